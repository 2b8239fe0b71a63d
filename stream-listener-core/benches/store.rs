//! Benchmark of the Redis-recorded coordinator: heartbeats of one group against a
//! throwaway local `redis-server`, client-side latency, fast-path share, `RETRY` count and the
//! Redis server's CPU (docs/design.md §5).
//!
//! Scenarios (each on its own fresh server):
//! - `a`: 100 members × 1,000 shards. Goal: Redis under 5% of one core, p99 under 10 ms, no
//!   `RETRY`.
//! - `b`: 1,000 members × 10,000 shards (the next goal), same figures.
//! - `c`: as `b`, but the group metadata is provisioned as after a loss
//!   (`GroupStore::provision(true)`: no shard is handed out for one lease TTL), so convergence
//!   waits out the hold; the steady state shows whether the fast path answers once it has
//!   passed (docs/design.md §5.5: it did not, and every heartbeat was a full transition).
//!
//! Each scenario, on its server, in this order:
//! 1. idle: nothing sent for a few seconds (Redis's own background CPU);
//! 2. baseline `PING`, then baseline `HGET` of one field (the stream's `metadataVersion`) plus
//!    `ZADD XX` of one member on a sorted set, pipelined (the minimal work of any lease renewal),
//!    both at the heartbeat rate of the scenario (members / 3 s, spread evenly);
//! 3. convergence: every member joins, then rounds of heartbeats (each member reporting its
//!    assigned shards and, once, as `REVOKED` what it no longer is assigned) until the group is
//!    `STABLE` and every member converged;
//! 4. steady state: every member heartbeats every 3 s with its own driver task, start times
//!    spread evenly (100 members: one heartbeat every 30 ms); one heartbeat interval of warm-up,
//!    then the measured window.
//!
//! Latency is measured client-side around `GroupStore::heartbeat` (around the command or pipeline
//! for the baselines). Redis CPU is `used_cpu_sys + used_cpu_user` of `INFO cpu` before and after
//! the window divided by the wall time between the two reads: a fraction of one core. The machine
//! is shared and noisy, so latency and CPU are also given as ratios to the baselines of the same
//! run (BENCHMARKS.md).
//!
//! Run (from the repository root):
//! `cargo bench -p stream-listener-core --bench store --features testing`
//!
//! Options (after `--`, or environment variables):
//! - `--window <secs>` / `STORE_BENCH_WINDOW_SECS`: the measured steady window (default 30);
//! - `--baseline-window <secs>` / `STORE_BENCH_BASELINE_SECS`: each baseline's window (default 10);
//! - `--idle <secs>` / `STORE_BENCH_IDLE_SECS`: the idle window (default 5);
//! - `--scenario a|b|c|all` / `STORE_BENCH_SCENARIO`: which scenarios, comma-separated
//!   (default all);
//! - `--converge-limit <secs>` / `STORE_BENCH_CONVERGE_SECS`: give up converging a scenario
//!   after this long (default 300; its steady state is then not measured);
//! - `--lease-ttl <secs>` / `STORE_BENCH_LEASE_TTL_SECS`: `member_lease_ttl` of every scenario
//!   (default: 15 s for `a`, 60 s for `b`, see [`SCENARIOS`]).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use redis::AsyncCommands;
use stream_listener_core::internals::connection::{RedisConnection, RedisTarget};
use stream_listener_core::internals::coordinator::CoordinatorConfig;
use stream_listener_core::internals::keys::{GroupKeys, StreamKeys};
use stream_listener_core::internals::store::GroupStore;
use stream_listener_core::model::{
    GroupState, HeartbeatRequest, HeartbeatResponse, HeartbeatStatus, RevokeState, ShardIndex,
};
use stream_listener_core::testing::RedisServer;
use stream_listener_core::testing::fixtures::{create_active_stream, heartbeat_request, revoking};
use tokio::time::MissedTickBehavior;

const PREFIX: &str = "bench";
const GROUP: &str = "g";
/// The sorted set the `HGET` + `ZADD XX` baseline renews (a copy of the member ids, so the
/// group's own leases are not touched).
const BASELINE_LEASES: &str = "bench-baseline:leases";
/// Redis CPU goal: a fraction of one core.
const CPU_GOAL: f64 = 0.05;
/// p99 goal.
const P99_GOAL: Duration = Duration::from_millis(10);
/// Convergence gives up after this many rounds (a bug, not a slow machine).
const MAX_ROUNDS: usize = 40;

