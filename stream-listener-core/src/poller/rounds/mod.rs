//! Read rounds: on a standalone server, in both fencing modes, the shard tasks of one member
//! that read new entries share one round trip — the plain acks of their previous batches and
//! one multi-stream `XREADGROUP`, in strict mode naming the shards' read gates, or inside a
//! transaction with the fence check until the gates are open ([`crate::dataplane::round`],
//! docs/design.md §8.16) — instead of one round trip
//! per shard (BENCHMARKS.md compares the two).
//!
//! A round reads at most [`MAX_ROUND_ENTRIES`] entries (shards × `batch_size`): the requests
//! beyond it wait, first in line, for the next round.
//!
//! When a round is sent: no round of the member is in flight, and every shard that got entries
//! from the last round has either asked for the next one or stopped holding it up. A shard
//! holds rounds up (it has a [`Turn`]) only while it handles its batch without waiting for
//! anything: its task drops the turn whenever it waits (a handler that does not finish in its
//! first poll, a worker, a backoff, a round trip of its own, the lease, new entries: [`turn`]),
//! and when it ends. So shards whose handlers finish at once move in lockstep, one round trip
//! per round as in the strong raw loop, and a shard that waits never holds its siblings up.
//!
//! Who sends a round (the leader): the shard task whose request completes the rule above sends
//! it itself; when a dropped turn or a finished round completes it, the first queued task is
//! told to lead. Every task waiting in a round gets its own shard's replies, unparsed, and reads
//! them with its own [`crate::dataplane::ShardClient`]. A task cancelled while leading (its
//! member stopped) ends the round for every waiting task, which then decides again.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::oneshot;

use crate::connection::RedisConnection;
use crate::dataplane::round::{PartReply, RoundPart, read_round};
use crate::fence::FenceToken;
use crate::model::ShardIndex;

mod turn;

pub(crate) use turn::{Turn, TurnSlot};

/// The most entries one round may return (its shards × `batch_size`; a round has at least one
/// shard). Redis builds a command's whole reply before it runs anything else, and the member
/// holds it at once: a member behind on hundreds of shards would otherwise read hundreds of
/// batches in one command (512 shards × 500 entries: about 100 MB and a long stall of the server).
pub(crate) const MAX_ROUND_ENTRIES: usize = 4096;

/// Whether the member may use a shard with a token now (owned, lease valid).
pub(crate) type Holds<'a> = dyn Fn(ShardIndex, &FenceToken) -> bool + Sync + 'a;

/// One member's read rounds. Shared by its shard tasks (`ShardTaskContext::rounds`).
pub(crate) struct ReadRounds {
    group: String,
    consumer: String,
    /// Entries per shard per round (`batch_size`).
    count: usize,
    /// The `WAIT` after a round's acks (`min_replica_acks`), if any.
    wait: Option<crate::replication::AckWaits>,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Requests for the next round, in arrival order.
    queued: Vec<Queued>,
    /// Shards holding the next round up (each has a live [`Turn`]).
    expected: Vec<ShardIndex>,
    /// Whether a round is being sent (or a task has been told to send one).
    in_flight: bool,
}

/// One shard's request for the next round.
pub(crate) struct Request {
    pub(crate) shard: ShardIndex,
    /// The token the shard task read under; the leader re-checks it just before sending.
    pub(crate) token: FenceToken,
    pub(crate) part: RoundPart,
}

struct Queued {
    request: Request,
    reply: oneshot::Sender<Reply>,
}

enum Reply {
    /// Send the next round (the round is in flight until the guard is dropped); the request is
    /// queued again with the leader's own channel.
    Lead(Request, InFlight),
    Done(PartReply, Option<Turn>),
    Failed(redis::RedisError),
    /// Not sent: the lease or the assignment changed while it was queued.
    NotSent,
}

/// What became of a request.
pub(crate) enum RoundResult {
    /// The round ran; the shard's replies, and its turn when the read returned entries (hold it
    /// while handling them without waiting, give it back with the next request).
    Done(PartReply, Option<Turn>),
    /// The round's pipeline failed as a whole: nothing is known of what ran.
    Failed(redis::RedisError),
    /// Nothing was sent for this shard (its lease or assignment changed while queued, or the
    /// task sending the round was cancelled): decide again.
    NotSent,
}

impl State {
    /// Whether the next round may go now.
    fn ready(&self) -> bool {
        !self.in_flight && self.expected.is_empty() && !self.queued.is_empty()
    }

    /// When the next round may go: the first `max_parts` queued requests, for the caller to send
    /// (it leads).
    fn start(&mut self, max_parts: usize) -> Option<Vec<Queued>> {
        if !self.ready() {
            return None;
        }
        self.in_flight = true;
        Some(self.take_round(max_parts))
    }

    /// The first `max_parts` queued requests, in arrival order: one round's. The rest wait for
    /// the next round, first in line.
    fn take_round(&mut self, max_parts: usize) -> Vec<Queued> {
        let n = self.queued.len().min(max_parts.max(1));
        self.queued.drain(..n).collect()
    }

    /// When the next round may go: tells the first queued task that is still waiting to send it.
    /// Called under the lock.
    fn hand_off(&mut self, rounds: &Arc<ReadRounds>) {
        if !self.ready() {
            return;
        }
        self.in_flight = true;
        while !self.queued.is_empty() {
            let Queued { request, reply } = self.queued.remove(0);
            let lead = InFlight(Some(rounds.clone()));
            match reply.send(Reply::Lead(request, lead)) {
                Ok(()) => return,
                // That task is gone: its guard must not take the lock we hold.
                Err(Reply::Lead(_, lead)) => lead.defuse(),
                Err(_) => {}
            }
        }
        self.in_flight = false;
    }
}

