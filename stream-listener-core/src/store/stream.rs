//! Stream metadata in `sl:{<prefix>}:stream` (docs/design.md §3): fields `schema`, `revision`,
//! `metadataVersion` (readable with one `HGET` by every heartbeat) and `meta` (the JSON).

use std::collections::HashMap;

use redis::AsyncCommands;

use super::StoreError;
use super::scripts;
use crate::connection::{RedisConnection, RedisFailure};
use crate::keys::{STREAMS_INDEX_KEY, StreamKeys};
use crate::model::{COUNTER_LIMIT, StreamMetadata};

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

/// A stored counter: a decimal below [`COUNTER_LIMIT`] (the store adds 1 to revisions), else
/// [`StoreError::Malformed`] naming key and field.
pub(crate) fn parse_u64(key: &str, field: &str, value: Option<&String>) -> Result<u64, StoreError> {
    let value =
        value.ok_or_else(|| StoreError::malformed(key, format!("field {field} is missing")))?;
    value
        .parse()
        .ok()
        .filter(|v| *v < COUNTER_LIMIT)
        .ok_or_else(|| {
            StoreError::malformed(
                key,
                format!("field {field} is {value:?}, not a number below 2^62"),
            )
        })
}

/// A counter decoded from stored JSON, checked against [`COUNTER_LIMIT`] (by absolute value).
pub(crate) fn check_counter(
    key: &str,
    field: &str,
    name: &str,
    value: u64,
) -> Result<(), StoreError> {
    if value < COUNTER_LIMIT {
        return Ok(());
    }
    Err(StoreError::malformed(
        key,
        format!(
            "{name} {value} in field {field} is at or above 2^62, which no real history reaches"
        ),
    ))
}

/// `error`, or [`StoreError::WrongType`] when it is `WRONGTYPE` ([`RedisFailure::WrongType`])
/// and one of `keys` (key, Redis type, name of the type) holds another type: which key a script
/// tripped over is not in the message, so each is asked with `TYPE`.
pub(crate) async fn wrong_type(
    conn: &mut RedisConnection,
    error: redis::RedisError,
    keys: &[(&str, &str, &'static str)],
) -> StoreError {
    if RedisFailure::of(&error) != RedisFailure::WrongType {
        return error.into();
    }
    for (key, redis_type, expected) in keys {
        let found: redis::RedisResult<String> =
            redis::cmd("TYPE").arg(*key).query_async(conn).await;
        if let Ok(found) = found
            && found != *redis_type
            && found != "none"
        {
            return StoreError::WrongType {
                key: (*key).to_owned(),
                found,
                expected,
            };
        }
    }
    error.into()
}

/// Loads the stream metadata; `Ok(None)` when the key does not exist.
///
/// # Errors
/// [`StoreError::Redis`] when Redis fails; [`StoreError::UnknownSchema`],
/// [`StoreError::CorruptMetadata`] or [`StoreError::Malformed`] when the hash exists but cannot be
/// read (fail closed: it is never rebuilt silently; a counter at or above
/// [`crate::model::COUNTER_LIMIT`] or a shard index at `u32::MAX` included);
/// [`StoreError::WrongType`] when the key is not a hash.
pub async fn load_stream_metadata(
    conn: &mut RedisConnection,
    keys: &StreamKeys,
) -> Result<Option<StreamMetadata>, StoreError> {
    let key = keys.metadata();
    let fields: HashMap<String, String> = match conn.hgetall(&key).await {
        Ok(fields) => fields,
        Err(e) => return Err(wrong_type(conn, e, &[(&key, "hash", "hash")]).await),
    };
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
    check_counter(&key, "meta", "metadataVersion", meta.metadata_version)?;
    // The coordinator takes `shardIndex + 1` as the bound of known indexes.
    if let Some(shard) = meta.shards.iter().find(|s| s.shard_index == u32::MAX) {
        return Err(StoreError::malformed(
            &key,
            format!(
                "shard index {} in field meta is out of range (at most {})",
                shard.shard_index,
                u32::MAX - 1
            ),
        ));
    }
    // Every reader builds the group's keys from these names: a name that cannot be used is
    // corrupt metadata, named as such, not an invalid argument of whoever read it.
    if let Some((group, error)) = meta
        .groups
        .iter()
        .find_map(|g| keys.group(&g.consumer_group).err().map(|e| (g, e)))
    {
        return Err(StoreError::malformed(
            &key,
            format!(
                "registered group {:?} in field meta has a name that cannot be used ({error})",
                group.consumer_group
            ),
        ));
    }
    Ok(Some(meta))
}

/// Reads only the stream's `metadataVersion` and `schema` (two `HGET`s in one round trip,
/// docs/design.md §5); `Ok(None)` when the stream metadata does not exist. The schema is checked here because a
/// steady member reads nothing else of the stream metadata.
///
/// # Errors
/// [`StoreError::Redis`]; [`StoreError::Malformed`] when the field is not a number below
/// [`crate::model::COUNTER_LIMIT`]; [`StoreError::UnknownSchema`] when the hash has a version
/// but not this build's `schema`; [`StoreError::WrongType`] when the key is not a hash.
pub async fn read_metadata_version(
    conn: &mut RedisConnection,
    keys: &StreamKeys,
) -> Result<Option<u64>, StoreError> {
    let key = keys.metadata();
    // Two `HGET`s in one round trip, not `HMGET`: the README's producer and admin ACL rules
    // grant `+hget` only.
    let (version, schema): (Option<String>, Option<String>) = match redis::pipe()
        .hget(&key, "metadataVersion")
        .hget(&key, "schema")
        .query_async(conn)
        .await
    {
        Ok(values) => values,
        Err(e) => return Err(wrong_type(conn, e, &[(&key, "hash", "hash")]).await),
    };
    let Some(version) = version else {
        return Ok(None);
    };
    check_schema(&key, schema.as_ref())?;
    parse_u64(&key, "metadataVersion", Some(&version)).map(Some)
}

/// Writes `meta` if the stored `revision` is still `expected_revision` (`None`: the key must not
/// exist). On success `meta.revision` is the new revision. Also adds the prefix to the
/// `sl:streams` index (a separate command: the index is rebuildable, never a source of truth).
///
/// # Errors
/// [`StoreError::Redis`] when Redis fails; nothing is written then, except when only the index
/// update failed ([`StoreError::WrongType`] when `sl:streams` is not a set): the metadata is
/// written, and the index is rebuildable.
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
    if let Err(e) = conn
        .sadd::<_, _, i64>(STREAMS_INDEX_KEY, keys.prefix())
        .await
    {
        return Err(wrong_type(conn, e, &[(STREAMS_INDEX_KEY, "set", "set")]).await);
    }
    Ok(StreamCas::Written)
}
