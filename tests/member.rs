//! The member runtime on real Redis: listeners consume sharded streams end to end (docs/design.md
//! §6–§8).

mod support;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use stream_listener::core::handler::{Delivery, HandlerError};
use stream_listener::core::internals::admin;
use stream_listener::core::internals::connection::RedisTarget;
use stream_listener::core::internals::coordinator::CoordinatorConfig;
use stream_listener::core::member::{Listener, ListenerHandle, ListenerOptions};
use stream_listener::core::producer::{Publisher, PublisherOptions};
use stream_listener::testing::{RedisCluster, RedisServer};
use support::{connect, wait_until};

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Event {
    key: String,
    seq: u64,
}

/// One handler call, as the test saw it.
#[derive(Debug, Clone)]
struct Handled {
    member: String,
    shard: u32,
    entry_id: String,
    key: String,
    seq: u64,
}

type Log = Arc<Mutex<Vec<Handled>>>;

fn fast_coordination() -> CoordinatorConfig {
    support::fast()
}

fn options(concurrency: u32) -> ListenerOptions {
    let mut options = ListenerOptions::default();
    options.concurrency = concurrency;
    options.coordination = fast_coordination();
    options.block = Duration::from_millis(500);
    options.batch_size = 64;
    options
}

async fn start_listener(
    target: &RedisTarget,
    log: &Log,
    options: ListenerOptions,
) -> ListenerHandle {
    let log = log.clone();
    let handler = move |delivery: Delivery| {
        let log = log.clone();
        async move {
            let payload = delivery
                .payload()
                .ok_or_else(|| HandlerError::Decode("no payload field".into()))?;
            let event: Event =
                serde_json::from_slice(payload).map_err(|e| HandlerError::Decode(e.to_string()))?;
            log.lock().unwrap().push(Handled {
                member: delivery.member_id.to_string(),
                shard: delivery.shard,
                entry_id: delivery.entry_id.clone(),
                key: event.key,
                seq: event.seq,
            });
            Ok::<(), HandlerError>(())
        }
    };
    Listener::new(target.clone(), "orders", "billing", handler, options)
        .unwrap()
        .start()
        .await
        .unwrap()
}

async fn publish(target: &RedisTarget, keys: usize, count: usize) {
    let publisher = Publisher::new(connect(target).await, "orders", PublisherOptions::default())
        .await
        .unwrap();
    let mut seqs = vec![0u64; keys];
    let mut batch = Vec::new();
    for n in 0..count {
        let k = n % keys;
        batch.push((
            format!("key-{k}"),
            Event {
                key: format!("key-{k}"),
                seq: seqs[k],
            },
        ));
        seqs[k] += 1;
        if batch.len() == 64 {
            publisher.publish_batch(&batch).await.unwrap();
            batch.clear();
        }
    }
    if !batch.is_empty() {
        publisher.publish_batch(&batch).await.unwrap();
    }
}

/// Every message handled at least once; per key, first-time handling in publish order.
fn check_complete_and_ordered(log: &[Handled], keys: usize, count: usize) {
    let mut first_seen: HashMap<(String, u64), usize> = HashMap::new();
    for (i, h) in log.iter().enumerate() {
        first_seen.entry((h.key.clone(), h.seq)).or_insert(i);
    }
    assert_eq!(
        first_seen.len(),
        count,
        "every message handled at least once"
    );
    let mut per_key: BTreeMap<String, Vec<(usize, u64)>> = BTreeMap::new();
    for ((key, seq), i) in &first_seen {
        per_key.entry(key.clone()).or_default().push((*i, *seq));
    }
    assert_eq!(per_key.len(), keys);
    for (key, mut firsts) in per_key {
        firsts.sort();
        let seqs: Vec<u64> = firsts.iter().map(|(_, s)| *s).collect();
        let expected: Vec<u64> = (0..seqs.len() as u64).collect();
        assert_eq!(seqs, expected, "first-time handling of {key} out of order");
    }
}

