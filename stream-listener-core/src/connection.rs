//! Connections to Redis: standalone or Cluster, chosen by configuration, behind one type.
//!
//! Both kinds reconnect by themselves (redis-rs's `ConnectionManager` and cluster connection).
//! Every command of the coordinator and the admin operations touches keys of one hash slot
//! (docs/design.md §2), so the same code runs on both.
//!
//! Re-sent commands. redis-rs's cluster connection re-sends a request after a dropped
//! connection, an I/O error, `READONLY`, `MOVED`/`ASK`, `TRYAGAIN` or `CLUSTERDOWN` (redis 1.8.1,
//! `cluster_handling/async_connection/request.rs`); a read that ran but whose reply was lost is
//! then sent again and returns the *next* batch, and the first one stays unseen in the
//! consumer's pending list (docs/design.md §8.10). The coordinator's and the admin's commands are
//! safe to re-send (request sequence numbers, compare-and-set); the data plane's are not, so it
//! uses [`RedisConnection::for_data_plane`]: on a cluster a second connection that never
//! re-sends (an error reaches the shard task, which re-reads its own pending entries). The
//! standalone `ConnectionManager` never re-sends a command (its retries are reconnection
//! attempts; a failed command returns its error), so the data plane may use one: each member
//! has its own ([`RedisConnection::member_data_plane`]).
//!
//! Sentinel: [`SentinelConnection`] (module `sentinel`) serves the master the sentinels name
//! with a `ConnectionManager`, and replaces it after a failover without re-sending the failed
//! command, so the data plane shares it (docs/design.md §15.3).

use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Value};

mod tls;
mod tls_failure;

use tls::standalone_client;
pub(crate) use tls::{install_crypto_provider, ring_provider, tls_certificates};
pub use tls_failure::tls_advice;
use tls_failure::{explain_cluster_failure, explain_failure, tls_cause};
mod sentinel;

/// Why a connection attempt to `target` that timed out, or that the caller's own deadline cut
/// short, failed, when a check can tell: a `rediss://` standalone URL whose port answers a plain
/// `PING` (a TLS handshake failure, see [`tls_failure`]). `None` otherwise. Used by
/// [`crate::startup::connect`] when `startup_timeout` ends before the attempt's own timeout.
pub(crate) async fn explain_timed_out_attempt(target: &RedisTarget) -> Option<redis::RedisError> {
    let Topology::Standalone(url) = target.topology() else {
        return None;
    };
    if !url.starts_with("rediss://") {
        return None;
    }
    let timeout = redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut));
    let explained = explain_failure(url, timeout).await;
    (RedisFailure::of(&explained) == RedisFailure::TlsHandshake).then_some(explained)
}

pub use sentinel::SentinelConnection;

/// Where Redis is and how to reach it: a [`Topology`] (standalone, cluster or Sentinel) and the
/// TLS files ([`TlsOptions`]) used when its URLs are `rediss://`. Its `Debug` hides passwords
/// (`user:password@` and `pass=`); [`RedisTarget::describe`] is the same for logs.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisTarget {
    topology: Topology,
    tls: TlsOptions,
}

/// How the Redis deployment is laid out.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Topology {
    /// One server: a `redis://` or `rediss://` URL (`redis://user:password@host:port/db`).
    Standalone(String),
    /// A Redis Cluster: one or more seed node URLs.
    Cluster(Vec<String>),
    /// A master found through Redis Sentinel ([`SentinelTarget`]).
    Sentinel(SentinelTarget),
}

/// A master monitored by Redis Sentinel: the sentinels to ask, and the name they know it by
/// (Sentinel's `SENTINEL GET-MASTER-ADDR-BY-NAME`, <https://redis.io/docs/latest/operate/oss_and_stack/management/sentinel/>).
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SentinelTarget {
    /// URLs of the sentinels (`redis://[user:password@]host:26379`), at least one.
    pub sentinels: Vec<String>,
    /// The monitored master's name (`sentinel monitor <name> ...`), e.g. `mymaster`.
    pub master_name: String,
    /// Credentials and database for the master and its replicas, as a URL whose host is
    /// ignored (`redis://user:password@_/0`); `None`: no authentication, database 0.
    pub master_auth: Option<String>,
}

