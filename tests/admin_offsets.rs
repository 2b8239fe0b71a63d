//! Group offset reset, group delete and stream delete on real Redis, standalone and on the local
//! 3-master cluster (docs/design.md §10.5–§10.7): exact ids re-delivered after each reset target,
//! dry runs that change nothing, every refusal changing nothing, and deletes that leave no key
//! behind on any node.

mod support;

use std::time::Duration;

use redis::AsyncCommands;
use redis::streams::StreamInfoGroupsReply;
use stream_listener::core::internals::admin::{
    self, AdminError, ResetOptions, ResetTarget, StoreError,
};
use stream_listener::core::internals::connection::{RedisConnection, RedisTarget};
use stream_listener::core::model::{ShardIndex, StartFrom};
use stream_listener::testing::{RedisCluster, RedisServer};
use support::tests_of;

const IDS: [&str; 5] = ["1000-1", "2000-0", "2000-1", "3000-0", "4000-5"];

/// A standalone server or a 3-master cluster, a connection to it, and a connection to each node
/// (to `SCAN` every node).
struct Redis {
    _server: Option<RedisServer>,
    _cluster: Option<RedisCluster>,
    target: RedisTarget,
    conn: RedisConnection,
    nodes: Vec<RedisConnection>,
}

impl Redis {
    async fn start(cluster: bool) -> Redis {
        if cluster {
            let cluster = RedisCluster::start().unwrap();
            let target = RedisTarget::cluster(cluster.urls());
            let mut nodes = Vec::new();
            for node in cluster.nodes() {
                nodes.push(support::connect(&RedisTarget::standalone(node.url())).await);
            }
            Redis {
                conn: support::connect(&target).await,
                _server: None,
                _cluster: Some(cluster),
                target,
                nodes,
            }
        } else {
            let server = RedisServer::start().unwrap();
            let target = RedisTarget::standalone(server.url());
            Redis {
                conn: support::connect(&target).await,
                nodes: vec![support::connect(&target).await],
                _server: Some(server),
                _cluster: None,
                target,
            }
        }
    }

    /// Every key on every node, sorted.
    async fn all_keys(&mut self) -> Vec<String> {
        let mut keys = Vec::new();
        for node in &mut self.nodes {
            let mut cursor = 0u64;
            loop {
                let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
                    .arg(cursor)
                    .arg("COUNT")
                    .arg(1000)
                    .query_async(node)
                    .await
                    .unwrap();
                keys.extend(batch);
                if next == 0 {
                    break;
                }
                cursor = next;
            }
        }
        keys.sort();
        keys
    }
}

fn shard(i: ShardIndex) -> String {
    format!("{{orders:{i}}}")
}

/// `(name, pending, last-delivered-id)` of every consumer group of `key`.
async fn groups_of(conn: &mut RedisConnection, key: &str) -> Vec<(String, usize, String)> {
    let reply: StreamInfoGroupsReply = conn.xinfo_groups(key).await.unwrap();
    let mut groups: Vec<_> = reply
        .groups
        .into_iter()
        .map(|g| (g.name, g.pending, g.last_delivered_id))
        .collect();
    groups.sort();
    groups
}

/// What a refused operation must leave unchanged: each shard's groups and attempt fields.
async fn snapshot(conn: &mut RedisConnection, shards: u32) -> Vec<String> {
    let mut out = Vec::new();
    for i in 0..shards {
        out.push(format!("{:?}", groups_of(conn, &shard(i)).await));
        let mut attempts: Vec<String> = conn.hkeys(format!("{}:attempts", shard(i))).await.unwrap();
        attempts.sort();
        out.push(format!("{attempts:?}"));
    }
    out
}

/// `orders` with `shards` shards, group `billing` (earliest), [`IDS`] on every shard, all read
/// by `billing` and all but the last two acked.
async fn setup(conn: &mut RedisConnection, shards: u32) {
    admin::create_stream(conn, "orders", shards).await.unwrap();
    admin::register_group(conn, "orders", "billing", StartFrom::Earliest)
        .await
        .unwrap();
    for i in 0..shards {
        for id in IDS {
            let _: String = conn.xadd(shard(i), id, &[("n", id)]).await.unwrap();
        }
        let read = support::read_new(conn, &shard(i), "billing", 100).await;
        assert_eq!(read, IDS);
        let _: u64 = conn.xack(shard(i), "billing", &IDS[..3]).await.unwrap();
    }
}

async fn reset(
    conn: &mut RedisConnection,
    target: ResetTarget,
    shards: Option<Vec<ShardIndex>>,
    dry_run: bool,
) -> Result<admin::GroupReset, AdminError> {
    let options = ResetOptions {
        target,
        shards,
        dry_run,
    };
    admin::reset_group(conn, "orders", "billing", &options).await
}

