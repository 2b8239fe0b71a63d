//! The member runtime (docs/design.md §6.7 member rules, §7.3 concurrency, §8.13 shutdown).
//!
//! A [`Listener`] runs `concurrency` logical group members `<base>-m0 … <base>-m{N-1}` for one
//! handler. `<base>` is a UUIDv7 made at process start, or the configured `instance_id` (static
//! membership). Each member has its own heartbeat loop, assignment state, epoch and fencing
//! tokens, and polls the shards it owns with `runtime_max_concurrency` local workers (the
//! shard poller, `crate::poller`).

mod health;
mod heartbeat;
mod shutdown;

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::batch::{AnyHandler, BatchHandler};
use crate::connection::RedisTarget;
use crate::handler::Handler;
use crate::keys::{NameError, StreamKeys};
use crate::model::{Epoch, ShardIndex};
use crate::poller::ShardTaskContext;
use crate::reconciler::{Identity, Reconciler};
use crate::runtime::MemberShared;
pub use crate::runtime::Ordering;
pub use crate::runtime::{
    EventCallback, ListenerEvent, ListenerOptions, MAX_BATCH_SIZE, MAX_CONCURRENCY,
};
use crate::startup::{Connected, StartupError};
use crate::store::provision::{ProvisionError, register_group};
use health::HealthCell;
pub use health::{HealthSource, MemberHealth, MemberState};
pub use shutdown::ShutdownError;

/// Why a listener could not start or stopped.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum ListenerError {
    /// Invalid options.
    #[error("invalid listener options")]
    Options(#[from] OptionsError),
    /// Invalid stream or group name.
    #[error(transparent)]
    Name(#[from] NameError),
    /// Redis could not be reached, refused, or is too old ([`crate::startup::connect`]); check
    /// the URL and that the server runs.
    #[error("cannot start on Redis: check the URL and that the server runs")]
    Startup(#[from] StartupError),
    /// The group could not be registered (unknown stream, Redis failure, contention).
    #[error("registering the consumer group failed")]
    Register(#[source] ProvisionError),
    /// The Redis user lacks a command or key the listener needs ([`crate::acl::check_listener`],
    /// before the group is registered or a member joins); the error names it and the ACL rule to
    /// add (README "ACL users").
    #[error(transparent)]
    Permissions(#[from] crate::acl::AclCheckError),
}

crate::report::readable_debug!(ListenerError);

/// What is wrong with [`ListenerOptions`].
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum OptionsError {
    /// A count that must be positive is 0.
    #[error("{name} must be at least 1")]
    Zero {
        /// The option.
        name: &'static str,
    },
    /// A count above its limit ([`crate::runtime::MAX_BATCH_SIZE`],
    /// [`crate::runtime::MAX_CONCURRENCY`]).
    #[error("{name} must be at most {max}")]
    TooLarge {
        /// The option.
        name: &'static str,
        /// The limit.
        max: u64,
    },
    /// A duration that must be positive is zero.
    #[error("{name} must be positive")]
    NotPositive {
        /// The option.
        name: &'static str,
    },
    /// A duration above the longest the protocol accepts.
    #[error("{name} is longer than {} s: use a shorter value", max.as_secs())]
    TooLong {
        /// The option.
        name: &'static str,
        /// The limit.
        max: Duration,
    },
    /// The protocol timings ([`ListenerOptions::coordination`]) are invalid.
    #[error("invalid coordination timings")]
    Coordination(#[source] crate::coordinator::TimingsError),
    /// `hook_timeout` is zero or not below `coordination.rebalance_timeout` (an `on_revoked`
    /// runs before the release, so a longer one could get the member fenced while it drains).
    #[error(
        "hook_timeout ({hook_timeout:?}) must be positive and below rebalance_timeout ({rebalance_timeout:?}): lower hook_timeout"
    )]
    HookTimeout {
        /// The hook timeout given.
        hook_timeout: Duration,
        /// The rebalance timeout it must stay below.
        rebalance_timeout: Duration,
    },
    /// `batch_max_wait` is above half of `coordination.member_lease_ttl`: a shard waiting that
    /// long for a fuller batch would leave its batch too little of the lease to run in.
    #[error(
        "batch_max_wait ({batch_max_wait:?}) must be at most half of member_lease_ttl ({member_lease_ttl:?}): lower batch_max_wait"
    )]
    BatchMaxWait {
        /// The wait given.
        batch_max_wait: Duration,
        /// The member lease it must leave room in.
        member_lease_ttl: Duration,
    },
    /// `min_replica_acks > 0` with a `replica_ack_timeout` of zero (`WAIT … 0` would block
    /// forever) or not below `coordination.heartbeat_interval` (a `WAIT` holds the connection it
    /// is sent on; README "Waiting for replicas").
    #[error(
        "replica_ack_timeout ({replica_ack_timeout:?}) must be positive and below heartbeat_interval ({heartbeat_interval:?}) when min_replica_acks > 0: lower it"
    )]
    ReplicaAckTimeout {
        /// The timeout given.
        replica_ack_timeout: Duration,
        /// The heartbeat interval it must stay below.
        heartbeat_interval: Duration,
    },
}

