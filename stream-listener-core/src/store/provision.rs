//! Provisioning at startup and by the admin tool (docs/design.md §2, §3, §8): creating a sharded
//! stream and registering a consumer group on it, with the shard scripts and compare-and-set
//! helpers both need. The runtime provisions through these functions (a listener registers its
//! group, a member re-provisions lost metadata); `crate::admin` wraps them for operators.

use std::collections::BTreeSet;
use std::sync::LazyLock;
use std::time::Duration;

use redis::Script;
use serde::Serialize;

use super::{GroupStore, StoreError, StreamCas, load_stream_metadata, write_stream_metadata};
use crate::connection::RedisConnection;
use crate::coordinator::{CoordinatorConfig, rfc3339};
use crate::gates::GATE_LUA;
use crate::keys::{NameError, StreamKeys};
use crate::model::{
    Micros, RegisteredGroup, ShardIndex, ShardInfo, ShardState, StartFrom, StreamMetadata,
};

/// Largest shard count a stream may have ([`create_stream`], `admin::scale`). Each shard is a
/// stream, a fence and, on a cluster, possibly another node to talk to; the heartbeat and
/// assignor costs grow with it too (docs/design.md §5's goal is 1,000 shards).
pub const MAX_SHARDS: u32 = 1024;

/// Compare-and-set attempts of one operation on the stream metadata before
/// [`StoreError::Contended`].
pub const CAS_ATTEMPTS: u32 = 16;

/// Why [`create_stream`] or [`register_group`] failed. Nothing was written, or a step was left
/// that the next call finishes (both are idempotent).
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum ProvisionError {
    /// A stream of 0 shards.
    #[error("stream {prefix:?} needs at least 1 shard")]
    ZeroShards {
        /// The stream prefix.
        prefix: String,
    },
    /// A shard count above [`MAX_SHARDS`].
    #[error("stream {prefix:?}: {requested} shards is above the limit of {max}")]
    TooManyShards {
        /// The stream prefix.
        prefix: String,
        /// The requested count.
        requested: u32,
        /// [`MAX_SHARDS`].
        max: u32,
    },
    /// The stream exists with another shard count.
    #[error("stream {prefix:?} exists with {existing} shards, not {requested}")]
    ShardCountMismatch {
        /// The stream prefix.
        prefix: String,
        /// Its shard count.
        existing: u32,
        /// The requested count.
        requested: u32,
    },
    /// Redis failed, the stream is unknown, its metadata is corrupt, or the compare-and-set kept
    /// conflicting.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A stream prefix or group name that cannot be used (docs/design.md §2).
    #[error(transparent)]
    InvalidName(#[from] NameError),
}

crate::report::readable_debug!(ProvisionError);

/// The stream metadata, or [`StoreError::MissingStream`].
pub(crate) async fn load_required(
    conn: &mut RedisConnection,
    keys: &StreamKeys,
) -> Result<StreamMetadata, StoreError> {
    load_stream_metadata(conn, keys)
        .await?
        .ok_or_else(|| StoreError::MissingStream {
            prefix: keys.prefix().to_owned(),
            key: keys.metadata(),
        })
}

/// The error after [`CAS_ATTEMPTS`] conflicts.
pub(crate) fn contended(what: &'static str) -> StoreError {
    StoreError::Contended {
        what,
        attempts: CAS_ATTEMPTS,
    }
}

/// Sleeps a random `[0, min(2^attempt, 64)]` ms before the next compare-and-set attempt.
pub(crate) async fn backoff(attempt: u32) {
    let cap = 1u64 << attempt.min(6);
    tokio::time::sleep(Duration::from_micros(rand::random_range(0..=cap * 1000))).await;
}

/// The result of [`create_stream`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CreatedStream {
    /// `true` when this call created the stream; `false` when it already existed with the same
    /// shard count (nothing was changed then).
    pub created: bool,
    /// The stream metadata as stored.
    pub metadata: StreamMetadata,
}

pub(crate) fn check_shard_count(
    prefix: &str,
    count: u32,
    allow_zero: bool,
) -> Result<(), ProvisionError> {
    if count == 0 && !allow_zero {
        return Err(ProvisionError::ZeroShards {
            prefix: prefix.to_owned(),
        });
    }
    if count > MAX_SHARDS {
        return Err(ProvisionError::TooManyShards {
            prefix: prefix.to_owned(),
            requested: count,
            max: MAX_SHARDS,
        });
    }
    Ok(())
}

