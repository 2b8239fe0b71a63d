use stream_listener::{Json, stream_listener};

#[stream_listener(group = "billing")]
async fn on_order(Json(id): Json<u64>) {
    let _ = id;
}

fn main() {}
