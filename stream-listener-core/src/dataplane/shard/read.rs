//! Reading new entries (docs/design.md §8.4 to §8.6): the fenced read script, the plain
//! `XREADGROUP` of acks mode, and the ack of a batch sent with the next read.

use redis::Value;

use super::ack::ack_count;
use super::reply::{parse_entries, single_stream_entries, text, withhold_if_larger};
use super::{Reply, ScriptCall, ShardClient, fenced_flag, unexpected_status};
use crate::connection::RedisFailure;
use crate::dataplane::error::DataPlaneError;
use crate::dataplane::round::{self, FencePart, PartRead, PartReply, RoundPart};
use crate::dataplane::{FencingMode, ReadOutcome, ShardEntry, scripts};
use crate::fence::FenceToken;
use crate::model::ShardIndex;

impl ShardClient {
    /// Reads up to `count` (at least 1) new entries on `shard` for the group
    /// (`XREADGROUP ... STREAMS <shard> >`, never blocking); they enter this consumer's PEL with
    /// delivery count 1. When nothing is new, returns [`ReadOutcome::Empty`] with the id of the
    /// stream's last entry (`"0-0"` when it has none): wait with [`crate::dataplane::Waiter::wait`] from it,
    /// then read again (an entry added between the two calls wakes the wait at once).
    ///
    /// In [`FencingMode::Strict`] the read is a script that checks the fence first
    /// ([`ReadOutcome::Fenced`]: nothing read). In [`FencingMode::Acks`] it is a plain
    /// `XREADGROUP` (no fence, `token` unused): a script costs Redis about 1.5 times the read
    /// itself to convert the entries to Lua and back (BENCHMARKS.md, item 1). Only when that
    /// finds nothing does the script run, to return the last id atomically with an empty read.
    /// The body limit ([`ShardClient::with_max_entry_bytes`]) then applies after the read: a
    /// too-large entry still comes back as [`EntryStatus::TooLarge`](crate::dataplane::EntryStatus::TooLarge) without its fields, but its
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
                self.read_new_reply(shard, token, count, mode, reply).await
            }
            FencingMode::Strict => {
                let call = self.read_script_call(shard, token, count, mode);
                self.read_new_script(shard, call).await
            }
        }
    }

    /// What a plain `XREADGROUP ... STREAMS <shard> >` returned, as [`ShardClient::read_new`]
    /// reports it; when nothing was new, the read script runs for the last id to wait from
    /// (atomically with an empty read, and fenced in strict mode: it may still return entries,
    /// or a refusal). For a read sent in a pipeline or a read round ([`crate::dataplane::round`]),
    /// in strict mode only once the round's fence check vouched for it.
    ///
    /// # Errors
    /// As [`ShardClient::read_new`].
    pub(crate) async fn read_new_reply(
        &mut self,
        shard: ShardIndex,
        token: &FenceToken,
        count: usize,
        mode: FencingMode,
        reply: redis::RedisResult<Value>,
    ) -> Result<ReadOutcome, DataPlaneError> {
        let entries = self.plain_read_reply(shard, reply)?;
        if entries.is_empty() {
            let call = self.read_script_call(shard, token, count, mode);
            self.read_new_script(shard, call).await
        } else {
            Ok(ReadOutcome::Entries(entries))
        }
    }

    /// Runs the read script of [`ShardClient::read_new`] (`call`, from
    /// [`ShardClient::read_script_call`]): the fence check in strict mode, and an `EMPTY` reply
    /// with the last id when nothing is new.
    async fn read_new_script(
        &mut self,
        shard: ShardIndex,
        call: ScriptCall,
    ) -> Result<ReadOutcome, DataPlaneError> {
        let reply = self.run(READ_NEW, shard, call).await?;
        read_new_outcome(shard, reply)
    }

    /// Acks `ids` on `shard` with a plain `XACK` and reads up to `count` new entries, in one
    /// round trip ([`crate::dataplane::round`]: in strict mode the read names the shard's read
    /// gate, inside a transaction with the fence check until the gate is known open; the
    /// entries never pass through Lua).
    /// Returns how many of `ids` were pending, and what the read returned. The ack is not
    /// fenced: a member acks only what it handled, and `XACK` is idempotent (docs/design.md
    /// §8.2). With no ids only the read is sent.
    ///
    /// # Errors
    /// As [`ShardClient::read_new`]; an error of the ack fails the whole call (acking again and
    /// reading own pending entries from `"0"` recovers).
    pub async fn ack_and_read_new(
        &mut self,
        shard: ShardIndex,
        token: &FenceToken,
        ids: &[String],
        count: usize,
        mode: FencingMode,
    ) -> Result<(usize, ReadOutcome), DataPlaneError> {
        let part = self.round_part(shard, token, ids, mode);
        let mut conn = self.conn.clone();
        let reply = round::read_round(
            &mut conn,
            &self.group,
            &self.consumer,
            count,
            vec![part],
            self.replica_wait.as_ref(),
        )
        .await
        .map_err(DataPlaneError::redis("ack_and_read_new", Some(shard)))?
        .pop()
        .ok_or_else(|| DataPlaneError::unexpected("ack_and_read_new", Some(shard), "no reply"))?;
        self.round_reply(shard, token, count, mode, reply).await
    }

    /// This shard's part of a read round ([`crate::dataplane::round`]): the plain ack of `ids`,
    /// and in strict mode the check of the fence against `token`.
    pub(crate) fn round_part(
        &mut self,
        shard: ShardIndex,
        token: &FenceToken,
        ids: &[String],
        mode: FencingMode,
    ) -> RoundPart {
        let fence = match mode {
            FencingMode::Strict => {
                let encoded = self.encoded(token).to_owned();
                let gate = self.keys.gate(shard, &self.group_keys, &encoded);
                let registry = self.keys.gate_registry(shard);
                let gate_open = self
                    .gate_open
                    .as_ref()
                    .is_some_and(|(s, t)| *s == shard && t == token);
                Some(FencePart::new(
                    self.keys.fence(shard),
                    gate,
                    registry,
                    token,
                    encoded,
                    gate_open,
                ))
            }
            FencingMode::Acks => None,
        };
        RoundPart {
            key: self.keys.shard(shard),
            ack: ids.to_vec(),
            fence,
        }
    }

    /// What a read round returned for this shard, as [`ShardClient::ack_and_read_new`] reports
    /// it: the number of ids acked, and the read. Entries vouched for (strict mode) mark the
    /// shard's gate open for `token`, so its next round reads through it without the check. A refused fence check is
    /// [`ReadOutcome::Fenced`] (its read failed with `NOGROUP` on the closed gate: that is the
    /// refusal, not an error). A round that delivered nothing for the shard (an aborted
    /// transaction, another shard's refusal, a failed multi-stream read) is followed by the
    /// shard's own read script, fenced in strict mode, which also reports the shard's own error.
    ///
    /// # Errors
    /// As [`ShardClient::ack_and_read_new`]; [`DataPlaneError::GateUnavailable`] when the read's
    /// gate could not be created (nothing was read); [`DataPlaneError::UnexpectedReply`] when
    /// entries may have been delivered that the fence check did not vouch for (re-read own
    /// pending entries: they are there).
    pub(crate) async fn round_reply(
        &mut self,
        shard: ShardIndex,
        token: &FenceToken,
        count: usize,
        mode: FencingMode,
        reply: PartReply,
    ) -> Result<(usize, ReadOutcome), DataPlaneError> {
        // Vouched-for entries (a passed check, or the gates): the gate is open for the next
        // round. Anything else: the next round checks.
        self.gate_open = (mode == FencingMode::Strict
            && matches!(reply.read, PartRead::Entries(_)))
        .then(|| (shard, token.clone()));
        let acked = match reply.ack {
            Some(ack) => ack_count(shard, ack)?,
            None => 0,
        };
        let read = match reply.read {
            PartRead::Entries(read) => {
                self.read_new_reply(shard, token, count, mode, Ok(read))
                    .await?
            }
            PartRead::Fenced(fenced) => ReadOutcome::Fenced(fenced),
            PartRead::ReadAlone => self.read_new(shard, token, count, mode).await?,
            PartRead::GateUnavailable { gate, detail } => {
                let (code, rest) = detail.split_once(' ').unwrap_or((detail.as_str(), ""));
                return Err(DataPlaneError::GateUnavailable {
                    shard,
                    gate,
                    source: redis::make_extension_error(code.to_owned(), Some(rest.to_owned())),
                });
            }
            PartRead::Unexpected(what) => {
                return Err(DataPlaneError::unexpected(READ_NEW, Some(shard), what));
            }
        };
        if matches!(read, ReadOutcome::Fenced(_)) {
            // An empty read's script found the fence raised: the gate is gone with the raise.
            self.gate_open = None;
        }
        Ok((acked, read))
    }

    pub(super) fn read_script_call(
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
    pub(super) fn plain_read_cmd(&self, shard: ShardIndex, count: usize) -> redis::Cmd {
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

    /// The entries a strict wait read on `shard` ([`crate::dataplane::shared_wait::WaitEnd::Delivered`]:
    /// a one-stream `XREADGROUP` reply), as a read's: bodies over the limit withheld.
    ///
    /// # Errors
    /// [`DataPlaneError::UnexpectedReply`] for a reply of another shape (the entries are in
    /// this consumer's PEL: read its pending entries).
    pub(crate) fn delivered_entries(
        &self,
        shard: ShardIndex,
        reply: Value,
    ) -> Result<Vec<ShardEntry>, DataPlaneError> {
        self.plain_read_reply(shard, Ok(reply))
    }

    /// The read gate of `shard` for `token` ([`crate::keys::StreamKeys::gate`]): what the
    /// shard's strict wait names (docs/design.md §8.16).
    pub(crate) fn gate(&mut self, shard: ShardIndex, token: &FenceToken) -> String {
        let encoded = self.encoded(token).to_owned();
        self.keys.gate(shard, &self.group_keys, &encoded)
    }

    /// The entries of a plain read, bodies over the limit withheld; empty when nothing is new.
    pub(super) fn plain_read_reply(
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
}

pub(super) const READ_NEW: &str = "read_new";

/// What the read script's reply means.
pub(super) fn read_new_outcome(
    shard: ShardIndex,
    reply: Reply,
) -> Result<ReadOutcome, DataPlaneError> {
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
        Reply::Done(status, rest) => Err(unexpected_status(READ_NEW, shard, &status, &rest)),
    }
}
