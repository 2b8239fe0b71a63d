//! The per-shard lag and pending sampler (docs/design.md §13.1): at most once per
//! `metrics_interval`, between two reads of new entries, a shard task reads its shard's lag,
//! pending count and oldest pending entry for its group in one script call, and sets the shard
//! gauges; the owner of the stream's lowest readable shard also sums lag over every readable
//! shard and sets the group's lag (one publisher per group).

use std::sync::LazyLock;
use std::time::{Duration, Instant};

use redis::Script;

use super::on::{MemberMetrics, ShardMetrics};
use crate::connection::RedisConnection;
use crate::keys::StreamKeys;
use crate::model::ShardIndex;
use crate::store::load_stream_metadata;

/// One shard's state for one consumer group, as Redis reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ShardSample {
    /// `XINFO GROUPS` `lag`: entries not yet delivered to the group; `None` when Redis cannot
    /// tell (entries deleted after the group's last delivered id, a group created at an
    /// arbitrary id).
    pub(crate) lag: Option<u64>,
    /// Entries in the group's pending entries list.
    pub(crate) pending: u64,
    /// Redis `TIME` − the id time of the oldest pending entry (zero when none, or when the id is
    /// in Redis' future).
    pub(crate) oldest_pending_age: Duration,
}

/// Lua: the shard's sample for group `ARGV[1]`: `{found, lag or -1, pending, oldest id or '',
/// TIME seconds, TIME µs}`; `found` is 0 without the stream or the group. Read-only.
fn sample_script() -> &'static Script {
    static SCRIPT: LazyLock<Script> = LazyLock::new(|| {
        Script::new(
            r"
local now = redis.call('TIME')
if redis.call('EXISTS', KEYS[1]) == 0 then return {0, -1, 0, '', now[1], now[2]} end
for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  local info = {}
  for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
  if info['name'] == ARGV[1] then
    local lag = info['lag']
    if not lag then lag = -1 end
    local summary = redis.call('XPENDING', KEYS[1], ARGV[1])
    local oldest = summary[2]
    if not oldest then oldest = '' end
    return {1, lag, summary[1], oldest, now[1], now[2]}
  end
end
return {0, -1, 0, '', now[1], now[2]}
",
        )
    });
    &SCRIPT
}

/// Lua: the summed lag of group `ARGV[1]` over the shards `KEYS`: the sum, or -1 when any
/// shard's lag is unknown (no stream, no group, or Redis cannot tell). Read-only. One call for
/// all shards on a standalone server, where the keys may share a script.
fn group_lag_script() -> &'static Script {
    static SCRIPT: LazyLock<Script> = LazyLock::new(|| {
        Script::new(
            r"
local total = 0
for _, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 0 then return -1 end
  local lag = nil
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', key)) do
    local info = {}
    for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
    if info['name'] == ARGV[1] then lag = info['lag'] end
  end
  if not lag then return -1 end
  total = total + lag
end
return total
",
        )
    });
    &SCRIPT
}

/// Keys per [`group_lag_script`] call: bounds how long one call holds Redis.
const GROUP_LAG_KEYS_PER_CALL: usize = 256;

/// The summed lag of `group` over `keys` on a standalone server, in calls of
/// [`GROUP_LAG_KEYS_PER_CALL`] keys: `None` when any shard's lag is unknown.
///
/// # Errors
/// The Redis error of a call.
pub(crate) async fn read_group_lag(
    conn: &mut RedisConnection,
    keys: &[String],
    group: &str,
) -> redis::RedisResult<Option<u64>> {
    let mut total = 0u64;
    for chunk in keys.chunks(GROUP_LAG_KEYS_PER_CALL) {
        let mut call = group_lag_script().prepare_invoke();
        for key in chunk {
            call.key(key);
        }
        let lag: i64 = call.arg(group).invoke_async(conn).await?;
        let Ok(lag) = u64::try_from(lag) else {
            return Ok(None);
        };
        total += lag;
    }
    Ok(Some(total))
}