/// TLS settings for `rediss://` connections (`[redis] tls_*`, README "TLS"). All paths are PEM
/// files. With every field empty a `rediss://` connection verifies the server against the
/// system's root certificates.
#[derive(Clone, Default, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub struct TlsOptions {
    /// `tls_ca_file`: the certificate authority (PEM) the server's certificate must chain to.
    pub ca_file: Option<std::path::PathBuf>,
    /// `tls_cert_file`: the client certificate (PEM) for mutual TLS; needs `key_file`.
    pub cert_file: Option<std::path::PathBuf>,
    /// `tls_key_file`: the client certificate's private key (PEM); needs `cert_file`.
    pub key_file: Option<std::path::PathBuf>,
    /// `tls_insecure`: skip verifying the server's certificate (an explicit, logged opt-out).
    pub insecure: bool,
}

impl SentinelTarget {
    /// The master `master_name` found through `sentinels`, without credentials.
    pub fn new(sentinels: Vec<String>, master_name: impl Into<String>) -> Self {
        SentinelTarget {
            sentinels,
            master_name: master_name.into(),
            master_auth: None,
        }
    }
}

impl RedisTarget {
    /// One server at `url` (`redis://` or `rediss://`).
    pub fn standalone(url: impl Into<String>) -> Self {
        Self::new(Topology::Standalone(url.into()))
    }

    /// A Redis Cluster reached through the seed node URLs `nodes`.
    pub fn cluster(nodes: Vec<String>) -> Self {
        Self::new(Topology::Cluster(nodes))
    }

    /// A master found through Sentinel.
    pub fn sentinel(target: SentinelTarget) -> Self {
        Self::new(Topology::Sentinel(target))
    }

    /// A target of `topology`, with no TLS files.
    pub fn new(topology: Topology) -> Self {
        RedisTarget {
            topology,
            tls: TlsOptions::default(),
        }
    }

    /// This target with the TLS files `tls`.
    pub fn with_tls(mut self, tls: TlsOptions) -> Self {
        self.tls = tls;
        self
    }

    /// The deployment's layout.
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// The TLS files.
    pub fn tls(&self) -> &TlsOptions {
        &self.tls
    }

    /// Whether this is a cluster (multi-slot calls must then be split per slot).
    pub fn is_cluster(&self) -> bool {
        matches!(self.topology, Topology::Cluster(_))
    }

    /// A client of one cluster node at `host:port`, with the user, password and TLS of the
    /// cluster's first seed URL (a cluster's nodes share them): for what redis-rs's cluster
    /// client does not give, a connection to a chosen node (keyspace notifications,
    /// docs/design.md §8.4).
    ///
    /// # Errors
    /// `InvalidClientConfig` when this is not a cluster target; the seed URL's own errors.
    pub(crate) fn cluster_node_client(
        &self,
        host: &str,
        port: u16,
    ) -> redis::RedisResult<redis::Client> {
        use redis::{ConnectionAddr, IntoConnectionInfo};
        let Topology::Cluster(nodes) = &self.topology else {
            return Err(redis::RedisError::from((
                redis::ErrorKind::InvalidClientConfig,
                "a node client needs a cluster target",
            )));
        };
        let Some(seed) = nodes.first() else {
            return Err(redis::RedisError::from((
                redis::ErrorKind::InvalidClientConfig,
                "a cluster target without nodes",
            )));
        };
        let seed = seed.as_str().into_connection_info()?;
        let addr = match seed.addr() {
            ConnectionAddr::TcpTls {
                insecure,
                tls_params,
                ..
            } => ConnectionAddr::TcpTls {
                host: host.to_owned(),
                port,
                insecure: *insecure,
                tls_params: tls_params.clone(),
            },
            _ => ConnectionAddr::Tcp(host.to_owned(), port),
        };
        let info = seed.clone().set_addr(addr);
        tls::client_of(info, &self.tls)
    }

    /// The target for logs and errors, passwords replaced by `***`: the URL, `cluster [a, b]`
    /// or `sentinel master <name> via [a, b]`.
    pub fn describe(&self) -> String {
        let list = |urls: &[String]| redact_urls(urls).join(", ");
        match &self.topology {
            Topology::Standalone(url) => redact_url(url),
            Topology::Cluster(nodes) => format!("cluster [{}]", list(nodes)),
            Topology::Sentinel(s) => {
                format!(
                    "sentinel master {} via [{}]",
                    s.master_name,
                    list(&s.sentinels)
                )
            }
        }
    }
}

