//! Tests of the sticky assignor (docs/design.md §7): balance, stickiness, weights and moves.

use super::*;
use proptest::prelude::*;
use proptest::sample::Index;

fn members(spec: &[(&str, u32)]) -> Vec<AssignorMember> {
    spec.iter()
        .map(|&(id, weight)| AssignorMember {
            member_id: id.to_owned(),
            weight,
        })
        .collect()
}

fn shards(range: impl IntoIterator<Item = u32>) -> BTreeSet<u32> {
    range.into_iter().collect()
}

fn target(spec: &[(&str, &[u32])]) -> Target {
    spec.iter()
        .flat_map(|&(id, list)| list.iter().map(move |&s| (s, id.to_owned())))
        .collect()
}

/// Shards per member of `members` (0 for members owning nothing).
fn counts(t: &Target, members: &[AssignorMember]) -> BTreeMap<String, u64> {
    let mut out: BTreeMap<String, u64> = members.iter().map(|m| (m.member_id.clone(), 0)).collect();
    for owner in t.values() {
        *out.entry(owner.clone()).or_default() += 1;
    }
    out
}

// ---- unit tests with hand-computed targets ----

#[test]
fn proportional_split_from_scratch() {
    // S = 8, weights 1,1,2: quotas 2,2,4 exactly. Placement in index order by lowest load/quota,
    // ties by id: 0→a, 1→b (b 0/2 = c 0/4, b first), 2→c, 3→c (1/4 < 1/2), 4→a (a,b,c at 1/2),
    // 5→b, 6→c, 7→c.
    let m = members(&[("a", 1), ("b", 1), ("c", 2)]);
    let got = assign(&shards(0..8), &m, &Target::new());
    assert_eq!(
        got,
        target(&[("a", &[0, 4]), ("b", &[1, 5]), ("c", &[2, 3, 6, 7])])
    );
}

#[test]
fn equal_weights_extra_slot_by_member_id_from_scratch() {
    // S = 5, M = 2: quotas 3,2; with no history the extra slot goes to "a" (id order).
    // 0→a (tie), 1→b (0/2 < 1/3), 2→a (1/3 < 1/2), 3→b (2/3 > 1/2), 4→a (b full).
    let m = members(&[("b", 1), ("a", 1)]);
    let got = assign(&shards(0..5), &m, &Target::new());
    assert_eq!(got, target(&[("a", &[0, 2, 4]), ("b", &[1, 3])]));
}

#[test]
fn equal_weights_extra_slot_goes_to_bigger_previous_owner() {
    // Same group, but "b" already owns 3 shards: the extra slot is b's, nothing moves.
    let m = members(&[("a", 1), ("b", 1)]);
    let previous = target(&[("a", &[3, 4]), ("b", &[0, 1, 2])]);
    let got = assign(&shards(0..5), &m, &previous);
    assert_eq!(got, previous);
    assert_eq!(moved_shards(&previous, &got), 0);
}

#[test]
fn largest_remainder_wins_over_previous_ownership() {
    // S = 4, weights a=1, b=2: shares 4/3 and 8/3, floors 1,2, remainders 1,2 (of W = 3):
    // the extra slot is b's although a owned everything. a keeps its lowest shard.
    let m = members(&[("a", 1), ("b", 2)]);
    let previous = target(&[("a", &[0, 1, 2, 3])]);
    let got = assign(&shards(0..4), &m, &previous);
    assert_eq!(got, target(&[("a", &[0]), ("b", &[1, 2, 3])]));
    assert_eq!(moved_shards(&previous, &got), 3);
}

#[test]
fn equal_remainders_prefer_the_member_that_would_lose_a_shard() {
    // S = 3, weights x=1, y=5 (W = 6): shares 0.5 and 2.5, floors 0,2, both remainders 3.
    // x owns all 3 shards: without the extra slot it would lose one more, y would not gain one
    // less, so the slot is x's. Re-running on the result must move nothing, although y owns
    // more shards than x (a plain "owns more" tie-break would flip the slot and move a shard).
    let m = members(&[("x", 1), ("y", 5)]);
    let previous = target(&[("x", &[0, 1, 2])]);
    let got = assign(&shards(0..3), &m, &previous);
    assert_eq!(got, target(&[("x", &[0]), ("y", &[1, 2])]));
    assert_eq!(assign(&shards(0..3), &m, &got), got);
}

