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
use crate::testing::fixtures::{command_calls as calls, last_xread_keys};

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

/// A randomized stress of the driver against a real standalone server: 12 shard "tasks" that act
/// as the poller does (read the stream's last id, wait from it; on a time-out wait again from the
/// same id without a read; sometimes busy between the read and the wait; sometimes revoked: the
/// slot dropped and a new one registered, at times before the old one is gone; sometimes the
/// wait is cut short), while entries arrive on random shards. Every entry must be seen by a read
/// within [`STRESS_BOUND`] of its `XADD` (the `XREAD`s block for 30 s: a lost wake shows as a
/// late entry). `STRESS_SEED=<n>` replays a run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stress_every_entry_is_seen_promptly() {
    let (_server, conn, wait) = setup(LONG).await;
    let target = RedisTarget::standalone(_server.url());
    stress(wait, conn, target, None).await;
}

/// The same stress on a 3-master cluster with keyspace notifications (tasks fall back to their
/// own `XREAD` on `Unavailable`), every subscription killed every 2 s (each master's
/// `CLIENT KILL TYPE pubsub`: the driver subscribes again, a new generation).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stress_on_a_cluster_with_subscriptions_killed_every_two_seconds() {
    stress_on_a_cluster(None).await;
}

/// FINDING: the same with only the first master's subscription killed (every 2 s): the driver's
/// `select_all` drops that subscription silently and never subscribes again (the wait stays
/// available, the masters are the same), so that master's shards are never woken: their entries
/// are seen only when a wait is cut short (here) or never (a poller whose waits time out waits
/// again without a read).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stress_on_a_cluster_with_one_masters_subscription_killed() {
    stress_on_a_cluster(Some(0)).await;
}

/// [`stress`] on a 3-master cluster; every 2 s the pubsub clients of `only` (a node index) or of
/// every node are killed.
async fn stress_on_a_cluster(only: Option<usize>) {
    let cluster = crate::testing::RedisCluster::start().unwrap();
    cluster.notify_keyspace_events().unwrap();
    let target = RedisTarget::cluster(cluster.urls());
    let conn = RedisConnection::connect(&target, Duration::from_secs(5))
        .await
        .unwrap();
    let wait = Arc::new(SharedWait::new(
        super::WakeSource::Keyspace,
        target.clone(),
        conn.clone(),
        LONG,
        tracing::Span::none(),
    ));
    let clients: Vec<redis::Client> = cluster
        .nodes()
        .iter()
        .enumerate()
        .filter(|(i, _)| only.is_none_or(|only| only == *i))
        .map(|(_, n)| n.client())
        .collect();
    let kill = move || {
        for client in &clients {
            if let Ok(mut sync) = client.get_connection() {
                let _: redis::RedisResult<redis::Value> = redis::cmd("CLIENT")
                    .arg("KILL")
                    .arg("TYPE")
                    .arg("pubsub")
                    .query(&mut sync);
            }
        }
    };
    stress(wait, conn, target, Some(Box::new(kill))).await;
}

const STRESS_BOUND: Duration = Duration::from_secs(1);

