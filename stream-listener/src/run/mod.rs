//! `run()`: from the config file and the registered listeners to running group members
//! (docs/design.md §7, §8.13 shutdown, §11).

mod app;
mod app_builder;
mod assignment;
mod error;

use std::collections::BTreeMap;
use std::sync::Arc;

use stream_listener_core::config::Config;
use stream_listener_core::internals::connection::{RedisConnection, RedisTarget};
use stream_listener_core::internals::keys::StreamKeys;
use stream_listener_core::internals::startup::{self, Connected};
use stream_listener_core::internals::store::provision::{ProvisionError, create_stream};
use stream_listener_core::internals::store::{
    Retention, StoreError, ensure_retention, load_stream_metadata,
};
use stream_listener_core::member::{Listener, ListenerError, ListenerHandle, ListenerOptions};
use stream_listener_core::state::States;

use crate::registry::ListenerRegistration;
pub use app::{ListenerStatus, RunningApp};
pub use app_builder::{App, app};
use assignment::AssignmentLog;
pub use error::RunError;

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
/// `run()` installs no `tracing` subscriber: install one in `main` to see its logs. It is
/// `app().run()`: use [`app`] to give the listeners shared state ([`App::with_state`]).
///
/// # Errors
/// Everything [`run_with`] returns, before anything runs; [`RunError::Signal`] when the signal
/// handlers cannot be installed. Once the members run, `run()` returns `Ok(())` after a graceful
/// shutdown.
pub async fn run() -> Result<(), RunError> {
    app().run().await
}

/// Starts every registered listener with `config` (no environment variables are read: apply
/// them with [`Config::apply_env`] or use [`Config::load`]) and returns at once with a handle.
/// For tests and for programs that embed listeners in a larger service. It is
/// `app().run_with(config)` ([`App::run_with`], with shared state).
///
/// # Errors
/// As [`run_listeners`] with [`registered_listeners`](crate::registered_listeners); [`RunError::NoListeners`] when none is
/// registered.
pub async fn run_with(config: Config) -> Result<RunningApp, RunError> {
    app().run_with(config).await
}

/// Starts `listeners` (rather than every registered one) with `config`. In order:
///
/// 1. checks the config and the listeners, without contacting Redis: names, duplicate names,
///    two listeners on one (stream, group), `[listeners.<name>]` sections for listeners that do
///    not exist, the merged settings (config overrides over the values given in code), the
///    states each listener's function takes (given with [`App::with_state`]; each handler is
///    made once from them, docs/design.md §14.1); then,
///    with `[observability] listen`, installs the Prometheus recorder (feature `metrics`) and
///    starts the HTTP listener (`/metrics`, `/healthz`, `/readyz`; docs/design.md §13.2), so
///    `/readyz` answers 503 `starting` during the next steps; it stops once the members have
///    left ([`RunningApp::join`]), or at once when a later step fails;
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
/// [`RunError::DuplicateStreamGroup`], [`RunError::Listener`], [`RunError::MissingState`]
/// (step 1, nothing sent to Redis);
/// [`RunError::MetricsRecorder`] when `listen` is set and another global `metrics` recorder is
/// installed, [`RunError::Listen`] when its address cannot be bound (step 1, nothing sent);
/// [`RunError::RedisUnreachable`] once `startup_timeout` has passed, or [`RunError::Redis`] at
/// once for errors retrying cannot fix (step 2); [`RunError::RedisTooOld`] (3);
/// [`RunError::Stream`] (4); [`RunError::MissingStream`] (5); [`RunError::Listener`] when a
/// listener cannot start (6: the ones already started are shut down first).
///
/// It is `app().run_listeners(config, listeners)` ([`App::run_listeners`], with shared state).
pub async fn run_listeners(
    config: Config,
    listeners: Vec<ListenerRegistration>,
) -> Result<RunningApp, RunError> {
    app().run_listeners(config, listeners).await
}

