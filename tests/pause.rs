//! Pause and resume on real Redis (docs/design.md §14.4):
//!
//! - `ListenerHandle::pause` for longer than the lease: no handler runs, the heartbeats keep the
//!   assignment (same member epoch, same shards, no revoke), the members stay ready and say they
//!   are paused; after `resume` every entry published meanwhile is handled, in order per shard;
//! - a paused shard that is revoked (a second member joins) is released at once and its entries
//!   are handled by the new owner while the first member is still paused;
//! - `HandlerError::pause_shard`: the entry is tried again only after the pause (never before
//!   it), with the same attempt number, and acked; with `max_attempts = 1` it is not
//!   dead-lettered; the member's other shard keeps going during the pause, and a pause longer
//!   than the lease keeps the shard (heartbeats go on).

mod support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use stream_listener::core::handler::HandlerError;
use stream_listener::core::member::ListenerHandle;
use support::*;

fn payload(n: u64) -> String {
    format!(r#"{{"n":{n}}}"#)
}

/// The `Revoked` events seen so far.
fn revokes(recorder: &Recorder) -> usize {
    recorder
        .events()
        .iter()
        .filter(|e| matches!(e, Ev::Revoked { .. }))
        .count()
}

/// `(epoch, owned shards)` of every member of `handle`.
fn assignment(handle: &ListenerHandle) -> Vec<(i64, Vec<u32>)> {
    handle
        .status()
        .into_iter()
        .map(|s| (s.member_epoch, s.owned))
        .collect()
}

/// The message numbers handled on `shard`, in the order their (successful) calls started.
fn handled_order(recorder: &Recorder, shard: u32) -> Vec<u64> {
    let done: std::collections::BTreeSet<String> = recorder
        .done
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, _, s, _)| *s == shard)
        .map(|(_, _, _, id)| id.clone())
        .collect();
    let mut seen = Vec::new();
    for call in recorder.calls() {
        if call.shard == shard && done.contains(&call.entry_id) && !seen.contains(&call.n) {
            seen.push(call.n);
        }
    }
    seen.into_iter().flatten().collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_longer_than_the_lease_keeps_the_assignment_and_resume_continues_in_order() {
    let (_serial, _server, target, mut conn, recorder) = Context::serial(2).await.parts();
    let listener = start_recording(&target, &recorder, options(1), Duration::ZERO).await;
    settle(&mut conn, 1, Duration::from_secs(20)).await;

    // Before the pause: entries 1..=4 on both shards are handled.
    let mut ids = BTreeMap::new();
    for n in 1..=4 {
        let shard = (n % 2) as u32;
        let id = xadd_fields(&mut conn, shard, &[("key", "k"), ("payload", &payload(n))]).await;
        ids.insert(n, (shard, id));
    }
    let first = wait_until(Duration::from_secs(10), || recorder.handled().len() == 4).await;
    assert!(first, "{:?}", recorder.calls());

    listener.pause();
    assert!(listener.is_paused());
    let before = assignment(&listener);
    let calls_before = recorder.calls().len();
    let revokes_before = revokes(&recorder);
    for n in 5..=20 {
        let shard = (n % 2) as u32;
        let id = xadd_fields(&mut conn, shard, &[("key", "k"), ("payload", &payload(n))]).await;
        ids.insert(n, (shard, id));
    }
    // Twice the lease: without heartbeats the members would be expired and the shards moved.
    tokio::time::sleep(LEASE * 2).await;
    assert_eq!(
        recorder.calls().len(),
        calls_before,
        "a handler ran while paused"
    );
    assert_eq!(assignment(&listener), before, "epoch or shards changed");
    assert_eq!(revokes(&recorder), revokes_before, "a shard was revoked");
    for health in listener.health() {
        assert!(health.paused, "{health:?}");
        assert!(health.ready && health.live, "{health:?}");
    }
    let group = describe(&mut conn).await;
    assert!(converged(&group), "{group:#?}");
    assert_eq!(group.members.iter().filter(|m| m.live).count(), 1);

    listener.resume();
    assert!(!listener.is_paused());
    let all = wait_until(Duration::from_secs(10), || recorder.handled().len() == 20).await;
    assert!(
        all,
        "not every entry was handled after resume: {:?}",
        recorder.calls()
    );
    let expected: BTreeMap<u32, Vec<u64>> = [0, 1]
        .into_iter()
        .map(|shard| {
            let ns = ids
                .iter()
                .filter(|(_, (s, _))| *s == shard)
                .map(|(n, _)| *n)
                .collect();
            (shard, ns)
        })
        .collect();
    for (shard, ns) in expected {
        assert_eq!(handled_order(&recorder, shard), ns, "shard {shard}");
    }
    assert!(!listener.health()[0].paused);
    assert_eq!(assignment(&listener), before);
    listener.shutdown_and_wait().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_shard_that_is_revoked_is_released_and_handled_by_the_new_owner() {
    let (_serial, _server, target, mut conn, recorder) = Context::serial(2).await.parts();
    let first = start_recording(&target, &recorder, options(1), Duration::ZERO).await;
    settle(&mut conn, 1, Duration::from_secs(20)).await;
    let first_id = first.member_ids()[0].clone();
    first.pause();

    for n in 1..=10 {
        let shard = (n % 2) as u32;
        xadd_fields(&mut conn, shard, &[("key", "k"), ("payload", &payload(n))]).await;
    }
    let second = start_recording(&target, &recorder, options(1), Duration::ZERO).await;
    let second_id = second.member_ids()[0].clone();
    let group = settle(&mut conn, 2, Duration::from_secs(20)).await;
    let moved: Vec<u32> = target_shards(&group, &second_id);
    assert_eq!(moved.len(), 1, "{group:#?}");
    let moved = moved[0];

    // The moved shard's five entries are handled by the second member; the first handles
    // nothing while paused.
    let done = wait_until(Duration::from_secs(10), || {
        recorder
            .handled()
            .iter()
            .filter(|(s, _)| *s == moved)
            .count()
            == 5
    })
    .await;
    assert!(done, "{:?}", recorder.calls());
    let calls = recorder.calls();
    assert!(calls.iter().all(|c| c.member == second_id), "{calls:?}");
    let expected: Vec<u64> = (1..=10).filter(|n| (n % 2) as u32 == moved).collect();
    assert_eq!(handled_order(&recorder, moved), expected);

    first.resume();
    let all = wait_until(Duration::from_secs(10), || recorder.handled().len() == 10).await;
    assert!(all, "{:?}", recorder.calls());
    assert!(
        recorder
            .calls()
            .iter()
            .filter(|c| c.shard != moved)
            .all(|c| c.member == first_id)
    );
    first.shutdown_and_wait().await.expect("clean shutdown");
    second.shutdown_and_wait().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_shard_retries_the_entry_after_the_pause_without_using_an_attempt() {
    let (_serial, _server, target, mut conn, recorder) = Context::serial(2).await.parts();
    // Longer than the lease: the shard is kept only if the heartbeats go on meanwhile.
    let pause = LEASE + Duration::from_millis(500);
    let paused_once = Arc::new(AtomicBool::new(false));
    let behaviour: Behaviour = {
        let paused_once = paused_once.clone();
        Arc::new(move |delivery| {
            if payload_n(delivery) == Some(1) && !paused_once.swap(true, Ordering::SeqCst) {
                Err(HandlerError::pause_shard(pause))
            } else {
                Ok(())
            }
        })
    };
    let mut opts = options(1);
    opts.max_attempts = 1;
    let listener =
        start_recording_with(&target, &recorder, opts, Duration::ZERO, Some(behaviour)).await;
    settle(&mut conn, 1, Duration::from_secs(20)).await;
    let before = assignment(&listener);

    let x = xadd_fields(&mut conn, 0, &[("key", "k"), ("payload", &payload(1))]).await;
    let y = xadd_fields(&mut conn, 0, &[("key", "k"), ("payload", &payload(2))]).await;
    let asked = wait_until(Duration::from_secs(10), || {
        paused_once.load(Ordering::SeqCst)
    })
    .await;
    assert!(asked);
    // The other shard keeps going during the pause.
    let z = xadd_fields(&mut conn, 1, &[("key", "k"), ("payload", &payload(3))]).await;
    let other = wait_until(pause / 2, || recorder.handled().contains(&(1, z.clone()))).await;
    assert!(other, "shard 1 was held up by shard 0's pause");
    assert!(!recorder.handled().contains(&(0, x.clone())));

    let done = wait_until(pause + Duration::from_secs(10), || {
        recorder.handled().contains(&(0, y.clone()))
    })
    .await;
    assert!(done, "{:?}", recorder.calls());
    let on_x: Vec<Call> = recorder
        .calls()
        .into_iter()
        .filter(|c| c.entry_id == x)
        .collect();
    assert_eq!(on_x.len(), 2, "{on_x:?}");
    assert_eq!(on_x[0].attempt, 1);
    assert_eq!(on_x[1].attempt, 1, "a pause is not a failed attempt");
    assert_eq!(
        on_x[1].delivery_count, 1,
        "retried in place, not re-delivered"
    );
    let waited = Duration::from_micros(on_x[1].at_us - on_x[0].at_us);
    assert!(
        waited >= pause,
        "retried after {waited:?}, before the {pause:?} pause"
    );
    // Then Y, in order, after X.
    assert_eq!(handled_order(&recorder, 0), vec![1, 2]);
    let dead: u64 = redis::cmd("XLEN")
        .arg("orders:dlq:billing")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(dead, 0, "paused entry was dead-lettered");
    assert_eq!(wait_no_pending(&mut conn, 0).await, 0);
    assert_eq!(assignment(&listener), before, "the pause cost the shard");
    assert_eq!(revokes(&recorder), 0);
    listener.shutdown_and_wait().await.expect("clean shutdown");
}
