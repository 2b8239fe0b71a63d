//! Reading new entries (`>`, docs/design.md §8.7): the ack of the previous batch and the next
//! read in one round trip, on the shard's own or in the member's read round ([`super::rounds`]),
//! and the blocking wait for new entries when a read found none.

use std::sync::Arc;
use std::time::Duration;

use super::rounds::{ReadRounds, Request, RoundResult};
use super::{ERROR_PAUSE, Phase, ShardTask, holds};
use crate::dataplane::shared_wait::{Settled, WaitEnd};
use crate::dataplane::{DataPlaneError, FencingMode, ReadOutcome, ShardEntry, Waiter};
use crate::fence::FenceToken;
use crate::model::ShardIndex;

/// How a shard task's wait for new entries ended ([`ShardTask::wait_for_entries`]).
#[derive(Debug)]
pub(super) enum Waited {
    /// Read: something may be new (or the wait failed, or the task is ending).
    Woken,
    /// The block time passed: nothing new after the id waited from.
    TimedOut,
    /// The strict wait read these entries into the member's PEL through the shard's gate
    /// (a one-stream `XREADGROUP` reply).
    Delivered(redis::Value),
    /// The strict wait may have read entries nobody received: read own pending ones first.
    ReadPending,
}

impl ShardTask {
    /// Acks the previous batch and reads the next one in the same round trip (one pipeline, the
    /// plain ack first; in strict mode the read is fenced by the shard's read gate, and by a
    /// transaction with the check until the gate is known open). A failed ack fails
    /// the whole round trip: the ids are held again and the shard re-reads its own pending
    /// entries.
    pub(super) async fn read_new(&mut self, token: &FenceToken) -> Result<(), DataPlaneError> {
        // Caught up, and the last wait ended without an entry: nothing is new after its id, and
        // (caught up) the acks went out on their own. Wait again from it, without a read: an
        // idle member sends one shared `XREAD` per block time, not a read per shard.
        if let Some(last_id) = self.idle_from.take()
            && self.acks.is_empty()
        {
            // In acks mode a due sweep comes first (claim, own pending, then a read).
            self.sweep_if_due();
            if self.phase == Phase::New {
                return self.wait_idle(token, last_id).await;
            }
            return Ok(());
        }
        // The member's strict wait may still name this shard (its own wait timed out): out of
        // it first, and what it read for the shard before anything newer.
        match self.settle().await {
            None => return Ok(()),
            Some(Settled::Clear) => {}
            Some(Settled::ReadPending) => {
                self.phase = Phase::Pending("0".into());
                return Ok(());
            }
            Some(Settled::Stashed(reply)) => return self.handle_delivered(token, reply).await,
        }
        let batch = self.ctx.options.batch_size;
        let mode = self.ctx.options.fencing;
        let ids = self.take_acks_for(token).await;
        // Checked again just before sending: since the task's own check it may have waited for
        // Redis (a separate ack, retention, metrics), and a process stopped meanwhile must not
        // send a read once its lease has passed (in acks mode nothing else would stop it).
        let still_held = holds(&self.ctx.shared, self.shard, token);
        let result = match self.ctx.rounds.clone() {
            _ if !still_held => Ok(None),
            Some(rounds) => self.round(&rounds, token, ids.as_slice()).await,
            None => self
                .client
                .ack_and_read_new(self.shard, token, &ids, batch, mode)
                .await
                .map(Some),
        };
        // The acked count is not what is counted: an id acked before counts 0 there.
        let (_, read) = match result {
            Ok(Some(replies)) => replies,
            // Not sent (lease or assignment changed while queued), or failed (nothing is known
            // of what ran): the handled ids are held again, and acked (again: harmless) before
            // the shard re-reads its own pending entries — not handled a second time.
            other => {
                self.acks.hold(token, ids);
                return other.map(|_| ());
            }
        };
        self.count_handled(ids.len());
        match read {
            ReadOutcome::Entries(entries) => self.handle_new(token, entries).await.map(|_| ()),
            ReadOutcome::Empty { last_id } => {
                self.behind = false;
                self.sweep_if_due();
                if self.phase == Phase::New {
                    return self.wait_idle(token, last_id).await;
                }
                Ok(())
            }
            ReadOutcome::Fenced(fenced) => {
                self.conflict("read", fenced, token).await;
                Ok(())
            }
        }
    }

