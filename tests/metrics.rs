//! Metrics on real Redis (docs/design.md §13.1), read from a global recorder (a `metrics_util`
//! registry of atomics) installed once in this test binary (members run on tokio tasks: a thread-local recorder
//! would not see them). The tests hold [`SERIAL`] and use groups of their own, so their series
//! never mix:
//!
//! - after entries with known outcomes (handled, dead-lettered by `NonRetryable`, undecodable,
//!   retried then handled, timed out then handled, panicked then handled, failing every
//!   attempt) every counter and every histogram count equals exactly what they imply; the
//!   shard's lag, pending count and oldest pending age, and the group's lag, go to 0 after the
//!   drain;
//! - retention counts the entries it trimmed from the shards it owns, and what a `force` trim
//!   removed before another group received them, under that group;
//! - every fence rejection is counted by op, once per `FenceRejected` event;
//! - while entries are unread, the group's lag (published by the owner of the lowest readable
//!   shard) is the sum of the shards' lags, and a pending entry of another consumer shows in the
//!   shard's pending count with a growing age.
//! - a batch listener counts handled, dead-lettered and retried entries one by one and times
//!   each batch attempt (docs/design.md §14.2).

mod support;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use metrics_util::registry::{Registry, Storage};
use metrics_util::storage::AtomicBucket;
use stream_listener::core::handler::{Delivery, HandlerError};
use stream_listener::core::internals::admin;
use stream_listener::core::internals::connection::{RedisConnection, RedisTarget};
use stream_listener::core::internals::dataplane::FencingMode;
use stream_listener::core::internals::keys::StreamKeys;
use stream_listener::core::internals::store::{Retention, RetentionMode};
use stream_listener::core::internals::telemetry::names;
use stream_listener::core::member::{
    EventCallback, Listener, ListenerEvent, ListenerHandle, ListenerOptions,
};
use stream_listener::core::model::StartFrom;
use stream_listener::testing::RedisServer;
use support::{connect, fast, wait_until};

/// One test at a time: they share the global recorder.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A series: its name and its labels, sorted.
type Series = (String, BTreeMap<String, String>);

/// A recorder keeping every series in a `metrics_util` registry of atomics, read without
/// resetting anything (a `DebuggingRecorder` snapshot swaps gauges to 0: a gauge read as 0 could
/// not tell "set to 0" from "not set since the last read").
struct Metrics {
    registry: Registry<Key, UnsetGauges>,
}

/// Atomic storage whose gauges start as NaN: a gauge registered but never set reads as unset.
struct UnsetGauges;

impl Storage<Key> for UnsetGauges {
    type Counter = Arc<AtomicU64>;
    type Gauge = Arc<AtomicU64>;
    type Histogram = Arc<AtomicBucket<f64>>;

    fn counter(&self, _: &Key) -> Self::Counter {
        Arc::default()
    }

    fn gauge(&self, _: &Key) -> Self::Gauge {
        Arc::new(AtomicU64::new(f64::NAN.to_bits()))
    }

    fn histogram(&self, _: &Key) -> Self::Histogram {
        Arc::new(AtomicBucket::new())
    }
}

/// What the recorder holds now (gauges never set left out).
#[derive(Default)]
struct Seen {
    counters: BTreeMap<Series, u64>,
    gauges: BTreeMap<Series, f64>,
    histograms: BTreeMap<Series, usize>,
}

struct Installed(Arc<Metrics>);

impl Recorder for Installed {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        self.0
            .registry
            .get_or_create_counter(key, |c| Counter::from_arc(c.clone()))
    }

    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        self.0
            .registry
            .get_or_create_gauge(key, |g| Gauge::from_arc(g.clone()))
    }

    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        self.0
            .registry
            .get_or_create_histogram(key, |h| Histogram::from_arc(h.clone()))
    }
}

static METRICS: LazyLock<Arc<Metrics>> = LazyLock::new(|| {
    let metrics = Arc::new(Metrics {
        registry: Registry::new(UnsetGauges),
    });
    metrics::set_global_recorder(Installed(metrics.clone()))
        .expect("the only recorder of this binary");
    metrics
});

fn series(key: &Key) -> Series {
    let labels = key
        .labels()
        .map(|l| (l.key().to_owned(), l.value().to_owned()))
        .collect();
    (key.name().to_owned(), labels)
}

