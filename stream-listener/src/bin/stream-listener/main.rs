//! `stream-listener`: the admin command-line tool of stream-listener (docs/design.md §1, §10), a
//! thin layer over `stream_listener::core::admin`.
//!
//! Exit codes: 0 success; 1 the operation failed (unknown stream, bad count, group still live,
//! corrupt metadata...); 2 usage error (bad arguments, invalid URL); 3 Redis unreachable. Errors
//! are one line on standard error saying what went wrong and what to do.

mod table;

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use serde::Serialize;
use stream_listener::core::admin::{
    self, AdminError, DeletedGroup, GroupDescription, GroupSummary, Lag, RetireReport, ScaleAction,
    ScaleOutcome, StreamDescription, StreamSummary,
};
use stream_listener::core::connection::{
    DEFAULT_RESPONSE_TIMEOUT, RedisConnection, RedisFailure, RedisTarget,
};
use stream_listener::core::coordinator::CoordinatorConfig;
use stream_listener::core::model::StartFrom;
use stream_listener::core::report::Chain;

use table::{Table, shards};

/// Admin tool for stream-listener: sharded Redis Streams with Kafka-style consumer groups.
///
/// Creates, scales, retires and describes sharded streams (`{<prefix>:<i>}` shard streams with
/// metadata in `sl:{<prefix>}:stream`) and their consumer groups.
///
/// Exit codes: 0 success, 1 operation failed, 2 usage error, 3 Redis unreachable.
#[derive(Debug, Parser)]
#[command(name = "stream-listener", version, propagate_version = true)]
struct Cli {
    /// Redis URL of a standalone server: redis://[user:password@]host:port[/db], or rediss://
    /// for TLS.
    #[arg(
        long,
        global = true,
        env = "REDIS_URL",
        default_value = "redis://127.0.0.1:6379",
        value_name = "URL"
    )]
    redis_url: String,

    /// Seed node of a Redis Cluster (a redis:// URL); repeat for more nodes. When given, the
    /// tool talks to the cluster and --redis-url is ignored.
    #[arg(long = "cluster-node", global = true, value_name = "URL")]
    cluster_nodes: Vec<String>,

    /// Print the result as JSON (camelCase fields, as stored) instead of tables.
    #[arg(long, global = true)]
    json: bool,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Sharded streams: create, scale, retire drained shards, describe, list.
    #[command(subcommand)]
    Stream(StreamCommand),
    /// Consumer groups of a stream: describe, list, delete.
    #[command(subcommand)]
    Group(GroupCommand),
}

#[derive(Debug, Subcommand)]
enum StreamCommand {
    /// Create a stream with N shards ({<prefix>:0}..{<prefix>:N-1}). Idempotent: creating an
    /// existing stream with the same count changes nothing; another count is an error (use
    /// `stream scale`).
    Create {
        /// Stream prefix (no `{`, `}`, whitespace).
        prefix: String,
        /// Number of shards, 1 to 1024.
        #[arg(long, value_name = "N")]
        shards: u32,
    },
    /// Change the shard count (one migration at a time).
    ///
    /// Scale-out provisions the new shards, with a consumer group for every registered group, and
    /// makes them ACTIVE at once. Scale-in (0 included: a full drain) marks the removed shards
    /// DRAINING: producers stop routing to them, members keep consuming them; retire them with
    /// `stream retire` once every group has consumed them. `--cancel` abandons a scale-in whose
    /// shards are not RETIRING yet.
    Scale {
        /// Stream prefix.
        prefix: String,
        /// Target shard count, 0 to 1024.
        #[arg(required_unless_present = "cancel", conflicts_with = "cancel")]
        target: Option<u32>,
        /// Abandon the running scale-in: DRAINING shards become ACTIVE again.
        #[arg(long)]
        cancel: bool,
    },
    /// Retire DRAINING shards that every consumer group has finished: no pending entry and no
    /// entry after its last delivered id. A shard is deleted only once the producers' routing
    /// lease has passed since it started draining. Run it again until it reports the migration
    /// complete; shards still in use are listed with the reason.
    Retire {
        /// Stream prefix.
        prefix: String,
        /// Producers' routing lease: how long a producer may keep routing with metadata read
        /// before the scale-in (e.g. 30s, 2m); a fifth more is waited as slack.
        #[arg(long, default_value = "30s", value_parser = parse_duration, value_name = "DURATION")]
        routing_lease: Duration,
    },
    /// Show a stream: shard count, migration, groups, and per shard its state, length and each
    /// consumer group's pending count, lag and last delivered id.
    Describe {
        /// Stream prefix.
        prefix: String,
    },
    /// List the streams of the index `sl:streams`.
    List,
}

