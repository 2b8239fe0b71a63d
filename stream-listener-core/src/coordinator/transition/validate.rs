//! Request validation and the `requestSeq` check, before anything changes.

use std::collections::BTreeSet;

use crate::coordinator::{Context, CoordinatorError, Group};
use crate::model::{
    COUNTER_LIMIT, HeartbeatRequest, HeartbeatResponse, PROTOCOL_VERSION, STATIC_LEAVE_EPOCH,
};

pub(super) fn validate(
    request: &HeartbeatRequest,
    ctx: &Context<'_>,
) -> Result<(), CoordinatorError> {
    if request.protocol_version != PROTOCOL_VERSION {
        return Err(CoordinatorError::UnsupportedProtocolVersion {
            got: request.protocol_version,
            supported: PROTOCOL_VERSION,
        });
    }
    if request.member_id.is_empty() {
        return Err(CoordinatorError::EmptyField { field: "memberId" });
    }
    if request.process_id.is_empty() {
        return Err(CoordinatorError::EmptyField { field: "processId" });
    }
    if request.member_epoch < STATIC_LEAVE_EPOCH {
        return Err(CoordinatorError::InvalidMemberEpoch(request.member_epoch));
    }
    let counters = [
        ("memberEpoch", request.member_epoch.unsigned_abs()),
        ("requestSeq", request.request_seq),
        ("metadataVersion", request.metadata_version),
    ];
    let conflicts = request.fence_conflicts.iter().flat_map(|c| {
        [
            ("fenceConflicts", c.incarnation),
            ("fenceConflicts", c.epoch.unsigned_abs()),
        ]
    });
    for (field, value) in counters.into_iter().chain(conflicts) {
        if value >= COUNTER_LIMIT {
            return Err(CoordinatorError::CounterAtLimit {
                field,
                value: value.to_string(),
            });
        }
    }
    let bound = ctx.stream.shard_index_bound;
    let mut seen = BTreeSet::new();
    let owned = request.owned_shards.iter().map(|s| (*s, "ownedShards"));
    let revoking = request
        .revoking_shards
        .iter()
        .map(|r| (r.shard_index, "revokingShards"));
    for (shard, field) in owned.chain(revoking) {
        if shard >= bound {
            return Err(CoordinatorError::ShardOutOfRange {
                shard,
                field,
                bound,
            });
        }
        if !seen.insert(shard) {
            return Err(CoordinatorError::DuplicateShard { shard, field });
        }
    }
    Ok(())
}

/// `requestSeq` handling: a lower one is ignored, a repeated one answered from the stored response.
pub(super) fn repeated_request(
    group: &Group,
    request: &HeartbeatRequest,
) -> Result<Option<HeartbeatResponse>, CoordinatorError> {
    let Some(member) = group.members.get(&request.member_id) else {
        return Ok(None);
    };
    if member.process_id != request.process_id || member.last_response.is_none() {
        return Ok(None);
    }
    if request.request_seq < member.last_request_seq {
        return Err(CoordinatorError::StaleRequestSeq {
            got: request.request_seq,
            last: member.last_request_seq,
        });
    }
    if request.request_seq == member.last_request_seq {
        return Ok(member.last_response.clone());
    }
    Ok(None)
}
