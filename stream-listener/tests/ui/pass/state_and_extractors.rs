//! Shared state and several extractors: `State<T>` (several types), parts extractors before the
//! payload one, a parts extractor last, no argument at all, and `handler_fn` without the
//! attribute.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::Deserialize;
use stream_listener::core::handler::Handler;
use stream_listener::{
    Delivery, HandlerError, Headers, Json, Message, Metadata, State, States, handler_fn,
    stream_listener,
};

#[derive(Debug, Deserialize)]
struct Order {
    id: String,
}

#[derive(Clone, Default)]
struct Counter(Arc<AtomicU64>);

#[derive(Clone)]
struct Db {
    url: &'static str,
}

#[stream_listener(stream = "orders", group = "billing")]
async fn on_order(
    State(counter): State<Counter>,
    State(db): State<Db>,
    metadata: Metadata,
    headers: Headers,
    Json(order): Json<Order>,
) -> Result<(), HandlerError> {
    let _ = (db.url, metadata.entry_id, headers.get_str("tenant"), order.id);
    counter.0.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

#[stream_listener(stream = "orders", group = "audit")]
async fn message_after_state(State(counter): State<Counter>, message: Message<Order>) {
    let _ = (counter, &message.payload.id, message.shard);
}

#[stream_listener(stream = "orders", group = "tenants")]
async fn parts_last(State(db): State<Db>, headers: Headers) {
    let _ = (db.url, headers);
}

#[stream_listener(stream = "orders", group = "ticks")]
async fn no_argument() {}

async fn without_the_attribute(
    State(counter): State<Counter>,
    delivery: Delivery,
    Json(order): Json<Order>,
) {
    let _ = (counter, &delivery.entry_id, order.id);
}

fn main() {
    let states = States::new().with(Counter::default());
    let handler = handler_fn(without_the_attribute, &states).unwrap();
    fn is_handler(_: &impl Handler) {}
    is_handler(&handler);
    let names: Vec<&str> = stream_listener::registered_listeners()
        .iter()
        .map(|l| l.name())
        .collect();
    assert_eq!(names, ["message_after_state", "no_argument", "on_order", "parts_last"]);
}
