//! Heartbeats through the model of the store, and the checks on each answer: a fast-path answer
//! is what the full transition would answer, the coordinator's invariants hold (docs/design.md
//! §4, §5).

use std::collections::BTreeSet;
use std::time::Duration;

use rand::Rng;

use super::store::{FastAnswer, Store, StoreFailure};
use super::{MS, World, us};
use super::{Message, Reply};
use crate::coordinator::invariants::check_group;
use crate::coordinator::{CoordinatorConfig, Group, StreamView};
use crate::model::{HeartbeatRequest, HeartbeatResponse, Micros};

/// A heartbeat the fast path sent on to the full transition: what its transition needs, alone
/// or in a combined batch, and the store as the fast path saw it (the fallback's check replays
/// its transition alone there).
pub(super) struct Fallback {
    pub(super) message: Message,
    pub(super) config: CoordinatorConfig,
    /// The stream view its store applies (with stale views, the one its process read).
    pub(super) view: StreamView,
    /// The store when the fast path fell back, at Redis `TIME` `at`, and the check that sent it.
    pub(super) before: Store,
    pub(super) at: Micros,
    pub(super) reason: &'static str,
}

impl World {
    /// A heartbeat reaches the store alone: the fast path, else its own full transition.
    pub(super) fn deliver_to_coordinator(&mut self, message: Message) -> Result<(), String> {
        match self.try_fast_path(message)? {
            Some(fallback) => self.own_transition(fallback),
            None => Ok(()),
        }
    }

    /// The fast-path script on a heartbeat that reaches the store: its answer goes back to the
    /// member (checked against the full transition's), or it falls back, returned for a full
    /// transition.
    pub(super) fn try_fast_path(&mut self, message: Message) -> Result<Option<Fallback>, String> {
        // Redis `TIME` moves on between two scripts (a group lost and re-provisioned in the same
        // µs as a correction round started would share its incarnation).
        self.now += 1;
        let config = self.procs[message.proc].config.clone();
        let view = if self.faults.stale_views {
            message.view.clone()
        } else {
            self.stream.view()
        };
        let request = &message.request;
        let before = self.store.clone();
        let now = self.now;
        let outcome = match self
            .store
            .fast_path(request, &config, view.metadata_version, now)
        {
            FastAnswer::Answered { response, renewed } => {
                self.stats.fast_answers += 1;
                if !self.faults.effects_only {
                    self.check_fast_answer(&before, request, &config, &view, &response, renewed)?;
                }
                Ok(response)
            }
            FastAnswer::Stale { last } => Err(StoreFailure::Stale { last }),
            FastAnswer::Fallback(reason) => {
                self.stats.full_transitions += 1;
                return Ok(Some(Fallback {
                    message,
                    config,
                    view,
                    before,
                    at: now,
                    reason,
                }));
            }
        };
        self.answer("coord", &message, &config, &view, &before, outcome)?;
        Ok(None)
    }

    /// The requester's own full transition (`GroupStore::own_transition`) at Redis `TIME` now:
    /// a heartbeat delivered alone, or one a combined batch left to it.
    pub(super) fn own_transition(&mut self, fallback: Fallback) -> Result<(), String> {
        let Fallback {
            message,
            config,
            view,
            ..
        } = &fallback;
        let request = &message.request;
        let before = self.store.clone();
        let now = self.now;
        // Every compare-and-set lost to concurrent writers: `RETRY`, nothing written.
        let contended = self.faulty && self.rng.random_bool(0.02);
        let outcome = if contended {
            self.store.retry_response(config)
        } else {
            let current = self.stream.view();
            self.store
                .full_transition(request, config, view, &current, &self.fences, now)
        };
        if let Err(StoreFailure::Refused(reason)) = &outcome {
            return Err(format!(
                "coordinator refused a well-formed request: {reason}"
            ));
        }
        if outcome == Err(StoreFailure::MissingGroup) {
            // `member/heartbeat.rs` re-provisions with its store's timings.
            let current = self.stream.view();
            self.now += 1;
            if self.store.provision(&current, self.now, true, config) {
                self.log.push(format!(
                    "t={} {} re-provisions the group, hold {}ms",
                    now / MS,
                    request.member_id,
                    us(config.member_lease_ttl) / MS
                ));
            }
        }
        if !contended && !self.faults.effects_only {
            self.check_needless_fallback(&fallback)?;
        }
        self.answer("coord", message, config, view, &before, outcome)
    }

