//! Listener registrations: what `#[stream_listener(...)]` submits and [`crate::run`] collects.

use std::sync::Arc;

use stream_listener_core::batch::ListenerHandler;
use stream_listener_core::handler::{Delivery, Handler, HandlerFuture};
use stream_listener_core::hooks::{HookFuture, Hooks, ShardHookContext};
use stream_listener_core::state::{MissingState, States};

/// A lifecycle hook as a registration holds it (docs/design.md §13.3).
pub type HookFn = fn(ShardHookContext) -> HookFuture;

/// How a registration of a function of extractors makes its handler, once at startup: takes what
/// the arguments need from the application's states ([`MissingState`] when one was not given)
/// and returns the handler (docs/design.md §14.1). The attribute writes one; without it,
/// `|states| Ok(Arc::new(handler_fn(on_order, states)?))` ([`crate::handler_fn`]).
pub type MakeHandler = fn(&States) -> Result<Arc<dyn Handler>, MissingState>;

/// As [`MakeHandler`], for a handler of either kind, per entry or per batch ([`ListenerHandler`],
/// docs/design.md §14.2): what the attribute writes, and how a batch listener is registered
/// without it: `|states| Ok(ListenerHandler::batch(on_orders))`.
pub type MakeListenerHandler = fn(&States) -> Result<ListenerHandler, MissingState>;

/// Where a registration's handler comes from.
#[derive(Debug, Clone, Copy)]
enum HandlerSource {
    /// [`ListenerRegistration::new`]: a function of the delivery alone, needing no state.
    Delivery(fn(Delivery) -> HandlerFuture),
    /// [`ListenerRegistration::with_states`]'s.
    States(MakeHandler),
    /// The attribute's and [`ListenerRegistration::with_listener_handler`]'s: per entry or per
    /// batch.
    Listener(MakeListenerHandler),
}

/// One listener: its name, stream, group, default concurrency and handler (docs/design.md §7).
///
/// `#[stream_listener(...)]` builds one per annotated function and registers it with
/// `inventory`; [`registered_listeners`] lists them. Build one with
/// [`ListenerRegistration::new`] to run a listener without the macro (with
/// [`crate::run_listeners`]).
#[derive(Debug, Clone, Copy)]
pub struct ListenerRegistration {
    name: &'static str,
    stream: &'static str,
    group: &'static str,
    concurrency: u32,
    handler: HandlerSource,
    defined_at: DefinedAt,
    hooks: RegisteredHooks,
}

/// The lifecycle hooks of a registration (`on_assigned`, `on_revoked`, `on_lost`).
#[derive(Debug, Clone, Copy, Default)]
struct RegisteredHooks {
    on_assigned: Option<HookFn>,
    on_revoked: Option<HookFn>,
    on_lost: Option<HookFn>,
}

/// Where the annotated function is, for messages (empty for [`ListenerRegistration::new`]).
#[derive(Debug, Clone, Copy)]
struct DefinedAt {
    module_path: &'static str,
    file: &'static str,
    line: u32,
}

impl ListenerRegistration {
    /// A registration with concurrency 1, no hooks and no definition site.
    const fn base(
        name: &'static str,
        stream: &'static str,
        group: &'static str,
        handler: HandlerSource,
    ) -> Self {
        ListenerRegistration {
            name,
            stream,
            group,
            concurrency: 1,
            handler,
            defined_at: DefinedAt {
                module_path: "",
                file: "",
                line: 0,
            },
            hooks: RegisteredHooks {
                on_assigned: None,
                on_revoked: None,
                on_lost: None,
            },
        }
    }

    /// The same registration, defined at `module_path`, `file:line` (for messages).
    const fn defined_at(
        mut self,
        module_path: &'static str,
        file: &'static str,
        line: u32,
    ) -> Self {
        self.defined_at = DefinedAt {
            module_path,
            file,
            line,
        };
        self
    }

    /// A listener as [`ListenerRegistration::new`] whose handler, per entry or per batch, is
    /// made at startup from the application's states by `make` ([`MakeListenerHandler`]), e.g.
    /// a batch listener without the attribute (docs/design.md §14.2):
    ///
    /// ```
    /// use stream_listener::{Batch, BatchError, Json, ListenerHandler, ListenerRegistration};
    ///
    /// async fn on_orders(batch: Batch<Json<u64>>) -> Result<(), BatchError> {
    ///     println!("{} orders", batch.len());
    ///     Ok(())
    /// }
    ///
    /// let registration = ListenerRegistration::with_listener_handler(
    ///     "on_orders", "orders", "billing", |_states| Ok(ListenerHandler::batch(on_orders)),
    /// );
    /// ```
    pub const fn with_listener_handler(
        name: &'static str,
        stream: &'static str,
        group: &'static str,
        make: MakeListenerHandler,
    ) -> Self {
        Self::base(name, stream, group, HandlerSource::Listener(make))
    }

    /// A listener named `name` (its `[listeners.<name>]` section) of consumer group `group` on
    /// stream `stream`, running `handler` for each entry, with concurrency 1.
    pub const fn new(
        name: &'static str,
        stream: &'static str,
        group: &'static str,
        handler: fn(Delivery) -> HandlerFuture,
    ) -> Self {
        Self::base(name, stream, group, HandlerSource::Delivery(handler))
    }

