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

/// Histogram buckets (seconds) of [`HANDLER_DURATION_SECONDS`]: 1 ms to 30 s, the default
/// `handler_timeout`. The facade's Prometheus recorder uses them (`_bucket` series for
/// `histogram_quantile`; without buckets the exporter renders summaries).
pub const HANDLER_DURATION_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Histogram buckets (seconds) of [`HEARTBEAT_DURATION_SECONDS`]: 0.5 ms to the 5 s heartbeat
/// timeout.
pub const HEARTBEAT_DURATION_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];

/// What a metric is, for its description.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    /// Only goes up.
    Counter,
    /// Set to the current value.
    Gauge,
    /// A distribution of observed values (seconds here).
    Histogram,
}

/// Each name of [`ALL`] with its kind and the one-line description exported as its `# HELP`
/// (docs/design.md §13.1). Units are in the names (`_seconds`; the rest count entries, shards
/// or events).
pub const DESCRIPTIONS: &[(&str, MetricKind, &str)] = &[
    (
        HANDLER_DURATION_SECONDS,
        MetricKind::Histogram,
        "Duration of one handler attempt, by outcome (ok, retry, dead_letter, decode_error, timeout, panic).",
    ),
    (
        MESSAGES_HANDLED_TOTAL,
        MetricKind::Counter,
        "Entries finished, by outcome: ok (handled and acked) or dead_letter.",
    ),
    (
        RETRIES_TOTAL,
        MetricKind::Counter,
        "Handler attempts scheduled again after a failure.",
    ),
    (
        DEAD_LETTERS_TOTAL,
        MetricKind::Counter,
        "Entries dead-lettered, by reason.",
    ),
    (
        SHARD_LAG,
        MetricKind::Gauge,
        "Entries of a shard owned by this process not yet delivered to the group (XINFO GROUPS lag).",
    ),
    (
        SHARD_PENDING,
        MetricKind::Gauge,
        "Entries in the shard's pending entries list for the group.",
    ),
    (
        SHARD_OLDEST_PENDING_AGE_SECONDS,
        MetricKind::Gauge,
        "Age of the shard's oldest pending entry (Redis TIME minus its id time); 0 when none.",
    ),
    (
        GROUP_LAG,
        MetricKind::Gauge,
        "Lag summed over every readable shard of the stream; one publisher per group (the owner of the lowest readable shard).",
    ),
    (OWNED_SHARDS, MetricKind::Gauge, "Shards the member owns."),
    (MEMBER_EPOCH, MetricKind::Gauge, "The member epoch."),
    (
        REBALANCES_TOTAL,
        MetricKind::Counter,
        "Assignments received with a new member epoch.",
    ),
    (
        ASSIGNMENTS_TOTAL,
        MetricKind::Counter,
        "Shards the member started reading.",
    ),
    (
        REVOCATIONS_TOTAL,
        MetricKind::Counter,
        "Shards the member released after a revoke.",
    ),
    (
        SHARDS_LOST_TOTAL,
        MetricKind::Counter,
        "Shards lost without a release (a fencing status, an expired lease).",
    ),
    (
        HEARTBEAT_DURATION_SECONDS,
        MetricKind::Histogram,
        "Round trip of one heartbeat.",
    ),
    (
        HEARTBEATS_TOTAL,
        MetricKind::Counter,
        "Heartbeat responses, by protocol status, or error when none came.",
    ),
    (
        FENCE_REJECTIONS_TOTAL,
        MetricKind::Counter,
        "Fenced operations the fence refused, by op.",
    ),
    (
        REDIS_ERRORS_TOTAL,
        MetricKind::Counter,
        "Redis errors, by kind.",
    ),
    (
        RETENTION_TRIMMED_TOTAL,
        MetricKind::Counter,
        "Entries trimmed by retention from shards this process owns.",
    ),
    (
        RETENTION_LOST_TOTAL,
        MetricKind::Counter,
        "Entries a force retention trim removed before the group (label) acked them.",
    ),
    (
        HOOK_FAILURES_TOTAL,
        MetricKind::Counter,
        "Lifecycle hook calls that returned an error, panicked or timed out, by hook.",
    ),
];