#[derive(Debug, Clone, Copy)]
struct Scenario {
    name: &'static str,
    members: usize,
    shards: u32,
    /// `member_lease_ttl` (`None`: the default, 15 s). Heartbeat interval (3 s) and rebalance
    /// timeout (60 s) are always the defaults.
    lease_ttl: Option<Duration>,
    /// The group is provisioned as after a loss (a hand-out hold of one lease TTL).
    after_loss: bool,
}

impl Scenario {
    fn config(&self) -> CoordinatorConfig {
        let default = CoordinatorConfig::default();
        match self.lease_ttl {
            None => default,
            Some(ttl) => {
                CoordinatorConfig::new(default.heartbeat_interval, ttl, default.rebalance_timeout)
                    .expect("valid timings")
            }
        }
    }
}

const SCENARIOS: [Scenario; 3] = [
    Scenario {
        name: "a",
        members: 100,
        shards: 1_000,
        lease_ttl: None,
        after_loss: false,
    },
    Scenario {
        name: "b",
        members: 1_000,
        shards: 10_000,
        // With the default 15 s the group does not converge when driven one heartbeat at a
        // time: a full transition at 1,000 members takes 11-25 ms here, so the 1,000 joins alone
        // outlast a lease, members expire between two of their heartbeats and rejoin, round
        // after round (BENCHMARKS.md; try `--scenario b --lease-ttl 15`). The steady state
        // (fast path) does not depend on the TTL.
        lease_ttl: Some(Duration::from_secs(60)),
        after_loss: false,
    },
    Scenario {
        name: "c",
        members: 1_000,
        shards: 10_000,
        // As b; the hand-out hold lasts this long too, so convergence takes a minute longer.
        lease_ttl: Some(Duration::from_secs(60)),
        after_loss: true,
    },
];

#[derive(Debug, Clone)]
struct Options {
    window: Duration,
    baseline_window: Duration,
    idle: Duration,
    converge_limit: Duration,
    scenarios: Vec<Scenario>,
}

impl Options {
    fn parse() -> Self {
        let env_secs = |name: &str, default: f64| {
            std::env::var(name)
                .ok()
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(default)
        };
        let mut window = env_secs("STORE_BENCH_WINDOW_SECS", 30.0);
        let mut baseline = env_secs("STORE_BENCH_BASELINE_SECS", 10.0);
        let mut idle = env_secs("STORE_BENCH_IDLE_SECS", 5.0);
        let mut converge = env_secs("STORE_BENCH_CONVERGE_SECS", 300.0);
        let mut lease_ttl = std::env::var("STORE_BENCH_LEASE_TTL_SECS")
            .ok()
            .and_then(|v| v.parse::<f64>().ok());
        let mut which = std::env::var("STORE_BENCH_SCENARIO").unwrap_or_else(|_| "all".into());
        // `cargo bench` passes `--bench` (and any filter); unknown arguments are ignored.
        let args: Vec<String> = std::env::args().skip(1).collect();
        let mut i = 0;
        while i < args.len() {
            let value = args.get(i + 1);
            let secs = value.and_then(|v| v.parse::<f64>().ok());
            match (args[i].as_str(), secs) {
                ("--window", Some(s)) => window = s,
                ("--baseline-window", Some(s)) => baseline = s,
                ("--idle", Some(s)) => idle = s,
                ("--converge-limit", Some(s)) => converge = s,
                ("--lease-ttl", Some(s)) => lease_ttl = Some(s),
                ("--scenario", _) if value.is_some() => which = value.cloned().unwrap_or_default(),
                _ => {
                    i += 1;
                    continue;
                }
            }
            i += 2;
        }
        let scenarios = SCENARIOS
            .iter()
            .filter(|s| which == "all" || which.split(',').any(|w| w == s.name))
            .map(|s| Scenario {
                lease_ttl: lease_ttl.map(Duration::from_secs_f64).or(s.lease_ttl),
                ..*s
            })
            .collect();
        Options {
            window: Duration::from_secs_f64(window.max(1.0)),
            baseline_window: Duration::from_secs_f64(baseline.max(1.0)),
            idle: Duration::from_secs_f64(idle.max(0.5)),
            converge_limit: Duration::from_secs_f64(converge.max(1.0)),
            scenarios,
        }
    }
}

/// One timed request.
#[derive(Debug, Clone, Copy)]
struct Sample {
    start: Instant,
    latency: Duration,
    fast_path: bool,
    status: Option<HeartbeatStatus>,
    attempts: u32,
    error: bool,
}

