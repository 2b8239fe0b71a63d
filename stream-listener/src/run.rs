//! `run()`: from the config file and the registered listeners to running group members
//! (docs/design.md §7, §8.13 shutdown, §11).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use stream_listener_core::admin::{self, AdminError};
use stream_listener_core::config::{Config, ConfigError, redact_url};
use stream_listener_core::connection::{
    DEFAULT_RESPONSE_TIMEOUT, RedisConnection, RedisFailure, RedisTarget,
};
use stream_listener_core::keys::StreamKeys;
use stream_listener_core::member::{
    EventCallback, Listener, ListenerError, ListenerEvent, ListenerHandle, ListenerOptions,
    MemberStatus,
};
use stream_listener_core::model::ShardIndex;
use stream_listener_core::store::load_stream_metadata;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::registry::{ListenerRegistration, registered_listeners};

/// The oldest Redis `run()` accepts (docs/design.md §1): `XAUTOCLAIM`'s reply and the purging of
/// trimmed entries by `XCLAIM` are from 7.0.
pub const MINIMUM_REDIS_VERSION: (u32, u32, u32) = (7, 0, 0);

/// Why [`run`], [`run_with`] or [`run_listeners`] could not start, or [`run`] stopped.
///
/// Its `Debug` output is its message, so `fn main() -> Result<(), RunError>` prints the readable
/// error (file, line and key of a config mistake; what to do) rather than a struct dump.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    /// The configuration is invalid (file, line and key are named), or configures a listener
    /// that does not exist.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A member stopped for good (another process took its static identity): the app stopped.
    #[error("member {} stopped: {}", .0.member_id, .0.reason)]
    MemberStopped(stream_listener_core::member::MemberStopped),
    /// No listener is registered: nothing would run.
    #[error(
        "no listeners are registered: annotate an `async fn` with #[stream_listener(stream = \"...\", group = \"...\")] in this program (inventory registration needs the function's crate to be linked into the binary)"
    )]
    NoListeners,
    /// Two listeners have the same name (their `[listeners.<name>]` section would be shared).
    #[error(
        "two listeners are named {name:?}: {first} and {second}; give one of them another `name = \"...\"`"
    )]
    DuplicateName {
        /// The name.
        name: String,
        /// The first listener (name, module, file and line).
        first: String,
        /// The second listener.
        second: String,
    },
    /// Two listeners consume the same stream in the same consumer group (docs/design.md §11): they
    /// would be members of one group with different handlers.
    #[error(
        "listeners {first} and {second} both consume stream {stream:?} in consumer group {group:?}; use one listener, or give one of them another group"
    )]
    DuplicateStreamGroup {
        /// The stream prefix.
        stream: String,
        /// The consumer group.
        group: String,
        /// The first listener.
        first: String,
        /// The second listener.
        second: String,
    },
    /// A listener's name, stream, group or settings are invalid.
    #[error("listener `{listener}`: {source}")]
    Listener {
        /// The listener's name.
        listener: String,
        /// What is wrong.
        #[source]
        source: ListenerError,
    },
    /// Redis did not answer within `startup_timeout`.
    #[error(
        "cannot reach Redis at {target} after {attempts} attempts in {} (startup_timeout): {last_error}; check that Redis is running and that [redis] url / cluster_nodes (or REDIS_URL) points at it",
        humantime::format_duration(*waited)
    )]
    RedisUnreachable {
        /// The URL or cluster nodes (passwords replaced by `***`).
        target: String,
        /// How long it tried.
        waited: Duration,
        /// Connection attempts made.
        attempts: u32,
        /// The last error.
        last_error: String,
    },
    /// Redis answered but refused or failed a command (authentication, ACL, ...).
    #[error("Redis at {target} failed: {detail}")]
    Redis {
        /// The URL or cluster nodes (passwords replaced by `***`).
        target: String,
        /// What failed.
        detail: String,
    },
    /// The Redis server is older than 7.0.
    #[error(
        "Redis {found} at {target} is too old: stream-listener needs Redis {}.{}.{} or newer; upgrade the server",
        MINIMUM_REDIS_VERSION.0, MINIMUM_REDIS_VERSION.1, MINIMUM_REDIS_VERSION.2
    )]
    RedisTooOld {
        /// The version `INFO server` reported (the oldest node of a cluster).
        found: String,
        /// The URL or cluster nodes.
        target: String,
    },
    /// A listener's stream does not exist and the config gives it no `shards`.
    #[error(
        "stream {stream:?} of listener `{listener}` does not exist; create it with `stream-listener stream create {stream} --shards N`, or add\n\n    [streams.{stream}]\n    shards = N\n\nto the config file so that run() creates it at startup"
    )]
    MissingStream {
        /// The stream prefix.
        stream: String,
        /// The listener that consumes it.
        listener: String,
    },
    /// Creating or checking a stream failed.
    #[error("stream {stream:?}: {source}")]
    Stream {
        /// The stream prefix.
        stream: String,
        /// The admin error.
        #[source]
        source: AdminError,
    },
    /// The SIGINT/SIGTERM handlers could not be installed.
    #[error("cannot install the SIGINT/SIGTERM handlers: {0}")]
    Signal(#[source] std::io::Error),
}

