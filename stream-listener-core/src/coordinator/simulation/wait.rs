//! The blocking strict wait (docs/design.md §8.4, §8.16): a shard task whose read of new entries
//! found nothing sends `XREADGROUP GROUP <g> <consumer> COUNT <n> BLOCK <b> STREAMS <gate(s1,T1)>
//! <s1> … > …` on its member's wait connection, one call for one or more of its shards, each with
//! the gate of its token (`gates.rs`), instead of waiting for a wake and reading by transaction.
//!
//! Redis's side: the request arrives (maybe late: a stalled wait connection, while its process is
//! paused or dead). A missing gate or stream fails it (`NOGROUP`), `BUSY` refuses it; new
//! entries serve it at once; else the client blocks. A blocked wait is served by the next entry
//! added to one of its shards (the entries enter this member's PEL, exactly as a read's), ended
//! with an error as soon as one of its gates is deleted (a raise, a refusing check, hygiene,
//! retirement) or a stream is, and answered empty when its block time passes. A paused or dead
//! process's blocked wait keeps being served: the gates are what stops a zombie's.
//!
//! The member's side: the reply travels back (maybe late; a paused process reads it when it
//! resumes, a dead one never). Entries go to the handler only while the task still holds the
//! shard by its lease with the token it waited under; else they stay in its PEL, for the next
//! owner's claim or its own pending read from `0`. An error reply sends the task to a read by
//! transaction (a check comes before any further wait), a timeout may be followed by another
//! wait. A wait whose outcome the member cannot know (its reply lost, its connection dropped,
//! or given up after the block time and a margin) may still be on its way to Redis, where the
//! task's own gate lets it read: the task kills its connection (`CLIENT KILL ID`, on its main
//! connection, which runs commands in order) and only then reads its own pending entries from
//! `0`, as after any read of new entries (§8.10). Without the kill
//! ([`super::ReadVariant::wait_lost_without_kill`]) the late wait strands entries in the
//! member's own PEL while it reads on.

use rand::Rng;

use super::entries::EntryId;
use super::{MS, World};
use crate::fence::FenceToken;
use crate::model::{Micros, ShardIndex};

/// The block time of a wait (the runtime's default `block`).
const BLOCK: Micros = 2_000 * MS;
/// How long after its block time a member waits for a wait's reply before it gives up on it.
const RESPONSE_MARGIN: Micros = 1_000 * MS;

/// A wait on its way to Redis, or blocked there.
#[derive(Debug, Clone)]
pub(super) struct Wait {
    pub(super) proc: usize,
    pub(super) id: u64,
    /// The member id: the consumer whose PEL the entries enter.
    pub(super) consumer: String,
    /// Its shards, each with the token whose gate it names.
    pub(super) shards: Vec<(ShardIndex, FenceToken)>,
    pub(super) count: u64,
    /// When it can reach Redis at the earliest.
    pub(super) arrives_at: Micros,
    /// The member gave up on it: it still runs if it arrives, but its reply goes nowhere.
    pub(super) abandoned: bool,
}

/// A wait blocked at Redis until `deadline`.
#[derive(Debug, Clone)]
pub(super) struct Blocked {
    pub(super) wait: Wait,
    pub(super) deadline: Micros,
}

/// How a wait ended, for each of its shards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum WaitEnd {
    /// Served: the ids that entered the member's PEL (maybe none for this shard).
    Served(Vec<EntryId>),
    /// The block time passed without an entry.
    TimedOut,
    /// Redis answered an error (a gate or a stream missing or deleted, `BUSY`): nothing read.
    Refused,
    /// No usable reply: lost with its connection, or given up on. It may have read.
    Lost,
}

/// A wait's reply on its way back to the member.
#[derive(Debug, Clone)]
pub(super) struct WaitReply {
    pub(super) proc: usize,
    pub(super) id: u64,
    pub(super) shards: Vec<(ShardIndex, FenceToken)>,
    /// Per shard, in the order of `shards`.
    pub(super) ends: Vec<WaitEnd>,
}

