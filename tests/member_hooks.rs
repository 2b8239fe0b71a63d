//! Lifecycle hooks and ownership (docs/design.md §13.3), with real Redis and, for the protocol's
//! order guarantees, real member processes (`workload consume --log-hooks`):
//!
//! - across a rebalance and a graceful shutdown, per member and shard: `on_assigned` before the
//!   first handler; `on_revoked` after the last handler and its ack (none of the ids handled in
//!   that ownership is pending when it starts), before the release (the next owner's first
//!   handler starts after it ended; the `revoked` event comes after it); no `on_lost`;
//! - hooks that panic, return errors or hang past `hook_timeout` leave the members running:
//!   every entry is handled, shards still move, the processes exit cleanly;
//! - a member frozen (`SIGSTOP`) past its lease and then resumed calls `on_lost` for each shard
//!   it owned, not `on_revoked`;
//! - `Delivery::still_owned()` turns false and the ownership token fires when the shard is
//!   revoked, so a long handler can stop early.
//!
//! Timings: heartbeat 200 ms, lease 1.5 s, rebalance timeout 3 s.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use stream_listener::core::handler::{Delivery, HandlerError};
use stream_listener::testing::workload::{HookCall, LogLine};
use support::*;

/// What one ownership (tenure) of a shard by a member looked like in that member's log.
#[derive(Debug, Default)]
struct Tenure {
    assigned: Option<HookCall>,
    /// Entry ids handled with success, in log order.
    handled: Vec<String>,
    /// `on_revoked` or `on_lost`.
    end: Option<HookCall>,
    /// Whether the `revoked` event came before the end hook (it must not for `on_revoked`).
    released_before_end: bool,
    /// Whether a handler line came after the end hook.
    handled_after_end: bool,
}

/// The tenures of `member` on each shard, from its log in write order. A hook line and a
/// handler line of one shard are written by the shard's own task, so their order in the log is
/// the order they happened in.
fn tenures(lines: &[LogLine], member: &str) -> BTreeMap<u32, Vec<Tenure>> {
    let mut all: BTreeMap<u32, Vec<Tenure>> = BTreeMap::new();
    for line in lines.iter().filter(|l| l.member() == member) {
        match line {
            LogLine::Hook(h) if h.hook == "on_assigned" => {
                all.entry(h.shard).or_default().push(Tenure {
                    assigned: Some(h.clone()),
                    ..Tenure::default()
                });
            }
            LogLine::Hook(h) => {
                let tenure = current(&mut all, h.shard, line);
                assert!(
                    tenure.end.is_none(),
                    "two end hooks in one tenure: {line:?}"
                );
                tenure.end = Some(h.clone());
            }
            LogLine::Handled(h) if h.ok => {
                let tenure = current(&mut all, h.call.shard, line);
                if tenure.end.is_some() {
                    tenure.handled_after_end = true;
                }
                tenure.handled.push(h.call.entry_id.clone());
            }
            LogLine::Revoked(o) => {
                if let Some(tenure) = all.get_mut(&o.shard).and_then(|t| t.last_mut())
                    && tenure.end.is_none()
                {
                    tenure.released_before_end = true;
                }
            }
            _ => {}
        }
    }
    all
}

/// The open tenure of `shard`: a hook or handler line before any `on_assigned` fails the test.
fn current<'a>(
    all: &'a mut BTreeMap<u32, Vec<Tenure>>,
    shard: u32,
    line: &LogLine,
) -> &'a mut Tenure {
    all.get_mut(&shard)
        .and_then(|t| t.last_mut())
        .unwrap_or_else(|| panic!("a line before the shard's on_assigned: {line:?}"))
}

