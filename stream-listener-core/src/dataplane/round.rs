//! One round trip that acks each shard's previous batch and reads the next one, for one shard or
//! for several shards of a member on a standalone server (docs/design.md §8.5–§8.7). One pipeline:
//!
//! 1. `XACK <shard> <group> <ids…>` for each shard with handled ids: plain, unfenced. An ack
//!    names only entries this member handled, and `XACK` is idempotent, so a late ack from a
//!    member that lost the shard cannot lose an entry (docs/design.md §8.2).
//! 2. In [`FencingMode::Strict`](super::FencingMode::Strict), the read is an optimistic
//!    transaction: `WATCH <fences…>`, `EVAL` of [`super::scripts::check_fences`] (compares every
//!    fence with the member's token and, on a refusal, changes a watched key), `MULTI`, the read,
//!    `EXEC`. A refusal, or a fence raised by anyone between the `WATCH` and the `EXEC`, aborts
//!    the `EXEC`: nothing is read. The entries never pass through Lua, so the fence costs Redis
//!    the same per round whatever the batch size.
//! 3. The read: `XREADGROUP GROUP <g> <consumer> COUNT <n> STREAMS <k1> … <kN> > … >`.
//! 4. `WAIT` last, when acks wait for replicas (`min_replica_acks`).
//!
//! On a cluster every round has one shard: its stream and fence share a hash slot, so the whole
//! pipeline goes to that slot's master (redis-rs routes a pipeline by its keyed commands). The
//! commands of one pipeline are written to the connection together, so no other command of this
//! connection runs between the `WATCH` and the `EXEC`; another client's command can, which is
//! what the `WATCH` catches.
//!
//! The replies are handed back per shard ([`PartReply`]), for the shard's own
//! [`super::ShardClient`] to interpret ([`super::ShardClient::round_reply`]). Entries delivered by
//! an `EXEC` are handed to a shard only when the check said `EQUAL` for it: in every other case
//! they stay unhandled in this consumer's PEL, where the shard's fenced pending read or its
//! owner's claim finds them.

use redis::Value;

use super::Fenced;
use super::scripts;
use crate::connection::RedisConnection;
use crate::fence::FenceToken;
use crate::model::{Epoch, Micros};

/// One shard's part of a [`read_round`].
#[derive(Debug)]
pub(crate) struct RoundPart {
    /// The shard stream key `{<prefix>:<i>}`.
    pub(crate) key: String,
    /// Ids this member handled on the shard, acked with a plain `XACK` before the read.
    pub(crate) ack: Vec<String>,
    /// Strict mode: the shard's fence and the member's token, checked in the read's
    /// transaction. `None` in acks mode (the read is not fenced).
    pub(crate) fence: Option<FencePart>,
}

/// The fence check of one shard in a transactional read.
#[derive(Debug)]
pub(crate) struct FencePart {
    /// The fence hash `{<prefix>:<i>}:fence`.
    pub(crate) key: String,
    /// The encoded token ([`FenceToken::encode`]).
    pub(crate) encoded: String,
    /// The token's incarnation, which orders it against a stored one with the member epoch.
    pub(crate) incarnation: Micros,
    /// The token's member epoch.
    pub(crate) epoch: Epoch,
}

impl FencePart {
    /// The check of `fence` (the fence key) against `token`, encoded as `encoded`.
    pub(crate) fn new(key: String, token: &FenceToken, encoded: String) -> Self {
        FencePart {
            key,
            encoded,
            incarnation: token.incarnation,
            epoch: token.member_epoch,
        }
    }
}

/// What a round returned for one [`RoundPart`].
#[derive(Debug)]
pub(crate) struct PartReply {
    /// The `XACK`'s reply (how many of the ids were pending); `None` when the part had no ids.
    pub(crate) ack: Option<redis::RedisResult<Value>>,
    /// The shard's share of the read.
    pub(crate) read: PartRead,
}

