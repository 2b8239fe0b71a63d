//! Members that die or lose Redis (docs/design.md §5, §6.7 member rules, §8):
//!
//! - a member killed without leaving — in process (`ListenerHandle::abort`) and as a real OS
//!   process (`SIGKILL`) — has its shards processed by the others within lease TTL plus two
//!   heartbeat intervals of the kill, and nothing is lost;
//! - Redis frozen (`SIGSTOP`) for longer than the lease: no handler starts once the members'
//!   leases have ended, and when Redis comes back they recover: everything is handled and the
//!   group is STABLE again.
//!
//! - on a Redis Cluster, a read that ran but whose reply was lost (the connection dropped after
//!   Redis executed it) is not sent again: nothing is stranded in the member's own pending list,
//!   nothing lost, per-key order kept (docs/design.md §8.10); likewise with a master frozen past
//!   the client's response timeout while reads run, and on a standalone server (whose
//!   `ConnectionManager` never re-sent a command: not a defect there);
//! - a master restarted without persistence: the shard streams it lost are provisioned again by
//!   the member (`auto_create_shards`, ACTIVE shards only) and read.
//!
//! Timings: heartbeat 200 ms, lease 1.5 s, rebalance timeout 3 s, 8 shards, 200 msg/s.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use stream_listener::core::internals::admin;
use stream_listener::core::internals::connection::RedisTarget;
use stream_listener::core::internals::dataplane::FencingMode;
use stream_listener::core::model::{GroupState, MemberState};
use stream_listener::testing::{RedisCluster, RedisServer};
use support::*;

/// Scheduling slack granted on top of the protocol bound (lease TTL + 2 heartbeats = 1.9 s): the
/// takeover itself (fence raise, claim, first read: a few Redis round trips) plus the delays of a
/// loaded 2-core machine running Redis, this test and a member process. Measured takeovers are
/// printed by the test; the expected worst case without load is lease + 1.1 heartbeat + ~50 ms.
const TAKEOVER_SLACK: Duration = Duration::from_millis(600);

enum Crash {
    /// `ListenerHandle::abort` of an in-process listener.
    Abort,
    /// `SIGKILL` of a member process (a `workload consume` child).
    Kill,
}

