//! Batch listeners on real Redis (docs/design.md §14.2):
//!
//! - the entries of one read are handled as one batch, in entry order, and acked;
//! - `BatchError::at(k, e)` acks the entries before `k` and retries exactly those from `k` on;
//!   with `e` a `HandlerError::pause_shard`, it runs them again after the pause, same attempt;
//! - an undecodable entry is dead-lettered with reason `decode` before the batch is built, and
//!   the batch skips it;
//! - a whole-batch error is retried whole with backoff; when `max_attempts` is used up every
//!   entry is dead-lettered with reason `handler`;
//! - `batch_max_wait` gathers entries trickling in into a batch larger than one read;
//! - `batch_size` caps every batch.
//!
//! Run also with `STREAM_LISTENER_TEST_FENCING=acks` (`support::options`).

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use stream_listener::core::batch::{Batch, BatchError};
use stream_listener::core::extract::Json;
use stream_listener::core::handler::HandlerError;
use stream_listener::core::internals::connection::{RedisConnection, RedisTarget};
use stream_listener::core::member::{Listener, ListenerHandle, ListenerOptions};
use support::*;

const DEAD_LETTERS: &str = "orders:dlq:billing";

#[derive(Debug, serde::Deserialize)]
struct N {
    n: u64,
}

/// One call of the batch handler: (entry id, n, attempt) of each entry, in batch order, and
/// when it started (µs).
#[derive(Debug, Clone)]
struct BatchCall {
    at_us: u64,
    entries: Vec<(String, u64, u32)>,
}

impl BatchCall {
    fn ids(&self) -> Vec<String> {
        self.entries.iter().map(|(id, _, _)| id.clone()).collect()
    }
}

type Calls = Arc<Mutex<Vec<BatchCall>>>;

/// What the handler returns for a batch (after it is recorded).
type Outcome = Arc<dyn Fn(&Batch<Json<N>>) -> Result<(), BatchError> + Send + Sync>;

/// Starts a batch listener of `GROUP` on `STREAM` recording every call, its outcome chosen by
/// `outcome`.
async fn start_batch(
    target: &RedisTarget,
    options: ListenerOptions,
    outcome: Outcome,
) -> (ListenerHandle, Calls) {
    let calls: Calls = Arc::default();
    let record = calls.clone();
    let handler = move |batch: Batch<Json<N>>| {
        let entries = batch
            .entries()
            .map(|(Json(value), meta)| (meta.entry_id.clone(), value.n, meta.attempt))
            .collect();
        record.lock().unwrap().push(BatchCall {
            at_us: now_us(),
            entries,
        });
        let result = outcome(&batch);
        async move { result }
    };
    let listener = Listener::new_batch(target.clone(), STREAM, GROUP, handler, options)
        .unwrap()
        .start()
        .await
        .unwrap();
    (listener, calls)
}

