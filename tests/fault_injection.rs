//! Fault injection with member processes as real OS processes: `kill -9` and `SIGSTOP`
//! of a member process, `SIGSTOP` of Redis, and a Redis restart from its append-only file, each
//! in the middle of a run of `examples/workload.rs`. Every run is verified by the checker
//! (`stream_listener::testing::workload::check`): no message lost, no shard read by two members at once
//! (judged on `read` events), per-key order in first-time handling; and once every message is
//! handled, nothing stays pending in the consumer group (everything read was acked, including
//! what was taken over).
//!
//! Run with `--nocapture` to see each scenario's figures (takeover and recovery times,
//! duplicates, fence rejections). On a failure the processes' raw logs are saved under the
//! system temp directory (`fault-logs-*`) and the path is printed.
//!
//! Timings: heartbeat 200 ms, lease 1.5 s, rebalance timeout 3 s; a few thousand messages per
//! run. The scenarios run one at a time (each starts Redis and four to five processes); every
//! wait is polled with a deadline.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use stream_listener::testing::RedisServer;
use stream_listener::testing::workload::{
    self as checker, Expected, LogLine, Stop, Workload, first_read_since, now_us,
    poll_until as wait_until,
};
use support::faults::{
    HEARTBEAT_MS, LEASE_MS, SHARDS, consumer, create_stream, diagnose_missing, entry_history,
    handled_ok, missing_messages, owned_now, pending_entries, pending_per_shard, producer,
    save_logs, serial, wait_settled, zombie_log,
};

const KEYS: u64 = 40;
const COUNT: u64 = 3000;
const EXPECTED: Expected = Expected {
    keys: KEYS,
    count: COUNT,
};

fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

fn sleep_ms(ms: u64) {
    std::thread::sleep(Duration::from_millis(ms));
}

fn start_consumers(url: &str, processes: usize, concurrency: u32, extra: &[&str]) -> Vec<Workload> {
    let consumers: Vec<Workload> = (0..processes)
        .map(|i| consumer(&format!("consumer-{i}"), url, concurrency, extra))
        .collect();
    let refs: Vec<&Workload> = consumers.iter().collect();
    wait_settled(&refs, Duration::from_secs(30), Duration::from_millis(800));
    consumers
}

