//! Replaying dead letters: re-publishing the original entry through the producer's routing,
//! then removing the dead letter (docs/design.md §10.8).

use std::collections::HashMap;

use serde::Serialize;

use super::select::{Cursor, DeadLetterSelection};
use super::{DeadLetterStream, RawDeadLetter};
use crate::admin::AdminError;
use crate::connection::RedisConnection;
use crate::producer::{Publisher, PublisherOptions, shard_for_key};

/// One dead letter [`replay_dead_letters`] re-published (or, in a dry run, would).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Replayed {
    /// The dead letter's id.
    pub id: String,
    /// Its `sourceStream` and `sourceId`: where the original entry was.
    pub source_stream: String,
    /// The original entry's id.
    pub source_id: String,
    /// The partition key (field `key`) it was routed by.
    pub partition_key: String,
    /// The shard it was appended to (in a dry run: the shard the producer routes it to now).
    pub shard: u32,
    /// That shard's stream key.
    pub stream_key: String,
    /// The new entry's id; `None` in a dry run.
    pub new_id: Option<String>,
    /// Whether `XDEL` removed the dead letter (`false` in a dry run, or when something else,
    /// a concurrent replay or purge, removed it first).
    pub removed: bool,
}

/// Why a selected dead letter was not replayed. It is kept in the dead-letter stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum SkipReason {
    /// It carries no field of the original entry: dead-lettered by id (the entry was trimmed,
    /// or too large). There is nothing to re-publish; inspect it and purge it by hand.
    NoPayload,
    /// Its entry has no `key` field (it was not written by the producer), or more than one:
    /// there is no partition key to route by.
    NoPartitionKey,
    /// It does not start with the fixed dead-letter fields (not written by stream-listener).
    Malformed,
    /// A field name of its original entry is not UTF-8 (written by hand): the producer
    /// publishes UTF-8 names only, and a lossy name would silently change the entry.
    BinaryFieldName,
}

impl SkipReason {
    /// A short explanation for the tool's output.
    pub fn describe(self) -> &'static str {
        match self {
            SkipReason::NoPayload => {
                "no payload fields (dead-lettered by id: trimmed or too large); kept, purge it with `dlq purge --id`"
            }
            SkipReason::NoPartitionKey => {
                "no single `key` field to route by; kept, publish it by hand"
            }
            SkipReason::Malformed => {
                "not a dead letter of stream-listener (the fixed fields are missing); kept"
            }
            SkipReason::BinaryFieldName => {
                "a field name is not UTF-8 (the producer cannot publish it); kept, publish it by hand"
            }
        }
    }
}

/// A selected dead letter that was not replayed, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ReplaySkip {
    /// The dead letter's id.
    pub id: String,
    /// Its `reason` (why it was dead-lettered).
    pub dead_letter_reason: String,
    /// Why it was not replayed.
    pub skipped: SkipReason,
}

/// A selected dead letter that names the same source entry (`sourceStream` and `sourceId`) as
/// one replayed earlier in the same run, with the same fields: the entry was dead-lettered twice,
/// which at-least-once delivery allows (an owner that wrote the dead letter but died before its
/// ack leaves the entry to the next owner, which dead-letters it again). It is removed without
/// publishing, so the replay publishes each entry once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ReplayDuplicate {
    /// The dead letter's id.
    pub id: String,
    /// The dead letter replayed in its place.
    pub duplicate_of: String,
    /// Whether `XDEL` removed it (`false` in a dry run, or when something else removed it
    /// first).
    pub removed: bool,
}

/// What [`replay_dead_letters`] did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ReplayReport {
    /// The stream prefix.
    pub stream_prefix: String,
    /// The consumer group.
    pub consumer_group: String,
    /// The dead-letter stream key.
    pub dead_letter_stream: String,
    /// What was selected.
    pub selection: DeadLetterSelection,
    /// A dry run: nothing was published or removed.
    pub dry_run: bool,
    /// The dead letters re-published, in dead-letter order (given order for ids).
    pub replayed: Vec<Replayed>,
    /// The selected dead letters that cannot be replayed; all kept.
    pub skipped: Vec<ReplaySkip>,
    /// The selected dead letters whose source entry was replayed earlier in this run: removed,
    /// not published again.
    pub duplicates: Vec<ReplayDuplicate>,
    /// The other consumer groups registered on the stream. A replayed entry is a new entry of the
    /// shard stream, so they receive it too: for a group that had handled the original, a second
    /// copy.
    pub other_groups: Vec<String>,
}

