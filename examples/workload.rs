//! `workload`: a load and fault-injection driver for stream-listener. The benchmarks and the
//! integration tests that need a member in a process of its own (to `SIGKILL` it, or freeze it
//! with `SIGSTOP` while its clocks run on: `tests/fault_*.rs`, `tests/member_*.rs`) run it as
//! real OS processes, and anyone can use it to test a deployment.
//!
//! ```text
//! workload [--redis-url URL | --cluster-node URL... | --sentinel URL... --sentinel-master NAME]
//!          produce --stream S --keys K --count N [--rate R] [--wait-replicas W [--wait-timeout-ms T]]
//! workload [--redis-url URL | --cluster-node URL... | --sentinel URL... --sentinel-master NAME]
//!          consume --stream S --group G --concurrency C
//!          [--handler-ms T] [--fail-every F] [--instance-id ID] [--fencing strict|acks]
//!          [--heartbeat-ms H --lease-ms L --rebalance-ms B] [--log-starts]
//!          [--ordering shard|key|none] [--max-in-flight M] ...
//! ```
//!
//! `--redis-url` defaults to `REDIS_URL`, then `redis://127.0.0.1:6379`; `--cluster-node` (repeat
//! it) talks to a Redis Cluster instead, `--sentinel` (repeat it) with `--sentinel-master` to the
//! master Redis Sentinel names (followed across failovers). Both commands create the stream with `--shards` shards
//! (default 8) when it does not exist, and use it as it is otherwise.
//!
//! **produce** publishes `count` messages through the routed [`Publisher`]: message `n` (from 0)
//! has partition key `key-<n mod K>` and payload `{"key":"key-<n mod K>","seq":<n div K>}`, so
//! every key's `seq` runs 0, 1, 2... in publish order. `--rate` paces it (messages per second;
//! unpaced by default). A failed batch is sent again (Redis down or restarting) until
//! `--retry-for-ms` passes without progress: messages may then be appended twice, never lost.
//! It prints one JSON line at the end: `{"event":"produced","stream":..,"keys":K,"count":N,
//! "retries":r,"elapsedUs":µs}`. With `--wait-replicas W` it sends `WAIT W T` after each batch
//! (`--wait-timeout-ms`, default 100) on the connection that appended the batch, and prints one
//! line per batch before the summary: `{"event":"replicated","first":n0,"end":n1,"acks":a,
//! "tsUs":µs}` for messages `n0..n1` (`acks` -1 when `WAIT` failed). On a standalone server the
//! reply counts the replicas that have every entry this process appended so far. On a cluster
//! redis-rs sends it to every master it has a connection to and returns the least count: a master
//! that has just died is skipped, so right after a failover a 1 does not prove that a replica
//! had the batch (docs/design.md §15.5).
//!
//! **consume** runs a listener with `concurrency` members and writes one JSON line to stdout per
//! handler call, assignment change, fenced read that returned entries, and fence rejection; with
//! `--log-starts` also one when the listener has started (`ready`, first) and one when each
//! handler call starts (`handling`). Field names and meanings are fixed: other tools read this
//! log (`stream_listener::testing::workload` parses and checks it):
//!
//! ```text
//! {"event":"ready","members":["<id>",...],"tsUs":µs}
//! {"event":"handling","member":"<id>","shard":i,"entryId":"<id>","memberEpoch":e,"attempt":a,
//!  "deliveryCount":d,"n":N|null,"tsUs":µs}
//! {"event":"handled","member":"<id>","shard":i,"entryId":"<id>","key":"<k>","seq":n,"attempt":a,
//!  "memberEpoch":e,"startUs":µs,"endUs":µs,"ok":bool}
//! {"event":"assigned"|"revoked","member":"<id>","shard":i,"memberEpoch":e,"tsUs":µs}
//! {"event":"read","member":"<id>","shard":i,"count":n,"firstId":"<id>","tsUs":µs}
//! {"event":"fenceRejected","op":"read"|"ack"|"claim","member":"<id>","shard":i,"tsUs":µs}
//! {"event":"hook","hook":"on_assigned"|"on_revoked"|"on_lost","member":"<id>","shard":i,
//!  "memberEpoch":e,"pendingIds":["<id>",...],"startUs":µs,"tsUs":µs}
//! ```
//!
//! `hook` lines come only with `--log-hooks` (the listener's lifecycle hooks, docs/design.md
//! §13.3), one per call, written when the hook ends (`pendingIds`: this member's pending entries
//! on the shard when it started). `--hook-ms` makes each hook sleep, `--hook-fail error|panic`
//! makes each one fail after logging.
//!
//! Times are µs since the Unix epoch (`SystemTime`), so the logs of several processes on one
//! host can be merged. Each line is written with one locked write and flushed before the handler
//! returns, so a line is never torn and a handled line is out before its entry is acked. The
//! payload is `{"key","seq"}` (as `produce` writes it) or `{"n": N}` (as the integration tests
//! write it; logged with `"key":null,"seq":null`, and `"n":N` in the `handling` line); any other
//! payload is logged with `"key":null,"seq":null,"ok":false` and dead-lettered (reason
//! `decode`). `--handler-ms` makes each call sleep; `--fail-every F` makes
//! the first attempt of every F-th entry the process handles fail with a retryable error (its
//! retry, attempt 2, succeeds). SIGTERM or SIGINT shuts down gracefully (drain, ack, leave) and
//! exits 0; a member stopped for good (another process took its `--instance-id`) makes the
//! process leave and exit 1. Progress and errors go to stderr.

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::{Args, Parser, Subcommand, ValueEnum};
use serde::{Deserialize, Serialize};
use serde_json::json;
use stream_listener::core::handler::{Delivery, HandlerError};
use stream_listener::core::hooks::{Hooks, ShardHookContext};
use stream_listener::core::internals::admin::{self, AdminError};
use stream_listener::core::internals::connection::{RedisConnection, RedisTarget, SentinelTarget};
use stream_listener::core::internals::coordinator::CoordinatorConfig;
use stream_listener::core::internals::dataplane::FencingMode;
use stream_listener::core::internals::keys::StreamKeys;
use stream_listener::core::internals::report::Chain;
use stream_listener::core::member::{EventCallback, Listener, ListenerEvent, ListenerOptions};
use stream_listener::core::producer::{Publisher, PublisherOptions};
use stream_listener::testing::workload::LogLine;
use tokio::signal::unix::{SignalKind, signal};

