//! Fault injection on a Redis Cluster with member processes as real OS processes (issue 20: the
//! transaction fence of docs/design.md §8.16 fault-tested like the Lua fence, on standalone and
//! cluster; the standalone case is `tests/fault_injection.rs`): `SIGSTOP` of a member process for
//! longer than its lease, then `SIGCONT`, in the middle of a run of `examples/workload.rs` in strict
//! mode (the default) on a local cluster of 3 masters.
//!
//! Judged on the processes' logs, as on a server: the checker
//! (`stream_listener::testing::workload::check`: nothing lost, per-key order, no shard read by two
//! members at once, the stop given to it), nothing pending once every message is handled, and the
//! zombie's own log: after the `SIGCONT` it neither reads nor starts a handler on a shard it lost
//! until it is assigned that shard again (`support::faults::zombie_log`).
//!
//! Judged on Redis as well, because the workload logs reads that returned entries and fence
//! refusals, but neither claims nor empty reads: from just before the `SIGCONT` until the end, a
//! thread looks at the consumers of every shard the zombie lost (`XINFO CONSUMERS` every 20 ms).
//! Redis refreshes a consumer's last-seen time (its `idle`) on every `XREADGROUP` and `XCLAIM`
//! under its name, whatever they return, and a consumer exists only once one of them has run (or
//! until consumer hygiene deletes it). So until a zombie member is assigned a lost shard again, its
//! consumer there must not appear, must not be seen later than before the `SIGCONT`, and its
//! pending list must not grow: **0 zombie reads and 0 zombie claims, as Redis ran them**. A refused
//! strict read does not count: its check deleted the read gate, and its `XREADGROUP` failed with
//! `NOGROUP` on the gate before it looked up any consumer (Redis checks every stream's group
//! first), or its `EXEC` aborted and the read never ran.
//! That the looks can see reads at all is checked on the new owners' consumers, whose last-seen
//! time moves on every shard.
//!
//! Printed (`--nocapture`): the checker's summary, how long the stop lasted and when each shard was
//! read by another member, the fence rejections the zombie logged after the `SIGCONT` (by op, by
//! shard, and those that refused the zombie itself), and the strict reads Redis saw refused after
//! the `SIGCONT` (failed `XREADGROUP` calls in `INFO commandstats`, every member: the `NOGROUP` of
//! a read whose check closed the gate).
//!
//! The stopped process's clocks run on while it is stopped (`SIGSTOP` does not stop
//! `CLOCK_MONOTONIC`), so when it continues its own lease check already fails: mostly the lease
//! stops the zombie, and the fence refuses only an operation that the stop caught between its lease
//! check and its sending. A second, ignored variant freezes its clocks during the stop with
//! libfaketime, so that the fence is what stops it.
//!
//! Timings as the suite's: heartbeat 200 ms, lease 1.5 s, rebalance timeout 3 s; 3000 messages at
//! 600/s; every wait is polled with a deadline.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use redis::streams::StreamInfoConsumersReply;
use stream_listener::core::internals::connection::RedisTarget;
use stream_listener::testing::RedisCluster;
use stream_listener::testing::workload::{
    self as checker, Expected, LogLine, Stop, Workload, first_read_since, handled_messages, now_us,
    poll_until as wait_until,
};
use support::faults::{
    SHARDS, assigned_again, cluster_consumer, cluster_consumer_args, cluster_producer,
    create_stream_on, owned_now, pending_per_shard_on, save_logs, serial, wait_settled,
    workload_binary, zombie_log,
};
use support::{GROUP, STREAM};

const KEYS: u64 = 40;
const COUNT: u64 = 3000;
const RATE: u64 = 600;
const EXPECTED: Expected = Expected {
    keys: KEYS,
    count: COUNT,
};
/// How often the watch looks at the zombie's lost shards in Redis.
const LOOK_EVERY: Duration = Duration::from_millis(20);

fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

/// A cluster of 3 masters (no replicas) with the suite's stream.
fn start_cluster() -> RedisCluster {
    let cluster = RedisCluster::builder()
        .masters(3)
        .start()
        .expect("a cluster of 3 masters");
    create_stream_on(&RedisTarget::cluster(cluster.urls()));
    cluster
}

