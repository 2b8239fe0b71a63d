//! A connection to the master that Redis Sentinel names, following failovers by itself
//! (docs/design.md §15.3).
//!
//! Resolution asks the sentinels in their configured order for the master's address
//! (`SENTINEL GET-MASTER-ADDR-BY-NAME`; the first that answers wins), connects a
//! [`ConnectionManager`] with the standalone timeouts to it and checks its `ROLE`, as Sentinel's
//! client guidelines ask (<https://redis.io/docs/latest/develop/reference/sentinel-clients/>): a
//! node that answers as a replica (a failover in progress) is not used. The resolution is ours,
//! not redis-rs's `Sentinel`, because redis-rs 1.8.1 connects to the master it names without the
//! TLS certificates of `[redis] tls_*` (only the system's roots), so a master behind a private CA
//! could not be verified; here the sentinels and the master are both reached with
//! [`super::tls::client_of`].
//!
//! Following a failover: a command that fails with a lost connection, a timeout or `READONLY`
//! (the old master came back as a replica) starts a re-resolution in the background, at most one
//! at a time for all clones; once the sentinels name a master at another address, a new manager
//! replaces the old one. The failed command's error still reaches the caller: nothing is re-sent
//! here (the data plane relies on a connection that never re-sends, docs/design.md §8.10), and
//! the caller's own retry goes to the new master.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock, Weak};
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::{
    Client, Cmd, ConnectionAddr, IntoConnectionInfo, Pipeline, RedisConnectionInfo, RedisError,
    RedisFuture, RedisResult, Value,
};

use super::{DEFAULT_CONNECT_TIMEOUT, RedisFailure, SentinelTarget, TlsOptions, redact_urls};

/// First pause between two failed re-resolutions; doubled up to [`MAX_RETRY_DELAY`].
const FIRST_RETRY_DELAY: Duration = Duration::from_millis(100);
/// Longest pause between two failed re-resolutions (a failover takes Sentinel's
/// `down-after-milliseconds` plus an election: seconds).
const MAX_RETRY_DELAY: Duration = Duration::from_secs(1);

/// A cloneable connection to the master of a [`SentinelTarget`]. Clones share the current
/// master's multiplexed connection and the re-resolution.
#[derive(Clone)]
pub struct SentinelConnection {
    shared: Arc<Shared>,
}

/// What every clone shares.
struct Shared {
    resolver: Resolver,
    current: RwLock<Master>,
    /// Bumped each time the manager is replaced: a failure seen on an older one is stale.
    generation: AtomicU64,
    /// Set while a re-resolution runs (one at a time).
    resolving: AtomicBool,
}

/// How the master is found and connected to.
struct Resolver {
    master_name: String,
    /// Clients of the sentinels, in their configured order (with the TLS files).
    sentinel_clients: Vec<Client>,
    /// The sentinels, for logs (passwords redacted).
    sentinels: String,
    /// Credentials, database and TLS of the master.
    master: MasterSettings,
    config: ConnectionManagerConfig,
    /// Bound on one whole resolution (sentinels, role checks, connecting).
    resolve_timeout: Duration,
}

/// The master in use.
#[derive(Clone)]
struct Master {
    /// `host:port` as the sentinels name it.
    addr: String,
    manager: ConnectionManager,
    generation: u64,
}