    /// [`crate::dataplane::ShardClient::ack_and_read_new`] in the member's next read round
    /// ([`super::rounds`]): the ack of `ids` and the read of this shard share the round trip with
    /// the member's other shards. `None` when nothing was sent for this shard.
    async fn round(
        &mut self,
        rounds: &Arc<ReadRounds>,
        token: &FenceToken,
        ids: &[String],
    ) -> Result<Option<(usize, ReadOutcome)>, DataPlaneError> {
        let batch = self.ctx.options.batch_size;
        let mode = self.ctx.options.fencing;
        let request = Request {
            shard: self.shard,
            token: token.clone(),
            part: self.client.round_part(self.shard, token, ids, mode),
        };
        let shared = &self.ctx.shared;
        let still_held = |shard: ShardIndex, token: &FenceToken| holds(shared, shard, token);
        let (reply, turn) = match rounds
            .submit(
                self.client.connection(),
                request,
                self.turn.take(),
                &still_held,
            )
            .await
        {
            RoundResult::Done(reply, turn) => (reply, turn),
            RoundResult::NotSent => return Ok(None),
            RoundResult::Failed(source) => {
                return Err(DataPlaneError::Redis {
                    op: "read_round",
                    shard: Some(self.shard),
                    source,
                });
            }
        };
        // Held while this task does not wait: a round trip of the shard's own (an empty read's
        // last id, a read alone after an aborted transaction) gives the turn up.
        self.turn.hold(turn);
        self.client
            .round_reply(self.shard, token, batch, mode, reply)
            .await
            .map(Some)
    }

    /// Handles new entries, from a read or a strict wait: a batch listener may first wait for a
    /// fuller batch. Returns whether the entries left more behind them (a full batch).
    async fn handle_new(
        &mut self,
        token: &FenceToken,
        entries: Vec<ShardEntry>,
    ) -> Result<bool, DataPlaneError> {
        // A batch listener may wait for a fuller batch (`batch_max_wait`).
        let entries = self.fill_batch(token, entries).await?;
        self.behind = entries.len() >= self.ctx.options.batch_size;
        if !self.handle_batch(token, entries).await? {
            // Entries left unfinished (lease lapse, failed attempt while draining) stay in this
            // consumer's pending list: go back to it before reading new ones.
            self.phase = Phase::Pending("0".into());
        }
        self.sweep_if_due();
        Ok(self.behind)
    }

    /// Waits for an entry after `last_id` for up to the block time; when none came, the next
    /// [`Self::read_new`] waits again from `last_id` instead of reading. In strict mode the wait
    /// names the shard's gate for `token`, and what a strict wait reads is handled here: the
    /// next wait starts after it, without a read, unless it was a full batch.
    async fn wait_idle(
        &mut self,
        token: &FenceToken,
        last_id: String,
    ) -> Result<(), DataPlaneError> {
        let gate = (self.ctx.options.fencing == FencingMode::Strict)
            .then(|| self.client.gate(self.shard, token));
        let block = self.ctx.options.block;
        match self
            .wait_for_entries(&last_id, gate.as_deref(), block)
            .await
        {
            Waited::TimedOut => self.idle_from = Some(last_id),
            Waited::Woken => {}
            Waited::ReadPending => self.phase = Phase::Pending("0".into()),
            Waited::Delivered(reply) => self.handle_delivered(token, reply).await?,
        }
        Ok(())
    }

    /// Handles what the strict wait read for the shard; unless it was a full batch, the next
    /// wait starts after it, without a read (an entry that came meanwhile answers it at once).
    async fn handle_delivered(
        &mut self,
        token: &FenceToken,
        reply: redis::Value,
    ) -> Result<(), DataPlaneError> {
        let entries = self.client.delivered_entries(self.shard, reply)?;
        let last = entries.last().map(|entry| entry.id.clone());
        let behind = self.handle_new(token, entries).await?;
        if !behind && self.phase == Phase::New {
            self.idle_from = last;
        }
        Ok(())
    }

