use stream_listener::{Json, stream_listener};

#[stream_listener(stream = "orders", group = "billing", on_assigned = "warm_up")]
async fn on_order(Json(id): Json<u64>) {
    let _ = id;
}

fn main() {}
