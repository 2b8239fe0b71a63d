//! The producer on a real standalone Redis (docs/design.md §9): entries land where the
//! routing says, resharding moves only the keys it must, a stale publisher refreshes after a
//! scale-in, bad input is refused before any `XADD`, publishing fails closed past the routing
//! lease, and concurrent publishes land exactly once, in each caller's order, each with its own
//! outcome.

mod support;

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use redis::AsyncCommands;
use stream_listener::core::internals::admin::{self, ScaleAction};
use stream_listener::core::internals::connection::{RedisConnection, RedisTarget};
use stream_listener::core::internals::keys::StreamKeys;
use stream_listener::core::internals::store::read_metadata_version;
use stream_listener::testing::RedisServer;
use stream_listener::{PublishError, Published, Publisher, PublisherOptions, shard_for_key};
use support::{command_calls, key_on_shard, scale_in_and_retire, total_len};

async fn connect(url: String, response_timeout: Duration) -> RedisConnection {
    RedisConnection::connect(&RedisTarget::standalone(url), response_timeout)
        .await
        .unwrap()
}

async fn start() -> (RedisServer, RedisConnection) {
    let server = RedisServer::start().unwrap();
    let conn = connect(server.url(), Duration::from_secs(5)).await;
    (server, conn)
}

/// The stream, through the admin API (shard streams and metadata, `metadataVersion` 1).
async fn create_stream(conn: &mut RedisConnection, prefix: &str, shards: u32) {
    let created = admin::create_stream(conn, prefix, shards).await.unwrap();
    assert!(created.created);
}

/// Scale-out through the admin API: new ACTIVE shards, `metadataVersion` bumped.
async fn scale_out(conn: &mut RedisConnection, prefix: &str, target: u32) {
    let outcome = admin::scale(conn, prefix, target).await.unwrap();
    assert_eq!(outcome.action, ScaleAction::ScaleOut);
}

/// An `XRANGE` entry: id and fields with byte values.
type RawEntry = (String, Vec<(String, Vec<u8>)>);

async fn xlen(conn: &mut RedisConnection, key: &str) -> u64 {
    conn.xlen(key).await.unwrap()
}

async fn exists(conn: &mut RedisConnection, key: &str) -> bool {
    conn.exists(key).await.unwrap()
}

/// `XADD` calls the server has executed (`INFO commandstats`).
async fn xadd_calls(conn: &mut RedisConnection) -> u64 {
    command_calls(conn).await.get("xadd").copied().unwrap_or(0)
}

fn fast_refresh() -> PublisherOptions {
    PublisherOptions {
        refresh_interval: Duration::ZERO,
        ..PublisherOptions::default()
    }
}

/// Options under which a publisher never refreshes on its own during a test.
fn never_refresh() -> PublisherOptions {
    PublisherOptions {
        refresh_interval: Duration::from_secs(3600),
        routing_lease: Duration::from_secs(7200),
        ..PublisherOptions::default()
    }
}

/// Publishes `keys` in batches of 64 with payload `[i, "order"]`.
async fn publish_keys(publisher: &Publisher, keys: &[String]) -> Vec<Published> {
    let mut published = Vec::new();
    for (chunk_index, chunk) in keys.chunks(64).enumerate() {
        let batch: Vec<(&str, (usize, &str))> = chunk
            .iter()
            .enumerate()
            .map(|(i, k)| (k.as_str(), (chunk_index * 64 + i, "order")))
            .collect();
        published.extend(publisher.publish_batch(&batch).await.unwrap());
    }
    published
}