async fn consume_everything(target: RedisTarget) {
    let mut conn = connect(&target).await;
    admin::create_stream(&mut conn, "orders", 8).await.unwrap();
    let log: Log = Arc::default();
    let handle = start_listener(&target, &log, options(4)).await;
    // Let the four members settle (two shards each) before publishing, so that no shard moves
    // while the messages are consumed.
    let settled = wait_until(Duration::from_secs(20), || {
        handle.status().iter().all(|s| s.owned.len() == 2)
    })
    .await;
    assert!(settled, "members did not settle: {:?}", handle.status());
    publish(&target, 500, 20_000).await;
    let complete = wait_until(Duration::from_secs(60), || {
        // Entry ids are unique per shard stream only.
        let log = log.lock().unwrap();
        let distinct: std::collections::HashSet<(u32, &str)> =
            log.iter().map(|h| (h.shard, h.entry_id.as_str())).collect();
        distinct.len() >= 20_000
    })
    .await;
    let status = handle.status();
    handle.shutdown_and_wait().await.expect("clean shutdown");
    let log = log.lock().unwrap().clone();
    let distinct: std::collections::HashSet<(u32, &str)> =
        log.iter().map(|h| (h.shard, h.entry_id.as_str())).collect();
    let keys: std::collections::HashSet<(&str, u64)> =
        log.iter().map(|h| (h.key.as_str(), h.seq)).collect();
    assert!(
        complete,
        "{} calls, {} distinct entries, {} distinct messages, status {status:?}",
        log.len(),
        distinct.len(),
        keys.len()
    );
    check_complete_and_ordered(&log, 500, 20_000);
    // Four members shared the eight shards, two each, and each shard was read by one member:
    // nothing moved once the group was stable.
    let owned: Vec<usize> = status.iter().map(|s| s.owned.len()).collect();
    assert_eq!(owned, vec![2, 2, 2, 2], "{status:?}");
    let mut readers: BTreeMap<u32, std::collections::BTreeSet<String>> = BTreeMap::new();
    for h in &log {
        readers.entry(h.shard).or_default().insert(h.member.clone());
    }
    assert_eq!(readers.len(), 8);
    assert!(readers.values().all(|m| m.len() == 1), "{readers:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_members_consume_twenty_thousand_messages_in_key_order() {
    let server = RedisServer::start().unwrap();
    consume_everything(RedisTarget::standalone(server.url())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_members_consume_twenty_thousand_messages_in_key_order_on_a_cluster() {
    let cluster = RedisCluster::start().unwrap();
    consume_everything(RedisTarget::cluster(cluster.urls())).await;
}

/// Redis restarted empty: it loses everything mid-run. A listener whose stream is configured
/// with `shards` provisions stream and group again (consumer groups from 0) and handles every
/// message written after the loss; without that, it fails closed and creates nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_metadata_is_provisioned_again_from_the_configured_shard_count() {
    let server = RedisServer::start().unwrap();
    let target = RedisTarget::standalone(server.url());
    lost_metadata_is_provisioned_again(&target, || {
        let mut conn = server.client().get_connection().unwrap();
        let () = redis::cmd("FLUSHALL").query(&mut conn).unwrap();
    })
    .await;
}

/// The same on a cluster, every master losing its data. The members come back with epochs the
/// new group does not know, so the coordinator runs a correction round, which reads every
/// shard's fence: one pipeline across the shards' slots, which a cluster refuses
/// (`CrossSlot`), so every heartbeat failed and nothing was read again (found by review).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_metadata_is_provisioned_again_on_a_cluster() {
    let cluster = RedisCluster::start().unwrap();
    let target = RedisTarget::cluster(cluster.urls());
    lost_metadata_is_provisioned_again(&target, || {
        for node in cluster.nodes() {
            let mut conn = node.client().get_connection().unwrap();
            // Replicas refuse writes; their masters' FLUSHALL reaches them.
            let _: redis::RedisResult<()> = redis::cmd("FLUSHALL").query(&mut conn);
        }
    })
    .await;
}

/// A stream scaled out past its configured `shards` (8 against 4), then lost: the members
/// provision it again with the count they last saw, not the configured one, so every shard
/// they owned exists again. Before, it came back with 4 shards, and the member, which still held
/// shards 4 to 7, was refused every heartbeat for good ("shard 4 in ownedShards is out of
/// range") and read nothing (found by review).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_scaled_past_its_configured_shards_comes_back_with_the_count_last_seen() {
    let server = RedisServer::start().unwrap();
    let target = RedisTarget::standalone(server.url());
    let mut conn = connect(&target).await;
    admin::create_stream(&mut conn, "orders", 4).await.unwrap();
    admin::scale(&mut conn, "orders", 8).await.unwrap();
    let log: Log = Arc::default();
    let mut opts = options(1);
    opts.auto_create_shards = Some(4);
    let handle = start_listener(&target, &log, opts).await;
    until_owned(&handle, &(0..8).collect::<Vec<u32>>()).await;
    let () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
    assert_eq!(
        provisioned_again(&mut conn).await.shard_count,
        8,
        "provisioned again with the count last seen"
    );
    handles_200_published(&target, &log, handle).await;
}

