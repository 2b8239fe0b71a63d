//! `stream-listener`: the admin command-line tool of stream-listener (docs/design.md §1, §10), a
//! thin layer over `stream_listener::core::internals::admin`.
//!
//! Exit codes: 0 success; 1 the operation failed (unknown stream, bad count, group still live,
//! corrupt metadata...); 2 usage error (bad arguments, invalid URL); 3 Redis unreachable. Errors
//! are one line on standard error saying what went wrong and what to do.

mod connect;
mod dlq;
mod failure;
mod resets;
mod retention;
mod table;
mod text;
mod watch;

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use serde::Serialize;
use stream_listener::core::internals::admin;
use stream_listener::core::internals::coordinator::CoordinatorConfig;

use connect::connect;
use failure::Failure;
use text::cleanup_text;
use text::{
    created_text, deleted_text, group_text, groups_text, retire_text, scale_text, stream_text,
    streams_text,
};

/// Admin tool for stream-listener: sharded Redis Streams with Kafka-style consumer groups.
///
/// Creates, scales, retires, describes, trims and deletes sharded streams (`{<prefix>:<i>}` shard
/// streams with metadata in `sl:{<prefix>}:stream`); describes, resets, cleans up and deletes
/// their consumer groups; lists, replays and purges their dead letters.
///
/// Exit codes: 0 success, 1 operation failed, 2 usage error, 3 Redis unreachable.
#[derive(Parser)]
#[command(name = "stream-listener", version, propagate_version = true)]
struct Cli {
    /// Redis URL of a standalone server: redis://[user:password@]host:port[/db], or rediss://
    /// for TLS [default: redis://127.0.0.1:6379].
    // `hide_env_values`: the URL may carry a password, which `--help` must not print.
    #[arg(
        long,
        global = true,
        env = "REDIS_URL",
        hide_env_values = true,
        value_name = "URL"
    )]
    redis_url: Option<String>,

    /// Seed node of a Redis Cluster (a redis:// URL); repeat for more nodes. When given, the
    /// tool talks to the cluster and --redis-url is ignored.
    #[arg(long = "cluster-node", global = true, value_name = "URL")]
    cluster_nodes: Vec<String>,

    /// PEM file of the certificate authority that signed the server's certificate (rediss://
    /// URLs); without it the system's root certificates are used.
    #[arg(long, global = true, env = "REDIS_TLS_CA_FILE", value_name = "PATH")]
    tls_ca_file: Option<std::path::PathBuf>,

    /// PEM client certificate for mutual TLS (with --tls-key-file).
    #[arg(long, global = true, env = "REDIS_TLS_CERT_FILE", value_name = "PATH")]
    tls_cert_file: Option<std::path::PathBuf>,

    /// PEM private key of --tls-cert-file.
    #[arg(long, global = true, env = "REDIS_TLS_KEY_FILE", value_name = "PATH")]
    tls_key_file: Option<std::path::PathBuf>,

    /// Do not verify the server's TLS certificate (tests only: anyone on the path can
    /// impersonate the server).
    #[arg(long, global = true, env = "REDIS_TLS_INSECURE")]
    tls_insecure: bool,
    /// A Redis Sentinel (redis://[user:password@]host:26379, rediss:// for TLS); repeat for more.
    /// With --sentinel-master the tool asks them for the master and talks to it; --redis-url then
    /// only gives the master's user, password, database and scheme (its host is ignored; without
    /// it the master speaks TLS when every sentinel URL is rediss://).
    #[arg(
        long = "sentinel",
        global = true,
        env = "REDIS_SENTINELS",
        hide_env_values = true,
        value_delimiter = ',',
        value_name = "URL"
    )]
    sentinels: Vec<String>,

    /// The name the sentinels monitor the master by (`sentinel monitor <name> ...`), e.g.
    /// mymaster; needs --sentinel.
    #[arg(
        long = "sentinel-master",
        global = true,
        env = "REDIS_SENTINEL_MASTER",
        value_name = "NAME"
    )]
    sentinel_master: Option<String>,

    /// Print the result as JSON (camelCase fields, as stored) instead of tables.
    #[arg(long, global = true)]
    json: bool,

    #[command(subcommand)]
    command: Command,
}

