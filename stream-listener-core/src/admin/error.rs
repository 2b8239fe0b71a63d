//! Errors of the admin operations: each says what went wrong and what to do.

use crate::connection::RedisFailure;
use crate::keys::NameError;
use crate::model::ShardIndex;
use crate::store::{RetentionError, StoreError};

/// Why an admin operation failed. A failed operation changes nothing, or leaves a step that the
/// next call of the same operation finishes (every operation is idempotent).
#[derive(thiserror::Error)]
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
        "consumer group {group:?} of stream {prefix:?} still has live members ({}): stop them (a graceful stop leaves the group at once), or, for members that crashed, retry once their leases have run out (in {wait_ms} ms at most)", members.join(", ")
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
    /// `group reset --shards` naming a shard that is not readable (not ACTIVE or DRAINING).
    /// Nothing was changed.
    #[error(
        "shard {shard} of stream {prefix:?} is not a readable shard (the readable shards are {readable:?}); give --shards from that list"
    )]
    ShardNotReadable {
        /// The stream prefix.
        prefix: String,
        /// The shard asked for.
        shard: ShardIndex,
        /// The readable shard set.
        readable: Vec<ShardIndex>,
    },
    /// `group reset --to <time>` with a time after Redis `TIME`. Nothing was changed.
    #[error(
        "reset time {time} is in the future (Redis time is {now}); give a past time, or --to latest"
    )]
    ResetTimeInFuture {
        /// The time asked for (RFC 3339).
        time: String,
        /// Redis `TIME` (RFC 3339).
        now: String,
    },
    /// `group reset --shift-by 0`. Nothing was changed.
    #[error(
        "--shift-by 0 moves nothing; give a negative count to re-deliver, a positive one to skip"
    )]
    ZeroShift,
    /// A shard of the group that the reset cannot work on: its stream or its consumer group is
    /// missing (see `stream-listener group describe`). Nothing was changed.
    #[error(
        "shard {shard} of stream {prefix:?} has no {what} for consumer group {group:?}; run `stream-listener group describe {prefix} {group}` and re-register the group if its consumer groups were lost"
    )]
    ShardNotReady {
        /// The stream prefix.
        prefix: String,
        /// The consumer group.
        group: String,
        /// The shard.
        shard: ShardIndex,
        /// `stream` or `consumer group`.
        what: &'static str,
    },
    /// `stream delete` without `--force` while a group still has entries to process. Nothing was
    /// deleted.
    #[error(
        "stream {prefix:?} still has data for consumer group {group:?} on shard {shard}: {detail}; let the group finish, or delete anyway with `stream-listener stream delete {prefix} --force`"
    )]
    StreamHasData {
        /// The stream prefix.
        prefix: String,
        /// The consumer group.
        group: String,
        /// The shard.
        shard: ShardIndex,
        /// `N pending entries` or `unread entries from <id>`.
        detail: String,
    },
    /// A data-plane script failed in a way that is not a Redis failure (an unexpected reply:
    /// a bug or an unsupported Redis version), for example in `group cleanup`.
    #[error(transparent)]
    DataPlane(#[from] crate::dataplane::DataPlaneError),
    /// A dead-letter id (or `--after`) that is not a stream entry id `<ms>-<seq>`. Nothing was
    /// done.
    #[error(
        "{id:?} is not a stream entry id; write it as <ms>-<seq> (e.g. 1700000000000-0), as `stream-listener dlq list` shows it"
    )]
    InvalidEntryId {
        /// The text given.
        id: String,
    },
    /// Dead-letter ids that are not in the dead-letter stream. Nothing was done.
    #[error(
        "no dead letter {} in {dead_letter_stream}; nothing was done; list the dead letters with `stream-listener dlq list`", ids.join(", ")
    )]
    DeadLettersNotFound {
        /// The dead-letter stream key.
        dead_letter_stream: String,
        /// The ids not found.
        ids: Vec<String>,
    },
    /// A dead-letter `reason` that is not one stream-listener writes. Nothing was done.
    #[error("{reason:?} is not a dead-letter reason; give one of {known}")]
    UnknownDeadLetterReason {
        /// The text given.
        reason: String,
        /// The known reasons, comma-separated.
        known: String,
    },
    /// A dead-letter selection or page that cannot be used (no ids, an age of 0, a page size
    /// out of range). Nothing was done.
    #[error("{detail}")]
    InvalidSelection {
        /// What is wrong and what to give instead.
        detail: String,
    },
    /// A replay stopped because re-publishing a dead letter failed. The dead letters before it
    /// were replayed and removed; it and the rest are kept.
    #[error(
        "the replay stopped at dead letter {dead_letter} of {dead_letter_stream} ({replayed} replayed and removed before it): re-publishing it failed; it is kept (if the error says the entry may have been appended, a new replay can publish it twice); fix the cause and run the replay again"
    )]
    ReplayPublish {
        /// The dead letter whose publish failed.
        dead_letter: String,
        /// The dead-letter stream key.
        dead_letter_stream: String,
        /// Dead letters replayed before it in this run.
        replayed: usize,
        /// The producer's error (boxed: it is large).
        #[source]
        source: Box<crate::producer::PublishError>,
    },
    /// A replayed dead letter was re-published, but removing it (`XDEL`) failed: it is still
    /// in the dead-letter stream, and a new replay would publish it again.
    #[error(
        "dead letter {dead_letter} was re-published to {stream_key} as {new_id} ({replayed} replayed before it), but removing it from {dead_letter_stream} failed; remove it with `stream-listener dlq purge --id {dead_letter}` (a replay would publish it twice), then replay the rest"
    )]
    ReplayNotRemoved {
        /// The dead letter.
        dead_letter: String,
        /// The dead-letter stream key.
        dead_letter_stream: String,
        /// Its new entry's id.
        new_id: String,
        /// The shard stream it was appended to.
        stream_key: String,
        /// Dead letters replayed before it in this run.
        replayed: usize,
        /// Redis's error (boxed: it is large).
        #[source]
        source: Box<redis::RedisError>,
    },
    /// A replay found a second dead letter of an entry it had replayed, but removing it (`XDEL`)
    /// failed: it is still in the dead-letter stream, and a later replay would publish the entry
    /// again.
    #[error(
        "dead letter {dead_letter} names the same entry as {duplicate_of}, which was replayed ({replayed} replayed in all), but removing it from {dead_letter_stream} failed; remove it with `stream-listener dlq purge --id {dead_letter}` (a replay would publish the entry twice), then replay the rest"
    )]
    DuplicateNotRemoved {
        /// The duplicate dead letter.
        dead_letter: String,
        /// The dead letter replayed for the same entry.
        duplicate_of: String,
        /// The dead-letter stream key.
        dead_letter_stream: String,
        /// Dead letters replayed in this run.
        replayed: usize,
        /// Redis's error (boxed: it is large).
        #[source]
        source: Box<redis::RedisError>,
    },
    /// A retention bound of 0 or an absurd one (docs/design.md §10.9). Nothing was written.
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

