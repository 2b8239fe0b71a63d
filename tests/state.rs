//! Shared state and several extractors on real Redis (docs/design.md §14.1): `app().with_state`
//! reaches `State<T>` arguments of the attribute's listeners and of `handler_fn` ones, and a
//! state that was not given stops the start before anything is sent to Redis.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use stream_listener::core::internals::connection::{RedisConnection, RedisTarget};
use stream_listener::testing::RedisServer;
use stream_listener::{
    Config, Json, ListenerRegistration, Metadata, Publisher, PublisherOptions, RunError, State,
    app, handler_fn, run_with, stream_listener,
};

#[derive(Debug, Serialize, Deserialize)]
struct Event {
    seq: u64,
}

/// The application's counter of handled events, and the (shard, entry id, seq) it saw.
#[derive(Clone, Default)]
struct Counter {
    handled: Arc<AtomicU64>,
    seen: Arc<Mutex<BTreeSet<(u32, String, u64)>>>,
}

impl Counter {
    fn count(&self) -> u64 {
        self.handled.load(Ordering::SeqCst)
    }
}

#[stream_listener(stream = "state_events", group = "counting")]
async fn on_counted(
    State(counter): State<Counter>,
    metadata: Metadata,
    Json(event): Json<Event>,
) -> Result<(), std::io::Error> {
    counter
        .seen
        .lock()
        .unwrap()
        .insert((metadata.shard, metadata.entry_id, event.seq));
    counter.handled.fetch_add(1, Ordering::SeqCst);
    Ok(())
}

/// Short protocol timings (the group settles in about a second) for `listener` on `stream`.
fn config(url: &str, stream: &str, listener: &str) -> Config {
    let text = format!(
        r#"
[redis]
url = "{url}"
startup_timeout = "5s"

[coordination]
heartbeat_interval = "200ms"
member_lease_ttl = "1500ms"
rebalance_timeout = "3s"

[streams.{stream}]
shards = 4

[listeners.{listener}]
handler_timeout = "2s"
block = "500ms"
"#
    );
    Config::from_toml_str(&text, "state-test.toml").unwrap()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

async fn publish(url: &str, stream: &str, n: u64) -> BTreeSet<(u32, String)> {
    let conn = RedisConnection::connect(
        &RedisTarget::standalone(url.to_owned()),
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    let publisher = Publisher::new(conn, stream, PublisherOptions::default())
        .await
        .unwrap();
    let events: Vec<(String, Event)> = (0..n)
        .map(|seq| (format!("key-{}", seq % 13), Event { seq }))
        .collect();
    publisher
        .publish_batch(&events)
        .await
        .unwrap()
        .into_iter()
        .map(|p| (p.shard, p.entry_id))
        .collect()
}

/// Polls until `done` holds or `within` passes (condition-based, not a fixed sleep).
async fn wait_until(within: Duration, mut done: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + within;
    while Instant::now() < end {
        if done() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    done()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_state_given_to_the_app_counts_every_entry() {
    const N: u64 = 120;
    let server = RedisServer::start().unwrap();
    let counter = Counter::default();
    let running = app()
        .with_state(counter.clone())
        .run_with(config(&server.url(), "state_events", "on_counted"))
        .await
        .unwrap();
    assert!(
        running
            .wait_for_assignment(4, Duration::from_secs(15))
            .await,
        "4 shards assigned: {:?}",
        running.status()
    );
    let published = publish(&server.url(), "state_events", N).await;
    assert!(
        wait_until(Duration::from_secs(20), || counter.count() >= N).await,
        "handled {} of {N}",
        counter.count()
    );
    running.shutdown_and_wait().await.expect("clean shutdown");
    // One member, no rebalance after the assignment: each entry handled exactly once, and the
    // metadata and payload the function got are those of the published entries.
    assert_eq!(counter.count(), N);
    let seen = counter.seen.lock().unwrap().clone();
    let entries: BTreeSet<(u32, String)> = seen.iter().map(|(s, e, _)| (*s, e.clone())).collect();
    assert_eq!(entries, published);
    let seqs: BTreeSet<u64> = seen.iter().map(|(_, _, seq)| *seq).collect();
    assert_eq!(seqs, (0..N).collect());
}

#[tokio::test]
async fn a_missing_state_fails_the_start_before_connecting() {
    // Nothing listens on this port: an attempt to connect would end in RedisUnreachable after
    // the 5 s startup_timeout, not in MissingState.
    let url = format!("redis://127.0.0.1:{}", free_port());
    let started = Instant::now();
    let error = run_with(config(&url, "state_events", "on_counted"))
        .await
        .unwrap_err();
    assert!(
        matches!(&error, RunError::MissingState { listener, type_name }
            if listener == "on_counted" && *type_name == std::any::type_name::<Counter>()),
        "{error:?}"
    );
    let text = error.to_string();
    for part in ["`on_counted`", "Counter", "app().with_state("] {
        assert!(text.contains(part), "{part:?} not in: {text}");
    }
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "no connection attempt"
    );
    // A state of another type does not stand in for it.
    let error = app()
        .with_state(7u64)
        .run_with(config(&url, "state_events", "on_counted"))
        .await
        .unwrap_err();
    assert!(matches!(error, RunError::MissingState { .. }), "{error:?}");
}

/// A function of several extractors without the attribute: `handler_fn` in a registration.
async fn on_tallied(State(tally): State<Arc<AtomicU64>>, _: Metadata, Json(_): Json<Event>) {
    tally.fetch_add(1, Ordering::SeqCst);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_listeners_with_a_handler_fn_registration() {
    const N: u64 = 40;
    let server = RedisServer::start().unwrap();
    let tally = Arc::new(AtomicU64::new(0));
    let listeners = vec![ListenerRegistration::with_states(
        "on_tallied",
        "state_tally",
        "tally",
        |states| Ok(Arc::new(handler_fn(on_tallied, states)?)),
    )];
    let running = app()
        .with_state(tally.clone())
        .run_listeners(
            config(&server.url(), "state_tally", "on_tallied"),
            listeners,
        )
        .await
        .unwrap();
    assert!(
        running
            .wait_for_assignment(4, Duration::from_secs(15))
            .await
    );
    publish(&server.url(), "state_tally", N).await;
    assert!(
        wait_until(Duration::from_secs(20), || tally.load(Ordering::SeqCst)
            >= N)
        .await,
        "handled {} of {N}",
        tally.load(Ordering::SeqCst)
    );
    running.shutdown_and_wait().await.expect("clean shutdown");
    assert_eq!(tally.load(Ordering::SeqCst), N);
}
