//! Writing a transition (docs/design.md §5.1): the changed fields of the group hash, the leases
//! and the history, written by one compare-and-set script that checks `revision` and
//! `leaseRevision`.

use super::{FAST, FAST_SEQ, FAST_WORKERS, GroupStore, LoadedGroup, MEMBER, META, STEADY};
use crate::coordinator::{self, CoordinatorConfig, Group};
use crate::store::{StoreError, scripts};

impl GroupStore {
    pub(super) async fn compare_and_set(
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
            .arg(self.config.history_capacity);
        // Each list as its length, then its items (a pair is two arguments).
        counted(&mut invocation, &writes.set);
        counted(&mut invocation, &writes.delete);
        counted(&mut invocation, &writes.leases);
        counted(&mut invocation, &writes.lease_removals);
        counted(&mut invocation, &writes.history);
        let written: redis::RedisResult<i64> = invocation.invoke_async(&mut self.conn).await;
        match written {
            Ok(1) => Ok(true),
            Ok(-1) => Err(self.wrong_type_now().await),
            Ok(_) => Ok(false),
            Err(e) => Err(self.wrong_type(e).await),
        }
    }
}

/// Adds `items` to a script call as their count, then each item.
fn counted<T: redis::ToRedisArgs>(invocation: &mut redis::ScriptInvocation<'_>, items: &[T]) {
    invocation.arg(items.len());
    for item in items {
        invocation.arg(item);
    }
}

/// The changed fields of one transition.
#[derive(Debug, Default)]
pub(super) struct Writes {
    set: Vec<(String, String)>,
    delete: Vec<String>,
    leases: Vec<(String, String)>,
    lease_removals: Vec<String>,
    history: Vec<String>,
}

impl Writes {
    pub(super) fn is_empty(&self) -> bool {
        self.set.is_empty()
            && self.delete.is_empty()
            && self.leases.is_empty()
            && self.lease_removals.is_empty()
            && self.history.is_empty()
    }

    pub(super) fn diff(
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
