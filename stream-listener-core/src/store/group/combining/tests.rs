//! The combiner lease against a real server (docs/design.md §5.7): a combiner releases only its
//! own lease. One whose lease expired while it worked (paused, slow) and passed to another must
//! leave the new holder's lease in place, or a third requester takes it and two combine at once.

use redis::AsyncCommands;

use super::{COMBINER, encode_timings};
use crate::connection::{RedisConnection, RedisTarget};
use crate::coordinator::CoordinatorConfig;
use crate::keys::StreamKeys;
use crate::store::GroupStore;
use crate::store::scripts;
use crate::testing::RedisServer;
use crate::testing::fixtures::{create_active_stream, heartbeat_request};

const GROUP_KEY: &str = "sl:{orders:g}:group";
const LATE: &str = "late";

async fn setup() -> (RedisServer, RedisConnection, GroupStore) {
    let server = RedisServer::start().unwrap();
    let target = RedisTarget::standalone(server.url());
    let mut conn = RedisConnection::connect(&target, std::time::Duration::from_secs(5))
        .await
        .unwrap();
    create_active_stream(&mut conn, "orders", 4).await;
    let stream = StreamKeys::new("orders").unwrap();
    let keys = stream.group("g").unwrap();
    let mut store = GroupStore::new(conn.clone(), stream, keys, CoordinatorConfig::default());
    store.provision(false).await.unwrap();
    (server, conn, store)
}

/// Queues a join of `member` with request id `id`, taking the combiner lease as `LATE`, as
/// `GroupStore::combined` does.
async fn submit_as_late_combiner(conn: &mut RedisConnection, member: &str, id: &str) {
    let request = heartbeat_request(member, "test", 1, (1, 0), &[]);
    let entry = format!(
        "{}\n{}",
        encode_timings(&CoordinatorConfig::default()),
        serde_json::to_string(&request).unwrap()
    );
    let reply: Vec<String> = scripts::group_submit()
        .key(GROUP_KEY)
        .arg(id)
        .arg(entry)
        .arg(LATE)
        .arg(1_500_000)
        .arg(4096)
        .invoke_async(conn)
        .await
        .unwrap();
    assert_eq!(reply[..2], ["1", "1"], "queued, with the lease");
}

/// Writes the lease as another requester's that took it over after `LATE`'s expired.
async fn hand_the_lease_to_another(conn: &mut RedisConnection) -> String {
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(conn).await.unwrap();
    let lease = format!("other|{}", secs * 1_000_000 + micros + 1_500_000);
    let _: () = conn.hset(GROUP_KEY, COMBINER, &lease).await.unwrap();
    lease
}

async fn lease_now(conn: &mut RedisConnection) -> Option<String> {
    conn.hget(GROUP_KEY, COMBINER).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_leaves_the_lease_that_another_combiner_took_since() {
    let (_server, mut conn, mut store) = setup().await;
    submit_as_late_combiner(&mut conn, "a", "req-a").await;
    let other = hand_the_lease_to_another(&mut conn).await;
    let mut stream = store.read_stream_view(None).await.unwrap();
    store.combine(LATE, &mut stream).await.unwrap();
    let answered: bool = conn.hexists(GROUP_KEY, "resp:req-a").await.unwrap();
    assert!(answered, "the batch was applied");
    assert_eq!(lease_now(&mut conn).await, Some(other));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_combiner_that_finds_the_queue_empty_leaves_another_combiners_lease() {
    let (_server, mut conn, mut store) = setup().await;
    let other = hand_the_lease_to_another(&mut conn).await;
    let mut stream = store.read_stream_view(None).await.unwrap();
    store.combine(LATE, &mut stream).await.unwrap();
    assert_eq!(lease_now(&mut conn).await, Some(other));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_releases_its_own_lease() {
    let (_server, mut conn, mut store) = setup().await;
    submit_as_late_combiner(&mut conn, "a", "req-a").await;
    let mut stream = store.read_stream_view(None).await.unwrap();
    store.combine(LATE, &mut stream).await.unwrap();
    assert_eq!(lease_now(&mut conn).await, None);
}
