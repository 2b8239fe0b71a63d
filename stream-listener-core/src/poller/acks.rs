//! The deferred acks of a shard task (docs/design.md §8.7): entries handled under a token wait
//! in an [`AckBuffer`] and are acked with the next read (one round trip for both), or on their
//! own before anything else (a claim, a pending read, a raise, a wait, the task's end).

use std::time::Instant;

use super::{ERROR_PAUSE, Phase, ShardTask};
use crate::dataplane::DataPlaneError;
use crate::fence::FenceToken;

/// Ids of entries handled under one token and not acked yet.
#[derive(Debug, Default)]
pub(super) struct AckBuffer {
    held: Option<(FenceToken, Vec<String>)>,
}

impl AckBuffer {
    /// Holds `ids`, handled under `token`, with those already held under it. Ids held under
    /// another token are let go: the caller flushes them first, and when that failed they stay
    /// in this consumer's pending list and the shard went back to it (handled or acked again,
    /// never lost).
    pub(super) fn hold(&mut self, token: &FenceToken, ids: Vec<String>) {
        if ids.is_empty() {
            return;
        }
        match &mut self.held {
            Some((held, held_ids)) if held == token => held_ids.extend(ids),
            _ => self.held = Some((token.clone(), ids)),
        }
    }

    /// Whether ids handled under a token other than `token` are held.
    pub(super) fn holds_other_than(&self, token: &FenceToken) -> bool {
        self.held.as_ref().is_some_and(|(held, _)| held != token)
    }

    /// The ids held under `token`, no longer held; none when they are under another token (those
    /// stay held).
    pub(super) fn take_for(&mut self, token: &FenceToken) -> Vec<String> {
        match self.held.take() {
            Some((held, ids)) if &held == token => ids,
            other => {
                self.held = other;
                Vec::new()
            }
        }
    }

    /// Everything held, with its token, no longer held.
    pub(super) fn take(&mut self) -> Option<(FenceToken, Vec<String>)> {
        self.held.take()
    }

    /// Whether nothing is held.
    pub(super) fn is_empty(&self) -> bool {
        self.held.is_none()
    }
}

/// Tries of the last ack of an ownership after a Redis failure (docs/design.md §13.3).
const FINAL_ACK_TRIES: u32 = 3;

impl ShardTask {
    /// Acks the entries handled but not yet acked, on their own. When they cannot be acked now
    /// they stay in this consumer's pending list and the shard goes back to it: they are acked
    /// later or handled again, never left behind. After a Redis failure the ids stay held too,
    /// and the ack is tried again after a pause (acking twice is harmless; handling twice is
    /// what at-least-once allows but should not cost a connection blip); when the lease passed
    /// or the fence refused, they are let go (the next owner claims them).
    /// Returns false when ids were held and not acked.
    pub(super) async fn flush_acks(&mut self) -> bool {
        let Some((token, ids)) = self.acks.take() else {
            return true;
        };
        let acked = match self.ack(&token, &ids).await {
            Ok(acked) => acked,
            Err(error) => {
                self.ctx.metrics.redis_error(&error);
                tracing::warn!(error = %crate::report::Chain(&error), "acking handled entries failed; retrying");
                self.acks.hold(&token, ids);
                self.pause(ERROR_PAUSE).await;
                false
            }
        };
        if !acked && self.phase != Phase::Claim {
            self.phase = Phase::Pending("0".into());
        }
        acked
    }

    /// The last ack of an ownership, at the task's end. A drain's pauses are over at once (its
    /// token is cancelled), so after a Redis failure the ack is tried again here, up to
    /// [`FINAL_ACK_TRIES`] times in all, while the lease holds and the task is not stopped.
    /// Returns whether every handled entry was acked; when not, the end hook is `on_lost` and the
    /// entries stay pending for the next owner (docs/design.md §13.3).
    pub(super) async fn flush_final_acks(&mut self) -> bool {
        for tries in 1..=FINAL_ACK_TRIES {
            if self.flush_acks().await {
                return true;
            }
            // Let go (the lease passed or the fence refused), the last try, or a stop.
            let lease_valid = self.ctx.shared.lock().lease_valid(Instant::now());
            if self.acks.is_empty() || tries == FINAL_ACK_TRIES || !lease_valid {
                return false;
            }
            tokio::select! {
                _ = tokio::time::sleep(ERROR_PAUSE) => {}
                _ = self.stop.cancelled() => return false,
            }
        }
        false
    }

