//! Shared helpers of the fault-injection suite (`tests/fault_*.rs`): the workload program
//! (`examples/workload.rs`) built once and run as real OS processes, signals to them, bounded
//! waits, and the log [`checker`].
//!
//! Times are wall-clock µs since the Unix epoch ([`now_us`]), as in the workload's log lines, so
//! the test's own instants (when it sent a signal) compare with the processes' lines.

#![allow(dead_code)]

pub mod checker;

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use checker::{LogLine, ProcessLog};

/// Protocol timings of the suite: heartbeat 200 ms, lease 1.5 s, rebalance timeout 3 s.
pub const HEARTBEAT_MS: u64 = 200;
pub const LEASE_MS: u64 = 1500;
pub const REBALANCE_MS: u64 = 3000;

/// Wall-clock µs since the Unix epoch.
pub fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// The scenarios start several processes with short leases: run one at a time, so that they do
/// not starve each other of CPU (a starved member misses its lease).
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The `workload` example's executable, built once per test binary with the same cargo that runs
/// the tests: `cargo build --workspace --example workload`, so cargo decides whether it is up to
/// date. `--workspace` resolves features as `cargo test --workspace` does, which has already
/// built the example: the build is then a no-op (without it, a clean tree would compile a second
/// variant of the example and its dependencies). The path is the one cargo reports, so
/// `CARGO_TARGET_DIR` works.
pub fn workload_binary() -> &'static str {
    static PATH: OnceLock<String> = OnceLock::new();
    PATH.get_or_init(|| {
        let output = Command::new(env!("CARGO"))
            .args([
                "build",
                "--workspace",
                "--example",
                "workload",
                "--message-format=json-render-diagnostics",
            ])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .stderr(Stdio::inherit())
            .output()
            .expect("cargo runs");
        assert!(
            output.status.success(),
            "building examples/workload.rs failed"
        );
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
            .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == "workload")
            .find_map(|m| m["executable"].as_str().map(str::to_owned))
            .expect("cargo reports the workload executable")
    })
}

