//! Deterministic simulation of the heartbeat protocol (docs/design.md §4–§8), through the store.
//!
//! A seeded scheduler drives member processes that apply responses with the runtime's own
//! reconciler (`member::reconciler`: one heartbeat in flight, lease from the send time of the
//! first attempt, revoke before assign, rejoin after fencing, the interval and lease the response
//! carries), exactly as docs/design.md §6 says, through joins, leaves, static leaves and restarts,
//! crashes, pauses, lost / duplicated / delayed / reordered requests and replies, client retries
//! of a request whose effect was applied, slow revokers and time. Each process has its own
//! `[coordination]` timings (its store's [`CoordinatorConfig`]); rolling restarts change them.
//! Admin operations change the stream (scale out, scale in to DRAINING, retirement, cancel,
//! registrations), and each request carries the stream metadata its process read when it sent it.
//! The group can revert to an earlier snapshot (lost writes) or be lost as a whole, after which
//! the next member re-provisions it with a hand-out hold, as the runtime does.
//!
//! Heartbeats go through a model of the store ([`store`]): the fast-path script whenever the
//! real one would answer, else the full transition and the writes of `Writes::diff`. Members
//! raise and check per-shard fences as §8 says; a reverted snapshot does not revert them.
//!
//! After every step: the invariants of §4 on the coordinator ([`super::invariants`]); epochs
//! never decrease; the group's `metadataVersion` never goes back; from the members' side, no
//! shard is readable by two processes at the same instant — by lease alone while no write was
//! lost, and through the fences always. After every heartbeat: a response carries the
//! requester's own timings; a fast-path answer is what the full transition would answer and
//! leaves what it would leave; the fast path does not fall back on a request whose full
//! transition only renews the lease. Each history ends with a fault-free phase in which every
//! member heartbeats on the schedule its responses give it: none may expire, the group must reach
//! STABLE with every shard read by one member, and further heartbeats must change no epoch.
//!
//! Replay a failing seed with `SIM_SEED=<seed> cargo test -p stream-listener-core simulation`;
//! `SIM_SEEDS=<n>` runs more seeds; `SIM_STEPS=<n>` sets the steps of a history; the ignored
//! tests `replay` and `long_random_histories_keep_every_invariant` take their faults from
//! `SIM_FAULTS` (e.g. `all`, or `survived,-stale_views`).

mod store;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::invariants::check_group;
use super::{CoordinatorConfig, Group, StreamView, Variant};
use crate::fence::{FenceToken, FenceVerdict};
use crate::member::reconciler::{Identity, Reconciler};
use crate::model::{
    Epoch, FenceConflict, GroupState, HeartbeatRequest, HeartbeatResponse, HeartbeatStatus,
    LEAVE_EPOCH, MemberState, Micros, RevokeState, STATIC_LEAVE_EPOCH, ShardIndex, ShardState,
};
use store::{FastAnswer, Store, StoreFailure};

const MS: Micros = 1_000;
/// Sim time at the start of every history (µs).
const START: Micros = 1_000_000 * MS;
/// `[coordination]` profiles: heartbeat interval, member lease TTL, rebalance timeout (µs).
/// Profile 0 is the one every process has without [`Faults::mixed_timings`].
const PROFILES: [(Micros, Micros, Micros); 3] = [
    (1_000 * MS, 3_000 * MS, 2_000 * MS),
    (500 * MS, 2_000 * MS, 1_500 * MS),
    // The rolling change of docs/design.md §6.5 scaled down (15 s / 3 s → 60 s / 20 s): its
    // interval is longer than the other profiles' leases.
    (4_000 * MS, 12_000 * MS, 8_000 * MS),
];
/// The longest interval, lease and rebalance timeout of [`PROFILES`].
const MAX_HEARTBEAT: Micros = 4_000 * MS;
const MAX_LEASE: Micros = 12_000 * MS;
const MAX_REBALANCE: Micros = 8_000 * MS;
/// Time step of the fault-free phase; every interval of [`PROFILES`] is a multiple of it.
const TICK: Micros = 250 * MS;
/// Highest shard count a scale-out reaches.
const MAX_SHARDS: u32 = 10;

fn profile_config(profile: usize, variant: Variant) -> CoordinatorConfig {
    let (heartbeat, lease, rebalance) = PROFILES[profile];
    CoordinatorConfig {
        heartbeat_interval: Duration::from_micros(heartbeat),
        member_lease_ttl: Duration::from_micros(lease),
        rebalance_timeout: Duration::from_micros(rebalance),
        history_capacity: 8,
        variant,
    }
}

