//! The Lua scripts of the admin operations, and typed calls of them. Each script touches keys of
//! one hash slot only (docs/design.md §2): a shard stream with its fence, or a group's keys.
//!
//! Scripts read `XINFO GROUPS` in RESP2 form (arrays of name/value pairs) whatever protocol the
//! client speaks, and answer with strings only, so the replies parse the same on every setup.

use std::sync::LazyLock;

use redis::Script;

use crate::connection::RedisConnection;
use crate::gates::GATE_LUA;
use crate::keys::{GroupKeys, StreamKeys};
use crate::model::{Micros, ShardIndex, StreamMetadata};
use crate::store::StoreError;
pub(crate) use crate::store::provision::{destroy_group, ensure_shard, stream_time};

/// The retirement check of docs/design.md §10, and the deletion when it passes.
/// KEYS[1] shard stream, KEYS[2] its fence. ARGV[1] `check` (read only) or `delete`.
/// For every consumer group `XINFO GROUPS` lists: `pending` must be 0 and
/// `XRANGE (<last-delivered-id> + COUNT 1` empty (lag is not trusted: after a trim or an `XDEL` of
/// the tail the last delivered id may never equal the last generated one).
/// Returns {'gone'} (no stream; with `delete` the fence is deleted too), {'clear'} (check passed),
/// {'deleted'} (stream and fence deleted), {'pending', group, count} or {'unread', group, first
/// unread id}. KEYS[3], the shard's handler-attempt hash (docs/design.md §8.9), is deleted with the
/// fence: nothing is pending any more, so any count in it is stale; so are the shard's read gates
/// (docs/design.md §8.16), those its registry KEYS[4] lists and KEYS[5..], the registered groups'
/// gates of versions before gates were per token.
fn retire_script() -> &'static Script {
    static SCRIPT: LazyLock<Script> = LazyLock::new(|| {
        Script::new(&format!(
            "{GATE_LUA}{}",
            r"
local function delete_all()
  close_gates(KEYS[4], KEYS[1] .. ':gate:', '')
  redis.call('DEL', unpack(KEYS))
end
if redis.call('EXISTS', KEYS[1]) == 0 then
  if ARGV[1] == 'delete' then delete_all() end
  return {'gone'}
end
for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  local info = {}
  for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
  if tonumber(info['pending']) > 0 then
    return {'pending', info['name'], tostring(info['pending'])}
  end
  -- Nothing follows the largest possible id, and Redis refuses '(' after it.
  local last = info['last-delivered-id']
  if last ~= '18446744073709551615-18446744073709551615' then
    local after = redis.call('XRANGE', KEYS[1], '(' .. last, '+', 'COUNT', 1)
    if #after > 0 then return {'unread', info['name'], after[1][1]} end
  end
end
if ARGV[1] == 'delete' then
  delete_all()
  return {'deleted'}
end
return {'clear'}
"
        ))
    });
    &SCRIPT
}

/// Length and consumer groups of a shard stream. KEYS[1] shard stream.
/// Returns {exists (0/1), XLEN, groups}: each group {name, consumers, pending, last-delivered-id,
/// entries-read or '', lag or ''} as strings ('' where Redis answers nil).
fn shard_info_script() -> &'static Script {
    static SCRIPT: LazyLock<Script> = LazyLock::new(|| {
        Script::new(
            r"
if redis.call('EXISTS', KEYS[1]) == 0 then return {0, 0, {}} end
local out = {}
for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  local info = {}
  for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
  local read = info['entries-read']
  local lag = info['lag']
  out[#out + 1] = {info['name'], tostring(info['consumers']), tostring(info['pending']),
    info['last-delivered-id'], read and tostring(read) or '', lag and tostring(lag) or ''}
end
return {1, redis.call('XLEN', KEYS[1]), out}
",
        )
    });
    &SCRIPT
}