/// Reads every new entry of shard `i` for `billing` and acks it.
async fn consume(conn: &mut RedisConnection, i: ShardIndex) -> Vec<String> {
    let ids = support::read_new(conn, &shard(i), "billing", 100).await;
    if !ids.is_empty() {
        let _: u64 = conn.xack(shard(i), "billing", &ids).await.unwrap();
    }
    ids
}

async fn lag(conn: &mut RedisConnection, i: ShardIndex) -> Option<u64> {
    let raw: Vec<Vec<redis::Value>> = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(shard(i))
        .query_async(conn)
        .await
        .unwrap();
    let fields = &raw[0];
    let at = fields
        .iter()
        .position(|v| matches!(v, redis::Value::BulkString(b) if b == b"lag"))
        .unwrap();
    redis::from_redis_value(fields[at + 1].clone()).unwrap()
}

async fn reset_targets_deliver_exactly_the_expected_entries(cluster: bool) {
    let mut redis = Redis::start(cluster).await;
    let conn = &mut redis.conn;
    setup(conn, 3).await;
    let _: () = conn
        .hset_multiple(
            "{orders:0}:attempts",
            &[
                ("billing|4000-5", 2),
                ("billing|x|4000-5", 1),
                ("audit|4000-5", 1),
            ],
        )
        .await
        .unwrap();

    // Dry run: the right numbers, nothing changed.
    let before = snapshot(conn, 3).await;
    let dry = reset(conn, ResetTarget::Earliest, None, true)
        .await
        .unwrap();
    assert!(dry.dry_run);
    assert_eq!(dry.shards.len(), 3);
    for s in &dry.shards {
        assert_eq!(
            (s.old_position.as_str(), s.new_position.as_str()),
            ("4000-5", "0-0")
        );
        assert_eq!((s.to_deliver, s.skipped, s.pending_cleared), (5, 0, 2));
        assert_eq!(s.entries_read, 0);
    }
    assert_eq!(snapshot(conn, 3).await, before, "a dry run changes nothing");

    // Earliest: every entry again, the PEL and billing's attempt fields cleared, lag exact.
    let done = reset(conn, ResetTarget::Earliest, None, false)
        .await
        .unwrap();
    assert_eq!(done.shards, dry.shards);
    for i in 0..3 {
        assert_eq!(groups_of(conn, &shard(i)).await[0].1, 0, "PEL cleared");
        assert_eq!(lag(conn, i).await, Some(5));
        assert_eq!(consume(conn, i).await, IDS);
    }
    let mut attempts: Vec<String> = conn.hkeys("{orders:0}:attempts").await.unwrap();
    attempts.sort();
    assert_eq!(attempts, ["audit|4000-5", "billing|x|4000-5"]);

    // Latest: nothing old.
    let _: String = conn.xadd(shard(1), "5000-0", &[("n", "x")]).await.unwrap();
    let done = reset(conn, ResetTarget::Latest, None, false).await.unwrap();
    assert_eq!(done.shards[1].new_position, "5000-0");
    assert_eq!(done.shards[1].skipped, 1);
    for i in 0..3 {
        assert_eq!(lag(conn, i).await, Some(0));
        assert!(consume(conn, i).await.is_empty());
    }

    // A time: exactly the entries with ms >= t, the one at <t>-0 included.
    let done = reset(conn, ResetTarget::Time { ms: 2000 }, None, false)
        .await
        .unwrap();
    assert_eq!(done.shards[0].new_position, "1999-18446744073709551615");
    assert_eq!(done.shards[0].to_deliver, 4);
    for i in 0..3 {
        let expected: Vec<&str> = IDS[1..]
            .iter()
            .copied()
            .chain((i == 1).then_some("5000-0"))
            .collect();
        assert_eq!(lag(conn, i).await, Some(expected.len() as u64));
        assert_eq!(consume(conn, i).await, expected);
    }

    // Shift back 2: exactly 2 per shard; back 10 clamps at the start.
    reset(conn, ResetTarget::ShiftBy { n: -2 }, None, false)
        .await
        .unwrap();
    assert_eq!(consume(conn, 0).await, IDS[3..]);
    assert_eq!(consume(conn, 1).await, ["4000-5", "5000-0"]);
    let done = reset(conn, ResetTarget::ShiftBy { n: -10 }, Some(vec![0]), false)
        .await
        .unwrap();
    assert_eq!(done.shards.len(), 1);
    assert_eq!(done.shards[0].new_position, "0-0");
    assert_eq!(consume(conn, 0).await, IDS);

    // --shards limits; forward skips.
    reset(conn, ResetTarget::Earliest, Some(vec![2, 0]), false)
        .await
        .unwrap();
    let done = reset(conn, ResetTarget::ShiftBy { n: 2 }, Some(vec![0]), false)
        .await
        .unwrap();
    assert_eq!(
        (done.shards[0].new_position.as_str(), done.shards[0].skipped),
        ("2000-0", 2)
    );
    assert_eq!(consume(conn, 0).await, IDS[2..]);
    assert!(consume(conn, 1).await.is_empty(), "shard 1 was not reset");
    assert_eq!(consume(conn, 2).await, IDS);
    // Forward past the end clamps at the last entry.
    let done = reset(conn, ResetTarget::ShiftBy { n: 99 }, Some(vec![0]), false)
        .await
        .unwrap();
    assert_eq!(done.shards[0].new_position, "4000-5");
}

