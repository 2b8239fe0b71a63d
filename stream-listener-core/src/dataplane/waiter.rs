//! [`Waiter`]: waiting for new entries without a group (docs/design.md §8.4).

use std::time::Duration;

use redis::Value;

use super::error::DataPlaneError;
use super::slot::key_slot;
use crate::connection::{RedisConnection, RedisTarget};

/// Waits for new entries on shard streams with a plain `XREAD BLOCK` (no group, no PEL: nothing is
/// delivered, only the wake-up matters), on a connection of its own whose response timeout is
/// `2 × max_block + 1 s`, so an idle wait ends in an empty reply and never in a client timeout
/// (redis-rs's default response timeout is shorter than a typical block).
/// The connection reconnects by itself and is kept for the waiter's life (no connection per wait).
///
/// One wait at a time per waiter (`&mut self`): a blocked command holds the connection. On a
/// standalone server one call may cover all of a member's idle shards (what
/// [`super::shared_wait`] does); on a cluster one call covers keys of one hash slot only
/// ([`super::key_slot`]), so each idle shard needs its own waiter.
#[derive(Debug)]
pub struct Waiter {
    conn: RedisConnection,
    max_block: Duration,
}

impl Waiter {
    /// Opens the waiter's own connection to `target` for blocks of up to `max_block` (at least
    /// 1 ms; give the longest block you will ask for, e.g. the configured `block`).
    ///
    /// # Errors
    /// [`DataPlaneError::Redis`] (`op` = `connect`) when the URL is invalid or no server answers.
    pub async fn connect(
        target: &RedisTarget,
        max_block: Duration,
    ) -> Result<Self, DataPlaneError> {
        let max_block = max_block.max(Duration::from_millis(1));
        let conn = RedisConnection::connect(target, Self::response_timeout_for(max_block))
            .await
            .map_err(DataPlaneError::redis("connect", None))?;
        Ok(Waiter { conn, max_block })
    }

    /// The response timeout a waiter for blocks of up to `max_block` uses:
    /// `2 × max_block + 1 s` (a block may take longer than asked when the server is busy).
    pub fn response_timeout_for(max_block: Duration) -> Duration {
        max_block.saturating_mul(2) + Duration::from_secs(1)
    }

    /// This waiter's client id on the server (`CLIENT ID`): what `CLIENT UNBLOCK` names to end a
    /// wait early. Valid until the connection fails (a reconnected waiter has a new one).
    ///
    /// # Errors
    /// [`DataPlaneError::Redis`] (`op` = `client_id`) when Redis fails or refuses (`NOPERM`
    /// without `+client|id`).
    pub async fn client_id(&mut self) -> Result<i64, DataPlaneError> {
        redis::cmd("CLIENT")
            .arg("ID")
            .query_async(&mut self.conn)
            .await
            .map_err(DataPlaneError::redis("client_id", None))
    }

    /// The longest block this waiter accepts.
    pub fn max_block(&self) -> Duration {
        self.max_block
    }

    /// On a cluster, [`DataPlaneError::CrossSlot`] unless the keys of `shards` (first of each
    /// pair) are all in one hash slot: one blocking command covers one slot there.
    fn check_one_slot(&self, shards: &[(String, String)]) -> Result<(), DataPlaneError> {
        let Some((first, _)) = shards.first() else {
            return Ok(());
        };
        if self.conn.is_cluster() {
            let slot = key_slot(first);
            if shards.iter().any(|(key, _)| key_slot(key) != slot) {
                return Err(DataPlaneError::CrossSlot {
                    keys: shards.iter().map(|(key, _)| key.clone()).collect(),
                });
            }
        }
        Ok(())
    }

    /// Blocks until one of `shards` — `(shard stream key, last id seen)` pairs, the id usually
    /// [`super::ReadOutcome::Empty::last_id`] — has an entry after its id, or `block` (clamped to
    /// 1 ms..=[`Waiter::max_block`]; Redis's `BLOCK 0` = forever is never sent) passes. Returns
    /// the keys that have new entries, in the order Redis reports them (usually one: a woken
    /// `XREAD` answers as soon as any stream has data), or an empty list on a timeout — never an
    /// error for a normal timeout. An empty `shards` returns an empty list at once. Cap `block`
    /// by the member's remaining lease.
    ///
    /// # Errors
    /// [`DataPlaneError::CrossSlot`] on a cluster when the keys are not all in one hash slot
    /// (nothing is sent); [`DataPlaneError::Redis`] (`op` = `wait`) when Redis fails or does not
    /// answer within the response timeout (a paused server): back off and re-check the lease.
    pub async fn wait(
        &mut self,
        shards: &[(String, String)],
        block: Duration,
    ) -> Result<Vec<String>, DataPlaneError> {
        const OP: &str = "wait";
        if shards.is_empty() {
            return Ok(Vec::new());
        }
        self.check_one_slot(shards)?;
        let block = block.clamp(Duration::from_millis(1), self.max_block);
        let mut cmd = redis::cmd("XREAD");
        cmd.arg("COUNT")
            .arg(1)
            .arg("BLOCK")
            .arg(u64::try_from(block.as_millis()).unwrap_or(u64::MAX))
            .arg("STREAMS");
        for (key, _) in shards {
            cmd.arg(key);
        }
        for (_, id) in shards {
            cmd.arg(id);
        }
        let value: Value = cmd
            .query_async(&mut self.conn)
            .await
            .map_err(DataPlaneError::redis(OP, None))?;
        let key_of = |v: &Value| match v {
            Value::BulkString(bytes) => Some(String::from_utf8_lossy(bytes).into_owned()),
            Value::SimpleString(s) => Some(s.clone()),
            _ => None,
        };
        let bad = |v: &Value| DataPlaneError::unexpected(OP, None, format!("{v:?}"));
        match &value {
            Value::Nil => Ok(Vec::new()),
            // RESP2: [[key, entries], ...]
            Value::Array(streams) => streams
                .iter()
                .map(|s| match s {
                    Value::Array(pair) if !pair.is_empty() => {
                        key_of(&pair[0]).ok_or_else(|| bad(s))
                    }
                    other => Err(bad(other)),
                })
                .collect(),
            // RESP3: {key: entries, ...}
            Value::Map(streams) => streams
                .iter()
                .map(|(k, _)| key_of(k).ok_or_else(|| bad(k)))
                .collect(),
            other => Err(bad(other)),
        }
    }

