//! Redis Cluster failover under load, with real processes (issue 21, "Redis Cluster with
//! replicas"): a local cluster of 3 masters and 3 replicas (`RedisCluster::builder().replicas(1)`,
//! `cluster-node-timeout` 1.5 s), three `workload consume` processes of two members each and a
//! `workload produce` at 600 messages/s, all through `--cluster-node`. Mid-run a master is failed
//! over:
//!
//! - gracefully, with `CLUSTER FAILOVER` on its replica: nothing may be lost, not even in Redis;
//! - by `kill -9` of the master holding the group's coordination keys (`sl:{orders:billing}:*`
//!   and the shard streams of its slots), or of a master holding shards only: the cluster
//!   promotes its replica after `cluster-node-timeout`;
//! - by `kill -9` of the coordination master while its replica is cut off (frozen and its
//!   replication connection closed) for 1.2 s, right after a fourth process joined: the
//!   rebalance, fence raises, reads, acks and appends of those 1.2 s are lost with the master.
//!
//! What async replication loses is measured on Redis itself: after the run, the messages no
//! shard stream holds are those the old master acknowledged (`XADD` returned an id) and the
//! promoted replica never received. Those may be lost (`check_allowing_unreplicated_loss`,
//! counted); every message the new masters hold must be handled. The producer also runs with
//! `--wait-replicas 1 --wait-timeout-ms 50` (`WAIT 1 50` after each batch), reported only:
//! through redis-rs's cluster connection `WAIT` goes to every master it has a connection to, and
//! a master that just died is skipped, so a `WAIT` right after a kill can answer 1 for appends
//! that only the dead master had (seen in a run of the lagging-replica case).
//!
//! Each run is judged by the fault checker (`stream_listener::testing::workload::check`): no
//! loss (as above), per-key order of first handling, no shard read by two members at once (lost
//! fences or coordination writes must end in the correction round, not in two owners), and
//! nothing pending once every message is handled. Figures (printed; `--nocapture`): time from the
//! fault until the cluster is ready again and until each shard is read again, messages lost,
//! duplicates.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use stream_listener::core::internals::admin;
use stream_listener::core::internals::connection::{RedisConnection, RedisTarget};
use stream_listener::testing::RedisCluster;
use stream_listener::testing::workload::{
    self as checker, Expected, LogLine, Workload, first_read_since, handled_messages, now_us,
    poll_until,
};
use support::faults::{
    SHARDS, block_on, save_logs, serial, strings, wait_settled, workload_binary,
};
use support::{GROUP, STREAM};

const KEYS: u64 = 40;
const COUNT: u64 = 3000;
const RATE: u64 = 600;
const EXPECTED: Expected = Expected {
    keys: KEYS,
    count: COUNT,
};
/// `cluster-node-timeout`: a master unreachable this long is failed and its replica promoted.
const NODE_TIMEOUT: Duration = Duration::from_millis(1500);

fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

/// A 3-master, 3-replica cluster with the suite's stream.
fn start_cluster() -> RedisCluster {
    let cluster = RedisCluster::builder()
        .masters(3)
        .replicas(1)
        .node_timeout(NODE_TIMEOUT)
        .start()
        .expect("a cluster of 3 masters and 3 replicas");
    let target = RedisTarget::cluster(cluster.urls());
    block_on(async {
        let mut conn = RedisConnection::connect(&target, Duration::from_secs(5))
            .await
            .expect("connect to the cluster");
        admin::create_stream(&mut conn, STREAM, SHARDS)
            .await
            .expect("create the stream");
    });
    cluster
}

/// The group's `(incarnation, groupEpoch)` as `describe` shows it: a new incarnation means a
/// correction round ran (docs/design.md §6.6), after evidence of lost coordination writes.
fn group_view(cluster: &RedisCluster) -> (u64, i64) {
    use stream_listener::core::internals::coordinator::CoordinatorConfig;
    let config = CoordinatorConfig::new(
        Duration::from_millis(support::faults::HEARTBEAT_MS),
        Duration::from_millis(support::faults::LEASE_MS),
        Duration::from_millis(support::faults::REBALANCE_MS),
    )
    .expect("the suite's timings");
    let target = RedisTarget::cluster(cluster.urls());
    block_on(async {
        let mut conn = RedisConnection::connect(&target, Duration::from_secs(5))
            .await
            .expect("connect to the cluster");
        let group = admin::describe_group(&mut conn, STREAM, GROUP, &config)
            .await
            .expect("describe the group");
        (group.incarnation, group.group_epoch)
    })
}

