//! Gauges forgotten by the exporter come back (docs/design.md §13.1, §13.2): `run()`'s
//! Prometheus recorder forgets a gauge idle for 3 × `metrics_interval`; the next time a member
//! sets it, it must be exported again. Its own test binary: the recorder is installed once per
//! process, and the first app's `metrics_interval` sets the idle timeout.

#[allow(dead_code)]
#[path = "support/http.rs"]
mod http;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use stream_listener::core::handler::HandlerFuture;
use stream_listener::testing::RedisServer;
use stream_listener::{Config, Delivery, ListenerRegistration, run_listeners};

const STREAM: &str = "gauges";
const GROUP: &str = "gauges_group";
const WAIT: Duration = Duration::from_secs(10);

fn handler(_: Delivery) -> HandlerFuture {
    Box::pin(async { Ok(()) })
}

/// `metrics_interval` 100 ms: gauges are forgotten after 300 ms without a set. An idle shard task
/// waits up to `block` (1 s) between two samples and heartbeats come every 500 ms, so the shard
/// and member gauges are forgotten between two sets of each.
fn config(url: &str) -> Config {
    let text = format!(
        r#"
[redis]
url = "{url}"

[coordination]
heartbeat_interval = "500ms"
member_lease_ttl = "1500ms"
rebalance_timeout = "3s"

[streams.{STREAM}]
shards = 2

[listeners.on_gauges]
handler_timeout = "2s"
block = "1s"

[observability]
listen = "127.0.0.1:0"
metrics_interval = "100ms"
"#
    );
    Config::from_toml_str(&text, "gauges-test.toml").unwrap()
}

/// The `/metrics` lines of `name` with exactly `labels` before the value (`{…}` of the line).
async fn lines(addr: SocketAddr, name: &str) -> Vec<String> {
    let (status, text) = http::get(addr, "/metrics").await.unwrap();
    assert_eq!(status, 200, "{text}");
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .map(str::to_owned)
        .collect()
}

/// Polls `/metrics` every 10 ms until `done(lines of name)` holds; panics after `WAIT`.
async fn wait_lines(addr: SocketAddr, name: &str, what: &str, done: impl Fn(&[String]) -> bool) {
    let deadline = Instant::now() + WAIT;
    loop {
        let found = lines(addr, name).await;
        if done(&found) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not within {WAIT:?}; last lines of {name}: {found:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gauges_forgotten_while_idle_are_exported_again_at_the_next_set() {
    let server = RedisServer::start().unwrap();
    let listeners = vec![ListenerRegistration::new(
        "on_gauges",
        STREAM,
        GROUP,
        handler,
    )];
    let app = run_listeners(config(&server.url()), listeners)
        .await
        .unwrap();
    let addr = app.observability_addr().expect("listening");
    http::wait_for(addr, "/readyz", WAIT, "ready", |status, _| status == 200).await;

    let lag =
        format!(r#"stream_listener_shard_lag{{stream="{STREAM}",group="{GROUP}",shard="0"}} 0"#);
    let owned = |l: &[String]| {
        l.len() == 1
            && l[0].starts_with(&format!(
                r#"stream_listener_owned_shards{{stream="{STREAM}",group="{GROUP}",listener="on_gauges",member=""#
            ))
            && l[0].ends_with("} 2")
    };
    for round in 0..3 {
        // Set: exported with its exact value (nothing published: lag 0; one member: 2 shards).
        wait_lines(
            addr,
            "stream_listener_shard_lag",
            &format!("shard 0 lag set ({round})"),
            |l| l.contains(&lag),
        )
        .await;
        wait_lines(
            addr,
            "stream_listener_owned_shards",
            &format!("owned shards set ({round})"),
            owned,
        )
        .await;
        // Idle past 3 intervals: forgotten.
        wait_lines(
            addr,
            "stream_listener_shard_lag",
            &format!("shard 0 lag forgotten ({round})"),
            |l| !l.contains(&lag),
        )
        .await;
        wait_lines(
            addr,
            "stream_listener_owned_shards",
            &format!("owned shards forgotten ({round})"),
            |l| l.is_empty(),
        )
        .await;
    }
    app.shutdown_and_wait().await;
}