impl std::fmt::Debug for RunError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

/// Loads the configuration ([`Config::load`]: `STREAM_LISTENER_CONFIG` or
/// `stream-listener.toml`, then `REDIS_URL` and `STREAM_LISTENER_INSTANCE_ID`), starts every
/// listener registered with `#[stream_listener(...)]`, logs the assignment as it settles, and
/// shuts down gracefully on SIGINT or SIGTERM: in-flight handlers finish within
/// `shutdown_timeout`, finished entries are acked, members leave the group (docs/design.md §8).
///
/// ```no_run
/// #[tokio::main]
/// async fn main() -> Result<(), stream_listener::RunError> {
///     stream_listener::run().await
/// }
/// ```
///
/// `run()` installs no `tracing` subscriber: install one in `main` to see its logs.
///
/// # Errors
/// Everything [`run_with`] returns, before anything runs; [`RunError::Signal`] when the signal
/// handlers cannot be installed. Once the members run, `run()` returns `Ok(())` after a graceful
/// shutdown.
pub async fn run() -> Result<(), RunError> {
    let config = Config::load()?;
    let app = run_with(config).await?;
    app.run_until_signal().await
}

/// Starts every registered listener with `config` (no environment variables are read: apply
/// them with [`Config::apply_env`] or use [`Config::load`]) and returns at once with a handle.
/// For tests and for programs that embed listeners in a larger service.
///
/// # Errors
/// As [`run_listeners`] with [`registered_listeners`]; [`RunError::NoListeners`] when none is
/// registered.
pub async fn run_with(config: Config) -> Result<RunningApp, RunError> {
    run_listeners(config, registered_listeners()).await
}

