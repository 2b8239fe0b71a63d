//! `throughput`: the listener against raw consumer loops on the same server (see the crate docs).

mod baselines;
use baselines::*;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::common::*;
use stream_listener_core::handler::{Delivery, HandlerError};
use stream_listener_core::internals::admin::{self};
use stream_listener_core::internals::connection::{RedisConnection, RedisTarget};
use stream_listener_core::internals::dataplane::{FencingMode, ShardClient};
use stream_listener_core::internals::fence::FenceToken;
use stream_listener_core::internals::keys::StreamKeys;
use stream_listener_core::member::{Listener, ListenerOptions};
use stream_listener_core::model::StartFrom;

pub(crate) const TP_PREFIX: &str = "tp";
pub(crate) const TP_SHARDS: u32 = 8;
pub(crate) const TP_TASKS: u32 = 4;

/// The shards of raw task `t` (of 4): `t` and `t + 4`.
pub(crate) fn task_shards(t: u32) -> Vec<u32> {
    (0..TP_SHARDS).filter(|s| s % TP_TASKS == t).collect()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Case {
    RawStrong,
    /// Diagnostic: (a) through the strict listener's read round (plain `XACK`s, then `MULTI`, the
    /// check script with the read gate, the read, `EXEC`): the listener's Redis commands without
    /// the listener.
    RawStrongFencedAck,
    /// Diagnostic: (a) with its acks fenced through `WATCH` instead of Lua: one pipeline of
    /// `WATCH` (the fences and a tripwire key), a script without ids that checks each fence and
    /// writes the tripwire on a refusal, `MULTI`, the plain `XACK`s, `EXEC`, the read. `EXEC`
    /// runs only if no watched key changed after the check. A measurement of a cheaper fence,
    /// not something the listener does.
    RawStrongWatchAck,
    RawPerShard,
    FencedScripts,
    ListenerAcks,
    ListenerStrict,
    /// Diagnostic: (c) with the read in acks mode (the read script without the fence check).
    FencedAcksRead,
    /// Diagnostic: (c) without pipelining: read, then ack, then the next read (two round trips
    /// per batch, the shape of the listener's shard task).
    FencedSequential,
    /// Diagnostic: the strict listener with `runtime_max_concurrency = 2` (each member's two
    /// shards handle and ack in parallel instead of taking turns on one worker).
    ListenerStrictWorkers2,
    /// Diagnostic: the acks-mode listener with `runtime_max_concurrency = 2` (a member's two
    /// shard tasks never wait for each other's worker).
    ListenerAcksWorkers2,
    /// Diagnostic: (c) with plain `XREADGROUP` reads and the fenced ack script (what acks mode
    /// could cost: only acks and claims need the fence).
    PlainReadFencedAck,
    /// The listener with the shipped defaults (`ListenerOptions::default()`: strict fencing,
    /// the default `batch_size` whatever `E2E_BATCH` says), 4 members: what a user gets, against
    /// the peer.
    ListenerDefaults,
    /// sea-streamer-redis (LoadBalanced, Rolling commit), as a separate process on the same
    /// server (its own copy of the entries, keys `ss:<i>`, field `msg`).
    SeaStreamer,
}

impl Case {
    fn name(self) -> &'static str {
        match self {
            Case::RawStrong => "raw multi-stream XREADGROUP + pipelined XACK (a)",
            Case::RawStrongFencedAck => {
                "diagnostic: (a) through the strict read round (transaction)"
            }
            Case::RawStrongWatchAck => "diagnostic: (a) with acks fenced by WATCH/MULTI/EXEC",
            Case::RawPerShard => "raw per-shard XREADGROUP + pipelined XACK (b)",
            Case::FencedScripts => "raw per-shard fenced scripts, strict read_new + ack (c)",
            Case::ListenerAcks => "Listener, fencing = acks",
            Case::ListenerStrict => "Listener, fencing = strict (default)",
            Case::FencedAcksRead => "diagnostic: (c) with acks-mode reads (no fence check)",
            Case::FencedSequential => "diagnostic: (c) with read and ack in turn, not pipelined",
            Case::ListenerStrictWorkers2 => {
                "diagnostic: Listener, strict, runtime_max_concurrency = 2"
            }
            Case::ListenerAcksWorkers2 => "diagnostic: Listener, acks, runtime_max_concurrency = 2",
            Case::PlainReadFencedAck => "diagnostic: (c) with plain XREADGROUP reads, fenced acks",
            Case::ListenerDefaults => "Listener, shipped defaults (strict, default batch_size)",
            Case::SeaStreamer => {
                "sea-streamer-redis 1.0.0-rc.5, LoadBalanced, Rolling, 4 consumers: all received"
            }
        }
    }

    fn tag(self) -> &'static str {
        match self {
            Case::RawStrong => "strong",
            Case::RawStrongFencedAck => "strongfack",
            Case::RawStrongWatchAck => "strongwatch",
            Case::RawPerShard => "pershard",
            Case::FencedScripts => "fenced",
            Case::ListenerAcks => "lacks",
            Case::ListenerStrict => "lstrict",
            Case::FencedAcksRead => "fencedacks",
            Case::FencedSequential => "fencedseq",
            Case::ListenerStrictWorkers2 => "lstrictw2",
            Case::ListenerAcksWorkers2 => "lacksw2",
            Case::PlainReadFencedAck => "plainreadfack",
            Case::ListenerDefaults => "ldefault",
            Case::SeaStreamer => "seastreamer",
        }
    }
}

