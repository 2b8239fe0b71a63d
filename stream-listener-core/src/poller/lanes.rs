//! Several entries of one shard at once (`ordering = "key"` or `"none"`, docs/design.md §14.3).
//!
//! A batch is split into lanes: with `"key"` one lane per partition key (field `key`, compared
//! as bytes; entries without one share a lane of their own), with `"none"` one lane per entry.
//! A lane runs one entry at a time, in entry order, each through the same per-entry path as
//! `"shard"` ordering ([`ShardTask::handle_entry`]: attempt counting, retries with backoff in
//! place, dead letters, timeouts, panics, the `handle` span, metrics). Up to `max_in_flight`
//! lanes run at once, polled in the shard's own task (no spawn per entry); a free place goes to
//! the ready lane whose next entry is the oldest.
//!
//! The batch ends when every started entry has finished: the next read comes after, so at most
//! `batch_size` entries of a shard are read and unfinished at a time, and everything of one
//! batch is done before a later entry of the same key is read. When one entry is left
//! unfinished (a drain, a stop, the lease's end, a fence refusal) or a Redis call fails, no
//! further entry starts; those running finish; what finished is acked and the rest stays
//! pending (read again from `0`, in entry order, by this task or the next owner).

use std::collections::{BTreeSet, HashMap, VecDeque};

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;

use super::ShardTask;
use super::entries::Outcome;
use crate::dataplane::{DataPlaneError, Fenced, ShardEntry};
use crate::fence::FenceToken;
use crate::handler::field;
use crate::runtime::Ordering;

/// Which entries of one batch may start next: the pure scheduling of the lanes. Entries are
/// named by their index in the batch (entry order).
#[derive(Debug)]
pub(super) struct Lanes {
    /// Each entry's lane.
    lane_of: Vec<usize>,
    /// Each lane's entries not started yet, oldest first.
    waiting: Vec<VecDeque<usize>>,
    /// The next entry of each lane that has one waiting and none running.
    ready: BTreeSet<usize>,
    /// Entries started and not finished.
    running: usize,
    /// The most entries running at once (at least 1).
    max_in_flight: usize,
    /// Whether no further entry may start.
    halted: bool,
}

impl Lanes {
    /// The lanes of a batch whose entries have partition keys `keys` (in entry order; `None`
    /// for an entry without one): one lane per distinct key with [`Ordering::Key`] (the
    /// entries without a key share one), one per entry otherwise. At most `max_in_flight`
    /// (taken as 1 when 0) run at once.
    pub(super) fn new<'a>(
        keys: impl IntoIterator<Item = Option<&'a [u8]>>,
        ordering: Ordering,
        max_in_flight: usize,
    ) -> Self {
        let mut lane_of = Vec::new();
        let mut waiting: Vec<VecDeque<usize>> = Vec::new();
        let mut by_key: HashMap<Option<&[u8]>, usize> = HashMap::new();
        for (index, key) in keys.into_iter().enumerate() {
            let lane = if ordering == Ordering::Key {
                *by_key.entry(key).or_insert(waiting.len())
            } else {
                waiting.len()
            };
            if lane == waiting.len() {
                waiting.push(VecDeque::new());
            }
            waiting[lane].push_back(index);
            lane_of.push(lane);
        }
        let ready = waiting.iter().filter_map(|w| w.front().copied()).collect();
        Lanes {
            lane_of,
            waiting,
            ready,
            running: 0,
            max_in_flight: max_in_flight.max(1),
            halted: false,
        }
    }

    /// The entry to start now, if any: the oldest next entry of a lane with none running,
    /// while fewer than `max_in_flight` run and the lanes are not halted.
    pub(super) fn start_next(&mut self) -> Option<usize> {
        if self.halted || self.running >= self.max_in_flight {
            return None;
        }
        let index = self.ready.pop_first()?;
        self.waiting[self.lane_of[index]].pop_front();
        self.running += 1;
        Some(index)
    }

    /// Entry `index` (started) finished: the next entry of its lane becomes ready.
    pub(super) fn finish(&mut self, index: usize) {
        self.running = self.running.saturating_sub(1);
        if let Some(&next) = self.waiting[self.lane_of[index]].front() {
            self.ready.insert(next);
        }
    }

    /// No further entry starts (those running finish).
    pub(super) fn halt(&mut self) {
        self.halted = true;
    }

    /// Entries started and not finished.
    pub(super) fn running(&self) -> usize {
        self.running
    }
}

impl ShardTask {
    /// [`ShardTask::handle_batch`] with `ordering = "key"` or `"none"`: the batch's entries in
    /// lanes (module docs), acked as `"shard"` ordering acks a batch: when every entry finished,
    /// their ids wait in the ack buffer for the next read's round trip; otherwise what finished
    /// is acked now (in completion order, one fenced `XACK`). Returns whether every entry
    /// finished.
    ///
    /// # Errors
    /// The first Redis failure of an entry (an attempt count or a dead letter), once the
    /// entries running have finished; nothing of the batch is acked then (what finished is
    /// handled again after the shard re-reads its pending entries, as with `"shard"`).
    pub(super) async fn handle_lanes(
        &mut self,
        token: &FenceToken,
        entries: Vec<ShardEntry>,
    ) -> Result<bool, DataPlaneError> {
        let max_in_flight = usize::try_from(self.ctx.options.max_in_flight).unwrap_or(usize::MAX);
        let keys = entries.iter().map(|entry| field(&entry.fields, "key"));
        let mut lanes = Lanes::new(keys, self.ctx.options.ordering, max_in_flight);
        let (finished, complete, fenced, error) = self.run_lanes(token, &entries, &mut lanes).await;
        if let Some((op, fenced)) = fenced {
            self.conflict(op, fenced, token).await;
        }
        if let Some(error) = error {
            return Err(error);
        }
        let finished: Vec<String> = finished
            .into_iter()
            .map(|i| entries[i].id.clone())
            .collect();
        self.settle_read(token, finished, complete).await
    }

