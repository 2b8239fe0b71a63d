//! Producer throughput: `Publisher::publish_batch` (batches of 64 small JSON
//! payloads) against a raw pipelined `XADD` loop, on the same throwaway Redis, in the same run.
//!
//! - `raw`: the yardstick. The same messages, the same batches of 64, the same shard keys and the
//!   same `XADD <shard> NOMKSTREAM * key <k> payload <json>` commands, one pipeline per batch on the
//!   same kind of connection ([`RedisConnection`]) — but with JSON and shard keys computed before
//!   the clock starts, so it measures Redis and the client alone.
//! - `publish_batch`: serialization, size check, routing (XXH64 + jump hash), the cache check and
//!   the pipeline, all inside the clock.
//! - Rounds alternate (`raw` first in even rounds, `publish_batch` first in odd ones) to spread
//!   drift and noise; between rounds, outside the clock, every shard stream is emptied
//!   (`XTRIM MAXLEN 0`) so both sides append to streams of the same size.
//!
//! Concurrent callers (goal: at least 0.7 of `raw`, BENCHMARKS.md "Producer"): [`CALLERS`]
//! tokio tasks share one `Publisher` (clones), each calling `Publisher::publish` for one entry at
//! a time over its contiguous share of the round's messages, against `raw` in the same
//! alternating rounds; for reference, the same tasks sending one raw `XADD` per call. On the
//! local cluster the yardstick is the raw per-shard pipelines (below). Each table also gives
//! Redis's CPU per entry: `used_cpu_sys + used_cpu_user` of `INFO cpu`, summed over the servers,
//! read before and after each timed slice.
//!
//! Also measured (information, no goal): on the standalone server, a raw loop that sends one
//! pipeline per shard concurrently (what a cluster needs) instead of one per batch, and
//! `Publisher::publish` against a raw `XADD`, one message per round trip; on a local 3-master
//! cluster, `publish_batch` against a raw loop of per-shard pipelines sent concurrently.
//!
//! Waiting for replicas (README "Waiting for replicas"): against a master with one replica on
//! loopback, `publish_batch` and `publish` with `min_replica_acks = 0` against the same with
//! `min_replica_acks = 1` (a `WAIT 1 <timeout>` pipelined after each batch or message), in the
//! same alternating rounds.
//!
//! Run from the repository root:
//!
//! ```sh
//! cargo bench -p stream-listener-core --features testing --bench producer
//! ```
//!
//! Environment: `PRODUCER_BENCH_MESSAGES` (default 200000, per side), `PRODUCER_BENCH_ROUNDS`
//! (default 10), `PRODUCER_BENCH_CLUSTER=0` skips the cluster part, `PRODUCER_BENCH_ONLY=replica`
//! runs only the replica part (a short run: `PRODUCER_BENCH_MESSAGES=20000
//! PRODUCER_BENCH_ROUNDS=6`), `PRODUCER_BENCH_ONLY=concurrent` only the concurrent callers
//! (standalone and cluster). Goals: `publish_batch` at least 0.8 of `raw`, `publish` from
//! [`CALLERS`] tasks at least 0.7 of `raw` (BENCHMARKS.md, "Producer").

use std::collections::BTreeMap;
use std::hint::black_box;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::try_join_all;
use serde::Serialize;
use stream_listener_core::internals::admin;
use stream_listener_core::internals::connection::{RedisConnection, RedisTarget};
use stream_listener_core::internals::keys::StreamKeys;
use stream_listener_core::producer::{Publisher, PublisherOptions, shard_for_key};
use stream_listener_core::testing::{RedisCluster, RedisServer};

const PREFIX: &str = "bench";
const SHARDS: u32 = 16;
const BATCH: usize = 64;
const DISTINCT_KEYS: usize = 50_000;
/// Concurrent tasks of the concurrent-caller cases.
const CALLERS: usize = 64;

/// A small JSON payload (about 90 bytes serialized).
#[derive(Debug, Clone, Serialize)]
struct Order {
    id: u64,
    customer: String,
    amount_cents: u64,
    currency: &'static str,
    express: bool,
}

