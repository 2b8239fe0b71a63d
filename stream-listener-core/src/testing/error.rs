//! The harness's error type.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

/// What can go wrong while starting, driving or stopping throwaway Redis processes.
///
/// Every fallible function of [`crate::testing`] returns this type; the harness never panics.
/// Variants that concern a running or starting server carry the tail of its log (`log_tail`, the
/// last lines of the file `redis-server` wrote to), so a failing test shows why Redis misbehaved.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum HarnessError {
    /// A Redis binary (`redis-server` or `redis-cli`) was not found: not on `PATH`, or the
    /// override (builder option or environment variable) names a file that does not exist.
    ///
    /// Returned by [`RedisServerBuilder::start`](super::RedisServerBuilder::start) and
    /// [`RedisClusterBuilder::start`](super::RedisClusterBuilder::start).
    #[error(
        "`{binary}` not found (looked for {looked_for}); the tests need Redis >= 7.0 installed: \
         `sudo apt-get install redis-server redis-tools` (Debian/Ubuntu) or `brew install redis` \
         (macOS), with `redis-server` and `redis-cli` on PATH, or set {env_var} to the binary's path"
    )]
    RedisNotInstalled {
        /// The binary that is missing: `redis-server` or `redis-cli`.
        binary: &'static str,
        /// Where the harness looked: the override path, or `PATH`.
        looked_for: String,
        /// The environment variable that overrides the binary's path.
        env_var: &'static str,
    },

    /// No usable loopback port was found: every candidate was taken, or `redis-server` failed to
    /// bind each port it was given (another process won the race each time).
    #[error("no free loopback port for redis-server after {attempts} attempts")]
    PortsExhausted {
        /// How many ports were tried.
        attempts: u32,
    },

    /// `redis-server` did not answer `PING` within the start timeout.
    #[error(
        "redis-server on port {port} did not answer PING within {waited:?}; log tail:\n{log_tail}"
    )]
    StartTimeout {
        /// The server's TCP port.
        port: u16,
        /// How long the harness waited.
        waited: Duration,
        /// The last lines of the server's log.
        log_tail: String,
    },

    /// `redis-server` exited while starting, for a reason other than a taken port (which is
    /// retried on another port).
    #[error("redis-server on port {port} exited while starting ({status}); log tail:\n{log_tail}")]
    ServerExited {
        /// The server's TCP port.
        port: u16,
        /// The exit status, as printed by the OS.
        status: String,
        /// The last lines of the server's log.
        log_tail: String,
    },

    /// A port given to [`restart`](super::RedisServer::restart) is now taken by another process,
    /// so the server cannot come back on the same port.
    #[error("redis-server cannot restart on port {port}: the port is taken; log tail:\n{log_tail}")]
    PortTaken {
        /// The server's TCP port.
        port: u16,
        /// The last lines of the server's log.
        log_tail: String,
    },

    /// `redis-cli --cluster create` failed or did not finish in time.
    #[error("`redis-cli --cluster create` failed ({status}); output:\n{output}")]
    ClusterCreate {
        /// The exit status, or `timed out`.
        status: String,
        /// What `redis-cli` printed.
        output: String,
    },

    /// The cluster did not reach `cluster_state:ok` with all 16384 slots covered and every node
    /// known to every node within the timeout.
    #[error("redis cluster not ready after {waited:?}: {detail}")]
    ClusterNotReady {
        /// How long the harness waited.
        waited: Duration,
        /// The last `CLUSTER INFO` mismatch or error seen.
        detail: String,
    },

    /// The server was killed (and not restarted), so it cannot be paused or resumed.
    #[error("redis-server on port {port} is not running")]
    NotRunning {
        /// The server's TCP port.
        port: u16,
    },

    /// A cluster node index was out of range.
    #[error("no cluster node {index}: the cluster has {count} nodes")]
    NoSuchNode {
        /// The index asked for.
        index: usize,
        /// The number of nodes.
        count: usize,
    },

    /// Spawning a process failed (other than a missing binary).
    #[error("cannot spawn {}", program.display())]
    Spawn {
        /// The program that failed to start.
        program: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },

    /// The harness's spawner thread is gone (it panicked or could not be started).
    #[error("the harness's spawner thread is not running")]
    SpawnerGone,

    /// Sending a signal to a Redis process failed.
    #[error("cannot send {signal} to process {pid}")]
    Signal {
        /// The signal's name, e.g. `SIGSTOP`.
        signal: &'static str,
        /// The target process id.
        pid: u32,
        /// The OS error.
        #[source]
        source: io::Error,
    },

    /// A file-system or process operation of the harness failed.
    #[error("{context}")]
    Io {
        /// What the harness was doing.
        context: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },

    /// A Redis command issued by the harness itself failed.
    #[error("{context}")]
    Redis {
        /// What the harness was doing.
        context: String,
        /// The client's error.
        #[source]
        source: redis::RedisError,
    },

    /// Making the test certificates ([`TlsMaterial::generate`](super::TlsMaterial::generate)) or
    /// the TLS probe's client configuration failed.
    #[error("cannot set up TLS for the test servers: {context}: {detail}")]
    Tls {
        /// What the harness was doing.
        context: String,
        /// The certificate generator's or rustls's error.
        detail: String,
    },

    /// A [`RedisSentinel`](super::RedisSentinel) setup did not reach the state waited for in
    /// time: at start, every sentinel seeing the master, the replica and the other sentinels; in
    /// [`wait_for_failover`](super::RedisSentinel::wait_for_failover), every live sentinel naming
    /// a new master that answers as master.
    #[error("redis sentinel setup not ready after {waited:?}: {detail}")]
    SentinelNotReady {
        /// How long the harness waited.
        waited: Duration,
        /// The last mismatch or error seen.
        detail: String,
    },

    /// A cluster node answered a harness command with a reply the harness cannot use: `CLUSTER
    /// FAILOVER` refused (sent to a master: `-ERR You should send CLUSTER FAILOVER to a
    /// replica`), or an `INFO replication` / `CLUSTER NODES` reply without the expected fields.
    #[error("cluster node {index} answered `{command}` with {reply}")]
    UnexpectedReply {
        /// The node's index in the cluster.
        index: usize,
        /// The command sent.
        command: String,
        /// The reply, as the harness read it.
        reply: String,
    },
}

crate::report::readable_debug!(HarnessError);

impl HarnessError {
    pub(crate) fn io(context: impl Into<String>, source: io::Error) -> Self {
        Self::Io {
            context: context.into(),
            source,
        }
    }

    pub(crate) fn tls(context: impl Into<String>, detail: impl std::fmt::Display) -> Self {
        Self::Tls {
            context: context.into(),
            detail: detail.to_string(),
        }
    }

    pub(crate) fn redis(context: impl Into<String>, source: redis::RedisError) -> Self {
        Self::Redis {
            context: context.into(),
            source,
        }
    }
}