crate::report::readable_debug!(OptionsError);

/// A listener's members, running.
#[derive(Debug)]
pub struct ListenerHandle {
    shutdown: CancellationToken,
    /// Each member's id, state and task; the task returns what went wrong in its shutdown.
    members: Vec<(String, Arc<MemberShared>, JoinHandle<Vec<ShutdownError>>)>,
    /// One per listener merged in ([`ListenerHandle::merge`]).
    stopped: Vec<tokio::sync::watch::Receiver<Option<MemberStopped>>>,
    /// Each member's health record, in the order of `members`.
    health: Vec<Arc<HealthCell>>,
}

/// A member that stopped for good while the listener was meant to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberStopped {
    /// The member id.
    pub member_id: String,
    /// Why, in words that say what to do.
    pub reason: String,
}

/// What a member owns now (for logs and the quick start).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberStatus {
    /// Member id.
    pub member_id: String,
    /// Member epoch.
    pub member_epoch: Epoch,
    /// Owned shards, ascending.
    pub owned: Vec<ShardIndex>,
    /// Entries handled successfully so far.
    pub handled: u64,
}

impl ListenerHandle {
    /// The member ids, `<base>-m0` first.
    pub fn member_ids(&self) -> Vec<String> {
        self.members.iter().map(|(id, _, _)| id.clone()).collect()
    }

    /// What each member owns and has handled now.
    pub fn status(&self) -> Vec<MemberStatus> {
        self.members
            .iter()
            .map(|(id, shared, _)| {
                let reconciler = shared.lock();
                MemberStatus {
                    member_id: id.clone(),
                    member_epoch: reconciler.epoch(),
                    owned: reconciler.owned().keys().copied().collect(),
                    handled: shared.handled.load(std::sync::atomic::Ordering::Relaxed),
                }
            })
            .collect()
    }

    /// Every member's health now (docs/design.md §13.2), in the order of
    /// [`ListenerHandle::member_ids`]: its [`MemberState`], why, liveness (it heartbeats within
    /// its lease) and readiness (joined, holding its assignment, lease valid, not fenced, not
    /// shutting down), its epoch, owned / assigned / pending / revoking shards and its lease on
    /// the member's clock. Sends nothing to Redis; cheap enough for every probe.
    pub fn health(&self) -> Vec<MemberHealth> {
        self.health_source().health()
    }

    /// A cloneable view of the members for [`HealthSource::health`] snapshots taken elsewhere
    /// (an HTTP listener's task), valid for the members' whole life.
    pub fn health_source(&self) -> HealthSource {
        HealthSource {
            shutdown: self.shutdown.clone(),
            members: self
                .members
                .iter()
                .map(|(_, shared, _)| shared.clone())
                .zip(self.health.iter().cloned())
                .collect(),
        }
    }

    /// Pauses every shard of every member of this handle, in this process (docs/design.md §14.4):
    /// no shard task starts a read or a handler attempt until [`ListenerHandle::resume`]. An
    /// attempt in flight finishes and is acked (with `ordering = "key"` or `"none"`, every entry
    /// running on a shard; a failed attempt is not retried while paused, and a batch listener's
    /// batch in its backoff is not tried again); entries read but not started stay pending and
    /// are handled, in order, after the resume. Heartbeats go on, so a pause of any length keeps
    /// the members' assignments and starts no rebalance; a paused shard that is revoked is
    /// released at once, and a shutdown still shuts down. Idempotent; the members stay ready
    /// ([`MemberHealth::paused`] says they are paused).
    pub fn pause(&self) {
        for (_, shared, _) in &self.members {
            shared.set_paused(true);
        }
    }

