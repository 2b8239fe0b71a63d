//! The entries of one shard as Redis keeps them (docs/design.md §8): the shard's stream and its
//! one consumer group, with the group's last-delivered id and its PEL (entry → consumer). Every
//! operation is one Redis command (`XADD`, `XREADGROUP`, `XCLAIM … JUSTID`, `XACK`); what a
//! script or a transaction adds around them lives in `transaction.rs` and `redis_side.rs`.
//!
//! Entry ids are 1, 2, 3, … per shard and never reused, not even after a retirement deleted the
//! stream and a scale-out created it again (real ids are times, which move on as well).

use std::collections::BTreeMap;

/// An entry id of one shard's stream.
pub(super) type EntryId = u64;

/// One shard's stream and consumer group.
#[derive(Debug, Clone, Default)]
pub(super) struct ShardEntries {
    /// The last id appended.
    pub(super) last_id: EntryId,
    /// The group's last-delivered id: every entry up to it entered a PEL once.
    pub(super) last_delivered: EntryId,
    /// The group's PEL: entry → consumer (the member id, `ShardClient::consumer`).
    pub(super) pel: BTreeMap<EntryId, String>,
}

impl ShardEntries {
    /// `XADD`: `count` new entries.
    pub(super) fn append(&mut self, count: u64) {
        self.last_id += count;
    }

    /// `XREADGROUP … COUNT count STREAMS key >`: up to `count` entries after the last-delivered
    /// id, which enter `consumer`'s PEL.
    pub(super) fn read_new(&mut self, consumer: &str, count: u64) -> Vec<EntryId> {
        let first = self.last_delivered + 1;
        let last = self.last_id.min(self.last_delivered + count);
        let ids: Vec<EntryId> = (first..=last).collect();
        for id in &ids {
            self.pel.insert(*id, consumer.to_owned());
        }
        self.last_delivered = self.last_delivered.max(last);
        ids
    }

    /// `XREADGROUP … COUNT count STREAMS key <after>`: up to `count` of `consumer`'s own pending
    /// entries after `after` (a read from `0` pages through them).
    pub(super) fn read_pending(&self, consumer: &str, after: EntryId, count: u64) -> Vec<EntryId> {
        self.pel
            .range(after + 1..)
            .filter(|(_, owner)| owner.as_str() == consumer)
            .map(|(id, _)| *id)
            .take(usize::try_from(count).unwrap_or(usize::MAX))
            .collect()
    }

    /// `XPENDING` by consumer, then `XCLAIM … JUSTID` with idle 0: up to `count` pending entries
    /// of other consumers move to `consumer`.
    pub(super) fn claim_others(&mut self, consumer: &str, count: u64) -> Vec<EntryId> {
        let ids: Vec<EntryId> = self
            .pel
            .iter()
            .filter(|(_, owner)| owner.as_str() != consumer)
            .map(|(id, _)| *id)
            .take(usize::try_from(count).unwrap_or(usize::MAX))
            .collect();
        for id in &ids {
            self.pel.insert(*id, consumer.to_owned());
        }
        ids
    }

    /// `XACK`: the ids leave whichever PEL holds them (per entry, whoever sends it); returns those
    /// that were pending.
    pub(super) fn ack(&mut self, ids: impl IntoIterator<Item = EntryId>) -> Vec<EntryId> {
        ids.into_iter()
            .filter(|id| self.pel.remove(id).is_some())
            .collect()
    }

    /// What retirement checks before a shard becomes RETIRING (docs/design.md §10.2): nothing
    /// pending, and no entry after the last-delivered id.
    pub(super) fn drained(&self) -> bool {
        self.pel.is_empty() && self.last_delivered == self.last_id
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_claims_and_acks_move_entries_between_pels() {
        let mut shard = ShardEntries::default();
        shard.append(5);
        assert_eq!(shard.read_new("a", 2), vec![1, 2]);
        assert_eq!(shard.read_new("b", 2), vec![3, 4]);
        assert_eq!(shard.read_pending("a", 0, 10), vec![1, 2]);
        assert_eq!(shard.read_pending("a", 1, 10), vec![2]);
        assert_eq!(shard.claim_others("a", 1), vec![3]);
        assert_eq!(shard.read_pending("a", 0, 10), vec![1, 2, 3]);
        // Whoever acks, the entry leaves the PEL that holds it.
        assert_eq!(shard.ack([4, 9]), vec![4]);
        assert!(!shard.drained());
        assert_eq!(shard.read_new("a", 9), vec![5]);
        assert_eq!(shard.ack([1, 2, 3, 5]), vec![1, 2, 3, 5]);
        assert!(shard.drained());
    }
}