/// Three consumer processes of two members each, settled (every shard owned, nothing moving for
/// 0.8 s); the first one (the one to stop) under `clock` when given.
fn start_consumers(cluster: &RedisCluster, clock: Option<&FrozenClock>) -> Vec<Workload> {
    let extra = ["--handler-ms", "5"];
    let consumers: Vec<Workload> = (0..3)
        .map(|i| {
            let name = format!("consumer-{i}");
            match clock {
                Some(clock) if i == 0 => {
                    let args = cluster_consumer_args(cluster, 2, &extra);
                    Workload::spawn(&clock.wrapper, &name, &cluster.urls()[0], &args)
                }
                _ => cluster_consumer(cluster, &name, 2, &extra),
            }
        })
        .collect();
    wait_settled(
        &consumers.iter().collect::<Vec<_>>(),
        Duration::from_secs(30),
        Duration::from_millis(800),
    );
    consumers
}

/// How the stopped process's clocks were set back at the `SIGCONT` ([`FrozenClock`]): the lines
/// it wrote from line `from_line` on carry times `by_us` early; a handler call's start among them
/// is early too when it is at or after `fake_after_us` (calls that started before the stop carry
/// true times).
#[derive(Debug, Clone, Copy, Default)]
struct SetBack {
    from_line: usize,
    by_us: u64,
    fake_after_us: u64,
}

/// The log of `process` with true times: [`SetBack`] undone when `set_back` is given.
fn log_of(process: &Workload, set_back: Option<SetBack>) -> checker::ProcessLog {
    let mut log = process.log();
    let Some(set_back) = set_back else {
        return log;
    };
    let by = set_back.by_us;
    for line in log.lines.iter_mut().skip(set_back.from_line) {
        match line {
            LogLine::Handled(h) => {
                if h.start_us >= set_back.fake_after_us {
                    h.start_us += by;
                }
                h.end_us += by;
            }
            LogLine::Assigned(o) | LogLine::Revoked(o) => o.ts_us += by,
            LogLine::Read(r) => r.ts_us += by,
            LogLine::FenceRejected(f) => f.ts_us += by,
            LogLine::Handling(h) => h.ts_us += by,
            LogLine::Ready(r) => r.ts_us += by,
            LogLine::EntriesLost(e) => e.ts_us += by,
            LogLine::Hook(h) => {
                h.start_us += by;
                h.ts_us += by;
            }
        }
    }
    log
}

/// The logs of `consumers` with true times; `set_back` applies to the first (the stopped one).
fn logs(consumers: &[Workload], set_back: Option<SetBack>) -> Vec<checker::ProcessLog> {
    consumers
        .iter()
        .enumerate()
        .map(|(i, c)| log_of(c, if i == 0 { set_back } else { None }))
        .collect()
}

fn stderr_of(procs: &[Workload]) -> String {
    procs
        .iter()
        .map(|p| format!("{}: {}", p.name, p.stderr_text()))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The member ids of `process` (those with an assignment in its log).
fn members_of(process: &Workload) -> BTreeSet<String> {
    process
        .lines()
        .into_iter()
        .filter_map(|line| match line {
            LogLine::Assigned(o) => Some(o.member),
            _ => None,
        })
        .collect()
}

/// A consumer of a shard's group as one look saw it.
#[derive(Debug, Clone, Copy)]
struct Consumer {
    /// Entries in its pending list.
    pending: usize,
    /// Its last `XREADGROUP` or `XCLAIM` in Redis, µs since the Unix epoch, between these bounds
    /// (from the reply's `idle`, in ms, and when the look was sent and answered).
    seen: (u64, u64),
}

/// One look at a shard's consumer group (`XINFO CONSUMERS`).
#[derive(Debug, Clone)]
struct Look {
    shard: u32,
    /// When the reply came, µs since the Unix epoch.
    replied_us: u64,
    /// Every consumer of the group, by name.
    consumers: BTreeMap<String, Consumer>,
}

fn look(conn: &mut redis::cluster::ClusterConnection, shard: u32) -> Result<Look, String> {
    let sent_us = now_us();
    let reply: StreamInfoConsumersReply = redis::cmd("XINFO")
        .arg("CONSUMERS")
        .arg(format!("{{{STREAM}:{shard}}}"))
        .arg(GROUP)
        .query(conn)
        .map_err(|e| format!("XINFO CONSUMERS of shard {shard}: {e}"))?;
    let replied_us = now_us();
    let consumers = reply
        .consumers
        .into_iter()
        .map(|c| {
            let idle_us = c.idle as u64 * 1000;
            // Redis counts idle in whole ms from a clock read between the send and the reply.
            let seen = (
                sent_us.saturating_sub(idle_us + 1000),
                replied_us.saturating_sub(idle_us) + 1000,
            );
            (
                c.name,
                Consumer {
                    pending: c.pending,
                    seen,
                },
            )
        })
        .collect();
    Ok(Look {
        shard,
        replied_us,
        consumers,
    })
}

/// Looks at `shards` every [`LOOK_EVERY`] on a thread of its own, until [`Watch::end`].
struct Watch {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<(Vec<Look>, Vec<String>)>,
}

impl Watch {
    fn start(cluster: &RedisCluster, shards: Vec<u32>) -> Watch {
        let client = cluster.client();
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let (mut looks, mut errors) = (Vec::new(), Vec::new());
                let mut conn = match client.get_connection() {
                    Ok(conn) => conn,
                    Err(e) => return (looks, vec![format!("connecting the watch: {e}")]),
                };
                while !stop.load(Ordering::Relaxed) {
                    for &shard in &shards {
                        match look(&mut conn, shard) {
                            Ok(look) => looks.push(look),
                            Err(e) => errors.push(e),
                        }
                    }
                    std::thread::sleep(LOOK_EVERY);
                }
                (looks, errors)
            })
        };
        Watch { stop, thread }
    }

    /// Stops the thread; returns its looks and the errors it met.
    fn end(self) -> (Vec<Look>, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().expect("the watch thread")
    }
}

