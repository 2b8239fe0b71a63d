//! One handler attempt (docs/design.md §7.3, §8.8): on one of the member's workers (FIFO), under
//! `handler_timeout`, with a panic caught as a failed attempt, cancelled by a stop or the end of
//! the lease.

use std::panic::AssertUnwindSafe;

use futures_util::FutureExt;
use tracing::Instrument;

use std::sync::atomic::{AtomicU32, Ordering as AtomicOrdering};

use super::ShardTask;
use crate::batch::AnyHandler;
use crate::handler::{Delivery, HandlerError};
use crate::runtime::Ordering;
use crate::telemetry::Stopwatch;
use crate::trace_context;

/// What became of one handler attempt.
pub(super) enum Attempt {
    /// The handler returned `Ok`.
    Ok,
    /// The handler returned an error, panicked or timed out (which of them: the [`Cause`]; the
    /// policy looks only at the error, so a panic and a timeout stay retryable errors).
    Failed(HandlerError, Cause),
    /// Stopped (a fencing status, the member's end) or the lease ended: the entry is left
    /// pending.
    Cancelled,
}

/// How one run of a handler future ended ([`ShardTask::run_attempt`]).
pub(super) enum Ran<O> {
    /// It returned `O`.
    Done(O),
    /// It panicked (the payload).
    Panicked(Box<dyn std::any::Any + Send>),
    /// It ran past `handler_timeout`.
    TimedOut,
    /// Stopped (a fencing status, the member's end) or the lease ended.
    Cancelled,
}

/// One attempt in the member's count of attempts outside the worker pool, while it lives.
struct InFlight<'a>(&'a AtomicU32);

impl<'a> InFlight<'a> {
    fn enter(count: &'a AtomicU32) -> Self {
        count.fetch_add(1, AtomicOrdering::Relaxed);
        InFlight(count)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, AtomicOrdering::Relaxed);
    }
}

/// Why an attempt failed, for the metrics' `outcome` (docs/design.md §13.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Cause {
    /// The handler returned the error.
    Returned,
    /// The attempt ran past `handler_timeout`.
    Timeout,
    /// The handler panicked.
    Panic,
}

/// The attempt a finished handler future (panics caught) stands for.
fn attempt_outcome(
    outcome: Result<Result<(), HandlerError>, Box<dyn std::any::Any + Send>>,
) -> Attempt {
    match outcome {
        Ok(Ok(())) => Attempt::Ok,
        Ok(Err(error)) => Attempt::Failed(error, Cause::Returned),
        Err(panic) => Attempt::Failed(
            HandlerError::retryable(format!(
                "handler panicked: {}",
                crate::report::panic_text(panic.as_ref())
            )),
            Cause::Panic,
        ),
    }
}

impl ShardTask {
    /// The span the handler attempt runs in (docs/design.md §13.4): `handle`, at info level,
    /// with the stream prefix, group, member id, shard, member epoch, entry id and attempt, so
    /// that a handler's own logs and spans say which entry they are about. With the
    /// `opentelemetry` feature its parent is the producer's trace context from the entry's
    /// `traceparent` header. Disabled (next to free) when no subscriber wants it.
    fn attempt_span(&self, delivery: &Delivery) -> tracing::Span {
        let span = tracing::info_span!(
            "handle",
            stream = self.ctx.stream.prefix(),
            group = %self.ctx.group,
            member = %delivery.member_id,
            shard = delivery.shard,
            member_epoch = delivery.member_epoch,
            entry_id = %delivery.entry_id,
            attempt = delivery.attempt,
        );
        trace_context::set_parent(&span, &delivery.fields);
        span
    }

    /// One handler attempt under `handler_timeout`, cancelled at once by a stop or when the lease
    /// ends (fail closed); a drain lets it finish. With it, when the handler started (after
    /// the wait for a worker: the metrics time the handler, not the queue).
    pub(super) async fn run_handler(&self, delivery: Delivery) -> (Attempt, Stopwatch) {
        let (ran, started) = self
            .run_attempt(|| {
                let span = self.attempt_span(&delivery);
                match &self.ctx.handler {
                    AnyHandler::Entry(handler) => handler.handle(delivery).instrument(span),
                    // Batch listeners never reach the per-entry path (`handle_batch` dispatches
                    // them to `poller/batch.rs`); an error, not a panic, were it ever to happen.
                    AnyHandler::Batch(_) => {
                        let future: crate::handler::HandlerFuture = Box::pin(async {
                            Err(HandlerError::non_retryable(
                                "a batch listener's entry reached the per-entry handler path",
                            ))
                        });
                        future.instrument(span)
                    }
                }
            })
            .await;
        let attempt = match ran {
            Ran::Done(outcome) => attempt_outcome(Ok(outcome)),
            Ran::Panicked(panic) => attempt_outcome(Err(panic)),
            Ran::TimedOut => Attempt::Failed(self.timed_out(), Cause::Timeout),
            Ran::Cancelled => Attempt::Cancelled,
        };
        (attempt, started)
    }

