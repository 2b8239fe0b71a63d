//! What the configuration gives the runtime: a listener's options, a publisher and its options.

use super::Config;
use super::error::ConfigError;
use crate::member::ListenerOptions;
use crate::producer::PublisherOptions;

impl Config {
    /// The settings of listener `name`: `base` (defaults and the values of
    /// `#[stream_listener(...)]`) with `[coordination]`, `[member] instance_id` and the
    /// overrides of `[listeners.<name>]` applied.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] when the timings are invalid, or when the listener's effective
    /// `handler_timeout` or `hook_timeout` is not below `rebalance_timeout` (docs/design.md §8,
    /// §13.3).
    pub fn listener_options(
        &self,
        name: &str,
        base: ListenerOptions,
    ) -> Result<ListenerOptions, ConfigError> {
        let mut options = base;
        options.name = name.to_owned();
        options.coordination = self.coordinator_config()?;
        options.lease_margin = self.coordination.lease_margin;
        options.metrics_interval = self.observability.metrics_interval;
        options.min_replica_acks = self.redis.min_replica_acks;
        options.replica_ack_timeout = self.redis.replica_ack_timeout;
        if let Some(id) = &self.member.instance_id {
            options.instance_id = Some(id.clone());
        }
        if let Some(l) = self.listeners.get(name) {
            self.validate_listener(name, l)?;
            macro_rules! set {
                ($($field:ident),*) => { $( if let Some(v) = l.$field { options.$field = v; } )* };
            }
            set!(
                concurrency,
                runtime_max_concurrency,
                batch_size,
                block,
                max_attempts,
                backoff,
                max_deliveries,
                handler_timeout,
                shutdown_timeout,
                start_from,
                fencing,
                retention_interval,
                ordering,
                max_in_flight
            );
            if let Some(hook_timeout) = l.hook_timeout {
                options.hook_timeout = Some(hook_timeout);
            }
            if let Some(batch_max_wait) = l.batch_max_wait {
                options.batch_max_wait = batch_max_wait;
            }
            if let Some(max_entry_bytes) = l.max_entry_bytes {
                options.max_entry_bytes = Some(max_entry_bytes);
            }
        }
        let handler_given = self
            .listeners
            .get(name)
            .is_some_and(|l| l.handler_timeout.is_some());
        self.below_rebalance_timeout(
            name,
            &options,
            ("handler_timeout", options.handler_timeout, handler_given),
            "a slow handler would get its member fenced while it drains",
        )?;
        // Only a given one: the default is capped at half the rebalance timeout.
        if let Some(hook_timeout) = options.hook_timeout {
            let hook_given = self
                .listeners
                .get(name)
                .is_some_and(|l| l.hook_timeout.is_some());
            self.below_rebalance_timeout(
                name,
                &options,
                ("hook_timeout", hook_timeout, hook_given),
                "an on_revoked hook could get its member fenced before the release",
            )?;
        }
        // The batch's wait must leave it the lease to run in (docs/design.md §14.2).
        let lease_half = options.coordination.member_lease_ttl / 2;
        if options.batch_max_wait > lease_half {
            return Err(self.invalid(
                &["listeners", name, "batch_max_wait"],
                format!(
                    "listener {name:?}: batch_max_wait ({}) must be at most half of member_lease_ttl ({}): lower it",
                    humantime::format_duration(options.batch_max_wait),
                    humantime::format_duration(options.coordination.member_lease_ttl)
                ),
            ));
        }
        Ok(options)
    }

    /// Checks that listener `name`'s `key` (its `value`; `given` in `[listeners.<name>]`, else
    /// from the code or the default) is below the rebalance timeout, as a drain needs. The error
    /// points at the key when it was given, else at `[coordination] rebalance_timeout`.
    fn below_rebalance_timeout(
        &self,
        name: &str,
        options: &ListenerOptions,
        (key, value, given): (&str, std::time::Duration, bool),
        or_else: &str,
    ) -> Result<(), ConfigError> {
        let rebalance_timeout = options.coordination.rebalance_timeout;
        if value < rebalance_timeout {
            return Ok(());
        }
        let path: &[&str] = if given {
            &["listeners", name, key]
        } else {
            &["coordination", "rebalance_timeout"]
        };
        Err(self.invalid(
            path,
            format!(
                "listener {name:?}: {key} ({}) must be below rebalance_timeout ({}), or {or_else}",
                humantime::format_duration(value),
                humantime::format_duration(rebalance_timeout)
            ),
        ))
    }

