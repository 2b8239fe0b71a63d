//! Measuring a window: Redis CPU and command statistics, paced runs of units, the idle window.

use std::time::{Duration, Instant};

use crate::units::*;
use redis::AsyncCommands;
use stream_listener_core::connection::RedisConnection;
use stream_listener_core::keys::GroupKeys;
use tokio::time::MissedTickBehavior;

/// `used_cpu_sys + used_cpu_user` of the server, seconds.
pub(crate) async fn redis_cpu(conn: &mut RedisConnection) -> f64 {
    let info: String = redis::cmd("INFO")
        .arg("cpu")
        .query_async(conn)
        .await
        .expect("INFO cpu");
    info_fields(&info)
        .into_iter()
        .filter(|(k, _)| k == "used_cpu_sys" || k == "used_cpu_user")
        .filter_map(|(_, v)| v.parse::<f64>().ok())
        .sum()
}

pub(crate) fn info_fields(info: &str) -> Vec<(String, String)> {
    info.lines()
        .filter_map(|l| l.trim().split_once(':'))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// `INFO commandstats` as (command, calls, usec) sorted by usec, descending.
pub(crate) async fn command_stats(conn: &mut RedisConnection) -> Vec<(String, u64, u64)> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .expect("INFO commandstats");
    let mut stats: Vec<(String, u64, u64)> = info_fields(&info)
        .into_iter()
        .filter_map(|(k, v)| {
            let name = k.strip_prefix("cmdstat_")?.to_owned();
            let field = |f: &str| {
                v.split(',')
                    .find_map(|kv| kv.strip_prefix(f)?.strip_prefix('='))
                    .and_then(|x| x.parse::<u64>().ok())
            };
            Some((name, field("calls")?, field("usec")?))
        })
        .collect();
    stats.sort_by_key(|s| std::cmp::Reverse(s.2));
    stats
}

/// What one measured window gave.
#[derive(Debug, Clone, Default)]
pub(crate) struct Measured {
    pub(crate) samples: Vec<Sample>,
    pub(crate) wall: Duration,
    pub(crate) cpu_seconds: f64,
    pub(crate) revision_delta: Option<u64>,
    pub(crate) commands: Vec<(String, u64, u64)>,
}

impl Measured {
    pub(crate) fn cpu(&self) -> f64 {
        self.cpu_seconds / self.wall.as_secs_f64()
    }

    pub(crate) fn rate(&self) -> f64 {
        self.samples.len() as f64 / self.wall.as_secs_f64()
    }

    pub(crate) fn percentile(&self, p: f64) -> Duration {
        let mut latencies: Vec<Duration> = self.samples.iter().map(|s| s.latency).collect();
        if latencies.is_empty() {
            return Duration::ZERO;
        }
        latencies.sort_unstable();
        let rank = ((p / 100.0) * latencies.len() as f64).ceil() as usize;
        latencies[rank.clamp(1, latencies.len()) - 1]
    }

    pub(crate) fn max(&self) -> Duration {
        self.samples
            .iter()
            .map(|s| s.latency)
            .max()
            .unwrap_or_default()
    }

    pub(crate) fn count(&self, f: impl Fn(&Sample) -> bool) -> usize {
        self.samples.iter().filter(|s| f(s)).count()
    }
}

/// Drives `units` every `interval`, unit `i` first at `start + i × interval / n`, until `stop`.
/// Meanwhile measures the window `[from, stop)`: the samples started in it, Redis CPU and the
/// command statistics (reset at `from`), and the group's `revision` change when `group` is given.
pub(crate) async fn run_paced<U: Unit>(
    units: Vec<U>,
    interval: Duration,
    start: Instant,
    from: Instant,
    stop: Instant,
    mut conn: RedisConnection,
    group: Option<&GroupKeys>,
) -> (Vec<U>, Measured) {
    let n = u32::try_from(units.len()).expect("few units");
    let step = interval / n;
    let tasks: Vec<_> = units
        .into_iter()
        .enumerate()
        .map(|(i, mut unit)| {
            let first = start + step * u32::try_from(i).expect("few units");
            tokio::spawn(async move {
                let mut ticker =
                    tokio::time::interval_at(tokio::time::Instant::from_std(first), interval);
                ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
                let mut samples = Vec::new();
                loop {
                    let at = ticker.tick().await.into_std();
                    if at >= stop {
                        break;
                    }
                    samples.push(unit.tick().await);
                }
                (unit, samples)
            })
        })
        .collect();
    let revision = |conn: &mut RedisConnection| {
        let mut conn = conn.clone();
        let key = group.map(GroupKeys::metadata);
        async move {
            let key = key?;
            let value: Option<u64> = conn.hget(key, "revision").await.ok()?;
            value
        }
    };
    tokio::time::sleep_until(tokio::time::Instant::from_std(from)).await;
    let cpu_before = redis_cpu(&mut conn).await;
    let wall_before = Instant::now();
    let revision_before = revision(&mut conn).await;
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut conn)
        .await
        .expect("CONFIG RESETSTAT");
    tokio::time::sleep_until(tokio::time::Instant::from_std(stop)).await;
    let cpu_after = redis_cpu(&mut conn).await;
    let wall = wall_before.elapsed();
    let revision_after = revision(&mut conn).await;
    let commands = command_stats(&mut conn).await;
    let mut units = Vec::new();
    let mut samples = Vec::new();
    for task in tasks {
        let (unit, s) = task.await.expect("driver task");
        units.push(unit);
        samples.extend(s.into_iter().filter(|s| s.start >= from && s.start < stop));
    }
    let measured = Measured {
        samples,
        wall,
        cpu_seconds: cpu_after - cpu_before,
        revision_delta: revision_before
            .zip(revision_after)
            .map(|(b, a)| a.saturating_sub(b)),
        commands,
    };
    (units, measured)
}

/// Nothing sent: Redis's own background CPU over `window`.
pub(crate) async fn idle(conn: &mut RedisConnection, window: Duration) -> Measured {
    let cpu_before = redis_cpu(conn).await;
    let wall_before = Instant::now();
    tokio::time::sleep(window).await;
    let cpu_after = redis_cpu(conn).await;
    Measured {
        wall: wall_before.elapsed(),
        cpu_seconds: cpu_after - cpu_before,
        ..Measured::default()
    }
}
