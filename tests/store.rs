//! The Redis-recorded coordinator on real Redis (standalone and a 3-master cluster): the heartbeat
//! transaction, its fast path, concurrent drivers, and failing closed on missing or corrupt
//! metadata (docs/design.md §5).

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use redis::AsyncCommands;
use stream_listener::core::internals::connection::{RedisConnection, RedisTarget};
use stream_listener::core::internals::coordinator::{CoordinatorConfig, CoordinatorError};
use stream_listener::core::internals::keys::StreamKeys;
use stream_listener::core::internals::store::{
    GroupStore, StoreError, StreamCas, load_stream_metadata, write_stream_metadata,
};
use stream_listener::core::model::{
    GroupState, HeartbeatRequest, HeartbeatStatus, RevokeState, RevokingShard, ShardInfo,
    ShardState,
};
use stream_listener::testing::fixtures::{create_active_stream, revoking, timings};
use stream_listener::testing::{RedisCluster, RedisServer};
use support::{heartbeat_request, loads, reset_stats};
use tokio::io::AsyncWriteExt;
use tokio::sync::Notify;

const SHARDS: u32 = 16;

async fn connect(target: RedisTarget) -> RedisConnection {
    support::connect(&target).await
}

async fn group_store(conn: &RedisConnection, prefix: &str, group: &str) -> GroupStore {
    let stream = StreamKeys::new(prefix).unwrap();
    let keys = stream.group(group).unwrap();
    let mut store = GroupStore::new(conn.clone(), stream, keys, CoordinatorConfig::default());
    store.provision(false).await.unwrap();
    store
}

fn request(member: &str, seq: u64, epoch: i64, owned: &[u32]) -> HeartbeatRequest {
    heartbeat_request(member, "test", 1, (seq, epoch), owned)
}

/// One member following the protocol: join, then heartbeat `rounds` times, releasing what it is
/// no longer assigned at once. Returns its last requestSeq.
async fn drive_member(mut store: GroupStore, member: String, rounds: u64) -> u64 {
    let mut epoch = 0;
    let mut owned: Vec<u32> = Vec::new();
    let mut revoked: Vec<u32> = Vec::new();
    let mut seq = 0;
    for _ in 0..rounds {
        seq += 1;
        let mut req = request(&member, seq, epoch, &owned);
        req.revoking_shards = revoked
            .iter()
            .map(|s| RevokingShard {
                shard_index: *s,
                state: RevokeState::Revoked,
            })
            .collect();
        let outcome = store.heartbeat(&req).await.unwrap();
        let response = outcome.response;
        match response.status {
            HeartbeatStatus::Ok => {
                epoch = response.member_epoch;
                revoked = owned
                    .iter()
                    .filter(|s| !response.assigned_shards.contains(s))
                    .copied()
                    .collect();
                owned = response.assigned_shards.clone();
            }
            HeartbeatStatus::Retry => {}
            other => panic!("{member}: unexpected {other:?}"),
        }
        tokio::task::yield_now().await;
    }
    seq
}

