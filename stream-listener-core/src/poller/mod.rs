//! The shard poller (docs/design.md §7, §8): one task per owned shard, so at most one read or
//! handler runs per shard at a time and entries of a shard are handled in order. Handlers of all
//! the member's shards share `runtime_max_concurrency` workers through a fair (FIFO) semaphore, so
//! a member owning more shards than workers serves them round-robin and none starves.
//!
//! A shard task takes the shard over (raise the fence, claim other consumers' pending entries,
//! handle its own pending entries from `0`: [`takeover`]), then reads new entries with `>`
//! ([`reads`]). When a read finds nothing it waits with a plain `XREAD BLOCK`, for at most the
//! block time and the remaining lease: on a standalone server in the member's one shared wait over
//! all its caught-up shards ([`crate::dataplane::shared_wait`]), on a cluster on a connection of
//! its own. A wait that times out is followed by another wait, not by a read. Every read (in strict mode),
//! ack and claim is fenced in Redis. No read or ack happens without a valid lease and assignment.
//! Entries are handled in [`entries`] (the policy of [`attempt`], the handler run of
//! [`handler_run`]; a batch listener's in [`batch`]); what finished waits in the [`acks`] buffer for the next round trip.
//!
//! With `fencing = "acks"` on a standalone server, the member's shard tasks that read new
//! entries share one round trip per round ([`rounds`]): their acks and one multi-stream read.

mod acks;
mod attempt;
mod batch;
mod consumers;
mod entries;
mod handler_run;
mod lanes;
mod maintenance;
mod reads;
mod rounds;
mod takeover;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering as AtomicOrdering};
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::batch::AnyHandler;
use crate::connection::{RedisConnection, RedisTarget};
use crate::dataplane::shared_wait::{GroupRead, Settled, SharedWait, WaitSlot, WakeSource};
use crate::dataplane::{FencingMode, ShardClient, Waiter};
use crate::fence::FenceToken;
use crate::hooks::HookKind;
use crate::keys::StreamKeys;
use crate::model::ShardIndex;
use crate::runtime::{ListenerOptions, MemberShared};
use crate::telemetry::{MemberMetrics, ShardMetrics};
use acks::AckBuffer;
use rounds::{ReadRounds, TurnSlot};

/// Pause after a Redis error in a shard task (no hot loop even when Redis restarted empty).
const ERROR_PAUSE: Duration = Duration::from_millis(500);

/// What every shard task of one member shares, built once when its listener starts
/// (docs/design.md §7.3): where and what to read, the handler, the options, the member's
/// assignment state, its worker pool and its read rounds. The heartbeat loop holds it too, to
/// spawn shard tasks and to report the workers in use.
pub(crate) struct ShardTaskContext {
    pub(crate) target: RedisTarget,
    /// The process's connection (heartbeats, metrics samples); the shard tasks read, ack and
    /// claim on [`Self::data_plane_connection`].
    pub(crate) conn: RedisConnection,
    /// The member's data-plane connection, made by its first shard task
    /// ([`RedisConnection::member_data_plane`]).
    data_plane: tokio::sync::OnceCell<RedisConnection>,
    pub(crate) stream: StreamKeys,
    pub(crate) group: String,
    /// Per entry or per batch (docs/design.md §14.2).
    pub(crate) handler: AnyHandler,
    pub(crate) options: Arc<ListenerOptions>,
    pub(crate) shared: Arc<MemberShared>,
    /// The member id, shared by every delivery.
    member_id: Arc<str>,
    /// The member's `runtime_max_concurrency` workers, FIFO, shared by its shard tasks.
    workers: Semaphore,
    /// The member's read rounds on a standalone server (one command may span all the member's
    /// shard keys there); `None` on a cluster (keys of different slots cannot share a command).
    rounds: Option<Arc<ReadRounds>>,
    /// The member's one wait over its caught-up shards (docs/design.md §8.4): a blocking `XREAD`
    /// on a standalone server, keyspace notifications on a cluster (when they are off, each
    /// shard task waits on a connection of its own).
    shared_wait: SharedWait,
    /// The member's replica waits after acks (`min_replica_acks`), shared by its shards: one
    /// `WAIT` in flight at a time (docs/design.md §15.4).
    ack_waits: Option<crate::replication::AckWaits>,
    /// The member's metric series (docs/design.md §13.1), resolved once.
    pub(crate) metrics: MemberMetrics,
    /// Handler attempts running now outside the worker pool: with `ordering = "key"` or
    /// `"none"` a shard's attempts are bounded by `max_in_flight` and take no worker
    /// (docs/design.md §14.3); counted for the heartbeat's `activeConsumerWorkers`.
    in_flight: AtomicU32,
}

