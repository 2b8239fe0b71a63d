//! [`RedisCluster`]: a throwaway local Redis Cluster, of masters only or with replicas, and its
//! fault injection (pause, kill, restart, `CLUSTER FAILOVER`, waiting for a promotion).

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
    replicas: usize,
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
            replicas: 0,
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

    /// Replicas per master (default 0): `redis-cli --cluster create ... --cluster-replicas
    /// <count>`, so `masters(3).replicas(1)` starts 6 nodes, 3 masters and one replica of each.
    /// Which node replicates which master is `redis-cli`'s choice: ask
    /// [`RedisCluster::replica_of`].
    pub fn replicas(mut self, count: usize) -> Self {
        self.replicas = count;
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

    /// Starts the nodes (`masters * (1 + replicas)`, each a [`RedisServer`] with
    /// `--cluster-enabled yes` and its `nodes.conf` in its own directory, on a port whose bus port
    /// `port + 10000` is free too), runs `redis-cli --cluster create <addrs> --cluster-replicas
    /// <replicas> --cluster-yes`, then waits as [`RedisCluster::wait_until_ready`] says (every
    /// node reports `cluster_state:ok`, all 16384 slots assigned and ok, knows every node, and
    /// every replica's link to its master is up). Blocks the calling thread.
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
        let nodes = (0..self.masters * (1 + self.replicas))
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
            replicas: self.replicas,
            ready_timeout: self.ready_timeout,
            tls,
            dir,
        };
        cluster.create(&cli)?;
        cluster.wait_until_ready()?;
        Ok(cluster)
    }
}

