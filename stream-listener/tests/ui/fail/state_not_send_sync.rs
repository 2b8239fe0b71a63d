use std::rc::Rc;

use stream_listener::{Json, State, stream_listener};

#[stream_listener(stream = "orders", group = "billing")]
async fn on_order(State(counter): State<Rc<u64>>, Json(id): Json<u64>) {
    let _ = (counter, id);
}

fn main() {}