fn us(d: Duration) -> Micros {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// What a process knows of a shard's fence, as the poller does: the token it raised, or the
/// token the fence refused (it parks until the coordinator gives it another).
#[derive(Debug, Clone, Default)]
struct ShardFence {
    raised: Option<FenceToken>,
    refused: Option<FenceToken>,
}

#[derive(Debug, Clone)]
struct InFlight {
    request: HeartbeatRequest,
    first_sent_at: Micros,
    /// The stream metadata the process's store read for this heartbeat.
    view: StreamView,
}

/// One member process: the runtime's own [`Reconciler`] (the member rules of docs/design.md §6),
/// its store's timings, and what the poller knows of each shard's fence.
#[derive(Debug, Clone)]
struct Proc {
    reconciler: Reconciler,
    member_id: String,
    process_id: String,
    instance_id: Option<String>,
    /// The `[coordination]` section of this process (its store runs with it).
    config: CoordinatorConfig,
    /// The heartbeat interval the last response gave it (µs), as `member/heartbeat.rs` adopts it.
    interval: Micros,
    /// When the next heartbeat is due by that interval.
    next_due: Micros,
    alive: bool,
    paused_until: Micros,
    leaving: bool,
    seq: u64,
    in_flight: Option<InFlight>,
    fences: BTreeMap<ShardIndex, ShardFence>,
    slow_revoker: bool,
    /// Fault-free phase: has heartbeated on schedule since it last joined (it must not expire).
    punctual: bool,
    /// Sim time 0 as a monotonic instant (the reconciler works with `Instant`s).
    base: Instant,
}

impl Proc {
    fn new(
        member_id: String,
        process_id: String,
        instance_id: Option<String>,
        weight: u32,
        config: CoordinatorConfig,
        now: Micros,
        base: Instant,
    ) -> Self {
        let reconciler = Reconciler::new(Identity {
            member_id: member_id.clone(),
            member_name: "sim".into(),
            instance_id: instance_id.clone(),
            process_id: process_id.clone(),
            runtime_max_concurrency: weight,
        });
        Proc {
            reconciler,
            member_id,
            process_id,
            instance_id,
            interval: us(config.heartbeat_interval),
            config,
            next_due: now,
            alive: true,
            paused_until: 0,
            leaving: false,
            seq: 0,
            in_flight: None,
            fences: BTreeMap::new(),
            slow_revoker: false,
            punctual: false,
            base,
        }
    }

    fn instant(&self, now: Micros) -> Instant {
        self.base + Duration::from_micros(now - START)
    }

    fn can_act(&self, now: Micros) -> bool {
        self.alive && now >= self.paused_until
    }

    /// A client's retry of a heartbeat without an answer: after half an interval of its own.
    fn request_timeout(&self) -> Micros {
        us(self.config.heartbeat_interval) / 2
    }

    /// Would read `shard` now if fences did not exist.
    fn reads_by_lease(&self, shard: ShardIndex, now: Micros) -> bool {
        self.can_act(now) && self.reconciler.may_use(shard, self.instant(now))
    }

    /// Reads `shard` now through its fence: raised with the current token, and the fence holds it.
    fn reads_by_fence(&self, shard: ShardIndex, now: Micros, fence: Option<&FenceToken>) -> bool {
        let Some(token) = self.reconciler.token(shard) else {
            return false;
        };
        let state = self.fences.get(&shard);
        self.reads_by_lease(shard, now)
            && state.is_some_and(|f| f.raised.as_ref() == Some(token))
            && token.check(fence) == FenceVerdict::Equal
    }

    fn owned_shards(&self) -> Vec<ShardIndex> {
        self.reconciler.owned().keys().copied().collect()
    }

    fn draining_shards(&self) -> Vec<ShardIndex> {
        self.reconciler
            .revoking()
            .iter()
            .filter(|(_, s)| **s == RevokeState::Draining)
            .map(|(s, _)| *s)
            .collect()
    }

    fn build_request(&mut self) -> HeartbeatRequest {
        self.seq += 1;
        self.reconciler.request(self.seq)
    }

    /// docs/design.md §6.7, member rules, as the runtime applies them: the lease margin is a fifth
    /// of the response's TTL, and the next heartbeat is due after the response's interval.
    fn apply(
        &mut self,
        response: &HeartbeatResponse,
        request: &HeartbeatRequest,
        sent_at: Micros,
        now: Micros,
    ) {
        let margin = Duration::from_millis(response.member_lease_ttl_ms) / 5;
        let changes = self
            .reconciler
            .apply(response, request, self.instant(sent_at), margin);
        self.interval = response.heartbeat_interval_ms.max(1) * MS;
        self.next_due = now + self.interval;
        if changes.fatal {
            self.alive = false;
        }
        if changes.stop_all {
            self.fences.clear();
            self.punctual = false;
        }
    }
}

#[derive(Debug, Clone)]
struct Message {
    proc: usize,
    request: HeartbeatRequest,
    view: StreamView,
}

#[derive(Debug, Clone)]
struct Reply {
    proc: usize,
    seq: u64,
    outcome: Result<HeartbeatResponse, StoreFailure>,
}

/// Which faults a history may contain.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Faults {
    pub(crate) lost_writes: bool,
    /// Admin operations on the stream: scale out, scale in, retirement, cancel, registrations.
    pub(crate) stream_changes: bool,
    /// Check the coordinator's own holdings (one holder per shard) too, not only what members read.
    pub(crate) check_holdings: bool,
    /// Processes with different `[coordination]` timings in one group, changed by rolling restarts.
    pub(crate) mixed_timings: bool,
    /// The group hash and its leases lost; the next member re-provisions it with a hand-out hold.
    pub(crate) group_loss: bool,
    /// A request's stream metadata is the one its process read when it sent it, which a later
    /// transition of another process may already have passed.
    pub(crate) stale_views: bool,
    /// Skip the checks that compare a fast-path answer with the full transition's, a fallback
    /// with its full transition, and a response's timings with the requester's: a defect must
    /// then show through what it breaks (two readers, a punctual member expired, no convergence,
    /// a settled group off the fast path).
    pub(crate) effects_only: bool,
}

impl Faults {
    /// Every fault that today's protocol survives: all of them since stale views no longer take
    /// a group's `metadataVersion` back (docs/design.md §5.4). Kept apart from [`Faults::all`] so a
    /// fault found failing again can be left out here, with a `finds_*` test pinning it.
    pub(crate) fn survived() -> Self {
        Faults::all()
    }

    /// Every fault.
    pub(crate) fn all() -> Self {
        Faults {
            lost_writes: true,
            stream_changes: true,
            check_holdings: true,
            mixed_timings: true,
            group_loss: true,
            stale_views: true,
            effects_only: false,
        }
    }
}

/// The stream metadata, as the admin operations change it (docs/design.md §3, §10).
#[derive(Debug, Clone)]
struct SimStream {
    shards: BTreeMap<ShardIndex, ShardState>,
    shard_count: u32,
    metadata_version: u64,
    /// The running migration: its `fromShardCount` and the shards it set DRAINING.
    migration: Option<(u32, BTreeSet<ShardIndex>)>,
}

impl SimStream {
    fn view(&self) -> StreamView {
        let highest = self.shards.keys().map(|s| s + 1).max();
        StreamView {
            metadata_version: self.metadata_version,
            shard_count: self.shard_count,
            readable: self
                .shards
                .iter()
                .filter(|(_, s)| s.is_readable())
                .map(|(i, _)| *i)
                .collect(),
            shard_index_bound: highest.unwrap_or(0).max(self.shard_count),
        }
    }
}

/// Counts for the report of a long run.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Stats {
    pub(crate) steps: u64,
    pub(crate) fast_answers: u64,
    pub(crate) full_transitions: u64,
    pub(crate) admin_ops: u64,
    pub(crate) group_losses: u64,
}

struct World {
    rng: ChaCha8Rng,
    now: Micros,
    variant: Variant,
    faults: Faults,
    /// False in the fault-free phase.
    faulty: bool,
    stream: SimStream,
    store: Store,
    snapshots: Vec<Store>,
    fences: BTreeMap<ShardIndex, FenceToken>,
    procs: Vec<Proc>,
    to_coordinator: Vec<Message>,
    to_members: Vec<Reply>,
    next_member: usize,
    next_process: usize,
    /// The profile new processes start with (a rolling change moves it).
    rollout: usize,
    writes_lost: bool,
    /// The group was lost: what members of the lost incarnation still hold is unknown to the
    /// coordinator, so its holdings are not checked (what members read still is, by lease too).
    group_lost: bool,
    last_epochs: Option<(Micros, Epoch, Epoch)>,
    member_epochs: BTreeMap<String, (Micros, Epoch)>,
    last_metadata_version: Option<u64>,
    stats: Stats,
    log: Vec<String>,
    /// Sim time [`START`] as a monotonic instant, for the members' reconcilers.
    base: Instant,
}