impl World {
    /// Process `i` sends a wait for `shards` (tasks in [`super::shard_task::Phase::New`] whose
    /// last read found nothing), after the `XACK` of their held ids on its connection.
    pub(super) fn send_wait(&mut self, i: usize, shards: &[ShardIndex], count: u64) {
        for shard in shards {
            if let Some(ids) = self.procs[i].held_acks.remove(shard) {
                let ids = ids.into_iter().collect();
                self.send(i, super::pipeline::Op::Ack { shard: *shard, ids });
            }
        }
        self.data.last_op += 1;
        let id = self.data.last_op;
        let proc = &mut self.procs[i];
        let mut waited = Vec::new();
        for shard in shards {
            if let Some(task) = proc.tasks.get_mut(shard) {
                task.waiting = Some(id);
                waited.push((*shard, task.token.clone()));
            }
        }
        let lease = super::us(proc.config.member_lease_ttl);
        // Now and then the wait connection stalls: the request reaches Redis late.
        let stalled = self.faulty && self.faults.connection_faults && self.rng.random_bool(0.05);
        let arrives_at = if stalled {
            self.now + self.rng.random_range(1..=2 * lease)
        } else {
            self.now
        };
        let wait = Wait {
            proc: i,
            id,
            consumer: proc.member_id.clone(),
            shards: waited,
            count,
            arrives_at,
            abandoned: false,
        };
        self.log.push(format!(
            "t={} {} sends wait {id} {:?}{}",
            self.now / MS,
            proc.process_id,
            shards,
            if stalled { " (stalled)" } else { "" }
        ));
        self.stats.waits_sent += 1;
        proc.waits.insert(id, self.now + BLOCK + RESPONSE_MARGIN);
        self.data.wait_wire.push(wait);
    }

    /// The position in the wire of a wait of process `i` that may reach Redis now, if any.
    pub(super) fn wait_arrivable(&self, i: usize) -> Option<usize> {
        self.data
            .wait_wire
            .iter()
            .position(|w| w.proc == i && w.arrives_at <= self.now)
    }

    /// One move of the waits' traffic: a request reaches Redis, or a reply its member.
    pub(super) fn wait_traffic(&mut self) {
        let now = self.now;
        let requests: Vec<usize> = (0..self.data.wait_wire.len())
            .filter(|k| self.data.wait_wire[*k].arrives_at <= now)
            .collect();
        let replies: Vec<usize> = (0..self.data.wait_replies.len())
            .filter(|k| self.reply_deliverable(&self.data.wait_replies[*k]))
            .collect();
        let total = requests.len() + replies.len();
        if total == 0 {
            return;
        }
        let pick = self.rng.random_range(0..total);
        if pick < requests.len() {
            let wait = self.data.wait_wire.remove(requests[pick]);
            self.wait_arrives(wait);
        } else {
            let reply = self
                .data
                .wait_replies
                .remove(replies[pick - requests.len()]);
            self.wait_reply_arrives(reply);
        }
    }

    /// Everything of the waits' traffic that can move now does (the fault-free phase).
    pub(super) fn flush_wait_traffic(&mut self) {
        self.expire_blocked();
        let now = self.now;
        let (ready, late): (Vec<Wait>, Vec<Wait>) = std::mem::take(&mut self.data.wait_wire)
            .into_iter()
            .partition(|w| w.arrives_at <= now);
        self.data.wait_wire = late;
        for wait in ready {
            self.wait_arrives(wait);
        }
        self.deliver_wait_replies();
        self.give_up_waits();
    }

    /// Every reply that can reach its member now does.
    pub(super) fn deliver_wait_replies(&mut self) {
        let (ready, held): (Vec<WaitReply>, Vec<WaitReply>) =
            std::mem::take(&mut self.data.wait_replies)
                .into_iter()
                .partition(|r| self.reply_deliverable(r));
        self.data.wait_replies = held;
        for reply in ready {
            self.wait_reply_arrives(reply);
        }
    }

