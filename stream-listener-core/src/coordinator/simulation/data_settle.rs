//! The data plane in the fault-free phase (docs/design.md §4.4): commands still in flight from the
//! faulty phase reach Redis, every live member works its shards each tick until it has caught
//! up, and once the group is settled the producers stop: then every appended entry must have
//! been handled and no PEL may hold anything (invariant (d), `entry_checks.rs`).

use rand::Rng;

use super::shard_task::Phase;
use super::{MAX_LEASE, MAX_REBALANCE, TICK, World};
use crate::model::ShardIndex;

/// Most commands one member's shard sends in one tick (the task catches up well before).
const WORK_ROUNDS: usize = 60;
/// Most ticks the end of the fault-free phase waits for the members to catch up.
const DRAIN_TICKS: usize = 40;

impl World {
    /// One tick of the data plane in the fault-free phase.
    pub(super) fn settle_data(&mut self) -> Result<(), String> {
        if self.data.producing && self.rng.random_bool(0.5) {
            self.produce();
        }
        self.run_late_commands();
        if self.faults.strict_waits {
            self.flush_wait_traffic();
        }
        for i in 0..self.procs.len() {
            if self.procs[i].alive {
                self.work_shards(i);
            }
        }
        self.check_readers()?;
        self.check_entries()
    }

    /// Producers stop; the members catch up; then invariant (d). When every member has left,
    /// one joins to read what is left.
    pub(super) fn drain_entries(&mut self) -> Result<(), String> {
        self.data.producing = false;
        let mut ticks = DRAIN_TICKS;
        if !self.procs.iter().any(|p| p.alive && !p.leaving) {
            self.spawn_member();
            ticks = ((4 * MAX_LEASE + 4 * MAX_REBALANCE) / TICK) as usize;
        }
        for _ in 0..ticks {
            if self.everything_handled().is_ok() {
                break;
            }
            self.settle_tick()?;
        }
        self.everything_handled()
    }

    fn everything_handled(&self) -> Result<(), String> {
        self.data
            .ledger
            .check_all_handled(&self.data.shards, |shard| self.stream_exists(shard))
    }

    /// What is still in flight reaches Redis now (late); a dead process's unsent commands never
    /// do.
    fn run_late_commands(&mut self) {
        for i in 0..self.procs.len() {
            while self.runnable(i) {
                self.run_next(i);
            }
            if !self.procs[i].alive {
                self.procs[i].pipeline.clear();
            }
        }
    }

    /// Process `i` handles what it has in hand, acks, and sends its tasks' next commands, until
    /// every task has caught up (or is parked).
    fn work_shards(&mut self, i: usize) {
        for round in 0..WORK_ROUNDS {
            self.sync_tasks(i);
            self.handle_all(i);
            self.send_acks(i);
            // An idle shard reads once a tick all the same (its wait for new entries ends in a
            // read), which is how a task learns that its fence was lost.
            let sent = self.send_all(i, round == 0);
            while self.runnable(i) {
                self.run_next(i);
            }
            if self.faults.strict_waits {
                self.flush_wait_traffic();
            }
            if !sent {
                break;
            }
        }
    }

    fn handle_all(&mut self, i: usize) {
        let now = self.now;
        let shards: Vec<ShardIndex> = self.procs[i].tasks.keys().copied().collect();
        for shard in shards {
            while self.procs[i].reads_by_lease(shard, now)
                && self.procs[i]
                    .tasks
                    .get(&shard)
                    .is_some_and(|t| !t.in_hand.is_empty())
            {
                self.handle_next(i, shard);
            }
        }
    }

    /// Every task with something to do (or every ready one, `idle_too`) sends its next
    /// command, or its wait; whether one did.
    fn send_all(&mut self, i: usize, idle_too: bool) -> bool {
        let now = self.now;
        let proc = &self.procs[i];
        let due: Vec<ShardIndex> = proc
            .tasks
            .iter()
            .filter(|(shard, task)| task.ready() && proc.reads_by_lease(**shard, now))
            .filter(|(shard, task)| {
                idle_too || task.phase != Phase::New || self.has_new_entries(**shard)
            })
            .map(|(shard, _)| *shard)
            .collect();
        for shard in &due {
            let waits = self.faults.strict_waits && self.procs[i].tasks[shard].wait_next;
            if waits && self.procs[i].tasks[shard].phase == Phase::New {
                self.send_wait(i, &[*shard], 3);
            } else {
                self.send_task_command(i, &[*shard], 3);
            }
        }
        !due.is_empty()
    }

    fn has_new_entries(&self, shard: ShardIndex) -> bool {
        self.data
            .shards
            .get(&shard)
            .is_some_and(|e| e.last_delivered < e.last_id)
    }
}
