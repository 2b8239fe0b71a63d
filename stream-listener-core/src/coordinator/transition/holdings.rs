//! What each member and replaced process holds, and which shards that blocks (docs/design.md
//! §6.3).

use std::collections::BTreeSet;

use crate::coordinator::{CoordinatorConfig, Group};
use crate::model::{MemberMetadata, MemberState, Micros, ShardIndex};

/// What a member holds, its lease aside: the shards last sent as assigned, last reported owned,
/// and last reported draining (docs/design.md §6.3, holdings).
pub(super) fn held_shards(member: &MemberMetadata) -> BTreeSet<ShardIndex> {
    member
        .assigned_shards
        .iter()
        .chain(&member.current_assignment)
        .chain(&member.revoking)
        .copied()
        .collect()
}

pub(super) fn holds(
    member: &MemberMetadata,
    shard: ShardIndex,
    now: Micros,
    config: &CoordinatorConfig,
) -> bool {
    let _ = config;
    #[cfg(test)]
    if config.variant.no_lease_wait
        && !matches!(member.state, MemberState::Active | MemberState::Leaving)
    {
        return false;
    }
    #[cfg(test)]
    let sent = !config.variant.ignore_sent && member.assigned_shards.contains(&shard);
    #[cfg(not(test))]
    let sent = member.assigned_shards.contains(&shard);
    member.member_lease_expires_at > now
        && (sent || member.current_assignment.contains(&shard) || member.revoking.contains(&shard))
}

/// A shard is blocked for `member_id` while another member, or any replaced process (its own
/// included), holds it, or while a re-provisioned group waits out the lease of the lost one.
pub(super) fn is_blocked(
    group: &Group,
    shard: ShardIndex,
    member_id: &str,
    now: Micros,
    config: &CoordinatorConfig,
) -> bool {
    if group.meta.hand_out_not_before.is_some_and(|t| now < t) {
        return true;
    }
    group.members.values().any(|other| {
        let old_holds = other
            .old_process_holdings
            .iter()
            .any(|old| old.lease_expires_at > now && old.shards.contains(&shard));
        old_holds || (other.member_id != member_id && holds(other, shard, now, config))
    })
}

/// The shards of `shards` that are blocked for `member_id` (see [`is_blocked`]), in one pass over
/// the members: what each holds is small, so this costs the group's holdings, not members × shards.
pub(super) fn blocked_among(
    group: &Group,
    shards: &BTreeSet<ShardIndex>,
    member_id: &str,
    now: Micros,
    config: &CoordinatorConfig,
) -> BTreeSet<ShardIndex> {
    if shards.is_empty() {
        return BTreeSet::new();
    }
    if group.meta.hand_out_not_before.is_some_and(|t| now < t) {
        return shards.clone();
    }
    let mut blocked = BTreeSet::new();
    for other in group.members.values() {
        for old in &other.old_process_holdings {
            if old.lease_expires_at > now {
                blocked.extend(old.shards.intersection(shards).copied());
            }
        }
        if other.member_id == member_id || other.member_lease_expires_at <= now {
            continue;
        }
        let held = other
            .assigned_shards
            .iter()
            .chain(&other.current_assignment)
            .chain(&other.revoking);
        blocked.extend(held.filter(|s| shards.contains(s) && holds(other, **s, now, config)));
    }
    blocked
}

pub(super) fn is_live(member: &MemberMetadata, now: Micros) -> bool {
    member.state == MemberState::Active && member.member_lease_expires_at > now
}