/// A dead letter that can be re-published: its partition key and the other fields.
struct Replayable<'a> {
    key: String,
    fields: Vec<(&'a str, &'a [u8])>,
}

/// The partition key and fields to publish `raw` with, or why it cannot be.
fn replayable(raw: &RawDeadLetter) -> Result<Replayable<'_>, SkipReason> {
    if !raw.well_formed() {
        return Err(SkipReason::Malformed);
    }
    let payload = raw.payload();
    if payload.is_empty() {
        return Err(SkipReason::NoPayload);
    }
    if raw.binary_names {
        return Err(SkipReason::BinaryFieldName);
    }
    let mut keys = payload.iter().filter(|(name, _)| name == "key");
    let (Some((_, key)), None) = (keys.next(), keys.next()) else {
        return Err(SkipReason::NoPartitionKey);
    };
    let Ok(key) = std::str::from_utf8(key) else {
        return Err(SkipReason::NoPartitionKey);
    };
    Ok(Replayable {
        key: key.to_owned(),
        // The publisher writes `key` first, then these: the producer's own layout.
        fields: payload
            .iter()
            .filter(|(name, _)| name != "key")
            .map(|(name, value)| (name.as_str(), value.as_slice()))
            .collect(),
    })
}

/// Replays the dead letters of `group` on stream `prefix` that `selection` names: each one's
/// original fields are appended again with the producer's [`Publisher::publish_raw`] (so the
/// entry lands on the shard its `key` routes to now: jump hash over the current `shardCount`,
/// never a DRAINING shard during a scale-in), and once that `XADD` is acknowledged the dead
/// letter is removed (`XDEL`). One dead letter at a time, in order, so the guarantee is
/// at-least-once: a crash or error between the publish and the `XDEL` leaves the dead letter in
/// place and the next replay publishes it again (a duplicate, never a loss).
///
/// A dead letter without payload fields (dead-lettered by id: trimmed or too large), without a
/// single `key` field, or without the fixed fields is skipped and kept, and listed in
/// [`ReplayReport::skipped`]. A dead letter of the same source entry (`sourceStream`, `sourceId`)
/// and fields as one replayed earlier in the run is removed without publishing
/// ([`ReplayReport::duplicates`]): each entry is published once. Scans
/// ([`DeadLetterSelection::All`], `Reason`, `OlderThan`) stop at the last dead letter present at the start, so an entry that fails again and is dead-lettered
/// anew is not replayed twice in one run. `dry_run` reads and routes but publishes and removes
/// nothing. A selection that matches nothing is an empty report, not an error. The entry goes
/// to the shard stream, so every consumer group of the stream receives it, not only `group`
/// ([`ReplayReport::other_groups`] names the others).
///
/// # Errors
/// As [`super::purge_dead_letters`] for the selection (nothing done then);
/// [`AdminError::ReplayPublish`] when a publish fails (the dead letters before it are replayed,
/// this one and the rest are kept; run again once fixed); [`AdminError::ReplayNotRemoved`] when
/// the `XDEL` after a successful publish fails (that dead letter would be replayed again);
/// [`AdminError::DuplicateNotRemoved`] when the `XDEL` of a copy fails (a later replay would
/// publish its entry again).
pub async fn replay_dead_letters(
    conn: &mut RedisConnection,
    prefix: &str,
    group: &str,
    selection: DeadLetterSelection,
    dry_run: bool,
) -> Result<ReplayReport, AdminError> {
    let dlq = DeadLetterStream::open(conn, prefix, group).await?;
    let mut cursor = Cursor::start(conn, &dlq, selection.clone()).await?;
    let mut report = ReplayReport {
        stream_prefix: prefix.to_owned(),
        consumer_group: group.to_owned(),
        dead_letter_stream: dlq.key.clone(),
        selection,
        dry_run,
        replayed: Vec::new(),
        skipped: Vec::new(),
        duplicates: Vec::new(),
        other_groups: dlq.other_groups.clone(),
    };
    let mut publisher: Option<Publisher> = None;
    let mut replayed_sources = ReplayedSources::default();
    while let Some(page) = cursor.next(conn, &dlq).await? {
        for raw in &page {
            if let Some(first) = replayed_sources.copy_of(raw) {
                let first = first.to_owned();
                let duplicate = remove_duplicate(conn, &dlq, raw, &first, dry_run, &report).await?;
                report.duplicates.push(duplicate);
                continue;
            }
            let entry = match replayable(raw) {
                Ok(entry) => entry,
                Err(skipped) => {
                    tracing::warn!(stream = prefix, group, dead_letter = %raw.id, ?skipped, "dead letter cannot be replayed: kept");
                    report.skipped.push(ReplaySkip {
                        id: raw.id.clone(),
                        dead_letter_reason: raw.reason(),
                        skipped,
                    });
                    continue;
                }
            };
            let publisher = match &publisher {
                Some(publisher) => publisher,
                None => publisher.insert(
                    replay_publisher(conn, prefix)
                        .await
                        .map_err(|source| replay_failed(&dlq, raw, &report, source))?,
                ),
            };
            let replayed = if dry_run {
                route_only(&dlq, publisher, raw, entry)
                    .map_err(|source| replay_failed(&dlq, raw, &report, source))?
            } else {
                publish_then_remove(conn, &dlq, publisher, raw, entry, &report).await?
            };
            replayed_sources.insert(raw);
            report.replayed.push(replayed);
        }
    }
    Ok(report)
}

