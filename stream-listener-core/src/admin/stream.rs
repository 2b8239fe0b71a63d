//! Stream-level admin operations: create, scale, cancel, retire (docs/design.md §3, §10).

mod retire;
mod scale;

use serde::Serialize;

use super::{AdminError, CAS_ATTEMPTS, MAX_SHARDS, backoff, contended, scripts, stream_keys};
use crate::connection::RedisConnection;
use crate::coordinator::rfc3339;
use crate::model::{ShardInfo, ShardState, StreamMetadata};
use crate::store::{StreamCas, load_stream_metadata, write_stream_metadata};

pub use retire::{RetireReport, ShardRetirement, WaitReason, retire_drained};
pub use scale::{ScaleAction, ScaleOutcome, cancel_scale, scale};

/// The result of [`create_stream`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CreatedStream {
    /// `true` when this call created the stream; `false` when it already existed with the same
    /// shard count (nothing was changed then).
    pub created: bool,
    /// The stream metadata as stored.
    pub metadata: StreamMetadata,
}

fn check_shard_count(prefix: &str, count: u32, allow_zero: bool) -> Result<(), AdminError> {
    if count == 0 && !allow_zero {
        return Err(AdminError::ZeroShards {
            prefix: prefix.to_owned(),
        });
    }
    if count > MAX_SHARDS {
        return Err(AdminError::TooManyShards {
            prefix: prefix.to_owned(),
            requested: count,
            max: MAX_SHARDS,
        });
    }
    Ok(())
}

/// Creates the sharded stream `prefix` with `shards` shards (docs/design.md §2, §3): the shard
/// streams `{prefix:0}`..`{prefix:shards-1}` (empty, so producers' `XADD ... NOMKSTREAM` finds
/// them), then the stream metadata `sl:{prefix}:stream` with every shard ACTIVE, `metadataVersion`
/// 1 and no registered group, by a compare-and-set that only creates (the prefix is added to
/// `sl:streams`).
///
/// Idempotent: when the stream exists with `shards` shards, nothing is changed and
/// [`CreatedStream::created`] is `false`. Shard streams left by an earlier attempt that crashed
/// before writing the metadata are kept as they are.
///
/// # Errors
/// Before anything is written: [`AdminError::InvalidName`] for a prefix with `{`, `}`, whitespace
/// or control characters, or empty; [`AdminError::ZeroShards`]; [`AdminError::TooManyShards`]
/// above [`MAX_SHARDS`]; [`AdminError::ShardCountMismatch`] when the stream exists with another
/// count (use [`scale`]). [`AdminError::Store`] when Redis fails or the existing metadata cannot
/// be read.
pub async fn create_stream(
    conn: &mut RedisConnection,
    prefix: &str,
    shards: u32,
) -> Result<CreatedStream, AdminError> {
    let keys = stream_keys(prefix)?;
    check_shard_count(prefix, shards, false)?;
    for attempt in 1..=CAS_ATTEMPTS {
        if let Some(existing) = load_stream_metadata(conn, &keys).await? {
            if existing.shard_count == shards {
                return Ok(CreatedStream {
                    created: false,
                    metadata: existing,
                });
            }
            return Err(AdminError::ShardCountMismatch {
                prefix: prefix.to_owned(),
                existing: existing.shard_count,
                requested: shards,
            });
        }
        for shard in 0..shards {
            scripts::ensure_shard(conn, &keys, shard, true, &[]).await?;
        }
        let now = scripts::stream_time(conn, &keys).await?;
        let mut meta = StreamMetadata {
            stream_prefix: prefix.to_owned(),
            shard_count: shards,
            shards: (0..shards)
                .map(|shard_index| ShardInfo {
                    shard_index,
                    state: ShardState::Active,
                })
                .collect(),
            metadata_version: 1,
            groups: Vec::new(),
            migration: None,
            updated_at: rfc3339(now),
            revision: 0,
        };
        match write_stream_metadata(conn, &keys, None, &mut meta).await? {
            StreamCas::Written => {
                return Ok(CreatedStream {
                    created: true,
                    metadata: meta,
                });
            }
            // Created concurrently: the next round compares the counts.
            StreamCas::Conflict => backoff(attempt).await,
        }
    }
    Err(contended("creating the stream"))
}
