//! End-to-end benchmarks of the listener runtime (BENCHMARKS.md items 1-3 and 7), each against a
//! baseline measured in the same run, on a throwaway `redis-server` and a local 3-master cluster
//! started through the test harness (hence the `testing` feature). A `harness = false` program
//! that prints its tables; BENCHMARKS.md, "End to end", has the results.
//!
//! ```sh
//! cargo bench -p stream-listener-core --features testing --bench end_to_end -- <part>...
//! ```
//!
//! Parts (default: all four, in this order):
//! - `throughput`: 1,000,000 small entries pre-loaded over 8 shards (a pipelined `XADD` before
//!   the clock starts), consumed and acked by one `Listener` with `concurrency = 4` and a no-op
//!   handler, `fencing = acks` and `strict`, against three raw loops on the same server in the
//!   same run: (a) the strong raw loop — 4 tasks, each one multi-stream `XREADGROUP COUNT b` over
//!   its 2 shards with the acks of its previous batch pipelined in the same round trip (standalone
//!   only: on a cluster keys of different slots cannot share a call); (b) the per-shard raw loop —
//!   the same 4 tasks serving their shards one at a time, `XACK` of the shard's previous batch +
//!   `XREADGROUP` of the shard in one pipeline; (c) the same per-shard loop through the
//!   fence-checking scripts (`ShardClient::ack` and `ShardClient::read_new` in strict mode, sent
//!   together on the multiplexed connection: one round trip). Rounds rotate the order of the
//!   cases; every case of every round has its own consumer group from `0`, so each reads the same
//!   entries. The listener joins and settles (group `STABLE`, every member owning 2 shards, idle)
//!   *before* the clock starts: its consumer groups are then set back to `0` (`XGROUP SETID`) and
//!   one entry per shard wakes the blocked shard tasks; the clock stops when the members have
//!   acked every entry (their `handled` counters). Each case also reports Redis CPU per entry
//!   (`INFO`), this process's CPU per entry (`/proc/self/stat`) and `INFO commandstats`.
//!   Diagnostic cases (only with `E2E_CASES`, tags in [`Case::tag`]): (a) with its acks fenced
//!   as the listener's read rounds fence them (Lua) or through `WATCH`, (c) with acks-mode reads,
//!   (c) with plain `XREADGROUP` reads and fenced acks, (c) without pipelining, the strict and
//!   the acks-mode listener with `runtime_max_concurrency = 2`; and sea-streamer-redis (`benches/sea-streamer`,
//!   run as a process when `E2E_SEA_STREAMER_BIN` names its binary).
//! - `latency`: publish→handler latency (the publish time in µs is in the payload, the handler
//!   subtracts it from its own clock) at 100 msg/s and at 50% of the peak of the strict listener
//!   (measured first, on 400,000 entries), against a raw consumer at the same rates on the same
//!   server: 4 tasks, each a blocking `XREADGROUP ... BLOCK` over its 2 shards on a connection of
//!   its own with the previous acks pipelined (on a cluster: one task and connection per shard).
//! - `memory`: resident memory (`VmRSS` from `/proc/self/status`) of a child process (this
//!   program again) with one listener of 4 members owning 64 shards, idle; then with every shard
//!   holding a read batch in flight (the handler never returns), for two batch sizes: the slope is
//!   the memory per entry in flight. Baseline: the same child with a tokio runtime and a Redis
//!   connection but no listener.
//! - `rebalance`: 12 shards under a steady load of 1,200 msg/s (one entry per shard every 10 ms),
//!   members (one listener of `concurrency = 1` each, in this process) 3 → 4, 4 → 3 by a graceful
//!   leave, 3 → 4 again, then 4 → 3 by `abort()` (a crash without leaving). Per change: shards
//!   moved against the assignor's minimum, the longest gap between handler starts of every shard
//!   that did not move against its longest gap in the 10 s before, and the time until
//!   `describe_group` says `STABLE` with every member converged. At the end: every published
//!   entry was handled (at least once).
//!
//! Environment: `E2E_MESSAGES` (default 1000000), `E2E_ROUNDS` (default 3), `E2E_BATCH` (default
//! 32: the listener's `batch_size` and the raw loops' `COUNT`), `E2E_CLUSTER=0` skips the cluster
//! runs, `E2E_PEAK` (msg/s) skips the latency part's peak measurement, `E2E_CASES` (comma-separated
//! tags) picks the throughput cases, `E2E_RAW_OWN_CONNECTIONS=1` gives each raw task its own
//! connection, `E2E_PROFILE=1` prints a line when a clock starts (to attach `perf`).

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use redis::Value;
use stream_listener_core::admin::{self, GroupDescription};
use stream_listener_core::assignor::{self, AssignorMember, Target};
use stream_listener_core::connection::{RedisConnection, RedisTarget};
use stream_listener_core::coordinator::CoordinatorConfig;
use stream_listener_core::dataplane::{FencingMode, ReadOutcome, ShardClient};
use stream_listener_core::fence::FenceToken;
use stream_listener_core::handler::{Delivery, HandlerError};
use stream_listener_core::keys::StreamKeys;
use stream_listener_core::member::{
    EventCallback, Listener, ListenerEvent, ListenerHandle, ListenerOptions,
};
use stream_listener_core::model::{GroupState, MemberState, StartFrom};
use stream_listener_core::producer::{Publisher, PublisherOptions, shard_for_key};
use stream_listener_core::testing::{RedisCluster, RedisServer};

// ---------------------------------------------------------------------------------------------
// Common helpers
// ---------------------------------------------------------------------------------------------

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

/// `VmRSS` of this process, KiB.
fn rss_kb() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

async fn connect(target: &RedisTarget) -> RedisConnection {
    RedisConnection::connect(target, Duration::from_secs(10))
        .await
        .expect("connect to Redis")
}

/// Protocol timings of the benchmarks' listeners: heartbeat 1 s, lease 10 s (faster settling
/// than the 3 s / 15 s defaults; a steady member's data path does not depend on them).
fn coordination() -> CoordinatorConfig {
    CoordinatorConfig::new(
        Duration::from_secs(1),
        Duration::from_secs(10),
        Duration::from_secs(20),
    )
    .expect("valid timings")
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpu
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .unwrap_or("?")
        .trim()
        .to_owned();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    format!(
        "{cores} cores, {model}, load average {}",
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    )
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .next()
        .unwrap_or("?")
        .to_owned()
}