/// The dead letters replayed in one run, by source entry (`sourceStream`, `sourceId`), with the
/// fields they published.
#[derive(Default)]
struct ReplayedSources(HashMap<Source, (String, Fields)>);

/// `sourceStream` and `sourceId`.
type Source = (String, String);
/// A dead letter's original fields, in order.
type Fields = Vec<(String, Vec<u8>)>;

impl ReplayedSources {
    fn source(raw: &RawDeadLetter) -> Source {
        (raw.text("sourceStream"), raw.text("sourceId"))
    }

    /// Records `raw`, just replayed.
    fn insert(&mut self, raw: &RawDeadLetter) {
        let source = Self::source(raw);
        if !source.1.is_empty() {
            self.0
                .insert(source, (raw.id.clone(), raw.payload().to_vec()));
        }
    }

    /// The id of the dead letter replayed earlier for the same entry when `raw` is a copy of it:
    /// well formed, the same source, the same fields. A dead letter that differs (written by
    /// hand) is not a copy: it is replayed or skipped on its own.
    fn copy_of(&self, raw: &RawDeadLetter) -> Option<&str> {
        if !raw.well_formed() {
            return None;
        }
        let (first, payload) = self.0.get(&Self::source(raw))?;
        (payload.as_slice() == raw.payload()).then_some(first.as_str())
    }
}

/// Removes `raw`, a second dead letter of the entry `first` was replayed for (in a dry run,
/// only reports it).
async fn remove_duplicate(
    conn: &mut RedisConnection,
    dlq: &DeadLetterStream,
    raw: &RawDeadLetter,
    first: &str,
    dry_run: bool,
    report: &ReplayReport,
) -> Result<ReplayDuplicate, AdminError> {
    let removed = if dry_run {
        false
    } else {
        let removed = dlq
            .delete(conn, &[raw.id.as_str()])
            .await
            .map_err(|source| AdminError::DuplicateNotRemoved {
                dead_letter: raw.id.clone(),
                duplicate_of: first.to_owned(),
                dead_letter_stream: dlq.key.clone(),
                replayed: report.replayed.len(),
                source: Box::new(source),
            })?;
        tracing::info!(group = %dlq.group, dead_letter = %raw.id, duplicate_of = first, "dead letter of an entry already replayed removed");
        removed == 1
    };
    Ok(ReplayDuplicate {
        id: raw.id.clone(),
        duplicate_of: first.to_owned(),
        removed,
    })
}

/// A publisher that checks the routing before every publish (a replay follows the stream's
/// current shard count at once) and accepts any size (the entry was accepted once).
async fn replay_publisher(
    conn: &RedisConnection,
    prefix: &str,
) -> Result<Publisher, crate::producer::PublishError> {
    let options = PublisherOptions {
        max_payload_bytes: usize::MAX,
        refresh_interval: std::time::Duration::ZERO,
        ..PublisherOptions::default()
    };
    Publisher::new(conn.clone(), prefix, options).await
}

