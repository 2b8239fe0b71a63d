//! Redis's side of the data plane's commands (docs/design.md §8): each runs atomically when the
//! scheduler lets Redis reach it (a transaction in two steps: `WATCH` + check, then `EXEC`), and
//! its reply goes back to the shard task that sent it, unless the reply is lost. Fenced scripts
//! (raise, claim, pending read) check the fence and act in one step; `XACK` is plain.

use rand::Rng;

use super::MS;
use super::World;
use super::pipeline::{Op, ReadReply, ScriptReply};
use super::process::ShardFence;
use super::shard_task::ShardTask;
use super::transaction::{self, Check, ReadTx, TxStage};
use crate::fence::{FenceToken, FenceVerdict};
use crate::model::{FenceConflict, ShardIndex};

impl World {
    /// Redis reaches the next command of some process's pipeline. A paused process has not sent
    /// its pipeline yet; a transaction whose `WATCH` ran has its `EXEC` on the wire already.
    pub(super) fn run_some_pipeline(&mut self) {
        let runnable: Vec<usize> = (0..self.procs.len())
            .filter(|i| self.runnable(*i))
            .collect();
        if runnable.is_empty() {
            return;
        }
        let i = runnable[self.rng.random_range(0..runnable.len())];
        self.run_next(i);
    }

    pub(super) fn runnable(&self, i: usize) -> bool {
        let proc = &self.procs[i];
        if self.now < proc.stalled_until {
            return false;
        }
        match proc.pipeline.front() {
            None => false,
            Some((
                _,
                Op::Read(ReadTx {
                    stage: TxStage::Watched { .. },
                    ..
                }),
            )) => true,
            Some(_) => proc.can_act(self.now),
        }
    }

    /// Redis runs the next step of process `i`'s pipeline.
    pub(super) fn run_next(&mut self, i: usize) {
        if self.run_watch(i) {
            return;
        }
        let process = self.procs[i].process_id.clone();
        let Some((id, op)) = self.procs[i].pipeline.pop_front() else {
            return;
        };
        if self.data.server.busy {
            // Refused with `BUSY`: a script, an `XACK`, or the `XREADGROUP` queued in a
            // transaction (whose `EXEC` then reads nothing).
            self.log.push(format!(
                "t={} {process} BUSY for {}",
                self.now / MS,
                op.describe()
            ));
            self.fail_op(i, id, op);
            return;
        }
        let lost = std::mem::take(&mut self.procs[i].lose_next_reply);
        self.log.push(format!(
            "t={} {process} runs {}{}",
            self.now / MS,
            op.describe(),
            if lost { " (reply lost)" } else { "" }
        ));
        match op {
            Op::Ack { shard, ids } => self.run_ack(i, shard, ids, lost),
            Op::Raise { shard, token } => {
                let reply = self.run_raise(shard, &token);
                let reply = if lost { ScriptReply::Error } else { reply };
                self.reply_to_script(i, id, shard, reply, |t, r, v| t.on_raise(r, v));
            }
            Op::Claim {
                shard,
                token,
                count,
            } => {
                let reply = self.run_claim(i, shard, &token, count);
                let reply = if lost { ScriptReply::Error } else { reply };
                self.reply_to_script(i, id, shard, reply, |t, r, _| t.on_claim(r));
            }
            Op::Pending {
                shard,
                token,
                after,
                count,
            } => {
                let reply = self.run_pending(i, shard, &token, after, count);
                let reply = if lost { ScriptReply::Error } else { reply };
                self.reply_to_script(i, id, shard, reply, |t, r, _| t.on_pending(r));
            }
            Op::Read(tx) => self.run_exec(i, id, tx, lost),
        }
    }