/// The round in flight: while it lives no other round of the member goes. Dropping it (the
/// round done, or the task sending it cancelled, or told to lead and gone) lets the next go.
struct InFlight(Option<Arc<ReadRounds>>);

impl InFlight {
    /// Drops the guard without taking the lock (the caller holds it and resets `in_flight`).
    fn defuse(mut self) {
        self.0 = None;
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(rounds) = self.0.take() {
            let mut state = rounds.lock();
            state.in_flight = false;
            state.hand_off(&rounds);
        }
    }
}

impl std::fmt::Debug for ReadRounds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadRounds")
            .field("group", &self.group)
            .field("consumer", &self.consumer)
            .field("count", &self.count)
            .finish_non_exhaustive()
    }
}

impl ReadRounds {
    /// Rounds for consumer `consumer` (the member id) of `group`, reading up to `count` entries
    /// per shard on a standalone server.
    pub(crate) fn new(
        group: String,
        consumer: String,
        count: usize,
        wait: Option<crate::replication::AckWaits>,
    ) -> Arc<Self> {
        Arc::new(ReadRounds {
            group,
            consumer,
            count,
            wait,
            state: Mutex::new(State::default()),
        })
    }

    /// The most shards one round reads: [`MAX_ROUND_ENTRIES`] entries at `count` per shard.
    fn max_parts(&self) -> usize {
        (MAX_ROUND_ENTRIES / self.count.max(1)).max(1)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Nothing under this lock can panic halfway through a change that matters.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues `request` for the next round and waits for that round's replies for its shard.
    /// `conn`: the member's data-plane connection, on which this task sends the round when it
    /// leads (every task of the member passes the same one). `turn`: the shard's turn from the
    /// previous round, given back. `holds(shard, token)`: whether the member still owns `shard`
    /// with `token` and its lease is valid; whoever sends the round checks it for each request
    /// just before sending (all requests come from one member, so every task passes the same
    /// check).
    pub(crate) async fn submit(
        self: &Arc<Self>,
        conn: &RedisConnection,
        request: Request,
        turn: Option<Turn>,
        holds: &Holds<'_>,
    ) -> RoundResult {
        let (reply, mut waiting) = oneshot::channel();
        let returned = turn.map(Turn::give_back);
        let lead = {
            let mut state = self.lock();
            if let Some(shard) = returned {
                state.expected.retain(|&s| s != shard);
            }
            state.queued.push(Queued { request, reply });
            state.start(self.max_parts())
        };
        if let Some(round) = lead {
            self.send(conn, round, InFlight(Some(self.clone())), holds)
                .await;
        }
        loop {
            match waiting.await {
                Ok(Reply::Done(reply, turn)) => return RoundResult::Done(reply, turn),
                Ok(Reply::Failed(error)) => return RoundResult::Failed(error),
                Ok(Reply::NotSent) | Err(_) => return RoundResult::NotSent,
                Ok(Reply::Lead(request, in_flight)) => {
                    let (reply, next) = oneshot::channel();
                    waiting = next;
                    let round = {
                        let mut state = self.lock();
                        state.queued.insert(0, Queued { request, reply });
                        state.take_round(self.max_parts())
                    };
                    self.send(conn, round, in_flight, holds).await;
                }
            }
        }
    }

    /// Sends one round (in flight while `in_flight` lives) and hands each waiting task its
    /// replies.
    async fn send(
        self: &Arc<Self>,
        conn: &RedisConnection,
        round: Vec<Queued>,
        in_flight: InFlight,
        holds: &Holds<'_>,
    ) {
        let (sendable, stale): (Vec<Queued>, Vec<Queued>) = round
            .into_iter()
            .partition(|q| !q.reply.is_closed() && holds(q.request.shard, &q.request.token));
        for queued in stale {
            let _ = queued.reply.send(Reply::NotSent);
        }
        if sendable.is_empty() {
            return;
        }
        let mut shards = Vec::with_capacity(sendable.len());
        let mut waiting = Vec::with_capacity(sendable.len());
        let mut parts = Vec::with_capacity(sendable.len());
        for Queued { request, reply } in sendable {
            shards.push(request.shard);
            waiting.push(reply);
            parts.push(request.part);
        }
        let mut conn = conn.clone();
        let replies = read_round(
            &mut conn,
            &self.group,
            &self.consumer,
            self.count,
            parts,
            self.wait.as_ref(),
        )
        .await;
        let replies = match replies {
            Ok(replies) => replies,
            Err(error) => {
                drop(in_flight);
                for reply in waiting {
                    let copy = redis::RedisError::from((
                        error.kind(),
                        "read round failed",
                        error.to_string(),
                    ));
                    let _ = reply.send(Reply::Failed(copy));
                }
                return;
            }
        };
        // Shards that got entries hold the next round up until they ask again (or wait).
        let turns: Vec<Option<Turn>> = {
            let mut state = self.lock();
            let turns = shards
                .iter()
                .zip(&replies)
                .map(|(&shard, reply)| {
                    reply.has_entries().then(|| {
                        state.expected.push(shard);
                        Turn::new(self.clone(), shard)
                    })
                })
                .collect();
            drop(state);
            turns
        };
        drop(in_flight);
        // Not under the lock: a reply that cannot be delivered drops its turn, which locks.
        for ((reply, part), turn) in waiting.into_iter().zip(replies).zip(turns) {
            let _ = reply.send(Reply::Done(part, turn));
        }
    }
}

#[cfg(all(test, feature = "testing"))]
mod fence_tests;
#[cfg(all(test, feature = "testing"))]
mod tests;
