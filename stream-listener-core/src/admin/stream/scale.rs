//! Scaling a stream out and in, and cancelling a migration (docs/design.md §10).

use serde::Serialize;

use crate::admin::{
    AdminError, CAS_ATTEMPTS, backoff, contended, load_required, scripts, stream_keys,
    write_next_version,
};
use crate::connection::RedisConnection;
use crate::coordinator::rfc3339;
use crate::model::{Migration, ShardIndex, ShardInfo, ShardState, StreamMetadata};
use crate::store::StreamCas;
use crate::store::provision::check_shard_count;

/// What [`scale`] or [`cancel_scale`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ScaleAction {
    /// New shards were provisioned and marked ACTIVE.
    ScaleOut,
    /// Shards were marked DRAINING; a migration is recorded.
    ScaleIn,
    /// The stream already has (or is already draining to) the requested count: nothing changed.
    Unchanged,
    /// The migration was abandoned: DRAINING shards are ACTIVE again.
    Cancelled,
}

/// The result of [`scale`] and [`cancel_scale`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ScaleOutcome {
    /// The stream prefix.
    pub stream_prefix: String,
    /// What was done.
    pub action: ScaleAction,
    /// `shardCount` before the call.
    pub from_shard_count: u32,
    /// `shardCount` after the call.
    pub to_shard_count: u32,
    /// Shards provisioned and marked ACTIVE (scale-out), ascending.
    pub provisioned: Vec<ShardIndex>,
    /// Shards marked DRAINING (scale-in), ascending.
    pub draining: Vec<ShardIndex>,
    /// Shards made ACTIVE again (cancel), ascending.
    pub reactivated: Vec<ShardIndex>,
    /// `metadataVersion` after the call.
    pub metadata_version: u64,
    /// The migration running after the call, if any.
    pub migration: Option<Migration>,
}

impl ScaleOutcome {
    /// `action` of stream `prefix` took its metadata from `before` to `after`; the shard lists
    /// are empty.
    fn new(
        prefix: &str,
        action: ScaleAction,
        before: &StreamMetadata,
        after: &StreamMetadata,
    ) -> Self {
        ScaleOutcome {
            stream_prefix: prefix.to_owned(),
            action,
            from_shard_count: before.shard_count,
            to_shard_count: after.shard_count,
            provisioned: Vec::new(),
            draining: Vec::new(),
            reactivated: Vec::new(),
            metadata_version: after.metadata_version,
            migration: after.migration.clone(),
        }
    }

    fn unchanged(meta: &StreamMetadata) -> Self {
        ScaleOutcome::new(&meta.stream_prefix, ScaleAction::Unchanged, meta, meta)
    }
}

/// Sets the state of shard `index`, adding it (in index order) when it is not listed.
pub(super) fn set_state(shards: &mut Vec<ShardInfo>, index: ShardIndex, state: ShardState) {
    match shards.iter_mut().find(|s| s.shard_index == index) {
        Some(shard) => shard.state = state,
        None => {
            shards.push(ShardInfo {
                shard_index: index,
                state,
            });
            shards.sort_by_key(|s| s.shard_index);
        }
    }
}

pub(super) fn indexes_in(meta: &StreamMetadata, state: ShardState) -> Vec<ShardIndex> {
    meta.shards
        .iter()
        .filter(|s| s.state == state)
        .map(|s| s.shard_index)
        .collect()
}

