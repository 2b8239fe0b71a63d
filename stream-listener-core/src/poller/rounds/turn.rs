//! A shard's turn in its member's next read round, and the rule that it is held only while the
//! shard task does not wait (docs/design.md §8.7).
//!
//! The turn lives in the task's [`TurnSlot`], and the task runs inside
//! [`TurnSlot::release_while_waiting`]: whenever the task's future returns `Pending` (it waits for
//! a worker, a handler, a backoff, a round trip of its own, the lease, new entries, or anything
//! else) the turn is dropped before the task is parked. No code path can forget to let the round
//! go: a task can only hold its siblings up while it runs.

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};

use super::ReadRounds;
use crate::model::ShardIndex;

/// A shard's place in the next round: while it lives, the round waits for this shard. Dropping
/// it lets the round go without the shard.
pub(crate) struct Turn {
    rounds: Option<Arc<ReadRounds>>,
    shard: ShardIndex,
}

impl Drop for Turn {
    fn drop(&mut self) {
        if let Some(rounds) = self.rounds.take() {
            let mut state = rounds.lock();
            state.expected.retain(|&s| s != self.shard);
            state.hand_off(&rounds);
        }
    }
}

impl Turn {
    /// `shard`'s turn in the next round of `rounds` (the caller lists it as expected).
    pub(super) fn new(rounds: Arc<ReadRounds>, shard: ShardIndex) -> Self {
        Turn {
            rounds: Some(rounds),
            shard,
        }
    }

    /// The shard, the turn given back without the lock being taken (the caller holds it).
    pub(super) fn give_back(mut self) -> ShardIndex {
        self.rounds = None;
        self.shard
    }
}

/// Where a shard task keeps its turn between a round and its next request.
#[derive(Default)]
pub(crate) struct TurnSlot(Mutex<Option<Turn>>);

impl TurnSlot {
    /// Keeps `turn` (the one a round just gave) until the next request or the next wait.
    pub(crate) fn hold(&self, turn: Option<Turn>) {
        *self.lock() = turn;
    }

    /// The turn, to give back with the next request.
    pub(crate) fn take(&self) -> Option<Turn> {
        self.lock().take()
    }

    /// Runs `future`, dropping the held turn every time it waits (returns `Pending`).
    pub(crate) async fn release_while_waiting<F: Future>(&self, future: F) -> F::Output {
        let mut future = std::pin::pin!(future);
        std::future::poll_fn(|cx| {
            let poll = future.as_mut().poll(cx);
            if poll.is_pending() {
                // Dropped outside the lock: a dropped turn may hand the round off.
                let turn = self.take();
                drop(turn);
            }
            poll
        })
        .await
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Turn>> {
        // Only the shard's own task uses the slot; nothing under the lock can panic.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(all(test, feature = "testing"))]
mod tests {
    use std::task::Poll;

    use super::*;

    /// A future that waits once, then finishes.
    fn waits_once() -> impl Future<Output = ()> {
        let mut waited = false;
        std::future::poll_fn(move |cx| {
            if waited {
                Poll::Ready(())
            } else {
                waited = true;
                cx.waker().wake_by_ref();
                Poll::Pending
            }
        })
    }

    /// A turn held while the task runs survives; the first wait drops it, and a turn taken
    /// before the wait is the caller's (given back with a request).
    #[tokio::test]
    async fn the_turn_is_dropped_when_the_task_waits() {
        let rounds = super::super::tests::rounds_of(1);
        let slot = TurnSlot::default();
        let expect = |shard| {
            rounds.lock().expected.push(shard);
            Turn::new(rounds.clone(), shard)
        };
        slot.release_while_waiting(async {
            slot.hold(Some(expect(0)));
            assert_eq!(rounds.lock().expected, vec![0], "held while running");
            waits_once().await;
            assert!(slot.take().is_none(), "dropped by the wait");
            assert!(rounds.lock().expected.is_empty());
            slot.hold(Some(expect(1)));
            let taken = slot.take();
            waits_once().await;
            assert_eq!(
                rounds.lock().expected,
                vec![1],
                "a taken turn is not the slot's"
            );
            drop(taken);
            assert!(rounds.lock().expected.is_empty());
        })
        .await;
    }
}
