//! The dead-letter stream of a consumer group, `<prefix>:dlq:<group>` (docs/design.md §8.8,
//! §10.8): reading it page by page ([`list_dead_letters`]), one dead letter whole
//! ([`show_dead_letter`]), re-publishing dead letters ([`replay_dead_letters`]) and deleting them
//! ([`purge_dead_letters`]).
//!
//! Every dead letter starts with the fixed fields `sourceStream`, `sourceId`, `shard`, `group`,
//! `reason`, `error`, `attempts`, in that order, followed by the entry's own fields (none for an
//! entry dead-lettered by id: trimmed, or too large).

mod purge;
mod replay;
mod select;

use redis::AsyncCommands;
use serde::Serialize;

use super::{AdminError, load_required, stream_keys};
use crate::admin::scripts::stream_time;
use crate::connection::RedisConnection;
use crate::dataplane::DeadLetterReason;
use crate::keys::StreamKeys;
use crate::model::ShardIndex;
use crate::store::StoreError;

pub use purge::{PURGE_ID_LIMIT, PurgeReport, purge_dead_letters};
pub use replay::{
    ReplayDuplicate, ReplayReport, ReplaySkip, Replayed, SkipReason, replay_dead_letters,
};
pub use select::DeadLetterSelection;

/// The default page size of [`list_dead_letters`] (the tool's `--count`).
pub const DEFAULT_DEAD_LETTER_PAGE: usize = 100;

/// The largest page [`list_dead_letters`] reads at once.
pub const MAX_DEAD_LETTER_PAGE: usize = 10_000;

/// The fixed fields that open every dead letter, in order (docs/design.md §8.8).
const FIXED_FIELDS: [&str; 7] = [
    "sourceStream",
    "sourceId",
    "shard",
    "group",
    "reason",
    "error",
    "attempts",
];

/// Every [`DeadLetterReason`], in the order the tool lists them.
pub(crate) fn known_reasons() -> [DeadLetterReason; 5] {
    [
        DeadLetterReason::Handler,
        DeadLetterReason::NonRetryable,
        DeadLetterReason::Decode,
        DeadLetterReason::MaxDeliveries,
        DeadLetterReason::TooLarge,
    ]
}

/// The [`DeadLetterReason`] stored as `reason` (`handler`, `non-retryable`, `decode`,
/// `max-deliveries`, `too-large`).
///
/// # Errors
/// [`AdminError::UnknownDeadLetterReason`] for any other text, naming it and the known ones.
pub fn parse_dead_letter_reason(text: &str) -> Result<DeadLetterReason, AdminError> {
    known_reasons()
        .into_iter()
        .find(|reason| reason.as_str() == text)
        .ok_or_else(|| AdminError::UnknownDeadLetterReason {
            reason: text.to_owned(),
            known: known_reasons().map(DeadLetterReason::as_str).join(", "),
        })
}

/// A stream entry id `<ms>-<seq>` as its two parts, or `None` when `id` is not one.
pub(crate) fn parse_entry_id(id: &str) -> Option<(u64, u64)> {
    let (ms, seq) = id.split_once('-')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(ms) || !digits(seq) {
        return None;
    }
    Some((ms.parse().ok()?, seq.parse().ok()?))
}

/// One field of a dead letter's original entry. Values are shown as UTF-8 (bytes that are not
/// UTF-8 are shown replaced by U+FFFD; replay re-publishes the bytes as stored).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EntryField {
    /// The field name (`key`, `payload`, or a raw field of the producer).
    pub name: String,
    /// The value, as UTF-8.
    pub value: String,
}

/// One dead letter as [`list_dead_letters`] shows it: the fixed fields, its age and how many
/// fields of the original entry it carries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DeadLetterSummary {
    /// The dead letter's id in the dead-letter stream.
    pub id: String,
    /// `sourceStream`: the shard stream key it came from, e.g. `{orders:1}`.
    pub source_stream: String,
    /// `sourceId`: the entry's id in that shard stream.
    pub source_id: String,
    /// `shard`: the shard index; `None` when the stored field is not a number.
    pub shard: Option<ShardIndex>,
    /// `reason`: `handler`, `non-retryable`, `decode`, `max-deliveries` or `too-large`.
    pub reason: String,
    /// `error`: the handler's error with its causes (may span lines).
    pub error: String,
    /// `attempts`: handler attempts made; `None` when the stored field is not a number.
    pub attempts: Option<u32>,
    /// Redis `TIME` minus the millisecond part of the dead letter's id, ms (0 when the clock is
    /// behind the id).
    pub age_ms: u64,
    /// Fields of the original entry it carries; 0 for an entry dead-lettered by id (trimmed, or
    /// too large), which cannot be replayed.
    pub payload_fields: usize,
    /// `false` when the dead letter does not start with the fixed fields in order (not written by
    /// stream-listener): shown as found, never replayed.
    pub well_formed: bool,
}

