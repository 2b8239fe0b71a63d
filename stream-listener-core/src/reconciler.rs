//! A member's assignment state and the member rules of docs/design.md §6, as pure code: what the
//! member reports in its next heartbeat, and what it must do when a response arrives.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::fence::FenceToken;
use crate::model::{
    Epoch, FenceConflict, HeartbeatRequest, HeartbeatResponse, HeartbeatStatus, JOIN_EPOCH, Micros,
    PROTOCOL_VERSION, RevokeState, RevokingShard, ShardIndex,
};

/// Who the member is: fixed for its whole life.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Identity {
    pub(crate) member_id: String,
    pub(crate) member_name: String,
    pub(crate) instance_id: Option<String>,
    pub(crate) process_id: String,
    pub(crate) runtime_max_concurrency: u32,
}

/// What the runtime must do after a response.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Changes {
    /// Newly assigned shards to start (raise the fence with the token first).
    pub(crate) start: Vec<(ShardIndex, FenceToken)>,
    /// Owned shards to keep but re-raise with a new token (a correction round ended).
    pub(crate) reraise: Vec<(ShardIndex, FenceToken)>,
    /// Owned shards to revoke: stop reading, drain, then report `REVOKED`.
    pub(crate) revoke: Vec<ShardIndex>,
    /// Stop every read and ack at once and cancel in-flight handlers (a fencing status).
    pub(crate) stop_all: bool,
    /// Stop for good: another process took this static identity.
    pub(crate) fatal: bool,
}

/// The member's view of its assignment (docs/design.md §6.7, member rules).
#[derive(Debug, Clone)]
pub(crate) struct Reconciler {
    identity: Identity,
    epoch: Epoch,
    metadata_version: u64,
    incarnation: Micros,
    owned: BTreeMap<ShardIndex, FenceToken>,
    revoking: BTreeMap<ShardIndex, RevokeState>,
    lease_deadline: Option<Instant>,
    conflicts: Vec<FenceConflict>,
    leaving: bool,
    stopped: bool,
}

impl Reconciler {
    pub(crate) fn new(identity: Identity) -> Self {
        Reconciler {
            identity,
            epoch: JOIN_EPOCH,
            metadata_version: 0,
            incarnation: 0,
            owned: BTreeMap::new(),
            revoking: BTreeMap::new(),
            lease_deadline: None,
            conflicts: Vec::new(),
            leaving: false,
            stopped: false,
        }
    }

    pub(crate) fn identity(&self) -> &Identity {
        &self.identity
    }

    pub(crate) fn epoch(&self) -> Epoch {
        self.epoch
    }

    /// The fencing token of an owned shard.
    pub(crate) fn token(&self, shard: ShardIndex) -> Option<&FenceToken> {
        self.owned.get(&shard)
    }

    /// Owned shards with their tokens.
    pub(crate) fn owned(&self) -> &BTreeMap<ShardIndex, FenceToken> {
        &self.owned
    }

    /// Whether the member may read, ack or claim `shard` at `now`: it owns it and its lease has
    /// not passed (fail closed).
    pub(crate) fn may_use(&self, shard: ShardIndex, now: Instant) -> bool {
        self.owned.contains_key(&shard) && self.lease_valid(now)
    }

    /// Whether the member may finish and ack work on `shard` at `now`: it owns it or is draining
    /// it (a drain acks what finished), and its lease has not passed.
    pub(crate) fn may_finish(&self, shard: ShardIndex, now: Instant) -> bool {
        let holding = self.owned.contains_key(&shard)
            || self.revoking.get(&shard) == Some(&RevokeState::Draining);
        holding && self.lease_valid(now)
    }

    /// Shards being given up, with how far each is.
    #[cfg(test)]
    pub(crate) fn revoking(&self) -> &BTreeMap<ShardIndex, RevokeState> {
        &self.revoking
    }

    /// Shards being given up, ascending (for health snapshots).
    pub(crate) fn revoking_shards(&self) -> Vec<ShardIndex> {
        self.revoking.keys().copied().collect()
    }

    /// Whether a graceful shutdown began ([`Reconciler::begin_leave`]).
    pub(crate) fn is_leaving(&self) -> bool {
        self.leaving
    }

    /// Whether the member owns exactly the shards `response` assigned, with none pending
    /// elsewhere and none being given up: it holds its whole assignment.
    pub(crate) fn holds(&self, response: &HeartbeatResponse) -> bool {
        let assigned: std::collections::BTreeSet<ShardIndex> =
            response.assigned_shards.iter().copied().collect();
        response.pending_shards.is_empty()
            && self.revoking.is_empty()
            && self.owned.keys().copied().eq(assigned)
    }

    pub(crate) fn lease_valid(&self, now: Instant) -> bool {
        self.lease_deadline.is_some_and(|d| now < d)
    }

