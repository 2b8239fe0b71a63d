//! TLS on real servers (README "TLS", docs/design.md §15.1): `run_with` consumes what a publisher
//! sends over `rediss://` verified against `tls_ca_file` (a standalone server and a cluster),
//! mutual TLS with a client certificate, `tls_insecure`, and the startup errors of a wrong CA, a
//! missing client certificate and a plaintext URL against a TLS-only server: clear, typed and
//! immediate, not retried until `startup_timeout`.

mod support;

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use stream_listener::core::internals::connection::{RedisConnection, RedisFailure, tls_advice};
use stream_listener::testing::{RedisCluster, RedisServer, TlsAuthClients, TlsMaterial};
use stream_listener::{
    Config, HandlerError, Message, RunError, RunningApp, run_with, stream_listener,
};

#[derive(Debug, Serialize, Deserialize)]
struct Event {
    seq: u64,
}

/// The seq of every event `on_tls_event` handled (each test uses its own range).
static HANDLED: Mutex<Vec<u64>> = Mutex::new(Vec::new());

#[stream_listener(stream = "tls_events", group = "tls_group")]
async fn on_tls_event(message: Message<Event>) -> Result<(), HandlerError> {
    HANDLED.lock().unwrap().push(message.payload.seq);
    Ok(())
}

/// A startup timeout far longer than any assertion's bound: an error that arrives within a few
/// seconds was not retried until it.
const STARTUP_TIMEOUT: &str = "30s";
/// How soon a TLS startup error must arrive.
const FAIL_FAST: Duration = Duration::from_secs(5);

/// The `[redis]` target lines (`url = ...` or `cluster_nodes = [...]` and `tls_*`) with short
/// protocol timings.
fn config(redis: &str) -> Config {
    let text = format!(
        r#"
[redis]
{redis}
startup_timeout = "{STARTUP_TIMEOUT}"

[coordination]
heartbeat_interval = "200ms"
member_lease_ttl = "1500ms"
rebalance_timeout = "3s"

[streams.tls_events]
shards = 2

[listeners.on_tls_event]
handler_timeout = "2s"
block = "300ms"
"#
    );
    Config::from_toml_str(&text, "tls-test.toml").unwrap()
}

/// `key = "path"` (TOML-escaped).
fn path_line(key: &str, path: &Path) -> String {
    format!("{key} = {:?}\n", path.display().to_string())
}

fn ca_line(material: &TlsMaterial) -> String {
    path_line("tls_ca_file", material.ca_file())
}

fn client_cert_lines(material: &TlsMaterial) -> String {
    path_line("tls_cert_file", material.client_cert_file())
        + &path_line("tls_key_file", material.client_key_file())
}

