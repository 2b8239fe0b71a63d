//! Metrics (docs/design.md §13.1): what the member, its shard tasks and the retention pass
//! record through the `metrics` facade, and the per-shard lag/pending sampler.
//!
//! With the cargo feature `metrics` off, [`MemberMetrics`], [`ShardMetrics`] and [`Stopwatch`]
//! are empty types whose methods are empty inline functions: the call sites carry no `cfg`, and
//! nothing is recorded, no clock read and no Redis call is made for metrics. With it on, every
//! label set is resolved once (a member's handles when its listener starts, a shard's when its
//! task starts) and the hot path only bumps atomics of the installed recorder. Handles are
//! resolved against the recorder installed at that time: install one before starting listeners.

pub mod names;

#[cfg(feature = "metrics")]
mod on;
#[cfg(feature = "metrics")]
mod sampler;
#[cfg(feature = "metrics")]
pub(crate) use on::{MemberMetrics, ShardMetrics, Stopwatch};

#[cfg(not(feature = "metrics"))]
mod off;
#[cfg(not(feature = "metrics"))]
pub(crate) use off::{MemberMetrics, ShardMetrics, Stopwatch};

use crate::model::HeartbeatStatus;

/// The `outcome` label of one handler attempt
/// ([`names::HANDLER_DURATION_SECONDS`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HandlerOutcome {
    /// The handler returned `Ok`.
    Ok,
    /// A retryable error: tried again (in place, or by the shard's next owner after a drain).
    Retry,
    /// A non-retryable error, or the last attempt failed: dead-lettered.
    DeadLetter,
    /// The extractor refused the payload: dead-lettered.
    DecodeError,
    /// The attempt ran past `handler_timeout`.
    Timeout,
    /// The handler panicked.
    Panic,
    /// The handler asked to pause its shard (`HandlerError::pause_shard`): tried again after the
    /// pause, not a failure.
    Pause,
}

impl HandlerOutcome {
    /// Every outcome, in [`Self::index`] order.
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    const ALL: [HandlerOutcome; 7] = [
        HandlerOutcome::Ok,
        HandlerOutcome::Retry,
        HandlerOutcome::DeadLetter,
        HandlerOutcome::DecodeError,
        HandlerOutcome::Timeout,
        HandlerOutcome::Panic,
        HandlerOutcome::Pause,
    ];

    /// The label value.
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            HandlerOutcome::Ok => "ok",
            HandlerOutcome::Retry => "retry",
            HandlerOutcome::DeadLetter => "dead_letter",
            HandlerOutcome::DecodeError => "decode_error",
            HandlerOutcome::Timeout => "timeout",
            HandlerOutcome::Panic => "panic",
            HandlerOutcome::Pause => "pause",
        }
    }

    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    fn index(self) -> usize {
        self as usize
    }
}

/// The `status` label of a heartbeat response: the protocol's name of it.
#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
pub(crate) fn heartbeat_status(status: HeartbeatStatus) -> &'static str {
    match status {
        HeartbeatStatus::Ok => "OK",
        HeartbeatStatus::SyncMetadata => "SYNC_METADATA",
        HeartbeatStatus::RevokePending => "REVOKE_PENDING",
        HeartbeatStatus::Retry => "RETRY",
        HeartbeatStatus::UnknownMemberId => "UNKNOWN_MEMBER_ID",
        HeartbeatStatus::FencedMemberEpoch => "FENCED_MEMBER_EPOCH",
        HeartbeatStatus::FencedInstanceId => "FENCED_INSTANCE_ID",
    }
}

