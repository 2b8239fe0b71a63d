//! `rebalance`: membership changes under a steady load.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::*;
use stream_listener_core::handler::{Delivery, HandlerError};
use stream_listener_core::internals::admin::{self, GroupDescription};
use stream_listener_core::internals::assignor::{self, AssignorMember};
use stream_listener_core::internals::connection::{RedisConnection, RedisTarget};
use stream_listener_core::member::{Listener, ListenerHandle, ListenerOptions};
use stream_listener_core::producer::{Publisher, PublisherOptions, shard_for_key};

pub(crate) const RB_PREFIX: &str = "rb";
pub(crate) const RB_GROUP: &str = "g";
pub(crate) const RB_SHARDS: u32 = 12;

pub(crate) struct Starts {
    /// Handler start times per shard.
    pub(crate) per_shard: Vec<Vec<Instant>>,
    pub(crate) ids: HashSet<String>,
}

pub(crate) type StartLog = Arc<Mutex<Starts>>;

pub(crate) async fn start_member(
    target: &RedisTarget,
    log: &StartLog,
    name: &str,
) -> ListenerHandle {
    let mut options = ListenerOptions::default();
    options.name = name.to_owned();
    options.concurrency = 1;
    options.coordination = coordination();
    options.block = Duration::from_secs(2);
    let log = log.clone();
    let handler = move |d: Delivery| {
        {
            let mut l = log.lock().unwrap();
            l.per_shard[d.shard as usize].push(Instant::now());
            l.ids.insert(format!("{}/{}", d.shard, d.entry_id));
        }
        async { Ok::<(), HandlerError>(()) }
    };
    Listener::new(target.clone(), RB_PREFIX, RB_GROUP, handler, options)
        .unwrap()
        .start()
        .await
        .unwrap()
}

/// Longest gap between consecutive handler starts of `shard` among starts in `[from, to]`,
/// counting the gap from the last start before `from` when `across` (a stall beginning at the
/// change).
pub(crate) fn longest_gap(
    starts: &[Instant],
    from: Instant,
    to: Instant,
    across: bool,
) -> Duration {
    let mut prev: Option<Instant> = if across {
        starts.iter().rev().find(|t| **t < from).copied()
    } else {
        None
    };
    let mut longest = Duration::ZERO;
    for t in starts.iter().filter(|t| **t >= from && **t <= to) {
        if let Some(p) = prev {
            longest = longest.max(*t - p);
        }
        prev = Some(*t);
    }
    // A shard with no start until `to` is stalled for at least that long.
    if let Some(p) = prev {
        longest = longest.max(to.saturating_duration_since(p));
    }
    longest
}