impl std::fmt::Debug for RedisTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisTarget")
            .field("topology", &self.topology)
            .field("tls", &self.tls)
            .finish()
    }
}

impl std::fmt::Debug for Topology {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Topology::Standalone(url) => {
                f.debug_tuple("Standalone").field(&redact_url(url)).finish()
            }
            Topology::Cluster(nodes) => {
                f.debug_tuple("Cluster").field(&redact_urls(nodes)).finish()
            }
            Topology::Sentinel(s) => f.debug_tuple("Sentinel").field(s).finish(),
        }
    }
}

impl std::fmt::Debug for SentinelTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SentinelTarget")
            .field("sentinels", &redact_urls(&self.sentinels))
            .field("master_name", &self.master_name)
            .field("master_auth", &self.master_auth.as_deref().map(redact_url))
            .finish()
    }
}

/// Each of `urls` as [`redact_url`] shows it, for logs and `Debug` of URL lists.
pub fn redact_urls(urls: &[String]) -> Vec<String> {
    urls.iter().map(|url| redact_url(url)).collect()
}

/// `url` with the password of `user:password@host` and of a `pass=` query parameter replaced by
/// `***`, for logs and errors.
pub fn redact_url(url: &str) -> String {
    let mut out = url.to_owned();
    if let Some(scheme_end) = out.find("://") {
        let rest = scheme_end + 3;
        if let Some(at) = out[rest..].find('@').map(|i| rest + i)
            && let Some(colon) = out[rest..at].find(':').map(|i| rest + i)
        {
            out.replace_range(colon + 1..at, "***");
        }
    }
    if let Some(start) = out.find("pass=").map(|i| i + 5) {
        let end = out[start..].find('&').map_or(out.len(), |i| start + i);
        out.replace_range(start..end, "***");
    }
    out
}

/// A cloneable connection to a standalone server, a cluster or a Sentinel master. Clones share the underlying
/// multiplexed connection; blocking commands need a connection of their own.
#[derive(Clone)]
pub enum RedisConnection {
    /// A standalone server.
    Standalone(ConnectionManager),
    /// A Redis Cluster, and the data plane's connection to it (made on first use, shared by
    /// every clone).
    Cluster(ClusterConnection, Arc<DataPlaneCluster>),
    /// The master Sentinel names, followed across failovers ([`SentinelConnection`]).
    Sentinel(SentinelConnection),
}

/// The data plane's connection to a cluster: the same nodes and timeouts, no re-sent requests
/// (redis-rs `retries(0)`): a request whose reply is lost fails instead of running twice
/// ([`RedisConnection::for_data_plane`]).
pub struct DataPlaneCluster {
    client: ClusterClient,
    conn: tokio::sync::OnceCell<ClusterConnection>,
}

impl std::fmt::Debug for RedisConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RedisConnection::Standalone(_) => f.write_str("RedisConnection::Standalone"),
            RedisConnection::Cluster(..) => f.write_str("RedisConnection::Cluster"),
            RedisConnection::Sentinel(_) => f.write_str("RedisConnection::Sentinel"),
        }
    }
}

/// Response timeout of the coordinator's and admin's commands (none of them blocks).
pub const DEFAULT_RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);
/// Connection timeout.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

