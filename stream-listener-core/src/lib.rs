//! The core of stream-listener: everything that is not the macro or the facade.
//!
//! One module per concept (docs/design.md §1). What an application or an integrator uses:
//! - [`config`]: the TOML configuration file and its environment overrides, with errors naming file, line and key (docs/design.md §11);
//! - [`handler`]: the `Handler` trait, the `Delivery` (and its `Metadata`) it receives, retry or dead-letter errors;
//! - [`batch`]: batch handlers, `Batch<T>`, `BatchError`, `BatchHandler` (docs/design.md §14.2);
//! - [`extract`]: extractors turning a `Delivery` and the application's states into a listener function's arguments (`Json<T>`, `Message<T>`, `RawMessage`, `State<T>`, `Metadata`, `Headers`) and the handler return types (docs/design.md §7, §8, §14.1);
//! - [`member`]: the member runtime: `Listener`, its options, events and handle (docs/design.md §6, §7);
//! - [`producer`]: the `Publisher`, key → shard routing and its leased routing cache (docs/design.md §9);
//! - [`model`]: the protocol's data (stream, group and member metadata, heartbeat request and response);
//! - [`hooks`]: a listener's lifecycle hooks, `on_assigned`, `on_revoked`, `on_lost` (docs/design.md §13.3);
//! - `testing` (feature `testing`): a real-Redis test harness;
//! - [`state`]: the application's shared states by type, read by the `State<T>` extractor (docs/design.md §14.1);
//! - [`handler_fn`]: a function of several extractors as a `Handler`, without the attribute (docs/design.md §14.1).
//!
//! Everything else is in [`internals`], for the admin tool, tests and benchmarks, without a
//! semver promise.

mod acl;
mod admin;
mod assignor;
pub mod batch;
mod clock;
pub mod config;
mod connection;
mod coordinator;
mod dataplane;
pub mod extract;
mod fence;
mod gates;
pub mod handler;
pub mod handler_fn;
pub mod headers;
pub mod hooks;
mod keys;
pub mod member;
pub mod model;
mod poller;
pub mod producer;
mod reconciler;
mod replication;
mod report;
mod runtime;
mod script_flags;
mod startup;
pub mod state;
mod store;
mod telemetry;
mod trace_context;

// The crate's unit tests use the pure fixtures without the feature.
#[cfg(any(test, feature = "testing"))]
pub mod testing;

/// The building blocks below the public API: the store, the data plane, keys, connections, the
/// coordinator and the admin operations (docs/design.md §1).
///
/// **Unstable**: no semver promise covers this module; anything in it may change or go in any
/// release. It exists for the `stream-listener` admin tool, the tests and the benchmarks, and for
/// integrators who accept that.
pub mod internals {
    /// Each module of the crate named here, as `internals::<name>`: everything it exports.
    macro_rules! re_export {
        ($($(#[$doc:meta])* $name:ident),* $(,)?) => {
            $($(#[$doc])* pub mod $name {
                pub use crate::$name::*;
            })*
        };
    }

    re_export! {
        /// The Redis permissions a listener needs, checked before it joins (README "ACL users").
        acl,
        /// Admin operations: create, register, describe, list, scale, retire, delete (docs/design.md §8, §10).
        admin,
        /// The sticky assignor (docs/design.md §7).
        assignor,
        /// Standalone, cluster or Sentinel connections behind one type.
        connection,
        /// The pure coordinator state machine (docs/design.md §4–§6); it knows nothing of Redis.
        coordinator,
        /// Fenced shard operations: raise, claim, read, ack, dead-letter, blocking wait (docs/design.md §8).
        dataplane,
        /// Per-shard fencing tokens (docs/design.md §8).
        fence,
        /// The key layout in Redis and name validation (docs/design.md §2).
        keys,
        /// Waiting for replicas after a write (`WAIT`, README "Waiting for replicas").
        replication,
        /// Printing an error with its causes, each once (`report::Chain`, docs/design.md §8.14).
        report,
        /// Connecting at startup: retry, `PING`, the Redis version check (docs/design.md §1).
        startup,
        /// The Redis-recorded coordinator: metadata, compare-and-set, heartbeat transaction, and
        /// provisioning (docs/design.md §5).
        store,
        /// Metrics: the metric names (`telemetry::names`, docs/design.md §13.1).
        telemetry,
    }
}
