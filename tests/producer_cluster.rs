//! The producer on a real 3-master Redis Cluster (docs/design.md §9): batches fan out as one
//! pipeline per shard (a redis-rs cluster pipeline must stay in one slot), entries land where the
//! routing says, a stale publisher refreshes after a scale-in, and concurrent publishes land
//! exactly once, each with its own outcome.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use redis::AsyncCommands;
use stream_listener::core::internals::admin::{self};
use stream_listener::core::internals::connection::{RedisConnection, RedisTarget};
use stream_listener::testing::RedisCluster;
use stream_listener::{PublishError, Publisher, PublisherOptions, shard_for_key};
use support::{scale_in_and_retire, total_len};

async fn connect(cluster: &RedisCluster) -> RedisConnection {
    support::connect(&RedisTarget::cluster(cluster.urls())).await
}

/// The stream, through the admin API (shard streams and metadata, `metadataVersion` 1).
async fn create_stream(conn: &mut RedisConnection, prefix: &str, shards: u32) {
    let created = admin::create_stream(conn, prefix, shards).await.unwrap();
    assert!(created.created);
}

async fn xlen(conn: &mut RedisConnection, key: &str) -> u64 {
    conn.xlen(key).await.unwrap()
}

async fn exists(conn: &mut RedisConnection, key: &str) -> bool {
    conn.exists(key).await.unwrap()
}

#[tokio::test]
async fn batches_and_single_publishes_land_on_their_shards_across_the_cluster() {
    let cluster = RedisCluster::start().unwrap();
    let mut conn = connect(&cluster).await;
    create_stream(&mut conn, "orders", 16).await;
    let publisher = Publisher::new(conn.clone(), "orders", PublisherOptions::default())
        .await
        .unwrap();

    let keys: Vec<String> = (0..5_000).map(|i| format!("customer-{i}")).collect();
    let mut published = Vec::new();
    // Batches of 64, then one large batch, then single publishes.
    for chunk in keys[..3_000].chunks(64) {
        let batch: Vec<(&str, &str)> = chunk.iter().map(|k| (k.as_str(), "order")).collect();
        published.extend(publisher.publish_batch(&batch).await.unwrap());
    }
    let large: Vec<(&str, u32)> = keys[3_000..4_900].iter().map(|k| (k.as_str(), 7)).collect();
    published.extend(publisher.publish_batch(&large).await.unwrap());
    for key in &keys[4_900..] {
        published.push(publisher.publish(key, &[1, 2, 3]).await.unwrap());
    }

    let mut expected: BTreeMap<u32, u64> = BTreeMap::new();
    for (key, p) in keys.iter().zip(&published) {
        let shard = shard_for_key(key, 16);
        assert_eq!(p.shard, shard, "{key}");
        assert_eq!(p.stream_key, format!("{{orders:{shard}}}"));
        *expected.entry(shard).or_default() += 1;
    }
    assert_eq!(expected.len(), 16);
    let mut sum = 0;
    for (shard, count) in &expected {
        let len = xlen(&mut conn, &format!("{{orders:{shard}}}")).await;
        assert_eq!(len, *count, "shard {shard}");
        sum += len;
    }
    assert_eq!(sum, keys.len() as u64);
    assert_eq!(total_len(&mut conn, "orders", 16).await, 5_000);

    // Entry ids of one shard grow in batch order (per-key order holds within a batch).
    let shard0: Vec<&str> = published
        .iter()
        .filter(|p| p.shard == 0)
        .map(|p| p.entry_id.as_str())
        .collect();
    let ids: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
        .arg("{orders:0}")
        .arg("-")
        .arg("+")
        .query_async(&mut conn)
        .await
        .unwrap();
    let stored: Vec<&str> = ids.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(stored, shard0);
}

