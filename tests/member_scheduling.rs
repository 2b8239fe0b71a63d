//! The shard poller's scheduling (with the idle cost; docs/design.md §7, §8):
//!
//! - one member with one worker (`runtime_max_concurrency = 1`) owning 16 shards that all have
//!   work serves them in strict rotation: every shard in every round;
//! - idle members send a bounded number of commands per second (no busy polling).

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use stream_listener::core::handler::{Delivery, HandlerError};
use stream_listener::core::internals::connection::{RedisConnection, RedisTarget};
use stream_listener::testing::RedisServer;
use support::*;

const SHARDS: u32 = 16;

/// One worker, 16 shards, one entry per read (`batch_size = 1`) and 5 ms handlers; every shard
/// has a backlog from the start (20 entries each) and keeps getting more (one entry per shard
/// every 40 ms: 400 msg/s, twice what the worker can do).
///
/// The assertion — strict rotation: in the sequence of handler calls (from the call at which the
/// last shard first comes, after its takeover), **every window of 16 consecutive calls covers all
/// 16 shards** (at least 95% of them: a stall of the host may make one shard miss one round; every
/// window of 32 calls covers them all), i.e. each shard's consecutive calls are 16
/// calls apart: no shard is served twice while another one with work waits, so every shard is
/// served in every round of 16 calls. Why this holds exactly and is not timing-luck: the worker
/// is a FIFO semaphore taken per batch; a shard re-queues after its batch with its ack and next
/// read (one local round trip, well under a millisecond), while the 15 shards ahead of it need
/// 15 handler calls (≥ 75 ms) before its turn comes back. Also: never two handlers at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_worker_serves_sixteen_shards_in_strict_rotation() {
    let _serial = SERIAL.lock().await;
    let Loaded {
        server,
        target,
        conn: _,
        shards: all,
        mut published,
    } = loaded_stream(SHARDS, 20).await;

    let order: Arc<std::sync::Mutex<Vec<(u32, String)>>> = Arc::default();
    let in_flight = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (order, in_flight, most) = (order.clone(), in_flight.clone(), most.clone());
        move |delivery: Delivery| {
            let (order, in_flight, most) = (order.clone(), in_flight.clone(), most.clone());
            async move {
                let now = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                order
                    .lock()
                    .unwrap()
                    .push((delivery.shard, delivery.entry_id.clone()));
                tokio::time::sleep(Duration::from_millis(5)).await;
                in_flight.fetch_sub(1, Ordering::SeqCst);
                Ok::<(), HandlerError>(())
            }
        }
    };
    let mut opts = options(1);
    opts.runtime_max_concurrency = 1;
    opts.batch_size = 1;
    let listener = start_listener(&target, handler, opts).await;
    let publisher = SteadyPublisher::start(
        server.client(),
        all.clone(),
        Duration::from_millis(40),
        10_000,
    );
    // 2.5 s of calls (~400 calls = 25 rounds), all with every shard backlogged.
    let enough = wait_until(Duration::from_secs(20), || {
        order.lock().unwrap().len() >= 400
    })
    .await;
    assert!(enough, "only {} calls", order.lock().unwrap().len());
    let calls: Vec<u32> = order.lock().unwrap().iter().map(|(s, _)| *s).collect();
    published.extend(publisher.stop());

    assert_eq!(
        most.load(Ordering::SeqCst),
        1,
        "two handlers ran at once with one worker"
    );
    // Rotation starts once every shard has joined the queue: a shard enters it after its
    // takeover (fence raise, claim, own pending entries), and the 16 takeovers do not end at
    // the same instant. From the call where the last shard first comes, it is strict.
    let joined = (0..SHARDS)
        .map(|s| {
            calls
                .iter()
                .position(|c| *c == s)
                .expect("every shard served")
        })
        .max()
        .unwrap();
    assert!(
        joined < 2 * SHARDS as usize,
        "a shard waited {joined} calls for its first turn"
    );
    // No starvation, ever: every shard within any two rounds.
    let window = SHARDS as usize;
    for (offset, rounds) in calls[joined..].windows(2 * window).enumerate() {
        let distinct: BTreeSet<u32> = rounds.iter().copied().collect();
        assert_eq!(
            distinct.len(),
            window,
            "calls {}..{}: a shard waited more than two rounds: {rounds:?}",
            joined + offset,
            joined + offset + 2 * window
        );
    }
    // Strict rotation in (nearly) every round. The only slack: a stall of the host can hold up
    // one shard's re-queue (its ack and read) past the 75 ms its turn takes to come back (a tokio
    // worker descheduled with the task in its slot), and that shard then misses one round; an
    // unfair or LIFO pool breaks nearly every window instead.
    let windows: Vec<&[u32]> = calls[joined..].windows(window).collect();
    let broken: Vec<(usize, &[u32])> = windows
        .iter()
        .enumerate()
        .filter(|(_, round)| round.iter().copied().collect::<BTreeSet<u32>>().len() != window)
        .map(|(offset, round)| (joined + offset, *round))
        .collect();
    assert!(
        broken.len() * 20 <= windows.len(),
        "{} of {} windows of 16 calls are not a full rotation (some shard served twice while \
         another waited): {:?} (first 64 calls: {:?})",
        broken.len(),
        windows.len(),
        &broken[..broken.len().min(4)],
        &calls[..calls.len().min(64)]
    );
    // Every shard got its share: the counts differ by at most one.
    let mut per_shard: BTreeMap<u32, usize> = BTreeMap::new();
    for s in &calls[joined..] {
        *per_shard.entry(*s).or_default() += 1;
    }
    let (low, high) = (
        per_shard.values().min().copied().unwrap(),
        per_shard.values().max().copied().unwrap(),
    );
    assert_eq!(per_shard.len(), SHARDS as usize);
    assert!(high - low <= 2, "{per_shard:?}");
    eprintln!(
        "{} calls, {} of {} windows a full rotation; per shard {low}..={high}",
        calls.len(),
        windows.len() - broken.len(),
        windows.len()
    );

    // Everything is handled in the end, in order per shard.
    let done = wait_until(Duration::from_secs(30), || {
        order.lock().unwrap().len() >= published.len()
    })
    .await;
    assert!(done);
    assert_handled_in_order(&order.lock().unwrap(), &published, &all);
    listener.shutdown_and_wait().await.expect("clean shutdown");
}

