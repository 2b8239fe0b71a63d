//! Admin operations on a real standalone Redis (docs/design.md §2, §3, §8, §10): create, register,
//! scale-out, scale-in with draining and retirement (pending entries, unread entries, an `XDEL`
//! of the tail, the routing lease), cancel, full drain, describe, list, group delete, and failing
//! closed on corrupt or missing metadata.

mod support;

use std::time::Duration;

use redis::AsyncCommands;
use redis::streams::StreamInfoGroupsReply;
use stream_listener::core::internals::admin::{
    self, AdminError, Lag, ScaleAction, StoreError, WaitReason,
};
use stream_listener::core::internals::connection::{RedisConnection, RedisTarget};
use stream_listener::core::internals::coordinator::CoordinatorConfig;
use stream_listener::core::internals::keys::{NameError, StreamKeys};
use stream_listener::core::internals::store::GroupStore;
use stream_listener::core::model::{
    GroupState, HeartbeatRequest, HeartbeatStatus, MemberState, ShardState, StartFrom,
};
use stream_listener::testing::RedisServer;
use support::{coordination, heartbeat_request, mark_retiring};

const NO_LEASE: Duration = Duration::ZERO;

async fn connect(server: &RedisServer) -> RedisConnection {
    support::connect(&RedisTarget::standalone(server.url())).await
}

/// `(name, pending, last-delivered-id)` of each consumer group of `key`, by name.
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

async fn exists(conn: &mut RedisConnection, key: &str) -> bool {
    conn.exists(key).await.unwrap()
}

async fn dbsize(conn: &mut RedisConnection) -> u64 {
    redis::cmd("DBSIZE").query_async(conn).await.unwrap()
}

/// Reads up to `count` new entries of `key` for `group` as consumer `c1`; returns their ids.
async fn read(conn: &mut RedisConnection, key: &str, group: &str, count: usize) -> Vec<String> {
    support::read_new(conn, key, group, count).await
}

async fn ack(conn: &mut RedisConnection, key: &str, group: &str, ids: &[String]) {
    let acked: u64 = conn.xack(key, group, ids).await.unwrap();
    assert_eq!(acked, ids.len() as u64);
}

async fn add(conn: &mut RedisConnection, key: &str, ids: &[&str]) {
    for id in ids {
        let _: String = conn.xadd(key, *id, &[("n", *id)]).await.unwrap();
    }
}

fn request(member: &str, seq: u64, epoch: i64, owned: &[u32]) -> HeartbeatRequest {
    heartbeat_request(member, "listener", 2, (seq, epoch), owned)
}

fn group_store(
    conn: &RedisConnection,
    prefix: &str,
    group: &str,
    config: &CoordinatorConfig,
) -> GroupStore {
    let stream = StreamKeys::new(prefix).unwrap();
    let keys = stream.group(group).unwrap();
    GroupStore::new(conn.clone(), stream, keys, config.clone())
}

fn short_leases() -> CoordinatorConfig {
    coordination(
        Duration::from_millis(100),
        Duration::from_millis(1200),
        Duration::from_secs(5),
    )
}

