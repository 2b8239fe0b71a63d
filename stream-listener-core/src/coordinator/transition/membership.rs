//! Identity, join, leave and the member's report (rules 3–7 of docs/design.md §6).

use std::collections::BTreeSet;

use super::Answer;
use super::correction::in_correction_round;
use super::holdings::{held_shards, is_blocked};
use super::time::{holds_anything, release_all};
use super::timings::record_timings;
use crate::coordinator::{CoordinatorConfig, Group};
use crate::model::{
    HeartbeatRequest, HeartbeatStatus, MemberMetadata, MemberState, Micros, OldProcessHolding,
    RevokeState, ShardIndex,
};

pub(super) fn join(
    group: &mut Group,
    request: &HeartbeatRequest,
    now: Micros,
    config: &CoordinatorConfig,
) -> Answer {
    let id = &request.member_id;
    let existing = group.members.remove(id);
    let member = match existing {
        None => new_member(request),
        Some(old) if matches!(old.state, MemberState::Expired | MemberState::Left) => {
            // It holds nothing; replaced processes it remembers still do.
            let mut member = new_member(request);
            member.member_epoch = old.member_epoch;
            member.old_process_holdings = old.old_process_holdings.clone();
            group.history.push_front(old);
            member
        }
        Some(mut same) if same.process_id == request.process_id => {
            // The member cleared its state after a fencing status: its holdings go at once.
            release_all(&mut same);
            same.state = MemberState::Active;
            same
        }
        Some(replaced) => replace_process(replaced, request, now, config),
    };
    group.members.insert(id.clone(), member);
    group.meta.group_epoch += 1;
    if let Some(answer) = apply_report(group, request, now, config) {
        return answer;
    }
    if let Some(round) = group.meta.correction_round.as_mut() {
        round.synced_members.remove(id);
        return Answer::Accepted(HeartbeatStatus::RevokePending);
    }
    Answer::Accepted(HeartbeatStatus::Ok)
}

pub(super) fn new_member(request: &HeartbeatRequest) -> MemberMetadata {
    MemberMetadata {
        member_id: request.member_id.clone(),
        member_name: request.member_name.clone(),
        instance_id: request.instance_id.clone(),
        process_id: request.process_id.clone(),
        state: MemberState::Active,
        away: false,
        member_epoch: 0,
        previous_member_epoch: 0,
        assigned_shards: BTreeSet::new(),
        previous_assigned_shards: BTreeSet::new(),
        current_assignment: BTreeSet::new(),
        revoking: BTreeSet::new(),
        old_process_holdings: Vec::new(),
        last_request_seq: 0,
        last_response: None,
        metadata_version: request.metadata_version,
        runtime_max_concurrency: request.runtime_max_concurrency.max(1),
        active_consumer_workers: request.active_consumer_workers,
        last_heartbeat_at: 0,
        member_lease_expires_at: 0,
        revoke_deadline: None,
        heartbeat_interval_ms: 0,
        member_lease_ttl_ms: 0,
        rebalance_timeout_ms: 0,
    }
}

/// A different process takes the member id (a static member restarted, or a second process with
/// the same `instance_id`): the last join wins. What the replaced process may still be reading
/// becomes an entry of `oldProcessHoldings` until its lease runs out.
pub(super) fn replace_process(
    replaced: MemberMetadata,
    request: &HeartbeatRequest,
    now: Micros,
    config: &CoordinatorConfig,
) -> MemberMetadata {
    let _ = config;
    let mut member = new_member(request);
    member.member_epoch = replaced.member_epoch;
    member.previous_member_epoch = replaced.previous_member_epoch;
    member.old_process_holdings = replaced.old_process_holdings.clone();
    #[cfg(test)]
    if config.variant.single_ghost {
        member.old_process_holdings.clear();
    }
    let held: BTreeSet<ShardIndex> = replaced
        .current_assignment
        .iter()
        .chain(&replaced.revoking)
        .chain(&replaced.assigned_shards)
        .copied()
        .collect();
    #[cfg(test)]
    let release_at_once = config.variant.release_on_foreign_join;
    #[cfg(not(test))]
    let release_at_once = false;
    if !held.is_empty() && replaced.member_lease_expires_at > now && !release_at_once {
        member.old_process_holdings.push(OldProcessHolding {
            process_id: replaced.process_id,
            shards: held,
            lease_expires_at: replaced.member_lease_expires_at,
        });
    }
    member
}

