//! `retention`: the soak benchmark of docs/design.md §10.9 (BENCHMARKS.md item 8). Entries are
//! published at a steady rate over 8 shards of a standalone server while two groups consume
//! them: `fast` (one listener, `concurrency = 2`, no-op handler) and `slow` (one member, one
//! worker, a handler that spins `E2E_RETENTION_SLOW_US` µs per entry). Run twice on fresh
//! servers, without and with retention (`"acked"`, `maxLen` = `E2E_RETENTION_KEEP` per shard,
//! `retention_interval` 1 s): the peak `used_memory` above the empty server, as a ratio to the
//! memory of `8 × keep` entries of the same shape written in the same run; the slow group's
//! losses (entries published minus entries it handled, and its pending count at the end); Redis
//! CPU of the whole run with retention as a ratio to the run without (noisy on a shared
//! machine), and the time Redis spent in the commands only the trim script sends (`INFO
//! commandstats`: `XTRIM`, `XINFO GROUPS`, `XPENDING`, `XRANGE`, `XLEN`, `TIME`) as a share of
//! the run's Redis CPU.
//!
//! Knobs: `E2E_RETENTION_ENTRIES` (default 2,000,000), `E2E_RETENTION_RATE` (entries/s, default
//! 20,000), `E2E_RETENTION_KEEP` (default 50,000), `E2E_RETENTION_SLOW_US` (default 20).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use stream_listener_core::handler::{Delivery, HandlerError};
use stream_listener_core::internals::admin;
use stream_listener_core::internals::connection::{RedisConnection, RedisTarget};
use stream_listener_core::internals::keys::StreamKeys;
use stream_listener_core::internals::store::{Retention, RetentionMode};
use stream_listener_core::member::{Listener, ListenerHandle, ListenerOptions};
use stream_listener_core::model::StartFrom;
use stream_listener_core::testing::RedisServer;

use crate::common::{
    connect, coordination, env_usize, preload, redis_stats, stream_length, total_handled,
};

const PREFIX: &str = "soak";
const SHARDS: u32 = 8;

struct Soak {
    secs: f64,
    peak_used: u64,
    reference: u64,
    final_len: u64,
    slow_lost: u64,
    slow_pending: u64,
    redis_cpu: f64,
    trim_calls: u64,
    trim_usec: u64,
}

async fn used_memory(conn: &mut RedisConnection) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("memory")
        .query_async(conn)
        .await
        .unwrap_or_default();
    info.lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

fn options(name: &str, concurrency: u32) -> ListenerOptions {
    let mut options = ListenerOptions::default();
    options.name = name.to_owned();
    options.concurrency = concurrency;
    options.coordination = coordination();
    options.retention_interval = Duration::from_secs(1);
    options
}

async fn start(
    target: &RedisTarget,
    group: &str,
    concurrency: u32,
    spin: Duration,
) -> ListenerHandle {
    let handler = move |_: Delivery| {
        if !spin.is_zero() {
            let until = Instant::now() + spin;
            while Instant::now() < until {
                std::hint::spin_loop();
            }
        }
        async { Ok::<(), HandlerError>(()) }
    };
    Listener::new(
        target.clone(),
        PREFIX,
        group,
        handler,
        options(group, concurrency),
    )
    .unwrap()
    .start()
    .await
    .unwrap()
}

/// Publishes `total` entries at `rate` per second in pipelines every 10 ms.
async fn publish(mut conn: RedisConnection, total: u64, rate: u64, published: Arc<AtomicU64>) {
    let keys = StreamKeys::new(PREFIX).unwrap();
    let per_tick = (rate / 100).max(1);
    let begin = Instant::now();
    let mut n = 0u64;
    while n < total {
        let mut pipe = redis::pipe();
        for _ in 0..per_tick.min(total - n) {
            let key = format!("key-{}", n % 1000);
            pipe.cmd("XADD")
                .arg(keys.shard((n % u64::from(SHARDS)) as u32))
                .arg("*")
                .arg("key")
                .arg(&key)
                .arg("payload")
                .arg(format!("{{\"key\":\"{key}\",\"seq\":{n}}}"))
                .ignore();
            n += 1;
        }
        let () = pipe.query_async(&mut conn).await.expect("publish");
        published.store(n, Ordering::Relaxed);
        // Steady: the n-th entry is due at n / rate seconds.
        let due = begin + Duration::from_secs_f64(n as f64 / rate as f64);
        tokio::time::sleep_until(due.into()).await;
    }
}

