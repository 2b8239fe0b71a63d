//! The protocol's data: stream, group and member metadata, the heartbeat request and response.
//!
//! Every type serialises to JSON with exactly the camelCase field names of docs/design.md §3 and
//! §6; operators see them in `describe`, and members in other processes (or languages) read them.
//! Times are microseconds since the Unix epoch as read by Redis `TIME` on the node that owns the
//! group key (never a process clock), except the `...At` strings, which are RFC 3339 for people.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

/// A shard index: shard `i` of prefix `p` is the stream `{p:i}` (docs/design.md §2).
pub type ShardIndex = u32;

/// A member id: `<base>-m<k>`, where `<base>` is a per-process UUIDv7 or the static `instance_id`.
pub type MemberId = String;

/// Microseconds since the Unix epoch, from Redis `TIME`.
pub type Micros = u64;

/// An epoch (group, assignment or member epoch). Signed because heartbeat requests use `0` (join),
/// `-1` (leave) and `-2` (static leave) as member epochs (docs/design.md §6).
pub type Epoch = i64;

/// Exclusive upper bound of every counter the coordinator reads from Redis: incarnations and
/// other µs times, epochs (by absolute value), `revision`, `leaseRevision`, `metadataVersion`,
/// `requestSeq`, fence tokens. 2^62: no real history comes near it (epochs and revisions grow
/// by a few per heartbeat), so a stored value at or above it is corrupt, and keeping below it
/// leaves room for every `+ 1` the coordinator does, in `u64` and in `i64` (docs/design.md
/// §5.6). Fence scripts compare tokens exactly as decimal strings, so tokens beyond 2^53
/// stay exact; only values Lua reads as numbers (the fast path's `fastseq`) fall back to the
/// full transition from 2^53 on.
pub const COUNTER_LIMIT: u64 = 1 << 62;

/// The heartbeat protocol version this build speaks. A request with another version is refused
/// with [`crate::coordinator::CoordinatorError::UnsupportedProtocolVersion`].
pub const PROTOCOL_VERSION: u32 = 1;

/// `memberEpoch` of a join request.
pub const JOIN_EPOCH: Epoch = 0;
/// `memberEpoch` of a leave request (KIP-848's `-1`).
pub const LEAVE_EPOCH: Epoch = -1;
/// `memberEpoch` of a static leave request (KIP-848's `-2`): the member keeps its target reserved
/// while its lease runs.
pub const STATIC_LEAVE_EPOCH: Epoch = -2;

/// Lifecycle of a shard stream (docs/design.md §3, §10).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ShardState {
    /// Producers route to it; members read it.
    Active,
    /// Scale-in: producers no longer route to it, members still read it until it is empty.
    Draining,
    /// Being deleted: no cancel after this point; still readable until retired.
    Retiring,
    /// Deleted; no longer readable.
    Retired,
}

impl ShardState {
    /// Whether members read a shard in this state: `ACTIVE` and `DRAINING` shards form the
    /// `readableShardSet` (docs/design.md §3). A `RETIRING` shard has passed the emptiness check
    /// and is about to be deleted, so nothing is left to read in it.
    pub fn is_readable(self) -> bool {
        matches!(self, ShardState::Active | ShardState::Draining)
    }
}

/// One shard of a stream and its state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ShardInfo {
    /// The shard index `i` of `{<prefix>:i}`.
    pub shard_index: ShardIndex,
    /// Its lifecycle state.
    pub state: ShardState,
}

/// Where a newly registered consumer group starts reading (config `start_from`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StartFrom {
    /// From entry id `0`: every entry already in the shard is delivered.
    #[default]
    Earliest,
    /// From `$`: only entries added after the group is created.
    Latest,
}

/// A consumer group registered in the stream metadata (docs/design.md §8).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RegisteredGroup {
    /// The consumer group name (no `:`, `{` or `}`).
    pub consumer_group: String,
    /// Where it started when it was registered.
    pub start_from: StartFrom,
}

