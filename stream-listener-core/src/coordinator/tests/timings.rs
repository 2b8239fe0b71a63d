//! Re-provisioned groups and members with different timings (docs/design.md §6.5).

use super::*;
use crate::testing::fixtures::timings;

impl Fixture {
    /// A heartbeat run by a process whose `[coordination]` timings are `config`.
    fn send_with(
        &mut self,
        config: &CoordinatorConfig,
        request: HeartbeatRequest,
    ) -> HeartbeatResponse {
        let own = std::mem::replace(&mut self.config, config.clone());
        let response = self.send(request);
        self.config = own;
        response
    }

    /// `member` (process `p-<member>`) joins with `config` and reports the shards it was given
    /// as owned: the answer to that report.
    fn join_and_own(&mut self, config: &CoordinatorConfig, member: &str) -> HeartbeatResponse {
        let process = format!("p-{member}");
        let joined = self.send_with(config, request(member, &process, JOIN_EPOCH, &[]));
        let owned = joined.assigned_shards;
        self.send_with(
            config,
            request(member, &process, joined.member_epoch, &owned),
        )
    }
}

fn response_timings(r: &HeartbeatResponse) -> (u64, u64, u64) {
    (
        r.heartbeat_interval_ms,
        r.member_lease_ttl_ms,
        r.rebalance_timeout_ms,
    )
}

/// docs/design.md §5.5: the hand-out hold of a group re-provisioned after a loss ends: once it
/// has passed it is cleared, so `next_deadline` (the fast path's `steady` deadline) no longer
/// carries an instant in the past.
#[test]
fn a_passed_hand_out_hold_no_longer_counts_as_a_deadline() {
    for forever in [false, true] {
        let mut f = Fixture::new(2);
        f.config.variant.hand_out_hold_forever = forever;
        let hold = T0 + LEASE;
        f.group.meta.hand_out_not_before = Some(hold);
        let a = f.join("a");
        assert_eq!(a.assigned_shards, Vec::<ShardIndex>::new(), "held");
        assert_eq!(a.pending_shards, vec![0, 1]);
        f.advance_ms(15_000);
        let a = f.beat("a", a.member_epoch, &[]);
        assert_eq!(a.assigned_shards, vec![0, 1], "the hold has passed");
        f.beat("a", a.member_epoch, &[0, 1]);
        assert_eq!(f.group.meta.state, GroupState::Stable);
        if forever {
            // The known-wrong variant keeps the old behaviour, for the simulation.
            assert_eq!(next_deadline(&f.group), Some(hold));
        } else {
            assert_eq!(f.group.meta.hand_out_not_before, None);
            assert_eq!(next_deadline(&f.group), None);
        }
    }
}

