//! The settings of one listener (config section `[listeners.<name>]`, docs/design.md §11).

use std::time::Duration;

use super::EventCallback;
use super::Ordering;
use crate::coordinator::CoordinatorConfig;
use crate::dataplane::FencingMode;
use crate::model::StartFrom;

/// The largest [`ListenerOptions::batch_size`]: entries read per shard and round. Redis takes
/// `COUNT` as a signed 64-bit integer, and far below that one read holds more entries in memory
/// than a member handles in many leases.
pub const MAX_BATCH_SIZE: usize = 100_000;

/// The largest [`ListenerOptions::concurrency`]: the largest shard count
/// ([`crate::admin::MAX_SHARDS`]), since a member past the stream's shard count never owns one.
pub const MAX_CONCURRENCY: u32 = crate::admin::MAX_SHARDS;

/// Settings of one listener (config section `[listeners.<name>]`, docs/design.md §11).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ListenerOptions {
    /// The listener's name (member name in `describe`); default `listener`.
    pub name: String,
    /// Logical members in this process (default 1, at most [`MAX_CONCURRENCY`]).
    pub concurrency: u32,
    /// Local workers per member (default 1); the assignor's weight. Never caps shards owned.
    pub runtime_max_concurrency: u32,
    /// Entries per read and shard (default 500, as Kafka's `max.poll.records`: fewer round trips
    /// per entry; BENCHMARKS.md item 1; at most [`MAX_BATCH_SIZE`]).
    pub batch_size: usize,
    /// Longest wait for new entries in one `XREAD BLOCK` (default 2 s), capped by the lease.
    pub block: Duration,
    /// Handler attempts per delivery before dead-lettering (default 3).
    pub max_attempts: u32,
    /// First retry backoff, doubled per attempt up to 30 s (default 200 ms).
    pub backoff: Duration,
    /// Handler attempts on an entry that did not finish (processes that died in its handler, or
    /// lost the shard during it; the first delivery counts as one) after which the next delivery
    /// dead-letters it unhandled (default 10). Re-reads and handovers without an attempt do not
    /// count (docs/design.md §8.9).
    pub max_deliveries: u64,
    /// Limit of one handler attempt (default 30 s); below `rebalance_timeout`.
    pub handler_timeout: Duration,
    /// Time in-flight handlers get at shutdown before they are cancelled (default 30 s).
    pub shutdown_timeout: Duration,
    /// Where a newly registered group starts (default earliest).
    pub start_from: StartFrom,
    /// `strict` (default) or `acks` fencing (docs/design.md §8): in acks mode new entries are read
    /// with a plain `XREADGROUP` (no fence check, no script), acks and claims stay fenced. On a
    /// standalone server the member's shards then share their reads: one multi-stream
    /// `XREADGROUP` and their acks per round trip (docs/design.md §8.7).
    pub fencing: FencingMode,
    /// Static membership: member ids become `<instance_id>-m<k>` and leaving uses `-2`.
    pub instance_id: Option<String>,
    /// Protocol timings.
    pub coordination: CoordinatorConfig,
    /// Safety margin taken off the lease on the member's side (default 20% of the lease TTL).
    pub lease_margin: Option<Duration>,
    /// Called on assignment changes, reads and fence rejections (for logs and tests).
    pub events: Option<EventCallback>,
    /// The stream's configured shard count (config `[streams.<prefix>] shards`), when it is
    /// auto-created. Then lost stream or group metadata (Redis restarted empty) is provisioned
    /// again from it — a new incarnation, consumer groups from `0`, no shard handed out for one
    /// lease TTL (docs/design.md §5). Without it, missing metadata fails closed.
    pub auto_create_shards: Option<u32>,
    /// Entries larger than this (field names plus values, bytes) are never read into the
    /// process: they are dead-lettered by id with reason `too-large`.
    /// Default 16 MiB; `None` reads entries of any size. With [`FencingMode::Acks`] new entries
    /// are read with a plain `XREADGROUP` and the limit applies after the read: the entry is
    /// still dead-lettered by id and never handled, but its body passes through the process once.
    pub max_entry_bytes: Option<usize>,
    /// How often each shard task trims its shard to the stream's retention, and reads that
    /// retention (docs/design.md §10.9). Default 1 min; `[listeners.<name>] retention_interval`.
    pub retention_interval: Duration,
    /// The listener's lifecycle hooks, `on_assigned`, `on_revoked` and `on_lost`
    /// (docs/design.md §13.3); none by default.
    pub hooks: crate::hooks::Hooks,
    /// Limit of one hook call (`[listeners.<name>] hook_timeout`); when given, it must be
    /// positive and below `coordination.rebalance_timeout`, since an `on_revoked` runs before
    /// the release. `None` (default): 10 s, or half the rebalance timeout when that is shorter
    /// ([`ListenerOptions::effective_hook_timeout`]). A hook past it is abandoned (dropped) and
    /// counted as failed.
    pub hook_timeout: Option<Duration>,
    /// How often each shard task samples its shard's lag, pending count and oldest pending entry
    /// for the metrics (one script call per shard per interval; the owner of the lowest readable
    /// shard also sums the group's lag), with the cargo feature `metrics` (docs/design.md §13.1).
    /// Gauges are re-set this often while valid. Positive and at most one day
    /// ([`Listener::new`](crate::member::Listener::new) refuses others); default 5 s;
    /// `[observability] metrics_interval`.
    pub metrics_interval: Duration,
    /// How long a shard of a batch listener ([`Listener::new_batch`](crate::member::Listener::new_batch))
    /// waits for a fuller batch (up to `batch_size`) after a read that returned fewer entries,
    /// before calling the handler with what it has (docs/design.md §14.2). Default 0 (never
    /// waits); at most half of `coordination.member_lease_ttl`, so that the batch still has
    /// the lease to run in ([`Listener::new_batch`](crate::member::Listener::new_batch) refuses
    /// longer ones). Each wait is also cut at the lease's end, a drain and a stop. Ignored by
    /// per-entry listeners. `[listeners.<name>] batch_max_wait`.
    pub batch_max_wait: Duration,
    /// How a shard's entries may run relative to each other: [`Ordering::Shard`] (default, one
    /// at a time in entry order), [`Ordering::Key`] (different partition keys concurrently, one
    /// key in order) or [`Ordering::None`]; `[listeners.<name>] ordering` (docs/design.md §14.3).
    /// Ignored by batch listeners ([`Listener::new_batch`](crate::member::Listener::new_batch)):
    /// a shard runs one batch attempt at a time, on one worker.
    pub ordering: Ordering,
    /// With [`Ordering::Key`] or [`Ordering::None`]: the most handler calls of one shard in
    /// flight at once (default 16, at least 1; [`Listener::new`](crate::member::Listener::new)
    /// refuses 0). Ignored with [`Ordering::Shard`] (one at a time) and by batch listeners;
    /// `[listeners.<name>] max_in_flight`.
    pub max_in_flight: u32,
    /// Replicas that must acknowledge each ack (`[redis] min_replica_acks`, default 0: off):
    /// every ack, or read round carrying acks, ends with `WAIT n <replica_ack_timeout>` in its
    /// pipeline; fewer replicas is a `warn!`, and consumption goes on (README "Waiting for
    /// replicas"). The user then needs `+wait`, checked at startup.
    pub min_replica_acks: u32,
    /// How long each such `WAIT` lasts at most (`[redis] replica_ack_timeout`, default 1 s).
    /// It holds the member's data-plane connection (its reads wait): keep it well below
    /// `heartbeat_interval`.
    pub replica_ack_timeout: Duration,
}