async fn killed_member_shards_move_within_lease_plus_two_heartbeats(crash: Crash) {
    let (_serial, server, target, mut conn, recorder) = Context::serial(8).await.parts();

    let survivor = start_recording(&target, &recorder, options(2), Duration::ZERO).await;
    let survivors: BTreeSet<String> = survivor.member_ids().into_iter().collect();
    let mut victim_listener = None;
    let mut victim_process = None;
    let victims: BTreeSet<String> = match crash {
        Crash::Abort => {
            let handle = start_recording(&target, &recorder, options(2), Duration::ZERO).await;
            let ids = handle.member_ids();
            victim_listener = Some(handle);
            ids.into_iter().collect()
        }
        Crash::Kill => {
            let process =
                MemberProcess::spawn(&server.url(), &["--concurrency", "2"], recorder.clone());
            let ids = process.members.clone();
            victim_process = Some(process);
            ids.into_iter().collect()
        }
    };
    let (group, settled) = wait_for_group(&mut conn, Duration::from_secs(20), |g| {
        converged(g) && g.members.iter().filter(|m| m.live).count() == 4
    })
    .await;
    assert!(settled, "group did not settle: {group:#?}");
    let before = target_of(&group);
    let victim_shards: BTreeSet<u32> = before
        .iter()
        .filter(|(_, owner)| !survivors.contains(*owner))
        .map(|(s, _)| *s)
        .collect();
    assert_eq!(victim_shards.len(), 4, "{before:?}");

    let publisher = SteadyPublisher::start(
        server.client(),
        (0..8).collect(),
        Duration::from_millis(40),
        0,
    );
    // Steady processing on every shard first (1 s), then the crash.
    let warm = wait_until(Duration::from_secs(10), || {
        let calls = recorder.calls();
        (0..8).all(|s| calls.iter().filter(|c| c.shard == s).count() >= 25)
    })
    .await;
    assert!(warm, "not every shard was being processed");

    let killed_at = match crash {
        Crash::Abort => {
            let at = now_us();
            victim_listener.take().unwrap().abort();
            at
        }
        Crash::Kill => victim_process.as_mut().unwrap().kill(),
    };

    // The first handler start by a survivor on each of the victim's shards after the kill.
    let first_after = |recorder: &Recorder| {
        recorder.first_starts_after(killed_at, &victim_shards, |m| survivors.contains(m))
    };
    let moved = wait_until(Duration::from_secs(15), || {
        first_after(&recorder).len() == victim_shards.len()
    })
    .await;
    let first = first_after(&recorder);
    assert!(
        moved,
        "victim shards {victim_shards:?}, served again: {first:?}"
    );
    let delays: BTreeMap<u32, f64> = first
        .iter()
        .map(|(s, at)| (*s, ms(at - killed_at)))
        .collect();
    eprintln!("takeover after the kill, ms per shard: {delays:?}");
    let bound = LEASE + 2 * HEARTBEAT + TAKEOVER_SLACK;
    for (shard, delay) in &delays {
        assert!(
            *delay <= bound.as_secs_f64() * 1000.0,
            "shard {shard} served again {delay} ms after the kill; bound {bound:?} \
             (lease {LEASE:?} + 2 x heartbeat {HEARTBEAT:?} + slack {TAKEOVER_SLACK:?}); all: {delays:?}"
        );
    }
    // The shards moved because the victim's lease ran out, not earlier: its last renewal was at
    // most ~1.1 heartbeats before the kill, so its lease ran until at least lease − 1.1 × 200 ms
    // after it (checked with one more heartbeat of tolerance), and no survivor handled a victim
    // shard before the kill.
    let earliest = LEASE - 2 * HEARTBEAT;
    for (shard, delay) in &delays {
        assert!(
            *delay >= earliest.as_secs_f64() * 1000.0,
            "shard {shard} taken over {delay} ms after the kill, before the victim's lease could \
             have ended (≥ {earliest:?}): two owners at once"
        );
    }
    let early: Vec<Call> = recorder
        .calls()
        .into_iter()
        .filter(|c| {
            c.at_us <= killed_at
                && victim_shards.contains(&c.shard)
                && survivors.contains(&c.member)
        })
        .collect();
    assert!(
        early.is_empty(),
        "survivors read victim shards before the kill: {early:?}"
    );

    // Nothing lost: every published entry handled, and nothing left pending.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let published = publisher.stop();
    assert_nothing_lost(&recorder, &published, Duration::from_secs(20)).await;
    let (group, settled) = wait_for_group(&mut conn, Duration::from_secs(10), converged).await;
    assert!(settled, "{group:#?}");
    for shard in 0..8 {
        assert_eq!(pending_count(&mut conn, shard).await, 0, "shard {shard}");
    }
    // The survivors own everything; the victims expired.
    let live: BTreeSet<String> = group
        .members
        .iter()
        .filter(|m| m.live)
        .map(|m| m.member_id.clone())
        .collect();
    assert_eq!(live, survivors);
    let owned: BTreeSet<u32> = group.members.iter().flat_map(|m| m.owned.clone()).collect();
    assert_eq!(owned, (0..8).collect());
    let expired: BTreeSet<String> = group
        .history
        .iter()
        .filter(|m| m.state == MemberState::Expired)
        .map(|m| m.member_id.clone())
        .collect();
    assert_eq!(expired, victims, "history: {:#?}", group.history);
    survivor.shutdown_and_wait().await.expect("clean shutdown");
}

tests_of!(killed_member_shards_move_within_lease_plus_two_heartbeats {
    aborted_member_shards_are_processed_by_others_within_lease_plus_two_heartbeats =>
        Crash::Abort,
    sigkilled_member_process_shards_are_processed_by_others_within_lease_plus_two_heartbeats =>
        Crash::Kill,
});

/// What [`redis_paused_longer_than_the_lease`] checks after Redis answers again.
#[derive(PartialEq)]
enum AfterPause {
    /// New entries are handled and the group is STABLE again.
    Recover,
    /// Also: every entry is handled in the end, those abandoned at the lease end included, and
    /// nothing stays pending.
    NothingLost,
}

