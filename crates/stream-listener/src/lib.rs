//! stream-listener: Kafka-grade consumer groups for sharded Redis Streams.
//!
//! This facade re-exports the pieces users need. See `DESIGN.md` in the repository for the
//! architecture and the protocol.

pub use stream_listener_core::{assignor, coordinator, model};

/// The producer (DESIGN.md §9): routed publishing to a sharded stream.
pub use stream_listener_core::producer::{
    PublishError, Published, Publisher, PublisherOptions, RoutingSnapshot, shard_for_key,
};

/// Everything of `stream-listener-core`: the store, keys, connections and admin operations, for
/// tools and tests that need more than the facade's surface.
pub use stream_listener_core as core;

/// The real-Redis test harness (cargo feature `testing`): throwaway `redis-server` processes, a
/// local 3-master cluster and fault injection. See [`stream_listener_core::testing`].
#[cfg(feature = "testing")]
pub use stream_listener_core::testing;
