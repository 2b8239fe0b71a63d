//! The Redis permissions a listener needs, checked before it joins (README "ACL users",
//! docs/design.md §15.2).
//!
//! A listener whose Redis user lacks one command or key of its rule would otherwise start, join
//! and then fail in a loop on the first heartbeat, read or ack Redis refuses. So
//! [`check_listener`] asks Redis first, in one script, whether the user may run each command the
//! listener sends, on each kind of key it touches: `redis.acl_check_cmd` (Redis 7.0,
//! <https://redis.io/docs/latest/develop/interact/programmability/lua-api/#redis.acl_check_cmd>)
//! answers without running anything, and needs no admin rights (`ACL DRYRUN` does). The first
//! refused check becomes a [`PermissionError`] naming the command or the key, what the listener
//! needs it for, and the ACL rule to add. Redis's own `NOPERM` reply names a command but not the
//! key; the check knows the key.

use redis::Script;

use crate::connection::RedisConnection;
use crate::keys::{GroupKeys, STREAMS_INDEX_KEY, StreamKeys};

/// One command the role sends: why, its arguments, and the key it touches (with the README key
/// pattern that grants it).
struct Check {
    operation: &'static str,
    /// 1, or 2 for a command with subcommands (`XINFO GROUPS`): the words that name it.
    name_words: usize,
    argv: Vec<String>,
    key: Option<(String, String)>,
}

impl Check {
    fn new(operation: &'static str, argv: &[&str]) -> Self {
        let name_words = match argv[0] {
            "XINFO" | "XGROUP" | "SCRIPT" | "CLUSTER" | "CLIENT" => 2,
            _ => 1,
        };
        Check {
            operation,
            name_words,
            argv: argv.iter().map(|a| (*a).to_owned()).collect(),
            key: None,
        }
    }

    /// This check on `key`, granted by the README pattern `pattern`. The key is the argument
    /// after the command's name words.
    fn on(operation: &'static str, argv: &[&str], key: &str, pattern: &str) -> Self {
        let mut check = Check::new(operation, argv);
        check.argv.insert(check.name_words, key.to_owned());
        check.key = Some((key.to_owned(), pattern.to_owned()));
        check
    }

    fn command(&self) -> String {
        self.argv[..self.name_words].join(" ")
    }
}

/// Which permission a Redis user lacks.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Missing {
    /// The command itself (`+xclaim` is not in the rule).
    Command,
    /// The key (no key pattern of the rule matches it, or only for reading or writing).
    Key {
        /// The key the command touches, e.g. `sl:{orders:billing}:group`.
        key: String,
        /// The README rule's pattern that grants it, e.g. `~sl:{orders:billing}:group`.
        pattern: String,
    },
}

/// A command or key the Redis user may not use, found before the listener joined.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", self.describe())]
#[non_exhaustive]
pub struct PermissionError {
    /// The role: `listener`.
    pub role: &'static str,
    /// What the role needs the permission for, e.g. `take over a shard's pending entries`.
    pub operation: &'static str,
    /// The command as Redis names it, upper case, with its subcommand: `XCLAIM`, `XINFO GROUPS`.
    pub command: String,
    /// The command or the key.
    pub missing: Missing,
}

impl PermissionError {
    /// The `+command` rule that grants [`Self::command`]: `+xclaim`, `+xinfo|groups`.
    pub fn command_rule(&self) -> String {
        format!("+{}", self.command.to_lowercase().replace(' ', "|"))
    }

    fn describe(&self) -> String {
        match &self.missing {
            Missing::Command => format!(
                "the Redis user may not run {} (the {} needs it to {}): add {} to the user's ACL rule (README \"ACL users\" has the {} rule)",
                self.command,
                self.role,
                self.operation,
                self.command_rule(),
                self.role
            ),
            Missing::Key { key, pattern } => format!(
                "the Redis user may not use the key {key} with {} (the {} needs it to {}): add a key pattern that matches it, such as {pattern}, to the user's ACL rule (README \"ACL users\" has the {} rule)",
                self.command, self.role, self.operation, self.role
            ),
        }
    }
}

