//! The handler model of README "Handlers" in one service: shared state and several extractors,
//! a batch listener, key-ordered parallelism, pause / resume, `pause_shard`, a producer-only
//! stream and the shutdown result.
//!
//! ```sh
//! redis-server --port 6390 --save '' &         # or any Redis 7; REDIS_URL says where
//! REDIS_URL=redis://127.0.0.1:6390 STREAM_LISTENER_CONFIG=examples/handlers.toml \
//!     cargo run --example handlers
//! ```
//!
//! `examples/handlers.toml` declares the streams `orders` (4 shards), `payments` (2) and
//! `invoices` (2, producer-only), and sets `ordering = "key"` for `on_order` and
//! `batch_max_wait` for the batch listener `on_orders`. The example then:
//!
//! 1. publishes to `invoices` with `Config::load()?.publisher("invoices")`, which creates the
//!    declared stream on the first run (no listener, no admin step);
//! 2. starts the three listeners with two states (`app().with_state(..).with_state(..)`);
//! 3. publishes 200 orders of 10 customers: `on_order` (group `billing`) handles different
//!    customers of a shard at once and each customer's orders in order; `on_orders` (group
//!    `audit`) gets them in batches and fails one entry once with `BatchError::at`, so the
//!    entries before it are acked and the rest retried;
//! 4. pauses every listener (`app.handle().pause()`), publishes an order, shows that nothing is
//!    handled while paused, and resumes;
//! 5. publishes a payment while the "gateway" is down: `on_payment` returns
//!    `HandlerError::pause_shard`, and the same entry is tried again after each pause (same
//!    attempt number) until the gateway is back;
//! 6. shuts down and returns the `ShutdownError` if the shutdown was not clean.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use stream_listener::{
    Batch, BatchError, Config, HandlerError, Json, Metadata, State, stream_listener,
};

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Order {
    id: String,
    customer: String,
    seq: u32,
}

#[derive(Debug, Serialize, Deserialize)]
struct Payment {
    id: String,
}

/// The application's "database": what the order listeners did.
#[derive(Clone, Default)]
struct Db {
    /// Customer → the `seq` of each order billed, in the order they were billed.
    billed: Arc<Mutex<HashMap<String, Vec<u32>>>>,
    /// Handler calls of `on_order` running now, and the most seen at once.
    running: Arc<AtomicUsize>,
    most_at_once: Arc<AtomicUsize>,
    /// Order ids audited by the batch listener, and the size of each batch.
    audited: Arc<Mutex<Vec<String>>>,
    batch_sizes: Arc<Mutex<Vec<usize>>>,
    /// The batch listener fails this order once.
    fail_once: Arc<Mutex<Option<String>>>,
}

impl Db {
    fn billed_count(&self) -> usize {
        self.billed.lock().unwrap().values().map(Vec::len).sum()
    }
}

/// A payment gateway that can be down.
#[derive(Clone, Default)]
struct Gateway {
    down: Arc<AtomicBool>,
    /// (payment id, attempt) of each call.
    calls: Arc<Mutex<Vec<(String, u32)>>>,
    charged: Arc<Mutex<Vec<String>>>,
}

#[derive(Debug)]
struct AuditStoreBusy;

impl std::fmt::Display for AuditStoreBusy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the audit store is busy")
    }
}

impl std::error::Error for AuditStoreBusy {}

/// Per entry, several extractors: the state, the entry's metadata and the decoded order.
/// `ordering = "key"` (handlers.toml): the customers of a shard run at once, each in order.
#[stream_listener(stream = "orders", group = "billing", concurrency = 2)]
async fn on_order(
    State(db): State<Db>,
    meta: Metadata,
    Json(order): Json<Order>,
) -> Result<(), HandlerError> {
    // The publisher routed by customer: the partition key is the customer.
    debug_assert_eq!(meta.partition_key.as_deref(), Some(order.customer.as_str()));
    let now = db.running.fetch_add(1, Ordering::SeqCst) + 1;
    db.most_at_once.fetch_max(now, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(5)).await; // an IO-bound call
    db.billed
        .lock()
        .unwrap()
        .entry(order.customer)
        .or_default()
        .push(order.seq);
    db.running.fetch_sub(1, Ordering::SeqCst);
    Ok(())
}

/// A batch listener: the state, then the batch (its last argument).
#[stream_listener(stream = "orders", group = "audit")]
async fn on_orders(State(db): State<Db>, batch: Batch<Json<Order>>) -> Result<(), BatchError> {
    db.batch_sizes.lock().unwrap().push(batch.len());
    for (i, Json(order)) in batch.iter().enumerate() {
        let fail = {
            let mut fail_once = db.fail_once.lock().unwrap();
            let fail = fail_once.as_deref() == Some(order.id.as_str());
            if fail {
                *fail_once = None;
            }
            fail
        };
        if fail {
            // Entries 0..i are done (acked); i and the rest are retried.
            return Err(BatchError::at(i, AuditStoreBusy));
        }
        db.audited.lock().unwrap().push(order.id.clone());
    }
    Ok(())
}

