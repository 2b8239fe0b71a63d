//! [`RedisServer`]: one throwaway `redis-server` process.

use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use tempfile::TempDir;

use super::HarnessError;
use super::binaries::Binary;
use super::ports::{self, PortLease};
use super::probe::{self, Reply, Transport};
use super::process::{self, Signal, SpawnSpec};
use super::tls::{TlsAuthClients, TlsMaterial};

/// How often a starting server is probed.
const POLL_INTERVAL: Duration = Duration::from_millis(20);
/// Timeout of one probe (connect, write, read).
const PROBE_TIMEOUT: Duration = Duration::from_millis(250);
/// How many log lines error messages carry.
const LOG_TAIL_LINES: usize = 30;
/// Name of the log file (the server's stdout and stderr) inside its directory.
const LOG_FILE: &str = "redis.log";
/// Name of a sentinel's configuration file inside its directory.
const SENTINEL_CONFIG_FILE: &str = "sentinel.conf";

/// When an append-only file is on, how often Redis calls `fsync` on it (`appendfsync`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Appendfsync {
    /// After every write command: a write acknowledged before a `SIGKILL` survives a restart.
    /// The harness's default, because tests assert exactly that.
    #[default]
    Always,
    /// Once per second (Redis's own default).
    EverySec,
    /// Whenever the OS flushes.
    No,
}

impl Appendfsync {
    fn as_str(self) -> &'static str {
        match self {
            Self::Always => "always",
            Self::EverySec => "everysec",
            Self::No => "no",
        }
    }
}

/// Options of a [`RedisServer`]; made by [`RedisServer::builder`], consumed by
/// [`start`](Self::start).
///
/// Defaults: no persistence (`--save "" --appendonly no`), a 10 s start timeout, 5 attempts at
/// finding a port `redis-server` can bind, and the binary from `STREAM_LISTENER_REDIS_SERVER` or
/// `PATH`.
#[derive(Debug, Clone)]
#[must_use = "call .start() to start the server"]
pub struct RedisServerBuilder {
    aof: bool,
    appendfsync: Appendfsync,
    config: Vec<(String, String)>,
    binary: Option<PathBuf>,
    start_timeout: Duration,
    port_attempts: u32,
    bus_port: bool,
    parent_dir: Option<PathBuf>,
    tls: Option<(Option<TlsMaterial>, TlsAuthClients)>,
    sentinel_config: Option<String>,
}

impl Default for RedisServerBuilder {
    fn default() -> Self {
        Self {
            aof: false,
            appendfsync: Appendfsync::default(),
            config: Vec::new(),
            binary: None,
            start_timeout: Duration::from_secs(10),
            port_attempts: 5,
            bus_port: false,
            parent_dir: None,
            tls: None,
            sentinel_config: None,
        }
    }
}

impl RedisServerBuilder {
    /// Turns the append-only file on (`--appendonly yes`, with [`appendfsync`](Self::appendfsync),
    /// `always` by default) or off (the default). With it on, data survives
    /// [`RedisServer::kill`] followed by [`RedisServer::restart`].
    pub fn aof(mut self, on: bool) -> Self {
        self.aof = on;
        self
    }

    /// Sets `appendfsync` for when the append-only file is on; ignored otherwise.
    pub fn appendfsync(mut self, policy: Appendfsync) -> Self {
        self.appendfsync = policy;
        self
    }

    /// Adds one configuration directive, passed as `--<name> <value>` after the harness's own
    /// (so it overrides them). Do not set `port`, `bind` or `dir`: the harness owns those.
    pub fn config(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.config.push((name.into(), value.into()));
        self
    }

    /// Runs this `redis-server` binary instead of the one from `STREAM_LISTENER_REDIS_SERVER` or
    /// `PATH`. A bare name is looked up on `PATH`.
    pub fn server_binary(mut self, path: impl Into<PathBuf>) -> Self {
        self.binary = Some(path.into());
        self
    }

