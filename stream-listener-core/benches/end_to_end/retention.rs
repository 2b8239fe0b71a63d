//! `retention`: the soak benchmark of docs/design.md §10.9 (BENCHMARKS.md item 8). Entries are
//! published at a steady rate over 8 shards of a standalone server while two groups consume
//! them: `fast` (one listener, `concurrency = 2`, no-op handler) and `slow` (one member, one
//! worker, a handler that spins `E2E_RETENTION_SLOW_US` µs per entry). Runs alternate on fresh
//! servers, without and with retention (`"acked"`, `maxLen` = `E2E_RETENTION_KEEP` per shard,
//! `retention_interval` 1 s), `E2E_RETENTION_PAIRS` pairs (A B A B ...): the peak `used_memory`
//! above the empty server, as a ratio to the memory of `8 × keep` entries of the same shape
//! written in the same run; the slow group's losses (entries published minus entries it
//! handled, and its pending count at the end); Redis CPU (`used_cpu_sys + used_cpu_user`) of
//! each run with retention as a ratio to the run without of its pair, and their median.
//!
//! The trim's own server time: the bench sets `store::TRIM_AS_EVAL`, so the trim script (and
//! only it) goes by `EVAL`; `cmdstat_eval`'s `usec` is then the whole script (Lua and nested
//! commands), less the SHA1 of the body that `EVAL` adds per call (measured after each run: the
//! same script on a missing key by `EVAL` and by `EVALSHA`, `PROBE_CALLS` times each). Its share
//! is that time over the same run's Redis CPU.
//!
//! Knobs: `E2E_RETENTION_ENTRIES` (default 2,000,000), `E2E_RETENTION_RATE` (entries/s, default
//! 20,000), `E2E_RETENTION_KEEP` (default 50,000), `E2E_RETENTION_SLOW_US` (default 20),
//! `E2E_RETENTION_PAIRS` (default 1).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use stream_listener_core::handler::{Delivery, HandlerError};
use stream_listener_core::internals::admin;
use stream_listener_core::internals::connection::{RedisConnection, RedisTarget};
use stream_listener_core::internals::keys::StreamKeys;
use stream_listener_core::internals::store::{Retention, RetentionMode, TRIM_AS_EVAL};
use stream_listener_core::member::{Listener, ListenerHandle, ListenerOptions};
use stream_listener_core::model::StartFrom;
use stream_listener_core::testing::RedisServer;

use crate::common::{
    connect, coordination, env_usize, preload, redis_stats, stream_length, total_handled,
};

const PREFIX: &str = "soak";
const SHARDS: u32 = 8;
/// Calls of the `EVAL` / `EVALSHA` cost probe, each.
const PROBE_CALLS: u64 = 2_000;

struct Soak {
    secs: f64,
    peak_used: u64,
    reference: u64,
    final_len: u64,
    slow_lost: u64,
    slow_pending: u64,
    redis_cpu: f64,
    /// `EVAL` calls: the trim script's.
    trim_calls: u64,
    /// Their `usec`, less the probe's `EVAL` overhead per call.
    trim_usec: f64,
    /// `EVAL`'s extra µs per call over `EVALSHA` (the probe).
    eval_overhead_us: f64,
    /// `cmdstat_evalsha` `usec` of the run: every other script.
    evalsha_usec: u64,
    xtrim_calls: u64,
}

type Commands = std::collections::BTreeMap<String, (u64, u64)>;

fn delta(before: &Commands, after: &Commands, name: &str) -> (u64, u64) {
    let b = before.get(name).copied().unwrap_or((0, 0));
    let a = after.get(name).copied().unwrap_or((0, 0));
    (a.0 - b.0, a.1 - b.1)
}

