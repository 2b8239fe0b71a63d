//! Admin operations on sharded streams and consumer groups, as a library (docs/design.md §2, §3,
//! §8, §10); the `stream-listener` command-line tool of the facade crate is a thin layer over them.
//!
//! Every operation is an `async fn` taking a [`RedisConnection`] (standalone or cluster: every
//! command and script touches keys of one hash slot) and is idempotent: running it again after a
//! crash or a lost reply finishes what the first run started and changes nothing else.
//!
//! | operation | what it does |
//! | --- | --- |
//! | [`create_stream`] | provisions shards `{p:0}`..`{p:N-1}` and the stream metadata |
//! | [`register_group`] | creates a consumer group on every readable shard, then registers it |
//! | [`scale`] / [`cancel_scale`] | scale-out (new ACTIVE shards) or scale-in (DRAINING shards) |
//! | [`retire_drained`] | retires DRAINING shards that every group has finished (§10) |
//! | [`describe_stream`] / [`describe_group`] | what operators see: shards, members, lag |
//! | [`list_streams`] / [`list_groups`] | the streams of `sl:streams`, the groups of a stream |
//! | [`delete_group`] | removes an inactive group everywhere |
//! | [`reset_group`] | moves an inactive group's position on its shards (`XGROUP SETID`) |
//! | [`delete_stream`] | removes a stream and every key it owns |
//! | [`cleanup_consumers`] | deletes the Redis consumers of members that left (no pending entries) |
//! | [`list_dead_letters`] / [`show_dead_letter`] | a group's dead letters, a page or one whole |
//! | [`replay_dead_letters`] / [`purge_dead_letters`] | re-publish dead letters, or delete them |
//! | [`stream_retention`] / [`set_stream_retention`] / [`trim_stream`] | a stream's retention, and a trim to it (§10.9) |
//!
//! Changes of the stream metadata are compare-and-sets on its `revision`
//! ([`crate::store::write_stream_metadata`]); a conflict reloads and redoes the operation, up to
//! [`CAS_ATTEMPTS`] times, then fails with [`StoreError::Contended`]. Every change bumps
//! `metadataVersion`, so groups pick it up on their next heartbeat (docs/design.md §5). Times are
//! Redis `TIME` of the node that owns the stream metadata key, never a process clock.

mod cleanup;
mod describe;
mod dlq;
mod error;
mod group;
mod retention;
mod scripts;
mod stream;
// Issue 16: group offsets, stream delete.
mod delete;
mod liveness;
mod reset;

pub use crate::keys::NameError;
pub use crate::store::StoreError;
pub use cleanup::{
    ConsumerCleanup, KeptBecause, KeptConsumer, ShardConsumerCleanup, cleanup_consumers,
};
pub use delete::{DeletedStream, delete_stream};
pub use describe::{
    ConsumerGroupInfo, DEAD_LETTER_SCAN_LIMIT, GroupDescription, GroupShardDescription,
    GroupSummary, Lag, MemberDescription, PastMember, StreamDescription, StreamShardDescription,
    StreamSummary, describe_group, describe_stream, list_groups, list_streams,
};
pub use dlq::{
    DEFAULT_DEAD_LETTER_PAGE, DeadLetter, DeadLetterPage, DeadLetterSelection, DeadLetterSummary,
    EntryField, MAX_DEAD_LETTER_PAGE, PURGE_ID_LIMIT, PurgeReport, ReplayDuplicate, ReplayReport,
    ReplaySkip, Replayed, SkipReason, list_dead_letters, parse_dead_letter_reason,
    purge_dead_letters, replay_dead_letters, show_dead_letter,
};
pub use error::AdminError;
pub use group::{DeletedGroup, delete_group, delete_group_with, register_group};
pub use reset::{GroupReset, ResetOptions, ResetTarget, ShardReset, reset_group};
pub use retention::{
    DeadLetterTrim, ShardTrim, StreamRetention, TrimReport, set_stream_retention, stream_retention,
    trim_stream,
};
pub use stream::{
    RetireReport, ScaleAction, ScaleOutcome, ShardRetirement, WaitReason, cancel_scale,
    create_stream, retire_drained, scale,
};

use crate::connection::RedisConnection;
use crate::coordinator::{CoordinatorConfig, rfc3339};
use crate::keys::{GroupKeys, StreamKeys};
use crate::model::{Micros, StreamMetadata};
use crate::store::provision::{self, ProvisionError};
use crate::store::{GroupStore, StreamCas, write_stream_metadata};
pub(crate) use provision::backoff;

pub use crate::store::provision::{CAS_ATTEMPTS, CreatedStream, GroupRegistration, MAX_SHARDS};

/// Validated keys of `prefix`.
fn stream_keys(prefix: &str) -> Result<StreamKeys, AdminError> {
    Ok(StreamKeys::new(prefix)?)
}

/// The stream metadata, or [`StoreError::MissingStream`].
async fn load_required(
    conn: &mut RedisConnection,
    keys: &StreamKeys,
) -> Result<StreamMetadata, AdminError> {
    Ok(provision::load_required(conn, keys).await?)
}

/// Validates the names, loads the stream metadata of `prefix` and opens a store of `group` with
/// `config` (no group data is read yet): what an operation on one consumer group starts from, as
/// (stream keys, group keys, stream metadata, group store).
///
/// # Errors
/// [`AdminError::InvalidName`]; [`StoreError::MissingStream`]; Redis failure.
async fn open_group(
    conn: &mut RedisConnection,
    prefix: &str,
    group: &str,
    config: CoordinatorConfig,
) -> Result<(StreamKeys, GroupKeys, StreamMetadata, GroupStore), AdminError> {
    let keys = stream_keys(prefix)?;
    let group_keys = keys.group(group)?;
    let meta = load_required(conn, &keys).await?;
    let store = GroupStore::new(conn.clone(), keys.clone(), group_keys.clone(), config);
    Ok((keys, group_keys, meta, store))
}

/// Writes `next`, a change of `current`, as the next `metadataVersion` stamped `now` (Redis
/// `TIME`, µs), with a compare-and-set on `current`'s revision.
async fn write_next_version(
    conn: &mut RedisConnection,
    keys: &StreamKeys,
    current: &StreamMetadata,
    next: &mut StreamMetadata,
    now: Micros,
) -> Result<StreamCas, AdminError> {
    next.metadata_version += 1;
    next.updated_at = rfc3339(now);
    Ok(write_stream_metadata(conn, keys, Some(current.revision), next).await?)
}

/// The error after [`CAS_ATTEMPTS`] conflicts.
fn contended(what: &'static str) -> AdminError {
    AdminError::Store(provision::contended(what))
}

/// The provisioning functions' errors are the admin tool's, variant for variant.
impl From<ProvisionError> for AdminError {
    fn from(error: ProvisionError) -> Self {
        match error {
            ProvisionError::Store(error) => AdminError::Store(error),
            ProvisionError::InvalidName(error) => AdminError::InvalidName(error),
            ProvisionError::ZeroShards { prefix } => AdminError::ZeroShards { prefix },
            ProvisionError::TooManyShards {
                prefix,
                requested,
                max,
            } => AdminError::TooManyShards {
                prefix,
                requested,
                max,
            },
            ProvisionError::ShardCountMismatch {
                prefix,
                existing,
                requested,
            } => AdminError::ShardCountMismatch {
                prefix,
                existing,
                requested,
            },
        }
    }
}

/// Milliseconds of a µs span, rounded up (so "1 ms left" is never shown as 0).
fn ceil_ms(micros: u64) -> u64 {
    micros.div_ceil(1000)
}
