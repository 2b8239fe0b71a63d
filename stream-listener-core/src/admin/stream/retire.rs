//! Retiring drained shards once no producer or member can still use them (docs/design.md §10).

use std::collections::BTreeMap;
use std::time::{Duration, UNIX_EPOCH};

use serde::Serialize;

use super::scale::{indexes_in, set_state};
use crate::admin::scripts::RetireCheck;
use crate::admin::{
    AdminError, CAS_ATTEMPTS, backoff, ceil_ms, contended, load_required, scripts, stream_keys,
    write_next_version,
};
use crate::connection::RedisConnection;
use crate::keys::StreamKeys;
use crate::model::{Micros, Migration, ShardIndex, ShardState, StreamMetadata};
use crate::store::StreamCas;

/// Why a shard is not retired yet.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "reason", rename_all = "camelCase")]
#[non_exhaustive]
pub enum WaitReason {
    /// The producer routing lease, and its slack of a fifth, has not passed since the shard
    /// started draining: a producer that read the metadata before the change may still write
    /// to it.
    #[serde(rename_all = "camelCase")]
    RoutingLease {
        /// Time left, slack included, ms.
        remaining_ms: u64,
    },
    /// A consumer group has delivered entries that are not acknowledged.
    #[serde(rename_all = "camelCase")]
    Pending {
        /// The consumer group.
        group: String,
        /// Its pending count on the shard.
        pending: u64,
    },
    /// A consumer group has entries after its last delivered id.
    #[serde(rename_all = "camelCase")]
    UnreadEntries {
        /// The consumer group.
        group: String,
        /// The first entry it has not read.
        next_id: String,
    },
}

impl std::fmt::Display for WaitReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WaitReason::RoutingLease { remaining_ms } => {
                write!(f, "routing lease not passed ({remaining_ms} ms left)")
            }
            WaitReason::Pending { group, pending } => {
                write!(f, "group {group} has {pending} pending entries")
            }
            WaitReason::UnreadEntries { group, next_id } => {
                write!(f, "group {group} has unread entries (next {next_id})")
            }
        }
    }
}

/// What [`retire_drained`] did with one shard.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ShardRetirement {
    /// The shard.
    pub shard_index: ShardIndex,
    /// Its state after the call: RETIRED when retired, else DRAINING (also when it was RETIRING
    /// and the final check found entries left: a write that landed after the first check, or a
    /// read after it; it is readable again so members read them, and the next call retries it).
    pub state: ShardState,
    /// Why it is not retired yet; `None` when it was retired.
    pub waiting: Option<WaitReason>,
}

/// The result of [`retire_drained`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RetireReport {
    /// The stream prefix.
    pub stream_prefix: String,
    /// Every shard that was DRAINING or RETIRING when the call started, ascending.
    pub shards: Vec<ShardRetirement>,
    /// No DRAINING or RETIRING shard is left and no migration is recorded.
    pub migration_complete: bool,
    /// `metadataVersion` after the call.
    pub metadata_version: u64,
    /// The readable shard set after the call (ACTIVE and DRAINING shards).
    pub readable_shard_set: Vec<ShardIndex>,
}

/// The slack [`retire_drained`] adds to the routing lease: a fifth of it (6 s for the default
/// 30 s). It covers what the lease alone does not: the migration's `startedAt` is Redis `TIME`
/// read before the scale-in's compare-and-set, so a producer's metadata read sent in between
/// still saw the shard ACTIVE and its lease runs past `startedAt + lease`; and an `XADD` sent
/// just before a producer's lease ends lands a moment later.
pub(crate) fn routing_lease_slack(routing_lease: Duration) -> Duration {
    routing_lease / 5
}

