//! The attempt policy (docs/design.md §8.8 outcomes, §8.9 poison entries), as pure code: after a
//! failed handler attempt, whether the entry is tried again in place and after what backoff, is
//! dead-lettered, or is left pending; and whether a re-delivered entry has used up
//! `max_deliveries`. The shard task carries the decisions out ([`super::entries`]).

use std::time::Duration;

use crate::dataplane::DeadLetterReason;
use crate::handler::HandlerError;
use crate::runtime::ListenerOptions;

/// Longest backoff between handler attempts (after the first retry).
pub(super) const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// The limits of one listener that the policy applies (copied out of its options: every shard
/// task of every member shares those, and a reference count touched per entry from several
/// cores costs more than these copies).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Limits {
    /// Handler attempts per delivery (`max_attempts`, at least 1).
    pub(super) max_attempts: u32,
    /// Wait before the first retry (`backoff`); doubled for each further one, up to
    /// [`MAX_BACKOFF`].
    pub(super) backoff: Duration,
    /// Handler attempts over all deliveries after which the entry is dead-lettered unhandled
    /// (`max_deliveries`).
    pub(super) max_deliveries: u64,
}

/// What to do after a failed attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Try again in place after `backoff`.
    Retry {
        /// The wait before the next attempt.
        backoff: Duration,
    },
    /// Dead-letter the entry (then ack it).
    DeadLetter {
        /// The reason written with the dead letter.
        reason: DeadLetterReason,
    },
    /// Try no more now: the entry stays pending for the shard's next owner.
    Abandon,
    /// The handler asked to pause the shard (`HandlerError::pause_shard`): start nothing on it
    /// for `duration` (clamped), then try the same entry again with the same attempt number.
    PauseShard {
        /// The pause, within `HandlerError::MIN_SHARD_PAUSE..=MAX_SHARD_PAUSE`.
        duration: Duration,
    },
}

impl Limits {
    /// The limits `options` set.
    pub(super) fn of(options: &ListenerOptions) -> Self {
        Limits {
            max_attempts: options.max_attempts,
            backoff: options.backoff,
            max_deliveries: options.max_deliveries,
        }
    }

    /// After attempt number `attempt` (from 1) failed with `error`. A shard pause asked for is
    /// a [`Verdict::PauseShard`] whatever the attempt (an `Abandon` while draining). A decode or non-retryable
    /// error is dead-lettered at once, and so is any error of the last attempt; otherwise the
    /// entry is retried after `backoff × 2^(attempt − 1)` (the first retry after `backoff`
    /// itself, later ones at most [`MAX_BACKOFF`]), unless the shard is `draining`: a drain
    /// starts no retry, the entry stays pending for the next owner.
    pub(super) fn after_failure(
        &self,
        error: &HandlerError,
        attempt: u32,
        draining: bool,
    ) -> Verdict {
        if let HandlerError::PauseShard { duration } = error {
            // A drain starts nothing more: the entry stays pending for the next owner.
            return match draining {
                true => Verdict::Abandon,
                false => Verdict::PauseShard {
                    duration: clamp_pause(*duration),
                },
            };
        }
        let reason = match error {
            HandlerError::Decode(_) => Some(DeadLetterReason::Decode),
            HandlerError::NonRetryable(_) => Some(DeadLetterReason::NonRetryable),
            _ if attempt >= self.max_attempts => Some(DeadLetterReason::Handler),
            _ => None,
        };
        match reason {
            Some(reason) => Verdict::DeadLetter { reason },
            None if draining => Verdict::Abandon,
            None => Verdict::Retry {
                backoff: self.backoff_after(attempt),
            },
        }
    }

    /// The wait after failed attempt number `attempt` (from 1).
    fn backoff_after(&self, attempt: u32) -> Duration {
        if attempt <= 1 {
            return self.backoff;
        }
        let factor = 2u32.saturating_pow(attempt - 1);
        self.backoff.saturating_mul(factor).min(MAX_BACKOFF)
    }