impl ShardTaskContext {
    /// The context of the member whose state is `shared`, with its worker pool and read rounds.
    pub(crate) fn new(
        target: RedisTarget,
        conn: RedisConnection,
        stream: StreamKeys,
        group: String,
        handler: AnyHandler,
        options: Arc<ListenerOptions>,
        shared: Arc<MemberShared>,
    ) -> Self {
        let member_id = shared.member_id();
        let ack_waits = options
            .replica_wait()
            .map(crate::replication::AckWaits::new);
        let rounds = (!conn.is_cluster()).then(|| {
            ReadRounds::new(
                group.clone(),
                member_id.clone(),
                options.batch_size,
                ack_waits.clone(),
            )
        });
        let metrics = MemberMetrics::new(stream.prefix(), &group, &options.name, &member_id);
        let span = tracing::info_span!(
            "shared_wait",
            stream = stream.prefix(),
            group = %group,
            member_id = %member_id
        );
        let source = if conn.is_cluster() {
            WakeSource::Keyspace
        } else {
            WakeSource::Xread
        };
        let mut shared_wait =
            SharedWait::new(source, target.clone(), conn.clone(), options.block, span);
        // Strict mode: the wait reads through the shards' gates (docs/design.md §8.4, §8.16).
        if options.fencing == FencingMode::Strict {
            shared_wait = shared_wait.with_group_read(GroupRead {
                group: group.to_string(),
                consumer: member_id.to_string(),
                count: options.batch_size,
            });
        }
        ShardTaskContext {
            shared_wait,
            metrics,
            workers: Semaphore::new(options.runtime_max_concurrency as usize),
            member_id: member_id.into(),
            rounds,
            ack_waits,
            target,
            conn,
            data_plane: tokio::sync::OnceCell::new(),
            stream,
            group,
            handler,
            options,
            shared,
            in_flight: AtomicU32::new(0),
        }
    }

    /// The member's data-plane connection (docs/design.md §8.12), made at the first call and
    /// shared by its shard tasks and read rounds from then on. One attempt at a time: the
    /// member's other shard tasks wait for it.
    ///
    /// # Errors
    /// As [`RedisConnection::member_data_plane`]: nothing is kept, the next call tries again.
    async fn data_plane_connection(&self) -> redis::RedisResult<RedisConnection> {
        self.data_plane
            .get_or_try_init(|| self.conn.member_data_plane(&self.target))
            .await
            .cloned()
    }

    /// How many handler attempts of the member run now (the heartbeat's
    /// `activeConsumerWorkers`, docs/design.md §6): its workers in use, plus, with
    /// `ordering = "key"` or `"none"`, the attempts running outside the pool (§14.3).
    pub(crate) fn active_workers(&self) -> u32 {
        let free = u32::try_from(self.workers.available_permits()).unwrap_or(u32::MAX);
        let pool = self.options.runtime_max_concurrency.saturating_sub(free);
        pool.saturating_add(self.in_flight.load(AtomicOrdering::Relaxed))
    }
}

/// How the heartbeat loop steers one shard task.
pub(crate) struct TaskTokens {
    /// Drain: finish the current handler attempt, ack, stop.
    pub(crate) revoke: CancellationToken,
    /// Stop at once: cancel the handler, ack nothing.
    pub(crate) stop: CancellationToken,
    /// Cancelled on a revoke or a stop: what handlers see (`Delivery::still_owned`).
    pub(crate) ownership: CancellationToken,
}

/// Where a shard task is in the takeover sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Phase {
    /// Claim other consumers' pending entries.
    Claim,
    /// Handle own pending entries after this id.
    Pending(String),
    /// Read new entries.
    New,
}

