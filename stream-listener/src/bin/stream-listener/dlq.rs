//! `stream-listener dlq ...`: a consumer group's dead letters (list, show, replay, purge), over
//! `admin::{list_dead_letters, show_dead_letter, replay_dead_letters, purge_dead_letters}`.

use std::time::Duration;

use clap::{Args, Subcommand};
use stream_listener::core::internals::admin::{
    self, DEFAULT_DEAD_LETTER_PAGE, DeadLetter, DeadLetterPage, DeadLetterSelection, PurgeReport,
    ReplayReport,
};
use stream_listener::core::internals::connection::RedisConnection;
use stream_listener::core::internals::dataplane::DeadLetterReason;

use crate::failure::{Failure, one_line};
use crate::table::Table;
use crate::{output, parse_duration};

/// The dead-letter stream `<prefix>:dlq:<group>` is per consumer group, so every command takes
/// the stream prefix and the group.
#[derive(Debug, Subcommand)]
pub(crate) enum DlqCommand {
    /// List a group's dead letters, oldest first: id, source shard and entry id, reason,
    /// attempts, age (Redis TIME minus the dead letter's id time), whether the original payload
    /// is kept (only those can be replayed) and the error (one line, truncated; in full with
    /// --json). Paged: --count per page, --after for the next page.
    List {
        /// Stream prefix.
        prefix: String,
        /// Consumer group.
        group: String,
        /// Dead letters per page, 1 to 10000.
        #[arg(long, default_value_t = DEFAULT_DEAD_LETTER_PAGE, value_name = "N")]
        count: usize,
        /// Start after this dead-letter id (the last id of the previous page, as printed).
        #[arg(long, value_name = "ID")]
        after: Option<String>,
    },
    /// Show one dead letter whole: the fixed fields, the full error, and every field of the
    /// original entry (key, payload...). The stream prefix and group name the dead-letter
    /// stream the id belongs to.
    Show {
        /// Stream prefix.
        prefix: String,
        /// Consumer group.
        group: String,
        /// The dead letter's id (as `dlq list` prints it).
        id: String,
    },
    /// Re-publish dead letters through the producer's routing (each lands on the shard its key
    /// routes to now), then remove each from the dead-letter stream, one at a time: at least
    /// once, a crash between the two leaves a duplicate, never a loss. Dead letters without
    /// payload fields (trimmed or too large) cannot be replayed: they are skipped, reported and
    /// kept. Exits 1, doing nothing, when a given --id is not a dead letter.
    Replay {
        /// Stream prefix.
        prefix: String,
        /// Consumer group.
        group: String,
        #[command(flatten)]
        select: ReplaySelect,
        /// Show what would be replayed and where it would land; publish and remove nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Delete dead letters. A selector is required: --id, --all, --reason or --older-than.
    /// Exits 1, deleting nothing, when a given --id is not a dead letter.
    Purge {
        /// Stream prefix.
        prefix: String,
        /// Consumer group.
        group: String,
        #[command(flatten)]
        select: PurgeSelect,
        /// Show what would be deleted; delete nothing.
        #[arg(long)]
        dry_run: bool,
    },
}

/// Which dead letters `dlq replay` re-publishes (exactly one).
#[derive(Debug, Clone, Args)]
#[group(required = true, multiple = false)]
pub(crate) struct ReplaySelect {
    /// These dead-letter ids (repeat --id, or give several after it).
    #[arg(long = "id", value_name = "ID", num_args = 1..)]
    ids: Vec<String>,
    /// Every dead letter present when the replay starts.
    #[arg(long)]
    all: bool,
    /// Every dead letter with this reason: handler, non-retryable, decode, max-deliveries or
    /// too-large.
    #[arg(long, value_parser = parse_reason, value_name = "REASON")]
    reason: Option<DeadLetterReason>,
}

/// Which dead letters `dlq purge` deletes (exactly one).
#[derive(Debug, Clone, Args)]
#[group(required = true, multiple = false)]
pub(crate) struct PurgeSelect {
    /// These dead-letter ids (repeat --id, or give several after it).
    #[arg(long = "id", value_name = "ID", num_args = 1..)]
    ids: Vec<String>,
    /// Every dead letter present when the purge starts.
    #[arg(long)]
    all: bool,
    /// Every dead letter with this reason: handler, non-retryable, decode, max-deliveries or
    /// too-large.
    #[arg(long, value_parser = parse_reason, value_name = "REASON")]
    reason: Option<DeadLetterReason>,
    /// Every dead letter older than this (e.g. 7d, 12h), by its id time against Redis TIME.
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    older_than: Option<Duration>,
}

fn parse_reason(text: &str) -> Result<DeadLetterReason, String> {
    admin::parse_dead_letter_reason(text).map_err(|e| e.to_string())
}

fn selection(
    ids: Vec<String>,
    all: bool,
    reason: Option<DeadLetterReason>,
    older_than: Option<Duration>,
) -> Result<DeadLetterSelection, Failure> {
    match (ids.is_empty(), all, reason, older_than) {
        (false, false, None, None) => Ok(DeadLetterSelection::Ids(ids)),
        (true, true, None, None) => Ok(DeadLetterSelection::All),
        (true, false, Some(reason), None) => Ok(DeadLetterSelection::Reason(reason)),
        (true, false, None, Some(age)) => Ok(DeadLetterSelection::OlderThan(age)),
        _ => Err(Failure::Usage(
            "give exactly one of --id, --all, --reason, --older-than".into(),
        )),
    }
}

/// Runs one `dlq` command; the text or JSON to print.
pub(crate) async fn run(
    conn: &mut RedisConnection,
    as_json: bool,
    command: DlqCommand,
) -> Result<String, Failure> {
    match command {
        DlqCommand::List {
            prefix,
            group,
            count,
            after,
        } => {
            let page =
                admin::list_dead_letters(conn, &prefix, &group, after.as_deref(), count).await?;
            output(as_json, &page, |page| list_text(page, count))
        }
        DlqCommand::Show { prefix, group, id } => {
            let letter = admin::show_dead_letter(conn, &prefix, &group, &id).await?;
            output(as_json, &letter, show_text)
        }
        DlqCommand::Replay {
            prefix,
            group,
            select,
            dry_run,
        } => {
            let selection = selection(select.ids, select.all, select.reason, None)?;
            let report =
                admin::replay_dead_letters(conn, &prefix, &group, selection, dry_run).await?;
            output(as_json, &report, replay_text)
        }
        DlqCommand::Purge {
            prefix,
            group,
            select,
            dry_run,
        } => {
            let selection = selection(select.ids, select.all, select.reason, select.older_than)?;
            let report =
                admin::purge_dead_letters(conn, &prefix, &group, selection, dry_run).await?;
            output(as_json, &report, purge_text)
        }
    }
}

/// Ids a purge prints without `--json`.
const PURGE_IDS_SHOWN: usize = 10;

/// The error column is cut here (the full text is in `dlq show` and `--json`).
const ERROR_WIDTH: usize = 60;

/// `text` on one line, cut to `width` characters with an ellipsis.
fn truncated(text: &str, width: usize) -> String {
    let line = one_line(text);
    if line.chars().count() <= width {
        return line;
    }
    let mut cut: String = line.chars().take(width - 1).collect();
    cut.push('…');
    cut
}

/// An age in ms, as its largest whole unit: 850ms, 12s, 5m, 3h, 2d.
pub(crate) fn age(ms: u64) -> String {
    const UNITS: [(u64, &str); 4] = [
        (86_400_000, "d"),
        (3_600_000, "h"),
        (60_000, "m"),
        (1000, "s"),
    ];
    UNITS.iter().find(|(size, _)| ms >= *size).map_or_else(
        || format!("{ms}ms"),
        |(size, unit)| format!("{}{unit}", ms / size),
    )
}

/// `n dead letter(s)`.
fn dead_letters(n: impl Into<u64>) -> String {
    match n.into() {
        1 => "1 dead letter".to_owned(),
        n => format!("{n} dead letters"),
    }
}

fn or_dash<T: ToString>(value: Option<T>) -> String {
    value.map_or_else(|| "-".to_owned(), |v| v.to_string())
}

/// The page as a table; the next-page hint repeats `count` when it is not the default.
fn list_text(page: &DeadLetterPage, count: usize) -> String {
    let mut out = format!(
        "dead letters of group {} on stream {} ({}): {} in total\n",
        page.consumer_group, page.stream_prefix, page.dead_letter_stream, page.total
    );
    if page.dead_letters.is_empty() {
        out.push_str("none on this page\n");
        return out;
    }
    out.push('\n');
    let mut table = Table::new(&[
        "ID",
        "SHARD",
        "SOURCE ID",
        "REASON",
        "ATTEMPTS",
        "AGE",
        "ENTRY",
        "ERROR",
    ]);
    for d in &page.dead_letters {
        table.row(vec![
            d.id.clone(),
            or_dash(d.shard),
            d.source_id.clone(),
            d.reason.clone(),
            or_dash(d.attempts),
            age(d.age_ms),
            // Whether the dead letter carries the original entry's fields (`payloadFields` in
            // JSON), or only its id (trimmed, too large). Not whether it had a `payload` field:
            // a header of that name read as such (new-user pass).
            if d.payload_fields > 0 {
                "kept"
            } else {
                "id-only"
            }
            .into(),
            truncated(&d.error, ERROR_WIDTH),
        ]);
    }
    out.push_str(&table.render());
    if let Some(after) = &page.next_after {
        let count = if count == DEFAULT_DEAD_LETTER_PAGE {
            String::new()
        } else {
            format!(" --count {count}")
        };
        out.push_str(&format!(
            "\nmore: stream-listener dlq list {} {}{count} --after {after}\n",
            page.stream_prefix, page.consumer_group
        ));
    }
    out
}

fn show_text(d: &DeadLetter) -> String {
    let s = &d.summary;
    let mut out = String::new();
    let mut line =
        |name: &str, value: String| out.push_str(&format!("{:<14}{value}\n", format!("{name}:")));
    line("id", s.id.clone());
    line(
        "source",
        format!(
            "{} entry {} (shard {})",
            s.source_stream,
            s.source_id,
            or_dash(s.shard)
        ),
    );
    line("reason", s.reason.clone());
    line("attempts", or_dash(s.attempts));
    line("age", format!("{} ({} ms)", age(s.age_ms), s.age_ms));
    if !s.well_formed {
        line(
            "warning",
            "not a dead letter of stream-listener: the fixed fields are missing".into(),
        );
    }
    out.push_str("error:\n");
    for error_line in s.error.lines() {
        out.push_str(&format!("  {error_line}\n"));
    }
    if d.fields.is_empty() {
        out.push_str("fields:       none (dead-lettered by id: the entry was trimmed or too large; it cannot be replayed)\n");
    } else {
        out.push_str("fields:\n");
        for field in &d.fields {
            out.push_str(&format!("  {} = {}\n", field.name, field.value));
        }
    }
    out
}

fn replay_text(r: &ReplayReport) -> String {
    let mut out = String::new();
    let verb = if r.dry_run {
        "dry run: would replay"
    } else {
        "replayed"
    };
    if r.replayed.is_empty() && r.skipped.is_empty() {
        return format!(
            "no dead letter of {} matches: nothing replayed\n",
            r.dead_letter_stream
        );
    }
    out.push_str(&format!(
        "{verb} {} of {}",
        dead_letters(r.replayed.len() as u64),
        r.dead_letter_stream
    ));
    if r.replayed.is_empty() {
        out.push('\n');
    } else {
        out.push_str(if r.dry_run {
            " (nothing published or removed):\n"
        } else {
            ":\n"
        });
        let mut table = if r.dry_run {
            Table::new(&["DEAD LETTER", "KEY", "SHARD"])
        } else {
            Table::new(&["DEAD LETTER", "KEY", "SHARD", "NEW ID", "REMOVED"])
        };
        for d in &r.replayed {
            let mut row = vec![d.id.clone(), d.partition_key.clone(), d.shard.to_string()];
            if !r.dry_run {
                row.push(or_dash(d.new_id.as_ref()));
                row.push(if d.removed { "yes" } else { "no" }.into());
            }
            table.row(row);
        }
        out.push_str(&table.render());
    }
    if !r.replayed.is_empty() && !r.other_groups.is_empty() {
        out.push_str(&format!(
            "note: consumer groups {} of {} receive the replayed entries too (a second copy of what they handled)\n",
            r.other_groups.join(", "),
            r.stream_prefix
        ));
    }
    if !r.duplicates.is_empty() {
        out.push_str(&format!(
            "{} {} naming an entry replayed above (dead-lettered twice, which at-least-once delivery allows):\n",
            if r.dry_run { "would remove" } else { "removed" },
            dead_letters(r.duplicates.len() as u64)
        ));
        for d in &r.duplicates {
            let gone = if d.removed || r.dry_run {
                ""
            } else {
                "; already removed by something else"
            };
            out.push_str(&format!(
                "  {} (same entry as {}{gone})\n",
                d.id, d.duplicate_of
            ));
        }
    }
    if !r.skipped.is_empty() {
        out.push_str(&format!("skipped {} (kept):\n", r.skipped.len()));
        for s in &r.skipped {
            out.push_str(&format!(
                "  {} ({}): {}\n",
                s.id,
                s.dead_letter_reason,
                s.skipped.describe()
            ));
        }
    }
    out
}

fn purge_text(r: &PurgeReport) -> String {
    if r.purged == 0 {
        return format!(
            "no dead letter of {} matches: nothing purged\n",
            r.dead_letter_stream
        );
    }
    let verb = if r.dry_run {
        "dry run: would purge"
    } else {
        "purged"
    };
    // A long purge would print a wall of ids: the first few, then how many more (all of them,
    // up to the JSON's limit, with --json).
    let shown = r.ids.len().min(PURGE_IDS_SHOWN);
    let mut ids = r.ids[..shown].join(", ");
    let more = r.purged.saturating_sub(shown as u64);
    if more > 0 {
        ids.push_str(&format!(" and {more} more"));
    }
    format!(
        "{verb} {} from {}: {ids}\n",
        dead_letters(r.purged),
        r.dead_letter_stream
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_use_their_largest_unit() {
        assert_eq!(age(0), "0ms");
        assert_eq!(age(999), "999ms");
        assert_eq!(age(12_500), "12s");
        assert_eq!(age(5 * 60_000 + 1), "5m");
        assert_eq!(age(3 * 3_600_000), "3h");
        assert_eq!(age(9 * 86_400_000), "9d");
    }

    #[test]
    fn a_long_purge_prints_the_first_ids_and_how_many_more() {
        let report = |purged: u64| PurgeReport {
            stream_prefix: "orders".into(),
            consumer_group: "billing".into(),
            dead_letter_stream: "orders:dlq:billing".into(),
            selection: DeadLetterSelection::All,
            dry_run: false,
            purged,
            ids: (0..purged.min(1000)).map(|i| format!("{i}-0")).collect(),
            ids_truncated: purged > 1000,
        };
        assert_eq!(
            purge_text(&report(1)),
            "purged 1 dead letter from orders:dlq:billing: 0-0\n"
        );
        assert_eq!(
            purge_text(&report(1500)),
            "purged 1500 dead letters from orders:dlq:billing: 0-0, 1-0, 2-0, 3-0, 4-0, 5-0, 6-0, 7-0, 8-0, 9-0 and 1490 more\n"
        );
    }

    #[test]
    fn errors_are_cut_to_one_line() {
        assert_eq!(truncated("a\n  b", 10), "a b");
        let long = "x".repeat(70);
        let cut = truncated(&long, ERROR_WIDTH);
        assert_eq!(cut.chars().count(), ERROR_WIDTH);
        assert!(cut.ends_with('…'));
    }
}
