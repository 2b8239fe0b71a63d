//! Scenario tests of the coordinator rules (DESIGN.md §4–§6), one rule at a time, with the exact
//! expected responses. Random histories are in `simulation.rs`.

use std::collections::BTreeMap;
use std::time::Duration;

use super::invariants::check_group;
use super::*;
use crate::model::*;

const MS: Micros = 1_000;
const T0: Micros = 1_700_000_000_000_000;
const LEASE: Micros = 15_000 * MS;

struct Fixture {
    group: Group,
    stream: StreamView,
    config: CoordinatorConfig,
    now: Micros,
    seqs: BTreeMap<String, u64>,
}

fn stream(shards: u32) -> StreamView {
    StreamView {
        metadata_version: 1,
        shard_count: shards,
        readable: (0..shards).collect(),
        shard_index_bound: shards,
    }
}

fn request(member: &str, process: &str, epoch: Epoch, owned: &[ShardIndex]) -> HeartbeatRequest {
    HeartbeatRequest {
        member_id: member.into(),
        member_name: "on_order".into(),
        instance_id: None,
        process_id: process.into(),
        request_seq: 0,
        member_epoch: epoch,
        metadata_version: 1,
        runtime_max_concurrency: 1,
        active_consumer_workers: 0,
        owned_shards: owned.to_vec(),
        revoking_shards: Vec::new(),
        fence_conflicts: Vec::new(),
        protocol_version: PROTOCOL_VERSION,
    }
}

fn revoking(shards: &[ShardIndex], state: RevokeState) -> Vec<RevokingShard> {
    shards
        .iter()
        .map(|s| RevokingShard {
            shard_index: *s,
            state,
        })
        .collect()
}

impl Fixture {
    fn new(shards: u32) -> Self {
        let stream = stream(shards);
        Fixture {
            group: Group::new("orders", "billing", &stream, T0),
            stream,
            config: CoordinatorConfig::default(),
            now: T0,
            seqs: BTreeMap::new(),
        }
    }

    /// Sends `request` with the next `requestSeq` of its process and checks the invariants.
    fn send(&mut self, mut request: HeartbeatRequest) -> HeartbeatResponse {
        let seq = self.seqs.entry(request.process_id.clone()).or_default();
        *seq += 1;
        request.request_seq = *seq;
        self.send_raw(&request).expect("well-formed request")
    }

    fn send_raw(
        &mut self,
        request: &HeartbeatRequest,
    ) -> Result<HeartbeatResponse, CoordinatorError> {
        let ctx = Context {
            now: self.now,
            stream: &self.stream,
            fences: None,
        };
        let response = heartbeat(&mut self.group, request, &ctx, &self.config)?;
        check_group(&self.group, self.now, true).expect("invariants hold");
        Ok(response)
    }

    fn join(&mut self, member: &str) -> HeartbeatResponse {
        self.send(request(member, &format!("p-{member}"), JOIN_EPOCH, &[]))
    }

    /// A normal heartbeat of `member` (process `p-<member>`) owning `owned`.
    fn beat(&mut self, member: &str, epoch: Epoch, owned: &[ShardIndex]) -> HeartbeatResponse {
        self.send(request(member, &format!("p-{member}"), epoch, owned))
    }

    fn advance_ms(&mut self, ms: u64) {
        self.now += ms * MS;
    }

    fn member(&self, id: &str) -> &MemberMetadata {
        &self.group.members[id]
    }
}

// ---- validation ---------------------------------------------------------------------------------