/// [`run_listeners`] with the application's `states`.
pub(crate) async fn start(
    config: Config,
    listeners: Vec<ListenerRegistration>,
    states: &States,
) -> Result<RunningApp, RunError> {
    config.validate()?;
    let target = config.redis.target();
    let log = Arc::new(AssignmentLog::default());
    let planned = plan(&config, &target, listeners, states, &log)?;
    // Before Redis: /readyz answers 503 "starting" while startup retries.
    let names = planned
        .iter()
        .map(|p| p.registration.name().to_owned())
        .collect();
    // The longest gap between two sets of a live gauge: a heartbeat (member gauges) or a block
    // (an idle shard's sample); the exporter must not forget a gauge within it.
    let refresh = planned
        .iter()
        .map(|p| {
            let options = p.listener.options();
            options.block.max(options.coordination.heartbeat_interval)
        })
        .max()
        .unwrap_or_default();
    let observability = crate::observability::start(&config, names, refresh).await?;
    match start_members(&config, &target, planned, &log).await {
        Ok(mut app) => {
            if let Some((server, probe)) = observability {
                probe.running(app.listener_sizes(), app.handle().health_source());
                app.serve_until_left(server);
            }
            Ok(app)
        }
        Err(error) => {
            if let Some((server, _)) = observability {
                server.stop().await;
            }
            Err(error)
        }
    }
}

