use std::rc::Rc;

use stream_listener::{Json, stream_listener};

async fn save(_: u64) {}

#[stream_listener(stream = "orders", group = "billing")]
async fn on_order(Json(id): Json<u64>) {
    let shared = Rc::new(id);
    save(*shared).await;
}

fn main() {}
