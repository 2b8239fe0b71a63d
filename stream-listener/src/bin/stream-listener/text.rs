//! The tables and sentences the tool prints for each command without `--json`.

use serde::Serialize;
use stream_listener::core::internals::admin::{ConsumerCleanup, KeptBecause};
use stream_listener::core::internals::admin::{
    CreatedStream, DeletedGroup, GroupDescription, GroupSummary, Lag, RetireReport, ScaleAction,
    ScaleOutcome, StreamDescription, StreamSummary,
};
use stream_listener::core::model::StartFrom;

use crate::failure::one_line;
use crate::table::{Table, shards};

/// The outcome of `stream create`; `retention_given`: the command also set the retention (its
/// own line follows), so an existing stream's text does not claim that nothing changed.
pub(crate) fn created_text(
    prefix: &str,
    shards: u32,
    created: &CreatedStream,
    retention_given: bool,
) -> String {
    let meta = &created.metadata;
    if created.created {
        format!(
            "created stream {prefix} with {shards} shards ({{{prefix}:0}}..{{{prefix}:{}}}), metadataVersion {}\n",
            shards - 1,
            meta.metadata_version
        )
    } else if retention_given {
        format!(
            "stream {prefix} already exists with {} shards: shards unchanged\n",
            meta.shard_count
        )
    } else {
        format!(
            "stream {prefix} already exists with {} shards: nothing changed\n",
            meta.shard_count
        )
    }
}

fn start_from(start: StartFrom) -> &'static str {
    match start {
        StartFrom::Earliest => "earliest",
        StartFrom::Latest => "latest",
    }
}

fn upper<T: Serialize>(value: &T) -> String {
    serde_json::to_value(value)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_else(|| "?".into())
}

/// `shard 4` or `shards 2-3,5`.
fn named_shards(indexes: &[u32]) -> String {
    let noun = if indexes.len() == 1 {
        "shard"
    } else {
        "shards"
    };
    format!("{noun} {}", shards(indexes))
}

pub(crate) fn scale_text(outcome: &ScaleOutcome) -> String {
    let prefix = &outcome.stream_prefix;
    let version = outcome.metadata_version;
    match outcome.action {
        ScaleAction::ScaleOut => format!(
            "scaled out {prefix} from {} to {} shards: {} provisioned and ACTIVE (metadataVersion {version})\n",
            outcome.from_shard_count,
            outcome.to_shard_count,
            named_shards(&outcome.provisioned)
        ),
        ScaleAction::ScaleIn => format!(
            "scale-in of {prefix} from {} to {} shards started: {} {} DRAINING (metadataVersion {version}); producers no longer route to them and members keep consuming them; run `stream-listener stream retire {prefix}` to retire them once consumed\n",
            outcome.from_shard_count,
            outcome.to_shard_count,
            named_shards(&outcome.draining),
            if outcome.draining.len() == 1 {
                "is"
            } else {
                "are"
            }
        ),
        ScaleAction::Unchanged => match &outcome.migration {
            Some(m) => format!(
                "{prefix} is already draining from {} to {} shards: nothing changed; run `stream-listener stream retire {prefix}` to finish\n",
                m.from_shard_count, m.to_shard_count
            ),
            None => format!(
                "{prefix} already has {} shards: nothing changed\n",
                outcome.to_shard_count
            ),
        },
        ScaleAction::Cancelled => format!(
            "cancelled the scale-in of {prefix}: shards {} are ACTIVE again, shard count {} (metadataVersion {version})\n",
            shards(&outcome.reactivated),
            outcome.to_shard_count
        ),
    }
}

pub(crate) fn retire_text(report: &RetireReport) -> String {
    let prefix = &report.stream_prefix;
    if report.shards.is_empty() {
        return format!("nothing to retire: stream {prefix} has no DRAINING shard\n");
    }
    let mut table = Table::new(&["SHARD", "STATE", "RESULT"]);
    for shard in &report.shards {
        let result = match &shard.waiting {
            None => "retired".to_owned(),
            Some(reason) => format!("waiting: {reason}"),
        };
        table.row(vec![
            shard.shard_index.to_string(),
            upper(&shard.state),
            result,
        ]);
    }
    let mut out = table.render();
    if report.migration_complete {
        out.push_str(&format!(
            "migration complete: readable shards {} (metadataVersion {})\n",
            shards(&report.readable_shard_set),
            report.metadata_version
        ));
    } else {
        out.push_str(&format!(
            "migration not complete: run `stream-listener stream retire {prefix}` again later (metadataVersion {})\n",
            report.metadata_version
        ));
    }
    out
}