/// Redis frozen for 3 s (lease 1.5 s) while two members have a backlog of slow entries in hand
/// (read-ahead batches of 16 entries of 100 ms each): once the lease has ended no handler starts
/// until Redis answers again; then the members recover.
async fn redis_paused_longer_than_the_lease(after: AfterPause) {
    let (_serial, server, target, mut conn, recorder) = Context::serial(4).await.parts();
    let mut opts = options(2);
    opts.batch_size = 16;
    let listener = start_recording(&target, &recorder, opts, Duration::from_millis(100)).await;
    settle(&mut conn, 2, Duration::from_secs(20)).await;

    // 4 x 40 entries of 100 ms, two members with one worker each: 8 s of work.
    let mut published = preload(&server.client(), &[0, 1, 2, 3], 40, 0);
    let busy = wait_until(Duration::from_secs(10), || recorder.calls().len() >= 6).await;
    assert!(busy);

    let paused_at = now_us();
    server.pause().unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let resumed_at = now_us();
    server.resume().unwrap();

    // The members' own lease deadline is at most `lease - margin` (1.2 s) after the last
    // heartbeat they sent before the pause; a handler starting later than one full lease after
    // the pause (300 ms of slack) means a member kept working without a lease.
    let lease_end = paused_at + LEASE.as_micros() as u64;
    let during: Vec<Call> = recorder
        .calls()
        .into_iter()
        .filter(|c| c.at_us > lease_end && c.at_us < resumed_at)
        .collect();
    let last_before = recorder
        .calls()
        .iter()
        .filter(|c| c.at_us < resumed_at)
        .map(|c| c.at_us)
        .max()
        .unwrap();
    eprintln!(
        "last handler start {} ms after the pause (lease {LEASE:?})",
        ms(last_before.saturating_sub(paused_at))
    );
    // Handlers running when the lease ended are cancelled: none finishes later than its own
    // length (100 ms) after a full lease.
    let late_finish: Vec<(u64, String, u32, String)> = recorder
        .done
        .lock()
        .unwrap()
        .iter()
        .filter(|d| d.0 > lease_end + 100_000 && d.0 < resumed_at)
        .cloned()
        .collect();
    assert!(
        late_finish.is_empty(),
        "handlers finished after the lease end instead of being cancelled: {late_finish:?}"
    );
    assert!(
        during.is_empty(),
        "{} handler starts between the lease end ({} ms after the pause) and the resume: {:?}",
        during.len(),
        LEASE.as_millis(),
        first_five(&during)
    );

    // Recovery: entries written after the pause are handled, and the group is STABLE again.
    let mut fresh_conn = server.client().get_connection().unwrap();
    let fresh: Vec<Published> = (0..4)
        .map(|shard| xadd_sync(&mut fresh_conn, shard, 1000 + u64::from(shard)))
        .collect();
    let recovered = wait_until(Duration::from_secs(25), || {
        all_handled(&fresh, &recorder.handled())
    })
    .await;
    assert!(
        recovered,
        "entries written after the pause were not handled"
    );
    let group = settle(&mut conn, 2, Duration::from_secs(10)).await;
    assert_eq!(group.state, GroupState::Stable);
    if after == AfterPause::Recover {
        listener.shutdown_and_wait().await.expect("clean shutdown");
        return;
    }

    // Nothing lost: the entries the members had in hand when their leases ended are handled too.
    published.extend(fresh);
    let all = wait_until(Duration::from_secs(10), || {
        all_handled(&published, &recorder.handled())
    })
    .await;
    if !all {
        // Where the missing entries are: the group's PEL, per consumer.
        let handled = recorder.handled();
        let mut stuck: BTreeMap<(u32, String), usize> = BTreeMap::new();
        for shard in 0..4 {
            for (id, consumer, _) in pel(&mut conn, shard).await {
                if !handled.contains(&(shard, id)) {
                    *stuck.entry((shard, consumer)).or_default() += 1;
                }
            }
        }
        eprintln!("unhandled entries still pending, per (shard, consumer): {stuck:?}");
        eprintln!("members now: {:?}", listener.status());
    }
    assert_all_handled(&published, &recorder.handled());
    assert!(all);
    assert_no_pending(&mut conn, 0..4).await;
    listener.shutdown_and_wait().await.expect("clean shutdown");
}