async fn stress(
    wait: Arc<SharedWait>,
    mut conn: RedisConnection,
    target: RedisTarget,
    fault: Option<Box<dyn Fn() + Send + Sync>>,
) {
    use rand::{Rng, SeedableRng};
    use std::collections::HashMap;
    use std::sync::Mutex;
    use tokio::time::Instant;

    const SHARDS: u32 = 12;
    let seed: u64 = std::env::var("STRESS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("STRESS_SEED={seed}");
    // Per key: (id, when a read saw it) for every read.
    type Seen = HashMap<String, Vec<(String, Instant)>>;
    let seen: Arc<Mutex<Seen>> = Arc::default();
    let stop = tokio_util::sync::CancellationToken::new();
    let fell_back = Arc::new(std::sync::atomic::AtomicU64::new(0));

    async fn last_id(conn: &mut RedisConnection, key: &str) -> String {
        let v: redis::Value = redis::cmd("XREVRANGE")
            .arg(key)
            .arg("+")
            .arg("-")
            .arg("COUNT")
            .arg(1)
            .query_async(conn)
            .await
            .unwrap();
        match v {
            redis::Value::Array(entries) => match entries.first() {
                Some(redis::Value::Array(entry)) => {
                    redis::from_redis_value(entry[0].clone()).unwrap()
                }
                _ => "0-0".to_owned(),
            },
            other => panic!("{other:?}"),
        }
    }

    let mut tasks = Vec::new();
    for shard in 0..SHARDS {
        let wait = wait.clone();
        let seen = seen.clone();
        let stop = stop.clone();
        let target = target.clone();
        let fell_back = fell_back.clone();
        let mut conn = conn.clone();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ u64::from(shard));
        tasks.push(tokio::spawn(async move {
            let key = key(shard);
            let mut slot = Some(Arc::new(wait.register(key.clone())));
            let mut old: Option<Arc<WaitSlot>> = None;
            let mut own: Option<super::Waiter> = None;
            while !stop.is_cancelled() {
                // A read: everything up to the stream's last entry is seen now.
                let last = last_id(&mut conn, &key).await;
                seen.lock()
                    .unwrap()
                    .entry(key.clone())
                    .or_default()
                    .push((last.clone(), Instant::now()));
                // Sometimes busy (handling) before waiting.
                if rng.random_bool(0.3) {
                    tokio::time::sleep(Duration::from_millis(rng.random_range(0..20))).await;
                }
                // Sometimes revoked and taken over again: a new registration; the old one
                // lingers for a while (a draining task) or goes at once.
                if rng.random_bool(0.05) {
                    old = slot.take();
                    slot = Some(Arc::new(wait.register(key.clone())));
                    if rng.random_bool(0.5) {
                        old = None;
                    }
                    // The new task reads first.
                    continue;
                }
                if rng.random_bool(0.1) {
                    old = None;
                }
                let current = slot.clone().unwrap();
                loop {
                    if stop.is_cancelled() {
                        return;
                    }
                    let block = Duration::from_millis(rng.random_range(1..300));
                    // Sometimes the wait is cut short (the task's select on revoke/stop).
                    let end = if rng.random_bool(0.05) {
                        let cut = Duration::from_millis(rng.random_range(0..50));
                        match tokio::time::timeout(cut, current.wait(&last, block)).await {
                            Ok(end) => end,
                            Err(_) => WaitEnd::Woken,
                        }
                    } else {
                        current.wait(&last, block).await
                    };
                    match end {
                        WaitEnd::Woken => break,
                        WaitEnd::TimedOut => {}
                        WaitEnd::Delivered(_) | WaitEnd::ReadPending => {
                            unreachable!("a wait without a gate never reads")
                        }
                        WaitEnd::Unavailable => {
                            // The poller's `wait_alone`.
                            fell_back.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            if own.is_none() {
                                own = Some(super::Waiter::connect(&target, LONG).await.unwrap());
                            }
                            let shards = [(key.clone(), last.clone())];
                            match own.as_mut().unwrap().wait(&shards, block).await {
                                Ok(woken) if woken.is_empty() => {}
                                _ => break,
                            }
                        }
                    }
                }
                let _ = &old;
            }
        }));
    }

    // Entries on random shards, sometimes in bursts, for 15 s; the fault every 2 s.
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut published: Vec<(String, String, Instant)> = Vec::new();
    let end = Instant::now() + Duration::from_secs(15);
    let mut next_fault = Instant::now() + Duration::from_secs(2);
    let fault: Option<Arc<dyn Fn() + Send + Sync>> = fault.map(Arc::from);
    while Instant::now() < end {
        if let Some(fault) = &fault
            && Instant::now() >= next_fault
        {
            next_fault += Duration::from_secs(2);
            let fault = fault.clone();
            tokio::task::spawn_blocking(move || fault()).await.unwrap();
        }
        let burst = if rng.random_bool(0.1) {
            rng.random_range(2..6)
        } else {
            1
        };
        for _ in 0..burst {
            let k = key(rng.random_range(0..SHARDS));
            // Before the XADD: a read may see the entry before its reply comes back.
            let sent = Instant::now();
            let id = xadd(&mut conn, &k).await;
            published.push((k, id, sent));
        }
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..40))).await;
    }
    tokio::time::sleep(STRESS_BOUND + Duration::from_millis(200)).await;
    stop.cancel();
    let seen = seen.lock().unwrap().clone();
    let mut late = Vec::new();
    let mut worst = Duration::ZERO;
    for (k, id, at) in &published {
        let first = seen
            .get(k)
            .into_iter()
            .flatten()
            .filter(|(s, when)| *when >= *at && compare_ids(s, id) != Ordering::Less)
            .map(|(_, when)| *when)
            .min();
        match first {
            Some(when) => {
                let latency = when - *at;
                worst = worst.max(latency);
                if latency > STRESS_BOUND {
                    late.push((k.clone(), id.clone(), latency));
                }
            }
            None => late.push((k.clone(), id.clone(), Duration::MAX)),
        }
    }
    eprintln!(
        "{} entries, worst latency {worst:?}, {} fallback waits",
        published.len(),
        fell_back.load(std::sync::atomic::Ordering::Relaxed)
    );
    assert!(late.is_empty(), "seed {seed}: late or never seen: {late:?}");
    for task in tasks {
        let _ = task.await;
    }
}

