//! The data plane's faults (docs/design.md §8.2, §8.10): lost replies, dropped and stalled
//! connections, members paused right after they decided a read (the zombies fences exist for),
//! a fence key lost, `maxmemory` periods, the script cache emptied, other clients' scripts
//! running too long (`BUSY`), and other groups' raises in the shared fence hashes.

use rand::Rng;

use super::pipeline::Op;
use super::{MS, World};
use crate::model::ShardIndex;

impl World {
    /// At most one fault of the data plane per step of the faulty phase.
    pub(super) fn data_fault(&mut self) {
        let faults = self.faults;
        if self.data.server.busy && self.rng.random_bool(0.7) {
            self.set_busy(false);
        }
        match self.rng.random_range(0..100u32) {
            0..=5 if faults.connection_faults => self.connection_fault(),
            6 if faults.fence_loss => self.lose_fence(),
            // In `maxmemory` about a fifth of the time.
            7..=8 if faults.oom && (self.data.server.oom || self.rng.random_bool(0.25)) => {
                self.toggle_oom();
            }
            9 if faults.script_flush => self.flush_scripts(),
            10..=11 if self.data.other_groups => self.other_group_raise(),
            12 if faults.busy_scripts => self.set_busy(true),
            _ => {}
        }
    }

    /// A reply lost (the command ran), the connection dropped with commands not yet run (a
    /// transaction whose `EXEC` had not run never executes), or the connection stalls; with
    /// blocking waits, the same on a member's wait connection (its stalls are drawn as a wait is
    /// sent, `wait.rs`).
    fn connection_fault(&mut self) {
        let alive: Vec<usize> = (0..self.procs.len())
            .filter(|i| self.procs[*i].can_act(self.now))
            .collect();
        let Some(i) = self.pick(alive) else {
            return;
        };
        if self.faults.strict_waits && self.rng.random_bool(0.3) {
            if self.rng.random_bool(0.5) {
                self.procs[i].lose_next_wait_reply = true;
            } else {
                self.drop_wait_connection(i);
            }
            return;
        }
        match self.rng.random_range(0..3u32) {
            0 => self.procs[i].lose_next_reply = true,
            1 => self.drop_connection(i),
            _ => self.stall_connection(i),
        }
    }

    /// Process `i` pauses (a GC or VM pause) right after it decided to read, before its
    /// pipeline went out: the transaction reaches Redis when the process resumes, mostly after
    /// its shards moved on. This is the zombie that fences exist for (the control plane's
    /// pauses hit any process at any time).
    pub(super) fn pause_sender(&mut self, i: usize) {
        // Long enough, mostly, for its shards to move on before it resumes.
        let lease = super::us(self.procs[i].config.member_lease_ttl);
        let until = self.now + self.rng.random_range(lease * 3 / 2..=3 * lease);
        self.procs[i].paused_until = self.procs[i].paused_until.max(until);
        // Its waits not yet on the wire go out as it resumes too.
        for wait in &mut self.data.wait_wire {
            if wait.proc == i && wait.arrives_at <= self.now {
                wait.arrives_at = until;
            }
        }
        self.log.push(format!(
            "t={} {} pauses until {} with {} commands unsent",
            self.now / MS,
            self.procs[i].process_id,
            until / MS,
            self.procs[i].pipeline.len()
        ));
        // Now and then the fence of one of its shards is lost while it is paused: the next
        // owner's raise finds no token, and the gates the paused member's late commands name
        // must be closed all the same.
        if self.faults.fence_loss && self.rng.random_bool(0.5) {
            // A shard it waits on, if it sent a wait, else any of its shards.
            let waited: Vec<ShardIndex> = self
                .data
                .wait_wire
                .iter()
                .filter(|w| w.proc == i)
                .flat_map(|w| w.shards.iter().map(|(s, _)| *s))
                .collect();
            let shards = if waited.is_empty() {
                self.procs[i].tasks.keys().copied().collect()
            } else {
                waited
            };
            if !shards.is_empty() {
                let shard = shards[self.rng.random_range(0..shards.len())];
                self.lose_fence_of(shard);
            }
        }
        // Now and then the history's script flush or `maxmemory` period starts as it resumes:
        // a bias toward the windows where a zombie's late check meets them (any such history
        // could happen).
        if self.faults.script_flush && self.rng.random_bool(0.5) {
            self.data.flush_at = Some(until);
        }
        if self.faults.oom && self.rng.random_bool(0.5) {
            // As it resumes, or just after its transaction is queued (its EXEC then runs at
            // maxmemory, where a check that must write meets the limit).
            if self.rng.random_bool(0.5) {
                self.data.oom_at = Some(until);
            } else {
                self.data.oom_after_queue = Some(i);
            }
        }
        if self.faults.busy_scripts && self.rng.random_bool(0.5) {
            self.data.busy_at = Some(until);
        }
    }