/// One owned shard's poller.
pub(crate) struct ShardTask {
    ctx: Arc<ShardTaskContext>,
    shard: ShardIndex,
    revoke: CancellationToken,
    stop: CancellationToken,
    client: ShardClient,
    /// Entries handled under a token but not acked yet ([`acks`]).
    acks: AckBuffer,
    /// Whether the last read of new entries returned a full batch (more are likely waiting).
    behind: bool,
    /// The last entry id of the shard when its last wait for new entries ended without any (its
    /// block time passed): nothing is new after it, so with nothing to ack the task waits again
    /// from it without a read. Cleared by a raise and by an error.
    idle_from: Option<String>,
    /// Whether the gauges were sampled since the shard went idle (`idle_from` set): then it is not
    /// sampled again until it reads.
    sampled_while_idle: bool,
    /// Operations (raises, reads, claims) failed in a row since the last that succeeded: what
    /// [`ShardTask::failed_again`] logs by.
    failures: u32,
    /// The shard's place in the member's shared wait, made with the task.
    wait_slot: WaitSlot,
    /// The shard's own blocking connection, made at its first wait when the shared wait is
    /// unavailable (a cluster without keyspace notifications).
    waiter: Option<Waiter>,
    raised: Option<FenceToken>,
    phase: Phase,
    /// The shard stream key, shared by every delivery.
    shard_key: Arc<str>,
    /// When other consumers' pending entries were last claimed (`acks` mode sweeps).
    last_sweep: Instant,
    /// Whether the next completed claim is a takeover's, to be followed by consumer hygiene
    /// (`consumers.rs`); not the `acks` mode sweeps'.
    clean_after_claim: bool,
    /// This shard's turn in the member's next read round: dropped whenever the task waits
    /// ([`TurnSlot::release_while_waiting`]).
    turn: Arc<TurnSlot>,
    /// When the next retention trim ([`maintenance`]) is due.
    maintenance: maintenance::Schedule,
    /// The member epoch the shard was assigned at (the lifecycle hooks' context).
    member_epoch: crate::model::Epoch,
    /// This ownership of the shard, cloned into every delivery (one token per ownership).
    ownership: crate::handler::Ownership,
    /// The shard's metric series and its lag sampler's schedule (docs/design.md §13.1).
    metrics: ShardMetrics,
    /// Until when the shard is paused by a handler's `HandlerError::pause_shard` (docs/design.md
    /// §14.4): no read and no attempt starts on it before then. On the task, not in one entry's
    /// attempts, so that every path that starts work on the shard respects it ([`Self::paused`]).
    paused_until: std::sync::Mutex<Option<tokio::time::Instant>>,
}

impl ShardTask {
    /// # Errors
    /// [`crate::keys::NameError`] for an invalid group name (validated when the listener was built).
    pub(crate) fn new(
        ctx: Arc<ShardTaskContext>,
        shard: ShardIndex,
        member_epoch: crate::model::Epoch,
        tokens: TaskTokens,
    ) -> Result<Self, crate::keys::NameError> {
        let TaskTokens {
            revoke,
            stop,
            ownership,
        } = tokens;
        let client = ShardClient::new(
            ctx.conn.clone(),
            ctx.stream.clone(),
            &ctx.group,
            &ctx.member_id,
        )?
        .with_max_entry_bytes(ctx.options.max_entry_bytes)
        .with_replica_wait(ctx.ack_waits.clone());
        let shard_key: Arc<str> = ctx.stream.shard(shard).into();
        let wait_slot = ctx.shared_wait.register(shard_key.to_string());
        let maintenance = maintenance::Schedule::new(ctx.options.retention_interval);
        let metrics = ShardMetrics::new(
            ctx.stream.prefix(),
            &ctx.group,
            shard,
            ctx.options.metrics_interval,
        );
        Ok(ShardTask {
            ctx,
            shard,
            revoke,
            stop,
            client,
            acks: AckBuffer::default(),
            behind: false,
            idle_from: None,
            sampled_while_idle: false,
            failures: 0,
            wait_slot,
            waiter: None,
            raised: None,
            phase: Phase::Claim,
            shard_key,
            last_sweep: Instant::now(),
            clean_after_claim: false,
            turn: Arc::default(),
            maintenance,
            member_epoch,
            ownership: crate::handler::Ownership::new(ownership),
            metrics,
            paused_until: std::sync::Mutex::new(None),
        })
    }