impl RedisConnection {
    /// Connects to `target` with `response_timeout` for every command.
    ///
    /// # Errors
    /// A [`redis::RedisError`] when the URL is invalid or no server answers in time; for Sentinel
    /// also when no sentinel answers, none monitors the master's name (`InvalidClientConfig`) or
    /// none names a usable master now (`MASTERDOWN`), see [`SentinelConnection`].
    pub async fn connect(
        target: &RedisTarget,
        response_timeout: Duration,
    ) -> redis::RedisResult<Self> {
        install_crypto_provider();
        match target.topology() {
            Topology::Standalone(url) => {
                let client = standalone_client(url, target.tls())?;
                let config = ConnectionManagerConfig::new()
                    .set_response_timeout(Some(response_timeout))
                    .set_connection_timeout(Some(DEFAULT_CONNECT_TIMEOUT))
                    .set_number_of_retries(1);
                match ConnectionManager::new_with_config(client, config).await {
                    Ok(manager) => Ok(RedisConnection::Standalone(manager)),
                    Err(error) => Err(explain_failure(url, error).await),
                }
            }
            Topology::Cluster(nodes) => {
                let certs = tls_certificates(target.tls())?;
                let client = |retries| {
                    let mut builder = ClusterClient::builder(nodes.clone())
                        .response_timeout(response_timeout)
                        .connection_timeout(DEFAULT_CONNECT_TIMEOUT)
                        .retries(retries);
                    if let Some(certs) = &certs {
                        builder = builder.certs(certs.clone());
                    }
                    if target.tls().insecure {
                        builder = builder.tls(redis::TlsMode::Insecure);
                    }
                    builder.build()
                };
                let data_plane = Arc::new(DataPlaneCluster {
                    client: client(0)?,
                    conn: tokio::sync::OnceCell::new(),
                });
                match client(2)?.get_async_connection().await {
                    Ok(conn) => Ok(RedisConnection::Cluster(conn, data_plane)),
                    Err(error) => Err(explain_cluster_failure(nodes, target.tls(), error).await),
                }
            }
            Topology::Sentinel(sentinel) => Ok(RedisConnection::Sentinel(
                SentinelConnection::connect(sentinel, target.tls(), response_timeout).await?,
            )),
        }
    }

    /// The connection for data-plane commands (reads, acks, claims, dead letters): one that
    /// never re-sends a request on its own, so a read whose reply was lost fails (the shard task
    /// then re-reads its own pending entries from `0`) instead of running again and returning
    /// the next batch (docs/design.md §8.10). On a standalone server that is this connection (a
    /// `ConnectionManager` never re-sends); on a cluster a second cluster connection without
    /// retries, made on the first call and shared by every clone of this one (its nodes, its
    /// response timeout). `MOVED`, `ASK` and `TRYAGAIN` then reach the caller too (the slot map is
    /// refreshed all the same): a shard task pauses and tries again.
    ///
    /// # Errors
    /// A [`redis::RedisError`] when the cluster's data-plane connection cannot be made (no node
    /// answers in time); the next call tries again.
    pub async fn for_data_plane(&self) -> redis::RedisResult<RedisConnection> {
        match self {
            // Neither re-sends: a `ConnectionManager` does not, and a Sentinel connection only
            // replaces its manager after a failure, never sends the failed command again.
            RedisConnection::Standalone(_) | RedisConnection::Sentinel(_) => Ok(self.clone()),
            RedisConnection::Cluster(_, data_plane) => {
                let conn = data_plane
                    .conn
                    .get_or_try_init(|| data_plane.client.get_async_connection())
                    .await?
                    .clone();
                Ok(RedisConnection::Cluster(conn, data_plane.clone()))
            }
        }
    }

    /// The data-plane connection of one group member (docs/design.md §8.12): on a standalone
    /// server a new connection to `target` of the member's own (a `ConnectionManager`, which
    /// never re-sends, see [`RedisConnection::for_data_plane`]); on a cluster and on Sentinel
    /// the shared [`RedisConnection::for_data_plane`] one.
    ///
    /// Why one per member: redis-rs parses every reply of a multiplexed connection in that
    /// connection's one driver task, so members sharing one connection share one parser. With
    /// one each, their replies are parsed on the runtime's threads side by side, and a member's
    /// `WAIT` after its acks holds only its own connection (BENCHMARKS.md, "Throughput"). On a
    /// cluster the data-plane connection already keeps one connection per master, each with
    /// its own driver; one set per member would add a connection per master per member. On
    /// Sentinel a connection of the member's own would follow failovers on its own: after a
    /// failover that one connection saw and the other did not, the member would heartbeat on
    /// one master and read on another (docs/design.md §15.3).
    ///
    /// When a standalone server refuses the new connection but answers `PING` on this one
    /// (`maxclients` reached, a proxy's limit per client), this connection is returned, with a
    /// warning: the member's heartbeats go through here, and a member that renewed its shards
    /// without reading them would hold them up.
    ///
    /// # Errors
    /// On a standalone server the new connection's error when this one does not answer either
    /// (Redis unreachable: try again later); as [`RedisConnection::for_data_plane`] on a
    /// cluster and on Sentinel.
    pub(crate) async fn member_data_plane(
        &self,
        target: &RedisTarget,
    ) -> redis::RedisResult<RedisConnection> {
        match self {
            RedisConnection::Standalone(_) => {
                let refused = match RedisConnection::connect(target, DEFAULT_RESPONSE_TIMEOUT).await
                {
                    Ok(own) => return Ok(own),
                    Err(error) => error,
                };
                let mut shared = self.clone();
                redis::cmd("PING").query_async::<()>(&mut shared).await?;
                tracing::warn!(
                    error = %crate::report::Chain(&refused),
                    "the member's own data-plane connection was refused; it reads and acks on the process's connection"
                );
                Ok(shared)
            }
            RedisConnection::Cluster(..) | RedisConnection::Sentinel(_) => {
                self.for_data_plane().await
            }
        }
    }