/// Polls `done` every 50 ms until it holds or `deadline` passes; returns its last value. (Not
/// faster: the conditions scan the logs, and the test shares the CPU with the processes it
/// watches. Measured times come from the logs' timestamps, not from polling.)
pub fn wait_until(deadline: Duration, mut done: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + deadline;
    while Instant::now() < end {
        if done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    done()
}

/// Runs one future to completion on a throwaway runtime (admin calls from synchronous tests).
pub fn block_on<F: std::future::Future>(future: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
        .block_on(future)
}

/// Lines a child wrote, filled by a reader thread.
#[derive(Debug, Default)]
struct Captured {
    lines: Vec<LogLine>,
    bad: Vec<String>,
    raw: Vec<String>,
}

/// A `workload` child process (consumer or producer). Its stdout is parsed line by line by a
/// reader thread, its stderr kept for diagnostics. Killed (`SIGCONT` then `SIGKILL`) when dropped.
pub struct Workload {
    pub name: String,
    child: Child,
    /// Closing it makes a consumer started with `--exit-on-stdin-close` shut down.
    stdin: Option<ChildStdin>,
    stdout: Arc<Mutex<Captured>>,
    stderr: Arc<Mutex<Vec<String>>>,
    readers: Vec<JoinHandle<()>>,
    exit: Option<ExitStatus>,
}

impl Workload {
    /// Starts `workload --redis-url <url> <args...>`.
    pub fn spawn(name: &str, url: &str, args: &[String]) -> Workload {
        let mut child = Command::new(workload_binary())
            .arg("--redis-url")
            .arg(url)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the workload example starts");
        let stdout = Arc::new(Mutex::new(Captured::default()));
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let out_pipe = child.stdout.take().expect("piped stdout");
        let err_pipe = child.stderr.take().expect("piped stderr");
        let out_reader = {
            let stdout = stdout.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(out_pipe).lines() {
                    let Ok(line) = line else { break };
                    let mut captured = stdout.lock().unwrap();
                    match LogLine::parse(&line) {
                        Ok(parsed) => captured.lines.push(parsed),
                        Err(error) => captured.bad.push(error),
                    }
                    captured.raw.push(line);
                }
            })
        };
        let err_reader = {
            let stderr = stderr.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(err_pipe).lines() {
                    let Ok(line) = line else { break };
                    stderr.lock().unwrap().push(line);
                }
            })
        };
        let stdin = child.stdin.take();
        Workload {
            name: name.to_owned(),
            child,
            stdin,
            stdout,
            stderr,
            readers: vec![out_reader, err_reader],
            exit: None,
        }
    }

    /// A `workload consume` process with the suite's timings (`extra` is appended).
    pub fn consumer(name: &str, url: &str, concurrency: u32, extra: &[&str]) -> Workload {
        let mut args: Vec<String> = [
            "consume",
            "--stream",
            STREAM,
            "--group",
            GROUP,
            "--heartbeat-ms",
            &HEARTBEAT_MS.to_string(),
            "--lease-ms",
            &LEASE_MS.to_string(),
            "--rebalance-ms",
            &REBALANCE_MS.to_string(),
            "--concurrency",
            &concurrency.to_string(),
            "--batch-size",
            "16",
            "--block-ms",
            "500",
            "--backoff-ms",
            "20",
            "--handler-timeout-ms",
            "2000",
            "--shutdown-timeout-ms",
            "3000",
            "--shards",
            &SHARDS.to_string(),
            "--exit-on-stdin-close",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        Workload::spawn(name, url, &args)
    }

    /// A `workload produce` process.
    pub fn producer(url: &str, keys: u64, count: u64, rate: u64) -> Workload {
        let args: Vec<String> = [
            "produce",
            "--stream",
            STREAM,
            "--keys",
            &keys.to_string(),
            "--count",
            &count.to_string(),
            "--rate",
            &rate.to_string(),
            "--shards",
            &SHARDS.to_string(),
            "--batch",
            "32",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        Workload::spawn("producer", url, &args)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends `signal` (`STOP`, `CONT`, `TERM`, `KILL`) with `kill(1)`.
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .arg("-s")
            .arg(signal)
            .arg(self.pid().to_string())
            .status()
            .expect("kill(1) runs");
        assert!(status.success(), "kill -s {signal} {} failed", self.pid());
    }

    /// `kill -9`, and waits until the process is gone and its output read.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        self.exit = self.child.wait().ok();
        self.join_readers();
    }

    /// Whether the process has exited (reaps it).
    pub fn exited(&mut self) -> bool {
        if self.exit.is_none() {
            self.exit = self.child.try_wait().ok().flatten();
        }
        self.exit.is_some()
    }

    /// Waits for the process to exit by itself, at most `deadline`; its exit status.
    pub fn wait_exit(&mut self, deadline: Duration) -> Option<ExitStatus> {
        let exited = wait_until(deadline, || self.exited());
        if exited {
            self.join_readers();
        }
        self.exit
    }

    /// `SIGTERM` (graceful: drain, ack, leave) and waits for the exit, at most `deadline`.
    /// Panics with the process's stderr if it does not exit successfully in time.
    pub fn terminate(&mut self, deadline: Duration) {
        if !self.exited() {
            self.signal("TERM");
        }
        let status = self.wait_exit(deadline);
        assert!(
            status.is_some_and(|s| s.success()),
            "{} did not shut down cleanly within {deadline:?} after SIGTERM (status {status:?}); stderr:\n{}",
            self.name,
            self.stderr_text()
        );
    }

    fn join_readers(&mut self) {
        self.stdin.take();
        for reader in self.readers.drain(..) {
            let _ = reader.join();
        }
    }

    /// The parsed lines so far.
    pub fn lines(&self) -> Vec<LogLine> {
        self.stdout.lock().unwrap().lines.clone()
    }

    /// Number of lines so far.
    pub fn line_count(&self) -> usize {
        self.stdout.lock().unwrap().raw.len()
    }

    /// The raw stdout lines so far.
    pub fn raw_lines(&self) -> Vec<String> {
        self.stdout.lock().unwrap().raw.clone()
    }

    pub fn stderr_text(&self) -> String {
        self.stderr.lock().unwrap().join("\n")
    }

    /// The log for the checker (complete once the process has exited).
    pub fn log(&self) -> ProcessLog {
        let captured = self.stdout.lock().unwrap();
        ProcessLog {
            name: self.name.clone(),
            lines: captured.lines.clone(),
            bad_lines: captured.bad.clone(),
        }
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        if !self.exited() {
            let _ = Command::new("kill")
                .args(["-s", "CONT", &self.pid().to_string()])
                .status();
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Stream, group and shard count of every scenario (each runs its own Redis).
pub const STREAM: &str = "orders";
pub const GROUP: &str = "g";
pub const SHARDS: u32 = 8;

/// The shards each member owns now according to `lines` (assigned and not revoked since).
pub fn owned_now(lines: &[LogLine]) -> std::collections::BTreeMap<u32, String> {
    let mut owned = std::collections::BTreeMap::new();
    for line in lines {
        match line {
            LogLine::Assigned(o) => {
                owned.insert(o.shard, o.member.clone());
            }
            LogLine::Revoked(o) if owned.get(&o.shard) == Some(&o.member) => {
                owned.remove(&o.shard);
            }
            _ => {}
        }
    }
    owned
}

/// Waits until the live processes `procs` together own every shard, each process at least one,
/// and nothing has changed hands for `quiet`. Panics after `deadline`.
pub fn wait_settled(procs: &[&Workload], deadline: Duration, quiet: Duration) {
    let mut last_change = Instant::now();
    let mut last: Vec<std::collections::BTreeMap<u32, String>> = Vec::new();
    let settled = wait_until(deadline, || {
        let owned: Vec<_> = procs.iter().map(|p| owned_now(&p.lines())).collect();
        if owned != last {
            last = owned.clone();
            last_change = Instant::now();
        }
        let total: usize = owned.iter().map(|o| o.len()).sum();
        let shards: std::collections::BTreeSet<u32> =
            owned.iter().flat_map(|o| o.keys().copied()).collect();
        total == SHARDS as usize
            && shards.len() == SHARDS as usize
            && owned.iter().all(|o| !o.is_empty())
            && last_change.elapsed() >= quiet
    });
    assert!(
        settled,
        "the consumers did not settle within {deadline:?}: {:?}; stderr: {}",
        last,
        procs
            .iter()
            .map(|p| format!("{}: {}", p.name, p.stderr_text()))
            .collect::<Vec<_>>()
            .join(" | ")
    );
}

/// Distinct produced messages with an ok handled line in `procs`' logs so far.
pub fn handled_ok(procs: &[&Workload]) -> usize {
    let mut done = std::collections::HashSet::new();
    for p in procs {
        for line in p.lines() {
            if let LogLine::Handled(h) = line
                && h.ok
                && let (Some(k), Some(s)) = (h.key, h.seq)
            {
                done.insert((k, s));
            }
        }
    }
    done.len()
}

/// The earliest read of `shard` by any member of `procs` at or after `since_us`.
pub fn first_read_since(procs: &[&Workload], shard: u32, since_us: u64) -> Option<(u64, String)> {
    procs
        .iter()
        .flat_map(|p| p.lines())
        .filter_map(|line| match line {
            LogLine::Read(r) if r.shard == shard && r.ts_us >= since_us => {
                Some((r.ts_us, r.member))
            }
            _ => None,
        })
        .min()
}

/// Creates the suite's stream (`SHARDS` shards) on the server at `url`.
pub fn create_stream(url: &str) {
    use stream_listener::core::admin;
    use stream_listener::core::connection::{RedisConnection, RedisTarget};
    block_on(async {
        let mut conn = RedisConnection::connect(
            &RedisTarget::Standalone(url.to_owned()),
            Duration::from_secs(5),
        )
        .await
        .expect("connect to Redis");
        admin::create_stream(&mut conn, STREAM, SHARDS)
            .await
            .expect("create the stream");
    });
}

/// An `XRANGE` entry: id and fields.
type StreamEntry = (String, Vec<(String, Vec<u8>)>);

/// For messages that no consumer handled: where they are in Redis (entry id, shard, pending or
/// not, the group's last delivered id), for failure messages.
pub fn diagnose_missing(url: &str, missing: &[(String, u64)]) -> String {
    let mut out = String::new();
    let Ok(client) = redis::Client::open(url) else {
        return "cannot open a Redis client".into();
    };
    let Ok(mut conn) = client.get_connection() else {
        return "cannot connect to Redis".into();
    };
    for shard in 0..SHARDS {
        let key = format!("{{{STREAM}:{shard}}}");
        let entries: Vec<StreamEntry> = redis::cmd("XRANGE")
            .arg(&key)
            .arg("-")
            .arg("+")
            .query(&mut conn)
            .unwrap_or_default();
        let groups: redis::Value = redis::cmd("XINFO")
            .arg("GROUPS")
            .arg(&key)
            .query(&mut conn)
            .unwrap_or(redis::Value::Nil);
        for (id, fields) in &entries {
            let payload = fields
                .iter()
                .find(|(name, _)| name == "payload")
                .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
                .unwrap_or_default();
            let Ok(value) = serde_json::from_str::<serde_json::Value>(&payload) else {
                continue;
            };
            let message = (
                value["key"].as_str().unwrap_or_default().to_owned(),
                value["seq"].as_u64().unwrap_or(u64::MAX),
            );
            if missing.contains(&message) {
                let pending: redis::Value = redis::cmd("XPENDING")
                    .arg(&key)
                    .arg(GROUP)
                    .arg(id)
                    .arg(id)
                    .arg(1)
                    .query(&mut conn)
                    .unwrap_or(redis::Value::Nil);
                out.push_str(&format!(
                    "\n{}#{} is entry {id} of {key}; pending: {pending:?}; groups: {groups:?}",
                    message.0, message.1
                ));
            }
        }
    }
    if out.is_empty() {
        out = format!("none of {missing:?} is in any shard stream (never appended?)");
    }
    out
}

/// Produced messages without an ok handled line in `procs`' logs.
pub fn missing_messages(procs: &[&Workload], expected: checker::Expected) -> Vec<(String, u64)> {
    let mut done = std::collections::HashSet::new();
    for p in procs {
        for line in p.lines() {
            if let LogLine::Handled(h) = line
                && h.ok
                && let (Some(k), Some(s)) = (h.key, h.seq)
            {
                done.insert((k, s));
            }
        }
    }
    expected.messages().filter(|m| !done.contains(m)).collect()
}

/// Writes every process's raw stdout and stderr to a fresh directory under the system temp
/// directory, for a failing run's post-mortem; returns the directory.
pub fn save_logs(scenario: &str, procs: &[&Workload]) -> String {
    let dir = std::env::temp_dir().join(format!(
        "fault-logs-{scenario}-{}-{}",
        std::process::id(),
        now_us()
    ));
    if std::fs::create_dir_all(&dir).is_err() {
        return "(could not create a log directory)".into();
    }
    for p in procs {
        let _ = std::fs::write(
            dir.join(format!("{}.jsonl", p.name)),
            p.raw_lines().join("\n") + "\n",
        );
        let _ = std::fs::write(dir.join(format!("{}.stderr", p.name)), p.stderr_text());
    }
    dir.display().to_string()
}

/// Entries pending in the group's PEL, per shard (`XPENDING <shard> <group>` count).
pub fn pending_per_shard(url: &str) -> Result<Vec<u64>, String> {
    let client = redis::Client::open(url).map_err(|e| e.to_string())?;
    let mut conn = client.get_connection().map_err(|e| e.to_string())?;
    (0..SHARDS)
        .map(|shard| {
            let summary: redis::Value = redis::cmd("XPENDING")
                .arg(format!("{{{STREAM}:{shard}}}"))
                .arg(GROUP)
                .query(&mut conn)
                .map_err(|e| e.to_string())?;
            match summary {
                redis::Value::Array(items) => match items.first() {
                    Some(redis::Value::Int(n)) => Ok(u64::try_from(*n).unwrap_or(0)),
                    other => Err(format!("unexpected XPENDING summary {other:?}")),
                },
                other => Err(format!("unexpected XPENDING reply {other:?}")),
            }
        })
        .collect()
}

/// Up to 20 pending entries per shard: (shard, entry id, consumer, delivery count).
pub fn pending_entries(url: &str) -> Vec<(u32, String, String, u64)> {
    let Ok(client) = redis::Client::open(url) else {
        return Vec::new();
    };
    let Ok(mut conn) = client.get_connection() else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for shard in 0..SHARDS {
        let rows: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
            .arg(format!("{{{STREAM}:{shard}}}"))
            .arg(GROUP)
            .arg("-")
            .arg("+")
            .arg(20)
            .query(&mut conn)
            .unwrap_or_default();
        out.extend(
            rows.into_iter()
                .map(|(id, consumer, _idle, count)| (shard, id, consumer, count)),
        );
    }
    out
}

/// What the logs of `procs` say about entry `id` of `shard`: its handled and read lines.
pub fn entry_history(procs: &[&Workload], shard: u32, id: &str) -> Vec<String> {
    let mut out = Vec::new();
    for p in procs {
        for line in p.lines() {
            match &line {
                LogLine::Handled(h) if h.shard == shard && h.entry_id == id => {
                    out.push(format!("{}: {line:?}", p.name));
                }
                LogLine::Read(r) if r.shard == shard && r.first_id.as_str() <= id => {
                    // Only the last read at or before the id is interesting; keep them all
                    // and trim below.
                    out.push(format!("{}: {line:?}", p.name));
                }
                _ => {}
            }
        }
    }
    // The reads that may have returned the entry: the last few before it.
    let reads: Vec<String> = out
        .iter()
        .filter(|l| l.contains("Read("))
        .cloned()
        .collect();
    let mut kept: Vec<String> = out.into_iter().filter(|l| !l.contains("Read(")).collect();
    kept.extend(reads.into_iter().rev().take(2));
    kept
}
