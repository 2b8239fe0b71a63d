//! `ordering` (only when named): key-ordered parallelism within a shard (docs/design.md §14.3).
//! An IO-bound handler (`tokio::time::sleep(10 ms)`), 8 shards of a standalone server, entries
//! pre-loaded over 1,000 partition keys (`key-<n mod 1000>`; a key stays on one shard), one
//! listener of one member. Two cases in the same run, each on a stream of its own:
//! `ordering = "shard"` with `runtime_max_concurrency = 8` (one worker per shard: the most that
//! mode can do, about 800/s) on `E2E_ORDERING_SHARD_ENTRIES` entries (default 2,000), and
//! `ordering = "key"` with the defaults (`max_in_flight` 16, `batch_size` 32, one worker) on
//! `E2E_ORDERING_ENTRIES` (default 20,000). The rate of each is its entries over the time from
//! its first handler start to its last handler end (so joining is not timed); the ratio is
//! key over shard. Per-key order violations: handler starts whose `seq` is below the last one
//! started for its key (the payload's `seq` is the entry's publish number).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use stream_listener_core::handler::{Delivery, HandlerError};
use stream_listener_core::internals::admin;
use stream_listener_core::internals::connection::RedisTarget;
use stream_listener_core::internals::keys::StreamKeys;
use stream_listener_core::member::{Listener, ListenerOptions, Ordering};

use crate::common::{connect, coordination, env_usize, load_average, now_us, preload};

const SHARDS: u32 = 8;
const WORK: Duration = Duration::from_millis(10);

/// What the handlers of one case saw.
#[derive(Default)]
struct Seen {
    first_start_us: u64,
    last_end_us: u64,
    calls: u64,
    /// Per key, the highest `seq` started.
    last_seq: HashMap<String, u64>,
    violations: u64,
}

struct Outcome {
    entries: usize,
    rate: f64,
    violations: u64,
    calls: u64,
}

/// The `key` and `seq` of a `{"key":..,"seq":..}` payload.
fn key_and_seq(delivery: &Delivery) -> Option<(String, u64)> {
    let value: serde_json::Value = serde_json::from_slice(delivery.payload()?).ok()?;
    Some((
        value.get("key")?.as_str()?.to_owned(),
        value.get("seq")?.as_u64()?,
    ))
}

async fn case(target: &RedisTarget, prefix: &str, ordering: Ordering, entries: usize) -> Outcome {
    let mut conn = connect(target).await;
    admin::create_stream(&mut conn, prefix, SHARDS)
        .await
        .expect("create stream");
    let keys = StreamKeys::new(prefix).expect("prefix");
    preload(&mut conn, &keys, SHARDS, entries).await;
    let seen = Arc::new(Mutex::new(Seen {
        first_start_us: u64::MAX,
        ..Seen::default()
    }));
    let handler = {
        let seen = seen.clone();
        move |delivery: Delivery| {
            let seen = seen.clone();
            async move {
                let start = now_us();
                let (key, seq) = key_and_seq(&delivery)
                    .ok_or_else(|| HandlerError::Decode("not {key, seq}".into()))?;
                {
                    let mut s = seen.lock().unwrap();
                    s.first_start_us = s.first_start_us.min(start);
                    let last = s.last_seq.entry(key).or_insert(0);
                    let broken = seq < *last;
                    *last = (*last).max(seq);
                    s.violations += u64::from(broken);
                }
                tokio::time::sleep(WORK).await;
                let mut s = seen.lock().unwrap();
                s.calls += 1;
                s.last_end_us = s.last_end_us.max(now_us());
                Ok::<(), HandlerError>(())
            }
        }
    };
    let mut options = ListenerOptions::default();
    options.name = format!("ordering-{}", ordering.as_str());
    options.coordination = coordination();
    options.ordering = ordering;
    if ordering == Ordering::Shard {
        options.runtime_max_concurrency = SHARDS;
    }
    let handle = Listener::new(target.clone(), prefix, "bench", handler, options)
        .expect("listener")
        .start()
        .await
        .expect("start");
    let limit = Instant::now() + Duration::from_secs(120);
    while seen.lock().unwrap().calls < entries as u64 && Instant::now() < limit {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    handle.shutdown();
    handle.join().await.expect("clean shutdown");
    let s = seen.lock().unwrap();
    let secs = s.last_end_us.saturating_sub(s.first_start_us) as f64 / 1e6;
    Outcome {
        entries,
        rate: s.calls as f64 / secs.max(1e-9),
        violations: s.violations,
        calls: s.calls,
    }
}

pub(crate) async fn ordering(target: RedisTarget) {
    let shard_entries = env_usize("E2E_ORDERING_SHARD_ENTRIES", 2_000);
    let key_entries = env_usize("E2E_ORDERING_ENTRIES", 20_000);
    println!(
        "\n## ordering: 10 ms IO-bound handler, {SHARDS} shards, 1,000 keys (load {})",
        load_average()
    );
    let shard = case(&target, "ord-shard", Ordering::Shard, shard_entries).await;
    let key = case(&target, "ord-key", Ordering::Key, key_entries).await;
    println!("| case | entries | handled | entries/s | per-key order violations |");
    println!("|---|---:|---:|---:|---:|");
    for (name, o) in [
        ("shard (8 workers)", &shard),
        ("key (max_in_flight 16)", &key),
    ] {
        println!(
            "| {name} | {} | {} | {:.0} | {} |",
            o.entries, o.calls, o.rate, o.violations
        );
    }
    println!(
        "key / shard throughput: {:.1}x (goal >= 10x); violations {} (goal 0)",
        key.rate / shard.rate,
        shard.violations + key.violations
    );
}