    /// Whether this is a cluster connection (multi-slot calls must then be split per slot).
    pub fn is_cluster(&self) -> bool {
        matches!(self, RedisConnection::Cluster(..))
    }
}

impl ConnectionLike for RedisConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            RedisConnection::Standalone(c) => c.req_packed_command(cmd),
            RedisConnection::Cluster(c, _) => c.req_packed_command(cmd),
            RedisConnection::Sentinel(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            RedisConnection::Standalone(c) => c.req_packed_commands(pipeline, offset, count),
            RedisConnection::Cluster(c, _) => c.req_packed_commands(pipeline, offset, count),
            RedisConnection::Sentinel(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            RedisConnection::Standalone(c) => c.get_db(),
            RedisConnection::Cluster(c, _) => c.get_db(),
            RedisConnection::Sentinel(c) => c.get_db(),
        }
    }
}

/// What a failed Redis command means to the caller: the one place that reads redis-rs's error
/// kinds and Redis's error codes (docs/design.md §8.14). Modelled on redis-rs's `ErrorKind` and
/// `RedisError::is_timeout`, narrowed to the cases stream-listener acts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RedisFailure {
    /// The connection failed, was refused or dropped, or no cluster node could be reached: an
    /// I/O error. Back off and retry; the connection reconnects by itself.
    ConnectionLost,
    /// No answer within the response or connection timeout (the command may have run).
    Timeout,
    /// The server answers but cannot serve now: `LOADING` (reading its dump at startup),
    /// `CLUSTERDOWN`, `MASTERDOWN`. Back off and retry.
    Unavailable,
    /// `NOSCRIPT`: the script is not in the server's cache (restarted, failed over); the command
    /// did not run. Load the script and send it again.
    NoScript,
    /// `NOGROUP`: the stream or its consumer group does not exist.
    NoGroup,
    /// `BUSYGROUP`: the consumer group exists already.
    BusyGroup,
    /// `OOM`: the server is at `maxmemory` and refuses writes.
    OutOfMemory,
    /// `READONLY`: a write reached a replica (a failover demoted the node).
    ReadOnly,
    /// `MOVED`, `ASK` or `TRYAGAIN`: on a cluster the slot is served elsewhere or is moving.
    ClusterRedirect,
    /// `WRONGTYPE`: a key holds another Redis type than the command needs.
    WrongType,
    /// Anything else: a command Redis refused for another reason, a reply of an unexpected type,
    /// an invalid URL.
    Other,
    /// The TLS handshake failed: the server's certificate did not verify (wrong `tls_ca_file`,
    /// a host name the certificate does not name), the server refused the client (no or a wrong
    /// client certificate), a `redis://` URL reached a server that speaks TLS, or a `rediss://`
    /// URL a plain one. Retrying cannot fix it; [`tls_advice`] says what to check.
    TlsHandshake,
    /// `NOPERM`, or a script's `redis.call` refused by ACL (`ERR The user executing the script
    /// can't ...`): the Redis user lacks the command or the key (README "ACL users"). Retrying
    /// cannot fix it; add the permission to the user's ACL rule.
    NoPermission,
}