async fn concurrent_drivers_lose_no_update(conn: RedisConnection, prefix: &str, drivers: usize) {
    let mut conn_for_setup = conn.clone();
    create_active_stream(&mut conn_for_setup, prefix, SHARDS).await;
    let mut tasks = Vec::new();
    for i in 0..drivers {
        let store = group_store(&conn, prefix, "g").await;
        tasks.push(tokio::spawn(drive_member(store, format!("m{i:02}"), 12)));
    }
    let mut last_seqs = Vec::new();
    for task in tasks {
        last_seqs.push(task.await.unwrap());
    }
    // Settle: one more round each, sequentially, so every member reports its final state.
    let mut store = group_store(&conn, prefix, "g").await;
    for _ in 0..3 {
        let loaded = store.load().await.unwrap();
        for (i, last) in last_seqs.iter_mut().enumerate() {
            let id = format!("m{i:02}");
            let member = &loaded.group.members[&id];
            let owned: Vec<u32> = member.assigned_shards.iter().copied().collect();
            *last += 1;
            let mut req = request(&id, *last, member.member_epoch, &owned);
            req.revoking_shards = member
                .current_assignment
                .iter()
                .filter(|s| !member.assigned_shards.contains(s))
                .map(|s| RevokingShard {
                    shard_index: *s,
                    state: RevokeState::Revoked,
                })
                .collect();
            let outcome = store.heartbeat(&req).await.unwrap();
            assert_eq!(outcome.response.status, HeartbeatStatus::Ok);
        }
    }
    let loaded = store.load().await.unwrap();
    let group = &loaded.group;
    assert_eq!(group.members.len(), drivers, "every join was recorded");
    for (i, last) in last_seqs.iter().enumerate() {
        let member = &group.members[&format!("m{i:02}")];
        assert_eq!(
            member.last_request_seq, *last,
            "no lost heartbeat of m{i:02}"
        );
    }
    assert_eq!(group.meta.state, GroupState::Stable);
    let assigned: usize = group
        .meta
        .target_assignment
        .members
        .values()
        .map(|s| s.len())
        .sum();
    assert_eq!(assigned, SHARDS as usize);
    let counts: Vec<usize> = group
        .meta
        .target_assignment
        .members
        .values()
        .map(|s| s.len())
        .collect();
    let (min, max) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
    assert!(max - min <= 1, "balanced: {counts:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_concurrent_drivers_lose_no_update() {
    let server = RedisServer::start().unwrap();
    let conn = connect(RedisTarget::standalone(server.url())).await;
    concurrent_drivers_lose_no_update(conn, "orders", 20).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_concurrent_drivers_lose_no_update_on_a_cluster() {
    let cluster = RedisCluster::start().unwrap();
    let conn = connect(RedisTarget::cluster(cluster.urls())).await;
    concurrent_drivers_lose_no_update(conn, "orders", 20).await;
}

#[tokio::test]
async fn a_steady_member_is_answered_by_the_fast_path_exactly_as_by_the_full_transition() {
    let server = RedisServer::start().unwrap();
    let mut conn = connect(RedisTarget::standalone(server.url())).await;
    create_active_stream(&mut conn, "orders", 4).await;
    let mut store = group_store(&conn, "orders", "g").await;
    let joined = store.heartbeat(&request("a", 1, 0, &[])).await.unwrap();
    assert!(!joined.fast_path);
    let epoch = joined.response.member_epoch;
    let converged = store
        .heartbeat(&request("a", 2, epoch, &[0, 1, 2, 3]))
        .await
        .unwrap();
    assert!(!converged.fast_path);
    assert_eq!(
        store.load().await.unwrap().group.meta.state,
        GroupState::Stable
    );
    let leases = StreamKeys::new("orders")
        .unwrap()
        .group("g")
        .unwrap()
        .leases();
    let lease_before: f64 = conn.zscore(&leases, "a").await.unwrap();
    let steady = store
        .heartbeat(&request("a", 3, epoch, &[0, 1, 2, 3]))
        .await
        .unwrap();
    assert!(steady.fast_path, "a steady heartbeat takes the fast path");
    assert_eq!(steady.response, converged.response);
    let lease_after: f64 = conn.zscore(&leases, "a").await.unwrap();
    assert!(lease_after > lease_before, "the fast path moves the lease");
    // The full transition, forced by a report that differs only in worker activity the fast path
    // ignores... is not needed: a repeated sequence number gets the same answer too.
    let retried = store
        .heartbeat(&request("a", 3, epoch, &[0, 1, 2, 3]))
        .await
        .unwrap();
    assert_eq!(retried.response, converged.response);
    // A stale sequence number is refused.
    let stale = store
        .heartbeat(&request("a", 2, epoch, &[0, 1, 2, 3]))
        .await;
    assert!(
        matches!(stale, Err(StoreError::Coordinator(_))),
        "{stale:?}"
    );
    // A different report goes the full way and the full transition sees the fast path's seq.
    let full = store
        .heartbeat(&request("a", 4, epoch, &[0, 1, 2]))
        .await
        .unwrap();
    assert!(!full.fast_path);
    let member = &store.load().await.unwrap().group.members["a"];
    assert_eq!(member.last_request_seq, 4);
    // The lease the full transition wrote is not older than the fast path's.
    let lease_full: f64 = conn.zscore(&leases, "a").await.unwrap();
    assert!(lease_full >= lease_after);
}

#[tokio::test]
async fn missing_metadata_fails_closed() {
    let server = RedisServer::start().unwrap();
    let mut conn = connect(RedisTarget::standalone(server.url())).await;
    create_active_stream(&mut conn, "orders", 2).await;
    let mut store = group_store(&conn, "orders", "g").await;
    store.heartbeat(&request("a", 1, 0, &[])).await.unwrap();
    let keys = StreamKeys::new("orders").unwrap();
    let _: () = conn.del(keys.group("g").unwrap().metadata()).await.unwrap();
    let err = store.heartbeat(&request("a", 2, 1, &[])).await.unwrap_err();
    assert!(matches!(err, StoreError::MissingGroup { .. }), "{err}");
    assert!(err.to_string().contains("not rebuilt"), "{err}");
    let exists: bool = conn
        .exists(keys.group("g").unwrap().metadata())
        .await
        .unwrap();
    assert!(!exists, "nothing was rebuilt from the member's report");
    let _: () = conn.del(keys.metadata()).await.unwrap();
    let err = store.heartbeat(&request("a", 3, 1, &[])).await.unwrap_err();
    assert!(matches!(err, StoreError::MissingStream { .. }), "{err}");
    assert!(
        err.to_string().contains("stream-listener stream create"),
        "{err}"
    );
}

#[tokio::test]
async fn corrupt_json_is_an_error_not_a_rebuild() {
    let server = RedisServer::start().unwrap();
    let mut conn = connect(RedisTarget::standalone(server.url())).await;
    create_active_stream(&mut conn, "orders", 2).await;
    let mut store = group_store(&conn, "orders", "g").await;
    store.heartbeat(&request("a", 1, 0, &[])).await.unwrap();
    let group_key = StreamKeys::new("orders")
        .unwrap()
        .group("g")
        .unwrap()
        .metadata();
    let _: () = conn
        .hset(&group_key, "member:a", "{not json")
        .await
        .unwrap();
    let err = store.heartbeat(&request("a", 2, 1, &[])).await.unwrap_err();
    assert!(
        matches!(&err, StoreError::CorruptMetadata { field, .. } if field == "member:a"),
        "{err}"
    );
    let stored: String = conn.hget(&group_key, "member:a").await.unwrap();
    assert_eq!(stored, "{not json", "left as found");
    let _: () = conn.hset(&group_key, "schema", "99").await.unwrap();
    let err = store.heartbeat(&request("a", 3, 1, &[])).await.unwrap_err();
    assert!(matches!(err, StoreError::UnknownSchema { .. }), "{err}");
}

#[tokio::test]
async fn redis_unreachable_is_a_clear_error() {
    let server = RedisServer::start().unwrap();
    let mut conn = connect(RedisTarget::standalone(server.url())).await;
    create_active_stream(&mut conn, "orders", 2).await;
    let mut store = group_store(&conn, "orders", "g").await;
    drop(server);
    let err = store.heartbeat(&request("a", 1, 0, &[])).await.unwrap_err();
    assert!(matches!(err, StoreError::Redis(_)), "{err}");
    assert!(err.to_string().contains("check that Redis is up"), "{err}");
}

async fn group_hash_fields(conn: &mut RedisConnection) -> Vec<String> {
    let key = StreamKeys::new("orders")
        .unwrap()
        .group("g")
        .unwrap()
        .metadata();
    let mut fields: Vec<String> = conn.hkeys(&key).await.unwrap();
    fields.sort();
    fields
}

/// A steady member's `activeConsumerWorkers` goes through the fast path (`fastworkers:<id>`),
/// reaches the loaded group, and every field of the member is gone once it leaves.
#[tokio::test]
async fn fast_path_workers_are_stored_and_removed_with_the_member() {
    let server = RedisServer::start().unwrap();
    let mut conn = connect(RedisTarget::standalone(server.url())).await;
    create_active_stream(&mut conn, "orders", 4).await;
    let mut store = group_store(&conn, "orders", "g").await;
    store.heartbeat(&request("b", 1, 0, &[])).await.unwrap();
    let joined = store.heartbeat(&request("a", 1, 0, &[])).await.unwrap();
    let (mut epoch, mut owned) = (
        joined.response.member_epoch,
        joined.response.assigned_shards.clone(),
    );
    let (mut b_epoch, mut b_owned, mut seq, mut fast) = (0, vec![], 1, false);
    for _ in 0..10 {
        seq += 1;
        let mut report = request("a", seq, epoch, &owned);
        report.active_consumer_workers = 5;
        let out = store.heartbeat(&report).await.unwrap();
        fast |= out.fast_path;
        epoch = out.response.member_epoch;
        owned = out.response.assigned_shards.clone();
        let out = store
            .heartbeat(&request("b", seq, b_epoch, &b_owned))
            .await
            .unwrap();
        b_epoch = out.response.member_epoch;
        b_owned = out.response.assigned_shards.clone();
    }
    assert!(fast, "no heartbeat of `a` took the fast path");
    let loaded = store.load().await.unwrap();
    assert_eq!(loaded.group.members["a"].active_consumer_workers, 5);
    assert!(
        group_hash_fields(&mut conn)
            .await
            .contains(&"fastworkers:a".to_string())
    );

    store
        .heartbeat(&request("a", seq + 1, -1, &[]))
        .await
        .unwrap();
    let fields = group_hash_fields(&mut conn).await;
    assert!(
        !fields.iter().any(|f| f.ends_with(":a")),
        "fields of the member that left: {fields:?}"
    );
}

fn store_with(
    conn: &RedisConnection,
    prefix: &str,
    group: &str,
    config: CoordinatorConfig,
) -> GroupStore {
    let stream = StreamKeys::new(prefix).unwrap();
    let keys = stream.group(group).unwrap();
    GroupStore::new(conn.clone(), stream, keys, config)
}

/// docs/design.md §5.5: a group re-provisioned after a loss holds its shards for one lease, and
/// once that instant has passed the fast path answers again within one more lease (the hold
/// used to stay in the `steady` deadline, so every heartbeat fell back, for good).
#[tokio::test]
async fn the_fast_path_answers_again_within_a_lease_after_a_re_provision() {
    let server = RedisServer::start().unwrap();
    let mut conn = connect(RedisTarget::standalone(server.url())).await;
    create_active_stream(&mut conn, "orders", 4).await;
    let config = timings(300, 1_500, 6_000);
    let lease = config.member_lease_ttl;
    let interval = config.heartbeat_interval;
    let mut store = store_with(&conn, "orders", "g", config);
    let provisioned_at = std::time::Instant::now();
    assert!(store.provision(true).await.unwrap(), "created after a loss");
    let (mut seq, mut epoch, mut owned) = (0, 0, Vec::new());
    let mut first_fast = None;
    let mut fast_after = 0;
    let deadline = provisioned_at + lease * 2;
    while std::time::Instant::now() < deadline + interval && fast_after < 3 {
        seq += 1;
        let out = store
            .heartbeat(&request("a", seq, epoch, &owned))
            .await
            .unwrap();
        assert_eq!(out.response.status, HeartbeatStatus::Ok);
        if provisioned_at.elapsed() < lease.mul_f64(0.9) {
            assert!(
                out.response.assigned_shards.is_empty(),
                "nothing is handed out during the hold"
            );
        }
        if out.fast_path {
            first_fast.get_or_insert_with(|| provisioned_at.elapsed());
            fast_after += 1;
        } else {
            assert!(
                first_fast.is_none(),
                "once fast, a steady member stays on the fast path"
            );
        }
        epoch = out.response.member_epoch;
        owned = out.response.assigned_shards.clone();
        tokio::time::sleep(Duration::from_millis(out.response.heartbeat_interval_ms)).await;
    }
    let first_fast = first_fast.expect("the fast path never answered after the hold had passed");
    assert!(
        first_fast <= lease * 2,
        "first fast path {first_fast:?} after the re-provision, more than hold + one lease"
    );
    assert_eq!(owned, vec![0, 1, 2, 3]);
    assert_eq!(fast_after, 3);
    let loaded = store.load().await.unwrap();
    assert_eq!(
        loaded.group.meta.hand_out_not_before, None,
        "the passed hold was cleared"
    );
}

/// What one member saw while heartbeating on the interval its responses gave it.
#[derive(Debug, Default)]
struct Seen {
    heartbeats: usize,
    fast_paths: usize,
    /// Heartbeats and fast paths in the last part of the run, when the group is settled.
    settled: (usize, usize),
    /// Responses whose timings were not the member's own: (fast path, interval ms, lease ms).
    foreign_timings: Vec<(bool, u64, u64)>,
    statuses: Vec<HeartbeatStatus>,
}

/// One member following the protocol with its own store (its own `[coordination]` timings) for
/// `run`, adopting the interval of each response as the runtime does (`member/heartbeat.rs`).
async fn drive_with_own_timings(
    mut store: GroupStore,
    member: &str,
    own: CoordinatorConfig,
    run: Duration,
) -> Seen {
    let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap();
    let (own_interval, own_lease) = (ms(own.heartbeat_interval), ms(own.member_lease_ttl));
    let started = std::time::Instant::now();
    let settled_from = run.mul_f64(0.5);
    let mut seen = Seen::default();
    let (mut seq, mut epoch) = (0, 0);
    let (mut owned, mut revoked): (Vec<u32>, Vec<u32>) = (Vec::new(), Vec::new());
    while started.elapsed() < run {
        seq += 1;
        let mut req = request(member, seq, epoch, &owned);
        req.revoking_shards = revoked
            .drain(..)
            .map(|s| RevokingShard {
                shard_index: s,
                state: RevokeState::Revoked,
            })
            .collect();
        let out = store.heartbeat(&req).await.unwrap();
        let r = &out.response;
        seen.heartbeats += 1;
        seen.fast_paths += usize::from(out.fast_path);
        if started.elapsed() >= settled_from {
            seen.settled.0 += 1;
            seen.settled.1 += usize::from(out.fast_path);
        }
        if (r.heartbeat_interval_ms, r.member_lease_ttl_ms) != (own_interval, own_lease) {
            seen.foreign_timings.push((
                out.fast_path,
                r.heartbeat_interval_ms,
                r.member_lease_ttl_ms,
            ));
        }
        if r.status != HeartbeatStatus::Ok {
            seen.statuses.push(r.status);
        }
        if r.status == HeartbeatStatus::Ok {
            epoch = r.member_epoch;
            revoked = owned
                .iter()
                .filter(|s| !r.assigned_shards.contains(s))
                .copied()
                .collect();
            owned = r.assigned_shards.clone();
        } else if matches!(
            r.status,
            HeartbeatStatus::UnknownMemberId | HeartbeatStatus::FencedMemberEpoch
        ) {
            (epoch, owned) = (0, Vec::new());
        }
        tokio::time::sleep(Duration::from_millis(r.heartbeat_interval_ms.max(1))).await;
    }
    seen
}

/// docs/design.md §6.5: two members of one group run different `[coordination]` timings
/// (1.5 s / 0.3 s and 6 s / 1 s, each its own `GroupStore`). Every response either gets, from
/// the full transition or the fast path, carries its own lease and interval (the fast path's
/// `fast:<id>` entries were written with the timings of whichever member's transition wrote
/// them), and the group stays STABLE with both answered by the fast path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_with_different_timings_are_each_answered_with_their_own() {
    let server = RedisServer::start().unwrap();
    let mut conn = connect(RedisTarget::standalone(server.url())).await;
    create_active_stream(&mut conn, "orders", 8).await;
    let short = timings(300, 1_500, 6_000);
    let long = timings(1_000, 6_000, 20_000);
    let mut a_store = store_with(&conn, "orders", "g", short.clone());
    a_store.provision(false).await.unwrap();
    let b_store = store_with(&conn, "orders", "g", long.clone());
    let run = Duration::from_secs(8);
    let a = tokio::spawn(drive_with_own_timings(a_store, "a", short, run));
    let b = tokio::spawn(drive_with_own_timings(b_store, "b", long, run));
    let (a, b) = (a.await.unwrap(), b.await.unwrap());
    for (name, seen) in [("a", &a), ("b", &b)] {
        assert_eq!(
            seen.foreign_timings,
            vec![],
            "{name} got another member's timings: {seen:?}"
        );
        assert_eq!(seen.statuses, vec![], "{name}: {seen:?}");
        // Settled: (nearly) every heartbeat is answered by the fast path; one may fall back when
        // the other member's lease renewal and a transition race.
        assert!(
            seen.settled.0 >= 3,
            "{name} heartbeated on its own schedule: {seen:?}"
        );
        assert!(
            seen.settled.1 + 1 >= seen.settled.0,
            "{name} stays on the fast path: {seen:?}"
        );
    }
    assert!(
        a.heartbeats > 2 * b.heartbeats,
        "each on its own interval: {a:?} {b:?}"
    );
    // As either member's store loads it: each renewal is its own lease minus its own TTL.
    for config in [timings(300, 1_500, 6_000), timings(1_000, 6_000, 20_000)] {
        let mut store = store_with(&conn, "orders", "g", config);
        let loaded = store.load().await.unwrap();
        assert_eq!(loaded.group.meta.state, GroupState::Stable);
        for (id, lease_ms) in [("a", 1_500), ("b", 6_000)] {
            let member = &loaded.group.members[id];
            assert_eq!(member.member_lease_ttl_ms, lease_ms);
            assert!(
                member.last_heartbeat_at <= loaded.now,
                "{id}: renewal in the future: {member:?}"
            );
            assert!(
                member.member_lease_expires_at <= loaded.now + lease_ms * 1_000,
                "{id}: lease recorded with its own TTL"
            );
        }
    }
}

/// docs/design.md §6.5: the fast path's outage check uses the requester's own lease. Two members
/// with different TTLs (1.5 s and 6 s) and an outage, written into the leases as Redis would see
/// it afterwards: neither renewed for over half its own TTL (1.3 s and 3.5 s ago). The full
/// transition re-arms every lease by the gap; the fast path used to compare the newest lease (the
/// long one) with the requester's short TTL, saw no outage and answered, renewing the requester
/// alone. It must fall back instead.
#[tokio::test]
async fn the_fast_path_falls_back_after_an_outage_whatever_the_other_members_ttl() {
    let server = RedisServer::start().unwrap();
    let mut conn = connect(RedisTarget::standalone(server.url())).await;
    create_active_stream(&mut conn, "orders", 2).await;
    let short = timings(300, 1_500, 6_000);
    let long = timings(1_000, 6_000, 20_000);
    let mut a = store_with(&conn, "orders", "g", short);
    a.provision(false).await.unwrap();
    let mut b = store_with(&conn, "orders", "g", long);
    let ja = a
        .heartbeat(&request("a", 1, 0, &[]))
        .await
        .unwrap()
        .response;
    let ra = a
        .heartbeat(&request("a", 2, ja.member_epoch, &[0, 1]))
        .await
        .unwrap()
        .response;
    let jb = b
        .heartbeat(&request("b", 1, 0, &[]))
        .await
        .unwrap()
        .response;
    let mut req = request("a", 3, ra.member_epoch, &[0]);
    req.revoking_shards = vec![RevokingShard {
        shard_index: 1,
        state: RevokeState::Revoked,
    }];
    let ra = a.heartbeat(&req).await.unwrap().response;
    let rb = b
        .heartbeat(&request("b", 2, jb.member_epoch, &[]))
        .await
        .unwrap()
        .response;
    let rb = b
        .heartbeat(&request("b", 3, rb.member_epoch, &rb.assigned_shards))
        .await
        .unwrap()
        .response;
    let steady = a
        .heartbeat(&request("a", 4, ra.member_epoch, &[0]))
        .await
        .unwrap();
    assert!(steady.fast_path, "settled before the outage");
    let loaded = a.load().await.unwrap();
    assert_eq!(loaded.group.meta.state, GroupState::Stable);
    // The outage, as the leases show it afterwards.
    let now = loaded.now;
    let leases = StreamKeys::new("orders")
        .unwrap()
        .group("g")
        .unwrap()
        .leases();
    let a_lease = now - 1_300_000 + 1_500_000;
    let b_lease = now - 3_500_000 + 6_000_000;
    let _: () = conn.zadd(&leases, "a", a_lease).await.unwrap();
    let _: () = conn.zadd(&leases, "b", b_lease).await.unwrap();
    let after = a
        .heartbeat(&request("a", 5, ra.member_epoch, &[0]))
        .await
        .unwrap();
    assert_eq!(after.response.status, HeartbeatStatus::Ok);
    assert!(
        !after.fast_path,
        "the full transition re-arms after an outage"
    );
    let b_rearmed: f64 = conn.zscore(&leases, "b").await.unwrap();
    assert!(
        b_rearmed as u64 >= b_lease + 1_300_000,
        "b's lease re-armed by the gap: {b_rearmed} < {b_lease} + 1.3 s"
    );
    let rb = b
        .heartbeat(&request("b", 4, rb.member_epoch, &rb.assigned_shards))
        .await
        .unwrap();
    assert_eq!(rb.response.status, HeartbeatStatus::Ok);
}

/// A loopback TCP proxy in front of one Redis server. Once armed, it holds the first chunk a
/// client sends that contains `EVALSHA` (a script call) until released, so a test can run other
/// clients' commands between two commands of one heartbeat.
struct ScriptGate {
    url: String,
    armed: Arc<AtomicBool>,
    holding: Arc<AtomicBool>,
    release: Arc<Notify>,
}

impl ScriptGate {
    async fn start(upstream: String) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("redis://{}", listener.local_addr().unwrap());
        let gate = ScriptGate {
            url,
            armed: Arc::new(AtomicBool::new(false)),
            holding: Arc::new(AtomicBool::new(false)),
            release: Arc::new(Notify::new()),
        };
        let (armed, holding, release) = (
            gate.armed.clone(),
            gate.holding.clone(),
            gate.release.clone(),
        );
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                    return;
                };
                let (mut from_client, mut to_client) = client.into_split();
                let (mut from_server, mut to_server) = server.into_split();
                tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut from_server, &mut to_client).await;
                });
                let (armed, holding, release) = (armed.clone(), holding.clone(), release.clone());
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 * 1024];
                    while let Some(chunk) = support::read_chunk(&mut from_client, &mut buf).await {
                        let script = chunk.windows(7).any(|w| w.eq_ignore_ascii_case(b"EVALSHA"));
                        if script && armed.swap(false, Ordering::SeqCst) {
                            holding.store(true, Ordering::SeqCst);
                            release.notified().await;
                            holding.store(false, Ordering::SeqCst);
                        }
                        if to_server.write_all(chunk).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        gate
    }

    fn arm(&self) {
        self.armed.store(true, Ordering::SeqCst);
    }

    /// Waits (bounded) until a script call is held.
    async fn wait_holding(&self) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !self.holding.load(Ordering::SeqCst) {
            assert!(
                std::time::Instant::now() < deadline,
                "no script call reached the gate within 10 s"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    fn release(&self) {
        self.release.notify_one();
    }
}

/// The stream metadata with `count` ACTIVE shards at `version`, written over the stored one.
async fn rewrite_stream(conn: &mut RedisConnection, prefix: &str, count: u32, version: u64) {
    let keys = StreamKeys::new(prefix).unwrap();
    let mut meta = load_stream_metadata(conn, &keys).await.unwrap().unwrap();
    let revision = meta.revision;
    meta.shard_count = count;
    meta.shards = (0..count)
        .map(|i| ShardInfo {
            shard_index: i,
            state: ShardState::Active,
        })
        .collect();
    meta.metadata_version = version;
    let written = write_stream_metadata(conn, &keys, Some(revision), &mut meta)
        .await
        .unwrap();
    assert_eq!(written, StreamCas::Written);
}

/// docs/design.md §5.4: a heartbeat reads the stream view, then loads the
/// group. When a scale-out and another member's transition land in between, the loaded group
/// has the newer `metadataVersion`; applying the older view took the group's version and
/// readable set back (two `groupEpoch` bumps, the new shards out of the target). The store now
/// reads the view again when the loaded group is newer than it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_view_read_before_a_scale_out_does_not_take_the_group_back() {
    let server = RedisServer::start().unwrap();
    let mut conn = connect(RedisTarget::standalone(server.url())).await;
    create_active_stream(&mut conn, "orders", 2).await;
    let mut b = group_store(&conn, "orders", "g").await;
    let joined = b.heartbeat(&request("b", 1, 0, &[])).await.unwrap();
    let gate = ScriptGate::start(server.addr()).await;
    let gated = connect(RedisTarget::standalone(gate.url.clone())).await;
    let mut a = store_with(&gated, "orders", "g", CoordinatorConfig::default());
    gate.arm();
    // A join skips the fast path: `a` reads the stream version and view (1), then its load
    // waits at the gate.
    let join = tokio::spawn(async move { a.heartbeat(&request("a", 1, 0, &[])).await });
    gate.wait_holding().await;
    rewrite_stream(&mut conn, "orders", 4, 2).await;
    let out = b
        .heartbeat(&request("b", 2, joined.response.member_epoch, &[]))
        .await
        .unwrap();
    assert_eq!(out.response.status, HeartbeatStatus::Ok);
    let applied = b.load().await.unwrap().group.meta;
    assert_eq!(applied.metadata_version, 2, "b applied the scale-out");
    gate.release();
    let out = tokio::time::timeout(Duration::from_secs(10), join)
        .await
        .expect("a's heartbeat ends once released")
        .unwrap()
        .unwrap();
    assert_eq!(out.response.status, HeartbeatStatus::Ok);
    let meta = b.load().await.unwrap().group.meta;
    assert_eq!(
        (meta.metadata_version, meta.shard_count),
        (2, 4),
        "the group went back to the view a read before the scale-out"
    );
    assert_eq!(meta.readable_shard_set, (0..4).collect());
    assert_eq!(meta.group_epoch, applied.group_epoch + 1, "a's join only");
}