    /// The ids handled under `token` and not yet acked, to ack with the next read (none when
    /// they were under another one: those are acked on their own first).
    pub(super) async fn take_acks_for(&mut self, token: &FenceToken) -> Vec<String> {
        if self.acks.holds_other_than(token) {
            self.flush_acks().await;
        }
        // Still held under the other token when that ack failed: tried again first next time.
        self.acks.take_for(token)
    }

    /// The end of handling one read, in every mode (in order, key lanes, batch): when
    /// `complete` (every entry finished), the `finished` ids wait in the ack buffer for the
    /// next read's round trip ([`Self::hold_acks`]); otherwise (revoked, stopped, lease ended,
    /// paused) they are acked now, in one fenced `XACK`. Returns `complete`.
    ///
    /// # Errors
    /// The ack's Redis failure, when not complete.
    pub(super) async fn settle_read(
        &mut self,
        token: &FenceToken,
        finished: Vec<String>,
        complete: bool,
    ) -> Result<bool, DataPlaneError> {
        if complete {
            self.hold_acks(token, finished).await;
        } else {
            self.ack(token, &finished).await?;
        }
        Ok(complete)
    }

    /// Holds `ids`, finished under `token`, for the next read's round trip (or an ack on their
    /// own if something else comes first); ids held under another token are acked first.
    pub(super) async fn hold_acks(&mut self, token: &FenceToken, ids: Vec<String>) {
        if !ids.is_empty() && self.acks.holds_other_than(token) {
            self.flush_acks().await;
        }
        self.acks.hold(token, ids);
    }

    pub(super) fn count_handled(&self, acked: usize) {
        self.ctx
            .shared
            .handled
            .fetch_add(acked as u64, std::sync::atomic::Ordering::Relaxed);
    }

    /// Acks `ids` through the fence. Returns whether they are acked; when not (lease passed,
    /// fence refused, Redis failed), they stay in this consumer's pending list and the shard goes
    /// back to it, so finished work is acked later or handled again — never left behind.
    pub(super) async fn ack(
        &mut self,
        token: &FenceToken,
        ids: &[String],
    ) -> Result<bool, DataPlaneError> {
        if ids.is_empty() {
            return Ok(true);
        }
        if !self.may_finish() {
            return Ok(false); // no ack without a valid lease and assignment (or drain)
        }
        match self.client.ack(self.shard, token, ids).await? {
            Ok(_) => {
                self.count_handled(ids.len());
                Ok(true)
            }
            Err(fenced) => {
                self.conflict("ack", fenced, token).await;
                Ok(false)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(member_epoch: i64) -> FenceToken {
        FenceToken {
            incarnation: 1,
            member_epoch,
            member_id: "m".into(),
            process_id: "p".into(),
        }
    }

    fn ids(ids: &[&str]) -> Vec<String> {
        ids.iter().map(|&id| id.to_owned()).collect()
    }

    #[test]
    fn ids_held_under_one_token_are_taken_together() {
        let mut buffer = AckBuffer::default();
        buffer.hold(&token(1), ids(&["1-0", "2-0"]));
        buffer.hold(&token(1), ids(&["3-0"]));
        buffer.hold(&token(1), Vec::new());
        assert!(!buffer.holds_other_than(&token(1)));
        assert_eq!(buffer.take_for(&token(1)), ids(&["1-0", "2-0", "3-0"]));
        assert!(buffer.take().is_none(), "taken ids are no longer held");
    }

    #[test]
    fn ids_under_another_token_stay_held_until_taken_as_a_whole() {
        let mut buffer = AckBuffer::default();
        buffer.hold(&token(1), ids(&["1-0"]));
        assert!(buffer.holds_other_than(&token(2)));
        assert!(buffer.take_for(&token(2)).is_empty());
        assert_eq!(buffer.take(), Some((token(1), ids(&["1-0"]))));
        assert!(!buffer.holds_other_than(&token(2)), "nothing held");
    }

    #[test]
    fn holding_under_a_new_token_lets_the_old_ids_go() {
        let mut buffer = AckBuffer::default();
        buffer.hold(&token(1), ids(&["1-0"]));
        buffer.hold(&token(2), Vec::new());
        assert!(
            buffer.holds_other_than(&token(2)),
            "nothing new: the old ids stay"
        );
        buffer.hold(&token(2), ids(&["2-0"]));
        assert_eq!(buffer.take(), Some((token(2), ids(&["2-0"]))));
    }
}
