//! Observability: a listener with lifecycle hooks that reads message headers, served on
//! `/metrics`, `/healthz` and `/readyz` by `run()`.
//!
//! ```sh
//! redis-server --port 6390 --save '' &         # or any Redis 7; REDIS_URL says where
//! export REDIS_URL=redis://127.0.0.1:6390
//! export STREAM_LISTENER_CONFIG=examples/observed.toml
//! cargo run --example observed                 # the listener, until Ctrl-C
//! cargo run --example observed -- publish 100  # in another shell: 100 orders with headers
//! curl -s localhost:9464/readyz; curl -s localhost:9464/metrics | grep stream_listener_
//! cargo run -p stream-listener -- group describe orders observed --watch
//! ```
//!
//! `examples/observed.toml` creates the stream `orders` with 4 shards and sets
//! `[observability] listen = "127.0.0.1:9464"` (in a container: `"0.0.0.0:9464"`). While it runs:
//! `/readyz` is 503 until both members hold their shards, the hooks print each shard gained and
//! released (also at Ctrl-C), and after a publish `stream_listener_messages_handled_total` grows
//! by the count and `stream_listener_group_lag` drops back to 0 within a `metrics_interval`.

use serde::{Deserialize, Serialize};
use stream_listener::{Config, Headers, Message, ShardHookContext, stream_listener};

#[derive(Debug, Serialize, Deserialize)]
struct Order {
    id: String,
    amount: f64,
}

/// A member gained a shard: before its first handler runs.
async fn assigned(cx: ShardHookContext) {
    println!(
        "assigned: {} owns shard {} of {} (epoch {})",
        cx.member_id, cx.shard, cx.stream, cx.member_epoch
    );
}

/// A member gives a shard up in order: its handlers finished and their acks are written.
async fn revoked(cx: ShardHookContext) -> Result<(), std::io::Error> {
    println!("revoked: {} releases shard {}", cx.member_id, cx.shard);
    Ok(())
}

/// The listener: two members of group `observed`, hooks registered through the attribute.
#[stream_listener(stream = "orders", group = "observed", concurrency = 2,
                  on_assigned = assigned, on_revoked = revoked)]
async fn on_order(message: Message<Order>) {
    let tenant = message.headers().get_str("tenant").unwrap_or("-");
    let correlation = message.headers().get_str("correlation-id").unwrap_or("-");
    println!(
        "order {} ({}) of tenant {tenant}, correlation {correlation}, shard {}",
        message.payload.id, message.payload.amount, message.shard
    );
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_target(false)
        .with_writer(std::io::stderr)
        .init();
    let mut args = std::env::args().skip(1);
    match args.next().as_deref() {
        None => Ok(stream_listener::run().await?),
        Some("publish") => {
            let count: usize = args.next().map(|n| n.parse()).transpose()?.unwrap_or(10);
            let config = Config::load()?;
            let publisher = config.publisher("orders").await?;
            for n in 0..count {
                let order = Order {
                    id: format!("o-{n}"),
                    amount: n as f64,
                };
                let headers = Headers::new()
                    .with("tenant", if n % 2 == 0 { "acme" } else { "globex" })
                    .with("correlation-id", format!("c-{n}"));
                publisher
                    .publish_with_headers(&format!("customer-{n}"), &order, &headers)
                    .await?;
            }
            println!("published {count} orders to stream `orders`");
            Ok(())
        }
        Some(other) => {
            Err(format!("unknown command `{other}`: no argument, or `publish [N]`").into())
        }
    }
}
