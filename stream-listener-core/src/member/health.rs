//! A member's health, for liveness and readiness probes (docs/design.md §13.2).
//!
//! The heartbeat loop records what each response (or failure) said ([`HealthTrack`]); a
//! snapshot ([`MemberHealth`]) combines that with the reconciler's assignment and lease at the
//! moment it is taken, on the member's clock. Taking one locks the member's state briefly and
//! sends nothing to Redis, so probes may call it as often as they like.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::model::{Epoch, HeartbeatResponse, HeartbeatStatus, ShardIndex};
use crate::runtime::MemberShared;

/// What a member is doing, as far as probes are concerned ([`MemberHealth::state`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MemberState {
    /// Not yet holding its first assignment since it (re)joined: no response yet, or shards it
    /// was given are still being released by other members.
    Joining,
    /// Joined and holding every shard it was given.
    Ready,
    /// It held its assignment and a rebalance now moves shards to or from it (still ready).
    Rebalancing,
    /// Its lease ran out: no heartbeat renewed it in time (Redis unreachable or slow), so it
    /// reads and acks nothing until one does.
    LeaseInDoubt,
    /// The coordinator fenced it (`UNKNOWN_MEMBER_ID`, `FENCED_MEMBER_EPOCH`): its shards were
    /// stopped and it is rejoining.
    Fenced,
    /// A graceful shutdown is under way: it drains and leaves.
    ShuttingDown,
    /// Stopped for good: another process took its static identity (`FENCED_INSTANCE_ID`).
    Stopped,
}

impl MemberState {
    /// The state as written in the health JSON: `joining`, `ready`, `rebalancing`,
    /// `lease_in_doubt`, `fenced`, `shutting_down`, `stopped`.
    pub fn as_str(self) -> &'static str {
        match self {
            MemberState::Joining => "joining",
            MemberState::Ready => "ready",
            MemberState::Rebalancing => "rebalancing",
            MemberState::LeaseInDoubt => "lease_in_doubt",
            MemberState::Fenced => "fenced",
            MemberState::ShuttingDown => "shutting_down",
            MemberState::Stopped => "stopped",
        }
    }
}

/// One member's health at the moment [`crate::member::ListenerHandle::health`] was called.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct MemberHealth {
    /// The member id.
    pub member_id: String,
    /// What it is doing.
    pub state: MemberState,
    /// Why it is in that state, in words (what it waits for, the last heartbeat error).
    pub reason: String,
    /// Liveness: it heartbeats within its lease. True while its lease is valid, or while the
    /// last heartbeat response (of any status) is less than one lease TTL old, or, before any
    /// response, during the first lease TTL after it started; also during a shutdown. False once
    /// it stopped for good.
    pub live: bool,
    /// Readiness: not shutting down, not fenced, its lease valid, and it has held its whole
    /// assignment since it (re)joined (a later rebalance keeps it ready).
    pub ready: bool,
    /// Its member epoch (0 before it joined and after a fencing status).
    pub member_epoch: Epoch,
    /// Shards it owns and reads, ascending.
    pub owned_shards: Vec<ShardIndex>,
    /// Shards the last heartbeat response assigned it, ascending.
    pub target_shards: Vec<ShardIndex>,
    /// Assigned shards it waits for, still held by another member, ascending.
    pub pending_shards: Vec<ShardIndex>,
    /// Shards it is giving up (draining or released, not yet acknowledged), ascending.
    pub revoking_shards: Vec<ShardIndex>,
    /// Time left on its lease on the member's clock, the lease margin already taken off
    /// (`ttl − margin` from the sending of the heartbeat that renewed it); `None` when it holds
    /// no lease (before it joined, after a fencing status).
    pub lease_remaining: Option<Duration>,
    /// Time since the send of the heartbeat that last renewed its lease; `None` before the first.
    pub since_last_renewal: Option<Duration>,
    /// Time since the last heartbeat response of any status; `None` before the first.
    pub since_last_response: Option<Duration>,
    /// The last heartbeat failure (a Redis error or timeout) since the last response, if any.
    pub last_error: Option<String>,
    /// Whether it is paused ([`crate::member::ListenerHandle::pause`]): it reads nothing and
    /// starts no handler, but heartbeats, keeps its shards and stays ready (a paused Kafka
    /// consumer is still in its group).
    pub paused: bool,
}