/// What the looks after the `SIGCONT` say about the zombie's consumers on the shards it lost.
#[derive(Debug, Default)]
struct WatchVerdict {
    /// A zombie member's consumer that appeared, was seen later, or whose pending list grew on a
    /// lost shard before the member was assigned that shard again (first per consumer and shard).
    violations: Vec<String>,
    /// (Look, zombie member) pairs judged: taken before the member's reassignment of the shard.
    judged: usize,
    /// The lost shards on which a consumer was seen later than before the `SIGCONT` (an owner's
    /// read, or a zombie's, judged above): the looks see reads.
    readers_seen: BTreeSet<u32>,
}

/// Judges `looks` against `before` (taken while the zombie was stopped) for the consumers named
/// `zombie` (its members): a look counts for a member and shard until the zombie's log
/// (`zombie_lines`) shows the member assigned the shard again after `continued_us` (the `assigned`
/// line is written before the shard task starts, so no look answered before it can show the new
/// ownership's work).
fn judge(
    before: &BTreeMap<u32, Look>,
    looks: &[Look],
    zombie_lines: &[LogLine],
    zombie: &BTreeSet<String>,
    continued_us: u64,
) -> WatchVerdict {
    let mut verdict = WatchVerdict::default();
    let mut reported = BTreeSet::new();
    for look in looks {
        let Some(then) = before.get(&look.shard) else {
            continue;
        };
        let seen_later = |name: &String, now: &Consumer| {
            then.consumers
                .get(name)
                .is_none_or(|e| now.seen.0 > e.seen.1)
        };
        if look
            .consumers
            .iter()
            .any(|(name, now)| seen_later(name, now))
        {
            verdict.readers_seen.insert(look.shard);
        }
        for name in zombie {
            let reassigned =
                assigned_again(zombie_lines, name, look.shard, continued_us).unwrap_or(u64::MAX);
            if look.replied_us >= reassigned {
                continue;
            }
            verdict.judged += 1;
            let what = match (then.consumers.get(name), look.consumers.get(name)) {
                (_, None) => None,
                (None, Some(now)) => Some(format!(
                    "its consumer appeared (an XREADGROUP or XCLAIM under its name) with {} \
                     pending, seen in {:?}",
                    now.pending, now.seen
                )),
                (Some(e), Some(now)) if now.pending > e.pending => Some(format!(
                    "its pending list grew from {} to {}",
                    e.pending, now.pending
                )),
                (Some(e), Some(now)) if seen_later(name, now) => Some(format!(
                    "it ran an XREADGROUP or XCLAIM: seen in {:?}, before the SIGCONT in {:?}",
                    now.seen, e.seen
                )),
                (Some(_), Some(_)) => None,
            };
            if let Some(what) = what
                && reported.insert((name.clone(), look.shard))
            {
                verdict.violations.push(format!(
                    "shard {}, member {name}, look answered at {} ({:+.1} ms from the SIGCONT; \
                     assigned the shard again at {}): {what}",
                    look.shard,
                    look.replied_us,
                    (look.replied_us as f64 - continued_us as f64) / 1000.0,
                    if reassigned == u64::MAX {
                        "never".to_owned()
                    } else {
                        reassigned.to_string()
                    }
                ));
            }
        }
    }
    verdict
}