/// A connection to `cluster` and a shared wait woken by its keyspace notifications.
async fn keyspace_wait(cluster: &crate::testing::RedisCluster) -> (RedisConnection, SharedWait) {
    let target = RedisTarget::cluster(cluster.urls());
    let conn = RedisConnection::connect(&target, Duration::from_secs(5))
        .await
        .unwrap();
    let wait = SharedWait::new(
        super::WakeSource::Keyspace,
        target,
        conn.clone(),
        LONG,
        tracing::Span::none(),
    );
    (conn, wait)
}

/// `shard` registered with `wait` and an entry added to it; its first wait, which reads once
/// after the subscription, ends; then a task waits from that entry (asserted still waiting
/// 100 ms later). Returns the shard's slot and that task.
async fn waiting_after_its_first_read(
    wait: &SharedWait,
    conn: &mut RedisConnection,
    shard: &str,
) -> (Arc<WaitSlot>, JoinHandle<WaitEnd>) {
    let slot = Arc::new(wait.register(shard.to_owned()));
    let id = xadd(conn, shard).await;
    assert_eq!(
        tokio::time::timeout(PROMPT, slot.wait(&id, LONG)).await,
        Ok(WaitEnd::Woken)
    );
    let task = waiting(slot.clone(), &id, LONG);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!task.is_finished(), "the wait ended without an entry");
    (slot, task)
}

/// `PUBSUB NUMSUB` of `key`'s keyspace channel, summed over the cluster's nodes.
fn channel_subscribers(cluster: &crate::testing::RedisCluster, key: &str) -> i64 {
    cluster
        .nodes()
        .iter()
        .map(|node| {
            let mut sync = node.client().get_connection().unwrap();
            let (_, n): (String, i64) = redis::cmd("PUBSUB")
                .arg("NUMSUB")
                .arg(format!("__keyspace@0__:{key}"))
                .query(&mut sync)
                .unwrap();
            n
        })
        .sum()
}

