//! [`SharedWait`]: one blocking `XREAD` per member over all of its caught-up shards
//! (docs/design.md §8.4).
//!
//! A shard task whose read of new entries found none waits for the next entry. With a blocking
//! command per shard, a member owning 512 shards would hold 512 connections. Here every shard
//! task of a member registers its shard key and last id with the member's shared wait (a
//! [`WaitSlot`]), and one driver task blocks in `XREAD BLOCK <block> STREAMS <all keys> <ids>`
//! on one connection of its own ([`super::Waiter`]); when Redis answers, the woken shards' tasks
//! read.
//!
//! - **Adding a shard to a wait in flight.** A shard that registers (or registers a new id) while
//!   the `XREAD` blocks is not covered by it. The driver then interrupts the `XREAD` with
//!   `CLIENT UNBLOCK <id>` sent on the member's control connection (the blocked command answers
//!   as if it timed out) and blocks again over the new set. `CLIENT UNBLOCK` answers 0 when the
//!   `XREAD` has not reached the server yet (the two connections are not ordered): the driver
//!   asks again, backing off, until it answers 1 or the `XREAD` returns. When the interrupt
//!   fails (refused, or a second of zeros), the driver drops the blocking connection (which frees
//!   the `XREAD` on the server) and blocks again on a new one. Ids make all this free of races:
//!   an entry that arrives between two `XREAD`s is after the id the next one waits from, so that
//!   one answers at once.
//! - **A wait that times out** ends only the shard task's own wait (its block, its lease): the
//!   key stays in the shared `XREAD` with the same id, and the task registers again without a
//!   read and without interrupting anything. An idle member sends one `XREAD` per block time.
//! - **A shard that leaves** (revoked, stopped: its [`WaitSlot`] is dropped) leaves the `XREAD`
//!   at once: the driver interrupts it and blocks again without the key.
//! - **An error** (the connection failed, a paused server past the response timeout) wakes every
//!   shard of the failed `XREAD` (a wake may have been lost: each reads once), and the driver
//!   pauses before it connects again.
//!
//! On Redis Cluster one `XREAD` covers the keys of one hash slot only, and each shard is its own
//! slot (docs/design.md §2, §8.4). There the driver listens to keyspace notifications instead
//! ([`keyspace`]): one subscription per master to the channels of the member's shards, an
//! `xadd` event wakes its shard. When the
//! servers do not publish them (`notify-keyspace-events` without `K` and `t`, or no permission),
//! or while a subscription is down, [`WaitSlot::wait`] answers [`WaitEnd::Unavailable`] and the
//! shard task waits on a connection of its own.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::error::DataPlaneError;
use super::waiter::Waiter;
use crate::connection::{RedisConnection, RedisTarget};

/// Pause of the driver after a failed wait or connect (no hot loop while Redis is down).
const ERROR_PAUSE: Duration = Duration::from_millis(500);

/// First and longest pause between two `CLIENT UNBLOCK`s that found the `XREAD` not blocked yet.
const UNBLOCK_RETRY_FIRST: Duration = Duration::from_millis(1);
const UNBLOCK_RETRY_MOST: Duration = Duration::from_millis(64);

/// How a [`WaitSlot::wait`] ended.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum WaitEnd {
    /// The shard may have new entries after the id waited from: read. Also after a failed wait
    /// (a wake may have been lost) and when the member's wait is shutting down.
    Woken,
    /// The block time passed without an entry: nothing new after the id, wait again from it.
    TimedOut,
    /// Cluster only: the keyspace notifications are not available now; wait another way (the
    /// shard's own `XREAD BLOCK`).
    Unavailable,
    /// Only for [`WaitSlot::wait_reading`]: the strict wait read these entries of the shard into
    /// the member's PEL through the shard's gate, so while the fence held the member's token
    /// (docs/design.md §8.16), now or while the task was not waiting. Shaped as a one-stream
    /// `XREADGROUP` reply, `[[key, entries]]`.
    Delivered(redis::Value),
    /// Only for [`WaitSlot::wait_reading`]: a strict wait lost its reply, so it may have read
    /// entries of the shard that no task received: read this consumer's pending entries from
    /// the start before new ones.
    ReadPending,
}

/// What [`WaitSlot::settle`] found that the strict wait read for the shard.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Settled {
    /// Nothing the task has not received.
    Clear,
    /// Entries read while the task was not waiting (a one-stream `XREADGROUP` reply, as
    /// [`WaitEnd::Delivered`]): handle them before reading on.
    Stashed(redis::Value),
    /// A wait lost its reply: read the pending entries first.
    ReadPending,
}

/// What the strict wait reads with (docs/design.md §8.4): the member's consumer group, its
/// consumer name and the most entries per shard (the listener's `batch_size`).
#[derive(Debug, Clone)]
pub(crate) struct GroupRead {
    /// The consumer group.
    pub(crate) group: String,
    /// The member's consumer name.
    pub(crate) consumer: String,
    /// `COUNT`: the most entries read per shard.
    pub(crate) count: usize,
}