#[test]
fn unequal_weights_scale_out_follows_largest_remainder() {
    // S = 2, a=3, b=1: shares 1.5 and 0.5, equal remainders, no history → a gets the extra
    // slot by id: a owns both shards. z (weight 1) joins: W = 5, shares 1.2, 0.4, 0.4, floors
    // 1,0,0, the extra slot goes to the largest remainder (b and z: 2 of 5), b by id. So one
    // shard moves from a to b, not to the new member: with unequal weights, largest-remainder
    // rounding can move shards between old members on a scale-out (still exactly the shards
    // over the new quotas, see `assert_sticky`).
    let old = members(&[("a", 3), ("b", 1)]);
    let stable = assign(&shards(0..2), &old, &Target::new());
    assert_eq!(stable, target(&[("a", &[0, 1])]));
    let grown = members(&[("a", 3), ("b", 1), ("z", 1)]);
    let next = assign(&shards(0..2), &grown, &stable);
    assert_eq!(next, target(&[("a", &[0]), ("b", &[1])]));
    assert_eq!(moved_shards(&stable, &next), 1);
}

#[test]
fn shards_over_quota_and_of_departed_members_are_redistributed() {
    // a owned all 6 shards; b and c join: quotas 2,2,2. a keeps 0,1; 2..5 in order go to the
    // lowest load/quota: 2→b (tie with c, id), 3→c, 4→b, 5→c.
    let m = members(&[("a", 1), ("b", 1), ("c", 1)]);
    let previous = target(&[("a", &[0, 1, 2, 3, 4, 5])]);
    let got = assign(&shards(0..6), &m, &previous);
    assert_eq!(
        got,
        target(&[("a", &[0, 1]), ("b", &[2, 4]), ("c", &[3, 5])])
    );
    assert_eq!(moved_shards(&previous, &got), 4);

    // d departed: only its shards move, to the members below quota.
    let previous = target(&[("a", &[0, 10]), ("b", &[20, 30]), ("d", &[40, 50])]);
    let m = members(&[("a", 1), ("b", 1), ("c", 1)]);
    let got = assign(&shards([0, 10, 20, 30, 40, 50]), &m, &previous);
    assert_eq!(
        got,
        target(&[("a", &[0, 10]), ("b", &[20, 30]), ("c", &[40, 50])])
    );
}

#[test]
fn keeps_lowest_indexes_when_over_quota() {
    let m = members(&[("a", 1), ("b", 1)]);
    let previous = target(&[("a", &[9, 3, 7, 1])]);
    let got = assign(&shards([1, 3, 7, 9]), &m, &previous);
    assert_eq!(got, target(&[("a", &[1, 3]), ("b", &[7, 9])]));
}

#[test]
fn ignores_unknown_owners_and_unreadable_shards() {
    let m = members(&[("a", 1), ("b", 1)]);
    let previous = target(&[("a", &[1, 100]), ("ghost", &[2, 3]), ("b", &[4, 200])]);
    let got = assign(&shards([1, 2, 3, 4]), &m, &previous);
    // a keeps 1, b keeps 4; 2→a (tie 1/2, id), 3→b.
    assert_eq!(got, target(&[("a", &[1, 2]), ("b", &[3, 4])]));
    assert_eq!(moved_shards(&previous, &got), 2);
}

#[test]
fn empty_inputs() {
    let previous = target(&[("a", &[0])]);
    assert!(assign(&shards(0..10), &[], &previous).is_empty());
    assert!(assign(&BTreeSet::new(), &members(&[("a", 1)]), &previous).is_empty());
    // More members than shards: some members get nothing.
    let m = members(&[("a", 1), ("b", 1), ("c", 1)]);
    assert_eq!(
        assign(&shards([5]), &m, &Target::new()),
        target(&[("a", &[5])])
    );
    assert_eq!(
        assign(&shards([5]), &m, &target(&[("c", &[5])])),
        target(&[("c", &[5])])
    );
}

#[test]
fn zero_weight_counts_as_one() {
    let zero = members(&[("a", 0), ("b", 1), ("c", 2)]);
    let one = members(&[("a", 1), ("b", 1), ("c", 2)]);
    let got = assign(&shards(0..8), &zero, &Target::new());
    assert_eq!(got, assign(&shards(0..8), &one, &Target::new()));
    assert_eq!(
        counts(&got, &zero),
        BTreeMap::from([("a".into(), 2), ("b".into(), 2), ("c".into(), 4)])
    );
}

