//! Waiting for replicas (README "Waiting for replicas", docs/design.md §15.4) on a real master
//! with one replica (`replicaof`): with `min_replica_acks = 1` publishes and acks wait for the
//! replica and succeed; with the replica frozen (`SIGSTOP`) a publish returns
//! `PublishError::NotReplicated` with the count after about `replica_ack_timeout` (the entries
//! are on the master), and a listener still handles and acks everything, logging a warning per
//! ack that the replica missed.
//!
//! The process-wide `tracing` subscriber (a buffer) is installed once for both tests.

mod support;

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use serde_json::json;
use stream_listener::core::internals::admin;
use stream_listener::core::internals::connection::{RedisConnection, RedisTarget};
use stream_listener::core::internals::dataplane::FencingMode;
use stream_listener::core::member::ListenerOptions;
use stream_listener::core::producer::{PublishError, Publisher, PublisherOptions};
use stream_listener::testing::RedisServer;
use support::logs::LogBuffer;
use support::{Recorder, STREAM, connect, info, wait_until};

const TIMEOUT: Duration = Duration::from_millis(100);
/// The publishers' `replica_ack_timeout` where the replica is up: long enough for a loaded
/// machine (an online replica on loopback acknowledges in well under a millisecond).
const ONLINE_TIMEOUT: Duration = Duration::from_secs(2);

/// The test process's log lines, warnings and errors (one subscriber for every test here).
fn logs() -> &'static LogBuffer {
    static LOGS: OnceLock<LogBuffer> = OnceLock::new();
    LOGS.get_or_init(|| support::logs::capture(tracing::Level::WARN))
}

fn count_in_logs(text: &str) -> usize {
    logs().text().matches(text).count()
}

/// A master and a replica of it, the replica online (`INFO replication` of the master), and the
/// stream `orders` of 2 shards.
async fn master_and_replica() -> (RedisServer, RedisServer, RedisConnection) {
    let master = RedisServer::start().unwrap();
    let replica = RedisServer::builder()
        .config("replicaof", format!("127.0.0.1 {}", master.port()))
        .start()
        .unwrap();
    let mut conn = connect(&RedisTarget::standalone(master.url())).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let replication = info(&mut conn, "replication").await;
        if replication.contains("connected_slaves:1") && replication.contains("state=online") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "replica not online: {replication}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    admin::create_stream(&mut conn, STREAM, 2).await.unwrap();
    (master, replica, conn)
}

fn waiting_publisher() -> PublisherOptions {
    PublisherOptions {
        min_replica_acks: 1,
        replica_ack_timeout: TIMEOUT,
        ..PublisherOptions::default()
    }
}

fn waiting_listener(fencing: FencingMode) -> ListenerOptions {
    let mut options = support::options(1);
    options.fencing = fencing;
    options.min_replica_acks = 1;
    options.replica_ack_timeout = TIMEOUT;
    options
}

fn batch(from: u64, count: u64) -> Vec<(String, serde_json::Value)> {
    (from..from + count)
        .map(|n| (format!("k{n}"), json!({ "n": n })))
        .collect()
}

/// Entries pending in group `billing` on both shards (`XPENDING` summary).
async fn pending(conn: &mut RedisConnection) -> u64 {
    let mut total = 0;
    for shard in 0..2 {
        total += support::pending_count(conn, shard).await;
    }
    total
}

async fn shard_lengths(conn: &mut RedisConnection) -> u64 {
    support::total_len(conn, STREAM, 2).await
}