tests_of!(redis_paused_longer_than_the_lease {
    redis_paused_longer_than_the_lease_stops_handlers_then_members_recover => AfterPause::Recover,
    /// The entries a member had read but not finished when its lease ended stay in its own PEL;
    /// when its lease is renewed and it keeps the shard, it must handle them (they are not new
    /// entries).
    entries_in_hand_when_the_lease_ended_are_handled_after_redis_returns => AfterPause::NothingLost,
});

/// A TCP proxy in front of one cluster node (announced as the node's address with
/// `cluster-announce-port`, so clients route through it). While armed, the first client chunk
/// carrying a plain `XREADGROUP ... >` is forwarded to Redis, which runs it; its reply is then
/// swallowed and the connection dropped: the read ran, its reply was lost.
struct LostReplyProxy {
    port: u16,
}

/// Shared by a cluster's proxies: whether to drop the next `>` read's reply, and how many were.
#[derive(Default)]
struct LostReplies {
    armed: std::sync::atomic::AtomicBool,
    dropped: std::sync::atomic::AtomicUsize,
}

impl LostReplyProxy {
    async fn start(upstream: u16, faults: Arc<LostReplies>) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let faults = faults.clone();
                tokio::spawn(async move {
                    let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await
                    else {
                        return;
                    };
                    Self::pump(client, server, faults).await;
                });
            }
        });
        LostReplyProxy { port }
    }

    /// Relays both ways until either side closes, or until a doomed read's reply arrives.
    async fn pump(
        client: tokio::net::TcpStream,
        server: tokio::net::TcpStream,
        faults: Arc<LostReplies>,
    ) {
        use std::sync::atomic::Ordering;
        use tokio::io::AsyncWriteExt;
        let (mut client_read, mut client_write) = client.into_split();
        let (mut server_read, mut server_write) = server.into_split();
        let doomed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let upstream = {
            let doomed = doomed.clone();
            let faults = faults.clone();
            async move {
                let mut buf = vec![0u8; 64 * 1024];
                while let Some(chunk) = read_chunk(&mut client_read, &mut buf).await {
                    if is_new_read(chunk)
                        && faults
                            .armed
                            .compare_exchange(true, false, Ordering::SeqCst, Ordering::SeqCst)
                            .is_ok()
                    {
                        doomed.store(true, Ordering::SeqCst);
                    }
                    if server_write.write_all(chunk).await.is_err() {
                        return;
                    }
                    if doomed.load(Ordering::SeqCst) {
                        // Nothing more from this client: its connection is about to drop.
                        std::future::pending::<()>().await;
                    }
                }
            }
        };
        let downstream = async move {
            let mut buf = vec![0u8; 64 * 1024];
            while let Some(chunk) = read_chunk(&mut server_read, &mut buf).await {
                if doomed.load(Ordering::SeqCst) {
                    // The doomed read ran (its reply is here): lose it, drop the connection.
                    faults.dropped.fetch_add(1, Ordering::SeqCst);
                    return;
                }
                if client_write.write_all(chunk).await.is_err() {
                    return;
                }
            }
        };
        // Either direction ending ends both: the sockets close when dropped.
        tokio::select! {
            _ = upstream => {}
            _ = downstream => {}
        }
    }
}

/// The commands of a client chunk (RESP arrays of bulk strings); those after anything else,
/// or cut off at the chunk's end, are left out.
fn commands(mut chunk: &[u8]) -> Vec<Vec<Vec<u8>>> {
    fn line(chunk: &mut &[u8], prefix: u8) -> Option<usize> {
        let end = chunk.windows(2).position(|w| w == b"\r\n")?;
        if chunk.first() != Some(&prefix) {
            return None;
        }
        let n = std::str::from_utf8(&chunk[1..end]).ok()?.parse().ok()?;
        *chunk = &chunk[end + 2..];
        Some(n)
    }
    let mut out = Vec::new();
    while !chunk.is_empty() {
        let Some(len) = line(&mut chunk, b'*') else {
            break;
        };
        let mut args = Vec::with_capacity(len);
        for _ in 0..len {
            let Some(n) = line(&mut chunk, b'$') else {
                return out;
            };
            if chunk.len() < n + 2 {
                return out;
            }
            args.push(chunk[..n].to_vec());
            chunk = &chunk[n + 2..];
        }
        out.push(args);
    }
    out
}