/// The other side of follow-up A: stream metadata lost and re-created from config restarts at a
/// lower `metadataVersion`, and the group must follow it (a fresh read still lower than the
/// group's is a restart, not staleness), or the fast path, which compares the stream's version
/// with `steady`'s, falls back for good and the readable set never updates.
#[tokio::test]
async fn a_group_follows_stream_metadata_re_created_at_a_lower_version() {
    let server = RedisServer::start().unwrap();
    let mut conn = connect(RedisTarget::standalone(server.url())).await;
    create_active_stream(&mut conn, "orders", 2).await;
    let config = timings(300, 1_500, 6_000);
    // A correction round (the member reports a version above the re-created one) lasts a lease.
    let settle = config.member_lease_ttl * 3;
    let mut store = store_with(&conn, "orders", "g", config);
    store.provision(false).await.unwrap();
    rewrite_stream(&mut conn, "orders", 4, 5).await;
    let (mut seq, mut epoch, mut owned, mut version) = (0, 0, Vec::new(), 1);
    // Heartbeats on the interval the responses give until one is answered by the fast path
    // (bounded by `settle`); whether one was.
    let mut settle_on_fast_path = async |store: &mut GroupStore| {
        let deadline = std::time::Instant::now() + settle;
        while std::time::Instant::now() < deadline {
            seq += 1;
            let mut req = request("a", seq, epoch, &owned);
            req.metadata_version = version;
            let out = store.heartbeat(&req).await.unwrap();
            // SYNC_METADATA once the member reports a version above the re-created one
            // (evidence of lost metadata: a correction round); it adopts the group's, as the
            // runtime does.
            assert!(
                matches!(
                    out.response.status,
                    HeartbeatStatus::Ok | HeartbeatStatus::SyncMetadata
                ),
                "{out:?}"
            );
            epoch = out.response.member_epoch;
            owned = out.response.assigned_shards.clone();
            version = out.response.metadata_version;
            if out.fast_path {
                return Some(owned.clone());
            }
            tokio::time::sleep(Duration::from_millis(out.response.heartbeat_interval_ms)).await;
        }
        None
    };
    assert_eq!(
        settle_on_fast_path(&mut store).await,
        Some(vec![0, 1, 2, 3]),
        "settled at version 5"
    );
    // Lost, and re-created from config: version 1 again.
    let key = StreamKeys::new("orders").unwrap().metadata();
    let _: () = conn.del(&key).await.unwrap();
    create_active_stream(&mut conn, "orders", 4).await;
    let owned_after = settle_on_fast_path(&mut store).await;
    let meta = store.load().await.unwrap().group.meta;
    assert_eq!((meta.metadata_version, meta.shard_count), (1, 4));
    assert_eq!(
        owned_after,
        Some(vec![0, 1, 2, 3]),
        "the fast path answers again at the re-created version"
    );
    // And the next change of the re-created stream reaches the group.
    rewrite_stream(&mut conn, "orders", 6, 2).await;
    let owned_after = settle_on_fast_path(&mut store).await;
    let meta = store.load().await.unwrap().group.meta;
    assert_eq!((meta.metadata_version, meta.shard_count), (2, 6));
    assert_eq!(meta.readable_shard_set, (0..6).collect());
    assert_eq!(
        owned_after,
        Some(vec![0, 1, 2, 3, 4, 5]),
        "settled again after the scale-out"
    );
}