pub(crate) struct TpSetup {
    pub(crate) prefix: &'static str,
    pub(crate) messages: usize,
    pub(crate) target: RedisTarget,
    pub(crate) conn: RedisConnection,
    pub(crate) keys: StreamKeys,
    pub(crate) batch: usize,
}

/// Runs one case on its own consumer group; returns (entries, seconds, costs).
pub(crate) async fn run_case(
    setup: &TpSetup,
    case: Case,
    round: usize,
) -> (u64, f64, Option<CaseCost>) {
    let group = format!("{}-r{round}", case.tag());
    let mut conn = setup.conn.clone();
    match case {
        Case::SeaStreamer => run_sea_streamer(setup, round).await,
        Case::ListenerDefaults => {
            let default_batch = ListenerOptions::default().batch_size;
            run_listener_case_with(setup, &group, false, 1, |options| {
                options.batch_size = default_batch;
            })
            .await
        }
        Case::ListenerAcks
        | Case::ListenerStrict
        | Case::ListenerStrictWorkers2
        | Case::ListenerAcksWorkers2 => {
            let workers = match case {
                Case::ListenerStrictWorkers2 | Case::ListenerAcksWorkers2 => 2,
                _ => 1,
            };
            let acks = matches!(case, Case::ListenerAcks | Case::ListenerAcksWorkers2);
            run_listener_case(setup, &group, acks, workers).await
        }
        _ => {
            create_groups(&mut conn, &setup.keys, TP_SHARDS, &group).await;
            let client = ShardClient::new(setup.conn.clone(), setup.keys.clone(), &group, "fenced")
                .expect("client");
            let mut tokens = Vec::new();
            for t in 0..TP_TASKS {
                let token = FenceToken {
                    incarnation: 1,
                    member_epoch: 1,
                    member_id: format!("fenced-{t}"),
                    process_id: "bench".into(),
                };
                if matches!(
                    case,
                    Case::FencedScripts
                        | Case::FencedAcksRead
                        | Case::FencedSequential
                        | Case::PlainReadFencedAck
                        | Case::RawStrongFencedAck
                        | Case::RawStrongWatchAck
                ) {
                    let mut c = ShardClient::new(
                        setup.conn.clone(),
                        setup.keys.clone(),
                        &group,
                        &format!("fenced-{t}"),
                    )
                    .expect("client");
                    for s in task_shards(t) {
                        c.raise_fence(s, &token)
                            .await
                            .expect("raise")
                            .expect("raised");
                    }
                }
                tokens.push(token);
            }
            drop(client);
            // As the listener's members: a connection per task on a standalone server, one
            // shared cluster connection on a cluster (docs/design.md §8.12); the knob overrides.
            let default_own = usize::from(!setup.conn.is_cluster());
            let own_conns = env_usize("E2E_RAW_OWN_CONNECTIONS", default_own) != 0;
            let mut conns = Vec::new();
            for _ in 0..TP_TASKS {
                conns.push(if own_conns {
                    connect(&setup.target).await
                } else {
                    setup.conn.clone()
                });
            }
            profile_marker();
            let probe = CostProbe::start(&mut conn).await;
            let start = Instant::now();
            let mut tasks = Vec::new();
            for t in 0..TP_TASKS {
                let shards = task_shards(t);
                let keys: Vec<String> = shards.iter().map(|s| setup.keys.shard(*s)).collect();
                let conn = conns[t as usize].clone();
                let group = group.clone();
                let consumer = format!("fenced-{t}");
                let batch = setup.batch;
                let token = tokens[t as usize].clone();
                let stream = setup.keys.clone();
                tasks.push(tokio::spawn(async move {
                    match case {
                        Case::RawStrong => {
                            raw_strong(conn, keys, group, consumer, batch, None).await
                        }
                        Case::RawStrongFencedAck => {
                            let client =
                                ShardClient::new(conn, stream, &group, &consumer).expect("client");
                            raw_strong_fenced_round(client, shards, keys, token, batch).await
                        }
                        Case::RawStrongWatchAck => {
                            let mut conn = conn;
                            let fences = shards.iter().map(|&s| stream.fence(s)).collect();
                            let trip = format!("{}:trip", keys[0]);
                            let watch = WatchFence::new(&mut conn, fences, trip, &token).await;
                            raw_strong(conn, keys, group, consumer, batch, Some(watch)).await
                        }
                        Case::RawPerShard => {
                            raw_per_shard(conn, keys, group, consumer, batch).await
                        }
                        _ => {
                            let mode = if case == Case::FencedAcksRead {
                                FencingMode::Acks
                            } else {
                                FencingMode::Strict
                            };
                            let pipelined = case != Case::FencedSequential;
                            let plain = (case == Case::PlainReadFencedAck).then(|| conn.clone());
                            let client =
                                ShardClient::new(conn, stream, &group, &consumer).expect("client");
                            fenced_scripts(client, shards, token, batch, mode, pipelined, plain)
                                .await
                        }
                    }
                }));
            }
            let mut total = 0;
            for task in tasks {
                total += task.await.expect("task");
            }
            let secs = start.elapsed().as_secs_f64();
            let cost = probe.finish(&mut conn, total, secs).await;
            destroy_groups(&mut conn, &setup.keys, TP_SHARDS, &group).await;
            (total, secs, cost)
        }
    }
}

