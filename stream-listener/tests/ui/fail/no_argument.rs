use stream_listener::stream_listener;

#[stream_listener(stream = "orders", group = "billing")]
async fn on_order() {}

fn main() {}
