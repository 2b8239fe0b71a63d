//! Taking a shard over (docs/design.md §8.2): raise the fence with the member's token, claim
//! other consumers' pending entries (then delete the idle consumers of members that left,
//! `consumers.rs`), then handle this consumer's own pending entries from `0`;
//! what a fence refusal means; and a consumer group lost on the shard, created again.

use std::time::Instant;

use super::{ERROR_PAUSE, Phase, ShardTask};
use crate::connection::RedisConnection;
use crate::dataplane::{DataPlaneError, Fenced, FencingMode, GroupRecreated, ReadOutcome};
use crate::fence::FenceToken;
use crate::model::{FenceConflict, ShardState};
use crate::runtime::ListenerEvent;

/// Ids claimed per claim call.
const CLAIM_BATCH: usize = 256;

impl ShardTask {
    pub(super) async fn raise(&mut self, token: &FenceToken) {
        match self.client.raise_fence(self.shard, token).await {
            Ok(Ok(())) => {
                self.failures = 0;
                self.raised = Some(token.clone());
                self.phase = Phase::Claim;
                self.idle_from = None;
                self.clean_after_claim = true;
            }
            Ok(Err(fenced)) => self.conflict("read", fenced, token).await,
            Err(error) => {
                // No fence next to a missing stream: the stream must come back first (or the
                // shard be revoked), or this raise fails for good.
                self.on_failure("raising the fence", &error).await;
                self.pause(ERROR_PAUSE).await;
            }
        }
    }

    /// The fence holds another token than `token`: stop using the shard. `Lower` (a raise lost
    /// in a failover): raise again after re-checking lease and assignment. `Higher`: report the
    /// conflict and park until the coordinator decides (a new token, a revoke, a fencing status).
    pub(super) async fn conflict(&mut self, op: &'static str, fenced: Fenced, token: &FenceToken) {
        self.ctx.metrics.fence_rejected(op);
        self.ctx.options.emit(ListenerEvent::FenceRejected {
            op,
            member: self.ctx.member_id.to_string(),
            shard: self.shard,
        });
        self.raised = None;
        if fenced == Fenced::Lower {
            return;
        }
        let Some((incarnation, epoch)) = fenced.conflict() else {
            // Not a token at all (written by hand?): fail closed, say what to do, and try the
            // raise again now and then, so the shard resumes once someone fixes the field.
            tracing::error!(
                op,
                fence = %self.ctx.stream.fence(self.shard),
                group = %self.ctx.group,
                "the fence field of this group holds a value that is not a fencing token: the shard is not read until it is deleted (HDEL <fence> <group>)"
            );
            self.pause(self.ctx.options.coordination.member_lease_ttl)
                .await;
            return;
        };
        self.ctx.shared.lock().fence_conflict(FenceConflict {
            shard_index: self.shard,
            incarnation,
            epoch,
        });
        tracing::warn!(
            op,
            "the shard's fence holds a higher token: not reading it; reported"
        );
        while !self.done() && self.usable_token().as_ref() == Some(token) {
            self.wait_for_assignment().await;
        }
    }

    pub(super) async fn claim(&mut self, token: &FenceToken) -> Result<(), DataPlaneError> {
        match self
            .client
            .claim_others(self.shard, token, CLAIM_BATCH)
            .await?
        {
            Ok(report) => {
                if report.trimmed > 0 {
                    tracing::warn!(
                        trimmed = report.trimmed,
                        "pending entries of other consumers were trimmed before they were acked"
                    );
                }
                if report.complete {
                    // At takeover the old owners' PELs are empty now: their consumers can go
                    // (§8.15). Not after the acks-mode sweeps: once per takeover is enough.
                    if std::mem::take(&mut self.clean_after_claim) {
                        self.clean_consumers().await;
                    }
                    self.phase = Phase::Pending("0".into());
                }
                Ok(())
            }
            Err(fenced) => {
                self.conflict("claim", fenced, token).await;
                Ok(())
            }
        }
    }