tests_of!(reset_targets_deliver_exactly_the_expected_entries {
    reset_targets_standalone => false,
    reset_targets_cluster => true,
});

#[tokio::test]
async fn bad_resets_are_clear_errors_and_change_nothing() {
    let mut redis = Redis::start(false).await;
    let conn = &mut redis.conn;
    setup(conn, 2).await;
    admin::register_group(conn, "orders", "audit", StartFrom::Earliest)
        .await
        .unwrap();
    let before = snapshot(conn, 2).await;

    let options = |target| ResetOptions {
        target,
        shards: None,
        dry_run: false,
    };
    let err = admin::reset_group(conn, "orders", "nobody", &options(ResetTarget::Earliest))
        .await
        .unwrap_err();
    assert!(
        matches!(err, AdminError::Store(StoreError::UnknownGroup { ref group, .. }) if group == "nobody"),
        "{err:?}"
    );
    let err = admin::reset_group(conn, "nostream", "billing", &options(ResetTarget::Earliest))
        .await
        .unwrap_err();
    assert!(
        matches!(err, AdminError::Store(StoreError::MissingStream { .. })),
        "{err:?}"
    );
    let err = reset(conn, ResetTarget::ShiftBy { n: 0 }, None, false)
        .await
        .unwrap_err();
    assert!(matches!(err, AdminError::ZeroShift), "{err:?}");
    let err = reset(conn, ResetTarget::Earliest, Some(vec![0, 2]), false)
        .await
        .unwrap_err();
    match &err {
        AdminError::ShardNotReadable {
            shard, readable, ..
        } => assert_eq!((*shard, readable.as_slice()), (2, &[0, 1][..])),
        other => panic!("{other:?}"),
    }
    assert!(err.to_string().contains("shard 2"), "{err}");
    let future_ms = (support::now_us() / 1000) + 3_600_000;
    let err = reset(conn, ResetTarget::Time { ms: future_ms }, None, false)
        .await
        .unwrap_err();
    assert!(
        matches!(err, AdminError::ResetTimeInFuture { .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("in the future"), "{err}");
    assert_eq!(
        snapshot(conn, 2).await,
        before,
        "no refused reset changed anything"
    );
    // A stream whose shard lost the consumer group: refused before any shard changes.
    let _: () = redis::cmd("XGROUP")
        .arg("DESTROY")
        .arg(shard(1))
        .arg("audit")
        .query_async(conn)
        .await
        .unwrap();
    let before_audit = snapshot(conn, 2).await;
    let err = admin::reset_group(conn, "orders", "audit", &options(ResetTarget::Latest))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            AdminError::ShardNotReady {
                shard: 1,
                what: "consumer group",
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(snapshot(conn, 2).await, before_audit);
}

/// A real running listener makes its group live: the reset is refused, names the member and
/// changes nothing; once the listener has stopped, the reset goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_of_a_live_group_is_refused() {
    let mut redis = Redis::start(false).await;
    let target = redis.target.clone();
    let conn = &mut redis.conn;
    setup(conn, 2).await;
    let recorder = std::sync::Arc::new(support::Recorder::default());
    let listener =
        support::start_recording(&target, &recorder, support::options(1), Duration::ZERO).await;
    // `start` returns once the member has joined: its lease runs. The listener may ack the
    // pending entries meanwhile, but nothing moves the group's position except a reset.
    let positions = |conn: &mut RedisConnection| {
        let mut conn = conn.clone();
        async move {
            let mut out = Vec::new();
            for i in 0..2 {
                out.push(groups_of(&mut conn, &shard(i)).await[0].2.clone());
            }
            out
        }
    };
    assert_eq!(positions(conn).await, ["4000-5", "4000-5"]);
    match reset(conn, ResetTarget::Earliest, None, false).await {
        Err(AdminError::GroupActive { members, .. }) => assert_eq!(members.len(), 1, "{members:?}"),
        other => panic!("reset of a live group: {other:?}"),
    }
    assert_eq!(
        positions(conn).await,
        ["4000-5", "4000-5"],
        "nothing changed"
    );
    listener.shutdown_and_wait().await.expect("clean shutdown");
    let mut reset_done = None;
    for _ in 0..250 {
        match reset(conn, ResetTarget::Earliest, None, false).await {
            Ok(done) => {
                reset_done = Some(done);
                break;
            }
            Err(AdminError::GroupActive { .. }) => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(other) => panic!("{other:?}"),
        }
    }
    let done = reset_done.expect("the reset goes through once the listener has stopped");
    assert!(done.shards.iter().all(|s| s.to_deliver == 5));
}

/// Every key of group `billing` and the group's traces on the shards.
async fn billing_traces(redis: &mut Redis, shards: u32) -> Vec<String> {
    let mut out: Vec<String> = redis
        .all_keys()
        .await
        .into_iter()
        .filter(|k| k.contains("billing"))
        .collect();
    for i in 0..shards {
        let key = shard(i);
        let exists: bool = redis.conn.exists(&key).await.unwrap();
        if exists {
            for (name, ..) in groups_of(&mut redis.conn, &key).await {
                if name == "billing" {
                    out.push(format!("consumer group on {key}"));
                }
            }
        }
        let fence: Option<String> = redis
            .conn
            .hget(format!("{key}:fence"), "billing")
            .await
            .unwrap();
        if fence.is_some() {
            out.push(format!("fence field on {key}"));
        }
        let attempts: Vec<String> = redis.conn.hkeys(format!("{key}:attempts")).await.unwrap();
        out.extend(attempts.into_iter().filter(|f| f.starts_with("billing|")));
    }
    out
}

async fn group_delete_leaves_no_key_of_the_group(cluster: bool) {
    let mut redis = Redis::start(cluster).await;
    let conn = &mut redis.conn;
    setup(conn, 4).await;
    admin::register_group(conn, "orders", "audit", StartFrom::Earliest)
        .await
        .unwrap();
    for i in 0..4 {
        support::plant_fence(conn, &format!("{}:fence", shard(i)), "billing").await;
        support::plant_fence(conn, &format!("{}:fence", shard(i)), "audit").await;
        for group in ["billing", "audit"] {
            support::plant_gate(conn, &shard(i), group).await;
        }
        // billing's gate as versions before per-token gates named it too.
        support::plant_legacy_gate(conn, &format!("{}:gate:billing", shard(i)), "billing").await;
        let _: () = conn
            .hset_multiple(
                format!("{}:attempts", shard(i)),
                &[("billing|4000-5", 2), ("audit|4000-5", 2)],
            )
            .await
            .unwrap();
    }
    let _: String = conn
        .xadd("orders:dlq:billing", "*", &[("shard", "1")])
        .await
        .unwrap();
    let _: String = conn
        .xadd("orders:dlq:audit", "*", &[("shard", "1")])
        .await
        .unwrap();
    // Shards 2 and 3 DRAINING, then 3 RETIRING: the group goes from every state's shard.
    admin::scale(conn, "orders", 2).await.unwrap();
    support::mark_retiring(conn, "orders", 3).await;

    let deleted = admin::delete_group(conn, "orders", "billing")
        .await
        .unwrap();
    assert_eq!(deleted.destroyed_on, vec![0, 1, 2, 3]);
    assert_eq!(deleted.dead_letters, 1);
    assert_eq!(billing_traces(&mut redis, 4).await, Vec::<String>::new());
    // audit keeps everything, its read gates included (billing's went: billing_traces).
    let keys = redis.all_keys().await;
    let gates = (0..4).map(|i| format!("{}:gate:audit:1:1:planted:m0", shard(i)));
    for key in [
        "orders:dlq:audit".to_owned(),
        "sl:{orders:audit}:group".to_owned(),
    ]
    .into_iter()
    .chain(gates)
    {
        assert!(keys.contains(&key), "{key}: {keys:?}");
    }
    for i in 0..4 {
        let names: Vec<String> = groups_of(&mut redis.conn, &shard(i))
            .await
            .into_iter()
            .map(|g| g.0)
            .collect();
        assert_eq!(names, ["audit"]);
        let listed: Vec<String> = redis
            .conn
            .smembers(format!("{}:gates", shard(i)))
            .await
            .unwrap();
        assert_eq!(
            listed,
            [format!("{}:gate:audit:1:1:planted:m0", shard(i))],
            "billing's gates left the registry"
        );
    }
}

tests_of!(group_delete_leaves_no_key_of_the_group {
    group_delete_leaves_no_key_standalone => false,
    group_delete_leaves_no_key_cluster => true,
});

/// `orders` (4 shards, 3 DRAINING after a scale-in to 3) with groups `billing` (read all, 2
/// pending per shard) and `audit` (read nothing), fences, attempts, read gates and dead letters
/// of both; `payments`, which must survive, next to it, with a read gate of its own.
async fn two_streams(conn: &mut RedisConnection) {
    setup(conn, 4).await;
    admin::register_group(conn, "orders", "audit", StartFrom::Earliest)
        .await
        .unwrap();
    for i in 0..4 {
        for group in ["billing", "audit"] {
            support::plant_gate(conn, &shard(i), group).await;
        }
        support::plant_fence(conn, &format!("{}:fence", shard(i)), "billing").await;
        let _: () = conn
            .hset_multiple(
                format!("{}:attempts", shard(i)),
                &[("billing|4000-5", 2), ("audit|4000-5", 2)],
            )
            .await
            .unwrap();
    }
    for group in ["billing", "audit"] {
        let _: String = conn
            .xadd(format!("orders:dlq:{group}"), "*", &[("shard", "1")])
            .await
            .unwrap();
    }
    // A dead-letter stream kept by `group delete --keep-dead-letters`, and one of the longer
    // prefix `orders:dlq:x` (not of `orders`).
    for key in ["orders:dlq:old", DECOY] {
        let _: String = conn.xadd(key, "*", &[("shard", "0")]).await.unwrap();
    }
    admin::scale(conn, "orders", 3).await.unwrap();
    admin::create_stream(conn, "payments", 2).await.unwrap();
    admin::register_group(conn, "payments", "billing", StartFrom::Earliest)
        .await
        .unwrap();
    support::plant_gate(conn, "{payments:0}", "billing").await;
}

/// The dead-letter stream of group `g` of stream `orders:dlq:x`: not a key of `orders`.
const DECOY: &str = "orders:dlq:x:dlq:g";

fn of_orders(keys: &[String]) -> Vec<String> {
    keys.iter()
        .filter(|k| k.contains("orders") && k.as_str() != DECOY)
        .cloned()
        .collect()
}

async fn stream_delete_leaves_no_key_of_the_stream(cluster: bool) {
    let mut redis = Redis::start(cluster).await;
    two_streams(&mut redis.conn).await;
    let before = redis.all_keys().await;
    assert_eq!(
        of_orders(&before).len(),
        4 * 6 + 1 + 2 * 2 + 1,
        "4 shards with fence, attempts, 2 read gates and their registry, the metadata, 2 groups with hash and dead letters, a kept dead-letter stream: {before:?}"
    );

    // Data left and no --force: refused, naming group and shard, nothing deleted.
    let err = admin::delete_stream(&mut redis.conn, "orders", false)
        .await
        .unwrap_err();
    match &err {
        AdminError::StreamHasData {
            group,
            shard,
            detail,
            ..
        } => assert_eq!(
            (group.as_str(), *shard, detail.as_str()),
            ("audit", 0, "unread entries from 1000-1")
        ),
        other => panic!("{other:?}"),
    }
    assert!(err.to_string().contains("--force"), "{err}");
    assert_eq!(redis.all_keys().await, before);

    // A live member of one group: refused even with --force.
    let far = (support::now_us() + 60_000_000) as f64;
    let _: u64 = redis
        .conn
        .zadd("sl:{orders:audit}:leases", "m1", far)
        .await
        .unwrap();
    let err = admin::delete_stream(&mut redis.conn, "orders", true)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, AdminError::GroupActive { group, members, .. } if group == "audit" && members == &["m1"]),
        "{err:?}"
    );
    let _: u64 = redis
        .conn
        .zrem("sl:{orders:audit}:leases", "m1")
        .await
        .unwrap();
    let before = redis.all_keys().await;

    let deleted = admin::delete_stream(&mut redis.conn, "orders", true)
        .await
        .unwrap();
    assert_eq!(deleted.groups, ["billing", "audit"]);
    assert_eq!(deleted.shards_deleted, vec![0, 1, 2, 3]);
    assert_eq!(deleted.orphan_dead_letters, ["orders:dlq:old"]);
    assert_eq!(deleted.keys_deleted, of_orders(&before).len() as u64);
    let after = redis.all_keys().await;
    assert_eq!(of_orders(&after), Vec::<String>::new());
    let indexed: Vec<String> = redis.conn.smembers("sl:streams").await.unwrap();
    assert_eq!(indexed, ["payments"]);
    assert_eq!(
        after.len(),
        before.len() - of_orders(&before).len(),
        "payments and {DECOY} untouched: {after:?}"
    );
    assert!(after.contains(&DECOY.to_owned()));

    // Gone: a second call says so.
    let err = admin::delete_stream(&mut redis.conn, "orders", true)
        .await
        .unwrap_err();
    assert!(
        matches!(err, AdminError::Store(StoreError::MissingStream { .. })),
        "{err:?}"
    );
}