/// Publishes `seqs` through `config`'s publisher and waits until each is handled and no entry of
/// the group is pending (every one acked).
async fn publish_and_consume(app: &RunningApp, config: &Config, seqs: std::ops::Range<u64>) {
    assert!(
        app.wait_for_assignment(2, Duration::from_secs(20)).await,
        "2 shards assigned: {:?}",
        app.status()
    );
    let publisher = config.publisher("tls_events").await.unwrap();
    let events: Vec<(String, Event)> = seqs
        .clone()
        .map(|seq| (format!("key-{seq}"), Event { seq }))
        .collect();
    publisher.publish_batch(&events).await.unwrap();
    let expected: BTreeSet<u64> = seqs.collect();
    let mut conn = RedisConnection::connect(&config.redis.target(), Duration::from_secs(5))
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let seen: BTreeSet<u64> = HANDLED
            .lock()
            .unwrap()
            .iter()
            .copied()
            .filter(|seq| expected.contains(seq))
            .collect();
        let mut pending = 0u64;
        for shard in 0..2 {
            let summary: redis::Value = redis::cmd("XPENDING")
                .arg(format!("{{tls_events:{shard}}}"))
                .arg("tls_group")
                .query_async(&mut conn)
                .await
                .unwrap();
            if let redis::Value::Array(items) = summary
                && let Some(redis::Value::Int(count)) = items.first()
            {
                pending += *count as u64;
            }
        }
        if seen == expected && pending == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{} of {} handled, {pending} pending",
            seen.len(),
            expected.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `run_with(config)` fails: returns the error and how long it took.
async fn startup_error(config: Config) -> (RunError, Duration) {
    let started = Instant::now();
    match run_with(config).await {
        Ok(app) => {
            app.shutdown_and_wait().await.expect("clean shutdown");
            panic!("run_with started")
        }
        Err(error) => (error, started.elapsed()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumes_over_tls_verified_against_the_ca_file() {
    let server = RedisServer::builder()
        .tls(TlsAuthClients::Optional)
        .start()
        .unwrap();
    assert!(server.url().starts_with("rediss://127.0.0.1:"));
    // The harness's own client speaks TLS too.
    let mut con = server.client().get_connection().unwrap();
    let pong: String = redis::cmd("PING").query(&mut con).unwrap();
    assert_eq!(pong, "PONG");
    let material = server.tls().unwrap();
    let config = config(&format!("url = {:?}\n{}", server.url(), ca_line(material)));
    let app = run_with(config.clone()).await.unwrap();
    publish_and_consume(&app, &config, 0..100).await;
    app.shutdown_and_wait().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_needs_the_client_certificate() {
    let server = RedisServer::builder()
        .tls(TlsAuthClients::Required)
        .start()
        .unwrap();
    let material = server.tls().unwrap();
    let url = format!("url = {:?}\n{}", server.url(), ca_line(material));

    let (error, took) = startup_error(config(&url)).await;
    assert!(took < FAIL_FAST, "failed after {took:?}");
    let RunError::RedisTls { advice, .. } = &error else {
        panic!("expected RedisTls, got {error:?}");
    };
    assert!(advice.contains("tls_cert_file"), "{advice}");
    assert!(
        error.to_string().starts_with("TLS with Redis at rediss://"),
        "{error}"
    );

    let config = config(&(url + &client_cert_lines(material)));
    let app = run_with(config.clone()).await.unwrap();
    publish_and_consume(&app, &config, 1000..1050).await;
    app.shutdown_and_wait().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_ca_is_a_clear_startup_error_at_once() {
    let server = RedisServer::builder()
        .tls(TlsAuthClients::Optional)
        .start()
        .unwrap();
    let other_dir = tempfile::tempdir().unwrap();
    let other = TlsMaterial::generate(other_dir.path()).unwrap();
    // With a password in the URL: the error names the target without it.
    let url = format!("rediss://app:s3cret@127.0.0.1:{}", server.port());
    let (error, took) = startup_error(config(&format!("url = {url:?}\n{}", ca_line(&other)))).await;
    assert!(took < FAIL_FAST, "failed after {took:?}, not at once");
    assert!(
        matches!(error, RunError::RedisTls { .. }),
        "expected RedisTls, got {error:?}"
    );
    let text = error.to_string();
    assert!(text.contains("TLS verification"), "{text}");
    assert!(text.contains("tls_ca_file"), "{text}");
    assert!(
        text.starts_with(&format!(
            "TLS with Redis at rediss://app:***@127.0.0.1:{}",
            server.port()
        )),
        "{text}"
    );
    assert!(!format!("{error:?}").contains("s3cret"), "{error:?}");

    // The one place that reads redis-rs's errors says the same to every caller.
    let target = config(&format!("url = {:?}\n{}", server.url(), ca_line(&other)))
        .redis
        .target();
    let error = RedisConnection::connect(&target, Duration::from_secs(5))
        .await
        .unwrap_err();
    assert_eq!(RedisFailure::of(&error), RedisFailure::TlsHandshake);
    assert!(!RedisFailure::of(&error).is_unreachable());
    assert!(tls_advice(&error).unwrap().contains("tls_ca_file"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_for_another_host_is_a_clear_startup_error_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let material = TlsMaterial::generate_for(dir.path(), &["redis.invalid"]).unwrap();
    let server = RedisServer::builder()
        .tls_material(material.clone(), TlsAuthClients::Optional)
        .start()
        .unwrap();
    let (error, took) = startup_error(config(&format!(
        "url = {:?}\n{}",
        server.url(),
        ca_line(&material)
    )))
    .await;
    assert!(took < FAIL_FAST, "failed after {took:?}, not at once");
    let RunError::RedisTls { advice, source, .. } = &error else {
        panic!("expected RedisTls, got {error:?}");
    };
    assert!(
        advice.contains("a name or IP address the certificate lists"),
        "{advice}"
    );
    assert!(
        source
            .to_string()
            .contains("not valid for name \"127.0.0.1\""),
        "{source}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plaintext_url_against_a_tls_only_server_says_use_rediss() {
    let server = RedisServer::builder()
        .tls(TlsAuthClients::Optional)
        .start()
        .unwrap();
    let plain = format!("redis://127.0.0.1:{}", server.port());
    let (error, took) = startup_error(config(&format!("url = {plain:?}\n"))).await;
    assert!(took < FAIL_FAST, "failed after {took:?}, not at once");
    let RunError::RedisTls { advice, .. } = &error else {
        panic!("expected RedisTls, got {error:?}");
    };
    assert!(advice.contains("speak TLS"), "{advice}");
    assert!(advice.contains("rediss://"), "{advice}");

    // A server that is down is still "unreachable", not a TLS failure.
    drop(server);
    let error = RedisConnection::connect(
        &config(&format!("url = {plain:?}\n")).redis.target(),
        Duration::from_secs(5),
    )
    .await
    .unwrap_err();
    assert_eq!(RedisFailure::of(&error), RedisFailure::ConnectionLost);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rediss_url_against_a_plain_server_says_use_redis() {
    let server = RedisServer::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let material = TlsMaterial::generate(dir.path()).unwrap();
    let url = format!("rediss://127.0.0.1:{}", server.port());
    let (error, took) =
        startup_error(config(&format!("url = {url:?}\n{}", ca_line(&material)))).await;
    // A plain server never answers the ClientHello: the first attempt times out (10 s), then the
    // check says why instead of retrying until startup_timeout (30 s).
    assert!(took < Duration::from_secs(15), "failed after {took:?}");
    let RunError::RedisTls { advice, .. } = &error else {
        panic!("expected RedisTls, got {error:?}");
    };
    assert!(advice.contains("does not speak TLS"), "{advice}");
    assert!(advice.contains("redis://host:port"), "{advice}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rediss_url_against_a_plain_server_says_use_redis_with_a_short_startup_timeout() {
    // The quick start's startup_timeout is 10 s, no longer than the first attempt's own timeout:
    // the check must still say why, not "cannot reach Redis ... check that Redis is running".
    let server = RedisServer::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let material = TlsMaterial::generate(dir.path()).unwrap();
    let url = format!("rediss://127.0.0.1:{}", server.port());
    let mut config = config(&format!("url = {url:?}\n{}", ca_line(&material)));
    config.redis.startup_timeout = Duration::from_secs(3);
    let (error, took) = startup_error(config).await;
    assert!(took < Duration::from_secs(8), "failed after {took:?}");
    let RunError::RedisTls { advice, .. } = &error else {
        panic!("expected RedisTls, got {error:?}");
    };
    assert!(advice.contains("does not speak TLS"), "{advice}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_insecure_connects_without_a_ca() {
    let server = RedisServer::builder()
        .tls(TlsAuthClients::Optional)
        .start()
        .unwrap();
    // Without a CA the system's roots do not know the test CA: verification fails.
    let (error, _) = startup_error(config(&format!("url = {:?}\n", server.url()))).await;
    assert!(matches!(error, RunError::RedisTls { .. }), "{error:?}");

    // The opt-out is logged once, as a warning naming the target (this thread's subscriber:
    // run_with's startup runs on the test's thread).
    let (logs, subscriber) = support::logs::subscriber(tracing::Level::WARN);
    let guard = tracing::subscriber::set_default(subscriber);
    let config = config(&format!("url = {:?}\ntls_insecure = true\n", server.url()));
    let app = run_with(config.clone()).await.unwrap();
    drop(guard);
    let warnings: Vec<String> = logs
        .lines()
        .into_iter()
        .filter(|line| line.contains("tls_insecure"))
        .collect();
    assert_eq!(warnings.len(), 1, "{warnings:#?}");
    assert!(warnings[0].contains(" WARN "), "{}", warnings[0]);
    assert!(warnings[0].contains(&server.url()), "{}", warnings[0]);
    publish_and_consume(&app, &config, 2000..2020).await;
    app.shutdown_and_wait().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumes_from_a_tls_cluster() {
    let cluster = RedisCluster::builder().tls().start().unwrap();
    let nodes = cluster
        .urls()
        .iter()
        .map(|u| format!("{u:?}"))
        .collect::<Vec<_>>()
        .join(", ");
    assert!(nodes.starts_with("\"rediss://"), "{nodes}");
    let mut con = cluster.client().get_async_connection().await.unwrap();
    let pong: String = redis::cmd("PING").query_async(&mut con).await.unwrap();
    assert_eq!(pong, "PONG");

    // A wrong CA, and plain redis:// seeds, fail at once on a cluster too.
    let other_dir = tempfile::tempdir().unwrap();
    let other = TlsMaterial::generate(other_dir.path()).unwrap();
    let (error, took) = startup_error(config(&format!(
        "cluster_nodes = [{nodes}]\n{}",
        ca_line(&other)
    )))
    .await;
    assert!(took < FAIL_FAST, "failed after {took:?}, not at once");
    let RunError::RedisTls { advice, .. } = &error else {
        panic!("expected RedisTls, got {error:?}");
    };
    assert!(advice.contains("tls_ca_file"), "{advice}");
    let plain = nodes.replace("rediss://", "redis://");
    let (error, took) = startup_error(config(&format!("cluster_nodes = [{plain}]\n"))).await;
    assert!(took < FAIL_FAST, "failed after {took:?}, not at once");
    let RunError::RedisTls { advice, .. } = &error else {
        panic!("expected RedisTls, got {error:?}");
    };
    assert!(advice.contains("rediss://"), "{advice}");
    let config = config(&format!(
        "cluster_nodes = [{nodes}]\n{}",
        ca_line(cluster.tls().unwrap())
    ));
    assert!(config.redis.target().is_cluster());
    let app = run_with(config.clone()).await.unwrap();
    publish_and_consume(&app, &config, 3000..3100).await;
    app.shutdown_and_wait().await.expect("clean shutdown");
}

/// A `rediss://` sentinel whose certificate does not verify (no `tls_ca_file`: the system's
/// roots do not know the test CA) is a TLS failure, as for a server: `run_with` stops at once
/// with `RunError::RedisTls`, not retried as an unreachable sentinel until `startup_timeout`.
/// (A TLS-only `redis-server` stands in for the sentinel: the handshake fails before any
/// command.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_whose_certificate_does_not_verify_is_a_tls_failure() {
    let server = RedisServer::builder()
        .tls(TlsAuthClients::Optional)
        .start()
        .unwrap();
    let (error, took) = startup_error(config(&format!(
        "sentinels = [{:?}]\nsentinel_master = \"mymaster\"\n",
        server.url()
    )))
    .await;
    assert!(
        matches!(error, RunError::RedisTls { .. }),
        "{error:?} after {took:?}"
    );
    assert!(took < FAIL_FAST, "failed after {took:?}");
}
