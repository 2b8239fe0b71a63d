//! Stream delete (docs/design.md §10.7): removes every key of a sharded stream (§2).

use redis::AsyncCommands;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use serde::Serialize;

use super::liveness::refuse_live;
use super::scripts::{self, GroupKeysDeletion, RetireCheck};
use super::{AdminError, group::group_active, stream_keys};
use crate::connection::RedisConnection;
use crate::keys::{STREAMS_INDEX_KEY, StreamKeys};
use crate::model::{ShardIndex, ShardState, StreamMetadata};
use crate::store::{StoreError, load_stream_metadata};

/// The result of [`delete_stream`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DeletedStream {
    /// The stream prefix.
    pub stream_prefix: String,
    /// The registered consumer groups whose keys were deleted (their group hash, leases,
    /// history and dead-letter stream), by name.
    pub groups: Vec<String>,
    /// Dead-letter streams `<prefix>:dlq:<group>` of groups no longer registered (kept by
    /// `group delete --keep-dead-letters`), found by `SCAN` on every node and deleted.
    #[serde(default)]
    pub orphan_dead_letters: Vec<String>,
    /// Shards whose stream existed and was deleted (with its fence, attempts hash and read
    /// gates), ascending.
    pub shards_deleted: Vec<ShardIndex>,
    /// Keys deleted in all (0 when a previous run had deleted everything but the index entry).
    pub keys_deleted: u64,
    /// Whether `--force` was given.
    pub forced: bool,
}

/// Deletes the sharded stream `prefix` and every key it owns (docs/design.md §2): for every
/// shard listed in the metadata (RETIRED ones included) the shard stream, its fence, its
/// attempts hash, its read gates and their registry; for every registered group its hash,
/// leases, history and dead-letter stream `<prefix>:dlq:<group>`; the dead-letter streams of
/// groups no longer registered (kept by `group delete --keep-dead-letters`: found by `SCAN MATCH
/// <prefix>:dlq:*` on every master, the rest of the name a valid group name); the stream
/// metadata; its entry in `sl:streams`.
///
/// Refused while any registered group has a live member (as `delete_group`, §10.5). Without
/// `force` also refused while any consumer group on a shard has pending entries or entries after
/// its `last-delivered-id` (the check of §10.2); `force` deletes them.
///
/// Order, so that a crash leaves a state the next call finishes or that fails closed: the
/// groups' keys (each in one script that re-checks the leases), the dead-letter streams, the
/// shards, the stream metadata last (while it exists, a new call finds every key from it; a
/// member or producer meets missing shards or groups and fails closed), then the index entry (a
/// call finding only that entry removes it).
///
/// # Errors
/// [`AdminError::InvalidName`]; [`AdminError::Store`] with [`StoreError::MissingStream`] when
/// nothing of the stream is left; [`AdminError::GroupActive`]; [`AdminError::StreamHasData`]
/// without `force`; Redis failures.
pub async fn delete_stream(
    conn: &mut RedisConnection,
    prefix: &str,
    force: bool,
) -> Result<DeletedStream, AdminError> {
    let keys = stream_keys(prefix)?;
    let Some(meta) = load_stream_metadata(conn, &keys).await? else {
        return finish_index(conn, &keys, force).await;
    };
    let groups: Vec<String> = meta
        .groups
        .iter()
        .map(|g| g.consumer_group.clone())
        .collect();
    for group in &groups {
        refuse_live(conn, &keys, &keys.group(group)?).await?;
    }
    if !force {
        refuse_data(conn, &keys, &meta).await?;
    }
    let mut keys_deleted = 0;
    for group in &groups {
        let group_keys = keys.group(group)?;
        match scripts::delete_group_keys(conn, &group_keys).await? {
            GroupKeysDeletion::Deleted(n) => keys_deleted += n,
            GroupKeysDeletion::Live(live) => {
                let now = scripts::stream_time(conn, &keys).await?;
                return Err(group_active(prefix, group, live, now));
            }
        }
        keys_deleted += del(conn, &[keys.dead_letters(&group_keys)]).await?;
    }
    let mut registered_dead_letters = Vec::with_capacity(groups.len());
    for group in &groups {
        registered_dead_letters.push(keys.dead_letters(&keys.group(group)?));
    }
    let mut orphan_dead_letters = Vec::new();
    for key in scan_dead_letters(conn, &keys).await? {
        if !registered_dead_letters.contains(&key) {
            keys_deleted += del(conn, std::slice::from_ref(&key)).await?;
            orphan_dead_letters.push(key);
        }
    }
    let mut shards_deleted = Vec::new();
    for shard in meta.shards.iter().map(|s| s.shard_index) {
        let mut shard_keys = vec![
            keys.shard(shard),
            keys.fence(shard),
            keys.attempts(shard),
            keys.gate_registry(shard),
        ];
        shard_keys.extend(scripts::registered_gates(conn, &keys, shard).await?);
        shard_keys.extend(scripts::legacy_gate_keys(&keys, &meta, shard));
        let existed: bool = conn
            .exists(&shard_keys[0])
            .await
            .map_err(StoreError::from)?;
        keys_deleted += del(conn, &shard_keys).await?;
        if existed {
            shards_deleted.push(shard);
        }
    }
    keys_deleted += del(conn, &[keys.metadata()]).await?;
    let _: u64 = conn
        .srem(STREAMS_INDEX_KEY, prefix)
        .await
        .map_err(StoreError::from)?;
    tracing::info!(
        stream = prefix,
        keys_deleted,
        forced = force,
        "stream deleted"
    );
    Ok(DeletedStream {
        stream_prefix: prefix.to_owned(),
        groups,
        orphan_dead_letters,
        shards_deleted,
        keys_deleted,
        forced: force,
    })
}