    /// Time left on the lease (zero when passed or never granted).
    pub(crate) fn lease_remaining(&self, now: Instant) -> Duration {
        self.lease_deadline
            .map_or(Duration::ZERO, |d| d.saturating_duration_since(now))
    }

    #[cfg(test)]
    pub(crate) fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// A draining shard finished its in-flight work: report it `REVOKED` next time.
    pub(crate) fn drained(&mut self, shard: ShardIndex) {
        if let Some(state) = self.revoking.get_mut(&shard) {
            *state = RevokeState::Revoked;
        }
    }

    /// The fence of an owned shard holds another token: stop using it and report it.
    pub(crate) fn fence_conflict(&mut self, conflict: FenceConflict) {
        if self.owned.contains_key(&conflict.shard_index) && !self.conflicts.contains(&conflict) {
            self.conflicts.push(conflict);
        }
    }

    /// Graceful shutdown begins: give up every owned shard; accept nothing new.
    pub(crate) fn begin_leave(&mut self) -> Vec<ShardIndex> {
        self.leaving = true;
        let shards: Vec<ShardIndex> = self.owned.keys().copied().collect();
        for shard in &shards {
            self.owned.remove(shard);
            self.revoking.insert(*shard, RevokeState::Draining);
        }
        shards
    }

    /// The next heartbeat: epoch `0` to join, or the current epoch with the full report.
    pub(crate) fn request(&mut self, request_seq: u64) -> HeartbeatRequest {
        let owned = &self.owned;
        self.conflicts
            .retain(|c| owned.contains_key(&c.shard_index));
        HeartbeatRequest {
            member_id: self.identity.member_id.clone(),
            member_name: self.identity.member_name.clone(),
            instance_id: self.identity.instance_id.clone(),
            process_id: self.identity.process_id.clone(),
            request_seq,
            member_epoch: self.epoch,
            metadata_version: self.metadata_version,
            runtime_max_concurrency: self.identity.runtime_max_concurrency,
            active_consumer_workers: 0,
            owned_shards: self.owned.keys().copied().collect(),
            revoking_shards: self
                .revoking
                .iter()
                .map(|(shard, state)| RevokingShard {
                    shard_index: *shard,
                    state: *state,
                })
                .collect(),
            fence_conflicts: self.conflicts.clone(),
            protocol_version: PROTOCOL_VERSION,
        }
    }

    /// The leave request (`-1`, or `-2` for a static member): every shard reported `REVOKED`.
    pub(crate) fn leave_request(&mut self, request_seq: u64) -> HeartbeatRequest {
        let mut request = self.request(request_seq);
        let static_member = self.identity.instance_id.is_some();
        request.member_epoch = if static_member {
            crate::model::STATIC_LEAVE_EPOCH
        } else {
            crate::model::LEAVE_EPOCH
        };
        let mut all: Vec<ShardIndex> = self.revoking.keys().copied().collect();
        all.extend(self.owned.keys().copied());
        all.sort_unstable();
        all.dedup();
        request.owned_shards.clear();
        request.revoking_shards = all
            .into_iter()
            .map(|shard_index| RevokingShard {
                shard_index,
                state: RevokeState::Revoked,
            })
            .collect();
        request.fence_conflicts.clear();
        request
    }

    /// Applies the response to `request`, whose first attempt was sent at `sent_at`, with lease
    /// `ttl − margin` (docs/design.md §6.7, member rules).
    pub(crate) fn apply(
        &mut self,
        response: &HeartbeatResponse,
        request: &HeartbeatRequest,
        sent_at: Instant,
        lease_margin: Duration,
    ) -> Changes {
        let mut changes = Changes::default();
        match response.status {
            HeartbeatStatus::Retry => {}
            HeartbeatStatus::UnknownMemberId | HeartbeatStatus::FencedMemberEpoch => {
                self.rejoin();
                changes.stop_all = true;
            }
            HeartbeatStatus::FencedInstanceId => {
                self.clear();
                self.stopped = true;
                changes.stop_all = true;
                changes.fatal = true;
            }
            HeartbeatStatus::Ok
            | HeartbeatStatus::SyncMetadata
            | HeartbeatStatus::RevokePending => {
                let ttl = Duration::from_millis(response.member_lease_ttl_ms);
                self.lease_deadline = Some(sent_at + ttl.saturating_sub(lease_margin));
                self.epoch = response.member_epoch;
                self.metadata_version = response.metadata_version;
                self.acknowledge_revoked(request);
                // Reported conflicts were received: the coordinator acts on them once.
                self.conflicts
                    .retain(|c| !request.fence_conflicts.contains(c));
                changes.revoke = self.revoke_unassigned(&response.assigned_shards);
                if response.status == HeartbeatStatus::Ok && !self.leaving {
                    self.start_assigned(response, &mut changes);
                }
                self.incarnation = self.incarnation.max(response.incarnation);
            }
        }
        changes
    }