    /// In `acks` mode a zombie can still read (reads are fenced by the lease only), so entries it
    /// read after the takeover sit in its pending list: claim other consumers' entries again once
    /// per lease TTL (docs/design.md §8, the periodic sweep).
    pub(super) fn sweep_if_due(&mut self) {
        let acks_mode = self.ctx.options.fencing == FencingMode::Acks;
        if acks_mode && self.last_sweep.elapsed() >= self.ctx.options.coordination.member_lease_ttl
        {
            self.last_sweep = Instant::now();
            self.phase = Phase::Claim;
        }
    }

    pub(super) async fn read_pending(
        &mut self,
        token: &FenceToken,
        after: &str,
    ) -> Result<(), DataPlaneError> {
        // Out of the member's strict wait first: whatever it read for the shard is in the PEL,
        // which this read goes through (what it stashed would be handled twice).
        if self.settle().await.is_none() {
            return Ok(());
        }
        let batch = self.ctx.options.batch_size;
        let mode = self.ctx.options.fencing;
        match self
            .client
            .read_pending(self.shard, token, after, batch, mode)
            .await?
        {
            ReadOutcome::Entries(entries) => {
                // An empty page means the own pending entries are done.
                let last = entries.last().map(|e| e.id.clone());
                let complete = self.handle_batch(token, entries).await?;
                match (complete, last) {
                    (true, Some(last)) => self.phase = Phase::Pending(last),
                    (true, None) => self.phase = Phase::New,
                    (false, _) => {}
                }
                Ok(())
            }
            ReadOutcome::Empty { .. } => {
                self.phase = Phase::New;
                Ok(())
            }
            ReadOutcome::Fenced(fenced) => {
                self.conflict("read", fenced, token).await;
                Ok(())
            }
        }
    }

    /// The shard's stream or consumer group is missing (`NOGROUP`, no such key) when `failed`
    /// ran. A scale-in's retirement deletes a drained shard's stream while its owner still holds
    /// the shard, until the owner's next heartbeat revokes it (docs/design.md §10.2): nothing is
    /// lost, so the owner says so at info level and asks for that heartbeat now. A warning per
    /// retry there ("Redis lost data") came with every scale-in. On any other shard it is lost
    /// data: warn (when `log`: [`ShardTask::failed_again`]), and create the consumer group again
    /// where the configuration allows.
    pub(super) async fn on_missing_group(&self, failed: &str, error: &DataPlaneError, log: bool) {
        let mut conn = self.ctx.conn.clone();
        let state = self.state_in_metadata(&mut conn).await;
        if matches!(state, Some(ShardState::Retiring | ShardState::Retired)) {
            tracing::info!(
                stream = %self.shard_key,
                ?state,
                "the shard was retired by a scale-in: released at the heartbeat asked for now"
            );
            self.ctx.shared.wake_heartbeat.notify_one();
            return;
        }
        if self.ctx.options.auto_create_shards.is_none() {
            // Nothing here creates it again, so "let the group be provisioned again" alone would
            // leave the reader waiting for something that never happens: name the fixes.
            if log {
                tracing::warn!(error = %crate::report::Chain(error), failures = self.failures, "{failed} failed; retrying. {}", self.without_auto_create(state));
            }
            return;
        }
        if log {
            tracing::warn!(error = %crate::report::Chain(error), failures = self.failures, "{failed} failed; retrying");
        }
        self.recreate_consumer_group(state).await;
    }

    /// What to do about a lost consumer group when no member creates it again (no
    /// `auto_create_shards`): by hand only where a member would (a readable shard, its stream
    /// only while ACTIVE: [`Self::recreate_consumer_group`]).
    fn without_auto_create(&self, state: Option<ShardState>) -> String {
        let (key, group) = (&self.shard_key, &self.ctx.group);
        let by_hand = match state {
            Some(ShardState::Active) => format!("XGROUP CREATE {key} {group} 0 MKSTREAM"),
            Some(s) if s.is_readable() => format!("XGROUP CREATE {key} {group} 0"),
            _ => {
                return "The stream metadata does not list the shard as readable, so it is not created again; the shard is released when the assignment drops it".to_owned();
            }
        };
        format!(
            "The stream's shard count is not configured, so no member creates the consumer group again: set `shards` under [streams.{}] in the config (`ListenerOptions::auto_create_shards` without one), or create it by hand with `{by_hand}` (from 0: entries already handled are delivered again)",
            self.ctx.stream.prefix()
        )
    }

