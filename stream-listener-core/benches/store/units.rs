//! The load: a [`Member`] following the protocol, and the baselines' units (`PING`; one
//! lease renewal's `HGET` + `ZADD XX`), each one request per tick.

use std::collections::BTreeSet;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::*;
use stream_listener_core::connection::RedisConnection;
use stream_listener_core::model::{
    HeartbeatRequest, HeartbeatResponse, HeartbeatStatus, PROTOCOL_VERSION, RevokeState,
    RevokingShard, ShardIndex,
};
use stream_listener_core::store::GroupStore;

/// One timed request.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sample {
    pub(crate) start: Instant,
    pub(crate) latency: Duration,
    pub(crate) fast_path: bool,
    pub(crate) status: Option<HeartbeatStatus>,
    pub(crate) attempts: u32,
    pub(crate) error: bool,
}

impl Sample {
    pub(crate) fn plain(start: Instant, ok: bool) -> Self {
        Sample {
            start,
            latency: start.elapsed(),
            fast_path: false,
            status: None,
            attempts: 0,
            error: !ok,
        }
    }
}

/// Something driven at a fixed interval: one request per tick.
pub(crate) trait Unit: Send + 'static {
    fn tick(&mut self) -> impl Future<Output = Sample> + Send;
}

/// A member following the protocol (as in tests/store.rs): releases what it is no longer
/// assigned by reporting it `REVOKED` once, rejoins with epoch 0 when fenced.
pub(crate) struct Member {
    pub(crate) id: String,
    pub(crate) store: GroupStore,
    pub(crate) seq: u64,
    pub(crate) epoch: i64,
    pub(crate) metadata_version: u64,
    pub(crate) owned: Vec<ShardIndex>,
    pub(crate) revoked: Vec<ShardIndex>,
    /// What the last request reported: owned shards, and whether it reported revoked ones.
    pub(crate) reported: (Vec<ShardIndex>, bool),
    pub(crate) last: Option<HeartbeatResponse>,
    pub(crate) last_at: Option<Instant>,
    /// Longest time between two heartbeats of this member during convergence.
    pub(crate) max_gap: Duration,
}

impl Member {
    pub(crate) fn new(id: String, store: GroupStore) -> Self {
        Member {
            id,
            store,
            seq: 0,
            epoch: 0,
            metadata_version: 1,
            owned: Vec::new(),
            revoked: Vec::new(),
            reported: (Vec::new(), false),
            last: None,
            last_at: None,
            max_gap: Duration::ZERO,
        }
    }

    pub(crate) fn request(&self) -> HeartbeatRequest {
        HeartbeatRequest {
            member_id: self.id.clone(),
            member_name: "bench".into(),
            instance_id: None,
            process_id: format!("proc-{}", self.id),
            request_seq: self.seq,
            member_epoch: self.epoch,
            metadata_version: self.metadata_version,
            runtime_max_concurrency: 1,
            active_consumer_workers: 0,
            owned_shards: self.owned.clone(),
            revoking_shards: self
                .revoked
                .iter()
                .map(|s| RevokingShard {
                    shard_index: *s,
                    state: RevokeState::Revoked,
                })
                .collect(),
            fence_conflicts: Vec::new(),
            protocol_version: PROTOCOL_VERSION,
        }
    }

    /// Converged: the last request reported nothing revoked, and its answer was `OK` with
    /// exactly the reported shards assigned and nothing pending.
    pub(crate) fn converged(&self) -> bool {
        self.last.as_ref().is_some_and(|r| {
            r.status == HeartbeatStatus::Ok
                && r.pending_shards.is_empty()
                && !self.reported.1
                && r.assigned_shards == self.reported.0
        })
    }

    pub(crate) async fn heartbeat(&mut self) -> Sample {
        self.seq += 1;
        let request = self.request();
        self.reported = (self.owned.clone(), !self.revoked.is_empty());
        let start = Instant::now();
        if let Some(at) = self.last_at {
            self.max_gap = self.max_gap.max(start - at);
        }
        self.last_at = Some(start);
        let result = self.store.heartbeat(&request).await;
        let latency = start.elapsed();
        match result {
            Ok(outcome) => {
                let response = outcome.response;
                self.apply(&response);
                let sample = Sample {
                    start,
                    latency,
                    fast_path: outcome.fast_path,
                    status: Some(response.status),
                    attempts: outcome.attempts,
                    error: false,
                };
                self.last = Some(response);
                sample
            }
            Err(e) => {
                eprintln!("  {}: heartbeat failed: {e}", self.id);
                Sample {
                    start,
                    latency,
                    fast_path: false,
                    status: None,
                    attempts: 0,
                    error: true,
                }
            }
        }
    }

    pub(crate) fn apply(&mut self, response: &HeartbeatResponse) {
        match response.status {
            HeartbeatStatus::Ok => {
                self.epoch = response.member_epoch;
                self.metadata_version = response.metadata_version;
                let assigned: BTreeSet<ShardIndex> =
                    response.assigned_shards.iter().copied().collect();
                self.revoked = self
                    .owned
                    .iter()
                    .filter(|s| !assigned.contains(s))
                    .copied()
                    .collect();
                self.owned = response.assigned_shards.clone();
            }
            HeartbeatStatus::SyncMetadata => {
                self.epoch = response.member_epoch;
                self.metadata_version = response.metadata_version;
                let assigned: BTreeSet<ShardIndex> =
                    response.assigned_shards.iter().copied().collect();
                let (keep, release): (Vec<ShardIndex>, Vec<ShardIndex>) =
                    self.owned.iter().partition(|s| assigned.contains(s));
                self.revoked.extend(release);
                self.owned = keep;
            }
            HeartbeatStatus::RevokePending | HeartbeatStatus::Retry => {}
            HeartbeatStatus::UnknownMemberId | HeartbeatStatus::FencedMemberEpoch => {
                self.epoch = 0;
                self.owned.clear();
                self.revoked.clear();
            }
            HeartbeatStatus::FencedInstanceId => {
                panic!("{}: FENCED_INSTANCE_ID without an instance id", self.id)
            }
        }
    }
}

impl Unit for Member {
    fn tick(&mut self) -> impl Future<Output = Sample> + Send {
        self.heartbeat()
    }
}

/// Baseline: one `PING`.
pub(crate) struct Ping {
    pub(crate) conn: RedisConnection,
}

impl Unit for Ping {
    async fn tick(&mut self) -> Sample {
        let start = Instant::now();
        let result: redis::RedisResult<String> =
            redis::cmd("PING").query_async(&mut self.conn).await;
        Sample::plain(start, result.is_ok())
    }
}

/// Baseline: `HGET` of the stream's `metadataVersion` and `ZADD XX` of the member's lease,
/// pipelined (one round trip).
pub(crate) struct Renewal {
    pub(crate) conn: RedisConnection,
    pub(crate) metadata_key: String,
    pub(crate) member: String,
    pub(crate) ttl_us: u64,
}

impl Unit for Renewal {
    async fn tick(&mut self) -> Sample {
        let start = Instant::now();
        let now_us = u64::try_from(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_micros(),
        )
        .unwrap_or(u64::MAX);
        let mut pipe = redis::pipe();
        pipe.hget(&self.metadata_key, "metadataVersion")
            .cmd("ZADD")
            .arg(BASELINE_LEASES)
            .arg("XX")
            .arg(now_us + self.ttl_us)
            .arg(&self.member);
        let result: redis::RedisResult<(Option<String>, i64)> =
            pipe.query_async(&mut self.conn).await;
        Sample::plain(start, result.is_ok())
    }
}
