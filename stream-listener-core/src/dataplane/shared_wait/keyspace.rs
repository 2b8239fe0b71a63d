//! The shared wait's driver on Redis Cluster: keyspace notifications (docs/design.md §8.4).
//!
//! One `XREAD` covers one hash slot, and every shard is its own slot, so a blocking read cannot
//! cover a member's shards there. Instead the driver subscribes, on every master, to the keyspace
//! channel `__keyspace@0__:<key>` of each shard registered with the member's wait (the shards it
//! owns): Redis publishes an `xadd` event on the channel of the key an entry was added to, on the
//! node that holds it, when the server's `notify-keyspace-events` has `K` (keyspace channels)
//! and `t` (stream commands) or `A`. The event wakes the shard's task, which reads.
//!
//! - **Only the owner hears a shard, and only while it waits.** Each event goes to the one member
//!   that owns its shard. An event that finds the shard's task reading or handling marks the
//!   shard busy ([`super::Inner::wake_on_event`]): its channel is unsubscribed until the task
//!   waits again, so a busy shard's entries do not each send an event; the task's next wait
//!   subscribes it again and reads once.
//!   A pattern over the prefix (`PSUBSCRIBE __keyspace@0__:{<prefix>:*}`, as before) sent every
//!   entry to every member of every group of the stream: on a busy stream the members drowned
//!   in events (BENCHMARKS.md item 2), and a 1,000-member group would get 1,000 events per entry.
//!   The channels follow the registrations (a shard task starts, a revoked one stops); the
//!   driver subscribes on every master, so a slot that moves between masters needs nothing.
//! - **Nothing missed at the start.** A shard reads once after its channel's subscription is
//!   confirmed on every master ([`super::Inner::subscribed`]): its last read may have come
//!   before it. After that, an entry added after a task's read is published after it, so the
//!   task sees either the entry in its read or the event.
//! - **A subscription that ends** (on any one master: each master's events end with a marker)
//!   means subscribing again on every master; the waiting tasks keep waiting, and the new
//!   subscriptions wake them to read once. Every [`TOPOLOGY_CHECK`] the driver compares the masters
//!   with `CLUSTER SLOTS` (a failover, a new node: subscribe again) and counts each master's
//!   `CONFIG SET` calls (`INFO commandstats`): when they changed, `notify-keyspace-events` may
//!   have been off for a moment, long enough to miss an entry's event, and the driver subscribes
//!   again, which reads its configuration and makes every waiting shard read once. Reading only
//!   the configuration would miss a change turned off and on again between two checks. The
//!   check runs beside the events: a master that does not answer it holds nothing up.
//! - **Off, refused or failing: wait another way.** When a server does not publish the events,
//!   the user may not read its configuration or subscribe, or subscribing fails, the wait is
//!   unavailable: the waiting tasks wait on connections of their own, from their last id (which
//!   covers an event lost meanwhile), until the driver, trying again after a pause, is back.
//! - **Cost.** One connection per master per member; nothing per idle shard but its channel.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::future::{FusedFuture, FutureExt};
use redis::Value;
use redis::aio::PubSubSink;

use super::{ERROR_PAUSE, Inner, sleep_until};

/// How often the driver compares the cluster's masters with those it subscribed on, and their
/// `CONFIG SET` calls with those counted when it subscribed.
pub(super) const TOPOLOGY_CHECK: Duration = Duration::from_secs(5);

/// How long the driver waits before checking again when the events are off on the servers.
const OFF_PAUSE: Duration = Duration::from_secs(30);

/// The longest one step of subscribing may take on one master (the masters, a master's
/// configuration, a connect, a channel change). The driver waits for it, events of every master
/// and its waits' deadlines included, so a master that stops answering (paused, cut off) must
/// not hold the member's other shards for longer: past it the subscriptions count as down, and
/// the shards wait on connections of their own.
const CHANNEL_CHANGE_TIMEOUT: Duration = Duration::from_secs(1);

