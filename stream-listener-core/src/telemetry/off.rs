//! The recording types with the `metrics` feature off: empty, every method an empty inline
//! function (no clock read, no Redis call).

use std::time::Duration;

use super::HandlerOutcome;
use crate::connection::RedisConnection;
use crate::dataplane::DeadLetterReason;
use crate::keys::StreamKeys;
use crate::model::{Epoch, HeartbeatStatus, ShardIndex};

/// No clock read.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Stopwatch;

impl Stopwatch {
    #[inline(always)]
    pub(crate) fn start() -> Self {
        Stopwatch
    }
}

/// Nothing recorded.
pub(crate) struct MemberMetrics;

#[allow(clippy::unused_self)]
impl MemberMetrics {
    #[inline(always)]
    pub(crate) fn new(_stream: &str, _group: &str, _listener: &str, _member: &str) -> Self {
        MemberMetrics
    }
    #[inline(always)]
    pub(crate) fn handler_attempt(&self, _outcome: HandlerOutcome, _started: Stopwatch) {}
    #[inline(always)]
    pub(crate) fn handled(&self) {}
    #[inline(always)]
    pub(crate) fn retry(&self) {}
    #[inline(always)]
    pub(crate) fn dead_lettered(&self, _reason: DeadLetterReason) {}
    #[inline(always)]
    pub(crate) fn heartbeat(
        &self,
        _sent: Stopwatch,
        _outcome: Result<HeartbeatStatus, &(dyn std::error::Error + 'static)>,
    ) {
    }
    #[inline(always)]
    pub(crate) fn assignment(
        &self,
        _owned: usize,
        _epoch: Epoch,
        _rebalanced: bool,
        _started: usize,
    ) {
    }
    #[inline(always)]
    pub(crate) fn revoked(&self, _count: usize) {}
    #[inline(always)]
    pub(crate) fn lost(&self, _count: usize) {}
    #[inline(always)]
    pub(crate) fn fence_rejected(&self, _op: &'static str) {}
    #[inline(always)]
    pub(crate) fn redis_error(&self, _error: &(dyn std::error::Error + 'static)) {}
    #[inline(always)]
    pub(crate) fn hook_failure(&self, _hook: &'static str) {}
}

/// Nothing recorded, nothing sampled.
pub(crate) struct ShardMetrics;

#[allow(clippy::unused_self)]
impl ShardMetrics {
    #[inline(always)]
    pub(crate) fn new(
        _stream: &str,
        _group: &str,
        _shard: ShardIndex,
        _interval: Duration,
    ) -> Self {
        ShardMetrics
    }
    #[inline(always)]
    pub(crate) fn trimmed<'a>(
        &self,
        _deleted: u64,
        _lost: impl IntoIterator<Item = (&'a str, u64)>,
    ) {
    }
    #[inline(always)]
    pub(crate) fn keep_alive(&mut self) {}
    #[inline(always)]
    pub(crate) async fn sample(
        &mut self,
        _conn: &RedisConnection,
        _keys: &StreamKeys,
        _group: &str,
        _shard: ShardIndex,
        _lowest_owned: impl FnOnce() -> bool,
        _member: &MemberMetrics,
    ) -> bool {
        false
    }
}