#[test]
fn malformed_requests_are_refused_and_change_nothing() {
    let mut f = Fixture::new(4);
    f.join("a");
    let before = f.group.clone();
    let cases: Vec<(HeartbeatRequest, CoordinatorError)> = vec![
        (
            HeartbeatRequest {
                protocol_version: 9,
                ..request("a", "p-a", 1, &[])
            },
            CoordinatorError::UnsupportedProtocolVersion {
                got: 9,
                supported: 1,
            },
        ),
        (
            request("", "p-a", 1, &[]),
            CoordinatorError::EmptyField { field: "memberId" },
        ),
        (
            request("a", "", 1, &[]),
            CoordinatorError::EmptyField { field: "processId" },
        ),
        (
            request("a", "p-a", -3, &[]),
            CoordinatorError::InvalidMemberEpoch(-3),
        ),
        (
            request("a", "p-a", 1, &[1, 1]),
            CoordinatorError::DuplicateShard {
                shard: 1,
                field: "ownedShards",
            },
        ),
        (
            HeartbeatRequest {
                revoking_shards: revoking(&[2], RevokeState::Draining),
                ..request("a", "p-a", 1, &[2])
            },
            CoordinatorError::DuplicateShard {
                shard: 2,
                field: "revokingShards",
            },
        ),
        (
            request("a", "p-a", 1, &[4]),
            CoordinatorError::ShardOutOfRange {
                shard: 4,
                field: "ownedShards",
                bound: 4,
            },
        ),
    ];
    for (bad, expected) in cases {
        assert_eq!(f.send_raw(&bad), Err(expected));
        assert_eq!(f.group, before);
    }
}

#[test]
fn heartbeat_interval_above_a_third_of_the_lease_is_refused() {
    let err = CoordinatorConfig::new(
        Duration::from_secs(6),
        Duration::from_secs(15),
        Duration::from_secs(60),
    );
    assert_eq!(
        err,
        Err(ConfigError::HeartbeatTooSlow {
            heartbeat_ms: 6000,
            lease_ms: 15000
        })
    );
    assert_eq!(
        CoordinatorConfig::new(
            Duration::ZERO,
            Duration::from_secs(15),
            Duration::from_secs(60)
        ),
        Err(ConfigError::Zero {
            name: "heartbeat_interval"
        })
    );
    assert!(
        CoordinatorConfig::new(
            Duration::from_secs(5),
            Duration::from_secs(15),
            Duration::from_secs(60)
        )
        .is_ok()
    );
    // Absurd values are refused instead of overflowing time arithmetic later.
    assert_eq!(
        CoordinatorConfig::new(
            Duration::from_secs(3),
            Duration::from_secs(600_000 * 365 * 86_400),
            Duration::from_secs(60)
        ),
        Err(ConfigError::TooLong {
            name: "member_lease_ttl",
            max_secs: 86_400
        })
    );
}

// ---- join, converge, unchanged group --------------------------------------------------------------

#[test]
fn first_member_gets_every_shard_and_the_group_becomes_stable() {
    let mut f = Fixture::new(4);
    let r = f.join("a");
    assert_eq!(r.status, HeartbeatStatus::Ok);
    assert_eq!(
        (r.member_epoch, r.group_epoch, r.assignment_epoch),
        (1, 1, 1)
    );
    assert_eq!(r.assigned_shards, vec![0, 1, 2, 3]);
    assert_eq!(r.pending_shards, Vec::<ShardIndex>::new());
    assert_eq!(r.heartbeat_interval_ms, 3000);
    assert_eq!(r.member_lease_ttl_ms, 15000);
    assert_eq!(r.incarnation, T0);
    assert_eq!(f.group.meta.state, GroupState::Reconciling);
    f.advance_ms(10);
    let r = f.beat("a", 1, &[0, 1, 2, 3]);
    assert_eq!((r.status, r.member_epoch), (HeartbeatStatus::Ok, 1));
    assert_eq!(f.group.meta.state, GroupState::Stable);
    // An unchanged group: heartbeats change no epoch.
    for _ in 0..5 {
        f.advance_ms(3000);
        let r = f.beat("a", 1, &[0, 1, 2, 3]);
        assert_eq!(
            (r.member_epoch, r.group_epoch, r.assignment_epoch),
            (1, 1, 1)
        );
        assert_eq!(f.group.meta.state, GroupState::Stable);
    }
    assert_eq!(f.member("a").member_lease_expires_at, f.now + LEASE);
}

