//! [`ShardClient`]: the fenced operations on one group's shards (docs/design.md §8).

use std::sync::Arc;

use redis::{Script, Value};

use super::error::DataPlaneError;
use super::round::{AckPart, into_result};
use super::scripts;
use super::{
    ClaimReport, DeadLetterReason, EntryStatus, Fenced, FencingMode, ReadOutcome, ShardEntry,
};
use crate::connection::{RedisConnection, RedisFailure};
use crate::fence::FenceToken;
use crate::keys::{NameError, StreamKeys};
use crate::model::ShardIndex;

/// The most ids one [`ShardClient::claim_others`] call requests (larger batches are clamped), so
/// that one script call stays short: Redis runs nothing else while a script runs.
pub const MAX_CLAIM_BATCH: usize = 1000;

/// What [`ShardClient::recreate_group`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GroupRecreated {
    /// The consumer group was created from `0`; `stream_created` when the stream was too.
    Created {
        /// Whether the shard stream was created with it (`MKSTREAM`).
        stream_created: bool,
    },
    /// The group exists already (`BUSYGROUP`): created meanwhile.
    Exists,
    /// The stream is missing and was not to be created.
    StreamMissing,
}

/// The fenced operations of one member (Redis consumer) of one consumer group on the shards of one
/// stream. Every method is one round trip: one script on the shard's slot, or one `XADD` for
/// [`ShardClient::dead_letter`]. Cheap to clone (clones share the multiplexed connection); never
/// use it for blocking commands (that is [`super::Waiter`]'s job).
#[derive(Debug, Clone)]
pub struct ShardClient {
    conn: RedisConnection,
    keys: StreamKeys,
    group: String,
    consumer: String,
    dead_letters: String,
    max_entry_bytes: u64,
    /// The last token used and its encoding (`FenceToken::encode`), reused while it holds.
    encoded_token: Option<(FenceToken, String)>,
}

/// An `EVALSHA` ready to send, with the script it runs (loaded again on `NOSCRIPT`).
struct ScriptCall {
    script: &'static Script,
    cmd: redis::Cmd,
}

/// A script reply once the fence and a missing group are handled.
enum Reply {
    /// The script did its work: its status (`EQUAL`, `OK`, `EMPTY`) and the rest of the reply.
    Done(String, Vec<Value>),
    /// The fence refused the operation.
    Refused(Fenced),
}

impl ShardClient {
    /// A client for consumer group `group` of the stream `keys`, acting as Redis consumer
    /// `consumer` (the member id, docs/design.md §7). Entries of any size are returned in full
    /// until [`ShardClient::with_max_entry_bytes`] sets a limit.
    ///
    /// # Errors
    /// [`NameError`] when the group name is not valid ([`crate::keys::validate_group_name`]).
    pub fn new(
        conn: RedisConnection,
        keys: StreamKeys,
        group: &str,
        consumer: &str,
    ) -> Result<Self, NameError> {
        let group_keys = keys.group(group)?;
        let dead_letters = keys.dead_letters(&group_keys);
        Ok(ShardClient {
            conn,
            keys,
            group: group.to_owned(),
            consumer: consumer.to_owned(),
            dead_letters,
            max_entry_bytes: 0,
            encoded_token: None,
        })
    }

    /// Withholds bodies larger than `limit` bytes (field names plus values) from reads: such
    /// entries come back as [`EntryStatus::TooLarge`] with no fields, so a huge entry never
    /// reaches this process (a huge entry). `None`: no limit.
    pub fn with_max_entry_bytes(mut self, limit: Option<usize>) -> Self {
        self.max_entry_bytes = limit.map_or(0, |l| l.max(1) as u64);
        self
    }

    /// Sends every later command over `conn` (the data plane's connection,
    /// [`RedisConnection::for_data_plane`]).
    pub(crate) fn set_connection(&mut self, conn: RedisConnection) {
        self.conn = conn;
    }

    /// The consumer group.
    pub fn group(&self) -> &str {
        &self.group
    }

    /// The Redis consumer name (the member id).
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// The stream's keys.
    pub fn keys(&self) -> &StreamKeys {
        &self.keys
    }

    /// The dead-letter stream `<prefix>:dlq:<group>`.
    pub fn dead_letter_key(&self) -> &str {
        &self.dead_letters
    }

    /// Raises shard `shard`'s fence to `token` (docs/design.md §8): accepted when the fence field
    /// is empty, holds a strictly lower `(incarnation, memberEpoch)`, or holds `token` itself.
    /// Call it before the first read of a newly assigned shard, and again after any
    /// [`Fenced::Lower`].
    ///
    /// Returns `Ok(())` (`EQUAL`: the fence holds `token` now) or `Err(Fenced::Higher { found })`:
    /// the fence holds a token at or above ours that is not ours (same pair, other member
    /// included) and was left unchanged. Never `Fenced::Lower`.
    ///
    /// # Errors
    /// [`DataPlaneError::NoGroup`] when the shard stream does not exist (nothing is written: a
    /// retired shard's fence never comes back); [`DataPlaneError::Redis`] when Redis fails (the
    /// raise may or may not have happened: raise again, it is idempotent).
    pub async fn raise_fence(
        &mut self,
        shard: ShardIndex,
        token: &FenceToken,
    ) -> Result<Result<(), Fenced>, DataPlaneError> {
        const OP: &str = "raise_fence";
        let call = self.script_call(scripts::raise(), shard, token);
        let reply = self.run(OP, shard, call).await?;
        match reply {
            Reply::Refused(fenced) => Ok(Err(fenced)),
            Reply::Done(status, _) if status == "EQUAL" => Ok(Ok(())),
            Reply::Done(status, _) => Err(DataPlaneError::unexpected(
                OP,
                Some(shard),
                format!("status {status:?}"),
            )),
        }
    }

