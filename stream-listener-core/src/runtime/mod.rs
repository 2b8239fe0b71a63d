//! What a member's heartbeat loop (`crate::member`) and its shard tasks (`crate::poller`) share
//! (docs/design.md §7.3): the listener's options and events, and the member's assignment state.
//!
//! The heartbeat loop writes the assignment state (the reconciler: owned shards, tokens, lease)
//! and the shard tasks read it before every operation. This module imports neither side, so
//! `member` depends on `poller` (it spawns shard tasks) and both on `runtime`, with no cycle.

mod events;
mod options;
mod ordering;

use std::sync::atomic::AtomicU64;
use std::sync::{Mutex, MutexGuard, PoisonError};

use tokio::sync::Notify;

use crate::reconciler::Reconciler;
pub use events::{EventCallback, ListenerEvent};
pub use options::{DEFAULT_METRICS_INTERVAL, ListenerOptions, MAX_BATCH_SIZE, MAX_CONCURRENCY};
pub use ordering::Ordering;

/// State one member's heartbeat loop and shard tasks share.
#[derive(Debug)]
pub(crate) struct MemberShared {
    reconciler: Mutex<Reconciler>,
    /// Wakes the heartbeat loop early (a shard drained: report it now).
    pub(crate) wake_heartbeat: Notify,
    /// Signals shard tasks that the assignment or lease changed.
    pub(crate) assignment_changed: Notify,
    /// Entries handled and acked so far (the `handled` of a member's status).
    pub(crate) handled: AtomicU64,
    /// Whether the member's shard tasks are paused (`ListenerHandle::pause`, docs/design.md
    /// §14.4): a watch, so a paused task waits for the resume instead of polling the flag.
    pub(crate) paused: tokio::sync::watch::Sender<bool>,
}

impl MemberShared {
    pub(crate) fn new(reconciler: Reconciler) -> Self {
        MemberShared {
            reconciler: Mutex::new(reconciler),
            wake_heartbeat: Notify::new(),
            assignment_changed: Notify::new(),
            handled: AtomicU64::new(0),
            paused: tokio::sync::watch::Sender::new(false),
        }
    }

    /// The member's assignment state, locked. Never held across an await.
    pub(crate) fn lock(&self) -> MutexGuard<'_, Reconciler> {
        // A panic while holding this lock cannot leave the reconciler half-updated in a way that
        // matters more than stopping: recover the guard rather than poisoning every member task.
        self.reconciler
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether the member is paused now (one load).
    pub(crate) fn is_paused(&self) -> bool {
        *self.paused.borrow()
    }

    /// Pauses (`true`) or resumes (`false`) the member's shard tasks; waiting tasks wake.
    pub(crate) fn set_paused(&self, paused: bool) {
        self.paused.send_replace(paused);
    }

    /// The member id (fixed for the member's life).
    pub(crate) fn member_id(&self) -> String {
        self.lock().identity().member_id.clone()
    }
}