    pub(crate) async fn run(mut self) {
        // Under the member's span (stream, group, member id: the task is spawned in it), with
        // the member epoch this ownership began at: hooks, the sampler and the retention pass log
        // inside it.
        let span = tracing::info_span!(
            "shard",
            shard = self.shard,
            member_epoch = self.member_epoch
        );
        let shared = self.ctx.shared.clone();
        let turn = self.turn.clone();
        async move {
            // Before the first handler of this ownership (docs/design.md §13.3).
            self.run_hook(HookKind::Assigned).await;
            let acked = turn.release_while_waiting(self.poll()).await;
            // After the last ack, before the heartbeat loop sees the task end and reports the
            // release: revoked when the drain ended in order, lost otherwise.
            self.run_hook(self.end_hook(acked)).await;
            // Released (drained or stopped): report it with the next heartbeat, now.
            shared.wake_heartbeat.notify_one();
        }
        .instrument(span)
        .await;
    }

    /// Which hook the end of this task calls: `on_revoked` after a drain that ended with the
    /// lease valid and every handled entry `acked` (the release follows), `on_lost` after a stop
    /// (fencing status, the member's end, a shutdown past `shutdown_timeout`), when the lease
    /// passed (someone else may own the shard already), or when the last ack could not be
    /// written (those entries are handled again by the next owner: nothing may be committed as
    /// if they were acked).
    fn end_hook(&self, acked: bool) -> HookKind {
        let lease_valid = self.ctx.shared.lock().lease_valid(Instant::now());
        if self.stop.is_cancelled() || !lease_valid || !acked {
            HookKind::Lost
        } else {
            HookKind::Revoked
        }
    }

    /// Runs lifecycle hook `kind` for this shard (docs/design.md §13.3): bounded by
    /// `hook_timeout`; a failure is logged and counted, nothing more.
    async fn run_hook(&self, kind: HookKind) {
        let options = &self.ctx.options;
        if options.hooks.is_empty() {
            return;
        }
        let context = crate::hooks::ShardHookContext::new(
            self.ctx.stream.prefix(),
            &self.ctx.group,
            &options.name,
            &self.ctx.member_id,
            self.member_epoch,
            self.shard,
        );
        // A failure is logged by `Hooks::run` and counted here; the member goes on either way.
        let outcome = options
            .hooks
            .run(kind, context, options.effective_hook_timeout())
            .await;
        if outcome.is_err() {
            self.ctx.metrics.hook_failure(kind.as_str());
        }
    }

    fn done(&self) -> bool {
        self.revoke.is_cancelled() || self.stop.is_cancelled()
    }

    /// The current token when the member may use the shard now (owned, lease valid).
    fn usable_token(&self) -> Option<FenceToken> {
        let reconciler = self.ctx.shared.lock();
        if reconciler.may_use(self.shard, Instant::now()) {
            reconciler.token(self.shard).cloned()
        } else {
            None
        }
    }

    /// Whether the member still owns the shard with `token` and its lease holds (no clone).
    fn still_holds(&self, token: &FenceToken) -> bool {
        holds(&self.ctx.shared, self.shard, token)
    }

    /// Whether in-flight work on the shard may finish and be acked now (owned or draining, lease
    /// valid). A stop (fencing status, lost lease) ends it at once.
    fn may_finish(&self) -> bool {
        !self.stop.is_cancelled()
            && self
                .ctx
                .shared
                .lock()
                .may_finish(self.shard, Instant::now())
    }

    fn lease_remaining(&self) -> Duration {
        self.ctx.shared.lock().lease_remaining(Instant::now())
    }

