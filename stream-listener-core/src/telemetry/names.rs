//! The metric names (docs/design.md §13.1; README `### Metrics`): one `pub const` per series, so
//! the recorder, the dashboard and its test agree on them. All are prefixed `stream_listener_`;
//! durations are in seconds, counters end in `_total`.

/// Histogram (s) of one handler attempt; labels `stream`, `group`, `listener`, `member`,
/// `outcome` ∈ `ok`, `retry`, `dead_letter`, `decode_error`, `timeout`, `panic`.
pub const HANDLER_DURATION_SECONDS: &str = "stream_listener_handler_duration_seconds";
/// Counter of entries finished; labels as above with `outcome` ∈ `ok`, `dead_letter`.
pub const MESSAGES_HANDLED_TOTAL: &str = "stream_listener_messages_handled_total";
/// Counter of handler attempts scheduled again after a failure; member labels.
pub const RETRIES_TOTAL: &str = "stream_listener_retries_total";
/// Counter of entries dead-lettered; member labels and `reason` (`DeadLetterReason::as_str`).
pub const DEAD_LETTERS_TOTAL: &str = "stream_listener_dead_letters_total";
/// Gauge (entries) of a shard's entries not yet delivered to the group; `stream`, `group`, `shard`.
pub const SHARD_LAG: &str = "stream_listener_shard_lag";
/// Gauge (entries) in a shard's pending entries list for the group; `stream`, `group`, `shard`.
pub const SHARD_PENDING: &str = "stream_listener_shard_pending";
/// Gauge (s): Redis `TIME` − the id time of the shard's oldest pending entry (0 when none);
/// `stream`, `group`, `shard`.
pub const SHARD_OLDEST_PENDING_AGE_SECONDS: &str =
    "stream_listener_shard_oldest_pending_age_seconds";
/// Gauge (entries): lag summed over every readable shard; `stream`, `group`; one publisher per
/// group (the owner of the lowest readable shard).
pub const GROUP_LAG: &str = "stream_listener_group_lag";
/// Gauge of shards the member owns; member labels.
pub const OWNED_SHARDS: &str = "stream_listener_owned_shards";
/// Gauge: the member epoch; member labels.
pub const MEMBER_EPOCH: &str = "stream_listener_member_epoch";
/// Counter of assignments received with a new member epoch; member labels.
pub const REBALANCES_TOTAL: &str = "stream_listener_rebalances_total";
/// Counter of shards the member started reading; member labels.
pub const ASSIGNMENTS_TOTAL: &str = "stream_listener_assignments_total";
/// Counter of shards the member released after a revoke; member labels.
pub const REVOCATIONS_TOTAL: &str = "stream_listener_revocations_total";
/// Counter of shards lost without a release (a fencing status, an expired lease); member labels.
pub const SHARDS_LOST_TOTAL: &str = "stream_listener_shards_lost_total";
/// Histogram (s) of a heartbeat's round trip; member labels.
pub const HEARTBEAT_DURATION_SECONDS: &str = "stream_listener_heartbeat_duration_seconds";
/// Counter of heartbeat responses; member labels and `status` (`OK`, `RETRY`, … or `error`).
pub const HEARTBEATS_TOTAL: &str = "stream_listener_heartbeats_total";
/// Counter of fence refusals; member labels and `op` (`read`, `ack`, `claim`, …).
pub const FENCE_REJECTIONS_TOTAL: &str = "stream_listener_fence_rejections_total";
/// Counter of Redis errors; member labels and `kind` (`io`, `timeout`, `cluster`, `script`,
/// `response`, `oom`, `other`).
pub const REDIS_ERRORS_TOTAL: &str = "stream_listener_redis_errors_total";
/// Counter of entries trimmed by retention from shards this process owns; `stream`, `group`.
pub const RETENTION_TRIMMED_TOTAL: &str = "stream_listener_retention_trimmed_total";
/// Counter of entries a `force` trim removed before `group` acked them; `stream`, `group`.
pub const RETENTION_LOST_TOTAL: &str = "stream_listener_retention_lost_total";
/// Counter of lifecycle hooks that failed; member labels and `hook`.
pub const HOOK_FAILURES_TOTAL: &str = "stream_listener_hook_failures_total";

/// Every name above, for checks (a dashboard's queries use only these).
pub const ALL: &[&str] = &[
    HANDLER_DURATION_SECONDS,
    MESSAGES_HANDLED_TOTAL,
    RETRIES_TOTAL,
    DEAD_LETTERS_TOTAL,
    SHARD_LAG,
    SHARD_PENDING,
    SHARD_OLDEST_PENDING_AGE_SECONDS,
    GROUP_LAG,
    OWNED_SHARDS,
    MEMBER_EPOCH,
    REBALANCES_TOTAL,
    ASSIGNMENTS_TOTAL,
    REVOCATIONS_TOTAL,
    SHARDS_LOST_TOTAL,
    HEARTBEAT_DURATION_SECONDS,
    HEARTBEATS_TOTAL,
    FENCE_REJECTIONS_TOTAL,
    REDIS_ERRORS_TOTAL,
    RETENTION_TRIMMED_TOTAL,
    RETENTION_LOST_TOTAL,
    HOOK_FAILURES_TOTAL,
];