/// Asserts every tenure of `member` that ended in order: `on_revoked` after its last handler,
/// with none of its handled ids pending, before the release; returns the `on_revoked` calls by
/// shard, in order.
fn assert_revoked_in_order(lines: &[LogLine], member: &str) -> BTreeMap<u32, Vec<HookCall>> {
    let mut revoked: BTreeMap<u32, Vec<HookCall>> = BTreeMap::new();
    for (shard, tenures) in tenures(lines, member) {
        for tenure in tenures {
            let Some(end) = tenure.end else { continue };
            assert_eq!(end.hook, "on_revoked", "shard {shard} of {member}: {end:?}");
            assert_eq!(
                tenure.assigned.as_ref().map(|a| a.member_epoch),
                Some(end.member_epoch),
                "shard {shard} of {member}: one ownership, one epoch"
            );
            assert!(
                !tenure.handled_after_end,
                "shard {shard} of {member}: a handler ran after on_revoked"
            );
            assert!(
                !tenure.released_before_end,
                "shard {shard} of {member}: released before on_revoked"
            );
            let acked_late: Vec<&String> = tenure
                .handled
                .iter()
                .filter(|id| end.pending_ids.contains(id))
                .collect();
            assert!(
                acked_late.is_empty(),
                "shard {shard} of {member}: handled entries still pending when on_revoked started: {acked_late:?}"
            );
            revoked.entry(shard).or_default().push(end);
        }
    }
    revoked
}

fn hook_calls<'a>(lines: &'a [LogLine], hook: &'a str) -> impl Iterator<Item = &'a HookCall> + 'a {
    lines.iter().filter_map(move |l| match l {
        LogLine::Hook(h) if h.hook == hook => Some(h),
        _ => None,
    })
}

