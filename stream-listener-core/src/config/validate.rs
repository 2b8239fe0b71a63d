//! Checking the values of a loaded configuration, with errors naming the key (docs/design.md
//! §11).

use super::error::ConfigError;
use super::sections::{ListenerConfig, StreamConfig};
use super::{Config, MAX_SHARDS};
use crate::coordinator::CoordinatorConfig;

impl Config {
    /// Checks every value: Redis URLs parse and `url` and `cluster_nodes` are not both given;
    /// timings are positive, `heartbeat_interval` ≤ `member_lease_ttl` / 3, `lease_margin` <
    /// `member_lease_ttl`; the instance id is usable; stream prefixes are valid (no `{`
    /// or `}`) and `shards` is 1 to [`MAX_SHARDS`]; listener counts are at least 1 and
    /// `handler_timeout` is positive and below `rebalance_timeout`; `[observability] listen` is
    /// a socket address and `metrics_interval` is positive and at most a day.
    ///
    /// # Errors
    /// The first problem found, as [`ConfigError::Invalid`] naming the key (and the file and
    /// line when the configuration came from a file).
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_redis()?;
        self.coordinator_config()?;
        self.validate_replica_wait()?;
        if let Some(id) = &self.member.instance_id {
            check_instance_id(id).map_err(|m| self.invalid(&["member", "instance_id"], m))?;
        }
        for (prefix, stream) in &self.streams {
            crate::keys::validate_stream_prefix(prefix).map_err(|e| {
                self.invalid(&["streams", prefix], format!("{e} (write `[streams.<prefix>]` with the bare prefix, e.g. [streams.orders])"))
            })?;
            if let Some(shards) = stream.shards
                && !(1..=MAX_SHARDS).contains(&shards)
            {
                return Err(self.invalid(
                    &["streams", prefix, "shards"],
                    format!("{shards} shards: a stream needs 1 to {MAX_SHARDS} shards"),
                ));
            }
            if stream.max_payload_bytes == Some(0) {
                return Err(self.invalid(
                    &["streams", prefix, "max_payload_bytes"],
                    "must be at least 1 (default 1048576, 1 MiB)",
                ));
            }
            self.validate_retention(prefix, stream)?;
        }
        for (name, listener) in &self.listeners {
            self.validate_listener(name, listener)?;
        }
        self.listen_addr()?;
        if self.observability.metrics_interval.is_zero() {
            return Err(self.invalid(
                &["observability", "metrics_interval"],
                "must be positive (default \"5s\")",
            ));
        }
        if self.observability.metrics_interval > crate::coordinator::MAX_TIMING {
            return Err(self.invalid(
                &["observability", "metrics_interval"],
                "must be at most 1 day (default \"5s\")",
            ));
        }
        Ok(())
    }

    /// The address of `[observability] listen`, parsed; `None` when the key is absent (no HTTP
    /// listener).
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming `observability.listen` (and its file and line) when the
    /// value is not an IP address and port such as `"127.0.0.1:9464"` or `"[::]:9464"`.
    pub fn listen_addr(&self) -> Result<Option<std::net::SocketAddr>, ConfigError> {
        let Some(listen) = &self.observability.listen else {
            return Ok(None);
        };
        check_listen_addr(listen).map(Some).map_err(|message| {
            self.invalid(
                &["observability", "listen"],
                format!("{message}, or remove the key for no HTTP listener"),
            )
        })
    }

    pub(super) fn validate_redis(&self) -> Result<(), ConfigError> {
        let redis = &self.redis;
        if redis.url.is_some() && !redis.cluster_nodes.is_empty() {
            return Err(self.invalid(
                &["redis", "cluster_nodes"],
                "give either `url` (one server) or `cluster_nodes` (a cluster), not both",
            ));
        }
        self.validate_sentinel()?;
        if let Some(url) = &redis.url {
            check_redis_url(url).map_err(|m| self.invalid(&["redis", "url"], m))?;
        }
        for node in &redis.cluster_nodes {
            check_redis_url(node).map_err(|m| self.invalid(&["redis", "cluster_nodes"], m))?;
        }
        if redis.startup_timeout.is_zero() {
            return Err(self.invalid(
                &["redis", "startup_timeout"],
                "must be positive, e.g. \"30s\"",
            ));
        }
        self.validate_tls()
    }

    /// The `tls_*` keys (README "TLS"): a client certificate needs its key and the reverse,
    /// `tls_insecure` excludes `tls_ca_file` (nothing would be verified against it), and TLS
    /// settings need `rediss://` URLs for `url` and `cluster_nodes`, and for a Sentinel target at
    /// least one `rediss://` sentinel or `url`.
    fn validate_tls(&self) -> Result<(), ConfigError> {
        let redis = &self.redis;
        match (&redis.tls_cert_file, &redis.tls_key_file) {
            (Some(_), None) => {
                return Err(self.invalid(
                    &["redis", "tls_cert_file"],
                    "mutual TLS needs tls_key_file too (the client certificate's private key, PEM)",
                ));
            }
            (None, Some(_)) => {
                return Err(self.invalid(
                    &["redis", "tls_key_file"],
                    "mutual TLS needs tls_cert_file too (the client certificate, PEM)",
                ));
            }
            _ => {}
        }
        if redis.tls_insecure && redis.tls_ca_file.is_some() {
            return Err(self.invalid(
                &["redis", "tls_insecure"],
                "tls_insecure = true skips verifying the server, so tls_ca_file would not be used: remove one of them (keep tls_ca_file to verify the server)",
            ));
        }
        let tls_key = [
            (redis.tls_ca_file.is_some(), "tls_ca_file"),
            (redis.tls_cert_file.is_some(), "tls_cert_file"),
            (redis.tls_insecure, "tls_insecure"),
        ]
        .into_iter()
        .find_map(|(set, key)| set.then_some(key));
        let Some(tls_key) = tls_key else {
            return Ok(());
        };
        let tls_url = |url: &String| url.starts_with("rediss://");
        if !redis.sentinels.is_empty() {
            // The TLS files serve the rediss:// sentinels and a rediss:// master (the scheme of
            // `url`, or without one, of the sentinels): with no rediss:// URL they are unused.
            if redis.sentinels.iter().any(tls_url) || redis.url.as_ref().is_some_and(tls_url) {
                return Ok(());
            }
            return Err(self.invalid(
                &["redis", tls_key],
                format!(
                    "{tls_key} is set but the sentinels and [redis] url are plain redis:// URLs, which never use TLS; write the sentinels as rediss://host:port, and url as rediss://... for a TLS master"
                ),
            ));
        }
        let plain = match (&redis.url, redis.cluster_nodes.first()) {
            (_, Some(_)) => redis
                .cluster_nodes
                .iter()
                .find(|n| !n.starts_with("rediss://"))
                .map(|n| ("cluster_nodes", n.clone())),
            (Some(url), None) => (!url.starts_with("rediss://")).then(|| ("url", url.clone())),
            (None, None) => Some(("url", super::DEFAULT_REDIS_URL.to_owned())),
        };
        match plain {
            Some((key, url)) => Err(self.invalid(
                &["redis", tls_key],
                format!(
                    "{tls_key} is set but [redis] {key} {:?} is a plain redis:// URL, which never uses TLS; write it as rediss://host:port",
                    redact_url(&url)
                ),
            )),
            None => Ok(()),
        }
    }

    /// `sentinels` and `sentinel_master` come together, never with `cluster_nodes`, and the
    /// sentinels' URLs parse.
    fn validate_sentinel(&self) -> Result<(), ConfigError> {
        let redis = &self.redis;
        if !redis.sentinels.is_empty() && !redis.cluster_nodes.is_empty() {
            return Err(self.invalid(
                &["redis", "sentinels"],
                "give either `sentinels` (a master found through Redis Sentinel) or `cluster_nodes` (a Redis Cluster), not both",
            ));
        }
        match (redis.sentinels.is_empty(), &redis.sentinel_master) {
            (false, None) => {
                return Err(self.invalid(
                    &["redis", "sentinels"],
                    "`sentinels` needs `sentinel_master`: the name the sentinels monitor the master by (`sentinel monitor <name> ...`), e.g. sentinel_master = \"mymaster\"",
                ));
            }
            (true, Some(_)) => {
                return Err(self.invalid(
                    &["redis", "sentinel_master"],
                    "`sentinel_master` needs `sentinels`: the URLs of the sentinels to ask, e.g. sentinels = [\"redis://10.0.0.1:26379\"]",
                ));
            }
            (false, Some(name)) if name.trim().is_empty() => {
                return Err(self.invalid(
                    &["redis", "sentinel_master"],
                    "must not be empty: the name the sentinels monitor the master by, e.g. \"mymaster\"",
                ));
            }
            _ => {}
        }
        for sentinel in &redis.sentinels {
            check_redis_url(sentinel).map_err(|m| self.invalid(&["redis", "sentinels"], m))?;
        }
        Ok(())
    }

    /// The protocol timings of `[coordination]`, checked.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] for a zero duration, a heartbeat slower than a third of the
    /// lease, or a lease margin not below the lease.
    pub fn coordinator_config(&self) -> Result<CoordinatorConfig, ConfigError> {
        let c = &self.coordination;
        for (key, value) in [
            ("heartbeat_interval", c.heartbeat_interval),
            ("member_lease_ttl", c.member_lease_ttl),
            ("rebalance_timeout", c.rebalance_timeout),
        ] {
            if value.is_zero() {
                return Err(self.invalid(&["coordination", key], "must be positive"));
            }
        }
        if c.heartbeat_interval.saturating_mul(3) > c.member_lease_ttl {
            return Err(self.invalid(
                &["coordination", "heartbeat_interval"],
                format!(
                    "{} is more than a third of member_lease_ttl ({}); members would lose their lease between two heartbeats: lower it or raise member_lease_ttl",
                    humantime::format_duration(c.heartbeat_interval),
                    humantime::format_duration(c.member_lease_ttl)
                ),
            ));
        }
        // The member's lease (ttl - margin) must outlast two heartbeat intervals, or it lapses
        // between heartbeats and every lapse re-reads (and re-counts) the pending entries.
        if let Some(margin) = c.lease_margin
            && margin.saturating_add(c.heartbeat_interval.saturating_mul(2)) > c.member_lease_ttl
        {
            return Err(self.invalid(
                &["coordination", "lease_margin"],
                format!(
                    "{} leaves members less than two heartbeat intervals ({} each) of their {} lease; lower lease_margin (at most member_lease_ttl - 2 x heartbeat_interval)",
                    humantime::format_duration(margin),
                    humantime::format_duration(c.heartbeat_interval),
                    humantime::format_duration(c.member_lease_ttl)
                ),
            ));
        }
        CoordinatorConfig::new(
            c.heartbeat_interval,
            c.member_lease_ttl,
            c.rebalance_timeout,
        )
        .map_err(|e| self.invalid(&["coordination"], e.to_string()))
    }

    pub(super) fn validate_listener(
        &self,
        name: &str,
        l: &ListenerConfig,
    ) -> Result<(), ConfigError> {
        let at_least_one = [
            ("concurrency", l.concurrency.map(u64::from)),
            (
                "runtime_max_concurrency",
                l.runtime_max_concurrency.map(u64::from),
            ),
            ("batch_size", l.batch_size.map(|v| v as u64)),
            ("max_attempts", l.max_attempts.map(u64::from)),
            ("max_deliveries", l.max_deliveries),
            ("max_in_flight", l.max_in_flight.map(u64::from)),
            ("max_entry_bytes", l.max_entry_bytes.map(|v| v as u64)),
        ];
        for (key, value) in at_least_one {
            if value == Some(0) {
                return Err(self.invalid(&["listeners", name, key], "must be at least 1"));
            }
        }
        let at_most = [
            (
                "batch_size",
                l.batch_size.map(|v| v as u64),
                crate::runtime::MAX_BATCH_SIZE as u64,
                "entries read per shard and round",
            ),
            (
                "concurrency",
                l.concurrency.map(u64::from),
                u64::from(crate::runtime::MAX_CONCURRENCY),
                "the largest shard count: more members could never own a shard",
            ),
        ];
        for (key, value, max, why) in at_most {
            if value.is_some_and(|v| v > max) {
                return Err(self.invalid(
                    &["listeners", name, key],
                    format!("must be at most {max} ({why})"),
                ));
            }
        }
        for (key, value) in [
            ("block", l.block),
            ("handler_timeout", l.handler_timeout),
            ("retention_interval", l.retention_interval),
            ("hook_timeout", l.hook_timeout),
        ] {
            if value.is_some_and(|v| v.is_zero()) {
                return Err(self.invalid(&["listeners", name, key], "must be positive"));
            }
        }
        Ok(())
    }

    /// Fails on a `[listeners.<name>]` section whose name is not in `known` (the registered
    /// listeners of the program).
    ///
    /// # Errors
    /// [`ConfigError::UnknownListener`] for the first such section, with its location.
    pub fn check_listener_names<'a>(
        &self,
        known: impl IntoIterator<Item = &'a str>,
    ) -> Result<(), ConfigError> {
        let mut known: Vec<String> = known.into_iter().map(str::to_owned).collect();
        known.sort();
        known.dedup();
        for name in self.listeners.keys() {
            if !known.iter().any(|k| k == name) {
                return Err(ConfigError::UnknownListener {
                    name: name.clone(),
                    location: self.locate(&["listeners", name]),
                    known,
                });
            }
        }
        Ok(())
    }
}

