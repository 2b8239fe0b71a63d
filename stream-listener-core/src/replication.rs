//! Waiting for replicas after a write (README "Waiting for replicas", docs/design.md §15.4):
//! `WAIT numreplicas timeout` (<https://redis.io/docs/latest/commands/wait/>) sent on the same
//! connection as the write, in the same pipeline, so it covers that write.
//!
//! `WAIT` blocks the connection it is sent on until enough replicas acknowledged every write sent
//! before it on that connection, or the timeout passed; it then returns how many did. It is not a
//! consensus write: an entry whose `WAIT` timed out is still on the master, and a failover to a
//! replica that lacks it loses it. On a cluster, redis-rs sends a pipeline to the node of its first
//! keyed command, so a `WAIT` after an `XADD` or an ack script runs on that command's node.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use redis::{Cmd, Value};

/// How many replicas must acknowledge a write (`[redis] min_replica_acks`) and how long to wait
/// for them at most (`[redis] replica_ack_timeout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplicaWait {
    /// Replicas that must acknowledge, at least 1.
    pub replicas: u32,
    /// The longest wait; sent in whole milliseconds, at least 1 (`WAIT … 0` would block forever).
    pub timeout: Duration,
}

impl ReplicaWait {
    /// A wait for `replicas` replicas, or `None` when `replicas` is 0 (waiting is off).
    pub fn new(replicas: u32, timeout: Duration) -> Option<Self> {
        (replicas > 0).then_some(ReplicaWait { replicas, timeout })
    }

    /// `WAIT <replicas> <timeout in ms, at least 1>`.
    pub(crate) fn cmd(&self) -> Cmd {
        let millis = u64::try_from(self.timeout.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        let mut cmd = redis::cmd("WAIT");
        cmd.arg(self.replicas).arg(millis);
        cmd
    }

    /// The number of replicas a `WAIT` reply says acknowledged; `None` for another reply (an
    /// error reply, such as `NOPERM` without `+wait`).
    pub(crate) fn acked(reply: &Value) -> Option<u32> {
        match reply {
            Value::Int(n) => u32::try_from(*n).ok(),
            _ => None,
        }
    }

    /// Whether `acked` replicas are fewer than asked for.
    pub(crate) fn short(&self, acked: u32) -> bool {
        acked < self.replicas
    }

    /// Logs (`warn!`) that an ack's `WAIT` reply `reply` counts fewer replicas than asked for, or
    /// is not a count: the entries were handled and acked on the master; a failover to a replica
    /// that lacks the ack delivers them again. Consumption goes on.
    pub(crate) fn warn_if_short(&self, reply: Option<&Value>, acks: usize) {
        match reply.and_then(Self::acked) {
            Some(acked) if !self.short(acked) => {}
            Some(acked) => tracing::warn!(
                acked,
                wanted = self.replicas,
                timeout = ?self.timeout,
                acks,
                "fewer replicas than min_replica_acks acknowledged an ack within replica_ack_timeout; the entries are acked on the master, and a failover to a replica that lacks the ack delivers them again"
            ),
            None => tracing::warn!(
                reply = ?reply,
                wanted = self.replicas,
                acks,
                "WAIT after an ack did not return a replica count; the entries are acked on the master"
            ),
        }
    }
}

/// A member's replica waits after acks (docs/design.md §15.4): at most one ack `WAIT` in flight
/// per member, and none for a while after one fell short.
///
/// Why: `WAIT` blocks the connection it is sent on, and a member's shards share one data-plane
/// connection (docs/design.md §8.12). One `WAIT` per shard's ack would queue in Redis behind
/// each other when the replica is gone (32 shards × `replica_ack_timeout`), starving the
/// member's reads. A `WAIT` covers every write sent before it on its connection,
/// so the acks that go without one are covered by the member's next `WAIT`. After a short
/// `WAIT` (a replica down or lagging), acks go without `WAIT` for [`AckWaits::pause`]; the first
/// ack after the pause probes the replicas again. Waiting after acks narrows duplicates after a
/// failover; it never holds an entry back (the ack is done on the master either way).
#[derive(Debug, Clone)]
pub(crate) struct AckWaits {
    wait: ReplicaWait,
    state: Arc<AckWaitState>,
}

#[derive(Debug, Default)]
struct AckWaitState {
    in_flight: AtomicBool,
    paused_until: Mutex<Option<Instant>>,
}

/// The right to send one ack `WAIT` ([`AckWaits::begin`]); released when dropped.
#[derive(Debug)]
pub(crate) struct AckWaitTurn {
    waits: AckWaits,
}

impl AckWaits {
    /// The member's ack waits for `wait`.
    pub(crate) fn new(wait: ReplicaWait) -> Self {
        AckWaits {
            wait,
            state: Arc::default(),
        }
    }