    /// Moves up to `batch` (1..=[`MAX_CLAIM_BATCH`]) pending entries of *other* consumers of the
    /// group on `shard` to this consumer, without changing their delivery counts (`XPENDING` by
    /// consumer, then `XCLAIM <me> 0 <ids> JUSTID`). Idle time 0 is safe only because the previous
    /// holder released the shard or its lease ran out: call it at takeover, after
    /// [`ShardClient::raise_fence`], and repeat until [`ClaimReport::complete`]. Ids whose entry
    /// was trimmed or deleted leave the PEL and are counted in [`ClaimReport::trimmed`]; their
    /// handler-attempt counts ([`ShardClient::count_attempt`]) are removed with them.
    /// Always fenced, whatever the [`FencingMode`].
    ///
    /// # Errors
    /// [`DataPlaneError::NoGroup`] when the stream or group is missing; [`DataPlaneError::Redis`]
    /// when Redis fails (a claim that did happen is harmless to repeat).
    pub async fn claim_others(
        &mut self,
        shard: ShardIndex,
        token: &FenceToken,
        batch: usize,
    ) -> Result<Result<ClaimReport, Fenced>, DataPlaneError> {
        const OP: &str = "claim_others";
        let batch = batch.clamp(1, MAX_CLAIM_BATCH);
        let script = scripts::claim_others();
        let mut cmd = redis::cmd("EVALSHA");
        // A third key, the attempt hash: the counts of ids dropped as trimmed go with them.
        cmd.arg(script.get_hash())
            .arg(3)
            .arg(self.keys.shard(shard))
            .arg(self.keys.fence(shard))
            .arg(self.keys.attempts(shard))
            .arg(&self.group);
        cmd.arg(self.encoded(token));
        cmd.arg(token.incarnation).arg(token.member_epoch);
        cmd.arg(&self.consumer).arg(batch);
        let call = ScriptCall { script, cmd };
        let reply = self.run(OP, shard, call).await?;
        let rest = match reply {
            Reply::Refused(fenced) => return Ok(Err(fenced)),
            Reply::Done(status, rest) if status == "OK" && rest.len() == 3 => rest,
            Reply::Done(status, rest) => {
                return Err(DataPlaneError::unexpected(
                    OP,
                    Some(shard),
                    format!("status {status:?} with {} values", rest.len()),
                ));
            }
        };
        let number = |v: &Value| {
            int(v)
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| DataPlaneError::unexpected(OP, Some(shard), format!("{v:?}")))
        };
        Ok(Ok(ClaimReport {
            claimed: number(&rest[0])?,
            trimmed: number(&rest[1])?,
            complete: number(&rest[2])? == 0,
        }))
    }

    /// Reads up to `count` (at least 1) of this consumer's own pending entries on `shard` with ids
    /// strictly after `after_id` (`"0"` to start; then the id of the last entry returned), with
    /// their delivery counts — this read included: each read of an entry that still exists adds
    /// one (`XREADGROUP ... STREAMS <shard> <after_id>`, then `XPENDING` over the same range).
    /// Entries trimmed or deleted while pending come back as [`EntryStatus::Trimmed`] (their count
    /// is not increased). An empty [`ReadOutcome::Entries`] means nothing is pending after
    /// `after_id`; this method never returns [`ReadOutcome::Empty`].
    ///
    /// In [`FencingMode::Strict`] the fence is checked first ([`ReadOutcome::Fenced`]: nothing
    /// read); in [`FencingMode::Acks`] it is not, and `token` is unused.
    ///
    /// # Errors
    /// [`DataPlaneError::NoGroup`] when the stream or group is missing (Redis lost its data);
    /// [`DataPlaneError::Redis`] when Redis fails.
    pub async fn read_pending(
        &mut self,
        shard: ShardIndex,
        token: &FenceToken,
        after_id: &str,
        count: usize,
        mode: FencingMode,
    ) -> Result<ReadOutcome, DataPlaneError> {
        const OP: &str = "read_pending";
        let mut call = self.script_call(scripts::read_pending(), shard, token);
        call.cmd
            .arg(fenced_flag(mode))
            .arg(&self.consumer)
            .arg(count.max(1))
            .arg(after_id)
            .arg(self.max_entry_bytes);
        let reply = self.run(OP, shard, call).await?;
        match reply {
            Reply::Refused(fenced) => Ok(ReadOutcome::Fenced(fenced)),
            Reply::Done(status, mut rest) if status == "OK" && rest.len() == 1 => Ok(
                ReadOutcome::Entries(parse_entries(OP, shard, rest.remove(0), true)?),
            ),
            Reply::Done(status, rest) => Err(DataPlaneError::unexpected(
                OP,
                Some(shard),
                format!("status {status:?} with {} values", rest.len()),
            )),
        }
    }

    /// Reads up to `count` (at least 1) new entries on `shard` for the group
    /// (`XREADGROUP ... STREAMS <shard> >`, never blocking); they enter this consumer's PEL with
    /// delivery count 1. When nothing is new, returns [`ReadOutcome::Empty`] with the id of the
    /// stream's last entry (`"0-0"` when it has none): wait with [`super::Waiter::wait`] from it,
    /// then read again (an entry added between the two calls wakes the wait at once).
    ///
    /// In [`FencingMode::Strict`] the read is a script that checks the fence first
    /// ([`ReadOutcome::Fenced`]: nothing read). In [`FencingMode::Acks`] it is a plain
    /// `XREADGROUP` (no fence, `token` unused): a script costs Redis about 1.5 times the read
    /// itself to convert the entries to Lua and back (BENCHMARKS.md, item 1). Only when that
    /// finds nothing does the script run, to return the last id atomically with an empty read.
    /// The body limit ([`ShardClient::with_max_entry_bytes`]) then applies after the read: a
    /// too-large entry still comes back as [`EntryStatus::TooLarge`] without its fields, but its
    /// body has passed through this process once.
    ///
    /// # Errors
    /// [`DataPlaneError::NoGroup`] when the stream or group is missing (Redis lost its data);
    /// [`DataPlaneError::Redis`] when Redis fails (entries may have been delivered: they are in
    /// this consumer's PEL and come back from [`ShardClient::read_pending`]).
    pub async fn read_new(
        &mut self,
        shard: ShardIndex,
        token: &FenceToken,
        count: usize,
        mode: FencingMode,
    ) -> Result<ReadOutcome, DataPlaneError> {
        match mode {
            FencingMode::Acks => {
                let reply = self
                    .plain_read_cmd(shard, count)
                    .query_async(&mut self.conn)
                    .await;
                self.read_new_reply(shard, token, count, reply).await
            }
            FencingMode::Strict => self.read_new_script(shard, token, count, mode).await,
        }
    }

    /// What a plain `XREADGROUP ... STREAMS <shard> >` (acks mode) returned, as
    /// [`ShardClient::read_new`] reports it; when nothing was new, the read script runs for the
    /// last id to wait from (atomically with an empty read). For a read sent in a pipeline or a
    /// read round ([`super::round`]).
    ///
    /// # Errors
    /// As [`ShardClient::read_new`].
    pub(crate) async fn read_new_reply(
        &mut self,
        shard: ShardIndex,
        token: &FenceToken,
        count: usize,
        reply: redis::RedisResult<Value>,
    ) -> Result<ReadOutcome, DataPlaneError> {
        let entries = self.plain_read_reply(shard, reply)?;
        if entries.is_empty() {
            self.read_new_script(shard, token, count, FencingMode::Acks)
                .await
        } else {
            Ok(ReadOutcome::Entries(entries))
        }
    }

    /// The read script of [`ShardClient::read_new`]: the fence check in strict mode, and an
    /// `EMPTY` reply with the last id when nothing is new.
    async fn read_new_script(
        &mut self,
        shard: ShardIndex,
        token: &FenceToken,
        count: usize,
        mode: FencingMode,
    ) -> Result<ReadOutcome, DataPlaneError> {
        let call = self.read_script_call(shard, token, count, mode);
        let reply = self.run(READ_NEW, shard, call).await?;
        read_new_outcome(shard, reply)
    }

    /// [`ShardClient::ack`] of `ids` and [`ShardClient::read_new`] in one round trip: one
    /// pipeline, the ack first. Returns both results; when the ack is refused by the fence, what
    /// the read returned is still returned (in strict mode the same fence refused it too; in
    /// acks mode those entries are in this consumer's pending list: drop them, the shard's next
    /// owner claims them). With no ids it is [`ShardClient::read_new`] alone.
    ///
    /// # Errors
    /// As [`ShardClient::ack`] and [`ShardClient::read_new`]; an error of either fails the
    /// whole call (acking again and reading own pending entries from `"0"` recovers).
    pub async fn ack_and_read_new(
        &mut self,
        shard: ShardIndex,
        token: &FenceToken,
        ids: &[String],
        count: usize,
        mode: FencingMode,
    ) -> Result<(Result<usize, Fenced>, ReadOutcome), DataPlaneError> {
        if ids.is_empty() {
            return Ok((Ok(0), self.read_new(shard, token, count, mode).await?));
        }
        let ack = self.ack_call(shard, token, ids).cmd;
        let read = match mode {
            FencingMode::Acks => self.plain_read_cmd(shard, count),
            FencingMode::Strict => self.read_script_call(shard, token, count, mode).cmd,
        };
        let mut pipe = redis::pipe();
        pipe.add_command(ack).add_command(read).ignore_errors();
        let replies: Vec<Value> = pipe
            .query_async(&mut self.conn)
            .await
            .map_err(DataPlaneError::redis("ack_and_read_new", Some(shard)))?;
        let Ok([ack_reply, read_reply]) = <[Value; 2]>::try_from(replies) else {
            return Err(DataPlaneError::unexpected(
                "ack_and_read_new",
                Some(shard),
                "not two replies",
            ));
        };
        let acked = self
            .ack_reply(shard, token, ids, into_result(ack_reply))
            .await?;
        let read = match (mode, into_result(read_reply)) {
            (FencingMode::Acks, reply) => self.read_new_reply(shard, token, count, reply).await?,
            (FencingMode::Strict, Err(error)) if is_noscript(&error) => {
                self.read_new_script(shard, token, count, mode).await?
            }
            (FencingMode::Strict, reply) => {
                read_new_outcome(shard, self.classify(READ_NEW, shard, reply)?)?
            }
        };
        Ok((acked, read))
    }

    fn read_script_call(
        &mut self,
        shard: ShardIndex,
        token: &FenceToken,
        count: usize,
        mode: FencingMode,
    ) -> ScriptCall {
        let mut call = self.script_call(scripts::read_new(), shard, token);
        call.cmd
            .arg(fenced_flag(mode))
            .arg(&self.consumer)
            .arg(count.max(1))
            .arg(self.max_entry_bytes);
        call
    }

    /// `XREADGROUP ... COUNT <count> STREAMS <shard> >`, without a script (acks mode).
    fn plain_read_cmd(&self, shard: ShardIndex, count: usize) -> redis::Cmd {
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP")
            .arg(&self.group)
            .arg(&self.consumer)
            .arg("COUNT")
            .arg(count.max(1))
            .arg("STREAMS")
            .arg(self.keys.shard(shard))
            .arg(">");
        cmd
    }

    /// The entries of a plain read, bodies over the limit withheld; empty when nothing is new.
    fn plain_read_reply(
        &self,
        shard: ShardIndex,
        reply: redis::RedisResult<Value>,
    ) -> Result<Vec<ShardEntry>, DataPlaneError> {
        let reply = reply.map_err(|source| match RedisFailure::of(&source) {
            RedisFailure::NoGroup => self.no_group(
                shard,
                format!("NOGROUP {}", source.detail().unwrap_or_default()),
            ),
            _ => DataPlaneError::Redis {
                op: READ_NEW,
                shard: Some(shard),
                source,
            },
        })?;
        let Some(list) = single_stream_entries(reply) else {
            return Ok(Vec::new());
        };
        let mut entries = parse_entries(READ_NEW, shard, list, false)?;
        if self.max_entry_bytes > 0 {
            for entry in &mut entries {
                withhold_if_larger(entry, self.max_entry_bytes);
            }
        }
        Ok(entries)
    }

    /// Acknowledges `ids` on `shard` (`XACK`), always fenced, whatever the [`FencingMode`].
    /// Returns how many of them were pending in the group (ids acked before, or never delivered,
    /// count 0). With no ids only the fence is checked. Ack trimmed entries like any other.
    ///
    /// # Errors
    /// [`DataPlaneError::Redis`] when Redis fails (acking again is harmless). A missing group is
    /// not an error here: nothing is pending, the result is 0 (a missing fence answers
    /// [`Fenced::Lower`] first).
    pub async fn ack(
        &mut self,
        shard: ShardIndex,
        token: &FenceToken,
        ids: &[String],
    ) -> Result<Result<usize, Fenced>, DataPlaneError> {
        let call = self.ack_call(shard, token, ids);
        let reply = self.run(ACK, shard, call).await?;
        ack_outcome(shard, reply)
    }

    /// The fenced ack of `ids` on `shard` as one shard's part of a read round's multi-shard ack
    /// ([`super::round`]): its fence key and its arguments. Read the part's reply with
    /// [`ShardClient::ack_reply`].
    pub(crate) fn ack_part(
        &mut self,
        shard: ShardIndex,
        token: &FenceToken,
        ids: &[String],
    ) -> AckPart {
        let mut args = redis::Cmd::new();
        args.arg(self.encoded(token))
            .arg(token.incarnation)
            .arg(token.member_epoch)
            .arg(ids.len());
        for id in ids {
            args.arg(id);
        }
        AckPart {
            fence: self.keys.fence(shard),
            args,
        }
    }

    /// The listener's acks-mode read round as one raw call, for the benchmarks' diagnostic
    /// loops (`testing` feature): one pipeline with one `ack_shards` script call acking each
    /// `(shard, token, ids)` part fenced with its own token, and one multi-stream `XREADGROUP`
    /// of up to `count` new entries per shard, as this client's consumer. Standalone servers
    /// only. Returns, per part in order, its ack reply (`None` without ids) and its read reply
    /// shaped as a one-stream `XREADGROUP` reply (`[[key, entries]]`, nil when nothing was new).
    ///
    /// # Errors
    /// The pipeline's [`redis::RedisError`] (connection lost, timeout), or a read reply of an
    /// unexpected shape.
    #[cfg(feature = "testing")]
    pub async fn read_round(
        &mut self,
        parts: &[(ShardIndex, &FenceToken, &[String])],
        count: usize,
    ) -> redis::RedisResult<Vec<(Option<redis::RedisResult<Value>>, Value)>> {
        let round: Vec<super::round::RoundPart> = parts
            .iter()
            .map(|&(shard, token, ids)| super::round::RoundPart {
                key: self.keys.shard(shard),
                ack: (!ids.is_empty()).then(|| self.ack_part(shard, token, ids)),
            })
            .collect();
        let mut conn = self.conn.clone();
        let replies =
            super::round::read_round(&mut conn, &self.group, &self.consumer, count, round).await?;
        replies
            .into_iter()
            .map(|reply| match reply.read {
                super::round::PartRead::Entries(read) => Ok((reply.ack, read)),
                other => Err(redis::RedisError::from((
                    redis::ErrorKind::Parse,
                    "read round",
                    format!("{other:?}"),
                ))),
            })
            .collect()
    }

    /// What an [`ShardClient::ack_cmd`] sent elsewhere returned, as [`ShardClient::ack`] reports
    /// it. A script missing on the server (restarted, failed over) did not run: the ack is sent
    /// again on its own, which loads it.
    ///
    /// # Errors
    /// As [`ShardClient::ack`].
    pub(crate) async fn ack_reply(
        &mut self,
        shard: ShardIndex,
        token: &FenceToken,
        ids: &[String],
        reply: redis::RedisResult<Value>,
    ) -> Result<Result<usize, Fenced>, DataPlaneError> {
        match reply {
            Err(error) if is_noscript(&error) => self.ack(shard, token, ids).await,
            reply => ack_outcome(shard, self.classify(ACK, shard, reply)?),
        }
    }

    fn ack_call(&mut self, shard: ShardIndex, token: &FenceToken, ids: &[String]) -> ScriptCall {
        let mut call = self.script_call(scripts::ack(), shard, token);
        for id in ids {
            call.cmd.arg(id);
        }
        call
    }

    /// Writes `entry` to the dead-letter stream `<prefix>:dlq:<group>` (docs/design.md §8) and
    /// returns the new entry's id. Fields, in this order: `sourceStream` (the shard key),
    /// `sourceId`, `shard` (the index), `group`, `reason` ([`DeadLetterReason::as_str`]), `error`,
    /// `attempts` (decimal), then the entry's own fields (none for a trimmed or too-large entry:
    /// it is dead-lettered by id). Not fenced (the key is in another slot): write the dead letter,
    /// then [`ShardClient::ack`] the entry; a retry after a failure between the two may write it
    /// twice (`sourceStream` + `sourceId` identify it).
    ///
    /// # Errors
    /// [`DataPlaneError::Redis`] when Redis fails (do not ack then).
    pub async fn dead_letter(
        &mut self,
        shard: ShardIndex,
        entry: &ShardEntry,
        reason: DeadLetterReason,
        error: &str,
        attempts: u32,
    ) -> Result<String, DataPlaneError> {
        let mut cmd = redis::cmd("XADD");
        cmd.arg(&self.dead_letters)
            .arg("*")
            .arg("sourceStream")
            .arg(self.keys.shard(shard))
            .arg("sourceId")
            .arg(&entry.id)
            .arg("shard")
            .arg(shard)
            .arg("group")
            .arg(&self.group)
            .arg("reason")
            .arg(reason.as_str())
            .arg("error")
            .arg(error)
            .arg("attempts")
            .arg(attempts);
        for (field, value) in entry.fields.iter() {
            cmd.arg(field).arg(value);
        }
        cmd.query_async(&mut self.conn)
            .await
            .map_err(DataPlaneError::redis("dead_letter", Some(shard)))
    }

    /// Counts one handler attempt on entry `entry_id` of `shard`, which was delivered before
    /// (its delivery count is above 1; any delivery with `max_deliveries = 1`), in the shard's
    /// attempt hash
    /// `{<prefix>:<i>}:attempts`, field `<group>|<entry id>` (`HINCRBY`, fenced like an ack,
    /// whatever the [`FencingMode`]: a member that lost the shard counts nothing). Call it just
    /// before the first handler attempt of such a delivery; a first delivery is not counted
    /// (no cost on the hot path) unless `max_deliveries = 1`, where the assumed first attempt
    /// would use up the limit. Re-reads and claims do not count: only attempts do, so
    /// `max_deliveries` stops an entry that keeps killing its process, not one that was handed
    /// over unhandled (docs/design.md §8.9). Remove the count with
    /// [`ShardClient::forget_attempts`] once the entry is acked or dead-lettered.
    ///
    /// Returns the attempts counted so far, this one included (at least 1), or the refusal. A
    /// corrupt stored value (not a count, or the key not a hash) is dropped and logged, and the
    /// count starts again from 1: never a stuck shard.
    ///
    /// # Errors
    /// [`DataPlaneError::NoGroup`] when the shard stream does not exist (nothing written);
    /// [`DataPlaneError::Redis`] when Redis fails (the count may or may not have risen: an
    /// attempt counted twice brings the dead letter one attempt early, never late).
    pub async fn count_attempt(
        &mut self,
        shard: ShardIndex,
        token: &FenceToken,
        entry_id: &str,
    ) -> Result<Result<u64, Fenced>, DataPlaneError> {
        const OP: &str = "count_attempt";
        let script = scripts::count_attempt();
        let (stream, fence, attempts) = (
            self.keys.shard(shard),
            self.keys.fence(shard),
            self.keys.attempts(shard),
        );
        let field = self.attempt_field(entry_id);
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(script.get_hash())
            .arg(3)
            .arg(stream)
            .arg(fence)
            .arg(attempts)
            .arg(&self.group);
        cmd.arg(self.encoded(token));
        cmd.arg(token.incarnation)
            .arg(token.member_epoch)
            .arg(field);
        let reply = self.run(OP, shard, ScriptCall { script, cmd }).await?;
        match reply {
            Reply::Refused(fenced) => Ok(Err(fenced)),
            Reply::Done(status, rest) if status == "OK" && rest.len() == 2 => {
                if int(&rest[1]) == Some(1) {
                    tracing::warn!(
                        key = %self.keys.attempts(shard),
                        entry = entry_id,
                        "the handler-attempt count held a value that is not a count: dropped, counting again from 1"
                    );
                }
                int(&rest[0])
                    .and_then(|n| u64::try_from(n).ok())
                    .filter(|n| *n >= 1)
                    .map(Ok)
                    .ok_or_else(|| DataPlaneError::unexpected(OP, Some(shard), "attempt count"))
            }
            Reply::Done(status, rest) => Err(DataPlaneError::unexpected(
                OP,
                Some(shard),
                format!("status {status:?} with {} values", rest.len()),
            )),
        }
    }

    /// Removes the attempt counts ([`ShardClient::count_attempt`]) of `entry_ids` on `shard`
    /// (`HDEL`, not fenced: removing a count of an entry that is finished is always right).
    /// No ids: nothing is sent.
    ///
    /// # Errors
    /// [`DataPlaneError::Redis`] when Redis fails (the field stays: a few bytes until the shard
    /// is retired, never a wrong dead letter, since the entry is no longer pending).
    pub async fn forget_attempts(
        &mut self,
        shard: ShardIndex,
        entry_ids: &[&str],
    ) -> Result<(), DataPlaneError> {
        if entry_ids.is_empty() {
            return Ok(());
        }
        let mut cmd = redis::cmd("HDEL");
        cmd.arg(self.keys.attempts(shard));
        for id in entry_ids {
            cmd.arg(self.attempt_field(id));
        }
        cmd.query_async::<()>(&mut self.conn)
            .await
            .map_err(DataPlaneError::redis("forget_attempts", Some(shard)))
    }

    /// Creates this group's consumer group on `shard` again from `0` (nothing written in the gap
    /// is skipped), and the shard stream with it (`MKSTREAM`) only when `create_stream`: the
    /// caller decides from the stream metadata (a member creates a stream only for an ACTIVE
    /// shard, docs/design.md §8.11). One script, so the check and the creation cannot be split.
    ///
    /// # Errors
    /// [`DataPlaneError::Redis`] when Redis fails or the key holds another type;
    /// [`DataPlaneError::UnexpectedReply`] for a reply of another shape.
    pub(crate) async fn recreate_group(
        &mut self,
        shard: ShardIndex,
        create_stream: bool,
    ) -> Result<GroupRecreated, DataPlaneError> {
        let (stream_created, group): (i64, i64) = scripts::recreate_group()
            .key(self.keys.shard(shard))
            .arg(&self.group)
            .arg(if create_stream { "1" } else { "0" })
            .invoke_async(&mut self.conn)
            .await
            .map_err(DataPlaneError::redis("recreate_group", Some(shard)))?;
        match group {
            1 => Ok(GroupRecreated::Created {
                stream_created: stream_created == 1,
            }),
            0 => Ok(GroupRecreated::Exists),
            -1 => Ok(GroupRecreated::StreamMissing),
            other => Err(DataPlaneError::unexpected(
                "recreate_group",
                Some(shard),
                format!("group status {other}"),
            )),
        }
    }

    /// Undoes [`ShardClient::recreate_group`] when the shard stopped being readable meanwhile:
    /// destroys the consumer group, and deletes the stream when this call's creation made it and
    /// it is still empty with no group.
    ///
    /// # Errors
    /// [`DataPlaneError::Redis`] when Redis fails.
    pub(crate) async fn undo_recreate_group(
        &mut self,
        shard: ShardIndex,
        stream_created: bool,
    ) -> Result<(), DataPlaneError> {
        scripts::undo_recreate_group()
            .key(self.keys.shard(shard))
            .arg(&self.group)
            .arg(if stream_created { "1" } else { "0" })
            .invoke_async::<i64>(&mut self.conn)
            .await
            .map(|_| ())
            .map_err(DataPlaneError::redis("undo_recreate_group", Some(shard)))
    }

    /// The attempt hash field of `entry_id`: `<group>|<entry id>`.
    fn attempt_field(&self, entry_id: &str) -> String {
        format!("{}|{entry_id}", self.group)
    }

    /// `EVALSHA` of `script` on `shard` with the common keys and arguments; the caller adds its
    /// own. Built directly: a `ScriptInvocation` copies every argument twice, and the ack carries
    /// a batch of ids.
    fn script_call(
        &mut self,
        script: &'static Script,
        shard: ShardIndex,
        token: &FenceToken,
    ) -> ScriptCall {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(script.get_hash())
            .arg(2)
            .arg(self.keys.shard(shard))
            .arg(self.keys.fence(shard))
            .arg(&self.group);
        cmd.arg(self.encoded(token));
        cmd.arg(token.incarnation).arg(token.member_epoch);
        ScriptCall { script, cmd }
    }

    /// `token` encoded (`FenceToken::encode`), from the cache while the token holds.
    fn encoded(&mut self, token: &FenceToken) -> &str {
        if self
            .encoded_token
            .as_ref()
            .is_none_or(|(cached, _)| cached != token)
        {
            self.encoded_token = Some((token.clone(), token.encode()));
        }
        self.encoded_token
            .as_ref()
            .map_or("", |(_, encoded)| encoded.as_str())
    }

    /// Runs a [`ShardClient::script_call`] and sorts out fence refusals and missing groups. On
    /// `NOSCRIPT` (a restarted or failed-over server) the script is loaded and run again.
    async fn run(
        &mut self,
        op: &'static str,
        shard: ShardIndex,
        call: ScriptCall,
    ) -> Result<Reply, DataPlaneError> {
        let reply = match call.cmd.query_async(&mut self.conn).await {
            Err(error) if is_noscript(&error) => {
                call.script
                    .load_async(&mut self.conn)
                    .await
                    .map_err(DataPlaneError::redis(op, Some(shard)))?;
                call.cmd.query_async(&mut self.conn).await
            }
            other => other,
        };
        self.classify(op, shard, reply)
    }

    /// [`DataPlaneError::NoGroup`] for `shard`, with Redis's message.
    fn no_group(&self, shard: ShardIndex, detail: String) -> DataPlaneError {
        DataPlaneError::NoGroup {
            shard,
            stream: self.keys.shard(shard),
            group: self.group.clone(),
            detail,
        }
    }

    /// A script's reply: its status, fence refusals and missing groups sorted out.
    fn classify(
        &self,
        op: &'static str,
        shard: ShardIndex,
        reply: redis::RedisResult<Value>,
    ) -> Result<Reply, DataPlaneError> {
        let value = reply.map_err(DataPlaneError::redis(op, Some(shard)))?;
        let Value::Array(mut items) = value else {
            return Err(DataPlaneError::unexpected(
                op,
                Some(shard),
                format!("{value:?}"),
            ));
        };
        let status = items.first().and_then(text).ok_or_else(|| {
            DataPlaneError::unexpected(op, Some(shard), format!("no status in {items:?}"))
        })?;
        let rest = items.split_off(1);
        match status.as_str() {
            "LOWER" => Ok(Reply::Refused(Fenced::Lower)),
            "HIGHER" => Ok(Reply::Refused(Fenced::Higher {
                found: rest
                    .first()
                    .and_then(text)
                    .and_then(|s| FenceToken::decode(&s)),
            })),
            "NOGROUP" => Err(self.no_group(shard, rest.first().and_then(text).unwrap_or_default())),
            _ => Ok(Reply::Done(status, rest)),
        }
    }
}

