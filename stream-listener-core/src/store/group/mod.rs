//! Group metadata in Redis and the heartbeat transaction (docs/design.md §2, §5).
//!
//! `sl:{<prefix>:<group>}:group` is a hash: `schema`, `revision`, `leaseRevision`, `meta` (the
//! group-level JSON), one `member:<id>` JSON per member, and the fast-path fields `steady`
//! (`<metadataVersion>|<next deadline µs>|<groupEpoch>|<assignmentEpoch>`, absent in a
//! correction round and while a new target is due),
//! `fast:<id>` (`<fingerprint>\n<response JSON>`), `fastseq:<id>` and `fastworkers:<id>` (the
//! `activeConsumerWorkers` of the request at `fastseq`). Leases live in the sorted
//! set `:leases` (member id → expiry µs); the capped `:history` list keeps retired members.
//!
//! A full heartbeat loads everything and Redis `TIME` with one script, runs the pure
//! [`crate::coordinator::heartbeat`], and writes only the changed fields with a compare-and-set
//! script that checks `revision` and the `fastseq:<id>` of each member it writes; conflicts
//! retry with jitter, then `RETRY`.
//! Full heartbeats are queued in the hash and applied in batches by whichever requester holds
//! the combiner lease (`combining`); a requester runs its own only for what a batch leaves.
//! A steady-state heartbeat is one script that answers exactly what the full transition would
//! and only moves the lease and `fastseq` (so a concurrent full transition that writes the
//! member notices).

mod combining;
mod decode;
mod decoded;
mod fast_path;
mod writes;

use decode::{Decoded, decode_group, decode_leases, hash_text};
use writes::Writes;

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use redis::AsyncCommands;

use super::stream::{SCHEMA_VERSION, check_schema, load_stream_metadata, parse_u64, wrong_type};
use super::{StoreError, scripts};
use crate::connection::RedisConnection;
use crate::coordinator::{self, Context, CoordinatorConfig, Group, StreamView, Transition};
use crate::fence::FenceToken;
use crate::keys::{GroupKeys, StreamKeys};
use crate::model::{
    HeartbeatRequest, HeartbeatResponse, HeartbeatStatus, MemberMetadata, Micros, ShardIndex,
};

/// `TIME` seconds and µs, the group hash (field, value), the leases (member, score), as bytes:
/// text that is not UTF-8 is named by `decode` (docs/design.md §5.6).
type LoadReply = (u64, u64, Vec<(Vec<u8>, Vec<u8>)>, Vec<(Vec<u8>, f64)>);

/// Full transitions attempted before answering `RETRY`.
const MAX_ATTEMPTS: u32 = 8;

// The group hash's fields (docs/design.md §3.2), shared by the submodules.
const META: &str = "meta";
const MEMBER: &str = "member:";
const FAST: &str = "fast:";
const FAST_SEQ: &str = "fastseq:";
const FAST_WORKERS: &str = "fastworkers:";
const STEADY: &str = "steady";

/// The answer to one heartbeat, with how it was reached (for metrics and benchmarks).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeartbeatOutcome {
    /// The response for the member.
    pub response: HeartbeatResponse,
    /// Answered by the steady-state fast path (one script).
    pub fast_path: bool,
    /// Compare-and-set attempts of the requester's own full transition (0 on the fast path, 1
    /// when a combined batch answered it, docs/design.md §5.7).
    pub attempts: u32,
}

/// A group as loaded, with what the compare-and-set needs to detect concurrent changes.
#[derive(Debug, Clone)]
pub struct LoadedGroup {
    /// The coordinator state (history not loaded: empty).
    pub group: Group,
    /// Redis `TIME` of the load, µs.
    pub now: Micros,
    revision: u64,
    fields: HashMap<String, String>,
    leases: HashMap<String, Micros>,
}

/// The Redis-recorded coordinator of one consumer group.
#[derive(Debug, Clone)]
pub struct GroupStore {
    conn: RedisConnection,
    stream_keys: StreamKeys,
    keys: GroupKeys,
    config: CoordinatorConfig,
    stream_view: Option<StreamView>,
    /// What the last load decoded, shared by clones (docs/design.md §5.1).
    decoded: Decoded,
}

