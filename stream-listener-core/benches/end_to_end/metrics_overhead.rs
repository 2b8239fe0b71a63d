//! `metrics_overhead` (feature `metrics`): the `throughput` part's listener case with a real
//! `metrics-exporter-prometheus` recorder (built without its HTTP listener, upkeep every 5 s as
//! the exporter's own listener runs it, rendered once at the end to prove it recorded) against the
//! same case with no recorder, interleaved rounds in one run (docs/design.md §13.1,
//! BENCHMARKS.md "Metrics overhead").
//!
//! One global recorder is installed for the whole run: a switch that hands out the Prometheus
//! recorder's handles while "on" and no-op handles while "off", the state of a process without a
//! recorder (the `metrics` facade then gives every call site a no-op handle too). Handles are
//! resolved when a listener starts, so each case's listener starts after the switch is set.
//! With metrics the listener samples lag every `metrics_interval` (`E2E_METRICS_INTERVAL_MS`,
//! default 5000, the default interval; a run shorter than it samples only at the takeover, so
//! set it below the run time to put the sampler inside the clock); without, the interval is a
//! day (after the first sample at the takeover, before the clock).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use metrics_exporter_prometheus::{
    Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder,
};

use crate::common::*;
use crate::throughput::{TP_PREFIX, TP_SHARDS, TpSetup, run_listener_case_with};
use stream_listener_core::internals::admin;
use stream_listener_core::internals::connection::RedisTarget;
use stream_listener_core::internals::keys::StreamKeys;
use stream_listener_core::internals::telemetry::names;

/// The recorder of the whole run: Prometheus while `on`, no-op handles otherwise.
struct Switch {
    prometheus: PrometheusRecorder,
    on: Arc<AtomicBool>,
}

impl Recorder for Switch {
    fn describe_counter(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.prometheus.describe_counter(key, unit, description);
    }

    fn describe_gauge(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.prometheus.describe_gauge(key, unit, description);
    }

    fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.prometheus.describe_histogram(key, unit, description);
    }

    fn register_counter(&self, key: &Key, metadata: &Metadata<'_>) -> Counter {
        if self.on.load(Ordering::Relaxed) {
            self.prometheus.register_counter(key, metadata)
        } else {
            Counter::noop()
        }
    }

    fn register_gauge(&self, key: &Key, metadata: &Metadata<'_>) -> Gauge {
        if self.on.load(Ordering::Relaxed) {
            self.prometheus.register_gauge(key, metadata)
        } else {
            Gauge::noop()
        }
    }

    fn register_histogram(&self, key: &Key, metadata: &Metadata<'_>) -> Histogram {
        if self.on.load(Ordering::Relaxed) {
            self.prometheus.register_histogram(key, metadata)
        } else {
            Histogram::noop()
        }
    }
}

/// Installs the switch as the global recorder (once per process).
fn install() -> (Arc<AtomicBool>, PrometheusHandle) {
    // The buckets `run()`'s recorder sets (with them the exporter keeps bucket counts rather
    // than a summary: what a user of `[observability] listen` pays).
    let prometheus = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full(names::HANDLER_DURATION_SECONDS.into()),
            names::HANDLER_DURATION_BUCKETS,
        )
        .and_then(|b| {
            b.set_buckets_for_metric(
                Matcher::Full(names::HEARTBEAT_DURATION_SECONDS.into()),
                names::HEARTBEAT_DURATION_BUCKETS,
            )
        })
        .expect("valid buckets")
        .build_recorder();
    let handle = prometheus.handle();
    let on = Arc::new(AtomicBool::new(false));
    metrics::set_global_recorder(Switch {
        prometheus,
        on: on.clone(),
    })
    .expect("the only recorder of this run");
    (on, handle)
}