/// `CONFIG RESETSTAT` on every node.
fn reset_stats(cluster: &RedisCluster) {
    for node in cluster.nodes() {
        let mut conn = node.client().get_connection().expect("connect to a node");
        redis::cmd("CONFIG")
            .arg("RESETSTAT")
            .query::<()>(&mut conn)
            .expect("CONFIG RESETSTAT");
    }
}

/// Failed `XREADGROUP` calls on every node since [`reset_stats`] (`INFO commandstats`,
/// `failed_calls`): a strict read whose fence check refused deleted its read gate, and its
/// `XREADGROUP` then failed with `NOGROUP` (docs/design.md §8.16). Nothing else of the runtime
/// fails an `XREADGROUP` while every shard has its consumer group (a read refused while queued,
/// for `BUSY` or `OOM`, counts as rejected, not failed).
fn refused_strict_reads(cluster: &RedisCluster) -> u64 {
    cluster
        .nodes()
        .iter()
        .map(|node| {
            let mut conn = node.client().get_connection().expect("connect to a node");
            let info: String = redis::cmd("INFO")
                .arg("commandstats")
                .query(&mut conn)
                .expect("INFO commandstats");
            info.lines()
                .find_map(|line| line.strip_prefix("cmdstat_xreadgroup:"))
                .and_then(|stats| {
                    stats
                        .split(',')
                        .find_map(|field| field.strip_prefix("failed_calls="))
                })
                .and_then(|calls| calls.parse::<u64>().ok())
                .unwrap_or(0)
        })
        .sum()
}

/// Waits for the producer, for every message to be handled and for nothing to be pending, then
/// ends `watch` and shuts the consumers down. Returns the watch's looks and errors.
fn finish(
    cluster: &RedisCluster,
    producer: &mut Workload,
    consumers: &mut [Workload],
    watch: Watch,
) -> (Vec<Look>, Vec<String>) {
    let status = producer.wait_exit(Duration::from_secs(40));
    assert!(
        status.is_some_and(|s| s.success()),
        "the producer did not finish (status {status:?}); stderr:\n{}",
        producer.stderr_text()
    );
    let started = Instant::now();
    let all = wait_until(Duration::from_secs(30), || {
        handled_messages(&consumers.iter().collect::<Vec<_>>()).len() >= COUNT as usize
    });
    if !all {
        let saved = save_logs(
            "cluster-sigstop-unfinished",
            &consumers.iter().collect::<Vec<_>>(),
        );
        panic!(
            "not every message was handled within {:?} (logs in {saved}): {}; stderr:\n{}",
            started.elapsed(),
            checker::check(&logs(consumers, None), EXPECTED, &[]).summary(),
            stderr_of(consumers)
        );
    }
    // At-least-once also means nothing stays pending: entries a zombie read would stay in its
    // pending list, unhandled.
    let mut pending = Vec::new();
    let drained = wait_until(Duration::from_secs(15), || {
        pending = cluster
            .client()
            .get_connection()
            .map_err(|e| e.to_string())
            .and_then(|mut conn| pending_per_shard_on(&mut conn))
            .unwrap_or_default();
        pending.len() == SHARDS as usize && pending.iter().all(|&n| n == 0)
    });
    if !drained {
        let saved = save_logs(
            "cluster-sigstop-pending",
            &consumers.iter().collect::<Vec<_>>(),
        );
        panic!(
            "entries stay pending after every message was handled (per shard {pending:?}; logs \
             in {saved}): read but never acked"
        );
    }
    let watched = watch.end();
    for consumer in consumers.iter_mut() {
        consumer.terminate(Duration::from_secs(20));
    }
    watched
}

/// Where Debian's `faketime` package puts the thread-safe libfaketime.
const LIBFAKETIME: [&str; 3] = [
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1",
    "/usr/local/lib/faketime/libfaketimeMT.so.1",
];

