//! Benchmarks of the pure coordinator: the sticky assignor and one heartbeat transition,
//! at 10,000 shards and 1,000 members.
//!
//! Cases (criterion group `coordinator`):
//! - `yardstick`: a fixed workload of similar size, the baseline every figure is divided by (the
//!   machine is shared and noisy): build a `BTreeMap<u32, String>` of 10,000 entries
//!   (shard → `member-0042`-style id) and clone it. Measured first and again last.
//! - `assign_from_scratch`, `assign_scale_out`, `assign_unchanged`: [`assign`] for 10,000 shards
//!   and 1,000 members with an empty previous target, with the target of 999 members, and with its
//!   own output. Goal: under 10 ms each.
//! - `heartbeat_steady_one`: one steady-state heartbeat (same epoch, same report) of one member of
//!   a stable 1,000-member, 10,000-shard group; the group is cloned outside the timed part.
//!   `heartbeat_steady_rotating`: the same, as a sequence of heartbeats of different members on
//!   one group, `now` advancing by 1 µs each. Goal: under 1 ms.
//! - `heartbeat_join_1001st`: a 1,001st member joins the stable group (a new target by the
//!   assignor). No goal.
//! - `heartbeat_rejoin_new_process`: a member of the stable group joins again from a new process,
//!   as a static member does in a rolling restart: the group epoch moves, the live set and so the
//!   target do not (the assignor is skipped, `keeps_previous`). No goal; compare with the join.
//!
//! Run with `cargo bench -p stream-listener-core --bench coordinator`. After the criterion output a
//! summary prints each median, its ratio to the yardstick and the goal (BENCHMARKS.md).

use std::collections::{BTreeMap, BTreeSet};
use std::hint::black_box;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use criterion::{BatchSize, Bencher, Criterion};
use stream_listener_core::internals::assignor::{AssignorMember, Target, assign};
use stream_listener_core::internals::coordinator::{
    Context, CoordinatorConfig, Group, StreamView, heartbeat,
};
use stream_listener_core::model::{
    Epoch, GroupState, HeartbeatRequest, HeartbeatResponse, HeartbeatStatus, Micros,
    PROTOCOL_VERSION, ShardIndex,
};

const SHARDS: u32 = 10_000;
const MEMBERS: usize = 1_000;
/// A realistic Redis `TIME` in µs (2025).
const START: Micros = 1_750_000_000_000_000;
/// Time between two requests while the group is built: 2 ms, so a round of 1,000 heartbeats takes
/// 2 s, well within the 15 s default lease.
const STEP: Micros = 2_000;

const GROUP: &str = "coordinator";
const YARDSTICK: &str = "yardstick";
const YARDSTICK_AGAIN: &str = "yardstick_again";

fn member_id(i: usize) -> String {
    format!("member-{i:04}")
}

fn assignor_members(n: usize) -> Vec<AssignorMember> {
    (0..n)
        .map(|i| AssignorMember {
            member_id: member_id(i),
            weight: 1,
        })
        .collect()
}

fn readable() -> BTreeSet<ShardIndex> {
    (0..SHARDS).collect()
}

/// The yardstick: 10,000 entries shard → `member-0042`, built and cloned.
fn yardstick() -> (BTreeMap<u32, String>, BTreeMap<u32, String>) {
    let map: BTreeMap<u32, String> = (0..SHARDS)
        .map(|shard| (shard, format!("member-{:04}", shard % 1_000)))
        .collect();
    let copy = map.clone();
    (map, copy)
}

// ---- a stable group built through the public API --------------------------------------------------

/// One simulated member: what it last got and will report.
#[derive(Clone)]
struct SimMember {
    id: String,
    process_id: String,
    seq: u64,
    epoch: Epoch,
    owned: Vec<ShardIndex>,
}

impl SimMember {
    fn new(i: usize) -> Self {
        SimMember {
            id: member_id(i),
            process_id: format!("process-{i:04}"),
            seq: 0,
            epoch: 0,
            owned: Vec::new(),
        }
    }