/// The one password redaction ([`crate::connection::redact_url`]), re-exported here for
/// config users.
pub use crate::connection::redact_url;

pub(super) fn check_redis_url(url: &str) -> Result<(), String> {
    redis::IntoConnectionInfo::into_connection_info(url)
        .map(|_| ())
        .map_err(|e| {
            format!(
                "{:?} is not a Redis URL ({e}); write redis://[user:password@]host:port[/db] or rediss://... for TLS",
                redact_url(url)
            )
        })
}

/// `listen` parsed as a socket address, or what to write instead.
pub(super) fn check_listen_addr(listen: &str) -> Result<std::net::SocketAddr, String> {
    listen.parse().map_err(|e| {
        format!(
            "{listen:?} is not a socket address ({e}); write an IP address and a port, e.g. \"127.0.0.1:9464\", \"0.0.0.0:9464\" (every interface) or \"[::]:9464\""
        )
    })
}

pub(super) fn check_instance_id(id: &str) -> Result<(), String> {
    if id.is_empty() {
        return Err("the instance id is empty; give a non-empty id or remove the key".into());
    }
    if let Some(c) = id
        .chars()
        .find(|c| c.is_whitespace() || c.is_control() || matches!(c, '{' | '}'))
    {
        return Err(format!(
            "instance id {id:?} contains {c:?}; use letters, digits, '-', '_', '.' or ':'"
        ));
    }
    if id.len() > crate::keys::MAX_NAME_LEN {
        return Err(format!(
            "instance id is {} bytes long; the limit is {}",
            id.len(),
            crate::keys::MAX_NAME_LEN
        ));
    }
    Ok(())
}

