//! `run_with` / `run_listeners` on real Redis: a `#[stream_listener]` function consumes what a
//! publisher sends; startup errors are clear and bounded (docs/design.md §11).

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use stream_listener::core::handler::HandlerFuture;
use stream_listener::core::internals::connection::{RedisConnection, RedisTarget};
use stream_listener::testing::{RedisCluster, RedisServer};
use stream_listener::{
    Config, ConfigError, Delivery, HandlerError, ListenerRegistration, Message, Publisher,
    PublisherOptions, RunError, run_listeners, run_with, stream_listener,
};

#[derive(Debug, Serialize, Deserialize)]
struct Event {
    seq: u64,
}

/// (member, shard, seq) of every call of `on_event`.
static HANDLED: Mutex<Vec<(String, u32, u64)>> = Mutex::new(Vec::new());

/// (hook, member, shard) of every lifecycle hook call of `on_event` (docs/design.md §13.3).
static HOOKS: Mutex<Vec<(&'static str, String, u32)>> = Mutex::new(Vec::new());

async fn record_assigned(context: stream_listener::ShardHookContext) {
    HOOKS
        .lock()
        .unwrap()
        .push(("on_assigned", context.member_id, context.shard));
}

async fn record_revoked(context: stream_listener::ShardHookContext) -> Result<(), std::io::Error> {
    HOOKS
        .lock()
        .unwrap()
        .push(("on_revoked", context.member_id, context.shard));
    Ok(())
}

async fn record_lost(context: stream_listener::ShardHookContext) {
    HOOKS
        .lock()
        .unwrap()
        .push(("on_lost", context.member_id, context.shard));
}

/// The shards hook `hook` was called for, among the calls for `members`.
fn hooked(hook: &str, members: &[String]) -> Vec<u32> {
    let mut shards: Vec<u32> = HOOKS
        .lock()
        .unwrap()
        .iter()
        .filter(|(h, member, _)| *h == hook && members.contains(member))
        .map(|(_, _, shard)| *shard)
        .collect();
    shards.sort_unstable();
    shards
}

#[stream_listener(
    stream = "run_events",
    group = "run_group",
    concurrency = 2,
    on_assigned = record_assigned,
    on_revoked = record_revoked,
    on_lost = record_lost
)]
async fn on_event(message: Message<Event>) -> Result<(), HandlerError> {
    HANDLED.lock().unwrap().push((
        message.member_id.clone(),
        message.shard,
        message.payload.seq,
    ));
    Ok(())
}

