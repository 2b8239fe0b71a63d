//! The data plane's fenced shard operations (docs/design.md §8): raising a shard's fence, claiming
//! other consumers' pending entries at takeover, reading own pending and new entries, acking,
//! dead-lettering, and waiting for new entries without a group.
//!
//! Every read of pending entries (in [`FencingMode::Strict`]), lone ack and claim is one Lua
//! script that first checks that the shard's fence field (named after the consumer group) holds
//! exactly the caller's [`FenceToken`], and does nothing otherwise: a member that lost the shard
//! cannot read or claim there, whatever its clock says. A strict read of new entries is a
//! transaction with the same check inside it and a read gate (`round.rs`, docs/design.md §8.16).
//! Each script touches only the shard stream `{<prefix>:<i>}` and keys of its slot (its fence
//! `{<prefix>:<i>}:fence`, attempts hash, read gates; docs/design.md §2), so everything runs on
//! Redis Cluster. The comparison rules are those of [`FenceToken::raise`] and
//! [`FenceToken::check`].
//!
//! Reads never block (`BLOCK` is refused in scripts): when a `>` read finds nothing, the script
//! returns the stream's last entry id, and the caller waits from that id with a plain
//! `XREAD BLOCK` (no group): [`shared_wait`] for all of a member's shards on a standalone server,
//! [`Waiter::wait`] on a dedicated connection per shard on a cluster.
//!
//! Takeover of a shard, in order (docs/design.md §8): [`ShardClient::raise_fence`];
//! [`ShardClient::claim_others`] until its report is [`ClaimReport::complete`];
//! [`ShardClient::read_pending`] from `"0"`, moving the cursor to the last id returned, until it
//! returns no entries; then [`ShardClient::read_new`]. Entries whose body was trimmed or deleted
//! while pending come back as [`EntryStatus::Trimmed`]: ack and count them, never retry them.
//! No operation deletes a consumer that has pending entries (that would drop them): consumer
//! hygiene ([`ShardClient::clean_consumers`], docs/design.md §8.15) deletes only consumers
//! whose pending count is 0, checked in the script that deletes them.

mod error;
pub(crate) mod round;
pub(crate) mod scripts;
mod shard;
pub(crate) mod shared_wait;
mod slot;
mod waiter;

pub use error::DataPlaneError;
pub(crate) use shard::GroupRecreated;
pub use shard::{
    ConsumerSweep, KeepList, MAX_CLAIM_BATCH, ShardClient, delete_idle_consumers, read_keep_list,
};
pub use slot::key_slot;
pub use waiter::Waiter;

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::fence::{FenceToken, FenceVerdict};
use crate::model::{Epoch, Micros};

/// Which operations are fenced in Redis (docs/design.md §8, config key `fencing`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FencingMode {
    /// `"strict"` (default): reads, acks and claims all check the fence.
    #[default]
    Strict,
    /// `"acks"`: reads rely on the member's lease alone (no fence check: faster, but a paused
    /// process or a clock step can let a zombie read); acks and claims stay fenced.
    Acks,
}

/// Why an operation was refused: the shard's fence does not hold the caller's token. Nothing was
/// changed in Redis.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Fenced {
    /// The fence is absent or below the caller's `(incarnation, memberEpoch)`: a raise was lost
    /// (a failover, or Redis lost data). Re-check lease and assignment, raise again, retry.
    Lower,
    /// The fence holds a token at or above the caller's `(incarnation, memberEpoch)` that is not
    /// the caller's: another member owns the shard. Stop using it and report the conflict in
    /// `fenceConflicts` ([`Fenced::conflict`]). `found` is the stored token; `None` when the stored
    /// value is not a token at all (it is treated as higher: fail closed; an operator must fix or
    /// delete the fence field).
    Higher {
        /// The token the fence holds.
        found: Option<FenceToken>,
    },
}

impl Fenced {
    /// The verdict of docs/design.md §8 this refusal stands for (`LOWER` or `HIGHER`).
    pub fn verdict(&self) -> FenceVerdict {
        match self {
            Fenced::Lower => FenceVerdict::Lower,
            Fenced::Higher { .. } => FenceVerdict::Higher,
        }
    }

