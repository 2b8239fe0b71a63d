use stream_listener::{Json, State, stream_listener};

struct Db;

#[stream_listener(stream = "orders", group = "billing")]
async fn on_order(State(db): State<Db>, Json(id): Json<u64>) {
    let _ = (db, id);
}

fn main() {}