#[test]
fn revoke_before_assign_moves_a_shard_only_after_it_is_released() {
    let mut f = Fixture::new(4);
    f.join("a");
    f.beat("a", 1, &[0, 1, 2, 3]);
    let b = f.join("b");
    assert_eq!(b.member_epoch, 2);
    assert_eq!(b.assigned_shards, Vec::<ShardIndex>::new());
    assert_eq!(b.pending_shards, vec![2, 3]);
    // a learns it keeps 0 and 1; its epoch moves because its assigned shards changed.
    let a = f.beat("a", 1, &[0, 1, 2, 3]);
    assert_eq!((a.member_epoch, a.assigned_shards.clone()), (2, vec![0, 1]));
    // a drains 2 and 3: still held, b still waits.
    let a = f.send(HeartbeatRequest {
        revoking_shards: revoking(&[2, 3], RevokeState::Draining),
        ..request("a", "p-a", 2, &[0, 1])
    });
    assert_eq!(a.assigned_shards, vec![0, 1]);
    let b = f.beat("b", 2, &[]);
    assert_eq!(
        (b.assigned_shards.clone(), b.pending_shards.clone()),
        (vec![], vec![2, 3])
    );
    // a reports 2 released: b may take 2, not yet 3.
    f.send(HeartbeatRequest {
        revoking_shards: vec![
            RevokingShard {
                shard_index: 2,
                state: RevokeState::Revoked,
            },
            RevokingShard {
                shard_index: 3,
                state: RevokeState::Draining,
            },
        ],
        ..request("a", "p-a", 2, &[0, 1])
    });
    let b = f.beat("b", 2, &[]);
    assert_eq!(
        (b.assigned_shards.clone(), b.pending_shards.clone()),
        (vec![2], vec![3])
    );
    assert_eq!(b.member_epoch, 2);
    f.send(HeartbeatRequest {
        revoking_shards: revoking(&[3], RevokeState::Revoked),
        ..request("a", "p-a", 2, &[0, 1])
    });
    let b = f.beat("b", 2, &[2]);
    assert_eq!(b.assigned_shards, vec![2, 3]);
    f.beat("b", 2, &[2, 3]);
    assert_eq!(f.group.meta.state, GroupState::Stable);
    assert_eq!(f.member("a").revoke_deadline, None);
}

// ---- lost responses, retries, delayed requests --------------------------------------------------

#[test]
fn a_lost_response_does_not_fence_a_healthy_member() {
    let mut f = Fixture::new(4);
    f.join("a");
    f.beat("a", 1, &[0, 1, 2, 3]);
    f.join("b");
    let lost = f.beat("a", 1, &[0, 1, 2, 3]);
    assert_eq!(lost.member_epoch, 2);
    // The response was lost: a heartbeats again with its previous epoch and old shards.
    let again = f.beat("a", 1, &[0, 1, 2, 3]);
    assert_eq!(again.status, HeartbeatStatus::Ok);
    assert_eq!((again.member_epoch, again.assigned_shards), (2, vec![0, 1]));
}

#[test]
fn a_retried_request_gets_the_stored_response_and_a_delayed_one_is_ignored() {
    let mut f = Fixture::new(2);
    let mut join = request("a", "p-a", JOIN_EPOCH, &[]);
    join.request_seq = 7;
    let first = f.send_raw(&join).unwrap();
    let group_epoch = f.group.meta.group_epoch;
    f.advance_ms(100);
    let retried = f.send_raw(&join).unwrap();
    assert_eq!(retried, first);
    assert_eq!(
        f.group.meta.group_epoch, group_epoch,
        "a retried join is not a second join"
    );
    let mut next = request("a", "p-a", first.member_epoch, &[0, 1]);
    next.request_seq = 8;
    f.send_raw(&next).unwrap();
    assert_eq!(
        f.send_raw(&join),
        Err(CoordinatorError::StaleRequestSeq { got: 7, last: 8 })
    );
}

