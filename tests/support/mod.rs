//! What the integration tests share: short protocol timings, a recording handler, a steady
//! publisher on its own OS thread, bounded waits, the group as `describe` shows it, and a
//! listener in a real OS process (the `workload` example) that can be killed or frozen;
//! [`faults`] has the fault-injection suite's side (consumer and producer processes, the
//! checker's inputs, diagnostics).
//!
//! Times are wall-clock µs since the Unix epoch ([`now_us`]) everywhere, so that logs of the test
//! process and of a member process can be merged.

#![allow(dead_code)]

pub mod faults;
pub mod logs;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::AsyncCommands;
use redis::streams::{StreamReadOptions, StreamReadReply};
use stream_listener::core::handler::{Delivery, Handler, HandlerError};
use stream_listener::core::internals::admin::{self, GroupDescription, ScaleAction};
use stream_listener::core::internals::connection::{RedisConnection, RedisTarget};
use stream_listener::core::internals::coordinator::CoordinatorConfig;
use stream_listener::core::internals::keys::StreamKeys;
use stream_listener::core::internals::store::{
    StreamCas, load_stream_metadata, write_stream_metadata,
};
use stream_listener::core::member::{EventCallback, Listener, ListenerHandle, ListenerOptions};
use stream_listener::core::model::{GroupState, ShardState};
use stream_listener::testing::RedisServer;
pub use stream_listener::testing::workload::now_us;
use stream_listener::testing::workload::{LogLine, Workload, poll_until};