    /// The store's answer to one heartbeat, on a store that was `before` when it arrived: logged,
    /// the checks on the store and on the answer, and the reply on its way to the member.
    fn answer(
        &mut self,
        label: &str,
        message: &Message,
        config: &CoordinatorConfig,
        view: &StreamView,
        before: &Store,
        outcome: Result<HeartbeatResponse, StoreFailure>,
    ) -> Result<(), String> {
        self.log_answer(label, &message.request, view, &outcome);
        self.check_store_change(before, &[&message.request])?;
        self.reply(message, config, outcome)
    }

    /// One line of the log for the store's answer to `request`.
    pub(super) fn log_answer(
        &mut self,
        label: &str,
        request: &HeartbeatRequest,
        view: &StreamView,
        outcome: &Result<HeartbeatResponse, StoreFailure>,
    ) {
        self.log.push(format!(
            "t={} {label} {}({}) seq={} epoch={} mv={} owned={:?} rev={:?} -> {}",
            self.now / MS,
            request.member_id,
            request.process_id,
            request.request_seq,
            request.member_epoch,
            view.metadata_version,
            request.owned_shards,
            request
                .revoking_shards
                .iter()
                .map(|r| (r.shard_index, r.state))
                .collect::<Vec<_>>(),
            match outcome {
                Ok(r) => format!(
                    "{:?} e={} a={:?} p={:?} ge={} inc={} hb={} ttl={}",
                    r.status,
                    r.member_epoch,
                    r.assigned_shards,
                    r.pending_shards,
                    r.group_epoch,
                    r.incarnation,
                    r.heartbeat_interval_ms,
                    r.member_lease_ttl_ms
                ),
                Err(e) => format!("{e:?}"),
            }
        ));
    }

    /// The checks on a store that was `before` the heartbeats `requests` (one, or a combined
    /// batch's): the cause of a correction round that started, and when the store changed, the
    /// coordinator's invariants (and a snapshot that lost writes may revert to).
    pub(super) fn check_store_change(
        &mut self,
        before: &Store,
        requests: &[&HeartbeatRequest],
    ) -> Result<(), String> {
        self.check_correction_round_cause(before, requests)?;
        if self.store != *before {
            if self.store.group.is_some() {
                self.snapshots.push(self.store.clone());
                if self.snapshots.len() > 30 {
                    self.snapshots.remove(0);
                }
            }
            self.check_coordinator()?;
        }
        Ok(())
    }

    /// `outcome` on its way back to the requester of `message`, a response with its own timings.
    pub(super) fn reply(
        &mut self,
        message: &Message,
        config: &CoordinatorConfig,
        outcome: Result<HeartbeatResponse, StoreFailure>,
    ) -> Result<(), String> {
        if let Ok(response) = &outcome
            && !self.faults.effects_only
        {
            check_timings(response, config)?;
        }
        self.to_members.push(Reply {
            proc: message.proc,
            seq: message.request.request_seq,
            outcome,
        });
        Ok(())
    }

    /// A correction round starts only on lost coordination writes (docs/design.md §6.6). In a
    /// history whose faults lose none (no lost writes, no lost group), a round that starts is a
    /// false alarm that costs every member `SYNC_METADATA` for a lease TTL: a zombie's late fence
    /// conflict taken for evidence, for one.
    fn check_correction_round_cause(
        &self,
        before: &Store,
        requests: &[&HeartbeatRequest],
    ) -> Result<(), String> {
        if self.faults.lost_writes || self.faults.group_loss {
            return Ok(());
        }
        let started = |store: &Store| {
            let round = store.group.as_ref()?.meta.correction_round.as_ref()?;
            Some(round.started_at)
        };
        let now = started(&self.store);
        if now.is_some() && now != started(before) {
            let heartbeats: Vec<String> = requests
                .iter()
                .map(|r| {
                    format!(
                        "{} ({}) with fence conflicts {:?}",
                        r.member_id, r.process_id, r.fence_conflicts
                    )
                })
                .collect();
            return Err(format!(
                "a correction round started without lost writes, on the heartbeat of {}",
                heartbeats.join(", ")
            ));
        }
        Ok(())
    }

