//! One round trip for several shards on a standalone server, in `fencing = "acks"` mode: the
//! fenced acks of each shard's previous batch, then one multi-stream
//! `XREADGROUP GROUP <g> <consumer> COUNT <n> STREAMS <k1> … <kN> > … >`, in one pipeline. This
//! is the strong raw loop of BENCHMARKS.md item 1; the poller's read rounds
//! (`poller::rounds`) decide which shards share a round. On a cluster the shard keys are in
//! different hash slots and cannot share a command: shards read one at a time there.
//!
//! The replies are handed back per shard, unparsed, so that each shard's own
//! [`super::ShardClient`] reads them exactly as it reads its own one-shard pipeline
//! ([`super::ShardClient::ack_reply`], [`super::ShardClient::read_new_reply`]).

use redis::Value;

use crate::connection::RedisConnection;

/// One shard's part of a [`read_round`].
pub(crate) struct RoundPart {
    /// The shard stream key `{<prefix>:<i>}`.
    pub(crate) key: String,
    /// The fenced ack of the shard's previous batch ([`super::ShardClient::ack_cmd`]); `None`
    /// when it has nothing to ack.
    pub(crate) ack: Option<redis::Cmd>,
}

/// What a round returned for one [`RoundPart`].
#[derive(Debug)]
pub(crate) struct PartReply {
    /// The ack's reply; `None` when the part had no ack.
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

/// Sends the acks of `parts` (those that have one) and one multi-stream `XREADGROUP` of up to
/// `count` new entries per shard, for consumer `consumer` of group `group`, as one pipeline.
/// Returns one [`PartReply`] per part, in order. Standalone servers only (one command spans all
/// the keys). Never blocks.
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
) -> redis::RedisResult<Vec<PartReply>> {
    let mut pipe = redis::pipe();
    let mut read = redis::cmd("XREADGROUP");
    read.arg("GROUP")
        .arg(group)
        .arg(consumer)
        .arg("COUNT")
        .arg(count.max(1))
        .arg("STREAMS");
    let mut keys = Vec::with_capacity(parts.len());
    let mut has_ack = Vec::with_capacity(parts.len());
    for part in parts {
        read.arg(&part.key);
        has_ack.push(part.ack.is_some());
        if let Some(ack) = part.ack {
            pipe.add_command(ack);
        }
        keys.push(part.key);
    }
    for _ in &keys {
        read.arg(">");
    }
    pipe.add_command(read).ignore_errors();
    let mut replies: Vec<Value> = pipe.query_async(conn).await?;
    let read_reply = replies.pop();
    let mut acks = replies.into_iter();
    let mut shares = match read_reply {
        Some(Value::ServerError(_)) => Err(None),
        Some(reply) => split_by_stream(reply, &keys).ok_or_else(|| Some("read reply".to_owned())),
        None => Err(Some("no read reply".to_owned())),
    };
    let mut out = Vec::with_capacity(keys.len());
    for (i, key) in keys.into_iter().enumerate() {
        let ack = if has_ack[i] {
            Some(into_result(acks.next().unwrap_or(Value::Nil)))
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
