//! Quick start: a consumer group of four members shares a sharded Redis stream of orders.
//!
//! ```sh
//! cargo run --example quickstart
//! ```
//!
//! It uses the Redis at `REDIS_URL`, or `redis://127.0.0.1:6379`; when nothing answers there and
//! `redis-server` is installed, it starts a throwaway server for the run and says so. Then it:
//!
//! 1. starts the listener `on_order` below: four members of consumer group `quickstart` on
//!    stream `orders`, which has 4 shards (created on the first run, reused afterwards);
//! 2. publishes the 200 orders of `examples/data/orders.jsonl`, keyed by customer, so each
//!    customer's orders land on one shard and are handled in order;
//! 3. waits until every order of this run was handled, prints which member owns which shards
//!    and how many orders each handled, and shuts down gracefully.
//!
//! Delivery is at least once: after a crash or a rebalance an order can be handled twice, so a
//! real handler makes its effects idempotent (for example keyed by `order.id`).

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use stream_listener::testing::RedisServer;
use stream_listener::{Config, Json, Metadata, State, stream_listener};

#[derive(Debug, Serialize, Deserialize)]
struct Order {
    id: String,
    customer: String,
    items: Vec<Item>,
    amount: f64,
    currency: String,
    created_at: String,
}

#[derive(Debug, Serialize, Deserialize)]
struct Item {
    sku: String,
    name: String,
    quantity: u32,
    unit_price: f64,
}

/// The application's state: the entries handled so far, (shard stream, entry id) → the member
/// that handled it. Given once with `app().with_state(...)`; every call gets a clone (an `Arc`).
#[derive(Clone, Default)]
struct Handled(Arc<Mutex<BTreeMap<(String, String), String>>>);

/// The listener. Its arguments are extractors: `State<Handled>` is the application's state,
/// `Metadata` where the entry came from (stream key, entry id, member, ...), and `Json<Order>`
/// the order decoded from JSON (the payload extractor comes last).
#[stream_listener(stream = "orders", group = "quickstart", concurrency = 4)]
async fn on_order(State(handled): State<Handled>, entry: Metadata, Json(_order): Json<Order>) {
    // A real handler would bill `_order` here, idempotently (keyed by its id).
    handled
        .0
        .lock()
        .unwrap()
        .insert((entry.stream_key, entry.entry_id), entry.member_id);
}

const DEFAULT_URL: &str = "redis://127.0.0.1:6379";

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_target(false)
        .with_writer(std::io::stderr)
        .init();
    let (url, _server) = find_redis().await?;

    // The configuration; a program would keep it in stream-listener.toml.
    let config = Config::from_toml_str(
        &format!(
            r#"
            [redis]
            url = "{url}"
            startup_timeout = "10s"

            [coordination]              # short timings, so the group settles in about a second
            heartbeat_interval = "500ms"
            member_lease_ttl = "3s"

            [streams.orders]
            shards = 4                  # created at startup if it does not exist
            "#
        ),
        "quickstart config",
    )?;
    let handled = Handled::default();
    let app = stream_listener::app()
        .with_state(handled.clone())
        .run_with(config.clone())
        .await?;
    if !app.wait_for_assignment(4, Duration::from_secs(30)).await {
        eprintln!("the 4 shards were not assigned within 30 s; continuing anyway");
    }

    let publisher = config.publisher("orders").await?;
    let orders: Vec<(String, Order)> = include_str!("data/orders.jsonl")
        .lines()
        .map(|line| serde_json::from_str::<Order>(line).map(|o| (o.customer.clone(), o)))
        .collect::<Result<_, _>>()?;
    let published = publisher.publish_batch(&orders).await?;
    let mine: HashSet<(String, String)> = published
        .into_iter()
        .map(|p| (p.stream_key, p.entry_id))
        .collect();
    println!("published {} orders to stream `orders`", mine.len());

    // Wait (at most 60 s) until every order of this run was handled.
    let deadline = Instant::now() + Duration::from_secs(60);
    let handled_by = loop {
        let so_far = handled.0.lock().unwrap().clone();
        let done = mine.iter().all(|entry| so_far.contains_key(entry));
        if done || Instant::now() > deadline {
            break so_far;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let mut per_member: BTreeMap<String, usize> = BTreeMap::new();
    for (entry, member) in &handled_by {
        if mine.contains(entry) {
            *per_member.entry(member.clone()).or_default() += 1;
        }
    }

    println!("\nmember                                       shards  orders handled");
    for listener in app.status() {
        for member in listener.members {
            let count = per_member.get(&member.member_id).copied().unwrap_or(0);
            let shards = format!("{:?}", member.owned);
            println!("{:<44} {shards:<7} {count}", member.member_id);
        }
    }
    let total: usize = per_member.values().sum();
    println!("{total} of {} orders handled\n", mine.len());

    app.shutdown_and_wait().await?;
    println!("shut down cleanly");
    if total < mine.len() {
        return Err(format!("only {total} of {} orders were handled in 60 s", mine.len()).into());
    }
    Ok(())
}

/// `REDIS_URL`, or the default address; when nothing answers at the default address, a
/// throwaway `redis-server` (kept alive by the returned handle).
async fn find_redis() -> Result<(String, Option<RedisServer>), Box<dyn std::error::Error>> {
    if let Ok(url) = std::env::var("REDIS_URL") {
        return Ok((url, None));
    }
    if answers(DEFAULT_URL).await {
        return Ok((DEFAULT_URL.to_owned(), None));
    }
    match RedisServer::start() {
        Ok(server) => {
            println!(
                "nothing answers at {DEFAULT_URL}: started a throwaway redis-server at {} for this run",
                server.url()
            );
            Ok((server.url(), Some(server)))
        }
        Err(error) => Err(format!(
            "nothing answers at {DEFAULT_URL} and no redis-server could be started ({error}); start Redis 7 or newer, or set REDIS_URL"
        )
        .into()),
    }
}

async fn answers(url: &str) -> bool {
    let ping = async {
        let client = redis::Client::open(url)?;
        let mut connection = client.get_multiplexed_async_connection().await?;
        redis::cmd("PING").query_async::<()>(&mut connection).await
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(1), ping).await,
        Ok(Ok(()))
    )
}
