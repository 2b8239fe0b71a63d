//! Time-based work for the whole group (rule 1 of docs/design.md §6): outages, hand-out holds,
//! the readable shard set, expiry and fencing, retirement to the history.

use std::collections::BTreeSet;

use super::timings::member_lease_ttl_us;
use crate::coordinator::{Context, CoordinatorConfig, Group};
use crate::model::{MemberMetadata, MemberState, Micros, ShardIndex};

/// If every live member's last lease renewal is older than half its own lease TTL, Redis or
/// every member was unreachable: extend leases and revoke deadlines by the time since the most
/// recent renewal, as Kafka does on coordinator load, so an outage does not expire everyone
/// (docs/design.md §5). This only delays hand-offs: a member reads by its own lease deadline, which
/// never passes later than the recorded one, so extending a record is always safe. Replaced
/// processes are not extended. Each member is judged by its own TTL (members of one group may
/// run different `[coordination]` timings, docs/design.md §6.5): one member renewing on its own
/// schedule is proof enough that there was no outage, and a renewal is its lease minus its TTL.
pub(super) fn rearm_leases_after_outage(
    group: &mut Group,
    now: Micros,
    config: &CoordinatorConfig,
) {
    let mut last_renewal: Option<Micros> = None;
    for member in group.members.values() {
        if !matches!(member.state, MemberState::Active | MemberState::Leaving) {
            continue;
        }
        let ttl = member_lease_ttl_us(member, config);
        let renewal = member.member_lease_expires_at.saturating_sub(ttl);
        if now.saturating_sub(renewal) <= ttl / 2 {
            return;
        }
        last_renewal = Some(last_renewal.map_or(renewal, |r| r.max(renewal)));
    }
    let Some(last_renewal) = last_renewal else {
        return;
    };
    let gap = now.saturating_sub(last_renewal);
    for member in group.members.values_mut() {
        if matches!(member.state, MemberState::Active | MemberState::Leaving) {
            member.member_lease_expires_at += gap;
            if let Some(deadline) = member.revoke_deadline.as_mut() {
                *deadline += gap;
            }
        }
    }
}

/// A hand-out hold (set when metadata was re-provisioned after a loss) that has passed blocks
/// nothing any more; clearing it keeps it out of [`next_deadline`], which the fast path checks.
pub(super) fn end_hand_out_hold_if_passed(
    group: &mut Group,
    now: Micros,
    config: &CoordinatorConfig,
) {
    let _ = config;
    #[cfg(test)]
    if config.variant.hand_out_hold_forever {
        return;
    }
    if group.meta.hand_out_not_before.is_some_and(|t| now >= t) {
        group.meta.hand_out_not_before = None;
    }
}

/// A changed readable shard set or shard count (scale-out, drain, retirement) bumps `groupEpoch`.
pub(super) fn apply_stream_view(group: &mut Group, ctx: &Context<'_>) {
    let stream = ctx.stream;
    let meta = &mut group.meta;
    if meta.readable_shard_set != stream.readable || meta.shard_count != stream.shard_count {
        meta.group_epoch += 1;
        meta.readable_shard_set = stream.readable.clone();
        meta.shard_count = stream.shard_count;
    }
    meta.metadata_version = stream.metadata_version;
}

pub(super) fn expire_and_fence(group: &mut Group, now: Micros) {
    let mut bumps = 0;
    let target = &group.meta.target_assignment.members;
    for member in group.members.values_mut() {
        let live_state = matches!(member.state, MemberState::Active | MemberState::Leaving);
        if live_state && member.member_lease_expires_at <= now {
            if member.state == MemberState::Active {
                member.state = MemberState::Expired;
                bumps += 1;
            } else {
                member.state = MemberState::Left;
            }
            release_all(member);
        } else if member.state == MemberState::Active
            && member.revoke_deadline.is_some_and(|d| now >= d)
            && !reported_within(member, target.get(&member.member_id))
        {
            member.state = MemberState::Fenced;
            member.revoke_deadline = None;
            bumps += 1;
        }
    }
    group.meta.group_epoch += bumps;
}

pub(super) fn release_all(member: &mut MemberMetadata) {
    member.current_assignment.clear();
    member.revoking.clear();
    member.assigned_shards.clear();
    member.revoke_deadline = None;
    member.away = false;
}

/// Whether everything the member reported (owned and draining) is in its target.
pub(super) fn reported_within(
    member: &MemberMetadata,
    target: Option<&BTreeSet<ShardIndex>>,
) -> bool {
    let in_target = |s: &ShardIndex| target.is_some_and(|t| t.contains(s));
    member.current_assignment.iter().all(in_target) && member.revoking.iter().all(in_target)
}

/// Drops lapsed old-process holdings and moves EXPIRED / FENCED / LEFT members that hold nothing
/// any more to the capped history (newest first).
pub(super) fn retire_finished_members(group: &mut Group, now: Micros, config: &CoordinatorConfig) {
    let mut finished = Vec::new();
    for (id, member) in group.members.iter_mut() {
        member
            .old_process_holdings
            .retain(|old| old.lease_expires_at > now);
        let terminal = matches!(
            member.state,
            MemberState::Expired | MemberState::Fenced | MemberState::Left
        );
        if terminal && !holds_anything(member, now) && member.old_process_holdings.is_empty() {
            finished.push(id.clone());
        }
    }
    for id in finished {
        if let Some(member) = group.members.remove(&id) {
            group.history.push_front(member);
        }
    }
    group.history.truncate(config.history_capacity);
}

pub(super) fn holds_anything(member: &MemberMetadata, now: Micros) -> bool {
    member.member_lease_expires_at > now
        && !(member.current_assignment.is_empty()
            && member.revoking.is_empty()
            && member.assigned_shards.is_empty())
}
