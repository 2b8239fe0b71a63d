//! Combined batches of full heartbeats (docs/design.md §5.7, `store/group/combining.rs`): a
//! heartbeat the fast path does not answer is queued in the group hash, and whichever requester
//! holds the combiner lease applies every queued one with one load, `heartbeat_batch` and one
//! compare-and-set; what the batch cannot apply (refused, stale, needing the fences, unreadable)
//! goes back to its requester's own transition ("solo").
//!
//! With [`Faults::batches`](super::Faults), the scheduler's delivery of a heartbeat whose fast
//! path falls back sometimes queues it with other heartbeats in flight at that moment. Each of
//! them runs its fast path first, as its requester's store does before it queues; those that
//! fall back are queued in a random order that keeps each process's requests in the order it
//! sent them. One queued requester is the combiner: the group is loaded and written with its
//! timings, and its stream view is applied to every request. The answers go back to the members
//! as any reply does (lost, duplicated, late); then the solo requests run their own transitions
//! one after another, exactly as a heartbeat delivered alone. Now and then a queued request or an
//! answer does not read: the request is solo, or applied and then run again by its requester's
//! own transition (which answers it as a retry).
//!
//! Not modelled: a batch whose every compare-and-set lost to concurrent writers stays queued for
//! a later batch, or its requesters give up on it, which is a request delivered late (the
//! messages' faults already); the combiner lease, which only decides who does the work.
//!
//! Checked after each batch, besides every check of a single heartbeat: it answers what its
//! requests' own transitions would, one after another in queue order on the store it loaded, at
//! its instant, and leaves what they would leave (`heartbeat_batch`'s contract); a request
//! repeated within it (a retry, a duplicate) gets its first copy's answer. Where the store's
//! reloads between own transitions make the difference, the batch is counted, not failed
//! ([`World::check_batch`]).

use std::collections::{BTreeMap, VecDeque};

use rand::Rng;

use super::heartbeats::{Fallback, comparable, difference};
use super::store::{Store, applied_view};
use super::{MS, Message, World};
use crate::coordinator::{Context, CoordinatorConfig, Group, StreamView, Transition, heartbeat};
use crate::model::{HeartbeatRequest, HeartbeatResponse};

/// How often a heartbeat the fast path sends on, in the scheduler's delivery, goes to a batch.
const COMBINED: f64 = 0.5;
/// How likely each other heartbeat in flight is to join the batch.
const JOINS: f64 = 0.6;
/// How likely a queued request, or a batch's answer, is not to read.
const UNREADABLE: f64 = 0.03;

/// A queued request with its requester's timings, as the combiner reads it (`None`: it does not
/// read).
type Queued = Option<(HeartbeatRequest, CoordinatorConfig)>;

impl World {
    /// A heartbeat reaches the store while others are in flight (the scheduler's delivery): the
    /// fast path; else, with [`Faults::batches`](super::Faults) sometimes, a combined batch with
    /// others in flight; else its own full transition.
    pub(super) fn deliver_among_others(&mut self, message: Message) -> Result<(), String> {
        let Some(fallback) = self.try_fast_path(message)? else {
            return Ok(());
        };
        if self.faults.batches && self.rng.random_bool(COMBINED) {
            self.combine(fallback)
        } else {
            self.own_transition(fallback)
        }
    }

    /// One batch over `first` and the heartbeats that join it: one load and one write, the
    /// answers back to the members, then the solo requests' own transitions.
    fn combine(&mut self, first: Fallback) -> Result<(), String> {
        let queue = self.queue(first)?;
        let requests = self.stored_requests(&queue);
        let combiner = &queue[self.rng.random_range(0..queue.len())];
        let (config, view) = (combiner.config.clone(), combiner.view.clone());
        let name = combiner.message.request.process_id.clone();
        let current = self.stream.view();
        self.now += 1;
        let before = self.store.clone();
        let answers = self
            .store
            .combined_batch(&requests, &config, &view, &current, self.now);
        self.count_batch(&queue, &answers, &name);
        if !self.faults.effects_only {
            self.check_batch(&before, &queue, &answers, (&config, &view, &current))?;
        }
        let applied: Vec<&HeartbeatRequest> = queue
            .iter()
            .zip(&answers)
            .filter(|(_, answer)| answer.is_some())
            .map(|(fallback, _)| &fallback.message.request)
            .collect();
        self.check_store_change(&before, &applied)?;
        let mut solo = Vec::new();
        for (fallback, answer) in queue.into_iter().zip(answers) {
            match answer {
                Some(response) if !self.rng.random_bool(UNREADABLE) => {
                    self.answered_in_batch(&fallback, response)?;
                }
                // No answer, or one that does not read: its requester's own transition.
                _ => solo.push(fallback),
            }
        }
        self.stats.batch_solo += solo.len() as u64;
        for fallback in solo {
            self.now += 1;
            self.own_transition(fallback)?;
        }
        Ok(())
    }

