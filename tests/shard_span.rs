//! What a shard task's logs say about where they come from (docs/design.md §13.3): a lifecycle
//! hook runs on its shard's task, so its own logs and the framework's "lifecycle hook failed"
//! warning are inside the task's `shard` span, which names the shard and the member epoch it was
//! assigned at, under the member's span (stream prefix, group, member id). The same spans carry
//! the lag sampler's and the retention pass's logs.
//!
//! One test in this binary: it installs the process-wide subscriber (a `fmt` subscriber writing
//! to a buffer), which the listener's tasks on other threads then report to.

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use stream_listener::{Delivery, HandlerError, ShardHookContext};
use support::{Context, GROUP, STREAM, options, start_listener, wait_until};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hook_logs_name_stream_group_member_shard_and_member_epoch() {
    let buffer = support::logs::capture(tracing::Level::INFO);

    let (_serial, _server, target, _conn, _recorder) = Context::start(1).await.parts();
    let contexts: Arc<Mutex<Vec<ShardHookContext>>> = Arc::default();
    let mut options = options(1);
    let seen = contexts.clone();
    options.hooks.on_assigned(move |cx: ShardHookContext| {
        seen.lock().unwrap().push(cx);
        async {
            tracing::info!("on_assigned ran");
            Err::<(), _>("flush failed")
        }
    });
    let handler = |_: Delivery| async { Ok::<(), HandlerError>(()) };
    let listener = start_listener(&target, handler, options).await;

    let failed = "lifecycle hook failed";
    assert!(
        wait_until(Duration::from_secs(20), || buffer
            .lines()
            .iter()
            .any(|line| line.contains(failed)))
        .await,
        "no hook failure logged: {:#?}",
        buffer.lines()
    );
    let cx = contexts.lock().unwrap()[0].clone();
    let spans = format!(
        "member{{stream={STREAM} group={GROUP} member={}}}:shard{{shard=0 member_epoch={}}}:",
        cx.member_id, cx.member_epoch
    );
    let lines = buffer.lines();
    for message in ["on_assigned ran", failed] {
        let line = lines
            .iter()
            .find(|line| line.contains(message))
            .unwrap_or_else(|| panic!("no line {message:?}: {lines:#?}"));
        assert!(line.contains(&spans), "{message:?} not in {spans}: {line}");
    }
    listener.shutdown_and_wait().await.expect("clean shutdown");
}
