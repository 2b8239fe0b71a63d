//! Group metadata in Redis and the heartbeat transaction (docs/design.md §2, §5).
//!
//! `sl:{<prefix>:<group>}:group` is a hash: `schema`, `revision`, `leaseRevision`, `meta` (the
//! group-level JSON), one `member:<id>` JSON per member, and the fast-path fields `steady`
//! (`<metadataVersion>|<next deadline µs>`, present only while the group is STABLE),
//! `fast:<id>` (`<fingerprint>\n<response JSON>`), `fastseq:<id>` and `fastworkers:<id>` (the
//! `activeConsumerWorkers` of the request at `fastseq`). Leases live in the sorted
//! set `:leases` (member id → expiry µs); the capped `:history` list keeps retired members.
//!
//! A full heartbeat loads everything and Redis `TIME` with one script, runs the pure
//! [`crate::coordinator::heartbeat`], and writes only the changed fields with a compare-and-set
//! script that checks `revision` and `leaseRevision`; conflicts retry with jitter, then `RETRY`.
//! A steady-state heartbeat is one script that answers exactly what the full transition would
//! and only moves the lease (bumping `leaseRevision`, so a concurrent full transition notices).

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use redis::AsyncCommands;

use super::stream::{
    SCHEMA_VERSION, check_counter, check_schema, load_stream_metadata, parse_u64, wrong_type,
};
use super::{StoreError, scripts};
use crate::connection::RedisConnection;
use crate::coordinator::{
    self, Context, CoordinatorConfig, CoordinatorError, Group, MAX_TIMING, StreamView, Transition,
};
use crate::fence::FenceToken;
use crate::keys::{GroupKeys, StreamKeys};
use crate::model::{
    GroupMetadata, HeartbeatRequest, HeartbeatResponse, HeartbeatStatus, MemberMetadata, Micros,
    ShardIndex,
};

/// `TIME` seconds and µs, the group hash, the leases (member, score).
type LoadReply = (u64, u64, HashMap<String, String>, Vec<(String, f64)>);