    /// How long [`start`](Self::start) and [`RedisServer::restart`] wait for the server to answer
    /// `PING` (default 10 s).
    pub fn start_timeout(mut self, timeout: Duration) -> Self {
        self.start_timeout = timeout;
        self
    }

    /// How many ports are tried when `redis-server` fails to bind the one it was given because
    /// another process took it first (default 5; at least 1).
    pub fn port_attempts(mut self, attempts: u32) -> Self {
        self.port_attempts = attempts.max(1);
        self
    }

    /// Creates the server's temporary directory inside `parent` instead of the system's
    /// temporary directory (useful when the test process may be killed, which leaves the
    /// directory behind: put it in one the caller cleans up).
    pub fn temp_dir_in(mut self, parent: impl Into<PathBuf>) -> Self {
        self.parent_dir = Some(parent.into());
        self
    }

    /// Makes the server TLS-only: `--port 0`, `--tls-port` on the server's port, certificates
    /// made at start ([`TlsMaterial::generate`] in the server's directory, see
    /// [`RedisServer::tls`]), `--tls-auth-clients` from `auth`. [`RedisServer::url`] is then
    /// `rediss://127.0.0.1:<port>`, [`RedisServer::client`] trusts the CA and presents the client
    /// certificate, and the readiness probe speaks TLS.
    pub fn tls(mut self, auth: TlsAuthClients) -> Self {
        self.tls = Some((None, auth));
        self
    }

    /// As [`tls`](Self::tls) with certificates made beforehand (several servers of one CA: a
    /// cluster, a master and its replicas, sentinels).
    pub fn tls_material(mut self, material: TlsMaterial, auth: TlsAuthClients) -> Self {
        self.tls = Some((Some(material), auth));
        self
    }

    /// Reserves the cluster bus port (`port + 10000`) as well; used for cluster nodes.
    pub(crate) fn with_bus_port(mut self) -> Self {
        self.bus_port = true;
        self
    }

    /// Runs the process as a sentinel (`redis-server <dir>/sentinel.conf --sentinel`), the file
    /// holding `config` (Sentinel rewrites it as it learns the topology); used by
    /// [`super::RedisSentinel`].
    pub(crate) fn sentinel(mut self, config: String) -> Self {
        self.sentinel_config = Some(config);
        self
    }

    /// Starts the server on a free `127.0.0.1` port in a fresh temporary directory and waits until
    /// it answers `PING`. Blocks the calling thread (at most about `port_attempts` × the start
    /// timeout); calling it from inside a tokio runtime is fine in tests.
    ///
    /// # Errors
    ///
    /// - [`HarnessError::RedisNotInstalled`]: no `redis-server` binary;
    /// - [`HarnessError::PortsExhausted`]: no free port, or every port tried was taken by another
    ///   process before `redis-server` bound it;
    /// - [`HarnessError::StartTimeout`] / [`HarnessError::ServerExited`]: the server did not come
    ///   up (the error carries its log tail);
    /// - [`HarnessError::Tls`]: the TLS certificates could not be made;
    /// - [`HarnessError::Io`], [`HarnessError::Spawn`], [`HarnessError::SpawnerGone`].
    pub fn start(mut self) -> Result<RedisServer, HarnessError> {
        let binary = Binary::Server.resolve(self.binary.as_deref())?;
        let mut dir = tempfile::Builder::new();
        dir.prefix("stream-listener-redis-");
        let dir = match &self.parent_dir {
            Some(parent) => dir.tempdir_in(parent),
            None => dir.tempdir(),
        }
        .map_err(|e| HarnessError::io("cannot create a temporary directory", e))?;
        if let Some((material @ None, _)) = &mut self.tls {
            *material = Some(TlsMaterial::generate(dir.path())?);
        }
        let tls = self.tls.as_ref().and_then(|(m, _)| m.clone());
        let probe = match &tls {
            Some(material) => material.probe_config()?,
            None => Transport::Plain,
        };
        if let Some(config) = &self.sentinel_config {
            std::fs::write(dir.path().join(SENTINEL_CONFIG_FILE), config)
                .map_err(|e| HarnessError::io("cannot write the sentinel's configuration", e))?;
        }
        let lease = ports::lease(self.bus_port)?;
        let mut server = RedisServer {
            args: self.args(lease.port(), dir.path()),
            client: client(lease.port(), tls.as_ref())?,
            tls,
            probe,
            lease,
            binary,
            log_path: dir.path().join(LOG_FILE),
            child: None,
            start_timeout: self.start_timeout,
            dir,
        };
        for attempt in 1..=self.port_attempts {
            match server.launch() {
                Ok(()) => return Ok(server),
                Err(Launch::Failed(error)) => return Err(error),
                Err(Launch::PortTaken) if attempt < self.port_attempts => {
                    // Another process took the port first: move to a new one, same directory.
                    let lease = ports::lease(self.bus_port)?;
                    server.args = self.args(lease.port(), server.dir.path());
                    server.client = client(lease.port(), server.tls.as_ref())?;
                    server.lease = lease;
                }
                Err(Launch::PortTaken) => {}
            }
        }
        Err(HarnessError::PortsExhausted {
            attempts: self.port_attempts,
        })
    }

