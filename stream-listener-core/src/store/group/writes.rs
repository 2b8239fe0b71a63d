//! Writing a transition (docs/design.md §5.1): the changed fields of the group hash, the leases
//! and the history, written by one compare-and-set script that checks `revision` and the
//! `fastseq:<id>` of every member the write touches.

use super::{FAST, FAST_SEQ, FAST_WORKERS, GroupStore, LoadedGroup, MEMBER, META, STEADY};
use crate::coordinator::{self, CoordinatorConfig, Group, ShardHolders, SteadyMarker};
use crate::model::MemberMetadata;
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
            .arg(loaded.revision + 1)
            .arg(self.config.history_capacity);
        // Each list as its length, then its items (a pair is two arguments).
        counted(&mut invocation, &writes.guards(loaded));
        counted(&mut invocation, &writes.set);
        counted(&mut invocation, &writes.delete);
        counted(&mut invocation, &writes.leases);
        counted(&mut invocation, &writes.lease_removals);
        counted(&mut invocation, &writes.history);
        counted(&mut invocation, &writes.releases);
        let written: redis::RedisResult<i64> = invocation.invoke_async(&mut self.conn).await;
        match written {
            Ok(1) => Ok(true),
            Ok(-1) => Err(self.wrong_type_now().await),
            Ok(_) => Ok(false),
            Err(e) => Err(self.wrong_type(e).await),
        }
    }
}

/// A value the coordinator made that does not serialise (not expected: the model types are plain
/// data), named by its field.
fn unserialisable(field: &str, error: serde_json::Error) -> StoreError {
    StoreError::corrupt("group", field, error)
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
    /// Fields deleted only while their value starts with the prefix: leases released by their
    /// holder alone.
    releases: Vec<(String, String)>,
}

impl Writes {
    /// The `fastseq:<id>` of every member whose fields or lease this write touches, with its
    /// loaded value (`""` when absent): the compare-and-set refuses if the fast path answered
    /// one of them since the load. Members the write leaves alone may renew on the fast path
    /// meanwhile: a renewal only extends a lease that the transition already saw as live and
    /// recently renewed (the fast path runs only while no lease has passed and the requester's
    /// own is fresh), so no decision of the transition depends on it (docs/design.md §5.1). A
    /// check of every lease at once made each full transition of a large group that is partly
    /// on the fast path lose to its 333 renewals a second.
    fn guards(&self, loaded: &LoadedGroup) -> Vec<(String, String)> {
        let members_of_fields = self
            .set
            .iter()
            .map(|(field, _)| field)
            .chain(&self.delete)
            .filter_map(|field| {
                [MEMBER, FAST, FAST_SEQ, FAST_WORKERS]
                    .iter()
                    .find_map(|prefix| field.strip_prefix(prefix))
            });
        let touched: std::collections::BTreeSet<&str> = members_of_fields
            .chain(self.leases.iter().map(|(id, _)| id.as_str()))
            .chain(self.lease_removals.iter().map(String::as_str))
            .collect();
        touched
            .into_iter()
            .map(|id| {
                let field = format!("{FAST_SEQ}{id}");
                let loaded_value = loaded.fields.get(&field).cloned().unwrap_or_default();
                (field, loaded_value)
            })
            .collect()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.set.is_empty()
            && self.delete.is_empty()
            && self.leases.is_empty()
            && self.lease_removals.is_empty()
            && self.history.is_empty()
            && self.releases.is_empty()
    }

    /// Sets `field` to `value` whatever the loaded hash holds.
    pub(super) fn set(&mut self, field: String, value: String) {
        self.set.push((field, value));
    }

    /// Deletes `field` of the group hash.
    pub(super) fn delete(&mut self, field: String) {
        self.delete.push(field);
    }

    /// Deletes the lease `field` (`<holder>|<expiry µs>`) only while `holder` holds it: a holder
    /// whose lease expired and passed to another leaves the new one's in place.
    pub(super) fn release(&mut self, field: String, holder: &str) {
        self.releases.push((field, format!("{holder}|")));
    }