/// An active resharding of a stream (docs/design.md §10).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Migration {
    /// Shard count before the migration.
    pub from_shard_count: u32,
    /// Shard count producers route to once it completes.
    pub to_shard_count: u32,
    /// When it started (RFC 3339).
    pub started_at: String,
}

/// Stream metadata, one per prefix, in `sl:{<prefix>}:stream` (docs/design.md §3).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StreamMetadata {
    /// The stream prefix (no `{` or `}`).
    pub stream_prefix: String,
    /// Number of shards producers route to (jump consistent hash over `0..shardCount`).
    pub shard_count: u32,
    /// Every shard that exists or existed, with its state.
    pub shards: Vec<ShardInfo>,
    /// Bumped on every change of this metadata.
    pub metadata_version: u64,
    /// Registered consumer groups.
    pub groups: Vec<RegisteredGroup>,
    /// The active resharding, or `null`.
    pub migration: Option<Migration>,
    /// Time of the last change (RFC 3339).
    pub updated_at: String,
    /// Compare-and-set revision of this metadata.
    pub revision: u64,
}

impl StreamMetadata {
    /// The readable shard set: `ACTIVE` and `DRAINING` shards, ascending.
    pub fn readable_shard_set(&self) -> BTreeSet<ShardIndex> {
        self.shards
            .iter()
            .filter(|s| s.state.is_readable())
            .map(|s| s.shard_index)
            .collect()
    }
}

/// Group state (docs/design.md §4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum GroupState {
    /// No live member.
    Empty,
    /// `groupEpoch > assignmentEpoch`: a new target assignment is needed.
    Assigning,
    /// The target is stored; some live member has not converged to it.
    Reconciling,
    /// Every live member owns exactly its target.
    Stable,
}

/// The target assignment: which member should own which shards (docs/design.md §3, §7).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TargetAssignment {
    /// Equals the `groupEpoch` it was computed for.
    pub assignment_epoch: Epoch,
    /// The `groupEpoch` it was computed from.
    pub group_epoch: Epoch,
    /// Member id → its target shards (ascending). Members with no shard are absent.
    pub members: BTreeMap<MemberId, BTreeSet<ShardIndex>>,
}

/// An active lost-metadata correction round (docs/design.md §6.6): `correctionRound` in the
/// group's `meta` (docs/design.md §3.2), present only while a round runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CorrectionRound {
    /// When the evidence was seen (µs).
    pub started_at: Micros,
    /// The round lasts at least until this time: one lease TTL after the evidence (µs).
    pub not_before_end: Micros,
    /// Member epochs at or above this value were handed out in the new incarnation: a member
    /// that reports one has heartbeated on the new incarnation.
    pub base_epoch: Epoch,
    /// Members that have heartbeated on the new incarnation.
    pub synced_members: BTreeSet<MemberId>,
}

/// Group-level metadata, the `meta` field of `sl:{<prefix>:<group>}:group` (docs/design.md §3).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GroupMetadata {
    /// The stream prefix.
    pub stream_prefix: String,
    /// The consumer group.
    pub consumer_group: String,
    /// Redis `TIME` (µs) when this group's metadata was created or last corrected; a re-created
    /// group gets a larger one. The first part of every fencing token.
    pub incarnation: Micros,
    /// Increments on every change that needs a new target (docs/design.md §3).
    pub group_epoch: Epoch,
    /// The stream `metadataVersion` this group last applied.
    pub metadata_version: u64,
    /// The `groupEpoch` the stored target was computed from.
    pub assignment_epoch: Epoch,
    /// Group state.
    pub state: GroupState,
    /// The stream's `shardCount` as last applied.
    pub shard_count: u32,
    /// ACTIVE and DRAINING shards as last applied, ascending.
    pub readable_shard_set: BTreeSet<ShardIndex>,
    /// Time of the last change (RFC 3339).
    pub updated_at: String,
    /// Time of the last group state change (RFC 3339).
    pub last_transition_at: String,
    /// The target assignment.
    pub target_assignment: TargetAssignment,
    /// No shard is sent as assigned before this time (µs): set when metadata is re-provisioned,
    /// because members of the lost incarnation may still be reading (docs/design.md §5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hand_out_not_before: Option<Micros>,
    /// The running correction round, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub correction_round: Option<CorrectionRound>,
}

