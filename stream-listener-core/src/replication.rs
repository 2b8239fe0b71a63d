//! Waiting for replicas after a write (README "Waiting for replicas", docs/design.md §15.4):
//! `WAIT numreplicas timeout` (<https://redis.io/docs/latest/commands/wait/>) sent on the same
//! connection as the write, in the same pipeline, so it covers that write.
//!
//! `WAIT` blocks the connection it is sent on until enough replicas acknowledged every write sent
//! before it on that connection, or the timeout passed; it then returns how many did. It is not a
//! consensus write: an entry whose `WAIT` timed out is still on the master, and a failover to a
//! replica that lacks it loses it. On a cluster, redis-rs sends a pipeline to the node of its first
//! keyed command, so a `WAIT` after an `XADD` or an ack script runs on that command's node.

use std::time::Duration;

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
}