tests_of!(stream_delete_leaves_no_key_of_the_stream {
    stream_delete_leaves_no_key_standalone => false,
    stream_delete_leaves_no_key_cluster => true,
});

/// A deletion interrupted at any step is finished by running it again: here by hand, half of it
/// (one group's keys, two shards) of a forced one, then only the index entry left.
#[tokio::test]
async fn an_interrupted_stream_delete_is_finished_by_running_it_again() {
    let mut redis = Redis::start(false).await;
    two_streams(&mut redis.conn).await;
    let conn = &mut redis.conn;
    let _: u64 = conn
        .del(&[
            "sl:{orders:billing}:group",
            "orders:dlq:billing",
            "{orders:0}",
            "{orders:0}:fence",
            "{orders:0}:attempts",
            "{orders:2}",
        ])
        .await
        .unwrap();
    let deleted = admin::delete_stream(conn, "orders", true).await.unwrap();
    assert_eq!(deleted.shards_deleted, vec![1, 3]);
    assert_eq!(of_orders(&redis.all_keys().await), Vec::<String>::new());

    // Crashed after the metadata: only the index entry is left.
    let _: u64 = redis.conn.sadd("sl:streams", "orders").await.unwrap();
    let deleted = admin::delete_stream(&mut redis.conn, "orders", false)
        .await
        .unwrap();
    assert_eq!((deleted.keys_deleted, deleted.groups.len()), (0, 0));
    let indexed: Vec<String> = redis.conn.smembers("sl:streams").await.unwrap();
    assert_eq!(indexed, ["payments"]);
}