/// One dead letter whole ([`show_dead_letter`]): the summary and the original entry's fields.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DeadLetter {
    /// The fixed fields and age.
    #[serde(flatten)]
    pub summary: DeadLetterSummary,
    /// The original entry's fields, in order (`key` and `payload` for the producer's entries).
    pub fields: Vec<EntryField>,
}

/// One page of [`list_dead_letters`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DeadLetterPage {
    /// The stream prefix.
    pub stream_prefix: String,
    /// The consumer group.
    pub consumer_group: String,
    /// The dead-letter stream key `<prefix>:dlq:<group>`.
    pub dead_letter_stream: String,
    /// Its length (`XLEN`), all pages.
    pub total: u64,
    /// The dead letters of this page, oldest first.
    pub dead_letters: Vec<DeadLetterSummary>,
    /// The id to pass as `after` for the next page; `None` on the last page.
    pub next_after: Option<String>,
}

/// A dead letter as read: its id and its raw field/value pairs.
#[derive(Debug, Clone)]
pub(crate) struct RawDeadLetter {
    pub(crate) id: String,
    pub(crate) pairs: Vec<(String, Vec<u8>)>,
    /// Whether a field name was not UTF-8 (shown lossily in `pairs`; never replayed).
    pub(crate) binary_names: bool,
}

impl RawDeadLetter {
    /// Whether the pairs open with [`FIXED_FIELDS`] in order.
    fn well_formed(&self) -> bool {
        self.pairs.len() >= FIXED_FIELDS.len()
            && self
                .pairs
                .iter()
                .zip(FIXED_FIELDS)
                .all(|((name, _), fixed)| name == fixed)
    }

    /// The first value of field `name`, as UTF-8.
    fn text(&self, name: &str) -> String {
        self.pairs
            .iter()
            .find(|(field, _)| field == name)
            .map(|(_, value)| String::from_utf8_lossy(value).into_owned())
            .unwrap_or_default()
    }

    /// The original entry's fields: the pairs after the fixed ones (none when malformed).
    pub(crate) fn payload(&self) -> &[(String, Vec<u8>)] {
        if self.well_formed() {
            &self.pairs[FIXED_FIELDS.len()..]
        } else {
            &[]
        }
    }

    /// The stored `reason`.
    pub(crate) fn reason(&self) -> String {
        self.text("reason")
    }

    /// The millisecond part of the id.
    pub(crate) fn id_ms(&self) -> u64 {
        parse_entry_id(&self.id).map_or(0, |(ms, _)| ms)
    }

    fn summary(&self, now_ms: u64) -> DeadLetterSummary {
        DeadLetterSummary {
            id: self.id.clone(),
            source_stream: self.text("sourceStream"),
            source_id: self.text("sourceId"),
            shard: self.text("shard").parse().ok(),
            reason: self.reason(),
            error: self.text("error"),
            attempts: self.text("attempts").parse().ok(),
            age_ms: now_ms.saturating_sub(self.id_ms()),
            payload_fields: self.payload().len(),
            well_formed: self.well_formed(),
        }
    }

    fn whole(&self, now_ms: u64) -> DeadLetter {
        DeadLetter {
            summary: self.summary(now_ms),
            fields: self
                .payload()
                .iter()
                .map(|(name, value)| EntryField {
                    name: name.clone(),
                    value: String::from_utf8_lossy(value).into_owned(),
                })
                .collect(),
        }
    }
}

/// The dead-letter stream of one group, checked: the stream exists, the group name is valid,
/// and the group is registered or has a dead-letter stream (a deleted group keeps it).
pub(crate) struct DeadLetterStream {
    pub(crate) keys: StreamKeys,
    pub(crate) group: String,
    pub(crate) key: String,
    /// The other consumer groups registered on the stream (a replay reaches them too).
    pub(crate) other_groups: Vec<String>,
}

