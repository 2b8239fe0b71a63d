//! The Lua scripts of the data plane (docs/design.md §8). Every script gets the same two keys, both
//! in the slot of the shard's hash tag (docs/design.md §2), so each runs on Redis Cluster:
//! `KEYS[1]` the shard stream `{<prefix>:<i>}`, `KEYS[2]` its fence hash `{<prefix>:<i>}:fence`.
//! The first four arguments are the same too: `ARGV[1]` the consumer group (also the fence field),
//! `ARGV[2]` our encoded token (`FenceToken::encode`), `ARGV[3]` our incarnation, `ARGV[4]` our
//! member epoch.
//!
//! Replies are arrays whose first element is a status: `EQUAL` / `OK` / `EMPTY` (done),
//! `LOWER` / `HIGHER` (the fence does not hold our token: nothing was done; `HIGHER` carries the
//! stored value), `NOGROUP` (the stream or its consumer group is missing; carries Redis's message).

use std::sync::LazyLock;

use redis::Script;

use crate::gates::GATE_LUA;
use crate::script_flags::ALLOW_OOM;

/// Exact integer comparison and the order of fencing tokens: the part of [`PRELUDE`] that the
/// check of a transactional read ([`check_fences`]) needs, which is sent whole every time.
const TOKEN_ORDER: &str = r"
-- Compares two decimal integers given as strings: -1, 0 or 1, exact beyond 2^53.
local function cmp_int(a, b)
  local na, nb = string.sub(a, 1, 1) == '-', string.sub(b, 1, 1) == '-'
  if na ~= nb then return na and -1 or 1 end
  if na then a, b = string.sub(b, 2), string.sub(a, 2) end
  a = string.gsub(a, '^0+(%d)', '%1')
  b = string.gsub(b, '^0+(%d)', '%1')
  if #a ~= #b then return #a < #b and -1 or 1 end
  if a == b then return 0 end
  return a < b and -1 or 1
end

-- Orders a stored token against ours (incarnation inc, member epoch ep) by
-- (incarnation, memberEpoch): -1, 0 or 1; nil when the stored value is not a token.
local function order(stored, inc, ep)
  local sinc, sep = string.match(stored, '^(%-?%d+):(%-?%d+):')
  if not sinc then return nil end
  local c = cmp_int(sinc, inc)
  if c == 0 then c = cmp_int(sep, ep) end
  return c
end

";

/// Helpers shared by every script after [`TOKEN_ORDER`]: the fence check, the classification of
/// errors caught with `redis.pcall`, and entry bodies.
const PRELUDE: &str = r"
-- nil when field `group` of fence hash `fence` holds exactly our token; otherwise the reply
-- refusing the operation: LOWER (absent or below ours: a raise was lost) or HIGHER (at or
-- above ours, another token, or not a token at all: fail closed).
local function refusal_of(fence, group, token, inc, ep)
  local stored = redis.call('HGET', fence, group)
  if stored == token then return nil end
  if not stored then return {'LOWER'} end
  local c = order(stored, inc, ep)
  if c == nil or c >= 0 then return {'HIGHER', stored} end
  return {'LOWER', stored}
end

-- refusal_of for this script's shard and token (KEYS[2], ARGV[1..4]).
local function refusal()
  return refusal_of(KEYS[2], ARGV[1], ARGV[2], ARGV[3], ARGV[4])
end

-- The reply for an error caught by redis.pcall: NOGROUP when the stream or the group is
-- missing, else the error itself.
local function failed(r)
  if string.find(r.err, '^NOGROUP') or string.find(r.err, '^ERR no such key') then
    return {'NOGROUP', r.err}
  end
  return r
end

-- The NOGROUP reply when the shard stream KEYS[1] does not exist, else nil: nothing is written
-- next to a missing stream, which may just have been retired.
local function no_stream()
  if redis.call('EXISTS', KEYS[1]) == 0 then
    return {'NOGROUP', 'ERR no such key: the shard stream does not exist'}
  end
end

