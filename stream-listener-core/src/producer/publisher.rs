//! The [`Publisher`]: routed `XADD`s with a leased routing cache (docs/design.md §9).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use futures_util::future::try_join_all;
use redis::{Cmd, Pipeline};
use serde::Serialize;

use super::PublishError;
use super::routing::shard_for_key;
use crate::connection::RedisConnection;
use crate::keys::StreamKeys;
use crate::model::{ShardState, StreamMetadata};
use crate::store::{load_stream_metadata, read_metadata_version};

/// Default [`PublisherOptions::max_payload_bytes`]: 1 MiB.
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 1024 * 1024;
/// Default [`PublisherOptions::refresh_interval`]: 5 s.
pub const DEFAULT_REFRESH_INTERVAL: Duration = Duration::from_secs(5);
/// Default [`PublisherOptions::routing_lease`]: 30 s.
pub const DEFAULT_ROUTING_LEASE: Duration = Duration::from_secs(30);

/// Settings of a [`Publisher`]. `PublisherOptions::default()` gives the documented defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublisherOptions {
    /// Largest payload accepted, in bytes (default 1 MiB, [`DEFAULT_MAX_PAYLOAD_BYTES`]): the
    /// JSON bytes for [`Publisher::publish`] and [`Publisher::publish_batch`], the sum of field
    /// name and value lengths for [`Publisher::publish_raw`]. The partition key is not counted.
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
    /// Checked lazily at publish time: one `HGET metadataVersion` once this long has passed since
    /// the last successful read was sent, and the full metadata only when the version changed.
    /// Must be shorter than [`Self::routing_lease`]; `Duration::ZERO` checks before every publish.
    pub refresh_interval: Duration,
    /// How long routing metadata may be used after its read was sent (default 30 s,
    /// [`DEFAULT_ROUTING_LEASE`]). When a refresh fails, the cached routing is used until this
    /// lease runs out; past it, publish fails closed with [`PublishError::RoutingLeaseExpired`].
    /// Admin retirement of a drained shard waits at least this long after the scale-in
    /// (docs/design.md §10), so it must not exceed the admin's routing lease. Must be positive.
    pub routing_lease: Duration,
}

impl Default for PublisherOptions {
    fn default() -> Self {
        PublisherOptions {
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
            maxlen: None,
            refresh_interval: DEFAULT_REFRESH_INTERVAL,
            routing_lease: DEFAULT_ROUTING_LEASE,
        }
    }
}

impl PublisherOptions {
    fn validate(&self) -> Result<(), PublishError> {
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
        if self.refresh_interval >= self.routing_lease {
            return invalid(format!(
                "refresh_interval ({:?}) must be shorter than routing_lease ({:?}), or a failed refresh would fail publishing at once",
                self.refresh_interval, self.routing_lease
            ));
        }
        Ok(())
    }
}

/// Where one message was appended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    /// The shard stream key `{<prefix>:<shard>}`.
    pub stream_key: String,
    /// The entry id Redis gave it (`<ms>-<seq>`).
    pub entry_id: String,
    /// The shard index: `shard_for_key(partition_key, shardCount)`.
    pub shard: u32,
}

/// What a [`Publisher`] currently routes with (for diagnostics and tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoutingSnapshot {
    /// `metadataVersion` of the cached stream metadata.
    pub metadata_version: u64,
    /// `shardCount` routed over (ACTIVE shards `0..shard_count`).
    pub shard_count: u32,
    /// Time since the read that confirmed it was sent (the lease runs from then).
    pub age: Duration,
}

/// The routing derived from one version of the stream metadata.
#[derive(Debug)]
struct Routing {
    metadata_version: u64,
    shard_count: u32,
    /// `{<prefix>:<i>}` for `i` in `0..shard_count`.
    shard_keys: Vec<String>,
}