/// How the driver learns of new entries.
#[derive(Debug, Clone)]
pub(crate) enum WakeSource {
    /// One `XREAD BLOCK` over every waiting shard (standalone server, Sentinel master).
    Xread,
    /// Keyspace notifications of the registered shard streams from every master of a cluster
    /// ([`keyspace`]).
    Keyspace,
}

/// A member's shared wait for new entries: its driver task (started on the first wait) and the
/// shards registered with it. Dropping it stops the driver.
pub(crate) struct SharedWait {
    inner: Arc<Inner>,
    stop: CancellationToken,
}

impl std::fmt::Debug for SharedWait {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedWait").finish_non_exhaustive()
    }
}

struct Inner {
    source: WakeSource,
    /// Set in strict mode on a standalone server or Sentinel: waits that name a gate read what
    /// they wait for ([`WaitSlot::wait_reading`]).
    group_read: Option<GroupRead>,
    /// Where the driver's own connections go.
    target: RedisTarget,
    /// The member's control connection: `CLIENT UNBLOCK` goes here (never the blocked one).
    control: RedisConnection,
    /// The longest block (the listener's `block`).
    max_block: Duration,
    state: Mutex<State>,
    /// Wakes the driver: a shard registered, left, or asked for an earlier deadline.
    changed: Notify,
    /// Notified (all waiters) when a blocking command has returned and its result was handed
    /// out: what [`WaitSlot::settle`] waits for.
    returned: Notify,
    stop: CancellationToken,
    /// The span the driver logs in.
    span: tracing::Span,
}

#[derive(Default)]
struct State {
    next_slot: u64,
    /// Per registered shard task.
    watches: HashMap<u64, Watch>,
    driver_started: bool,
    /// The keys of the `XREAD` (or strict `XREADGROUP`) in flight (empty between two).
    blocked: Vec<String>,
    /// The command in flight is the strict `XREADGROUP`: it reads the shards it names.
    reading: bool,
    /// Keyspace notifications: whether every master's subscription is up.
    available: bool,
    /// Keyspace notifications: the last subscription generation handed out, and each shard key's
    /// (set when its channel's subscription was confirmed on every master; absent while it is
    /// not subscribed). A watch reads once under each generation of its key: its last read may
    /// have come before the subscription, so an entry since may have gone unnoticed.
    generation: u64,
    key_generations: HashMap<String, u64>,
    /// Bumped by every registration, drop of one, and change of a watch's `busy`: the keyspace
    /// driver follows the listening keys with its channels only when it moved.
    registry_version: u64,
    /// Keyspace notifications: the driver has tried to subscribe at least once (before that a
    /// task waits for the first attempt instead of waiting another way).
    tried: bool,
}

/// One shard task's registration.
struct Watch {
    key: String,
    /// The last entry id the task has seen: the `XREAD` waits for entries after it. `None`
    /// until the task's first wait.
    last_id: Option<String>,
    /// An `XREAD` answered for the key since `last_id` was set: out of the next `XREAD` until
    /// the task registers a new id (it reads first).
    woken: bool,
    /// The task blocked in [`WaitSlot::wait`] now, if any.
    waiter: Option<Pending>,
    /// The shard's read gate for the task's token, when its last wait was
    /// [`WaitSlot::wait_reading`]: the driver reads only when every wanted shard has one.
    gate: Option<String>,
    /// A strict wait read entries of the shard while its task was not waiting, or failed
    /// without a reply: the task's next wait answers [`WaitEnd::ReadPending`].
    unread: bool,
    /// What a strict wait read for the shard while its task was not waiting: handed to the
    /// task's next wait or settle, so that it is handled as read, without a re-read from the
    /// PEL (which would count a second delivery, docs/design.md §8.9).
    stash: Option<redis::Value>,
    /// The task reads the shard itself ([`WaitSlot::settle`]): out of every blocking command
    /// until it waits again.
    withdrawn: bool,
    /// The subscription generation of its key this watch has read under (keyspace
    /// notifications).
    generation: u64,
    /// Keyspace notifications: an event came while the task was not waiting (it was reading or
    /// handling), so the shard is busy and its channel is unsubscribed until the task waits
    /// again: a busy shard's entries then send no event each.
    busy: bool,
}

struct Pending {
    deadline: Instant,
    done: oneshot::Sender<WaitEnd>,
}

