//! The seeded scheduler: one random step at a time, then the fault-free phase that must settle.

use rand::Rng;

use super::{MAX_HEARTBEAT, MAX_LEASE, MAX_MEMBERS, MAX_REBALANCE, MS, PROFILES, TICK, World, us};
use crate::model::{Epoch, GroupState, MemberState, Micros};

/// Steps of the data plane after each step of the control plane (`Faults::entries`).
const DATA_STEPS: usize = 6;
/// The rolls of [`World::step`] that a calm step may take: the data plane, drains, joins,
/// crashes, pauses, restarts, leaves, admin operations, lost writes, rollouts, group losses.
const CALM_EVENTS: std::ops::Range<u32> = 63..95;

impl World {
    pub(super) fn step(&mut self) -> Result<(), String> {
        self.stats.steps += 1;
        let roll = if self.faults.entries && self.calm_tick()? {
            // A calm step: heartbeats went through; now and then one of the other events.
            if !self.rng.random_bool(0.3) {
                return self.after_step();
            }
            self.rng.random_range(CALM_EVENTS)
        } else {
            self.rng.random_range(0..100u32)
        };
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
                    self.deliver_among_others(message)?;
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
            63..=74 if self.faults.entries => self.data_step(),
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
        self.after_step()
    }

    /// The data plane moves between any two steps of the control plane; then the checks.
    fn after_step(&mut self) -> Result<(), String> {
        if self.faults.entries {
            self.scheduled_faults();
            if self.faults.strict_waits {
                self.wait_clock();
            }
            for _ in 0..DATA_STEPS {
                self.data_step();
            }
            self.data_fault();
        }
        self.check_readers()?;
        self.check_entries()
    }

    /// With the data plane modelled, the faulty phase has calm stretches (or is calm throughout,
    /// [`Faults::calm`]): a tick in which heartbeats and their replies go through at once on the
    /// members' schedules, so leases hold and members read, while the other events (joins,
    /// crashes, pauses, leaves, admin operations, lost writes) and the data plane's faults go
    /// on. Without them a member's lease has mostly passed by the time its reply arrives.
    /// Whether this step was calm.
    fn calm_tick(&mut self) -> Result<bool, String> {
        if self.calm_ticks == 0 {
            if !self.faults.calm && !self.rng.random_bool(0.02) {
                return Ok(false);
            }
            self.calm_ticks = self.rng.random_range(16..=64);
            self.log.push(format!(
                "t={} calm for {} ticks",
                self.now / MS,
                self.calm_ticks
            ));
        }
        self.calm_ticks -= 1;
        self.now += TICK;
        for i in 0..self.procs.len() {
            let p = &mut self.procs[i];
            if !p.can_act(self.now) || p.leaving || p.in_flight.is_some() {
                continue;
            }
            if !p.slow_revoker {
                for shard in p.draining_shards() {
                    p.reconciler.drained(shard);
                }
            }
            if self.now < p.next_due {
                continue;
            }
            self.send_heartbeat(i);
            let message = self.to_coordinator.pop().ok_or("no message")?;
            self.deliver_to_coordinator(message)?;
            if let Some(reply) = self.to_members.pop() {
                self.deliver_to_member(reply)?;
            }
        }
        Ok(true)
    }

    /// One tick of the fault-free phase: every live member whose heartbeat is due by its own
    /// schedule heartbeats, gets its reply at once, drains at once and reads its shards.
    pub(super) fn settle_tick(&mut self) -> Result<(), String> {
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
            if !self.faults.entries {
                for shard in self.procs[i].owned_shards() {
                    self.read(i, shard);
                    self.read(i, shard);
                }
            }
            self.check_readers()?;
        }
        if self.faults.entries {
            self.settle_data()?;
        }
        Ok(())
    }

    pub(super) fn epoch_fingerprint(&self) -> Option<(Micros, Epoch, Epoch, Vec<Epoch>)> {
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

    pub(super) fn settle(&mut self) -> Result<(), String> {
        self.faulty = false;
        self.to_coordinator.clear();
        self.to_members.clear();
        for p in &mut self.procs {
            p.paused_until = 0;
            p.stalled_until = 0;
            p.in_flight = None;
            p.next_due = self.now;
            p.punctual = false;
        }
        self.data.calm_down();
        self.log.push(format!("t={} SETTLE", self.now / MS));
        let ticks = (4 * MAX_LEASE + 4 * MAX_REBALANCE + 12 * MAX_HEARTBEAT) / TICK;
        // Settled means STABLE with no time-based work still ahead: a deadline that passes (a
        // replaced process's holding running out, the end of a correction round or a hand-out
        // hold) takes one full transition (docs/design.md §5.5), which the steady check below
        // must not count as a missed fast path.
        for _ in 0..ticks {
            self.settle_tick()?;
            if self.is_settled() && self.pending_deadline().is_none() {
                break;
            }
        }
        if !self.is_settled() || self.pending_deadline().is_some() {
            let state = self.store.load(&self.check_config()).map(|g| g.meta.state);
            return Err(format!(
                "no convergence: group {state:?}, pending deadline {:?}",
                self.pending_deadline()
            ));
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
        if self.faults.entries {
            self.drain_entries()?;
        }
        Ok(())
    }

    /// The group's earliest time-based trigger still ahead of now (`coordinator::next_deadline`),
    /// if any.
    fn pending_deadline(&self) -> Option<Micros> {
        let group = self.store.load(&self.check_config())?;
        crate::coordinator::next_deadline(&group).filter(|deadline| *deadline > self.now)
    }

    pub(super) fn is_settled(&self) -> bool {
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