    /// The fast path answered: the full transition on the same state must answer the same, and
    /// when the fast path renewed the lease, leave the same coordinator state.
    pub(super) fn check_fast_answer(
        &self,
        before: &Store,
        request: &HeartbeatRequest,
        config: &CoordinatorConfig,
        view: &StreamView,
        response: &HeartbeatResponse,
        renewed: bool,
    ) -> Result<(), String> {
        let mut full = before.clone();
        let current = self.stream.view();
        let expected =
            full.full_transition(request, config, view, &current, &self.fences, self.now);
        // A repeated request: the member acts on these fields only (the stored fast entry is
        // rewritten with the group's later epochs; see docs/design.md §4.4 on repeat answers).
        let acted_on = |r: &HeartbeatResponse| {
            (
                r.status,
                r.member_epoch,
                r.assigned_shards.clone(),
                r.pending_shards.clone(),
                r.incarnation,
                (
                    r.heartbeat_interval_ms,
                    r.member_lease_ttl_ms,
                    r.rebalance_timeout_ms,
                ),
            )
        };
        // A repeat is answered before the script's lease checks: once the member's recorded
        // lease has passed, the full transition expires it, while the fast path repeats the
        // stored answer. That is safe: the member dates its lease from its first attempt, so the
        // repeat extends nothing the store did not record, and its next request falls back.
        let lease_passed = before
            .leases
            .get(&request.member_id)
            .is_none_or(|lease| *lease <= self.now);
        // Or the repeat carries the steady answer of a later write (the original was lost): it
        // must then be what a fresh request would get now.
        let fresh = || {
            let mut fresh_request = request.clone();
            fresh_request.request_seq += 1;
            let mut fresh = before.clone();
            fresh
                .full_transition(
                    &fresh_request,
                    config,
                    view,
                    &current,
                    &self.fences,
                    self.now,
                )
                .is_ok_and(|r| acted_on(&r) == acted_on(response))
        };
        let same = match &expected {
            Ok(expected) if renewed => expected == response,
            Ok(_) if lease_passed => true,
            Ok(expected) => acted_on(expected) == acted_on(response) || fresh(),
            // Where the full transition says stale (or refuses), the fast path must not answer,
            // not even a repeat: a late duplicate used to match a fast entry a later write left
            // in place (docs/design.md §5.3), which `outdated_fast_entries` brings back.
            Err(_) => false,
        };
        if !same {
            return Err(format!(
                "fast path answered {}({}) seq={} (lease renewed: {renewed}) with {response:?}\n  \
                 but the full transition {expected:?}",
                request.member_id, request.process_id, request.request_seq
            ));
        }
        if renewed {
            let fast = comparable(self.store.load(config));
            let full = comparable(full.load(config));
            if fast != full {
                return Err(format!(
                    "fast path left another state than the full transition: {}",
                    difference(fast.as_ref(), full.as_ref())
                ));
            }
        }
        Ok(())
    }

    /// The fast path fell back after its steady marker matched, on a request matching the
    /// member's fast entry: the full transition must have had work to do (else the fast path is
    /// off for no reason, as after a re-provisioning whose hand-out hold never stops counting).
    /// Judged on the store the fast path saw, with the request's transition alone there: what a
    /// combined batch ran with it, or before its own transition, is no reason for the fallback.
    pub(super) fn check_needless_fallback(&self, fallback: &Fallback) -> Result<(), String> {
        let Fallback {
            message,
            config,
            view,
            before,
            at,
            reason,
        } = fallback;
        let request = &message.request;
        // Only the deadline: a passed lease may be rescued by the outage re-arm, which changes
        // nothing visible when the requester holds the only lease, and the script cannot tell.
        if *reason != "deadline passed" {
            return Ok(());
        }
        let Some((forced, response)) = before.forced_fast_path(request, config, *at) else {
            return Ok(());
        };
        let mut alone = before.clone();
        let current = self.stream.view();
        let outcome = alone.full_transition(request, config, view, &current, &self.fences, *at);
        let same = outcome == Ok(response)
            && comparable(forced.load(config)) == comparable(alone.load(config));
        if same {
            return Err(format!(
                "fast path fell back ({reason}, steady {:?}, handOutNotBefore {:?}) but the full \
                 transition only renewed the lease of {}",
                before.steady,
                before
                    .group
                    .as_ref()
                    .and_then(|g| g.meta.hand_out_not_before),
                request.member_id
            ));
        }
        Ok(())
    }