/// Steps 2 to 6 of [`run_listeners`].
async fn start_members(
    config: &Config,
    target: &RedisTarget,
    planned: Vec<Planned>,
    log: &Arc<AssignmentLog>,
) -> Result<RunningApp, RunError> {
    let connected = startup::connect(target, Some(config.redis.startup_timeout))
        .await
        .map_err(|e| RunError::startup(target.describe(), e))?;
    provision(&connected, config, target).await?;
    check_streams(&connected, &planned, target).await?;
    let mut listeners = Vec::new();
    let mut members: Option<ListenerHandle> = None;
    for Planned {
        registration,
        listener,
    } in planned
    {
        // The first listener on the checked connection, every further one on its own (as
        // separate `Listener::start` calls would be).
        let own = match &members {
            None => Ok(connected.clone()),
            Some(_) => connected.another().await,
        };
        let started = match own {
            Ok(own) => listener.start_on(&own).await,
            Err(error) => Err(ListenerError::Startup(error)),
        };
        let handle = match started {
            Ok(handle) => handle,
            Err(source) => {
                if let Some(started) = members
                    && let Err(error) = started.shutdown_and_wait().await
                {
                    // The startup error is what to report; this one is only logged.
                    tracing::warn!(error = %stream_listener_core::internals::report::Chain(&error), "stopping the listeners already started was not clean");
                }
                return Err(RunError::Listener {
                    listener: registration.name().to_owned(),
                    source,
                });
            }
        };
        let ids = handle.member_ids();
        log.add_listener(registration.name(), &ids);
        tracing::info!(
            listener = registration.name(),
            stream = registration.stream(),
            group = registration.group(),
            members = ids.len(),
            "listener started"
        );
        listeners.push((registration, ids));
        members = Some(match members {
            Some(started) => started.merge(handle),
            None => handle,
        });
    }
    let members = members.ok_or(RunError::NoListeners)?;
    // A rebalance moves shards over a few heartbeats (revoke, then assign): log once nothing
    // has changed for two heartbeat intervals.
    let settle = config.coordination.heartbeat_interval * 2;
    tokio::spawn(log.clone().run(settle, members.shutdown_token()));
    Ok(RunningApp::new(listeners, members))
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
    states: &States,
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
        base.hooks = registration.hooks();
        let mut options = config.listener_options(registration.name(), base)?;
        options.events = Some(log.callback(registration.name()));
        // The configured shard count is operator intent: with it, a member whose stream or group
        // metadata is lost (Redis restarted empty) provisions them again while it runs
        // (docs/design.md §5.5), as step 4 does at startup. Without it the members failed closed
        // until the process was restarted.
        options.auto_create_shards = config
            .streams
            .get(registration.stream())
            .and_then(|stream| stream.shards);
        let handler =
            registration
                .make_handler(states)
                .map_err(|missing| RunError::MissingState {
                    listener: registration.name().to_owned(),
                    type_name: missing.type_name,
                })?;
        let listener = Listener::with_handler(
            target.clone(),
            registration.stream(),
            registration.group(),
            handler,
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

/// Step 4: create the configured streams that do not exist.
async fn provision(
    connected: &Connected,
    config: &Config,
    target: &RedisTarget,
) -> Result<(), RunError> {
    let mut conn = connected.connection();
    for (prefix, stream) in &config.streams {
        let Some(shards) = stream.shards else {
            continue;
        };
        match create_stream(&mut conn, prefix, shards).await {
            Ok(created) if created.created => {
                tracing::info!(stream = %prefix, shards, "stream created");
            }
            Ok(_) => tracing::debug!(stream = %prefix, shards, "stream exists"),
            Err(ProvisionError::ShardCountMismatch { existing, .. }) => tracing::warn!(
                stream = %prefix,
                existing,
                configured = shards,
                "stream exists with another shard count; keeping it (change it with `stream-listener stream scale`)"
            ),
            Err(ProvisionError::Store(error)) if unreachable(&error) => {
                return Err(RunError::Redis {
                    target: target.describe(),
                    source: Box::new(error),
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
    // After creation, so a stream created just now gets its retention too.
    for (prefix, stream) in &config.streams {
        if let Some(retention) = stream.retention() {
            provision_retention(&mut conn, prefix, &retention, target).await?;
        }
    }
    Ok(())
}

/// Writes a stream's configured retention to Redis when it differs, logging the change
/// (docs/design.md §10.9). A stream that does not exist is left to the stream check.
async fn provision_retention(
    conn: &mut RedisConnection,
    prefix: &str,
    retention: &Retention,
    target: &RedisTarget,
) -> Result<(), RunError> {
    let redis = |e: StoreError| RunError::Redis {
        target: target.describe(),
        source: Box::new(e),
    };
    let keys = StreamKeys::new(prefix).map_err(|e| RunError::Stream {
        stream: prefix.to_owned(),
        source: ProvisionError::InvalidName(e),
    })?;
    if let Some(previous) = ensure_retention(conn, &keys, retention)
        .await
        .map_err(redis)?
    {
        // As stored: the `retention` field's JSON (`null`: none).
        let previous = serde_json::to_string(&previous).unwrap_or_default();
        let current = serde_json::to_string(retention).unwrap_or_default();
        tracing::info!(stream = %prefix, %previous, %current, "stream retention set from the configuration");
    }
    Ok(())
}

/// Step 5: every listener's stream exists.
async fn check_streams(
    connected: &Connected,
    planned: &[Planned],
    target: &RedisTarget,
) -> Result<(), RunError> {
    let mut conn = connected.connection();
    for planned in planned {
        let registration = &planned.registration;
        let keys = StreamKeys::new(registration.stream()).map_err(|e| RunError::Listener {
            listener: registration.name().to_owned(),
            source: ListenerError::Name(e),
        })?;
        let metadata =
            load_stream_metadata(&mut conn, &keys)
                .await
                .map_err(|e| RunError::Redis {
                    target: target.describe(),
                    source: Box::new(e),
                })?;
        let Some(metadata) = metadata else {
            return Err(RunError::MissingStream {
                stream: registration.stream().to_owned(),
                listener: registration.name().to_owned(),
            });
        };
        warn_of_idle_members(
            registration.name(),
            planned.listener.options().concurrency,
            metadata.readable_shard_set().len(),
        );
    }
    Ok(())
}

/// A listener whose members outnumber its stream's shards leaves some of them without a shard
/// for good (a shard has one owner): say so once, at startup, rather than let `/readyz` list
/// members that never get anything.
fn warn_of_idle_members(listener: &str, concurrency: u32, shards: usize) {
    let members = usize::try_from(concurrency).unwrap_or(usize::MAX);
    if members > shards {
        tracing::warn!(
            listener,
            concurrency,
            shards,
            "more members than the stream has shards: {} of this process's members will own no shard (each shard has one owner; lower `concurrency`, or scale the stream out with `stream-listener stream scale`)",
            members - shards
        );
    }
}

/// Whether a store error means Redis could not be reached (the admin tool's exit code 3).
fn unreachable(error: &StoreError) -> bool {
    matches!(error, StoreError::Redis(e) if stream_listener_core::internals::connection::RedisFailure::of(e).is_unreachable())
}