// ---- leave, static membership --------------------------------------------------------------------

#[test]
fn leave_moves_shards_as_they_are_revoked_then_the_member_is_history() {
    let mut f = Fixture::new(4);
    f.join("a");
    f.beat("a", 1, &[0, 1, 2, 3]);
    f.join("b");
    f.beat("a", 1, &[0, 1, 2, 3]);
    f.send(HeartbeatRequest {
        revoking_shards: revoking(&[2, 3], RevokeState::Revoked),
        ..request("a", "p-a", 2, &[0, 1])
    });
    f.beat("b", 2, &[]);
    f.beat("b", 2, &[2, 3]);
    assert_eq!(f.group.meta.state, GroupState::Stable);
    let ge = f.group.meta.group_epoch;
    // b leaves, reporting everything released.
    let r = f.send(HeartbeatRequest {
        revoking_shards: revoking(&[2, 3], RevokeState::Revoked),
        ..request("b", "p-b", LEAVE_EPOCH, &[])
    });
    assert_eq!(r.status, HeartbeatStatus::Ok);
    assert_eq!(f.group.meta.group_epoch, ge + 1);
    assert!(!f.group.members.contains_key("b"));
    assert_eq!(f.group.history[0].state, MemberState::Left);
    let a = f.beat("a", 2, &[0, 1]);
    assert_eq!(a.assigned_shards, vec![0, 1, 2, 3]);
}

#[test]
fn a_static_member_back_within_its_lease_moves_nothing() {
    let mut f = Fixture::new(4);
    let static_join = |member: &str, process: &str| HeartbeatRequest {
        instance_id: Some(format!("pod-{member}")),
        ..request(member, process, JOIN_EPOCH, &[])
    };
    f.send(static_join("s", "p1"));
    f.send(HeartbeatRequest {
        instance_id: Some("pod-s".into()),
        ..request("s", "p1", 1, &[0, 1, 2, 3])
    });
    f.join("b");
    let s = f.send(HeartbeatRequest {
        instance_id: Some("pod-s".into()),
        revoking_shards: revoking(&[2, 3], RevokeState::Revoked),
        ..request("s", "p1", 1, &[0, 1])
    });
    f.beat("b", 2, &[]);
    f.beat("b", 2, &[2, 3]);
    assert_eq!(s.assigned_shards, vec![0, 1]);
    let target_before = f.group.meta.target_assignment.members.clone();
    let b_epoch = f.member("b").member_epoch;
    // Static leave: everything released, target kept, no rebalance.
    f.send(HeartbeatRequest {
        instance_id: Some("pod-s".into()),
        revoking_shards: revoking(&[0, 1], RevokeState::Revoked),
        ..request("s", "p1", STATIC_LEAVE_EPOCH, &[])
    });
    assert!(f.member("s").away);
    f.advance_ms(5000);
    let b = f.beat("b", 2, &[2, 3]);
    assert_eq!((b.assigned_shards, b.pending_shards), (vec![2, 3], vec![]));
    // The pod restarts as a new process within the lease: same target, at once.
    let back = f.send(static_join("s", "p2"));
    assert_eq!(back.assigned_shards, vec![0, 1]);
    assert_eq!(
        f.group
            .meta
            .target_assignment
            .members
            .values()
            .collect::<Vec<_>>(),
        target_before.values().collect::<Vec<_>>()
    );
    let b = f.beat("b", 2, &[2, 3]);
    assert_eq!(b.member_epoch, b_epoch, "no other member's epoch changes");
    // The old process is fenced for good.
    let old = f.send(HeartbeatRequest {
        instance_id: Some("pod-s".into()),
        ..request("s", "p1", 2, &[])
    });
    assert_eq!(old.status, HeartbeatStatus::FencedInstanceId);
}

