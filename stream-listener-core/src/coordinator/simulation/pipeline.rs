//! A member process's data-plane connection: the commands it sent that Redis has not run yet, in
//! the order Redis runs them, and the replies they get (docs/design.md §8).
//!
//! A command is decided by the shard task while the process may use the shard (it owns it and
//! its lease holds), and Redis runs it later, after any other client's commands: a process
//! paused before its pipeline went out sends it when it resumes, long after its lease passed.
//! That is how a zombie's read, raise, claim or ack arrives late.

use super::entries::EntryId;
use super::transaction::ReadTx;
use crate::fence::{FenceToken, FenceVerdict};
use crate::model::ShardIndex;

/// A command (or script, or transaction) in the pipeline.
#[derive(Debug, Clone)]
pub(super) enum Op {
    /// Plain `XACK` of handled ids: no fence (a member acks only what it handled).
    Ack {
        shard: ShardIndex,
        ids: Vec<EntryId>,
    },
    /// The raise script: `HSET` of the token when strictly higher (docs/design.md §8.2).
    Raise {
        shard: ShardIndex,
        token: FenceToken,
    },
    /// The claim script: check the fence, then `XPENDING` by consumer and `XCLAIM … JUSTID` of
    /// up to `count` entries of other consumers (§8.3 step 2).
    Claim {
        shard: ShardIndex,
        token: FenceToken,
        count: u64,
    },
    /// The pending-read script: check the fence, then `XREADGROUP … <after>` of the member's own
    /// pending entries (§8.3 step 4).
    Pending {
        shard: ShardIndex,
        token: FenceToken,
        after: EntryId,
        count: u64,
    },
    /// The optimistic transaction that reads new entries (`transaction.rs`).
    Read(ReadTx),
}

impl Op {
    /// For the log.
    pub(super) fn describe(&self) -> String {
        match self {
            Op::Ack { shard, ids } => format!("XACK {shard} {ids:?}"),
            Op::Raise { shard, token } => {
                format!(
                    "raise {shard} ({},{})",
                    token.incarnation, token.member_epoch
                )
            }
            Op::Claim { shard, .. } => format!("claim {shard}"),
            Op::Pending { shard, after, .. } => format!("pending {shard} after {after}"),
            Op::Read(tx) => format!(
                "EXEC {:?}",
                tx.shards.iter().map(|(s, _)| s).collect::<Vec<_>>()
            ),
        }
    }
}

/// The reply of a fenced script (raise, claim, pending read), as the shard task sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum ScriptReply {
    /// The fence held the token (or the raise was accepted): the ids read or claimed.
    Passed(Vec<EntryId>),
    /// The fence refused the token: `LOWER` or `HIGHER`.
    Refused(FenceVerdict),
    /// `NOGROUP`: the shard's stream is gone (retired).
    Gone,
    /// No usable reply: lost with the connection, or the write refused (`OOM`).
    Error,
}

/// One shard's part of a read transaction's reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum ReadReply {
    /// The check passed for the shard and the `EXEC` ran: the entries read (maybe none).
    Handed(Vec<EntryId>),
    /// The `EXEC` aborted, or ran while the check did not pass for the shard (the entries read
    /// then stay unseen in the member's PEL): the shard's verdict when the check ran.
    NotHanded(Option<FenceVerdict>),
    /// No usable reply: lost, or the connection dropped before the `EXEC`.
    Error,
}
