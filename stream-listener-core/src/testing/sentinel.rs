//! [`RedisSentinel`]: a throwaway Redis Sentinel setup (one master, one replica, three sentinels).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use redis::FromRedisValue;

use super::{HarnessError, RedisServer, TlsAuthClients, TlsMaterial};

/// Timeout of one query the harness sends (connect, write, read).
const QUERY_TIMEOUT: Duration = Duration::from_millis(500);
/// How often a state being waited for is checked.
const POLL_INTERVAL: Duration = Duration::from_millis(50);
/// How many sentinels run: three, so that a quorum of two survives one of them.
const SENTINELS: usize = 3;

/// Options of a [`RedisSentinel`]; made by [`RedisSentinel::builder`], consumed by
/// [`start`](Self::start).
///
/// Defaults: master name `mymaster`, `down-after-milliseconds` 1000, `failover-timeout` 5000,
/// a 30 s ready timeout.
#[derive(Debug, Clone)]
#[must_use = "call .start() to start the setup"]
pub struct RedisSentinelBuilder {
    master_name: String,
    down_after: Duration,
    failover_timeout: Duration,
    ready_timeout: Duration,
    tls: bool,
}

impl Default for RedisSentinelBuilder {
    fn default() -> Self {
        RedisSentinelBuilder {
            master_name: "mymaster".to_owned(),
            down_after: Duration::from_millis(1000),
            failover_timeout: Duration::from_millis(5000),
            ready_timeout: Duration::from_secs(30),
            tls: false,
        }
    }
}

impl RedisSentinelBuilder {
    /// The name the sentinels monitor the master by (`sentinel monitor <name> ...`).
    pub fn master_name(mut self, name: impl Into<String>) -> Self {
        self.master_name = name.into();
        self
    }

    /// Sentinel's `down-after-milliseconds`: how long the master may not answer before a
    /// sentinel deems it down (default 1 s).
    pub fn down_after(mut self, after: Duration) -> Self {
        self.down_after = after;
        self
    }

    /// Sentinel's `failover-timeout` (default 5 s).
    pub fn failover_timeout(mut self, timeout: Duration) -> Self {
        self.failover_timeout = timeout;
        self
    }

    /// How long [`start`](Self::start) waits for every sentinel to see the master, the replica
    /// and the two other sentinels (default 30 s; sentinels find each other through `hello`
    /// messages every 2 s).
    pub fn ready_timeout(mut self, timeout: Duration) -> Self {
        self.ready_timeout = timeout;
        self
    }

    /// Makes all five processes TLS-only with one set of certificates ([`TlsMaterial`], made at
    /// start, see [`RedisSentinel::tls`]): `--tls-replication yes`, so the replica and the
    /// sentinels reach the master over TLS, `--tls-auth-clients optional`;
    /// [`RedisSentinel::sentinel_urls`] are then `rediss://`.
    pub fn tls(mut self) -> Self {
        self.tls = true;
        self
    }

    /// Starts a master, a replica of it (`REPLICAOF`) and three sentinels
    /// (`redis-server <dir>/sentinel.conf --sentinel`, each `sentinel monitor <name> 127.0.0.1
    /// <master port> 2`) on free loopback ports, and waits until every sentinel reports the
    /// master (`SENTINEL MASTER`), the replica (`SENTINEL REPLICAS`) and the other two sentinels.
    /// Blocks the calling thread.
    ///
    /// # Errors
    /// As [`super::RedisServerBuilder::start`]; [`HarnessError::Redis`] when `REPLICAOF` fails;
    /// [`HarnessError::SentinelNotReady`] when the setup is not ready in time.
    pub fn start(self) -> Result<RedisSentinel, HarnessError> {
        let tls = match self.tls {
            true => {
                let dir = tempfile::Builder::new()
                    .prefix("stream-listener-sentinel-tls-")
                    .tempdir()
                    .map_err(|e| HarnessError::io("cannot create a temporary directory", e))?;
                let material = TlsMaterial::generate(dir.path())?;
                Some((material, dir))
            }
            false => None,
        };
        let builder = || match &tls {
            Some((material, _)) => {
                RedisServer::builder().tls_material(material.clone(), TlsAuthClients::Optional)
            }
            None => RedisServer::builder(),
        };
        let master = builder().start()?;
        let replica = builder().start()?;
        query::<()>(
            &replica,
            redis::cmd("REPLICAOF").arg("127.0.0.1").arg(master.port()),
        )
        .map_err(|e| HarnessError::redis("REPLICAOF on the replica failed", e))?;
        let config = format!(
            "sentinel monitor {name} 127.0.0.1 {port} 2\n\
             sentinel down-after-milliseconds {name} {down}\n\
             sentinel failover-timeout {name} {failover}\n\
             sentinel parallel-syncs {name} 1\n",
            name = self.master_name,
            port = master.port(),
            down = self.down_after.as_millis(),
            failover = self.failover_timeout.as_millis(),
        );
        let sentinels = (0..SENTINELS)
            .map(|_| builder().sentinel(config.clone()).start())
            .collect::<Result<Vec<_>, _>>()?;
        let setup = RedisSentinel {
            sentinels,
            known_master: master.port(),
            nodes: vec![master, replica],
            master_name: self.master_name,
            tls,
        };
        setup.wait_ready(self.ready_timeout)?;
        Ok(setup)
    }
}

