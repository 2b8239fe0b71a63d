//! Combined full transitions on real Redis (docs/design.md §5.7): full heartbeats queued in the
//! group hash and applied in one batch by whichever requester holds the combiner lease; a dead
//! combiner's lease; requests a batch leaves to their requester; a damaged queue.

mod support;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use redis::AsyncCommands;
use stream_listener::core::internals::connection::{RedisConnection, RedisTarget};
use stream_listener::core::internals::coordinator::{CoordinatorConfig, CoordinatorError};
use stream_listener::core::internals::keys::StreamKeys;
use stream_listener::core::internals::store::{GroupStore, HeartbeatOutcome, StoreError};
use stream_listener::core::model::{HeartbeatRequest, HeartbeatStatus};
use stream_listener::testing::RedisServer;
use stream_listener::testing::fixtures::create_active_stream;
use support::{heartbeat_request, loads, reset_stats};
use tokio::task::JoinHandle;

const SHARDS: u32 = 16;
const GROUP_KEY: &str = "sl:{orders:g}:group";

async fn setup(server: &RedisServer) -> (RedisConnection, GroupStore) {
    let mut conn = support::connect(&RedisTarget::standalone(server.url())).await;
    create_active_stream(&mut conn, "orders", SHARDS).await;
    let stream = StreamKeys::new("orders").unwrap();
    let keys = stream.group("g").unwrap();
    let mut store = GroupStore::new(conn.clone(), stream, keys, CoordinatorConfig::default());
    store.provision(false).await.unwrap();
    (conn, store)
}

fn join(member: &str) -> HeartbeatRequest {
    heartbeat_request(member, "test", 1, (1, 0), &[])
}

/// Redis `TIME` in µs.
async fn redis_now(conn: &mut RedisConnection) -> u64 {
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(conn).await.unwrap();
    secs * 1_000_000 + micros
}

/// Writes the combiner lease as a combiner that stopped would: `combiner` = `<token>|<expiry>`.
async fn hold_lease(conn: &mut RedisConnection, expiry_us: u64) {
    let _: () = conn
        .hset(GROUP_KEY, "combiner", format!("stopped|{expiry_us}"))
        .await
        .unwrap();
}

/// A combiner that is alive but slow: it holds the lease, renewing it every 300 ms for 1.5 s
/// ahead (no requester takes a lease ending more than 2 s ahead, and takes over one that
/// does), until [`release`] stops it and lets the lease run out.
async fn hold_lease_until_released(conn: &RedisConnection) -> JoinHandle<()> {
    let mut conn = conn.clone();
    let now = redis_now(&mut conn).await;
    hold_lease(&mut conn, now + 1_500_000).await;
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(300)).await;
            let now = redis_now(&mut conn).await;
            hold_lease(&mut conn, now + 1_500_000).await;
        }
    })
}

/// Stops [`hold_lease_until_released`] and lets the lease run out (an expiry in the past).
async fn release(holder: JoinHandle<()>, conn: &mut RedisConnection) {
    holder.abort();
    let _ = holder.await;
    hold_lease(conn, 0).await;
}

