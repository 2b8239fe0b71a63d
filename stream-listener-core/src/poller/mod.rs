//! The shard poller (docs/design.md §7, §8): one task per owned shard, so at most one read or
//! handler runs per shard at a time and entries of a shard are handled in order. Handlers of all
//! the member's shards share `runtime_max_concurrency` workers through a fair (FIFO) semaphore, so
//! a member owning more shards than workers serves them round-robin and none starves.
//!
//! A shard task takes the shard over (raise the fence, claim other consumers' pending entries,
//! handle its own pending entries from `0`), then reads new entries with `>`. When a read finds
//! nothing it waits with a plain `XREAD BLOCK` on a dedicated connection, for at most the block
//! time and the remaining lease. Every read (in strict mode), ack and claim is fenced in Redis.
//! No read or ack happens without a valid lease and assignment.
//!
//! With `fencing = "acks"` on a standalone server, the member's shard tasks that read new
//! entries share one round trip per round ([`rounds`]): their acks and one multi-stream read.

mod rounds;

pub(crate) use rounds::ReadRounds;

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::FutureExt;

use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::connection::{RedisConnection, RedisTarget};
use crate::dataplane::round::{PartRead, RoundPart};
use crate::dataplane::{
    DataPlaneError, DeadLetterReason, EntryStatus, Fenced, FencingMode, GroupRecreated,
    ReadOutcome, ShardClient, ShardEntry, Waiter,
};
use crate::fence::FenceToken;
use crate::handler::{Delivery, Handler, HandlerError, Metadata};
use crate::keys::StreamKeys;
use crate::member::{ListenerEvent, ListenerOptions, MemberShared};
use crate::model::{FenceConflict, ShardIndex};
use rounds::{Request, RoundResult, Turn};

/// Longest backoff between handler attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// Pause after a Redis error in a shard task (no hot loop even when Redis restarted empty).
const ERROR_PAUSE: Duration = Duration::from_millis(500);
/// Ids claimed per claim call.
const CLAIM_BATCH: usize = 256;
/// The `error` field of a `max-deliveries` dead letter.
const MAX_DELIVERIES_ERROR: &str = "max_deliveries handler attempts did not finish";

/// Everything a shard task needs from its member.
pub(crate) struct ShardTaskContext {
    pub(crate) target: RedisTarget,
    pub(crate) conn: RedisConnection,
    pub(crate) stream: StreamKeys,
    pub(crate) group: String,
    pub(crate) handler: Arc<dyn Handler>,
    pub(crate) options: Arc<ListenerOptions>,
    pub(crate) shared: Arc<MemberShared>,
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

/// What became of one entry.
enum Outcome {
    /// Handled, dead-lettered or trimmed: ack it.
    Ack,
    /// Not finished (drain, stop, lease end): leave it pending for the next owner.
    Abandon,
}

/// One owned shard's poller.
pub(crate) struct ShardTask {
    ctx: ShardTaskContext,
    shard: ShardIndex,
    revoke: CancellationToken,
    stop: CancellationToken,
    client: ShardClient,
    /// Entries handled under a token but not acked yet: acked together with the next read (one
    /// round trip for both), or on their own before anything else.
    unacked: Option<(FenceToken, Vec<String>)>,
    /// Whether the last read of new entries returned a full batch (more are likely waiting).
    behind: bool,
    waiter: Option<Waiter>,
    raised: Option<FenceToken>,
    phase: Phase,
    /// The member id, shared by every delivery.
    member_id: Arc<str>,
    /// The shard stream key, shared by every delivery.
    shard_key: Arc<str>,
    /// The member's worker pool ([`worker_pool`]).
    workers: Arc<Semaphore>,
    /// When other consumers' pending entries were last claimed (`acks` mode sweeps).
    last_sweep: Instant,
    /// The member's read rounds, when new entries are read in rounds ([`rounds`]).
    rounds: Option<Arc<ReadRounds>>,
    /// This shard's turn in the next round: held only while handling a round's batch without
    /// waiting for anything ([`ShardTask::release_turn`] before any wait).
    turn: Option<Turn>,
}

impl ShardTask {
    /// # Errors
    /// [`crate::keys::NameError`] for an invalid group name (validated when the listener was built).
    pub(crate) fn new(
        ctx: ShardTaskContext,
        shard: ShardIndex,
        revoke: CancellationToken,
        stop: CancellationToken,
    ) -> Result<Self, crate::keys::NameError> {
        let member_id = ctx.shared.lock().identity().member_id.clone();
        let client =
            ShardClient::new(ctx.conn.clone(), ctx.stream.clone(), &ctx.group, &member_id)?
                .with_max_entry_bytes(ctx.options.max_entry_bytes);
        let shard_key = ctx.stream.shard(shard).into();
        let workers = worker_pool(&ctx);
        let rounds = read_rounds(&ctx, &member_id);
        Ok(ShardTask {
            ctx,
            shard,
            revoke,
            stop,
            client,
            unacked: None,
            behind: false,
            waiter: None,
            raised: None,
            phase: Phase::Claim,
            member_id: member_id.into(),
            shard_key,
            workers,
            last_sweep: Instant::now(),
            rounds,
            turn: None,
        })
    }

