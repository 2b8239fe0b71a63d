//! Fault benchmarks with members as real OS processes (items 4, 5 and 6): the
//! `workload` example (release build) as consumer and producer processes on a throwaway
//! `redis-server`, its JSON log lines judged by the fault suite's checker
//! (`stream_listener::testing::workload::check`: no message lost, per-key order in first-time handling, no
//! shard read by two members at once). Results in BENCHMARKS.md, "End to end".
//!
//! ```sh
//! cargo build --release --example workload
//! cargo bench --bench faults -- [failover] [static] [redis-restart]
//! ```
//!
//! Every scenario uses the default protocol timings (heartbeat 3 s, lease 15 s, rebalance timeout
//! 60 s), 12 shards, three consumer processes of `concurrency = 2` (static ones in `static`, two
//! processes in `redis-restart`), and a producer at 400 msg/s over 64 keys.
//! - `failover`: `kill -9` of one consumer process; per shard it owned, the time until another
//!   member reads it (goal: under lease TTL + 2 heartbeat intervals = 21 s); time until the group
//!   is `STABLE` again; messages lost (must be 0).
//! - `static`: the same with `--instance-id`; one process restarted within its lease, first
//!   gracefully (`SIGTERM`: it leaves with `-2`, away), then by `kill -9`: shards moved to other
//!   members (must be 0), and the time until the restarted process reads its shards again.
//! - `redis-restart`: Redis with an append-only file (`appendfsync always`) killed and restarted
//!   mid-run (down 2 s): time until every shard is read again; nothing lost, duplicates against
//!   the entries that can be in flight.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use stream_listener::core::internals::admin;
use stream_listener::core::internals::connection::{RedisConnection, RedisTarget};
use stream_listener::core::internals::coordinator::CoordinatorConfig;
use stream_listener::core::model::GroupState;
use stream_listener::testing::RedisServer;
use stream_listener::testing::workload::{
    self as checker, Expected, LogLine, ProcessLog, Workload, build_example, first_read_since,
    handled_messages, now_us, owned_before, poll_until,
};

const STREAM: &str = "faults";
const GROUP: &str = "g";
const SHARDS: u32 = 12;
const KEYS: u64 = 64;
const RATE: u64 = 400;
const HEARTBEAT_MS: u64 = 3000;
const LEASE_MS: u64 = 15_000;

fn secs(us: u64) -> f64 {
    us as f64 / 1e6
}

