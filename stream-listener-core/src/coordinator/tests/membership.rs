//! Join, converge, lost responses and retries, leave and static membership (docs/design.md §6).

use super::*;

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
    let mut f = Fixture::owned_by_a(4);
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
    let mut f = Fixture::owned_by_a(4);
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
    let mut f = Fixture::owned_by_a(4);
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
fn a_static_members_reservation_runs_one_lease_from_its_leave() {
    // A pod that stops just before its next heartbeat is due, and takes most of a lease to come
    // back: its reservation must run from the leave, not from the heartbeat before it.
    let mut f = Fixture::new(4);
    let with_instance = |r: HeartbeatRequest| HeartbeatRequest {
        instance_id: Some("pod-s".into()),
        ..r
    };
    f.send(with_instance(request("s", "p1", JOIN_EPOCH, &[])));
    f.send(with_instance(request("s", "p1", 1, &[0, 1, 2, 3])));
    f.join("b");
    f.send(HeartbeatRequest {
        revoking_shards: revoking(&[2, 3], RevokeState::Revoked),
        ..with_instance(request("s", "p1", 1, &[0, 1]))
    });
    f.beat("b", 2, &[]);
    f.beat("b", 2, &[2, 3]);
    let target_before = f.group.meta.target_assignment.members.clone();
    let epoch_before = f.group.meta.group_epoch;
    f.advance_ms(2_900);
    f.send(HeartbeatRequest {
        revoking_shards: revoking(&[0, 1], RevokeState::Revoked),
        ..with_instance(request("s", "p1", STATIC_LEAVE_EPOCH, &[]))
    });
    assert_eq!(f.member("s").member_lease_expires_at, f.now + LEASE);
    // Past one lease from the last heartbeat, within one lease of the leave.
    for _ in 0..4 {
        f.advance_ms(3_500);
        f.beat("b", 2, &[2, 3]);
    }
    let b = f.beat("b", 2, &[2, 3]);
    assert_eq!((b.assigned_shards, b.pending_shards), (vec![2, 3], vec![]));
    assert_eq!(f.member("s").state, MemberState::Active, "still reserved");
    let back = f.send(with_instance(request("s", "p2", JOIN_EPOCH, &[])));
    assert_eq!(
        (back.assigned_shards, back.pending_shards),
        (vec![0, 1], vec![])
    );
    assert_eq!(f.group.meta.target_assignment.members, target_before);
    assert_eq!(
        f.group.meta.group_epoch,
        epoch_before + 1,
        "only the rejoin's bump"
    );
}

#[test]
fn a_static_member_not_back_within_a_lease_of_its_leave_expires() {
    let mut f = Fixture::new(2);
    let with_instance = |r: HeartbeatRequest| HeartbeatRequest {
        instance_id: Some("pod-s".into()),
        ..r
    };
    f.send(with_instance(request("s", "p1", JOIN_EPOCH, &[])));
    f.send(with_instance(request("s", "p1", 1, &[0, 1])));
    f.join("b");
    f.send(HeartbeatRequest {
        revoking_shards: revoking(&[1], RevokeState::Revoked),
        ..with_instance(request("s", "p1", 1, &[0]))
    });
    f.beat("b", 2, &[1]);
    f.send(HeartbeatRequest {
        revoking_shards: revoking(&[0], RevokeState::Revoked),
        ..with_instance(request("s", "p1", STATIC_LEAVE_EPOCH, &[]))
    });
    // `b` heartbeats meanwhile (a group silent for half a lease looks like an outage, §5.2).
    for _ in 0..5 {
        f.advance_ms(3_000);
        f.beat("b", 2, &[1]);
    }
    f.advance_ms(1);
    let b = f.beat("b", 2, &[1]);
    assert!(!f.group.members.contains_key("s"), "expired and retired");
    assert_eq!(
        f.group.target_of("b").iter().copied().collect::<Vec<_>>(),
        vec![0, 1]
    );
    assert!(b.assigned_shards.contains(&1));
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