/// The listener case: join and settle first, then rewind its consumer groups to `0` and wake the
/// shard tasks; the clock runs until every entry is acked.
pub(crate) async fn run_listener_case(
    setup: &TpSetup,
    group: &str,
    acks: bool,
    workers: u32,
) -> (u64, f64, Option<CaseCost>) {
    run_listener_case_with(setup, group, acks, workers, |_| {}).await
}

/// [`run_listener_case`] with the listener's options changed by `tune` (the `metrics_overhead`
/// part sets its `metrics_interval`).
pub(crate) async fn run_listener_case_with(
    setup: &TpSetup,
    group: &str,
    acks: bool,
    workers: u32,
    tune: impl FnOnce(&mut ListenerOptions),
) -> (u64, f64, Option<CaseCost>) {
    let mut conn = setup.conn.clone();
    let mut options = ListenerOptions::default();
    options.concurrency = 4;
    options.batch_size = setup.batch;
    options.runtime_max_concurrency = workers;
    options.fencing = if acks {
        FencingMode::Acks
    } else {
        FencingMode::Strict
    };
    options.start_from = StartFrom::Latest;
    options.coordination = coordination();
    tune(&mut options);
    let handler = |_delivery: Delivery| async { Ok::<(), HandlerError>(()) };
    let handle = Listener::new(setup.target.clone(), setup.prefix, group, handler, options)
        .expect("listener")
        .start()
        .await
        .expect("start");
    wait_converged(&mut conn, setup.prefix, group, 4, Duration::from_secs(60))
        .await
        .expect("listener group converged");
    // Let every shard task finish its takeover and block in XREAD.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = total_handled(&[&handle]);
    profile_marker();
    let probe = CostProbe::start(&mut conn).await;
    let start = Instant::now();
    let cluster = conn.is_cluster();
    let mut pipe = redis::pipe();
    for s in 0..TP_SHARDS {
        let key = setup.keys.shard(s);
        pipe.cmd("XGROUP")
            .arg("SETID")
            .arg(&key)
            .arg(group)
            .arg("0")
            .ignore();
        pipe.cmd("XADD")
            .arg(&key)
            .arg("*")
            .arg("key")
            .arg("wake")
            .arg("payload")
            .arg("{}")
            .ignore();
        if cluster {
            let () = pipe.query_async(&mut conn).await.expect("rewind");
            pipe = redis::pipe();
        }
    }
    if !cluster {
        let () = pipe.query_async(&mut conn).await.expect("rewind");
    }
    let target = stream_length(&mut conn, &setup.keys, TP_SHARDS).await;
    loop {
        if total_handled(&[&handle]) - before >= target {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
        if start.elapsed() > Duration::from_secs(120) {
            panic!(
                "listener case did not finish: {} of {target}",
                total_handled(&[&handle]) - before
            );
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let total = total_handled(&[&handle]) - before;
    let cost = probe.finish(&mut conn, total, secs).await;
    handle.shutdown_and_wait().await.expect("clean shutdown");
    (total, secs, cost)
}

pub(crate) async fn throughput(target: RedisTarget, label: &str) -> BTreeMap<Case, f64> {
    let messages = env_usize("E2E_MESSAGES", 1_000_000);
    let rounds = env_usize("E2E_ROUNDS", 3);
    let batch = env_usize("E2E_BATCH", 32);
    let mut conn = connect(&target).await;
    let cluster = conn.is_cluster();
    admin::create_stream(&mut conn, TP_PREFIX, TP_SHARDS)
        .await
        .expect("create stream");
    let keys = StreamKeys::new(TP_PREFIX).unwrap();
    let loading = Instant::now();
    preload(&mut conn, &keys, TP_SHARDS, messages).await;
    println!(
        "[{label}] pre-loaded {messages} entries over {TP_SHARDS} shards in {:.1} s (outside the clock); batch {batch}, {rounds} rounds",
        loading.elapsed().as_secs_f64()
    );
    let setup = TpSetup {
        prefix: TP_PREFIX,
        messages,
        target,
        conn,
        keys,
        batch,
    };
    let mut cases = vec![
        Case::RawStrong,
        Case::RawPerShard,
        Case::FencedScripts,
        Case::ListenerAcks,
        Case::ListenerStrict,
    ];
    if cluster {
        cases.retain(|c| *c != Case::RawStrong);
    } else if std::env::var("E2E_SEA_STREAMER_BIN").is_ok() {
        cases.push(Case::ListenerDefaults);
        cases.push(Case::SeaStreamer);
    }
    if let Ok(only) = std::env::var("E2E_CASES") {
        cases = [
            Case::RawStrong,
            Case::RawStrongFencedAck,
            Case::RawStrongWatchAck,
            Case::RawPerShard,
            Case::FencedScripts,
            Case::ListenerAcks,
            Case::ListenerStrict,
            Case::FencedAcksRead,
            Case::FencedSequential,
            Case::ListenerStrictWorkers2,
            Case::ListenerAcksWorkers2,
            Case::PlainReadFencedAck,
            Case::ListenerDefaults,
            Case::SeaStreamer,
        ]
        .into_iter()
        .filter(|c| only.split(',').any(|t| t == c.tag()))
        .filter(|c| {
            !cluster
                || !matches!(
                    c,
                    Case::RawStrong | Case::RawStrongFencedAck | Case::SeaStreamer
                )
        })
        .collect();
    }
    let mut results: BTreeMap<Case, Vec<(u64, f64)>> = BTreeMap::new();
    let mut costs: BTreeMap<Case, Vec<CaseCost>> = BTreeMap::new();
    for round in 0..rounds {
        let mut order = cases.clone();
        order.rotate_left(round % cases.len());
        for case in order {
            let (n, secs, cost) = run_case(&setup, case, round).await;
            println!(
                "[{label}] round {round} {:<58} {n:>8} entries {secs:>6.2} s {:>9.0} msg/s (load {})",
                case.name(),
                n as f64 / secs,
                load_average()
            );
            if let Some(c) = cost {
                let top: Vec<String> = c
                    .commands
                    .iter()
                    .take(4)
                    .map(|(name, calls, per_call, per_msg)| {
                        format!("{name} {calls} calls {per_call:.1} µs/call {per_msg:.2} µs/entry")
                    })
                    .collect();
                println!(
                    "        Redis {:.2} µs CPU/entry (busy {:.0}% of a core), client {:.2} µs CPU/entry (busy {:.0}% of a core); {}",
                    c.redis_us_per_msg,
                    c.redis_busy * 100.0,
                    c.client_us_per_msg,
                    c.client_busy * 100.0,
                    top.join("; ")
                );
                costs.entry(case).or_default().push(c);
            }
            results.entry(case).or_default().push((n, secs));
        }
    }
    let rate = |case: Case| -> f64 {
        let Some(v) = results.get(&case) else {
            return f64::NAN;
        };
        let n: u64 = v.iter().map(|(n, _)| n).sum();
        let s: f64 = v.iter().map(|(_, s)| s).sum();
        n as f64 / s
    };
    let median_ratio = |num: Case, den: Case| -> f64 {
        let (Some(num), Some(den)) = (results.get(&num), results.get(&den)) else {
            return f64::NAN;
        };
        let mut r: Vec<f64> = num
            .iter()
            .zip(den)
            .map(|(a, b)| (a.0 as f64 / a.1) / (b.0 as f64 / b.1))
            .collect();
        r.sort_by(f64::total_cmp);
        r[r.len() / 2]
    };
    let baseline = if cluster {
        Case::RawPerShard
    } else {
        Case::RawStrong
    };
    println!("\n[{label}] throughput, {messages} entries per case, batch {batch}");
    println!(
        "| case | msgs/s (all rounds) | ratio to {} | ratio to (c) | median of per-round ratios to {} / to (c) |",
        baseline.tag(),
        baseline.tag()
    );
    println!("| --- | --- | --- | --- | --- |");
    let mut out = BTreeMap::new();
    for case in &cases {
        let r = rate(*case);
        out.insert(*case, r);
        println!(
            "| {} | {:.0} | {:.3} | {:.3} | {:.3} / {:.3} |",
            case.name(),
            r,
            r / rate(baseline),
            r / rate(Case::FencedScripts),
            median_ratio(*case, baseline),
            median_ratio(*case, Case::FencedScripts)
        );
    }
    if !costs.is_empty() {
        println!(
            "\n[{label}] where the time goes (means over rounds; CPU from INFO and /proc/self/stat)"
        );
        println!(
            "| case | Redis µs CPU per entry (all masters) | Redis busy (share of a core, summed over masters) | client µs CPU per entry | client busy (share of the 2 cores' time, in cores) | Redis commands: µs per entry (µs per call) |"
        );
        println!("| --- | --- | --- | --- | --- | --- |");
        for case in &cases {
            let Some(v) = costs.get(case) else { continue };
            let mean = |f: &dyn Fn(&CaseCost) -> f64| v.iter().map(f).sum::<f64>() / v.len() as f64;
            let last = &v[v.len() - 1];
            let commands: Vec<String> = last
                .commands
                .iter()
                .take(4)
                .map(|(name, _, per_call, per_msg)| format!("{name} {per_msg:.2} ({per_call:.1})"))
                .collect();
            println!(
                "| {} | {:.2} | {:.0}% | {:.2} | {:.2} | {} |",
                case.name(),
                mean(&|c| c.redis_us_per_msg),
                mean(&|c| c.redis_busy) * 100.0,
                mean(&|c| c.client_us_per_msg),
                mean(&|c| c.client_busy),
                commands.join(", ")
            );
        }
    }
    out
}