/// Load and fault-injection driver for stream-listener: publishes keyed, numbered messages, or
/// consumes them with a listener and logs every handler call and ownership change as JSON lines.
#[derive(Debug, Parser)]
#[command(name = "workload")]
struct Cli {
    /// Redis URL of a standalone server.
    #[arg(
        long,
        global = true,
        env = "REDIS_URL",
        default_value = "redis://127.0.0.1:6379",
        value_name = "URL"
    )]
    redis_url: String,

    /// Seed node of a Redis Cluster (a redis:// URL); repeat for more nodes. When given,
    /// --redis-url is ignored.
    #[arg(long = "cluster-node", global = true, value_name = "URL")]
    cluster_nodes: Vec<String>,

    /// A Redis Sentinel (a redis:// URL); repeat for more. With --sentinel-master the master is
    /// found through them and followed across failovers; --redis-url then only gives the
    /// master's user, password and database.
    #[arg(
        long = "sentinel",
        global = true,
        env = "REDIS_SENTINELS",
        value_delimiter = ',',
        value_name = "URL"
    )]
    sentinels: Vec<String>,

    /// The name the sentinels monitor the master by (e.g. mymaster).
    #[arg(
        long = "sentinel-master",
        global = true,
        env = "REDIS_SENTINEL_MASTER",
        value_name = "NAME"
    )]
    sentinel_master: Option<String>,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Publish `count` messages over `keys` partition keys, per-key seq from 0.
    Produce(ProduceArgs),
    /// Run a listener and log every handler call and ownership change as JSON lines.
    Consume(ConsumeArgs),
}