/// What the heartbeat loop learnt from responses, for [`MemberHealth`].
#[derive(Debug)]
pub(crate) struct HealthTrack {
    started: Instant,
    lease_ttl: Duration,
    last_response: Option<Instant>,
    last_renewal: Option<Instant>,
    target: Vec<ShardIndex>,
    pending: Vec<ShardIndex>,
    /// A fencing status came and the member has not held an assignment since.
    fenced: bool,
    /// It has held its whole assignment since it last (re)joined.
    settled: bool,
    /// It holds its whole assignment now (as of the last response).
    holds: bool,
    last_error: Option<String>,
    stopped: bool,
}

impl HealthTrack {
    /// A member starting now, with the configured lease TTL (liveness before any response).
    pub(crate) fn new(lease_ttl: Duration) -> Self {
        HealthTrack {
            started: Instant::now(),
            lease_ttl,
            last_response: None,
            last_renewal: None,
            target: Vec::new(),
            pending: Vec::new(),
            fenced: false,
            settled: false,
            holds: false,
            last_error: None,
            stopped: false,
        }
    }

    /// A response to the heartbeat sent at `sent_at` arrived and was applied; `holds` says
    /// whether the member now owns exactly what it was assigned, with nothing pending or
    /// revoking.
    pub(crate) fn responded(
        &mut self,
        response: &HeartbeatResponse,
        sent_at: Instant,
        holds: bool,
    ) {
        self.last_response = Some(Instant::now());
        self.last_error = None;
        self.lease_ttl = Duration::from_millis(response.member_lease_ttl_ms);
        match response.status {
            HeartbeatStatus::Retry => {}
            HeartbeatStatus::UnknownMemberId | HeartbeatStatus::FencedMemberEpoch => {
                self.fenced = true;
                self.settled = false;
                self.holds = false;
                self.last_renewal = None;
                self.target.clear();
                self.pending.clear();
            }
            HeartbeatStatus::FencedInstanceId => {
                self.stopped = true;
                self.holds = false;
            }
            HeartbeatStatus::Ok
            | HeartbeatStatus::SyncMetadata
            | HeartbeatStatus::RevokePending => {
                self.last_renewal = Some(sent_at);
                self.target = sorted(&response.assigned_shards);
                self.pending = sorted(&response.pending_shards);
                self.holds = holds;
                if holds {
                    self.settled = true;
                    self.fenced = false;
                }
            }
        }
    }

    /// A heartbeat failed without a response (`error` says why).
    pub(crate) fn failed(&mut self, error: String) {
        self.last_error = Some(error);
    }
}

/// A member's [`HealthTrack`], shared by its heartbeat loop (writer) and health snapshots.
#[derive(Debug)]
pub(crate) struct HealthCell(Mutex<HealthTrack>);

impl HealthCell {
    pub(crate) fn new(lease_ttl: Duration) -> Self {
        HealthCell(Mutex::new(HealthTrack::new(lease_ttl)))
    }

    /// Locked; never held across an await.
    pub(crate) fn lock(&self) -> MutexGuard<'_, HealthTrack> {
        // Plain data written whole per response: a panic elsewhere cannot leave it half-written.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

fn sorted(shards: &[ShardIndex]) -> Vec<ShardIndex> {
    shards
        .iter()
        .copied()
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect()
}

/// The members of a listener (or of several merged ones), for health snapshots that outlive a
/// borrow of the [`crate::member::ListenerHandle`]: cheap to clone, `Send + Sync`.
#[derive(Debug, Clone)]
pub struct HealthSource {
    pub(super) shutdown: CancellationToken,
    pub(super) members: Vec<(Arc<MemberShared>, Arc<HealthCell>)>,
}

impl HealthSource {
    /// Whether a shutdown of these members was asked for
    /// ([`ListenerHandle::shutdown`](crate::member::ListenerHandle::shutdown)).
    pub fn is_shutting_down(&self) -> bool {
        self.shutdown.is_cancelled()
    }

