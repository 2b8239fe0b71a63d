//! Lifecycle hooks of a listener (docs/design.md §13.3), modelled on Kafka's
//! `ConsumerRebalanceListener`: `on_assigned` when a member gains a shard, `on_revoked` when it
//! gives one up in order (drained and acked, before the release), `on_lost` when it lost one
//! without a release (fenced, lease expired: someone else may own it already).
//!
//! Each call is about **one shard**: a member takes over, drains and releases each shard on its
//! own (a drained shard is released without waiting for the slowest of the others), so the order
//! guarantees hold per shard. A hook runs on the shard's task under
//! [`ListenerOptions::hook_timeout`](crate::member::ListenerOptions::hook_timeout); an error, a
//! panic or a timeout is logged (warn) and never stops the member or delays the release beyond
//! the timeout.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;

use crate::handler::BoxError;
use crate::model::{Epoch, ShardIndex};

/// The limit of one hook call when `hook_timeout` is not given, unless half the rebalance
/// timeout is shorter ([`ListenerOptions::effective_hook_timeout`](crate::member::ListenerOptions::effective_hook_timeout)).
pub const DEFAULT_HOOK_TIMEOUT: Duration = Duration::from_secs(10);

/// The future a [`ShardHook`] returns.
pub type HookFuture = Pin<Box<dyn Future<Output = Result<(), BoxError>> + Send + 'static>>;

/// What a hook is told: which listener and member gained or gave up which shard.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShardHookContext {
    /// The stream prefix, e.g. `orders`.
    pub stream: String,
    /// The consumer group.
    pub group: String,
    /// The listener's name (its `[listeners.<name>]` section).
    pub listener: String,
    /// The member (`<base>-m<k>`).
    pub member_id: String,
    /// The member epoch it was given the shard at.
    pub member_epoch: Epoch,
    /// The shard assigned, revoked or lost.
    pub shard: ShardIndex,
}

impl ShardHookContext {
    /// A context for `shard` of `stream`/`group`, owned by `member_id` of listener `listener` at
    /// `member_epoch`. Public so that a hook can be unit-tested.
    pub fn new(
        stream: &str,
        group: &str,
        listener: &str,
        member_id: &str,
        member_epoch: Epoch,
        shard: ShardIndex,
    ) -> Self {
        ShardHookContext {
            stream: stream.to_owned(),
            group: group.to_owned(),
            listener: listener.to_owned(),
            member_id: member_id.to_owned(),
            member_epoch,
            shard,
        }
    }
}

/// A lifecycle hook. Implemented for every
/// `Fn(ShardHookContext) -> impl Future<Output = Result<(), E>>` where `E` converts into a
/// [`BoxError`] (any `std::error::Error + Send + Sync`, or a `String`).
pub trait ShardHook: Send + Sync + 'static {
    /// Runs the hook for one shard.
    fn call(&self, context: ShardHookContext) -> HookFuture;
}

impl<F, Fut, E> ShardHook for F
where
    F: Fn(ShardHookContext) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), E>> + Send + 'static,
    E: Into<BoxError>,
{
    fn call(&self, context: ShardHookContext) -> HookFuture {
        let future = self(context);
        Box::pin(async move { future.await.map_err(Into::into) })
    }
}

/// What a hook function registered through `#[stream_listener(on_revoked = path)]` may return:
/// `()` or `Result<(), E>` with `E` converting into a [`BoxError`].
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a lifecycle hook's result",
    label = "return `()` or `Result<(), E>`",
    note = "a hook is `async fn(ShardHookContext) -> ()` or `-> Result<(), E>` where `E: std::error::Error + Send + Sync + 'static`"
)]
pub trait IntoHookResult {
    /// The hook's outcome.
    ///
    /// # Errors
    /// The function's error, boxed.
    fn into_hook_result(self) -> Result<(), BoxError>;
}