-- An entry's body as returned: its field/value list; false when the entry was trimmed or
-- deleted while pending; its size in bytes (fields and values) when above max (0 = no limit).
local function body(fields, max)
  if not fields then return false end
  if max > 0 then
    local n = 0
    for i = 1, #fields do n = n + #fields[i] end
    if n > max then return n end
  end
  return fields
end
";

fn with_prelude(body: &str) -> Script {
    Script::new(&format!("{TOKEN_ORDER}{PRELUDE}{GATE_LUA}{body}"))
}

/// [`with_prelude`] for a script that must run at `maxmemory` (its flags line first).
fn with_prelude_allow_oom(body: &str) -> Script {
    Script::new(&format!(
        "{ALLOW_OOM}{TOKEN_ORDER}{PRELUDE}{GATE_LUA}{body}"
    ))
}

/// A read script that checks the fence first when `ARGV[5]` is `'1'` (strict mode); in acks
/// mode `body` runs unchecked.
fn fenced_if_strict(body: &str) -> Script {
    with_prelude(&format!(
        "if ARGV[5] == '1' then\n  local refused = refusal()\n  if refused then return refused end\nend\n{body}"
    ))
}

/// A script that checks the fence first, whatever the fencing mode: `body` runs only when the
/// fence holds our token, else the refusal is the reply.
fn always_fenced(body: &str) -> Script {
    with_prelude(&fence_first(body))
}

/// `body` after the fence check (see [`always_fenced`]).
fn fence_first(body: &str) -> String {
    format!("local refused = refusal()\nif refused then return refused end\n{body}")
}

/// Raises the fence to our token: accepts a strictly higher `(incarnation, memberEpoch)` than the
/// stored one, an empty field, or the same token again. Breaks the two-key convention with
/// `KEYS[3]`, the shard's gate registry `{<prefix>:<i>}:gates` (same slot). No further
/// arguments. When it writes our token, it first closes every other read gate of the group on
/// the shard (docs/design.md §8.16): the stored token's, which also ends a strict wait of its
/// holder blocked on it, and any a lost fence value left behind. Returns `{'EQUAL'}` (the fence
/// holds our token now), `{'HIGHER', stored}` (unchanged), or `{'NOGROUP', ...}` when the shard
/// stream does not exist: a fence is never written next to a missing stream, which may just
/// have been retired (docs/design.md §8.11). Fails with `WRONGTYPE` (nothing written) when the
/// registry is not a set. Runs at `maxmemory` ([`ALLOW_OOM`]): a takeover must be possible in
/// a full Redis, which only consuming drains.
pub(crate) fn raise() -> &'static Script {
    static SCRIPT: LazyLock<Script> = LazyLock::new(|| {
        with_prelude_allow_oom(
            r"
local missing = no_stream()
if missing then return missing end
local stored = redis.call('HGET', KEYS[2], ARGV[1])
if stored == ARGV[2] then return {'EQUAL'} end
if stored then
  local c = order(stored, ARGV[3], ARGV[4])
  if c == nil or c >= 0 then return {'HIGHER', stored} end
end
local gates = KEYS[1] .. ':gate:' .. ARGV[1] .. ':'
close_gates(KEYS[3], gates, gates .. ARGV[2])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return {'EQUAL'}
",
        )
    });
    &SCRIPT
}

/// Reads the consumer's own pending entries after an id, with their delivery counts.
/// ARGV[5] '1' = check the fence first (strict), '0' = do not (acks mode); ARGV[6] consumer;
/// ARGV[7] count; ARGV[8] the id to read after (exclusive; '0' = from the start);
/// ARGV[9] the largest body in bytes returned in full (0 = no limit).
/// Returns `{'OK', {{id, body, deliveryCount}, ...}}` (empty list: nothing pending after the id).
pub(crate) fn read_pending() -> &'static Script {
    static SCRIPT: LazyLock<Script> = LazyLock::new(|| {
        fenced_if_strict(
            r"
local r = redis.pcall('XREADGROUP', 'GROUP', ARGV[1], ARGV[6], 'COUNT', ARGV[7], 'STREAMS', KEYS[1], ARGV[8])
if type(r) == 'table' and r.err then return failed(r) end
local entries = (r and r[1] and r[1][2]) or {}
if #entries == 0 then return {'OK', {}} end
-- The same range of the same consumer's PEL: exactly these ids, with the counts this read set.
local counts = {}
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], entries[1][1], entries[#entries][1], #entries, ARGV[6])
for _, p in ipairs(pending) do counts[p[1]] = p[4] end
local max = tonumber(ARGV[9])
local out = {}
for i, e in ipairs(entries) do out[i] = {e[1], body(e[2], max), counts[e[1]] or 0} end
return {'OK', out}
",
        )
    });
    &SCRIPT
}