    /// Ends a [`ListenerHandle::pause`]: every shard task goes back to its own pending entries
    /// (from `0`), then reads new ones. Idempotent; a shard paused by a handler's
    /// [`crate::handler::HandlerError::pause_shard`] stays paused until its own pause ends.
    pub fn resume(&self) {
        for (_, shared, _) in &self.members {
            shared.set_paused(false);
        }
    }

    /// Whether the members are paused ([`ListenerHandle::pause`] called, no
    /// [`ListenerHandle::resume`] since); `false` for a handle without members.
    pub fn is_paused(&self) -> bool {
        !self.members.is_empty() && self.members.iter().all(|(_, shared, _)| shared.is_paused())
    }

    /// Asks every member to shut down gracefully: stop reads, finish in-flight handlers within
    /// `shutdown_timeout`, ack, and leave (`-1`, or `-2` for a static member) reporting every
    /// shard `REVOKED`. Returns at once; [`ListenerHandle::join`] waits.
    pub fn shutdown(&self) {
        self.shutdown.cancel();
    }

    /// A token cancelled when shutdown starts (to tie other work to the listener).
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// Waits until every member has stopped (after [`ListenerHandle::shutdown`], or for good
    /// after `FENCED_INSTANCE_ID`).
    ///
    /// # Errors
    /// A [`ShutdownError`] when the shutdown was not clean: a handler still ran past
    /// `shutdown_timeout` ([`ShutdownError::HandlerCancelled`]: cancelled, its entry stays
    /// pending for the next owner) or a leave did not reach Redis
    /// ([`ShutdownError::LeaveNotDelivered`]: the member's shards move when its lease expires);
    /// [`ShutdownError::Several`] for more than one. Every member has stopped either way.
    pub async fn join(self) -> Result<(), ShutdownError> {
        let mut problems = Vec::new();
        for (_, _, task) in self.members {
            // An aborted or panicked member task has nothing more to report.
            if let Ok(found) = task.await {
                problems.extend(found);
            }
        }
        ShutdownError::from_problems(problems)
    }

    /// Resolves when a member stops for good on its own (today: another process took its static
    /// identity, `FENCED_INSTANCE_ID`), with which member and why; never resolves otherwise. An
    /// application should then exit with an error rather than run with fewer members.
    pub async fn stopped_for_good(&self) -> MemberStopped {
        let waits = self.stopped.iter().map(|stopped| {
            let mut stopped = stopped.clone();
            Box::pin(async move {
                // Cloned out at once: the watch guard must not live across an await (Send futures).
                let found = stopped
                    .wait_for(Option::is_some)
                    .await
                    .map(|value| value.clone());
                match found {
                    Ok(Some(stopped)) => stopped,
                    _ => std::future::pending().await,
                }
            })
        });
        if self.stopped.is_empty() {
            return std::future::pending().await;
        }
        futures_util::future::select_all(waits).await.0
    }

    /// Shuts down ([`ListenerHandle::shutdown`]) and waits ([`ListenerHandle::join`]).
    ///
    /// # Errors
    /// As [`ListenerHandle::join`]: a handler cancelled past `shutdown_timeout`, a leave that
    /// did not reach Redis.
    pub async fn shutdown_and_wait(self) -> Result<(), ShutdownError> {
        self.shutdown();
        self.join().await
    }

    /// Waits for the first SIGINT or SIGTERM, [`ListenerHandle::shutdown`], or a member that stops
    /// for good ([`ListenerHandle::stopped_for_good`], returned). Shuts nothing down itself.
    ///
    /// # Errors
    /// An [`std::io::Error`] when the signal handlers cannot be installed.
    pub async fn until_signal(&self) -> std::io::Result<Option<MemberStopped>> {
        self.wait_for_stop(true).await
    }

