//! The Lua that closes read gates (docs/design.md §8.16), shared by the scripts that raise a
//! fence, check one, sweep consumers, and delete a shard or a group: a read gate
//! ([`crate::keys::StreamKeys::gate`]) is an empty stream named after one fencing token, listed in
//! its shard's registry ([`crate::keys::StreamKeys::gate_registry`]).

/// Lua functions, put before a script's body:
/// - `close_gates(registry, prefix, keep)`: deletes every gate the set `registry` lists whose
///   name starts with `prefix` (`<shard>:gate:<group>:` for one group, `<shard>:gate:` for all)
///   and is not `keep` (`''` keeps none), and removes it from the set. Only `DEL` and `SREM`,
///   which Redis runs at `maxmemory` too. A registry of another type (written by hand) fails the
///   script with `WRONGTYPE`: what it listed cannot be read, so nothing is done until it is
///   repaired by hand.
/// - `open_gate(registry, gate, group)`: lists `gate` in `registry` and creates it (`XGROUP
///   CREATE <gate> <group> $ MKSTREAM`), unless it exists. Returns nil, or Redis's error: the
///   `SADD` comes first, a deny-oom write that Redis refuses at `maxmemory` when it is the
///   script's first write (then nothing was written), or `WRONGTYPE` for a registry written by
///   hand. A gate is never created without being listed.
///
/// Gate names are built from the shard key the script gets, which is in the gates' hash slot:
/// on a cluster the script reaches the gates' node.
pub(crate) const GATE_LUA: &str = r"
local function close_gates(registry, prefix, keep)
  for _, gate in ipairs(redis.call('SMEMBERS', registry)) do
    if gate ~= keep and string.sub(gate, 1, #prefix) == prefix then
      redis.call('DEL', gate)
      redis.call('SREM', registry, gate)
    end
  end
end

local function open_gate(registry, gate, group)
  if redis.call('EXISTS', gate) == 1 then return nil end
  local listed = redis.pcall('SADD', registry, gate)
  if type(listed) == 'table' and listed.err then return listed.err end
  local r = redis.pcall('XGROUP', 'CREATE', gate, group, '$', 'MKSTREAM')
  if type(r) == 'table' and r.err then
    redis.call('SREM', registry, gate)
    return r.err
  end
  return nil
end

";