impl Routing {
    /// Checks that the metadata is routable: the prefix matches and every shard in
    /// `0..shardCount` is ACTIVE.
    fn from_metadata(keys: &StreamKeys, meta: &StreamMetadata) -> Result<Routing, PublishError> {
        let inconsistent = |detail: String| PublishError::InconsistentMetadata {
            prefix: keys.prefix().to_owned(),
            detail,
        };
        if meta.stream_prefix != keys.prefix() {
            return Err(inconsistent(format!(
                "{} holds streamPrefix {:?}",
                keys.metadata(),
                meta.stream_prefix
            )));
        }
        let states: BTreeMap<u32, ShardState> = meta
            .shards
            .iter()
            .map(|s| (s.shard_index, s.state))
            .collect();
        for shard in 0..meta.shard_count {
            match states.get(&shard) {
                Some(ShardState::Active) => {}
                Some(state) => {
                    return Err(inconsistent(format!(
                        "shard {shard} is {state:?} but below shardCount {} (producers route to shards 0..shardCount, which must be ACTIVE)",
                        meta.shard_count
                    )));
                }
                None => {
                    return Err(inconsistent(format!(
                        "shard {shard} is below shardCount {} but not listed in shards",
                        meta.shard_count
                    )));
                }
            }
        }
        Ok(Routing {
            metadata_version: meta.metadata_version,
            shard_count: meta.shard_count,
            shard_keys: (0..meta.shard_count).map(|i| keys.shard(i)).collect(),
        })
    }
}

#[derive(Debug, Clone)]
struct Cached {
    routing: Arc<Routing>,
    /// When the read that confirmed `routing` was sent: the lease starts then.
    read_sent_at: Instant,
}

struct Inner {
    conn: RedisConnection,
    keys: StreamKeys,
    options: PublisherOptions,
    cache: Mutex<Cached>,
    /// One refresh at a time; publishes that wait for it use its result.
    refresh_lock: tokio::sync::Mutex<()>,
}

/// Publishes messages to one sharded stream (docs/design.md §9).
///
/// Each message goes to shard [`super::shard_for_key`]`(partition_key, shardCount)` as
/// `XADD {<prefix>:<shard>} NOMKSTREAM [MAXLEN ~ n] * key <partition_key> payload <json>`.
/// Messages with the same key go to the same shard while the shard count is unchanged, so they
/// are consumed in publish order.
///
/// Routing is cached by `metadataVersion`: after [`PublisherOptions::refresh_interval`] the next
/// publish sends one `HGET metadataVersion` and loads the whole metadata only when it changed.
/// When `NOMKSTREAM` finds no stream (the shard was retired and deleted), the publisher refreshes
/// at once and retries once. If refreshing fails, the cache is used until
/// [`PublishError::RoutingLeaseExpired`] after [`PublisherOptions::routing_lease`].
///
/// Cheap to clone: clones share the connection and the routing cache, and may publish
/// concurrently from several tasks.
#[derive(Clone)]
pub struct Publisher {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("prefix", &self.inner.keys.prefix())
            .field("routing", &self.routing_snapshot())
            .field("options", &self.inner.options)
            .finish()
    }
}