const MAX_MEMBERS: usize = 6;

impl World {
    fn new(seed: u64, variant: Variant, faults: Faults) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let shards = rng.random_range(1..=6u32);
        let mut stream = SimStream {
            shards: (0..shards).map(|s| (s, ShardState::Active)).collect(),
            shard_count: shards,
            metadata_version: 1,
            migration: None,
        };
        let now = START;
        // Group registration: the group hash first (at the stream's version), then the
        // registration bumps the stream's metadataVersion.
        let mut store = Store::default();
        store.provision(&stream.view(), now, false, &profile_config(0, variant));
        stream.metadata_version += 1;
        World {
            rng,
            now,
            variant,
            faults,
            faulty: true,
            stream,
            store,
            snapshots: Vec::new(),
            fences: BTreeMap::new(),
            procs: Vec::new(),
            to_coordinator: Vec::new(),
            to_members: Vec::new(),
            next_member: 0,
            next_process: 0,
            rollout: 0,
            writes_lost: false,
            group_lost: false,
            last_epochs: None,
            member_epochs: BTreeMap::new(),
            last_metadata_version: None,
            stats: Stats::default(),
            log: Vec::new(),
            base: Instant::now(),
        }
    }

    fn new_process_id(&mut self) -> String {
        self.next_process += 1;
        format!("p{}", self.next_process)
    }

    /// The timings of a new process: the rollout's, or with mixed timings sometimes another.
    fn new_process_config(&mut self) -> (usize, CoordinatorConfig) {
        let profile = if self.faults.mixed_timings && self.rng.random_bool(0.3) {
            self.rng.random_range(0..PROFILES.len())
        } else {
            self.rollout
        };
        (profile, profile_config(profile, self.variant))
    }

    fn spawn_member(&mut self) {
        let id = format!("m{}", self.next_member);
        self.next_member += 1;
        let is_static = self.rng.random_bool(0.4);
        let process = self.new_process_id();
        let weight = if self.rng.random_bool(0.7) {
            1
        } else {
            self.rng.random_range(2..=3)
        };
        let (_, config) = self.new_process_config();
        let mut proc = Proc::new(
            id.clone(),
            process,
            is_static.then(|| format!("static-{id}")),
            weight,
            config,
            self.now,
            self.base,
        );
        proc.slow_revoker = self.rng.random_bool(0.2);
        self.procs.push(proc);
    }

    /// A new process for a static member's id, while the old one may still run; with mixed
    /// timings it may come with other timings (a rolling change of `[coordination]`).
    fn restart_static(&mut self, index: usize) {
        let old = &self.procs[index];
        let (id, instance) = (old.member_id.clone(), old.instance_id.clone());
        let weight = old.reconciler.identity().runtime_max_concurrency;
        let process = self.new_process_id();
        let (profile, config) = self.new_process_config();
        self.log.push(format!(
            "t={} restart {id} as {process} with profile {profile}",
            self.now / MS,
        ));
        let proc = Proc::new(id, process, instance, weight, config, self.now, self.base);
        self.procs.push(proc);
    }

    fn live_procs(&self) -> usize {
        self.procs.iter().filter(|p| p.alive).count()
    }

    /// The config the invariant checks load the group with (only `lastHeartbeatAt` depends on it).
    fn check_config(&self) -> CoordinatorConfig {
        profile_config(0, self.variant)
    }

    // ---- the store -----------------------------------------------------------------------------

    fn deliver_to_coordinator(&mut self, message: Message) -> Result<(), String> {
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
                // Every compare-and-set lost to concurrent writers: `RETRY`, nothing written.
                let contended = self.faulty && self.rng.random_bool(0.02);
                let outcome = if contended {
                    self.store.retry_response(&config)
                } else {
                    let current = self.stream.view();
                    self.store
                        .full_transition(request, &config, &view, &current, &self.fences, now)
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
                    if self.store.provision(&current, self.now, true, &config) {
                        self.log.push(format!(
                            "t={} {} re-provisions the group, hold {}ms",
                            now / MS,
                            request.member_id,
                            us(config.member_lease_ttl) / MS
                        ));
                    }
                }
                if !contended && !self.faults.effects_only {
                    self.check_needless_fallback(&before, reason, request, &config, &outcome)?;
                }
                outcome
            }
        };
        self.log.push(format!(
            "t={} coord {}({}) seq={} epoch={} mv={} owned={:?} rev={:?} -> {}",
            now / MS,
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
            match &outcome {
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
        if self.store != before {
            if self.store.group.is_some() {
                self.snapshots.push(self.store.clone());
                if self.snapshots.len() > 30 {
                    self.snapshots.remove(0);
                }
            }
            self.check_coordinator()?;
        }
        if let Ok(response) = &outcome
            && !self.faults.effects_only
        {
            check_timings(response, &config)?;
        }
        self.to_members.push(Reply {
            proc: message.proc,
            seq: request.request_seq,
            outcome,
        });
        Ok(())
    }

    /// The fast path answered: the full transition on the same state must answer the same, and
    /// when the fast path renewed the lease, leave the same coordinator state.
    fn check_fast_answer(
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
    fn check_needless_fallback(
        &self,
        before: &Store,
        reason: &str,
        request: &HeartbeatRequest,
        config: &CoordinatorConfig,
        outcome: &Result<HeartbeatResponse, StoreFailure>,
    ) -> Result<(), String> {
        // Only the deadline: a passed lease may be rescued by the outage re-arm, which changes
        // nothing visible when the requester holds the only lease, and the script cannot tell.
        if reason != "deadline passed" {
            return Ok(());
        }
        let Some((forced, response)) = before.forced_fast_path(request, config, self.now) else {
            return Ok(());
        };
        let same = outcome.as_ref() == Ok(&response)
            && comparable(forced.load(config)) == comparable(self.store.load(config));
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

    fn check_coordinator(&mut self) -> Result<(), String> {
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

    fn revert(&mut self) {
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
    fn lose_group(&mut self) {
        self.store.lose_everything();
        self.snapshots.clear();
        self.group_lost = true;
        self.stats.group_losses += 1;
        self.log.push(format!("t={} GROUP LOST", self.now / MS));
    }

    // ---- admin operations on the stream (docs/design.md §10) ------------------------------------

    fn admin_operation(&mut self) {
        let stream = &mut self.stream;
        let roll = self.rng.random_range(0..5u32);
        let done = match roll {
            0 if stream.migration.is_none() && stream.shard_count < MAX_SHARDS => {
                // Scale out: new (or retired) indexes become ACTIVE.
                let target = (stream.shard_count + self.rng.random_range(1..=2)).min(MAX_SHARDS);
                for shard in stream.shard_count..target {
                    stream.shards.insert(shard, ShardState::Active);
                }
                stream.shard_count = target;
                "scale out"
            }
            1 if stream.migration.is_none() && stream.shard_count > 1 => {
                // Scale in: shards at or above the target become DRAINING (still readable).
                let target = self.rng.random_range(1..stream.shard_count);
                let mut draining = BTreeSet::new();
                for (index, state) in stream.shards.iter_mut() {
                    if *index >= target && *state == ShardState::Active {
                        *state = ShardState::Draining;
                        draining.insert(*index);
                    }
                }
                stream.migration = Some((stream.shard_count, draining));
                stream.shard_count = target;
                "scale in"
            }
            2 if stream.migration.is_some() => {
                // Retirement, one stage at a time: DRAINING → RETIRING (leaves the readable
                // set) → RETIRED; the migration ends with its last shard.
                let draining: Vec<ShardIndex> = stream
                    .shards
                    .iter()
                    .filter(|(_, s)| **s == ShardState::Draining)
                    .map(|(i, _)| *i)
                    .collect();
                if draining.is_empty() {
                    for state in stream.shards.values_mut() {
                        if *state == ShardState::Retiring {
                            *state = ShardState::Retired;
                        }
                    }
                    stream.migration = None;
                    "retire: RETIRED"
                } else {
                    for shard in draining {
                        stream.shards.insert(shard, ShardState::Retiring);
                    }
                    "retire: RETIRING"
                }
            }
            3 if stream.migration.as_ref().is_some_and(|(_, shards)| {
                shards
                    .iter()
                    .all(|s| stream.shards.get(s) == Some(&ShardState::Draining))
            }) =>
            {
                // Cancel: the migration's DRAINING shards become ACTIVE again.
                if let Some((from, shards)) = stream.migration.take() {
                    for shard in shards {
                        stream.shards.insert(shard, ShardState::Active);
                    }
                    stream.shard_count = from;
                }
                "cancel scale"
            }
            4 => "register another group",
            _ => return,
        };
        stream.metadata_version += 1;
        self.stats.admin_ops += 1;
        let view = stream.view();
        self.log.push(format!(
            "t={} admin {done}: mv={} count={} readable={:?}",
            self.now / MS,
            view.metadata_version,
            view.shard_count,
            view.readable
        ));
    }

    // ---- members ---------------------------------------------------------------------------------

    fn send_heartbeat(&mut self, index: usize) {
        let view = self.stream.view();
        let proc = &mut self.procs[index];
        let request = proc.build_request();
        proc.in_flight = Some(InFlight {
            request: request.clone(),
            first_sent_at: self.now,
            view: view.clone(),
        });
        self.to_coordinator.push(Message {
            proc: index,
            request,
            view,
        });
    }

    /// The client re-sends the request (a response timeout, a dropped connection): the same
    /// request, whether or not the first one was applied.
    fn retry_heartbeat(&mut self, index: usize) {
        if let Some(in_flight) = &self.procs[index].in_flight {
            self.to_coordinator.push(Message {
                proc: index,
                request: in_flight.request.clone(),
                view: in_flight.view.clone(),
            });
        }
    }

    /// Applies a reply. In the fault-free phase a member that heartbeats on the schedule its
    /// responses give it must never be expired: a fencing status for it is an error.
    fn deliver_to_member(&mut self, reply: Reply) -> Result<(), String> {
        let now = self.now;
        let proc = &mut self.procs[reply.proc];
        if !proc.can_act(now) {
            return Ok(());
        }
        let Some(in_flight) = proc.in_flight.clone() else {
            return Ok(()); // a duplicate, or a reply to a request given up on
        };
        if in_flight.request.request_seq != reply.seq {
            return Ok(());
        }
        proc.in_flight = None;
        let response = match reply.outcome {
            Ok(response) => response,
            Err(failure) => {
                // `member/heartbeat.rs`: an error; a stale sequence continues above the last.
                if let StoreFailure::Stale { last } = failure {
                    proc.seq = proc.seq.max(last);
                }
                proc.next_due = now + proc.interval;
                return Ok(());
            }
        };
        let fenced = matches!(
            response.status,
            HeartbeatStatus::UnknownMemberId | HeartbeatStatus::FencedMemberEpoch
        );
        if proc.punctual && fenced {
            return Err(format!(
                "{}({}) heartbeats every {}ms as told, its store's lease is {}ms, yet it got {:?}",
                proc.member_id,
                proc.process_id,
                proc.interval / MS,
                us(proc.config.member_lease_ttl) / MS,
                response.status
            ));
        }
        proc.apply(&response, &in_flight.request, in_flight.first_sent_at, now);
        // Punctual from a response on: unless a revoke deadline set in the faulty phase still
        // runs (a reply lost there may have left it too little time).
        let no_old_deadline = || {
            self.store
                .load(&profile_config(0, self.variant))
                .and_then(|g| g.members.get(&proc.member_id).cloned())
                .is_some_and(|m| m.process_id == proc.process_id && m.revoke_deadline.is_none())
        };
        if !self.faulty && response.status.renews_lease() && !proc.punctual && no_old_deadline() {
            proc.punctual = true;
        }
        self.log.push(format!(
            "t={} {}({}) applies {:?} owned={:?} lease={}",
            now / MS,
            proc.member_id,
            proc.process_id,
            response.status,
            proc.owned_shards(),
            proc.reconciler
                .lease_remaining(proc.instant(now))
                .as_millis()
        ));
        Ok(())
    }

    /// The member stops after a graceful drain: `-1`, or `-2` for a static member.
    fn leave(&mut self, index: usize, static_leave: bool) {
        let view = self.stream.view();
        let proc = &mut self.procs[index];
        proc.seq += 1;
        let mut request = proc.reconciler.leave_request(proc.seq);
        // The runtime sends -2 for every static member; the simulation also lets them send -1.
        request.member_epoch = if static_leave {
            STATIC_LEAVE_EPOCH
        } else {
            LEAVE_EPOCH
        };
        proc.alive = false;
        self.to_coordinator.push(Message {
            proc: index,
            request,
            view,
        });
    }

    /// One read attempt on a shard, as the poller makes it (docs/design.md §8): raise the fence
    /// with the current token first, then check it on every read; a refused token parks the shard
    /// until the coordinator gives another.
    fn read(&mut self, index: usize, shard: ShardIndex) {
        let now = self.now;
        let proc = &mut self.procs[index];
        if !proc.reads_by_lease(shard, now) {
            return;
        }
        let Some(token) = proc.reconciler.token(shard).cloned() else {
            return;
        };
        let state = proc.fences.entry(shard).or_default();
        if state.refused.as_ref() == Some(&token) {
            return;
        }
        let fence = self.fences.get(&shard);
        let verdict = if state.raised.as_ref() == Some(&token) {
            token.check(fence)
        } else {
            let (verdict, value) = token.raise(fence);
            self.fences.insert(shard, value);
            verdict
        };
        match verdict {
            FenceVerdict::Equal => state.raised = Some(token),
            FenceVerdict::Lower => state.raised = None,
            FenceVerdict::Higher => {
                state.raised = None;
                state.refused = Some(token);
                if let Some(found) = self.fences.get(&shard) {
                    proc.reconciler.fence_conflict(FenceConflict {
                        shard_index: shard,
                        incarnation: found.incarnation,
                        epoch: found.member_epoch,
                    });
                }
            }
        }
    }

    /// A draining shard finished: the poller wakes the heartbeat to report it at once.
    fn drain(&mut self, index: usize, shard: ShardIndex) {
        let proc = &mut self.procs[index];
        proc.reconciler.drained(shard);
        proc.next_due = self.now;
    }

    // ---- checks from the members' side ------------------------------------------------------------

    fn check_readers(&self) -> Result<(), String> {
        let now = self.now;
        let bound = self
            .stream
            .view()
            .shard_index_bound
            .max(self.fences.keys().map(|s| s + 1).max().unwrap_or(0));
        for shard in 0..bound {
            let by_fence: Vec<&str> = self
                .procs
                .iter()
                .filter(|p| p.reads_by_fence(shard, now, self.fences.get(&shard)))
                .map(|p| p.process_id.as_str())
                .collect();
            if by_fence.len() > 1 {
                return Err(format!(
                    "shard {shard} readable through its fence by {by_fence:?}"
                ));
            }
            if !self.writes_lost {
                let by_lease: Vec<&str> = self
                    .procs
                    .iter()
                    .filter(|p| p.reads_by_lease(shard, now))
                    .map(|p| p.process_id.as_str())
                    .collect();
                if by_lease.len() > 1 {
                    return Err(format!(
                        "shard {shard} readable by lease by {by_lease:?} at t={}",
                        now / MS
                    ));
                }
            }
        }
        Ok(())
    }

    // ---- the scheduler ---------------------------------------------------------------------------

    fn step(&mut self) -> Result<(), String> {
        self.stats.steps += 1;
        let roll = self.rng.random_range(0..100u32);
        let n = self.procs.len();
        match roll {
            0..=14 => self.now += self.rng.random_range(1..=MAX_HEARTBEAT / 4),
            15..=34 if n > 0 => {
                let i = self.rng.random_range(0..n);
                let p = &self.procs[i];
                if p.can_act(self.now) {
                    match &p.in_flight {
                        // On its schedule, or early (the runtime wakes the heartbeat on changes).
                        None if self.now >= p.next_due || self.rng.random_bool(0.3) => {
                            self.send_heartbeat(i)
                        }
                        None => {}
                        Some(f) if self.now >= f.first_sent_at + p.request_timeout() => {
                            self.retry_heartbeat(i)
                        }
                        Some(_) => {}
                    }
                }
            }
            35..=49 if !self.to_coordinator.is_empty() => {
                // Requests arrive in any order; some are lost, some delayed, some duplicated.
                let i = self.rng.random_range(0..self.to_coordinator.len());
                let message = if self.rng.random_bool(0.08) {
                    self.to_coordinator[i].clone()
                } else {
                    self.to_coordinator.swap_remove(i)
                };
                if self.rng.random_bool(0.9) {
                    self.deliver_to_coordinator(message)?;
                }
            }
            50..=62 if !self.to_members.is_empty() => {
                let i = self.rng.random_range(0..self.to_members.len());
                let reply = if self.rng.random_bool(0.1) {
                    self.to_members[i].clone() // duplicated
                } else {
                    self.to_members.swap_remove(i)
                };
                if self.rng.random_bool(0.92) {
                    self.deliver_to_member(reply)?;
                }
            }
            63..=74 if n > 0 => {
                let i = self.rng.random_range(0..n);
                let shards = self.procs[i].owned_shards();
                if !shards.is_empty() {
                    let shard = shards[self.rng.random_range(0..shards.len())];
                    self.read(i, shard);
                }
            }
            75..=82 if n > 0 => {
                let i = self.rng.random_range(0..n);
                let p = &self.procs[i];
                let draining = p.draining_shards();
                let slow = p.slow_revoker && self.rng.random_bool(0.8);
                if !draining.is_empty() && !slow {
                    let shard = draining[self.rng.random_range(0..draining.len())];
                    self.drain(i, shard);
                }
            }
            83..=85 if self.live_procs() < MAX_MEMBERS => self.spawn_member(),
            86 if n > 0 => {
                let i = self.rng.random_range(0..n);
                self.procs[i].alive = false; // crash
            }
            87 if n > 0 => {
                let i = self.rng.random_range(0..n);
                let lease = us(self.procs[i].config.member_lease_ttl);
                self.procs[i].paused_until = self.now + self.rng.random_range(1..=2 * lease);
            }
            88 if n > 0 => {
                // Restart a static member's process, while the old one runs or after it died.
                let i = self.rng.random_range(0..n);
                let latest = self
                    .procs
                    .iter()
                    .rposition(|p| p.member_id == self.procs[i].member_id);
                if self.procs[i].instance_id.is_some()
                    && latest == Some(i)
                    && self.live_procs() < MAX_MEMBERS + 2
                {
                    self.restart_static(i);
                }
            }
            89..=90 if n > 0 => {
                let i = self.rng.random_range(0..n);
                let p = &mut self.procs[i];
                if p.can_act(self.now) {
                    if !p.leaving {
                        // Graceful shutdown: stop reading, drain everything, then leave.
                        p.leaving = true;
                        p.reconciler.begin_leave();
                    } else if p.draining_shards().is_empty() {
                        let static_leave = p.instance_id.is_some() && self.rng.random_bool(0.6);
                        self.leave(i, static_leave);
                    }
                }
            }
            91 if self.faults.stream_changes => self.admin_operation(),
            92 if self.faults.lost_writes && self.rng.random_bool(0.3) => self.revert(),
            93 if self.faults.mixed_timings && self.rng.random_bool(0.3) => {
                // A rolling change of `[coordination]`: new processes start with other timings.
                self.rollout = self.rng.random_range(0..PROFILES.len());
                self.log.push(format!(
                    "t={} rollout of profile {}",
                    self.now / MS,
                    self.rollout
                ));
            }
            94 if self.faults.group_loss && self.rng.random_bool(0.05) => self.lose_group(),
            _ => self.now += self.rng.random_range(1..=MAX_HEARTBEAT / 8),
        }
        self.check_readers()
    }

    /// One tick of the fault-free phase: every live member whose heartbeat is due by its own
    /// schedule heartbeats, gets its reply at once, drains at once and reads its shards.
    fn settle_tick(&mut self) -> Result<(), String> {
        self.now += TICK;
        for i in 0..self.procs.len() {
            let p = &mut self.procs[i];
            if !p.alive || self.now < p.next_due {
                continue;
            }
            for shard in p.draining_shards() {
                p.reconciler.drained(shard);
            }
            if p.leaving {
                // A graceful shutdown completes: drained, it leaves.
                let static_leave = p.instance_id.is_some();
                self.leave(i, static_leave);
                if let Some(message) = self.to_coordinator.pop() {
                    self.deliver_to_coordinator(message)?;
                }
                self.to_members.clear();
                continue;
            }
            self.send_heartbeat(i);
            let message = self.to_coordinator.pop().ok_or("no message")?;
            self.deliver_to_coordinator(message)?;
            if let Some(reply) = self.to_members.pop() {
                self.deliver_to_member(reply)?;
            }
            if !self.procs[i].draining_shards().is_empty() {
                // Revoked: it drains at once, and the release wakes the next heartbeat.
                self.procs[i].next_due = self.now + TICK;
            }
            for shard in self.procs[i].owned_shards() {
                self.read(i, shard);
                self.read(i, shard);
            }
            self.check_readers()?;
        }
        Ok(())
    }

    fn epoch_fingerprint(&self) -> Option<(Micros, Epoch, Epoch, Vec<Epoch>)> {
        let group = self.store.load(&self.check_config())?;
        let meta = &group.meta;
        let members = group.members.values().map(|m| m.member_epoch).collect();
        Some((
            meta.incarnation,
            meta.group_epoch,
            meta.assignment_epoch,
            members,
        ))
    }

    fn settle(&mut self) -> Result<(), String> {
        self.faulty = false;
        self.to_coordinator.clear();
        self.to_members.clear();
        for p in &mut self.procs {
            p.paused_until = 0;
            p.in_flight = None;
            p.next_due = self.now;
            p.punctual = false;
        }
        self.log.push(format!("t={} SETTLE", self.now / MS));
        let ticks = (4 * MAX_LEASE + 4 * MAX_REBALANCE + 12 * MAX_HEARTBEAT) / TICK;
        for _ in 0..ticks {
            self.settle_tick()?;
            if self.is_settled() {
                break;
            }
        }
        if !self.is_settled() {
            let state = self.store.load(&self.check_config()).map(|g| g.meta.state);
            return Err(format!("no convergence: group {state:?}"));
        }
        // An unchanged group: heartbeats change no epoch and it stays STABLE; once every member
        // has heartbeated on the settled group, the fast path answers every heartbeat.
        let before = self.epoch_fingerprint();
        for _ in 0..MAX_HEARTBEAT / TICK {
            self.settle_tick()?;
        }
        let full_before = self.stats.full_transitions;
        for _ in 0..2 * MAX_HEARTBEAT / TICK {
            self.settle_tick()?;
        }
        if self.epoch_fingerprint() != before || !self.is_settled() {
            return Err(format!(
                "unchanged group changed epochs {before:?} -> {:?}",
                self.epoch_fingerprint(),
            ));
        }
        let full = self.stats.full_transitions - full_before;
        if full > 0 {
            return Err(format!(
                "a settled group ran {full} full transitions for steady heartbeats (steady {:?})",
                self.store.steady
            ));
        }
        Ok(())
    }

    fn is_settled(&self) -> bool {
        let any_alive = self.procs.iter().any(|p| p.alive);
        if !any_alive {
            return true;
        }
        let Some(group) = self.store.load(&self.check_config()) else {
            return false;
        };
        if group.meta.state != GroupState::Stable {
            return false;
        }
        // Every alive process is the live member it thinks it is, and every live member record
        // belongs to an alive process (dead and away members have expired).
        let members_match = self.procs.iter().filter(|p| p.alive).all(|p| {
            group.members.get(&p.member_id).is_some_and(|m| {
                m.process_id == p.process_id
                    && m.state == MemberState::Active
                    && m.member_epoch == p.reconciler.epoch()
            })
        });
        let records_alive = group.members.values().all(|m| {
            m.state != MemberState::Active
                || self
                    .procs
                    .iter()
                    .any(|p| p.alive && p.process_id == m.process_id)
        });
        if !members_match || !records_alive {
            return false;
        }
        self.stream.view().readable.iter().all(|shard| {
            self.procs
                .iter()
                .any(|p| p.reads_by_fence(*shard, self.now, self.fences.get(shard)))
        })
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
fn difference(fast: Option<&Group>, full: Option<&Group>) -> String {
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
fn comparable(group: Option<Group>) -> Option<Group> {
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

/// Runs one seeded history of `steps` steps, then the fault-free phase. `Err` carries the reason
/// and the last log lines.
pub(crate) fn run_history(
    seed: u64,
    steps: usize,
    variant: Variant,
    faults: Faults,
) -> Result<Stats, String> {
    let mut world = World::new(seed, variant, faults);
    let initial = world.rng.random_range(1..=4);
    for _ in 0..initial {
        world.spawn_member();
    }
    let mut outcome = Ok(());
    for _ in 0..steps {
        outcome = world.step();
        if outcome.is_err() {
            break;
        }
    }
    if outcome.is_ok() {
        outcome = world.settle();
    }
    let steps_run = world.stats.steps;
    outcome.map(|()| world.stats).map_err(|reason| {
        let tail = world.log.len().saturating_sub(40);
        format!(
            "seed {seed}: {reason}\n  (after {steps_run} steps)\n{}",
            world.log[tail..].join("\n")
        )
    })
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|s| s.parse().ok())
}

fn seeds(default: u64) -> Vec<u64> {
    if let Some(seed) = env_u64("SIM_SEED") {
        return vec![seed];
    }
    (0..env_u64("SIM_SEEDS").unwrap_or(default)).collect()
}

fn steps(default: usize) -> usize {
    env_u64("SIM_STEPS")
        .and_then(|s| usize::try_from(s).ok())
        .unwrap_or(default)
}

fn run_all(faults: Faults, seed_count: u64, steps_per_history: usize) -> Stats {
    let mut total = Stats::default();
    for seed in seeds(seed_count) {
        match run_history(seed, steps_per_history, Variant::default(), faults) {
            Ok(stats) => {
                total.steps += stats.steps;
                total.fast_answers += stats.fast_answers;
                total.full_transitions += stats.full_transitions;
                total.admin_ops += stats.admin_ops;
                total.group_losses += stats.group_losses;
            }
            Err(report) => panic!("simulation failed; replay with SIM_SEED={seed}\n{report}"),
        }
    }
    total
}

#[test]
fn random_histories_keep_every_invariant() {
    run_all(
        Faults {
            lost_writes: false,
            ..Faults::survived()
        },
        150,
        steps(400),
    );
}

#[test]
fn random_histories_with_lost_writes_keep_fences_exclusive() {
    run_all(Faults::survived(), 150, steps(400));
}

/// The long run (docs/design.md §4.4): `SIM_SEEDS` histories of `SIM_STEPS` steps with every fault
/// today's protocol survives, or those of `SIM_FAULTS` (defaults: 500 × 2,000 = 10⁶ steps). It
/// runs every seed and lists
/// the failing ones by their first line. In debug:
/// `SIM_SEEDS=500 SIM_STEPS=2000 cargo test -p stream-listener-core --lib coordinator::simulation::long -- --ignored --nocapture`.
#[test]
#[ignore = "10^6 steps: run by hand"]
fn long_random_histories_keep_every_invariant() {
    let started = Instant::now();
    let mut total = Stats::default();
    let mut failures = Vec::new();
    for seed in seeds(500) {
        let faults = faults_from_env(Faults::survived());
        match run_history(seed, steps(2_000), Variant::default(), faults) {
            Ok(stats) => {
                total.steps += stats.steps;
                total.fast_answers += stats.fast_answers;
                total.full_transitions += stats.full_transitions;
                total.admin_ops += stats.admin_ops;
                total.group_losses += stats.group_losses;
            }
            Err(report) => {
                let first = report.lines().take(2).collect::<Vec<_>>().join(" / ");
                eprintln!("FAILED {first}");
                failures.push(seed);
            }
        }
    }
    eprintln!(
        "{total:?} in passing histories, {:.1}s; failing seeds {failures:?}",
        started.elapsed().as_secs_f64()
    );
    assert!(failures.is_empty(), "failing seeds {failures:?}");
}

/// Each known-wrong rule (`Variant`) must be caught by some seed.
fn caught(variant: Variant) -> Option<String> {
    // Only the members' side: the mistake must let two processes read one shard.
    let faults = Faults::default();
    (0..400).find_map(|seed| run_history(seed, 400, variant, faults).err())
}

/// The mistake must show as what it breaks: two processes reading one shard.
fn assert_two_readers(report: Option<String>, variant: &str) {
    let report = report.unwrap_or_else(|| panic!("{variant} not caught by 400 seeds"));
    let first = report.lines().next().unwrap_or_default();
    eprintln!("{variant}: {first}");
    assert!(
        first.contains("readable by lease by"),
        "{variant} caught for another reason: {first}"
    );
}

#[test]
fn catches_a_sent_shard_that_does_not_block_others() {
    let report = caught(Variant {
        ignore_sent: true,
        ..Variant::default()
    });
    assert_two_readers(report, "ignore-sent");
}

#[test]
fn catches_a_fenced_members_shards_handed_out_before_its_lease_ends() {
    let report = caught(Variant {
        no_lease_wait: true,
        ..Variant::default()
    });
    assert_two_readers(report, "no-lease-wait");
}

#[test]
fn catches_a_replaced_process_shards_handed_out_at_once() {
    let report = caught(Variant {
        release_on_foreign_join: true,
        ..Variant::default()
    });
    assert_two_readers(report, "release-on-foreign-join");
}

#[test]
fn catches_only_the_last_replaced_process_remembered() {
    let report = caught(Variant {
        single_ghost: true,
        ..Variant::default()
    });
    assert_two_readers(report, "single-ghost");
}

/// The first failing history of `seeds` seeds of `steps` steps, with its seed.
fn first_failure(variant: Variant, faults: Faults, seeds: u64, steps: usize) -> Option<String> {
    (0..seeds).find_map(|seed| run_history(seed, steps, variant, faults).err())
}

fn assert_caught_as(report: Option<String>, what: &str, expected: &[&str]) {
    let report = report.unwrap_or_else(|| panic!("{what} not caught"));
    let first = report.lines().next().unwrap_or_default();
    eprintln!("{what}: {first}");
    assert!(
        expected.iter().any(|e| first.contains(e)),
        "{what} caught for another reason: {report}"
    );
}

/// docs/design.md §5.5: a hand-out hold that is never cleared keeps the fast path off for good
/// after a re-provisioning; the simulation sees the fast path fall back on requests whose full
/// transition only renews the lease.
#[test]
fn catches_a_hand_out_hold_that_never_ends() {
    let variant = Variant {
        hand_out_hold_forever: true,
        ..Variant::default()
    };
    let faults = Faults {
        group_loss: true,
        ..Faults::default()
    };
    assert_caught_as(
        first_failure(variant, faults, 100, 400),
        "hand-out-hold-forever",
        &["fast path fell back (deadline passed"],
    );
}

/// Finding 1 through what it breaks, without the fallback check: after a re-provisioning, a
/// settled group keeps running full transitions for steady heartbeats.
#[test]
fn catches_the_effect_of_a_hand_out_hold_that_never_ends() {
    let variant = Variant {
        hand_out_hold_forever: true,
        ..Variant::default()
    };
    let faults = Faults {
        group_loss: true,
        effects_only: true,
        ..Faults::default()
    };
    assert_caught_as(
        first_failure(variant, faults, 100, 400),
        "hand-out-hold-forever (effects)",
        &["a settled group ran"],
    );
}

/// docs/design.md §6.5: steady responses written with the writing member's timings; the
/// simulation sees a fast-path answer differ from the full transition's, with other timings.
#[test]
fn catches_steady_responses_with_the_writers_timings() {
    let variant = Variant {
        writer_timings: true,
        ..Variant::default()
    };
    let faults = Faults {
        mixed_timings: true,
        ..Faults::default()
    };
    assert_caught_as(
        first_failure(variant, faults, 100, 400),
        "writer-timings",
        &["fast path answered", "carries timings"],
    );
}

/// Finding 2 through what it breaks, without the direct checks: members adopt a lease and an
/// interval that are not the ones their store records, so a member reads past its recorded lease
/// (two readers) or expires while it heartbeats as told.
#[test]
fn catches_the_effects_of_steady_responses_with_the_writers_timings() {
    let variant = Variant {
        writer_timings: true,
        ..Variant::default()
    };
    let faults = Faults {
        mixed_timings: true,
        effects_only: true,
        ..Faults::default()
    };
    assert_caught_as(
        first_failure(variant, faults, 200, 400),
        "writer-timings (effects)",
        &["readable by lease by", "yet it got"],
    );
}

/// docs/design.md §5.3: `Writes::diff` left a member's `fast:<id>` and
/// `fastseq:<id>` in place when the member had no steady response at a write (here a static
/// member after `-2`), so a late duplicate of a request older than the member's last one matched
/// the old entry, passed `seq > fastseq`, and renewed the lease of a member that had left, where
/// the full transition answers `StaleRequestSeq`. Seed 1048, step 433, of the long run (with
/// every fault but stale views, as when it was found). Fixed: the history passes, and the old
/// rule is caught as what it did.
#[test]
fn catches_a_late_request_renewing_a_lease_through_an_outdated_fast_entry() {
    let faults = Faults {
        stale_views: false,
        ..Faults::all()
    };
    let fixed = run_history(1048, 433, Variant::default(), faults);
    assert!(
        fixed.is_ok(),
        "seed 1048 fails again: {}",
        fixed.unwrap_err()
    );
    let variant = Variant {
        outdated_fast_entries: true,
        ..Variant::default()
    };
    assert_caught_as(
        run_history(1048, 433, variant, faults).err(),
        "outdated fast entry",
        &["(lease renewed: true) with HeartbeatResponse"],
    );
}

/// Open protocol defect (reported, not fixed here; a known limit, docs/design.md §12.1): the
/// hand-out hold after a re-provision lasts the provisioning process's lease TTL, so a member of
/// the lost incarnation with a longer one still reads by its lease when the shard is handed out
/// again (the fences still stop it). Seed 841: a 12 s member takes shard 0, the group is lost, a
/// 2 s member re-provisions it, a 3 s member gets shard 0 after 2 s.
#[test]
fn finds_a_hand_out_hold_shorter_than_an_old_members_lease() {
    let faults = Faults {
        group_loss: true,
        mixed_timings: true,
        ..Faults::default()
    };
    let report = run_history(841, 45, Variant::default(), faults).err();
    assert_caught_as(report, "short hand-out hold", &["readable by lease by"]);
}

/// docs/design.md §5.4: a transition applied the stream metadata its process
/// read before loading the group, even when another process's transition had applied a newer one
/// (a scale-out in between), so the group's `metadataVersion` and readable set went back. Seed 12,
/// 50 steps, with stale views and admin operations. Fixed (the store reads the view again when
/// the loaded group is newer): the history passes, and the old rule is caught as what it did.
#[test]
fn catches_a_group_metadata_version_going_back_on_a_stale_view() {
    let faults = Faults {
        stale_views: true,
        stream_changes: true,
        ..Faults::default()
    };
    let fixed = run_history(12, 50, Variant::default(), faults);
    assert!(fixed.is_ok(), "seed 12 fails again: {}", fixed.unwrap_err());
    let variant = Variant {
        stale_view_applied: true,
        ..Variant::default()
    };
    assert_caught_as(
        run_history(12, 50, variant, faults).err(),
        "stale stream view",
        &["metadataVersion went back"],
    );
    assert_caught_as(
        first_failure(variant, faults, 100, 400),
        "stale stream view (any seed)",
        &["metadataVersion went back"],
    );
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

    /// Seeds beyond the fixed range, so every run explores new histories too.
    #[test]
    fn any_seed_keeps_every_invariant(seed in proptest::prelude::any::<u64>(), lost_writes in proptest::prelude::any::<bool>()) {
        let faults = Faults { lost_writes, ..Faults::survived() };
        let outcome = run_history(seed, 300, Variant::default(), faults);
        proptest::prop_assert!(outcome.is_ok(), "replay with SIM_SEED={seed}: {}", outcome.unwrap_err());
    }
}

/// The faults named in `SIM_FAULTS` (comma-separated field names of [`Faults`], `-name` to turn
/// one off, `all`, `survived`), or `default` without it.
fn faults_from_env(default: Faults) -> Faults {
    let Ok(names) = std::env::var("SIM_FAULTS") else {
        return default;
    };
    let mut faults = Faults::default();
    for name in names.split(',') {
        let name = name.trim();
        let (on, field) = match name.strip_prefix('-') {
            Some(field) => (false, field),
            None => (true, name),
        };
        match field {
            "all" => faults = Faults::all(),
            "survived" => faults = Faults::survived(),
            "lost_writes" => faults.lost_writes = on,
            "stream_changes" => faults.stream_changes = on,
            "check_holdings" => faults.check_holdings = on,
            "mixed_timings" => faults.mixed_timings = on,
            "group_loss" => faults.group_loss = on,
            "stale_views" => faults.stale_views = on,
            "effects_only" => faults.effects_only = on,
            _ => {}
        }
    }
    faults
}

/// Replays one history: `SIM_SEED=3 SIM_FAULTS=all cargo test -p stream-listener-core --lib
/// coordinator::simulation::replay -- --ignored`.
#[test]
#[ignore = "replays SIM_SEED by hand"]
fn replay() {
    let faults = faults_from_env(Faults::default());
    let seed = env_u64("SIM_SEED").unwrap_or(0);
    match run_history(seed, steps(400), Variant::default(), faults) {
        Ok(stats) => eprintln!("seed {seed} ok: {stats:?}"),
        Err(report) => panic!("{report}"),
    }
}
