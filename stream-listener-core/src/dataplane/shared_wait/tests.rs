//! The shared wait against a real standalone server. Blocks are long (30 s) where a missed
//! interrupt must show: a shard covered late would wait for the whole block, far past the
//! bounds asserted here.

use std::cmp::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;

use super::{SharedWait, WaitEnd, WaitSlot, compare_ids};
use crate::connection::{RedisConnection, RedisTarget};
use crate::testing::RedisServer;

const LONG: Duration = Duration::from_secs(30);
/// Far below [`LONG`], far above a round trip.
const PROMPT: Duration = Duration::from_secs(5);

/// A server that logs every command with its arguments (`SLOWLOG`), a connection to it, and a
/// shared wait whose `XREAD`s block for up to `max_block`.
async fn setup(max_block: Duration) -> (RedisServer, RedisConnection, Arc<SharedWait>) {
    let server = RedisServer::builder()
        .config("slowlog-log-slower-than", "0")
        .config("slowlog-max-len", "100000")
        .start()
        .unwrap();
    let target = RedisTarget::standalone(server.url());
    let conn = RedisConnection::connect(&target, Duration::from_secs(5))
        .await
        .unwrap();
    let wait = SharedWait::new(
        super::WakeSource::Xread,
        target,
        conn.clone(),
        max_block,
        tracing::Span::none(),
    );
    (server, conn, Arc::new(wait))
}

fn key(shard: u32) -> String {
    format!("{{s:{shard}}}")
}

/// A task waiting on `slot` from `last_id` for `block`.
fn waiting(slot: Arc<WaitSlot>, last_id: &str, block: Duration) -> JoinHandle<WaitEnd> {
    let last_id = last_id.to_owned();
    tokio::spawn(async move { slot.wait(&last_id, block).await })
}

async fn xadd(conn: &mut RedisConnection, key: &str) -> String {
    redis::cmd("XADD")
        .arg(key)
        .arg("*")
        .arg("f")
        .arg("v")
        .query_async(conn)
        .await
        .unwrap()
}

/// `calls` of `command` in `INFO commandstats` (`client|unblock` for a subcommand).
async fn calls(conn: &mut RedisConnection, command: &str) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .unwrap();
    let prefix = format!("cmdstat_{command}:calls=");
    info.lines()
        .find_map(|line| line.strip_prefix(prefix.as_str()))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |n| n.parse().unwrap())
}

async fn info_field(conn: &mut RedisConnection, section: &str, field: &str) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg(section)
        .query_async(conn)
        .await
        .unwrap();
    let prefix = format!("{field}:");
    info.lines()
        .find_map(|line| line.strip_prefix(prefix.as_str()))
        .map(|n| n.trim().parse().unwrap())
        .unwrap()
}

