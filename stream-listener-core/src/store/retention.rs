//! Retention of a sharded stream (docs/design.md §10.9): the `retention` field of the stream
//! metadata hash `sl:{<prefix>}:stream`, and the script that trims one stream key to it.
//!
//! The field sits beside `meta`, not in it: changing retention bumps no `metadataVersion` and so
//! never causes a rebalance. An absent field means no retention (nothing is ever trimmed).

use std::sync::LazyLock;

use redis::{AsyncCommands, Script};
use serde::{Deserialize, Serialize};

use super::StoreError;
use super::stream::wrong_type;
use crate::connection::RedisConnection;
use crate::keys::StreamKeys;

/// The field of `sl:{<prefix>}:stream` that holds the retention JSON.
pub const RETENTION_FIELD: &str = "retention";

/// Longest accepted age bound: 100 years, in ms. Anything above is a typo (a unit slip).
pub const MAX_RETENTION_AGE_MS: u64 = 100 * 365 * 24 * 3_600_000;

/// Largest accepted length bound: 2^53 entries, the largest integer a Lua number (a double)
/// holds exactly; the trim script compares lengths as Lua numbers.
pub const MAX_RETENTION_LEN: u64 = 1 << 53;

/// How a stream's shards are trimmed (`retention = "acked" | "force"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RetentionMode {
    /// Never trim an entry that some consumer group on the shard has not acked or not been
    /// delivered yet: the bounds are limited by every group's oldest pending and first
    /// undelivered id. The default.
    #[default]
    Acked,
    /// The bounds alone: a group behind them loses entries, and the trim counts them per group.
    Force,
}

impl RetentionMode {
    /// The name the config, the JSON and the trim script use.
    pub fn as_str(self) -> &'static str {
        match self {
            RetentionMode::Acked => "acked",
            RetentionMode::Force => "force",
        }
    }
}

/// A stream's retention, as stored in the `retention` field (camelCase JSON:
/// `{"mode":"acked","maxAgeMs":604800000,"maxLen":null,"dlqMaxAgeMs":null,"dlqMaxLen":null}`).
///
/// `max_len` counts entries per shard. The dead-letter bounds apply to every group's
/// `<prefix>:dlq:<group>` stream, trimmed by the bounds alone (no group reads it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct Retention {
    /// `acked` (default) or `force`.
    #[serde(default)]
    pub mode: RetentionMode,
    /// Entries older than this (ms, by entry id against Redis `TIME`) go.
    #[serde(default)]
    pub max_age_ms: Option<u64>,
    /// Only the newest this many entries of each shard are kept.
    #[serde(default)]
    pub max_len: Option<u64>,
    /// Dead letters older than this (ms) go.
    #[serde(default)]
    pub dlq_max_age_ms: Option<u64>,
    /// Only the newest this many dead letters of each group are kept.
    #[serde(default)]
    pub dlq_max_len: Option<u64>,
}

/// A retention value that cannot be used. Nothing was written.
#[derive(Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RetentionError {
    /// A bound of 0, above [`MAX_RETENTION_AGE_MS`] / [`MAX_RETENTION_LEN`], or unparsable.
    #[error("{key} = {value} is invalid: {reason}")]
    InvalidValue {
        /// The key (`retention_max_age`, `--retention-max-len`, ...).
        key: String,
        /// The value as given.
        value: String,
        /// Why, and what to give instead.
        reason: String,
    },
}

crate::report::readable_debug!(RetentionError);

impl RetentionError {
    pub(crate) fn invalid(key: &str, value: impl ToString, reason: impl Into<String>) -> Self {
        RetentionError::InvalidValue {
            key: key.to_owned(),
            value: value.to_string(),
            reason: reason.into(),
        }
    }
}

impl Retention {
    /// A retention in `mode` with no bounds; add them with the fields.
    pub fn new(mode: RetentionMode) -> Self {
        Retention {
            mode,
            ..Retention::default()
        }
    }

    /// Whether the shards have a bound (else only dead letters are trimmed).
    pub fn bounds_shards(&self) -> bool {
        self.max_age_ms.is_some() || self.max_len.is_some()
    }

    /// Whether the dead-letter streams have a bound.
    pub fn bounds_dead_letters(&self) -> bool {
        self.dlq_max_age_ms.is_some() || self.dlq_max_len.is_some()
    }