/// A `workload consume` process with the benchmarks' settings (`extra` is appended).
fn consumer(bin: &Path, name: &str, url: &str, extra: &[&str]) -> Workload {
    let mut args: Vec<String> = [
        "consume",
        "--stream",
        STREAM,
        "--group",
        GROUP,
        "--concurrency",
        "2",
        "--shards",
        &SHARDS.to_string(),
        "--exit-on-stdin-close",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    args.extend(extra.iter().map(|s| (*s).to_owned()));
    Workload::spawn(bin, name, url, &args)
}

/// A `workload produce` process at `RATE` over `KEYS` keys.
fn producer(bin: &Path, url: &str, count: u64) -> Workload {
    let args: Vec<String> = [
        "produce",
        "--stream",
        STREAM,
        "--keys",
        &KEYS.to_string(),
        "--count",
        &count.to_string(),
        "--rate",
        &RATE.to_string(),
        "--shards",
        &SHARDS.to_string(),
        "--batch",
        "16",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    Workload::spawn(bin, "producer", url, &args)
}

/// Assignments of `shards` in `[from_us, to_us)` to members other than `except` (a prefix).
fn moved_to_others(
    procs: &[&Workload],
    shards: &BTreeSet<u32>,
    except: &str,
    from_us: u64,
    to_us: u64,
) -> usize {
    procs
        .iter()
        .flat_map(|p| p.lines())
        .filter(|l| {
            matches!(l, LogLine::Assigned(o) if shards.contains(&o.shard)
                && !o.member.starts_with(except)
                && o.ts_us >= from_us && o.ts_us < to_us)
        })
        .count()
}

struct Admin {
    runtime: tokio::runtime::Runtime,
    target: RedisTarget,
}

impl Admin {
    fn new(url: &str) -> Admin {
        Admin {
            runtime: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap(),
            target: RedisTarget::standalone(url.to_owned()),
        }
    }

    fn conn(&self) -> Option<RedisConnection> {
        self.runtime
            .block_on(RedisConnection::connect(
                &self.target,
                Duration::from_secs(5),
            ))
            .ok()
    }

    fn create_stream(&self) {
        let mut conn = self.conn().expect("connect");
        self.runtime
            .block_on(admin::create_stream(&mut conn, STREAM, SHARDS))
            .expect("create stream");
    }

    /// `STABLE` with `members` live members, each owning its target and nothing else.
    fn converged(&self, members: usize) -> bool {
        let Some(mut conn) = self.conn() else {
            return false;
        };
        let Ok(d) = self.runtime.block_on(admin::describe_group(
            &mut conn,
            STREAM,
            GROUP,
            &CoordinatorConfig::default(),
        )) else {
            return false;
        };
        let live: Vec<_> = d.members.iter().filter(|m| m.live).collect();
        d.state == GroupState::Stable
            && live.len() == members
            && live
                .iter()
                .all(|m| m.owned == m.target && m.pending.is_empty() && m.revoking.is_empty())
    }

    /// Target owner per shard.
    fn owners(&self) -> BTreeMap<u32, String> {
        let mut conn = self.conn().expect("connect");
        let d = self
            .runtime
            .block_on(admin::describe_group(
                &mut conn,
                STREAM,
                GROUP,
                &CoordinatorConfig::default(),
            ))
            .expect("describe");
        d.shards
            .iter()
            .filter_map(|s| s.target_owner.clone().map(|o| (s.shard_index, o)))
            .collect()
    }
}

/// Waits for the producer and for every message to be handled, shuts the consumers down, runs
/// the checker over every consumer log (the killed ones too).
fn finish(producer: &mut Workload, consumers: &mut [Workload], count: u64) -> checker::Report {
    poll_until(Duration::from_secs(180), || producer.exited());
    poll_until(Duration::from_secs(60), || {
        handled_messages(&consumers.iter().collect::<Vec<_>>()).len() >= count as usize
    });
    for c in consumers.iter_mut() {
        c.stop(Duration::from_secs(40));
    }
    let logs: Vec<ProcessLog> = consumers.iter().map(Workload::log).collect();
    checker::check(&logs, Expected { keys: KEYS, count }, &[])
}

fn report_line(report: &checker::Report, count: u64) -> String {
    format!(
        "produced {count}, handled ok {} (lost {}), duplicate handled lines {}, handler calls {}, reads {}, fence rejections {:?}, checker violations {}{}",
        report.handled_ok,
        count as usize - report.handled_ok.min(count as usize),
        report.duplicates,
        report.handler_calls,
        report.reads,
        report.fence_rejections,
        report.violations.len(),
        if report.violations.is_empty() {
            String::new()
        } else {
            format!(
                " (first: {:?})",
                report.violations.iter().take(3).collect::<Vec<_>>()
            )
        }
    )
}

fn failover(bin: &Path) {
    let server = RedisServer::start().expect("redis-server");
    let url = server.url();
    let admin = Admin::new(&url);
    admin.create_stream();
    let count = RATE * 60;
    let mut consumers: Vec<Workload> = (0..3)
        .map(|i| consumer(bin, &format!("consumer-{i}"), &url, &[]))
        .collect();
    assert!(
        poll_until(Duration::from_secs(60), || admin.converged(6)),
        "group did not settle"
    );
    let mut producer = producer(bin, &url, count);
    std::thread::sleep(Duration::from_secs(10));
    let killed_us = now_us();
    let victim: BTreeSet<u32> = owned_before(&consumers[1].lines(), killed_us)
        .keys()
        .copied()
        .collect();
    let killed = Instant::now();
    consumers[1].kill9();
    let survivors = [&consumers[0], &consumers[2]];
    let mut takeover = BTreeMap::new();
    for &shard in &victim {
        poll_until(Duration::from_secs(60), || {
            first_read_since(&survivors, shard, killed_us + 1).is_some()
        });
        if let Some((at, _)) = first_read_since(&survivors, shard, killed_us + 1) {
            takeover.insert(shard, secs(at - killed_us));
        }
    }
    poll_until(Duration::from_secs(60), || admin.converged(4));
    let stable = killed.elapsed().as_secs_f64();
    let report = finish(&mut producer, &mut consumers, count);
    let slowest = takeover.values().copied().fold(0.0, f64::max);
    let goal = secs((LEASE_MS + 2 * HEARTBEAT_MS) * 1000);
    println!(
        "\n[failover] kill -9 of one of 3 consumer processes (2 members each), 12 shards, {RATE} msg/s, heartbeat 3 s, lease 15 s"
    );
    println!(
        "| shards of the killed process | read again after (s), per shard | slowest | goal (lease + 2 heartbeats) | met? | STABLE again after | messages lost |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    println!(
        "| {} | {} | {slowest:.2} s | < {goal:.0} s | {} | {stable:.1} s | {} |",
        victim.len(),
        takeover
            .iter()
            .map(|(s, t)| format!("{s}: {t:.2}"))
            .collect::<Vec<_>>()
            .join(", "),
        if slowest < goal && takeover.len() == victim.len() {
            "yes"
        } else {
            "no"
        },
        count as usize - report.handled_ok.min(count as usize)
    );
    println!("[failover] {}", report_line(&report, count));
}

fn static_membership(bin: &Path) {
    let server = RedisServer::start().expect("redis-server");
    let url = server.url();
    let admin = Admin::new(&url);
    admin.create_stream();
    let count = RATE * 100;
    let mut consumers: Vec<Workload> = ["pod-a", "pod-b", "pod-c"]
        .iter()
        .map(|id| consumer(bin, id, &url, &["--instance-id", id]))
        .collect();
    assert!(
        poll_until(Duration::from_secs(60), || admin.converged(6)),
        "group did not settle"
    );
    let mut producer = producer(bin, &url, count);
    std::thread::sleep(Duration::from_secs(8));
    let mut rows = Vec::new();
    for (how, graceful) in [
        ("SIGTERM (leave -2), restart", true),
        ("kill -9, restart", false),
    ] {
        let owners_before = admin.owners();
        let stopped_us = now_us();
        let pod_b: BTreeSet<u32> = owned_before(&consumers[1].lines(), stopped_us)
            .keys()
            .copied()
            .collect();
        let stopped = Instant::now();
        if graceful {
            consumers[1].stop(Duration::from_secs(40));
        } else {
            consumers[1].kill9();
        }
        let down = stopped.elapsed().as_secs_f64();
        let restarted_us = now_us();
        let restarted = consumer(bin, "pod-b", &url, &["--instance-id", "pod-b"]);
        // The old process's log is kept (for the checker) as an extra entry.
        let old = std::mem::replace(&mut consumers[1], restarted);
        consumers.push(old);
        let mut back = BTreeMap::new();
        for &shard in &pod_b {
            poll_until(Duration::from_secs(60), || {
                first_read_since(&[&consumers[1]], shard, restarted_us + 1).is_some()
            });
            if let Some((at, _)) = first_read_since(&[&consumers[1]], shard, restarted_us + 1) {
                back.insert(shard, secs(at - restarted_us));
            }
        }
        // When the restarted process was first assigned one of its shards.
        let assigned = consumers[1]
            .lines()
            .iter()
            .filter_map(|l| match l {
                LogLine::Assigned(o) if pod_b.contains(&o.shard) => Some(o.ts_us),
                _ => None,
            })
            .min()
            .map_or(f64::NAN, |t| secs(t.saturating_sub(restarted_us)));
        poll_until(Duration::from_secs(60), || admin.converged(6));
        let stable = stopped.elapsed().as_secs_f64();
        std::thread::sleep(Duration::from_secs(2));
        let owners_after = admin.owners();
        let target_moved = owners_before
            .iter()
            .filter(|(s, o)| owners_after.get(s) != Some(o))
            .count();
        let procs: Vec<&Workload> = consumers.iter().collect();
        let moved = moved_to_others(&procs, &pod_b, "pod-b-", stopped_us, now_us());
        rows.push((
            how,
            pod_b.len(),
            down,
            moved,
            target_moved,
            assigned,
            back.values().copied().fold(0.0, f64::max),
            stable,
        ));
        std::thread::sleep(Duration::from_secs(5));
    }
    let report = finish(&mut producer, &mut consumers, count);
    println!(
        "\n[static] static members pod-a/b/c (2 members each), 12 shards, {RATE} msg/s, heartbeat 3 s, lease 15 s; pod-b restarted within its lease"
    );
    println!(
        "| restart | pod-b's shards | process down for | shards assigned to other members meanwhile | target owners changed (describe, before vs after) | restarted pod-b first assigned one of them after (from restart) | pod-b reads all its shards again after (from restart) | STABLE with 6 members after (from stop) |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    for (how, n, down, moved, target_moved, assigned, back, stable) in rows {
        println!(
            "| {how} | {n} | {down:.2} s | {moved} | {target_moved} | {assigned:.2} s | {back:.2} s | {stable:.1} s |"
        );
    }
    println!("[static] {}", report_line(&report, count));
}

fn redis_restart(bin: &Path) {
    let mut server = RedisServer::builder().aof(true).start().expect("redis");
    let url = server.url();
    let admin = Admin::new(&url);
    admin.create_stream();
    let count = RATE * 50;
    let mut consumers: Vec<Workload> = (0..2)
        .map(|i| consumer(bin, &format!("consumer-{i}"), &url, &[]))
        .collect();
    assert!(
        poll_until(Duration::from_secs(60), || admin.converged(4)),
        "group did not settle"
    );
    let mut producer = producer(bin, &url, count);
    std::thread::sleep(Duration::from_secs(10));
    let owners_before = admin.owners();
    let killed_us = now_us();
    server.kill().unwrap();
    std::thread::sleep(Duration::from_secs(2));
    server.restart().unwrap();
    let restarted_us = now_us();
    let restarted = Instant::now();
    let all: Vec<&Workload> = consumers.iter().collect();
    let mut back = BTreeMap::new();
    for shard in 0..SHARDS {
        poll_until(Duration::from_secs(90), || {
            first_read_since(&all, shard, restarted_us + 1).is_some()
        });
        if let Some((at, _)) = first_read_since(&all, shard, restarted_us + 1) {
            back.insert(shard, secs(at - restarted_us));
        }
    }
    poll_until(Duration::from_secs(90), || admin.converged(4));
    let stable = restarted.elapsed().as_secs_f64();
    let owners_after = admin.owners();
    let report = finish(&mut producer, &mut consumers, count);
    let slowest = back.values().copied().fold(0.0, f64::max);
    let fastest = back.values().copied().fold(f64::MAX, f64::min);
    println!(
        "\n[redis-restart] Redis (AOF, appendfsync always) killed and restarted mid-run, down {:.1} s; 2 consumer processes (2 members each), 12 shards, {RATE} msg/s, heartbeat 3 s, lease 15 s",
        secs(restarted_us - killed_us)
    );
    println!(
        "| shards read again | first / last shard read again after restart | STABLE after restart | owners changed | messages lost | duplicate handled lines | entries that can be in flight (4 members x 3 shards x batch 32) |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    println!(
        "| {} of {SHARDS} | {fastest:.2} s / {slowest:.2} s | {stable:.1} s | {} | {} | {} | {} |",
        back.len(),
        owners_before
            .iter()
            .filter(|(s, o)| owners_after.get(s) != Some(o))
            .count(),
        count as usize - report.handled_ok.min(count as usize),
        report.duplicates,
        4 * 3 * 32
    );
    println!("[redis-restart] {}", report_line(&report, count));
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let parts: Vec<&str> = if args.is_empty() {
        vec!["failover", "static", "redis-restart"]
    } else {
        args.iter().map(String::as_str).collect()
    };
    // `target/release/examples/workload`, built by cargo (a no-op when it is up to date).
    let bin = PathBuf::from(build_example(
        env!("CARGO"),
        env!("CARGO_MANIFEST_DIR"),
        &["--release"],
        "workload",
    ));
    println!("workload: {}", bin.display());
    for part in parts {
        let started = Instant::now();
        match part {
            "failover" => failover(&bin),
            "static" => static_membership(&bin),
            "redis-restart" => redis_restart(&bin),
            other => eprintln!("unknown part {other}: failover, static, redis-restart"),
        }
        println!("[{part}] took {:.0} s", started.elapsed().as_secs_f64());
    }
}