/// A throwaway local Redis Cluster (3 masters by default, with
/// [`replicas`](RedisClusterBuilder::replicas) per master if asked for), stopped when dropped.
///
/// Each node is a [`RedisServer`] on `127.0.0.1`; [`client`](Self::client) gives a redis-rs
/// `cluster::ClusterClient` seeded with every node. Fault injection works per node, by index
/// (`0..nodes().len()`). Roles change on a failover: ask [`master_of_key`](Self::master_of_key),
/// [`master_of_slot`](Self::master_of_slot), [`replica_of`](Self::replica_of) and
/// [`is_master`](Self::is_master) rather than assume them.
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
    client: redis::cluster::ClusterClient,
    replicas: usize,
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

    /// `CONFIG SET notify-keyspace-events Kt` on every node: the keyspace events a listener's
    /// members wait with on a cluster (docs/design.md §8.4). Not persisted: a restarted node
    /// needs it again.
    ///
    /// # Errors
    ///
    /// [`HarnessError::Redis`] when a node cannot be reached or refuses.
    pub fn notify_keyspace_events(&self) -> Result<(), HarnessError> {
        self.set_notify_keyspace_events("Kt")
    }

    /// `CONFIG SET notify-keyspace-events <flags>` on every node (`""` turns them off).
    ///
    /// # Errors
    ///
    /// [`HarnessError::Redis`] when a node cannot be reached or refuses.
    pub fn set_notify_keyspace_events(&self, flags: &str) -> Result<(), HarnessError> {
        for node in &self.nodes {
            let context = format!(
                "CONFIG SET notify-keyspace-events {flags:?} on {}",
                node.addr()
            );
            let mut conn = node
                .client()
                .get_connection()
                .map_err(|e| HarnessError::redis(context.clone(), e))?;
            redis::cmd("CONFIG")
                .arg("SET")
                .arg("notify-keyspace-events")
                .arg(flags)
                .query::<()>(&mut conn)
                .map_err(|e| HarnessError::redis(context, e))?;
        }
        Ok(())
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
    /// failed after `cluster-node-timeout`; with no replicas its slots are then unserved, with
    /// replicas one of its replicas is promoted ([`wait_until_promoted`](Self::wait_until_promoted)).
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
    /// with `cluster_state:ok`, `cluster_slots_assigned:16384`, `cluster_slots_ok:16384`,
    /// `cluster_known_nodes` equal to the number of nodes and `cluster_size` equal to the number
    /// of masters; and, with replicas, until as many nodes as there are masters say
    /// `role:master`, every other node says `role:slave` with `master_link_status:up`, and each
    /// master's `connected_slaves` counts the replicas that follow it (each node's own `INFO
    /// replication`), so that a write can be replicated.
    ///
    /// # Errors
    ///
    /// [`HarnessError::ClusterNotReady`] with the last mismatch seen.
    pub fn wait_until_ready(&self) -> Result<(), HarnessError> {
        let all: Vec<usize> = (0..self.nodes.len()).collect();
        let masters = self.nodes.len() / (1 + self.replicas);
        self.wait_for("ready", || {
            self.slots_served(&all)
                .or_else(|| self.size_is(masters))
                .or_else(|| self.replicas_linked(&all, Some(masters)))
        })
    }

    /// Whether node `index` is a master now (`INFO replication`: `role:master`).
    ///
    /// # Errors
    ///
    /// [`HarnessError::NoSuchNode`]; [`HarnessError::Io`] when the node does not answer (killed,
    /// paused) within 500 ms; [`HarnessError::UnexpectedReply`] for a reply without `role`.
    pub fn is_master(&self, index: usize) -> Result<bool, HarnessError> {
        Ok(matches!(
            self.replication(index)?,
            Replication::Master { .. }
        ))
    }

    /// The node serving hash slot `slot` (0..16384) now, by index: the running master whose own
    /// `CLUSTER NODES` line (`myself`) lists the slot.
    ///
    /// # Errors
    ///
    /// [`HarnessError::ClusterNotReady`] when no running master claims the slot (it is unserved).
    pub fn master_of_slot(&self, slot: u16) -> Result<usize, HarnessError> {
        self.running()
            .find(|&i| {
                self.own_line(i).is_ok_and(|n| {
                    n.is_master() && n.slots.iter().any(|(lo, hi)| (*lo..=*hi).contains(&slot))
                })
            })
            .ok_or_else(|| HarnessError::ClusterNotReady {
                waited: Duration::ZERO,
                detail: format!("no running master serves slot {slot}"),
            })
    }

    /// The node serving `key` now (`CLUSTER KEYSLOT`, then [`master_of_slot`](Self::master_of_slot)).
    ///
    /// # Errors
    ///
    /// As [`master_of_slot`](Self::master_of_slot).
    pub fn master_of_key(&self, key: &str) -> Result<usize, HarnessError> {
        let slot = self
            .running()
            .find_map(
                |i| match self.nodes[i].probe(&["CLUSTER", "KEYSLOT", key], PROBE_TIMEOUT) {
                    Ok(Reply::Integer(slot)) => u16::try_from(slot).ok(),
                    _ => None,
                },
            )
            .ok_or_else(|| HarnessError::ClusterNotReady {
                waited: Duration::ZERO,
                detail: format!("no running node answered CLUSTER KEYSLOT {key}"),
            })?;
        self.master_of_slot(slot)
    }

    /// A running replica of master `master` now, by index (the first node whose own `INFO
    /// replication` says `role:slave` with `master_port` that of `master`); `None` when it has
    /// none.
    ///
    /// # Errors
    ///
    /// [`HarnessError::NoSuchNode`].
    pub fn replica_of(&self, master: usize) -> Result<Option<usize>, HarnessError> {
        let port = self.get(master)?.port();
        Ok(self.running().find(|&i| {
            matches!(
                self.replication(i),
                Ok(Replication::Replica { master_port, .. }) if master_port == port
            )
        }))
    }

    /// A manual, graceful failover: sends `CLUSTER FAILOVER` to replica `replica` (its master
    /// stops accepting writes, the replica catches up with its replication stream, then takes
    /// over its slots; <https://redis.io/docs/latest/commands/cluster-failover/>), then waits
    /// until it is a master and the cluster is ready again ([`wait_until_ready`](Self::wait_until_ready):
    /// the old master is now its replica, linked).
    ///
    /// # Errors
    ///
    /// [`HarnessError::NoSuchNode`]; [`HarnessError::UnexpectedReply`] when the node refuses
    /// (`-ERR You should send CLUSTER FAILOVER to a replica`); [`HarnessError::Io`] when it does
    /// not answer; [`HarnessError::ClusterNotReady`] when it is not a master, with every node
    /// ready, within the builder's `ready_timeout`.
    pub fn failover(&self, replica: usize) -> Result<(), HarnessError> {
        match self
            .get(replica)?
            .probe(&["CLUSTER", "FAILOVER"], PROBE_TIMEOUT)
        {
            Ok(Reply::Simple(_)) => {}
            Ok(other) => {
                return Err(HarnessError::UnexpectedReply {
                    index: replica,
                    command: "CLUSTER FAILOVER".into(),
                    reply: format!("{other:?}"),
                });
            }
            Err(e) => {
                return Err(HarnessError::io(
                    format!("node {replica}: CLUSTER FAILOVER failed"),
                    e,
                ));
            }
        }
        self.wait_for("failed over", || {
            (!self.is_master(replica).unwrap_or(false))
                .then(|| format!("node {replica} is not a master yet"))
        })?;
        self.wait_until_ready()
    }

    /// Waits (at most the builder's `ready_timeout`) until node `replica` is a master and the
    /// running nodes serve every slot again (`cluster_state:ok`, 16384 slots ok on each), with
    /// the replicas that still have a running master linked to it: the cluster promoted
    /// `replica` after its master was killed ([`kill_node`](Self::kill_node)) and
    /// `cluster-node-timeout` ([`RedisClusterBuilder::node_timeout`]) passed.
    ///
    /// # Errors
    ///
    /// [`HarnessError::NoSuchNode`]; [`HarnessError::ClusterNotReady`] with the last mismatch seen.
    pub fn wait_until_promoted(&self, replica: usize) -> Result<(), HarnessError> {
        self.get(replica)?;
        self.wait_for("promoted", || {
            let running: Vec<usize> = self.running().collect();
            (!self.is_master(replica).unwrap_or(false))
                .then(|| format!("node {replica} is not a master yet"))
                .or_else(|| self.slots_served(&running))
                .or_else(|| self.replicas_linked(&running, None))
        })
    }

    /// Polls `mismatch` until it finds none, at most the builder's `ready_timeout`.
    fn wait_for(
        &self,
        what: &str,
        mut mismatch: impl FnMut() -> Option<String>,
    ) -> Result<(), HarnessError> {
        let started = Instant::now();
        loop {
            let Some(detail) = mismatch() else {
                return Ok(());
            };
            if started.elapsed() >= self.ready_timeout {
                return Err(HarnessError::ClusterNotReady {
                    waited: started.elapsed(),
                    detail: format!("not {what}: {detail}"),
                });
            }
            std::thread::sleep(POLL_INTERVAL);
        }
    }

    /// The first `CLUSTER INFO` mismatch of `nodes`: state ok, every slot assigned and ok, every
    /// node known.
    fn slots_served(&self, nodes: &[usize]) -> Option<String> {
        let known = self.nodes.len().to_string();
        let expected = [
            ("cluster_state", "ok"),
            ("cluster_slots_assigned", SLOTS),
            ("cluster_slots_ok", SLOTS),
            ("cluster_known_nodes", known.as_str()),
        ];
        nodes.iter().find_map(|&i| {
            let addr = self.nodes[i].addr();
            let info = match self.text(i, &["CLUSTER", "INFO"]) {
                Ok(info) => info,
                Err(e) => return Some(format!("node {addr}: CLUSTER INFO failed: {e}")),
            };
            expected.iter().find_map(|(field, want)| {
                let got = probe::info_field(&info, field);
                (got != Some(*want))
                    .then(|| format!("node {addr}: {field} is {got:?}, want {want}"))
            })
        })
    }

    /// A mismatch when node 0's `CLUSTER INFO` does not count `masters` masters with slots.
    fn size_is(&self, masters: usize) -> Option<String> {
        let info = match self.text(0, &["CLUSTER", "INFO"]) {
            Ok(info) => info,
            Err(e) => return Some(format!("node 0: CLUSTER INFO failed: {e}")),
        };
        let got = probe::info_field(&info, "cluster_size");
        (got != Some(masters.to_string().as_str()))
            .then(|| format!("cluster_size is {got:?}, want {masters}"))
    }

    /// The first replica problem among `nodes`, each judged by its own `INFO replication`: a
    /// replica whose link to its master is not up, a master with fewer `connected_slaves` than
    /// the replicas among `nodes` that follow it, or (`masters` given) a number of masters among
    /// `nodes` other than `masters`.
    fn replicas_linked(&self, nodes: &[usize], masters: Option<usize>) -> Option<String> {
        if self.replicas == 0 {
            return None;
        }
        let mut roles = Vec::new();
        for &i in nodes {
            match self.replication(i) {
                Ok(role) => roles.push((i, role)),
                Err(e) => return Some(e.to_string()),
            }
        }
        let count = roles
            .iter()
            .filter(|(_, r)| matches!(r, Replication::Master { .. }))
            .count();
        if let Some(want) = masters
            && count != want
        {
            return Some(format!("{count} nodes are masters, want {want}"));
        }
        roles.iter().find_map(|(i, role)| match role {
            Replication::Replica { link_up: false, .. } => {
                Some(format!("node {i}: its link to its master is not up"))
            }
            Replication::Replica { .. } => None,
            Replication::Master { connected } => {
                let port = self.nodes[*i].port();
                let following = roles
                    .iter()
                    .filter(|(_, r)| matches!(r, Replication::Replica { master_port, .. } if *master_port == port))
                    .count();
                (*connected < following)
                    .then(|| format!("node {i}: {connected} replicas connected, want {following}"))
            }
        })
    }

    /// Node `index`'s own view of its role (`INFO replication`).
    fn replication(&self, index: usize) -> Result<Replication, HarnessError> {
        let info = self.text(index, &["INFO", "replication"])?;
        let field = |name| probe::info_field(&info, name);
        match field("role") {
            Some("master") => Ok(Replication::Master {
                connected: field("connected_slaves")
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(0),
            }),
            Some("slave") => Ok(Replication::Replica {
                master_port: field("master_port")
                    .and_then(|p| p.parse().ok())
                    .unwrap_or(0),
                link_up: field("master_link_status") == Some("up"),
            }),
            other => Err(HarnessError::UnexpectedReply {
                index,
                command: "INFO replication".into(),
                reply: format!("role {other:?}"),
            }),
        }
    }

    /// Indices of the nodes that run (not killed).
    fn running(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.nodes.len()).filter(|&i| self.nodes[i].pid().is_some())
    }

    /// A bulk-string reply of node `index` to `args`.
    fn text(&self, index: usize, args: &[&str]) -> Result<String, HarnessError> {
        // The node's own probe: it speaks TLS to a TLS node.
        match self.get(index)?.probe(args, PROBE_TIMEOUT) {
            Ok(Reply::Bulk(Some(text))) => Ok(text),
            Ok(other) => Err(HarnessError::UnexpectedReply {
                index,
                command: args.join(" "),
                reply: format!("{other:?}"),
            }),
            Err(e) => Err(HarnessError::io(
                format!("node {index}: {} failed", args.join(" ")),
                e,
            )),
        }
    }

    /// Node `index`'s own line of its `CLUSTER NODES` (flagged `myself`).
    fn own_line(&self, index: usize) -> Result<NodeLine, HarnessError> {
        let text = self.text(index, &["CLUSTER", "NODES"])?;
        text.lines()
            .filter_map(NodeLine::parse)
            .find(|n| n.flags.iter().any(|f| f == "myself"))
            .ok_or_else(|| HarnessError::UnexpectedReply {
                index,
                command: "CLUSTER NODES".into(),
                reply: "no `myself` line".into(),
            })
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
        let replicas = self.replicas.to_string();
        args.extend(["--cluster-replicas", replicas.as_str(), "--cluster-yes"].map(OsString::from));
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

/// A node's replication role, from its own `INFO replication`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Replication {
    /// `role:master` with `connected_slaves`.
    Master { connected: usize },
    /// `role:slave` following `master_port`, its `master_link_status` up or not.
    Replica { master_port: u16, link_up: bool },
}

