//! The fenced read of new entries by optimistic transaction (docs/design.md §8.2, as the data
//! plane is changing to): one pipeline on one connection, `WATCH <fence keys>`, `EVAL check`,
//! `MULTI`, `XREADGROUP … >`, `EXEC`. Redis runs it in two steps that other clients' commands
//! interleave with: `WATCH` and the check, then, later, the `EXEC`.
//!
//! The check compares each shard's fence field with the member's token. When one is refused it
//! *trips*: it touches a watched key with commands Redis never refuses under `maxmemory`
//! (`PEXPIRE` + `PERSIST` of an existing fence key), so the `EXEC` aborts. A raise by anyone
//! between the `WATCH` and the `EXEC` aborts it as well. When no watched key exists, nothing can
//! be tripped: the check answers `UNFENCED`, the `EXEC` runs, and the member must not hand those
//! entries to its handler. The known-wrong [`ReadVariant`]s bring back the hazards this closes.

use std::collections::BTreeMap;

use super::ReadVariant;
use super::fence_key::FenceKey;
use crate::fence::{FenceToken, FenceVerdict};
use crate::model::ShardIndex;

/// One transaction in a member's pipeline: a round over one or more of its shards.
#[derive(Debug, Clone)]
pub(super) struct ReadTx {
    /// The round's shards, each with the token its task reads under.
    pub(super) shards: Vec<(ShardIndex, FenceToken)>,
    /// The `COUNT` of the `XREADGROUP`.
    pub(super) count: u64,
    pub(super) stage: TxStage,
}

#[derive(Debug, Clone)]
pub(super) enum TxStage {
    /// In the pipeline; Redis has run nothing of it yet.
    Sent,
    /// `WATCH` and the check ran: the fence keys' versions the `WATCH` saw, and the check's reply.
    Watched { versions: Vec<u64>, check: Check },
}

/// The check script's reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Check {
    /// The script ran: each shard's verdict, and `unfenced` when one was refused but no watched
    /// key existed to trip (the `EXEC` will run).
    Ran {
        verdicts: Vec<FenceVerdict>,
        unfenced: bool,
    },
    /// The script did not run, or failed before its tripwire took: `BUSY` (another client's
    /// script ran too long), `NOSCRIPT` (`EVALSHA` on a server that lost its scripts) or `OOM` (a
    /// denyoom tripwire under `maxmemory`). Nothing was tripped, so an `EXEC` that runs reads
    /// unfenced.
    Failed(&'static str),
}

/// What the server is going through while the check runs.
#[derive(Debug, Clone, Copy)]
pub(super) struct Server {
    /// The script cache holds the check (an `EVALSHA` finds it).
    pub(super) scripts_loaded: bool,
    /// `maxmemory` reached with `noeviction`: denyoom commands are refused.
    pub(super) oom: bool,
    /// Another client's script has run past `busy-reply-threshold`: Redis answers `BUSY` to
    /// every script and command but a few (`WATCH` and `MULTI` among them) until it ends.
    pub(super) busy: bool,
}

impl Check {
    /// The shard at `index` of the round passed the check: the member may hand its entries to
    /// its handler (and only then). An `UNFENCED` transaction's entries stay unhandled in the
    /// member's PEL, unless the member follows [`ReadVariant::handle_unfenced`].
    pub(super) fn passed(&self, index: usize, variant: ReadVariant) -> bool {
        match self {
            Check::Ran { verdicts, unfenced } => {
                verdicts.get(index) == Some(&FenceVerdict::Equal)
                    || (*unfenced && variant.handle_unfenced)
            }
            Check::Failed(_) => false,
        }
    }

    /// The shard's verdict, when the script ran.
    pub(super) fn verdict(&self, index: usize) -> Option<FenceVerdict> {
        match self {
            Check::Ran { verdicts, .. } => verdicts.get(index).copied(),
            Check::Failed(_) => None,
        }
    }
}

/// `WATCH` of the round's fence keys: the versions the `EXEC` will compare.
pub(super) fn watch(
    shards: &[(ShardIndex, FenceToken)],
    keys: &BTreeMap<ShardIndex, FenceKey>,
) -> Vec<u64> {
    shards
        .iter()
        .map(|(shard, _)| keys.get(shard).copied().unwrap_or_default().version)
        .collect()
}

