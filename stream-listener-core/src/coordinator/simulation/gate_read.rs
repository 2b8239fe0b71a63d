//! The gate read (docs/design.md §8.16): once a shard task's last read of new entries under its
//! token was handed over (its transaction's check passed for it, or a gate read succeeded), its
//! next read of new entries is a plain, non-blocking `XREADGROUP GROUP <g> <member> COUNT <n>
//! STREAMS <shard 1> … <shard N> <gate 1> … <gate N> > … >` naming every shard's gate of the
//! round (no `MULTI`, no check), sent only when every task of the round believes its gate open
//! (`ShardTask::gate_open`).
//!
//! Redis's side, in one step: `BUSY` refuses it; a missing stream or named gate fails it as a
//! whole (`NOGROUP`: Redis checks every named stream's group before it reads any), nothing read;
//! else each shard's new entries, up to `COUNT`, enter the member's PEL. It runs at `maxmemory`
//! (`XREADGROUP` is not deny-oom). A gate is open only while its shard's fence holds its token
//! (or the field was lost since that token's raise: no one else reads before the next raise,
//! which closes it), so a delivery while the fence holds another token is a zombie read, handed
//! over or not, as a blocking wait's (`wait.rs`).
//!
//! The member's side: entries read go to the handler (the gates vouch for them; the handler
//! takes them only while the lease holds) and the belief stays; a refusal clears it, and the
//! task's next read is the transaction (the runtime sends it at once); a lost reply or a dropped
//! connection sends the task back to its own pending entries from `0`, as a transaction's does.
//!
//! The known-wrong [`super::ReadVariant`]s `gate_read_without_gates` (a plain `XREADGROUP`
//! trusting the belief) and `gate_read_first_gate_only` (the transaction read's one gate) name
//! fewer gates.

use super::gates::Gates;
use super::pipeline::GateReply;
use super::{MS, World};
use crate::fence::FenceToken;
use crate::model::ShardIndex;