impl SharedWait {
    /// A shared wait woken by `source`. With [`WakeSource::Xread`] its driver blocks on a
    /// connection of its own to `target`, for up to `max_block` per `XREAD` (the listener's
    /// `block`), and interrupts it with `CLIENT UNBLOCK` on `control`; with
    /// [`WakeSource::Keyspace`] it subscribes on every master `control` names. Nothing is
    /// connected or spawned before the first [`WaitSlot::wait`]; the driver logs in `span` (the
    /// member's stream, group and member id).
    pub(crate) fn new(
        source: WakeSource,
        target: RedisTarget,
        control: RedisConnection,
        max_block: Duration,
        span: tracing::Span,
    ) -> Self {
        let stop = CancellationToken::new();
        let inner = Arc::new(Inner {
            source,
            group_read: None,
            target,
            control,
            max_block: max_block.max(Duration::from_millis(1)),
            state: Mutex::default(),
            changed: Notify::new(),
            returned: Notify::new(),
            stop: stop.clone(),
            span,
        });
        SharedWait { inner, stop }
    }

    /// The same wait, whose [`WaitSlot::wait_reading`] reads what it waits for with `read`
    /// (strict mode on a standalone server or Sentinel; ignored with keyspace notifications).
    /// Call before the first registration.
    pub(crate) fn with_group_read(mut self, read: GroupRead) -> Self {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.group_read = Some(read);
        }
        self
    }

    /// Registers the shard stream `key` (one registration per shard task; dropping it leaves
    /// the wait).
    pub(crate) fn register(&self, key: String) -> WaitSlot {
        let mut state = self.inner.lock();
        let slot = state.next_slot;
        state.next_slot += 1;
        state.registry_version += 1;
        state.watches.insert(
            slot,
            Watch {
                key,
                last_id: None,
                woken: false,
                waiter: None,
                gate: None,
                unread: false,
                stash: None,
                withdrawn: false,
                generation: 0,
                busy: false,
            },
        );
        WaitSlot {
            inner: self.inner.clone(),
            slot,
        }
    }
}

#[cfg(test)]
impl SharedWait {
    /// The keys of the `XREAD` in flight, sorted.
    fn blocked(&self) -> Vec<String> {
        self.inner.lock().blocked.clone()
    }
}

impl Drop for SharedWait {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// One shard task's place in its member's [`SharedWait`].
pub(crate) struct WaitSlot {
    inner: Arc<Inner>,
    slot: u64,
}

impl std::fmt::Debug for WaitSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WaitSlot")
            .field("slot", &self.slot)
            .finish_non_exhaustive()
    }
}

impl WaitSlot {
    /// Waits until the shard may have an entry after `last_id` ([`WaitEnd::Woken`]) or `block`
    /// passes ([`WaitEnd::TimedOut`]). Cancel-safe: dropping the future ends this task's wait,
    /// and the key stays in the shared `XREAD` until the next wait or the slot's drop. Never an
    /// error: a failed shared wait answers [`WaitEnd::Woken`] (the read that follows reports
    /// what is wrong).
    pub(crate) async fn wait(&self, last_id: &str, block: Duration) -> WaitEnd {
        self.wait_with(last_id, None, block).await
    }

    /// The strict wait (docs/design.md §8.4, §8.16): as [`WaitSlot::wait`], but where the
    /// member's wait reads ([`SharedWait::with_group_read`], no keyspace notifications) and every
    /// waiting shard names its gate, the driver blocks in one `XREADGROUP` over the gates and the
    /// shards ([`super::Waiter::read_group`]) instead of an `XREAD`, and the entries it reads
    /// come back as [`WaitEnd::Delivered`], without a read after the wake. `gate` is the shard's
    /// read gate for the token the task holds, opened by the task's last passing fence check.
    /// Also answers [`WaitEnd::ReadPending`] (see there). A wait that failed on a missing or
    /// deleted gate read nothing and answers [`WaitEnd::Woken`]: the read that follows checks
    /// the fence and opens the gate again.
    pub(crate) async fn wait_reading(&self, last_id: &str, gate: &str, block: Duration) -> WaitEnd {
        self.wait_with(last_id, Some(gate), block).await
    }

    /// Takes the shard out of the member's strict wait before its task reads the shard itself
    /// (new entries or its own pending ones), so that the two never read it at once (the
    /// task's `>` read could get later entries than the wait, and handle them first): when a
    /// strict `XREADGROUP` in flight names the shard (the task's own wait timed out, the key
    /// stayed in it), interrupts it and waits until it returned and what it read was handed
    /// out. Then answers what the wait read for the shard that its task has not received:
    /// [`Settled::Stashed`] (handle these first), [`Settled::ReadPending`] (a wait lost its
    /// reply: read the pending entries first), or [`Settled::Clear`]. The shard stays out of the
    /// wait until its task waits again. Answers `Clear` at once without a strict wait (acks mode,
    /// keyspace notifications).
    pub(crate) async fn settle(&self) -> Settled {
        let strict =
            self.inner.group_read.is_some() && matches!(self.inner.source, WakeSource::Xread);
        if !strict {
            return Settled::Clear;
        }
        loop {
            let returned = self.inner.returned.notified();
            tokio::pin!(returned);
            returned.as_mut().enable();
            {
                let mut state = self.inner.lock();
                let in_flight = state.reading;
                let blocked = state.blocked.clone();
                let Some(watch) = state.watches.get_mut(&self.slot) else {
                    return Settled::Clear;
                };
                // Out of every command computed from now on.
                watch.withdrawn = true;
                if !in_flight || !blocked.contains(&watch.key) {
                    let stash = watch.stash.take();
                    if std::mem::take(&mut watch.unread) {
                        return Settled::ReadPending;
                    }
                    return stash.map_or(Settled::Clear, Settled::Stashed);
                }
            }
            self.inner.changed.notify_one();
            returned.await;
        }
    }