    /// Whether every delivery's attempts are counted in Redis, first deliveries included.
    ///
    /// `max_deliveries` counts handler attempts, not deliveries: re-reads and handovers of
    /// read-ahead raise the PEL count without any attempt (docs/design.md §8.9). A first
    /// delivery costs nothing; a re-delivered entry's attempts are counted just before its first
    /// attempt here, and its first delivery is assumed to have reached a handler (which may have
    /// killed its process uncounted). With `max_deliveries = 1` that assumption would use up the
    /// one attempt, and an entry handed over unhandled would be dead-lettered without any: there
    /// every delivery is counted (two round trips more per entry, the price of the strictest
    /// setting), and the count is then exact.
    pub(super) fn counts_first_deliveries(&self) -> bool {
        self.max_deliveries <= 1
    }

    /// Whether the attempts on an entry delivered `delivery_count` times are counted before it
    /// is handled.
    pub(super) fn counts_attempts(&self, delivery_count: u64) -> bool {
        self.counts_first_deliveries() || delivery_count > 1
    }

    /// Whether an entry whose attempt count in Redis is `counted` (this delivery's included)
    /// has used up `max_deliveries`: it is then dead-lettered unhandled.
    pub(super) fn over_max_deliveries(&self, counted: u64) -> bool {
        let attempt_number = if self.counts_first_deliveries() {
            counted
        } else {
            // The uncounted first delivery.
            counted.saturating_add(1)
        };
        attempt_number > self.max_deliveries
    }
}

