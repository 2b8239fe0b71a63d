//! The raw consumer loops (and sea-streamer) the listener is measured against.

use super::*;

use std::process::Command;
use std::time::Instant;

use crate::common::*;
use redis::Value;
use stream_listener_core::internals::connection::{RedisConnection, Topology};
use stream_listener_core::internals::dataplane::{FencingMode, ReadOutcome, ShardClient};
use stream_listener_core::internals::fence::FenceToken;

/// (a) One multi-stream `XREADGROUP` per round trip over the task's shards, with the previous
/// batch's `XACK`s in the same pipeline; with `watch`, the `XACK`s are fenced by it
/// ([`Case::RawStrongWatchAck`]).
pub(crate) async fn raw_strong(
    mut conn: RedisConnection,
    keys: Vec<String>,
    group: String,
    consumer: String,
    batch: usize,
    watch: Option<WatchFence>,
) -> u64 {
    let mut acks: Vec<Vec<String>> = vec![Vec::new(); keys.len()];
    let mut total = 0;
    loop {
        let acking = acks.iter().any(|ids| !ids.is_empty());
        let watched = watch.as_ref().filter(|_| acking);
        let mut pipe = redis::pipe();
        if let Some(watch) = watched {
            watch.open(&mut pipe, &group);
        }
        for (key, ids) in keys.iter().zip(&acks) {
            if !ids.is_empty() {
                pipe.cmd("XACK").arg(key).arg(&group).arg(ids).ignore();
            }
        }
        if watched.is_some() {
            pipe.cmd("EXEC");
        }
        add_multi_stream_read(&mut pipe, &group, &consumer, batch, &keys);
        let mut replies: Vec<Value> = pipe.query_async(&mut conn).await.expect("raw read");
        let reply = replies.pop().expect("read reply");
        if watched.is_some() {
            let exec = replies.pop().expect("exec reply");
            assert_eq!(replies.pop(), Some(Value::Int(1)), "fence refused");
            assert!(
                matches!(exec, Value::Array(_)),
                "transaction aborted: {exec:?}"
            );
        }
        for ids in &mut acks {
            ids.clear();
        }
        let got = parse_read(reply, &keys, &mut acks, |_| {});
        if got == 0 {
            return total;
        }
        total += got as u64;
    }
}

/// Acks fenced through `WATCH` instead of Lua ([`Case::RawStrongWatchAck`]): a task's fence
/// hashes, its tripwire key (`{<first shard>}:trip`, standalone only), its encoded token and
/// the check script.
pub(crate) struct WatchFence {
    pub(crate) fences: Vec<String>,
    pub(crate) trip: String,
    pub(crate) encoded: String,
    pub(crate) check: redis::Script,
}