crate::report::readable_debug!(AdminError);

impl AdminError {
    /// Whether Redis could not be reached (connection refused, timeout, dropped connection,
    /// cluster down: [`RedisFailure::is_unreachable`]): the command-line tool exits with code 3
    /// then.
    pub fn is_redis_unreachable(&self) -> bool {
        match self {
            AdminError::Store(StoreError::Redis(err)) => RedisFailure::of(err).is_unreachable(),
            AdminError::ReplayPublish { source, .. } => match source.as_ref() {
                crate::producer::PublishError::Redis(err) => RedisFailure::of(err).is_unreachable(),
                _ => false,
            },
            AdminError::ReplayNotRemoved { source, .. }
            | AdminError::DuplicateNotRemoved { source, .. } => {
                RedisFailure::of(source).is_unreachable()
            }
            _ => false,
        }
    }

    /// Whether the operation's arguments are wrong in themselves, whatever Redis holds: a name
    /// that cannot be used, a shard count of 0 or above the limit, a shift of 0, an entry id,
    /// dead-letter reason, selection or retention bound that cannot be used. The command-line
    /// tool exits with code 2 (usage error) then; errors that depend on what Redis holds (an
    /// unknown stream, a shard the stream lacks, a reset time after Redis's clock) are operation
    /// failures. A stored name that cannot be used is corrupt metadata
    /// ([`StoreError::Malformed`]), not [`AdminError::InvalidName`].
    pub fn is_invalid_argument(&self) -> bool {
        matches!(
            self,
            AdminError::InvalidName(_)
                | AdminError::ZeroShards { .. }
                | AdminError::TooManyShards { .. }
                | AdminError::ZeroShift
                | AdminError::InvalidEntryId { .. }
                | AdminError::UnknownDeadLetterReason { .. }
                | AdminError::InvalidSelection { .. }
                | AdminError::InvalidRetention(_)
        )
    }

    /// Whether Redis refused a command or key for the user's ACL rule
    /// ([`RedisFailure::NoPermission`], README "ACL users"): the command-line tool then says
    /// which key patterns the admin rule needs.
    pub fn is_no_permission(&self) -> bool {
        let failure = match self {
            AdminError::Store(StoreError::Redis(err)) => RedisFailure::of(err),
            AdminError::ReplayPublish { source, .. } => match source.as_ref() {
                crate::producer::PublishError::Redis(err) => RedisFailure::of(err),
                crate::producer::PublishError::NoPermission { .. } => return true,
                _ => return false,
            },
            AdminError::ReplayNotRemoved { source, .. }
            | AdminError::DuplicateNotRemoved { source, .. } => RedisFailure::of(source),
            _ => return false,
        };
        failure == RedisFailure::NoPermission
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused() -> redis::RedisError {
        std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused").into()
    }

    #[test]
    fn a_replay_that_lost_redis_is_unreachable_not_an_operation_error() {
        let publish = AdminError::ReplayPublish {
            dead_letter: "1-0".into(),
            dead_letter_stream: "o:dlq:g".into(),
            replayed: 0,
            source: Box::new(crate::producer::PublishError::Redis(refused())),
        };
        assert!(publish.is_redis_unreachable());
        let remove = AdminError::ReplayNotRemoved {
            dead_letter: "1-0".into(),
            dead_letter_stream: "o:dlq:g".into(),
            new_id: "2-0".into(),
            stream_key: "{o:0}".into(),
            replayed: 0,
            source: Box::new(refused()),
        };
        assert!(remove.is_redis_unreachable());
        let refused_by_acl = AdminError::ReplayPublish {
            dead_letter: "1-0".into(),
            dead_letter_stream: "o:dlq:g".into(),
            replayed: 0,
            source: Box::new(crate::producer::PublishError::Redis(
                redis::RedisError::from((redis::ErrorKind::Client, "NOPERM")),
            )),
        };
        assert!(!refused_by_acl.is_redis_unreachable());
    }
}