/// Reads new entries (`>`). ARGV[5] '1' = check the fence first, '0' = do not; ARGV[6] consumer;
/// ARGV[7] count; ARGV[8] the largest body in bytes returned in full (0 = no limit).
/// Returns `{'OK', {{id, body}, ...}}`, or `{'EMPTY', lastId}` when nothing is new: the id of the
/// stream's last entry ('0-0' when it has none), to wait from with `XREAD BLOCK`.
pub(crate) fn read_new() -> &'static Script {
    static SCRIPT: LazyLock<Script> = LazyLock::new(|| {
        fenced_if_strict(
            r"
local r = redis.pcall('XREADGROUP', 'GROUP', ARGV[1], ARGV[6], 'COUNT', ARGV[7], 'STREAMS', KEYS[1], '>')
if type(r) == 'table' and r.err then return failed(r) end
if not r or not r[1] or #r[1][2] == 0 then
  local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
  return {'EMPTY', (last[1] and last[1][1]) or '0-0'}
end
local max = tonumber(ARGV[8])
local out = {}
for i, e in ipairs(r[1][2]) do out[i] = {e[1], body(e[2], max)} end
return {'OK', out}
",
        )
    });
    &SCRIPT
}

/// Acknowledges entries, always fenced. ARGV[5..] the ids (none: only the fence is checked).
/// Returns `{'OK', acked}` (ids that were pending).
pub(crate) fn ack() -> &'static Script {
    static SCRIPT: LazyLock<Script> = LazyLock::new(|| {
        always_fenced(
            r"
local acked = 0
-- In chunks: unpack has a stack limit.
for i = 5, #ARGV, 500 do
  acked = acked + redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, i, math.min(i + 499, #ARGV)))
end
return {'OK', acked}
",
        )
    });
    &SCRIPT
}