impl Sample {
    fn plain(start: Instant, ok: bool) -> Self {
        Sample {
            start,
            latency: start.elapsed(),
            fast_path: false,
            status: None,
            attempts: 0,
            error: !ok,
        }
    }
}

/// Something driven at a fixed interval: one request per tick.
trait Unit: Send + 'static {
    fn tick(&mut self) -> impl Future<Output = Sample> + Send;
}

/// A member following the protocol (as in tests/store.rs): releases what it is no longer
/// assigned by reporting it `REVOKED` once, rejoins with epoch 0 when fenced.
struct Member {
    id: String,
    store: GroupStore,
    seq: u64,
    epoch: i64,
    metadata_version: u64,
    owned: Vec<ShardIndex>,
    revoked: Vec<ShardIndex>,
    /// What the last request reported: owned shards, and whether it reported revoked ones.
    reported: (Vec<ShardIndex>, bool),
    last: Option<HeartbeatResponse>,
    last_at: Option<Instant>,
    /// Longest time between two heartbeats of this member during convergence.
    max_gap: Duration,
}

impl Member {
    fn new(id: String, store: GroupStore) -> Self {
        Member {
            id,
            store,
            seq: 0,
            epoch: 0,
            metadata_version: 1,
            owned: Vec::new(),
            revoked: Vec::new(),
            reported: (Vec::new(), false),
            last: None,
            last_at: None,
            max_gap: Duration::ZERO,
        }
    }

    fn request(&self) -> HeartbeatRequest {
        HeartbeatRequest {
            revoking_shards: revoking(&self.revoked, RevokeState::Revoked),
            ..heartbeat_request(
                &self.id,
                "bench",
                self.metadata_version,
                (self.seq, self.epoch),
                &self.owned,
            )
        }
    }

    /// Converged: the last request reported nothing revoked, and its answer was `OK` with
    /// exactly the reported shards assigned and nothing pending.
    fn converged(&self) -> bool {
        self.last.as_ref().is_some_and(|r| {
            r.status == HeartbeatStatus::Ok
                && r.pending_shards.is_empty()
                && !self.reported.1
                && r.assigned_shards == self.reported.0
        })
    }

    async fn heartbeat(&mut self) -> Sample {
        self.seq += 1;
        let request = self.request();
        self.reported = (self.owned.clone(), !self.revoked.is_empty());
        let start = Instant::now();
        if let Some(at) = self.last_at {
            self.max_gap = self.max_gap.max(start - at);
        }
        self.last_at = Some(start);
        let result = self.store.heartbeat(&request).await;
        let latency = start.elapsed();
        match result {
            Ok(outcome) => {
                let response = outcome.response;
                self.apply(&response);
                let sample = Sample {
                    start,
                    latency,
                    fast_path: outcome.fast_path,
                    status: Some(response.status),
                    attempts: outcome.attempts,
                    error: false,
                };
                self.last = Some(response);
                sample
            }
            Err(e) => {
                eprintln!("  {}: heartbeat failed: {e}", self.id);
                Sample {
                    start,
                    latency,
                    fast_path: false,
                    status: None,
                    attempts: 0,
                    error: true,
                }
            }
        }
    }

    fn apply(&mut self, response: &HeartbeatResponse) {
        match response.status {
            HeartbeatStatus::Ok => {
                self.epoch = response.member_epoch;
                self.metadata_version = response.metadata_version;
                let assigned: BTreeSet<ShardIndex> =
                    response.assigned_shards.iter().copied().collect();
                self.revoked = self
                    .owned
                    .iter()
                    .filter(|s| !assigned.contains(s))
                    .copied()
                    .collect();
                self.owned = response.assigned_shards.clone();
            }
            HeartbeatStatus::SyncMetadata => {
                self.epoch = response.member_epoch;
                self.metadata_version = response.metadata_version;
                let assigned: BTreeSet<ShardIndex> =
                    response.assigned_shards.iter().copied().collect();
                let (keep, release): (Vec<ShardIndex>, Vec<ShardIndex>) =
                    self.owned.iter().partition(|s| assigned.contains(s));
                self.revoked.extend(release);
                self.owned = keep;
            }
            HeartbeatStatus::RevokePending | HeartbeatStatus::Retry => {}
            HeartbeatStatus::UnknownMemberId | HeartbeatStatus::FencedMemberEpoch => {
                self.epoch = 0;
                self.owned.clear();
                self.revoked.clear();
            }
            HeartbeatStatus::FencedInstanceId => {
                panic!("{}: FENCED_INSTANCE_ID without an instance id", self.id)
            }
        }
    }
}

