//! The data plane in the simulation (docs/design.md §8), member side: producers append, shard
//! tasks send their next command (a transaction, a gate read, `gate_read.rs`, or a blocking wait,
//! `wait.rs`), handlers take entries, held ids
//! are acked (plain `XACK`, any time, by zombies too). Redis's side of each command is in
//! `redis_side.rs`, the read gates in `gates.rs`, the data plane's faults in `data_faults.rs`,
//! the invariants in `entry_checks.rs`.

use std::collections::BTreeMap;

use rand::Rng;

use super::entries::ShardEntries;
use super::entry_checks::Ledger;
use super::fence_key::FenceKey;
use super::gates::Gates;
use super::pipeline::Op;
use super::shard_task::{Phase, ShardTask};
use super::transaction::{ReadTx, Server, TxStage};
use super::wait::{Blocked, Wait, WaitReply};
use super::{ReadVariant, World};
use crate::fence::FenceToken;
use crate::model::{Micros, ShardIndex, ShardState};

/// Most entries one read or claim returns.
const MAX_BATCH: u64 = 3;

/// What a shard task sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Sent {
    /// A read of new entries (a round's transaction, or a read alone).
    Read,
    /// A gate read.
    GateRead,
    /// A blocking wait.
    Wait,
    /// Another command, or nothing.
    Other,
}

/// The data plane's Redis state beside the world's `fences`, and the record of what was handled.
#[derive(Debug, Clone)]
pub(super) struct DataPlane {
    pub(super) variant: ReadVariant,
    /// Each shard's stream and consumer group.
    pub(super) shards: BTreeMap<ShardIndex, ShardEntries>,
    /// Each shard's fence key, beside this group's field.
    pub(super) fence_keys: BTreeMap<ShardIndex, FenceKey>,
    /// The read gates that exist, one per shard and token (docs/design.md §8.16, `gates.rs`).
    pub(super) gates: Gates,
    /// Per shard, the token the last accepted raise wrote: what a lost fence field held, and
    /// what the gates the registry still lists belong to.
    pub(super) last_raised: BTreeMap<ShardIndex, FenceToken>,
    /// Blocking waits (`wait.rs`): on their way to Redis, blocked there, and their replies on
    /// their way back.
    pub(super) wait_wire: Vec<Wait>,
    pub(super) blocked: Vec<Blocked>,
    pub(super) wait_replies: Vec<WaitReply>,
    pub(super) server: Server,
    /// Another consumer group reads the stream: its raises write to the same fence hashes.
    pub(super) other_groups: bool,
    /// Producers append (they stop for the end of the fault-free phase).
    pub(super) producing: bool,
    /// The id of the last command sent.
    pub(super) last_op: u64,
    /// A script flush, and the start of a `maxmemory` or a busy period, scheduled for then.
    pub(super) flush_at: Option<Micros>,
    pub(super) oom_at: Option<Micros>,
    pub(super) busy_at: Option<Micros>,
    /// `maxmemory` reached as soon as this process's next transaction has been queued (its
    /// `EXEC` then runs at `maxmemory`).
    pub(super) oom_after_queue: Option<usize>,
    pub(super) ledger: Ledger,
}

impl DataPlane {
    pub(super) fn new(variant: ReadVariant) -> Self {
        DataPlane {
            variant,
            shards: BTreeMap::new(),
            fence_keys: BTreeMap::new(),
            gates: Gates::default(),
            last_raised: BTreeMap::new(),
            wait_wire: Vec::new(),
            blocked: Vec::new(),
            wait_replies: Vec::new(),
            server: Server {
                scripts_loaded: true,
                oom: false,
                busy: false,
            },
            other_groups: false,
            producing: true,
            last_op: 0,
            flush_at: None,
            oom_at: None,
            busy_at: None,
            oom_after_queue: None,
            ledger: Ledger::default(),
        }
    }
}

impl DataPlane {
    /// The fault-free phase: no `maxmemory`, no long script, nothing scheduled.
    pub(super) fn calm_down(&mut self) {
        self.server.oom = false;
        self.server.busy = false;
        self.flush_at = None;
        self.oom_at = None;
        self.busy_at = None;
        self.oom_after_queue = None;
    }
}