#[derive(Debug, Subcommand)]
enum GroupCommand {
    /// Show a consumer group: state, epochs, members (state, epoch, lease, owned / revoking /
    /// pending shards) and per shard the target owner, length, pending count, lag, last delivered
    /// id and dead letters.
    Describe {
        /// Stream prefix.
        prefix: String,
        /// Consumer group.
        group: String,
        #[command(flatten)]
        timing: Timing,
    },
    /// List the consumer groups registered on a stream.
    List {
        /// Stream prefix.
        prefix: String,
        #[command(flatten)]
        timing: Timing,
    },
    /// Delete an inactive consumer group (every member's lease has run out): its metadata, its
    /// registration, and its consumer group on every shard. The dead-letter stream is kept.
    Delete {
        /// Stream prefix.
        prefix: String,
        /// Consumer group.
        group: String,
    },
}

#[derive(Debug, Clone, Args)]
struct Timing {
    /// The members' `member_lease_ttl` ([coordination] in their config), used to judge expired
    /// members the way the coordinator does.
    #[arg(long, default_value = "15s", value_parser = parse_positive_duration, value_name = "DURATION")]
    member_lease_ttl: Duration,
}

impl Timing {
    fn config(&self) -> CoordinatorConfig {
        let defaults = CoordinatorConfig::default();
        CoordinatorConfig::new(
            self.member_lease_ttl / 3,
            self.member_lease_ttl,
            defaults.rebalance_timeout,
        )
        .unwrap_or(defaults)
    }
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text).map_err(|e| format!("{e} (write e.g. 30s, 2m, 500ms)"))
}

fn parse_positive_duration(text: &str) -> Result<Duration, String> {
    let duration = parse_duration(text)?;
    if duration < Duration::from_millis(3) {
        return Err("must be at least 3ms".into());
    }
    Ok(duration)
}

/// A failure and its exit code.
enum Failure {
    /// Exit code 1.
    Operation(String),
    /// Exit code 2.
    Usage(String),
    /// Exit code 3.
    Unreachable(String),
}

impl Failure {
    fn code(&self) -> u8 {
        match self {
            Failure::Operation(_) => 1,
            Failure::Usage(_) => 2,
            Failure::Unreachable(_) => 3,
        }
    }

    fn message(&self) -> &str {
        match self {
            Failure::Operation(m) | Failure::Usage(m) | Failure::Unreachable(m) => m,
        }
    }
}

impl From<AdminError> for Failure {
    fn from(err: AdminError) -> Self {
        let text = one_line(&Chain(&err).to_string());
        if err.is_redis_unreachable() {
            Failure::Unreachable(format!(
                "lost the connection to Redis: {text}; check that Redis is up, then retry"
            ))
        } else {
            Failure::Operation(text)
        }
    }
}

fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// `redis://user:secret@host` → `redis://***@host`: never print a password.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}***{}", &url[..scheme + 3], &url[at..])
        }
        _ => url.to_owned(),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("error: cannot start the async runtime: {err}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(output) => {
            print!("{output}");
            ExitCode::SUCCESS
        }
        Err(failure) => {
            eprintln!("error: {}", failure.message());
            ExitCode::from(failure.code())
        }
    }
}

async fn connect(cli: &Cli) -> Result<RedisConnection, Failure> {
    let (target, shown) = if cli.cluster_nodes.is_empty() {
        (
            RedisTarget::Standalone(cli.redis_url.clone()),
            redact(&cli.redis_url),
        )
    } else {
        let shown: Vec<String> = cli.cluster_nodes.iter().map(|n| redact(n)).collect();
        (
            RedisTarget::Cluster(cli.cluster_nodes.clone()),
            format!("cluster {}", shown.join(", ")),
        )
    };
    RedisConnection::connect(&target, DEFAULT_RESPONSE_TIMEOUT)
        .await
        .map_err(|err| {
            let text = one_line(&err.to_string());
            if err.kind() == redis::ErrorKind::InvalidClientConfig {
                Failure::Usage(format!(
                    "invalid Redis address {shown}: {text}; write it as redis://[user:password@]host:port[/db]"
                ))
            } else if RedisFailure::of(&err).is_unreachable() {
                Failure::Unreachable(format!(
                    "cannot reach Redis at {shown}: {text}; check that Redis is running and that --redis-url (or REDIS_URL, or --cluster-node) points at it"
                ))
            } else {
                Failure::Operation(format!("cannot connect to Redis at {shown}: {text}"))
            }
        })
}

fn json<T: Serialize>(value: &T) -> Result<String, Failure> {
    serde_json::to_string_pretty(value)
        .map(|text| text + "\n")
        .map_err(|e| Failure::Operation(format!("cannot print JSON: {e}")))
}

