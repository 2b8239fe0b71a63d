//! The steady-state fast path (docs/design.md §5.3): one script that answers a steady heartbeat
//! exactly as the full transition would and only moves the lease, and the fast-path fields the
//! load applies to each member.

use std::collections::HashMap;

use super::{FAST, FAST_SEQ, FAST_WORKERS, GroupStore, duration_us};
use crate::coordinator::{self, CoordinatorError};
use crate::model::{GroupMetadata, HeartbeatRequest, HeartbeatResponse, MemberMetadata};
use crate::store::stream::parse_u64;
use crate::store::{StoreError, scripts};

impl GroupStore {
    /// The steady-state fast path (docs/design.md §5); `None` when the full transition must run.
    pub(super) async fn fast_path(
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
                // The script answers only with epochs it matched as at most 18 digits.
                let epoch = |i: usize| reply.get(i).and_then(|v| v.parse().ok()).unwrap_or(0);
                match serde_json::from_str(json) {
                    Ok(response) => Ok(Some(HeartbeatResponse {
                        group_epoch: epoch(2),
                        assignment_epoch: epoch(3),
                        ..response
                    })),
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
}

/// Requests the fast path accepted count as accepted: their sequence and (steady) response,
/// completed with the group's epochs from `meta` (written with the `steady` marker the fast path
/// took them from).
pub(super) fn apply_fast_path_state(
    key: &str,
    fields: &HashMap<String, String>,
    (id, meta): (&str, &GroupMetadata),
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
        Ok(response) => HeartbeatResponse {
            group_epoch: meta.group_epoch,
            assignment_epoch: meta.assignment_epoch,
            ..response
        },
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