    /// The batch's queue: `first`, and the other heartbeats in flight that join it, each after
    /// its own fast path (what that answers is not queued), in arrival order.
    fn queue(&mut self, first: Fallback) -> Result<Vec<Fallback>, String> {
        let in_flight = std::mem::take(&mut self.to_coordinator);
        let rng = &mut self.rng;
        let (joining, left): (Vec<Message>, Vec<Message>) =
            in_flight.into_iter().partition(|_| rng.random_bool(JOINS));
        self.to_coordinator = left;
        let senders: Vec<(usize, u64)> = std::iter::once(&first.message)
            .chain(&joining)
            .map(|m| (m.proc, m.request.request_seq))
            .collect();
        let mut first = Some(first);
        let mut joining: Vec<Option<Message>> = joining.into_iter().map(Some).collect();
        let mut queue = Vec::new();
        for i in self.arrival_order(&senders) {
            let fallback = match i.checked_sub(1) {
                None => first.take(),
                Some(j) => match joining[j].take() {
                    Some(message) => self.try_fast_path(message)?,
                    None => None,
                },
            };
            queue.extend(fallback);
        }
        Ok(queue)
    }

    /// A random interleaving of heartbeats given by their senders' process and `requestSeq`, as
    /// indices into `senders`: each process's in the order it sent them (a retry or a duplicate
    /// next to what it repeats). Requests of different processes race to the queue, one
    /// process's follow one another.
    fn arrival_order(&mut self, senders: &[(usize, u64)]) -> Vec<usize> {
        let mut sent: Vec<usize> = (0..senders.len()).collect();
        sent.sort_by_key(|&i| senders[i].1);
        let mut by_proc: BTreeMap<usize, VecDeque<usize>> = BTreeMap::new();
        for i in sent {
            by_proc.entry(senders[i].0).or_default().push_back(i);
        }
        let mut order = Vec::new();
        while !by_proc.is_empty() {
            let nth = self.rng.random_range(0..by_proc.len());
            let Some((&proc, next)) = by_proc.iter_mut().nth(nth) else {
                break;
            };
            order.extend(next.pop_front());
            if next.is_empty() {
                by_proc.remove(&proc);
            }
        }
        order
    }

    /// The queued requests as the combiner reads them: each with its requester's timings, or
    /// now and then `None`, a stored text that does not read (answered solo).
    fn stored_requests(&mut self, queue: &[Fallback]) -> Vec<Queued> {
        queue
            .iter()
            .map(|fallback| {
                let readable = !self.rng.random_bool(UNREADABLE);
                readable.then(|| (fallback.message.request.clone(), fallback.config.clone()))
            })
            .collect()
    }

    /// A request the batch answered: logged, the check of its fallback, and the answer on its
    /// way to the member.
    fn answered_in_batch(
        &mut self,
        fallback: &Fallback,
        response: HeartbeatResponse,
    ) -> Result<(), String> {
        let outcome = Ok(response);
        self.log_answer("batch", &fallback.message.request, &fallback.view, &outcome);
        if !self.faults.effects_only {
            self.check_needless_fallback(fallback)?;
        }
        self.reply(&fallback.message, &fallback.config, outcome)
    }

    /// The batch's counts, and its line of the log.
    fn count_batch(
        &mut self,
        queue: &[Fallback],
        answers: &[Option<HeartbeatResponse>],
        combiner: &str,
    ) {
        self.stats.batches += 1;
        self.stats.batched += queue.len() as u64;
        if queue.len() > 1 {
            self.stats.shared_batches += 1;
        }
        let queued: Vec<String> = queue
            .iter()
            .zip(answers)
            .map(|(fallback, answer)| {
                let request = &fallback.message.request;
                let solo = if answer.is_some() { "" } else { " solo" };
                format!(
                    "{}({}) seq={} epoch={}{solo}",
                    request.member_id,
                    request.process_id,
                    request.request_seq,
                    request.member_epoch
                )
            })
            .collect();
        self.log.push(format!(
            "t={} batch combined by {combiner}: {}",
            self.now / MS,
            queued.join(", ")
        ));
    }

