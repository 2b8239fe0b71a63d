//! Handling entries (docs/design.md §8.8 outcomes, §8.9 poison entries): a batch in order (or,
//! with `ordering = "key"` or `"none"`, several entries at once: [`super::lanes`]), each
//! entry by its status (present, trimmed, too large), its attempts counted across deliveries
//! when the policy says so ([`super::attempt`]), retried in place, dead-lettered or left pending.

use super::ShardTask;
use super::attempt::{Limits, Verdict};
use super::handler_run::{Attempt, Cause};
use crate::batch::AnyHandler;
use crate::dataplane::{DataPlaneError, DeadLetterReason, EntryStatus, Fenced, ShardEntry};
use crate::fence::FenceToken;
use crate::handler::{Delivery, HandlerError, Metadata};
use crate::report::Chain;
use crate::runtime::{ListenerEvent, Ordering};
use crate::telemetry::HandlerOutcome;

/// The `error` field of a `max-deliveries` dead letter.
const MAX_DELIVERIES_ERROR: &str = "max_deliveries handler attempts did not finish";

/// What an entry's status and attempt count say before its first handler attempt
/// ([`ShardTask::admit`]).
pub(super) enum Admission {
    /// Trimmed or dead-lettered without an attempt: ack it.
    Finished,
    /// The fence refused operation `op` (its attempt count): leave it pending; the caller
    /// handles the conflict ([`ShardTask::conflict`]) once no entry runs.
    Fenced(&'static str, Fenced),
    /// Ready for its handler; `counted`: its attempts are counted in Redis (forget them once it
    /// is finished).
    Ready {
        /// Whether this delivery's attempts were counted.
        counted: bool,
    },
}

/// What became of one entry.
pub(super) enum Outcome {
    /// Handled, dead-lettered or trimmed: ack it.
    Ack,
    /// Not finished (drain, stop, lease end): leave it pending for the next owner.
    Abandon,
    /// Not finished: the fence refused operation `op` (its attempt count). The caller, which
    /// owns the task's fence state, handles the conflict ([`ShardTask::conflict`]) once no entry
    /// runs; the entry stays pending.
    Fenced(&'static str, Fenced),
}

impl ShardTask {
    /// Handles `entries` in order. When every entry finished, their ids wait in the ack buffer for the
    /// next read's round trip; otherwise (revoked, stopped, lease ended) what finished is acked
    /// now, in one fenced `XACK`. Returns whether every entry finished.
    pub(super) async fn handle_batch(
        &mut self,
        token: &FenceToken,
        entries: Vec<ShardEntry>,
    ) -> Result<bool, DataPlaneError> {
        if let Some(first) = entries.first() {
            self.ctx.options.emit(ListenerEvent::Read {
                member: self.ctx.member_id.to_string(),
                shard: self.shard,
                count: entries.len(),
                first_id: first.id.clone(),
            });
        }
        // A batch listener's entries go to the batch path (`poller/batch.rs`) as one batch, in
        // order: `ordering` does not apply to it (docs/design.md §14.2).
        if let AnyHandler::Batch(handler) = &self.ctx.handler {
            let handler = handler.clone();
            return self.handle_as_batch(token, entries, handler).await;
        }
        if self.ctx.options.ordering != Ordering::Shard {
            // Several entries at once, by key or in any order ([`super::lanes`]).
            return self.handle_lanes(token, entries).await;
        }
        let mut finished = Vec::with_capacity(entries.len());
        let mut complete = true;
        for entry in entries {
            // Paused: the entries not started stay pending (read again from `0` on resume).
            if self.done() || !self.still_holds(token) || self.paused() {
                complete = false;
                break;
            }
            match self.handle_entry(token, &entry).await? {
                Outcome::Ack => finished.push(entry.id),
                Outcome::Abandon => {
                    complete = false;
                    break;
                }
                Outcome::Fenced(op, fenced) => {
                    self.conflict(op, fenced, token).await;
                    complete = false;
                    break;
                }
            }
        }
        self.settle_read(token, finished, complete).await
    }

    /// docs/design.md §8.8, outcomes: retries in place with backoff, dead letters, cancellation.
    ///
    /// Every attempt shares the entry's fields (`Arc`): the entry may be trimmed from the stream
    /// while it is retried, and its retries and dead letter must still have its body.
    ///
    /// Takes `&self`: several entries of a shard run at once with `ordering = "key"` or
    /// `"none"` ([`super::lanes`]), each through this same path. Its few Redis calls (attempt
    /// counts, dead letters: off the path of a first delivery that succeeds) use a copy of the
    /// shard client on the same connection.
    pub(super) async fn handle_entry(
        &self,
        token: &FenceToken,
        entry: &ShardEntry,
    ) -> Result<Outcome, DataPlaneError> {
        let limits = Limits::of(&self.ctx.options);
        let counted = match self.admit(token, entry, limits).await? {
            Admission::Finished => return Ok(Outcome::Ack),
            Admission::Fenced(op, fenced) => return Ok(Outcome::Fenced(op, fenced)),
            Admission::Ready { counted } => counted,
        };
        let outcome = self.attempts(token, entry, limits).await?;
        if counted && matches!(outcome, Outcome::Ack) {
            self.forget_attempts(entry).await;
        }
        Ok(outcome)
    }

