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
//! - `d`: 1,000 members × 10,000 shards, default timings (15 s lease), converged the way a
//!   deployment does it: concurrently (step 3 below).
//! - `e`: 100 members × 1,000 shards, as `d` (small: shows the concurrent driver converges).
//! - `f`: a rolling restart of 250 processes × 4 static members (1,000 members × 10,000 shards,
//!   default timings), converged as `d`, then step 4 below. Goal: "a rolling restart of all 250
//!   processes (static membership, one every 2 s) moves no shard and keeps every shard read
//!   within (lease + 2 heartbeats) of its owner's restart".
//!
//! Each scenario, on its server, in this order:
//! 1. idle: nothing sent for a few seconds (Redis's own background CPU);
//! 2. baseline `PING`, then baseline `HGET` of one field (the stream's `metadataVersion`) plus
//!    `ZADD XX` of one member on a sorted set, pipelined (the minimal work of any lease renewal),
//!    both at the heartbeat rate of the scenario (members / 3 s, spread evenly);
//! 3. convergence: every member joins, then rounds of heartbeats (each member reporting its
//!    assigned shards and, once, as `REVOKED` what it no longer is assigned) until the group is
//!    `STABLE` and every member converged. Scenarios `a`-`c` send one heartbeat at a time;
//!    `d`, `e` run every member in its own task, heartbeating every 3 s on its own schedule, the
//!    first heartbeats (the joins) spread evenly over the first interval (a `RETRY` is followed
//!    by the next tick's heartbeat; a real member sleeps a jittered interval after each answer
//!    instead, and bounds a heartbeat to a third of the lease), each member on a connection of
//!    its own, all in this one process; a monitor on a thread, runtime and connection of its
//!    own (so the members' work does not starve it) prints progress every interval; at
//!    the end: the time from the last join to the group `STABLE` with every member converged
//!    (or that it did not within `--converge-limit`: the tasks are then aborted and the steady
//!    state not measured), full transitions, fast-path answers, CAS conflicts, `RETRY`,
//!    `UNKNOWN_MEMBER_ID` (and how many went to a member whose previous heartbeat was less
//!    than a lease TTL earlier: expiring while heartbeating on time), `FENCED_MEMBER_EPOCH`, the
//!    longest gap between two heartbeats of a member, the full transitions' latency, Redis CPU,
//!    `INFO commandstats`, a one-second SLOWLOG sample of the scripts' server time, and the
//!    bench process's own CPU (`/proc/self/stat`; every member's client work runs in it).
//!    Redis CPU there includes the monitor's own group load each interval and the SLOWLOG
//!    sample (its `slowlog|get` shows in the command statistics);
//! 4. `f` only, the rolling restart: every member back on its own schedule (as in step 3), then,
//!    an interval and a second later, one process restarted every 2 s, in order, all of them.
//!    A member id is stable per instance (`p<process>-m<slot>`, also its `instance_id`, as a
//!    listener with an `instance_id` names its members); a restart is a new `processId` with the
//!    same ids. Graceful (the default), as a listener shuts down: the old process's 4 members
//!    stop their shards and send the static leave (`-2`) reporting nothing owned and every shard
//!    `REVOKED`; 500 ms after the last leave is answered the new process's 4 members join
//!    (epoch 0), each on a new connection, then heartbeat every 3 s on their own schedule. Hard
//!    (`--hard-restart`): the old process just stops (kill -9: nothing sent), the new one joins
//!    500 ms later. A monitor (own thread, runtime, connection) reads the target every 250 ms.
//!    Printed: shards moved (the target's owner of every shard before the first restart against
//!    after the last, and every change of owner the monitor saw in between); for each restarted
//!    member the time from its old process's stop to the first answer that assigns the new one
//!    every shard the old one owned (it reads them from then on), p50 / p99 / max and how many
//!    took longer than lease + 2 heartbeats; the heartbeat figures of step 3 over the restart;
//!    the group at the end, which must be `STABLE` with every member. To tell why a member
//!    waited: where each restart's time went from the stop signal (old members stopped, leaves
//!    answered, joins sent and answered), and how many joins came after the old process's
//!    reservation had ended (the target stays reserved until the lease renewed by the member's
//!    static leave, or by its last heartbeat on a hard restart, runs out). The restart ends when every
//!    member got its shards back and the group is `STABLE` with every member converged, or
//!    `--converge-limit` after the last restart (then every task is aborted: a collapsed group
//!    answers too slowly to stop member by member, and the steady window is skipped);
//! 5. steady state: every member heartbeats every 3 s with its own driver task, start times
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
//! - `--scenario a|b|c|d|e|f|all` / `STORE_BENCH_SCENARIO`: which scenarios, comma-separated
//!   (default all);
//! - `--converge-limit <secs>` / `STORE_BENCH_CONVERGE_SECS`: give up converging a scenario
//!   after this long (default 300; its steady state is then not measured), and give up waiting
//!   for `f` to settle after its last restart after this long;
//! - `--processes <n>` / `STORE_BENCH_PROCESSES`: `f` with `n` processes (`4n` members,
//!   `40n` shards: 10 a member, as in the full one; default 250) for a quick check;
//! - `--hard-restart` / `STORE_BENCH_HARD_RESTART=1`: `f`'s old processes stop without a leave;
//! - `--lease-ttl <secs>` / `STORE_BENCH_LEASE_TTL_SECS`: `member_lease_ttl` of every scenario
//!   (default: 15 s for `a`, `d`, `e`; 60 s for `b`, `c`; see [`SCENARIOS`]).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use redis::AsyncCommands;
use stream_listener_core::internals::connection::{RedisConnection, RedisTarget};
use stream_listener_core::internals::coordinator::CoordinatorConfig;
use stream_listener_core::internals::keys::{GroupKeys, StreamKeys};
use stream_listener_core::internals::report::Chain;
use stream_listener_core::internals::store::GroupStore;
use stream_listener_core::model::{
    GroupMetadata, GroupState, HeartbeatRequest, HeartbeatResponse, HeartbeatStatus, LEAVE_EPOCH,
    RevokeState, STATIC_LEAVE_EPOCH, ShardIndex, TargetAssignment,
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
/// Scenario `f`: logical members per process (a listener's `concurrency`).
const MEMBERS_PER_PROCESS: usize = 4;
/// Scenario `f` with `--processes`: shards per member, as in the full scenario (10,000 / 1,000),
/// so that each member's share, and what a restart hands back, stays the same.
const SHARDS_PER_MEMBER: u32 = 10;
/// Scenario `f`: one process restarted every this long, in order.
const RESTART_EVERY: Duration = Duration::from_secs(2);
/// Scenario `f`: from the old process's exit (its leaves answered) to the new one's joins.
const START_UP_DELAY: Duration = Duration::from_millis(500);
/// Scenario `f`: how often the monitor reads the target, to see any change of owner between the
/// first restart and the last (a member's answers show only its own target, when it asks).
const TARGET_SAMPLE: Duration = Duration::from_millis(250);

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
    /// Convergence drives every member in its own task on its own schedule
    /// ([`converge_concurrent`]) instead of one heartbeat at a time ([`converge`]).
    concurrent: bool,
    /// Static members, [`MEMBERS_PER_PROCESS`] a process, restarted process by process after
    /// convergence ([`rolling_restart`]).
    rolling_restart: bool,
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

const SCENARIOS: [Scenario; 6] = [
    Scenario {
        name: "a",
        members: 100,
        shards: 1_000,
        lease_ttl: None,
        after_loss: false,
        concurrent: false,
        rolling_restart: false,
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
        concurrent: false,
        rolling_restart: false,
    },
    Scenario {
        name: "c",
        members: 1_000,
        shards: 10_000,
        // As b; the hand-out hold lasts this long too, so convergence takes a minute longer.
        lease_ttl: Some(Duration::from_secs(60)),
        after_loss: true,
        concurrent: false,
        rolling_restart: false,
    },
    Scenario {
        name: "d",
        members: 1_000,
        shards: 10_000,
        // As deployed: every member on its own schedule, default timings (15 s lease).
        lease_ttl: None,
        after_loss: false,
        concurrent: true,
        rolling_restart: false,
    },
    Scenario {
        name: "e",
        members: 100,
        shards: 1_000,
        // The small one: shows the concurrent driver converges a group when the store keeps up.
        lease_ttl: None,
        after_loss: false,
        concurrent: true,
        rolling_restart: false,
    },
    Scenario {
        name: "f",
        // 250 processes × MEMBERS_PER_PROCESS (`--processes` changes both counts).
        members: 1_000,
        shards: 10_000,
        // As deployed, as d: the goal is stated in the default timings (15 s lease, 3 s
        // heartbeat: every shard read again within 21 s of its owner's restart).
        lease_ttl: None,
        after_loss: false,
        concurrent: true,
        rolling_restart: true,
    },
];

#[derive(Debug, Clone)]
struct Options {
    window: Duration,
    baseline_window: Duration,
    idle: Duration,
    converge_limit: Duration,
    scenarios: Vec<Scenario>,
    /// Scenario `f`: the old process stops without a leave (kill -9).
    hard_restart: bool,
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
        let mut processes = std::env::var("STORE_BENCH_PROCESSES")
            .ok()
            .and_then(|v| v.parse::<f64>().ok());
        let mut hard_restart =
            std::env::var("STORE_BENCH_HARD_RESTART").is_ok_and(|v| !v.is_empty() && v != "0");
        // `cargo bench` passes `--bench` (and any filter); unknown arguments are ignored.
        let args: Vec<String> = std::env::args().skip(1).collect();
        let mut i = 0;
        while i < args.len() {
            if args[i] == "--hard-restart" {
                hard_restart = true;
                i += 1;
                continue;
            }
            let value = args.get(i + 1);
            let secs = value.and_then(|v| v.parse::<f64>().ok());
            match (args[i].as_str(), secs) {
                ("--window", Some(s)) => window = s,
                ("--baseline-window", Some(s)) => baseline = s,
                ("--idle", Some(s)) => idle = s,
                ("--converge-limit", Some(s)) => converge = s,
                ("--lease-ttl", Some(s)) => lease_ttl = Some(s),
                ("--processes", Some(s)) => processes = Some(s),
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
            .map(|s| match processes {
                Some(p) if s.rolling_restart => with_processes(s, p.max(1.0) as usize),
                _ => s,
            })
            .collect();
        Options {
            window: Duration::from_secs_f64(window.max(1.0)),
            baseline_window: Duration::from_secs_f64(baseline.max(1.0)),
            idle: Duration::from_secs_f64(idle.max(0.5)),
            converge_limit: Duration::from_secs_f64(converge.max(1.0)),
            scenarios,
            hard_restart,
        }
    }
}

/// Scenario `f` with `processes` processes: the same members per process and shards per member.
fn with_processes(scenario: Scenario, processes: usize) -> Scenario {
    let members = processes * MEMBERS_PER_PROCESS;
    Scenario {
        members,
        shards: u32::try_from(members).expect("few members") * SHARDS_PER_MEMBER,
        ..scenario
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
    /// `Some` for a static member (scenario `f`): its member id, as a listener with an
    /// `instance_id` names its members (`<instance_id>-m<k>` both).
    instance_id: Option<String>,
    /// This incarnation's process: a restart is a new process with the same member id.
    process_id: String,
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
    /// Failed heartbeats: the first is printed, all are counted in the tables (`errors`).
    failures: u64,
    /// Answers to this process (its join's included).
    answers: u32,
    /// The last answer that renewed the lease: its request's start and the answer (the lease
    /// runs a TTL from the renewal, which lies in between).
    renewed: Option<(Instant, Instant)>,
    /// A restarted member (scenario `f`): what its old process left.
    predecessor: Option<Predecessor>,
    /// Until the first answer that assigns this process all the predecessor's shards again.
    awaiting: bool,
    /// Set by that answer, taken by the driver: how long after the old process's stop, and the
    /// how-manieth answer of this process it was (1: the join's).
    restored: Option<(Duration, u32)>,
    /// Set by a restarted member's first answer (its join's), taken by the driver.
    rejoined: Option<Rejoin>,
    /// `FENCED_INSTANCE_ID`: another process took the identity; the member stops for good.
    stopped: bool,
}

impl Member {
    fn new(id: String, store: GroupStore) -> Self {
        let process_id = format!("proc-{id}");
        Member {
            id,
            instance_id: None,
            process_id,
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
            failures: 0,
            answers: 0,
            renewed: None,
            predecessor: None,
            awaiting: false,
            restored: None,
            rejoined: None,
            stopped: false,
        }
    }

    /// Member `slot` of process `process` (scenario `f`), in the process's first incarnation.
    fn static_member(process: usize, slot: usize, store: GroupStore) -> Self {
        let id = format!("p{process:03}-m{slot}");
        Member {
            instance_id: Some(id.clone()),
            process_id: format!("p{process:03}-run0"),
            ..Member::new(id, store)
        }
    }

    /// This member in the restarted process `process_id`: same ids, nothing owned, epoch 0 (a
    /// join); it waits for everything this one owned when its process stopped at `stopped_at`.
    /// `ttl`: the lease TTL, to tell when this one's reservation ended.
    fn restarted(
        &self,
        process_id: String,
        store: GroupStore,
        stopped_at: Instant,
        ttl: Duration,
    ) -> Self {
        Member {
            instance_id: self.instance_id.clone(),
            process_id,
            predecessor: Some(Predecessor {
                stopped_at,
                shards: self.owned.iter().copied().collect(),
                reserved_until: self
                    .renewed
                    .map(|(sent, answered)| (sent + ttl, answered + ttl)),
            }),
            awaiting: true,
            ..Member::new(self.id.clone(), store)
        }
    }

    fn request(&self) -> HeartbeatRequest {
        HeartbeatRequest {
            instance_id: self.instance_id.clone(),
            process_id: self.process_id.clone(),
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

    /// The leave of a graceful shutdown, as the reconciler's `leave_request`: `-2` for a static
    /// member (`-1` otherwise), nothing owned, every shard it had reported `REVOKED` (a listener
    /// stops its shard tasks before it leaves).
    fn leave_request(&self) -> HeartbeatRequest {
        let mut all: Vec<ShardIndex> = self.owned.iter().chain(&self.revoked).copied().collect();
        all.sort_unstable();
        all.dedup();
        HeartbeatRequest {
            member_epoch: if self.instance_id.is_some() {
                STATIC_LEAVE_EPOCH
            } else {
                LEAVE_EPOCH
            },
            owned_shards: Vec::new(),
            revoking_shards: revoking(&all, RevokeState::Revoked),
            ..self.request()
        }
    }

    async fn heartbeat(&mut self) -> Sample {
        self.seq += 1;
        let request = self.request();
        self.reported = (self.owned.clone(), !self.revoked.is_empty());
        let sample = self.send(&request).await;
        if matches!(
            sample.status,
            Some(
                HeartbeatStatus::Ok
                    | HeartbeatStatus::SyncMetadata
                    | HeartbeatStatus::RevokePending
            )
        ) {
            self.renewed = Some((sample.start, sample.start + sample.latency));
        }
        sample
    }

    /// Leaves the group ([`Member::leave_request`]); the member is not used afterwards. A
    /// static leave answered `OK` renews the lease: the member's reservation runs one lease from
    /// the leave (docs/design.md §6.4, rule 5).
    async fn leave(&mut self) -> Sample {
        self.seq += 1;
        let request = self.leave_request();
        let sample = self.send(&request).await;
        if sample.status == Some(HeartbeatStatus::Ok) && self.instance_id.is_some() {
            self.renewed = Some((sample.start, sample.start + sample.latency));
        }
        sample
    }

    async fn send(&mut self, request: &HeartbeatRequest) -> Sample {
        let start = Instant::now();
        if let Some(at) = self.last_at {
            self.max_gap = self.max_gap.max(start - at);
        }
        self.last_at = Some(start);
        let result = self.store.heartbeat(request).await;
        let latency = start.elapsed();
        match result {
            Ok(outcome) => {
                let response = outcome.response;
                self.apply(&response);
                self.answers += 1;
                if self.answers == 1 {
                    self.note_rejoin(&response, start, start + latency);
                }
                self.check_restored(&response, start + latency);
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
                // One line per member, not per failure: a thousand members that fail every
                // heartbeat would bury the tables (scenario d).
                self.failures += 1;
                if self.failures == 1 {
                    eprintln!(
                        "  {}: heartbeat failed: {e} (its later failures are only counted)",
                        self.id
                    );
                }
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
                assert!(
                    self.instance_id.is_some(),
                    "{}: FENCED_INSTANCE_ID without an instance id",
                    self.id
                );
                // Another process took the identity: a listener stops for good.
                self.owned.clear();
                self.revoked.clear();
                self.stopped = true;
            }
        }
    }

    /// A restarted member reads its old shards again from the answer that assigns all of them
    /// to this process: records how long after the old process's stop that came.
    fn check_restored(&mut self, response: &HeartbeatResponse, answered_at: Instant) {
        let Some(old) = self.predecessor.as_ref().filter(|_| self.awaiting) else {
            return;
        };
        let assigned: BTreeSet<ShardIndex> = response.assigned_shards.iter().copied().collect();
        if response.status == HeartbeatStatus::Ok && old.shards.is_subset(&assigned) {
            self.restored = Some((answered_at - old.stopped_at, self.answers));
            self.awaiting = false;
        }
    }

    /// A restarted member's join answered: when, against its predecessor's reservation.
    fn note_rejoin(&mut self, response: &HeartbeatResponse, sent: Instant, answered: Instant) {
        let Some(old) = &self.predecessor else {
            return;
        };
        let assigned: BTreeSet<ShardIndex> = response.assigned_shards.iter().copied().collect();
        self.rejoined = Some(Rejoin {
            sent: sent - old.stopped_at,
            answered: answered - old.stopped_at,
            after_reservation: old.reserved_until.is_none_or(|(_, latest)| sent > latest),
            maybe_after_reservation: old
                .reserved_until
                .is_none_or(|(earliest, _)| answered > earliest),
            status: response.status,
            old_shards_assigned: old.shards.intersection(&assigned).count(),
            old_shards: old.shards.len(),
        });
    }
}

/// What a restarted member carries over from its old process (scenario `f`).
#[derive(Debug, Clone)]
struct Predecessor {
    /// When the old process was told to stop (it reads nothing from then on).
    stopped_at: Instant,
    /// What it owned then.
    shards: BTreeSet<ShardIndex>,
    /// When its lease, and so a static leave's reservation of its target, ended: at the
    /// earliest and at the latest (its last renewal's request start and answer plus the TTL; a
    /// static leave is a renewal). `None`: it never renewed.
    reserved_until: Option<(Instant, Instant)>,
}

/// A restarted member's join (scenario `f`), timed from its old process's stop.
#[derive(Debug, Clone)]
struct Rejoin {
    sent: Duration,
    answered: Duration,
    /// Sent after the predecessor's reservation had surely ended: the coordinator expires the
    /// member first, its target goes to the others (the join then takes a share back).
    after_reservation: bool,
    /// Answered after the reservation may have ended.
    maybe_after_reservation: bool,
    status: HeartbeatStatus,
    /// Of the predecessor's shards, those the join's answer assigned, and all of them.
    old_shards_assigned: usize,
    old_shards: usize,
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
    try_redis_cpu(conn).await.expect("INFO cpu")
}

/// [`redis_cpu`], `None` when `INFO` fails.
async fn try_redis_cpu(conn: &mut RedisConnection) -> Option<f64> {
    let info: String = redis::cmd("INFO").arg("cpu").query_async(conn).await.ok()?;
    let cpu = info_fields(&info)
        .into_iter()
        .filter(|(k, _)| k == "used_cpu_sys" || k == "used_cpu_user")
        .filter_map(|(_, v)| v.parse::<f64>().ok())
        .sum();
    Some(cpu)
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

/// Counters shared by the member tasks of [`converge_concurrent`] (cumulative since the start).
#[derive(Debug, Default)]
struct Live {
    /// Heartbeats sent; `heartbeats`: answered (or failed).
    started: AtomicU64,
    heartbeats: AtomicU64,
    full: AtomicU64,
    fast: AtomicU64,
    /// Full transitions that needed more than one compare-and-set attempt.
    conflicts: AtomicU64,
    retries: AtomicU64,
    unknown: AtomicU64,
    /// `UNKNOWN_MEMBER_ID` to a member whose previous heartbeat started less than a lease TTL
    /// before this one: a member expiring while it heartbeats on time.
    unknown_on_time: AtomicU64,
    /// Of those, the ones whose previous heartbeat was answered `RETRY` (which renews nothing).
    unknown_on_time_after_retry: AtomicU64,
    fenced: AtomicU64,
    errors: AtomicU64,
    /// Members that sent their first heartbeat (the join).
    joined: AtomicU64,
    /// Members whose last answer left them converged ([`Member::converged`]).
    converged: AtomicI64,
    /// µs since the start: the last member's first heartbeat.
    last_join_us: AtomicU64,
    /// µs since the start: the latest answer that made a member converged.
    last_converged_us: AtomicU64,
    /// Longest time between the starts of two heartbeats of one member, µs.
    max_gap_us: AtomicU64,
    /// Gaps longer than 1.5 heartbeat intervals (the driver fell behind its schedule).
    late_gaps: AtomicU64,
    /// Longest delay between a tick's scheduled time and its heartbeat's start, µs.
    max_lateness_us: AtomicU64,
    /// The full transitions' samples.
    full_samples: std::sync::Mutex<Vec<Sample>>,
    /// `FENCED_INSTANCE_ID` (scenario `f`: another process took a static identity).
    fenced_instance: AtomicU64,
    /// Scenario `f`: processes whose new incarnation started.
    restarted: AtomicU64,
    /// Scenario `f`: the leaves answered `OK`, and the others (not applied, failed).
    leaves_ok: AtomicU64,
    leaves_other: AtomicU64,
    /// Scenario `f`: the restarted members assigned all their old shards again.
    restored: std::sync::Mutex<Vec<Restored>>,
    /// Scenario `f`: member tasks of a stopping process that did not stop within [`STOP_GRACE`].
    aborted: AtomicU64,
    /// Scenario `f`: the restarted members' joins.
    rejoins: std::sync::Mutex<Vec<Rejoin>>,
    /// Scenario `f`: per restarted process, from the stop signal: its members stopped (their
    /// in-flight heartbeats finished), and their leaves answered.
    stops: std::sync::Mutex<Vec<(Duration, Duration)>>,
    /// Scenario `f`: failed connects of a starting process (each retried).
    connect_failures: AtomicU64,
}

/// A restarted member that got its shards back (scenario `f`).
#[derive(Debug, Clone)]
struct Restored {
    member: String,
    /// From its old process's stop to the answer.
    wait: Duration,
    /// The how-manieth answer of the new process it was (1: the join's).
    answers: u32,
}

impl Live {
    /// Counts one answered (or failed) request by path and status; `UNKNOWN_MEMBER_ID` is left
    /// to the caller, which knows the member's previous heartbeat.
    fn record(&self, sample: &Sample) {
        if sample.error {
            self.errors.fetch_add(1, Ordering::Relaxed);
        } else if sample.fast_path {
            self.fast.fetch_add(1, Ordering::Relaxed);
        } else {
            self.full.fetch_add(1, Ordering::Relaxed);
        }
        if sample.attempts > 1 {
            self.conflicts.fetch_add(1, Ordering::Relaxed);
        }
        match sample.status {
            Some(HeartbeatStatus::Retry) => {
                self.retries.fetch_add(1, Ordering::Relaxed);
            }
            Some(HeartbeatStatus::FencedMemberEpoch) => {
                self.fenced.fetch_add(1, Ordering::Relaxed);
            }
            Some(HeartbeatStatus::FencedInstanceId) => {
                self.fenced_instance.fetch_add(1, Ordering::Relaxed);
            }
            _ => {}
        }
        if !sample.fast_path && sample.status.is_some() {
            self.full_samples.lock().expect("samples").push(*sample);
        }
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

fn load(counter: &AtomicU64) -> u64 {
    counter.load(Ordering::Relaxed)
}

/// One member on its own schedule: heartbeats at `first`, then every `interval` (a tick missed
/// because a heartbeat took longer goes out at once), until `stop` (or `FENCED_INSTANCE_ID`,
/// which stops a listener for good). An in-flight heartbeat is finished, so the member's state
/// stays consistent. A restarted member's answer that gives its shards back goes to `live`.
#[allow(clippy::too_many_arguments)]
async fn drive_member(
    mut member: Member,
    first: Instant,
    interval: Duration,
    ttl: Duration,
    base: Instant,
    live: Arc<Live>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Member {
    let mut ticker = tokio::time::interval_at(tokio::time::Instant::from_std(first), interval);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut converged = false;
    let mut previous: Option<(Instant, Option<HeartbeatStatus>)> = None;
    loop {
        let at = tokio::select! {
            biased;
            _ = stop.wait_for(|s| *s) => break,
            at = ticker.tick() => at.into_std(),
        };
        live.max_lateness_us
            .fetch_max(micros(at.elapsed()), Ordering::Relaxed);
        live.started.fetch_add(1, Ordering::Relaxed);
        let sample = member.heartbeat().await;
        live.heartbeats.fetch_add(1, Ordering::Relaxed);
        match previous {
            None => {
                live.joined.fetch_add(1, Ordering::Relaxed);
                live.last_join_us
                    .fetch_max(micros(sample.start - base), Ordering::Relaxed);
            }
            Some((at, _)) => {
                let gap = sample.start - at;
                live.max_gap_us.fetch_max(micros(gap), Ordering::Relaxed);
                if gap > interval * 3 / 2 {
                    live.late_gaps.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        live.record(&sample);
        if sample.status == Some(HeartbeatStatus::UnknownMemberId) {
            live.unknown.fetch_add(1, Ordering::Relaxed);
            if let Some((at, status)) = previous
                && sample.start - at < ttl
            {
                live.unknown_on_time.fetch_add(1, Ordering::Relaxed);
                if status == Some(HeartbeatStatus::Retry) {
                    live.unknown_on_time_after_retry
                        .fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        if let Some(rejoin) = member.rejoined.take() {
            live.rejoins.lock().expect("rejoins").push(rejoin);
        }
        if let Some((wait, answers)) = member.restored.take() {
            live.restored.lock().expect("restored").push(Restored {
                member: member.id.clone(),
                wait,
                answers,
            });
        }
        let now_converged = member.converged();
        if now_converged != converged {
            converged = now_converged;
            live.converged
                .fetch_add(if converged { 1 } else { -1 }, Ordering::Relaxed);
            if converged {
                live.last_converged_us
                    .fetch_max(micros(base.elapsed()), Ordering::Relaxed);
            }
        }
        previous = Some((sample.start, sample.status));
        if member.stopped {
            break;
        }
    }
    // A stopped task's member no longer counts (scenario `f` stops processes one by one).
    if converged {
        live.converged.fetch_sub(1, Ordering::Relaxed);
    }
    member
}

/// The bench process's own CPU (all its threads), seconds: `utime + stime` of `/proc/self/stat`
/// (in `USER_HZ`, 100 per second on Linux). NaN where it cannot be read.
fn process_cpu() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return f64::NAN;
    };
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return f64::NAN;
    };
    // After the command name: field 3 (state) is index 0, utime (14) index 11, stime (15) 12.
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(f64::NAN)
    };
    (ticks(11) + ticks(12)) / 100.0
}

/// Server-side time of each coordinator script, from a SLOWLOG sample of every command over
/// `window`: (script, calls, usec), told apart by their keys and arguments (`EVALSHA sha numkeys
/// …`: the load has 2 keys and no argument, the fast path 2 keys and arguments, the
/// compare-and-set 3 keys). The SLOWLOG settings are restored afterwards.
async fn script_sample(
    conn: &mut RedisConnection,
    window: Duration,
) -> Vec<(String, u64, u64, u64)> {
    let get = |conn: &mut RedisConnection, name: &'static str| {
        let mut conn = conn.clone();
        async move {
            let reply: Vec<String> = redis::cmd("CONFIG")
                .arg("GET")
                .arg(name)
                .query_async(&mut conn)
                .await
                .unwrap_or_default();
            reply.get(1).cloned()
        }
    };
    let slower = get(conn, "slowlog-log-slower-than")
        .await
        .unwrap_or_else(|| "10000".into());
    let len = get(conn, "slowlog-max-len")
        .await
        .unwrap_or_else(|| "128".into());
    let set = |conn: &mut RedisConnection, name: &'static str, value: String| {
        let mut conn = conn.clone();
        async move {
            let _: redis::RedisResult<()> = redis::cmd("CONFIG")
                .arg("SET")
                .arg(name)
                .arg(value)
                .query_async(&mut conn)
                .await;
        }
    };
    set(conn, "slowlog-max-len", "100000".into()).await;
    let _: redis::RedisResult<()> = redis::cmd("SLOWLOG").arg("RESET").query_async(conn).await;
    set(conn, "slowlog-log-slower-than", "0".into()).await;
    tokio::time::sleep(window).await;
    set(conn, "slowlog-log-slower-than", slower).await;
    let entries: redis::RedisResult<Vec<redis::Value>> = redis::cmd("SLOWLOG")
        .arg("GET")
        .arg(100_000)
        .query_async(conn)
        .await;
    let _: redis::RedisResult<()> = redis::cmd("SLOWLOG").arg("RESET").query_async(conn).await;
    set(conn, "slowlog-max-len", len).await;
    let mut by_script: BTreeMap<String, (u64, u64, u64)> = BTreeMap::new();
    for entry in entries.unwrap_or_default() {
        // [id, timestamp, usec, [args…], client address, client name]
        let redis::Value::Array(fields) = entry else {
            continue;
        };
        let usec = match fields.get(2) {
            Some(redis::Value::Int(u)) => u64::try_from(*u).unwrap_or(0),
            _ => continue,
        };
        let args: Vec<String> = match fields.get(3) {
            Some(redis::Value::Array(args)) => args
                .iter()
                .map(|a| redis::from_redis_value::<String>(a.clone()).unwrap_or_default())
                .collect(),
            _ => continue,
        };
        let command = args
            .first()
            .map(|c| c.to_ascii_lowercase())
            .unwrap_or_default();
        let name = if command == "evalsha" {
            match (args.get(2).map(String::as_str), args.len()) {
                (Some("2"), 5) => "script: load".to_owned(),
                (Some("2"), _) => "script: fast path".to_owned(),
                (Some("3"), _) => "script: compare-and-set".to_owned(),
                (Some("1"), 8) => "script: submit (queue)".to_owned(),
                (Some("1"), 6) => "script: poll (queue)".to_owned(),
                (keys, _) => format!("script: other ({} keys)", keys.unwrap_or("?")),
            }
        } else {
            command
        };
        let e = by_script.entry(name).or_default();
        e.0 += 1;
        e.1 += usec;
        e.2 = e.2.max(usec);
    }
    let mut scripts: Vec<(String, u64, u64, u64)> = by_script
        .into_iter()
        .map(|(name, (calls, usec, max))| (name, calls, usec, max))
        .collect();
    scripts.sort_by_key(|s| std::cmp::Reverse(s.2));
    scripts
}

/// What a concurrent convergence gave.
#[derive(Debug, Clone, Default)]
struct Concurrent {
    limit: Duration,
    /// From the last join to the answer that made the last member converged, when the group was
    /// then seen `STABLE` with every member converged; `None`: not within `limit`.
    converged_after_last_join: Option<Duration>,
    /// From the last join to when the monitor saw it (polls every 100 ms).
    observed_after_last_join: Option<Duration>,
    /// From the first join to the last one.
    joins_took: Duration,
    heartbeats: u64,
    full: u64,
    fast: u64,
    conflicts: u64,
    retries: u64,
    unknown: u64,
    unknown_on_time: u64,
    unknown_on_time_after_retry: u64,
    fenced: u64,
    errors: u64,
    max_gap: Duration,
    late_gaps: u64,
    max_lateness: Duration,
    /// The full transitions' samples (for their latency).
    full_latency: Measured,
    /// From the start until every task stopped.
    wall: Duration,
    /// From the stop signal until every task stopped (in-flight heartbeats finish).
    stopping: Duration,
    /// Tasks aborted: all of them at the limit; when converged, any still running 30 s after
    /// the stop signal.
    aborted: usize,
    /// Heartbeats sent but not answered when the tasks stopped.
    in_flight: u64,
    /// Redis CPU over `wall`, fraction of one core; the bench process's, in cores.
    redis_cpu: f64,
    bench_cpu: f64,
    commands: Vec<(String, u64, u64)>,
    /// Per command: name, calls, total µs, the longest call's µs.
    scripts: Vec<(String, u64, u64, u64)>,
}

/// Every member in its own task, heartbeating every `heartbeat_interval` on its own schedule,
/// first heartbeats (the joins) spread evenly over the first interval, as [`run_paced`] does;
/// the protocol as [`Member`] follows it (a `RETRY` is answered by the next tick's heartbeat).
/// A monitor on a thread and runtime of its own (so the members' work does not starve it) prints
/// progress every heartbeat interval and ends the convergence when the group is `STABLE` with
/// every member converged, or after `limit` from the first join. Then the tasks stop: after
/// their in-flight heartbeat when converged (the members go on to the steady window), at once
/// (aborted) when not. Returns the members (all of them only when none was aborted) and the
/// figures.
async fn converge_concurrent(
    members: Vec<Member>,
    target: &RedisTarget,
    stream_keys: &StreamKeys,
    store: &GroupStore,
    config: &CoordinatorConfig,
    limit: Duration,
) -> (Vec<Member>, Concurrent) {
    let interval = config.heartbeat_interval;
    let ttl = config.member_lease_ttl;
    let n = members.len();
    let live = Arc::new(Live::default());
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut conn = RedisConnection::connect(target, Duration::from_secs(10))
        .await
        .expect("connect");
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut conn)
        .await
        .expect("CONFIG RESETSTAT");
    let redis_before = redis_cpu(&mut conn).await;
    let bench_before = process_cpu();
    let base = Instant::now();
    let step = interval / u32::try_from(n).expect("few members");
    let tasks: Vec<_> = members
        .into_iter()
        .enumerate()
        .map(|(i, member)| {
            let first = base + step * u32::try_from(i).expect("few members");
            tokio::spawn(drive_member(
                member,
                first,
                interval,
                ttl,
                base,
                live.clone(),
                stop_rx.clone(),
            ))
        })
        .collect();

    let (monitor, done_rx) = {
        let live = live.clone();
        let keys = (stream_keys.clone(), store.keys().clone(), config.clone());
        spawn_monitor(target.clone(), keys, move |conn, store| {
            monitor(conn, store, live, n, base, interval, limit)
        })
    };
    let mut figures = done_rx.await.expect("monitor");
    monitor.join().expect("monitor thread");
    let stop_at = Instant::now();
    let _ = stop_tx.send(true);
    let converged = figures.converged_after_last_join.is_some();
    let grace = if converged {
        Duration::from_secs(30)
    } else {
        Duration::ZERO
    };
    let deadline = tokio::time::Instant::now() + grace;
    let mut members = Vec::with_capacity(n);
    for mut task in tasks {
        if !converged {
            task.abort();
        }
        match tokio::time::timeout_at(deadline, &mut task).await {
            Ok(Ok(member)) => members.push(member),
            Ok(Err(e)) if e.is_cancelled() => figures.aborted += 1,
            Ok(Err(e)) => panic!("member task: {e}"),
            Err(_) => {
                task.abort();
                figures.aborted += 1;
            }
        }
    }
    figures.stopping = stop_at.elapsed();
    figures.redis_cpu = (figures.redis_cpu - redis_before) / figures.wall.as_secs_f64();
    figures.bench_cpu = (figures.bench_cpu - bench_before) / figures.wall.as_secs_f64();
    figures.limit = limit;
    figures.in_flight = load(&live.started).saturating_sub(load(&live.heartbeats));
    figures.joins_took = Duration::from_micros(load(&live.last_join_us));
    figures.heartbeats = load(&live.heartbeats);
    figures.full = load(&live.full);
    figures.fast = load(&live.fast);
    figures.conflicts = load(&live.conflicts);
    figures.retries = load(&live.retries);
    figures.unknown = load(&live.unknown);
    figures.unknown_on_time = load(&live.unknown_on_time);
    figures.unknown_on_time_after_retry = load(&live.unknown_on_time_after_retry);
    figures.fenced = load(&live.fenced);
    figures.errors = load(&live.errors);
    figures.max_gap = Duration::from_micros(load(&live.max_gap_us));
    figures.late_gaps = load(&live.late_gaps);
    figures.max_lateness = Duration::from_micros(load(&live.max_lateness_us));
    figures.full_latency = Measured {
        samples: std::mem::take(&mut *live.full_samples.lock().expect("samples")),
        wall: figures.wall,
        ..Measured::default()
    };
    (members, figures)
}

/// How long the monitor waits for one of its reads (so that it stops near the limit).
const MONITOR_TIMEOUT: Duration = Duration::from_secs(2);

/// The monitor of [`converge_concurrent`], on its own connection: progress every `interval`,
/// the end (converged or `limit`), and at the end Redis's CPU seconds, the bench process's and
/// the command statistics (cumulative: the caller subtracts the start).
async fn monitor(
    mut conn: RedisConnection,
    mut store: GroupStore,
    live: Arc<Live>,
    n: usize,
    base: Instant,
    interval: Duration,
    limit: Duration,
) -> Concurrent {
    let mut figures = Concurrent::default();
    let mut next_progress = base + interval;
    let mut last_progress: Option<(Instant, f64, f64, u64)> = None;
    let mut sampled = false;
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let joined = load(&live.joined);
        let converged = usize::try_from(live.converged.load(Ordering::Relaxed)).unwrap_or(0);
        let last_join = Duration::from_micros(load(&live.last_join_us));
        if joined == n as u64
            && converged == n
            && let Ok(Ok(loaded)) = tokio::time::timeout(MONITOR_TIMEOUT, store.load()).await
            && loaded.group.meta.state == GroupState::Stable
            && loaded.group.members.len() == n
        {
            let last = Duration::from_micros(load(&live.last_converged_us));
            figures.converged_after_last_join = Some(last.saturating_sub(last_join));
            figures.observed_after_last_join = Some(base.elapsed().saturating_sub(last_join));
            break;
        }
        // One SLOWLOG sample of the scripts' server time, a second after the last join (the
        // group at full size, rebalancing).
        if !sampled && joined == n as u64 && base.elapsed() > last_join + Duration::from_secs(1) {
            sampled = true;
            figures.scripts = script_sample(&mut conn, Duration::from_secs(1)).await;
        }
        if Instant::now() >= next_progress {
            next_progress += interval;
            let loaded = tokio::time::timeout(MONITOR_TIMEOUT, store.load()).await;
            let (state, in_group) = match &loaded {
                Ok(Ok(l)) => (format!("{:?}", l.group.meta.state), l.group.members.len()),
                Ok(Err(e)) => (format!("load failed: {}", Chain(e)), 0),
                Err(_) => (format!("load not answered within {MONITOR_TIMEOUT:?}"), 0),
            };
            let now = Instant::now();
            // NaN when INFO does not answer in time.
            let redis = tokio::time::timeout(MONITOR_TIMEOUT, try_redis_cpu(&mut conn))
                .await
                .ok()
                .flatten()
                .unwrap_or(f64::NAN);
            let bench = process_cpu();
            let heartbeats = load(&live.heartbeats);
            let last = match last_progress {
                None => String::new(),
                Some((at, redis_then, bench_then, heartbeats_then)) => {
                    let secs = (now - at).as_secs_f64();
                    format!(
                        "; last {secs:.1}s: {:.0} answers/s, Redis CPU {:.0}%, bench CPU {:.2} \
                         cores",
                        (heartbeats - heartbeats_then) as f64 / secs,
                        (redis - redis_then) / secs * 100.0,
                        (bench - bench_then) / secs,
                    )
                }
            };
            println!(
                "  t {:>5.1}s: joined {joined}/{n}, group {state}, {in_group} members, converged \
                 {converged}/{n}; in flight {}; full {}, fast {}, CAS conflicts {}, RETRY {}, \
                 UNKNOWN_MEMBER_ID {} (on time {}), FENCED_MEMBER_EPOCH {}{}; longest gap \
                 {:.1?}{last}",
                (now - base).as_secs_f64(),
                load(&live.started).saturating_sub(heartbeats),
                load(&live.full),
                load(&live.fast),
                load(&live.conflicts),
                load(&live.retries),
                load(&live.unknown),
                load(&live.unknown_on_time),
                load(&live.fenced),
                match load(&live.errors) {
                    0 => String::new(),
                    e => format!(", ERRORS {e}"),
                },
                Duration::from_micros(load(&live.max_gap_us)),
            );
            if !redis.is_nan() {
                last_progress = Some((now, redis, bench, heartbeats));
            }
        }
        if base.elapsed() >= limit {
            println!("  did not converge within {limit:?}: stopping the members");
            break;
        }
    }
    figures.wall = base.elapsed();
    figures.redis_cpu = try_redis_cpu(&mut conn).await.unwrap_or(f64::NAN);
    figures.bench_cpu = process_cpu();
    figures.commands = command_stats(&mut conn).await;
    figures
}

/// The end-of-convergence report of [`converge_concurrent`].
fn print_concurrent(c: &Concurrent, config: &CoordinatorConfig, members: usize) {
    match (c.converged_after_last_join, c.observed_after_last_join) {
        (Some(took), Some(seen)) => println!(
            "  CONVERGED {took:.1?} after the last join (the last member's converged answer; \
             STABLE seen {seen:.1?} after it); joins spread over {:.1?}",
            c.joins_took
        ),
        _ => println!(
            "  did not converge within {:?} (joins spread over {:.1?})",
            c.limit, c.joins_took
        ),
    }
    println!(
        "  {} heartbeats: full transitions {}, fast-path answers {}, CAS conflicts (attempts > 1) \
         {}, RETRY {}, UNKNOWN_MEMBER_ID {} ({} to a member that heartbeated on time, {} of them \
         after a RETRY), FENCED_MEMBER_EPOCH {}, errors {}",
        c.heartbeats,
        c.full,
        c.fast,
        c.conflicts,
        c.retries,
        c.unknown,
        c.unknown_on_time,
        c.unknown_on_time_after_retry,
        c.fenced,
        c.errors
    );
    if c.unknown_on_time > 0 {
        println!(
            "  VIOLATION: {} times a member heartbeating on time (gap < lease TTL {:?}) was \
             answered UNKNOWN_MEMBER_ID",
            c.unknown_on_time, config.member_lease_ttl
        );
    }
    println!(
        "  longest gap between two heartbeats of a member {:.1?} (interval {:?}); {} gaps over \
         1.5 intervals; a tick started at most {:.1?} late{}",
        c.max_gap,
        config.heartbeat_interval,
        c.late_gaps,
        c.max_lateness,
        if c.max_gap > config.heartbeat_interval * 3 / 2 {
            ": the members fell behind their schedule"
        } else {
            ""
        }
    );
    let full = &c.full_latency;
    println!(
        "  full transitions, client side: p50 {}, p99 {}, max {} ({} samples)",
        ms(full.percentile(50.0)),
        ms(full.percentile(99.0)),
        ms(full.max()),
        full.samples.len()
    );
    let evalsha = c
        .commands
        .iter()
        .find(|(name, _, _)| name == "evalsha")
        .map_or((0, 0), |(_, calls, usec)| (*calls, *usec));
    println!(
        "  over {:.1?} (stopping took {:.1?}{}, {} heartbeats in flight): Redis CPU {:.1}% of a core, {:.2} ms of Redis \
         CPU per full transition; EVALSHA {} calls, {:.2} ms per full transition; bench process \
         CPU {:.2} cores of {}{}",
        c.wall,
        c.stopping,
        if c.aborted > 0 {
            format!(", {} tasks aborted", c.aborted)
        } else {
            String::new()
        },
        c.in_flight,
        c.redis_cpu * 100.0,
        c.redis_cpu * c.wall.as_secs_f64() * 1e3 / c.full.max(1) as f64,
        evalsha.0,
        evalsha.1 as f64 / 1e3 / c.full.max(1) as f64,
        c.bench_cpu,
        std::thread::available_parallelism().map_or(0, usize::from),
        if c.bench_cpu
            > 0.8 * std::thread::available_parallelism().map_or(f64::INFINITY, |p| p.get() as f64)
        {
            ": the bench process is near saturation, the figures are client-bound"
        } else {
            ""
        }
    );
    // The load script's HGETALL of the group hash counts the group loads (the monitor's too):
    // one per batch of combined full transitions and per attempt of a requester's own (the
    // combiner's submit and poll scripts read TIME as well, so TIME no longer counts them).
    let loads = c
        .commands
        .iter()
        .find(|(name, _, _)| name == "hgetall")
        .map_or(0, |(_, calls, _)| *calls);
    println!(
        "  group loads (HGETALL calls) {loads}: {:.2} per full transition; bench CPU {:.1} ms \
         per load (the client's decode + the transitions of each batch or attempt)",
        loads as f64 / c.full.max(1) as f64,
        c.bench_cpu * c.wall.as_secs_f64() * 1e3 / loads.max(1) as f64
    );
    println!("  INFO commandstats of the convergence ({members} members):");
    print_commands(&c.commands, 8);
    if c.scripts.is_empty() {
        println!("  SLOWLOG sample of the scripts: none taken (converged first)");
    } else {
        println!("  SLOWLOG sample (1 s, a second after the last join), server time per command:");
        for (name, calls, usec, max) in c.scripts.iter().take(8) {
            println!(
                "    {name:<24} calls {calls:>7}  usec {usec:>10}  usec/call {:>8.2}  max {max:>7}",
                *usec as f64 / (*calls).max(1) as f64
            );
        }
    }
}

/// How long a stopped process's member may take to finish its in-flight heartbeat before its
/// task is aborted (and counted): far beyond any answer's time.
const STOP_GRACE: Duration = Duration::from_secs(30);
/// Scenario `f`: the monitor's progress lines (the phase lasts minutes).
const RESTART_PROGRESS: Duration = Duration::from_secs(15);

/// What the restart tasks of [`rolling_restart`] share.
struct RestartContext {
    target: RedisTarget,
    stream_keys: StreamKeys,
    group_keys: GroupKeys,
    config: CoordinatorConfig,
    live: Arc<Live>,
    /// The start of the phase: the drivers' time base.
    base: Instant,
    /// The old process stops without a leave (kill -9).
    hard: bool,
    /// Every member task started, so that a phase that did not settle can be abandoned at
    /// once: a collapsed group answers so slowly that stopping member by member takes hours.
    started: std::sync::Mutex<Vec<tokio::task::AbortHandle>>,
}

/// One process incarnation: its members' driver tasks and their stop signal.
struct Incarnation {
    stop: tokio::sync::watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<Member>>,
}

impl Incarnation {
    /// Drives one process's `members`, each first at its instant ([`drive_member`]).
    fn start(members: Vec<(Member, Instant)>, ctx: &RestartContext) -> Self {
        let (stop, stop_rx) = tokio::sync::watch::channel(false);
        let tasks: Vec<_> = members
            .into_iter()
            .map(|(member, first)| {
                tokio::spawn(drive_member(
                    member,
                    first,
                    ctx.config.heartbeat_interval,
                    ctx.config.member_lease_ttl,
                    ctx.base,
                    ctx.live.clone(),
                    stop_rx.clone(),
                ))
            })
            .collect();
        ctx.started
            .lock()
            .expect("started")
            .extend(tasks.iter().map(tokio::task::JoinHandle::abort_handle));
        Incarnation { stop, tasks }
    }

    /// Signals the process to stop: each member finishes its in-flight heartbeat.
    fn signal(&self) {
        let _ = self.stop.send(true);
    }

    /// Stops the process ([`Incarnation::signal`]) and takes its members back by `deadline`
    /// (a task still running then is aborted). Returns the members and how many were aborted.
    async fn stop(self, deadline: tokio::time::Instant) -> (Vec<Member>, u64) {
        self.signal();
        let mut members = Vec::with_capacity(self.tasks.len());
        let mut aborted = 0;
        for mut task in self.tasks {
            match tokio::time::timeout_at(deadline, &mut task).await {
                Ok(Ok(member)) => members.push(member),
                Ok(Err(e)) => panic!("member task: {e}"),
                Err(_) => {
                    task.abort();
                    aborted += 1;
                }
            }
        }
        (members, aborted)
    }
}

/// Restarts process `process` as a deployment does: stops its members (each after its in-flight
/// heartbeat: nothing is read from then on, which is when the wait for the shards starts) and,
/// unless `hard` (a kill sends nothing), sends their leaves together, as a listener's shutdown
/// does; [`START_UP_DELAY`] after the old process is gone, the new process's members (the same
/// ids, a new process id, a new connection each) join at once, then heartbeat every interval.
/// Each remembers when the old process stopped and what it owned.
async fn restart_process(
    process: usize,
    old: Incarnation,
    ctx: Arc<RestartContext>,
) -> Incarnation {
    let stopped_at = Instant::now();
    let (mut members, aborted) = old.stop(tokio::time::Instant::now() + STOP_GRACE).await;
    let stopped = stopped_at.elapsed();
    ctx.live.aborted.fetch_add(aborted, Ordering::Relaxed);
    if !ctx.hard {
        // A listener bounds its leave as every heartbeat, by a third of the lease: one not
        // answered by then is not delivered, and the lease runs out instead.
        let bound = ctx.config.member_lease_ttl / 3;
        let leaves = members
            .iter_mut()
            .map(|m| tokio::time::timeout(bound, m.leave()));
        let leaves = futures_util::future::join_all(leaves).await;
        for sample in &leaves {
            let Ok(sample) = sample else {
                ctx.live.leaves_other.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            ctx.live.record(sample);
            let counter = if sample.status == Some(HeartbeatStatus::Ok) {
                &ctx.live.leaves_ok
            } else {
                &ctx.live.leaves_other
            };
            counter.fetch_add(1, Ordering::Relaxed);
        }
    }
    ctx.live
        .stops
        .lock()
        .expect("stops")
        .push((stopped, stopped_at.elapsed()));
    tokio::time::sleep(START_UP_DELAY).await;
    let process_id = format!("p{process:03}-run1");
    let mut stores = Vec::with_capacity(members.len());
    for _ in &members {
        let conn = connect_retrying(&ctx.target, &ctx.live).await;
        stores.push(GroupStore::new(
            conn,
            ctx.stream_keys.clone(),
            ctx.group_keys.clone(),
            ctx.config.clone(),
        ));
    }
    let now = Instant::now();
    let next = members
        .iter()
        .zip(stores)
        .map(|(old, store)| {
            let ttl = ctx.config.member_lease_ttl;
            (
                old.restarted(process_id.clone(), store, stopped_at, ttl),
                now,
            )
        })
        .collect();
    ctx.live.restarted.fetch_add(1, Ordering::Relaxed);
    Incarnation::start(next, &ctx)
}

/// A starting process's connection: a connect that fails (it times out when the machine is
/// saturated) is retried a second later, as a process starting up would, and counted.
async fn connect_retrying(target: &RedisTarget, live: &Live) -> RedisConnection {
    loop {
        match RedisConnection::connect(target, Duration::from_secs(10)).await {
            Ok(conn) => return conn,
            Err(e) => {
                if live.connect_failures.fetch_add(1, Ordering::Relaxed) == 0 {
                    eprintln!("  a restarted member's connect failed: {e} (retried; counted)");
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

/// Shard → its owner (member id) in a target.
type Owners = BTreeMap<ShardIndex, String>;

fn owners(target: &TargetAssignment) -> Owners {
    target
        .members
        .iter()
        .flat_map(|(id, shards)| shards.iter().map(move |s| (*s, id.clone())))
        .collect()
}

/// The stored target alone: the group hash's `meta` field (a full load decodes every member
/// too, which the monitor need not pay every [`TARGET_SAMPLE`]).
async fn read_owners(conn: &mut RedisConnection, key: &str) -> Option<Owners> {
    let json: Option<String> = conn.hget(key, "meta").await.ok()?;
    let meta: GroupMetadata = serde_json::from_str(&json?).ok()?;
    Some(owners(&meta.target_assignment))
}

/// The shards whose owner differs between two targets (without one in either counts): shard,
/// owner before, owner after.
fn moved_shards<'a>(
    before: &'a Owners,
    after: &'a Owners,
) -> Vec<(ShardIndex, Option<&'a str>, Option<&'a str>)> {
    let shards: BTreeSet<ShardIndex> = before.keys().chain(after.keys()).copied().collect();
    shards
        .into_iter()
        .filter_map(|s| {
            let (was, is) = (
                before.get(&s).map(String::as_str),
                after.get(&s).map(String::as_str),
            );
            (was != is).then_some((s, was, is))
        })
        .collect()
}

/// What the rolling restart of scenario `f` gave.
#[derive(Debug, Clone, Default)]
struct Restarts {
    processes: usize,
    members: usize,
    hard: bool,
    limit: Duration,
    /// From the start of the phase: the first restart's stop signal and the last one's.
    first_restart: Duration,
    last_restart: Duration,
    /// From the start of the phase: when the monitor saw every member restored and the group
    /// `STABLE` with every member converged; `None`: not within `limit` of the last restart.
    settled_at: Option<Duration>,
    /// The target before the first restart (the monitor's first read).
    before: Option<Owners>,
    /// Shards whose owner differs between `before` and the target at the end.
    moved_overall: Option<usize>,
    /// The monitor's reads of the target, those that differed from the read before, and the
    /// shards that changed owner in them (a few described in `examples`).
    target_samples: u64,
    target_changes: u64,
    moved_during: usize,
    examples: Vec<String>,
    /// Restarted members assigned all their old shards again.
    waits: Vec<Restored>,
    /// The restarted members' joins, and per process when its members stopped and left.
    rejoins: Vec<Rejoin>,
    stops: Vec<(Duration, Duration)>,
    connect_failures: u64,
    heartbeats: u64,
    full: u64,
    fast: u64,
    conflicts: u64,
    retries: u64,
    unknown: u64,
    unknown_on_time: u64,
    fenced: u64,
    fenced_instance: u64,
    errors: u64,
    leaves_ok: u64,
    leaves_other: u64,
    /// Member tasks that did not stop within [`STOP_GRACE`].
    aborted: u64,
    max_gap: Duration,
    late_gaps: u64,
    full_latency: Measured,
    /// From the start of the phase until every task stopped; the stopping alone.
    wall: Duration,
    stopping: Duration,
    /// Redis CPU over `wall`, fraction of one core; the bench process's, in cores.
    redis_cpu: f64,
    bench_cpu: f64,
    commands: Vec<(String, u64, u64)>,
    /// The group at the end: state, members, and how many of the driven members converged.
    end_state: Option<GroupState>,
    end_members: usize,
    end_converged: usize,
}

impl Restarts {
    /// Lease + 2 heartbeats: the goal's bound on a restarted member's wait.
    fn wait_goal(config: &CoordinatorConfig) -> Duration {
        config.member_lease_ttl + config.heartbeat_interval * 2
    }

    /// The waits, ascending.
    fn sorted_waits(&self) -> Vec<Duration> {
        let mut waits: Vec<Duration> = self.waits.iter().map(|r| r.wait).collect();
        waits.sort_unstable();
        waits
    }

    fn no_shard_moved(&self) -> bool {
        self.moved_overall == Some(0) && self.moved_during == 0
    }

    /// Every member restored within the goal's bound.
    fn every_shard_read_in_time(&self, config: &CoordinatorConfig) -> bool {
        let goal = Restarts::wait_goal(config);
        self.waits.len() == self.members && self.waits.iter().all(|r| r.wait <= goal)
    }

    fn stable_at_end(&self) -> bool {
        self.end_state == Some(GroupState::Stable) && self.end_members == self.members
    }
}

/// The `p`th percentile of ascending `values` (nearest rank), zero when empty.
fn percentile_of(values: &[Duration], p: f64) -> Duration {
    if values.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p / 100.0) * values.len() as f64).ceil() as usize;
    values[rank.clamp(1, values.len()) - 1]
}

/// Scenario `f`'s rolling restart of the converged `members` ([`MEMBERS_PER_PROCESS`] a
/// process, in order): every member back on its own schedule, spread over an interval (as
/// [`converge_concurrent`]); an interval and a second later (every member heartbeated once), one
/// process restarted every [`RESTART_EVERY`] ([`restart_process`]), all of them. A monitor on a
/// thread, runtime and connection of its own ([`restart_monitor`]) reads the target throughout
/// and ends the phase once every restarted member got its shards back and the group is
/// `STABLE` with every member converged, or `limit` after the last restart. Then every task
/// stops after its in-flight heartbeat. Returns the new incarnations' members and the figures.
async fn rolling_restart(
    members: Vec<Member>,
    target: &RedisTarget,
    stream_keys: &StreamKeys,
    store: &GroupStore,
    config: &CoordinatorConfig,
    hard: bool,
    limit: Duration,
) -> (Vec<Member>, Restarts) {
    let interval = config.heartbeat_interval;
    let n = members.len();
    let processes = n.div_ceil(MEMBERS_PER_PROCESS);
    let live = Arc::new(Live::default());
    let mut conn = RedisConnection::connect(target, Duration::from_secs(10))
        .await
        .expect("connect");
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut conn)
        .await
        .expect("CONFIG RESETSTAT");
    let redis_before = redis_cpu(&mut conn).await;
    let bench_before = process_cpu();
    let base = Instant::now();
    let ctx = Arc::new(RestartContext {
        target: target.clone(),
        stream_keys: stream_keys.clone(),
        group_keys: store.keys().clone(),
        config: config.clone(),
        live: live.clone(),
        base,
        hard,
        started: std::sync::Mutex::new(Vec::new()),
    });
    let step = interval / u32::try_from(n).expect("few members");
    let mut scheduled: Vec<(Member, Instant)> = members
        .into_iter()
        .enumerate()
        .map(|(i, m)| (m, base + step * u32::try_from(i).expect("few members")))
        .collect();
    let mut running: Vec<Option<Incarnation>> = Vec::with_capacity(processes);
    while !scheduled.is_empty() {
        let rest = scheduled.split_off(MEMBERS_PER_PROCESS.min(scheduled.len()));
        running.push(Some(Incarnation::start(
            std::mem::replace(&mut scheduled, rest),
            &ctx,
        )));
    }
    let first_restart = base + interval + Duration::from_secs(1);

    let (monitor, done_rx) = {
        let live = live.clone();
        let keys = (stream_keys.clone(), store.keys().clone(), config.clone());
        let give_up = first_restart
            + RESTART_EVERY * u32::try_from(processes).expect("few processes")
            + limit;
        spawn_monitor(target.clone(), keys, move |conn, store| {
            restart_monitor(conn, store, live, (n, processes), base, give_up)
        })
    };

    let mut restarts = Vec::with_capacity(processes);
    let (mut first_signal, mut last_signal) = (None, Duration::ZERO);
    for (p, slot) in running.iter_mut().enumerate() {
        let at = first_restart + RESTART_EVERY * u32::try_from(p).expect("few processes");
        tokio::time::sleep_until(tokio::time::Instant::from_std(at)).await;
        last_signal = base.elapsed();
        first_signal.get_or_insert(last_signal);
        let old = slot.take().expect("a running process");
        restarts.push(tokio::spawn(restart_process(p, old, ctx.clone())));
    }
    let mut figures = done_rx.await.expect("monitor");
    monitor.join().expect("monitor thread");
    let stop_at = Instant::now();
    let members = if figures.settled_at.is_some() {
        let mut incarnations = Vec::with_capacity(processes);
        for restart in restarts {
            incarnations.push(restart.await.expect("restart task"));
        }
        stop_all(incarnations, &mut figures).await
    } else {
        abandon(restarts, &ctx, &mut figures)
    };
    figures.stopping = stop_at.elapsed();
    figures.hard = hard;
    figures.limit = limit;
    figures.first_restart = first_signal.unwrap_or_default();
    figures.last_restart = last_signal;
    figures.redis_cpu = (figures.redis_cpu - redis_before) / figures.wall.as_secs_f64();
    figures.bench_cpu = (figures.bench_cpu - bench_before) / figures.wall.as_secs_f64();
    figures.heartbeats = load(&live.heartbeats);
    figures.full = load(&live.full);
    figures.fast = load(&live.fast);
    figures.conflicts = load(&live.conflicts);
    figures.retries = load(&live.retries);
    figures.unknown = load(&live.unknown);
    figures.unknown_on_time = load(&live.unknown_on_time);
    figures.fenced = load(&live.fenced);
    figures.fenced_instance = load(&live.fenced_instance);
    figures.errors = load(&live.errors);
    figures.leaves_ok = load(&live.leaves_ok);
    figures.leaves_other = load(&live.leaves_other);
    figures.aborted += load(&live.aborted);
    figures.max_gap = Duration::from_micros(load(&live.max_gap_us));
    figures.late_gaps = load(&live.late_gaps);
    figures.waits = std::mem::take(&mut *live.restored.lock().expect("restored"));
    figures.rejoins = std::mem::take(&mut *live.rejoins.lock().expect("rejoins"));
    figures.stops = std::mem::take(&mut *live.stops.lock().expect("stops"));
    figures.connect_failures = load(&live.connect_failures);
    figures.full_latency = Measured {
        samples: std::mem::take(&mut *live.full_samples.lock().expect("samples")),
        wall: figures.wall,
        ..Measured::default()
    };
    let loaded = store.clone().load().await.expect("load group");
    figures.end_state = Some(loaded.group.meta.state);
    figures.end_members = loaded.group.members.len();
    figures.end_converged = members.iter().filter(|m| m.converged()).count();
    if figures.settled_at.is_none() {
        println!(
            "  the phase did not settle: {} member tasks abandoned (aborted); the figures below \
             are up to then",
            figures.aborted
        );
    }
    let after = owners(&loaded.group.meta.target_assignment);
    figures.moved_overall = figures
        .before
        .as_ref()
        .map(|before| moved_shards(before, &after).len());
    (members, figures)
}

/// Stops every process of a settled phase, each member after its in-flight heartbeat, within
/// [`STOP_GRACE`] in all; returns the members in process order.
async fn stop_all(incarnations: Vec<Incarnation>, figures: &mut Restarts) -> Vec<Member> {
    for incarnation in &incarnations {
        incarnation.signal();
    }
    let deadline = tokio::time::Instant::now() + STOP_GRACE;
    let mut members = Vec::new();
    for incarnation in incarnations {
        let (stopped, aborted) = incarnation.stop(deadline).await;
        members.extend(stopped);
        figures.aborted += aborted;
    }
    members
}

/// Abandons a phase that did not settle: aborts the restarts still running and every member
/// task (counted in `aborted`; their members are lost, the steady window is skipped anyway).
fn abandon(
    restarts: Vec<tokio::task::JoinHandle<Incarnation>>,
    ctx: &RestartContext,
    figures: &mut Restarts,
) -> Vec<Member> {
    for restart in &restarts {
        restart.abort();
    }
    for task in ctx.started.lock().expect("started").iter() {
        if !task.is_finished() {
            task.abort();
            figures.aborted += 1;
        }
    }
    Vec::new()
}

/// The monitor of [`rolling_restart`], on its own connection: reads the target every
/// [`TARGET_SAMPLE`] (the first read is the target before the first restart) and counts every
/// change of owner; prints progress every [`RESTART_PROGRESS`]; ends once all `processes`
/// restarted, all `n` members got their shards back and the group is `STABLE` with every
/// member converged, or at `give_up`. At the end: Redis's CPU seconds, the bench process's and
/// the command statistics (cumulative: the caller subtracts the start).
async fn restart_monitor(
    mut conn: RedisConnection,
    mut store: GroupStore,
    live: Arc<Live>,
    (n, processes): (usize, usize),
    base: Instant,
    give_up: Instant,
) -> Restarts {
    let meta_key = store.keys().metadata();
    let mut figures = Restarts {
        processes,
        members: n,
        ..Restarts::default()
    };
    let mut previous: Option<Owners> = None;
    let mut next_progress = base + RESTART_PROGRESS;
    let mut last_progress: Option<(Instant, f64, f64, u64)> = None;
    loop {
        tokio::time::sleep(TARGET_SAMPLE).await;
        if let Ok(Some(owners)) =
            tokio::time::timeout(MONITOR_TIMEOUT, read_owners(&mut conn, &meta_key)).await
        {
            figures.target_samples += 1;
            match &previous {
                None => figures.before = Some(owners.clone()),
                Some(before) => note_moves(&mut figures, before, &owners, base),
            }
            previous = Some(owners);
        }
        let restarted = usize::try_from(load(&live.restarted)).unwrap_or(0);
        let restored = live.restored.lock().expect("restored").len();
        let converged = usize::try_from(live.converged.load(Ordering::Relaxed)).unwrap_or(0);
        if restarted == processes
            && restored == n
            && converged == n
            && let Ok(Ok(loaded)) = tokio::time::timeout(MONITOR_TIMEOUT, store.load()).await
            && loaded.group.meta.state == GroupState::Stable
            && loaded.group.members.len() == n
        {
            figures.settled_at = Some(base.elapsed());
            break;
        }
        if Instant::now() >= next_progress {
            next_progress += RESTART_PROGRESS;
            let loaded = tokio::time::timeout(MONITOR_TIMEOUT, store.load()).await;
            let now = Instant::now();
            let redis = tokio::time::timeout(MONITOR_TIMEOUT, try_redis_cpu(&mut conn))
                .await
                .ok()
                .flatten()
                .unwrap_or(f64::NAN);
            let bench = process_cpu();
            let heartbeats = load(&live.heartbeats);
            let last = last_progress.map_or_else(String::new, |(at, redis_then, bench_then, h)| {
                let secs = (now - at).as_secs_f64();
                format!(
                    "; last {secs:.0}s: {:.0} answers/s, Redis CPU {:.0}%, bench CPU {:.2} cores",
                    (heartbeats - h) as f64 / secs,
                    (redis - redis_then) / secs * 100.0,
                    (bench - bench_then) / secs,
                )
            });
            let longest = live
                .restored
                .lock()
                .expect("restored")
                .iter()
                .map(|r| r.wait)
                .max()
                .unwrap_or_default();
            println!(
                "  t {:>5.1}s: restarted {restarted}/{processes} processes, restored {restored}/{n} \
                 members (longest wait {longest:.1?}), group {}, converged {converged}/{n}; full \
                 {}, fast {}, CAS conflicts {}, RETRY {}, UNKNOWN_MEMBER_ID {}, FENCED_* {}; target \
                 changes {} ({} shards){last}",
                (now - base).as_secs_f64(),
                match &loaded {
                    Ok(Ok(l)) => format!(
                        "{:?} with {} members",
                        l.group.meta.state,
                        l.group.members.len()
                    ),
                    Ok(Err(e)) => format!("load failed: {}", Chain(e)),
                    Err(_) => format!("load not answered within {MONITOR_TIMEOUT:?}"),
                },
                load(&live.full),
                load(&live.fast),
                load(&live.conflicts),
                load(&live.retries),
                load(&live.unknown),
                load(&live.fenced) + load(&live.fenced_instance),
                figures.target_changes,
                figures.moved_during,
            );
            if !redis.is_nan() {
                last_progress = Some((now, redis, bench, heartbeats));
            }
        }
        if Instant::now() >= give_up {
            println!("  did not settle in time after the last restart: stopping the members");
            break;
        }
    }
    figures.wall = base.elapsed();
    figures.redis_cpu = try_redis_cpu(&mut conn).await.unwrap_or(f64::NAN);
    figures.bench_cpu = process_cpu();
    figures.commands = command_stats(&mut conn).await;
    figures
}

/// Counts the changes of owner between two reads of the target, describing the first few (a
/// move is the goal's failure: which member took which shard, and when, says why).
fn note_moves(figures: &mut Restarts, before: &Owners, after: &Owners, base: Instant) {
    let moved = moved_shards(before, after);
    if moved.is_empty() {
        return;
    }
    figures.target_changes += 1;
    figures.moved_during += moved.len();
    if figures.examples.len() < 10 {
        let (shard, was, is) = moved[0];
        let members = |o: &Owners| o.values().cloned().collect::<BTreeSet<String>>();
        let (then, now) = (members(before), members(after));
        let list = |ids: Vec<&String>| {
            let n = ids.len();
            let shown: Vec<&str> = ids.into_iter().take(6).map(String::as_str).collect();
            format!(
                "{n} [{}{}]",
                shown.join(", "),
                if n > 6 { ", …" } else { "" }
            )
        };
        figures.examples.push(format!(
            "t {:.1}s: {} shards changed owner, e.g. shard {shard} {} -> {}; owners gone from \
             the target {}, new owners {}",
            base.elapsed().as_secs_f64(),
            moved.len(),
            was.unwrap_or("(none)"),
            is.unwrap_or("(none)"),
            list(then.difference(&now).collect()),
            list(now.difference(&then).collect()),
        ));
    }
}

/// min / p50 / p99 / max of `values`.
fn spread(mut values: Vec<Duration>) -> String {
    values.sort_unstable();
    format!(
        "{:.2?} / {:.2?} / {:.2?} / {:.2?}",
        values.first().copied().unwrap_or_default(),
        percentile_of(&values, 50.0),
        percentile_of(&values, 99.0),
        values.last().copied().unwrap_or_default()
    )
}

/// Where a restart's time goes, from the stop signal, and the joins against the old process's
/// reservation (a static leave keeps the target reserved only while the lease of the member's
/// last heartbeat runs: a join applied later finds the member expired and its shards moved).
fn print_restart_timeline(r: &Restarts) {
    let joins = &r.rejoins;
    let count = |f: &dyn Fn(&Rejoin) -> bool| joins.iter().filter(|j| f(j)).count();
    println!(
        "  restart timeline from the stop signal (min / p50 / p99 / max): old members stopped \
         (in-flight heartbeats done) {}; leaves answered {}; joins sent {}; joins answered {}",
        spread(r.stops.iter().map(|s| s.0).collect()),
        if r.hard {
            "none sent (hard)".to_owned()
        } else {
            spread(r.stops.iter().map(|s| s.1).collect())
        },
        spread(joins.iter().map(|j| j.sent).collect()),
        spread(joins.iter().map(|j| j.answered).collect()),
    );
    let statuses: BTreeMap<String, usize> = joins.iter().fold(BTreeMap::new(), |mut m, j| {
        *m.entry(format!("{:?}", j.status)).or_default() += 1;
        m
    });
    println!(
        "  {} joins answered ({statuses:?}); {} assigned all the old shards at once, {} some, {} \
         none; {} sent after the old process's reservation had surely ended (its last renewal's \
         answer + lease TTL), {} answered after it may have; connect failures {}",
        joins.len(),
        count(&|j| j.old_shards_assigned == j.old_shards),
        count(&|j| j.old_shards_assigned > 0 && j.old_shards_assigned < j.old_shards),
        count(&|j| j.old_shards_assigned == 0 && j.old_shards > 0),
        count(&|j| j.after_reservation),
        count(&|j| j.maybe_after_reservation),
        r.connect_failures,
    );
}

/// The rolling restart's report ([`rolling_restart`]), with the goal's verdicts.
fn print_restart(r: &Restarts, config: &CoordinatorConfig, shards: u32) {
    let goal = Restarts::wait_goal(config);
    println!(
        "  ROLLING RESTART ({}) of {} processes x {MEMBERS_PER_PROCESS} members, one every \
         {RESTART_EVERY:?}: stop signals from t {:.1?} to t {:.1?}; {}",
        if r.hard {
            "hard: the old process stops without a leave"
        } else {
            "graceful: static leaves, then the new process"
        },
        r.processes,
        r.first_restart,
        r.last_restart,
        r.settled_at.map_or_else(
            || format!("did NOT settle within {:?} of the last restart", r.limit),
            |at| format!(
                "settled {:.1?} after the last restart (every member restored, group STABLE, \
                 every member converged)",
                at.saturating_sub(r.last_restart)
            )
        ),
    );
    println!(
        "  shards moved: {} of {shards} (target before the first restart vs at the end); target \
         changes seen by the monitor: {} in {} reads (every {TARGET_SAMPLE:?}), {} shards \
         changed owner in them",
        r.moved_overall
            .map_or_else(|| "? (no read before)".into(), |m| m.to_string()),
        r.target_changes,
        r.target_samples,
        r.moved_during
    );
    for example in &r.examples {
        println!("    {example}");
    }
    let waits = r.sorted_waits();
    let over = waits.iter().filter(|w| **w > goal).count();
    let on_join = r.waits.iter().filter(|w| w.answers == 1).count();
    println!(
        "  shards read again: {} of {} restarted members were assigned all their old shards; \
         from the old process's stop: min {:.2?}, p50 {:.2?}, p99 {:.2?}, max {:.2?}; {over} over \
         lease + 2 heartbeats ({goal:?}); {on_join} on the join's answer, {} later",
        waits.len(),
        r.members,
        waits.first().copied().unwrap_or_default(),
        percentile_of(&waits, 50.0),
        percentile_of(&waits, 99.0),
        waits.last().copied().unwrap_or_default(),
        waits.len() - on_join,
    );
    let mut slowest = r.waits.clone();
    slowest.sort_by_key(|w| std::cmp::Reverse(w.wait));
    let slowest: Vec<String> = slowest
        .iter()
        .take(5)
        .map(|w| format!("{} {:.2?} (answer {})", w.member, w.wait, w.answers))
        .collect();
    println!("    slowest: {}", slowest.join(", "));
    print_restart_timeline(r);
    println!(
        "  leaves answered OK {}, otherwise {}; {} heartbeats (leaves included): full transitions \
         {}, fast path {} ({:.1}%), CAS conflicts {}, RETRY {}, UNKNOWN_MEMBER_ID {} ({} on \
         time), FENCED_MEMBER_EPOCH {}, FENCED_INSTANCE_ID {}, errors {}, tasks aborted {}",
        r.leaves_ok,
        r.leaves_other,
        r.heartbeats + r.leaves_ok + r.leaves_other,
        r.full,
        r.fast,
        100.0 * r.fast as f64 / (r.full + r.fast).max(1) as f64,
        r.conflicts,
        r.retries,
        r.unknown,
        r.unknown_on_time,
        r.fenced,
        r.fenced_instance,
        r.errors,
        r.aborted,
    );
    let full = &r.full_latency;
    println!(
        "  longest gap between two heartbeats of a member {:.1?} ({} over 1.5 intervals); full \
         transitions, client side: p50 {}, p99 {}, max {} ({} samples)",
        r.max_gap,
        r.late_gaps,
        ms(full.percentile(50.0)),
        ms(full.percentile(99.0)),
        ms(full.max()),
        full.samples.len()
    );
    let loads = r
        .commands
        .iter()
        .find(|(name, _, _)| name == "hgetall")
        .map_or(0, |(_, calls, _)| *calls);
    println!(
        "  over {:.1?} (stopping took {:.1?}): Redis CPU {:.1}% of a core, bench process CPU \
         {:.2} cores of {}; group loads (HGETALL) {loads}, {:.2} per full transition",
        r.wall,
        r.stopping,
        r.redis_cpu * 100.0,
        r.bench_cpu,
        std::thread::available_parallelism().map_or(0, usize::from),
        loads as f64 / r.full.max(1) as f64,
    );
    println!("  INFO commandstats of the rolling restart:");
    print_commands(&r.commands, 8);
    println!(
        "  at the end: group {}, {} members; {} of {} members converged",
        r.end_state.map_or_else(|| "?".into(), |s| format!("{s:?}")),
        r.end_members,
        r.end_converged,
        r.members
    );
    println!(
        "  GOAL: no shard moved {}; every shard read again within {goal:?} of its owner's \
         restart {}; STABLE with {} members at the end {}",
        yes_no(r.no_shard_moved()),
        yes_no(r.every_shard_read_in_time(config)),
        r.members,
        yes_no(r.stable_at_end()),
    );
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
    /// The concurrent convergence's figures (scenarios d, e, f).
    concurrent: Option<Concurrent>,
    /// The rolling restart's figures (scenario f).
    restart: Option<Restarts>,
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
        config.clone(),
    );
    store
        .provision(scenario.after_loss)
        .await
        .expect("provision");
    let mut members: Vec<Member> = (0..scenario.members)
        .map(|i| Member::new(member_id(i), store.clone()))
        .collect();
    if scenario.concurrent {
        println!(
            "  concurrent convergence: every member in its own task, a heartbeat every \
             {interval:?}, the joins spread over the first interval (progress every interval):"
        );
        // As deployed: every member (a process of its own) on a connection of its own, so no
        // member's answer waits behind another's on one multiplexed connection; the monitor too.
        let mut own = Vec::with_capacity(scenario.members);
        for i in 0..scenario.members {
            let member_conn = RedisConnection::connect(&target, Duration::from_secs(10))
                .await
                .expect("connect a member");
            let member_store = GroupStore::new(
                member_conn,
                stream_keys.clone(),
                group_keys.clone(),
                config.clone(),
            );
            own.push(if scenario.rolling_restart {
                let (process, slot) = (i / MEMBERS_PER_PROCESS, i % MEMBERS_PER_PROCESS);
                Member::static_member(process, slot, member_store)
            } else {
                Member::new(member_id(i), member_store)
            });
        }
        drop(members);
        let convergence_start = Instant::now();
        let (driven, figures) = converge_concurrent(
            own,
            &target,
            &stream_keys,
            &store,
            &config,
            options.converge_limit,
        )
        .await;
        let convergence = convergence_start.elapsed();
        print_concurrent(&figures, &config, scenario.members);
        let converged = figures.converged_after_last_join.is_some() && figures.aborted == 0;
        if !converged {
            println!("  steady window skipped: the group did not converge");
            return Report {
                scenario,
                idle,
                ping,
                renewal,
                steady: None,
                convergence,
                concurrent: Some(figures),
                restart: None,
            };
        }
        members = driven;
        let mut restart = None;
        if scenario.rolling_restart {
            let (restarted, restarts) = rolling_restart(
                members,
                &target,
                &stream_keys,
                &store,
                &config,
                options.hard_restart,
                options.converge_limit,
            )
            .await;
            print_restart(&restarts, &config, scenario.shards);
            let settled = restarts.settled_at.is_some() && restarts.aborted == 0;
            members = restarted;
            restart = Some(restarts);
            if !settled {
                println!("  steady window skipped: the group did not settle after the restarts");
                return Report {
                    scenario,
                    idle,
                    ping,
                    renewal,
                    steady: None,
                    convergence,
                    concurrent: Some(figures),
                    restart,
                };
            }
        }
        let mut report = steady_state(
            scenario,
            options,
            (idle, ping, renewal),
            members,
            &mut store,
            &conn,
            &group_keys,
            (convergence, Some(figures)),
        )
        .await;
        report.restart = restart;
        return report;
    }
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
            concurrent: None,
            restart: None,
        };
    }
    steady_state(
        scenario,
        options,
        (idle, ping, renewal),
        members,
        &mut store,
        &conn,
        &group_keys,
        (convergence, None),
    )
    .await
}

/// 4. Steady state: one interval of warm-up, then the window.
#[allow(clippy::too_many_arguments)]
async fn steady_state(
    scenario: Scenario,
    options: &Options,
    (idle, ping, renewal): (Measured, Measured, Measured),
    members: Vec<Member>,
    store: &mut GroupStore,
    conn: &RedisConnection,
    group_keys: &GroupKeys,
    (convergence, concurrent): (Duration, Option<Concurrent>),
) -> Report {
    let interval = scenario.config().heartbeat_interval;
    let lead = Duration::from_millis(200);
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
        Some(group_keys),
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
    Report {
        scenario,
        idle,
        ping,
        renewal,
        steady: Some(steady),
        convergence,
        concurrent,
        restart: None,
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
            let why = match &r.restart {
                Some(restart) if restart.settled_at.is_none() || restart.aborted > 0 => {
                    "the rolling restart did not settle".to_owned()
                }
                _ => format!("did not converge in {:.0?}", r.convergence),
            };
            println!(
                "| {} ({} members x {} shards) | {why}: not measured |",
                r.scenario.name, r.scenario.members, r.scenario.shards
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
    if reports.iter().any(|r| r.concurrent.is_some()) {
        println!(
            "\nconcurrent convergence (every member in its own task on its own schedule; the \
             cumulative figures run from the first join to the stop):"
        );
        println!(
            "| scenario | lease TTL | converged after the last join | full transitions | \
             fast path | CAS conflicts | RETRY | UNKNOWN_MEMBER_ID (to members on time) | \
             FENCED_MEMBER_EPOCH | longest heartbeat gap | full transition p50 / p99 / max | \
             Redis CPU (% of a core) | Redis CPU per full transition | EVALSHA per full \
             transition | bench CPU (cores) |"
        );
        println!(
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- \
             | --- |"
        );
    }
    for r in reports {
        let Some(c) = &r.concurrent else {
            continue;
        };
        let evalsha_usec = c
            .commands
            .iter()
            .find(|(name, _, _)| name == "evalsha")
            .map_or(0, |(_, _, usec)| *usec);
        let full = c.full.max(1) as f64;
        println!(
            "| {} ({} members x {} shards) | {:?} | {} | {} | {} | {} | {} | {} ({}) | {} | \
             {:.1?} | {} / {} / {} | {:.1}% | {:.2} ms | {:.2} ms | {:.2} |",
            r.scenario.name,
            r.scenario.members,
            r.scenario.shards,
            r.scenario.config().member_lease_ttl,
            c.converged_after_last_join.map_or_else(
                || format!("did not converge within {:?}", c.limit),
                |d| format!("{d:.1?}")
            ),
            c.full,
            c.fast,
            c.conflicts,
            c.retries,
            c.unknown,
            c.unknown_on_time,
            c.fenced,
            c.max_gap,
            ms(c.full_latency.percentile(50.0)),
            ms(c.full_latency.percentile(99.0)),
            ms(c.full_latency.max()),
            c.redis_cpu * 100.0,
            c.redis_cpu * c.wall.as_secs_f64() * 1e3 / full,
            evalsha_usec as f64 / 1e3 / full,
            c.bench_cpu,
        );
    }
    summary_restarts(reports);
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

/// The rolling restarts' table (scenario f).
fn summary_restarts(reports: &[Report]) {
    if reports.iter().all(|r| r.restart.is_none()) {
        return;
    }
    println!(
        "\nrolling restart (static members, {MEMBERS_PER_PROCESS} a process, one process every \
         {RESTART_EVERY:?}; wait: from the old process's stop to the answer that assigns the new \
         one all its old shards):"
    );
    println!(
        "| scenario | restart | settled after the last restart | shards moved (before vs after; \
         during) | wait p50 / p99 / max | restored (over lease + 2 heartbeats) | full transitions \
         | fast path | CAS conflicts | RETRY | UNKNOWN_MEMBER_ID | FENCED_* | Redis CPU (% of a \
         core) | bench CPU (cores) | at the end | goals met? |"
    );
    println!(
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- \
         | --- |"
    );
    for r in reports {
        let Some(f) = &r.restart else {
            continue;
        };
        let config = r.scenario.config();
        let goal = Restarts::wait_goal(&config);
        let waits = f.sorted_waits();
        println!(
            "| {} ({} processes, {} members x {} shards) | {} | {} | {}; {} | {:.2?} / {:.2?} / \
             {:.2?} | {} of {} ({}) | {} | {} ({:.1}%) | {} | {} | {} | {} | {:.1}% | {:.2} | {} \
             with {} members | no move {}, read within {goal:?} {}, STABLE {} |",
            r.scenario.name,
            f.processes,
            f.members,
            r.scenario.shards,
            if f.hard { "hard" } else { "graceful" },
            f.settled_at.map_or_else(
                || "did not settle".to_owned(),
                |at| format!("{:.1?}", at.saturating_sub(f.last_restart))
            ),
            f.moved_overall
                .map_or_else(|| "?".into(), |m| m.to_string()),
            f.moved_during,
            percentile_of(&waits, 50.0),
            percentile_of(&waits, 99.0),
            waits.last().copied().unwrap_or_default(),
            waits.len(),
            f.members,
            waits.iter().filter(|w| **w > goal).count(),
            f.full,
            f.fast,
            100.0 * f.fast as f64 / (f.full + f.fast).max(1) as f64,
            f.conflicts,
            f.retries,
            f.unknown,
            f.fenced + f.fenced_instance,
            f.redis_cpu * 100.0,
            f.bench_cpu,
            f.end_state.map_or_else(|| "?".into(), |s| format!("{s:?}")),
            f.end_members,
            yes_no(f.no_shard_moved()),
            yes_no(f.every_shard_read_in_time(&config)),
            yes_no(f.stable_at_end()),
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

/// Runs `watch` on a thread, runtime and connection of its own, with a store of the group, so
/// that the members' work does not starve it. Returns the thread and what `watch` comes to.
fn spawn_monitor<T, F, Fut>(
    target: RedisTarget,
    (stream_keys, group_keys, config): (StreamKeys, GroupKeys, CoordinatorConfig),
    watch: F,
) -> (
    std::thread::JoinHandle<()>,
    tokio::sync::oneshot::Receiver<T>,
)
where
    T: Send + 'static,
    F: FnOnce(RedisConnection, GroupStore) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = T>,
{
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    let thread = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("monitor runtime");
        let figures = runtime.block_on(async move {
            // The monitor's connection, and its store's, are driven by its own runtime.
            let conn = RedisConnection::connect(&target, Duration::from_secs(10))
                .await
                .expect("connect the monitor");
            let store = GroupStore::new(conn.clone(), stream_keys, group_keys, config);
            watch(conn, store).await
        });
        let _ = done_tx.send(figures);
    });
    (thread, done_rx)
}
