//! One round trip that acks each shard's previous batch and reads the next one, for one shard or
//! for several shards of a member on a standalone server (docs/design.md §8.5–§8.7). One pipeline:
//!
//! 1. `XACK <shard> <group> <ids…>` for each shard with handled ids: plain, unfenced, outside any
//!    transaction. An ack names only entries this member handled, and `XACK` is idempotent, so a
//!    late ack from a member that lost the shard cannot lose an entry (docs/design.md §8.2).
//! 2. In [`FencingMode::Strict`](super::FencingMode::Strict), the read is a transaction with the
//!    fence check inside it (docs/design.md §8.16): `MULTI`, the `EVAL` of
//!    [`super::scripts::check_fences`] over the round's fences and **gates**, the read, `EXEC`.
//!    Redis runs the check and the read back to back inside the `EXEC`, nothing between them. A
//!    gate ([`crate::keys::StreamKeys::gate`]) is an empty stream with the consumer group, one
//!    per shard and fencing token: when every fence holds the member's token the check makes
//!    sure the round's gates exist (the shards' strict waits name them, docs/design.md §8.4); on
//!    any refusal it deletes them, and the read, which names the first one, then fails as a
//!    whole with `NOGROUP` before it looks at any stream. A command refused while queued (`BUSY` during another
//!    client's long script, `NOPERM`, `OOM`) makes the `EXEC` answer `EXECABORT`, and an `EXEC`
//!    refused for `BUSY` aborts too: whenever the check did not run, the read did not either. The
//!    entries never pass through Lua, so the fence costs Redis the same per round whatever the
//!    batch size.
//! 3. The read: `XREADGROUP GROUP <g> <consumer> COUNT <n> STREAMS <k1> … <kN> [<gate>] > … >`.
//! 4. `WAIT` last, when acks wait for replicas (`min_replica_acks`).
//!
//! **Through the gates.** A gate exists only while its shard's fence holds its token, so a read
//! that names every shard's gate is fenced by the gates alone, as the strict wait is
//! (docs/design.md §8.4). Once a shard's last read under its token was vouched for (the check
//! passed, or the gates answered), its part says so ([`FencePart::gate_open`]), and a round whose
//! every part says so is a plain `XREADGROUP GROUP <g> <consumer> COUNT <n> STREAMS <k1> … <kN>
//! <gate 1> … <gate N> > … >`: no transaction, no script, the cost of an unfenced read. When it
//! fails (a gate closed by a raise, a group missing, `BUSY`), Redis read nothing, and the round
//! sends the transaction above at once, which opens the gates again or gives each shard its
//! verdict.
//!
//! A checked round spanning several shards (standalone servers only) names the gate of its first
//! shard (the check vouches for the others); a round through the gates names every shard's. On a
//! cluster every round has one shard: its stream, fence and gate share a hash slot, so the whole
//! pipeline goes to that slot's master (redis-rs routes a pipeline by its keyed commands).
//!
//! The replies are handed back per shard ([`PartReply`]), for the shard's own
//! [`super::ShardClient`] to interpret ([`super::ShardClient::round_reply`]). Entries delivered by
//! an `EXEC` are handed to a shard only when the check said `OK` (every fence `EQUAL`): in every
//! other case nothing was read, or what was read stays unhandled in this consumer's PEL, where the
//! shard's fenced pending read finds it.

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
    /// The shard's read gate for the token, `{<prefix>:<i>}:gate:<group>:<token>`
    /// ([`crate::keys::StreamKeys::gate`]): the check opens every shard's (for its wait and the
    /// reads through the gates), and its read names the first shard's; a read through the gates
    /// names every shard's.
    pub(crate) gate: String,
    /// The shard's gate registry `{<prefix>:<i>}:gates`
    /// ([`crate::keys::StreamKeys::gate_registry`]).
    pub(crate) registry: String,
    /// The encoded token ([`FenceToken::encode`]).
    pub(crate) encoded: String,
    /// The token's incarnation, which orders it against a stored one with the member epoch.
    pub(crate) incarnation: Micros,
    /// The token's member epoch.
    pub(crate) epoch: Epoch,
    /// The shard's last read under this token was vouched for (its check passed, or it read
    /// through its gate): the gate is believed open, and a round of such parts reads through the
    /// gates without the check. A wrong belief costs a round trip, never a fence: Redis fails a
    /// read that names a missing gate.
    pub(crate) gate_open: bool,
}

