//! Group offset reset, Kafka's `kafka-consumer-groups --reset-offsets` (docs/design.md §10.6):
//! moves a consumer group's position (`last-delivered-id`) on its shards with `XGROUP SETID`.

use std::sync::LazyLock;

use redis::Script;
use serde::Serialize;

use super::liveness::refuse_live;
use super::{AdminError, open_group, scripts};
use crate::connection::RedisConnection;
use crate::coordinator::rfc3339;
use crate::keys::StreamKeys;
use crate::model::{ShardIndex, StreamMetadata};
use crate::store::StoreError;

/// Where [`reset_group`] moves the group's position on each shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "camelCase")]
#[non_exhaustive]
pub enum ResetTarget {
    /// Before the first entry (`0-0`): every entry of the shard is delivered again.
    Earliest,
    /// The shard's `last-generated-id`: nothing already in the shard is delivered.
    Latest,
    /// Just before the entry id `<ms>-0`: every entry whose id has `ms` or more milliseconds is
    /// delivered (again), none before. The position is `<ms-1>-18446744073709551615`, the
    /// largest id below `<ms>-0`, because a group delivers only ids *after* its position: a
    /// position of `<ms>-0` itself would skip an entry with exactly that id. `ms` must not be
    /// after Redis `TIME`.
    #[serde(rename_all = "camelCase")]
    Time {
        /// Milliseconds since the Unix epoch.
        ms: u64,
    },
    /// Moves the position by `n` entries from the current `last-delivered-id` (Kafka's
    /// `--shift-by`): `-N` re-delivers the N entries at or before it, `+N` skips the next N
    /// entries; clamped to the shard (at most to `0-0`, at least to its `last-generated-id`).
    /// Never 0.
    #[serde(rename_all = "camelCase")]
    ShiftBy {
        /// Entries to move by: negative back, positive forward.
        n: i64,
    },
}

impl std::fmt::Display for ResetTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ResetTarget::Earliest => write!(f, "earliest"),
            ResetTarget::Latest => write!(f, "latest"),
            // RFC 3339 ends with the year 9999 (humantime's `Display` fails after it, and a
            // failing `Display` makes `to_string` panic): later times as a plain count.
            ResetTarget::Time { ms } if *ms >= LAST_RFC3339_MS => {
                write!(f, "{ms} ms since the Unix epoch")
            }
            ResetTarget::Time { ms } => {
                let time = std::time::UNIX_EPOCH + std::time::Duration::from_millis(*ms);
                write!(f, "{}", humantime::format_rfc3339_millis(time))
            }
            ResetTarget::ShiftBy { n } => write!(f, "shift by {n:+}"),
        }
    }
}

/// The first millisecond after 9999-12-31T23:59:59.999Z, the last time RFC 3339 can write.
const LAST_RFC3339_MS: u64 = 253_402_300_800_000;

/// What [`reset_group`] does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResetOptions {
    /// The new position.
    pub target: ResetTarget,
    /// The shards to reset, each a readable shard; `None`: every readable shard.
    pub shards: Option<Vec<ShardIndex>>,
    /// Compute and report, change nothing.
    pub dry_run: bool,
}

/// One shard of a [`GroupReset`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ShardReset {
    /// The shard.
    pub shard_index: ShardIndex,
    /// The group's `last-delivered-id` before.
    pub old_position: String,
    /// Its `last-delivered-id` after (with `dryRun`, what it would be).
    pub new_position: String,
    /// Entries after the new position: what the group will deliver from this shard, entries it
    /// delivered before included (a re-delivery) and entries it had not read yet included.
    pub to_deliver: u64,
    /// Entries between the new and the old position that the group had not read: with a
    /// forward move, the ones skipped.
    pub skipped: u64,
    /// Pending entries removed from the group's PEL (`XACK`), with their handler-attempt counts.
    pub pending_cleared: u64,
    /// The `ENTRIESREAD` given to `XGROUP SETID`: entries-added minus `toDeliver`, so Redis'
    /// `lag` equals `toDeliver`.
    pub entries_read: u64,
}

/// The result of [`reset_group`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GroupReset {
    /// The stream prefix.
    pub stream_prefix: String,
    /// The consumer group.
    pub consumer_group: String,
    /// The target, as given.
    pub target: ResetTarget,
    /// Whether nothing was changed (`--dry-run`).
    pub dry_run: bool,
    /// The shards, ascending.
    pub shards: Vec<ShardReset>,
}

