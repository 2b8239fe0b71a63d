//! stream-listener: Kafka-grade consumer groups for sharded Redis Streams.
//!
//! Annotate an `async fn` with [`#[stream_listener(...)]`](macro@stream_listener), call
//! [`run()`] from `main`, and configure the rest in `stream-listener.toml` (docs/design.md §11,
//! [`Config`]):
//!
//! ```no_run
//! use serde::Deserialize;
//! use stream_listener::{HandlerError, Json, stream_listener};
//!
//! #[derive(Deserialize)]
//! struct Order {
//!     id: String,
//!     amount: f64,
//! }
//!
//! #[stream_listener(stream = "orders", group = "billing", concurrency = 4)]
//! async fn on_order(Json(order): Json<Order>) -> Result<(), HandlerError> {
//!     println!("order {} for {}", order.id, order.amount);
//!     Ok(())
//! }
//!
//! #[tokio::main]
//! async fn main() -> Result<(), stream_listener::RunError> {
//!     stream_listener::run().await
//! }
//! ```
//!
//! The pieces:
//! - [`macro@stream_listener`] registers a listener; its arguments are extractors ([`Json`],
//!   [`Message`], [`RawMessage`], [`State`], [`Metadata`], [`Headers`], [`Delivery`]) and its
//!   return value decides ack, retry or dead letter ([`core::extract`]);
//! - [`run()`], [`run_with`] and [`run_listeners`] start the registered listeners
//!   ([`RunningApp`], [`RunError`]); [`app()`]`.with_state(value)` gives them shared state first
//!   ([`App`]);
//! - a listener whose last argument is [`Batch<T>`](Batch) gets a shard's entries at once and
//!   says which one failed with [`BatchError::at`] (docs/design.md §14.2); `ordering = "key"`
//!   runs a shard's keys in parallel (§14.3); [`ListenerHandle::pause`] /
//!   [`ListenerHandle::resume`] ([`RunningApp::handle`]) and [`HandlerError::pause_shard`] pause
//!   consumption (§14.4);
//! - [`Config`] is the configuration file;
//! - [`Publisher`] appends to a sharded stream, routed by partition key (docs/design.md §9);
//! - the `stream-listener` command-line tool (feature `cli`, on by default) creates, scales,
//!   retires and describes streams and groups; [`core::internals::admin`] is the same as a
//!   library;
//! - `testing` (feature `testing`) starts throwaway Redis servers and clusters for tests;
//! - [`Headers`] travel with a message ([`Publisher::publish_with_headers`], read by
//!   [`Message::headers`] and the [`Headers`] extractor); with the feature `opentelemetry` (off
//!   by default) the publisher writes the current span's W3C trace context into them and each
//!   handler attempt's span is parented by it (docs/design.md §13.4);
//! - `[observability] listen` in the config serves `/metrics` (feature `metrics`, on by
//!   default: Prometheus text), `/healthz` and `/readyz` (JSON per listener and member,
//!   [`ListenerHandle::health`]; docs/design.md §13.2);
//! - [`core`] is `stream-listener-core` for integrators: [`core::member::Listener`] runs one
//!   listener without `run()`; [`core::internals`] holds the store, data plane and admin
//!   operations without a semver promise.
//!
//! Delivery is at least once: a handler can run more than once for one entry (a retry, a
//! rebalance, a crash), so make its effects idempotent where duplicates matter (docs/design.md
//! §12).

mod observability;
mod registry;
mod run;