impl Config {
    /// The retention keys of `[streams.<prefix>]` (docs/design.md §10.9): ages above 0 and up
    /// to 100 years, the shards' `retention_max_age` at least one `heartbeat_interval`; lengths
    /// of 1 to 2^53.
    fn validate_retention(&self, prefix: &str, stream: &StreamConfig) -> Result<(), ConfigError> {
        let heartbeat = self.coordination.heartbeat_interval;
        for (key, age) in [
            ("retention_max_age", stream.retention_max_age),
            ("dlq_retention_max_age", stream.dlq_retention_max_age),
        ] {
            let Some(age) = age else { continue };
            let ms = u64::try_from(age.as_millis()).unwrap_or(u64::MAX);
            crate::store::check_age(key, Some(ms))
                .map_err(|e| self.invalid(&["streams", prefix, key], e.to_string()))?;
            // Dead letters are not read by members, so only the shards' age needs the floor.
            if key == "retention_max_age" && age < heartbeat {
                return Err(self.invalid(
                    &["streams", prefix, key],
                    format!(
                        "{} is below one heartbeat_interval ({}); entries would go before a member could read them: give at least that",
                        humantime::format_duration(age),
                        humantime::format_duration(heartbeat)
                    ),
                ));
            }
        }
        for (key, len) in [
            ("retention_max_len", stream.retention_max_len),
            ("dlq_retention_max_len", stream.dlq_retention_max_len),
        ] {
            crate::store::check_len(key, len)
                .map_err(|e| self.invalid(&["streams", prefix, key], e.to_string()))?;
        }
        Ok(())
    }
}

