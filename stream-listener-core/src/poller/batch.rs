//! The batch path (docs/design.md §14.2): a batch listener's entries of one read handled as one
//! batch per handler call, in order. Each entry's status and attempt count are checked as on the
//! per-entry path ([`ShardTask::admit`]); entries that do not decode are dead-lettered (reason
//! `decode`) before the batch is built; the handler's outcome acks the batch, a prefix of it, or
//! retries it with the backoff policy of [`super::attempt`]. And `batch_max_wait`: a read that
//! returned fewer than `batch_size` entries waits that long for more ([`ShardTask::fill_batch`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::attempt::{Limits, Verdict};
use super::entries::{Admission, failed_outcome};
use super::handler_run::{Cause, Ran};
use super::reads::Waited;
use super::{Phase, ShardTask};
use crate::batch::{AnyHandler, BatchError, ErasedBatchHandler};
use crate::dataplane::shared_wait::Settled;
use crate::dataplane::{DataPlaneError, DeadLetterReason, ReadOutcome, ShardEntry};
use crate::fence::FenceToken;
use crate::handler::HandlerError;
use crate::report::Chain;
use crate::telemetry::HandlerOutcome;

/// An entry admitted to the batch: it, and whether its attempts are counted in Redis.
type Admitted = (ShardEntry, bool);

/// How one batch attempt ended, as the policy sees it.
enum Failure {
    /// Entry `index` of the attempt's batch failed (the ones before it are handled).
    At(usize, HandlerError, Cause),
    /// The whole batch failed.
    All(HandlerError, Cause),
}

impl ShardTask {
    /// Handles `entries` as batches of `handler` (docs/design.md §14.2), as
    /// [`ShardTask::handle_batch`] does per entry: when every entry finished, their ids wait in
    /// the ack buffer; otherwise what finished is acked now. Returns whether every entry finished.
    pub(super) async fn handle_as_batch(
        &mut self,
        token: &FenceToken,
        entries: Vec<ShardEntry>,
        handler: Arc<dyn ErasedBatchHandler>,
    ) -> Result<bool, DataPlaneError> {
        let limits = Limits::of(&self.ctx.options);
        let mut finished = Vec::with_capacity(entries.len());
        let mut rest: Vec<Admitted> = Vec::with_capacity(entries.len());
        let mut complete = true;
        for entry in entries {
            // Paused (the member, e.g. during `batch_max_wait`): the batch stays pending, read
            // again from `0` after the resume, as the per-entry path's entries not started.
            if self.done() || !self.still_holds(token) || self.paused() {
                complete = false;
                break;
            }
            match self.admit(token, &entry, limits).await? {
                Admission::Finished => finished.push(entry.id),
                Admission::Fenced(op, fenced) => {
                    self.conflict(op, fenced, token).await;
                    complete = false;
                    break;
                }
                Admission::Ready { counted } => rest.push((entry, counted)),
            }
        }
        if complete {
            complete = self
                .batch_attempts(token, rest, &handler, limits, &mut finished)
                .await?;
        }
        self.settle_read(token, finished, complete).await
    }