impl World {
    /// Whether a shard's stream exists: from its creation until retirement deletes it.
    pub(super) fn stream_exists(&self, shard: ShardIndex) -> bool {
        self.stream
            .shards
            .get(&shard)
            .is_some_and(|state| *state != ShardState::Retired)
    }

    /// One step of the data plane, between the control plane's steps: a producer, a shard task,
    /// Redis or a handler moves.
    pub(super) fn data_step(&mut self) {
        let n = self.procs.len();
        match self.rng.random_range(0..100u32) {
            0..=14 => self.produce(),
            15..=39 => {
                let senders = (0..n).filter(|i| !self.sendable(*i).is_empty()).collect();
                if let Some(i) = self.pick(senders) {
                    // A member paused right after it sent a read of new entries, or a wait
                    // (more often: its late wait is what the per-token gates are for).
                    let pause = match self.send_next(i) {
                        Sent::Read => 0.03,
                        Sent::Wait | Sent::GateRead => 0.1,
                        Sent::Other => 0.0,
                    };
                    if pause > 0.0
                        && self.faulty
                        && self.faults.connection_faults
                        && self.rng.random_bool(pause)
                    {
                        self.pause_sender(i);
                    }
                    // Most commands reach Redis at once; the others wait behind other clients'.
                    while self.runnable(i) && self.rng.random_bool(0.5) {
                        self.run_next(i);
                    }
                    if self.faults.strict_waits
                        && self.rng.random_bool(0.5)
                        && let Some(k) = self.wait_arrivable(i)
                    {
                        let wait = self.data.wait_wire.remove(k);
                        self.wait_arrives(wait);
                    }
                }
            }
            40..=74 if self.faults.strict_waits && self.rng.random_bool(0.3) => {
                self.wait_traffic();
            }
            40..=74 => self.run_some_pipeline(),
            75..=94 => {
                let handlers = (0..n).filter(|i| !self.handleable(*i).is_empty()).collect();
                if let Some(i) = self.pick(handlers) {
                    self.handle_some(i);
                }
            }
            _ if n > 0 => {
                let i = self.rng.random_range(0..n);
                self.send_acks(i);
            }
            _ => {}
        }
    }

    /// `XADD` of a few entries to an ACTIVE shard (producers route to ACTIVE shards only); refused
    /// under `maxmemory`.
    pub(super) fn produce(&mut self) {
        if !self.data.producing || self.data.server.oom {
            return;
        }
        let active: Vec<ShardIndex> = self
            .stream
            .shards
            .iter()
            .filter(|(_, s)| **s == ShardState::Active)
            .map(|(i, _)| *i)
            .collect();
        if active.is_empty() {
            return;
        }
        let shard = active[self.rng.random_range(0..active.len())];
        // Now and then a burst: the group lags behind, a backlog to read.
        let count = if self.rng.random_bool(0.1) {
            self.rng.random_range(5..=20)
        } else {
            self.rng.random_range(1..=3)
        };
        self.data.shards.entry(shard).or_default().append(count);
        self.stats.appended += count;
        self.serve_blocked(shard);
    }

    /// Keeps a process's shard tasks in step with its reconciler: a task per owned shard, a new
    /// one (a new takeover) for a new token; a shard no longer owned ends its task, and the
    /// entries in hand stay pending for the next owner (docs/design.md §8.8, drain).
    pub(super) fn sync_tasks(&mut self, i: usize) {
        let proc = &mut self.procs[i];
        let owned = proc.reconciler.owned();
        let in_step = owned.len() == proc.tasks.len()
            && owned
                .iter()
                .zip(proc.tasks.iter())
                .all(|((s, token), (t, task))| s == t && *token == task.token);
        if in_step {
            return;
        }
        proc.tasks
            .retain(|shard, task| owned.get(shard) == Some(&task.token));
        for (shard, token) in owned {
            proc.tasks
                .entry(*shard)
                .or_insert_with(|| ShardTask::new(token.clone()));
        }
    }