impl Unit for Member {
    fn tick(&mut self) -> impl Future<Output = Sample> + Send {
        self.heartbeat()
    }
}

/// Baseline: one `PING`.
struct Ping {
    conn: RedisConnection,
}

impl Unit for Ping {
    async fn tick(&mut self) -> Sample {
        let start = Instant::now();
        let result: redis::RedisResult<String> =
            redis::cmd("PING").query_async(&mut self.conn).await;
        Sample::plain(start, result.is_ok())
    }
}

/// Baseline: `HGET` of the stream's `metadataVersion` and `ZADD XX` of the member's lease,
/// pipelined (one round trip).
struct Renewal {
    conn: RedisConnection,
    metadata_key: String,
    member: String,
    ttl_us: u64,
}

impl Unit for Renewal {
    async fn tick(&mut self) -> Sample {
        let start = Instant::now();
        let now_us = u64::try_from(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_micros(),
        )
        .unwrap_or(u64::MAX);
        let mut pipe = redis::pipe();
        pipe.hget(&self.metadata_key, "metadataVersion")
            .cmd("ZADD")
            .arg(BASELINE_LEASES)
            .arg("XX")
            .arg(now_us + self.ttl_us)
            .arg(&self.member);
        let result: redis::RedisResult<(Option<String>, i64)> =
            pipe.query_async(&mut self.conn).await;
        Sample::plain(start, result.is_ok())
    }
}

/// `used_cpu_sys + used_cpu_user` of the server, seconds.
async fn redis_cpu(conn: &mut RedisConnection) -> f64 {
    let info: String = redis::cmd("INFO")
        .arg("cpu")
        .query_async(conn)
        .await
        .expect("INFO cpu");
    info_fields(&info)
        .into_iter()
        .filter(|(k, _)| k == "used_cpu_sys" || k == "used_cpu_user")
        .filter_map(|(_, v)| v.parse::<f64>().ok())
        .sum()
}

fn info_fields(info: &str) -> Vec<(String, String)> {
    info.lines()
        .filter_map(|l| l.trim().split_once(':'))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// `INFO commandstats` as (command, calls, usec) sorted by usec, descending.
async fn command_stats(conn: &mut RedisConnection) -> Vec<(String, u64, u64)> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .expect("INFO commandstats");
    let mut stats: Vec<(String, u64, u64)> = info_fields(&info)
        .into_iter()
        .filter_map(|(k, v)| {
            let name = k.strip_prefix("cmdstat_")?.to_owned();
            let field = |f: &str| {
                v.split(',')
                    .find_map(|kv| kv.strip_prefix(f)?.strip_prefix('='))
                    .and_then(|x| x.parse::<u64>().ok())
            };
            Some((name, field("calls")?, field("usec")?))
        })
        .collect();
    stats.sort_by_key(|s| std::cmp::Reverse(s.2));
    stats
}

/// What one measured window gave.
#[derive(Debug, Clone, Default)]
struct Measured {
    samples: Vec<Sample>,
    wall: Duration,
    cpu_seconds: f64,
    revision_delta: Option<u64>,
    commands: Vec<(String, u64, u64)>,
}

impl Measured {
    fn cpu(&self) -> f64 {
        self.cpu_seconds / self.wall.as_secs_f64()
    }

    fn rate(&self) -> f64 {
        self.samples.len() as f64 / self.wall.as_secs_f64()
    }

    fn percentile(&self, p: f64) -> Duration {
        let mut latencies: Vec<Duration> = self.samples.iter().map(|s| s.latency).collect();
        if latencies.is_empty() {
            return Duration::ZERO;
        }
        latencies.sort_unstable();
        let rank = ((p / 100.0) * latencies.len() as f64).ceil() as usize;
        latencies[rank.clamp(1, latencies.len()) - 1]
    }

    fn max(&self) -> Duration {
        self.samples
            .iter()
            .map(|s| s.latency)
            .max()
            .unwrap_or_default()
    }

    fn count(&self, f: impl Fn(&Sample) -> bool) -> usize {
        self.samples.iter().filter(|s| f(s)).count()
    }
}

