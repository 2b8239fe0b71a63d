//! The sections of the file, as typed settings with their defaults (docs/design.md §11).

use std::time::Duration;

use serde::Deserialize;

use super::DEFAULT_REDIS_URL;
use super::validate::redact_url;
use crate::connection::redact_urls;
use crate::connection::{RedisTarget, SentinelTarget, TlsOptions, Topology};
use crate::coordinator::CoordinatorConfig;
use crate::dataplane::FencingMode;
use crate::model::StartFrom;
use crate::runtime::DEFAULT_METRICS_INTERVAL;

/// `[redis]`: a standalone server (`url`), a cluster (`cluster_nodes`) or a master found through
/// Sentinel (`sentinels` and `sentinel_master`), one of them; TLS files for `rediss://` URLs;
/// replication waits (`min_replica_acks`).
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct RedisConfig {
    /// `url`: `redis://[user:password@]host:port[/db]`, or `rediss://` for TLS. With `sentinels`
    /// only its user, password and database count (the master's credentials). Default
    /// [`DEFAULT_REDIS_URL`]; `REDIS_URL` overrides it.
    pub url: Option<String>,
    /// `cluster_nodes`: seed node URLs of a Redis Cluster (empty: standalone).
    pub cluster_nodes: Vec<String>,
    /// `sentinels`: URLs of Redis Sentinel processes (`redis://host:26379`); with
    /// `sentinel_master`, members, producers and the admin tool find the master through them and
    /// follow a failover (README "Sentinel").
    pub sentinels: Vec<String>,
    /// `sentinel_master`: the name the sentinels monitor the master by (`mymaster`).
    pub sentinel_master: Option<String>,
    /// `tls_ca_file`: PEM file of the certificate authority a `rediss://` server's certificate
    /// must chain to (default: the system's roots).
    pub tls_ca_file: Option<std::path::PathBuf>,
    /// `tls_cert_file`: PEM client certificate for mutual TLS (with `tls_key_file`).
    pub tls_cert_file: Option<std::path::PathBuf>,
    /// `tls_key_file`: PEM private key of `tls_cert_file`.
    pub tls_key_file: Option<std::path::PathBuf>,
    /// `tls_insecure` (default false): do not verify the server's certificate. Logged as a
    /// warning at startup; for tests only.
    pub tls_insecure: bool,
    /// `min_replica_acks` (default 0: off): after each publish and each ack, wait
    /// (`WAIT numreplicas timeout`) until this many replicas have the write (README "Sentinel").
    pub min_replica_acks: u32,
    /// `replica_ack_timeout` (default 1 s): how long such a wait lasts at most.
    #[serde(with = "humantime_serde")]
    pub replica_ack_timeout: Duration,
    /// `startup_timeout` (default 30 s): how long `run()` retries, with capped backoff, while
    /// Redis does not answer at startup, before it fails with a clear error.
    #[serde(with = "humantime_serde")]
    pub startup_timeout: Duration,
}

impl Default for RedisConfig {
    fn default() -> Self {
        RedisConfig {
            url: None,
            cluster_nodes: Vec::new(),
            sentinels: Vec::new(),
            sentinel_master: None,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            tls_insecure: false,
            min_replica_acks: 0,
            replica_ack_timeout: Duration::from_secs(1),
            startup_timeout: Duration::from_secs(30),
        }
    }
}

impl std::fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConfig")
            .field("url", &self.url.as_deref().map(redact_url))
            .field("cluster_nodes", &redact_urls(&self.cluster_nodes))
            .field("sentinels", &redact_urls(&self.sentinels))
            .field("sentinel_master", &self.sentinel_master)
            .field("tls_ca_file", &self.tls_ca_file)
            .field("tls_cert_file", &self.tls_cert_file)
            .field("tls_key_file", &self.tls_key_file)
            .field("tls_insecure", &self.tls_insecure)
            .field("min_replica_acks", &self.min_replica_acks)
            .field("replica_ack_timeout", &self.replica_ack_timeout)
            .field("startup_timeout", &self.startup_timeout)
            .finish()
    }
}

impl RedisConfig {
    /// Where to connect: the cluster when `cluster_nodes` is set, the Sentinel master when
    /// `sentinels` is, else `url` (default [`DEFAULT_REDIS_URL`]); with the TLS files. The
    /// validation (docs/design.md §11) has refused a file that sets more than one of them.
    pub fn target(&self) -> RedisTarget {
        let url = || {
            self.url
                .clone()
                .unwrap_or_else(|| DEFAULT_REDIS_URL.to_owned())
        };
        let topology = if !self.cluster_nodes.is_empty() {
            Topology::Cluster(self.cluster_nodes.clone())
        } else if !self.sentinels.is_empty() {
            let mut sentinel = SentinelTarget::new(
                self.sentinels.clone(),
                self.sentinel_master.clone().unwrap_or_default(),
            );
            sentinel.master_auth = self.url.clone();
            Topology::Sentinel(sentinel)
        } else {
            Topology::Standalone(url())
        };
        let tls = TlsOptions {
            ca_file: self.tls_ca_file.clone(),
            cert_file: self.tls_cert_file.clone(),
            key_file: self.tls_key_file.clone(),
            insecure: self.tls_insecure,
        };
        RedisTarget::new(topology).with_tls(tls)
    }
}

