//! Expiry, fencing, outages and a changed readable shard set (docs/design.md §6).

use super::*;

#[test]
fn an_expired_member_is_replaced_and_its_shards_move() {
    let mut f = Fixture::owned_by_a(2);
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
    let mut f = Fixture::owned_by_a(2);
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
    let mut f = Fixture::owned_by_a(2);
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
    let mut f = Fixture::owned_by_a(2);
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
