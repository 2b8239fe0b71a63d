//! Redis Sentinel (docs/design.md §15.3): members, a producer and the admin API find the master
//! through the sentinels of a real setup (`stream_listener::testing::RedisSentinel`: one master,
//! one replica, three `redis-server --sentinel`), follow a failover by themselves, and startup
//! fails clearly when no sentinel answers or none knows the master's name.

mod support;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use stream_listener::core::internals::admin;
use stream_listener::core::internals::connection::{
    RedisConnection, RedisFailure, RedisTarget, SentinelTarget,
};
use stream_listener::core::internals::startup::{self, StartupError};
use stream_listener::core::model::GroupState;
use stream_listener::core::producer::{Publisher, PublisherOptions};
use stream_listener::testing::RedisSentinel;
use support::{Recorder, STREAM, connect, options, start_recording, wait_for_group, wait_until};

/// Payload `n`s handled by [`on_sentinel_event`], the listener `run_with` starts.
static RUN_HANDLED: std::sync::Mutex<BTreeSet<u64>> = std::sync::Mutex::new(BTreeSet::new());

#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Event {
    n: u64,
}

#[stream_listener::stream_listener(
    stream = "sentinel_events",
    group = "sentinel_group",
    concurrency = 2
)]
async fn on_sentinel_event(
    message: stream_listener::Message<Event>,
) -> Result<(), stream_listener::HandlerError> {
    RUN_HANDLED.lock().unwrap().insert(message.payload.n);
    Ok(())
}

fn target_of(setup: &RedisSentinel) -> RedisTarget {
    RedisTarget::sentinel(SentinelTarget::new(
        setup.sentinel_urls(),
        setup.master_name(),
    ))
}

/// Starts a setup off the async runtime's worker (the harness blocks while it waits).
async fn start_setup() -> RedisSentinel {
    tokio::task::spawn_blocking(RedisSentinel::start)
        .await
        .unwrap()
        .expect("the Sentinel setup starts")
}

/// The distinct payload `n`s the recorder's handler saw.
fn handled_ns(recorder: &Recorder) -> BTreeSet<u64> {
    recorder.calls().iter().filter_map(|c| c.n).collect()
}

