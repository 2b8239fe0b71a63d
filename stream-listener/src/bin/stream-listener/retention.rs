//! `stream retention`, `stream trim` and the retention flags of `stream create`
//! (docs/design.md §10.9): the flags, their checks, and what the tool prints.

use std::time::Duration;

use clap::{Args, ValueEnum};
use stream_listener::core::internals::admin::{
    self, DeadLetterTrim, ShardTrim, StreamRetention, TrimReport,
};
use stream_listener::core::internals::connection::RedisConnection;
use stream_listener::core::internals::store::{
    KeyTrim, Retention, RetentionError, RetentionMode, TrimReason,
};

use crate::failure::Failure;
use crate::table::Table;

/// `--retention acked|force`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum ModeArg {
    /// Never trim an entry some consumer group has not acked or not received yet.
    Acked,
    /// The bounds alone: a group behind them loses entries (counted and logged).
    Force,
}

/// The retention flags of `stream create` and `stream retention`. A flag not given keeps the
/// stored value (`stream retention`) or stays unset (`stream create`).
#[derive(Debug, Clone, Default, Args)]
pub(crate) struct RetentionArgs {
    /// Retention mode: `acked` (default: never trim what a consumer group still needs) or
    /// `force` (the bounds alone; losses are counted and logged).
    #[arg(long = "retention", value_enum, value_name = "MODE")]
    mode: Option<ModeArg>,
    /// Trim shard entries older than this (e.g. 7d, 12h), by entry id against Redis TIME.
    #[arg(long, value_parser = crate::parse_duration, value_name = "DURATION")]
    retention_max_age: Option<Duration>,
    /// Keep at most this many entries per shard (1 to 2^53).
    #[arg(long, value_name = "N")]
    retention_max_len: Option<u64>,
    /// Trim dead letters older than this (e.g. 30d).
    #[arg(long, value_parser = crate::parse_duration, value_name = "DURATION")]
    dlq_retention_max_age: Option<Duration>,
    /// Keep at most this many dead letters per consumer group (1 to 2^53).
    #[arg(long, value_name = "N")]
    dlq_retention_max_len: Option<u64>,
}

impl RetentionArgs {
    /// Whether any retention flag was given.
    pub(crate) fn any(&self) -> bool {
        self.mode.is_some()
            || self.retention_max_age.is_some()
            || self.retention_max_len.is_some()
            || self.dlq_retention_max_age.is_some()
            || self.dlq_retention_max_len.is_some()
    }

    /// `base` (or no retention: mode acked, no bounds) with the given flags applied.
    ///
    /// # Errors
    /// A usage error naming the flag and value for a 0 or absurd bound.
    pub(crate) fn apply(&self, base: Option<Retention>) -> Result<Retention, Failure> {
        let mut retention = base.unwrap_or_else(|| Retention::new(RetentionMode::Acked));
        if let Some(mode) = self.mode {
            retention.mode = match mode {
                ModeArg::Acked => RetentionMode::Acked,
                ModeArg::Force => RetentionMode::Force,
            };
        }
        if let Some(age) = self.retention_max_age {
            retention.max_age_ms = Some(whole_millis("--retention-max-age", age)?);
        }
        if let Some(len) = self.retention_max_len {
            retention.max_len = Some(len);
        }
        if let Some(age) = self.dlq_retention_max_age {
            retention.dlq_max_age_ms = Some(whole_millis("--dlq-retention-max-age", age)?);
        }
        if let Some(len) = self.dlq_retention_max_len {
            retention.dlq_max_len = Some(len);
        }
        retention.validate().map_err(flag_error)?;
        check_force_age(&retention)?;
        Ok(retention)
    }
}

/// The shortest shard age a `"force"` retention may have from the tool: the default
/// `heartbeat_interval`. The tool cannot know the members' own timings (a config's retention is
/// checked against its own heartbeat); a force bound below one heartbeat trims entries before any
/// member could read them. An `"acked"` age of any length is safe: it never trims an entry a
/// group still needs.
const FORCE_AGE_FLOOR: Duration = Duration::from_secs(3);

/// Refuses a `"force"` retention whose shard age is below [`FORCE_AGE_FLOOR`].
fn check_force_age(retention: &Retention) -> Result<(), Failure> {
    let floor = millis(FORCE_AGE_FLOOR);
    match retention.max_age_ms {
        Some(ms) if retention.mode == RetentionMode::Force && ms < floor => {
            Err(Failure::Usage(format!(
                "--retention-max-age {} with --retention force is below one heartbeat interval ({}): entries would be trimmed before a member could read them; give at least that, or use --retention acked",
                humantime::format_duration(Duration::from_millis(ms)),
                humantime::format_duration(FORCE_AGE_FLOOR)
            )))
        }
        _ => Ok(()),
    }
}