fn lock(cache: &Mutex<Cached>) -> MutexGuard<'_, Cached> {
    // The cache is replaced whole under the lock: a panic elsewhere cannot leave it half-written.
    cache
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Publisher {
    /// A publisher for the stream `prefix` on `conn` (standalone or cluster). Loads the stream
    /// metadata once (`HGETALL sl:{<prefix>}:stream`).
    ///
    /// A stream with zero shards is accepted here; publishing to it fails with
    /// [`PublishError::NoShards`] until it is scaled out.
    ///
    /// # Errors
    /// - [`PublishError::InvalidOptions`] for options that cannot work;
    /// - [`PublishError::InvalidPrefix`] for an empty prefix, one longer than 200 bytes, or one
    ///   with `{`, `}`, whitespace or control characters;
    /// - [`PublishError::UnknownStream`] when the stream metadata does not exist;
    /// - [`PublishError::InconsistentMetadata`] or [`PublishError::Metadata`] when it cannot be
    ///   routed with or read;
    /// - [`PublishError::Redis`] when Redis fails.
    pub async fn new(
        conn: RedisConnection,
        prefix: &str,
        options: PublisherOptions,
    ) -> Result<Publisher, PublishError> {
        options.validate()?;
        let keys = StreamKeys::new(prefix)?;
        let read_sent_at = Instant::now();
        let mut read_conn = conn.clone();
        let meta = load_stream_metadata(&mut read_conn, &keys)
            .await?
            .ok_or_else(|| unknown_stream(&keys))?;
        let routing = Arc::new(Routing::from_metadata(&keys, &meta)?);
        Ok(Publisher {
            inner: Arc::new(Inner {
                conn,
                keys,
                options,
                cache: Mutex::new(Cached {
                    routing,
                    read_sent_at,
                }),
                refresh_lock: tokio::sync::Mutex::new(()),
            }),
        })
    }

    /// The stream prefix.
    pub fn prefix(&self) -> &str {
        self.inner.keys.prefix()
    }

    /// The options it was built with.
    pub fn options(&self) -> &PublisherOptions {
        &self.inner.options
    }

    /// The cached routing (no Redis call).
    pub fn routing_snapshot(&self) -> RoutingSnapshot {
        let cached = lock(&self.inner.cache).clone();
        RoutingSnapshot {
            metadata_version: cached.routing.metadata_version,
            shard_count: cached.routing.shard_count,
            age: cached.read_sent_at.elapsed(),
        }
    }

    /// Serializes `payload` to JSON (serde_json) and appends
    /// `key <partition_key> payload <json>` to the key's shard. One `XADD`, plus a metadata check
    /// when the refresh interval has passed; after a retired shard, one refresh and one retry.
    ///
    /// # Errors
    /// [`PublishError::Serialize`] or [`PublishError::PayloadTooLarge`] (nothing sent);
    /// [`PublishError::NoShards`], [`PublishError::UnknownStream`],
    /// [`PublishError::InconsistentMetadata`], [`PublishError::Metadata`],
    /// [`PublishError::RoutingLeaseExpired`] (routing; nothing appended);
    /// [`PublishError::ShardMissing`] (nothing appended); [`PublishError::Redis`] (the entry may
    /// or may not have been appended).
    pub async fn publish<T: Serialize + ?Sized>(
        &self,
        partition_key: &str,
        payload: &T,
    ) -> Result<Published, PublishError> {
        let json = serde_json::to_vec(payload).map_err(|source| PublishError::Serialize {
            index: None,
            source,
        })?;
        self.check_size(json.len(), None)?;
        self.append_one(partition_key, &[("payload", &json)]).await
    }

    /// Appends `key <partition_key>` followed by `fields` (name, bytes) as given, for payloads
    /// that are not JSON. Same routing, retry and errors as [`Self::publish`]; the size checked
    /// against `max_payload_bytes` is the sum of field name and value lengths.
    ///
    /// # Errors
    /// [`PublishError::ReservedField`] for a field named `key`; otherwise as [`Self::publish`]
    /// (without [`PublishError::Serialize`]).
    pub async fn publish_raw(
        &self,
        partition_key: &str,
        fields: &[(&str, &[u8])],
    ) -> Result<Published, PublishError> {
        if let Some((field, _)) = fields.iter().find(|(name, _)| *name == "key") {
            return Err(PublishError::ReservedField {
                field: (*field).to_owned(),
            });
        }
        let size = fields
            .iter()
            .map(|(name, value)| name.len() + value.len())
            .sum();
        self.check_size(size, None)?;
        self.append_one(partition_key, fields).await
    }

    /// Publishes `messages` (partition key, payload) as [`Self::publish`] does, pipelined: every
    /// payload is serialized and size-checked first (one bad payload refuses the whole batch
    /// and nothing is sent), then one pipeline goes out — on a standalone server one pipeline for
    /// the whole batch, on a cluster one per shard (a redis-rs cluster pipeline must stay in one
    /// slot), sent concurrently. Entries of one shard are appended in batch order. Entries that
    /// met a retired shard are re-routed after one refresh and sent once more.
    ///
    /// Returns one [`Published`] per message, in input order. An empty batch sends nothing.
    ///
    /// # Errors
    /// As [`Self::publish`], with the batch position in [`PublishError::Serialize`] and
    /// [`PublishError::PayloadTooLarge`]. A [`PublishError::Redis`] or
    /// [`PublishError::ShardMissing`] can come after other entries of the batch were appended.
    pub async fn publish_batch<K: AsRef<str>, T: Serialize>(
        &self,
        messages: &[(K, T)],
    ) -> Result<Vec<Published>, PublishError> {
        let mut payloads = Vec::with_capacity(messages.len());
        for (index, (_, payload)) in messages.iter().enumerate() {
            let json = serde_json::to_vec(payload).map_err(|source| PublishError::Serialize {
                index: Some(index),
                source,
            })?;
            self.check_size(json.len(), Some(index))?;
            payloads.push(json);
        }
        if messages.is_empty() {
            return Ok(Vec::new());
        }
        let key = |i: usize| messages[i].0.as_ref();
        let mut routing = self.routing().await?;
        let mut published: Vec<Option<Published>> = vec![None; messages.len()];
        let mut pending: Vec<usize> = (0..messages.len()).collect();
        let mut retried = false;
        loop {
            let shards = pending
                .iter()
                .map(|&i| self.route(&routing, key(i)))
                .collect::<Result<Vec<_>, _>>()?;
            let ids = self
                .send(&routing, &pending, &shards, |i, shard_key| {
                    self.xadd(shard_key, key(i), &[("payload", &payloads[i])])
                })
                .await?;
            let mut missing = Vec::new();
            for ((&i, &shard), id) in pending.iter().zip(&shards).zip(ids) {
                match id {
                    Some(entry_id) => {
                        published[i] = Some(Published {
                            stream_key: routing.shard_keys[shard as usize].clone(),
                            entry_id,
                            shard,
                        });
                    }
                    None => missing.push((i, shard)),
                }
            }
            let Some(&(_, shard)) = missing.first() else {
                break;
            };
            if retried {
                return Err(self.shard_missing(&routing, shard));
            }
            retried = true;
            routing = self.refresh(Some(Instant::now())).await?;
            pending = missing.into_iter().map(|(i, _)| i).collect();
        }
        Ok(published.into_iter().flatten().collect())
    }

    fn check_size(&self, size: usize, index: Option<usize>) -> Result<(), PublishError> {
        let limit = self.inner.options.max_payload_bytes;
        if size > limit {
            return Err(PublishError::PayloadTooLarge { index, size, limit });
        }
        Ok(())
    }

    /// `XADD <shard_key> NOMKSTREAM [MAXLEN ~ n] * key <partition_key> <fields...>`.
    fn xadd(&self, shard_key: &str, partition_key: &str, fields: &[(&str, &[u8])]) -> Cmd {
        let mut cmd = redis::cmd("XADD");
        cmd.arg(shard_key).arg("NOMKSTREAM");
        if let Some(maxlen) = self.inner.options.maxlen {
            cmd.arg("MAXLEN").arg("~").arg(maxlen);
        }
        cmd.arg("*").arg("key").arg(partition_key);
        for (name, value) in fields {
            cmd.arg(*name).arg(*value);
        }
        cmd
    }

    /// The shard of `partition_key` under `routing`.
    fn route(&self, routing: &Routing, partition_key: &str) -> Result<u32, PublishError> {
        if routing.shard_count == 0 {
            return Err(PublishError::NoShards {
                prefix: self.inner.keys.prefix().to_owned(),
                metadata_version: routing.metadata_version,
            });
        }
        Ok(shard_for_key(partition_key, routing.shard_count))
    }

    fn shard_missing(&self, routing: &Routing, shard: u32) -> PublishError {
        PublishError::ShardMissing {
            stream_key: self.inner.keys.shard(shard),
            shard,
            metadata_version: routing.metadata_version,
        }
    }

    async fn append_one(
        &self,
        partition_key: &str,
        fields: &[(&str, &[u8])],
    ) -> Result<Published, PublishError> {
        let mut routing = self.routing().await?;
        let mut retried = false;
        loop {
            let shard = self.route(&routing, partition_key)?;
            let stream_key = &routing.shard_keys[shard as usize];
            let mut conn = self.inner.conn.clone();
            let id: Option<String> = self
                .xadd(stream_key, partition_key, fields)
                .query_async(&mut conn)
                .await?;
            match id {
                Some(entry_id) => {
                    return Ok(Published {
                        stream_key: stream_key.clone(),
                        entry_id,
                        shard,
                    });
                }
                None if !retried => {
                    retried = true;
                    routing = self.refresh(Some(Instant::now())).await?;
                }
                None => return Err(self.shard_missing(&routing, shard)),
            }
        }
    }

    /// Sends `XADD`s of the messages `pending` (routed to `shards`) and returns their ids
    /// (`None`: no stream), aligned with `pending`.
    async fn send(
        &self,
        routing: &Routing,
        pending: &[usize],
        shards: &[u32],
        xadd: impl Fn(usize, &str) -> Cmd,
    ) -> Result<Vec<Option<String>>, PublishError> {
        let conn = &self.inner.conn;
        if !conn.is_cluster() {
            let mut pipe = Pipeline::with_capacity(pending.len());
            for (&i, &shard) in pending.iter().zip(shards) {
                pipe.add_command(xadd(i, &routing.shard_keys[shard as usize]));
            }
            let mut conn = conn.clone();
            return Ok(pipe.query_async(&mut conn).await?);
        }
        // Cluster: one pipeline per shard (one slot each), all in flight at once.
        let mut by_shard: BTreeMap<u32, (Pipeline, Vec<usize>)> = BTreeMap::new();
        for (position, (&i, &shard)) in pending.iter().zip(shards).enumerate() {
            let (pipe, positions) = by_shard
                .entry(shard)
                .or_insert_with(|| (Pipeline::new(), Vec::new()));
            pipe.add_command(xadd(i, &routing.shard_keys[shard as usize]));
            positions.push(position);
        }
        let replies = try_join_all(by_shard.into_values().map(|(pipe, positions)| {
            let mut conn = conn.clone();
            async move {
                let ids: Vec<Option<String>> = pipe.query_async(&mut conn).await?;
                Ok::<_, redis::RedisError>((positions, ids))
            }
        }))
        .await?;
        let mut ids = vec![None; pending.len()];
        for (positions, shard_ids) in replies {
            for (position, id) in positions.into_iter().zip(shard_ids) {
                ids[position] = id;
            }
        }
        Ok(ids)
    }

    /// The routing to publish with now: the cache, checked once the refresh interval has passed.
    async fn routing(&self) -> Result<Arc<Routing>, PublishError> {
        let cached = lock(&self.inner.cache).clone();
        // refresh_interval < routing_lease: a cache this fresh is within its lease.
        if cached.read_sent_at.elapsed() < self.inner.options.refresh_interval {
            return Ok(cached.routing);
        }
        self.refresh(None).await
    }

    /// Refreshes the routing. `nil_at: Some(t)`: an `XADD` found no stream at `t`, so only a
    /// read sent after `t` will do; `None`: the refresh interval has passed.
    async fn refresh(&self, nil_at: Option<Instant>) -> Result<Arc<Routing>, PublishError> {
        let inner = &self.inner;
        let _one_at_a_time = inner.refresh_lock.lock().await;
        let cached = lock(&inner.cache).clone();
        let fresh_enough = match nil_at {
            None => cached.read_sent_at.elapsed() < inner.options.refresh_interval,
            Some(nil_at) => cached.read_sent_at > nil_at,
        };
        if fresh_enough {
            // Another task refreshed while this one waited for the lock.
            return self.within_lease(cached);
        }
        let read_sent_at = Instant::now();
        match self.read_routing(&cached.routing).await {
            Ok(routing) => {
                if routing.metadata_version != cached.routing.metadata_version {
                    tracing::debug!(
                        prefix = inner.keys.prefix(),
                        from_version = cached.routing.metadata_version,
                        to_version = routing.metadata_version,
                        shard_count = routing.shard_count,
                        "producer routing changed"
                    );
                }
                let fresh = Cached {
                    routing,
                    read_sent_at,
                };
                *lock(&inner.cache) = fresh.clone();
                self.within_lease(fresh)
            }
            Err(PublishError::Redis(error)) => {
                let age = cached.read_sent_at.elapsed();
                if age >= inner.options.routing_lease {
                    Err(self.lease_expired(age, Some(error)))
                } else if nil_at.is_some() {
                    // The shard routed to is gone: the cache cannot be used for this message.
                    Err(PublishError::Redis(error))
                } else {
                    tracing::warn!(
                        prefix = inner.keys.prefix(),
                        ?age,
                        lease = ?inner.options.routing_lease,
                        %error,
                        "producer routing refresh failed; publishing with the cached routing until its lease runs out"
                    );
                    Ok(cached.routing)
                }
            }
            // Definitive answers (no stream, corrupt or inconsistent metadata): fail closed.
            Err(error) => Err(error),
        }
    }

    /// `cached.routing` if its lease still runs.
    fn within_lease(&self, cached: Cached) -> Result<Arc<Routing>, PublishError> {
        let age = cached.read_sent_at.elapsed();
        if age >= self.inner.options.routing_lease {
            // The metadata read answered only after the lease had run out (Redis too slow).
            return Err(self.lease_expired(age, None));
        }
        Ok(cached.routing)
    }

    fn lease_expired(&self, age: Duration, source: Option<redis::RedisError>) -> PublishError {
        PublishError::RoutingLeaseExpired {
            prefix: self.inner.keys.prefix().to_owned(),
            age,
            lease: self.inner.options.routing_lease,
            source,
        }
    }

    /// One `HGET metadataVersion`; the whole metadata only when the version differs from
    /// `current`'s.
    async fn read_routing(&self, current: &Arc<Routing>) -> Result<Arc<Routing>, PublishError> {
        let keys = &self.inner.keys;
        let mut conn = self.inner.conn.clone();
        let version = read_metadata_version(&mut conn, keys)
            .await?
            .ok_or_else(|| unknown_stream(keys))?;
        if version == current.metadata_version {
            return Ok(Arc::clone(current));
        }
        let meta = load_stream_metadata(&mut conn, keys)
            .await?
            .ok_or_else(|| unknown_stream(keys))?;
        Ok(Arc::new(Routing::from_metadata(keys, &meta)?))
    }
}