/// Whether a client chunk carries a read of new entries: a plain `XREADGROUP ... >` (acks mode)
/// or the read script (strict mode): `EVALSHA <sha> 2 <stream> <fence> <group> <token> <inc>
/// <epoch> <fenced flag> <consumer> <count> <max bytes>`, 13 parts with the flag `0`/`1` and
/// the batch size (64) as count; an ack of 4 ids has 13 parts too, but ids there.
fn is_new_read(chunk: &[u8]) -> bool {
    commands(chunk).iter().any(|cmd| {
        let arg = |i: usize| cmd.get(i).map(Vec::as_slice);
        let plain = arg(0).is_some_and(|c| c.eq_ignore_ascii_case(b"XREADGROUP"))
            && cmd.last().map(Vec::as_slice) == Some(b">".as_slice());
        let script = arg(0).is_some_and(|c| c.eq_ignore_ascii_case(b"EVALSHA"))
            && cmd.len() == 13
            && arg(2) == Some(b"2".as_slice())
            && matches!(arg(9), Some(b"0") | Some(b"1"))
            && arg(11) == Some(b"64".as_slice());
        plain || script
    })
}

/// Puts a [`LostReplyProxy`] in front of every node of `cluster` and waits until every node
/// announces the proxies' ports in `CLUSTER SLOTS`. Returns the proxies' URLs (seed nodes).
async fn proxy_cluster(cluster: &RedisCluster, faults: &Arc<LostReplies>) -> Vec<String> {
    let mut ports = Vec::new();
    for node in cluster.nodes() {
        let proxy = LostReplyProxy::start(node.port(), faults.clone()).await;
        let mut con = node.client().get_connection().unwrap();
        let () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("cluster-announce-port")
            .arg(proxy.port)
            .query(&mut con)
            .unwrap();
        ports.push(proxy.port);
    }
    let announced = wait_until(Duration::from_secs(20), || {
        cluster.nodes().iter().all(|node| {
            let mut con = node.client().get_connection().unwrap();
            let slots: Vec<redis::Value> =
                redis::cmd("CLUSTER").arg("SLOTS").query(&mut con).unwrap();
            slots.iter().all(|range| match range {
                redis::Value::Array(parts) => match parts.get(2) {
                    Some(redis::Value::Array(master)) => match master.get(1) {
                        Some(redis::Value::Int(port)) => ports.contains(&(*port as u16)),
                        _ => false,
                    },
                    _ => false,
                },
                _ => false,
            })
        })
    })
    .await;
    assert!(announced, "the nodes did not announce the proxies");
    ports
        .iter()
        .map(|port| format!("redis://127.0.0.1:{port}"))
        .collect()
}

/// `count` entries on each of `shards` of a cluster, round-robin (key `s<shard>`, payload
/// `{"n": N}`).
fn preload_cluster(cluster: &RedisCluster, shards: &[u32], count: u64) -> Vec<Published> {
    preload_on(
        &mut cluster.client().get_connection().unwrap(),
        shards,
        count,
        0,
    )
}