/// Resets the position of consumer group `group` of stream `prefix` on its readable shards (or
/// `options.shards`), as Kafka's `kafka-consumer-groups --reset-offsets` does for a partition.
///
/// Per shard, one script (the shard's slot: stream and attempts hash) computes the new position
/// (see [`ResetTarget`]), and unless `dry_run`: acknowledges every pending entry of the group
/// (`XACK`) and deletes its handler-attempt fields `<group>|<id>` (docs/design.md §8.9), then
/// runs `XGROUP SETID <shard> <group> <position> ENTRIESREAD <entries-added − toDeliver>`. So
/// after a reset the group's PEL on the shard is empty and it delivers exactly the entries after
/// the new position, each once: to `latest` skips everything, to an earlier point reprocesses
/// from there (pending entries after the position are delivered again as new ones, pending
/// entries before it are dropped, since they would otherwise come back through takeover).
///
/// Every check runs before any change: a bad request changes nothing. The group must be
/// inactive (no lease past Redis `TIME`, checked on the loaded group and again on its leases
/// sorted set right before the first change). A member starting while the scripts run is not
/// stopped by them (the shards and the group live in other slots); stop the group's processes
/// first.
///
/// # Errors
/// [`AdminError::InvalidName`]; [`AdminError::Store`] with [`StoreError::MissingStream`] or
/// [`StoreError::UnknownGroup`] (not registered); [`AdminError::ZeroShift`];
/// [`AdminError::ShardNotReadable`] for a shard outside the readable set;
/// [`AdminError::ResetTimeInFuture`]; [`AdminError::GroupActive`] while a member is live;
/// [`AdminError::ShardNotReady`] when a shard's stream or consumer group is missing; Redis
/// failures.
pub async fn reset_group(
    conn: &mut RedisConnection,
    prefix: &str,
    group: &str,
    options: &ResetOptions,
) -> Result<GroupReset, AdminError> {
    let (keys, group_keys, meta, _) = open_group(conn, prefix, group, Default::default()).await?;
    if !meta.groups.iter().any(|g| g.consumer_group == group) {
        return Err(StoreError::UnknownGroup {
            prefix: prefix.to_owned(),
            group: group.to_owned(),
        }
        .into());
    }
    let shards = shards_to_reset(prefix, &meta, options.shards.as_deref())?;
    let mode = Mode::of(options.target)?;
    if let ResetTarget::Time { ms } = options.target {
        let now = scripts::stream_time(conn, &keys).await?;
        if ms.saturating_mul(1000) > now {
            return Err(AdminError::ResetTimeInFuture {
                time: options.target.to_string(),
                now: rfc3339(now),
            });
        }
    }
    refuse_live(conn, &keys, &group_keys).await?;
    // A dry pass over every shard first: a missing stream or consumer group fails before any
    // shard is changed.
    let mut planned = Vec::with_capacity(shards.len());
    for &shard in &shards {
        planned.push(reset_shard(conn, &keys, group, shard, &mode, false).await?);
    }
    let shards = if options.dry_run {
        planned
    } else {
        refuse_live(conn, &keys, &group_keys).await?;
        let mut done = Vec::with_capacity(shards.len());
        for &shard in &shards {
            let reset = reset_shard(conn, &keys, group, shard, &mode, true).await?;
            tracing::info!(
                stream = prefix,
                group,
                shard,
                old = %reset.old_position,
                new = %reset.new_position,
                to_deliver = reset.to_deliver,
                pending_cleared = reset.pending_cleared,
                "consumer group position reset"
            );
            done.push(reset);
        }
        done
    };
    Ok(GroupReset {
        stream_prefix: prefix.to_owned(),
        consumer_group: group.to_owned(),
        target: options.target,
        dry_run: options.dry_run,
        shards,
    })
}