fn unknown_stream(keys: &StreamKeys) -> PublishError {
    PublishError::UnknownStream {
        prefix: keys.prefix().to_owned(),
        key: keys.metadata(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ShardInfo;

    fn meta(shard_count: u32, shards: &[(u32, ShardState)]) -> StreamMetadata {
        StreamMetadata {
            stream_prefix: "orders".into(),
            shard_count,
            shards: shards
                .iter()
                .map(|&(shard_index, state)| ShardInfo { shard_index, state })
                .collect(),
            metadata_version: 7,
            groups: Vec::new(),
            migration: None,
            updated_at: "2026-11-29T00:00:00Z".into(),
            revision: 1,
        }
    }

    #[test]
    fn default_options_are_the_documented_ones() {
        let o = PublisherOptions::default();
        assert_eq!(o.max_payload_bytes, 1 << 20);
        assert_eq!(o.maxlen, None);
        assert_eq!(o.refresh_interval, Duration::from_secs(5));
        assert_eq!(o.routing_lease, Duration::from_secs(30));
        assert!(o.validate().is_ok());
    }

    #[test]
    fn options_that_cannot_work_are_refused() {
        let bad = [
            PublisherOptions {
                max_payload_bytes: 0,
                ..Default::default()
            },
            PublisherOptions {
                maxlen: Some(0),
                ..Default::default()
            },
            PublisherOptions {
                routing_lease: Duration::ZERO,
                refresh_interval: Duration::ZERO,
                ..Default::default()
            },
            PublisherOptions {
                refresh_interval: Duration::from_secs(30),
                ..Default::default()
            },
        ];
        for options in bad {
            let err = options.validate().unwrap_err();
            assert!(
                matches!(err, PublishError::InvalidOptions { .. }),
                "{options:?}"
            );
        }
    }

    #[test]
    fn routing_requires_active_shards_below_the_count() {
        let keys = StreamKeys::new("orders").unwrap();
        let ok = meta(
            2,
            &[
                (0, ShardState::Active),
                (1, ShardState::Active),
                (2, ShardState::Draining),
            ],
        );
        let routing = Routing::from_metadata(&keys, &ok).unwrap();
        assert_eq!(routing.shard_keys, ["{orders:0}", "{orders:1}"]);
        assert_eq!(routing.metadata_version, 7);

        let draining_below = meta(2, &[(0, ShardState::Active), (1, ShardState::Draining)]);
        let missing = meta(2, &[(0, ShardState::Active)]);
        let mut other_prefix = ok.clone();
        other_prefix.stream_prefix = "payments".into();
        for bad in [draining_below, missing, other_prefix] {
            let err = Routing::from_metadata(&keys, &bad).unwrap_err();
            assert!(
                matches!(err, PublishError::InconsistentMetadata { .. }),
                "{err}"
            );
        }
        let drained = meta(0, &[(0, ShardState::Retired)]);
        assert_eq!(
            Routing::from_metadata(&keys, &drained).unwrap().shard_count,
            0
        );
    }

    #[test]
    fn error_messages_say_what_to_do() {
        let too_large = PublishError::PayloadTooLarge {
            index: Some(3),
            size: 2_000_000,
            limit: 1_048_576,
        };
        let text = too_large.to_string();
        assert!(text.contains("message #3"), "{text}");
        assert!(text.contains("2000000 bytes"), "{text}");
        assert!(text.contains("1048576"), "{text}");
        let single = PublishError::PayloadTooLarge {
            index: None,
            size: 10,
            limit: 5,
        };
        assert!(single.to_string().starts_with("payload is 10 bytes"));
    }
}