/// Registers an `async fn` as a listener of a sharded stream (docs/design.md §7).
///
/// ```no_run
/// use stream_listener::{Message, stream_listener};
/// # #[derive(serde::Deserialize)] struct Order;
/// # #[derive(Debug)] struct Unavailable;
/// # impl std::fmt::Display for Unavailable { fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result { f.write_str("x") } }
/// # impl std::error::Error for Unavailable {}
///
/// #[stream_listener(stream = "orders", group = "billing", concurrency = 4, name = "billing")]
/// async fn on_order(order: Message<Order>) -> Result<(), Unavailable> {
///     println!("entry {} of shard {}", order.entry_id, order.shard);
///     Ok(())
/// }
/// ```
///
/// Keys:
///
/// | key | required | meaning |
/// | --- | --- | --- |
/// | `stream = "..."` | yes | the stream prefix (no `{` or `}`) |
/// | `group = "..."` | yes | the consumer group (no `:`, `{` or `}`) |
/// | `concurrency = N` | no, default 1 | logical group members in this process, ids `<base>-m0 … <base>-m{N-1}`, each with its own heartbeat, shards and epoch |
/// | `name = "..."` | no, default the function name | the listener's name: its `[listeners.<name>]` config section |
/// | `crate = "path"` | no, default `::stream_listener` | where this crate is, when it is renamed or re-exported |
/// | `on_assigned = path` | no | lifecycle hook called for each shard a member gains, before its first handler (docs/design.md §13.3) |
/// | `on_revoked = path` | no | hook called for each shard a member gives up in order: after its last handler and ack, before the release |
/// | `on_lost = path` | no | hook called for each shard a member lost without a release (fenced, lease expired): commit nothing |
///
/// A hook is a path to an `async fn(ShardHookContext)` returning `()` or `Result<(), E>` (`E`
/// as for handlers); it runs under `hook_timeout`, and an error, a panic or a timeout is logged
/// and never stops the member ([`Hooks`]).
///
/// The function must be an `async fn` (not a method, not generic) whose arguments, any number
/// of them, are extractors (docs/design.md §14.1):
///
/// | argument | position | gets |
/// | --- | --- | --- |
/// | [`Json<T>`], [`Message<T>`], [`RawMessage`] ([`FromDelivery`]) | last only, at most one | the payload decoded (or raw), as the table of [`core::extract`] says |
/// | [`State<T>`] ([`FromDeliveryParts`]) | any | the application's value of type `T` (`T: Clone + Send + Sync + 'static`), given with [`app()`]`.with_state(value)`, cloned per call; a missing one is [`RunError::MissingState`] at startup |
/// | [`Metadata`], [`Headers`], [`Delivery`] ([`FromDeliveryParts`]) | any | where the entry came from, its headers, the delivery itself |
/// | your own [`FromDeliveryParts`] or [`FromDelivery`] | as its trait | what it extracts |
///
/// ```no_run
/// use stream_listener::{Json, Metadata, State, stream_listener};
/// # #[derive(serde::Deserialize)] struct Order;
/// #[derive(Clone)]
/// struct Db;
///
/// #[stream_listener(stream = "orders", group = "billing")]
/// async fn on_order(State(db): State<Db>, meta: Metadata, Json(order): Json<Order>) {
///     let _ = (db, meta.entry_id, order);
/// }
///
/// # async fn main_() -> Result<(), stream_listener::RunError> {
/// stream_listener::app().with_state(Db).run().await
/// # }
/// ```
///
/// It returns `()` or `Result<(), E>` with `E: std::error::Error + Send + Sync + 'static` (or
/// `Box<dyn Error + Send + Sync>`): an `Err` is retried with backoff up to `max_attempts`, then
/// dead-lettered; return [`HandlerError::non_retryable`] to dead-letter at once. Its future must
/// be `Send`. The function stays an ordinary function: call it in unit tests.
///
/// Every mistake is a compile error at the offending token: a missing `async`, `stream` or
/// `group`; `concurrency = 0`; an unknown or repeated key; `self`; generics; an argument that is
/// not an extractor; a payload extractor that is not the last argument (two payload
/// extractors); a `State<T>` whose `T` is not `Clone`, or not `Send + Sync`; another return
/// type; a hook value that is not a path, or a hook function with another signature (at the
/// path).
#[doc(inline)]
pub use stream_listener_macros::stream_listener;

pub use registry::HookFn;
pub use registry::{ListenerRegistration, registered_listeners};
pub use registry::{MakeHandler, MakeListenerHandler};
pub use run::{App, app};
pub use run::{ListenerStatus, RunError, RunningApp, run, run_listeners, run_with};
pub use stream_listener_core::extract::{FromDeliveryParts, LastExtractor, State};
pub use stream_listener_core::handler::Ownership;
/// Shared state and functions of several extractors (docs/design.md §14.1): `app().with_state(db)`
/// gives the `State<T>` arguments their values; [`handler_fn`] makes a handler of such a
/// function without the attribute.
pub use stream_listener_core::handler_fn::{HandlerFn, ListenerFn, handler_fn};
/// Lifecycle hooks (docs/design.md §13.3): `#[stream_listener(on_revoked = path)]` or
/// [`core::member::ListenerOptions::hooks`].
pub use stream_listener_core::hooks::{
    HookFuture, Hooks, IntoHookResult, ShardHook, ShardHookContext,
};
pub use stream_listener_core::state::{MissingState, States};

/// Batch listeners (docs/design.md §14.2): [`Batch`] of per-entry extractors, [`BatchError`] to
/// say which entry failed ([`core::member::Listener::new_batch`]).
pub use stream_listener_core::batch::{
    Batch, BatchError, BatchHandler, IntoBatchResult, ListenerHandler,
};
/// Arguments of a batch listener function before its [`Batch`] ([`State`] is one).
pub use stream_listener_core::extract::FromStates;
/// Extractors and handler return types (docs/design.md §7, §8; the table of
/// [`core::extract`]).
pub use stream_listener_core::extract::{
    FromDelivery, IntoHandlerResult, Json, Message, RawMessage,
};
pub use stream_listener_core::handler::{BoxError, Delivery, HandlerError, Metadata};
/// Message headers (docs/design.md §13.4): written by [`Publisher::publish_with_headers`], read
/// by the [`Headers`] extractor and [`Message::headers`].
pub use stream_listener_core::headers::Headers;
/// Why a graceful shutdown was not clean (docs/design.md §14.5).
pub use stream_listener_core::member::ShutdownError;
/// Member health for probes (docs/design.md §13.2, `/healthz` and `/readyz`).
pub use stream_listener_core::member::{HealthSource, MemberHealth, MemberState};
pub use stream_listener_core::member::{ListenerHandle, MemberStatus};