/// Waits for the producer to finish and for every message to be handled (by any consumer,
/// including dead ones), then shuts the live consumers down gracefully. Panics with
/// diagnostics on a timeout.
/// Returns when the shutdown began (µs): ownership changes after it are the shutdown's.
fn finish(
    url: &str,
    producer: &mut Workload,
    consumers: &mut [Workload],
    deadline: Duration,
) -> u64 {
    let started = Instant::now();
    let status = producer.wait_exit(deadline);
    assert!(
        status.is_some_and(|s| s.success()),
        "the producer did not finish within {deadline:?} (status {status:?}); stderr:\n{}",
        producer.stderr_text()
    );
    let produced = producer.raw_lines();
    assert!(
        produced.iter().any(|l| l.contains(r#""event":"produced""#)),
        "the producer printed no summary: {produced:?}"
    );
    let remaining = deadline.saturating_sub(started.elapsed());
    let all = wait_until(remaining.max(Duration::from_secs(10)), || {
        handled_ok(&consumers.iter().collect::<Vec<_>>()) >= COUNT as usize
    });
    if !all {
        let report = checker::check(&logs(consumers), EXPECTED, &[]);
        let missing = missing_messages(&consumers.iter().collect::<Vec<_>>(), EXPECTED);
        let sample: Vec<(String, u64)> = missing.into_iter().take(20).collect();
        let mut procs: Vec<&Workload> = consumers.iter().collect();
        procs.push(producer);
        let saved = save_logs("unfinished", &procs);
        panic!(
            "not every message was handled in time (logs in {saved}): {}\n{:?}\nin Redis: {}\nstderr: {}",
            report.summary(),
            report.violations,
            diagnose_missing(url, &sample),
            consumers
                .iter()
                .map(|c| format!("{}: {}", c.name, c.stderr_text()))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
    // At-least-once also means nothing stays pending: once every message is handled, the
    // running members ack everything, including what they took over.
    let mut pending = Vec::new();
    let drained = wait_until(Duration::from_secs(10), || {
        pending = pending_per_shard(url).unwrap_or_default();
        pending.len() == SHARDS as usize && pending.iter().all(|&n| n == 0)
    });
    if !drained {
        let procs: Vec<&Workload> = consumers.iter().collect();
        let saved = save_logs("pending", &procs);
        let details: Vec<String> = pending_entries(url)
            .into_iter()
            .map(|(shard, id, consumer, deliveries)| {
                format!(
                    "shard {shard} entry {id} pending at {consumer} (delivered {deliveries}x); \
                     logs: {:?}",
                    entry_history(&procs, shard, &id)
                )
            })
            .collect();
        panic!(
            "entries stay pending in the group after every message was handled (per shard: \
             {pending:?}; logs in {saved}): they were read but never acked:\n{}",
            details.join("\n")
        );
    }
    let shutdown_us = now_us();
    for consumer in consumers.iter_mut() {
        if !consumer.exited() {
            consumer.terminate(Duration::from_secs(20));
        }
    }
    shutdown_us
}

/// Asserts the checker found nothing; on a violation the raw logs are saved first.
fn assert_clean(report: &checker::Report, scenario: &str, consumers: &[Workload]) {
    if !report.ok() {
        let saved = save_logs(scenario, &consumers.iter().collect::<Vec<_>>());
        eprintln!("{scenario}: logs saved in {saved}");
    }
    report.assert_ok();
}

fn logs(consumers: &[Workload]) -> Vec<checker::ProcessLog> {
    consumers.iter().map(Workload::log).collect()
}

/// Shards owned by the members of `process` right now, by member.
fn owned_by(process: &Workload) -> BTreeMap<u32, String> {
    owned_now(&process.lines())
}

/// Shards owned by the members of `process` at `at_us`, by member.
fn owned_at(process: &Workload, at_us: u64) -> BTreeMap<u32, String> {
    let lines: Vec<LogLine> = process
        .lines()
        .into_iter()
        .filter(|l| l.ts_us() < at_us)
        .collect();
    owned_now(&lines)
}

/// Assignments logged in `[from_us, to_us)` by `consumers`.
fn assignments_between(consumers: &[Workload], from_us: u64, to_us: u64) -> usize {
    consumers
        .iter()
        .flat_map(Workload::lines)
        .filter(|l| matches!(l, LogLine::Assigned(o) if o.ts_us >= from_us && o.ts_us < to_us))
        .count()
}

#[test]
fn workload_log_lines_have_the_fixed_fields() {
    let _serial = serial();
    let server = RedisServer::start().unwrap();
    let url = server.url();
    create_stream(&url);
    let mut consumers = start_consumers(&url, 1, 1, &["--fail-every", "3"]);
    let mut producer = producer(&url, 3, 30, 1000);
    let status = producer.wait_exit(Duration::from_secs(30));
    assert!(
        status.is_some_and(|s| s.success()),
        "{}",
        producer.stderr_text()
    );
    assert!(wait_until(Duration::from_secs(20), || handled_ok(&[
        &consumers[0]
    ]) == 30));
    consumers[0].terminate(Duration::from_secs(20));

    let fields = |line: &str| -> (String, BTreeSet<String>) {
        let value: serde_json::Value = serde_json::from_str(line).unwrap();
        let object = value.as_object().unwrap();
        (
            object["event"].as_str().unwrap().to_owned(),
            object.keys().cloned().collect(),
        )
    };
    let set = |names: &[&str]| -> BTreeSet<String> { names.iter().map(|s| (*s).into()).collect() };
    let (event, keys) = fields(&producer.raw_lines()[0]);
    assert_eq!(event, "produced");
    assert_eq!(
        keys,
        set(&["event", "stream", "keys", "count", "retries", "elapsedUs"])
    );
    let mut kinds = BTreeSet::new();
    for line in consumers[0].raw_lines() {
        let (event, keys) = fields(&line);
        let expected = match event.as_str() {
            "handled" => set(&[
                "event",
                "member",
                "shard",
                "entryId",
                "key",
                "seq",
                "attempt",
                "memberEpoch",
                "startUs",
                "endUs",
                "ok",
            ]),
            "assigned" | "revoked" => set(&["event", "member", "shard", "memberEpoch", "tsUs"]),
            "read" => set(&["event", "member", "shard", "count", "firstId", "tsUs"]),
            "fenceRejected" => set(&["event", "op", "member", "shard", "tsUs"]),
            other => panic!("unknown event {other:?} in {line}"),
        };
        assert_eq!(keys, expected, "{line}");
        kinds.insert(event);
    }
    assert!(kinds.contains("handled") && kinds.contains("assigned") && kinds.contains("read"));
    // --fail-every 3: every third entry fails once and succeeds on attempt 2.
    let handled: Vec<checker::Handled> = consumers[0]
        .lines()
        .into_iter()
        .filter_map(|l| match l {
            LogLine::Handled(h) => Some(h),
            _ => None,
        })
        .collect();
    let failed: Vec<&checker::Handled> = handled.iter().filter(|h| !h.ok).collect();
    assert_eq!(failed.len(), 10, "{failed:?}");
    for f in failed {
        assert_eq!(f.call.attempt, 1);
        assert!(
            handled.iter().any(|h| h.call.entry_id == f.call.entry_id
                && h.call.shard == f.call.shard
                && h.ok
                && h.call.attempt == 2),
            "no successful retry of {f:?}"
        );
    }
    let report = checker::check(&logs(&consumers), Expected { keys: 3, count: 30 }, &[]);
    eprintln!("{}", report.summary());
    assert_clean(&report, "contract", &consumers);
}

/// `kill -9` of a member process mid-run: its shards are read again by the other members within
/// about a lease, and nothing is lost.
#[test]
fn kill_9_of_a_member_process_loses_nothing() {
    kill_9_scenario("strict");
}

/// The same in `fencing = "acks"` (plain reads, acks piggybacked on them): a killed process reads
/// nothing more, so here too no shard has two readers, and nothing is lost.
#[test]
fn kill_9_of_a_member_process_loses_nothing_in_acks_mode() {
    kill_9_scenario("acks");
}

fn kill_9_scenario(fencing: &str) {
    kill_9_run(
        fencing,
        &[
            "--handler-ms",
            "2",
            "--fail-every",
            "97",
            "--fencing",
            fencing,
        ],
        true,
    );
}

/// `kill -9` under load with `ordering = "key"` (docs/design.md §14.3): a 20 ms handler, up to 8
/// calls per shard at once (the 40 keys give each shard about 5), retries from `--fail-every`.
/// At 20 ms a call, one call at a time would fall behind the producer (125/s per shard).
/// The checker judges per-key order of first-time handling too: a takeover re-reads the killed
/// member's unacked entries, in entry order, before any later entry of their keys.
#[test]
fn kill_9_of_a_member_process_in_key_ordering_loses_nothing_and_keeps_key_order() {
    kill_9_run(
        "key-ordering",
        &[
            "--handler-ms",
            "20",
            "--fail-every",
            "97",
            "--ordering",
            "key",
            "--max-in-flight",
            "8",
        ],
        true,
    );
}

/// As the key-ordering case with `ordering = "none"`: no loss and one reader per shard; per-key
/// order is not promised, so not judged.
#[test]
fn kill_9_of_a_member_process_in_no_ordering_loses_nothing() {
    kill_9_run(
        "no-ordering",
        &[
            "--handler-ms",
            "20",
            "--fail-every",
            "97",
            "--ordering",
            "none",
            "--max-in-flight",
            "8",
        ],
        false,
    );
}

/// Three consumer processes (two members each) with `consumer_args`, a producer at 1000/s, a
/// `kill -9` of one process after 1 s; then every message handled, nothing pending, and the
/// checker's verdict (per-key order judged when `key_order`).
fn kill_9_run(label: &str, consumer_args: &[&str], key_order: bool) {
    let fencing = label;
    let _serial = serial();
    let server = RedisServer::start().unwrap();
    let url = server.url();
    create_stream(&url);
    let mut consumers = start_consumers(&url, 3, 2, consumer_args);
    let mut producer = producer(&url, KEYS, COUNT, 1000);
    sleep_ms(1000);

    let victim_shards: BTreeSet<u32> = owned_by(&consumers[1]).keys().copied().collect();
    assert!(!victim_shards.is_empty());
    let killed_us = now_us();
    consumers[1].kill9();

    let survivors = [&consumers[0], &consumers[2]];
    let mut takeover_ms = BTreeMap::new();
    for &shard in &victim_shards {
        let read = wait_until(Duration::from_secs(20), || {
            first_read_since(&survivors, shard, killed_us).is_some()
        });
        assert!(
            read,
            "shard {shard} of the killed process was never read again"
        );
        let (at, _) = first_read_since(&survivors, shard, killed_us).unwrap();
        takeover_ms.insert(shard, ms(at - killed_us));
    }
    finish(&url, &mut producer, &mut consumers, Duration::from_secs(60));

    let report = if key_order {
        checker::check(&logs(&consumers), EXPECTED, &[])
    } else {
        checker::check_without_key_order(&logs(&consumers), EXPECTED, &[])
    };
    eprintln!(
        "kill -9 ({fencing}): {}; shards {victim_shards:?} read again after (ms) {takeover_ms:?} (goal: lease + 2 heartbeats = {} ms)",
        report.summary(),
        LEASE_MS + 2 * HEARTBEAT_MS
    );
    assert_clean(&report, &format!("kill9-{fencing}"), &consumers);
    let slowest = takeover_ms.values().copied().fold(0.0, f64::max);
    assert!(
        slowest < 8_000.0,
        "a shard of the killed process waited {slowest} ms to be read again: {takeover_ms:?}"
    );
}

/// `SIGSTOP` of a member process for longer than the lease, then `SIGCONT`: the others take its
/// shards while it is stopped; once continued, the zombie never reads (nor starts a handler on) a
/// shard it lost until it is assigned that shard again, and no shard is read by two members at
/// once.
#[test]
fn sigstop_of_a_member_process_past_its_lease_leaves_a_zombie_that_does_not_read() {
    let _serial = serial();
    let server = RedisServer::start().unwrap();
    let url = server.url();
    create_stream(&url);
    let mut consumers = start_consumers(&url, 3, 2, &["--handler-ms", "5"]);
    let mut producer = producer(&url, KEYS, COUNT, 600);
    sleep_ms(1000);

    let victim_owned = owned_by(&consumers[0]);
    assert!(!victim_owned.is_empty());
    let stopped_us = now_us();
    consumers[0].signal("STOP");
    sleep_ms(5000);
    let continued_us = now_us();
    consumers[0].signal("CONT");

    // The other members took every shard of the stopped process while it was stopped.
    let others = [&consumers[1], &consumers[2]];
    for &shard in victim_owned.keys() {
        let taken = first_read_since(&others, shard, stopped_us);
        assert!(
            taken.as_ref().is_some_and(|(at, _)| *at < continued_us),
            "shard {shard} was not read by another member while its owner was stopped: {taken:?}"
        );
    }
    // The zombie learns it lost its shards and joins again: it is assigned shards anew.
    let rejoined = wait_until(Duration::from_secs(20), || {
        consumers[0]
            .lines()
            .iter()
            .any(|l| matches!(l, LogLine::Assigned(o) if o.ts_us >= continued_us))
    });
    assert!(
        rejoined,
        "the continued process was never assigned a shard again"
    );
    finish(&url, &mut producer, &mut consumers, Duration::from_secs(60));

    let stop = Stop {
        process: 0,
        stopped_us,
        continued_us,
    };
    let report = checker::check(&logs(&consumers), EXPECTED, &[stop]);

    // Zombie checks on the continued process's own log, per (member, shard) it owned at the stop.
    let zombie = zombie_log(
        &consumers[0].lines(),
        &victim_owned,
        stopped_us,
        continued_us,
    );
    let spanning = zombie.spanning;
    eprintln!(
        "SIGSTOP member: {}; the stopped process owned {victim_owned:?}; handler calls spanning the stop: {spanning}; fence rejections after SIGCONT: {} {:?}",
        report.summary(),
        zombie.rejections(),
        zombie.fence_rejections
    );
    assert_clean(&report, "sigstop-member", &consumers);
    let violations = zombie.violations();
    if !violations.is_empty() {
        let saved = save_logs("zombie", &consumers.iter().collect::<Vec<_>>());
        panic!("the continued process kept working (logs in {saved}): {violations:#?}");
    }
    assert!(
        spanning <= victim_owned.len(),
        "more handler calls spanned the stop ({spanning}) than the stopped process had shards"
    );
}

/// `SIGSTOP` of Redis for longer than the lease: the members stop handling once their leases run
/// out (fail closed), then recover by themselves when Redis continues; nothing is lost.
#[test]
fn sigstop_of_redis_past_the_lease_stops_the_members_and_they_recover() {
    let _serial = serial();
    let server = RedisServer::start().unwrap();
    let url = server.url();
    create_stream(&url);
    let mut consumers = start_consumers(&url, 2, 2, &["--handler-ms", "2"]);
    let mut producer = producer(&url, KEYS, COUNT, 600);
    sleep_ms(1500);

    let owners_before: Vec<BTreeMap<u32, String>> = consumers.iter().map(owned_by).collect();
    let paused_us = now_us();
    server.pause().unwrap();
    sleep_ms(3000);
    let resumed_us = now_us();
    server.resume().unwrap();

    let all: Vec<&Workload> = consumers.iter().collect();
    let mut recovery_ms = BTreeMap::new();
    for shard in 0..SHARDS {
        let read = wait_until(Duration::from_secs(20), || {
            first_read_since(&all, shard, resumed_us).is_some()
        });
        assert!(read, "shard {shard} was never read after Redis continued");
        let (at, _) = first_read_since(&all, shard, resumed_us).unwrap();
        recovery_ms.insert(shard, ms(at - resumed_us));
    }
    let shutdown_us = finish(&url, &mut producer, &mut consumers, Duration::from_secs(60));

    let report = checker::check(&logs(&consumers), EXPECTED, &[]);
    // Fail closed: from the end of the lease (plus scheduling slack) until Redis continued, no
    // handler started and no read happened.
    let quiet_from = paused_us + LEASE_MS * 1000 + 250_000;
    let mut active = Vec::new();
    for consumer in &consumers {
        for line in consumer.lines() {
            match &line {
                LogLine::Handled(h) if h.start_us >= quiet_from && h.start_us < resumed_us => {
                    active.push(line.clone());
                }
                LogLine::Read(r) if r.ts_us >= quiet_from && r.ts_us < resumed_us => {
                    active.push(line.clone());
                }
                _ => {}
            }
        }
    }
    // The outage is not a reason to move shards (docs/design.md §5): reported, not asserted.
    let moves = assignments_between(&consumers, paused_us, shutdown_us);
    let owners_after: Vec<BTreeMap<u32, String>> =
        consumers.iter().map(|c| owned_at(c, shutdown_us)).collect();
    eprintln!(
        "SIGSTOP Redis: {}; first read per shard after Redis continued (ms): {recovery_ms:?}; assignments from the pause to the shutdown: {moves}; owners before {owners_before:?} after {owners_after:?}",
        report.summary()
    );
    assert_clean(&report, "sigstop-redis", &consumers);
    assert!(
        active.is_empty(),
        "members kept working after their leases ran out while Redis was stopped: {active:#?}"
    );
}

/// Redis killed and restarted from its append-only file (`appendfsync always`) mid-run, down for
/// longer than the lease: the members and the producer reconnect by themselves, and nothing is
/// lost.
#[test]
fn redis_restart_with_aof_mid_run_loses_nothing() {
    let _serial = serial();
    let mut server = RedisServer::builder().aof(true).start().unwrap();
    let url = server.url();
    create_stream(&url);
    let mut consumers = start_consumers(&url, 2, 2, &["--handler-ms", "2"]);
    let mut producer = producer(&url, KEYS, COUNT, 600);
    sleep_ms(1500);

    let owners_before: Vec<BTreeMap<u32, String>> = consumers.iter().map(owned_by).collect();
    let killed_us = now_us();
    server.kill().unwrap();
    sleep_ms(2000);
    server.restart().unwrap();
    let restarted_us = now_us();

    let all: Vec<&Workload> = consumers.iter().collect();
    let mut recovery_ms = BTreeMap::new();
    for shard in 0..SHARDS {
        let read = wait_until(Duration::from_secs(30), || {
            first_read_since(&all, shard, restarted_us).is_some()
        });
        assert!(
            read,
            "shard {shard} was never read after Redis restarted; stderr: {}",
            consumers
                .iter()
                .map(|c| c.stderr_text())
                .collect::<Vec<_>>()
                .join(" | ")
        );
        let (at, _) = first_read_since(&all, shard, restarted_us).unwrap();
        recovery_ms.insert(shard, ms(at - restarted_us));
    }
    let shutdown_us = finish(&url, &mut producer, &mut consumers, Duration::from_secs(60));

    let report = checker::check(&logs(&consumers), EXPECTED, &[]);
    let moves = assignments_between(&consumers, killed_us, shutdown_us);
    let owners_after: Vec<BTreeMap<u32, String>> =
        consumers.iter().map(|c| owned_at(c, shutdown_us)).collect();
    eprintln!(
        "Redis restart (AOF): {}; down {} ms; first read per shard after the restart (ms): {recovery_ms:?}; assignments from the kill to the shutdown: {moves}; owners before {owners_before:?} after {owners_after:?}; producer: {}",
        report.summary(),
        ms(restarted_us - killed_us),
        producer.raw_lines().join(" ")
    );
    assert_clean(&report, "redis-restart", &consumers);
}
