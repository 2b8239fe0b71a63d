//! The recording types with the `metrics` feature on: counter and histogram handles resolved
//! once, bumped per event; gauges resolved again at every set ([`LiveGauge`]).

use std::time::{Duration, Instant};

use metrics::{Counter, Histogram, Label};

use super::names;
use super::{HandlerOutcome, heartbeat_status, redis_error_kind};
use crate::dataplane::DeadLetterReason;
use crate::model::{Epoch, HeartbeatStatus, ShardIndex};

/// A gauge looked up in the recorder at every [`LiveGauge::set`], not held as a handle.
///
/// The Prometheus exporter forgets a gauge idle for its idle timeout by deleting it from its
/// registry; a handle resolved before that keeps writing to the deleted storage, so the series
/// would never come back (a shard stuck in one handler, or a Redis outage longer than the idle
/// timeout, removed `owned_shards`, `member_epoch`, the shard gauges and `group_lag` for the
/// rest of the process's life, or the shard's ownership). Resolving again at each set (once per
/// heartbeat or sample, never per entry) registers the series anew after it was forgotten.
#[derive(Debug)]
pub(crate) struct LiveGauge {
    name: &'static str,
    labels: Vec<Label>,
    /// The last value set (`f64` bits), for [`LiveGauge::set_again`]; `u64::MAX` before any.
    last: std::sync::atomic::AtomicU64,
}

impl LiveGauge {
    fn new(name: &'static str, labels: Vec<Label>) -> Self {
        let gauge = LiveGauge {
            name,
            labels,
            last: std::sync::atomic::AtomicU64::new(u64::MAX),
        };
        // Registered at once, as a resolved handle would be (exported from the start).
        drop(metrics::gauge!(gauge.name, gauge.labels.clone()));
        gauge
    }

    /// Sets the series to `value`, registering it again if the recorder forgot it.
    pub(crate) fn set(&self, value: f64) {
        self.last
            .store(value.to_bits(), std::sync::atomic::Ordering::Relaxed);
        metrics::gauge!(self.name, self.labels.clone()).set(value);
    }

    /// Sets the series to its last value again (nothing before a first [`LiveGauge::set`]), so
    /// the exporter does not forget a series whose value has not changed.
    pub(crate) fn set_again(&self) {
        let bits = self.last.load(std::sync::atomic::Ordering::Relaxed);
        if bits != u64::MAX {
            metrics::gauge!(self.name, self.labels.clone()).set(f64::from_bits(bits));
        }
    }
}

/// Every dead-letter reason, in [`reason_index`] order.
const REASONS: [DeadLetterReason; 5] = [
    DeadLetterReason::Handler,
    DeadLetterReason::NonRetryable,
    DeadLetterReason::Decode,
    DeadLetterReason::MaxDeliveries,
    DeadLetterReason::TooLarge,
];

fn reason_index(reason: DeadLetterReason) -> usize {
    match reason {
        DeadLetterReason::Handler => 0,
        DeadLetterReason::NonRetryable => 1,
        DeadLetterReason::Decode => 2,
        DeadLetterReason::MaxDeliveries => 3,
        DeadLetterReason::TooLarge => 4,
    }
}

/// Gives the installed recorder every metric's description (`# HELP` in Prometheus), once per
/// member start: the recorder may have been installed after an earlier member started, and a
/// repeated description only replaces the same text.
fn describe_all() {
    use names::MetricKind;
    for &(name, kind, description) in names::DESCRIPTIONS {
        match kind {
            MetricKind::Counter => metrics::describe_counter!(name, description),
            MetricKind::Gauge => metrics::describe_gauge!(name, description),
            MetricKind::Histogram => {
                metrics::describe_histogram!(name, metrics::Unit::Seconds, description);
            }
        }
    }
}

/// `labels` plus `key = value`.
fn labels_with(labels: &[Label], key: &'static str, value: &'static str) -> Vec<Label> {
    let mut all = labels.to_vec();
    all.push(Label::from_static_parts(key, value));
    all
}

/// A clock read at the start of a timed operation.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Stopwatch(Instant);

impl Stopwatch {
    /// Starts timing now.
    #[inline]
    pub(crate) fn start() -> Self {
        Stopwatch(Instant::now())
    }

    fn elapsed(self) -> Duration {
        self.0.elapsed()
    }
}

