//! [`RunError`]: why `run()` could not start or stopped.

use std::time::Duration;

use stream_listener_core::config::ConfigError;
use stream_listener_core::handler::BoxError;
use stream_listener_core::internals::startup::{MINIMUM_REDIS_VERSION, StartupError};
use stream_listener_core::internals::store::provision::ProvisionError;
use stream_listener_core::member::{ListenerError, MemberStopped};

/// Why [`crate::run`], [`crate::run_with`] or [`crate::run_listeners`] (or the same methods of
/// [`crate::App`]) could not start, or [`crate::run`] stopped.
///
/// Causes are kept as [`std::error::Error::source`], not repeated in the message. Its `Debug`
/// output is the message followed by each cause (`: ...`), so `fn main() -> Result<(), RunError>`
/// prints the readable error (file, line and key of a config mistake; what to do) rather than a
/// struct dump.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    /// The configuration is invalid (file, line and key are named), or configures a listener
    /// that does not exist.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A member stopped for good (another process took its static identity): the app stopped.
    #[error("member {} stopped: {}", .0.member_id, .0.reason)]
    MemberStopped(MemberStopped),
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
    /// A listener's name, stream, group or settings are invalid, or it could not start.
    #[error("listener `{listener}` cannot run")]
    Listener {
        /// The listener's name.
        listener: String,
        /// What is wrong.
        #[source]
        source: ListenerError,
    },
    /// Redis did not answer within `startup_timeout`.
    #[error(
        "cannot reach Redis at {target} after {attempts} attempts in {} (startup_timeout); check that Redis is running and that [redis] url / cluster_nodes (or REDIS_URL) points at it",
        humantime::format_duration(Duration::from_millis(u64::try_from(waited.as_millis()).unwrap_or(u64::MAX)))
    )]
    RedisUnreachable {
        /// The URL or cluster nodes (passwords replaced by `***`).
        target: String,
        /// How long it tried.
        waited: Duration,
        /// Connection attempts made.
        attempts: u32,
        /// The last attempt's error; `None` when it timed out without one.
        #[source]
        last_error: Option<BoxError>,
    },
    /// Redis answered but refused or failed a command (authentication, ACL, ...).
    #[error("Redis at {target} failed")]
    Redis {
        /// The URL or cluster nodes (passwords replaced by `***`).
        target: String,
        /// What failed.
        #[source]
        source: BoxError,
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
    #[error("cannot provision stream {stream:?}")]
    Stream {
        /// The stream prefix.
        stream: String,
        /// Why.
        #[source]
        source: ProvisionError,
    },
    /// The SIGINT/SIGTERM handlers could not be installed.
    #[error("cannot install the SIGINT/SIGTERM handlers")]
    Signal(#[source] std::io::Error),
    /// The HTTP listener of `[observability] listen` cannot bind its address (port in use,
    /// an address of another machine, a privileged port); nothing was sent to Redis.
    #[error("cannot listen on {address} ([observability] listen): {advice}")]
    Listen {
        /// The address as configured.
        address: String,
        /// What to do about it.
        advice: &'static str,
        /// The bind error.
        #[source]
        source: std::io::Error,
    },
    /// `[observability] listen` is set but another global `metrics` recorder is installed in
    /// this process, so the Prometheus one that serves `/metrics` cannot be.
    #[error(
        "a global metrics recorder is already installed, so [observability] listen cannot serve /metrics: remove `listen` from the config and serve the metrics of your own recorder (run_with / run_listeners work without it), or do not install another recorder"
    )]
    MetricsRecorder,
    /// The Prometheus recorder could not be built (a bug: its settings are constant).
    #[error("cannot set up the Prometheus recorder: {0}")]
    MetricsSetup(String),
    /// A listener's function takes `State<T>` (or another extractor needing a state of type
    /// `T`) and the application was given no `T` (docs/design.md §14.1); nothing was sent to
    /// Redis.
    #[error(
        "listener `{listener}` takes a state of type `{type_name}`, but none was provided: call `stream_listener::app().with_state(value)` with a `{type_name}`, then `.run()` (or `.run_with(config)`, `.run_listeners(config, listeners)`)"
    )]
    MissingState {
        /// The listener's name.
        listener: String,
        /// The missing type, as `std::any::type_name` prints it.
        type_name: &'static str,
    },
    /// A shutdown that was not clean ([`RunningApp::shutdown_and_wait`](crate::RunningApp::shutdown_and_wait),
    /// [`RunningApp::join`](crate::RunningApp::join)): a handler cancelled past
    /// `shutdown_timeout`, or a leave that did not reach Redis. Every member has stopped. Lets a
    /// `main` returning `Result<(), RunError>` write `app.shutdown_and_wait().await?`.
    #[error(transparent)]
    Shutdown(#[from] stream_listener_core::member::ShutdownError),
    /// The TLS handshake with Redis failed at startup (docs/design.md §15.1): the server's
    /// certificate did not verify against `tls_ca_file`, the server refused the client
    /// certificate, or the URL's scheme does not match the server (`redis://` to a TLS port,
    /// `rediss://` to a plain one). Not retried.
    #[error("TLS with Redis at {target} failed: {advice}")]
    RedisTls {
        /// The URL or cluster nodes (passwords replaced by `***`).
        target: String,
        /// What to check: the settings to fix.
        advice: &'static str,
        /// The handshake's error.
        #[source]
        source: BoxError,
    },
}

impl RunError {
    /// The error of the startup checks ([`stream_listener_core::internals::startup::connect`]) on
    /// `target` (already redacted).
    pub(crate) fn startup(target: String, error: StartupError) -> Self {
        match error {
            StartupError::Unreachable {
                waited,
                attempts,
                last_error,
            } => RunError::RedisUnreachable {
                target,
                waited,
                attempts,
                last_error: last_error.map(BoxError::from),
            },
            StartupError::TooOld { found } => RunError::RedisTooOld { found, target },
            StartupError::Tls { advice, source } => RunError::RedisTls {
                target,
                advice,
                source: Box::new(source),
            },
            other => RunError::Redis {
                target,
                source: Box::new(other),
            },
        }
    }
}

impl std::fmt::Debug for RunError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The one implementation every public error's `Debug` shares (docs/design.md §14.5).
        stream_listener_core::internals::report::debug_chain(self, f)
    }
}