    /// Checks every bound: ages 1 ms to 100 years, lengths 1 to 2^53.
    ///
    /// # Errors
    /// [`RetentionError::InvalidValue`] naming the first bad key (its JSON name) and value.
    pub fn validate(&self) -> Result<(), RetentionError> {
        check_age("maxAgeMs", self.max_age_ms)?;
        check_len("maxLen", self.max_len)?;
        check_age("dlqMaxAgeMs", self.dlq_max_age_ms)?;
        check_len("dlqMaxLen", self.dlq_max_len)
    }
}

/// An age bound in ms: 1 ms to [`MAX_RETENTION_AGE_MS`].
pub(crate) fn check_age(key: &str, value: Option<u64>) -> Result<(), RetentionError> {
    match value {
        Some(0) => Err(RetentionError::invalid(
            key,
            "0",
            "an age bound must be above 0 (omit it for no age bound)",
        )),
        Some(ms) if ms > MAX_RETENTION_AGE_MS => Err(RetentionError::invalid(
            key,
            format!("{ms} ms"),
            "it is above 100 years; give a real age such as 7d",
        )),
        _ => Ok(()),
    }
}

/// A length bound: 1 to [`MAX_RETENTION_LEN`].
pub(crate) fn check_len(key: &str, value: Option<u64>) -> Result<(), RetentionError> {
    match value {
        Some(0) => Err(RetentionError::invalid(
            key,
            "0",
            "a length bound must be at least 1 (omit it for no length bound)",
        )),
        Some(len) if len > MAX_RETENTION_LEN => Err(RetentionError::invalid(
            key,
            len,
            "it is above 2^53 entries; give at most 9007199254740992",
        )),
        _ => Ok(()),
    }
}

/// Reads the stream's retention (one `HGET`); `Ok(None)` when none is set.
///
/// # Errors
/// [`StoreError::Redis`]; [`StoreError::CorruptMetadata`] when the field is not retention JSON
/// or a bound is out of range ([`Retention::validate`]); [`StoreError::WrongType`] when the key
/// is not a hash.
pub async fn load_retention(
    conn: &mut RedisConnection,
    keys: &StreamKeys,
) -> Result<Option<Retention>, StoreError> {
    let key = keys.metadata();
    let value: Option<String> = match conn.hget(&key, RETENTION_FIELD).await {
        Ok(value) => value,
        Err(e) => return Err(wrong_type(conn, e, &[(&key, "hash", "hash")]).await),
    };
    value
        .map(|json| {
            let retention: Retention = serde_json::from_str(&json)
                .map_err(|e| StoreError::corrupt(&key, RETENTION_FIELD, e))?;
            // Out of range (written by hand or by another version): used as is, a `maxLen` of
            // 0 in force mode would empty every shard.
            retention.validate().map_err(|e| {
                let e = <serde_json::Error as serde::de::Error>::custom(e.to_string());
                StoreError::corrupt(&key, RETENTION_FIELD, e)
            })?;
            Ok(retention)
        })
        .transpose()
}

/// Sets (`Some`) or clears (`None`) the stream's retention, only while the stream metadata exists
/// (a script: check and write in one step). Returns whether the stream exists.
///
/// # Errors
/// [`StoreError::Redis`]; [`StoreError::WrongType`] when the key is not a hash.
pub async fn write_retention(
    conn: &mut RedisConnection,
    keys: &StreamKeys,
    retention: Option<&Retention>,
) -> Result<bool, StoreError> {
    let key = keys.metadata();
    let json = match retention {
        Some(r) => {
            serde_json::to_string(r).map_err(|e| StoreError::corrupt(&key, RETENTION_FIELD, e))?
        }
        None => String::new(),
    };
    let written: redis::RedisResult<i64> = write_script()
        .key(&key)
        .arg(RETENTION_FIELD)
        .arg(json)
        .invoke_async(conn)
        .await;
    match written {
        Ok(written) => Ok(written == 1),
        Err(e) => Err(wrong_type(conn, e, &[(&key, "hash", "hash")]).await),
    }
}