struct Workload {
    keys: Vec<String>,
    orders: Vec<Order>,
    /// For the raw loops: JSON and shard key of each message, computed up front.
    json: Vec<Vec<u8>>,
    shard_keys: Vec<String>,
    shards: Vec<u32>,
}

impl Workload {
    fn new(messages: usize) -> Workload {
        let keys: Vec<String> = (0..messages)
            .map(|i| format!("customer-{}", i % DISTINCT_KEYS))
            .collect();
        let orders: Vec<Order> = (0..messages)
            .map(|i| Order {
                id: i as u64,
                customer: keys[i].clone(),
                amount_cents: 1_000 + (i as u64 * 37) % 100_000,
                currency: "EUR",
                express: i % 3 == 0,
            })
            .collect();
        let json = orders
            .iter()
            .map(|o| serde_json::to_vec(o).unwrap())
            .collect();
        let stream = StreamKeys::new(PREFIX).unwrap();
        let shards: Vec<u32> = keys.iter().map(|k| shard_for_key(k, SHARDS)).collect();
        let shard_keys = shards.iter().map(|s| stream.shard(*s)).collect();
        Workload {
            keys,
            orders,
            json,
            shard_keys,
            shards,
        }
    }

    fn len(&self) -> usize {
        self.keys.len()
    }

    fn xadd(&self, pipe: &mut redis::Pipeline, i: usize) {
        pipe.cmd("XADD")
            .arg(&self.shard_keys[i])
            .arg("NOMKSTREAM")
            .arg("*")
            .arg("key")
            .arg(&self.keys[i])
            .arg("payload")
            .arg(&self.json[i]);
    }
}

/// The stream, through the admin API: [`SHARDS`] ACTIVE shards and their empty shard streams.
async fn create_stream(conn: &mut RedisConnection) {
    admin::create_stream(conn, PREFIX, SHARDS).await.unwrap();
}

/// Empties every shard stream (kept, so `NOMKSTREAM` still finds it).
async fn trim(conn: &mut RedisConnection) {
    let keys = StreamKeys::new(PREFIX).unwrap();
    for shard in 0..SHARDS {
        let _: i64 = redis::cmd("XTRIM")
            .arg(keys.shard(shard))
            .arg("MAXLEN")
            .arg(0)
            .query_async(conn)
            .await
            .unwrap();
    }
}

/// Raw: one pipeline of `BATCH` XADDs per batch.
async fn raw_one_pipeline(conn: &RedisConnection, w: &Workload, range: Range<usize>) {
    let mut conn = conn.clone();
    let indices: Vec<usize> = range.collect();
    for batch in indices.chunks(BATCH) {
        let mut pipe = redis::Pipeline::with_capacity(batch.len());
        for &i in batch {
            w.xadd(&mut pipe, i);
        }
        let ids: Vec<Option<String>> = pipe.query_async(&mut conn).await.unwrap();
        black_box(ids);
    }
}

/// Raw: per batch, one pipeline per shard, all in flight at once.
async fn raw_per_shard(conn: &RedisConnection, w: &Workload, range: Range<usize>) {
    let indices: Vec<usize> = range.collect();
    for batch in indices.chunks(BATCH) {
        let mut by_shard: BTreeMap<u32, redis::Pipeline> = BTreeMap::new();
        for &i in batch {
            w.xadd(by_shard.entry(w.shards[i]).or_default(), i);
        }
        let replies = try_join_all(by_shard.into_values().map(|pipe| {
            let mut conn = conn.clone();
            async move { pipe.query_async::<Vec<Option<String>>>(&mut conn).await }
        }))
        .await
        .unwrap();
        black_box(replies);
    }
}

/// Raw: one `XADD` per round trip.
async fn raw_single(conn: &RedisConnection, w: &Workload, range: Range<usize>) {
    let mut conn = conn.clone();
    for i in range {
        let id: Option<String> = redis::cmd("XADD")
            .arg(&w.shard_keys[i])
            .arg("NOMKSTREAM")
            .arg("*")
            .arg("key")
            .arg(&w.keys[i])
            .arg("payload")
            .arg(&w.json[i])
            .query_async(&mut conn)
            .await
            .unwrap();
        black_box(id);
    }
}

