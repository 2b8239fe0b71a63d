//! Consumer hygiene in the shard task (docs/design.md §8.15): once takeover has claimed the
//! other consumers' pending entries, the shard's owner deletes the consumers of members that
//! left, and the group's read gate on the shard with the consumers strict reads leave in it
//! (docs/design.md §8.16; the next passing check creates it again), best effort.

use super::ShardTask;

impl ShardTask {
    /// Deletes the Redis consumers of this shard that belong to no live or static member of the
    /// group and have no pending entry ([`crate::dataplane::ShardClient::clean_consumers`]).
    /// Best effort: a failure is logged at warn and the next takeover or periodic
    /// maintenance pass (`maintenance.rs`, every `retention_interval`) tries again; it never stops the shard from being read.
    /// Returns how many consumers were deleted (0 on failure).
    pub(super) async fn clean_consumers(&mut self) -> usize {
        match self.client.clean_consumers(self.shard).await {
            Ok(Some(sweep)) => {
                if !sweep.deleted.is_empty() {
                    tracing::debug!(
                        stream = %self.shard_key,
                        group = %self.ctx.group,
                        member = %self.ctx.member_id,
                        shard = self.shard,
                        deleted = sweep.deleted.len(),
                        kept_pending = sweep.kept_pending.len(),
                        "deleted the Redis consumers of members that left"
                    );
                }
                sweep.deleted.len()
            }
            Ok(None) => {
                tracing::warn!(
                    stream = %self.shard_key,
                    group = %self.ctx.group,
                    member = %self.ctx.member_id,
                    shard = self.shard,
                    "the group's metadata is missing: no consumer deleted (retried at the next takeover or maintenance pass)"
                );
                0
            }
            Err(error) => {
                self.ctx.metrics.redis_error(&error);
                tracing::warn!(
                    stream = %self.shard_key,
                    group = %self.ctx.group,
                    member = %self.ctx.member_id,
                    shard = self.shard,
                    error = %crate::report::Chain(&error),
                    "deleting idle Redis consumers failed; retried at the next takeover or maintenance pass"
                );
                0
            }
        }
    }
}
