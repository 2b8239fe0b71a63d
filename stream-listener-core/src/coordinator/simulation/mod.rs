//! Deterministic simulation of the heartbeat protocol (docs/design.md §4–§8), through the store.
//!
//! A seeded scheduler drives member processes that apply responses with the runtime's own
//! reconciler (`reconciler`: one heartbeat in flight, lease from the send time of the
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
//! real one would answer, else the full transition and the writes of `Writes::diff`. With
//! [`Faults::batches`], a heartbeat the fast path does not answer is sometimes combined with
//! others in flight (`batch.rs`, docs/design.md §5.7): one load, the real `heartbeat_batch`, one
//! write, and the requests it leaves run their own transitions. Members raise and check
//! per-shard fences as §8 says; a reverted snapshot does not revert them.
//!
//! After every step: the invariants of §4 on the coordinator ([`super::invariants`]); epochs
//! never decrease; the group's `metadataVersion` never goes back; from the members' side, no
//! shard is readable by two processes at the same instant — by lease alone while no write was
//! lost, and through the fences always. After every heartbeat: a response carries the
//! requester's own timings; a fast-path answer is what the full transition would answer and
//! leaves what it would leave; the fast path does not fall back on a request whose full
//! transition only renews the lease; a combined batch answers what its requests' own
//! transitions one after another would (a request repeated within it, what its first copy got),
//! and leaves what they would. Each history ends with a fault-free phase in which every member
//! heartbeats on the schedule its responses give it: none may expire, the group must reach
//! STABLE with every shard read by one member, and further heartbeats must change no epoch.
//!
//! With [`Faults::entries`] the data plane is modelled too (docs/design.md §8): each shard's
//! stream, consumer group and PEL; shard tasks that take over (raise, claim, own pending entries
//! from `0`) and read new entries by transaction (`MULTI`, the check with the read gates,
//! `XREADGROUP`, `EXEC`), or alone with the fenced read script; handlers, and plain `XACK`s that a
//! zombie may send late. Read gates are per shard and fencing token (`{p:i}:gate:<group>:<token>`,
//! `gates.rs`), listed in the shard's registry: a check that passes creates its round's gates, one
//! that refuses deletes them, and a raise closes every other token's gate of its shard, also when
//! the fence field it replaced was lost (the registry, not the fence, lists them). With
//! [`Faults::strict_waits`] a task whose read found nothing waits with a blocking `XREADGROUP` on
//! its gate and its shard (`wait.rs`): Redis serves it when an entry arrives, ends it with an
//! error when the gate is deleted, answers it empty after its block time; a paused or dead
//! member's wait keeps being served (only its gate stops it), and requests and replies travel
//! late. With [`Faults::gate_reads`] a task whose last read of new entries was handed over (its
//! transaction's check passed, or a gate read succeeded) reads next with the gate read
//! (`gate_read.rs`): a plain `XREADGROUP` naming every gate of its round, failed by Redis as a
//! whole when one is missing, after which the transaction reads. Its invariants (no loss, no
//! zombie reads or claims, first handlings in id order, and everything handled after the
//! fault-free phase) are checked after every step (`entry_checks.rs`); a wait or a gate read that
//! puts entries into the PEL of a member whose token the fence does not hold is a zombie read,
//! handed over or not (a field lost since the last raise counts as
//! holding that raise's token: no one else can read before the next raise, which closes the
//! gate).
//!
//! Replay a failing seed with `SIM_SEED=<seed> cargo test -p stream-listener-core simulation`;
//! `SIM_SEEDS=<n>` runs more seeds; `SIM_STEPS=<n>` sets the steps of a history; `SIM_LOG=<n>`
//! how many lines of its log a failure shows (40), and shows them for a passing history too; the
//! ignored tests `replay` and
//! `long_random_histories_keep_every_invariant` take their faults from `SIM_FAULTS` (e.g. `all`,
//! `survived,-stale_views`, or `data_plane,calm`) and a known-wrong read rule from
//! `SIM_READ_VARIANT` (e.g. `evalsha_check`).

mod admin;
mod batch;
mod data_faults;
mod data_settle;
mod dataplane;
mod entries;
mod entry_checks;
mod fence_key;
mod gate_read;
mod gates;
mod heartbeats;
mod members;
mod pipeline;
mod process;
mod redis_side;
mod scheduler;
mod shard_task;
mod store;
#[cfg(test)]
mod tests;
mod transaction;
mod wait;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{CoordinatorConfig, StreamView, Variant};
use crate::fence::FenceToken;
use crate::model::{Epoch, HeartbeatRequest, HeartbeatResponse, Micros, ShardIndex, ShardState};
use dataplane::DataPlane;
use process::Proc;
use store::{Store, StoreFailure};

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