/// Writes `wanted` as the stream's retention when the stored one differs (startup provisioning
/// of a config that declares retention). Returns `Some(previous)` when it wrote, `None` when it
/// was already so or the stream does not exist (the caller's stream check reports that).
///
/// # Errors
/// [`StoreError::Redis`]; [`StoreError::CorruptMetadata`] when the stored field is not
/// retention JSON (not overwritten: fix it with `stream-listener stream retention --clear`);
/// [`StoreError::WrongType`].
pub async fn ensure_retention(
    conn: &mut RedisConnection,
    keys: &StreamKeys,
    wanted: &Retention,
) -> Result<Option<Option<Retention>>, StoreError> {
    let previous = load_retention(conn, keys).await?;
    if previous.as_ref() == Some(wanted) {
        return Ok(None);
    }
    let written = write_retention(conn, keys, Some(wanted)).await?;
    Ok(written.then_some(previous))
}

/// KEYS[1] stream metadata. ARGV: field, JSON ('' = clear). Returns 0 when the metadata is
/// missing (nothing written), else 1.
fn write_script() -> &'static Script {
    static SCRIPT: LazyLock<Script> = LazyLock::new(|| {
        Script::new(
            r"
if redis.call('HEXISTS', KEYS[1], 'meta') == 0 then return 0 end
if ARGV[2] == '' then redis.call('HDEL', KEYS[1], ARGV[1])
else redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end
return 1
",
        )
    });
    &SCRIPT
}

/// The trim script's body: computes the trim point of one stream key and trims in the same step,
/// or only counts (dry run).
const TRIM_LUA: &str = include_str!("retention_trim.lua");

/// The trim script, sent as `EVALSHA` ([`TRIM_LUA`]).
fn trim_script() -> &'static Script {
    static SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(TRIM_LUA));
    &SCRIPT
}

/// Benchmarks only (`testing` feature): while `true`, `trim_key` sends the trim script as
/// `EVAL` with its body instead of `EVALSHA`. Every other script of the crate goes by `EVALSHA`
/// (and `SCRIPT LOAD` on `NOSCRIPT`, never `EVAL`), so `INFO commandstats`' `cmdstat_eval`
/// (`calls`, `usec`) is then the trim script alone, its nested commands and Lua included. `EVAL`
/// costs one SHA1 of the body per call more than `EVALSHA` (the script is compiled once either
/// way); the retention benchmark measures that difference and subtracts it.
#[cfg(feature = "testing")]
pub static TRIM_AS_EVAL: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Sends the trim script with `args` for `key`: `EVALSHA`, or `EVAL` while [`TRIM_AS_EVAL`].
async fn invoke_trim(
    conn: &mut RedisConnection,
    key: &str,
    args: &[String; 4],
) -> redis::RedisResult<redis::Value> {
    #[cfg(feature = "testing")]
    if TRIM_AS_EVAL.load(std::sync::atomic::Ordering::Relaxed) {
        return redis::cmd("EVAL")
            .arg(TRIM_LUA)
            .arg(1)
            .arg(key)
            .arg(args)
            .query_async(conn)
            .await;
    }
    trim_script().key(key).arg(args).invoke_async(conn).await
}

/// What limited a trim ([`KeyTrim::reason`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub enum TrimReason {
    /// Entries older than the age bound went.
    MaxAge,
    /// Entries beyond the length bound went.
    MaxLen,
    /// A consumer group ([`KeyTrim::holder`]) still needs the entry at the trim point: entries
    /// before it went (acked mode), possibly none.
    Group,
    /// Nothing is beyond the bounds.
    WithinBounds,
    /// Acked mode on a shard without any consumer group: nothing was delivered, everything kept.
    NoGroups,
    /// No bound set for this key.
    NoBounds,
    /// The stream key does not exist.
    NoStream,
}

/// Entries a group lost to a force-mode trim: its pending entries and undelivered entries that
/// were trimmed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct GroupLoss {
    /// The consumer group.
    pub consumer_group: String,
    /// Entries it had not acked (pending) or not received (undelivered) that went.
    pub entries: u64,
}

impl GroupLoss {
    /// `entries` lost by `group`.
    pub fn new(group: &str, entries: u64) -> Self {
        GroupLoss {
            consumer_group: group.to_owned(),
            entries,
        }
    }
}

/// The result of trimming (or, in a dry run, of counting) one stream key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[non_exhaustive]
pub struct KeyTrim {
    /// The stream key.
    pub key: String,
    /// Entries deleted (dry run: that would be).
    pub deleted: u64,
    /// What set the trim point.
    pub reason: TrimReason,
    /// The consumer group that needs the lowest entry (its oldest pending or first undelivered
    /// id is [`KeyTrim::holder_id`]); `None` when no group needs anything.
    pub holder: Option<String>,
    /// That lowest id.
    pub holder_id: Option<String>,
    /// Entries with an id below this one went (`None`: nothing went, or nothing is left).
    pub trim_point: Option<String>,
    /// Entries left.
    pub length_after: u64,
    /// Force mode: what each group lost (groups that lost nothing are not listed).
    pub lost: Vec<GroupLoss>,
}

