//! A member's shard task as the poller runs it (docs/design.md §8.3–§8.5, §8.10): the takeover
//! (raise the fence → claim other consumers' pending entries → the member's own pending entries
//! from `0`) and then reads of new entries, one command at a time; the entries read and not yet
//! handled; and the member's rules for every reply, a blocking wait's (`wait.rs`) and a gate
//! read's (`gate_read.rs`) among them. A new token (a new assignment, a correction round) starts
//! a new task, with a new takeover, and without the belief that its gate is open.

use std::collections::VecDeque;

use super::ReadVariant;
use super::entries::EntryId;
use super::pipeline::{GateReply, ReadReply, ScriptReply};
use super::wait::WaitEnd;
use crate::fence::{FenceToken, FenceVerdict};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    /// Raise the fence with the task's token: first, and after every `LOWER` (a lost raise).
    Raise { after_lower: bool },
    /// Claim other consumers' pending entries, a batch at a time, until none is left: after
    /// every raise, since the fence was not this token's while others could read.
    Claim,
    /// Read the member's own pending entries from `0`, a batch at a time (`after`: the last id
    /// read): after the takeover's claims, and after any error of a read of new entries (its
    /// entries may sit unseen in the member's PEL).
    Pending { after: EntryId },
    /// Read new entries (`>`) by transaction, in rounds of the member's shards, or wait for
    /// them (`wait.rs`).
    New,
    /// Kill the connection of a blocking wait whose outcome is unknown (`CLIENT KILL ID`), then
    /// read the member's own pending entries from `0`: that wait may still reach Redis and read
    /// through the task's own gate, after a pending read that did not wait for the kill.
    KillWait { wait: u64 },
    /// The fence holds a higher token, or the stream is gone: read nothing more with this token.
    Parked,
}

#[derive(Debug, Clone)]
pub(super) struct ShardTask {
    pub(super) token: FenceToken,
    pub(super) phase: Phase,
    /// Entries read while the fence held the token, not yet handled, in id order.
    pub(super) in_hand: VecDeque<EntryId>,
    /// The command of this task whose reply it waits for (a command it gave up on, after a
    /// response timeout, may still run: its reply is ignored).
    pub(super) waiting: Option<u64>,
    /// In [`Phase::New`]: the last round read nothing for this shard, which reads on its own next
    /// (the fenced read script), as `ShardClient::round_reply` does for `PartRead::ReadAlone`.
    pub(super) read_alone: bool,
    /// In [`Phase::New`]: the last read found nothing for this shard (or a wait timed out), so
    /// it waits for new entries with a blocking wait on its gate next (with
    /// `Faults::strict_waits`), rather than reading again.
    pub(super) wait_next: bool,
    /// In [`Phase::New`]: the task's last read of new entries under its token was handed over
    /// (its transaction's check passed for it, or a gate read succeeded), so it believes its
    /// gate open, and reads next with a gate read (`gate_read.rs`) when every shard of the round
    /// believes so too (with `Faults::gate_reads`). Any other outcome of any read clears it.
    pub(super) gate_open: bool,
}

impl ShardTask {
    pub(super) fn new(token: FenceToken) -> Self {
        ShardTask {
            token,
            phase: Phase::Raise { after_lower: false },
            in_hand: VecDeque::new(),
            waiting: None,
            read_alone: false,
            wait_next: false,
            gate_open: false,
        }
    }

    /// Ready to send its next command: nothing in flight and its batch handled.
    pub(super) fn ready(&self) -> bool {
        self.waiting.is_none() && self.in_hand.is_empty() && self.phase != Phase::Parked
    }

    /// A refusal of the fence: `LOWER` raises again (and takes over again), `HIGHER` parks.
    fn refused(&mut self, verdict: FenceVerdict) {
        self.phase = match verdict {
            FenceVerdict::Lower => Phase::Raise { after_lower: true },
            FenceVerdict::Higher => Phase::Parked,
            FenceVerdict::Equal => self.phase,
        };
    }