const READ_NEW: &str = "read_new";
const ACK: &str = "ack";

fn is_noscript(error: &redis::RedisError) -> bool {
    RedisFailure::of(error) == RedisFailure::NoScript
}

/// What the read script's reply means.
fn read_new_outcome(shard: ShardIndex, reply: Reply) -> Result<ReadOutcome, DataPlaneError> {
    match reply {
        Reply::Refused(fenced) => Ok(ReadOutcome::Fenced(fenced)),
        Reply::Done(status, mut rest) if status == "OK" && rest.len() == 1 => Ok(
            ReadOutcome::Entries(parse_entries(READ_NEW, shard, rest.remove(0), false)?),
        ),
        Reply::Done(status, rest) if status == "EMPTY" && rest.len() == 1 => {
            let last_id = text(&rest[0])
                .ok_or_else(|| DataPlaneError::unexpected(READ_NEW, Some(shard), "last id"))?;
            Ok(ReadOutcome::Empty { last_id })
        }
        Reply::Done(status, rest) => Err(DataPlaneError::unexpected(
            READ_NEW,
            Some(shard),
            format!("status {status:?} with {} values", rest.len()),
        )),
    }
}

/// What the ack script's reply means.
fn ack_outcome(shard: ShardIndex, reply: Reply) -> Result<Result<usize, Fenced>, DataPlaneError> {
    match reply {
        Reply::Refused(fenced) => Ok(Err(fenced)),
        Reply::Done(status, rest) if status == "OK" && rest.len() == 1 => int(&rest[0])
            .and_then(|n| usize::try_from(n).ok())
            .map(Ok)
            .ok_or_else(|| DataPlaneError::unexpected(ACK, Some(shard), "acked count")),
        Reply::Done(status, rest) => Err(DataPlaneError::unexpected(
            ACK,
            Some(shard),
            format!("status {status:?} with {} values", rest.len()),
        )),
    }
}