/// The fence check of a strict read (docs/design.md §8.16, `dataplane::round`): sent with
/// `EVAL`, never `EVALSHA`, inside the read's transaction (`MULTI`, this check, the
/// `XREADGROUP`, `EXEC`), so that Redis runs it right before the read and nothing in between. A
/// server that lost its scripts would answer `EVALSHA` with `NOSCRIPT` inside the `EXEC`, the
/// check would not run and the read after it would; `EVAL` always runs the body.
///
/// For a round of `n` shards, `KEYS[1..n]` are their fence hashes, `KEYS[n+1..2n]` their
/// **gates** for the tokens checked (`{<prefix>:<i>}:gate:<group>:<token>`,
/// [`crate::keys::StreamKeys::gate`]: empty streams with consumer group `ARGV[1]`; the read
/// names the first one with the shards, a strict wait names each), `KEYS[2n+1..3n]` their gate
/// registries ([`crate::keys::StreamKeys::gate_registry`]). `ARGV[1]` is the group (also the
/// fence field); then per shard its encoded token, incarnation and member epoch. Returns
/// `{status, verdicts}`: one verdict per shard, `{'EQUAL'}`, `{'LOWER'}`, `{'LOWER', stored}` or
/// `{'HIGHER', stored}` (as the other scripts' refusals; a fence key of the wrong type is
/// `{'HIGHER', ''}`: fail closed). Status:
/// - `OK`: every verdict is `EQUAL`, and the first gate exists: it was there, or the check
///   created and listed it. The read runs. The other gates are created the same way where Redis
///   accepts it; a missing one only fails its shard's wait (which then wakes it to read).
/// - `REFUSED`: a verdict is not `EQUAL` (a fence key lost counts as `LOWER`): the check deleted
///   every gate of the round with `DEL`, which Redis runs under `maxmemory` too (it is not
///   *deny-oom*). The read fails as a whole with `NOGROUP` on the first gate, before it reads
///   any stream: nothing is read.
/// - `NOGATE`, with Redis's error third: every verdict is `EQUAL`, but the first gate was missing
///   and could not be created (the registry's `SADD` is deny-oom: refused at `maxmemory`;
///   `WRONGTYPE` for a registry written by hand). The read fails with `NOGROUP`: nothing is read,
///   fail closed, until Redis accepts the write.
///
/// The check writes nothing else: no write comes before the gates', so Redis applies its
/// `maxmemory` rule to the first of them as to any first write of a script.
pub(crate) fn check_fences() -> &'static str {
    static SOURCE: LazyLock<String> = LazyLock::new(|| {
        format!(
            "{TOKEN_ORDER}{GATE_LUA}{}",
            r"
local n = #KEYS / 3
local verdicts, refused = {}, false
for s = 1, n do
  local a = 2 + 3 * (s - 1)
  local stored = redis.pcall('HGET', KEYS[s], ARGV[1])
  local v
  if type(stored) == 'table' then
    v = {'HIGHER', ''}
  elseif stored == ARGV[a] then
    v = {'EQUAL'}
  elseif not stored then
    v = {'LOWER'}
  else
    local c = order(stored, ARGV[a + 1], ARGV[a + 2])
    if c == nil or c >= 0 then v = {'HIGHER', stored} else v = {'LOWER', stored} end
  end
  if v[1] ~= 'EQUAL' then refused = true end
  verdicts[s] = v
end
if refused then
  for s = 1, n do
    redis.call('DEL', KEYS[n + s])
    redis.pcall('SREM', KEYS[2 * n + s], KEYS[n + s])
  end
  return {'REFUSED', verdicts}
end
local err = open_gate(KEYS[2 * n + 1], KEYS[n + 1], ARGV[1])
if err then return {'NOGATE', verdicts, err} end
-- The other shards' gates only serve their waits: one that cannot be created fails its wait,
-- which then wakes its shards to read instead.
for s = 2, n do open_gate(KEYS[2 * n + s], KEYS[n + s], ARGV[1]) end
return {'OK', verdicts}
"
        )
    });
    &SOURCE
}

/// Claims other consumers' pending entries without inflating delivery counts (takeover,
/// docs/design.md §8), always fenced. ARGV[5] our consumer; ARGV[6] the most ids to request in this
/// call. For each other consumer with a PEL (`XINFO CONSUMERS`): `XPENDING - + n consumer`, then
/// `XCLAIM ... 0 ids JUSTID` (Redis >= 7 drops ids whose entry was trimmed or deleted from the
/// PEL and does not return them). Never deletes a consumer. Breaks the two-key convention with
/// `KEYS[3]`, the shard's attempt hash (same slot): the attempt counts of the ids dropped go
/// with them (docs/design.md §8.9), since no shard task sees those ids again.
/// Returns `{'OK', claimed, trimmed, more}`: more = 1 when the budget ran out before every other
/// consumer's PEL was empty.
pub(crate) fn claim_others() -> &'static Script {
    static SCRIPT: LazyLock<Script> = LazyLock::new(|| {
        always_fenced(
            r"
local consumers = redis.pcall('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])
if consumers.err then return failed(consumers) end
local budget = tonumber(ARGV[6])
local claimed, trimmed, more = 0, 0, 0
for _, c in ipairs(consumers) do
  local name, pending = nil, 0
  for i = 1, #c, 2 do
    if c[i] == 'name' then name = c[i + 1] elseif c[i] == 'pending' then pending = c[i + 1] end
  end
  if name ~= ARGV[5] and pending > 0 then
    if budget == 0 then more = 1; break end
    local ids = {}
    for i, p in ipairs(redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', math.min(budget, pending), name)) do
      ids[i] = p[1]
    end
    local requested = #ids
    if requested > 0 then
      ids[requested + 1] = 'JUSTID'
      local moved = redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[5], 0, unpack(ids))
      local got = #moved
      if got < requested then
        local kept = {}
        for _, id in ipairs(moved) do kept[id] = true end
        for i = 1, requested do
          -- pcall: a key of the wrong type is count_attempt's to repair, not a failed claim.
          if not kept[ids[i]] then redis.pcall('HDEL', KEYS[3], ARGV[1] .. '|' .. ids[i]) end
        end
      end
      claimed = claimed + got
      trimmed = trimmed + requested - got
      budget = budget - requested
    end
    if pending > requested then more = 1 end
  end
end
return {'OK', claimed, trimmed, more}
",
        )
    });
    &SCRIPT
}