fn lines(pairs: &[(&str, String)]) -> String {
    let width = pairs.iter().map(|(k, _)| k.len()).max().unwrap_or(0) + 1;
    pairs
        .iter()
        .map(|(k, v)| format!("{:<width$} {v}\n", format!("{k}:")))
        .collect()
}

pub(crate) fn stream_text(d: &StreamDescription) -> String {
    let groups = if d.groups.is_empty() {
        "none".to_owned()
    } else {
        d.groups
            .iter()
            .map(|g| format!("{} ({})", g.consumer_group, start_from(g.start_from)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let migration = match &d.migration {
        None => "none".to_owned(),
        Some(m) => format!(
            "{} -> {} shards, draining since {}",
            m.from_shard_count, m.to_shard_count, m.started_at
        ),
    };
    let mut out = lines(&[
        ("stream", d.stream_prefix.clone()),
        ("shard count", d.shard_count.to_string()),
        ("readable shards", shards(&d.readable_shard_set)),
        (
            "metadata",
            format!("version {}, revision {}", d.metadata_version, d.revision),
        ),
        ("updated", d.updated_at.clone()),
        ("migration", migration),
        ("groups", groups),
    ]);
    if let Some(retention) = &d.retention {
        out.push_str(&format!(
            "{:<16} {}\n",
            "retention:",
            crate::retention::retention_summary(retention)
        ));
    }
    out.push('\n');
    let mut table = Table::new(&[
        "SHARD",
        "STATE",
        "LENGTH",
        "GROUP",
        "PENDING",
        "LAG",
        "LAST DELIVERED",
    ]);
    for shard in &d.shards {
        let length = shard
            .length
            .map_or_else(|| "-".to_owned(), |l| l.to_string());
        if shard.groups.is_empty() {
            table.row(vec![
                shard.shard_index.to_string(),
                upper(&shard.state),
                length.clone(),
                "-".into(),
                "-".into(),
                "-".into(),
                "-".into(),
            ]);
        }
        for group in &shard.groups {
            table.row(vec![
                shard.shard_index.to_string(),
                upper(&shard.state),
                length.clone(),
                group.name.clone(),
                group.pending.to_string(),
                group.lag.to_string(),
                group.last_delivered_id.clone(),
            ]);
        }
    }
    out.push_str(&table.render());
    out
}

pub(crate) fn streams_text(listed: &[StreamSummary]) -> String {
    if listed.is_empty() {
        return "no streams (the index sl:streams is empty)\n".into();
    }
    let mut table = Table::new(&["STREAM", "SHARDS", "VERSION", "GROUPS", "MIGRATION"]);
    for s in listed {
        let (shard_count, version, groups, migration) = match &s.problem {
            Some(problem) => (
                "?".to_owned(),
                "?".to_owned(),
                "?".to_owned(),
                format!("unreadable: {}", one_line(problem)),
            ),
            None => (
                s.shard_count.map_or("?".into(), |c| c.to_string()),
                s.metadata_version.map_or("?".into(), |v| v.to_string()),
                if s.groups.is_empty() {
                    "-".into()
                } else {
                    s.groups.join(",")
                },
                s.migration.as_ref().map_or("-".into(), |m| {
                    format!("{} -> {}", m.from_shard_count, m.to_shard_count)
                }),
            ),
        };
        table.row(vec![
            s.stream_prefix.clone(),
            shard_count,
            version,
            groups,
            migration,
        ]);
    }
    table.render()
}

fn lease(ms: i64) -> String {
    if ms > 0 {
        format!("{ms} ms")
    } else {
        format!("expired {} ms ago", -ms)
    }
}

pub(crate) fn group_text(d: &GroupDescription) -> String {
    let mut out = lines(&[
        (
            "group",
            format!(
                "{} on stream {} (start from {})",
                d.consumer_group,
                d.stream_prefix,
                start_from(d.start_from)
            ),
        ),
        ("state", upper(&d.state)),
        (
            "epochs",
            format!(
                "group {}, assignment {}, incarnation {}",
                d.group_epoch, d.assignment_epoch, d.incarnation
            ),
        ),
        (
            "metadata",
            format!(
                "version {} applied (stream at {}), shard count {}, readable shards {}",
                d.metadata_version,
                d.stream_metadata_version,
                d.shard_count,
                shards(&d.readable_shard_set)
            ),
        ),
        (
            "dead letters",
            match d.oldest_dead_letter_age_ms {
                Some(ms) => format!(
                    "{} in {}, oldest {} old",
                    d.dead_letters,
                    d.dead_letter_stream,
                    crate::dlq::age(ms)
                ),
                None => format!("{} in {}", d.dead_letters, d.dead_letter_stream),
            },
        ),
    ]);
    if d.leases_stale {
        out.push_str(
            "warning: no member renewed its lease for over half the lease TTL: every member is down, or Redis was unreachable; the next heartbeat re-arms the leases\n",
        );
    }
    out.push('\n');
    if d.members.is_empty() {
        out.push_str("no members\n");
    } else {
        let mut table = Table::new(&[
            "MEMBER", "NAME", "STATE", "LIVE", "EPOCH", "LEASE", "OWNED", "REVOKING", "PENDING",
            "AWAY",
        ]);
        for m in &d.members {
            table.row(vec![
                m.member_id.clone(),
                m.member_name.clone(),
                upper(&m.state),
                if m.live { "yes" } else { "no" }.into(),
                m.member_epoch.to_string(),
                lease(m.lease_remaining_ms),
                shards(&m.owned),
                shards(&m.revoking),
                shards(&m.pending),
                if m.away { "yes" } else { "no" }.into(),
            ]);
        }
        out.push_str(&table.render());
    }
    out.push('\n');
    let mut table = Table::new(&[
        "SHARD",
        "STATE",
        "OWNER",
        "LENGTH",
        "PENDING",
        "LAG",
        "LAST DELIVERED",
        "DEAD LETTERS",
    ]);
    let dash = || "-".to_owned();
    for s in &d.shards {
        let lag = if s.consumer_group_exists {
            s.lag.to_string()
        } else {
            debug_assert_eq!(s.lag, Lag::Unknown);
            "no group".to_owned()
        };
        table.row(vec![
            s.shard_index.to_string(),
            upper(&s.state),
            s.target_owner.clone().unwrap_or_else(dash),
            s.length.map_or_else(dash, |l| l.to_string()),
            s.pending.map_or_else(dash, |p| p.to_string()),
            lag,
            s.last_delivered_id.clone().unwrap_or_else(dash),
            s.dead_letters.map_or_else(dash, |n| n.to_string()),
        ]);
    }
    out.push_str(&table.render());
    out
}

pub(crate) fn groups_text(prefix: &str, listed: &[GroupSummary]) -> String {
    if listed.is_empty() {
        return format!("no consumer group is registered on stream {prefix}\n");
    }
    let mut table = Table::new(&[
        "GROUP",
        "START FROM",
        "STATE",
        "GROUP EPOCH",
        "MEMBERS",
        "LIVE",
        "PROBLEM",
    ]);
    for g in listed {
        table.row(vec![
            g.consumer_group.clone(),
            start_from(g.start_from).into(),
            g.state.as_ref().map_or("?".into(), upper),
            g.group_epoch.map_or("?".into(), |e| e.to_string()),
            g.members.to_string(),
            g.live_members.to_string(),
            g.problem.as_deref().map_or("-".into(), one_line),
        ]);
    }
    table.render()
}

pub(crate) fn deleted_text(d: &DeletedGroup) -> String {
    format!(
        "deleted group {} of stream {}: {} metadata keys, {}, consumer groups destroyed on shards {}; dead-letter stream {} {} ({} entries)\n",
        d.consumer_group,
        d.stream_prefix,
        d.keys_deleted,
        if d.unregistered {
            "unregistered"
        } else {
            "was not registered"
        },
        shards(&d.destroyed_on),
        d.dead_letter_stream,
        if d.dead_letters_kept {
            "kept"
        } else {
            "deleted"
        },
        d.dead_letters
    )
}

/// `group cleanup`: per shard, the consumers deleted (or that would be) and the ones kept, why.
pub(crate) fn cleanup_text(c: &ConsumerCleanup) -> String {
    let verb = if c.dry_run { "would delete" } else { "deleted" };
    let mut out = format!(
        "consumer cleanup of group {} on stream {}{}\n",
        c.consumer_group,
        c.stream_prefix,
        if c.dry_run {
            " (dry run: nothing deleted)"
        } else {
            ""
        }
    );
    for shard in &c.shards {
        if shard.no_consumer_group {
            out += &format!("shard {}: no consumer group\n", shard.shard_index);
            continue;
        }
        let deleted = if shard.deleted.is_empty() {
            "none".to_owned()
        } else {
            shard.deleted.join(", ")
        };
        out += &format!("shard {}: {verb} {deleted}\n", shard.shard_index);
        for kept in &shard.kept {
            let why = match kept.reason {
                KeptBecause::LiveMember => "live member",
                KeptBecause::StaticMember => "static member",
                KeptBecause::Pending => "no member, pending entries",
            };
            out += &format!(
                "  kept {} ({why}, pending {})\n",
                kept.consumer, kept.pending
            );
        }
    }
    let total: usize = c.shards.iter().map(|s| s.deleted.len()).sum();
    out += &format!("{verb} {total} consumers in all\n");
    out
}