fn fenced_flag(mode: FencingMode) -> &'static str {
    match mode {
        FencingMode::Strict => "1",
        FencingMode::Acks => "0",
    }
}

/// A string reply element.
fn text(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(bytes) => Some(String::from_utf8_lossy(bytes).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        Value::VerbatimString { text, .. } => Some(text.clone()),
        Value::Okay => Some("OK".to_owned()),
        _ => None,
    }
}

/// A string reply element taken by value: no copy for valid UTF-8 (ids and field names, per
/// entry on the hot path).
fn into_text(value: Value) -> Option<String> {
    match value {
        Value::BulkString(bytes) => Some(
            String::from_utf8(bytes)
                .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned()),
        ),
        Value::SimpleString(s) => Some(s),
        other => text(&other),
    }
}

/// An integer reply element (Lua numbers arrive as integers).
fn int(value: &Value) -> Option<i64> {
    match value {
        Value::Int(n) => Some(*n),
        Value::BulkString(bytes) => std::str::from_utf8(bytes).ok()?.parse().ok(),
        _ => None,
    }
}

/// The entry list of a one-stream `XREADGROUP` reply: `[[key, entries]]` (RESP2) or
/// `{key: entries}` (RESP3); `None` for a nil reply (nothing new).
fn single_stream_entries(reply: Value) -> Option<Value> {
    match reply {
        Value::Array(streams) => match streams.into_iter().next()? {
            Value::Array(pair) => pair.into_iter().nth(1),
            _ => None,
        },
        Value::Map(streams) => streams.into_iter().next().map(|(_, entries)| entries),
        _ => None,
    }
}

