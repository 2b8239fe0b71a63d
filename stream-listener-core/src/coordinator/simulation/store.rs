//! The group store of `store/group/`, modelled field by field for the simulation: what a full
//! transition writes (`Writes::diff`), what a load reads back (`decode_group` with
//! `apply_fast_path_state`), and what the fast-path Lua script (`scripts::group_fast_path`)
//! checks and does, and a combined batch of full transitions (`combining.rs`, with
//! `heartbeat_batch`). Each operation is atomic, as a script is; a compare-and-set that loses
//! every attempt to concurrent writers is modelled by the caller as a `RETRY` answer.
//!
//! Keep it in step with the real store: a change there that this model does not follow makes
//! the simulation check something other than what runs.

use std::collections::{BTreeMap, BTreeSet};

use crate::coordinator::{
    Context, CoordinatorConfig, CoordinatorError, Group, ShardHolders, SteadyMarker, StreamView,
    Transition, heartbeat, heartbeat_batch, heartbeat_with_fences, member_lease_ttl_us,
    request_fingerprint, steady_fingerprint, steady_response,
};
use crate::fence::FenceToken;
use crate::model::{HeartbeatRequest, HeartbeatResponse, HeartbeatStatus, Micros, ShardIndex};

/// A heartbeat the store did not answer with a response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum StoreFailure {
    /// `StaleRequestSeq` (from the fast path's `{'2', last}` or the full transition).
    Stale { last: u64 },
    /// `MissingGroup`: the group hash does not exist.
    MissingGroup,
    /// The coordinator refused the request for another reason: a defect, for a well-formed one.
    Refused(String),
}

/// What the fast-path script answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum FastAnswer {
    /// `{'1', response}`; `renewed` when it moved the lease (a new `requestSeq`).
    Answered {
        response: HeartbeatResponse,
        renewed: bool,
    },
    /// `{'2', last}`.
    Stale { last: u64 },
    /// `{'0'}`, with the check that sent it to the full transition.
    Fallback(&'static str),
}

/// The group's Redis keys: the hash `sl:{..}:group` (its `meta` and `member:<id>` JSON as the
/// coordinator state, and the fast-path fields) and the sorted set `:leases`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(super) struct Store {
    /// `meta` and the `member:<id>` fields as last written by a full transition (the member JSON
    /// keeps the lease of that write; a load takes it from `leases`). `None`: the hash is gone.
    pub(super) group: Option<Group>,
    /// `:leases`: member id → expiry (µs).
    pub(super) leases: BTreeMap<String, Micros>,
    /// `steady`: the stream version, the next deadline (0: none) and the group's epochs.
    pub(super) steady: Option<SteadyMarker>,
    /// `fast:<id>`: the steady fingerprint and the steady response without the group's epochs
    /// (`SteadyMarker::member_part`).
    pub(super) fast: BTreeMap<String, (String, HeartbeatResponse)>,
    /// `fastseq:<id>`.
    pub(super) fast_seq: BTreeMap<String, u64>,
    /// `fastworkers:<id>`.
    pub(super) fast_workers: BTreeMap<String, u32>,
    pub(super) revision: u64,
    pub(super) lease_revision: u64,
}

impl Store {
    /// `provision`: creates the group hash if absent, at `now`, with the hand-out hold of
    /// `config`'s lease when `after_loss`. Returns whether it was created.
    pub(super) fn provision(
        &mut self,
        stream: &StreamView,
        now: Micros,
        after_loss: bool,
        config: &CoordinatorConfig,
    ) -> bool {
        if self.group.is_some() {
            return false;
        }
        let mut group = Group::new("orders", "g", stream, now);
        if after_loss {
            group.meta.hand_out_not_before = Some(now + config.lease_ttl_us());
        }
        *self = Store {
            group: Some(group),
            revision: 1,
            ..Store::default()
        };
        true
    }

    /// The whole hash and the leases are lost (a failover to an empty replica, a flush).
    pub(super) fn lose_everything(&mut self) {
        *self = Store::default();
    }

