//! Scenario tests of the coordinator rules (docs/design.md §4–§6), one rule at a time, with the
//! exact expected responses, one file per concept. Random histories are in `simulation/`.

mod batch;
mod expiry;
mod json;
mod lost_metadata;
mod membership;
mod timings;
mod validation;

use std::collections::BTreeMap;
use std::time::Duration;

use super::invariants::check_group;
use super::*;
use crate::model::*;
use crate::testing::fixtures::{heartbeat_request, revoking};

const MS: Micros = 1_000;
const T0: Micros = 1_700_000_000_000_000;
const LEASE: Micros = 15_000 * MS;

struct Fixture {
    group: Group,
    stream: StreamView,
    config: CoordinatorConfig,
    now: Micros,
    seqs: BTreeMap<String, u64>,
}

fn stream(shards: u32) -> StreamView {
    StreamView {
        metadata_version: 1,
        shard_count: shards,
        readable: (0..shards).collect(),
        shard_index_bound: shards,
    }
}

/// A join-or-renew heartbeat of `member` in process `process` (`metadataVersion` 1, seq 0).
fn request(member: &str, process: &str, epoch: Epoch, owned: &[ShardIndex]) -> HeartbeatRequest {
    HeartbeatRequest {
        process_id: process.into(),
        ..heartbeat_request(member, "on_order", 1, (0, epoch), owned)
    }
}

impl Fixture {
    fn new(shards: u32) -> Self {
        let stream = stream(shards);
        Fixture {
            group: Group::new("orders", "billing", &stream, T0),
            stream,
            config: CoordinatorConfig::default(),
            now: T0,
            seqs: BTreeMap::new(),
        }
    }

    /// A group of `shards` shards whose member `a` joined and reported every shard owned.
    fn owned_by_a(shards: u32) -> Self {
        let mut f = Fixture::new(shards);
        f.join("a");
        f.beat("a", 1, &(0..shards).collect::<Vec<_>>());
        f
    }

    /// Sends `request` with the next `requestSeq` of its process and checks the invariants.
    fn send(&mut self, mut request: HeartbeatRequest) -> HeartbeatResponse {
        let seq = self.seqs.entry(request.process_id.clone()).or_default();
        *seq += 1;
        request.request_seq = *seq;
        self.send_raw(&request).expect("well-formed request")
    }

    /// Sends `request` as it is, without fences, and checks the invariants when it answered.
    fn transition(&mut self, request: &HeartbeatRequest) -> Result<Transition, CoordinatorError> {
        let ctx = Context {
            now: self.now,
            stream: &self.stream,
        };
        let transition = heartbeat(&mut self.group, request, &ctx, &self.config)?;
        if let Transition::Done(_) = transition {
            check_group(&self.group, self.now, true).expect("invariants hold");
        }
        Ok(transition)
    }

    /// As [`Fixture::transition`], for a request that is no lost-metadata evidence.
    fn send_raw(
        &mut self,
        request: &HeartbeatRequest,
    ) -> Result<HeartbeatResponse, CoordinatorError> {
        let transition = self.transition(request)?;
        Ok(transition.response().expect("no lost-metadata evidence"))
    }

    fn join(&mut self, member: &str) -> HeartbeatResponse {
        self.send(request(member, &format!("p-{member}"), JOIN_EPOCH, &[]))
    }

    /// A normal heartbeat of `member` (process `p-<member>`) owning `owned`.
    fn beat(&mut self, member: &str, epoch: Epoch, owned: &[ShardIndex]) -> HeartbeatResponse {
        self.send(request(member, &format!("p-{member}"), epoch, owned))
    }

    fn advance_ms(&mut self, ms: u64) {
        self.now += ms * MS;
    }

    fn member(&self, id: &str) -> &MemberMetadata {
        &self.group.members[id]
    }
}