/// Why the notifications cannot be used now.
#[derive(Debug, thiserror::Error)]
enum Unavailable {
    /// Redis failed or refused (a node down, no permission to subscribe or to read the config).
    #[error("{0}")]
    Redis(#[from] redis::RedisError),
    /// A master did not answer a step of subscribing within [`CHANNEL_CHANGE_TIMEOUT`].
    #[error("a master did not answer a subscription step within {CHANNEL_CHANGE_TIMEOUT:?}")]
    NoAnswer,
    /// A master's `notify-keyspace-events` lacks `K` or `t`.
    #[error(
        "master {node} has notify-keyspace-events {flags:?}, without K and t: set `notify-keyspace-events Kt` (or add K and t to what is there) to let a member wait on all its shards with one connection per master"
    )]
    Off {
        /// `host:port`.
        node: String,
        /// The flags it has.
        flags: String,
    },
    /// The masters changed, a subscription ended, or a master's configuration may have changed.
    #[error("the cluster's masters, a subscription or a master's configuration changed")]
    Changed,
}

/// The driver: subscribes on every master to the channels of the registered shards, wakes the
/// shards the events name, subscribes again after a failure or a change of masters. Returns when
/// the shared wait is dropped.
pub(super) async fn drive(inner: Arc<Inner>) {
    // One warning per stretch without notifications, not one per attempt.
    let mut warned = false;
    loop {
        let outcome = match subscribe_all(&inner).await {
            Ok(subscribed) => {
                if warned {
                    tracing::info!(
                        "keyspace notifications are back: idle shards share the member's wait again"
                    );
                }
                warned = false;
                tracing::debug!(
                    masters = subscribed.masters.len(),
                    shards = subscribed.keys.len(),
                    "waiting on keyspace notifications"
                );
                // On a change the waiting tasks keep waiting: subscribing again takes
                // milliseconds, and the new subscriptions wake them. Only a failed attempt
                // below sends them to connections of their own.
                listen(&inner, subscribed).await
            }
            Err(error) => Some(error),
        };
        let Some(error) = outcome else { return };
        if !matches!(error, Unavailable::Changed) {
            inner.set_available(false);
        }
        let pause = match &error {
            Unavailable::Changed => Duration::ZERO,
            Unavailable::Off { .. } => OFF_PAUSE,
            Unavailable::Redis(error) if is_refusal(error) => OFF_PAUSE,
            Unavailable::Redis(_) | Unavailable::NoAnswer => ERROR_PAUSE,
        };
        if !warned && !matches!(error, Unavailable::Changed) {
            tracing::warn!(error = %error, "keyspace notifications are unavailable: each idle shard waits on a connection of its own until they are back");
            warned = true;
        }
        tokio::select! {
            () = tokio::time::sleep(pause) => {}
            () = inner.stop.cancelled() => return,
        }
    }
}

/// Every master's events, merged; an item `None` when one master's subscription ended.
type Events = futures_util::stream::BoxStream<'static, Option<redis::Msg>>;

/// What [`subscribe_all`] set up: the masters, a sink per master to change the channels, their
/// merged events, and the shard keys whose channels are subscribed on every master.
struct Subscribed {
    /// The masters subscribed on.
    masters: ConfigSets,
    sinks: Vec<PubSubSink>,
    events: Events,
    keys: BTreeSet<String>,
    /// [`Inner::registry_version`] the channels were last brought in line with.
    version: u64,
}

/// Each master (`(host, port)`) with its `CONFIG SET` calls (`INFO commandstats`) when its
/// `notify-keyspace-events` was read; `None` where `INFO` did not answer (the periodic check then
/// reads the configuration itself).
type ConfigSets = BTreeMap<(String, u16), Option<u64>>;

/// `step` on one master, given up after [`CHANNEL_CHANGE_TIMEOUT`].
async fn bounded<T>(
    step: impl std::future::Future<Output = redis::RedisResult<T>>,
) -> Result<T, Unavailable> {
    bounded_answer(async { Ok(step.await?) }).await
}

/// The keyspace channel of shard stream `key` (database 0: a cluster has no other). `SUBSCRIBE`
/// takes it literally: a prefix's glob characters need no escaping.
fn channel_of(key: &str) -> String {
    format!("__keyspace@0__:{key}")
}