/// Lua: `live_leases(leases, group, now)`, the members whose lease runs past `now` (µs) as a
/// flat `{member, expiry µs, ...}` list (at most 20 members): from the leases sorted set, or,
/// when that key holds another Redis type (written by hand: no member can heartbeat against
/// it), from the `memberLeaseExpiresAt` of the group hash's `member:<id>` JSON (the lease of
/// the last full transition; fast-path renewals were in the sorted set only), so a corrupt
/// leases key neither hides a member whose JSON lease runs nor makes the group impossible to
/// delete.
/// Lease times are whole µs below 2^53: exact as Lua numbers.
pub(crate) const LIVE_LEASES_LUA: &str = r"
local function live_leases(leases, group, now)
  local kind = redis.call('TYPE', leases).ok
  if kind == 'zset' or kind == 'none' then
    return redis.call('ZRANGEBYSCORE', leases, '(' .. string.format('%.0f', now), '+inf',
      'WITHSCORES', 'LIMIT', 0, 20)
  end
  local out = {}
  if redis.call('TYPE', group).ok ~= 'hash' then return out end
  local fields = redis.call('HGETALL', group)
  for i = 1, #fields, 2 do
    if string.sub(fields[i], 1, 7) == 'member:' and #out < 40 then
      local ok, m = pcall(cjson.decode, fields[i + 1])
      local at = ok and type(m) == 'table' and tonumber(m.memberLeaseExpiresAt)
      if at and at > now then
        out[#out + 1] = string.sub(fields[i], 8)
        out[#out + 1] = string.format('%.0f', at)
      end
    end
  end
  return out
end
";

/// Deletes a group's coordinator keys if no member's lease runs past Redis `TIME`
/// ([`LIVE_LEASES_LUA`]). KEYS[1] group hash, KEYS[2] leases, KEYS[3] history.
/// Returns {'deleted', keys deleted} or {'live', member, expiry µs, ...} (at most 20 members).
fn delete_group_keys_script() -> &'static Script {
    static SCRIPT: LazyLock<Script> = LazyLock::new(|| {
        Script::new(&format!(
            "{LIVE_LEASES_LUA}{}",
            r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local live = live_leases(KEYS[2], KEYS[1], now)
if #live > 0 then
  local out = {'live'}
  for _, v in ipairs(live) do out[#out + 1] = v end
  return out
end
return {'deleted', tostring(redis.call('DEL', KEYS[1], KEYS[2], KEYS[3]))}
"
        ))
    });
    &SCRIPT
}

/// The read gates of versions before gates were per token ([`StreamKeys::legacy_gate`]) of
/// shard `shard` for every group `meta` registers: deleted wherever the shard's keys are. A group
/// of another process's making has none: a gate is created only by a listener of a registered
/// group. Today's gates are listed in the shard's registry ([`StreamKeys::gate_registry`]).
pub(crate) fn legacy_gate_keys(
    keys: &StreamKeys,
    meta: &StreamMetadata,
    shard: ShardIndex,
) -> Vec<String> {
    meta.groups
        .iter()
        .filter_map(|g| keys.group(&g.consumer_group).ok())
        .map(|group| keys.legacy_gate(shard, &group))
        .collect()
}

/// The read gates shard `shard`'s registry lists ([`StreamKeys::gate_registry`], docs/design.md
/// §8.16), each a key of the shard's slot; none when the registry is missing.
///
/// # Errors
/// [`StoreError`] when Redis fails, or the registry is not a set (`WRONGTYPE`: written by hand;
/// delete it and the gates `{<prefix>:<i>}:gate:*` by hand).
pub(crate) async fn registered_gates(
    conn: &mut RedisConnection,
    keys: &StreamKeys,
    shard: ShardIndex,
) -> Result<Vec<String>, StoreError> {
    let gates: Vec<String> = redis::cmd("SMEMBERS")
        .arg(keys.gate_registry(shard))
        .query_async(conn)
        .await?;
    Ok(gates)
}

/// What the retirement script found on a shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RetireCheck {
    /// The stream does not exist (already deleted).
    Gone,
    /// Every group has read and acknowledged everything (check only).
    Clear,
    /// Stream and fence deleted.
    Deleted,
    /// A group has pending entries.
    Pending { group: String, count: u64 },
    /// A group has entries after its last delivered id.
    Unread { group: String, next_id: String },
}

/// Runs the retirement script on shard `shard`: only the check, or the check and the deletion
/// (with the shard's read gates).
pub(crate) async fn retire_shard(
    conn: &mut RedisConnection,
    keys: &StreamKeys,
    meta: &StreamMetadata,
    shard: ShardIndex,
    delete: bool,
) -> Result<RetireCheck, StoreError> {
    let mut invocation = retire_script().prepare_invoke();
    invocation
        .key(keys.shard(shard))
        .key(keys.fence(shard))
        .key(keys.attempts(shard))
        .key(keys.gate_registry(shard));
    for gate in legacy_gate_keys(keys, meta, shard) {
        invocation.key(gate);
    }
    let reply: Vec<String> = invocation
        .arg(if delete { "delete" } else { "check" })
        .invoke_async(conn)
        .await?;
    let field = |i: usize| reply.get(i).cloned().unwrap_or_default();
    Ok(match reply.first().map(String::as_str) {
        Some("gone") => RetireCheck::Gone,
        Some("clear") => RetireCheck::Clear,
        Some("deleted") => RetireCheck::Deleted,
        Some("pending") => RetireCheck::Pending {
            group: field(1),
            count: field(2).parse().unwrap_or(0),
        },
        Some("unread") => RetireCheck::Unread {
            group: field(1),
            next_id: field(2),
        },
        other => {
            return Err(StoreError::Malformed {
                key: keys.shard(shard),
                detail: format!("unexpected reply of the retirement script: {other:?}"),
            });
        }
    })
}

/// One consumer group of a shard as `XINFO GROUPS` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RawGroupInfo {
    pub(crate) name: String,
    pub(crate) consumers: u64,
    pub(crate) pending: u64,
    pub(crate) last_delivered_id: String,
    pub(crate) entries_read: Option<u64>,
    pub(crate) lag: Option<u64>,
}