/// docs/design.md §6.5: every response a member gets carries its own timings, whichever
/// member's transition computed it: the full answer, the steady answer the store's fast path
/// replays (computed with another member's config), and its revoke deadline.
#[test]
fn each_member_is_answered_with_its_own_timings() {
    let short = timings(300, 1_500, 6_000);
    let long = timings(1_000, 6_000, 20_000);
    let mut f = Fixture::new(4);
    let a = f.send_with(&short, request("a", "p-a", JOIN_EPOCH, &[]));
    assert_eq!(response_timings(&a), (300, 1_500, 6_000));
    let a = f.send_with(&short, request("a", "p-a", a.member_epoch, &[0, 1, 2, 3]));
    let b = f.send_with(&long, request("b", "p-b", JOIN_EPOCH, &[]));
    assert_eq!(response_timings(&b), (1_000, 6_000, 20_000));
    // a must give up two shards: its revoke deadline is its own rebalance timeout.
    let a = f.send_with(&short, request("a", "p-a", a.member_epoch, &[0, 1, 2, 3]));
    assert_eq!(response_timings(&a), (300, 1_500, 6_000));
    assert_eq!(f.member("a").revoke_deadline, Some(f.now + 6_000 * MS));
    let kept = a.assigned_shards.clone();
    let a = f.send_with(
        &short,
        HeartbeatRequest {
            revoking_shards: revoking(
                &[0, 1, 2, 3]
                    .into_iter()
                    .filter(|s| !kept.contains(s))
                    .collect::<Vec<_>>(),
                RevokeState::Revoked,
            ),
            ..request("a", "p-a", a.member_epoch, &kept)
        },
    );
    let b = f.send_with(&long, request("b", "p-b", b.member_epoch, &[]));
    let b = f.send_with(
        &long,
        request("b", "p-b", b.member_epoch, &b.assigned_shards),
    );
    assert_eq!(response_timings(&b), (1_000, 6_000, 20_000));
    assert_eq!(f.group.meta.state, GroupState::Stable);
    assert_eq!(
        f.member("a").member_lease_expires_at - f.member("a").last_heartbeat_at,
        1_500 * MS
    );
    assert_eq!(
        f.member("b").member_lease_expires_at - f.member("b").last_heartbeat_at,
        6_000 * MS
    );
    // The steady answers, computed by either member's transition, carry each member's own.
    for writer in [&short, &long] {
        let a_steady = steady_response(&f.group, "a", writer, &ShardHolders::of(&f.group)).unwrap();
        let b_steady = steady_response(&f.group, "b", writer, &ShardHolders::of(&f.group)).unwrap();
        assert_eq!(response_timings(&a_steady), (300, 1_500, 6_000));
        assert_eq!(response_timings(&b_steady), (1_000, 6_000, 20_000));
        assert_eq!(a_steady.assigned_shards, a.assigned_shards);
    }
    // The known-wrong variant answers with the writer's timings, for the simulation.
    let mut wrong = short.clone();
    wrong.variant.writer_timings = true;
    let b_steady = steady_response(&f.group, "b", &wrong, &ShardHolders::of(&f.group)).unwrap();
    assert_eq!(response_timings(&b_steady), (300, 1_500, 6_000));
}

/// docs/design.md §6.5: the outage re-arm judges each member by its own lease TTL. Redis was
/// unreachable for 3.4 s: the short-lease member's lease ran out, the long-lease member's did
/// not. Judged by the short TTL of the first transition after it, the long-lease member looked
/// renewed in the future, no outage was seen, and the short-lease member was expired.
#[test]
fn an_outage_is_judged_by_each_members_own_lease() {
    let short = timings(300, 1_500, 6_000);
    let long = timings(1_000, 6_000, 20_000);
    let mut f = Fixture::new(2);
    let a = f.join_and_own(&short, "a");
    let b = f.send_with(&long, request("b", "p-b", JOIN_EPOCH, &[]));
    let a = f.send_with(
        &short,
        HeartbeatRequest {
            revoking_shards: revoking(&[1], RevokeState::Revoked),
            ..request("a", "p-a", a.member_epoch, &[0])
        },
    );
    let b = f.send_with(&long, request("b", "p-b", b.member_epoch, &[]));
    let b = f.send_with(&long, request("b", "p-b", b.member_epoch, &[1]));
    f.advance_ms(100);
    let a = f.send_with(&short, request("a", "p-a", a.member_epoch, &[0]));
    assert_eq!(f.group.meta.state, GroupState::Stable);
    let epoch = f.group.meta.group_epoch;
    f.advance_ms(3_400);
    let a = f.send_with(&short, request("a", "p-a", a.member_epoch, &[0]));
    assert_eq!(
        (a.status, a.assigned_shards.clone()),
        (HeartbeatStatus::Ok, vec![0]),
        "the outage expired no one"
    );
    assert_eq!(f.group.meta.group_epoch, epoch);
    let b = f.send_with(&long, request("b", "p-b", b.member_epoch, &[1]));
    assert_eq!(b.status, HeartbeatStatus::Ok);
    assert_eq!(f.group.meta.state, GroupState::Stable);
}