impl Metrics {
    /// Every series' value now.
    fn refresh(&self) -> Seen {
        let mut seen = Seen::default();
        self.registry.visit_counters(|key, c| {
            seen.counters.insert(series(key), c.load(Ordering::SeqCst));
        });
        self.registry.visit_gauges(|key, g| {
            let value = f64::from_bits(g.load(Ordering::SeqCst));
            if !value.is_nan() {
                seen.gauges.insert(series(key), value);
            }
        });
        self.registry.visit_histograms(|key, h| {
            seen.histograms.insert(series(key), h.data().len());
        });
        seen
    }

    /// The sum of the counter `name` over the series whose labels include `labels`.
    fn counter(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        let seen = self.refresh();
        select(&seen.counters, name, labels).sum()
    }

    /// The values recorded into histogram `name` over the series matching `labels`.
    fn histogram_count(&self, name: &str, labels: &[(&str, &str)]) -> usize {
        let seen = self.refresh();
        select(&seen.histograms, name, labels).sum()
    }

    /// The gauge `name` of the one series matching `labels`, if set.
    fn gauge(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let seen = self.refresh();
        let values: Vec<f64> = select(&seen.gauges, name, labels).collect();
        assert!(values.len() <= 1, "{name} {labels:?}: {values:?}");
        values.first().copied()
    }
}

fn select<'a, V: Copy>(
    map: &'a BTreeMap<Series, V>,
    name: &'a str,
    labels: &'a [(&str, &str)],
) -> impl Iterator<Item = V> + 'a {
    map.iter()
        .filter(move |((n, l), _)| {
            n == name
                && labels
                    .iter()
                    .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|(_, v)| *v)
}

const STREAM: &str = "metered";

async fn server(shards: u32) -> (RedisServer, RedisTarget, RedisConnection) {
    let server = RedisServer::start().unwrap();
    let target = RedisTarget::standalone(server.url());
    let mut conn = connect(&target).await;
    admin::create_stream(&mut conn, STREAM, shards)
        .await
        .unwrap();
    (server, target, conn)
}

fn options(name: &str) -> ListenerOptions {
    let mut options = ListenerOptions::default();
    options.name = name.into();
    options.coordination = fast();
    options.block = Duration::from_millis(200);
    options.fencing = FencingMode::Strict;
    options.metrics_interval = Duration::from_millis(50);
    options.shutdown_timeout = Duration::from_millis(200);
    options
}

/// Appends an entry with `payload` to shard `shard` of [`STREAM`].
async fn xadd(conn: &mut RedisConnection, shard: u32, payload: &str) {
    let _: String = redis::cmd("XADD")
        .arg(format!("{{{STREAM}:{shard}}}"))
        .arg("*")
        .arg("key")
        .arg("k")
        .arg("payload")
        .arg(payload)
        .query_async(conn)
        .await
        .unwrap();
}

/// The `kind` of a `{"kind": K}` payload; `None` when it does not decode.
fn kind(delivery: &Delivery) -> Option<String> {
    let value: serde_json::Value = serde_json::from_slice(delivery.payload()?).ok()?;
    Some(value.get("kind")?.as_str()?.to_owned())
}

/// Fails as the payload's `kind` says, on the first attempt only except `fatal` and `always`.
async fn outcome_handler(delivery: Delivery) -> Result<(), HandlerError> {
    let Some(kind) = kind(&delivery) else {
        return Err(HandlerError::Decode("not {\"kind\": K}".into()));
    };
    let first = delivery.attempt == 1;
    match kind.as_str() {
        "fatal" => Err(HandlerError::non_retryable("fatal")),
        "always" => Err(HandlerError::retryable("always")),
        "flaky" if first => Err(HandlerError::retryable("flaky")),
        "slow" if first => {
            tokio::time::sleep(Duration::from_secs(30)).await;
            Ok(())
        }
        "panic" if first => panic!("a panicking handler (expected in this test)"),
        _ => Ok(()),
    }
}

async fn start(
    target: &RedisTarget,
    group: &str,
    options: ListenerOptions,
    handler: impl stream_listener::core::handler::Handler,
) -> ListenerHandle {
    Listener::new(target.clone(), STREAM, group, handler, options)
        .unwrap()
        .start()
        .await
        .unwrap()
}