/// docs/design.md §5.3: a static member away after `-2` has no steady response,
/// and `Writes::diff` left its `fast:<id>`/`fastseq:<id>` of the last steady write in place: a
/// late request sent before the `-2` (its sequence above that `fastseq`, below the `-2`'s)
/// matched the old fingerprint and renewed the lease on the fast path, where the full transition
/// answers `StaleRequestSeq`.
#[tokio::test]
async fn a_late_request_does_not_renew_a_lease_through_an_outdated_fast_entry() {
    let server = RedisServer::start().unwrap();
    let mut conn = connect(RedisTarget::standalone(server.url())).await;
    create_active_stream(&mut conn, "orders", 2).await;
    let mut store = group_store(&conn, "orders", "g").await;
    let static_request = |seq, epoch, owned: &[u32]| HeartbeatRequest {
        instance_id: Some("a-1".into()),
        ..request("a", seq, epoch, owned)
    };
    let joined = store.heartbeat(&static_request(1, 0, &[])).await.unwrap();
    let epoch = joined.response.member_epoch;
    let owned = joined.response.assigned_shards.clone();
    store
        .heartbeat(&static_request(2, epoch, &owned))
        .await
        .unwrap();
    let steady = store
        .heartbeat(&static_request(3, epoch, &owned))
        .await
        .unwrap();
    assert!(steady.fast_path, "settled");
    // Request 4 is delayed; the member leaves statically with request 5.
    let left = store
        .heartbeat(&static_request(5, -2, &owned))
        .await
        .unwrap();
    assert_eq!(left.response.status, HeartbeatStatus::Ok);
    let leases = StreamKeys::new("orders")
        .unwrap()
        .group("g")
        .unwrap()
        .leases();
    let lease_before: f64 = conn.zscore(&leases, "a").await.unwrap();
    let late = store.heartbeat(&static_request(4, epoch, &owned)).await;
    assert!(
        matches!(
            late,
            Err(StoreError::Coordinator(CoordinatorError::StaleRequestSeq {
                got: 4,
                last: 5
            }))
        ),
        "the late request 4 after 5: {late:?}"
    );
    let lease_after: f64 = conn.zscore(&leases, "a").await.unwrap();
    assert_eq!(
        lease_after, lease_before,
        "the late request moved the lease"
    );
    let fields = group_hash_fields(&mut conn).await;
    assert!(
        !fields
            .iter()
            .any(|f| f.starts_with("fast") && f.ends_with(":a")),
        "fast-path fields of a member without a steady response: {fields:?}"
    );
    let member = &store.load().await.unwrap().group.members["a"];
    assert_eq!(member.last_request_seq, 5);
    assert!(member.away);
}