/// Creates the sharded stream `prefix` with `shards` shards (docs/design.md §2, §3): the shard
/// streams `{prefix:0}`..`{prefix:shards-1}` (empty, so producers' `XADD ... NOMKSTREAM` finds
/// them), then the stream metadata `sl:{prefix}:stream` with every shard ACTIVE, `metadataVersion`
/// 1 and no registered group, by a compare-and-set that only creates (the prefix is added to
/// `sl:streams`).
///
/// Idempotent: when the stream exists with `shards` shards, nothing is changed and
/// [`CreatedStream::created`] is `false`. Shard streams left by an earlier attempt that crashed
/// before writing the metadata are kept as they are.
///
/// # Errors
/// Before anything is written: [`ProvisionError::InvalidName`] for a prefix with `{`, `}`,
/// whitespace or control characters, or empty; [`ProvisionError::ZeroShards`];
/// [`ProvisionError::TooManyShards`] above [`MAX_SHARDS`]; [`ProvisionError::ShardCountMismatch`]
/// when the stream exists with another count (use `admin::scale`). [`ProvisionError::Store`] when
/// Redis fails or the existing metadata cannot be read.
pub async fn create_stream(
    conn: &mut RedisConnection,
    prefix: &str,
    shards: u32,
) -> Result<CreatedStream, ProvisionError> {
    let keys = StreamKeys::new(prefix)?;
    check_shard_count(prefix, shards, false)?;
    for attempt in 1..=CAS_ATTEMPTS {
        if let Some(existing) = load_stream_metadata(conn, &keys).await? {
            if existing.shard_count == shards {
                return Ok(CreatedStream {
                    created: false,
                    metadata: existing,
                });
            }
            return Err(ProvisionError::ShardCountMismatch {
                prefix: prefix.to_owned(),
                existing: existing.shard_count,
                requested: shards,
            });
        }
        for shard in 0..shards {
            ensure_shard(conn, &keys, shard, true, &[]).await?;
        }
        let now = stream_time(conn, &keys).await?;
        let mut meta = StreamMetadata {
            stream_prefix: prefix.to_owned(),
            shard_count: shards,
            shards: (0..shards)
                .map(|shard_index| ShardInfo {
                    shard_index,
                    state: ShardState::Active,
                })
                .collect(),
            metadata_version: 1,
            groups: Vec::new(),
            migration: None,
            updated_at: rfc3339(now),
            revision: 0,
        };
        match write_stream_metadata(conn, &keys, None, &mut meta).await? {
            StreamCas::Written => {
                return Ok(CreatedStream {
                    created: true,
                    metadata: meta,
                });
            }
            // Created concurrently: the next round compares the counts.
            StreamCas::Conflict => backoff(attempt).await,
        }
    }
    Err(ProvisionError::Store(contended("creating the stream")))
}

/// The result of [`register_group`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GroupRegistration {
    /// The stream prefix.
    pub stream_prefix: String,
    /// The consumer group.
    pub consumer_group: String,
    /// `true` when this call registered the group; `false` when it was already registered
    /// (nothing was changed then).
    pub registered: bool,
    /// The registered `startFrom`: the stored one when the group was already registered (a
    /// different `start_from` argument does not change it; it only matters at registration).
    pub start_from: StartFrom,
    /// The stream's `metadataVersion` after the call.
    pub metadata_version: u64,
}

/// The start id of `XGROUP CREATE` for `start_from` (docs/design.md §8).
fn start_id(start_from: StartFrom) -> &'static str {
    match start_from {
        StartFrom::Earliest => "0",
        StartFrom::Latest => "$",
    }
}