    /// Blocks in `XREADGROUP GROUP <group> <consumer> COUNT <count> BLOCK <block> STREAMS
    /// <gates…> <shards…> > … >` (docs/design.md §8.4, §8.16): the strict wait, which reads what
    /// it waits for. `shards` are `(shard stream key, read gate key)` pairs, each gate the one of
    /// the member's fencing token on that shard ([`crate::keys::StreamKeys::gate`]). The gates
    /// are empty streams that exist only while the shard's fence holds the token, and Redis checks
    /// every named stream's group before it reads any: a missing gate fails the command as a
    /// whole, and deleting a gate (a raise by the shard's next owner) unblocks it with an error,
    /// so the wait reads only while every fence holds. Returns each shard with entries and its
    /// entries (`(key, entries array)`, as the reply carries them: now in this consumer's
    /// PEL), or an empty list when `block` passed (clamped as in [`Waiter::wait`]).
    ///
    /// # Errors
    /// [`DataPlaneError::CrossSlot`] on a cluster when the keys are not all in one hash slot
    /// (nothing is sent); [`DataPlaneError::Redis`] (`op` = `wait_read`): a server error reply
    /// (a gate or a group missing or deleted: nothing was read) or a failure of the connection
    /// (entries may have been read: read this consumer's pending entries);
    /// [`DataPlaneError::UnexpectedReply`] for a reply of another shape (entries may have been
    /// read).
    pub(crate) async fn read_group(
        &mut self,
        group: &str,
        consumer: &str,
        count: usize,
        shards: &[(String, String)],
        block: Duration,
    ) -> Result<Vec<(String, Value)>, DataPlaneError> {
        const OP: &str = "wait_read";
        if shards.is_empty() {
            return Ok(Vec::new());
        }
        self.check_one_slot(shards)?;
        let block = block.clamp(Duration::from_millis(1), self.max_block);
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP")
            .arg(group)
            .arg(consumer)
            .arg("COUNT")
            .arg(count.max(1))
            .arg("BLOCK")
            .arg(u64::try_from(block.as_millis()).unwrap_or(u64::MAX))
            .arg("STREAMS");
        for (_, gate) in shards {
            cmd.arg(gate);
        }
        for (key, _) in shards {
            cmd.arg(key);
        }
        for _ in 0..shards.len() * 2 {
            cmd.arg(">");
        }
        let value: Value = cmd
            .query_async(&mut self.conn)
            .await
            .map_err(DataPlaneError::redis(OP, None))?;
        let bad = |v: &Value| DataPlaneError::unexpected(OP, None, format!("{v:?}"));
        let pairs: Vec<(&Value, &Value)> = match &value {
            Value::Nil => return Ok(Vec::new()),
            // RESP2: [[key, entries], ...]
            Value::Array(streams) => streams
                .iter()
                .map(|s| match s {
                    Value::Array(pair) if pair.len() == 2 => Ok((&pair[0], &pair[1])),
                    other => Err(bad(other)),
                })
                .collect::<Result<_, _>>()?,
            // RESP3: {key: entries, ...}
            Value::Map(streams) => streams.iter().map(|(k, v)| (k, v)).collect(),
            other => return Err(bad(other)),
        };
        let mut delivered = Vec::new();
        for (key, entries) in pairs {
            let key = match key {
                Value::BulkString(bytes) => String::from_utf8_lossy(bytes).into_owned(),
                Value::SimpleString(s) => s.clone(),
                other => return Err(bad(other)),
            };
            let empty =
                matches!(entries, Value::Array(e) if e.is_empty()) || *entries == Value::Nil;
            // A gate's share is always empty: nothing writes to it.
            if !empty && shards.iter().any(|(shard, _)| *shard == key) {
                delivered.push((key, entries.clone()));
            }
        }
        Ok(delivered)
    }
}