/// `publish_batch`, `BATCH` messages at a time.
async fn publisher_batches(publisher: &Publisher, w: &Workload, range: Range<usize>) {
    let indices: Vec<usize> = range.collect();
    let mut batch: Vec<(&str, &Order)> = Vec::with_capacity(BATCH);
    for chunk in indices.chunks(BATCH) {
        batch.clear();
        batch.extend(chunk.iter().map(|&i| (w.keys[i].as_str(), &w.orders[i])));
        black_box(publisher.publish_batch(&batch).await.unwrap());
    }
}

/// `publish`, one message at a time.
async fn publisher_single(publisher: &Publisher, w: &Workload, range: Range<usize>) {
    for i in range {
        black_box(publisher.publish(&w.keys[i], &w.orders[i]).await.unwrap());
    }
}

/// `range` cut into [`CALLERS`] contiguous shares (the last ones may be shorter or empty).
fn shares(range: Range<usize>) -> impl Iterator<Item = Range<usize>> {
    let per = range.len().div_ceil(CALLERS);
    (0..CALLERS).map(move |t| {
        let start = (range.start + t * per).min(range.end);
        start..(start + per).min(range.end)
    })
}

/// Raw: [`CALLERS`] tasks, each sending one `XADD` per call over its share.
async fn raw_concurrent(conn: &RedisConnection, w: &Arc<Workload>, range: Range<usize>) {
    let tasks: Vec<_> = shares(range)
        .map(|share| {
            let (conn, w) = (conn.clone(), Arc::clone(w));
            tokio::spawn(async move { raw_single(&conn, &w, share).await })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
}

/// [`CALLERS`] tasks on clones of one publisher, each calling `publish` over its share.
async fn publisher_concurrent(publisher: &Publisher, w: &Arc<Workload>, range: Range<usize>) {
    let tasks: Vec<_> = shares(range)
        .map(|share| {
            let (publisher, w) = (publisher.clone(), Arc::clone(w));
            tokio::spawn(async move { publisher_single(&publisher, &w, share).await })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Case {
    Raw,
    PublishBatch,
    RawPerShard,
    RawSingle,
    PublishSingle,
    PublishBatchWaiting,
    PublishSingleWaiting,
    PublishConcurrent,
    RawConcurrent,
}

impl Case {
    fn name(self) -> &'static str {
        match self {
            Case::Raw => "raw pipelined XADD loop (one pipeline per batch of 64)",
            Case::PublishBatch => "Publisher::publish_batch (batch 64)",
            Case::RawPerShard => "raw, one pipeline per shard per batch, concurrent",
            Case::RawSingle => "raw XADD, one message per round trip",
            Case::PublishSingle => "Publisher::publish (one message per round trip)",
            Case::PublishBatchWaiting => {
                "Publisher::publish_batch (batch 64), min_replica_acks = 1"
            }
            Case::PublishSingleWaiting => "Publisher::publish, min_replica_acks = 1",
            Case::PublishConcurrent => {
                "Publisher::publish from 64 concurrent tasks, one entry per call"
            }
            Case::RawConcurrent => "raw XADD from 64 concurrent tasks, one per call",
        }
    }
}

#[derive(Default)]
struct Tally {
    messages: usize,
    elapsed: Duration,
    round_rates: Vec<f64>,
    /// Redis CPU (user + sys, every server) spent during the timed slices.
    redis_cpu: Duration,
}

impl Tally {
    fn add(&mut self, messages: usize, elapsed: Duration, redis_cpu: Duration) {
        self.messages += messages;
        self.elapsed += elapsed;
        self.redis_cpu += redis_cpu;
        self.round_rates
            .push(messages as f64 / elapsed.as_secs_f64());
    }

    fn rate(&self) -> f64 {
        self.messages as f64 / self.elapsed.as_secs_f64()
    }

    fn median(&self) -> f64 {
        median(&self.round_rates)
    }

    /// Redis CPU per entry, in microseconds.
    fn cpu_per_entry_us(&self) -> f64 {
        self.redis_cpu.as_secs_f64() * 1e6 / self.messages as f64
    }
}

fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// What one part of the bench runs against.
struct Target<'a> {
    conn: &'a RedisConnection,
    publisher: &'a Publisher,
    /// The publisher of the `*Waiting` cases (`min_replica_acks = 1`).
    waiting: &'a Publisher,
    /// One plain connection per Redis server (every cluster node), for `INFO cpu`.
    servers: &'a [RedisConnection],
}

/// `used_cpu_sys + used_cpu_user` summed over `servers` (`INFO cpu`).
async fn redis_cpu(servers: &[RedisConnection]) -> Duration {
    let mut total = 0.0;
    for server in servers {
        let info: String = redis::cmd("INFO")
            .arg("cpu")
            .query_async(&mut server.clone())
            .await
            .unwrap();
        total += info
            .lines()
            .filter_map(|line| {
                let (name, value) = line.trim().split_once(':')?;
                matches!(name, "used_cpu_sys" | "used_cpu_user").then(|| value.parse::<f64>())
            })
            .map(Result::unwrap)
            .sum::<f64>();
    }
    Duration::from_secs_f64(total)
}

async fn run_case(case: Case, t: &Target<'_>, w: &Arc<Workload>, range: Range<usize>) -> Duration {
    let start = Instant::now();
    match case {
        Case::Raw => raw_one_pipeline(t.conn, w, range).await,
        Case::PublishBatch => publisher_batches(t.publisher, w, range).await,
        Case::RawPerShard => raw_per_shard(t.conn, w, range).await,
        Case::RawSingle => raw_single(t.conn, w, range).await,
        Case::PublishSingle => publisher_single(t.publisher, w, range).await,
        Case::PublishBatchWaiting => publisher_batches(t.waiting, w, range).await,
        Case::PublishSingleWaiting => publisher_single(t.waiting, w, range).await,
        Case::PublishConcurrent => publisher_concurrent(t.publisher, w, range).await,
        Case::RawConcurrent => raw_concurrent(t.conn, w, range).await,
    }
    start.elapsed()
}

/// Runs `cases` in `rounds` alternating rounds over `w` (each case sends every message once, in
/// `rounds` slices); returns the tallies. `single_share` divides the slices of
/// [`Case::RawSingle`] and [`Case::PublishSingle`] (they are slow).
async fn measure(
    t: &Target<'_>,
    w: &Arc<Workload>,
    rounds: usize,
    cases: &[Case],
    single_share: usize,
) -> BTreeMap<Case, Tally> {
    let mut tallies: BTreeMap<Case, Tally> = BTreeMap::new();
    let per_round = w.len() / rounds;
    let mut trim_conn = t.conn.clone();
    // Warm-up: one slice of each, not counted.
    for &case in cases {
        run_case(case, t, w, 0..per_round.min(5_000)).await;
    }
    trim(&mut trim_conn).await;
    for round in 0..rounds {
        let range = round * per_round..(round + 1) * per_round;
        let mut order: Vec<Case> = cases.to_vec();
        if round % 2 == 1 {
            order.reverse();
        }
        for case in order {
            let range = if matches!(
                case,
                Case::RawSingle | Case::PublishSingle | Case::PublishSingleWaiting
            ) {
                range.start..range.start + per_round / single_share
            } else {
                range.clone()
            };
            let messages = range.len();
            let cpu_before = redis_cpu(t.servers).await;
            let elapsed = run_case(case, t, w, range).await;
            let cpu = redis_cpu(t.servers).await.saturating_sub(cpu_before);
            tallies.entry(case).or_default().add(messages, elapsed, cpu);
            trim(&mut trim_conn).await;
        }
    }
    tallies
}

fn report(title: &str, tallies: &BTreeMap<Case, Tally>, yardstick: Case) {
    let base = &tallies[&yardstick];
    println!("\n{title}");
    println!(
        "| case | messages | msgs/s (total) | msgs/s (median round) | ratio to yardstick (total) | ratio (median of rounds) | Redis CPU µs/entry |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for (case, tally) in tallies {
        let paired: Vec<f64> = tally
            .round_rates
            .iter()
            .zip(&base.round_rates)
            .map(|(a, b)| a / b)
            .collect();
        println!(
            "| {} | {} | {:.0} | {:.0} | {:.3} | {:.3} | {:.2} |",
            case.name(),
            tally.messages,
            tally.rate(),
            tally.median(),
            tally.rate() / base.rate(),
            median(&paired),
            tally.cpu_per_entry_us(),
        );
    }
}

/// Prints whether `case` reached `goal` times `yardstick`'s rate (`what` names the goal).
fn goal(tallies: &BTreeMap<Case, Tally>, what: &str, case: Case, yardstick: Case, goal: f64) {
    let ratio = tallies[&case].rate() / tallies[&yardstick].rate();
    println!(
        "goal ({what} >= {goal:.2}): {ratio:.3} -> {}",
        if ratio >= goal { "met" } else { "NOT met" }
    );
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

async fn connect(url: String) -> RedisConnection {
    RedisConnection::connect(&RedisTarget::standalone(url), Duration::from_secs(10))
        .await
        .unwrap()
}

async fn bench() {
    let messages = env_usize("PRODUCER_BENCH_MESSAGES", 200_000);
    let rounds = env_usize("PRODUCER_BENCH_ROUNDS", 10).max(1);
    let cluster = std::env::var("PRODUCER_BENCH_CLUSTER").map_or(true, |v| v != "0");
    let only = std::env::var("PRODUCER_BENCH_ONLY").unwrap_or_default();
    let w = Arc::new(Workload::new(messages));
    let payload_bytes: usize = w.json.iter().map(Vec::len).sum::<usize>() / w.len();
    println!(
        "producer bench: {messages} messages per case, {rounds} alternating rounds, batch {BATCH}, {SHARDS} shards, {DISTINCT_KEYS} distinct keys, mean JSON payload {payload_bytes} bytes, {CALLERS} concurrent callers"
    );

    if only == "replica" {
        replica_part(&w, rounds).await;
        return;
    }
    let all = only != "concurrent";

    // Standalone.
    let server = RedisServer::start().unwrap();
    let conn = connect(server.url()).await;
    let mut setup = conn.clone();
    create_stream(&mut setup).await;
    let publisher = Publisher::new(conn.clone(), PREFIX, PublisherOptions::default())
        .await
        .unwrap();
    let servers = [conn.clone()];
    let t = Target {
        conn: &conn,
        publisher: &publisher,
        waiting: &publisher,
        servers: &servers,
    };
    let tallies = measure(
        &t,
        &w,
        rounds,
        &[Case::Raw, Case::PublishConcurrent, Case::RawConcurrent],
        1,
    )
    .await;
    report(
        "Standalone, goal: publish from 64 concurrent tasks >= 0.7 of raw",
        &tallies,
        Case::Raw,
    );
    goal(
        &tallies,
        "publish from 64 tasks / raw",
        Case::PublishConcurrent,
        Case::Raw,
        0.7,
    );
    if all {
        let tallies = measure(&t, &w, rounds, &[Case::Raw, Case::PublishBatch], 1).await;
        report(
            "Standalone, goal: publish_batch >= 0.8 of raw",
            &tallies,
            Case::Raw,
        );
        goal(
            &tallies,
            "publish_batch / raw",
            Case::PublishBatch,
            Case::Raw,
            0.8,
        );
        let extra = measure(
            &t,
            &w,
            rounds,
            &[
                Case::Raw,
                Case::RawPerShard,
                Case::RawSingle,
                Case::PublishSingle,
            ],
            20,
        )
        .await;
        report(
            "Standalone, information: pipeline shapes and unpipelined publish",
            &extra,
            Case::Raw,
        );
    }
    drop(server);

    if cluster {
        let cluster = RedisCluster::start().unwrap();
        let conn = RedisConnection::connect(
            &RedisTarget::cluster(cluster.urls()),
            Duration::from_secs(10),
        )
        .await
        .unwrap();
        let mut setup = conn.clone();
        create_stream(&mut setup).await;
        let publisher = Publisher::new(conn.clone(), PREFIX, PublisherOptions::default())
            .await
            .unwrap();
        let mut servers = Vec::new();
        for node in cluster.nodes() {
            servers.push(connect(node.url()).await);
        }
        let t = Target {
            conn: &conn,
            publisher: &publisher,
            waiting: &publisher,
            servers: &servers,
        };
        let half = Arc::new(Workload::new(messages / 2));
        let tallies = measure(
            &t,
            &half,
            rounds,
            &[
                Case::RawPerShard,
                Case::PublishConcurrent,
                Case::RawConcurrent,
            ],
            1,
        )
        .await;
        report(
            "3-master cluster: publish from 64 concurrent tasks against raw per-shard pipelines",
            &tallies,
            Case::RawPerShard,
        );
        goal(
            &tallies,
            "publish from 64 tasks / raw per-shard pipelines",
            Case::PublishConcurrent,
            Case::RawPerShard,
            0.7,
        );
        if all {
            let tallies = measure(
                &t,
                &half,
                rounds,
                &[Case::RawPerShard, Case::PublishBatch],
                1,
            )
            .await;
            report(
                "3-master cluster, information: publish_batch against raw per-shard pipelines",
                &tallies,
                Case::RawPerShard,
            );
        }
    }
    if all {
        replica_part(&w, rounds).await;
    }
}

/// A master and one replica of it on loopback (`replicaof`), the replica online.
async fn master_and_replica() -> (RedisServer, RedisServer, RedisConnection) {
    let master = RedisServer::start().unwrap();
    let replica = RedisServer::builder()
        .config("replicaof", format!("127.0.0.1 {}", master.port()))
        .start()
        .unwrap();
    let conn = connect(master.url()).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query_async(&mut conn.clone())
            .await
            .unwrap();
        if info.contains("connected_slaves:1") && info.contains("state=online") {
            break;
        }
        assert!(Instant::now() < deadline, "replica not online: {info}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (master, replica, conn)
}

/// `min_replica_acks = 0` against `1`, batch and single, against a master with one replica.
async fn replica_part(w: &Arc<Workload>, rounds: usize) {
    let (master, replica, conn) = master_and_replica().await;
    let mut setup = conn.clone();
    create_stream(&mut setup).await;
    let plain = Publisher::new(conn.clone(), PREFIX, PublisherOptions::default())
        .await
        .unwrap();
    let waiting_options = PublisherOptions {
        min_replica_acks: 1,
        replica_ack_timeout: Duration::from_secs(1),
        ..PublisherOptions::default()
    };
    let waiting = Publisher::new(conn.clone(), PREFIX, waiting_options)
        .await
        .unwrap();
    let servers = [connect(master.url()).await, connect(replica.url()).await];
    let t = Target {
        conn: &conn,
        publisher: &plain,
        waiting: &waiting,
        servers: &servers,
    };
    let tallies = measure(
        &t,
        w,
        rounds,
        &[Case::PublishBatch, Case::PublishBatchWaiting],
        1,
    )
    .await;
    report(
        "Master + 1 replica (loopback), publish_batch: min_replica_acks = 0 vs 1",
        &tallies,
        Case::PublishBatch,
    );
    let tallies = measure(
        &t,
        w,
        rounds,
        &[Case::PublishSingle, Case::PublishSingleWaiting],
        10,
    )
    .await;
    report(
        "Master + 1 replica (loopback), publish: min_replica_acks = 0 vs 1",
        &tallies,
        Case::PublishSingle,
    );
}

fn main() {
    // One client thread for every case, like a producer task; the server(s) use the other core.
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(bench());
}
