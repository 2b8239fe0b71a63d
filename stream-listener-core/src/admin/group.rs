//! Group-level admin operations: register and delete (docs/design.md §2, §8).

use redis::AsyncCommands;
use serde::Serialize;

use super::scripts::{self, GroupKeysDeletion};
use super::{
    AdminError, CAS_ATTEMPTS, GroupRegistration, backoff, ceil_ms, contended, load_required,
    open_group, write_next_version,
};
use crate::connection::RedisConnection;
use crate::coordinator::CoordinatorConfig;
use crate::model::{ShardIndex, ShardState, StartFrom};
use crate::store::provision;
use crate::store::{StoreError, StreamCas};

/// Registers consumer group `group` on stream `prefix`, for operators:
/// [`crate::store::provision::register_group`] (which says what is created, under which
/// compare-and-set, and when it is a no-op).
///
/// # Errors
/// [`AdminError::InvalidName`] for a bad prefix or group name (nothing written);
/// [`AdminError::Store`]: unknown stream ([`StoreError::MissingStream`]), Redis failure, corrupt
/// metadata, or [`StoreError::Contended`].
pub async fn register_group(
    conn: &mut RedisConnection,
    prefix: &str,
    group: &str,
    start_from: StartFrom,
) -> Result<GroupRegistration, AdminError> {
    Ok(provision::register_group(conn, prefix, group, start_from).await?)
}

/// The result of [`delete_group`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DeletedGroup {
    /// The stream prefix.
    pub stream_prefix: String,
    /// The consumer group.
    pub consumer_group: String,
    /// How many of the group hash, leases and history existed and were deleted (0 to 3).
    pub keys_deleted: u64,
    /// Whether the group was removed from the stream metadata's `groups` by this call.
    pub unregistered: bool,
    /// Shards whose consumer group was destroyed (`XGROUP DESTROY`), ascending.
    pub destroyed_on: Vec<ShardIndex>,
    /// The dead-letter stream `<prefix>:dlq:<group>`.
    pub dead_letter_stream: String,
    /// Its length before the call.
    pub dead_letters: u64,
    /// Whether it was kept (`--keep-dead-letters`); otherwise it was deleted.
    #[serde(default)]
    pub dead_letters_kept: bool,
    /// The stream's `metadataVersion` after the call.
    pub metadata_version: u64,
}

/// Deletes consumer group `group` of stream `prefix`, which must be inactive: no member's lease
/// runs past Redis `TIME` (judged from the loaded group at its load time, then again atomically
/// by the script that deletes its keys, on the leases sorted set).
///
/// In this order, so that a crash leaves a state the next call finishes: the group hash, leases
/// and history are deleted (one script on the group's slot); the group is removed from the stream
/// metadata's `groups` (compare-and-set, `metadataVersion` bumped); its consumer group is
/// destroyed, and its fence fields and handler-attempt fields cleared, on every shard that is not
/// RETIRED (ACTIVE, DRAINING and RETIRING: a RETIRED shard's keys are gone); last the dead-letter
/// stream `<prefix>:dlq:<group>` is deleted ([`delete_group_with`] can keep it). So no key of the
/// group is left (docs/design.md §2). A group whose metadata is missing or corrupt can be
/// deleted (that is how lost group metadata is cleared). Members of the group must be stopped
/// first: a member starting during the deletion may re-register the group.
///
/// # Errors
/// [`AdminError::InvalidName`]; [`AdminError::GroupActive`] while a member's lease runs (nothing
/// deleted); [`AdminError::Store`]: unknown stream, [`StoreError::UnknownGroup`] when nothing of
/// the group exists (nothing changed), Redis failure, or [`StoreError::Contended`].
pub async fn delete_group(
    conn: &mut RedisConnection,
    prefix: &str,
    group: &str,
) -> Result<DeletedGroup, AdminError> {
    delete_group_with(conn, prefix, group, false).await
}