    /// The handler attempts on the admitted entries `rest`, until every one is handled or
    /// dead-lettered (returns `true`) or the rest is left pending (`false`: drain, stop, lease
    /// end). The ids of finished entries go to `finished`.
    async fn batch_attempts(
        &mut self,
        token: &FenceToken,
        mut rest: Vec<Admitted>,
        handler: &Arc<dyn ErasedBatchHandler>,
        limits: Limits,
        finished: &mut Vec<String>,
    ) -> Result<bool, DataPlaneError> {
        let mut attempt = 1;
        while !rest.is_empty() {
            let deliveries = rest
                .iter()
                .map(|(entry, _)| self.delivery(token, entry, attempt))
                .collect();
            let prepared = handler.prepare(deliveries);
            // Undecodable entries: dead-lettered now, never in the batch (a decode does not
            // get better with retries).
            let mut slots: Vec<Option<Admitted>> = rest.into_iter().map(Some).collect();
            for (position, error) in prepared.failed {
                if let Some((entry, counted)) = slots[position].take() {
                    let text = Chain(&error).to_string();
                    self.dead_letter(&entry, DeadLetterReason::Decode, &text, attempt)
                        .await?;
                    self.finish(entry, counted, finished).await;
                }
            }
            rest = prepared
                .kept
                .iter()
                .filter_map(|&position| slots[position].take())
                .collect();
            let Some(run) = prepared.run else {
                return Ok(true);
            };
            let first = rest.first().map(|(entry, _)| entry.id.clone());
            let span = tracing::info_span!(
                "handle_batch",
                stream = self.ctx.stream.prefix(),
                group = %self.ctx.group,
                member = %self.ctx.member_id,
                shard = self.shard,
                member_epoch = token.member_epoch,
                first_entry_id = first.as_deref().unwrap_or_default(),
                entries = rest.len(),
                attempt,
            );
            let (ran, started) = self
                .run_attempt(|| tracing::Instrument::instrument(run(), span))
                .await;
            let failure = match ran {
                Ran::Done(Ok(())) => {
                    self.ctx
                        .metrics
                        .handler_attempt(HandlerOutcome::Ok, started);
                    for (entry, counted) in std::mem::take(&mut rest) {
                        self.ctx.metrics.handled();
                        self.finish(entry, counted, finished).await;
                    }
                    return Ok(true);
                }
                Ran::Done(Err(error)) => self.failure(error, rest.len()),
                Ran::Panicked(panic) => Failure::All(
                    HandlerError::retryable(format!(
                        "batch handler panicked: {}",
                        crate::report::panic_text(panic.as_ref())
                    )),
                    Cause::Panic,
                ),
                Ran::TimedOut => Failure::All(self.timed_out(), Cause::Timeout),
                Ran::Cancelled => return Ok(false),
            };
            let (index, error, cause) = match failure {
                Failure::At(index, error, cause) => (Some(index), error, cause),
                Failure::All(error, cause) => (None, error, cause),
            };
            // The handled prefix is done whatever happens to the rest.
            if let Some(index) = index {
                for (entry, counted) in rest.drain(..index) {
                    self.ctx.metrics.handled();
                    self.finish(entry, counted, finished).await;
                }
            }
            // Draining: no further retries; the rest stays pending for the next owner.
            let draining = self.revoke.is_cancelled();
            let verdict = limits.after_failure(&error, attempt, draining);
            self.ctx
                .metrics
                .handler_attempt(failed_outcome(&error, cause, &verdict), started);
            let backoff = match verdict {
                Verdict::DeadLetter { reason } => {
                    let text = Chain(&error).to_string();
                    // One entry failed: it alone; the whole batch failed: every entry.
                    let dead = if index.is_some() { 1 } else { rest.len() };
                    for (entry, counted) in rest.drain(..dead) {
                        self.dead_letter(&entry, reason, &text, attempt).await?;
                        self.finish(entry, counted, finished).await;
                    }
                    // The entries after a dead-lettered one go on as a fresh batch: they did
                    // not fail.
                    attempt = 1;
                    // A pause of the member starts no further batch either.
                    if !rest.is_empty()
                        && (self.done() || !self.still_holds(token) || self.paused())
                    {
                        return Ok(false);
                    }
                    continue;
                }
                Verdict::Abandon => return Ok(false),
                // A handler's `pause_shard` (docs/design.md §14.4): no failed attempt; the rest
                // of the batch runs again with the same attempt number after the pause.
                Verdict::PauseShard { duration } => {
                    tracing::info!(?duration, entries = rest.len(), error = %Chain(&error), "batch handler paused the shard; the batch is tried again after the pause");
                    self.pause_shard_for(duration);
                    self.wait_while_paused().await;
                    if self.done() || !self.may_finish() || self.ctx.shared.is_paused() {
                        return Ok(false);
                    }
                    continue;
                }
                Verdict::Retry { backoff } => backoff,
            };
            for _ in &rest {
                self.ctx.metrics.retry();
            }
            tracing::debug!(
                first_entry = rest.first().map(|(entry, _)| entry.id.as_str()).unwrap_or_default(),
                entries = rest.len(),
                attempt,
                error = %Chain(&error),
                "batch handler failed; retrying in place"
            );
            self.pause(backoff).await;
            // The lease may have lapsed during the backoff: no attempt without it. A pause of
            // the member leaves the rest pending, as on the per-entry path.
            if self.done() || !self.may_finish() || self.ctx.shared.is_paused() {
                return Ok(false);
            }
            attempt += 1;
        }
        Ok(true)
    }

