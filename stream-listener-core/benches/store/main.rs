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

mod measure;
mod report;
mod scenario;
mod units;

use std::time::Duration;

use report::*;
use scenario::*;
use stream_listener_core::coordinator::CoordinatorConfig;

pub(crate) const PREFIX: &str = "bench";
pub(crate) const GROUP: &str = "g";
/// The sorted set the `HGET` + `ZADD XX` baseline renews (a copy of the member ids, so the
/// group's own leases are not touched).
pub(crate) const BASELINE_LEASES: &str = "bench-baseline:leases";
/// Redis CPU goal: a fraction of one core.
pub(crate) const CPU_GOAL: f64 = 0.05;
/// p99 goal.
pub(crate) const P99_GOAL: Duration = Duration::from_millis(10);
/// Convergence gives up after this many rounds (a bug, not a slow machine).
pub(crate) const MAX_ROUNDS: usize = 40;

#[derive(Debug, Clone, Copy)]
pub(crate) struct Scenario {
    pub(crate) name: &'static str,
    pub(crate) members: usize,
    pub(crate) shards: u32,
    /// `member_lease_ttl` (`None`: the default, 15 s). Heartbeat interval (3 s) and rebalance
    /// timeout (60 s) are always the defaults.
    pub(crate) lease_ttl: Option<Duration>,
    /// The group is provisioned as after a loss (a hand-out hold of one lease TTL).
    pub(crate) after_loss: bool,
}

impl Scenario {
    pub(crate) fn config(&self) -> CoordinatorConfig {
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

pub(crate) const SCENARIOS: [Scenario; 3] = [
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
pub(crate) struct Options {
    pub(crate) window: Duration,
    pub(crate) baseline_window: Duration,
    pub(crate) idle: Duration,
    pub(crate) converge_limit: Duration,
    pub(crate) scenarios: Vec<Scenario>,
}

impl Options {
    pub(crate) fn parse() -> Self {
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