/// Everything published is handled, nothing stays pending, and each shard (one key per shard)
/// was handled in publication order the first time each entry was handled.
async fn check_nothing_stranded(
    conn: &mut stream_listener::core::internals::connection::RedisConnection,
    recorder: &Recorder,
    published: &[Published],
    shards: &[u32],
) {
    let all = wait_until(Duration::from_secs(30), || {
        all_handled(published, &recorder.handled())
    })
    .await;
    if !all {
        for &shard in shards {
            eprintln!(
                "shard {shard} pending: {} entries",
                pel(conn, shard).await.len()
            );
        }
    }
    let redelivered: Vec<(u32, u64)> = recorder
        .calls()
        .iter()
        .filter(|c| c.delivery_count > 1)
        .map(|c| (c.shard, c.delivery_count))
        .collect();
    eprintln!(
        "handler calls on re-delivered entries: {} {:?}",
        redelivered.len(),
        &redelivered[..redelivered.len().min(3)]
    );
    assert_all_handled(published, &recorder.handled());
    for &shard in shards {
        assert_eq!(
            wait_no_pending(conn, shard).await,
            0,
            "shard {shard}: stranded"
        );
        let mut seen = BTreeSet::new();
        let first_time: Vec<u64> = recorder
            .calls()
            .iter()
            .filter(|c| c.shard == shard && seen.insert(c.entry_id.clone()))
            .filter_map(|c| c.n)
            .collect();
        let mut sorted = first_time.clone();
        sorted.sort_unstable();
        assert_eq!(first_time, sorted, "shard {shard}: out of order");
    }
}

/// docs/design.md §8.10: a member's `>` read runs in Redis, the connection drops before its
/// reply arrives. redis-rs's cluster client used to send it again (`retries(2)`), and the
/// second read returned the *next* batch: the first sat in the member's own pending list,
/// never re-read (no periodic re-read of one's own PEL), stranded. The data plane's connection
/// now sends nothing twice: the read fails, and the shard task re-reads its own pending entries.
async fn a_read_whose_reply_is_lost_on_a_cluster_strands_nothing(mode: FencingMode) {
    let _serial = SERIAL.lock().await;
    let cluster = RedisCluster::start().unwrap();
    let faults = Arc::new(LostReplies::default());
    let target = RedisTarget::cluster(proxy_cluster(&cluster, &faults).await);
    let mut conn = connect(&target).await;
    admin::create_stream(&mut conn, STREAM, 2).await.unwrap();
    let shards = [0, 1];
    let published = preload_cluster(&cluster, &shards, 300);
    let recorder = Arc::new(Recorder::default());
    let mut opts = options(1);
    opts.fencing = mode;
    // 1 ms per entry: 64 ms per batch, 600 entries.
    let listener = start_recording(&target, &recorder, opts, Duration::from_millis(1)).await;
    // The next `>` read once entries are handled (not the process's first read script call:
    // that one meets `NOSCRIPT` and does not run), with a backlog waiting, loses its reply.
    let started = wait_until(Duration::from_secs(20), || !recorder.calls().is_empty()).await;
    assert!(started);
    faults
        .armed
        .store(true, std::sync::atomic::Ordering::SeqCst);
    check_nothing_stranded(&mut conn, &recorder, &published, &shards).await;
    assert_eq!(
        faults.dropped.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "no reply was lost: the test tested nothing"
    );
    listener.shutdown_and_wait().await.expect("clean shutdown");
}

/// The index of the node of `cluster` that serves `key`'s slot.
fn node_of(cluster: &RedisCluster, key: &str) -> usize {
    let slot = i64::from(stream_listener::core::internals::dataplane::key_slot(key));
    let mut con = cluster.nodes()[0].client().get_connection().unwrap();
    let ranges: Vec<(i64, i64, (String, i64))> = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query::<Vec<redis::Value>>(&mut con)
        .unwrap()
        .into_iter()
        .map(|range| {
            let redis::Value::Array(parts) = range else {
                panic!("CLUSTER SLOTS: {range:?}")
            };
            let int = |v: &redis::Value| match v {
                redis::Value::Int(n) => *n,
                other => panic!("{other:?}"),
            };
            let redis::Value::Array(master) = &parts[2] else {
                panic!("{parts:?}")
            };
            (
                int(&parts[0]),
                int(&parts[1]),
                (String::new(), int(&master[1])),
            )
        })
        .collect();
    let port = ranges
        .iter()
        .find(|(first, last, _)| (*first..=*last).contains(&slot))
        .map(|(_, _, (_, port))| *port as u16)
        .unwrap();
    cluster
        .nodes()
        .iter()
        .position(|n| n.port() == port)
        .unwrap()
}

