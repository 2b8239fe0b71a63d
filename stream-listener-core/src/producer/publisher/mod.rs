//! The [`Publisher`]: routed `XADD`s with a leased routing cache (docs/design.md §9).

mod cache;
mod coalesce;
mod options;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::future::try_join_all;
use redis::{Cmd, Pipeline};
use serde::Serialize;

use super::PublishError;
use super::routing::shard_for_key;
use crate::connection::RedisConnection;
use crate::headers::Headers;
use crate::keys::StreamKeys;
use crate::store::load_stream_metadata;
use crate::trace_context::{self, TRACEPARENT};
use cache::{Cached, Routing, lock, unknown_stream};
use coalesce::Coalescer;

pub use options::{
    DEFAULT_MAX_PAYLOAD_BYTES, DEFAULT_REFRESH_INTERVAL, DEFAULT_ROUTING_LEASE, PublisherOptions,
};

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

struct Inner {
    conn: RedisConnection,
    keys: StreamKeys,
    options: PublisherOptions,
    cache: Mutex<Cached>,
    /// One refresh at a time; publishes that wait for it use its result.
    refresh_lock: tokio::sync::Mutex<()>,
    /// Sends single publishes, coalescing those that arrive while one is in flight.
    coalescer: Arc<Coalescer>,
}