impl WatchFence {
    pub(crate) async fn new(
        conn: &mut RedisConnection,
        fences: Vec<String>,
        trip: String,
        token: &FenceToken,
    ) -> Self {
        // KEYS: the fences, then the tripwire; ARGV[1] the group, ARGV[2] the encoded token.
        let check = redis::Script::new(
            r"
for i = 1, #KEYS - 1 do
  if redis.call('HGET', KEYS[i], ARGV[1]) ~= ARGV[2] then
    redis.call('INCR', KEYS[#KEYS])
    return 0
  end
end
return 1
",
        );
        let _: String = check.prepare_invoke().load_async(conn).await.expect("load");
        WatchFence {
            fences,
            trip,
            encoded: token.encode(),
            check,
        }
    }

    /// `WATCH` the fences and the tripwire, check the fences (the tripwire is written on a
    /// refusal), `MULTI`: the caller adds the `XACK`s and `EXEC`.
    fn open(&self, pipe: &mut redis::Pipeline, group: &str) {
        pipe.cmd("WATCH").arg(&self.fences).arg(&self.trip).ignore();
        pipe.cmd("EVALSHA")
            .arg(self.check.get_hash())
            .arg(self.fences.len() + 1)
            .arg(&self.fences)
            .arg(&self.trip)
            .arg(group)
            .arg(&self.encoded);
        pipe.cmd("MULTI").ignore();
    }
}

/// Diagnostic (a) through the listener's strict read round (`ShardClient::read_round`): per round
/// one pipeline of the plain `XACK`s and the multi-stream `XREADGROUP` fenced by a transaction
/// (`MULTI`, `EVAL` the check with the read gate, the read of the shards and the gate, `EXEC`).
pub(crate) async fn raw_strong_fenced_round(
    mut client: ShardClient,
    shards: Vec<u32>,
    keys: Vec<String>,
    token: FenceToken,
    batch: usize,
) -> u64 {
    let mut acks: Vec<Vec<String>> = vec![Vec::new(); shards.len()];
    let mut total = 0;
    loop {
        let parts: Vec<(u32, &FenceToken, &[String])> = shards
            .iter()
            .zip(&acks)
            .map(|(&shard, ids)| (shard, &token, ids.as_slice()))
            .collect();
        let replies = client
            .read_round(&parts, batch, FencingMode::Strict)
            .await
            .expect("fenced round");
        let mut next = vec![Vec::new(); shards.len()];
        let mut got = 0;
        for (i, (ack, read)) in replies.into_iter().enumerate() {
            if let Some(ack) = ack {
                let ack = ack.expect("ack");
                assert_eq!(
                    ack,
                    Value::Int(acks[i].len() as i64),
                    "every handled id acked"
                );
            }
            let mut ids = vec![Vec::new()];
            got += parse_read(read, &keys[i..=i], &mut ids, |_| {});
            next[i].extend(ids.pop().unwrap_or_default());
        }
        acks = next;
        if got == 0 {
            return total;
        }
        total += got as u64;
    }
}

/// Adds `XREADGROUP GROUP <group> <consumer> COUNT <batch> STREAMS <keys…> > …` to `pipe`.
pub(crate) fn add_multi_stream_read(
    pipe: &mut redis::Pipeline,
    group: &str,
    consumer: &str,
    batch: usize,
    keys: &[String],
) {
    pipe.cmd("XREADGROUP")
        .arg("GROUP")
        .arg(group)
        .arg(consumer)
        .arg("COUNT")
        .arg(batch)
        .arg("STREAMS")
        .arg(keys);
    for _ in keys {
        pipe.arg(">");
    }
}

/// (b) The task's shards one at a time: `XACK` of the shard's previous batch and `XREADGROUP` of
/// the shard in one pipeline.
pub(crate) async fn raw_per_shard(
    mut conn: RedisConnection,
    keys: Vec<String>,
    group: String,
    consumer: String,
    batch: usize,
) -> u64 {
    let mut acks: Vec<Vec<String>> = vec![Vec::new(); keys.len()];
    let mut done = vec![false; keys.len()];
    let mut total = 0;
    while done.iter().any(|d| !d) {
        for i in 0..keys.len() {
            if done[i] {
                continue;
            }
            let mut pipe = redis::pipe();
            if !acks[i].is_empty() {
                pipe.cmd("XACK")
                    .arg(&keys[i])
                    .arg(&group)
                    .arg(&acks[i])
                    .ignore();
            }
            pipe.cmd("XREADGROUP")
                .arg("GROUP")
                .arg(&group)
                .arg(&consumer)
                .arg("COUNT")
                .arg(batch)
                .arg("STREAMS")
                .arg(&keys[i])
                .arg(">");
            let (reply,): (Value,) = pipe.query_async(&mut conn).await.expect("raw read");
            acks[i].clear();
            let mut ids = vec![Vec::new()];
            let got = parse_read(reply, &keys[i..=i], &mut ids, |_| {});
            acks[i] = ids.pop().unwrap_or_default();
            if got == 0 {
                done[i] = true;
            }
            total += got as u64;
        }
    }
    total
}

/// (c) The per-shard loop through the fence-checking scripts: the shard's previous batch acked with
/// `ShardClient::ack` and the next read with `ShardClient::read_new` (strict), both sent at once
/// on the multiplexed connection (one round trip).
pub(crate) async fn fenced_scripts(
    client: ShardClient,
    shards: Vec<u32>,
    token: FenceToken,
    batch: usize,
    mode: FencingMode,
    pipelined: bool,
    mut plain: Option<RedisConnection>,
) -> u64 {
    let mut acks: Vec<Vec<String>> = vec![Vec::new(); shards.len()];
    let mut done = vec![false; shards.len()];
    let mut total = 0;
    let mut reader = client.clone();
    let mut acker = client;
    while done.iter().any(|d| !d) {
        for i in 0..shards.len() {
            if done[i] {
                continue;
            }
            let shard = shards[i];
            let ids = std::mem::take(&mut acks[i]);
            let ack = async {
                if !ids.is_empty() {
                    let acked = acker.ack(shard, &token, &ids).await.expect("ack");
                    assert_eq!(acked.expect("fence"), ids.len());
                }
            };
            let read = if let Some(conn) = plain.as_mut() {
                let key = reader.keys().shard(shard);
                let mut cmd = redis::cmd("XREADGROUP");
                cmd.arg("GROUP")
                    .arg(reader.group())
                    .arg(reader.consumer())
                    .arg("COUNT")
                    .arg(batch)
                    .arg("STREAMS")
                    .arg(&key)
                    .arg(">");
                let read = cmd.query_async::<Value>(conn);
                let ((), reply) = tokio::join!(ack, read);
                let mut ids = vec![Vec::new()];
                let got = parse_read(reply.expect("read"), &[key], &mut ids, |_| {});
                if got == 0 {
                    done[i] = true;
                }
                total += got as u64;
                acks[i] = ids.pop().unwrap_or_default();
                continue;
            } else if pipelined {
                let read = reader.read_new(shard, &token, batch, mode);
                let ((), read) = tokio::join!(ack, read);
                read
            } else {
                ack.await;
                reader.read_new(shard, &token, batch, mode).await
            };
            match read.expect("read_new") {
                ReadOutcome::Entries(entries) => {
                    total += entries.len() as u64;
                    acks[i] = entries.into_iter().map(|e| e.id).collect();
                }
                ReadOutcome::Empty { .. } => done[i] = true,
                ReadOutcome::Fenced(f) => panic!("fenced: {f:?}"),
            }
        }
    }
    total
}

/// Pre-loads sea-streamer's own copy of the entries (`ss:<i>`, field `msg`, the same payloads) and
/// runs its consumer binary; the time is the binary's, until every entry is acked in Redis.
pub(crate) async fn run_sea_streamer(
    setup: &TpSetup,
    round: usize,
) -> (u64, f64, Option<CaseCost>) {
    let bin = std::env::var("E2E_SEA_STREAMER_BIN").expect("E2E_SEA_STREAMER_BIN");
    let Topology::Standalone(url) = setup.target.topology() else {
        panic!("sea-streamer runs on the standalone server only");
    };
    let mut conn = setup.conn.clone();
    let stream = format!("ss{round}");
    let mut pipe = redis::pipe();
    for n in 0..setup.messages {
        let shard = n % TP_SHARDS as usize;
        let payload = format!("{{\"key\":\"key-{}\",\"seq\":{n}}}", n % 1000);
        pipe.cmd("XADD")
            .arg(format!("{stream}:{shard}"))
            .arg("*")
            .arg("msg")
            .arg(payload)
            .ignore();
        if (n + 1) % 1000 == 0 || n + 1 == setup.messages {
            let () = pipe.query_async(&mut conn).await.expect("preload");
            pipe = redis::pipe();
        }
    }
    profile_marker();
    let probe = CostProbe::start(&mut conn).await;
    let started = Instant::now();
    let out = Command::new(&bin)
        .arg(url)
        .arg(&stream)
        .arg(setup.messages.to_string())
        .arg("4")
        .arg(setup.batch.to_string())
        .output()
        .expect("run sea-streamer-consume");
    let wall = started.elapsed().as_secs_f64();
    let text = String::from_utf8_lossy(&out.stdout);
    let value = |key: &str| {
        text.split_whitespace()
            .find_map(|kv| kv.strip_prefix(key))
            .and_then(|v| v.parse::<f64>().ok())
    };
    let (Some(received), Some(acked), Some(n)) =
        (value("received_s="), value("acked_s="), value("count="))
    else {
        panic!(
            "sea-streamer-consume failed: {text} {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    println!(
        "        sea-streamer: received all after {received:.2} s, when {} were still pending in Redis; all acked in Redis after {acked:.2} s (process wall {wall:.2} s)",
        value("pending_at_received=").unwrap_or(0.0)
    );
    // The client CPU is the child's: not in this process's figures.
    let cost = probe.finish(&mut conn, n as u64, received).await;
    for s in 0..TP_SHARDS {
        let () = redis::cmd("DEL")
            .arg(format!("{stream}:{s}"))
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    (n as u64, received, cost)
}