    async fn wait_for_stop(&self, or_member: bool) -> std::io::Result<Option<MemberStopped>> {
        let mut terminate =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            result = tokio::signal::ctrl_c() => result.map(|()| None),
            _ = terminate.recv() => Ok(None),
            _ = self.shutdown.cancelled() => Ok(None),
            stopped = self.stopped_for_good(), if or_member => Ok(Some(stopped)),
        }
    }

    /// Shuts down gracefully on the first SIGINT or SIGTERM (or when [`ListenerHandle::shutdown`]
    /// is called), then waits until every member has left. A shutdown that was not clean
    /// ([`ShutdownError`]) is logged as a warning, not returned: the process is exiting, and
    /// what it leaves behind is safe (pending entries go to the next owner, leases expire).
    ///
    /// # Errors
    /// An [`std::io::Error`] when the signal handlers cannot be installed.
    pub async fn run_until_signal(self) -> std::io::Result<()> {
        self.wait_for_stop(false).await?;
        tracing::info!("shutting down: draining in-flight work, then leaving the group");
        if let Err(error) = self.shutdown_and_wait().await {
            tracing::warn!(error = %crate::report::Chain(&error), "shutdown was not clean");
        }
        Ok(())
    }

    /// One handle for the members of `self` and `other` (the listeners of one process): shutting
    /// it down, or cancelling its [`ListenerHandle::shutdown_token`], shuts both down; `join`
    /// waits for both; [`ListenerHandle::status`] lists `self`'s members first.
    ///
    /// # Panics
    /// Outside a Tokio runtime (it spawns the task that forwards the shutdown).
    pub fn merge(mut self, other: ListenerHandle) -> ListenerHandle {
        let (ours, theirs) = (self.shutdown.clone(), other.shutdown.clone());
        tokio::spawn(async move {
            ours.cancelled().await;
            theirs.cancel();
        });
        self.members.extend(other.members);
        self.stopped.extend(other.stopped);
        self.health.extend(other.health);
        self
    }

    /// Stops every member at once without leaving the group, as a crash would: in-flight
    /// handlers are cancelled, nothing more is acked, and the members' shards move only when
    /// their leases run out. For fault-injection tests.
    pub fn abort(self) {
        for (_, _, task) in &self.members {
            task.abort();
        }
    }
}

/// A listener: a handler bound to a stream and a consumer group.
pub struct Listener {
    target: RedisTarget,
    stream: StreamKeys,
    group: String,
    handler: AnyHandler,
    options: ListenerOptions,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener")
            .field("stream", &self.stream.prefix())
            .field("group", &self.group)
            .field("options", &self.options)
            .finish()
    }
}

impl Listener {
    /// The listener's options, as validated by [`Listener::new`].
    pub fn options(&self) -> &ListenerOptions {
        &self.options
    }

    /// A listener of `group` on stream `stream` at `target`, running `handler`.
    ///
    /// # Errors
    /// [`ListenerError::Name`] for a prefix with `{`/`}` or a group with `:`/`{`/`}`;
    /// [`ListenerError::Options`] for zero concurrency, workers, batch size, attempts or
    /// `max_in_flight`, a concurrency above [`MAX_CONCURRENCY`] or a batch size above
    /// [`MAX_BATCH_SIZE`] ([`OptionsError::TooLarge`]), a timing above the protocol's limit, a zero `metrics_interval`
    /// ([`OptionsError::NotPositive`]), or a `hook_timeout` that is zero or not below the
    /// rebalance timeout ([`OptionsError::HookTimeout`]).
    pub fn new(
        target: RedisTarget,
        stream: &str,
        group: &str,
        handler: impl Handler,
        options: ListenerOptions,
    ) -> Result<Self, ListenerError> {
        Self::build(
            target,
            stream,
            group,
            AnyHandler::Entry(Arc::new(handler)),
            options,
        )
    }

