//! Hostile tests of the handler model on real Redis (docs/design.md §14.3, §14.4):
//!
//! - key mode: while one key's entry has paused the shard (`pause_shard`), an entry of another
//!   key that is retrying in place starts no further attempt before the pause ends ("the shard
//!   starts no attempt for `duration`");
//! - a batch listener whose batch is in its retry backoff when the member is paused
//!   (`ListenerHandle::pause`) starts no further attempt while paused (as the per-entry path):
//!   the batch is not retried, let alone dead-lettered, during the pause, and is handled after
//!   the resume.

mod support;

use std::sync::atomic::{AtomicUsize, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use stream_listener::core::batch::{Batch, BatchError};
use stream_listener::core::extract::Json;
use stream_listener::core::handler::{Delivery, HandlerError};
use stream_listener::core::member::{Listener, Ordering};
use support::*;

#[derive(Debug, Default)]
struct Lanes {
    /// Calls of key `a`: (attempt, when).
    a_calls: Mutex<Vec<(u32, Instant)>>,
    /// Calls of key `b`.
    b_calls: AtomicUsize,
    /// When `b`'s first call returned `pause_shard`.
    b_paused_at: Mutex<Option<Instant>>,
}

/// Polls `done` every 5 ms for up to 10 s.
async fn wait_for(done: impl Fn() -> bool) {
    let end = Instant::now() + Duration::from_secs(10);
    while !done() && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_mode_a_retrying_lane_starts_no_attempt_while_another_lane_paused_the_shard() {
    let (_serial, _server, target, mut conn, _recorder) = Context::serial(1).await.parts();
    let pause = Duration::from_millis(1500);
    // Both entries in the first read: one batch, two lanes.
    xadd_fields(&mut conn, 0, &[("key", "a"), ("payload", "{}")]).await;
    xadd_fields(&mut conn, 0, &[("key", "b"), ("payload", "{}")]).await;

    let seen = Arc::new(Lanes::default());
    let handler = {
        let seen = seen.clone();
        move |delivery: Delivery| {
            let seen = seen.clone();
            async move {
                match delivery.partition_key() {
                    Some("a") => {
                        let first = {
                            let mut calls = seen.a_calls.lock().unwrap();
                            calls.push((delivery.attempt, Instant::now()));
                            calls.len() == 1
                        };
                        if first {
                            // Fails only once `b` has paused the shard: its retry (after a
                            // 100 ms backoff) falls within the pause.
                            wait_for(|| seen.b_paused_at.lock().unwrap().is_some()).await;
                            return Err(HandlerError::retryable("a fails once"));
                        }
                        Ok(())
                    }
                    _ => {
                        if seen.b_calls.fetch_add(1, AtomicOrdering::SeqCst) == 0 {
                            wait_for(|| !seen.a_calls.lock().unwrap().is_empty()).await;
                            *seen.b_paused_at.lock().unwrap() = Some(Instant::now());
                            return Err(HandlerError::pause_shard(pause));
                        }
                        Ok(())
                    }
                }
            }
        }
    };
    let mut opts = options(1);
    opts.ordering = Ordering::Key;
    opts.max_in_flight = 4;
    opts.max_attempts = 5;
    opts.backoff = Duration::from_millis(100);
    let listener = start_listener(&target, handler, opts).await;

    let done = wait_until(Duration::from_secs(15), || {
        seen.a_calls.lock().unwrap().len() >= 2 && seen.b_calls.load(AtomicOrdering::SeqCst) >= 2
    })
    .await;
    assert!(done, "{seen:?}");
    assert_eq!(wait_no_pending(&mut conn, 0).await, 0);
    let paused_at = seen.b_paused_at.lock().unwrap().unwrap();
    let (attempt, second) = seen.a_calls.lock().unwrap()[1];
    assert_eq!(attempt, 2, "{seen:?}");
    // Some slack for the instants taken in the handler vs. in the poller.
    assert!(
        second >= paused_at + pause - Duration::from_millis(100),
        "a's attempt 2 started {:?} after b paused the shard for {pause:?}",
        second.duration_since(paused_at)
    );
    listener.shutdown_and_wait().await.expect("clean shutdown");
}

#[derive(Debug, serde::Deserialize)]
struct N {
    #[allow(dead_code)]
    n: u64,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_in_its_retry_backoff_is_not_retried_while_the_member_is_paused() {
    let (_serial, _server, target, mut conn, _recorder) = Context::serial(1).await.parts();
    for n in 1..=3u64 {
        let payload = format!(r#"{{"n":{n}}}"#);
        xadd_fields(&mut conn, 0, &[("key", "k"), ("payload", &payload)]).await;
    }
    let backoff = Duration::from_millis(500);
    // (attempt, delivery count) of each call.
    let calls: Arc<Mutex<Vec<(u32, u64)>>> = Arc::default();
    let handler = {
        let calls = calls.clone();
        move |batch: Batch<Json<N>>| {
            let meta = batch.metadata(0).expect("a non-empty batch");
            let first = {
                let mut calls = calls.lock().unwrap();
                calls.push((meta.attempt, meta.delivery_count));
                calls.len() == 1
            };
            let result = if first {
                Err(BatchError::all("dependency down"))
            } else {
                Ok(())
            };
            async move { result }
        }
    };
    let mut opts = options(1);
    // The second attempt, if it ran while paused, would fail and be the last: dead letters.
    opts.max_attempts = 2;
    opts.backoff = backoff;
    let listener = Listener::new_batch(target.clone(), STREAM, GROUP, handler, opts)
        .unwrap()
        .start()
        .await
        .unwrap();

    let calls_len = || calls.lock().unwrap().len();
    assert!(wait_until(Duration::from_secs(10), || calls_len() == 1).await);
    // Within the first attempt's backoff (500 ms; `wait_until` polls every 20 ms).
    listener.pause();
    tokio::time::sleep(backoff * 4).await;
    assert_eq!(
        calls.lock().unwrap().clone(),
        vec![(1, 1)],
        "the batch handler ran while the member was paused"
    );
    listener.resume();
    assert!(wait_until(Duration::from_secs(10), || calls_len() == 2).await);
    assert_eq!(wait_no_pending(&mut conn, 0).await, 0);
    let dead: i64 = redis::cmd("XLEN")
        .arg("orders:dlq:billing")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(dead, 0, "dead letters: {:?}", calls.lock().unwrap());
    listener.shutdown_and_wait().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_handler_pause_shard_at_k_acks_the_prefix_and_reruns_the_rest_after_the_pause_with_the_same_attempt()
 {
    let (_serial, _server, target, mut conn, _recorder) = Context::serial(1).await.parts();
    let mut ids = Vec::new();
    for n in 1..=3u64 {
        let payload = format!(r#"{{"n":{n}}}"#);
        ids.push(xadd_fields(&mut conn, 0, &[("key", "k"), ("payload", &payload)]).await);
    }
    let pause = Duration::from_millis(800);
    // (when, [(id, attempt, delivery count)]) of each call.
    type Seen = Vec<(Instant, Vec<(String, u32, u64)>)>;
    let calls: Arc<Mutex<Seen>> = Arc::default();
    let handler = {
        let calls = calls.clone();
        move |batch: Batch<Json<N>>| {
            let entries = batch
                .entries()
                .map(|(_, m)| (m.entry_id.clone(), m.attempt, m.delivery_count))
                .collect();
            let first = {
                let mut calls = calls.lock().unwrap();
                calls.push((Instant::now(), entries));
                calls.len() == 1
            };
            let result = if first {
                Err(BatchError::at(1, HandlerError::pause_shard(pause)))
            } else {
                Ok(())
            };
            async move { result }
        }
    };
    let mut opts = options(1);
    // A pause is no failed attempt: never a dead letter, even with one attempt.
    opts.max_attempts = 1;
    let listener = Listener::new_batch(target.clone(), STREAM, GROUP, handler, opts)
        .unwrap()
        .start()
        .await
        .unwrap();
    let calls_len = || calls.lock().unwrap().len();
    assert!(wait_until(Duration::from_secs(10), || calls_len() == 2).await);
    assert_eq!(wait_no_pending(&mut conn, 0).await, 0);
    let seen = calls.lock().unwrap().clone();
    assert_eq!(seen.len(), 2, "{seen:?}");
    let first: Vec<String> = seen[0].1.iter().map(|e| e.0.clone()).collect();
    assert_eq!(first, ids, "{seen:?}");
    assert_eq!(
        seen[1].1,
        vec![(ids[1].clone(), 1, 1), (ids[2].clone(), 1, 1)],
        "the rest, in place, same attempt, same delivery"
    );
    assert!(
        seen[1].0 >= seen[0].0 + pause - Duration::from_millis(50),
        "rerun {:?} after the pause began",
        seen[1].0.duration_since(seen[0].0)
    );
    let dead: i64 = redis::cmd("XLEN")
        .arg("orders:dlq:billing")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(dead, 0);
    listener.shutdown_and_wait().await.expect("clean shutdown");
}

/// Handler starts in key mode: (key, n, attempt, delivery count, when).
type KeyStarts = Arc<Mutex<Vec<(String, u64, u32, u64, Instant)>>>;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_mode_pause_shard_starts_nothing_during_the_pause_and_loses_nothing() {
    let (_serial, _server, target, mut conn, _recorder) = Context::serial(1).await.parts();
    let pause = Duration::from_millis(1000);
    // a1 b1 c1 a2 b2 c2 (n = 1..=6): one batch, three lanes.
    for (n, key) in ["a", "b", "c", "a", "b", "c"].into_iter().enumerate() {
        let payload = format!(r#"{{"n":{}}}"#, n + 1);
        xadd_fields(&mut conn, 0, &[("key", key), ("payload", &payload)]).await;
    }
    let starts: KeyStarts = Arc::default();
    let paused_at: Arc<Mutex<Option<Instant>>> = Arc::default();
    let handler = {
        let (starts, paused_at) = (starts.clone(), paused_at.clone());
        move |delivery: Delivery| {
            let (starts, paused_at) = (starts.clone(), paused_at.clone());
            async move {
                let key = delivery.partition_key().unwrap_or_default().to_owned();
                let n = payload_n(&delivery).unwrap_or(0);
                starts.lock().unwrap().push((
                    key.clone(),
                    n,
                    delivery.attempt,
                    delivery.delivery_count,
                    Instant::now(),
                ));
                if n == 2 && paused_at.lock().unwrap().is_none() {
                    *paused_at.lock().unwrap() = Some(Instant::now());
                    return Err(HandlerError::pause_shard(pause));
                }
                if n == 1 || n == 3 {
                    // a1 and c1 finish only once b1 paused the shard: a2 and c2 must not start
                    // during the pause.
                    wait_for(|| paused_at.lock().unwrap().is_some()).await;
                }
                Ok(())
            }
        }
    };
    let mut opts = options(1);
    opts.ordering = Ordering::Key;
    opts.max_in_flight = 3;
    let listener = start_listener(&target, handler, opts).await;
    let handled = || {
        let starts = starts.lock().unwrap();
        (1..=6u64).all(|n| starts.iter().any(|s| s.1 == n))
    };
    assert!(
        wait_until(Duration::from_secs(15), || handled()
            && starts.lock().unwrap().len() >= 7)
        .await
    );
    assert_eq!(wait_no_pending(&mut conn, 0).await, 0);
    let paused_at = paused_at.lock().unwrap().unwrap();
    let starts = starts.lock().unwrap().clone();
    for (key, n, attempt, delivery_count, at) in &starts {
        let during = *at > paused_at && *at < paused_at + pause - Duration::from_millis(50);
        assert!(
            !during || *n == 1 || *n == 3,
            "{key}{n} (attempt {attempt}, delivery {delivery_count}) started {:?} into the pause: {starts:?}",
            at.duration_since(paused_at)
        );
    }
    // b1 again, in place: same attempt, same delivery.
    let b1: Vec<(u32, u64)> = starts
        .iter()
        .filter(|s| s.1 == 2)
        .map(|s| (s.2, s.3))
        .collect();
    assert_eq!(b1, vec![(1, 1), (1, 1)], "{starts:?}");
    // Per key, entry order.
    for key in ["a", "b", "c"] {
        let ns: Vec<u64> = starts.iter().filter(|s| s.0 == key).map(|s| s.1).collect();
        let mut sorted = ns.clone();
        sorted.sort();
        assert_eq!(ns, sorted, "key {key}: {starts:?}");
    }
    listener.shutdown_and_wait().await.expect("clean shutdown");
}

/// A batch handler's future.
type BatchFuture =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), BatchError>> + Send>>;

/// A batch listener recording (attempt, delivery count, batch length) of each call; its first
/// call waits until `release` is set, then returns `first`; later calls succeed.
fn gated_batch_handler(
    calls: Arc<Mutex<Vec<(u32, u64, usize)>>>,
    release: Arc<std::sync::atomic::AtomicBool>,
    first: fn() -> BatchError,
) -> impl Fn(Batch<Json<N>>) -> BatchFuture + Send + Sync + 'static {
    move |batch: Batch<Json<N>>| {
        let meta = batch.metadata(0).expect("a non-empty batch");
        let is_first = {
            let mut calls = calls.lock().unwrap();
            calls.push((meta.attempt, meta.delivery_count, batch.len()));
            calls.len() == 1
        };
        let release = release.clone();
        Box::pin(async move {
            if is_first {
                wait_for(|| release.load(AtomicOrdering::SeqCst)).await;
                return Err(first());
            }
            Ok(())
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_dead_letter_the_rest_of_the_batch_does_not_start_while_the_member_is_paused() {
    let (_serial, _server, target, mut conn, _recorder) = Context::serial(1).await.parts();
    for n in 1..=3u64 {
        let payload = format!(r#"{{"n":{n}}}"#);
        xadd_fields(&mut conn, 0, &[("key", "k"), ("payload", &payload)]).await;
    }
    let calls: Arc<Mutex<Vec<(u32, u64, usize)>>> = Arc::default();
    let release = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let handler = gated_batch_handler(calls.clone(), release.clone(), || {
        BatchError::at(0, HandlerError::non_retryable("entry 0 is bad"))
    });
    let listener = Listener::new_batch(target.clone(), STREAM, GROUP, handler, options(1))
        .unwrap()
        .start()
        .await
        .unwrap();
    let calls_len = || calls.lock().unwrap().len();
    assert!(wait_until(Duration::from_secs(10), || calls_len() == 1).await);
    // Paused while the first call runs: it finishes (entry 0 dead-lettered), nothing more starts.
    listener.pause();
    release.store(true, AtomicOrdering::SeqCst);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(
        calls.lock().unwrap().clone(),
        vec![(1, 1, 3)],
        "the rest of the batch ran while the member was paused"
    );
    listener.resume();
    assert!(wait_until(Duration::from_secs(10), || calls_len() == 2).await);
    assert_eq!(wait_no_pending(&mut conn, 0).await, 0);
    assert_eq!(calls.lock().unwrap()[1].2, 2, "{:?}", calls.lock().unwrap());
    listener.shutdown_and_wait().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_during_batch_max_wait_starts_no_batch() {
    let (_serial, _server, target, mut conn, _recorder) = Context::serial(1).await.parts();
    let calls: Arc<Mutex<Vec<(u32, u64, usize)>>> = Arc::default();
    let release = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let handler = gated_batch_handler(calls.clone(), release, || BatchError::all("unused"));
    let mut opts = options(1);
    // At most half the lease (1.5 s).
    opts.batch_max_wait = Duration::from_millis(700);
    opts.batch_size = 10;
    let listener = Listener::new_batch(target.clone(), STREAM, GROUP, handler, opts)
        .unwrap()
        .start()
        .await
        .unwrap();
    settle(&mut conn, 1, Duration::from_secs(20)).await;
    xadd_fields(&mut conn, 0, &[("key", "k"), ("payload", r#"{"n":1}"#)]).await;
    // Read (in the pending list) and waiting for a fuller batch: paused now.
    let mut read = false;
    let end = Instant::now() + Duration::from_secs(10);
    while !read && Instant::now() < end {
        read = pending_count(&mut conn, 0).await == 1;
        if !read {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    assert!(read);
    listener.pause();
    assert!(calls.lock().unwrap().is_empty(), "handled before the wait");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        calls.lock().unwrap().clone(),
        vec![],
        "a batch started while the member was paused"
    );
    listener.resume();
    assert!(wait_until(Duration::from_secs(10), || calls.lock().unwrap().len() == 1).await);
    assert_eq!(wait_no_pending(&mut conn, 0).await, 0);
    listener.shutdown_and_wait().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_mode_pause_then_shutdown_finishes_what_runs_and_leaves_the_rest_to_the_next_run() {
    let (_serial, _server, target, mut conn, _recorder) = Context::serial(1).await.parts();
    // a1 b1 a2: a1 and b1 run at once, a2 waits for a1.
    for (n, key) in [(1, "a"), (2, "b"), (3, "a")] {
        let payload = format!(r#"{{"n":{n}}}"#);
        xadd_fields(&mut conn, 0, &[("key", key), ("payload", &payload)]).await;
    }
    let starts: Arc<Mutex<Vec<u64>>> = Arc::default();
    let release = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let handler = {
        let (starts, release) = (starts.clone(), release.clone());
        move |delivery: Delivery| {
            let (starts, release) = (starts.clone(), release.clone());
            async move {
                starts
                    .lock()
                    .unwrap()
                    .push(payload_n(&delivery).unwrap_or(0));
                wait_for(|| release.load(AtomicOrdering::SeqCst)).await;
                Ok::<(), HandlerError>(())
            }
        }
    };
    let mut opts = options(1);
    opts.ordering = Ordering::Key;
    opts.max_in_flight = 4;
    let listener = start_listener(&target, handler.clone(), opts.clone()).await;
    assert!(
        wait_until(Duration::from_secs(10), || starts.lock().unwrap().len()
            == 2)
        .await
    );
    listener.pause();
    release.store(true, AtomicOrdering::SeqCst);
    let started = Instant::now();
    listener.shutdown_and_wait().await.expect("clean shutdown");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    let mut first_run = starts.lock().unwrap().clone();
    first_run.sort();
    assert_eq!(first_run, vec![1, 2], "a2 started while paused");
    // a1 and b1 acked; a2 read, not started: pending for the next run.
    assert_eq!(pending_count(&mut conn, 0).await, 1);
    starts.lock().unwrap().clear();
    let listener = start_listener(&target, handler, opts).await;
    assert!(
        wait_until(Duration::from_secs(10), || starts.lock().unwrap().len()
            == 1)
        .await
    );
    assert_eq!(starts.lock().unwrap().clone(), vec![3]);
    assert_eq!(wait_no_pending(&mut conn, 0).await, 0);
    listener.shutdown_and_wait().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_only_undecodable_entries_is_dead_lettered_without_a_handler_call() {
    let (_serial, _server, target, mut conn, _recorder) = Context::serial(1).await.parts();
    for bad in ["not json", r#"{"n":"x"}"#, "{}"] {
        xadd_fields(&mut conn, 0, &[("key", "k"), ("payload", bad)]).await;
    }
    let calls: Arc<Mutex<Vec<(u32, u64, usize)>>> = Arc::default();
    let release = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let handler = gated_batch_handler(calls.clone(), release, || BatchError::all("unused"));
    let listener = Listener::new_batch(target.clone(), STREAM, GROUP, handler, options(1))
        .unwrap()
        .start()
        .await
        .unwrap();
    let dead = || {
        let mut conn = conn.clone();
        async move {
            let n: i64 = redis::cmd("XLEN")
                .arg("orders:dlq:billing")
                .query_async(&mut conn)
                .await
                .unwrap();
            n
        }
    };
    let end = Instant::now() + Duration::from_secs(10);
    while dead().await < 3 && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(dead().await, 3);
    assert_eq!(wait_no_pending(&mut conn, 0).await, 0);
    // A later decodable entry still goes through.
    xadd_fields(&mut conn, 0, &[("key", "k"), ("payload", r#"{"n":1}"#)]).await;
    assert!(wait_until(Duration::from_secs(10), || calls.lock().unwrap().len() == 1).await);
    assert_eq!(calls.lock().unwrap()[0].2, 1);
    assert_eq!(wait_no_pending(&mut conn, 0).await, 0);
    listener.shutdown_and_wait().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_handler_past_handler_timeout_is_retried_whole() {
    let (_serial, _server, target, mut conn, _recorder) = Context::serial(1).await.parts();
    for n in 1..=2u64 {
        let payload = format!(r#"{{"n":{n}}}"#);
        xadd_fields(&mut conn, 0, &[("key", "k"), ("payload", &payload)]).await;
    }
    // The first call never returns (until cancelled by the timeout).
    let calls: Arc<Mutex<Vec<(u32, u64, usize)>>> = Arc::default();
    let release = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let handler = gated_batch_handler(calls.clone(), release, || BatchError::all("unused"));
    let mut opts = options(1);
    opts.handler_timeout = Duration::from_millis(300);
    opts.backoff = Duration::from_millis(20);
    let listener = Listener::new_batch(target.clone(), STREAM, GROUP, handler, opts)
        .unwrap()
        .start()
        .await
        .unwrap();
    assert!(wait_until(Duration::from_secs(10), || calls.lock().unwrap().len() == 2).await);
    assert_eq!(calls.lock().unwrap().clone(), vec![(1, 1, 2), (2, 1, 2)]);
    assert_eq!(wait_no_pending(&mut conn, 0).await, 0);
    listener.shutdown_and_wait().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_mode_a_redis_restart_while_keys_run_at_once_loses_nothing_and_keeps_key_order() {
    let (_serial, _unused, _, _, _) = Context::serial(1).await.parts();
    let mut server = stream_listener::testing::RedisServer::builder()
        .aof(true)
        .config("appendfsync", "always")
        .start()
        .unwrap();
    let target =
        stream_listener::core::internals::connection::RedisTarget::standalone(server.url());
    let mut conn = connect(&target).await;
    stream_listener::core::internals::admin::create_stream(&mut conn, STREAM, 1)
        .await
        .unwrap();
    let keys = ["a", "b", "c", "d"];
    for n in 1..=12u64 {
        let key = keys[((n - 1) % 4) as usize];
        let payload = format!(r#"{{"n":{n}}}"#);
        xadd_fields(&mut conn, 0, &[("key", key), ("payload", &payload)]).await;
    }
    // (key, n) of each start; calls of one key in flight now and at most.
    type Track = (
        Vec<(String, u64)>,
        std::collections::HashMap<String, usize>,
        usize,
    );
    let track: Arc<Mutex<Track>> = Arc::default();
    let release = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let handler = {
        let (track, release) = (track.clone(), release.clone());
        move |delivery: Delivery| {
            let (track, release) = (track.clone(), release.clone());
            async move {
                let key = delivery.partition_key().unwrap_or_default().to_owned();
                let n = payload_n(&delivery).unwrap_or(0);
                {
                    let mut t = track.lock().unwrap();
                    t.0.push((key.clone(), n));
                    let now = {
                        let c = t.1.entry(key.clone()).or_default();
                        *c += 1;
                        *c
                    };
                    t.2 = t.2.max(now);
                }
                // The first four (one per key) run until Redis is down.
                wait_for(|| release.load(AtomicOrdering::SeqCst)).await;
                *track.lock().unwrap().1.get_mut(&key).unwrap() -= 1;
                Ok::<(), HandlerError>(())
            }
        }
    };
    let mut opts = options(1);
    opts.ordering = Ordering::Key;
    opts.max_in_flight = 4;
    let listener = start_listener(&target, handler, opts).await;
    assert!(
        wait_until(Duration::from_secs(10), || track.lock().unwrap().0.len()
            == 4)
        .await
    );
    server.kill().unwrap();
    release.store(true, AtomicOrdering::SeqCst);
    // Down for longer than the lease.
    tokio::time::sleep(LEASE + Duration::from_millis(500)).await;
    server.restart().unwrap();
    let all = wait_until(Duration::from_secs(30), || {
        let t = track.lock().unwrap();
        (1..=12u64).all(|n| t.0.iter().any(|(_, m)| *m == n))
    })
    .await;
    assert!(all, "{:?}", track.lock().unwrap().0);
    let mut conn = connect(&target).await;
    assert_eq!(wait_no_pending(&mut conn, 0).await, 0);
    let t = track.lock().unwrap().clone();
    assert_eq!(t.2, 1, "a key in two handlers at once: {:?}", t.0);
    for key in keys {
        let mut first = Vec::new();
        for (k, n) in &t.0 {
            if k == key && !first.contains(n) {
                first.push(*n);
            }
        }
        let mut sorted = first.clone();
        sorted.sort();
        assert_eq!(first, sorted, "key {key}: {:?}", t.0);
    }
    listener.shutdown_and_wait().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_mode_an_endless_pause_shard_ends_at_a_revoke_and_at_shutdown() {
    let (_serial, _server, target, mut conn, _recorder) = Context::serial(2).await.parts();
    // (member, shard, n) of each start; the first call on each shard pauses it "forever".
    let starts: Arc<Mutex<Vec<(String, u32, u64)>>> = Arc::default();
    let handler = {
        let starts = starts.clone();
        move |delivery: Delivery| {
            let starts = starts.clone();
            async move {
                let n = payload_n(&delivery).unwrap_or(0);
                let first_on_shard = {
                    let mut s = starts.lock().unwrap();
                    let first = !s.iter().any(|(_, shard, _)| *shard == delivery.shard);
                    s.push((delivery.member_id.clone(), delivery.shard, n));
                    first
                };
                if first_on_shard {
                    return Err(HandlerError::pause_shard(Duration::MAX));
                }
                Ok(())
            }
        }
    };
    let mut opts = options(1);
    opts.ordering = Ordering::Key;
    opts.max_in_flight = 4;
    let first = start_listener(&target, handler.clone(), opts.clone()).await;
    settle(&mut conn, 1, Duration::from_secs(20)).await;
    for (n, shard) in [(1, 0), (2, 1)] {
        let payload = format!(r#"{{"n":{n}}}"#);
        xadd_fields(&mut conn, shard, &[("key", "k"), ("payload", &payload)]).await;
    }
    assert!(
        wait_until(Duration::from_secs(10), || starts.lock().unwrap().len()
            == 2)
        .await
    );
    let joined = Instant::now();
    let second = start_listener(&target, handler, opts).await;
    let second_id = second.member_ids()[0].clone();
    let group = settle(&mut conn, 2, Duration::from_secs(20)).await;
    let moved: Vec<u32> = target_shards(&group, &second_id);
    assert_eq!(moved.len(), 1, "{group:#?}");
    let moved = moved[0];
    // The paused entry of the moved shard is released by the drain and handled by the new owner.
    assert!(
        wait_until(Duration::from_secs(10), || {
            starts
                .lock()
                .unwrap()
                .iter()
                .any(|(m, s, _)| *m == second_id && *s == moved)
        })
        .await,
        "{:?}",
        starts.lock().unwrap()
    );
    assert_eq!(wait_no_pending(&mut conn, moved).await, 0);
    assert!(
        joined.elapsed() < REBALANCE + Duration::from_secs(2),
        "{:?}",
        joined.elapsed()
    );
    // The other shard is still paused (an hour): shutdown ends it, cleanly and at once.
    let stopping = Instant::now();
    first.shutdown_and_wait().await.expect("clean shutdown");
    assert!(
        stopping.elapsed() < Duration::from_secs(3),
        "{:?}",
        stopping.elapsed()
    );
    second.shutdown_and_wait().await.expect("clean shutdown");
}