/// A full transition writes the members it changed, not every member (docs/design.md §5.1): a
/// member it left as loaded keeps its stored JSON, and loads the same afterwards (its lease and
/// sequence from the fast path included). Rewriting every member made each transition's work grow
/// with the group.
#[tokio::test]
async fn a_full_transition_leaves_the_members_it_did_not_change_as_stored() {
    let server = RedisServer::start().unwrap();
    let mut conn = connect(RedisTarget::standalone(server.url())).await;
    create_active_stream(&mut conn, "orders", 4).await;
    let mut store = group_store(&conn, "orders", "g").await;
    let key = StreamKeys::new("orders")
        .unwrap()
        .group("g")
        .unwrap()
        .metadata();
    // Both members join and converge.
    let (mut a, mut b) = ((1, 0, vec![]), (1, 0, vec![]));
    for _ in 0..4 {
        for (id, (seq, epoch, owned)) in [("a", &mut a), ("b", &mut b)] {
            let out = store
                .heartbeat(&request(id, *seq, *epoch, owned))
                .await
                .unwrap();
            *seq += 1;
            *epoch = out.response.member_epoch;
            *owned = out.response.assigned_shards.clone();
        }
    }
    assert_eq!(
        store.load().await.unwrap().group.meta.state,
        GroupState::Stable
    );
    // `b` heartbeats on the fast path: its lease and `fastseq:b` move, `member:b` does not.
    for _ in 0..2 {
        let out = store
            .heartbeat(&request("b", b.0, b.1, &b.2))
            .await
            .unwrap();
        assert!(out.fast_path, "b is steady");
        b.0 += 1;
    }
    let b_loaded = store.load().await.unwrap().group.members["b"].clone();
    assert_eq!(b_loaded.last_request_seq, b.0 - 1);
    let (a_json, b_json): (String, String) = (
        conn.hget(&key, "member:a").await.unwrap(),
        conn.hget(&key, "member:b").await.unwrap(),
    );
    // `a` reports one shard fewer than it was assigned: a full transition that changes `a` only.
    let fewer = &a.2[..a.2.len() - 1];
    let out = store
        .heartbeat(&request("a", a.0, a.1, fewer))
        .await
        .unwrap();
    assert!(!out.fast_path);
    let (a_after, b_after): (String, String) = (
        conn.hget(&key, "member:a").await.unwrap(),
        conn.hget(&key, "member:b").await.unwrap(),
    );
    assert_ne!(a_after, a_json, "the changed member is written");
    assert_eq!(
        b_after, b_json,
        "the member the transition left as loaded is not rewritten"
    );
    let b_reloaded = store.load().await.unwrap().group.members["b"].clone();
    assert_eq!(b_reloaded, b_loaded, "and it loads as before");
}