/// Starts `listeners` (rather than every registered one) with `config`. In order:
///
/// 1. checks the config and the listeners, without contacting Redis: names, duplicate names,
///    two listeners on one (stream, group), `[listeners.<name>]` sections for listeners that do
///    not exist, the merged settings (config overrides over the values given in code);
/// 2. connects (standalone or cluster), retrying with capped backoff (100 ms doubling to 2 s)
///    while Redis does not answer, for at most `[redis] startup_timeout`;
/// 3. checks that Redis is 7.0 or newer (`INFO server`);
/// 4. creates each `[streams.<prefix>]` with `shards` that does not exist (an existing stream
///    keeps its shard count);
/// 5. checks that every listener's stream exists;
/// 6. starts the members of every listener (`concurrency` per listener; static membership from
///    `[member] instance_id`), and a task that logs each listener's assignment once it has not
///    changed for two heartbeat intervals.
///
/// # Errors
/// [`RunError::Config`], [`RunError::NoListeners`], [`RunError::DuplicateName`],
/// [`RunError::DuplicateStreamGroup`], [`RunError::Listener`] (step 1, nothing sent to Redis);
/// [`RunError::RedisUnreachable`] once `startup_timeout` has passed, or [`RunError::Redis`] at
/// once for errors retrying cannot fix (step 2); [`RunError::RedisTooOld`] (3);
/// [`RunError::Stream`] (4); [`RunError::MissingStream`] (5); [`RunError::Listener`] when a
/// listener cannot start (6: the ones already started are shut down first).
pub async fn run_listeners(
    config: Config,
    listeners: Vec<ListenerRegistration>,
) -> Result<RunningApp, RunError> {
    config.validate()?;
    let target = config.redis.target();
    let log = Arc::new(AssignmentLog::default());
    let planned = plan(&config, &target, listeners, &log)?;
    let mut conn = connect(&target, config.redis.startup_timeout).await?;
    check_version(&mut conn, &target).await?;
    provision(&mut conn, &config, &target).await?;
    for planned in &planned {
        let keys =
            StreamKeys::new(planned.registration.stream()).map_err(|e| RunError::Listener {
                listener: planned.registration.name().to_owned(),
                source: ListenerError::Name(e),
            })?;
        let exists = load_stream_metadata(&mut conn, &keys)
            .await
            .map_err(|e| RunError::Redis {
                target: describe_target(&target),
                detail: e.to_string(),
            })?
            .is_some();
        if !exists {
            return Err(RunError::MissingStream {
                stream: planned.registration.stream().to_owned(),
                listener: planned.registration.name().to_owned(),
            });
        }
    }
    let mut running: Vec<RunningListener> = Vec::new();
    for Planned {
        registration,
        listener,
    } in planned
    {
        match listener.start().await {
            Ok(handle) => {
                log.add_listener(registration.name(), &handle.member_ids());
                tracing::info!(
                    listener = registration.name(),
                    stream = registration.stream(),
                    group = registration.group(),
                    members = handle.member_ids().len(),
                    "listener started"
                );
                running.push(RunningListener {
                    registration,
                    handle,
                });
            }
            Err(source) => {
                for started in running {
                    started.handle.shutdown_and_wait().await;
                }
                return Err(RunError::Listener {
                    listener: registration.name().to_owned(),
                    source,
                });
            }
        }
    }
    let shutdown = CancellationToken::new();
    let tokens: Vec<CancellationToken> =
        running.iter().map(|l| l.handle.shutdown_token()).collect();
    {
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            shutdown.cancelled().await;
            for token in tokens {
                token.cancel();
            }
        });
    }
    // A rebalance moves shards over a few heartbeats (revoke, then assign): log once nothing
    // has changed for two heartbeat intervals.
    let settle = config.coordination.heartbeat_interval * 2;
    tokio::spawn(log.clone().run(settle, shutdown.clone()));
    Ok(RunningApp {
        listeners: running,
        shutdown,
    })
}

struct Planned {
    registration: ListenerRegistration,
    listener: Listener,
}

/// Step 1: everything that can be checked without Redis.
fn plan(
    config: &Config,
    target: &RedisTarget,
    mut listeners: Vec<ListenerRegistration>,
    log: &Arc<AssignmentLog>,
) -> Result<Vec<Planned>, RunError> {
    if listeners.is_empty() {
        return Err(RunError::NoListeners);
    }
    listeners
        .sort_by(|a, b| (a.name(), a.stream(), a.group()).cmp(&(b.name(), b.stream(), b.group())));
    let mut by_name: BTreeMap<&str, &ListenerRegistration> = BTreeMap::new();
    let mut by_stream_group: BTreeMap<(&str, &str), &ListenerRegistration> = BTreeMap::new();
    for registration in &listeners {
        if let Some(first) = by_name.insert(registration.name(), registration) {
            return Err(RunError::DuplicateName {
                name: registration.name().to_owned(),
                first: first.describe(),
                second: registration.describe(),
            });
        }
        let key = (registration.stream(), registration.group());
        if let Some(first) = by_stream_group.insert(key, registration) {
            return Err(RunError::DuplicateStreamGroup {
                stream: registration.stream().to_owned(),
                group: registration.group().to_owned(),
                first: first.describe(),
                second: registration.describe(),
            });
        }
    }
    config.check_listener_names(listeners.iter().map(|l| l.name()))?;
    let mut planned = Vec::new();
    for registration in listeners {
        let mut base = ListenerOptions::default();
        base.concurrency = registration.concurrency();
        let mut options = config.listener_options(registration.name(), base)?;
        options.events = Some(log.callback(registration.name()));
        let listener = Listener::new(
            target.clone(),
            registration.stream(),
            registration.group(),
            registration.handler(),
            options,
        )
        .map_err(|source| RunError::Listener {
            listener: registration.name().to_owned(),
            source,
        })?;
        planned.push(Planned {
            registration,
            listener,
        });
    }
    Ok(planned)
}

