//! Zombie members and fencing in Redis (docs/design.md §6.7 member rules, §8: a zombie
//! member must not work on after eviction).
//!
//! A member process `P` is frozen with `SIGSTOP` for longer than its lease while an in-process
//! member `L` takes its shards over (its heartbeats stall while the process lives: its clocks run
//! on). Then, with `P`'s own fencing token (read from the shard's fence before the freeze), a
//! stale read and a stale ack are sent after `L` raised the fence: Redis refuses both in strict
//! mode; in `acks` mode the ack is refused and the read passes. `P` is then let run again: it
//! must not read or start a handler on any shard before it is assigned one again, no two members
//! ever read one shard at once (from the log of reads per shard), and nothing is lost.
//!
//! Timings: heartbeat 200 ms, lease 1.5 s, rebalance timeout 3 s; 4 shards, 100 msg/s.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::AsyncCommands;
use stream_listener::core::handler::HandlerError;
use stream_listener::core::internals::admin;
use stream_listener::core::internals::connection::RedisConnection;
use stream_listener::core::internals::dataplane::{Fenced, FencingMode, ReadOutcome, ShardClient};
use stream_listener::core::internals::fence::FenceToken;
use stream_listener::core::internals::keys::StreamKeys;
use stream_listener::core::model::MemberState;
use support::*;

async fn fence_of(conn: &mut RedisConnection, shard: u32) -> Option<FenceToken> {
    let value: Option<String> = conn
        .hget(StreamKeys::new(STREAM).unwrap().fence(shard), GROUP)
        .await
        .unwrap();
    value.and_then(|v| FenceToken::decode(&v))
}

/// Per shard, the reads of each tenure (a member's reads after one `Assigned` event of it for
/// that shard) as `[first, last]`; asserts that tenures of different members never overlap.
fn assert_one_reader_at_a_time(events: &[Ev]) -> BTreeMap<u32, Vec<(String, u64, u64)>> {
    let mut events: Vec<&Ev> = events.iter().collect();
    events.sort_by_key(|e| e.at_us());
    // (member, shard) -> index of its current tenure in `tenures[shard]`.
    let mut current: BTreeMap<(String, u32), usize> = BTreeMap::new();
    let mut tenures: BTreeMap<u32, Vec<(String, u64, u64)>> = BTreeMap::new();
    for event in events {
        match event {
            Ev::Assigned { member, shard, .. } => {
                current.remove(&(member.clone(), *shard));
            }
            Ev::Read {
                at_us,
                member,
                shard,
                ..
            } => {
                let list = tenures.entry(*shard).or_default();
                let index = *current.entry((member.clone(), *shard)).or_insert_with(|| {
                    list.push((member.clone(), *at_us, *at_us));
                    list.len() - 1
                });
                list[index].2 = *at_us;
            }
            _ => {}
        }
    }
    for (shard, list) in &tenures {
        for (i, a) in list.iter().enumerate() {
            for b in &list[i + 1..] {
                if a.0 != b.0 {
                    assert!(
                        a.2 < b.1 || b.2 < a.1,
                        "shard {shard}: {} read in [{}, {}] and {} in [{}, {}] (µs): two readers \
                         at once; tenures {list:?}",
                        a.0,
                        a.1,
                        a.2,
                        b.0,
                        b.1,
                        b.2
                    );
                }
            }
        }
    }
    tenures
}