/// [`delete_group`], keeping the group's dead-letter stream when `keep_dead_letters` (for
/// `stream-listener group delete --keep-dead-letters`: dead letters to inspect or replay by
/// hand). A kept dead-letter stream is met again by a group registered later under the name.
///
/// # Errors
/// As [`delete_group`].
pub async fn delete_group_with(
    conn: &mut RedisConnection,
    prefix: &str,
    group: &str,
    keep_dead_letters: bool,
) -> Result<DeletedGroup, AdminError> {
    let (keys, group_keys, meta, mut store) =
        open_group(conn, prefix, group, CoordinatorConfig::default()).await?;
    let registered = meta.groups.iter().any(|g| g.consumer_group == group);
    // Missing or unreadable: deleted all the same; the leases are checked by the script.
    super::liveness::refuse_live_in_loaded(&mut store, prefix, group).await?;
    let keys_deleted = match scripts::delete_group_keys(conn, &group_keys).await? {
        GroupKeysDeletion::Deleted(n) => n,
        GroupKeysDeletion::Live(live) => {
            let now = scripts::stream_time(conn, &keys).await?;
            return Err(group_active(prefix, group, live, now));
        }
    };
    let mut meta = meta;
    let mut unregistered = false;
    if registered {
        let mut done = false;
        for attempt in 1..=CAS_ATTEMPTS {
            let current = load_required(conn, &keys).await?;
            if !current.groups.iter().any(|g| g.consumer_group == group) {
                meta = current;
                done = true;
                break;
            }
            let mut next = current.clone();
            next.groups.retain(|g| g.consumer_group != group);
            let now = scripts::stream_time(conn, &keys).await?;
            match write_next_version(conn, &keys, &current, &mut next, now).await? {
                StreamCas::Written => {
                    meta = next;
                    unregistered = true;
                    done = true;
                    break;
                }
                StreamCas::Conflict => backoff(attempt).await,
            }
        }
        if !done {
            return Err(contended("unregistering the consumer group"));
        }
    }
    let mut destroyed_on = Vec::new();
    for shard in &meta.shards {
        if shard.state != ShardState::Retired
            && scripts::destroy_group(conn, &keys, shard.shard_index, group).await?
        {
            destroyed_on.push(shard.shard_index);
        }
    }
    let dead_letter_stream = keys.dead_letters(&group_keys);
    let (dead_letter_key, dead_letters) = dead_letter_count(conn, &dead_letter_stream).await?;
    // A dead-letter stream left by an earlier run (or a kept one) is the group's too.
    let dead_letters_gone = !keep_dead_letters && dead_letter_key;
    if !registered && keys_deleted == 0 && destroyed_on.is_empty() && !dead_letters_gone {
        return Err(StoreError::UnknownGroup {
            prefix: prefix.to_owned(),
            group: group.to_owned(),
        }
        .into());
    }
    if dead_letters_gone {
        let _: u64 = conn
            .del(&dead_letter_stream)
            .await
            .map_err(StoreError::from)?;
    }
    Ok(DeletedGroup {
        stream_prefix: prefix.to_owned(),
        consumer_group: group.to_owned(),
        keys_deleted,
        unregistered,
        destroyed_on,
        dead_letter_stream,
        dead_letters,
        dead_letters_kept: keep_dead_letters,
        metadata_version: meta.metadata_version,
    })
}

/// Whether the key `<prefix>:dlq:<group>` exists, and its length when it is a stream (0 when it
/// holds another type, written by hand: it is the group's key by name all the same, so
/// `group delete` removes it rather than failing on `XLEN` at every run).
async fn dead_letter_count(
    conn: &mut RedisConnection,
    key: &str,
) -> Result<(bool, u64), AdminError> {
    let kind: String = redis::cmd("TYPE")
        .arg(key)
        .query_async(conn)
        .await
        .map_err(StoreError::from)?;
    Ok(match kind.as_str() {
        "none" => (false, 0),
        "stream" => (true, conn.xlen(key).await.map_err(StoreError::from)?),
        _ => (true, 0),
    })
}

pub(super) fn group_active(
    prefix: &str,
    group: &str,
    live: Vec<(String, u64)>,
    now: u64,
) -> AdminError {
    let last = live.iter().map(|(_, expiry)| *expiry).max().unwrap_or(now);
    AdminError::GroupActive {
        prefix: prefix.to_owned(),
        group: group.to_owned(),
        members: live.into_iter().map(|(member, _)| member).collect(),
        wait_ms: ceil_ms(last.saturating_sub(now)),
    }
}