/// A baseline: [`run_paced`] from `lead` from now, with one second of warm-up before the
/// `window` measured, and no group.
async fn run_baseline<U: Unit>(
    units: Vec<U>,
    interval: Duration,
    lead: Duration,
    window: Duration,
    conn: &RedisConnection,
) -> Measured {
    let start = Instant::now() + lead;
    let from = start + Duration::from_secs(1);
    let (_, measured) = run_paced(
        units,
        interval,
        start,
        from,
        from + window,
        conn.clone(),
        None,
    )
    .await;
    measured
}

/// Drives `units` every `interval`, unit `i` first at `start + i × interval / n`, until `stop`.
/// Meanwhile measures the window `[from, stop)`: the samples started in it, Redis CPU and the
/// command statistics (reset at `from`), and the group's `revision` change when `group` is given.
async fn run_paced<U: Unit>(
    units: Vec<U>,
    interval: Duration,
    start: Instant,
    from: Instant,
    stop: Instant,
    mut conn: RedisConnection,
    group: Option<&GroupKeys>,
) -> (Vec<U>, Measured) {
    let n = u32::try_from(units.len()).expect("few units");
    let step = interval / n;
    let tasks: Vec<_> = units
        .into_iter()
        .enumerate()
        .map(|(i, mut unit)| {
            let first = start + step * u32::try_from(i).expect("few units");
            tokio::spawn(async move {
                let mut ticker =
                    tokio::time::interval_at(tokio::time::Instant::from_std(first), interval);
                ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
                let mut samples = Vec::new();
                loop {
                    let at = ticker.tick().await.into_std();
                    if at >= stop {
                        break;
                    }
                    samples.push(unit.tick().await);
                }
                (unit, samples)
            })
        })
        .collect();
    let revision = |conn: &mut RedisConnection| {
        let mut conn = conn.clone();
        let key = group.map(GroupKeys::metadata);
        async move {
            let key = key?;
            let value: Option<u64> = conn.hget(key, "revision").await.ok()?;
            value
        }
    };
    tokio::time::sleep_until(tokio::time::Instant::from_std(from)).await;
    let cpu_before = redis_cpu(&mut conn).await;
    let wall_before = Instant::now();
    let revision_before = revision(&mut conn).await;
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut conn)
        .await
        .expect("CONFIG RESETSTAT");
    tokio::time::sleep_until(tokio::time::Instant::from_std(stop)).await;
    let cpu_after = redis_cpu(&mut conn).await;
    let wall = wall_before.elapsed();
    let revision_after = revision(&mut conn).await;
    let commands = command_stats(&mut conn).await;
    let mut units = Vec::new();
    let mut samples = Vec::new();
    for task in tasks {
        let (unit, s) = task.await.expect("driver task");
        units.push(unit);
        samples.extend(s.into_iter().filter(|s| s.start >= from && s.start < stop));
    }
    let measured = Measured {
        samples,
        wall,
        cpu_seconds: cpu_after - cpu_before,
        revision_delta: revision_before
            .zip(revision_after)
            .map(|(b, a)| a.saturating_sub(b)),
        commands,
    };
    (units, measured)
}

/// Nothing sent: Redis's own background CPU over `window`.
async fn idle(conn: &mut RedisConnection, window: Duration) -> Measured {
    let cpu_before = redis_cpu(conn).await;
    let wall_before = Instant::now();
    tokio::time::sleep(window).await;
    let cpu_after = redis_cpu(conn).await;
    Measured {
        wall: wall_before.elapsed(),
        cpu_seconds: cpu_after - cpu_before,
        ..Measured::default()
    }
}