/// Reads `key`'s sample for `group`: one script call. `None` without the stream or the group.
///
/// # Errors
/// The Redis error of the call (or a malformed reply).
pub(crate) async fn read_shard(
    conn: &mut RedisConnection,
    key: &str,
    group: &str,
) -> redis::RedisResult<Option<ShardSample>> {
    let (found, lag, pending, oldest, secs, micros): (i64, i64, u64, String, u64, u64) =
        sample_script()
            .key(key)
            .arg(group)
            .invoke_async(conn)
            .await?;
    if found == 0 {
        return Ok(None);
    }
    let now_ms = secs.saturating_mul(1000) + micros / 1000;
    let oldest_pending_age = oldest
        .split_once('-')
        .and_then(|(ms, _)| ms.parse::<u64>().ok())
        .map_or(Duration::ZERO, |ms| {
            Duration::from_millis(now_ms.saturating_sub(ms))
        });
    Ok(Some(ShardSample {
        lag: u64::try_from(lag).ok(),
        pending,
        oldest_pending_age,
    }))
}

impl ShardMetrics {
    /// Samples the shard when due (and its group's lag when `lowest_owned()` says this is the
    /// member's lowest owned shard and it is the stream's lowest readable one); returns whether
    /// it was due (a sample was tried). Errors are counted and logged; the gauges then keep their
    /// last value until the next sample.
    pub(crate) async fn sample(
        &mut self,
        conn: &RedisConnection,
        keys: &StreamKeys,
        group: &str,
        shard: ShardIndex,
        lowest_owned: impl FnOnce() -> bool,
        member: &MemberMetrics,
    ) -> bool {
        let now = Instant::now();
        if now < self.next_sample {
            return false;
        }
        self.next_sample = crate::clock::later_by(now, self.interval);
        let mut conn = conn.clone();
        let own_lag = match read_shard(&mut conn, &keys.shard(shard), group).await {
            Ok(Some(sample)) => {
                // An unknown lag is not set (never shown as 0): the gauge keeps its last value.
                if let Some(lag) = sample.lag {
                    self.lag.set(lag as f64);
                }
                self.pending.set(sample.pending as f64);
                self.oldest_pending_age
                    .set(sample.oldest_pending_age.as_secs_f64());
                sample.lag
            }
            Ok(None) => None,
            Err(error) => {
                member.redis_error(&error);
                tracing::debug!(error = %crate::report::Chain(&error), "sampling the shard's lag failed");
                return true;
            }
        };
        if lowest_owned() {
            self.sample_group(&mut conn, keys, group, (shard, own_lag), member)
                .await;
        }
        true
    }

    /// The group's lag, when `shard` is the stream's lowest readable shard: the sum over every
    /// readable shard, `own_lag` for `shard` itself (just read) and one script call for each
    /// other. Not set when any shard's lag is unknown (`own_lag` `None` included).
    async fn sample_group(
        &self,
        conn: &mut RedisConnection,
        keys: &StreamKeys,
        group: &str,
        (shard, own_lag): (ShardIndex, Option<u64>),
        member: &MemberMetrics,
    ) {
        let readable = match load_stream_metadata(conn, keys).await {
            Ok(Some(meta)) => meta.readable_shard_set(),
            Ok(None) => return,
            Err(error) => {
                member.redis_error(&error);
                return;
            }
        };
        if readable.first() != Some(&shard) {
            return;
        }
        // Its own lag unknown: so is the sum.
        let Some(mut total) = own_lag else {
            return;
        };
        let others: Vec<ShardIndex> = readable.into_iter().filter(|i| *i != shard).collect();
        if !conn.is_cluster() {
            // One script call for all the other shards (a few with thousands of shards).
            let others: Vec<String> = others.iter().map(|i| keys.shard(*i)).collect();
            match read_group_lag(conn, &others, group).await {
                Ok(Some(lag)) => self.group_lag.set((total + lag) as f64),
                Ok(None) => {}
                Err(error) => member.redis_error(&error),
            }
            return;
        }
        for index in others {
            match read_shard(conn, &keys.shard(index), group).await {
                Ok(Some(ShardSample { lag: Some(lag), .. })) => total += lag,
                // A shard without its consumer group yet has delivered nothing: its lag is
                // unknown too.
                Ok(_) => return,
                Err(error) => {
                    member.redis_error(&error);
                    return;
                }
            }
        }
        self.group_lag.set(total as f64);
    }
}

#[cfg(all(test, feature = "testing"))]
mod tests {
    use super::*;
    use crate::connection::RedisTarget;
    use crate::testing::RedisServer;