    /// How long acks go without `WAIT` after a short one: four `replica_ack_timeout`s, at least
    /// 1 s (the connection is then blocked by a `WAIT` at most a fifth of the time).
    pub(crate) fn pause(&self) -> Duration {
        (self.wait.timeout * 4).max(Duration::from_secs(1))
    }

    /// A turn to send a `WAIT` with the next ack, or `None` when another ack's `WAIT` of this
    /// member is in flight or waits are paused after a short one.
    pub(crate) fn begin(&self) -> Option<AckWaitTurn> {
        let paused = self
            .state
            .paused_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some_and(|until| Instant::now() < until);
        if paused || self.state.in_flight.swap(true, Ordering::AcqRel) {
            return None;
        }
        Some(AckWaitTurn {
            waits: self.clone(),
        })
    }
}

impl AckWaitTurn {
    /// `WAIT <replicas> <timeout>`.
    pub(crate) fn cmd(&self) -> Cmd {
        self.waits.wait.cmd()
    }

    /// Reads the `WAIT` reply (`None`: none came back) for `acks` acks: logs a short one and
    /// pauses the member's ack waits ([`AckWaits::pause`]).
    pub(crate) fn finish(self, reply: Option<&Value>, acks: usize) {
        let wait = self.waits.wait;
        let short = reply
            .and_then(ReplicaWait::acked)
            .is_none_or(|acked| wait.short(acked));
        if short {
            wait.warn_if_short(reply, acks);
            let pause = self.waits.pause();
            *self
                .waits
                .state
                .paused_until
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = Some(Instant::now() + pause);
            tracing::warn!(
                ?pause,
                "acks go without WAIT for this long, then probe the replicas again"
            );
        }
    }
}

impl Drop for AckWaitTurn {
    fn drop(&mut self) {
        self.waits.state.in_flight.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_is_off_at_zero_and_never_blocks_forever() {
        assert_eq!(ReplicaWait::new(0, Duration::from_secs(1)), None);
        let wait = ReplicaWait::new(2, Duration::from_micros(10)).unwrap();
        let args: Vec<Vec<u8>> = wait
            .cmd()
            .args_iter()
            .filter_map(|a| match a {
                redis::Arg::Simple(bytes) => Some(bytes.to_vec()),
                _ => None,
            })
            .collect();
        assert_eq!(args, vec![b"WAIT".to_vec(), b"2".to_vec(), b"1".to_vec()]);
        assert_eq!(ReplicaWait::acked(&Value::Int(1)), Some(1));
        assert_eq!(ReplicaWait::acked(&Value::Nil), None);
        assert!(wait.short(1) && !wait.short(2));
    }

    #[test]
    fn one_ack_wait_in_flight_per_member_and_none_after_a_short_one() {
        let waits = AckWaits::new(ReplicaWait::new(1, Duration::from_millis(100)).unwrap());
        assert_eq!(waits.pause(), Duration::from_secs(1));
        let turn = waits.begin().expect("the first turn");
        assert!(waits.clone().begin().is_none(), "one in flight per member");
        turn.finish(Some(&Value::Int(1)), 3);
        let turn = waits
            .begin()
            .expect("released, and not paused: the replica acked");
        turn.finish(Some(&Value::Int(0)), 3);
        assert!(waits.begin().is_none(), "paused after a short WAIT");
        *waits.state.paused_until.lock().unwrap() = Some(Instant::now());
        let turn = waits.begin().expect("the pause is over: probe again");
        drop(turn);
        assert!(waits.begin().is_some(), "a dropped turn is released");
    }
}