/// One protocol-following member of [`converged_members_stay_on_the_fast_path_while_others_reconcile`].
struct Follower {
    id: String,
    seq: u64,
    epoch: i64,
    owned: Vec<u32>,
}

impl Follower {
    /// Sends the member's next heartbeat (releasing at once what it is no longer assigned) and
    /// adopts the answer.
    async fn beat(&mut self, store: &mut GroupStore) -> (bool, Vec<u32>) {
        self.seq += 1;
        let mut req = request(&self.id, self.seq, self.epoch, &self.owned);
        let outcome = store.heartbeat(&req).await.unwrap();
        let response = outcome.response;
        assert_eq!(response.status, HeartbeatStatus::Ok, "{}", self.id);
        let released: Vec<u32> = self
            .owned
            .iter()
            .filter(|s| !response.assigned_shards.contains(s))
            .copied()
            .collect();
        self.epoch = response.member_epoch;
        self.owned = response.assigned_shards.clone();
        if !released.is_empty() {
            self.seq += 1;
            req = request(&self.id, self.seq, self.epoch, &self.owned);
            req.revoking_shards = revoking(&released, RevokeState::Revoked);
            store.heartbeat(&req).await.unwrap();
        }
        (outcome.fast_path, response.pending_shards)
    }
}

/// docs/design.md §5.3: the fast path answers a converged member whatever the group's state, so
/// in a large group a join sends only the members it concerns to the full transition. Five
/// members on 16 shards: the fifth takes three shards from three of the four, and the fourth,
/// whose target is unchanged, stays on the fast path while the others reconcile; its answer
/// carries the group's epochs of now (stored once, in `steady`).
#[tokio::test]
async fn converged_members_stay_on_the_fast_path_while_others_reconcile() {
    let server = RedisServer::start().unwrap();
    let mut conn = connect(RedisTarget::standalone(server.url())).await;
    create_active_stream(&mut conn, "orders", 16).await;
    let mut store = group_store(&conn, "orders", "g").await;
    let follower = |id: &str| Follower {
        id: id.to_owned(),
        seq: 0,
        epoch: 0,
        owned: vec![],
    };
    let mut members: Vec<Follower> = ["a", "b", "c", "d"].into_iter().map(follower).collect();
    for _ in 0..4 {
        for m in &mut members {
            m.beat(&mut store).await;
        }
    }
    let group = store.load().await.unwrap().group;
    assert_eq!(group.meta.state, GroupState::Stable);
    let before = group.meta.target_assignment.members.clone();

    let mut e = follower("e");
    let (_, pending) = e.beat(&mut store).await;
    assert_eq!(pending.len(), 3, "e waits for three shards to be released");
    let group = store.load().await.unwrap().group;
    assert_eq!(group.meta.state, GroupState::Reconciling);
    let after = &group.meta.target_assignment.members;
    let unchanged: Vec<&str> = ["a", "b", "c", "d"]
        .into_iter()
        .filter(|id| before.get(*id) == after.get(*id))
        .collect();
    assert_eq!(unchanged.len(), 1, "one member keeps its four shards");
    for m in &mut members {
        let (fast, _) = m.beat(&mut store).await;
        assert_eq!(
            fast,
            unchanged.contains(&m.id.as_str()),
            "{} on the fast path",
            m.id
        );
    }
    // The untouched member's answer on the fast path, mid-rebalance, with the epochs of now.
    let keeper = members.iter_mut().find(|m| m.id == unchanged[0]).unwrap();
    keeper.seq += 1;
    let out = store
        .heartbeat(&request(
            &keeper.id,
            keeper.seq,
            keeper.epoch,
            &keeper.owned,
        ))
        .await
        .unwrap();
    let group = store.load().await.unwrap().group;
    assert!(out.fast_path);
    assert_eq!(
        (out.response.group_epoch, out.response.assignment_epoch),
        (group.meta.group_epoch, group.meta.assignment_epoch)
    );
    assert_eq!(out.response.assigned_shards, keeper.owned);
}