/// The clocks of one workload process, which the test can set back: the process runs under
/// libfaketime (`LD_PRELOAD`), which reads its offset from a file at every look at a clock
/// (`FAKETIME_NO_CACHE=1`) and applies it to every clock, the monotonic one (leases, timers) and
/// the wall clock (log times) alike. Set back by the length of a stop at the `SIGCONT`, the
/// process's clocks stand still while it is stopped, as a paused VM's can: its lease has not run
/// out when it continues, while the coordinator (Redis `TIME`) has seen it expire. Then the fence,
/// not the lease, is what stops it. The test undoes the offset in the process's log times
/// ([`SetBack`]).
struct FrozenClock {
    _dir: tempfile::TempDir,
    /// libfaketime's offset (`FAKETIME_TIMESTAMP_FILE`).
    offset: PathBuf,
    /// `exec`s the workload example under libfaketime (the same process id).
    wrapper: PathBuf,
}

impl FrozenClock {
    /// `None` when libfaketime is not installed.
    fn new() -> Option<FrozenClock> {
        let lib = LIBFAKETIME.iter().map(Path::new).find(|p| p.exists())?;
        let dir = tempfile::tempdir().expect("a temporary directory");
        let offset = dir.path().join("offset");
        std::fs::write(&offset, "+0\n").expect("write the offset");
        let wrapper = dir.path().join("workload");
        std::fs::write(
            &wrapper,
            format!(
                "#!/bin/sh\nLD_PRELOAD='{}' FAKETIME_TIMESTAMP_FILE='{}' FAKETIME_NO_CACHE=1 exec '{}' \"$@\"\n",
                lib.display(),
                offset.display(),
                workload_binary().display()
            ),
        )
        .expect("write the wrapper");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755))
            .expect("make the wrapper executable");
        Some(FrozenClock {
            _dir: dir,
            offset,
            wrapper,
        })
    }

    /// From the process's next look at its clocks on, they read `by` earlier.
    fn set_back(&self, by: Duration) {
        std::fs::write(&self.offset, format!("-{:.6}\n", by.as_secs_f64()))
            .expect("write the offset");
    }
}

/// `SIGSTOP` of a member process on a cluster for longer than its lease, then `SIGCONT`: the
/// others take its shards while it is stopped; once continued, the zombie never reads (nor starts
/// a handler on) a shard it lost until it is assigned that shard again, neither in its log nor in
/// Redis (no `XREADGROUP` nor `XCLAIM` under its members' names there, no entry added to their
/// pending lists); nothing is lost, nothing stays pending, and no shard is read by two members at
/// once. Its clocks run on while it is stopped, so it finds its lease gone when it continues:
/// mostly the lease stops it, and the fence only refuses an operation that the stop caught between
/// its lease check and its sending (printed).
#[test]
fn sigstop_of_a_member_process_past_its_lease_on_a_cluster_leaves_a_zombie_that_neither_reads_nor_claims()
 {
    sigstop_on_a_cluster(None);
}

/// As above, with the stopped process's clocks standing still while it is stopped
/// ([`FrozenClock`]): when it continues its lease seems valid to it for about a second more, so it
/// reads, acks and claims on, and the fence refuses it (at least one refusal is asserted). It does
/// finish the handler calls of entries it had read before the stop (nothing can tell it not to),
/// but starts none on an entry appended after the stop: it reads nothing, in its log or in Redis.
/// Needs libfaketime (Debian package `faketime`), hence ignored: run it with `--ignored`.
///
/// Open problem: in about half of the runs so far the continued process never joined the group
/// again within 20 s (alive and idle, its log silent after its fence rejections), and the test
/// fails at that wait (logs saved, `fault-logs-cluster-sigstop-rejoin-*`). Whether libfaketime
/// or the member runtime is at fault is not known yet. In every run that got past it, the fence
/// refused the zombie and it read and claimed nothing.
#[test]
#[ignore = "needs libfaketime: apt-get install faketime"]
fn sigstop_of_a_member_process_whose_clocks_stand_still_on_a_cluster_is_stopped_by_the_fence() {
    let clock = FrozenClock::new().unwrap_or_else(|| {
        panic!("no libfaketime (apt-get install faketime) at any of {LIBFAKETIME:?}")
    });
    sigstop_on_a_cluster(Some(&clock));
}

/// How much of the stop the process under a [`FrozenClock`] still sees: its times after the
/// `SIGCONT` stay apart from those before the `SIGSTOP`.
const SEEN_OF_THE_STOP: Duration = Duration::from_millis(20);