/// After `stream delete`, producers and members get today's clear errors: a new publisher and a
/// new listener are told the stream does not exist; a publisher built before cannot append.
#[tokio::test]
async fn producers_and_members_of_a_deleted_stream_fail_clearly() {
    use stream_listener::{PublishError, Publisher, PublisherOptions};
    let mut redis = Redis::start(false).await;
    let target = redis.target.clone();
    setup(&mut redis.conn, 2).await;
    let old = Publisher::new(redis.conn.clone(), "orders", PublisherOptions::default())
        .await
        .unwrap();
    admin::delete_stream(&mut redis.conn, "orders", true)
        .await
        .unwrap();
    assert_eq!(redis.all_keys().await, Vec::<String>::new());

    let err = Publisher::new(redis.conn.clone(), "orders", PublisherOptions::default())
        .await
        .unwrap_err();
    assert!(matches!(err, PublishError::UnknownStream { .. }), "{err:?}");
    let err = old.publish("k", &1).await.unwrap_err();
    assert!(
        matches!(
            err,
            PublishError::UnknownStream { .. } | PublishError::ShardMissing { .. }
        ),
        "{err:?}"
    );
    assert_eq!(
        redis.all_keys().await,
        Vec::<String>::new(),
        "nothing re-created"
    );
    let recorder = std::sync::Arc::new(support::Recorder::default());
    let handler = support::recording_handler(recorder, Duration::ZERO, None);
    let err = stream_listener::core::member::Listener::new(
        target,
        "orders",
        "billing",
        handler,
        support::options(1),
    )
    .unwrap()
    .start()
    .await
    .unwrap_err();
    let text = stream_listener::core::internals::report::Chain(&err).to_string();
    assert!(text.contains("stream create"), "{text}");
    assert_eq!(
        redis.all_keys().await,
        Vec::<String>::new(),
        "nothing re-created"
    );
}

