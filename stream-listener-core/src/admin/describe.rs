//! What operators see: describe and list (docs/design.md §3: field names are camelCase exactly as
//! stored).

mod group;
mod list;

use serde::{Serialize, Serializer};

use super::scripts::RawGroupInfo;
use super::{AdminError, load_required, scripts, stream_keys};
use crate::connection::RedisConnection;
use crate::model::{Migration, RegisteredGroup, ShardIndex, ShardState};

pub use group::{
    GroupDescription, GroupShardDescription, MemberDescription, PastMember, describe_group,
};
pub use list::{GroupSummary, StreamSummary, list_groups, list_streams};

/// Dead-letter streams up to this length are read whole to count dead letters per shard (field
/// `shard` of each entry, docs/design.md §8); longer ones only report the group total.
pub const DEAD_LETTER_SCAN_LIMIT: usize = 1000;

/// A consumer group's lag on a shard: entries added to the shard that the group has not been
/// delivered yet (`XINFO GROUPS` `lag`). Redis cannot always tell (after an `XDEL`, a trim or an
/// `XSETID` it answers nil): that is [`Lag::Unknown`], never 0. Serialised as a number, or the
/// string `"unknown"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lag {
    /// Entries not delivered yet.
    Known(u64),
    /// Redis cannot tell.
    Unknown,
}

impl Lag {
    fn from_raw(lag: Option<u64>) -> Self {
        lag.map_or(Lag::Unknown, Lag::Known)
    }
}

impl std::fmt::Display for Lag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Lag::Known(n) => write!(f, "{n}"),
            Lag::Unknown => f.write_str("unknown"),
        }
    }
}

impl Serialize for Lag {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Lag::Known(n) => serializer.serialize_u64(*n),
            Lag::Unknown => serializer.serialize_str("unknown"),
        }
    }
}

/// One consumer group of one shard stream, from `XINFO GROUPS`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ConsumerGroupInfo {
    /// The consumer group name.
    pub name: String,
    /// Its consumers (Redis consumer names are member ids, docs/design.md §7).
    pub consumers: u64,
    /// Entries delivered and not acknowledged.
    pub pending: u64,
    /// The id of the last entry delivered to the group.
    pub last_delivered_id: String,
    /// Entries read, when Redis knows it.
    pub entries_read: Option<u64>,
    /// Entries not delivered yet.
    pub lag: Lag,
}

impl From<RawGroupInfo> for ConsumerGroupInfo {
    fn from(raw: RawGroupInfo) -> Self {
        ConsumerGroupInfo {
            name: raw.name,
            consumers: raw.consumers,
            pending: raw.pending,
            last_delivered_id: raw.last_delivered_id,
            entries_read: raw.entries_read,
            lag: Lag::from_raw(raw.lag),
        }
    }
}

/// One shard in [`StreamDescription`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StreamShardDescription {
    /// The shard index.
    pub shard_index: ShardIndex,
    /// Its state in the stream metadata.
    pub state: ShardState,
    /// Whether the shard stream `{p:i}` exists (false for a RETIRED shard).
    pub exists: bool,
    /// `XLEN`; `None` when the stream does not exist.
    pub length: Option<u64>,
    /// Its consumer groups, in `XINFO GROUPS` order.
    pub groups: Vec<ConsumerGroupInfo>,
}

/// [`describe_stream`]: the stream metadata and every shard's length and consumer groups.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StreamDescription {
    /// The stream prefix.
    pub stream_prefix: String,
    /// Shards producers route to.
    pub shard_count: u32,
    /// The stream's `metadataVersion`.
    pub metadata_version: u64,
    /// Compare-and-set revision of the stream metadata.
    pub revision: u64,
    /// Time of the last change (RFC 3339).
    pub updated_at: String,
    /// The running migration, if any.
    pub migration: Option<Migration>,
    /// Registered consumer groups.
    pub groups: Vec<RegisteredGroup>,
    /// ACTIVE and DRAINING shards, ascending.
    pub readable_shard_set: Vec<ShardIndex>,
    /// Every shard the metadata lists, ascending.
    pub shards: Vec<StreamShardDescription>,
    /// The stream's retention (docs/design.md §10.9); `None`: nothing is trimmed.
    pub retention: Option<crate::store::Retention>,
}

/// Describes stream `prefix`: its metadata and, per shard, state, length and consumer groups
/// (pending, lag, last delivered id). One script call per shard (`XLEN` + `XINFO GROUPS`).
///
/// # Errors
/// [`AdminError::InvalidName`]; [`AdminError::Store`]: [`crate::store::StoreError::MissingStream`] for an
/// unknown stream, [`crate::store::StoreError::CorruptMetadata`] / [`crate::store::StoreError::UnknownSchema`] /
/// [`crate::store::StoreError::Malformed`] when the metadata cannot be read (never rebuilt), Redis failure.
pub async fn describe_stream(
    conn: &mut RedisConnection,
    prefix: &str,
) -> Result<StreamDescription, AdminError> {
    let keys = stream_keys(prefix)?;
    let meta = load_required(conn, &keys).await?;
    let mut shards = Vec::with_capacity(meta.shards.len());
    for shard in &meta.shards {
        let info = scripts::shard_info(conn, &keys, shard.shard_index).await?;
        shards.push(StreamShardDescription {
            shard_index: shard.shard_index,
            state: shard.state,
            exists: info.is_some(),
            length: info.as_ref().map(|(length, _)| *length),
            groups: info
                .map(|(_, groups)| groups.into_iter().map(Into::into).collect())
                .unwrap_or_default(),
        });
    }
    Ok(StreamDescription {
        stream_prefix: meta.stream_prefix.clone(),
        shard_count: meta.shard_count,
        metadata_version: meta.metadata_version,
        revision: meta.revision,
        updated_at: meta.updated_at.clone(),
        migration: meta.migration.clone(),
        groups: meta.groups.clone(),
        readable_shard_set: meta.readable_shard_set().into_iter().collect(),
        shards,
        retention: crate::store::load_retention(conn, &keys).await?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_lag_is_never_shown_as_zero() {
        assert_eq!(
            serde_json::to_string(&Lag::Unknown).unwrap(),
            r#""unknown""#
        );
        assert_eq!(serde_json::to_string(&Lag::Known(0)).unwrap(), "0");
        assert_eq!(Lag::Unknown.to_string(), "unknown");
        assert_eq!(Lag::from_raw(None), Lag::Unknown);
        assert_eq!(Lag::from_raw(Some(7)), Lag::Known(7));
    }
}