/// Member state (docs/design.md §3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum MemberState {
    /// In the group.
    Active,
    /// Sent `-1`; its shards move as it reports them `REVOKED` or its lease runs out.
    Leaving,
    /// Its lease ran out.
    Expired,
    /// The coordinator fenced it (late revoke, or an ownership report it could not make).
    Fenced,
    /// Left and released everything.
    Left,
}

/// What a replaced process still holds (docs/design.md §6.3, holdings): kept until its lease runs
/// out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OldProcessHolding {
    /// The replaced process.
    pub process_id: String,
    /// Shards it may still be reading.
    pub shards: BTreeSet<ShardIndex>,
    /// Its lease expiry (µs).
    pub lease_expires_at: Micros,
}

/// Member metadata, one `member:<id>` field of the group hash (docs/design.md §3).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MemberMetadata {
    /// The member id.
    pub member_id: MemberId,
    /// A human name (the listener name).
    pub member_name: String,
    /// Static membership identity, when configured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance_id: Option<String>,
    /// The UUIDv7 of the process currently behind this member id.
    pub process_id: String,
    /// Member state.
    pub state: MemberState,
    /// A static member that sent `-2`: its target stays reserved while its lease runs.
    pub away: bool,
    /// Current member epoch.
    pub member_epoch: Epoch,
    /// The epoch before the last change (tolerated once, for a lost response).
    pub previous_member_epoch: Epoch,
    /// `assignedShards` of the last response (shards it may read).
    pub assigned_shards: BTreeSet<ShardIndex>,
    /// `assignedShards` of the response before.
    pub previous_assigned_shards: BTreeSet<ShardIndex>,
    /// Shards it last reported owned.
    pub current_assignment: BTreeSet<ShardIndex>,
    /// Shards it last reported `DRAINING`.
    pub revoking: BTreeSet<ShardIndex>,
    /// Holdings of replaced processes, one entry per process.
    pub old_process_holdings: Vec<OldProcessHolding>,
    /// `requestSeq` of the last accepted request of `processId`.
    pub last_request_seq: u64,
    /// The response to that request, answered again to a retry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_response: Option<HeartbeatResponse>,
    /// Stream `metadataVersion` the member last reported.
    pub metadata_version: u64,
    /// Local worker count; the assignor's weight.
    pub runtime_max_concurrency: u32,
    /// Workers busy at the last heartbeat.
    pub active_consumer_workers: u32,
    /// Last accepted heartbeat (µs).
    pub last_heartbeat_at: Micros,
    /// Lease expiry (µs); mirrored in the leases sorted set.
    pub member_lease_expires_at: Micros,
    /// The member must have released shards outside its target by then (µs), or be fenced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revoke_deadline: Option<Micros>,
    /// The member's own heartbeat interval (ms): that of the `[coordination]` config of the
    /// process whose heartbeat was last accepted. Every response to this member carries it, also
    /// one written by another member's transition. `0` in metadata written before it was
    /// recorded: the config of the transition running then stands in.
    #[serde(default)]
    pub heartbeat_interval_ms: u64,
    /// The member's own lease TTL (ms), recorded like `heartbeatIntervalMs`; its lease is
    /// renewed by this much, and its renewal time is its lease expiry minus this.
    #[serde(default)]
    pub member_lease_ttl_ms: u64,
    /// The member's own rebalance timeout (ms), recorded like `heartbeatIntervalMs`; its
    /// `revokeDeadline` is set with it.
    #[serde(default)]
    pub rebalance_timeout_ms: u64,
}