impl DeadLetterStream {
    /// Opens the dead-letter stream of `group` on `prefix`.
    ///
    /// # Errors
    /// [`AdminError::InvalidName`]; [`StoreError::MissingStream`]; [`StoreError::UnknownGroup`]
    /// when the group is not registered and has no dead-letter stream; Redis failure.
    pub(crate) async fn open(
        conn: &mut RedisConnection,
        prefix: &str,
        group: &str,
    ) -> Result<DeadLetterStream, AdminError> {
        let keys = stream_keys(prefix)?;
        let group_keys = keys.group(group)?;
        let meta = load_required(conn, &keys).await?;
        let key = keys.dead_letters(&group_keys);
        if !meta.groups.iter().any(|g| g.consumer_group == group) {
            let exists: bool = conn.exists(&key).await.map_err(StoreError::from)?;
            if !exists {
                return Err(StoreError::UnknownGroup {
                    prefix: prefix.to_owned(),
                    group: group.to_owned(),
                }
                .into());
            }
        }
        let other_groups = meta
            .groups
            .iter()
            .map(|g| g.consumer_group.clone())
            .filter(|g| g != group)
            .collect();
        Ok(DeadLetterStream {
            keys,
            group: group.to_owned(),
            key,
            other_groups,
        })
    }

    /// Redis `TIME` of the stream metadata's node, ms (the admin operations' clock).
    pub(crate) async fn now_ms(&self, conn: &mut RedisConnection) -> Result<u64, AdminError> {
        Ok(stream_time(conn, &self.keys).await? / 1000)
    }

    /// `XRANGE <key> <start> <end> COUNT <count>`, parsed.
    pub(crate) async fn range(
        &self,
        conn: &mut RedisConnection,
        start: &str,
        end: &str,
        count: usize,
    ) -> Result<Vec<RawDeadLetter>, AdminError> {
        let reply: Vec<(String, Vec<Vec<u8>>)> = redis::cmd("XRANGE")
            .arg(&self.key)
            .arg(start)
            .arg(end)
            .arg("COUNT")
            .arg(count)
            .query_async(conn)
            .await
            .map_err(StoreError::from)?;
        Ok(reply
            .into_iter()
            .map(|(id, flat)| RawDeadLetter {
                id,
                binary_names: flat
                    .chunks_exact(2)
                    .any(|kv| std::str::from_utf8(&kv[0]).is_err()),
                pairs: flat
                    .chunks_exact(2)
                    .map(|kv| (String::from_utf8_lossy(&kv[0]).into_owned(), kv[1].clone()))
                    .collect(),
            })
            .collect())
    }

    /// The dead letter `id`, if present.
    pub(crate) async fn get(
        &self,
        conn: &mut RedisConnection,
        id: &str,
    ) -> Result<Option<RawDeadLetter>, AdminError> {
        Ok(self.range(conn, id, id, 1).await?.into_iter().next())
    }

    /// `XDEL` of `ids`: how many were there.
    pub(crate) async fn delete(
        &self,
        conn: &mut RedisConnection,
        ids: &[&str],
    ) -> Result<u64, redis::RedisError> {
        if ids.is_empty() {
            return Ok(0);
        }
        conn.xdel(&self.key, ids).await
    }
}

/// Lists the dead letters of `group` on stream `prefix`, oldest first: `count` of them (1 to
/// [`MAX_DEAD_LETTER_PAGE`]) after the id `after` (exclusive; `None`: from the start), with
/// their fixed fields and age (Redis `TIME` of the stream metadata's node minus the dead
/// letter's id time). Reads with `XRANGE`; changes nothing. A group that was deleted keeps its
/// dead-letter stream, which can still be listed.
///
/// # Errors
/// [`AdminError::InvalidName`]; [`AdminError::InvalidSelection`] for a `count` of 0 or above
/// [`MAX_DEAD_LETTER_PAGE`]; [`AdminError::InvalidEntryId`] when `after` is not an entry id;
/// [`AdminError::Store`]: [`StoreError::MissingStream`], [`StoreError::UnknownGroup`] (not
/// registered and no dead-letter stream), Redis failure.
pub async fn list_dead_letters(
    conn: &mut RedisConnection,
    prefix: &str,
    group: &str,
    after: Option<&str>,
    count: usize,
) -> Result<DeadLetterPage, AdminError> {
    if count == 0 || count > MAX_DEAD_LETTER_PAGE {
        return Err(AdminError::InvalidSelection {
            detail: format!(
                "a page of {count} dead letters; give --count 1 to {MAX_DEAD_LETTER_PAGE}"
            ),
        });
    }
    let start = match after {
        Some(id) => format!("({}", checked_id(id)?),
        None => "-".to_owned(),
    };
    let dlq = DeadLetterStream::open(conn, prefix, group).await?;
    let now_ms = dlq.now_ms(conn).await?;
    let total: u64 = conn.xlen(&dlq.key).await.map_err(StoreError::from)?;
    // One more than asked tells whether another page follows.
    let mut raw = dlq.range(conn, &start, "+", count + 1).await?;
    let next_after = if raw.len() > count {
        raw.truncate(count);
        raw.last().map(|last| last.id.clone())
    } else {
        None
    };
    Ok(DeadLetterPage {
        stream_prefix: prefix.to_owned(),
        consumer_group: group.to_owned(),
        dead_letter_stream: dlq.key.clone(),
        total,
        dead_letters: raw.iter().map(|d| d.summary(now_ms)).collect(),
        next_after,
    })
}