/// Why [`check_listener`] stopped the start.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum AclCheckError {
    /// The Redis user lacks a permission.
    #[error(transparent)]
    Denied(Box<PermissionError>),
    /// The check itself failed for another reason (Redis unreachable, a script error).
    #[error("checking the Redis user's permissions (EVALSHA of redis.acl_check_cmd) failed")]
    Redis(#[source] redis::RedisError),
}

crate::report::readable_debug!(AclCheckError);

/// For each check (`n`, `name_words`, then `n` arguments in ARGV): `redis.acl_check_cmd` on the
/// whole command; on the first refused, `{index, 1 if the command alone is allowed}`; `{0, 0}`
/// when every check passes.
const CHECK_LUA: &str = r"
local i, index = 1, 0
while i <= #ARGV do
  local n, words = tonumber(ARGV[i]), tonumber(ARGV[i + 1])
  local argv = {}
  for j = 1, n do argv[j] = ARGV[i + 1 + j] end
  index = index + 1
  if not redis.acl_check_cmd(unpack(argv)) then
    local name = {}
    for j = 1, words do name[j] = argv[j] end
    return {index, redis.acl_check_cmd(unpack(name)) and 1 or 0}
  end
  i = i + 2 + n
end
return {0, 0}
";

/// The commands a listener of `group` sends and the keys it touches (docs/design.md §2, §5, §8;
/// the README's listener rule grants exactly these). Shard 0 stands for every shard: the rule's
/// shard pattern covers them all. `creates_stream`: `auto_create_shards` is set (`SADD
/// sl:streams`); `waits`: `min_replica_acks > 0` (`WAIT`).
fn listener_checks(
    keys: &StreamKeys,
    group: &GroupKeys,
    creates_stream: bool,
    waits: bool,
) -> Vec<Check> {
    let g = group.group();
    let shard = keys.shard(0);
    let fence = keys.fence(0);
    let gate = keys.gate(0, group, "1:1:probe:probe");
    let gate_registry = keys.gate_registry(0);
    let attempts = keys.attempts(0);
    let meta = keys.metadata();
    let (group_key, leases, history) = (group.metadata(), group.leases(), group.history());
    let dlq = keys.dead_letters(group);
    let prefix = keys.prefix();
    let patterns = listener_key_patterns(prefix, g);
    let [
        shards,
        meta_pattern,
        group_pattern,
        leases_pattern,
        history_pattern,
        dlq_pattern,
        index_pattern,
    ] = <[String; 7]>::try_from(patterns).expect("seven listener patterns");
    let mut checks = vec![
        Check::new("read the coordinator's clock", &["TIME"]),
        Check::on(
            "read the stream metadata",
            &["EXISTS"],
            &meta,
            &meta_pattern,
        ),
        Check::on(
            "read the stream metadata",
            &["HGETALL"],
            &meta,
            &meta_pattern,
        ),
        Check::on(
            "read the stream metadata",
            &["HGET", "meta"],
            &meta,
            &meta_pattern,
        ),
        Check::on("run retention", &["HEXISTS", "meta"], &meta, &meta_pattern),
        Check::on("check a shard stream's type", &["TYPE"], &shard, &shards),
        Check::on(
            "read a shard",
            &["XREADGROUP", "GROUP", g, "probe", "COUNT", "1", "STREAMS"],
            &shard,
            &shards,
        )
        .key_last(),
        Check::on(
            "wait for new entries",
            &["XREAD", "COUNT", "1", "STREAMS"],
            &shard,
            &shards,
        )
        .key_last(),
        // One blocking XREAD per member over its caught-up shards, interrupted with CLIENT
        // UNBLOCK when a shard joins or leaves it (docs/design.md §8.4).
        Check::new("wait for new entries", &["CLIENT", "ID"]),
        Check::new("wait for new entries", &["CLIENT", "UNBLOCK", "0"]),
        // A strict wait that lost its reply is killed before its shards read on (§8.4).
        Check::new("wait for new entries", &["CLIENT", "KILL", "ID", "0"]),
        Check::on("ack entries", &["XACK", g, "0-1"], &shard, &shards),
        Check::on(
            "take over a shard's pending entries",
            &["XCLAIM", g, "probe", "0", "0-1"],
            &shard,
            &shards,
        ),
        Check::on(
            "read a shard's pending entries",
            &["XPENDING", g],
            &shard,
            &shards,
        ),
        Check::on("measure lag", &["XLEN"], &shard, &shards),
        Check::on(
            "read entries by id",
            &["XRANGE", "-", "+", "COUNT", "1"],
            &shard,
            &shards,
        ),
        Check::on(
            "read a shard's last entry",
            &["XREVRANGE", "+", "-", "COUNT", "1"],
            &shard,
            &shards,
        ),
        Check::on("run retention", &["XTRIM", "MINID", "0"], &shard, &shards),
        Check::on(
            "read the consumer groups of a shard",
            &["XINFO", "GROUPS"],
            &shard,
            &shards,
        ),
        Check::on(
            "remove idle consumers",
            &["XINFO", "CONSUMERS", g],
            &shard,
            &shards,
        ),
        Check::on(
            "create the consumer group on a shard",
            &["XGROUP", "CREATE", g, "$"],
            &shard,
            &shards,
        ),
        Check::on(
            "provision a shard stream",
            &["XGROUP", "DESTROY", g],
            &shard,
            &shards,
        ),
        Check::on(
            "remove idle consumers",
            &["XGROUP", "DELCONSUMER", g, "probe"],
            &shard,
            &shards,
        ),
        Check::on("read a shard's fence", &["HGET", g], &fence, &shards),
        // A strict read is a transaction with the fence check inside it and read gates: the
        // check opens the gates (EXISTS, XGROUP CREATE ... MKSTREAM, listed with SADD) or, on a
        // refusal, deletes them (DEL, SREM); the read and the strict wait name them, and a raise
        // deletes the other tokens' (SMEMBERS) (docs/design.md §8.16).
        Check::new("fence a read", &["MULTI"]),
        Check::new("fence a read", &["EXEC"]),
        Check::new("fence a read", &["EVAL", "return 1", "0"]),
        // With +eval, redis-rs runs this very check with EVAL when the server lacks its script,
        // so the refusal of SCRIPT LOAD would only show later, at the first fenced script.
        Check::new("load its scripts", &["SCRIPT", "LOAD", "return 1"]),
        Check::on("fence a read", &["EXISTS"], &gate, &shards),
        Check::on(
            "fence a read",
            &["XGROUP", "CREATE", g, "$", "MKSTREAM"],
            &gate,
            &shards,
        ),
        Check::on("fence a read", &["DEL"], &gate, &shards),
        Check::on("fence a read", &["SADD", "probe"], &gate_registry, &shards),
        Check::on("fence a read", &["SREM", "probe"], &gate_registry, &shards),
        Check::on("fence a read", &["SMEMBERS"], &gate_registry, &shards),
        Check::on(
            "fence a read",
            &["XREADGROUP", "GROUP", g, "probe", "COUNT", "1", "STREAMS"],
            &gate,
            &shards,
        )
        .key_last(),
        Check::on("register the group on a shard", &["HKEYS"], &fence, &shards),
        Check::on(
            "count handler attempts",
            &["HINCRBY", "probe", "1"],
            &attempts,
            &shards,
        ),
        Check::on(
            "forget handler attempts",
            &["HDEL", "probe"],
            &attempts,
            &shards,
        ),
        Check::on("forget handler attempts", &["DEL"], &attempts, &shards),
        Check::on(
            "send heartbeats",
            &["HMGET", "meta"],
            &group_key,
            &group_pattern,
        ),
        Check::on(
            "send heartbeats",
            &["HSET", "probe", "1"],
            &group_key,
            &group_pattern,
        ),
        Check::on(
            "send heartbeats",
            &["ZADD", "1", "probe"],
            &leases,
            &leases_pattern,
        ),
        Check::on(
            "send heartbeats",
            &["ZRANGE", "0", "-1"],
            &leases,
            &leases_pattern,
        ),
        Check::on(
            "send heartbeats",
            &["ZSCORE", "probe"],
            &leases,
            &leases_pattern,
        ),
        Check::on(
            "send heartbeats",
            &["ZREM", "probe"],
            &leases,
            &leases_pattern,
        ),
        Check::on(
            "record departed members",
            &["LPUSH", "probe"],
            &history,
            &history_pattern,
        ),
        Check::on(
            "record departed members",
            &["LTRIM", "0", "99"],
            &history,
            &history_pattern,
        ),
        Check::on(
            "write dead letters",
            &["XADD", "*", "probe", "1"],
            &dlq,
            &dlq_pattern,
        ),
    ];
    if creates_stream {
        checks.push(Check::on(
            "create its stream (auto_create_shards)",
            &["SADD", prefix],
            STREAMS_INDEX_KEY,
            &index_pattern,
        ));
    }
    if waits {
        checks.push(Check::new(
            "wait for replicas (min_replica_acks)",
            &["WAIT", "0", "0"],
        ));
    }
    checks
}