/// Registers consumer group `group` on stream `prefix` (docs/design.md §8): what a member does when
/// it joins a group the stream metadata does not list.
///
/// Under the stream metadata's compare-and-set, retried on conflicts (at most [`CAS_ATTEMPTS`]):
/// the consumer group is created on every readable shard, from `0` (or `$` for
/// [`StartFrom::Latest`]; `BUSYGROUP` ignored: an existing consumer group keeps its position),
/// then the group metadata is provisioned ([`GroupStore::provision`], `after_loss = false`;
/// no-op when it exists), and only then the compare-and-set adds the group to `groups` and bumps
/// `metadataVersion`. A scale-out re-reads `groups` under the same compare-and-set
/// (`admin::scale`), and this function re-reads the readable shards on every attempt, so
/// neither can leave a shard without the consumer group. A missing ACTIVE shard stream is
/// created; a missing DRAINING one is not (it may just have been retired). A consumer group that
/// an earlier attempt created on a shard that has become RETIRING meanwhile is destroyed again
/// (the group never read it, and it would block the shard's deletion).
///
/// Idempotent: an already registered group is left as it is (`registered: false`); in
/// particular its group metadata is not re-created when missing: that is lost metadata, which
/// fails closed (docs/design.md §5).
///
/// # Errors
/// [`ProvisionError::InvalidName`] for a bad prefix or group name (nothing written);
/// [`ProvisionError::Store`]: unknown stream ([`StoreError::MissingStream`]), Redis failure,
/// corrupt metadata, or [`StoreError::Contended`].
pub async fn register_group(
    conn: &mut RedisConnection,
    prefix: &str,
    group: &str,
    start_from: StartFrom,
) -> Result<GroupRegistration, ProvisionError> {
    let keys = StreamKeys::new(prefix)?;
    let group_keys = keys.group(group)?;
    let id = start_id(start_from);
    let mut touched: BTreeSet<ShardIndex> = BTreeSet::new();
    let mut provisioned = false;
    let outcome = |registered, start_from, metadata_version| GroupRegistration {
        stream_prefix: prefix.to_owned(),
        consumer_group: group.to_owned(),
        registered,
        start_from,
        metadata_version,
    };
    for attempt in 1..=CAS_ATTEMPTS {
        let meta = load_required(conn, &keys).await?;
        if let Some(existing) = meta.groups.iter().find(|g| g.consumer_group == group) {
            let start_from = existing.start_from;
            undo_on_retiring(conn, &keys, &meta, &touched, group).await?;
            return Ok(outcome(false, start_from, meta.metadata_version));
        }
        for shard in &meta.shards {
            if shard.state.is_readable() {
                let create_missing = shard.state == ShardState::Active;
                ensure_shard(
                    conn,
                    &keys,
                    shard.shard_index,
                    create_missing,
                    &[(group, id)],
                )
                .await?;
                touched.insert(shard.shard_index);
            }
        }
        if !provisioned {
            GroupStore::new(
                conn.clone(),
                keys.clone(),
                group_keys.clone(),
                CoordinatorConfig::default(),
            )
            .provision(false)
            .await?;
            provisioned = true;
        }
        let now = stream_time(conn, &keys).await?;
        let mut next = meta.clone();
        next.groups.push(RegisteredGroup {
            consumer_group: group.to_owned(),
            start_from,
        });
        next.metadata_version += 1;
        next.updated_at = rfc3339(now);
        match write_stream_metadata(conn, &keys, Some(meta.revision), &mut next).await? {
            StreamCas::Written => {
                undo_on_retiring(conn, &keys, &next, &touched, group).await?;
                return Ok(outcome(true, start_from, next.metadata_version));
            }
            StreamCas::Conflict => backoff(attempt).await,
        }
    }
    Err(contended("registering the consumer group").into())
}

/// Destroys the consumer group on shards in `touched` that are RETIRING in `meta`: created by an
/// attempt that raced with the shard's retirement check, it would block the deletion forever.
async fn undo_on_retiring(
    conn: &mut RedisConnection,
    keys: &StreamKeys,
    meta: &StreamMetadata,
    touched: &BTreeSet<ShardIndex>,
    group: &str,
) -> Result<(), ProvisionError> {
    for shard in &meta.shards {
        if shard.state == ShardState::Retiring && touched.contains(&shard.shard_index) {
            destroy_group(conn, keys, shard.shard_index, group).await?;
        }
    }
    Ok(())
}

/// A consumer group name that no valid group can have (it contains `:`): used for a moment to
/// create an empty shard stream with `XGROUP CREATE ... MKSTREAM`.
const PROVISION_GROUP: &str = "sl:provision";

/// Redis `TIME` of the node that owns KEYS[1]. Returns {seconds, microseconds}.
fn time_script() -> &'static Script {
    static SCRIPT: LazyLock<Script> =
        LazyLock::new(|| Script::new("local t = redis.call('TIME') return {t[1], t[2]}"));
    &SCRIPT
}

/// Makes sure a shard stream exists and has the given consumer groups.
/// KEYS[1] shard stream. ARGV[1] `1` to create the stream when missing (`0`: leave it missing),
/// ARGV[2] the provisioning group name, then consumer group / start id pairs. `BUSYGROUP` is
/// ignored (an existing group keeps its position). Returns {exists (0/1), groups created}.
fn ensure_shard_script() -> &'static Script {
    static SCRIPT: LazyLock<Script> = LazyLock::new(|| {
        Script::new(
            r"
local t = redis.call('TYPE', KEYS[1]).ok
if t == 'none' then
  if ARGV[1] ~= '1' then return {0, 0} end
  redis.call('XGROUP', 'CREATE', KEYS[1], ARGV[2], '$', 'MKSTREAM')
  redis.call('XGROUP', 'DESTROY', KEYS[1], ARGV[2])
elseif t ~= 'stream' then
  return redis.error_reply('key ' .. KEYS[1] .. ' holds a ' .. t .. ', not a stream: it cannot be a shard stream')
end
local created = 0
for i = 3, #ARGV, 2 do
  local r = redis.pcall('XGROUP', 'CREATE', KEYS[1], ARGV[i], ARGV[i + 1])
  if type(r) == 'table' and r.err then
    if not string.find(r.err, 'BUSYGROUP', 1, true) then return redis.error_reply(r.err) end
  else
    created = created + 1
  end
end
return {1, created}
",
        )
    });
    &SCRIPT
}

