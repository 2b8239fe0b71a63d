//! The sticky assignor (docs/design.md §7).
//!
//! [`assign`] is a pure, deterministic function from (readable shard set, live members, previous
//! target) to a new target in which every readable shard has exactly one owner. It follows the idea
//! of KIP-848's uniform sticky assignor: compute a balanced quota per member first, then keep as
//! many previous assignments as the quotas allow and hand out only what is left, so that the number
//! of shards that change owner — each of which costs a revoke/drain/fence round (§6, §8) — is as
//! small as the quotas permit.
//!
//! The rules, in order (docs/design.md §7):
//!
//! 1. **Quotas.** Each member gets a quota proportional to its weight (its `runtimeMaxConcurrency`;
//!    0 counts as 1), rounded by largest remainder: every member first gets
//!    `⌊S·w/W⌋`, and the `S − Σ⌊S·w/W⌋` (< M) extra slots go to the members with the largest
//!    remainder `S·w mod W`. Among equal remainders an extra slot goes first to a member that would
//!    otherwise have to give up a shard (it owns more of the readable shards in the previous target
//!    than its rounded-down quota), then to the member owning more of the readable shards in the
//!    previous target, then by `memberId` ascending. With equal weights every quota is `⌊S/M⌋` or
//!    `⌈S/M⌉`, and the extra slots go to the members that already own the most shards, so an
//!    unchanged group moves nothing.
//! 2. **Stickiness.** Previous owners that are still live keep their previous shards up to their
//!    quota, lowest shard indexes first.
//! 3. **Left-over shards** — shards of departed members, shards without a previous owner, and shards
//!    over quota — are sorted by shard index.
//! 4. **Placement.** Each left-over shard, in that order, goes to the member with the lowest load
//!    relative to its quota (`load/quota`, compared exactly by cross-multiplication) among the
//!    members whose load is still below their quota; ties by `memberId` ascending.
//!
//! Rule 5 of §7 (a shard whose owner changes is *pending* for its new owner until released) is the
//! coordinator's business, not the assignor's.
//!
//! Cost: `O(S·log M + S·log P + M·log M)` for `S` readable shards, `M` members and `P` previous
//! entries (a binary heap drives rule 4; there is no `S × M` scan).

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap, HashSet};

/// One live member as the assignor sees it (docs/design.md §7: live members are `ACTIVE` members
/// with a valid lease plus static members away within their lease).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AssignorMember {
    /// The member id (`<base>-m0`...).
    pub member_id: String,
    /// Relative weight (the member's `runtimeMaxConcurrency`); 0 is treated as 1.
    pub weight: u32,
}

/// Shard index → owner, the target assignment (BTreeMap for deterministic iteration).
pub type Target = BTreeMap<u32, String>;