/// The dead letter `id` of `group` on stream `prefix`, whole: fixed fields, age, and every field
/// of the original entry (`key`, `payload`...). Changes nothing.
///
/// # Errors
/// [`AdminError::InvalidEntryId`] when `id` is not an entry id `<ms>-<seq>`;
/// [`AdminError::DeadLettersNotFound`] when no dead letter has that id; otherwise as
/// [`list_dead_letters`].
pub async fn show_dead_letter(
    conn: &mut RedisConnection,
    prefix: &str,
    group: &str,
    id: &str,
) -> Result<DeadLetter, AdminError> {
    let id = checked_id(id)?;
    let dlq = DeadLetterStream::open(conn, prefix, group).await?;
    let now_ms = dlq.now_ms(conn).await?;
    match dlq.get(conn, id).await? {
        Some(raw) => Ok(raw.whole(now_ms)),
        None => Err(AdminError::DeadLettersNotFound {
            dead_letter_stream: dlq.key,
            ids: vec![id.to_owned()],
        }),
    }
}

/// `id` when it is an entry id `<ms>-<seq>`.
pub(crate) fn checked_id(id: &str) -> Result<&str, AdminError> {
    parse_entry_id(id)
        .map(|_| id)
        .ok_or_else(|| AdminError::InvalidEntryId { id: id.to_owned() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_ids_are_two_decimal_parts() {
        assert_eq!(parse_entry_id("1-0"), Some((1, 0)));
        assert_eq!(
            parse_entry_id("1700000000000-18446744073709551615"),
            Some((1_700_000_000_000, u64::MAX))
        );
        for bad in [
            "",
            "1",
            "-1",
            "1-",
            "a-1",
            "1-b",
            "1-2-3",
            "+1-2",
            "1 -2",
            "99999999999999999999-0",
        ] {
            assert_eq!(parse_entry_id(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn every_reason_parses_back_and_others_are_refused_by_name() {
        // Exhaustive: a new reason must be added to `known_reasons`.
        for reason in known_reasons() {
            match reason {
                DeadLetterReason::Handler
                | DeadLetterReason::NonRetryable
                | DeadLetterReason::Decode
                | DeadLetterReason::MaxDeliveries
                | DeadLetterReason::TooLarge => {}
            }
            assert_eq!(parse_dead_letter_reason(reason.as_str()).unwrap(), reason);
        }
        let err = parse_dead_letter_reason("timeout").unwrap_err().to_string();
        assert!(err.contains("\"timeout\""), "{err}");
        assert!(
            err.contains("handler, non-retryable, decode, max-deliveries, too-large"),
            "{err}"
        );
    }

    #[test]
    fn a_dead_letter_without_the_fixed_layout_has_no_payload() {
        let pairs = |names: &[&str]| {
            names
                .iter()
                .map(|n| ((*n).to_owned(), b"v".to_vec()))
                .collect::<Vec<_>>()
        };
        let mut names = FIXED_FIELDS.to_vec();
        names.extend(["key", "payload"]);
        let good = RawDeadLetter {
            id: "5-1".into(),
            pairs: pairs(&names),
            binary_names: false,
        };
        assert!(good.well_formed());
        assert_eq!(good.payload().len(), 2);
        assert_eq!(good.summary(7).age_ms, 2);
        names.swap(0, 1);
        let bad = RawDeadLetter {
            id: "5-1".into(),
            pairs: pairs(&names),
            binary_names: false,
        };
        assert!(!bad.well_formed());
        assert!(bad.payload().is_empty());
        assert_eq!(bad.summary(1).age_ms, 0);
    }
}
