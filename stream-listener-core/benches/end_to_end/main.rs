//! End-to-end benchmarks of the listener runtime (BENCHMARKS.md items 1-3 and 7), each against a
//! baseline measured in the same run, on a throwaway `redis-server` and a local 3-master cluster
//! started through the test harness (hence the `testing` feature). A `harness = false` program
//! that prints its tables; BENCHMARKS.md, "End to end", has the results.
//!
//! ```sh
//! cargo bench -p stream-listener-core --features testing --bench end_to_end -- <part>...
//! ```
//!
//! Parts (default: all four, in this order):
//! - `throughput`: 1,000,000 small entries pre-loaded over 8 shards (a pipelined `XADD` before
//!   the clock starts), consumed and acked by one `Listener` with `concurrency = 4` and a no-op
//!   handler, `fencing = acks` and `strict`, against three raw loops on the same server in the
//!   same run: (a) the strong raw loop — 4 tasks, each one multi-stream `XREADGROUP COUNT b` over
//!   its 2 shards with the acks of its previous batch pipelined in the same round trip (standalone
//!   only: on a cluster keys of different slots cannot share a call); (b) the per-shard raw loop —
//!   the same 4 tasks serving their shards one at a time, `XACK` of the shard's previous batch +
//!   `XREADGROUP` of the shard in one pipeline; (c) the same per-shard loop through the
//!   fence-checking scripts (`ShardClient::ack` and `ShardClient::read_new` in strict mode, sent
//!   together on the multiplexed connection: one round trip). Rounds rotate the order of the
//!   cases; every case of every round has its own consumer group from `0`, so each reads the same
//!   entries. The listener joins and settles (group `STABLE`, every member owning 2 shards, idle)
//!   *before* the clock starts: its consumer groups are then set back to `0` (`XGROUP SETID`) and
//!   one entry per shard wakes the blocked shard tasks; the clock stops when the members have
//!   acked every entry (their `handled` counters). Each case also reports Redis CPU per entry
//!   (`INFO`), this process's CPU per entry (`/proc/self/stat`) and `INFO commandstats`.
//!   Diagnostic cases (only with `E2E_CASES`, tags in [`Case::tag`]): (a) with its acks fenced
//!   as the listener's read rounds fence them (Lua) or through `WATCH`, (c) with acks-mode reads,
//!   (c) with plain `XREADGROUP` reads and fenced acks, (c) without pipelining, the strict and
//!   the acks-mode listener with `runtime_max_concurrency = 2`; and sea-streamer-redis (`benches/sea-streamer`,
//!   run as a process when `E2E_SEA_STREAMER_BIN` names its binary).
//! - `latency`: publish→handler latency (the publish time in µs is in the payload, the handler
//!   subtracts it from its own clock) at 100 msg/s and at 50% of the peak of the strict listener
//!   (measured first, on 400,000 entries), against a raw consumer at the same rates on the same
//!   server: 4 tasks, each a blocking `XREADGROUP ... BLOCK` over its 2 shards on a connection of
//!   its own with the previous acks pipelined (on a cluster: one task and connection per shard).
//!   The cluster runs twice: with `notify-keyspace-events Kt` (the listener's members wait with
//!   keyspace notifications, as the README recommends) and without (each idle shard waits on a
//!   connection of its own).
//! - `memory`: resident memory (`VmRSS` from `/proc/self/status`) of a child process (this
//!   program again) with one listener of 4 members owning 64 shards, idle; then with every shard
//!   holding a read batch in flight (the handler never returns), for two batch sizes: the slope is
//!   the memory per entry in flight. Baseline: the same child with a tokio runtime and a Redis
//!   connection but no listener.
//! - `rebalance`: 12 shards under a steady load of 1,200 msg/s (one entry per shard every 10 ms),
//!   members (one listener of `concurrency = 1` each, in this process) 3 → 4, 4 → 3 by a graceful
//!   leave, 3 → 4 again, then 4 → 3 by `abort()` (a crash without leaving). Per change: shards
//!   moved against the assignor's minimum, the longest gap between handler starts of every shard
//!   that did not move against its longest gap in the 10 s before, and the time until
//!   `describe_group` says `STABLE` with every member converged. At the end: every published
//!   entry was handled (at least once).
//!
//! - `idle` (only when named): connections and commands of an idle listener of 4 members with
//!   default timings on 512 shards against the same on 8 shards (shared waits, docs/design.md
//!   §8.4), standalone and cluster (with `notify-keyspace-events Kt`), see `idle.rs`.
//! - `retention` (only when named): the retention soak of docs/design.md §10.9, see
//!   `retention.rs` (its knobs are `E2E_RETENTION_*`).
//! - `metrics_overhead` (only when named; needs `--features testing,metrics`): the listener's
//!   throughput with a real Prometheus recorder against none, interleaved rounds on a standalone
//!   server (docs/design.md §13.1), see `metrics_overhead.rs` (`E2E_METRICS_INTERVAL_MS`: its
//!   `metrics_interval`, default 5000).
//! - `ordering` (only when named): `ordering = "key"` against `"shard"` with a 10 ms IO-bound
//!   handler on 8 shards and 1,000 keys, and per-key order violations, see `ordering.rs`
//!   (`E2E_ORDERING_ENTRIES`, `E2E_ORDERING_SHARD_ENTRIES`).
//!
//! Environment: `E2E_MESSAGES` (default 1000000), `E2E_ROUNDS` (default 3), `E2E_BATCH` (default
//! 32: the listener's `batch_size` and the raw loops' `COUNT`), `E2E_CLUSTER=0` skips the cluster
//! runs, `E2E_PEAK` (msg/s) skips the latency part's peak measurement (`E2E_CLUSTER_PEAK` on the cluster), `E2E_CASES` (comma-separated
//! tags) picks the throughput cases, `E2E_RAW_OWN_CONNECTIONS` (`1`: each raw task its own
//! connection, the default on a standalone server, as the listener's members; `0`: one shared
//! connection, the default on a cluster), `E2E_PROFILE=1` prints a line when a clock starts (to attach `perf`).

