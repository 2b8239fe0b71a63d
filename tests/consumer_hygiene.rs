//! Consumer hygiene (docs/design.md §8.15) on real Redis: the shard script deletes only consumers
//! outside the keep-list with 0 pending entries (one with pending entries is never deleted); the
//! keep-list holds live leases and static members still in the group; `group cleanup` (the admin
//! function) in a dry run changes nothing and lists the right names, on a standalone server and
//! on a 3-master cluster; members' takeovers on a cluster claim, then delete, the consumers of
//! departed members; a static member's consumer survives a restart of its process; and the
//! goal: after 50 restarts of 3 non-static member processes under load (SIGTERM and SIGKILL
//! mixed), every shard has at most (live members + 1) Redis consumers, and nothing was lost.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::AsyncCommands;
use redis::streams::{StreamReadOptions, StreamReadReply};
use stream_listener::core::internals::admin::{self, KeptBecause, KeptConsumer};
use stream_listener::core::internals::connection::{RedisConnection, RedisTarget};
use stream_listener::core::internals::dataplane::{
    ConsumerSweep, DataPlaneError, ShardClient, delete_idle_consumers, read_keep_list,
};
use stream_listener::core::internals::keys::StreamKeys;
use stream_listener::core::internals::store::StoreError;
use stream_listener::core::model::StartFrom;
use stream_listener::testing::RedisCluster;
use support::*;

/// The group's Redis consumers on `shard` (`XINFO CONSUMERS`): name → pending count.
async fn consumers(conn: &mut RedisConnection, shard: u32) -> BTreeMap<String, u64> {
    let rows: Vec<Vec<redis::Value>> = redis::cmd("XINFO")
        .arg("CONSUMERS")
        .arg(format!("{{{STREAM}:{shard}}}"))
        .arg(GROUP)
        .query_async(conn)
        .await
        .unwrap();
    rows.into_iter()
        .map(|row| {
            let mut name = String::new();
            let mut pending = 0;
            for pair in row.chunks(2) {
                match (&pair[0], &pair[1]) {
                    (redis::Value::BulkString(k), redis::Value::BulkString(v)) if k == b"name" => {
                        name = String::from_utf8_lossy(v).into_owned()
                    }
                    (redis::Value::BulkString(k), redis::Value::Int(n)) if k == b"pending" => {
                        pending = *n as u64
                    }
                    _ => {}
                }
            }
            (name, pending)
        })
        .collect()
}

