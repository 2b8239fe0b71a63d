//! [`RedisCluster`]: a throwaway local Redis Cluster of masters only.

use std::ffi::OsString;
use std::fs::File;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use tempfile::TempDir;

use super::binaries::Binary;
use super::probe::{self, Reply};
use super::process::{self, SpawnSpec};
use super::{HarnessError, RedisServer, RedisServerBuilder, TlsAuthClients, TlsMaterial};

/// Slots of a Redis Cluster.
const SLOTS: &str = "16384";
/// How often the cluster is probed while it forms.
const POLL_INTERVAL: Duration = Duration::from_millis(50);
/// Timeout of one probe.
const PROBE_TIMEOUT: Duration = Duration::from_millis(500);

/// Options of a [`RedisCluster`]; made by [`RedisCluster::builder`], consumed by
/// [`start`](Self::start).
///
/// Defaults: 3 masters, no replicas, no persistence, `cluster-node-timeout` 5 s, 30 s to form the
/// cluster, binaries from `STREAM_LISTENER_REDIS_SERVER` / `STREAM_LISTENER_REDIS_CLI` or `PATH`.
#[derive(Debug, Clone)]
#[must_use = "call .start() to start the cluster"]
pub struct RedisClusterBuilder {
    masters: usize,
    node_timeout: Duration,
    ready_timeout: Duration,
    cli_binary: Option<PathBuf>,
    server: RedisServerBuilder,
    tls: bool,
}

impl Default for RedisClusterBuilder {
    fn default() -> Self {
        Self {
            masters: 3,
            node_timeout: Duration::from_secs(5),
            ready_timeout: Duration::from_secs(30),
            cli_binary: None,
            server: RedisServerBuilder::default(),
            tls: false,
        }
    }
}

impl RedisClusterBuilder {
    /// Number of master nodes (default 3; Redis needs at least 3, smaller values are raised to 3).
    pub fn masters(mut self, count: usize) -> Self {
        self.masters = count.max(3);
        self
    }

    /// Turns an append-only file on every node on or off (see [`RedisServerBuilder::aof`]).
    pub fn aof(mut self, on: bool) -> Self {
        self.server = self.server.aof(on);
        self
    }

    /// `cluster-node-timeout`: how long a node must be unreachable before the others mark it
    /// failed (default 5 s; Redis takes milliseconds, sub-millisecond parts are dropped).
    pub fn node_timeout(mut self, timeout: Duration) -> Self {
        self.node_timeout = timeout;
        self
    }

    /// How long [`start`](Self::start) waits for `redis-cli --cluster create` and then for every
    /// node to report `cluster_state:ok` (default 30 s, each).
    pub fn ready_timeout(self, timeout: Duration) -> Self {
        Self {
            ready_timeout: timeout,
            ..self
        }
    }

    /// Runs this `redis-server` binary (see [`RedisServerBuilder::server_binary`]).
    pub fn server_binary(mut self, path: impl Into<PathBuf>) -> Self {
        self.server = self.server.server_binary(path);
        self
    }

    /// Makes every node TLS-only with one set of certificates ([`TlsMaterial`], made at start in
    /// the cluster's directory, see [`RedisCluster::tls`]): `--tls-cluster yes` (the cluster bus
    /// over TLS), `--tls-auth-clients optional`; [`RedisCluster::urls`] are then `rediss://` and
    /// [`RedisCluster::client`] trusts the CA.
    pub fn tls(mut self) -> Self {
        self.tls = true;
        self
    }

    /// Runs this `redis-cli` binary instead of the one from `STREAM_LISTENER_REDIS_CLI` or `PATH`.
    pub fn cli_binary(mut self, path: impl Into<PathBuf>) -> Self {
        self.cli_binary = Some(path.into());
        self
    }