    /// The first step of a read transaction at the front of process `i`'s pipeline, if there is
    /// one: `WATCH` of the round's fence keys, then the check (and its tripwire). Whether it ran.
    fn run_watch(&mut self, i: usize) -> bool {
        let Some((_, Op::Read(tx))) = self.procs[i].pipeline.front_mut() else {
            return false;
        };
        if !matches!(tx.stage, TxStage::Sent) {
            return false;
        }
        let versions = transaction::watch(&tx.shards, &self.data.fence_keys);
        let check = transaction::check(
            &tx.shards,
            &self.fences,
            &mut self.data.fence_keys,
            self.data.server,
            self.data.variant,
        );
        if matches!(check, Check::Ran { unfenced: true, .. }) {
            self.stats.unfenced += 1;
        }
        let shards: Vec<ShardIndex> = tx.shards.iter().map(|(s, _)| *s).collect();
        self.log.push(format!(
            "t={} {} WATCH+check {shards:?} -> {check:?}",
            self.now / MS,
            self.procs[i].process_id,
        ));
        let passed = matches!(&check, Check::Ran { verdicts, .. }
            if verdicts.iter().all(|v| *v == FenceVerdict::Equal));
        if self.data.variant.exec_after_check && !passed {
            // The member saw the check's answer and sends no `EXEC` (after `NOSCRIPT` it loads
            // the script for the next time).
            if check == Check::Failed("NOSCRIPT") {
                self.data.server.scripts_loaded = true;
            }
            if let Some((id, Op::Read(tx))) = self.procs[i].pipeline.pop_front() {
                for (index, (shard, token)) in tx.shards.iter().enumerate() {
                    let reply = ReadReply::NotHanded(check.verdict(index));
                    self.reply_to_read(i, id, *shard, token, reply);
                }
            }
            return true;
        }
        if let Some((_, Op::Read(tx))) = self.procs[i].pipeline.front_mut() {
            tx.stage = TxStage::Watched { versions, check };
        }
        true
    }

    /// A plain `XACK`: the ids leave whichever PEL holds them. A lost reply keeps them held (the
    /// next ack repeats it, idempotently).
    fn run_ack(&mut self, i: usize, shard: ShardIndex, ids: Vec<u64>, lost: bool) {
        let who = self.procs[i].process_id.clone();
        if self.stream_exists(shard) {
            let removed = self.data.shards.entry(shard).or_default().ack(ids.clone());
            self.data.ledger.acked(shard, &removed, &who);
        }
        if lost {
            self.procs[i]
                .held_acks
                .entry(shard)
                .or_default()
                .extend(ids);
        }
    }

    /// The raise script: `NOGROUP` on a retired shard, else `HSET` (refused under `maxmemory`)
    /// of a strictly higher token; the same token again writes nothing.
    fn run_raise(&mut self, shard: ShardIndex, token: &FenceToken) -> ScriptReply {
        if !self.stream_exists(shard) {
            return ScriptReply::Gone;
        }
        let (verdict, value) = token.raise(self.fences.get(&shard));
        if self.fences.get(&shard) != Some(&value) {
            if self.data.server.oom {
                return ScriptReply::Error;
            }
            self.fences.insert(shard, value);
            self.data.fence_keys.entry(shard).or_default().touch();
        }
        match verdict {
            FenceVerdict::Equal => ScriptReply::Passed(Vec::new()),
            refused => ScriptReply::Refused(refused),
        }
    }

    /// The fence check that opens the claim and pending-read scripts.
    fn script_check(&self, shard: ShardIndex, token: &FenceToken) -> Result<(), ScriptReply> {
        if !self.stream_exists(shard) {
            return Err(ScriptReply::Gone);
        }
        match token.check(self.fences.get(&shard)) {
            FenceVerdict::Equal => Ok(()),
            refused => Err(ScriptReply::Refused(refused)),
        }
    }

    /// The claim script: a batch of other consumers' pending entries moves to this member.
    fn run_claim(
        &mut self,
        i: usize,
        shard: ShardIndex,
        token: &FenceToken,
        count: u64,
    ) -> ScriptReply {
        if let Err(reply) = self.script_check(shard, token) {
            return reply;
        }
        let consumer = self.procs[i].member_id.clone();
        let ids = self
            .data
            .shards
            .entry(shard)
            .or_default()
            .claim_others(&consumer, count);
        if !ids.is_empty() && self.fences.get(&shard) != Some(token) {
            let fence = format!("{:?}", self.fences.get(&shard));
            let who = self.procs[i].process_id.clone();
            self.data.ledger.zombie_claim(shard, &ids, &who, &fence);
        }
        ScriptReply::Passed(ids)
    }