/// Waits (bounded by [`PROMPT`]) until `key`'s channel has `n` subscribers over the cluster.
async fn until_channel_subscribers(cluster: &crate::testing::RedisCluster, key: &str, n: i64) {
    let end = tokio::time::Instant::now() + PROMPT;
    loop {
        let seen = channel_subscribers(cluster, key);
        if seen == n {
            return;
        }
        assert!(
            tokio::time::Instant::now() < end,
            "{key}: {seen} subscribers, not {n}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Keyspace notifications (docs/design.md §8.4): an event that finds the shard's task not
/// waiting (reading, handling) marks the shard busy and its channel is unsubscribed, so a busy
/// shard's entries send no event each; the task's next wait that blocks subscribes it again and
/// is woken to read once (an entry may have come meanwhile), and after that an entry wakes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_a_busy_shards_channel_is_unsubscribed_until_its_task_waits_again() {
    let cluster = crate::testing::RedisCluster::start().unwrap();
    cluster.notify_keyspace_events().unwrap();
    let masters = (0..cluster.nodes().len())
        .filter(|&i| cluster.is_master(i).unwrap())
        .count() as i64;
    let (mut conn, wait) = keyspace_wait(&cluster).await;
    let shard = key(0);
    let slot = Arc::new(wait.register(shard.clone()));
    // The first wait waits for the subscription, which wakes it to read once.
    let first = xadd(&mut conn, &shard).await;
    assert_eq!(
        tokio::time::timeout(PROMPT, slot.wait(&first, LONG)).await,
        Ok(WaitEnd::Woken)
    );
    until_channel_subscribers(&cluster, &shard, masters).await;

    // An entry while the task is not waiting: busy, the channel is unsubscribed.
    let second = xadd(&mut conn, &shard).await;
    until_channel_subscribers(&cluster, &shard, 0).await;
    // The event was kept: the next wait ends at once (the task reads).
    assert_eq!(
        tokio::time::timeout(PROMPT, slot.wait(&second, LONG)).await,
        Ok(WaitEnd::Woken)
    );
    // Caught up, the task waits: subscribed again, and woken to read once.
    assert_eq!(
        tokio::time::timeout(PROMPT, slot.wait(&second, LONG)).await,
        Ok(WaitEnd::Woken)
    );
    assert_eq!(channel_subscribers(&cluster, &shard), masters);
    // Now it blocks, and an entry wakes it.
    let task = waiting(slot.clone(), &second, LONG);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!task.is_finished(), "the wait ended without an entry");
    xadd(&mut conn, &shard).await;
    assert_eq!(
        tokio::time::timeout(PROMPT, task).await.unwrap().unwrap(),
        WaitEnd::Woken
    );
}

/// Keyspace notifications: a master that stops answering (SIGSTOP) while the driver changes the
/// member's channels (here a new shard registers: `SUBSCRIBE` on every master) must not hold up
/// the other masters' shards: the change gives up after a bound, and their waits end (here
/// `Unavailable`: they wait on connections of their own until the subscriptions are back).
/// Without the bound the driver waited for the paused master's confirmation, and no event,
/// timeout or wake reached any shard of the member.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_a_paused_master_does_not_hold_up_the_other_masters_shards() {
    let cluster = crate::testing::RedisCluster::start().unwrap();
    cluster.notify_keyspace_events().unwrap();
    let master_of = |k: &str| cluster.master_of_key(k).unwrap();
    // A shard on one master, and a master without it to pause.
    let healthy = key(0);
    let paused = (0..cluster.nodes().len())
        .find(|&i| cluster.is_master(i).unwrap() && i != master_of(&healthy))
        .unwrap();
    let (mut conn, wait) = keyspace_wait(&cluster).await;
    let (_slot, task) = waiting_after_its_first_read(&wait, &mut conn, &healthy).await;

    cluster.pause_node(paused).unwrap();
    let newcomer = waiting(Arc::new(wait.register(key(1))), "0-0", LONG);
    tokio::time::sleep(Duration::from_millis(100)).await;
    xadd(&mut conn, &healthy).await;
    let ended = tokio::time::timeout(PROMPT, task).await;
    cluster.resume_node(paused).unwrap();
    let end = ended
        .expect("the healthy master's shard waited on")
        .unwrap();
    assert!(
        matches!(end, WaitEnd::Woken | WaitEnd::Unavailable),
        "{end:?}"
    );
    newcomer.abort();
}