    /// The raise script's reply. After a `LOWER`, the takeover starts again with the claims,
    /// unless the member follows [`ReadVariant::lower_retries_without_takeover`].
    pub(super) fn on_raise(&mut self, reply: &ScriptReply, variant: ReadVariant) {
        self.gate_open = false;
        let Phase::Raise { after_lower } = self.phase else {
            return;
        };
        match reply {
            ScriptReply::Passed(_) if after_lower && variant.lower_retries_without_takeover => {
                self.phase = Phase::New;
            }
            ScriptReply::Passed(_) => self.phase = Phase::Claim,
            ScriptReply::Refused(verdict) => self.refused(*verdict),
            ScriptReply::Gone => self.phase = Phase::Parked,
            ScriptReply::Error => {}
        }
    }

    /// The claim script's reply: the next batch, or on to the member's own pending entries.
    pub(super) fn on_claim(&mut self, reply: &ScriptReply) {
        self.gate_open = false;
        if self.phase != Phase::Claim {
            return;
        }
        match reply {
            ScriptReply::Passed(ids) if ids.is_empty() => self.phase = Phase::Pending { after: 0 },
            ScriptReply::Passed(_) | ScriptReply::Error => {}
            ScriptReply::Refused(verdict) => self.refused(*verdict),
            ScriptReply::Gone => self.phase = Phase::Parked,
        }
    }

    /// The pending-read script's reply: the entries go to the handler; an empty page ends the
    /// takeover. An error repeats the page.
    pub(super) fn on_pending(&mut self, reply: &ScriptReply) {
        self.gate_open = false;
        if !matches!(self.phase, Phase::Pending { .. }) {
            return;
        }
        match reply {
            ScriptReply::Passed(ids) => match ids.last() {
                Some(last) => {
                    self.phase = Phase::Pending { after: *last };
                    self.in_hand.extend(ids);
                }
                None => self.phase = Phase::New,
            },
            ScriptReply::Refused(verdict) => self.refused(*verdict),
            ScriptReply::Gone => self.phase = Phase::Parked,
            ScriptReply::Error => {}
        }
    }

    /// This shard's part of a read transaction's reply. Entries go to the handler only when the
    /// check passed; a round that read nothing for a shard the check did not refuse is followed by
    /// the shard's read alone; any error, or a check that did not vouch for what was read, sends
    /// the task back to its own pending entries from `0` (the read may have run).
    pub(super) fn on_read(&mut self, reply: &ReadReply, variant: ReadVariant) {
        self.gate_open = false;
        if self.phase != Phase::New {
            return;
        }
        self.wait_next = matches!(reply, ReadReply::Handed(ids) if ids.is_empty());
        match reply {
            ReadReply::Handed(ids) => {
                self.gate_open = true;
                self.in_hand.extend(ids);
            }
            ReadReply::Aborted | ReadReply::NotHanded(Some(FenceVerdict::Equal)) => {
                self.read_alone = true;
            }
            ReadReply::NotHanded(Some(verdict)) => self.refused(*verdict),
            ReadReply::Error if variant.error_reads_on => {}
            ReadReply::NotHanded(None) | ReadReply::Error => {
                self.phase = Phase::Pending { after: 0 };
            }
        }
    }

    /// The reply of the read script of new entries, sent alone: the entries go to the handler;
    /// the next read goes in a round again. An error sends the task back to its own pending
    /// entries from `0`, as after any read of new entries.
    pub(super) fn on_read_alone(&mut self, reply: &ScriptReply, variant: ReadVariant) {
        self.gate_open = false;
        if self.phase != Phase::New {
            return;
        }
        self.read_alone = false;
        self.wait_next = matches!(reply, ScriptReply::Passed(ids) if ids.is_empty());
        match reply {
            ScriptReply::Passed(ids) => self.in_hand.extend(ids),
            ScriptReply::Refused(verdict) => self.refused(*verdict),
            ScriptReply::Gone => self.phase = Phase::Parked,
            ScriptReply::Error if variant.error_reads_on => {}
            ScriptReply::Error => self.phase = Phase::Pending { after: 0 },
        }
    }
}

impl ShardTask {
    /// The reply of the `CLIENT KILL` of a wait's connection: killed or already gone, on to the
    /// member's own pending entries; an error sends it again.
    pub(super) fn on_kill(&mut self, reply: &ScriptReply) {
        self.gate_open = false;
        if !matches!(self.phase, Phase::KillWait { .. }) {
            return;
        }
        if *reply != ScriptReply::Error {
            self.phase = Phase::Pending { after: 0 };
        }
    }