/// The other side of the per-member rule: a short-lease member that stopped is expired on its
/// own lease while a long-lease member keeps renewing on its slower schedule (judging everyone
/// by the shortest TTL would see an outage at every slow heartbeat and extend the dead member
/// for ever).
#[test]
fn a_stopped_short_lease_member_expires_while_a_slow_one_heartbeats() {
    let short = timings(300, 1_500, 6_000);
    let long = timings(1_000, 6_000, 20_000);
    let mut f = Fixture::new(2);
    let mut a_epoch = f.join_and_own(&long, "a").member_epoch;
    let b = f.send_with(&short, request("b", "p-b", JOIN_EPOCH, &[]));
    assert_eq!(b.status, HeartbeatStatus::Ok);
    let stopped_at = f.now;
    let mut expired_at = None;
    for _ in 0..6 {
        f.advance_ms(1_000);
        let a = f.send_with(&long, request("a", "p-a", a_epoch, &[0]));
        a_epoch = a.member_epoch;
        let gone = f
            .group
            .members
            .get("b")
            .is_none_or(|m| m.state != MemberState::Active);
        if gone && expired_at.is_none() {
            expired_at = Some(f.now);
        }
    }
    let expired_at = expired_at.expect("the stopped member expired");
    assert!(
        expired_at - stopped_at <= 2_000 * MS,
        "expired on its own 1.5 s lease"
    );
}

/// docs/design.md §6.5: a correction round lasts the longest lease any known member runs with,
/// not the TTL of the transition that saw the evidence.
#[test]
fn a_correction_round_lasts_the_longest_members_lease() {
    let short = timings(300, 1_500, 6_000);
    let long = timings(1_000, 6_000, 20_000);
    let mut f = Fixture::new(2);
    f.join_and_own(&long, "a");
    let b = f.send_with(&short, request("b", "p-b", JOIN_EPOCH, &[]));
    f.advance_ms(100);
    let evidence = HeartbeatRequest {
        request_seq: 99,
        metadata_version: 7,
        ..request("b", "p-b", b.member_epoch, &[])
    };
    let fences = BTreeMap::new();
    let ctx = Context {
        now: f.now,
        stream: &f.stream,
    };
    let r = heartbeat_with_fences(&mut f.group, &evidence, &ctx, &fences, &short).unwrap();
    assert_eq!(r.status, HeartbeatStatus::SyncMetadata);
    let round = f.group.meta.correction_round.as_ref().unwrap();
    assert_eq!(round.not_before_end, f.now + 6_000 * MS);
}

/// The members' own timings are camelCase fields of the member JSON, and member metadata written
/// before they existed still loads (with `0`: the running transition's config stands in).
#[test]
fn member_timings_are_recorded_in_camel_case_and_old_members_still_load() {
    let mut f = Fixture::new(2);
    f.join("a");
    let mut json = serde_json::to_value(f.member("a")).unwrap();
    assert_eq!(json["heartbeatIntervalMs"], 3000);
    assert_eq!(json["memberLeaseTtlMs"], 15000);
    assert_eq!(json["rebalanceTimeoutMs"], 60000);
    let object = json.as_object_mut().unwrap();
    for key in [
        "heartbeatIntervalMs",
        "memberLeaseTtlMs",
        "rebalanceTimeoutMs",
    ] {
        object.remove(key);
    }
    let old: MemberMetadata = serde_json::from_value(json).unwrap();
    assert_eq!(
        (
            old.heartbeat_interval_ms,
            old.member_lease_ttl_ms,
            old.rebalance_timeout_ms
        ),
        (0, 0, 0)
    );
    f.group.members.insert("a".into(), old);
    let long = timings(1_000, 6_000, 20_000);
    let r = steady_response(&f.group, "a", &long, &ShardHolders::of(&f.group));
    // Not converged yet (nothing reported): check the full answer instead.
    assert!(r.is_none());
    let a = f.send_with(&long, request("a", "p-a", 1, &[]));
    assert_eq!(response_timings(&a), (1_000, 6_000, 20_000));
}
