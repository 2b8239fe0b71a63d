//! [`RunningApp`]: the running listeners of `run_with()`, one [`ListenerHandle`] for all of them.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use stream_listener_core::member::{ListenerHandle, MemberStatus, ShutdownError};
use stream_listener_core::model::ShardIndex;
use tokio_util::sync::CancellationToken;

use super::RunError;
use crate::registry::ListenerRegistration;

/// One listener's state, from [`RunningApp::status`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ListenerStatus {
    /// The listener's name.
    pub name: String,
    /// Its stream prefix.
    pub stream: String,
    /// Its consumer group.
    pub group: String,
    /// Each member: id, epoch, owned shards, entries handled.
    pub members: Vec<MemberStatus>,
}

impl ListenerStatus {
    /// Every shard some member of this listener owns now, ascending.
    pub fn owned_shards(&self) -> Vec<ShardIndex> {
        let set: BTreeSet<ShardIndex> = self
            .members
            .iter()
            .flat_map(|m| m.owned.iter().copied())
            .collect();
        set.into_iter().collect()
    }
}

/// The running listeners of [`crate::run_with`] or [`crate::run_listeners`].
///
/// The lifecycle (shutdown, join, signals) is [`ListenerHandle`]'s, for the members of every
/// listener at once ([`RunningApp::handle`]); this type adds what is per listener.
///
/// Dropping it does not stop the members: call [`RunningApp::shutdown_and_wait`] (or
/// [`RunningApp::run_until_signal`]) for a graceful shutdown.
#[derive(Debug)]
pub struct RunningApp {
    listeners: Vec<(ListenerRegistration, Vec<String>)>,
    members: ListenerHandle,
    /// The HTTP listener of `[observability] listen`, stopped once the members have left.
    observability: Option<crate::observability::Server>,
}

impl RunningApp {
    /// `members` of the `listeners` (each with its member ids).
    pub(crate) fn new(
        listeners: Vec<(ListenerRegistration, Vec<String>)>,
        members: ListenerHandle,
    ) -> Self {
        RunningApp {
            listeners,
            members,
            observability: None,
        }
    }

    /// Each listener's name and member count, in the order of the merged handle's members.
    pub(crate) fn listener_sizes(&self) -> Vec<(String, usize)> {
        self.listeners
            .iter()
            .map(|(registration, ids)| (registration.name().to_owned(), ids.len()))
            .collect()
    }

    /// Keeps `server` running until the members have left ([`RunningApp::join`]).
    pub(crate) fn serve_until_left(&mut self, server: crate::observability::Server) {
        self.observability = Some(server);
    }

    /// The address the HTTP listener of `[observability] listen` is bound to (the real port
    /// when `listen` gives port 0), `None` without one.
    pub fn observability_addr(&self) -> Option<std::net::SocketAddr> {
        self.observability.as_ref().map(|s| s.local_addr())
    }

    /// The members of every listener, as one handle.
    pub fn handle(&self) -> &ListenerHandle {
        &self.members
    }

    /// What every member of every listener owns and has handled now, listeners by name.
    pub fn status(&self) -> Vec<ListenerStatus> {
        // The merged handle lists the listeners' members in start order (`ListenerHandle::merge`
        // appends), so each listener's are the next `ids.len()`. Matching by id would not do:
        // with static membership every listener names its members `<instance_id>-m<k>`.
        let mut members = self.members.status().into_iter();
        self.listeners
            .iter()
            .map(|(registration, ids)| ListenerStatus {
                name: registration.name().to_owned(),
                stream: registration.stream().to_owned(),
                group: registration.group().to_owned(),
                members: members.by_ref().take(ids.len()).collect(),
            })
            .collect()
    }

    /// Waits until, for every listener, this process's members together own `shards` distinct
    /// shards, each once, spread evenly (no member owns more than one shard above another), or
    /// `timeout` passes. Returns whether they do. For tests and demos where this process is the
    /// whole group and wants a settled assignment before it publishes.
    pub async fn wait_for_assignment(&self, shards: usize, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let settled = self.status().iter().all(|l| {
                let counts: Vec<usize> = l.members.iter().map(|m| m.owned.len()).collect();
                let owned: usize = counts.iter().sum();
                let spread = counts.iter().max().unwrap_or(&0) - counts.iter().min().unwrap_or(&0);
                owned == shards && l.owned_shards().len() == shards && spread <= 1
            });
            if settled {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Starts a graceful shutdown of every listener and returns at once
    /// ([`ListenerHandle::shutdown`]).
    pub fn shutdown(&self) {
        self.members.shutdown();
    }

    /// A token whose cancellation shuts every listener down ([`ListenerHandle::shutdown_token`]).
    pub fn shutdown_token(&self) -> CancellationToken {
        self.members.shutdown_token()
    }

    /// Waits until every member of every listener has stopped ([`ListenerHandle::join`]), then
    /// stops the HTTP listener of `[observability] listen` (it answers `/readyz` with 503
    /// `shutting_down` during the drain).
    ///
    /// # Errors
    /// As [`ListenerHandle::join`]: a [`ShutdownError`] naming each handler cancelled past
    /// `shutdown_timeout` and each leave that did not reach Redis (every member has stopped
    /// either way).
    pub async fn join(self) -> Result<(), ShutdownError> {
        let joined = self.members.join().await;
        if let Some(server) = self.observability {
            server.stop().await;
        }
        joined
    }

    /// Graceful shutdown ([`ListenerHandle::shutdown_and_wait`]): stop reads, let in-flight
    /// handlers finish within `shutdown_timeout`, ack what finished, leave the groups; returns
    /// when every member has left.
    ///
    /// # Errors
    /// A [`ShutdownError`] when it was not clean ([`RunningApp::join`]).
    pub async fn shutdown_and_wait(self) -> Result<(), ShutdownError> {
        self.members.shutdown();
        self.join().await
    }

    /// Runs until SIGINT or SIGTERM (or [`RunningApp::shutdown`], or a member that stops for
    /// good), then shuts down gracefully. A shutdown that was not clean ([`ShutdownError`]) is
    /// logged as a warning and not returned: the process is exiting, and what it leaves is safe
    /// (cancelled handlers' entries stay pending for the next owner; a lost leave's lease
    /// expires).
    ///
    /// # Errors
    /// [`RunError::Signal`] when the signal handlers cannot be installed;
    /// [`RunError::MemberStopped`] after the shutdown when a member stopped for good.
    pub async fn run_until_signal(self) -> Result<(), RunError> {
        let stopped = self
            .members
            .until_signal()
            .await
            .map_err(RunError::Signal)?;
        tracing::info!("shutting down: draining in-flight work, then leaving the groups");
        match self.shutdown_and_wait().await {
            Ok(()) => tracing::info!("shut down"),
            Err(error) => {
                tracing::warn!(error = %stream_listener_core::internals::report::Chain(&error), "shut down, not cleanly");
            }
        }
        match stopped {
            Some(stopped) => Err(RunError::MemberStopped(stopped)),
            None => Ok(()),
        }
    }
}