fn describe_target(target: &RedisTarget) -> String {
    match target {
        RedisTarget::Standalone(url) => redact_url(url),
        RedisTarget::Cluster(nodes) => format!(
            "cluster [{}]",
            nodes
                .iter()
                .map(|n| redact_url(n))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// Step 2: connect and `PING`, with capped retries until `startup_timeout`.
async fn connect(
    target: &RedisTarget,
    startup_timeout: Duration,
) -> Result<RedisConnection, RunError> {
    let started = Instant::now();
    let deadline = started + startup_timeout;
    let mut delay = Duration::from_millis(100);
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        let remaining = deadline.saturating_duration_since(Instant::now());
        let attempt = async {
            let mut conn = RedisConnection::connect(target, DEFAULT_RESPONSE_TIMEOUT).await?;
            redis::cmd("PING").query_async::<()>(&mut conn).await?;
            Ok::<_, redis::RedisError>(conn)
        };
        let last_error = match tokio::time::timeout(remaining, attempt).await {
            Ok(Ok(conn)) => {
                if attempts > 1 {
                    tracing::info!(attempts, "connected to Redis");
                }
                return Ok(conn);
            }
            Ok(Err(error)) if !RedisFailure::of(&error).is_unreachable() => {
                return Err(RunError::Redis {
                    target: describe_target(target),
                    detail: error.to_string(),
                });
            }
            Ok(Err(error)) => error.to_string(),
            Err(_) => "no answer before startup_timeout".to_owned(),
        };
        let now = Instant::now();
        if now + delay >= deadline {
            return Err(RunError::RedisUnreachable {
                target: describe_target(target),
                waited: now - started,
                attempts,
                last_error,
            });
        }
        if attempts == 1 || attempts.is_power_of_two() {
            tracing::warn!(
                target = %describe_target(target),
                attempts,
                error = %last_error,
                "Redis does not answer yet; retrying until startup_timeout"
            );
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_secs(2));
    }
}

/// Step 3: `INFO server` on every node; the oldest `redis_version` must be at least 7.0.
async fn check_version(conn: &mut RedisConnection, target: &RedisTarget) -> Result<(), RunError> {
    let reply: redis::Value = redis::cmd("INFO")
        .arg("server")
        .query_async(conn)
        .await
        .map_err(|e| RunError::Redis {
            target: describe_target(target),
            detail: format!("INFO server failed: {e}"),
        })?;
    let mut texts = Vec::new();
    collect_text(&reply, &mut texts);
    let versions: Vec<(u32, u32, u32)> = texts.iter().filter_map(|t| redis_version(t)).collect();
    match versions.iter().min() {
        Some(&oldest) if oldest < MINIMUM_REDIS_VERSION => Err(RunError::RedisTooOld {
            found: format!("{}.{}.{}", oldest.0, oldest.1, oldest.2),
            target: describe_target(target),
        }),
        Some(_) => Ok(()),
        None => {
            tracing::warn!("INFO server reported no redis_version; cannot check for Redis 7.0");
            Ok(())
        }
    }
}

fn collect_text(value: &redis::Value, out: &mut Vec<String>) {
    match value {
        redis::Value::BulkString(bytes) => out.push(String::from_utf8_lossy(bytes).into_owned()),
        redis::Value::SimpleString(s) | redis::Value::VerbatimString { text: s, .. } => {
            out.push(s.clone())
        }
        redis::Value::Array(items) | redis::Value::Set(items) => {
            items.iter().for_each(|v| collect_text(v, out))
        }
        redis::Value::Map(pairs) => pairs.iter().for_each(|(k, v)| {
            collect_text(k, out);
            collect_text(v, out);
        }),
        _ => {}
    }
}

/// `redis_version:7.2.4` in an `INFO` reply → `(7, 2, 4)`.
pub(crate) fn redis_version(info: &str) -> Option<(u32, u32, u32)> {
    let line = info
        .lines()
        .find_map(|l| l.trim().strip_prefix("redis_version:"))?;
    let mut parts = line.trim().split('.').map(|p| {
        p.chars()
            .take_while(char::is_ascii_digit)
            .collect::<String>()
            .parse::<u32>()
            .ok()
    });
    let major = parts.next()??;
    let minor = parts.next().flatten().unwrap_or(0);
    let patch = parts.next().flatten().unwrap_or(0);
    Some((major, minor, patch))
}

/// Step 4: create the configured streams that do not exist.
async fn provision(
    conn: &mut RedisConnection,
    config: &Config,
    target: &RedisTarget,
) -> Result<(), RunError> {
    for (prefix, stream) in &config.streams {
        let Some(shards) = stream.shards else {
            continue;
        };
        match admin::create_stream(conn, prefix, shards).await {
            Ok(created) if created.created => {
                tracing::info!(stream = %prefix, shards, "stream created");
            }
            Ok(_) => tracing::debug!(stream = %prefix, shards, "stream exists"),
            Err(AdminError::ShardCountMismatch { existing, .. }) => tracing::warn!(
                stream = %prefix,
                existing,
                configured = shards,
                "stream exists with another shard count; keeping it (change it with `stream-listener stream scale`)"
            ),
            Err(error) if error.is_redis_unreachable() => {
                return Err(RunError::Redis {
                    target: describe_target(target),
                    detail: error.to_string(),
                });
            }
            Err(source) => {
                return Err(RunError::Stream {
                    stream: prefix.clone(),
                    source,
                });
            }
        }
    }
    Ok(())
}

struct RunningListener {
    registration: ListenerRegistration,
    handle: ListenerHandle,
}

/// One listener's state, from [`RunningApp::status`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ListenerStatus {
    /// The listener's name.
    pub name: String,
    /// Its stream prefix.
    pub stream: String,
    /// Its consumer group.
    pub group: String,
    /// Each member: id, epoch, owned shards, entries handled.
    pub members: Vec<MemberStatus>,
}

impl ListenerStatus {
    /// Every shard some member of this listener owns now, ascending.
    pub fn owned_shards(&self) -> Vec<ShardIndex> {
        let set: BTreeSet<ShardIndex> = self
            .members
            .iter()
            .flat_map(|m| m.owned.iter().copied())
            .collect();
        set.into_iter().collect()
    }
}

/// The running listeners of [`run_with`] or [`run_listeners`].
///
/// Dropping it does not stop the members: call [`RunningApp::shutdown_and_wait`] (or
/// [`RunningApp::run_until_signal`]) for a graceful shutdown.
#[derive(Debug)]
pub struct RunningApp {
    listeners: Vec<RunningListener>,
    shutdown: CancellationToken,
}

impl std::fmt::Debug for RunningListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunningListener")
            .field("name", &self.registration.name())
            .field("members", &self.handle.member_ids())
            .finish()
    }
}

