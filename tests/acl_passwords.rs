//! Passwords never appear in logs, `Debug` output or error messages (README "ACL users",
//! docs/design.md §15.2): a listener started through `run_listeners` with
//! `redis://sl-listener:s3cret-pw@…` (the right password, a wrong one, an unreachable host, an
//! invalid URL), with every log line of the process captured (a `fmt` subscriber at DEBUG writing
//! to a buffer) and the `Debug` and `Display` of the config, its target and every error kept;
//! none holds the password. The admin tool's stderr is checked in
//! `stream-listener/tests/cli_acl.rs`.
//!
//! One test in this binary: it installs the process-wide subscriber.

mod support;

use std::sync::Mutex;
use std::time::Duration;

use serde_json::json;
use stream_listener::core::internals::admin;
use stream_listener::core::internals::connection::{RedisConnection, RedisTarget};
use stream_listener::core::internals::report::Chain;
use stream_listener::core::member::Listener;
use stream_listener::testing::RedisServer;
use stream_listener::testing::acl::{AclRule, readme_acl_rules, rule_of};
use stream_listener::{
    Config, Delivery, HandlerError, ListenerRegistration, Publisher, PublisherOptions,
    run_listeners,
};

const PASSWORD: &str = "s3cret-pw";

static HANDLED: Mutex<u64> = Mutex::new(0);

fn count(_: Delivery) -> stream_listener::core::handler::HandlerFuture {
    *HANDLED.lock().unwrap() += 1;
    Box::pin(async { Ok::<(), HandlerError>(()) })
}

/// `[redis] url` and short timings for stream `orders`, group `billing`.
fn config(url: &str) -> Result<Config, stream_listener::ConfigError> {
    let text = format!(
        r#"
[redis]
url = "{url}"
startup_timeout = "600ms"

[coordination]
heartbeat_interval = "200ms"
member_lease_ttl = "1500ms"
rebalance_timeout = "3s"

[listeners.billing]
block = "300ms"
handler_timeout = "2s"
"#
    );
    Config::from_toml_str(&text, "app.toml")
}

fn registration() -> Vec<ListenerRegistration> {
    vec![ListenerRegistration::new(
        "billing", "orders", "billing", count,
    )]
}

/// The README's listener rule with the password [`PASSWORD`].
fn listener_rule() -> AclRule {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let rules = readme_acl_rules(&readme).unwrap();
    let mut rule = rule_of(&rules, "sl-listener").unwrap().clone();
    for r in &mut rule.rules {
        if r.starts_with('>') {
            *r = format!(">{PASSWORD}");
        }
    }
    rule.password = PASSWORD.to_owned();
    rule
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passwords_never_appear_in_logs_debug_or_errors() {
    let buffer = support::logs::capture(tracing::Level::DEBUG);

    let server = RedisServer::start().unwrap();
    let rule = listener_rule();
    rule.apply(&mut server.client().get_connection().unwrap())
        .unwrap();
    let mut conn = RedisConnection::connect(
        &RedisTarget::standalone(server.url()),
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    admin::create_stream(&mut conn, "orders", 2).await.unwrap();
    let mut shown: Vec<String> = Vec::new();

    // The right password: the listener consumes.
    let right = config(&rule.url(&server.addr())).unwrap();
    shown.push(format!("{right:?}"));
    shown.push(format!("{:?}", right.redis));
    shown.push(format!("{:?}", right.redis.target()));
    shown.push(right.redis.target().describe());
    let app = run_listeners(right, registration()).await.unwrap();
    let publisher = Publisher::new(conn.clone(), "orders", PublisherOptions::default())
        .await
        .unwrap();
    let batch: Vec<(String, serde_json::Value)> = (0..10)
        .map(|n| (format!("k{n}"), json!({ "n": n })))
        .collect();
    publisher.publish_batch(&batch).await.unwrap();
    assert!(
        support::wait_until(Duration::from_secs(10), || *HANDLED.lock().unwrap() >= 10).await,
        "handled {}",
        HANDLED.lock().unwrap()
    );
    app.shutdown_and_wait().await.expect("clean shutdown");

    // A wrong password (the user's is another), an unreachable host (retried until
    // startup_timeout, with warnings), an invalid URL.
    let wrong = format!("redis://sl-other:{PASSWORD}@{}", server.addr());
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let unreachable = format!(
        "redis://sl-listener:{PASSWORD}@127.0.0.1:{}",
        closed.local_addr().unwrap().port()
    );
    drop(closed);
    let invalid = format!("redis://sl-listener:{PASSWORD}@127.0.0.1:notaport");
    for url in [&wrong, &unreachable, &invalid] {
        match config(url) {
            Ok(config) => {
                let err = run_listeners(config, registration())
                    .await
                    .err()
                    .unwrap_or_else(|| panic!("{} started", url.replace(PASSWORD, "***")));
                shown.push(err.to_string());
                shown.push(format!("{err:?}"));
                shown.push(Chain(&err).to_string());
            }
            // The invalid URL is refused by the config's validation.
            Err(err) => {
                shown.push(err.to_string());
                shown.push(format!("{err:?}"));
            }
        }
        let target = RedisTarget::standalone(url.clone());
        let handler = |_: Delivery| async { Ok::<(), HandlerError>(()) };
        let listener = Listener::new(
            target.clone(),
            "orders",
            "billing",
            handler,
            support::options(1),
        )
        .unwrap();
        let Err(err) = listener.start().await else {
            panic!("started with a wrong password or host");
        };
        shown.push(format!("{err:?}"));
        shown.push(err.to_string());
        if let Err(err) = RedisConnection::connect(&target, Duration::from_secs(1)).await {
            shown.push(format!("{err:?}"));
            shown.push(err.to_string());
        }
    }

    let logs = buffer.text();
    assert!(
        logs.contains("Redis does not answer yet"),
        "the unreachable host was retried and logged: {logs}"
    );
    assert!(
        !logs.contains(PASSWORD),
        "a log line holds the password: {logs}"
    );
    for text in &shown {
        assert!(!text.contains(PASSWORD), "{text}");
    }
    assert!(
        shown.iter().any(|t| t.contains("sl-listener:***@")),
        "URLs are shown redacted: {shown:#?}"
    );
}
