//! The publisher's settings and their defaults.

use std::time::Duration;

use crate::producer::PublishError;

/// Default [`PublisherOptions::max_payload_bytes`]: 1 MiB.
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 1024 * 1024;
/// Default [`PublisherOptions::refresh_interval`]: 5 s.
pub const DEFAULT_REFRESH_INTERVAL: Duration = Duration::from_secs(5);
/// Default [`PublisherOptions::routing_lease`]: 30 s.
pub const DEFAULT_ROUTING_LEASE: Duration = Duration::from_secs(30);

/// Settings of a [`Publisher`](crate::producer::Publisher). `PublisherOptions::default()` gives the documented defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublisherOptions {
    /// Largest payload accepted, in bytes (default 1 MiB, [`DEFAULT_MAX_PAYLOAD_BYTES`]): the
    /// JSON bytes for [`Publisher::publish`](crate::producer::Publisher::publish) and [`Publisher::publish_batch`](crate::producer::Publisher::publish_batch), the sum of field
    /// name and value lengths for [`Publisher::publish_raw`](crate::producer::Publisher::publish_raw). The partition key is not counted.
    /// With headers ([`Publisher::publish_with_headers`](crate::producer::Publisher::publish_with_headers)), the JSON plus the header fields' names (`h:<name>`) and values, trace context included.
    /// A larger payload is refused with [`PublishError::PayloadTooLarge`] before any `XADD`.
    /// Must be at least 1.
    pub max_payload_bytes: usize,
    /// `Some(n)` appends with `XADD ... MAXLEN ~ n`: Redis trims each shard stream to about `n`
    /// entries (at least `n`, trimming whole macro nodes). **Trimming drops the oldest entries
    /// whether or not every consumer group has read them**: a slow or stopped group loses
    /// messages, and entries pending in a group are lost for it (its members ack and count them,
    /// docs/design.md §8). Off by default (`None`): streams grow until consumers' retention trims
    /// them. `Some(0)` is refused.
    pub maxlen: Option<usize>,
    /// How often the routing metadata is checked (default 5 s, [`DEFAULT_REFRESH_INTERVAL`]).
    /// Checked lazily at publish time: `HGET metadataVersion` (with `schema`, one round trip) once this long has passed since
    /// the last successful read was sent, and the full metadata only when the version changed.
    /// Must be shorter than [`Self::routing_lease`]; `Duration::ZERO` checks before every publish.
    pub refresh_interval: Duration,
    /// How long routing metadata may be used after its read was sent (default 30 s,
    /// [`DEFAULT_ROUTING_LEASE`]). When a refresh fails, the cached routing is used until this
    /// lease runs out; past it, publish fails closed with [`PublishError::RoutingLeaseExpired`].
    /// Admin retirement of a drained shard waits at least this long after the scale-in
    /// (docs/design.md §10), so it must not exceed the admin's routing lease. Must be positive.
    pub routing_lease: Duration,
    /// Replicas that must acknowledge each publish (`[redis] min_replica_acks`, default 0: off).
    /// With `n > 0` every `XADD` (or pipelined batch of them) is followed, in the same pipeline,
    /// by `WAIT n <replica_ack_timeout>`; fewer replicas within the timeout is
    /// [`PublishError::NotReplicated`] (the entries *were* written). README "Waiting for replicas".
    pub min_replica_acks: u32,
    /// How long each `WAIT` lasts at most (`[redis] replica_ack_timeout`, default 1 s). The wait
    /// holds the connection it is sent on: other commands on it queue behind it.
    pub replica_ack_timeout: Duration,
}

impl Default for PublisherOptions {
    fn default() -> Self {
        PublisherOptions {
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
            maxlen: None,
            refresh_interval: DEFAULT_REFRESH_INTERVAL,
            routing_lease: DEFAULT_ROUTING_LEASE,
            min_replica_acks: 0,
            replica_ack_timeout: Duration::from_secs(1),
        }
    }
}

impl PublisherOptions {
    /// The `WAIT` after each publish, `None` when `min_replica_acks` is 0.
    pub(crate) fn replica_wait(&self) -> Option<crate::replication::ReplicaWait> {
        crate::replication::ReplicaWait::new(self.min_replica_acks, self.replica_ack_timeout)
    }

    pub(super) fn validate(&self) -> Result<(), PublishError> {
        let invalid = |detail: String| Err(PublishError::InvalidOptions { detail });
        if self.max_payload_bytes == 0 {
            return invalid("max_payload_bytes is 0: nothing could be published; use at least 1 (default 1 MiB)".into());
        }
        if self.maxlen == Some(0) {
            return invalid("maxlen is Some(0): every entry would be trimmed at once; use None (no trimming) or a positive length".into());
        }
        if self.routing_lease.is_zero() {
            return invalid(
                "routing_lease is 0: routing would always be expired; use a positive lease (default 30 s)"
                    .into(),
            );
        }
        if self.min_replica_acks > 0 && self.replica_ack_timeout.is_zero() {
            return invalid(
                "replica_ack_timeout is 0 with min_replica_acks > 0: WAIT with 0 would block forever; use a positive timeout (default 1 s)"
                    .into(),
            );
        }
        if self.refresh_interval >= self.routing_lease {
            return invalid(format!(
                "refresh_interval ({:?}) must be shorter than routing_lease ({:?}), or a failed refresh would fail publishing at once",
                self.refresh_interval, self.routing_lease
            ));
        }
        Ok(())
    }
}
