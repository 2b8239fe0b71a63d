use stream_listener::{Json, ShardHookContext, stream_listener};

async fn flush(_context: ShardHookContext) -> u32 {
    7
}

#[stream_listener(stream = "orders", group = "billing", on_lost = flush)]
async fn on_order(Json(id): Json<u64>) {
    let _ = id;
}

fn main() {}
