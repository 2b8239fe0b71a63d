//! The coordinator: a pure, deterministic state machine (docs/design.md §4–§7).
//!
//! There is no coordinator server. Every decision is one call of [`heartbeat`] (or [`advance`]) on
//! a [`Group`] loaded from Redis, at the time `now` read by Redis `TIME` on the node that owns the
//! group key; the store writes back what changed under a compare-and-set (docs/design.md §5). This
//! module knows nothing of Redis: it is tested as a state machine, with property tests and a
//! deterministic simulation of many random histories that checks the invariants of docs/design.md
//! §4 after every step.
//!
//! The protocol follows Kafka's KIP-848 (group, assignment and member epochs; the coordinator
//! computes the target; members revoke before new owners are assigned; fencing by epoch; static
//! membership), adapted to a coordinator without a server: holdings and leases replace the
//! broker's session, and per-shard fences in Redis stop zombies (docs/design.md §8).

#[cfg(test)]
#[macro_use]
mod flags;

mod batch;
mod error;
mod transition;

#[cfg(test)]
mod invariants;
#[cfg(test)]
mod simulation;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

pub(crate) use batch::heartbeat_batch;
pub use error::{CoordinatorError, TimingsError};
pub use transition::{
    ShardHolders, SteadyMarker, Transition, advance, heartbeat, heartbeat_with_fences,
    next_deadline, request_fingerprint, steady_fingerprint, steady_response,
};
pub(crate) use transition::{base_response, member_lease_ttl_us};

use crate::model::{
    GroupMetadata, GroupState, MemberMetadata, Micros, ShardIndex, StreamMetadata, TargetAssignment,
};

/// The longest accepted protocol timing: a day. Longer values are surely mistakes, and would
/// overflow time arithmetic.
pub const MAX_TIMING: Duration = Duration::from_secs(24 * 60 * 60);

/// Timing settings of the protocol (config section `[coordination]`, docs/design.md §11).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CoordinatorConfig {
    /// How often members heartbeat (default 3 s). At most a third of `member_lease_ttl`.
    pub heartbeat_interval: Duration,
    /// How long a member's assignment lasts without a renewing heartbeat (default 15 s).
    pub member_lease_ttl: Duration,
    /// How long a member has to release shards it must give up before it is fenced (default 60 s).
    pub rebalance_timeout: Duration,
    /// How many EXPIRED / FENCED / LEFT members the history keeps (default 100).
    pub history_capacity: usize,
    #[cfg(test)]
    pub(crate) variant: Variant,
}

#[cfg(test)]
flags! {
    /// Known-wrong rules, re-introduced one at a time to show the simulation catches them (the
    /// founding design's executable model had the same ones).
    pub(crate) struct Variant {
        /// A shard sent as assigned but not yet reported does not block other members.
        ignore_sent,
        /// A fenced member's shards are handed out before its lease ends.
        no_lease_wait,
        /// A new process of a member gets the old process's shards at once.
        release_on_foreign_join,
        /// Only the last replaced process's holdings are remembered.
        single_ghost,
        /// A hand-out hold stays in the group after it has passed, so [`next_deadline`] keeps an
        /// instant in the past and the store's fast path falls back on every heartbeat
        /// (docs/design.md §5.5).
        hand_out_hold_forever,
        /// A steady response ([`steady_response`], the store's `fast:<id>` entries) carries the
        /// timings of the transition that wrote it, not the member's own (docs/design.md §6.5).
        writer_timings,
        /// The store's full transition applies the stream view its process read before the load
        /// even when the loaded group has a newer `metadataVersion` (no fresh re-read;
        /// docs/design.md §5.4). Only the simulation's store model follows it.
        stale_view_applied,
        /// `Writes::diff` leaves `fast:<id>` / `fastseq:<id>` / `fastworkers:<id>` in place for a
        /// member without a steady response (docs/design.md §5.3). Only the simulation's store
        /// model follows it.
        outdated_fast_entries,
        /// A fence conflict *at* the stored `(incarnation, groupEpoch)` counts as lost-metadata
        /// evidence, whoever reports it, so a zombie's late conflict starts a correction round
        /// (docs/design.md §6.6).
        evidence_at_stored_epoch,
    }
}

impl Default for CoordinatorConfig {
    fn default() -> Self {
        CoordinatorConfig {
            heartbeat_interval: Duration::from_secs(3),
            member_lease_ttl: Duration::from_secs(15),
            rebalance_timeout: Duration::from_secs(60),
            history_capacity: 100,
            #[cfg(test)]
            variant: Variant::default(),
        }
    }
}

impl CoordinatorConfig {
    /// Builds a configuration from the three timings; `history_capacity` keeps its default.
    ///
    /// # Errors
    /// [`TimingsError::Zero`] when a duration is zero; [`TimingsError::HeartbeatTooSlow`] when
    /// `heartbeat_interval` is above a third of `member_lease_ttl` (docs/design.md §5).
    pub fn new(
        heartbeat_interval: Duration,
        member_lease_ttl: Duration,
        rebalance_timeout: Duration,
    ) -> Result<Self, TimingsError> {
        let config = CoordinatorConfig {
            heartbeat_interval,
            member_lease_ttl,
            rebalance_timeout,
            ..CoordinatorConfig::default()
        };
        config.validate()?;
        Ok(config)
    }