#[test]
fn a_replaced_process_keeps_its_shards_blocked_until_its_lease_ends() {
    let mut f = Fixture::new(2);
    let with_instance = |r: HeartbeatRequest| HeartbeatRequest {
        instance_id: Some("pod".into()),
        ..r
    };
    f.send(with_instance(request("s", "p1", JOIN_EPOCH, &[])));
    f.send(with_instance(request("s", "p1", 1, &[0, 1])));
    let p1_lease = f.member("s").member_lease_expires_at;
    // p1 hangs; the orchestrator starts p2 with the same identity.
    f.advance_ms(1000);
    let p2 = f.send(with_instance(request("s", "p2", JOIN_EPOCH, &[])));
    assert_eq!(
        (p2.assigned_shards.clone(), p2.pending_shards.clone()),
        (vec![], vec![0, 1])
    );
    assert_eq!(f.member("s").old_process_holdings.len(), 1);
    // A third process before p1's lease ends: p1 is still remembered.
    f.advance_ms(1000);
    let p3 = f.send(with_instance(request("s", "p3", JOIN_EPOCH, &[])));
    assert_eq!(p3.assigned_shards, Vec::<ShardIndex>::new());
    f.now = p1_lease;
    let p3 = f.send(with_instance(request("s", "p3", p3.member_epoch, &[])));
    assert_eq!(p3.assigned_shards, vec![0, 1]);
    assert!(f.member("s").old_process_holdings.is_empty());
}

// ---- expiry, fencing, outage ---------------------------------------------------------------------

#[test]
fn an_expired_member_is_replaced_and_its_shards_move() {
    let mut f = Fixture::new(2);
    f.join("a");
    f.beat("a", 1, &[0, 1]);
    f.join("b");
    let a = f.beat("a", 1, &[0, 1]);
    assert_eq!(a.assigned_shards, vec![0]);
    // a crashes before releasing shard 1; b heartbeats on until a's lease ends.
    let a_lease = f.member("a").member_lease_expires_at;
    let mut b_epoch = 2;
    while f.now + 3000 * MS < a_lease {
        f.advance_ms(3000);
        let b = f.beat("b", b_epoch, &[]);
        assert_eq!(b.pending_shards, vec![1]);
        b_epoch = b.member_epoch;
    }
    f.now = a_lease;
    let ge = f.group.meta.group_epoch;
    let b = f.beat("b", b_epoch, &[]);
    assert_eq!(b.assigned_shards, vec![0, 1]);
    assert_eq!(f.group.meta.group_epoch, ge + 1);
    assert_eq!(f.group.history[0].member_id, "a");
    assert_eq!(f.group.history[0].state, MemberState::Expired);
    let a = f.beat("a", a.member_epoch, &[0]);
    assert_eq!(a.status, HeartbeatStatus::UnknownMemberId);
}

#[test]
fn a_late_revoker_is_fenced_and_its_shards_wait_for_its_lease() {
    let mut f = Fixture::new(2);
    f.config.rebalance_timeout = Duration::from_secs(6);
    f.join("a");
    f.beat("a", 1, &[0, 1]);
    f.join("b");
    // a keeps heartbeating but never gives shard 1 up.
    let mut a_epoch = 1;
    for _ in 0..2 {
        f.advance_ms(3000);
        a_epoch = f.beat("a", a_epoch, &[0, 1]).member_epoch;
    }
    f.advance_ms(1);
    let r = f.beat("a", a_epoch, &[0, 1]);
    assert_eq!(r.status, HeartbeatStatus::FencedMemberEpoch);
    assert_eq!(f.member("a").state, MemberState::Fenced);
    let b = f.beat("b", 2, &[]);
    assert_eq!(
        b.assigned_shards,
        Vec::<ShardIndex>::new(),
        "fenced a still holds until its lease ends"
    );
    f.now = f.member("a").member_lease_expires_at;
    let b = f.beat("b", 2, &[]);
    assert_eq!(b.assigned_shards, vec![0, 1]);
}