/// `[coordination]`: protocol timings (docs/design.md §5, §6). Defaults: heartbeat 3 s, lease 15 s,
/// margin 20% of the lease, rebalance timeout 60 s.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct CoordinationConfig {
    /// `heartbeat_interval`: at most a third of `member_lease_ttl`.
    #[serde(with = "humantime_serde")]
    pub heartbeat_interval: Duration,
    /// `member_lease_ttl`: how long an assignment lasts without a renewing heartbeat.
    #[serde(with = "humantime_serde")]
    pub member_lease_ttl: Duration,
    /// `lease_margin`: taken off the lease on the member's side (default 20% of the TTL); below
    /// `member_lease_ttl`.
    #[serde(with = "humantime_serde")]
    pub lease_margin: Option<Duration>,
    /// `rebalance_timeout`: how long a member has to release shards it must give up; above every
    /// listener's `handler_timeout`.
    #[serde(with = "humantime_serde")]
    pub rebalance_timeout: Duration,
}

impl Default for CoordinationConfig {
    fn default() -> Self {
        let defaults = CoordinatorConfig::default();
        CoordinationConfig {
            heartbeat_interval: defaults.heartbeat_interval,
            member_lease_ttl: defaults.member_lease_ttl,
            lease_margin: None,
            rebalance_timeout: defaults.rebalance_timeout,
        }
    }
}

/// `[member]`: this process's identity.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct MemberConfig {
    /// `instance_id`: static membership (docs/design.md §7): member ids become
    /// `<instance_id>-m<k>` and a restarted process takes its shards back. One per process;
    /// `STREAM_LISTENER_INSTANCE_ID` overrides it.
    pub instance_id: Option<String>,
}

/// `[streams.<prefix>]`: one sharded stream.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct StreamConfig {
    /// `shards`: create the stream with this many shards at startup if it does not exist
    /// (1 to [`MAX_SHARDS`](crate::admin::MAX_SHARDS)), and, for `run()`'s listeners, again
    /// with their group while running if Redis loses them (docs/design.md §5.5). An existing
    /// stream keeps its count (change it with `stream-listener stream scale`). Without it, the
    /// stream must exist.
    pub shards: Option<u32>,
    /// `max_payload_bytes`: the publisher's payload limit (default 1 MiB), see
    /// [`Config::publisher_options`](crate::config::Config::publisher_options).
    pub max_payload_bytes: Option<usize>,
    /// `retention`: `"acked"` (default: never trim what a consumer group has not acked or
    /// received) or `"force"` (the bounds alone) (docs/design.md §10.9). Any retention key makes
    /// startup write the stream's retention to Redis when it differs.
    pub retention: Option<crate::store::RetentionMode>,
    /// `retention_max_age`: shard entries older than this go (e.g. `"7d"`; at least one
    /// `heartbeat_interval`, at most 100 years).
    #[serde(with = "humantime_serde")]
    pub retention_max_age: Option<Duration>,
    /// `retention_max_len`: entries kept per shard (1 to 2^53).
    pub retention_max_len: Option<u64>,
    /// `dlq_retention_max_age`: dead letters older than this go.
    #[serde(with = "humantime_serde")]
    pub dlq_retention_max_age: Option<Duration>,
    /// `dlq_retention_max_len`: dead letters kept per consumer group (1 to 2^53).
    pub dlq_retention_max_len: Option<u64>,
}

impl StreamConfig {
    /// The retention the section declares, `None` when it has no retention key. Unchecked: see
    /// [`Config::validate`](crate::config::Config::validate).
    pub fn retention(&self) -> Option<crate::store::Retention> {
        let declared = self.retention.is_some()
            || self.retention_max_age.is_some()
            || self.retention_max_len.is_some()
            || self.dlq_retention_max_age.is_some()
            || self.dlq_retention_max_len.is_some();
        if !declared {
            return None;
        }
        let ms = |d: Option<Duration>| d.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let mut retention = crate::store::Retention::new(self.retention.unwrap_or_default());
        retention.max_age_ms = ms(self.retention_max_age);
        retention.max_len = self.retention_max_len;
        retention.dlq_max_age_ms = ms(self.dlq_retention_max_age);
        retention.dlq_max_len = self.dlq_retention_max_len;
        Some(retention)
    }
}