mod common;
mod idle;
mod latency;
mod memory;
#[cfg(feature = "metrics")]
mod metrics_overhead;
mod ordering;
mod rebalance;
mod retention;
mod throughput;

use common::*;
use latency::latency;
use memory::{memory, memory_child};
use rebalance::rebalance;
use retention::retention;
use stream_listener_core::internals::connection::RedisTarget;
use stream_listener_core::testing::{RedisCluster, RedisServer};
use throughput::{Case, throughput};

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    if args.first().map(String::as_str) == Some("memory-child") {
        memory_child(&args[1..]);
        return;
    }
    let parts: Vec<&str> = if args.is_empty() {
        vec!["throughput", "latency", "memory", "rebalance"]
    } else {
        args.iter().map(String::as_str).collect()
    };
    let cluster = env_usize("E2E_CLUSTER", 1) != 0;
    println!("machine: {}", machine());
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let mut strict_peak: Option<f64> =
            std::env::var("E2E_PEAK").ok().and_then(|v| v.parse().ok());
        for part in parts {
            match part {
                "throughput" => {
                    {
                        let server = RedisServer::start().expect("redis-server");
                        let r =
                            throughput(RedisTarget::standalone(server.url()), "standalone").await;
                        strict_peak = strict_peak.or(r.get(&Case::ListenerStrict).copied());
                    }
                    if cluster {
                        let c = RedisCluster::start().expect("cluster");
                        throughput(RedisTarget::cluster(c.urls()), "cluster").await;
                    }
                }
                "latency" => {
                    {
                        let server = RedisServer::start().expect("redis-server");
                        latency(
                            RedisTarget::standalone(server.url()),
                            "standalone",
                            strict_peak,
                        )
                        .await;
                    }
                    if cluster {
                        // Twice: as the README recommends (`notify-keyspace-events Kt`: the
                        // members wait with keyspace notifications), and without (each idle
                        // shard waits on a connection of its own, docs/design.md §8.4).
                        for keyspace in [true, false] {
                            let c = RedisCluster::start().expect("cluster");
                            if keyspace {
                                let nodes: Vec<RedisTarget> =
                                    c.urls().into_iter().map(RedisTarget::standalone).collect();
                                notify_keyspace_events(&nodes).await;
                            }
                            let label = if keyspace {
                                "cluster, notify-keyspace-events Kt"
                            } else {
                                "cluster, no keyspace notifications"
                            };
                            let peak = std::env::var("E2E_CLUSTER_PEAK")
                                .ok()
                                .and_then(|v| v.parse().ok());
                            latency(RedisTarget::cluster(c.urls()), label, peak).await;
                        }
                    }
                }
                "memory" => memory().await,
                "idle" => {
                    {
                        let server = RedisServer::start().expect("redis-server");
                        let target = RedisTarget::standalone(server.url());
                        let servers = idle::Servers {
                            nodes: vec![target.clone()],
                        };
                        idle::idle(target, servers, "standalone").await;
                    }
                    if cluster {
                        let c = RedisCluster::start().expect("cluster");
                        let servers = idle::Servers {
                            nodes: c
                                .urls()
                                .into_iter()
                                .map(RedisTarget::standalone)
                                .collect(),
                        };
                        idle::idle(RedisTarget::cluster(c.urls()), servers, "cluster").await;
                    }
                }
                "rebalance" => {
                    {
                        let server = RedisServer::start().expect("redis-server");
                        rebalance(RedisTarget::standalone(server.url()), "standalone").await;
                    }
                    if cluster {
                        let c = RedisCluster::start().expect("cluster");
                        rebalance(RedisTarget::cluster(c.urls()), "cluster").await;
                    }
                }
                "retention" => retention().await,
                "ordering" => {
                    let server = RedisServer::start().expect("redis-server");
                    ordering::ordering(RedisTarget::standalone(server.url())).await;
                }
                #[cfg(feature = "metrics")]
                "metrics_overhead" => {
                    let server = RedisServer::start().expect("redis-server");
                    metrics_overhead::metrics_overhead(
                        RedisTarget::standalone(server.url()),
                        "standalone",
                    )
                    .await;
                }
                #[cfg(not(feature = "metrics"))]
                "metrics_overhead" => {
                    eprintln!("metrics_overhead needs the metrics feature: --features testing,metrics")
                }
                other => eprintln!(
                    "unknown part {other}: throughput, latency, memory, rebalance, idle, retention, metrics_overhead, ordering"
                ),
            }
        }
    });
}
