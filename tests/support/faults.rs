//! The fault-injection suite's side of the support (`tests/fault_*.rs`): the `workload`
//! example as consumer and producer processes with the suite's timings, waits on their logs,
//! and diagnostics for a failing run. The process, its log and the checker are in
//! `stream_listener::testing::workload`, shared with the fault benchmarks.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use stream_listener::core::internals::connection::RedisTarget;
use stream_listener::testing::RedisCluster;
use stream_listener::testing::workload::{
    CONT_GRACE_US, Expected, Handled, LogLine, Read, Workload, build_example, handled_messages,
    now_us, owned_before, poll_until,
};

use super::{GROUP, STREAM};

/// Protocol timings of the suite: heartbeat 200 ms, lease 1.5 s, rebalance timeout 3 s.
pub const HEARTBEAT_MS: u64 = 200;
pub const LEASE_MS: u64 = 1500;
pub const REBALANCE_MS: u64 = 3000;

/// The scenarios start several processes with short leases: run one at a time, so that they do
/// not starve each other of CPU (a starved member misses its lease).
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The `workload` example's executable, built once per test binary with the same cargo that runs
/// the tests: `cargo build --workspace --example workload`, so cargo decides whether it is up to
/// date. `--workspace` resolves features as `cargo test --workspace` does, which has already
/// built the example: the build is then a no-op (without it, a clean tree would compile a second
/// variant of the example and its dependencies). The path is the one cargo reports, so
/// `CARGO_TARGET_DIR` works.
pub fn workload_binary() -> &'static std::path::Path {
    static PATH: OnceLock<std::path::PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        build_example(
            env!("CARGO"),
            env!("CARGO_MANIFEST_DIR"),
            &["--workspace"],
            "workload",
        )
        .into()
    })
}

/// Runs one future to completion on a throwaway runtime (admin calls from synchronous tests).
pub fn block_on<F: std::future::Future>(future: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
        .block_on(future)
}

/// A `workload consume` process with the suite's timings (`extra` is appended).
pub fn consumer(name: &str, url: &str, concurrency: u32, extra: &[&str]) -> Workload {
    let mut args = consumer_args(concurrency, HEARTBEAT_MS, LEASE_MS, REBALANCE_MS);
    args.extend(strings(extra));
    Workload::spawn(workload_binary(), name, url, &args)
}

/// The arguments of a `workload consume` of the suite's stream and group with `concurrency`
/// members and these protocol timings (milliseconds), and the suite's batch, block, backoff,
/// handler and shutdown settings.
pub fn consumer_args(
    concurrency: u32,
    heartbeat_ms: u64,
    lease_ms: u64,
    rebalance_ms: u64,
) -> Vec<String> {
    strings(&[
        "consume",
        "--stream",
        STREAM,
        "--group",
        GROUP,
        "--heartbeat-ms",
        &heartbeat_ms.to_string(),
        "--lease-ms",
        &lease_ms.to_string(),
        "--rebalance-ms",
        &rebalance_ms.to_string(),
        "--concurrency",
        &concurrency.to_string(),
        "--batch-size",
        "16",
        "--block-ms",
        "500",
        "--backoff-ms",
        "20",
        "--handler-timeout-ms",
        "2000",
        "--shutdown-timeout-ms",
        "3000",
        "--shards",
        &SHARDS.to_string(),
        "--exit-on-stdin-close",
    ])
}

/// A `workload consume` process on the Redis Cluster `cluster` (`--cluster-node` for every node),
/// otherwise as [`consumer`] starts one on a server.
pub fn cluster_consumer(
    cluster: &RedisCluster,
    name: &str,
    concurrency: u32,
    extra: &[&str],
) -> Workload {
    let args = cluster_consumer_args(cluster, concurrency, extra);
    Workload::spawn(workload_binary(), name, &cluster.urls()[0], &args)
}

/// The arguments of [`cluster_consumer`]'s process.
pub fn cluster_consumer_args(
    cluster: &RedisCluster,
    concurrency: u32,
    extra: &[&str],
) -> Vec<String> {
    let mut args = consumer_args(concurrency, HEARTBEAT_MS, LEASE_MS, REBALANCE_MS);
    args.extend(cluster_args(cluster));
    args.extend(strings(extra));
    args
}

/// `--cluster-node <url>` for every node of `cluster` (the workload's global option: it talks to
/// the cluster instead of `--redis-url`).
pub fn cluster_args(cluster: &RedisCluster) -> Vec<String> {
    cluster
        .urls()
        .into_iter()
        .flat_map(|url| ["--cluster-node".to_owned(), url])
        .collect()
}

/// A `workload produce` process.
pub fn producer(url: &str, keys: u64, count: u64, rate: u64) -> Workload {
    Workload::spawn(
        workload_binary(),
        "producer",
        url,
        &producer_args(keys, count, rate),
    )
}