/// Counts one handler attempt on a re-delivered entry (docs/design.md §8 `max_deliveries`,
/// docs/design.md §8.9), always fenced. Breaks the two-key convention above with a third key in the
/// same slot: `KEYS[3]` the shard's attempt hash `{<prefix>:<i>}:attempts`; `ARGV[5]` the field
/// `<group>|<entry id>`. Returns `{'OK', attempts, repaired}`: the attempts started on the entry
/// so far, this one included (a first delivery's is counted only with `max_deliveries = 1`), and
/// 1 when a corrupt value was dropped first (the key not a hash: deleted; the field not a
/// decimal count below 10^15: removed), so the count starts again; `NOGROUP` when the shard
/// stream does not exist (nothing is written next to a retired shard). Runs at `maxmemory`
/// ([`ALLOW_OOM`]), so that re-delivered entries are still handled in a full Redis.
pub(crate) fn count_attempt() -> &'static Script {
    static SCRIPT: LazyLock<Script> = LazyLock::new(|| {
        with_prelude_allow_oom(&fence_first(
            r"
local missing = no_stream()
if missing then return missing end
local repaired = 0
local kind = redis.call('TYPE', KEYS[3]).ok
if kind ~= 'hash' and kind ~= 'none' then
  redis.call('DEL', KEYS[3])
  repaired = 1
end
local stored = redis.call('HGET', KEYS[3], ARGV[5])
if stored and (not string.match(stored, '^%d+$') or #stored > 15) then
  redis.call('HDEL', KEYS[3], ARGV[5])
  repaired = 1
end
return {'OK', redis.call('HINCRBY', KEYS[3], ARGV[5], 1), repaired}
",
        ))
    });
    &SCRIPT
}

/// Creates consumer group ARGV[1] on shard stream KEYS[1] from `0`; the stream too
/// (`MKSTREAM`) only when ARGV[2] is `1`. Returns `{stream created (0/1), group created}`:
/// group created is `1`, `0` when it exists (`BUSYGROUP`), `-1` when the stream is missing and
/// not to be created.
pub(crate) fn recreate_group() -> &'static Script {
    static SCRIPT: LazyLock<Script> = LazyLock::new(|| {
        Script::new(
            r"
local existed = redis.call('EXISTS', KEYS[1]) == 1
if not existed and ARGV[2] ~= '1' then return {0, -1} end
local r = redis.pcall('XGROUP', 'CREATE', KEYS[1], ARGV[1], '0', 'MKSTREAM')
if type(r) == 'table' and r.err then
  if string.find(r.err, '^BUSYGROUP') then return {0, 0} end
  return r
end
return {existed and 0 or 1, 1}
",
        )
    });
    &SCRIPT
}

/// Undoes [`recreate_group_script`] on a shard that stopped being readable meanwhile: destroys
/// consumer group ARGV[1] of KEYS[1], and when ARGV[2] is `1` (the stream was created with it)
/// deletes the stream if it is still empty and has no group. Returns 1 when it deleted it.
pub(crate) fn undo_recreate_group() -> &'static Script {
    static SCRIPT: LazyLock<Script> = LazyLock::new(|| {
        Script::new(
            r"
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.pcall('XGROUP', 'DESTROY', KEYS[1], ARGV[1])
if ARGV[2] == '1' and redis.call('XLEN', KEYS[1]) == 0
  and #redis.call('XINFO', 'GROUPS', KEYS[1]) == 0 then
  return redis.call('DEL', KEYS[1])
end
return 0
",
        )
    });
    &SCRIPT
}