    fn args(&self, port: u16, dir: &Path) -> Vec<OsString> {
        let mut args: Vec<OsString> = Vec::new();
        if self.sentinel_config.is_some() {
            // The configuration file must come first; Sentinel needs it writable.
            args.push(dir.join(SENTINEL_CONFIG_FILE).into_os_string());
            args.push("--sentinel".into());
        }
        let mut push = |name: &str, value: &str| {
            args.push(format!("--{name}").into());
            args.push(value.into());
        };
        push("port", &port.to_string());
        push("bind", "127.0.0.1");
        push("daemonize", "no");
        push("save", "");
        push("appendonly", if self.aof { "yes" } else { "no" });
        if self.aof {
            push("appendfsync", self.appendfsync.as_str());
        }
        // Logs go to stdout, which the harness sends to the log file together with stderr (where
        // fatal configuration errors are printed before logging starts).
        push("logfile", "");
        args.push("--dir".into());
        args.push(dir.as_os_str().to_owned());
        if let Some((Some(material), auth)) = &self.tls {
            // After `--port <port>`: the last `--port` wins, the plain port is off.
            for (name, value) in material.server_args(port, *auth) {
                args.push(format!("--{name}").into());
                args.push(value.into());
            }
        }
        for (name, value) in &self.config {
            args.push(format!("--{name}").into());
            args.push(value.into());
        }
        args
    }
}

/// A throwaway `redis-server` on `127.0.0.1`, stopped (`SIGKILL`, then reaped) when dropped.
///
/// Made by [`RedisServer::start`] or [`RedisServer::builder`]. The server runs in its own
/// temporary directory (its `dir`, log file and append-only file), removed on drop. On Linux the
/// process also dies when the test process dies, even by `SIGKILL`.
///
/// Fault injection: [`pause`](Self::pause) / [`resume`](Self::resume) (`SIGSTOP` / `SIGCONT`),
/// [`kill`](Self::kill) (`SIGKILL`) and [`restart`](Self::restart) (same port, same directory).
#[derive(Debug)]
pub struct RedisServer {
    lease: PortLease,
    binary: PathBuf,
    args: Vec<OsString>,
    log_path: PathBuf,
    child: Option<Child>,
    client: redis::Client,
    start_timeout: Duration,
    tls: Option<TlsMaterial>,
    probe: Transport,
    // Declared last: dropped after `Drop::drop` has stopped the process.
    dir: TempDir,
}

/// Why one launch failed.
enum Launch {
    /// `redis-server` could not bind its port (or bus port): try another port.
    PortTaken,
    Failed(HarnessError),
}

impl RedisServer {
    /// Options for a server; see [`RedisServerBuilder`].
    pub fn builder() -> RedisServerBuilder {
        RedisServerBuilder::default()
    }