/// Checks every master's `notify-keyspace-events`, connects a subscription to each, and
/// subscribes the registered shards' channels.
async fn subscribe_all(inner: &Inner) -> Result<Subscribed, Unavailable> {
    use futures_util::StreamExt as _;
    // Until every channel is subscribed again, no shard counts as subscribed: a task that
    // waits meanwhile waits for the subscription, which then wakes it to read once.
    inner.unsubscribed_all();
    let found = bounded_answer(masters(inner)).await?;
    let mut sinks = Vec::with_capacity(found.len());
    let mut streams = Vec::with_capacity(found.len());
    let mut masters = ConfigSets::new();
    for (host, port) in &found {
        // Counted before the configuration is read: a change after the read shows as a count
        // that moved.
        let sets = bounded_answer(config_sets_on(inner, host, *port))
            .await
            .ok();
        masters.insert((host.clone(), *port), sets);
        bounded_answer(check_events_on(inner, host, *port)).await?;
        let client = inner.target.cluster_node_client(host, *port)?;
        let (sink, stream) = bounded(client.get_async_pubsub()).await?.split();
        sinks.push(sink);
        // The end of one master's subscription must show: merged streams end only when all do.
        let events = stream
            .map(Some)
            .chain(futures_util::stream::once(async { None }));
        streams.push(events.boxed());
    }
    inner.set_available(true);
    let mut subscribed = Subscribed {
        masters,
        sinks,
        events: futures_util::stream::select_all(streams).boxed(),
        keys: BTreeSet::new(),
        version: 0,
    };
    subscribed.follow_registrations(inner).await?;
    Ok(subscribed)
}

impl Subscribed {
    /// Brings the subscribed channels in line with the listening shards (registered, not busy),
    /// on every master: unsubscribes those of shards that left or turned busy, subscribes those
    /// of new ones and of shards caught up again, which then read once (an entry may have come
    /// between their last read and the subscription).
    async fn follow_registrations(&mut self, inner: &Inner) -> Result<(), Unavailable> {
        let Some((version, registered)) = inner.listening_keys(self.version) else {
            return Ok(());
        };
        let left: Vec<String> = self.keys.difference(&registered).cloned().collect();
        let new: Vec<String> = registered.difference(&self.keys).cloned().collect();
        if !left.is_empty() {
            inner.unsubscribed(&left);
            let channels: Vec<String> = left.iter().map(|k| channel_of(k)).collect();
            for sink in &mut self.sinks {
                bounded(sink.unsubscribe(&channels)).await?;
            }
            for key in &left {
                self.keys.remove(key);
            }
        }
        if !new.is_empty() {
            let channels: Vec<String> = new.iter().map(|k| channel_of(k)).collect();
            for sink in &mut self.sinks {
                bounded(sink.subscribe(&channels)).await?;
            }
            self.keys.extend(new.iter().cloned());
            inner.subscribed(&new);
        }
        self.version = version;
        Ok(())
    }
}

/// `step`, given up after [`CHANNEL_CHANGE_TIMEOUT`] ([`bounded`] for steps that fail with
/// [`Unavailable`]).
async fn bounded_answer<T>(
    step: impl std::future::Future<Output = Result<T, Unavailable>>,
) -> Result<T, Unavailable> {
    tokio::time::timeout(CHANNEL_CHANGE_TIMEOUT, step)
        .await
        .unwrap_or(Err(Unavailable::NoAnswer))
}

/// `cmd` on the master at `host:port`, through the member's control connection routed to that
/// node (no connection of its own).
async fn on_master(
    inner: &Inner,
    host: &str,
    port: u16,
    cmd: redis::Cmd,
) -> Result<Value, Unavailable> {
    use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
    let crate::connection::RedisConnection::Cluster(conn, _) = &inner.control else {
        return Err(Unavailable::Redis(redis::RedisError::from((
            redis::ErrorKind::InvalidClientConfig,
            "keyspace notifications wait on a cluster connection",
        ))));
    };
    let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
        host: host.to_owned(),
        port,
    });
    Ok(conn.clone().route_command(cmd, routing).await?)
}

/// How many `CONFIG SET` calls the master at `host:port` has served (`INFO commandstats`; 0
/// before the first, or after `CONFIG RESETSTAT`).
async fn config_sets_on(inner: &Inner, host: &str, port: u16) -> Result<u64, Unavailable> {
    let mut cmd = redis::cmd("INFO");
    cmd.arg("commandstats");
    let reply = on_master(inner, host, port, cmd).await?;
    let info: String =
        redis::from_redis_value(reply).map_err(|error| Unavailable::Redis(error.into()))?;
    Ok(config_set_calls(&info))
}