impl SentinelConnection {
    /// Resolves the master of `target` through its sentinels and connects to it, with
    /// `response_timeout` for every command.
    ///
    /// # Errors
    /// - no sentinel answers: an I/O error (`ConnectionLost`, retried by startup) naming them;
    /// - no sentinel monitors a master of that name: `InvalidClientConfig` (retrying cannot fix it);
    /// - the sentinels know the master but none names a usable one now (down, failover in
    ///   progress, it refuses connections or is not a master): a `MASTERDOWN` error or the
    ///   master's own I/O error (both retried by startup);
    /// - an invalid URL, or the master refuses the credentials.
    pub(crate) async fn connect(
        target: &SentinelTarget,
        tls: &TlsOptions,
        response_timeout: Duration,
    ) -> RedisResult<Self> {
        let sentinel_clients = target
            .sentinels
            .iter()
            .map(|url| {
                let tls = if url.starts_with("rediss://") {
                    tls
                } else {
                    &TlsOptions::default()
                };
                super::tls::client_of(url.as_str().into_connection_info()?, tls)
            })
            .collect::<RedisResult<Vec<_>>>()?;
        let master = master_settings(target, tls)?;
        let config = ConnectionManagerConfig::new()
            .set_response_timeout(Some(response_timeout))
            .set_connection_timeout(Some(DEFAULT_CONNECT_TIMEOUT))
            .set_number_of_retries(1);
        let resolver = Resolver {
            master_name: target.master_name.clone(),
            sentinel_clients,
            sentinels: redact_urls(&target.sentinels).join(", "),
            master,
            config,
            resolve_timeout: DEFAULT_CONNECT_TIMEOUT + response_timeout,
        };
        let (addr, manager) = resolver.resolve().await?;
        tracing::info!(
            master_name = %resolver.master_name,
            master = %addr,
            "connected to the master Sentinel names"
        );
        Ok(SentinelConnection {
            shared: Arc::new(Shared {
                resolver,
                current: RwLock::new(Master {
                    addr,
                    manager,
                    generation: 0,
                }),
                generation: AtomicU64::new(0),
                resolving: AtomicBool::new(false),
            }),
        })
    }

    /// `host:port` of the master in use, as the sentinels named it.
    pub fn master_addr(&self) -> String {
        self.shared.current().addr
    }

    fn current(&self) -> Master {
        self.shared.current()
    }

    /// Starts a re-resolution when `error` (seen on the manager of `generation`) means the
    /// master may have changed.
    fn on_error(&self, error: &RedisError, generation: u64) {
        let failure = RedisFailure::of(error);
        let suspicious = matches!(
            failure,
            RedisFailure::ConnectionLost | RedisFailure::Timeout | RedisFailure::ReadOnly
        );
        if !suspicious || generation != self.shared.generation.load(Ordering::Acquire) {
            return;
        }
        if self.shared.resolving.swap(true, Ordering::AcqRel) {
            return;
        }
        tracing::warn!(
            master_name = %self.shared.resolver.master_name,
            master = %self.shared.current().addr,
            ?failure,
            "a command to the master failed; asking the sentinels which node is master"
        );
        tokio::spawn(re_resolve(Arc::downgrade(&self.shared)));
    }
}

/// Asks the sentinels until they name a usable master, then replaces the manager if the master
/// moved. Stops when every connection is dropped.
async fn re_resolve(shared: Weak<Shared>) {
    let mut delay = FIRST_RETRY_DELAY;
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        let Some(strong) = shared.upgrade() else {
            return;
        };
        match strong.resolver.resolve().await {
            Ok((addr, manager)) => {
                strong.replace(addr, manager);
                strong.resolving.store(false, Ordering::Release);
                return;
            }
            // Logged at attempts 1, 2, 4, 8...: a master that stays down is not a line a second.
            Err(error) if attempts.is_power_of_two() => {
                tracing::warn!(
                    master_name = %strong.resolver.master_name,
                    attempts,
                    error = %error,
                    "no usable master yet (failover in progress?); asking the sentinels again"
                );
            }
            Err(_) => {}
        }
        drop(strong);
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(MAX_RETRY_DELAY);
    }
}

impl Shared {
    fn current(&self) -> Master {
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Puts the manager of the master at `addr` in use, unless that master is already in use (a
    /// timeout on a healthy master: its own manager reconnects by itself).
    fn replace(&self, addr: String, manager: ConnectionManager) {
        let master_name = &self.resolver.master_name;
        let mut current = self.current.write().unwrap_or_else(PoisonError::into_inner);
        if current.addr == addr {
            tracing::info!(%master_name, master = %addr, "the master has not moved");
            return;
        }
        let generation = self.generation.fetch_add(1, Ordering::AcqRel) + 1;
        tracing::warn!(
            %master_name,
            old_master = %current.addr,
            master = %addr,
            "the master moved (Sentinel failover): commands now go to the new master"
        );
        *current = Master {
            addr,
            manager,
            generation,
        };
    }
}

impl Resolver {
    /// One resolution, bounded by `resolve_timeout`: the master's address and a manager
    /// connected to it whose node answered `ROLE` as master.
    async fn resolve(&self) -> RedisResult<(String, ConnectionManager)> {
        match tokio::time::timeout(self.resolve_timeout, self.resolve_unbounded()).await {
            Ok(result) => result,
            Err(_) => Err(RedisError::from(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "the sentinels [{}] named no master {:?} within {}",
                    self.sentinels,
                    self.master_name,
                    humantime::format_duration(self.resolve_timeout)
                ),
            ))),
        }
    }