    /// A reply reaches a process that can read it (a paused one when it resumes); one to a dead
    /// process is dropped on arrival.
    fn reply_deliverable(&self, reply: &WaitReply) -> bool {
        let proc = &self.procs[reply.proc];
        !proc.alive || proc.can_act(self.now)
    }

    /// Time passes for the waits: blocked ones time out at Redis, and members give up on waits
    /// whose reply has not come after the block time and a margin.
    pub(super) fn wait_clock(&mut self) {
        self.expire_blocked();
        self.give_up_waits();
    }

    /// The waits whose block time passed get an empty reply.
    fn expire_blocked(&mut self) {
        let now = self.now;
        let (expired, blocked): (Vec<Blocked>, Vec<Blocked>) =
            std::mem::take(&mut self.data.blocked)
                .into_iter()
                .partition(|b| b.deadline <= now);
        self.data.blocked = blocked;
        for b in expired {
            self.stats.waits_timed_out += 1;
            let ends = vec![WaitEnd::TimedOut; b.wait.shards.len()];
            self.reply_wait(&b.wait, ends);
        }
    }

    /// Every process that can act gives up on the waits whose reply is overdue.
    fn give_up_waits(&mut self) {
        let now = self.now;
        for i in 0..self.procs.len() {
            if !self.procs[i].can_act(now) {
                continue;
            }
            let due: Vec<u64> = self.procs[i]
                .waits
                .iter()
                .filter(|(_, give_up)| **give_up <= now)
                .map(|(id, _)| *id)
                .collect();
            for id in due {
                if self.awaited(i, id) {
                    self.give_up_wait(i, id);
                } else {
                    // Its tasks are gone (revoked, a new token): no one waits for it any more.
                    self.procs[i].waits.remove(&id);
                }
            }
        }
    }

    /// Process `i` gives up on wait `id` (a response timeout): it drops the wait's connection,
    /// which frees the wait if it is blocked at Redis; a request still on the wire runs once
    /// when it arrives, and its reply goes nowhere. Its tasks take it for lost.
    fn give_up_wait(&mut self, i: usize, id: u64) {
        self.procs[i].waits.remove(&id);
        let mut shards = None;
        if let Some(k) = self
            .data
            .blocked
            .iter()
            .position(|b| b.wait.proc == i && b.wait.id == id)
        {
            shards = Some(self.data.blocked.remove(k).wait.shards);
        }
        if let Some(w) = self
            .data
            .wait_wire
            .iter_mut()
            .find(|w| w.proc == i && w.id == id)
        {
            w.abandoned = true;
            shards = Some(w.shards.clone());
        }
        if let Some(k) = self
            .data
            .wait_replies
            .iter()
            .position(|r| r.proc == i && r.id == id)
        {
            shards = Some(self.data.wait_replies.remove(k).shards);
        }
        let Some(shards) = shards else {
            return;
        };
        self.log.push(format!(
            "t={} {} gives up on wait {id}",
            self.now / MS,
            self.procs[i].process_id
        ));
        self.stats.waits_lost += 1;
        let ends = vec![WaitEnd::Lost; shards.len()];
        self.wait_reply_arrives(WaitReply {
            proc: i,
            id,
            shards,
            ends,
        });
    }

    /// Whether a task of process `i` still waits for wait `id`.
    fn awaited(&self, i: usize, id: u64) -> bool {
        self.procs[i].tasks.values().any(|t| t.waiting == Some(id))
    }

