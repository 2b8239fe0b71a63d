//! The dead-letter side of the data plane (docs/design.md §8.8, §8.9): writing a dead letter and
//! counting handler attempts for `max_deliveries`.

use super::reply::int;
use super::{ScriptCall, ShardClient};
use crate::dataplane::error::DataPlaneError;
use crate::dataplane::{DeadLetterReason, Fenced, ShardEntry, scripts};
use crate::fence::FenceToken;
use crate::model::ShardIndex;

impl ShardClient {
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
    /// whatever the [`FencingMode`](crate::dataplane::FencingMode): a member that lost the shard counts nothing). Call it just
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
        match reply.ok(OP, shard, 2)? {
            Err(fenced) => Ok(Err(fenced)),
            Ok(rest) => {
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

    /// The attempt hash field of `entry_id`: `<group>|<entry id>`.
    pub(super) fn attempt_field(&self, entry_id: &str) -> String {
        format!("{}|{entry_id}", self.group)
    }
}