/// One member's series (labels `stream`, `group`, `listener`, `member`), resolved once when its
/// listener starts; shared by its heartbeat loop and shard tasks.
pub(crate) struct MemberMetrics {
    labels: Vec<Label>,
    handler: [Histogram; 7],
    handled_ok: Counter,
    handled_dead_letter: Counter,
    retries: Counter,
    dead_letters: [Counter; 5],
    owned_shards: LiveGauge,
    member_epoch: LiveGauge,
    rebalances: Counter,
    assignments: Counter,
    revocations: Counter,
    lost: Counter,
    heartbeat_duration: Histogram,
}

impl MemberMetrics {
    /// The series of member `member` of listener `listener` reading `stream` for `group`.
    pub(crate) fn new(stream: &str, group: &str, listener: &str, member: &str) -> Self {
        describe_all();
        let labels = vec![
            Label::new("stream", stream.to_owned()),
            Label::new("group", group.to_owned()),
            Label::new("listener", listener.to_owned()),
            Label::new("member", member.to_owned()),
        ];
        let with = |key, value| labels_with(&labels, key, value);
        let counter = |name: &'static str| metrics::counter!(name, labels.clone());
        MemberMetrics {
            handler: HandlerOutcome::ALL.map(|outcome| {
                metrics::histogram!(
                    names::HANDLER_DURATION_SECONDS,
                    with("outcome", outcome.as_str())
                )
            }),
            handled_ok: metrics::counter!(names::MESSAGES_HANDLED_TOTAL, with("outcome", "ok")),
            handled_dead_letter: metrics::counter!(
                names::MESSAGES_HANDLED_TOTAL,
                with("outcome", "dead_letter")
            ),
            retries: counter(names::RETRIES_TOTAL),
            dead_letters: REASONS.map(|reason| {
                metrics::counter!(names::DEAD_LETTERS_TOTAL, with("reason", reason.as_str()))
            }),
            owned_shards: LiveGauge::new(names::OWNED_SHARDS, labels.clone()),
            member_epoch: LiveGauge::new(names::MEMBER_EPOCH, labels.clone()),
            rebalances: counter(names::REBALANCES_TOTAL),
            assignments: counter(names::ASSIGNMENTS_TOTAL),
            revocations: counter(names::REVOCATIONS_TOTAL),
            lost: counter(names::SHARDS_LOST_TOTAL),
            heartbeat_duration: metrics::histogram!(
                names::HEARTBEAT_DURATION_SECONDS,
                labels.clone()
            ),
            labels,
        }
    }

    /// The member's labels plus `key = value` (for the rare series: resolved per event).
    fn with(&self, key: &'static str, value: &'static str) -> Vec<Label> {
        labels_with(&self.labels, key, value)
    }

    /// One handler attempt that started at `started` ended with `outcome`.
    #[inline]
    pub(crate) fn handler_attempt(&self, outcome: HandlerOutcome, started: Stopwatch) {
        self.handler[outcome.index()].record(started.elapsed().as_secs_f64());
    }

    /// An entry was handled (its ack follows).
    #[inline]
    pub(crate) fn handled(&self) {
        self.handled_ok.increment(1);
    }

    /// A failed attempt is tried again.
    #[inline]
    pub(crate) fn retry(&self) {
        self.retries.increment(1);
    }

    /// An entry was dead-lettered for `reason` (its ack follows).
    pub(crate) fn dead_lettered(&self, reason: DeadLetterReason) {
        self.handled_dead_letter.increment(1);
        self.dead_letters[reason_index(reason)].increment(1);
    }

