use stream_listener::stream_listener;

#[stream_listener(stream = "orders", group = "billing")]
struct OnOrder;

fn main() {}
