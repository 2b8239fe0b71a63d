//! Consumer hygiene (docs/design.md §8.15): deleting the Redis consumers of a shard that belong
//! to no member of the group any more and hold no pending entry.
//!
//! Non-static member ids are new per process, and a member's Redis consumer name is its member
//! id, so every restart leaves one consumer per shard read. Two steps, in two hash slots (on a
//! cluster the leases and the shard live on different nodes): [`read_keep_list`] on the group's
//! slot, then [`delete_idle_consumers`] on the shard's slot with the keep-list as arguments. The
//! shard script deletes only consumers whose pending count it reads as 0 itself, so a race with
//! a joining member loses nothing (docs/design.md §8.15).

use redis::Value;

use super::ShardClient;
use super::reply::{int, text};
use crate::connection::RedisConnection;
use crate::dataplane::error::DataPlaneError;
use crate::dataplane::scripts;
use crate::keys::{GroupKeys, StreamKeys};
use crate::model::ShardIndex;

/// The members of a group whose Redis consumers must stay, as [`read_keep_list`] read them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct KeepList {
    /// Whether the group hash `sl:{<prefix>:<group>}:group` exists. When it does not (Redis lost
    /// the group's metadata, docs/design.md §5.5), nobody can tell which consumers belong to live
    /// members: callers skip the cleanup.
    pub group_exists: bool,
    /// Members whose lease (`sl:{<prefix>:<group>}:leases` score, µs) is at or after Redis
    /// `TIME`.
    pub live: Vec<String>,
    /// Members still in the member map with an expired lease whose metadata names an
    /// `instanceId` (static members away: their consumer name survives restarts), or whose
    /// metadata cannot be read (kept: it cannot be judged).
    pub static_members: Vec<String>,
}

impl KeepList {
    /// Every name to keep, `own` (the caller's consumer, when it has one) first.
    pub fn names(&self, own: Option<&str>) -> Vec<String> {
        own.map(str::to_owned)
            .into_iter()
            .chain(self.live.iter().cloned())
            .chain(self.static_members.iter().cloned())
            .collect()
    }
}

/// What one [`delete_idle_consumers`] call did on one shard.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ConsumerSweep {
    /// Consumers deleted (`XGROUP DELCONSUMER`), or that would be in a dry run: not in the
    /// keep-list, 0 pending entries.
    pub deleted: Vec<String>,
    /// Consumers not in the keep-list kept because they have pending entries: (name, pending
    /// count). They are claimed by the shard's next owner at takeover and deleted afterwards.
    pub kept_pending: Vec<(String, u64)>,
    /// Consumers in the keep-list: (name, pending count).
    pub kept: Vec<(String, u64)>,
}

/// Reads the keep-list of the group of `group_keys`: one script on the group's slot
/// (`TIME`, `ZRANGE <leases> <now> +inf BYSCORE`, the expired ones' `member:<id>` fields;
/// Redis ≥ 6.2).
///
/// # Errors
/// [`DataPlaneError::Redis`] when Redis fails; [`DataPlaneError::UnexpectedReply`] for a reply
/// of another shape.
pub async fn read_keep_list(
    conn: &mut RedisConnection,
    group_keys: &GroupKeys,
) -> Result<KeepList, DataPlaneError> {
    const OP: &str = "consumer_keep_list";
    let (exists, live, static_members): (i64, Vec<String>, Vec<String>) =
        scripts::consumer_keep_list()
            .key(group_keys.leases())
            .key(group_keys.metadata())
            .invoke_async(conn)
            .await
            .map_err(DataPlaneError::redis(OP, None))?;
    Ok(KeepList {
        group_exists: exists == 1,
        live,
        static_members,
    })
}

