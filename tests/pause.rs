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
//!   than the lease keeps the shard (heartbeats go on);
//! - with `ordering = "key"`, `pause_shard` starts no new entry on the shard until the pause
//!   ends (the entries running finish meanwhile); the paused entry runs again after it, with the
//!   same attempt number, and every entry is acked;
//! - a batch listener's `BatchError::all(HandlerError::pause_shard(d))`: the same batch runs
//!   again after `d` with the same attempt number, and is acked;
//! - a member pause during a batch's retry backoff: no batch attempt starts until the resume.

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

/// How many entries the group's dead-letter stream holds.
async fn dead_letter_count(
    conn: &mut stream_listener::core::internals::connection::RedisConnection,
) -> u64 {
    redis::cmd("XLEN")
        .arg("orders:dlq:billing")
        .query_async(conn)
        .await
        .unwrap()
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
        // Shard 1's entry may have the same id (another stream, the same millisecond).
        .filter(|c| c.shard == 0 && c.entry_id == x)
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
    let dead = dead_letter_count(&mut conn).await;
    assert_eq!(dead, 0, "paused entry was dead-lettered");
    assert_eq!(wait_no_pending(&mut conn, 0).await, 0);
    assert_eq!(assignment(&listener), before, "the pause cost the shard");
    assert_eq!(revokes(&recorder), 0);
    listener.shutdown_and_wait().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_key_ordering_pause_shard_starts_nothing_new_on_the_shard_until_the_pause_ends() {
    let (_serial, _server, target, mut conn, recorder) = Context::serial(1).await.parts();
    let pause = Duration::from_millis(800);
    // Entry 1 (key a) pauses the shard at once; the other entries of the first wave (keys b, c,
    // d: four lanes run at once) are still running then, and finish during the pause.
    let work = Duration::from_millis(300);
    let keys = ["a", "b", "c", "d", "e", "f", "a", "g"];
    let mut ids = Vec::new();
    for (n, key) in (1..).zip(keys) {
        ids.push(xadd_fields(&mut conn, 0, &[("key", key), ("payload", &payload(n))]).await);
    }
    // When entry 1's handler returned the pause (µs; 0 until then).
    let paused_at = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let handler = {
        let (recorder, paused_at) = (recorder.clone(), paused_at.clone());
        move |delivery: stream_listener::core::handler::Delivery| {
            let (recorder, paused_at) = (recorder.clone(), paused_at.clone());
            async move {
                let n = recorder.record_call(&delivery);
                if n == Some(1) && paused_at.load(Ordering::SeqCst) == 0 {
                    paused_at.store(now_us(), Ordering::SeqCst);
                    return Err(HandlerError::pause_shard(pause));
                }
                tokio::time::sleep(work).await;
                recorder.record_done(&delivery);
                Ok(())
            }
        }
    };
    let mut opts = options(1);
    opts.ordering = stream_listener::core::member::Ordering::Key;
    opts.max_in_flight = 4;
    opts.max_attempts = 1;
    let listener = start_listener(&target, handler, opts).await;

    let all = wait_until(pause + Duration::from_secs(15), || {
        recorder.handled().len() == ids.len()
    })
    .await;
    assert!(all, "{:?}", recorder.calls());
    let paused_at = paused_at.load(Ordering::SeqCst);
    assert!(paused_at > 0);
    let pause_end = paused_at + pause.as_micros() as u64;
    let calls = recorder.calls();
    // The first wave: entries 1 to 4, started together before the pause.
    let first_wave: Vec<&Call> = calls.iter().take(4).collect();
    let mut wave_ns: Vec<u64> = first_wave.iter().filter_map(|c| c.n).collect();
    wave_ns.sort();
    assert_eq!(wave_ns, vec![1, 2, 3, 4], "{calls:?}");
    // No call starts on the shard after the pause was asked for and before it ends.
    for call in &calls[4..] {
        assert!(
            call.at_us >= pause_end,
            "entry {:?} started {} ms before the pause ended: {calls:?}",
            call.n,
            ms(pause_end - call.at_us)
        );
    }
    // The entries running when the pause began finished during it.
    let done = recorder.done.lock().unwrap().clone();
    for id in &ids[1..4] {
        let at = done.iter().find(|(_, _, _, d)| d == id).unwrap().0;
        assert!(
            at < pause_end,
            "{id} finished only after the pause: {done:?}"
        );
    }
    // Entry 1 is tried again after the pause with the same attempt number, then acked; its
    // key's next entry (7) starts only after it.
    let on_1: Vec<&Call> = calls.iter().filter(|c| c.n == Some(1)).collect();
    assert_eq!(on_1.len(), 2, "{on_1:?}");
    assert_eq!((on_1[0].attempt, on_1[1].attempt), (1, 1), "{on_1:?}");
    let first_7 = calls.iter().find(|c| c.n == Some(7)).unwrap();
    assert!(first_7.at_us > on_1[1].at_us, "{calls:?}");
    // Nothing lost: every entry handled and acked, nothing dead-lettered.
    assert_eq!(wait_no_pending(&mut conn, 0).await, 0);
    let dead = dead_letter_count(&mut conn).await;
    assert_eq!(dead, 0);
    listener.shutdown_and_wait().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_that_returns_pause_shard_runs_again_after_the_pause_with_the_same_attempt() {
    use stream_listener::core::batch::{Batch, BatchError};
    use stream_listener::core::extract::Json;
    use stream_listener::core::member::Listener;

    let (_serial, _server, target, mut conn, _recorder) = Context::serial(1).await.parts();
    let pause = Duration::from_millis(800);
    let mut ids = Vec::new();
    for n in 1..=3 {
        ids.push(xadd_fields(&mut conn, 0, &[("key", "k"), ("payload", &payload(n))]).await);
    }
    // Each call: when it started (µs), and each entry's (id, attempt).
    type Seen = Vec<(u64, Vec<(String, u32)>)>;
    let calls: Arc<std::sync::Mutex<Seen>> = Arc::default();
    let paused_once = Arc::new(AtomicBool::new(false));
    let handler = {
        let (calls, paused_once) = (calls.clone(), paused_once.clone());
        move |batch: Batch<Json<serde_json::Value>>| {
            let entries = batch
                .entries()
                .map(|(_, meta)| (meta.entry_id.clone(), meta.attempt))
                .collect();
            calls.lock().unwrap().push((now_us(), entries));
            let result = if paused_once.swap(true, Ordering::SeqCst) {
                Ok(())
            } else {
                Err(BatchError::all(HandlerError::pause_shard(pause)))
            };
            async move { result }
        }
    };
    let mut opts = options(1);
    // A pause is no failed attempt: not dead-lettered even with one attempt.
    opts.max_attempts = 1;
    let listener = Listener::new_batch(target.clone(), STREAM, GROUP, handler, opts)
        .unwrap()
        .start()
        .await
        .unwrap();

    let twice = wait_until(pause + Duration::from_secs(10), || {
        calls.lock().unwrap().len() >= 2
    })
    .await;
    assert!(twice, "{:?}", calls.lock().unwrap());
    assert_eq!(wait_no_pending(&mut conn, 0).await, 0);
    let seen = calls.lock().unwrap().clone();
    assert_eq!(seen.len(), 2, "{seen:?}");
    let expected: Vec<(String, u32)> = ids.iter().map(|id| (id.clone(), 1)).collect();
    assert_eq!(seen[0].1, expected, "{seen:?}");
    assert_eq!(
        seen[1].1, expected,
        "the same batch, the same attempt: {seen:?}"
    );
    let waited = Duration::from_micros(seen[1].0 - seen[0].0);
    assert!(
        waited >= pause,
        "ran again after {waited:?}, before the {pause:?} pause"
    );
    let dead = dead_letter_count(&mut conn).await;
    assert_eq!(dead, 0, "a paused batch was dead-lettered");
    listener.shutdown_and_wait().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_pause_during_a_batch_retry_backoff_starts_no_attempt_until_resume() {
    use stream_listener::core::batch::{Batch, BatchError};
    use stream_listener::core::extract::Json;
    use stream_listener::core::member::Listener;

    let (_serial, _server, target, mut conn, _recorder) = Context::serial(1).await.parts();
    for n in 1..=2 {
        xadd_fields(&mut conn, 0, &[("key", "k"), ("payload", &payload(n))]).await;
    }
    // When each call started (µs) and its attempt number.
    let calls: Arc<std::sync::Mutex<Vec<(u64, u32)>>> = Arc::default();
    let handler = {
        let calls = calls.clone();
        move |batch: Batch<Json<serde_json::Value>>| {
            let attempt = batch.metadata(0).map_or(0, |meta| meta.attempt);
            calls.lock().unwrap().push((now_us(), attempt));
            let result = if attempt == 1 {
                Err(BatchError::all(HandlerError::retryable("database down")))
            } else {
                Ok(())
            };
            async move { result }
        }
    };
    let mut opts = options(1);
    opts.max_attempts = 5;
    // Long enough for the pause to come during it.
    opts.backoff = Duration::from_millis(1000);
    let listener = Listener::new_batch(target.clone(), STREAM, GROUP, handler, opts)
        .unwrap()
        .start()
        .await
        .unwrap();
    let failed = wait_until(Duration::from_secs(10), || {
        !calls.lock().unwrap().is_empty()
    })
    .await;
    assert!(failed);
    listener.pause();
    // Past the backoff, still paused: no attempt may start.
    tokio::time::sleep(Duration::from_millis(2000)).await;
    let while_paused = calls.lock().unwrap().clone();
    assert_eq!(
        while_paused.len(),
        1,
        "a batch attempt started while the member was paused: {while_paused:?}"
    );
    let resumed_at = now_us();
    listener.resume();
    assert_eq!(wait_no_pending(&mut conn, 0).await, 0);
    let seen = calls.lock().unwrap().clone();
    assert!(seen.len() >= 2 && seen[1].0 >= resumed_at, "{seen:?}");
    listener.shutdown_and_wait().await.expect("clean shutdown");
}
