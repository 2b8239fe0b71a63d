use stream_listener::{Json, Metadata, stream_listener};

#[stream_listener(stream = "orders", group = "billing")]
async fn on_order(Json(id): Json<u64>, metadata: Metadata) {
    let _ = (id, metadata);
}

fn main() {}