pub(crate) async fn metrics_overhead(target: RedisTarget, label: &str) {
    let messages = env_usize("E2E_MESSAGES", 1_000_000);
    let rounds = env_usize("E2E_ROUNDS", 3);
    let batch = env_usize("E2E_BATCH", 32);
    let sample_every = Duration::from_millis(env_usize("E2E_METRICS_INTERVAL_MS", 5000) as u64);
    let (on, handle) = install();
    let mut conn = connect(&target).await;
    admin::create_stream(&mut conn, TP_PREFIX, TP_SHARDS)
        .await
        .expect("create stream");
    let keys = StreamKeys::new(TP_PREFIX).unwrap();
    preload(&mut conn, &keys, TP_SHARDS, messages).await;
    println!(
        "[{label}] metrics overhead: {messages} entries over {TP_SHARDS} shards per case, batch {batch}, {rounds} rounds"
    );
    let setup = TpSetup {
        prefix: TP_PREFIX,
        messages,
        target,
        conn,
        keys,
        batch,
    };
    // Upkeep as the exporter's HTTP listener runs it (drains histogram samples into summaries).
    let upkeep = {
        let handle = handle.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(5)).await;
                handle.run_upkeep();
            }
        })
    };
    // (acks mode, with metrics) → (entries, seconds) per round.
    let mut results: BTreeMap<(bool, bool), Vec<(u64, f64)>> = BTreeMap::new();
    for round in 0..rounds {
        for acks in [true, false] {
            // Alternate which goes first, so neither always runs on a warmer server.
            let order = if round % 2 == 0 {
                [false, true]
            } else {
                [true, false]
            };
            for with in order {
                on.store(with, Ordering::Relaxed);
                let group = format!(
                    "mo-{}-{}-r{round}",
                    if acks { "acks" } else { "strict" },
                    if with { "on" } else { "off" }
                );
                let interval = if with {
                    sample_every
                } else {
                    Duration::from_secs(86_400)
                };
                let (n, secs, _) = run_listener_case_with(&setup, &group, acks, 1, |options| {
                    options.metrics_interval = interval;
                })
                .await;
                println!(
                    "[{label}] round {round} {:<6} metrics {:<3} {n:>8} entries {secs:>6.2} s {:>9.0} msg/s (load {})",
                    if acks { "acks" } else { "strict" },
                    if with { "on" } else { "off" },
                    n as f64 / secs,
                    load_average()
                );
                results.entry((acks, with)).or_default().push((n, secs));
            }
        }
    }
    on.store(false, Ordering::Relaxed);
    upkeep.abort();
    let rendered = handle.render();
    let handled = rendered
        .lines()
        .filter(|l| l.starts_with("stream_listener_messages_handled_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>();
    println!(
        "\n[{label}] the Prometheus recorder rendered {} lines, {handled:.0} entries handled (the metrics-on cases' entries)",
        rendered.lines().count()
    );
    let rate = |v: &[(u64, f64)]| {
        let n: u64 = v.iter().map(|(n, _)| n).sum();
        let s: f64 = v.iter().map(|(_, s)| s).sum();
        n as f64 / s
    };
    println!(
        "\n[{label}] metrics overhead, {messages} entries per case, batch {batch}, {rounds} rounds"
    );
    println!(
        "| listener | msgs/s without a recorder | msgs/s with Prometheus | ratio (all rounds) | median of per-round ratios |"
    );
    println!("| --- | --- | --- | --- | --- |");
    for acks in [true, false] {
        let (Some(off), Some(with)) = (results.get(&(acks, false)), results.get(&(acks, true)))
        else {
            continue;
        };
        let mut ratios: Vec<f64> = with
            .iter()
            .zip(off)
            .map(|(a, b)| (a.0 as f64 / a.1) / (b.0 as f64 / b.1))
            .collect();
        ratios.sort_by(f64::total_cmp);
        println!(
            "| {} | {:.0} | {:.0} | {:.3} | {:.3} |",
            if acks {
                "fencing = acks"
            } else {
                "fencing = strict"
            },
            rate(off),
            rate(with),
            rate(with) / rate(off),
            ratios[ratios.len() / 2]
        );
    }
}
