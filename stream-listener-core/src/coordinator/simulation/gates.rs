//! The read gates of this group as Redis keeps them (docs/design.md §8.16): one empty stream
//! `{<prefix>:<i>}:gate:<group>:<token>` per shard and fencing token, each listed in the shard's
//! registry `{<prefix>:<i>}:gates`. The registry is not modelled apart: it lists exactly the open
//! gates of its shard (a gate is never created without being listed, nor deleted without being
//! unlisted), and the loss of a fence key does not touch it.
//!
//! A strict read and a strict wait name the gate of their token; Redis fails them (`NOGROUP`)
//! when it is missing, and ends a wait blocked on it when it is deleted. Who opens and closes
//! gates:
//! - the check of a read transaction: one that passes creates every missing gate of its round
//!   (a deny-oom write), one that refuses deletes them all (`DEL`);
//! - the raise that writes a token into the fence field closes every other gate of the shard
//!   from the registry, whether the field held a lower token or was lost;
//! - consumer hygiene after a takeover's claims closes the other tokens' gates (best effort: it
//!   may fail, and safety must not need it);
//! - retirement deletes every gate of the shard.
//!
//! The known-wrong [`ReadVariant`]s `fixed_gate`, `raise_keeps_gates` and
//! `raise_from_empty_keeps_gates` change these rules.

use std::collections::BTreeSet;

use super::ReadVariant;
use crate::fence::FenceToken;
use crate::model::ShardIndex;

/// A gate: its shard and the encoded token in its name (empty for the one gate per shard of
/// [`ReadVariant::fixed_gate`]).
pub(super) type GateKey = (ShardIndex, String);

/// The gates that exist.
#[derive(Debug, Clone, Default)]
pub(super) struct Gates {
    open: BTreeSet<GateKey>,
}

impl Gates {
    /// The gate a reader of `shard` with `token` names.
    pub(super) fn key(shard: ShardIndex, token: &FenceToken, variant: ReadVariant) -> GateKey {
        if variant.fixed_gate {
            (shard, String::new())
        } else {
            (shard, token.encode())
        }
    }

    pub(super) fn is_open(&self, key: &GateKey) -> bool {
        self.open.contains(key)
    }

    /// `XGROUP CREATE … MKSTREAM` after the registry's `SADD`.
    pub(super) fn open(&mut self, key: GateKey) {
        self.open.insert(key);
    }

    /// `DEL` and `SREM`: never refused.
    pub(super) fn close(&mut self, key: &GateKey) {
        self.open.remove(key);
    }

    /// Every gate of `shard` but `keep` (the registry's `close_gates`).
    pub(super) fn close_others(&mut self, shard: ShardIndex, keep: Option<&GateKey>) {
        self.open.retain(|key| key.0 != shard || Some(key) == keep);
    }

    /// The gates a raise of `raiser` closes, as the raise script was accepted with the field
    /// holding `stored` (`None`: lost, or never written). The design closes every other token's
    /// gate from the registry, so that a gate left by a lost fence value closes too.
    pub(super) fn on_raise(
        &mut self,
        shard: ShardIndex,
        stored: Option<&FenceToken>,
        raiser: &FenceToken,
        variant: ReadVariant,
    ) {
        if variant.raise_keeps_gates {
            return;
        }
        if variant.fixed_gate {
            // One gate per shard, deleted by the raise of a new value (§12.1's candidate).
            if stored != Some(raiser) {
                self.close(&(shard, String::new()));
            }
            return;
        }
        if variant.raise_from_empty_keeps_gates {
            // Without a registry the raise can only name the stored token's gate.
            if let Some(stored) = stored.filter(|s| *s != raiser) {
                self.close(&Self::key(shard, stored, variant));
            }
            return;
        }
        let keep = Self::key(shard, raiser, variant);
        self.close_others(shard, Some(&keep));
    }

    /// The gates consumer hygiene closes after the claims of `owner`'s takeover: the other
    /// tokens' gates the registry lists; the one gate of [`ReadVariant::fixed_gate`], as the
    /// runtime did before gates were per token; none without a registry to list them
    /// ([`ReadVariant::raise_from_empty_keeps_gates`]).
    pub(super) fn on_hygiene(
        &mut self,
        shard: ShardIndex,
        owner: &FenceToken,
        variant: ReadVariant,
    ) {
        if variant.fixed_gate {
            self.close_others(shard, None);
        } else if !variant.raise_from_empty_keeps_gates {
            let own = Self::key(shard, owner, variant);
            self.close_others(shard, Some(&own));
        }
    }
}

/// A world for the gates' unit tests (`wait.rs`, `gate_read.rs`): one member process, and
/// `shards` whose fences hold `token` (as its last raise) with the token's gate open.
#[cfg(test)]
pub(super) fn one_member_holding(
    variant: ReadVariant,
    token: &FenceToken,
    shards: &[ShardIndex],
) -> super::World {
    let faults = super::Faults::default().with_data_plane();
    let mut world = super::World::new(1, crate::coordinator::Variant::default(), variant, faults);
    world.spawn_member();
    for &shard in shards {
        world.fences.insert(shard, token.clone());
        world.data.last_raised.insert(shard, token.clone());
        world.data.gates.open(Gates::key(shard, token, variant));
    }
    world
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::fixtures::fence_token as token;

    fn gates(keys: &[GateKey]) -> Gates {
        Gates {
            open: keys.iter().cloned().collect(),
        }
    }

    #[test]
    fn a_raise_closes_every_other_tokens_gate_even_after_a_lost_fence() {
        let design = ReadVariant::default();
        let (old, zombie, new) = (token(1, 4, "z"), token(1, 5, "a"), token(1, 6, "b"));
        let keys = [
            Gates::key(0, &old, design),
            Gates::key(0, &zombie, design),
            Gates::key(1, &zombie, design),
        ];
        // The field was lost: the raise finds nothing stored and still closes shard 0's gates.
        let mut open = gates(&keys);
        open.on_raise(0, None, &new, design);
        assert!(!open.is_open(&keys[0]) && !open.is_open(&keys[1]));
        assert!(open.is_open(&keys[2]), "another shard's gate stays");
        // Without the registry, only the stored token's gate closes.
        let variant = ReadVariant::with(&["raise_from_empty_keeps_gates"]);
        let mut open = gates(&keys);
        open.on_raise(0, None, &new, variant);
        assert!(open.is_open(&keys[1]));
        open.on_raise(0, Some(&zombie), &new, variant);
        assert!(!open.is_open(&keys[1]) && open.is_open(&keys[0]));
    }

    #[test]
    fn the_raisers_own_gate_stays_and_a_fixed_gate_is_shared_by_every_token() {
        let design = ReadVariant::default();
        let mine = token(1, 5, "a");
        let key = Gates::key(0, &mine, design);
        let mut open = gates(std::slice::from_ref(&key));
        open.on_raise(0, None, &mine, design);
        assert!(
            open.is_open(&key),
            "a raise again after LOWER keeps its gate"
        );
        let fixed = ReadVariant::with(&["fixed_gate"]);
        assert_eq!(
            Gates::key(0, &mine, fixed),
            Gates::key(0, &token(1, 6, "b"), fixed)
        );
    }
}