tests_of!(a_read_whose_reply_is_lost_on_a_cluster_strands_nothing {
    a_read_whose_reply_is_lost_on_a_cluster_strands_nothing_strict => FencingMode::Strict,
    a_read_whose_reply_is_lost_on_a_cluster_strands_nothing_in_acks_mode => FencingMode::Acks,
});

/// docs/design.md §8.10, the pause: the master of a shard frozen (`SIGSTOP`) for longer than the
/// client's response timeout (5 s) while the member reads it. The reads sent meanwhile run when
/// it resumes, their replies long given up: they must not be sent again, and the member must
/// re-read its own pending entries. 0 stranded, 0 lost, per-key order kept. (With redis 1.8.1
/// a timed-out request is not re-sent, since the request's overall timeout is its response
/// timeout; this guards the shard task's own recovery after the error.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_frozen_past_the_response_timeout_during_reads_strands_nothing() {
    let _serial = SERIAL.lock().await;
    let cluster = RedisCluster::start().unwrap();
    let target = RedisTarget::cluster(cluster.urls());
    let mut conn = connect(&target).await;
    admin::create_stream(&mut conn, STREAM, 2).await.unwrap();
    let shards = [0, 1];
    let published = preload_cluster(&cluster, &shards, 300);
    let recorder = Arc::new(Recorder::default());
    let mut opts = options(1);
    opts.batch_size = 16;
    // 5 ms per entry: 3 s of reads and handling, during which the master freezes.
    let listener = start_recording(&target, &recorder, opts, Duration::from_millis(5)).await;
    let node = node_of(&cluster, "{orders:0}");
    let reading = wait_until(Duration::from_secs(20), || {
        recorder.calls().iter().filter(|c| c.shard == 0).count() >= 20
    })
    .await;
    assert!(reading, "shard 0 was not being read");
    cluster.pause_node(node).unwrap();
    // The fault itself: longer than the client's response timeout.
    tokio::time::sleep(
        stream_listener::core::internals::connection::DEFAULT_RESPONSE_TIMEOUT
            + Duration::from_secs(1),
    )
    .await;
    cluster.resume_node(node).unwrap();
    check_nothing_stranded(&mut conn, &recorder, &published, &shards).await;
    listener.shutdown_and_wait().await.expect("clean shutdown");
}

/// docs/design.md §8.10 on a standalone server: not a defect there. The `ConnectionManager`'s
/// retries (`set_number_of_retries(1)`) are reconnection attempts; a command whose connection
/// dropped returns its error and is never sent again (redis 1.8.1,
/// `aio/connection_manager.rs`, `send_packed_command(s)`), so the shard task re-reads its own
/// pending entries. Passes with and without the fix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_whose_reply_is_lost_on_a_standalone_server_strands_nothing() {
    let _serial = SERIAL.lock().await;
    let server = RedisServer::start().unwrap();
    let faults = Arc::new(LostReplies::default());
    let proxy = LostReplyProxy::start(server.port(), faults.clone()).await;
    let target = RedisTarget::standalone(format!("redis://127.0.0.1:{}", proxy.port));
    let mut conn = connect(&target).await;
    admin::create_stream(&mut conn, STREAM, 2).await.unwrap();
    let shards = [0, 1];
    let published = preload(&server.client(), &shards, 300, 0);
    let recorder = Arc::new(Recorder::default());
    let mut opts = options(1);
    // Plain `>` reads, in read rounds (one multi-stream `XREADGROUP` for both shards).
    opts.fencing = FencingMode::Acks;
    faults
        .armed
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let listener = start_recording(&target, &recorder, opts, Duration::ZERO).await;
    check_nothing_stranded(&mut conn, &recorder, &published, &shards).await;
    assert_eq!(
        faults.dropped.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "no reply was lost: the test tested nothing"
    );
    listener.shutdown_and_wait().await.expect("clean shutdown");
}

