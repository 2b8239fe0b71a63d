//! `group describe --watch` (docs/design.md §13.5): the describe view, read again every
//! `--interval`, until Ctrl-C.
//!
//! On a terminal each snapshot redraws the screen in place: the whole frame (ANSI home + clear,
//! a header line, the table) is built first and written with one write, so the screen never
//! shows half a frame. When standard output is not a terminal (a pipe, a file), each snapshot is
//! printed after the previous one, followed by a blank line, so the output stays a readable log;
//! with `--json` each snapshot is one line of JSON (JSON lines). The first snapshot's error ends
//! the command as `describe` would (an unknown group is exit 1); a later failure (Redis
//! restarting) is shown in the frame and the watch goes on.

use std::io::{IsTerminal, Write};
use std::time::{Duration, SystemTime};

use clap::Args;
use stream_listener::core::internals::admin;
use stream_listener::core::internals::connection::RedisConnection;
use stream_listener::core::internals::coordinator::CoordinatorConfig;

use crate::failure::Failure;
use crate::text::group_text;

/// The shortest `--interval`: each snapshot costs a few commands per shard.
const MIN_INTERVAL: Duration = Duration::from_millis(100);

/// ANSI: cursor home, then clear the screen.
const HOME_AND_CLEAR: &str = "\x1b[H\x1b[2J";

/// The `--watch` and `--interval` flags of `group describe`.
#[derive(Debug, Args)]
pub(crate) struct WatchArgs {
    /// Redraw the view every --interval until Ctrl-C (on a terminal: in place; otherwise each
    /// snapshot followed by a blank line, or one JSON line per snapshot with --json).
    #[arg(long)]
    pub(crate) watch: bool,
    /// Time between snapshots with --watch (at least 100ms), e.g. 2s, 500ms.
    #[arg(long, default_value = "2s", value_parser = parse_interval, value_name = "DURATION", requires = "watch")]
    pub(crate) interval: Duration,
}

fn parse_interval(text: &str) -> Result<Duration, String> {
    let interval = crate::parse_duration(text)?;
    if interval < MIN_INTERVAL {
        return Err(format!(
            "must be at least {} (each snapshot reads every shard)",
            humantime::format_duration(MIN_INTERVAL)
        ));
    }
    Ok(interval)
}

/// How snapshots are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Redraw in place.
    Terminal,
    /// One after the other, a blank line after each.
    Log,
    /// One JSON line each.
    JsonLines,
}

/// Watches group `group` of stream `prefix` until Ctrl-C; returns what is left to print
/// (nothing).
///
/// # Errors
/// The first snapshot's [`Failure`] (an unknown stream or group, Redis unreachable), or a failed
/// write to standard output other than a closed pipe (which ends the watch successfully).
pub(crate) async fn watch(
    conn: &mut RedisConnection,
    prefix: &str,
    group: &str,
    config: &CoordinatorConfig,
    args: &WatchArgs,
    as_json: bool,
) -> Result<String, Failure> {
    let mode = if as_json {
        Mode::JsonLines
    } else if std::io::stdout().is_terminal() {
        Mode::Terminal
    } else {
        Mode::Log
    };
    let mut ticker = tokio::time::interval(args.interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let interrupted = tokio::signal::ctrl_c();
    tokio::pin!(interrupted);
    let mut first = true;
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = &mut interrupted => return Ok(String::new()),
        }
        // Ctrl-C ends the watch during a snapshot too: with Redis frozen, a read waits for the
        // response timeout.
        let snapshot = tokio::select! {
            snapshot = admin::describe_group(conn, prefix, group, config) => snapshot,
            _ = &mut interrupted => return Ok(String::new()),
        };
        let body = match snapshot {
            Ok(described) => match mode {
                Mode::JsonLines => serde_json::to_string(&described)
                    .map_err(|e| Failure::Operation(format!("cannot print JSON: {e}")))?,
                Mode::Terminal | Mode::Log => group_text(&described),
            },
            Err(error) if first => return Err(error.into()),
            Err(error) => {
                let failure = Failure::from(error);
                match mode {
                    Mode::JsonLines => {
                        serde_json::json!({ "error": failure.message() }).to_string()
                    }
                    Mode::Terminal | Mode::Log => {
                        format!("describe failed: {}; trying again\n", failure.message())
                    }
                }
            }
        };
        first = false;
        match write_frame(&frame(mode, prefix, group, args.interval, &body)) {
            Ok(()) => {}
            // The reader is gone (`--watch | head -n 1`): nobody is watching, end as Ctrl-C does.
            Err(error) if error.kind() == std::io::ErrorKind::BrokenPipe => {
                return Ok(String::new());
            }
            Err(error) => {
                return Err(Failure::Operation(format!(
                    "cannot write to standard output: {error}"
                )));
            }
        }
    }
}

/// One snapshot as written: on a terminal home + clear, a header and the view; otherwise the
/// header, the view and a blank line; JSON lines as they are.
fn frame(mode: Mode, prefix: &str, group: &str, interval: Duration, body: &str) -> String {
    if mode == Mode::JsonLines {
        return format!("{body}\n");
    }
    let header = format!(
        "every {}: group {group} of stream {prefix} at {}",
        humantime::format_duration(interval),
        humantime::format_rfc3339_seconds(SystemTime::now())
    );
    let mut text = String::with_capacity(body.len() + header.len() + 16);
    if mode == Mode::Terminal {
        text.push_str(HOME_AND_CLEAR);
    }
    text.push_str(&header);
    text.push_str("\n\n");
    text.push_str(body);
    if !body.ends_with('\n') {
        text.push('\n');
    }
    if mode == Mode::Log {
        text.push('\n');
    }
    text
}

/// Writes `frame` with one write and flushes it (no half-drawn screen).
fn write_frame(frame: &str) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(frame.as_bytes()).and_then(|()| out.flush())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intervals_below_the_minimum_are_refused() {
        assert_eq!(parse_interval("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_interval("100ms"), Ok(MIN_INTERVAL));
        let error = parse_interval("50ms").unwrap_err();
        assert_eq!(
            error,
            "must be at least 100ms (each snapshot reads every shard)"
        );
        assert!(parse_interval("soon").is_err());
    }

    #[test]
    fn a_terminal_frame_clears_first_and_a_log_frame_ends_with_a_blank_line() {
        let interval = Duration::from_secs(2);
        let terminal = frame(Mode::Terminal, "orders", "billing", interval, "view\n");
        assert!(terminal.starts_with("\x1b[H\x1b[2Jevery 2s: group billing of stream orders at "));
        assert!(terminal.ends_with("\n\nview\n"), "{terminal:?}");
        let log = frame(Mode::Log, "orders", "billing", interval, "view");
        assert!(log.starts_with("every 2s: group billing of stream orders at "));
        assert!(log.ends_with("\n\nview\n\n"), "{log:?}");
        assert_eq!(
            frame(Mode::JsonLines, "orders", "billing", interval, "{}"),
            "{}\n"
        );
    }
}