    /// Switches the shard client to the member's data-plane connection, which never re-sends a
    /// request (a read whose reply was lost must fail, not run twice: docs/design.md §8.10).
    /// Tries again after a pause until it is made or the task ends; returns whether it was.
    async fn use_data_plane_connection(&mut self) -> bool {
        while !self.done() {
            // A connection attempt lasts up to the connect timeout, and the member's tasks
            // wait for one another's: a revoke or a stop must not wait for them.
            let made = tokio::select! {
                made = self.ctx.data_plane_connection() => made,
                _ = self.revoke.cancelled() => return false,
                _ = self.stop.cancelled() => return false,
            };
            match made {
                Ok(conn) => {
                    self.client.set_connection(conn);
                    return true;
                }
                Err(error) => {
                    self.ctx.metrics.redis_error(&error);
                    tracing::warn!(error = %crate::report::Chain(&error), "connecting the data plane failed; retrying");
                    self.pause(ERROR_PAUSE).await;
                }
            }
        }
        false
    }

    /// Reads and handles until the task is drained or stopped; returns whether every entry it
    /// handled was acked.
    async fn poll(&mut self) -> bool {
        if !self.use_data_plane_connection().await {
            return true;
        }
        while !self.done() {
            let Some(token) = self.usable_token() else {
                self.flush_acks().await;
                self.wait_for_assignment().await;
                continue;
            };
            if self.raised.as_ref() != Some(&token) {
                // Held ids are acked under the token they were handled with before the fence
                // moves on (after the raise, that ack would be refused).
                if self.flush_acks().await {
                    self.raise(&token).await;
                }
                continue;
            }
            // Paused (the member by `ListenerHandle::pause`, or the shard by a handler's
            // `pause_shard`): nothing is read or started; what finished is acked now, and the
            // heartbeats go on, so the shard stays owned (docs/design.md §14.4).
            if self.paused() {
                self.flush_acks().await;
                // Out of the member's strict wait, which would read on: what it read is in
                // the PEL, read from `0` after the pause.
                if !matches!(self.settle().await, None | Some(Settled::Clear)) {
                    self.phase = Phase::Pending("0".into());
                }
                self.wait_while_paused().await;
                continue;
            }
            // Behind on new entries (the last read was a full batch): the ack of the previous
            // batch travels with the next read. Otherwise ack first, on its own: before a claim
            // or a pending read, and when caught up, so the next read comes a round trip later
            // and finds a bigger batch (each script call has a fixed cost in Redis: reading a
            // trickle at once, in strict mode, costs latency at moderate rates). A failed ack
            // changes the phase (or the fence state): decide again.
            let piggyback = self.phase == Phase::New && self.behind;
            if !piggyback && !self.flush_acks().await {
                continue;
            }
            // Between reads of new entries: a due trim costs one script call per interval.
            if self.phase == Phase::New {
                self.maintain().await;
                self.sample_metrics().await;
            }
            let step = match self.phase.clone() {
                Phase::Claim => self.claim(&token).await,
                Phase::Pending(after) => self.read_pending(&token, &after).await,
                Phase::New => self.read_new(&token).await,
            };
            let Err(error) = step else {
                self.failures = 0;
                continue;
            };
            self.idle_from = None;
            self.on_failure("shard operation", &error).await;
            // What was read before the failure may be handled but not acked: go back to
            // this consumer's pending entries before reading new ones.
            if self.phase == Phase::New {
                self.phase = Phase::Pending("0".into());
            }
            self.pause(ERROR_PAUSE).await;
        }
        // Drained or stopped: ack what finished while the lease (or the drain) allows.
        self.flush_final_acks().await
    }

    /// A raise, read or claim (`failed`) failed: counts it in the metrics and
    /// [`Self::failed_again`], and warns (a lost consumer group: [`Self::on_missing_group`]).
    async fn on_failure(&mut self, failed: &str, error: &crate::dataplane::DataPlaneError) {
        self.ctx.metrics.redis_error(error);
        let log = self.failed_again();
        if error.is_no_group() {
            self.on_missing_group(failed, error, log).await;
        } else if log {
            tracing::warn!(error = %crate::report::Chain(error), failures = self.failures, "{failed} failed; retrying");
        }
    }

    /// Counts a failed operation; whether to log it: the first of a run, then every twentieth
    /// (every 10 s at [`ERROR_PAUSE`]), so a shard that fails for good (a lost consumer group,
    /// a key of another type) does not write two warnings a second for as long as it lasts. The
    /// metrics count every one.
    fn failed_again(&mut self) -> bool {
        self.failures = self.failures.saturating_add(1);
        self.failures == 1 || self.failures.is_multiple_of(20)
    }