/// docs/design.md §8.11: a master restarted without persistence loses the
/// shard streams of its slots while the stream metadata, on another master, still lists them
/// ACTIVE. With `auto_create_shards` the member must provision such a shard again (stream and
/// consumer group, from `0`), as it did before docs/design.md §8.11: no admin operation does it for
/// a registered group (`register_group` returns early, `scale` to the same count changes nothing,
/// `create_stream` finds the metadata), so the shard stayed unread for good and every
/// producer write routed to it failed (`XADD ... NOMKSTREAM` finds no stream). Also exercises
/// the data plane's cluster connection without retries (docs/design.md §8.10) reconnecting to the
/// restarted node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_stream_lost_with_its_master_is_provisioned_again_with_auto_create_shards() {
    let _serial = SERIAL.lock().await;
    let mut cluster = RedisCluster::start().unwrap();
    let target = RedisTarget::cluster(cluster.urls());
    let mut conn = connect(&target).await;
    const SHARDS: u32 = 8;
    admin::create_stream(&mut conn, STREAM, SHARDS)
        .await
        .unwrap();
    // A master with shards and none of the coordination keys (those would be re-provisioned
    // by the metadata path of docs/design.md §5.5 instead).
    let coordination: BTreeSet<usize> = [
        "sl:streams".to_owned(),
        format!("sl:{{{STREAM}}}:stream"),
        format!("sl:{{{STREAM}:{GROUP}}}:group"),
        format!("sl:{{{STREAM}:{GROUP}}}:leases"),
        format!("sl:{{{STREAM}:{GROUP}}}:history"),
    ]
    .iter()
    .map(|key| node_of(&cluster, key))
    .collect();
    let (node, lost): (usize, Vec<u32>) = (0..cluster.nodes().len())
        .filter(|n| !coordination.contains(n))
        .map(|n| {
            let shards = (0..SHARDS)
                .filter(|s| node_of(&cluster, &format!("{{{STREAM}:{s}}}")) == n)
                .collect::<Vec<u32>>();
            (n, shards)
        })
        .find(|(_, shards)| !shards.is_empty())
        .expect("a master with shards and no coordination key");
    let recorder = Arc::new(Recorder::default());
    let mut opts = options(1);
    opts.auto_create_shards = Some(SHARDS);
    let listener = start_recording(&target, &recorder, opts, Duration::ZERO).await;
    let (group, settled) = wait_for_group(&mut conn, Duration::from_secs(20), |g| {
        converged(g) && target_of(g).len() == SHARDS as usize
    })
    .await;
    assert!(settled, "{group:#?}");

    // The restart without persistence: the node comes back with its slots and no data.
    cluster.kill_node(node).unwrap();
    cluster.restart_node(node).unwrap();
    cluster.wait_until_ready().unwrap();
    let mut direct = cluster.nodes()[node].client().get_connection().unwrap();
    let keys: u64 = redis::cmd("DBSIZE").query(&mut direct).unwrap();
    assert_eq!(keys, 0, "the restarted node kept data");

    // Each lost shard comes back with its consumer group, and a producer's write is handled.
    let end = std::time::Instant::now() + Duration::from_secs(20);
    let mut missing = lost.clone();
    while !missing.is_empty() && std::time::Instant::now() < end {
        missing.retain(|shard| {
            let groups: redis::RedisResult<Vec<redis::Value>> = redis::cmd("XINFO")
                .arg("GROUPS")
                .arg(format!("{{{STREAM}:{shard}}}"))
                .query(&mut direct);
            !groups.is_ok_and(|g| g.len() == 1)
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        missing.is_empty(),
        "shards {missing:?} of the restarted master were never provisioned again"
    );
    let shard = lost[0];
    let written: Option<String> = redis::cmd("XADD")
        .arg(format!("{{{STREAM}:{shard}}}"))
        .arg("NOMKSTREAM")
        .arg("*")
        .arg("key")
        .arg("k")
        .arg("payload")
        .arg(r#"{"n":1}"#)
        .query(&mut direct)
        .unwrap();
    let id = written.expect("the shard stream exists again");
    let handled = wait_until(Duration::from_secs(15), || {
        recorder.handled().contains(&(shard, id.clone()))
    })
    .await;
    assert!(handled, "{:?}", recorder.calls());
    listener.shutdown_and_wait().await.expect("clean shutdown");
}