    /// What `entry`'s status and attempt count say before any handler attempt (docs/design.md
    /// §8.9): trimmed (acked), too large or over `max_deliveries` (dead-lettered), or ready to
    /// handle, its attempts counted in Redis when the policy says so. Shared by the batch path.
    pub(super) async fn admit(
        &self,
        token: &FenceToken,
        entry: &ShardEntry,
        limits: Limits,
    ) -> Result<Admission, DataPlaneError> {
        match entry.status {
            EntryStatus::Present => {}
            EntryStatus::Trimmed => {
                tracing::warn!(entry = %entry.id, "entry trimmed while pending: acked without handling");
                // It may have been counted by a process that died in its handler (only ever a
                // re-delivered entry: a first delivery is never counted).
                if entry.delivery_count > 1 {
                    self.forget_attempts(entry).await;
                }
                return Ok(Admission::Finished);
            }
            EntryStatus::TooLarge { bytes } => {
                let error = format!("entry of {bytes} bytes is over the read limit");
                self.dead_letter(entry, DeadLetterReason::TooLarge, &error, 0)
                    .await?;
                // Counted by a process with a larger limit (a rolling change of it), maybe.
                if entry.delivery_count > 1 {
                    self.forget_attempts(entry).await;
                }
                return Ok(Admission::Finished);
            }
        }
        // Counted in Redis just before the first attempt of this delivery
        // ([`Limits::counts_first_deliveries`] says when).
        let counted = limits.counts_attempts(entry.delivery_count);
        if counted {
            let attempts = match self
                .client
                .clone()
                .count_attempt(self.shard, token, &entry.id)
                .await?
            {
                Ok(attempts) => attempts,
                Err(fenced) => return Ok(Admission::Fenced("attempt", fenced)),
            };
            if limits.over_max_deliveries(attempts) {
                self.dead_letter(
                    entry,
                    DeadLetterReason::MaxDeliveries,
                    MAX_DELIVERIES_ERROR,
                    0,
                )
                .await?;
                self.forget_attempts(entry).await;
                return Ok(Admission::Finished);
            }
        }
        Ok(Admission::Ready { counted })
    }

    /// The handler attempts of one delivery of `entry`: up to `max_attempts`, in place, with
    /// growing backoff; a dead letter when they are used up or the error says so.
    async fn attempts(
        &self,
        token: &FenceToken,
        entry: &ShardEntry,
        limits: Limits,
    ) -> Result<Outcome, DataPlaneError> {
        // A shard pause (`pause_shard`) is no failed attempt: the same attempt number runs again.
        let mut attempt = 1;
        while attempt <= limits.max_attempts {
            let delivery = self.delivery(token, entry, attempt);
            let (ran, started) = self.run_handler(delivery).await;
            let (error, cause) = match ran {
                Attempt::Ok => {
                    self.ctx
                        .metrics
                        .handler_attempt(HandlerOutcome::Ok, started);
                    self.ctx.metrics.handled();
                    return Ok(Outcome::Ack);
                }
                Attempt::Cancelled => return Ok(Outcome::Abandon),
                Attempt::Failed(error, cause) => (error, cause),
            };
            // Draining: no further retries; the entry stays pending for the next owner.
            let draining = self.revoke.is_cancelled();
            let verdict = limits.after_failure(&error, attempt, draining);
            self.ctx
                .metrics
                .handler_attempt(failed_outcome(&error, cause, &verdict), started);
            match verdict {
                Verdict::DeadLetter { reason } => {
                    // The text first: a `Chain` (a plain `dyn Error` reference) is not `Sync`.
                    let text = Chain(&error).to_string();
                    self.dead_letter(entry, reason, &text, attempt).await?;
                    return Ok(Outcome::Ack);
                }
                Verdict::Abandon => return Ok(Outcome::Abandon),
                Verdict::PauseShard { duration } => {
                    tracing::info!(entry = %entry.id, attempt, ?duration, error = %Chain(&error), "handler paused the shard; the entry is tried again after the pause");
                    self.pause_shard_for(duration);
                    self.wait_while_paused().await;
                    // Not a failed attempt: the same number again.
                    attempt -= 1;
                }
                Verdict::Retry { backoff } => {
                    self.ctx.metrics.retry();
                    tracing::debug!(entry = %entry.id, attempt, error = %Chain(&error), "handler failed; retrying in place");
                    self.pause(backoff).await;
                    // Another entry of the shard (a lane: `ordering = "key"` or `"none"`) may
                    // have paused it meanwhile (`pause_shard`): no attempt before that pause
                    // ends (a member pause is checked below).
                    if !self.ctx.shared.is_paused() {
                        self.wait_while_paused().await;
                    }
                }
            }
            // The lease may have lapsed during the backoff (heartbeats failing): no attempt
            // without it, or the shard's next owner and this one could run the entry at once.
            // A pause of the member leaves the entry pending, as the entries not started.
            if self.done() || !self.may_finish() || self.ctx.shared.is_paused() {
                return Ok(Outcome::Abandon);
            }
            attempt += 1;
        }
        Ok(Outcome::Abandon)
    }