/// docs/design.md §5.1, §5.3: a full transition commits while members it does not write renew on
/// the fast path between its load and its compare-and-set. Before, the compare-and-set checked
/// one `leaseRevision` that every fast-path renewal bumped, so in a large group that stayed on
/// the fast path while others reconciled, a join lost attempt after attempt (here: 3 s and
/// dozens of group loads, against one). 40 members own the 40 shards and renew on the fast path
/// as fast as Redis answers; a 41st joins, which changes no one's target (its quota is 0), so
/// only the join's own batch loads the group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_commits_while_other_members_renew_on_the_fast_path() {
    let server = RedisServer::start().unwrap();
    let mut conn = connect(RedisTarget::standalone(server.url())).await;
    create_active_stream(&mut conn, "orders", 40).await;
    let mut store = group_store(&conn, "orders", "g").await;
    let mut members: Vec<Follower> = (0..40)
        .map(|i| Follower {
            id: format!("m{i:02}"),
            seq: 0,
            epoch: 0,
            owned: vec![],
        })
        .collect();
    for _ in 0..4 {
        for m in &mut members {
            m.beat(&mut store).await;
        }
    }
    assert_eq!(
        store.load().await.unwrap().group.meta.state,
        GroupState::Stable
    );
    let stop = Arc::new(AtomicBool::new(false));
    let hammer = {
        let mut store = group_store(&conn, "orders", "g").await;
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut full = 0u32;
            let mut fast = 0u32;
            let deadline = std::time::Instant::now() + Duration::from_secs(20);
            while !stop.load(Ordering::Relaxed) && std::time::Instant::now() < deadline {
                for m in &mut members {
                    let (on_fast_path, _) = m.beat(&mut store).await;
                    if on_fast_path {
                        fast += 1;
                    } else {
                        full += 1;
                    }
                }
            }
            (fast, full)
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    reset_stats(&mut conn).await;
    let joined = tokio::time::timeout(
        Duration::from_secs(10),
        store.heartbeat(&request("joiner", 1, 0, &[])),
    )
    .await
    .expect("the join is answered")
    .unwrap();
    let join_loads = loads(&mut conn).await;
    stop.store(true, Ordering::Relaxed);
    let (fast, full) = hammer.await.unwrap();
    assert_eq!(joined.response.status, HeartbeatStatus::Ok);
    assert!(joined.response.assigned_shards.is_empty());
    assert_eq!(full, 0, "no one's target changed");
    assert!(
        fast > 100,
        "the others renewed on the fast path meanwhile ({fast})"
    );
    assert_eq!(join_loads, 1, "one load, one compare-and-set");
    let group = store.load().await.unwrap().group;
    assert!(group.members.contains_key("joiner"));
}

