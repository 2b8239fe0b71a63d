//! Admin operations on a real 3-master Redis Cluster: the main flow of create, register,
//! scale-out, scale-in with pending entries, retirement, describe, list and group delete runs
//! with every key in its own slot and no CROSSSLOT error (docs/design.md §2, §10).

mod support;

use std::time::Duration;

use redis::AsyncCommands;
use redis::streams::StreamInfoGroupsReply;
use stream_listener::core::internals::admin::{self, ScaleAction, WaitReason};
use stream_listener::core::internals::connection::{RedisConnection, RedisTarget};
use stream_listener::core::internals::coordinator::CoordinatorConfig;
use stream_listener::core::model::{GroupState, ShardState, StartFrom};
use stream_listener::testing::RedisCluster;

async fn group_names(conn: &mut RedisConnection, key: &str) -> Vec<String> {
    let reply: StreamInfoGroupsReply = conn.xinfo_groups(key).await.unwrap();
    let mut names: Vec<String> = reply.groups.into_iter().map(|g| g.name).collect();
    names.sort();
    names
}

async fn read_all(conn: &mut RedisConnection, key: &str, group: &str) -> Vec<String> {
    support::read_new(conn, key, group, 100).await
}

#[tokio::test]
async fn main_admin_flow_on_a_cluster() {
    let cluster = RedisCluster::start().unwrap();
    let mut conn = support::connect(&RedisTarget::cluster(cluster.urls())).await;
    let config = CoordinatorConfig::default();

    let created = admin::create_stream(&mut conn, "orders", 4).await.unwrap();
    assert!(created.created);
    assert!(
        !admin::create_stream(&mut conn, "orders", 4)
            .await
            .unwrap()
            .created
    );
    for group in ["audit", "billing"] {
        let registration = admin::register_group(&mut conn, "orders", group, StartFrom::Earliest)
            .await
            .unwrap();
        assert!(registration.registered);
    }
    for i in 0..4 {
        assert_eq!(
            group_names(&mut conn, &format!("{{orders:{i}}}")).await,
            ["audit", "billing"]
        );
    }

    let out = admin::scale(&mut conn, "orders", 6).await.unwrap();
    assert_eq!(out.action, ScaleAction::ScaleOut);
    assert_eq!(out.provisioned, vec![4, 5]);
    assert_eq!(out.metadata_version, 4);
    for i in [4, 5] {
        assert_eq!(
            group_names(&mut conn, &format!("{{orders:{i}}}")).await,
            ["audit", "billing"]
        );
    }

    for i in [4, 5] {
        let _: String = conn
            .xadd(format!("{{orders:{i}}}"), "1-1", &[("n", "1")])
            .await
            .unwrap();
    }
    support::plant_fence(&mut conn, "{orders:4}:fence", "billing").await;
    let inward = admin::scale(&mut conn, "orders", 4).await.unwrap();
    assert_eq!(inward.draining, vec![4, 5]);
    assert_eq!(inward.metadata_version, 5);

    // billing reads shard 4 without acking; audit has read nothing anywhere.
    let delivered = read_all(&mut conn, "{orders:4}", "billing").await;
    assert_eq!(delivered, ["1-1"]);
    let report = admin::retire_drained(&mut conn, "orders", Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(report.metadata_version, 5);
    let reasons: Vec<_> = report.shards.iter().map(|s| s.waiting.clone()).collect();
    assert_eq!(
        reasons,
        vec![
            Some(WaitReason::UnreadEntries {
                group: "audit".into(),
                next_id: "1-1".into()
            }),
            Some(WaitReason::UnreadEntries {
                group: "audit".into(),
                next_id: "1-1".into()
            }),
        ]
    );
    for i in [4, 5] {
        let key = format!("{{orders:{i}}}");
        for group in ["audit", "billing"] {
            let ids = read_all(&mut conn, &key, group).await;
            if !ids.is_empty() {
                let _: u64 = conn.xack(&key, group, &ids).await.unwrap();
            }
        }
    }
    let report = admin::retire_drained(&mut conn, "orders", Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(
        report.shards[0].waiting,
        Some(WaitReason::Pending {
            group: "billing".into(),
            pending: 1
        })
    );
    assert_eq!(report.shards[1].state, ShardState::Retired);
    assert_eq!(report.readable_shard_set, vec![0, 1, 2, 3, 4]);
    let _: u64 = conn
        .xack("{orders:4}", "billing", &delivered)
        .await
        .unwrap();
    let report = admin::retire_drained(&mut conn, "orders", Duration::ZERO)
        .await
        .unwrap();
    assert!(report.migration_complete);
    assert_eq!(report.readable_shard_set, vec![0, 1, 2, 3]);
    assert_eq!(report.metadata_version, 9);
    for key in ["{orders:4}", "{orders:4}:fence", "{orders:5}"] {
        let exists: bool = conn.exists(key).await.unwrap();
        assert!(!exists, "{key}");
    }

    let stream = admin::describe_stream(&mut conn, "orders").await.unwrap();
    assert_eq!(stream.shard_count, 4);
    assert_eq!(stream.shards.len(), 6);
    assert_eq!(stream.shards[4].state, ShardState::Retired);
    let group = admin::describe_group(&mut conn, "orders", "billing", &config)
        .await
        .unwrap();
    assert_eq!(group.state, GroupState::Empty);
    assert_eq!(group.shards.len(), 4);
    assert!(group.shards.iter().all(|s| s.consumer_group_exists));
    let listed = admin::list_streams(&mut conn).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].groups, ["audit", "billing"]);
    assert_eq!(
        admin::list_groups(&mut conn, "orders", &config)
            .await
            .unwrap()
            .len(),
        2
    );

    let deleted = admin::delete_group(&mut conn, "orders", "audit")
        .await
        .unwrap();
    assert!(deleted.unregistered);
    assert_eq!(deleted.destroyed_on, vec![0, 1, 2, 3]);
    for i in 0..4 {
        assert_eq!(
            group_names(&mut conn, &format!("{{orders:{i}}}")).await,
            ["billing"]
        );
    }

    // Scale-in and cancel across slots too.
    admin::scale(&mut conn, "orders", 2).await.unwrap();
    let cancelled = admin::cancel_scale(&mut conn, "orders").await.unwrap();
    assert_eq!(cancelled.reactivated, vec![2, 3]);
}
