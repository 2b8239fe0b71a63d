//! `latency`: publish→handler latency of the listener against a raw blocking consumer.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::*;
use crate::throughput::{TP_SHARDS, TP_TASKS, TpSetup, run_listener_case, task_shards};
use redis::Value;
use stream_listener_core::handler::{Delivery, HandlerError};
use stream_listener_core::internals::admin::{self};
use stream_listener_core::internals::connection::RedisTarget;
use stream_listener_core::internals::keys::StreamKeys;
use stream_listener_core::member::{Listener, ListenerOptions};
use stream_listener_core::producer::{Publisher, PublisherOptions};

pub(crate) const LAT_SHARDS: u32 = 8;

#[derive(serde::Serialize, serde::Deserialize)]
pub(crate) struct Stamped {
    pub(crate) key: String,
    pub(crate) us: u64,
    pub(crate) phase: u32,
}

/// Publishes at `rate` msg/s for `secs` seconds; payload `{"key","us","phase"}`.
pub(crate) async fn publish_at(publisher: &Publisher, rate: f64, secs: f64, phase: u32) -> u64 {
    let start = Instant::now();
    let tick = if rate <= 1000.0 {
        Duration::from_secs_f64(1.0 / rate)
    } else {
        Duration::from_millis(1)
    };
    let mut interval = tokio::time::interval(tick);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut sent: u64 = 0;
    let mut n: u64 = 0;
    while start.elapsed().as_secs_f64() < secs {
        interval.tick().await;
        let due = (rate * start.elapsed().as_secs_f64()) as u64;
        let count = due.saturating_sub(sent).min(5_000);
        if count == 0 {
            continue;
        }
        let us = now_us();
        let batch: Vec<(String, Stamped)> = (0..count)
            .map(|_| {
                n += 1;
                let key = format!("k{}", n % 997);
                (key.clone(), Stamped { key, us, phase })
            })
            .collect();
        if count == 1 {
            publisher
                .publish(&batch[0].0, &batch[0].1)
                .await
                .expect("publish");
        } else {
            publisher.publish_batch(&batch).await.expect("publish");
        }
        sent += count;
    }
    sent
}

pub(crate) type Samples = Arc<Mutex<BTreeMap<u32, Vec<u64>>>>;

pub(crate) fn record(samples: &Samples, payload: &[u8]) {
    if let Ok(s) = serde_json::from_slice::<Stamped>(payload) {
        let latency = now_us().saturating_sub(s.us);
        samples
            .lock()
            .unwrap()
            .entry(s.phase)
            .or_default()
            .push(latency);
    }
}

/// The raw consumer: 4 tasks, each blocking `XREADGROUP` over its 2 shards on a connection of its
/// own, acks of the previous batch pipelined.
pub(crate) fn spawn_raw_consumer(
    target: &RedisTarget,
    keys: &StreamKeys,
    group: &str,
    batch: usize,
    samples: Samples,
    stop: Arc<AtomicUsize>,
) -> Vec<tokio::task::JoinHandle<()>> {
    // Standalone: 4 tasks over 2 shards each; cluster (one slot per call): one task per shard.
    let groups: Vec<Vec<u32>> = if target.is_cluster() {
        (0..LAT_SHARDS).map(|s| vec![s]).collect()
    } else {
        (0..TP_TASKS).map(task_shards).collect()
    };
    groups
        .into_iter()
        .enumerate()
        .map(|(t, shards)| {
            let target = target.clone();
            let keys: Vec<String> = shards.iter().map(|s| keys.shard(*s)).collect();
            let group = group.to_owned();
            let samples = samples.clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut conn = connect(&target).await;
                let mut acks: Vec<Vec<String>> = vec![Vec::new(); keys.len()];
                while stop.load(Ordering::Relaxed) == 0 {
                    let mut pipe = redis::pipe();
                    for (key, ids) in keys.iter().zip(&acks) {
                        if !ids.is_empty() {
                            pipe.cmd("XACK").arg(key).arg(&group).arg(ids).ignore();
                        }
                    }
                    pipe.cmd("XREADGROUP")
                        .arg("GROUP")
                        .arg(&group)
                        .arg(format!("raw-{t}"))
                        .arg("COUNT")
                        .arg(batch)
                        .arg("BLOCK")
                        .arg(500)
                        .arg("STREAMS")
                        .arg(&keys);
                    for _ in &keys {
                        pipe.arg(">");
                    }
                    let (reply,): (Value,) = pipe.query_async(&mut conn).await.expect("raw read");
                    for ids in &mut acks {
                        ids.clear();
                    }
                    parse_read(reply, &keys, &mut acks, |fields| {
                        let payload = fields.chunks(2).find_map(|kv| match kv {
                            [Value::BulkString(k), Value::BulkString(v)] if k == b"payload" => {
                                Some(v.as_slice())
                            }
                            _ => None,
                        });
                        if let Some(p) = payload {
                            record(&samples, p);
                        }
                    });
                }
            })
        })
        .collect()
}