/// A `workload produce` process on the Redis Cluster `cluster`, otherwise as [`producer`].
pub fn cluster_producer(cluster: &RedisCluster, keys: u64, count: u64, rate: u64) -> Workload {
    let mut args = producer_args(keys, count, rate);
    args.extend(cluster_args(cluster));
    Workload::spawn(workload_binary(), "producer", &cluster.urls()[0], &args)
}

/// The arguments of a `workload produce` of `count` messages over `keys` keys at `rate` per
/// second to the suite's stream, in batches of 32.
fn producer_args(keys: u64, count: u64, rate: u64) -> Vec<String> {
    strings(&[
        "produce",
        "--stream",
        STREAM,
        "--keys",
        &keys.to_string(),
        "--count",
        &count.to_string(),
        "--rate",
        &rate.to_string(),
        "--shards",
        &SHARDS.to_string(),
        "--batch",
        "32",
    ])
}

/// Owned copies of command-line words.
pub fn strings(words: &[&str]) -> Vec<String> {
    words.iter().map(|s| (*s).to_owned()).collect()
}

/// Shard count of every scenario (each runs its own Redis, with the support's stream and group).
pub const SHARDS: u32 = 8;

/// The shards each member owns now according to `lines` (assigned and not revoked since).
pub fn owned_now(lines: &[LogLine]) -> std::collections::BTreeMap<u32, String> {
    owned_before(lines, u64::MAX)
}

/// Waits until the live processes `procs` together own every shard, each process at least one,
/// and nothing has changed hands for `quiet`. Panics after `deadline`.
pub fn wait_settled(procs: &[&Workload], deadline: Duration, quiet: Duration) {
    let mut last_change = Instant::now();
    let mut last: Vec<std::collections::BTreeMap<u32, String>> = Vec::new();
    let settled = poll_until(deadline, || {
        let owned: Vec<_> = procs.iter().map(|p| owned_now(&p.lines())).collect();
        if owned != last {
            last = owned.clone();
            last_change = Instant::now();
        }
        let total: usize = owned.iter().map(|o| o.len()).sum();
        let shards: std::collections::BTreeSet<u32> =
            owned.iter().flat_map(|o| o.keys().copied()).collect();
        total == SHARDS as usize
            && shards.len() == SHARDS as usize
            && owned.iter().all(|o| !o.is_empty())
            && last_change.elapsed() >= quiet
    });
    assert!(
        settled,
        "the consumers did not settle within {deadline:?}: {:?}; stderr: {}",
        last,
        procs
            .iter()
            .map(|p| format!("{}: {}", p.name, p.stderr_text()))
            .collect::<Vec<_>>()
            .join(" | ")
    );
}

/// Distinct produced messages with an ok handled line in `procs`' logs so far.
pub fn handled_ok(procs: &[&Workload]) -> usize {
    handled_messages(procs).len()
}

/// Creates the suite's stream (`SHARDS` shards) on the server at `url`.
pub fn create_stream(url: &str) {
    create_stream_on(&RedisTarget::standalone(url.to_owned()));
}

/// Creates the suite's stream (`SHARDS` shards) on `target` (a server or a cluster).
pub fn create_stream_on(target: &RedisTarget) {
    use stream_listener::core::internals::admin;
    use stream_listener::core::internals::connection::RedisConnection;
    block_on(async {
        let mut conn = RedisConnection::connect(target, Duration::from_secs(5))
            .await
            .expect("connect to Redis");
        admin::create_stream(&mut conn, STREAM, SHARDS)
            .await
            .expect("create the stream");
    });
}

/// An `XRANGE` entry: id and fields.
type StreamEntry = (String, Vec<(String, Vec<u8>)>);