    /// A heartbeat sent at `sent` got a response with `status`, or none (`None`: a Redis error or
    /// a timeout, also counted by kind).
    pub(crate) fn heartbeat(
        &self,
        sent: Stopwatch,
        outcome: Result<HeartbeatStatus, &(dyn std::error::Error + 'static)>,
    ) {
        self.heartbeat_duration.record(sent.elapsed().as_secs_f64());
        let status = match outcome {
            Ok(status) => heartbeat_status(status),
            Err(error) => {
                self.redis_error(error);
                "error"
            }
        };
        metrics::counter!(names::HEARTBEATS_TOTAL, self.with("status", status)).increment(1);
    }

    /// The member's state after a response: `owned` shards at member epoch `epoch`; `rebalanced`
    /// when the response carried a new epoch, `started` shards newly assigned.
    pub(crate) fn assignment(&self, owned: usize, epoch: Epoch, rebalanced: bool, started: usize) {
        self.owned_shards.set(owned as f64);
        self.member_epoch.set(epoch as f64);
        if rebalanced {
            self.rebalances.increment(1);
        }
        self.assignments.increment(started as u64);
    }

    /// `count` shards were released after a revoke.
    pub(crate) fn revoked(&self, count: usize) {
        self.revocations.increment(count as u64);
    }

    /// `count` shards were lost without a release (a fencing status).
    pub(crate) fn lost(&self, count: usize) {
        self.lost.increment(count as u64);
    }

    /// The fence refused operation `op` (`read`, `ack`, `claim`, …).
    pub(crate) fn fence_rejected(&self, op: &'static str) {
        metrics::counter!(names::FENCE_REJECTIONS_TOTAL, self.with("op", op)).increment(1);
    }

    /// An operation failed with `error`: counted by kind when a Redis error caused it.
    pub(crate) fn redis_error(&self, error: &(dyn std::error::Error + 'static)) {
        if let Some(kind) = redis_error_kind(error) {
            metrics::counter!(names::REDIS_ERRORS_TOTAL, self.with("kind", kind)).increment(1);
        }
    }

    /// Lifecycle hook `hook` (`on_assigned`, `on_revoked`, `on_lost`) returned an error, panicked
    /// or timed out.
    pub(crate) fn hook_failure(&self, hook: &'static str) {
        metrics::counter!(names::HOOK_FAILURES_TOTAL, self.with("hook", hook)).increment(1);
    }
}

/// One owned shard's series (labels `stream`, `group`, `shard`), resolved when its task starts,
/// and its sampler's schedule.
pub(crate) struct ShardMetrics {
    pub(super) lag: LiveGauge,
    pub(super) pending: LiveGauge,
    pub(super) oldest_pending_age: LiveGauge,
    pub(super) group_lag: LiveGauge,
    trimmed: Counter,
    stream: String,
    pub(super) interval: Duration,
    pub(super) next_sample: Instant,
}

impl ShardMetrics {
    /// The series of `shard` of `stream` read by `group`, sampled every `interval`; the first
    /// sample is due at once (the first read of new entries).
    pub(crate) fn new(stream: &str, group: &str, shard: ShardIndex, interval: Duration) -> Self {
        let labels = [
            Label::new("stream", stream.to_owned()),
            Label::new("group", group.to_owned()),
        ];
        let mut shard_labels = labels.to_vec();
        shard_labels.push(Label::new("shard", shard.to_string()));
        ShardMetrics {
            lag: LiveGauge::new(names::SHARD_LAG, shard_labels.clone()),
            pending: LiveGauge::new(names::SHARD_PENDING, shard_labels.clone()),
            oldest_pending_age: LiveGauge::new(
                names::SHARD_OLDEST_PENDING_AGE_SECONDS,
                shard_labels,
            ),
            group_lag: LiveGauge::new(names::GROUP_LAG, labels.to_vec()),
            trimmed: metrics::counter!(names::RETENTION_TRIMMED_TOTAL, labels.to_vec()),
            stream: stream.to_owned(),
            interval,
            next_sample: Instant::now(),
        }
    }

    /// When a sample is due, sets the shard's gauges to their last values again instead of
    /// reading Redis: an idle shard's values cannot have changed (docs/design.md §13.1), and a
    /// series not set for a while is forgotten by the exporter.
    pub(crate) fn keep_alive(&mut self) {
        let now = Instant::now();
        if now < self.next_sample {
            return;
        }
        self.next_sample = crate::clock::later_by(now, self.interval);
        self.lag.set_again();
        self.pending.set_again();
        self.oldest_pending_age.set_again();
    }

    /// Retention trimmed `deleted` entries of the shard; a `force` trim removed `lost` entries
    /// that consumer group `group` still needed, per group.
    pub(crate) fn trimmed<'a>(&self, deleted: u64, lost: impl IntoIterator<Item = (&'a str, u64)>) {
        self.trimmed.increment(deleted);
        for (group, entries) in lost {
            metrics::counter!(
                names::RETENTION_LOST_TOTAL,
                "stream" => self.stream.clone(),
                "group" => group.to_owned()
            )
            .increment(entries);
        }
    }
}