/// A throwaway Sentinel setup on `127.0.0.1`: one master, one replica, three sentinels, each a
/// [`RedisServer`] in its own temporary directory, all stopped when dropped (sentinels first).
///
/// Made by [`RedisSentinel::start`] or [`RedisSentinel::builder`]. Faults:
/// [`kill_master`](Self::kill_master) (`SIGKILL`) and [`wait_for_failover`](Self::wait_for_failover);
/// a manual failover is `SENTINEL FAILOVER <name>` sent to a sentinel.
#[derive(Debug)]
pub struct RedisSentinel {
    // Declared first: dropped first, so no sentinel starts a failover while the nodes stop.
    sentinels: Vec<RedisServer>,
    /// The data nodes: the first master, then its replica.
    nodes: Vec<RedisServer>,
    master_name: String,
    /// The master's port as of the start or the last [`RedisSentinel::wait_for_failover`].
    known_master: u16,
    /// The certificates of a TLS setup and the directory holding them (dropped last).
    tls: Option<(TlsMaterial, tempfile::TempDir)>,
}

impl RedisSentinel {
    /// Options for a setup; see [`RedisSentinelBuilder`].
    pub fn builder() -> RedisSentinelBuilder {
        RedisSentinelBuilder::default()
    }

    /// Starts a setup with the default options.
    ///
    /// # Errors
    /// As [`RedisSentinelBuilder::start`].
    pub fn start() -> Result<Self, HarnessError> {
        Self::builder().start()
    }

    /// The certificates of a TLS setup ([`RedisSentinelBuilder::tls`]), `None` for a plain one.
    pub fn tls(&self) -> Option<&TlsMaterial> {
        self.tls.as_ref().map(|(material, _)| material)
    }

    /// The sentinels' URLs, `redis://127.0.0.1:<port>` (`rediss://` with
    /// [`RedisSentinelBuilder::tls`]), for `[redis] sentinels`.
    pub fn sentinel_urls(&self) -> Vec<String> {
        self.sentinels.iter().map(RedisServer::url).collect()
    }

    /// The name the sentinels monitor the master by (for `[redis] sentinel_master`).
    pub fn master_name(&self) -> &str {
        &self.master_name
    }

    /// The data node the first sentinel that answers names master now
    /// (`SENTINEL GET-MASTER-ADDR-BY-NAME`).
    ///
    /// # Errors
    /// [`HarnessError::SentinelNotReady`] when no sentinel answers with a node of this setup.
    pub fn master(&self) -> Result<&RedisServer, HarnessError> {
        let port = self.master_port()?;
        self.node(port).ok_or_else(|| {
            not_ready(
                Duration::ZERO,
                format!("the sentinels name port {port}, no node of this setup"),
            )
        })
    }

    /// The running data node that is not the master (the replica, before a failover; after
    /// [`kill_master`](Self::kill_master) and a failover, none: `None`).
    ///
    /// # Errors
    /// As [`master`](Self::master).
    pub fn replica(&self) -> Result<Option<&RedisServer>, HarnessError> {
        let master = self.master_port()?;
        Ok(self
            .nodes
            .iter()
            .find(|n| n.port() != master && n.pid().is_some()))
    }