/// The `kind` label of a failure: of the first [`redis::RedisError`] in `error`'s source chain
/// (`io`, `timeout`, `cluster`, `script`, `oom`, `response`, `other`), `timeout` for a
/// [`crate::store::StoreError::Timeout`]; `None` when no Redis error caused it (a corrupt
/// metadata value, a missing group: not a Redis failure).
#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
pub(crate) fn redis_error_kind(error: &(dyn std::error::Error + 'static)) -> Option<&'static str> {
    let mut next = Some(error);
    while let Some(current) = next {
        if let Some(redis) = current.downcast_ref::<redis::RedisError>() {
            return Some(classify(redis));
        }
        if let Some(crate::store::StoreError::Timeout(_)) =
            current.downcast_ref::<crate::store::StoreError>()
        {
            return Some("timeout");
        }
        next = current.source();
    }
    None
}

// Only the recording types use the labels (the feature on).
#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
fn classify(error: &redis::RedisError) -> &'static str {
    use redis::ErrorKind;
    if error.is_timeout() {
        return "timeout";
    }
    if error.is_io_error() || error.is_connection_dropped() || error.is_connection_refusal() {
        return "io";
    }
    if error.is_cluster_error() || error.kind() == ErrorKind::ClusterConnectionNotFound {
        return "cluster";
    }
    match error.code() {
        Some("OOM") => return "oom",
        Some("NOSCRIPT" | "BUSY") => return "script",
        _ => {}
    }
    if error
        .detail()
        .is_some_and(|detail| detail.contains("script"))
    {
        return "script";
    }
    match error.kind() {
        // The server answered with an error (`Extension`: a code redis-rs does not name, such as
        // `WRONGTYPE`), or an answer of the wrong shape.
        ErrorKind::Server(_)
        | ErrorKind::Extension
        | ErrorKind::Parse
        | ErrorKind::UnexpectedReturnType => "response",
        _ => "other",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every name has exactly one description, in [`names::ALL`]'s order, and its kind matches
    /// the naming convention (`_total` counters, `_seconds` histograms but for the age gauge).
    #[test]
    fn every_name_has_one_description_of_its_kind() {
        let described: Vec<&str> = names::DESCRIPTIONS.iter().map(|d| d.0).collect();
        assert_eq!(described, names::ALL);
        for &(name, kind, description) in names::DESCRIPTIONS {
            let expected = if name.ends_with("_total") {
                names::MetricKind::Counter
            } else if name.ends_with("_duration_seconds") {
                names::MetricKind::Histogram
            } else {
                names::MetricKind::Gauge
            };
            assert_eq!(kind, expected, "{name}");
            assert!(description.ends_with('.'), "{name}: {description}");
        }
    }

    #[test]
    fn outcomes_are_indexed_in_order() {
        for (i, outcome) in HandlerOutcome::ALL.iter().enumerate() {
            assert_eq!(outcome.index(), i);
        }
        assert_eq!(HandlerOutcome::DecodeError.as_str(), "decode_error");
    }

    #[test]
    fn heartbeat_statuses_are_the_protocol_names() {
        for status in [
            HeartbeatStatus::Ok,
            HeartbeatStatus::SyncMetadata,
            HeartbeatStatus::RevokePending,
            HeartbeatStatus::Retry,
            HeartbeatStatus::UnknownMemberId,
            HeartbeatStatus::FencedMemberEpoch,
            HeartbeatStatus::FencedInstanceId,
        ] {
            let json = serde_json::to_string(&status).unwrap();
            assert_eq!(json, format!("\"{}\"", heartbeat_status(status)));
        }
    }

    #[test]
    fn redis_errors_are_classified_through_the_source_chain() {
        let io = redis::RedisError::from(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "reset",
        ));
        let store = crate::store::StoreError::Redis(io);
        assert_eq!(redis_error_kind(&store), Some("io"));
        let timeout = crate::store::StoreError::Timeout(std::time::Duration::from_secs(1));
        assert_eq!(redis_error_kind(&timeout), Some("timeout"));
        let name = crate::keys::StreamKeys::new("bad prefix{").unwrap_err();
        assert_eq!(redis_error_kind(&name), None);
    }

    /// The kinds of errors a real server returns.
    #[cfg(feature = "testing")]
    #[tokio::test]
    async fn real_server_errors_are_classified() {
        use crate::connection::{RedisConnection, RedisTarget};
        let server = crate::testing::RedisServer::start().unwrap();
        let target = RedisTarget::standalone(server.url());
        let mut conn = RedisConnection::connect(&target, std::time::Duration::from_secs(5))
            .await
            .unwrap();
        let kind = |result: redis::RedisResult<redis::Value>| {
            redis_error_kind(&result.unwrap_err()).unwrap()
        };
        let no_script = redis::cmd("EVALSHA")
            .arg("0000000000000000000000000000000000000000")
            .arg(0)
            .query_async(&mut conn)
            .await;
        assert_eq!(kind(no_script), "script");
        let failing = redis::cmd("EVAL")
            .arg("return redis.error_reply('ERR boom')")
            .arg(0)
            .query_async(&mut conn)
            .await;
        assert_eq!(kind(failing), "response");
        let _: () = redis::cmd("SET")
            .arg("s")
            .arg("v")
            .query_async(&mut conn)
            .await
            .unwrap();
        let wrong_type = redis::cmd("XLEN").arg("s").query_async(&mut conn).await;
        assert_eq!(kind(wrong_type), "response");
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory")
            .arg(1)
            .query_async(&mut conn)
            .await
            .unwrap();
        let oom = redis::cmd("SET")
            .arg("k")
            .arg("v")
            .query_async(&mut conn)
            .await;
        assert_eq!(kind(oom), "oom");
    }
}
