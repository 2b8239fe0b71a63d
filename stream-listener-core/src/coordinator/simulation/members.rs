//! What the members do: send, retry, receive, leave, read and drain, and the check that no shard
//! is readable by two processes at once (docs/design.md §8).

use super::process::InFlight;
use super::store::StoreFailure;
use super::{MS, World, profile_config, us};
use super::{Message, Reply};
use crate::fence::FenceVerdict;
use crate::model::{FenceConflict, HeartbeatStatus, LEAVE_EPOCH, STATIC_LEAVE_EPOCH, ShardIndex};

impl World {
    pub(super) fn send_heartbeat(&mut self, index: usize) {
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
    pub(super) fn retry_heartbeat(&mut self, index: usize) {
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
    pub(super) fn deliver_to_member(&mut self, reply: Reply) -> Result<(), String> {
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
    pub(super) fn leave(&mut self, index: usize, static_leave: bool) {
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
    pub(super) fn read(&mut self, index: usize, shard: ShardIndex) {
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
    pub(super) fn drain(&mut self, index: usize, shard: ShardIndex) {
        let proc = &mut self.procs[index];
        proc.reconciler.drained(shard);
        proc.next_due = self.now;
    }

    // ---- checks from the members' side ------------------------------------------------------------

    pub(super) fn check_readers(&self) -> Result<(), String> {
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
}