#[tokio::test]
async fn a_stale_publisher_on_the_cluster_refreshes_after_scale_in() {
    let cluster = RedisCluster::start().unwrap();
    let mut conn = connect(&cluster).await;
    create_stream(&mut conn, "orders", 8).await;
    let stale = Publisher::new(
        conn.clone(),
        "orders",
        PublisherOptions {
            refresh_interval: Duration::from_secs(3600),
            routing_lease: Duration::from_secs(7200),
            ..PublisherOptions::default()
        },
    )
    .await
    .unwrap();
    scale_in_and_retire(&mut conn, "orders", 5).await;

    let keys: Vec<String> = (0..1_000).map(|i| format!("user-{i}")).collect();
    let batch: Vec<(&str, usize)> = keys.iter().map(|k| (k.as_str(), k.len())).collect();
    let published = stale.publish_batch(&batch).await.unwrap();
    for (key, p) in keys.iter().zip(&published) {
        assert_eq!(p.shard, shard_for_key(key, 5), "{key}");
    }
    assert_eq!(stale.routing_snapshot().shard_count, 5);
    assert_eq!(total_len(&mut conn, "orders", 5).await, 1_000);
    for shard in 5..8 {
        let key = format!("{{orders:{shard}}}");
        assert!(!exists(&mut conn, &key).await, "{key} was re-created");
    }
}

/// Concurrent single publishes on the cluster (docs/design.md §9: coalesced per shard, each
/// shard's pipeline on its own node): every entry lands exactly once under the id its caller got,
/// each caller's entries of a shard in its call order, and an error reply of one shard
/// (`WRONGTYPE`) fails only the publishes to that shard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_publishes_land_exactly_once_per_caller_and_errors_stay_with_their_shard() {
    const CALLERS: usize = 64;
    const EACH: usize = 30;
    let cluster = RedisCluster::start().unwrap();
    let mut conn = connect(&cluster).await;
    create_stream(&mut conn, "orders", 16).await;
    let _: i64 = conn.del("{orders:5}").await.unwrap();
    let _: () = conn.set("{orders:5}", "not a stream").await.unwrap();
    let publisher = Publisher::new(conn.clone(), "orders", PublisherOptions::default())
        .await
        .unwrap();
    let tasks: Vec<_> = (0..CALLERS)
        .map(|caller| {
            let publisher = publisher.clone();
            tokio::spawn(async move {
                let mut outcomes = Vec::new();
                for i in 0..EACH {
                    let key = format!("caller-{caller}-{}", i % 7);
                    let outcome = publisher.publish(&key, &(caller, i)).await;
                    outcomes.push((key, outcome));
                }
                outcomes
            })
        })
        .collect();
    let mut returned: BTreeMap<(String, String), (usize, usize)> = BTreeMap::new();
    let mut refused = 0;
    for (caller, task) in tasks.into_iter().enumerate() {
        for (i, (key, outcome)) in task.await.unwrap().into_iter().enumerate() {
            match outcome {
                Ok(p) => {
                    assert_eq!(p.shard, shard_for_key(&key, 16), "{key}");
                    assert_ne!(p.shard, 5, "{key}");
                    returned.insert((p.stream_key, p.entry_id), (caller, i));
                }
                Err(PublishError::Redis(e)) if shard_for_key(&key, 16) == 5 => {
                    assert_eq!(e.code(), Some("WRONGTYPE"), "{key}: {e}");
                    refused += 1;
                }
                Err(e) => panic!("{key}: {e}"),
            }
        }
    }
    assert!(refused > 0, "some keys route to shard 5");
    assert_eq!(returned.len() + refused, CALLERS * EACH);

    let mut stored = 0;
    for shard in (0..16).filter(|&s| s != 5) {
        let stream_key = format!("{{orders:{shard}}}");
        let entries: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
            .arg(&stream_key)
            .arg("-")
            .arg("+")
            .query_async(&mut conn)
            .await
            .unwrap();
        let mut last: BTreeMap<usize, usize> = BTreeMap::new();
        for (id, fields) in entries {
            let (caller, i): (usize, usize) = serde_json::from_str(&fields[1].1).unwrap();
            assert_eq!(returned.get(&(stream_key.clone(), id)), Some(&(caller, i)));
            if let Some(before) = last.insert(caller, i) {
                assert!(
                    before < i,
                    "caller {caller}: #{i} after #{before} on {stream_key}"
                );
            }
            stored += 1;
        }
    }
    assert_eq!(stored, returned.len(), "every entry exactly once");
}
