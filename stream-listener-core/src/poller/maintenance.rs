//! The shard task's periodic maintenance (docs/design.md §10.9): at most once per
//! `retention_interval`, between two reads of new entries, the task trims its shard to the
//! stream's retention, and the task of the stream's lowest readable shard also trims its group's
//! dead-letter stream; then it deletes the Redis consumers of members that left (§8.15).
//! Unfenced: in `"acked"` mode the trim script removes only entries that no consumer group on
//! the shard still needs, so a zombie's trim loses nothing; in `"force"` mode
//! the bounds decide regardless of who trims.
//!
//! [`ShardTask::maintain`] runs the steps in order: retention, then consumer cleanup.

use std::time::{Duration, Instant};

use super::ShardTask;
use crate::connection::RedisConnection;
use crate::runtime::ListenerEvent;
use crate::store::{
    Bounds, KeyTrim, Retention, StoreError, load_retention, load_stream_metadata, trim_key,
};

/// When the next maintenance pass is due.
#[derive(Debug)]
pub(super) struct Schedule {
    interval: Duration,
    next: Instant,
}

impl Schedule {
    /// The first pass one interval after the task starts (a takeover comes first).
    pub(super) fn new(interval: Duration) -> Self {
        Schedule {
            interval,
            next: crate::clock::later_by(Instant::now(), interval),
        }
    }

    /// Whether a pass is due now; if so, the next one is an interval away.
    fn take_due(&mut self) -> bool {
        let now = Instant::now();
        if now < self.next {
            return false;
        }
        self.next = crate::clock::later_by(now, self.interval);
        true
    }
}

impl ShardTask {
    /// Runs the maintenance steps when due. Errors are logged and the step is tried again at the
    /// next pass: maintenance never stops the shard's reads.
    pub(super) async fn maintain(&mut self) {
        if !self.maintenance.take_due() {
            return;
        }
        let mut conn = self.ctx.conn.clone();
        if let Err(error) = self.apply_retention(&mut conn).await {
            self.ctx.metrics.redis_error(&error);
            tracing::warn!(error = %crate::report::Chain(&error), "retention trim failed; trying again next interval");
        }
        // A member that was live at this shard's takeover and has left since keeps its Redis
        // consumer until the next takeover; the periodic pass removes it (docs/design.md §8.15).
        // Best effort with its own logging, like the takeover's.
        self.clean_consumers().await;
        // Further maintenance steps go here, each with its own error handling.
    }

    /// The retention step: reads the stream's retention (one `HGET` per interval) and trims the
    /// shard, and the dead-letter stream when this task is the one that trims it.
    async fn apply_retention(&self, conn: &mut RedisConnection) -> Result<(), StoreError> {
        let Some(retention) = load_retention(conn, &self.ctx.stream).await? else {
            return Ok(());
        };
        if retention.bounds_shards() {
            let key = self.ctx.stream.shard(self.shard);
            let trim = trim_key(conn, &key, Bounds::shards(&retention), false).await?;
            self.report_trim(&trim);
        }
        if retention.bounds_dead_letters() && self.trims_dead_letters(conn).await? {
            self.trim_dead_letters(conn, &retention).await?;
        }
        Ok(())
    }

    /// Whether this shard is the stream's lowest readable one: its owner trims the group's
    /// dead-letter stream (one member per group, whoever it is after a rebalance).
    async fn trims_dead_letters(&self, conn: &mut RedisConnection) -> Result<bool, StoreError> {
        let Some(meta) = load_stream_metadata(conn, &self.ctx.stream).await? else {
            return Ok(false);
        };
        Ok(meta.readable_shard_set().first() == Some(&self.shard))
    }

    async fn trim_dead_letters(
        &self,
        conn: &mut RedisConnection,
        retention: &Retention,
    ) -> Result<(), StoreError> {
        let Ok(group) = self.ctx.stream.group(&self.ctx.group) else {
            return Ok(());
        };
        let key = self.ctx.stream.dead_letters(&group);
        let trim = trim_key(conn, &key, Bounds::dead_letters(retention), false).await?;
        if trim.deleted > 0 {
            tracing::info!(stream = self.ctx.stream.prefix(), group = %self.ctx.group, deleted = trim.deleted, "dead letters trimmed to retention");
        }
        Ok(())
    }

    /// Logs the trim; a force-mode loss is a warning per group and a
    /// [`ListenerEvent::EntriesLost`], never silent.
    fn report_trim(&self, trim: &KeyTrim) {
        let stream = self.ctx.stream.prefix();
        self.metrics.trimmed(
            trim.deleted,
            trim.lost
                .iter()
                .map(|loss| (loss.consumer_group.as_str(), loss.entries)),
        );
        if trim.deleted > 0 {
            tracing::debug!(stream, shard = self.shard, deleted = trim.deleted, reason = ?trim.reason, "shard trimmed to retention");
        }
        for loss in &trim.lost {
            tracing::warn!(
                stream,
                shard = self.shard,
                group = %loss.consumer_group,
                lost = loss.entries,
                "force retention trimmed entries this group had not acked or received"
            );
            self.ctx.options.emit(ListenerEvent::EntriesLost {
                member: self.ctx.member_id.to_string(),
                shard: self.shard,
                group: loss.consumer_group.clone(),
                entries: loss.entries,
            });
        }
    }
}