/// Keyspace notifications turned off and on again between two of the driver's checks
/// (docs/design.md §8.4): an entry added while they were off sent no event, and a check that
/// only asked for the configuration would find it as before. The driver counts each master's
/// `CONFIG SET` calls, and when they changed it subscribes again, so the waiting shards read
/// once: the entry is read at the next check, not when the shard's next entry comes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_an_entry_added_while_notifications_were_briefly_off_is_read() {
    let cluster = crate::testing::RedisCluster::start().unwrap();
    cluster.notify_keyspace_events().unwrap();
    let (mut conn, wait) = keyspace_wait(&cluster).await;
    let shard = key(0);
    let (_slot, task) = waiting_after_its_first_read(&wait, &mut conn, &shard).await;

    cluster.set_notify_keyspace_events("").unwrap();
    xadd(&mut conn, &shard).await;
    cluster.set_notify_keyspace_events("Kt").unwrap();
    let end = tokio::time::timeout(super::keyspace::TOPOLOGY_CHECK + PROMPT, task)
        .await
        .expect("the entry added while the notifications were off was never announced")
        .unwrap();
    // Woken by the new subscription, or sent to a connection of its own if a check fell in
    // the moment they were off: either way it reads.
    assert!(
        matches!(end, WaitEnd::Woken | WaitEnd::Unavailable),
        "{end:?}"
    );
}

/// A master that stops answering while the driver runs its periodic check of the masters and
/// their configuration (every 5 s, docs/design.md §8.4) must not hold up the shards of the
/// other masters: the check runs beside the events, not in their way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_a_master_paused_across_the_periodic_checks_does_not_hold_up_the_others() {
    // No failover while the master is paused: the check must cope with a silent master.
    let cluster = crate::testing::RedisCluster::builder()
        .node_timeout(Duration::from_secs(120))
        .start()
        .unwrap();
    cluster.notify_keyspace_events().unwrap();
    let healthy = key(0);
    let paused = (0..cluster.nodes().len())
        .find(|&i| cluster.is_master(i).unwrap() && i != cluster.master_of_key(&healthy).unwrap())
        .unwrap();
    let (mut conn, wait) = keyspace_wait(&cluster).await;
    let slot = Arc::new(wait.register(healthy.clone()));
    let mut last = xadd(&mut conn, &healthy).await;
    assert_eq!(
        tokio::time::timeout(PROMPT, slot.wait(&last, LONG)).await,
        Ok(WaitEnd::Woken)
    );

    cluster.pause_node(paused).unwrap();
    let started = tokio::time::Instant::now();
    let mut slowest = Duration::ZERO;
    // Across two checks, every entry on the healthy master ends its shard's wait at once.
    while started.elapsed() < super::keyspace::TOPOLOGY_CHECK * 2 + Duration::from_secs(1) {
        let task = waiting(slot.clone(), &last, LONG);
        tokio::time::sleep(Duration::from_millis(200)).await;
        let added = tokio::time::Instant::now();
        last = xadd(&mut conn, &healthy).await;
        let end = tokio::time::timeout(PROMPT, task).await;
        slowest = slowest.max(added.elapsed());
        let Ok(Ok(end)) = end else {
            cluster.resume_node(paused).unwrap();
            panic!("the healthy master's shard waited on past {PROMPT:?}");
        };
        assert!(
            matches!(end, WaitEnd::Woken | WaitEnd::Unavailable),
            "{end:?}"
        );
    }
    cluster.resume_node(paused).unwrap();
    assert!(
        slowest < Duration::from_millis(500),
        "an entry on the healthy master waited {slowest:?}"
    );
}
