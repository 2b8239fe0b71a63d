//! Lifecycle hooks through the attribute: paths to `async fn(ShardHookContext)` returning `()`
//! or `Result<(), E>`, and the registration carrying them.

use stream_listener::{Json, ShardHookContext, stream_listener};

mod hooks {
    use stream_listener::ShardHookContext;

    pub async fn flush(context: ShardHookContext) -> Result<(), std::io::Error> {
        let _ = context.shard;
        Ok(())
    }
}

async fn warm_up(context: ShardHookContext) {
    let _ = context.member_epoch;
}

async fn forget(_context: ShardHookContext) -> Result<(), String> {
    Err("nothing to forget".into())
}

#[stream_listener(
    stream = "orders",
    group = "billing",
    on_assigned = warm_up,
    on_revoked = hooks::flush,
    on_lost = forget
)]
async fn on_order(Json(id): Json<u64>) {
    let _ = id;
}

#[stream_listener(stream = "payments", group = "billing", on_revoked = hooks::flush)]
async fn on_payment(Json(id): Json<u64>) {
    let _ = id;
}

fn main() {
    let listeners = stream_listener::registered_listeners();
    assert_eq!(listeners.len(), 2);
    let hooks = format!("{:?}", listeners[0].hooks());
    assert_eq!(
        hooks,
        "Hooks { on_assigned: true, on_revoked: true, on_lost: true }"
    );
    let hooks = format!("{:?}", listeners[1].hooks());
    assert_eq!(
        hooks,
        "Hooks { on_assigned: false, on_revoked: true, on_lost: false }"
    );
}