/// For messages that no consumer handled: where they are in Redis (entry id, shard, pending or
/// not, the group's last delivered id), for failure messages.
pub fn diagnose_missing(url: &str, missing: &[(String, u64)]) -> String {
    let mut out = String::new();
    let Ok(client) = redis::Client::open(url) else {
        return "cannot open a Redis client".into();
    };
    let Ok(mut conn) = client.get_connection() else {
        return "cannot connect to Redis".into();
    };
    for shard in 0..SHARDS {
        let key = format!("{{{STREAM}:{shard}}}");
        let entries: Vec<StreamEntry> = redis::cmd("XRANGE")
            .arg(&key)
            .arg("-")
            .arg("+")
            .query(&mut conn)
            .unwrap_or_default();
        let groups: redis::Value = redis::cmd("XINFO")
            .arg("GROUPS")
            .arg(&key)
            .query(&mut conn)
            .unwrap_or(redis::Value::Nil);
        for (id, fields) in &entries {
            let payload = fields
                .iter()
                .find(|(name, _)| name == "payload")
                .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
                .unwrap_or_default();
            let Ok(value) = serde_json::from_str::<serde_json::Value>(&payload) else {
                continue;
            };
            let message = (
                value["key"].as_str().unwrap_or_default().to_owned(),
                value["seq"].as_u64().unwrap_or(u64::MAX),
            );
            if missing.contains(&message) {
                let pending: redis::Value = redis::cmd("XPENDING")
                    .arg(&key)
                    .arg(GROUP)
                    .arg(id)
                    .arg(id)
                    .arg(1)
                    .query(&mut conn)
                    .unwrap_or(redis::Value::Nil);
                out.push_str(&format!(
                    "\n{}#{} is entry {id} of {key}; pending: {pending:?}; groups: {groups:?}",
                    message.0, message.1
                ));
            }
        }
    }
    if out.is_empty() {
        out = format!("none of {missing:?} is in any shard stream (never appended?)");
    }
    out
}

/// Produced messages without an ok handled line in `procs`' logs.
pub fn missing_messages(procs: &[&Workload], expected: Expected) -> Vec<(String, u64)> {
    let done = handled_messages(procs);
    expected.messages().filter(|m| !done.contains(m)).collect()
}

/// Writes every process's raw stdout and stderr to a fresh directory under the system temp
/// directory, for a failing run's post-mortem; returns the directory.
pub fn save_logs(scenario: &str, procs: &[&Workload]) -> String {
    let dir = std::env::temp_dir().join(format!(
        "fault-logs-{scenario}-{}-{}",
        std::process::id(),
        now_us()
    ));
    if std::fs::create_dir_all(&dir).is_err() {
        return "(could not create a log directory)".into();
    }
    for p in procs {
        let _ = std::fs::write(
            dir.join(format!("{}.jsonl", p.name)),
            p.raw_lines().join("\n") + "\n",
        );
        let _ = std::fs::write(dir.join(format!("{}.stderr", p.name)), p.stderr_text());
    }
    dir.display().to_string()
}

/// Entries pending in the group's PEL, per shard (`XPENDING <shard> <group>` count).
pub fn pending_per_shard(url: &str) -> Result<Vec<u64>, String> {
    let client = redis::Client::open(url).map_err(|e| e.to_string())?;
    let mut conn = client.get_connection().map_err(|e| e.to_string())?;
    pending_per_shard_on(&mut conn)
}

/// [`pending_per_shard`] on `conn` (a server's or a cluster's connection).
pub fn pending_per_shard_on(conn: &mut impl redis::ConnectionLike) -> Result<Vec<u64>, String> {
    (0..SHARDS)
        .map(|shard| {
            let summary: redis::Value = redis::cmd("XPENDING")
                .arg(format!("{{{STREAM}:{shard}}}"))
                .arg(GROUP)
                .query(conn)
                .map_err(|e| e.to_string())?;
            match summary {
                redis::Value::Array(items) => match items.first() {
                    Some(redis::Value::Int(n)) => Ok(u64::try_from(*n).unwrap_or(0)),
                    other => Err(format!("unexpected XPENDING summary {other:?}")),
                },
                other => Err(format!("unexpected XPENDING reply {other:?}")),
            }
        })
        .collect()
}

/// Up to 20 pending entries per shard: (shard, entry id, consumer, delivery count).
pub fn pending_entries(url: &str) -> Vec<(u32, String, String, u64)> {
    let Ok(client) = redis::Client::open(url) else {
        return Vec::new();
    };
    let Ok(mut conn) = client.get_connection() else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for shard in 0..SHARDS {
        let rows: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
            .arg(format!("{{{STREAM}:{shard}}}"))
            .arg(GROUP)
            .arg("-")
            .arg("+")
            .arg(20)
            .query(&mut conn)
            .unwrap_or_default();
        out.extend(
            rows.into_iter()
                .map(|(id, consumer, _idle, count)| (shard, id, consumer, count)),
        );
    }
    out
}

/// What the logs of `procs` say about entry `id` of `shard`: its handled and read lines.
pub fn entry_history(procs: &[&Workload], shard: u32, id: &str) -> Vec<String> {
    let mut out = Vec::new();
    for p in procs {
        for line in p.lines() {
            match &line {
                LogLine::Handled(h) if h.call.shard == shard && h.call.entry_id == id => {
                    out.push(format!("{}: {line:?}", p.name));
                }
                LogLine::Read(r) if r.shard == shard && r.first_id.as_str() <= id => {
                    // Only the last read at or before the id is interesting; keep them all
                    // and trim below.
                    out.push(format!("{}: {line:?}", p.name));
                }
                _ => {}
            }
        }
    }
    // The reads that may have returned the entry: the last few before it.
    let reads: Vec<String> = out
        .iter()
        .filter(|l| l.contains("Read("))
        .cloned()
        .collect();
    let mut kept: Vec<String> = out.into_iter().filter(|l| !l.contains("Read(")).collect();
    kept.extend(reads.into_iter().rev().take(2));
    kept
}