pub(crate) async fn latency(target: RedisTarget, label: &str, peak: Option<f64>) {
    let batch = env_usize("E2E_BATCH", 32);
    let mut conn = connect(&target).await;
    let cluster = conn.is_cluster();
    // The peak of the strict listener on this server now (unless given).
    let peak = match peak {
        Some(p) => p,
        None => {
            admin::create_stream(&mut conn, "peak", TP_SHARDS)
                .await
                .unwrap();
            let keys = StreamKeys::new("peak").unwrap();
            preload(&mut conn, &keys, TP_SHARDS, 400_000).await;
            let setup = TpSetup {
                prefix: "peak",
                messages: 400_000,
                target: target.clone(),
                conn: conn.clone(),
                keys: keys.clone(),
                batch,
            };
            let (n, secs, _) = run_listener_case(&setup, "peak", false, 1).await;
            for s in 0..TP_SHARDS {
                let () = redis::cmd("DEL")
                    .arg(keys.shard(s))
                    .query_async(&mut conn)
                    .await
                    .unwrap();
            }
            n as f64 / secs
        }
    };
    let half = peak / 2.0;
    println!(
        "[{label}] latency: strict listener peak {peak:.0} msg/s, 50% = {half:.0} msg/s; batch {batch}"
    );
    // Listener stream and raw stream, same shape, same server.
    for prefix in ["lat", "latraw"] {
        admin::create_stream(&mut conn, prefix, LAT_SHARDS)
            .await
            .unwrap();
    }
    let samples: Samples = Arc::new(Mutex::new(BTreeMap::new()));
    let mut options = ListenerOptions::default();
    options.concurrency = 4;
    options.batch_size = batch;
    options.coordination = coordination();
    let s = samples.clone();
    let handler = move |d: Delivery| {
        if let Some(p) = d.payload() {
            record(&s, p);
        }
        async { Ok::<(), HandlerError>(()) }
    };
    let handle = Listener::new(target.clone(), "lat", "g", handler, options)
        .unwrap()
        .start()
        .await
        .unwrap();
    wait_converged(&mut conn, "lat", "g", 4, Duration::from_secs(60))
        .await
        .expect("converged");
    let stop = Arc::new(AtomicUsize::new(0));
    let raw_tasks = {
        let raw_keys = StreamKeys::new("latraw").unwrap();
        create_groups(&mut conn, &raw_keys, LAT_SHARDS, "g").await;
        spawn_raw_consumer(
            &target,
            &raw_keys,
            "g",
            batch,
            samples.clone(),
            stop.clone(),
        )
    };
    let listener_pub = Publisher::new(conn.clone(), "lat", PublisherOptions::default())
        .await
        .unwrap();
    let raw_pub = Publisher::new(conn.clone(), "latraw", PublisherOptions::default())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    // phase ids: 1 raw@100, 2 listener@100, 3 raw@half, 4 listener@half (odd: warm-up ids + 10)
    let low_secs = 15.0;
    let high_secs = 8.0;
    let plan: Vec<(u32, &Publisher, f64, f64)> = vec![
        (1, &raw_pub, 100.0, low_secs),
        (2, &listener_pub, 100.0, low_secs),
        (3, &raw_pub, half, high_secs),
        (4, &listener_pub, half, high_secs),
    ];
    let mut achieved = BTreeMap::new();
    for (phase, publisher, rate, secs) in plan {
        // 1 s warm-up recorded under phase + 10, then the measured window.
        publish_at(publisher, rate, 1.0, phase + 10).await;
        let start = Instant::now();
        let sent = publish_at(publisher, rate, secs, phase).await;
        achieved.insert(phase, sent as f64 / start.elapsed().as_secs_f64());
        // Let the tail drain.
        tokio::time::sleep(Duration::from_millis(1500)).await;
    }
    stop.store(1, Ordering::Relaxed);
    for t in raw_tasks {
        let _ = t.await;
    }
    handle.shutdown_and_wait().await.expect("clean shutdown");
    let samples = samples.lock().unwrap().clone();
    let stats = |phase: u32| -> (usize, u64, u64, u64) {
        let mut v = samples.get(&phase).cloned().unwrap_or_default();
        v.sort_unstable();
        (
            v.len(),
            percentile(&v, 50.0),
            percentile(&v, 99.0),
            v.last().copied().unwrap_or(0),
        )
    };
    let raw_name = if cluster {
        "raw blocking XREADGROUP, one task and connection per shard"
    } else {
        "raw blocking XREADGROUP, 4 tasks over 2 shards each"
    };
    println!(
        "\n[{label}] publish→handler latency (load {})",
        load_average()
    );
    println!(
        "| rate | consumer | published msg/s | samples | p50 | p99 | max | p50 ratio to raw | p99 ratio to raw |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for (raw, lis, name) in [(1, 2, "100 msg/s"), (3, 4, "50% of peak")] {
        let r = stats(raw);
        let l = stats(lis);
        {
            println!(
                "| {name} | {raw_name} | {:.0} | {} | {} | {} | {} | 1 | 1 |",
                achieved.get(&raw).copied().unwrap_or(0.0),
                r.0,
                ms(r.1),
                ms(r.2),
                ms(r.3)
            );
        }
        let ratio = |a: u64, b: u64| {
            if b == 0 {
                "—".to_owned()
            } else {
                format!("{:.2}", a as f64 / b as f64)
            }
        };
        println!(
            "| {name} | Listener (strict) | {:.0} | {} | {} | {} | {} | {} | {} |",
            achieved.get(&lis).copied().unwrap_or(0.0),
            l.0,
            ms(l.1),
            ms(l.2),
            ms(l.3),
            ratio(l.1, r.1),
            ratio(l.2, r.2)
        );
    }
}