/// State of a shard the member is giving up, in a heartbeat request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum RevokeState {
    /// Still finishing in-flight work: still held.
    Draining,
    /// Released: no read, ack or claim any more.
    Revoked,
}

/// A shard the member is giving up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RevokingShard {
    /// The shard.
    pub shard_index: ShardIndex,
    /// How far the revoke is.
    pub state: RevokeState,
}

/// A fence found holding a token other than the member's (docs/design.md §8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FenceConflict {
    /// The shard.
    pub shard_index: ShardIndex,
    /// Incarnation of the token found in the fence.
    pub incarnation: Micros,
    /// Member epoch of the token found in the fence.
    pub epoch: Epoch,
}

/// A heartbeat request (docs/design.md §6).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HeartbeatRequest {
    /// The member id.
    pub member_id: MemberId,
    /// A human name.
    pub member_name: String,
    /// Static identity, when configured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance_id: Option<String>,
    /// UUIDv7 made at process start.
    pub process_id: String,
    /// Per process, increasing; a retry repeats it.
    pub request_seq: u64,
    /// `0` join, `-1` leave, `-2` static leave, `> 0` normal.
    pub member_epoch: Epoch,
    /// Stream `metadataVersion` the member last adopted.
    pub metadata_version: u64,
    /// Local workers (the assignor's weight), at least 1.
    pub runtime_max_concurrency: u32,
    /// Workers busy now.
    pub active_consumer_workers: u32,
    /// Shards it owns (reads) now.
    pub owned_shards: Vec<ShardIndex>,
    /// Shards it is giving up.
    pub revoking_shards: Vec<RevokingShard>,
    /// Fences it found holding another token.
    pub fence_conflicts: Vec<FenceConflict>,
    /// [`PROTOCOL_VERSION`].
    pub protocol_version: u32,
}

/// Heartbeat response status (docs/design.md §6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum HeartbeatStatus {
    /// Start newly assigned shards; revoke owned shards not in `assignedShards`.
    Ok,
    /// Correction round: adopt the stored version and epoch, keep owned shards still assigned,
    /// revoke the rest, start nothing new.
    SyncMetadata,
    /// Correction round: keep draining, start nothing new until a later `OK`.
    RevokePending,
    /// Keep current work; retry with full state.
    Retry,
    /// Stop at once, clear state, rejoin with epoch `0`.
    UnknownMemberId,
    /// Stop at once, clear state, rejoin with epoch `0`.
    FencedMemberEpoch,
    /// Another process took this static identity: stop for good.
    FencedInstanceId,
}

impl HeartbeatStatus {
    /// Whether the status renews the member's lease (`OK`, `SYNC_METADATA`, `REVOKE_PENDING`).
    pub fn renews_lease(self) -> bool {
        matches!(
            self,
            HeartbeatStatus::Ok | HeartbeatStatus::SyncMetadata | HeartbeatStatus::RevokePending
        )
    }
}

/// A heartbeat response (docs/design.md §6).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HeartbeatResponse {
    /// What the member does next.
    pub status: HeartbeatStatus,
    /// The member's epoch (for a fencing status: the epoch the coordinator holds, or 0).
    pub member_epoch: Epoch,
    /// The group epoch.
    pub group_epoch: Epoch,
    /// The assignment epoch.
    pub assignment_epoch: Epoch,
    /// The stream metadata version the group applied.
    pub metadata_version: u64,
    /// The group incarnation (first part of fencing tokens).
    pub incarnation: Micros,
    /// Shards the member may read now.
    pub assigned_shards: Vec<ShardIndex>,
    /// Target shards blocked until their previous holder releases them.
    pub pending_shards: Vec<ShardIndex>,
    /// Heartbeat interval (ms).
    pub heartbeat_interval_ms: u64,
    /// Member lease TTL (ms).
    pub member_lease_ttl_ms: u64,
    /// Rebalance timeout (ms).
    pub rebalance_timeout_ms: u64,
}
