//! The transitions: the coordinator rules of docs/design.md §6, in order.

mod assignment;
mod correction;
mod holdings;
mod membership;
mod steady;
mod time;
mod timings;
mod validate;

use std::collections::BTreeMap;

use super::{Context, CoordinatorConfig, CoordinatorError, Group, rfc3339};
use crate::fence::FenceToken;
use crate::model::{
    GroupState, HeartbeatRequest, HeartbeatResponse, HeartbeatStatus, JOIN_EPOCH, LEAVE_EPOCH,
    MemberMetadata, Micros, STATIC_LEAVE_EPOCH, ShardIndex,
};
use assignment::{fencing_response, recompute_target, respond};
use correction::{
    end_correction_round_if_done, in_correction_round, is_lost_metadata_evidence,
    start_correction_round,
};
use holdings::is_live;
use membership::{join, leave, member_heartbeat};
use time::{
    apply_stream_view, end_hand_out_hold_if_passed, expire_and_fence, holds_anything,
    rearm_leases_after_outage, retire_finished_members,
};
use timings::record_timings;
use validate::{repeated_request, validate};

pub(crate) use assignment::base_response;
pub use steady::{
    ShardHolders, SteadyMarker, next_deadline, request_fingerprint, steady_fingerprint,
    steady_response,
};
pub(crate) use timings::member_lease_ttl_us;

/// What one [`heartbeat`] came to.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum Transition {
    /// The transition ran: the group holds the new state, and this is the response to send.
    Done(HeartbeatResponse),
    /// Lost metadata is suspected (docs/design.md §6.6, correction round): read this group's
    /// fence of every readable shard and run [`heartbeat_with_fences`] with them on the group as
    /// loaded (the one given to [`heartbeat`] may be partly advanced and must be dropped).
    NeedsFences,
}

impl Transition {
    /// The response, `None` when the transition needs the fences.
    pub fn response(self) -> Option<HeartbeatResponse> {
        match self {
            Transition::Done(response) => Some(response),
            Transition::NeedsFences => None,
        }
    }
}

/// Applies one heartbeat to `group` at `ctx.now` and returns the response (docs/design.md §6).
///
/// Rules, in order: time-based work for the whole group ([`advance`]); a retried request (same
/// process, same `requestSeq`) gets the stored response and changes nothing else; lost-metadata evidence,
/// which starts a correction round; identity and epoch checks; join (`0`), leave (`-1`), static
/// leave (`-2`) or a normal heartbeat with report validation; lease renewal; a new target with the
/// sticky assignor when `groupEpoch > assignmentEpoch`; the response, whose `assignedShards` are
/// the member's target shards held by no other member or process. Fencing statuses
/// (`UNKNOWN_MEMBER_ID`, `FENCED_MEMBER_EPOCH`, `FENCED_INSTANCE_ID`) are answers, not errors;
/// so is [`Transition::NeedsFences`], when lost metadata is suspected: a correction round needs
/// the fences, which only the caller can read.
///
/// # Errors
/// A malformed request (protocol version, empty ids, epoch below `-2`, duplicate or out-of-range
/// shards) is refused before anything changes. [`CoordinatorError::StaleRequestSeq`] for a request
/// older than the last accepted one of its process. On any error the group may be partly advanced
/// and must be dropped.
pub fn heartbeat(
    group: &mut Group,
    request: &HeartbeatRequest,
    ctx: &Context<'_>,
    config: &CoordinatorConfig,
) -> Result<Transition, CoordinatorError> {
    Ok(match prepare(group, request, ctx, config)? {
        Prepared::Answered(response) => Transition::Done(response),
        Prepared::LostMetadata => Transition::NeedsFences,
        Prepared::Proceed => Transition::Done(apply_request(group, request, ctx.now, config)),
    })
}

/// [`heartbeat`] given `fences`, this group's fence of every readable shard (shard → token): a
/// correction round starts when lost metadata is suspected, so it always answers.
///
/// # Errors
/// As [`heartbeat`], and [`CoordinatorError::CounterAtLimit`] when a fence is so high that the
/// round's incarnation or epoch could not be above it.
pub fn heartbeat_with_fences(
    group: &mut Group,
    request: &HeartbeatRequest,
    ctx: &Context<'_>,
    fences: &BTreeMap<ShardIndex, FenceToken>,
    config: &CoordinatorConfig,
) -> Result<HeartbeatResponse, CoordinatorError> {
    match prepare(group, request, ctx, config)? {
        Prepared::Answered(response) => return Ok(response),
        Prepared::LostMetadata => start_correction_round(group, request, fences, ctx.now, config)?,
        Prepared::Proceed => {}
    }
    Ok(apply_request(group, request, ctx.now, config))
}

/// Where a heartbeat stands after validation, the time-based work and the `requestSeq` check.
enum Prepared {
    /// A retried request, answered with its stored response.
    Answered(HeartbeatResponse),
    /// Lost-metadata evidence outside a correction round: one must start first.
    LostMetadata,
    /// The request is to be applied.
    Proceed,
}

