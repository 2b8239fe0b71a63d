//! ACL users (README "ACL users", docs/design.md §15.2) on a real server: the README's three
//! `ACL SETUSER` rules, read from README.md itself, are created as they are written, and the
//! listener, the producer and the admin operations run as those users without one refusal (`ACL
//! LOG` stays empty). A listener whose user lacks one command or key of its rule fails at startup,
//! before it joins, with an error naming that command or key. The admin tool's subcommands run
//! as the admin user in `stream-listener/tests/cli_acl.rs`.

mod support;

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use stream_listener::core::handler::HandlerError;
use stream_listener::core::internals::acl::{AclCheckError, Missing};
use stream_listener::core::internals::admin;
use stream_listener::core::internals::connection::{RedisConnection, RedisTarget};
use stream_listener::core::internals::dataplane::FencingMode;
use stream_listener::core::internals::report::Chain;
use stream_listener::core::member::ListenerHandle;
use stream_listener::core::member::{Listener, ListenerError};
use stream_listener::core::producer::{Publisher, PublisherOptions};
use stream_listener::testing::RedisServer;
use stream_listener::testing::acl::{AclRule, readme_acl_rules, rule_of};
use support::{Behaviour, GROUP, Recorder, STREAM, connect, settle, wait_until};

const DEAD_LETTERS: &str = "orders:dlq:billing";

fn readme_rules() -> Vec<AclRule> {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("README.md is readable");
    readme_acl_rules(&readme).expect("README.md has the ACL rules")
}

/// A server with the README's users, and a connection as the default (unrestricted) user.
async fn server_with_users() -> (RedisServer, RedisConnection, Vec<AclRule>) {
    let server = RedisServer::start().unwrap();
    let rules = readme_rules();
    let mut sync = server.client().get_connection().unwrap();
    for rule in &rules {
        rule.apply(&mut sync)
            .unwrap_or_else(|e| panic!("README rule of {} is refused: {e}", rule.user));
    }
    let conn = connect(&RedisTarget::standalone(server.url())).await;
    (server, conn, rules)
}

fn target_of(rule: &AclRule, server: &RedisServer) -> RedisTarget {
    RedisTarget::standalone(rule.url(&server.addr()))
}

/// The server's `ACL LOG` (every refused command or key since the last reset), one line each.
async fn acl_log(conn: &mut RedisConnection) -> Vec<String> {
    let entries: Vec<redis::Value> = redis::cmd("ACL")
        .arg("LOG")
        .query_async(conn)
        .await
        .unwrap();
    entries.iter().map(|e| format!("{e:?}")).collect()
}

/// Every tenth message fails for good: a dead letter.
fn every_tenth_fails() -> Behaviour {
    Arc::new(|delivery| match support::payload_n(delivery) {
        Some(n) if n % 10 == 0 => Err(HandlerError::NonRetryable("tenth message".into())),
        _ => Ok(()),
    })
}

async fn publish(publisher: &Publisher, from: u64, count: u64) {
    let batch: Vec<(String, serde_json::Value)> = (from..from + count)
        .map(|n| (format!("k{n}"), json!({ "n": n })))
        .collect();
    publisher.publish_batch(&batch).await.unwrap();
}

async fn start_member(
    target: &RedisTarget,
    recorder: &Arc<Recorder>,
    fencing: FencingMode,
) -> ListenerHandle {
    let mut options = support::options(1);
    options.fencing = fencing;
    support::start_recording_with(
        target,
        recorder,
        options,
        Duration::ZERO,
        Some(every_tenth_fails()),
    )
    .await
}

async fn dead_letter_count(conn: &mut RedisConnection) -> u64 {
    redis::cmd("XLEN")
        .arg(DEAD_LETTERS)
        .query_async(conn)
        .await
        .unwrap()
}