#[tokio::test]
async fn entries_land_on_the_shard_the_routing_names() {
    let (_server, mut conn) = start().await;
    create_stream(&mut conn, "orders", 16).await;
    let publisher = Publisher::new(conn.clone(), "orders", PublisherOptions::default())
        .await
        .unwrap();
    let keys: Vec<String> = (0..3_000).map(|i| format!("customer-{i}")).collect();
    let mut published = publish_keys(&publisher, &keys).await;
    for key in &keys[..200] {
        published.push(publisher.publish(key, &("single", 1)).await.unwrap());
    }

    let mut expected: BTreeMap<u32, u64> = BTreeMap::new();
    for (key, p) in keys.iter().chain(&keys[..200]).zip(&published) {
        let shard = shard_for_key(key, 16);
        assert_eq!(p.shard, shard, "{key}");
        assert_eq!(p.stream_key, format!("{{orders:{shard}}}"));
        *expected.entry(shard).or_default() += 1;
    }
    assert_eq!(expected.len(), 16, "every shard got keys");
    for (shard, count) in &expected {
        assert_eq!(
            xlen(&mut conn, &format!("{{orders:{shard}}}")).await,
            *count,
            "shard {shard}"
        );
    }

    // The entry: `key <k> payload <json>`, under the id publish returned.
    let first = &published[0];
    let entries: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
        .arg(&first.stream_key)
        .arg(&first.entry_id)
        .arg(&first.entry_id)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        entries,
        [(
            first.entry_id.clone(),
            vec![
                ("key".to_owned(), "customer-0".to_owned()),
                ("payload".to_owned(), r#"[0,"order"]"#.to_owned()),
            ]
        )]
    );
}