impl Config {
    /// `[redis] replica_ack_timeout` with `min_replica_acks > 0`: positive, and below
    /// `heartbeat_interval`, because a `WAIT` holds the connection it is sent on: a member's
    /// reads, or a publisher's connection, which heartbeats may share (README "Waiting for
    /// replicas"). On a cluster each `WAIT` goes in the
    /// pipeline of its write, to that write's node, so cluster targets are accepted.
    fn validate_replica_wait(&self) -> Result<(), ConfigError> {
        let redis = &self.redis;
        if redis.min_replica_acks == 0 {
            return Ok(());
        }
        if redis.replica_ack_timeout.is_zero() {
            return Err(self.invalid(
                &["redis", "replica_ack_timeout"],
                "must be positive with min_replica_acks > 0 (WAIT with 0 would block forever); default \"1s\"",
            ));
        }
        let heartbeat = self.coordination.heartbeat_interval;
        if redis.replica_ack_timeout >= heartbeat {
            return Err(self.invalid(
                &["redis", "replica_ack_timeout"],
                format!(
                    "replica_ack_timeout ({}) must be below heartbeat_interval ({}): a WAIT holds the member's connection, and heartbeats queue behind it while replicas lag",
                    humantime::format_duration(redis.replica_ack_timeout),
                    humantime::format_duration(heartbeat)
                ),
            ));
        }
        Ok(())
    }
}
