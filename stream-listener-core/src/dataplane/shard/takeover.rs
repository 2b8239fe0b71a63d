//! Taking over a shard (docs/design.md §8.3): raising its fence, claiming the other consumers'
//! pending entries, and reading this consumer's own pending entries.

use redis::Value;

use super::MAX_CLAIM_BATCH;
use super::reply::{int, parse_entries};
use super::{Reply, ShardClient, fenced_flag};
use crate::dataplane::error::DataPlaneError;
use crate::dataplane::{ClaimReport, Fenced, FencingMode, ReadOutcome, scripts};
use crate::fence::FenceToken;
use crate::model::ShardIndex;

impl ShardClient {
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
        // A third key, the gate registry: the raise closes the other tokens' read gates.
        let registry = self.keys.gate_registry(shard);
        let call = self.script_call_with(scripts::raise(), shard, token, Some(registry));
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
        // A third key, the attempt hash: the counts of ids dropped as trimmed go with them.
        let attempts = self.keys.attempts(shard);
        let mut call = self.script_call_with(scripts::claim_others(), shard, token, Some(attempts));
        call.cmd.arg(&self.consumer).arg(batch);
        let reply = self.run(OP, shard, call).await?;
        let rest = match reply.ok(OP, shard, 3)? {
            Ok(rest) => rest,
            Err(fenced) => return Ok(Err(fenced)),
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
    /// Entries trimmed or deleted while pending come back as [`EntryStatus::Trimmed`](crate::dataplane::EntryStatus::Trimmed) (their count
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
        match reply.ok(OP, shard, 1)? {
            Ok(mut rest) => Ok(ReadOutcome::Entries(parse_entries(
                OP,
                shard,
                rest.remove(0),
                true,
            )?)),
            Err(fenced) => Ok(ReadOutcome::Fenced(fenced)),
        }
    }
}