/// Waits until the group is `STABLE` with `members` live members, each owning exactly its target
/// and nothing pending or revoking. Returns the description.
async fn wait_converged(
    conn: &mut RedisConnection,
    prefix: &str,
    group: &str,
    members: usize,
    limit: Duration,
) -> Option<GroupDescription> {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if let Ok(d) = admin::describe_group(conn, prefix, group, &coordination()).await
            && converged(&d, members)
        {
            return Some(d);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

fn converged(d: &GroupDescription, members: usize) -> bool {
    let live: Vec<_> = d
        .members
        .iter()
        .filter(|m| m.live && m.state == MemberState::Active)
        .collect();
    d.state == GroupState::Stable
        && live.len() == members
        && d.members.len() == members
        && live.iter().all(|m| {
            m.owned == m.target
                && m.assigned == m.target
                && m.pending.is_empty()
                && m.revoking.is_empty()
        })
}

fn target_of(d: &GroupDescription) -> Target {
    d.shards
        .iter()
        .filter_map(|s| s.target_owner.clone().map(|o| (s.shard_index, o)))
        .collect()
}

fn total_handled(handles: &[&ListenerHandle]) -> u64 {
    handles
        .iter()
        .flat_map(|h| h.status())
        .map(|s| s.handled)
        .sum()
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn ms(us: u64) -> String {
    format!("{:.2} ms", us as f64 / 1000.0)
}

/// CPU time of this process (user + system), seconds (`/proc/self/stat`, 10 ms resolution).
fn process_cpu() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which is in parentheses and may hold spaces).
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // utime and stime are fields 14 and 15 of the line: 12 and 13 after the command.
    (ticks(11) + ticks(12)) / 100.0
}

/// Redis `INFO` of a standalone server: total CPU seconds and per-command `(calls, usec)`.
async fn redis_stats(conn: &mut RedisConnection) -> (f64, BTreeMap<String, (u64, u64)>) {
    let info: String = redis::cmd("INFO")
        .arg("everything")
        .query_async(conn)
        .await
        .unwrap_or_default();
    let mut cpu = 0.0;
    let mut commands = BTreeMap::new();
    for line in info.lines() {
        if let Some(v) = line
            .strip_prefix("used_cpu_sys:")
            .or_else(|| line.strip_prefix("used_cpu_user:"))
        {
            cpu += v.trim().parse::<f64>().unwrap_or(0.0);
        }
        if let Some(rest) = line.strip_prefix("cmdstat_")
            && let Some((name, values)) = rest.split_once(':')
        {
            let get = |key: &str| {
                values
                    .split(',')
                    .find_map(|kv| kv.strip_prefix(key))
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or(0)
            };
            commands.insert(name.to_owned(), (get("calls="), get("usec=")));
        }
    }
    (cpu, commands)
}

/// Where the time of one case went: Redis CPU and busy share, client CPU, and the commands
/// (calls, µs per call, µs per entry) from `INFO commandstats`.
struct CaseCost {
    redis_us_per_msg: f64,
    redis_busy: f64,
    client_us_per_msg: f64,
    client_busy: f64,
    commands: Vec<(String, u64, f64, f64)>,
}

/// Started right before a case's clock, finished right after it.
struct CostProbe {
    standalone: bool,
    redis_cpu: f64,
    client_cpu: f64,
}

impl CostProbe {
    async fn start(conn: &mut RedisConnection) -> CostProbe {
        let standalone = !conn.is_cluster();
        let mut redis_cpu = 0.0;
        if standalone {
            let () = redis::cmd("CONFIG")
                .arg("RESETSTAT")
                .query_async(conn)
                .await
                .unwrap();
            redis_cpu = redis_stats(conn).await.0;
        }
        CostProbe {
            standalone,
            redis_cpu,
            client_cpu: process_cpu(),
        }
    }

    async fn finish(self, conn: &mut RedisConnection, n: u64, secs: f64) -> Option<CaseCost> {
        let client = process_cpu() - self.client_cpu;
        if !self.standalone {
            return None;
        }
        let (cpu1, commands) = redis_stats(conn).await;
        let n = n.max(1) as f64;
        let mut commands: Vec<(String, u64, f64, f64)> = commands
            .into_iter()
            .filter(|(name, (calls, _))| *calls > 100 && name != "info")
            .map(|(name, (calls, usec))| (name, calls, usec as f64 / calls as f64, usec as f64 / n))
            .collect();
        commands.sort_by(|a, b| b.3.total_cmp(&a.3));
        Some(CaseCost {
            redis_us_per_msg: (cpu1 - self.redis_cpu) * 1e6 / n,
            redis_busy: (cpu1 - self.redis_cpu) / secs,
            client_us_per_msg: client * 1e6 / n,
            client_busy: client / secs,
            commands,
        })
    }
}

/// With `E2E_PROFILE=1`, prints a line when a timed case starts (to attach a profiler then).
fn profile_marker() {
    if env_usize("E2E_PROFILE", 0) != 0 {
        println!("[profile] clock starts, pid {}", std::process::id());
        std::io::stdout().flush().unwrap();
    }
}

/// Appends `count` small entries round-robin over `shards` shards of `keys`: fields
/// `key key-<n mod 1000>` and `payload {"key":"key-<k>","seq":<n>}` (about 30 bytes), in
/// pipelines of 1,000 (per shard on a cluster).
async fn preload(conn: &mut RedisConnection, keys: &StreamKeys, shards: u32, count: usize) {
    let cluster = conn.is_cluster();
    let shard_keys: Vec<String> = (0..shards).map(|s| keys.shard(s)).collect();
    let mut per_shard: Vec<redis::Pipeline> = (0..shards).map(|_| redis::pipe()).collect();
    let mut one = redis::pipe();
    let mut pending = 0;
    for n in 0..count {
        let shard = n % shards as usize;
        let key = format!("key-{}", n % 1000);
        let payload = format!("{{\"key\":\"{key}\",\"seq\":{n}}}");
        let pipe = if cluster {
            &mut per_shard[shard]
        } else {
            &mut one
        };
        pipe.cmd("XADD")
            .arg(&shard_keys[shard])
            .arg("*")
            .arg("key")
            .arg(&key)
            .arg("payload")
            .arg(&payload)
            .ignore();
        pending += 1;
        if pending == 1000 || n + 1 == count {
            pending = 0;
            if cluster {
                for p in &mut per_shard {
                    let () = p.query_async(conn).await.expect("preload");
                    *p = redis::pipe();
                }
            } else {
                let () = one.query_async(conn).await.expect("preload");
                one = redis::pipe();
            }
        }
    }
}

async fn stream_length(conn: &mut RedisConnection, keys: &StreamKeys, shards: u32) -> u64 {
    let mut total = 0;
    for s in 0..shards {
        let n: u64 = redis::cmd("XLEN")
            .arg(keys.shard(s))
            .query_async(conn)
            .await
            .expect("XLEN");
        total += n;
    }
    total
}

async fn create_groups(conn: &mut RedisConnection, keys: &StreamKeys, shards: u32, group: &str) {
    for s in 0..shards {
        let () = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(keys.shard(s))
            .arg(group)
            .arg("0")
            .query_async(conn)
            .await
            .expect("XGROUP CREATE");
    }
}

async fn destroy_groups(conn: &mut RedisConnection, keys: &StreamKeys, shards: u32, group: &str) {
    for s in 0..shards {
        let _: redis::RedisResult<i64> = redis::cmd("XGROUP")
            .arg("DESTROY")
            .arg(keys.shard(s))
            .arg(group)
            .query_async(conn)
            .await;
    }
}

/// Parses an `XREADGROUP` reply (RESP2): for each stream, its index in `keys` and the entry ids;
/// `on_entry` sees each entry's fields.
fn parse_read(
    reply: Value,
    keys: &[String],
    ids: &mut [Vec<String>],
    mut on_entry: impl FnMut(&[Value]),
) -> usize {
    let Value::Array(streams) = reply else {
        return 0;
    };
    let mut got = 0;
    for stream in streams {
        let Value::Array(mut pair) = stream else {
            continue;
        };
        if pair.len() != 2 {
            continue;
        }
        let entries = pair.pop();
        let name = match pair.pop() {
            Some(Value::BulkString(b)) => b,
            _ => continue,
        };
        let Some(index) = keys.iter().position(|k| k.as_bytes() == name.as_slice()) else {
            continue;
        };
        let Some(Value::Array(entries)) = entries else {
            continue;
        };
        for entry in entries {
            let Value::Array(mut parts) = entry else {
                continue;
            };
            if parts.len() != 2 {
                continue;
            }
            if let Value::Array(fields) = &parts[1] {
                on_entry(fields);
            }
            if let Value::BulkString(id) = parts.swap_remove(0) {
                ids[index].push(String::from_utf8(id).unwrap_or_default());
                got += 1;
            }
        }
    }
    got
}

// ---------------------------------------------------------------------------------------------
// 1. Throughput
// ---------------------------------------------------------------------------------------------

const TP_PREFIX: &str = "tp";
const TP_SHARDS: u32 = 8;
const TP_TASKS: u32 = 4;

/// The shards of raw task `t` (of 4): `t` and `t + 4`.
fn task_shards(t: u32) -> Vec<u32> {
    (0..TP_SHARDS).filter(|s| s % TP_TASKS == t).collect()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Case {
    RawStrong,
    /// Diagnostic: (a) with its acks fenced as the acks-mode listener's read rounds fence them
    /// (one `ack_shards` script call per round, each shard with its own token): the listener's
    /// Redis commands without the listener.
    RawStrongFencedAck,
    /// Diagnostic: (a) with its acks fenced through `WATCH` instead of Lua: one pipeline of
    /// `WATCH` (the fences and a tripwire key), a script without ids that checks each fence and
    /// writes the tripwire on a refusal, `MULTI`, the plain `XACK`s, `EXEC`, the read. `EXEC`
    /// runs only if no watched key changed after the check. A measurement of a cheaper fence,
    /// not something the listener does.
    RawStrongWatchAck,
    RawPerShard,
    FencedScripts,
    ListenerAcks,
    ListenerStrict,
    /// Diagnostic: (c) with the read in acks mode (the read script without the fence check).
    FencedAcksRead,
    /// Diagnostic: (c) without pipelining: read, then ack, then the next read (two round trips
    /// per batch, the shape of the listener's shard task).
    FencedSequential,
    /// Diagnostic: the strict listener with `runtime_max_concurrency = 2` (each member's two
    /// shards handle and ack in parallel instead of taking turns on one worker).
    ListenerStrictWorkers2,
    /// Diagnostic: the acks-mode listener with `runtime_max_concurrency = 2` (a member's two
    /// shard tasks never wait for each other's worker).
    ListenerAcksWorkers2,
    /// Diagnostic: (c) with plain `XREADGROUP` reads and the fenced ack script (what acks mode
    /// could cost: only acks and claims need the fence).
    PlainReadFencedAck,
    /// sea-streamer-redis (LoadBalanced, Rolling commit), as a separate process on the same
    /// server (its own copy of the entries, keys `ss:<i>`, field `msg`).
    SeaStreamer,
}

impl Case {
    fn name(self) -> &'static str {
        match self {
            Case::RawStrong => "raw multi-stream XREADGROUP + pipelined XACK (a)",
            Case::RawStrongFencedAck => "diagnostic: (a) with the rounds' fenced ack (ack_shards)",
            Case::RawStrongWatchAck => "diagnostic: (a) with acks fenced by WATCH/MULTI/EXEC",
            Case::RawPerShard => "raw per-shard XREADGROUP + pipelined XACK (b)",
            Case::FencedScripts => "raw per-shard fenced scripts, strict read_new + ack (c)",
            Case::ListenerAcks => "Listener, fencing = acks",
            Case::ListenerStrict => "Listener, fencing = strict (default)",
            Case::FencedAcksRead => "diagnostic: (c) with acks-mode reads (no fence check)",
            Case::FencedSequential => "diagnostic: (c) with read and ack in turn, not pipelined",
            Case::ListenerStrictWorkers2 => {
                "diagnostic: Listener, strict, runtime_max_concurrency = 2"
            }
            Case::ListenerAcksWorkers2 => "diagnostic: Listener, acks, runtime_max_concurrency = 2",
            Case::PlainReadFencedAck => "diagnostic: (c) with plain XREADGROUP reads, fenced acks",
            Case::SeaStreamer => {
                "sea-streamer-redis 1.0.0-rc.5, LoadBalanced, Rolling, 4 consumers: all received"
            }
        }
    }

    fn tag(self) -> &'static str {
        match self {
            Case::RawStrong => "strong",
            Case::RawStrongFencedAck => "strongfack",
            Case::RawStrongWatchAck => "strongwatch",
            Case::RawPerShard => "pershard",
            Case::FencedScripts => "fenced",
            Case::ListenerAcks => "lacks",
            Case::ListenerStrict => "lstrict",
            Case::FencedAcksRead => "fencedacks",
            Case::FencedSequential => "fencedseq",
            Case::ListenerStrictWorkers2 => "lstrictw2",
            Case::ListenerAcksWorkers2 => "lacksw2",
            Case::PlainReadFencedAck => "plainreadfack",
            Case::SeaStreamer => "seastreamer",
        }
    }
}