/// Waits (bounded) until the server has `n` blocked clients.
async fn until_blocked(conn: &mut RedisConnection, n: u64) {
    let end = tokio::time::Instant::now() + PROMPT;
    while info_field(conn, "clients", "blocked_clients").await != n {
        assert!(tokio::time::Instant::now() < end, "never {n} blocked");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The keys of the most recent `XREAD` the server finished (from the `SLOWLOG`).
async fn last_xread_keys(conn: &mut RedisConnection) -> Vec<String> {
    let log: redis::Value = redis::cmd("SLOWLOG")
        .arg("GET")
        .arg(-1)
        .query_async(conn)
        .await
        .unwrap();
    let redis::Value::Array(entries) = log else {
        panic!("{log:?}")
    };
    for entry in entries {
        let redis::Value::Array(fields) = entry else {
            continue;
        };
        let Some(redis::Value::Array(args)) = fields.get(3) else {
            continue;
        };
        let args: Vec<String> = args
            .iter()
            .map(|a| redis::from_redis_value(a.clone()).unwrap())
            .collect();
        if args
            .first()
            .is_some_and(|c| c.eq_ignore_ascii_case("xread"))
        {
            let streams = args.iter().position(|a| a == "STREAMS").unwrap();
            let keys = &args[streams + 1..];
            return keys[..keys.len() / 2].to_vec();
        }
    }
    panic!("no XREAD in the slow log");
}

#[test]
fn ids_compare_as_numbers() {
    assert_eq!(compare_ids("9-0", "10-0"), Ordering::Less);
    assert_eq!(compare_ids("10-2", "10-10"), Ordering::Less);
    assert_eq!(compare_ids("10-2", "10-2"), Ordering::Equal);
    assert_eq!(compare_ids("0-0", "0"), Ordering::Equal);
}

#[tokio::test]
async fn one_connection_waits_for_64_shards_and_wakes_only_the_one_with_an_entry() {
    let (_server, mut conn, wait) = setup(LONG).await;
    let slots: Vec<Arc<WaitSlot>> = (0..64).map(|s| Arc::new(wait.register(key(s)))).collect();
    let tasks: Vec<_> = slots
        .iter()
        .map(|slot| waiting(slot.clone(), "0-0", LONG))
        .collect();
    until_blocked(&mut conn, 1).await;
    // This test's connection (also the wait's control connection) and the one blocking XREAD.
    assert_eq!(
        info_field(&mut conn, "clients", "connected_clients").await,
        2
    );

    xadd(&mut conn, &key(37)).await;
    let mut tasks = tasks;
    let woken = tasks.remove(37);
    let end = tokio::time::timeout(PROMPT, woken).await.unwrap().unwrap();
    assert_eq!(end, WaitEnd::Woken);
    assert!(
        tasks.iter().all(|t| !t.is_finished()),
        "only shard 37 had an entry"
    );
    assert_eq!(
        info_field(&mut conn, "clients", "connected_clients").await,
        2
    );
}

#[tokio::test]
async fn a_shard_that_starts_waiting_mid_block_is_covered_at_once() {
    let (_server, mut conn, wait) = setup(LONG).await;
    let a = Arc::new(wait.register(key(0)));
    let b = Arc::new(wait.register(key(1)));
    let first = waiting(a, "0-0", LONG);
    until_xread_over(&wait, &mut conn, &[key(0)]).await;
    assert_eq!(calls(&mut conn, "client|unblock").await, 0);

    let second = waiting(b, "0-0", LONG);
    xadd(&mut conn, &key(1)).await;
    let end = tokio::time::timeout(PROMPT, second).await.unwrap().unwrap();
    assert_eq!(end, WaitEnd::Woken);
    assert!(calls(&mut conn, "client|unblock").await >= 1);
    assert!(!first.is_finished());
}

#[tokio::test]
async fn a_shard_that_leaves_is_out_of_the_next_xread() {
    let (_server, mut conn, wait) = setup(LONG).await;
    let a = Arc::new(wait.register(key(0)));
    let b = Arc::new(wait.register(key(1)));
    let first = waiting(a, "0-0", LONG);
    let second = waiting(b.clone(), "0-0", LONG);
    until_xread_over(&wait, &mut conn, &[key(0), key(1)]).await;

    // Revoked: the task's wait is dropped, then its slot.
    second.abort();
    assert!(second.await.unwrap_err().is_cancelled());
    drop(b);
    until_xread_over(&wait, &mut conn, &[key(0)]).await;

    xadd(&mut conn, &key(0)).await;
    let ended = tokio::time::timeout(PROMPT, first).await.unwrap().unwrap();
    assert_eq!(ended, WaitEnd::Woken);
    assert_eq!(last_xread_keys(&mut conn).await, vec![key(0)]);
}

/// Waits (bounded by [`PROMPT`], far below the block) until the wait's `XREAD` in flight covers
/// exactly `keys` and the server has it blocked (the previous one has returned by then).
async fn until_xread_over(wait: &SharedWait, conn: &mut RedisConnection, keys: &[String]) {
    let end = tokio::time::Instant::now() + PROMPT;
    while wait.blocked() != keys || info_field(conn, "clients", "blocked_clients").await != 1 {
        assert!(
            tokio::time::Instant::now() < end,
            "the XREAD in flight covers {:?}, not {keys:?}",
            wait.blocked()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn a_timed_out_wait_keeps_its_key_and_interrupts_nothing() {
    let (_server, mut conn, wait) = setup(LONG).await;
    let slot = Arc::new(wait.register(key(0)));
    for _ in 0..5 {
        let end = waiting(slot.clone(), "0-0", Duration::from_millis(50))
            .await
            .unwrap();
        assert_eq!(end, WaitEnd::TimedOut);
    }
    until_blocked(&mut conn, 1).await;
    // One XREAD (counted when it starts), still blocked, covered all five waits: none
    // interrupted.
    assert_eq!(calls(&mut conn, "xread").await, 1);
    assert_eq!(calls(&mut conn, "client|unblock").await, 0);

    // An entry while the task is not waiting: its next wait from the same id ends at once.
    xadd(&mut conn, &key(0)).await;
    until_blocked(&mut conn, 0).await;
    let ended = tokio::time::timeout(PROMPT, slot.wait("0-0", LONG))
        .await
        .unwrap();
    assert_eq!(ended, WaitEnd::Woken);
}

#[tokio::test]
async fn a_paused_server_wakes_the_waiting_shards() {
    // Blocks of 200 ms: the blocking connection's response timeout is 2 × 200 ms + 1 s.
    let (server, mut conn, wait) = setup(Duration::from_millis(200)).await;
    let slot = Arc::new(wait.register(key(0)));
    let task = waiting(slot, "0-0", LONG);
    until_blocked(&mut conn, 1).await;
    server.pause().unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(10), task).await;
    server.resume().unwrap();
    // Woken (a wake may have been lost), long before its own 30 s.
    assert_eq!(ended.unwrap().unwrap(), WaitEnd::Woken);
}
