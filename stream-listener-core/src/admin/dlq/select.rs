//! Which dead letters a replay or purge acts on, read page by page.

use std::time::Duration;

use redis::AsyncCommands;
use serde::Serialize;

use super::{DeadLetterStream, RawDeadLetter, checked_id};
use crate::admin::AdminError;
use crate::dataplane::DeadLetterReason;
use crate::store::StoreError;

/// Dead letters read per `XRANGE` while scanning for a selection.
const SCAN_PAGE: usize = 100;

/// The dead letters a [`replay_dead_letters`](super::replay_dead_letters) or
/// [`purge_dead_letters`](super::purge_dead_letters) acts on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum DeadLetterSelection {
    /// These dead-letter ids (`<ms>-<seq>`), each once, in the order given. Every one must be
    /// present, or nothing is done.
    Ids(Vec<String>),
    /// Every dead letter present when the operation starts.
    All,
    /// Every dead letter present when the operation starts whose `reason` is this one.
    Reason(#[serde(serialize_with = "reason_text")] DeadLetterReason),
    /// Every dead letter whose id time is more than this long before Redis `TIME` (at least
    /// 1 ms). In JSON `{"olderThanMs": <ms>}`.
    #[serde(rename = "olderThanMs", serialize_with = "millis")]
    OlderThan(Duration),
}

fn millis<S: serde::Serializer>(age: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_u64(u64::try_from(age.as_millis()).unwrap_or(u64::MAX))
}

fn reason_text<S: serde::Serializer>(
    reason: &DeadLetterReason,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(reason.as_str())
}

/// Walks the dead letters a [`DeadLetterSelection`] names, one page at a time.
///
/// A scan stops at the last dead letter that existed when it started: a replayed entry that
/// fails again is dead-lettered anew behind that point, and `--all` must not replay it again in
/// the same run (it would loop for as long as the handler fails).
pub(crate) struct Cursor {
    selection: DeadLetterSelection,
    /// Ids given: read and checked up front, handed out as one page.
    given: Option<Vec<RawDeadLetter>>,
    /// The last id handed out (exclusive start of the next page).
    after: Option<String>,
    /// The last dead letter at the start (inclusive end); `None`: the stream was empty.
    end: Option<String>,
    /// Only dead letters with an id time below this, ms ([`DeadLetterSelection::OlderThan`]).
    before_ms: Option<u64>,
    done: bool,
}

impl Cursor {
    /// Checks `selection` and fixes the end of the scan.
    ///
    /// # Errors
    /// [`AdminError::InvalidSelection`] for no ids or a zero age; [`AdminError::InvalidEntryId`];
    /// [`AdminError::DeadLettersNotFound`] naming every given id that is not present (nothing
    /// is done then); Redis failure.
    pub(crate) async fn start(
        conn: &mut crate::connection::RedisConnection,
        dlq: &DeadLetterStream,
        selection: DeadLetterSelection,
    ) -> Result<Cursor, AdminError> {
        let mut cursor = Cursor {
            selection: selection.clone(),
            given: None,
            after: None,
            end: None,
            before_ms: None,
            done: false,
        };
        match &selection {
            DeadLetterSelection::Ids(ids) => {
                cursor.given = Some(read_given(conn, dlq, ids).await?);
                return Ok(cursor);
            }
            DeadLetterSelection::OlderThan(age) => {
                if age.is_zero() {
                    return Err(AdminError::InvalidSelection {
                        detail: "an age of 0 selects every dead letter; give a positive --older-than (e.g. 7d), or --all".into(),
                    });
                }
                let age_ms = u64::try_from(age.as_millis()).unwrap_or(u64::MAX);
                cursor.before_ms = Some(dlq.now_ms(conn).await?.saturating_sub(age_ms));
            }
            DeadLetterSelection::All | DeadLetterSelection::Reason(_) => {}
        }
        let last: Vec<(String, redis::Value)> = conn
            .xrevrange_count(&dlq.key, "+", "-", 1)
            .await
            .map_err(StoreError::from)?;
        cursor.end = last.into_iter().next().map(|(id, _)| id);
        cursor.done = cursor.end.is_none();
        Ok(cursor)
    }

    /// The next page of selected dead letters, oldest first; `None` when there are no more. A
    /// page may be empty while more follow (none of a scanned page matched).
    pub(crate) async fn next(
        &mut self,
        conn: &mut crate::connection::RedisConnection,
        dlq: &DeadLetterStream,
    ) -> Result<Option<Vec<RawDeadLetter>>, AdminError> {
        if let Some(given) = self.given.take() {
            self.done = true;
            return Ok(Some(given));
        }
        let Some(end) = self.end.clone().filter(|_| !self.done) else {
            return Ok(None);
        };
        let start = self
            .after
            .as_ref()
            .map_or_else(|| "-".to_owned(), |id| format!("({id}"));
        let page = dlq.range(conn, &start, &end, SCAN_PAGE).await?;
        match page.last() {
            Some(last) if page.len() == SCAN_PAGE && last.id != end => {
                self.after = Some(last.id.clone());
            }
            _ => self.done = true,
        }
        let mut selected = Vec::with_capacity(page.len());
        for raw in page {
            if self.before_ms.is_some_and(|before| raw.id_ms() >= before) {
                // Ids only grow: nothing later is old enough either.
                self.done = true;
                break;
            }
            if self.matches(&raw) {
                selected.push(raw);
            }
        }
        Ok(Some(selected))
    }

    fn matches(&self, raw: &RawDeadLetter) -> bool {
        match &self.selection {
            DeadLetterSelection::Reason(reason) => raw.reason() == reason.as_str(),
            DeadLetterSelection::Ids(_)
            | DeadLetterSelection::All
            | DeadLetterSelection::OlderThan(_) => true,
        }
    }
}

/// Reads the given ids (each once, in order); every one must be present.
async fn read_given(
    conn: &mut crate::connection::RedisConnection,
    dlq: &DeadLetterStream,
    ids: &[String],
) -> Result<Vec<RawDeadLetter>, AdminError> {
    if ids.is_empty() {
        return Err(AdminError::InvalidSelection {
            detail: "no dead-letter id given; give --id ID (see `stream-listener dlq list`)".into(),
        });
    }
    let mut unique: Vec<&str> = Vec::with_capacity(ids.len());
    for id in ids {
        let id = checked_id(id)?;
        if !unique.contains(&id) {
            unique.push(id);
        }
    }
    let mut found = Vec::with_capacity(unique.len());
    let mut missing = Vec::new();
    for id in unique {
        match dlq.get(conn, id).await? {
            Some(raw) => found.push(raw),
            None => missing.push(id.to_owned()),
        }
    }
    if !missing.is_empty() {
        return Err(AdminError::DeadLettersNotFound {
            dead_letter_stream: dlq.key.clone(),
            ids: missing,
        });
    }
    Ok(found)
}
