//! Admin operations on the simulated stream (docs/design.md §10).

use std::collections::BTreeSet;

use rand::Rng;

use super::{MAX_SHARDS, MS, World};
use crate::model::{ShardIndex, ShardState};

impl World {
    pub(super) fn admin_operation(&mut self) {
        // With the data plane modelled, retirement checks that the group read and acked
        // everything first (docs/design.md §10.2); the shards that pass, and the ones deleted.
        let entries = self.faults.entries;
        let drained: BTreeSet<ShardIndex> = self
            .stream
            .shards
            .keys()
            .copied()
            .filter(|s| !entries || self.shard_drained(*s))
            .collect();
        let mut deleted = Vec::new();
        let stream = &mut self.stream;
        let roll = self.rng.random_range(0..5u32);
        let done = match roll {
            0 if stream.migration.is_none() && stream.shard_count < MAX_SHARDS => {
                // Scale out: new (or retired) indexes become ACTIVE.
                let target = (stream.shard_count + self.rng.random_range(1..=2)).min(MAX_SHARDS);
                for shard in stream.shard_count..target {
                    stream.shards.insert(shard, ShardState::Active);
                }
                stream.shard_count = target;
                "scale out"
            }
            1 if stream.migration.is_none() && stream.shard_count > 1 => {
                // Scale in: shards at or above the target become DRAINING (still readable).
                let target = self.rng.random_range(1..stream.shard_count);
                let mut draining = BTreeSet::new();
                for (index, state) in stream.shards.iter_mut() {
                    if *index >= target && *state == ShardState::Active {
                        *state = ShardState::Draining;
                        draining.insert(*index);
                    }
                }
                stream.migration = Some((stream.shard_count, draining));
                stream.shard_count = target;
                "scale in"
            }
            2 if stream.migration.is_some() => {
                // Retirement, one stage at a time: DRAINING → RETIRING (leaves the readable
                // set) → RETIRED; the migration ends with its last shard.
                let draining: Vec<ShardIndex> = stream
                    .shards
                    .iter()
                    .filter(|(_, s)| **s == ShardState::Draining)
                    .map(|(i, _)| *i)
                    .collect();
                let ready: Vec<ShardIndex> = draining
                    .iter()
                    .copied()
                    .filter(|s| drained.contains(s))
                    .collect();
                if draining.is_empty() {
                    for (shard, state) in stream.shards.iter_mut() {
                        if *state == ShardState::Retiring {
                            *state = ShardState::Retired;
                            deleted.push(*shard);
                        }
                    }
                    stream.migration = None;
                    "retire: RETIRED"
                } else if ready.is_empty() {
                    return;
                } else {
                    for shard in ready {
                        stream.shards.insert(shard, ShardState::Retiring);
                    }
                    "retire: RETIRING"
                }
            }
            3 if stream.migration.as_ref().is_some_and(|(_, shards)| {
                shards
                    .iter()
                    .all(|s| stream.shards.get(s) == Some(&ShardState::Draining))
            }) =>
            {
                // Cancel: the migration's DRAINING shards become ACTIVE again.
                if let Some((from, shards)) = stream.migration.take() {
                    for shard in shards {
                        stream.shards.insert(shard, ShardState::Active);
                    }
                    stream.shard_count = from;
                }
                "cancel scale"
            }
            4 => {
                // Its members raise their own fields in the shards' fence hashes.
                self.data.other_groups = entries;
                "register another group"
            }
            _ => return,
        };
        stream.metadata_version += 1;
        self.stats.admin_ops += 1;
        let view = stream.view();
        self.log.push(format!(
            "t={} admin {done}: mv={} count={} readable={:?}",
            self.now / MS,
            view.metadata_version,
            view.shard_count,
            view.readable
        ));
        for shard in deleted {
            self.delete_shard(shard);
        }
    }
}