impl RedisFailure {
    /// What `error` means. For a pipeline's error, what its first failed command's means.
    pub fn of(error: &redis::RedisError) -> Self {
        use redis::ErrorKind;
        if tls_cause(error).is_some() {
            return RedisFailure::TlsHandshake;
        }
        if error.is_timeout() {
            return RedisFailure::Timeout;
        }
        if error.is_io_error()
            || error.is_connection_refusal()
            || error.is_connection_dropped()
            || error.kind() == ErrorKind::ClusterConnectionNotFound
        {
            return RedisFailure::ConnectionLost;
        }
        if error.code() == Some("ERR") && error.detail().is_some_and(is_script_acl_refusal) {
            return RedisFailure::NoPermission;
        }
        match error.code() {
            Some(code) => RedisFailure::of_code(code),
            // A pipeline's error (`ignore_errors` off) carries the failed commands' errors.
            None => error
                .clone()
                .into_server_errors()
                .and_then(|errors| errors.first().map(|(_, e)| RedisFailure::of_code(e.code())))
                .unwrap_or(RedisFailure::Other),
        }
    }

    /// What a reply means: `None` unless it is an error reply (in a pipeline sent with
    /// `ignore_errors`, or a script's element), else as [`RedisFailure::of`].
    pub fn of_reply(reply: &Value) -> Option<Self> {
        match reply {
            Value::ServerError(error)
                if error.code() == "ERR" && error.details().is_some_and(is_script_acl_refusal) =>
            {
                Some(RedisFailure::NoPermission)
            }
            Value::ServerError(error) => Some(RedisFailure::of_code(error.code())),
            _ => None,
        }
    }

    /// The failure of an error reply whose code (its first word) is `code`.
    fn of_code(code: &str) -> Self {
        match code {
            "NOSCRIPT" => RedisFailure::NoScript,
            "NOGROUP" => RedisFailure::NoGroup,
            "BUSYGROUP" => RedisFailure::BusyGroup,
            "OOM" => RedisFailure::OutOfMemory,
            "READONLY" => RedisFailure::ReadOnly,
            "MOVED" | "ASK" | "TRYAGAIN" => RedisFailure::ClusterRedirect,
            "WRONGTYPE" => RedisFailure::WrongType,
            "LOADING" | "CLUSTERDOWN" | "MASTERDOWN" => RedisFailure::Unavailable,
            "NOPERM" => RedisFailure::NoPermission,
            _ => RedisFailure::Other,
        }
    }

