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