/// A shard's share of a round's read.
#[derive(Debug)]
pub(crate) enum PartRead {
    /// Shaped as a one-stream `XREADGROUP` reply: `[[key, entries]]`, or nil when nothing was new.
    /// In strict mode only when the fence check said `EQUAL` for this shard.
    Entries(Value),
    /// The fence refused this shard (strict mode): its entries, if the `EXEC` ran anyway
    /// (`UNFENCED`), stay unhandled in this consumer's PEL.
    Fenced(Fenced),
    /// Nothing was delivered for this shard: the transaction was aborted (another shard's
    /// refusal, or a fence raised meanwhile), or the read failed with an error reply (Redis
    /// checks every stream's group before reading any: one shard's missing group fails it for
    /// all). Read the shard on its own, which reports that shard's own error or refusal.
    ReadAlone,
    /// A reply of an unexpected shape, or entries the fence check did not vouch for: entries may
    /// have been delivered; re-read this consumer's pending entries (a fenced read).
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

/// Sends the plain acks of `parts` and one read of up to `count` new entries per shard, for
/// consumer `consumer` of group `group`, as one pipeline (the module docs give its commands);
/// fenced by a transaction when the parts carry a [`FencePart`] (all of them, as one member's
/// parts do). More than
/// one part: standalone servers only (one command spans all the keys). Never blocks. Returns one
/// [`PartReply`] per part, in order.
///
/// # Errors
/// The [`redis::RedisError`] of the pipeline as a whole (connection lost, response timeout):
/// nothing is known of what ran; each shard acks again and re-reads its own pending entries.
/// Errors of single commands (an ack, a missing group) come back inside the replies.
pub(crate) async fn read_round(
    conn: &mut RedisConnection,
    group: &str,
    consumer: &str,
    count: usize,
    parts: Vec<RoundPart>,
    wait: Option<&crate::replication::AckWaits>,
) -> redis::RedisResult<Vec<PartReply>> {
    // A part without a fence in a fenced round gets no verdict: its share is then unexpected.
    let fenced = parts.iter().any(|p| p.fence.is_some());
    let acked = parts.iter().filter(|p| !p.ack.is_empty()).count();
    let mut pipe = redis::pipe();
    for part in &parts {
        if !part.ack.is_empty() {
            pipe.cmd("XACK").arg(&part.key).arg(group).arg(&part.ack);
        }
    }
    if fenced {
        add_fence_check(&mut pipe, group, &parts);
    }
    let mut read = redis::cmd("XREADGROUP");
    read.arg("GROUP")
        .arg(group)
        .arg(consumer)
        .arg("COUNT")
        .arg(count.max(1))
        .arg("STREAMS");
    for part in &parts {
        read.arg(&part.key);
    }
    for _ in &parts {
        read.arg(">");
    }
    pipe.add_command(read);
    if fenced {
        pipe.cmd("EXEC");
    }
    pipe.ignore_errors();
    // The acks' WAIT last (`min_replica_acks`): it covers the acks before it.
    let turn = wait
        .filter(|_| acked > 0)
        .and_then(crate::replication::AckWaits::begin);
    if let Some(turn) = &turn {
        pipe.add_command(turn.cmd());
    }
    let mut replies: Vec<Value> = pipe.query_async(conn).await?;
    if let Some(turn) = turn {
        let ids = parts.iter().map(|p| p.ack.len()).sum();
        turn.finish(replies.pop().as_ref(), ids);
    }
    let expected = acked + if fenced { 5 } else { 1 };
    if replies.len() != expected {
        return Err(redis::RedisError::from((
            redis::ErrorKind::Parse,
            "read round",
            format!("{} replies, expected {expected}", replies.len()),
        )));
    }
    let mut replies = replies.into_iter();
    let mut acks = Vec::with_capacity(parts.len());
    for part in &parts {
        acks.push((!part.ack.is_empty()).then(|| replies.next().map(into_result)));
    }
    let keys: Vec<String> = parts.into_iter().map(|p| p.key).collect();
    let reads = if fenced {
        let transaction: Vec<Value> = replies.collect();
        match <[Value; 5]>::try_from(transaction) {
            Ok([watch, check, multi, queued, exec]) => {
                if watch == Value::Okay && multi == Value::Okay {
                    fenced_shares(Some(check), Some(exec), &keys)
                } else {
                    // Without the WATCH nothing protects the read, and without the MULTI the
                    // read ran on its own: what it delivered is not vouched for.
                    match queued {
                        Value::ServerError(_) | Value::Nil => {
                            keys.iter().map(|_| PartRead::ReadAlone).collect()
                        }
                        _ => unexpected(&keys, "the transaction did not start"),
                    }
                }
            }
            Err(_) => unexpected(&keys, "transaction replies"),
        }
    } else {
        plain_shares(replies.next(), &keys)
    };
    Ok(acks
        .into_iter()
        .zip(reads)
        .map(|(ack, read)| PartReply {
            ack: ack.flatten(),
            read,
        })
        .collect())
}

/// `WATCH <fences>`, the `EVAL` of the check over them, `MULTI`.
fn add_fence_check(pipe: &mut redis::Pipeline, group: &str, parts: &[RoundPart]) {
    let fences: Vec<&FencePart> = parts.iter().filter_map(|p| p.fence.as_ref()).collect();
    let watch = pipe.cmd("WATCH");
    for fence in &fences {
        watch.arg(&fence.key);
    }
    let check = pipe
        .cmd("EVAL")
        .arg(scripts::check_fences())
        .arg(fences.len());
    for fence in &fences {
        check.arg(&fence.key);
    }
    check.arg(group);
    for fence in &fences {
        check
            .arg(&fence.encoded)
            .arg(fence.incarnation)
            .arg(fence.epoch);
    }
    pipe.cmd("MULTI");
}

/// Each shard's share of a plain (acks mode) read's reply.
fn plain_shares(reply: Option<Value>, keys: &[String]) -> Vec<PartRead> {
    match reply {
        Some(Value::ServerError(_)) => keys.iter().map(|_| PartRead::ReadAlone).collect(),
        Some(reply) => entries_per_key(reply, keys),
        None => unexpected(keys, "no read reply"),
    }
}

/// Each shard's share of a transactional read: the check's verdicts decide which shards may use
/// what the `EXEC` delivered.
fn fenced_shares(check: Option<Value>, exec: Option<Value>, keys: &[String]) -> Vec<PartRead> {
    let verdicts = check.and_then(|check| parse_check(check, keys.len()));
    let delivered = match exec {
        // Aborted (a watched fence changed, or the check tripped it): nothing was read.
        Some(Value::Nil) => None,
        // EXECABORT: a command was refused while queued; nothing ran.
        Some(Value::ServerError(_)) => None,
        Some(Value::Array(mut results)) if results.len() == 1 => match results.remove(0) {
            // The read failed inside the transaction: nothing was delivered.
            Value::ServerError(_) => None,
            read => Some(read),
        },
        other => return unexpected(keys, &format!("EXEC reply {other:?}")),
    };
    let Some(verdicts) = verdicts else {
        // The check did not run as it should (an error reply, such as NOPERM): what the EXEC
        // delivered, if anything, is not vouched for.
        return match delivered {
            None => keys.iter().map(|_| PartRead::ReadAlone).collect(),
            Some(_) => unexpected(keys, "the fence check failed but the read ran"),
        };
    };
    let shares = match delivered {
        None => keys.iter().map(|_| PartRead::ReadAlone).collect(),
        Some(read) => entries_per_key(read, keys),
    };
    shares
        .into_iter()
        .zip(verdicts)
        .map(|(share, verdict)| match verdict {
            Some(fenced) => PartRead::Fenced(fenced),
            None => share,
        })
        .collect()
}

/// The check's verdict per shard: `None` for `EQUAL`, the refusal otherwise; `None` as a whole
/// when the reply is not a well-formed check reply (an error, say).
fn parse_check(reply: Value, n: usize) -> Option<Vec<Option<Fenced>>> {
    let Value::Array(mut items) = reply else {
        return None;
    };
    if items.len() != 2 {
        return None;
    }
    let Value::Array(verdicts) = items.pop()? else {
        return None;
    };
    let status = text(&items[0])?;
    if !matches!(status.as_str(), "OK" | "TRIPPED" | "UNFENCED") || verdicts.len() != n {
        return None;
    }
    verdicts
        .into_iter()
        .map(|verdict| {
            let Value::Array(verdict) = verdict else {
                return None;
            };
            let found = verdict.get(1).and_then(text);
            match text(verdict.first()?)?.as_str() {
                "EQUAL" => Some(None),
                "LOWER" => Some(Some(Fenced::Lower)),
                "HIGHER" => Some(Some(Fenced::Higher {
                    found: found.as_deref().and_then(FenceToken::decode),
                })),
                _ => None,
            }
        })
        .collect()
}

fn text(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(bytes) => String::from_utf8(bytes.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

/// Every shard's share as [`PartRead::Unexpected`] with `what`.
fn unexpected(keys: &[String], what: &str) -> Vec<PartRead> {
    keys.iter()
        .map(|_| PartRead::Unexpected(what.to_owned()))
        .collect()
}

/// Each shard's share of a (multi-stream) `XREADGROUP` reply, shaped as a one-stream reply.
fn entries_per_key(reply: Value, keys: &[String]) -> Vec<PartRead> {
    let Some(mut shares) = split_by_stream(reply, keys) else {
        return unexpected(keys, "read reply");
    };
    keys.iter()
        .zip(shares.iter_mut())
        .map(|(key, share)| {
            PartRead::Entries(match share.take() {
                Some(entries) => Value::Array(vec![Value::Array(vec![
                    Value::BulkString(key.clone().into_bytes()),
                    entries,
                ])]),
                None => Value::Nil,
            })
        })
        .collect()
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