    /// The pending-read script: a page of this member's own pending entries.
    fn run_pending(
        &mut self,
        i: usize,
        shard: ShardIndex,
        token: &FenceToken,
        after: u64,
        count: u64,
    ) -> ScriptReply {
        if let Err(reply) = self.script_check(shard, token) {
            return reply;
        }
        let consumer = &self.procs[i].member_id;
        let entries = self.data.shards.entry(shard).or_default();
        ScriptReply::Passed(entries.read_pending(consumer, after, count))
    }

    /// The transaction's `EXEC`: aborted when a watched fence key was written since the `WATCH`,
    /// else `XREADGROUP … >` of every shard of the round into this member's PEL. The member hands
    /// a shard's entries to its handler only when the check passed for it.
    fn run_exec(&mut self, i: usize, id: u64, tx: ReadTx, lost: bool) {
        let TxStage::Watched { versions, check } = tx.stage else {
            return;
        };
        if check == Check::Failed("NOSCRIPT") {
            // The client loads the script when it sees the error.
            self.data.server.scripts_loaded = true;
        }
        let aborted = transaction::exec_aborts(&tx.shards, &versions, &self.data.fence_keys);
        if aborted {
            self.stats.aborted_execs += 1;
        } else {
            self.stats.execs += 1;
        }
        let consumer = self.procs[i].member_id.clone();
        let mut replies = Vec::new();
        for (index, (shard, token)) in tx.shards.iter().enumerate() {
            let reply = if aborted {
                ReadReply::NotHanded(check.verdict(index))
            } else if !self.stream_exists(*shard) {
                ReadReply::Error // NOGROUP inside the EXEC
            } else {
                let entries = self.data.shards.entry(*shard).or_default();
                let ids = entries.read_new(&consumer, tx.count);
                if check.passed(index, self.data.variant) {
                    ReadReply::Handed(ids)
                } else {
                    ReadReply::NotHanded(check.verdict(index))
                }
            };
            replies.push((*shard, token.clone(), reply));
        }
        self.log.push(format!(
            "t={} {} EXEC{} {:?}",
            self.now / MS,
            self.procs[i].process_id,
            if lost { " (reply lost)" } else { "" },
            replies.iter().map(|(s, _, r)| (s, r)).collect::<Vec<_>>()
        ));
        for (shard, token, reply) in replies {
            let reply = if lost { ReadReply::Error } else { reply };
            self.reply_to_read(i, id, shard, &token, reply);
        }
    }

    /// A command whose reply will not come (its connection dropped, or it timed out): errors
    /// for the tasks that wait for it; an ack's ids are held again.
    pub(super) fn fail_op(&mut self, i: usize, id: u64, op: Op) {
        match op {
            Op::Ack { shard, ids } => {
                self.procs[i]
                    .held_acks
                    .entry(shard)
                    .or_default()
                    .extend(ids);
            }
            Op::Read(tx) => {
                for (shard, token) in tx.shards {
                    self.reply_to_read(i, id, shard, &token, ReadReply::Error);
                }
            }
            Op::Raise { shard, .. } => {
                self.reply_to_script(i, id, shard, ScriptReply::Error, |t, r, v| t.on_raise(r, v));
            }
            Op::Claim { shard, .. } => {
                self.reply_to_script(i, id, shard, ScriptReply::Error, |t, r, _| t.on_claim(r));
            }
            Op::Pending { shard, .. } => {
                self.reply_to_script(i, id, shard, ScriptReply::Error, |t, r, _| t.on_pending(r));
            }
        }
    }