/// Deletes, on shard `shard` of `keys`, every Redis consumer of `group` that is not in `keep`
/// and has no pending entry (`XINFO CONSUMERS`, then `XGROUP DELCONSUMER`, in one script: the
/// pending count is checked where the consumer is deleted), and the group's read gates on the
/// shard ([`StreamKeys::gate`], docs/design.md §8.16) that belong to no current fence value (left
/// by a lost fence) or to versions before gates were per token. With `dry_run` nothing is
/// deleted and [`ConsumerSweep::deleted`] lists the consumers that would be. Not fenced (see
/// docs/design.md §8.15 for why that is safe; deleting a gate at any time is safe too: it only
/// fails the reads and waits that name it, which then check their fence again).
///
/// # Errors
/// [`DataPlaneError::NoGroup`] when the shard stream or its consumer group is missing (nothing
/// changed); [`DataPlaneError::Redis`] when Redis fails (a deletion that happened is harmless:
/// run it again); [`DataPlaneError::UnexpectedReply`] for a reply of another shape.
pub async fn delete_idle_consumers(
    conn: &mut RedisConnection,
    keys: &StreamKeys,
    shard: ShardIndex,
    group: &str,
    keep: &[String],
    dry_run: bool,
) -> Result<ConsumerSweep, DataPlaneError> {
    const OP: &str = "delete_idle_consumers";
    let stream = keys.shard(shard);
    let mut invocation = scripts::delete_idle_consumers().key(&stream);
    // A name the key layout refuses has no gate: no listener could have created one.
    if let Ok(group_keys) = keys.group(group) {
        invocation
            .key(keys.gate_registry(shard))
            .key(keys.fence(shard))
            .key(keys.legacy_gate(shard, &group_keys));
    }
    invocation.arg(group).arg(if dry_run { "1" } else { "0" });
    for name in keep {
        invocation.arg(name);
    }
    let reply: Vec<Value> = invocation
        .invoke_async(conn)
        .await
        .map_err(DataPlaneError::redis(OP, Some(shard)))?;
    let unexpected = |detail: String| DataPlaneError::unexpected(OP, Some(shard), detail);
    let status = reply.first().and_then(text);
    match (status.as_deref(), reply.len()) {
        (Some("OK"), 4) => Ok(ConsumerSweep {
            deleted: names(&reply[1]).ok_or_else(|| unexpected(format!("{reply:?}")))?,
            kept_pending: counts(&reply[2]).ok_or_else(|| unexpected(format!("{reply:?}")))?,
            kept: counts(&reply[3]).ok_or_else(|| unexpected(format!("{reply:?}")))?,
        }),
        (Some("NOGROUP"), _) => Err(DataPlaneError::NoGroup {
            shard,
            stream,
            group: group.to_owned(),
            detail: reply.get(1).and_then(text).unwrap_or_default(),
        }),
        _ => Err(unexpected(format!("{reply:?}"))),
    }
}

/// A list of names.
fn names(value: &Value) -> Option<Vec<String>> {
    match value {
        Value::Array(items) => items.iter().map(text).collect(),
        _ => None,
    }
}

/// A list of `{name, count}` pairs.
fn counts(value: &Value) -> Option<Vec<(String, u64)>> {
    let Value::Array(items) = value else {
        return None;
    };
    items
        .iter()
        .map(|pair| match pair {
            Value::Array(pair) if pair.len() == 2 => {
                Some((text(&pair[0])?, u64::try_from(int(&pair[1])?).ok()?))
            }
            _ => None,
        })
        .collect()
}

impl ShardClient {
    /// Consumer hygiene on `shard` (docs/design.md §8.15): reads the group's keep-list (live
    /// leases and static members in the group, plus this client's own consumer), then deletes
    /// the shard's other consumers that have no pending entry. Run by a shard's owner after
    /// takeover has claimed the other consumers' pending entries, and available to any periodic
    /// per-shard maintenance. Returns `None` when the group hash is missing (lost metadata:
    /// nothing is judged, nothing deleted).
    ///
    /// # Errors
    /// As [`read_keep_list`] and [`delete_idle_consumers`]. Best effort for callers: nothing is
    /// lost when it fails, the next run deletes what this one did not.
    pub async fn clean_consumers(
        &mut self,
        shard: ShardIndex,
    ) -> Result<Option<ConsumerSweep>, DataPlaneError> {
        let keep = read_keep_list(&mut self.conn, &self.group_keys).await?;
        if !keep.group_exists {
            return Ok(None);
        }
        let names = keep.names(Some(&self.consumer));
        delete_idle_consumers(
            &mut self.conn,
            &self.keys,
            shard,
            &self.group,
            &names,
            false,
        )
        .await
        .map(Some)
    }
}
