//! What the store's fast path needs of the rules (docs/design.md §5.3): the steady response,
//! the next time-based deadline, and the fingerprint of a steady heartbeat.

use super::assignment::base_response;
use super::correction::in_correction_round;
use super::timings::with_own_timings;
use crate::coordinator::{CoordinatorConfig, Group};
use crate::model::{
    Epoch, GroupState, HeartbeatRequest, HeartbeatResponse, HeartbeatStatus, MemberState, Micros,
    PROTOCOL_VERSION, ShardIndex,
};

/// The response a converged member of a STABLE group gets for a heartbeat that repeats its epoch
/// and reports exactly its target as owned, with nothing revoking and no fence conflict: what
/// [`heartbeat`](crate::coordinator::heartbeat) would answer when no time-based work is due. `None` when the group is not
/// STABLE, a correction round runs, or the member is not converged. The store's fast path
/// (docs/design.md §5) answers with it without running the full transition.
pub fn steady_response(
    group: &Group,
    member_id: &str,
    config: &CoordinatorConfig,
) -> Option<HeartbeatResponse> {
    if group.meta.state != GroupState::Stable || in_correction_round(group) {
        return None;
    }
    let member = group.members.get(member_id)?;
    let target = group.target_of(member_id);
    let converged = member.state == MemberState::Active
        && !member.away
        && &member.assigned_shards == target
        && &member.current_assignment == target
        && member.revoking.is_empty();
    let response = HeartbeatResponse {
        status: HeartbeatStatus::Ok,
        member_epoch: member.member_epoch,
        assigned_shards: target.iter().copied().collect(),
        ..base_response(group, config)
    };
    #[cfg(test)]
    if config.variant.writer_timings {
        return converged.then_some(response);
    }
    converged.then(|| with_own_timings(response, member, config))
}

/// The earliest time-based trigger other than a member lease (µs): revoke deadlines, replaced
/// processes' leases, the end of a correction round, the end of a hand-out hold. The store's
/// fast path falls back to the full transition once it has passed. A hand-out hold that has
/// passed is cleared by the time-based work ([`advance`](crate::coordinator::advance)), so it counts here only until then.
pub fn next_deadline(group: &Group) -> Option<Micros> {
    let members = group.members.values();
    let revokes = members.clone().filter_map(|m| m.revoke_deadline);
    let old = members.flat_map(|m| m.old_process_holdings.iter().map(|o| o.lease_expires_at));
    let round = group
        .meta
        .correction_round
        .as_ref()
        .map(|r| r.not_before_end);
    revokes
        .chain(old)
        .chain(round)
        .chain(group.meta.hand_out_not_before)
        .min()
}

/// What identifies a steady heartbeat (the store's fast path, docs/design.md §5.3): the member's
/// process, epoch, adopted metadata version, weight and owned shards (ascending), as
/// `<process>|<epoch>|<metadataVersion>|<weight>|<shard>,<shard>,…`. The fast path answers only a
/// request with exactly the fingerprint stored for the member when the group became STABLE; the
/// store writes it and the simulation's model of the store uses the same function.
pub fn steady_fingerprint<'a>(
    process_id: &str,
    epoch: Epoch,
    metadata_version: u64,
    weight: u32,
    owned: impl Iterator<Item = &'a ShardIndex>,
) -> String {
    let owned: Vec<String> = owned.map(ToString::to_string).collect();
    format!(
        "{process_id}|{epoch}|{metadata_version}|{weight}|{}",
        owned.join(",")
    )
}

/// The [`steady_fingerprint`] of a heartbeat request, `None` when the fast path does not look at
/// it at all: not a normal heartbeat of this protocol version, or one reporting a revoke or a
/// fence conflict (docs/design.md §5.3). The store's fast path and the simulation's model of it
/// both use it.
pub fn request_fingerprint(request: &HeartbeatRequest) -> Option<String> {
    let eligible = request.member_epoch > 0
        && request.protocol_version == PROTOCOL_VERSION
        && request.revoking_shards.is_empty()
        && request.fence_conflicts.is_empty()
        && !request.member_id.is_empty();
    if !eligible {
        return None;
    }
    let mut owned = request.owned_shards.clone();
    owned.sort_unstable();
    Some(steady_fingerprint(
        &request.process_id,
        request.member_epoch,
        request.metadata_version,
        request.runtime_max_concurrency.max(1),
        owned.iter(),
    ))
}