    /// The shard lost its consumer group (or its stream), and `auto_create_shards` is set
    /// (operator intent; without it the caller keeps failing closed and names the fixes): create
    /// the group again from `0` — nothing written in the gap is skipped.
    ///
    /// Only while the stream metadata lists the shard as readable: a member holds a retired
    /// shard until its next heartbeat, and re-creating it then would bring back a stream no one
    /// reads, into which a producer's late `XADD ... NOMKSTREAM` would succeed (docs/design.md
    /// §8.11). A missing stream is created (`MKSTREAM`) only while the shard is ACTIVE, the
    /// rule of `register_group`: a master restarted without persistence loses the shard streams
    /// of its slots while the stream metadata, elsewhere, still lists them, and no admin
    /// operation provisions them again for a registered group. An ACTIVE shard reaches RETIRED
    /// only after DRAINING for the routing lease and more, so the check and the creation are
    /// that far apart at least. When the shard stopped being readable while the group was
    /// created (a retirement started), the group is destroyed again (created from `0`, it would
    /// block the shard's deletion, as in docs/design.md §8.1), and a stream created here with it
    /// when it is still empty.
    async fn recreate_consumer_group(&self, state: Option<ShardState>) {
        let mut conn = self.ctx.conn.clone();
        let key = self.ctx.stream.shard(self.shard);
        if !state.is_some_and(|s| s.is_readable()) {
            tracing::warn!(
                stream = %key,
                "consumer group missing on a shard the stream metadata does not list as readable: not created again"
            );
            return;
        }
        let create_stream = state == Some(ShardState::Active);
        let mut client = self.client.clone();
        match client.recreate_group(self.shard, create_stream).await {
            Ok(GroupRecreated::Created { .. }) if self.readable_in_metadata(&mut conn).await => {
                tracing::warn!("consumer group was missing on this shard: created again from 0")
            }
            Ok(GroupRecreated::Created { stream_created }) => {
                let undone = client.undo_recreate_group(self.shard, stream_created).await;
                tracing::warn!(
                    stream = %key,
                    undone = undone.is_ok(),
                    "the shard stopped being readable while its consumer group was created again: destroyed it"
                );
            }
            Ok(GroupRecreated::StreamMissing) => tracing::warn!(
                stream = %key,
                "consumer group missing on a DRAINING shard whose stream is gone: not created (a member creates a stream only for an ACTIVE shard)"
            ),
            Ok(GroupRecreated::Exists) => {} // created meanwhile
            Err(error) => {
                self.ctx.metrics.redis_error(&error);
                tracing::warn!(error = %crate::report::Chain(&error), "re-creating the consumer group failed")
            }
        }
    }

    /// Whether the stream metadata lists this shard as readable (ACTIVE or DRAINING), read now.
    /// Missing or unreadable metadata, or a failed read: no (fail closed).
    async fn readable_in_metadata(&self, conn: &mut RedisConnection) -> bool {
        self.state_in_metadata(conn)
            .await
            .is_some_and(|s| s.is_readable())
    }

    /// This shard's state in the stream metadata, read now; `None` when it is not listed, the
    /// metadata is missing or unreadable, or the read failed.
    async fn state_in_metadata(&self, conn: &mut RedisConnection) -> Option<ShardState> {
        match crate::store::load_stream_metadata(conn, &self.ctx.stream).await {
            Ok(Some(meta)) => meta
                .shards
                .iter()
                .find(|s| s.shard_index == self.shard)
                .map(|s| s.state),
            Ok(None) => None,
            Err(error) => {
                self.ctx.metrics.redis_error(&error);
                tracing::warn!(error = %crate::report::Chain(&error), "reading the stream metadata failed");
                None
            }
        }
    }
}
