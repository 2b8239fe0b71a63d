//! `RunningApp::run_until_signal` (what `run()` ends with) shuts down gracefully on SIGTERM:
//! the members leave the group and it returns `Ok` (docs/design.md §8.13, shutdown). One test per
//! binary: the signal goes to the whole test process.

use std::time::{Duration, Instant};

use stream_listener::testing::RedisServer;
use stream_listener::{Config, RawMessage, RunningApp, run_with, stream_listener};

#[stream_listener(stream = "signals", group = "g")]
async fn on_entry(_: RawMessage) {}

#[test]
fn handles_are_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<RunningApp>();
    check::<stream_listener::RunError>();
    check::<Config>();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_shuts_down_gracefully() {
    let server = RedisServer::start().unwrap();
    let text = format!(
        "[redis]\nurl = \"{}\"\n[coordination]\nheartbeat_interval = \"200ms\"\nmember_lease_ttl = \"1500ms\"\n[streams.signals]\nshards = 2\n",
        server.url()
    );
    let app = run_with(Config::from_toml_str(&text, "signal.toml").unwrap())
        .await
        .unwrap();
    assert!(app.wait_for_assignment(2, Duration::from_secs(15)).await);
    let mut conn = stream_listener::core::internals::connection::RedisConnection::connect(
        &stream_listener::core::internals::connection::RedisTarget::standalone(server.url()),
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    let live = leases(&mut conn).await;
    assert_eq!(live.len(), 1, "one member holds a lease: {live:?}");
    let running = tokio::spawn(app.run_until_signal());
    // Let the task install its handlers before the signal is sent.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let sent = Instant::now();
    let status = std::process::Command::new("kill")
        .args(["-TERM", &std::process::id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let result = tokio::time::timeout(Duration::from_secs(10), running)
        .await
        .expect("shut down within 10 s")
        .unwrap();
    result.unwrap();
    assert!(sent.elapsed() < Duration::from_secs(10));

    // Every member left: the group has no live member.
    let live = leases(&mut conn).await;
    assert!(live.is_empty(), "members left the group: {live:?}");
}

async fn leases(
    conn: &mut stream_listener::core::internals::connection::RedisConnection,
) -> Vec<String> {
    redis::cmd("ZRANGE")
        .arg("sl:{signals:g}:leases")
        .arg(0)
        .arg(-1)
        .query_async(conn)
        .await
        .unwrap()
}