    /// This shard's part of a blocking wait's reply. Entries served go to the handler when the
    /// task still holds the shard by its lease (`holds`); else they stay in the member's PEL, and
    /// the task reads its own pending entries from `0` if it goes on. An error (a gate closed,
    /// the stream gone) is followed by a read by transaction, whose check comes before any
    /// further wait; a timeout, or a reply with nothing for this shard, by another wait or (the
    /// member's choice, `wait_again`) a read; an unknown outcome by the kill of the wait's
    /// connection and the member's own pending entries from `0`, as after any read of new
    /// entries (docs/design.md §8.10).
    pub(super) fn on_wait(
        &mut self,
        wait: u64,
        end: &WaitEnd,
        holds: bool,
        wait_again: bool,
        variant: ReadVariant,
    ) {
        self.gate_open = false;
        if self.phase != Phase::New {
            return;
        }
        self.wait_next = false;
        match end {
            WaitEnd::Served(ids) if ids.is_empty() => self.wait_next = true,
            WaitEnd::Served(ids) if holds => self.in_hand.extend(ids),
            WaitEnd::Served(_) => self.phase = Phase::Pending { after: 0 },
            WaitEnd::TimedOut => self.wait_next = wait_again,
            WaitEnd::Refused => {}
            WaitEnd::Lost if variant.error_reads_on => {}
            WaitEnd::Lost if variant.wait_lost_without_kill => {
                self.phase = Phase::Pending { after: 0 };
            }
            WaitEnd::Lost => self.phase = Phase::KillWait { wait },
        }
    }
}