#[test]
fn reporting_a_shard_not_held_fences_the_member() {
    let mut f = Fixture::new(2);
    f.join("a");
    f.beat("a", 1, &[0, 1]);
    f.join("b");
    let b = f.beat("b", 2, &[1]);
    assert_eq!(b.status, HeartbeatStatus::FencedMemberEpoch);
    // It held nothing, so it goes straight to the history; a keeps both shards.
    assert_eq!(f.group.history[0].member_id, "b");
    assert_eq!(f.group.history[0].state, MemberState::Fenced);
    let a = f.beat("a", 1, &[0, 1]);
    assert_eq!(a.assigned_shards, vec![0, 1]);
}

#[test]
fn an_outage_longer_than_the_lease_expires_no_one() {
    let mut f = Fixture::new(2);
    f.join("a");
    f.beat("a", 1, &[0, 1]);
    f.join("b");
    f.beat("a", 1, &[0, 1]);
    f.send(HeartbeatRequest {
        revoking_shards: revoking(&[1], RevokeState::Revoked),
        ..request("a", "p-a", 2, &[0])
    });
    f.beat("b", 2, &[]);
    f.beat("b", 2, &[1]);
    assert_eq!(f.group.meta.state, GroupState::Stable);
    // Redis was unreachable for a minute: the first heartbeat after it must not expire b.
    f.advance_ms(60_000);
    let a = f.beat("a", 2, &[0]);
    assert_eq!(a.assigned_shards, vec![0]);
    assert_eq!(f.member("b").state, MemberState::Active);
    let b = f.beat("b", 2, &[1]);
    assert_eq!((b.status, b.member_epoch), (HeartbeatStatus::Ok, 2));
    assert_eq!(f.group.meta.state, GroupState::Stable);
}

// ---- readable shard set --------------------------------------------------------------------------

#[test]
fn a_new_readable_shard_bumps_the_group_epoch_and_is_assigned() {
    let mut f = Fixture::new(2);
    f.join("a");
    f.beat("a", 1, &[0, 1]);
    f.stream = StreamView {
        metadata_version: 2,
        shard_count: 3,
        readable: [0, 1, 2].into(),
        shard_index_bound: 3,
    };
    let a = f.beat("a", 1, &[0, 1]);
    assert_eq!(a.assigned_shards, vec![0, 1, 2]);
    assert_eq!(
        (a.group_epoch, a.member_epoch, a.metadata_version),
        (2, 2, 2)
    );
    // Scale-in: shard 2 drained and retired.
    f.stream = StreamView {
        metadata_version: 3,
        shard_count: 2,
        readable: [0, 1].into(),
        shard_index_bound: 3,
    };
    let a = f.beat("a", 2, &[0, 1, 2]);
    assert_eq!(a.assigned_shards, vec![0, 1]);
    assert_eq!(a.group_epoch, 3);
}

// ---- lost metadata ---------------------------------------------------------------------------------