/// The stream created again with fewer shards than a member holds (by another process, or an
/// operator, after a loss): the coordinator refuses every request that names a shard it no
/// longer has. The member stops its shards and joins again, as after a fencing status, instead
/// of being refused for good while it reads nothing (found by review).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_holding_shards_the_stream_no_longer_has_joins_again() {
    let server = RedisServer::start().unwrap();
    let target = RedisTarget::standalone(server.url());
    let mut conn = connect(&target).await;
    admin::create_stream(&mut conn, "orders", 8).await.unwrap();
    let log: Log = Arc::default();
    let handle = start_listener(&target, &log, options(1)).await;
    until_owned(&handle, &(0..8).collect::<Vec<u32>>()).await;
    // Lost, and created again with 4 shards, the group registered as a listener's start would,
    // then scaled to 5: metadataVersion 3, so the member reads the new shard count (a stream
    // created again at the version the member last saw looks the same to it: docs/design.md
    // §12.1).
    let () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
    admin::create_stream(&mut conn, "orders", 4).await.unwrap();
    stream_listener::core::internals::store::provision::register_group(
        &mut conn,
        "orders",
        "billing",
        stream_listener::core::model::StartFrom::Earliest,
    )
    .await
    .unwrap();
    admin::scale(&mut conn, "orders", 5).await.unwrap();
    until_owned(&handle, &[0, 1, 2, 3, 4]).await;
    handles_200_published(&target, &log, handle).await;
}

/// Waits (up to 20 s) until the listener's one member owns exactly `shards`.
async fn until_owned(handle: &ListenerHandle, shards: &[u32]) {
    assert!(
        wait_until(Duration::from_secs(20), || handle.status()[0].owned
            == shards)
        .await,
        "{:?} {:?}",
        handle.status(),
        handle.health()
    );
}

