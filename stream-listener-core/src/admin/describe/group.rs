//! Describing one consumer group: its members, past members and shards, as of now
//! (docs/design.md §4, §6).

use redis::AsyncCommands;
use redis::streams::StreamRangeReply;
use serde::Serialize;

use super::{DEAD_LETTER_SCAN_LIMIT, Lag};
use crate::admin::{AdminError, open_group, scripts};
use crate::connection::RedisConnection;
use crate::coordinator;
use crate::coordinator::{Context, CoordinatorConfig, Group, StreamView};
use crate::model::{
    Epoch, GroupState, MemberState, Micros, RegisteredGroup, ShardIndex, ShardState, StartFrom,
    StreamMetadata,
};
use crate::store::StoreError;

/// One member in [`GroupDescription`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct MemberDescription {
    /// The member id (also its Redis consumer name).
    pub member_id: String,
    /// Its human name (the listener).
    pub member_name: String,
    /// Static identity, when configured.
    pub instance_id: Option<String>,
    /// Its state after the time-based work of the coordinator at the load time (an ACTIVE member
    /// whose lease ran out shows as EXPIRED).
    pub state: MemberState,
    /// ACTIVE with a lease that runs past the load time.
    pub live: bool,
    /// A static member away after `-2`.
    pub away: bool,
    /// Its member epoch.
    pub member_epoch: Epoch,
    /// Stored lease expiry minus Redis `TIME` at load, ms; negative when the lease ran out that
    /// long ago.
    pub lease_remaining_ms: i64,
    /// Shards it last reported owned (`currentAssignment`), ascending.
    pub owned: Vec<ShardIndex>,
    /// Shards it last reported draining (`revoking`), ascending.
    pub revoking: Vec<ShardIndex>,
    /// Shards last sent as assigned (`assignedShards`), ascending.
    pub assigned: Vec<ShardIndex>,
    /// Target shards not yet sent as assigned (target minus assigned): blocked until their
    /// previous holder releases them, ascending.
    pub pending: Vec<ShardIndex>,
    /// Its target shards, ascending.
    pub target: Vec<ShardIndex>,
    /// Its local workers (the assignor's weight).
    pub runtime_max_concurrency: u32,
    /// Workers busy at its last heartbeat.
    pub active_consumer_workers: u32,
}

/// A member of the group's history (EXPIRED / FENCED / LEFT members that hold nothing).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PastMember {
    /// The member id.
    pub member_id: String,
    /// Its human name.
    pub member_name: String,
    /// EXPIRED, FENCED or LEFT.
    pub state: MemberState,
    /// Its last member epoch.
    pub member_epoch: Epoch,
}

/// One shard in [`GroupDescription`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GroupShardDescription {
    /// The shard index.
    pub shard_index: ShardIndex,
    /// Its state in the stream metadata.
    pub state: ShardState,
    /// The member whose target holds it, if any.
    pub target_owner: Option<String>,
    /// `XLEN`; `None` when the shard stream does not exist.
    pub length: Option<u64>,
    /// Whether the consumer group exists on the shard.
    pub consumer_group_exists: bool,
    /// The group's pending count (`XINFO GROUPS` `pending`); `None` without the consumer group.
    pub pending: Option<u64>,
    /// The group's lag; [`Lag::Unknown`] when Redis cannot tell or without the consumer group.
    pub lag: Lag,
    /// The group's last delivered id; `None` without the consumer group.
    pub last_delivered_id: Option<String>,
    /// Dead letters of this group that came from this shard; `None` when the dead-letter stream
    /// is longer than [`DEAD_LETTER_SCAN_LIMIT`] (see [`GroupDescription::dead_letters`]).
    pub dead_letters: Option<u64>,
}