/// The rules before the request itself: validation, time-based work, a retried request, and the
/// lost-metadata check.
fn prepare(
    group: &mut Group,
    request: &HeartbeatRequest,
    ctx: &Context<'_>,
    config: &CoordinatorConfig,
) -> Result<Prepared, CoordinatorError> {
    validate(request, ctx)?;
    advance_time(group, ctx, config);
    if let Some(stored) = repeated_request(group, request)? {
        recompute_target(group, ctx.now, config);
        finish(group, ctx.now);
        return Ok(Prepared::Answered(stored));
    }
    let evidence = if group.meta.correction_round.is_none() {
        is_lost_metadata_evidence(group, request, ctx.now, config)
    } else {
        correction::is_lost_round_evidence(group, request)
    };
    if evidence {
        return Ok(Prepared::LostMetadata);
    }
    Ok(Prepared::Proceed)
}

/// The rules of the request itself: join, leave or a normal heartbeat, the new target and the
/// response; then members that hold nothing retire.
fn apply_request(
    group: &mut Group,
    request: &HeartbeatRequest,
    now: Micros,
    config: &CoordinatorConfig,
) -> HeartbeatResponse {
    let status = match request.member_epoch {
        JOIN_EPOCH => join(group, request, now, config),
        LEAVE_EPOCH => leave(group, request, now, config, false),
        STATIC_LEAVE_EPOCH => leave(group, request, now, config, true),
        _ => member_heartbeat(group, request, now, config),
    };
    let response = match status {
        Answer::Fencing(status) => fencing_response(group, request, status, config),
        Answer::Accepted(status) => {
            if let Some(member) = group.members.get_mut(&request.member_id) {
                record_timings(member, config);
            }
            recompute_target(group, now, config);
            let force_epoch = request.member_epoch == JOIN_EPOCH;
            let response = respond(group, &request.member_id, status, now, config, force_epoch);
            if let Some(member) = group.members.get_mut(&request.member_id) {
                member.last_request_seq = request.request_seq;
                member.last_response = Some(response.clone());
            }
            response
        }
    };
    retire_finished_members(group, now, config);
    finish(group, now);
    response
}

/// Applies the time-based work for the whole group at `ctx.now` without a heartbeat: re-arms
/// leases after an outage, applies a changed readable shard set, expires members whose lease ran
/// out, fences members that did not revoke by their `revokeDeadline`, moves members that hold
/// nothing to the history, ends a finished correction round, and stores a new target if one is
/// needed. [`heartbeat`] runs it first; admin tools run it to describe a group as of now.
pub fn advance(group: &mut Group, ctx: &Context<'_>, config: &CoordinatorConfig) {
    advance_time(group, ctx, config);
    recompute_target(group, ctx.now, config);
    finish(group, ctx.now);
}

/// Rule 1 without the new target: [`heartbeat`] computes the target once, after the request.
fn advance_time(group: &mut Group, ctx: &Context<'_>, config: &CoordinatorConfig) {
    let now = ctx.now;
    end_hand_out_hold_if_passed(group, now, config);
    rearm_leases_after_outage(group, now, config);
    apply_stream_view(group, ctx);
    expire_and_fence(group, now);
    retire_finished_members(group, now, config);
    end_correction_round_if_done(group, now);
}
/// What the request rules decided: accepted with a status (a new target and response follow), or
/// a fencing status answered as it is.
enum Answer {
    Accepted(HeartbeatStatus),
    Fencing(HeartbeatStatus),
}

/// Group state (docs/design.md §4) and timestamps after a transition.
fn finish(group: &mut Group, now: Micros) {
    let state = group_state(group, now);
    let stamp = rfc3339(now);
    if state != group.meta.state {
        group.meta.state = state;
        group.meta.last_transition_at.clone_from(&stamp);
    }
    group.meta.updated_at = stamp;
}

fn group_state(group: &Group, now: Micros) -> GroupState {
    let mut live = group
        .members
        .values()
        .filter(|m| is_live(m, now))
        .peekable();
    if live.peek().is_none() {
        return GroupState::Empty;
    }
    if group.meta.group_epoch > group.meta.assignment_epoch {
        return GroupState::Assigning;
    }
    let converged = |m: &MemberMetadata| {
        let target = group.target_of(&m.member_id);
        m.away
            || (&m.assigned_shards == target
                && &m.current_assignment == target
                && m.revoking.is_empty())
    };
    let others_hold_nothing = group
        .members
        .values()
        .filter(|m| !is_live(m, now))
        .all(|m| !holds_anything(m, now) && m.old_process_holdings.is_empty());
    if live.all(converged) && others_hold_nothing && !in_correction_round(group) {
        GroupState::Stable
    } else {
        GroupState::Reconciling
    }
}