/// The key patterns of the README's listener rule for `group` of stream `prefix` (docs/design.md
/// §2): the shard streams with their fences, attempts and read gates, the stream metadata, the
/// group's three
/// keys, its dead letters, and the `sl:streams` index (only to create the stream).
pub fn listener_key_patterns(prefix: &str, group: &str) -> Vec<String> {
    vec![
        format!("~{{{prefix}:[0-9]*"),
        format!("~sl:{{{prefix}}}:stream"),
        format!("~sl:{{{prefix}:{group}}}:group"),
        format!("~sl:{{{prefix}:{group}}}:leases"),
        format!("~sl:{{{prefix}:{group}}}:history"),
        format!("~{prefix}:dlq:{group}"),
        format!("~{STREAMS_INDEX_KEY}"),
    ]
}

/// The key patterns of the README's producer rule for stream `prefix`: the shard streams (not
/// their fences: the pattern ends in `}`) and, read only, the stream metadata.
pub fn producer_key_patterns(prefix: &str) -> Vec<String> {
    vec![
        format!("~{{{prefix}:[0-9]*}}"),
        format!("%R~sl:{{{prefix}}}:stream"),
    ]
}

/// The key patterns of the README's admin tool rule for stream `prefix`: the listener's, for every
/// group of the stream.
pub fn admin_key_patterns(prefix: &str) -> Vec<String> {
    vec![
        format!("~{{{prefix}:[0-9]*"),
        format!("~sl:{{{prefix}}}:stream"),
        format!("~sl:{{{prefix}:*}}:group"),
        format!("~sl:{{{prefix}:*}}:leases"),
        format!("~sl:{{{prefix}:*}}:history"),
        format!("~{prefix}:dlq:*"),
        format!("~{STREAMS_INDEX_KEY}"),
    ]
}