impl GroupStore {
    /// A store for group `keys` of stream `stream_keys`, with the protocol timings `config`.
    pub fn new(
        conn: RedisConnection,
        stream_keys: StreamKeys,
        keys: GroupKeys,
        config: CoordinatorConfig,
    ) -> Self {
        GroupStore {
            conn,
            stream_keys,
            keys,
            config,
            stream_view: None,
            decoded: Decoded::default(),
        }
    }

    /// The group's keys.
    pub fn keys(&self) -> &GroupKeys {
        &self.keys
    }

    /// Creates the group metadata if it does not exist, at Redis `TIME` (its `incarnation`).
    /// With `after_loss`, no shard is handed out until one lease TTL later, because members of
    /// the lost incarnation may still be reading (docs/design.md §5). Returns whether it was
    /// created.
    ///
    /// # Errors
    /// [`StoreError::Redis`] when Redis fails; [`StoreError::MissingStream`] without stream metadata.
    pub async fn provision(&mut self, after_loss: bool) -> Result<bool, StoreError> {
        let stream = self.read_stream_view(None).await?;
        let now = self.redis_time().await?;
        let mut group = Group::new(self.keys.prefix(), self.keys.group(), &stream, now);
        if after_loss {
            group.meta.hand_out_not_before = Some(now + duration_us(self.config.member_lease_ttl));
        }
        let meta = serde_json::to_string(&group.meta)
            .map_err(|e| StoreError::corrupt(&self.keys.metadata(), META, e))?;
        let written: i64 = scripts::group_create()
            .key(self.keys.metadata())
            .arg(SCHEMA_VERSION)
            .arg(meta)
            .invoke_async(&mut self.conn)
            .await?;
        Ok(written == 1)
    }

    /// Loads the group and Redis `TIME` in one script.
    ///
    /// # Errors
    /// [`StoreError::MissingGroup`] when the hash does not exist; [`StoreError::UnknownSchema`],
    /// [`StoreError::CorruptMetadata`], [`StoreError::Malformed`] when it cannot be read (fail
    /// closed: a counter at or above [`crate::model::COUNTER_LIMIT`], a lease later than any
    /// TTL allows, and a field name, lease member, `meta` or `member:<id>` that is not UTF-8
    /// included); [`StoreError::WrongType`] when the group hash or `:leases` holds
    /// another Redis type; [`StoreError::Redis`].
    pub async fn load(&mut self) -> Result<LoadedGroup, StoreError> {
        let reply: redis::RedisResult<LoadReply> = scripts::group_load()
            .key(self.keys.metadata())
            .key(self.keys.leases())
            .invoke_async(&mut self.conn)
            .await;
        let (secs, micros, fields, leases) = match reply {
            Ok(reply) => reply,
            Err(e) => return Err(self.wrong_type(e).await),
        };
        let now = secs * 1_000_000 + micros;
        let key = self.keys.metadata();
        let fields = hash_text(&key, fields)?;
        if fields.is_empty() {
            return Err(StoreError::MissingGroup {
                prefix: self.keys.prefix().to_owned(),
                group: self.keys.group().to_owned(),
                key,
            });
        }
        check_schema(&key, fields.get("schema"))?;
        let revision = parse_u64(&key, "revision", fields.get("revision"))?;
        // The fast path still bumps `leaseRevision` for processes of the version before, whose
        // compare-and-set checks it during a rolling upgrade; this one guards the members it
        // writes instead (`Writes::guards`). A corrupt value is still named here.
        if let Some(v) = fields.get("leaseRevision") {
            parse_u64(&key, "leaseRevision", Some(v))?;
        }
        let leases = decode_leases(&self.keys.leases(), leases, now)?;
        let group = decode_group(&key, &fields, &leases, &self.config, now, &self.decoded)?;
        Ok(LoadedGroup {
            group,
            now,
            revision,
            fields,
            leases,
        })
    }