/// Waits (up to 10 s) until the stream metadata of `orders` exists again, and returns it.
async fn provisioned_again(
    conn: &mut stream_listener::core::internals::connection::RedisConnection,
) -> stream_listener::core::model::StreamMetadata {
    let keys = stream_listener::core::internals::keys::StreamKeys::new("orders").unwrap();
    for _ in 0..200 {
        if let Some(meta) =
            stream_listener::core::internals::store::load_stream_metadata(conn, &keys)
                .await
                .unwrap()
        {
            return meta;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("stream metadata not provisioned again");
}

/// Publishes 200 entries over 20 keys, checks that `handle`'s listener handles them all within
/// 30 s (into `log`, cleared by the caller), and shuts it down.
async fn handles_200_published(target: &RedisTarget, log: &Log, handle: ListenerHandle) {
    publish(target, 20, 200).await;
    let all = wait_until(Duration::from_secs(30), || log.lock().unwrap().len() >= 200).await;
    let status = handle.status();
    handle.shutdown_and_wait().await.expect("clean shutdown");
    assert!(
        all,
        "{} of 200 handled: {status:?}",
        log.lock().unwrap().len()
    );
}

async fn lost_metadata_is_provisioned_again(target: &RedisTarget, lose_everything: impl Fn()) {
    let mut conn = connect(target).await;
    admin::create_stream(&mut conn, "orders", 4).await.unwrap();
    let log: Log = Arc::default();
    let mut opts = options(2);
    opts.auto_create_shards = Some(4);
    let handle = start_listener(target, &log, opts).await;
    publish(target, 20, 200).await;
    assert!(wait_until(Duration::from_secs(20), || log.lock().unwrap().len() >= 200).await);
    lose_everything();
    // The members notice on their next heartbeat and provision the stream again.
    provisioned_again(&mut conn).await;
    log.lock().unwrap().clear();
    publish(target, 20, 200).await;
    let all = wait_until(Duration::from_secs(30), || log.lock().unwrap().len() >= 200).await;
    handle.shutdown_and_wait().await.expect("clean shutdown");
    let log = log.lock().unwrap().clone();
    assert!(
        all,
        "only {} of the 200 messages written after the loss were handled",
        log.len()
    );
    check_complete_and_ordered(&log, 20, 200);
}

/// Two processes with the same static identity: the last join wins and the replaced one stops
/// for good, which its handle reports so the application can exit with an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replaced_static_member_stops_for_good_and_says_so() {
    let server = RedisServer::start().unwrap();
    let target = RedisTarget::standalone(server.url());
    let mut conn = connect(&target).await;
    admin::create_stream(&mut conn, "orders", 2).await.unwrap();
    let log: Log = Arc::default();
    let mut opts = options(1);
    opts.instance_id = Some("pod-a".into());
    let first = start_listener(&target, &log, opts.clone()).await;
    assert!(
        wait_until(Duration::from_secs(10), || first.status()[0].owned.len()
            == 2)
        .await
    );
    let second = start_listener(&target, &log, opts).await;
    let stopped = tokio::time::timeout(Duration::from_secs(10), first.stopped_for_good())
        .await
        .expect("the replaced process learns it is fenced within a few heartbeats");
    assert_eq!(stopped.member_id, "pod-a-m0");
    assert!(
        stopped.reason.contains("FENCED_INSTANCE_ID"),
        "{}",
        stopped.reason
    );
    assert!(first.status()[0].owned.is_empty(), "it stopped reading");
    assert!(
        wait_until(Duration::from_secs(10), || second.status()[0].owned.len()
            == 2)
        .await
    );
    second.shutdown_and_wait().await.expect("clean shutdown");
    first.join().await.expect("clean stop");
}

/// A huge entry: an entry over `max_entry_bytes` never reaches the process: it is
/// dead-lettered by id (reason `too-large`, without its body) and acked, and its neighbours are
/// handled in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_over_the_size_limit_is_dead_lettered_by_id() {
    let server = RedisServer::start().unwrap();
    let target = RedisTarget::standalone(server.url());
    let mut conn = connect(&target).await;
    admin::create_stream(&mut conn, "orders", 1).await.unwrap();
    let event = |seq: u64| {
        serde_json::to_string(&Event {
            key: "k".into(),
            seq,
        })
        .unwrap()
    };
    let _: String = redis::cmd("XADD")
        .arg("{orders:0}")
        .arg("*")
        .arg("key")
        .arg("k")
        .arg("payload")
        .arg(event(0))
        .query_async(&mut conn)
        .await
        .unwrap();
    let big: String = redis::cmd("XADD")
        .arg("{orders:0}")
        .arg("*")
        .arg("key")
        .arg("k")
        .arg("payload")
        .arg("x".repeat(2 * 1024 * 1024))
        .query_async(&mut conn)
        .await
        .unwrap();
    let _: String = redis::cmd("XADD")
        .arg("{orders:0}")
        .arg("*")
        .arg("key")
        .arg("k")
        .arg("payload")
        .arg(event(1))
        .query_async(&mut conn)
        .await
        .unwrap();
    let log: Log = Arc::default();
    let mut opts = options(1);
    opts.max_entry_bytes = Some(1024 * 1024);
    let handle = start_listener(&target, &log, opts).await;
    assert!(wait_until(Duration::from_secs(20), || log.lock().unwrap().len() >= 2).await);
    let dead: Vec<redis::Value> = redis::cmd("XRANGE")
        .arg("orders:dlq:billing")
        .arg("-")
        .arg("+")
        .query_async(&mut conn)
        .await
        .unwrap();
    handle.shutdown_and_wait().await.expect("clean shutdown");
    let seqs: Vec<u64> = log.lock().unwrap().iter().map(|h| h.seq).collect();
    assert_eq!(seqs, vec![0, 1], "the neighbours are handled, in order");
    assert_eq!(dead.len(), 1, "one dead letter");
    let text = format!("{dead:?}");
    assert!(
        text.contains("too-large") && text.contains(&big),
        "{}",
        &text[..text.len().min(400)]
    );
    assert!(
        text.len() < 10_000,
        "the body was not copied into the dead letter"
    );
    let pending: (u64, redis::Value, redis::Value, redis::Value) = redis::cmd("XPENDING")
        .arg("{orders:0}")
        .arg("billing")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(pending.0, 0, "acked");
}
