//! One member's heartbeat loop: sends the report, applies the response (docs/design.md §6 member
//! rules) and starts, revokes and stops the shard tasks of the [`crate::poller`].

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::model::{HeartbeatRequest, HeartbeatResponse, HeartbeatStatus, ShardIndex};
use crate::poller::{ShardTask, ShardTaskContext};
use crate::reconciler::Changes;
use crate::runtime::ListenerEvent;
use crate::store::{GroupStore, StoreError};
use crate::telemetry::Stopwatch;

/// Longest time one heartbeat may take before it counts as lost.
const MAX_HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest pause between heartbeats while the store fails (missing metadata, Redis down).
const MAX_ERROR_BACKOFF: Duration = Duration::from_secs(10);

/// One member: its heartbeat loop and the shard tasks it runs.
pub(super) struct Member {
    /// What the member's shard tasks share (and what the loop reads: connection, stream, group,
    /// options, assignment state).
    pub(super) ctx: Arc<ShardTaskContext>,
    pub(super) shutdown: CancellationToken,
    /// Parent of every shard task's stop token: cancelled when this member's task ends or is
    /// aborted, so no shard task outlives its member.
    pub(super) member_stop: CancellationToken,
    /// Told when this member stops for good.
    pub(super) stopped: Arc<tokio::sync::watch::Sender<Option<super::MemberStopped>>>,
    /// What probes read (docs/design.md §13.2): written after every response or failure.
    pub(super) health: Arc<super::HealthCell>,
}

/// A running shard task and how to stop it.
struct Running {
    /// Drain: finish the current handler attempt, ack, stop.
    revoke: CancellationToken,
    /// Stop at once: cancel the handler, ack nothing.
    stop: CancellationToken,
    /// The handlers' view of the ownership (`Delivery::still_owned`): a child of `stop`,
    /// cancelled with `revoke` as well (docs/design.md §13.3).
    ownership: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    /// Starts the drain, and tells the shard's handlers that the shard is going.
    fn revoke(&self) {
        self.ownership.cancel();
        self.revoke.cancel();
    }
}

impl Member {
    /// Runs the member until it stops; returns what went wrong in its shutdown (nothing when it
    /// stopped otherwise).
    pub(super) async fn run(self) -> Vec<super::ShutdownError> {
        let member_id = self.member_id();
        let _stop_shards_on_exit = self.member_stop.clone().drop_guard();
        let span = tracing::info_span!(
            "member",
            stream = %self.ctx.stream.prefix(),
            group = %self.ctx.group,
            member = %member_id,
        );
        self.run_loop().instrument(span).await
    }