/// A heartbeat on its way to the store, with the stream metadata its process read.
#[derive(Debug, Clone)]
struct Message {
    proc: usize,
    request: HeartbeatRequest,
    view: StreamView,
}

/// The store's answer on its way back to the process.
#[derive(Debug, Clone)]
struct Reply {
    proc: usize,
    seq: u64,
    outcome: Result<HeartbeatResponse, StoreFailure>,
}

flags! {
    /// Which faults a history may contain.
    pub(crate) struct Faults {
        /// Writes of the group lost: it reverts to an earlier snapshot (the fences do not).
        lost_writes,
        /// Admin operations on the stream: scale out, scale in, retirement, cancel, registrations.
        stream_changes,
        /// Check the coordinator's own holdings (one holder per shard) too, not only what members
        /// read.
        check_holdings,
        /// Processes with different `[coordination]` timings in one group, changed by rolling
        /// restarts.
        mixed_timings,
        /// The group hash and its leases lost; the next member re-provisions it with a hand-out
        /// hold.
        group_loss,
        /// A request's stream metadata is the one its process read when it sent it, which a later
        /// transition of another process may already have passed.
        stale_views,
        /// Full heartbeats combined in batches (docs/design.md §5.7, `batch.rs`): a heartbeat
        /// the fast path sends on, delivered while others are in flight, is sometimes applied in
        /// one batch with some of them (`heartbeat_batch`, one load, one write), and what the
        /// batch leaves runs its own transition. Not a fault: the store's way of running
        /// concurrent full transitions, on in [`Faults::all`].
        batches,
        /// Skip the checks that compare a fast-path answer with the full transition's, a fallback
        /// with its full transition, and a response's timings with the requester's: a defect must
        /// then show through what it breaks (two readers, a punctual member expired, no
        /// convergence, a settled group off the fast path).
        effects_only,
        /// Model the data plane (docs/design.md §8): entries, PELs, shard tasks, reads by
        /// transaction with a read gate, handlers and plain acks, with its invariants. Off, a
        /// history is the control plane's alone, exactly as before the data plane was modelled
        /// (the pinned seeds of `tests.rs` replay those histories).
        entries,
        /// A shard's fence key lost (a failover that lost it, an eviction, a `DEL` by hand): the
        /// whole hash, or only this group's field.
        fence_loss,
        /// `maxmemory` reached (`noeviction`) for a while: denyoom writes (`XADD`, `HSET`,
        /// `XGROUP CREATE`) are refused, and so is every command queued in a transaction.
        oom,
        /// The server's script cache emptied (a restart, a failover, `SCRIPT FLUSH`): an
        /// `EVALSHA` answers `NOSCRIPT`.
        script_flush,
        /// Replies lost after their command ran, connections dropped with commands not yet run
        /// (a transaction whose `EXEC` had not run) or stalled, and processes paused right after
        /// they sent a command.
        connection_faults,
        /// Another client's script runs past `busy-reply-threshold` for a while: Redis answers
        /// `BUSY` to every script and command but `WATCH` and `MULTI` (a transaction with a
        /// refused command, or whose `EXEC` is refused, aborts), and the period can start or end
        /// between any two steps of a transaction.
        busy_scripts,
        /// Strict mode's blocking wait (with the data plane, docs/design.md §8.16): a shard task
        /// whose read of new entries found nothing sends a blocking `XREADGROUP` on its gate
        /// (`wait.rs`) instead of reading again. Not a fault: the member's way of waiting, on in
        /// [`Faults::with_data_plane`].
        strict_waits,
        /// The gate read (with the data plane, docs/design.md §8.16): a shard task whose last
        /// read of new entries under its token was handed over (its transaction's check passed,
        /// or a gate read succeeded) reads new entries next with a plain `XREADGROUP` naming
        /// every gate of its round (`gate_read.rs`), when every shard of the round believes so.
        /// Not a fault: on in [`Faults::with_data_plane`].
        gate_reads,
        /// The whole faulty phase is calm (with the data plane): heartbeats go through on the
        /// members' schedules, so members hold their shards and read, and every other fault
        /// (pauses above all) hits members at work. Without it the faulty phase has calm
        /// stretches only.
        calm,
    }
}

impl Faults {
    /// Every fault of the control plane that today's protocol survives: all of them since stale
    /// views no longer take a group's `metadataVersion` back (docs/design.md §5.4). Kept apart
    /// from [`Faults::all`] so a fault found failing again can be left out here, with a `finds_*`
    /// test pinning it.
    pub(crate) fn survived() -> Self {
        Faults::all()
    }