    /// Starts the nodes (each a [`RedisServer`] with `--cluster-enabled yes` and its
    /// `nodes.conf` in its own directory, on a port whose bus port `port + 10000` is free too),
    /// runs `redis-cli --cluster create <addrs> --cluster-replicas 0 --cluster-yes`, then waits
    /// until every node reports `cluster_state:ok`, all 16384 slots assigned and ok, and knows
    /// every node. Blocks the calling thread.
    ///
    /// # Errors
    ///
    /// - [`HarnessError::RedisNotInstalled`]: no `redis-server` or no `redis-cli`;
    /// - any error of [`RedisServerBuilder::start`] for a node;
    /// - [`HarnessError::ClusterCreate`]: `redis-cli` failed or timed out (with its output);
    /// - [`HarnessError::ClusterNotReady`]: the cluster did not converge in time.
    pub fn start(self) -> Result<RedisCluster, HarnessError> {
        let cli = Binary::Cli.resolve(self.cli_binary.as_deref())?;
        let node_timeout_ms = self.node_timeout.as_millis().max(1).to_string();
        let dir = tempfile::Builder::new()
            .prefix("stream-listener-cluster-")
            .tempdir()
            .map_err(|e| HarnessError::io("cannot create a temporary directory", e))?;
        let tls = match self.tls {
            true => Some(TlsMaterial::generate(dir.path())?),
            false => None,
        };
        let mut node_builder = self
            .server
            .clone()
            .with_bus_port()
            .config("cluster-enabled", "yes")
            .config("cluster-config-file", "nodes.conf")
            .config("cluster-node-timeout", node_timeout_ms);
        if let Some(material) = &tls {
            node_builder = node_builder.tls_material(material.clone(), TlsAuthClients::Optional);
        }
        let nodes = (0..self.masters)
            .map(|_| node_builder.clone().start())
            .collect::<Result<Vec<_>, _>>()?;
        let urls: Vec<String> = nodes.iter().map(RedisServer::url).collect();
        let mut client = redis::cluster::ClusterClient::builder(urls);
        if let Some(material) = &tls {
            crate::connection::install_crypto_provider();
            client = client.certs(material.redis_certificates()?);
        }
        let client = client
            .build()
            .map_err(|e| HarnessError::redis("cannot build a cluster client", e))?;
        let cluster = RedisCluster {
            nodes,
            client,
            ready_timeout: self.ready_timeout,
            tls,
            dir,
        };
        cluster.create(&cli)?;
        cluster.wait_until_ready()?;
        Ok(cluster)
    }
}

/// A throwaway local Redis Cluster of masters only (3 by default), stopped when dropped.
///
/// Each node is a [`RedisServer`] on `127.0.0.1`; [`client`](Self::client) gives a redis-rs
/// `cluster::ClusterClient` seeded with every node. Fault injection works per node, by index
/// (`0..nodes().len()`).
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
    client: redis::cluster::ClusterClient,
    ready_timeout: Duration,
    tls: Option<TlsMaterial>,
    dir: TempDir,
}

impl RedisCluster {
    /// Options for a cluster; see [`RedisClusterBuilder`].
    pub fn builder() -> RedisClusterBuilder {
        RedisClusterBuilder::default()
    }

    /// Starts a 3-master cluster with the default options.
    ///
    /// # Errors
    ///
    /// As [`RedisClusterBuilder::start`].
    pub fn start() -> Result<Self, HarnessError> {
        Self::builder().start()
    }