/// Drops the fields of an entry whose names and values total more than `max` bytes and marks it
/// [`EntryStatus::TooLarge`] (what the scripts do in Redis, done after a plain read).
fn withhold_if_larger(entry: &mut ShardEntry, max: u64) {
    let bytes: usize = entry
        .fields
        .iter()
        .map(|(name, value)| name.len() + value.len())
        .sum();
    let bytes = bytes as u64;
    if bytes > max {
        entry.fields = Arc::default();
        entry.status = EntryStatus::TooLarge { bytes };
    }
}

/// Whether `pair` is a field name (a string: not UTF-8 is read lossily) and a value (a string
/// or an integer) of an entry body.
fn is_field_pair(pair: &[Value]) -> bool {
    matches!(pair[0], Value::BulkString(_) | Value::SimpleString(_))
        && matches!(
            pair[1],
            Value::BulkString(_) | Value::SimpleString(_) | Value::Int(_)
        )
}

/// A field value checked by [`is_field_pair`], taken by value.
fn into_bytes(value: Value) -> Vec<u8> {
    match value {
        Value::BulkString(bytes) => bytes,
        Value::SimpleString(s) => s.into_bytes(),
        Value::Int(n) => n.to_string().into_bytes(),
        _ => Vec::new(),
    }
}