/// `--keep-dead-letters` keeps the dead-letter stream and nothing else; a later delete of the
/// name removes it; then the group is unknown.
#[tokio::test]
async fn group_delete_can_keep_the_dead_letters() {
    let mut redis = Redis::start(false).await;
    let conn = &mut redis.conn;
    setup(conn, 2).await;
    let _: String = conn
        .xadd("orders:dlq:billing", "*", &[("shard", "1")])
        .await
        .unwrap();
    let deleted = admin::delete_group_with(conn, "orders", "billing", true)
        .await
        .unwrap();
    assert!(deleted.dead_letters_kept);
    assert_eq!(deleted.dead_letters, 1);
    assert_eq!(billing_traces(&mut redis, 2).await, ["orders:dlq:billing"]);

    let deleted = admin::delete_group(&mut redis.conn, "orders", "billing")
        .await
        .unwrap();
    assert_eq!(
        (
            deleted.dead_letters,
            deleted.dead_letters_kept,
            deleted.unregistered
        ),
        (1, false, false)
    );
    assert_eq!(billing_traces(&mut redis, 2).await, Vec::<String>::new());
    let err = admin::delete_group(&mut redis.conn, "orders", "billing")
        .await
        .unwrap_err();
    assert!(
        matches!(err, AdminError::Store(StoreError::UnknownGroup { .. })),
        "{err:?}"
    );
}