async fn soak(with_retention: bool, total: u64, rate: u64, keep: u64, spin: Duration) -> Soak {
    let server = RedisServer::start().expect("redis-server");
    let target = RedisTarget::Standalone(server.url());
    let mut conn = connect(&target).await;
    admin::create_stream(&mut conn, PREFIX, SHARDS)
        .await
        .unwrap();
    for group in ["fast", "slow"] {
        admin::register_group(&mut conn, PREFIX, group, StartFrom::Earliest)
            .await
            .unwrap();
    }
    if with_retention {
        let mut retention = Retention::new(RetentionMode::Acked);
        retention.max_len = Some(keep);
        admin::set_stream_retention(&mut conn, PREFIX, Some(retention))
            .await
            .unwrap();
    }
    let fast = start(&target, "fast", 2, Duration::ZERO).await;
    let slow = start(&target, "slow", 1, spin).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let base_used = used_memory(&mut conn).await;
    let (cpu0, cmds0) = redis_stats(&mut conn).await;
    let began = Instant::now();
    let published = Arc::new(AtomicU64::new(0));
    let publisher = tokio::spawn(publish(conn.clone(), total, rate, published.clone()));
    let mut peak = base_used;
    let deadline = began + Duration::from_secs_f64(total as f64 / rate as f64 * 3.0 + 120.0);
    loop {
        peak = peak.max(used_memory(&mut conn).await);
        let done = publisher.is_finished()
            && total_handled(&[&fast]) >= total
            && total_handled(&[&slow]) >= total;
        if done || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let secs = began.elapsed().as_secs_f64();
    // One more pass trims what the last entries left beyond the bound.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (cpu1, cmds1) = redis_stats(&mut conn).await;
    let keys = StreamKeys::new(PREFIX).unwrap();
    let final_len = stream_length(&mut conn, &keys, SHARDS).await;
    let mut slow_pending = 0;
    for shard in 0..SHARDS {
        let reply: redis::streams::StreamPendingReply =
            redis::AsyncCommands::xpending(&mut conn, keys.shard(shard), "slow")
                .await
                .unwrap();
        slow_pending += reply.count() as u64;
    }
    let slow_lost = total.saturating_sub(total_handled(&[&slow]));
    fast.shutdown_and_wait().await;
    slow.shutdown_and_wait().await;
    let delta = |name: &str| {
        let before = cmds0.get(name).copied().unwrap_or((0, 0));
        let after = cmds1.get(name).copied().unwrap_or((0, 0));
        (after.0 - before.0, after.1 - before.1)
    };
    // The commands only the trim script sends (the listeners' data path uses none of them once
    // settled): its cost inside Redis, whatever the rest of the machine does.
    let (trim_calls, _) = delta("xtrim");
    let trim_usec = [
        "xtrim",
        "xinfo|groups",
        "xpending",
        "xrange",
        "xlen",
        "time",
    ]
    .iter()
    .map(|name| delta(name).1)
    .sum();
    if with_retention {
        let parts: Vec<String> = [
            "xtrim",
            "xinfo|groups",
            "xpending",
            "xrange",
            "xlen",
            "time",
        ]
        .iter()
        .map(|name| {
            let (calls, usec) = delta(name);
            format!("{name} {calls} calls {:.3} s", usec as f64 / 1e6)
        })
        .collect();
        println!("trim commands: {}", parts.join(", "));
    }
    // The memory of 8 × keep entries of the same shape, on the same server.
    let before = used_memory(&mut conn).await;
    preload(
        &mut conn,
        &StreamKeys::new("reference").unwrap(),
        SHARDS,
        (keep * u64::from(SHARDS)) as usize,
    )
    .await;
    let reference = used_memory(&mut conn).await.saturating_sub(before);
    Soak {
        secs,
        peak_used: peak - base_used,
        reference,
        final_len,
        slow_lost,
        slow_pending,
        redis_cpu: cpu1 - cpu0,
        trim_calls,
        trim_usec,
    }
}

pub(crate) async fn retention() {
    let total = env_usize("E2E_RETENTION_ENTRIES", 2_000_000) as u64;
    let rate = env_usize("E2E_RETENTION_RATE", 20_000) as u64;
    let keep = env_usize("E2E_RETENTION_KEEP", 50_000) as u64;
    let spin = Duration::from_micros(env_usize("E2E_RETENTION_SLOW_US", 20) as u64);
    println!(
        "\n## retention soak: {total} entries at {rate}/s over {SHARDS} shards, groups fast + slow ({} µs/entry), keep {keep}/shard acked, interval 1 s",
        spin.as_micros()
    );
    let without = soak(false, total, rate, keep, spin).await;
    let with = soak(true, total, rate, keep, spin).await;
    println!(
        "| run | time | peak used_memory above start | ratio to {keep}×{SHARDS} entries | length at end | slow lost / pending | Redis CPU | CPU ratio | XTRIM calls | trim commands' time (share of Redis CPU) |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for (name, s) in [("no retention", &without), ("acked, maxLen", &with)] {
        println!(
            "| {name} | {:.1} s | {:.1} MB | {:.2} (reference {:.1} MB) | {} | {} / {} | {:.2} s | {:.3} | {} | {:.3} s ({:.2}%) |",
            s.secs,
            s.peak_used as f64 / 1e6,
            s.peak_used as f64 / s.reference.max(1) as f64,
            s.reference as f64 / 1e6,
            s.final_len,
            s.slow_lost,
            s.slow_pending,
            s.redis_cpu,
            s.redis_cpu / without.redis_cpu.max(1e-9),
            s.trim_calls,
            s.trim_usec as f64 / 1e6,
            s.trim_usec as f64 / 1e4 / s.redis_cpu.max(1e-9)
        );
    }
}
