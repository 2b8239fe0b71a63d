//! The data plane's invariants (docs/design.md §4.4, §8), and the record they need beside Redis:
//! which entries some process handled, and in which order they were first handled.
//!
//! - (a) **No loss**: an entry in no PEL and at or below the group's last-delivered id has been
//!   handled by someone. Entries leave a PEL only by `XACK`, so each acked id is checked after
//!   the step that acked it: an ack never removes an unhandled entry.
//! - (b) **No zombie reads or claims**: a process hands an entry to its handler only if the fence
//!   held its own token when its `EXEC` (or fenced script) delivered it, a blocking wait or a
//!   gate read delivers entries into a member's PEL only while the fence holds the member's token
//!   (handed over or not), and a claim moves entries only while the fence holds the claimer's token.
//! - (c) **Order**: per shard, entries are first handled in id order.
//! - (d) At the end of the fault-free phase, every appended entry has been handled and no PEL
//!   holds anything.

use std::collections::{BTreeMap, BTreeSet};

use super::entries::{EntryId, ShardEntries};
use crate::model::ShardIndex;

#[derive(Debug, Clone, Default)]
pub(super) struct Ledger {
    /// Per shard, the entries handled at least once.
    handled: BTreeMap<ShardIndex, BTreeSet<EntryId>>,
    /// Per shard, the highest entry handled so far.
    highest_first: BTreeMap<ShardIndex, EntryId>,
    /// Ids that left a PEL by `XACK` in this step, with who acked them.
    acked: Vec<(ShardIndex, EntryId, String)>,
    /// The first broken invariant, reported after the step.
    violation: Option<String>,
    pub(super) zombie_reads: u64,
    pub(super) zombie_claims: u64,
}

impl Ledger {
    fn violate(&mut self, message: String) {
        self.violation.get_or_insert(message);
    }

    /// (c): `who` hands `id` to its handler. Its first handling must come after every entry of
    /// the shard first handled before it.
    pub(super) fn handle(&mut self, shard: ShardIndex, id: EntryId, who: &str) -> bool {
        let first = self.handled.entry(shard).or_default().insert(id);
        if first {
            let highest = self.highest_first.entry(shard).or_default();
            let before = *highest;
            *highest = before.max(id);
            if id < before {
                self.violate(format!(
                    "order: {who} first handled entry {id} of shard {shard} after entry {before} was"
                ));
            }
        }
        first
    }

    /// (a): ids that `who`'s `XACK` removed from a PEL, checked after the step.
    pub(super) fn acked(&mut self, shard: ShardIndex, ids: &[EntryId], who: &str) {
        self.acked
            .extend(ids.iter().map(|id| (shard, *id, who.to_owned())));
    }

    /// (b): `who` hands `id` to its handler from a delivery made while the fence held `fence`,
    /// not its own token.
    pub(super) fn zombie_read(&mut self, shard: ShardIndex, id: EntryId, who: &str, fence: &str) {
        self.zombie_reads += 1;
        self.violate(format!(
            "zombie read: {who} handed entry {id} of shard {shard} to its handler, delivered while \
             the fence held {fence}"
        ));
    }

    /// (b): `who`'s `read` (its blocking wait, or its read through the gates) put `id` into
    /// its PEL while the fence held `fence`, not the token whose gates it named (or should have).
    pub(super) fn zombie_gated_read(
        &mut self,
        read: &str,
        shard: ShardIndex,
        id: EntryId,
        who: &str,
        fence: &str,
    ) {
        self.zombie_reads += 1;
        self.violate(format!(
            "zombie read: {who}'s {read} read entry {id} of shard {shard} into its PEL while the \
             fence held {fence}"
        ));
    }

    /// (b): `who`'s claim moved `ids` while the fence held `fence`, not its own token.
    pub(super) fn zombie_claim(
        &mut self,
        shard: ShardIndex,
        ids: &[EntryId],
        who: &str,
        fence: &str,
    ) {
        self.zombie_claims += 1;
        self.violate(format!(
            "zombie claim: {who} claimed entries {ids:?} of shard {shard} while the fence held \
             {fence}"
        ));
    }

    /// The invariants after a step: the first violation found, and (a) for the ids acked in it.
    pub(super) fn check_step(
        &mut self,
        shards: &BTreeMap<ShardIndex, ShardEntries>,
    ) -> Result<(), String> {
        for (shard, id, who) in std::mem::take(&mut self.acked) {
            let Some(entries) = shards.get(&shard) else {
                continue;
            };
            let handled = self.handled.get(&shard).is_some_and(|h| h.contains(&id));
            let pending = entries.pel.contains_key(&id);
            if !handled && !pending && id <= entries.last_delivered {
                self.violate(format!(
                    "loss: {who}'s XACK took entry {id} of shard {shard} out of every PEL \
                     (last-delivered {}), and no one handled it",
                    entries.last_delivered
                ));
            }
        }
        match &self.violation {
            Some(message) => Err(message.clone()),
            None => Ok(()),
        }
    }

    /// (d), at the end of the fault-free phase: every entry of every existing stream handled, and
    /// every PEL empty.
    pub(super) fn check_all_handled(
        &self,
        shards: &BTreeMap<ShardIndex, ShardEntries>,
        exists: impl Fn(ShardIndex) -> bool,
    ) -> Result<(), String> {
        for (shard, entries) in shards.iter().filter(|(s, _)| exists(**s)) {
            let handled = self.handled.get(shard);
            let unhandled: Vec<EntryId> = (1..=entries.last_id)
                .filter(|id| !handled.is_some_and(|h| h.contains(id)))
                .take(8)
                .collect();
            if !unhandled.is_empty() || !entries.pel.is_empty() {
                let pel: Vec<_> = entries.pel.iter().take(8).collect();
                return Err(format!(
                    "after the fault-free phase, shard {shard} (last id {}, last-delivered {}) has \
                     unhandled entries {unhandled:?} and pending {pel:?}",
                    entries.last_id, entries.last_delivered
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_first_handled_after_a_later_one_breaks_the_order() {
        let mut ledger = Ledger::default();
        let shards = BTreeMap::from([(0, ShardEntries::default())]);
        assert!(ledger.handle(0, 1, "p1"));
        assert!(ledger.handle(0, 3, "p1"));
        assert!(
            !ledger.handle(0, 1, "p2"),
            "a second handling is no first one"
        );
        assert!(ledger.check_step(&shards).is_ok());
        ledger.handle(0, 2, "p2");
        let report = ledger.check_step(&shards).unwrap_err();
        assert!(report.starts_with("order: p2 first handled entry 2 of shard 0 after entry 3"));
    }

    #[test]
    fn an_ack_of_an_unhandled_entry_is_a_loss() {
        let mut ledger = Ledger::default();
        let mut entries = ShardEntries::default();
        entries.append(2);
        entries.read_new("m1", 2);
        ledger.handle(0, 1, "p1");
        let removed = entries.ack([1, 2]);
        ledger.acked(0, &removed, "p1");
        let shards = BTreeMap::from([(0, entries)]);
        let report = ledger.check_step(&shards).unwrap_err();
        assert!(
            report.starts_with("loss: p1's XACK took entry 2 of shard 0"),
            "{report}"
        );
        assert!(ledger.check_all_handled(&shards, |_| true).is_err());
    }
}