impl IntoHookResult for () {
    fn into_hook_result(self) -> Result<(), BoxError> {
        Ok(())
    }
}

impl<E: Into<BoxError>> IntoHookResult for Result<(), E> {
    fn into_hook_result(self) -> Result<(), BoxError> {
        self.map_err(Into::into)
    }
}

/// Which hook ran: the `hook` label of `stream_listener_hook_failures_total` and of the logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum HookKind {
    /// The member gained the shard; runs before its first handler.
    Assigned,
    /// The member drained the shard (in-flight handlers finished, acks written); runs before
    /// the release is reported.
    Revoked,
    /// The member lost the shard without a release (fencing status, lease expired, stopped).
    Lost,
}

impl HookKind {
    /// `on_assigned`, `on_revoked` or `on_lost`.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            HookKind::Assigned => "on_assigned",
            HookKind::Revoked => "on_revoked",
            HookKind::Lost => "on_lost",
        }
    }
}

/// The hooks of one listener ([`ListenerOptions::hooks`](crate::member::ListenerOptions::hooks));
/// each is optional. Set them with [`Hooks::on_assigned`], [`Hooks::on_revoked`] and
/// [`Hooks::on_lost`].
#[derive(Clone, Default)]
pub struct Hooks {
    on_assigned: Option<Arc<dyn ShardHook>>,
    on_revoked: Option<Arc<dyn ShardHook>>,
    on_lost: Option<Arc<dyn ShardHook>>,
}

impl std::fmt::Debug for Hooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hooks")
            .field("on_assigned", &self.on_assigned.is_some())
            .field("on_revoked", &self.on_revoked.is_some())
            .field("on_lost", &self.on_lost.is_some())
            .finish()
    }
}

impl Hooks {
    /// Runs `hook` when the member gains a shard, before the shard's first handler.
    pub fn on_assigned(&mut self, hook: impl ShardHook) -> &mut Self {
        self.on_assigned = Some(Arc::new(hook));
        self
    }

    /// Runs `hook` when the member gives a shard up in order: after its last handler finished and
    /// its acks were written, before the release is reported (the place to flush side state).
    pub fn on_revoked(&mut self, hook: impl ShardHook) -> &mut Self {
        self.on_revoked = Some(Arc::new(hook));
        self
    }

    /// Runs `hook` when the member lost a shard without a release (fenced, lease expired,
    /// stopped, or the last acks could not be written): another member may own it already, or
    /// will handle some of its entries again, so commit nothing.
    pub fn on_lost(&mut self, hook: impl ShardHook) -> &mut Self {
        self.on_lost = Some(Arc::new(hook));
        self
    }

    /// Whether any hook is set.
    pub fn is_empty(&self) -> bool {
        self.on_assigned.is_none() && self.on_revoked.is_none() && self.on_lost.is_none()
    }

    fn get(&self, kind: HookKind) -> Option<&Arc<dyn ShardHook>> {
        match kind {
            HookKind::Assigned => self.on_assigned.as_ref(),
            HookKind::Revoked => self.on_revoked.as_ref(),
            HookKind::Lost => self.on_lost.as_ref(),
        }
    }

    /// Runs hook `kind` (if set) for `context` under `timeout`. An error, a panic or a timeout
    /// is logged as a warning and returned as [`HookFailure`]; nothing of it propagates further.
    pub(crate) async fn run(
        &self,
        kind: HookKind,
        context: ShardHookContext,
        timeout: Duration,
    ) -> Result<(), HookFailure> {
        let Some(hook) = self.get(kind) else {
            return Ok(());
        };
        let (listener, member, shard) = (
            context.listener.clone(),
            context.member_id.clone(),
            context.shard,
        );
        let Err(failure) = attempt(hook.as_ref(), context, timeout).await else {
            return Ok(());
        };
        tracing::warn!(
            hook = kind.as_str(),
            listener = %listener,
            member = %member,
            shard,
            failure = %failure,
            "lifecycle hook failed; the member goes on"
        );
        Err(failure)
    }
}