/// A throwaway standalone server with the stream created over `shards` shards, each holding
/// `per_shard` entries.
struct Loaded {
    server: RedisServer,
    target: RedisTarget,
    conn: RedisConnection,
    /// `0..shards`.
    shards: Vec<u32>,
    published: Vec<Published>,
}

async fn loaded_stream(shards: u32, per_shard: u64) -> Loaded {
    let (_, server, target, conn, _) = Context::start(shards).await.parts();
    let shards: Vec<u32> = (0..shards).collect();
    let published = preload(&server.client(), &shards, per_shard, 0);
    Loaded {
        server,
        target,
        conn,
        shards,
        published,
    }
}

/// Every published entry of `shards` was handled, in publication order per shard: `handled`
/// holds (shard, entry id) per handler call.
fn assert_handled_in_order(handled: &[(u32, String)], published: &[Published], shards: &[u32]) {
    for &shard in shards {
        let mine: Vec<&String> = handled
            .iter()
            .filter(|(s, _)| *s == shard)
            .map(|(_, id)| id)
            .collect();
        let expected: Vec<&String> = published
            .iter()
            .filter(|p| p.shard == shard)
            .map(|p| &p.id)
            .collect();
        assert_eq!(mine, expected, "shard {shard}");
    }
}

/// Idle cost: 2 members, 8 shards (4 each), heartbeat 200 ms, `block` 500 ms, nothing published
/// for 3 s. Redis's `total_commands_processed` counts the commands a script runs as well as the
/// script call itself, so the bound counts both, from the configuration:
///
/// - heartbeats: ≤ 1 / (0.9 × 200 ms) = 5.6 per second per member (±10% jitter), each the
///   stream's `metadataVersion` and `schema` (two `HGET`s) and one steady-state fast-path script,
///   at most 15 commands in all (`EVALSHA` and, inside, `steady` and `schema`, `meta`'s
///   presence, `TIME`, the member's fields, the earliest lease and deadline, the lease move and
///   its revision — 14 measured, 1 spare): 2 × 5.6 × 15 = 168/s;
/// - idle shards: none of their own. A member waits on all its caught-up shards with one
///   `XREAD BLOCK` (docs/design.md §8.4), and a shard whose wait timed out waits again without a
///   read: one `XREAD` per member per `block` (500 ms): 2 × 2 = 4/s.
///
/// Bound: 172 commands per second. The `schema` and `meta` checks of a steady group added 2
/// commands per heartbeat to the 12 before (bound 140 then); before the shared wait the bound was
/// 215 (a read script and an `XREAD BLOCK` per shard per `block`). A member polling without blocking would send
/// thousands. Also, structurally: at most one `XREAD BLOCK` per member per `block` (+1), 2
/// commands per member per block with the `CLIENT UNBLOCK` that can come with it.
///
/// With `fencing = "acks"` (STREAM_LISTENER_TEST_FENCING=acks), on top, the periodic sweep: once
/// per lease TTL (1.5 s) each shard claims other consumers' entries (`EVALSHA`, the fence `HGET`,
/// `XINFO CONSUMERS`), reads its own pending ones (`EVALSHA`, `XREADGROUP`) and reads new ones
/// again (5): 8 × 10 / 1.5 s = 53.3/s. Bound: 226 (225.3 rounded up).
const IDLE_COMMANDS_PER_SECOND: f64 = 172.0;
const IDLE_COMMANDS_PER_SECOND_ACKS: f64 = 226.0;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_members_send_a_bounded_number_of_commands_per_second() {
    let (_serial, _server, target, mut conn, recorder) = Context::serial(8).await.parts();
    let opts = options(2);
    let bound = match opts.fencing {
        stream_listener::core::internals::dataplane::FencingMode::Acks => {
            IDLE_COMMANDS_PER_SECOND_ACKS
        }
        _ => IDLE_COMMANDS_PER_SECOND,
    };
    let listener = start_recording(&target, &recorder, opts, Duration::ZERO).await;
    settle(&mut conn, 2, Duration::from_secs(20)).await;
    // Let the takeovers finish (every shard waiting on new entries).
    tokio::time::sleep(Duration::from_secs(1)).await;

    let window = Duration::from_secs(3);
    let stats_before = command_calls(&mut conn).await;
    let before = info_number(&mut conn, "stats", "total_commands_processed").await;
    let started = std::time::Instant::now();
    tokio::time::sleep(window).await;
    let after = info_number(&mut conn, "stats", "total_commands_processed").await;
    let elapsed = started.elapsed().as_secs_f64();
    let stats_after = command_calls(&mut conn).await;
    // Our own INFO commands in the window: the commandstats call and the first INFO stats.
    let ours = 2;
    let rate = (after - before - ours) as f64 / elapsed;
    let breakdown: BTreeMap<&String, u64> = stats_after
        .iter()
        .map(|(name, calls)| (name, calls - stats_before.get(name).copied().unwrap_or(0)))
        .filter(|(_, calls)| *calls > 0)
        .collect();
    eprintln!("idle: {rate:.1} commands/s over {elapsed:.2} s; per command: {breakdown:?}");
    assert!(
        rate <= bound,
        "idle members sent {rate:.1} commands/s (bound {bound}); per command in the window: \
         {breakdown:?}"
    );
    let blocks = breakdown.get(&"xread".to_owned()).copied().unwrap_or(0);
    let most_blocks = 2 * ((elapsed / 0.5).ceil() as u64 + 1);
    assert!(
        blocks <= most_blocks,
        "{blocks} XREAD BLOCK calls in {elapsed:.2} s for 2 members (at most {most_blocks})"
    );
    assert!(recorder.calls().is_empty());
    listener.shutdown_and_wait().await.expect("clean shutdown");
}