    async fn wait_with(&self, last_id: &str, gate: Option<&str>, block: Duration) -> WaitEnd {
        let (done, ended) = oneshot::channel();
        let keyspace = matches!(self.inner.source, WakeSource::Keyspace);
        {
            let mut guard = self.inner.lock();
            let state = &mut *guard;
            let (available, tried) = (state.available, state.tried);
            let key_generation = state
                .watches
                .get(&self.slot)
                .and_then(|w| state.key_generations.get(&w.key).copied());
            let Some(watch) = state.watches.get_mut(&self.slot) else {
                return WaitEnd::Woken;
            };
            let same_id = watch.last_id.as_deref() == Some(last_id);
            if keyspace {
                if !available && tried {
                    return WaitEnd::Unavailable;
                }
                // An `xadd` event since the task last waited (it may have come after the task's
                // read: a new id does not clear it), or the first wait under its key's
                // subscription. A key not subscribed yet waits for it (which wakes it).
                if watch.woken || key_generation.is_some_and(|g| g != watch.generation) {
                    watch.woken = false;
                    if let Some(generation) = key_generation {
                        watch.generation = generation;
                    }
                    return WaitEnd::Woken;
                }
            } else if watch.unread {
                // A wait lost its reply: its own pending entries hold what it read.
                watch.unread = false;
                watch.stash = None;
                watch.woken = false;
                return WaitEnd::ReadPending;
            } else if let Some(stash) = watch.stash.take() {
                // Read for the task while it was not waiting.
                watch.woken = false;
                return WaitEnd::Delivered(stash);
            } else if same_id && watch.woken {
                // Woken while the task was not waiting: read now.
                watch.woken = false;
                return WaitEnd::Woken;
            }
            if !same_id {
                watch.last_id = Some(last_id.to_owned());
                watch.woken = keyspace && watch.woken;
            }
            watch.gate = gate.map(str::to_owned);
            watch.withdrawn = false;
            if std::mem::take(&mut watch.busy) {
                // Caught up again: its channel is subscribed again, which wakes it to read once.
                state.registry_version += 1;
            }
            watch.waiter = Some(Pending {
                deadline: Instant::now() + block,
                done,
            });
            if !state.driver_started {
                state.driver_started = true;
                let inner = self.inner.clone();
                let span = inner.span.clone();
                tokio::spawn(drive(inner).instrument(span));
            }
        }
        self.inner.changed.notify_one();
        // A dropped sender (the driver stopped): read, as after any failure.
        ended.await.unwrap_or(WaitEnd::Woken)
    }
}

