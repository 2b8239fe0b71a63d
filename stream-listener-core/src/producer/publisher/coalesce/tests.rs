//! The coalescer's queues against a real standalone server, observed from inside: publishes
//! that arrive while a pipeline is in flight wait in the queue and go out together, in the order
//! they joined; a cancelled one is left out; a sender task that is dropped fails its callers
//! instead of leaving them waiting; nothing outlives the last handle once the queue is empty; and
//! a publish outside a runtime leaves no queue behind.
//! The server is paused (`SIGSTOP`) to hold a pipeline in flight; waits are counted in
//! scheduler turns, never in time.

use std::sync::Weak;
use std::time::Duration;

use super::*;
use crate::connection::RedisTarget;
use crate::producer::{PublishError, Publisher, PublisherOptions};
use crate::testing::RedisServer;

/// A server with stream `orders` of one shard, and a publisher of it.
async fn setup() -> (RedisServer, RedisConnection, Publisher) {
    let server = RedisServer::start().unwrap();
    let target = RedisTarget::standalone(server.url());
    let mut conn = RedisConnection::connect(&target, Duration::from_secs(5))
        .await
        .unwrap();
    crate::testing::fixtures::create_stream(&mut conn, "orders", 1).await;
    let publisher = Publisher::new(conn.clone(), "orders", PublisherOptions::default())
        .await
        .unwrap();
    (server, conn, publisher)
}

fn coalescer(publisher: &Publisher) -> &Coalescer {
    &publisher.inner.coalescer
}

/// Entries waiting in the (standalone) queue; `None` when it is idle.
fn queued(publisher: &Publisher) -> Option<usize> {
    coalescer(publisher).lock().get(&None).map(Vec::len)
}

/// Lets other tasks run until `done`; panics after many scheduler turns.
async fn turn_until(what: &str, mut done: impl FnMut() -> bool) {
    for _ in 0..100_000 {
        if done() {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("still not {what}");
}

fn spawn_publish(
    publisher: &Publisher,
    key: String,
) -> tokio::task::JoinHandle<Result<crate::producer::Published, PublishError>> {
    let publisher = publisher.clone();
    tokio::spawn(async move { publisher.publish(&key, &key).await })
}

/// The partition keys of `{orders:0}`, in stream order.
async fn stored_keys(conn: &mut RedisConnection) -> Vec<String> {
    let entries: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
        .arg("{orders:0}")
        .arg("-")
        .arg("+")
        .query_async(conn)
        .await
        .unwrap();
    entries
        .into_iter()
        .map(|(_, fields)| fields[0].1.clone())
        .collect()
}

#[tokio::test]
async fn publishes_arriving_during_a_pipeline_go_out_together_in_joining_order() {
    let (server, mut conn, publisher) = setup().await;
    server.pause().unwrap();
    let first = spawn_publish(&publisher, "first".into());
    // In flight: its sender task has taken it out of the queue.
    turn_until("in flight", || queued(&publisher) == Some(0)).await;
    let waiting: Vec<_> = (0..10)
        .map(|i| spawn_publish(&publisher, format!("waiting-{i}")))
        .collect();
    turn_until("queued", || queued(&publisher) == Some(10)).await;
    let mut waiting = waiting.into_iter();
    let cancelled = waiting.nth(4).unwrap();
    cancelled.abort();
    turn_until("cancelled", || cancelled.is_finished()).await;
    server.resume().unwrap();

    first.await.unwrap().unwrap();
    for task in waiting {
        task.await.unwrap().unwrap();
    }
    turn_until("idle", || queued(&publisher).is_none()).await;
    let expected: Vec<String> = std::iter::once("first".to_owned())
        .chain((0..10).filter(|&i| i != 4).map(|i| format!("waiting-{i}")))
        .collect();
    assert_eq!(
        stored_keys(&mut conn).await,
        expected,
        "in joining order, waiting-4 left out"
    );
}

/// A sender task dropped with its runtime before its queue is empty: the caller waiting in the
/// queue gets an error at once, and the next publish starts a new sender.
#[tokio::test]
async fn a_sender_task_dropped_with_its_runtime_fails_its_waiting_callers() {
    let (server, mut conn, publisher) = setup().await;
    let other = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    server.pause().unwrap();
    // Started on the other runtime, so its sender task runs there.
    let on_other = publisher.clone();
    other.spawn(async move { on_other.publish("first", &1).await });
    turn_until("in flight", || queued(&publisher) == Some(0)).await;
    let waiting = spawn_publish(&publisher, "waiting".into());
    turn_until("queued", || queued(&publisher) == Some(1)).await;

    other.shutdown_background();
    let err = waiting.await.unwrap().unwrap_err();
    assert!(
        matches!(&err, PublishError::Redis(e) if e.to_string().contains("pipeline task stopped")),
        "{err}"
    );
    assert_eq!(queued(&publisher), None);
    server.resume().unwrap();
    publisher.publish("after", &2).await.unwrap();
    let keys = stored_keys(&mut conn).await;
    assert!(keys.ends_with(&["after".to_owned()]), "{keys:?}");
    assert!(!keys.contains(&"waiting".to_owned()));
}

/// Once its queue is empty the sender task ends: with every handle dropped, nothing holds the
/// coalescer (and its connection) any longer.
#[tokio::test]
async fn nothing_outlives_the_last_handle_once_the_queue_is_empty() {
    let (_server, _conn, publisher) = setup().await;
    let tasks: Vec<_> = (0..20)
        .map(|i| spawn_publish(&publisher, format!("k{i}")))
        .collect();
    let weak: Weak<Coalescer> = Arc::downgrade(&publisher.inner.coalescer);
    drop(publisher);
    for task in tasks {
        task.await.unwrap().unwrap();
    }
    turn_until("dropped", || weak.upgrade().is_none()).await;
}

/// A publish polled outside a Tokio runtime panics where it would start the sender task
/// (`tokio::spawn`), and leaves no queue behind that no task would ever send: later publishes
/// are sent.
#[tokio::test]
async fn a_publish_outside_a_runtime_leaves_no_busy_queue() {
    let (_server, mut conn, publisher) = setup().await;
    let outside = publisher.clone();
    let polled = std::thread::spawn(move || {
        let mut publish = std::pin::pin!(outside.publish("outside", &1));
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let _ = publish.as_mut().poll(&mut cx);
    })
    .join();
    assert!(polled.is_err(), "tokio::spawn panics outside a runtime");
    assert_eq!(queued(&publisher), None);
    publisher.publish("inside", &2).await.unwrap();
    assert_eq!(stored_keys(&mut conn).await, ["inside"]);
}
