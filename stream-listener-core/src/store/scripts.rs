//! The Lua scripts of the store. Each touches keys of one hash slot only (docs/design.md §2).

use std::sync::LazyLock;

use redis::Script;

use crate::script_flags::ALLOW_OOM;

/// Compare-and-set of the stream metadata hash.
/// KEYS[1] stream metadata. ARGV: expected revision ('' = must not exist), new revision,
/// metadataVersion, meta JSON, schema. Returns 1 when written, 0 on a conflict.
pub(crate) fn stream_cas() -> &'static Script {
    static SCRIPT: LazyLock<Script> = LazyLock::new(|| {
        Script::new(
            r"
local current = redis.call('HGET', KEYS[1], 'revision')
if ARGV[1] == '' then
  if current then return 0 end
elseif current ~= ARGV[1] then
  return 0
end
redis.call('HSET', KEYS[1], 'schema', ARGV[5], 'revision', ARGV[2], 'metadataVersion', ARGV[3], 'meta', ARGV[4])
return 1
",
        )
    });
    &SCRIPT
}

/// Loads a group: Redis `TIME`, the group hash and the leases, in one call on the group's node.
/// KEYS[1] group hash, KEYS[2] leases. Returns {seconds, microseconds, HGETALL, ZRANGE WITHSCORES}.
pub(crate) fn group_load() -> &'static Script {
    static SCRIPT: LazyLock<Script> = LazyLock::new(|| {
        Script::new(
            r"
local t = redis.call('TIME')
return {t[1], t[2], redis.call('HGETALL', KEYS[1]), redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')}
",
        )
    });
    &SCRIPT
}

/// Creates a group hash if absent. KEYS[1] group hash. ARGV: schema, meta JSON.
/// Returns 1 when created, 0 when it existed.
pub(crate) fn group_create() -> &'static Script {
    static SCRIPT: LazyLock<Script> = LazyLock::new(|| {
        Script::new(
            r"
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'schema', ARGV[1], 'revision', '1', 'leaseRevision', '0', 'meta', ARGV[2])
return 1
",
        )
    });
    &SCRIPT
}