    /// Runs one heartbeat: the fast path when it applies; else the full transition, queued for
    /// the group's combiner and applied in a batch (docs/design.md §5.7), or, for what a batch
    /// does not answer, run by this requester under compare-and-set, retried with jitter up to
    /// a bound and then answered `RETRY`.
    ///
    /// # Errors
    /// [`StoreError::Coordinator`] for a malformed or stale request; [`StoreError::MissingStream`],
    /// [`StoreError::MissingGroup`], corrupt metadata (fail closed, naming key and field: a
    /// malformed fast-path field falls back to the full transition, which rewrites it or names
    /// it), [`StoreError::WrongType`]; [`StoreError::Redis`].
    pub async fn heartbeat(
        &mut self,
        request: &HeartbeatRequest,
    ) -> Result<HeartbeatOutcome, StoreError> {
        let stream_version = self.read_stream_version().await?;
        if let Some(response) = self.fast_path(request, stream_version).await? {
            return Ok(HeartbeatOutcome {
                response,
                fast_path: true,
                attempts: 0,
            });
        }
        let mut stream = self.read_stream_view(Some(stream_version)).await?;
        if let combining::Combined::Answered(response) = self.combined(request, &mut stream).await?
        {
            return Ok(HeartbeatOutcome {
                response,
                fast_path: false,
                attempts: 1,
            });
        }
        self.own_transition(request, stream).await
    }

    /// The full transition run by the requester itself, under compare-and-set, retried with
    /// jitter up to a bound and then answered `RETRY`: for what a combined batch does not
    /// answer (docs/design.md §5.7).
    async fn own_transition(
        &mut self,
        request: &HeartbeatRequest,
        mut stream: StreamView,
    ) -> Result<HeartbeatOutcome, StoreError> {
        for attempt in 1..=MAX_ATTEMPTS {
            let loaded = self.load().await?;
            if loaded.group.meta.metadata_version > stream.metadata_version {
                // Another transition applied a newer stream view after this one was read (a
                // scale-out in between): applying ours would take the group's metadataVersion
                // and readable set back. Read it again, after the load: a version still lower
                // than the group's is a stream metadata re-created from config (a restart, not
                // staleness), which the group must follow (docs/design.md §5.4).
                stream = self.read_stream_view(None).await?;
            }
            let (group, response) = self.transition(&loaded, request, &stream).await?;
            let writes = Writes::diff(&loaded, &group, &self.config)?;
            if writes.is_empty() || self.compare_and_set(&loaded, &writes).await? {
                return Ok(HeartbeatOutcome {
                    response,
                    fast_path: false,
                    attempts: attempt,
                });
            }
            tracing::debug!(
                stream = %self.keys.prefix(),
                group = %self.keys.group(),
                member = %request.member_id,
                attempt,
                "group metadata changed concurrently; reloading"
            );
            tokio::time::sleep(jitter(attempt)).await;
        }
        let loaded = self.load().await?;
        Ok(HeartbeatOutcome {
            response: retry_response(&loaded.group, &self.config),
            fast_path: false,
            attempts: MAX_ATTEMPTS,
        })
    }

    async fn transition(
        &mut self,
        loaded: &LoadedGroup,
        request: &HeartbeatRequest,
        stream: &StreamView,
    ) -> Result<(Group, HeartbeatResponse), StoreError> {
        let mut group = loaded.group.clone();
        let ctx = Context {
            now: loaded.now,
            stream,
        };
        match coordinator::heartbeat(&mut group, request, &ctx, &self.config)? {
            Transition::Done(response) => Ok((group, response)),
            Transition::NeedsFences => {
                let fences = self
                    .read_fences(&stream.readable.iter().copied().collect::<Vec<_>>())
                    .await?;
                let mut group = loaded.group.clone();
                let response = coordinator::heartbeat_with_fences(
                    &mut group,
                    request,
                    &ctx,
                    &fences,
                    &self.config,
                )?;
                Ok((group, response))
            }
        }
    }