/// Computes the new target: every shard of `readable` assigned to exactly one of `members`.
///
/// `previous` is the previous target (shard → owner); owners not in `members` and shards not in
/// `readable` are ignored. Returns an empty map when `members` is empty.
///
/// Implements the sticky assignment of docs/design.md §7 (the idea of KIP-848's uniform sticky
/// assignor), see the module documentation (`internals::assignor`) for the exact rules:
/// quotas proportional to weights by largest remainder (extra slots on equal remainders to members
/// that would otherwise give a shard up, then to members owning more previous shards, then by
/// `memberId`); live previous owners keep their shards up to quota, lowest indexes first; the other
/// shards, by index, go to the member with the lowest `load/quota` below quota, ties by `memberId`.
///
/// Guarantees (property-tested below):
/// - deterministic, and independent of the order of `members`;
/// - every readable shard is assigned exactly once, to a member of `members`; nothing else is;
/// - each member's share is within one shard of `S·w/W` (with equal weights: `⌊S/M⌋` or `⌈S/M⌉`);
/// - idempotent: `assign(r, m, &assign(r, m, p)) == assign(r, m, p)` — an unchanged group moves
///   nothing;
/// - the shards moving away from a live member are exactly its previous readable shards above its
///   quota (its highest indexes), so [`moved_shards`] equals the shards of departed owners plus
///   `Σ max(0, previous count − quota)`; with equal weights, adding one member moves only the
///   shards the new member receives and removing one member moves only its shards.
///
/// Member ids must be unique: the caller guarantees it (checked by a `debug_assert!`). The function
/// stays total on invalid input: of several members with the same id, only the first is kept.
///
/// All arithmetic is done in `u64`/`u128`, so any shard count and any weights up to `u32::MAX`
/// are handled without overflow.
#[must_use]
pub fn assign(readable: &BTreeSet<u32>, members: &[AssignorMember], previous: &Target) -> Target {
    // Members sorted by id (rank = position), duplicates dropped keeping the first occurrence:
    // the stable sort keeps equal ids in input order and `dedup_by` keeps the first of a run.
    let mut sorted: Vec<&AssignorMember> = members.iter().collect();
    sorted.sort_by(|a, b| a.member_id.cmp(&b.member_id));
    let before = sorted.len();
    sorted.dedup_by(|later, first| later.member_id == first.member_id);
    debug_assert_eq!(before, sorted.len(), "assign: member ids must be unique");
    if sorted.is_empty() {
        return Target::new();
    }
    let rank_of: HashMap<&str, usize> = sorted
        .iter()
        .enumerate()
        .map(|(rank, m)| (m.member_id.as_str(), rank))
        .collect();

    // Previous live owner of each readable shard (by position in `readable`), and the number of
    // readable shards each live member owned.
    let previous_owner: Vec<Option<usize>> = readable
        .iter()
        .map(|shard| {
            previous
                .get(shard)
                .and_then(|owner| rank_of.get(owner.as_str()).copied())
        })
        .collect();
    let mut previous_count = vec![0u64; sorted.len()];
    for rank in previous_owner.iter().flatten() {
        previous_count[*rank] += 1;
    }

    // Rule 1: quotas.
    let quota = quotas(readable.len() as u64, &sorted, &previous_count);

    // Rule 2: live previous owners keep their shards up to quota, lowest indexes first (`readable`
    // iterates in ascending order). Rule 3: the rest, in index order.
    let mut load = vec![0u64; sorted.len()];
    let mut owner: Vec<usize> = vec![usize::MAX; readable.len()];
    let mut left_over: Vec<usize> = Vec::new();
    for (position, previous) in previous_owner.iter().enumerate() {
        match *previous {
            Some(rank) if load[rank] < quota[rank] => {
                load[rank] += 1;
                owner[position] = rank;
            }
            _ => left_over.push(position),
        }
    }

    // Rule 4: lowest load/quota among members below quota, ties by member id.
    let mut heap: BinaryHeap<Candidate> = (0..sorted.len())
        .filter(|&rank| load[rank] < quota[rank])
        .map(|rank| Candidate {
            load: load[rank],
            quota: quota[rank],
            rank,
        })
        .collect();
    for position in left_over {
        // Σ quota = S and every kept shard counts against its owner's quota, so the free slots
        // (Σ quota − load) are exactly the left-over shards: the heap cannot run dry here.
        let mut best = heap
            .pop()
            .expect("assign: quotas sum to the number of readable shards");
        owner[position] = best.rank;
        best.load += 1;
        if best.load < best.quota {
            heap.push(best);
        }
    }

    readable
        .iter()
        .zip(owner)
        .map(|(&shard, rank)| (shard, sorted[rank].member_id.clone()))
        .collect()
}

/// Whether [`assign`] would return `previous` unchanged, answered without running it: `previous`
/// (member id → its shards, the coordinator's target) covers every shard of `readable` exactly
/// once and nothing else, every owner is one of `members` with at least one shard, and each
/// member owns exactly its rule-1 quota. Then rule 2 keeps every shard where it is and rule 4 has
/// nothing to place, so `assign(readable, members, previous) == previous` (property-tested).
///
/// This is the common case of a join that does not change the live set, such as a static member
/// rejoining from a new process during a rolling restart: the group epoch moves, but the target
/// does not. The check costs one pass over `previous` with a set lookup per shard and a sort of
/// `members`, against the assignor's map building and string clones per shard (docs/design.md
/// §7). Returns `false` whenever it cannot tell cheaply (duplicate member ids, shards outside
/// `readable`, a shard owned twice): the caller then runs [`assign`].
#[must_use]
pub fn keeps_previous(
    readable: &BTreeSet<u32>,
    members: &[AssignorMember],
    previous: &BTreeMap<String, BTreeSet<u32>>,
) -> bool {
    let mut sorted: Vec<&AssignorMember> = members.iter().collect();
    sorted.sort_by(|a, b| a.member_id.cmp(&b.member_id));
    sorted.dedup_by(|later, first| later.member_id == first.member_id);
    if sorted.len() != members.len() {
        return false;
    }
    if sorted.is_empty() {
        return previous.is_empty();
    }
    let mut previous_count = vec![0u64; sorted.len()];
    let mut owned = 0usize;
    for (owner, shards) in previous {
        let Ok(rank) = sorted.binary_search_by(|m| m.member_id.as_str().cmp(owner.as_str())) else {
            return false;
        };
        if shards.is_empty() || !shards.iter().all(|s| readable.contains(s)) {
            return false;
        }
        previous_count[rank] = shards.len() as u64;
        owned += shards.len();
    }
    // Every owned shard is readable; with as many of them as readable shards and none owned
    // twice, they are the readable set.
    if owned != readable.len() || !owned_once(previous, owned) {
        return false;
    }
    quotas(readable.len() as u64, &sorted, &previous_count) == previous_count
}