    /// The nodes, in creation order.
    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }

    /// Node `index`, or `None` if out of range.
    pub fn node(&self, index: usize) -> Option<&RedisServer> {
        self.nodes.get(index)
    }

    /// Every node's `127.0.0.1:<port>`.
    pub fn addrs(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::addr).collect()
    }

    /// The certificates of a TLS cluster ([`RedisClusterBuilder::tls`]), `None` for a plain one.
    pub fn tls(&self) -> Option<&TlsMaterial> {
        self.tls.as_ref()
    }

    /// Every node's `redis://127.0.0.1:<port>` (`rediss://` for a TLS cluster), the form
    /// `cluster::ClusterClient::new` takes.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// A redis-rs cluster client seeded with every node (cheap to clone; it connects only when
    /// asked for a connection).
    pub fn client(&self) -> redis::cluster::ClusterClient {
        self.client.clone()
    }

    /// Freezes node `index` with `SIGSTOP` (see [`RedisServer::pause`]).
    ///
    /// # Errors
    ///
    /// [`HarnessError::NoSuchNode`], or as [`RedisServer::pause`].
    pub fn pause_node(&self, index: usize) -> Result<(), HarnessError> {
        self.get(index)?.pause()
    }

    /// Lets node `index` run again with `SIGCONT` (see [`RedisServer::resume`]).
    ///
    /// # Errors
    ///
    /// [`HarnessError::NoSuchNode`], or as [`RedisServer::resume`].
    pub fn resume_node(&self, index: usize) -> Result<(), HarnessError> {
        self.get(index)?.resume()
    }

    /// Kills node `index` with `SIGKILL` (see [`RedisServer::kill`]). The other nodes mark it
    /// failed after `cluster-node-timeout`; with no replicas its slots are then unserved.
    ///
    /// # Errors
    ///
    /// [`HarnessError::NoSuchNode`], or as [`RedisServer::kill`].
    pub fn kill_node(&mut self, index: usize) -> Result<(), HarnessError> {
        self.get_mut(index)?.kill()
    }

    /// Restarts node `index` on the same port and directory (see [`RedisServer::restart`]): it
    /// reloads its `nodes.conf`, so it comes back with the same node id and slots. Waits for
    /// `PING` only; call [`wait_until_ready`](Self::wait_until_ready) to wait for the cluster.
    ///
    /// # Errors
    ///
    /// [`HarnessError::NoSuchNode`], or as [`RedisServer::restart`].
    pub fn restart_node(&mut self, index: usize) -> Result<(), HarnessError> {
        self.get_mut(index)?.restart()
    }

    /// Waits (at most the builder's `ready_timeout`) until every node answers `CLUSTER INFO`
    /// with `cluster_state:ok`, `cluster_slots_assigned:16384`, `cluster_slots_ok:16384` and
    /// `cluster_known_nodes` equal to the number of nodes.
    ///
    /// # Errors
    ///
    /// [`HarnessError::ClusterNotReady`] with the last mismatch seen.
    pub fn wait_until_ready(&self) -> Result<(), HarnessError> {
        let started = Instant::now();
        let known = self.nodes.len().to_string();
        let expected = [
            ("cluster_state", "ok"),
            ("cluster_slots_assigned", SLOTS),
            ("cluster_slots_ok", SLOTS),
            ("cluster_known_nodes", known.as_str()),
        ];
        loop {
            let detail = self.nodes.iter().find_map(|node| {
                let info = match node.probe(&["CLUSTER", "INFO"], PROBE_TIMEOUT) {
                    Ok(Reply::Bulk(Some(info))) => info,
                    other => {
                        return Some(format!("node {}: CLUSTER INFO gave {other:?}", node.addr()));
                    }
                };
                expected.iter().find_map(|(field, want)| {
                    let got = probe::info_field(&info, field);
                    (got != Some(*want))
                        .then(|| format!("node {}: {field} is {got:?}, want {want}", node.addr()))
                })
            });
            let Some(detail) = detail else {
                return Ok(());
            };
            if started.elapsed() >= self.ready_timeout {
                return Err(HarnessError::ClusterNotReady {
                    waited: started.elapsed(),
                    detail,
                });
            }
            std::thread::sleep(POLL_INTERVAL);
        }
    }

    fn get(&self, index: usize) -> Result<&RedisServer, HarnessError> {
        let count = self.nodes.len();
        self.nodes
            .get(index)
            .ok_or(HarnessError::NoSuchNode { index, count })
    }

    fn get_mut(&mut self, index: usize) -> Result<&mut RedisServer, HarnessError> {
        let count = self.nodes.len();
        self.nodes
            .get_mut(index)
            .ok_or(HarnessError::NoSuchNode { index, count })
    }

    /// Runs `redis-cli --cluster create` and waits for it (bounded).
    fn create(&self, cli: &std::path::Path) -> Result<(), HarnessError> {
        let output_path = self.dir.path().join("cluster-create.log");
        let output = File::create(&output_path)
            .map_err(|e| HarnessError::io("cannot create the redis-cli output file", e))?;
        let mut args: Vec<OsString> = self
            .tls
            .as_ref()
            .map(TlsMaterial::cli_args)
            .unwrap_or_default();
        args.extend(["--cluster", "create"].map(OsString::from));
        args.extend(self.addrs().into_iter().map(OsString::from));
        args.extend(["--cluster-replicas", "0", "--cluster-yes"].map(OsString::from));
        let mut child = process::spawn(SpawnSpec {
            program: cli.to_path_buf(),
            args,
            cwd: self.dir.path().to_path_buf(),
            output,
        })?;
        let read_output = || std::fs::read_to_string(&output_path).unwrap_or_default();
        let started = Instant::now();
        loop {
            match child.try_wait() {
                Ok(Some(status)) if status.success() => return Ok(()),
                Ok(Some(status)) => {
                    return Err(HarnessError::ClusterCreate {
                        status: status.to_string(),
                        output: read_output(),
                    });
                }
                Ok(None) if started.elapsed() >= self.ready_timeout => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(HarnessError::ClusterCreate {
                        status: format!("timed out after {:?}", started.elapsed()),
                        output: read_output(),
                    });
                }
                Ok(None) => std::thread::sleep(POLL_INTERVAL),
                Err(e) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(HarnessError::io("cannot check on redis-cli", e));
                }
            }
        }
    }
}