/// Makes `consumer` a Redis consumer of the group on `shard` that read `read` new entries and
/// acked the first `acked` of them (so it has `read - acked` pending).
async fn consumer_with(
    conn: &mut RedisConnection,
    shard: u32,
    consumer: &str,
    read: usize,
    acked: usize,
) {
    let key = format!("{{{STREAM}:{shard}}}");
    let () = redis::cmd("XGROUP")
        .arg("CREATECONSUMER")
        .arg(&key)
        .arg(GROUP)
        .arg(consumer)
        .query_async(conn)
        .await
        .map(|_: i64| ())
        .unwrap();
    if read == 0 {
        return;
    }
    for n in 0..read {
        let _: String = conn
            .xadd(
                &key,
                "*",
                &[
                    ("key", format!("k{n}")),
                    ("payload", format!(r#"{{"n":{n}}}"#)),
                ],
            )
            .await
            .unwrap();
    }
    let options = StreamReadOptions::default()
        .group(GROUP, consumer)
        .count(read);
    let reply: StreamReadReply = conn.xread_options(&[&key], &[">"], &options).await.unwrap();
    let ids: Vec<String> = reply
        .keys
        .into_iter()
        .flat_map(|k| k.ids.into_iter().map(|e| e.id))
        .collect();
    assert_eq!(ids.len(), read, "{consumer}: read");
    if acked > 0 {
        let _: u64 = conn.xack(&key, GROUP, &ids[..acked]).await.unwrap();
    }
}

/// Redis `TIME` in µs.
async fn redis_now(conn: &mut RedisConnection) -> u64 {
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(conn).await.unwrap();
    secs * 1_000_000 + micros
}

/// Puts `member` in the group's member map (a minimal `member:<id>` JSON: the keep-list reads
/// only `instanceId`) with a lease ending at `lease_end` µs.
async fn plant_member(
    conn: &mut RedisConnection,
    member: &str,
    instance_id: Option<&str>,
    lease_end: u64,
) {
    let json = match instance_id {
        Some(i) => format!(r#"{{"memberId":"{member}","instanceId":"{i}"}}"#),
        None => format!(r#"{{"memberId":"{member}"}}"#),
    };
    let _: i64 = conn
        .hset(
            format!("sl:{{{STREAM}:{GROUP}}}:group"),
            format!("member:{member}"),
            json,
        )
        .await
        .unwrap();
    let _: i64 = conn
        .zadd(format!("sl:{{{STREAM}:{GROUP}}}:leases"), member, lease_end)
        .await
        .unwrap();
}

fn names(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| (*s).to_owned()).collect()
}

fn sweep(deleted: &[&str], kept_pending: &[(&str, u64)], kept: &[(&str, u64)]) -> ConsumerSweep {
    let pairs = |l: &[(&str, u64)]| l.iter().map(|(n, p)| ((*n).to_owned(), *p)).collect();
    ConsumerSweep {
        deleted: names(deleted),
        kept_pending: pairs(kept_pending),
        kept: pairs(kept),
    }
}

async fn registered(shards: u32) -> Context {
    let mut context = Context::start(shards).await;
    admin::register_group(&mut context.conn, STREAM, GROUP, StartFrom::Earliest)
        .await
        .unwrap();
    context
}

#[tokio::test]
async fn a_consumer_with_pending_entries_is_never_deleted_and_an_idle_one_is() {
    let Context {
        server, mut conn, ..
    } = registered(1).await;
    consumer_with(&mut conn, 0, "gone-busy", 2, 1).await;
    consumer_with(&mut conn, 0, "gone-idle", 2, 2).await;
    consumer_with(&mut conn, 0, "gone-never-read", 0, 0).await;
    consumer_with(&mut conn, 0, "listed", 1, 0).await;
    let keys = StreamKeys::new(STREAM).unwrap();
    let before = consumers(&mut conn, 0).await;
    let keep = names(&["listed", "not-a-consumer"]);
    // Read gates (docs/design.md §8.16): the current token's, listed, kept; one a lost fence
    // value left behind, listed, and one of versions before per-token gates, both deleted.
    let group_keys = keys.group(GROUP).unwrap();
    let shard_key = keys.shard(0);
    let _: i64 = conn
        .hset(keys.fence(0), GROUP, "1:1:planted:m0")
        .await
        .unwrap();
    let current = support::plant_gate(&mut conn, &shard_key, GROUP).await;
    let stale = format!("{shard_key}:gate:{GROUP}:0:9:old:m1");
    support::plant_legacy_gate(&mut conn, &stale, GROUP).await;
    let _: i64 = conn.sadd(keys.gate_registry(0), &stale).await.unwrap();
    let gate = keys.legacy_gate(0, &group_keys);
    for args in [
        vec!["CREATE", gate.as_str(), GROUP, "$", "MKSTREAM"],
        vec!["CREATECONSUMER", gate.as_str(), GROUP, "gone-idle"],
    ] {
        let _: redis::Value = redis::cmd("XGROUP")
            .arg(&args)
            .query_async(&mut conn)
            .await
            .unwrap();
    }

    // Dry run: the same answer, nothing deleted.
    let dry = delete_idle_consumers(&mut conn, &keys, 0, GROUP, &keep, true)
        .await
        .unwrap();
    let expected = sweep(
        &["gone-idle", "gone-never-read"],
        &[("gone-busy", 1)],
        &[("listed", 1)],
    );
    // XINFO CONSUMERS lists consumers by name.
    assert_eq!(dry, expected);
    assert_eq!(consumers(&mut conn, 0).await, before);
    for key in [&gate, &stale, &current] {
        assert!(
            conn.exists::<_, bool>(key).await.unwrap(),
            "a dry run keeps {key}"
        );
    }

    let done = delete_idle_consumers(&mut conn, &keys, 0, GROUP, &keep, false)
        .await
        .unwrap();
    assert_eq!(done, expected);
    assert!(
        !conn.exists::<_, bool>(&gate).await.unwrap(),
        "the old gate goes with its consumers"
    );
    assert!(!conn.exists::<_, bool>(&stale).await.unwrap());
    assert!(
        conn.exists::<_, bool>(&current).await.unwrap(),
        "the fence's token keeps its gate: its holder's wait goes on"
    );
    let listed: Vec<String> = conn.smembers(keys.gate_registry(0)).await.unwrap();
    assert_eq!(listed, std::slice::from_ref(&current));
    let after = consumers(&mut conn, 0).await;
    assert_eq!(
        after,
        BTreeMap::from([("gone-busy".to_owned(), 1), ("listed".to_owned(), 1)])
    );
    // The busy consumer's PEL is intact.
    assert_eq!(pending_of(&mut conn, 0, "gone-busy").await.len(), 1);

    // Once its entry is acked, the consumer with no member goes too.
    let pending = pending_of(&mut conn, 0, "gone-busy").await;
    let _: u64 = conn.xack("{orders:0}", GROUP, &pending).await.unwrap();
    let last = delete_idle_consumers(&mut conn, &keys, 0, GROUP, &keep, false)
        .await
        .unwrap();
    assert_eq!(last, sweep(&["gone-busy"], &[], &[("listed", 1)]));
    assert_eq!(
        consumers(&mut conn, 0).await,
        BTreeMap::from([("listed".to_owned(), 1)])
    );
    drop(server);
}

#[tokio::test]
async fn a_missing_consumer_group_is_a_clear_error_and_changes_nothing() {
    let Context {
        server, mut conn, ..
    } = Context::start(1).await;
    let keys = StreamKeys::new(STREAM).unwrap();
    let error = delete_idle_consumers(&mut conn, &keys, 0, "nobody", &[], false)
        .await
        .unwrap_err();
    assert!(
        matches!(&error, DataPlaneError::NoGroup { shard: 0, group, .. } if group == "nobody"),
        "{error:?}"
    );
    let error = admin::cleanup_consumers(&mut conn, STREAM, "nobody", false)
        .await
        .unwrap_err();
    assert!(
        matches!(&error, admin::AdminError::Store(StoreError::UnknownGroup { group, .. }) if group == "nobody"),
        "{error:?}"
    );
    assert!(error.to_string().contains("\"nobody\""), "{error}");
    let error = admin::cleanup_consumers(&mut conn, "nowhere", GROUP, false)
        .await
        .unwrap_err();
    assert!(
        matches!(&error, admin::AdminError::Store(StoreError::MissingStream { prefix, .. }) if prefix == "nowhere"),
        "{error:?}"
    );
    let error = admin::cleanup_consumers(&mut conn, STREAM, "a:b", false)
        .await
        .unwrap_err();
    assert!(
        matches!(error, admin::AdminError::InvalidName(_)),
        "{error:?}"
    );
    assert!(error.to_string().contains("a:b"), "{error}");
    drop(server);
}

/// The keep-list: live leases, and static members still in the member map whose lease ran out;
/// not expired non-static members, nor lease entries without a member.
async fn the_keep_list_holds_live_and_static_members(mut conn: RedisConnection, shards: u32) {
    let now = redis_now(&mut conn).await;
    plant_member(&mut conn, "live-a", None, now + 60_000_000).await;
    plant_member(&mut conn, "live-static", Some("pod-1"), now + 60_000_000).await;
    plant_member(&mut conn, "away-static", Some("pod-2"), now - 1_000_000).await;
    plant_member(&mut conn, "expired", None, now - 1_000_000).await;
    let _: i64 = conn
        .zadd(format!("sl:{{{STREAM}:{GROUP}}}:leases"), "ghost", now - 1)
        .await
        .unwrap();
    let keys = StreamKeys::new(STREAM).unwrap();
    let group_keys = keys.group(GROUP).unwrap();
    let keep = read_keep_list(&mut conn, &group_keys).await.unwrap();
    assert!(keep.group_exists);
    let live: BTreeSet<&str> = keep.live.iter().map(String::as_str).collect();
    assert_eq!(live, BTreeSet::from(["live-a", "live-static"]));
    assert_eq!(keep.static_members, ["away-static"]);

    for shard in 0..shards {
        for member in [
            "me",
            "live-a",
            "live-static",
            "away-static",
            "expired",
            "ghost",
        ] {
            consumer_with(&mut conn, shard, member, 0, 0).await;
        }
    }
    // The CLI's core: a dry run changes nothing and names every consumer with its reason.
    let dry = admin::cleanup_consumers(&mut conn, STREAM, GROUP, true)
        .await
        .unwrap();
    assert!(dry.dry_run);
    assert_eq!(dry.shards.len(), shards as usize);
    for (i, shard) in dry.shards.iter().enumerate() {
        assert_eq!(shard.shard_index, i as u32);
        assert!(!shard.no_consumer_group);
        assert_eq!(shard.deleted, ["expired", "ghost", "me"]);
        let kept = |c: &str, reason| KeptConsumer {
            consumer: c.to_owned(),
            reason,
            pending: 0,
        };
        assert_eq!(
            shard.kept,
            [
                kept("away-static", KeptBecause::StaticMember),
                kept("live-a", KeptBecause::LiveMember),
                kept("live-static", KeptBecause::LiveMember),
            ]
        );
        assert_eq!(consumers(&mut conn, i as u32).await.len(), 6);
    }

    // The runtime's call keeps its own consumer as well.
    let mut client = ShardClient::new(conn.clone(), keys.clone(), GROUP, "me").unwrap();
    for shard in 0..shards {
        let swept = client.clean_consumers(shard).await.unwrap().unwrap();
        assert_eq!(swept.deleted, ["expired", "ghost"], "shard {shard}");
        let left: BTreeSet<String> = consumers(&mut conn, shard).await.into_keys().collect();
        assert_eq!(
            left,
            BTreeSet::from(["away-static", "live-a", "live-static", "me"].map(String::from)),
            "shard {shard}"
        );
    }
    // Nothing left to do.
    let done = admin::cleanup_consumers(&mut conn, STREAM, GROUP, false)
        .await
        .unwrap();
    assert_eq!(
        done.shards.iter().map(|s| s.deleted.len()).sum::<usize>(),
        shards as usize,
        "only `me` goes: not a member"
    );
}

#[tokio::test]
async fn the_keep_list_holds_live_and_static_members_on_a_standalone_server() {
    let Context { server, conn, .. } = registered(2).await;
    the_keep_list_holds_live_and_static_members(conn, 2).await;
    drop(server);
}

#[tokio::test]
async fn the_keep_list_holds_live_and_static_members_on_a_cluster() {
    let cluster = RedisCluster::start().unwrap();
    let target = RedisTarget::cluster(cluster.urls());
    let mut conn = connect(&target).await;
    admin::create_stream(&mut conn, STREAM, 4).await.unwrap();
    admin::register_group(&mut conn, STREAM, GROUP, StartFrom::Earliest)
        .await
        .unwrap();
    // The shards and the group's keys are spread over the masters.
    let slots: BTreeSet<u16> = (0..4)
        .map(|s| stream_listener::core::internals::dataplane::key_slot(&format!("{{orders:{s}}}")))
        .collect();
    assert_eq!(slots.len(), 4);
    the_keep_list_holds_live_and_static_members(conn, 4).await;
    drop(cluster);
}

/// The shards owned by `member` in `group`.
fn owned_by(group: &admin::GroupDescription, member: &str) -> BTreeSet<u32> {
    group
        .members
        .iter()
        .filter(|m| m.member_id == member)
        .flat_map(|m| m.owned.clone())
        .collect()
}

/// A static member (`--instance-id pod-a`, member id `pod-a-m0`) restarted: while its process is
/// down its lease still runs (`-2` keeps it; a 10 s lease of its own, docs/design.md §6.5), so a
/// cleanup run then keeps its consumer as a live member; the restarted process reads its shards
/// again under the same consumer name, and those shards still have exactly that one consumer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_static_members_consumer_survives_a_restart_of_its_process() {
    let (_serial, server, _target, mut conn, recorder) = Context::serial(2).await.parts();
    let url = server.url();
    let static_args = [
        "--instance-id",
        "pod-a",
        "--concurrency",
        "1",
        "--heartbeat-ms",
        "500",
        "--lease-ms",
        "10000",
    ];
    let a = MemberProcess::spawn(&url, &static_args, recorder.clone());
    assert_eq!(a.members, ["pod-a-m0"]);
    let b = MemberProcess::spawn(&url, &["--concurrency", "1"], recorder.clone());
    let group = settle(&mut conn, 2, Duration::from_secs(20)).await;
    let a_shards = owned_by(&group, "pod-a-m0");
    assert_eq!(a_shards.len(), 1, "{group:#?}");
    let publisher =
        SteadyPublisher::start(server.client(), vec![0, 1], Duration::from_millis(20), 0);
    let busy = wait_until(Duration::from_secs(10), || {
        let calls = recorder.calls();
        (0..2).all(|s| calls.iter().filter(|c| c.shard == s).count() >= 10)
    })
    .await;
    assert!(busy, "both shards were not being processed");

    let (_, clean_exit) = a.terminate();
    assert!(clean_exit);
    let cleaned = admin::cleanup_consumers(&mut conn, STREAM, GROUP, false)
        .await
        .unwrap();
    for shard in &cleaned.shards {
        assert!(
            !shard.deleted.iter().any(|c| c == "pod-a-m0"),
            "the static member's consumer was deleted: {cleaned:#?}"
        );
    }
    let shard = *a_shards.first().unwrap();
    let kept: Vec<&KeptConsumer> = cleaned.shards[shard as usize]
        .kept
        .iter()
        .filter(|k| k.consumer == "pod-a-m0")
        .collect();
    assert_eq!(kept.len(), 1, "{cleaned:#?}");
    assert_eq!(kept[0].reason, KeptBecause::LiveMember);

    let restarted_at = now_us();
    let a = MemberProcess::spawn(&url, &static_args, recorder.clone());
    assert_eq!(a.members, ["pod-a-m0"]);
    let resumed = wait_until(Duration::from_secs(15), || {
        recorder
            .calls()
            .iter()
            .any(|c| c.member == "pod-a-m0" && c.shard == shard && c.at_us > restarted_at)
    })
    .await;
    assert!(
        resumed,
        "the restarted static member did not read shard {shard}"
    );
    let group = settle(&mut conn, 2, Duration::from_secs(20)).await;
    assert_eq!(owned_by(&group, "pod-a-m0"), a_shards);
    let names: BTreeSet<String> = consumers(&mut conn, shard).await.into_keys().collect();
    assert_eq!(names, BTreeSet::from(["pod-a-m0".to_owned()]));

    let published = publisher.stop();
    assert_nothing_lost(&recorder, &published, Duration::from_secs(20)).await;
    drop((a, b));
}

/// How many restarts the goal test makes (`HYGIENE_RESTARTS`, default 50).
fn restarts() -> usize {
    std::env::var("HYGIENE_RESTARTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50)
}

/// The goal of issue 16: 3 non-static member processes (one member each) on 4 shards under a
/// steady load, restarted 50 times one after the other (every third by SIGKILL, the others by
/// SIGTERM), each restart waiting only until the group has converged again with 3 live members.
/// Then every shard has at most (live members + 1) = 4 Redis consumers, and every published
/// entry was handled. Without the cleanup each shard would keep one consumer per member process
/// that ever read it (dozens).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_50_restarts_every_shard_has_at_most_live_members_plus_one_consumers() {
    const SHARDS: u32 = 4;
    const LIVE: usize = 3;
    let (_serial, server, _target, mut conn, recorder) = Context::serial(SHARDS).await.parts();
    let url = server.url();
    let spawn = || MemberProcess::spawn(&url, &["--concurrency", "1"], recorder.clone());
    let mut processes: Vec<MemberProcess> = (0..LIVE).map(|_| spawn()).collect();
    settle(&mut conn, LIVE, Duration::from_secs(30)).await;
    let publisher = SteadyPublisher::start(
        server.client(),
        (0..SHARDS).collect(),
        Duration::from_millis(20),
        0,
    );
    let started = Instant::now();
    let mut ever: BTreeSet<String> = processes.iter().flat_map(|p| p.members.clone()).collect();
    let total = restarts();
    for restart in 0..total {
        let mut victim = processes.remove(restart % LIVE);
        if restart % 3 == 2 {
            victim.kill();
        } else {
            let (_, clean) = victim.terminate();
            assert!(clean, "restart {restart}: the member did not exit cleanly");
        }
        let fresh = spawn();
        ever.extend(fresh.members.clone());
        processes.push(fresh);
        let live: BTreeSet<String> = processes.iter().flat_map(|p| p.members.clone()).collect();
        let (group, settled) = wait_for_group(&mut conn, Duration::from_secs(30), |g| {
            converged(g)
                && g.members
                    .iter()
                    .filter(|m| m.live)
                    .map(|m| &m.member_id)
                    .collect::<BTreeSet<_>>()
                    == live.iter().collect()
        })
        .await;
        assert!(
            settled,
            "restart {restart}: the group did not converge: {group:#?}"
        );
    }
    let restarting = started.elapsed();
    let published = publisher.stop();
    assert_nothing_lost(&recorder, &published, Duration::from_secs(30)).await;
    assert_no_pending(&mut conn, 0..SHARDS).await;

    let mut per_shard = BTreeMap::new();
    for shard in 0..SHARDS {
        let names = consumers(&mut conn, shard).await;
        assert!(
            names.len() <= LIVE + 1,
            "shard {shard} has {} Redis consumers (live members {LIVE}): {names:?}",
            names.len()
        );
        per_shard.insert(shard, names.len());
    }
    eprintln!(
        "{total} restarts in {restarting:?} ({} member ids in all); consumers per shard at the end: {per_shard:?}; {} entries published",
        ever.len(),
        published.len()
    );
    assert_eq!(ever.len(), LIVE + total);
    drop(processes);
}

/// The runtime on a 3-master cluster (the leases and each shard on their own slots): a member's
/// takeover claims a departed consumer's pending entry, then deletes that consumer and an idle
/// one on every shard, keeping only the live members' consumers; the claimed entry is handled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn takeovers_delete_the_consumers_of_departed_members_on_a_cluster() {
    const SHARDS: u32 = 4;
    let _serial = SERIAL.lock().await;
    let cluster = RedisCluster::start().unwrap();
    let target = RedisTarget::cluster(cluster.urls());
    let mut conn = connect(&target).await;
    admin::create_stream(&mut conn, STREAM, SHARDS)
        .await
        .unwrap();
    admin::register_group(&mut conn, STREAM, GROUP, StartFrom::Earliest)
        .await
        .unwrap();
    for shard in 0..SHARDS {
        consumer_with(&mut conn, shard, "departed-idle-m0", 1, 1).await;
    }
    consumer_with(&mut conn, 0, "departed-busy-m0", 1, 0).await;
    let busy_entry = pending_of(&mut conn, 0, "departed-busy-m0").await;
    assert_eq!(busy_entry.len(), 1);

    let recorder = Arc::new(Recorder::default());
    let listener = start_recording(&target, &recorder, options(2), Duration::ZERO).await;
    let members: BTreeSet<String> = listener.member_ids().into_iter().collect();
    let end = Instant::now() + Duration::from_secs(20);
    let mut last = BTreeMap::new();
    loop {
        let mut all_clean = true;
        for shard in 0..SHARDS {
            let names: BTreeSet<String> = consumers(&mut conn, shard).await.into_keys().collect();
            all_clean &= names.is_subset(&members) && !names.is_empty();
            last.insert(shard, names);
        }
        if all_clean || Instant::now() >= end {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for (shard, names) in &last {
        assert!(
            names.is_subset(&members) && !names.is_empty(),
            "shard {shard}: consumers {names:?}, live members {members:?}"
        );
    }
    let handled = wait_until(Duration::from_secs(10), || {
        recorder.handled().contains(&(0, busy_entry[0].clone()))
    })
    .await;
    assert!(
        handled,
        "the departed member's pending entry was not handled"
    );
    listener.shutdown_and_wait().await.expect("clean shutdown");
}

/// A member that was live at a shard's takeover and left afterwards keeps its Redis consumer on
/// that shard until the next takeover, unless the owner's periodic maintenance pass (every
/// `retention_interval`, docs/design.md §8.15) removes it: one planted after the takeover (0
/// pending) goes within a few passes; the owner's own consumer stays. (A consumer with pending
/// entries is never deleted: the script tests above; one cannot be planted here, the running
/// owner would read the entry first.)
#[tokio::test]
async fn the_maintenance_pass_deletes_consumers_of_members_that_left_after_the_takeover() {
    let (_serial, server, target, mut conn, recorder) = Context::serial(1).await.parts();
    support::preload(&server.client(), &[0], 3, 0);
    let mut options = support::options(1);
    options.retention_interval = Duration::from_millis(200);
    let handle = support::start_recording(&target, &recorder, options, Duration::ZERO).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while recorder.handled().len() < 3 {
        assert!(
            Instant::now() < deadline,
            "the listener handled {:?}",
            recorder.handled()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The takeover is over (its cleanup ran before the first read), and the group is STABLE
    // with its one member owning its target: no further fence raise, so no further takeover
    // cleanup. This consumer appears after it.
    support::settle(&mut conn, 1, Duration::from_secs(20)).await;
    let owner: Vec<String> = consumers(&mut conn, 0).await.into_keys().collect();
    assert_eq!(owner.len(), 1, "{owner:?}");
    consumer_with(&mut conn, 0, "left-idle", 0, 0).await;
    assert!(consumers(&mut conn, 0).await.contains_key("left-idle"));

    // 25 passes at 200 ms.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let now = consumers(&mut conn, 0).await;
        if !now.contains_key("left-idle") {
            assert_eq!(now.into_keys().collect::<Vec<_>>(), owner);
            break;
        }
        assert!(Instant::now() < deadline, "still there after 5 s: {now:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    handle.shutdown_and_wait().await.expect("clean shutdown");
}