    async fn run_loop(self) -> Vec<super::ShutdownError> {
        let group_keys = match self.ctx.stream.group(&self.ctx.group) {
            Ok(keys) => keys,
            Err(error) => {
                tracing::error!(error = %crate::report::Chain(&error), "invalid group name");
                return Vec::new();
            }
        };
        let mut store = GroupStore::new(
            self.ctx.conn.clone(),
            self.ctx.stream.clone(),
            group_keys,
            self.ctx.options.coordination.clone(),
        );
        let mut shards: BTreeMap<ShardIndex, Running> = BTreeMap::new();
        let mut seq = 0u64;
        let mut interval = self.ctx.options.coordination.heartbeat_interval;
        let mut failures = 0u32;
        loop {
            seq += 1;
            // A task that ended while the loop waited (its end wakes this heartbeat) is reported
            // released now: reaped only after the response, it went out as still revoking, and
            // its release waited a whole interval.
            self.reap_drained(&mut shards);
            let mut request = self.ctx.shared.lock().request(seq);
            request.active_consumer_workers = self.ctx.active_workers();
            let sent_at = Instant::now();
            let timer = Stopwatch::start();
            let sent = self.send(&mut store, &request).await;
            self.ctx.metrics.heartbeat(
                timer,
                sent.as_ref()
                    .map(|response| response.status)
                    .map_err(|error| error as _),
            );
            match sent {
                Ok(response) => {
                    failures = 0;
                    interval = Duration::from_millis(response.heartbeat_interval_ms.max(1));
                    let changes = self.apply(&response, &request, sent_at);
                    self.record_assignment(&request, &response, &changes);
                    let mut stopped = Vec::new();
                    if self.act(&changes, &mut shards, &response, &mut stopped) {
                        return Vec::new();
                    }
                    // The rejoin (next heartbeat) releases this process's holdings at once
                    // (coordinator rule 4): it goes out only once the stopped tasks are done.
                    if !stopped.is_empty() && !self.await_stopped(stopped).await {
                        return Vec::new();
                    }
                }
                Err(error) => {
                    failures += 1;
                    self.health
                        .lock()
                        .failed(crate::report::Chain(&error).to_string());
                    // Our sequence is behind what the coordinator recorded for this process
                    // (a lost fast-path answer, say): continue above it.
                    if let StoreError::Coordinator(
                        crate::coordinator::CoordinatorError::StaleRequestSeq { last, .. },
                    ) = &error
                    {
                        seq = seq.max(*last);
                    }
                    if matches!(
                        error,
                        StoreError::MissingStream { .. } | StoreError::MissingGroup { .. }
                    ) {
                        self.reprovision(&mut store, &error).await;
                    }
                    // The stream has fewer shards than this member holds (created again with
                    // another count after a loss): every request naming them is refused, so
                    // drop them all and join again, as after a fencing status.
                    if let StoreError::Coordinator(
                        crate::coordinator::CoordinatorError::ShardOutOfRange { .. },
                    ) = &error
                        && !self.rejoin_without_shards(&mut shards).await
                    {
                        return Vec::new();
                    }
                    // Rate-limited: the first failure and then every tenth.
                    if failures == 1 || failures.is_multiple_of(10) {
                        tracing::warn!(error = %crate::report::Chain(&error), failures, "heartbeat failed; reads stop when the lease ends");
                    }
                }
            }
            self.reap_drained(&mut shards);
            let wait = if failures == 0 {
                jittered(interval)
            } else {
                (interval * failures.min(4)).min(MAX_ERROR_BACKOFF)
            };
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = self.ctx.shared.wake_heartbeat.notified() => {}
                _ = self.shutdown.cancelled() => {
                    return self.leave(&mut store, &mut shards, seq + 1).await;
                }
            }
        }
    }

    /// Missing metadata: provision it again from the configured shard count (operator intent),
    /// or keep failing closed without one (docs/design.md §5).
    async fn reprovision(&self, store: &mut GroupStore, error: &StoreError) {
        let Some(configured) = self.ctx.options.auto_create_shards else {
            return;
        };
        // A stream scaled past its configured count comes back with the count this member last
        // saw: with the configured one, the shards above it would be gone and their members
        // refused.
        let shards = configured.max(store.last_seen_shard_count().unwrap_or(0));
        tracing::warn!(error = %crate::report::Chain(error), shards, "metadata lost: provisioning stream and group again from the configuration");
        let mut conn = self.ctx.conn.clone();
        let prefix = self.ctx.stream.prefix();
        if matches!(error, StoreError::MissingStream { .. })
            && let Err(error) =
                crate::store::provision::create_stream(&mut conn, prefix, shards).await
        {
            tracing::warn!(error = %crate::report::Chain(&error), "re-creating the stream failed");
            return;
        }
        // The group first, with its hand-out hold: members of the lost incarnation may still
        // read until their leases end. Consumer groups from 0, whatever start_from says.
        if let Err(error) = store.provision(true).await {
            tracing::warn!(error = %crate::report::Chain(&error), "re-creating the group failed");
            return;
        }
        if let Err(error) = crate::store::provision::register_group(
            &mut conn,
            prefix,
            &self.ctx.group,
            crate::model::StartFrom::Earliest,
        )
        .await
        {
            tracing::warn!(error = %crate::report::Chain(&error), "registering the group again failed");
        }
    }

    async fn send(
        &self,
        store: &mut GroupStore,
        request: &HeartbeatRequest,
    ) -> Result<HeartbeatResponse, StoreError> {
        // A third of the lease: a stuck heartbeat must not outlive the lease it tries to renew.
        let timeout = (self.ctx.options.coordination.member_lease_ttl / 3)
            .clamp(Duration::from_millis(100), MAX_HEARTBEAT_TIMEOUT);
        match tokio::time::timeout(timeout, store.heartbeat(request)).await {
            Ok(outcome) => Ok(outcome?.response),
            // A response after its request timed out is ignored (the future is dropped).
            Err(_) => Err(StoreError::Timeout(timeout)),
        }
    }

    fn apply(
        &self,
        response: &HeartbeatResponse,
        request: &HeartbeatRequest,
        sent_at: Instant,
    ) -> Changes {
        let margin = self
            .ctx
            .options
            .lease_margin
            .unwrap_or_else(|| Duration::from_millis(response.member_lease_ttl_ms) / 5);
        let (changes, holds) = {
            let mut reconciler = self.ctx.shared.lock();
            let changes = reconciler.apply(response, request, sent_at, margin);
            (changes, reconciler.holds(response))
        };
        self.health.lock().responded(response, sent_at, holds);
        self.ctx.shared.assignment_changed.notify_waiters();
        if response.status != HeartbeatStatus::Ok {
            tracing::info!(status = ?response.status, member_epoch = response.member_epoch, "heartbeat status");
        }
        changes
    }

    /// Carries out a response's changes. Returns `true` when the member must stop for good.
    /// Tasks stopped by a fencing status are moved to `stopped`: the caller waits for them
    /// before the rejoin ([`Self::await_stopped`]).
    fn act(
        &self,
        changes: &Changes,
        shards: &mut BTreeMap<ShardIndex, Running>,
        response: &HeartbeatResponse,
        stopped: &mut Vec<(ShardIndex, tokio::task::JoinHandle<()>)>,
    ) -> bool {
        if changes.stop_all {
            self.stop_all(
                shards,
                response.member_epoch,
                "shard stopped: fencing status, rejoining",
                stopped,
            );
        }
        if changes.fatal {
            let reason = "another process took this static member identity (FENCED_INSTANCE_ID): stopped for good; give each pod its own instance_id";
            tracing::error!("{reason}");
            self.stopped.send_replace(Some(super::MemberStopped {
                member_id: self.member_id(),
                reason: reason.to_owned(),
            }));
            return true;
        }
        for shard in &changes.revoke {
            if let Some(running) = shards.get(shard) {
                running.revoke();
            }
        }
        for (shard, token) in &changes.start {
            tracing::info!(shard, member_epoch = token.member_epoch, "shard assigned");
            self.event(ListenerEvent::Assigned {
                member: self.member_id(),
                shard: *shard,
                member_epoch: token.member_epoch,
            });
            let running = self.spawn_shard(*shard, token.member_epoch);
            if let Some(old) = shards.insert(*shard, running) {
                old.stop.cancel();
            }
        }
        // Re-raised tokens are picked up by the shard tasks themselves (they compare the token
        // they raised with the current one before every operation).
        false
    }

    /// Stops every shard task, waits for them and forgets them, so the next request joins again
    /// with nothing. Returns `false` when the member was shut down meanwhile.
    async fn rejoin_without_shards(&self, shards: &mut BTreeMap<ShardIndex, Running>) -> bool {
        let epoch = {
            let mut reconciler = self.ctx.shared.lock();
            let epoch = reconciler.epoch();
            reconciler.rejoin();
            epoch
        };
        let mut stopped = Vec::new();
        self.stop_all(
            shards,
            epoch,
            "shard stopped: the stream no longer has it; joining again",
            &mut stopped,
        );
        self.await_stopped(stopped).await
    }

    /// Stops every shard task (moved to `stopped`, which the caller waits for before the
    /// rejoin), logging `why` for each.
    fn stop_all(
        &self,
        shards: &mut BTreeMap<ShardIndex, Running>,
        member_epoch: crate::model::Epoch,
        why: &'static str,
        stopped: &mut Vec<(ShardIndex, tokio::task::JoinHandle<()>)>,
    ) {
        self.ctx.metrics.lost(shards.len());
        for (shard, running) in std::mem::take(shards) {
            running.stop.cancel();
            stopped.push((shard, running.task));
            tracing::info!(shard, "{why}");
            self.event(ListenerEvent::Revoked {
                member: self.member_id(),
                shard,
                member_epoch,
            });
        }
    }

    /// Waits for the shard tasks a fencing status stopped, before the rejoin: a rejoin from the
    /// same process releases its holdings at once (docs/design.md §6.4 coordinator rule 4), so the
    /// next owner could read while an old handler still runs (a handler that ignores cancellation:
    /// blocks its thread, or does not return promptly when dropped). Until the join the
    /// coordinator keeps the holdings of the fenced member (until its lease runs out).
    ///
    /// Bounded by `handler_timeout` (a task whose handler honours cancellation ends at once);
    /// past it the member rejoins anyway, with an error naming the shards whose handler still
    /// runs (its lease would release them soon as well). Returns `false` when the member was
    /// shut down meanwhile (no leave: nothing is owned, the lease runs out).
    async fn await_stopped(&self, stopped: Vec<(ShardIndex, tokio::task::JoinHandle<()>)>) -> bool {
        let deadline = tokio::time::Instant::now() + self.ctx.options.handler_timeout;
        for (shard, mut task) in stopped {
            tokio::select! {
                outcome = tokio::time::timeout_at(deadline, &mut task) => {
                    if outcome.is_err() {
                        tracing::error!(
                            shard,
                            handler_timeout = ?self.ctx.options.handler_timeout,
                            "a handler stopped by a fencing status still runs after handler_timeout \
                             (it ignores cancellation): rejoining anyway; the next owner may handle \
                             entries of this shard while it runs"
                        );
                    }
                }
                _ = self.shutdown.cancelled() => return false,
            }
        }
        true
    }

    /// Starts the task of `shard`, assigned at `member_epoch`.
    fn spawn_shard(&self, shard: ShardIndex, member_epoch: crate::model::Epoch) -> Running {
        let revoke = CancellationToken::new();
        let stop = self.member_stop.child_token();
        let ownership = stop.child_token();
        let tokens = crate::poller::TaskTokens {
            revoke: revoke.clone(),
            stop: stop.clone(),
            ownership: ownership.clone(),
        };
        let task = match ShardTask::new(self.ctx.clone(), shard, member_epoch, tokens) {
            // In the member's span, so that the shard's span is its child.
            Ok(task) => tokio::spawn(task.run().in_current_span()),
            Err(error) => {
                tracing::error!(error = %crate::report::Chain(&error), shard, "shard not polled");
                tokio::spawn(async {})
            }
        };
        Running {
            revoke,
            stop,
            ownership,
            task,
        }
    }

    /// Shard tasks that finished draining are released: reported `REVOKED` next heartbeat.
    fn reap_drained(&self, shards: &mut BTreeMap<ShardIndex, Running>) {
        let finished: Vec<ShardIndex> = shards
            .iter()
            .filter(|(_, r)| r.task.is_finished())
            .map(|(s, _)| *s)
            .collect();
        let epoch = self.ctx.shared.lock().epoch();
        self.ctx.metrics.revoked(finished.len());
        for shard in finished {
            shards.remove(&shard);
            self.ctx.shared.lock().drained(shard);
            tracing::info!(shard, member_epoch = epoch, "shard released");
            self.event(ListenerEvent::Revoked {
                member: self.member_id(),
                shard,
                member_epoch: epoch,
            });
        }
    }

    /// Graceful shutdown: drain every shard within `shutdown_timeout`, then leave. Returns what
    /// was not clean: each shard whose handler was cancelled, a leave that was not delivered.
    async fn leave(
        &self,
        store: &mut GroupStore,
        shards: &mut BTreeMap<ShardIndex, Running>,
        seq: u64,
    ) -> Vec<super::ShutdownError> {
        let mut problems = Vec::new();
        self.ctx.shared.lock().begin_leave();
        for running in shards.values() {
            running.revoke();
        }
        let deadline = tokio::time::Instant::now() + self.ctx.options.shutdown_timeout;
        for (shard, running) in std::mem::take(shards) {
            let stop = running.stop.clone();
            let mut task = running.task;
            if tokio::time::timeout_at(deadline, &mut task).await.is_err() {
                tracing::warn!(
                    shard,
                    "in-flight handler did not finish within shutdown_timeout: cancelled, not acked"
                );
                stop.cancel();
                let _ = task.await;
                problems.push(super::ShutdownError::HandlerCancelled {
                    listener: self.ctx.options.name.clone(),
                    stream: self.ctx.stream.prefix().to_owned(),
                    group: self.ctx.group.clone(),
                    member_id: self.member_id(),
                    shard,
                    shutdown_timeout: self.ctx.options.shutdown_timeout,
                });
            }
            self.ctx.shared.lock().drained(shard);
            self.ctx.metrics.revoked(1);
        }
        let request = self.ctx.shared.lock().leave_request(seq);
        match self.send(store, &request).await {
            Ok(_) => tracing::info!("left the group"),
            Err(error) => {
                tracing::warn!(error = %crate::report::Chain(&error), "leave not delivered; the lease will expire instead");
                problems.push(super::ShutdownError::LeaveNotDelivered {
                    listener: self.ctx.options.name.clone(),
                    stream: self.ctx.stream.prefix().to_owned(),
                    group: self.ctx.group.clone(),
                    member_id: self.member_id(),
                    source: Box::new(error),
                });
            }
        }
        problems
    }

    fn member_id(&self) -> String {
        self.ctx.shared.member_id()
    }

    /// The member's owned shards and epoch after a response, a rebalance when it carried a new
    /// member epoch, and the shards it starts (docs/design.md §13.1).
    fn record_assignment(
        &self,
        request: &HeartbeatRequest,
        response: &HeartbeatResponse,
        changes: &Changes,
    ) {
        let (owned, epoch) = {
            let reconciler = self.ctx.shared.lock();
            (reconciler.owned().len(), reconciler.epoch())
        };
        let rebalanced =
            response.status == HeartbeatStatus::Ok && response.member_epoch != request.member_epoch;
        self.ctx
            .metrics
            .assignment(owned, epoch, rebalanced, changes.start.len());
    }

    fn event(&self, event: ListenerEvent) {
        self.ctx.options.emit(event);
    }
}

/// `interval` ± 10%, so members started together do not heartbeat in lockstep.
fn jittered(interval: Duration) -> Duration {
    let factor = rand::random_range(0.9..1.1);
    interval.mul_f64(factor)
}
