//! The member runtime (docs/design.md §6.7 member rules, §7.3 concurrency, §8.13 shutdown).
//!
//! A [`Listener`] runs `concurrency` logical group members `<base>-m0 … <base>-m{N-1}` for one
//! handler. `<base>` is a UUIDv7 made at process start, or the configured `instance_id` (static
//! membership). Each member has its own heartbeat loop, assignment state, epoch and fencing
//! tokens, and polls the shards it owns with `runtime_max_concurrency` local workers (the
//! shard poller, `crate::poller`).

mod heartbeat;

use std::sync::Arc;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::connection::{RedisConnection, RedisTarget};
use crate::handler::Handler;
use crate::keys::{NameError, StreamKeys};
use crate::model::{Epoch, ShardIndex};
use crate::poller::ShardTaskContext;
use crate::reconciler::{Identity, Reconciler};
use crate::runtime::MemberShared;
pub use crate::runtime::{EventCallback, ListenerEvent, ListenerOptions};
use crate::store::StoreError;

/// Why a listener could not start or stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ListenerError {
    /// Invalid options.
    #[error("invalid listener options: {0}")]
    Options(String),
    /// Invalid stream or group name.
    #[error(transparent)]
    Name(#[from] NameError),
    /// Redis unreachable at start.
    #[error("cannot connect to Redis: {0}; check the URL and that the server runs")]
    Connect(#[source] redis::RedisError),
    /// The store refused (missing stream, Redis error).
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The group could not be registered.
    #[error("registering the consumer group failed: {0}")]
    Register(String),
}

/// A listener's members, running.
#[derive(Debug)]
pub struct ListenerHandle {
    shutdown: CancellationToken,
    members: Vec<(String, Arc<MemberShared>, JoinHandle<()>)>,
    stopped: tokio::sync::watch::Receiver<Option<MemberStopped>>,
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
    pub async fn join(self) {
        for (_, _, task) in self.members {
            let _ = task.await;
        }
    }

    /// Resolves when a member stops for good on its own (today: another process took its static
    /// identity, `FENCED_INSTANCE_ID`), with which member and why; never resolves otherwise. An
    /// application should then exit with an error rather than run with fewer members.
    pub async fn stopped_for_good(&self) -> MemberStopped {
        let mut stopped = self.stopped.clone();
        // Cloned out at once: the watch guard must not live across an await (Send futures).
        let found = stopped
            .wait_for(Option::is_some)
            .await
            .map(|value| value.clone());
        match found {
            Ok(Some(stopped)) => stopped,
            _ => std::future::pending().await,
        }
    }

    /// Shuts down and waits.
    pub async fn shutdown_and_wait(self) {
        self.shutdown();
        self.join().await;
    }

    /// Shuts down gracefully on the first SIGINT or SIGTERM (or when [`ListenerHandle::shutdown`]
    /// is called), then waits until every member has left.
    ///
    /// # Errors
    /// An [`std::io::Error`] when the signal handlers cannot be installed.
    pub async fn run_until_signal(self) -> std::io::Result<()> {
        let mut terminate =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            result = tokio::signal::ctrl_c() => result?,
            _ = terminate.recv() => {}
            _ = self.shutdown.cancelled() => {}
        }
        tracing::info!("shutting down: draining in-flight work, then leaving the group");
        self.shutdown_and_wait().await;
        Ok(())
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
    handler: Arc<dyn Handler>,
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
    /// A listener of `group` on stream `stream` at `target`, running `handler`.
    ///
    /// # Errors
    /// [`ListenerError::Name`] for a prefix with `{`/`}` or a group with `:`/`{`/`}`;
    /// [`ListenerError::Options`] for zero concurrency, workers, batch size or attempts.
    pub fn new(
        target: RedisTarget,
        stream: &str,
        group: &str,
        handler: impl Handler,
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
        ];
        if let Some((name, _)) = zero.iter().find(|(_, zero)| *zero) {
            return Err(ListenerError::Options(format!("{name} must be at least 1")));
        }
        options
            .coordination
            .validate()
            .map_err(|e| ListenerError::Options(e.to_string()))?;
        let max = crate::coordinator::MAX_TIMING;
        let timings = [
            ("block", options.block),
            ("backoff", options.backoff),
            ("handler_timeout", options.handler_timeout),
            ("shutdown_timeout", options.shutdown_timeout),
        ];
        if let Some((name, _)) = timings.iter().find(|(_, value)| *value > max) {
            return Err(ListenerError::Options(format!(
                "{name} is longer than {} s: use a shorter value",
                max.as_secs()
            )));
        }
        Ok(Listener {
            target,
            stream,
            group: group.to_owned(),
            handler: Arc::new(handler),
            options,
        })
    }

    /// Connects, registers the group on the stream if needed (docs/design.md §8, groups), and
    /// starts the members.
    ///
    /// # Errors
    /// [`ListenerError::Connect`] when Redis does not answer; [`ListenerError::Store`] when the
    /// stream does not exist ([`StoreError::MissingStream`] says how to create it);
    /// [`ListenerError::Register`] when the group cannot be registered.
    pub async fn start(self) -> Result<ListenerHandle, ListenerError> {
        let conn =
            RedisConnection::connect(&self.target, crate::connection::DEFAULT_RESPONSE_TIMEOUT)
                .await
                .map_err(ListenerError::Connect)?;
        let mut admin_conn = conn.clone();
        crate::admin::register_group(
            &mut admin_conn,
            self.stream.prefix(),
            &self.group,
            self.options.start_from,
        )
        .await
        .map_err(|e| ListenerError::Register(e.to_string()))?;
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
            };
            let task = tokio::spawn(member.run());
            members.push((member_id, shared, task));
        }
        Ok(ListenerHandle {
            shutdown,
            members,
            stopped,
        })
    }
}
