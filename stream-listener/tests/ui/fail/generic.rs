use stream_listener::{Json, stream_listener};

#[stream_listener(stream = "orders", group = "billing")]
async fn on_order<T: serde::de::DeserializeOwned>(Json(event): Json<T>) {
    let _ = event;
}

fn main() {}