/// One line of `CLUSTER NODES`: `<id> <ip:port@cport> <flags> <master> <ping-sent> <pong-recv>
/// <config-epoch> <link-state> <slot> <slot> ...`
/// (<https://redis.io/docs/latest/commands/cluster-nodes/>).
#[derive(Debug, Clone, PartialEq, Eq)]
struct NodeLine {
    port: u16,
    flags: Vec<String>,
    /// Slot ranges served, inclusive (migrating/importing entries `[...]` are skipped).
    slots: Vec<(u16, u16)>,
}

impl NodeLine {
    fn parse(line: &str) -> Option<NodeLine> {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [_id, addr, flags, _master, _, _, _, _, slots @ ..] = fields.as_slice() else {
            return None;
        };
        let host_port = addr.split('@').next()?;
        let port = host_port.rsplit(':').next()?.parse().ok()?;
        let slots = slots
            .iter()
            .filter(|s| !s.starts_with('['))
            .filter_map(|s| match s.split_once('-') {
                Some((lo, hi)) => Some((lo.parse().ok()?, hi.parse().ok()?)),
                None => s.parse().ok().map(|n| (n, n)),
            })
            .collect();
        Some(NodeLine {
            port,
            flags: flags.split(',').map(str::to_owned).collect(),
            slots,
        })
    }

    /// Flagged `master` and not `fail`.
    fn is_master(&self) -> bool {
        self.flags.iter().any(|f| f == "master") && !self.flags.iter().any(|f| f == "fail")
    }
}

#[cfg(test)]
mod tests {
    use super::NodeLine;

    #[test]
    fn cluster_nodes_lines_parse() {
        let master = NodeLine::parse(
            "07c3 127.0.0.1:30004@40004 myself,master - 0 1426238317239 4 connected 0-5460 7000 [93-<-292f]",
        )
        .unwrap();
        assert_eq!(master.port, 30004);
        assert!(master.is_master());
        assert_eq!(master.slots, vec![(0, 5460), (7000, 7000)]);
        let replica = NodeLine::parse(
            "e7d1 127.0.0.1:30002@40002 slave,fail 07c3 0 1426238316232 2 connected",
        )
        .unwrap();
        assert_eq!(replica.port, 30002);
        assert!(!replica.is_master());
        assert!(replica.slots.is_empty());
        assert_eq!(NodeLine::parse("garbage"), None);
    }
}