/// Changes the shard count of stream `prefix` to `target` (docs/design.md §10); one migration at a
/// time.
///
/// - **Scale-out** (`target` above `shardCount`): shards `shardCount..target` are provisioned
///   (stream created if missing, and a consumer group from `0` for every registered group: a new
///   shard holds nothing older than the change), then one compare-and-set marks them ACTIVE, sets
///   `shardCount = target` and bumps `metadataVersion`. The registered groups are re-read on every
///   attempt, so a group registered concurrently ([`crate::admin::register_group`]) is never missing on a
///   new shard. No migration is recorded: the change is complete when the call returns.
/// - **Scale-in** (`target` below `shardCount`, 0 included: a full drain): ACTIVE shards
///   `target..shardCount` become DRAINING (producers stop routing to them, members keep reading),
///   `shardCount = target`, a [`Migration`] records when draining started (Redis `TIME`), and
///   `metadataVersion` is bumped. [`retire_drained`](crate::admin::retire_drained) finishes it.
/// - `target` equal to `shardCount` (or to the target of the running migration): nothing changes
///   ([`ScaleAction::Unchanged`]).
///
/// # Errors
/// [`AdminError::InvalidName`]; [`AdminError::TooManyShards`] above [`MAX_SHARDS`](crate::admin::MAX_SHARDS);
/// [`AdminError::MigrationInProgress`] while another migration runs (retire it or
/// [`cancel_scale`]); [`AdminError::Store`]: unknown stream ([`crate::store::StoreError::MissingStream`]),
/// Redis failure, corrupt metadata, or [`crate::store::StoreError::Contended`] after [`CAS_ATTEMPTS`]
/// conflicts. Nothing is changed then, except shard streams and consumer groups provisioned for a
/// scale-out that did not commit (harmless: not readable, and the next attempt reuses them).
pub async fn scale(
    conn: &mut RedisConnection,
    prefix: &str,
    target: u32,
) -> Result<ScaleOutcome, AdminError> {
    let keys = stream_keys(prefix)?;
    check_shard_count(prefix, target, true)?;
    for attempt in 1..=CAS_ATTEMPTS {
        let meta = load_required(conn, &keys).await?;
        let from = meta.shard_count;
        if let Some(migration) = &meta.migration {
            if migration.to_shard_count == target && from == target {
                return Ok(ScaleOutcome::unchanged(&meta));
            }
            return Err(AdminError::MigrationInProgress {
                prefix: prefix.to_owned(),
                from: migration.from_shard_count,
                to: migration.to_shard_count,
            });
        }
        if target == from {
            return Ok(ScaleOutcome::unchanged(&meta));
        }
        let now = scripts::stream_time(conn, &keys).await?;
        let mut next = meta.clone();
        let mut provisioned = Vec::new();
        let mut draining = Vec::new();
        if target > from {
            let groups: Vec<(&str, &str)> = meta
                .groups
                .iter()
                .map(|g| (g.consumer_group.as_str(), "0"))
                .collect();
            for shard in from..target {
                scripts::ensure_shard(conn, &keys, shard, true, &groups).await?;
                set_state(&mut next.shards, shard, ShardState::Active);
                provisioned.push(shard);
            }
        } else {
            for shard in next.shards.iter_mut() {
                if shard.shard_index >= target && shard.state == ShardState::Active {
                    shard.state = ShardState::Draining;
                    draining.push(shard.shard_index);
                }
            }
            next.migration = Some(Migration {
                from_shard_count: from,
                to_shard_count: target,
                started_at: rfc3339(now),
            });
        }
        next.shard_count = target;
        match write_next_version(conn, &keys, &meta, &mut next, now).await? {
            StreamCas::Written => {
                let action = if target > from {
                    ScaleAction::ScaleOut
                } else {
                    ScaleAction::ScaleIn
                };
                return Ok(ScaleOutcome {
                    provisioned,
                    draining,
                    ..ScaleOutcome::new(prefix, action, &meta, &next)
                });
            }
            StreamCas::Conflict => backoff(attempt).await,
        }
    }
    Err(contended("scaling the stream"))
}

/// Abandons the running migration of stream `prefix` (`scale --cancel`, docs/design.md §10): its
/// DRAINING shards become ACTIVE again, `shardCount` goes back to the migration's
/// `fromShardCount`, the migration is cleared and `metadataVersion` bumped. Possible only while
/// no shard of the migration has reached RETIRING.
///
/// # Errors
/// [`AdminError::NoMigration`] when none runs; [`AdminError::CannotCancel`] when a shard of it is
/// RETIRING or RETIRED; [`AdminError::Store`] as for [`scale`]. Nothing is changed then.
pub async fn cancel_scale(
    conn: &mut RedisConnection,
    prefix: &str,
) -> Result<ScaleOutcome, AdminError> {
    let keys = stream_keys(prefix)?;
    for attempt in 1..=CAS_ATTEMPTS {
        let meta = load_required(conn, &keys).await?;
        let Some(migration) = meta.migration.clone() else {
            return Err(AdminError::NoMigration {
                prefix: prefix.to_owned(),
            });
        };
        let range = migration.to_shard_count..migration.from_shard_count;
        let past: Vec<ShardIndex> = meta
            .shards
            .iter()
            .filter(|s| range.contains(&s.shard_index))
            .filter(|s| matches!(s.state, ShardState::Retiring | ShardState::Retired))
            .map(|s| s.shard_index)
            .collect();
        if !past.is_empty() {
            return Err(AdminError::CannotCancel {
                prefix: prefix.to_owned(),
                shards: past,
            });
        }
        let now = scripts::stream_time(conn, &keys).await?;
        let mut next = meta.clone();
        let mut reactivated = Vec::new();
        for shard in next.shards.iter_mut() {
            if shard.state == ShardState::Draining {
                shard.state = ShardState::Active;
                reactivated.push(shard.shard_index);
            }
        }
        next.shard_count = migration.from_shard_count;
        next.migration = None;
        match write_next_version(conn, &keys, &meta, &mut next, now).await? {
            StreamCas::Written => {
                return Ok(ScaleOutcome {
                    reactivated,
                    ..ScaleOutcome::new(prefix, ScaleAction::Cancelled, &meta, &next)
                });
            }
            StreamCas::Conflict => backoff(attempt).await,
        }
    }
    Err(contended("cancelling the migration"))
}
