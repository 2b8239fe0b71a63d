//! Every extractor and every return type a listener function may have.

use serde::Deserialize;
use stream_listener::{
    BoxError, Delivery, HandlerError, Json, Message, RawMessage, stream_listener,
};

#[derive(Debug, Deserialize)]
struct Order {
    id: String,
}

#[derive(Debug)]
struct Unavailable;

impl std::fmt::Display for Unavailable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("downstream unavailable")
    }
}

impl std::error::Error for Unavailable {}

#[stream_listener(stream = "orders", group = "billing", concurrency = 4)]
async fn json_with_an_error(Json(order): Json<Order>) -> Result<(), Unavailable> {
    let _ = order.id;
    Ok(())
}

#[stream_listener(stream = "orders", group = "audit")]
async fn message_returning_unit(message: Message<Order>) {
    let _ = (&message.payload.id, &message.entry_id, message.shard, message.delivery_count);
}

#[stream_listener(stream = "orders", group = "archive", name = "archiver")]
async fn raw_with_handler_error(raw: RawMessage) -> Result<(), HandlerError> {
    match raw.payload() {
        Some(_) => Ok(()),
        None => Err(HandlerError::non_retryable("no payload")),
    }
}

#[stream_listener(stream = "orders", group = "debug", crate = "::stream_listener")]
async fn delivery_with_a_boxed_error(delivery: Delivery) -> Result<(), BoxError> {
    let _ = delivery.entry_id;
    Ok(())
}

fn main() {
    let names: Vec<&str> = stream_listener::registered_listeners()
        .iter()
        .map(|l| l.name())
        .collect();
    assert_eq!(
        names,
        ["archiver", "delivery_with_a_boxed_error", "json_with_an_error", "message_returning_unit"]
    );
}