/// The dry run of one replay: where the producer routes it now.
fn route_only(
    dlq: &DeadLetterStream,
    publisher: &Publisher,
    raw: &RawDeadLetter,
    entry: Replayable<'_>,
) -> Result<Replayed, crate::producer::PublishError> {
    let shard_count = publisher.routing_snapshot().shard_count;
    if shard_count == 0 {
        return Err(crate::producer::PublishError::NoShards {
            prefix: publisher.prefix().to_owned(),
            metadata_version: publisher.routing_snapshot().metadata_version,
        });
    }
    let shard = shard_for_key(&entry.key, shard_count);
    Ok(replayed(raw, entry.key, shard, None, false, &dlq.keys))
}

/// Publishes one dead letter's entry, then (only once the `XADD` is acknowledged) removes it.
async fn publish_then_remove(
    conn: &mut RedisConnection,
    dlq: &DeadLetterStream,
    publisher: &Publisher,
    raw: &RawDeadLetter,
    entry: Replayable<'_>,
    report: &ReplayReport,
) -> Result<Replayed, AdminError> {
    let published = publisher
        .publish_raw(&entry.key, &entry.fields)
        .await
        .map_err(|source| replay_failed(dlq, raw, report, source))?;
    let removed = dlq
        .delete(conn, &[raw.id.as_str()])
        .await
        .map_err(|source| AdminError::ReplayNotRemoved {
            dead_letter: raw.id.clone(),
            dead_letter_stream: dlq.key.clone(),
            new_id: published.entry_id.clone(),
            stream_key: published.stream_key.clone(),
            replayed: report.replayed.len(),
            source: Box::new(source),
        })?;
    tracing::info!(
        stream = publisher.prefix(),
        group = %dlq.group,
        shard = published.shard,
        dead_letter = %raw.id,
        new_id = %published.entry_id,
        "dead letter replayed"
    );
    let mut done = replayed(
        raw,
        entry.key,
        published.shard,
        Some(published.entry_id),
        removed == 1,
        &dlq.keys,
    );
    done.stream_key = published.stream_key;
    Ok(done)
}

fn replayed(
    raw: &RawDeadLetter,
    partition_key: String,
    shard: u32,
    new_id: Option<String>,
    removed: bool,
    keys: &crate::keys::StreamKeys,
) -> Replayed {
    Replayed {
        id: raw.id.clone(),
        source_stream: raw.text("sourceStream"),
        source_id: raw.text("sourceId"),
        partition_key,
        shard,
        stream_key: keys.shard(shard),
        new_id,
        removed,
    }
}

fn replay_failed(
    dlq: &DeadLetterStream,
    raw: &RawDeadLetter,
    report: &ReplayReport,
    source: crate::producer::PublishError,
) -> AdminError {
    AdminError::ReplayPublish {
        dead_letter: raw.id.clone(),
        dead_letter_stream: dlq.key.clone(),
        replayed: report.replayed.len(),
        source: Box::new(source),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dead_letter(own: &[(&str, &[u8])]) -> RawDeadLetter {
        let mut pairs: Vec<(String, Vec<u8>)> = super::super::FIXED_FIELDS
            .iter()
            .map(|name| ((*name).to_owned(), b"x".to_vec()))
            .collect();
        pairs.extend(own.iter().map(|(n, v)| ((*n).to_owned(), v.to_vec())));
        RawDeadLetter {
            id: "1-0".into(),
            pairs,
            binary_names: false,
        }
    }

    #[test]
    fn the_key_routes_and_the_other_fields_are_published_in_order() {
        let raw = dead_letter(&[("a", b"1"), ("key", b"k"), ("payload", b"{}")]);
        let entry = replayable(&raw).unwrap();
        assert_eq!(entry.key, "k");
        assert_eq!(
            entry.fields,
            vec![("a", &b"1"[..]), ("payload", &b"{}"[..])]
        );
    }

    #[test]
    fn what_cannot_be_routed_is_skipped() {
        let skipped = |own: &[(&str, &[u8])]| replayable(&dead_letter(own)).err();
        assert_eq!(skipped(&[]), Some(SkipReason::NoPayload));
        assert_eq!(
            skipped(&[("payload", b"{}")]),
            Some(SkipReason::NoPartitionKey)
        );
        assert_eq!(
            skipped(&[("key", b"a"), ("key", b"b")]),
            Some(SkipReason::NoPartitionKey)
        );
        assert_eq!(
            skipped(&[("key", b"\xff")]),
            Some(SkipReason::NoPartitionKey)
        );
        let mut malformed = dead_letter(&[("key", b"k")]);
        malformed.pairs.swap(0, 1);
        assert_eq!(replayable(&malformed).err(), Some(SkipReason::Malformed));
    }
}
