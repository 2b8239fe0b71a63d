use stream_listener::{Batch, BatchError, Json, RawMessage, State, stream_listener};

#[derive(serde::Deserialize)]
struct Order {
    id: u64,
}

#[derive(Clone)]
struct Db;

/// A batch listener by its last argument's type, with a state before it.
#[stream_listener(stream = "orders", group = "billing")]
async fn on_orders(State(_db): State<Db>, batch: Batch<Json<Order>>) -> Result<(), BatchError> {
    for Json(order) in batch {
        if order.id == 0 {
            return Err(BatchError::all("order 0"));
        }
    }
    Ok(())
}

type Raw = Batch<RawMessage>;

/// `batch = true` for a type alias; returning `()` acks the batch.
#[stream_listener(stream = "raw", group = "archive", batch = true)]
async fn on_raw(batch: Raw) {
    let _ = batch.len();
}

fn main() {}