/// `--cluster-node <url>` for every node.
fn cluster_args(cluster: &RedisCluster) -> Vec<String> {
    cluster
        .urls()
        .into_iter()
        .flat_map(|url| ["--cluster-node".to_owned(), url])
        .collect()
}

/// Member timings of a consumer process: heartbeat, lease, rebalance timeout (ms).
#[derive(Debug, Clone, Copy)]
struct Timings {
    heartbeat_ms: u64,
    lease_ms: u64,
    rebalance_ms: u64,
}

/// The suite's timings (`tests/support/faults.rs`): 200 ms, 1.5 s, 3 s.
const SUITE: Timings = Timings {
    heartbeat_ms: support::faults::HEARTBEAT_MS,
    lease_ms: support::faults::LEASE_MS,
    rebalance_ms: support::faults::REBALANCE_MS,
};

/// A `workload consume` process of two members on the cluster, as `support::faults::consumer`
/// starts one but with `timings`, a 2 ms handler and `extra`.
fn cluster_consumer(
    cluster: &RedisCluster,
    name: &str,
    timings: Timings,
    extra: &[&str],
) -> Workload {
    let mut args = support::faults::consumer_args(
        2,
        timings.heartbeat_ms,
        timings.lease_ms,
        timings.rebalance_ms,
    );
    args.extend(strings(&["--handler-ms", "2"]));
    args.extend(cluster_args(cluster));
    args.extend(strings(extra));
    Workload::spawn(workload_binary(), name, &cluster.urls()[0], &args)
}

/// Three consumer processes, settled (every shard owned, nothing moving for 0.8 s).
fn start_consumers(cluster: &RedisCluster, timings: Timings) -> Vec<Workload> {
    let consumers: Vec<Workload> = (0..3)
        .map(|i| cluster_consumer(cluster, &format!("consumer-{i}"), timings, &[]))
        .collect();
    wait_settled(
        &consumers.iter().collect::<Vec<_>>(),
        Duration::from_secs(30),
        Duration::from_millis(800),
    );
    consumers
}

/// `workload produce` at `RATE`/s with `WAIT 1 50` after each batch of 32.
fn start_producer(cluster: &RedisCluster) -> Workload {
    let mut args = strings(&[
        "produce",
        "--stream",
        STREAM,
        "--keys",
        &KEYS.to_string(),
        "--count",
        &COUNT.to_string(),
        "--rate",
        &RATE.to_string(),
        "--shards",
        &SHARDS.to_string(),
        "--batch",
        "32",
        "--wait-replicas",
        "1",
        "--wait-timeout-ms",
        "50",
    ]);
    args.extend(cluster_args(cluster));
    Workload::spawn(workload_binary(), "producer", &cluster.urls()[0], &args)
}

/// The master serving the group's coordination keys (`sl:{orders:billing}:group` and its
/// companions share the slot of `{orders:billing}`, docs/design.md §2.2).
fn coordination_master(cluster: &RedisCluster) -> usize {
    cluster
        .master_of_key(&format!("{{{STREAM}:{GROUP}}}"))
        .expect("the group's slot has a master")
}

/// The shards whose stream is on node `master`.
fn shards_on(cluster: &RedisCluster, master: usize) -> BTreeSet<u32> {
    (0..SHARDS)
        .filter(|shard| {
            cluster.master_of_key(&format!("{{{STREAM}:{shard}}}")).ok() == Some(master)
        })
        .collect()
}

/// An `XRANGE` entry: its id and fields.
type StreamEntry = (String, Vec<(String, Vec<u8>)>);

/// A set of produced messages, `(key, seq)`.
type Messages = BTreeSet<(String, u64)>;

/// Messages (key, seq) whose batch's `WAIT` returned at least one replica, and the others, from
/// the producer's `replicated` lines. Message `n` is `key-<n mod K>`, seq `n div K`.
fn replication_of(producer: &Workload) -> (Messages, Messages) {
    let mut acked = BTreeSet::new();
    for line in producer.raw_lines() {
        let Ok(value) = serde_json::from_str::<serde_json::Value>(&line) else {
            continue;
        };
        if value["event"] != "replicated" || value["acks"].as_i64().unwrap_or(-1) < 1 {
            continue;
        }
        let (first, end) = (value["first"].as_u64(), value["end"].as_u64());
        if let (Some(first), Some(end)) = (first, end) {
            acked.extend(first..end);
        }
    }
    let message = |n: u64| (Expected::key(n % KEYS), n / KEYS);
    let (yes, no): (Vec<u64>, Vec<u64>) = (0..COUNT).partition(|n| acked.contains(n));
    (
        yes.into_iter().map(message).collect(),
        no.into_iter().map(message).collect(),
    )
}