    /// Kills the current master with `SIGKILL` (no shutdown, no final save, no last
    /// replication) and returns its port. Sentinel then fails over to the replica after
    /// `down-after-milliseconds` and an election: see [`wait_for_failover`](Self::wait_for_failover).
    ///
    /// # Errors
    /// As [`master`](Self::master); [`HarnessError::Io`] when the process cannot be killed.
    pub fn kill_master(&mut self) -> Result<u16, HarnessError> {
        let port = self.master_port()?;
        let node = self
            .nodes
            .iter_mut()
            .find(|n| n.port() == port)
            .ok_or_else(|| not_ready(Duration::ZERO, format!("no node on port {port}")))?;
        node.kill()?;
        Ok(port)
    }

    /// A manual failover: `SENTINEL FAILOVER <name>` to the first running sentinel (over TLS for
    /// a TLS setup). Returns at once; [`wait_for_failover`](Self::wait_for_failover) waits for it.
    ///
    /// # Errors
    /// [`HarnessError::Redis`] when no sentinel accepts it.
    pub fn failover(&self) -> Result<(), HarnessError> {
        let sentinel = self
            .sentinels
            .iter()
            .find(|s| s.pid().is_some())
            .ok_or_else(|| not_ready(Duration::ZERO, "no sentinel runs".into()))?;
        query::<()>(
            sentinel,
            redis::cmd("SENTINEL")
                .arg("FAILOVER")
                .arg(&self.master_name),
        )
        .map_err(|e| HarnessError::redis("SENTINEL FAILOVER failed", e))
    }

    /// Waits until every sentinel names a master other than the one known before (at start, or
    /// at the last call), that node answers `ROLE` as master, and the old master, if it still
    /// runs (a manual `SENTINEL FAILOVER`), answers as a replica (Sentinel converts it a moment
    /// after the promotion; until then it still takes writes); returns the new master's port.
    ///
    /// # Errors
    /// [`HarnessError::SentinelNotReady`] with the last state seen when `timeout` passes.
    pub fn wait_for_failover(&mut self, timeout: Duration) -> Result<u16, HarnessError> {
        let started = Instant::now();
        let old = self.known_master;
        loop {
            let detail = match self.all_sentinels_agree() {
                Ok(port) if port != old && self.node_is_master(port) && self.demoted(old) => {
                    self.known_master = port;
                    return Ok(port);
                }
                Ok(port) => format!("the sentinels name port {port} (was {old})"),
                Err(detail) => detail,
            };
            if started.elapsed() >= timeout {
                return Err(not_ready(started.elapsed(), detail));
            }
            std::thread::sleep(POLL_INTERVAL);
        }
    }

    /// Whether the node on `port` is killed or answers `ROLE` as a replica.
    fn demoted(&self, port: u16) -> bool {
        match self.node(port) {
            Some(node) if node.pid().is_some() => matches!(
                self.query_port::<redis::Role>(port, &redis::cmd("ROLE")),
                Ok(redis::Role::Replica { .. })
            ),
            _ => true,
        }
    }

    fn node(&self, port: u16) -> Option<&RedisServer> {
        self.nodes.iter().find(|n| n.port() == port)
    }

    fn master_port(&self) -> Result<u16, HarnessError> {
        let mut last = String::from("no sentinel");
        for sentinel in &self.sentinels {
            match self.master_addr(sentinel.port(), &self.master_name) {
                Ok(port) => return Ok(port),
                Err(e) => last = e,
            }
        }
        Err(not_ready(Duration::ZERO, last))
    }

    /// The master port every sentinel names, if they agree.
    fn all_sentinels_agree(&self) -> Result<u16, String> {
        let ports = self
            .sentinels
            .iter()
            .map(|s| self.master_addr(s.port(), &self.master_name))
            .collect::<Result<Vec<_>, _>>()?;
        match ports.split_first() {
            Some((first, rest)) if rest.iter().all(|p| p == first) => Ok(*first),
            _ => Err(format!("the sentinels disagree: {ports:?}")),
        }
    }