/// The default [`ListenerOptions::max_in_flight`] and `[listeners.<name>] max_in_flight`: 16.
pub(crate) const DEFAULT_MAX_IN_FLIGHT: u32 = 16;

/// The default [`ListenerOptions::metrics_interval`] and `[observability] metrics_interval`: 5 s.
pub const DEFAULT_METRICS_INTERVAL: Duration = Duration::from_secs(5);

impl Default for ListenerOptions {
    fn default() -> Self {
        ListenerOptions {
            name: "listener".into(),
            concurrency: 1,
            runtime_max_concurrency: 1,
            batch_size: 500,
            block: Duration::from_secs(2),
            max_attempts: 3,
            backoff: Duration::from_millis(200),
            max_deliveries: 10,
            handler_timeout: Duration::from_secs(30),
            shutdown_timeout: Duration::from_secs(30),
            start_from: StartFrom::Earliest,
            fencing: FencingMode::Strict,
            instance_id: None,
            coordination: CoordinatorConfig::default(),
            lease_margin: None,
            events: None,
            auto_create_shards: None,
            max_entry_bytes: Some(16 * 1024 * 1024),
            retention_interval: Duration::from_secs(60),
            hooks: crate::hooks::Hooks::default(),
            hook_timeout: None,
            metrics_interval: DEFAULT_METRICS_INTERVAL,
            batch_max_wait: Duration::ZERO,
            ordering: Ordering::Shard,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            min_replica_acks: 0,
            replica_ack_timeout: Duration::from_secs(1),
        }
    }
}

impl ListenerOptions {
    /// The `WAIT` after each ack, `None` when `min_replica_acks` is 0.
    pub(crate) fn replica_wait(&self) -> Option<crate::replication::ReplicaWait> {
        crate::replication::ReplicaWait::new(self.min_replica_acks, self.replica_ack_timeout)
    }

    /// The limit of one hook call: [`ListenerOptions::hook_timeout`], or when not given
    /// [`DEFAULT_HOOK_TIMEOUT`](crate::hooks::DEFAULT_HOOK_TIMEOUT) capped at half
    /// `coordination.rebalance_timeout`.
    pub fn effective_hook_timeout(&self) -> Duration {
        self.hook_timeout.unwrap_or_else(|| {
            crate::hooks::DEFAULT_HOOK_TIMEOUT.min(self.coordination.rebalance_timeout / 2)
        })
    }

    /// Reports `event` to the [`ListenerOptions::events`] callback, if any.
    pub(crate) fn emit(&self, event: super::ListenerEvent) {
        if let Some(callback) = &self.events {
            (callback.0)(event);
        }
    }
}
