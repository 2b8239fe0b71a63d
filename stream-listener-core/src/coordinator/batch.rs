//! A batch of heartbeats applied at one instant (docs/design.md §5.7): what the store's combiner
//! runs on the group it loaded.

use std::collections::BTreeSet;

use super::{Context, CoordinatorConfig, Group, Transition, heartbeat};
use crate::model::{HeartbeatRequest, HeartbeatResponse};

/// Applies `requests` in order, each with its requester's timings, to `group` at `ctx.now`: the
/// group after them and one answer per request, `None` for a request the batch leaves to its
/// requester's own transition. Those are the requests that are `None` here already (unreadable
/// as stored), that [`heartbeat`] refuses, and that need the fences ([`Transition::NeedsFences`]):
/// the requester's own transition reports the error or reads the fences.
///
/// The result is what applying the answered requests one after another at `ctx.now` gives, so
/// every rule and invariant of a single heartbeat holds after each of them. A refused request may
/// have advanced the group partly ([`heartbeat`]), so the batch then starts again from `group`
/// as given, without it: one clone of the group per such request, none otherwise.
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
    'replay: loop {
        let mut after = group.clone();
        let mut answers = Vec::with_capacity(requests.len());
        for (i, queued) in requests.iter().enumerate() {
            let Some((request, config)) = queued.as_ref().filter(|_| !left_out.contains(&i)) else {
                answers.push(None);
                continue;
            };
            match heartbeat(&mut after, request, ctx, config) {
                Ok(Transition::Done(response)) => answers.push(Some(response)),
                Ok(Transition::NeedsFences) | Err(_) => {
                    left_out.insert(i);
                    continue 'replay;
                }
            }
        }
        return (after, answers);
    }
}