    /// `load` + `decode_group`: the coordinator state as a transition of a process with `config`
    /// sees it (the config only matters for `lastHeartbeatAt`).
    pub(super) fn load(&self, config: &CoordinatorConfig) -> Option<Group> {
        let mut group = self.group.clone()?;
        group.history.clear();
        for (id, member) in group.members.iter_mut() {
            if let Some(lease) = self.leases.get(id) {
                // The member's own TTL (docs/design.md §6.5).
                let ttl = member_lease_ttl_us(member, config);
                member.member_lease_expires_at = *lease;
                member.last_heartbeat_at = member.last_heartbeat_at.max(lease.saturating_sub(ttl));
            }
            // apply_fast_path_state
            let Some(seq) = self.fast_seq.get(id) else {
                continue;
            };
            let entry = self.fast.get(id);
            let same_process = entry
                .and_then(|(print, _)| print.split_once('|'))
                .is_some_and(|(process, _)| process == member.process_id);
            if !same_process || *seq <= member.last_request_seq {
                continue;
            }
            member.last_request_seq = *seq;
            if let Some(workers) = self.fast_workers.get(id) {
                member.active_consumer_workers = *workers;
            }
            if let Some((_, response)) = entry {
                member.last_response = Some(HeartbeatResponse {
                    group_epoch: group.meta.group_epoch,
                    assignment_epoch: group.meta.assignment_epoch,
                    ..response.clone()
                });
            }
        }
        Some(group)
    }

    /// The fast-path script, for a request of a process with `config` whose store read the
    /// stream's `metadataVersion` `stream_version`, at Redis `TIME` `now`.
    pub(super) fn fast_path(
        &mut self,
        request: &HeartbeatRequest,
        config: &CoordinatorConfig,
        stream_version: u64,
        now: Micros,
    ) -> FastAnswer {
        let Some(print) = request_fingerprint(request) else {
            return FastAnswer::Fallback("not eligible");
        };
        let Some(marker) = self.steady else {
            return FastAnswer::Fallback("no steady marker");
        };
        if marker.metadata_version != stream_version {
            return FastAnswer::Fallback("stream metadataVersion changed");
        }
        if marker.deadline > 0 && now >= marker.deadline {
            return FastAnswer::Fallback("deadline passed");
        }
        let Some((stored_print, response)) = self.fast.get(&request.member_id) else {
            return FastAnswer::Fallback("no fast entry");
        };
        if *stored_print != print {
            return FastAnswer::Fallback("fingerprint differs");
        }
        let response = marker.complete(response.clone());
        let last = self.fast_seq.get(&request.member_id).copied().unwrap_or(0);
        let seq = request.request_seq;
        if seq < last {
            return FastAnswer::Stale { last };
        }
        if seq == last {
            let others_due = self
                .leases
                .iter()
                .any(|(id, lease)| *lease <= now && *id != request.member_id);
            if others_due {
                return FastAnswer::Fallback("another member's lease passed");
            }
            return FastAnswer::Answered {
                response,
                renewed: false,
            };
        }
        if let Some(reason) = self.lease_checks(&request.member_id, now, config) {
            return FastAnswer::Fallback(reason);
        }
        self.renew(request, now, config);
        FastAnswer::Answered {
            response,
            renewed: true,
        }
    }