    /// One of `candidates`, at random.
    pub(super) fn pick(&mut self, candidates: Vec<usize>) -> Option<usize> {
        if candidates.is_empty() {
            return None;
        }
        Some(candidates[self.rng.random_range(0..candidates.len())])
    }

    /// The shards whose tasks process `i` may send a command for now: ready, owned, and its lease
    /// not passed.
    fn sendable(&mut self, i: usize) -> Vec<ShardIndex> {
        self.sync_tasks(i);
        let now = self.now;
        let proc = &self.procs[i];
        proc.tasks
            .iter()
            .filter(|(shard, task)| task.ready() && proc.reads_by_lease(**shard, now))
            .map(|(shard, _)| *shard)
            .collect()
    }

    /// The shards whose entries in hand process `i` may handle now (no handler attempt without a
    /// lease, docs/design.md §8.8).
    fn handleable(&mut self, i: usize) -> Vec<ShardIndex> {
        self.sync_tasks(i);
        let now = self.now;
        let proc = &self.procs[i];
        proc.tasks
            .iter()
            .filter(|(shard, task)| !task.in_hand.is_empty() && proc.reads_by_lease(**shard, now))
            .map(|(shard, _)| *shard)
            .collect()
    }

    /// Process `i` sends the next command of one of its shard tasks, if it may use the shard now
    /// (owned, lease not passed): the held ids' `XACK` first, then the phase's command. A read of
    /// new entries may be a round over several of its shards (one transaction), or the read
    /// script of one shard that reads alone, or a gate read of a round whose every task believes
    /// its gate open; a shard whose last read found nothing waits instead (with
    /// [`super::Faults::strict_waits`]), with others that wait too.
    pub(super) fn send_next(&mut self, i: usize) -> Sent {
        let ready = self.sendable(i);
        if ready.is_empty() {
            return Sent::Other;
        }
        let shard = ready[self.rng.random_range(0..ready.len())];
        let task = &self.procs[i].tasks[&shard];
        let strict_waits = self.faults.strict_waits;
        let waits = |t: &ShardTask| strict_waits && t.phase == Phase::New && t.wait_next;
        // A shard that reads alone joins no round.
        let joins = |t: &ShardTask| t.phase == Phase::New && !t.read_alone && !waits(t);
        let waiting = waits(task);
        let round = if waiting || joins(task) {
            let tasks = &self.procs[i].tasks;
            let others: Vec<ShardIndex> = ready
                .iter()
                .filter(|s| **s != shard)
                .filter(|s| {
                    if waiting {
                        waits(&tasks[*s])
                    } else {
                        joins(&tasks[*s])
                    }
                })
                .copied()
                .collect();
            let mut round: Vec<ShardIndex> = others
                .into_iter()
                .filter(|_| self.rng.random_bool(0.5))
                .collect();
            round.insert(0, shard);
            round
        } else {
            vec![shard]
        };
        let count = self.rng.random_range(1..=MAX_BATCH);
        if waiting {
            self.send_wait(i, &round, count);
            Sent::Wait
        } else {
            self.send_task_command(i, &round, count)
        }
    }