/// The bounds of one trim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Bounds {
    pub(crate) mode: RetentionMode,
    pub(crate) max_age_ms: Option<u64>,
    pub(crate) max_len: Option<u64>,
}

impl Bounds {
    /// The bounds of the shards.
    pub(crate) fn shards(retention: &Retention) -> Self {
        Bounds {
            mode: retention.mode,
            max_age_ms: retention.max_age_ms,
            max_len: retention.max_len,
        }
    }

    /// The bounds of a dead-letter stream: no group reads it, so the bounds alone.
    pub(crate) fn dead_letters(retention: &Retention) -> Self {
        Bounds {
            mode: RetentionMode::Force,
            max_age_ms: retention.dlq_max_age_ms,
            max_len: retention.dlq_max_len,
        }
    }
}

fn optional(value: Option<u64>) -> String {
    value.map(|v| v.to_string()).unwrap_or_default()
}

fn non_empty(text: String) -> Option<String> {
    (!text.is_empty()).then_some(text)
}

/// Trims `key` (a shard or a dead-letter stream) to `bounds` in one script, or only counts what
/// would go (`dry_run`). Exact trimming (`XTRIM MINID` / `MAXLEN` without `~`): what the report
/// says went is gone. Cost: O(entries that go + consumer groups + their pending entries in force
/// mode); a dry run counts in chunks of 1,000.
///
/// # Errors
/// [`StoreError::Redis`]; [`StoreError::WrongType`] when the key is not a stream;
/// [`StoreError::Malformed`] when the script's reply has another shape.
pub(crate) async fn trim_key(
    conn: &mut RedisConnection,
    key: &str,
    bounds: Bounds,
    dry_run: bool,
) -> Result<KeyTrim, StoreError> {
    let args = [
        bounds.mode.as_str().to_owned(),
        optional(bounds.max_age_ms),
        optional(bounds.max_len),
        if dry_run { "1" } else { "0" }.to_owned(),
    ];
    let reply = invoke_trim(conn, key, &args).await;
    let reply = match reply {
        Ok(reply) => reply,
        Err(e) => return Err(wrong_type(conn, e, &[(key, "stream", "stream")]).await),
    };
    parse_trim(key, reply)
}

type TrimReply = (
    String,
    u64,
    String,
    String,
    String,
    String,
    u64,
    Vec<(String, u64)>,
);

fn parse_trim(key: &str, reply: redis::Value) -> Result<KeyTrim, StoreError> {
    let bad = |detail: String| StoreError::malformed(key, format!("trim script reply: {detail}"));
    if let Ok((status,)) = redis::from_redis_value::<(String,)>(reply.clone())
        && status == "NOSTREAM"
    {
        return Ok(KeyTrim {
            key: key.to_owned(),
            deleted: 0,
            reason: TrimReason::NoStream,
            holder: None,
            holder_id: None,
            trim_point: None,
            length_after: 0,
            lost: Vec::new(),
        });
    }
    let (_, deleted, reason, holder, holder_id, point, length_after, lost): TrimReply =
        redis::from_redis_value(reply).map_err(|e| bad(e.to_string()))?;
    let reason = match reason.as_str() {
        "maxAge" => TrimReason::MaxAge,
        "maxLen" => TrimReason::MaxLen,
        "group" => TrimReason::Group,
        "withinBounds" => TrimReason::WithinBounds,
        "noGroups" => TrimReason::NoGroups,
        "noBounds" => TrimReason::NoBounds,
        other => return Err(bad(format!("unknown reason {other:?}"))),
    };
    Ok(KeyTrim {
        key: key.to_owned(),
        deleted,
        reason,
        holder: non_empty(holder),
        holder_id: non_empty(holder_id),
        trim_point: if deleted == 0 { None } else { non_empty(point) },
        length_after,
        lost: lost
            .into_iter()
            .map(|(consumer_group, entries)| GroupLoss {
                consumer_group,
                entries,
            })
            .collect(),
    })
}