/// Parses the scripts' entry list: `{{id, body[, deliveryCount]}, ...}` where body is the
/// field/value list, nil (trimmed) or the size in bytes (too large).
fn parse_entries(
    op: &'static str,
    shard: ShardIndex,
    value: Value,
    with_counts: bool,
) -> Result<Vec<ShardEntry>, DataPlaneError> {
    let bad = |what: String| DataPlaneError::unexpected(op, Some(shard), what);
    let list = match value {
        Value::Array(list) => list,
        other => return Err(bad(format!("entry list {other:?}"))),
    };
    let mut entries = Vec::with_capacity(list.len());
    for item in list {
        let Value::Array(mut parts) = item else {
            return Err(bad(format!("entry {item:?}")));
        };
        if parts.len() < 2 {
            parts.resize(2, Value::Nil);
        }
        let id = match std::mem::take(&mut parts[0]) {
            Value::Nil => return Err(bad("entry id nil".into())),
            raw => into_text(raw).ok_or_else(|| bad("entry id".into()))?,
        };
        let delivery_count = if with_counts {
            parts
                .get(2)
                .and_then(int)
                .and_then(|n| u64::try_from(n).ok())
                .ok_or_else(|| bad(format!("delivery count of {id}")))?
        } else {
            1
        };
        let (fields, status) = match std::mem::take(&mut parts[1]) {
            Value::Nil => (Arc::default(), EntryStatus::Trimmed),
            Value::Int(bytes) => (
                Arc::default(),
                EntryStatus::TooLarge {
                    bytes: u64::try_from(bytes).unwrap_or(0),
                },
            ),
            Value::Array(mut flat) if flat.len() % 2 == 0 => {
                if let Some(pair) = flat.chunks_exact(2).find(|pair| !is_field_pair(pair)) {
                    return Err(bad(format!("field of {id}: {pair:?}")));
                }
                // Straight into the shared slice every attempt's `Delivery` gets (one
                // allocation: the iterator has an exact length).
                let fields: Arc<[(String, Vec<u8>)]> = flat
                    .chunks_exact_mut(2)
                    .map(|pair| {
                        let name = into_text(std::mem::take(&mut pair[0])).unwrap_or_default();
                        (name, into_bytes(std::mem::take(&mut pair[1])))
                    })
                    .collect();
                (fields, EntryStatus::Present)
            }
            other => return Err(bad(format!("body of {id}: {other:?}"))),
        };
        entries.push(ShardEntry {
            id,
            fields,
            delivery_count,
            status,
        });
    }
    Ok(entries)
}