    /// The error of an attempt past `handler_timeout`.
    pub(super) fn timed_out(&self) -> HandlerError {
        HandlerError::retryable(format!(
            "handler timed out after {:?}",
            self.ctx.options.handler_timeout
        ))
    }

    /// Runs the future `make` returns (called once a worker is taken) as one handler attempt:
    /// on one of the member's workers, under `handler_timeout`, cancelled by a stop or the
    /// lease's end, a panic caught. Shared by the per-entry and the batch path.
    pub(super) async fn run_attempt<O, F>(&self, make: impl FnOnce() -> F) -> (Ran<O>, Stopwatch)
    where
        F: std::future::Future<Output = O>,
    {
        // One of the member's workers per attempt, FIFO: shards waiting for a worker are served
        // in turn, and no worker is held through a backoff or an ack. A free worker is taken
        // at once (`try_acquire` never jumps the queue: released permits go to waiters first).
        // The permit borrows the member's pool (no reference count touched per entry). Waiting
        // for a worker gives up the shard's turn in the read round (as every wait does).
        //
        // With `ordering = "key"` or `"none"` no worker is taken: the shard's attempts are
        // bounded by `max_in_flight` ([`super::lanes`]), and a pool of one (the default) would
        // run them one at a time. They are counted for `activeConsumerWorkers` instead
        // (docs/design.md §14.3).
        // A batch listener's shard runs one batch at a time whatever its `ordering`: it takes a
        // worker.
        let one_at_a_time = self.ctx.options.ordering == Ordering::Shard
            || matches!(self.ctx.handler, AnyHandler::Batch(_));
        let (_permit, _in_flight) = if one_at_a_time {
            let workers = &self.ctx.workers;
            let permit = match workers.try_acquire() {
                Ok(permit) => permit,
                Err(_) => {
                    let permit = tokio::select! {
                        permit = workers.acquire() => permit.ok(),
                        _ = self.stop.cancelled() => None,
                    };
                    // The wait for a worker may have outlived the lease (or the process was
                    // paused in it).
                    match permit {
                        Some(permit) if self.may_finish() => permit,
                        _ => return (Ran::Cancelled, Stopwatch::start()),
                    }
                }
            };
            (Some(permit), None)
        } else {
            (None, Some(InFlight::enter(&self.ctx.in_flight)))
        };
        let started = Stopwatch::start();
        // Runs in the shard's own task (no spawn per entry); a panic is caught and counts as a
        // failed attempt, also one in the handler function's code before its future (a
        // closure's body, not an `async fn`'s); dropping the future cancels the handler.
        let handler = match std::panic::catch_unwind(AssertUnwindSafe(make)) {
            Ok(handler) => handler,
            Err(panic) => return (Ran::Panicked(panic), started),
        };
        let handler = AssertUnwindSafe(handler).catch_unwind();
        tokio::pin!(handler);
        let done = |outcome: Result<O, Box<dyn std::any::Any + Send>>| match outcome {
            Ok(outcome) => Ran::Done(outcome),
            Err(panic) => Ran::Panicked(panic),
        };
        // Most handlers finish in their first poll: no timer is armed for them. A pending one is
        // polled again below with the task's waker (and the task, waiting, gives up its turn).
        if let Some(outcome) = handler.as_mut().now_or_never() {
            return (done(outcome), started);
        }
        // The timeout runs from the end of the first poll (no clock read for handlers that are
        // done by then; a first poll that blocks the thread cannot be timed out anyway).
        let timeout = tokio::time::sleep(self.ctx.options.handler_timeout);
        tokio::pin!(timeout);
        loop {
            let lease_end = tokio::time::sleep(self.lease_remaining());
            tokio::select! {
                outcome = &mut handler => return (done(outcome), started),
                _ = &mut timeout => return (Ran::TimedOut, started),
                _ = self.stop.cancelled() => return (Ran::Cancelled, started),
                _ = lease_end => {
                    if !self.may_finish() {
                        return (Ran::Cancelled, started);
                    }
                }
            }
        }
    }
}
