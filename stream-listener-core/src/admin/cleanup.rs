//! `group cleanup`: consumer hygiene run by an operator (docs/design.md §8.15). Deletes, on every
//! shard of a stream, the Redis consumers of a group that belong to no live or static member and
//! have no pending entry; or, in a dry run, lists what would go.

use serde::Serialize;

use super::{AdminError, load_required, stream_keys};
use crate::connection::RedisConnection;
use crate::dataplane::{DataPlaneError, KeepList, delete_idle_consumers, read_keep_list};
use crate::model::{ShardIndex, ShardState};
use crate::store::StoreError;

/// Why [`cleanup_consumers`] kept a consumer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum KeptBecause {
    /// `"liveMember"`: its member's lease runs (at or after Redis `TIME`).
    LiveMember,
    /// `"staticMember"`: a static member (an `instanceId`) still in the group whose lease ran
    /// out: it keeps its consumer name across restarts.
    StaticMember,
    /// `"pending"`: no member of the group any more, but it still has pending entries; the
    /// shard's next owner claims them at takeover, and a later cleanup deletes it.
    Pending,
}

/// A consumer that [`cleanup_consumers`] kept.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct KeptConsumer {
    /// The Redis consumer name (a member id).
    pub consumer: String,
    /// Why it was kept.
    pub reason: KeptBecause,
    /// Its pending entries (`XINFO CONSUMERS`'s `pending`).
    pub pending: u64,
}

/// One shard in a [`ConsumerCleanup`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ShardConsumerCleanup {
    /// The shard.
    pub shard_index: ShardIndex,
    /// Consumers deleted (or, in a dry run, that would be), in `XINFO CONSUMERS` order.
    pub deleted: Vec<String>,
    /// Consumers kept, with the reason.
    pub kept: Vec<KeptConsumer>,
    /// `true` when the shard has no consumer group of this name (nothing to clean).
    pub no_consumer_group: bool,
}

/// The result of [`cleanup_consumers`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ConsumerCleanup {
    /// The stream prefix.
    pub stream_prefix: String,
    /// The consumer group.
    pub consumer_group: String,
    /// Whether nothing was deleted ([`ConsumerCleanup::shards`] lists what would be).
    pub dry_run: bool,
    /// Every shard that is not RETIRED, ascending.
    pub shards: Vec<ShardConsumerCleanup>,
}

/// Deletes (`dry_run`: lists) the Redis consumers of `group` on every shard of stream `prefix`
/// that belong to no member whose lease runs and to no static member still in the group, and
/// that have no pending entry (docs/design.md §8.15). The keep-list is read first on the
/// group's slot, then each shard runs one script that checks `pending = 0` and deletes in the
/// same step (`XINFO CONSUMERS`, `XGROUP DELCONSUMER`), so no pending entry is ever dropped. Safe
/// while members run.
///
/// # Errors
/// [`AdminError::InvalidName`] for a bad prefix or group name; [`AdminError::Store`]: unknown
/// stream ([`StoreError::MissingStream`]), a group not registered on it
/// ([`StoreError::UnknownGroup`]), a registered group whose metadata is missing
/// ([`StoreError::MissingGroup`]: which members live cannot be told), or Redis failure. Nothing
/// is deleted by a call that fails before its first shard; a failure on a later shard leaves the
/// earlier shards cleaned (run it again).
pub async fn cleanup_consumers(
    conn: &mut RedisConnection,
    prefix: &str,
    group: &str,
    dry_run: bool,
) -> Result<ConsumerCleanup, AdminError> {
    let keys = stream_keys(prefix)?;
    let group_keys = keys.group(group)?;
    let meta = load_required(conn, &keys).await?;
    if !meta.groups.iter().any(|g| g.consumer_group == group) {
        return Err(StoreError::UnknownGroup {
            prefix: prefix.to_owned(),
            group: group.to_owned(),
        }
        .into());
    }
    let keep = read_keep_list(conn, &group_keys)
        .await
        .map_err(admin_error)?;
    if !keep.group_exists {
        return Err(StoreError::MissingGroup {
            prefix: prefix.to_owned(),
            group: group.to_owned(),
            key: group_keys.metadata(),
        }
        .into());
    }
    let names = keep.names(None);
    let mut shards = Vec::new();
    for shard in meta
        .shards
        .iter()
        .filter(|s| s.state != ShardState::Retired)
    {
        let index = shard.shard_index;
        let cleaned = match delete_idle_consumers(conn, &keys, index, group, &names, dry_run).await
        {
            Ok(sweep) => ShardConsumerCleanup {
                shard_index: index,
                kept: kept_consumers(&keep, sweep.kept, sweep.kept_pending),
                deleted: sweep.deleted,
                no_consumer_group: false,
            },
            Err(DataPlaneError::NoGroup { .. }) => ShardConsumerCleanup {
                shard_index: index,
                deleted: Vec::new(),
                kept: Vec::new(),
                no_consumer_group: true,
            },
            Err(error) => return Err(admin_error(error)),
        };
        shards.push(cleaned);
    }
    shards.sort_by_key(|s| s.shard_index);
    Ok(ConsumerCleanup {
        stream_prefix: prefix.to_owned(),
        consumer_group: group.to_owned(),
        dry_run,
        shards,
    })
}

/// The kept consumers with their reasons: keep-listed ones as live or static members, the
/// others for their pending entries.
fn kept_consumers(
    keep: &KeepList,
    kept: Vec<(String, u64)>,
    kept_pending: Vec<(String, u64)>,
) -> Vec<KeptConsumer> {
    let listed = kept.into_iter().map(|(consumer, pending)| {
        let reason = if keep.live.contains(&consumer) {
            KeptBecause::LiveMember
        } else {
            KeptBecause::StaticMember
        };
        KeptConsumer {
            consumer,
            reason,
            pending,
        }
    });
    let busy = kept_pending
        .into_iter()
        .map(|(consumer, pending)| KeptConsumer {
            consumer,
            reason: KeptBecause::Pending,
            pending,
        });
    listed.chain(busy).collect()
}

/// A data-plane failure as the admin tool's: Redis failures stay Redis failures (exit code 3
/// when unreachable).
fn admin_error(error: DataPlaneError) -> AdminError {
    match error {
        DataPlaneError::Redis { source, .. } => AdminError::Store(StoreError::Redis(source)),
        other => AdminError::DataPlane(other),
    }
}
