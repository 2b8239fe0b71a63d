//! Retention as an admin operation (docs/design.md §10.9): print, set or clear a stream's
//! retention (`stream-listener stream retention`), and trim a stream that no member trims
//! (`stream-listener stream trim [--dry-run]`) with the same script the runtime runs.

use serde::Serialize;

use super::{AdminError, load_required, stream_keys};
use crate::connection::RedisConnection;
use crate::keys::StreamKeys;
use crate::model::ShardIndex;
use crate::store::{Bounds, KeyTrim, Retention, load_retention, trim_key, write_retention};

/// A stream's retention ([`stream_retention`], [`set_stream_retention`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct StreamRetention {
    /// The stream prefix.
    pub stream_prefix: String,
    /// The retention before the call (equal to `retention` for a read).
    pub previous: Option<Retention>,
    /// The retention now; `None`: nothing is trimmed.
    pub retention: Option<Retention>,
}

/// Reads the retention of stream `prefix` (`None`: none set).
///
/// # Errors
/// [`AdminError::InvalidName`]; [`crate::store::StoreError::MissingStream`] for an unknown
/// stream; [`crate::store::StoreError::CorruptMetadata`] when the field is not retention JSON;
/// Redis failure.
pub async fn stream_retention(
    conn: &mut RedisConnection,
    prefix: &str,
) -> Result<StreamRetention, AdminError> {
    let keys = stream_keys(prefix)?;
    load_required(conn, &keys).await?;
    let retention = load_retention(conn, &keys).await?;
    Ok(StreamRetention {
        stream_prefix: prefix.to_owned(),
        previous: retention,
        retention,
    })
}

/// Sets (`Some`) or clears (`None`) the retention of stream `prefix`. Writes the `retention`
/// field of `sl:{<prefix>}:stream` only: `metadataVersion` stays, no group rebalances. Members
/// pick the change up within their `retention_interval`. Idempotent. A corrupt stored
/// retention (not JSON, or out of range) is overwritten and reported as `previous: None`.
///
/// # Errors
/// [`AdminError::InvalidRetention`] for a bound of 0 or an absurd one (nothing written);
/// [`AdminError::InvalidName`]; [`crate::store::StoreError::MissingStream`]; Redis failure.
pub async fn set_stream_retention(
    conn: &mut RedisConnection,
    prefix: &str,
    retention: Option<Retention>,
) -> Result<StreamRetention, AdminError> {
    let keys = stream_keys(prefix)?;
    if let Some(retention) = &retention {
        retention.validate()?;
    }
    load_required(conn, &keys).await?;
    // A corrupt stored retention is what this call fixes (its errors say so): overwritten, and
    // reported as no previous retention.
    let previous = match load_retention(conn, &keys).await {
        Ok(previous) => previous,
        Err(crate::store::StoreError::CorruptMetadata { .. }) => {
            write_retention(conn, &keys, retention.as_ref()).await?;
            None
        }
        Err(e) => return Err(e.into()),
    };
    if previous != retention && !write_retention(conn, &keys, retention.as_ref()).await? {
        // Deleted between the load and the write.
        load_required(conn, &keys).await?;
    }
    Ok(StreamRetention {
        stream_prefix: prefix.to_owned(),
        previous,
        retention,
    })
}

/// One shard's part of a [`TrimReport`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct ShardTrim {
    /// The shard.
    pub shard_index: ShardIndex,
    /// What went (or would go) and why.
    #[serde(flatten)]
    pub trim: KeyTrim,
}

/// One group's dead-letter stream's part of a [`TrimReport`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct DeadLetterTrim {
    /// The consumer group.
    pub consumer_group: String,
    /// What went (or would go) and why.
    #[serde(flatten)]
    pub trim: KeyTrim,
}

/// [`trim_stream`]: per readable shard and per registered group's dead-letter stream, what went.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct TrimReport {
    /// The stream prefix.
    pub stream_prefix: String,
    /// Whether nothing was changed (only counted).
    pub dry_run: bool,
    /// The retention applied.
    pub retention: Retention,
    /// Readable shards (ACTIVE and DRAINING), ascending; empty when the retention bounds no shard.
    pub shards: Vec<ShardTrim>,
    /// Dead-letter streams of the registered groups; empty when no dead-letter bound is set.
    pub dead_letters: Vec<DeadLetterTrim>,
}

/// Trims stream `prefix` to its stored retention now, or only counts (`dry_run`): one script per
/// readable shard (trim point and trim in one step, docs/design.md §10.9) and one per registered
/// group's dead-letter stream. For streams without a running member; members trim the shards
/// they own themselves.
///
/// # Errors
/// [`AdminError::NoRetention`] when the stream has no retention; [`AdminError::InvalidName`];
/// [`crate::store::StoreError::MissingStream`]; [`crate::store::StoreError::WrongType`] when a
/// shard key is not a stream; Redis failure (shards already trimmed stay trimmed: run it again).
pub async fn trim_stream(
    conn: &mut RedisConnection,
    prefix: &str,
    dry_run: bool,
) -> Result<TrimReport, AdminError> {
    let keys = stream_keys(prefix)?;
    let meta = load_required(conn, &keys).await?;
    let retention = load_retention(conn, &keys)
        .await?
        .ok_or_else(|| AdminError::NoRetention {
            prefix: prefix.to_owned(),
        })?;
    let mut shards = Vec::new();
    if retention.bounds_shards() {
        for shard in meta.readable_shard_set() {
            let trim = trim_key(
                conn,
                &keys.shard(shard),
                Bounds::shards(&retention),
                dry_run,
            )
            .await?;
            shards.push(ShardTrim {
                shard_index: shard,
                trim,
            });
        }
    }
    let mut dead_letters = Vec::new();
    if retention.bounds_dead_letters() {
        for group in &meta.groups {
            let trim =
                trim_dead_letters(conn, &keys, &group.consumer_group, &retention, dry_run).await?;
            dead_letters.push(DeadLetterTrim {
                consumer_group: group.consumer_group.clone(),
                trim,
            });
        }
    }
    Ok(TrimReport {
        stream_prefix: prefix.to_owned(),
        dry_run,
        retention,
        shards,
        dead_letters,
    })
}

async fn trim_dead_letters(
    conn: &mut RedisConnection,
    keys: &StreamKeys,
    group: &str,
    retention: &Retention,
    dry_run: bool,
) -> Result<KeyTrim, AdminError> {
    let key = keys.dead_letters(&keys.group(group)?);
    Ok(trim_key(conn, &key, Bounds::dead_letters(retention), dry_run).await?)
}
