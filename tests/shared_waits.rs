//! Shared waits (docs/design.md §8.4): a member waits for new entries on all its caught-up
//! shards with one blocking `XREAD` on one connection, so its connections do not grow with its
//! shards. On a standalone server:
//!
//! - 4 members on 512 shards hold at most 4 × (1 node + 2) = 12 connections, and an entry on any
//!   shard wakes its member at once;
//! - a revoked shard leaves its member's wait at once;
//! - a member owning 1,000 shards runs within 256 file descriptors.
//!
//! On a 3-master cluster, with `notify-keyspace-events Kt`, members wait with keyspace
//! notifications: 4 members on 512 shards hold at most 4 × (3 + 2) = 20 connections, an entry
//! on any shard wakes its member, and a master paused mid-wait does not stop the others.
//!
//! The block is 20 s in these tests: a shard missing from its member's wait would be read only
//! when the block ends, far past the bounds asserted (5 s).

mod support;

use std::time::{Duration, Instant};

use stream_listener::core::internals::admin;
use stream_listener::core::internals::connection::{RedisConnection, RedisTarget};
use stream_listener::testing::RedisCluster;
use stream_listener::testing::fixtures::last_xread_keys;
use support::*;

/// Far below the tests' 20 s block, far above a round trip and a handler call.
const PROMPT: Duration = Duration::from_secs(5);
const BLOCK: Duration = Duration::from_secs(20);