    /// Runs the lanes until no entry runs and none may start. Returns the entries finished (to
    /// ack), whether every entry did, the first fence refusal and the first Redis failure.
    async fn run_lanes(
        &self,
        token: &FenceToken,
        entries: &[ShardEntry],
        lanes: &mut Lanes,
    ) -> (
        Vec<usize>,
        bool,
        Option<(&'static str, Fenced)>,
        Option<DataPlaneError>,
    ) {
        let mut finished = Vec::with_capacity(entries.len());
        let mut fenced = None;
        let mut error = None;
        let mut running = FuturesUnordered::new();
        loop {
            // As `"shard"` ordering checks before each entry: nothing starts in a drain, after a
            // stop or without the lease and this token (the entries running may finish).
            // A pause (the member's, or a handler's `pause_shard`) starts nothing more either;
            // what runs finishes, the rest stays pending.
            if self.done() || !self.still_holds(token) || self.paused() {
                lanes.halt();
            }
            while let Some(index) = lanes.start_next() {
                let entry = &entries[index];
                running.push(async move { (index, self.handle_entry(token, entry).await) });
            }
            let Some((index, outcome)) = running.next().await else {
                break;
            };
            lanes.finish(index);
            match outcome {
                Ok(Outcome::Ack) => finished.push(index),
                Ok(Outcome::Abandon) => lanes.halt(),
                Ok(Outcome::Fenced(op, refused)) => {
                    fenced.get_or_insert((op, refused));
                    lanes.halt();
                }
                Err(failed) => {
                    error.get_or_insert(failed);
                    lanes.halt();
                }
            }
        }
        debug_assert_eq!(lanes.running(), 0);
        let complete = finished.len() == entries.len();
        (finished, complete, fenced, error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lanes(keys: &[Option<&str>], ordering: Ordering, max_in_flight: usize) -> Lanes {
        Lanes::new(
            keys.iter().map(|k| k.map(str::as_bytes)),
            ordering,
            max_in_flight,
        )
    }

    fn start_all(lanes: &mut Lanes) -> Vec<usize> {
        std::iter::from_fn(|| lanes.start_next()).collect()
    }

    #[test]
    fn different_keys_start_together_up_to_max_in_flight_oldest_first() {
        let mut l = lanes(
            &[Some("a"), Some("b"), Some("c"), Some("d")],
            Ordering::Key,
            3,
        );
        assert_eq!(start_all(&mut l), vec![0, 1, 2]);
        assert_eq!(l.running(), 3);
        l.finish(1);
        assert_eq!(start_all(&mut l), vec![3]);
    }

    #[test]
    fn one_key_runs_one_entry_at_a_time_in_entry_order() {
        let mut l = lanes(
            &[Some("a"), Some("b"), Some("a"), Some("a"), Some("b")],
            Ordering::Key,
            16,
        );
        assert_eq!(start_all(&mut l), vec![0, 1]);
        l.finish(1);
        assert_eq!(start_all(&mut l), vec![4], "b's next; a's wait for entry 0");
        l.finish(0);
        assert_eq!(start_all(&mut l), vec![2]);
        l.finish(4);
        assert_eq!(start_all(&mut l), Vec::<usize>::new());
        l.finish(2);
        assert_eq!(start_all(&mut l), vec![3]);
        l.finish(3);
        assert_eq!(l.running(), 0);
        assert_eq!(start_all(&mut l), Vec::<usize>::new());
    }

    #[test]
    fn entries_without_a_key_share_one_lane() {
        let mut l = lanes(&[None, Some("a"), None], Ordering::Key, 16);
        assert_eq!(start_all(&mut l), vec![0, 1]);
        l.finish(0);
        assert_eq!(start_all(&mut l), vec![2]);
    }

    #[test]
    fn none_ordering_runs_any_entries_together() {
        let mut l = lanes(&[Some("a"), Some("a"), None, None], Ordering::None, 3);
        assert_eq!(start_all(&mut l), vec![0, 1, 2]);
        l.finish(0);
        assert_eq!(start_all(&mut l), vec![3]);
    }

    #[test]
    fn a_halt_starts_nothing_more_but_running_entries_finish() {
        let mut l = lanes(&[Some("a"), Some("a"), Some("b")], Ordering::Key, 16);
        assert_eq!(start_all(&mut l), vec![0, 2]);
        l.halt();
        l.finish(0);
        assert_eq!(start_all(&mut l), Vec::<usize>::new());
        l.finish(2);
        assert_eq!(l.running(), 0);
    }

    #[test]
    fn a_zero_max_in_flight_is_taken_as_one() {
        let mut l = lanes(&[Some("a"), Some("b")], Ordering::Key, 0);
        assert_eq!(start_all(&mut l), vec![0]);
    }
}