/// `EVAL`'s extra server µs per call over `EVALSHA`: the trim script on a missing key (it returns
/// after `EXISTS`), `PROBE_CALLS` times each way, on an otherwise idle server.
async fn eval_overhead(conn: &mut RedisConnection) -> f64 {
    let body = include_str!("../../src/store/retention_trim.lua");
    let sha: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(body)
        .query_async(conn)
        .await
        .expect("SCRIPT LOAD");
    let (_, before) = redis_stats(conn).await;
    for (command, script) in [("EVAL", body), ("EVALSHA", sha.as_str())] {
        let mut pipe = redis::pipe();
        for _ in 0..PROBE_CALLS {
            pipe.cmd(command)
                .arg(script)
                .arg(1)
                .arg("probe-missing")
                .arg(&["acked", "", "1", "1"])
                .ignore();
        }
        let () = pipe.query_async(conn).await.expect("probe");
    }
    let (_, after) = redis_stats(conn).await;
    let per_call = |name| delta(&before, &after, name).1 as f64 / PROBE_CALLS as f64;
    (per_call("eval") - per_call("evalsha")).max(0.0)
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
    let target = RedisTarget::standalone(server.url());
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
    fast.shutdown_and_wait().await.expect("clean shutdown");
    slow.shutdown_and_wait().await.expect("clean shutdown");
    let delta = |name: &str| delta(&cmds0, &cmds1, name);
    // The trim script alone goes by EVAL (TRIM_AS_EVAL): its whole cost inside Redis.
    let (trim_calls, eval_usec) = delta("eval");
    let eval_overhead_us = eval_overhead(&mut conn).await;
    let trim_usec = (eval_usec as f64 - eval_overhead_us * trim_calls as f64).max(0.0);
    if with_retention {
        // Where the script's time goes: its nested commands (the data path sends none of them).
        let parts: Vec<String> = ["xtrim", "xinfo|groups", "xpending", "xrange", "xlen"]
            .iter()
            .map(|name| {
                let (calls, usec) = delta(name);
                format!("{name} {calls} calls {:.3} s", usec as f64 / 1e6)
            })
            .collect();
        println!(
            "trim script: {trim_calls} EVAL calls {:.3} s ({:.1} µs/call, EVAL overhead {eval_overhead_us:.1} µs/call subtracted); nested: {}",
            trim_usec / 1e6,
            trim_usec / trim_calls.max(1) as f64,
            parts.join(", ")
        );
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
        eval_overhead_us,
        evalsha_usec: delta("evalsha").1,
        xtrim_calls: delta("xtrim").0,
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
    let pairs = env_usize("E2E_RETENTION_PAIRS", 1).max(1);
    TRIM_AS_EVAL.store(true, Ordering::Relaxed);
    let mut runs = Vec::new();
    for _ in 0..pairs {
        let without = soak(false, total, rate, keep, spin).await;
        let with = soak(true, total, rate, keep, spin).await;
        runs.push((without, with));
    }
    println!(
        "| pair | run | time | peak used_memory above start | ratio to {keep}×{SHARDS} entries | length at end | slow lost / pending | Redis CPU | CPU ratio | EVALSHA (other scripts) | trim calls (XTRIM) | trim script time (share of Redis CPU) |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for (pair, (without, with)) in runs.iter().enumerate() {
        for (name, s) in [("no retention", without), ("acked, maxLen", with)] {
            println!(
                "| {} | {name} | {:.1} s | {:.1} MB | {:.2} (reference {:.1} MB) | {} | {} / {} | {:.2} s | {:.3} | {:.2} s | {} ({}) | {:.3} s ({:.2}%) |",
                pair + 1,
                s.secs,
                s.peak_used as f64 / 1e6,
                s.peak_used as f64 / s.reference.max(1) as f64,
                s.reference as f64 / 1e6,
                s.final_len,
                s.slow_lost,
                s.slow_pending,
                s.redis_cpu,
                s.redis_cpu / without.redis_cpu.max(1e-9),
                s.evalsha_usec as f64 / 1e6,
                s.trim_calls,
                s.xtrim_calls,
                s.trim_usec / 1e6,
                s.trim_usec / 1e4 / s.redis_cpu.max(1e-9)
            );
        }
    }
    let mut ratios: Vec<f64> = runs
        .iter()
        .map(|(without, with)| with.redis_cpu / without.redis_cpu.max(1e-9))
        .collect();
    ratios.sort_by(f64::total_cmp);
    let median = if ratios.len() % 2 == 1 {
        ratios[ratios.len() / 2]
    } else {
        (ratios[ratios.len() / 2 - 1] + ratios[ratios.len() / 2]) / 2.0
    };
    let trim: f64 = runs.iter().map(|(_, with)| with.trim_usec).sum::<f64>() / 1e6;
    let with_cpu: f64 = runs.iter().map(|(_, with)| with.redis_cpu).sum();
    let without_cpu: f64 = runs.iter().map(|(without, _)| without.redis_cpu).sum();
    let overhead: Vec<String> = runs
        .iter()
        .map(|(_, with)| format!("{:.1}", with.eval_overhead_us))
        .collect();
    println!(
        "whole-run Redis CPU ratio per pair {:?}, median {median:.3}; trim script {trim:.3} s = {:.2}% of the with-retention runs' Redis CPU ({with_cpu:.2} s), {:.2}% of the runs without ({without_cpu:.2} s); EVAL overhead µs/call subtracted: {}",
        ratios.iter().map(|r| format!("{r:.3}")).collect::<Vec<_>>(),
        trim / with_cpu.max(1e-9) * 100.0,
        trim / without_cpu.max(1e-9) * 100.0,
        overhead.join(", ")
    );
}