impl Drop for WaitSlot {
    fn drop(&mut self) {
        let mut state = self.inner.lock();
        state.watches.remove(&self.slot);
        state.registry_version += 1;
        drop(state);
        self.inner.changed.notify_one();
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The keys the next `XREAD` covers, each with the id to wait from (a key registered twice,
    /// by a task ending and its successor, waits from the lower id) and its gate (none when the
    /// two name different gates).
    fn wanted(&self) -> BTreeMap<String, Wanted> {
        wanted_of(&self.lock())
    }

    /// Starts a blocking command over `wanted` unless the wanted keys changed since they were
    /// read (one lock: [`WaitSlot::settle`] sees either the command or a changed set): records
    /// its keys and whether it reads. `false`: compute the set again.
    fn start_blocking(&self, wanted: &BTreeMap<String, Wanted>, reading: bool) -> bool {
        let mut state = self.lock();
        if wanted_of(&state) != *wanted {
            return false;
        }
        state.blocked = wanted.keys().cloned().collect();
        state.reading = reading;
        true
    }

    /// The blocking command returned and its result was handed out.
    fn end_blocking(&self) {
        let mut state = self.lock();
        state.blocked.clear();
        state.reading = false;
        drop(state);
        self.returned.notify_waiters();
    }

    /// The earliest deadline of a waiting task.
    fn next_deadline(&self) -> Option<Instant> {
        self.lock()
            .watches
            .values()
            .filter_map(|w| w.waiter.as_ref().map(|p| p.deadline))
            .min()
    }

    /// Ends the waits whose deadline has passed; their keys stay in the `XREAD`.
    fn time_out_due(&self) {
        let now = Instant::now();
        for watch in self.lock().watches.values_mut() {
            if watch.waiter.as_ref().is_some_and(|p| p.deadline <= now) {
                finish(watch, WaitEnd::TimedOut);
            }
        }
    }

    /// Marks `keys` woken (out of the `XREAD` until their tasks register a new id) and wakes
    /// their waiting tasks.
    fn wake(&self, keys: &[String]) {
        for watch in self.lock().watches.values_mut() {
            if keys.contains(&watch.key) {
                watch.woken = true;
                finish(watch, WaitEnd::Woken);
            }
        }
    }

    /// An `xadd` event for `key` (keyspace notifications): wakes its waiting tasks, which read
    /// next (so the event is spent). A watch whose task is not waiting (reading, handling) keeps
    /// it (`woken`: its next wait ends at once) and turns busy: the driver unsubscribes the
    /// channel until the task waits again.
    fn wake_on_event(&self, key: &str) {
        let mut guard = self.lock();
        let state = &mut *guard;
        let mut turned_busy = false;
        for watch in state.watches.values_mut().filter(|w| w.key == key) {
            if tell(watch, WaitEnd::Woken) {
                continue;
            }
            watch.woken = true;
            if !watch.busy {
                watch.busy = true;
                turned_busy = true;
            }
        }
        if turned_busy {
            state.registry_version += 1;
            drop(guard);
            self.changed.notify_one();
        }
    }

    /// Hands what a strict wait read to the shards' waiting tasks; for a shard whose task is not
    /// waiting it is stashed until the task's next wait or settle.
    fn deliver(&self, delivered: Vec<(String, redis::Value)>) {
        let mut state = self.lock();
        for (key, entries) in delivered {
            let reply = redis::Value::Array(vec![redis::Value::Array(vec![
                redis::Value::BulkString(key.clone().into_bytes()),
                entries,
            ])]);
            let mut handed = false;
            for watch in state.watches.values_mut().filter(|w| w.key == key) {
                watch.woken = true;
                if handed {
                    finish(watch, WaitEnd::Woken);
                } else if let Some(pending) = watch.waiter.take() {
                    // The task stopped waiting meanwhile: kept for its next wait or settle.
                    if let Err(WaitEnd::Delivered(reply)) =
                        pending.done.send(WaitEnd::Delivered(reply.clone()))
                    {
                        watch.stash = Some(reply);
                    }
                    handed = true;
                } else {
                    watch.stash = Some(reply.clone());
                    handed = true;
                }
            }
        }
    }

    /// A strict wait over `keys` failed without a reply: it may have read entries, so each of
    /// their tasks reads its pending entries next.
    fn lose_reply(&self, keys: &[String]) {
        for watch in self.lock().watches.values_mut() {
            if keys.contains(&watch.key) {
                watch.woken = true;
                watch.unread = true;
                watch.stash = None;
                finish(watch, WaitEnd::ReadPending);
            }
        }
    }
}

impl Inner {
    /// Keyspace notifications are connected on every master (`true`: the shards' channels are
    /// subscribed next, [`Inner::subscribed`]) or down (`false`: every waiting task waits another
    /// way, from its last id, which covers an event lost meanwhile).
    fn set_available(&self, available: bool) {
        let mut state = self.lock();
        state.tried = true;
        state.available = available;
        if !available {
            for watch in state.watches.values_mut() {
                finish(watch, WaitEnd::Unavailable);
            }
        }
    }

    /// The listening shard keys (registered, with a watch that is not busy) and the registry's
    /// version, unless it is still `seen`.
    fn listening_keys(&self, seen: u64) -> Option<(u64, BTreeSet<String>)> {
        let state = self.lock();
        if state.registry_version == seen {
            return None;
        }
        let keys = state
            .watches
            .values()
            .filter(|w| !w.busy)
            .map(|w| w.key.clone())
            .collect();
        Some((state.registry_version, keys))
    }

    /// The channels of `keys` are subscribed on every master: a new generation for them. Their
    /// waiting tasks read once now, and their other tasks at their next wait.
    fn subscribed(&self, keys: &[String]) {
        let mut guard = self.lock();
        let state = &mut *guard;
        state.generation += 1;
        let generation = state.generation;
        for key in keys {
            state.key_generations.insert(key.clone(), generation);
        }
        let keys: BTreeSet<&str> = keys.iter().map(String::as_str).collect();
        for watch in state.watches.values_mut() {
            // A task that stopped waiting reads at its next wait instead (its generation is
            // then still the old one).
            if keys.contains(watch.key.as_str()) && tell(watch, WaitEnd::Woken) {
                watch.generation = generation;
            }
        }
    }

    /// The channels of `keys` are being unsubscribed: no event is promised for them any more.
    fn unsubscribed(&self, keys: &[String]) {
        let mut state = self.lock();
        for key in keys {
            state.key_generations.remove(key);
        }
    }

    /// Every subscription is being made again: no event is promised until then.
    fn unsubscribed_all(&self) {
        self.lock().key_generations.clear();
    }
}

/// Tells a waiting task of a keyspace wait how its wait ended; `false` when no task is waiting
/// (none, or it stopped waiting and dropped its receiver).
fn tell(watch: &mut Watch, end: WaitEnd) -> bool {
    watch
        .waiter
        .take()
        .is_some_and(|pending| pending.done.send(end).is_ok())
}

fn finish(watch: &mut Watch, end: WaitEnd) {
    if let Some(pending) = watch.waiter.take() {
        // Entries a strict wait read while the task was not waiting come first.
        let end = if watch.unread {
            WaitEnd::ReadPending
        } else {
            end
        };
        let told_pending = end == WaitEnd::ReadPending;
        // A task that stopped waiting dropped its receiver: nothing to tell.
        if pending.done.send(end).is_ok() && told_pending {
            watch.unread = false;
        }
    }
}

/// One wanted key of the next blocking command.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Wanted {
    /// The id to wait from (`XREAD`).
    id: String,
    /// The shard's read gate (strict `XREADGROUP`), when its task named one.
    gate: Option<String>,
}

/// Orders two stream entry ids (`<ms>-<seq>`) numerically; ids that do not parse compare as
/// strings.
fn compare_ids(a: &str, b: &str) -> Ordering {
    let parse = |id: &str| {
        let (ms, seq) = id.split_once('-').unwrap_or((id, "0"));
        Some((ms.parse::<u64>().ok()?, seq.parse::<u64>().ok()?))
    };
    match (parse(a), parse(b)) {
        (Some(a), Some(b)) => a.cmp(&b),
        _ => a.cmp(b),
    }
}

/// The keys the next blocking command covers (see [`Inner::wanted`]).
fn wanted_of(state: &State) -> BTreeMap<String, Wanted> {
    let mut wanted: BTreeMap<String, Wanted> = BTreeMap::new();
    for watch in state.watches.values().filter(|w| !w.woken && !w.withdrawn) {
        let Some(id) = &watch.last_id else { continue };
        wanted
            .entry(watch.key.clone())
            .and_modify(|known| {
                if compare_ids(id, &known.id) == Ordering::Less {
                    known.id.clone_from(id);
                }
                if known.gate != watch.gate {
                    known.gate = None;
                }
            })
            .or_insert_with(|| Wanted {
                id: id.clone(),
                gate: watch.gate.clone(),
            });
    }
    wanted
}

/// The driver of [`Inner::source`].
async fn drive(inner: Arc<Inner>) {
    match inner.source.clone() {
        WakeSource::Xread => drive_xread(inner).await,
        WakeSource::Keyspace => keyspace::drive(inner).await,
    }
}

/// The `XREAD` driver: blocks over the wanted keys, interrupts and blocks again when they change,
/// times waits out, wakes the shards Redis names. In strict mode, when every wanted shard names
/// its gate, it blocks in the strict `XREADGROUP` instead and hands the entries it reads over.
async fn drive_xread(inner: Arc<Inner>) {
    let mut blocking: Option<(Waiter, i64)> = None;
    // After a strict wait is refused (a gate missing: nothing was read), the waits are plain
    // `XREAD`s for one block time, so that a gate that cannot be created (at `maxmemory`, or
    // damaged by hand) costs one refusal per block time, not a loop of them.
    let mut wake_only_until: Option<Instant> = None;
    loop {
        let wanted = inner.wanted();
        if wanted.is_empty() {
            if !idle(&inner).await {
                return;
            }
            continue;
        }
        if blocking.is_none() {
            match connect(&inner).await {
                Ok(connected) => blocking = Some(connected),
                Err(error) => {
                    let keys: Vec<String> = wanted.into_keys().collect();
                    if !fail(&inner, &keys, &error, false).await {
                        return;
                    }
                    continue;
                }
            }
        }
        let Some((waiter, client_id)) = blocking.as_mut() else {
            continue;
        };
        let reading = wake_only_until.is_none_or(|until| Instant::now() >= until)
            && inner.group_read.is_some()
            && wanted.values().all(|w| w.gate.is_some());
        let keys: Vec<String> = wanted.keys().cloned().collect();
        let Some(result) = block_once(&inner, waiter, *client_id, &wanted, reading).await else {
            return;
        };
        match result {
            Ok(Blocked::Returned(woken)) => inner.wake(&woken),
            // Handed out already (`block_once`).
            Ok(Blocked::Delivered(_)) => {}
            // The interrupt failed: closing the blocking connection frees the blocked command
            // on the server; block again at once, over the new set, on a new connection.
            Ok(Blocked::Abandoned) => blocking = None,
            // Redis refused the strict wait (a gate missing or deleted, a group gone): nothing
            // was read. The shards read, which checks their fences and opens their gates.
            // A new connection too: a refusal such as `READONLY` after a Sentinel failover means
            // the connection moved on its own, and its client id (for `CLIENT KILL`) with it.
            Err(error) if reading && is_refusal(&error) => {
                tracing::debug!(error = %crate::report::Chain(&error), "the strict wait was refused; its shards read first");
                inner.wake(&keys);
                wake_only_until = Some(Instant::now() + inner.max_block);
                blocking = None;
            }
            Err(error) => {
                blocking = None;
                if !fail(&inner, &keys, &error, reading).await {
                    return;
                }
            }
        }
    }
}

/// Whether `error` is Redis's refusal of the command (an error reply), not a failure of the
/// connection after which the command may have run.
fn is_refusal(error: &DataPlaneError) -> bool {
    match error {
        DataPlaneError::Redis { source, .. } => {
            source.code().is_some() && !source.is_io_error() && !source.is_timeout()
        }
        _ => false,
    }
}

/// Nothing to wait on: times waits out until something changes. `false` when stopped.
async fn idle(inner: &Inner) -> bool {
    let deadline = inner.next_deadline();
    tokio::select! {
        () = inner.changed.notified() => true,
        () = sleep_until(deadline) => { inner.time_out_due(); true }
        () = inner.stop.cancelled() => false,
    }
}

/// Opens the driver's blocking connection and learns its client id (for `CLIENT UNBLOCK`).
async fn connect(inner: &Inner) -> Result<(Waiter, i64), DataPlaneError> {
    let mut waiter = Waiter::connect(&inner.target, inner.max_block).await?;
    let client_id = waiter.client_id().await?;
    Ok((waiter, client_id))
}

/// A failed connect or wait: every shard of it reads once, and the driver pauses (after a
/// strict wait, `reading`, its shards were told to read their pending entries first already:
/// [`block_once`]). `false` when stopped.
async fn fail(inner: &Inner, keys: &[String], error: &DataPlaneError, reading: bool) -> bool {
    tracing::warn!(error = %crate::report::Chain(error), shards = keys.len(), "the shared wait for new entries failed; its shards read once, and it waits again after a pause");
    if !reading {
        inner.wake(keys);
    }
    tokio::select! {
        () = tokio::time::sleep(ERROR_PAUSE) => true,
        () = inner.stop.cancelled() => false,
    }
}

/// How a [`block_once`] ended.
enum Blocked {
    /// The `XREAD` returned: the keys with new entries (none after a timeout or an interrupt).
    Returned(Vec<String>),
    /// The strict `XREADGROUP` returned: each shard with entries and its entries, now in the
    /// member's PEL (none after a timeout or an interrupt).
    Delivered(Vec<(String, redis::Value)>),
    /// It had to be interrupted and `CLIENT UNBLOCK` failed (refused, or never found it
    /// blocked): the caller drops the connection.
    Abandoned,
}

/// One `XREAD BLOCK` over `wanted`, or the strict `XREADGROUP` over it when `reading` (every
/// key has a gate), interrupted when the wanted keys change, timing waits out meanwhile. `None`
/// when stopped.
async fn block_once(
    inner: &Inner,
    waiter: &mut Waiter,
    client_id: i64,
    wanted: &BTreeMap<String, Wanted>,
    reading: bool,
) -> Option<Result<Blocked, DataPlaneError>> {
    if !inner.start_blocking(wanted, reading) {
        // The set changed since it was read: no command, the caller reads it again.
        return Some(Ok(Blocked::Returned(Vec::new())));
    }
    let result = block_interruptibly(inner, waiter, client_id, wanted, reading).await;
    // Handed out before the command counts as returned, so that a task settling its shard
    // finds what was read for it.
    let result = result.map(|result| match result {
        Ok(Blocked::Delivered(delivered)) => {
            inner.deliver(delivered);
            Ok(Blocked::Delivered(Vec::new()))
        }
        other => other,
    });
    // A strict wait that ended without its reply (the connection failed or was dropped) may
    // have read entries, or may still reach Redis and read them later (a command stalled on
    // its way, or in the server's input buffer). Its connection is killed first, so that it
    // can read nothing after the shards' tasks read their pending entries, which they do next.
    let lost = match &result {
        Some(Ok(Blocked::Abandoned)) => true,
        Some(Err(error)) => !is_refusal(error),
        _ => false,
    };
    if reading && lost {
        if !kill_waiter(inner, client_id).await {
            return None;
        }
        inner.lose_reply(&keys_of(wanted));
    }
    inner.end_blocking();
    result
}

/// `CLIENT KILL ID <client_id>` on the control connection, until Redis answers (killed, or no
/// such client: gone already). Once it has, the killed connection runs no command any more, so
/// a read sent after it finds in the member's PEL whatever that connection's wait read. Retried
/// after a pause while Redis fails or refuses (a permission removed at runtime: the shards wait
/// rather than read out of order). `false` when stopped.
async fn kill_waiter(inner: &Inner, client_id: i64) -> bool {
    let mut conn = inner.control.clone();
    loop {
        let reply: redis::RedisResult<redis::Value> = redis::cmd("CLIENT")
            .arg("KILL")
            .arg("ID")
            .arg(client_id)
            .query_async(&mut conn)
            .await;
        match reply {
            Ok(_) => return true,
            Err(error) if error.to_string().contains("No such client") => return true,
            Err(error) => {
                tracing::warn!(error = %error, "killing the connection of a strict wait that lost its reply failed; its shards wait until it is done");
            }
        }
        tokio::select! {
            () = tokio::time::sleep(ERROR_PAUSE) => {}
            () = inner.stop.cancelled() => return false,
        }
    }
}

fn keys_of(wanted: &BTreeMap<String, Wanted>) -> Vec<String> {
    wanted.keys().cloned().collect()
}

/// The blocking command of [`block_once`].
async fn block(
    inner: &Inner,
    waiter: &mut Waiter,
    wanted: &BTreeMap<String, Wanted>,
    reading: bool,
) -> Result<Blocked, DataPlaneError> {
    match inner.group_read.as_ref().filter(|_| reading) {
        Some(read) => {
            let shards: Vec<(String, String)> = wanted
                .iter()
                .filter_map(|(key, w)| Some((key.clone(), w.gate.clone()?)))
                .collect();
            waiter
                .read_group(
                    &read.group,
                    &read.consumer,
                    read.count,
                    &shards,
                    inner.max_block,
                )
                .await
                .map(Blocked::Delivered)
        }
        None => {
            let shards: Vec<(String, String)> = wanted
                .iter()
                .map(|(key, w)| (key.clone(), w.id.clone()))
                .collect();
            waiter
                .wait(&shards, inner.max_block)
                .await
                .map(Blocked::Returned)
        }
    }
}

/// [`block_once`]'s command, its interrupt and the waits' deadlines.
async fn block_interruptibly(
    inner: &Inner,
    waiter: &mut Waiter,
    client_id: i64,
    blocked: &BTreeMap<String, Wanted>,
    reading: bool,
) -> Option<Result<Blocked, DataPlaneError>> {
    let wait = block(inner, waiter, blocked, reading);
    tokio::pin!(wait);
    let mut interrupted = false;
    let mut unblocking: Option<Pin<Box<dyn Future<Output = bool> + Send + '_>>> = None;
    loop {
        let deadline = inner.next_deadline();
        tokio::select! {
            result = &mut wait => return Some(result),
            () = inner.stop.cancelled() => return None,
            () = inner.changed.notified(), if !interrupted => {
                if inner.wanted() != *blocked {
                    interrupted = true;
                    unblocking = Some(Box::pin(unblock(&inner.control, client_id)));
                }
            }
            () = sleep_until(deadline) => inner.time_out_due(),
            done = run(unblocking.as_mut()), if unblocking.is_some() => {
                unblocking = None;
                if !done {
                    return Some(Ok(Blocked::Abandoned));
                }
            }
        }
    }
}

/// Awaits the `CLIENT UNBLOCK` in progress, if any.
async fn run<'a>(future: Option<&mut Pin<Box<dyn Future<Output = bool> + Send + 'a>>>) -> bool {
    match future {
        Some(future) => future.await,
        None => std::future::pending().await,
    }
}

/// `CLIENT UNBLOCK <client_id>` until Redis unblocks it (answers 1: `true`), backing off while
/// the blocked command has not reached the server (answers 0). `false` after an error (a
/// refusal, the control connection failing) or a second of zeros (the blocking connection was
/// replaced): the caller then drops the blocking connection instead.
async fn unblock(control: &RedisConnection, client_id: i64) -> bool {
    let mut pause = UNBLOCK_RETRY_FIRST;
    let give_up = Instant::now() + Duration::from_secs(1);
    let mut conn = control.clone();
    while Instant::now() < give_up {
        let reply: redis::RedisResult<i64> = redis::cmd("CLIENT")
            .arg("UNBLOCK")
            .arg(client_id)
            .query_async(&mut conn)
            .await;
        match reply {
            Ok(1) => return true,
            Ok(_) => {}
            Err(error) => {
                tracing::debug!(error = %error, "CLIENT UNBLOCK failed: the shared wait blocks again on a new connection");
                return false;
            }
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(UNBLOCK_RETRY_MOST);
    }
    false
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

mod keyspace;

#[cfg(all(test, feature = "testing"))]
mod tests;

#[cfg(all(test, feature = "testing"))]
mod strict_tests;