/// Publishes messages to one sharded stream (docs/design.md §9).
///
/// Each message goes to shard [`super::shard_for_key`]`(partition_key, shardCount)` as
/// `XADD {<prefix>:<shard>} NOMKSTREAM [MAXLEN ~ n] * key <partition_key> payload <json>`.
/// Messages with the same key go to the same shard while the shard count is unchanged, so they
/// are consumed in publish order.
///
/// Routing is cached by `metadataVersion`: after [`PublisherOptions::refresh_interval`] the next
/// publish sends `HGET metadataVersion` (with `HGET schema`, one round trip) and loads the whole
/// metadata only when the version changed.
/// When `NOMKSTREAM` finds no stream (the shard was retired and deleted), the publisher refreshes
/// at once and retries once. If refreshing fails, the cache is used until
/// [`PublishError::RoutingLeaseExpired`] after [`PublisherOptions::routing_lease`].
///
/// Cheap to clone: clones share the connection and the routing cache, and may publish
/// concurrently from several tasks. Single publishes ([`Self::publish`] and its variants) that
/// arrive while one is in flight are coalesced: they queue and go out together as the next
/// pipeline (one per shard on a cluster), with no added delay when the publisher is idle
/// (docs/design.md §9). Each caller still gets its own [`Published`] or [`PublishError`]. The
/// pipelines are sent by a task spawned on the caller's Tokio runtime.
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
            .await
            .map_err(|e| match e {
                crate::store::StoreError::Redis(error) => PublishError::from_redis(
                    error,
                    "HGETALL",
                    &keys.metadata(),
                    &crate::acl::producer_key_patterns(keys.prefix())[1],
                ),
                other => other.into(),
            })?
            .ok_or_else(|| unknown_stream(&keys))?;
        let routing = Arc::new(Routing::from_metadata(&keys, &meta)?);
        let coalescer = Coalescer::new(conn.clone(), options.replica_wait());
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
                coalescer,
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
    /// The `XADD` is sent at once when no other publish of this publisher (or its clones) is in
    /// flight, else in the next pipeline with those that arrived meanwhile (docs/design.md §9);
    /// a caller's entries are appended in call order. Dropping the future before its `XADD` is
    /// sent leaves the entry out; once sent, it is appended whether or not the future is still
    /// awaited. With the `opentelemetry` feature, the current span's trace context is added as
    /// headers (as [`Self::publish_with_headers`] does).
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
        self.publish_with_headers(partition_key, payload, &Headers::new())
            .await
    }

    /// [`Self::publish`] with `headers`: appends
    /// `key <partition_key> payload <json> h:<name> <value> ...`, one field per header in the
    /// given order (docs/design.md §13.4). With the `opentelemetry` feature, when a `tracing`
    /// span with an OpenTelemetry context is current, its W3C `traceparent` (and `tracestate`
    /// when not empty) follow as headers, unless `headers` has a `traceparent` already. The
    /// size checked against `max_payload_bytes` is the JSON plus the header fields' names and
    /// values.
    ///
    /// # Errors
    /// [`PublishError::InvalidHeaderName`] for an empty header name or one with a control
    /// character (nothing sent); otherwise as [`Self::publish`].
    pub async fn publish_with_headers<T: Serialize + ?Sized>(
        &self,
        partition_key: &str,
        payload: &T,
        headers: &Headers,
    ) -> Result<Published, PublishError> {
        check_header_names(headers, None)?;
        let json = serde_json::to_vec(payload).map_err(|source| PublishError::Serialize {
            index: None,
            source,
        })?;
        let message = Encoded::new(json, headers, &trace_headers(headers));
        self.check_size(message.size(), None)?;
        self.append_one(partition_key, &message.fields()).await
    }

    /// Appends `key <partition_key>` followed by `fields` (name, bytes) as given, for payloads
    /// that are not JSON. Same routing, retry and errors as [`Self::publish`]; the size checked
    /// against `max_payload_bytes` is the sum of field name and value lengths. Fields named
    /// `h:<name>` reach handlers as header `<name>` (a dead-letter replay republishes headers
    /// this way); no trace context is added: the fields are written exactly as given.
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
    /// met a retired shard are re-routed after one refresh and sent once more. With the
    /// `opentelemetry` feature every entry carries the current span's trace context.
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
        let none = Headers::new();
        let trace = trace_headers(&none);
        let mut encoded = Vec::with_capacity(messages.len());
        for (index, (_, payload)) in messages.iter().enumerate() {
            encoded.push(self.encode(index, payload, &none, &trace)?);
        }
        self.append_batch(|i| messages[i].0.as_ref(), &encoded)
            .await
    }

    /// [`Self::publish_batch`] of (partition key, payload, headers): each entry as
    /// [`Self::publish_with_headers`] writes it, pipelined the same way; the current span's trace
    /// context (feature `opentelemetry`) goes into every entry whose headers have no
    /// `traceparent`.
    ///
    /// # Errors
    /// [`PublishError::InvalidHeaderName`] with the batch position (nothing sent); otherwise as
    /// [`Self::publish_batch`].
    pub async fn publish_batch_with_headers<K: AsRef<str>, T: Serialize>(
        &self,
        messages: &[(K, T, Headers)],
    ) -> Result<Vec<Published>, PublishError> {
        let trace = trace_headers(&Headers::new());
        let none = Headers::new();
        let mut encoded = Vec::with_capacity(messages.len());
        for (index, (_, payload, headers)) in messages.iter().enumerate() {
            check_header_names(headers, Some(index))?;
            let trace = if headers.contains(TRACEPARENT) {
                &none
            } else {
                &trace
            };
            encoded.push(self.encode(index, payload, headers, trace)?);
        }
        self.append_batch(|i| messages[i].0.as_ref(), &encoded)
            .await
    }

    /// Message `index` of a batch serialized and size-checked.
    fn encode<T: Serialize>(
        &self,
        index: usize,
        payload: &T,
        headers: &Headers,
        trace: &Headers,
    ) -> Result<Encoded, PublishError> {
        let json = serde_json::to_vec(payload).map_err(|source| PublishError::Serialize {
            index: Some(index),
            source,
        })?;
        let message = Encoded::new(json, headers, trace);
        self.check_size(message.size(), Some(index))?;
        Ok(message)
    }

    /// Appends the encoded `messages` (partition key of message `i`: `key(i)`), pipelined as
    /// [`Self::publish_batch`] says.
    async fn append_batch<'a>(
        &self,
        key: impl Fn(usize) -> &'a str,
        messages: &[Encoded],
    ) -> Result<Vec<Published>, PublishError> {
        if messages.is_empty() {
            return Ok(Vec::new());
        }
        let mut routing = self.routing().await?;
        let mut published: Vec<Option<Published>> = vec![None; messages.len()];
        let mut pending: Vec<usize> = (0..messages.len()).collect();
        let mut retried = false;
        let mut least_acked: Option<u32> = None;
        loop {
            let shards = pending
                .iter()
                .map(|&i| self.route(&routing, key(i)))
                .collect::<Result<Vec<_>, _>>()?;
            let (ids, acked) = self
                .send(&routing, &pending, &shards, |i, shard_key| {
                    self.xadd(shard_key, key(i), &messages[i].fields())
                })
                .await?;
            least_acked = match (least_acked, acked) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
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
        self.replicated(published.into_iter().flatten().collect(), least_acked)
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
        // Sized up front: growing the buffers argument by argument reallocates them several
        // times per entry (malloc and realloc were prominent in a profile of the producer bench).
        let field_bytes: usize = fields.iter().map(|(n, v)| n.len() + v.len()).sum();
        let mut cmd = Cmd::with_capacity(
            9 + 2 * fields.len(),
            48 + shard_key.len() + partition_key.len() + field_bytes,
        );
        cmd.arg("XADD").arg(shard_key).arg("NOMKSTREAM");
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
            let xadd = self.xadd(stream_key, partition_key, fields);
            let (id, acked) = self
                .inner
                .coalescer
                .send(shard, xadd)
                .await
                .map_err(|error| self.refused(error, stream_key))?;
            match id {
                Some(entry_id) => {
                    let published = Published {
                        stream_key: stream_key.clone(),
                        entry_id,
                        shard,
                    };
                    return self
                        .replicated(vec![published], acked)
                        .map(|mut p| p.remove(0));
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
    ) -> Result<(Vec<Option<String>>, Option<u32>), PublishError> {
        let conn = &self.inner.conn;
        let wait = self.inner.options.replica_wait();
        if !conn.is_cluster() {
            let mut pipe = Pipeline::with_capacity(pending.len() + 1);
            for (&i, &shard) in pending.iter().zip(shards) {
                pipe.add_command(xadd(i, &routing.shard_keys[shard as usize]));
            }
            let mut conn = conn.clone();
            return query_waiting(pipe, wait, &mut conn)
                .await
                .map_err(|e| self.refused(e, &self.keys_of(routing, shards)));
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
        // A WAIT in a shard's pipeline runs on that shard's node: redis-rs routes a cluster
        // pipeline by its first keyed command (the XADD), and WAIT has no key.
        let replies = try_join_all(by_shard.into_iter().map(|(shard, (pipe, positions))| {
            let mut conn = conn.clone();
            async move {
                let (ids, acked) = query_waiting(pipe, wait, &mut conn)
                    .await
                    .map_err(|e| self.refused(e, &routing.shard_keys[shard as usize]))?;
                Ok::<_, PublishError>((positions, ids, acked))
            }
        }))
        .await?;
        let mut ids = vec![None; pending.len()];
        let mut least: Option<u32> = None;
        for (positions, shard_ids, acked) in replies {
            for (position, id) in positions.into_iter().zip(shard_ids) {
                ids[position] = id;
            }
            least = match (least, acked) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        Ok((ids, least))
    }

    /// A failed `XADD` (and `WAIT`) on `key`: [`PublishError::NoPermission`] when the ACL
    /// refused it, else [`PublishError::Redis`].
    fn refused(&self, error: redis::RedisError, key: &str) -> PublishError {
        let pattern = &crate::acl::producer_key_patterns(self.inner.keys.prefix())[0];
        PublishError::from_redis(error, "XADD", key, pattern)
    }

    /// The distinct shard stream keys of `shards`, comma-separated, for an error.
    fn keys_of(&self, routing: &Routing, shards: &[u32]) -> String {
        let distinct: std::collections::BTreeSet<u32> = shards.iter().copied().collect();
        distinct
            .into_iter()
            .map(|s| routing.shard_keys[s as usize].as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// `published` when no `WAIT` was sent (`acked` is `None`) or enough replicas acknowledged;
    /// else [`PublishError::NotReplicated`] carrying them.
    fn replicated(
        &self,
        published: Vec<Published>,
        acked: Option<u32>,
    ) -> Result<Vec<Published>, PublishError> {
        match (self.inner.options.replica_wait(), acked) {
            (Some(wait), Some(acked)) if wait.short(acked) => Err(PublishError::NotReplicated {
                published,
                acked,
                wanted: wait.replicas,
                timeout: wait.timeout,
            }),
            _ => Ok(published),
        }
    }
}

/// Sends the `XADD`s of `pipe`, followed by `WAIT` when `wait` is set; returns their ids
/// (`None`: no stream) and the replicas `WAIT` counted.
async fn query_waiting(
    mut pipe: Pipeline,
    wait: Option<crate::replication::ReplicaWait>,
    conn: &mut RedisConnection,
) -> redis::RedisResult<(Vec<Option<String>>, Option<u32>)> {
    let Some(wait) = wait else {
        return Ok((pipe.query_async(conn).await?, None));
    };
    pipe.add_command(wait.cmd());
    let mut replies: Vec<redis::Value> = pipe.query_async(conn).await?;
    let acked = replies
        .pop()
        .as_ref()
        .and_then(crate::replication::ReplicaWait::acked);
    let ids = replies
        .into_iter()
        .map(redis::from_redis_value::<Option<String>>)
        .collect::<Result<Vec<_>, _>>()?;
    Ok((ids, Some(acked.unwrap_or(0))))
}

/// One message's fields after `key`: `payload <json>`, then each header as `h:<name> <value>`
/// (docs/design.md §13.4).
struct Encoded {
    json: Vec<u8>,
    headers: Vec<(String, Vec<u8>)>,
}

impl Encoded {
    /// `json` with the fields of `headers`, then those of `trace` (the trace context).
    fn new(json: Vec<u8>, headers: &Headers, trace: &Headers) -> Self {
        let headers = headers
            .to_fields()
            .chain(trace.to_fields())
            .map(|(name, value)| (name, value.to_vec()))
            .collect();
        Encoded { json, headers }
    }

    /// The size checked against `max_payload_bytes`: the JSON, header field names and values.
    fn size(&self) -> usize {
        let headers: usize = self.headers.iter().map(|(n, v)| n.len() + v.len()).sum();
        self.json.len() + headers
    }

    /// The `XADD` fields after `key`.
    fn fields(&self) -> Vec<(&str, &[u8])> {
        let mut fields = Vec::with_capacity(1 + self.headers.len());
        fields.push(("payload", self.json.as_slice()));
        fields.extend(self.headers.iter().map(|(n, v)| (n.as_str(), v.as_slice())));
        fields
    }
}

/// The current span's trace context as headers, unless `headers` carry a `traceparent` of the
/// caller's; empty without the `opentelemetry` feature.
fn trace_headers(headers: &Headers) -> Headers {
    let mut trace = Headers::new();
    if !headers.contains(TRACEPARENT) {
        trace_context::inject_current(&mut trace);
    }
    trace
}

/// Refuses a header name other producers and tools could not carry (docs/design.md §13.4).
fn check_header_names(headers: &Headers, index: Option<usize>) -> Result<(), PublishError> {
    match headers.invalid_name() {
        Some((name, problem)) => Err(PublishError::InvalidHeaderName {
            index,
            name: name.to_owned(),
            problem,
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests;