/// Whether no shard is in two of `previous`'s sets (`owned` shards in all).
fn owned_once(previous: &BTreeMap<String, BTreeSet<u32>>, owned: usize) -> bool {
    let mut seen: HashSet<u32> = HashSet::with_capacity(owned);
    previous.values().flatten().all(|s| seen.insert(*s))
}

/// The number of shards that change owner between two targets: the shards of `next` whose owner
/// differs from their owner in `prev`. Shards absent from `prev` (newly readable, or unowned
/// before) do not count as moved, and neither do shards absent from `next` (no longer readable).
///
/// This is the cost the sticky assignor of docs/design.md §7 minimises: each moved shard needs a
/// revoke/drain by its old owner before its new owner may read it (§6 `pendingShards`).
#[must_use]
pub fn moved_shards(prev: &Target, next: &Target) -> usize {
    next.iter()
        .filter(|(shard, owner)| prev.get(shard).is_some_and(|old| old != *owner))
        .count()
}

/// Rule 1 of §7: quotas by largest remainder, for members sorted by id (`rank` = position).
fn quotas(shards: u64, members: &[&AssignorMember], previous_count: &[u64]) -> Vec<u64> {
    let weight = |m: &AssignorMember| u128::from(m.weight.max(1));
    let total: u128 = members.iter().map(|m| weight(m)).sum();
    let mut quota = Vec::with_capacity(members.len());
    let mut remainder = Vec::with_capacity(members.len());
    for m in members {
        let product = u128::from(shards) * weight(m);
        // ⌊S·w/W⌋ ≤ S, so it fits in u64.
        quota.push(u64::try_from(product / total).unwrap_or(u64::MAX));
        remainder.push(product % total);
    }
    let given: u64 = quota.iter().sum();
    let extra = usize::try_from(shards - given).unwrap_or(usize::MAX);
    if extra > 0 {
        // Needs the slot: without it the member would give up one of its previous shards.
        let needs = |rank: usize| previous_count[rank] > quota[rank];
        let mut order: Vec<usize> = (0..members.len()).collect();
        order.sort_by(|&a, &b| {
            remainder[b]
                .cmp(&remainder[a])
                .then_with(|| needs(b).cmp(&needs(a)))
                .then_with(|| previous_count[b].cmp(&previous_count[a]))
                .then_with(|| a.cmp(&b))
        });
        for &rank in order.iter().take(extra) {
            quota[rank] += 1;
        }
    }
    quota
}

/// A member below quota, ordered so that the max-heap's top is the member with the lowest
/// `load/quota` (exact cross-multiplication), ties by lowest rank (= lowest `memberId`).
#[derive(Debug, Clone, Copy)]
struct Candidate {
    load: u64,
    quota: u64,
    rank: usize,
}

impl Ord for Candidate {
    fn cmp(&self, other: &Self) -> Ordering {
        // self.load/self.quota < other.load/other.quota  ⇔  self is "greater" (served first).
        let mine = u128::from(self.load) * u128::from(other.quota);
        let theirs = u128::from(other.load) * u128::from(self.quota);
        theirs.cmp(&mine).then_with(|| other.rank.cmp(&self.rank))
    }
}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Candidate {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Candidate {}

#[cfg(test)]
mod tests;