#[test]
fn lost_metadata_starts_one_correction_round_above_every_fence() {
    let mut f = Fixture::new(2);
    f.join("a");
    f.beat("a", 1, &[0, 1]);
    let lost = f.group.clone();
    // Writes after this snapshot are lost: a moved on to epoch 5 and raised fences with it.
    let stale_fence = crate::fence::FenceToken {
        incarnation: T0,
        member_epoch: 5,
        member_id: "a".into(),
        process_id: "p-a".into(),
    };
    f.group = lost;
    f.advance_ms(1000);
    let evidence = HeartbeatRequest {
        request_seq: 99,
        ..request("a", "p-a", 5, &[0, 1])
    };
    assert_eq!(f.send_raw(&evidence), Err(CoordinatorError::FencesRequired));
    let fences: BTreeMap<ShardIndex, crate::fence::FenceToken> =
        [(0, stale_fence.clone()), (1, stale_fence)].into();
    let ctx = Context {
        now: f.now,
        stream: &f.stream,
        fences: Some(&fences),
    };
    let r = heartbeat(&mut f.group, &evidence, &ctx, &f.config).unwrap();
    f.seqs.insert("p-a".into(), evidence.request_seq);
    assert_eq!(r.status, HeartbeatStatus::SyncMetadata);
    assert!(r.incarnation > T0);
    assert!(r.member_epoch > 5, "epochs restart above any found");
    assert_eq!(r.assigned_shards, vec![0, 1]);
    // A joiner during the round is registered but gets nothing.
    let b = f.join("b");
    assert_eq!(
        (b.status, b.assigned_shards.clone()),
        (HeartbeatStatus::RevokePending, vec![])
    );
    // The round lasts a lease TTL and until every live member heartbeated on the new incarnation.
    let mut a_epoch = r.member_epoch;
    let mut b_epoch = b.member_epoch;
    let end = f.now + LEASE;
    while f.now < end {
        f.advance_ms(3000);
        let a = f.beat("a", a_epoch, &[0]);
        let b = f.beat("b", b_epoch, &[]);
        (a_epoch, b_epoch) = (a.member_epoch, b.member_epoch);
        if f.now < end {
            assert_eq!(a.status, HeartbeatStatus::SyncMetadata);
        }
    }
    f.advance_ms(1);
    let a = f.send(HeartbeatRequest {
        revoking_shards: revoking(&[1], RevokeState::Revoked),
        ..request("a", "p-a", a_epoch, &[0])
    });
    assert_eq!(a.status, HeartbeatStatus::Ok);
    assert_eq!(f.group.meta.correction_round, None);
    let b = f.beat("b", b_epoch, &[]);
    assert_eq!(
        (b.status, b.assigned_shards),
        (HeartbeatStatus::Ok, vec![1])
    );
}

/// Issue 14, finding 8: a fence at the top of the counters (built by hand: `FenceToken::decode`
/// refuses such values) must not overflow `highest + 1` (a panic in debug, a wrap in release and
/// a correction round that never ends): the round is refused with a typed error and nothing
/// changes; a request carrying such counters is refused before anything is read.
#[test]
fn counters_at_the_limit_are_refused_not_overflowed() {
    let mut f = Fixture::new(2);
    f.join("a");
    f.beat("a", 1, &[0, 1]);
    let before = f.group.clone();
    let evidence = HeartbeatRequest {
        request_seq: 99,
        ..request("a", "p-a", 5, &[0, 1])
    };
    for (incarnation, epoch, field) in [
        (u64::MAX, 5, "incarnation"),
        (T0, Epoch::MAX, "groupEpoch"),
        (COUNTER_LIMIT - 1, 5, "incarnation"),
    ] {
        let token = crate::fence::FenceToken {
            incarnation,
            member_epoch: epoch,
            member_id: "z".into(),
            process_id: "p-z".into(),
        };
        let fences: BTreeMap<ShardIndex, crate::fence::FenceToken> = [(0, token)].into();
        let ctx = Context {
            now: f.now,
            stream: &f.stream,
            fences: Some(&fences),
        };
        let mut group = before.clone();
        let result = heartbeat(&mut group, &evidence, &ctx, &f.config);
        assert!(
            matches!(&result, Err(CoordinatorError::CounterAtLimit { field: got, .. }) if *got == field),
            "{incarnation}:{epoch}: {result:?}"
        );
    }
    // In the request itself: refused by validation, group unchanged.
    for bad in [
        HeartbeatRequest {
            fence_conflicts: vec![FenceConflict {
                shard_index: 0,
                incarnation: u64::MAX,
                epoch: 1,
            }],
            ..request("a", "p-a", 1, &[0, 1])
        },
        HeartbeatRequest {
            fence_conflicts: vec![FenceConflict {
                shard_index: 0,
                incarnation: T0,
                epoch: Epoch::MAX,
            }],
            ..request("a", "p-a", 1, &[0, 1])
        },
        request("a", "p-a", Epoch::MAX, &[0, 1]),
        HeartbeatRequest {
            request_seq: u64::MAX,
            ..request("a", "p-a", 1, &[0, 1])
        },
    ] {
        let result = f.send_raw(&bad);
        assert!(
            matches!(result, Err(CoordinatorError::CounterAtLimit { .. })),
            "{result:?}"
        );
        assert_eq!(f.group, before);
    }
}