/// A dependency that is down pauses the shard; the entry is tried again after the pause.
#[stream_listener(stream = "payments", group = "gateway")]
async fn on_payment(
    State(gateway): State<Gateway>,
    meta: Metadata,
    Json(payment): Json<Payment>,
) -> Result<(), HandlerError> {
    gateway
        .calls
        .lock()
        .unwrap()
        .push((payment.id.clone(), meta.attempt));
    if gateway.down.load(Ordering::SeqCst) {
        return Err(HandlerError::pause_shard(Duration::from_millis(300)));
    }
    gateway.charged.lock().unwrap().push(payment.id);
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_target(false)
        .with_writer(std::io::stderr)
        .init();

    // 1. Producer-only: `invoices` is declared in the config and created here if needed.
    let invoices = Config::load()?.publisher("invoices").await?;
    let invoice = Order {
        id: "invoice-1".into(),
        customer: "customer-1".into(),
        seq: 0,
    };
    invoices.publish("customer-1", &invoice).await?;
    println!("1. published to the producer-only stream `invoices`");

    // 2. The listeners, with two states.
    let config = Config::load()?;
    let db = Db::default();
    let gateway = Gateway::default();
    let app = stream_listener::app()
        .with_state(db.clone())
        .with_state(gateway.clone())
        .run_with(config.clone())
        .await?;
    // `wait_for_assignment` takes one shard count for every listener; these streams differ.
    wait_until("the assignment", || {
        app.status().iter().all(|listener| {
            let shards = if listener.stream == "orders" { 4 } else { 2 };
            listener.owned_shards().len() == shards
        })
    })
    .await?;
    println!("2. listeners started and assigned");

    // 3. Key-ordered parallelism and a batch listener.
    let orders = config.publisher("orders").await?;
    let mut batch = Vec::new();
    for seq in 0..20 {
        for c in 0..10 {
            let customer = format!("customer-{c}");
            let id = format!("order-{c}-{seq}");
            batch.push((customer.clone(), Order { id, customer, seq }));
        }
    }
    *db.fail_once.lock().unwrap() = Some("order-3-7".into());
    orders.publish_batch(&batch).await?;
    wait_until("200 orders billed", || db.billed_count() == 200).await?;
    let in_order = db
        .billed
        .lock()
        .unwrap()
        .values()
        .all(|seqs| *seqs == (0..20).collect::<Vec<_>>());
    println!(
        "3. billed 200 orders, up to {} at once, each customer's in order: {in_order}",
        db.most_at_once.load(Ordering::SeqCst)
    );
    wait_until("200 orders audited", || {
        db.audited.lock().unwrap().len() == 200
    })
    .await?;
    println!(
        "   audited 200 orders in batches of {:?} (order-3-7 failed once: its batch went on from it)",
        db.batch_sizes.lock().unwrap()
    );

    // 4. Pause and resume every listener of the app.
    app.handle().pause();
    let before = db.billed_count();
    let late = Order {
        id: "order-0-20".into(),
        customer: "customer-0".into(),
        seq: 20,
    };
    orders.publish("customer-0", &late).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let health = app.handle().health();
    let paused = health.iter().filter(|m| m.paused).count();
    let ready = health.iter().filter(|m| m.ready).count();
    println!(
        "4. paused: {} orders handled in 1 s; of {} members, {paused} paused, {ready} ready",
        db.billed_count() - before,
        health.len()
    );
    app.handle().resume();
    wait_until("the order published while paused", || {
        db.billed_count() == before + 1
    })
    .await?;
    println!("   resumed: the order published while paused is handled");

    // 5. pause_shard while the gateway is down.
    let payments = config.publisher("payments").await?;
    gateway.down.store(true, Ordering::SeqCst);
    payments
        .publish(
            "account-1",
            &Payment {
                id: "payment-1".into(),
            },
        )
        .await?;
    wait_until("three paused calls", || {
        gateway.calls.lock().unwrap().len() >= 3
    })
    .await?;
    gateway.down.store(false, Ordering::SeqCst);
    wait_until("the payment charged", || {
        !gateway.charged.lock().unwrap().is_empty()
    })
    .await?;
    let calls = gateway.calls.lock().unwrap().clone();
    println!(
        "5. payment-1 charged after {} calls, (id, attempt) each: {calls:?}",
        calls.len()
    );

    // 6. A shutdown that was not clean is an error (`ShutdownError`).
    app.shutdown_and_wait().await?;
    println!("6. shut down cleanly");
    Ok(())
}

/// Waits (at most 30 s) until `done` holds.
async fn wait_until(
    what: &str,
    mut done: impl FnMut() -> bool,
) -> Result<(), Box<dyn std::error::Error>> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !done() {
        if Instant::now() > deadline {
            return Err(format!("timed out waiting for {what}").into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}