    pub(crate) async fn run(mut self) {
        let span = tracing::info_span!("shard", shard = self.shard);
        let shared = self.ctx.shared.clone();
        async move {
            self.poll().await;
            // Released (drained or stopped): report it with the next heartbeat, now.
            shared.wake_heartbeat.notify_one();
        }
        .instrument(span)
        .await;
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

    /// Lets the member's next read round go without this shard: call before anything that may
    /// wait ([`rounds`]).
    fn release_turn(&mut self) {
        self.turn = None;
    }

    /// Switches the shard client to the data plane's connection, which never re-sends a
    /// request (a read whose reply was lost must fail, not run twice: docs/design.md §8.10).
    /// Tries again after a pause until it is made or the task ends; returns whether it was.
    async fn use_data_plane_connection(&mut self) -> bool {
        while !self.done() {
            match self.ctx.conn.for_data_plane().await {
                Ok(conn) => {
                    self.client.set_connection(conn);
                    return true;
                }
                Err(error) => {
                    tracing::warn!(%error, "connecting the data plane failed; retrying");
                    self.pause(ERROR_PAUSE).await;
                }
            }
        }
        false
    }

    async fn poll(&mut self) {
        if !self.use_data_plane_connection().await {
            return;
        }
        while !self.done() {
            let Some(token) = self.usable_token() else {
                self.release_turn();
                self.flush_acks().await;
                self.wait_for_assignment().await;
                continue;
            };
            if self.raised.as_ref() != Some(&token) {
                self.release_turn();
                // Held ids are acked under the token they were handled with before the fence
                // moves on (after the raise, that ack would be refused).
                if self.flush_acks().await {
                    self.raise(&token).await;
                }
                continue;
            }
            // Behind on new entries (the last read was a full batch): the ack of the previous
            // batch travels with the next read. Otherwise ack first, on its own: before a claim
            // or a pending read, and when caught up, so the next read comes a round trip later
            // and finds a bigger batch (each script call has a fixed cost in Redis: reading a
            // trickle at once, in strict mode, made p50 and p99 latency at half the peak rate
            // 20-35% worse). A failed ack changes the phase (or the fence state): decide again.
            let piggyback = self.phase == Phase::New && self.behind;
            if !piggyback && !self.flush_acks().await {
                continue;
            }
            let step = match self.phase.clone() {
                Phase::Claim => self.claim(&token).await,
                Phase::Pending(after) => self.read_pending(&token, &after).await,
                Phase::New => self.read_new(&token).await,
            };
            if let Err(error) = step {
                tracing::warn!(%error, "shard operation failed; retrying");
                if error.is_no_group() {
                    self.recreate_consumer_group().await;
                }
                // What was read before the failure may be handled but not acked: go back to
                // this consumer's pending entries before reading new ones.
                if self.phase == Phase::New {
                    self.phase = Phase::Pending("0".into());
                }
                self.pause(ERROR_PAUSE).await;
            }
        }
        // Drained or stopped: ack what finished while the lease (or the drain) allows.
        self.flush_acks().await;
    }

    /// Acks the entries handled but not yet acked, on their own. When they cannot be acked now
    /// they stay in this consumer's pending list and the shard goes back to it: they are acked
    /// later or handled again, never left behind. After a Redis failure the ids stay held too,
    /// and the ack is tried again after a pause (acking twice is harmless; handling twice is
    /// what at-least-once allows but should not cost a connection blip); when the lease passed
    /// or the fence refused, they are let go (the next owner claims them).
    /// Returns false when ids were held and not acked.
    async fn flush_acks(&mut self) -> bool {
        let Some((token, ids)) = self.unacked.take() else {
            return true;
        };
        self.release_turn();
        let acked = match self.ack(&token, &ids).await {
            Ok(acked) => acked,
            Err(error) => {
                tracing::warn!(%error, "acking handled entries failed; retrying");
                self.unacked = Some((token, ids));
                self.pause(ERROR_PAUSE).await;
                false
            }
        };
        if !acked && self.phase != Phase::Claim {
            self.phase = Phase::Pending("0".into());
        }
        acked
    }

    /// The ids handled under `token` and not yet acked (none when they were under another one:
    /// those are acked on their own first).
    async fn take_unacked(&mut self, token: &FenceToken) -> Vec<String> {
        if self.unacked.as_ref().is_some_and(|(t, _)| t != token) {
            self.flush_acks().await;
        }
        match self.unacked.take() {
            Some((held, ids)) if &held == token => ids,
            // Still held under the other token (that ack failed): tried again first next time.
            other => {
                self.unacked = other;
                Vec::new()
            }
        }
    }

    /// The shard lost its consumer group (or its stream): with `auto_create_shards` (operator
    /// intent) create the group again from `0` — nothing written in the gap is skipped;
    /// without it, keep failing closed.
    ///
    /// Only while the stream metadata lists the shard as readable: a member holds a retired
    /// shard until its next heartbeat, and re-creating it then would bring back a stream no one
    /// reads, into which a producer's late `XADD ... NOMKSTREAM` would succeed (docs/design.md
    /// §8.11). A missing stream is created (`MKSTREAM`) only while the shard is ACTIVE, the
    /// rule of `register_group`: a master restarted without persistence loses the shard streams
    /// of its slots while the stream metadata, elsewhere, still lists them, and no admin
    /// operation provisions them again for a registered group. An ACTIVE shard reaches RETIRED
    /// only after DRAINING for the routing lease and more, so the check and the creation are
    /// that far apart at least. When the shard stopped being readable while the group was
    /// created (a retirement started), the group is destroyed again (created from `0`, it would
    /// block the shard's deletion, as in docs/design.md §8.1), and a stream created here with it
    /// when it is still empty.
    async fn recreate_consumer_group(&self) {
        if self.ctx.options.auto_create_shards.is_none() {
            return;
        }
        let mut conn = self.ctx.conn.clone();
        let key = self.ctx.stream.shard(self.shard);
        let state = self.state_in_metadata(&mut conn).await;
        if !state.is_some_and(|s| s.is_readable()) {
            tracing::warn!(
                stream = %key,
                "consumer group missing on a shard that is no longer readable (retiring or retired): not created again"
            );
            return;
        }
        let create_stream = state == Some(crate::model::ShardState::Active);
        let mut client = self.client.clone();
        match client.recreate_group(self.shard, create_stream).await {
            Ok(GroupRecreated::Created { .. }) if self.readable_in_metadata(&mut conn).await => {
                tracing::warn!("consumer group was missing on this shard: created again from 0")
            }
            Ok(GroupRecreated::Created { stream_created }) => {
                let undone = client.undo_recreate_group(self.shard, stream_created).await;
                tracing::warn!(
                    stream = %key,
                    undone = undone.is_ok(),
                    "the shard stopped being readable while its consumer group was created again: destroyed it"
                );
            }
            Ok(GroupRecreated::StreamMissing) => tracing::warn!(
                stream = %key,
                "consumer group missing on a DRAINING shard whose stream is gone: not created (a member creates a stream only for an ACTIVE shard)"
            ),
            Ok(GroupRecreated::Exists) => {} // created meanwhile
            Err(error) => tracing::warn!(%error, "re-creating the consumer group failed"),
        }
    }

    /// Whether the stream metadata lists this shard as readable (ACTIVE or DRAINING), read now.
    /// Missing or unreadable metadata, or a failed read: no (fail closed).
    async fn readable_in_metadata(&self, conn: &mut RedisConnection) -> bool {
        self.state_in_metadata(conn)
            .await
            .is_some_and(|s| s.is_readable())
    }

    /// This shard's state in the stream metadata, read now; `None` when it is not listed, the
    /// metadata is missing or unreadable, or the read failed.
    async fn state_in_metadata(
        &self,
        conn: &mut RedisConnection,
    ) -> Option<crate::model::ShardState> {
        match crate::store::load_stream_metadata(conn, &self.ctx.stream).await {
            Ok(Some(meta)) => meta
                .shards
                .iter()
                .find(|s| s.shard_index == self.shard)
                .map(|s| s.state),
            Ok(None) => None,
            Err(error) => {
                tracing::warn!(%error, "reading the stream metadata failed");
                None
            }
        }
    }

    /// Lease passed or shard not (yet) usable: wait for the next assignment change.
    async fn wait_for_assignment(&mut self) {
        self.release_turn();
        tokio::select! {
            _ = self.ctx.shared.assignment_changed.notified() => {}
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
            _ = self.revoke.cancelled() => {}
            _ = self.stop.cancelled() => {}
        }
    }

    async fn pause(&mut self, duration: Duration) {
        self.release_turn();
        tokio::select! {
            _ = tokio::time::sleep(duration) => {}
            _ = self.revoke.cancelled() => {}
            _ = self.stop.cancelled() => {}
        }
    }

    async fn raise(&mut self, token: &FenceToken) {
        self.release_turn();
        match self.client.raise_fence(self.shard, token).await {
            Ok(Ok(())) => {
                self.raised = Some(token.clone());
                self.phase = Phase::Claim;
            }
            Ok(Err(fenced)) => self.conflict("read", fenced, token).await,
            Err(error) => {
                tracing::warn!(%error, "raising the fence failed; retrying");
                // No fence next to a missing stream: the stream must come back first (or the
                // shard be revoked), or this raise fails for good.
                if error.is_no_group() {
                    self.recreate_consumer_group().await;
                }
                self.pause(ERROR_PAUSE).await;
            }
        }
    }

    /// The fence holds another token than `token`: stop using the shard. `Lower` (a raise lost
    /// in a failover): raise again after re-checking lease and assignment. `Higher`: report the
    /// conflict and park until the coordinator decides (a new token, a revoke, a fencing status).
    async fn conflict(&mut self, op: &'static str, fenced: Fenced, token: &FenceToken) {
        self.release_turn();
        self.event(ListenerEvent::FenceRejected {
            op,
            member: self.member_id.to_string(),
            shard: self.shard,
        });
        self.raised = None;
        if fenced == Fenced::Lower {
            return;
        }
        let Some((incarnation, epoch)) = fenced.conflict() else {
            // Not a token at all (written by hand?): fail closed, say what to do, and try the
            // raise again now and then, so the shard resumes once someone fixes the field.
            tracing::error!(
                op,
                fence = %self.ctx.stream.fence(self.shard),
                group = %self.ctx.group,
                "the fence field of this group holds a value that is not a fencing token: the shard is not read until it is deleted (HDEL <fence> <group>)"
            );
            self.pause(self.ctx.options.coordination.member_lease_ttl)
                .await;
            return;
        };
        self.ctx.shared.lock().fence_conflict(FenceConflict {
            shard_index: self.shard,
            incarnation,
            epoch,
        });
        tracing::warn!(
            op,
            "the shard's fence holds a higher token: not reading it; reported"
        );
        while !self.done() && self.usable_token().as_ref() == Some(token) {
            self.wait_for_assignment().await;
        }
    }

    async fn claim(&mut self, token: &FenceToken) -> Result<(), DataPlaneError> {
        self.release_turn();
        match self
            .client
            .claim_others(self.shard, token, CLAIM_BATCH)
            .await?
        {
            Ok(report) => {
                if report.trimmed > 0 {
                    tracing::warn!(
                        trimmed = report.trimmed,
                        "pending entries of other consumers were trimmed before they were acked"
                    );
                }
                if report.complete {
                    self.phase = Phase::Pending("0".into());
                }
                Ok(())
            }
            Err(fenced) => {
                self.conflict("claim", fenced, token).await;
                Ok(())
            }
        }
    }

    /// In `acks` mode a zombie can still read (reads are fenced by the lease only), so entries it
    /// read after the takeover sit in its pending list: claim other consumers' entries again once
    /// per lease TTL (docs/design.md §8, the periodic sweep).
    fn sweep_if_due(&mut self) {
        let acks_mode = self.ctx.options.fencing == crate::dataplane::FencingMode::Acks;
        if acks_mode && self.last_sweep.elapsed() >= self.ctx.options.coordination.member_lease_ttl
        {
            self.last_sweep = Instant::now();
            self.phase = Phase::Claim;
        }
    }

    async fn read_pending(
        &mut self,
        token: &FenceToken,
        after: &str,
    ) -> Result<(), DataPlaneError> {
        self.release_turn();
        let batch = self.ctx.options.batch_size;
        let mode = self.ctx.options.fencing;
        match self
            .client
            .read_pending(self.shard, token, after, batch, mode)
            .await?
        {
            ReadOutcome::Entries(entries) => {
                // An empty page means the own pending entries are done.
                let last = entries.last().map(|e| e.id.clone());
                let complete = self.handle_batch(token, entries).await?;
                match (complete, last) {
                    (true, Some(last)) => self.phase = Phase::Pending(last),
                    (true, None) => self.phase = Phase::New,
                    (false, _) => {}
                }
                Ok(())
            }
            ReadOutcome::Empty { .. } => {
                self.phase = Phase::New;
                Ok(())
            }
            ReadOutcome::Fenced(fenced) => {
                self.conflict("read", fenced, token).await;
                Ok(())
            }
        }
    }

    /// Acks the previous batch and reads the next one in the same round trip (one pipeline, the
    /// ack first). A refused or failed ack wins over what the read returned: those entries stay
    /// in this consumer's pending list.
    async fn read_new(&mut self, token: &FenceToken) -> Result<(), DataPlaneError> {
        let batch = self.ctx.options.batch_size;
        let mode = self.ctx.options.fencing;
        let ids = self.take_unacked(token).await;
        let result = match self.rounds.clone() {
            Some(rounds) => self.round(&rounds, token, ids.as_slice()).await,
            None => self
                .client
                .ack_and_read_new(self.shard, token, &ids, batch, mode)
                .await
                .map(Some),
        };
        let (acked, read) = match result {
            Ok(Some(replies)) => replies,
            // Not sent (lease or assignment changed while queued), or failed (nothing is known
            // of what ran): the handled ids are held again, and acked (again: harmless) before
            // the shard re-reads its own pending entries — not handled a second time.
            other => {
                if !ids.is_empty() {
                    self.unacked = Some((token.clone(), ids));
                }
                return other.map(|_| ());
            }
        };
        match acked {
            Ok(_) => self.count_handled(ids.len()),
            Err(fenced) => {
                self.conflict("ack", fenced, token).await;
                return Ok(());
            }
        }
        match read {
            ReadOutcome::Entries(entries) => {
                self.behind = entries.len() >= batch;
                if !self.handle_batch(token, entries).await? {
                    // Entries left unfinished (lease lapse, failed attempt while draining) stay
                    // in this consumer's pending list: go back to it before reading new ones.
                    self.phase = Phase::Pending("0".into());
                }
                self.sweep_if_due();
                Ok(())
            }
            ReadOutcome::Empty { last_id } => {
                self.behind = false;
                self.sweep_if_due();
                if self.phase == Phase::New {
                    self.wait_for_entries(&last_id).await?;
                }
                Ok(())
            }
            ReadOutcome::Fenced(fenced) => {
                self.conflict("read", fenced, token).await;
                Ok(())
            }
        }
    }

    /// [`ShardClient::ack_and_read_new`] in the member's next read round ([`rounds`]): the ack of
    /// `ids` and the read of this shard share the round trip with the member's other shards.
    /// `None` when nothing was sent for this shard.
    async fn round(
        &mut self,
        rounds: &Arc<ReadRounds>,
        token: &FenceToken,
        ids: &[String],
    ) -> Result<Option<(Result<usize, Fenced>, ReadOutcome)>, DataPlaneError> {
        let batch = self.ctx.options.batch_size;
        let ack = (!ids.is_empty()).then(|| self.client.ack_part(self.shard, token, ids));
        let request = Request {
            shard: self.shard,
            token: token.clone(),
            part: RoundPart {
                key: self.shard_key.to_string(),
                ack,
            },
        };
        let shared = self.ctx.shared.clone();
        let still_held = move |shard: ShardIndex, token: &FenceToken| holds(&shared, shard, token);
        let (reply, turn) = match rounds.submit(request, self.turn.take(), &still_held).await {
            RoundResult::Done(reply, turn) => (reply, turn),
            RoundResult::NotSent => return Ok(None),
            RoundResult::Failed(source) => {
                return Err(DataPlaneError::Redis {
                    op: "read_round",
                    shard: Some(self.shard),
                    source,
                });
            }
        };
        // A script missing on the server makes this shard ack on its own (round trips): the
        // member's next round must not wait for that.
        let noscript = matches!(&reply.ack, Some(Err(e)) if e.code() == Some("NOSCRIPT"));
        let turn = turn.filter(|_| !noscript);
        let acked = match reply.ack {
            Some(ack) => self.client.ack_reply(self.shard, token, ids, ack).await?,
            None => Ok(0),
        };
        let read = match reply.read {
            PartRead::Entries(read) => {
                self.client
                    .read_new_reply(self.shard, token, batch, Ok(read))
                    .await?
            }
            // The multi-stream read failed as a whole and delivered nothing (another shard's
            // group missing?): read this shard on its own, which reports its own error if any.
            PartRead::ReadAlone => {
                self.client
                    .read_new(self.shard, token, batch, FencingMode::Acks)
                    .await?
            }
            // Entries may have been delivered: back to this consumer's pending entries.
            PartRead::Unexpected(what) => {
                return Err(DataPlaneError::unexpected(
                    "read_round",
                    Some(self.shard),
                    what,
                ));
            }
        };
        self.turn = turn;
        Ok(Some((acked, read)))
    }

    /// Blocks until a new entry arrives, the block time or the lease runs out, or the shard is
    /// revoked (`XREAD BLOCK` without a group, on a dedicated connection).
    async fn wait_for_entries(&mut self, last_id: &str) -> Result<(), DataPlaneError> {
        self.release_turn();
        let block = self.ctx.options.block.min(self.lease_remaining());
        if block < Duration::from_millis(1) {
            return Ok(());
        }
        if self.waiter.is_none() {
            self.waiter = Some(Waiter::connect(&self.ctx.target, self.ctx.options.block).await?);
        }
        let shards = [(self.ctx.stream.shard(self.shard), last_id.to_owned())];
        let Some(waiter) = self.waiter.as_mut() else {
            return Ok(());
        };
        tokio::select! {
            result = waiter.wait(&shards, block) => { result?; }
            _ = self.revoke.cancelled() => {}
            _ = self.stop.cancelled() => {}
        }
        Ok(())
    }

    /// Handles `entries` in order. When every entry finished, their ids wait in `unacked` for the
    /// next read's round trip; otherwise (revoked, stopped, lease ended) what finished is acked
    /// now, in one fenced `XACK`. Returns whether every entry finished.
    async fn handle_batch(
        &mut self,
        token: &FenceToken,
        entries: Vec<ShardEntry>,
    ) -> Result<bool, DataPlaneError> {
        if let Some(first) = entries.first() {
            self.event(ListenerEvent::Read {
                member: self.member_id.to_string(),
                shard: self.shard,
                count: entries.len(),
                first_id: first.id.clone(),
            });
        }
        let mut finished = Vec::with_capacity(entries.len());
        let mut complete = true;
        for mut entry in entries {
            if self.done() || !self.still_holds(token) {
                complete = false;
                break;
            }
            match self.handle_entry(token, &mut entry).await? {
                Outcome::Ack => finished.push(entry.id),
                Outcome::Abandon => {
                    complete = false;
                    break;
                }
            }
        }
        if complete {
            // Acked with the next read (or on its own if something else comes first).
            match &mut self.unacked {
                Some((held, ids)) if held == token => ids.extend(finished),
                _ if finished.is_empty() => {}
                _ => {
                    self.flush_acks().await;
                    self.unacked = Some((token.clone(), finished));
                }
            }
            return Ok(true);
        }
        self.ack(token, &finished).await?;
        Ok(false)
    }

    fn count_handled(&self, acked: usize) {
        self.ctx
            .shared
            .handled
            .fetch_add(acked as u64, std::sync::atomic::Ordering::Relaxed);
    }

    /// Acks `ids` through the fence. Returns whether they are acked; when not (lease passed,
    /// fence refused, Redis failed), they stay in this consumer's pending list and the shard goes
    /// back to it, so finished work is acked later or handled again — never left behind.
    async fn ack(&mut self, token: &FenceToken, ids: &[String]) -> Result<bool, DataPlaneError> {
        if ids.is_empty() {
            return Ok(true);
        }
        self.release_turn();
        if !self.may_finish() {
            return Ok(false); // no ack without a valid lease and assignment (or drain)
        }
        match self.client.ack(self.shard, token, ids).await? {
            Ok(_) => {
                self.count_handled(ids.len());
                Ok(true)
            }
            Err(fenced) => {
                self.conflict("ack", fenced, token).await;
                Ok(false)
            }
        }
    }

    /// docs/design.md §8.8, outcomes: retries in place with backoff, dead letters, cancellation.
    ///
    /// Every attempt shares the entry's fields (`Arc`): the entry may be trimmed from the stream
    /// while it is retried, and its retries and dead letter must still have its body.
    async fn handle_entry(
        &mut self,
        token: &FenceToken,
        entry: &mut ShardEntry,
    ) -> Result<Outcome, DataPlaneError> {
        // Copied out, not an `Arc` clone: every shard task of every member shares the options,
        // and a reference count touched per entry from both cores costs more than these copies.
        let (max_deliveries, max_attempts, mut backoff) = {
            let options = &self.ctx.options;
            (
                options.max_deliveries,
                options.max_attempts,
                options.backoff,
            )
        };
        match entry.status {
            EntryStatus::Present => {}
            EntryStatus::Trimmed => {
                tracing::warn!(entry = %entry.id, "entry trimmed while pending: acked without handling");
                // It may have been counted by a process that died in its handler (only ever a
                // re-delivered entry: a first delivery is never counted).
                if entry.delivery_count > 1 {
                    self.forget_attempts(entry).await;
                }
                return Ok(Outcome::Ack);
            }
            EntryStatus::TooLarge { bytes } => {
                let error = format!("entry of {bytes} bytes is over the read limit");
                self.dead_letter(entry, DeadLetterReason::TooLarge, &error, 0)
                    .await?;
                // Counted by a process with a larger limit (a rolling change of it), maybe.
                if entry.delivery_count > 1 {
                    self.forget_attempts(entry).await;
                }
                return Ok(Outcome::Ack);
            }
        }
        // `max_deliveries` counts handler attempts, not deliveries: re-reads and handovers of
        // read-ahead raise the PEL count without any attempt (docs/design.md §8.9). A first
        // delivery costs nothing; a re-delivered entry's attempts are counted in Redis just
        // before its first attempt here, and the first delivery is assumed to have reached a
        // handler (it may have killed its process uncounted). With `max_deliveries = 1` that
        // assumption would use up the one attempt, and an entry handed over unhandled would be
        // dead-lettered without any: there every delivery is counted, first ones included (two
        // round trips more per entry, the price of the strictest setting), and the count is then
        // exact.
        let counts_first = max_deliveries <= 1;
        let counted = counts_first || entry.delivery_count > 1;
        if counted {
            let attempts = match self
                .client
                .count_attempt(self.shard, token, &entry.id)
                .await?
            {
                Ok(attempts) => attempts,
                Err(fenced) => {
                    self.conflict("attempt", fenced, token).await;
                    return Ok(Outcome::Abandon);
                }
            };
            let attempt_number = if counts_first {
                attempts
            } else {
                attempts.saturating_add(1)
            };
            if attempt_number > max_deliveries {
                self.dead_letter(
                    entry,
                    DeadLetterReason::MaxDeliveries,
                    MAX_DELIVERIES_ERROR,
                    0,
                )
                .await?;
                self.forget_attempts(entry).await;
                return Ok(Outcome::Ack);
            }
        }
        let outcome = self
            .attempts(token, entry, max_attempts, &mut backoff)
            .await?;
        if counted && matches!(outcome, Outcome::Ack) {
            self.forget_attempts(entry).await;
        }
        Ok(outcome)
    }

    /// The handler attempts of one delivery of `entry`: up to `max_attempts`, in place, with
    /// growing `backoff`; a dead letter when they are used up or the error says so.
    async fn attempts(
        &mut self,
        token: &FenceToken,
        entry: &ShardEntry,
        max_attempts: u32,
        backoff: &mut Duration,
    ) -> Result<Outcome, DataPlaneError> {
        for attempt in 1..=max_attempts {
            let mut metadata = Metadata::new(
                &self.shard_key,
                self.shard,
                entry.id.clone(),
                &entry.fields,
                &self.member_id,
                token.member_epoch,
            );
            (metadata.delivery_count, metadata.attempt) = (entry.delivery_count, attempt);
            let delivery = Delivery {
                metadata,
                fields: entry.fields.clone(),
            };
            let error = match self.run_handler(delivery).await {
                Attempt::Ok => {
                    return Ok(Outcome::Ack);
                }
                Attempt::Cancelled => return Ok(Outcome::Abandon),
                Attempt::Failed(error) => error,
            };
            let reason = match &error {
                HandlerError::Decode(_) => Some(DeadLetterReason::Decode),
                HandlerError::NonRetryable(_) => Some(DeadLetterReason::NonRetryable),
                _ if attempt == max_attempts => Some(DeadLetterReason::Handler),
                _ => None,
            };
            if let Some(reason) = reason {
                self.dead_letter(entry, reason, &error.to_string(), attempt)
                    .await?;
                return Ok(Outcome::Ack);
            }
            tracing::debug!(entry = %entry.id, attempt, %error, "handler failed; retrying in place");
            // Draining: no further retries; the entry stays pending for the next owner.
            if self.revoke.is_cancelled() {
                return Ok(Outcome::Abandon);
            }
            self.pause(*backoff).await;
            // The lease may have lapsed during the backoff (heartbeats failing): no attempt
            // without it, or the shard's next owner and this one could run the entry at once.
            if self.done() || !self.may_finish() {
                return Ok(Outcome::Abandon);
            }
            *backoff = (*backoff * 2).min(MAX_BACKOFF);
        }
        Ok(Outcome::Abandon)
    }

    /// Removes `entry`'s attempt count once it is finished (handled or dead-lettered), before
    /// its ack: if the ack is then lost, the entry comes back with a fresh count, which is right
    /// (its handler did not kill the process). A failure leaves a stale field, logged.
    ///
    /// Only while the task may still finish (the `HDEL` is not fenced): a stopped task whose
    /// handler returned late (it ignored cancellation) acks nothing, and the shard's next tenure
    /// may have counted its own attempt meanwhile; the count stays, this attempt in it.
    async fn forget_attempts(&mut self, entry: &ShardEntry) {
        if !self.may_finish() {
            return;
        }
        if let Err(error) = self
            .client
            .forget_attempts(self.shard, &[entry.id.as_str()])
            .await
        {
            tracing::warn!(entry = %entry.id, %error, "removing the attempt count failed");
        }
    }

    /// One handler attempt under `handler_timeout`, cancelled at once by a stop or when the lease
    /// ends (fail closed); a drain lets it finish.
    async fn run_handler(&mut self, delivery: Delivery) -> Attempt {
        // One of the member's workers per attempt, FIFO: shards waiting for a worker are served
        // in turn, and no worker is held through a backoff or an ack. A free worker is taken
        // at once (`try_acquire` never jumps the queue: released permits go to waiters first).
        // The permit borrows `self.workers` (no reference count touched per entry): the turn is
        // released below as a field write.
        let _permit = match self.workers.try_acquire() {
            Ok(permit) => permit,
            Err(_) => {
                self.turn = None;
                let permit = tokio::select! {
                    permit = self.workers.acquire() => permit.ok(),
                    _ = self.stop.cancelled() => None,
                };
                // The wait for a worker may have outlived the lease (or the process was paused
                // in it).
                match permit {
                    Some(permit) if self.may_finish() => permit,
                    _ => return Attempt::Cancelled,
                }
            }
        };
        // Runs in the shard's own task (no spawn per entry); a panic is caught and counts as a
        // failed attempt; dropping the future cancels the handler.
        let handler = AssertUnwindSafe(self.ctx.handler.handle(delivery)).catch_unwind();
        tokio::pin!(handler);
        // Most handlers finish in their first poll: no timer is armed for them. A pending one is
        // polled again below with the task's waker.
        if let Some(outcome) = handler.as_mut().now_or_never() {
            return attempt_outcome(outcome);
        }
        self.turn = None; // the handler waits: let the member's next read round go
        // The timeout runs from the end of the first poll (no clock read for handlers that are
        // done by then; a first poll that blocks the thread cannot be timed out anyway).
        let timeout = tokio::time::sleep(self.ctx.options.handler_timeout);
        tokio::pin!(timeout);
        loop {
            let lease_end = tokio::time::sleep(self.lease_remaining());
            tokio::select! {
                outcome = &mut handler => return attempt_outcome(outcome),
                _ = &mut timeout => {
                    return Attempt::Failed(HandlerError::retryable(format!(
                        "handler timed out after {:?}", self.ctx.options.handler_timeout
                    )));
                }
                _ = self.stop.cancelled() => return Attempt::Cancelled,
                _ = lease_end => {
                    if !self.may_finish() {
                        return Attempt::Cancelled;
                    }
                }
            }
        }
    }

    async fn dead_letter(
        &mut self,
        entry: &ShardEntry,
        reason: DeadLetterReason,
        error: &str,
        attempts: u32,
    ) -> Result<(), DataPlaneError> {
        self.release_turn();
        tracing::warn!(entry = %entry.id, ?reason, attempts, error, "dead-lettering entry");
        self.client
            .dead_letter(self.shard, entry, reason, error, attempts)
            .await?;
        Ok(())
    }

    fn event(&self, event: ListenerEvent) {
        if let Some(callback) = &self.ctx.options.events {
            (callback.0)(event);
        }
    }
}

enum Attempt {
    Ok,
    Failed(HandlerError),
    Cancelled,
}

/// The attempt a finished handler future (panics caught) stands for.
fn attempt_outcome(
    outcome: Result<Result<(), HandlerError>, Box<dyn std::any::Any + Send>>,
) -> Attempt {
    match outcome {
        Ok(Ok(())) => Attempt::Ok,
        Ok(Err(error)) => Attempt::Failed(error),
        Err(panic) => Attempt::Failed(HandlerError::retryable(format!(
            "handler panicked: {}",
            panic_message(panic.as_ref())
        ))),
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".into())
}

/// Whether `member` owns `shard` with `token` and its lease holds, now.
fn holds(member: &MemberShared, shard: ShardIndex, token: &FenceToken) -> bool {
    let reconciler = member.lock();
    reconciler.may_use(shard, Instant::now()) && reconciler.token(shard) == Some(token)
}

/// The member's read rounds: with `fencing = "acks"` on a standalone server (one command may
/// span all the member's shard keys there); `None` otherwise (strict reads are fenced scripts,
/// one shard each; cluster keys of different slots cannot share a command).
fn read_rounds(ctx: &ShardTaskContext, member_id: &str) -> Option<Arc<ReadRounds>> {
    ctx.shared
        .rounds
        .get_or_init(|| {
            (ctx.options.fencing == FencingMode::Acks && !ctx.conn.is_cluster()).then(|| {
                ReadRounds::new(
                    ctx.conn.clone(),
                    ctx.group.clone(),
                    member_id.to_owned(),
                    ctx.options.batch_size,
                )
            })
        })
        .clone()
}

/// The member's worker pool: `runtime_max_concurrency` permits, FIFO, shared by its shard tasks.
fn worker_pool(ctx: &ShardTaskContext) -> Arc<Semaphore> {
    ctx.shared
        .workers
        .get_or_init(|| Arc::new(Semaphore::new(ctx.options.runtime_max_concurrency as usize)))
        .clone()
}