/// Appends `{"n":<n>}` to shard 0 for each `n`; returns the ids.
async fn publish(conn: &mut RedisConnection, ns: impl IntoIterator<Item = u64>) -> Vec<String> {
    let mut ids = Vec::new();
    for n in ns {
        let payload = format!(r#"{{"n":{n}}}"#);
        ids.push(xadd_fields(conn, 0, &[("key", "k"), ("payload", &payload)]).await);
    }
    ids
}

fn calls_of(calls: &Calls) -> Vec<BatchCall> {
    calls.lock().unwrap().clone()
}

/// How many times each id was in a batch the handler saw.
fn times_seen(calls: &[BatchCall], id: &str) -> usize {
    calls
        .iter()
        .flat_map(|call| call.entries.iter())
        .filter(|(seen, _, _)| seen == id)
        .count()
}

/// The dead letters: (source id, reason, attempts), in order.
async fn dead_letters(conn: &mut RedisConnection) -> Vec<(String, String, String)> {
    let reply: Vec<(String, Vec<String>)> = redis::cmd("XRANGE")
        .arg(DEAD_LETTERS)
        .arg("-")
        .arg("+")
        .query_async(conn)
        .await
        .unwrap();
    reply
        .into_iter()
        .map(|(_, flat)| {
            let get = |name: &str| {
                flat.chunks(2)
                    .find(|kv| kv[0] == name)
                    .map(|kv| kv[1].clone())
                    .unwrap_or_default()
            };
            (get("sourceId"), get("reason"), get("attempts"))
        })
        .collect()
}

fn ok() -> Outcome {
    Arc::new(|_| Ok(()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_entries_of_a_read_are_one_batch_in_order_and_all_acked() {
    let (_serial, _server, target, mut conn, _recorder) = Context::serial(1).await.parts();
    let ids = publish(&mut conn, 1..=5).await;
    let (listener, calls) = start_batch(&target, options(1), ok()).await;
    assert!(
        wait_until(Duration::from_secs(10), || calls_of(&calls).len() == 1).await,
        "no batch"
    );
    let seen = calls_of(&calls);
    assert_eq!(
        seen[0].entries,
        ids.iter()
            .zip(1..=5)
            .map(|(id, n)| (id.clone(), n, 1))
            .collect::<Vec<_>>()
    );
    assert_eq!(wait_no_pending(&mut conn, 0).await, 0);
    // Entries published later come as later batches, each handled once.
    let later = publish(&mut conn, 6..=7).await;
    assert!(
        wait_until(Duration::from_secs(10), || {
            let seen = calls_of(&calls);
            later.iter().all(|id| times_seen(&seen, id) == 1)
        })
        .await
    );
    assert_eq!(wait_no_pending(&mut conn, 0).await, 0);
    assert!(dead_letters(&mut conn).await.is_empty());
    listener.shutdown_and_wait().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_error_at_k_acks_the_prefix_and_retries_exactly_the_entries_from_k() {
    let (_serial, _server, target, mut conn, _recorder) = Context::serial(1).await.parts();
    let ids = publish(&mut conn, 1..=5).await;
    let mut opts = options(1);
    opts.max_attempts = 5;
    opts.backoff = Duration::from_millis(50);
    // Entry n = 3 fails on its first two attempts.
    let outcome: Outcome = Arc::new(|batch| {
        for (i, (Json(value), meta)) in batch.entries().enumerate() {
            if value.n == 3 && meta.attempt < 3 {
                return Err(BatchError::at(i, "n = 3 is not ready"));
            }
        }
        Ok(())
    });
    let (listener, calls) = start_batch(&target, opts, outcome).await;
    assert!(
        wait_until(Duration::from_secs(10), || calls_of(&calls).len() == 3).await,
        "{:?}",
        calls_of(&calls)
    );
    let seen = calls_of(&calls);
    assert_eq!(seen[0].ids(), ids);
    assert_eq!(seen[1].ids(), ids[2..].to_vec(), "retried from index 2");
    assert_eq!(seen[2].ids(), ids[2..].to_vec());
    let attempts: Vec<u32> = seen.iter().map(|call| call.entries[0].2).collect();
    assert_eq!(attempts, vec![1, 2, 3]);
    for id in &ids[..2] {
        assert_eq!(times_seen(&seen, id), 1, "{id} before the failed index");
    }
    for id in &ids[2..] {
        assert_eq!(times_seen(&seen, id), 3, "{id} from the failed index on");
    }
    // Backoff 50 ms, then 100 ms: lower bounds only.
    assert!(seen[1].at_us - seen[0].at_us >= 50_000, "{seen:?}");
    assert!(seen[2].at_us - seen[1].at_us >= 100_000, "{seen:?}");
    assert_eq!(wait_no_pending(&mut conn, 0).await, 0);
    assert!(dead_letters(&mut conn).await.is_empty());
    listener.shutdown_and_wait().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_error_at_k_with_pause_shard_acks_the_prefix_and_runs_the_rest_after_the_pause() {
    let (_serial, _server, target, mut conn, _recorder) = Context::serial(1).await.parts();
    let ids = publish(&mut conn, 1..=5).await;
    let mut opts = options(1);
    // A pause is not a failed attempt: with one attempt, nothing may be dead-lettered.
    opts.max_attempts = 1;
    let pause = Duration::from_millis(400);
    // Entry n = 3 asks for a pause on its first call.
    let paused = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let outcome: Outcome = {
        let paused = paused.clone();
        Arc::new(move |batch| {
            for (i, (Json(value), _)) in batch.entries().enumerate() {
                if value.n == 3 && !paused.swap(true, std::sync::atomic::Ordering::SeqCst) {
                    return Err(BatchError::at(i, HandlerError::pause_shard(pause)));
                }
            }
            Ok(())
        })
    };
    let (listener, calls) = start_batch(&target, opts, outcome).await;
    assert!(
        wait_until(Duration::from_secs(10), || calls_of(&calls).len() == 2).await,
        "{:?}",
        calls_of(&calls)
    );
    let seen = calls_of(&calls);
    assert_eq!(seen[0].ids(), ids);
    assert_eq!(seen[1].ids(), ids[2..].to_vec(), "the rest, from index 2");
    let attempts: Vec<u32> = seen.iter().map(|call| call.entries[0].2).collect();
    assert_eq!(attempts, vec![1, 1], "a pause is not a failed attempt");
    assert!(
        seen[1].at_us - seen[0].at_us >= pause.as_micros() as u64,
        "called again before the pause ended: {seen:?}"
    );
    for id in &ids[..2] {
        assert_eq!(times_seen(&seen, id), 1, "{id} before the pausing index");
    }
    assert_eq!(wait_no_pending(&mut conn, 0).await, 0);
    assert!(dead_letters(&mut conn).await.is_empty());
    listener.shutdown_and_wait().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_entry_whose_attempts_are_used_up_is_dead_lettered_alone_and_the_rest_go_on() {
    let (_serial, _server, target, mut conn, _recorder) = Context::serial(1).await.parts();
    let ids = publish(&mut conn, 1..=4).await;
    let mut opts = options(1);
    opts.max_attempts = 2;
    opts.backoff = Duration::from_millis(20);
    let outcome: Outcome =
        Arc::new(
            |batch| match batch.iter().position(|Json(value)| value.n == 2) {
                Some(i) => Err(BatchError::at(i, "n = 2 always fails")),
                None => Ok(()),
            },
        );
    let (listener, calls) = start_batch(&target, opts, outcome).await;
    assert!(
        wait_until(Duration::from_secs(10), || calls_of(&calls).len() == 3).await,
        "{:?}",
        calls_of(&calls)
    );
    let seen = calls_of(&calls);
    assert_eq!(seen[0].ids(), ids);
    assert_eq!(seen[1].ids(), ids[1..].to_vec());
    // After the dead letter: the rest as a fresh batch, attempt 1.
    assert_eq!(seen[2].ids(), ids[2..].to_vec());
    assert_eq!(seen[2].entries[0].2, 1);
    assert_eq!(
        dead_letters(&mut conn).await,
        vec![(ids[1].clone(), "handler".to_owned(), "2".to_owned())]
    );
    assert_eq!(wait_no_pending(&mut conn, 0).await, 0);
    listener.shutdown_and_wait().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undecodable_entry_is_dead_lettered_before_the_batch_and_the_batch_skips_it() {
    let (_serial, _server, target, mut conn, _recorder) = Context::serial(1).await.parts();
    let first = publish(&mut conn, 1..=2).await;
    let bad = xadd_fields(&mut conn, 0, &[("key", "k"), ("payload", r#"{"n":"#)]).await;
    let last = publish(&mut conn, 4..=4).await;
    let (listener, calls) = start_batch(&target, options(1), ok()).await;
    assert!(
        wait_until(Duration::from_secs(10), || calls_of(&calls).len() == 1).await,
        "no batch"
    );
    let seen = calls_of(&calls);
    assert_eq!(
        seen[0].entries,
        vec![
            (first[0].clone(), 1, 1),
            (first[1].clone(), 2, 1),
            (last[0].clone(), 4, 1)
        ]
    );
    assert_eq!(
        dead_letters(&mut conn).await,
        vec![(bad.clone(), "decode".to_owned(), "1".to_owned())]
    );
    assert_eq!(wait_no_pending(&mut conn, 0).await, 0);
    assert_eq!(calls_of(&calls).len(), 1, "nothing retried");
    listener.shutdown_and_wait().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_batch_error_is_retried_whole_with_backoff_then_succeeds() {
    let (_serial, _server, target, mut conn, _recorder) = Context::serial(1).await.parts();
    let ids = publish(&mut conn, 1..=3).await;
    let mut opts = options(1);
    opts.max_attempts = 5;
    opts.backoff = Duration::from_millis(50);
    // Any error but `BatchError::at`: the whole batch, here through `From`.
    let outcome: Outcome = Arc::new(|batch| {
        let attempt = batch.metadata(0).map_or(0, |meta| meta.attempt);
        if attempt < 3 {
            return Err(HandlerError::retryable("database down").into());
        }
        Ok(())
    });
    let (listener, calls) = start_batch(&target, opts, outcome).await;
    assert!(
        wait_until(Duration::from_secs(10), || calls_of(&calls).len() == 3).await,
        "{:?}",
        calls_of(&calls)
    );
    let seen = calls_of(&calls);
    for (k, call) in seen.iter().enumerate() {
        assert_eq!(call.ids(), ids, "attempt {}", k + 1);
        assert!(call.entries.iter().all(|(_, _, a)| *a as usize == k + 1));
    }
    assert!(seen[1].at_us - seen[0].at_us >= 50_000, "{seen:?}");
    assert!(seen[2].at_us - seen[1].at_us >= 100_000, "{seen:?}");
    assert_eq!(wait_no_pending(&mut conn, 0).await, 0);
    assert!(dead_letters(&mut conn).await.is_empty());
    listener.shutdown_and_wait().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_batch_error_past_max_attempts_dead_letters_every_entry() {
    let (_serial, _server, target, mut conn, _recorder) = Context::serial(1).await.parts();
    let ids = publish(&mut conn, 1..=3).await;
    let mut opts = options(1);
    opts.max_attempts = 3;
    opts.backoff = Duration::from_millis(20);
    let outcome: Outcome = Arc::new(|_| Err(BatchError::all("database down")));
    let (listener, calls) = start_batch(&target, opts, outcome).await;
    let done = wait_until(Duration::from_secs(10), || calls_of(&calls).len() == 3).await;
    assert!(done, "{:?}", calls_of(&calls));
    assert_eq!(wait_no_pending(&mut conn, 0).await, 0);
    let letters = dead_letters(&mut conn).await;
    assert_eq!(
        letters,
        ids.iter()
            .map(|id| (id.clone(), "handler".to_owned(), "3".to_owned()))
            .collect::<Vec<_>>()
    );
    assert_eq!(
        calls_of(&calls).len(),
        3,
        "not handled again after the dead letters"
    );
    for id in &ids {
        assert_eq!(times_seen(&calls_of(&calls), id), 3);
    }
    listener.shutdown_and_wait().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_max_wait_gathers_entries_trickling_in_into_one_batch() {
    let (_serial, _server, target, mut conn, _recorder) = Context::serial(1).await.parts();
    let mut opts = options(1);
    opts.batch_size = 10;
    // At most half of the test lease (1.5 s).
    opts.batch_max_wait = Duration::from_millis(700);
    let (listener, calls) = start_batch(&target, opts, ok()).await;
    settle(&mut conn, 1, Duration::from_secs(20)).await;
    // Five entries 20 ms apart: without the wait the first read would take one of them.
    let mut ids = Vec::new();
    for n in 1..=5 {
        ids.extend(publish(&mut conn, [n]).await);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        wait_until(Duration::from_secs(10), || {
            let seen = calls_of(&calls);
            ids.iter().all(|id| times_seen(&seen, id) == 1)
        })
        .await,
        "{:?}",
        calls_of(&calls)
    );
    let seen = calls_of(&calls);
    let sizes: Vec<usize> = seen.iter().map(|call| call.entries.len()).collect();
    assert!(
        sizes.iter().any(|&size| size > 1),
        "every batch had one entry: {sizes:?}"
    );
    // In order across batches.
    let order: Vec<String> = seen.iter().flat_map(|call| call.ids()).collect();
    assert_eq!(order, ids);
    assert_eq!(wait_no_pending(&mut conn, 0).await, 0);
    listener.shutdown_and_wait().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_size_caps_every_batch_even_with_a_wait() {
    let (_serial, _server, target, mut conn, _recorder) = Context::serial(1).await.parts();
    let ids = publish(&mut conn, 1..=25).await;
    let mut opts = options(1);
    opts.batch_size = 10;
    opts.batch_max_wait = Duration::from_millis(300);
    let (listener, calls) = start_batch(&target, opts, ok()).await;
    assert!(
        wait_until(Duration::from_secs(10), || {
            let seen = calls_of(&calls);
            ids.iter().all(|id| times_seen(&seen, id) == 1)
        })
        .await,
        "{:?}",
        calls_of(&calls)
    );
    let seen = calls_of(&calls);
    let sizes: Vec<usize> = seen.iter().map(|call| call.entries.len()).collect();
    assert_eq!(sizes, vec![10, 10, 5]);
    let order: Vec<String> = seen.iter().flat_map(|call| call.ids()).collect();
    assert_eq!(order, ids);
    assert_eq!(wait_no_pending(&mut conn, 0).await, 0);
    listener.shutdown_and_wait().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_retryable_error_at_k_dead_letters_entry_k_at_once() {
    let (_serial, _server, target, mut conn, _recorder) = Context::serial(1).await.parts();
    let ids = publish(&mut conn, 1..=3).await;
    let mut opts = options(1);
    opts.max_attempts = 5;
    let outcome: Outcome =
        Arc::new(
            |batch| match batch.iter().position(|Json(value)| value.n == 2) {
                Some(i) => Err(BatchError::at(
                    i,
                    HandlerError::non_retryable("no such order"),
                )),
                None => Ok(()),
            },
        );
    let (listener, calls) = start_batch(&target, opts, outcome).await;
    assert!(
        wait_until(Duration::from_secs(10), || calls_of(&calls).len() == 2).await,
        "{:?}",
        calls_of(&calls)
    );
    let seen = calls_of(&calls);
    assert_eq!(seen[0].ids(), ids);
    assert_eq!(seen[1].ids(), ids[2..].to_vec());
    assert_eq!(
        dead_letters(&mut conn).await,
        vec![(ids[1].clone(), "non-retryable".to_owned(), "1".to_owned())]
    );
    assert_eq!(wait_no_pending(&mut conn, 0).await, 0);
    listener.shutdown_and_wait().await.expect("clean shutdown");
}

/// A handler bug: neither a panic nor a silent drop, the whole batch failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_index_past_the_batch_fails_the_whole_batch() {
    let (_serial, _server, target, mut conn, _recorder) = Context::serial(1).await.parts();
    let ids = publish(&mut conn, 1..=2).await;
    let mut opts = options(1);
    opts.max_attempts = 2;
    opts.backoff = Duration::from_millis(20);
    let outcome: Outcome = Arc::new(|batch| Err(BatchError::at(batch.len(), "off by one")));
    let (listener, calls) = start_batch(&target, opts, outcome).await;
    assert!(
        wait_until(Duration::from_secs(10), || calls_of(&calls).len() == 2).await,
        "{:?}",
        calls_of(&calls)
    );
    assert_eq!(wait_no_pending(&mut conn, 0).await, 0);
    let seen = calls_of(&calls);
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert!(seen.iter().all(|call| call.ids() == ids));
    assert_eq!(
        dead_letters(&mut conn).await,
        ids.iter()
            .map(|id| (id.clone(), "handler".to_owned(), "2".to_owned()))
            .collect::<Vec<_>>()
    );
    listener.shutdown_and_wait().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_batch_handler_is_a_failed_attempt_of_the_whole_batch() {
    let (_serial, _server, target, mut conn, _recorder) = Context::serial(1).await.parts();
    let ids = publish(&mut conn, 1..=2).await;
    let mut opts = options(1);
    opts.max_attempts = 3;
    opts.backoff = Duration::from_millis(20);
    let outcome: Outcome = Arc::new(|batch| {
        if batch.metadata(0).is_some_and(|meta| meta.attempt == 1) {
            panic!("handler bug");
        }
        Ok(())
    });
    let (listener, calls) = start_batch(&target, opts, outcome).await;
    assert!(
        wait_until(Duration::from_secs(10), || calls_of(&calls).len() == 2).await,
        "{:?}",
        calls_of(&calls)
    );
    let seen = calls_of(&calls);
    assert_eq!(seen[1].ids(), ids);
    assert_eq!(seen[1].entries[0].2, 2);
    assert_eq!(wait_no_pending(&mut conn, 0).await, 0);
    assert!(dead_letters(&mut conn).await.is_empty());
    listener.shutdown_and_wait().await.expect("clean shutdown");
}

/// A drain (graceful shutdown) starts no retry: the handled prefix is acked, the rest stays
/// pending, and the shard's next owner handles exactly the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_acks_the_handled_prefix_and_leaves_the_rest_to_the_next_owner() {
    let (_serial, _server, target, mut conn, _recorder) = Context::serial(1).await.parts();
    let ids = publish(&mut conn, 1..=4).await;
    let mut opts = options(1);
    opts.max_attempts = 10;
    opts.backoff = Duration::from_secs(5);
    let outcome: Outcome = Arc::new(|_| Err(BatchError::at(2, "not now")));
    let (first, calls) = start_batch(&target, opts.clone(), outcome).await;
    assert!(
        wait_until(Duration::from_secs(10), || calls_of(&calls).len() == 1).await,
        "no batch"
    );
    // In the 5 s backoff: the drain ends it.
    first.shutdown_and_wait().await.expect("clean shutdown");
    assert_eq!(calls_of(&calls).len(), 1, "a retry started in the drain");
    let left: Vec<String> = pel(&mut conn, 0)
        .await
        .into_iter()
        .map(|(id, _, _)| id)
        .collect();
    assert_eq!(
        left,
        ids[2..].to_vec(),
        "the prefix acked, the rest pending"
    );
    let (next, calls) = start_batch(&target, opts, ok()).await;
    assert!(
        wait_until(Duration::from_secs(15), || !calls_of(&calls).is_empty()).await,
        "the next owner never handled the rest"
    );
    assert_eq!(calls_of(&calls)[0].ids(), ids[2..].to_vec());
    assert_eq!(wait_no_pending(&mut conn, 0).await, 0);
    next.shutdown_and_wait().await.expect("clean shutdown");
}