impl RunningApp {
    /// What every member of every listener owns and has handled now, listeners by name.
    pub fn status(&self) -> Vec<ListenerStatus> {
        self.listeners
            .iter()
            .map(|l| ListenerStatus {
                name: l.registration.name().to_owned(),
                stream: l.registration.stream().to_owned(),
                group: l.registration.group().to_owned(),
                members: l.handle.status(),
            })
            .collect()
    }

    /// Waits until, for every listener, this process's members together own `shards` distinct
    /// shards, each once, spread evenly (no member owns more than one shard above another), or `timeout`
    /// passes. Returns whether they do. For tests and demos where this process is the whole
    /// group and wants a settled assignment before it publishes.
    pub async fn wait_for_assignment(&self, shards: usize, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let settled = self.status().iter().all(|l| {
                let counts: Vec<usize> = l.members.iter().map(|m| m.owned.len()).collect();
                let owned: usize = counts.iter().sum();
                let spread = counts.iter().max().unwrap_or(&0) - counts.iter().min().unwrap_or(&0);
                owned == shards && l.owned_shards().len() == shards && spread <= 1
            });
            if settled {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Starts a graceful shutdown of every listener and returns at once.
    pub fn shutdown(&self) {
        self.shutdown.cancel();
    }

    /// A token whose cancellation shuts every listener down (the same as
    /// [`RunningApp::shutdown`]), for wiring to other shutdown sources.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// Waits until every member of every listener has stopped.
    pub async fn join(self) {
        for listener in self.listeners {
            listener.handle.join().await;
        }
    }

    /// Graceful shutdown: stop reads, let in-flight handlers finish within `shutdown_timeout`,
    /// ack what finished, leave the groups; returns when every member has left.
    pub async fn shutdown_and_wait(self) {
        self.shutdown();
        for listener in &self.listeners {
            listener.handle.shutdown();
        }
        self.join().await;
    }

    /// Runs until SIGINT or SIGTERM (or [`RunningApp::shutdown`]), then shuts down gracefully.
    ///
    /// # Errors
    /// [`RunError::Signal`] when the signal handlers cannot be installed.
    pub async fn run_until_signal(self) -> Result<(), RunError> {
        let mut terminate =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                .map_err(RunError::Signal)?;
        let stopped = futures_util::future::select_all(
            self.listeners
                .iter()
                .map(|l| Box::pin(l.handle.stopped_for_good())),
        );
        let mut member_stopped = None;
        tokio::select! {
            result = tokio::signal::ctrl_c() => result.map_err(RunError::Signal)?,
            _ = terminate.recv() => {}
            _ = self.shutdown.cancelled() => {}
            (stopped, _, _) = stopped, if !self.listeners.is_empty() => member_stopped = Some(stopped),
        }
        tracing::info!("shutting down: draining in-flight work, then leaving the groups");
        self.shutdown_and_wait().await;
        tracing::info!("shut down");
        match member_stopped {
            Some(stopped) => Err(RunError::MemberStopped(stopped)),
            None => Ok(()),
        }
    }
}

/// Shard ownership as reported by the members' events, logged once it settles.
#[derive(Default)]
struct AssignmentLog {
    /// listener → member → owned shards.
    owned: Mutex<BTreeMap<String, BTreeMap<String, BTreeSet<ShardIndex>>>>,
    changed: Notify,
}

impl AssignmentLog {
    fn lock(
        &self,
    ) -> std::sync::MutexGuard<'_, BTreeMap<String, BTreeMap<String, BTreeSet<ShardIndex>>>> {
        self.owned
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn add_listener(&self, name: &str, members: &[String]) {
        let mut owned = self.lock();
        let listener = owned.entry(name.to_owned()).or_default();
        for member in members {
            listener.entry(member.clone()).or_default();
        }
    }

    fn callback(self: &Arc<Self>, listener: &str) -> EventCallback {
        let log = Arc::downgrade(self);
        let listener = listener.to_owned();
        EventCallback(Arc::new(move |event| {
            let Some(log) = log.upgrade() else { return };
            let changed = match event {
                ListenerEvent::Assigned { member, shard, .. } => log
                    .lock()
                    .entry(listener.clone())
                    .or_default()
                    .entry(member)
                    .or_default()
                    .insert(shard),
                ListenerEvent::Revoked { member, shard, .. } => log
                    .lock()
                    .entry(listener.clone())
                    .or_default()
                    .entry(member)
                    .or_default()
                    .remove(&shard),
                _ => false,
            };
            if changed {
                log.changed.notify_one();
            }
        }))
    }

    /// Logs every listener's assignment once no change has come for `settle`.
    async fn run(self: Arc<Self>, settle: Duration, shutdown: CancellationToken) {
        loop {
            tokio::select! {
                _ = self.changed.notified() => {}
                _ = shutdown.cancelled() => return,
            }
            loop {
                tokio::select! {
                    _ = self.changed.notified() => continue,
                    _ = tokio::time::sleep(settle) => break,
                    _ = shutdown.cancelled() => return,
                }
            }
            let snapshot = self.lock().clone();
            for (listener, members) in snapshot {
                let shards: usize = members.values().map(BTreeSet::len).sum();
                let assignment = members
                    .iter()
                    .map(|(member, owned)| format!("{member}: {owned:?}"))
                    .collect::<Vec<_>>()
                    .join(", ");
                tracing::info!(
                    listener = %listener,
                    shards,
                    members = members.len(),
                    %assignment,
                    "assignment settled"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::redis_version;

    #[test]
    fn versions_are_read_from_info() {
        let info = "# Server\r\nredis_version:7.0.15\r\nredis_git_sha1:00000000\r\n";
        assert_eq!(redis_version(info), Some((7, 0, 15)));
        assert_eq!(redis_version("redis_version:6.2.14\r\n"), Some((6, 2, 14)));
        assert_eq!(
            redis_version("redis_version:255.255.255"),
            Some((255, 255, 255))
        );
        assert!(redis_version("redis_version:6.0.9").unwrap() < super::MINIMUM_REDIS_VERSION);
        assert_eq!(redis_version("# Server\r\n"), None);
    }
}