/// A shard stream's length and consumer groups; `None` when the stream does not exist.
pub(crate) async fn shard_info(
    conn: &mut RedisConnection,
    keys: &StreamKeys,
    shard: ShardIndex,
) -> Result<Option<(u64, Vec<RawGroupInfo>)>, StoreError> {
    let (exists, length, groups): (i64, u64, Vec<Vec<String>>) = shard_info_script()
        .key(keys.shard(shard))
        .invoke_async(conn)
        .await?;
    if exists == 0 {
        return Ok(None);
    }
    let number = |v: Option<&String>| v.and_then(|v| v.parse::<u64>().ok());
    let groups = groups
        .into_iter()
        .map(|g| RawGroupInfo {
            name: g.first().cloned().unwrap_or_default(),
            consumers: number(g.get(1)).unwrap_or(0),
            pending: number(g.get(2)).unwrap_or(0),
            last_delivered_id: g.get(3).cloned().unwrap_or_default(),
            entries_read: number(g.get(4)),
            lag: number(g.get(5)),
        })
        .collect();
    Ok(Some((length, groups)))
}

/// Outcome of [`delete_group_keys`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum GroupKeysDeletion {
    /// Number of keys deleted (0 to 3).
    Deleted(u64),
    /// Members whose lease runs past Redis `TIME`, with the lease expiry (µs).
    Live(Vec<(String, Micros)>),
}

/// Deletes the group hash, leases and history, unless a lease is still running.
pub(crate) async fn delete_group_keys(
    conn: &mut RedisConnection,
    keys: &GroupKeys,
) -> Result<GroupKeysDeletion, StoreError> {
    let reply: Vec<String> = delete_group_keys_script()
        .key(keys.metadata())
        .key(keys.leases())
        .key(keys.history())
        .invoke_async(conn)
        .await?;
    match reply.first().map(String::as_str) {
        Some("deleted") => Ok(GroupKeysDeletion::Deleted(
            reply.get(1).and_then(|n| n.parse().ok()).unwrap_or(0),
        )),
        Some("live") => Ok(GroupKeysDeletion::Live(
            reply[1..]
                .chunks(2)
                .map(|pair| {
                    let expiry = pair.get(1).and_then(|s| s.parse::<f64>().ok());
                    // Scores are whole µs below 2^53, so f64 holds them exactly.
                    (pair[0].clone(), expiry.unwrap_or(0.0) as Micros)
                })
                .collect(),
        )),
        other => Err(StoreError::Malformed {
            key: keys.metadata(),
            detail: format!("unexpected reply of the group deletion script: {other:?}"),
        }),
    }
}