impl ShardTask {
    /// This shard's part of a gate read's reply. Entries read go to the handler (the gates
    /// vouched for them) and the belief stays; a refusal (a gate or a stream missing, `BUSY`:
    /// nothing read) clears it, so the next read is the transaction, whose check comes first; an
    /// unknown outcome sends the task back to its own pending entries from `0`, as after a
    /// transaction's lost reply (docs/design.md §8.10).
    pub(super) fn on_gate_read(&mut self, reply: &GateReply, variant: ReadVariant) {
        self.gate_open = false;
        if self.phase != Phase::New {
            return;
        }
        self.read_alone = false;
        self.wait_next = matches!(reply, GateReply::Handed(ids) if ids.is_empty());
        match reply {
            GateReply::Handed(ids) => {
                self.gate_open = true;
                self.in_hand.extend(ids);
            }
            GateReply::Refused => {}
            GateReply::Error if variant.error_reads_on => {}
            GateReply::Error => self.phase = Phase::Pending { after: 0 },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::fixtures::fence_token as token;

    #[test]
    fn a_takeover_raises_claims_reads_its_own_pending_entries_then_new_ones() {
        let design = ReadVariant::default();
        let mut task = ShardTask::new(token(1, 5, "a"));
        task.on_raise(&ScriptReply::Passed(vec![]), design);
        assert_eq!(task.phase, Phase::Claim);
        task.on_claim(&ScriptReply::Passed(vec![3, 4]));
        task.on_claim(&ScriptReply::Passed(vec![]));
        assert_eq!(task.phase, Phase::Pending { after: 0 });
        task.on_pending(&ScriptReply::Passed(vec![3, 4]));
        assert_eq!(task.phase, Phase::Pending { after: 4 });
        assert_eq!(task.in_hand, [3, 4]);
        task.in_hand.clear();
        task.on_pending(&ScriptReply::Passed(vec![]));
        assert_eq!(task.phase, Phase::New);
        // A lost raise: raise again, and take over again.
        task.on_read(&ReadReply::NotHanded(Some(FenceVerdict::Lower)), design);
        assert_eq!(task.phase, Phase::Raise { after_lower: true });
        task.on_raise(&ScriptReply::Passed(vec![]), design);
        assert_eq!(task.phase, Phase::Claim);
    }

    #[test]
    fn an_unseen_exec_sends_the_task_back_to_its_own_pending_entries() {
        let design = ReadVariant::default();
        let mut task = ShardTask::new(token(1, 5, "a"));
        task.phase = Phase::New;
        // Nothing read for a shard the check did not refuse: it reads alone, then in rounds.
        for nothing in [
            ReadReply::Aborted,
            ReadReply::NotHanded(Some(FenceVerdict::Equal)),
        ] {
            task.on_read(&nothing, design);
            assert_eq!((task.phase, task.read_alone), (Phase::New, true));
            task.on_read_alone(&ScriptReply::Passed(vec![7]), design);
            assert_eq!((task.phase, task.read_alone), (Phase::New, false));
            assert_eq!(task.in_hand.pop_front(), Some(7));
        }
        task.on_read(&ReadReply::Error, design);
        assert_eq!(task.phase, Phase::Pending { after: 0 });
        task.phase = Phase::New;
        task.on_read(&ReadReply::NotHanded(None), design);
        assert_eq!(task.phase, Phase::Pending { after: 0 });
        task.phase = Phase::New;
        task.on_read(&ReadReply::NotHanded(Some(FenceVerdict::Higher)), design);
        assert_eq!(task.phase, Phase::Parked);
        assert!(!task.ready());
    }

    #[test]
    fn a_wait_follows_an_empty_read_and_an_unknown_one_kills_its_connection_first() {
        let design = ReadVariant::default();
        let mut task = ShardTask::new(token(1, 5, "a"));
        task.phase = Phase::New;
        task.on_read(&ReadReply::Handed(vec![]), design);
        assert!(task.wait_next);
        // Served while the lease holds: to the handler; a read by transaction comes next.
        task.on_wait(1, &WaitEnd::Served(vec![4, 5]), true, false, design);
        assert_eq!((task.in_hand.len(), task.wait_next), (2, false));
        task.in_hand.clear();
        task.wait_next = true;
        task.on_wait(2, &WaitEnd::TimedOut, true, true, design);
        assert!(task.wait_next, "a timeout may wait again");
        task.on_wait(3, &WaitEnd::Refused, true, true, design);
        assert_eq!(
            (task.phase, task.wait_next),
            (Phase::New, false),
            "a check first"
        );
        // Served after the lease passed: nothing handed, its own pending entries next.
        task.on_wait(4, &WaitEnd::Served(vec![6]), false, true, design);
        assert_eq!(task.phase, Phase::Pending { after: 0 });
        assert!(task.in_hand.is_empty());
        task.phase = Phase::New;
        task.on_wait(5, &WaitEnd::Lost, true, true, design);
        assert_eq!(task.phase, Phase::KillWait { wait: 5 });
        task.on_kill(&ScriptReply::Error);
        assert_eq!(task.phase, Phase::KillWait { wait: 5 }, "sent again");
        task.on_kill(&ScriptReply::Passed(vec![]));
        assert_eq!(task.phase, Phase::Pending { after: 0 });
    }

    #[test]
    fn a_passed_check_or_gate_read_opens_the_belief_and_any_other_outcome_clears_it() {
        let design = ReadVariant::default();
        let mut task = ShardTask::new(token(1, 5, "a"));
        assert!(!task.gate_open, "a new token starts without it");
        task.phase = Phase::New;
        task.on_read(&ReadReply::Handed(vec![1]), design);
        assert!(task.gate_open);
        task.in_hand.clear();
        task.on_gate_read(&GateReply::Handed(vec![2, 3]), design);
        assert!(task.gate_open && task.in_hand == [2, 3]);
        task.in_hand.clear();
        // Refused: nothing read, the transaction next (not a read alone, not a wait).
        task.on_gate_read(&GateReply::Refused, design);
        assert!(!task.gate_open && !task.read_alone && !task.wait_next);
        assert_eq!(task.phase, Phase::New);
        task.on_read(&ReadReply::Handed(vec![]), design);
        assert!(task.gate_open && task.wait_next);
        task.on_wait(1, &WaitEnd::Served(vec![4]), true, false, design);
        assert!(!task.gate_open, "a wait is another read");
        task.in_hand.clear();
        task.on_read(&ReadReply::Handed(vec![5]), design);
        task.in_hand.clear();
        // Lost: its own pending entries from 0, as after a transaction's lost reply.
        task.on_gate_read(&GateReply::Error, design);
        assert_eq!(
            (task.phase, task.gate_open),
            (Phase::Pending { after: 0 }, false)
        );
        task.phase = Phase::New;
        task.on_read(&ReadReply::Aborted, design);
        assert!(!task.gate_open && task.read_alone);
    }
}