/// The metadata is gone: a previous run got past it and left (at most) the index entry.
async fn finish_index(
    conn: &mut RedisConnection,
    keys: &StreamKeys,
    force: bool,
) -> Result<DeletedStream, AdminError> {
    let removed: u64 = conn
        .srem(STREAMS_INDEX_KEY, keys.prefix())
        .await
        .map_err(StoreError::from)?;
    if removed == 0 {
        return Err(StoreError::MissingStream {
            prefix: keys.prefix().to_owned(),
            key: keys.metadata(),
        }
        .into());
    }
    Ok(DeletedStream {
        stream_prefix: keys.prefix().to_owned(),
        groups: Vec::new(),
        orphan_dead_letters: Vec::new(),
        shards_deleted: Vec::new(),
        keys_deleted: 0,
        forced: force,
    })
}

/// [`AdminError::StreamHasData`] for the first shard (ascending) on which a consumer group has
/// pending or unread entries (the read-only retirement check of docs/design.md §10.2).
async fn refuse_data(
    conn: &mut RedisConnection,
    keys: &StreamKeys,
    meta: &StreamMetadata,
) -> Result<(), AdminError> {
    for shard in meta
        .shards
        .iter()
        .filter(|s| s.state != ShardState::Retired)
    {
        let (group, detail) =
            match scripts::retire_shard(conn, keys, meta, shard.shard_index, false).await? {
                RetireCheck::Pending { group, count } => {
                    (group, format!("{count} pending entries"))
                }
                RetireCheck::Unread { group, next_id } => {
                    (group, format!("unread entries from {next_id}"))
                }
                RetireCheck::Gone | RetireCheck::Clear | RetireCheck::Deleted => continue,
            };
        return Err(AdminError::StreamHasData {
            prefix: keys.prefix().to_owned(),
            group,
            shard: shard.shard_index,
            detail,
        });
    }
    Ok(())
}

/// `DEL` of keys of one slot; how many existed.
async fn del(conn: &mut RedisConnection, keys: &[String]) -> Result<u64, AdminError> {
    Ok(conn.del(keys).await.map_err(StoreError::from)?)
}

/// The stream keys named `<prefix>:dlq:<group>` on every master (standalone: the server), with
/// `<group>` a valid group name (no `:`, so the key is not a dead-letter stream of a longer
/// prefix such as `<prefix>:dlq:x`), sorted.
async fn scan_dead_letters(
    conn: &mut RedisConnection,
    keys: &StreamKeys,
) -> Result<Vec<String>, AdminError> {
    let head = format!("{}:dlq:", keys.prefix());
    let pattern = format!("{}*", glob_escape(&head));
    let mut found = Vec::new();
    for node in scan_targets(conn).await? {
        let mut cursor = "0".to_owned();
        loop {
            let mut cmd = redis::cmd("SCAN");
            cmd.arg(&cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(1000)
                .arg("TYPE")
                .arg("stream");
            let reply = match (&node, &mut *conn) {
                (Some(route), RedisConnection::Cluster(cluster, _)) => {
                    cluster.route_command(cmd, route.clone()).await
                }
                _ => cmd.query_async(conn).await,
            };
            let (next, batch): (String, Vec<String>) =
                redis::from_redis_value(reply.map_err(StoreError::from)?)
                    .map_err(|e| StoreError::from(redis::RedisError::from(e)))?;
            found.extend(batch.into_iter().filter(|key| {
                key.strip_prefix(&head)
                    .is_some_and(|group| crate::keys::validate_group_name(group).is_ok())
            }));
            if next == "0" {
                break;
            }
            cursor = next;
        }
    }
    found.sort();
    found.dedup();
    Ok(found)
}

/// Where to `SCAN`: `None` (the connection itself) on a standalone server; each master of a
/// cluster by address, from `CLUSTER NODES` (every `master` that owns slots, failing or not:
/// an unreachable one fails the delete).
async fn scan_targets(conn: &mut RedisConnection) -> Result<Vec<Option<RoutingInfo>>, AdminError> {
    if !conn.is_cluster() {
        return Ok(vec![None]);
    }
    let nodes: String = redis::cmd("CLUSTER")
        .arg("NODES")
        .query_async(conn)
        .await
        .map_err(StoreError::from)?;
    let mut targets = Vec::new();
    for line in nodes.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (Some(addr), Some(flags)) = (fields.get(1), fields.get(2)) else {
            continue;
        };
        // Every master that owns slots, failing or not: a master in PFAIL/FAIL that still owns
        // slots holds keys of its slots, and a SCAN it cannot answer fails the delete loudly
        // (run it again once the cluster is healthy) instead of skipping its keys. A master
        // without slots (one that failed over, or a new empty one) holds none.
        let owns_slots = fields.len() > 8;
        if !flags.split(',').any(|f| f == "master") || !owns_slots {
            continue;
        }
        // `ip:port@cport[,hostname]`
        let addr = addr.split('@').next().unwrap_or_default();
        let Some((host, port)) = addr.rsplit_once(':') else {
            continue;
        };
        let Ok(port) = port.parse::<u16>() else {
            continue;
        };
        targets.push(Some(RoutingInfo::SingleNode(
            SingleNodeRoutingInfo::ByAddress {
                host: host.to_owned(),
                port,
            },
        )));
    }
    Ok(targets)
}

/// `text` with the glob characters of `SCAN MATCH` escaped.
fn glob_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::glob_escape;

    #[test]
    fn scan_patterns_escape_glob_characters() {
        assert_eq!(glob_escape("orders:dlq:"), "orders:dlq:");
        assert_eq!(glob_escape("a*b?[c]\\"), "a\\*b\\?\\[c\\]\\\\");
    }
}