fn member_id(i: usize) -> String {
    format!("member-{i:04}")
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

/// Joins every member, then heartbeats rounds over all members until the group is STABLE and
/// every member converged. Sequential: concurrent full transitions only conflict. Gives up (false)
/// after `MAX_ROUNDS` rounds or `limit`.
async fn converge(
    members: &mut [Member],
    store: &mut GroupStore,
    ttl: Duration,
    limit: Duration,
) -> bool {
    let started = Instant::now();
    for round in 0..MAX_ROUNDS {
        let round_start = Instant::now();
        let mut full = 0usize;
        let mut fast = 0usize;
        let mut retries = 0usize;
        let mut conflicts = 0usize;
        let mut max_latency = Duration::ZERO;
        let mut statuses: BTreeMap<String, usize> = BTreeMap::new();
        for member in members.iter_mut() {
            let sample = member.heartbeat().await;
            assert!(!sample.error, "convergence heartbeat failed");
            if sample.fast_path {
                fast += 1;
            } else {
                full += 1;
            }
            if sample.attempts > 1 {
                conflicts += 1;
            }
            if sample.status == Some(HeartbeatStatus::Retry) {
                retries += 1;
            }
            if let Some(status) = sample.status
                && status != HeartbeatStatus::Ok
            {
                *statuses.entry(format!("{status:?}")).or_default() += 1;
            }
            max_latency = max_latency.max(sample.latency);
        }
        let loaded = store.load().await.expect("load group");
        let converged = members.iter().filter(|m| m.converged()).count();
        let max_gap = members.iter().map(|m| m.max_gap).max().unwrap_or_default();
        let took = round_start.elapsed();
        println!(
            "  round {round:>2}: {took:>8.2?} ({} per heartbeat, max {}), full {full}, fast {fast}, \
             CAS conflicts {conflicts}, RETRY {retries}, other statuses {statuses:?}; \
             group {:?}, {} members, converged {converged}/{}, longest gap between two \
             heartbeats of a member {max_gap:.1?}",
            ms(took / u32::try_from(members.len()).unwrap_or(1)),
            ms(max_latency),
            loaded.group.meta.state,
            loaded.group.members.len(),
            members.len(),
        );
        if max_gap > ttl {
            println!(
                "  warning: a member went {max_gap:.1?} without a heartbeat (lease TTL {ttl:?})"
            );
        }
        if loaded.group.meta.state == GroupState::Stable
            && loaded.group.members.len() == members.len()
            && converged == members.len()
        {
            println!(
                "  converged in {:.1?} ({} rounds after the joins)",
                started.elapsed(),
                round
            );
            return true;
        }
        if started.elapsed() > limit {
            println!(
                "  NOT converged after {:.1?} ({} rounds): giving up",
                started.elapsed(),
                round + 1
            );
            return false;
        }
    }
    println!("  NOT converged after {MAX_ROUNDS} rounds: giving up");
    false
}

/// The figures of one scenario.
struct Report {
    scenario: Scenario,
    idle: Measured,
    ping: Measured,
    renewal: Measured,
    /// `None` when the group did not converge.
    steady: Option<Measured>,
    convergence: Duration,
}

async fn run_scenario(scenario: Scenario, options: &Options) -> Report {
    let config = scenario.config();
    let interval = config.heartbeat_interval;
    let ttl = config.member_lease_ttl;
    println!(
        "\n== scenario {}: {} members x {} shards, a heartbeat every {interval:?} each \
         ({:.1}/s), lease TTL {ttl:?}, rebalance timeout {:?}{}",
        scenario.name,
        scenario.members,
        scenario.shards,
        scenario.members as f64 / interval.as_secs_f64(),
        config.rebalance_timeout,
        if scenario.after_loss {
            ", group provisioned as after a loss (hand-out hold of one lease TTL)"
        } else {
            ""
        }
    );
    let server = RedisServer::start().expect("start redis-server");
    println!("  redis-server pid {:?} at {}", server.pid(), server.url());
    let target = RedisTarget::standalone(server.url());
    let mut conn = RedisConnection::connect(&target, Duration::from_secs(10))
        .await
        .expect("connect");
    create_active_stream(&mut conn, PREFIX, scenario.shards).await;
    let stream_keys = StreamKeys::new(PREFIX).expect("prefix");
    let group_keys = stream_keys.group(GROUP).expect("group");

    // 1. Idle.
    let idle = idle(&mut conn, options.idle).await;
    println!("  idle: Redis CPU {:.3}% of a core", idle.cpu() * 100.0);

    // 2. Baselines at the same rate.
    let lead = Duration::from_millis(200);
    let pings: Vec<Ping> = (0..scenario.members)
        .map(|_| Ping { conn: conn.clone() })
        .collect();
    let ping = run_baseline(pings, interval, lead, options.baseline_window, &conn).await;
    print_window("baseline PING", &ping);

    let mut seed = redis::pipe();
    for i in 0..scenario.members {
        seed.zadd(BASELINE_LEASES, member_id(i), 0).ignore();
    }
    let _: () = seed
        .query_async(&mut conn)
        .await
        .expect("seed baseline set");
    let renewals: Vec<Renewal> = (0..scenario.members)
        .map(|i| Renewal {
            conn: conn.clone(),
            metadata_key: stream_keys.metadata(),
            member: member_id(i),
            ttl_us: u64::try_from(ttl.as_micros()).unwrap_or(u64::MAX),
        })
        .collect();
    let renewal = run_baseline(renewals, interval, lead, options.baseline_window, &conn).await;
    print_window("baseline HGET + ZADD XX (pipelined)", &renewal);

    // 3. Convergence.
    let mut store = GroupStore::new(
        conn.clone(),
        stream_keys.clone(),
        group_keys.clone(),
        config,
    );
    store
        .provision(scenario.after_loss)
        .await
        .expect("provision");
    let mut members: Vec<Member> = (0..scenario.members)
        .map(|i| Member::new(member_id(i), store.clone()))
        .collect();
    println!("  convergence (round 0 = the joins):");
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut conn)
        .await
        .expect("CONFIG RESETSTAT");
    let cpu_before = redis_cpu(&mut conn).await;
    let convergence_start = Instant::now();
    let converged = converge(&mut members, &mut store, ttl, options.converge_limit).await;
    let convergence = convergence_start.elapsed();
    let cpu = (redis_cpu(&mut conn).await - cpu_before) / convergence.as_secs_f64();
    let hlen: u64 = conn.hlen(group_keys.metadata()).await.expect("HLEN");
    let bytes: Option<u64> = redis::cmd("MEMORY")
        .arg("USAGE")
        .arg(group_keys.metadata())
        .query_async(&mut conn)
        .await
        .expect("MEMORY USAGE");
    println!(
        "  during convergence: Redis CPU {:.1}% of a core; group hash {hlen} fields, {:.2} MB",
        cpu * 100.0,
        bytes.unwrap_or(0) as f64 / 1e6
    );
    print_commands(&command_stats(&mut conn).await, 4);
    if !converged {
        return Report {
            scenario,
            idle,
            ping,
            renewal,
            steady: None,
            convergence,
        };
    }

    // 4. Steady state: one interval of warm-up, then the window.
    let now = Instant::now();
    let start = now + lead;
    let from = start + interval;
    let stop = from + options.window;
    let (members, steady) = run_paced(
        members,
        interval,
        start,
        from,
        stop,
        conn.clone(),
        Some(&group_keys),
    )
    .await;
    print_window("steady heartbeats", &steady);
    let loaded = store.load().await.expect("load group");
    println!(
        "  after the window: group {:?}, {} members; {} of {} members converged",
        loaded.group.meta.state,
        loaded.group.members.len(),
        members.iter().filter(|m| m.converged()).count(),
        members.len()
    );
    println!("  INFO commandstats of the steady window:");
    print_commands(&steady.commands, 6);
    drop(server);
    Report {
        scenario,
        idle,
        ping,
        renewal,
        steady: Some(steady),
        convergence,
    }
}