impl Check {
    /// Moves the key to the end (`XREADGROUP … STREAMS <key> >`, `XREAD … STREAMS <key> 0`).
    fn key_last(mut self) -> Self {
        let key = self.argv.remove(self.name_words);
        self.argv.push(key);
        self.argv.push(
            if self.argv[0] == "XREADGROUP" {
                ">"
            } else {
                "0"
            }
            .to_owned(),
        );
        self
    }
}

/// Checks, before a listener of `group` on `keys` joins, that its Redis user may run every command
/// it sends on every kind of key it touches (one `EVALSHA`; Redis 7.0's
/// `redis.acl_check_cmd`). `creates_stream`: it may create its stream (`auto_create_shards`);
/// `waits`: it sends `WAIT` (`min_replica_acks > 0`).
///
/// # Errors
/// [`AclCheckError::Denied`] naming the first refused command or key (also when `EVALSHA` or
/// `SCRIPT LOAD` themselves are refused); [`AclCheckError::Redis`] when the check could not run.
pub async fn check_listener(
    conn: &mut RedisConnection,
    keys: &StreamKeys,
    group: &GroupKeys,
    creates_stream: bool,
    waits: bool,
) -> Result<(), AclCheckError> {
    let mut checks = listener_checks(keys, group, creates_stream, waits);
    if conn.is_cluster() {
        // redis-rs reads the slot map with CLUSTER SLOTS, and follows a migrating slot with
        // ASKING (README "ACL users", the cluster line).
        checks.push(Check::new(
            "follow the cluster's slots",
            &["CLUSTER", "SLOTS"],
        ));
        checks.push(Check::new("follow a slot that moves", &["ASKING"]));
    }
    let script = Script::new(CHECK_LUA);
    let mut invocation = script.prepare_invoke();
    for check in &checks {
        invocation
            .arg(check.argv.len())
            .arg(check.name_words)
            .arg(&check.argv);
    }
    let (index, command_allowed): (usize, u8) = match invocation.invoke_async(conn).await {
        Ok(reply) => reply,
        Err(error) => {
            return Err(match refused_command(&error) {
                Some(command) => AclCheckError::Denied(Box::new(PermissionError {
                    role: "listener",
                    operation: "check its permissions and run its scripts",
                    command,
                    missing: Missing::Command,
                })),
                None => AclCheckError::Redis(error),
            });
        }
    };
    let Some(check) = index.checked_sub(1).and_then(|i| checks.get(i)) else {
        return Ok(());
    };
    let missing = match (&check.key, command_allowed) {
        (Some((key, pattern)), 1) => Missing::Key {
            key: key.clone(),
            pattern: pattern.clone(),
        },
        _ => Missing::Command,
    };
    Err(AclCheckError::Denied(Box::new(PermissionError {
        role: "listener",
        operation: check.operation,
        command: check.command(),
        missing,
    })))
}