    /// The shard's lag and pending gauges when due (docs/design.md §13.1): one script call per
    /// `metrics_interval`, and the group's lag from the member's lowest owned shard.
    async fn sample_metrics(&mut self) {
        let (shared, shard) = (&self.ctx.shared, self.shard);
        let lowest_owned = || shared.lock().owned().keys().next() == Some(&shard);
        // An idle shard's own gauges cannot change until an entry wakes it: only its owner reads
        // it, and it is caught up with its acks sent. One sample per idle stretch is enough, so
        // an idle member costs no command per shard; the gauges are set again to the same
        // values, or the exporter would forget them. The member's lowest shard keeps sampling:
        // it also sums the group's lag over every shard (§13.1).
        let idle = self.idle_from.is_some();
        if idle && self.sampled_while_idle && !lowest_owned() {
            self.metrics.keep_alive();
            return;
        }
        let sampled = self
            .metrics
            .sample(
                &self.ctx.conn,
                &self.ctx.stream,
                &self.ctx.group,
                shard,
                lowest_owned,
                &self.ctx.metrics,
            )
            .await;
        self.sampled_while_idle = idle && (sampled || self.sampled_while_idle);
    }

    /// Lease passed or shard not (yet) usable: wait for the next assignment change.
    async fn wait_for_assignment(&self) {
        tokio::select! {
            _ = self.ctx.shared.assignment_changed.notified() => {}
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
            _ = self.revoke.cancelled() => {}
            _ = self.stop.cancelled() => {}
        }
    }

    /// Whether nothing may start on the shard now: its member is paused
    /// (`ListenerHandle::pause`) or a handler paused the shard and the pause has not ended.
    pub(super) fn paused(&self) -> bool {
        self.ctx.shared.is_paused() || self.shard_pause_end().is_some()
    }

    /// When a handler's pause of the shard ends, while it has not ended. A lock, not a plain
    /// field: with `ordering = "key"` or `"none"` several entries of the shard run at once,
    /// each through `&self` ([`lanes`]).
    fn shard_pause_end(&self) -> Option<tokio::time::Instant> {
        let mut until = self
            .paused_until
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if until.is_some_and(|end| tokio::time::Instant::now() >= end) {
            *until = None;
        }
        *until
    }

    /// Pauses the shard for `duration` from now (a handler's `pause_shard`, already clamped);
    /// a later end wins over an earlier one.
    pub(super) fn pause_shard_for(&self, duration: Duration) {
        let end = tokio::time::Instant::now() + duration;
        let mut until = self
            .paused_until
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *until = Some(until.map_or(end, |old| old.max(end)));
    }

    /// Waits until the shard is no longer [`Self::paused`], or it is revoked or stopped (a
    /// revoke ends a pause: the drain has nothing in flight).
    pub(super) async fn wait_while_paused(&self) {
        let mut member_paused = self.ctx.shared.paused.subscribe();
        while self.paused() && !self.done() {
            let until = self.shard_pause_end();
            let shard_pause = async {
                match until {
                    Some(until) => tokio::time::sleep_until(until).await,
                    None => std::future::pending().await,
                }
            };
            let member_resumed = async {
                if self.ctx.shared.is_paused() {
                    // An error means the member is gone: its stop token ends the wait.
                    let _ = member_paused.wait_for(|paused| !*paused).await;
                } else {
                    std::future::pending::<()>().await;
                }
            };
            tokio::select! {
                _ = shard_pause => {}
                _ = member_resumed => {}
                _ = self.revoke.cancelled() => {}
                _ = self.stop.cancelled() => {}
            }
        }
    }

    async fn pause(&self, duration: Duration) {
        tokio::select! {
            _ = tokio::time::sleep(duration) => {}
            _ = self.revoke.cancelled() => {}
            _ = self.stop.cancelled() => {}
        }
    }
}

/// Whether `member` owns `shard` with `token` and its lease holds, now.
fn holds(member: &MemberShared, shard: ShardIndex, token: &FenceToken) -> bool {
    let reconciler = member.lock();
    reconciler.may_use(shard, Instant::now()) && reconciler.token(shard) == Some(token)
}