/// (a) One multi-stream `XREADGROUP` per round trip over the task's shards, with the previous
/// batch's `XACK`s in the same pipeline; with `watch`, the `XACK`s are fenced by it
/// ([`Case::RawStrongWatchAck`]).
async fn raw_strong(
    mut conn: RedisConnection,
    keys: Vec<String>,
    group: String,
    consumer: String,
    batch: usize,
    watch: Option<WatchFence>,
) -> u64 {
    let mut acks: Vec<Vec<String>> = vec![Vec::new(); keys.len()];
    let mut total = 0;
    loop {
        let acking = acks.iter().any(|ids| !ids.is_empty());
        let watched = watch.as_ref().filter(|_| acking);
        let mut pipe = redis::pipe();
        if let Some(watch) = watched {
            watch.open(&mut pipe, &group);
        }
        for (key, ids) in keys.iter().zip(&acks) {
            if !ids.is_empty() {
                pipe.cmd("XACK").arg(key).arg(&group).arg(ids).ignore();
            }
        }
        if watched.is_some() {
            pipe.cmd("EXEC");
        }
        add_multi_stream_read(&mut pipe, &group, &consumer, batch, &keys);
        let mut replies: Vec<Value> = pipe.query_async(&mut conn).await.expect("raw read");
        let reply = replies.pop().expect("read reply");
        if watched.is_some() {
            let exec = replies.pop().expect("exec reply");
            assert_eq!(replies.pop(), Some(Value::Int(1)), "fence refused");
            assert!(
                matches!(exec, Value::Array(_)),
                "transaction aborted: {exec:?}"
            );
        }
        for ids in &mut acks {
            ids.clear();
        }
        let got = parse_read(reply, &keys, &mut acks, |_| {});
        if got == 0 {
            return total;
        }
        total += got as u64;
    }
}

/// Acks fenced through `WATCH` instead of Lua ([`Case::RawStrongWatchAck`]): a task's fence
/// hashes, its tripwire key (`{<first shard>}:trip`, standalone only), its encoded token and
/// the check script.
struct WatchFence {
    fences: Vec<String>,
    trip: String,
    encoded: String,
    check: redis::Script,
}

