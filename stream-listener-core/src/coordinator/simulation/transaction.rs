//! The fenced read of new entries (docs/design.md §8.16): one pipeline on one connection,
//! `MULTI`, `EVAL check` (the round's fence keys, its gates and their registries), `XREADGROUP …
//! >` of the round's shards and the first shard's gate, `EXEC`. Redis reaches it in three steps
//! that other clients' commands interleave with: `MULTI` and the queued check, the queued read,
//! the `EXEC`.
//!
//! A command refused while queued (`BUSY` while another client's script runs too long, `OOM` at
//! `maxmemory`) makes the `EXEC` abort, and so does an `EXEC` refused for `BUSY`: nothing runs.
//! Otherwise the `EXEC` runs the check and the read back to back. The check compares each
//! shard's fence field with the member's token: when every one holds it, the check makes sure
//! the gate of every shard of the round for its token exists (`gates.rs`), creating the missing
//! ones (a deny-oom write, refused at `maxmemory`: `NOGATE`, nothing created); on any refusal it
//! deletes them all (`DEL`, never refused). The read names the first shard's gate, so it fails
//! as a whole (`NOGROUP`) whenever that gate is missing; the others are the gates the shards'
//! blocking waits name (`wait.rs`).
//!
//! The known-wrong [`ReadVariant`]s bring back the hazards this closes, the previous order of the
//! pipeline among them ([`ReadVariant::check_outside_transaction`]: `WATCH`, the check with its
//! tripwire, then `MULTI`, the read, `EXEC`), which this module models too.

use std::collections::BTreeMap;

use super::ReadVariant;
use super::fence_key::FenceKey;
use super::gates::{GateKey, Gates};
use crate::fence::{FenceToken, FenceVerdict};
use crate::model::ShardIndex;

/// One transaction in a member's pipeline: a round over one or more of its shards.
#[derive(Debug, Clone)]
pub(super) struct ReadTx {
    /// The round's shards, each with the token its task reads under. The first one's gate is
    /// the one the read names.
    pub(super) shards: Vec<(ShardIndex, FenceToken)>,
    /// The `COUNT` of the `XREADGROUP`.
    pub(super) count: u64,
    pub(super) stage: TxStage,
}

