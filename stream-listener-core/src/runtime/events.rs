//! What a member reports to the application as it runs (`ListenerOptions::events`).

use std::sync::Arc;

use crate::model::{Epoch, ShardIndex};

/// A callback for [`ListenerEvent`]s. It runs on the member's tasks: keep it quick.
#[derive(Clone)]
pub struct EventCallback(pub Arc<dyn Fn(ListenerEvent) + Send + Sync>);

impl std::fmt::Debug for EventCallback {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EventCallback")
    }
}

/// Something a member did, reported to [`ListenerOptions::events`](super::ListenerOptions::events).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ListenerEvent {
    /// The member started reading a shard.
    Assigned {
        /// Member id.
        member: String,
        /// Shard.
        shard: ShardIndex,
        /// Member epoch of the assignment.
        member_epoch: Epoch,
    },
    /// The member gave a shard up (drained and released, or stopped by fencing).
    Revoked {
        /// Member id.
        member: String,
        /// Shard.
        shard: ShardIndex,
        /// Member epoch at that time.
        member_epoch: Epoch,
    },
    /// A fenced read returned entries.
    Read {
        /// Member id.
        member: String,
        /// Shard.
        shard: ShardIndex,
        /// Entries returned.
        count: usize,
        /// First entry id.
        first_id: String,
    },
    /// The fence refused a read, ack or claim.
    FenceRejected {
        /// `read`, `ack` or `claim`.
        op: &'static str,
        /// Member id.
        member: String,
        /// Shard.
        shard: ShardIndex,
    },
    /// A `"force"` retention trim of a shard this member owns removed entries that `group` had
    /// not acked or not received (docs/design.md §10.9); also logged as a warning.
    EntriesLost {
        /// Member id (of the trimming member; `group` may be another group).
        member: String,
        /// Shard.
        shard: ShardIndex,
        /// The consumer group that lost them.
        group: String,
        /// Entries lost.
        entries: u64,
    },
}