    /// Starts a server with the default options (no persistence).
    ///
    /// # Errors
    ///
    /// As [`RedisServerBuilder::start`].
    pub fn start() -> Result<Self, HarnessError> {
        Self::builder().start()
    }

    /// The TCP port on `127.0.0.1`. It stays the same across [`restart`](Self::restart).
    pub fn port(&self) -> u16 {
        self.lease.port()
    }

    /// `127.0.0.1:<port>`.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port())
    }

    /// `redis://127.0.0.1:<port>`, or `rediss://127.0.0.1:<port>` for a TLS server.
    pub fn url(&self) -> String {
        url(self.port(), self.tls.is_some())
    }

    /// The certificates of a TLS server ([`RedisServerBuilder::tls`]), `None` for a plain one.
    pub fn tls(&self) -> Option<&TlsMaterial> {
        self.tls.as_ref()
    }

    /// A redis-rs client for this server (cheap: it connects only when asked for a connection).
    /// For a TLS server it trusts the harness's CA and presents its client certificate.
    pub fn client(&self) -> redis::Client {
        self.client.clone()
    }

    /// The server's working directory (`dir`): its append-only file and log live here.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The log file: the server's stdout and stderr, appended across restarts.
    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// The last `lines` lines of the log (empty if it cannot be read).
    pub fn log_tail(&self, lines: usize) -> String {
        log_tail(&self.log_path, 0, lines)
    }

    /// The process id, or `None` after [`kill`](Self::kill).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Freezes the server with `SIGSTOP`: it keeps its port and accepts TCP connections (the
    /// kernel completes them) but answers nothing until [`resume`](Self::resume).
    ///
    /// # Errors
    ///
    /// [`HarnessError::NotRunning`] after [`kill`](Self::kill); [`HarnessError::Signal`] if the
    /// signal cannot be sent.
    pub fn pause(&self) -> Result<(), HarnessError> {
        self.signal(Signal::Stop)
    }

    /// Lets a paused server run again with `SIGCONT`; harmless on a running server.
    ///
    /// # Errors
    ///
    /// As [`pause`](Self::pause).
    pub fn resume(&self) -> Result<(), HarnessError> {
        self.signal(Signal::Cont)
    }

    /// Kills the server with `SIGKILL` and waits for it to exit: no shutdown, no final save, the
    /// port is free when this returns. Does nothing if the server is already killed. The
    /// directory is kept for [`restart`](Self::restart).
    ///
    /// # Errors
    ///
    /// [`HarnessError::Io`] if the process cannot be killed or reaped.
    pub fn kill(&mut self) -> Result<(), HarnessError> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        child
            .kill()
            .map_err(|e| HarnessError::io("cannot kill redis-server", e))?;
        child
            .wait()
            .map_err(|e| HarnessError::io("cannot reap redis-server", e))?;
        Ok(())
    }

    /// Starts the server again on the same port with the same options and directory (so an
    /// append-only file is replayed), and waits until it answers `PING` (the dataset is then
    /// loaded). A running server is killed first.
    ///
    /// # Errors
    ///
    /// [`HarnessError::PortTaken`] if another process took the port meanwhile;
    /// [`HarnessError::StartTimeout`] / [`HarnessError::ServerExited`] if it does not come up;
    /// [`HarnessError::Io`], [`HarnessError::Spawn`], [`HarnessError::SpawnerGone`].
    pub fn restart(&mut self) -> Result<(), HarnessError> {
        self.kill()?;
        match self.launch() {
            Ok(()) => Ok(()),
            Err(Launch::PortTaken) => Err(HarnessError::PortTaken {
                port: self.port(),
                log_tail: self.log_tail(LOG_TAIL_LINES),
            }),
            Err(Launch::Failed(error)) => Err(error),
        }
    }

    fn signal(&self, signal: Signal) -> Result<(), HarnessError> {
        let child = self
            .child
            .as_ref()
            .ok_or(HarnessError::NotRunning { port: self.port() })?;
        process::send_signal(child, signal)
    }

    /// Spawns the process and waits until it answers `PING` as itself.
    fn launch(&mut self) -> Result<(), Launch> {
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log_path)
            .map_err(|e| Launch::Failed(HarnessError::io("cannot open the redis log file", e)))?;
        let log_start = file_len(&log);
        let child = process::spawn(SpawnSpec {
            program: self.binary.clone(),
            args: self.args.clone(),
            cwd: self.dir.path().to_path_buf(),
            output: log,
        })
        .map_err(Launch::Failed)?;
        let pid = child.id();
        self.child = Some(child);
        let result = self.wait_ready(pid, log_start);
        if result.is_err() {
            // Never leave a half-started process behind.
            let _ = self.kill();
        }
        result
    }

    fn wait_ready(&mut self, pid: u32, log_start: u64) -> Result<(), Launch> {
        let port = self.port();
        let started = Instant::now();
        loop {
            let exited = match self.child.as_mut().map(Child::try_wait) {
                Some(Ok(status)) => status,
                Some(Err(e)) => {
                    return Err(Launch::Failed(HarnessError::io(
                        "cannot check on redis-server",
                        e,
                    )));
                }
                None => None,
            };
            if let Some(status) = exited {
                self.child = None;
                let tail = log_tail(&self.log_path, log_start, LOG_TAIL_LINES);
                if tail.contains("Address already in use") {
                    return Err(Launch::PortTaken);
                }
                return Err(Launch::Failed(HarnessError::ServerExited {
                    port,
                    status: status.to_string(),
                    log_tail: tail,
                }));
            }
            if self.answers_ping()
                // Make sure the answer came from our process, not from one that took the port.
                && let Ok(Reply::Bulk(Some(info))) = self.probe(&["INFO", "server"], PROBE_TIMEOUT)
            {
                if probe::info_field(&info, "process_id") == Some(pid.to_string().as_str()) {
                    return Ok(());
                }
                return Err(Launch::PortTaken);
            }
            if started.elapsed() >= self.start_timeout {
                return Err(Launch::Failed(HarnessError::StartTimeout {
                    port,
                    waited: started.elapsed(),
                    log_tail: log_tail(&self.log_path, log_start, LOG_TAIL_LINES),
                }));
            }
            std::thread::sleep(POLL_INTERVAL);
        }
    }
}

