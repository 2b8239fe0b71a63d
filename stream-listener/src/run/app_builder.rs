//! [`App`]: the application's shared states, then `run`, `run_with` or `run_listeners` with them
//! (docs/design.md §14.1).

use stream_listener_core::config::Config;
use stream_listener_core::state::States;

use super::{RunError, RunningApp};
use crate::registry::{ListenerRegistration, registered_listeners};

/// An application to run: the listeners' shared states, then [`App::run`], [`App::run_with`]
/// or [`App::run_listeners`].
///
/// ```no_run
/// use std::sync::Arc;
/// use std::sync::atomic::{AtomicU64, Ordering};
/// use stream_listener::{Json, State, stream_listener};
///
/// #[derive(Clone, Default)]
/// struct Handled(Arc<AtomicU64>);
///
/// #[stream_listener(stream = "orders", group = "billing")]
/// async fn on_order(State(handled): State<Handled>, Json(_id): Json<u64>) {
///     handled.0.fetch_add(1, Ordering::Relaxed);
/// }
///
/// #[tokio::main]
/// async fn main() -> Result<(), stream_listener::RunError> {
///     stream_listener::app().with_state(Handled::default()).run().await
/// }
/// ```
#[derive(Debug, Clone, Default)]
#[must_use = "an App does nothing until `.run()`, `.run_with(config)` or `.run_listeners(..)`"]
pub struct App {
    states: States,
}

/// An application without state: add states with [`App::with_state`], then run it.
/// `run()`, `run_with(config)` and `run_listeners(config, listeners)` are
/// `app().run()`, `app().run_with(config)` and `app().run_listeners(config, listeners)`.
pub fn app() -> App {
    App::default()
}

impl App {
    /// The application with `value` as the state of type `T`, read by listener arguments
    /// `State(value): State<T>` (cloned for each call; wrap it in an `Arc` if cloning is not
    /// cheap). One value per type: a second `with_state` of the same type replaces the first;
    /// wrap two values of one type in distinct types to give both.
    pub fn with_state<T: Clone + Send + Sync + 'static>(mut self, value: T) -> App {
        self.states.insert(value);
        self
    }

    /// The states given so far.
    pub fn states(&self) -> &States {
        &self.states
    }

    /// As [`crate::run`] with these states: loads the configuration, starts every registered
    /// listener, and shuts down gracefully on SIGINT or SIGTERM.
    ///
    /// # Errors
    /// As [`crate::run`]; [`RunError::MissingState`] when a listener takes a state that was not
    /// given (before anything is sent to Redis).
    pub async fn run(self) -> Result<(), RunError> {
        let config = Config::load()?;
        let app = self.run_with(config).await?;
        app.run_until_signal().await
    }

    /// As [`crate::run_with`] with these states: starts every registered listener with
    /// `config` and returns at once with a handle.
    ///
    /// # Errors
    /// As [`crate::run_with`]; [`RunError::MissingState`] as for [`App::run`].
    pub async fn run_with(self, config: Config) -> Result<RunningApp, RunError> {
        self.run_listeners(config, registered_listeners()).await
    }

    /// As [`crate::run_listeners`] with these states: starts `listeners` with `config`.
    ///
    /// # Errors
    /// As [`crate::run_listeners`], whose step 1 checks that every state a listener takes was
    /// given ([`RunError::MissingState`], naming the listener and the type).
    pub async fn run_listeners(
        self,
        config: Config,
        listeners: Vec<ListenerRegistration>,
    ) -> Result<RunningApp, RunError> {
        super::start(config, listeners, &self.states).await
    }
}
