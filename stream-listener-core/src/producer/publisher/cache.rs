//! The leased routing cache (docs/design.md §9): the routing of one metadata version, its
//! refresh by `metadataVersion`, and the lease that bounds how long a stale one is used.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::Publisher;
use crate::keys::StreamKeys;
use crate::model::{ShardState, StreamMetadata};
use crate::producer::PublishError;
use crate::store::{load_stream_metadata, read_metadata_version};

/// The routing derived from one version of the stream metadata.
#[derive(Debug)]
pub(super) struct Routing {
    pub(super) metadata_version: u64,
    pub(super) shard_count: u32,
    /// `{<prefix>:<i>}` for `i` in `0..shard_count`.
    pub(super) shard_keys: Vec<String>,
}

impl Routing {
    /// Checks that the metadata is routable: the prefix matches and every shard in
    /// `0..shardCount` is ACTIVE.
    pub(super) fn from_metadata(
        keys: &StreamKeys,
        meta: &StreamMetadata,
    ) -> Result<Routing, PublishError> {
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
pub(super) struct Cached {
    pub(super) routing: Arc<Routing>,
    /// When the read that confirmed `routing` was sent: the lease starts then.
    pub(super) read_sent_at: Instant,
}
pub(super) fn lock(cache: &Mutex<Cached>) -> MutexGuard<'_, Cached> {
    // The cache is replaced whole under the lock: a panic elsewhere cannot leave it half-written.
    cache
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
pub(super) fn unknown_stream(keys: &StreamKeys) -> PublishError {
    PublishError::UnknownStream {
        prefix: keys.prefix().to_owned(),
        key: keys.metadata(),
    }
}

impl Publisher {
    /// The routing to publish with now: the cache, checked once the refresh interval has passed.
    pub(super) async fn routing(&self) -> Result<Arc<Routing>, PublishError> {
        let cached = lock(&self.inner.cache).clone();
        // refresh_interval < routing_lease: a cache this fresh is within its lease.
        if cached.read_sent_at.elapsed() < self.inner.options.refresh_interval {
            return Ok(cached.routing);
        }
        self.refresh(None).await
    }

    /// Refreshes the routing. `nil_at: Some(t)`: an `XADD` found no stream at `t`, so only a
    /// read sent after `t` will do; `None`: the refresh interval has passed.
    pub(super) async fn refresh(
        &self,
        nil_at: Option<Instant>,
    ) -> Result<Arc<Routing>, PublishError> {
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
        // After an `XADD` found no stream, the whole metadata: a stream created again at the
        // version cached (docs/design.md §12.1) may route over another shard count.
        let whole = nil_at.is_some();
        match self.read_routing(&cached.routing, whole).await {
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
    pub(super) fn within_lease(&self, cached: Cached) -> Result<Arc<Routing>, PublishError> {
        let age = cached.read_sent_at.elapsed();
        if age >= self.inner.options.routing_lease {
            // The metadata read answered only after the lease had run out (Redis too slow).
            return Err(self.lease_expired(age, None));
        }
        Ok(cached.routing)
    }

    pub(super) fn lease_expired(
        &self,
        age: Duration,
        source: Option<redis::RedisError>,
    ) -> PublishError {
        PublishError::RoutingLeaseExpired {
            prefix: self.inner.keys.prefix().to_owned(),
            age,
            lease: self.inner.options.routing_lease,
            source,
        }
    }

    /// `HGET metadataVersion` and `HGET schema` in one round trip; the whole metadata only when
    /// the version differs from `current`'s, or always with `whole`.
    pub(super) async fn read_routing(
        &self,
        current: &Arc<Routing>,
        whole: bool,
    ) -> Result<Arc<Routing>, PublishError> {
        let keys = &self.inner.keys;
        let mut conn = self.inner.conn.clone();
        if !whole {
            let version = read_metadata_version(&mut conn, keys)
                .await?
                .ok_or_else(|| unknown_stream(keys))?;
            if version == current.metadata_version {
                return Ok(Arc::clone(current));
            }
        }
        let meta = load_stream_metadata(&mut conn, keys)
            .await?
            .ok_or_else(|| unknown_stream(keys))?;
        Ok(Arc::new(Routing::from_metadata(keys, &meta)?))
    }
}