    /// The next request: a join while the epoch is 0, else a heartbeat reporting `owned`.
    fn next_request(&mut self) -> HeartbeatRequest {
        self.seq += 1;
        HeartbeatRequest {
            member_id: self.id.clone(),
            member_name: "bench".to_owned(),
            instance_id: None,
            process_id: self.process_id.clone(),
            request_seq: self.seq,
            member_epoch: self.epoch,
            metadata_version: 1,
            runtime_max_concurrency: 1,
            active_consumer_workers: 0,
            owned_shards: self.owned.clone(),
            revoking_shards: Vec::new(),
            fence_conflicts: Vec::new(),
            protocol_version: PROTOCOL_VERSION,
        }
    }
}

struct Sim {
    group: Group,
    stream: StreamView,
    config: CoordinatorConfig,
    now: Micros,
    members: Vec<SimMember>,
}

impl Sim {
    /// The group after `request` on a clone of the stable group, and the response (a group
    /// response, not a retry).
    fn answer(&self, request: &HeartbeatRequest, ctx: &Context<'_>) -> (Group, HeartbeatResponse) {
        let mut group = self.group.clone();
        let response = heartbeat(&mut group, request, ctx, &self.config)
            .expect("heartbeat")
            .response()
            .unwrap();
        (group, response)
    }

    /// Measures `request` on a fresh clone of the stable group each time (the clone not timed).
    fn bench_one(&self, b: &mut Bencher<'_>, request: &HeartbeatRequest, ctx: &Context<'_>) {
        b.iter_batched(
            || self.group.clone(),
            |mut g| {
                let response = heartbeat(&mut g, black_box(request), ctx, &self.config);
                (g, response)
            },
            BatchSize::LargeInput,
        );
    }

    /// Sends the next request of member `i` at `now + STEP` and adopts the response.
    fn step(&mut self, i: usize) {
        self.now += STEP;
        let request = self.members[i].next_request();
        let ctx = Context {
            now: self.now,
            stream: &self.stream,
        };
        let response = heartbeat(&mut self.group, &request, &ctx, &self.config)
            .unwrap_or_else(|e| panic!("heartbeat of {}: {e}", request.member_id))
            .response()
            .expect("no lost-metadata evidence");
        assert_eq!(
            response.status,
            HeartbeatStatus::Ok,
            "heartbeat of {}",
            request.member_id
        );
        let member = &mut self.members[i];
        member.epoch = response.member_epoch;
        member.owned = response.assigned_shards;
    }

    /// 1,000 joins, then rounds of heartbeats of every member until the group is stable.
    fn stable_group() -> Sim {
        let stream = StreamView {
            metadata_version: 1,
            shard_count: SHARDS,
            readable: readable(),
            shard_index_bound: SHARDS,
        };
        let mut sim = Sim {
            group: Group::new("orders", "g", &stream, START),
            stream,
            config: CoordinatorConfig::default(),
            now: START,
            members: (0..MEMBERS).map(SimMember::new).collect(),
        };
        for i in 0..MEMBERS {
            sim.step(i);
        }
        let mut rounds = 0;
        while sim.group.meta.state != GroupState::Stable {
            rounds += 1;
            assert!(rounds <= 20, "the group did not become stable");
            for i in 0..MEMBERS {
                sim.step(i);
            }
        }
        assert_eq!(sim.group.members.len(), MEMBERS);
        assert!(sim.members.iter().all(|m| m.owned.len() == 10));
        eprintln!(
            "stable group of {MEMBERS} members and {SHARDS} shards after {rounds} rounds of heartbeats"
        );
        sim
    }
}

// ---- the benchmarks ----------------------------------------------------------------------------

fn bench_yardstick(c: &mut Criterion, name: &str) {
    let mut group = c.benchmark_group(GROUP);
    group.sample_size(50);
    group.bench_function(name, |b| b.iter(yardstick));
    group.finish();
}