/// When `member` was first assigned `shard` at or after `since_us` according to `lines` (µs),
/// `None` when it was not.
pub fn assigned_again(lines: &[LogLine], member: &str, shard: u32, since_us: u64) -> Option<u64> {
    lines
        .iter()
        .filter_map(|line| match line {
            LogLine::Assigned(o)
                if o.shard == shard && o.member == member && o.ts_us >= since_us =>
            {
                Some(o.ts_us)
            }
            _ => None,
        })
        .min()
}

/// What the log of a member process frozen with `SIGSTOP` and continued with `SIGCONT` says about
/// it after the `SIGCONT` ([`zombie_log`]).
#[derive(Debug, Default)]
pub struct ZombieLog {
    /// Reads logged after the checker's grace past the `SIGCONT` ([`CONT_GRACE_US`]: a reply
    /// that arrived during the stop is logged only then) by a member on a shard it owned at the
    /// stop, before it was assigned that shard again: the zombie read.
    pub reads: Vec<Read>,
    /// Handler calls started after the `SIGCONT` by a member on a shard it owned at the stop,
    /// before it was assigned that shard again: the zombie worked on.
    pub handler_starts: Vec<Handled>,
    /// Handler calls on those shards that started before the stop and ended after the
    /// `SIGCONT` (at most one per shard: the call the stop froze).
    pub spanning: usize,
    /// Fence rejections the process logged after the `SIGCONT`, by operation (`read`, `ack`,
    /// `claim`): each is one operation of a member the fence refused.
    pub fence_rejections: BTreeMap<String, usize>,
    /// The same, by shard.
    pub fence_rejections_by_shard: BTreeMap<u32, usize>,
    /// Of those, the rejections of an operation of a member on a shard it owned at the stop,
    /// before it was assigned that shard again: the fence stopping the zombie (the others are
    /// rebalances after it joined again).
    pub zombie_rejections: usize,
}

impl ZombieLog {
    /// The zombie's reads and handler starts, one sentence each.
    pub fn violations(&self) -> Vec<String> {
        let reads = self
            .reads
            .iter()
            .map(|r| format!("zombie read after SIGCONT: {r:?}"));
        let starts = self
            .handler_starts
            .iter()
            .map(|h| format!("zombie started a handler after SIGCONT: {h:?}"));
        reads.chain(starts).collect()
    }

    /// Fence rejections after the `SIGCONT`, all operations.
    pub fn rejections(&self) -> usize {
        self.fence_rejections.values().sum()
    }
}

/// Judges `lines`, the log of a process stopped at `stopped_us` and continued at `continued_us`
/// that owned `owned` (shard → member) at the stop: see [`ZombieLog`].
pub fn zombie_log(
    lines: &[LogLine],
    owned: &BTreeMap<u32, String>,
    stopped_us: u64,
    continued_us: u64,
) -> ZombieLog {
    let mut log = ZombieLog::default();
    for (&shard, member) in owned {
        let reassigned = assigned_again(lines, member, shard, continued_us).unwrap_or(u64::MAX);
        for line in lines {
            match line {
                LogLine::Read(r)
                    if r.shard == shard
                        && &r.member == member
                        && r.ts_us > continued_us + CONT_GRACE_US
                        && r.ts_us < reassigned =>
                {
                    log.reads.push(r.clone());
                }
                LogLine::Handled(h)
                    if h.call.shard == shard
                        && &h.call.member == member
                        && h.start_us >= continued_us
                        && h.start_us < reassigned =>
                {
                    log.handler_starts.push(h.clone());
                }
                LogLine::Handled(h)
                    if h.call.shard == shard
                        && h.start_us < stopped_us
                        && h.end_us >= continued_us =>
                {
                    log.spanning += 1;
                }
                _ => {}
            }
        }
    }
    for line in lines {
        if let LogLine::FenceRejected(f) = line
            && f.ts_us >= continued_us
        {
            *log.fence_rejections.entry(f.op.clone()).or_default() += 1;
            *log.fence_rejections_by_shard.entry(f.shard).or_default() += 1;
            let owned_at_stop = owned.get(&f.shard) == Some(&f.member);
            let reassigned = assigned_again(lines, &f.member, f.shard, continued_us);
            if owned_at_stop && reassigned.is_none_or(|at| f.ts_us < at) {
                log.zombie_rejections += 1;
            }
        }
    }
    log
}