    /// The task of `shard` that waits for command `id`, if it still runs and still waits (a
    /// new token is a new task; a timed-out command's reply is ignored).
    fn task_waiting(&mut self, i: usize, id: u64, shard: ShardIndex) -> Option<&mut ShardTask> {
        let proc = &mut self.procs[i];
        if !proc.alive {
            return None;
        }
        proc.tasks.get_mut(&shard).filter(|t| t.waiting == Some(id))
    }

    fn reply_to_script(
        &mut self,
        i: usize,
        id: u64,
        shard: ShardIndex,
        reply: ScriptReply,
        react: impl FnOnce(&mut ShardTask, &ScriptReply, super::ReadVariant),
    ) {
        let variant = self.data.variant;
        let Some(task) = self.task_waiting(i, id, shard) else {
            return;
        };
        task.waiting = None;
        let token = task.token.clone();
        let in_hand_before = task.in_hand.len();
        react(task, &reply, variant);
        let handed: Vec<u64> = task.in_hand.iter().skip(in_hand_before).copied().collect();
        match reply {
            ScriptReply::Passed(_) => self.note_verdict(i, shard, &token, FenceVerdict::Equal),
            ScriptReply::Refused(verdict) => self.note_verdict(i, shard, &token, verdict),
            ScriptReply::Gone | ScriptReply::Error => {}
        }
        self.check_handed(i, shard, &token, &handed);
    }

    fn reply_to_read(
        &mut self,
        i: usize,
        id: u64,
        shard: ShardIndex,
        token: &FenceToken,
        reply: ReadReply,
    ) {
        let variant = self.data.variant;
        let Some(task) = self.task_waiting(i, id, shard) else {
            return;
        };
        task.waiting = None;
        task.on_read(&reply, variant);
        match reply {
            ReadReply::Handed(ids) => {
                self.note_verdict(i, shard, token, FenceVerdict::Equal);
                self.check_handed(i, shard, token, &ids);
                if variant.ack_on_read {
                    self.procs[i]
                        .held_acks
                        .entry(shard)
                        .or_default()
                        .extend(ids);
                }
            }
            ReadReply::NotHanded(Some(verdict)) => self.note_verdict(i, shard, token, verdict),
            ReadReply::NotHanded(None) | ReadReply::Error => {}
        }
    }

    /// (b): entries handed to the handler were delivered while the fence held the task's token
    /// (the reply is applied in the step that delivered them).
    fn check_handed(&mut self, i: usize, shard: ShardIndex, token: &FenceToken, ids: &[u64]) {
        if ids.is_empty() || self.fences.get(&shard) == Some(token) {
            return;
        }
        let fence = format!("{:?}", self.fences.get(&shard));
        let who = format!("{}({})", self.procs[i].member_id, self.procs[i].process_id);
        for id in ids {
            self.data.ledger.zombie_read(shard, *id, &who, &fence);
        }
    }

    /// What the poller learns of the fence from a verdict, as `members.rs::read` does: `EQUAL`
    /// (a raise accepted, a check passed) reads on, `LOWER` raises again, `HIGHER` parks the
    /// shard and reports the conflict (docs/design.md §6.7).
    fn note_verdict(
        &mut self,
        i: usize,
        shard: ShardIndex,
        token: &FenceToken,
        verdict: FenceVerdict,
    ) {
        let found = self.fences.get(&shard).cloned();
        let proc = &mut self.procs[i];
        if proc.reconciler.token(shard) != Some(token) {
            return;
        }
        let state: &mut ShardFence = proc.fences.entry(shard).or_default();
        match verdict {
            FenceVerdict::Equal => state.raised = Some(token.clone()),
            FenceVerdict::Lower => state.raised = None,
            FenceVerdict::Higher => {
                state.raised = None;
                state.refused = Some(token.clone());
                if let Some(found) = found {
                    proc.reconciler.fence_conflict(FenceConflict {
                        shard_index: shard,
                        incarnation: found.incarnation,
                        epoch: found.member_epoch,
                    });
                }
            }
        }
    }
}