    /// [`crate::dataplane::shared_wait::WaitSlot::settle`], ended by a revoke or a stop
    /// (`None`): it waits while a lost strict wait's connection is being killed.
    pub(super) async fn settle(&self) -> Option<Settled> {
        tokio::select! {
            settled = self.wait_slot.settle() => Some(settled),
            _ = self.revoke.cancelled() => None,
            _ = self.stop.cancelled() => None,
        }
    }

    /// Blocks until a new entry arrives after `last_id`, the block time or the lease runs out,
    /// or the shard is revoked; at most `most`. [`Waited::TimedOut`] only when the block time
    /// passed without an entry (then nothing is new after `last_id`); [`Waited::Woken`] when the
    /// shard should read (woken, a failed wait: a wake may have been lost, a lease too short to
    /// wait, a revoke or a stop). The wait is the member's shared one
    /// ([`crate::dataplane::shared_wait`]: one `XREAD` on a standalone server, keyspace
    /// notifications on a cluster), or, when that is unavailable, the shard's own `XREAD` on a
    /// connection of its own. With `gate` (strict mode) the shared wait may read what it waits
    /// for ([`Waited::Delivered`], [`Waited::ReadPending`]). A failed wait is logged and counted
    /// here and pauses the task (no hot loop).
    pub(super) async fn wait_for_entries(
        &mut self,
        last_id: &str,
        gate: Option<&str>,
        most: Duration,
    ) -> Waited {
        let block = self.ctx.options.block.min(most).min(self.lease_remaining());
        if block < Duration::from_millis(1) {
            return Waited::Woken;
        }
        let shared = tokio::select! {
            end = self.shared_wait(last_id, gate, block) => end,
            _ = self.revoke.cancelled() => WaitEnd::Woken,
            _ = self.stop.cancelled() => WaitEnd::Woken,
        };
        if shared != WaitEnd::Unavailable {
            // The shared wait works (again): the shard's own connection is not needed.
            self.waiter = None;
        }
        let ended = match shared {
            WaitEnd::Woken => Ok(Waited::Woken),
            WaitEnd::TimedOut => Ok(Waited::TimedOut),
            WaitEnd::Delivered(reply) => Ok(Waited::Delivered(reply)),
            WaitEnd::ReadPending => Ok(Waited::ReadPending),
            WaitEnd::Unavailable => self.wait_alone(last_id, block).await.map(|woken| {
                if woken {
                    Waited::Woken
                } else {
                    Waited::TimedOut
                }
            }),
        };
        match ended {
            Ok(waited) => waited,
            Err(error) => {
                self.ctx.metrics.redis_error(&error);
                tracing::warn!(error = %crate::report::Chain(&error), "waiting for new entries failed; reading again after a pause");
                self.pause(ERROR_PAUSE).await;
                Waited::Woken
            }
        }
    }

    /// The member's shared wait: strict (it may read) with a gate, a wake only without.
    async fn shared_wait(&self, last_id: &str, gate: Option<&str>, block: Duration) -> WaitEnd {
        match gate {
            Some(gate) => self.wait_slot.wait_reading(last_id, gate, block).await,
            None => self.wait_slot.wait(last_id, block).await,
        }
    }

    /// The shard's own `XREAD BLOCK` (no group), on a connection of its own made at the first
    /// wait: `Ok(false)` when `block` passed without an entry.
    async fn wait_alone(&mut self, last_id: &str, block: Duration) -> Result<bool, DataPlaneError> {
        if self.waiter.is_none() {
            self.waiter = Some(Waiter::connect(&self.ctx.target, self.ctx.options.block).await?);
        }
        let shards = [(self.ctx.stream.shard(self.shard), last_id.to_owned())];
        let Some(waiter) = self.waiter.as_mut() else {
            return Ok(true);
        };
        tokio::select! {
            result = waiter.wait(&shards, block) => result.map(|woken| !woken.is_empty()),
            _ = self.revoke.cancelled() => Ok(true),
            _ = self.stop.cancelled() => Ok(true),
        }
    }
}
