//! Stream metadata in `sl:{<prefix>}:stream` (DESIGN.md §3): fields `schema`, `revision`,
//! `metadataVersion` (readable with one `HGET` by every heartbeat) and `meta` (the JSON).

use std::collections::HashMap;

use redis::AsyncCommands;

use super::StoreError;
use super::scripts;
use crate::connection::RedisConnection;
use crate::keys::{STREAMS_INDEX_KEY, StreamKeys};
use crate::model::StreamMetadata;

/// The metadata schema this build reads and writes (field `schema` of every metadata hash).
pub const SCHEMA_VERSION: u32 = 1;

/// The outcome of a compare-and-set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamCas {
    /// Written; the metadata's `revision` is the new one.
    Written,
    /// Another writer changed it first: reload and redo.
    Conflict,
}

pub(crate) fn check_schema(key: &str, found: Option<&String>) -> Result<(), StoreError> {
    match found {
        Some(s) if s == &SCHEMA_VERSION.to_string() => Ok(()),
        other => Err(StoreError::UnknownSchema {
            key: key.to_owned(),
            found: other.cloned().unwrap_or_else(|| "(none)".into()),
            supported: SCHEMA_VERSION,
        }),
    }
}

pub(crate) fn parse_u64(key: &str, field: &str, value: Option<&String>) -> Result<u64, StoreError> {
    let value =
        value.ok_or_else(|| StoreError::malformed(key, format!("field {field} is missing")))?;
    value.parse().map_err(|_| {
        StoreError::malformed(key, format!("field {field} is {value:?}, not a number"))
    })
}

/// Loads the stream metadata; `Ok(None)` when the key does not exist.
///
/// # Errors
/// [`StoreError::Redis`] when Redis fails; [`StoreError::UnknownSchema`],
/// [`StoreError::CorruptMetadata`] or [`StoreError::Malformed`] when the hash exists but cannot be
/// read (fail closed: it is never rebuilt silently).
pub async fn load_stream_metadata(
    conn: &mut RedisConnection,
    keys: &StreamKeys,
) -> Result<Option<StreamMetadata>, StoreError> {
    let key = keys.metadata();
    let fields: HashMap<String, String> = conn.hgetall(&key).await?;
    if fields.is_empty() {
        return Ok(None);
    }
    check_schema(&key, fields.get("schema"))?;
    let revision = parse_u64(&key, "revision", fields.get("revision"))?;
    let json = fields
        .get("meta")
        .ok_or_else(|| StoreError::malformed(&key, "field meta is missing"))?;
    let mut meta: StreamMetadata =
        serde_json::from_str(json).map_err(|e| StoreError::corrupt(&key, "meta", e))?;
    meta.revision = revision;
    Ok(Some(meta))
}

/// Reads only the stream's `metadataVersion` (one `HGET`, DESIGN.md §5); `Ok(None)` when the
/// stream metadata does not exist.
///
/// # Errors
/// [`StoreError::Redis`]; [`StoreError::Malformed`] when the field is not a number.
pub async fn read_metadata_version(
    conn: &mut RedisConnection,
    keys: &StreamKeys,
) -> Result<Option<u64>, StoreError> {
    let key = keys.metadata();
    let value: Option<String> = conn.hget(&key, "metadataVersion").await?;
    value
        .map(|v| parse_u64(&key, "metadataVersion", Some(&v)))
        .transpose()
}

/// Writes `meta` if the stored `revision` is still `expected_revision` (`None`: the key must not
/// exist). On success `meta.revision` is the new revision. Also adds the prefix to the
/// `sl:streams` index (a separate command: the index is rebuildable, never a source of truth).
///
/// # Errors
/// [`StoreError::Redis`] when Redis fails; nothing is written then.
pub async fn write_stream_metadata(
    conn: &mut RedisConnection,
    keys: &StreamKeys,
    expected_revision: Option<u64>,
    meta: &mut StreamMetadata,
) -> Result<StreamCas, StoreError> {
    let new_revision = expected_revision.map_or(1, |r| r + 1);
    let mut candidate = meta.clone();
    candidate.revision = new_revision;
    let json = serde_json::to_string(&candidate)
        .map_err(|e| StoreError::corrupt(&keys.metadata(), "meta", e))?;
    let written: i64 = scripts::stream_cas()
        .key(keys.metadata())
        .arg(expected_revision.map(|r| r.to_string()).unwrap_or_default())
        .arg(new_revision)
        .arg(candidate.metadata_version)
        .arg(json)
        .arg(SCHEMA_VERSION)
        .invoke_async(conn)
        .await?;
    if written == 0 {
        return Ok(StreamCas::Conflict);
    }
    *meta = candidate;
    let _: i64 = conn.sadd(STREAMS_INDEX_KEY, keys.prefix()).await?;
    Ok(StreamCas::Written)
}