/// Compare-and-set of a group: writes only the changed fields if `revision` is still the loaded
/// one and so is the `fastseq:<id>` of every member whose fields or lease it writes (the fast path
/// moves a member's lease and `fastseq` together; docs/design.md §5.1). KEYS[1] group hash,
/// KEYS[2] leases, KEYS[3] history. ARGV: expected revision, new revision, history cap, then
/// counted lists: n, field/expected-value pairs to check (`''` for absent); n, field/value pairs
/// to HSET; n, fields to HDEL; n, member/score pairs to ZADD; n, members to ZREM; n, history
/// entries to LPUSH (oldest first); n, field/prefix pairs to HDEL only while the field's value
/// starts with the prefix (a lease released by its holder alone: `combiner`, `<token>|`).
/// Returns 1, 0 (conflict) or -1 when the leases or the history
/// key holds another type (nothing written: a failing ZADD or LPUSH would leave the fields
/// written before it).
pub(crate) fn group_cas() -> &'static Script {
    static SCRIPT: LazyLock<Script> = LazyLock::new(|| {
        Script::new(&format!(
            "{ALLOW_OOM}{}",
            r"
if (redis.call('HGET', KEYS[1], 'revision') or '') ~= ARGV[1] then return 0 end
local i = 4
local n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  if (redis.call('HGET', KEYS[1], ARGV[i]) or '') ~= ARGV[i + 1] then return 0 end
  i = i + 2
end
local lt, ht = redis.call('TYPE', KEYS[2]).ok, redis.call('TYPE', KEYS[3]).ok
if (lt ~= 'zset' and lt ~= 'none') or (ht ~= 'list' and ht ~= 'none') then return -1 end
n = tonumber(ARGV[i]); i = i + 1
local set = {'revision', ARGV[2]}
for _ = 1, n do
  set[#set + 1] = ARGV[i]; set[#set + 1] = ARGV[i + 1]; i = i + 2
end
redis.call('HSET', KEYS[1], unpack(set))
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do redis.call('HDEL', KEYS[1], ARGV[i]); i = i + 1 end
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do redis.call('ZADD', KEYS[2], ARGV[i + 1], ARGV[i]); i = i + 2 end
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do redis.call('ZREM', KEYS[2], ARGV[i]); i = i + 1 end
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do redis.call('LPUSH', KEYS[3], ARGV[i]); i = i + 1 end
if n > 0 then redis.call('LTRIM', KEYS[3], 0, tonumber(ARGV[3]) - 1) end
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  local held = redis.call('HGET', KEYS[1], ARGV[i])
  if held and string.sub(held, 1, #ARGV[i + 1]) == ARGV[i + 1] then redis.call('HDEL', KEYS[1], ARGV[i]) end
  i = i + 2
end
return 1
"
        ))
    });
    &SCRIPT
}

/// The steady-state heartbeat (docs/design.md §5). KEYS[1] group hash, KEYS[2] leases.
/// ARGV: member id, request fingerprint, requestSeq, lease TTL (µs), the stream's metadataVersion,
/// activeConsumerWorkers (stored with the sequence: the only report a steady heartbeat changes).
/// Returns {'1', response JSON, groupEpoch, assignmentEpoch} when answered (the member's stored
/// answer and the group's epochs from `steady`, `<metadataVersion>|<deadline>|<groupEpoch>|
/// <assignmentEpoch>`), {'2', last seq} for a stale request, {'0'} when
/// the full transition must run: no `steady` (a correction round or a group waiting for a new
/// target), the stream changed, a deadline or the earliest lease has passed (for a repeat, a
/// lease other than the requester's: its stored answer may be that of a later write, which
/// time-based work due now would change), the requester's own lease is older than half its TTL (the full
/// transition then decides whether there was an outage to re-arm: members may run different
/// TTLs, and only the requester's is known here, docs/design.md §6.5), or the request differs from
/// the member's steady fingerprint. A malformed `steady`, `fast:<id>`, `fastseq:<id>` or
/// `leaseRevision` (no separator, not a number, negative, NaN, too large for Lua's doubles or
/// `HINCRBY`) also answers {'0'}, before anything is written: the full transition rewrites the
/// first two, and names the others in a typed error. So does a group hash whose `schema` is not
/// this build's or that lacks `meta`: the full transition fails closed on them with a typed
/// error, which the fast path would otherwise step around for as long as the group is steady.
pub(crate) fn group_fast_path() -> &'static Script {
    static SCRIPT: LazyLock<Script> = LazyLock::new(|| {
        Script::new(&format!(
            "{ALLOW_OOM}local schema_version = '{}'{}",
            crate::store::SCHEMA_VERSION,
            r"
local h = KEYS[1]
local steady, schema = unpack(redis.call('HMGET', h, 'steady', 'schema'))
if not steady then return {'0'} end
if schema ~= schema_version then return {'0'} end
if redis.call('HEXISTS', h, 'meta') == 0 then return {'0'} end
local version, due, ge, ae = string.match(steady, '^([^|]*)|([^|]*)|(%d+)|(%d+)$')
if not version or #ge > 18 or #ae > 18 then return {'0'} end
if version ~= ARGV[5] then return {'0'} end
local deadline = tonumber(due)
if not deadline or not (deadline >= 0 and deadline < 9007199254740992) then return {'0'} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
if deadline > 0 and now >= deadline then return {'0'} end
local entry = redis.call('HGET', h, 'fast:' .. ARGV[1])
if not entry then return {'0'} end
local nl = string.find(entry, '\n', 1, true)
if not nl then return {'0'} end
if string.sub(entry, 1, nl - 1) ~= ARGV[2] then return {'0'} end
local seq = tonumber(ARGV[3])
local last = tonumber(redis.call('HGET', h, 'fastseq:' .. ARGV[1]) or '0')
if not last or last >= 9007199254740992 then return {'0'} end
if seq < last then return {'2', string.format('%.0f', last)} end
local response = string.sub(entry, nl + 1)
if seq == last then
  local due = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, 2)
  for _, id in ipairs(due) do if id ~= ARGV[1] then return {'0'} end end
  return {'1', response, ge, ae}
end
local ttl = tonumber(ARGV[4])
local lr = redis.call('HGET', h, 'leaseRevision') or '0'
if not string.match(lr, '^%d+$') or #lr > 18 then return {'0'} end
local first = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
if first[2] == nil or tonumber(first[2]) <= now then return {'0'} end
local own = redis.call('ZSCORE', KEYS[2], ARGV[1])
if not own or tonumber(own) < now + ttl / 2 then return {'0'} end
redis.call('ZADD', KEYS[2], 'XX', string.format('%.0f', now + ttl), ARGV[1])
redis.call('HSET', h, 'fastseq:' .. ARGV[1], ARGV[3], 'fastworkers:' .. ARGV[1], ARGV[6])
redis.call('HINCRBY', h, 'leaseRevision', 1)
return {'1', response, ge, ae}
"
        ))
    });
    &SCRIPT
}

/// The combiner lease of a group hash (docs/design.md §5.7), shared by the submit and poll
/// scripts: `try_lease(h, token, ttl)` takes the field `combiner` (`<token>|<expiry µs>`) when it
/// is absent, expired or unreadable, and returns whether it did. The lease only saves work: the
/// compare-and-set of the batch is what keeps two combiners from both writing.
const COMBINER_LEASE_LUA: &str = r"
local function try_lease(h, token, ttl)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local held = redis.call('HGET', h, 'combiner')
  local expiry = held and tonumber(string.match(held, '|(%d+)$'))
  -- No requester takes a lease longer than 2 s: a later expiry is corrupt, and is taken over.
  if expiry and expiry > now and expiry <= now + 2000000 then return '0' end
  redis.call('HSET', h, 'combiner', token .. '|' .. string.format('%.0f', now + tonumber(ttl)))
  return '1'