/// The `calls` of `cmdstat_config|set` in an `INFO commandstats` reply; 0 when absent.
fn config_set_calls(info: &str) -> u64 {
    info.lines()
        .find_map(|line| line.strip_prefix("cmdstat_config|set:"))
        .and_then(|stats| {
            stats
                .split(',')
                .find_map(|stat| stat.strip_prefix("calls="))
        })
        .and_then(|calls| calls.trim().parse().ok())
        .unwrap_or(0)
}

/// `Off` unless the master at `host:port` publishes stream events on keyspace channels.
async fn check_events_on(inner: &Inner, host: &str, port: u16) -> Result<(), Unavailable> {
    let mut cmd = redis::cmd("CONFIG");
    cmd.arg("GET").arg("notify-keyspace-events");
    let reply = on_master(inner, host, port, cmd).await?;
    let (_, flags): (String, String) =
        redis::from_redis_value(reply).map_err(|error| Unavailable::Redis(error.into()))?;
    if publishes_stream_keyspace_events(&flags) {
        Ok(())
    } else {
        Err(Unavailable::Off {
            node: format!("{host}:{port}"),
            flags,
        })
    }
}

/// Whether Redis refused for good (no permission to read the configuration or to subscribe):
/// asking again soon would only fill the ACL log.
fn is_refusal(error: &redis::RedisError) -> bool {
    matches!(
        crate::connection::RedisFailure::of(error),
        crate::connection::RedisFailure::NoPermission
    )
}

/// Whether `notify-keyspace-events` flags publish `xadd` on keyspace channels: `K`, and `t` or
/// the `A` alias.
fn publishes_stream_keyspace_events(flags: &str) -> bool {
    flags.contains('K') && (flags.contains('t') || flags.contains('A'))
}

/// The cluster's masters (`CLUSTER SLOTS`), as `(host, port)`.
async fn masters(inner: &Inner) -> Result<BTreeSet<(String, u16)>, Unavailable> {
    let mut conn = inner.control.clone();
    let slots: Value = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async(&mut conn)
        .await?;
    Ok(masters_of(&slots))
}

/// The masters of a `CLUSTER SLOTS` reply: each range's third element is its master
/// `[host, port, id, …]`.
fn masters_of(slots: &Value) -> BTreeSet<(String, u16)> {
    let Value::Array(ranges) = slots else {
        return BTreeSet::new();
    };
    ranges
        .iter()
        .filter_map(|range| match range {
            Value::Array(fields) => match fields.get(2) {
                Some(Value::Array(master)) => {
                    let host: String = redis::from_redis_value(master.first()?.clone()).ok()?;
                    let port: u16 = redis::from_redis_value(master.get(1)?.clone()).ok()?;
                    Some((host, port))
                }
                _ => None,
            },
            _ => None,
        })
        .collect()
}

/// Wakes the shards the events name, follows the registrations, times waits out, and every
/// [`TOPOLOGY_CHECK`] checks the masters and their configuration beside all that; returns why
/// it stopped listening (`None`: the shared wait was dropped).
async fn listen(inner: &Inner, mut subscribed: Subscribed) -> Option<Unavailable> {
    let mut check_due = tokio::time::interval(TOPOLOGY_CHECK);
    check_due.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    check_due.tick().await;
    // The check in progress. It goes through the control connection, whose commands wait up to
    // its response timeout: awaited in place, a paused master held every event and deadline.
    let mut checking = std::pin::pin!(futures_util::future::Fuse::terminated());
    loop {
        let deadline = inner.next_deadline();
        tokio::select! {
            event = subscribed.events.next() => match event {
                Some(Some(message)) => {
                    if let Some(key) = added_to(&message) {
                        inner.wake_on_event(&key);
                    }
                }
                // A master's subscription ended (a killed connection, a restarted node, an
                // output buffer limit): subscribe again.
                Some(None) | None => return Some(Unavailable::Changed),
            },
            _ = check_due.tick(), if checking.is_terminated() => {
                checking.set(still_subscribed(inner, subscribed.masters.clone()).fuse());
            }
            changed = &mut checking, if !checking.is_terminated() => {
                if changed.is_some() {
                    return changed;
                }
            }
            () = inner.changed.notified() => {
                if let Err(error) = subscribed.follow_registrations(inner).await {
                    return Some(error);
                }
            }
            () = sleep_until(deadline) => inner.time_out_due(),
            () = inner.stop.cancelled() => return None,
        }
    }
}