/// [`describe_group`]: a consumer group's state, members and shards.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GroupDescription {
    /// The stream prefix.
    pub stream_prefix: String,
    /// The consumer group.
    pub consumer_group: String,
    /// Its registered `startFrom`.
    pub start_from: StartFrom,
    /// Group state (after the time-based work at the load time).
    pub state: GroupState,
    /// Redis `TIME` (µs) when the group metadata was created or last corrected.
    pub incarnation: Micros,
    /// Group epoch.
    pub group_epoch: Epoch,
    /// Assignment epoch.
    pub assignment_epoch: Epoch,
    /// The stream `metadataVersion` the group has applied.
    pub metadata_version: u64,
    /// The stream's current `metadataVersion`.
    pub stream_metadata_version: u64,
    /// The stream's `shardCount`.
    pub shard_count: u32,
    /// Readable shards as the group applies them, ascending.
    pub readable_shard_set: Vec<ShardIndex>,
    /// Redis `TIME` of the load, µs: every lease and state here is judged at this time.
    pub now: Micros,
    /// No live member renewed its lease for over half the lease TTL: either every member is down
    /// or Redis was unreachable. The next heartbeat re-arms the leases (docs/design.md §5); until
    /// then members are shown as stored, with negative `leaseRemainingMs`.
    pub leases_stale: bool,
    /// The members (ACTIVE, LEAVING, and retired ones still holding shards).
    pub members: Vec<MemberDescription>,
    /// The capped history, newest first (with members the time-based work retires at the load
    /// time).
    pub history: Vec<PastMember>,
    /// Every shard that is not RETIRED, ascending.
    pub shards: Vec<GroupShardDescription>,
    /// The dead-letter stream `<prefix>:dlq:<group>`.
    pub dead_letter_stream: String,
    /// Its length (all shards).
    pub dead_letters: u64,
    /// Age of the oldest dead letter: Redis `TIME` at the load minus the time part of its id, ms
    /// (0 when the clock is behind the id); `None` when there is none.
    pub oldest_dead_letter_age_ms: Option<u64>,
}

/// The group as the coordinator would see it at `now` (the load time): [`coordinator::advance`]
/// on a copy, unless that would re-arm leases after an outage (then the stored group, and `true`).
pub(super) fn view_group(
    stored: &Group,
    now: Micros,
    stream: &StreamMetadata,
    config: &CoordinatorConfig,
) -> (Group, bool) {
    let view = StreamView::from(stream);
    let mut group = stored.clone();
    let ctx = Context { now, stream: &view };
    coordinator::advance(&mut group, &ctx, config);
    let rearmed = group.members.iter().any(|(id, member)| {
        stored
            .members
            .get(id)
            .is_some_and(|old| member.member_lease_expires_at > old.member_lease_expires_at)
    });
    if rearmed {
        (stored.clone(), true)
    } else {
        (group, false)
    }
}

pub(super) fn registered<'a>(
    meta: &'a StreamMetadata,
    group: &str,
) -> Result<&'a RegisteredGroup, AdminError> {
    meta.groups
        .iter()
        .find(|g| g.consumer_group == group)
        .ok_or_else(|| {
            StoreError::UnknownGroup {
                prefix: meta.stream_prefix.clone(),
                group: group.to_owned(),
            }
            .into()
        })
}

