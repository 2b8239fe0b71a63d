//! The annotated function stays an ordinary function: it can be called, e.g. in a unit test.

use stream_listener::{Json, stream_listener};

#[stream_listener(stream = "orders", group = "billing")]
pub async fn on_order(Json(amount): Json<u64>) -> Result<(), std::io::Error> {
    assert_eq!(amount, 21);
    Ok(())
}

fn main() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(on_order(Json(21))).unwrap();
}
