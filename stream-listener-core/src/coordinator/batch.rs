//! A batch of heartbeats applied at one instant (docs/design.md §5.7): what the store's combiner
//! runs on the group it loaded.

use std::collections::{BTreeSet, HashMap};

use super::{Context, CoordinatorConfig, Group, Transition, heartbeat};
use crate::model::{HeartbeatRequest, HeartbeatResponse};

/// Applies `requests` in order, each with its requester's timings, to `group` at `ctx.now`: the
/// group after them and one answer per request, `None` for a request the batch leaves to its
/// requester's own transition. Those are the requests that are `None` here already (unreadable
/// as stored), that [`heartbeat`] refuses, and that need the fences ([`Transition::NeedsFences`]):
/// the requester's own transition reports the error or reads the fences.
///
/// The result is what applying the answered requests one after another at `ctx.now` gives, so
/// every rule and invariant of a single heartbeat holds after each of them, with one addition to
/// rule 0 (a retried request gets the stored response): a request repeated within the batch (same
/// member, process and `requestSeq`) gets the answer of its first copy, even when that one made
/// the member leave. A requester whose batch failed to write (a Redis error) may send its request
/// again while the first copy is still queued; it must get the answer the first copy got, not
/// `UNKNOWN_MEMBER_ID` from a member its own leave removed. A refused request may
/// have advanced the group partly ([`heartbeat`]), so the batch then starts again from `group`
/// as given, without it: one clone of the group and one replay per such request, none otherwise.
/// After [`MAX_REPLAYS`] of them every request after the last one refused is left to its
/// requester too, so a batch costs at most `MAX_REPLAYS + 1` passes over its requests, whatever
/// it holds (a replay per refusal would grow with the square of the batch).
/// Replays of a batch at most; see [`heartbeat_batch`].
const MAX_REPLAYS: usize = 4;

pub(crate) fn heartbeat_batch(
    group: &Group,
    requests: &[Option<(HeartbeatRequest, CoordinatorConfig)>],
    ctx: &Context<'_>,
) -> (Group, Vec<Option<HeartbeatResponse>>) {
    let mut left_out: BTreeSet<usize> = requests
        .iter()
        .enumerate()
        .filter(|(_, r)| r.is_none())
        .map(|(i, _)| i)
        .collect();
    let mut replays = 0;
    'replay: loop {
        let mut after = group.clone();
        let mut answers: Vec<Option<HeartbeatResponse>> = Vec::with_capacity(requests.len());
        let mut first_copies: HashMap<(&str, &str, u64), usize> = HashMap::new();
        for (i, queued) in requests.iter().enumerate() {
            let Some((request, config)) = queued.as_ref().filter(|_| !left_out.contains(&i)) else {
                answers.push(None);
                continue;
            };
            let copy_of = (
                request.member_id.as_str(),
                request.process_id.as_str(),
                request.request_seq,
            );
            if let Some(&first) = first_copies.get(&copy_of) {
                answers.push(answers[first].clone());
                continue;
            }
            match heartbeat(&mut after, request, ctx, config) {
                Ok(Transition::Done(response)) => {
                    first_copies.insert(copy_of, i);
                    answers.push(Some(response));
                }
                Ok(Transition::NeedsFences) | Err(_) => {
                    left_out.insert(i);
                    replays += 1;
                    if replays >= MAX_REPLAYS {
                        left_out.extend(i + 1..requests.len());
                    }
                    continue 'replay;
                }
            }
        }
        return (after, answers);
    }
}