async fn run(cli: Cli) -> Result<String, Failure> {
    let mut conn = connect(&cli).await?;
    let conn = &mut conn;
    let as_json = cli.json;
    match cli.command {
        Command::Stream(StreamCommand::Create { prefix, shards }) => {
            let created = admin::create_stream(conn, &prefix, shards).await?;
            if as_json {
                return json(&created);
            }
            let meta = &created.metadata;
            Ok(if created.created {
                format!(
                    "created stream {prefix} with {shards} shards ({{{prefix}:0}}..{{{prefix}:{}}}), metadataVersion {}\n",
                    shards - 1,
                    meta.metadata_version
                )
            } else {
                format!(
                    "stream {prefix} already exists with {} shards: nothing changed\n",
                    meta.shard_count
                )
            })
        }
        Command::Stream(StreamCommand::Scale {
            prefix,
            target,
            cancel,
        }) => {
            let outcome = match (cancel, target) {
                (true, _) => admin::cancel_scale(conn, &prefix).await?,
                (false, Some(target)) => admin::scale(conn, &prefix, target).await?,
                (false, None) => {
                    return Err(Failure::Usage(
                        "give a target shard count, or --cancel".into(),
                    ));
                }
            };
            if as_json {
                return json(&outcome);
            }
            Ok(scale_text(&outcome))
        }
        Command::Stream(StreamCommand::Retire {
            prefix,
            routing_lease,
        }) => {
            let report = admin::retire_drained(conn, &prefix, routing_lease).await?;
            if as_json {
                return json(&report);
            }
            Ok(retire_text(&report))
        }
        Command::Stream(StreamCommand::Describe { prefix }) => {
            let described = admin::describe_stream(conn, &prefix).await?;
            if as_json {
                return json(&described);
            }
            Ok(stream_text(&described))
        }
        Command::Stream(StreamCommand::List) => {
            let listed = admin::list_streams(conn).await?;
            if as_json {
                return json(&listed);
            }
            Ok(streams_text(&listed))
        }
        Command::Group(GroupCommand::Describe {
            prefix,
            group,
            timing,
        }) => {
            let described = admin::describe_group(conn, &prefix, &group, &timing.config()).await?;
            if as_json {
                return json(&described);
            }
            Ok(group_text(&described))
        }
        Command::Group(GroupCommand::List { prefix, timing }) => {
            let listed = admin::list_groups(conn, &prefix, &timing.config()).await?;
            if as_json {
                return json(&listed);
            }
            Ok(groups_text(&prefix, &listed))
        }
        Command::Group(GroupCommand::Delete { prefix, group }) => {
            let deleted = admin::delete_group(conn, &prefix, &group).await?;
            if as_json {
                return json(&deleted);
            }
            Ok(deleted_text(&deleted))
        }
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

fn scale_text(outcome: &ScaleOutcome) -> String {
    let prefix = &outcome.stream_prefix;
    let version = outcome.metadata_version;
    match outcome.action {
        ScaleAction::ScaleOut => format!(
            "scaled out {prefix} from {} to {} shards: shards {} provisioned and ACTIVE (metadataVersion {version})\n",
            outcome.from_shard_count,
            outcome.to_shard_count,
            shards(&outcome.provisioned)
        ),
        ScaleAction::ScaleIn => format!(
            "scale-in of {prefix} from {} to {} shards started: shards {} are DRAINING (metadataVersion {version}); producers no longer route to them and members keep consuming them; run `stream-listener stream retire {prefix}` to retire them once consumed\n",
            outcome.from_shard_count,
            outcome.to_shard_count,
            shards(&outcome.draining)
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

fn retire_text(report: &RetireReport) -> String {
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

fn stream_text(d: &StreamDescription) -> String {
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

fn streams_text(listed: &[StreamSummary]) -> String {
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

fn group_text(d: &GroupDescription) -> String {
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
            format!("{} in {}", d.dead_letters, d.dead_letter_stream),
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

fn groups_text(prefix: &str, listed: &[GroupSummary]) -> String {
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

fn deleted_text(d: &DeletedGroup) -> String {
    format!(
        "deleted group {} of stream {}: {} metadata keys, {}, consumer groups destroyed on shards {}; dead-letter stream {} kept ({} entries)\n",
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
        d.dead_letters
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_never_printed() {
        assert_eq!(
            redact("redis://u:secret@host:6379/0"),
            "redis://***@host:6379/0"
        );
        assert_eq!(redact("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
    }

    #[test]
    fn the_command_line_parses() {
        Cli::command_for_tests().debug_assert();
    }

    impl Cli {
        fn command_for_tests() -> clap::Command {
            <Cli as clap::CommandFactory>::command()
        }
    }
}