impl FencePart {
    /// The check of fence key `key` against `token`, encoded as `encoded`, with the shard's read
    /// gate `gate` for that token and its gate registry `registry`; `gate_open`: see
    /// [`FencePart::gate_open`].
    pub(crate) fn new(
        key: String,
        gate: String,
        registry: String,
        token: &FenceToken,
        encoded: String,
        gate_open: bool,
    ) -> Self {
        FencePart {
            key,
            gate,
            registry,
            encoded,
            incarnation: token.incarnation,
            epoch: token.member_epoch,
            gate_open,
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
    /// In strict mode only when the fence check said `OK` for the round, or the read named every
    /// shard's gate.
    Entries(Value),
    /// The fence refused this shard (strict mode): the check deleted the gate, and the read
    /// failed with `NOGROUP` before it read anything.
    Fenced(Fenced),
    /// Nothing was delivered for this shard: the transaction was aborted (`EXECABORT`: a command
    /// refused while queued, such as `BUSY`), another shard of the round was refused, or the read
    /// failed with an error reply (Redis checks every stream's group before reading any: one
    /// shard's missing group fails it for all). Read the shard on its own, which reports that
    /// shard's own error or refusal.
    ReadAlone,
    /// Every fence held the member's token, but the read's gate was missing and the check could
    /// not create it (`XGROUP CREATE … MKSTREAM` refused, at `maxmemory`: Redis's error in
    /// `detail`), so the read failed and nothing was read: fail closed until Redis accepts the
    /// write.
    GateUnavailable {
        /// The gate key.
        gate: String,
        /// Redis's error.
        detail: String,
    },
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

/// How a round reads.
enum ReadKind {
    /// Acks mode: a plain `XREADGROUP`.
    Plain,
    /// Strict, every gate believed open: a plain `XREADGROUP` naming every part's gate.
    ThroughGates(Vec<String>),
    /// Strict: the transaction with the check, reading through the first part's gate.
    Checked(String),
}

impl ReadKind {
    fn of(parts: &[RoundPart]) -> Self {
        let fences: Vec<&FencePart> = parts.iter().filter_map(|p| p.fence.as_ref()).collect();
        match fences.first() {
            None => ReadKind::Plain,
            // A part without a fence in a fenced round gets no verdict: its share is then
            // unexpected (the transaction's reply decides).
            Some(_) if fences.len() == parts.len() && fences.iter().all(|f| f.gate_open) => {
                ReadKind::ThroughGates(fences.iter().map(|f| f.gate.clone()).collect())
            }
            Some(first) => ReadKind::Checked(first.gate.clone()),
        }
    }

    /// How many replies the read has in the pipeline.
    fn replies(&self) -> usize {
        match self {
            ReadKind::Checked(_) => 4,
            ReadKind::Plain | ReadKind::ThroughGates(_) => 1,
        }
    }
}

/// Sends the plain acks of `parts` and one read of up to `count` new entries per shard, for
/// consumer `consumer` of group `group`, as one pipeline (the module docs give its commands);
/// fenced when the parts carry a [`FencePart`] (all of them, as one member's parts do): through
/// the gates when every part believes its gate open, else by the transaction with the check, which
/// also follows a read through the gates that failed. More than one part: standalone servers
/// only (one command spans all the keys). Never blocks. Returns one [`PartReply`] per part, in
/// order.
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
    let kind = ReadKind::of(&parts);
    let acked = parts.iter().filter(|p| !p.ack.is_empty()).count();
    let mut pipe = redis::pipe();
    for part in &parts {
        if !part.ack.is_empty() {
            pipe.cmd("XACK").arg(&part.key).arg(group).arg(&part.ack);
        }
    }
    match &kind {
        ReadKind::Plain => {
            _ = pipe.add_command(read_cmd(group, consumer, count, &parts, &[] as &[&str]))
        }
        ReadKind::ThroughGates(gates) => {
            _ = pipe.add_command(read_cmd(group, consumer, count, &parts, gates));
        }
        ReadKind::Checked(gate) => add_strict_read(&mut pipe, group, consumer, count, &parts, gate),
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
    let expected = acked + kind.replies();
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
    let keys: Vec<String> = parts.iter().map(|p| p.key.clone()).collect();
    let reads = match kind {
        ReadKind::Plain => plain_shares(replies.next(), &keys),
        ReadKind::Checked(gate) => strict_shares(replies.collect(), &keys, &gate),
        ReadKind::ThroughGates(gates) => match replies.next() {
            // A gate closed (or a group missing, or BUSY): nothing was read. The check decides.
            Some(Value::ServerError(_)) => {
                checked_read(conn, group, consumer, count, &parts, &keys, &gates[0]).await?
            }
            Some(reply) => entries_per_key(reply, &keys, &gates),
            None => unexpected(&keys, "no read reply"),
        },
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

/// The transaction with the check alone (no acks), reading through `gate` (the first part's):
/// after a read through the gates failed.
async fn checked_read(
    conn: &mut RedisConnection,
    group: &str,
    consumer: &str,
    count: usize,
    parts: &[RoundPart],
    keys: &[String],
    gate: &str,
) -> redis::RedisResult<Vec<PartRead>> {
    let mut pipe = redis::pipe();
    add_strict_read(&mut pipe, group, consumer, count, parts, gate);
    pipe.ignore_errors();
    let replies: Vec<Value> = pipe.query_async(conn).await?;
    Ok(strict_shares(replies, keys, gate))
}

/// The strict read (docs/design.md §8.16): `MULTI`, the `EVAL` of the check over the fences of
/// `parts` and `gate`, the read of every part's shard and of the gate, `EXEC`.
fn add_strict_read(
    pipe: &mut redis::Pipeline,
    group: &str,
    consumer: &str,
    count: usize,
    parts: &[RoundPart],
    gate: &str,
) {
    let fences: Vec<&FencePart> = parts.iter().filter_map(|p| p.fence.as_ref()).collect();
    pipe.cmd("MULTI");
    let check = pipe
        .cmd("EVAL")
        .arg(scripts::check_fences())
        .arg(fences.len() * 3);
    for fence in &fences {
        check.arg(&fence.key);
    }
    for fence in &fences {
        check.arg(&fence.gate);
    }
    for fence in &fences {
        check.arg(&fence.registry);
    }
    check.arg(group);
    for fence in &fences {
        check
            .arg(&fence.encoded)
            .arg(fence.incarnation)
            .arg(fence.epoch);
    }
    pipe.add_command(read_cmd(group, consumer, count, parts, &[gate]));
    pipe.cmd("EXEC");
}

/// `XREADGROUP GROUP <group> <consumer> COUNT <count> STREAMS <shards…> <gates…> > … >`.
fn read_cmd(
    group: &str,
    consumer: &str,
    count: usize,
    parts: &[RoundPart],
    gates: &[impl AsRef<str>],
) -> redis::Cmd {
    let mut read = redis::cmd("XREADGROUP");
    read.arg("GROUP")
        .arg(group)
        .arg(consumer)
        .arg("COUNT")
        .arg(count.max(1))
        .arg("STREAMS");
    for part in parts {
        read.arg(&part.key);
    }
    for gate in gates {
        read.arg(gate.as_ref());
    }
    for _ in 0..parts.len() + gates.len() {
        read.arg(">");
    }
    read
}

/// The commands of the strict read of `parts` through the first part's gate, in the order the
/// round sends them (no acks, no `WAIT`): for tests that deliver them to Redis in pieces.
#[cfg(test)]
pub(crate) fn strict_read_commands(
    group: &str,
    consumer: &str,
    count: usize,
    parts: &[RoundPart],
) -> Vec<redis::Cmd> {
    let gate = parts
        .iter()
        .find_map(|p| p.fence.as_ref())
        .map(|f| f.gate.clone())
        .unwrap_or_default();
    let mut pipe = redis::pipe();
    add_strict_read(&mut pipe, group, consumer, count, parts, &gate);
    pipe.cmd_iter().cloned().collect()
}

/// Each shard's share of a plain (acks mode) read's reply.
fn plain_shares(reply: Option<Value>, keys: &[String]) -> Vec<PartRead> {
    match reply {
        Some(Value::ServerError(_)) => keys.iter().map(|_| PartRead::ReadAlone).collect(),
        Some(reply) => entries_per_key(reply, keys, &[] as &[&str]),
        None => unexpected(keys, "no read reply"),
    }
}

/// Each shard's share of a strict read's replies: `MULTI`, the check's and the read's replies
/// to being queued, `EXEC`.
fn strict_shares(transaction: Vec<Value>, keys: &[String], gate: &str) -> Vec<PartRead> {
    let Ok([multi, _check_queued, read_queued, exec]) = <[Value; 4]>::try_from(transaction) else {
        return unexpected(keys, "transaction replies");
    };
    if multi == Value::Okay {
        return exec_shares(exec, keys, gate);
    }
    // No transaction (MULTI refused, as for a user without +multi): the check and the read ran
    // on their own, and what the read delivered is not vouched for. A refusing check deleted
    // the gate first, so the read failed.
    match read_queued {
        Value::ServerError(_) | Value::Nil => keys.iter().map(|_| PartRead::ReadAlone).collect(),
        _ => unexpected(keys, "the transaction did not start"),
    }
}

/// Each shard's share of what a strict read's `EXEC` answered: the check's verdicts decide which
/// shards may use what the read delivered.
pub(crate) fn exec_shares(exec: Value, keys: &[String], gate: &str) -> Vec<PartRead> {
    let (check, read) = match exec {
        // EXECABORT (a command refused while queued, or the EXEC refused for BUSY): nothing ran.
        // Nil is what an EXEC aborted by a WATCH answers (the round watches nothing): nor then.
        Value::ServerError(_) | Value::Nil => {
            return keys.iter().map(|_| PartRead::ReadAlone).collect();
        }
        Value::Array(results) => match <[Value; 2]>::try_from(results) {
            Ok([check, read]) => (check, read),
            Err(results) => return unexpected(keys, &format!("EXEC reply {results:?}")),
        },
        other => return unexpected(keys, &format!("EXEC reply {other:?}")),
    };
    let delivered = match read {
        // The read failed (NOGROUP: the gate closed by a refusal, or a shard's group missing):
        // nothing was delivered.
        Value::ServerError(_) => None,
        read => Some(read),
    };
    let Some(check) = parse_check(check, keys.len()) else {
        // The check did not run as written (an error reply, such as NOPERM after an ACL change
        // between the queueing and the EXEC): what the read delivered is not vouched for.
        return match delivered {
            None => keys.iter().map(|_| PartRead::ReadAlone).collect(),
            Some(_) => unexpected(keys, "the fence check failed but the read ran"),
        };
    };
    match (check, delivered) {
        (Checked::Open, Some(read)) => entries_per_key(read, keys, &[gate]),
        (Checked::Open, None) => keys.iter().map(|_| PartRead::ReadAlone).collect(),
        (Checked::NoGate(detail), None) => keys
            .iter()
            .map(|_| PartRead::GateUnavailable {
                gate: gate.to_owned(),
                detail: detail.clone(),
            })
            .collect(),
        (Checked::Refused(verdicts), delivered) => verdicts
            .into_iter()
            .map(|verdict| match (verdict, &delivered) {
                (Some(fenced), _) => PartRead::Fenced(fenced),
                (None, None) => PartRead::ReadAlone,
                (None, Some(_)) => {
                    PartRead::Unexpected("the fence check refused but the read ran".to_owned())
                }
            })
            .collect(),
        (Checked::NoGate(_), Some(_)) => unexpected(keys, "the gate was missing but the read ran"),
    }
}

/// What the check answered, once parsed.
enum Checked {
    /// `OK`: every fence holds the member's token and the gate is open.
    Open,
    /// `REFUSED`: at least one fence refused (the shard's verdict; `None` for `EQUAL`), and the
    /// gate was deleted.
    Refused(Vec<Option<Fenced>>),
    /// `NOGATE`: every fence holds the token, but the missing gate could not be created (Redis's
    /// error).
    NoGate(String),
}

/// The check's reply (`{status, verdicts[, error]}`, [`scripts::check_fences`]); `None` when it
/// is not a well-formed check reply (an error, say) or does not have `n` verdicts.
fn parse_check(reply: Value, n: usize) -> Option<Checked> {
    let Value::Array(items) = reply else {
        return None;
    };
    let mut items = items.into_iter();
    let status = text(&items.next()?)?;
    let Value::Array(verdicts) = items.next()? else {
        return None;
    };
    if verdicts.len() != n {
        return None;
    }
    let verdicts = verdicts
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
        .collect::<Option<Vec<Option<Fenced>>>>()?;
    let every_equal = verdicts.iter().all(Option::is_none);
    match status.as_str() {
        "OK" if every_equal => Some(Checked::Open),
        "REFUSED" if !every_equal => Some(Checked::Refused(verdicts)),
        "NOGATE" if every_equal => Some(Checked::NoGate(text(&items.next()?)?)),
        _ => None,
    }
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
/// `gates`: the read's gates, whose shares (always empty: nothing writes to them) are left out.
fn entries_per_key(reply: Value, keys: &[String], gates: &[impl AsRef<str>]) -> Vec<PartRead> {
    let Some(mut shares) = split_by_stream(reply, keys, gates) else {
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
/// a nil reply means nothing was new anywhere). `None` when the reply has another shape. The
/// shares of `gates` are dropped.
fn split_by_stream(
    reply: Value,
    keys: &[String],
    gates: &[impl AsRef<str>],
) -> Option<Vec<Option<Value>>> {
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
        if gates
            .iter()
            .any(|gate| gate.as_ref().as_bytes() == key.as_slice())
        {
            continue;
        }
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