    /// The faults scheduled for a time that has come.
    pub(super) fn scheduled_faults(&mut self) {
        if self.data.flush_at.is_some_and(|at| at <= self.now) {
            self.data.flush_at = None;
            self.flush_scripts();
        }
        if self.data.oom_at.is_some_and(|at| at <= self.now) {
            self.data.oom_at = None;
            if !self.data.server.oom {
                self.toggle_oom();
            }
        }
        if self.data.busy_at.is_some_and(|at| at <= self.now) {
            self.data.busy_at = None;
            self.set_busy(true);
        }
    }

    /// Another client's script runs past `busy-reply-threshold` (`busy`), or ends.
    fn set_busy(&mut self, busy: bool) {
        if self.data.server.busy != busy {
            self.data.server.busy = busy;
            let state = if busy { "runs long: BUSY" } else { "ended" };
            self.log.push(format!(
                "t={} another client's script {state}",
                self.now / MS
            ));
        }
    }

    fn flush_scripts(&mut self) {
        self.data.server.scripts_loaded = false;
        self.log
            .push(format!("t={} script cache emptied", self.now / MS));
    }

    /// `maxmemory` reached, or left.
    pub(super) fn toggle_oom(&mut self) {
        let oom = !self.data.server.oom;
        self.data.server.oom = oom;
        let state = if oom { "reached" } else { "left" };
        self.log
            .push(format!("t={} maxmemory {state}", self.now / MS));
    }

    /// The process's connection drops: what it had sent and Redis had not run never runs. Its
    /// tasks see errors; its unsent acks are held again (acked later, idempotently).
    pub(super) fn drop_connection(&mut self, i: usize) {
        let ops = std::mem::take(&mut self.procs[i].pipeline);
        self.log.push(format!(
            "t={} {} connection dropped with {} commands",
            self.now / MS,
            self.procs[i].process_id,
            ops.len()
        ));
        for (id, op) in ops {
            self.fail_op(i, id, op);
        }
    }

    /// The process's data-plane connection stalls for up to two leases (its heartbeats go on):
    /// what it sent reaches Redis late. Half the time its commands time out first: the tasks
    /// see errors and go on (to their own pending entries), while the commands still run later
    /// (docs/design.md §8.10, a master frozen past the response timeout).
    fn stall_connection(&mut self, i: usize) {
        let lease = super::us(self.procs[i].config.member_lease_ttl);
        let until = self.now + self.rng.random_range(1..=2 * lease);
        self.procs[i].stalled_until = until;
        let time_out = self.rng.random_bool(0.5);
        self.log.push(format!(
            "t={} {} connection stalls until {}{}",
            self.now / MS,
            self.procs[i].process_id,
            until / MS,
            if time_out { ", commands time out" } else { "" }
        ));
        if time_out {
            let ops: Vec<(u64, Op)> = self.procs[i].pipeline.iter().cloned().collect();
            for (id, op) in ops {
                self.fail_op(i, id, op);
            }
        }
    }

    /// A fence key lost: the whole hash (a failover that lost it, an eviction, a `DEL`), or
    /// only this group's field. Either way a `WATCH` on it sees a write (the check outside the
    /// transaction).
    fn lose_fence(&mut self) {
        let shards: Vec<ShardIndex> = self.fences.keys().copied().collect();
        if shards.is_empty() {
            return;
        }
        let shard = shards[self.rng.random_range(0..shards.len())];
        self.lose_fence_of(shard);
    }

    fn lose_fence_of(&mut self, shard: ShardIndex) {
        if self.fences.remove(&shard).is_none() {
            return;
        }
        let key = self.data.fence_keys.entry(shard).or_default();
        let whole = self.rng.random_bool(0.5);
        if whole {
            key.lose();
        } else {
            key.touch();
        }
        self.log.push(format!(
            "t={} fence of shard {shard} lost ({})",
            self.now / MS,
            if whole { "the key" } else { "the field" }
        ));
    }

    /// Another group's member raises its field in a shard's fence hash (`HSET`, refused under
    /// `maxmemory`): with the check outside the transaction, this group's transactions watching
    /// it abort, which is only a retry; the check inside the transaction does not see it.
    fn other_group_raise(&mut self) {
        if self.data.server.oom {
            return;
        }
        let shards: Vec<ShardIndex> = self
            .stream
            .shards
            .keys()
            .copied()
            .filter(|s| self.stream_exists(*s))
            .collect();
        if shards.is_empty() {
            return;
        }
        let shard = shards[self.rng.random_range(0..shards.len())];
        let key = self.data.fence_keys.entry(shard).or_default();
        key.other_fields = true;
        key.touch();
    }
}