/// `fencing = "acks"` on a standalone server: a member's shards share one multi-stream
/// `XREADGROUP` per round (docs/design.md §8.7). One member, 4 shards with 500 entries each, batch
/// 25, 4 workers and a handler that finishes at once. Read one shard at a time, the new entries
/// alone take at least 4 × 500 / 25 = 80 `XREADGROUP` calls; in rounds, 20 when the four move
/// in lockstep. `cmdstat_xreadgroup` also counts the reads the scripts make: the takeover's
/// pending read and the empty read at the end (about 3 per shard). Bound: 60, well under the 80
/// that per-shard reads cannot go below. Also: every entry handled once, in order per shard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_acks_mode_a_members_shards_share_one_read_per_round() {
    const PER_SHARD: u64 = 500;
    let _serial = SERIAL.lock().await;
    let Loaded {
        server: _server,
        target,
        mut conn,
        shards,
        published,
    } = loaded_stream(4, PER_SHARD).await;

    let order: Arc<std::sync::Mutex<Vec<(u32, String)>>> = Arc::default();
    let handler = {
        let order = order.clone();
        move |delivery: Delivery| {
            order
                .lock()
                .unwrap()
                .push((delivery.shard, delivery.entry_id.clone()));
            async { Ok::<(), HandlerError>(()) }
        }
    };
    let mut opts = options(1);
    opts.fencing = stream_listener::core::internals::dataplane::FencingMode::Acks;
    opts.runtime_max_concurrency = 4;
    opts.batch_size = 25;
    let listener = start_listener(&target, handler, opts).await;
    let all = published.len();
    let done = wait_until(Duration::from_secs(30), || {
        order.lock().unwrap().len() >= all
    })
    .await;
    assert!(done, "handled {} of {all}", order.lock().unwrap().len());
    listener.shutdown_and_wait().await.expect("clean shutdown");

    let reads = command_calls(&mut conn).await["xreadgroup"];
    eprintln!("{reads} XREADGROUP calls for {all} entries in batches of 25 over 4 shards");
    assert!(
        reads <= 60,
        "{reads} XREADGROUP calls: the shards were not read in shared rounds"
    );
    let handled = order.lock().unwrap().clone();
    assert_eq!(handled.len(), all, "an entry was handled twice");
    assert_handled_in_order(&handled, &published, &shards);
    for shard in 0..4 {
        let pending: Vec<redis::Value> = redis::cmd("XPENDING")
            .arg(format!("{{{STREAM}:{shard}}}"))
            .arg(GROUP)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(
            pending[0],
            redis::Value::Int(0),
            "shard {shard}: entries left unacked"
        );
    }
}