/// Short protocol timings so the group settles in about a second.
fn config(url: &str, extra: &str) -> Config {
    let text = format!(
        r#"
[redis]
url = "{url}"
startup_timeout = "5s"

[coordination]
heartbeat_interval = "200ms"
member_lease_ttl = "1500ms"
rebalance_timeout = "3s"

[streams.run_events]
shards = 4

[listeners.on_event]
handler_timeout = "2s"
block = "500ms"
{extra}
"#
    );
    Config::from_toml_str(&text, "run-test.toml").unwrap()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registered_listener_consumes_published_events() {
    let server = RedisServer::start().unwrap();
    let app = run_with(config(&server.url(), "")).await.unwrap();
    assert!(
        app.wait_for_assignment(4, Duration::from_secs(15)).await,
        "4 shards assigned: {:?}",
        app.status()
    );

    let conn = RedisConnection::connect(
        &RedisTarget::standalone(server.url()),
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    let publisher = Publisher::new(conn, "run_events", PublisherOptions::default())
        .await
        .unwrap();
    let events: Vec<(String, Event)> = (0..200)
        .map(|seq| (format!("key-{}", seq % 17), Event { seq }))
        .collect();
    publisher.publish_batch(&events).await.unwrap();

    let deadline = Instant::now() + Duration::from_secs(20);
    let seen = loop {
        let seen: std::collections::BTreeSet<u64> = HANDLED
            .lock()
            .unwrap()
            .iter()
            .map(|h| h.2)
            .filter(|seq| *seq < 1000)
            .collect();
        if seen.len() == 200 || Instant::now() > deadline {
            break seen;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(seen.len(), 200, "every event handled");

    let status = app.status();
    assert_eq!(status.len(), 1);
    assert_eq!(status[0].name, "on_event");
    assert_eq!(
        (status[0].stream.as_str(), status[0].group.as_str()),
        ("run_events", "run_group")
    );
    assert_eq!(status[0].members.len(), 2, "concurrency = 2 from the macro");
    assert_eq!(status[0].owned_shards(), vec![0, 1, 2, 3]);
    let handled: u64 = status[0].members.iter().map(|m| m.handled).sum();
    assert!(handled >= 200, "members count what they handled: {handled}");
    let per_member: BTreeMap<String, usize> =
        HANDLED
            .lock()
            .unwrap()
            .iter()
            .fold(BTreeMap::new(), |mut acc, (member, _, _)| {
                *acc.entry(member.clone()).or_default() += 1;
                acc
            });
    assert_eq!(
        per_member.len(),
        2,
        "both members handled events: {per_member:?}"
    );

    // The attribute's hooks reached the members run_with started: each shard assigned (twice
    // for a shard that moved to the second member when it joined).
    let members: Vec<String> = status[0]
        .members
        .iter()
        .map(|m| m.member_id.clone())
        .collect();
    let mut assigned = hooked("on_assigned", &members);
    assigned.dedup();
    assert_eq!(assigned, vec![0, 1, 2, 3]);

    let started = Instant::now();
    app.shutdown_and_wait().await.expect("clean shutdown");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "graceful shutdown is quick"
    );
    // Every ownership ended in order (a move, then the shutdown): revoked, not lost.
    assert_eq!(
        hooked("on_revoked", &members),
        hooked("on_assigned", &members)
    );
    assert_eq!(hooked("on_lost", &members), Vec::<u32>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_with_a_cluster() {
    let cluster = RedisCluster::start().unwrap();
    let nodes = cluster
        .urls()
        .iter()
        .map(|u| format!("{u:?}"))
        .collect::<Vec<_>>()
        .join(", ");
    let text = format!(
        "[redis]\ncluster_nodes = [{nodes}]\n[coordination]\nheartbeat_interval = \"200ms\"\nmember_lease_ttl = \"1500ms\"\nrebalance_timeout = \"3s\"\n[streams.run_events]\nshards = 4\n[listeners.on_event]\nhandler_timeout = \"2s\"\n"
    );
    let config = Config::from_toml_str(&text, "cluster.toml").unwrap();
    assert!(config.redis.target().is_cluster());
    let app = run_with(config.clone()).await.unwrap();
    assert!(
        app.wait_for_assignment(4, Duration::from_secs(20)).await,
        "{:?}",
        app.status()
    );
    let publisher = config.publisher("run_events").await.unwrap();
    let events: Vec<(String, Event)> = (1000..1100)
        .map(|seq| (format!("key-{seq}"), Event { seq }))
        .collect();
    publisher.publish_batch(&events).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let seen = HANDLED
            .lock()
            .unwrap()
            .iter()
            .filter(|h| (1000..1100).contains(&h.2))
            .map(|h| h.2)
            .collect::<std::collections::BTreeSet<u64>>()
            .len();
        if seen == 100 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "only {seen} of 100 handled on the cluster"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    app.shutdown_and_wait().await.expect("clean shutdown");
}

/// Redis restarted empty under a running `run_with` (docs/design.md §5.5): a listener whose
/// stream is configured with `shards` provisions stream and group again from that
/// configuration and handles what is published after the loss. `run()` created the stream at
/// startup but did not give its listeners the configured shard count, so they failed closed
/// for good ("group … is registered but its metadata … is missing") until the process was
/// restarted, which a new user found.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_redis_lost_its_data_a_configured_stream_is_provisioned_again_and_consumed() {
    let server = RedisServer::start().unwrap();
    let config = config(&server.url(), "");
    let app = run_with(config.clone()).await.unwrap();
    assert!(
        app.wait_for_assignment(4, Duration::from_secs(15)).await,
        "{:?}",
        app.status()
    );
    let mut conn = RedisConnection::connect(
        &RedisTarget::standalone(server.url()),
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    let () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
    // The members notice at their next heartbeat.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let exists: bool = redis::cmd("EXISTS")
            .arg("sl:{run_events}:stream")
            .query_async(&mut conn)
            .await
            .unwrap();
        if exists {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the stream was not provisioned again: {:?}",
            app.status()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let publisher = config.publisher("run_events").await.unwrap();
    let events: Vec<(String, Event)> = (100_000..100_050)
        .map(|seq| (format!("key-{seq}"), Event { seq }))
        .collect();
    publisher.publish_batch(&events).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let seen = HANDLED
            .lock()
            .unwrap()
            .iter()
            .filter(|h| (100_000..100_050).contains(&h.2))
            .map(|h| h.2)
            .collect::<std::collections::BTreeSet<u64>>()
            .len();
        if seen == 50 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "only {seen} of the 50 entries published after the loss were handled: {:?}",
            app.status()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    app.shutdown_and_wait().await.expect("clean shutdown");
}

#[tokio::test]
async fn config_overrides_apply_over_the_macro() {
    let server = RedisServer::start().unwrap();
    let app = run_with(config(&server.url(), "concurrency = 3"))
        .await
        .unwrap();
    assert_eq!(app.status()[0].members.len(), 3);
    app.shutdown_and_wait().await.expect("clean shutdown");
}

#[tokio::test]
async fn an_override_of_an_unknown_listener_is_an_error() {
    // Checked before Redis is contacted: this URL has no server.
    let url = format!("redis://127.0.0.1:{}", free_port());
    let text = format!("[redis]\nurl = \"{url}\"\n\n[listeners.on_evnet]\nconcurrency = 2\n");
    let config = Config::from_toml_str(&text, "app.toml").unwrap();
    let err = run_with(config).await.unwrap_err();
    let RunError::Config(ConfigError::UnknownListener {
        name,
        known,
        location,
    }) = &err
    else {
        panic!("expected UnknownListener, got {err:?}");
    };
    assert_eq!(name, "on_evnet");
    assert_eq!(known, &["on_event".to_owned()]);
    assert_eq!(location.as_ref().map(|l| l.line), Some(4));
    assert!(
        err.to_string()
            .starts_with("app.toml:4:12: [listeners.on_evnet]"),
        "{err}"
    );
}

#[tokio::test]
async fn unreachable_redis_fails_after_startup_timeout() {
    let url = format!("redis://127.0.0.1:{}", free_port());
    let text = format!("[redis]\nurl = \"{url}\"\nstartup_timeout = \"1500ms\"\n");
    let config = Config::from_toml_str(&text, "app.toml").unwrap();
    let started = Instant::now();
    let err = run_with(config).await.unwrap_err();
    let elapsed = started.elapsed();
    assert!(
        matches!(err, RunError::RedisUnreachable { attempts, .. } if attempts >= 3),
        "{err:?}"
    );
    // Backoff 100 ms doubling: attempts at 0, 0.1, 0.3, 0.7 s, the next step would pass the
    // deadline, so the last sleep ends at it (1.5 s) for one more attempt. It used to give up
    // at 0.7 s, as soon as the next step would have passed the deadline.
    assert!(
        elapsed >= Duration::from_millis(1500) && elapsed < Duration::from_secs(4),
        "gave up after startup_timeout, not before and not much later: {elapsed:?}"
    );
    assert_says(
        &err,
        &[
            "cannot reach Redis at redis://127.0.0.1:",
            "startup_timeout",
        ],
    );
    // How long it tried, to the millisecond (not "1s 500ms 412us 19ns").
    let message = err.to_string();
    assert!(
        !message.contains("us ") && !message.contains("ns "),
        "{message}"
    );
}

/// A publisher made from the config while Redis is unreachable: the error names the URL and the
/// config key, and does not warn of duplicates (nothing was sent).
#[tokio::test]
async fn a_publisher_that_cannot_connect_names_the_url() {
    let url = format!("redis://127.0.0.1:{}", free_port());
    let config = Config::from_toml_str(&format!("[redis]\nurl = \"{url}\"\n"), "app.toml").unwrap();
    let Err(err) = config.publisher("orders").await else {
        panic!("a publisher without Redis");
    };
    let message = err.to_string();
    assert!(
        message.contains(&format!("cannot connect to Redis at {url}")),
        "{message}"
    );
    assert!(message.contains("[redis] url"), "{message}");
    assert!(!message.contains("twice"), "{message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_coming_up_during_startup_is_waited_for() {
    let mut server = RedisServer::start().unwrap();
    let url = server.url();
    server.kill().unwrap();
    let restarter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(1500));
        server.restart().unwrap();
        server
    });
    let started = Instant::now();
    let app = run_with(config(&url, "")).await.unwrap();
    assert!(started.elapsed() >= Duration::from_millis(1000));
    let _server = restarter.join().unwrap();
    app.shutdown_and_wait().await.expect("clean shutdown");
}

fn ignore(_: Delivery) -> HandlerFuture {
    Box::pin(async { Ok(()) })
}

#[tokio::test]
async fn two_listeners_on_one_stream_and_group_are_an_error() {
    let url = format!("redis://127.0.0.1:{}", free_port());
    let config = Config::from_toml_str(&format!("[redis]\nurl = \"{url}\"\n"), "app.toml").unwrap();
    let listeners = vec![
        ListenerRegistration::new("first", "orders", "billing", ignore),
        ListenerRegistration::new("second", "orders", "billing", ignore),
    ];
    let err = run_listeners(config, listeners).await.unwrap_err();
    assert!(
        matches!(&err, RunError::DuplicateStreamGroup { stream, group, .. } if stream == "orders" && group == "billing"),
        "{err:?}"
    );
    assert!(
        err.to_string().contains("`first`") && err.to_string().contains("`second`"),
        "{err}"
    );
}

#[tokio::test]
async fn a_missing_stream_without_shards_is_an_error_saying_how_to_create_it() {
    let server = RedisServer::start().unwrap();
    let config = Config::from_toml_str(
        &format!("[redis]\nurl = \"{}\"\n", server.url()),
        "app.toml",
    )
    .unwrap();
    let listeners = vec![ListenerRegistration::new(
        "audit",
        "audit_log",
        "auditors",
        ignore,
    )];
    let err = run_listeners(config, listeners).await.unwrap_err();
    assert!(
        matches!(&err, RunError::MissingStream { stream, .. } if stream == "audit_log"),
        "{err:?}"
    );
    assert_says(
        &err,
        &[
            "stream-listener stream create audit_log --shards N",
            "[streams.audit_log]",
        ],
    );
}

#[tokio::test]
async fn no_listeners_is_an_error() {
    let err = run_listeners(Config::default(), Vec::new())
        .await
        .unwrap_err();
    assert!(matches!(err, RunError::NoListeners), "{err:?}");
}

/// With static membership every listener of a process names its members `<instance_id>-m<k>`:
/// two listeners (on two streams) each have a member `pod-a-m0`. The app's status must still list
/// each listener's own members only, and `wait_for_assignment` see each listener's shards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listeners_with_the_same_static_member_ids_each_report_their_own_members() {
    let server = RedisServer::start().unwrap();
    let text = format!(
        r#"
[redis]
url = "{}"
startup_timeout = "5s"

[member]
instance_id = "pod-a"

[coordination]
heartbeat_interval = "200ms"
member_lease_ttl = "1500ms"
rebalance_timeout = "3s"

[streams.static_alpha]
shards = 2

[streams.static_beta]
shards = 2

[listeners.first]
handler_timeout = "2s"

[listeners.second]
handler_timeout = "2s"
"#,
        server.url()
    );
    let config = Config::from_toml_str(&text, "static.toml").unwrap();
    let listeners = vec![
        ListenerRegistration::new("first", "static_alpha", "g", ignore),
        ListenerRegistration::new("second", "static_beta", "g", ignore),
    ];
    let app = run_listeners(config, listeners).await.unwrap();
    assert!(
        app.wait_for_assignment(2, Duration::from_secs(15)).await,
        "{:?}",
        app.status()
    );
    let status = app.status();
    assert_eq!(status.len(), 2);
    for listener in &status {
        let ids: Vec<&str> = listener
            .members
            .iter()
            .map(|m| m.member_id.as_str())
            .collect();
        assert_eq!(ids, ["pod-a-m0"], "{}: {status:?}", listener.name);
        assert_eq!(listener.owned_shards(), [0, 1], "{}", listener.name);
    }
    app.shutdown_and_wait().await.expect("clean shutdown");
}

/// Asserts that the message of `err` contains each of `parts`, showing it whole when one is
/// missing.
fn assert_says(err: &impl std::fmt::Display, parts: &[&str]) {
    let text = err.to_string();
    for part in parts {
        assert!(text.contains(part), "{part:?} not in: {text}");
    }
}

/// Set once the slow handler has started.
static SLOW_STARTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// A handler that runs far past any `shutdown_timeout` of these tests.
fn slow(_: Delivery) -> HandlerFuture {
    SLOW_STARTED.store(true, std::sync::atomic::Ordering::SeqCst);
    Box::pin(async {
        tokio::time::sleep(Duration::from_secs(60)).await;
        Ok(())
    })
}

/// docs/design.md §14.5: `shutdown_and_wait` says whether the shutdown was clean. A handler
/// still running after `shutdown_timeout` is cancelled and named in the error (its entry stays
/// pending); a shutdown with nothing in flight is `Ok`.
/// Shuts `app` down as a `main` returning `Result<(), RunError>` would: `?` converts a
/// shutdown that was not clean into `RunError::Shutdown`.
async fn shut_down(app: stream_listener::RunningApp) -> Result<(), RunError> {
    app.shutdown_and_wait().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_names_a_handler_cancelled_past_shutdown_timeout_and_a_clean_one_is_ok() {
    let server = RedisServer::start().unwrap();
    let text = format!(
        r#"
[redis]
url = "{}"
startup_timeout = "5s"

[coordination]
heartbeat_interval = "200ms"
member_lease_ttl = "1500ms"
rebalance_timeout = "3s"

[streams.slow_events]
shards = 1

[streams.quick_events]
shards = 1
"#,
        server.url()
    );
    let quick_section = "\n[listeners.quick]\nhandler_timeout = \"2s\"\n";
    let clean = Config::from_toml_str(&format!("{text}{quick_section}"), "shutdown.toml").unwrap();
    let slow_section =
        "\n[listeners.slow]\nhandler_timeout = \"2s\"\nshutdown_timeout = \"300ms\"\n";
    let config = Config::from_toml_str(&(text + slow_section), "shutdown.toml").unwrap();

    let quick = run_listeners(
        clean,
        vec![ListenerRegistration::new(
            "quick",
            "quick_events",
            "g",
            ignore,
        )],
    )
    .await
    .unwrap();
    assert!(quick.wait_for_assignment(1, Duration::from_secs(15)).await);
    shut_down(quick).await.expect("clean shutdown");

    let app = run_listeners(
        config.clone(),
        vec![ListenerRegistration::new("slow", "slow_events", "g", slow)],
    )
    .await
    .unwrap();
    assert!(app.wait_for_assignment(1, Duration::from_secs(15)).await);
    let member = app.status()[0].members[0].member_id.clone();
    let publisher = config.publisher("slow_events").await.unwrap();
    publisher.publish("k", &Event { seq: 1 }).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !SLOW_STARTED.load(std::sync::atomic::Ordering::SeqCst) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(SLOW_STARTED.load(std::sync::atomic::Ordering::SeqCst));
    let started = Instant::now();
    // Through `?` in a function returning `RunError`, as a `main` would.
    let error = match shut_down(app).await {
        Err(RunError::Shutdown(error)) => error,
        other => panic!("{other:?}"),
    };
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "bounded by shutdown_timeout"
    );
    match &error {
        stream_listener::ShutdownError::HandlerCancelled {
            listener,
            stream,
            group,
            member_id,
            shard,
            shutdown_timeout,
            ..
        } => {
            assert_eq!(
                (listener.as_str(), stream.as_str(), group.as_str(), *shard),
                ("slow", "slow_events", "g", 0)
            );
            assert_eq!(member_id, &member);
            assert_eq!(*shutdown_timeout, Duration::from_millis(300));
        }
        other => panic!("{other:?}"),
    }
    assert_says(
        &error,
        &["`slow`", "shard 0", "shutdown_timeout (300ms)", "pending"],
    );
    // The cancelled handler's entry was not acked.
    let mut conn = RedisConnection::connect(
        &RedisTarget::standalone(server.url()),
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    // The XPENDING summary's first element: the group's pending count.
    let pending: Vec<redis::Value> = redis::cmd("XPENDING")
        .arg("{slow_events:0}")
        .arg("g")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(pending.first(), Some(&redis::Value::Int(1)));
}

/// docs/design.md §14.5: the public errors' `Debug` is their message with its causes (what
/// `fn main() -> Result<(), E>` prints), not the derive's struct dump.
#[test]
fn public_errors_debug_as_their_message_and_causes() {
    let unknown = stream_listener::PublishError::UnknownStream {
        prefix: "payments".into(),
        key: "sl:{payments}:stream".into(),
    };
    assert_eq!(format!("{unknown:?}"), unknown.to_string());
    assert!(format!("{unknown:?}").starts_with("stream \"payments\" does not exist"));

    let mut options = stream_listener::core::member::ListenerOptions::default();
    options.concurrency = 0;
    let target = RedisTarget::standalone("redis://127.0.0.1:1");
    let refused =
        stream_listener::core::member::Listener::new(target, "orders", "billing", ignore, options)
            .unwrap_err();
    assert_eq!(
        format!("{refused:?}"),
        "invalid listener options: concurrency must be at least 1"
    );

    let config = Config::from_toml_str("[redis]\nurl = 5\n", "bad.toml").unwrap_err();
    assert_eq!(
        format!("{config:?}"),
        stream_listener::core::internals::report::Chain(&config).to_string()
    );
    assert!(format!("{config:?}").contains("bad.toml"), "{config:?}");
    // RunError shares the implementation.
    let run = RunError::Config(config);
    assert!(format!("{run:?}").contains("bad.toml"), "{run:?}");
}
