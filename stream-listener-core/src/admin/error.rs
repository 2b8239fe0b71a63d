//! Errors of the admin operations: each says what went wrong and what to do.

use crate::connection::RedisFailure;
use crate::keys::NameError;
use crate::model::ShardIndex;
use crate::store::{RetentionError, StoreError};

/// Why an admin operation failed. A failed operation changes nothing, or leaves a step that the
/// next call of the same operation finishes (every operation is idempotent).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AdminError {
    /// A store error: Redis unreachable ([`StoreError::Redis`]), unknown stream
    /// ([`StoreError::MissingStream`]), unregistered group ([`StoreError::UnknownGroup`]), lost
    /// group metadata ([`StoreError::MissingGroup`]), corrupt metadata, or a compare-and-set that
    /// kept conflicting ([`StoreError::Contended`]).
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A stream prefix or group name that cannot be used (docs/design.md §2). Nothing was written.
    #[error(transparent)]
    InvalidName(#[from] NameError),
    /// `create` with 0 shards. Nothing was written.
    #[error(
        "a stream needs at least 1 shard, not 0; give --shards 1 or more (to drain an existing stream completely, use `stream-listener stream scale {prefix} 0`)"
    )]
    ZeroShards {
        /// The stream prefix.
        prefix: String,
    },
    /// A shard count above [`super::MAX_SHARDS`]. Nothing was written.
    #[error(
        "{requested} shards for stream {prefix:?} is above the limit of {max}; choose at most {max}"
    )]
    TooManyShards {
        /// The stream prefix.
        prefix: String,
        /// The requested count.
        requested: u32,
        /// [`super::MAX_SHARDS`].
        max: u32,
    },
    /// `create` of a stream that exists with another shard count. Nothing was written.
    #[error(
        "stream {prefix:?} already exists with {existing} shards, not {requested}; change its shard count with `stream-listener stream scale {prefix} {requested}`"
    )]
    ShardCountMismatch {
        /// The stream prefix.
        prefix: String,
        /// Its shard count.
        existing: u32,
        /// The requested count.
        requested: u32,
    },
    /// `scale` while another resharding runs (one at a time, docs/design.md §10). Nothing was
    /// written.
    #[error(
        "stream {prefix:?} is already resharding from {from} to {to} shards; wait until `stream-listener stream retire {prefix}` has retired the draining shards, or abandon it with `stream-listener stream scale {prefix} --cancel`"
    )]
    MigrationInProgress {
        /// The stream prefix.
        prefix: String,
        /// Shard count before the running migration.
        from: u32,
        /// Its target shard count.
        to: u32,
    },
    /// `scale --cancel` without a running resharding. Nothing was written.
    #[error("stream {prefix:?} is not resharding: there is nothing to cancel")]
    NoMigration {
        /// The stream prefix.
        prefix: String,
    },
    /// `scale --cancel` after some shard reached RETIRING (no cancel after that point,
    /// docs/design.md §10). Nothing was written.
    #[error(
        "the resharding of {prefix:?} can no longer be cancelled: shards {shards:?} are already RETIRING or RETIRED; finish it with `stream-listener stream retire {prefix}`, then scale out again if needed"
    )]
    CannotCancel {
        /// The stream prefix.
        prefix: String,
        /// Shards past the point of no return.
        shards: Vec<ShardIndex>,
    },
    /// `group delete` of a group with a member whose lease still runs. Nothing was deleted.
    #[error(
        "consumer group {group:?} of stream {prefix:?} still has live members ({}); stop them, wait {wait_ms} ms for their leases to run out, then retry", members.join(", ")
    )]
    GroupActive {
        /// The stream prefix.
        prefix: String,
        /// The consumer group.
        group: String,
        /// Members whose lease still runs (at most 20).
        members: Vec<String>,
        /// Time until the last of those leases runs out, ms.
        wait_ms: u64,
    },
    /// The stream metadata contradicts itself (for example DRAINING shards without a recorded
    /// migration). Nothing was written.
    #[error(
        "stream metadata of {prefix:?} is inconsistent: {detail}; inspect it with `stream-listener stream describe {prefix} --json` and fix the key by hand"
    )]
    Inconsistent {
        /// The stream prefix.
        prefix: String,
        /// What contradicts what.
        detail: String,
    },
    /// A retention bound of 0 or an absurd one (docs/design.md §10.6). Nothing was written.
    #[error(transparent)]
    InvalidRetention(#[from] RetentionError),
    /// `stream trim` of a stream without retention. Nothing was trimmed.
    #[error(
        "stream {prefix:?} has no retention, so nothing is trimmed; set one with `stream-listener stream retention {prefix} --retention-max-len N` (or --retention-max-age)"
    )]
    NoRetention {
        /// The stream prefix.
        prefix: String,
    },
}

impl AdminError {
    /// Whether Redis could not be reached (connection refused, timeout, dropped connection,
    /// cluster down: [`RedisFailure::is_unreachable`]): the command-line tool exits with code 3
    /// then.
    pub fn is_redis_unreachable(&self) -> bool {
        match self {
            AdminError::Store(StoreError::Redis(err)) => RedisFailure::of(err).is_unreachable(),
            _ => false,
        }
    }
}