    /// The policy's view of a handler's `error` on a batch of `len` entries: an index out of
    /// range is a bug in the handler, taken as the whole batch failing (and logged).
    fn failure(&self, error: BatchError, len: usize) -> Failure {
        match error.index {
            Some(index) if index < len => Failure::At(index, error.error, Cause::Returned),
            Some(index) => {
                tracing::error!(
                    index,
                    entries = len,
                    error = %Chain(&error.error),
                    "batch handler returned BatchError::at with an index past the batch: the whole batch failed (fix the handler)"
                );
                Failure::All(error.error, Cause::Returned)
            }
            None => Failure::All(error.error, Cause::Returned),
        }
    }

    /// `entry` is handled or dead-lettered: its attempt count goes (when counted), its id waits
    /// for the ack.
    async fn finish(&mut self, entry: ShardEntry, counted: bool, finished: &mut Vec<String>) {
        if counted {
            self.forget_attempts(&entry).await;
        }
        finished.push(entry.id);
    }

    /// `batch_max_wait` (docs/design.md §14.2): a batch listener's read of new `entries` that
    /// returned fewer than `batch_size` waits up to `batch_max_wait` for more (each wait a
    /// blocking `XREAD` from the last id, cut at the block time, the lease's end, a drain or a
    /// stop), reading what arrives, until the batch is full or the time is up. Entries read
    /// here are in this consumer's pending list like the first ones: on an error the shard goes
    /// back to it.
    pub(super) async fn fill_batch(
        &mut self,
        token: &FenceToken,
        mut entries: Vec<ShardEntry>,
    ) -> Result<Vec<ShardEntry>, DataPlaneError> {
        let options = &self.ctx.options;
        let (wait, batch, mode) = (options.batch_max_wait, options.batch_size, options.fencing);
        if wait.is_zero() || !matches!(self.ctx.handler, AnyHandler::Batch(_)) {
            return Ok(entries);
        }
        let deadline = Instant::now() + wait;
        while entries.len() < batch && !self.done() && self.still_holds(token) && !self.paused() {
            let Some(last_id) = entries.last().map(|entry| entry.id.clone()) else {
                break;
            };
            let left = deadline.saturating_duration_since(Instant::now());
            if left < Duration::from_millis(1) {
                break;
            }
            match self.wait_for_entries(&last_id, None, left).await {
                // A strict wait that had this shard before the task stopped naming its gate
                // may still deliver: those entries join the batch.
                Waited::Delivered(reply) => {
                    entries.extend(self.client.delivered_entries(self.shard, reply)?);
                    continue;
                }
                // Its own pending entries hold what a strict wait read: after this batch, and
                // nothing newer before them.
                Waited::ReadPending => {
                    self.phase = Phase::Pending("0".into());
                    break;
                }
                Waited::Woken | Waited::TimedOut => {}
            }
            match self.settle().await {
                None => break,
                Some(Settled::Clear) => {}
                Some(Settled::Stashed(reply)) => {
                    entries.extend(self.client.delivered_entries(self.shard, reply)?);
                    continue;
                }
                // A strict wait lost its reply: after this batch, from the PEL.
                Some(Settled::ReadPending) => {
                    self.phase = Phase::Pending("0".into());
                    break;
                }
            }
            match self
                .client
                .read_new(self.shard, token, batch - entries.len(), mode)
                .await?
            {
                ReadOutcome::Entries(more) => entries.extend(more),
                ReadOutcome::Empty { .. } => {}
                ReadOutcome::Fenced(fenced) => {
                    // The batch is not handled without the fence (`handle_as_batch` checks).
                    self.conflict("read", fenced, token).await;
                    break;
                }
            }
        }
        Ok(entries)
    }
}