    /// The command of the tasks of `shards` (one, or a round of tasks reading new entries), after
    /// the `XACK` of their held ids in the same pipeline; what it sent. A round reads new entries
    /// with a gate read (with [`super::Faults::gate_reads`]) when every task of it believes its
    /// gate open, else with the transaction.
    pub(super) fn send_task_command(
        &mut self,
        i: usize,
        shards: &[ShardIndex],
        count: u64,
    ) -> Sent {
        for shard in shards {
            if let Some(ids) = self.procs[i].held_acks.remove(shard) {
                let ack = Op::Ack {
                    shard: *shard,
                    ids: ids.into_iter().collect(),
                };
                self.send(i, ack);
            }
        }
        self.data.last_op += 1;
        let id = self.data.last_op;
        let gate_reads = self.faults.gate_reads;
        let proc = &mut self.procs[i];
        let first = &proc.tasks[&shards[0]];
        let (shard, token) = (shards[0], first.token.clone());
        let round: Vec<(ShardIndex, FenceToken)> = shards
            .iter()
            .map(|s| (*s, proc.tasks[s].token.clone()))
            .collect();
        let believed = shards.iter().all(|s| proc.tasks[s].gate_open);
        let op = match first.phase {
            Phase::Raise { .. } => Op::Raise { shard, token },
            Phase::Claim => Op::Claim {
                shard,
                token,
                count,
            },
            Phase::Pending { after } => Op::Pending {
                shard,
                token,
                after,
                count,
            },
            Phase::New if first.read_alone => Op::ReadAlone {
                shard,
                token,
                count,
            },
            Phase::New if gate_reads && believed => Op::GateRead {
                shards: round,
                count,
            },
            Phase::New => Op::Read(ReadTx {
                shards: round,
                count,
                stage: TxStage::Sent,
            }),
            Phase::KillWait { wait } => Op::KillWait { shard, wait },
            Phase::Parked => return Sent::Other,
        };
        for shard in shards {
            if let Some(task) = proc.tasks.get_mut(shard) {
                task.waiting = Some(id);
            }
        }
        let sent = match op {
            Op::GateRead { .. } => Sent::GateRead,
            Op::Read(_) | Op::ReadAlone { .. } => Sent::Read,
            _ => Sent::Other,
        };
        proc.pipeline.push_back((id, op));
        if sent == Sent::GateRead {
            self.stats.gate_reads_sent += 1;
        }
        sent
    }

    /// Puts a command no task waits for (an ack) in process `i`'s pipeline.
    pub(super) fn send(&mut self, i: usize, op: Op) {
        self.data.last_op += 1;
        self.procs[i].pipeline.push_back((self.data.last_op, op));
    }

    /// Process `i`'s handler takes one or more of the entries in hand of one of its shards.
    fn handle_some(&mut self, i: usize) {
        let shards = self.handleable(i);
        if shards.is_empty() {
            return;
        }
        let shard = shards[self.rng.random_range(0..shards.len())];
        let count = self.rng.random_range(1..=MAX_BATCH);
        for _ in 0..count {
            self.handle_next(i, shard);
        }
    }

    /// The handler of process `i` handles the next entry in hand of `shard`; its id is held for
    /// the ack.
    pub(super) fn handle_next(&mut self, i: usize, shard: ShardIndex) {
        let proc = &mut self.procs[i];
        let Some(id) = proc
            .tasks
            .get_mut(&shard)
            .and_then(|t| t.in_hand.pop_front())
        else {
            return;
        };
        let who = format!("{}({})", proc.member_id, proc.process_id);
        proc.held_acks.entry(shard).or_default().insert(id);
        if self.data.ledger.handle(shard, id, &who) {
            self.stats.handled += 1;
        }
    }

    /// Process `i` sends the `XACK` of every id it holds: plain, so also after it lost the
    /// shard, its lease, or its membership.
    pub(super) fn send_acks(&mut self, i: usize) {
        if !self.procs[i].can_act(self.now) {
            return;
        }
        for (shard, ids) in std::mem::take(&mut self.procs[i].held_acks) {
            let ids = ids.into_iter().collect();
            self.send(i, Op::Ack { shard, ids });
        }
    }

    /// Retirement deletes a shard's stream, its fence, its read gates and their registry
    /// (docs/design.md §10.2 step 4): the waits blocked on them end with an error.
    pub(super) fn delete_shard(&mut self, shard: ShardIndex) {
        self.fences.remove(&shard);
        self.data.last_raised.remove(&shard);
        self.data.fence_keys.entry(shard).or_default().lose();
        self.data.gates.close_others(shard, None);
        // The stream goes too; retirement checked that its group had read and acked everything,
        // so a scale-out that creates it again starts with nothing to read.
        self.unblock_closed();
    }

    /// Whether the shard's group has read and acked everything (retirement's check).
    pub(super) fn shard_drained(&self, shard: ShardIndex) -> bool {
        self.data
            .shards
            .get(&shard)
            .is_none_or(ShardEntries::drained)
    }

    /// The invariants of the data plane after a step (`entry_checks.rs`).
    pub(super) fn check_entries(&mut self) -> Result<(), String> {
        if !self.faults.entries {
            return Ok(());
        }
        self.data.ledger.check_step(&self.data.shards)
    }
}