    /// Checks the timings.
    ///
    /// # Errors
    /// As [`CoordinatorConfig::new`].
    pub fn validate(&self) -> Result<(), TimingsError> {
        for (name, value) in [
            ("heartbeat_interval", self.heartbeat_interval),
            ("member_lease_ttl", self.member_lease_ttl),
            ("rebalance_timeout", self.rebalance_timeout),
        ] {
            if value.is_zero() {
                return Err(TimingsError::Zero { name });
            }
        }
        for (name, value) in [
            ("heartbeat_interval", self.heartbeat_interval),
            ("member_lease_ttl", self.member_lease_ttl),
            ("rebalance_timeout", self.rebalance_timeout),
        ] {
            if value > MAX_TIMING {
                return Err(TimingsError::TooLong {
                    name,
                    max_secs: MAX_TIMING.as_secs(),
                });
            }
        }
        if self.heartbeat_interval.saturating_mul(3) > self.member_lease_ttl {
            return Err(TimingsError::HeartbeatTooSlow {
                heartbeat_ms: self.heartbeat_interval.as_millis(),
                lease_ms: self.member_lease_ttl.as_millis(),
            });
        }
        Ok(())
    }

    pub(crate) fn lease_ttl_us(&self) -> Micros {
        duration_us(self.member_lease_ttl)
    }
}

fn duration_us(d: Duration) -> Micros {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// What the coordinator needs of the stream metadata: read with every heartbeat (docs/design.md
/// §5).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamView {
    /// The stream's `metadataVersion`.
    pub metadata_version: u64,
    /// The stream's `shardCount`.
    pub shard_count: u32,
    /// ACTIVE and DRAINING shards.
    pub readable: BTreeSet<ShardIndex>,
    /// Exclusive upper bound of every shard index the stream has or had; a report of a shard at
    /// or above it is malformed.
    pub shard_index_bound: ShardIndex,
}

impl From<&StreamMetadata> for StreamView {
    fn from(stream: &StreamMetadata) -> Self {
        // Saturating: a shard index at u32::MAX is corrupt (the store refuses it when it loads
        // the metadata); here it must only not overflow.
        let highest = stream
            .shards
            .iter()
            .map(|s| s.shard_index.saturating_add(1))
            .max();
        StreamView {
            metadata_version: stream.metadata_version,
            shard_count: stream.shard_count,
            readable: stream.readable_shard_set(),
            shard_index_bound: highest.unwrap_or(0).max(stream.shard_count),
        }
    }
}

/// The inputs of one transition besides the group and the request.
#[derive(Debug, Clone, Copy)]
pub struct Context<'a> {
    /// Redis `TIME` of the node owning the group key, µs since the Unix epoch.
    pub now: Micros,
    /// The stream metadata as read with this heartbeat.
    pub stream: &'a StreamView,
}

/// One consumer group's whole coordinator state: what the store loads from
/// `sl:{<prefix>:<group>}:group`, `:leases` and `:history` (docs/design.md §2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    /// The `meta` field.
    pub meta: GroupMetadata,
    /// The `member:<id>` fields, by member id.
    pub members: BTreeMap<String, MemberMetadata>,
    /// EXPIRED / FENCED / LEFT members that hold nothing, newest first, capped at
    /// [`CoordinatorConfig::history_capacity`].
    pub history: VecDeque<MemberMetadata>,
}

impl Group {
    /// A new, empty group of `consumer_group` on `stream_prefix`, created at `now` (which becomes
    /// its `incarnation`), with the stream's current readable set.
    pub fn new(
        stream_prefix: &str,
        consumer_group: &str,
        stream: &StreamView,
        now: Micros,
    ) -> Self {
        let stamp = rfc3339(now);
        Group {
            meta: GroupMetadata {
                stream_prefix: stream_prefix.to_owned(),
                consumer_group: consumer_group.to_owned(),
                incarnation: now,
                group_epoch: 0,
                metadata_version: stream.metadata_version,
                assignment_epoch: 0,
                state: GroupState::Empty,
                shard_count: stream.shard_count,
                readable_shard_set: stream.readable.clone(),
                updated_at: stamp.clone(),
                last_transition_at: stamp,
                target_assignment: TargetAssignment::default(),
                hand_out_not_before: None,
                correction_round: None,
            },
            members: BTreeMap::new(),
            history: VecDeque::new(),
        }
    }

    /// The target shards of `member_id` (empty when it has none).
    pub fn target_of(&self, member_id: &str) -> &BTreeSet<ShardIndex> {
        static EMPTY: BTreeSet<ShardIndex> = BTreeSet::new();
        self.meta
            .target_assignment
            .members
            .get(member_id)
            .unwrap_or(&EMPTY)
    }
}

/// RFC 3339 text of a Redis `TIME` in µs, for the `...At` fields people read.
pub(crate) fn rfc3339(now: Micros) -> String {
    let time = std::time::UNIX_EPOCH + Duration::from_micros(now);
    humantime::format_rfc3339_micros(time).to_string()
}