    /// A batch listener of `group` on stream `stream` at `target` (docs/design.md §14.2):
    /// `handler` gets the decoded entries of one shard read at once, up to `batch_size`, in
    /// entry order, waiting up to `batch_max_wait` for a fuller batch.
    ///
    /// # Errors
    /// As [`Listener::new`], and [`ListenerError::Options`] with
    /// [`OptionsError::BatchMaxWait`] for a `batch_max_wait` above half of
    /// `coordination.member_lease_ttl`.
    pub fn new_batch<T: Send + 'static>(
        target: RedisTarget,
        stream: &str,
        group: &str,
        handler: impl BatchHandler<T>,
        options: ListenerOptions,
    ) -> Result<Self, ListenerError> {
        Self::build(target, stream, group, AnyHandler::batch(handler), options)
    }

    /// A listener running `handler`, per entry or per batch
    /// ([`ListenerHandler`](crate::batch::ListenerHandler)): what [`Listener::new`] and
    /// [`Listener::new_batch`] build, for a handler whose kind is decided at run time (the
    /// facade's registrations).
    ///
    /// # Errors
    /// As [`Listener::new`], and for a batch handler as [`Listener::new_batch`].
    pub fn with_handler(
        target: RedisTarget,
        stream: &str,
        group: &str,
        handler: crate::batch::ListenerHandler,
        options: ListenerOptions,
    ) -> Result<Self, ListenerError> {
        Self::build(target, stream, group, handler.0, options)
    }

    /// The validation of [`Listener::new`] and [`Listener::new_batch`].
    fn build(
        target: RedisTarget,
        stream: &str,
        group: &str,
        handler: AnyHandler,
        options: ListenerOptions,
    ) -> Result<Self, ListenerError> {
        let stream = StreamKeys::new(stream)?;
        stream.group(group)?;
        let zero = [
            ("concurrency", options.concurrency == 0),
            (
                "runtime_max_concurrency",
                options.runtime_max_concurrency == 0,
            ),
            ("batch_size", options.batch_size == 0),
            ("max_attempts", options.max_attempts == 0),
            ("max_in_flight", options.max_in_flight == 0),
        ];
        if let Some((name, _)) = zero.iter().find(|(_, zero)| *zero) {
            return Err(OptionsError::Zero { name }.into());
        }
        let limits = [
            (
                "batch_size",
                options.batch_size as u64,
                crate::runtime::MAX_BATCH_SIZE as u64,
            ),
            (
                "concurrency",
                u64::from(options.concurrency),
                u64::from(crate::runtime::MAX_CONCURRENCY),
            ),
        ];
        if let Some(&(name, _, max)) = limits.iter().find(|(_, value, max)| value > max) {
            return Err(OptionsError::TooLarge { name, max }.into());
        }
        options
            .coordination
            .validate()
            .map_err(OptionsError::Coordination)?;
        let max = crate::coordinator::MAX_TIMING;
        let timings = [
            ("block", options.block),
            ("backoff", options.backoff),
            ("handler_timeout", options.handler_timeout),
            ("shutdown_timeout", options.shutdown_timeout),
            ("retention_interval", options.retention_interval),
            ("metrics_interval", options.metrics_interval),
            ("batch_max_wait", options.batch_max_wait),
        ];
        if let Some((name, _)) = timings.iter().find(|(_, value)| *value > max) {
            return Err(OptionsError::TooLong { name, max }.into());
        }
        if options.metrics_interval.is_zero() {
            return Err(OptionsError::NotPositive {
                name: "metrics_interval",
            }
            .into());
        }
        let rebalance_timeout = options.coordination.rebalance_timeout;
        if let Some(hook_timeout) = options.hook_timeout
            && (hook_timeout.is_zero() || hook_timeout >= rebalance_timeout)
        {
            return Err(OptionsError::HookTimeout {
                hook_timeout,
                rebalance_timeout,
            }
            .into());
        }
        // The batch's wait must leave it the lease to run in (docs/design.md §14.2).
        let member_lease_ttl = options.coordination.member_lease_ttl;
        if options.batch_max_wait > member_lease_ttl / 2 {
            return Err(OptionsError::BatchMaxWait {
                batch_max_wait: options.batch_max_wait,
                member_lease_ttl,
            }
            .into());
        }
        let heartbeat_interval = options.coordination.heartbeat_interval;
        if options.min_replica_acks > 0
            && (options.replica_ack_timeout.is_zero()
                || options.replica_ack_timeout >= heartbeat_interval)
        {
            return Err(OptionsError::ReplicaAckTimeout {
                replica_ack_timeout: options.replica_ack_timeout,
                heartbeat_interval,
            }
            .into());
        }
        Ok(Listener {
            target,
            stream,
            group: group.to_owned(),
            handler,
            options,
        })
    }

    /// Connects ([`crate::startup::connect`]: one attempt, then the Redis version check) and
    /// starts on that connection ([`Listener::start_on`]).
    ///
    /// # Errors
    /// [`ListenerError::Startup`] when Redis does not answer, refuses or is too old; otherwise as
    /// [`Listener::start_on`].
    pub async fn start(self) -> Result<ListenerHandle, ListenerError> {
        let connected = crate::startup::connect(&self.target, None).await?;
        self.start_on(&connected).await
    }

    /// Registers the group on the stream if needed (docs/design.md §8, groups) and starts the
    /// members, on a connection that passed the startup checks (shared by the listeners of one
    /// process).
    ///
    /// # Errors
    /// [`ListenerError::Register`] when the group cannot be registered, e.g. when the stream does
    /// not exist (`StoreError::MissingStream` in its source says how to create it).
    pub async fn start_on(self, connected: &Connected) -> Result<ListenerHandle, ListenerError> {
        let conn = connected.connection();
        let mut admin_conn = conn.clone();
        let group_keys = self.stream.group(&self.group)?;
        crate::acl::check_listener(
            &mut admin_conn,
            &self.stream,
            &group_keys,
            self.options.auto_create_shards.is_some(),
            self.options.min_replica_acks > 0,
        )
        .await?;
        register_group(
            &mut admin_conn,
            self.stream.prefix(),
            &self.group,
            self.options.start_from,
        )
        .await
        .map_err(ListenerError::Register)?;
        let base = self
            .options
            .instance_id
            .clone()
            .unwrap_or_else(|| uuid::Uuid::now_v7().to_string());
        let process_id = uuid::Uuid::now_v7().to_string();
        let shutdown = CancellationToken::new();
        let (stopped_tx, stopped) = tokio::sync::watch::channel(None);
        let stopped_tx = Arc::new(stopped_tx);
        let shared_options = Arc::new(self.options);
        let mut members = Vec::new();
        let mut healths = Vec::new();
        for k in 0..shared_options.concurrency {
            let member_id = format!("{base}-m{k}");
            let identity = Identity {
                member_id: member_id.clone(),
                member_name: shared_options.name.clone(),
                instance_id: shared_options
                    .instance_id
                    .as_ref()
                    .map(|i| format!("{i}-m{k}")),
                process_id: process_id.clone(),
                runtime_max_concurrency: shared_options.runtime_max_concurrency,
            };
            let shared = Arc::new(MemberShared::new(Reconciler::new(identity)));
            let health = Arc::new(HealthCell::new(
                shared_options.coordination.member_lease_ttl,
            ));
            // The worker pool and the read rounds are the member's, made before any shard task.
            let ctx = ShardTaskContext::new(
                self.target.clone(),
                conn.clone(),
                self.stream.clone(),
                self.group.clone(),
                self.handler.clone(),
                shared_options.clone(),
                shared.clone(),
            );
            let member = heartbeat::Member {
                ctx: Arc::new(ctx),
                shutdown: shutdown.clone(),
                member_stop: CancellationToken::new(),
                stopped: stopped_tx.clone(),
                health: health.clone(),
            };
            let task = tokio::spawn(member.run());
            members.push((member_id, shared, task));
            healths.push(health);
        }
        Ok(ListenerHandle {
            shutdown,
            members,
            stopped: vec![stopped],
            health: healths,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn new_with(options: ListenerOptions) -> Result<Listener, ListenerError> {
        let target = RedisTarget::standalone("redis://127.0.0.1:1");
        let handler = |_: crate::handler::Delivery| async { Ok(()) };
        Listener::new(target, "orders", "billing", handler, options)
    }

    #[test]
    fn replica_ack_timeout_must_be_positive_and_below_the_heartbeat_interval() {
        let mut options = ListenerOptions {
            replica_ack_timeout: Duration::ZERO,
            ..ListenerOptions::default()
        };
        assert!(new_with(options.clone()).is_ok(), "off: not checked");
        options.min_replica_acks = 1;
        for timeout in [Duration::ZERO, options.coordination.heartbeat_interval] {
            options.replica_ack_timeout = timeout;
            match new_with(options.clone()) {
                Err(ListenerError::Options(OptionsError::ReplicaAckTimeout {
                    replica_ack_timeout,
                    ..
                })) => assert_eq!(replica_ack_timeout, timeout),
                other => panic!("{timeout:?}: {:?}", other.err()),
            }
        }
        options.replica_ack_timeout = Duration::from_millis(100);
        assert!(new_with(options).is_ok());
    }

    #[test]
    fn a_given_hook_timeout_must_be_positive_and_below_the_rebalance_timeout() {
        let mut options = ListenerOptions::default();
        assert!(
            new_with(options.clone()).is_ok(),
            "the default is capped, never refused"
        );
        for bad in [Duration::ZERO, options.coordination.rebalance_timeout] {
            options.hook_timeout = Some(bad);
            match new_with(options.clone()) {
                Err(ListenerError::Options(OptionsError::HookTimeout {
                    hook_timeout,
                    rebalance_timeout,
                })) => {
                    assert_eq!(hook_timeout, bad);
                    assert_eq!(rebalance_timeout, options.coordination.rebalance_timeout);
                }
                other => panic!("{bad:?}: {other:?}"),
            }
        }
        options.hook_timeout = Some(Duration::from_secs(1));
        assert!(new_with(options).is_ok());
    }

    #[test]
    fn a_batch_listener_is_validated_as_any_and_its_wait_must_leave_half_the_lease() {
        let target = RedisTarget::standalone("redis://127.0.0.1:1");
        let handler = |_: crate::batch::Batch<crate::extract::RawMessage>| async {};
        let mut options = ListenerOptions::default();
        options.batch_max_wait = options.coordination.member_lease_ttl / 2;
        assert!(
            Listener::new_batch(
                target.clone(),
                "orders",
                "billing",
                handler,
                options.clone()
            )
            .is_ok()
        );
        options.batch_max_wait += Duration::from_millis(1);
        match Listener::new_batch(
            target.clone(),
            "orders",
            "billing",
            handler,
            options.clone(),
        ) {
            Err(ListenerError::Options(OptionsError::BatchMaxWait {
                batch_max_wait,
                member_lease_ttl,
            })) => {
                assert_eq!(batch_max_wait, options.batch_max_wait);
                assert_eq!(member_lease_ttl, options.coordination.member_lease_ttl);
            }
            other => panic!("{other:?}"),
        }
        options.batch_max_wait = Duration::ZERO;
        options.batch_size = 0;
        assert!(matches!(
            Listener::new_batch(target, "orders", "billing", handler, options),
            Err(ListenerError::Options(OptionsError::Zero {
                name: "batch_size"
            }))
        ));
    }

    /// Counts above their limits are refused before anything starts (a `batch_size` past
    /// Redis's `COUNT` failed every read).
    #[test]
    fn counts_above_their_limits_are_refused() {
        for (options, name, max) in [
            (
                ListenerOptions {
                    batch_size: crate::runtime::MAX_BATCH_SIZE + 1,
                    ..ListenerOptions::default()
                },
                "batch_size",
                100_000,
            ),
            (
                ListenerOptions {
                    concurrency: 1025,
                    ..ListenerOptions::default()
                },
                "concurrency",
                1024,
            ),
        ] {
            match new_with(options) {
                Err(ListenerError::Options(OptionsError::TooLarge { name: n, max: m })) => {
                    assert_eq!((n, m), (name, max));
                }
                other => panic!("{name}: {other:?}"),
            }
        }
    }

    /// A zero interval would sample every shard between every two reads (a script call each).
    #[test]
    fn a_zero_metrics_interval_is_refused() {
        let options = ListenerOptions {
            metrics_interval: Duration::ZERO,
            ..ListenerOptions::default()
        };
        match new_with(options) {
            Err(ListenerError::Options(OptionsError::NotPositive { name })) => {
                assert_eq!(name, "metrics_interval");
            }
            other => panic!("{other:?}"),
        }
    }
}