/// The shards asked for (ascending, deduplicated), each readable; every readable shard when
/// none is named.
fn shards_to_reset(
    prefix: &str,
    meta: &StreamMetadata,
    asked: Option<&[ShardIndex]>,
) -> Result<Vec<ShardIndex>, AdminError> {
    let readable = meta.readable_shard_set();
    let Some(asked) = asked else {
        return Ok(readable.into_iter().collect());
    };
    let mut shards: Vec<ShardIndex> = asked.to_vec();
    shards.sort_unstable();
    shards.dedup();
    if let Some(&shard) = shards.iter().find(|s| !readable.contains(s)) {
        return Err(AdminError::ShardNotReadable {
            prefix: prefix.to_owned(),
            shard,
            readable: readable.into_iter().collect(),
        });
    }
    Ok(shards)
}

/// The script's arguments for a target: mode and its argument.
struct Mode {
    name: &'static str,
    arg: String,
}

/// Largest entry-id sequence part: `<ms-1>-MAX_SEQ` is the id just below `<ms>-0`.
const MAX_SEQ: u64 = u64::MAX;

/// Entries a shift can move by at most: beyond, Lua's doubles would lose whole counts (and no
/// shard holds that many entries).
const MAX_SHIFT: u64 = 1 << 52;

impl Mode {
    fn of(target: ResetTarget) -> Result<Mode, AdminError> {
        Ok(match target {
            ResetTarget::Earliest => Mode::new("earliest", String::new()),
            ResetTarget::Latest => Mode::new("latest", String::new()),
            ResetTarget::Time { ms: 0 } => Mode::new("earliest", String::new()),
            ResetTarget::Time { ms } => Mode::new("id", format!("{}-{MAX_SEQ}", ms - 1)),
            ResetTarget::ShiftBy { n: 0 } => return Err(AdminError::ZeroShift),
            ResetTarget::ShiftBy { n } => Mode::new(
                if n < 0 { "back" } else { "forward" },
                n.unsigned_abs().min(MAX_SHIFT).to_string(),
            ),
        })
    }

    fn new(name: &'static str, arg: String) -> Mode {
        Mode { name, arg }
    }
}

