//! Stream-level admin operations: create, scale, cancel, retire (docs/design.md §3, §10).

mod retire;
mod scale;

use super::AdminError;
use crate::connection::RedisConnection;
use crate::store::provision::{self, CreatedStream};

pub use retire::{RetireReport, ShardRetirement, WaitReason, retire_drained};
pub use scale::{ScaleAction, ScaleOutcome, cancel_scale, scale};

/// Creates the sharded stream `prefix` with `shards` shards, for operators:
/// [`crate::store::provision::create_stream`] (which says what is written, in which order, and
/// when it is a no-op).
///
/// # Errors
/// Before anything is written: [`AdminError::InvalidName`] for a prefix with `{`, `}`, whitespace
/// or control characters, or empty; [`AdminError::ZeroShards`]; [`AdminError::TooManyShards`]
/// above [`super::MAX_SHARDS`]; [`AdminError::ShardCountMismatch`] when the stream exists with
/// another count (use [`scale`]). [`AdminError::Store`] when Redis fails or the existing metadata cannot
/// be read.
pub async fn create_stream(
    conn: &mut RedisConnection,
    prefix: &str,
    shards: u32,
) -> Result<CreatedStream, AdminError> {
    Ok(provision::create_stream(conn, prefix, shards).await?)
}