impl World {
    /// What makes Redis fail a read of `shards` that names the gates of the first `named` of
    /// them: a stream, or a named gate, missing (`NOGROUP`). The blocking wait names them all.
    pub(super) fn missing_key(
        &self,
        shards: &[(ShardIndex, FenceToken)],
        named: usize,
    ) -> Option<&'static str> {
        let variant = self.data.variant;
        shards.iter().enumerate().find_map(|(k, (shard, token))| {
            if !self.stream_exists(*shard) {
                Some("NOGROUP stream")
            } else if k < named && !self.data.gates.is_open(&Gates::key(*shard, token, variant)) {
                Some("NOGROUP gate")
            } else {
                None
            }
        })
    }

    /// How many of a gate read's shards have their gate named: all of them in the design.
    fn gates_named(&self, shards: usize) -> usize {
        let variant = self.data.variant;
        if variant.gate_read_without_gates {
            0
        } else if variant.gate_read_first_gate_only {
            shards.min(1)
        } else {
            shards
        }
    }

    /// Redis runs process `i`'s gate read `id` (reply lost with `lost`): refused or failed as a
    /// whole, or each shard's new entries into the member's PEL; then the reply goes to the tasks
    /// that wait for it.
    pub(super) fn run_gate_read(
        &mut self,
        i: usize,
        id: u64,
        shards: &[(ShardIndex, FenceToken)],
        count: u64,
        lost: bool,
    ) {
        let refusal = if self.data.server.busy {
            Some("BUSY")
        } else {
            self.missing_key(shards, self.gates_named(shards.len()))
        };
        let process = self.procs[i].process_id.clone();
        let replies: Vec<GateReply> = if refusal.is_some() {
            self.stats.gate_reads_failed += 1;
            vec![GateReply::Refused; shards.len()]
        } else {
            self.stats.gate_reads_served += 1;
            let consumer = self.procs[i].member_id.clone();
            let mut replies = Vec::new();
            for (shard, token) in shards {
                let ids = self
                    .data
                    .shards
                    .entry(*shard)
                    .or_default()
                    .read_new(&consumer, count);
                let holder = self
                    .fences
                    .get(shard)
                    .or_else(|| self.data.last_raised.get(shard));
                if !ids.is_empty() && holder != Some(token) {
                    let fence = format!("{:?}", self.fences.get(shard));
                    for id in &ids {
                        self.data.ledger.zombie_gated_read(
                            "gate read",
                            *shard,
                            *id,
                            &process,
                            &fence,
                        );
                    }
                }
                self.stats.gate_read_entries += ids.len() as u64;
                replies.push(GateReply::Handed(ids));
            }
            replies
        };
        self.log.push(format!(
            "t={} {process} gate read {:?}{}: {}",
            self.now / MS,
            shards.iter().map(|(s, _)| s).collect::<Vec<_>>(),
            if lost { " (reply lost)" } else { "" },
            match refusal {
                Some(reason) => reason.to_owned(),
                None => format!("{replies:?}"),
            }
        ));
        for ((shard, _), reply) in shards.iter().zip(replies) {
            let reply = if lost { GateReply::Error } else { reply };
            self.reply_to_gate_read(i, id, *shard, &reply);
        }
    }

    /// This shard's part of a gate read's reply reaches its task, if it still waits for it.
    pub(super) fn reply_to_gate_read(
        &mut self,
        i: usize,
        id: u64,
        shard: ShardIndex,
        reply: &GateReply,
    ) {
        let variant = self.data.variant;
        let Some(task) = self.task_waiting(i, id, shard) else {
            return;
        };
        task.waiting = None;
        task.on_gate_read(reply, variant);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coordinator::simulation::ReadVariant;
    use crate::coordinator::simulation::gates::one_member_holding;
    use crate::coordinator::simulation::shard_task::{Phase, ShardTask};
    use crate::testing::fixtures::fence_token as token;

    /// A world with one member process that believes the gates of shards 0 and 1 open for
    /// `mine`, which both fences hold, with entries on both; the gates are open.
    fn believing(variant: ReadVariant, mine: &FenceToken) -> World {
        let mut world = one_member_holding(variant, mine, &[0, 1]);
        for shard in [0, 1] {
            world.data.shards.entry(shard).or_default().append(2);
            let mut task = ShardTask::new(mine.clone());
            task.phase = Phase::New;
            task.gate_open = true;
            task.waiting = Some(1);
            world.procs[0].tasks.insert(shard, task);
        }
        world
    }

    fn round(mine: &FenceToken) -> Vec<(ShardIndex, FenceToken)> {
        vec![(0, mine.clone()), (1, mine.clone())]
    }

    #[test]
    fn a_gate_read_reads_every_shard_while_its_gates_are_open_even_at_maxmemory() {
        let design = ReadVariant::default();
        let mine = token(1, 5, "a");
        let mut world = believing(design, &mine);
        world.data.server.oom = true;
        world.run_gate_read(0, 1, &round(&mine), 10, false);
        assert_eq!(world.stats.gate_reads_served, 1);
        for shard in [0, 1] {
            let task = &world.procs[0].tasks[&shard];
            assert_eq!(task.in_hand, [1, 2]);
            assert!(task.gate_open);
        }
        assert_eq!(world.data.ledger.zombie_reads, 0);
    }

    #[test]
    fn a_missing_second_gate_fails_the_whole_read_and_the_transaction_comes_next() {
        let design = ReadVariant::default();
        let (mine, next) = (token(1, 5, "a"), token(1, 6, "b"));
        let mut world = believing(design, &mine);
        // Shard 1 moved on: the next owner's raise closed the member's gate there.
        world.run_raise(1, &next);
        world.run_gate_read(0, 1, &round(&mine), 10, false);
        assert_eq!(world.stats.gate_reads_failed, 1);
        assert!(world.data.shards.values().all(|e| e.pel.is_empty()));
        for shard in [0, 1] {
            let task = &world.procs[0].tasks[&shard];
            assert!(!task.gate_open && !task.read_alone && task.phase == Phase::New);
        }
        // Busy: refused too.
        let mut world = believing(design, &mine);
        world.data.server.busy = true;
        world.run_gate_read(0, 1, &round(&mine), 10, false);
        assert_eq!(world.stats.gate_reads_failed, 1);
    }

    #[test]
    fn fewer_gates_named_let_a_zombie_read_a_shard_that_moved_on() {
        let (mine, next) = (token(1, 5, "a"), token(1, 6, "b"));
        for rule in ["gate_read_without_gates", "gate_read_first_gate_only"] {
            let variant = ReadVariant::with(&[rule]);
            let mut world = believing(variant, &mine);
            world.run_raise(1, &next);
            world.run_gate_read(0, 1, &round(&mine), 10, false);
            assert!(world.data.ledger.zombie_reads > 0, "{rule}");
        }
        // Only the first shard moved on: the first gate is enough to fail it.
        let variant = ReadVariant::with(&["gate_read_first_gate_only"]);
        let mut world = believing(variant, &mine);
        world.run_raise(0, &next);
        world.run_gate_read(0, 1, &round(&mine), 10, false);
        assert_eq!(world.stats.gate_reads_failed, 1);
    }
}