/// A pause asked for by a handler, within `HandlerError::MIN_SHARD_PAUSE..=MAX_SHARD_PAUSE`.
fn clamp_pause(duration: Duration) -> Duration {
    duration.clamp(HandlerError::MIN_SHARD_PAUSE, HandlerError::MAX_SHARD_PAUSE)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        max_attempts: 3,
        backoff: Duration::from_millis(200),
        max_deliveries: 10,
    };

    fn retryable() -> HandlerError {
        HandlerError::retryable("boom")
    }

    fn retry(millis: u64) -> Verdict {
        Verdict::Retry {
            backoff: Duration::from_millis(millis),
        }
    }

    fn dead_letter(reason: DeadLetterReason) -> Verdict {
        Verdict::DeadLetter { reason }
    }

    #[test]
    fn the_options_set_the_limits() {
        let options = ListenerOptions {
            max_attempts: 4,
            backoff: Duration::from_millis(50),
            max_deliveries: 7,
            ..ListenerOptions::default()
        };
        assert_eq!(
            Limits::of(&options),
            Limits {
                max_attempts: 4,
                backoff: Duration::from_millis(50),
                max_deliveries: 7,
            }
        );
    }

    #[test]
    fn a_decode_or_non_retryable_error_is_dead_lettered_at_once_even_while_draining() {
        for draining in [false, true] {
            let decode = HandlerError::Decode("bad json".into());
            assert_eq!(
                LIMITS.after_failure(&decode, 1, draining),
                dead_letter(DeadLetterReason::Decode)
            );
            let fatal = HandlerError::non_retryable("no such order");
            assert_eq!(
                LIMITS.after_failure(&fatal, 1, draining),
                dead_letter(DeadLetterReason::NonRetryable)
            );
        }
    }

    #[test]
    fn the_last_attempt_failing_dead_letters_the_entry_even_while_draining() {
        for draining in [false, true] {
            assert_eq!(
                LIMITS.after_failure(&retryable(), 3, draining),
                dead_letter(DeadLetterReason::Handler)
            );
        }
        let once = Limits {
            max_attempts: 1,
            ..LIMITS
        };
        assert_eq!(
            once.after_failure(&retryable(), 1, false),
            dead_letter(DeadLetterReason::Handler)
        );
    }

    #[test]
    fn a_retryable_error_is_retried_with_a_doubling_backoff() {
        let many = Limits {
            max_attempts: 20,
            ..LIMITS
        };
        assert_eq!(many.after_failure(&retryable(), 1, false), retry(200));
        assert_eq!(many.after_failure(&retryable(), 2, false), retry(400));
        assert_eq!(many.after_failure(&retryable(), 3, false), retry(800));
        assert_eq!(many.after_failure(&retryable(), 8, false), retry(25_600));
        assert_eq!(
            many.after_failure(&retryable(), 9, false),
            retry(30_000),
            "51.2 s capped"
        );
        assert_eq!(many.after_failure(&retryable(), 19, false), retry(30_000));
    }

    #[test]
    fn the_backoff_saturates_instead_of_overflowing() {
        let endless = Limits {
            max_attempts: u32::MAX,
            ..LIMITS
        };
        assert_eq!(
            endless.after_failure(&retryable(), u32::MAX - 1, false),
            retry(30_000)
        );
    }

    #[test]
    fn only_retries_after_the_first_are_capped() {
        let slow = Limits {
            max_attempts: 5,
            backoff: Duration::from_secs(60),
            ..LIMITS
        };
        assert_eq!(slow.after_failure(&retryable(), 1, false), retry(60_000));
        assert_eq!(slow.after_failure(&retryable(), 2, false), retry(30_000));
    }

    #[test]
    fn a_drain_starts_no_retry() {
        assert_eq!(
            LIMITS.after_failure(&retryable(), 1, true),
            Verdict::Abandon
        );
        assert_eq!(
            LIMITS.after_failure(&retryable(), 2, true),
            Verdict::Abandon
        );
    }

    #[test]
    fn only_re_deliveries_are_counted_unless_max_deliveries_is_one() {
        assert!(!LIMITS.counts_first_deliveries());
        assert!(!LIMITS.counts_attempts(1));
        assert!(LIMITS.counts_attempts(2));
        let strictest = Limits {
            max_deliveries: 1,
            ..LIMITS
        };
        assert!(strictest.counts_first_deliveries());
        assert!(strictest.counts_attempts(1));
        assert!(strictest.counts_attempts(2));
    }

    #[test]
    fn the_uncounted_first_delivery_counts_toward_max_deliveries() {
        // Counted 9 of 10 attempts plus the first delivery: this is the tenth, allowed.
        assert!(!LIMITS.over_max_deliveries(9));
        assert!(LIMITS.over_max_deliveries(10));
        assert!(LIMITS.over_max_deliveries(u64::MAX), "saturates");
    }

    #[test]
    fn with_max_deliveries_one_the_count_is_exact() {
        let strictest = Limits {
            max_deliveries: 1,
            ..LIMITS
        };
        assert!(!strictest.over_max_deliveries(1), "the one attempt");
        assert!(strictest.over_max_deliveries(2));
        let none = Limits {
            max_deliveries: 0,
            ..LIMITS
        };
        assert!(none.over_max_deliveries(1));
    }

    #[test]
    fn a_shard_pause_is_neither_a_failure_nor_a_dead_letter_even_on_the_last_attempt() {
        let pause = HandlerError::pause_shard(Duration::from_millis(300));
        let expected = Verdict::PauseShard {
            duration: Duration::from_millis(300),
        };
        assert_eq!(LIMITS.after_failure(&pause, 1, false), expected);
        assert_eq!(LIMITS.after_failure(&pause, 3, false), expected);
        assert_eq!(LIMITS.after_failure(&pause, u32::MAX, false), expected);
        assert_eq!(LIMITS.after_failure(&pause, 1, true), Verdict::Abandon);
    }

    #[test]
    fn a_shard_pause_is_clamped() {
        let short = HandlerError::pause_shard(Duration::ZERO);
        assert_eq!(
            LIMITS.after_failure(&short, 1, false),
            Verdict::PauseShard {
                duration: HandlerError::MIN_SHARD_PAUSE
            }
        );
        let endless = HandlerError::pause_shard(Duration::MAX);
        assert_eq!(
            LIMITS.after_failure(&endless, 1, false),
            Verdict::PauseShard {
                duration: HandlerError::MAX_SHARD_PAUSE
            }
        );
    }
}