    /// This group's fence of each shard (docs/design.md §8), for a correction round. One `HGET` per
    /// shard, all sent at once as commands of their own: the fences of different shards live in
    /// different slots on a cluster, where one pipeline across them is refused (`CrossSlot`), and
    /// a multiplexed connection sends concurrent commands together anyway.
    async fn read_fences(
        &mut self,
        shards: &[ShardIndex],
    ) -> Result<BTreeMap<ShardIndex, FenceToken>, StoreError> {
        let reads = shards.iter().map(|shard| {
            let mut conn = self.conn.clone();
            let fence = self.stream_keys.fence(*shard);
            let group = self.keys.group().to_owned();
            async move {
                redis::cmd("HGET")
                    .arg(fence)
                    .arg(group)
                    .query_async::<Option<String>>(&mut conn)
                    .await
            }
        });
        let values: Vec<Option<String>> = match futures_util::future::try_join_all(reads).await {
            Ok(values) => values,
            Err(e) => {
                let fences: Vec<String> =
                    shards.iter().map(|s| self.stream_keys.fence(*s)).collect();
                let keys: Vec<(&str, &str, &'static str)> = fences
                    .iter()
                    .map(|k| (k.as_str(), "hash", "hash"))
                    .collect();
                return Err(wrong_type(&mut self.conn, e, &keys).await);
            }
        };
        Ok(shards
            .iter()
            .zip(values)
            .filter_map(|(shard, value)| Some((*shard, FenceToken::decode(&value?)?)))
            .collect())
    }

    /// The stream's `shardCount` in the last stream metadata this store read, if it read any:
    /// what a member provisions again after a loss when the stream was scaled past its
    /// configured count (docs/design.md §5.5).
    pub(crate) fn last_seen_shard_count(&self) -> Option<u32> {
        self.stream_view.as_ref().map(|view| view.shard_count)
    }

    async fn read_stream_version(&mut self) -> Result<u64, StoreError> {
        super::read_metadata_version(&mut self.conn, &self.stream_keys)
            .await?
            .ok_or_else(|| self.missing_stream())
    }

    /// The stream view at `version`, from the cache when it has that version.
    async fn read_stream_view(&mut self, version: Option<u64>) -> Result<StreamView, StoreError> {
        if let (Some(view), Some(version)) = (&self.stream_view, version)
            && view.metadata_version == version
        {
            return Ok(view.clone());
        }
        let meta = load_stream_metadata(&mut self.conn, &self.stream_keys)
            .await?
            .ok_or_else(|| self.missing_stream())?;
        let view = StreamView::from(&meta);
        self.stream_view = Some(view.clone());
        Ok(view)
    }

    fn missing_stream(&self) -> StoreError {
        StoreError::MissingStream {
            prefix: self.stream_keys.prefix().to_owned(),
            key: self.stream_keys.metadata(),
        }
    }

    /// `error`, or [`StoreError::WrongType`] naming the group key that holds another type.
    async fn wrong_type(&mut self, error: redis::RedisError) -> StoreError {
        let (group, leases, history) = (
            self.keys.metadata(),
            self.keys.leases(),
            self.keys.history(),
        );
        let keys = [
            (group.as_str(), "hash", "hash"),
            (leases.as_str(), "zset", "sorted set"),
            (history.as_str(), "list", "list"),
        ];
        wrong_type(&mut self.conn, error, &keys).await
    }

    /// The compare-and-set refused to write because a key has another type: which one.
    async fn wrong_type_now(&mut self) -> StoreError {
        let error = redis::make_extension_error(
            "WRONGTYPE".to_owned(),
            Some("a group key holds another type".to_owned()),
        );
        self.wrong_type(error).await
    }

    async fn redis_time(&mut self) -> Result<Micros, StoreError> {
        let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut self.conn).await?;
        Ok(secs * 1_000_000 + micros)
    }

    /// The group's history, newest first (EXPIRED / FENCED / LEFT members).
    ///
    /// # Errors
    /// [`StoreError::Redis`]; [`StoreError::CorruptMetadata`] for an entry that is not JSON;
    /// [`StoreError::WrongType`] when `:history` is not a list.
    pub async fn history(&mut self) -> Result<Vec<MemberMetadata>, StoreError> {
        let entries: Vec<String> = match self.conn.lrange(self.keys.history(), 0, -1).await {
            Ok(entries) => entries,
            Err(e) => return Err(self.wrong_type(e).await),
        };
        entries
            .iter()
            .map(|e| {
                serde_json::from_str(e)
                    .map_err(|err| StoreError::corrupt(&self.keys.history(), "entry", err))
            })
            .collect()
    }
}

fn duration_us(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// Backoff before attempt `attempt + 1`: random in `[0, min(2^attempt, 64)]` ms.
fn jitter(attempt: u32) -> Duration {
    let cap = 1u64 << attempt.min(6);
    Duration::from_micros(rand::random_range(0..=cap * 1000))
}

fn retry_response(group: &Group, config: &CoordinatorConfig) -> HeartbeatResponse {
    HeartbeatResponse {
        status: HeartbeatStatus::Retry,
        ..coordinator::base_response(group, config)
    }
}