/// A correction round reads this group's fence of every shard (docs/design.md §6.6). On a
/// cluster the fences live in their shards' slots, and one pipeline across slots is refused
/// (`CrossSlot`): every heartbeat of the round failed, so a cluster group that lost its
/// coordination data never got out of it (found by review: members re-provisioning after
/// Redis lost its data report epochs and versions the new group does not know).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_correction_round_reads_the_fences_on_a_cluster() {
    let cluster = RedisCluster::start().unwrap();
    let mut conn = connect(RedisTarget::cluster(cluster.urls())).await;
    create_active_stream(&mut conn, "orders", 6).await;
    let mut store = store_with(&conn, "orders", "g", timings(300, 1_500, 6_000));
    store.provision(false).await.unwrap();
    // A stream version above the stream's: evidence of lost metadata.
    let mut req = request("a", 1, 0, &[]);
    req.metadata_version = 5;
    let out = store
        .heartbeat(&req)
        .await
        .expect("the correction round reads the fences");
    // The round holds every shard back until it ends (a lease).
    assert_eq!(
        out.response.status,
        HeartbeatStatus::RevokePending,
        "{out:?}"
    );
    assert_eq!(out.response.pending_shards, (0..6).collect::<Vec<u32>>());
    let group = store.load().await.unwrap().group;
    assert!(group.meta.correction_round.is_some(), "{:?}", group.meta);
}
