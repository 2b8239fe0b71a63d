//! One round trip for several shards on a standalone server, in `fencing = "acks"` mode: one
//! script call acking each shard's previous batch, each fenced with the shard's own token
//! (`scripts::ack_shards`), then one multi-stream
//! `XREADGROUP GROUP <g> <consumer> COUNT <n> STREAMS <k1> … <kN> > … >`, in one pipeline. This
//! is the strong raw loop of BENCHMARKS.md item 1; the poller's read rounds
//! (`poller::rounds`) decide which shards share a round. On a cluster the shard keys are in
//! different hash slots and cannot share a command: shards read one at a time there.
//!
//! The replies are handed back per shard, unparsed, so that each shard's own
//! [`super::ShardClient`] reads them exactly as it reads its own one-shard pipeline
//! ([`super::ShardClient::ack_reply`], [`super::ShardClient::read_new_reply`]).

use redis::Value;

use super::scripts;
use crate::connection::{RedisConnection, RedisFailure};

/// One shard's part of a round's multi-shard ack ([`super::ShardClient::ack_part`]).
pub(crate) struct AckPart {
    /// The shard's fence key `{<prefix>:<i>}:fence`.
    pub(crate) fence: String,
    /// The shard's arguments: encoded token, incarnation, member epoch, number of ids, the ids.
    pub(crate) args: redis::Cmd,
}

/// One shard's part of a [`read_round`].
pub(crate) struct RoundPart {
    /// The shard stream key `{<prefix>:<i>}`.
    pub(crate) key: String,
    /// The fenced ack of the shard's previous batch; `None` when it has nothing to ack.
    pub(crate) ack: Option<AckPart>,
}

/// What a round returned for one [`RoundPart`].
#[derive(Debug)]
pub(crate) struct PartReply {
    /// The shard's reply to the ack, shaped as the one-shard ack script's; `None` when the part
    /// had no ack.
    pub(crate) ack: Option<redis::RedisResult<Value>>,
    /// The shard's share of the read.
    pub(crate) read: PartRead,
}

/// A shard's share of a round's multi-stream read.
#[derive(Debug)]
pub(crate) enum PartRead {
    /// Shaped as a one-stream `XREADGROUP` reply: `[[key, entries]]`, or nil when nothing was new.
    Entries(Value),
    /// The read failed with an error reply and delivered nothing (Redis checks every stream's
    /// group before reading any: one shard's missing group fails it for all): read the shard on
    /// its own, which reports that shard's own error.
    ReadAlone,
    /// A reply of an unexpected shape: entries may have been delivered; re-read this consumer's
    /// pending entries.
    Unexpected(String),
}

impl PartReply {
    /// Whether the read returned at least one entry for this shard.
    pub(crate) fn has_entries(&self) -> bool {
        match &self.read {
            PartRead::Entries(Value::Array(streams)) => streams.iter().any(|pair| match pair {
                Value::Array(pair) => matches!(pair.get(1), Some(Value::Array(e)) if !e.is_empty()),
                _ => false,
            }),
            _ => false,
        }
    }
}