/// The configuration file (docs/design.md §11; its sections are the types of
/// [`core::config`]).
pub use stream_listener_core::config::{Config, ConfigError};

/// The producer (docs/design.md §9): routed publishing to a sharded stream.
pub use stream_listener_core::producer::{
    PublishError, Published, Publisher, PublisherOptions, shard_for_key,
};

/// `stream-listener-core`, for integrators: the listener runtime without `run()`
/// ([`core::member`]), the configuration and producer types, and the unstable
/// [`core::internals`] (store, data plane, keys, connections, admin operations) that the admin
/// tool, tests and benchmarks use.
pub use stream_listener_core as core;

/// The real-Redis test harness (cargo feature `testing`): throwaway `redis-server` processes, a
/// local 3-master cluster and fault injection. See [`stream_listener_core::testing`].
#[cfg(feature = "testing")]
pub use stream_listener_core::testing;

/// What the expansion of `#[stream_listener]` names; not a stable API.
#[doc(hidden)]
pub mod __private {
    pub use crate::registry::HookFn;
    pub use crate::registry::ListenerRegistration;
    pub use inventory;
    pub use stream_listener_core::extract::{FromDelivery, FromDeliveryParts, IntoHandlerResult};
    pub use stream_listener_core::handler::{Delivery, Handler, HandlerError, HandlerFuture};
    pub use stream_listener_core::state::{MissingState, States};

    use stream_listener_core::extract::LastExtractor;

    /// One argument's extraction, with what it took from the states (boxed once at startup,
    /// so that the type is `Part<T>` and a wrong argument type is reported once, at [`part`] or
    /// [`last`], spanned at the argument).
    pub struct Part<T> {
        extract: Box<Extract<T>>,
    }

    /// An argument's extraction with its prepared state.
    type Extract<T> = dyn Fn(&Delivery) -> Result<T, HandlerError> + Send + Sync;

    impl<T> Part<T> {
        /// Extracts the argument from `delivery`.
        pub fn extract(&self, delivery: &Delivery) -> Result<T, HandlerError> {
            (self.extract)(delivery)
        }
    }

    /// Prepares an argument before the last: a parts extractor.
    pub fn part<T: FromDeliveryParts + 'static>(states: &States) -> Result<Part<T>, MissingState> {
        let prepared = T::prepare(states)?;
        Ok(Part {
            extract: Box::new(move |delivery| T::from_delivery_parts(delivery, &prepared)),
        })
    }

    /// Prepares the last argument (its marker `M` inferred: a payload or a parts extractor).
    pub fn last<T: LastExtractor<M> + 'static, M>(
        states: &States,
    ) -> Result<Part<T>, MissingState> {
        let prepared = T::prepare_last(states)?;
        Ok(Part {
            extract: Box::new(move |delivery| T::from_delivery_last(delivery, &prepared)),
        })
    }
    pub use stream_listener_core::hooks::{HookFuture, IntoHookResult, ShardHookContext};

    pub use stream_listener_core::batch::{Batch, BatchError, IntoBatchResult, ListenerHandler};
    use stream_listener_core::extract::FromStates;

    /// A per-entry handler made by the attribute, as a registration holds it.
    pub fn each(handler: std::sync::Arc<dyn Handler>) -> ListenerHandler {
        ListenerHandler::from(handler)
    }

    /// An argument before the `Batch<T>` of a batch listener, made from the states alone
    /// ([`FromStates`]), with what it took from them.
    pub struct StatePart<T> {
        make: Box<dyn Fn() -> T + Send + Sync>,
    }

    impl<T> StatePart<T> {
        /// The argument for one batch attempt.
        pub fn make(&self) -> T {
            (self.make)()
        }
    }

    /// Prepares an argument before a `Batch<T>`.
    pub fn state_part<T: FromStates + 'static>(
        states: &States,
    ) -> Result<StatePart<T>, MissingState> {
        let prepared = T::prepare_states(states)?;
        Ok(StatePart {
            make: Box::new(move || T::from_prepared(&prepared)),
        })
    }

    /// The batch handler of a function's closure: `T` is the batch's per-entry extractor, so a
    /// last argument that is not a `Batch<T>` of a [`FromDelivery`] `T` is reported here.
    pub fn batch<T, F, Fut>(handler: F) -> ListenerHandler
    where
        T: FromDelivery + Send + 'static,
        F: Fn(Batch<T>) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<(), BatchError>> + Send + 'static,
    {
        ListenerHandler::batch(handler)
    }
}
