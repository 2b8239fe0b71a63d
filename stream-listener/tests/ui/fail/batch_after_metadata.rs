use stream_listener::{Batch, Json, Metadata, stream_listener};

#[derive(serde::Deserialize)]
struct Order;

#[stream_listener(stream = "orders", group = "billing")]
async fn on_orders(metadata: Metadata, batch: Batch<Json<Order>>) {
    let _ = (metadata, batch);
}

fn main() {}
