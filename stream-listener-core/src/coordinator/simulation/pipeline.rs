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
    /// The read script of new entries (`>`) of one shard: check the fence, then `XREADGROUP`;
    /// what a shard task sends when its round's transaction read nothing for it (aborted, or
    /// another shard of the round refused).
    ReadAlone {
        shard: ShardIndex,
        token: FenceToken,
        count: u64,
    },
    /// The transaction that reads new entries of a round (`transaction.rs`).
    Read(ReadTx),
    /// The gate read of a round (`gate_read.rs`): a plain `XREADGROUP GROUP <g> <member> COUNT
    /// <n> STREAMS <shard…> <gate…> > … >` naming every shard's gate of its token, sent when
    /// every task of the round believes its gate open. One step at Redis, never refused at
    /// `maxmemory` (not deny-oom).
    GateRead {
        shards: Vec<(ShardIndex, FenceToken)>,
        count: u64,
    },
    /// `CLIENT KILL ID` of the connection of blocking wait `wait` (`wait.rs`), whose outcome the
    /// member cannot know: once it ran (or found the connection gone), that wait never runs, so
    /// the pending read queued after it on this connection sees whatever it read.
    KillWait { shard: ShardIndex, wait: u64 },
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
            Op::ReadAlone { shard, .. } => format!("read alone {shard}"),
            Op::Read(tx) => format!(
                "EXEC {:?}",
                tx.shards.iter().map(|(s, _)| s).collect::<Vec<_>>()
            ),
            Op::GateRead { shards, .. } => format!(
                "gate read {:?}",
                shards.iter().map(|(s, _)| s).collect::<Vec<_>>()
            ),
            Op::KillWait { shard, wait } => format!("CLIENT KILL wait {wait} of {shard}"),
        }
    }
}

/// The reply of a fenced script (raise, claim, pending read, read alone), as the shard task sees
/// it.
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
    /// The check passed and the read ran: the entries read (maybe none).
    Handed(Vec<EntryId>),
    /// Nothing was read, and the check did not refuse this shard: the `EXEC` aborted, or another
    /// shard of the round was refused (its read failed on the closed gate). The shard reads on
    /// its own.
    Aborted,
    /// The check refused the shard (its verdict), or did not vouch for what the read delivered
    /// (`None`: the check failed, and the read ran; its entries stay unseen in the member's PEL).
    NotHanded(Option<FenceVerdict>),
    /// No usable reply: lost, the connection dropped before the `EXEC`, or the read failed closed
    /// on a gate that could not be created (a typed error for the poller).
    Error,
}

/// One shard's part of a gate read's reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum GateReply {
    /// Every named gate and stream existed: the entries read (maybe none), vouched for by the
    /// gates.
    Handed(Vec<EntryId>),
    /// Redis refused it (`NOGROUP`: a gate or a stream missing; `BUSY`): nothing read. The
    /// task's belief is gone, and its next read is the transaction.
    Refused,
    /// No usable reply: lost, or the connection dropped. It may have read.
    Error,
}