    fn wait_ready(&self, timeout: Duration) -> Result<(), HarnessError> {
        let started = Instant::now();
        loop {
            let detail = match self
                .sentinels
                .iter()
                .try_for_each(|s| self.sentinel_ready(s.port()))
            {
                Ok(()) => return Ok(()),
                Err(detail) => detail,
            };
            if started.elapsed() >= timeout {
                return Err(not_ready(started.elapsed(), detail));
            }
            std::thread::sleep(POLL_INTERVAL);
        }
    }

    /// Whether the sentinel on `port` sees the master, its replica and the two other sentinels.
    fn sentinel_ready(&self, port: u16) -> Result<(), String> {
        let master: HashMap<String, String> = self
            .query_port(
                port,
                redis::cmd("SENTINEL").arg("MASTER").arg(&self.master_name),
            )
            .map_err(|e| format!("SENTINEL MASTER on {port}: {e}"))?;
        let field = |name: &str| master.get(name).map(String::as_str).unwrap_or("");
        let expected_master = self.nodes[0].port().to_string();
        if field("port") != expected_master
            || field("flags") != "master"
            || field("num-slaves") != "1"
            || field("num-other-sentinels") != (SENTINELS - 1).to_string()
        {
            return Err(format!(
                "sentinel {port}: master port {}, flags {}, {} replicas, {} other sentinels",
                field("port"),
                field("flags"),
                field("num-slaves"),
                field("num-other-sentinels")
            ));
        }
        let replicas: Vec<HashMap<String, String>> = self
            .query_port(
                port,
                redis::cmd("SENTINEL")
                    .arg("REPLICAS")
                    .arg(&self.master_name),
            )
            .map_err(|e| format!("SENTINEL REPLICAS on {port}: {e}"))?;
        let replica_port = self.nodes[1].port().to_string();
        let seen = replicas.iter().any(|r| {
            r.get("port") == Some(&replica_port)
                && r.get("flags").is_some_and(|f| f == "slave")
                && r.get("master-link-status").is_some_and(|s| s == "ok")
        });
        if !seen {
            return Err(format!(
                "sentinel {port}: replica {replica_port} not seen up yet"
            ));
        }
        Ok(())
    }

    /// The master's port as the sentinel on `port` names it.
    fn master_addr(&self, port: u16, name: &str) -> Result<u16, String> {
        let addr: Option<(String, u16)> = self
            .query_port(
                port,
                redis::cmd("SENTINEL")
                    .arg("GET-MASTER-ADDR-BY-NAME")
                    .arg(name),
            )
            .map_err(|e| format!("SENTINEL GET-MASTER-ADDR-BY-NAME on {port}: {e}"))?;
        addr.map(|(_, p)| p)
            .ok_or_else(|| format!("sentinel {port} knows no master {name:?}"))
    }

    /// Whether the node on `port` answers `ROLE` as master.
    fn node_is_master(&self, port: u16) -> bool {
        matches!(
            self.query_port::<redis::Role>(port, &redis::cmd("ROLE")),
            Ok(redis::Role::Primary { .. })
        )
    }

    /// The harness's server (sentinel or data node) on `port`.
    fn server(&self, port: u16) -> Option<&RedisServer> {
        self.sentinels
            .iter()
            .chain(&self.nodes)
            .find(|n| n.port() == port)
    }

    /// [`query`] to the server on `port` (its client speaks TLS to a TLS server).
    fn query_port<T: FromRedisValue>(&self, port: u16, cmd: &redis::Cmd) -> redis::RedisResult<T> {
        match self.server(port) {
            Some(server) => query(server, cmd),
            None => Err(redis::RedisError::from(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("no server of the setup on port {port}"),
            ))),
        }
    }
}

/// Sends `cmd` to `server` on a fresh connection (TLS to a TLS server), every step bounded by
/// [`QUERY_TIMEOUT`].
fn query<T: FromRedisValue>(server: &RedisServer, cmd: &redis::Cmd) -> redis::RedisResult<T> {
    let mut conn = server.client().get_connection_with_timeout(QUERY_TIMEOUT)?;
    conn.set_read_timeout(Some(QUERY_TIMEOUT))?;
    conn.set_write_timeout(Some(QUERY_TIMEOUT))?;
    cmd.query(&mut conn)
}

fn not_ready(waited: Duration, detail: String) -> HarnessError {
    HarnessError::SentinelNotReady { waited, detail }
}
