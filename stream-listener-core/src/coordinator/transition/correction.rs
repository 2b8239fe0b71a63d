//! Lost metadata: the evidence and the correction round (rule 2, docs/design.md §6.6).

use std::collections::{BTreeMap, BTreeSet};

use super::holdings::{held_shards, is_live};
use super::timings::member_lease_ttl_us;
use crate::coordinator::{CoordinatorConfig, CoordinatorError, Group};
use crate::fence::FenceToken;
use crate::model::{
    COUNTER_LIMIT, CorrectionRound, Epoch, HeartbeatRequest, MemberState, Micros, ShardIndex,
};

/// Evidence that stored metadata lost writes (docs/design.md §6): the request carries a version or
/// an epoch the coordinator never handed out as far as it remembers, or a fence conflict above
/// the stored `(incarnation, groupEpoch)`, or a fence conflict on a shard the coordinator says
/// the reporting member holds.
pub(super) fn is_lost_metadata_evidence(
    group: &Group,
    request: &HeartbeatRequest,
    now: Micros,
    config: &CoordinatorConfig,
) -> bool {
    let meta = &group.meta;
    if request.metadata_version > meta.metadata_version || request.member_epoch > meta.group_epoch {
        return true;
    }
    if let Some(member) = group.members.get(&request.member_id)
        && request.member_epoch > member.member_epoch
    {
        return true;
    }
    // A member the coordinator counts as the holder of a shard finds a higher fence on it: no
    // one can have been given that shard since, unless writes were lost (the token may even be
    // below the stored group epoch: epochs lost in a revert are handed out again).
    let holder = group.members.get(&request.member_id).filter(|m| {
        m.process_id == request.process_id
            && m.state == MemberState::Active
            && m.member_lease_expires_at > now
    });
    // Strictly above: a fence *at* the stored epoch is what every member given a shard at the
    // current epoch raises, so a zombie that finds one (its shard moved on while it was paused)
    // reports no lost write, and counting it started a needless correction round.
    let stored = (meta.incarnation, meta.group_epoch);
    #[cfg(test)]
    let at_stored_counts = config.variant.evidence_at_stored_epoch;
    #[cfg(not(test))]
    let at_stored_counts = false;
    let _ = config;
    request.fence_conflicts.iter().any(|c| {
        (c.incarnation, c.epoch) > stored
            || (at_stored_counts && (c.incarnation, c.epoch) == stored)
            || holder.is_some_and(|m| held_shards(m).contains(&c.shard_index))
    })
}

/// Evidence, during a correction round, that the round itself was restored by lost writes
/// after it had ended (or that a later round was lost): an epoch or version above the stored
/// ones, or a fence raised at or above the round's incarnation (no one starts a shard while the
/// round runs, and the round's incarnation is above every fence found when it started).
pub(super) fn is_lost_round_evidence(group: &Group, request: &HeartbeatRequest) -> bool {
    let meta = &group.meta;
    request.metadata_version > meta.metadata_version
        || request.member_epoch > meta.group_epoch
        || request
            .fence_conflicts
            .iter()
            .any(|c| c.incarnation >= meta.incarnation)
}

/// Starts a new incarnation above every token found, with epochs restarting above any found,
/// lasting at least one lease TTL (the longest of the known members' own TTLs and this
/// transition's) and until every live member has heartbeated on it.
pub(super) fn start_correction_round(
    group: &mut Group,
    request: &HeartbeatRequest,
    fences: &BTreeMap<ShardIndex, FenceToken>,
    now: Micros,
    config: &CoordinatorConfig,
) -> Result<(), CoordinatorError> {
    let meta = &group.meta;
    let conflicts = request.fence_conflicts.iter();
    let highest_incarnation = fences
        .values()
        .map(|t| t.incarnation)
        .chain(conflicts.clone().map(|c| c.incarnation))
        .fold(meta.incarnation, u64::max);
    let highest_epoch = fences
        .values()
        .map(|t| t.member_epoch)
        .chain(conflicts.map(|c| c.epoch))
        .chain(group.members.values().map(|m| m.member_epoch))
        .chain([request.member_epoch, meta.assignment_epoch])
        .fold(meta.group_epoch, Epoch::max);
    let longest_ttl = group
        .members
        .values()
        .map(|m| member_lease_ttl_us(m, config))
        .fold(config.lease_ttl_us(), Micros::max);
    // Checked, not saturating: a new incarnation and epoch must be strictly above every token
    // found, or the round would leave them in charge (and start again on every report). Tokens
    // and stored counters at or above COUNTER_LIMIT are refused before, so this only answers a
    // corrupt group built by hand.
    let at_limit =
        |field: &'static str, value: String| CoordinatorError::CounterAtLimit { field, value };
    let incarnation = highest_incarnation
        .checked_add(1)
        .filter(|i| *i < COUNTER_LIMIT)
        .ok_or_else(|| at_limit("incarnation", highest_incarnation.to_string()))?;
    let group_epoch = highest_epoch
        .checked_add(1)
        .filter(|e| e.unsigned_abs() < COUNTER_LIMIT)
        .ok_or_else(|| at_limit("groupEpoch", highest_epoch.to_string()))?;
    let meta = &mut group.meta;
    meta.incarnation = now.max(incarnation);
    meta.group_epoch = group_epoch;
    meta.correction_round = Some(CorrectionRound {
        started_at: now,
        not_before_end: now + longest_ttl,
        base_epoch: meta.group_epoch,
        synced_members: BTreeSet::new(),
    });
    tracing::warn!(
        stream = %meta.stream_prefix,
        group = %meta.consumer_group,
        member = %request.member_id,
        incarnation = meta.incarnation,
        group_epoch = meta.group_epoch,
        "lost group metadata suspected: correction round started"
    );
    Ok(())
}

pub(super) fn end_correction_round_if_done(group: &mut Group, now: Micros) {
    let Some(round) = &group.meta.correction_round else {
        return;
    };
    let everyone_synced = group
        .members
        .values()
        .filter(|m| is_live(m, now))
        .all(|m| m.away || round.synced_members.contains(&m.member_id));
    if now >= round.not_before_end && everyone_synced {
        group.meta.correction_round = None;
    }
}

pub(super) fn in_correction_round(group: &Group) -> bool {
    group.meta.correction_round.is_some()
}
