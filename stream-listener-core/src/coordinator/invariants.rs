//! The invariants of docs/design.md §4, checked on a [`Group`] after every transition by the tests.

use std::collections::BTreeSet;

use super::Group;
use crate::model::{GroupState, MemberMetadata, MemberState, Micros, ShardIndex};

fn is_live(member: &MemberMetadata, now: Micros) -> bool {
    member.state == MemberState::Active && member.member_lease_expires_at > now
}

fn holds(member: &MemberMetadata, shard: ShardIndex, now: Micros) -> bool {
    member.member_lease_expires_at > now
        && (member.assigned_shards.contains(&shard)
            || member.current_assignment.contains(&shard)
            || member.revoking.contains(&shard))
}

/// Checks invariants 1, 2, 4 and 5 (and 3 on the coordinator's side: one holder per shard, when
/// `holdings_exclusive` says no write was lost) at `now`, right after a transition.
pub(crate) fn check_group(
    group: &Group,
    now: Micros,
    holdings_exclusive: bool,
) -> Result<(), String> {
    let meta = &group.meta;
    let target = &meta.target_assignment;
    // 1. assignmentEpoch equals the groupEpoch the target came from and never exceeds it.
    if meta.assignment_epoch > meta.group_epoch {
        return Err(format!(
            "assignmentEpoch {} > groupEpoch {}",
            meta.assignment_epoch, meta.group_epoch
        ));
    }
    if target.assignment_epoch != meta.assignment_epoch
        || target.group_epoch != meta.assignment_epoch
    {
        return Err(format!(
            "target computed for epoch {}/{} but assignmentEpoch is {}",
            target.assignment_epoch, target.group_epoch, meta.assignment_epoch
        ));
    }
    // 2 and 4. Each readable (ACTIVE or DRAINING) shard has exactly one target owner, a live member.
    let any_live = group.members.values().any(|m| is_live(m, now));
    let mut owners = std::collections::BTreeMap::new();
    for (member, shards) in &target.members {
        for shard in shards {
            if owners.insert(*shard, member.clone()).is_some() {
                return Err(format!("shard {shard} has two target owners"));
            }
        }
    }
    let targeted: BTreeSet<ShardIndex> = owners.keys().copied().collect();
    if any_live && meta.group_epoch == meta.assignment_epoch {
        if targeted != meta.readable_shard_set {
            return Err(format!(
                "target covers {targeted:?}, readable set is {:?}",
                meta.readable_shard_set
            ));
        }
        for (shard, owner) in &owners {
            let live = group.members.get(owner).is_some_and(|m| is_live(m, now));
            if !live {
                return Err(format!("target owner {owner} of shard {shard} is not live"));
            }
        }
    }
    // 3, coordinator side: a shard is held by at most one member or replaced process.
    if holdings_exclusive && meta.correction_round.is_none() {
        for shard in 0..=meta.readable_shard_set.last().copied().unwrap_or(0) {
            let members = group
                .members
                .values()
                .filter(|m| holds(m, shard, now))
                .count();
            let old = group
                .members
                .values()
                .flat_map(|m| &m.old_process_holdings)
                .filter(|o| o.lease_expires_at > now && o.shards.contains(&shard))
                .count();
            if members + old > 1 {
                return Err(format!("shard {shard} held by {} holders", members + old));
            }
        }
    }
    // 5. In STABLE, live non-away members own exactly the target minus away members' shards.
    if meta.state == GroupState::Stable {
        let mut owned = BTreeSet::new();
        let mut reserved = BTreeSet::new();
        for member in group.members.values().filter(|m| is_live(m, now)) {
            let shards = target
                .members
                .get(&member.member_id)
                .cloned()
                .unwrap_or_default();
            if member.away {
                reserved.extend(shards);
            } else {
                owned.extend(member.current_assignment.iter().copied());
            }
        }
        let expected: BTreeSet<ShardIndex> = targeted.difference(&reserved).copied().collect();
        if owned != expected {
            return Err(format!(
                "STABLE but members own {owned:?}, target minus reserved is {expected:?}"
            ));
        }
    }
    Ok(())
}