    /// `REVOKED` shards the coordinator accepted are forgotten.
    fn acknowledge_revoked(&mut self, request: &HeartbeatRequest) {
        for reported in &request.revoking_shards {
            if reported.state == RevokeState::Revoked
                && self.revoking.get(&reported.shard_index) == Some(&RevokeState::Revoked)
            {
                self.revoking.remove(&reported.shard_index);
            }
        }
    }

    fn revoke_unassigned(&mut self, assigned: &[ShardIndex]) -> Vec<ShardIndex> {
        let dropped: Vec<ShardIndex> = self
            .owned
            .keys()
            .filter(|s| !assigned.contains(s))
            .copied()
            .collect();
        for shard in &dropped {
            self.owned.remove(shard);
            self.revoking.insert(*shard, RevokeState::Draining);
        }
        dropped
    }

    fn start_assigned(&mut self, response: &HeartbeatResponse, changes: &mut Changes) {
        let token = FenceToken {
            incarnation: response.incarnation,
            member_epoch: response.member_epoch,
            member_id: self.identity.member_id.clone(),
            process_id: self.identity.process_id.clone(),
        };
        for shard in &response.assigned_shards {
            // A revoking shard never resumes before its REVOKED is acknowledged.
            if self.revoking.contains_key(shard) {
                continue;
            }
            match self.owned.get_mut(shard) {
                None => {
                    self.owned.insert(*shard, token.clone());
                    changes.start.push((*shard, token.clone()));
                }
                // A correction round ended: re-raise with the new token before reading again.
                Some(current) if current.incarnation < response.incarnation => {
                    *current = token.clone();
                    self.conflicts.retain(|c| c.shard_index != *shard);
                    changes.reraise.push((*shard, token.clone()));
                }
                Some(_) => {}
            }
        }
    }

    /// Forgets every shard and joins again at the next request: after a fencing status, and for
    /// a member holding shards the stream no longer has (created again with fewer shards), which
    /// the coordinator refuses to hear of.
    pub(crate) fn rejoin(&mut self) {
        self.clear();
        self.epoch = JOIN_EPOCH;
    }