/// A membership change of the rebalance run: which member joins, leaves or crashes.
enum Change {
    Join(&'static str),
    Leave(&'static str),
    Abort(&'static str),
}

pub(crate) struct PhaseReport {
    pub(crate) name: &'static str,
    pub(crate) moved: usize,
    pub(crate) minimum: usize,
    pub(crate) matches_assignor: bool,
    pub(crate) stable_after: Duration,
    pub(crate) worst_ratio: f64,
    pub(crate) worst_shard: u32,
    pub(crate) before_max: Duration,
    pub(crate) after_max: Duration,
    pub(crate) not_moved: usize,
    pub(crate) shards_over_goal: usize,
    pub(crate) moved_resume: Duration,
}

#[allow(clippy::too_many_arguments)]
pub(crate) async fn measure_change(
    name: &'static str,
    conn: &mut RedisConnection,
    log: &StartLog,
    before: &GroupDescription,
    t_change: Instant,
    members_after: usize,
) -> (PhaseReport, GroupDescription) {
    let after = wait_converged(
        conn,
        RB_PREFIX,
        RB_GROUP,
        members_after,
        Duration::from_secs(90),
    )
    .await
    .expect("converged after change");
    let stable_after = t_change.elapsed();
    // Observe one more second of steady state after convergence.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let t_end = Instant::now();
    let prev = target_of(before);
    let next = target_of(&after);
    let members: Vec<AssignorMember> = after
        .members
        .iter()
        .map(|m| AssignorMember {
            member_id: m.member_id.clone(),
            weight: m.runtime_max_concurrency,
        })
        .collect();
    let readable: BTreeSet<u32> = after.readable_shard_set.iter().copied().collect();
    let expected = assignor::assign(&readable, &members, &prev);
    let moved = assignor::moved_shards(&prev, &next)
        + prev.keys().filter(|s| !next.contains_key(s)).count();
    let minimum = assignor::moved_shards(&prev, &expected);
    let starts = log.lock().unwrap().per_shard.clone();
    let window_start = t_change - Duration::from_secs(10);
    let mut worst_ratio = 0.0;
    let mut worst_shard = 0;
    let mut before_max = Duration::ZERO;
    let mut after_max = Duration::ZERO;
    let mut not_moved = 0;
    let mut over = 0;
    let mut moved_resume = Duration::ZERO;
    for shard in 0..RB_SHARDS {
        let s = &starts[shard as usize];
        if prev.get(&shard) == next.get(&shard) {
            not_moved += 1;
            let b = longest_gap(s, window_start, t_change, false);
            let a = longest_gap(s, t_change, t_end, true);
            before_max = before_max.max(b);
            after_max = after_max.max(a);
            let ratio = a.as_secs_f64() / b.as_secs_f64().max(1e-6);
            if ratio > 2.0 {
                over += 1;
            }
            if ratio > worst_ratio {
                worst_ratio = ratio;
                worst_shard = shard;
            }
        } else {
            moved_resume = moved_resume.max(longest_gap(s, t_change, t_end, true));
        }
    }
    (
        PhaseReport {
            name,
            moved,
            minimum,
            matches_assignor: expected == next,
            stable_after,
            worst_ratio,
            worst_shard,
            before_max,
            after_max,
            not_moved,
            shards_over_goal: over,
            moved_resume,
        },
        after,
    )
}

pub(crate) async fn rebalance(target: RedisTarget, label: &str) {
    let mut conn = connect(&target).await;
    admin::create_stream(&mut conn, RB_PREFIX, RB_SHARDS)
        .await
        .unwrap();
    let log: StartLog = Arc::new(Mutex::new(Starts {
        per_shard: vec![Vec::new(); RB_SHARDS as usize],
        ids: HashSet::new(),
    }));
    // One key per shard, so each batch of 12 puts one entry on every shard.
    let mut shard_keys: Vec<Option<String>> = vec![None; RB_SHARDS as usize];
    let mut n = 0;
    while shard_keys.iter().any(Option::is_none) {
        let k = format!("key-{n}");
        let s = shard_for_key(&k, RB_SHARDS) as usize;
        if shard_keys[s].is_none() {
            shard_keys[s] = Some(k);
        }
        n += 1;
    }
    let shard_keys: Vec<String> = shard_keys.into_iter().map(Option::unwrap).collect();
    let mut handles: BTreeMap<&'static str, ListenerHandle> = BTreeMap::new();
    for name in ["a", "b", "c"] {
        handles.insert(name, start_member(&target, &log, name).await);
    }
    let mut d = wait_converged(&mut conn, RB_PREFIX, RB_GROUP, 3, Duration::from_secs(60))
        .await
        .expect("3 members converged");
    // Steady load: one entry per shard every 10 ms (1,200 msg/s).
    let publisher = Publisher::new(conn.clone(), RB_PREFIX, PublisherOptions::default())
        .await
        .unwrap();
    let stop = Arc::new(AtomicUsize::new(0));
    let published = Arc::new(AtomicU64::new(0));
    let load = {
        let stop = stop.clone();
        let published = published.clone();
        tokio::spawn(async move {
            let mut interval = tokio::time::interval(Duration::from_millis(10));
            let mut seq = 0u64;
            while stop.load(Ordering::Relaxed) == 0 {
                interval.tick().await;
                let batch: Vec<(&String, u64)> = shard_keys
                    .iter()
                    .map(|k| {
                        seq += 1;
                        (k, seq)
                    })
                    .collect();
                publisher.publish_batch(&batch).await.expect("publish");
                published.fetch_add(batch.len() as u64, Ordering::Relaxed);
            }
        })
    };
    tokio::time::sleep(Duration::from_secs(10)).await;
    let mut reports = Vec::new();

    // 3 -> 4, 4 -> 3 by graceful leave, 3 -> 4 again, 4 -> 3 by a crash (abort: no leave, shards
    // move when the lease runs out); 10 s of steady load before each.
    let changes = [
        ("3 → 4 (join)", Change::Join("d"), 4),
        ("4 → 3 (graceful leave)", Change::Leave("a"), 3),
        ("3 → 4 (join)", Change::Join("e"), 4),
        ("4 → 3 (abort, lease 10 s)", Change::Abort("b"), 3),
    ];
    for (i, (name, change, members_after)) in changes.into_iter().enumerate() {
        if i > 0 {
            tokio::time::sleep(Duration::from_secs(10)).await;
        }
        let t = Instant::now();
        let leave = match change {
            Change::Join(member) => {
                handles.insert(member, start_member(&target, &log, member).await);
                None
            }
            Change::Leave(member) => {
                let leaving = handles.remove(member).unwrap();
                Some(tokio::spawn(leaving.shutdown_and_wait()))
            }
            Change::Abort(member) => {
                handles.remove(member).unwrap().abort();
                None
            }
        };
        let (r, after) = measure_change(name, &mut conn, &log, &d, t, members_after).await;
        reports.push(r);
        d = after;
        if let Some(leave) = leave {
            leave.await.unwrap().expect("clean shutdown");
        }
    }

    stop.store(1, Ordering::Relaxed);
    load.await.unwrap();
    let total = published.load(Ordering::Relaxed);
    let deadline = Instant::now() + Duration::from_secs(30);
    while (log.lock().unwrap().ids.len() as u64) < total && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let handled = log.lock().unwrap().ids.len() as u64;
    let calls: usize = log.lock().unwrap().per_shard.iter().map(Vec::len).sum();
    for (_, h) in handles {
        h.shutdown_and_wait().await.expect("clean shutdown");
    }
    println!(
        "\n[{label}] rebalance under load, 12 shards, 1,200 msg/s, heartbeat 1 s, lease 10 s (load {})",
        load_average()
    );
    println!(
        "| change | shards moved | assignor minimum | = assignor's target | time to STABLE + converged | shards not moved | longest gap before (10 s), max over them | longest gap after, max over them | worst per-shard ratio (shard) | shards over 2× | moved shards: longest gap |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for r in &reports {
        println!(
            "| {} | {} | {} | {} | {:.2} s | {} | {:.0} ms | {:.0} ms | {:.2} ({}) | {} | {:.2} s |",
            r.name,
            r.moved,
            r.minimum,
            if r.matches_assignor { "yes" } else { "no" },
            r.stable_after.as_secs_f64(),
            r.not_moved,
            r.before_max.as_secs_f64() * 1000.0,
            r.after_max.as_secs_f64() * 1000.0,
            r.worst_ratio,
            r.worst_shard,
            r.shards_over_goal,
            r.moved_resume.as_secs_f64()
        );
    }
    println!(
        "[{label}] published {total}, distinct entries handled {handled} (lost: {}), handler calls {calls} (repeats: {})",
        total.saturating_sub(handled),
        calls as u64 - handled
    );
}
