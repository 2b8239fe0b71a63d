//! What the end-to-end benchmarks share: environment knobs, clocks, CPU and memory probes,
//! group waits, stream set-up and the parsing of raw `XREADGROUP` replies.

use std::collections::BTreeMap;
use std::io::Write;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use redis::Value;
use stream_listener_core::internals::admin::{self, GroupDescription};
use stream_listener_core::internals::assignor::Target;
use stream_listener_core::internals::connection::{RedisConnection, RedisTarget};
use stream_listener_core::internals::coordinator::CoordinatorConfig;
use stream_listener_core::internals::keys::StreamKeys;
use stream_listener_core::member::ListenerHandle;
use stream_listener_core::model::{GroupState, MemberState};

pub(crate) fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

pub(crate) fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

/// `VmRSS` of this process, KiB.
pub(crate) fn rss_kb() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

pub(crate) async fn connect(target: &RedisTarget) -> RedisConnection {
    RedisConnection::connect(target, Duration::from_secs(10))
        .await
        .expect("connect to Redis")
}

/// `CONFIG SET notify-keyspace-events Kt` on each node: the keyspace events a cluster's shared
/// waits subscribe to (docs/design.md §8.4; harmless on a standalone server).
pub(crate) async fn notify_keyspace_events(nodes: &[RedisTarget]) {
    for node in nodes {
        let mut c = connect(node).await;
        let () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("notify-keyspace-events")
            .arg("Kt")
            .query_async(&mut c)
            .await
            .expect("CONFIG SET notify-keyspace-events");
    }
}

/// Protocol timings of the benchmarks' listeners: heartbeat 1 s, lease 10 s (faster settling
/// than the 3 s / 15 s defaults; a steady member's data path does not depend on them).
pub(crate) fn coordination() -> CoordinatorConfig {
    CoordinatorConfig::new(
        Duration::from_secs(1),
        Duration::from_secs(10),
        Duration::from_secs(20),
    )
    .expect("valid timings")
}

pub(crate) fn machine() -> String {
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

pub(crate) fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .next()
        .unwrap_or("?")
        .to_owned()
}

/// Waits until the group is `STABLE` with `members` live members, each owning exactly its target
/// and nothing pending or revoking. Returns the description.
pub(crate) async fn wait_converged(
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

pub(crate) fn converged(d: &GroupDescription, members: usize) -> bool {
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

pub(crate) fn target_of(d: &GroupDescription) -> Target {
    d.shards
        .iter()
        .filter_map(|s| s.target_owner.clone().map(|o| (s.shard_index, o)))
        .collect()
}

pub(crate) fn total_handled(handles: &[&ListenerHandle]) -> u64 {
    handles
        .iter()
        .flat_map(|h| h.status())
        .map(|s| s.handled)
        .sum()
}

pub(crate) fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

pub(crate) fn ms(us: u64) -> String {
    format!("{:.2} ms", us as f64 / 1000.0)
}

/// CPU time of this process (user + system), seconds (`/proc/self/stat`, 10 ms resolution).
pub(crate) fn process_cpu() -> f64 {
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
pub(crate) async fn redis_stats(conn: &mut RedisConnection) -> (f64, BTreeMap<String, (u64, u64)>) {
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
pub(crate) struct CaseCost {
    pub(crate) redis_us_per_msg: f64,
    pub(crate) redis_busy: f64,
    pub(crate) client_us_per_msg: f64,
    pub(crate) client_busy: f64,
    pub(crate) commands: Vec<(String, u64, f64, f64)>,
}

/// Started right before a case's clock, finished right after it.
pub(crate) struct CostProbe {
    /// A connection to each server whose CPU counts: the standalone server, or each master of
    /// the cluster (their CPU and commands are summed).
    nodes: Vec<RedisConnection>,
    pub(crate) redis_cpu: f64,
    pub(crate) client_cpu: f64,
}

/// Connections to every master of the cluster behind `conn` (from `CLUSTER SLOTS`), or `conn`
/// itself on a standalone server.
async fn cost_nodes(conn: &mut RedisConnection) -> Vec<RedisConnection> {
    if !conn.is_cluster() {
        return vec![conn.clone()];
    }
    let slots: Vec<Vec<redis::Value>> = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async(conn)
        .await
        .unwrap();
    let mut masters = std::collections::BTreeSet::new();
    for range in slots {
        if let Some(redis::Value::Array(master)) = range.get(2) {
            let host: String = redis::from_redis_value(master[0].clone()).unwrap();
            let port: u16 = redis::from_redis_value(master[1].clone()).unwrap();
            masters.insert(format!("redis://{host}:{port}"));
        }
    }
    let mut nodes = Vec::new();
    for url in masters {
        let target = stream_listener_core::internals::connection::RedisTarget::standalone(url);
        nodes.push(
            RedisConnection::connect(&target, std::time::Duration::from_secs(5))
                .await
                .unwrap(),
        );
    }
    nodes
}

/// [`redis_stats`] summed over `nodes`.
async fn nodes_stats(nodes: &mut [RedisConnection]) -> (f64, BTreeMap<String, (u64, u64)>) {
    let mut cpu = 0.0;
    let mut commands: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for node in nodes {
        let (node_cpu, node_commands) = redis_stats(node).await;
        cpu += node_cpu;
        for (name, (calls, usec)) in node_commands {
            let entry = commands.entry(name).or_default();
            entry.0 += calls;
            entry.1 += usec;
        }
    }
    (cpu, commands)
}

impl CostProbe {
    pub(crate) async fn start(conn: &mut RedisConnection) -> CostProbe {
        let mut nodes = cost_nodes(conn).await;
        for node in &mut nodes {
            let () = redis::cmd("CONFIG")
                .arg("RESETSTAT")
                .query_async(node)
                .await
                .unwrap();
        }
        let redis_cpu = nodes_stats(&mut nodes).await.0;
        CostProbe {
            nodes,
            redis_cpu,
            client_cpu: process_cpu(),
        }
    }

    pub(crate) async fn finish(
        mut self,
        _conn: &mut RedisConnection,
        n: u64,
        secs: f64,
    ) -> Option<CaseCost> {
        let client = process_cpu() - self.client_cpu;
        let (cpu1, commands) = nodes_stats(&mut self.nodes).await;
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
pub(crate) fn profile_marker() {
    if env_usize("E2E_PROFILE", 0) != 0 {
        println!("[profile] clock starts, pid {}", std::process::id());
        std::io::stdout().flush().unwrap();
    }
}

/// Appends `count` small entries round-robin over `shards` shards of `keys`: fields
/// `key key-<n mod 1000>` and `payload {"key":"key-<k>","seq":<n>}` (about 30 bytes), in
/// pipelines of 1,000 (per shard on a cluster).
pub(crate) async fn preload(
    conn: &mut RedisConnection,
    keys: &StreamKeys,
    shards: u32,
    count: usize,
) {
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

pub(crate) async fn stream_length(
    conn: &mut RedisConnection,
    keys: &StreamKeys,
    shards: u32,
) -> u64 {
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

pub(crate) async fn create_groups(
    conn: &mut RedisConnection,
    keys: &StreamKeys,
    shards: u32,
    group: &str,
) {
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

pub(crate) async fn destroy_groups(
    conn: &mut RedisConnection,
    keys: &StreamKeys,
    shards: u32,
    group: &str,
) {
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
pub(crate) fn parse_read(
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