    /// What to check after `error`, for the messages of errors that wrap it: an ACL refusal
    /// ([`RedisFailure::NoPermission`]) names the user's ACL rule, a full server
    /// ([`RedisFailure::OutOfMemory`]) its memory and [`RedisFailure::WrongType`] the overwritten
    /// key; anything else says `otherwise` ("check that
    /// Redis is up and reachable"), which would send an operator whose permission was removed
    /// at runtime, or whose Redis filled up, looking for a network fault.
    pub(crate) fn hint(error: &redis::RedisError, otherwise: &'static str) -> &'static str {
        match RedisFailure::of(error) {
            RedisFailure::NoPermission => {
                "the Redis user's ACL rule refuses a command or key this needs: ACL LOG names it, README \"ACL users\" has the rule"
            }
            RedisFailure::OutOfMemory => {
                "Redis is at maxmemory: running listeners keep consuming (README \"Running in production\"); free memory (retention, trimming, a higher maxmemory) for this to succeed"
            }
            // Retrying cannot fix it, and "check that Redis is up" would send the reader the
            // wrong way: the key was overwritten by hand or by another program.
            RedisFailure::WrongType => {
                "a key holds another Redis type than stream-listener keeps there (written by hand or by another program): find it among the stream's keys with TYPE (docs/design.md §2.1 lists them) and rename or delete it"
            }
            _ => otherwise,
        }
    }

    /// Whether the server (or cluster) could not be reached or could not serve, as opposed to a
    /// command it refused: [`RedisFailure::ConnectionLost`], [`RedisFailure::Timeout`],
    /// [`RedisFailure::Unavailable`]. The admin tool exits with code 3 then, and startup keeps
    /// retrying until `startup_timeout`.
    pub fn is_unreachable(self) -> bool {
        matches!(
            self,
            RedisFailure::ConnectionLost | RedisFailure::Timeout | RedisFailure::Unavailable
        )
    }
}

/// Whether an `ERR` reply's text is Redis 7's refusal of a command or key a script called
/// (`The user executing the script can't run this command or subcommand` / `can't access at least
/// one of the keys`): ACL refusals inside scripts are `ERR`, not `NOPERM`.
fn is_script_acl_refusal(detail: &str) -> bool {
    detail.starts_with("The user executing the script can't")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_never_reach_debug_output() {
        let target = RedisTarget::standalone("redis://u:s3cret@127.0.0.1:7711/0");
        assert_eq!(
            format!("{:?}", target.topology()),
            "Standalone(\"redis://u:***@127.0.0.1:7711/0\")"
        );
        assert_eq!(target.describe(), "redis://u:***@127.0.0.1:7711/0");
        assert_eq!(
            redact_url("redis+unix:///tmp/r.sock?db=1&pass=s3cret"),
            "redis+unix:///tmp/r.sock?db=1&pass=***"
        );
        assert_eq!(
            redact_url("redis://127.0.0.1:6379"),
            "redis://127.0.0.1:6379"
        );
        let cluster = RedisTarget::cluster(vec!["redis://:pw@10.0.0.1:7000".into()]);
        assert!(!format!("{cluster:?}").contains("pw@"));
    }

    #[test]
    fn each_error_code_has_its_failure() {
        let failure = |code: &str| {
            RedisFailure::of(&redis::make_extension_error(
                code.to_owned(),
                Some("detail".to_owned()),
            ))
        };
        let table: [(&[&str], RedisFailure); 10] = [
            (&["NOSCRIPT"], RedisFailure::NoScript),
            (&["NOGROUP"], RedisFailure::NoGroup),
            (&["BUSYGROUP"], RedisFailure::BusyGroup),
            (&["OOM"], RedisFailure::OutOfMemory),
            (&["READONLY"], RedisFailure::ReadOnly),
            (&["MOVED", "ASK", "TRYAGAIN"], RedisFailure::ClusterRedirect),
            (&["WRONGTYPE"], RedisFailure::WrongType),
            (
                &["LOADING", "CLUSTERDOWN", "MASTERDOWN"],
                RedisFailure::Unavailable,
            ),
            (&["ERR"], RedisFailure::Other),
            (&["NOPERM"], RedisFailure::NoPermission),
        ];
        for (code, expected) in table
            .iter()
            .flat_map(|(codes, expected)| codes.iter().map(move |code| (*code, *expected)))
        {
            assert_eq!(failure(code), expected, "{code}");
            assert_eq!(
                expected.is_unreachable(),
                matches!(expected, RedisFailure::Unavailable),
                "{code}"
            );
        }
    }

    #[test]
    fn io_errors_are_lost_connections_or_timeouts() {
        use std::io::{Error, ErrorKind};
        let of = |kind| RedisFailure::of(&redis::RedisError::from(Error::from(kind)));
        assert_eq!(
            of(ErrorKind::ConnectionRefused),
            RedisFailure::ConnectionLost
        );
        assert_eq!(of(ErrorKind::BrokenPipe), RedisFailure::ConnectionLost);
        assert_eq!(of(ErrorKind::TimedOut), RedisFailure::Timeout);
        assert!(of(ErrorKind::ConnectionReset).is_unreachable());
        let config = redis::RedisError::from((redis::ErrorKind::InvalidClientConfig, "bad URL"));
        assert_eq!(RedisFailure::of(&config), RedisFailure::Other);
        assert!(!RedisFailure::of(&config).is_unreachable());
    }

    #[test]
    fn acl_refusals_in_scripts_are_no_permission() {
        let in_script = redis::make_extension_error(
            "ERR".to_owned(),
            Some("The user executing the script can't run this command or subcommand script: 2b58, on @user_script:1.".to_owned()),
        );
        assert_eq!(RedisFailure::of(&in_script), RedisFailure::NoPermission);
        assert!(!RedisFailure::NoPermission.is_unreachable());
        let other = redis::make_extension_error("ERR".to_owned(), Some("syntax error".to_owned()));
        assert_eq!(RedisFailure::of(&other), RedisFailure::Other);
    }

    #[test]
    fn only_error_replies_have_a_failure() {
        assert_eq!(RedisFailure::of_reply(&Value::Okay), None);
        assert_eq!(RedisFailure::of_reply(&Value::Nil), None);
    }
}
