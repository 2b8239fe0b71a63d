//! The target assignment and the response (rules 8–9 of docs/design.md §6).

use std::collections::{BTreeMap, BTreeSet};

use super::holdings::{blocked_among, is_live};
use super::time::reported_within;
use super::timings::{member_rebalance_timeout_us, ms, with_own_timings};
use crate::assignor;
use crate::assignor::AssignorMember;
use crate::coordinator::{CoordinatorConfig, Group};
use crate::model::{
    HeartbeatRequest, HeartbeatResponse, HeartbeatStatus, MemberState, Micros, ShardIndex,
    TargetAssignment,
};

/// Rule 8: a new sticky target when `groupEpoch > assignmentEpoch`; revoke deadlines for members
/// that must give up shards, cleared for those that have.
pub(super) fn recompute_target(group: &mut Group, now: Micros, config: &CoordinatorConfig) {
    let meta = &mut group.meta;
    if meta.group_epoch > meta.assignment_epoch {
        let live: Vec<AssignorMember> = group
            .members
            .values()
            .filter(|m| is_live(m, now))
            .map(|m| AssignorMember {
                member_id: m.member_id.clone(),
                weight: m.runtime_max_concurrency,
            })
            .collect();
        // A join that leaves the live set as it was (a static member back from a new process)
        // moves the group epoch but not the target: skip the assignor's per-shard work.
        let previous = &meta.target_assignment.members;
        let members = if assignor::keeps_previous(&meta.readable_shard_set, &live, previous) {
            std::mem::take(&mut meta.target_assignment.members)
        } else {
            sticky_target(&meta.readable_shard_set, &live, previous)
        };
        meta.assignment_epoch = meta.group_epoch;
        meta.target_assignment = TargetAssignment {
            assignment_epoch: meta.group_epoch,
            group_epoch: meta.group_epoch,
            members,
        };
    }
    let target = &group.meta.target_assignment.members;
    for member in group.members.values_mut() {
        if member.state != MemberState::Active {
            continue;
        }
        if reported_within(member, target.get(&member.member_id)) {
            member.revoke_deadline = None;
        } else if member.revoke_deadline.is_none() {
            member.revoke_deadline = Some(now + member_rebalance_timeout_us(member, config));
        }
    }
}

/// The sticky assignor's target (docs/design.md §7) as the group stores it: member → shards.
fn sticky_target(
    readable: &BTreeSet<ShardIndex>,
    live: &[AssignorMember],
    previous: &BTreeMap<String, BTreeSet<ShardIndex>>,
) -> BTreeMap<String, BTreeSet<ShardIndex>> {
    let previous: assignor::Target = previous
        .iter()
        .flat_map(|(id, shards)| shards.iter().map(move |s| (*s, id.clone())))
        .collect();
    let mut members = BTreeMap::<String, BTreeSet<ShardIndex>>::new();
    for (shard, owner) in assignor::assign(readable, live, &previous) {
        members.entry(owner).or_default().insert(shard);
    }
    members
}

/// Rule 9: `assignedShards` = target shards held by no one else; `pendingShards` = the rest. The
/// member epoch moves to `assignmentEpoch` when `assignedShards` changes (and on every join).
pub(super) fn respond(
    group: &mut Group,
    member_id: &str,
    status: HeartbeatStatus,
    now: Micros,
    config: &CoordinatorConfig,
    force_epoch: bool,
) -> HeartbeatResponse {
    let target = group.target_of(member_id).clone();
    let blocked = blocked_among(group, &target, member_id, now, config);
    let (assigned, pending): (BTreeSet<ShardIndex>, BTreeSet<ShardIndex>) =
        target.iter().partition(|s| !blocked.contains(s));
    // A joiner during a correction round is registered but gets nothing to start; a static
    // member away after `-2` is sent nothing while its target stays reserved.
    let away = group.members.get(member_id).is_some_and(|m| m.away);
    let (assigned, pending) = if status == HeartbeatStatus::RevokePending || away {
        (BTreeSet::new(), target)
    } else {
        (assigned, pending)
    };
    let assignment_epoch = group.meta.assignment_epoch;
    let round_base = group.meta.correction_round.as_ref().map(|r| r.base_epoch);
    let base = base_response(group, config);
    let response = match group.members.get_mut(member_id) {
        Some(member) => {
            let stale_incarnation = round_base.is_some_and(|base| member.member_epoch < base);
            if force_epoch || stale_incarnation || assigned != member.assigned_shards {
                member.previous_member_epoch = member.member_epoch;
                member.previous_assigned_shards =
                    std::mem::replace(&mut member.assigned_shards, assigned.clone());
                member.member_epoch = assignment_epoch;
            }
            with_own_timings(
                HeartbeatResponse {
                    member_epoch: member.member_epoch,
                    ..base
                },
                member,
                config,
            )
        }
        None => base,
    };
    HeartbeatResponse {
        status,
        assigned_shards: assigned.into_iter().collect(),
        pending_shards: pending.into_iter().collect(),
        ..response
    }
}

pub(super) fn fencing_response(
    group: &Group,
    request: &HeartbeatRequest,
    status: HeartbeatStatus,
    config: &CoordinatorConfig,
) -> HeartbeatResponse {
    let member_epoch = group
        .members
        .get(&request.member_id)
        .filter(|m| m.process_id == request.process_id)
        .map_or(0, |m| m.member_epoch);
    HeartbeatResponse {
        status,
        member_epoch,
        ..base_response(group, config)
    }
}

/// A response carrying the group's epochs and the timings, status `OK`, nothing assigned.
pub(crate) fn base_response(group: &Group, config: &CoordinatorConfig) -> HeartbeatResponse {
    HeartbeatResponse {
        status: HeartbeatStatus::Ok,
        member_epoch: 0,
        group_epoch: group.meta.group_epoch,
        assignment_epoch: group.meta.assignment_epoch,
        metadata_version: group.meta.metadata_version,
        incarnation: group.meta.incarnation,
        assigned_shards: Vec::new(),
        pending_shards: Vec::new(),
        heartbeat_interval_ms: ms(config.heartbeat_interval),
        member_lease_ttl_ms: ms(config.member_lease_ttl),
        rebalance_timeout_ms: ms(config.rebalance_timeout),
    }
}
