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