    /// Every member's health now, in the order of
    /// [`ListenerHandle::member_ids`](crate::member::ListenerHandle::member_ids).
    pub fn health(&self) -> Vec<MemberHealth> {
        let now = Instant::now();
        let shutting_down = self.shutdown.is_cancelled();
        self.members
            .iter()
            .map(|(shared, cell)| snapshot(shared, &cell.lock(), now, shutting_down))
            .collect()
    }
}

fn snapshot(
    shared: &MemberShared,
    track: &HealthTrack,
    now: Instant,
    shutting_down: bool,
) -> MemberHealth {
    let reconciler = shared.lock();
    let lease_valid = reconciler.lease_valid(now);
    let ago = |at: Option<Instant>| at.map(|t| now.saturating_duration_since(t));
    let since_last_response = ago(track.last_response);
    let heard_within_lease = match since_last_response {
        Some(age) => age < track.lease_ttl,
        None => now.saturating_duration_since(track.started) < track.lease_ttl,
    };
    let leaving = shutting_down || reconciler.is_leaving();
    let live = !track.stopped && (leaving || lease_valid || heard_within_lease);
    let error_note = track
        .last_error
        .as_ref()
        .map(|e| format!(" (last heartbeat error: {e})"))
        .unwrap_or_default();
    let pending = &track.pending;
    let (state, reason) = if track.stopped {
        (
            MemberState::Stopped,
            "stopped for good: another process took this static member identity (FENCED_INSTANCE_ID); give each process its own instance_id".to_owned(),
        )
    } else if leaving {
        (
            MemberState::ShuttingDown,
            "shutting down: draining in-flight handlers, then leaving the group".to_owned(),
        )
    } else if track.fenced {
        (
            MemberState::Fenced,
            format!("fenced by the coordinator: its shards were stopped; rejoining{error_note}"),
        )
    } else if track.last_renewal.is_some() && !lease_valid {
        let expired = ago(track.last_renewal).unwrap_or_default();
        (
            MemberState::LeaseInDoubt,
            format!(
                "lease expired: no heartbeat renewed it for {} (reads and acks stop until one does){error_note}",
                humantime::format_duration(round_ms(expired))
            ),
        )
    } else if !track.settled {
        let reason = if track.last_renewal.is_none() {
            format!("joining: waiting for the coordinator's first assignment{error_note}")
        } else {
            format!(
                "joining: waiting for shards {pending:?} to be released by their previous owners{error_note}"
            )
        };
        (MemberState::Joining, reason)
    } else if !track.holds {
        (
            MemberState::Rebalancing,
            format!("rebalancing: shards move (pending {pending:?}); still ready{error_note}"),
        )
    } else {
        (
            MemberState::Ready,
            format!("holds its assignment{error_note}"),
        )
    };
    let ready = matches!(state, MemberState::Ready | MemberState::Rebalancing);
    MemberHealth {
        member_id: reconciler.identity().member_id.clone(),
        state,
        reason,
        live,
        ready,
        member_epoch: reconciler.epoch(),
        owned_shards: reconciler.owned().keys().copied().collect(),
        target_shards: track.target.clone(),
        pending_shards: pending.clone(),
        revoking_shards: reconciler.revoking_shards(),
        lease_remaining: track.last_renewal.map(|_| reconciler.lease_remaining(now)),
        since_last_renewal: ago(track.last_renewal),
        since_last_response,
        last_error: track.last_error.clone(),
        paused: shared.is_paused(),
    }
}

/// Milliseconds are plenty for a probe's message.
fn round_ms(d: Duration) -> Duration {
    Duration::from_millis(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reconciler::{Identity, Reconciler};

    const TTL: Duration = Duration::from_secs(15);
    const MARGIN: Duration = Duration::from_secs(3);

    struct Member {
        shared: Arc<MemberShared>,
        cell: Arc<HealthCell>,
        shutdown: CancellationToken,
        seq: u64,
    }

    fn member() -> Member {
        let identity = Identity {
            member_id: "base-m0".into(),
            member_name: "on_order".into(),
            instance_id: None,
            process_id: "proc-1".into(),
            runtime_max_concurrency: 1,
        };
        Member {
            shared: Arc::new(MemberShared::new(Reconciler::new(identity))),
            cell: Arc::new(HealthCell::new(TTL)),
            shutdown: CancellationToken::new(),
            seq: 0,
        }
    }

    fn response(status: HeartbeatStatus, assigned: &[u32], pending: &[u32]) -> HeartbeatResponse {
        HeartbeatResponse {
            status,
            member_epoch: 5,
            group_epoch: 5,
            assignment_epoch: 5,
            metadata_version: 1,
            incarnation: 100,
            assigned_shards: assigned.to_vec(),
            pending_shards: pending.to_vec(),
            heartbeat_interval_ms: 3000,
            member_lease_ttl_ms: 15000,
            rebalance_timeout_ms: 60000,
        }
    }

    impl Member {
        /// What the heartbeat loop does with a response to a heartbeat sent at `sent_at`.
        fn respond(&mut self, response: &HeartbeatResponse, sent_at: Instant) {
            self.seq += 1;
            let mut reconciler = self.shared.lock();
            let request = reconciler.request(self.seq);
            reconciler.apply(response, &request, sent_at, MARGIN);
            let holds = reconciler.holds(response);
            drop(reconciler);
            self.cell.lock().responded(response, sent_at, holds);
        }

        fn health_at(&self, now: Instant) -> MemberHealth {
            snapshot(
                &self.shared,
                &self.cell.lock(),
                now,
                self.shutdown.is_cancelled(),
            )
        }
    }

    #[test]
    fn a_new_member_is_joining_live_and_not_ready() {
        let m = member();
        let h = m.health_at(Instant::now());
        assert_eq!(
            (h.state, h.live, h.ready),
            (MemberState::Joining, true, false)
        );
        assert_eq!(h.lease_remaining, None);
        assert!(
            h.reason
                .starts_with("joining: waiting for the coordinator's first assignment")
        );
        let h = m.health_at(Instant::now() + TTL + Duration::from_secs(1));
        assert!(!h.live, "no response for a whole lease TTL after the start");
    }

    #[test]
    fn holding_the_assignment_is_ready_until_the_lease_passes() {
        let mut m = member();
        let sent = Instant::now();
        m.respond(&response(HeartbeatStatus::Ok, &[0, 2], &[]), sent);
        let h = m.health_at(sent + Duration::from_secs(1));
        assert_eq!((h.state, h.live, h.ready), (MemberState::Ready, true, true));
        assert_eq!(
            (h.owned_shards.clone(), h.target_shards.clone()),
            (vec![0, 2], vec![0, 2])
        );
        assert_eq!(h.member_epoch, 5);
        assert_eq!(
            h.lease_remaining,
            Some(Duration::from_secs(11)),
            "ttl - margin - 1 s"
        );

        // The lease (12 s) passed: in doubt, still live until one TTL after the response.
        let h = m.health_at(sent + Duration::from_secs(13));
        assert_eq!(
            (h.state, h.live, h.ready),
            (MemberState::LeaseInDoubt, true, false)
        );
        assert_eq!(h.lease_remaining, Some(Duration::ZERO));
        m.cell.lock().failed("heartbeat got no answer".into());
        let h = m.health_at(sent + Duration::from_secs(16));
        assert_eq!((h.state, h.live), (MemberState::LeaseInDoubt, false));
        assert!(
            h.reason
                .contains("last heartbeat error: heartbeat got no answer"),
            "{}",
            h.reason
        );
    }

    #[test]
    fn pending_shards_keep_a_joining_member_unready_and_a_later_rebalance_does_not() {
        let mut m = member();
        let sent = Instant::now();
        m.respond(&response(HeartbeatStatus::Ok, &[0, 1], &[1]), sent);
        let h = m.health_at(sent);
        assert_eq!((h.state, h.ready), (MemberState::Joining, false));
        assert_eq!(h.pending_shards, vec![1]);
        m.respond(&response(HeartbeatStatus::Ok, &[0, 1], &[]), sent);
        assert_eq!(m.health_at(sent).state, MemberState::Ready);
        // Shard 1 moves away: revoking until released, still ready.
        m.respond(&response(HeartbeatStatus::Ok, &[0], &[]), sent);
        let h = m.health_at(sent);
        assert_eq!((h.state, h.ready), (MemberState::Rebalancing, true));
        assert_eq!(h.revoking_shards, vec![1]);
    }

    #[test]
    fn fencing_shutdown_and_a_taken_identity() {
        let mut m = member();
        let sent = Instant::now();
        m.respond(&response(HeartbeatStatus::Ok, &[0], &[]), sent);
        m.respond(
            &response(HeartbeatStatus::FencedMemberEpoch, &[], &[]),
            sent,
        );
        let h = m.health_at(sent);
        assert_eq!(
            (h.state, h.live, h.ready),
            (MemberState::Fenced, true, false)
        );
        assert_eq!((h.member_epoch, h.lease_remaining), (0, None));
        // Rejoined and holding again: ready.
        m.respond(&response(HeartbeatStatus::Ok, &[0], &[]), sent);
        assert_eq!(m.health_at(sent).state, MemberState::Ready);

        m.shutdown.cancel();
        let h = m.health_at(sent);
        assert_eq!(
            (h.state, h.live, h.ready),
            (MemberState::ShuttingDown, true, false)
        );

        let mut m = member();
        m.respond(&response(HeartbeatStatus::FencedInstanceId, &[], &[]), sent);
        let h = m.health_at(sent);
        assert_eq!(
            (h.state, h.live, h.ready),
            (MemberState::Stopped, false, false)
        );
    }
}