    /// For `fenceConflicts` (docs/design.md §6): the `(incarnation, epoch)` the fence holds, when
    /// it is higher and a readable token.
    pub fn conflict(&self) -> Option<(Micros, Epoch)> {
        match self {
            Fenced::Higher { found: Some(t) } => Some((t.incarnation, t.member_epoch)),
            _ => None,
        }
    }
}

/// What a read returned for one entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EntryStatus {
    /// The entry exists; its fields are in [`ShardEntry::fields`].
    Present,
    /// The entry was trimmed or deleted while pending (only from [`ShardClient::read_pending`]):
    /// no fields. Ack it and count it (`trimmed_before_ack`); never hand it to a handler.
    Trimmed,
    /// Its fields and values together are larger than the client's limit
    /// ([`ShardClient::with_max_entry_bytes`]): the body was not sent. Dead-letter it by id with
    /// [`DeadLetterReason::TooLarge`] and ack it (a huge entry).
    TooLarge {
        /// Total bytes of its field names and values.
        bytes: u64,
    },
}

/// One entry of a shard stream, as read for the group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardEntry {
    /// The stream entry id, `<ms>-<seq>`.
    pub id: String,
    /// Field/value pairs in stream order; empty unless [`EntryStatus::Present`]. Shared, not
    /// copied, with every [`crate::handler::Delivery`] of the entry.
    pub fields: Arc<[(String, Vec<u8>)]>,
    /// Deliveries of this entry to the group so far, this one included (the PEL's count; `1` for
    /// entries read with `>`). Above 1, the entry was delivered before: its handler attempts
    /// are counted with [`ShardClient::count_attempt`] and compared with `max_deliveries`
    /// (re-reads raise this count without any attempt).
    pub delivery_count: u64,
    /// Whether the body is here, trimmed, or withheld for its size.
    pub status: EntryStatus,
}

impl ShardEntry {
    /// The value of the first field named `name`.
    pub fn field(&self, name: &str) -> Option<&[u8]> {
        crate::handler::field(&self.fields, name)
    }
}

/// The result of a read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadOutcome {
    /// Entries in id order, at most the count asked for. From [`ShardClient::read_pending`], an
    /// empty list means nothing is pending after the cursor.
    Entries(Vec<ShardEntry>),
    /// Only from [`ShardClient::read_new`]: nothing new. `last_id` is the id of the stream's last
    /// entry (`"0-0"` when the stream is empty): wait with [`Waiter::wait`] from it.
    Empty {
        /// Where to wait from.
        last_id: String,
    },
    /// Refused by the fence (strict mode only); nothing was read.
    Fenced(Fenced),
}

/// What one [`ShardClient::claim_others`] call did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ClaimReport {
    /// Entries moved to the caller's PEL, delivery counts unchanged (`XCLAIM ... JUSTID`).
    pub claimed: usize,
    /// Ids requested whose entry had been trimmed or deleted: Redis dropped them from the PEL
    /// (they are no longer pending anywhere). Count them as `trimmed_before_ack`.
    pub trimmed: usize,
    /// `true` when no other consumer has pending entries left; `false` when the batch budget ran
    /// out first: call again.
    pub complete: bool,
}

/// The `reason` field of a dead letter (docs/design.md §8). The strings are stable: operators and
/// tools match on them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeadLetterReason {
    /// `"handler"`: the handler failed `max_attempts` times.
    Handler,
    /// `"non-retryable"`: the handler marked its error non-retryable.
    NonRetryable,
    /// `"decode"`: the payload could not be decoded.
    Decode,
    /// `"max-deliveries"`: `max_deliveries` handler attempts did not finish (the entry may crash
    /// the process).
    MaxDeliveries,
    /// `"too-large"`: the entry is larger than the limit (a huge entry).
    TooLarge,
}

impl DeadLetterReason {
    /// The stored string.
    pub fn as_str(self) -> &'static str {
        match self {
            DeadLetterReason::Handler => "handler",
            DeadLetterReason::NonRetryable => "non-retryable",
            DeadLetterReason::Decode => "decode",
            DeadLetterReason::MaxDeliveries => "max-deliveries",
            DeadLetterReason::TooLarge => "too-large",
        }
    }
}

impl std::fmt::Display for DeadLetterReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