    /// Sets `field` to `value` unless the loaded hash holds exactly that; whether it was set.
    fn set_if_changed(&mut self, loaded: &LoadedGroup, field: String, value: String) -> bool {
        if loaded.fields.get(&field) == Some(&value) {
            return false;
        }
        self.set.push((field, value));
        true
    }

    /// The fast-path fields of member `id` outside a correction round: its steady answer
    /// (without the group's epochs, which `steady` carries) and sequence, or, with no steady
    /// answer now, the removal of an earlier write's entry. Returns whether any of them changed.
    fn steady_entry(
        &mut self,
        loaded: &LoadedGroup,
        (group, holders): (&Group, &ShardHolders<'_>),
        (id, member): (&str, &MemberMetadata),
        config: &CoordinatorConfig,
    ) -> Result<bool, StoreError> {
        let Some(response) = coordinator::steady_response(group, id, config, holders) else {
            // A member with no steady answer now (away after `-2`, not converged): an entry
            // of an earlier write would let a late duplicate of an older request,
            // above that old `fastseq`, renew its lease where the full transition says
            // stale (docs/design.md §5.3). Its JSON, written by the caller because this
            // changed, holds what the entry counted (`lastRequestSeq`, `lastResponse`,
            // `activeConsumerWorkers`: the load applied them), so nothing is lost.
            let mut removed = false;
            for prefix in [FAST, FAST_SEQ, FAST_WORKERS] {
                let field = format!("{prefix}{id}");
                if loaded.fields.contains_key(&field) {
                    self.delete.push(field);
                    removed = true;
                }
            }
            return Ok(removed);
        };
        let print = coordinator::steady_fingerprint(
            &member.process_id,
            member.member_epoch,
            group.meta.metadata_version,
            member.runtime_max_concurrency,
            member.current_assignment.iter(),
        );
        let json = serde_json::to_string(&SteadyMarker::member_part(response))
            .map_err(|e| unserialisable(id, e))?;
        let entry = self.set_if_changed(loaded, format!("{FAST}{id}"), format!("{print}\n{json}"));
        let seq = self.set_if_changed(
            loaded,
            format!("{FAST_SEQ}{id}"),
            member.last_request_seq.to_string(),
        );
        Ok(entry || seq)
    }

    pub(super) fn diff(
        loaded: &LoadedGroup,
        group: &Group,
        config: &CoordinatorConfig,
    ) -> Result<Self, StoreError> {
        let mut writes = Writes::default();
        let meta = serde_json::to_string(&group.meta).map_err(|e| unserialisable(META, e))?;
        writes.set_if_changed(loaded, META.into(), meta);
        let marker = SteadyMarker::of(group);
        let holders = ShardHolders::of(group);
        for (id, member) in &group.members {
            let fast_fields_changed = if marker.is_some() {
                writes.steady_entry(loaded, (group, &holders), (id, member), config)?
            } else {
                // A correction round: no `steady` marker, the fast path answers nothing, and
                // the first write after the round rewrites or removes these fields.
                false
            };
            // A member the transition left as loaded keeps its stored JSON: the next load
            // rebuilds the same member from it, the lease and the unchanged fast-path fields
            // (`decode_group`). Rewriting every member on every transition made a transition's
            // work grow with the group (1,000 members: 1.5 to 3.5 ms of serialising here).
            // When its fast-path fields change, its JSON is written too, so that what they
            // counted stays with it (`apply_fast_path_state`).
            if fast_fields_changed || loaded.group.members.get(id) != Some(member) {
                let json = serde_json::to_string(member).map_err(|e| unserialisable(id, e))?;
                writes.set_if_changed(loaded, format!("{MEMBER}{id}"), json);
            }
        }
        if let Some(marker) = marker {
            let SteadyMarker {
                metadata_version,
                deadline,
                group_epoch,
                assignment_epoch,
            } = marker;
            writes.set_if_changed(
                loaded,
                STEADY.into(),
                format!("{metadata_version}|{deadline}|{group_epoch}|{assignment_epoch}"),
            );
        } else if loaded.fields.contains_key(STEADY) {
            writes.delete.push(STEADY.into());
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
                .push(serde_json::to_string(member).map_err(|e| unserialisable("history", e))?);
        }
        Ok(writes)
    }
}