#[derive(Debug, Clone)]
pub(super) enum TxStage {
    /// In the pipeline; Redis has run nothing of it yet.
    Sent,
    /// `MULTI` and the check's `EVAL` reached Redis: queued, or refused while queued (`BUSY`,
    /// `OOM`), which dooms the `EXEC`.
    CheckQueued { refused: Option<&'static str> },
    /// The `XREADGROUP` reached Redis too: queued, or refused (or the check was).
    ReadQueued { refused: Option<&'static str> },
    /// [`ReadVariant::check_outside_transaction`]: `WATCH` and the check ran, outside the
    /// transaction: the fence keys' versions the `WATCH` saw, and the check's reply. `MULTI`, the
    /// read and `EXEC` reach Redis in one more step.
    Watched { versions: Vec<u64>, check: Check },
}

/// The check script's reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Check {
    /// The script ran: each shard's verdict. `unfenced` only in the check outside the
    /// transaction: one was refused, but no watched key existed to trip (its `EXEC` runs).
    Ran {
        verdicts: Vec<FenceVerdict>,
        unfenced: bool,
    },
    /// Every verdict was `EQUAL`, but a gate of the round was missing and its creation was
    /// refused (`OOM`, the script's first write): nothing was created. The read fails (nothing
    /// read, fail closed) when it was the first shard's gate; else it runs, and the poller takes
    /// the reply for an error.
    NoGate,
    /// The script did not run, or failed before it could stop the read: `NOSCRIPT` (`EVALSHA` on
    /// a server that lost its scripts), `OOM` (the gate closed with a deny-oom write at
    /// `maxmemory`), `BUSY` (the check sent outside the transaction while another client's script
    /// ran too long). Nothing stopped the read.
    Failed(&'static str),
}

/// What the server is going through while the check runs.
#[derive(Debug, Clone, Copy)]
pub(super) struct Server {
    /// The script cache holds the check (an `EVALSHA` finds it).
    pub(super) scripts_loaded: bool,
    /// `maxmemory` reached with `noeviction`: deny-oom commands, and every command queued in a
    /// transaction, are refused.
    pub(super) oom: bool,
    /// Another client's script has run past `busy-reply-threshold`: Redis answers `BUSY` to
    /// every script and command but a few (`WATCH` and `MULTI` among them) until it ends.
    pub(super) busy: bool,
}

impl Check {
    /// Whether every shard of the round passed the check: the member may hand the entries read
    /// to its handlers (and only then).
    pub(super) fn passed(&self) -> bool {
        matches!(self, Check::Ran { verdicts, .. }
            if verdicts.iter().all(|v| *v == FenceVerdict::Equal))
    }

    /// The shard's verdict, when the script ran.
    pub(super) fn verdict(&self, index: usize) -> Option<FenceVerdict> {
        match self {
            Check::Ran { verdicts, .. } => verdicts.get(index).copied(),
            Check::NoGate | Check::Failed(_) => None,
        }
    }
}

/// The check inside the transaction, run by the `EXEC` right before the read. Every verdict
/// `EQUAL`: the round's missing gates are created (at `maxmemory` none is, and a missing first
/// gate, the one the read names, is [`Check::NoGate`]); any refusal deletes every gate of the
/// round.
pub(super) fn check_in_exec(
    shards: &[(ShardIndex, FenceToken)],
    fences: &BTreeMap<ShardIndex, FenceToken>,
    gates: &mut Gates,
    server: Server,
    variant: ReadVariant,
) -> Check {
    if variant.evalsha_check && !server.scripts_loaded {
        return Check::Failed("NOSCRIPT");
    }
    let verdicts: Vec<FenceVerdict> = shards
        .iter()
        .map(|(shard, token)| token.check(fences.get(shard)))
        .collect();
    let ran = Check::Ran {
        verdicts,
        unfenced: false,
    };
    if variant.no_gate {
        return ran;
    }
    let keys: Vec<GateKey> = shards
        .iter()
        .map(|(shard, token)| Gates::key(*shard, token, variant))
        .collect();
    if ran.passed() {
        if server.oom {
            // Every missing gate's `SADD` would be the script's first write: refused. Only the
            // first gate, which the read names, fails the check; the others only fail their
            // shards' waits (the runtime's `check_fences`).
            if !gates.is_open(&keys[0]) {
                return Check::NoGate;
            }
            return ran;
        }
        for key in keys {
            if !gates.is_open(&key) {
                gates.open(key);
            }
        }
    } else {
        if variant.denyoom_gate && server.oom {
            // The script's first write, deny-oom, refused at maxmemory: it fails, the gates
            // stay as they were.
            return Check::Failed("OOM");
        }
        for key in &keys {
            gates.close(key);
        }
    }
    ran
}

/// Whether the read after the check runs: the gate it names (the first shard's, `first`) exists
/// (a read without a gate, in [`ReadVariant::no_gate`], always runs).
pub(super) fn read_runs(gates: &Gates, first: &GateKey, variant: ReadVariant) -> bool {
    gates.is_open(first) || variant.no_gate
}

/// `WATCH` of the round's fence keys (the check outside the transaction): the versions the
/// `EXEC` will compare.
pub(super) fn watch(
    shards: &[(ShardIndex, FenceToken)],
    keys: &BTreeMap<ShardIndex, FenceKey>,
) -> Vec<u64> {
    shards
        .iter()
        .map(|(shard, _)| keys.get(shard).copied().unwrap_or_default().version)
        .collect()
}

/// The check outside the transaction ([`ReadVariant::check_outside_transaction`]), run right
/// after the `WATCH`: verdicts, then the tripwire when one shard is refused (`PEXPIRE` +
/// `PERSIST` of a watched key that exists: never refused, always a write). Refused with `BUSY`
/// while another client's script runs: nothing is tripped.
pub(super) fn check_before_transaction(
    shards: &[(ShardIndex, FenceToken)],
    fences: &BTreeMap<ShardIndex, FenceToken>,
    keys: &mut BTreeMap<ShardIndex, FenceKey>,
    server: Server,
) -> Check {
    if server.busy {
        return Check::Failed("BUSY");
    }
    let verdicts: Vec<FenceVerdict> = shards
        .iter()
        .map(|(shard, token)| token.check(fences.get(shard)))
        .collect();
    if verdicts.iter().all(|v| *v == FenceVerdict::Equal) {
        return Check::Ran {
            verdicts,
            unfenced: false,
        };
    }
    let existing = shards.iter().find(|(shard, _)| {
        keys.get(shard)
            .copied()
            .unwrap_or_default()
            .exists(fences.get(shard))
    });
    match existing {
        Some((shard, _)) => {
            keys.entry(*shard).or_default().touch();
            Check::Ran {
                verdicts,
                unfenced: false,
            }
        }
        None => Check::Ran {
            verdicts,
            unfenced: true,
        },
    }
}

/// `EXEC` after a `WATCH`: aborted when a watched key was written since (by anyone, the check's
/// own tripwire included).
pub(super) fn exec_aborts(
    shards: &[(ShardIndex, FenceToken)],
    watched: &[u64],
    keys: &BTreeMap<ShardIndex, FenceKey>,
) -> bool {
    watch(shards, keys) != watched
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::fixtures::fence_token as token;

    const CALM: Server = Server {
        scripts_loaded: true,
        oom: false,
        busy: false,
    };

    /// The check inside the transaction with the fence holding `fence`, against token (1, 5):
    /// its reply, and whether the gate is open after it and the read runs.
    fn run(
        fence: Option<FenceToken>,
        gate_open: bool,
        server: Server,
        variant: ReadVariant,
    ) -> (Check, bool) {
        let shards = vec![(0, token(1, 5, "a"))];
        let fences: BTreeMap<ShardIndex, FenceToken> = fence.into_iter().map(|t| (0, t)).collect();
        let key = Gates::key(0, &shards[0].1, variant);
        let mut gates = Gates::default();
        if gate_open {
            gates.open(key.clone());
        }
        let check = check_in_exec(&shards, &fences, &mut gates, server, variant);
        (check, read_runs(&gates, &key, variant))
    }

    fn ran(verdict: FenceVerdict) -> Check {
        Check::Ran {
            verdicts: vec![verdict],
            unfenced: false,
        }
    }

    #[test]
    fn a_passed_check_opens_the_gate_and_a_refused_one_closes_it() {
        let design = ReadVariant::default();
        let mine = Some(token(1, 5, "a"));
        for open in [false, true] {
            let (check, read) = run(mine.clone(), open, CALM, design);
            assert!(check.passed() && read, "gate open before: {open}");
        }
        let (check, read) = run(Some(token(1, 6, "b")), true, CALM, design);
        assert_eq!((check, read), (ran(FenceVerdict::Higher), false));
        // Every fence lost: LOWER, and the gate closes like on any refusal.
        let (check, read) = run(None, true, CALM, design);
        assert_eq!((check, read), (ran(FenceVerdict::Lower), false));
    }

    #[test]
    fn a_round_opens_or_closes_the_gate_of_each_of_its_shards_for_its_token() {
        let design = ReadVariant::default();
        let shards = vec![(0, token(1, 5, "a")), (1, token(1, 5, "a"))];
        let keys: Vec<GateKey> = shards
            .iter()
            .map(|(s, t)| Gates::key(*s, t, design))
            .collect();
        let mut fences: BTreeMap<ShardIndex, FenceToken> = shards.iter().cloned().collect();
        let mut gates = Gates::default();
        let check = check_in_exec(&shards, &fences, &mut gates, CALM, design);
        assert!(check.passed() && keys.iter().all(|k| gates.is_open(k)));
        // At maxmemory a missing second gate is not created, but only the first one, which the
        // read names, fails the check: the read runs and is handed out.
        gates.close(&keys[1]);
        let oom = Server { oom: true, ..CALM };
        let check = check_in_exec(&shards, &fences, &mut gates, oom, design);
        assert!(check.passed(), "{check:?}");
        assert!(read_runs(&gates, &keys[0], design) && !gates.is_open(&keys[1]));
        gates.close(&keys[0]);
        let check = check_in_exec(&shards, &fences, &mut gates, oom, design);
        assert_eq!(check, Check::NoGate);
        assert!(!read_runs(&gates, &keys[0], design));
        // One shard refused: every gate of the round closes.
        fences.insert(1, token(1, 6, "b"));
        gates.open(keys[1].clone());
        let check = check_in_exec(&shards, &fences, &mut gates, CALM, design);
        assert_eq!(check.verdict(1), Some(FenceVerdict::Higher));
        assert!(keys.iter().all(|k| !gates.is_open(k)));
    }

    #[test]
    fn at_maxmemory_a_refusal_still_closes_the_gate_and_a_missing_gate_fails_closed() {
        let design = ReadVariant::default();
        let oom = Server { oom: true, ..CALM };
        let (check, read) = run(Some(token(1, 6, "b")), true, oom, design);
        assert_eq!((check, read), (ran(FenceVerdict::Higher), false), "DEL");
        let (check, read) = run(Some(token(1, 5, "a")), false, oom, design);
        assert_eq!((check, read), (Check::NoGate, false), "no XGROUP CREATE");
        let (check, read) = run(Some(token(1, 5, "a")), true, oom, design);
        assert!(check.passed() && read, "an open gate needs no write");
    }

    #[test]
    fn the_known_wrong_rules_let_a_refused_read_run() {
        let stale = Some(token(1, 6, "b"));
        let flushed = Server {
            scripts_loaded: false,
            ..CALM
        };
        let evalsha = ReadVariant::with(&["evalsha_check"]);
        assert_eq!(
            run(stale.clone(), true, flushed, evalsha),
            (Check::Failed("NOSCRIPT"), true)
        );
        let oom = Server { oom: true, ..CALM };
        let denyoom = ReadVariant::with(&["denyoom_gate"]);
        assert_eq!(
            run(stale.clone(), true, oom, denyoom),
            (Check::Failed("OOM"), true)
        );
        let no_gate = ReadVariant::with(&["no_gate"]);
        assert_eq!(
            run(stale, false, CALM, no_gate),
            (ran(FenceVerdict::Higher), true)
        );
    }

    #[test]
    fn outside_the_transaction_a_busy_server_runs_no_check_so_nothing_is_tripped() {
        let shards = vec![(0, token(1, 5, "a"))];
        let fences = BTreeMap::from([(0, token(1, 6, "b"))]);
        let mut keys = BTreeMap::from([(
            0,
            FenceKey {
                version: 7,
                other_fields: false,
            },
        )]);
        let versions = watch(&shards, &keys);
        let busy = Server { busy: true, ..CALM };
        let check = check_before_transaction(&shards, &fences, &mut keys, busy);
        assert_eq!(check, Check::Failed("BUSY"));
        assert!(
            !exec_aborts(&shards, &versions, &keys),
            "the EXEC would run"
        );
        let check = check_before_transaction(&shards, &fences, &mut keys, CALM);
        assert_eq!(check.verdict(0), Some(FenceVerdict::Higher));
        assert!(exec_aborts(&shards, &versions, &keys), "tripped");
    }
}