    pub(super) fn check_coordinator(&mut self) -> Result<(), String> {
        let Some(group) = self.store.load(&self.check_config()) else {
            return Ok(());
        };
        check_group(
            &group,
            self.now,
            self.faults.check_holdings && !self.writes_lost && !self.group_lost,
        )?;
        let meta = &group.meta;
        let epochs = (meta.incarnation, meta.group_epoch, meta.assignment_epoch);
        if let Some(last) = self.last_epochs {
            let before =
                (last.0, last.1) > (epochs.0, epochs.1) || (last.0, last.2) > (epochs.0, epochs.2);
            if before {
                return Err(format!("epochs decreased from {last:?} to {epochs:?}"));
            }
        }
        self.last_epochs = Some(epochs);
        if let Some(last) = self.last_metadata_version
            && meta.metadata_version < last
        {
            return Err(format!(
                "group metadataVersion went back from {last} to {}",
                meta.metadata_version
            ));
        }
        self.last_metadata_version = Some(meta.metadata_version);
        for member in group.members.values() {
            let now = (meta.incarnation, member.member_epoch);
            if let Some(last) = self.member_epochs.insert(member.member_id.clone(), now)
                && last > now
            {
                return Err(format!(
                    "member {} epoch decreased from {last:?} to {now:?}",
                    member.member_id
                ));
            }
        }
        Ok(())
    }

    pub(super) fn revert(&mut self) {
        if self.snapshots.len() < 2 {
            return;
        }
        let index = self.rng.random_range(0..self.snapshots.len() - 1);
        self.store = self.snapshots[index].clone();
        self.snapshots.truncate(index + 1);
        self.writes_lost = true;
        self.last_epochs = None;
        self.last_metadata_version = None;
        self.member_epochs.clear();
        self.log
            .push(format!("t={} REVERT to snapshot {index}", self.now / MS));
    }

    /// The group hash and its leases are lost; the shard fences (other keys) survive.
    pub(super) fn lose_group(&mut self) {
        self.store.lose_everything();
        self.snapshots.clear();
        self.group_lost = true;
        self.stats.group_losses += 1;
        self.log.push(format!("t={} GROUP LOST", self.now / MS));
    }
}

/// A response carries the requester's own timings: the member adopts them (interval, lease and
/// margin), while its store records its lease with its own TTL.
fn check_timings(response: &HeartbeatResponse, config: &CoordinatorConfig) -> Result<(), String> {
    let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    let own = (
        ms(config.heartbeat_interval),
        ms(config.member_lease_ttl),
        ms(config.rebalance_timeout),
    );
    let told = (
        response.heartbeat_interval_ms,
        response.member_lease_ttl_ms,
        response.rebalance_timeout_ms,
    );
    if own != told {
        return Err(format!(
            "{:?} response carries timings {told:?} ms, the requester's are {own:?}",
            response.status
        ));
    }
    Ok(())
}

/// What differs between two loaded groups (fast path first), for a report.
pub(super) fn difference(fast: Option<&Group>, full: Option<&Group>) -> String {
    let (Some(fast), Some(full)) = (fast, full) else {
        return format!("{fast:?} / {full:?}");
    };
    let mut out = Vec::new();
    if fast.meta != full.meta {
        out.push(format!("meta {:?}\n  vs {:?}", fast.meta, full.meta));
    }
    let ids: BTreeSet<&String> = fast.members.keys().chain(full.members.keys()).collect();
    for id in ids {
        let (a, b) = (fast.members.get(id), full.members.get(id));
        if a != b {
            out.push(format!("member {id}: {a:?}\n  vs {b:?}"));
        }
    }
    out.join("\n")
}

/// A loaded group with the fields a transition stamps with the time alone cleared.
pub(super) fn comparable(group: Option<Group>) -> Option<Group> {
    let mut group = group?;
    group.meta.updated_at.clear();
    // The metadataVersion a member last reported is descriptive only (read by nothing but
    // `describe`), and the fast path does not record it: a steady request's version is the
    // group's (its fingerprint says so), while a full transition stores the request's.
    for member in group.members.values_mut() {
        member.metadata_version = 0;
    }
    Some(group)
}
