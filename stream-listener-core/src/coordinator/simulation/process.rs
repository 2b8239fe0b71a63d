//! A simulated member process: the runtime's reconciler, its in-flight heartbeat, what it
//! knows of each shard's fence, and its data plane: shard tasks, handled ids waiting for their
//! ack, and the commands in flight on its connection (docs/design.md §6, §8).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use super::entries::EntryId;
use super::pipeline::Op;
use super::shard_task::ShardTask;
use super::{MS, START, us};
use crate::coordinator::{CoordinatorConfig, StreamView};
use crate::fence::{FenceToken, FenceVerdict};
use crate::model::{HeartbeatRequest, HeartbeatResponse, Micros, RevokeState, ShardIndex};
use crate::reconciler::{Identity, Reconciler};

/// What a process knows of a shard's fence, as the poller does: the token it raised, or the
/// token the fence refused (it parks until the coordinator gives it another).
#[derive(Debug, Clone, Default)]
pub(super) struct ShardFence {
    pub(super) raised: Option<FenceToken>,
    pub(super) refused: Option<FenceToken>,
}

#[derive(Debug, Clone)]
pub(super) struct InFlight {
    pub(super) request: HeartbeatRequest,
    pub(super) first_sent_at: Micros,
    /// The stream metadata the process's store read for this heartbeat.
    pub(super) view: StreamView,
}

/// One member process: the runtime's own [`Reconciler`] (the member rules of docs/design.md §6),
/// its store's timings, and what the poller knows of each shard's fence.
#[derive(Debug, Clone)]
pub(super) struct Proc {
    pub(super) reconciler: Reconciler,
    pub(super) member_id: String,
    pub(super) process_id: String,
    pub(super) instance_id: Option<String>,
    /// The `[coordination]` section of this process (its store runs with it).
    pub(super) config: CoordinatorConfig,
    /// The heartbeat interval the last response gave it (µs), as `member/heartbeat.rs` adopts it.
    pub(super) interval: Micros,
    /// When the next heartbeat is due by that interval.
    pub(super) next_due: Micros,
    pub(super) alive: bool,
    pub(super) paused_until: Micros,
    pub(super) leaving: bool,
    pub(super) seq: u64,
    pub(super) in_flight: Option<InFlight>,
    pub(super) fences: BTreeMap<ShardIndex, ShardFence>,
    pub(super) slow_revoker: bool,
    /// Fault-free phase: has heartbeated on schedule since it last joined (it must not expire).
    pub(super) punctual: bool,
    /// Sim time 0 as a monotonic instant (the reconciler works with `Instant`s).
    pub(super) base: Instant,
    /// The data plane's shard tasks, one per owned shard (`Faults::entries`).
    pub(super) tasks: BTreeMap<ShardIndex, ShardTask>,
    /// Handled ids waiting for their ack, per shard. Kept across revocations and fencing: a
    /// zombie may send them long after it lost the shard.
    pub(super) held_acks: BTreeMap<ShardIndex, BTreeSet<EntryId>>,
    /// Commands sent on the data-plane connection that Redis has not run yet, in order, with
    /// their ids.
    pub(super) pipeline: VecDeque<(u64, Op)>,
    /// The data-plane connection is stalled until then (a network delay, a frozen socket): what
    /// is in the pipeline reaches Redis only after, while heartbeats go on.
    pub(super) stalled_until: Micros,
    /// The reply of the next command Redis completes is lost (the command ran).
    pub(super) lose_next_reply: bool,
    /// The blocking waits it sent and has no reply for yet, with when it gives up on each
    /// (`wait.rs`).
    pub(super) waits: BTreeMap<u64, Micros>,
    /// The next reply of a wait is lost (the wait ran).
    pub(super) lose_next_wait_reply: bool,
}

impl Proc {
    pub(super) fn new(
        member_id: String,
        process_id: String,
        instance_id: Option<String>,
        weight: u32,
        config: CoordinatorConfig,
        now: Micros,
        base: Instant,
    ) -> Self {
        let reconciler = Reconciler::new(Identity {
            member_id: member_id.clone(),
            member_name: "sim".into(),
            instance_id: instance_id.clone(),
            process_id: process_id.clone(),
            runtime_max_concurrency: weight,
        });
        Proc {
            reconciler,
            member_id,
            process_id,
            instance_id,
            interval: us(config.heartbeat_interval),
            config,
            next_due: now,
            alive: true,
            paused_until: 0,
            leaving: false,
            seq: 0,
            in_flight: None,
            fences: BTreeMap::new(),
            slow_revoker: false,
            punctual: false,
            base,
            tasks: BTreeMap::new(),
            held_acks: BTreeMap::new(),
            pipeline: VecDeque::new(),
            stalled_until: 0,
            lose_next_reply: false,
            waits: BTreeMap::new(),
            lose_next_wait_reply: false,
        }
    }

    pub(super) fn instant(&self, now: Micros) -> Instant {
        self.base + Duration::from_micros(now - START)
    }

    pub(super) fn can_act(&self, now: Micros) -> bool {
        self.alive && now >= self.paused_until
    }

    /// A client's retry of a heartbeat without an answer: after half an interval of its own.
    pub(super) fn request_timeout(&self) -> Micros {
        us(self.config.heartbeat_interval) / 2
    }

    /// Would read `shard` now if fences did not exist.
    pub(super) fn reads_by_lease(&self, shard: ShardIndex, now: Micros) -> bool {
        self.can_act(now) && self.reconciler.may_use(shard, self.instant(now))
    }

    /// Reads `shard` now through its fence: raised with the current token, and the fence holds it.
    pub(super) fn reads_by_fence(
        &self,
        shard: ShardIndex,
        now: Micros,
        fence: Option<&FenceToken>,
    ) -> bool {
        let Some(token) = self.reconciler.token(shard) else {
            return false;
        };
        let state = self.fences.get(&shard);
        self.reads_by_lease(shard, now)
            && state.is_some_and(|f| f.raised.as_ref() == Some(token))
            && token.check(fence) == FenceVerdict::Equal
    }

    pub(super) fn owned_shards(&self) -> Vec<ShardIndex> {
        self.reconciler.owned().keys().copied().collect()
    }

    pub(super) fn draining_shards(&self) -> Vec<ShardIndex> {
        self.reconciler
            .revoking()
            .iter()
            .filter(|(_, s)| **s == RevokeState::Draining)
            .map(|(s, _)| *s)
            .collect()
    }

    pub(super) fn build_request(&mut self) -> HeartbeatRequest {
        self.seq += 1;
        self.reconciler.request(self.seq)
    }

    /// docs/design.md §6.7, member rules, as the runtime applies them: the lease margin is a fifth
    /// of the response's TTL, and the next heartbeat is due after the response's interval.
    pub(super) fn apply(
        &mut self,
        response: &HeartbeatResponse,
        request: &HeartbeatRequest,
        sent_at: Micros,
        now: Micros,
    ) {
        let margin = Duration::from_millis(response.member_lease_ttl_ms) / 5;
        let changes = self
            .reconciler
            .apply(response, request, self.instant(sent_at), margin);
        self.interval = response.heartbeat_interval_ms.max(1) * MS;
        self.next_due = now + self.interval;
        if changes.fatal {
            self.alive = false;
        }
        if changes.stop_all {
            // Reads stop and in-flight handlers are cancelled: entries in hand stay pending for
            // the next owner. Handled ids stay held (an ack needs no fence).
            self.fences.clear();
            self.tasks.clear();
            self.punctual = false;
        }
    }
}