    /// The delivery of `entry` for handler attempt number `attempt` (from 1) of this delivery.
    pub(super) fn delivery(
        &self,
        token: &FenceToken,
        entry: &ShardEntry,
        attempt: u32,
    ) -> Delivery {
        let mut metadata = Metadata::new(
            &self.shard_key,
            self.shard,
            entry.id.clone(),
            &entry.fields,
            &self.ctx.member_id,
            token.member_epoch,
        );
        (metadata.delivery_count, metadata.attempt) = (entry.delivery_count, attempt);
        metadata.ownership = self.ownership.clone();
        Delivery {
            metadata,
            fields: entry.fields.clone(),
        }
    }

    /// Removes `entry`'s attempt count once it is finished (handled or dead-lettered), before
    /// its ack: if the ack is then lost, the entry comes back with a fresh count, which is right
    /// (its handler did not kill the process). A failure leaves a stale field, logged.
    ///
    /// Only while the task may still finish (the `HDEL` is not fenced): a stopped task whose
    /// handler returned late (it ignored cancellation) acks nothing, and the shard's next tenure
    /// may have counted its own attempt meanwhile; the count stays, this attempt in it.
    pub(super) async fn forget_attempts(&self, entry: &ShardEntry) {
        if !self.may_finish() {
            return;
        }
        if let Err(error) = self
            .client
            .clone()
            .forget_attempts(self.shard, &[entry.id.as_str()])
            .await
        {
            self.ctx.metrics.redis_error(&error);
            tracing::warn!(entry = %entry.id, error = %crate::report::Chain(&error), "removing the attempt count failed");
        }
    }

    pub(super) async fn dead_letter(
        &self,
        entry: &ShardEntry,
        reason: DeadLetterReason,
        error: &str,
        attempts: u32,
    ) -> Result<(), DataPlaneError> {
        tracing::warn!(entry = %entry.id, %reason, attempts, error, "dead-lettering entry");
        self.client
            .clone()
            .dead_letter(self.shard, entry, reason, error, attempts)
            .await?;
        self.ctx.metrics.dead_lettered(reason);
        Ok(())
    }
}

/// The metrics' `outcome` of a failed attempt: a timeout or a panic by its cause, a decode
/// error as such, any other error by what the policy decided (a drain's abandon is a retry: the
/// next owner tries again).
pub(super) fn failed_outcome(
    error: &HandlerError,
    cause: Cause,
    verdict: &Verdict,
) -> HandlerOutcome {
    match (cause, error, verdict) {
        (Cause::Timeout, ..) => HandlerOutcome::Timeout,
        (Cause::Panic, ..) => HandlerOutcome::Panic,
        (_, HandlerError::Decode(_), _) => HandlerOutcome::DecodeError,
        (_, _, Verdict::DeadLetter { .. }) => HandlerOutcome::DeadLetter,
        (_, _, Verdict::Retry { .. } | Verdict::Abandon) => HandlerOutcome::Retry,
        (_, _, Verdict::PauseShard { .. }) => HandlerOutcome::Pause,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_timeout_or_a_panic_is_its_own_outcome_whatever_the_verdict() {
        let retry = Verdict::Retry {
            backoff: Duration::from_millis(1),
        };
        let dead = Verdict::DeadLetter {
            reason: DeadLetterReason::Handler,
        };
        let error = HandlerError::retryable("x");
        for verdict in [&retry, &dead, &Verdict::Abandon] {
            assert_eq!(
                failed_outcome(&error, Cause::Timeout, verdict),
                HandlerOutcome::Timeout
            );
            assert_eq!(
                failed_outcome(&error, Cause::Panic, verdict),
                HandlerOutcome::Panic
            );
        }
    }

    #[test]
    fn a_returned_error_is_labelled_by_its_kind_and_the_verdict() {
        let retry = Verdict::Retry {
            backoff: Duration::from_millis(1),
        };
        let decode = Verdict::DeadLetter {
            reason: DeadLetterReason::Decode,
        };
        let fatal = Verdict::DeadLetter {
            reason: DeadLetterReason::NonRetryable,
        };
        assert_eq!(
            failed_outcome(&HandlerError::Decode("x".into()), Cause::Returned, &decode),
            HandlerOutcome::DecodeError
        );
        assert_eq!(
            failed_outcome(&HandlerError::non_retryable("x"), Cause::Returned, &fatal),
            HandlerOutcome::DeadLetter
        );
        let error = HandlerError::retryable("x");
        assert_eq!(
            failed_outcome(&error, Cause::Returned, &retry),
            HandlerOutcome::Retry
        );
        assert_eq!(
            failed_outcome(&error, Cause::Returned, &Verdict::Abandon),
            HandlerOutcome::Retry,
            "a drain leaves it to the next owner"
        );
    }
}