/// Docs: "a group whose metadata is missing or corrupt can be deleted". A leases sorted set or
/// a shard's fence holding another Redis type (written by hand) made `group delete` fail with
/// WRONGTYPE on every run, so the group could never be cleared. The leases key is the group's
/// and goes; the fence is the shard's (other groups' fields) and is left as it is.
#[tokio::test]
async fn group_delete_clears_a_group_whose_leases_or_fence_have_the_wrong_type() {
    let mut redis = Redis::start(false).await;
    let conn = &mut redis.conn;
    setup(conn, 2).await;
    let _: () = conn
        .set("sl:{orders:billing}:leases", "garbage")
        .await
        .unwrap();
    let _: () = conn.set("{orders:1}:fence", "garbage").await.unwrap();
    // A member whose JSON lease still runs is judged live without the sorted set.
    let now_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64;
    let json = format!(r#"{{"memberLeaseExpiresAt":{}}}"#, now_us + 60_000_000);
    let _: u64 = conn
        .hset("sl:{orders:billing}:group", "member:m1", &json)
        .await
        .unwrap();
    let before = snapshot(conn, 2).await;
    let err = admin::delete_group(conn, "orders", "billing")
        .await
        .unwrap_err();
    assert!(
        matches!(err, AdminError::GroupActive { ref members, .. } if members == &["m1"]),
        "{err:?}"
    );
    let options = ResetOptions {
        target: ResetTarget::Earliest,
        shards: None,
        dry_run: false,
    };
    let err = admin::reset_group(conn, "orders", "billing", &options)
        .await
        .unwrap_err();
    assert!(matches!(err, AdminError::GroupActive { .. }), "{err:?}");
    assert_eq!(snapshot(conn, 2).await, before);
    let _: u64 = conn
        .hdel("sl:{orders:billing}:group", "member:m1")
        .await
        .unwrap();

    let deleted = admin::delete_group(conn, "orders", "billing")
        .await
        .unwrap();
    assert_eq!(deleted.destroyed_on, [0, 1]);
    assert!(deleted.unregistered);
    let fence: String = redis.conn.get("{orders:1}:fence").await.unwrap();
    assert_eq!(fence, "garbage");
    let _: u64 = redis.conn.del("{orders:1}:fence").await.unwrap();
    assert_eq!(billing_traces(&mut redis, 2).await, Vec::<String>::new());
}

/// A shard whose last entry has the largest possible id
/// (`18446744073709551615-18446744073709551615`): the reset script's exclusive ranges
/// `(<id>` after that id were an error ("invalid start ID"), so every target but `earliest`
/// failed on it.
#[tokio::test]
async fn resets_work_on_a_shard_ending_at_the_largest_entry_id() {
    const MAX: &str = "18446744073709551615-18446744073709551615";
    let mut redis = Redis::start(false).await;
    let conn = &mut redis.conn;
    admin::create_stream(conn, "orders", 1).await.unwrap();
    admin::register_group(conn, "orders", "billing", StartFrom::Earliest)
        .await
        .unwrap();
    for id in ["0-1", "5-18446744073709551615", MAX] {
        let _: String = conn.xadd(shard(0), id, &[("n", id)]).await.unwrap();
    }
    assert_eq!(
        support::read_new(conn, &shard(0), "billing", 100)
            .await
            .len(),
        3
    );
    let positions = |r: admin::GroupReset| {
        let s = &r.shards[0];
        (
            s.new_position.clone(),
            s.to_deliver,
            s.skipped,
            s.entries_read,
        )
    };
    let cases = [
        (ResetTarget::ShiftBy { n: 1 }, (MAX, 0, 0, 3)),
        (ResetTarget::Latest, (MAX, 0, 0, 3)),
        (
            ResetTarget::ShiftBy { n: -1 },
            ("5-18446744073709551615", 1, 0, 2),
        ),
        (
            ResetTarget::Time { ms: 6 },
            ("5-18446744073709551615", 1, 0, 2),
        ),
    ];
    for (target, (pos, to_deliver, skipped, read)) in cases {
        let got = positions(reset(conn, target, None, true).await.unwrap());
        assert_eq!(got, (pos.to_owned(), to_deliver, skipped, read), "{target}");
    }
    // From a position before the end, forward to the last id and past it.
    reset(conn, ResetTarget::Earliest, None, false)
        .await
        .unwrap();
    let got = positions(
        reset(conn, ResetTarget::ShiftBy { n: 3 }, None, false)
            .await
            .unwrap(),
    );
    assert_eq!(got, (MAX.to_owned(), 0, 3, 3));
    let got = positions(
        reset(conn, ResetTarget::ShiftBy { n: 5 }, None, true)
            .await
            .unwrap(),
    );
    assert_eq!(got, (MAX.to_owned(), 0, 0, 3));
    // The same range after the largest id in the check of `stream delete` without --force.
    let deleted = admin::delete_stream(conn, "orders", false).await.unwrap();
    assert_eq!(deleted.shards_deleted, [0]);
}

/// A key `<prefix>:dlq:<group>` of another type (written by hand) made `group delete` fail with
/// WRONGTYPE after it had unregistered the group and destroyed its consumer groups, and every
/// later run failed the same way. The key is the group's by name: deleted (0 dead letters),
/// kept with `--keep-dead-letters`.
#[tokio::test]
async fn group_delete_removes_a_dead_letter_key_of_another_type() {
    let mut redis = Redis::start(false).await;
    let conn = &mut redis.conn;
    setup(conn, 2).await;
    admin::register_group(conn, "orders", "audit", StartFrom::Earliest)
        .await
        .unwrap();
    let _: () = conn.set("orders:dlq:audit", "kept").await.unwrap();
    let deleted = admin::delete_group_with(conn, "orders", "audit", true)
        .await
        .unwrap();
    assert_eq!((deleted.dead_letters, deleted.dead_letters_kept), (0, true));
    let kept: String = conn.get("orders:dlq:audit").await.unwrap();
    assert_eq!(kept, "kept");

    let _: () = conn.set("orders:dlq:billing", "garbage").await.unwrap();
    let deleted = admin::delete_group(conn, "orders", "billing")
        .await
        .unwrap();
    assert_eq!((deleted.dead_letters, deleted.unregistered), (0, true));
    assert_eq!(deleted.destroyed_on, [0, 1]);
    assert_eq!(billing_traces(&mut redis, 2).await, Vec::<String>::new());

    // An empty dead-letter stream (its entries deleted) is a key of the group too.
    let conn = &mut redis.conn;
    admin::register_group(conn, "orders", "billing", StartFrom::Earliest)
        .await
        .unwrap();
    let id: String = conn
        .xadd("orders:dlq:billing", "*", &[("shard", "0")])
        .await
        .unwrap();
    let _: u64 = conn.xdel("orders:dlq:billing", &[id]).await.unwrap();
    let deleted = admin::delete_group(conn, "orders", "billing")
        .await
        .unwrap();
    assert_eq!(deleted.dead_letters, 0);
    assert_eq!(billing_traces(&mut redis, 2).await, Vec::<String>::new());
}

/// A time target after the year 9999 (possible through the library's `ResetTarget::Time`, not
/// the CLI's parser) panicked: the refusal formatted it with humantime, whose `Display` fails
/// past 9999-12-31, and `to_string` panics on a failing `Display`. It is refused as any time in
/// the future, nothing changed.
#[tokio::test]
async fn a_reset_to_a_time_after_the_year_9999_is_refused_without_a_panic() {
    let mut redis = Redis::start(false).await;
    let conn = &mut redis.conn;
    setup(conn, 1).await;
    let before = snapshot(conn, 1).await;
    for ms in [253_402_300_800_000, u64::MAX] {
        let target = ResetTarget::Time { ms };
        let err = reset(conn, target, None, false).await.unwrap_err();
        assert!(
            matches!(err, AdminError::ResetTimeInFuture { ref time, .. } if time == &format!("{ms} ms since the Unix epoch")),
            "{err:?}"
        );
        assert_eq!(target.to_string(), format!("{ms} ms since the Unix epoch"));
    }
    assert_eq!(
        ResetTarget::Time {
            ms: 253_402_300_799_999
        }
        .to_string(),
        "9999-12-31T23:59:59.999Z"
    );
    assert_eq!(snapshot(conn, 1).await, before);
}