    /// A [`Publisher`](crate::producer::Publisher) for stream `prefix` on the configured Redis
    /// (standalone or cluster), with [`Config::publisher_options`]. One connection attempt, no
    /// retries.
    ///
    /// A stream the config declares with `[streams.<prefix>] shards = N` is created first when
    /// it does not exist, as `run()` does at startup (docs/design.md §14.5): a producer-only
    /// service needs no admin step. An existing stream keeps its shard count (a different one is
    /// logged; change it with `stream-listener stream scale`). Only `prefix` is created, and
    /// retention is left to `run()` and the admin tool.
    ///
    /// # Errors
    /// [`PublishError::Connect`](crate::producer::PublishError::Connect) when Redis cannot be
    /// reached, [`PublishError::Redis`](crate::producer::PublishError::Redis) when a command
    /// fails; [`PublishError::Provision`](crate::producer::PublishError::Provision) when the
    /// declared stream cannot be created; otherwise as
    /// [`Publisher::new`](crate::producer::Publisher::new) (for example
    /// [`PublishError::UnknownStream`](crate::producer::PublishError::UnknownStream) for a
    /// stream that neither exists nor is declared with `shards`).
    pub async fn publisher(
        &self,
        prefix: &str,
    ) -> Result<crate::producer::Publisher, crate::producer::PublishError> {
        let target = self.redis.target();
        let mut conn = crate::connection::RedisConnection::connect(
            &target,
            crate::connection::DEFAULT_RESPONSE_TIMEOUT,
        )
        .await
        .map_err(|source| crate::producer::PublishError::Connect {
            target: target.describe(),
            source,
        })?;
        if let Some(shards) = self.streams.get(prefix).and_then(|s| s.shards) {
            provision_declared(&mut conn, prefix, shards).await?;
        }
        crate::producer::Publisher::new(conn, prefix, self.publisher_options(prefix)).await
    }

    /// Publisher settings for stream `prefix`: the defaults with `max_payload_bytes` of
    /// `[streams.<prefix>]` applied.
    pub fn publisher_options(&self, prefix: &str) -> PublisherOptions {
        let mut options = PublisherOptions::default();
        if let Some(max) = self.streams.get(prefix).and_then(|s| s.max_payload_bytes) {
            options.max_payload_bytes = max;
        }
        options.min_replica_acks = self.redis.min_replica_acks;
        options.replica_ack_timeout = self.redis.replica_ack_timeout;
        options
    }
}

/// Creates the declared stream `prefix` with `shards` shards when it does not exist
/// ([`crate::store::provision::create_stream`], as `run()`'s step 4); an existing one keeps its
/// shard count.
async fn provision_declared(
    conn: &mut crate::connection::RedisConnection,
    prefix: &str,
    shards: u32,
) -> Result<(), crate::producer::PublishError> {
    use crate::store::provision::{ProvisionError, create_stream};
    match create_stream(conn, prefix, shards).await {
        Ok(created) if created.created => {
            tracing::info!(stream = %prefix, shards, "stream created");
            Ok(())
        }
        Ok(_) => Ok(()),
        Err(ProvisionError::ShardCountMismatch { existing, .. }) => {
            tracing::warn!(
                stream = %prefix,
                existing,
                configured = shards,
                "stream exists with another shard count; keeping it (change it with `stream-listener stream scale`)"
            );
            Ok(())
        }
        Err(ProvisionError::InvalidName(error)) => Err(error.into()),
        Err(source) => Err(crate::producer::PublishError::Provision {
            prefix: prefix.to_owned(),
            source,
        }),
    }
}