end
";

/// Releases the combiner lease of a group hash (docs/design.md §5.7) when `ARGV[1]` holds it:
/// deletes `combiner` only while it reads `<ARGV[1]>|…`. A combiner whose lease expired and
/// passed to another must not free the new holder's, or a third requester would take it and
/// two would combine at once. KEYS[1] group hash. Returns 1 when released, else 0.
pub(crate) fn group_release_lease() -> &'static Script {
    static SCRIPT: LazyLock<Script> = LazyLock::new(|| {
        Script::new(
            r"
local held = redis.call('HGET', KEYS[1], 'combiner')
if held and string.sub(held, 1, #ARGV[1] + 1) == ARGV[1] .. '|' then
  redis.call('HDEL', KEYS[1], 'combiner')
  return 1
end
return 0
",
        )
    });
    &SCRIPT
}

/// Queues a full heartbeat for the group's combiner (docs/design.md §5.7). KEYS[1] group hash.
/// ARGV: request id, request entry, combiner token, combiner lease (µs), queue bound.
/// Returns {'1', '1' when this caller took the combiner lease else '0', the request's number}
/// when queued, {'0'} when not: no group hash (the caller's own transition reports it), the queue
/// holds the bound already, or the numbers would reach 2^53. A `reqdone` that is not a whole
/// number below 2^53 counts as 0 (the next batch rewrites it), and a `reqseq` that is not one, or
/// is below `reqdone`, as `reqdone`; a number whose `req:` field exists (a `reqseq` lost or
/// damaged) is passed over, so no queued request is overwritten. The numbers stay exact as Lua
/// doubles and print without an exponent (`%.0f`). Not `allow-oom`: a refused queue falls back
/// to the caller's own transition, which is.
pub(crate) fn group_submit() -> &'static Script {
    static SCRIPT: LazyLock<Script> = LazyLock::new(|| {
        Script::new(&format!(
            "{COMBINER_LEASE_LUA}{}",
            r"
local function counter(field)
  local n = tonumber(redis.call('HGET', KEYS[1], field) or '0')
  if n and n >= 0 and n < 9007199254740992 and n == math.floor(n) then return n end
  return nil
end
local h = KEYS[1]
if redis.call('TYPE', h).ok ~= 'hash' then return {'0'} end
local done = counter('reqdone') or 0
local last = counter('reqseq')
if not last or last < done then last = done end
if last - done >= tonumber(ARGV[5]) then return {'0'} end
local n = last + 1
while redis.call('HEXISTS', h, 'req:' .. string.format('%.0f', n)) == 1 do n = n + 1 end
if n >= 9007199254740991 then return {'0'} end
n = string.format('%.0f', n)
redis.call('HSET', h, 'reqseq', n, 'req:' .. n, ARGV[1] .. '\n' .. ARGV[2])
return {'1', try_lease(h, ARGV[3], ARGV[4]), n}
"
        ))
    });
    &SCRIPT
}

/// A queued heartbeat's wait (docs/design.md §5.7). KEYS[1] group hash. ARGV: request id,
/// combiner token, combiner lease (µs), the request's number. Returns {'1', answer} and deletes
/// it when the combiner has answered (`<expiry µs>|<response JSON>`, or `<expiry µs>|solo`);
/// {'3'} when there is neither the answer nor the queued request (the hash was restored from an
/// older copy, a failover lost writes, a hand deleted it: the request will never be answered);
/// else {'0', '1' when this caller took the combiner lease else '0'}; {'2'} when the group hash
/// is gone. A batch writes an answer and deletes its request in one write, so one of them is
/// always there until the requester collects the answer.
pub(crate) fn group_poll() -> &'static Script {
    static SCRIPT: LazyLock<Script> = LazyLock::new(|| {
        Script::new(&format!(
            "{COMBINER_LEASE_LUA}{}",
            r"
local h = KEYS[1]
if redis.call('TYPE', h).ok ~= 'hash' then return {'2'} end
local answer = redis.call('HGET', h, 'resp:' .. ARGV[1])
if answer then
  redis.call('HDEL', h, 'resp:' .. ARGV[1])
  return {'1', answer}
end
local queued = redis.call('HGET', h, 'req:' .. ARGV[4])
if not queued or string.sub(queued, 1, #ARGV[1] + 1) ~= ARGV[1] .. '\n' then return {'3'} end
return {'0', try_lease(h, ARGV[2], ARGV[3])}
"
        ))
    });
    &SCRIPT
}