/// `age` in ms for `flag`; an age above 0 but below 1 ms is refused by its own text (it would
/// read as 0: ages count in the milliseconds of entry ids).
fn whole_millis(flag: &str, age: Duration) -> Result<u64, Failure> {
    if !age.is_zero() && age < Duration::from_millis(1) {
        return Err(Failure::Usage(format!(
            "{flag} {} is below 1 ms: ages count in the milliseconds of entry ids; give at least 1ms",
            humantime::format_duration(age)
        )));
    }
    Ok(millis(age))
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// The validation error with the JSON key replaced by the flag.
fn flag_error(error: RetentionError) -> Failure {
    let RetentionError::InvalidValue { key, value, reason } = &error else {
        return Failure::Usage(error.to_string());
    };
    let flag = match key.as_str() {
        "maxAgeMs" => "--retention-max-age",
        "maxLen" => "--retention-max-len",
        "dlqMaxAgeMs" => "--dlq-retention-max-age",
        "dlqMaxLen" => "--dlq-retention-max-len",
        other => other,
    };
    Failure::Usage(format!("{flag} {value} is invalid: {reason}"))
}

/// `stream retention <prefix> [flags | --clear]`.
pub(crate) async fn retention_command(
    conn: &mut RedisConnection,
    prefix: &str,
    args: &RetentionArgs,
    clear: bool,
) -> Result<StreamRetention, Failure> {
    if clear {
        return Ok(admin::set_stream_retention(conn, prefix, None).await?);
    }
    let current = admin::stream_retention(conn, prefix).await?;
    if !args.any() {
        return Ok(current);
    }
    let retention = args.apply(current.retention)?;
    Ok(admin::set_stream_retention(conn, prefix, Some(retention)).await?)
}

fn age(ms: Option<u64>) -> String {
    ms.map_or_else(
        || "none".to_owned(),
        |ms| humantime::format_duration(Duration::from_millis(ms)).to_string(),
    )
}

fn len(n: Option<u64>) -> String {
    n.map_or_else(|| "none".to_owned(), |n| n.to_string())
}

/// One line: mode and bounds.
pub(crate) fn retention_summary(r: &Retention) -> String {
    format!(
        "{}, max age {}, max len {} per shard; dead letters: max age {}, max len {}",
        r.mode.as_str(),
        age(r.max_age_ms),
        len(r.max_len),
        age(r.dlq_max_age_ms),
        len(r.dlq_max_len)
    )
}

pub(crate) fn retention_text(r: &StreamRetention) -> String {
    let prefix = &r.stream_prefix;
    let now = match &r.retention {
        Some(retention) => format!("retention {}", retention_summary(retention)),
        None => "no retention: nothing is trimmed".to_owned(),
    };
    if r.previous == r.retention {
        format!("stream {prefix}: {now}\n")
    } else {
        format!("stream {prefix} changed: {now}\n")
    }
}

fn reason(trim: &KeyTrim) -> String {
    match trim.reason {
        TrimReason::MaxAge => "max age".into(),
        TrimReason::MaxLen => "max len".into(),
        TrimReason::Group => format!(
            "held back by group {} at {}",
            trim.holder.as_deref().unwrap_or("?"),
            trim.holder_id.as_deref().unwrap_or("?")
        ),
        TrimReason::WithinBounds => "within bounds".into(),
        TrimReason::NoGroups => "no consumer group yet: everything kept".into(),
        TrimReason::NoBounds => "no bound".into(),
        TrimReason::NoStream => "stream missing".into(),
        _ => "?".into(),
    }
}

fn trim_row(table: &mut Table, what: String, trim: &KeyTrim) {
    table.row(vec![
        what,
        trim.deleted.to_string(),
        trim.length_after.to_string(),
        trim.trim_point.clone().unwrap_or_else(|| "-".into()),
        reason(trim),
    ]);
}

pub(crate) fn trim_text(report: &TrimReport) -> String {
    let mut out = format!(
        "{} {} to retention {}\n\n",
        if report.dry_run {
            "dry run (nothing changed): would trim"
        } else {
            "trimmed"
        },
        report.stream_prefix,
        retention_summary(&report.retention)
    );
    let mut table = Table::new(&["SHARD", "DELETED", "LEFT", "TRIM POINT", "REASON"]);
    for ShardTrim {
        shard_index, trim, ..
    } in &report.shards
    {
        trim_row(&mut table, shard_index.to_string(), trim);
    }
    for DeadLetterTrim {
        consumer_group,
        trim,
        ..
    } in &report.dead_letters
    {
        trim_row(&mut table, format!("dlq:{consumer_group}"), trim);
    }
    out.push_str(&table.render());
    for ShardTrim {
        shard_index, trim, ..
    } in &report.shards
    {
        for loss in &trim.lost {
            out.push_str(&format!(
                "shard {shard_index}: group {} {} {} entries it had not acked or received\n",
                loss.consumer_group,
                if report.dry_run { "would lose" } else { "lost" },
                loss.entries
            ));
        }
    }
    out
}