impl WatchFence {
    async fn new(
        conn: &mut RedisConnection,
        fences: Vec<String>,
        trip: String,
        token: &FenceToken,
    ) -> Self {
        // KEYS: the fences, then the tripwire; ARGV[1] the group, ARGV[2] the encoded token.
        let check = redis::Script::new(
            r"
for i = 1, #KEYS - 1 do
  if redis.call('HGET', KEYS[i], ARGV[1]) ~= ARGV[2] then
    redis.call('INCR', KEYS[#KEYS])
    return 0
  end
end
return 1
",
        );
        let _: String = check.prepare_invoke().load_async(conn).await.expect("load");
        WatchFence {
            fences,
            trip,
            encoded: token.encode(),
            check,
        }
    }

    /// `WATCH` the fences and the tripwire, check the fences (the tripwire is written on a
    /// refusal), `MULTI`: the caller adds the `XACK`s and `EXEC`.
    fn open(&self, pipe: &mut redis::Pipeline, group: &str) {
        pipe.cmd("WATCH").arg(&self.fences).arg(&self.trip).ignore();
        pipe.cmd("EVALSHA")
            .arg(self.check.get_hash())
            .arg(self.fences.len() + 1)
            .arg(&self.fences)
            .arg(&self.trip)
            .arg(group)
            .arg(&self.encoded);
        pipe.cmd("MULTI").ignore();
    }
}

/// Diagnostic (a) with fenced acks: per round one pipeline of one `ack_shards` call (each shard
/// fenced with the task's token) and the multi-stream `XREADGROUP`
/// (`ShardClient::read_round`, the acks-mode listener's read round).
async fn raw_strong_fenced_ack(
    mut client: ShardClient,
    shards: Vec<u32>,
    keys: Vec<String>,
    token: FenceToken,
    batch: usize,
) -> u64 {
    let mut acks: Vec<Vec<String>> = vec![Vec::new(); shards.len()];
    let mut total = 0;
    loop {
        let parts: Vec<(u32, &FenceToken, &[String])> = shards
            .iter()
            .zip(&acks)
            .map(|(&shard, ids)| (shard, &token, ids.as_slice()))
            .collect();
        let replies = client
            .read_round(&parts, batch)
            .await
            .expect("fenced round");
        let mut next = vec![Vec::new(); shards.len()];
        let mut got = 0;
        for (i, (ack, read)) in replies.into_iter().enumerate() {
            match ack {
                // The script was not loaded yet (the first round loads it): ack them next round.
                Some(Err(e)) if e.code() == Some("NOSCRIPT") => next[i] = acks[i].clone(),
                Some(ack) => {
                    let ack = ack.expect("fenced ack");
                    let ok = |v: Option<&Value>| match v {
                        Some(Value::SimpleString(s)) => s == "OK",
                        Some(Value::BulkString(b)) => b == b"OK",
                        _ => false,
                    };
                    assert!(
                        matches!(&ack, Value::Array(reply) if ok(reply.first())),
                        "fenced ack refused: {ack:?}"
                    );
                }
                None => {}
            }
            let mut ids = vec![Vec::new()];
            got += parse_read(read, &keys[i..=i], &mut ids, |_| {});
            next[i].extend(ids.pop().unwrap_or_default());
        }
        acks = next;
        if got == 0 {
            return total;
        }
        total += got as u64;
    }
}

/// Adds `XREADGROUP GROUP <group> <consumer> COUNT <batch> STREAMS <keys…> > …` to `pipe`.
fn add_multi_stream_read(
    pipe: &mut redis::Pipeline,
    group: &str,
    consumer: &str,
    batch: usize,
    keys: &[String],
) {
    pipe.cmd("XREADGROUP")
        .arg("GROUP")
        .arg(group)
        .arg(consumer)
        .arg("COUNT")
        .arg(batch)
        .arg("STREAMS")
        .arg(keys);
    for _ in keys {
        pipe.arg(">");
    }
}

/// (b) The task's shards one at a time: `XACK` of the shard's previous batch and `XREADGROUP` of
/// the shard in one pipeline.
async fn raw_per_shard(
    mut conn: RedisConnection,
    keys: Vec<String>,
    group: String,
    consumer: String,
    batch: usize,
) -> u64 {
    let mut acks: Vec<Vec<String>> = vec![Vec::new(); keys.len()];
    let mut done = vec![false; keys.len()];
    let mut total = 0;
    while done.iter().any(|d| !d) {
        for i in 0..keys.len() {
            if done[i] {
                continue;
            }
            let mut pipe = redis::pipe();
            if !acks[i].is_empty() {
                pipe.cmd("XACK")
                    .arg(&keys[i])
                    .arg(&group)
                    .arg(&acks[i])
                    .ignore();
            }
            pipe.cmd("XREADGROUP")
                .arg("GROUP")
                .arg(&group)
                .arg(&consumer)
                .arg("COUNT")
                .arg(batch)
                .arg("STREAMS")
                .arg(&keys[i])
                .arg(">");
            let (reply,): (Value,) = pipe.query_async(&mut conn).await.expect("raw read");
            acks[i].clear();
            let mut ids = vec![Vec::new()];
            let got = parse_read(reply, &keys[i..=i], &mut ids, |_| {});
            acks[i] = ids.pop().unwrap_or_default();
            if got == 0 {
                done[i] = true;
            }
            total += got as u64;
        }
    }
    total
}

/// (c) The per-shard loop through the fence-checking scripts: the shard's previous batch acked with
/// `ShardClient::ack` and the next read with `ShardClient::read_new` (strict), both sent at once
/// on the multiplexed connection (one round trip).
async fn fenced_scripts(
    client: ShardClient,
    shards: Vec<u32>,
    token: FenceToken,
    batch: usize,
    mode: FencingMode,
    pipelined: bool,
    mut plain: Option<RedisConnection>,
) -> u64 {
    let mut acks: Vec<Vec<String>> = vec![Vec::new(); shards.len()];
    let mut done = vec![false; shards.len()];
    let mut total = 0;
    let mut reader = client.clone();
    let mut acker = client;
    while done.iter().any(|d| !d) {
        for i in 0..shards.len() {
            if done[i] {
                continue;
            }
            let shard = shards[i];
            let ids = std::mem::take(&mut acks[i]);
            let ack = async {
                if !ids.is_empty() {
                    let acked = acker.ack(shard, &token, &ids).await.expect("ack");
                    assert_eq!(acked.expect("fence"), ids.len());
                }
            };
            let read = if let Some(conn) = plain.as_mut() {
                let key = reader.keys().shard(shard);
                let mut cmd = redis::cmd("XREADGROUP");
                cmd.arg("GROUP")
                    .arg(reader.group())
                    .arg(reader.consumer())
                    .arg("COUNT")
                    .arg(batch)
                    .arg("STREAMS")
                    .arg(&key)
                    .arg(">");
                let read = cmd.query_async::<Value>(conn);
                let ((), reply) = tokio::join!(ack, read);
                let mut ids = vec![Vec::new()];
                let got = parse_read(reply.expect("read"), &[key], &mut ids, |_| {});
                if got == 0 {
                    done[i] = true;
                }
                total += got as u64;
                acks[i] = ids.pop().unwrap_or_default();
                continue;
            } else if pipelined {
                let read = reader.read_new(shard, &token, batch, mode);
                let ((), read) = tokio::join!(ack, read);
                read
            } else {
                ack.await;
                reader.read_new(shard, &token, batch, mode).await
            };
            match read.expect("read_new") {
                ReadOutcome::Entries(entries) => {
                    total += entries.len() as u64;
                    acks[i] = entries.into_iter().map(|e| e.id).collect();
                }
                ReadOutcome::Empty { .. } => done[i] = true,
                ReadOutcome::Fenced(f) => panic!("fenced: {f:?}"),
            }
        }
    }
    total
}

/// Pre-loads sea-streamer's own copy of the entries (`ss:<i>`, field `msg`, the same payloads) and
/// runs its consumer binary; the time is the binary's, until every entry is acked in Redis.
async fn run_sea_streamer(setup: &TpSetup, round: usize) -> (u64, f64, Option<CaseCost>) {
    let bin = std::env::var("E2E_SEA_STREAMER_BIN").expect("E2E_SEA_STREAMER_BIN");
    let RedisTarget::Standalone(url) = &setup.target else {
        panic!("sea-streamer runs on the standalone server only");
    };
    let mut conn = setup.conn.clone();
    let stream = format!("ss{round}");
    let mut pipe = redis::pipe();
    for n in 0..setup.messages {
        let shard = n % TP_SHARDS as usize;
        let payload = format!("{{\"key\":\"key-{}\",\"seq\":{n}}}", n % 1000);
        pipe.cmd("XADD")
            .arg(format!("{stream}:{shard}"))
            .arg("*")
            .arg("msg")
            .arg(payload)
            .ignore();
        if (n + 1) % 1000 == 0 || n + 1 == setup.messages {
            let () = pipe.query_async(&mut conn).await.expect("preload");
            pipe = redis::pipe();
        }
    }
    profile_marker();
    let probe = CostProbe::start(&mut conn).await;
    let started = Instant::now();
    let out = Command::new(&bin)
        .arg(url)
        .arg(&stream)
        .arg(setup.messages.to_string())
        .arg("4")
        .arg(setup.batch.to_string())
        .output()
        .expect("run sea-streamer-consume");
    let wall = started.elapsed().as_secs_f64();
    let text = String::from_utf8_lossy(&out.stdout);
    let value = |key: &str| {
        text.split_whitespace()
            .find_map(|kv| kv.strip_prefix(key))
            .and_then(|v| v.parse::<f64>().ok())
    };
    let (Some(received), Some(acked), Some(n)) =
        (value("received_s="), value("acked_s="), value("count="))
    else {
        panic!(
            "sea-streamer-consume failed: {text} {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    println!(
        "        sea-streamer: received all after {received:.2} s, when {} were still pending in Redis; all acked in Redis after {acked:.2} s (process wall {wall:.2} s)",
        value("pending_at_received=").unwrap_or(0.0)
    );
    // The client CPU is the child's: not in this process's figures.
    let cost = probe.finish(&mut conn, n as u64, received).await;
    for s in 0..TP_SHARDS {
        let () = redis::cmd("DEL")
            .arg(format!("{stream}:{s}"))
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    (n as u64, received, cost)
}

struct TpSetup {
    prefix: &'static str,
    messages: usize,
    target: RedisTarget,
    conn: RedisConnection,
    keys: StreamKeys,
    batch: usize,
}

/// Runs one case on its own consumer group; returns (entries, seconds, costs).
async fn run_case(setup: &TpSetup, case: Case, round: usize) -> (u64, f64, Option<CaseCost>) {
    let group = format!("{}-r{round}", case.tag());
    let mut conn = setup.conn.clone();
    match case {
        Case::SeaStreamer => run_sea_streamer(setup, round).await,
        Case::ListenerAcks
        | Case::ListenerStrict
        | Case::ListenerStrictWorkers2
        | Case::ListenerAcksWorkers2 => {
            let workers = match case {
                Case::ListenerStrictWorkers2 | Case::ListenerAcksWorkers2 => 2,
                _ => 1,
            };
            let acks = matches!(case, Case::ListenerAcks | Case::ListenerAcksWorkers2);
            run_listener_case(setup, &group, acks, workers).await
        }
        _ => {
            create_groups(&mut conn, &setup.keys, TP_SHARDS, &group).await;
            let client = ShardClient::new(setup.conn.clone(), setup.keys.clone(), &group, "fenced")
                .expect("client");
            let mut tokens = Vec::new();
            for t in 0..TP_TASKS {
                let token = FenceToken {
                    incarnation: 1,
                    member_epoch: 1,
                    member_id: format!("fenced-{t}"),
                    process_id: "bench".into(),
                };
                if matches!(
                    case,
                    Case::FencedScripts
                        | Case::FencedAcksRead
                        | Case::FencedSequential
                        | Case::PlainReadFencedAck
                        | Case::RawStrongFencedAck
                        | Case::RawStrongWatchAck
                ) {
                    let mut c = ShardClient::new(
                        setup.conn.clone(),
                        setup.keys.clone(),
                        &group,
                        &format!("fenced-{t}"),
                    )
                    .expect("client");
                    for s in task_shards(t) {
                        c.raise_fence(s, &token)
                            .await
                            .expect("raise")
                            .expect("raised");
                    }
                }
                tokens.push(token);
            }
            drop(client);
            // One shared multiplexed connection (as the listener has), or one per task.
            let own_conns = env_usize("E2E_RAW_OWN_CONNECTIONS", 0) != 0;
            let mut conns = Vec::new();
            for _ in 0..TP_TASKS {
                conns.push(if own_conns {
                    connect(&setup.target).await
                } else {
                    setup.conn.clone()
                });
            }
            profile_marker();
            let probe = CostProbe::start(&mut conn).await;
            let start = Instant::now();
            let mut tasks = Vec::new();
            for t in 0..TP_TASKS {
                let shards = task_shards(t);
                let keys: Vec<String> = shards.iter().map(|s| setup.keys.shard(*s)).collect();
                let conn = conns[t as usize].clone();
                let group = group.clone();
                let consumer = format!("fenced-{t}");
                let batch = setup.batch;
                let token = tokens[t as usize].clone();
                let stream = setup.keys.clone();
                tasks.push(tokio::spawn(async move {
                    match case {
                        Case::RawStrong => {
                            raw_strong(conn, keys, group, consumer, batch, None).await
                        }
                        Case::RawStrongFencedAck => {
                            let client =
                                ShardClient::new(conn, stream, &group, &consumer).expect("client");
                            raw_strong_fenced_ack(client, shards, keys, token, batch).await
                        }
                        Case::RawStrongWatchAck => {
                            let mut conn = conn;
                            let fences = shards.iter().map(|&s| stream.fence(s)).collect();
                            let trip = format!("{}:trip", keys[0]);
                            let watch = WatchFence::new(&mut conn, fences, trip, &token).await;
                            raw_strong(conn, keys, group, consumer, batch, Some(watch)).await
                        }
                        Case::RawPerShard => {
                            raw_per_shard(conn, keys, group, consumer, batch).await
                        }
                        _ => {
                            let mode = if case == Case::FencedAcksRead {
                                FencingMode::Acks
                            } else {
                                FencingMode::Strict
                            };
                            let pipelined = case != Case::FencedSequential;
                            let plain = (case == Case::PlainReadFencedAck).then(|| conn.clone());
                            let client =
                                ShardClient::new(conn, stream, &group, &consumer).expect("client");
                            fenced_scripts(client, shards, token, batch, mode, pipelined, plain)
                                .await
                        }
                    }
                }));
            }
            let mut total = 0;
            for task in tasks {
                total += task.await.expect("task");
            }
            let secs = start.elapsed().as_secs_f64();
            let cost = probe.finish(&mut conn, total, secs).await;
            destroy_groups(&mut conn, &setup.keys, TP_SHARDS, &group).await;
            (total, secs, cost)
        }
    }
}

/// The listener case: join and settle first, then rewind its consumer groups to `0` and wake the
/// shard tasks; the clock runs until every entry is acked.
async fn run_listener_case(
    setup: &TpSetup,
    group: &str,
    acks: bool,
    workers: u32,
) -> (u64, f64, Option<CaseCost>) {
    let mut conn = setup.conn.clone();
    let mut options = ListenerOptions::default();
    options.concurrency = 4;
    options.batch_size = setup.batch;
    options.runtime_max_concurrency = workers;
    options.fencing = if acks {
        FencingMode::Acks
    } else {
        FencingMode::Strict
    };
    options.start_from = StartFrom::Latest;
    options.coordination = coordination();
    let handler = |_delivery: Delivery| async { Ok::<(), HandlerError>(()) };
    let handle = Listener::new(setup.target.clone(), setup.prefix, group, handler, options)
        .expect("listener")
        .start()
        .await
        .expect("start");
    wait_converged(&mut conn, setup.prefix, group, 4, Duration::from_secs(60))
        .await
        .expect("listener group converged");
    // Let every shard task finish its takeover and block in XREAD.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = total_handled(&[&handle]);
    profile_marker();
    let probe = CostProbe::start(&mut conn).await;
    let start = Instant::now();
    let cluster = conn.is_cluster();
    let mut pipe = redis::pipe();
    for s in 0..TP_SHARDS {
        let key = setup.keys.shard(s);
        pipe.cmd("XGROUP")
            .arg("SETID")
            .arg(&key)
            .arg(group)
            .arg("0")
            .ignore();
        pipe.cmd("XADD")
            .arg(&key)
            .arg("*")
            .arg("key")
            .arg("wake")
            .arg("payload")
            .arg("{}")
            .ignore();
        if cluster {
            let () = pipe.query_async(&mut conn).await.expect("rewind");
            pipe = redis::pipe();
        }
    }
    if !cluster {
        let () = pipe.query_async(&mut conn).await.expect("rewind");
    }
    let target = stream_length(&mut conn, &setup.keys, TP_SHARDS).await;
    loop {
        if total_handled(&[&handle]) - before >= target {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
        if start.elapsed() > Duration::from_secs(120) {
            panic!(
                "listener case did not finish: {} of {target}",
                total_handled(&[&handle]) - before
            );
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let total = total_handled(&[&handle]) - before;
    let cost = probe.finish(&mut conn, total, secs).await;
    handle.shutdown_and_wait().await;
    (total, secs, cost)
}

async fn throughput(target: RedisTarget, label: &str) -> BTreeMap<Case, f64> {
    let messages = env_usize("E2E_MESSAGES", 1_000_000);
    let rounds = env_usize("E2E_ROUNDS", 3);
    let batch = env_usize("E2E_BATCH", 32);
    let mut conn = connect(&target).await;
    let cluster = conn.is_cluster();
    admin::create_stream(&mut conn, TP_PREFIX, TP_SHARDS)
        .await
        .expect("create stream");
    let keys = StreamKeys::new(TP_PREFIX).unwrap();
    let loading = Instant::now();
    preload(&mut conn, &keys, TP_SHARDS, messages).await;
    println!(
        "[{label}] pre-loaded {messages} entries over {TP_SHARDS} shards in {:.1} s (outside the clock); batch {batch}, {rounds} rounds",
        loading.elapsed().as_secs_f64()
    );
    let setup = TpSetup {
        prefix: TP_PREFIX,
        messages,
        target,
        conn,
        keys,
        batch,
    };
    let mut cases = vec![
        Case::RawStrong,
        Case::RawPerShard,
        Case::FencedScripts,
        Case::ListenerAcks,
        Case::ListenerStrict,
    ];
    if cluster {
        cases.retain(|c| *c != Case::RawStrong);
    } else if std::env::var("E2E_SEA_STREAMER_BIN").is_ok() {
        cases.push(Case::SeaStreamer);
    }
    if let Ok(only) = std::env::var("E2E_CASES") {
        cases = [
            Case::RawStrong,
            Case::RawStrongFencedAck,
            Case::RawStrongWatchAck,
            Case::RawPerShard,
            Case::FencedScripts,
            Case::ListenerAcks,
            Case::ListenerStrict,
            Case::FencedAcksRead,
            Case::FencedSequential,
            Case::ListenerStrictWorkers2,
            Case::ListenerAcksWorkers2,
            Case::PlainReadFencedAck,
            Case::SeaStreamer,
        ]
        .into_iter()
        .filter(|c| only.split(',').any(|t| t == c.tag()))
        .filter(|c| {
            !cluster
                || !matches!(
                    c,
                    Case::RawStrong | Case::RawStrongFencedAck | Case::SeaStreamer
                )
        })
        .collect();
    }
    let mut results: BTreeMap<Case, Vec<(u64, f64)>> = BTreeMap::new();
    let mut costs: BTreeMap<Case, Vec<CaseCost>> = BTreeMap::new();
    for round in 0..rounds {
        let mut order = cases.clone();
        order.rotate_left(round % cases.len());
        for case in order {
            let (n, secs, cost) = run_case(&setup, case, round).await;
            println!(
                "[{label}] round {round} {:<58} {n:>8} entries {secs:>6.2} s {:>9.0} msg/s (load {})",
                case.name(),
                n as f64 / secs,
                load_average()
            );
            if let Some(c) = cost {
                let top: Vec<String> = c
                    .commands
                    .iter()
                    .take(4)
                    .map(|(name, calls, per_call, per_msg)| {
                        format!("{name} {calls} calls {per_call:.1} µs/call {per_msg:.2} µs/entry")
                    })
                    .collect();
                println!(
                    "        Redis {:.2} µs CPU/entry (busy {:.0}% of a core), client {:.2} µs CPU/entry (busy {:.0}% of a core); {}",
                    c.redis_us_per_msg,
                    c.redis_busy * 100.0,
                    c.client_us_per_msg,
                    c.client_busy * 100.0,
                    top.join("; ")
                );
                costs.entry(case).or_default().push(c);
            }
            results.entry(case).or_default().push((n, secs));
        }
    }
    let rate = |case: Case| -> f64 {
        let Some(v) = results.get(&case) else {
            return f64::NAN;
        };
        let n: u64 = v.iter().map(|(n, _)| n).sum();
        let s: f64 = v.iter().map(|(_, s)| s).sum();
        n as f64 / s
    };
    let median_ratio = |num: Case, den: Case| -> f64 {
        let (Some(num), Some(den)) = (results.get(&num), results.get(&den)) else {
            return f64::NAN;
        };
        let mut r: Vec<f64> = num
            .iter()
            .zip(den)
            .map(|(a, b)| (a.0 as f64 / a.1) / (b.0 as f64 / b.1))
            .collect();
        r.sort_by(f64::total_cmp);
        r[r.len() / 2]
    };
    let baseline = if cluster {
        Case::RawPerShard
    } else {
        Case::RawStrong
    };
    println!("\n[{label}] throughput, {messages} entries per case, batch {batch}");
    println!(
        "| case | msgs/s (all rounds) | ratio to {} | ratio to (c) | median of per-round ratios to {} / to (c) |",
        baseline.tag(),
        baseline.tag()
    );
    println!("| --- | --- | --- | --- | --- |");
    let mut out = BTreeMap::new();
    for case in &cases {
        let r = rate(*case);
        out.insert(*case, r);
        println!(
            "| {} | {:.0} | {:.3} | {:.3} | {:.3} / {:.3} |",
            case.name(),
            r,
            r / rate(baseline),
            r / rate(Case::FencedScripts),
            median_ratio(*case, baseline),
            median_ratio(*case, Case::FencedScripts)
        );
    }
    if !costs.is_empty() {
        println!(
            "\n[{label}] where the time goes (means over rounds; CPU from INFO and /proc/self/stat)"
        );
        println!(
            "| case | Redis µs CPU per entry | Redis busy (share of a core) | client µs CPU per entry | client busy (share of the 2 cores' time, in cores) | Redis commands: µs per entry (µs per call) |"
        );
        println!("| --- | --- | --- | --- | --- | --- |");
        for case in &cases {
            let Some(v) = costs.get(case) else { continue };
            let mean = |f: &dyn Fn(&CaseCost) -> f64| v.iter().map(f).sum::<f64>() / v.len() as f64;
            let last = &v[v.len() - 1];
            let commands: Vec<String> = last
                .commands
                .iter()
                .take(4)
                .map(|(name, _, per_call, per_msg)| format!("{name} {per_msg:.2} ({per_call:.1})"))
                .collect();
            println!(
                "| {} | {:.2} | {:.0}% | {:.2} | {:.2} | {} |",
                case.name(),
                mean(&|c| c.redis_us_per_msg),
                mean(&|c| c.redis_busy) * 100.0,
                mean(&|c| c.client_us_per_msg),
                mean(&|c| c.client_busy),
                commands.join(", ")
            );
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// 2. Latency
// ---------------------------------------------------------------------------------------------

const LAT_SHARDS: u32 = 8;

#[derive(serde::Serialize, serde::Deserialize)]
struct Stamped {
    key: String,
    us: u64,
    phase: u32,
}

/// Publishes at `rate` msg/s for `secs` seconds; payload `{"key","us","phase"}`.
async fn publish_at(publisher: &Publisher, rate: f64, secs: f64, phase: u32) -> u64 {
    let start = Instant::now();
    let tick = if rate <= 1000.0 {
        Duration::from_secs_f64(1.0 / rate)
    } else {
        Duration::from_millis(1)
    };
    let mut interval = tokio::time::interval(tick);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut sent: u64 = 0;
    let mut n: u64 = 0;
    while start.elapsed().as_secs_f64() < secs {
        interval.tick().await;
        let due = (rate * start.elapsed().as_secs_f64()) as u64;
        let count = due.saturating_sub(sent).min(5_000);
        if count == 0 {
            continue;
        }
        let us = now_us();
        let batch: Vec<(String, Stamped)> = (0..count)
            .map(|_| {
                n += 1;
                let key = format!("k{}", n % 997);
                (key.clone(), Stamped { key, us, phase })
            })
            .collect();
        if count == 1 {
            publisher
                .publish(&batch[0].0, &batch[0].1)
                .await
                .expect("publish");
        } else {
            publisher.publish_batch(&batch).await.expect("publish");
        }
        sent += count;
    }
    sent
}

type Samples = Arc<Mutex<BTreeMap<u32, Vec<u64>>>>;

fn record(samples: &Samples, payload: &[u8]) {
    if let Ok(s) = serde_json::from_slice::<Stamped>(payload) {
        let latency = now_us().saturating_sub(s.us);
        samples
            .lock()
            .unwrap()
            .entry(s.phase)
            .or_default()
            .push(latency);
    }
}

/// The raw consumer: 4 tasks, each blocking `XREADGROUP` over its 2 shards on a connection of its
/// own, acks of the previous batch pipelined.
fn spawn_raw_consumer(
    target: &RedisTarget,
    keys: &StreamKeys,
    group: &str,
    batch: usize,
    samples: Samples,
    stop: Arc<AtomicUsize>,
) -> Vec<tokio::task::JoinHandle<()>> {
    // Standalone: 4 tasks over 2 shards each; cluster (one slot per call): one task per shard.
    let groups: Vec<Vec<u32>> = if matches!(target, RedisTarget::Cluster(_)) {
        (0..LAT_SHARDS).map(|s| vec![s]).collect()
    } else {
        (0..TP_TASKS).map(task_shards).collect()
    };
    groups
        .into_iter()
        .enumerate()
        .map(|(t, shards)| {
            let target = target.clone();
            let keys: Vec<String> = shards.iter().map(|s| keys.shard(*s)).collect();
            let group = group.to_owned();
            let samples = samples.clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut conn = connect(&target).await;
                let mut acks: Vec<Vec<String>> = vec![Vec::new(); keys.len()];
                while stop.load(Ordering::Relaxed) == 0 {
                    let mut pipe = redis::pipe();
                    for (key, ids) in keys.iter().zip(&acks) {
                        if !ids.is_empty() {
                            pipe.cmd("XACK").arg(key).arg(&group).arg(ids).ignore();
                        }
                    }
                    pipe.cmd("XREADGROUP")
                        .arg("GROUP")
                        .arg(&group)
                        .arg(format!("raw-{t}"))
                        .arg("COUNT")
                        .arg(batch)
                        .arg("BLOCK")
                        .arg(500)
                        .arg("STREAMS")
                        .arg(&keys);
                    for _ in &keys {
                        pipe.arg(">");
                    }
                    let (reply,): (Value,) = pipe.query_async(&mut conn).await.expect("raw read");
                    for ids in &mut acks {
                        ids.clear();
                    }
                    parse_read(reply, &keys, &mut acks, |fields| {
                        let payload = fields.chunks(2).find_map(|kv| match kv {
                            [Value::BulkString(k), Value::BulkString(v)] if k == b"payload" => {
                                Some(v.as_slice())
                            }
                            _ => None,
                        });
                        if let Some(p) = payload {
                            record(&samples, p);
                        }
                    });
                }
            })
        })
        .collect()
}

async fn latency(target: RedisTarget, label: &str, peak: Option<f64>) {
    let batch = env_usize("E2E_BATCH", 32);
    let mut conn = connect(&target).await;
    let cluster = conn.is_cluster();
    // The peak of the strict listener on this server now (unless given).
    let peak = match peak {
        Some(p) => p,
        None => {
            admin::create_stream(&mut conn, "peak", TP_SHARDS)
                .await
                .unwrap();
            let keys = StreamKeys::new("peak").unwrap();
            preload(&mut conn, &keys, TP_SHARDS, 400_000).await;
            let setup = TpSetup {
                prefix: "peak",
                messages: 400_000,
                target: target.clone(),
                conn: conn.clone(),
                keys: keys.clone(),
                batch,
            };
            let (n, secs, _) = run_listener_case(&setup, "peak", false, 1).await;
            for s in 0..TP_SHARDS {
                let () = redis::cmd("DEL")
                    .arg(keys.shard(s))
                    .query_async(&mut conn)
                    .await
                    .unwrap();
            }
            n as f64 / secs
        }
    };
    let half = peak / 2.0;
    println!(
        "[{label}] latency: strict listener peak {peak:.0} msg/s, 50% = {half:.0} msg/s; batch {batch}"
    );
    // Listener stream and raw stream, same shape, same server.
    for prefix in ["lat", "latraw"] {
        admin::create_stream(&mut conn, prefix, LAT_SHARDS)
            .await
            .unwrap();
    }
    let samples: Samples = Arc::new(Mutex::new(BTreeMap::new()));
    let mut options = ListenerOptions::default();
    options.concurrency = 4;
    options.batch_size = batch;
    options.coordination = coordination();
    let s = samples.clone();
    let handler = move |d: Delivery| {
        if let Some(p) = d.payload() {
            record(&s, p);
        }
        async { Ok::<(), HandlerError>(()) }
    };
    let handle = Listener::new(target.clone(), "lat", "g", handler, options)
        .unwrap()
        .start()
        .await
        .unwrap();
    wait_converged(&mut conn, "lat", "g", 4, Duration::from_secs(60))
        .await
        .expect("converged");
    let stop = Arc::new(AtomicUsize::new(0));
    let raw_tasks = {
        let raw_keys = StreamKeys::new("latraw").unwrap();
        create_groups(&mut conn, &raw_keys, LAT_SHARDS, "g").await;
        spawn_raw_consumer(
            &target,
            &raw_keys,
            "g",
            batch,
            samples.clone(),
            stop.clone(),
        )
    };
    let listener_pub = Publisher::new(conn.clone(), "lat", PublisherOptions::default())
        .await
        .unwrap();
    let raw_pub = Publisher::new(conn.clone(), "latraw", PublisherOptions::default())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    // phase ids: 1 raw@100, 2 listener@100, 3 raw@half, 4 listener@half (odd: warm-up ids + 10)
    let low_secs = 15.0;
    let high_secs = 8.0;
    let plan: Vec<(u32, &Publisher, f64, f64)> = vec![
        (1, &raw_pub, 100.0, low_secs),
        (2, &listener_pub, 100.0, low_secs),
        (3, &raw_pub, half, high_secs),
        (4, &listener_pub, half, high_secs),
    ];
    let mut achieved = BTreeMap::new();
    for (phase, publisher, rate, secs) in plan {
        // 1 s warm-up recorded under phase + 10, then the measured window.
        publish_at(publisher, rate, 1.0, phase + 10).await;
        let start = Instant::now();
        let sent = publish_at(publisher, rate, secs, phase).await;
        achieved.insert(phase, sent as f64 / start.elapsed().as_secs_f64());
        // Let the tail drain.
        tokio::time::sleep(Duration::from_millis(1500)).await;
    }
    stop.store(1, Ordering::Relaxed);
    for t in raw_tasks {
        let _ = t.await;
    }
    handle.shutdown_and_wait().await;
    let samples = samples.lock().unwrap().clone();
    let stats = |phase: u32| -> (usize, u64, u64, u64) {
        let mut v = samples.get(&phase).cloned().unwrap_or_default();
        v.sort_unstable();
        (
            v.len(),
            percentile(&v, 50.0),
            percentile(&v, 99.0),
            v.last().copied().unwrap_or(0),
        )
    };
    let raw_name = if cluster {
        "raw blocking XREADGROUP, one task and connection per shard"
    } else {
        "raw blocking XREADGROUP, 4 tasks over 2 shards each"
    };
    println!(
        "\n[{label}] publish→handler latency (load {})",
        load_average()
    );
    println!(
        "| rate | consumer | published msg/s | samples | p50 | p99 | max | p50 ratio to raw | p99 ratio to raw |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for (raw, lis, name) in [(1, 2, "100 msg/s"), (3, 4, "50% of peak")] {
        let r = stats(raw);
        let l = stats(lis);
        {
            println!(
                "| {name} | {raw_name} | {:.0} | {} | {} | {} | {} | 1 | 1 |",
                achieved.get(&raw).copied().unwrap_or(0.0),
                r.0,
                ms(r.1),
                ms(r.2),
                ms(r.3)
            );
        }
        let ratio = |a: u64, b: u64| {
            if b == 0 {
                "—".to_owned()
            } else {
                format!("{:.2}", a as f64 / b as f64)
            }
        };
        println!(
            "| {name} | Listener (strict) | {:.0} | {} | {} | {} | {} | {} | {} |",
            achieved.get(&lis).copied().unwrap_or(0.0),
            l.0,
            ms(l.1),
            ms(l.2),
            ms(l.3),
            ratio(l.1, r.1),
            ratio(l.2, r.2)
        );
    }
}

// ---------------------------------------------------------------------------------------------
// 7. Memory
// ---------------------------------------------------------------------------------------------

const MEM_PREFIX: &str = "mem";
const MEM_SHARDS: u32 = 64;

/// The child: `memory-child <url> <bare|listener> <group> <batch>`. Prints `RSS_BARE <kB>` or
/// `RSS_IDLE <kB>`, then (listener) waits until every shard has a batch of `batch` entries in
/// flight and prints `RSS_INFLIGHT <kB> <entries>`, then waits to be killed.
fn memory_child(args: &[String]) {
    let url = args[0].clone();
    let mode = args[1].clone();
    let group = args[2].clone();
    let batch: usize = args[3].parse().unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async move {
        let target = RedisTarget::Standalone(url);
        let mut conn = connect(&target).await;
        let _: String = redis::cmd("PING").query_async(&mut conn).await.unwrap();
        if mode == "bare" {
            tokio::time::sleep(Duration::from_secs(2)).await;
            println!("RSS_BARE {}", rss_kb());
            std::io::stdout().flush().unwrap();
            std::future::pending::<()>().await;
        }
        let started = Arc::new(AtomicU64::new(0));
        let read = Arc::new(AtomicU64::new(0));
        let mut options = ListenerOptions::default();
        options.concurrency = 4;
        options.batch_size = batch;
        options.coordination = coordination();
        options.handler_timeout = Duration::from_secs(600);
        options.start_from = StartFrom::Latest;
        let r = read.clone();
        options.events = Some(EventCallback(Arc::new(move |e| {
            if let ListenerEvent::Read { count, .. } = e {
                r.fetch_add(count as u64, Ordering::Relaxed);
            }
        })));
        let s = started.clone();
        let handler = move |_d: Delivery| {
            s.fetch_add(1, Ordering::Relaxed);
            async {
                std::future::pending::<()>().await;
                Ok::<(), HandlerError>(())
            }
        };
        let _handle = Listener::new(target.clone(), MEM_PREFIX, &group, handler, options)
            .unwrap()
            .start()
            .await
            .unwrap();
        wait_converged(&mut conn, MEM_PREFIX, &group, 4, Duration::from_secs(60))
            .await
            .expect("converged");
        tokio::time::sleep(Duration::from_secs(3)).await;
        println!("RSS_IDLE {}", rss_kb());
        std::io::stdout().flush().unwrap();
        let want = (batch as u64) * u64::from(MEM_SHARDS);
        let give_up = Instant::now() + Duration::from_secs(60);
        while (started.load(Ordering::Relaxed) < u64::from(MEM_SHARDS)
            || read.load(Ordering::Relaxed) < want)
            && Instant::now() < give_up
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        println!("RSS_INFLIGHT {} {}", rss_kb(), read.load(Ordering::Relaxed));
        std::io::stdout().flush().unwrap();
        std::future::pending::<()>().await;
    });
}

struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn_child(
    url: &str,
    mode: &str,
    group: &str,
    batch: usize,
) -> (Child, impl Iterator<Item = String> + use<>) {
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new(exe)
        .arg("memory-child")
        .arg(url)
        .arg(mode)
        .arg(group)
        .arg(batch.to_string())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let lines = BufReader::new(out).lines().map_while(Result::ok);
    (Child(child), lines)
}

fn field(line: &str, n: usize) -> u64 {
    line.split_whitespace()
        .nth(n)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

async fn memory() {
    let server = RedisServer::start().expect("redis-server");
    let url = server.url();
    let target = RedisTarget::Standalone(url.clone());
    let mut conn = connect(&target).await;
    admin::create_stream(&mut conn, MEM_PREFIX, MEM_SHARDS)
        .await
        .unwrap();
    let keys = StreamKeys::new(MEM_PREFIX).unwrap();
    let (_bare, mut lines) = spawn_child(&url, "bare", "-", 1);
    let bare = tokio::task::spawn_blocking(move || lines.next().unwrap())
        .await
        .unwrap();
    let bare = field(&bare, 1);
    drop(_bare);
    println!("[memory] bare process (tokio runtime + one Redis connection): {bare} kB");
    let mut rows = Vec::new();
    for (i, batch) in [100usize, 1000].into_iter().enumerate() {
        let group = format!("mem{i}");
        let (child, mut lines) = spawn_child(&url, "listener", &group, batch);
        let (idle_line, lines) = tokio::task::spawn_blocking(move || {
            let l = lines.next().unwrap();
            (l, lines)
        })
        .await
        .unwrap();
        let idle = field(&idle_line, 1);
        // Now fill every shard with one batch (the handler blocks on its first entry), in one
        // MULTI/EXEC: the blocked shard tasks wake when every entry is there, so each first read
        // takes a whole batch.
        let mut pipe = redis::pipe();
        pipe.atomic();
        for n in 0..batch * MEM_SHARDS as usize {
            let key = format!("key-{}", n % 1000);
            pipe.cmd("XADD")
                .arg(keys.shard((n % MEM_SHARDS as usize) as u32))
                .arg("*")
                .arg("key")
                .arg(&key)
                .arg("payload")
                .arg(format!("{{\"key\":\"{key}\",\"seq\":{n}}}"))
                .ignore();
        }
        let () = pipe.query_async(&mut conn).await.unwrap();
        let mut lines = lines;
        let inflight_line = tokio::task::spawn_blocking(move || lines.next().unwrap())
            .await
            .unwrap();
        let inflight = field(&inflight_line, 1);
        let entries = field(&inflight_line, 2);
        println!(
            "[memory] batch {batch}: idle {idle} kB, {entries} entries in flight: {inflight} kB"
        );
        rows.push((batch, idle, inflight, entries));
        drop(child);
        // Drop this batch's entries so the next child's group starts from an empty stream.
        for s in 0..MEM_SHARDS {
            let _: i64 = redis::cmd("XTRIM")
                .arg(keys.shard(s))
                .arg("MAXLEN")
                .arg(0)
                .query_async(&mut conn)
                .await
                .unwrap();
        }
    }
    // `key key-NNN payload {"key":"key-NNN","seq":N}`: about 50 bytes of field names and values,
    // plus an id of about 15 bytes.
    let entry_bytes = "about 50 bytes of field names and values, plus a 15-byte id";
    let (b1, i1, f1, e1) = rows[0];
    let (b2, i2, f2, e2) = rows[1];
    let slope = (f2 as f64 - f1 as f64) * 1024.0 / (e2 as f64 - e1 as f64);
    println!("\n[memory] (load {})", load_average());
    println!("| case | VmRSS | ratio to bare process |");
    println!("| --- | --- | --- |");
    println!("| bare process: tokio runtime + one Redis connection | {bare} kB | 1 |");
    for (b, i, f, e) in [(b1, i1, f1, e1), (b2, i2, f2, e2)] {
        println!(
            "| listener, 4 members, 64 shards, idle (child for batch {b}) | {i} kB | {:.2} |",
            i as f64 / bare as f64
        );
        println!(
            "| same, {e} entries in flight (batch {b} on each shard) | {f} kB | {:.2} |",
            f as f64 / bare as f64
        );
    }
    println!(
        "\n[memory] per entry in flight (slope between the two batch sizes): {slope:.0} bytes; entries are {entry_bytes}"
    );
}

// ---------------------------------------------------------------------------------------------
// 3. Rebalance under load
// ---------------------------------------------------------------------------------------------

const RB_PREFIX: &str = "rb";
const RB_GROUP: &str = "g";
const RB_SHARDS: u32 = 12;

struct Starts {
    /// Handler start times per shard.
    per_shard: Vec<Vec<Instant>>,
    ids: HashSet<String>,
}

type StartLog = Arc<Mutex<Starts>>;

async fn start_member(target: &RedisTarget, log: &StartLog, name: &str) -> ListenerHandle {
    let mut options = ListenerOptions::default();
    options.name = name.to_owned();
    options.concurrency = 1;
    options.coordination = coordination();
    options.block = Duration::from_secs(2);
    let log = log.clone();
    let handler = move |d: Delivery| {
        {
            let mut l = log.lock().unwrap();
            l.per_shard[d.shard as usize].push(Instant::now());
            l.ids.insert(format!("{}/{}", d.shard, d.entry_id));
        }
        async { Ok::<(), HandlerError>(()) }
    };
    Listener::new(target.clone(), RB_PREFIX, RB_GROUP, handler, options)
        .unwrap()
        .start()
        .await
        .unwrap()
}

/// Longest gap between consecutive handler starts of `shard` among starts in `[from, to]`,
/// counting the gap from the last start before `from` when `across` (a stall beginning at the
/// change).
fn longest_gap(starts: &[Instant], from: Instant, to: Instant, across: bool) -> Duration {
    let mut prev: Option<Instant> = if across {
        starts.iter().rev().find(|t| **t < from).copied()
    } else {
        None
    };
    let mut longest = Duration::ZERO;
    for t in starts.iter().filter(|t| **t >= from && **t <= to) {
        if let Some(p) = prev {
            longest = longest.max(*t - p);
        }
        prev = Some(*t);
    }
    // A shard with no start until `to` is stalled for at least that long.
    if let Some(p) = prev {
        longest = longest.max(to.saturating_duration_since(p));
    }
    longest
}

struct PhaseReport {
    name: &'static str,
    moved: usize,
    minimum: usize,
    matches_assignor: bool,
    stable_after: Duration,
    worst_ratio: f64,
    worst_shard: u32,
    before_max: Duration,
    after_max: Duration,
    not_moved: usize,
    shards_over_goal: usize,
    moved_resume: Duration,
}

#[allow(clippy::too_many_arguments)]
async fn measure_change(
    name: &'static str,
    conn: &mut RedisConnection,
    log: &StartLog,
    before: &GroupDescription,
    t_change: Instant,
    members_after: usize,
) -> (PhaseReport, GroupDescription) {
    let after = wait_converged(
        conn,
        RB_PREFIX,
        RB_GROUP,
        members_after,
        Duration::from_secs(90),
    )
    .await
    .expect("converged after change");
    let stable_after = t_change.elapsed();
    // Observe one more second of steady state after convergence.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let t_end = Instant::now();
    let prev = target_of(before);
    let next = target_of(&after);
    let members: Vec<AssignorMember> = after
        .members
        .iter()
        .map(|m| AssignorMember {
            member_id: m.member_id.clone(),
            weight: m.runtime_max_concurrency,
        })
        .collect();
    let readable: BTreeSet<u32> = after.readable_shard_set.iter().copied().collect();
    let expected = assignor::assign(&readable, &members, &prev);
    let moved = assignor::moved_shards(&prev, &next)
        + prev.keys().filter(|s| !next.contains_key(s)).count();
    let minimum = assignor::moved_shards(&prev, &expected);
    let starts = log.lock().unwrap().per_shard.clone();
    let window_start = t_change - Duration::from_secs(10);
    let mut worst_ratio = 0.0;
    let mut worst_shard = 0;
    let mut before_max = Duration::ZERO;
    let mut after_max = Duration::ZERO;
    let mut not_moved = 0;
    let mut over = 0;
    let mut moved_resume = Duration::ZERO;
    for shard in 0..RB_SHARDS {
        let s = &starts[shard as usize];
        if prev.get(&shard) == next.get(&shard) {
            not_moved += 1;
            let b = longest_gap(s, window_start, t_change, false);
            let a = longest_gap(s, t_change, t_end, true);
            before_max = before_max.max(b);
            after_max = after_max.max(a);
            let ratio = a.as_secs_f64() / b.as_secs_f64().max(1e-6);
            if ratio > 2.0 {
                over += 1;
            }
            if ratio > worst_ratio {
                worst_ratio = ratio;
                worst_shard = shard;
            }
        } else {
            moved_resume = moved_resume.max(longest_gap(s, t_change, t_end, true));
        }
    }
    (
        PhaseReport {
            name,
            moved,
            minimum,
            matches_assignor: expected == next,
            stable_after,
            worst_ratio,
            worst_shard,
            before_max,
            after_max,
            not_moved,
            shards_over_goal: over,
            moved_resume,
        },
        after,
    )
}

async fn rebalance(target: RedisTarget, label: &str) {
    let mut conn = connect(&target).await;
    admin::create_stream(&mut conn, RB_PREFIX, RB_SHARDS)
        .await
        .unwrap();
    let log: StartLog = Arc::new(Mutex::new(Starts {
        per_shard: vec![Vec::new(); RB_SHARDS as usize],
        ids: HashSet::new(),
    }));
    // One key per shard, so each batch of 12 puts one entry on every shard.
    let mut shard_keys: Vec<Option<String>> = vec![None; RB_SHARDS as usize];
    let mut n = 0;
    while shard_keys.iter().any(Option::is_none) {
        let k = format!("key-{n}");
        let s = shard_for_key(&k, RB_SHARDS) as usize;
        if shard_keys[s].is_none() {
            shard_keys[s] = Some(k);
        }
        n += 1;
    }
    let shard_keys: Vec<String> = shard_keys.into_iter().map(Option::unwrap).collect();
    let mut handles: BTreeMap<&'static str, ListenerHandle> = BTreeMap::new();
    for name in ["a", "b", "c"] {
        handles.insert(name, start_member(&target, &log, name).await);
    }
    let mut d = wait_converged(&mut conn, RB_PREFIX, RB_GROUP, 3, Duration::from_secs(60))
        .await
        .expect("3 members converged");
    // Steady load: one entry per shard every 10 ms (1,200 msg/s).
    let publisher = Publisher::new(conn.clone(), RB_PREFIX, PublisherOptions::default())
        .await
        .unwrap();
    let stop = Arc::new(AtomicUsize::new(0));
    let published = Arc::new(AtomicU64::new(0));
    let load = {
        let stop = stop.clone();
        let published = published.clone();
        tokio::spawn(async move {
            let mut interval = tokio::time::interval(Duration::from_millis(10));
            let mut seq = 0u64;
            while stop.load(Ordering::Relaxed) == 0 {
                interval.tick().await;
                let batch: Vec<(&String, u64)> = shard_keys
                    .iter()
                    .map(|k| {
                        seq += 1;
                        (k, seq)
                    })
                    .collect();
                publisher.publish_batch(&batch).await.expect("publish");
                published.fetch_add(batch.len() as u64, Ordering::Relaxed);
            }
        })
    };
    tokio::time::sleep(Duration::from_secs(10)).await;
    let mut reports = Vec::new();

    // 3 -> 4
    let t = Instant::now();
    handles.insert("d", start_member(&target, &log, "d").await);
    let (r, after) = measure_change("3 → 4 (join)", &mut conn, &log, &d, t, 4).await;
    reports.push(r);
    d = after;
    tokio::time::sleep(Duration::from_secs(10)).await;

    // 4 -> 3 by graceful leave
    let t = Instant::now();
    let leaving = handles.remove("a").unwrap();
    let leave = tokio::spawn(leaving.shutdown_and_wait());
    let (r, after) = measure_change("4 → 3 (graceful leave)", &mut conn, &log, &d, t, 3).await;
    reports.push(r);
    d = after;
    leave.await.unwrap();
    tokio::time::sleep(Duration::from_secs(10)).await;

    // 3 -> 4 again
    let t = Instant::now();
    handles.insert("e", start_member(&target, &log, "e").await);
    let (r, after) = measure_change("3 → 4 (join)", &mut conn, &log, &d, t, 4).await;
    reports.push(r);
    d = after;
    tokio::time::sleep(Duration::from_secs(10)).await;

    // 4 -> 3 by a crash (abort: no leave, shards move when the lease runs out)
    let t = Instant::now();
    handles.remove("b").unwrap().abort();
    let (r, _) = measure_change("4 → 3 (abort, lease 10 s)", &mut conn, &log, &d, t, 3).await;
    reports.push(r);

    stop.store(1, Ordering::Relaxed);
    load.await.unwrap();
    let total = published.load(Ordering::Relaxed);
    let deadline = Instant::now() + Duration::from_secs(30);
    while (log.lock().unwrap().ids.len() as u64) < total && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let handled = log.lock().unwrap().ids.len() as u64;
    let calls: usize = log.lock().unwrap().per_shard.iter().map(Vec::len).sum();
    for (_, h) in handles {
        h.shutdown_and_wait().await;
    }
    println!(
        "\n[{label}] rebalance under load, 12 shards, 1,200 msg/s, heartbeat 1 s, lease 10 s (load {})",
        load_average()
    );
    println!(
        "| change | shards moved | assignor minimum | = assignor's target | time to STABLE + converged | shards not moved | longest gap before (10 s), max over them | longest gap after, max over them | worst per-shard ratio (shard) | shards over 2× | moved shards: longest gap |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for r in &reports {
        println!(
            "| {} | {} | {} | {} | {:.2} s | {} | {:.0} ms | {:.0} ms | {:.2} ({}) | {} | {:.2} s |",
            r.name,
            r.moved,
            r.minimum,
            if r.matches_assignor { "yes" } else { "no" },
            r.stable_after.as_secs_f64(),
            r.not_moved,
            r.before_max.as_secs_f64() * 1000.0,
            r.after_max.as_secs_f64() * 1000.0,
            r.worst_ratio,
            r.worst_shard,
            r.shards_over_goal,
            r.moved_resume.as_secs_f64()
        );
    }
    println!(
        "[{label}] published {total}, distinct entries handled {handled} (lost: {}), handler calls {calls} (repeats: {})",
        total.saturating_sub(handled),
        calls as u64 - handled
    );
}

// ---------------------------------------------------------------------------------------------

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    if args.first().map(String::as_str) == Some("memory-child") {
        memory_child(&args[1..]);
        return;
    }
    let parts: Vec<&str> = if args.is_empty() {
        vec!["throughput", "latency", "memory", "rebalance"]
    } else {
        args.iter().map(String::as_str).collect()
    };
    let cluster = env_usize("E2E_CLUSTER", 1) != 0;
    println!("machine: {}", machine());
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let mut strict_peak: Option<f64> =
            std::env::var("E2E_PEAK").ok().and_then(|v| v.parse().ok());
        for part in parts {
            match part {
                "throughput" => {
                    {
                        let server = RedisServer::start().expect("redis-server");
                        let r =
                            throughput(RedisTarget::Standalone(server.url()), "standalone").await;
                        strict_peak = strict_peak.or(r.get(&Case::ListenerStrict).copied());
                    }
                    if cluster {
                        let c = RedisCluster::start().expect("cluster");
                        throughput(RedisTarget::Cluster(c.urls()), "cluster").await;
                    }
                }
                "latency" => {
                    {
                        let server = RedisServer::start().expect("redis-server");
                        latency(
                            RedisTarget::Standalone(server.url()),
                            "standalone",
                            strict_peak,
                        )
                        .await;
                    }
                    if cluster {
                        let c = RedisCluster::start().expect("cluster");
                        latency(RedisTarget::Cluster(c.urls()), "cluster", None).await;
                    }
                }
                "memory" => memory().await,
                "rebalance" => {
                    {
                        let server = RedisServer::start().expect("redis-server");
                        rebalance(RedisTarget::Standalone(server.url()), "standalone").await;
                    }
                    if cluster {
                        let c = RedisCluster::start().expect("cluster");
                        rebalance(RedisTarget::Cluster(c.urls()), "cluster").await;
                    }
                }
                other => eprintln!("unknown part {other}: throughput, latency, memory, rebalance"),
            }
        }
    });
}
