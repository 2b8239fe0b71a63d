//! Errors of the pure coordinator.

use crate::model::{Epoch, ShardIndex};

/// Why the coordinator refused a heartbeat request or could not finish a transition.
///
/// Validation errors (`UnsupportedProtocolVersion` .. `CounterAtLimit`) mean the request is
/// malformed: nothing was changed, and the member should log the error and fix its build or
/// report. `StaleRequestSeq` means the request arrived after a newer one of the same process:
/// it is ignored.
#[derive(Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CoordinatorError {
    /// The request speaks another protocol version.
    #[error(
        "unsupported protocolVersion {got}: this coordinator speaks version {supported}; run the same stream-listener version in every member"
    )]
    UnsupportedProtocolVersion {
        /// The version in the request.
        got: u32,
        /// The version this build speaks.
        supported: u32,
    },
    /// A required identifier is empty.
    #[error("heartbeat request has an empty {field}: every member must send a non-empty {field}")]
    EmptyField {
        /// `memberId` or `processId`.
        field: &'static str,
    },
    /// `memberEpoch` below `-2`.
    #[error(
        "memberEpoch {0} is invalid: send 0 to join, -1 to leave, -2 for a static leave, or the epoch the coordinator gave"
    )]
    InvalidMemberEpoch(Epoch),
    /// A shard appears twice in the report (in one list, or both owned and revoking).
    #[error("shard {shard} appears more than once in {field}: report each shard once")]
    DuplicateShard {
        /// The shard.
        shard: ShardIndex,
        /// Where it was repeated.
        field: &'static str,
    },
    /// A shard index the stream never had.
    #[error("shard {shard} in {field} is out of range: the stream has shard indexes 0..{bound}")]
    ShardOutOfRange {
        /// The shard.
        shard: ShardIndex,
        /// Where it was reported.
        field: &'static str,
        /// Exclusive upper bound of known shard indexes.
        bound: ShardIndex,
    },
    /// A counter at or above [`crate::model::COUNTER_LIMIT`] (2^62): in the request (an epoch, a
    /// sequence, a version, a fence conflict read from a corrupt fence), or met while starting a
    /// correction round. No real history reaches it, and the next incarnation or epoch could not
    /// be above it: nothing was changed.
    #[error(
        "{field} is {value}, at or above 2^62, which no real history reaches: it comes from a corrupt value (a fence field or metadata written by hand?); delete or fix that value"
    )]
    CounterAtLimit {
        /// The request field or counter (`memberEpoch`, `requestSeq`, `metadataVersion`,
        /// `fenceConflicts`, `incarnation`, `groupEpoch`).
        field: &'static str,
        /// The value, as text.
        value: String,
    },
    /// A request older than the last accepted one of the same process: ignored, nothing changed.
    #[error(
        "requestSeq {got} is below the last accepted {last} of this process: a delayed request, ignored"
    )]
    StaleRequestSeq {
        /// The request's sequence number.
        got: u64,
        /// The last accepted one.
        last: u64,
    },
}

crate::report::readable_debug!(CoordinatorError);

/// Invalid coordinator timing configuration.
#[derive(Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TimingsError {
    /// A duration that must be positive is zero.
    #[error("{name} must be greater than zero")]
    Zero {
        /// The setting.
        name: &'static str,
    },
    /// A duration above [`super::MAX_TIMING`].
    #[error("{name} is longer than {max_secs} s: use a shorter value")]
    TooLong {
        /// The setting.
        name: &'static str,
        /// The limit in seconds.
        max_secs: u64,
    },
    /// `heartbeat_interval` above a third of `member_lease_ttl`.
    #[error(
        "heartbeat_interval ({heartbeat_ms} ms) must be at most a third of member_lease_ttl ({lease_ms} ms), so a lost heartbeat or two does not expire a member; lower heartbeat_interval or raise member_lease_ttl"
    )]
    HeartbeatTooSlow {
        /// `heartbeat_interval` in ms.
        heartbeat_ms: u128,
        /// `member_lease_ttl` in ms.
        lease_ms: u128,
    },
}

crate::report::readable_debug!(TimingsError);