/// The producer's `WAIT` replies batch after batch, run-length encoded: `1x40 -1x3 0x20 ...`
/// (`-1`: `WAIT` failed).
fn wait_replies(producer: &Workload) -> String {
    let mut runs: Vec<(i64, usize)> = Vec::new();
    for line in producer.raw_lines() {
        let Ok(value) = serde_json::from_str::<serde_json::Value>(&line) else {
            continue;
        };
        if value["event"] != "replicated" {
            continue;
        }
        let acks = value["acks"].as_i64().unwrap_or(-1);
        match runs.last_mut() {
            Some((last, n)) if *last == acks => *n += 1,
            _ => runs.push((acks, 1)),
        }
    }
    runs.iter()
        .map(|(acks, n)| format!("{acks}x{n}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Entries pending in the group per shard (`XPENDING <shard> <group>` through the cluster).
fn pending_per_shard(cluster: &RedisCluster) -> Result<Vec<u64>, String> {
    let mut conn = cluster
        .client()
        .get_connection()
        .map_err(|e| e.to_string())?;
    support::faults::pending_per_shard_on(&mut conn)
}

/// For each shard, the time from `fault_us` until its first read at or after
/// `since_us` (when the test saw the new master serve), in ms: an upper bound on how long the
/// shard went unread. Panics naming the shard when one is not read within 30 s.
fn read_again(consumers: &[Workload], fault_us: u64, since_us: u64) -> BTreeMap<u32, f64> {
    let all: Vec<&Workload> = consumers.iter().collect();
    (0..SHARDS)
        .map(|shard| {
            let read = poll_until(Duration::from_secs(30), || {
                first_read_since(&all, shard, since_us).is_some()
            });
            if !read {
                let saved = save_logs("cluster-unread", &all);
                panic!(
                    "shard {shard} was never read after the failover (logs in {saved}); stderr: {}",
                    stderr_of(consumers)
                );
            }
            let (at, _) = first_read_since(&all, shard, since_us).unwrap();
            (shard, ms(at - fault_us))
        })
        .collect()
}

/// For each shard, the longest time from an entry's append (the milliseconds of its stream id,
/// the master's clock: the same host) to the end of its first ok handler call, over the entries
/// appended in `[from_us, to_us]`, in ms: how long the shard's new entries waited around a fault.
/// (Read gaps would also count the time the producer could not append.)
fn longest_waits(consumers: &[Workload], from_us: u64, to_us: u64) -> BTreeMap<u32, f64> {
    let mut first_done: BTreeMap<(u32, String), u64> = BTreeMap::new();
    for line in consumers.iter().flat_map(Workload::lines) {
        if let LogLine::Handled(h) = line
            && h.ok
        {
            let done = first_done
                .entry((h.call.shard, h.call.entry_id))
                .or_insert(u64::MAX);
            *done = (*done).min(h.end_us);
        }
    }
    let mut waits: BTreeMap<u32, f64> = BTreeMap::new();
    for ((shard, id), done) in first_done {
        let Some(appended_us) = id
            .split('-')
            .next()
            .and_then(|ms| ms.parse::<u64>().ok())
            .map(|ms| ms * 1000)
        else {
            continue;
        };
        if (from_us..=to_us).contains(&appended_us) {
            let wait = waits.entry(shard).or_insert(0.0);
            *wait = wait.max(ms(done.saturating_sub(appended_us)));
        }
    }
    waits
}

fn stderr_of(procs: &[Workload]) -> String {
    procs
        .iter()
        .map(|p| format!("{}: {}", p.name, p.stderr_text()))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Waits for the producer, then until every message outside `may_be_lost` is handled and nothing
/// is pending; then shuts the consumers down.
fn finish(
    cluster: &RedisCluster,
    producer: &mut Workload,
    consumers: &mut [Workload],
    may_be_lost: &BTreeSet<(String, u64)>,
) {
    let status = producer.wait_exit(Duration::from_secs(60));
    assert!(
        status.is_some_and(|s| s.success()),
        "the producer did not finish (status {status:?}); stderr:\n{}",
        producer.stderr_text()
    );
    // The messages Redis no longer holds may never come; every other one must.
    let started = Instant::now();
    let all = poll_until(Duration::from_secs(40), || {
        handled_messages(&consumers.iter().collect::<Vec<_>>())
            .iter()
            .filter(|m| !may_be_lost.contains(*m))
            .count()
            == COUNT as usize - may_be_lost.len()
    });
    if !all {
        let saved = save_logs("cluster-unfinished", &consumers.iter().collect::<Vec<_>>());
        panic!(
            "not every message was handled within {:?} (logs in {saved}): {}; stderr:\n{}",
            started.elapsed(),
            checker::check_allowing_unreplicated_loss(&logs(consumers), EXPECTED, &[], may_be_lost)
                .summary(),
            stderr_of(consumers)
        );
    }
    let mut pending = Vec::new();
    let drained = poll_until(Duration::from_secs(15), || {
        pending = pending_per_shard(cluster).unwrap_or_default();
        pending.len() == SHARDS as usize && pending.iter().all(|&n| n == 0)
    });
    if !drained {
        let saved = save_logs("cluster-pending", &consumers.iter().collect::<Vec<_>>());
        panic!(
            "entries stay pending after every message was handled (per shard {pending:?}; logs in \
             {saved}): read but never acked"
        );
    }
    for consumer in consumers.iter_mut() {
        consumer.terminate(Duration::from_secs(20));
    }
}

fn logs(consumers: &[Workload]) -> Vec<checker::ProcessLog> {
    consumers.iter().map(Workload::log).collect()
}

fn assert_clean(report: &checker::Report, scenario: &str, consumers: &[Workload]) {
    if !report.ok() {
        let saved = save_logs(scenario, &consumers.iter().collect::<Vec<_>>());
        eprintln!("{scenario}: logs saved in {saved}");
    }
    report.assert_ok();
}

/// `CLUSTER FAILOVER` on the replica of the master holding the group's coordination keys, under
/// load: the replica catches up before it takes over (the master pauses its clients meanwhile),
/// so nothing is lost, no shard has two readers, and every shard of that master is read again.
#[test]
fn a_graceful_cluster_failover_under_load_loses_nothing() {
    let _serial = serial();
    let cluster = start_cluster();
    let mut consumers = start_consumers(&cluster, SUITE);
    let mut producer = start_producer(&cluster);
    std::thread::sleep(Duration::from_millis(1500));

    let master = coordination_master(&cluster);
    let replica = cluster
        .replica_of(master)
        .unwrap()
        .expect("the master has a replica");
    let moved = shards_on(&cluster, master);
    let before = group_view(&cluster);
    let fault_us = now_us();
    cluster.failover(replica).expect("CLUSTER FAILOVER");
    let ready_us = now_us();
    assert_eq!(coordination_master(&cluster), replica);
    let read_again_ms = read_again(&consumers, fault_us, ready_us);
    let ready_ms = ms(ready_us - fault_us);

    let status = producer.wait_exit(Duration::from_secs(60));
    assert!(
        status.is_some_and(|s| s.success()),
        "{}",
        producer.stderr_text()
    );
    let after = group_view(&cluster);
    let absent = absent_from_the_streams(&cluster);
    finish(&cluster, &mut producer, &mut consumers, &BTreeSet::new());
    let report = checker::check(&logs(&consumers), EXPECTED, &[]);
    let (acked, unacked) = replication_of(&producer);
    eprintln!(
        "CLUSTER FAILOVER: {}; failed over and ready after {ready_ms:.0} ms; every shard read \
         again after (ms) {read_again_ms:?} (shards {moved:?} were on the old master); messages \
         whose WAIT 1 returned >= 1: {}, the others: {}; WAIT replies per batch: {}; group \
         (incarnation, groupEpoch) before {before:?} after {after:?}",
        report.summary(),
        acked.len(),
        unacked.len(),
        wait_replies(&producer)
    );
    assert_clean(&report, "cluster-failover", &consumers);
    assert_eq!(report.handled_ok, COUNT as usize);
    assert!(
        absent.is_empty(),
        "the new master lacks {} appended messages, e.g. {:?}",
        absent.len(),
        absent.iter().take(5).collect::<Vec<_>>()
    );
    let slowest = read_again_ms.values().copied().fold(0.0, f64::max);
    assert!(
        slowest < 10_000.0,
        "a shard waited {slowest} ms to be read again after the failover: {read_again_ms:?}"
    );
}

/// `kill -9` of the master holding the group's coordination keys, under load: the cluster
/// promotes its replica after `cluster-node-timeout`; the members reconnect by themselves and
/// read every shard again; every message the promoted replica holds is handled (those it lacks
/// may be lost: counted and reported); no shard has two readers. The heartbeats fail until the promotion
/// (about 3 s, longer than the 1.5 s lease), so every member stops reading meanwhile (fail
/// closed) and goes on with the same shards.
#[test]
fn kill_9_of_the_coordination_master_under_load_promotes_its_replica_and_loses_no_replicated_entry()
{
    kill_9(Kill9 {
        label: "coordination",
        victim: coordination_master,
        timings: SUITE,
        others_gap: None,
        lag: None,
    });
}

/// `kill -9` of a master that holds shard streams but not the group's coordination keys: only
/// its shards wait for the promotion; the entries of the shards on the other masters are handled
/// on (none waits as long as the lease from its append to its handling); the same guarantees as
/// above.
#[test]
fn kill_9_of_a_shard_master_under_load_stops_only_its_shards() {
    kill_9(Kill9 {
        label: "shards",
        victim: |cluster| {
            let coordination = coordination_master(cluster);
            (0..SHARDS)
                .filter_map(|shard| cluster.master_of_key(&format!("{{{STREAM}:{shard}}}")).ok())
                .find(|&m| m != coordination)
                .expect("a master with shards and without the group's keys")
        },
        timings: SUITE,
        others_gap: Some(Duration::from_millis(SUITE.lease_ms)),
        lag: None,
    });
}

/// `kill -9` of the coordination master with members whose lease outlasts the promotion
/// (heartbeat 300 ms, lease 8 s, so 6.4 s after the lease margin, against about 3 s until the
/// promotion): the heartbeats fail meanwhile, but no member stops, so the shards on the other
/// masters are read on (no entry there waits 1.5 s from its append to its handling).
#[test]
fn kill_9_of_the_coordination_master_within_the_lease_stops_only_its_shards() {
    kill_9(Kill9 {
        label: "within-lease",
        victim: coordination_master,
        timings: Timings {
            heartbeat_ms: 300,
            lease_ms: 8000,
            rebalance_ms: 8000,
        },
        others_gap: Some(Duration::from_millis(1500)),
        lag: None,
    });
}

/// As the coordination master's `kill -9`, with the replica cut off for the 1.2 s before the
/// kill: frozen (`SIGSTOP`, shorter than `cluster-node-timeout`, so that it stays eligible) and
/// its replication connection closed by the master (`CLIENT KILL TYPE replica`), right after a
/// fourth consumer process joined. Every write of those 1.2 s (the rebalance in the group's
/// metadata, leases, fence raises, reads and acks of the master's shards, appends) never
/// reaches it, and is lost when it is promoted. Every message the promoted replica holds is still
/// handled, the others may be lost (counted), and lost coordination writes must not give a shard
/// two readers.
#[test]
fn kill_9_of_the_coordination_master_with_a_lagging_replica_loses_only_unreplicated_writes() {
    kill_9(Kill9 {
        label: "lagging-replica",
        victim: coordination_master,
        timings: SUITE,
        others_gap: None,
        lag: Some(Duration::from_millis(1200)),
    });
}

/// Entries of `shards` that were handled (so the old master had them) and appended before
/// `before_us`, but that the shard stream lacks now: what the promoted replica never received.
fn entries_the_new_master_lacks(
    cluster: &RedisCluster,
    consumers: &[Workload],
    shards: &BTreeSet<u32>,
    before_us: u64,
) -> usize {
    let mut conn = cluster.client().get_connection().unwrap();
    let mut lacking = 0;
    for &shard in shards {
        let stored: Vec<StreamEntry> = redis::cmd("XRANGE")
            .arg(format!("{{{STREAM}:{shard}}}"))
            .arg("-")
            .arg("+")
            .query(&mut conn)
            .unwrap();
        let stored: BTreeSet<String> = stored.into_iter().map(|(id, _)| id).collect();
        let handled: BTreeSet<String> = consumers
            .iter()
            .flat_map(Workload::lines)
            .filter_map(|line| match line {
                LogLine::Handled(h) if h.call.shard == shard => Some(h.call.entry_id),
                _ => None,
            })
            .filter(|id| {
                id.split('-')
                    .next()
                    .and_then(|ms| ms.parse::<u64>().ok())
                    .is_some_and(|ms| ms * 1000 < before_us)
            })
            .collect();
        lacking += handled.difference(&stored).count();
    }
    lacking
}

/// The produced messages that no shard stream holds now (`XRANGE` of every shard through the
/// cluster, payloads `{"key","seq"}`): after a `kill -9`, the appends the promoted replica never
/// received.
fn absent_from_the_streams(cluster: &RedisCluster) -> Messages {
    let mut conn = cluster.client().get_connection().unwrap();
    let mut stored = Messages::new();
    for shard in 0..SHARDS {
        let entries: Vec<StreamEntry> = redis::cmd("XRANGE")
            .arg(format!("{{{STREAM}:{shard}}}"))
            .arg("-")
            .arg("+")
            .query(&mut conn)
            .unwrap();
        for (_, fields) in entries {
            let payload = fields.iter().find(|(name, _)| name == "payload");
            let value =
                payload.and_then(|(_, v)| serde_json::from_slice::<serde_json::Value>(v).ok());
            if let Some(value) = value
                && let (Some(key), Some(seq)) = (value["key"].as_str(), value["seq"].as_u64())
            {
                stored.insert((key.to_owned(), seq));
            }
        }
    }
    EXPECTED
        .messages()
        .filter(|m| !stored.contains(m))
        .collect()
}

/// The assignment changes of `process`, relative to `fault_us`, for the figures.
fn assignment_changes(process: Option<&Workload>, fault_us: u64) -> Vec<String> {
    let Some(process) = process else {
        return Vec::new();
    };
    process
        .lines()
        .iter()
        .filter_map(|line| {
            let (what, o) = match line {
                LogLine::Assigned(o) => ("assigned", o),
                LogLine::Revoked(o) => ("revoked", o),
                _ => return None,
            };
            Some(format!(
                "{what} shard {} epoch {} at {:+.0} ms",
                o.shard,
                o.member_epoch,
                (o.ts_us as f64 - fault_us as f64) / 1000.0
            ))
        })
        .collect()
}

/// `CLIENT KILL TYPE replica` on node `master`: it closes its replicas' connections (a frozen
/// replica cannot reconnect, so the writes after this are on the master only).
fn cut_replication_link(cluster: &RedisCluster, master: usize) {
    let mut conn = cluster
        .node(master)
        .unwrap()
        .client()
        .get_connection()
        .unwrap();
    let killed: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("replica")
        .query(&mut conn)
        .unwrap();
    assert_eq!(killed, 1, "the master had one replica connection");
}

/// One `kill -9` run ([`kill_9`]).
struct Kill9 {
    /// Names the run in the figures and the saved logs.
    label: &'static str,
    /// Picks the master to kill.
    victim: fn(&RedisCluster) -> usize,
    /// The consumers' timings.
    timings: Timings,
    /// No entry of a shard on another master may wait this long from its append to its handling.
    others_gap: Option<Duration>,
    /// A fourth process joins, then the replica is cut off (frozen, its replication connection
    /// closed) for this long before the kill, and continued right after it.
    lag: Option<Duration>,
}

/// The `kill -9` scenario `run`.
fn kill_9(run: Kill9) {
    let Kill9 {
        label,
        victim,
        timings,
        others_gap,
        lag,
    } = run;
    let _serial = serial();
    let mut cluster = start_cluster();
    let mut consumers = start_consumers(&cluster, timings);
    let mut producer = start_producer(&cluster);
    std::thread::sleep(Duration::from_millis(1500));

    let master = victim(&cluster);
    let replica = cluster
        .replica_of(master)
        .unwrap()
        .expect("the master has a replica");
    let moved = shards_on(&cluster, master);
    let before = group_view(&cluster);
    if let Some(lag) = lag {
        // Frozen, the replica would still find what the master sent in its socket buffer; so
        // the master also drops its replication link, and what it takes from then on is only
        // on the master.
        // A fourth process joins; once its members have joined, the replica is cut off, so
        // the rebalance that follows (its coordination writes, and the fence raises on this
        // master's shards) is lost with the master.
        consumers.push(cluster_consumer(
            &cluster,
            "consumer-3",
            timings,
            &["--log-starts"],
        ));
        let joined = poll_until(Duration::from_secs(20), || {
            consumers[3]
                .lines()
                .iter()
                .any(|l| matches!(l, LogLine::Ready(_)))
        });
        assert!(
            joined,
            "the fourth process did not start: {}",
            consumers[3].stderr_text()
        );
        cluster.pause_node(replica).unwrap();
        cut_replication_link(&cluster, master);
        std::thread::sleep(lag);
    }
    let fault_us = now_us();
    cluster.kill_node(master).unwrap();
    if lag.is_some() {
        cluster.resume_node(replica).unwrap();
    }
    cluster
        .wait_until_promoted(replica)
        .expect("the cluster promotes the replica");
    let promoted_us = now_us();
    let promoted_ms = ms(promoted_us - fault_us);
    for shard in &moved {
        let key = format!("{{{STREAM}:{shard}}}");
        assert_eq!(cluster.master_of_key(&key).unwrap(), replica, "{key}");
    }
    // The killed node comes back as the new master's replica, so WAIT can be satisfied again.
    cluster.restart_node(master).unwrap();
    cluster.wait_until_ready().expect("the old master rejoins");
    assert_eq!(cluster.replica_of(replica).unwrap(), Some(master));
    let read_again_ms = read_again(&consumers, fault_us, promoted_us);

    let status = producer.wait_exit(Duration::from_secs(60));
    assert!(
        status.is_some_and(|s| s.success()),
        "{}",
        producer.stderr_text()
    );
    let (acked, _) = replication_of(&producer);
    // What the promoted replica has is what survived: the appends it lacks were acknowledged
    // by the old master only. Those may be lost; every message it has must be handled.
    let absent = absent_from_the_streams(&cluster);
    let after = group_view(&cluster);
    finish(&cluster, &mut producer, &mut consumers, &absent);
    let lacking = entries_the_new_master_lacks(&cluster, &consumers, &moved, fault_us);
    let joiner = assignment_changes(consumers.get(3), fault_us);
    let waits = longest_waits(&consumers, fault_us - 1_000_000, fault_us + 15_000_000);
    let report =
        checker::check_allowing_unreplicated_loss(&logs(&consumers), EXPECTED, &[], &absent);
    let lost_after_wait =
        support::faults::missing_messages(&consumers.iter().collect::<Vec<_>>(), EXPECTED)
            .into_iter()
            .filter(|m| acked.contains(m))
            .count();
    eprintln!(
        "kill -9 of a master ({label}): {}; replica promoted after {promoted_ms:.0} ms \
         (cluster-node-timeout {NODE_TIMEOUT:?}); every shard read again after (ms) \
         {read_again_ms:?}; longest wait from append to handled per shard (ms) {waits:?} (shards \
         {moved:?} were on the killed master); messages the new masters lack (acknowledged by \
         the old master only): {}, of which never handled (lost): {}; messages the new masters \
         have that were lost: 0 (asserted); entries handled from the old master that the new \
         one lacks: {lacking}; messages whose WAIT 1 returned >= 1: {}, of them lost: \
         {lost_after_wait}; WAIT replies per batch: {}; producer: {}; group (incarnation, \
         groupEpoch) before {before:?} after {after:?}; the joiner's assignment changes (from \
         the kill): {joiner:?}",
        report.summary(),
        absent.len(),
        report.lost_unreplicated,
        acked.len(),
        wait_replies(&producer),
        producer.raw_lines().last().cloned().unwrap_or_default()
    );
    if !report.ok() {
        let mut procs: Vec<&Workload> = consumers.iter().collect();
        procs.push(&producer);
        eprintln!("logs with the producer's: {}", save_logs(label, &procs));
    }
    assert_clean(&report, &format!("cluster-kill9-{label}"), &consumers);
    let slowest = read_again_ms.values().copied().fold(0.0, f64::max);
    assert!(
        slowest < 20_000.0,
        "a shard waited {slowest} ms to be read again after the kill: {read_again_ms:?}"
    );
    if let Some(limit) = others_gap {
        let limit_ms = limit.as_secs_f64() * 1000.0;
        let stalled: BTreeMap<&u32, &f64> = waits
            .iter()
            .filter(|(shard, wait)| !moved.contains(shard) && **wait >= limit_ms)
            .collect();
        assert!(
            stalled.is_empty(),
            "entries of shards on the masters that kept running waited {stalled:?} ms to be \
             handled (limit {limit_ms} ms)"
        );
    }
}
