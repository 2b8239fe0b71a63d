//! The assignment log of `run()`: shard ownership as the members report it, logged once it has
//! settled.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use stream_listener_core::member::{EventCallback, ListenerEvent};
use stream_listener_core::model::ShardIndex;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// Shard ownership as reported by the members' events, logged once it settles.
#[derive(Default)]
pub(crate) struct AssignmentLog {
    /// listener → member → owned shards.
    owned: Mutex<BTreeMap<String, BTreeMap<String, BTreeSet<ShardIndex>>>>,
    changed: Notify,
}

impl AssignmentLog {
    fn lock(
        &self,
    ) -> std::sync::MutexGuard<'_, BTreeMap<String, BTreeMap<String, BTreeSet<ShardIndex>>>> {
        self.owned
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(crate) fn add_listener(&self, name: &str, members: &[String]) {
        let mut owned = self.lock();
        let listener = owned.entry(name.to_owned()).or_default();
        for member in members {
            listener.entry(member.clone()).or_default();
        }
    }

    /// Applies `change` to what `member` of `listener` owns; returns what `change` returns.
    fn update(
        &self,
        listener: &str,
        member: String,
        change: impl FnOnce(&mut BTreeSet<ShardIndex>) -> bool,
    ) -> bool {
        let mut owned = self.lock();
        change(
            owned
                .entry(listener.to_owned())
                .or_default()
                .entry(member)
                .or_default(),
        )
    }

    pub(crate) fn callback(self: &Arc<Self>, listener: &str) -> EventCallback {
        let log = Arc::downgrade(self);
        let listener = listener.to_owned();
        EventCallback(Arc::new(move |event| {
            let Some(log) = log.upgrade() else { return };
            let changed = match event {
                ListenerEvent::Assigned { member, shard, .. } => {
                    log.update(&listener, member, |owned| owned.insert(shard))
                }
                ListenerEvent::Revoked { member, shard, .. } => {
                    log.update(&listener, member, |owned| owned.remove(&shard))
                }
                _ => false,
            };
            if changed {
                log.changed.notify_one();
            }
        }))
    }

    /// Logs every listener's assignment once no change has come for `settle`.
    pub(crate) async fn run(self: Arc<Self>, settle: Duration, shutdown: CancellationToken) {
        loop {
            tokio::select! {
                _ = self.changed.notified() => {}
                _ = shutdown.cancelled() => return,
            }
            loop {
                tokio::select! {
                    _ = self.changed.notified() => continue,
                    _ = tokio::time::sleep(settle) => break,
                    _ = shutdown.cancelled() => return,
                }
            }
            let snapshot = self.lock().clone();
            for (listener, members) in snapshot {
                let shards: usize = members.values().map(BTreeSet::len).sum();
                let assignment = members
                    .iter()
                    .map(|(member, owned)| format!("{member}: {owned:?}"))
                    .collect::<Vec<_>>()
                    .join(", ");
                if shards == 0 {
                    // "Settled" alone reads as done; an idle process is worth a why.
                    tracing::info!(
                        listener = %listener,
                        members = members.len(),
                        "assignment settled: this process owns no shard (other members hold them, the group has more members than shards, or a stopped static member's shards wait out its lease); `stream-listener group describe` shows which"
                    );
                    continue;
                }
                tracing::info!(
                    listener = %listener,
                    shards,
                    members = members.len(),
                    %assignment,
                    "assignment settled"
                );
            }
        }
    }
}