/// With the replica up: publishes (one and a batch) and acks wait for it and succeed, in both
/// fencing modes; the replica has every entry and every ack.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishes_and_acks_wait_for_an_online_replica() {
    logs();
    let (master, replica, mut conn) = master_and_replica().await;
    let online = PublisherOptions {
        replica_ack_timeout: ONLINE_TIMEOUT,
        ..waiting_publisher()
    };
    let publisher = Publisher::new(conn.clone(), STREAM, online).await.unwrap();
    publisher
        .publish("k0", &json!({ "n": 0 }))
        .await
        .expect("one publish acknowledged by the replica");
    let published = publisher.publish_batch(&batch(1, 39)).await.unwrap();
    assert_eq!(published.len(), 39);

    let mut replica_conn = connect(&RedisTarget::standalone(replica.url())).await;
    assert_eq!(
        shard_lengths(&mut replica_conn).await,
        40,
        "WAIT returned: the replica has them"
    );

    for (fencing, from) in [(FencingMode::Strict, 40), (FencingMode::Acks, 80)] {
        let recorder = Arc::new(Recorder::default());
        let listener = support::start_recording(
            &RedisTarget::standalone(master.url()),
            &recorder,
            waiting_listener(fencing),
            Duration::ZERO,
        )
        .await;
        if from > 40 {
            publisher.publish_batch(&batch(from, 40)).await.unwrap();
        }
        // Each run handles the 40 entries the group has not consumed yet.
        assert!(
            wait_until(Duration::from_secs(10), || recorder.handled().len() == 40).await,
            "{fencing:?}: handled {}",
            recorder.handled().len()
        );
        listener.shutdown_and_wait().await.expect("clean shutdown");
        assert_eq!(
            pending(&mut conn).await,
            0,
            "{fencing:?}: every entry acked"
        );
        // The member's last acks may have gone without a WAIT of their own (one in flight at a
        // time, docs/design.md §15.4): replication brings them all the same.
        let mut replica_pending = pending(&mut replica_conn).await;
        let deadline = Instant::now() + Duration::from_secs(5);
        while replica_pending > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
            replica_pending = pending(&mut replica_conn).await;
        }
        assert_eq!(
            replica_pending, 0,
            "{fencing:?}: the acks reached the replica"
        );
    }
}

/// With the replica frozen: a publish fails with `NotReplicated` (0 of 1) after about
/// `replica_ack_timeout`, its entries on the master; a listener handles and acks every entry
/// all the same and logs a warning for the acks the replica missed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_replica_fails_publishes_with_the_count_and_only_warns_on_acks() {
    logs();
    let (master, replica, mut conn) = master_and_replica().await;
    let publisher = Publisher::new(conn.clone(), STREAM, waiting_publisher())
        .await
        .unwrap();
    replica.pause().unwrap();

    let started = Instant::now();
    let error = publisher.publish_batch(&batch(0, 20)).await.unwrap_err();
    let waited = started.elapsed();
    match &error {
        PublishError::NotReplicated {
            published,
            acked,
            wanted,
            timeout,
        } => {
            assert_eq!(
                (published.len(), *acked, *wanted, *timeout),
                (20, 0, 1, TIMEOUT)
            );
        }
        other => panic!("expected NotReplicated, got {other:?}"),
    }
    assert!(
        waited >= TIMEOUT && waited < TIMEOUT + Duration::from_secs(1),
        "failed after {waited:?}"
    );
    assert!(error.to_string().contains("0 of 1 replicas"), "{error}");
    let started = Instant::now();
    let one = publisher.publish("k20", &json!({ "n": 20 })).await;
    assert!(
        matches!(one, Err(PublishError::NotReplicated { acked: 0, .. })),
        "{one:?}"
    );
    assert!(started.elapsed() >= TIMEOUT);
    assert_eq!(
        shard_lengths(&mut conn).await,
        21,
        "the entries are on the master"
    );

    let warning = "fewer replicas than min_replica_acks acknowledged an ack";
    let before = count_in_logs(warning);
    let recorder = Arc::new(Recorder::default());
    let listener = support::start_recording(
        &RedisTarget::standalone(master.url()),
        &recorder,
        waiting_listener(FencingMode::Strict),
        Duration::ZERO,
    )
    .await;
    assert!(
        wait_until(Duration::from_secs(15), || recorder.handled().len() == 21).await,
        "handled {}",
        recorder.handled().len()
    );
    listener.shutdown_and_wait().await.expect("clean shutdown");
    assert_eq!(
        pending(&mut conn).await,
        0,
        "every entry acked on the master"
    );
    assert!(
        count_in_logs(warning) > before,
        "the missed acks were logged"
    );
    replica.resume().unwrap();
}