// By hand: the URLs may hold a password, and Debug must not print it.
impl std::fmt::Debug for Cli {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use stream_listener::core::internals::connection::{redact_url, redact_urls};
        f.debug_struct("Cli")
            .field("redis_url", &self.redis_url.as_deref().map(redact_url))
            .field("cluster_nodes", &redact_urls(&self.cluster_nodes))
            .field("sentinels", &redact_urls(&self.sentinels))
            .field("sentinel_master", &self.sentinel_master)
            .field("tls_ca_file", &self.tls_ca_file)
            .field("tls_cert_file", &self.tls_cert_file)
            .field("tls_key_file", &self.tls_key_file)
            .field("tls_insecure", &self.tls_insecure)
            .field("json", &self.json)
            .field("command", &self.command)
            .finish()
    }
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Sharded streams: create, scale, retire drained shards, describe, list, delete, retention,
    /// trim.
    #[command(subcommand)]
    Stream(StreamCommand),
    /// Consumer groups of a stream: describe, list, delete, reset, cleanup.
    #[command(subcommand)]
    Group(GroupCommand),
    /// Dead letters of a consumer group (`<prefix>:dlq:<group>`): list, show, replay, purge.
    #[command(subcommand)]
    Dlq(dlq::DlqCommand),
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
        /// Retention to set on the stream (see `stream retention`).
        #[command(flatten)]
        retention: retention::RetentionArgs,
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
    /// Delete a stream and every key it owns: shard streams, fences, attempt hashes, every
    /// registered group's metadata, leases, history and dead-letter stream, the stream metadata
    /// and its `sl:streams` entry. Refused while a group has live members; without --force also
    /// refused while a group has pending or unread entries (the error names group and shard).
    /// Run it again to finish a deletion that was interrupted.
    Delete {
        /// Stream prefix.
        prefix: String,
        /// Delete even though groups have pending or unread entries (they are lost).
        #[arg(long)]
        force: bool,
    },
    /// Print, set or clear a stream's retention. Without flags it prints it; flags change the
    /// given settings and keep the others; `--clear` removes it (nothing is trimmed any more).
    /// Members apply a change within their `retention_interval`; no rebalance.
    Retention {
        /// Stream prefix.
        prefix: String,
        #[command(flatten)]
        retention: retention::RetentionArgs,
        /// Remove the retention.
        #[arg(long, conflicts_with_all = ["mode", "retention_max_age", "retention_max_len", "dlq_retention_max_age", "dlq_retention_max_len"])]
        clear: bool,
    },
    /// Trim a stream to its retention now, per readable shard and per group's dead-letter
    /// stream, and print what went and why (which bound, or which group holds the trim point
    /// back). For streams no member runs on; running members trim the shards they own.
    Trim {
        /// Stream prefix.
        prefix: String,
        /// Count what would go, change nothing.
        #[arg(long)]
        dry_run: bool,
    },
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
        #[command(flatten)]
        watch: watch::WatchArgs,
    },
    /// List the consumer groups registered on a stream.
    List {
        /// Stream prefix.
        prefix: String,
        #[command(flatten)]
        timing: Timing,
    },
    /// Delete an inactive consumer group (every member's lease has run out): its metadata, its
    /// registration, its consumer group, fence field and attempt counts on every shard, and its
    /// dead-letter stream (unless --keep-dead-letters).
    Delete {
        /// Stream prefix.
        prefix: String,
        /// Consumer group.
        group: String,
        /// Keep the dead-letter stream <prefix>:dlq:<group>.
        #[arg(long)]
        keep_dead_letters: bool,
    },
    /// Move an inactive consumer group's position on its shards (like kafka-consumer-groups
    /// --reset-offsets), with XGROUP SETID. Per shard the group's pending entries are
    /// acknowledged (dropped from its PEL), so afterwards it delivers exactly the entries after
    /// the new position: `--to latest` skips everything, an earlier point reprocesses from
    /// there. Refused while the group has live members.
    #[command(group(clap::ArgGroup::new("position").required(true).args(["to", "shift_by"])))]
    Reset {
        /// Stream prefix.
        prefix: String,
        /// Consumer group.
        group: String,
        /// earliest (every entry again), latest (nothing old), or an RFC 3339 time in UTC such
        /// as 2026-12-01T12:00:00Z: the entries whose id has that millisecond or a later one.
        #[arg(long, value_parser = resets::parse_reset_to, value_name = "POSITION")]
        to: Option<admin::ResetTarget>,
        /// Move by N entries from the last delivered id: -N re-delivers N entries, +N skips N;
        /// clamped to the shard. Not 0.
        #[arg(long, allow_hyphen_values = true, value_name = "N")]
        shift_by: Option<i64>,
        /// Only these shards (readable ones), comma-separated, e.g. 0,3.
        #[arg(long, value_delimiter = ',', value_name = "SHARDS")]
        shards: Option<Vec<u32>>,
        /// Print per shard the old and new position and the entries that would be delivered,
        /// change nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Delete the Redis consumers of members that left the group (consumer hygiene).
    ///
    /// On every shard that is not RETIRED, a Redis consumer of the group is deleted
    /// (`XGROUP DELCONSUMER`) when it belongs to no member whose lease runs and to no static
    /// member still in the group, and only when it has no pending entries (checked in the same
    /// script): nothing pending is ever dropped. Safe while members run; they do the same after
    /// each takeover. Prints per shard the consumers deleted and the ones kept, with the reason
    /// (live member, static member, pending N).
    Cleanup {
        /// Stream prefix.
        prefix: String,
        /// Consumer group.
        group: String,
        /// Only list what would be deleted; change nothing.
        #[arg(long)]
        dry_run: bool,
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

pub(crate) fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text).map_err(|e| format!("{e} (write e.g. 30s, 2m, 500ms)"))
}