    /// The script's checks on the sorted set: the earliest lease has not passed, and the
    /// requester's own lease is at least half its TTL ahead (else the full transition decides
    /// whether there was an outage to re-arm).
    fn lease_checks(
        &self,
        member_id: &str,
        now: Micros,
        config: &CoordinatorConfig,
    ) -> Option<&'static str> {
        let ttl = config.lease_ttl_us();
        let Some(first) = self.leases.values().min() else {
            return Some("no lease");
        };
        if *first <= now {
            return Some("earliest lease passed");
        }
        match self.leases.get(member_id) {
            Some(own) if 2 * *own >= 2 * now + ttl => None,
            _ => Some("own lease old (outage?)"),
        }
    }

    /// `ZADD XX` with the requester's TTL, `fastseq`, `fastworkers`, `HINCRBY leaseRevision`.
    fn renew(&mut self, request: &HeartbeatRequest, now: Micros, config: &CoordinatorConfig) {
        if let Some(lease) = self.leases.get_mut(&request.member_id) {
            *lease = now + config.lease_ttl_us();
        }
        self.fast_seq
            .insert(request.member_id.clone(), request.request_seq);
        self.fast_workers
            .insert(request.member_id.clone(), request.active_consumer_workers);
        self.lease_revision += 1;
    }

    /// What the fast path would do for `request` if its checks on the steady marker, deadline and
    /// leases were skipped: the lease moves, the stored response is the answer. `None` when the
    /// request does not match the member's fast entry or its sequence is not new.
    pub(super) fn forced_fast_path(
        &self,
        request: &HeartbeatRequest,
        config: &CoordinatorConfig,
        now: Micros,
    ) -> Option<(Store, HeartbeatResponse)> {
        let print = request_fingerprint(request)?;
        let (stored_print, response) = self.fast.get(&request.member_id)?;
        let last = self.fast_seq.get(&request.member_id).copied().unwrap_or(0);
        if *stored_print != print || request.request_seq <= last {
            return None;
        }
        // The group's epochs, which `steady` carries when it is there.
        let meta = &self.group.as_ref()?.meta;
        let response = HeartbeatResponse {
            group_epoch: meta.group_epoch,
            assignment_epoch: meta.assignment_epoch,
            ..response.clone()
        };
        let mut after = self.clone();
        after.renew(request, now, config);
        Some((after, response))
    }

    /// The full transition (`GroupStore::heartbeat` after the fast path): load, the pure
    /// transition (again with the fences when it asks for them), and the compare-and-set of
    /// `Writes::diff`. `stream` is the view the process read before the load; `current` the
    /// stream metadata now, which the store reads again when the loaded group's
    /// `metadataVersion` is above `stream`'s. `fences` is this group's fence of every shard.
    pub(super) fn full_transition(
        &mut self,
        request: &HeartbeatRequest,
        config: &CoordinatorConfig,
        stream: &StreamView,
        current: &StreamView,
        fences: &BTreeMap<ShardIndex, FenceToken>,
        now: Micros,
    ) -> Result<HeartbeatResponse, StoreFailure> {
        let loaded = self.load(config).ok_or(StoreFailure::MissingGroup)?;
        let stream = applied_view(&loaded, stream, current, config);
        let mut group = loaded.clone();
        let ctx = Context { now, stream };
        let result = match heartbeat(&mut group, request, &ctx, config) {
            Ok(Transition::Done(response)) => Ok(response),
            Ok(Transition::NeedsFences) => {
                let readable: BTreeMap<ShardIndex, FenceToken> = fences
                    .iter()
                    .filter(|(s, _)| stream.readable.contains(s))
                    .map(|(s, t)| (*s, t.clone()))
                    .collect();
                group = loaded.clone();
                heartbeat_with_fences(&mut group, request, &ctx, &readable, config)
            }
            Err(error) => Err(error),
        };
        match result {
            Ok(response) => {
                self.write(&loaded, group, config);
                Ok(response)
            }
            Err(CoordinatorError::StaleRequestSeq { last, .. }) => {
                Err(StoreFailure::Stale { last })
            }
            Err(other) => Err(StoreFailure::Refused(other.to_string())),
        }
    }

    /// A combined batch (`GroupStore::combine`): one load with the combiner's `config`, the
    /// stream view the combiner read (`stream`, or `current` as in [`Store::full_transition`]),
    /// `heartbeat_batch` on the queued `requests` at `now`, each with its requester's timings,
    /// and one write of `Writes::diff` with the combiner's config. Per request its response, or
    /// `None` ("solo"): its requester runs its own [`Store::full_transition`]. Without a group
    /// hash every request is solo: the queue script does not queue into a missing hash. A batch
    /// that answers nothing leaves the group as loaded, with nothing of it for `Writes::diff` to
    /// write (only the answers and the end of the queue, which the model does not keep): the
    /// coordinator state is not rewritten at an instant no transition advanced it to.
    pub(super) fn combined_batch(
        &mut self,
        requests: &[Option<(HeartbeatRequest, CoordinatorConfig)>],
        config: &CoordinatorConfig,
        stream: &StreamView,
        current: &StreamView,
        now: Micros,
    ) -> Vec<Option<HeartbeatResponse>> {
        let Some(loaded) = self.load(config) else {
            return vec![None; requests.len()];
        };
        let stream = applied_view(&loaded, stream, current, config);
        let ctx = Context { now, stream };
        let (group, answers) = heartbeat_batch(&loaded, requests, &ctx);
        if answers.iter().any(Option::is_some) {
            self.write(&loaded, group, config);
        }
        answers
    }

    /// The `RETRY` answer of a heartbeat whose compare-and-set lost every attempt.
    pub(super) fn retry_response(
        &self,
        config: &CoordinatorConfig,
    ) -> Result<HeartbeatResponse, StoreFailure> {
        let group = self.load(config).ok_or(StoreFailure::MissingGroup)?;
        Ok(HeartbeatResponse {
            status: HeartbeatStatus::Retry,
            ..crate::coordinator::base_response(&group, config)
        })
    }

    /// `Writes::diff` applied by the compare-and-set script: every changed field of `group`
    /// against `loaded`, the fast-path fields of a STABLE group from `steady_response` with the
    /// writer's `config`, the `steady` marker from `next_deadline`. A member's JSON is written
    /// only when the transition changed the member or its fast-path fields changed; otherwise
    /// the stored one stays (with its older lease and sequence, which the load brings up to date).
    pub(super) fn write(&mut self, loaded: &Group, mut group: Group, config: &CoordinatorConfig) {
        let marker = SteadyMarker::of(&group);
        let holders = ShardHolders::of(&group);
        let mut fast_changed = BTreeSet::new();
        for (id, member) in &group.members {
            if marker.is_none() {
                continue;
            }
            if let Some(response) = steady_response(&group, id, config, &holders) {
                let print = steady_fingerprint(
                    &member.process_id,
                    member.member_epoch,
                    group.meta.metadata_version,
                    member.runtime_max_concurrency,
                    member.current_assignment.iter(),
                );
                let entry = (print, SteadyMarker::member_part(response));
                if self.fast.get(id) != Some(&entry) {
                    self.fast.insert(id.clone(), entry);
                    fast_changed.insert(id.clone());
                }
                if self.fast_seq.get(id) != Some(&member.last_request_seq) {
                    self.fast_seq.insert(id.clone(), member.last_request_seq);
                    fast_changed.insert(id.clone());
                }
            } else if !config.variant.outdated_fast_entries {
                // No steady answer: the entry of an earlier steady write goes (docs/design.md
                // §5.3).
                let removed = self.fast.remove(id).is_some()
                    | self.fast_seq.remove(id).is_some()
                    | self.fast_workers.remove(id).is_some();
                if removed {
                    fast_changed.insert(id.clone());
                }
            }
        }
        self.steady = marker;
        for id in loaded.members.keys() {
            if !group.members.contains_key(id) {
                self.fast.remove(id);
                self.fast_seq.remove(id);
                self.fast_workers.remove(id);
            }
        }
        self.leases.retain(|id, _| group.members.contains_key(id));
        for (id, member) in &group.members {
            self.leases
                .insert(id.clone(), member.member_lease_expires_at);
        }
        if let Some(stored) = &self.group {
            for (id, member) in group.members.iter_mut() {
                let unchanged =
                    !fast_changed.contains(id) && loaded.members.get(id) == Some(member);
                if let Some(kept) = stored.members.get(id).filter(|_| unchanged) {
                    *member = kept.clone();
                }
            }
        }
        // The history list is written (LPUSH) but never loaded.
        group.history.clear();
        self.group = Some(group);
        self.revision += 1;
    }
}

/// The stream view a transition on `loaded` applies: the one its process read (`stream`), or the
/// stream metadata now (`current`) when the loaded group's `metadataVersion` is above it, which
/// the store reads again then (docs/design.md §5.4).
pub(super) fn applied_view<'a>(
    loaded: &Group,
    stream: &'a StreamView,
    current: &'a StreamView,
    config: &CoordinatorConfig,
) -> &'a StreamView {
    if loaded.meta.metadata_version > stream.metadata_version && !config.variant.stale_view_applied
    {
        current
    } else {
        stream
    }
}