    async fn resolve_unbounded(&self) -> RedisResult<(String, ConnectionManager)> {
        let (host, port) = self.ask_sentinels().await?;
        let addr = format!("{host}:{port}");
        let client = self.master.client(host, port)?;
        let mut manager = ConnectionManager::new_with_config(client, self.config.clone())
            .await
            .map_err(|error| self.unreachable_master(&addr, error))?;
        // A failover in progress: the sentinels may still name the old master, now demoted.
        let role: redis::Role = redis::cmd("ROLE").query_async(&mut manager).await?;
        if !matches!(role, redis::Role::Primary { .. }) {
            return Err(redis::make_extension_error(
                "MASTERDOWN".to_owned(),
                Some(format!(
                    "{addr}, named master {:?} by the sentinels, answers ROLE as a replica (failover in progress)",
                    self.master_name
                )),
            ));
        }
        // The ROLE check can take as long as the node was frozen (`SIGSTOP`, a stalled VM): if
        // Sentinel promoted another node meanwhile, the old one answers "master" once it runs
        // again, until Sentinel converts it, and the writes it takes are dropped when it resyncs.
        // So the sentinels must still name this node after its ROLE answer.
        let (again_host, again_port) = self.ask_sentinels().await?;
        let again = format!("{again_host}:{again_port}");
        if again != addr {
            return Err(redis::make_extension_error(
                "MASTERDOWN".to_owned(),
                Some(format!(
                    "{addr} answered ROLE as master {:?}, but the sentinels now name {again} (a failover during the check)",
                    self.master_name
                )),
            ));
        }
        Ok((addr, manager))
    }

    /// `error` of connecting to the master at `addr`, naming `addr` when the connection was
    /// refused or dropped: redis-rs's "Connection refused" alone does not say that the sentinels
    /// named a node that is not there. Other errors (TLS, credentials) are returned as they are,
    /// their types intact.
    fn unreachable_master(&self, addr: &str, error: RedisError) -> RedisError {
        if RedisFailure::of(&error) != RedisFailure::ConnectionLost {
            return error;
        }
        RedisError::from(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            format!(
                "the sentinels [{}] name {addr} as master {:?}, but it cannot be reached: {error}",
                self.sentinels, self.master_name
            ),
        ))
    }

    /// The master's `(host, port)` from the first sentinel that answers
    /// `SENTINEL GET-MASTER-ADDR-BY-NAME`, asked in their configured order.
    ///
    /// # Errors
    /// - every sentinel that answered knows no master of that name: `InvalidClientConfig`
    ///   (retrying cannot fix it);
    /// - a sentinel's TLS handshake failed and none answered: that error
    ///   ([`RedisFailure::TlsHandshake`], startup stops at once);
    /// - none answered: an I/O error naming them (startup retries it).
    async fn ask_sentinels(&self) -> RedisResult<(String, u16)> {
        let mut unknown = false;
        let mut last_error = None;
        // Kept with its type: a handshake that failed is not an unreachable sentinel, and
        // retrying cannot fix it (RedisFailure::TlsHandshake, docs/design.md §15.1).
        let mut tls_error = None;
        for client in &self.sentinel_clients {
            let answer = async {
                let mut conn = client.get_multiplexed_async_connection().await?;
                redis::cmd("SENTINEL")
                    .arg("GET-MASTER-ADDR-BY-NAME")
                    .arg(&self.master_name)
                    .query_async::<Option<(String, u16)>>(&mut conn)
                    .await
            };
            match tokio::time::timeout(DEFAULT_CONNECT_TIMEOUT, answer).await {
                Ok(Ok(Some(addr))) => return Ok(addr),
                Ok(Ok(None)) => unknown = true,
                Ok(Err(error)) if RedisFailure::of(&error) == RedisFailure::TlsHandshake => {
                    last_error = Some(error.to_string());
                    tls_error.get_or_insert(error);
                }
                Ok(Err(error)) => last_error = Some(error.to_string()),
                Err(_) => last_error = Some("no answer in time".to_owned()),
            }
        }
        if unknown {
            return Err(RedisError::from((
                redis::ErrorKind::InvalidClientConfig,
                "unknown Sentinel master",
                format!(
                    "no sentinel of [{}] monitors a master named {:?} (SENTINEL GET-MASTER-ADDR-BY-NAME: nil); check [redis] sentinel_master against `sentinel monitor <name> ...`",
                    self.sentinels, self.master_name
                ),
            )));
        }
        if let Some(error) = tls_error {
            return Err(error);
        }
        Err(RedisError::from(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            format!(
                "no sentinel of [{}] answered: {}",
                self.sentinels,
                last_error.unwrap_or_default()
            ),
        )))
    }
}

