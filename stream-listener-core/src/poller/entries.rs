//! Handling entries (docs/design.md §8.8 outcomes, §8.9 poison entries): a batch in order, each
//! entry by its status (present, trimmed, too large), its attempts counted across deliveries
//! when the policy says so ([`super::attempt`]), retried in place, dead-lettered or left pending.

use super::ShardTask;
use super::attempt::{Limits, Verdict};
use super::handler_run::{Attempt, Cause};
use crate::dataplane::{DataPlaneError, DeadLetterReason, EntryStatus, ShardEntry};
use crate::fence::FenceToken;
use crate::handler::{Delivery, HandlerError, Metadata};
use crate::report::Chain;
use crate::runtime::ListenerEvent;
use crate::telemetry::HandlerOutcome;

/// The `error` field of a `max-deliveries` dead letter.
const MAX_DELIVERIES_ERROR: &str = "max_deliveries handler attempts did not finish";

/// What became of one entry.
enum Outcome {
    /// Handled, dead-lettered or trimmed: ack it.
    Ack,
    /// Not finished (drain, stop, lease end): leave it pending for the next owner.
    Abandon,
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
        let mut finished = Vec::with_capacity(entries.len());
        let mut complete = true;
        for mut entry in entries {
            // Paused: the entries not started stay pending (read again from `0` on resume).
            if self.done() || !self.still_holds(token) || self.paused() {
                complete = false;
                break;
            }
            match self.handle_entry(token, &mut entry).await? {
                Outcome::Ack => finished.push(entry.id),
                Outcome::Abandon => {
                    complete = false;
                    break;
                }
            }
        }
        if complete {
            // Acked with the next read (or on its own if something else comes first).
            self.hold_acks(token, finished).await;
            return Ok(true);
        }
        self.ack(token, &finished).await?;
        Ok(false)
    }

    /// docs/design.md §8.8, outcomes: retries in place with backoff, dead letters, cancellation.
    ///
    /// Every attempt shares the entry's fields (`Arc`): the entry may be trimmed from the stream
    /// while it is retried, and its retries and dead letter must still have its body.
    async fn handle_entry(
        &mut self,
        token: &FenceToken,
        entry: &mut ShardEntry,
    ) -> Result<Outcome, DataPlaneError> {
        let limits = Limits::of(&self.ctx.options);
        match entry.status {
            EntryStatus::Present => {}
            EntryStatus::Trimmed => {
                tracing::warn!(entry = %entry.id, "entry trimmed while pending: acked without handling");
                // It may have been counted by a process that died in its handler (only ever a
                // re-delivered entry: a first delivery is never counted).
                if entry.delivery_count > 1 {
                    self.forget_attempts(entry).await;
                }
                return Ok(Outcome::Ack);
            }
            EntryStatus::TooLarge { bytes } => {
                let error = format!("entry of {bytes} bytes is over the read limit");
                self.dead_letter(entry, DeadLetterReason::TooLarge, &error, 0)
                    .await?;
                // Counted by a process with a larger limit (a rolling change of it), maybe.
                if entry.delivery_count > 1 {
                    self.forget_attempts(entry).await;
                }
                return Ok(Outcome::Ack);
            }
        }
        // Counted in Redis just before the first attempt of this delivery
        // ([`Limits::counts_first_deliveries`] says when).
        let counted = limits.counts_attempts(entry.delivery_count);
        if counted {
            let attempts = match self
                .client
                .count_attempt(self.shard, token, &entry.id)
                .await?
            {
                Ok(attempts) => attempts,
                Err(fenced) => {
                    self.conflict("attempt", fenced, token).await;
                    return Ok(Outcome::Abandon);
                }
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
                return Ok(Outcome::Ack);
            }
        }
        let outcome = self.attempts(token, entry, limits).await?;
        if counted && matches!(outcome, Outcome::Ack) {
            self.forget_attempts(entry).await;
        }
        Ok(outcome)
    }

    /// The handler attempts of one delivery of `entry`: up to `max_attempts`, in place, with
    /// growing backoff; a dead letter when they are used up or the error says so.
    async fn attempts(
        &mut self,
        token: &FenceToken,
        entry: &ShardEntry,
        limits: Limits,
    ) -> Result<Outcome, DataPlaneError> {
        // A shard pause (`pause_shard`) is no failed attempt: the same attempt number runs again.
        let mut attempt = 1;
        while attempt <= limits.max_attempts {
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
            let delivery = Delivery {
                metadata,
                fields: entry.fields.clone(),
            };
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

    /// Removes `entry`'s attempt count once it is finished (handled or dead-lettered), before
    /// its ack: if the ack is then lost, the entry comes back with a fresh count, which is right
    /// (its handler did not kill the process). A failure leaves a stale field, logged.
    ///
    /// Only while the task may still finish (the `HDEL` is not fenced): a stopped task whose
    /// handler returned late (it ignored cancellation) acks nothing, and the shard's next tenure
    /// may have counted its own attempt meanwhile; the count stays, this attempt in it.
    async fn forget_attempts(&mut self, entry: &ShardEntry) {
        if !self.may_finish() {
            return;
        }
        if let Err(error) = self
            .client
            .forget_attempts(self.shard, &[entry.id.as_str()])
            .await
        {
            self.ctx.metrics.redis_error(&error);
            tracing::warn!(entry = %entry.id, error = %crate::report::Chain(&error), "removing the attempt count failed");
        }
    }

    async fn dead_letter(
        &mut self,
        entry: &ShardEntry,
        reason: DeadLetterReason,
        error: &str,
        attempts: u32,
    ) -> Result<(), DataPlaneError> {
        tracing::warn!(entry = %entry.id, ?reason, attempts, error, "dead-lettering entry");
        self.client
            .dead_letter(self.shard, entry, reason, error, attempts)
            .await?;
        self.ctx.metrics.dead_lettered(reason);
        Ok(())
    }
}

/// The metrics' `outcome` of a failed attempt: a timeout or a panic by its cause, a decode
/// error as such, any other error by what the policy decided (a drain's abandon is a retry: the
/// next owner tries again).
fn failed_outcome(error: &HandlerError, cause: Cause, verdict: &Verdict) -> HandlerOutcome {
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