#[tokio::test]
async fn clones_publish_concurrently() {
    let (_server, mut conn) = start().await;
    create_stream(&mut conn, "orders", 4).await;
    let publisher = Publisher::new(conn.clone(), "orders", fast_refresh())
        .await
        .unwrap();
    let mut tasks = Vec::new();
    for t in 0..4 {
        let publisher = publisher.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..250 {
                publisher.publish(&format!("k-{t}-{i}"), &i).await.unwrap();
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(total_len(&mut conn, "orders", 4).await, 1_000);
}

#[tokio::test]
async fn scale_out_8_to_9_moves_a_ninth_of_the_keys_all_to_the_new_shard() {
    let (_server, mut conn) = start().await;
    create_stream(&mut conn, "orders", 8).await;
    let publisher = Publisher::new(conn.clone(), "orders", fast_refresh())
        .await
        .unwrap();
    let keys: Vec<String> = (0..5_000).map(|i| format!("user-{i}")).collect();
    let before = publish_keys(&publisher, &keys).await;

    scale_out(&mut conn, "orders", 9).await;
    let after = publish_keys(&publisher, &keys).await;
    assert_eq!(publisher.routing_snapshot().shard_count, 9);

    let mut moved = 0u64;
    for ((key, b), a) in keys.iter().zip(&before).zip(&after) {
        assert_eq!(a.shard, shard_for_key(key, 9));
        if a.shard != b.shard {
            assert_eq!(a.shard, 8, "{key} moved {} → {}", b.shard, a.shard);
            moved += 1;
        }
    }
    let fraction = moved as f64 / keys.len() as f64;
    assert!(
        (0.09..=0.13).contains(&fraction),
        "{moved} of {} keys moved",
        keys.len()
    );
    assert_eq!(xlen(&mut conn, "{orders:8}").await, moved);
}

#[tokio::test]
async fn a_stale_publisher_after_scale_in_refreshes_and_lands_on_a_live_shard() {
    let (_server, mut conn) = start().await;
    create_stream(&mut conn, "orders", 4).await;
    let publisher = Publisher::new(conn.clone(), "orders", never_refresh())
        .await
        .unwrap();
    let on_shard_3: Vec<String> = (0..)
        .map(|i| format!("k{i}"))
        .filter(|k| shard_for_key(k, 4) == 3)
        .take(20)
        .collect();
    let first = publisher.publish(&on_shard_3[0], &"before").await.unwrap();
    assert_eq!(first.shard, 3);

    // Scale-in to 3 and retirement of shard 3; the publisher does not refresh on its own.
    assert!(exists(&mut conn, "{orders:3}").await);
    scale_in_and_retire(&mut conn, "orders", 3).await;
    assert!(
        !exists(&mut conn, "{orders:3}").await,
        "retired and deleted"
    );
    assert_eq!(publisher.routing_snapshot().shard_count, 4, "still stale");
    let xadds = xadd_calls(&mut conn).await;

    // One key: NOMKSTREAM nil, refresh, retry on the live shard.
    let p = publisher.publish(&on_shard_3[1], &"after").await.unwrap();
    assert_eq!(p.shard, shard_for_key(&on_shard_3[1], 3));
    assert!(p.shard < 3);
    assert_eq!(xadd_calls(&mut conn).await, xadds + 2, "one nil, one retry");
    let snapshot = publisher.routing_snapshot();
    assert_eq!(snapshot.shard_count, 3);
    let keys = StreamKeys::new("orders").unwrap();
    let stored = read_metadata_version(&mut conn, &keys).await.unwrap();
    assert_eq!(Some(snapshot.metadata_version), stored);
    assert!(
        !exists(&mut conn, "{orders:3}").await,
        "nothing written to the retired shard"
    );

    // A batch mixing keys of the retired shard and of live shards, on a stale publisher.
    create_stream(&mut conn, "payments", 4).await;
    let stale = Publisher::new(conn.clone(), "payments", never_refresh())
        .await
        .unwrap();
    scale_in_and_retire(&mut conn, "payments", 3).await;
    let mixed: Vec<String> = (0..200).map(|i| format!("m{i}")).collect();
    assert!(mixed.iter().any(|k| shard_for_key(k, 4) == 3));
    let batch: Vec<(&str, u32)> = mixed.iter().map(|k| (k.as_str(), 1)).collect();
    let published = stale.publish_batch(&batch).await.unwrap();
    for (key, p) in mixed.iter().zip(&published) {
        assert_eq!(p.shard, shard_for_key(key, 3), "{key}");
    }
    assert!(!exists(&mut conn, "{payments:3}").await);
    assert_eq!(total_len(&mut conn, "payments", 3).await, 200);
}

#[tokio::test]
async fn an_active_shard_whose_stream_is_gone_is_a_typed_error_and_is_not_recreated() {
    let (_server, mut conn) = start().await;
    create_stream(&mut conn, "orders", 2).await;
    let publisher = Publisher::new(conn.clone(), "orders", PublisherOptions::default())
        .await
        .unwrap();
    let key = key_on_shard(1, 2);
    let _: i64 = conn.del("{orders:1}").await.unwrap();
    let err = publisher.publish(&key, &1).await.unwrap_err();
    assert!(
        matches!(err, PublishError::ShardMissing { shard: 1, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("{orders:1}"), "{err}");
    assert!(!exists(&mut conn, "{orders:1}").await);
}

/// A shard stream overwritten with a string: the publish error says a key holds another type,
/// not "check that Redis is up" (found by a hostile test).
#[tokio::test]
async fn a_shard_key_of_another_type_is_an_error_that_says_so() {
    let (_server, mut conn) = start().await;
    create_stream(&mut conn, "orders", 2).await;
    let publisher = Publisher::new(conn.clone(), "orders", PublisherOptions::default())
        .await
        .unwrap();
    let _: i64 = conn.del("{orders:1}").await.unwrap();
    let () = conn.set("{orders:1}", "junk").await.unwrap();
    let err = publisher
        .publish(&key_on_shard(1, 2), &1)
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(text.contains("holds another Redis type"), "{text}");
    assert!(!text.contains("up and reachable"), "{text}");
}

/// The stream lost and created again with fewer shards at the same `metadataVersion` (created
/// and scaled out: 2; created and a group registered: 2 again). An `XADD` that finds no stream
/// makes the publisher read the whole metadata, not only compare the version, so it routes over
/// the new shard count. It compared the version only, kept routing over 8 shards and refused
/// half the keys with `ShardMissing` until it was restarted (found by review).
#[tokio::test]
async fn a_stream_created_again_at_the_same_version_with_fewer_shards_is_routed_anew() {
    let (_server, mut conn) = start().await;
    create_stream(&mut conn, "orders", 4).await;
    scale_out(&mut conn, "orders", 8).await;
    let publisher = Publisher::new(conn.clone(), "orders", never_refresh())
        .await
        .unwrap();
    let () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
    create_stream(&mut conn, "orders", 4).await;
    stream_listener::core::internals::store::provision::register_group(
        &mut conn,
        "orders",
        "g",
        stream_listener::core::model::StartFrom::Earliest,
    )
    .await
    .unwrap();
    let keys = StreamKeys::new("orders").unwrap();
    assert_eq!(
        read_metadata_version(&mut conn, &keys).await.unwrap(),
        Some(2)
    );
    let key = key_on_shard(6, 8);
    let published = publisher.publish(&key, &1).await.expect("routed anew");
    assert_eq!(published.shard, shard_for_key(&key, 4));
}

#[tokio::test]
async fn oversized_payloads_are_refused_before_any_xadd() {
    let (_server, mut conn) = start().await;
    create_stream(&mut conn, "orders", 4).await;
    let options = PublisherOptions {
        max_payload_bytes: 1_000,
        ..PublisherOptions::default()
    };
    let publisher = Publisher::new(conn.clone(), "orders", options)
        .await
        .unwrap();
    let xadds = xadd_calls(&mut conn).await;

    let big = "x".repeat(1_000); // 1,002 bytes of JSON with the quotes
    let err = publisher.publish("k", &big).await.unwrap_err();
    assert!(
        matches!(
            err,
            PublishError::PayloadTooLarge {
                index: None,
                size: 1_002,
                limit: 1_000
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("1002 bytes"), "{err}");

    let raw = vec![7u8; 994]; // "payload" (7) + 994 = 1,001
    let err = publisher
        .publish_raw("k", &[("payload", &raw)])
        .await
        .unwrap_err();
    assert!(matches!(
        err,
        PublishError::PayloadTooLarge { size: 1_001, .. }
    ));

    let small = "y".to_owned();
    let batch = vec![("a", &small), ("b", &small), ("c", &big), ("d", &small)];
    let err = publisher.publish_batch(&batch).await.unwrap_err();
    assert!(
        matches!(err, PublishError::PayloadTooLarge { index: Some(2), .. }),
        "{err}"
    );
    assert_eq!(xadd_calls(&mut conn).await, xadds, "no XADD was sent");
    assert_eq!(total_len(&mut conn, "orders", 4).await, 0);

    // Exactly at the limit is accepted.
    let fits = "z".repeat(998);
    publisher.publish("k", &fits).await.unwrap();
    assert_eq!(total_len(&mut conn, "orders", 4).await, 1);
}

#[tokio::test]
async fn payloads_that_fail_to_serialize_are_refused_before_any_xadd() {
    let (_server, mut conn) = start().await;
    create_stream(&mut conn, "orders", 2).await;
    let publisher = Publisher::new(conn.clone(), "orders", PublisherOptions::default())
        .await
        .unwrap();
    let xadds = xadd_calls(&mut conn).await;
    // JSON object keys must be strings.
    let bad: HashMap<(u8, u8), u8> = HashMap::from([((1, 2), 3)]);
    let err = publisher.publish("k", &bad).await.unwrap_err();
    assert!(
        matches!(err, PublishError::Serialize { index: None, .. }),
        "{err}"
    );
    let good: HashMap<(u8, u8), u8> = HashMap::new();
    let err = publisher
        .publish_batch(&[("a", &good), ("b", &bad)])
        .await
        .unwrap_err();
    assert!(matches!(
        err,
        PublishError::Serialize { index: Some(1), .. }
    ));
    assert!(err.to_string().contains("publish_raw"), "{err}");
    assert_eq!(xadd_calls(&mut conn).await, xadds);
}

#[tokio::test]
async fn unknown_streams_and_bad_prefixes_are_typed_errors() {
    let (_server, mut conn) = start().await;
    let err = Publisher::new(conn.clone(), "missing", PublisherOptions::default())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, PublishError::UnknownStream { prefix, key } if prefix == "missing" && key == "sl:{missing}:stream"),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("stream-listener stream create missing"),
        "{err}"
    );
    for bad in ["", "{orders}", "a b"] {
        let err = Publisher::new(conn.clone(), bad, PublisherOptions::default())
            .await
            .unwrap_err();
        assert!(
            matches!(err, PublishError::InvalidPrefix(_)),
            "{bad:?}: {err}"
        );
    }
    let err = Publisher::new(
        conn.clone(),
        "orders",
        PublisherOptions {
            maxlen: Some(0),
            ..PublisherOptions::default()
        },
    )
    .await
    .unwrap_err();
    assert!(matches!(err, PublishError::InvalidOptions { .. }), "{err}");

    // Metadata deleted under a running publisher: the next refresh says so.
    create_stream(&mut conn, "orders", 2).await;
    let publisher = Publisher::new(conn.clone(), "orders", fast_refresh())
        .await
        .unwrap();
    publisher.publish("k", &1).await.unwrap();
    let _: i64 = conn.del("sl:{orders}:stream").await.unwrap();
    let err = publisher.publish("k", &2).await.unwrap_err();
    assert!(matches!(err, PublishError::UnknownStream { .. }), "{err}");
}

#[tokio::test]
async fn a_fully_drained_stream_refuses_with_no_shards() {
    let (_server, mut conn) = start().await;
    create_stream(&mut conn, "orders", 2).await;
    let publisher = Publisher::new(conn.clone(), "orders", fast_refresh())
        .await
        .unwrap();
    publisher.publish("k", &1).await.unwrap();
    scale_in_and_retire(&mut conn, "orders", 0).await;
    let err = publisher.publish("k", &1).await.unwrap_err();
    let keys = StreamKeys::new("orders").unwrap();
    let stored = read_metadata_version(&mut conn, &keys)
        .await
        .unwrap()
        .unwrap();
    assert!(
        matches!(err, PublishError::NoShards { metadata_version, .. } if metadata_version == stored),
        "{err}"
    );
    let err = publisher.publish_batch(&[("k", 1)]).await.unwrap_err();
    assert!(matches!(err, PublishError::NoShards { .. }), "{err}");
    assert!(err.to_string().contains("scale"), "{err}");
    // A new publisher on a drained stream is accepted; publishing is what fails.
    let fresh = Publisher::new(conn.clone(), "orders", PublisherOptions::default())
        .await
        .unwrap();
    assert_eq!(fresh.routing_snapshot().shard_count, 0);
    assert!(matches!(
        fresh.publish_raw("k", &[]).await,
        Err(PublishError::NoShards { .. })
    ));
    // Scaled out again: publishing resumes.
    scale_out(&mut conn, "orders", 1).await;
    assert_eq!(publisher.publish("k", &1).await.unwrap().shard, 0);
}

#[tokio::test]
async fn raw_fields_are_appended_as_given() {
    let (_server, mut conn) = start().await;
    create_stream(&mut conn, "orders", 3).await;
    let publisher = Publisher::new(conn.clone(), "orders", PublisherOptions::default())
        .await
        .unwrap();
    let bytes: &[u8] = &[0, 255, 10, 13];
    let p = publisher
        .publish_raw(
            "k",
            &[("payload", bytes), ("contentType", b"application/x")],
        )
        .await
        .unwrap();
    assert_eq!(p.shard, shard_for_key("k", 3));
    let entries: Vec<RawEntry> = redis::cmd("XRANGE")
        .arg(&p.stream_key)
        .arg("-")
        .arg("+")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        entries[0].1,
        [
            ("key".to_owned(), b"k".to_vec()),
            ("payload".to_owned(), bytes.to_vec()),
            ("contentType".to_owned(), b"application/x".to_vec()),
        ]
    );
    let err = publisher
        .publish_raw("k", &[("key", b"other")])
        .await
        .unwrap_err();
    assert!(matches!(err, PublishError::ReservedField { .. }), "{err}");
}

#[tokio::test]
async fn maxlen_trims_shard_streams_when_asked() {
    let (_server, mut conn) = start().await;
    create_stream(&mut conn, "orders", 1).await;
    let trimming = Publisher::new(
        conn.clone(),
        "orders",
        PublisherOptions {
            maxlen: Some(10),
            ..PublisherOptions::default()
        },
    )
    .await
    .unwrap();
    let keys: Vec<String> = (0..1_000).map(|i| format!("k{i}")).collect();
    publish_keys(&trimming, &keys).await;
    let len = xlen(&mut conn, "{orders:0}").await;
    // `~`: Redis trims whole macro nodes (100 entries by default), keeping at least 10.
    assert!((10..=110).contains(&len), "XLEN {len}");

    let plain = Publisher::new(conn.clone(), "orders", PublisherOptions::default())
        .await
        .unwrap();
    publish_keys(&plain, &keys).await;
    assert_eq!(xlen(&mut conn, "{orders:0}").await, len + 1_000);
}

#[tokio::test]
async fn publishing_fails_closed_once_the_routing_lease_has_passed() {
    let (server, mut conn) = start().await;
    create_stream(&mut conn, "orders", 2).await;
    // Commands of the publisher's connection give up after 200 ms.
    let publisher_conn = connect(server.url(), Duration::from_millis(200)).await;
    let options = PublisherOptions {
        refresh_interval: Duration::from_millis(100),
        routing_lease: Duration::from_millis(1_500),
        ..PublisherOptions::default()
    };
    let publisher = Publisher::new(publisher_conn, "orders", options)
        .await
        .unwrap();
    publisher.publish("k", &1).await.unwrap();

    server.pause().unwrap();
    tokio::time::sleep(Duration::from_millis(150)).await;
    // Refresh fails within the lease: the cached routing is used, and the XADD itself fails.
    let err = publisher.publish("k", &2).await.unwrap_err();
    assert!(matches!(err, PublishError::Redis(_)), "{err}");
    assert!(publisher.routing_snapshot().age < Duration::from_millis(1_500));

    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let err = publisher.publish("k", &3).await.unwrap_err();
    assert!(
        matches!(err, PublishError::RoutingLeaseExpired { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("routing_lease"), "{err}");
    let err = publisher.publish_batch(&[("k", 4)]).await.unwrap_err();
    assert!(
        matches!(err, PublishError::RoutingLeaseExpired { .. }),
        "{err}"
    );

    server.resume().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match publisher.publish("k", &5).await {
            Ok(_) => break,
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(err) => panic!("publishing did not resume: {err}"),
        }
    }
    assert!(publisher.routing_snapshot().age < Duration::from_millis(1_500));
}

/// The README's "Routing" table is what the code does: every row is parsed and checked against
/// `shard_for_key` and `key_hash` (the unit test `readme_test_vectors_are_pinned` holds the same
/// vectors, so neither side can drift alone).
#[test]
fn readme_routing_vectors_match_the_code() {
    use stream_listener::core::producer::key_hash;
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let section = readme
        .split("\n## Routing\n")
        .nth(1)
        .expect("README.md has a Routing section");
    let section = section.split("\n## ").next().unwrap();
    let mut rows = 0;
    for line in section.lines().filter(|l| l.starts_with("| `")) {
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        let key = if cells[0].starts_with("`\"\"`") {
            ""
        } else {
            cells[0].trim_matches('`')
        };
        let hash =
            u64::from_str_radix(cells[1].trim_matches('`').trim_start_matches("0x"), 16).unwrap();
        assert_eq!(key_hash(key), hash, "{key:?}");
        let shards: Vec<u32> = cells[2..].iter().map(|c| c.parse().unwrap()).collect();
        assert_eq!(shards.len(), 16, "{line}");
        for (count, expected) in (1..=16).zip(shards) {
            assert_eq!(shard_for_key(key, count), expected, "{key:?} over {count}");
        }
        rows += 1;
    }
    assert_eq!(rows, 9, "every vector row was checked");
}

/// A producer-only service (docs/design.md §14.5): `Config::publisher` of a stream the config
/// declares with `shards` creates it when it does not exist yet (as `run()` would), with the
/// declared shards; an existing stream keeps its own shard count.
#[tokio::test]
async fn a_publisher_of_a_declared_stream_not_yet_created_creates_it_with_the_declared_shards() {
    let (server, mut conn) = start().await;
    let text = format!(
        "[redis]\nurl = \"{}\"\n\n[streams.payments]\nshards = 4\n\n[streams.refunds]\nshards = 3\n",
        server.url()
    );
    let config = stream_listener::Config::from_toml_str(&text, "producer-only.toml").unwrap();
    let publisher = config.publisher("payments").await.unwrap();
    assert_eq!(publisher.routing_snapshot().shard_count, 4);
    let published = publisher
        .publish("order-1", &serde_json::json!({"n": 1}))
        .await
        .unwrap();
    assert_eq!(
        xlen(&mut conn, &format!("{{payments:{}}}", published.shard)).await,
        1
    );
    let meta = StreamKeys::new("payments").unwrap();
    assert!(exists(&mut conn, &meta.metadata()).await);

    // An existing stream keeps its count: 2 shards created by the admin tool, 3 declared.
    create_stream(&mut conn, "refunds", 2).await;
    let publisher = config.publisher("refunds").await.unwrap();
    assert_eq!(publisher.routing_snapshot().shard_count, 2);
}

/// Every entry of `prefix`'s shards `0..shards`: (shard, entry id, partition key, payload).
async fn all_entries(
    conn: &mut RedisConnection,
    prefix: &str,
    shards: u32,
) -> Vec<(u32, String, String, String)> {
    let keys = StreamKeys::new(prefix).unwrap();
    let mut all = Vec::new();
    for shard in 0..shards {
        let entries: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
            .arg(keys.shard(shard))
            .arg("-")
            .arg("+")
            .query_async(conn)
            .await
            .unwrap();
        for (id, fields) in entries {
            let field = |name: &str| {
                let (_, value) = fields.iter().find(|(n, _)| n == name).unwrap();
                value.clone()
            };
            all.push((shard, id, field("key"), field("payload")));
        }
    }
    all
}

/// Concurrent single publishes on clones of one publisher (docs/design.md §9: while a pipeline
/// is in flight, arriving publishes queue and go out together as the next one): every entry
/// lands exactly once, under the id its caller got, and each caller's entries of a shard are
/// appended in its call order. The original publisher is dropped while its clones publish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_publishes_land_exactly_once_in_each_callers_order() {
    const CALLERS: usize = 64;
    const EACH: usize = 40;
    let (_server, mut conn) = start().await;
    create_stream(&mut conn, "orders", 8).await;
    let publisher = Publisher::new(conn.clone(), "orders", PublisherOptions::default())
        .await
        .unwrap();
    let tasks: Vec<_> = (0..CALLERS)
        .map(|caller| {
            let publisher = publisher.clone();
            tokio::spawn(async move {
                let mut published = Vec::new();
                for i in 0..EACH {
                    // Keys shared by all callers (one shard's entries interleave) and own keys.
                    let key = if i % 2 == 0 {
                        format!("shared-{}", i % 10)
                    } else {
                        format!("caller-{caller}-{i}")
                    };
                    let p = publisher.publish(&key, &(caller, i)).await.unwrap();
                    assert_eq!(p.shard, shard_for_key(&key, 8), "{key}");
                    published.push(p);
                }
                published
            })
        })
        .collect();
    drop(publisher);
    let mut returned: HashMap<(String, String), (usize, usize)> = HashMap::new();
    for (caller, task) in tasks.into_iter().enumerate() {
        for (i, p) in task.await.unwrap().into_iter().enumerate() {
            let previous = returned.insert((p.stream_key, p.entry_id), (caller, i));
            assert_eq!(previous, None, "one id returned twice");
        }
    }

    let stored = all_entries(&mut conn, "orders", 8).await;
    assert_eq!(stored.len(), CALLERS * EACH, "every entry exactly once");
    let mut last: HashMap<(u32, usize), usize> = HashMap::new();
    for (shard, id, _, payload) in stored {
        let (caller, i): (usize, usize) = serde_json::from_str(&payload).unwrap();
        let stream_key = format!("{{orders:{shard}}}");
        assert_eq!(returned.get(&(stream_key, id)), Some(&(caller, i)));
        if let Some(before) = last.insert((shard, caller), i) {
            assert!(
                before < i,
                "caller {caller}: #{i} before #{before} on shard {shard}"
            );
        }
    }
}

/// Callers whose publishes go out in one pipeline get their own outcome: a retired shard's nil
/// reply makes only its caller refresh and retry, a shard stream deleted under an ACTIVE shard
/// fails only its caller with `ShardMissing`, a per-entry error reply (`WRONGTYPE`) reaches only
/// its caller, and the others' entries land.
#[tokio::test]
async fn concurrent_callers_get_their_own_errors() {
    let (_server, mut conn) = start().await;
    create_stream(&mut conn, "orders", 4).await;
    let stale = Publisher::new(conn.clone(), "orders", never_refresh())
        .await
        .unwrap();
    scale_in_and_retire(&mut conn, "orders", 3).await; // shard 3 retired and deleted
    let _: i64 = conn.del("{orders:2}").await.unwrap(); // shard 2 ACTIVE, its stream gone
    let _: i64 = conn.del("{orders:1}").await.unwrap();
    let _: () = conn.set("{orders:1}", "not a stream").await.unwrap(); // XADD: WRONGTYPE

    // Keys routed (4 shards, stale) to shard 0, 1, 2 and 3; the last one to shard 0 under 3.
    let on = |shard: u32, under_three: Option<u32>| -> Vec<String> {
        (0..)
            .map(|i| format!("key-{i}"))
            .filter(|k| {
                shard_for_key(k, 4) == shard && under_three.is_none_or(|s| shard_for_key(k, 3) == s)
            })
            .take(4)
            .collect()
    };
    let cases: Vec<(u32, String)> = [
        (0, on(0, None)),
        (1, on(1, None)),
        (2, on(2, None)),
        (3, on(3, Some(0))),
    ]
    .into_iter()
    .flat_map(|(shard, keys)| keys.into_iter().map(move |k| (shard, k)))
    .collect();
    // Spawned together on this single-threaded runtime: they queue before the first pipeline
    // goes out, so they share it.
    let tasks: Vec<_> = cases
        .iter()
        .map(|(_, key)| {
            let (publisher, key) = (stale.clone(), key.clone());
            tokio::spawn(async move { publisher.publish(&key, &key).await })
        })
        .collect();
    let mut landed = 0;
    for ((shard, key), task) in cases.iter().zip(tasks) {
        match (shard, task.await.unwrap()) {
            (0 | 3, Ok(p)) => {
                assert_eq!(p.shard, 0, "{key}");
                landed += 1;
            }
            (1, Err(PublishError::Redis(e))) => {
                assert_eq!(e.code(), Some("WRONGTYPE"), "{key}: {e}");
            }
            (2, Err(PublishError::ShardMissing { shard: 2, .. })) => {}
            (shard, other) => panic!("{key} (shard {shard} of 4): {other:?}"),
        }
    }
    assert_eq!(landed, 8);
    assert_eq!(xlen(&mut conn, "{orders:0}").await, 8);
    assert!(!exists(&mut conn, "{orders:2}").await);
    assert!(!exists(&mut conn, "{orders:3}").await);
}

/// Lets the other tasks of this single-threaded runtime run until they wait (no timing).
async fn let_others_run() {
    for _ in 0..100 {
        tokio::task::yield_now().await;
    }
}

/// A caller that drops its publish (its task is aborted) while it waits behind a pipeline in
/// flight does not disturb the others: theirs land exactly once and the publisher keeps working;
/// the cancelled entry is not sent.
#[tokio::test]
async fn a_cancelled_caller_does_not_disturb_the_others() {
    let (server, mut conn) = start().await;
    create_stream(&mut conn, "orders", 4).await;
    let publisher = Publisher::new(conn.clone(), "orders", PublisherOptions::default())
        .await
        .unwrap();
    let publish = |key: &'static str| {
        let publisher = publisher.clone();
        tokio::spawn(async move { publisher.publish(key, &key).await })
    };
    server.pause().unwrap(); // the first pipeline stays in flight
    let first = publish("first");
    let_others_run().await;
    let before_cancelled = publish("before-cancelled");
    let cancelled = publish("cancelled");
    let after_cancelled = publish("after-cancelled");
    let_others_run().await;
    cancelled.abort();
    let_others_run().await; // the aborted task is dropped
    server.resume().unwrap();

    for task in [first, before_cancelled, after_cancelled] {
        task.await.unwrap().unwrap();
    }
    assert!(cancelled.await.unwrap_err().is_cancelled());
    publisher.publish("later", &"later").await.unwrap();
    let mut keys: Vec<String> = all_entries(&mut conn, "orders", 4)
        .await
        .into_iter()
        .map(|(_, _, key, _)| key)
        .collect();
    keys.sort();
    assert_eq!(
        keys,
        ["after-cancelled", "before-cancelled", "first", "later"]
    );
}

/// With `min_replica_acks` and no replica, each of several concurrent callers gets its own
/// `NotReplicated` carrying its own entry only (the `WAIT` goes after each pipeline).
#[tokio::test]
async fn concurrent_callers_each_get_their_own_not_replicated() {
    let (_server, mut conn) = start().await;
    create_stream(&mut conn, "orders", 4).await;
    let options = PublisherOptions {
        min_replica_acks: 1,
        replica_ack_timeout: Duration::from_millis(20),
        ..PublisherOptions::default()
    };
    let publisher = Publisher::new(conn.clone(), "orders", options)
        .await
        .unwrap();
    let keys: Vec<String> = (0..8).map(|i| format!("k{i}")).collect();
    let tasks: Vec<_> = keys
        .iter()
        .map(|key| {
            let (publisher, key) = (publisher.clone(), key.clone());
            tokio::spawn(async move { publisher.publish(&key, &1).await })
        })
        .collect();
    for (key, task) in keys.iter().zip(tasks) {
        match task.await.unwrap() {
            Err(PublishError::NotReplicated {
                published,
                acked: 0,
                wanted: 1,
                ..
            }) => {
                assert_eq!(published.len(), 1, "{key}");
                assert_eq!(published[0].shard, shard_for_key(key, 4), "{key}");
            }
            other => panic!("{key}: {other:?}"),
        }
    }
    assert_eq!(total_len(&mut conn, "orders", 4).await, 8);
}