impl ConnectionLike for SentinelConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        let Master {
            mut manager,
            generation,
            ..
        } = self.current();
        Box::pin(async move {
            let result = manager.req_packed_command(cmd).await;
            if let Err(error) = &result {
                self.on_error(error, generation);
            }
            result
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        let Master {
            mut manager,
            generation,
            ..
        } = self.current();
        Box::pin(async move {
            let result = manager.req_packed_commands(pipeline, offset, count).await;
            if let Err(error) = &result {
                self.on_error(error, generation);
            }
            result
        })
    }

    fn get_db(&self) -> i64 {
        self.current().manager.get_db()
    }
}

/// How the master is reached: its credentials and database (from `master_auth`, the userinfo
/// and path of `[redis] url`; its host is ignored), whether it speaks TLS (`master_auth` is
/// `rediss://`, or, without one, the sentinels' URLs are), and the TLS files.
struct MasterSettings {
    redis: RedisConnectionInfo,
    tls: Option<TlsOptions>,
}

impl MasterSettings {
    /// A client of the master at `host:port`.
    fn client(&self, host: String, port: u16) -> RedisResult<Client> {
        let addr = match &self.tls {
            Some(tls) => ConnectionAddr::TcpTls {
                host,
                port,
                insecure: tls.insecure,
                tls_params: None,
            },
            None => ConnectionAddr::Tcp(host, port),
        };
        let info = addr
            .into_connection_info()?
            .set_redis_settings(self.redis.clone());
        super::tls::client_of(info, self.tls.as_ref().unwrap_or(&TlsOptions::default()))
    }
}

fn master_settings(target: &SentinelTarget, tls: &TlsOptions) -> RedisResult<MasterSettings> {
    let (redis, secure) = match &target.master_auth {
        Some(auth) => (
            auth.as_str()
                .into_connection_info()?
                .redis_settings()
                .clone(),
            auth.starts_with("rediss://"),
        ),
        None => (
            RedisConnectionInfo::default(),
            target.sentinels.iter().all(|s| s.starts_with("rediss://")),
        ),
    };
    Ok(MasterSettings {
        redis,
        tls: secure.then(|| tls.clone()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_master_credentials_and_database_come_from_master_auth() {
        let mut target = SentinelTarget::new(vec!["redis://127.0.0.1:26379".into()], "mymaster");
        target.master_auth = Some("redis://u:s3cret@_/2".into());
        let master = master_settings(&target, &TlsOptions::default()).unwrap();
        let debug = format!("{:?}", master.redis);
        assert_eq!(master.redis.db(), 2, "{debug}");
        assert_eq!(master.redis.username(), Some("u"), "{debug}");
        assert!(!debug.contains("s3cret"), "{debug}");
        assert!(master.tls.is_none());
        target.master_auth = Some("rediss://_/0".into());
        assert!(
            master_settings(&target, &TlsOptions::default())
                .unwrap()
                .tls
                .is_some()
        );
        target.master_auth = None;
        let master = master_settings(&target, &TlsOptions::default()).unwrap();
        assert_eq!(master.redis.username(), None);
        assert!(master.tls.is_none());
    }
}