/// Removes one consumer group from a shard: `XGROUP DESTROY` when the stream exists, the
/// group's field of the fence and its handler-attempt counts (docs/design.md §8.9: fields
/// `<group>|<entry id>`; a group registered again under the name reads the same entry ids and
/// must not meet the old counts). KEYS[1] shard stream, KEYS[2] fence, KEYS[3] attempt hash,
/// KEYS[4..5] (when given) the shard's gate registry and the group's gate of versions before
/// gates were per token: the group's read gates on the shard are deleted. ARGV[1] group. Returns
/// 1 when a consumer group was destroyed.
fn destroy_group_script() -> &'static Script {
    static SCRIPT: LazyLock<Script> = LazyLock::new(|| {
        Script::new(&format!(
            "{GATE_LUA}{}",
            r"
-- A fence of another type (written by hand) is the shard's, not the group's: left as it is.
if redis.call('TYPE', KEYS[2]).ok == 'hash' then redis.call('HDEL', KEYS[2], ARGV[1]) end
-- The group's read gates on this shard (docs/design.md §8.16).
if KEYS[4] then
  redis.call('DEL', KEYS[5])
  close_gates(KEYS[4], KEYS[1] .. ':gate:' .. ARGV[1] .. ':', '')
end
-- The entry id after the last '|' has none: a field of group 'a|b' is not one of group 'a'.
if redis.call('TYPE', KEYS[3]).ok == 'hash' then
  local prefix = ARGV[1] .. '|'
  local gone = {}
  for _, field in ipairs(redis.call('HKEYS', KEYS[3])) do
    if string.sub(field, 1, #prefix) == prefix and not string.find(field, '|', #prefix + 1, true) then
      gone[#gone + 1] = field
    end
  end
  for i = 1, #gone, 500 do
    redis.call('HDEL', KEYS[3], unpack(gone, i, math.min(i + 499, #gone)))
  end
end
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
return redis.call('XGROUP', 'DESTROY', KEYS[1], ARGV[1])
"
        ))
    });
    &SCRIPT
}

/// Redis `TIME` (µs) of the node that owns the stream metadata key, so every admin decision about
/// one stream reads the same clock (the routing lease of docs/design.md §10 is measured with it).
pub(crate) async fn stream_time(
    conn: &mut RedisConnection,
    keys: &StreamKeys,
) -> Result<Micros, StoreError> {
    let (secs, micros): (u64, u64) = time_script()
        .key(keys.metadata())
        .invoke_async(conn)
        .await?;
    Ok(secs * 1_000_000 + micros)
}

/// Ensures shard `shard` exists (when `create_missing`) and has the consumer groups `groups`
/// (name, start id `0` or `$`). Returns whether the stream exists afterwards.
pub(crate) async fn ensure_shard(
    conn: &mut RedisConnection,
    keys: &StreamKeys,
    shard: ShardIndex,
    create_missing: bool,
    groups: &[(&str, &str)],
) -> Result<bool, StoreError> {
    let mut invocation = ensure_shard_script().prepare_invoke();
    invocation
        .key(keys.shard(shard))
        .arg(if create_missing { "1" } else { "0" })
        .arg(PROVISION_GROUP);
    for (group, id) in groups {
        invocation.arg(*group).arg(*id);
    }
    let (exists, _created): (i64, i64) = invocation.invoke_async(conn).await?;
    Ok(exists == 1)
}

/// Destroys consumer group `group` on shard `shard`, clears its fence field and its attempt
/// counts, and deletes its read gates there (docs/design.md §8.16); returns whether a consumer
/// group was destroyed.
pub(crate) async fn destroy_group(
    conn: &mut RedisConnection,
    keys: &StreamKeys,
    shard: ShardIndex,
    group: &str,
) -> Result<bool, StoreError> {
    let mut invocation = destroy_group_script().prepare_invoke();
    invocation
        .key(keys.shard(shard))
        .key(keys.fence(shard))
        .key(keys.attempts(shard));
    // A name the key layout refuses has no gate: no listener could have created one.
    if let Ok(group_keys) = keys.group(group) {
        invocation
            .key(keys.gate_registry(shard))
            .key(keys.legacy_gate(shard, &group_keys));
    }
    let destroyed: i64 = invocation.arg(group).invoke_async(conn).await?;
    Ok(destroyed == 1)
}
