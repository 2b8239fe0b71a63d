//! A shard's fence key as `WATCH` sees it (docs/design.md §8.2; only the check outside the
//! transaction, `ReadVariant::check_outside_transaction`, watches it): the hash
//! `{<prefix>:<i>}:fence` holds one field per consumer group. This group's field is the world's
//! `fences` entry; here are the rest of the key: whether other groups' fields keep it in
//! existence, and a version that every write to the key bumps, so that a `WATCH` taken before can
//! tell that the key was touched (Redis's `touchWatchedKey`, also for the client that wrote it).

use crate::fence::FenceToken;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct FenceKey {
    /// Bumped by every write to the key: a raise that changes this group's field, another
    /// group's raise, a tripwire, the key's loss.
    pub(super) version: u64,
    /// Fields of other groups of the stream (or a denyoom tripwire's field) are in the hash.
    pub(super) other_fields: bool,
}

impl FenceKey {
    /// Whether the hash exists, given this group's field.
    pub(super) fn exists(&self, field: Option<&FenceToken>) -> bool {
        field.is_some() || self.other_fields
    }

    /// A write to the key: every `WATCH` on it taken before fails its `EXEC`.
    pub(super) fn touch(&mut self) {
        self.version += 1;
    }

    /// The whole hash is gone (a failover that lost it, an eviction, a `DEL` by hand).
    pub(super) fn lose(&mut self) {
        self.other_fields = false;
        self.touch();
    }
}