/// Describes consumer group `group` of stream `prefix`: state and epochs; per member its state,
/// epoch, lease remaining, owned / revoking / assigned / pending (target minus assigned) shards
/// and away flag; per shard (not RETIRED) the target owner, shard state, length, the group's
/// pending count, lag, last delivered id and dead-letter count. The coordinator's time-based work
/// ([`coordinator::advance`], with `config`: use the members' `[coordination]` settings) runs on a
/// copy at the load time, so expired members show as EXPIRED; nothing is written.
///
/// Dead letters: the group total is `XLEN <prefix>:dlq:<group>`; per shard they are counted from
/// the entries' `shard` field when the dead-letter stream has at most
/// [`DEAD_LETTER_SCAN_LIMIT`] entries, else left `None`.
///
/// # Errors
/// [`AdminError::InvalidName`]; [`AdminError::Store`]: [`StoreError::MissingStream`],
/// [`StoreError::UnknownGroup`] when the group is not registered, [`StoreError::MissingGroup`]
/// when it is registered but its group hash is gone (fail closed: never rebuilt),
/// corrupt metadata, Redis failure.
pub async fn describe_group(
    conn: &mut RedisConnection,
    prefix: &str,
    group: &str,
    config: &CoordinatorConfig,
) -> Result<GroupDescription, AdminError> {
    let (keys, group_keys, meta, mut store) =
        open_group(conn, prefix, group, config.clone()).await?;
    let start_from = registered(&meta, group)?.start_from;
    let loaded = store.load().await?;
    let history = store.history().await?;
    let now = loaded.now;
    let (view, leases_stale) = view_group(&loaded.group, now, &meta, config);

    let members = view
        .members
        .values()
        .map(|member| {
            let stored_lease = loaded
                .group
                .members
                .get(&member.member_id)
                .map_or(member.member_lease_expires_at, |m| {
                    m.member_lease_expires_at
                });
            let target = view.target_of(&member.member_id);
            let remaining_us = i128::from(stored_lease) - i128::from(now);
            MemberDescription {
                member_id: member.member_id.clone(),
                member_name: member.member_name.clone(),
                instance_id: member.instance_id.clone(),
                state: member.state,
                live: member.state == MemberState::Active && stored_lease > now,
                away: member.away,
                member_epoch: member.member_epoch,
                lease_remaining_ms: i64::try_from(remaining_us.div_euclid(1000))
                    .unwrap_or(i64::MIN),
                owned: member.current_assignment.iter().copied().collect(),
                revoking: member.revoking.iter().copied().collect(),
                assigned: member.assigned_shards.iter().copied().collect(),
                pending: target
                    .difference(&member.assigned_shards)
                    .copied()
                    .collect(),
                target: target.iter().copied().collect(),
                runtime_max_concurrency: member.runtime_max_concurrency,
                active_consumer_workers: member.active_consumer_workers,
            }
        })
        .collect();

    let dead_letter_stream = keys.dead_letters(&group_keys);
    let dead_letters: u64 = conn
        .xlen(&dead_letter_stream)
        .await
        .map_err(StoreError::from)?;
    let per_shard = dead_letters_per_shard(conn, &dead_letter_stream, dead_letters).await?;
    let oldest_dead_letter_age_ms =
        oldest_dead_letter_age_ms(conn, &dead_letter_stream, now).await?;

    let mut shards = Vec::new();
    for shard in meta
        .shards
        .iter()
        .filter(|s| s.state != ShardState::Retired)
    {
        let index = shard.shard_index;
        let info = scripts::shard_info(conn, &keys, index).await?;
        let length = info.as_ref().map(|(length, _)| *length);
        let mine = info.and_then(|(_, groups)| groups.into_iter().find(|g| g.name == group));
        let target_owner = view
            .meta
            .target_assignment
            .members
            .iter()
            .find(|(_, shards)| shards.contains(&index))
            .map(|(member, _)| member.clone());
        shards.push(GroupShardDescription {
            shard_index: index,
            state: shard.state,
            target_owner,
            length,
            consumer_group_exists: mine.is_some(),
            pending: mine.as_ref().map(|g| g.pending),
            lag: Lag::from_raw(mine.as_ref().and_then(|g| g.lag)),
            last_delivered_id: mine.map(|g| g.last_delivered_id),
            dead_letters: per_shard
                .as_ref()
                .map(|counts| counts.iter().filter(|s| **s == index).count() as u64),
        });
    }

    Ok(GroupDescription {
        stream_prefix: prefix.to_owned(),
        consumer_group: group.to_owned(),
        start_from,
        state: view.meta.state,
        incarnation: view.meta.incarnation,
        group_epoch: view.meta.group_epoch,
        assignment_epoch: view.meta.assignment_epoch,
        metadata_version: view.meta.metadata_version,
        stream_metadata_version: meta.metadata_version,
        shard_count: meta.shard_count,
        readable_shard_set: view.meta.readable_shard_set.iter().copied().collect(),
        now,
        leases_stale,
        members,
        // Members the time-based work just retired, then the stored history: newest first.
        history: view
            .history
            .iter()
            .cloned()
            .chain(history)
            .map(|m| PastMember {
                member_id: m.member_id,
                member_name: m.member_name,
                state: m.state,
                member_epoch: m.member_epoch,
            })
            .collect(),
        shards,
        dead_letter_stream,
        dead_letters,
        oldest_dead_letter_age_ms,
    })
}

/// `now` (µs) minus the time part of the first dead letter's id, ms; `None` without one.
async fn oldest_dead_letter_age_ms(
    conn: &mut RedisConnection,
    key: &str,
    now: Micros,
) -> Result<Option<u64>, AdminError> {
    let first: Vec<(String, redis::Value)> = conn
        .xrange_count(key, "-", "+", 1)
        .await
        .map_err(StoreError::from)?;
    Ok(first.first().map(|(id, _)| {
        let id_ms = crate::admin::dlq::parse_entry_id(id).map_or(0, |(ms, _)| ms);
        (now / 1000).saturating_sub(id_ms)
    }))
}

/// The `shard` field of every dead letter, when the stream is short enough to read whole.
async fn dead_letters_per_shard(
    conn: &mut RedisConnection,
    key: &str,
    length: u64,
) -> Result<Option<Vec<ShardIndex>>, AdminError> {
    if length == 0 {
        return Ok(Some(Vec::new()));
    }
    if length > DEAD_LETTER_SCAN_LIMIT as u64 {
        return Ok(None);
    }
    let reply: StreamRangeReply = conn
        .xrange_count(key, "-", "+", DEAD_LETTER_SCAN_LIMIT + 1)
        .await
        .map_err(StoreError::from)?;
    if reply.ids.len() > DEAD_LETTER_SCAN_LIMIT {
        return Ok(None);
    }
    Ok(Some(
        reply
            .ids
            .iter()
            .filter_map(|entry| entry.get::<String>("shard")?.parse().ok())
            .collect(),
    ))
}