/// Leave (`-1`): `LEAVING`, target emptied, shards released as reported `REVOKED`, then `LEFT`.
/// Static leave (`-2`, only with an `instanceId`): the lease is renewed from the leave and the
/// target stays reserved while it runs.
/// A replaced process leaving releases what it reports `REVOKED` from its old holdings.
pub(super) fn leave(
    group: &mut Group,
    request: &HeartbeatRequest,
    now: Micros,
    config: &CoordinatorConfig,
    static_leave: bool,
) -> Answer {
    let Some(member) = group.members.get_mut(&request.member_id) else {
        return Answer::Fencing(HeartbeatStatus::UnknownMemberId);
    };
    if member.process_id != request.process_id {
        release_old_process_shards(member, request);
        return Answer::Fencing(HeartbeatStatus::FencedInstanceId);
    }
    let static_leave = static_leave && member.instance_id.is_some();
    let held_before = held_shards(member);
    apply_revokes(member, request, &held_before, false);
    // The member stopped before leaving: what it reports is all it still has.
    member.current_assignment = request
        .owned_shards
        .iter()
        .filter(|s| held_before.contains(s))
        .copied()
        .collect();
    member.assigned_shards.clear();
    match member.state {
        MemberState::Active if static_leave => {
            // The reservation runs one lease from the leave, not from the heartbeat before it:
            // a pod that stops just before a heartbeat is due gets its whole lease to come back.
            member.away = true;
            renew_lease(member, now, config);
        }
        MemberState::Active => {
            member.state = MemberState::Leaving;
            member.revoke_deadline = None;
            group.meta.group_epoch += 1;
        }
        _ => {}
    }
    if member.state == MemberState::Leaving {
        if holds_anything(member, now) {
            renew_lease(member, now, config);
        } else {
            member.state = MemberState::Left;
        }
    }
    Answer::Accepted(HeartbeatStatus::Ok)
}

pub(super) fn release_old_process_shards(member: &mut MemberMetadata, request: &HeartbeatRequest) {
    let revoked: BTreeSet<ShardIndex> = revoked_shards(request).collect();
    for old in &mut member.old_process_holdings {
        if old.process_id == request.process_id {
            old.shards.retain(|s| !revoked.contains(s));
        }
    }
    member
        .old_process_holdings
        .retain(|old| !old.shards.is_empty());
}

/// A normal heartbeat (`memberEpoch > 0`): identity and epoch checks (rule 3), report (rule 6),
/// lease (rule 7). In a correction round, known members get `SYNC_METADATA` whatever their epoch.
pub(super) fn member_heartbeat(
    group: &mut Group,
    request: &HeartbeatRequest,
    now: Micros,
    config: &CoordinatorConfig,
) -> Answer {
    let Some(member) = group.members.get(&request.member_id) else {
        return Answer::Fencing(HeartbeatStatus::UnknownMemberId);
    };
    if member.process_id != request.process_id {
        // A higher epoch from another process is evidence of lost metadata (a correction round
        // has started): the process rejoins. A lower one is a replaced process: it stops.
        return Answer::Fencing(if request.member_epoch > member.member_epoch {
            HeartbeatStatus::UnknownMemberId
        } else {
            HeartbeatStatus::FencedInstanceId
        });
    }
    if !matches!(member.state, MemberState::Active) {
        return Answer::Fencing(HeartbeatStatus::FencedMemberEpoch);
    }
    if let Some(round) = group.meta.correction_round.as_mut() {
        if request.member_epoch >= round.base_epoch {
            round.synced_members.insert(request.member_id.clone());
        }
    } else if !epoch_accepted(member, request) {
        return Answer::Fencing(HeartbeatStatus::FencedMemberEpoch);
    }
    if let Some(answer) = apply_report(group, request, now, config) {
        return answer;
    }
    let Some(member) = group.members.get_mut(&request.member_id) else {
        return Answer::Fencing(HeartbeatStatus::UnknownMemberId);
    };
    member.member_name.clone_from(&request.member_name);
    member.away = false;
    member.metadata_version = request.metadata_version;
    member.active_consumer_workers = request.active_consumer_workers;
    let weight = request.runtime_max_concurrency.max(1);
    if member.runtime_max_concurrency != weight {
        member.runtime_max_concurrency = weight;
        group.meta.group_epoch += 1;
    }
    Answer::Accepted(if in_correction_round(group) {
        HeartbeatStatus::SyncMetadata
    } else {
        HeartbeatStatus::Ok
    })
}

