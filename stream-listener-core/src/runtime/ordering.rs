//! How a shard's entries may run relative to each other (config key `ordering`,
//! docs/design.md §14.3).

use serde::{Deserialize, Serialize};

/// How the entries of one shard may run relative to each other (`[listeners.<name>] ordering`,
/// docs/design.md §14.3). In every mode a shard has one owner at a time, acks follow completion
/// and a new owner re-reads whatever was not acked (at-least-once, as with the default); a paused
/// shard (`ListenerHandle::pause`, `HandlerError::pause_shard`) starts no new entry while the
/// running ones finish. Batch listeners ignore it (one batch attempt of a shard at a time).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Ordering {
    /// `"shard"` (default): one entry of a shard at a time, in entry order; each handler
    /// attempt takes one of the member's `runtime_max_concurrency` workers.
    #[default]
    Shard,
    /// `"key"`: entries of one shard with different partition keys (field `key`) run
    /// concurrently, up to `max_in_flight` per shard; entries of one key run one at a time in
    /// entry order, their retries and backoff included. Entries without a key form one lane of
    /// their own (in entry order too).
    Key,
    /// `"none"`: any entries of a shard run concurrently, up to `max_in_flight`; no order.
    None,
}

impl Ordering {
    /// The config value: `"shard"`, `"key"` or `"none"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Ordering::Shard => "shard",
            Ordering::Key => "key",
            Ordering::None => "none",
        }
    }
}