    fn clear(&mut self) {
        self.owned.clear();
        self.revoking.clear();
        self.conflicts.clear();
        self.lease_deadline = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity() -> Identity {
        Identity {
            member_id: "base-m0".into(),
            member_name: "on_order".into(),
            instance_id: None,
            process_id: "proc-1".into(),
            runtime_max_concurrency: 1,
        }
    }

    fn response(
        status: HeartbeatStatus,
        epoch: Epoch,
        assigned: &[ShardIndex],
    ) -> HeartbeatResponse {
        HeartbeatResponse {
            status,
            member_epoch: epoch,
            group_epoch: epoch,
            assignment_epoch: epoch,
            metadata_version: 1,
            incarnation: 100,
            assigned_shards: assigned.to_vec(),
            pending_shards: Vec::new(),
            heartbeat_interval_ms: 3000,
            member_lease_ttl_ms: 15000,
            rebalance_timeout_ms: 60000,
        }
    }

    const MARGIN: Duration = Duration::from_secs(3);

    /// A member (`identity`) that joined and was assigned `shards` at epoch 5, with the time its
    /// join was sent (the lease runs from it).
    fn joined(identity: Identity, shards: &[ShardIndex]) -> (Reconciler, Instant) {
        let mut r = Reconciler::new(identity);
        let sent = Instant::now();
        let join = r.request(1);
        r.apply(
            &response(HeartbeatStatus::Ok, 5, shards),
            &join,
            sent,
            MARGIN,
        );
        (r, sent)
    }

    #[test]
    fn ok_starts_assigned_shards_with_the_responses_token_and_sets_the_lease() {
        let mut r = Reconciler::new(identity());
        let sent = Instant::now();
        let join = r.request(1);
        assert_eq!(join.member_epoch, 0);
        let changes = r.apply(
            &response(HeartbeatStatus::Ok, 5, &[0, 2]),
            &join,
            sent,
            MARGIN,
        );
        let shards: Vec<ShardIndex> = changes.start.iter().map(|(s, _)| *s).collect();
        assert_eq!(shards, vec![0, 2]);
        assert_eq!(changes.start[0].1.member_epoch, 5);
        assert_eq!(changes.start[0].1.incarnation, 100);
        assert!(r.may_use(0, sent + Duration::from_secs(11)));
        assert!(
            !r.may_use(0, sent + Duration::from_secs(12)),
            "lease is ttl - margin from the send time"
        );
        assert!(!r.may_use(1, sent));
        assert_eq!(r.request(2).owned_shards, vec![0, 2]);
    }

    #[test]
    fn a_shard_no_longer_assigned_is_revoked_and_never_resumed_before_its_release_is_acknowledged()
    {
        let (mut r, sent) = joined(identity(), &[0, 1]);
        let req = r.request(2);
        let changes = r.apply(&response(HeartbeatStatus::Ok, 6, &[0]), &req, sent, MARGIN);
        assert_eq!(changes.revoke, vec![1]);
        assert!(!r.may_use(1, sent));
        // Assigned again before it drained: not restarted.
        let req = r.request(3);
        let changes = r.apply(
            &response(HeartbeatStatus::Ok, 7, &[0, 1]),
            &req,
            sent,
            MARGIN,
        );
        assert!(changes.start.is_empty());
        r.drained(1);
        let req = r.request(4);
        assert_eq!(
            req.revoking_shards,
            vec![RevokingShard {
                shard_index: 1,
                state: RevokeState::Revoked
            }]
        );
        r.apply(&response(HeartbeatStatus::Ok, 7, &[0]), &req, sent, MARGIN);
        let req = r.request(5);
        assert!(
            req.revoking_shards.is_empty(),
            "the acknowledged release is forgotten"
        );
        let changes = r.apply(
            &response(HeartbeatStatus::Ok, 8, &[0, 1]),
            &req,
            sent,
            MARGIN,
        );
        assert_eq!(changes.start.len(), 1);
        assert_eq!(changes.start[0].0, 1);
    }

    #[test]
    fn fencing_statuses_stop_everything_and_rejoin() {
        let (mut r, sent) = joined(identity(), &[0]);
        let req = r.request(2);
        let changes = r.apply(
            &response(HeartbeatStatus::FencedMemberEpoch, 0, &[]),
            &req,
            sent,
            MARGIN,
        );
        assert!(changes.stop_all && !changes.fatal);
        assert!(!r.may_use(0, sent));
        assert_eq!(r.request(3).member_epoch, 0);
        let changes = r.apply(
            &response(HeartbeatStatus::FencedInstanceId, 0, &[]),
            &req,
            sent,
            MARGIN,
        );
        assert!(changes.fatal);
        assert!(r.is_stopped());
    }

    #[test]
    fn sync_metadata_keeps_assigned_owned_shards_and_starts_nothing_new() {
        let (mut r, sent) = joined(identity(), &[0, 1]);
        let req = r.request(2);
        let mut sync = response(HeartbeatStatus::SyncMetadata, 9, &[0, 2]);
        sync.incarnation = 200;
        let changes = r.apply(&sync, &req, sent, MARGIN);
        assert_eq!(changes.revoke, vec![1]);
        assert!(changes.start.is_empty());
        assert_eq!(
            r.token(0).map(|t| t.incarnation),
            Some(100),
            "old token until the round ends"
        );
        assert_eq!(r.epoch(), 9);
        let req = r.request(3);
        let mut ok = response(HeartbeatStatus::Ok, 9, &[0, 2]);
        ok.incarnation = 200;
        let changes = r.apply(&ok, &req, sent, MARGIN);
        assert_eq!(changes.reraise.len(), 1);
        assert_eq!(changes.reraise[0].1.incarnation, 200);
        assert_eq!(
            changes.start.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
            vec![2]
        );
    }

    #[test]
    fn a_fence_conflict_is_reported_until_a_response_acknowledges_it() {
        let (mut r, sent) = joined(identity(), &[0]);
        let conflict = FenceConflict {
            shard_index: 0,
            incarnation: 100,
            epoch: 7,
        };
        r.fence_conflict(conflict);
        let lost = r.request(2);
        assert_eq!(lost.fence_conflicts, vec![conflict]);
        // That response was lost: the next request reports it again.
        let req = r.request(3);
        assert_eq!(req.fence_conflicts, vec![conflict]);
        r.apply(
            &response(HeartbeatStatus::SyncMetadata, 9, &[0]),
            &req,
            sent,
            MARGIN,
        );
        // Received: not reported again (re-reporting it would start correction rounds forever).
        assert!(r.request(4).fence_conflicts.is_empty());
    }

    #[test]
    fn leaving_reports_everything_revoked() {
        let static_member = Identity {
            instance_id: Some("pod-1".into()),
            ..identity()
        };
        let (mut r, _) = joined(static_member, &[0, 1]);
        assert_eq!(r.begin_leave(), vec![0, 1]);
        let leave = r.leave_request(2);
        assert_eq!(leave.member_epoch, crate::model::STATIC_LEAVE_EPOCH);
        assert!(leave.owned_shards.is_empty());
        assert!(
            leave
                .revoking_shards
                .iter()
                .all(|s| s.state == RevokeState::Revoked)
        );
        assert_eq!(leave.revoking_shards.len(), 2);
    }
}
