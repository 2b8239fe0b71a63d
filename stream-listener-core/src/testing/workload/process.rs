//! A `workload` child process with its stdout parsed as it comes, and what its log says so far.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::log::{LogLine, ProcessLog};
use super::poll_until;

/// What a child wrote: its stdout parsed and raw, its stderr.
#[derive(Debug, Default)]
struct Captured {
    log: ProcessLog,
    raw: Vec<String>,
    stderr: Vec<String>,
}

/// A `workload` child process (consumer or producer). Its stdout is parsed line by line by a
/// reader thread, its stderr kept for diagnostics. Killed (`SIGCONT` then `SIGKILL`) when dropped.
#[derive(Debug)]
pub struct Workload {
    /// A name for messages and log files (`consumer-1`).
    pub name: String,
    child: Child,
    /// Closing it makes a consumer started with `--exit-on-stdin-close` shut down.
    stdin: Option<ChildStdin>,
    captured: Arc<Mutex<Captured>>,
    readers: Vec<JoinHandle<()>>,
    exit: Option<ExitStatus>,
}

impl Workload {
    /// Starts `binary --redis-url <url> <args...>`.
    ///
    /// # Panics
    ///
    /// When the program cannot be started.
    pub fn spawn(binary: &Path, name: &str, url: &str, args: &[String]) -> Workload {
        Workload::spawn_observed(binary, name, url, args, |_| {})
    }

    /// As [`spawn`](Self::spawn), and `observer` sees every line that parses as it is read (on
    /// the reader thread), for a caller that merges the child's log into its own records.
    ///
    /// # Panics
    ///
    /// When the program cannot be started.
    pub fn spawn_observed(
        binary: &Path,
        name: &str,
        url: &str,
        args: &[String],
        observer: impl Fn(&LogLine) + Send + 'static,
    ) -> Workload {
        let mut child = Command::new(binary)
            .arg("--redis-url")
            .arg(url)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the workload example starts");
        let captured = Arc::new(Mutex::new(Captured {
            log: ProcessLog {
                name: name.to_owned(),
                ..ProcessLog::default()
            },
            ..Captured::default()
        }));
        let out_pipe = child.stdout.take().expect("piped stdout");
        let err_pipe = child.stderr.take().expect("piped stderr");
        let out_reader = {
            let captured = captured.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(out_pipe).lines().map_while(Result::ok) {
                    let parsed = LogLine::parse(&line);
                    if let Ok(parsed) = &parsed {
                        observer(parsed);
                    }
                    let mut captured = lock(&captured);
                    match parsed {
                        Ok(parsed) => captured.log.lines.push(parsed),
                        Err(error) => captured.log.bad_lines.push(error),
                    }
                    captured.raw.push(line);
                }
            })
        };
        let err_reader = {
            let captured = captured.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(err_pipe).lines().map_while(Result::ok) {
                    lock(&captured).stderr.push(line);
                }
            })
        };
        Workload {
            name: name.to_owned(),
            stdin: child.stdin.take(),
            child,
            captured,
            readers: vec![out_reader, err_reader],
            exit: None,
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends `signal` (`STOP`, `CONT`, `TERM`, `KILL`) with `kill(1)`.
    ///
    /// # Panics
    ///
    /// When `kill(1)` fails (the process is gone).
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
        if poll_until(deadline, || self.exited()) {
            self.join_readers();
        }
        self.exit
    }

    /// `SIGTERM` (graceful: drain, ack, leave) unless it has exited, and waits for the exit at
    /// most `deadline`, then `kill -9`. The status of an exit in time.
    pub fn stop(&mut self, deadline: Duration) -> Option<ExitStatus> {
        if !self.exited() {
            self.signal("TERM");
        }
        let status = self.wait_exit(deadline);
        if status.is_none() {
            self.kill9();
        }
        status
    }

    /// As [`stop`](Self::stop), and panics with the process's stderr unless it exited
    /// successfully in time.
    #[track_caller]
    pub fn terminate(&mut self, deadline: Duration) {
        let status = self.stop(deadline);
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
        lock(&self.captured).log.lines.clone()
    }

    /// Number of stdout lines so far.
    pub fn line_count(&self) -> usize {
        lock(&self.captured).raw.len()
    }

    /// The raw stdout lines so far.
    pub fn raw_lines(&self) -> Vec<String> {
        lock(&self.captured).raw.clone()
    }

    /// The stderr lines so far, one string.
    pub fn stderr_text(&self) -> String {
        lock(&self.captured).stderr.join("\n")
    }

    /// The log for the checker (complete once the process has exited).
    pub fn log(&self) -> ProcessLog {
        lock(&self.captured).log.clone()
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

fn lock(captured: &Mutex<Captured>) -> std::sync::MutexGuard<'_, Captured> {
    captured
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The shards each member owned just before `before_us` according to `lines` (assigned and not
/// revoked since); `u64::MAX` for now.
pub fn owned_before(lines: &[LogLine], before_us: u64) -> BTreeMap<u32, String> {
    let mut owned = BTreeMap::new();
    for line in lines {
        match line {
            LogLine::Assigned(o) if o.ts_us < before_us => {
                owned.insert(o.shard, o.member.clone());
            }
            LogLine::Revoked(o)
                if o.ts_us < before_us && owned.get(&o.shard) == Some(&o.member) =>
            {
                owned.remove(&o.shard);
            }
            _ => {}
        }
    }
    owned
}

/// Distinct produced `(key, seq)` with an ok handled line in `procs`' logs so far.
pub fn handled_messages(procs: &[&Workload]) -> BTreeSet<(String, u64)> {
    let mut done = BTreeSet::new();
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
    done
}

/// The earliest read of `shard` by any member of `procs` at or after `since_us`: (µs, member).
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