    /// A listener as [`ListenerRegistration::new`] whose handler is made at startup from the
    /// application's states by `make` ([`MakeHandler`]), e.g. for a function of several
    /// extractors without the attribute:
    ///
    /// ```
    /// use std::sync::Arc;
    /// use stream_listener::{HandlerError, Json, ListenerRegistration, State, handler_fn};
    ///
    /// #[derive(Clone)]
    /// struct Db;
    ///
    /// async fn on_order(State(_db): State<Db>, Json(_id): Json<u64>) -> Result<(), HandlerError> {
    ///     Ok(())
    /// }
    ///
    /// let registration = ListenerRegistration::with_states("on_order", "orders", "billing", |states| {
    ///     Ok(Arc::new(handler_fn(on_order, states)?))
    /// });
    /// ```
    pub const fn with_states(
        name: &'static str,
        stream: &'static str,
        group: &'static str,
        make: MakeHandler,
    ) -> Self {
        Self::base(name, stream, group, HandlerSource::States(make))
    }

    /// The same listener with `concurrency` logical members (config `concurrency` overrides it).
    pub const fn with_concurrency(mut self, concurrency: u32) -> Self {
        self.concurrency = concurrency;
        self
    }

    /// Used by the expansion of `#[stream_listener]`; not a stable API.
    #[doc(hidden)]
    #[allow(clippy::too_many_arguments)]
    pub const fn __from_macro(
        name: &'static str,
        stream: &'static str,
        group: &'static str,
        concurrency: u32,
        handler: MakeListenerHandler,
        module_path: &'static str,
        file: &'static str,
        line: u32,
    ) -> Self {
        Self::base(name, stream, group, HandlerSource::Listener(handler))
            .with_concurrency(concurrency)
            .defined_at(module_path, file, line)
    }

    /// Used by the expansion of `#[stream_listener(on_assigned = .., on_revoked = .., on_lost =
    /// ..)]`; not a stable API.
    #[doc(hidden)]
    pub const fn __with_hooks(
        mut self,
        on_assigned: Option<HookFn>,
        on_revoked: Option<HookFn>,
        on_lost: Option<HookFn>,
    ) -> Self {
        self.hooks = RegisteredHooks {
            on_assigned,
            on_revoked,
            on_lost,
        };
        self
    }

    /// The same listener with an `on_assigned` hook: called for each shard a member gains,
    /// before its first handler (docs/design.md §13.3).
    pub const fn with_on_assigned(mut self, hook: HookFn) -> Self {
        self.hooks.on_assigned = Some(hook);
        self
    }

    /// The same listener with an `on_revoked` hook: called for each shard a member gives up in
    /// order, after its last ack and before the release (docs/design.md §13.3).
    pub const fn with_on_revoked(mut self, hook: HookFn) -> Self {
        self.hooks.on_revoked = Some(hook);
        self
    }

    /// The same listener with an `on_lost` hook: called for each shard a member lost without a
    /// release (fenced, lease expired; docs/design.md §13.3).
    pub const fn with_on_lost(mut self, hook: HookFn) -> Self {
        self.hooks.on_lost = Some(hook);
        self
    }

    /// The registered hooks as the listener's options take them.
    pub fn hooks(&self) -> Hooks {
        let mut hooks = Hooks::default();
        if let Some(hook) = self.hooks.on_assigned {
            hooks.on_assigned(hook);
        }
        if let Some(hook) = self.hooks.on_revoked {
            hooks.on_revoked(hook);
        }
        if let Some(hook) = self.hooks.on_lost {
            hooks.on_lost(hook);
        }
        hooks
    }

    /// The listener's name: the function name unless `name = "..."` was given.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The stream prefix it consumes.
    pub fn stream(&self) -> &'static str {
        self.stream
    }

    /// Its consumer group.
    pub fn group(&self) -> &'static str {
        self.group
    }

    /// Logical members per process given in code (default 1).
    pub fn concurrency(&self) -> u32 {
        self.concurrency
    }

    /// The handler, made with what its arguments need from `states` (once per start: each
    /// entry then extracts its arguments and calls the function, with no lookup by type).
    ///
    /// # Errors
    /// [`MissingState`] naming the type when the function takes `State<T>` (or another
    /// extractor needing a state) and `states` has no `T`.
    pub fn make_handler(&self, states: &States) -> Result<ListenerHandler, MissingState> {
        match self.handler {
            HandlerSource::Delivery(handler) => Ok(ListenerHandler::each(handler)),
            HandlerSource::States(make) => make(states).map(ListenerHandler::from),
            HandlerSource::Listener(make) => make(states),
        }
    }

    /// Where it is defined, for error messages: `` `name` (module, file:line) ``.
    pub fn describe(&self) -> String {
        let at = &self.defined_at;
        if at.file.is_empty() {
            format!("`{}`", self.name)
        } else {
            format!(
                "`{}` ({}, {}:{})",
                self.name, at.module_path, at.file, at.line
            )
        }
    }
}

inventory::collect!(ListenerRegistration);

/// Every listener registered with `#[stream_listener(...)]` in this program, sorted by name (then
/// stream and group): `inventory` gives no order of its own.
pub fn registered_listeners() -> Vec<ListenerRegistration> {
    let mut listeners: Vec<ListenerRegistration> =
        inventory::iter::<ListenerRegistration>().copied().collect();
    listeners.sort_by(|a, b| (a.name, a.stream, a.group).cmp(&(b.name, b.stream, b.group)));
    listeners
}