/// The top `n` commands by total time (scripts include the commands they call).
fn print_commands(commands: &[(String, u64, u64)], n: usize) {
    for (name, calls, usec) in commands.iter().take(n) {
        println!(
            "    {name:<12} calls {calls:>7}  usec {usec:>10}  usec/call {:>8.2}",
            *usec as f64 / (*calls).max(1) as f64
        );
    }
}

fn print_window(name: &str, m: &Measured) {
    let full = m.count(|s| !s.fast_path && s.status.is_some());
    let fast = m.count(|s| s.fast_path);
    let retries = m.count(|s| s.status == Some(HeartbeatStatus::Retry));
    let errors = m.count(|s| s.error);
    let conflicts = m.count(|s| s.attempts > 1);
    let fencing = m.count(|s| {
        matches!(
            s.status,
            Some(HeartbeatStatus::UnknownMemberId | HeartbeatStatus::FencedMemberEpoch)
        )
    });
    println!(
        "  {name}: {} requests in {:.1?} ({:.1}/s), p50 {}, p99 {}, max {}, Redis CPU {:.3}% \
         of a core{}",
        m.samples.len(),
        m.wall,
        m.rate(),
        ms(m.percentile(50.0)),
        ms(m.percentile(99.0)),
        ms(m.max()),
        m.cpu() * 100.0,
        if errors > 0 {
            format!(", {errors} ERRORS")
        } else {
            String::new()
        }
    );
    if m.samples.iter().any(|s| s.status.is_some()) {
        println!(
            "    fast path {fast} ({:.1}%), full transitions {full}, CAS conflicts {conflicts}, \
             RETRY {retries}, UNKNOWN_MEMBER_ID / FENCED_MEMBER_EPOCH {fencing}, \
             group revision +{}",
            100.0 * fast as f64 / m.samples.len().max(1) as f64,
            m.revision_delta
                .map_or_else(|| "?".into(), |d| d.to_string())
        );
    }
}