#[tokio::test]
async fn create_is_idempotent_and_bad_names_or_counts_create_nothing() {
    let server = RedisServer::start().unwrap();
    let mut conn = connect(&server).await;

    for bad in ["{orders}", "orders}{", "{}orders", "a{b"] {
        let err = admin::create_stream(&mut conn, bad, 4).await.unwrap_err();
        assert!(
            matches!(
                err,
                AdminError::InvalidName(NameError::ForbiddenCharacter { .. })
            ),
            "{bad}: {err:?}"
        );
        assert!(err.to_string().contains("not allowed"), "{err}");
    }
    let err = admin::create_stream(&mut conn, "orders", 0)
        .await
        .unwrap_err();
    assert!(matches!(err, AdminError::ZeroShards { .. }), "{err:?}");
    let err = admin::create_stream(&mut conn, "orders", 1025)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            AdminError::TooManyShards {
                requested: 1025,
                max: 1024,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(
        dbsize(&mut conn).await,
        0,
        "a refused create writes nothing"
    );

    let created = admin::create_stream(&mut conn, "orders", 4).await.unwrap();
    assert!(created.created);
    assert_eq!(created.metadata.shard_count, 4);
    assert_eq!(created.metadata.metadata_version, 1);
    assert_eq!(created.metadata.revision, 1);
    assert_eq!(
        created
            .metadata
            .readable_shard_set()
            .into_iter()
            .collect::<Vec<_>>(),
        vec![0, 1, 2, 3]
    );
    assert!(created.metadata.groups.is_empty());
    for i in 0..4 {
        let key = format!("{{orders:{i}}}");
        let kind: String = redis::cmd("TYPE")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(kind, "stream", "{key}");
        let len: u64 = conn.xlen(&key).await.unwrap();
        assert_eq!(len, 0);
        assert!(
            groups_of(&mut conn, &key).await.is_empty(),
            "no leftover group"
        );
    }
    assert!(!exists(&mut conn, "{orders:4}").await);
    let index: Vec<String> = conn.smembers("sl:streams").await.unwrap();
    assert_eq!(index, vec!["orders".to_owned()]);
    // 4 shards, the metadata hash, the index.
    assert_eq!(dbsize(&mut conn).await, 6);

    let again = admin::create_stream(&mut conn, "orders", 4).await.unwrap();
    assert!(!again.created);
    assert_eq!(again.metadata, created.metadata, "nothing changed");

    let err = admin::create_stream(&mut conn, "orders", 5)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            AdminError::ShardCountMismatch {
                existing: 4,
                requested: 5,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(
        err.to_string()
            .contains("`stream-listener stream scale orders 5`"),
        "{err}"
    );
    assert_eq!(dbsize(&mut conn).await, 6);
}

#[tokio::test]
async fn register_group_creates_the_consumer_group_on_every_shard() {
    let server = RedisServer::start().unwrap();
    let mut conn = connect(&server).await;
    admin::create_stream(&mut conn, "orders", 3).await.unwrap();
    add(&mut conn, "{orders:0}", &["1-1", "1-2"]).await;

    for bad in ["a:b", "{g}", "g}"] {
        let err = admin::register_group(&mut conn, "orders", bad, StartFrom::Earliest)
            .await
            .unwrap_err();
        assert!(matches!(err, AdminError::InvalidName(_)), "{bad}: {err:?}");
    }
    let err = admin::register_group(&mut conn, "missing", "billing", StartFrom::Earliest)
        .await
        .unwrap_err();
    assert!(
        matches!(err, AdminError::Store(StoreError::MissingStream { .. })),
        "{err:?}"
    );

    let registration = admin::register_group(&mut conn, "orders", "billing", StartFrom::Earliest)
        .await
        .unwrap();
    assert!(registration.registered);
    assert_eq!(registration.metadata_version, 2);
    for i in 0..3 {
        assert_eq!(
            groups_of(&mut conn, &format!("{{orders:{i}}}")).await,
            vec![("billing".to_owned(), 0, "0-0".to_owned())],
            "shard {i}"
        );
    }
    assert!(exists(&mut conn, "sl:{orders:billing}:group").await);

    let again = admin::register_group(&mut conn, "orders", "billing", StartFrom::Latest)
        .await
        .unwrap();
    assert!(!again.registered);
    assert_eq!(again.start_from, StartFrom::Earliest, "the stored one");
    assert_eq!(again.metadata_version, 2, "nothing changed");

    let latest = admin::register_group(&mut conn, "orders", "audit", StartFrom::Latest)
        .await
        .unwrap();
    assert!(latest.registered);
    assert_eq!(latest.metadata_version, 3);
    assert_eq!(
        groups_of(&mut conn, "{orders:0}").await,
        vec![
            ("audit".to_owned(), 0, "1-2".to_owned()),
            ("billing".to_owned(), 0, "0-0".to_owned()),
        ]
    );

    let described = admin::describe_group(
        &mut conn,
        "orders",
        "billing",
        &CoordinatorConfig::default(),
    )
    .await
    .unwrap();
    assert_eq!(described.state, GroupState::Empty);
    assert_eq!(described.start_from, StartFrom::Earliest);
    assert!(described.members.is_empty());
    assert_eq!(described.shards.len(), 3);
    assert_eq!(described.shards[0].length, Some(2));
    assert_eq!(described.shards[0].pending, Some(0));
    assert_eq!(described.shards[0].lag, Lag::Known(2));
    assert_eq!(
        described.shards[0].last_delivered_id.as_deref(),
        Some("0-0")
    );
    assert_eq!(described.shards[1].lag, Lag::Known(0));
    assert_eq!(described.shards[0].target_owner, None);
    assert_eq!(described.dead_letters, 0);
    assert_eq!(described.shards[0].dead_letters, Some(0));

    let groups = admin::list_groups(&mut conn, "orders", &CoordinatorConfig::default())
        .await
        .unwrap();
    let names: Vec<_> = groups.iter().map(|g| g.consumer_group.as_str()).collect();
    assert_eq!(names, ["billing", "audit"]);
    assert_eq!(groups[1].start_from, StartFrom::Latest);
    assert_eq!(groups[0].state, Some(GroupState::Empty));
    assert_eq!(groups[0].problem, None);
}

#[tokio::test]
async fn scale_out_provisions_new_shards_with_every_registered_group() {
    let server = RedisServer::start().unwrap();
    let mut conn = connect(&server).await;
    admin::create_stream(&mut conn, "orders", 4).await.unwrap();
    for (group, from) in [
        ("billing", StartFrom::Earliest),
        ("audit", StartFrom::Latest),
    ] {
        admin::register_group(&mut conn, "orders", group, from)
            .await
            .unwrap();
    }

    let err = admin::scale(&mut conn, "orders", 1025).await.unwrap_err();
    assert!(matches!(err, AdminError::TooManyShards { .. }), "{err:?}");
    let err = admin::scale(&mut conn, "nope", 2).await.unwrap_err();
    assert!(
        matches!(err, AdminError::Store(StoreError::MissingStream { .. })),
        "{err:?}"
    );

    let outcome = admin::scale(&mut conn, "orders", 6).await.unwrap();
    assert_eq!(outcome.action, ScaleAction::ScaleOut);
    assert_eq!((outcome.from_shard_count, outcome.to_shard_count), (4, 6));
    assert_eq!(outcome.provisioned, vec![4, 5]);
    assert_eq!(outcome.metadata_version, 4);
    assert_eq!(outcome.migration, None);
    for i in [4, 5] {
        assert_eq!(
            groups_of(&mut conn, &format!("{{orders:{i}}}")).await,
            vec![
                ("audit".to_owned(), 0, "0-0".to_owned()),
                ("billing".to_owned(), 0, "0-0".to_owned()),
            ],
            "shard {i}"
        );
    }
    let described = admin::describe_stream(&mut conn, "orders").await.unwrap();
    assert_eq!(described.shard_count, 6);
    assert_eq!(described.metadata_version, 4);
    assert_eq!(described.readable_shard_set, vec![0, 1, 2, 3, 4, 5]);
    assert!(
        described
            .shards
            .iter()
            .all(|s| s.state == ShardState::Active && s.exists && s.length == Some(0))
    );
    assert_eq!(described.shards[5].groups.len(), 2);

    let unchanged = admin::scale(&mut conn, "orders", 6).await.unwrap();
    assert_eq!(unchanged.action, ScaleAction::Unchanged);
    assert_eq!(unchanged.metadata_version, 4);
}

#[tokio::test]
async fn scale_in_keeps_draining_shards_until_every_group_has_read_and_acked_everything() {
    let server = RedisServer::start().unwrap();
    let mut conn = connect(&server).await;
    admin::create_stream(&mut conn, "orders", 4).await.unwrap(); // v1
    admin::register_group(&mut conn, "orders", "billing", StartFrom::Earliest)
        .await
        .unwrap(); // v2
    admin::scale(&mut conn, "orders", 6).await.unwrap(); // v3
    add(&mut conn, "{orders:5}", &["1-1", "1-2", "1-3"]).await;
    support::plant_fence(&mut conn, "{orders:5}:fence", "billing").await;
    // Shard 4's gate as versions before per-token gates named it, shard 5's listed in its
    // registry.
    support::plant_legacy_gate(&mut conn, "{orders:4}:gate:billing", "billing").await;
    let gate_5 = support::plant_gate(&mut conn, "{orders:5}", "billing").await;

    let outcome = admin::scale(&mut conn, "orders", 4).await.unwrap(); // v4
    assert_eq!(outcome.action, ScaleAction::ScaleIn);
    assert_eq!(outcome.draining, vec![4, 5]);
    assert_eq!(outcome.metadata_version, 4);
    let migration = outcome.migration.unwrap();
    assert_eq!(
        (migration.from_shard_count, migration.to_shard_count),
        (6, 4)
    );
    let described = admin::describe_stream(&mut conn, "orders").await.unwrap();
    assert_eq!(described.shard_count, 4);
    assert_eq!(described.readable_shard_set, vec![0, 1, 2, 3, 4, 5]);
    assert_eq!(described.shards[4].state, ShardState::Draining);

    // The routing lease (and its slack, a fifth of it) has not passed: nothing is checked or
    // changed.
    let report = admin::retire_drained(&mut conn, "orders", Duration::from_secs(3600))
        .await
        .unwrap();
    assert_eq!(report.metadata_version, 4);
    assert!(!report.migration_complete);
    for shard in &report.shards {
        assert_eq!(shard.state, ShardState::Draining);
        match shard.waiting {
            Some(WaitReason::RoutingLease { remaining_ms }) => {
                assert!(
                    (4_310_000..=4_320_000).contains(&remaining_ms),
                    "{remaining_ms}"
                );
            }
            ref other => panic!("{other:?}"),
        }
    }

    // Two entries delivered and not acknowledged: shard 5 keeps draining; empty shard 4 retires.
    let delivered = read(&mut conn, "{orders:5}", "billing", 2).await;
    assert_eq!(delivered, ["1-1", "1-2"]);
    let report = admin::retire_drained(&mut conn, "orders", NO_LEASE)
        .await
        .unwrap(); // v5, v6
    assert_eq!(report.shards.len(), 2);
    assert_eq!(report.shards[0].shard_index, 4);
    assert_eq!(report.shards[0].state, ShardState::Retired);
    assert_eq!(report.shards[0].waiting, None);
    assert_eq!(report.shards[1].state, ShardState::Draining);
    assert_eq!(
        report.shards[1].waiting,
        Some(WaitReason::Pending {
            group: "billing".into(),
            pending: 2
        })
    );
    assert_eq!(report.metadata_version, 6);
    assert_eq!(report.readable_shard_set, vec![0, 1, 2, 3, 5]);
    assert!(!report.migration_complete);
    assert!(!exists(&mut conn, "{orders:4}").await);
    assert!(
        !exists(&mut conn, "{orders:4}:gate:billing").await,
        "with its read gate"
    );
    assert!(exists(&mut conn, "{orders:5}").await);

    // Acknowledged, but an entry after the last delivered id is still unread.
    ack(&mut conn, "{orders:5}", "billing", &delivered).await;
    let report = admin::retire_drained(&mut conn, "orders", NO_LEASE)
        .await
        .unwrap();
    assert_eq!(report.shards.len(), 1);
    assert_eq!(
        report.shards[0].waiting,
        Some(WaitReason::UnreadEntries {
            group: "billing".into(),
            next_id: "1-3".into()
        })
    );
    assert_eq!(report.shards[0].state, ShardState::Draining);
    assert_eq!(report.metadata_version, 6, "nothing changed");

    // Read and acknowledged: retired, stream and fence deleted, migration cleared.
    let rest = read(&mut conn, "{orders:5}", "billing", 10).await;
    assert_eq!(rest, ["1-3"]);
    ack(&mut conn, "{orders:5}", "billing", &rest).await;
    let report = admin::retire_drained(&mut conn, "orders", NO_LEASE)
        .await
        .unwrap(); // v7, v8
    assert_eq!(report.shards[0].state, ShardState::Retired);
    assert_eq!(report.shards[0].waiting, None);
    assert!(report.migration_complete);
    assert_eq!(report.metadata_version, 8);
    assert_eq!(report.readable_shard_set, vec![0, 1, 2, 3]);
    assert!(!exists(&mut conn, "{orders:5}").await);
    assert!(!exists(&mut conn, "{orders:5}:fence").await);
    assert!(!exists(&mut conn, &gate_5).await);
    assert!(!exists(&mut conn, "{orders:5}:gates").await);
    let described = admin::describe_stream(&mut conn, "orders").await.unwrap();
    assert_eq!(described.migration, None);
    assert_eq!(described.shards[5].state, ShardState::Retired);
    assert!(!described.shards[5].exists);

    // Nothing left: a further call changes nothing.
    let report = admin::retire_drained(&mut conn, "orders", NO_LEASE)
        .await
        .unwrap();
    assert!(report.shards.is_empty());
    assert!(report.migration_complete);
    assert_eq!(report.metadata_version, 8);

    // A retired index can be provisioned again by a scale-out.
    let outcome = admin::scale(&mut conn, "orders", 5).await.unwrap();
    assert_eq!(outcome.provisioned, vec![4]);
    assert_eq!(
        groups_of(&mut conn, "{orders:4}").await,
        vec![("billing".to_owned(), 0, "0-0".to_owned())]
    );
}

#[tokio::test]
async fn a_shard_whose_tail_was_deleted_retires() {
    let server = RedisServer::start().unwrap();
    let mut conn = connect(&server).await;
    admin::create_stream(&mut conn, "tail", 2).await.unwrap();
    admin::register_group(&mut conn, "tail", "billing", StartFrom::Earliest)
        .await
        .unwrap();
    add(&mut conn, "{tail:1}", &["1-1", "1-2", "1-3"]).await;
    admin::scale(&mut conn, "tail", 1).await.unwrap();

    let delivered = read(&mut conn, "{tail:1}", "billing", 2).await;
    ack(&mut conn, "{tail:1}", "billing", &delivered).await;
    let deleted: u64 = conn.xdel("{tail:1}", &["1-3"]).await.unwrap();
    assert_eq!(deleted, 1);

    // The last delivered id (1-2) will never equal the last generated one (1-3); Redis no
    // longer knows the lag.
    let described =
        admin::describe_group(&mut conn, "tail", "billing", &CoordinatorConfig::default())
            .await
            .unwrap();
    assert_eq!(
        described.shards[1].last_delivered_id.as_deref(),
        Some("1-2")
    );
    assert_eq!(described.shards[1].lag, Lag::Unknown);
    assert_eq!(described.shards[1].pending, Some(0));
    assert_eq!(described.shards[1].length, Some(2));

    let report = admin::retire_drained(&mut conn, "tail", NO_LEASE)
        .await
        .unwrap();
    assert_eq!(report.shards.len(), 1);
    assert_eq!(report.shards[0].state, ShardState::Retired);
    assert!(report.migration_complete);
    assert_eq!(report.readable_shard_set, vec![0]);
    assert!(!exists(&mut conn, "{tail:1}").await);
}

/// docs/design.md §10.2: an entry that lands in a shard after the first retirement check (a
/// producer's late write, or a read of a member that had not yet seen RETIRING) makes the final
/// check fail. No member reads a RETIRING shard, so it must not stay RETIRING: it becomes DRAINING
/// again (readable, `metadataVersion` bumped), and once the entry is read and acknowledged the
/// next call retires it. The RETIRING state with the late entry is set up as the first check and
/// its compare-and-set leave it, then the entry is added (the write between the two checks).
#[tokio::test]
async fn a_retiring_shard_with_entries_left_is_readable_again_and_then_retires() {
    let server = RedisServer::start().unwrap();
    let mut conn = connect(&server).await;
    admin::create_stream(&mut conn, "orders", 2).await.unwrap(); // v1
    admin::register_group(&mut conn, "orders", "billing", StartFrom::Earliest)
        .await
        .unwrap(); // v2
    admin::scale(&mut conn, "orders", 1).await.unwrap(); // v3
    mark_retiring(&mut conn, "orders", 1).await; // v4
    add(&mut conn, "{orders:1}", &["1-1"]).await;

    let report = admin::retire_drained(&mut conn, "orders", NO_LEASE)
        .await
        .unwrap(); // v5
    assert_eq!(report.shards.len(), 1);
    assert_eq!(report.shards[0].state, ShardState::Draining, "{report:?}");
    assert_eq!(
        report.shards[0].waiting,
        Some(WaitReason::UnreadEntries {
            group: "billing".into(),
            next_id: "1-1".into()
        })
    );
    assert_eq!(
        report.readable_shard_set,
        vec![0, 1],
        "members read it again"
    );
    assert_eq!(report.metadata_version, 5);
    assert!(!report.migration_complete);
    assert!(exists(&mut conn, "{orders:1}").await);

    // Read but not acknowledged: it keeps draining.
    let delivered = read(&mut conn, "{orders:1}", "billing", 10).await;
    assert_eq!(delivered, ["1-1"]);
    let report = admin::retire_drained(&mut conn, "orders", NO_LEASE)
        .await
        .unwrap();
    assert_eq!(report.shards[0].state, ShardState::Draining);
    assert!(matches!(
        report.shards[0].waiting,
        Some(WaitReason::Pending { pending: 1, .. })
    ));
    ack(&mut conn, "{orders:1}", "billing", &delivered).await;
    let report = admin::retire_drained(&mut conn, "orders", NO_LEASE)
        .await
        .unwrap(); // v6, v7
    assert_eq!(report.shards[0].state, ShardState::Retired, "{report:?}");
    assert!(report.migration_complete);
    assert_eq!(report.readable_shard_set, vec![0]);
    assert!(!exists(&mut conn, "{orders:1}").await);
}

#[tokio::test]
async fn cancel_reactivates_draining_shards_until_one_is_retiring() {
    let server = RedisServer::start().unwrap();
    let mut conn = connect(&server).await;
    admin::create_stream(&mut conn, "orders", 4).await.unwrap(); // v1
    let err = admin::cancel_scale(&mut conn, "orders").await.unwrap_err();
    assert!(matches!(err, AdminError::NoMigration { .. }), "{err:?}");

    admin::scale(&mut conn, "orders", 2).await.unwrap(); // v2
    let err = admin::scale(&mut conn, "orders", 3).await.unwrap_err();
    assert!(
        matches!(err, AdminError::MigrationInProgress { from: 4, to: 2, .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("--cancel"), "{err}");
    let same = admin::scale(&mut conn, "orders", 2).await.unwrap();
    assert_eq!(same.action, ScaleAction::Unchanged);
    assert_eq!(same.metadata_version, 2);

    let cancelled = admin::cancel_scale(&mut conn, "orders").await.unwrap(); // v3
    assert_eq!(cancelled.action, ScaleAction::Cancelled);
    assert_eq!(cancelled.reactivated, vec![2, 3]);
    assert_eq!(
        (cancelled.from_shard_count, cancelled.to_shard_count),
        (2, 4)
    );
    assert_eq!(cancelled.metadata_version, 3);
    let described = admin::describe_stream(&mut conn, "orders").await.unwrap();
    assert_eq!(described.shard_count, 4);
    assert_eq!(described.migration, None);
    assert!(
        described
            .shards
            .iter()
            .all(|s| s.state == ShardState::Active)
    );

    // Shard 3 retires (empty), shard 2 waits for billing: no cancel any more.
    admin::register_group(&mut conn, "orders", "billing", StartFrom::Earliest)
        .await
        .unwrap(); // v4
    add(&mut conn, "{orders:2}", &["1-1"]).await;
    admin::scale(&mut conn, "orders", 2).await.unwrap(); // v5
    let report = admin::retire_drained(&mut conn, "orders", NO_LEASE)
        .await
        .unwrap();
    assert_eq!(report.shards[0].state, ShardState::Draining);
    assert_eq!(report.shards[1].state, ShardState::Retired);
    let err = admin::cancel_scale(&mut conn, "orders").await.unwrap_err();
    assert!(
        matches!(err, AdminError::CannotCancel { ref shards, .. } if shards == &[3]),
        "{err:?}"
    );
}

#[tokio::test]
async fn scale_to_zero_drains_every_shard() {
    let server = RedisServer::start().unwrap();
    let mut conn = connect(&server).await;
    admin::create_stream(&mut conn, "orders", 2).await.unwrap();
    let outcome = admin::scale(&mut conn, "orders", 0).await.unwrap();
    assert_eq!(outcome.draining, vec![0, 1]);
    assert_eq!(outcome.to_shard_count, 0);
    let report = admin::retire_drained(&mut conn, "orders", NO_LEASE)
        .await
        .unwrap();
    assert!(report.migration_complete);
    assert!(report.readable_shard_set.is_empty());
    assert!(report.shards.iter().all(|s| s.state == ShardState::Retired));
    let described = admin::describe_stream(&mut conn, "orders").await.unwrap();
    assert_eq!(described.shard_count, 0);
    assert!(!exists(&mut conn, "{orders:0}").await);
}

#[tokio::test]
async fn corrupt_stream_metadata_is_an_error_not_a_rebuild() {
    let server = RedisServer::start().unwrap();
    let mut conn = connect(&server).await;
    admin::create_stream(&mut conn, "orders", 2).await.unwrap();
    let _: u64 = conn
        .hset("sl:{orders}:stream", "meta", "{not json")
        .await
        .unwrap();

    let err = admin::describe_stream(&mut conn, "orders")
        .await
        .unwrap_err();
    match &err {
        AdminError::Store(StoreError::CorruptMetadata { key, field, .. }) => {
            assert_eq!(key, "sl:{orders}:stream");
            assert_eq!(field, "meta");
        }
        other => panic!("{other:?}"),
    }
    for result in [
        admin::create_stream(&mut conn, "orders", 2)
            .await
            .map(|_| ()),
        admin::scale(&mut conn, "orders", 3).await.map(|_| ()),
        admin::register_group(&mut conn, "orders", "g", StartFrom::Earliest)
            .await
            .map(|_| ()),
    ] {
        let err = result.unwrap_err();
        assert!(
            matches!(err, AdminError::Store(StoreError::CorruptMetadata { .. })),
            "{err:?}"
        );
    }
    let meta: String = conn.hget("sl:{orders}:stream", "meta").await.unwrap();
    assert_eq!(meta, "{not json", "not rebuilt");
    let listed = admin::list_streams(&mut conn).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert!(
        listed[0]
            .problem
            .as_deref()
            .unwrap()
            .contains("corrupt metadata")
    );
}

#[tokio::test]
async fn missing_group_metadata_fails_closed() {
    let server = RedisServer::start().unwrap();
    let mut conn = connect(&server).await;
    admin::create_stream(&mut conn, "orders", 2).await.unwrap();
    admin::register_group(&mut conn, "orders", "billing", StartFrom::Earliest)
        .await
        .unwrap();
    let _: u64 = conn.del("sl:{orders:billing}:group").await.unwrap();

    let config = CoordinatorConfig::default();
    let err = admin::describe_group(&mut conn, "orders", "billing", &config)
        .await
        .unwrap_err();
    assert!(
        matches!(err, AdminError::Store(StoreError::MissingGroup { .. })),
        "{err:?}"
    );
    // Registering again does not rebuild it.
    let again = admin::register_group(&mut conn, "orders", "billing", StartFrom::Earliest)
        .await
        .unwrap();
    assert!(!again.registered);
    assert!(!exists(&mut conn, "sl:{orders:billing}:group").await);
    let groups = admin::list_groups(&mut conn, "orders", &config)
        .await
        .unwrap();
    assert!(groups[0].problem.as_deref().unwrap().contains("is missing"));

    let err = admin::describe_group(&mut conn, "orders", "other", &config)
        .await
        .unwrap_err();
    assert!(
        matches!(err, AdminError::Store(StoreError::UnknownGroup { .. })),
        "{err:?}"
    );
    // Lost metadata is cleared by deleting the group.
    let deleted = admin::delete_group(&mut conn, "orders", "billing")
        .await
        .unwrap();
    assert!(deleted.unregistered);
    assert_eq!(deleted.destroyed_on, vec![0, 1]);
}

#[tokio::test]
async fn describe_group_shows_members_leases_and_expired_members() {
    let server = RedisServer::start().unwrap();
    let mut conn = connect(&server).await;
    admin::create_stream(&mut conn, "orders", 2).await.unwrap();
    admin::register_group(&mut conn, "orders", "billing", StartFrom::Earliest)
        .await
        .unwrap();
    let config = short_leases();
    let mut store = group_store(&conn, "orders", "billing", &config);

    // m1 joins and takes both shards; m2 joins later and gets its target as pending until m1
    // releases one.
    let join = store
        .heartbeat(&request("m1", 1, 0, &[]))
        .await
        .unwrap()
        .response;
    assert_eq!(join.status, HeartbeatStatus::Ok);
    assert_eq!(join.assigned_shards, vec![0, 1]);
    let m1_epoch = join.member_epoch;
    let ok = store
        .heartbeat(&request("m1", 2, m1_epoch, &[0, 1]))
        .await
        .unwrap()
        .response;
    assert_eq!(ok.status, HeartbeatStatus::Ok);
    let join2 = store
        .heartbeat(&request("m2", 1, 0, &[]))
        .await
        .unwrap()
        .response;
    assert_eq!(join2.status, HeartbeatStatus::Ok);
    assert!(join2.assigned_shards.is_empty());
    assert_eq!(join2.pending_shards.len(), 1);
    let m2_pending = join2.pending_shards.clone();

    let described = admin::describe_group(&mut conn, "orders", "billing", &config)
        .await
        .unwrap();
    assert!(!described.leases_stale);
    assert_eq!(described.members.len(), 2);
    let m1 = &described.members[0];
    assert_eq!(m1.member_id, "m1");
    assert_eq!(m1.state, MemberState::Active);
    assert!(m1.live);
    assert_eq!(m1.owned, vec![0, 1]);
    assert!(
        (1..=1200).contains(&m1.lease_remaining_ms),
        "{}",
        m1.lease_remaining_ms
    );
    let m2 = &described.members[1];
    assert_eq!(m2.assigned, Vec::<u32>::new());
    assert_eq!(m2.pending, m2_pending);
    assert_eq!(m2.target, m2_pending);
    let owner_of = |shard: u32| {
        described.shards[shard as usize]
            .target_owner
            .clone()
            .unwrap()
    };
    assert_eq!(owner_of(m2_pending[0]), "m2");
    assert!(matches!(
        described.state,
        GroupState::Reconciling | GroupState::Assigning
    ));

    // m2 stops; m1 keeps heartbeating (released nothing yet) until m2's lease has run out.
    let mut seq = 3;
    let mut epoch = ok.member_epoch;
    let deadline = tokio::time::Instant::now() + Duration::from_millis(1500);
    while tokio::time::Instant::now() < deadline {
        let response = store
            .heartbeat(&request("m1", seq, epoch, &[0, 1]))
            .await
            .unwrap()
            .response;
        assert_eq!(response.status, HeartbeatStatus::Ok);
        epoch = response.member_epoch;
        seq += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let described = admin::describe_group(&mut conn, "orders", "billing", &config)
        .await
        .unwrap();
    assert!(!described.leases_stale);
    let states: Vec<_> = described
        .members
        .iter()
        .map(|m| (m.member_id.as_str(), m.state, m.live))
        .collect();
    assert!(
        states.contains(&("m1", MemberState::Active, true)),
        "{states:?}"
    );
    let m2 = described.members.iter().find(|m| m.member_id == "m2");
    if let Some(m2) = m2 {
        assert_eq!(m2.state, MemberState::Expired);
        assert!(!m2.live);
        assert!(m2.lease_remaining_ms <= 0);
    } else {
        assert_eq!(described.history[0].member_id, "m2");
        assert_eq!(described.history[0].state, MemberState::Expired);
    }
    assert_eq!(owner_of(0), "m1");

    // Every member gone: leases are stale, members shown as stored with a negative lease.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let described = admin::describe_group(&mut conn, "orders", "billing", &config)
        .await
        .unwrap();
    assert!(described.leases_stale);
    let m1 = described
        .members
        .iter()
        .find(|m| m.member_id == "m1")
        .unwrap();
    assert!(!m1.live);
    assert!(m1.lease_remaining_ms < 0);
}

#[tokio::test]
async fn delete_group_refuses_live_groups_then_removes_everything() {
    let server = RedisServer::start().unwrap();
    let mut conn = connect(&server).await;
    admin::create_stream(&mut conn, "orders", 2).await.unwrap(); // v1
    admin::register_group(&mut conn, "orders", "billing", StartFrom::Earliest)
        .await
        .unwrap(); // v2
    admin::register_group(&mut conn, "orders", "audit", StartFrom::Earliest)
        .await
        .unwrap(); // v3
    let _: String = conn
        .xadd("orders:dlq:billing", "*", &[("shard", "1")])
        .await
        .unwrap();
    support::plant_fence(&mut conn, "{orders:0}:fence", "billing").await;
    let config = short_leases();
    let mut store = group_store(&conn, "orders", "billing", &config);
    let join = store
        .heartbeat(&request("m1", 1, 0, &[]))
        .await
        .unwrap()
        .response;
    assert_eq!(join.status, HeartbeatStatus::Ok);

    let described = admin::describe_group(&mut conn, "orders", "billing", &config)
        .await
        .unwrap();
    assert_eq!(described.dead_letters, 1);
    assert_eq!(described.shards[0].dead_letters, Some(0));
    assert_eq!(described.shards[1].dead_letters, Some(1));

    let err = admin::delete_group(&mut conn, "orders", "billing")
        .await
        .unwrap_err();
    match &err {
        AdminError::GroupActive {
            members, wait_ms, ..
        } => {
            assert_eq!(members, &["m1"]);
            assert!(*wait_ms <= 1200, "{wait_ms}");
        }
        other => panic!("{other:?}"),
    }
    assert!(
        exists(&mut conn, "sl:{orders:billing}:group").await,
        "nothing deleted"
    );

    tokio::time::sleep(Duration::from_millis(1300)).await;
    let deleted = admin::delete_group(&mut conn, "orders", "billing")
        .await
        .unwrap();
    assert!(deleted.unregistered);
    assert_eq!(
        deleted.keys_deleted, 2,
        "group hash and leases (no history yet)"
    );
    assert_eq!(deleted.destroyed_on, vec![0, 1]);
    assert_eq!(deleted.dead_letter_stream, "orders:dlq:billing");
    assert_eq!(deleted.dead_letters, 1);
    assert_eq!(deleted.metadata_version, 4);
    for key in ["sl:{orders:billing}:group", "sl:{orders:billing}:leases"] {
        assert!(!exists(&mut conn, key).await, "{key}");
    }
    let fence: Option<String> = conn.hget("{orders:0}:fence", "billing").await.unwrap();
    assert_eq!(fence, None);
    for i in 0..2 {
        let names: Vec<String> = groups_of(&mut conn, &format!("{{orders:{i}}}"))
            .await
            .into_iter()
            .map(|g| g.0)
            .collect();
        assert_eq!(names, ["audit"]);
    }
    let groups = admin::list_groups(&mut conn, "orders", &config)
        .await
        .unwrap();
    assert_eq!(groups.len(), 1);
    assert_eq!(groups[0].consumer_group, "audit");

    let err = admin::delete_group(&mut conn, "orders", "billing")
        .await
        .unwrap_err();
    assert!(
        matches!(err, AdminError::Store(StoreError::UnknownGroup { .. })),
        "{err:?}"
    );
}

#[tokio::test]
async fn list_streams_reads_the_index_and_skips_vanished_streams() {
    let server = RedisServer::start().unwrap();
    let mut conn = connect(&server).await;
    assert!(admin::list_streams(&mut conn).await.unwrap().is_empty());
    admin::create_stream(&mut conn, "payments", 3)
        .await
        .unwrap();
    admin::create_stream(&mut conn, "orders", 2).await.unwrap();
    admin::register_group(&mut conn, "orders", "billing", StartFrom::Earliest)
        .await
        .unwrap();
    let _: u64 = conn.sadd("sl:streams", "vanished").await.unwrap();

    let listed = admin::list_streams(&mut conn).await.unwrap();
    let summary: Vec<_> = listed
        .iter()
        .map(|s| {
            (
                s.stream_prefix.as_str(),
                s.shard_count,
                s.metadata_version,
                s.groups.clone(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        vec![
            ("orders", Some(2), Some(2), vec!["billing".to_owned()]),
            ("payments", Some(3), Some(1), vec![]),
        ]
    );
}

/// Registrations racing a scale-out: whatever the interleaving, every readable shard ends with
/// the consumer group of every registered group (both re-read under the stream metadata's
/// compare-and-set, docs/design.md §8).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registrations_racing_a_scale_out_leave_no_shard_without_its_group() {
    let server = RedisServer::start().unwrap();
    let conn = connect(&server).await;
    for round in 0..6 {
        let prefix = format!("race{round}");
        let mut setup = conn.clone();
        admin::create_stream(&mut setup, &prefix, 2).await.unwrap();
        let mut tasks = Vec::new();
        for g in 0..6 {
            let mut c = conn.clone();
            let prefix = prefix.clone();
            tasks.push(tokio::spawn(async move {
                admin::register_group(&mut c, &prefix, &format!("g{g}"), StartFrom::Earliest)
                    .await
                    .map(|_| ())
            }));
        }
        let mut c = conn.clone();
        let scaled = prefix.clone();
        tasks.push(tokio::spawn(async move {
            admin::scale(&mut c, &scaled, 8).await.map(|_| ())
        }));
        for task in tasks {
            task.await.unwrap().unwrap();
        }
        let described = admin::describe_stream(&mut setup, &prefix).await.unwrap();
        assert_eq!(described.shard_count, 8);
        assert_eq!(described.groups.len(), 6);
        assert_eq!(
            described.metadata_version, 8,
            "create, 6 registrations, 1 scale-out"
        );
        for shard in &described.shards {
            let mut names: Vec<&str> = shard.groups.iter().map(|g| g.name.as_str()).collect();
            names.sort_unstable();
            assert_eq!(
                names,
                ["g0", "g1", "g2", "g3", "g4", "g5"],
                "{prefix} shard {}",
                shard.shard_index
            );
        }
    }
}
