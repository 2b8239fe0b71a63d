//! What the store's fast path needs of the rules (docs/design.md §5.3): the steady response,
//! the next time-based deadline, and the fingerprint of a steady heartbeat.

use std::collections::{BTreeSet, HashMap};

use super::assignment::base_response;
use super::correction::in_correction_round;
use super::timings::with_own_timings;
use crate::coordinator::{CoordinatorConfig, Group};
use crate::model::{
    Epoch, HeartbeatRequest, HeartbeatResponse, HeartbeatStatus, MemberState, Micros,
    PROTOCOL_VERSION, ShardIndex,
};

/// The response a converged member gets for a heartbeat that repeats its epoch and reports
/// exactly its target as owned, with nothing revoking and no fence conflict: what
/// [`heartbeat`](crate::coordinator::heartbeat) would answer when no time-based work is due.
/// `None` when a correction round runs, the group waits for a new target, the member is not
/// converged (away, not `ACTIVE`, or its target not yet both sent and reported), or
/// anyone else holds one of its target shards (`holders`, [`ShardHolders::of`] this group). The
/// group need not be STABLE: while other members reconcile, such a member's answer is the same
/// (it has no revoke deadline, nothing it is sent is blocked, and what would change its answer is
/// a new target, written with its entry, or time-based work the fast path falls back for). The
/// store's fast path (docs/design.md §5.3) answers with it without running the full transition.
pub fn steady_response(
    group: &Group,
    member_id: &str,
    config: &CoordinatorConfig,
    holders: &ShardHolders<'_>,
) -> Option<HeartbeatResponse> {
    // A hand-out hold needs no check of its own: while it lasts nothing is sent, so only a
    // member with an empty target is converged, and its answer is the same; the fast path falls
    // back once the hold has ended (`next_deadline`).
    if !fast_path_allowed(group) {
        return None;
    }
    let member = group.members.get(member_id)?;
    let target = group.target_of(member_id);
    let converged = member.state == MemberState::Active
        && !member.away
        && &member.assigned_shards == target
        && &member.current_assignment == target
        && member.revoking.is_empty()
        && holders.held_only_by(target, member_id);
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

/// Who holds each shard by the group's records (docs/design.md §6.3: sent, reported owned or
/// draining, or in a replaced process's holdings), leases aside: built once per write, so that
/// [`steady_response`] costs each member its target, not the group's holdings. Leases aside
/// makes it stricter than the full transition's blocked shards (a holder whose lease has passed
/// still counts), so the fast path may fall back where the full transition would answer the same,
/// never the other way. It matters outside STABLE: after a correction round, say, a member may
/// still hold, by its last report, a shard another member has already been sent.
#[derive(Debug, Default)]
pub struct ShardHolders<'a> {
    /// Shard → its one holder; `None` when several hold it, or a replaced process does.
    holders: HashMap<ShardIndex, Option<&'a str>>,
}

impl<'a> ShardHolders<'a> {
    /// The holders of every shard of `group`'s members and replaced processes.
    pub fn of(group: &'a Group) -> Self {
        let mut holders: HashMap<ShardIndex, Option<&'a str>> = HashMap::new();
        for member in group.members.values() {
            let held = member
                .assigned_shards
                .iter()
                .chain(&member.current_assignment)
                .chain(&member.revoking);
            for shard in held {
                let only = holders.entry(*shard).or_insert(Some(&member.member_id));
                if *only != Some(member.member_id.as_str()) {
                    *only = None;
                }
            }
            for old in &member.old_process_holdings {
                holders.extend(old.shards.iter().map(|shard| (*shard, None)));
            }
        }
        ShardHolders { holders }
    }

    /// Whether no one but `member_id` holds any of `shards`.
    fn held_only_by(&self, shards: &BTreeSet<ShardIndex>, member_id: &str) -> bool {
        shards.iter().all(|shard| {
            self.holders
                .get(shard)
                .is_none_or(|only| *only == Some(member_id))
        })
    }
}

/// Whether the fast path may answer at all: not in a correction round, and not while the group
/// waits for a new target (`groupEpoch > assignmentEpoch`, stored after a transition that only
/// fenced its requester): the next full transition computes the target, and a converged member's
/// answer may change with it.
fn fast_path_allowed(group: &Group) -> bool {
    !in_correction_round(group) && group.meta.group_epoch <= group.meta.assignment_epoch
}

/// What every fast answer of a group shares, stored once (the store's `steady` field,
/// docs/design.md §5.3): the fast path runs only while it is present and its stream version and
/// deadline hold, and it completes each member's stored answer with the group's epochs. Keeping
/// the epochs here, not in every member's entry, means that a join or an expiry rewrites one
/// field, not one per converged member.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SteadyMarker {
    /// The group's `metadataVersion`: a request of a process that read another falls back.
    pub metadata_version: u64,
    /// [`next_deadline`] (µs), 0 for none: the fast path falls back once it has passed.
    pub deadline: Micros,
    /// The group's `groupEpoch`, answered by the fast path.
    pub group_epoch: Epoch,
    /// The group's `assignmentEpoch`, answered by the fast path.
    pub assignment_epoch: Epoch,
}

impl SteadyMarker {
    /// The marker of `group` as a transition leaves it; `None` where every heartbeat must run
    /// the full transition ([`fast_path_allowed`]).
    pub fn of(group: &Group) -> Option<SteadyMarker> {
        fast_path_allowed(group).then(|| SteadyMarker {
            metadata_version: group.meta.metadata_version,
            deadline: next_deadline(group).unwrap_or(0),
            group_epoch: group.meta.group_epoch,
            assignment_epoch: group.meta.assignment_epoch,
        })
    }

    /// A member's stored answer ([`SteadyMarker::member_part`]) as the fast path sends it.
    pub fn complete(&self, stored: HeartbeatResponse) -> HeartbeatResponse {
        HeartbeatResponse {
            group_epoch: self.group_epoch,
            assignment_epoch: self.assignment_epoch,
            ..stored
        }
    }

    /// What a member's fast entry stores of its [`steady_response`]: everything but the group's
    /// epochs (0), which the marker carries.
    pub fn member_part(response: HeartbeatResponse) -> HeartbeatResponse {
        HeartbeatResponse {
            group_epoch: 0,
            assignment_epoch: 0,
            ..response
        }
    }
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