/// Waits (up to 20 s) until `probe` returns `want`; asserts it did.
async fn wait_for<T: PartialEq + std::fmt::Debug>(what: &str, want: T, probe: impl Fn() -> T) {
    let reached = wait_until(Duration::from_secs(20), || probe() == want).await;
    if !reached {
        let last = probe();
        let seen = METRICS.refresh();
        panic!(
            "{what}: {last:?}, want {want:?}\ncounters {:#?}\ngauges {:#?}",
            seen.counters, seen.gauges
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_and_histograms_equal_the_known_outcomes_and_lag_goes_to_zero_after_a_drain() {
    let _serial = SERIAL.lock().await;
    let metrics = &*METRICS;
    let group = "outcomes";
    let (_server, target, mut conn) = server(1).await;
    let mut options = options("outcomes");
    options.max_attempts = 3;
    options.backoff = Duration::from_millis(10);
    options.handler_timeout = Duration::from_millis(300);
    for payload in [
        r#"{"kind":"ok"}"#,
        r#"{"kind":"fatal"}"#,
        r#"{"kind":"ok"}"#,
        "not json",
        r#"{"kind":"flaky"}"#,
        r#"{"kind":"ok"}"#,
        r#"{"kind":"slow"}"#,
        r#"{"kind":"fatal"}"#,
        r#"{"kind":"panic"}"#,
        r#"{"kind":"always"}"#,
        r#"{"kind":"ok"}"#,
        r#"{"kind":"ok"}"#,
    ] {
        xadd(&mut conn, 0, payload).await;
    }
    let handle = start(&target, group, options, outcome_handler).await;
    let member = handle.member_ids().remove(0);
    let of_member = [("group", group), ("member", member.as_str())];
    let labels = |extra: (&'static str, &'static str)| {
        let mut all = of_member.to_vec();
        all.push(extra);
        all
    };
    let handled = || metrics.counter(names::MESSAGES_HANDLED_TOTAL, &of_member);
    wait_for("entries finished", 12, handled).await;

    // ok ×5, flaky, slow and panic handled on their second attempt.
    assert_eq!(
        metrics.counter(names::MESSAGES_HANDLED_TOTAL, &labels(("outcome", "ok"))),
        8
    );
    // fatal ×2, the undecodable one, always (its third attempt).
    assert_eq!(
        metrics.counter(
            names::MESSAGES_HANDLED_TOTAL,
            &labels(("outcome", "dead_letter"))
        ),
        4
    );
    for (reason, count) in [("non-retryable", 2), ("decode", 1), ("handler", 1)] {
        assert_eq!(
            metrics.counter(names::DEAD_LETTERS_TOTAL, &labels(("reason", reason))),
            count,
            "{reason}"
        );
    }
    assert_eq!(metrics.counter(names::DEAD_LETTERS_TOTAL, &of_member), 4);
    // flaky, slow, panic once each; always twice.
    assert_eq!(metrics.counter(names::RETRIES_TOTAL, &of_member), 5);
    for (outcome, count) in [
        ("ok", 8),
        ("retry", 3),
        ("dead_letter", 3),
        ("decode_error", 1),
        ("timeout", 1),
        ("panic", 1),
    ] {
        assert_eq!(
            metrics.histogram_count(
                names::HANDLER_DURATION_SECONDS,
                &labels(("outcome", outcome))
            ),
            count,
            "{outcome}"
        );
    }
    assert_eq!(metrics.counter(names::ASSIGNMENTS_TOTAL, &of_member), 1);
    assert_eq!(
        metrics.gauge(names::OWNED_SHARDS, &of_member),
        Some(1.0),
        "owned shards"
    );
    let epoch = handle.status()[0].member_epoch;
    assert_eq!(
        metrics.gauge(names::MEMBER_EPOCH, &of_member),
        Some(epoch as f64)
    );
    assert_eq!(
        metrics.counter(names::FENCE_REJECTIONS_TOTAL, &of_member),
        0
    );
    assert!(metrics.counter(names::HEARTBEATS_TOTAL, &labels(("status", "OK"))) >= 1);

    // Drained: the shard's gauges and the group's lag are 0.
    let shard = [("group", group), ("shard", "0")];
    for name in [
        names::SHARD_LAG,
        names::SHARD_PENDING,
        names::SHARD_OLDEST_PENDING_AGE_SECONDS,
    ] {
        wait_for(name, Some(0.0), || metrics.gauge(name, &shard)).await;
    }
    wait_for(names::GROUP_LAG, Some(0.0), || {
        metrics.gauge(names::GROUP_LAG, &[("group", group)])
    })
    .await;
    handle.shutdown_and_wait().await.expect("clean shutdown");
    // Every heartbeat's round trip is timed once, whatever its status (the leave is not one).
    let heartbeats = metrics.counter(names::HEARTBEATS_TOTAL, &of_member);
    assert_eq!(
        metrics.histogram_count(names::HEARTBEAT_DURATION_SECONDS, &of_member),
        heartbeats as usize
    );
    assert_eq!(metrics.counter(names::REVOCATIONS_TOTAL, &of_member), 1);
}

/// Handles entries of shard 0; blocks (until cancelled) on every other shard's.
async fn blocking_handler(delivery: Delivery) -> Result<(), HandlerError> {
    if delivery.shard != 0 {
        std::future::pending::<()>().await;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_lag_is_the_sum_of_the_shards_lags_and_pending_entries_age() {
    let _serial = SERIAL.lock().await;
    let metrics = &*METRICS;
    let group = "lagging";
    let (_server, target, mut conn) = server(3).await;
    let mut options = options("lagging");
    options.batch_size = 1;
    options.runtime_max_concurrency = 3;
    options.handler_timeout = Duration::from_secs(60);
    for shard in 0..3 {
        for _ in 0..4 {
            xadd(&mut conn, shard, r#"{"kind":"ok"}"#).await;
        }
    }
    let handle = start(&target, group, options, blocking_handler).await;
    // Shards 1 and 2 read one entry each (batch 1) and block in its handler: 3 unread each.
    // Shard 0 drains. Its owner publishes the group's lag: 0 + 3 + 3.
    wait_for(names::GROUP_LAG, Some(6.0), || {
        metrics.gauge(names::GROUP_LAG, &[("group", group)])
    })
    .await;
    let shard0 = [("group", group), ("shard", "0")];
    wait_for("shard 0 lag", Some(0.0), || {
        metrics.gauge(names::SHARD_LAG, &shard0)
    })
    .await;

    // An entry delivered to another consumer of the group stays pending on shard 0: the
    // sampler counts it and its age grows. (One transaction: the listener cannot read it first.)
    let key = format!("{{{STREAM}:0}}");
    let _: redis::Value = redis::pipe()
        .atomic()
        .cmd("XADD")
        .arg(&key)
        .arg("*")
        .arg("payload")
        .arg("{}")
        .cmd("XREADGROUP")
        .arg("GROUP")
        .arg(group)
        .arg("ghost")
        .arg("COUNT")
        .arg(1)
        .arg("STREAMS")
        .arg(&key)
        .arg(">")
        .query_async(&mut conn)
        .await
        .unwrap();
    wait_for("shard 0 pending", Some(1.0), || {
        metrics.gauge(names::SHARD_PENDING, &shard0)
    })
    .await;
    let aged = wait_until(Duration::from_secs(20), || {
        metrics
            .gauge(names::SHARD_OLDEST_PENDING_AGE_SECONDS, &shard0)
            .is_some_and(|age| age >= 0.3)
    })
    .await;
    assert!(aged, "oldest pending age stays below 0.3 s");
    assert_eq!(metrics.gauge(names::SHARD_LAG, &shard0), Some(0.0));
    assert_eq!(
        metrics.gauge(names::GROUP_LAG, &[("group", group)]),
        Some(6.0)
    );
    assert_eq!(
        metrics.counter(names::ASSIGNMENTS_TOTAL, &[("group", group)]),
        3
    );
    // The handlers of shards 1 and 2 block on purpose: the shutdown cancels them and says so.
    let cancelled = handle.shutdown_and_wait().await.unwrap_err();
    let shards: Vec<u32> = cancelled
        .problems()
        .iter()
        .map(|problem| match problem {
            stream_listener::ShutdownError::HandlerCancelled { shard, .. } => *shard,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(shards, [1, 2]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_counts_what_it_trimmed_and_what_a_force_trim_cost_another_group() {
    let _serial = SERIAL.lock().await;
    let metrics = &*METRICS;
    let group = "trimming";
    let (_server, target, mut conn) = server(1).await;
    // A group that never reads: a force trim removes entries it has not received.
    admin::register_group(&mut conn, STREAM, "laggard", StartFrom::Earliest)
        .await
        .unwrap();
    let mut options = options("trimming");
    options.retention_interval = Duration::from_millis(100);
    for _ in 0..10 {
        xadd(&mut conn, 0, r#"{"kind":"ok"}"#).await;
    }
    let handle = start(&target, group, options, outcome_handler).await;
    let of_group = [("group", group)];
    wait_for("entries handled", 10, || {
        metrics.counter(names::MESSAGES_HANDLED_TOTAL, &of_group)
    })
    .await;
    // Handled and acked (the lag gauge 0 comes from a sample after the ack) before the trim.
    wait_for("shard lag", Some(0.0), || {
        metrics.gauge(names::SHARD_LAG, &[("group", group), ("shard", "0")])
    })
    .await;
    let mut retention = Retention::new(RetentionMode::Force);
    retention.max_len = Some(2);
    admin::set_stream_retention(&mut conn, STREAM, Some(retention))
        .await
        .unwrap();
    wait_for("trimmed", 8, || {
        metrics.counter(names::RETENTION_TRIMMED_TOTAL, &of_group)
    })
    .await;
    assert_eq!(
        metrics.counter(names::RETENTION_LOST_TOTAL, &[("group", "laggard")]),
        8
    );
    assert_eq!(metrics.counter(names::RETENTION_LOST_TOTAL, &of_group), 0);
    handle.shutdown_and_wait().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_fence_rejection_is_counted_by_op() {
    let _serial = SERIAL.lock().await;
    let metrics = &*METRICS;
    let group = "fenced-out";
    let (_server, target, mut conn) = server(1).await;
    // Not a fencing token: the raise is refused (and tried again after a lease TTL).
    let fence = StreamKeys::new(STREAM).unwrap().fence(0);
    let _: u64 = redis::cmd("HSET")
        .arg(&fence)
        .arg(group)
        .arg("not-a-token")
        .query_async(&mut conn)
        .await
        .unwrap();
    xadd(&mut conn, 0, r#"{"kind":"ok"}"#).await;
    let events = Arc::new(AtomicU64::new(0));
    let mut options = options("fenced-out");
    let seen = events.clone();
    options.events = Some(EventCallback(Arc::new(move |event| {
        if let ListenerEvent::FenceRejected { op: "read", .. } = event {
            seen.fetch_add(1, Ordering::SeqCst);
        }
    })));
    let handle = start(&target, group, options, outcome_handler).await;
    let of_group = [("group", group)];
    let rejected = wait_until(Duration::from_secs(20), || {
        metrics.counter(
            names::FENCE_REJECTIONS_TOTAL,
            &[("group", group), ("op", "read")],
        ) >= 2
    })
    .await;
    assert!(rejected, "the raise was not refused twice");
    handle.shutdown_and_wait().await.expect("clean shutdown");
    assert_eq!(
        metrics.counter(names::FENCE_REJECTIONS_TOTAL, &of_group),
        events.load(Ordering::SeqCst),
        "one count per FenceRejected event"
    );
    assert_eq!(metrics.counter(names::MESSAGES_HANDLED_TOTAL, &of_group), 0);
}

/// A failing `on_assigned` hook (an error on two shards) and a panicking `on_revoked` (on
/// shutdown, the same two shards) are counted once per call, by hook; the member goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_hook_failure_is_counted_by_hook() {
    let _serial = SERIAL.lock().await;
    let metrics = &*METRICS;
    let group = "hooked";
    let (_server, target, mut conn) = server(2).await;
    let mut options = options("hooked");
    options
        .hooks
        .on_assigned(
            |_cx: stream_listener::core::hooks::ShardHookContext| async {
                Err::<(), _>("the side store is down")
            },
        )
        .on_revoked(
            |_cx: stream_listener::core::hooks::ShardHookContext| async move {
                if true {
                    panic!("a panicking hook (expected in this test)");
                }
                Ok::<(), String>(())
            },
        );
    let handle = start(&target, group, options, outcome_handler).await;
    xadd(&mut conn, 0, r#"{"kind":"ok"}"#).await;
    xadd(&mut conn, 1, r#"{"kind":"ok"}"#).await;
    let of_group = [("group", group)];
    wait_for("both entries handled despite the hooks", 2, || {
        metrics.counter(names::MESSAGES_HANDLED_TOTAL, &of_group)
    })
    .await;
    let hook = |hook| {
        metrics.counter(
            names::HOOK_FAILURES_TOTAL,
            &[("group", group), ("hook", hook)],
        )
    };
    assert_eq!(hook("on_assigned"), 2);
    assert_eq!(hook("on_revoked"), 0);
    handle.shutdown_and_wait().await.expect("clean shutdown");
    assert_eq!(hook("on_revoked"), 2);
    assert_eq!(hook("on_lost"), 0);
}

/// A sampling or trimming interval longer than the protocol's longest timing (a day) is refused
/// by `Listener::new`, naming it, as `block` or `shutdown_timeout` are; a day is accepted and the
/// shard works as with any other interval. Before the fix, `Duration::MAX` was accepted and the
/// first sample (and the trim schedule at the task's start) panicked with "overflow when adding
/// duration to instant": the shard task died and no entry was handled. The schedules add their
/// interval without overflow now as well (`runtime::later_by`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interval_too_long_for_the_clock_does_not_stop_the_shard() {
    use stream_listener::core::member::{ListenerError, OptionsError};
    let _serial = SERIAL.lock().await;
    let metrics = &*METRICS;
    let group = "forever";
    let (_server, target, mut conn) = server(1).await;
    let day = Duration::from_secs(24 * 60 * 60);
    for name in ["metrics_interval", "retention_interval"] {
        let mut options = options("forever");
        match name {
            "metrics_interval" => options.metrics_interval = Duration::MAX,
            _ => options.retention_interval = Duration::MAX,
        }
        let refused = Listener::new(target.clone(), STREAM, group, outcome_handler, options);
        match refused {
            Err(ListenerError::Options(OptionsError::TooLong { name: refused, max })) => {
                assert_eq!((refused, max), (name, day));
            }
            other => panic!("{name} = Duration::MAX: {other:?}"),
        }
    }
    let mut options = options("forever");
    options.metrics_interval = day;
    options.retention_interval = day;
    let handle = start(&target, group, options, outcome_handler).await;
    for _ in 0..3 {
        xadd(&mut conn, 0, r#"{"kind":"ok"}"#).await;
    }
    let of_group = [("group", group), ("outcome", "ok")];
    wait_for("every entry handled", 3, || {
        metrics.counter(names::MESSAGES_HANDLED_TOTAL, &of_group)
    })
    .await;
    let handled = || handle.status().iter().map(|s| s.handled).sum::<u64>();
    wait_for("every entry acked", 3, handled).await;
    handle.shutdown_and_wait().await.expect("clean shutdown");
}

/// A batch listener (docs/design.md §14.2) counts handled, dead-lettered and retried entries one
/// by one, and times each batch attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_listener_counts_entries_one_by_one_and_times_each_batch_attempt() {
    use stream_listener::core::batch::{Batch, BatchError};
    use stream_listener::core::extract::Json;
    let _serial = SERIAL.lock().await;
    let metrics = &*METRICS;
    let group = "batches";
    let (_server, target, mut conn) = server(1).await;
    let mut options = options("batches");
    options.max_attempts = 3;
    options.backoff = Duration::from_millis(10);
    for payload in [
        r#"{"kind":"ok"}"#,
        r#"{"kind":"ok"}"#,
        "not json",
        r#"{"kind":"flaky"}"#,
        r#"{"kind":"ok"}"#,
    ] {
        xadd(&mut conn, 0, payload).await;
    }
    // The flaky entry fails its first attempt: the two before it are handled, it and the one
    // after it retried once.
    let handler = |batch: Batch<Json<serde_json::Value>>| {
        let flaky = batch
            .entries()
            .position(|(Json(value), meta)| value["kind"] == "flaky" && meta.attempt == 1);
        async move {
            match flaky {
                Some(i) => Err(BatchError::at(i, "flaky")),
                None => Ok(()),
            }
        }
    };
    let handle = Listener::new_batch(target.clone(), STREAM, group, handler, options)
        .unwrap()
        .start()
        .await
        .unwrap();
    let member = handle.member_ids().remove(0);
    let of_member = [("group", group), ("member", member.as_str())];
    let labels = |extra: (&'static str, &'static str)| {
        let mut all = of_member.to_vec();
        all.push(extra);
        all
    };
    let handled = || metrics.counter(names::MESSAGES_HANDLED_TOTAL, &of_member);
    wait_for("entries finished", 5, handled).await;
    assert_eq!(
        metrics.counter(names::MESSAGES_HANDLED_TOTAL, &labels(("outcome", "ok"))),
        4
    );
    assert_eq!(
        metrics.counter(names::DEAD_LETTERS_TOTAL, &labels(("reason", "decode"))),
        1
    );
    assert_eq!(metrics.counter(names::RETRIES_TOTAL, &of_member), 2);
    for (outcome, count) in [("ok", 1), ("retry", 1), ("decode_error", 0)] {
        assert_eq!(
            metrics.histogram_count(
                names::HANDLER_DURATION_SECONDS,
                &labels(("outcome", outcome))
            ),
            count,
            "{outcome}"
        );
    }
    handle.shutdown_and_wait().await.expect("clean shutdown");
}