    /// What makes Redis fail a wait of these shards: a stream or a gate missing (it names every
    /// shard's gate).
    fn wait_blocker(&self, wait: &Wait) -> Option<&'static str> {
        self.missing_key(&wait.shards, wait.shards.len())
    }

    /// Whether one of the wait's shards has entries after its group's last-delivered id.
    fn wait_has_entries(&self, wait: &Wait) -> bool {
        wait.shards.iter().any(|(shard, _)| {
            self.data
                .shards
                .get(shard)
                .is_some_and(|e| e.last_delivered < e.last_id)
        })
    }

    /// The wait reaches Redis: refused, served at once, or blocked.
    pub(super) fn wait_arrives(&mut self, wait: Wait) {
        let refusal = if self.data.server.busy {
            Some("BUSY")
        } else {
            self.wait_blocker(&wait)
        };
        let process = self.procs[wait.proc].process_id.clone();
        if let Some(reason) = refusal {
            self.log.push(format!(
                "t={} {process} wait {} refused: {reason}",
                self.now / MS,
                wait.id
            ));
            self.stats.waits_closed += 1;
            self.reply_wait(&wait, vec![WaitEnd::Refused; wait.shards.len()]);
        } else if self.wait_has_entries(&wait) {
            self.serve(&wait);
        } else if !wait.abandoned {
            self.log.push(format!(
                "t={} {process} wait {} blocks",
                self.now / MS,
                wait.id
            ));
            let deadline = self.now + BLOCK;
            self.data.blocked.push(Blocked { wait, deadline });
        }
    }

    /// Redis serves a wait: each of its shards' new entries, up to `COUNT`, enter the member's
    /// PEL. (b): a delivery while the fence holds another token is a zombie read, whether or
    /// not the member ever hands the entries over (a field lost since the last raise holds that
    /// raise's token: no one else may read until a raise, which closes the other gates).
    fn serve(&mut self, wait: &Wait) {
        let mut ends = Vec::new();
        for (shard, token) in &wait.shards {
            let entries = self.data.shards.entry(*shard).or_default();
            let ids = entries.read_new(&wait.consumer, wait.count);
            let holder = self
                .fences
                .get(shard)
                .or_else(|| self.data.last_raised.get(shard));
            if !ids.is_empty() && holder != Some(token) {
                let fence = format!("{:?}", self.fences.get(shard));
                let who = self.procs[wait.proc].process_id.clone();
                for id in &ids {
                    self.data
                        .ledger
                        .zombie_gated_read("blocking wait", *shard, *id, &who, &fence);
                }
            }
            self.stats.wait_entries += ids.len() as u64;
            ends.push(WaitEnd::Served(ids));
        }
        self.stats.waits_served += 1;
        self.log.push(format!(
            "t={} {} wait {} served {:?}",
            self.now / MS,
            self.procs[wait.proc].process_id,
            wait.id,
            ends
        ));
        self.reply_wait(wait, ends);
    }

    /// The entries just appended to `shard` serve the waits blocked on it, in the order they
    /// blocked; one that finds nothing left stays blocked. Redis runs the command again (7.2+,
    /// redis#11012), so a missing gate fails it; one that serves the ready key alone
    /// ([`super::ReadVariant::blocked_wait_outlives_its_gate`]) reads without looking at it.
    pub(super) fn serve_blocked(&mut self, shard: ShardIndex) {
        let outlives = self.data.variant.blocked_wait_outlives_its_gate;
        let mut k = 0;
        while k < self.data.blocked.len() {
            let wait = &self.data.blocked[k].wait;
            let on_shard = wait.shards.iter().any(|(s, _)| *s == shard);
            let runs = outlives || self.wait_blocker(wait).is_none();
            if on_shard && runs && self.wait_has_entries(wait) {
                let blocked = self.data.blocked.remove(k);
                self.serve(&blocked.wait);
            } else {
                k += 1;
            }
        }
    }

    /// Redis ends with an error every blocked wait one of whose gates or streams was just
    /// deleted (redis#10306, Redis 7.0: a deleted stream key wakes the `XREADGROUP`s blocked on
    /// it). Not with [`super::ReadVariant::blocked_wait_outlives_its_gate`].
    pub(super) fn unblock_closed(&mut self) {
        if self.data.variant.blocked_wait_outlives_its_gate {
            return;
        }
        let (closed, blocked): (Vec<Blocked>, Vec<Blocked>) =
            std::mem::take(&mut self.data.blocked)
                .into_iter()
                .partition(|b| self.wait_blocker(&b.wait).is_some());
        self.data.blocked = blocked;
        for b in closed {
            self.log.push(format!(
                "t={} {} wait {} unblocked: gate closed",
                self.now / MS,
                self.procs[b.wait.proc].process_id,
                b.wait.id
            ));
            self.stats.waits_closed += 1;
            self.reply_wait(&b.wait, vec![WaitEnd::Refused; b.wait.shards.len()]);
        }
    }

    /// Redis answers a wait: the reply goes back, most often at once. An abandoned wait's reply
    /// goes nowhere; a lost one reaches the member as [`WaitEnd::Lost`].
    fn reply_wait(&mut self, wait: &Wait, ends: Vec<WaitEnd>) {
        if wait.abandoned {
            return;
        }
        let lost = std::mem::take(&mut self.procs[wait.proc].lose_next_wait_reply);
        let ends = if lost {
            self.log
                .push(format!("t={} wait {} reply lost", self.now / MS, wait.id));
            if self.awaited(wait.proc, wait.id) {
                self.stats.waits_lost += 1;
            }
            vec![WaitEnd::Lost; ends.len()]
        } else {
            ends
        };
        let reply = WaitReply {
            proc: wait.proc,
            id: wait.id,
            shards: wait.shards.clone(),
            ends,
        };
        if self.reply_deliverable(&reply) && self.rng.random_bool(0.7) {
            self.wait_reply_arrives(reply);
        } else {
            self.data.wait_replies.push(reply);
        }
    }

    /// A wait's reply reaches its member: each task that still waits for it takes its part.
    /// Entries are handed over only while the task holds the shard by its lease (with the token
    /// it waited under: a new token is a new task, which waits for nothing yet).
    fn wait_reply_arrives(&mut self, reply: WaitReply) {
        let i = reply.proc;
        self.procs[i].waits.remove(&reply.id);
        if !self.procs[i].alive {
            return;
        }
        self.sync_tasks(i);
        let now = self.now;
        for ((shard, _), end) in reply.shards.iter().zip(reply.ends) {
            let holds = self.procs[i].reads_by_lease(*shard, now);
            let wait_again = self.rng.random_bool(0.5);
            let Some(task) = self.procs[i]
                .tasks
                .get_mut(shard)
                .filter(|t| t.waiting == Some(reply.id))
            else {
                continue;
            };
            task.waiting = None;
            task.on_wait(reply.id, &end, holds, wait_again, self.data.variant);
        }
    }

    /// Process `i`'s wait connection drops: its blocked waits are freed at Redis, its replies on
    /// the wire are lost, and its requests on the wire may still arrive and run (the server may
    /// not have seen the drop yet) with their replies going nowhere. Its tasks take them for
    /// lost.
    pub(super) fn drop_wait_connection(&mut self, i: usize) {
        let ids: Vec<u64> = self.procs[i].waits.keys().copied().collect();
        if ids.is_empty() {
            return;
        }
        self.log.push(format!(
            "t={} {} wait connection dropped with {} waits",
            self.now / MS,
            self.procs[i].process_id,
            ids.len()
        ));
        let mut ended = Vec::new();
        self.data.blocked.retain(|b| {
            let mine = b.wait.proc == i;
            if mine {
                ended.push((b.wait.id, b.wait.shards.clone()));
            }
            !mine
        });
        for w in &mut self.data.wait_wire {
            if w.proc == i && !w.abandoned {
                w.abandoned = true;
                ended.push((w.id, w.shards.clone()));
            }
        }
        self.data.wait_replies.retain(|r| {
            let mine = r.proc == i;
            if mine {
                ended.push((r.id, r.shards.clone()));
            }
            !mine
        });
        for (id, shards) in ended {
            if self.awaited(i, id) {
                self.stats.waits_lost += 1;
            }
            let ends = vec![WaitEnd::Lost; shards.len()];
            self.wait_reply_arrives(WaitReply {
                proc: i,
                id,
                shards,
                ends,
            });
        }
    }

    /// `CLIENT KILL ID` of the connection of process `i`'s wait `id`: Redis closes it, so the
    /// wait, blocked or still on its way, never runs (what it read before is in the PEL).
    pub(super) fn kill_wait(&mut self, i: usize, id: u64) {
        let mine = |proc: usize, wait: u64| proc == i && wait == id;
        self.data.blocked.retain(|b| !mine(b.wait.proc, b.wait.id));
        self.data.wait_wire.retain(|w| !mine(w.proc, w.id));
        self.data.wait_replies.retain(|r| !mine(r.proc, r.id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coordinator::simulation::ReadVariant;
    use crate::coordinator::simulation::gates::{Gates, one_member_holding};
    use crate::testing::fixtures::fence_token as token;

    /// A world with one member process and shard 0, whose fence holds `zombie` and whose gate for
    /// it is open: the zombie's wait on it has blocked.
    fn blocked_zombie(variant: ReadVariant, zombie: &FenceToken) -> World {
        let mut world = one_member_holding(variant, zombie, &[0]);
        world.wait_arrives(wait(zombie));
        assert_eq!(world.data.blocked.len(), 1, "no entry yet: it blocks");
        world
    }

    fn wait(token: &FenceToken) -> Wait {
        Wait {
            proc: 0,
            id: 1,
            consumer: "m0".into(),
            shards: vec![(0, token.clone())],
            count: 10,
            arrives_at: 0,
            abandoned: false,
        }
    }

    /// Entries are appended to shard 0: whatever wait is blocked there is served.
    fn publish(world: &mut World) {
        world.data.shards.entry(0).or_default().append(2);
        world.serve_blocked(0);
    }

    #[test]
    fn a_raise_ends_a_wait_on_the_old_tokens_gate_and_a_late_one_fails() {
        let design = ReadVariant::default();
        let (zombie, owner) = (token(1, 5, "z"), token(1, 6, "a"));
        let mut world = blocked_zombie(design, &zombie);
        world.run_raise(0, &owner);
        assert!(world.data.blocked.is_empty(), "unblocked with an error");
        world.wait_arrives(wait(&zombie));
        publish(&mut world);
        assert_eq!(world.stats.waits_closed, 2);
        assert!(world.data.shards[&0].pel.is_empty(), "nothing read");
    }

    #[test]
    fn after_a_lost_fence_only_the_registry_lets_the_raise_close_the_old_gate() {
        let (zombie, owner) = (token(1, 5, "z"), token(1, 6, "a"));
        for (rule, read) in [(None, false), (Some("raise_from_empty_keeps_gates"), true)] {
            let variant = ReadVariant::with(rule.as_slice());
            let mut world = blocked_zombie(variant, &zombie);
            world.fences.remove(&0);
            // Before any raise the zombie is still the last raiser: its wait reads, fenced.
            publish(&mut world);
            assert_eq!(world.data.shards[&0].pel.len(), 2, "{rule:?}");
            assert_eq!(world.data.ledger.zombie_reads, 0, "{rule:?}");
            world.wait_arrives(wait(&zombie));
            world.run_raise(0, &owner);
            publish(&mut world);
            let zombie_read = world.data.ledger.zombie_reads > 0;
            assert_eq!(zombie_read, read, "{rule:?}");
        }
    }

    #[test]
    fn a_new_owners_check_reopens_a_fixed_gate_for_a_zombies_late_wait() {
        let fixed = ReadVariant::with(&["fixed_gate"]);
        let (zombie, owner) = (token(1, 5, "z"), token(1, 6, "a"));
        let mut world = blocked_zombie(fixed, &zombie);
        world.run_raise(0, &owner);
        assert!(
            world.data.blocked.is_empty(),
            "the raise deleted the one gate"
        );
        // The new owner's check passes and creates the gate again, for every token.
        world.data.gates.open(Gates::key(0, &owner, fixed));
        world.wait_arrives(wait(&zombie));
        publish(&mut world);
        assert!(world.data.ledger.zombie_reads > 0);
    }
}
