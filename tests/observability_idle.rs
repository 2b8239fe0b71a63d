//! `/metrics` keeps the member's and the shards' gauges while the members run (docs/design.md
//! §13.1), against the Prometheus exporter's idle timeout, which deletes a gauge not set for
//! 3 × its idle unit:
//!
//! - a gauge forgotten while nothing set it (Redis frozen: no heartbeat response, no sample)
//!   comes back with the next set; it used to stay gone for the life of the handle (the
//!   member's, or the shard task's), since a handle resolved before the deletion wrote to the
//!   deleted storage;
//! - with a `metrics_interval` shorter than a third of the heartbeat interval or of `block`,
//!   the member's gauges (set once per heartbeat response) and an idle shard's (once per
//!   `block`) used to be forgotten between two sets; the idle unit now covers both.
//!
//! Both tests use the same timings: the process's recorder is installed once, by the first app.

#[allow(dead_code)]
#[path = "support/http.rs"]
mod http;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use stream_listener::core::handler::HandlerFuture;
use stream_listener::testing::RedisServer;
use stream_listener::{Config, Delivery, ListenerRegistration, RunningApp, run_listeners};

const SERIES: [&str; 3] = [
    "stream_listener_owned_shards{",
    "stream_listener_member_epoch{",
    "stream_listener_shard_lag{",
];

fn handler(_: Delivery) -> HandlerFuture {
    Box::pin(async { Ok(()) })
}

/// 1 s heartbeats and blocks, gauges sampled every 100 ms: before the fix, gauges were
/// forgotten after 300 ms without a set.
async fn start(
    server: &RedisServer,
    stream: &'static str,
    group: &'static str,
) -> (RunningApp, SocketAddr) {
    let addr: SocketAddr = format!("127.0.0.1:{}", http::free_port()).parse().unwrap();
    let text = format!(
        r#"
[redis]
url = "{url}"

[coordination]
heartbeat_interval = "1s"
member_lease_ttl = "10s"
rebalance_timeout = "12s"

[streams.{stream}]
shards = 2

[listeners.on_idle]
block = "1s"
handler_timeout = "2s"

[observability]
listen = "{addr}"
metrics_interval = "100ms"
"#,
        url = server.url()
    );
    let config = Config::from_toml_str(&text, "idle-test.toml").unwrap();
    let registration = ListenerRegistration::new("on_idle", stream, group, handler);
    let app = run_listeners(config, vec![registration]).await.unwrap();
    http::wait_for(addr, "/readyz", Duration::from_secs(15), "ready", |s, _| {
        s == 200
    })
    .await;
    (app, addr)
}

/// The series of `SERIES` that one scrape of `/metrics` lacks for `group`: the shard lag of
/// each of the two shards (`shard 1 lag`: the one that is not the member's lowest, which an
/// idle member does not sample again, only sets again).
async fn missing(addr: SocketAddr, group: &str) -> Vec<&'static str> {
    let (status, body) = http::get(addr, "/metrics").await.unwrap();
    assert_eq!(status, 200, "{body}");
    let label = format!("group=\"{group}\"");
    let has = |name: &str, extra: &str| {
        body.lines()
            .any(|line| line.starts_with(name) && line.contains(&label) && line.contains(extra))
    };
    let mut gone: Vec<&'static str> = SERIES.into_iter().filter(|name| !has(name, "")).collect();
    if !has("stream_listener_shard_lag{", "shard=\"1\"") {
        gone.push("shard 1 lag");
    }
    gone
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gauges_stay_in_every_scrape_with_a_short_metrics_interval() {
    let server = RedisServer::start().unwrap();
    let group = "steady_group";
    let (app, addr) = start(&server, "steady_events", group).await;
    // 60 scrapes over 6 s: six heartbeat intervals and blocks, twice the exporter's idle
    // timeout.
    let mut gaps = Vec::new();
    for scrape in 0..60 {
        for name in missing(addr, group).await {
            gaps.push((scrape, name));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(gaps, [], "series missing from scrapes (scrape, series)");
    app.shutdown_and_wait().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gauges_forgotten_during_a_redis_freeze_come_back_after_it() {
    let server = RedisServer::start().unwrap();
    let group = "frozen_group";
    let (app, addr) = start(&server, "frozen_events", group).await;
    assert_eq!(missing(addr, group).await, Vec::<&str>::new());
    // Frozen for longer than the idle timeout (3 × 1 s): nothing sets the gauges meanwhile.
    server.pause().unwrap();
    let frozen = Instant::now();
    let deadline = frozen + Duration::from_secs(10);
    while missing(addr, group).await.len() < SERIES.len() + 1 {
        assert!(Instant::now() < deadline, "the gauges were never forgotten");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    server.resume().unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let gone = missing(addr, group).await;
        if gone.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still missing 15 s after Redis came back: {gone:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    app.shutdown_and_wait().await.expect("clean shutdown");
}
