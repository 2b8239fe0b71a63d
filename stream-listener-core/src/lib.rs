//! The core of stream-listener: everything that is not the macro or the facade.
//!
//! One module per concept (docs/design.md §1):
//! - [`model`]: the protocol's data (stream, group and member metadata, heartbeat request and response);
//! - [`assignor`]: the sticky assignor (docs/design.md §7);
//! - [`coordinator`]: the pure coordinator state machine (docs/design.md §4–§6); it knows nothing of Redis;
//! - [`fence`]: per-shard fencing tokens (docs/design.md §8);
//! - [`keys`]: the key layout in Redis and name validation (docs/design.md §2);
//! - [`connection`]: standalone or cluster connections behind one type;
//! - [`store`]: the Redis-recorded coordinator: metadata, compare-and-set, heartbeat transaction (docs/design.md §5);
//! - [`handler`]: the `Handler` trait, the `Delivery` it receives, retry or dead-letter errors;
//! - [`member`]: the member runtime: `Listener`, heartbeat loop, reconciler (docs/design.md §6, §7);
//! - `poller`: one task per owned shard: takeover, fenced reads, handlers, acks (docs/design.md §7, §8);
//! - [`dataplane`]: fenced shard operations: raise, claim, read, ack, dead-letter, blocking wait (docs/design.md §8);
//! - [`producer`]: the `Publisher`, key → shard routing and its leased routing cache (docs/design.md §9);
//! - [`admin`]: admin operations: create, register, describe, list, scale, retire, delete (docs/design.md §8, §10);
//! - [`config`]: the TOML configuration file and its environment overrides, with errors naming file, line and key (docs/design.md §11);
//! - [`extract`]: extractors turning a `Delivery` into a listener function's argument (`Json<T>`, `Message<T>`, `RawMessage`) and the handler return types (docs/design.md §7, §8);
//! - `testing` (feature `testing`): a real-Redis test harness.

pub mod admin;
pub mod assignor;
pub mod config;
pub mod connection;
pub mod coordinator;
pub mod dataplane;
pub mod extract;
pub mod fence;
pub mod handler;
pub mod keys;
pub mod member;
pub mod model;
pub(crate) mod poller;
pub mod producer;
pub mod startup;
pub mod store;

#[cfg(feature = "testing")]
pub mod testing;