/// Waits until `l` holds the fence of every shard of `shards` and `p` has nothing pending there
/// (L claimed it); returns L's tokens.
async fn wait_for_takeover(
    conn: &mut RedisConnection,
    shards: &[u32],
    l: &str,
    p: &str,
) -> BTreeMap<u32, FenceToken> {
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let mut tokens = BTreeMap::new();
        let mut claimed = true;
        for &shard in shards {
            if let Some(t) = fence_of(conn, shard).await
                && t.member_id == l
            {
                tokens.insert(shard, t);
            }
            claimed &= pending_of(conn, shard, p).await.is_empty();
        }
        if tokens.len() == shards.len() && claimed {
            return tokens;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{l} did not take {p}'s shards {shards:?} over: fences {tokens:?}, claimed {claimed}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn zombie(mode: FencingMode) {
    let (_serial, server, target, mut conn, recorder) = Context::serial(4).await.parts();
    let mut l_options = options(1);
    l_options.fencing = mode;
    let l = start_recording(&target, &recorder, l_options, Duration::ZERO).await;
    let l_id = l.member_ids()[0].clone();
    let mode_arg = match mode {
        FencingMode::Strict => "strict",
        FencingMode::Acks => "acks",
    };
    // P: one member, 100 ms handlers, batches of 4: always some entries in hand.
    let p = MemberProcess::spawn(
        &server.url(),
        &[
            "--handler-ms",
            "100",
            "--batch-size",
            "4",
            "--fencing",
            mode_arg,
        ],
        recorder.clone(),
    );
    let p_id = p.members[0].clone();
    let group = settle(&mut conn, 2, Duration::from_secs(20)).await;
    let p_shards: Vec<u32> = target_shards(&group, &p_id);
    assert_eq!(p_shards.len(), 2);

    let publisher = SteadyPublisher::start(
        server.client(),
        (0..4).collect(),
        Duration::from_millis(40),
        0,
    );
    let busy = wait_until(Duration::from_secs(10), || {
        let calls = recorder.calls();
        p_shards.iter().all(|s| {
            calls
                .iter()
                .filter(|c| c.shard == *s && c.member == p_id)
                .count()
                >= 2
        })
    })
    .await;
    assert!(busy, "P is not handling its shards");
    let mut p_tokens = BTreeMap::new();
    for &shard in &p_shards {
        let token = fence_of(&mut conn, shard)
            .await
            .expect("P raised the fence");
        assert_eq!(token.member_id, p_id);
        p_tokens.insert(shard, token);
    }

    // Freeze P. What it holds once its last commands have landed: its PEL per shard.
    let frozen_at = now_us();
    p.freeze();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut p_pel: BTreeMap<u32, Vec<String>> = BTreeMap::new();
    for &shard in &p_shards {
        p_pel.insert(shard, pending_of(&mut conn, shard, &p_id).await);
    }
    let in_hand: usize = p_pel.values().map(Vec::len).sum();
    assert!(in_hand > 0, "P held no entry when frozen");

    // L takes the shards over once P's lease has run out: it raises the fences (higher member
    // epoch) and claims P's pending entries.
    let l_tokens = wait_for_takeover(&mut conn, &p_shards, &l_id, &p_id).await;
    let taken_at = now_us();
    eprintln!(
        "L raised the fences {} ms after the freeze",
        ms(taken_at - frozen_at)
    );
    for &shard in &p_shards {
        assert!(
            (l_tokens[&shard].incarnation, l_tokens[&shard].member_epoch)
                > (p_tokens[&shard].incarnation, p_tokens[&shard].member_epoch),
            "L's token is not above P's"
        );
    }

    // The stale read and the stale ack, with P's consumer name and P's token, after L raised
    // the fence.
    let mut zombie =
        ShardClient::new(conn.clone(), StreamKeys::new(STREAM).unwrap(), GROUP, &p_id).unwrap();
    if mode == FencingMode::Acks {
        // An unfenced stale read would take entries into P's PEL, where only a sweep by L finds
        // them (see `acks_mode_entries_a_zombie_read_are_claimed_by_the_owner`); here the
        // read runs when L has read everything, to show that the fence does not refuse it.
        publisher.pause();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let so_far = publisher.published();
        let caught_up = wait_until(Duration::from_secs(10), || {
            let calls = recorder.calls();
            so_far
                .iter()
                .filter(|p| p_shards.contains(&p.shard))
                .all(|p| {
                    calls
                        .iter()
                        .any(|c| c.shard == p.shard && c.entry_id == p.id)
                })
        })
        .await;
        assert!(caught_up, "L did not catch up on P's shards");
    }
    for &shard in &p_shards {
        let refused = Fenced::Higher {
            found: Some(l_tokens[&shard].clone()),
        };
        let ack = zombie
            .ack(shard, &p_tokens[&shard], &p_pel[&shard])
            .await
            .unwrap();
        assert_eq!(ack, Err(refused.clone()), "stale ack on shard {shard}");
        let read = zombie
            .read_new(shard, &p_tokens[&shard], 10, mode)
            .await
            .unwrap();
        match mode {
            FencingMode::Strict => {
                assert_eq!(
                    read,
                    ReadOutcome::Fenced(refused),
                    "stale read on shard {shard}"
                );
                assert!(
                    pending_of(&mut conn, shard, &p_id).await.is_empty(),
                    "the refused read delivered entries to P"
                );
            }
            _ => {
                // Reads rely on the lease alone in this mode: the fence does not refuse it (and
                // there is nothing new to read).
                assert!(
                    matches!(read, ReadOutcome::Empty { .. }),
                    "acks-mode stale read: {read:?}"
                );
            }
        }
    }
    publisher.resume();

    // Let P run again: it must not read nor start a handler before it is assigned a shard again.
    let thawed_at = now_us();
    p.thaw();
    let (group, settled) = wait_for_group(&mut conn, Duration::from_secs(20), |g| {
        converged(g)
            && g.members.iter().filter(|m| m.live).count() == 2
            && g.members
                .iter()
                .any(|m| m.member_id == p_id && !m.owned.is_empty())
    })
    .await;
    assert!(settled, "P did not rejoin: {group:#?}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let published = publisher.stop();
    let all = wait_until(Duration::from_secs(20), || {
        all_handled(&published, &recorder.handled())
    })
    .await;

    let events = recorder.events();
    let calls = recorder.calls();
    let reassigned_at: BTreeMap<u32, u64> = events
        .iter()
        .filter_map(|e| match e {
            Ev::Assigned {
                at_us,
                member,
                shard,
                ..
            } if *member == p_id && *at_us > thawed_at => Some((*shard, *at_us)),
            _ => None,
        })
        .fold(BTreeMap::new(), |mut m, (s, at)| {
            m.entry(s).or_insert(at);
            m
        });
    // P's, after its freeze, and before its shard was given to another member.
    let stale = |member: &str, at_us: u64, shard: u32| {
        member == p_id && at_us > frozen_at && reassigned_at.get(&shard).is_none_or(|r| at_us < *r)
    };
    let stale_reads: Vec<&Ev> = events
        .iter()
        .filter(
            |e| matches!(e, Ev::Read { at_us, member, shard, .. } if stale(member, *at_us, *shard)),
        )
        .collect();
    assert_none(&stale_reads, "P read after its lease");
    let stale_starts: Vec<&Call> = calls
        .iter()
        .filter(|c| stale(&c.member, c.at_us, c.shard))
        .collect();
    assert_none(&stale_starts, "P started handlers after its lease");
    let rejections: Vec<&Ev> = events
        .iter()
        .filter(|e| matches!(e, Ev::Fence { member, .. } if *member == p_id))
        .collect();
    eprintln!("fence rejections P saw itself after the thaw: {rejections:?}");

    // One reader at a time on every shard, over the whole run.
    let tenures = assert_one_reader_at_a_time(&events);
    for &shard in &p_shards {
        let readers: Vec<&str> = tenures[&shard].iter().map(|t| t.0.as_str()).collect();
        assert!(
            readers.len() >= 2 && readers[0] == p_id && readers[1] == l_id,
            "{readers:?}"
        );
    }

    // Nothing lost; what P held at the freeze was processed by L after the freeze.
    assert_all_handled(&published, &recorder.handled());
    assert!(all);
    for (&shard, ids) in &p_pel {
        for id in ids {
            assert!(
                calls.iter().any(|c| c.shard == shard
                    && c.entry_id == *id
                    && c.member == l_id
                    && c.at_us > frozen_at),
                "{id} of shard {shard}, held by P at the freeze, was not handled by L"
            );
        }
    }
    // Duplicates are limited to what P held at the freeze (finished but not yet acked, or in
    // hand): every entry handled by both members was in P's PEL then.
    let by: BTreeMap<(u32, String), BTreeSet<String>> =
        calls.iter().fold(BTreeMap::new(), |mut m, c| {
            m.entry((c.shard, c.entry_id.clone()))
                .or_default()
                .insert(c.member.clone());
            m
        });
    let duplicates: Vec<&(u32, String)> = by
        .iter()
        .filter(|(_, members)| members.len() > 1)
        .map(|(k, _)| k)
        .collect();
    for (shard, id) in &duplicates {
        assert!(
            p_pel.get(shard).is_some_and(|ids| ids.contains(id)),
            "{id} of shard {shard} handled by two members but not held by P at the freeze"
        );
    }
    eprintln!(
        "P held {in_hand} entries at the freeze; {} handled twice",
        duplicates.len()
    );
    for shard in 0..4 {
        assert_eq!(pending_count(&mut conn, shard).await, 0, "shard {shard}");
    }
    l.shutdown_and_wait().await.expect("clean shutdown");
    let (_, clean) = p.terminate();
    assert!(clean, "P did not exit cleanly on SIGTERM");
}

tests_of!(zombie {
    zombie_with_strict_fencing_stops_reading_and_redis_refuses_its_stale_read_and_ack =>
        FencingMode::Strict,
    zombie_with_acks_fencing_has_its_stale_ack_refused => FencingMode::Acks,
});

/// How long the owner may take to sweep entries other consumers hold on its shards in `acks` mode
/// (docs/design.md §8: "claimed at takeover and by a periodic sweep"; the period is not specified):
/// ten lease TTLs.
const SWEEP_WAIT: Duration = Duration::from_secs(15);

/// `acks` mode: reads are not fenced, so a zombie that passes its lease check late can take new
/// entries into its own PEL after the owner's takeover claim. The zombie then dies for good: only
/// the owner's periodic sweep can bring those entries to a handler (nothing lost).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_mode_entries_a_zombie_read_after_the_takeover_are_swept_by_the_owner() {
    let (_serial, server, target, mut conn, recorder) = Context::serial(4).await.parts();
    let mut l_options = options(1);
    l_options.fencing = FencingMode::Acks;
    let l = start_recording(&target, &recorder, l_options, Duration::ZERO).await;
    let l_id = l.member_ids()[0].clone();
    let mut p = MemberProcess::spawn(&server.url(), &["--fencing", "acks"], recorder.clone());
    let p_id = p.members[0].clone();
    let group = settle(&mut conn, 2, Duration::from_secs(20)).await;
    let p_shards: Vec<u32> = target_shards(&group, &p_id);
    let mut p_tokens = BTreeMap::new();
    for &shard in &p_shards {
        let token = wait_for_fence(&mut conn, shard, &p_id).await;
        p_tokens.insert(shard, token);
    }
    let publisher = SteadyPublisher::start(
        server.client(),
        (0..4).collect(),
        Duration::from_millis(40),
        0,
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    p.freeze();
    wait_for_takeover(&mut conn, &p_shards, &l_id, &p_id).await;

    // The zombie's late reads, with its own token: unfenced in this mode, they race L for new
    // entries until they have taken some.
    let mut zombie =
        ShardClient::new(conn.clone(), StreamKeys::new(STREAM).unwrap(), GROUP, &p_id).unwrap();
    let mut stolen: Vec<(u32, String)> = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while stolen.is_empty() && std::time::Instant::now() < deadline {
        for &shard in &p_shards {
            if let ReadOutcome::Entries(entries) = zombie
                .read_new(shard, &p_tokens[&shard], 10, FencingMode::Acks)
                .await
                .unwrap()
            {
                stolen.extend(entries.into_iter().map(|e| (shard, e.id)));
            }
        }
    }
    assert!(
        !stolen.is_empty(),
        "the zombie's unfenced reads never won an entry"
    );
    for (shard, id) in &stolen {
        assert!(pending_of(&mut conn, *shard, &p_id).await.contains(id));
    }
    // The zombie dies for good.
    p.kill();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let published = publisher.stop();
    let all = wait_until(SWEEP_WAIT, || all_handled(&published, &recorder.handled())).await;
    let handled = recorder.handled();
    let lost: Vec<&(u32, String)> = stolen.iter().filter(|e| !handled.contains(e)).collect();
    assert!(
        lost.is_empty() && all,
        "{} entries the zombie read after the takeover are still pending for it {} s later, never \
         handled: {lost:?}",
        lost.len(),
        SWEEP_WAIT.as_secs()
    );
    assert_all_handled(&published, &handled);
    for shard in 0..4 {
        assert_eq!(pending_count(&mut conn, shard).await, 0, "shard {shard}");
    }
    l.shutdown_and_wait().await.expect("clean shutdown");
}

/// Waits until `member` holds shard `shard`'s fence; returns its token.
async fn wait_for_fence(conn: &mut RedisConnection, shard: u32, member: &str) -> FenceToken {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(t) = fence_of(conn, shard).await
            && t.member_id == member
        {
            return t;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{member} never raised shard {shard}'s fence"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A retry waits out its backoff; if the lease lapsed meanwhile (heartbeats refused by an ACL
/// that allows only the data-plane keys, for 4 s), no attempt runs without it: the shard's next
/// owner could be running the same entry (found by the breaker). Once heartbeats pass again the
/// entry is handled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_retry_runs_after_the_lease_lapsed_during_its_backoff() {
    let (_serial, server, target, mut conn, recorder) = Context::serial(1).await.parts();
    let mut opts = options(1);
    opts.max_attempts = 3;
    opts.backoff = Duration::from_millis(2500); // > LEASE (1.5 s)
    opts.events = Some(recorder.callback());
    let window: Arc<Mutex<Option<(u64, u64)>>> = Arc::new(Mutex::new(None));
    let client = redis::Client::open(server.url()).unwrap();
    let w = window.clone();
    let behaviour: Behaviour = Arc::new(move |delivery| {
        if payload_n(delivery) == Some(1) && delivery.attempt == 1 && w.lock().unwrap().is_none() {
            let mut sync = client.get_connection().unwrap();
            let _: () = redis::cmd("ACL")
                .arg(&["SETUSER", "default", "resetkeys", "~{orders:*"])
                .query(&mut sync)
                .unwrap();
            let denied = now_us();
            *w.lock().unwrap() = Some((denied, denied + 4_000_000));
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_secs(4));
                let _: () = redis::cmd("ACL")
                    .arg(&["SETUSER", "default", "allkeys"])
                    .query(&mut sync)
                    .unwrap();
            });
            return Err(HandlerError::retryable("downstream timeout"));
        }
        Ok(())
    });
    let listener = start_listener(
        &target,
        recording_handler(recorder.clone(), Duration::ZERO, Some(behaviour)),
        opts,
    )
    .await;
    let (group, settled) = wait_for_group(&mut conn, Duration::from_secs(20), converged).await;
    assert!(settled, "{group:#?}");
    xadd_fields(&mut conn, 0, &[("key", "k"), ("payload", r#"{"n":1}"#)]).await;
    tokio::time::sleep(Duration::from_secs(7)).await;
    let (denied, restored) = window.lock().unwrap().expect("first attempt ran");
    let lease_end = denied + LEASE.as_micros() as u64;
    let calls = recorder.calls();
    let without_lease: Vec<_> = calls
        .iter()
        .filter(|c| c.at_us > lease_end && c.at_us < restored)
        .collect();
    assert!(
        without_lease.is_empty(),
        "handler called after the lease had passed (denied at {denied} µs, lease over at {lease_end}, restored at {restored}): {without_lease:?}"
    );
    let handled = wait_until(Duration::from_secs(15), || {
        recorder.handled().iter().any(|(shard, _)| *shard == 0)
    })
    .await;
    listener.shutdown_and_wait().await.expect("clean shutdown");
    assert!(handled, "the entry was never handled: {calls:?}");
}

/// Rewrites `member`'s record as the coordinator does when it fences a member (state `FENCED`;
/// the fast-path answer and `steady` removed so its next heartbeat runs the full transition;
/// `revision` bumped so a transition loaded before fails its compare-and-set). Its next heartbeat
/// is answered `FENCED_MEMBER_EPOCH` (docs/design.md §6.4 coordinator rule 3).
async fn force_fenced(conn: &mut RedisConnection, member: &str) {
    let script = redis::Script::new(
        r#"
        local field = 'member:' .. ARGV[1]
        local record = redis.call('HGET', KEYS[1], field)
        if not record then return 0 end
        record = string.gsub(record, '"state":"[A-Z_]+"', '"state":"FENCED"', 1)
        redis.call('HSET', KEYS[1], field, record)
        redis.call('HDEL', KEYS[1], 'fast:' .. ARGV[1], 'steady')
        redis.call('HINCRBY', KEYS[1], 'revision', 1)
        return 1
        "#,
    );
    let key = format!("sl:{{{STREAM}:{GROUP}}}:group");
    let done: i64 = script
        .key(key)
        .arg(member)
        .invoke_async(conn)
        .await
        .unwrap();
    assert_eq!(done, 1, "no record of member {member}");
}

/// What [`block_then_fence`] saw.
struct BlockedRun {
    owner: String,
    /// Start and end of the blocked handler, µs.
    start: u64,
    end: u64,
    fenced_at: u64,
    /// When `describe` first showed the owner ACTIVE again after the fencing (it rejoined), µs.
    rejoined_at: Option<u64>,
    calls: Vec<Call>,
    events: Vec<Ev>,
    all_handled: bool,
}

/// Two listeners (heartbeat 200 ms, lease 3 s) share one shard; its owner's handler blocks its
/// thread for `block` on the first entry (neither the stop token nor a drop can end it), and while
/// it blocks the owner's record is rewritten as fenced. Five more entries follow the blocking one.
async fn block_then_fence(handler_timeout: Duration, block: Duration) -> BlockedRun {
    let (_serial, _server, target, mut conn, recorder) = Context::start(1).await.parts();
    // (start, end) of the blocked handler, µs.
    let window: Arc<Mutex<(u64, u64)>> = Arc::new(Mutex::new((0, 0)));
    let w = window.clone();
    let behaviour: Behaviour = Arc::new(move |delivery| {
        if payload_n(delivery) == Some(0) && w.lock().unwrap().0 == 0 {
            let start = now_us();
            w.lock().unwrap().0 = start;
            // `block_in_place`: the worker's other tasks move to another thread, so only this
            // shard task waits (a plain blocking call could also strand the member's heartbeat
            // task in this worker's queue, which is tokio's matter, not the member's).
            tokio::task::block_in_place(|| std::thread::sleep(block));
            w.lock().unwrap().1 = now_us();
        }
        Ok(())
    });
    let mut listeners = Vec::new();
    for _ in 0..2 {
        let mut opts = options(1);
        opts.coordination = coordination(HEARTBEAT, Duration::from_secs(3), REBALANCE);
        opts.handler_timeout = handler_timeout;
        opts.events = Some(recorder.callback());
        let listener = start_listener(
            &target,
            recording_handler(recorder.clone(), Duration::ZERO, Some(behaviour.clone())),
            opts,
        )
        .await;
        listeners.push(listener);
    }
    let group = settle(&mut conn, 2, Duration::from_secs(20)).await;
    let owner = target_of(&group)[&0].clone();

    for n in 0..6u64 {
        xadd_fields(
            &mut conn,
            0,
            &[("key", "k"), ("payload", &format!("{{\"n\":{n}}}"))],
        )
        .await;
    }
    assert!(
        wait_until(Duration::from_secs(10), || window.lock().unwrap().0 != 0).await,
        "the blocking handler never started"
    );
    force_fenced(&mut conn, &owner).await;
    let fenced_at = now_us();
    let mut rejoined_at = None;
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    let all_handled = loop {
        if rejoined_at.is_none() {
            let group = describe(&mut conn).await;
            if group
                .members
                .iter()
                .any(|m| m.member_id == owner && m.state == MemberState::Active)
            {
                rejoined_at = Some(now_us());
            }
        }
        let done = recorder.handled().len() == 6 && window.lock().unwrap().1 != 0;
        if (done && rejoined_at.is_some()) || std::time::Instant::now() >= deadline {
            break done;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let (start, end) = *window.lock().unwrap();
    for listener in listeners {
        listener.shutdown_and_wait().await.expect("clean shutdown");
    }
    BlockedRun {
        owner,
        start,
        end,
        fenced_at,
        rejoined_at,
        calls: recorder.calls(),
        events: recorder.events(),
        all_handled,
    }
}

/// docs/design.md §6.8: after a fencing status a member stops its shard tasks, but a handler that
/// ignores cancellation (here it blocks its thread for 1.5 s) keeps running. The member must not
/// rejoin (which releases its holdings at once, coordinator rule 4) before that task has stopped:
/// the shard is neither read nor handled, on any member, while the old handler still runs. Lease
/// 3 s, so the blocked handler ends well inside the fenced member's lease: only the rejoin can
/// release the shard early. `handler_timeout` 5 s bounds the wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fenced_member_rejoins_only_after_its_blocked_handler_returned() {
    let _serial = SERIAL.lock().await;
    let run = block_then_fence(Duration::from_secs(5), Duration::from_millis(1500)).await;
    let BlockedRun {
        owner,
        start,
        end,
        fenced_at,
        ..
    } = &run;
    // The fencing status reached the owner while its handler was blocked (it stopped the shard).
    let stopped_during_block = run.events.iter().any(|e| {
        matches!(e, Ev::Revoked { at_us, member, shard: 0, .. }
            if member == owner && at_us >= fenced_at && at_us < end)
    });
    assert!(
        stopped_during_block,
        "the owner {owner} got no fencing status while blocked ({start}..{end} µs): {:?}",
        run.events
    );
    // Neither a read of the shard (the next tenure, on this member or another) nor a handler
    // start while the fenced handler still runs.
    let reads: Vec<&Ev> = run
        .events
        .iter()
        .filter(|e| matches!(e, Ev::Read { at_us, shard: 0, .. } if at_us > start && at_us < end))
        .collect();
    let overlapping: Vec<&Call> = run
        .calls
        .iter()
        .filter(|c| c.shard == 0 && c.at_us > *start && c.at_us < *end)
        .collect();
    assert!(
        reads.is_empty() && overlapping.is_empty(),
        "shard 0 was read or handled while {owner}'s fenced handler still ran ({start}..{end} µs): \
         reads {reads:#?}, handler starts {overlapping:#?}"
    );
    assert!(
        run.rejoined_at.is_some_and(|at| at >= *end),
        "the owner rejoined at {:?}, before its handler ended at {end} µs",
        run.rejoined_at
    );
    assert!(
        run.all_handled,
        "not every entry was handled: {:?}",
        run.calls
    );
}

/// The wait of finding 4 is bounded by `handler_timeout` (800 ms here): a handler that ignores
/// cancellation for longer (2.5 s) does not keep the fenced member out of the group; it rejoins
/// once the timeout has passed (with an error in its log), before the handler returns, and every
/// entry is handled. (Without the wait it rejoins one heartbeat after the fencing status.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fenced_member_waits_for_a_stuck_handler_only_up_to_handler_timeout() {
    let _serial = SERIAL.lock().await;
    let run = block_then_fence(Duration::from_millis(800), Duration::from_millis(2500)).await;
    let rejoined_at = run.rejoined_at.expect("the fenced owner never rejoined");
    assert!(
        rejoined_at < run.end,
        "the owner rejoined at {rejoined_at} µs, only after its stuck handler ended at {} µs",
        run.end
    );
    assert!(
        rejoined_at >= run.fenced_at + 800_000,
        "the owner rejoined {} ms after the fencing, before handler_timeout (800 ms)",
        ms(rejoined_at - run.fenced_at)
    );
    assert!(
        run.all_handled,
        "not every entry was handled: {:?}",
        run.calls
    );
}

/// docs/design.md §6.8 and §8.9: the handler-attempt count of a re-delivered
/// entry is removed (`HDEL`, not fenced) when its attempt finishes, before the ack. A handler
/// that ignores cancellation and returns after its member was fenced used to remove it too,
/// although its task may no longer ack: the shard's next tenure (here the same member after
/// its rejoin) had counted its own attempt meanwhile, and that count was wiped, so an entry
/// that kills its processes could escape `max_deliveries`. The stopped task must leave the
/// count alone (its own attempt stays counted, as a cancelled one does).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fenced_handler_returning_late_does_not_remove_the_next_tenures_attempt_count() {
    let (_serial, _server, target, mut conn, _) = Context::serial(1).await.parts();
    admin::register_group(
        &mut conn,
        STREAM,
        GROUP,
        stream_listener::core::model::StartFrom::Earliest,
    )
    .await
    .unwrap();
    let entry = xadd_fields(&mut conn, 0, &[("key", "k"), ("payload", r#"{"n":0}"#)]).await;
    // Delivered before (a handover): its attempts are counted.
    let _: redis::Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg(GROUP)
        .arg("crasher")
        .arg("STREAMS")
        .arg("{orders:0}")
        .arg(">")
        .query_async(&mut conn)
        .await
        .unwrap();
    // The first attempt blocks its thread for 2.5 s; the second until the test releases it.
    let first_end = Arc::new(Mutex::new(0u64));
    let release = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let calls = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let (e, r, c) = (first_end.clone(), release.clone(), calls.clone());
    let behaviour: Behaviour = Arc::new(move |delivery| {
        if payload_n(delivery) != Some(0) {
            return Ok(());
        }
        let call = c.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        tokio::task::block_in_place(|| {
            if call == 0 {
                std::thread::sleep(Duration::from_millis(2500));
                *e.lock().unwrap() = now_us();
            } else {
                let end = std::time::Instant::now() + Duration::from_secs(10);
                while !r.load(std::sync::atomic::Ordering::SeqCst)
                    && std::time::Instant::now() < end
                {
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        });
        Ok(())
    });
    let recorder = Arc::new(Recorder::default());
    let mut opts = options(1);
    opts.coordination = coordination(HEARTBEAT, Duration::from_secs(3), REBALANCE);
    opts.handler_timeout = Duration::from_millis(800);
    opts.events = Some(recorder.callback());
    let listener = start_listener(
        &target,
        recording_handler(recorder.clone(), Duration::ZERO, Some(behaviour)),
        opts,
    )
    .await;
    assert!(
        wait_until(Duration::from_secs(10), || calls
            .load(std::sync::atomic::Ordering::SeqCst)
            == 1)
        .await,
        "the first attempt never started"
    );
    let group = describe(&mut conn).await;
    let owner = target_of(&group)[&0].clone();
    force_fenced(&mut conn, &owner).await;
    // The member rejoins after handler_timeout; its next tenure counts a second attempt while
    // the first still blocks, and starts it once the first has returned its worker (one).
    let second = wait_until(Duration::from_secs(10), || {
        calls.load(std::sync::atomic::Ordering::SeqCst) == 2
    })
    .await;
    let field = format!("{GROUP}|{entry}");
    let count = |conn: &mut RedisConnection| {
        let mut conn = conn.clone();
        let field = field.clone();
        async move {
            redis::cmd("HGET")
                .arg("{orders:0}:attempts")
                .arg(&field)
                .query_async::<Option<u64>>(&mut conn)
                .await
                .unwrap()
        }
    };
    let counted = count(&mut conn).await;
    assert!(
        second && counted == Some(2),
        "second attempt started: {second}, count {counted:?}"
    );
    // The first attempt returns; for a second after it, the count must stay.
    assert!(
        wait_until(Duration::from_secs(10), || *first_end.lock().unwrap() != 0).await,
        "the first attempt never returned"
    );
    let end = std::time::Instant::now() + Duration::from_secs(1);
    let mut seen = count(&mut conn).await;
    while seen == Some(2) && std::time::Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(20)).await;
        seen = count(&mut conn).await;
    }
    release.store(true, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(
        seen,
        Some(2),
        "the fenced task's late return removed the next tenure's attempt count"
    );
    listener.shutdown_and_wait().await.expect("clean shutdown");
}

/// Asserts that nothing was `found`, naming `what` it would have been and listing it.
fn assert_none<T: std::fmt::Debug>(found: &[T], what: &str) {
    assert!(found.is_empty(), "{what}: {found:?}");
}