#[derive(Debug, Args)]
struct ProduceArgs {
    /// Stream prefix.
    #[arg(long)]
    stream: String,
    /// Number of partition keys (`key-0`..`key-<K-1>`).
    #[arg(long)]
    keys: u64,
    /// Number of messages.
    #[arg(long)]
    count: u64,
    /// Messages per second (unpaced when absent).
    #[arg(long)]
    rate: Option<f64>,
    /// Shards of the stream when it has to be created.
    #[arg(long, default_value_t = 8)]
    shards: u32,
    /// Messages per pipelined batch.
    #[arg(long, default_value_t = 256)]
    batch: usize,
    /// Give up when no batch could be sent for this long (ms).
    #[arg(long, default_value_t = 60_000)]
    retry_for_ms: u64,
    /// After each batch, `WAIT` for this many replicas and log a `replicated` line (0: no WAIT).
    #[arg(long, default_value_t = 0)]
    wait_replicas: u32,
    /// `WAIT`'s timeout (ms).
    #[arg(long, default_value_t = 100)]
    wait_timeout_ms: u64,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Fencing {
    /// Reads, acks and claims check the fence.
    Strict,
    /// Acks and claims check the fence; reads rely on the lease.
    Acks,
}

#[derive(Debug, Args)]
struct ConsumeArgs {
    /// Stream prefix.
    #[arg(long)]
    stream: String,
    /// Consumer group.
    #[arg(long)]
    group: String,
    /// Logical members in this process.
    #[arg(long, default_value_t = 1)]
    concurrency: u32,
    /// Each handler call sleeps this long (ms).
    #[arg(long, default_value_t = 0)]
    handler_ms: u64,
    /// The first attempt of every F-th entry fails with a retryable error (0: never).
    #[arg(long, default_value_t = 0)]
    fail_every: u64,
    /// Static membership: member ids `<ID>-m<k>`.
    #[arg(long, env = "STREAM_LISTENER_INSTANCE_ID")]
    instance_id: Option<String>,
    /// Fencing mode.
    #[arg(long, value_enum, default_value_t = Fencing::Strict)]
    fencing: Fencing,
    /// Heartbeat interval (ms); default 3000.
    #[arg(long)]
    heartbeat_ms: Option<u64>,
    /// Member lease TTL (ms); default 15000.
    #[arg(long)]
    lease_ms: Option<u64>,
    /// Rebalance timeout (ms); default 60000.
    #[arg(long)]
    rebalance_ms: Option<u64>,
    /// Lease margin taken off on the member's side (ms); default 20% of the lease.
    #[arg(long)]
    lease_margin_ms: Option<u64>,
    /// Entries per read.
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// Longest blocking wait for new entries (ms).
    #[arg(long, default_value_t = 2000)]
    block_ms: u64,
    /// Local workers per member (`runtime_max_concurrency`).
    #[arg(long, default_value_t = 1)]
    workers: u32,
    /// Handler attempts before dead-lettering.
    #[arg(long, default_value_t = 3)]
    max_attempts: u32,
    /// First retry backoff (ms).
    #[arg(long, default_value_t = 200)]
    backoff_ms: u64,
    /// Limit of one handler attempt (ms).
    #[arg(long, default_value_t = 30_000)]
    handler_timeout_ms: u64,
    /// Time in-flight handlers get at shutdown (ms).
    #[arg(long, default_value_t = 30_000)]
    shutdown_timeout_ms: u64,
    /// Shards of the stream when it has to be created.
    #[arg(long, default_value_t = 8)]
    shards: u32,
    /// Listener name (member name in `describe`).
    #[arg(long, default_value = "workload")]
    name: String,
    /// Shut down gracefully when standard input closes (for test harnesses, so that a consumer
    /// does not outlive the process that started it).
    #[arg(long)]
    exit_on_stdin_close: bool,
    /// Also log the listener's start (a `ready` line with its member ids) and the start of every
    /// handler call (a `handling` line, before the handler runs).
    #[arg(long)]
    log_starts: bool,
    /// Register `on_assigned`, `on_revoked` and `on_lost` hooks that log a `hook` line each.
    #[arg(long)]
    log_hooks: bool,
    /// Each hook sleeps this long (ms) before it logs.
    #[arg(long, default_value_t = 0)]
    hook_ms: u64,
    /// Each hook fails after logging: `error` returns one, `panic` panics.
    #[arg(long, value_enum)]
    hook_fail: Option<HookFail>,
    /// Limit of one hook call (ms); default 10 s or half the rebalance timeout.
    #[arg(long)]
    hook_timeout_ms: Option<u64>,
    /// How a shard's entries may run relative to each other (docs/design.md §14.3).
    #[arg(long, value_enum, default_value_t = OrderingArg::Shard)]
    ordering: OrderingArg,
    /// With `--ordering key` or `none`: the most handler calls of one shard at once.
    #[arg(long, default_value_t = 16)]
    max_in_flight: u32,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum OrderingArg {
    /// One entry of a shard at a time, in entry order.
    Shard,
    /// Different partition keys at once, each key in entry order.
    Key,
    /// Any entries at once.
    None,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum HookFail {
    /// The hook returns an error.
    Error,
    /// The hook panics.
    Panic,
}

/// The `--log-hooks` hooks: each reads this member's pending ids on the shard, sleeps
/// `--hook-ms`, logs a `hook` line, then fails as `--hook-fail` says.
fn logging_hooks(conn: RedisConnection, stream: &str, group: &str, args: &ConsumeArgs) -> Hooks {
    let keys = match StreamKeys::new(stream) {
        Ok(keys) => Arc::new(keys),
        Err(_) => return Hooks::default(),
    };
    let hook_time = Duration::from_millis(args.hook_ms);
    let fail = args.hook_fail;
    let group: Arc<str> = group.into();
    let hook = move |name: &'static str| {
        let (conn, keys, group) = (conn.clone(), keys.clone(), group.clone());
        move |context: ShardHookContext| {
            let (mut conn, keys, group) = (conn.clone(), keys.clone(), group.clone());
            async move {
                let start_us = now_us();
                let pending: redis::RedisResult<redis::streams::StreamPendingCountReply> =
                    redis::cmd("XPENDING")
                        .arg(keys.shard(context.shard))
                        .arg(&*group)
                        .arg("-")
                        .arg("+")
                        .arg(1000)
                        .arg(&context.member_id)
                        .query_async(&mut conn)
                        .await;
                let pending_ids: Vec<String> = pending
                    .map(|p| p.ids.into_iter().map(|id| id.id).collect())
                    .unwrap_or_default();
                if !hook_time.is_zero() {
                    tokio::time::sleep(hook_time).await;
                }
                emit(&json!({
                    "event": "hook",
                    "hook": name,
                    "member": context.member_id,
                    "shard": context.shard,
                    "memberEpoch": context.member_epoch,
                    "pendingIds": pending_ids,
                    "startUs": start_us,
                    "tsUs": now_us(),
                }));
                match fail {
                    None => Ok(()),
                    Some(HookFail::Error) => Err(format!("--hook-fail error: {name} fails")),
                    Some(HookFail::Panic) => panic!("--hook-fail panic: {name} panics"),
                }
            }
        }
    };
    let mut hooks = Hooks::default();
    hooks
        .on_assigned(hook("on_assigned"))
        .on_revoked(hook("on_revoked"))
        .on_lost(hook("on_lost"));
    hooks
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let target = if let (false, Some(master)) = (cli.sentinels.is_empty(), &cli.sentinel_master) {
        let mut sentinel = SentinelTarget::new(cli.sentinels.clone(), master.clone());
        sentinel.master_auth = Some(cli.redis_url.clone());
        RedisTarget::sentinel(sentinel)
    } else if cli.cluster_nodes.is_empty() {
        RedisTarget::standalone(cli.redis_url.clone())
    } else {
        RedisTarget::cluster(cli.cluster_nodes.clone())
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("workload: cannot start the tokio runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Produce(args) => produce(target, args).await,
            Command::Consume(args) => consume(target, args).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("workload: {error}");
            ExitCode::FAILURE
        }
    }
}

/// Wall-clock µs since the Unix epoch.
fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// Writes one line to stdout with one locked write, and flushes it.
fn emit(value: &serde_json::Value) {
    let mut line = value.to_string();
    line.push('\n');
    let mut out = std::io::stdout().lock();
    // A closed stdout (the reader went away) must not stop the listener: ignore write errors.
    let _ = out.write_all(line.as_bytes());
    let _ = out.flush();
}

async fn connect(target: &RedisTarget) -> Result<RedisConnection, String> {
    RedisConnection::connect(target, Duration::from_secs(5))
        .await
        .map_err(|e| format!("cannot connect to Redis ({target:?}): {e}"))
}

/// Creates the stream with `shards` shards when it does not exist; an existing stream is used as
/// it is, whatever its shard count.
async fn ensure_stream(
    conn: &mut RedisConnection,
    stream: &str,
    shards: u32,
) -> Result<(), String> {
    match admin::create_stream(conn, stream, shards).await {
        Ok(created) => {
            if created.created {
                eprintln!("workload: created stream {stream:?} with {shards} shards");
            }
            Ok(())
        }
        Err(AdminError::ShardCountMismatch { .. }) => Ok(()),
        Err(error) => Err(format!("cannot create stream {stream:?}: {error}")),
    }
}

/// The payload of every message `produce` writes.
#[derive(Debug, Serialize, Deserialize)]
struct Payload {
    key: String,
    seq: u64,
}

/// A payload `consume` accepts: `produce`'s, or the integration tests' `{"n": N}`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Accepted {
    Produced(Payload),
    Numbered { n: u64 },
}

async fn produce(target: RedisTarget, args: ProduceArgs) -> Result<(), String> {
    if args.keys == 0 {
        return Err("--keys must be at least 1".into());
    }
    if args.batch == 0 {
        return Err("--batch must be at least 1".into());
    }
    if let Some(rate) = args.rate
        && !(rate.is_finite() && rate > 0.0)
    {
        return Err(format!("--rate must be a positive number, not {rate}"));
    }
    let mut conn = connect(&target).await?;
    ensure_stream(&mut conn, &args.stream, args.shards).await?;
    // A clone shares the publisher's connection, so WAIT counts the replicas of its appends.
    let mut wait_conn = conn.clone();
    let publisher = Publisher::new(conn, &args.stream, PublisherOptions::default())
        .await
        .map_err(|e| format!("cannot publish to {:?}: {e}", args.stream))?;
    let started = Instant::now();
    let retry_for = Duration::from_millis(args.retry_for_ms);
    let mut sent = 0u64;
    let mut retries = 0u64;
    while sent < args.count {
        // Messages due now: all of them unpaced, else those whose time (n / rate) has come.
        let due = match args.rate {
            None => args.count,
            Some(rate) => {
                let due = (started.elapsed().as_secs_f64() * rate).floor() as u64 + 1;
                due.min(args.count)
            }
        };
        if due <= sent {
            let rate = args.rate.unwrap_or(1.0);
            let next = Duration::from_secs_f64(sent as f64 / rate);
            let wait = next.saturating_sub(started.elapsed());
            tokio::time::sleep(wait.max(Duration::from_micros(200))).await;
            continue;
        }
        let end = due.min(sent + args.batch as u64);
        let batch: Vec<(String, Payload)> = (sent..end)
            .map(|n| {
                let key = format!("key-{}", n % args.keys);
                let payload = Payload {
                    key: key.clone(),
                    seq: n / args.keys,
                };
                (key, payload)
            })
            .collect();
        let first_failure = Instant::now();
        let mut backoff = Duration::from_millis(50);
        loop {
            match publisher.publish_batch(&batch).await {
                Ok(_) => break,
                Err(error) => {
                    if first_failure.elapsed() >= retry_for {
                        return Err(format!(
                            "publishing failed for {:?}, giving up after {} of {} messages: {error}",
                            retry_for, sent, args.count
                        ));
                    }
                    retries += 1;
                    if retries == 1 || retries.is_multiple_of(10) {
                        eprintln!(
                            "workload: publishing failed ({retries} retries so far), sending the batch again: {error}"
                        );
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
            }
        }
        if args.wait_replicas > 0 {
            let acks = wait_for_replicas(&mut wait_conn, &args).await;
            emit(&json!({
                "event": "replicated",
                "first": sent,
                "end": end,
                "acks": acks,
                "tsUs": now_us(),
            }));
        }
        sent = end;
    }
    emit(&json!({
        "event": "produced",
        "stream": args.stream,
        "keys": args.keys,
        "count": args.count,
        "retries": retries,
        "elapsedUs": u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX),
    }));
    Ok(())
}

/// `WAIT <wait_replicas> <wait_timeout_ms>` on `conn`: the replicas that acknowledged every
/// write sent on it so far (on a cluster the least over the masters), -1 when it failed.
async fn wait_for_replicas(conn: &mut RedisConnection, args: &ProduceArgs) -> i64 {
    let reply: redis::RedisResult<i64> = redis::cmd("WAIT")
        .arg(args.wait_replicas)
        .arg(args.wait_timeout_ms)
        .query_async(conn)
        .await;
    reply.unwrap_or(-1)
}

fn coordination(args: &ConsumeArgs) -> Result<CoordinatorConfig, String> {
    let defaults = CoordinatorConfig::default();
    let pick = |ms: Option<u64>, default: Duration| ms.map_or(default, Duration::from_millis);
    CoordinatorConfig::new(
        pick(args.heartbeat_ms, defaults.heartbeat_interval),
        pick(args.lease_ms, defaults.member_lease_ttl),
        pick(args.rebalance_ms, defaults.rebalance_timeout),
    )
    .map_err(|e| format!("invalid timings: {e}"))
}

fn events_callback() -> EventCallback {
    EventCallback(Arc::new(|event: ListenerEvent| {
        // The line format is defined once, by the parser the tests and benchmarks read it with.
        let line = LogLine::from_event(event, now_us());
        emit(&serde_json::to_value(&line).expect("a log line serializes"));
    }))
}

async fn consume(target: RedisTarget, args: ConsumeArgs) -> Result<(), String> {
    let mut conn = connect(&target).await?;
    ensure_stream(&mut conn, &args.stream, args.shards).await?;
    let mut options = ListenerOptions::default();
    options.name = args.name.clone();
    options.concurrency = args.concurrency;
    options.runtime_max_concurrency = args.workers;
    options.batch_size = args.batch_size;
    options.block = Duration::from_millis(args.block_ms);
    options.max_attempts = args.max_attempts;
    options.backoff = Duration::from_millis(args.backoff_ms);
    options.handler_timeout = Duration::from_millis(args.handler_timeout_ms);
    options.shutdown_timeout = Duration::from_millis(args.shutdown_timeout_ms);
    options.fencing = match args.fencing {
        Fencing::Strict => FencingMode::Strict,
        Fencing::Acks => FencingMode::Acks,
    };
    options.instance_id = args.instance_id.clone();
    options.coordination = coordination(&args)?;
    options.lease_margin = args.lease_margin_ms.map(Duration::from_millis);
    options.events = Some(events_callback());
    if args.log_hooks {
        options.hooks = logging_hooks(conn.clone(), &args.stream, &args.group, &args);
    }
    options.hook_timeout = args.hook_timeout_ms.map(Duration::from_millis);
    options.ordering = match args.ordering {
        OrderingArg::Shard => stream_listener::core::member::Ordering::Shard,
        OrderingArg::Key => stream_listener::core::member::Ordering::Key,
        OrderingArg::None => stream_listener::core::member::Ordering::None,
    };
    options.max_in_flight = args.max_in_flight;

    let handler_time = Duration::from_millis(args.handler_ms);
    let fail_every = args.fail_every;
    let log_starts = args.log_starts;
    // Entries seen on a first attempt, for --fail-every.
    let first_attempts = Arc::new(AtomicU64::new(0));
    let handler = move |delivery: Delivery| {
        let first_attempts = first_attempts.clone();
        async move {
            let start_us = now_us();
            let accepted: Option<Accepted> = delivery
                .payload()
                .and_then(|bytes| serde_json::from_slice(bytes).ok());
            if log_starts {
                let n = match &accepted {
                    Some(Accepted::Numbered { n }) => Some(*n),
                    _ => None,
                };
                emit(&json!({
                    "event": "handling",
                    "member": &*delivery.member_id,
                    "shard": delivery.shard,
                    "entryId": delivery.entry_id,
                    "memberEpoch": delivery.member_epoch,
                    "attempt": delivery.attempt,
                    "deliveryCount": delivery.delivery_count,
                    "n": n,
                    "tsUs": start_us,
                }));
            }
            let payload = match &accepted {
                Some(Accepted::Produced(p)) => Some(p),
                _ => None,
            };
            let mut result = match &accepted {
                Some(_) => Ok(()),
                None => Err(HandlerError::Decode(
                    "payload is not {\"key\":<string>,\"seq\":<integer>} nor {\"n\":<integer>}"
                        .into(),
                )),
            };
            if result.is_ok() {
                if !handler_time.is_zero() {
                    tokio::time::sleep(handler_time).await;
                }
                if fail_every > 0 && delivery.attempt == 1 {
                    let n = first_attempts.fetch_add(1, Ordering::Relaxed) + 1;
                    if n.is_multiple_of(fail_every) {
                        result = Err(HandlerError::retryable(format!(
                            "--fail-every {fail_every}: entry {n} of this process fails once"
                        )));
                    }
                }
            }
            let (key, seq) = match &payload {
                Some(p) => (json!(p.key), json!(p.seq)),
                None => (serde_json::Value::Null, serde_json::Value::Null),
            };
            emit(&json!({
                "event": "handled",
                "member": &*delivery.member_id,
                "shard": delivery.shard,
                "entryId": delivery.entry_id,
                "key": key,
                "seq": seq,
                "attempt": delivery.attempt,
                "memberEpoch": delivery.member_epoch,
                "startUs": start_us,
                "endUs": now_us(),
                "ok": result.is_ok(),
            }));
            result
        }
    };

    // Installed before the members start, so that an early SIGTERM is graceful too.
    let mut terminate = signal(SignalKind::terminate())
        .map_err(|e| format!("cannot install signal handlers: {e}"))?;
    // With its causes: a listener error keeps them as its sources (docs/design.md §8.14).
    let listener = Listener::new(target, &args.stream, &args.group, handler, options)
        .map_err(|e| Chain(&e).to_string())?;
    let handle = listener.start().await.map_err(|e| Chain(&e).to_string())?;
    if args.log_starts {
        emit(&json!({"event": "ready", "members": handle.member_ids(), "tsUs": now_us()}));
    }
    eprintln!(
        "workload: consuming {:?} as group {:?} with members {}",
        args.stream,
        args.group,
        handle.member_ids().join(", ")
    );
    if args.exit_on_stdin_close {
        let token = handle.shutdown_token();
        std::thread::spawn(move || {
            let mut stdin = std::io::stdin().lock();
            let mut buf = [0u8; 256];
            while matches!(std::io::Read::read(&mut stdin, &mut buf), Ok(n) if n > 0) {}
            token.cancel();
        });
    }
    // As `ListenerHandle::run_until_signal`, and also ends when a member stops for good (another
    // process took its static identity): the process then leaves and exits with an error rather
    // than run with fewer members.
    let token = handle.shutdown_token();
    let stopped = tokio::select! {
        _ = tokio::signal::ctrl_c() => None,
        _ = terminate.recv() => None,
        _ = token.cancelled() => None,
        stopped = handle.stopped_for_good() => Some(stopped),
    };
    // Fault tests stop this process with Redis paused or gone: a shutdown that is not clean is
    // reported, not fatal (its entries stay pending; the checker judges what was handled).
    if let Err(error) = handle.shutdown_and_wait().await {
        eprintln!("workload: shutdown was not clean: {error:?}");
    }
    if let Some(stopped) = stopped {
        return Err(format!(
            "member {} stopped for good: {}",
            stopped.member_id, stopped.reason
        ));
    }
    eprintln!("workload: left the group");
    Ok(())
}
