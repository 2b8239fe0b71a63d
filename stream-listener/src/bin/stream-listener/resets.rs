//! What `group reset` and `stream delete` print without `--json`, and how `group reset --to`
//! is read.

use stream_listener::core::internals::admin::{DeletedStream, GroupReset, ResetTarget};

use crate::table::{Table, shards};

/// `--to`: `earliest`, `latest` or an RFC 3339 time in UTC (`2026-12-01T12:00:00Z`, fractions of
/// a second allowed; a time maps to its millisecond).
pub(crate) fn parse_reset_to(text: &str) -> Result<ResetTarget, String> {
    match text {
        "earliest" => return Ok(ResetTarget::Earliest),
        "latest" => return Ok(ResetTarget::Latest),
        _ => {}
    }
    let time = humantime::parse_rfc3339(text).map_err(|e| {
        format!(
            "{e}: give earliest, latest or an RFC 3339 time in UTC such as 2026-12-01T12:00:00Z"
        )
    })?;
    let ms = time
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|_| "the time is before 1970".to_owned())?
        .as_millis();
    Ok(ResetTarget::Time {
        ms: u64::try_from(ms).map_err(|_| "the time is too far in the future".to_owned())?,
    })
}

pub(crate) fn reset_text(r: &GroupReset) -> String {
    let mut table = Table::new(&[
        "SHARD",
        "OLD POSITION",
        "NEW POSITION",
        "TO DELIVER",
        "SKIPPED",
        "PENDING CLEARED",
    ]);
    for s in &r.shards {
        table.row(vec![
            s.shard_index.to_string(),
            s.old_position.clone(),
            s.new_position.clone(),
            s.to_deliver.to_string(),
            s.skipped.to_string(),
            s.pending_cleared.to_string(),
        ]);
    }
    let head = if r.dry_run {
        format!(
            "dry run: group {} of stream {} would be reset to {}; nothing changed\n",
            r.consumer_group, r.stream_prefix, r.target
        )
    } else {
        format!(
            "reset group {} of stream {} to {}\n",
            r.consumer_group, r.stream_prefix, r.target
        )
    };
    head + &table.render()
}

pub(crate) fn stream_deleted_text(d: &DeletedStream) -> String {
    let orphans = if d.orphan_dead_letters.is_empty() {
        String::new()
    } else {
        format!(
            ", dead letters of unregistered groups {}",
            d.orphan_dead_letters.join(", ")
        )
    };
    format!(
        "deleted stream {}{}: {} keys, shard streams {}, groups {}{orphans}\n",
        d.stream_prefix,
        if d.forced { " (forced)" } else { "" },
        d.keys_deleted,
        shards(&d.shards_deleted),
        if d.groups.is_empty() {
            "-".to_owned()
        } else {
            d.groups.join(", ")
        }
    )
}