fn bench_assignor(c: &mut Criterion) {
    let readable = readable();
    let members = assignor_members(MEMBERS);
    let empty = Target::new();
    let previous_999 = assign(&readable, &assignor_members(MEMBERS - 1), &empty);
    let own_output = assign(&readable, &members, &empty);
    assert_eq!(assign(&readable, &members, &own_output), own_output);

    let mut group = c.benchmark_group(GROUP);
    group.sample_size(50);
    for (name, previous) in [
        ("assign_from_scratch", &empty),
        ("assign_scale_out", &previous_999),
        ("assign_unchanged", &own_output),
    ] {
        group.bench_function(name, |b| {
            b.iter(|| {
                assign(
                    black_box(&readable),
                    black_box(&members),
                    black_box(previous),
                )
            });
        });
    }
    group.finish();
}

fn bench_heartbeat(c: &mut Criterion) {
    let sim = Sim::stable_group();
    let mut group = c.benchmark_group(GROUP);
    group.sample_size(30);

    // (a) One steady heartbeat of one member, on a fresh clone of the stable group each time.
    let mut steady = sim.members[MEMBERS / 2].clone();
    let request = steady.next_request();
    let now = sim.now + 1_000;
    let ctx = Context {
        now,
        stream: &sim.stream,
    };
    {
        let (check, response) = sim.answer(&request, &ctx);
        assert_eq!(response.status, HeartbeatStatus::Ok);
        assert_eq!(response.member_epoch, steady.epoch);
        assert_eq!(response.assigned_shards, steady.owned);
        assert_eq!(check.meta.state, GroupState::Stable);
        assert_eq!(check.meta.group_epoch, sim.group.meta.group_epoch);
    }
    group.bench_function("heartbeat_steady_one", |b| sim.bench_one(b, &request, &ctx));

    // (a') A sequence of steady heartbeats of different members on one group, 1 µs apart.
    group.bench_function("heartbeat_steady_rotating", |b| {
        let mut g = sim.group.clone();
        let mut requests: Vec<HeartbeatRequest> = sim
            .members
            .iter()
            .map(|m| m.clone().next_request())
            .collect();
        let mut now = sim.now;
        let mut next = 0;
        b.iter(|| {
            now += 1;
            let request = &mut requests[next];
            next = (next + 1) % MEMBERS;
            let ctx = Context {
                now,
                stream: &sim.stream,
            };
            let response = heartbeat(&mut g, request, &ctx, &sim.config);
            request.request_seq += 1;
            response
        });
        assert_eq!(g.meta.state, GroupState::Stable);
        assert_eq!(g.meta.group_epoch, sim.group.meta.group_epoch);
    });

    // (b) A 1,001st member joins: a new target by the assignor.
    let mut joiner = SimMember::new(MEMBERS);
    let join = joiner.next_request();
    {
        let (check, response) = sim.answer(&join, &ctx);
        assert_eq!(response.status, HeartbeatStatus::Ok);
        assert_eq!(check.meta.assignment_epoch, sim.group.meta.group_epoch + 1);
        assert_eq!(check.target_of(&joiner.id).len(), 9);
    }
    group.bench_function("heartbeat_join_1001st", |b| sim.bench_one(b, &join, &ctx));

    // (c) A member joins again from a new process: same live set, same target.
    let mut restarted = sim.members[MEMBERS / 3].clone();
    restarted.process_id = "process-restarted".to_owned();
    restarted.epoch = 0;
    let old_shards = std::mem::take(&mut restarted.owned);
    let rejoin = restarted.next_request();
    {
        let (check, response) = sim.answer(&rejoin, &ctx);
        assert_eq!(response.status, HeartbeatStatus::Ok);
        assert_eq!(check.meta.assignment_epoch, sim.group.meta.group_epoch + 1);
        assert_eq!(
            check.meta.target_assignment.members,
            sim.group.meta.target_assignment.members
        );
        assert_eq!(
            response.pending_shards, old_shards,
            "the old process's lease blocks them"
        );
    }
    group.bench_function("heartbeat_rejoin_new_process", |b| {
        sim.bench_one(b, &rejoin, &ctx)
    });
    group.finish();
}

// ---- the summary: medians as ratios to the yardstick -----------------------------------------------

