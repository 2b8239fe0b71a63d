use stream_listener::{Json, stream_listener};

async fn flush(shard: u32) -> Result<(), std::io::Error> {
    let _ = shard;
    Ok(())
}

#[stream_listener(stream = "orders", group = "billing", on_revoked = flush)]
async fn on_order(Json(id): Json<u64>) {
    let _ = id;
}

fn main() {}