/// On a cluster (3 masters, no replicas) each publish's `WAIT` runs on the node of its shard
/// stream, in the XADD's pipeline (`INFO commandstats` of each node counts its `WAIT`s), and,
/// no replica being there, the publish fails with `NotReplicated` (0 of 1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_wait_runs_on_the_node_of_the_write() {
    use stream_listener::testing::RedisCluster;
    logs();
    let cluster = RedisCluster::start().unwrap();
    let target = RedisTarget::cluster(cluster.urls());
    let mut conn = connect(&target).await;
    admin::create_stream(&mut conn, STREAM, 8).await.unwrap();
    let publisher = Publisher::new(conn.clone(), STREAM, waiting_publisher())
        .await
        .unwrap();
    let mut nodes = Vec::new();
    for node in cluster.nodes() {
        nodes.push(connect(&RedisTarget::standalone(node.url())).await);
    }
    for shard in [0u32, 3, 5] {
        let key = support::key_on_shard(shard, 8);
        let stream_key = format!("{{{STREAM}:{shard}}}");
        let mut before = Vec::new();
        for node in &mut nodes {
            before.push(
                support::command_calls(node)
                    .await
                    .get("wait")
                    .copied()
                    .unwrap_or(0),
            );
        }
        let outcome = publisher.publish(&key, &json!({ "n": shard })).await;
        assert!(
            matches!(&outcome, Err(PublishError::NotReplicated { acked: 0, wanted: 1, published, .. }) if published[0].stream_key == stream_key),
            "{outcome:?}"
        );
        for (i, node) in nodes.iter_mut().enumerate() {
            let waits = support::command_calls(node)
                .await
                .get("wait")
                .copied()
                .unwrap_or(0);
            let owns: Result<u64, _> = redis::cmd("XLEN").arg(&stream_key).query_async(node).await;
            let expected = u64::from(owns.is_ok());
            assert_eq!(
                waits - before[i],
                expected,
                "node {i} (owns {stream_key}: {})",
                owns.is_ok()
            );
        }
    }
}

/// A replica killed while a member of 32 shards acks with `min_replica_acks = 1` and the
/// default fencing. All shards' acks go through the member's one data-plane connection, where
/// Redis runs queued `WAIT`s one after the other, so one `WAIT` per shard's ack would hold every
/// read behind them for up to 32 × the timeout (and the heartbeats, before the member had a
/// data-plane connection of its own; on Sentinel they still share it). What must hold:
/// consumption goes on (acks only warn) and no heartbeat times out.
///
/// It failed before the member's ack waits were one at a time (`replication::AckWaits`,
/// docs/design.md §15.4): with 32 shards the member handled nothing for about 4–6 s after the
/// kill and its heartbeats timed out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_under_load_does_not_stall_a_member_of_many_shards() {
    logs();
    let master = RedisServer::start().unwrap();
    let mut replica = RedisServer::builder()
        .config("replicaof", format!("127.0.0.1 {}", master.port()))
        .start()
        .unwrap();
    let mut conn = connect(&RedisTarget::standalone(master.url())).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !info(&mut conn, "replication")
        .await
        .contains("state=online")
    {
        assert!(Instant::now() < deadline, "replica not online");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    const SHARDS: u32 = 32;
    admin::create_stream(&mut conn, STREAM, SHARDS)
        .await
        .unwrap();
    let publisher = Publisher::new(conn.clone(), STREAM, PublisherOptions::default())
        .await
        .unwrap();
    let recorder = Arc::new(Recorder::default());
    let mut options = support::options(1);
    options.min_replica_acks = 1;
    options.replica_ack_timeout = Duration::from_millis(180);
    let listener = support::start_recording(
        &RedisTarget::standalone(master.url()),
        &recorder,
        options,
        Duration::ZERO,
    )
    .await;
    let owned = || {
        listener
            .status()
            .iter()
            .map(|m| m.owned.len())
            .sum::<usize>()
    };
    assert!(wait_until(Duration::from_secs(15), || owned() == SHARDS as usize).await);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let publishing = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut n = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                publisher.publish_batch(&batch(n, 4)).await.unwrap();
                n += 4;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            n
        })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    let heartbeat_failures = count_in_logs("heartbeat failed");
    replica.kill().unwrap();
    // The longest time without a newly handled entry, over 6 s.
    let mut last = recorder.handled().len();
    let mut last_change = Instant::now();
    let mut longest = Duration::ZERO;
    let end = Instant::now() + Duration::from_secs(6);
    while Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = recorder.handled().len();
        if now != last {
            last = now;
            last_change = Instant::now();
        }
        longest = longest.max(last_change.elapsed());
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let published = publishing.await.unwrap();
    let all = wait_until(Duration::from_secs(30), || {
        recorder.handled().len() as u64 == published
    })
    .await;
    listener.shutdown_and_wait().await.expect("clean shutdown");
    assert!(all, "handled {} of {published}", recorder.handled().len());
    assert!(
        longest < Duration::from_secs(2),
        "nothing handled for {longest:?} after the replica was killed"
    );
    assert_eq!(
        count_in_logs("heartbeat failed"),
        heartbeat_failures,
        "heartbeats timed out behind the queued WAITs"
    );
}