/// The scenario of both tests above; `clock`: the stopped process's clocks stand still.
fn sigstop_on_a_cluster(clock: Option<&FrozenClock>) {
    workload_binary(); // built (or found up to date) before the scenario's clock starts
    let test_started = Instant::now();
    let label = if clock.is_some() {
        "frozen clock"
    } else {
        "clock running"
    };
    let _serial = serial();
    let cluster = start_cluster();
    let mut consumers = start_consumers(&cluster, clock);
    let produced_from = now_us();
    let mut producer = cluster_producer(&cluster, KEYS, COUNT, RATE);

    // The process to stop is at work: each of its shards was read since the producer started.
    let victim_owned = owned_now(&consumers[0].lines());
    assert!(!victim_owned.is_empty());
    let working = wait_until(Duration::from_secs(15), || {
        victim_owned
            .keys()
            .all(|&shard| first_read_since(&[&consumers[0]], shard, produced_from).is_some())
    });
    assert!(
        working,
        "the process to stop did not read all its shards {victim_owned:?}; stderr:\n{}",
        stderr_of(&consumers)
    );
    assert_eq!(
        owned_now(&consumers[0].lines()),
        victim_owned,
        "the shards moved before the stop"
    );
    let zombie_members = members_of(&consumers[0]);
    let lost: Vec<u32> = victim_owned.keys().copied().collect();

    let stopped_us = now_us();
    consumers[0].signal("STOP");

    // The other members take every shard of the stopped process while it is stopped: they read
    // each one (after raising its fence and claiming the stopped members' pending entries).
    let others = [&consumers[1], &consumers[2]];
    let taken = wait_until(Duration::from_secs(20), || {
        lost.iter()
            .all(|&shard| first_read_since(&others, shard, stopped_us).is_some())
    });
    if !taken {
        let saved = save_logs(
            "cluster-sigstop-untaken",
            &consumers.iter().collect::<Vec<_>>(),
        );
        panic!(
            "the shards {lost:?} of the stopped process were not all read by another member \
             (logs in {saved}); stderr:\n{}",
            stderr_of(&consumers)
        );
    }
    let taken_ms: BTreeMap<u32, f64> = lost
        .iter()
        .map(|&shard| {
            let (at, _) = first_read_since(&others, shard, stopped_us).unwrap();
            (shard, ms(at - stopped_us))
        })
        .collect();

    // Redis before the SIGCONT, with the zombie frozen: its consumers on the shards it lost.
    let mut conn = cluster
        .client()
        .get_connection()
        .expect("connect to the cluster");
    let before: BTreeMap<u32, Look> = lost
        .iter()
        .map(|&shard| {
            (
                shard,
                look(&mut conn, shard).expect("a look before the SIGCONT"),
            )
        })
        .collect();
    let zombie_before: BTreeMap<u32, BTreeMap<&String, usize>> = before
        .iter()
        .map(|(&shard, look)| {
            let consumers = look
                .consumers
                .iter()
                .filter(|(name, _)| zombie_members.contains(*name))
                .map(|(name, c)| (name, c.pending))
                .collect();
            (shard, consumers)
        })
        .collect();
    reset_stats(&cluster);
    let watch = Watch::start(&cluster, lost.clone());

    let from_line = consumers[0].line_count();
    let set_back = clock.map(|clock| {
        let by = Duration::from_micros(now_us() - stopped_us).saturating_sub(SEEN_OF_THE_STOP);
        clock.set_back(by);
        SetBack {
            from_line,
            by_us: u64::try_from(by.as_micros()).unwrap_or(u64::MAX),
            fake_after_us: stopped_us + u64::try_from(SEEN_OF_THE_STOP.as_micros() / 2).unwrap(),
        }
    });
    let continued_us = now_us();
    consumers[0].signal("CONT");

    // The zombie learns it lost its shards and joins again: it is assigned shards anew.
    let rejoined = wait_until(Duration::from_secs(20), || {
        log_of(&consumers[0], set_back)
            .lines
            .iter()
            .any(|l| matches!(l, LogLine::Assigned(o) if o.ts_us >= continued_us))
    });
    if !rejoined {
        let saved = save_logs(
            "cluster-sigstop-rejoin",
            &consumers.iter().collect::<Vec<_>>(),
        );
        panic!(
            "the continued process was never assigned a shard again (logs in {saved}); \
             stderr:\n{}",
            consumers[0].stderr_text()
        );
    }
    let (looks, watch_errors) = finish(&cluster, &mut producer, &mut consumers, watch);
    let refused_reads = refused_strict_reads(&cluster);

    let stop = Stop {
        process: 0,
        stopped_us,
        continued_us,
    };
    let report = checker::check(&logs(&consumers, set_back), EXPECTED, &[stop]);
    let zombie_lines = log_of(&consumers[0], set_back).lines;
    let zombie = zombie_log(&zombie_lines, &victim_owned, stopped_us, continued_us);
    let verdict = judge(
        &before,
        &looks,
        &zombie_lines,
        &zombie_members,
        continued_us,
    );
    // With its clocks standing still, the zombie finishes the handler calls of the entries it
    // had when it was stopped: entries appended before the stop. Any other entry it could only
    // have got by reading after the SIGCONT.
    let (in_hand, handler_starts): (Vec<_>, Vec<_>) = zombie.handler_starts.iter().partition(|h| {
        clock.is_some()
            && h.call
                .entry_id
                .split('-')
                .next()
                .and_then(|ms| ms.parse::<u64>().ok())
                .is_some_and(|ms| ms * 1000 < stopped_us)
    });
    let reassigned: BTreeMap<u32, f64> = victim_owned
        .iter()
        .filter_map(|(&shard, member)| {
            assigned_again(&zombie_lines, member, shard, continued_us)
                .map(|at| (shard, ms(at - continued_us)))
        })
        .collect();
    eprintln!(
        "SIGSTOP member (cluster, {label}): {}; the stopped process owned {victim_owned:?}; \
         stopped for {:.0} ms; its shards first read by another member after (ms from the stop) \
         {taken_ms:?}; assigned again to the same member after (ms from the SIGCONT) \
         {reassigned:?}; handler calls spanning the stop: {}; handler calls the zombie started \
         after SIGCONT on entries it had before the stop: {}; fence rejections the zombie logged \
         after SIGCONT: {} {:?} by shard {:?}, of which refused the zombie on a shard it lost: \
         {}; strict reads refused in Redis after SIGCONT (every member): {refused_reads}; the \
         zombie's consumers on its lost shards before the SIGCONT (pending): {zombie_before:?}; \
         Redis looks: {} ({} at the zombie's consumers before their reassignment, {} errors); \
         scenario time {:.1} s",
        report.summary(),
        ms(continued_us - stopped_us),
        zombie.spanning,
        in_hand.len(),
        zombie.rejections(),
        zombie.fence_rejections,
        zombie.fence_rejections_by_shard,
        zombie.zombie_rejections,
        looks.len(),
        verdict.judged,
        watch_errors.len(),
        test_started.elapsed().as_secs_f64()
    );
    if !report.ok() {
        let saved = save_logs("cluster-sigstop", &consumers.iter().collect::<Vec<_>>());
        eprintln!("cluster-sigstop: logs saved in {saved}");
    }
    report.assert_ok();
    let mut violations: Vec<String> = zombie
        .reads
        .iter()
        .map(|r| format!("zombie read after SIGCONT: {r:?}"))
        .collect();
    violations.extend(
        handler_starts
            .iter()
            .map(|h| format!("zombie started a handler after SIGCONT: {h:?}")),
    );
    violations.extend(verdict.violations.iter().map(|v| format!("in Redis: {v}")));
    if !violations.is_empty() {
        let saved = save_logs("cluster-zombie", &consumers.iter().collect::<Vec<_>>());
        panic!("the continued process kept working (logs in {saved}): {violations:#?}");
    }
    assert!(
        zombie.spanning <= victim_owned.len(),
        "more handler calls spanned the stop ({}) than the stopped process had shards",
        zombie.spanning
    );
    // The looks are worth something: they were taken, and they saw the owners read.
    assert!(
        verdict.judged > 0 && watch_errors.is_empty(),
        "the watch judged {} looks; errors: {watch_errors:?}",
        verdict.judged
    );
    assert_eq!(
        verdict.readers_seen,
        lost.iter().copied().collect::<BTreeSet<u32>>(),
        "the looks did not see a read of every lost shard after the SIGCONT"
    );
    if clock.is_some() {
        assert!(
            zombie.zombie_rejections > 0,
            "with its clocks standing still the zombie met no fence: did libfaketime set its \
             clocks back? ({} fence rejections after SIGCONT in all)",
            zombie.rejections()
        );
    }
}