    /// A combined batch answers what its requests' own transitions would, one after another in
    /// queue order on the store it loaded, at its instant and with the view it applied, and
    /// leaves what they would leave: `heartbeat_batch`'s contract, through the model's writes.
    /// The requests it left solo are left out (they run after it), and so are copies: a request
    /// repeated within the batch gets its first copy's answer and is not applied again
    /// (docs/design.md §5.7), as if the copy had been lost and the first answer duplicated.
    /// `combiner` is the combiner's timings, the stream view it read, and the stream metadata
    /// now.
    ///
    /// One difference is the store's, not the batch's: a load does not always give back what the
    /// last write wrote. A write leaves a member's fast-path fields in place while the group is
    /// not STABLE, and also when the member was replaced within it (expired and joined again,
    /// or taken by another process and back: `Writes::diff` deletes them only for a member gone
    /// from the group); a load applies them whenever their process is the member's
    /// (`apply_fast_path_state`), so an older process's `fastseq` and answer come back. Own
    /// transitions reload between requests, a batch does not. A difference that goes when the
    /// same requests run one after another on the group in memory, written once, is that one:
    /// counted and logged, not failed.
    fn check_batch(
        &mut self,
        before: &Store,
        queue: &[Fallback],
        answers: &[Option<HeartbeatResponse>],
        combiner: (&CoordinatorConfig, &StreamView, &StreamView),
    ) -> Result<(), String> {
        let (config, view, current) = combiner;
        let Some(loaded) = before.load(config) else {
            return Ok(());
        };
        let view = applied_view(&loaded, view, current, config);
        let applied = first_copies(queue, answers)?;
        let Some(difference) = self.one_after_another(before, &applied, (config, view)) else {
            return Ok(());
        };
        let ctx = Context {
            now: self.now,
            stream: view,
        };
        if let Some(in_memory) = self.in_memory(before, &loaded, &applied, (config, &ctx)) {
            return Err(format!(
                "{difference}\n  and from the same requests one after another in memory: \
                 {in_memory}"
            ));
        }
        self.stats.batch_reload_differences += 1;
        self.log.push(format!(
            "t={} the batch differs from own transitions only by their reloads: {difference}",
            self.now / MS
        ));
        Ok(())
    }

    /// How the batch's answers and the store it left differ from the `applied` requests' own
    /// transitions one after another on `before`, each with its requester's timings, at the
    /// batch's instant with its `view`; `None` when they do not.
    fn one_after_another(
        &self,
        before: &Store,
        applied: &[(&Fallback, &HeartbeatResponse)],
        (config, view): (&CoordinatorConfig, &StreamView),
    ) -> Option<String> {
        let mut alone = before.clone();
        for (fallback, response) in applied {
            let request = &fallback.message.request;
            let own = alone.full_transition(
                request,
                &fallback.config,
                view,
                view,
                &self.fences,
                self.now,
            );
            if own.as_ref() != Ok(*response) {
                return Some(format!(
                    "a combined batch answered {}({}) seq={} with {response:?}\n  but its own \
                     transition in queue order {own:?}",
                    request.member_id, request.process_id, request.request_seq
                ));
            }
        }
        let batch = comparable(self.store.load(config));
        let own = comparable(alone.load(config));
        (batch != own).then(|| {
            format!(
                "a combined batch left another state than its requests' own transitions: {}",
                difference(batch.as_ref(), own.as_ref())
            )
        })
    }

    /// How the batch's answers and the store it left differ from the `applied` requests run one
    /// after another on the group it loaded, in memory, with one write; `None` when they do not.
    fn in_memory(
        &self,
        before: &Store,
        loaded: &Group,
        applied: &[(&Fallback, &HeartbeatResponse)],
        (config, ctx): (&CoordinatorConfig, &Context<'_>),
    ) -> Option<String> {
        let mut group = loaded.clone();
        for (fallback, response) in applied {
            let request = &fallback.message.request;
            match heartbeat(&mut group, request, ctx, &fallback.config) {
                Ok(Transition::Done(own)) if own == **response => {}
                other => {
                    return Some(format!(
                        "{}({}) seq={} {other:?}",
                        request.member_id, request.process_id, request.request_seq
                    ));
                }
            }
        }
        let mut written = before.clone();
        written.write(loaded, group, config);
        let batch = comparable(self.store.load(config));
        let own = comparable(written.load(config));
        (batch != own).then(|| difference(batch.as_ref(), own.as_ref()))
    }
}

/// The requests the batch applied, in queue order, with their answers: those it answered, but
/// copies (same member, process and `requestSeq` as one answered before), whose answer must be
/// their first copy's.
fn first_copies<'a>(
    queue: &'a [Fallback],
    answers: &'a [Option<HeartbeatResponse>],
) -> Result<Vec<(&'a Fallback, &'a HeartbeatResponse)>, String> {
    let mut firsts: BTreeMap<(&str, &str, u64), &HeartbeatResponse> = BTreeMap::new();
    let mut applied = Vec::new();
    for (fallback, answer) in queue.iter().zip(answers) {
        let Some(response) = answer else {
            continue;
        };
        let request = &fallback.message.request;
        let copy_of = (
            request.member_id.as_str(),
            request.process_id.as_str(),
            request.request_seq,
        );
        match firsts.get(&copy_of) {
            Some(first) if *first != response => {
                return Err(format!(
                    "a combined batch answered a copy of {}({}) seq={} with {response:?}\n  but \
                     its first copy with {first:?}",
                    request.member_id, request.process_id, request.request_seq
                ));
            }
            Some(_) => {}
            None => {
                firsts.insert(copy_of, response);
                applied.push((fallback, response));
            }
        }
    }
    Ok(applied)
}