/// The check script, run right after the `WATCH`: verdicts, then the tripwire when one shard is
/// refused.
pub(super) fn check(
    shards: &[(ShardIndex, FenceToken)],
    fences: &BTreeMap<ShardIndex, FenceToken>,
    keys: &mut BTreeMap<ShardIndex, FenceKey>,
    server: Server,
    variant: ReadVariant,
) -> Check {
    if server.busy {
        return Check::Failed("BUSY");
    }
    if variant.evalsha_check && !server.scripts_loaded {
        return Check::Failed("NOSCRIPT");
    }
    let verdicts: Vec<FenceVerdict> = shards
        .iter()
        .map(|(shard, token)| token.check(fences.get(shard)))
        .collect();
    let refused = verdicts.iter().position(|v| *v != FenceVerdict::Equal);
    let Some(refused) = refused else {
        return Check::Ran {
            verdicts,
            unfenced: false,
        };
    };
    if variant.denyoom_tripwire {
        // `HSET` of a tombstone field in the refused shard's fence key: it even creates a lost
        // key, but `maxmemory` refuses it, and the script fails with nothing tripped.
        if server.oom {
            return Check::Failed("OOM");
        }
        let key = keys.entry(shards[refused].0).or_default();
        key.other_fields = true;
        key.touch();
        return Check::Ran {
            verdicts,
            unfenced: false,
        };
    }
    // `PEXPIRE` + `PERSIST` of a watched key that exists: never refused, always a write.
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

/// `EXEC`: aborted when a watched key was written since the `WATCH` (by anyone, the check's own
/// tripwire included).
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

    const LOADED: Server = Server {
        scripts_loaded: true,
        oom: false,
        busy: false,
    };

    fn run(
        fence: Option<FenceToken>,
        other_fields: bool,
        server: Server,
        variant: ReadVariant,
    ) -> (Check, bool) {
        let mine = token(1, 5, "a");
        let shards = vec![(0, mine)];
        let fences: BTreeMap<ShardIndex, FenceToken> = fence.into_iter().map(|t| (0, t)).collect();
        let mut keys = BTreeMap::from([(
            0,
            FenceKey {
                version: 7,
                other_fields,
            },
        )]);
        let versions = watch(&shards, &keys);
        let check = check(&shards, &fences, &mut keys, server, variant);
        let aborts = exec_aborts(&shards, &versions, &keys);
        (check, aborts)
    }

    #[test]
    fn a_refused_check_trips_the_exec_and_a_passed_one_does_not() {
        let design = ReadVariant::default();
        let (passed, aborts) = run(Some(token(1, 5, "a")), false, LOADED, design);
        assert!(passed.passed(0, design) && !aborts);
        let (higher, aborts) = run(Some(token(1, 6, "b")), false, LOADED, design);
        assert!(!higher.passed(0, design) && aborts);
        // This group's field lost, another group's still there: the key is tripped.
        let (lower, aborts) = run(None, true, LOADED, design);
        assert_eq!(lower.verdict(0), Some(FenceVerdict::Lower));
        assert!(aborts);
        // Under maxmemory too: PEXPIRE and PERSIST are never refused.
        let oom = Server {
            oom: true,
            ..LOADED
        };
        let (_, aborts) = run(Some(token(1, 6, "b")), false, oom, design);
        assert!(aborts);
    }

    #[test]
    fn a_lost_key_cannot_be_tripped_and_the_entries_are_not_handed_over() {
        let design = ReadVariant::default();
        let (check, aborts) = run(None, false, LOADED, design);
        assert!(!aborts);
        assert_eq!(
            check,
            Check::Ran {
                verdicts: vec![FenceVerdict::Lower],
                unfenced: true
            }
        );
        assert!(!check.passed(0, design));
        assert!(check.passed(0, ReadVariant::with(&["handle_unfenced"])));
    }

    #[test]
    fn noscript_and_a_refused_denyoom_tripwire_let_the_exec_run() {
        let stale = Some(token(1, 6, "b"));
        let flushed = Server {
            scripts_loaded: false,
            ..LOADED
        };
        let evalsha = ReadVariant::with(&["evalsha_check"]);
        assert_eq!(
            run(stale.clone(), false, flushed, evalsha),
            (Check::Failed("NOSCRIPT"), false)
        );
        let oom = Server {
            oom: true,
            ..LOADED
        };
        let denyoom = ReadVariant::with(&["denyoom_tripwire"]);
        assert_eq!(
            run(stale.clone(), false, oom, denyoom),
            (Check::Failed("OOM"), false)
        );
        // Without maxmemory the denyoom tripwire even trips a lost key.
        let (_, aborts) = run(None, false, LOADED, denyoom);
        assert!(aborts);
    }

    #[test]
    fn a_busy_server_runs_no_check_so_nothing_is_tripped() {
        let busy = Server {
            busy: true,
            ..LOADED
        };
        let design = ReadVariant::default();
        let (check, aborts) = run(Some(token(1, 6, "b")), false, busy, design);
        assert_eq!((check, aborts), (Check::Failed("BUSY"), false));
    }
}