/// `[listeners.<name>]`: overrides of one listener's settings; every key is optional and wins
/// over the value in `#[stream_listener(...)]` and the defaults of
/// [`crate::member::ListenerOptions`].
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct ListenerConfig {
    /// `concurrency`: logical members in this process (1 to
    /// [`MAX_CONCURRENCY`](crate::member::MAX_CONCURRENCY)).
    pub concurrency: Option<u32>,
    /// `runtime_max_concurrency`: local workers per member (≥ 1, default 1).
    pub runtime_max_concurrency: Option<u32>,
    /// `batch_size`: entries per read and shard (1 to
    /// [`MAX_BATCH_SIZE`](crate::member::MAX_BATCH_SIZE), default 500).
    pub batch_size: Option<usize>,
    /// `block`: longest wait for new entries (> 0, default 2 s).
    #[serde(with = "humantime_serde")]
    pub block: Option<Duration>,
    /// `max_attempts`: handler attempts before dead-lettering (≥ 1, default 3).
    pub max_attempts: Option<u32>,
    /// `backoff`: first retry backoff, doubled per attempt (default 200 ms).
    #[serde(with = "humantime_serde")]
    pub backoff: Option<Duration>,
    /// `max_deliveries`: handler attempts on an entry, in processes that did not finish them (it
    /// may crash the process), after which it is dead-lettered unhandled (≥ 1, default 10).
    /// Re-reads without an attempt do not count (docs/design.md §8.9).
    pub max_deliveries: Option<u64>,
    /// `handler_timeout`: limit of one handler attempt (> 0, below `rebalance_timeout`, default
    /// 30 s).
    #[serde(with = "humantime_serde")]
    pub handler_timeout: Option<Duration>,
    /// `shutdown_timeout`: time in-flight handlers get at shutdown (default 30 s).
    #[serde(with = "humantime_serde")]
    pub shutdown_timeout: Option<Duration>,
    /// `start_from`: `"earliest"` (default) or `"latest"`, where a newly registered group starts.
    pub start_from: Option<StartFrom>,
    /// `fencing`: `"strict"` (default) or `"acks"` (docs/design.md §8).
    pub fencing: Option<FencingMode>,
    /// `retention_interval`: how often each shard task trims its shard to the stream's
    /// retention (> 0, default 1 min; docs/design.md §10.9).
    #[serde(with = "humantime_serde")]
    pub retention_interval: Option<Duration>,
    /// `hook_timeout`: limit of one lifecycle hook call (> 0, below `rebalance_timeout`,
    /// default 10 s; docs/design.md §13.3).
    #[serde(with = "humantime_serde")]
    pub hook_timeout: Option<Duration>,
    /// `batch_max_wait`: how long a batch listener's shard waits for a fuller batch (up to
    /// `batch_size`) before calling the handler (default 0; at most half of `member_lease_ttl`;
    /// docs/design.md §14.2).
    #[serde(with = "humantime_serde")]
    pub batch_max_wait: Option<Duration>,
    /// `ordering`: `"shard"` (default), `"key"` or `"none"`: how a shard's entries may run
    /// relative to each other (docs/design.md §14.3); per-entry listeners only (a batch
    /// listener's batches of a shard run one at a time).
    pub ordering: Option<crate::member::Ordering>,
    /// `max_in_flight`: with `ordering = "key"` or `"none"`, the most handler calls of one shard
    /// in flight at once (≥ 1, default 16); ignored with `"shard"`.
    pub max_in_flight: Option<u32>,
    /// `max_entry_bytes`: the largest entry, in bytes of its field names and values, handed to
    /// the handler (≥ 1, default 16 MiB); a larger one is dead-lettered `too-large` by id,
    /// unhandled (docs/design.md §8.6).
    pub max_entry_bytes: Option<usize>,
}

/// `[observability]`: the process's HTTP listener for `/metrics`, `/healthz` and `/readyz`
/// (docs/design.md §13.2).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct ObservabilityConfig {
    /// `listen`: the socket address the HTTP listener binds, `"127.0.0.1:9464"` or
    /// `"[::]:9464"` (an IP and a port, no host name). Absent: no listener. See
    /// [`Config::listen_addr`](crate::config::Config::listen_addr).
    pub listen: Option<String>,
    /// `metrics_interval` (default 5 s, > 0): how often gauges are re-set; the Prometheus
    /// exporter forgets a gauge not set for three intervals (or three heartbeat intervals or
    /// `block`s, when longer).
    #[serde(with = "humantime_serde")]
    pub metrics_interval: Duration,
}

impl Default for ObservabilityConfig {
    fn default() -> Self {
        ObservabilityConfig {
            listen: None,
            metrics_interval: DEFAULT_METRICS_INTERVAL,
        }
    }
}
