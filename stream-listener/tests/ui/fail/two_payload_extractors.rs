use stream_listener::{Json, Message, stream_listener};

#[stream_listener(stream = "orders", group = "billing")]
async fn on_order(Json(id): Json<u64>, message: Message<u64>) {
    let _ = (id, message);
}

fn main() {}