/// One multi-threaded `#[tokio::test]` per `name => argument`, each awaiting `body(argument)`: a
/// scenario run under each of its settings, every setting a test of its own name. Attributes
/// (doc comments) before a name go to that test. A function cannot declare tests, hence a macro.
#[allow(unused_macros)]
macro_rules! tests_of {
    ($body:ident { $($(#[$attr:meta])* $name:ident => $arg:expr),+ $(,)? }) => {
        $(
            $(#[$attr])*
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                $body($arg).await;
            }
        )+
    };
}
// Not every test file that includes this module has such scenarios.
#[allow(unused_imports)]
pub(crate) use tests_of;

pub const STREAM: &str = "orders";
pub const GROUP: &str = "billing";

/// Heartbeat interval, lease TTL and rebalance timeout of most tests.
pub const HEARTBEAT: Duration = Duration::from_millis(200);
pub const LEASE: Duration = Duration::from_millis(1500);
pub const REBALANCE: Duration = Duration::from_secs(3);

pub fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

pub fn coordination(
    heartbeat: Duration,
    lease: Duration,
    rebalance: Duration,
) -> CoordinatorConfig {
    CoordinatorConfig::new(heartbeat, lease, rebalance).unwrap()
}

pub fn fast() -> CoordinatorConfig {
    coordination(HEARTBEAT, LEASE, REBALANCE)
}

/// Short timings, `concurrency` members, block 500 ms, batch 64.
pub fn options(concurrency: u32) -> ListenerOptions {
    let mut options = ListenerOptions::default();
    options.concurrency = concurrency;
    options.coordination = fast();
    options.block = Duration::from_millis(500);
    options.batch_size = 64;
    // The runtime suites in `fencing = "acks"` mode (read rounds on a standalone server) with
    // STREAM_LISTENER_TEST_FENCING=acks; tests that choose a mode set it themselves.
    if std::env::var("STREAM_LISTENER_TEST_FENCING").as_deref() == Ok("acks") {
        options.fencing = stream_listener::core::internals::dataplane::FencingMode::Acks;
    }
    options
}

/// What most tests start from: a fresh `redis-server`, a connection to it, [`STREAM`] with the
/// shards asked for, an empty [`Recorder`], and (from [`Context::serial`]) the [`SERIAL`] lock.
/// Take it apart with [`parts`](Self::parts) (`let (_serial, server, target, mut conn, recorder)
/// = Context::serial(4).await.parts();`), binding the server to a name: it stops when dropped.
pub struct Context {
    /// Held for the whole test by the timing-sensitive ones.
    serial: Option<tokio::sync::MutexGuard<'static, ()>>,
    pub server: RedisServer,
    pub target: RedisTarget,
    pub conn: RedisConnection,
    pub recorder: Arc<Recorder>,
}

impl Context {
    /// A server and a stream of `shards` shards.
    pub async fn start(shards: u32) -> Context {
        let server = RedisServer::start().unwrap();
        let target = RedisTarget::standalone(server.url());
        let mut conn = connect(&target).await;
        admin::create_stream(&mut conn, STREAM, shards)
            .await
            .unwrap();
        Context {
            serial: None,
            server,
            target,
            conn,
            recorder: Arc::new(Recorder::default()),
        }
    }

    /// The lock (if held), the server, its target, the connection and the recorder.
    pub fn parts(
        self,
    ) -> (
        Option<tokio::sync::MutexGuard<'static, ()>>,
        RedisServer,
        RedisTarget,
        RedisConnection,
        Arc<Recorder>,
    ) {
        (
            self.serial,
            self.server,
            self.target,
            self.conn,
            self.recorder,
        )
    }

    /// As [`start`](Self::start), after taking the [`SERIAL`] lock.
    pub async fn serial(shards: u32) -> Context {
        let serial = SERIAL.lock().await;
        Context {
            serial: Some(serial),
            ..Context::start(shards).await
        }
    }
}

/// Starts a listener of [`GROUP`] on [`STREAM`] with `handler`.
pub async fn start_listener(
    target: &RedisTarget,
    handler: impl Handler,
    options: ListenerOptions,
) -> ListenerHandle {
    Listener::new(target.clone(), STREAM, GROUP, handler, options)
        .unwrap()
        .start()
        .await
        .unwrap()
}

// Not every test file that includes this module builds heartbeats.
#[allow(unused_imports)]
pub use stream_listener::testing::fixtures::heartbeat_request;

/// Scale-in to `target` and retirement of the removed shards through the admin API: they become
/// DRAINING, then RETIRING, then their streams are deleted and they are RETIRED (three
/// `metadataVersion` bumps). The admin's routing lease is zero here, far below the test
/// publishers' leases: it makes a publisher that has not refreshed meet a deleted shard, the case
/// `XADD ... NOMKSTREAM` and the retry exist for.
pub async fn scale_in_and_retire(conn: &mut RedisConnection, prefix: &str, target: u32) {
    let outcome = admin::scale(conn, prefix, target).await.unwrap();
    assert_eq!(outcome.action, ScaleAction::ScaleIn);
    for _ in 0..20 {
        let report = admin::retire_drained(conn, prefix, Duration::ZERO)
            .await
            .unwrap();
        if report.migration_complete {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the scale-in of {prefix} to {target} did not complete");
}

/// Marks shard `shard` of `prefix` `RETIRING` in the stream metadata by hand (one
/// `metadataVersion` more), as a scale-in's retirement would, and asserts the write won.
pub async fn mark_retiring(conn: &mut RedisConnection, prefix: &str, shard: usize) {
    let keys = StreamKeys::new(prefix).unwrap();
    let mut meta = load_stream_metadata(conn, &keys).await.unwrap().unwrap();
    let revision = meta.revision;
    meta.shards[shard].state = ShardState::Retiring;
    meta.metadata_version += 1;
    let written = write_stream_metadata(conn, &keys, Some(revision), &mut meta)
        .await
        .unwrap();
    assert_eq!(written, StreamCas::Written);
}

/// Writes a placeholder fence for `group` at `fence_key` (what a member's first read leaves),
/// for admin operations that must clean fences up.
pub async fn plant_fence(conn: &mut RedisConnection, fence_key: &str, group: &str) {
    let _: u64 = conn.hset(fence_key, group, "token").await.unwrap();
}

/// Creates a read gate of `group` on the shard stream `shard_key` and lists it in the shard's
/// gate registry (an empty stream with the consumer group, named after a fencing token: what a
/// strict read's passing check leaves, docs/design.md §8.16), for admin operations that must
/// delete gates with their shards or groups. Returns the gate's key.
pub async fn plant_gate(conn: &mut RedisConnection, shard_key: &str, group: &str) -> String {
    let gate = format!("{shard_key}:gate:{group}:1:1:planted:m0");
    plant_legacy_gate(conn, &gate, group).await;
    let _: u64 = conn
        .sadd(format!("{shard_key}:gates"), &gate)
        .await
        .unwrap();
    gate
}

/// Creates the read gate `gate_key` of `group` as versions before per-token gates named it
/// (`{<prefix>:<i>}:gate:<group>`, not in any registry).
pub async fn plant_legacy_gate(conn: &mut RedisConnection, gate_key: &str, group: &str) {
    let () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(gate_key)
        .arg(group)
        .arg("$")
        .arg("MKSTREAM")
        .query_async(conn)
        .await
        .unwrap();
}

/// Entries over shards `0..shards` of `prefix`.
pub async fn total_len(conn: &mut RedisConnection, prefix: &str, shards: u32) -> u64 {
    let keys = StreamKeys::new(prefix).unwrap();
    let mut total = 0;
    for shard in 0..shards {
        total += conn.xlen::<_, u64>(keys.shard(shard)).await.unwrap();
    }
    total
}

pub async fn connect(target: &RedisTarget) -> RedisConnection {
    RedisConnection::connect(target, Duration::from_secs(5))
        .await
        .unwrap()
}

/// Polls `done` every 20 ms until it holds or `deadline` passes; returns its last value.
pub async fn wait_until(deadline: Duration, mut done: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + deadline;
    while Instant::now() < end {
        if done() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    done()
}

/// One handler call (its start), as a handler saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    pub at_us: u64,
    pub member: String,
    pub shard: u32,
    pub entry_id: String,
    pub member_epoch: i64,
    pub attempt: u32,
    pub delivery_count: u64,
    /// The message number of the payload `{"n": N}`, when it decodes.
    pub n: Option<u64>,
}

/// A listener event with the time it was seen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ev {
    Assigned {
        at_us: u64,
        member: String,
        shard: u32,
        epoch: i64,
    },
    Revoked {
        at_us: u64,
        member: String,
        shard: u32,
        epoch: i64,
    },
    Read {
        at_us: u64,
        member: String,
        shard: u32,
        count: usize,
        first_id: String,
    },
    Fence {
        at_us: u64,
        member: String,
        shard: u32,
        op: String,
    },
}

impl Ev {
    pub fn at_us(&self) -> u64 {
        match self {
            Ev::Assigned { at_us, .. }
            | Ev::Revoked { at_us, .. }
            | Ev::Read { at_us, .. }
            | Ev::Fence { at_us, .. } => *at_us,
        }
    }
}

/// What handlers and event callbacks saw, in one process or several.
#[derive(Debug, Default)]
pub struct Recorder {
    pub calls: Mutex<Vec<Call>>,
    /// Handler successes: (at, member, shard, entry id).
    pub done: Mutex<Vec<(u64, String, u32, String)>>,
    pub events: Mutex<Vec<Ev>>,
}

impl Recorder {
    pub fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    pub fn events(&self) -> Vec<Ev> {
        self.events.lock().unwrap().clone()
    }

    /// For each shard of `shards`, the first handler start after `after_us` by a member `by`
    /// accepts: when the shard was served again after a kill, leave or shutdown.
    pub fn first_starts_after(
        &self,
        after_us: u64,
        shards: &BTreeSet<u32>,
        by: impl Fn(&str) -> bool,
    ) -> BTreeMap<u32, u64> {
        let mut first = BTreeMap::new();
        for call in self.calls() {
            if call.at_us > after_us && shards.contains(&call.shard) && by(&call.member) {
                first.entry(call.shard).or_insert(call.at_us);
            }
        }
        first
    }

    /// Records the start of a handler call of `delivery` (now); returns its message number.
    pub fn record_call(&self, delivery: &Delivery) -> Option<u64> {
        let n = payload_n(delivery);
        self.calls.lock().unwrap().push(Call {
            at_us: now_us(),
            member: delivery.member_id.to_string(),
            shard: delivery.shard,
            entry_id: delivery.entry_id.clone(),
            member_epoch: delivery.member_epoch,
            attempt: delivery.attempt,
            delivery_count: delivery.delivery_count,
            n,
        });
        n
    }

    /// Records that the handler of `delivery` succeeded (now).
    pub fn record_done(&self, delivery: &Delivery) {
        self.done.lock().unwrap().push((
            now_us(),
            delivery.member_id.to_string(),
            delivery.shard,
            delivery.entry_id.clone(),
        ));
    }

    /// Distinct `(shard, entry id)` whose handler succeeded at least once.
    pub fn handled(&self) -> BTreeSet<(u32, String)> {
        self.done
            .lock()
            .unwrap()
            .iter()
            .map(|(_, _, s, id)| (*s, id.clone()))
            .collect()
    }

    /// An event callback that records into this recorder (as the line a member process would
    /// log for the event).
    pub fn callback(self: &Arc<Self>) -> EventCallback {
        let recorder = self.clone();
        EventCallback(Arc::new(move |event| {
            recorder.record(&LogLine::from_event(event, now_us()));
        }))
    }
}

/// The message number of a `{"n": N}` payload.
pub fn payload_n(delivery: &Delivery) -> Option<u64> {
    let payload = delivery.payload()?;
    let value: serde_json::Value = serde_json::from_slice(payload).ok()?;
    value.get("n")?.as_u64()
}

/// What a recording handler does with one call, after recording its start.
pub type Behaviour = Arc<dyn Fn(&Delivery) -> Result<(), HandlerError> + Send + Sync>;

/// A handler that records each call's start, sleeps `work`, then asks `behaviour` for the
/// outcome (a payload that does not decode is a `Decode` error unless `behaviour` says first).
pub fn recording_handler(
    recorder: Arc<Recorder>,
    work: Duration,
    behaviour: Option<Behaviour>,
) -> impl Fn(
    Delivery,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), HandlerError>> + Send>>
+ Send
+ Sync
+ 'static {
    move |delivery: Delivery| {
        let recorder = recorder.clone();
        let behaviour = behaviour.clone();
        Box::pin(async move {
            let n = recorder.record_call(&delivery);
            if !work.is_zero() {
                tokio::time::sleep(work).await;
            }
            if let Some(behaviour) = &behaviour {
                behaviour(&delivery)?;
            }
            if n.is_none() {
                return Err(HandlerError::Decode("payload is not {\"n\": N}".into()));
            }
            recorder.record_done(&delivery);
            Ok(())
        })
    }
}

/// Starts a listener of `GROUP` on `STREAM` with a recording handler and event callback.
pub async fn start_recording(
    target: &RedisTarget,
    recorder: &Arc<Recorder>,
    options: ListenerOptions,
    work: Duration,
) -> ListenerHandle {
    start_recording_with(target, recorder, options, work, None).await
}

/// As [`start_recording`], the handler's outcome chosen by `behaviour` (see
/// [`recording_handler`]).
pub async fn start_recording_with(
    target: &RedisTarget,
    recorder: &Arc<Recorder>,
    mut options: ListenerOptions,
    work: Duration,
    behaviour: Option<Behaviour>,
) -> ListenerHandle {
    options.events = Some(recorder.callback());
    let handler = recording_handler(recorder.clone(), work, behaviour);
    start_listener(target, handler, options).await
}

/// One entry written by the test.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    pub at_us: u64,
    pub n: u64,
    pub shard: u32,
    pub id: String,
}

/// `XADD {orders:<shard>} * key s<shard> payload {"n":<n>}` (synchronous, for publisher threads).
pub fn xadd_sync(con: &mut impl redis::ConnectionLike, shard: u32, n: u64) -> Published {
    let id: String = redis::cmd("XADD")
        .arg(format!("{{{STREAM}:{shard}}}"))
        .arg("*")
        .arg("key")
        .arg(format!("s{shard}"))
        .arg("payload")
        .arg(format!("{{\"n\":{n}}}"))
        .query(con)
        .unwrap();
    Published {
        at_us: now_us(),
        n,
        shard,
        id,
    }
}

/// Appends raw fields to shard `shard`; returns the entry id.
pub async fn xadd_fields(
    conn: &mut RedisConnection,
    shard: u32,
    fields: &[(&str, &str)],
) -> String {
    let mut cmd = redis::cmd("XADD");
    cmd.arg(format!("{{{STREAM}:{shard}}}")).arg("*");
    for (f, v) in fields {
        cmd.arg(*f).arg(*v);
    }
    cmd.query_async(conn).await.unwrap()
}

/// Writes `count` messages to each of `shards` at once (pipelined), numbers from `first_n`.
pub fn preload(client: &redis::Client, shards: &[u32], count: u64, first_n: u64) -> Vec<Published> {
    preload_on(
        &mut client.get_connection().unwrap(),
        shards,
        count,
        first_n,
    )
}

/// [`preload`] over any synchronous connection (a cluster's too): round-robin over `shards`.
pub fn preload_on(
    con: &mut impl redis::ConnectionLike,
    shards: &[u32],
    count: u64,
    first_n: u64,
) -> Vec<Published> {
    let mut out = Vec::new();
    let mut n = first_n;
    for _ in 0..count {
        for &shard in shards {
            out.push(xadd_sync(con, shard, n));
            n += 1;
        }
    }
    out
}

/// Publishes one message to each of `shards` every `interval`, on its own OS thread with its own
/// synchronous connection (so a busy test runtime cannot slow the rate), on an absolute schedule.
pub struct SteadyPublisher {
    stop: Arc<AtomicBool>,
    paused: Arc<AtomicBool>,
    published: Arc<Mutex<Vec<Published>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl SteadyPublisher {
    pub fn start(
        client: redis::Client,
        shards: Vec<u32>,
        interval: Duration,
        first_n: u64,
    ) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let paused = Arc::new(AtomicBool::new(false));
        let published = Arc::new(Mutex::new(Vec::new()));
        let thread = {
            let (stop, paused, published) = (stop.clone(), paused.clone(), published.clone());
            std::thread::spawn(move || {
                let mut con = client.get_connection().unwrap();
                let mut n = first_n;
                let mut next = Instant::now();
                while !stop.load(Ordering::SeqCst) {
                    if !paused.load(Ordering::SeqCst) {
                        for &shard in &shards {
                            let p = xadd_sync(&mut con, shard, n);
                            published.lock().unwrap().push(p);
                            n += 1;
                        }
                    }
                    next += interval;
                    let now = Instant::now();
                    if next > now {
                        std::thread::sleep(next - now);
                    } else {
                        next = now;
                    }
                }
            })
        };
        SteadyPublisher {
            stop,
            paused,
            published,
            thread: Some(thread),
        }
    }

    pub fn published(&self) -> Vec<Published> {
        self.published.lock().unwrap().clone()
    }

    pub fn pause(&self) {
        self.paused.store(true, Ordering::SeqCst);
    }

    pub fn resume(&self) {
        self.paused.store(false, Ordering::SeqCst);
    }

    /// Stops publishing and returns everything published.
    pub fn stop(mut self) -> Vec<Published> {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            thread.join().unwrap();
        }
        self.published()
    }
}

impl Drop for SteadyPublisher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

pub async fn describe(conn: &mut RedisConnection) -> GroupDescription {
    admin::describe_group(conn, STREAM, GROUP, &fast())
        .await
        .unwrap()
}

/// The target assignment (shard → member) as `describe` shows it.
pub fn target_of(group: &GroupDescription) -> BTreeMap<u32, String> {
    group
        .shards
        .iter()
        .filter_map(|s| s.target_owner.clone().map(|o| (s.shard_index, o)))
        .collect()
}

/// STABLE, and every live member reports owning exactly its target.
pub fn converged(group: &GroupDescription) -> bool {
    group.state == GroupState::Stable
        && group
            .members
            .iter()
            .filter(|m| m.live)
            .all(|m| m.owned == m.target && m.pending.is_empty() && m.revoking.is_empty())
}

/// Waits up to `deadline` until the group is [`converged`] with `members` live members (asserts
/// it is); returns the description.
pub async fn settle(
    conn: &mut RedisConnection,
    members: usize,
    deadline: Duration,
) -> GroupDescription {
    let (group, settled) = wait_for_group(conn, deadline, |g| {
        converged(g) && g.members.iter().filter(|m| m.live).count() == members
    })
    .await;
    assert!(settled, "{group:#?}");
    group
}

/// The shards `describe` targets at `member`.
pub fn target_shards<C: FromIterator<u32>>(group: &GroupDescription, member: &str) -> C {
    target_of(group)
        .iter()
        .filter(|(_, o)| o.as_str() == member)
        .map(|(s, _)| *s)
        .collect()
}

/// Polls `describe` until `done` holds; returns the last description and whether it held.
pub async fn wait_for_group(
    conn: &mut RedisConnection,
    deadline: Duration,
    mut done: impl FnMut(&GroupDescription) -> bool,
) -> (GroupDescription, bool) {
    let end = Instant::now() + deadline;
    loop {
        let group = describe(conn).await;
        if done(&group) {
            return (group, true);
        }
        if Instant::now() >= end {
            return (group, false);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The first partition key `k<i>` that the producer routes to `shard` of `shards`.
pub fn key_on_shard(shard: u32, shards: u32) -> String {
    (0..)
        .map(|i| format!("k{i}"))
        .find(|k| stream_listener::shard_for_key(k, shards) == shard)
        .unwrap()
}

/// Reads `from` into `buf`: the bytes read, `None` at the end or on an error (TCP proxies).
pub async fn read_chunk<'b>(
    from: &mut (impl tokio::io::AsyncRead + Unpin),
    buf: &'b mut [u8],
) -> Option<&'b [u8]> {
    use tokio::io::AsyncReadExt;
    match from.read(buf).await {
        Ok(0) | Err(_) => None,
        Ok(n) => Some(&buf[..n]),
    }
}

/// `INFO <section>`.
pub async fn info(conn: &mut RedisConnection, section: &str) -> String {
    redis::cmd("INFO")
        .arg(section)
        .query_async(conn)
        .await
        .unwrap()
}

/// Reads up to `count` new entries of `key` for `group` as consumer `c1`; returns their ids.
pub async fn read_new(
    conn: &mut RedisConnection,
    key: &str,
    group: &str,
    count: usize,
) -> Vec<String> {
    let options = StreamReadOptions::default().group(group, "c1").count(count);
    let reply: StreamReadReply = conn.xread_options(&[key], &[">"], &options).await.unwrap();
    reply
        .keys
        .into_iter()
        .flat_map(|k| k.ids.into_iter().map(|e| e.id))
        .collect()
}

/// The first five of `items` at most, for failure messages.
pub fn first_five<T>(items: &[T]) -> &[T] {
    &items[..items.len().min(5)]
}

/// A number from `INFO <section>`.
pub async fn info_number(conn: &mut RedisConnection, section: &str, field: &str) -> u64 {
    let info = info(conn, section).await;
    info.lines()
        .find_map(|line| line.strip_prefix(&format!("{field}:")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {field} in INFO {section}"))
}

/// `INFO commandstats` as command → calls.
pub async fn command_calls(conn: &mut RedisConnection) -> BTreeMap<String, u64> {
    let info = info(conn, "commandstats").await;
    info.lines()
        .filter_map(|line| {
            let (name, rest) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest.split(',').find_map(|kv| kv.strip_prefix("calls="))?;
            Some((name.to_owned(), calls.parse().ok()?))
        })
        .collect()
}

/// Pending count of the group on one shard (`XPENDING` summary).
pub async fn pending_count(conn: &mut RedisConnection, shard: u32) -> u64 {
    let reply: redis::Value = redis::cmd("XPENDING")
        .arg(format!("{{{STREAM}:{shard}}}"))
        .arg(GROUP)
        .query_async(conn)
        .await
        .unwrap();
    match reply {
        redis::Value::Array(items) => match items.first() {
            Some(redis::Value::Int(n)) => *n as u64,
            other => panic!("XPENDING summary: {other:?}"),
        },
        other => panic!("XPENDING summary: {other:?}"),
    }
}

/// Polls the pending count of `shard` for up to 5 s until it is 0; returns the last count.
pub async fn wait_no_pending(conn: &mut RedisConnection, shard: u32) -> u64 {
    let end = Instant::now() + Duration::from_secs(5);
    loop {
        let pending = pending_count(conn, shard).await;
        if pending == 0 || Instant::now() >= end {
            return pending;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The group's PEL on `shard` (of `consumer` only, when given): (id, consumer, idle ms,
/// delivery count).
async fn pending_rows(
    conn: &mut RedisConnection,
    shard: u32,
    consumer: Option<&str>,
) -> Vec<(String, String, u64, u64)> {
    let mut cmd = redis::cmd("XPENDING");
    cmd.arg(format!("{{{STREAM}:{shard}}}"))
        .arg(GROUP)
        .arg("-")
        .arg("+")
        .arg(100_000);
    if let Some(consumer) = consumer {
        cmd.arg(consumer);
    }
    cmd.query_async(conn).await.unwrap()
}

/// The ids pending for `consumer` on `shard`.
pub async fn pending_of(conn: &mut RedisConnection, shard: u32, consumer: &str) -> Vec<String> {
    let rows = pending_rows(conn, shard, Some(consumer)).await;
    rows.into_iter().map(|(id, _, _, _)| id).collect()
}

/// The group's whole PEL on `shard`: (id, consumer, delivery count).
pub async fn pel(conn: &mut RedisConnection, shard: u32) -> Vec<(String, String, u64)> {
    let rows = pending_rows(conn, shard, None).await;
    rows.into_iter().map(|(id, c, _, n)| (id, c, n)).collect()
}

/// Waits up to `deadline` until `recorder` has handled every published entry, then asserts that
/// it has (with the missing ones in the message).
pub async fn assert_nothing_lost(recorder: &Recorder, published: &[Published], deadline: Duration) {
    assert_nothing_lost_by(&[recorder], published, deadline).await;
}

/// As [`assert_nothing_lost`], for entries handled by any of `recorders` (members that each
/// record on their own).
pub async fn assert_nothing_lost_by(
    recorders: &[&Recorder],
    published: &[Published],
    deadline: Duration,
) {
    let handled =
        || -> BTreeSet<(u32, String)> { recorders.iter().flat_map(|r| r.handled()).collect() };
    let all = wait_until(deadline, || all_handled(published, &handled())).await;
    assert_all_handled(published, &handled());
    assert!(all);
}

/// Asserts that nothing stays pending on `shards` (each polled for up to 5 s).
pub async fn assert_no_pending(conn: &mut RedisConnection, shards: impl IntoIterator<Item = u32>) {
    for shard in shards {
        assert_eq!(wait_no_pending(conn, shard).await, 0, "shard {shard}");
    }
}

/// Whether every published entry is in `handled`.
pub fn all_handled(published: &[Published], handled: &BTreeSet<(u32, String)>) -> bool {
    published
        .iter()
        .all(|p| handled.contains(&(p.shard, p.id.clone())))
}

/// Asserts that every published entry's handler succeeded at least once.
pub fn assert_all_handled(published: &[Published], handled: &BTreeSet<(u32, String)>) {
    let missing: Vec<&Published> = published
        .iter()
        .filter(|p| !handled.contains(&(p.shard, p.id.clone())))
        .collect();
    assert!(
        missing.is_empty(),
        "{} of {} published entries never handled, e.g. {:?}",
        missing.len(),
        published.len(),
        first_five(&missing)
    );
}

/// A listener in a `workload consume` child process (`--log-starts`, with this support's stream,
/// group and timings unless `args` set them), its log merged into `recorder` as it is read:
/// `handling` lines as calls, ok `handled` lines as successes, ownership, read and fence lines as
/// events. Killed (`SIGKILL`) when dropped.
pub struct MemberProcess {
    process: Workload,
    pub members: Vec<String>,
    pub recorder: Arc<Recorder>,
}

impl MemberProcess {
    /// Spawns the member process with `args` (`workload consume` options) and waits until it
    /// reports its member ids.
    pub fn spawn(url: &str, args: &[&str], recorder: Arc<Recorder>) -> Self {
        let defaults = [
            ("--stream", STREAM.to_owned()),
            ("--group", GROUP.to_owned()),
            ("--name", "listener".to_owned()),
            ("--heartbeat-ms", HEARTBEAT.as_millis().to_string()),
            ("--lease-ms", LEASE.as_millis().to_string()),
            ("--rebalance-ms", REBALANCE.as_millis().to_string()),
            ("--batch-size", "64".to_owned()),
            ("--block-ms", "500".to_owned()),
        ];
        let mut all = faults::strings(&["consume", "--log-starts", "--exit-on-stdin-close"]);
        for (flag, value) in defaults {
            if !args.contains(&flag) {
                all.extend([flag.to_owned(), value]);
            }
        }
        all.extend(faults::strings(args));
        let process = {
            let recorder = recorder.clone();
            Workload::spawn_observed(
                faults::workload_binary(),
                "member-process",
                url,
                &all,
                move |line| recorder.record(line),
            )
        };
        let mut members = Vec::new();
        let ready = poll_until(Duration::from_secs(30), || {
            members = process
                .lines()
                .into_iter()
                .find_map(|line| match line {
                    LogLine::Ready(ready) => Some(ready.members),
                    _ => None,
                })
                .unwrap_or_default();
            !members.is_empty()
        });
        assert!(
            ready,
            "the member process reports ready: {}",
            process.stderr_text()
        );
        MemberProcess {
            process,
            members,
            recorder,
        }
    }

    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// Freezes the process (`SIGSTOP`): its clocks keep running, it does nothing.
    pub fn freeze(&self) {
        self.process.signal("STOP");
    }

    /// Lets it run again (`SIGCONT`).
    pub fn thaw(&self) {
        self.process.signal("CONT");
    }

    /// Graceful shutdown (`SIGTERM`), waiting for the exit (at most 30 s, then `SIGKILL`).
    /// Returns when the signal was sent and whether the process exited with status 0.
    pub fn terminate(mut self) -> (u64, bool) {
        let at = now_us();
        let status = self.process.stop(Duration::from_secs(30));
        (at, status.is_some_and(|s| s.success()))
    }

    /// A crash (`SIGKILL`), waiting for the exit. Returns the time of the kill.
    pub fn kill(&mut self) -> u64 {
        let at = now_us();
        self.process.kill9();
        at
    }

    /// The lines of its log read so far, in the order it wrote them.
    pub fn lines(&self) -> Vec<LogLine> {
        self.process.lines()
    }

    /// As [`terminate`](Self::terminate), keeping the process's log readable
    /// ([`lines`](Self::lines)): whether it exited with status 0.
    pub fn terminate_in_place(&mut self) -> bool {
        let status = self.process.stop(Duration::from_secs(30));
        status.is_some_and(|s| s.success())
    }
}

impl Recorder {
    /// Records one line of a member process's log.
    fn record(&self, line: &LogLine) {
        match line {
            LogLine::Handling(h) => self.calls.lock().unwrap().push(Call {
                at_us: h.ts_us,
                member: h.call.member.clone(),
                shard: h.call.shard,
                entry_id: h.call.entry_id.clone(),
                member_epoch: h.call.member_epoch,
                attempt: h.call.attempt,
                delivery_count: h.delivery_count,
                n: h.n,
            }),
            LogLine::Handled(h) if h.ok => self.done.lock().unwrap().push((
                h.end_us,
                h.call.member.clone(),
                h.call.shard,
                h.call.entry_id.clone(),
            )),
            LogLine::Assigned(o) => self.events.lock().unwrap().push(Ev::Assigned {
                at_us: o.ts_us,
                member: o.member.clone(),
                shard: o.shard,
                epoch: o.member_epoch,
            }),
            LogLine::Revoked(o) => self.events.lock().unwrap().push(Ev::Revoked {
                at_us: o.ts_us,
                member: o.member.clone(),
                shard: o.shard,
                epoch: o.member_epoch,
            }),
            LogLine::Read(r) => self.events.lock().unwrap().push(Ev::Read {
                at_us: r.ts_us,
                member: r.member.clone(),
                shard: r.shard,
                count: r.count as usize,
                first_id: r.first_id.clone(),
            }),
            LogLine::FenceRejected(f) => self.events.lock().unwrap().push(Ev::Fence {
                at_us: f.ts_us,
                member: f.member.clone(),
                shard: f.shard,
                op: f.op.clone(),
            }),
            _ => {}
        }
    }
}

/// Serialises the timing-sensitive tests of one test binary (they share two cores).
pub static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// `CONFIG RESETSTAT`: [`loads`] counts from here.
pub async fn reset_stats(conn: &mut RedisConnection) {
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(conn)
        .await
        .unwrap();
}

/// The group loads since the last `CONFIG RESETSTAT`: each runs one `HGETALL` of the group hash,
/// the only `HGETALL` of the tests that use it.
pub async fn loads(conn: &mut RedisConnection) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .unwrap();
    info.lines()
        .find_map(|line| line.strip_prefix("cmdstat_hgetall:calls="))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |calls| calls.parse().unwrap())
}