/// The stored epoch, or the previous one when the member owns nothing it was not given then (its
/// last response was lost: a healthy member must not be fenced for it).
pub(super) fn epoch_accepted(member: &MemberMetadata, request: &HeartbeatRequest) -> bool {
    request.member_epoch == member.member_epoch
        || (request.member_epoch == member.previous_member_epoch
            && request
                .owned_shards
                .iter()
                .all(|s| member.previous_assigned_shards.contains(s)))
}

/// Validates and records the member's report (rule 6) and renews its lease (rule 7). Returns a
/// fencing answer when it reports as owned a shard it neither holds nor may take (outside a
/// correction round, where every reported shard counts as held).
pub(super) fn apply_report(
    group: &mut Group,
    request: &HeartbeatRequest,
    now: Micros,
    config: &CoordinatorConfig,
) -> Option<Answer> {
    let id = &request.member_id;
    let member = group.members.get(id)?;
    let held_before = held_shards(member);
    if !in_correction_round(group) {
        let target = group.target_of(id);
        let may_own = |s: &ShardIndex| {
            held_before.contains(s)
                || (target.contains(s) && !is_blocked(group, *s, id, now, config))
        };
        if !request.owned_shards.iter().all(may_own) {
            let member = group.members.get_mut(id)?;
            member.state = MemberState::Fenced;
            member.revoke_deadline = None;
            group.meta.group_epoch += 1;
            tracing::warn!(member = %id, "member reported a shard it does not hold: fenced");
            return Some(Answer::Fencing(HeartbeatStatus::FencedMemberEpoch));
        }
    }
    let in_round = in_correction_round(group);
    let member = group.members.get_mut(id)?;
    member.current_assignment = request.owned_shards.iter().copied().collect();
    apply_revokes(member, request, &held_before, in_round);
    renew_lease(member, now, config);
    None
}

/// `REVOKED` releases a shard; `DRAINING` keeps a held shard held (in a correction round every
/// reported shard counts as held).
pub(super) fn apply_revokes(
    member: &mut MemberMetadata,
    request: &HeartbeatRequest,
    held_before: &BTreeSet<ShardIndex>,
    in_correction_round: bool,
) {
    member.revoking = request
        .revoking_shards
        .iter()
        .filter(|r| r.state == RevokeState::Draining)
        .filter(|r| in_correction_round || held_before.contains(&r.shard_index))
        .map(|r| r.shard_index)
        .collect();
}

pub(super) fn revoked_shards(request: &HeartbeatRequest) -> impl Iterator<Item = ShardIndex> + '_ {
    request
        .revoking_shards
        .iter()
        .filter(|r| r.state == RevokeState::Revoked)
        .map(|r| r.shard_index)
}

/// Renews the requesting member's lease by its own TTL: `config` is that of the process whose
/// heartbeat runs, and becomes the member's recorded timings.
pub(super) fn renew_lease(member: &mut MemberMetadata, now: Micros, config: &CoordinatorConfig) {
    record_timings(member, config);
    member.last_heartbeat_at = now;
    member.member_lease_expires_at = now + config.lease_ttl_us();
}