/// The command of a `NOPERM this user has no permissions to run the 'script|load' command`
/// reply, as Redis names it upper case (`SCRIPT LOAD`); `None` for any other error.
pub(crate) fn refused_command(error: &redis::RedisError) -> Option<String> {
    // A pipeline's error carries its failed commands' errors; the first one is the refusal.
    let first = || {
        let errors = error.clone().into_server_errors()?;
        let (_, first) = errors.first()?;
        Some((first.code().to_owned(), first.details().map(str::to_owned)))
    };
    let (code, detail) = match (error.code(), error.detail()) {
        (Some(code), Some(detail)) => (code.to_owned(), Some(detail.to_owned())),
        _ => first()?,
    };
    if code != "NOPERM" {
        return None;
    }
    let detail = detail?;
    let start = detail.find("run the '")? + "run the '".len();
    let end = start + detail[start..].find('\'')?;
    Some(detail[start..end].replace('|', " ").to_uppercase())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_command_is_named_as_redis_names_it() {
        let error = redis::make_extension_error(
            "NOPERM".to_owned(),
            Some("this user has no permissions to run the 'script|load' command".to_owned()),
        );
        assert_eq!(refused_command(&error).as_deref(), Some("SCRIPT LOAD"));
        let key = redis::make_extension_error(
            "NOPERM".to_owned(),
            Some(
                "this user has no permissions to access one of the keys used as arguments"
                    .to_owned(),
            ),
        );
        assert_eq!(refused_command(&key), None);
    }

    #[test]
    fn errors_say_what_to_add() {
        let error = PermissionError {
            role: "listener",
            operation: "read the consumer groups of a shard",
            command: "XINFO GROUPS".into(),
            missing: Missing::Command,
        };
        assert_eq!(error.command_rule(), "+xinfo|groups");
        assert!(error.to_string().contains("add +xinfo|groups"), "{error}");
        let keys = StreamKeys::new("orders").unwrap();
        let checks = listener_checks(&keys, &keys.group("billing").unwrap(), true, true);
        let read = checks.iter().find(|c| c.argv[0] == "XREADGROUP").unwrap();
        assert_eq!(
            read.argv.join(" "),
            "XREADGROUP GROUP billing probe COUNT 1 STREAMS {orders:0} >"
        );
        let info = checks
            .iter()
            .find(|c| c.command() == "XINFO GROUPS")
            .unwrap();
        assert_eq!(info.argv.join(" "), "XINFO GROUPS {orders:0}");
    }
}