fn parse_positive_duration(text: &str) -> Result<Duration, String> {
    let duration = parse_duration(text)?;
    if duration < Duration::from_millis(3) {
        return Err("must be at least 3ms".into());
    }
    Ok(duration)
}

fn main() -> ExitCode {
    let matches = <Cli as clap::CommandFactory>::command().get_matches();
    let prefix = failure::prefix_of(&matches);
    let cli = match <Cli as clap::FromArgMatches>::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(err) => err.exit(),
    };
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
            eprintln!("error: {}", failure.message_for(prefix.as_deref()));
            ExitCode::from(failure.code())
        }
    }
}

fn json<T: Serialize>(value: &T) -> Result<String, Failure> {
    serde_json::to_string_pretty(value)
        .map(|text| text + "\n")
        .map_err(|e| Failure::Operation(format!("cannot print JSON: {e}")))
}

/// `value` as JSON (`--json`) or as `text` renders it.
pub(crate) fn output<T: Serialize>(
    as_json: bool,
    value: &T,
    text: impl FnOnce(&T) -> String,
) -> Result<String, Failure> {
    if as_json {
        json(value)
    } else {
        Ok(text(value))
    }
}

async fn run(cli: Cli) -> Result<String, Failure> {
    let mut conn = connect(&cli).await?;
    let conn = &mut conn;
    let as_json = cli.json;
    match cli.command {
        Command::Stream(StreamCommand::Create {
            prefix,
            shards,
            retention,
        }) => {
            // Flags are checked before anything is created. On a stream that exists they change
            // the given settings and keep the others, as `stream retention` does, and the text
            // says what the retention is now.
            retention.any().then(|| retention.apply(None)).transpose()?;
            let created = admin::create_stream(conn, &prefix, shards).await?;
            let retention_now = if retention.any() {
                Some(retention::retention_command(conn, &prefix, &retention, false).await?)
            } else {
                None
            };
            output(as_json, &created, |c| {
                let mut text = created_text(&prefix, shards, c, retention_now.is_some());
                if let Some(now) = &retention_now {
                    text.push_str(&retention::retention_text(now));
                }
                text
            })
        }
        Command::Stream(StreamCommand::Retention {
            prefix,
            retention,
            clear,
        }) => {
            let shown = retention::retention_command(conn, &prefix, &retention, clear).await?;
            output(as_json, &shown, retention::retention_text)
        }
        Command::Stream(StreamCommand::Trim { prefix, dry_run }) => {
            let report = admin::trim_stream(conn, &prefix, dry_run).await?;
            output(as_json, &report, retention::trim_text)
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
            output(as_json, &outcome, scale_text)
        }
        Command::Stream(StreamCommand::Retire {
            prefix,
            routing_lease,
        }) => {
            let report = admin::retire_drained(conn, &prefix, routing_lease).await?;
            output(as_json, &report, retire_text)
        }
        Command::Stream(StreamCommand::Describe { prefix }) => {
            let described = admin::describe_stream(conn, &prefix).await?;
            output(as_json, &described, stream_text)
        }
        Command::Stream(StreamCommand::List) => {
            let listed = admin::list_streams(conn).await?;
            output(as_json, &listed, |l| streams_text(l))
        }
        Command::Group(GroupCommand::Describe {
            prefix,
            group,
            timing,
            watch,
        }) => {
            if watch.watch {
                let config = timing.config();
                return watch::watch(conn, &prefix, &group, &config, &watch, as_json).await;
            }
            let described = admin::describe_group(conn, &prefix, &group, &timing.config()).await?;
            output(as_json, &described, group_text)
        }
        Command::Group(GroupCommand::List { prefix, timing }) => {
            let listed = admin::list_groups(conn, &prefix, &timing.config()).await?;
            output(as_json, &listed, |l| groups_text(&prefix, l))
        }
        Command::Group(GroupCommand::Delete {
            prefix,
            group,
            keep_dead_letters,
        }) => {
            let deleted =
                admin::delete_group_with(conn, &prefix, &group, keep_dead_letters).await?;
            output(as_json, &deleted, deleted_text)
        }
        Command::Group(GroupCommand::Reset {
            prefix,
            group,
            to,
            shift_by,
            shards,
            dry_run,
        }) => {
            let target = match (to, shift_by) {
                (Some(to), None) => to,
                (None, Some(n)) => admin::ResetTarget::ShiftBy { n },
                _ => return Err(Failure::Usage("give one of --to or --shift-by".into())),
            };
            let options = admin::ResetOptions {
                target,
                shards,
                dry_run,
            };
            let reset = admin::reset_group(conn, &prefix, &group, &options).await?;
            output(as_json, &reset, resets::reset_text)
        }
        Command::Stream(StreamCommand::Delete { prefix, force }) => {
            let deleted = admin::delete_stream(conn, &prefix, force).await?;
            output(as_json, &deleted, resets::stream_deleted_text)
        }
        Command::Group(GroupCommand::Cleanup {
            prefix,
            group,
            dry_run,
        }) => {
            let cleaned = admin::cleanup_consumers(conn, &prefix, &group, dry_run).await?;
            output(as_json, &cleaned, cleanup_text)
        }
        Command::Dlq(command) => dlq::run(conn, as_json, command).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stream_listener::core::internals::connection::Topology;

    #[test]
    fn the_command_line_parses() {
        Cli::command_for_tests().debug_assert();
    }

    #[test]
    fn debug_of_the_command_line_hides_passwords() {
        let cli = Cli::parse_from([
            "stream-listener",
            "--redis-url",
            "redis://u:s3cret-pw@127.0.0.1:6379",
            "--cluster-node",
            "redis://u:s3cret-pw@127.0.0.1:7000",
            "--sentinel",
            "redis://:s3cret-pw@127.0.0.1:26379",
            "stream",
            "list",
        ]);
        let shown = format!("{cli:?}");
        assert!(shown.contains("redis://:***@127.0.0.1:26379"), "{shown}");
        assert!(!shown.contains("s3cret-pw"), "{shown}");
        assert!(shown.contains("redis://u:***@127.0.0.1:6379"), "{shown}");
        assert!(shown.contains("redis://u:***@127.0.0.1:7000"), "{shown}");
    }

    #[test]
    fn a_sentinel_master_without_redis_url_speaks_tls_like_its_sentinels() {
        let cli = Cli::parse_from([
            "stream-listener",
            "--sentinel",
            "rediss://127.0.0.1:26379",
            "--sentinel-master",
            "mymaster",
            "stream",
            "list",
        ]);
        let Ok((target, _, _)) = connect::target_of(&cli) else {
            panic!("no target");
        };
        let Topology::Sentinel(sentinel) = target.topology() else {
            panic!("not a Sentinel target: {target:?}");
        };
        // No --redis-url: the master's scheme follows the sentinels' (as [redis] without url),
        // not the plain default URL.
        assert_eq!(sentinel.master_auth, None);
        let cli = Cli::parse_from([
            "stream-listener",
            "--redis-url",
            "rediss://u:pw@_/2",
            "--sentinel",
            "rediss://127.0.0.1:26379",
            "--sentinel-master",
            "mymaster",
            "stream",
            "list",
        ]);
        let Ok((target, _, _)) = connect::target_of(&cli) else {
            panic!("no target");
        };
        let Topology::Sentinel(sentinel) = target.topology() else {
            panic!("not a Sentinel target: {target:?}");
        };
        assert_eq!(sentinel.master_auth.as_deref(), Some("rediss://u:pw@_/2"));
    }

    impl Cli {
        fn command_for_tests() -> clap::Command {
            <Cli as clap::CommandFactory>::command()
        }
    }
}
