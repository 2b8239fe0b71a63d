use stream_listener::{Json, stream_listener};

struct Billing;

impl Billing {
    #[stream_listener(stream = "orders", group = "billing")]
    async fn on_order(&self, Json(id): Json<u64>) {
        let _ = id;
    }
}

fn main() {}
