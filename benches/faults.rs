//! Fault benchmarks with members as real OS processes (items 4, 5 and 6): the
//! `workload` example (release build) as consumer and producer processes on a throwaway
//! `redis-server`, its JSON log lines judged by the fault suite's checker
//! (`tests/fault_support/checker.rs`: no message lost, per-key order in first-time handling, no
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

#[path = "../tests/fault_support/checker.rs"]
mod checker;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use checker::{Expected, LogLine, ProcessLog};
use stream_listener::core::admin;
use stream_listener::core::connection::{RedisConnection, RedisTarget};
use stream_listener::core::coordinator::CoordinatorConfig;
use stream_listener::core::model::GroupState;
use stream_listener::testing::RedisServer;

const STREAM: &str = "faults";
const GROUP: &str = "g";
const SHARDS: u32 = 12;
const KEYS: u64 = 64;
const RATE: u64 = 400;
const HEARTBEAT_MS: u64 = 3000;
const LEASE_MS: u64 = 15_000;

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

fn secs(us: u64) -> f64 {
    us as f64 / 1e6
}

/// `target/release/examples/workload`, built by cargo (a no-op when it is up to date).
fn workload_binary() -> String {
    let output = Command::new(env!("CARGO"))
        .args([
            "build",
            "--release",
            "--example",
            "workload",
            "--message-format=json-render-diagnostics",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stderr(Stdio::inherit())
        .output()
        .expect("cargo runs");
    assert!(output.status.success(), "building the workload failed");
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == "workload")
        .find_map(|m| m["executable"].as_str().map(str::to_owned))
        .expect("cargo reports the workload executable")
}

/// A workload process; its stdout lines parsed by a reader thread. Killed when dropped.
struct Proc {
    name: String,
    child: Child,
    _stdin: Option<ChildStdin>,
    lines: Arc<Mutex<Vec<(LogLine, String)>>>,
    raw: Arc<Mutex<Vec<String>>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Proc {
    fn spawn(bin: &str, name: &str, url: &str, args: &[String]) -> Proc {
        let mut child = Command::new(bin)
            .arg("--redis-url")
            .arg(url)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("workload starts");
        let out = child.stdout.take().expect("stdout");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let raw = Arc::new(Mutex::new(Vec::new()));
        let reader = {
            let lines = lines.clone();
            let raw = raw.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(out).lines().map_while(Result::ok) {
                    if let Ok(parsed) = LogLine::parse(&line) {
                        lines.lock().unwrap().push((parsed, line.clone()));
                    }
                    raw.lock().unwrap().push(line);
                }
            })
        };
        Proc {
            name: name.to_owned(),
            _stdin: child.stdin.take(),
            child,
            lines,
            raw,
            reader: Some(reader),
        }
    }

    fn consumer(bin: &str, name: &str, url: &str, extra: &[&str]) -> Proc {
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
        Proc::spawn(bin, name, url, &args)
    }

    fn producer(bin: &str, url: &str, count: u64) -> Proc {
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
        Proc::spawn(bin, "producer", url, &args)
    }

    fn lines(&self) -> Vec<LogLine> {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .map(|(l, _)| l.clone())
            .collect()
    }

    fn log(&self) -> ProcessLog {
        let raw = self.raw.lock().unwrap().join("\n");
        ProcessLog::parse(&self.name, &raw)
    }

    fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }

    fn terminate(&mut self) {
        if self.exited() {
            self.kill9();
            return;
        }
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status();
        let end = Instant::now() + Duration::from_secs(40);
        while Instant::now() < end {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill9();
    }

    fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Shards owned now (after the last line), by member, from a process's assigned/revoked lines.
fn owned(lines: &[LogLine], before_us: u64) -> BTreeMap<u32, String> {
    let mut owned = BTreeMap::new();
    for line in lines {
        match line {
            LogLine::Assigned(o) if o.ts_us < before_us => {
                owned.insert(o.shard, o.member.clone());
            }
            LogLine::Revoked(o)
                if o.ts_us < before_us && owned.get(&o.shard) == Some(&o.member) =>
            {
                owned.remove(&o.shard);
            }
            _ => {}
        }
    }
    owned
}

/// The first `read` of `shard` after `after_us` by any of `procs` (µs, member).
fn first_read(procs: &[&Proc], shard: u32, after_us: u64) -> Option<(u64, String)> {
    procs
        .iter()
        .flat_map(|p| p.lines())
        .filter_map(|l| match l {
            LogLine::Read(r) if r.shard == shard && r.ts_us > after_us => Some((r.ts_us, r.member)),
            _ => None,
        })
        .min()
}

/// Assignments of `shards` in `[from_us, to_us)` to members other than `except` (a prefix).
fn moved_to_others(
    procs: &[&Proc],
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

fn handled_ok(procs: &[&Proc]) -> usize {
    let mut seen = BTreeSet::new();
    for p in procs {
        for l in p.lines() {
            if let LogLine::Handled(h) = l
                && h.ok
                && let (Some(k), Some(s)) = (h.key, h.seq)
            {
                seen.insert((k, s));
            }
        }
    }
    seen.len()
}

fn wait_until(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    done()
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
            target: RedisTarget::Standalone(url.to_owned()),
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
fn finish(producer: &mut Proc, consumers: &mut [Proc], count: u64) -> checker::Report {
    wait_until(Duration::from_secs(180), || producer.exited());
    wait_until(Duration::from_secs(60), || {
        handled_ok(&consumers.iter().collect::<Vec<_>>()) >= count as usize
    });
    for c in consumers.iter_mut() {
        c.terminate();
    }
    let logs: Vec<ProcessLog> = consumers.iter().map(Proc::log).collect();
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

fn failover(bin: &str) {
    let server = RedisServer::start().expect("redis-server");
    let url = server.url();
    let admin = Admin::new(&url);
    admin.create_stream();
    let count = RATE * 60;
    let mut consumers: Vec<Proc> = (0..3)
        .map(|i| Proc::consumer(bin, &format!("consumer-{i}"), &url, &[]))
        .collect();
    assert!(
        wait_until(Duration::from_secs(60), || admin.converged(6)),
        "group did not settle"
    );
    let mut producer = Proc::producer(bin, &url, count);
    std::thread::sleep(Duration::from_secs(10));
    let killed_us = now_us();
    let victim: BTreeSet<u32> = owned(&consumers[1].lines(), killed_us)
        .keys()
        .copied()
        .collect();
    let killed = Instant::now();
    consumers[1].kill9();
    let survivors = [&consumers[0], &consumers[2]];
    let mut takeover = BTreeMap::new();
    for &shard in &victim {
        wait_until(Duration::from_secs(60), || {
            first_read(&survivors, shard, killed_us).is_some()
        });
        if let Some((at, _)) = first_read(&survivors, shard, killed_us) {
            takeover.insert(shard, secs(at - killed_us));
        }
    }
    wait_until(Duration::from_secs(60), || admin.converged(4));
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

fn static_membership(bin: &str) {
    let server = RedisServer::start().expect("redis-server");
    let url = server.url();
    let admin = Admin::new(&url);
    admin.create_stream();
    let count = RATE * 100;
    let mut consumers: Vec<Proc> = ["pod-a", "pod-b", "pod-c"]
        .iter()
        .map(|id| Proc::consumer(bin, id, &url, &["--instance-id", id]))
        .collect();
    assert!(
        wait_until(Duration::from_secs(60), || admin.converged(6)),
        "group did not settle"
    );
    let mut producer = Proc::producer(bin, &url, count);
    std::thread::sleep(Duration::from_secs(8));
    let mut rows = Vec::new();
    for (how, graceful) in [
        ("SIGTERM (leave -2), restart", true),
        ("kill -9, restart", false),
    ] {
        let owners_before = admin.owners();
        let stopped_us = now_us();
        let pod_b: BTreeSet<u32> = owned(&consumers[1].lines(), stopped_us)
            .keys()
            .copied()
            .collect();
        let stopped = Instant::now();
        if graceful {
            consumers[1].terminate();
        } else {
            consumers[1].kill9();
        }
        let down = stopped.elapsed().as_secs_f64();
        let restarted_us = now_us();
        let restarted = Proc::consumer(bin, "pod-b", &url, &["--instance-id", "pod-b"]);
        // The old process's log is kept (for the checker) as an extra entry.
        let old = std::mem::replace(&mut consumers[1], restarted);
        consumers.push(old);
        let mut back = BTreeMap::new();
        for &shard in &pod_b {
            wait_until(Duration::from_secs(60), || {
                first_read(&[&consumers[1]], shard, restarted_us).is_some()
            });
            if let Some((at, _)) = first_read(&[&consumers[1]], shard, restarted_us) {
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
        wait_until(Duration::from_secs(60), || admin.converged(6));
        let stable = stopped.elapsed().as_secs_f64();
        std::thread::sleep(Duration::from_secs(2));
        let owners_after = admin.owners();
        let target_moved = owners_before
            .iter()
            .filter(|(s, o)| owners_after.get(s) != Some(o))
            .count();
        let procs: Vec<&Proc> = consumers.iter().collect();
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

fn redis_restart(bin: &str) {
    let mut server = RedisServer::builder().aof(true).start().expect("redis");
    let url = server.url();
    let admin = Admin::new(&url);
    admin.create_stream();
    let count = RATE * 50;
    let mut consumers: Vec<Proc> = (0..2)
        .map(|i| Proc::consumer(bin, &format!("consumer-{i}"), &url, &[]))
        .collect();
    assert!(
        wait_until(Duration::from_secs(60), || admin.converged(4)),
        "group did not settle"
    );
    let mut producer = Proc::producer(bin, &url, count);
    std::thread::sleep(Duration::from_secs(10));
    let owners_before = admin.owners();
    let killed_us = now_us();
    server.kill().unwrap();
    std::thread::sleep(Duration::from_secs(2));
    server.restart().unwrap();
    let restarted_us = now_us();
    let restarted = Instant::now();
    let all: Vec<&Proc> = consumers.iter().collect();
    let mut back = BTreeMap::new();
    for shard in 0..SHARDS {
        wait_until(Duration::from_secs(90), || {
            first_read(&all, shard, restarted_us).is_some()
        });
        if let Some((at, _)) = first_read(&all, shard, restarted_us) {
            back.insert(shard, secs(at - restarted_us));
        }
    }
    wait_until(Duration::from_secs(90), || admin.converged(4));
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
    let bin = workload_binary();
    println!("workload: {bin}");
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