/// Publish → handle → ack, dead letters and a rebalance to a second member, all as the README's
/// users, in `fencing` mode; nothing refused, nothing lost.
async fn run_as_readme_users(fencing: FencingMode) {
    let (server, mut conn, rules) = server_with_users().await;
    let admin_target = target_of(rule_of(&rules, "sl-admin").unwrap(), &server);
    let mut admin_conn = connect(&admin_target).await;
    admin::create_stream(&mut admin_conn, STREAM, 4)
        .await
        .unwrap();
    let listener = target_of(rule_of(&rules, "sl-listener").unwrap(), &server);
    let producer_conn = connect(&target_of(rule_of(&rules, "sl-producer").unwrap(), &server)).await;
    let publisher = Publisher::new(producer_conn, STREAM, PublisherOptions::default())
        .await
        .unwrap();
    let recorder = Arc::new(Recorder::default());

    let first = start_member(&listener, &recorder, fencing).await;
    publish(&publisher, 1, 40).await;
    let done = wait_until(Duration::from_secs(10), || recorder.handled().len() == 36).await;
    assert!(
        done,
        "handled {} of 36; ACL LOG {:?}",
        recorder.handled().len(),
        acl_log(&mut conn).await
    );

    let second = start_member(&listener, &recorder, fencing).await;
    settle(&mut conn, 2, Duration::from_secs(15)).await;
    publish(&publisher, 41, 40).await;
    let done = wait_until(Duration::from_secs(10), || recorder.handled().len() == 72).await;
    assert!(
        done,
        "handled {} of 72; ACL LOG {:?}",
        recorder.handled().len(),
        acl_log(&mut conn).await
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while dead_letter_count(&mut conn).await < 8 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        dead_letter_count(&mut conn).await,
        8,
        "one dead letter per tenth message"
    );
    first.shutdown_and_wait().await.expect("clean shutdown");
    second.shutdown_and_wait().await.expect("clean shutdown");
    assert_eq!(
        acl_log(&mut conn).await,
        Vec::<String>::new(),
        "no command or key refused"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readme_users_run_a_group_in_strict_fencing() {
    run_as_readme_users(FencingMode::Strict).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readme_users_run_a_group_in_acks_fencing() {
    run_as_readme_users(FencingMode::Acks).await;
}

/// What starting a listener as a user whose rule lacks `removed` did.
enum Refusal {
    /// Refused by the permission check: the error names this command rule (`+xclaim`).
    Command(String),
    /// Refused by the permission check: the error names a key and this pattern.
    Key { key: String, pattern: String },
    /// Refused while connecting (`PING`, `INFO`): the error's text.
    Startup(String),
}

async fn start_without(
    server: &RedisServer,
    sync: &mut redis::Connection,
    rule: &AclRule,
    removed: &str,
    options: stream_listener::core::member::ListenerOptions,
) -> Refusal {
    let reduced = rule
        .without(removed)
        .unwrap_or_else(|| panic!("{removed} is in the rule"));
    reduced.apply(sync).unwrap();
    let started = std::time::Instant::now();
    let handler = support::recording_handler(Arc::new(Recorder::default()), Duration::ZERO, None);
    let outcome = Listener::new(target_of(&reduced, server), STREAM, GROUP, handler, options)
        .unwrap()
        .start()
        .await;
    let error = match outcome {
        Ok(handle) => {
            handle.shutdown_and_wait().await.expect("clean shutdown");
            panic!("a listener without {removed} started");
        }
        Err(error) => error,
    };
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "without {removed}: refused after {:?}, not at once",
        started.elapsed()
    );
    match error {
        ListenerError::Permissions(AclCheckError::Denied(denied)) => {
            let text = denied.to_string();
            match denied.missing.clone() {
                Missing::Command => {
                    assert!(text.contains(&denied.command), "{text}");
                    assert!(
                        text.contains(&format!("add {}", denied.command_rule())),
                        "{text}"
                    );
                    Refusal::Command(denied.command_rule())
                }
                Missing::Key { key, pattern } => {
                    assert!(text.contains(&key) && text.contains(&pattern), "{text}");
                    Refusal::Key { key, pattern }
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        ListenerError::Startup(startup) => Refusal::Startup(Chain(&startup).to_string()),
        other => panic!("without {removed}: {other:?}"),
    }
}

/// Every command and key pattern of the README's listener rule is needed and checked at startup:
/// without any one of them the listener does not start (within 2 s, before registering its
/// group), and the error names exactly that command, or a key and exactly that pattern.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_lacking_one_permission_fails_at_startup_naming_it() {
    let (server, mut conn, rules) = server_with_users().await;
    let mut sync = server.client().get_connection().unwrap();
    let mut admin_conn = connect(&RedisTarget::standalone(server.url())).await;
    admin::create_stream(&mut admin_conn, STREAM, 2)
        .await
        .unwrap();
    let rule = rule_of(&rules, "sl-listener").unwrap().clone();
    let removable: Vec<String> = rule
        .commands()
        .chain(rule.key_patterns())
        .map(str::to_owned)
        .collect();
    assert!(removable.len() > 30, "{removable:?}");
    for removed in &removable {
        let mut options = support::options(1);
        // `SADD sl:streams` is checked when the listener may create its stream.
        if removed == "+sadd" || removed == "~sl:streams" {
            options.auto_create_shards = Some(2);
        }
        // `WAIT` is checked when acks wait for replicas.
        if removed == "+wait" {
            options.min_replica_acks = 1;
            options.replica_ack_timeout = Duration::from_millis(100);
        }
        let refusal = start_without(&server, &mut sync, &rule, removed, options).await;
        match refusal {
            Refusal::Command(named) => assert_eq!(&named, removed),
            Refusal::Key { key, pattern } => {
                assert_eq!(&pattern, removed, "the key {key} is named with its pattern")
            }
            Refusal::Startup(text) => {
                let command = removed.trim_start_matches('+');
                assert!(
                    text.contains(&format!("'{command}'")),
                    "without {removed}: {text}"
                );
            }
        }
    }
    let registered: bool = redis::cmd("EXISTS")
        .arg("sl:{orders:billing}:group")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(!registered, "no refused listener registered the group");
}

/// The README rules' key patterns are the ones the permission errors suggest
/// (`acl::listener_key_patterns` and friends), for `orders` and `billing`.
#[test]
fn readme_key_patterns_are_the_ones_errors_suggest() {
    use stream_listener::core::internals::acl;
    let rules = readme_rules();
    let patterns = |user: &str| -> Vec<String> {
        rule_of(&rules, user)
            .unwrap()
            .key_patterns()
            .map(str::to_owned)
            .collect()
    };
    assert_eq!(
        patterns("sl-listener"),
        acl::listener_key_patterns("orders", "billing")
    );
    assert_eq!(
        patterns("sl-producer"),
        acl::producer_key_patterns("orders")
    );
    assert_eq!(patterns("sl-admin"), acl::admin_key_patterns("orders"));
}

/// Each command and key pattern of the README's producer rule (but `+hget`, sent only by the
/// periodic routing refresh) is needed: without it `Publisher::new` or the first publish fails
/// with `PublishError::NoPermission` naming the command and key and exactly the removed rule.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_lacking_one_permission_is_told_which() {
    use stream_listener::core::producer::PublishError;
    let (server, _conn, rules) = server_with_users().await;
    let mut sync = server.client().get_connection().unwrap();
    let mut admin_conn = connect(&RedisTarget::standalone(server.url())).await;
    admin::create_stream(&mut admin_conn, STREAM, 2)
        .await
        .unwrap();
    let rule = rule_of(&rules, "sl-producer").unwrap().clone();
    let removable: Vec<String> = rule
        .commands()
        .chain(rule.key_patterns())
        .filter(|r| *r != "+hget")
        .map(str::to_owned)
        .collect();
    assert_eq!(removable.len(), 5, "{removable:?}");
    for removed in &removable {
        let reduced = rule.without(removed).unwrap();
        reduced.apply(&mut sync).unwrap();
        let options = PublisherOptions {
            min_replica_acks: u32::from(removed == "+wait"),
            replica_ack_timeout: Duration::from_millis(50),
            ..PublisherOptions::default()
        };
        let conn = connect(&target_of(&reduced, &server)).await;
        let outcome = match Publisher::new(conn, STREAM, options).await {
            Ok(publisher) => publisher
                .publish_batch(&[("k1", json!({ "n": 1 }))])
                .await
                .map(drop),
            Err(error) => Err(error),
        };
        match outcome {
            Err(error @ PublishError::NoPermission { .. }) => {
                let PublishError::NoPermission {
                    rule, key, source, ..
                } = &error
                else {
                    unreachable!()
                };
                assert_eq!(rule, removed, "{error}: {source:?}");
                assert!(error.to_string().contains(key.as_str()), "{error}");
                assert!(
                    key.starts_with("{orders:") || key == "sl:{orders}:stream",
                    "{key}"
                );
            }
            other => panic!("without {removed}: {other:?}"),
        }
    }
}

/// The README's users with the cluster line on every node of a 3-master cluster with keyspace
/// notifications on: a listener consumes and dead-letters what the producer publishes, the admin
/// user creates the stream, and no node refuses anything. Without `+cluster|slots` the listener
/// does not start, naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readme_users_run_a_group_on_a_cluster() {
    use stream_listener::testing::RedisCluster;
    let cluster = RedisCluster::start().unwrap();
    // The members wait with keyspace notifications, as the README recommends: the rule's
    // `+subscribe`, `+unsubscribe` and channel pattern are used, and the ACL log checked below.
    cluster.notify_keyspace_events().unwrap();
    let rules = readme_rules();
    let apply = |rule: &AclRule| {
        for node in cluster.nodes() {
            rule.apply_for_cluster(&mut node.client().get_connection().unwrap())
                .unwrap();
        }
    };
    rules.iter().for_each(apply);
    let target = |user: &str| {
        let rule = rule_of(&rules, user).unwrap();
        RedisTarget::cluster(
            cluster
                .nodes()
                .iter()
                .map(|n| rule.url(&n.addr()))
                .collect(),
        )
    };
    let mut conn = connect(&RedisTarget::cluster(cluster.urls())).await;
    let mut admin_conn = connect(&target("sl-admin")).await;
    admin::create_stream(&mut admin_conn, STREAM, 4)
        .await
        .unwrap();
    let publisher = Publisher::new(
        connect(&target("sl-producer")).await,
        STREAM,
        PublisherOptions::default(),
    )
    .await
    .unwrap();
    let recorder = Arc::new(Recorder::default());
    let listener = start_member(&target("sl-listener"), &recorder, FencingMode::Strict).await;
    publish(&publisher, 1, 40).await;
    let done = wait_until(Duration::from_secs(15), || recorder.handled().len() == 36).await;
    assert!(done, "handled {} of 36", recorder.handled().len());
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while dead_letter_count(&mut conn).await < 4 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(dead_letter_count(&mut conn).await, 4);
    listener.shutdown_and_wait().await.expect("clean shutdown");
    for node in cluster.nodes() {
        let mut node_conn = connect(&RedisTarget::standalone(node.url())).await;
        assert_eq!(
            acl_log(&mut node_conn).await,
            Vec::<String>::new(),
            "node {}",
            node.addr()
        );
    }

    let listener_rule = rule_of(&rules, "sl-listener").unwrap();
    for removed in ["+cluster|slots", "+asking"] {
        let mut reduced = listener_rule.clone();
        reduced.cluster_rules.retain(|r| r != removed);
        apply(&reduced);
        let handler =
            support::recording_handler(Arc::new(Recorder::default()), Duration::ZERO, None);
        let target = RedisTarget::cluster(
            cluster
                .nodes()
                .iter()
                .map(|n| reduced.url(&n.addr()))
                .collect(),
        );
        let started = std::time::Instant::now();
        let outcome = Listener::new(target, STREAM, GROUP, handler, support::options(1))
            .unwrap()
            .start()
            .await;
        let Err(error) = outcome else {
            panic!("a listener without {removed} started");
        };
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        let text = Chain(&error).to_string();
        let command = removed.trim_start_matches('+');
        assert!(
            text.contains(command) || text.contains(&command.replace('|', " ").to_uppercase()),
            "without {removed}: {text}"
        );
    }
}

/// The lines a global `fmt` subscriber (WARN and above) wrote: a member's tasks run on the
/// runtime's threads, so a thread-local subscriber would not see them.
#[derive(Clone, Default)]
struct Logs(Arc<std::sync::Mutex<Vec<u8>>>);

impl Logs {
    fn lines(&self) -> Vec<String> {
        String::from_utf8_lossy(&self.0.lock().unwrap())
            .lines()
            .map(str::to_owned)
            .collect()
    }
}

impl std::io::Write for Logs {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// `+xack` removed from the listener's user while it runs: what the shards read is handled, and
/// then they read nothing more until they can ack (every handled entry stays pending); the
/// refused acks are retried with a back-off (not a spin) and logged as what they are, an ACL
/// refusal (not "check that Redis is up and reachable"); nothing is lost, and once `+xack` is
/// back every entry is handled and acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permission_removed_while_running_is_logged_as_such_and_recovers() {
    let logs = Logs::default();
    let writer = logs.clone();
    tracing::subscriber::set_global_default(
        tracing_subscriber::fmt()
            .with_ansi(false)
            .with_max_level(tracing::Level::WARN)
            .with_writer(move || writer.clone())
            .finish(),
    )
    .expect("the only global subscriber of tests/acl.rs");
    let (server, mut conn, rules) = server_with_users().await;
    admin::create_stream(&mut conn, STREAM, 2).await.unwrap();
    let listener = target_of(rule_of(&rules, "sl-listener").unwrap(), &server);
    let producer_conn = connect(&target_of(rule_of(&rules, "sl-producer").unwrap(), &server)).await;
    let publisher = Publisher::new(producer_conn, STREAM, PublisherOptions::default())
        .await
        .unwrap();
    let recorder = Arc::new(Recorder::default());
    let handle = support::start_recording_with(
        &listener,
        &recorder,
        support::options(1),
        Duration::ZERO,
        None,
    )
    .await;
    publish(&publisher, 1, 20).await;
    assert!(wait_until(Duration::from_secs(10), || recorder.handled().len() == 20).await);

    let mut sync = server.client().get_connection().unwrap();
    let setuser = |sync: &mut redis::Connection, rule: &str| {
        redis::cmd("ACL")
            .arg("SETUSER")
            .arg("sl-listener")
            .arg(rule)
            .query::<()>(sync)
            .unwrap()
    };
    setuser(&mut sync, "-xack");
    publish(&publisher, 21, 20).await;
    // What the shards read is handled; while their acks are refused they read nothing more
    // (they cannot record progress), so how many of the 20 depends on how they arrived.
    assert!(wait_until(Duration::from_secs(10), || recorder.handled().len() > 20).await);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let refused: Vec<String> = logs
        .lines()
        .into_iter()
        .filter(|line| line.contains("ack failed"))
        .collect();
    assert!(
        !refused.is_empty(),
        "no ack failure logged: {:#?}",
        logs.lines()
    );
    assert!(
        refused.len() < 60,
        "{} ack failures logged in about 3 s: a spin, not a back-off",
        refused.len()
    );
    for line in &refused {
        assert!(
            line.contains("ACL") && !line.contains("up and reachable"),
            "a refused ack must be logged as an ACL refusal: {line}"
        );
    }
    let pending =
        support::pending_count(&mut conn, 0).await + support::pending_count(&mut conn, 1).await;
    let handled_since = recorder.handled().len() as u64 - 20;
    assert_eq!(
        pending, handled_since,
        "every entry handled since stays pending (its ack refused), and nothing else was read"
    );

    setuser(&mut sync, "+xack");
    publish(&publisher, 41, 20).await;
    assert!(wait_until(Duration::from_secs(15), || recorder.handled().len() == 60).await);
    for shard in 0..2 {
        assert_eq!(support::wait_no_pending(&mut conn, shard).await, 0);
    }
    handle.shutdown_and_wait().await.expect("clean shutdown");
}