/// Waits until `count` requests are queued (`reqseq`), polling every 5 ms for up to 10 s.
async fn wait_queued(conn: &mut RedisConnection, count: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let queued: Option<u64> = conn.hget(GROUP_KEY, "reqseq").await.unwrap();
        if queued == Some(count) {
            return;
        }
        assert!(Instant::now() < deadline, "queued {queued:?} of {count}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn spawn_heartbeat(
    store: &GroupStore,
    request: HeartbeatRequest,
) -> JoinHandle<Result<HeartbeatOutcome, StoreError>> {
    let mut store = store.clone();
    tokio::spawn(async move { store.heartbeat(&request).await })
}

/// The queue's fields left in the group hash: `req:`, `resp:` and `combiner`.
async fn queue_fields(conn: &mut RedisConnection) -> Vec<String> {
    let fields: Vec<String> = conn.hkeys(GROUP_KEY).await.unwrap();
    fields
        .into_iter()
        .filter(|f| f.starts_with("req:") || f.starts_with("resp:") || f == "combiner")
        .collect()
}

/// Twenty joins queued behind a stopped combiner's lease are applied by one requester in one
/// batch once the lease has expired: one load for twenty full heartbeats (one each before), every
/// join answered, no shard sent to two members, and the queue left empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_heartbeats_are_applied_in_one_batch_after_a_stopped_combiners_lease() {
    let server = RedisServer::start().unwrap();
    let (mut conn, store) = setup(&server).await;
    let holder = hold_lease_until_released(&conn).await;
    let members: Vec<String> = (0..20).map(|i| format!("m{i:02}")).collect();
    let tasks: Vec<_> = members
        .iter()
        .map(|m| spawn_heartbeat(&store, join(m)))
        .collect();
    wait_queued(&mut conn, 20).await;
    reset_stats(&mut conn).await;
    // The lease runs out (its expiry is in the past now).
    release(holder, &mut conn).await;
    let mut sent = BTreeSet::new();
    for task in tasks {
        let outcome = task.await.unwrap().unwrap();
        assert_eq!(outcome.response.status, HeartbeatStatus::Ok);
        assert!(!outcome.fast_path);
        for shard in outcome.response.assigned_shards {
            assert!(sent.insert(shard), "shard {shard} sent to two members");
        }
    }
    // One batch; two only if a pause of this machine outlived the new combiner's lease.
    let loads = loads(&mut conn).await;
    assert!((1..=2).contains(&loads), "{loads} group loads");
    let mut store = store.clone();
    let loaded = store.load().await.unwrap();
    let joined: Vec<&String> = loaded.group.members.keys().collect();
    assert_eq!(joined, members.iter().collect::<Vec<_>>());
    let answered: Option<u64> = conn.hget(GROUP_KEY, "reqdone").await.unwrap();
    assert_eq!(answered, Some(20));
    assert_eq!(queue_fields(&mut conn).await, Vec::<String>::new());
}

/// A combiner that stops holds the queue up only until its lease expires: the waiting
/// requesters then combine themselves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_combiner_holds_the_queue_up_only_until_its_lease_expires() {
    let server = RedisServer::start().unwrap();
    let (mut conn, store) = setup(&server).await;
    let started = Instant::now();
    let now = redis_now(&mut conn).await;
    hold_lease(&mut conn, now + 400_000).await;
    let tasks: Vec<_> = ["a", "b", "c"]
        .into_iter()
        .map(|m| spawn_heartbeat(&store, join(m)))
        .collect();
    for task in tasks {
        let outcome = task.await.unwrap().unwrap();
        assert_eq!(outcome.response.status, HeartbeatStatus::Ok);
    }
    // No requester can take the lease before Redis `TIME` passes its expiry.
    assert!(started.elapsed() >= Duration::from_millis(400));
    assert_eq!(queue_fields(&mut conn).await, Vec::<String>::new());
}

/// A request the pure coordinator refuses (a shard reported twice) is left to its requester,
/// who gets the coordinator's error; the request queued before it in the same batch is applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_the_batch_refuses_gets_its_own_error_and_the_others_are_applied() {
    let server = RedisServer::start().unwrap();
    let (mut conn, store) = setup(&server).await;
    let holder = hold_lease_until_released(&conn).await;
    let good = spawn_heartbeat(&store, join("a"));
    wait_queued(&mut conn, 1).await;
    let mut malformed = join("b");
    malformed.owned_shards = vec![3, 3];
    let bad = spawn_heartbeat(&store, malformed);
    wait_queued(&mut conn, 2).await;
    release(holder, &mut conn).await;
    let outcome = good.await.unwrap().unwrap();
    assert_eq!(outcome.response.status, HeartbeatStatus::Ok);
    assert_eq!(
        outcome.response.assigned_shards,
        (0..SHARDS).collect::<Vec<_>>()
    );
    match bad.await.unwrap() {
        Err(StoreError::Coordinator(CoordinatorError::DuplicateShard { shard: 3, .. })) => {}
        other => panic!("expected the duplicate shard error, got {other:?}"),
    }
    let mut store = store.clone();
    let loaded = store.load().await.unwrap();
    assert_eq!(loaded.group.members.keys().collect::<Vec<_>>(), ["a"]);
    assert_eq!(queue_fields(&mut conn).await, Vec::<String>::new());
}

