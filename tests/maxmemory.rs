//! A Redis that fills up (`maxmemory`, policy `noeviction`): producers are refused, and the
//! listeners must go on draining it, since handling and trimming what is there is the only thing
//! that frees memory. Coordination writes are a few small fields (a lease score, a sequence, a
//! fence), so they run at `maxmemory` too (docs/design.md §5.3, §8.2).

mod support;

use std::time::Duration;

use stream_listener::core::internals::connection::RedisConnection;
use stream_listener::core::member::Listener;
use stream_listener::core::member::{ListenerHandle, ListenerOptions};
use support::*;

async fn set_maxmemory(conn: &mut RedisConnection, bytes: u64) {
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg(bytes)
        .query_async(conn)
        .await
        .unwrap();
}

/// `maxmemory` back to 0 (no limit).
async fn free_up(conn: &mut RedisConnection) {
    set_maxmemory(conn, 0).await;
}

/// 300 entries on two shards, and a listener (batch 8, 20 ms per entry: 6 s, four lease TTLs)
/// that has handled some of them; returns it with its options.
async fn start_with_backlog(
    server: &stream_listener::testing::RedisServer,
    target: &stream_listener::core::internals::connection::RedisTarget,
    recorder: &std::sync::Arc<Recorder>,
) -> (ListenerHandle, ListenerOptions) {
    preload(&server.client(), &[0, 1], 150, 0);
    let mut options = options(1);
    options.batch_size = 8;
    let handle =
        start_recording(target, recorder, options.clone(), Duration::from_millis(20)).await;
    assert!(
        wait_until(Duration::from_secs(10), || recorder.handled().len() >= 20).await,
        "the listener did not start handling"
    );
    (handle, options)
}

/// Sets `maxmemory` to 1 byte: every deny-oom command (`XADD`, `HSET`, `ZADD`, ...) is refused
/// with `OOM` from now on, whatever the server holds.
async fn fill_up(conn: &mut RedisConnection) {
    set_maxmemory(conn, 1).await;
    let refused: redis::RedisResult<String> = redis::cmd("XADD")
        .arg("{orders:0}")
        .arg("*")
        .arg("key")
        .arg("k")
        .query_async(conn)
        .await;
    let error = refused.expect_err("an XADD at maxmemory is refused");
    assert_eq!(error.code(), Some("OOM"), "{error}");
}

/// A member owning two shards with a backlog keeps handling it for many leases after Redis
/// reached `maxmemory`: its heartbeats renew its lease there. They were refused (`OOM` on the
/// fast path's `ZADD`), the member lost its lease after one TTL and stopped, and nothing freed
/// the memory again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_keeps_draining_a_redis_at_maxmemory() {
    let (_serial, server, target, mut conn, recorder) = Context::serial(2).await.parts();
    let (handle, _) = start_with_backlog(&server, &target, &recorder).await;
    fill_up(&mut conn).await;
    let drained = wait_until(Duration::from_secs(20), || recorder.handled().len() == 300).await;
    let handled = recorder.handled().len();
    free_up(&mut conn).await;
    handle.shutdown_and_wait().await.ok();
    assert!(
        drained,
        "handled {handled} of 300 entries in 20 s at maxmemory"
    );
}

/// An operator's usual move in a full-Redis incident, restarting the consumers, must work too:
/// the listener that was reading leaves, a new process starts at `maxmemory`, joins, takes the
/// shards over (raising their fences) and drains the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_started_at_maxmemory_takes_over_and_drains() {
    let (_serial, server, target, mut conn, recorder) = Context::serial(2).await.parts();
    let (first, options) = start_with_backlog(&server, &target, &recorder).await;
    fill_up(&mut conn).await;
    first.shutdown_and_wait().await.ok();
    let before = recorder.handled().len();
    assert!(
        before < 300,
        "the first listener drained everything ({before})"
    );
    let second = Listener::new(
        target.clone(),
        STREAM,
        GROUP,
        recording_handler(recorder.clone(), Duration::from_millis(5), None),
        options,
    )
    .unwrap()
    .start()
    .await;
    let drained = match &second {
        Ok(_) => wait_until(Duration::from_secs(20), || recorder.handled().len() == 300).await,
        Err(_) => false,
    };
    let handled = recorder.handled().len();
    free_up(&mut conn).await;
    let second = second.expect("a listener starts at maxmemory");
    second.shutdown_and_wait().await.ok();
    assert!(
        drained,
        "handled {handled} of 300 entries at maxmemory ({before} before the restart)"
    );
}

/// A consumer group registered for the first time needs memory (its metadata, `XGROUP CREATE`
/// on every shard): at `maxmemory` the listener's start fails with Redis's `OOM` as the reason
/// and what to do (it said to check that Redis is up and reachable), and a start once memory
/// frees registers it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_group_at_maxmemory_fails_to_start_with_oom_then_starts_once_memory_frees() {
    let (_serial, server, target, mut conn, recorder) = Context::serial(2).await.parts();
    preload(&server.client(), &[0, 1], 10, 0);
    fill_up(&mut conn).await;
    let start = || {
        Listener::new(
            target.clone(),
            STREAM,
            GROUP,
            recording_handler(recorder.clone(), Duration::ZERO, None),
            options(1),
        )
        .unwrap()
        .start()
    };
    let refused = tokio::time::timeout(Duration::from_secs(30), start())
        .await
        .expect("the start answers at maxmemory");
    let Err(error) = refused else {
        panic!("a new group cannot be registered at maxmemory");
    };
    // Debug prints the message and each cause (README "API tour").
    let text = format!("{error:?}");
    assert!(text.contains("OOM"), "{text}");
    assert!(
        text.contains("Redis is at maxmemory"),
        "says what to do: {text}"
    );
    assert!(!text.contains("reachable"), "not a network fault: {text}");
    free_up(&mut conn).await;
    let handle = start().await.expect("starts once memory frees");
    assert!(wait_until(Duration::from_secs(10), || recorder.handled().len() == 20).await);
    handle.shutdown_and_wait().await.ok();
}

/// A publish at `maxmemory` is refused, nothing is written, and the error says the server is full
/// (it said to check that Redis is up and reachable).
#[tokio::test]
async fn a_publish_at_maxmemory_says_redis_is_full() {
    let (_serial, _server, _target, mut conn, _) = Context::serial(2).await.parts();
    let publisher = stream_listener::Publisher::new(
        conn.clone(),
        STREAM,
        stream_listener::PublisherOptions::default(),
    )
    .await
    .unwrap();
    fill_up(&mut conn).await;
    let error = publisher
        .publish("k", &serde_json::json!({"n": 1}))
        .await
        .expect_err("refused at maxmemory");
    let text = error.to_string();
    assert!(text.contains("Redis is at maxmemory"), "{text}");
    assert!(!text.contains("reachable"), "{text}");
    free_up(&mut conn).await;
}
