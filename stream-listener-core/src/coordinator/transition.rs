//! The transitions: the coordinator rules of docs/design.md §6, in order.

use std::collections::{BTreeMap, BTreeSet};

use super::{Context, CoordinatorConfig, CoordinatorError, Group, rfc3339};
use crate::assignor::{self, AssignorMember};
use crate::fence::FenceToken;
use crate::model::{
    COUNTER_LIMIT, CorrectionRound, Epoch, GroupState, HeartbeatRequest, HeartbeatResponse,
    HeartbeatStatus, JOIN_EPOCH, LEAVE_EPOCH, MemberMetadata, MemberState, Micros,
    OldProcessHolding, PROTOCOL_VERSION, RevokeState, STATIC_LEAVE_EPOCH, ShardIndex,
    TargetAssignment,
};

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
    if group.meta.correction_round.is_none() && is_lost_metadata_evidence(group, request, ctx.now) {
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

/// The response a converged member of a STABLE group gets for a heartbeat that repeats its epoch
/// and reports exactly its target as owned, with nothing revoking and no fence conflict: what
/// [`heartbeat`] would answer when no time-based work is due. `None` when the group is not
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
/// passed is cleared by the time-based work ([`advance`]), so it counts here only until then.
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

enum Answer {
    Accepted(HeartbeatStatus),
    Fencing(HeartbeatStatus),
}

fn validate(request: &HeartbeatRequest, ctx: &Context<'_>) -> Result<(), CoordinatorError> {
    if request.protocol_version != PROTOCOL_VERSION {
        return Err(CoordinatorError::UnsupportedProtocolVersion {
            got: request.protocol_version,
            supported: PROTOCOL_VERSION,
        });
    }
    if request.member_id.is_empty() {
        return Err(CoordinatorError::EmptyField { field: "memberId" });
    }
    if request.process_id.is_empty() {
        return Err(CoordinatorError::EmptyField { field: "processId" });
    }
    if request.member_epoch < STATIC_LEAVE_EPOCH {
        return Err(CoordinatorError::InvalidMemberEpoch(request.member_epoch));
    }
    let counters = [
        ("memberEpoch", request.member_epoch.unsigned_abs()),
        ("requestSeq", request.request_seq),
        ("metadataVersion", request.metadata_version),
    ];
    let conflicts = request.fence_conflicts.iter().flat_map(|c| {
        [
            ("fenceConflicts", c.incarnation),
            ("fenceConflicts", c.epoch.unsigned_abs()),
        ]
    });
    for (field, value) in counters.into_iter().chain(conflicts) {
        if value >= COUNTER_LIMIT {
            return Err(CoordinatorError::CounterAtLimit {
                field,
                value: value.to_string(),
            });
        }
    }
    let bound = ctx.stream.shard_index_bound;
    let mut seen = BTreeSet::new();
    let owned = request.owned_shards.iter().map(|s| (*s, "ownedShards"));
    let revoking = request
        .revoking_shards
        .iter()
        .map(|r| (r.shard_index, "revokingShards"));
    for (shard, field) in owned.chain(revoking) {
        if shard >= bound {
            return Err(CoordinatorError::ShardOutOfRange {
                shard,
                field,
                bound,
            });
        }
        if !seen.insert(shard) {
            return Err(CoordinatorError::DuplicateShard { shard, field });
        }
    }
    Ok(())
}

/// `requestSeq` handling: a lower one is ignored, a repeated one answered from the stored response.
fn repeated_request(
    group: &Group,
    request: &HeartbeatRequest,
) -> Result<Option<HeartbeatResponse>, CoordinatorError> {
    let Some(member) = group.members.get(&request.member_id) else {
        return Ok(None);
    };
    if member.process_id != request.process_id || member.last_response.is_none() {
        return Ok(None);
    }
    if request.request_seq < member.last_request_seq {
        return Err(CoordinatorError::StaleRequestSeq {
            got: request.request_seq,
            last: member.last_request_seq,
        });
    }
    if request.request_seq == member.last_request_seq {
        return Ok(member.last_response.clone());
    }
    Ok(None)
}

// ---- time-based work (rule 1) ------------------------------------------------------------------

/// If every live member's last lease renewal is older than half its own lease TTL, Redis or
/// every member was unreachable: extend leases and revoke deadlines by the time since the most
/// recent renewal, as Kafka does on coordinator load, so an outage does not expire everyone
/// (docs/design.md §5). This only delays hand-offs: a member reads by its own lease deadline, which
/// never passes later than the recorded one, so extending a record is always safe. Replaced
/// processes are not extended. Each member is judged by its own TTL (members of one group may
/// run different `[coordination]` timings, docs/design.md §6.5): one member renewing on its own
/// schedule is proof enough that there was no outage, and a renewal is its lease minus its TTL.
fn rearm_leases_after_outage(group: &mut Group, now: Micros, config: &CoordinatorConfig) {
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
fn end_hand_out_hold_if_passed(group: &mut Group, now: Micros, config: &CoordinatorConfig) {
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
fn apply_stream_view(group: &mut Group, ctx: &Context<'_>) {
    let stream = ctx.stream;
    let meta = &mut group.meta;
    if meta.readable_shard_set != stream.readable || meta.shard_count != stream.shard_count {
        meta.group_epoch += 1;
        meta.readable_shard_set = stream.readable.clone();
        meta.shard_count = stream.shard_count;
    }
    meta.metadata_version = stream.metadata_version;
}

fn expire_and_fence(group: &mut Group, now: Micros) {
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

fn release_all(member: &mut MemberMetadata) {
    member.current_assignment.clear();
    member.revoking.clear();
    member.assigned_shards.clear();
    member.revoke_deadline = None;
    member.away = false;
}

/// Whether everything the member reported (owned and draining) is in its target.
fn reported_within(member: &MemberMetadata, target: Option<&BTreeSet<ShardIndex>>) -> bool {
    let in_target = |s: &ShardIndex| target.is_some_and(|t| t.contains(s));
    member.current_assignment.iter().all(in_target) && member.revoking.iter().all(in_target)
}

/// Drops lapsed old-process holdings and moves EXPIRED / FENCED / LEFT members that hold nothing
/// any more to the capped history (newest first).
fn retire_finished_members(group: &mut Group, now: Micros, config: &CoordinatorConfig) {
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

fn holds_anything(member: &MemberMetadata, now: Micros) -> bool {
    member.member_lease_expires_at > now
        && !(member.current_assignment.is_empty()
            && member.revoking.is_empty()
            && member.assigned_shards.is_empty())
}

// ---- lost metadata: the correction round (rule 2) -----------------------------------------------

/// Evidence that stored metadata lost writes (docs/design.md §6): the request carries a version or
/// an epoch the coordinator never handed out as far as it remembers, or a fence conflict at or
/// above the stored `(incarnation, groupEpoch)`, or a fence conflict on a shard the coordinator
/// says the reporting member holds.
fn is_lost_metadata_evidence(group: &Group, request: &HeartbeatRequest, now: Micros) -> bool {
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
    let stored = (meta.incarnation, meta.group_epoch);
    request.fence_conflicts.iter().any(|c| {
        (c.incarnation, c.epoch) >= stored
            || holder.is_some_and(|m| held_shards(m).contains(&c.shard_index))
    })
}

/// Starts a new incarnation above every token found, with epochs restarting above any found,
/// lasting at least one lease TTL (the longest of the known members' own TTLs and this
/// transition's) and until every live member has heartbeated on it.
fn start_correction_round(
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

fn end_correction_round_if_done(group: &mut Group, now: Micros) {
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

fn in_correction_round(group: &Group) -> bool {
    group.meta.correction_round.is_some()
}

// ---- identity, join, leave, report (rules 3–7) --------------------------------------------------

fn join(
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

fn new_member(request: &HeartbeatRequest) -> MemberMetadata {
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
fn replace_process(
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
/// Static leave (`-2`, only with an `instanceId`): the target stays reserved while the lease runs.
/// A replaced process leaving releases what it reports `REVOKED` from its old holdings.
fn leave(
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
        MemberState::Active if static_leave => member.away = true,
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

fn release_old_process_shards(member: &mut MemberMetadata, request: &HeartbeatRequest) {
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
fn member_heartbeat(
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
fn epoch_accepted(member: &MemberMetadata, request: &HeartbeatRequest) -> bool {
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
fn apply_report(
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
fn apply_revokes(
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

fn revoked_shards(request: &HeartbeatRequest) -> impl Iterator<Item = ShardIndex> + '_ {
    request
        .revoking_shards
        .iter()
        .filter(|r| r.state == RevokeState::Revoked)
        .map(|r| r.shard_index)
}

/// Renews the requesting member's lease by its own TTL: `config` is that of the process whose
/// heartbeat runs, and becomes the member's recorded timings.
fn renew_lease(member: &mut MemberMetadata, now: Micros, config: &CoordinatorConfig) {
    record_timings(member, config);
    member.last_heartbeat_at = now;
    member.member_lease_expires_at = now + config.lease_ttl_us();
}

// ---- each member's own timings -----------------------------------------------------------------

fn ms(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Records `config` (that of the requesting process) as the member's own timings (docs/design.md
/// §6.5).
fn record_timings(member: &mut MemberMetadata, config: &CoordinatorConfig) {
    member.heartbeat_interval_ms = ms(config.heartbeat_interval);
    member.member_lease_ttl_ms = ms(config.member_lease_ttl);
    member.rebalance_timeout_ms = ms(config.rebalance_timeout);
}

/// A recorded timing in ms, or `fallback` when it was not recorded (`0`: data written before
/// members' own timings were).
fn recorded_or(recorded_ms: u64, fallback: std::time::Duration) -> u64 {
    if recorded_ms == 0 {
        ms(fallback)
    } else {
        recorded_ms
    }
}

/// The member's own lease TTL (µs): the one its lease was last renewed with.
pub(crate) fn member_lease_ttl_us(member: &MemberMetadata, config: &CoordinatorConfig) -> Micros {
    recorded_or(member.member_lease_ttl_ms, config.member_lease_ttl).saturating_mul(1000)
}

fn member_rebalance_timeout_us(member: &MemberMetadata, config: &CoordinatorConfig) -> Micros {
    recorded_or(member.rebalance_timeout_ms, config.rebalance_timeout).saturating_mul(1000)
}

/// `response` with the member's own timings: every member adopts the interval and TTL of the
/// responses it gets, whichever member's transition wrote them.
fn with_own_timings(
    response: HeartbeatResponse,
    member: &MemberMetadata,
    config: &CoordinatorConfig,
) -> HeartbeatResponse {
    HeartbeatResponse {
        heartbeat_interval_ms: recorded_or(member.heartbeat_interval_ms, config.heartbeat_interval),
        member_lease_ttl_ms: recorded_or(member.member_lease_ttl_ms, config.member_lease_ttl),
        rebalance_timeout_ms: recorded_or(member.rebalance_timeout_ms, config.rebalance_timeout),
        ..response
    }
}

// ---- holdings ----------------------------------------------------------------------------------

/// What a member holds, its lease aside: the shards last sent as assigned, last reported owned,
/// and last reported draining (docs/design.md §6.3, holdings).
fn held_shards(member: &MemberMetadata) -> BTreeSet<ShardIndex> {
    member
        .assigned_shards
        .iter()
        .chain(&member.current_assignment)
        .chain(&member.revoking)
        .copied()
        .collect()
}

fn holds(
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
fn is_blocked(
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
fn blocked_among(
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

fn is_live(member: &MemberMetadata, now: Micros) -> bool {
    member.state == MemberState::Active && member.member_lease_expires_at > now
}

// ---- assignment and response (rules 8–9) -------------------------------------------------------

/// Rule 8: a new sticky target when `groupEpoch > assignmentEpoch`; revoke deadlines for members
/// that must give up shards, cleared for those that have.
fn recompute_target(group: &mut Group, now: Micros, config: &CoordinatorConfig) {
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
        let previous: assignor::Target = meta
            .target_assignment
            .members
            .iter()
            .flat_map(|(id, shards)| shards.iter().map(move |s| (*s, id.clone())))
            .collect();
        let next = assignor::assign(&meta.readable_shard_set, &live, &previous);
        let mut members = std::collections::BTreeMap::<String, BTreeSet<ShardIndex>>::new();
        for (shard, owner) in next {
            members.entry(owner).or_default().insert(shard);
        }
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

/// Rule 9: `assignedShards` = target shards held by no one else; `pendingShards` = the rest. The
/// member epoch moves to `assignmentEpoch` when `assignedShards` changes (and on every join).
fn respond(
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

fn fencing_response(
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