/// Full transitions attempted before answering `RETRY`.
const MAX_ATTEMPTS: u32 = 8;

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
    /// Compare-and-set attempts of the full transition (0 on the fast path).
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
    lease_revision: u64,
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
    /// closed: a counter at or above [`crate::model::COUNTER_LIMIT`] and a lease later than any
    /// TTL allows included); [`StoreError::WrongType`] when the group hash or `:leases` holds
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
        if fields.is_empty() {
            return Err(StoreError::MissingGroup {
                prefix: self.keys.prefix().to_owned(),
                group: self.keys.group().to_owned(),
                key,
            });
        }
        check_schema(&key, fields.get("schema"))?;
        let revision = parse_u64(&key, "revision", fields.get("revision"))?;
        let lease_revision = match fields.get("leaseRevision") {
            Some(v) => parse_u64(&key, "leaseRevision", Some(v))?,
            None => 0,
        };
        let leases = decode_leases(&self.keys.leases(), leases, now)?;
        let group = decode_group(&key, &fields, &leases, &self.config, now)?;
        Ok(LoadedGroup {
            group,
            now,
            revision,
            lease_revision,
            fields,
            leases,
        })
    }

    /// Runs one heartbeat: the fast path when it applies, else the full transition under
    /// compare-and-set, retried with jitter up to a bound and then answered `RETRY`.
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

    /// The steady-state fast path (docs/design.md §5); `None` when the full transition must run.
    async fn fast_path(
        &mut self,
        request: &HeartbeatRequest,
        stream_version: u64,
    ) -> Result<Option<HeartbeatResponse>, StoreError> {
        let Some(print) = coordinator::request_fingerprint(request) else {
            return Ok(None);
        };
        let reply: redis::RedisResult<Vec<String>> = scripts::group_fast_path()
            .key(self.keys.metadata())
            .key(self.keys.leases())
            .arg(&request.member_id)
            .arg(print)
            .arg(request.request_seq)
            .arg(duration_us(self.config.member_lease_ttl))
            .arg(stream_version)
            .arg(request.active_consumer_workers)
            .invoke_async(&mut self.conn)
            .await;
        let reply = match reply {
            Ok(reply) => reply,
            Err(e) => return Err(self.wrong_type(e).await),
        };
        match reply.first().map(String::as_str) {
            Some("1") => {
                let json = reply.get(1).map(String::as_str).unwrap_or_default();
                match serde_json::from_str(json) {
                    Ok(response) => Ok(Some(response)),
                    // Derived data: the full transition answers and writes it again.
                    Err(error) => {
                        tracing::warn!(
                            key = %self.keys.metadata(),
                            field = %format!("{FAST}{}", request.member_id),
                            %error,
                            "fast-path response is not JSON; the full transition rewrites it"
                        );
                        Ok(None)
                    }
                }
            }
            Some("2") => {
                let last = reply.get(1).and_then(|v| v.parse().ok()).unwrap_or(0);
                Err(CoordinatorError::StaleRequestSeq {
                    got: request.request_seq,
                    last,
                }
                .into())
            }
            _ => Ok(None),
        }
    }

    async fn compare_and_set(
        &mut self,
        loaded: &LoadedGroup,
        writes: &Writes,
    ) -> Result<bool, StoreError> {
        let mut invocation = scripts::group_cas().prepare_invoke();
        invocation
            .key(self.keys.metadata())
            .key(self.keys.leases())
            .key(self.keys.history())
            .arg(loaded.revision)
            .arg(loaded.lease_revision)
            .arg(loaded.revision + 1)
            .arg(self.config.history_capacity)
            .arg(writes.set.len());
        for (field, value) in &writes.set {
            invocation.arg(field).arg(value);
        }
        invocation.arg(writes.delete.len());
        for field in &writes.delete {
            invocation.arg(field);
        }
        invocation.arg(writes.leases.len());
        for (member, lease) in &writes.leases {
            invocation.arg(member).arg(lease);
        }
        invocation.arg(writes.lease_removals.len());
        for member in &writes.lease_removals {
            invocation.arg(member);
        }
        invocation.arg(writes.history.len());
        for entry in &writes.history {
            invocation.arg(entry);
        }
        let written: redis::RedisResult<i64> = invocation.invoke_async(&mut self.conn).await;
        match written {
            Ok(1) => Ok(true),
            Ok(-1) => Err(self.wrong_type_now().await),
            Ok(_) => Ok(false),
            Err(e) => Err(self.wrong_type(e).await),
        }
    }

    /// This group's fence of each shard (docs/design.md §8), for a correction round. One `HGET` per
    /// shard, pipelined (fences of different shards live in different slots on a cluster).
    async fn read_fences(
        &mut self,
        shards: &[ShardIndex],
    ) -> Result<BTreeMap<ShardIndex, FenceToken>, StoreError> {
        let mut pipe = redis::pipe();
        for shard in shards {
            pipe.hget(self.stream_keys.fence(*shard), self.keys.group());
        }
        let values: Vec<Option<String>> = match pipe.query_async(&mut self.conn).await {
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
        let error = redis::RedisError::from((
            redis::ErrorKind::UnexpectedReturnType,
            "WRONGTYPE",
            "a group key holds another type".to_owned(),
        ));
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

/// The `:leases` scores as expiries in µs. A score is a double: one later than
/// `now + MAX_TIMING` (no lease TTL is longer, so no real lease ends later; `+inf` included)
/// would keep a dead member's shards forever, and is refused; a negative one is an expired
/// lease (0): the member renews it or rejoins, so it is safe as it is.
fn decode_leases(
    key: &str,
    leases: Vec<(String, f64)>,
    now: Micros,
) -> Result<HashMap<String, Micros>, StoreError> {
    let horizon = now.saturating_add(duration_us(MAX_TIMING));
    leases
        .into_iter()
        .map(|(member, score)| {
            // Also refuses NaN (no ordering), though Redis never stores one.
            if !matches!(
                score.partial_cmp(&(horizon as f64)),
                Some(std::cmp::Ordering::Less | std::cmp::Ordering::Equal)
            ) {
                return Err(StoreError::malformed(
                    key,
                    format!(
                        "the lease of member {member:?} ends at {score} µs, later than any lease TTL allows (now {now} µs + {} s); remove it (ZREM {key} {member:?}): the member renews its lease or joins again",
                        MAX_TIMING.as_secs()
                    ),
                ));
            }
            // Whole µs below 2^53 (now + a day): f64 holds them exactly; negative ones saturate to 0.
            Ok((member, score as Micros))
        })
        .collect()
}

/// Refuses counters of the group and member JSON at or above the limit (their `+ 1` must not
/// overflow, and a correction round must be able to go above them), and deadlines later than
/// `now + MAX_TIMING`: the coordinator sets each to now plus one timing (a lease TTL, the
/// rebalance timeout), so a later one is corrupt and would hold shards back, or keep a round
/// open, for as long as it says.
fn check_counters(
    key: &str,
    meta: &GroupMetadata,
    members: &BTreeMap<String, MemberMetadata>,
    now: Micros,
) -> Result<(), StoreError> {
    let horizon = now.saturating_add(duration_us(MAX_TIMING));
    let deadline = |field: &str, name: &str, value: Micros| {
        if value <= horizon {
            return Ok(());
        }
        Err(StoreError::malformed(
            key,
            format!(
                "{name} {value} in field {field} is later than any timing allows (now {now} µs + {} s)",
                MAX_TIMING.as_secs()
            ),
        ))
    };
    if let Some(at) = meta.hand_out_not_before {
        deadline(META, "handOutNotBefore", at)?;
    }
    if let Some(round) = &meta.correction_round {
        deadline(META, "correctionRound.notBeforeEnd", round.not_before_end)?;
    }
    check_counter(key, META, "incarnation", meta.incarnation)?;
    check_counter(key, META, "groupEpoch", meta.group_epoch.unsigned_abs())?;
    check_counter(
        key,
        META,
        "assignmentEpoch",
        meta.assignment_epoch.unsigned_abs(),
    )?;
    check_counter(key, META, "metadataVersion", meta.metadata_version)?;
    for (id, member) in members {
        let field = format!("{MEMBER}{id}");
        check_counter(
            key,
            &field,
            "memberEpoch",
            member.member_epoch.unsigned_abs(),
        )?;
        check_counter(key, &field, "lastRequestSeq", member.last_request_seq)?;
        deadline(
            &field,
            "memberLeaseExpiresAt",
            member.member_lease_expires_at,
        )?;
        if let Some(at) = member.revoke_deadline {
            deadline(&field, "revokeDeadline", at)?;
        }
        for holding in &member.old_process_holdings {
            deadline(
                &field,
                "oldProcessHoldings.leaseExpiresAt",
                holding.lease_expires_at,
            )?;
        }
    }
    Ok(())
}

fn decode_group(
    key: &str,
    fields: &HashMap<String, String>,
    leases: &HashMap<String, Micros>,
    config: &CoordinatorConfig,
    now: Micros,
) -> Result<Group, StoreError> {
    let json = fields
        .get(META)
        .ok_or_else(|| StoreError::malformed(key, "field meta is missing"))?;
    let meta: GroupMetadata =
        serde_json::from_str(json).map_err(|e| StoreError::corrupt(key, META, e))?;
    let mut members = BTreeMap::new();
    for (field, json) in fields {
        let Some(id) = field.strip_prefix(MEMBER) else {
            continue;
        };
        let mut member: MemberMetadata =
            serde_json::from_str(json).map_err(|e| StoreError::corrupt(key, field, e))?;
        if let Some(lease) = leases.get(id) {
            // The fast path moves only the lease, by the member's own TTL (members of one group
            // may run different timings): the renewal it made is the lease minus that TTL.
            let ttl = coordinator::member_lease_ttl_us(&member, config);
            member.member_lease_expires_at = *lease;
            member.last_heartbeat_at = member.last_heartbeat_at.max(lease.saturating_sub(ttl));
        }
        apply_fast_path_state(key, fields, id, &mut member)?;
        members.insert(id.to_owned(), member);
    }
    check_counters(key, &meta, &members, now)?;
    Ok(Group {
        meta,
        members,
        history: Default::default(),
    })
}

/// Requests the fast path accepted count as accepted: their sequence and (steady) response.
fn apply_fast_path_state(
    key: &str,
    fields: &HashMap<String, String>,
    id: &str,
    member: &mut MemberMetadata,
) -> Result<(), StoreError> {
    let seq_field = format!("{FAST_SEQ}{id}");
    let Some(seq) = fields.get(&seq_field) else {
        return Ok(());
    };
    // Only the fast path's answers to this process count: a static member's new process
    // starts its sequence again, and an old process's entry must not make it look stale. An
    // entry that is not `<fingerprint>\n<response JSON>` is no answer either: it is ignored
    // as if absent (what deleting it would do), and the full transition writes it again.
    let field = format!("{FAST}{id}");
    let Some((print, json)) = fields.get(&field).and_then(|e| e.split_once('\n')) else {
        return Ok(());
    };
    let same_process = print
        .split_once('|')
        .is_some_and(|(process, _)| process == member.process_id);
    if !same_process {
        return Ok(());
    }
    let response = match serde_json::from_str(json) {
        Ok(response) => response,
        Err(error) => {
            tracing::warn!(key, %field, %error, "fast-path response is not JSON: ignored, the full transition rewrites it");
            return Ok(());
        }
    };
    let seq = parse_u64(key, &seq_field, Some(seq)).map_err(|e| fast_path_cache(e, key))?;
    if seq <= member.last_request_seq {
        return Ok(());
    }
    member.last_request_seq = seq;
    let workers_field = format!("{FAST_WORKERS}{id}");
    if let Some(workers) = fields.get(&workers_field) {
        member.active_consumer_workers = u32::try_from(
            parse_u64(key, &workers_field, Some(workers)).map_err(|e| fast_path_cache(e, key))?,
        )
        .unwrap_or(u32::MAX);
    }
    member.last_response = Some(response);
    Ok(())
}

/// A malformed fast-path field: deleting that field (not the key) is the repair, since the
/// next full transition writes it again.
fn fast_path_cache(error: StoreError, key: &str) -> StoreError {
    match error {
        StoreError::Malformed { detail, .. } => StoreError::malformed(
            key,
            format!("{detail} (fast-path state: delete just this field with HDEL)"),
        ),
        other => other,
    }
}

/// The changed fields of one transition.
#[derive(Debug, Default)]
struct Writes {
    set: Vec<(String, String)>,
    delete: Vec<String>,
    leases: Vec<(String, String)>,
    lease_removals: Vec<String>,
    history: Vec<String>,
}

impl Writes {
    fn is_empty(&self) -> bool {
        self.set.is_empty()
            && self.delete.is_empty()
            && self.leases.is_empty()
            && self.lease_removals.is_empty()
            && self.history.is_empty()
    }

    fn diff(
        loaded: &LoadedGroup,
        group: &Group,
        config: &CoordinatorConfig,
    ) -> Result<Self, StoreError> {
        let key_err = |field: &str, e| StoreError::corrupt("group", field, e);
        let mut writes = Writes::default();
        let mut set = |field: String, value: String| {
            if loaded.fields.get(&field) != Some(&value) {
                writes.set.push((field, value));
            }
        };
        set(
            META.into(),
            serde_json::to_string(&group.meta).map_err(|e| key_err(META, e))?,
        );
        let steady = group.meta.state == crate::model::GroupState::Stable
            && group.meta.correction_round.is_none();
        let mut outdated = Vec::new();
        for (id, member) in &group.members {
            let json = serde_json::to_string(member).map_err(|e| key_err(id, e))?;
            set(format!("{MEMBER}{id}"), json);
            if !steady {
                // No `steady` marker: the fast path answers nothing, and the next steady write
                // rewrites or removes these fields.
                continue;
            }
            if let Some(response) = coordinator::steady_response(group, id, config) {
                let print = coordinator::steady_fingerprint(
                    &member.process_id,
                    member.member_epoch,
                    group.meta.metadata_version,
                    member.runtime_max_concurrency,
                    member.current_assignment.iter(),
                );
                let json = serde_json::to_string(&response).map_err(|e| key_err(id, e))?;
                set(format!("{FAST}{id}"), format!("{print}\n{json}"));
                set(
                    format!("{FAST_SEQ}{id}"),
                    member.last_request_seq.to_string(),
                );
            } else {
                // A member with no steady answer now (away after `-2`, not converged): an entry
                // of an earlier steady write would let a late duplicate of an older request,
                // above that old `fastseq`, renew its lease where the full transition says
                // stale (docs/design.md §5.3). Its JSON, written above, holds what the entry
                // counted (`lastRequestSeq`, `lastResponse`, `activeConsumerWorkers`: the load
                // applied them), so nothing is lost.
                outdated.push(id);
            }
        }
        if steady {
            let deadline = coordinator::next_deadline(group).unwrap_or(0);
            set(
                STEADY.into(),
                format!("{}|{deadline}", group.meta.metadata_version),
            );
        } else if loaded.fields.contains_key(STEADY) {
            writes.delete.push(STEADY.into());
        }
        for id in outdated {
            for prefix in [FAST, FAST_SEQ, FAST_WORKERS] {
                let field = format!("{prefix}{id}");
                if loaded.fields.contains_key(&field) {
                    writes.delete.push(field);
                }
            }
        }
        for id in loaded.group.members.keys() {
            if !group.members.contains_key(id) {
                for prefix in [MEMBER, FAST, FAST_SEQ, FAST_WORKERS] {
                    let field = format!("{prefix}{id}");
                    if loaded.fields.contains_key(&field) {
                        writes.delete.push(field);
                    }
                }
            }
        }
        for (id, member) in &group.members {
            if loaded.leases.get(id) != Some(&member.member_lease_expires_at) {
                writes
                    .leases
                    .push((id.clone(), member.member_lease_expires_at.to_string()));
            }
        }
        for id in loaded.leases.keys() {
            if !group.members.contains_key(id) {
                writes.lease_removals.push(id.clone());
            }
        }
        // Oldest first, so the newest ends at the head of the list.
        for member in group.history.iter().rev() {
            writes
                .history
                .push(serde_json::to_string(member).map_err(|e| key_err("history", e))?);
        }
        Ok(writes)
    }
}