/// Publishes `{"n": n}` for each `n` under key `k<n>`, retrying a failed publish (a failover
/// makes one fail: its error reaches the caller, the retry goes to the new master) for at most
/// `deadline` in all; returns how many publishes failed.
async fn publish_all(publisher: &Publisher, ns: std::ops::Range<u64>, deadline: Duration) -> usize {
    let end = Instant::now() + deadline;
    let mut failures = 0;
    for n in ns {
        loop {
            match publisher
                .publish(&format!("k{n}"), &serde_json::json!({ "n": n }))
                .await
            {
                Ok(_) => break,
                Err(error) => {
                    failures += 1;
                    assert!(
                        Instant::now() < end,
                        "publishing {n} still fails after {deadline:?}: {error}"
                    );
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }
    failures
}

/// The master the connection uses now (`host:port`).
fn master_of(conn: &RedisConnection) -> String {
    match conn {
        RedisConnection::Sentinel(sentinel) => sentinel.master_addr(),
        other => panic!("a Sentinel connection, got {other:?}"),
    }
}

/// A listener of two members and a publisher find the master through the sentinels; after a
/// `SENTINEL FAILOVER` (the master demoted to a replica: writes to it get `READONLY`) publishing
/// and consuming resume on the new master without a restart, every entry is handled and the
/// group is STABLE again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_and_a_producer_find_the_master_and_follow_a_manual_failover() {
    let _serial = support::SERIAL.lock().await;
    let mut setup = start_setup().await;
    let first_master = setup.master().unwrap().port();
    let target = target_of(&setup);
    let mut conn = connect(&target).await;
    assert_eq!(master_of(&conn), format!("127.0.0.1:{first_master}"));
    admin::create_stream(&mut conn, STREAM, 4).await.unwrap();
    let recorder = Arc::new(Recorder::default());
    let listener = start_recording(&target, &recorder, options(2), Duration::ZERO).await;
    let publisher = Publisher::new(conn.clone(), STREAM, PublisherOptions::default())
        .await
        .unwrap();
    assert_eq!(
        publish_all(&publisher, 0..100, Duration::from_secs(5)).await,
        0
    );
    assert!(
        wait_until(Duration::from_secs(15), || handled_ns(&recorder).len()
            == 100)
        .await,
        "handled before the failover: {}",
        handled_ns(&recorder).len()
    );

    let sentinel = redis::Client::open(setup.sentinel_urls()[0].as_str()).unwrap();
    let mut sentinel = sentinel.get_multiplexed_async_connection().await.unwrap();
    let _: () = redis::cmd("SENTINEL")
        .arg("FAILOVER")
        .arg(setup.master_name())
        .query_async(&mut sentinel)
        .await
        .unwrap();
    let new_master = tokio::task::block_in_place(|| {
        setup
            .wait_for_failover(Duration::from_secs(20))
            .expect("Sentinel fails over")
    });
    assert_ne!(new_master, first_master);

    let failures = publish_all(&publisher, 100..200, Duration::from_secs(20)).await;
    assert!(
        wait_until(Duration::from_secs(20), || handled_ns(&recorder).len()
            == 200)
        .await,
        "handled after the failover: {} of 200",
        handled_ns(&recorder).len()
    );
    assert_eq!(handled_ns(&recorder), (0..200).collect::<BTreeSet<u64>>());
    assert_eq!(master_of(&conn), format!("127.0.0.1:{new_master}"));
    let (group, stable) = wait_for_group(&mut conn, Duration::from_secs(15), |g| {
        g.state == GroupState::Stable && g.members.iter().filter(|m| m.live).count() == 2
    })
    .await;
    assert!(stable, "{group:#?}");
    eprintln!(
        "manual failover {first_master} -> {new_master}: {failures} failed publishes retried"
    );
    listener.shutdown_and_wait().await.expect("clean shutdown");
}

/// A timeout on a healthy master (frozen by `SIGSTOP` for less than Sentinel's
/// `down-after-milliseconds`) reaches the caller, the connection asks the sentinels again, they
/// name the same master, and the connection keeps it: the next commands succeed there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_on_a_healthy_master_keeps_it() {
    let _serial = support::SERIAL.lock().await;
    let setup = start_setup().await;
    let master = setup.master().unwrap();
    let mut conn = RedisConnection::connect(&target_of(&setup), Duration::from_millis(300))
        .await
        .unwrap();
    let before = master_of(&conn);
    master.pause().unwrap();
    let error = redis::cmd("PING")
        .query_async::<()>(&mut conn)
        .await
        .unwrap_err();
    assert_eq!(RedisFailure::of(&error), RedisFailure::Timeout, "{error}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    master.resume().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut last = Err(error);
    while Instant::now() < deadline {
        last = redis::cmd("PING").query_async::<String>(&mut conn).await;
        if last.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(last.expect("the master answers again"), "PONG");
    // The re-resolution has found the same master by now (its ROLE check waited for the resume).
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(master_of(&conn), before);
    let pong: String = redis::cmd("PING").query_async(&mut conn).await.unwrap();
    assert_eq!(pong, "PONG");
}

/// The master frozen (`SIGSTOP`) past `down-after-milliseconds`, so that Sentinel promotes the
/// replica, and resumed right after the promotion: the old node answers as master again (until
/// Sentinel converts it, seconds later) and takes writes that its resync then drops. A
/// re-resolution that began during the freeze asked the sentinels before the promotion, and its
/// `ROLE` check on the frozen node is answered "master" after the resume: the connection must not
/// keep that node, but follow the sentinels to the new master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_resumed_after_its_failover_is_not_kept() {
    let _serial = support::SERIAL.lock().await;
    let setup = start_setup().await;
    let master = setup.master().unwrap();
    let mut conn = RedisConnection::connect(&target_of(&setup), Duration::from_millis(300))
        .await
        .unwrap();
    let old = master_of(&conn);
    master.pause().unwrap();
    let error = redis::cmd("PING")
        .query_async::<()>(&mut conn)
        .await
        .unwrap_err();
    assert_eq!(RedisFailure::of(&error), RedisFailure::Timeout, "{error}");
    let sentinel = redis::Client::open(setup.sentinel_urls()[0].as_str()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let new = loop {
        let mut sc = sentinel.get_multiplexed_async_connection().await.unwrap();
        let (host, port): (String, u16) = redis::cmd("SENTINEL")
            .arg("GET-MASTER-ADDR-BY-NAME")
            .arg(setup.master_name())
            .query_async(&mut sc)
            .await
            .unwrap();
        let addr = format!("{host}:{port}");
        if addr != old {
            break addr;
        }
        assert!(Instant::now() < deadline, "no failover");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    master.resume().unwrap();
    // Commands now get answers (from one node or the other); the re-resolution ends.
    let deadline = Instant::now() + Duration::from_secs(10);
    while redis::cmd("PING")
        .query_async::<String>(&mut conn)
        .await
        .is_err()
    {
        assert!(Instant::now() < deadline, "no answer after the resume");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(8);
    while master_of(&conn) != new && Instant::now() < deadline {
        let _ = redis::cmd("PING").query_async::<String>(&mut conn).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        master_of(&conn),
        new,
        "the connection kept the old master {old} after Sentinel promoted {new}"
    );
}

/// The sentinels name a master that is not there (killed, not yet failed over): the error is
/// retried by startup (`ConnectionLost`) and names the address the sentinels gave, not only
/// "Connection refused".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_master_that_cannot_be_reached_is_named_in_the_error() {
    let _serial = support::SERIAL.lock().await;
    let mut setup = start_setup().await;
    let port = setup.kill_master().unwrap();
    let error = RedisConnection::connect(&target_of(&setup), Duration::from_millis(500))
        .await
        .expect_err("the named master is down");
    assert_eq!(
        RedisFailure::of(&error),
        RedisFailure::ConnectionLost,
        "{error}"
    );
    let text = error.to_string();
    assert!(
        text.contains(&format!("127.0.0.1:{port}")) && text.contains("sentinels"),
        "{text}"
    );
}

/// `run_with` and `Config::publisher` on a TOML `[redis]` section naming the sentinels: the
/// registered listener and the publisher both find the master through them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_with_a_sentinel_config() {
    let _serial = support::SERIAL.lock().await;
    let setup = start_setup().await;
    let sentinels = setup
        .sentinel_urls()
        .iter()
        .map(|u| format!("{u:?}"))
        .collect::<Vec<_>>()
        .join(", ");
    let text = format!(
        "[redis]\nsentinels = [{sentinels}]\nsentinel_master = \"{}\"\nstartup_timeout = \"10s\"\n[coordination]\nheartbeat_interval = \"200ms\"\nmember_lease_ttl = \"1500ms\"\nrebalance_timeout = \"3s\"\n[streams.sentinel_events]\nshards = 4\n[listeners.on_sentinel_event]\nhandler_timeout = \"2s\"\nblock = \"500ms\"\n",
        setup.master_name()
    );
    let config = stream_listener::Config::from_toml_str(&text, "sentinel.toml").unwrap();
    let app = stream_listener::run_with(config.clone()).await.unwrap();
    assert!(
        app.wait_for_assignment(4, Duration::from_secs(20)).await,
        "{:?}",
        app.status()
    );
    let publisher = config.publisher("sentinel_events").await.unwrap();
    let events: Vec<(String, Event)> = (0..50).map(|n| (format!("key-{n}"), Event { n })).collect();
    publisher.publish_batch(&events).await.unwrap();
    assert!(
        wait_until(Duration::from_secs(20), || RUN_HANDLED
            .lock()
            .unwrap()
            .len()
            == 50)
        .await,
        "handled {} of 50",
        RUN_HANDLED.lock().unwrap().len()
    );
    assert_eq!(
        *RUN_HANDLED.lock().unwrap(),
        (0..50).collect::<BTreeSet<u64>>()
    );
    app.shutdown_and_wait().await.expect("clean shutdown");
}

/// A TLS-only setup (master, replica and sentinels behind one private CA): `rediss://`
/// sentinels with the CA file find the master over TLS, and follow a `SENTINEL FAILOVER`; without
/// the CA the startup fails at once with a TLS error, not a retry until `startup_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_setup_is_found_and_followed_over_tls() {
    let _serial = support::SERIAL.lock().await;
    let mut setup = tokio::task::spawn_blocking(|| RedisSentinel::builder().tls().start())
        .await
        .unwrap()
        .expect("the TLS Sentinel setup starts");
    assert!(
        setup
            .sentinel_urls()
            .iter()
            .all(|u| u.starts_with("rediss://"))
    );
    let ca = setup.tls().expect("a TLS setup").ca_only();

    let started = Instant::now();
    let error = startup::connect(&target_of(&setup), Some(Duration::from_secs(20)))
        .await
        .unwrap_err();
    assert!(
        matches!(error, StartupError::Tls { .. }),
        "without the CA: {error:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(5));

    let target = target_of(&setup).with_tls(ca);
    let first = setup.master().unwrap().port();
    let mut conn = connect(&target).await;
    assert_eq!(master_of(&conn), format!("127.0.0.1:{first}"));
    let () = redis::cmd("SET")
        .arg("tls-key")
        .arg("before")
        .query_async(&mut conn)
        .await
        .unwrap();

    setup.failover().unwrap();
    let second = tokio::task::block_in_place(|| {
        setup
            .wait_for_failover(Duration::from_secs(20))
            .expect("Sentinel fails over")
    });
    assert_ne!(second, first);
    // Writes fail (READONLY, a dropped connection) until the connection has asked the
    // sentinels again; then they reach the new master, over TLS.
    let mut written = false;
    let deadline = Instant::now() + Duration::from_secs(20);
    while !written && Instant::now() < deadline {
        written = redis::cmd("SET")
            .arg("tls-key")
            .arg("after")
            .query_async::<()>(&mut conn)
            .await
            .is_ok()
            && master_of(&conn) == format!("127.0.0.1:{second}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(written, "still on {}", master_of(&conn));
    let value: String = redis::cmd("GET")
        .arg("tls-key")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(value, "after");
}

/// Startup through sentinels that do not answer retries until `startup_timeout`, then says which
/// sentinels it asked; a master name no sentinel monitors fails at once, naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn startup_errors_name_the_sentinels_and_the_unknown_master() {
    let _serial = support::SERIAL.lock().await;
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let nobody = RedisTarget::sentinel(SentinelTarget::new(
        vec![format!("redis://127.0.0.1:{closed}")],
        "mymaster",
    ));
    let started = Instant::now();
    let error = startup::connect(&nobody, Some(Duration::from_millis(800)))
        .await
        .unwrap_err();
    let StartupError::Unreachable { last_error, .. } = &error else {
        panic!("expected Unreachable, got {error:?}");
    };
    let last_error = last_error.as_ref().expect("the last attempt's error");
    assert_eq!(RedisFailure::of(last_error), RedisFailure::ConnectionLost);
    assert!(
        last_error.to_string().contains(&format!(
            "no sentinel of [redis://127.0.0.1:{closed}] answered"
        )),
        "{last_error}"
    );
    assert!(started.elapsed() < Duration::from_secs(5));

    let setup = start_setup().await;
    let unknown = RedisTarget::sentinel(SentinelTarget::new(setup.sentinel_urls(), "nosuch"));
    let started = Instant::now();
    let error = startup::connect(&unknown, Some(Duration::from_secs(20)))
        .await
        .unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "an unknown master must fail at once, took {:?}",
        started.elapsed()
    );
    let StartupError::Refused(source) = &error else {
        panic!("expected Refused, got {error:?}");
    };
    let text = source.to_string();
    assert!(
        text.contains("monitors a master named \"nosuch\"") && text.contains("sentinel_master"),
        "{text}"
    );
}

/// Two sentinels that accept connections but never answer (a hung host) come first in the
/// list: the connection must still reach the master through the third, as Sentinel's client
/// guidelines ask (try the next sentinel), within one startup attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_sentinels_first_in_the_list_do_not_hide_the_one_that_answers() {
    let _serial = support::SERIAL.lock().await;
    let silent: Vec<std::net::TcpListener> = (0..2)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let setup = start_setup().await;
    let mut sentinels: Vec<String> = silent
        .iter()
        .map(|l| format!("redis://{}", l.local_addr().unwrap()))
        .collect();
    sentinels.extend(setup.sentinel_urls());
    let target = RedisTarget::sentinel(SentinelTarget::new(sentinels, setup.master_name()));
    let outcome = tokio::time::timeout(
        Duration::from_secs(30),
        RedisConnection::connect(&target, Duration::from_secs(5)),
    )
    .await
    .expect("connect returns");
    assert!(
        outcome.is_ok(),
        "the third sentinel names the master: {:?}",
        outcome.err()
    );
    drop(silent);
}

/// `kill -9` of the master under load, with the members and the producer as real processes
/// (`examples/workload.rs` pointed at the sentinels): Sentinel promotes the replica, every
/// process follows by itself, and the group is STABLE again. Asynchronous replication can lose
/// what the master acknowledged but had not yet sent to the replica: the replica's streams are
/// read right after the kill (it can receive nothing more, and it is not promoted yet, so this
/// is exactly what it had), and a lost message must not be among them. No shard is ever read by
/// two members at once (the checker's rule (c)).
#[test]
fn kill_9_of_the_master_under_load_loses_only_unreplicated_entries() {
    kill_master_under_load(Lag::None);
}

/// As above, with the replica cut off (`CLIENT KILL TYPE replica` on the master, after pointing
/// the replica's `masteruser` at a user the master does not have, so that it cannot reconnect)
/// from just before a third member process joins until the kill: the new master lacks those
/// entries, acks, heartbeats, the join's epoch bumps and fence raises. The members hold epochs
/// and fences the new master never saw. Asserted: the stored epoch went back, a correction round
/// (docs/design.md §6.6) started a new incarnation, and no shard had two readers.
#[test]
fn kill_9_of_a_lagging_master_during_a_join_rolls_back_coordination_without_two_readers() {
    kill_master_under_load(Lag::CutDuringJoin);
}

/// How the replica trails the master at the kill.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lag {
    /// Not on purpose: only what asynchronous replication had not sent yet.
    None,
    /// Its link cut ~600 ms before the kill, while a third consumer process joins.
    CutDuringJoin,
}

fn kill_master_under_load(lag: Lag) {
    use stream_listener::testing::workload::{
        self as checker, Expected, Workload, first_read_since, now_us, poll_until,
    };
    use support::faults::{
        SHARDS, consumer, create_stream, pending_per_shard, save_logs, serial, strings,
        wait_settled, workload_binary,
    };
    const KEYS: u64 = 40;
    const COUNT: u64 = 3000;
    let expected = Expected {
        keys: KEYS,
        count: COUNT,
    };
    let ms = |us: u64| us as f64 / 1000.0;

    let _serial = serial();
    let mut setup = RedisSentinel::start().unwrap();
    let first_master = setup.master().unwrap().url();
    create_stream(&first_master);
    let mut via_sentinel = Vec::new();
    for url in setup.sentinel_urls() {
        via_sentinel.extend(["--sentinel".to_owned(), url]);
    }
    via_sentinel.extend([
        "--sentinel-master".to_owned(),
        setup.master_name().to_owned(),
    ]);
    let via: Vec<&str> = via_sentinel.iter().map(String::as_str).collect();
    let mut extra = vec!["--handler-ms", "2"];
    extra.extend(&via);
    // `--redis-url` is only the master's credentials here (none): its host is ignored.
    let mut consumers: Vec<Workload> = (0..2)
        .map(|i| consumer(&format!("consumer-{i}"), &first_master, 2, &extra))
        .collect();
    wait_settled(
        &consumers.iter().collect::<Vec<_>>(),
        Duration::from_secs(30),
        Duration::from_millis(800),
    );
    let mut produce = strings(&[
        "produce",
        "--stream",
        support::STREAM,
        "--keys",
        &KEYS.to_string(),
        "--count",
        &COUNT.to_string(),
        "--rate",
        "600",
        "--shards",
        &SHARDS.to_string(),
        "--batch",
        "32",
    ]);
    produce.extend(via_sentinel.iter().cloned());
    let mut producer = Workload::spawn(workload_binary(), "producer", &first_master, &produce);
    std::thread::sleep(Duration::from_millis(1500));

    if lag == Lag::CutDuringJoin {
        // The replica re-authenticates as a user the master does not have, so once its link is
        // killed it cannot reconnect: everything after this point stays on the master only.
        let mut replica = setup
            .replica()
            .unwrap()
            .unwrap()
            .client()
            .get_connection()
            .unwrap();
        for (name, value) in [("masteruser", "cut-off"), ("masterauth", "nope")] {
            let _: () = redis::cmd("CONFIG")
                .arg("SET")
                .arg(name)
                .arg(value)
                .query(&mut replica)
                .unwrap();
        }
        let mut master = setup.master().unwrap().client().get_connection().unwrap();
        let killed: i64 = redis::cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg("replica")
            .query(&mut master)
            .unwrap();
        assert_eq!(killed, 1, "the replica's link");
        consumers.push(consumer("consumer-2", &first_master, 2, &extra));
        // The join's epoch bumps and fence raises happen on the master only. (The replica's
        // link must not stay down past 10 x down-after, or Sentinel would not promote it.)
        let joined = poll_until(Duration::from_secs(6), || {
            consumers[2]
                .lines()
                .iter()
                .any(|l| matches!(l, checker::LogLine::Read(_)))
        });
        assert!(
            joined,
            "consumer-2 never read a shard: {}",
            consumers[2].stderr_text()
        );
    }
    let members = consumers.len() * 2;
    let at_kill = group_on(&first_master);
    let killed_us = now_us();
    let old_port = setup.kill_master().unwrap();
    let (replica_port, replica_url) = {
        let replica = setup.replica().unwrap().expect("the replica runs");
        (replica.port(), replica.url())
    };
    let on_replica = messages_on(&replica_url);
    let on_replica_group = group_on(&replica_url);
    let new_port = setup
        .wait_for_failover(Duration::from_secs(30))
        .expect("Sentinel promotes the replica");
    let promoted_us = now_us();
    assert_eq!(new_port, replica_port);
    let new_master = format!("redis://127.0.0.1:{new_port}");

    let all: Vec<&Workload> = consumers.iter().collect();
    let mut recovery_ms = std::collections::BTreeMap::new();
    for shard in 0..SHARDS {
        let read = poll_until(Duration::from_secs(30), || {
            first_read_since(&all, shard, promoted_us).is_some()
        });
        assert!(
            read,
            "shard {shard} was never read after the failover; stderr: {}",
            all.iter()
                .map(|c| c.stderr_text())
                .collect::<Vec<_>>()
                .join(" | ")
        );
        let (at, _) = first_read_since(&all, shard, promoted_us).unwrap();
        recovery_ms.insert(shard, ms(at - killed_us));
    }
    let status = producer.wait_exit(Duration::from_secs(60));
    assert!(
        status.is_some_and(|s| s.success()),
        "the producer did not finish (status {status:?}): {}",
        producer.stderr_text()
    );
    // Everything the new master has is handled, and nothing stays pending there.
    let on_new_master = messages_on(&new_master);
    let all_handled = poll_until(Duration::from_secs(30), || {
        let done = stream_listener::testing::workload::handled_messages(&all);
        on_new_master.iter().all(|m| done.contains(m))
    });
    let drained = poll_until(Duration::from_secs(15), || {
        pending_per_shard(&new_master).is_ok_and(|p| p.iter().all(|&n| n == 0))
    });
    let stable = support::faults::block_on(async {
        let target = target_of(&setup);
        let mut conn = connect(&target).await;
        let (group, stable) = wait_for_group(&mut conn, Duration::from_secs(20), |g| {
            g.state == GroupState::Stable
                && g.members.iter().filter(|m| m.live).count() == members
                && support::converged(g)
        })
        .await;
        (
            stable,
            format!(
                "{:?} (incarnation, epoch) ({}, {})",
                group.state, group.incarnation, group.group_epoch
            ),
            group.incarnation as i64,
        )
    });
    for consumer in consumers.iter_mut() {
        consumer.terminate(Duration::from_secs(20));
    }
    let not_on_replica: BTreeSet<(String, u64)> = expected
        .messages()
        .filter(|m| !on_replica.contains(m))
        .collect();
    // Read from the old master before the kill but never replicated: handled, then gone.
    let handled_before_kill: BTreeSet<(String, u64)> = consumers
        .iter()
        .flat_map(Workload::lines)
        .filter_map(|line| match line {
            checker::LogLine::Handled(h) if h.start_us < killed_us && h.ok => {
                Some((h.key.clone()?, h.seq?))
            }
            _ => None,
        })
        .collect();
    let handled_not_replicated = handled_before_kill
        .iter()
        .filter(|m| !on_replica.contains(*m))
        .count();
    let report = checker::check_allowing_unreplicated_loss(
        &consumers.iter().map(Workload::log).collect::<Vec<_>>(),
        expected,
        &[],
        &not_on_replica,
    );
    eprintln!(
        "Sentinel kill -9 of the master ({lag:?}) {old_port} -> {new_port}: {}; failover (kill to promotion) {} ms; first read per shard after the kill (ms): {recovery_ms:?}; on the replica at the kill: {} messages; handled before the kill but not on the replica: {handled_not_replicated}; lost (never handled, none on the replica): {}; group (incarnation, epoch) on the master at the kill {at_kill:?}, on the replica {on_replica_group:?}; group after: {}; producer: {}",
        report.summary(),
        ms(promoted_us - killed_us),
        on_replica.len(),
        report.lost_unreplicated,
        stable.1,
        producer.raw_lines().join(" ")
    );
    if !report.ok() || !all_handled || !drained || !stable.0 {
        let mut procs: Vec<&Workload> = consumers.iter().collect();
        procs.push(&producer);
        eprintln!(
            "logs saved in {}",
            save_logs(&format!("sentinel-kill-{lag:?}"), &procs)
        );
    }
    report.assert_ok();
    if lag == Lag::CutDuringJoin {
        let (Ok(master), Ok(replica)) = (&at_kill, &on_replica_group) else {
            panic!("the group could not be read: {at_kill:?} {on_replica_group:?}");
        };
        assert!(
            handled_not_replicated + report.lost_unreplicated > 0,
            "the cut replica lacked no entry"
        );
        assert!(
            replica.1 < master.1,
            "the join's epochs were not lost: master {master:?}, replica {replica:?}"
        );
        assert!(
            stable.2 > master.0,
            "no correction round (new incarnation) after the lost epochs: {}",
            stable.1
        );
    }
    assert!(all_handled, "entries on the new master were never handled");
    assert!(drained, "entries stay pending on the new master");
    assert!(stable.0, "the group is not STABLE again: {}", stable.1);
}

/// The group's `(incarnation, groupEpoch)` as stored on the server at `url` (its own view, no
/// Sentinel), or why it could not be read.
fn group_on(url: &str) -> Result<(i64, i64), String> {
    support::faults::block_on(async {
        let mut conn = RedisConnection::connect(
            &RedisTarget::standalone(url.to_owned()),
            Duration::from_secs(2),
        )
        .await
        .map_err(|e| e.to_string())?;
        let group = admin::describe_group(&mut conn, STREAM, support::GROUP, &support::fast())
            .await
            .map_err(|e| e.to_string())?;
        Ok((group.incarnation as i64, group.group_epoch as i64))
    })
}

/// An `XRANGE` entry: id and fields.
type StreamEntry = (String, Vec<(String, Vec<u8>)>);

/// The workload messages `(key, seq)` in the shard streams of the server at `url`.
fn messages_on(url: &str) -> BTreeSet<(String, u64)> {
    let client = redis::Client::open(url).unwrap();
    let mut conn = client.get_connection().unwrap();
    let mut out = BTreeSet::new();
    for shard in 0..support::faults::SHARDS {
        let entries: Vec<StreamEntry> = redis::cmd("XRANGE")
            .arg(format!("{{{}:{shard}}}", support::STREAM))
            .arg("-")
            .arg("+")
            .query(&mut conn)
            .unwrap();
        for (_, fields) in entries {
            let Some((_, payload)) = fields.iter().find(|(name, _)| name == "payload") else {
                continue;
            };
            let value: serde_json::Value = serde_json::from_slice(payload).unwrap();
            if let (Some(key), Some(seq)) = (value["key"].as_str(), value["seq"].as_u64()) {
                out.insert((key.to_owned(), seq));
            }
        }
    }
    out
}