/// Computes, and with `ARGV[4] = apply` sets, a group's new position on one shard.
/// KEYS[1] shard stream, KEYS[2] its handler-attempt hash. ARGV[1] group, ARGV[2] mode
/// (`earliest`, `latest`, `id` with ARGV[3] the position, `back` / `forward` with ARGV[3] the
/// count), ARGV[4] `apply` or `dry`.
/// Returns {'nostream'}, {'nogroup'} or {'ok', old position, new position, to deliver, skipped,
/// pending, entries-read}. Ids are compared as (ms, seq) pairs of digit strings, never as Lua
/// numbers (the sequence part goes up to 2^64 - 1); counts stay far below 2^53.
fn reset_script() -> &'static Script {
    static SCRIPT: LazyLock<Script> = LazyLock::new(|| {
        Script::new(
            r"
if redis.call('EXISTS', KEYS[1]) == 0 then return {'nostream'} end
local g = nil
for _, x in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  local info = {}
  for i = 1, #x, 2 do info[x[i]] = x[i + 1] end
  if info['name'] == ARGV[1] then g = info end
end
if not g then return {'nogroup'} end
local s = {}
local raw = redis.call('XINFO', 'STREAM', KEYS[1])
for i = 1, #raw, 2 do s[raw[i]] = raw[i + 1] end
local last = s['last-generated-id']
local function digits_less(a, b)
  if #a ~= #b then return #a < #b end
  return a < b
end
local function id_less(a, b)
  local da, db = string.find(a, '-', 1, true), string.find(b, '-', 1, true)
  local ma, mb = string.sub(a, 1, da - 1), string.sub(b, 1, db - 1)
  if ma ~= mb then return digits_less(ma, mb) end
  return digits_less(string.sub(a, da + 1), string.sub(b, db + 1))
end
-- The exclusive range start after `id` ('(' .. id), or nil after the largest possible id,
-- where Redis refuses '(' ('invalid start ID'): nothing can follow it.
local function excl(id)
  if id == '18446744073709551615-18446744073709551615' then return nil end
  return '(' .. id
end
-- Visits up to n entries from `from` towards `to` (XRANGE or XREVRANGE) in batches; returns
-- how many it visited and the id of the last one. A nil `from` visits nothing.
local function walk(cmd, from, to, n)
  local seen, id = 0, nil
  while from and seen < n do
    local batch = math.min(1000, n - seen)
    local r = redis.call(cmd, KEYS[1], from, to, 'COUNT', batch)
    if #r == 0 then break end
    seen = seen + #r
    id = r[#r][1]
    if #r < batch then break end
    if cmd == 'XRANGE' then from = excl(id) else from = '(' .. id end
  end
  return seen, id
end
local old = g['last-delivered-id']
local mode = ARGV[2]
local pos
if mode == 'earliest' then
  pos = '0-0'
elseif mode == 'latest' then
  pos = last
elseif mode == 'id' then
  pos = ARGV[3]
  if id_less(last, pos) then pos = last end
elseif mode == 'back' then
  local n = tonumber(ARGV[3])
  local seen, id = walk('XREVRANGE', old, '-', n + 1)
  if seen == n + 1 then pos = id else pos = '0-0' end
else
  local n = tonumber(ARGV[3])
  local seen, id = walk('XRANGE', excl(old), '+', n)
  if seen == n then pos = id else pos = last end
end
local after
if mode == 'earliest' then after = s['length']
elseif mode == 'latest' then after = 0
else after = walk('XRANGE', excl(pos), '+', math.huge) end
local skipped = 0
if id_less(old, pos) then skipped = walk('XRANGE', excl(old), pos, math.huge) end
local pending = tonumber(redis.call('XPENDING', KEYS[1], ARGV[1])[1])
local read = tonumber(s['entries-added']) - after
if read < 0 then read = 0 end
if ARGV[4] == 'apply' then
  while true do
    local p = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1000)
    if #p == 0 then break end
    local ids = {}
    for i, e in ipairs(p) do ids[i] = e[1] end
    redis.call('XACK', KEYS[1], ARGV[1], unpack(ids))
  end
  -- The entry id after the last '|' has none: a field of group 'a|b' is not one of group 'a'.
  if redis.call('TYPE', KEYS[2]).ok == 'hash' then
    local prefix = ARGV[1] .. '|'
    local gone = {}
    for _, field in ipairs(redis.call('HKEYS', KEYS[2])) do
      if string.sub(field, 1, #prefix) == prefix and not string.find(field, '|', #prefix + 1, true) then
        gone[#gone + 1] = field
      end
    end
    for i = 1, #gone, 500 do
      redis.call('HDEL', KEYS[2], unpack(gone, i, math.min(i + 499, #gone)))
    end
  end
  redis.call('XGROUP', 'SETID', KEYS[1], ARGV[1], pos, 'ENTRIESREAD', string.format('%.0f', read))
end
return {'ok', old, pos, string.format('%.0f', after), string.format('%.0f', skipped),
  string.format('%.0f', pending), string.format('%.0f', read)}
",
        )
    });
    &SCRIPT
}

/// Runs [`reset_script`] on one shard.
async fn reset_shard(
    conn: &mut RedisConnection,
    keys: &StreamKeys,
    group: &str,
    shard: ShardIndex,
    mode: &Mode,
    apply: bool,
) -> Result<ShardReset, AdminError> {
    let reply: Vec<String> = reset_script()
        .key(keys.shard(shard))
        .key(keys.attempts(shard))
        .arg(group)
        .arg(mode.name)
        .arg(&mode.arg)
        .arg(if apply { "apply" } else { "dry" })
        .invoke_async(conn)
        .await
        .map_err(StoreError::from)?;
    let not_ready = |what| AdminError::ShardNotReady {
        prefix: keys.prefix().to_owned(),
        group: group.to_owned(),
        shard,
        what,
    };
    match reply.first().map(String::as_str) {
        Some("nostream") => return Err(not_ready("stream")),
        Some("nogroup") => return Err(not_ready("consumer group")),
        Some("ok") if reply.len() == 7 => {}
        other => {
            return Err(StoreError::Malformed {
                key: keys.shard(shard),
                detail: format!("unexpected reply of the reset script: {other:?}"),
            }
            .into());
        }
    }
    let number = |i: usize| reply[i].parse::<u64>().unwrap_or(0);
    Ok(ShardReset {
        shard_index: shard,
        old_position: reply[1].clone(),
        new_position: reply[2].clone(),
        to_deliver: number(3),
        skipped: number(4),
        pending_cleared: number(5),
        entries_read: number(6),
    })
}
