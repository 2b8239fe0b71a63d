//! Purging dead letters: `XDEL` of a selection.

use serde::Serialize;

use super::DeadLetterStream;
use super::select::{Cursor, DeadLetterSelection};
use crate::admin::AdminError;
use crate::connection::RedisConnection;
use crate::store::StoreError;

/// At most this many purged ids are listed in a [`PurgeReport`] (the count is always exact).
pub const PURGE_ID_LIMIT: usize = 1000;

/// What [`purge_dead_letters`] did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PurgeReport {
    /// The stream prefix.
    pub stream_prefix: String,
    /// The consumer group.
    pub consumer_group: String,
    /// The dead-letter stream key.
    pub dead_letter_stream: String,
    /// What was selected.
    pub selection: DeadLetterSelection,
    /// A dry run: nothing was deleted ([`Self::purged`] counts what would be).
    pub dry_run: bool,
    /// Dead letters deleted (in a dry run: selected).
    pub purged: u64,
    /// Their ids, oldest first, at most [`PURGE_ID_LIMIT`].
    pub ids: Vec<String>,
    /// More were purged than [`Self::ids`] lists.
    pub ids_truncated: bool,
}

/// Deletes the dead letters of `group` on stream `prefix` that `selection` names (`XDEL`, a page
/// of at most 100 ids per call). Scans stop at the last dead letter present at the start, so a
/// dead letter written meanwhile is never deleted unseen. `dry_run` counts and lists them and
/// deletes nothing. A selection that matches nothing is an empty report, not an error. The
/// tool refuses to purge without a selection; there is no "purge everything by default".
///
/// # Errors
/// [`AdminError::InvalidName`]; [`AdminError::InvalidSelection`] (no ids, an age of 0);
/// [`AdminError::InvalidEntryId`]; [`AdminError::DeadLettersNotFound`] naming every given id
/// that is not there (nothing deleted then); [`AdminError::Store`]:
/// [`StoreError::MissingStream`], [`StoreError::UnknownGroup`] (not registered and no
/// dead-letter stream), Redis failure (the pages before it are deleted; run it again).
pub async fn purge_dead_letters(
    conn: &mut RedisConnection,
    prefix: &str,
    group: &str,
    selection: DeadLetterSelection,
    dry_run: bool,
) -> Result<PurgeReport, AdminError> {
    let dlq = DeadLetterStream::open(conn, prefix, group).await?;
    let mut cursor = Cursor::start(conn, &dlq, selection.clone()).await?;
    let mut report = PurgeReport {
        stream_prefix: prefix.to_owned(),
        consumer_group: group.to_owned(),
        dead_letter_stream: dlq.key.clone(),
        selection,
        dry_run,
        purged: 0,
        ids: Vec::new(),
        ids_truncated: false,
    };
    while let Some(page) = cursor.next(conn, &dlq).await? {
        let ids: Vec<&str> = page.iter().map(|raw| raw.id.as_str()).collect();
        let purged = if dry_run {
            ids.len() as u64
        } else {
            dlq.delete(conn, &ids).await.map_err(StoreError::from)?
        };
        report.purged += purged;
        for id in ids {
            if report.ids.len() < PURGE_ID_LIMIT {
                report.ids.push(id.to_owned());
            } else {
                report.ids_truncated = true;
            }
        }
    }
    if !dry_run && report.purged > 0 {
        tracing::info!(
            stream = prefix,
            group,
            purged = report.purged,
            "dead letters purged"
        );
    }
    Ok(report)
}
