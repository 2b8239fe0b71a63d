//! Script flags (Redis 7 `#!lua` shebang) of the Lua scripts that must run when Redis is at
//! `maxmemory` (docs/design.md §8.16, "Coordination at `maxmemory`").

/// Put first in a script that renews leases, records a transition, raises a fence or counts a
/// handler attempt. Under `maxmemory` with `noeviction`, Redis refuses a script's first deny-oom
/// write (`ZADD`, `HSET`, `HINCRBY`) unless the script declares `allow-oom`. Without it a full
/// Redis stopped every heartbeat, so members lost their leases and stopped reading, and nothing
/// drained the memory again: consuming, acking and trimming is what frees it, and these writes
/// are a few small fields. Producers' `XADD`s stay refused.
pub(crate) const ALLOW_OOM: &str = "#!lua flags=allow-oom\n";