/// The heartbeat reports the workers running a handler (`activeConsumerWorkers`, docs/design.md
/// §6): one member with 3 workers and 4 shards whose handlers wait on a gate shows 3 busy workers
/// in `describe_group` (the fourth shard waits for a worker), and 0 once the gate opens and every
/// entry is handled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_heartbeat_reports_the_busy_workers() {
    let _serial = SERIAL.lock().await;
    let Loaded {
        server: _server,
        target,
        mut conn,
        published,
        ..
    } = loaded_stream(4, 1).await;

    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let handled = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (gate, handled) = (gate.clone(), handled.clone());
        move |_: Delivery| {
            let (gate, handled) = (gate.clone(), handled.clone());
            async move {
                let _pass = gate.acquire().await;
                handled.fetch_add(1, Ordering::SeqCst);
                Ok::<(), HandlerError>(())
            }
        }
    };
    let mut opts = options(1);
    opts.runtime_max_concurrency = 3;
    let listener = start_listener(&target, handler, opts).await;

    let busy = active_workers_reach(&mut conn, 3).await;
    assert_eq!(busy, 3, "busy workers reported while three handlers wait");
    gate.add_permits(published.len());
    let all = published.len();
    let done = wait_until(Duration::from_secs(10), || {
        handled.load(Ordering::SeqCst) >= all
    })
    .await;
    assert!(done, "handled {} of {all}", handled.load(Ordering::SeqCst));
    let idle = active_workers_reach(&mut conn, 0).await;
    assert_eq!(
        idle, 0,
        "busy workers reported after every handler returned"
    );
    listener.shutdown_and_wait().await.expect("clean shutdown");
}

/// Polls `describe_group` (10 s at most) until the one member reports `want` busy workers;
/// returns the last value seen.
async fn active_workers_reach(conn: &mut RedisConnection, want: u32) -> u32 {
    let end = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut seen = u32::MAX;
    while tokio::time::Instant::now() < end {
        if let [member] = describe(conn).await.members.as_slice() {
            seen = member.active_consumer_workers;
            if seen == want {
                break;
            }
        }
        tokio::time::sleep(HEARTBEAT / 4).await;
    }
    seen
}
