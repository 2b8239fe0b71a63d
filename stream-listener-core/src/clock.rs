//! Clock arithmetic for the schedules of the shard tasks (the metrics sampler, the retention
//! pass): adding an interval to an `Instant` without the overflow panic of `Instant + Duration`.

use std::time::{Duration, Instant};

/// How far ahead [`later_by`] puts a time the clock cannot hold: 30 years (as tokio does).
const FAR_FUTURE: Duration = Duration::from_secs(86_400 * 365 * 30);

/// `now` + `interval`, or 30 years after `now` when the clock cannot hold that (an interval
/// such as `Duration::MAX`, or `metrics_interval = "500000000000 years"`: "not again"). The
/// schedules of the shard tasks (metrics sampling, retention) add their interval with it: a
/// plain `Instant + Duration` panics on overflow, and that panic killed the shard task.
pub(crate) fn later_by(now: Instant, interval: Duration) -> Instant {
    now.checked_add(interval)
        .unwrap_or_else(|| now + FAR_FUTURE)
}