#[test]
fn huge_weights_do_not_overflow() {
    // Shares 1000·(2³²−1)/(2³³−1) ≈ 499.9999999 for a and b, ≈ 1.2e-7 for c: floors 499,499,0
    // and the two extra slots go to the larger remainders (a, b).
    let m = members(&[("a", u32::MAX), ("b", u32::MAX), ("c", 1)]);
    let readable = shards((0..1000).map(|i| i * 3 + 7));
    let got = assign(&readable, &m, &Target::new());
    assert_eq!(
        counts(&got, &m),
        BTreeMap::from([("a".into(), 500), ("b".into(), 500), ("c".into(), 0)])
    );

    // Shard indexes at the top of the u32 range and many heavy members.
    let m: Vec<AssignorMember> = (0..50)
        .map(|i| AssignorMember {
            member_id: format!("m{i}"),
            weight: u32::MAX - i,
        })
        .collect();
    let readable = shards((u32::MAX - 999)..=u32::MAX);
    let got = assign(&readable, &m, &Target::new());
    assert_eq!(got.len(), 1000);
    assert!(counts(&got, &m).values().all(|&c| c == 20));
}

#[test]
#[cfg_attr(debug_assertions, should_panic(expected = "member ids must be unique"))]
fn duplicate_member_ids_keep_the_first() {
    // Invalid input: debug builds assert; release builds keep the first "a" (weight 1).
    let m = members(&[("a", 1), ("b", 1), ("a", 3)]);
    let got = assign(&shards(0..4), &m, &Target::new());
    assert_eq!(
        got,
        assign(
            &shards(0..4),
            &members(&[("a", 1), ("b", 1)]),
            &Target::new()
        )
    );
}

#[test]
fn moved_shards_counts_owner_changes_only() {
    let prev = target(&[("a", &[0, 1, 2]), ("b", &[3])]);
    let next = target(&[("a", &[0]), ("b", &[1, 3]), ("c", &[2, 4, 5])]);
    // 1: a→b, 2: a→c moved; 0, 3 kept; 4, 5 new (absent from prev): not moved.
    assert_eq!(moved_shards(&prev, &next), 2);
    assert_eq!(moved_shards(&next, &prev), 2);
    assert_eq!(moved_shards(&prev, &prev), 0);
    assert_eq!(moved_shards(&Target::new(), &next), 0);
    assert_eq!(moved_shards(&prev, &Target::new()), 0);
}

// ---- property tests ----

/// Up to 200 non-contiguous shard indexes.
fn readable_sets() -> impl Strategy<Value = BTreeSet<u32>> {
    prop::collection::btree_set(0u32..400, 0..200)
}

/// 0..20 members `m0`, `m1`, … (string order differs from numeric order), in shuffled order,
/// with random weights 1..=5, or all the same weight.
fn member_lists() -> impl Strategy<Value = (Vec<AssignorMember>, bool)> {
    (0usize..20, any::<bool>(), 1u32..=5)
        .prop_flat_map(|(n, equal, same)| {
            prop::collection::vec(1u32..=5, n).prop_map(move |weights| {
                let list: Vec<AssignorMember> = weights
                    .into_iter()
                    .enumerate()
                    .map(|(i, w)| AssignorMember {
                        member_id: format!("m{i}"),
                        weight: if equal { same } else { w },
                    })
                    .collect();
                (list, equal)
            })
        })
        .prop_flat_map(|(list, equal)| (Just(list).prop_shuffle(), Just(equal)))
}

/// Random previous targets over shards 0..400 (so some are not readable), owned by `m0..m24`
/// (some not in the member list) and departed `gone*` members.
fn previous_targets() -> impl Strategy<Value = Target> {
    prop::collection::btree_map(0u32..400, 0usize..30, 0..300).prop_map(|map| {
        map.into_iter()
            .map(|(s, o)| {
                (
                    s,
                    if o < 25 {
                        format!("m{o}")
                    } else {
                        format!("gone{o}")
                    },
                )
            })
            .collect()
    })
}

/// Every readable shard assigned once, only readable shards, only to members.
fn assert_valid(readable: &BTreeSet<u32>, members: &[AssignorMember], got: &Target) {
    if members.is_empty() {
        assert!(got.is_empty());
        return;
    }
    assert!(
        got.keys().eq(readable.iter()),
        "assigned shards differ from the readable set"
    );
    assert!(
        got.values()
            .all(|o| members.iter().any(|m| &m.member_id == o)),
        "owner not a member"
    );
}

