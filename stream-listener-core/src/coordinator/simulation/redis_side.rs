//! Redis's side of the data plane's commands (docs/design.md §8): each runs atomically when the
//! scheduler lets Redis reach it (a transaction in three steps: `MULTI` and the queued check, the
//! queued read, the `EXEC` that runs both), and its reply goes back to the shard task that sent
//! it, unless the reply is lost. Fenced scripts (raise, claim, pending read, read alone) check the
//! fence and act in one step; `XACK` is plain.

use rand::Rng;

use super::MS;
use super::World;
use super::gates::Gates;
use super::pipeline::{GateReply, Op, ReadReply, ScriptReply};
use super::process::ShardFence;
use super::shard_task::{Phase, ShardTask};
use super::transaction::{self, Check, ReadTx, TxStage};
use crate::fence::{FenceToken, FenceVerdict};
use crate::model::{FenceConflict, ShardIndex};

impl World {
    /// Redis reaches the next command of some process's pipeline. A paused process has not sent
    /// its pipeline yet; a transaction Redis has started on has the rest on the wire already.
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
            Some((_, Op::Read(ReadTx { stage, .. }))) if !matches!(stage, TxStage::Sent) => true,
            Some(_) => proc.can_act(self.now),
        }
    }

    /// Redis runs the next step of process `i`'s pipeline.
    pub(super) fn run_next(&mut self, i: usize) {
        if self.queue_read_step(i) {
            return;
        }
        let process = self.procs[i].process_id.clone();
        let Some((id, op)) = self.procs[i].pipeline.pop_front() else {
            return;
        };
        if let Op::Read(tx) = op {
            let lost = std::mem::take(&mut self.procs[i].lose_next_reply);
            self.run_exec(i, id, tx, lost);
            return;
        }
        if let Op::GateRead { shards, count } = op {
            // `BUSY` is a refusal with a reply: the transaction next (`gate_read.rs`).
            let lost = std::mem::take(&mut self.procs[i].lose_next_reply);
            self.run_gate_read(i, id, &shards, count, lost);
            return;
        }
        if self.data.server.busy {
            // Refused with `BUSY`: a script or an `XACK`.
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
            Op::ReadAlone {
                shard,
                token,
                count,
            } => {
                let reply = self.run_read_alone(i, shard, &token, count);
                let reply = if lost { ScriptReply::Error } else { reply };
                self.reply_to_script(i, id, shard, reply, |t, r, v| t.on_read_alone(r, v));
            }
            Op::KillWait { shard, wait } => {
                self.kill_wait(i, wait);
                let reply = if lost {
                    ScriptReply::Error
                } else {
                    ScriptReply::Passed(Vec::new())
                };
                self.reply_to_script(i, id, shard, reply, |t, r, _| t.on_kill(r));
            }
            Op::Read(_) | Op::GateRead { .. } => {}
        }
    }

    /// The steps of a read transaction at the front of process `i`'s pipeline before its
    /// `EXEC`, if there is one to take: `MULTI` and the check queued (or refused while queued),
    /// then the read queued; with the check outside the transaction, `WATCH` and the check. Whether
    /// it took one.
    fn queue_read_step(&mut self, i: usize) -> bool {
        let server = self.data.server;
        // Refused while queued: `BUSY`, or `OOM` (at maxmemory Redis refuses every command
        // queued in a transaction).
        let refusal = if server.busy {
            Some("BUSY")
        } else if server.oom {
            Some("OOM")
        } else {
            None
        };
        let outside = self.data.variant.check_outside_transaction;
        let Some((_, Op::Read(tx))) = self.procs[i].pipeline.front_mut() else {
            return false;
        };
        let shards: Vec<ShardIndex> = tx.shards.iter().map(|(s, _)| *s).collect();
        let step = match tx.stage {
            TxStage::Sent if outside => {
                let versions = transaction::watch(&tx.shards, &self.data.fence_keys);
                let check = transaction::check_before_transaction(
                    &tx.shards,
                    &self.fences,
                    &mut self.data.fence_keys,
                    server,
                );
                let step = format!("WATCH+check {shards:?} -> {check:?}");
                tx.stage = TxStage::Watched { versions, check };
                step
            }
            TxStage::Sent => {
                tx.stage = TxStage::CheckQueued { refused: refusal };
                format!("MULTI, check queued {shards:?}: {refusal:?}")
            }
            TxStage::CheckQueued { refused } => {
                tx.stage = TxStage::ReadQueued {
                    refused: refused.or(refusal),
                };
                if self.data.oom_after_queue == Some(i) {
                    self.data.oom_after_queue = None;
                    if !self.data.server.oom {
                        self.toggle_oom();
                    }
                }
                format!("read queued {shards:?}: {refusal:?}")
            }
            TxStage::ReadQueued { .. } | TxStage::Watched { .. } => return false,
        };
        self.log.push(format!(
            "t={} {} {step}",
            self.now / MS,
            self.procs[i].process_id,
        ));
        true
    }

    /// The `EXEC` of a read transaction. Aborted (`EXECABORT`) when a command was refused while
    /// queued or Redis is busy; else the check, then the read of every shard of the round into
    /// this member's PEL, which fails as a whole when the round's gate is missing (closed by the
    /// check's refusal, or not creatable at `maxmemory`) or a shard's stream is gone. The member
    /// hands out the entries only when the check passed. With the check outside the transaction,
    /// the `EXEC` is the rest of the pipeline (`MULTI`, the read, `EXEC`) and aborts when a watched
    /// fence key changed since the `WATCH`.
    fn run_exec(&mut self, i: usize, id: u64, tx: ReadTx, lost: bool) {
        let server = self.data.server;
        let variant = self.data.variant;
        let (check, aborted) = match tx.stage {
            TxStage::ReadQueued { refused } => {
                if refused.is_some() || server.busy {
                    (None, true)
                } else {
                    let check = transaction::check_in_exec(
                        &tx.shards,
                        &self.fences,
                        &mut self.data.gates,
                        server,
                        variant,
                    );
                    let (first, token) = &tx.shards[0];
                    let gate = Gates::key(*first, token, variant);
                    let read = transaction::read_runs(&self.data.gates, &gate, variant);
                    (Some(check), !read)
                }
            }
            TxStage::Watched { versions, check } => {
                // MULTI, the read (refused while queued when busy or at maxmemory), EXEC.
                let aborted = server.busy
                    || server.oom
                    || transaction::exec_aborts(&tx.shards, &versions, &self.data.fence_keys);
                (Some(check), aborted)
            }
            TxStage::Sent | TxStage::CheckQueued { .. } => return,
        };
        if check == Some(Check::Failed("NOSCRIPT")) {
            // The client loads the script when it sees the error.
            self.data.server.scripts_loaded = true;
        }
        match &check {
            Some(Check::Ran { verdicts, .. })
                if verdicts.iter().any(|v| *v != FenceVerdict::Equal) =>
            {
                self.stats.refused_checks += 1;
            }
            Some(Check::NoGate) => self.stats.gate_failures += 1,
            _ => {}
        }
        if aborted {
            self.stats.aborted_execs += 1;
        } else {
            self.stats.execs += 1;
        }
        // A shard's missing stream (retired) fails the multi-stream read for every shard.
        let streams = tx.shards.iter().all(|(s, _)| self.stream_exists(*s));
        let consumer = self.procs[i].member_id.clone();
        let mut replies = Vec::new();
        for (index, (shard, token)) in tx.shards.iter().enumerate() {
            let verdict = check.as_ref().and_then(|c| c.verdict(index));
            let reply = match &check {
                _ if !aborted && !streams => {
                    if self.stream_exists(*shard) {
                        ReadReply::Aborted
                    } else {
                        ReadReply::Error // NOGROUP: read alone, it reports its own
                    }
                }
                // Nothing read: the read failed on the missing gate.
                Some(Check::NoGate) if aborted => ReadReply::Error,
                Some(Check::Ran { .. }) if aborted => match verdict {
                    Some(FenceVerdict::Equal) | None => ReadReply::Aborted,
                    refused => ReadReply::NotHanded(refused),
                },
                // With the check outside the transaction, a check that did not run and an
                // aborted EXEC are told apart by nobody: the member re-reads its own pending
                // entries, as that design did.
                Some(Check::Failed(_)) if aborted && variant.check_outside_transaction => {
                    ReadReply::NotHanded(None)
                }
                None | Some(Check::Failed(_)) if aborted => ReadReply::Aborted,
                // The read ran.
                _ => {
                    let entries = self.data.shards.entry(*shard).or_default();
                    let ids = entries.read_new(&consumer, tx.count);
                    match &check {
                        Some(check) if check.passed() => ReadReply::Handed(ids),
                        // Another shard's gate could not be created and the read ran through
                        // the first one's: the poller takes the reply for an error.
                        Some(Check::NoGate) => ReadReply::Error,
                        _ => ReadReply::NotHanded(match verdict {
                            Some(FenceVerdict::Equal) => None,
                            other => other,
                        }),
                    }
                }
            };
            replies.push((*shard, token.clone(), reply));
        }
        self.log.push(format!(
            "t={} {} EXEC{} {check:?} {:?}",
            self.now / MS,
            self.procs[i].process_id,
            if lost { " (reply lost)" } else { "" },
            replies.iter().map(|(s, _, r)| (s, r)).collect::<Vec<_>>()
        ));
        for (shard, token, reply) in replies {
            let reply = if lost { ReadReply::Error } else { reply };
            self.reply_to_read(i, id, shard, &token, reply);
        }
        // A refusing check deleted gates: the waits blocked on them end.
        self.unblock_closed();
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

    /// The raise script: `NOGROUP` on a retired shard, else `HSET` of a strictly higher token
    /// (or into a missing field); the same token again writes nothing new. When it writes, it
    /// first closes every other token's gate of the shard that the registry lists (`gates.rs`),
    /// which ends the waits blocked on them. It runs at `maxmemory` too (`allow-oom`).
    pub(super) fn run_raise(&mut self, shard: ShardIndex, token: &FenceToken) -> ScriptReply {
        if !self.stream_exists(shard) {
            return ScriptReply::Gone;
        }
        let stored = self.fences.get(&shard).cloned();
        let (verdict, value) = token.raise(stored.as_ref());
        if verdict == FenceVerdict::Equal {
            let variant = self.data.variant;
            self.data
                .gates
                .on_raise(shard, stored.as_ref(), token, variant);
            self.data.last_raised.insert(shard, value.clone());
            self.unblock_closed();
        }
        if stored.as_ref() != Some(&value) {
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

    /// The read script of new entries of one shard, sent alone: check the fence, then
    /// `XREADGROUP … >` into this member's PEL.
    fn run_read_alone(
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
        let entries = self.data.shards.entry(shard).or_default();
        ScriptReply::Passed(entries.read_new(&consumer, count))
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
            Op::ReadAlone { shard, .. } => {
                self.reply_to_script(i, id, shard, ScriptReply::Error, |t, r, v| {
                    t.on_read_alone(r, v);
                });
            }
            Op::KillWait { shard, .. } => {
                self.reply_to_script(i, id, shard, ScriptReply::Error, |t, r, _| t.on_kill(r));
            }
            Op::GateRead { shards, .. } => {
                for (shard, _) in shards {
                    self.reply_to_gate_read(i, id, shard, &GateReply::Error);
                }
            }
        }
    }

    /// The task of `shard` that waits for command `id`, if it still runs and still waits (a
    /// new token is a new task; a timed-out command's reply is ignored).
    pub(super) fn task_waiting(
        &mut self,
        i: usize,
        id: u64,
        shard: ShardIndex,
    ) -> Option<&mut ShardTask> {
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
        let claiming = task.phase == Phase::Claim;
        react(task, &reply, variant);
        let handed: Vec<u64> = task.in_hand.iter().skip(in_hand_before).copied().collect();
        if claiming && task.phase == (Phase::Pending { after: 0 }) {
            self.consumer_hygiene(shard, &token);
        }
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
            ReadReply::Aborted | ReadReply::NotHanded(None) | ReadReply::Error => {}
        }
    }

    /// The claims are done: consumer hygiene (docs/design.md §8.15) closes the shard's other
    /// tokens' gates with the consumers that strict reads left in them (harmless at any time:
    /// a gate of the current token is created again by the next check that passes). Best
    /// effort: half the time it fails, and reading goes on.
    fn consumer_hygiene(&mut self, shard: ShardIndex, token: &FenceToken) {
        if self.rng.random_bool(0.5) {
            self.data.gates.on_hygiene(shard, token, self.data.variant);
            self.unblock_closed();
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
