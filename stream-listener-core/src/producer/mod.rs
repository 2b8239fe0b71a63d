//! The producer (docs/design.md §9): a [`Publisher`] appends messages to the shard streams of one
//! stream prefix, routed by partition key.
//!
//! - Routing ([`shard_for_key`]): jump consistent hash (Lamping & Veach 2014,
//!   arXiv:1406.2294) of XXH64 (seed 0) of the key's UTF-8 bytes over `shardCount`. Resharding
//!   N→N+1 moves about 1/(N+1) of the keys, all to the new shard. The README's "Routing" section
//!   spells it out with test vectors for producers in other languages.
//! - Entries: `XADD {<prefix>:<i>} NOMKSTREAM [MAXLEN ~ n] * key <k> payload <json>`
//!   ([`Publisher::publish`], [`Publisher::publish_batch`]), or `key <k>` followed by raw fields
//!   ([`Publisher::publish_raw`]).
//! - Headers: `h:<name> <value>` fields after `payload`
//!   ([`Publisher::publish_with_headers`], [`Publisher::publish_batch_with_headers`]), with the
//!   current span's W3C trace context under the feature `opentelemetry` (docs/design.md §13.4).
//! - Routing metadata (`sl:{<prefix>}:stream`) is cached by `metadataVersion`, checked every
//!   `refresh_interval`, refreshed at once when `NOMKSTREAM` finds a retired (deleted) shard, and
//!   never used past `routing_lease` after its read was sent ([`PublisherOptions`]).
//! - Every failure is a typed [`PublishError`] saying what to do.

mod error;
mod publisher;
pub mod routing;

pub use error::PublishError;
pub use publisher::{
    DEFAULT_MAX_PAYLOAD_BYTES, DEFAULT_REFRESH_INTERVAL, DEFAULT_ROUTING_LEASE, Published,
    Publisher, PublisherOptions, RoutingSnapshot,
};
pub use routing::{jump_consistent_hash, key_hash, shard_for_key};