fn assert_balanced(
    readable: &BTreeSet<u32>,
    members: &[AssignorMember],
    got: &Target,
    equal: bool,
) {
    if members.is_empty() {
        return;
    }
    let s = readable.len() as u64;
    let n = members.len() as u64;
    let total: u128 = members.iter().map(|m| u128::from(m.weight.max(1))).sum();
    let c = counts(got, members);
    for m in members {
        let count = c[&m.member_id];
        if equal {
            assert!(
                count == s / n || count == s.div_ceil(n),
                "{} owns {count} of {s} / {n}",
                m.member_id
            );
        }
        // |count − S·w/W| < 1  ⇔  |count·W − S·w| < W.
        let lhs = u128::from(count) * total;
        let ideal = u128::from(s) * u128::from(m.weight.max(1));
        assert!(
            lhs.abs_diff(ideal) < total,
            "{} owns {count}, ideal {ideal}/{total}",
            m.member_id
        );
    }
}

/// The exact movement identity of rules 2–4: a live member keeps its lowest
/// `min(previous count, quota)` previous shards and loses the rest; no member both loses and
/// gains; `moved_shards` = shards of non-members + Σ max(0, previous count − quota).
fn assert_sticky(
    readable: &BTreeSet<u32>,
    members: &[AssignorMember],
    previous: &Target,
    got: &Target,
) {
    if members.is_empty() {
        return;
    }
    let c = counts(got, members);
    let mut expected_moves = 0u64;
    for m in members {
        let id = &m.member_id;
        let before: Vec<u32> = readable
            .iter()
            .copied()
            .filter(|s| previous.get(s) == Some(id))
            .collect();
        let quota = c[id];
        let keep = before.len().min(usize::try_from(quota).unwrap());
        for (i, s) in before.iter().enumerate() {
            assert_eq!(
                got[s] == *id,
                i < keep,
                "{id} shard {s}: keeps its lowest shards up to quota"
            );
        }
        let gained = got
            .iter()
            .filter(|&(s, o)| o == id && previous.get(s) != Some(id))
            .count();
        assert!(
            keep == before.len() || gained == 0,
            "{id} both loses and gains shards"
        );
        expected_moves += (before.len() as u64).saturating_sub(quota);
    }
    let departed = readable
        .iter()
        .filter(|s| {
            previous
                .get(s)
                .is_some_and(|o| !members.iter().any(|m| &m.member_id == o))
        })
        .count() as u64;
    assert_eq!(
        moved_shards(previous, got) as u64,
        departed + expected_moves
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn prop_deterministic_and_order_independent(
        readable in readable_sets(), (members, _equal) in member_lists(), previous in previous_targets(),
    ) {
        let got = assign(&readable, &members, &previous);
        prop_assert_eq!(&got, &assign(&readable, &members, &previous));
        let mut reversed = members.clone();
        reversed.reverse();
        prop_assert_eq!(&got, &assign(&readable, &reversed, &previous));
        let mut sorted = members.clone();
        sorted.sort_by(|a, b| a.member_id.cmp(&b.member_id));
        prop_assert_eq!(&got, &assign(&readable, &sorted, &previous));
    }

    #[test]
    fn prop_valid_balanced_sticky(
        readable in readable_sets(), (members, equal) in member_lists(), previous in previous_targets(),
    ) {
        let got = assign(&readable, &members, &previous);
        assert_valid(&readable, &members, &got);
        assert_balanced(&readable, &members, &got, equal);
        assert_sticky(&readable, &members, &previous, &got);
    }

    #[test]
    fn prop_unchanged_input_moves_nothing(
        readable in readable_sets(), (members, _equal) in member_lists(), previous in previous_targets(),
    ) {
        let stable = assign(&readable, &members, &previous);
        let again = assign(&readable, &members, &stable);
        prop_assert_eq!(moved_shards(&stable, &again), 0);
        prop_assert_eq!(&again, &stable);
    }

    #[test]
    fn prop_scale_out_moves_only_to_the_new_member(
        readable in readable_sets(), (members, equal) in member_lists(), previous in previous_targets(),
        new_weight in 1u32..=5,
    ) {
        let stable = assign(&readable, &members, &previous);
        let mut grown = members.clone();
        let weight = if equal { members.first().map_or(new_weight, |m| m.weight) } else { new_weight };
        grown.push(AssignorMember { member_id: "new".into(), weight });
        let next = assign(&readable, &grown, &stable);
        assert_valid(&readable, &grown, &next);
        assert_sticky(&readable, &grown, &stable, &next);
        if equal {
            // `stable` covers every readable shard unless the old group was empty.
            let new_count = next.iter().filter(|&(s, o)| o == "new" && stable.contains_key(s)).count();
            prop_assert_eq!(moved_shards(&stable, &next), new_count);
            for (s, o) in &next {
                prop_assert!(o == "new" || stable.get(s) == Some(o), "shard {} moved between old members", s);
            }
        }
    }

    #[test]
    fn prop_scale_in_moves_only_the_departed_members_shards(
        readable in readable_sets(), (members, equal) in member_lists(), previous in previous_targets(),
        gone in any::<Index>(),
    ) {
        prop_assume!(!members.is_empty());
        let stable = assign(&readable, &members, &previous);
        let mut shrunk = members.clone();
        let departed = shrunk.remove(gone.index(members.len())).member_id;
        let next = assign(&readable, &shrunk, &stable);
        assert_valid(&readable, &shrunk, &next);
        assert_sticky(&readable, &shrunk, &stable, &next);
        if equal && !shrunk.is_empty() {
            let departed_count = stable.values().filter(|o| **o == departed).count();
            prop_assert_eq!(moved_shards(&stable, &next), departed_count);
            for (s, o) in &stable {
                if *o != departed {
                    prop_assert_eq!(next.get(s), Some(o));
                }
            }
        }
    }

    #[test]
    fn prop_readable_set_changes(
        readable in readable_sets(), (members, equal) in member_lists(), previous in previous_targets(),
        added in prop::collection::btree_set(0u32..600, 0..100),
        removed in prop::collection::btree_set(0u32..400, 0..100),
    ) {
        let stable = assign(&readable, &members, &previous);

        // Growth: with equal weights no existing shard moves; in general exactly the shards
        // over the new quotas move (assert_sticky's identity).
        let grown: BTreeSet<u32> = readable.union(&added).copied().collect();
        let next = assign(&grown, &members, &stable);
        assert_valid(&grown, &members, &next);
        assert_balanced(&grown, &members, &next, equal);
        assert_sticky(&grown, &members, &stable, &next);
        if equal {
            prop_assert_eq!(moved_shards(&stable, &next), 0);
        }

        // Shrink: the identity still holds (some moves may be needed for balance).
        let shrunk: BTreeSet<u32> = readable.difference(&removed).copied().collect();
        let next = assign(&shrunk, &members, &stable);
        assert_valid(&shrunk, &members, &next);
        assert_balanced(&shrunk, &members, &next, equal);
        assert_sticky(&shrunk, &members, &stable, &next);
    }

    #[test]
    fn prop_keeps_previous_iff_assign_returns_it(
        readable in readable_sets(), (members, _equal) in member_lists(), previous in previous_targets(),
        change in 0usize..5, pick in any::<Index>(), weight in 1u32..=5,
    ) {
        // A random previous target rarely is a fixed point, so also try a fixed point and
        // small changes to it (a member more or less, a weight, a shard more or less).
        let stable = assign(&readable, &members, &previous);
        let (mut members2, mut readable2) = (members.clone(), readable.clone());
        match change {
            0 => {}
            1 => members2.push(AssignorMember { member_id: "new".into(), weight }),
            2 if !members2.is_empty() => { members2.remove(pick.index(members.len())); }
            3 if !members2.is_empty() => { members2[pick.index(members.len())].weight = weight; }
            _ => { readable2.insert(400 + weight); }
        }
        for (readable, members, previous) in [
            (&readable, &members, &previous),
            (&readable, &members, &stable),
            (&readable2, &members2, &stable),
        ] {
            let keeps = keeps_previous(readable, members, &by_member(previous));
            prop_assert_eq!(keeps, &assign(readable, members, previous) == previous);
        }
        prop_assert!(keeps_previous(&readable, &members, &by_member(&stable)));
    }
}

/// A target as the coordinator stores it: member id → its shards.
fn by_member(target: &Target) -> BTreeMap<String, BTreeSet<u32>> {
    let mut out: BTreeMap<String, BTreeSet<u32>> = BTreeMap::new();
    for (shard, owner) in target {
        out.entry(owner.clone()).or_default().insert(*shard);
    }
    out
}

#[test]
fn keeps_previous_refuses_a_shard_owned_twice_or_an_empty_entry() {
    let m = members(&[("a", 1), ("b", 1)]);
    let readable = shards(0..4);
    let twice: BTreeMap<String, BTreeSet<u32>> =
        [("a".into(), shards([0, 1])), ("b".into(), shards([1, 2]))].into();
    assert!(!keeps_previous(&readable, &m, &twice));
    let fixed: BTreeMap<String, BTreeSet<u32>> =
        [("a".into(), shards([0, 1])), ("b".into(), shards([2, 3]))].into();
    assert!(keeps_previous(&readable, &m, &fixed));
    let mut with_empty = fixed.clone();
    with_empty.insert("c".into(), BTreeSet::new());
    assert!(!keeps_previous(
        &readable,
        &members(&[("a", 1), ("b", 1), ("c", 1)]),
        &with_empty
    ));
}