fn summary(reports: &[Report], options: &Options) {
    println!(
        "\n== summary (steady window {:?}, baselines {:?} each, idle {:?})",
        options.window, options.baseline_window, options.idle
    );
    println!(
        "| scenario | heartbeats/s | fast-path share | full transitions in window | p50 | p99 | \
         RETRY | Redis CPU (% of a core) | p50 / PING, / HGET+ZADD | p99 / PING, / HGET+ZADD | \
         CPU / PING, / HGET+ZADD | CPU above idle / PING's, / HGET+ZADD's | goals met? |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for r in reports {
        let Some(s) = &r.steady else {
            println!(
                "| {} ({} members x {} shards) | did not converge in {:.0?}: not measured |",
                r.scenario.name, r.scenario.members, r.scenario.shards, r.convergence
            );
            continue;
        };
        let fast = s.count(|x| x.fast_path);
        let full = s.count(|x| !x.fast_path && x.status.is_some());
        let retries = s.count(|x| x.status == Some(HeartbeatStatus::Retry));
        let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
        let lat = |m: &Measured, p: f64| m.percentile(p).as_secs_f64();
        let net = |m: &Measured| m.cpu() - r.idle.cpu();
        let p99 = s.percentile(99.0);
        let goals = format!(
            "CPU {}, p99 {}, no RETRY {}",
            yes_no(s.cpu() < CPU_GOAL),
            yes_no(p99 < P99_GOAL),
            yes_no(retries == 0)
        );
        println!(
            "| {} ({} members x {} shards) | {:.1} | {:.1}% | {full} | {} | {} | {retries} | \
             {:.2}% (idle {:.2}%) | {:.2}, {:.2} | {:.2}, {:.2} | {:.2}, {:.2} | {:.2}, {:.2} | \
             {goals} |",
            r.scenario.name,
            r.scenario.members,
            r.scenario.shards,
            s.rate(),
            100.0 * fast as f64 / s.samples.len().max(1) as f64,
            ms(s.percentile(50.0)),
            ms(p99),
            s.cpu() * 100.0,
            r.idle.cpu() * 100.0,
            ratio(lat(s, 50.0), lat(&r.ping, 50.0)),
            ratio(lat(s, 50.0), lat(&r.renewal, 50.0)),
            ratio(lat(s, 99.0), lat(&r.ping, 99.0)),
            ratio(lat(s, 99.0), lat(&r.renewal, 99.0)),
            ratio(s.cpu(), r.ping.cpu()),
            ratio(s.cpu(), r.renewal.cpu()),
            ratio(net(s), net(&r.ping)),
            ratio(net(s), net(&r.renewal)),
        );
    }
    println!("\nbaselines:");
    println!("| scenario | baseline | requests/s | p50 | p99 | Redis CPU (% of a core) |");
    println!("| --- | --- | --- | --- | --- | --- |");
    for r in reports {
        for (name, m) in [
            ("idle", &r.idle),
            ("PING", &r.ping),
            ("HGET + ZADD XX", &r.renewal),
        ] {
            println!(
                "| {} | {name} | {:.1} | {} | {} | {:.2}% |",
                r.scenario.name,
                m.rate(),
                ms(m.percentile(50.0)),
                ms(m.percentile(99.0)),
                m.cpu() * 100.0
            );
        }
    }
    for r in reports {
        println!(
            "scenario {}: lease TTL {:?}, convergence {} {:.1?}",
            r.scenario.name,
            r.scenario.config().member_lease_ttl,
            if r.steady.is_some() {
                "took"
            } else {
                "FAILED after"
            },
            r.convergence
        );
    }
}

fn yes_no(ok: bool) -> &'static str {
    if ok { "yes" } else { "NO" }
}

fn main() {
    let options = Options::parse();
    println!(
        "store benchmark: window {:?}, baselines {:?}, idle {:?}, scenarios {:?}",
        options.window,
        options.baseline_window,
        options.idle,
        options.scenarios.iter().map(|s| s.name).collect::<Vec<_>>()
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let reports: Vec<Report> = runtime.block_on(async {
        let mut reports = Vec::new();
        for scenario in &options.scenarios {
            reports.push(run_scenario(*scenario, &options).await);
        }
        reports
    });
    summary(&reports, &options);
}