impl RedisServer {
    /// Whether the server answers `PING` with `PONG` right now (a loading server answers
    /// `-LOADING`).
    fn answers_ping(&self) -> bool {
        matches!(
            self.probe(&["PING"], PROBE_TIMEOUT),
            Ok(Reply::Simple(pong)) if pong == "PONG"
        )
    }

    /// One command on a fresh connection (over TLS for a TLS server), bounded by `timeout`.
    pub(crate) fn probe(&self, args: &[&str], timeout: Duration) -> std::io::Result<Reply> {
        probe::command_via(&self.probe, self.port(), args, timeout)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        // SIGKILL also ends a paused (SIGSTOPped) process.
        let _ = self.kill();
    }
}

fn client(port: u16, tls: Option<&TlsMaterial>) -> Result<redis::Client, HarnessError> {
    let error = |e| HarnessError::redis("cannot build a redis client", e);
    match tls {
        None => redis::Client::open(url(port, false)).map_err(error),
        Some(material) => {
            crate::connection::install_crypto_provider();
            redis::Client::build_with_tls(url(port, true), material.redis_certificates()?)
                .map_err(error)
        }
    }
}

fn url(port: u16, tls: bool) -> String {
    let scheme = if tls { "rediss" } else { "redis" };
    format!("{scheme}://127.0.0.1:{port}")
}

fn file_len(file: &File) -> u64 {
    file.metadata().map(|m| m.len()).unwrap_or(0)
}

/// The last `lines` lines of `path` from byte `from` on.
fn log_tail(path: &Path, from: u64, lines: usize) -> String {
    let Ok(bytes) = std::fs::read(path) else {
        return String::new();
    };
    let from = usize::try_from(from).unwrap_or(0).min(bytes.len());
    let text = String::from_utf8_lossy(&bytes[from..]);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
