//! Errors of the data plane.

use crate::model::ShardIndex;

/// Why a data-plane operation failed. A refused fence is not an error (it is the `Err` side of
/// each operation's inner `Result`, or [`super::ReadOutcome::Fenced`]); these are the cases where
/// Redis could not do what was asked. None of them leaves a partial change: every operation on a
/// shard is one script, applied whole or not at all.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum DataPlaneError {
    /// The shard stream or its consumer group does not exist (`NOGROUP`, or `no such key`).
    /// Redis lost its data (restarted empty) or the group was never
    /// provisioned on this shard. Retrying at once cannot help: back off, let the coordinator
    /// provision stream and group again (docs/design.md §5, §8), then raise the fence again.
    #[error(
        "shard {shard} ({stream}): the stream or its consumer group {group:?} does not exist ({detail}); Redis lost data or the group was never provisioned: back off, let the group be provisioned again (docs/design.md §5), then raise the fence again"
    )]
    NoGroup {
        /// The shard index.
        shard: ShardIndex,
        /// The shard stream key.
        stream: String,
        /// The consumer group.
        group: String,
        /// Redis's message.
        detail: String,
    },
    /// Redis did not answer in time, the connection failed, or Redis refused the command (the
    /// cause is the error's source; [`crate::connection::RedisFailure::of`] says which).
    /// Usually transient: back off, re-check the lease and the assignment, and retry.
    #[error(
        "Redis {op} failed{}; back off, re-check the lease, and retry ({})",
        shard.map(|s| format!(" on shard {s}")).unwrap_or_default(),
        crate::connection::RedisFailure::hint(source, "check that Redis is up and reachable")
    )]
    Redis {
        /// The operation (`raise_fence`, `read_pending`, `read_new`, `ack`, `claim_others`,
        /// `dead_letter`, `wait`, `connect`).
        op: &'static str,
        /// The shard, when the operation had one.
        shard: Option<ShardIndex>,
        /// The error redis-rs reported.
        source: redis::RedisError,
    },
    /// A reply of a shape the scripts never send: a bug, or a Redis version stream-listener does
    /// not support (it needs Redis >= 7.0).
    #[error(
        "unexpected reply to {op}{}: {detail}; this is a bug or an unsupported Redis version (7.0 or newer is needed)",
        shard.map(|s| format!(" on shard {s}")).unwrap_or_default()
    )]
    UnexpectedReply {
        /// The operation.
        op: &'static str,
        /// The shard, when the operation had one.
        shard: Option<ShardIndex>,
        /// What was wrong.
        detail: String,
    },
    /// A strict read's gate (docs/design.md §8.16, [`crate::keys::StreamKeys::gate`]) was
    /// missing and its fence check could not create it: Redis refused the write (`OOM` at
    /// `maxmemory`, the cause is the error's source). Every fence held the member's token, but the
    /// read failed closed and nothing was read. Back off and retry: reads resume once Redis
    /// accepts writes again (memory freed, or a `maxmemory` raised).
    #[error(
        "shard {shard}: the read gate {gate} could not be created, so the strict read failed closed and read nothing; {}",
        if crate::connection::RedisFailure::of(source) == crate::connection::RedisFailure::OutOfMemory {
            "reads resume once Redis is below maxmemory again"
        } else {
            crate::connection::RedisFailure::hint(source, "back off and retry")
        }
    )]
    GateUnavailable {
        /// The shard whose read failed.
        shard: ShardIndex,
        /// The gate key.
        gate: String,
        /// Redis's refusal of `XGROUP CREATE … MKSTREAM`.
        source: redis::RedisError,
    },
    /// [`super::Waiter::wait`] on a cluster was given keys of several hash slots: one blocking
    /// call can only cover one slot there. Group the shards by [`super::key_slot`] and wait on
    /// each group with its own [`super::Waiter`], or poll.
    #[error(
        "keys {keys:?} are in different hash slots: on Redis Cluster one blocking XREAD covers one slot; group shards by slot and use one Waiter per group"
    )]
    CrossSlot {
        /// The keys given.
        keys: Vec<String>,
    },
}

crate::report::readable_debug!(DataPlaneError);

impl DataPlaneError {
    /// Whether this is [`DataPlaneError::NoGroup`]: the stream or the group is missing.
    pub fn is_no_group(&self) -> bool {
        matches!(self, DataPlaneError::NoGroup { .. })
    }

    pub(crate) fn redis(
        op: &'static str,
        shard: Option<ShardIndex>,
    ) -> impl FnOnce(redis::RedisError) -> Self {
        move |source| DataPlaneError::Redis { op, shard, source }
    }

    pub(crate) fn unexpected(
        op: &'static str,
        shard: Option<ShardIndex>,
        detail: impl Into<String>,
    ) -> Self {
        DataPlaneError::UnexpectedReply {
            op,
            shard,
            detail: detail.into(),
        }
    }
}