/// Case, goal in ms (if any).
const CASES: [(&str, Option<f64>); 9] = [
    (YARDSTICK, None),
    ("assign_from_scratch", Some(10.0)),
    ("assign_scale_out", Some(10.0)),
    ("assign_unchanged", Some(10.0)),
    ("heartbeat_steady_one", Some(1.0)),
    ("heartbeat_steady_rotating", Some(1.0)),
    ("heartbeat_join_1001st", None),
    ("heartbeat_rejoin_new_process", None),
    (YARDSTICK_AGAIN, None),
];

/// Where criterion writes its estimates, found as criterion finds it.
fn criterion_home() -> PathBuf {
    if let Some(home) = std::env::var_os("CRITERION_HOME") {
        return PathBuf::from(home);
    }
    if let Some(target) = std::env::var_os("CARGO_TARGET_DIR") {
        return PathBuf::from(target).join("criterion");
    }
    let metadata = std::env::var_os("CARGO").and_then(|cargo| {
        std::process::Command::new(cargo)
            .args(["metadata", "--format-version", "1", "--no-deps"])
            .output()
            .ok()
    });
    let target = metadata
        .and_then(|out| serde_json::from_slice::<serde_json::Value>(&out.stdout).ok())
        .and_then(|v| v["target_directory"].as_str().map(PathBuf::from));
    target
        .unwrap_or_else(|| PathBuf::from("target"))
        .join("criterion")
}

/// The median (ns) criterion wrote for `name` in this run (`None` if it was not measured).
fn median_ns(home: &std::path::Path, name: &str, since: SystemTime) -> Option<f64> {
    let path = home.join(GROUP).join(name).join("new/estimates.json");
    let modified = std::fs::metadata(&path).and_then(|m| m.modified()).ok()?;
    if modified < since {
        return None;
    }
    let estimates: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).ok()?).ok()?;
    estimates["median"]["point_estimate"].as_f64()
}

fn print_summary(since: SystemTime) {
    let home = criterion_home();
    let medians: Vec<Option<f64>> = CASES
        .iter()
        .map(|(name, _)| median_ns(&home, name, since))
        .collect();
    let yardsticks: Vec<f64> = [medians[0], medians[CASES.len() - 1]]
        .into_iter()
        .flatten()
        .collect();
    if yardsticks.is_empty() {
        println!("\nsummary: the yardstick was not measured in this run, no ratios");
        return;
    }
    let yardstick = yardsticks.iter().sum::<f64>() / yardsticks.len() as f64;
    println!(
        "\nsummary (medians; yardstick = mean of the two yardstick medians = {yardstick:.0} ns)"
    );
    println!(
        "| case | median | ratio to yardstick | goal | met? |\n| --- | --- | --- | --- | --- |"
    );
    for ((name, goal), median) in CASES.iter().zip(medians) {
        let Some(ns) = median else { continue };
        let goal_text = goal.map_or("—".to_owned(), |ms| format!("< {ms} ms"));
        let met = goal.map_or("—", |ms| if ns < ms * 1e6 { "yes" } else { "no" });
        println!(
            "| {name} | {} | {:.2} | {goal_text} | {met} |",
            human(ns),
            ns / yardstick
        );
    }
}

fn human(ns: f64) -> String {
    if ns >= 1e6 {
        format!("{:.2} ms", ns / 1e6)
    } else {
        format!("{:.1} µs", ns / 1e3)
    }
}

fn main() {
    let started = SystemTime::now() - Duration::from_secs(1);
    let mut c = Criterion::default().without_plots().configure_from_args();
    bench_yardstick(&mut c, YARDSTICK);
    bench_assignor(&mut c);
    bench_heartbeat(&mut c);
    bench_yardstick(&mut c, YARDSTICK_AGAIN);
    c.final_summary();
    let args: Vec<String> = std::env::args().collect();
    let benchmarking = args.iter().any(|a| a == "--bench")
        && !args
            .iter()
            .any(|a| a == "--test" || a == "--list" || a == "--profile-time");
    if benchmarking {
        print_summary(started);
    }
}