/// The first handler start of `member` on `shard` at or after `after_us`.
fn first_start(recorder: &Recorder, member: &str, shard: u32, after_us: u64) -> Option<u64> {
    recorder
        .calls()
        .iter()
        .filter(|c| c.member == member && c.shard == shard && c.at_us >= after_us)
        .map(|c| c.at_us)
        .min()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hooks_fire_in_order_across_a_rebalance_and_a_shutdown_of_real_processes() {
    let (_serial, server, _target, mut conn, recorder) = Context::serial(4).await.parts();
    // Each hook takes 200 ms: a release that did not wait for `on_revoked` shows as a next
    // owner starting before the hook ended.
    let flags = ["--log-hooks", "--hook-ms", "200", "--handler-ms", "5"];
    let mut a = MemberProcess::spawn(&server.url(), &flags, recorder.clone());
    let a_id = a.members[0].clone();
    settle(&mut conn, 1, Duration::from_secs(20)).await;
    let publisher = SteadyPublisher::start(
        server.client(),
        (0..4).collect(),
        Duration::from_millis(20),
        0,
    );
    let started = now_us();
    let all_served = wait_until(Duration::from_secs(10), || {
        (0..4).all(|s| first_start(&recorder, &a_id, s, started).is_some())
    })
    .await;
    assert!(all_served, "the first member handles every shard");
    let mut b = MemberProcess::spawn(&server.url(), &flags, recorder.clone());
    let b_id = b.members[0].clone();
    let group = settle(&mut conn, 2, Duration::from_secs(20)).await;
    let moved: BTreeSet<u32> = target_shards(&group, &b_id);
    assert_eq!(moved.len(), 2, "{group:#?}");
    let b_served = wait_until(Duration::from_secs(10), || {
        moved
            .iter()
            .all(|s| first_start(&recorder, &b_id, *s, 0).is_some())
    })
    .await;
    assert!(b_served, "the new member handles the shards it was given");
    let published = publisher.stop();
    assert_nothing_lost(&recorder, &published, Duration::from_secs(15)).await;
    // B gives its shards up at shutdown: on_revoked for each, in order.
    assert!(b.terminate_in_place(), "the second member exits cleanly");
    // A takes the moved shards back (on_assigned again) before it shuts down too.
    settle(&mut conn, 1, Duration::from_secs(20)).await;
    let taken_back = wait_until(Duration::from_secs(10), || {
        let lines = a.lines();
        hook_calls(&lines, "on_assigned").count() == 4 + moved.len()
    })
    .await;
    assert!(taken_back, "A is assigned the moved shards again");
    assert!(a.terminate_in_place(), "the first member exits cleanly");

    let a_lines = a.lines();
    let b_lines = b.lines();
    let a_revoked = assert_revoked_in_order(&a_lines, &a_id);
    let b_revoked = assert_revoked_in_order(&b_lines, &b_id);
    assert_eq!(hook_calls(&a_lines, "on_lost").count(), 0, "{a_lines:?}");
    assert_eq!(hook_calls(&b_lines, "on_lost").count(), 0, "{b_lines:?}");
    // A: assigned all 4 shards, revoked the moved ones at the rebalance, assigned them again
    // when B left, and revoked all 4 at its shutdown. B: assigned the moved ones, revoked them
    // at its shutdown. Every ownership ended with on_revoked.
    let count = |lines: &[LogLine], hook: &str, shard: u32| {
        hook_calls(lines, hook).filter(|h| h.shard == shard).count()
    };
    for shard in 0..4 {
        let times = if moved.contains(&shard) { 2 } else { 1 };
        assert_eq!(
            count(&a_lines, "on_assigned", shard),
            times,
            "A, shard {shard}"
        );
        assert_eq!(
            a_revoked.get(&shard).map_or(0, Vec::len),
            times,
            "A, shard {shard}"
        );
        let times = usize::from(moved.contains(&shard));
        assert_eq!(
            count(&b_lines, "on_assigned", shard),
            times,
            "B, shard {shard}"
        );
        assert_eq!(
            b_revoked.get(&shard).map_or(0, Vec::len),
            times,
            "B, shard {shard}"
        );
    }
    // The release waited for A's on_revoked: B's first handler on a moved shard started after
    // that hook ended, and after B's own on_assigned ended.
    for shard in &moved {
        let revoked_at = a_revoked[shard][0].ts_us;
        let b_assigned = hook_calls(&b_lines, "on_assigned")
            .find(|h| h.shard == *shard)
            .unwrap();
        let first = first_start(&recorder, &b_id, *shard, 0).unwrap();
        assert!(
            first >= revoked_at && first >= b_assigned.ts_us,
            "shard {shard}: B's first handler at {first}, A's on_revoked ended at {revoked_at}, B's on_assigned at {}",
            b_assigned.ts_us
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn panicking_erroring_and_hanging_hooks_leave_the_members_running() {
    let (_serial, server, _target, mut conn, recorder) = Context::serial(4).await.parts();
    let mut a = MemberProcess::spawn(
        &server.url(),
        &["--log-hooks", "--hook-fail", "panic"],
        recorder.clone(),
    );
    let a_id = a.members[0].clone();
    settle(&mut conn, 1, Duration::from_secs(20)).await;
    let publisher = SteadyPublisher::start(
        server.client(),
        (0..4).collect(),
        Duration::from_millis(20),
        0,
    );
    // B's hooks would take a minute: hook_timeout (300 ms) abandons them.
    let mut b = MemberProcess::spawn(
        &server.url(),
        &[
            "--log-hooks",
            "--hook-ms",
            "60000",
            "--hook-timeout-ms",
            "300",
        ],
        recorder.clone(),
    );
    let b_id = b.members[0].clone();
    let group = settle(&mut conn, 2, Duration::from_secs(20)).await;
    let to_b: BTreeSet<u32> = target_shards(&group, &b_id);
    let mut c = MemberProcess::spawn(
        &server.url(),
        &["--log-hooks", "--hook-fail", "error"],
        recorder.clone(),
    );
    let c_id = c.members[0].clone();
    let group = settle(&mut conn, 3, Duration::from_secs(20)).await;
    for member in [&a_id, &b_id, &c_id] {
        let shards: BTreeSet<u32> = target_shards(&group, member);
        let served = wait_until(Duration::from_secs(10), || {
            shards
                .iter()
                .all(|s| first_start(&recorder, member, *s, 0).is_some())
        })
        .await;
        assert!(
            served,
            "{member} handles its shards {shards:?} despite its hooks"
        );
    }
    let published = publisher.stop();
    assert_nothing_lost(&recorder, &published, Duration::from_secs(15)).await;
    for (name, process) in [("a", &mut a), ("b", &mut b), ("c", &mut c)] {
        assert!(
            process.terminate_in_place(),
            "member process {name} exits cleanly"
        );
    }
    // The failing hooks did run (each logs before it fails); B's never finished, so it logged
    // none, yet its shards moved to it and were handled.
    let a_lines = a.lines();
    let c_lines = c.lines();
    assert_eq!(
        hook_calls(&a_lines, "on_assigned").count(),
        4,
        "{a_lines:?}"
    );
    assert!(
        hook_calls(&a_lines, "on_revoked").count() >= 2,
        "{a_lines:?}"
    );
    assert!(
        hook_calls(&c_lines, "on_assigned").count() >= 1,
        "{c_lines:?}"
    );
    assert_eq!(hook_calls(&b.lines(), "on_assigned").count(), 0);
    assert!(!to_b.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_frozen_past_its_lease_calls_on_lost_not_on_revoked() {
    let (_serial, server, _target, mut conn, recorder) = Context::serial(4).await.parts();
    let mut a = MemberProcess::spawn(&server.url(), &["--log-hooks"], recorder.clone());
    let a_id = a.members[0].clone();
    let mut b = MemberProcess::spawn(&server.url(), &["--log-hooks"], recorder.clone());
    let b_id = b.members[0].clone();
    let group = settle(&mut conn, 2, Duration::from_secs(20)).await;
    let a_shards: BTreeSet<u32> = target_shards(&group, &a_id);
    assert_eq!(a_shards.len(), 2);
    let assigned = wait_until(Duration::from_secs(10), || {
        let lines = a.lines();
        a_shards
            .iter()
            .all(|s| hook_calls(&lines, "on_assigned").any(|h| h.shard == *s))
    })
    .await;
    assert!(assigned);
    // A's log from here on: what the freeze did.
    let before_freeze = a.lines().len();
    a.freeze();
    // A's lease runs out: B is given every shard.
    let (group, moved) = wait_for_group(&mut conn, Duration::from_secs(20), |g| {
        target_shards::<BTreeSet<u32>>(g, &b_id).len() == 4 && converged(g)
    })
    .await;
    assert!(moved, "{group:#?}");
    a.thaw();
    let lost = wait_until(Duration::from_secs(10), || {
        hook_calls(&a.lines()[before_freeze..], "on_lost").count() == a_shards.len()
    })
    .await;
    let lines = a.lines()[before_freeze..].to_vec();
    assert!(lost, "on_lost for each of {a_shards:?}: {lines:?}");
    let lost: BTreeSet<u32> = hook_calls(&lines, "on_lost").map(|h| h.shard).collect();
    assert_eq!(lost, a_shards);
    assert_eq!(
        hook_calls(&lines, "on_revoked").count(),
        0,
        "a shard lost without a release is not revoked: {lines:?}"
    );
    for process in [&mut a, &mut b] {
        assert!(process.terminate_in_place());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn still_owned_turns_false_and_the_token_fires_when_the_shard_is_revoked() {
    let (_serial, _server, target, mut conn, _recorder) = Context::serial(2).await.parts();
    // (shard, still owned when the token fired, waited) per handler that saw its ownership end.
    let ended: Arc<Mutex<Vec<(u32, bool, Duration)>>> = Arc::default();
    let handler = {
        let ended = ended.clone();
        move |delivery: Delivery| {
            let ended = ended.clone();
            async move {
                assert!(delivery.still_owned());
                let started = Instant::now();
                let token = delivery.ownership_token();
                tokio::select! {
                    _ = token.cancelled() => {}
                    _ = tokio::time::sleep(Duration::from_secs(30)) => {}
                }
                ended.lock().unwrap().push((
                    delivery.shard,
                    delivery.still_owned(),
                    started.elapsed(),
                ));
                Ok::<(), HandlerError>(())
            }
        }
    };
    let mut options = options(1);
    // Both shards' handlers run at once.
    options.runtime_max_concurrency = 2;
    let first = start_listener(&target, handler.clone(), options.clone()).await;
    settle(&mut conn, 1, Duration::from_secs(20)).await;
    let client = redis::Client::open(_server.url()).unwrap();
    let mut sync = client.get_connection().unwrap();
    xadd_sync(&mut sync, 0, 1);
    xadd_sync(&mut sync, 1, 2);
    // Both handlers are waiting (nothing ended yet) when the second listener joins.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(ended.lock().unwrap().is_empty());
    let joined_at = Instant::now();
    let second = start_listener(&target, handler, options).await;
    let group = settle(&mut conn, 2, Duration::from_secs(20)).await;
    let moved: Vec<u32> = target_shards(&group, &second.member_ids()[0]);
    assert_eq!(moved.len(), 1);
    let one_ended = wait_until(Duration::from_secs(10), || {
        !ended.lock().unwrap().is_empty()
    })
    .await;
    assert!(one_ended);
    {
        let ended = ended.lock().unwrap();
        assert_eq!(ended.len(), 1, "{ended:?}");
        let (shard, owned, waited) = ended[0];
        assert_eq!((shard, owned), (moved[0], false));
        assert!(
            waited < joined_at.elapsed() + Duration::from_millis(300)
                && waited < Duration::from_secs(10),
            "{waited:?}"
        );
    }
    // At shutdown the kept shard's drain fires its token too: no 30 s wait.
    let shutdown = Instant::now();
    first.shutdown_and_wait().await.expect("clean shutdown");
    assert!(
        shutdown.elapsed() < Duration::from_secs(10),
        "{:?}",
        shutdown.elapsed()
    );
    let ended = ended.lock().unwrap().clone();
    assert_eq!(ended.len(), 2, "{ended:?}");
    assert!(!ended[1].1);
    drop(ended);
    second.shutdown_and_wait().await.expect("clean shutdown");
}

/// A drain whose last ack cannot be written ends the ownership with `on_lost`, not
/// `on_revoked`: Redis refuses the ack (the ACL takes `EVALSHA`, `EVAL` and `XACK` from the
/// member's user), so the handled entry stays pending and the next owner handles it again.
/// An `on_revoked` there would tell the application to commit side state for an entry that was
/// never acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_whose_last_ack_fails_calls_on_lost_not_on_revoked() {
    let (_serial, server, target, mut conn, _recorder) = Context::serial(1).await.parts();
    let ends: Arc<Mutex<Vec<&'static str>>> = Arc::default();
    let started = Arc::new(tokio::sync::Notify::new());
    let release = Arc::new(tokio::sync::Notify::new());
    let handler = {
        let (started, release) = (started.clone(), release.clone());
        move |_: Delivery| {
            let (started, release) = (started.clone(), release.clone());
            async move {
                started.notify_one();
                release.notified().await;
                Ok::<(), HandlerError>(())
            }
        }
    };
    let mut options = options(1);
    for (kind, name) in [(true, "on_revoked"), (false, "on_lost")] {
        let ends = ends.clone();
        let hook = move |_cx: stream_listener::core::hooks::ShardHookContext| {
            let ends = ends.clone();
            async move {
                ends.lock().unwrap().push(name);
                Ok::<(), String>(())
            }
        };
        if kind {
            options.hooks.on_revoked(hook);
        } else {
            options.hooks.on_lost(hook);
        }
    }
    let listener = start_listener(&target, handler, options).await;
    settle(&mut conn, 1, Duration::from_secs(20)).await;
    let client = redis::Client::open(server.url()).unwrap();
    let mut sync = client.get_connection().unwrap();
    xadd_sync(&mut sync, 0, 1);
    started.notified().await;
    // The drain starts while the handler runs; then Redis refuses writes and the handler ends.
    listener.shutdown();
    let mut acl = |rules: &[&str]| {
        let _: () = redis::cmd("ACL")
            .arg("SETUSER")
            .arg("default")
            .arg(rules)
            .query(&mut sync)
            .unwrap();
    };
    acl(&["-evalsha", "-eval", "-xack"]);
    release.notify_one();
    let ended = wait_until(Duration::from_secs(10), || !ends.lock().unwrap().is_empty()).await;
    acl(&["+@all"]);
    assert!(ended, "no end hook within 10 s");
    let pending: (u64, Option<String>, Option<String>, redis::Value) = redis::cmd("XPENDING")
        .arg(format!("{{{STREAM}:0}}"))
        .arg(GROUP)
        .query(&mut sync)
        .unwrap();
    assert_eq!(pending.0, 1, "the handled entry was acked after all");
    // The leave follows the end hook at once, so the ACL usually refuses it too (it is restored
    // only once the hook was seen): then the shutdown reports it. Nothing else may go wrong.
    match listener.join().await {
        Ok(()) | Err(stream_listener::core::member::ShutdownError::LeaveNotDelivered { .. }) => {}
        Err(other) => panic!("{other:?}"),
    }
    assert_eq!(*ends.lock().unwrap(), ["on_lost"]);
}