    /// Every fault of the control plane (`effects_only` is a way of checking, not a fault), and
    /// combined batches. The data plane's are added by [`Faults::with_data_plane`].
    pub(crate) fn all() -> Self {
        Faults::with(&[
            "lost_writes",
            "stream_changes",
            "check_holdings",
            "mixed_timings",
            "group_loss",
            "stale_views",
            "batches",
        ])
    }

    /// These faults, with the data plane modelled and every fault of it.
    pub(crate) fn with_data_plane(self) -> Self {
        Faults {
            entries: true,
            fence_loss: true,
            oom: true,
            script_flush: true,
            connection_faults: true,
            busy_scripts: true,
            strict_waits: true,
            gate_reads: true,
            ..self
        }
    }
}

flags! {
    /// Known-wrong rules of the data plane's reads (docs/design.md §8.16, the transaction with
    /// the check and the read gates inside it, and the blocking wait on a gate), re-introduced one
    /// at a time to show the simulation catches each hazard the design closes.
    pub(crate) struct ReadVariant {
        /// The previous pipeline: `WATCH` the fences, the check outside the transaction (a
        /// refusal trips the `EXEC` with `PEXPIRE` + `PERSIST` of a watched key), then `MULTI`,
        /// the read, `EXEC`, no gate. A check refused with `BUSY` trips nothing, and when the long
        /// script ends before the read is queued, the `EXEC` reads unfenced.
        check_outside_transaction,
        /// The check is sent with `EVALSHA`: a server that lost its scripts answers `NOSCRIPT`
        /// inside the `EXEC`, the check never runs, and the read after it does.
        evalsha_check,
        /// A refusing check closes the gate with a deny-oom write instead of `DEL`: at
        /// `maxmemory` Redis refuses it (the script's first write), the gate stays open and the
        /// read runs.
        denyoom_gate,
        /// The read names no gate: a refusing check only reports, and the read runs anyway (its
        /// entries are not handed out).
        no_gate,
        /// After `LOWER`, the member raises and reads new entries again, without claiming other
        /// consumers' pending entries or reading its own from `0`.
        lower_retries_without_takeover,
        /// After an error of a read of new entries (a lost reply, a dropped connection, a
        /// timeout), the member reads new entries again instead of its own pending entries from
        /// `0` (docs/design.md §8.10).
        error_reads_on,
        /// The member acks entries as they are read (as `NOACK` would), before its handler has
        /// them: invariant (a) must see an ack remove an unhandled entry.
        ack_on_read,
        /// One read gate per shard, not per token (`{p:i}:gate:<group>`), named by the blocking
        /// wait too, and deleted by the raise of a new value: the new owner's first check
        /// creates it again, and a zombie's wait that reaches Redis after that reads.
        fixed_gate,
        /// The raise leaves the other tokens' gates open: a zombie's wait blocked on its gate
        /// keeps being served after its shard moved on.
        raise_keeps_gates,
        /// The raise closes only the gate of the token it replaces (no registry): after the fence
        /// field was lost, a raise finds no token and closes nothing, and the old owner's blocked
        /// wait keeps reading (with [`Faults::fence_loss`]).
        raise_from_empty_keeps_gates,
        /// After a blocking wait whose outcome it cannot know (given up on after its response
        /// timeout, its connection dropped, its reply lost), the member reads its own pending
        /// entries from `0` at once, without killing the wait's connection first: the wait, still
        /// on its way, reaches Redis after that read and reads through the task's own gate, and
        /// its entries sit unseen in the member's PEL while it reads on.
        wait_lost_without_kill,
        /// Redis leaves a wait blocked when its gate is deleted and, when an entry arrives,
        /// serves it from the shard without looking at the gate again (Redis before 7.0, which
        /// woke no `XREADGROUP` on a deleted key, redis#10306; before 7.2 a woken command was
        /// not run again, redis#11012): a zombie's wait blocked before the raise keeps reading.
        blocked_wait_outlives_its_gate,
        /// The gate read names no gate: a plain `XREADGROUP` of the round's shards that trusts
        /// the member's belief that its gates are open. A paused member's gate read that reaches
        /// Redis after its shard moved on reads it.
        gate_read_without_gates,
        /// The gate read names only the first shard's gate, as the transaction's read does: a
        /// round over a shard whose fence still holds the token and one that moved on reads
        /// the second one too.
        gate_read_first_gate_only,
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
    steps: u64,
    fast_answers: u64,
    full_transitions: u64,
    /// Combined batches (`batch.rs`), those of more than one request, the requests queued in
    /// them, those that ran their own transitions after (solo, or an answer that did not read),
    /// and batches that differ from their requests' own transitions only by the reloads between
    /// those (`World::check_batch`).
    batches: u64,
    shared_batches: u64,
    batched: u64,
    batch_solo: u64,
    batch_reload_differences: u64,
    admin_ops: u64,
    group_losses: u64,
    /// Entries appended, and handled at least once.
    appended: u64,
    handled: u64,
    /// Read transactions whose `EXEC` ran or aborted, checks that refused (and closed their
    /// round's gates), and checks that could not create a missing gate (`NOGATE`).
    execs: u64,
    aborted_execs: u64,
    refused_checks: u64,
    gate_failures: u64,
    /// Blocking waits (`wait.rs`): sent; served (with the entries they delivered); ended with an
    /// error on a gate or stream missing or deleted (or `BUSY`); timed out at Redis; and lost
    /// (reply lost, connection dropped, given up on).
    waits_sent: u64,
    waits_served: u64,
    wait_entries: u64,
    waits_closed: u64,
    waits_timed_out: u64,
    waits_lost: u64,
    /// Gate reads (`gate_read.rs`): sent; served (every named gate and stream there, with the
    /// entries they delivered); failed (a gate or stream missing, `BUSY`: nothing read, a
    /// transaction next).
    gate_reads_sent: u64,
    gate_reads_served: u64,
    gate_read_entries: u64,
    gate_reads_failed: u64,
    /// Invariant (b)'s counts: entries handed to a handler from a delivery made while the fence
    /// held another token (or put into a member's PEL so by its wait), and claims made so; both
    /// must stay 0.
    zombie_reads: u64,
    zombie_claims: u64,
}

impl Stats {
    /// Adds the counts of another history.
    pub(crate) fn add(&mut self, other: Stats) {
        self.steps += other.steps;
        self.fast_answers += other.fast_answers;
        self.full_transitions += other.full_transitions;
        self.batches += other.batches;
        self.shared_batches += other.shared_batches;
        self.batched += other.batched;
        self.batch_solo += other.batch_solo;
        self.batch_reload_differences += other.batch_reload_differences;
        self.admin_ops += other.admin_ops;
        self.group_losses += other.group_losses;
        self.appended += other.appended;
        self.handled += other.handled;
        self.execs += other.execs;
        self.aborted_execs += other.aborted_execs;
        self.refused_checks += other.refused_checks;
        self.gate_failures += other.gate_failures;
        self.waits_sent += other.waits_sent;
        self.waits_served += other.waits_served;
        self.wait_entries += other.wait_entries;
        self.waits_closed += other.waits_closed;
        self.waits_timed_out += other.waits_timed_out;
        self.waits_lost += other.waits_lost;
        self.gate_reads_sent += other.gate_reads_sent;
        self.gate_reads_served += other.gate_reads_served;
        self.gate_read_entries += other.gate_read_entries;
        self.gate_reads_failed += other.gate_reads_failed;
        self.zombie_reads += other.zombie_reads;
        self.zombie_claims += other.zombie_claims;
    }
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
    /// The data plane (with [`Faults::entries`]).
    data: DataPlane,
    /// Steps left of a calm stretch of the faulty phase (with [`Faults::entries`]).
    calm_ticks: u32,
}

const MAX_MEMBERS: usize = 6;

impl World {
    fn new(seed: u64, variant: Variant, read_variant: ReadVariant, faults: Faults) -> Self {
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
            data: DataPlane::new(read_variant),
            calm_ticks: 0,
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
}

/// Runs one seeded history of `steps` steps, then the fault-free phase. `Err` carries the reason
/// and the last log lines.
pub(crate) fn run_history(
    seed: u64,
    steps: usize,
    variant: Variant,
    faults: Faults,
) -> Result<Stats, String> {
    run_history_with(seed, steps, variant, ReadVariant::default(), faults)
}

/// [`run_history`] with the data plane's reads following `read_variant`.
pub(crate) fn run_history_with(
    seed: u64,
    steps: usize,
    variant: Variant,
    read_variant: ReadVariant,
    faults: Faults,
) -> Result<Stats, String> {
    let mut world = World::new(seed, variant, read_variant, faults);
    if faults.entries {
        // Another consumer group of the stream, whose raises write to the same fence hashes.
        world.data.other_groups = world.rng.random_bool(0.5);
    }
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
    world.stats.zombie_reads = world.data.ledger.zombie_reads;
    world.stats.zombie_claims = world.data.ledger.zombie_claims;
    let steps_run = world.stats.steps;
    let log_lines = std::env::var("SIM_LOG").ok().and_then(|n| n.parse().ok());
    let tail = |lines: usize| world.log[world.log.len().saturating_sub(lines)..].join("\n");
    match outcome {
        Ok(()) => {
            if let Some(lines) = log_lines {
                eprintln!("seed {seed} ok\n{}", tail(lines));
            }
            Ok(world.stats)
        }
        Err(reason) => Err(format!(
            "seed {seed}: {reason}\n  (after {steps_run} steps)\n{}",
            tail(log_lines.unwrap_or(40))
        )),
    }
}