/// Deletes the consumers of group ARGV[1] on shard stream KEYS[1] that are idle for good
/// (consumer hygiene, docs/design.md §8.15): every consumer of `XINFO CONSUMERS` that is not in
/// the keep-list ARGV[3..] is deleted with `XGROUP DELCONSUMER` **only when its pending count is
/// 0**, checked in this same script, so no PEL is ever dropped (watermill-redisstream#24 lost
/// messages by deleting consumers with pending entries). ARGV[2] `'1'`: dry run, nothing
/// deleted. Not fenced: it deletes only consumers without pending entries, which holds whoever
/// runs it (docs/design.md §8.15). Breaks the convention above: the shard and the gate, no token.
/// Returns `{'OK', deleted, pending, kept}`: the names deleted (or that would be); `{name,
/// pending}` of the consumers not in the keep-list kept for their pending entries; `{name,
/// pending}` of those in the keep-list; or `{'NOGROUP', message}`. `KEYS[2..4]`, when given,
/// are the shard's gate registry, its fence hash and the group's gate of versions before gates
/// were per token (docs/design.md §8.16): but in a dry run, the old gate is deleted, and so is
/// every listed gate of the group but the one of the token the fence holds (a gate a lost fence
/// value left behind).
pub(crate) fn delete_idle_consumers() -> &'static Script {
    static SCRIPT: LazyLock<Script> = LazyLock::new(|| {
        with_prelude(
            r"
local keep = {}
for i = 3, #ARGV do keep[ARGV[i]] = true end
local consumers = redis.pcall('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])
if consumers.err then return failed(consumers) end
if KEYS[2] and ARGV[2] ~= '1' then
  redis.call('DEL', KEYS[4])
  local gates = KEYS[1] .. ':gate:' .. ARGV[1] .. ':'
  local current = redis.pcall('HGET', KEYS[3], ARGV[1])
  if type(current) ~= 'string' then current = '' else current = gates .. current end
  close_gates(KEYS[2], gates, current)
end
local deleted, busy, kept = {}, {}, {}
for _, c in ipairs(consumers) do
  local name, pending = nil, 0
  for i = 1, #c, 2 do
    if c[i] == 'name' then name = c[i + 1] elseif c[i] == 'pending' then pending = c[i + 1] end
  end
  if name then
    if keep[name] then
      kept[#kept + 1] = {name, pending}
    elseif pending > 0 then
      busy[#busy + 1] = {name, pending}
    else
      if ARGV[2] ~= '1' then redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], name) end
      deleted[#deleted + 1] = name
    end
  end
end
return {'OK', deleted, busy, kept}
",
        )
    });
    &SCRIPT
}

/// The members whose Redis consumers consumer hygiene keeps (docs/design.md §8.15), read on the
/// group's slot: `KEYS[1]` the leases sorted set `sl:{<prefix>:<group>}:leases`, `KEYS[2]` the
/// group hash `sl:{<prefix>:<group>}:group`. Breaks the shard-key convention above (it runs on
/// the group's slot, before the shard script, which gets its result as arguments).
/// Returns `{exists, live, static}`: `exists` 1 when the group hash exists; `live` the members
/// whose lease (score, µs) is at or after Redis `TIME`; `static` the members with an expired
/// lease still in the member map whose JSON names an `instanceId` (a static member away, or
/// whose JSON does not decode: kept, since it cannot be judged). Times are compared as the
/// score strings Redis parses, never computed in Lua beyond concatenation.
pub(crate) fn consumer_keep_list() -> &'static Script {
    static SCRIPT: LazyLock<Script> = LazyLock::new(|| {
        Script::new(
            r"
local t = redis.call('TIME')
local now = t[1] .. string.format('%06d', tonumber(t[2]))
local exists = redis.call('EXISTS', KEYS[2])
local live = redis.call('ZRANGE', KEYS[1], now, '+inf', 'BYSCORE')
local static = {}
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], '-inf', '(' .. now, 'BYSCORE')) do
  local json = redis.call('HGET', KEYS[2], 'member:' .. id)
  if json then
    local ok, m = pcall(cjson.decode, json)
    if not ok or type(m) ~= 'table' or type(m.instanceId) == 'string' then
      static[#static + 1] = id
    end
  end
end
return {exists, live, static}
",
        )
    });
    &SCRIPT
}
