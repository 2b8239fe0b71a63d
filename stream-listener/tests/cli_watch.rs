//! `stream-listener group describe --watch` (docs/design.md §13.5), run as a process against a
//! real Redis server with its output piped (not a terminal): snapshot after snapshot, each
//! followed by a blank line, reflecting changes made between them, until it is killed; and the
//! `--interval` checks.

use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::AsyncCommands;
use stream_listener::core::internals::admin;
use stream_listener::core::internals::connection::{RedisConnection, RedisTarget};
use stream_listener::core::model::StartFrom;
use stream_listener_core::testing::RedisServer;

const BIN: &str = env!("CARGO_BIN_EXE_stream-listener");

/// The snapshots in `output`: each starts with its header line.
fn snapshots(output: &str) -> Vec<&str> {
    output
        .split("every 200ms: group billing of stream orders at ")
        .skip(1)
        .collect()
}

/// (length, lag) of `shard` in a snapshot's shard table.
fn length_and_lag(snapshot: &str, shard: u32) -> Option<(String, String)> {
    snapshot.lines().find_map(|line| {
        let columns: Vec<&str> = line.split_whitespace().collect();
        (columns.len() >= 6 && columns[0] == shard.to_string() && columns[1] == "ACTIVE")
            .then(|| (columns[3].to_owned(), columns[5].to_owned()))
    })
}

