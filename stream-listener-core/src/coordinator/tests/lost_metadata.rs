//! Lost metadata: the correction round and counters at their limit (docs/design.md §6.6).

use super::*;

#[test]
fn lost_metadata_starts_one_correction_round_above_every_fence() {
    let mut f = Fixture::owned_by_a(2);
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
    assert_eq!(f.transition(&evidence), Ok(Transition::NeedsFences));
    let fences: BTreeMap<ShardIndex, crate::fence::FenceToken> =
        [(0, stale_fence.clone()), (1, stale_fence)].into();
    let ctx = Context {
        now: f.now,
        stream: &f.stream,
    };
    let r = heartbeat_with_fences(&mut f.group, &evidence, &ctx, &fences, &f.config).unwrap();
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

/// docs/design.md §5.6: a fence at the top of the counters (built by hand: `FenceToken::decode`
/// refuses such values) must not overflow `highest + 1` (a panic in debug, a wrap in release and
/// a correction round that never ends): the round is refused with a typed error and nothing
/// changes; a request carrying such counters is refused before anything is read.
#[test]
fn counters_at_the_limit_are_refused_not_overflowed() {
    let mut f = Fixture::owned_by_a(2);
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
        };
        let mut group = before.clone();
        let result = heartbeat_with_fences(&mut group, &evidence, &ctx, &fences, &f.config);
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

/// A zombie's late fence conflict is no evidence of lost writes (docs/design.md §6.6): `a`
/// expires, `b` takes its shards at the current group epoch and raises their fences, and then
/// `a`, paused past its lease, wakes up, finds `b`'s fence on shard 1 and reports it. The fence
/// is exactly at the stored `(incarnation, groupEpoch)`, as every fence of a member at the
/// current epoch is. Before, "at or above" counted it as evidence and the zombie's report started
/// a correction round: every member answered `SYNC_METADATA` and joiners got nothing for a
/// lease TTL. Only a fence strictly above, or any conflict reported by the shard's holder, is
/// evidence.
#[test]
fn a_zombies_conflict_at_the_current_epoch_starts_no_correction_round() {
    let mut f = Fixture::owned_by_a(2);
    let a_epoch = f.member("a").member_epoch;
    f.advance_ms(1000);
    // b heartbeats on time (no outage to re-arm) until a's lease ends.
    let mut b_epoch = f.join("b").member_epoch;
    let a_lease = f.member("a").member_lease_expires_at;
    while f.now + 3000 * MS < a_lease {
        f.advance_ms(3000);
        b_epoch = f.beat("b", b_epoch, &[]).member_epoch;
    }
    f.now = a_lease;
    let b = f.beat("b", b_epoch, &[]);
    assert_eq!(b.assigned_shards, vec![0, 1]);
    let b = f.beat("b", b.member_epoch, &[0, 1]);
    assert_eq!(b.status, HeartbeatStatus::Ok);
    let stored = (f.group.meta.incarnation, f.group.meta.group_epoch);
    assert_eq!(
        stored.1, b.member_epoch,
        "b holds its shards at the group epoch"
    );

    f.advance_ms(500);
    let seq = f.seqs["p-a"] + 1;
    let zombie = HeartbeatRequest {
        request_seq: seq,
        fence_conflicts: vec![FenceConflict {
            shard_index: 1,
            incarnation: stored.0,
            epoch: stored.1,
        }],
        ..request("a", "p-a", a_epoch, &[0, 1])
    };
    let answered = f
        .transition(&zombie)
        .map(|t| t.response().map(|r| r.status));
    assert_eq!(answered, Ok(Some(HeartbeatStatus::UnknownMemberId)));
    assert_eq!(f.group.meta.correction_round, None);
    let b = f.beat("b", b.member_epoch, &[0, 1]);
    assert_eq!(b.status, HeartbeatStatus::Ok);
}

/// The other evidence a conflict gives (docs/design.md §6.6): the member the coordinator counts
/// as the shard's holder reports a conflict on it, at the stored `(incarnation, groupEpoch)` or
/// below it. No one can have been given that shard since it got it, unless writes were lost.
#[test]
fn a_holders_conflict_at_or_below_the_current_epoch_is_evidence() {
    for below in [0, 1] {
        let mut f = Fixture::owned_by_a(2);
        let a_epoch = f.member("a").member_epoch;
        let (incarnation, group_epoch) = (f.group.meta.incarnation, f.group.meta.group_epoch);
        f.advance_ms(1000);
        let holder = HeartbeatRequest {
            request_seq: f.seqs["p-a"] + 1,
            fence_conflicts: vec![FenceConflict {
                shard_index: 1,
                incarnation,
                epoch: group_epoch - below,
            }],
            ..request("a", "p-a", a_epoch, &[0, 1])
        };
        assert_eq!(
            f.transition(&holder),
            Ok(Transition::NeedsFences),
            "{below} below the group epoch"
        );
    }
}

/// docs/design.md §6.6, "Evidence during a round" (found by the simulation, seed 1668 of the
/// long run): lost writes can put the group back inside a correction round that had already
/// ended in the lost timeline, after members were given shards with tokens of the round's own
/// incarnation. Such a token cannot exist while the round runs (no one starts a shard during a
/// round, and its incarnation is above every fence found when it began), nor can a member epoch
/// above the stored group epoch: both are evidence of lost writes, and start a new round with a
/// higher incarnation, whose end gives every holder a new token. Ignoring them left two members
/// parked on `HIGHER` for good, with their shards read by nobody. A conflict below the round's
/// incarnation (raised before the round) is not evidence during the round.
#[test]
fn during_a_correction_round_a_token_of_its_own_incarnation_is_evidence_of_lost_writes() {
    let mut f = Fixture::owned_by_a(2);
    f.advance_ms(1000);
    let evidence = HeartbeatRequest {
        request_seq: 99,
        ..request("a", "p-a", 5, &[0, 1])
    };
    assert_eq!(f.transition(&evidence), Ok(Transition::NeedsFences));
    let ctx = Context {
        now: f.now,
        stream: &f.stream,
    };
    let r =
        heartbeat_with_fences(&mut f.group, &evidence, &ctx, &BTreeMap::new(), &f.config).unwrap();
    f.seqs.insert("p-a".into(), evidence.request_seq);
    assert_eq!(r.status, HeartbeatStatus::SyncMetadata);
    let round = f.group.meta.incarnation;
    assert!(f.group.meta.correction_round.is_some());
    f.advance_ms(1000);
    let with_conflict = |incarnation, seq| HeartbeatRequest {
        request_seq: seq,
        fence_conflicts: vec![FenceConflict {
            shard_index: 1,
            incarnation,
            epoch: r.member_epoch,
        }],
        ..request("a", "p-a", r.member_epoch, &[0, 1])
    };
    assert_ne!(
        f.transition(&with_conflict(round - 1, 100)),
        Ok(Transition::NeedsFences),
        "a fence from before the round is no evidence during it"
    );
    assert_eq!(
        f.transition(&with_conflict(round, 101)),
        Ok(Transition::NeedsFences),
        "a token of the round's own incarnation"
    );
    let above = HeartbeatRequest {
        request_seq: 102,
        ..request("a", "p-a", f.group.meta.group_epoch + 1, &[0, 1])
    };
    assert_eq!(
        f.transition(&above),
        Ok(Transition::NeedsFences),
        "a member epoch above the stored group epoch"
    );
}
