//! A connection to the master that Redis Sentinel names, following failovers by itself
//! (docs/design.md §15.3).
//!
//! Resolution goes through redis-rs's [`redis::sentinel::Sentinel`]: it asks the sentinels in
//! their configured order (`SENTINEL MASTERS`, up to three at once, the first valid answer in
//! order wins), skips a master a sentinel flags `s_down`/`o_down`, and checks the named node's
//! `ROLE` (falling back to `INFO replication`), as Sentinel's client guidelines ask
//! (<https://redis.io/docs/latest/develop/reference/sentinel-clients/>). The master is then served
//! by a [`ConnectionManager`] with the standalone timeouts, whose own `ROLE` is checked once more
//! (the node can be demoted between the two checks).
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
use redis::sentinel::{Sentinel, SentinelNodeConnectionInfo};
use redis::{Cmd, IntoConnectionInfo, Pipeline, RedisError, RedisFuture, RedisResult, Value};

use super::{DEFAULT_CONNECT_TIMEOUT, RedisFailure, SentinelTarget, TlsOptions, redact_url};

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
    /// The sentinels' URLs, to tell an unknown master from a master that is down.
    sentinel_urls: Vec<String>,
    /// The sentinels, for logs (passwords redacted).
    sentinels: String,
    /// redis-rs's resolver, with its cached connections to the sentinels.
    sentinel: tokio::sync::Mutex<Sentinel>,
    /// Credentials, database and TLS mode of the master.
    node: SentinelNodeConnectionInfo,
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
        let (sentinel, node) = sentinels_and_master_node(target, tls)?;
        let config = ConnectionManagerConfig::new()
            .set_response_timeout(Some(response_timeout))
            .set_connection_timeout(Some(DEFAULT_CONNECT_TIMEOUT))
            .set_number_of_retries(1);
        let resolver = Resolver {
            master_name: target.master_name.clone(),
            sentinel_urls: target.sentinels.clone(),
            sentinels: target
                .sentinels
                .iter()
                .map(|s| redact_url(s))
                .collect::<Vec<_>>()
                .join(", "),
            sentinel: tokio::sync::Mutex::new(sentinel),
            node,
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
        let client = {
            let mut sentinel = self.sentinel.lock().await;
            match sentinel
                .async_master_for(&self.master_name, Some(&self.node))
                .await
            {
                Ok(client) => client,
                Err(error) => return Err(self.explain(error).await),
            }
        };
        let addr = client.get_connection_info().addr().to_string();
        let mut manager = ConnectionManager::new_with_config(client, self.config.clone()).await?;
        // The node may have been demoted since redis-rs checked it on its own connection.
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
        Ok((addr, manager))
    }

    /// A clear error for a failed resolution: which sentinels, which master, and whether
    /// retrying can help (the error's kind decides, see [`RedisFailure::is_unreachable`]).
    async fn explain(&self, error: RedisError) -> RedisError {
        if error.kind() != redis::ErrorKind::MasterNameNotFoundBySentinel {
            if RedisFailure::of(&error) == RedisFailure::ConnectionLost {
                // Keep it an I/O error so that startup retries, but say where it looked.
                return RedisError::from(std::io::Error::new(
                    std::io::ErrorKind::ConnectionRefused,
                    format!(
                        "no sentinel of [{}] answered, or the master they named refused the connection: {error}",
                        self.sentinels
                    ),
                ));
            }
            return error;
        }
        // "Not found" also covers a master the sentinels flag down: tell the two apart.
        match self.sentinels_know_master().await {
            Some(true) | None => redis::make_extension_error(
                "MASTERDOWN".to_owned(),
                Some(format!(
                    "the sentinels [{}] report master {:?} down (failover in progress?)",
                    self.sentinels, self.master_name
                )),
            ),
            Some(false) => RedisError::from((
                redis::ErrorKind::InvalidClientConfig,
                "unknown Sentinel master",
                format!(
                    "no sentinel of [{}] monitors a master named {:?} (SENTINEL MASTER: no such master); check [redis] sentinel_master against `sentinel monitor <name> ...`",
                    self.sentinels, self.master_name
                ),
            )),
        }
    }
}

impl Resolver {
    /// What the sentinels say of the master: `Some(true)` when one answers `SENTINEL MASTER
    /// <name>` with it, `Some(false)` when none does and one answered "No such master with that
    /// name", `None` when none answered.
    async fn sentinels_know_master(&self) -> Option<bool> {
        let mut unknown = false;
        for url in &self.sentinel_urls {
            let Ok(client) = redis::Client::open(url.as_str()) else {
                continue;
            };
            let answer = async {
                let mut conn = client.get_multiplexed_async_connection().await?;
                redis::cmd("SENTINEL")
                    .arg("MASTER")
                    .arg(&self.master_name)
                    .query_async::<Value>(&mut conn)
                    .await
            };
            match tokio::time::timeout(DEFAULT_CONNECT_TIMEOUT, answer).await {
                Ok(Ok(_)) => return Some(true),
                Ok(Err(error)) if error.code().is_some() => unknown = true,
                _ => {}
            }
        }
        unknown.then_some(false)
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

/// redis-rs's resolver over the sentinels' URLs, and how to reach the master it names.
///
/// TLS (wired by the lead at merge; this is the single place): with `tls_certificates(tls)`
/// returning certificates, build each sentinel's `ConnectionInfo` through
/// `redis::Client::build_with_tls(url, certs)?.get_connection_info().clone()` before
/// `Sentinel::build`, and give the master the same certificates. redis-rs 1.8.1's public
/// `Sentinel::build` keeps no certificates for the master (only `SentinelClientBuilder`'s
/// `set_client_to_redis_certificates` does), so the master needs that builder or a
/// `build_with_tls` client made from the resolved address.
fn sentinels_and_master_node(
    target: &SentinelTarget,
    tls: &TlsOptions,
) -> RedisResult<(Sentinel, SentinelNodeConnectionInfo)> {
    let sentinel = Sentinel::build(target.sentinels.clone())?;
    Ok((sentinel, node_connection_info(target, tls)?))
}

/// The master's credentials and database, from `master_auth` (the userinfo and path of
/// `[redis] url`; its host is ignored), and its TLS mode (`rediss://`).
fn node_connection_info(
    target: &SentinelTarget,
    tls: &TlsOptions,
) -> RedisResult<SentinelNodeConnectionInfo> {
    let mut node = SentinelNodeConnectionInfo::default();
    if let Some(auth) = &target.master_auth {
        let info = auth.as_str().into_connection_info()?;
        node = node.set_redis_connection_info(info.redis_settings().clone());
        if auth.starts_with("rediss://") {
            node = node.set_tls_mode(if tls.insecure {
                redis::TlsMode::Insecure
            } else {
                redis::TlsMode::Secure
            });
        }
    }
    Ok(node)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_master_credentials_and_database_come_from_master_auth() {
        let mut target = SentinelTarget::new(vec!["redis://127.0.0.1:26379".into()], "mymaster");
        target.master_auth = Some("redis://u:s3cret@_/2".into());
        let node = node_connection_info(&target, &TlsOptions::default()).unwrap();
        let debug = format!("{node:?}");
        assert!(debug.contains("db: 2"), "{debug}");
        assert!(debug.contains("\"u\""), "{debug}");
        assert!(!debug.contains("s3cret"), "{debug}");
        target.master_auth = None;
        let node = node_connection_info(&target, &TlsOptions::default()).unwrap();
        assert!(format!("{node:?}").contains("redis_connection_info: None"));
    }
}