fn duration_us(d: Duration) -> Micros {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

fn parse_started_at(prefix: &str, migration: &Migration) -> Result<Micros, AdminError> {
    let inconsistent = |detail: String| AdminError::Inconsistent {
        prefix: prefix.to_owned(),
        detail,
    };
    let time = humantime::parse_rfc3339(&migration.started_at).map_err(|e| {
        inconsistent(format!(
            "migration startedAt {:?} is not an RFC 3339 time ({e})",
            migration.started_at
        ))
    })?;
    let since = time.duration_since(UNIX_EPOCH).map_err(|_| {
        inconsistent(format!(
            "migration startedAt {:?} is before 1970",
            migration.started_at
        ))
    })?;
    Ok(duration_us(since))
}

/// Retires the DRAINING shards of stream `prefix` that every consumer group has finished
/// (docs/design.md §10). For each DRAINING shard, once `routing_lease` and a slack of a fifth of it
/// have passed since draining started (Redis `TIME` against the migration's `startedAt`, which is
/// read before the scale-in's compare-and-set; an `XADD` sent at the end of a producer's lease
/// lands a moment later):
///
/// 1. a read-only run of the retirement script checks, for every consumer group `XINFO GROUPS`
///    lists, `pending = 0` and no entry after its `last-delivered-id` (`XRANGE (<id> + COUNT 1`;
///    lag alone is not trusted). Shards that pass become RETIRING by a compare-and-set that bumps
///    `metadataVersion`: no cancel while RETIRING, and members stop reading them (RETIRING is
///    not readable, [`ShardState::is_readable`]; nothing is left to read in them);
/// 2. one script on the shard's slot (keys `{p:i}`, `{p:i}:fence`, `{p:i}:attempts`) checks
///    again and only then deletes the stream, its fence and its handler-attempt counts;
/// 3. a compare-and-set marks the deleted shards RETIRED, bumps `metadataVersion`, and clears the
///    migration when no DRAINING or RETIRING shard is left. A RETIRING shard whose second check
///    found entries (written or read after the first) becomes DRAINING again in the same
///    compare-and-set, so members read them: entries are never stranded in a shard no one
///    reads.
///
/// A crash between the steps is finished by the next call (a RETIRING shard is deleted and
/// marked RETIRED; an already deleted one only marked). Shards not ready are reported with the
/// reason ([`WaitReason`]); the call itself succeeds. Call it again until
/// [`RetireReport::migration_complete`].
///
/// # Errors
/// [`AdminError::InvalidName`]; [`AdminError::Inconsistent`] when DRAINING shards exist without a
/// migration or with an unreadable `startedAt`; [`AdminError::Store`]: unknown stream, Redis
/// failure, corrupt metadata, or [`crate::store::StoreError::Contended`].
pub async fn retire_drained(
    conn: &mut RedisConnection,
    prefix: &str,
    routing_lease: Duration,
) -> Result<RetireReport, AdminError> {
    let keys = stream_keys(prefix)?;
    for attempt in 1..=CAS_ATTEMPTS {
        let mut meta = load_required(conn, &keys).await?;
        let draining = indexes_in(&meta, ShardState::Draining);
        let mut waiting: BTreeMap<ShardIndex, WaitReason> = BTreeMap::new();
        let mut involved: Vec<ShardIndex> = draining.clone();
        involved.extend(indexes_in(&meta, ShardState::Retiring));
        involved.sort_unstable();
        if !draining.is_empty() {
            let migration = meta
                .migration
                .as_ref()
                .ok_or_else(|| AdminError::Inconsistent {
                    prefix: prefix.to_owned(),
                    detail: format!(
                        "shards {draining:?} are DRAINING but no migration is recorded"
                    ),
                })?;
            let wait = routing_lease.saturating_add(routing_lease_slack(routing_lease));
            let lease_end = parse_started_at(prefix, migration)?.saturating_add(duration_us(wait));
            let now = scripts::stream_time(conn, &keys).await?;
            let mut clear = Vec::new();
            for shard in draining {
                if now < lease_end {
                    waiting.insert(
                        shard,
                        WaitReason::RoutingLease {
                            remaining_ms: ceil_ms(lease_end - now),
                        },
                    );
                    continue;
                }
                let check = scripts::retire_shard(conn, &keys, &meta, shard, false).await?;
                match blocked_reason(check) {
                    Some(reason) => {
                        waiting.insert(shard, reason);
                    }
                    None => clear.push(shard),
                }
            }
            if !clear.is_empty() {
                let mut next = meta.clone();
                for shard in &clear {
                    set_state(&mut next.shards, *shard, ShardState::Retiring);
                }
                match write_next_version(conn, &keys, &meta, &mut next, now).await? {
                    StreamCas::Written => meta = next,
                    StreamCas::Conflict => {
                        backoff(attempt).await;
                        continue;
                    }
                }
            }
        }
        let mut deleted = Vec::new();
        let mut reopened = Vec::new();
        for shard in indexes_in(&meta, ShardState::Retiring) {
            let check = scripts::retire_shard(conn, &keys, &meta, shard, true).await?;
            match blocked_reason(check) {
                // Entries landed after the first check (a late producer write, or a member that
                // read before it saw RETIRING): no member reads a RETIRING shard, so it goes back
                // to DRAINING to be read, and the next call retires it.
                Some(reason) => {
                    waiting.insert(shard, reason);
                    reopened.push(shard);
                }
                // `delete` answers Deleted or Gone when nothing blocks.
                None => deleted.push(shard),
            }
        }
        // A migration left recorded with nothing to retire (cleared by `finish_retiring`).
        let stale_migration = meta.migration.is_some() && !unfinished(&meta);
        if !deleted.is_empty() || !reopened.is_empty() || stale_migration {
            meta = finish_retiring(conn, &keys, &deleted, &reopened).await?;
        }
        let shards = involved
            .into_iter()
            .map(|shard_index| ShardRetirement {
                shard_index,
                state: meta
                    .shards
                    .iter()
                    .find(|s| s.shard_index == shard_index)
                    .map_or(ShardState::Retired, |s| s.state),
                waiting: waiting.remove(&shard_index),
            })
            .collect();
        return Ok(RetireReport {
            stream_prefix: prefix.to_owned(),
            shards,
            migration_complete: meta.migration.is_none() && !unfinished(&meta),
            metadata_version: meta.metadata_version,
            readable_shard_set: meta.readable_shard_set().into_iter().collect(),
        });
    }
    Err(contended("retiring drained shards"))
}

/// Whether a shard is DRAINING or RETIRING.
fn unfinished(meta: &StreamMetadata) -> bool {
    meta.shards
        .iter()
        .any(|s| matches!(s.state, ShardState::Draining | ShardState::Retiring))
}

/// The reason a retirement check blocks; `None` when it passed.
fn blocked_reason(check: RetireCheck) -> Option<WaitReason> {
    match check {
        RetireCheck::Pending { group, count } => Some(WaitReason::Pending {
            group,
            pending: count,
        }),
        RetireCheck::Unread { group, next_id } => {
            Some(WaitReason::UnreadEntries { group, next_id })
        }
        RetireCheck::Gone | RetireCheck::Clear | RetireCheck::Deleted => None,
    }
}

/// Marks the deleted shards RETIRED and the `reopened` ones DRAINING again (both are RETIRING:
/// no cancel can have changed them), and clears the migration when no DRAINING or RETIRING shard
/// is left; retried on conflicts.
async fn finish_retiring(
    conn: &mut RedisConnection,
    keys: &StreamKeys,
    deleted: &[ShardIndex],
    reopened: &[ShardIndex],
) -> Result<StreamMetadata, AdminError> {
    for attempt in 1..=CAS_ATTEMPTS {
        let meta = load_required(conn, keys).await?;
        let mut next = meta.clone();
        for shard in next.shards.iter_mut() {
            if shard.state != ShardState::Retiring {
                continue;
            }
            if deleted.contains(&shard.shard_index) {
                shard.state = ShardState::Retired;
            } else if reopened.contains(&shard.shard_index) {
                shard.state = ShardState::Draining;
            }
        }
        if !unfinished(&next) {
            next.migration = None;
        }
        if next == meta {
            return Ok(meta);
        }
        let now = scripts::stream_time(conn, keys).await?;
        match write_next_version(conn, keys, &meta, &mut next, now).await? {
            StreamCas::Written => return Ok(next),
            StreamCas::Conflict => backoff(attempt).await,
        }
    }
    Err(contended("marking retired or reopened shards"))
}