/// One call of `hook` under `timeout`. A panic is caught here, whether the hook panics while it
/// makes its future or while it runs (no spawn: the hook runs on the shard task, like handlers).
async fn attempt(
    hook: &dyn ShardHook,
    context: ShardHookContext,
    timeout: Duration,
) -> Result<(), HookFailure> {
    let panicked = |panic: Box<dyn std::any::Any + Send>| {
        HookFailure::Panic(crate::report::panic_text(panic.as_ref()))
    };
    let future =
        std::panic::catch_unwind(AssertUnwindSafe(|| hook.call(context))).map_err(panicked)?;
    match tokio::time::timeout(timeout, AssertUnwindSafe(future).catch_unwind()).await {
        Ok(Ok(Ok(()))) => Ok(()),
        Ok(Ok(Err(error))) => Err(HookFailure::Error(
            crate::report::Chain(&*error).to_string(),
        )),
        Ok(Err(panic)) => Err(panicked(panic)),
        Err(_) => Err(HookFailure::Timeout(timeout)),
    }
}

/// How a hook failed (logged and counted; never stops the member).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum HookFailure {
    /// It returned an error (with its causes).
    #[error("returned an error: {0}")]
    Error(String),
    /// It panicked.
    #[error("panicked: {0}")]
    Panic(String),
    /// It did not finish within `hook_timeout`.
    #[error("did not finish within hook_timeout ({0:?})")]
    Timeout(Duration),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn context() -> ShardHookContext {
        ShardHookContext::new("orders", "billing", "on_order", "base-m0", 3, 1)
    }

    #[tokio::test]
    async fn errors_panics_and_timeouts_are_failures_not_panics() {
        let mut hooks = Hooks::default();
        hooks
            .on_assigned(|_| async { Err::<(), _>("flush failed") })
            .on_revoked(|_| async {
                if true {
                    panic!("boom");
                }
                Ok::<(), BoxError>(())
            })
            .on_lost(|_| async {
                std::future::pending::<()>().await;
                Ok::<(), BoxError>(())
            });
        let timeout = Duration::from_millis(20);
        assert_eq!(
            hooks.run(HookKind::Assigned, context(), timeout).await,
            Err(HookFailure::Error("flush failed".into()))
        );
        assert_eq!(
            hooks.run(HookKind::Revoked, context(), timeout).await,
            Err(HookFailure::Panic("boom".into()))
        );
        assert_eq!(
            hooks.run(HookKind::Lost, context(), timeout).await,
            Err(HookFailure::Timeout(timeout))
        );
        assert_eq!(
            Hooks::default()
                .run(HookKind::Lost, context(), timeout)
                .await,
            Ok(())
        );
    }

    #[tokio::test]
    async fn a_hook_that_panics_before_its_future_is_a_failure_too() {
        let mut hooks = Hooks::default();
        hooks.on_lost(
            |_: ShardHookContext| -> std::future::Ready<Result<(), BoxError>> {
                panic!("while making the future")
            },
        );
        assert_eq!(
            hooks
                .run(HookKind::Lost, context(), Duration::from_secs(1))
                .await,
            Err(HookFailure::Panic("while making the future".into()))
        );
    }

    #[tokio::test]
    async fn a_hook_receives_its_context() {
        let seen = Arc::new(std::sync::Mutex::new(None));
        let mut hooks = Hooks::default();
        let store = seen.clone();
        hooks.on_revoked(move |cx: ShardHookContext| {
            let store = store.clone();
            async move {
                *store.lock().unwrap() = Some(cx);
                Ok::<(), BoxError>(())
            }
        });
        hooks
            .run(HookKind::Revoked, context(), Duration::from_secs(1))
            .await
            .unwrap();
        assert_eq!(seen.lock().unwrap().clone(), Some(context()));
    }
}