// ---- JSON shape ------------------------------------------------------------------------------------

#[test]
fn group_metadata_uses_the_field_names_of_the_design() {
    let mut f = Fixture::new(2);
    f.join("member-a");
    let json = serde_json::to_value(&f.group.meta).unwrap();
    let keys: Vec<&str> = json
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    for key in [
        "streamPrefix",
        "consumerGroup",
        "incarnation",
        "groupEpoch",
        "metadataVersion",
        "assignmentEpoch",
        "state",
        "shardCount",
        "readableShardSet",
        "updatedAt",
        "lastTransitionAt",
        "targetAssignment",
    ] {
        assert!(keys.contains(&key), "missing {key} in {keys:?}");
    }
    assert_eq!(json["state"], "RECONCILING");
    assert_eq!(
        json["targetAssignment"]["members"]["member-a"],
        serde_json::json!([0, 1])
    );
    assert_eq!(json["readableShardSet"], serde_json::json!([0, 1]));
    let member = serde_json::to_value(f.member("member-a")).unwrap();
    assert_eq!(member["state"], "ACTIVE");
    assert_eq!(member["assignedShards"], serde_json::json!([0, 1]));
    let back: GroupMetadata = serde_json::from_value(json).unwrap();
    assert_eq!(back, f.group.meta);
    let response =
        serde_json::to_value(f.member("member-a").last_response.clone().unwrap()).unwrap();
    assert_eq!(response["status"], "OK");
    assert_eq!(response["heartbeatIntervalMs"], 3000);
}

#[test]
fn more_members_than_shards_reach_stable_and_stay() {
    let mut f = Fixture::new(1);
    let mut epochs = BTreeMap::new();
    for m in ["a", "b", "c"] {
        epochs.insert(m, f.join(m).member_epoch);
    }
    for _ in 0..2 {
        for m in ["a", "b", "c"] {
            let owned: Vec<ShardIndex> =
                f.group.members[m].assigned_shards.iter().copied().collect();
            epochs.insert(m, f.beat(m, epochs[m], &owned).member_epoch);
        }
    }
    assert_eq!(f.group.meta.state, GroupState::Stable);
    let fingerprint = |f: &Fixture| {
        let meta = &f.group.meta;
        let members: Vec<Epoch> = f.group.members.values().map(|m| m.member_epoch).collect();
        (meta.group_epoch, meta.assignment_epoch, members)
    };
    let before = fingerprint(&f);
    for _ in 0..10 {
        f.advance_ms(3000);
        for m in ["a", "b", "c"] {
            let owned: Vec<ShardIndex> =
                f.group.members[m].assigned_shards.iter().copied().collect();
            let r = f.beat(m, epochs[m], &owned);
            assert_eq!(r.status, HeartbeatStatus::Ok);
        }
        assert_eq!(f.group.meta.state, GroupState::Stable);
        assert_eq!(fingerprint(&f), before);
    }
    let owners: Vec<&String> = f.group.meta.target_assignment.members.keys().collect();
    assert_eq!(
        owners,
        vec!["a"],
        "the one shard stays with its first owner"
    );
}
