//! A batch listener written with the attribute (docs/design.md §14.2), on real Redis: a last
//! argument `Batch<T>` makes it one, `State<T>` arguments before it get the application's
//! states, and a missing state stops the start before anything is sent to Redis. The batch
//! semantics themselves (partial failure, decode errors, drains) are `tests/batch.rs`'s.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use stream_listener::core::internals::connection::{RedisConnection, RedisTarget};
use stream_listener::testing::RedisServer;
use stream_listener::{
    Batch, BatchError, Config, Json, Publisher, PublisherOptions, RunError, State, app, run_with,
    stream_listener,
};

#[derive(Debug, Serialize, Deserialize)]
struct Event {
    seq: u64,
}

/// What the listener saw: per shard, the seqs in the order the batches gave them, and the size
/// of every batch.
#[derive(Clone, Default)]
struct Seen {
    by_shard: Arc<Mutex<BTreeMap<u32, Vec<u64>>>>,
    sizes: Arc<Mutex<Vec<usize>>>,
}

impl Seen {
    fn total(&self) -> usize {
        self.by_shard.lock().unwrap().values().map(Vec::len).sum()
    }
}

#[stream_listener(stream = "batch_attr_events", group = "collecting")]
async fn on_events(State(seen): State<Seen>, batch: Batch<Json<Event>>) -> Result<(), BatchError> {
    seen.sizes.lock().unwrap().push(batch.len());
    let mut by_shard = seen.by_shard.lock().unwrap();
    for (Json(event), metadata) in batch.entries() {
        by_shard.entry(metadata.shard).or_default().push(event.seq);
    }
    Ok(())
}

fn config(url: &str) -> Config {
    let text = format!(
        r#"
[redis]
url = "{url}"
startup_timeout = "5s"

[coordination]
heartbeat_interval = "200ms"
member_lease_ttl = "1500ms"
rebalance_timeout = "3s"

[streams.batch_attr_events]
shards = 2

[listeners.on_events]
handler_timeout = "2s"
block = "500ms"
batch_size = 16
"#
    );
    Config::from_toml_str(&text, "batch-attribute-test.toml").unwrap()
}

/// Publishes `n` events on one key (one shard), in seq order.
async fn publish(url: &str, n: u64) {
    let conn = RedisConnection::connect(
        &RedisTarget::standalone(url.to_owned()),
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    let publisher = Publisher::new(conn, "batch_attr_events", PublisherOptions::default())
        .await
        .unwrap();
    let events: Vec<(String, Event)> = (0..n)
        .map(|seq| ("one-key".into(), Event { seq }))
        .collect();
    publisher.publish_batch(&events).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attribute_batch_listener_gets_its_state_and_batches_in_entry_order() {
    const N: u64 = 100;
    let server = RedisServer::start().unwrap();
    // Published before the listener starts: its first reads find full batches.
    let seen = Seen::default();
    let running = app()
        .with_state(seen.clone())
        .run_with(config(&server.url()))
        .await
        .unwrap();
    publish(&server.url(), N).await;
    let end = Instant::now() + Duration::from_secs(20);
    while seen.total() < N as usize && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    running.shutdown_and_wait().await.expect("clean shutdown");
    let by_shard = seen.by_shard.lock().unwrap().clone();
    assert_eq!(by_shard.len(), 1, "one key, one shard: {by_shard:?}");
    let seqs = by_shard.into_values().next().unwrap();
    assert_eq!(
        seqs,
        (0..N).collect::<Vec<_>>(),
        "every entry once, in order"
    );
    let sizes = seen.sizes.lock().unwrap().clone();
    assert!(
        sizes.iter().all(|&s| (1..=16).contains(&s)),
        "batch_size caps: {sizes:?}"
    );
    assert!(
        sizes.iter().any(|&s| s > 1),
        "entries came in batches: {sizes:?}"
    );
}

#[tokio::test]
async fn a_batch_listener_without_its_state_does_not_start() {
    let url = "redis://127.0.0.1:1";
    let error = run_with(config(url)).await.unwrap_err();
    assert!(
        matches!(&error, RunError::MissingState { listener, type_name }
            if listener == "on_events" && *type_name == std::any::type_name::<Seen>()),
        "{error:?}"
    );
}