/// `None` while the masters are those subscribed on and none has served a `CONFIG SET` since
/// (or, where `INFO` did not answer, each still publishes the events); otherwise why not. A
/// check that gets no answer from the cluster changes nothing (the subscriptions may be fine).
async fn still_subscribed(inner: &Inner, masters: ConfigSets) -> Option<Unavailable> {
    match self::masters(inner).await {
        Ok(now) if !now.iter().eq(masters.keys()) => return Some(Unavailable::Changed),
        Ok(_) => {}
        Err(error) => tracing::debug!(%error, "checking the cluster's masters failed"),
    }
    for ((host, port), counted) in &masters {
        match (*counted, config_sets_on(inner, host, *port).await) {
            // Its configuration is as it was when subscribed.
            (Some(counted), Ok(now)) if now == counted => continue,
            // A `CONFIG SET` since: the events may have been off for a moment, and an entry
            // added then sent none. Subscribing again reads the configuration and every waiting
            // shard once.
            (Some(_), Ok(_)) => return Some(Unavailable::Changed),
            (None, Ok(_)) => {}
            (_, Err(error)) => {
                tracing::debug!(%error, node = %format!("{host}:{port}"), "counting CONFIG SET calls failed");
            }
        }
        match check_events_on(inner, host, *port).await {
            Ok(()) => {}
            // Turned off at runtime: wait another way until they are back.
            Err(off @ Unavailable::Off { .. }) => return Some(off),
            Err(error) => {
                tracing::debug!(%error, node = %format!("{host}:{port}"), "checking notify-keyspace-events failed");
            }
        }
    }
    None
}

/// The shard key of an `xadd` event (`__keyspace@0__:<key>` / `xadd`); `None` for other events.
fn added_to(message: &redis::Msg) -> Option<String> {
    let event: String = message.get_payload().ok()?;
    if event != "xadd" {
        return None;
    }
    let channel = message.get_channel_name();
    channel.split_once("__:").map(|(_, key)| key.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shards_channel_is_its_keyspace_channel_taken_literally() {
        assert_eq!(channel_of("{orders:7}"), "__keyspace@0__:{orders:7}");
        assert_eq!(channel_of("{ord[e]rs*:0}"), "__keyspace@0__:{ord[e]rs*:0}");
    }

    #[test]
    fn config_set_calls_come_from_the_commandstats_line_of_config_set() {
        let info = "# Commandstats\r\ncmdstat_config|get:calls=9,usec=5,usec_per_call=0.56,rejected_calls=0,failed_calls=0\r\ncmdstat_config|set:calls=3,usec=40,usec_per_call=13.33,rejected_calls=1,failed_calls=0\r\n";
        assert_eq!(config_set_calls(info), 3);
        assert_eq!(
            config_set_calls("# Commandstats\r\ncmdstat_ping:calls=2,usec=1\r\n"),
            0
        );
        assert_eq!(config_set_calls("cmdstat_config|set:calls=x"), 0);
    }

    #[test]
    fn stream_events_need_keyspace_channels_and_the_stream_class() {
        assert!(publishes_stream_keyspace_events("Kt"));
        assert!(publishes_stream_keyspace_events("AK"));
        assert!(publishes_stream_keyspace_events("KEA"));
        assert!(!publishes_stream_keyspace_events(""));
        assert!(!publishes_stream_keyspace_events("Et"));
        assert!(!publishes_stream_keyspace_events("Kh"));
    }

    #[test]
    fn masters_come_from_each_slot_ranges_first_node() {
        let node = |host: &str, port: i64| {
            Value::Array(vec![
                Value::BulkString(host.as_bytes().to_vec()),
                Value::Int(port),
                Value::BulkString(b"id".to_vec()),
            ])
        };
        let slots = Value::Array(vec![
            Value::Array(vec![
                Value::Int(0),
                Value::Int(5460),
                node("127.0.0.1", 7000),
                node("127.0.0.1", 7003),
            ]),
            Value::Array(vec![
                Value::Int(5461),
                Value::Int(16383),
                node("127.0.0.1", 7001),
            ]),
        ]);
        let masters = masters_of(&slots);
        assert_eq!(
            masters.into_iter().collect::<Vec<_>>(),
            vec![
                ("127.0.0.1".to_owned(), 7000),
                ("127.0.0.1".to_owned(), 7001)
            ]
        );
    }
}