/// Waits (bounded) until the server has `n` blocked clients: every member idle in its one
/// `XREAD`.
async fn until_blocked(conn: &mut RedisConnection, n: u64, deadline: Duration) {
    let end = Instant::now() + deadline;
    loop {
        let blocked = info_number(conn, "clients", "blocked_clients").await;
        if blocked == n {
            return;
        }
        assert!(Instant::now() < end, "{blocked} blocked clients, not {n}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Publishes one entry to each of `shards` in turn and waits until it is handled; returns the
/// longest time from publish to handler call.
async fn each_wakes_its_member(
    server: &stream_listener::testing::RedisServer,
    recorder: &std::sync::Arc<Recorder>,
    shards: &[u32],
) -> Duration {
    let mut sync = server.client().get_connection().unwrap();
    each_wakes_its_member_over(&mut sync, recorder, shards).await
}

/// [`each_wakes_its_member`], publishing over `sync`.
async fn each_wakes_its_member_over(
    sync: &mut redis::Connection,
    recorder: &std::sync::Arc<Recorder>,
    shards: &[u32],
) -> Duration {
    let mut longest = Duration::ZERO;
    for (n, &shard) in shards.iter().enumerate() {
        let published = xadd_sync(sync, shard, n as u64);
        let sent = Instant::now();
        let handled = wait_until(PROMPT, || {
            recorder.handled().contains(&(shard, published.id.clone()))
        })
        .await;
        assert!(
            handled,
            "the entry on shard {shard} was not handled within {PROMPT:?}"
        );
        longest = longest.max(sent.elapsed());
    }
    longest
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_members_on_512_shards_hold_twelve_connections_at_most_and_wake_on_any_shard() {
    let (_serial, server, target, mut conn, recorder) = Context::serial(512).await.parts();
    let mut opts = options(4);
    opts.block = BLOCK;
    let listener = start_recording(&target, &recorder, opts, Duration::ZERO).await;
    settle(&mut conn, 4, Duration::from_secs(60)).await;
    until_blocked(&mut conn, 4, Duration::from_secs(30)).await;

    // This test's own connection is one of them.
    let connections = info_number(&mut conn, "clients", "connected_clients").await - 1;
    eprintln!("4 members on 512 shards: {connections} connections");
    assert!(
        connections <= 12,
        "{connections} connections (at most 4 × (1 + 2))"
    );

    let shards = [0, 37, 128, 255, 256, 300, 411, 511];
    let longest = each_wakes_its_member(&server, &recorder, &shards).await;
    eprintln!("longest publish-to-handler time: {longest:?}");
    listener.shutdown_and_wait().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_shard_leaves_its_members_wait_at_once() {
    let (_serial, server, target, mut conn, recorder) = Context::serial(8).await.parts();
    let mut opts = options(1);
    opts.block = BLOCK;
    let first = start_recording(&target, &recorder, opts.clone(), Duration::ZERO).await;
    let group = settle(&mut conn, 1, Duration::from_secs(20)).await;
    let first_id = group.members[0].member_id.clone();
    until_blocked(&mut conn, 1, PROMPT).await;

    let second = start_recording(&target, &recorder, opts, Duration::ZERO).await;
    let group = settle(&mut conn, 2, Duration::from_secs(20)).await;
    let kept: Vec<u32> = target_shards(&group, &first_id);
    assert_eq!(kept.len(), 4, "{group:#?}");
    until_blocked(&mut conn, 2, PROMPT).await;

    // Log every command with its arguments: the XREAD an entry on a kept shard ends names the
    // shards the first member waits on now.
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("slowlog-log-slower-than")
        .arg(0)
        .query_async(&mut conn)
        .await
        .unwrap();
    each_wakes_its_member(&server, &recorder, &kept[..1]).await;
    let waited_on = last_xread_keys(&mut conn).await;
    let kept_keys: Vec<String> = kept.iter().map(|s| format!("{{{STREAM}:{s}}}")).collect();
    let mut sorted = waited_on.clone();
    sorted.sort();
    let mut expected = kept_keys.clone();
    expected.sort();
    assert_eq!(
        sorted, expected,
        "the first member's XREAD covered {waited_on:?}"
    );
    second.shutdown_and_wait().await.expect("clean shutdown");
    first.shutdown_and_wait().await.expect("clean shutdown");
}

/// The soft limit on open files of this test process is lowered to 256 (`prlimit`) while one
/// member takes over and waits on 1,000 shards, then restored. The server counts the
/// connections: with a connection per idle shard the member could not open them (and would
/// fall back to polling), here it needs a handful.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_owning_1000_shards_runs_within_256_file_descriptors() {
    let (_serial, server, target, mut conn, recorder) = Context::serial(1000).await.parts();
    let limit = FileLimit::lower_to(256);
    let mut opts = options(1);
    opts.block = BLOCK;
    let listener = start_recording(&target, &recorder, opts, Duration::ZERO).await;
    settle(&mut conn, 1, Duration::from_secs(60)).await;
    until_blocked(&mut conn, 1, Duration::from_secs(30)).await;
    let open = std::fs::read_dir("/proc/self/fd").unwrap().count();
    let connections = info_number(&mut conn, "clients", "connected_clients").await - 1;
    eprintln!("1 member on 1000 shards: {connections} connections, {open} open files");
    assert!(
        connections <= 3,
        "{connections} connections (at most 1 × (1 + 2))"
    );
    each_wakes_its_member(&server, &recorder, &[1, 499, 999]).await;
    listener.shutdown_and_wait().await.expect("clean shutdown");
    drop(limit);
}

/// docs/design.md §8.12: a member whose own data-plane connection cannot be made (the server's
/// `maxclients` leaves room for the listener's process connection alone) reads and acks on the
/// process's connection. Before, the member renewed its shards there and never read them: every
/// shard task retried the connection every 500 ms for as long as the limit held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_without_room_for_its_own_connection_reads_on_the_process_connection() {
    let (_serial, server, target, mut conn, recorder) = Context::serial(4).await.parts();
    let mut sync = server.client().get_connection().unwrap();
    // This test's two connections, and one more: the listener's process connection.
    let connected = info_number(&mut conn, "clients", "connected_clients").await;
    set_maxclients(&mut conn, connected + 1).await;
    let mut opts = options(1);
    opts.block = Duration::from_millis(500);
    let listener = start_recording(&target, &recorder, opts, Duration::ZERO).await;
    settle(&mut conn, 1, Duration::from_secs(30)).await;
    each_wakes_its_member_over(&mut sync, &recorder, &[0, 1, 2, 3]).await;
    set_maxclients(&mut conn, 10_000).await;
    listener.shutdown_and_wait().await.expect("clean shutdown");
}

/// `CONFIG SET maxclients n` on this test's own connection (a new one may be refused).
async fn set_maxclients(conn: &mut RedisConnection, n: u64) {
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxclients")
        .arg(n)
        .query_async(conn)
        .await
        .unwrap();
}

/// This process's soft `RLIMIT_NOFILE`, lowered with `prlimit(1)` and restored when dropped.
struct FileLimit {
    soft: String,
}

impl FileLimit {
    fn lower_to(soft: u32) -> FileLimit {
        let before = std::process::Command::new("prlimit")
            .args([
                "--pid",
                &std::process::id().to_string(),
                "--nofile",
                "--raw",
                "--noheadings",
                "--output=SOFT",
            ])
            .output()
            .expect("prlimit(1) runs");
        assert!(before.status.success(), "{before:?}");
        let limit = FileLimit {
            soft: String::from_utf8(before.stdout).unwrap().trim().to_owned(),
        };
        limit.set(&soft.to_string());
        limit
    }

    fn set(&self, soft: &str) {
        let status = std::process::Command::new("prlimit")
            .args([
                "--pid",
                &std::process::id().to_string(),
                &format!("--nofile={soft}:"),
            ])
            .status()
            .expect("prlimit(1) runs");
        assert!(status.success());
    }
}

impl Drop for FileLimit {
    fn drop(&mut self) {
        self.set(&self.soft);
    }
}

/// The clients connected to each node of `cluster`, summed.
fn cluster_clients(cluster: &RedisCluster) -> u64 {
    cluster
        .nodes()
        .iter()
        .map(|node| {
            let mut sync = node.client().get_connection().unwrap();
            let info: String = redis::cmd("INFO").arg("clients").query(&mut sync).unwrap();
            let count: u64 = info
                .lines()
                .find_map(|l| l.strip_prefix("connected_clients:"))
                .unwrap()
                .trim()
                .parse()
                .unwrap();
            // This connection.
            count - 1
        })
        .sum()
}

/// Publishes one entry to each of `shards` through the cluster and waits until it is handled.
async fn each_wakes_its_member_on(
    conn: &mut RedisConnection,
    recorder: &std::sync::Arc<Recorder>,
    shards: &[u32],
) {
    for &shard in shards {
        let id = xadd_fields(conn, shard, &[("key", "k"), ("payload", r#"{"n":1}"#)]).await;
        let handled =
            wait_until(PROMPT, || recorder.handled().contains(&(shard, id.clone()))).await;
        assert!(
            handled,
            "the entry on shard {shard} was not handled within {PROMPT:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_four_members_on_512_shards_wait_with_keyspace_notifications() {
    let _serial = SERIAL.lock().await;
    let cluster = RedisCluster::start().unwrap();
    cluster.notify_keyspace_events().unwrap();
    let target = RedisTarget::cluster(cluster.urls());
    let mut conn = connect(&target).await;
    admin::create_stream(&mut conn, STREAM, 512).await.unwrap();
    let before = cluster_clients(&cluster);
    let recorder = std::sync::Arc::new(Recorder::default());
    let mut opts = options(4);
    opts.block = BLOCK;
    let listener = start_recording(&target, &recorder, opts, Duration::ZERO).await;
    settle(&mut conn, 4, Duration::from_secs(90)).await;
    // Every shard read once more under the new subscriptions and dropped its own connection.
    let end = Instant::now() + Duration::from_secs(30);
    let mut connections = cluster_clients(&cluster) - before;
    while connections > 20 && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(200)).await;
        connections = cluster_clients(&cluster) - before;
    }
    eprintln!("4 members on 512 shards of a 3-master cluster: {connections} connections");
    assert!(
        connections <= 20,
        "{connections} connections (at most 4 × (3 + 2))"
    );

    each_wakes_its_member_on(&mut conn, &recorder, &[0, 37, 128, 255, 300, 511]).await;

    // A master paused mid-wait (shorter than the cluster's node timeout: no failover): the
    // shards of the other masters still wake at once, and its own once it is back.
    // The paused master holds neither the stream's metadata nor the group's keys, so heartbeats
    // go on.
    let coordination = [
        cluster
            .master_of_key(&format!("sl:{{{STREAM}}}:stream"))
            .unwrap(),
        cluster
            .master_of_key(&format!("sl:{{{STREAM}:{GROUP}}}:group"))
            .unwrap(),
    ];
    let masters: Vec<usize> = (0..512)
        .map(|s| cluster.master_of_key(&format!("{{{STREAM}:{s}}}")).unwrap())
        .collect();
    let paused = *masters
        .iter()
        .find(|m| !coordination.contains(m))
        .expect("a master without coordination keys");
    let shard_on =
        |pick: &dyn Fn(usize) -> bool| (0..512u32).find(|s| pick(masters[*s as usize])).unwrap();
    let on_paused = shard_on(&|m| m == paused);
    let elsewhere = shard_on(&|m| m != paused);
    cluster.pause_node(paused).unwrap();
    each_wakes_its_member_on(&mut conn, &recorder, &[elsewhere]).await;
    cluster.resume_node(paused).unwrap();
    each_wakes_its_member_on(&mut conn, &recorder, &[on_paused]).await;
    listener.shutdown_and_wait().await.expect("clean shutdown");
}

/// On every master, the subscribers of each shard's keyspace channel and the pattern
/// subscriptions: `(PUBSUB NUMSUB of each channel, PUBSUB NUMPAT)` per master.
fn keyspace_subscribers(cluster: &RedisCluster, shards: u32) -> Vec<(Vec<i64>, i64)> {
    (0..cluster.nodes().len())
        .filter(|&i| cluster.is_master(i).unwrap_or(false))
        .map(|i| {
            let mut sync = cluster.node(i).unwrap().client().get_connection().unwrap();
            let mut numsub = redis::cmd("PUBSUB");
            numsub.arg("NUMSUB");
            for shard in 0..shards {
                numsub.arg(format!("__keyspace@0__:{{{STREAM}:{shard}}}"));
            }
            let pairs: Vec<(String, i64)> = numsub.query(&mut sync).unwrap();
            let numpat: i64 = redis::cmd("PUBSUB").arg("NUMPAT").query(&mut sync).unwrap();
            (pairs.into_iter().map(|(_, n)| n).collect(), numpat)
        })
        .collect()
}

/// Waits (bounded) until, on every master, each shard's channel has exactly one subscriber
/// (its owner) and there is no pattern subscription.
async fn until_each_channel_has_its_owner_only(cluster: &RedisCluster, shards: u32) {
    let end = Instant::now() + Duration::from_secs(15);
    loop {
        let seen = keyspace_subscribers(cluster, shards);
        if seen
            .iter()
            .all(|(numsub, numpat)| *numpat == 0 && numsub.iter().all(|&n| n == 1))
        {
            return;
        }
        assert!(
            Instant::now() < end,
            "subscribers per shard channel and pattern subscriptions, per master: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Each shard's `xadd` events go to the one member that owns it, also after a rebalance
/// (docs/design.md §8.4). With a pattern over the prefix every entry went to every member of
/// every group of the stream: on a busy stream the members drowned in events (BENCHMARKS.md
/// item 2: the publish-to-handler p50 went to seconds at half the peak rate).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_a_shards_keyspace_events_go_to_its_owner_only() {
    let _serial = SERIAL.lock().await;
    let shards = 8;
    let cluster = RedisCluster::start().unwrap();
    cluster.notify_keyspace_events().unwrap();
    let target = RedisTarget::cluster(cluster.urls());
    let mut conn = connect(&target).await;
    admin::create_stream(&mut conn, STREAM, shards)
        .await
        .unwrap();
    let recorder = std::sync::Arc::new(Recorder::default());
    let mut opts = options(2);
    opts.block = BLOCK;
    let first = start_recording(&target, &recorder, opts.clone(), Duration::ZERO).await;
    settle(&mut conn, 2, Duration::from_secs(60)).await;
    until_each_channel_has_its_owner_only(&cluster, shards).await;
    let all: Vec<u32> = (0..shards).collect();
    each_wakes_its_member_on(&mut conn, &recorder, &all).await;

    // Two more members: half the shards move, and their channels with them.
    let second = start_recording(&target, &recorder, opts, Duration::ZERO).await;
    settle(&mut conn, 4, Duration::from_secs(60)).await;
    until_each_channel_has_its_owner_only(&cluster, shards).await;
    each_wakes_its_member_on(&mut conn, &recorder, &all).await;
    second.shutdown_and_wait().await.expect("clean shutdown");
    first.shutdown_and_wait().await.expect("clean shutdown");
}
