//! `idle`: what an idle listener costs Redis in connections and commands, against the shard
//! count (docs/design.md §8.4). One listener of 4 members with default timings (heartbeat 3 s,
//! `block` 2 s), settled and idle, on a stream of 512 shards and, as the baseline of the same
//! run, on a stream of 8 shards: with shared waits both should cost the same. Counted by the
//! server(s): `connected_clients` (every node of a cluster, this program's own connections
//! subtracted) and `INFO commandstats` over a window.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::common::*;
use stream_listener_core::handler::{Delivery, HandlerError};
use stream_listener_core::internals::admin;
use stream_listener_core::internals::connection::{RedisConnection, RedisTarget};
use stream_listener_core::member::{Listener, ListenerOptions};

const WINDOW: Duration = Duration::from_secs(20);

/// The servers to count on: the standalone server, or every node of the cluster.
pub(crate) struct Servers {
    pub(crate) nodes: Vec<RedisTarget>,
}

/// Connections and commands of one idle listener.
struct Cost {
    connections: u64,
    commands_per_s: f64,
    by_command: BTreeMap<String, f64>,
}

pub(crate) async fn idle(target: RedisTarget, servers: Servers, label: &str) {
    let mut conn = connect(&target).await;
    notify_keyspace_events(&servers.nodes).await;
    let mut nodes = Vec::new();
    for node in &servers.nodes {
        nodes.push(connect(node).await);
    }
    let mut rows = Vec::new();
    for shards in [8u32, 512] {
        let prefix = format!("idle{shards}");
        admin::create_stream(&mut conn, &prefix, shards)
            .await
            .unwrap();
        let cost = measure(&target, &mut conn, &mut nodes, &prefix).await;
        println!(
            "[{label}] idle: 4 members on {shards} shards: {} connections, {:.1} commands/s {:?}",
            cost.connections, cost.commands_per_s, cost.by_command
        );
        rows.push((shards, cost));
    }
    let base = &rows[0].1;
    println!(
        "\n[{label}] idle listener, 4 members, default timings (load {})",
        load_average()
    );
    println!(
        "| shards | connections | ratio | commands/s (processed) | ratio | waits/s (`XREAD` + `XREADGROUP`: idle, only the strict waits) | `EVALSHA`+`EVAL`/s |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for (shards, cost) in &rows {
        let rate = |name: &str| cost.by_command.get(name).copied().unwrap_or(0.0);
        println!(
            "| {shards} | {} | {:.2} | {:.1} | {:.2} | {:.2} | {:.2} |",
            cost.connections,
            cost.connections as f64 / base.connections as f64,
            cost.commands_per_s,
            cost.commands_per_s / base.commands_per_s,
            rate("xread") + rate("xreadgroup"),
            rate("evalsha") + rate("eval"),
        );
    }
}

async fn measure(
    target: &RedisTarget,
    conn: &mut RedisConnection,
    nodes: &mut [RedisConnection],
    prefix: &str,
) -> Cost {
    let before = clients(nodes).await;
    let mut options = ListenerOptions::default();
    options.concurrency = 4;
    let handler = |_d: Delivery| async { Ok::<(), HandlerError>(()) };
    let handle = Listener::new(target.clone(), prefix, "g", handler, options)
        .unwrap()
        .start()
        .await
        .unwrap();
    wait_converged(conn, prefix, "g", 4, Duration::from_secs(120))
        .await
        .expect("converged");
    // Two heartbeat intervals and a few blocks: every shard caught up and waiting.
    tokio::time::sleep(Duration::from_secs(8)).await;
    let connections = clients(nodes).await - before;
    let start = commandstats(nodes).await;
    let started = Instant::now();
    tokio::time::sleep(WINDOW).await;
    let end = commandstats(nodes).await;
    let seconds = started.elapsed().as_secs_f64();
    handle.shutdown_and_wait().await.expect("clean shutdown");
    // This program's own INFO calls are left out.
    let by_command: BTreeMap<String, f64> = end
        .iter()
        .filter(|(name, _)| !name.starts_with("info"))
        .map(|(name, calls)| {
            let delta = calls - start.get(name).copied().unwrap_or(0);
            (name.clone(), delta as f64 / seconds)
        })
        .filter(|(_, rate)| *rate > 0.0)
        .collect();
    Cost {
        connections,
        commands_per_s: by_command.values().sum(),
        by_command,
    }
}

/// `connected_clients` summed over `nodes`.
async fn clients(nodes: &mut [RedisConnection]) -> u64 {
    let mut total = 0;
    for node in nodes {
        let info: String = redis::cmd("INFO")
            .arg("clients")
            .query_async(node)
            .await
            .unwrap();
        total += info
            .lines()
            .find_map(|l| l.strip_prefix("connected_clients:"))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap();
    }
    total
}

/// `INFO commandstats` calls per command, summed over `nodes`.
async fn commandstats(nodes: &mut [RedisConnection]) -> BTreeMap<String, u64> {
    let mut total = BTreeMap::new();
    for node in nodes {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(node)
            .await
            .unwrap();
        for line in info.lines() {
            let Some((name, rest)) = line
                .strip_prefix("cmdstat_")
                .and_then(|l| l.split_once(':'))
            else {
                continue;
            };
            let calls = rest
                .split(',')
                .find_map(|kv| kv.strip_prefix("calls="))
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
            *total.entry(name.to_owned()).or_insert(0) += calls;
        }
    }
    total
}