/// Waits up to 10 s until `done` holds for the output so far; returns the output.
fn wait_for(output: &Mutex<String>, done: impl Fn(&str) -> bool) -> String {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let text = output.lock().unwrap().clone();
        if done(&text) || Instant::now() >= end {
            return text;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A fresh server with stream `orders` (2 shards) and group `billing`: the server, its URL and
/// a connection.
async fn orders_with_billing() -> (RedisServer, String, RedisConnection) {
    let server = RedisServer::start().unwrap();
    let url = server.url();
    let mut conn = RedisConnection::connect(
        &RedisTarget::standalone(url.clone()),
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    admin::create_stream(&mut conn, "orders", 2).await.unwrap();
    admin::register_group(&mut conn, "orders", "billing", StartFrom::Earliest)
        .await
        .unwrap();
    (server, url, conn)
}

/// `group describe orders billing --watch --interval 200ms` against `url`, its stdout collected
/// by a thread into the returned text until the process closes it.
fn watch_every_200ms(
    url: &str,
) -> (
    std::process::Child,
    Arc<Mutex<String>>,
    std::thread::JoinHandle<()>,
) {
    let mut child = Command::new(BIN)
        .args(["--redis-url", url, "group", "describe", "orders", "billing"])
        .args(["--watch", "--interval", "200ms"])
        .env_remove("REDIS_URL")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let output = Arc::new(Mutex::new(String::new()));
    let reader = {
        let output = output.clone();
        let mut stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = stdout.read(&mut buf) {
                if n == 0 {
                    break;
                }
                output
                    .lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        })
    };
    (child, output, reader)
}

#[tokio::test]
async fn watch_prints_snapshots_that_follow_the_group_until_killed() {
    let (_server, url, mut conn) = orders_with_billing().await;
    let _: String = conn.xadd("{orders:0}", "1-1", &[("n", "1")]).await.unwrap();

    let (mut child, output, reader) = watch_every_200ms(&url);
    // A snapshot is complete once the next one's header is out.
    let text = wait_for(&output, |t| snapshots(t).len() >= 2);
    let first = snapshots(&text)[0].to_owned();
    assert_eq!(
        length_and_lag(&first, 0),
        Some(("1".into(), "1".into())),
        "{first}"
    );
    assert!(
        first.ends_with("\n\n"),
        "a blank line after each snapshot: {first:?}"
    );
    assert!(
        !text.contains('\x1b'),
        "no terminal escapes when not a terminal"
    );
    // New entries between snapshots: a later snapshot shows them.
    for id in ["1-2", "1-3"] {
        let _: String = conn.xadd("{orders:0}", id, &[("n", id)]).await.unwrap();
    }
    let text = wait_for(&output, |t| {
        snapshots(t)
            .iter()
            .any(|s| length_and_lag(s, 0) == Some(("3".into(), "3".into())))
    });
    child.kill().unwrap();
    child.wait().unwrap();
    reader.join().unwrap();
    let all = snapshots(&text);
    let changed = all
        .iter()
        .position(|s| length_and_lag(s, 0) == Some(("3".into(), "3".into())));
    assert!(
        changed.is_some_and(|i| i >= 1),
        "a snapshot after the first shows the new entries: {text}"
    );
    // Every snapshot before the change shows the old values: each is a fresh read.
    for snapshot in &all[..changed.unwrap()] {
        assert_eq!(length_and_lag(snapshot, 0), Some(("1".into(), "1".into())));
    }
}

#[test]
fn watch_intervals_are_checked() {
    let run = |args: &[&str]| {
        let output = Command::new(BIN)
            .args([
                "--redis-url",
                "redis://127.0.0.1:1",
                "group",
                "describe",
                "orders",
                "billing",
            ])
            .args(args)
            .env_remove("REDIS_URL")
            .output()
            .unwrap();
        (
            output.status.code(),
            String::from_utf8(output.stderr).unwrap(),
        )
    };
    let (code, err) = run(&["--watch", "--interval", "50ms"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("must be at least 100ms"), "{err}");
    let (code, err) = run(&["--interval", "1s"]);
    assert_eq!(code, Some(2), "--interval without --watch: {err}");
    assert!(err.contains("--watch"), "{err}");
}

/// `--watch | head -n 1`: when the reader closes the pipe, the watch ends quietly and
/// successfully, as `watch` or `tail -f` do, instead of failing with "Broken pipe".
#[tokio::test]
async fn watch_ends_quietly_when_the_reader_closes_the_pipe() {
    use std::io::BufRead;

    let (_server, url, _conn) = orders_with_billing().await;

    let mut child = Command::new(BIN)
        .args(["--redis-url", &url, "--json", "group", "describe"])
        .args(["orders", "billing", "--watch", "--interval", "100ms"])
        .env_remove("REDIS_URL")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    stdout.read_line(&mut first).unwrap();
    assert!(
        first.starts_with(r#"{"streamPrefix":"orders","consumerGroup":"billing""#),
        "{first}"
    );
    drop(stdout); // the reader is gone: the next snapshot's write gets EPIPE
    let end = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() >= end {
            child.kill().unwrap();
            panic!("the watch kept running after its reader closed the pipe");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert_eq!((status.code(), stderr.as_str()), (Some(0), ""));
}

/// Ctrl-C (SIGINT) while a snapshot waits for a frozen Redis ends the watch at once, with exit
/// code 0 and no failure frame. Before the fix the interrupt was only looked at between
/// snapshots: the process went on waiting for the read until Redis' response timeout (5 s),
/// then printed "describe failed: ... timed out" before it exited.
#[tokio::test]
async fn ctrl_c_while_redis_is_frozen_ends_the_watch_at_once() {
    let (server, url, _conn) = orders_with_billing().await;
    let (mut child, output, reader) = watch_every_200ms(&url);
    let text = wait_for(&output, |t| snapshots(t).len() >= 2);
    assert!(snapshots(&text).len() >= 2, "{text}");
    server.pause().unwrap();
    // Past the next tick: a snapshot is waiting for Redis now.
    std::thread::sleep(Duration::from_millis(600));
    let interrupted = Instant::now();
    let killed = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if interrupted.elapsed() > Duration::from_secs(10) {
            child.kill().unwrap();
            break child.wait().unwrap();
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let took = interrupted.elapsed();
    server.resume().unwrap();
    reader.join().unwrap();
    let text = output.lock().unwrap().clone();
    assert_eq!(status.code(), Some(0), "{text}");
    assert!(
        took < Duration::from_secs(2),
        "exited {took:?} after SIGINT"
    );
    assert!(!text.contains("describe failed"), "{text}");
}