/// Sends the acks of `parts` (those that have one, in one `ack_shards` script call) and one
/// multi-stream `XREADGROUP` of up to `count` new entries per shard, for consumer `consumer` of
/// group `group`, as one pipeline. Returns one [`PartReply`] per part, in order. Standalone
/// servers only (one command spans all the keys). Never blocks. When the server lost the script
/// (`NOSCRIPT`: restarted), it is loaded again for the next round and each shard's ack reply is
/// that error (the shard acks on its own).
///
/// # Errors
/// The [`redis::RedisError`] of the pipeline as a whole (connection lost, response timeout):
/// nothing is known of what ran; each shard acks again and re-reads its own pending entries.
/// Errors of single commands (a refused script, a missing group) come back inside the replies.
pub(crate) async fn read_round(
    conn: &mut RedisConnection,
    group: &str,
    consumer: &str,
    count: usize,
    parts: Vec<RoundPart>,
    wait: Option<&crate::replication::AckWaits>,
) -> redis::RedisResult<Vec<PartReply>> {
    let mut pipe = redis::pipe();
    let mut read = redis::cmd("XREADGROUP");
    read.arg("GROUP")
        .arg(group)
        .arg(consumer)
        .arg("COUNT")
        .arg(count.max(1))
        .arg("STREAMS");
    let acking = parts.iter().filter(|p| p.ack.is_some()).count();
    let mut ack = redis::cmd("EVALSHA");
    ack.arg(scripts::ack_shards().get_hash()).arg(2 * acking);
    let mut keys = Vec::with_capacity(parts.len());
    let mut has_ack = Vec::with_capacity(parts.len());
    let mut ack_args = Vec::with_capacity(acking);
    for part in parts {
        read.arg(&part.key);
        has_ack.push(part.ack.is_some());
        if let Some(part_ack) = part.ack {
            ack.arg(&part.key).arg(part_ack.fence);
            ack_args.push(part_ack.args);
        }
        keys.push(part.key);
    }
    ack.arg(group);
    for args in &ack_args {
        for arg in args.args_iter() {
            if let redis::Arg::Simple(bytes) = arg {
                ack.arg(bytes);
            }
        }
    }
    for _ in &keys {
        read.arg(">");
    }
    if acking > 0 {
        pipe.add_command(ack);
    }
    pipe.add_command(read).ignore_errors();
    // The acks' WAIT last (`min_replica_acks`): it covers the ack script before it.
    let turn = wait
        .filter(|_| acking > 0)
        .and_then(crate::replication::AckWaits::begin);
    if let Some(turn) = &turn {
        pipe.add_command(turn.cmd());
    }
    let mut replies: Vec<Value> = pipe.query_async(conn).await?;
    if let Some(turn) = turn {
        turn.finish(replies.pop().as_ref(), acking);
    }
    let read_reply = replies.pop();
    let mut acks = split_acks(replies.pop(), acking);
    if acks.first().and_then(RedisFailure::of_reply) == Some(RedisFailure::NoScript) {
        // Best effort: if this fails, the next round finds NOSCRIPT again and tries again.
        let _ = scripts::ack_shards().load_async(conn).await;
    }
    let mut acks = acks.drain(..);
    let mut shares = match read_reply {
        Some(Value::ServerError(_)) => Err(None),
        Some(reply) => split_by_stream(reply, &keys).ok_or_else(|| Some("read reply".to_owned())),
        None => Err(Some("no read reply".to_owned())),
    };
    let mut out = Vec::with_capacity(keys.len());
    for (i, key) in keys.into_iter().enumerate() {
        let ack = if has_ack[i] {
            acks.next().map(into_result)
        } else {
            None
        };
        let read = match &mut shares {
            Ok(shares) => PartRead::Entries(match shares[i].take() {
                Some(entries) => Value::Array(vec![Value::Array(vec![
                    Value::BulkString(key.into_bytes()),
                    entries,
                ])]),
                None => Value::Nil,
            }),
            Err(None) => PartRead::ReadAlone,
            Err(Some(what)) => PartRead::Unexpected(what.clone()),
        };
        out.push(PartReply { ack, read });
    }
    Ok(out)
}

/// The per-shard replies of an `ack_shards` call for `n` shards: an error reply is every
/// shard's; a reply of another shape gives each shard nil (an unexpected reply for it).
fn split_acks(reply: Option<Value>, n: usize) -> Vec<Value> {
    match reply {
        Some(Value::Array(replies)) if replies.len() == n => replies,
        Some(error @ Value::ServerError(_)) => vec![error; n],
        _ => vec![Value::Nil; n],
    }
}

/// The entry list of each of `keys` in a multi-stream `XREADGROUP` reply (RESP2
/// `[[key, entries], ...]` or RESP3 `{key: entries}`; streams with nothing new are left out, and
/// a nil reply means nothing was new anywhere). `None` when the reply has another shape.
fn split_by_stream(reply: Value, keys: &[String]) -> Option<Vec<Option<Value>>> {
    let pairs: Vec<(Value, Value)> = match reply {
        Value::Nil => Vec::new(),
        Value::Array(streams) => streams
            .into_iter()
            .map(|pair| match pair {
                Value::Array(pair) => <[Value; 2]>::try_from(pair).ok().map(|[k, e]| (k, e)),
                _ => None,
            })
            .collect::<Option<_>>()?,
        Value::Map(streams) => streams,
        _ => return None,
    };
    let mut shares: Vec<Option<Value>> = keys.iter().map(|_| None).collect();
    for (key, entries) in pairs {
        let Value::BulkString(key) = key else {
            return None;
        };
        let i = keys.iter().position(|k| k.as_bytes() == key.as_slice())?;
        shares[i] = Some(entries);
    }
    Some(shares)
}

/// A pipeline reply (errors kept in place by `ignore_errors`) as a command result.
pub(super) fn into_result(value: Value) -> redis::RedisResult<Value> {
    match value {
        Value::ServerError(error) => Err(error.into()),
        value => Ok(value),
    }
}