    #[tokio::test]
    async fn a_shard_sample_reads_lag_pending_and_the_oldest_pending_age() {
        let server = RedisServer::start().unwrap();
        let target = RedisTarget::standalone(server.url());
        let mut conn = RedisConnection::connect(&target, Duration::from_secs(5))
            .await
            .unwrap();
        let key = "s:sample";
        for id in ["1000-0", "2000-0", "3000-0", "4000-0"] {
            let _: String = redis::cmd("XADD")
                .arg(key)
                .arg(id)
                .arg("f")
                .arg("v")
                .query_async(&mut conn)
                .await
                .unwrap();
        }
        let _: () = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(key)
            .arg("g")
            .arg("0")
            .query_async(&mut conn)
            .await
            .unwrap();
        let unread = read_shard(&mut conn, key, "g").await.unwrap().unwrap();
        assert_eq!(
            unread,
            ShardSample {
                lag: Some(4),
                pending: 0,
                oldest_pending_age: Duration::ZERO
            }
        );
        let _: redis::Value = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg("g")
            .arg("c")
            .arg("COUNT")
            .arg(3)
            .arg("STREAMS")
            .arg(key)
            .arg(">")
            .query_async(&mut conn)
            .await
            .unwrap();
        let (secs, _): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await.unwrap();
        let read = read_shard(&mut conn, key, "g").await.unwrap().unwrap();
        assert_eq!((read.lag, read.pending), (Some(1), 3));
        // The oldest pending id is at 1 s after the epoch: its age is Redis TIME − 1 s.
        let age = read.oldest_pending_age.as_secs();
        assert!(age == secs - 1 || age == secs, "age {age} s, TIME {secs} s");
        assert_eq!(read_shard(&mut conn, key, "other").await.unwrap(), None);
        assert_eq!(read_shard(&mut conn, "s:none", "g").await.unwrap(), None);
        // A deleted entry after the last delivered id: Redis cannot tell the lag.
        let _: u64 = redis::cmd("XDEL")
            .arg(key)
            .arg("4000-0")
            .query_async(&mut conn)
            .await
            .unwrap();
        let _: String = redis::cmd("XADD")
            .arg(key)
            .arg("5000-0")
            .arg("f")
            .arg("v")
            .query_async(&mut conn)
            .await
            .unwrap();
        let deleted = read_shard(&mut conn, key, "g").await.unwrap().unwrap();
        assert_eq!((deleted.lag, deleted.pending), (None, 3));
    }

    #[tokio::test]
    async fn the_group_lag_sums_every_shard_in_one_call_and_is_unknown_when_one_is() {
        let server = RedisServer::start().unwrap();
        let target = RedisTarget::standalone(server.url());
        let mut conn = RedisConnection::connect(&target, Duration::from_secs(5))
            .await
            .unwrap();
        // 300 shards (two calls of at most 256 keys): shard i holds i % 3 unread entries.
        let keys: Vec<String> = (0..300).map(|i| format!("{{s:{i}}}")).collect();
        let mut want = 0;
        for (i, key) in keys.iter().enumerate() {
            let _: () = redis::cmd("XGROUP")
                .arg("CREATE")
                .arg(key)
                .arg("g")
                .arg("$")
                .arg("MKSTREAM")
                .query_async(&mut conn)
                .await
                .unwrap();
            for _ in 0..i % 3 {
                let _: String = redis::cmd("XADD")
                    .arg(key)
                    .arg("*")
                    .arg("f")
                    .arg("v")
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                want += 1;
            }
        }
        let commands = |info: String| -> u64 {
            info.lines()
                .find_map(|l| l.strip_prefix("cmdstat_evalsha:calls="))
                .and_then(|rest| rest.split(',').next())
                .map_or(0, |n| n.parse().unwrap())
        };
        // Loads the script (a first EVALSHA answers NOSCRIPT).
        read_group_lag(&mut conn, &keys[..1], "g").await.unwrap();
        let before = commands(
            redis::cmd("INFO")
                .arg("commandstats")
                .query_async(&mut conn)
                .await
                .unwrap(),
        );
        assert_eq!(
            read_group_lag(&mut conn, &keys, "g").await.unwrap(),
            Some(want)
        );
        let after = commands(
            redis::cmd("INFO")
                .arg("commandstats")
                .query_async(&mut conn)
                .await
                .unwrap(),
        );
        // Two script calls: 256 keys and 44.
        assert_eq!(after - before, 2);
        // A shard without the group: unknown.
        assert_eq!(
            read_group_lag(&mut conn, &keys, "other").await.unwrap(),
            None
        );
        let mut with_missing = keys.clone();
        with_missing.push("{s:none}".into());
        assert_eq!(
            read_group_lag(&mut conn, &with_missing, "g").await.unwrap(),
            None
        );
    }
}