/// Queue entries damaged by hand (no request id, timings that do not read) neither stop the
/// queue nor answer anyone wrongly: the first is dropped, the second answered `solo` (nobody
/// collects it), and the heartbeat queued after them is applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damaged_queue_entries_are_dropped_and_the_next_request_is_applied() {
    let server = RedisServer::start().unwrap();
    let (mut conn, store) = setup(&server).await;
    let _: () = redis::cmd("HSET")
        .arg(GROUP_KEY)
        .arg("reqseq")
        .arg(2)
        .arg("req:1")
        .arg("no request id")
        .arg("req:2")
        .arg("feed\nnot timings\n{}")
        .query_async(&mut conn)
        .await
        .unwrap();
    let mut store = store.clone();
    let outcome = store.heartbeat(&join("a")).await.unwrap();
    assert_eq!(outcome.response.status, HeartbeatStatus::Ok);
    assert_eq!(
        outcome.response.assigned_shards,
        (0..SHARDS).collect::<Vec<_>>()
    );
    let answered: Option<u64> = conn.hget(GROUP_KEY, "reqdone").await.unwrap();
    assert_eq!(answered, Some(3));
    let solo: Option<String> = conn.hget(GROUP_KEY, "resp:feed").await.unwrap();
    assert!(
        solo.as_deref().is_some_and(|s| s.ends_with("|solo")),
        "{solo:?}"
    );
    assert_eq!(queue_fields(&mut conn).await, vec!["resp:feed".to_owned()]);
}

/// A queued request that disappears (the hash restored from an older copy, as after a restart
/// from an older snapshot or a failover to a replica behind) is noticed at the next poll: its
/// requester runs its own transition at once, instead of combining an empty queue in a hot loop
/// until its timeout (thousands of group loads a second before the poll checked for it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_lost_from_the_queue_runs_its_own_transition_without_a_hot_loop() {
    let server = RedisServer::start().unwrap();
    let (mut conn, store) = setup(&server).await;
    let holder = hold_lease_until_released(&conn).await;
    let before: Vec<u8> = redis::cmd("DUMP")
        .arg(GROUP_KEY)
        .query_async(&mut conn)
        .await
        .unwrap();
    let join = spawn_heartbeat(&store, join("a"));
    wait_queued(&mut conn, 1).await;
    let _: () = redis::cmd("RESTORE")
        .arg(GROUP_KEY)
        .arg(0)
        .arg(before)
        .arg("REPLACE")
        .query_async(&mut conn)
        .await
        .unwrap();
    reset_stats(&mut conn).await;
    release(holder, &mut conn).await;
    let outcome = tokio::time::timeout(Duration::from_secs(10), join)
        .await
        .expect("answered, not stuck polling")
        .unwrap()
        .unwrap();
    assert_eq!(outcome.response.status, HeartbeatStatus::Ok);
    assert_eq!(
        outcome.response.assigned_shards,
        (0..SHARDS).collect::<Vec<_>>()
    );
    let loads = loads(&mut conn).await;
    assert!(loads <= 2, "{loads} group loads");
}

/// A `reqseq` lost while a request is queued does not let the next request overwrite it: the
/// submit passes over numbers whose `req:` field exists, and both are answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_reqseq_does_not_let_a_request_overwrite_a_queued_one() {
    let server = RedisServer::start().unwrap();
    let (mut conn, store) = setup(&server).await;
    let holder = hold_lease_until_released(&conn).await;
    let a = spawn_heartbeat(&store, join("a"));
    wait_queued(&mut conn, 1).await;
    let _: () = conn.hdel(GROUP_KEY, "reqseq").await.unwrap();
    let b = spawn_heartbeat(&store, join("b"));
    wait_queued(&mut conn, 2).await;
    release(holder, &mut conn).await;
    for task in [a, b] {
        let outcome = tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("answered")
            .unwrap()
            .unwrap();
        assert_eq!(outcome.response.status, HeartbeatStatus::Ok);
    }
    assert_eq!(queue_fields(&mut conn).await, Vec::<String>::new());
}
