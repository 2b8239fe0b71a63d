//! `RedisFailure::of` against errors from real servers (docs/design.md §8.14): each Redis error
//! the runtime acts on is classified from what the server really sends, not from a hand-made
//! error.

use std::time::Duration;

use redis::{AsyncCommands, Value};
use stream_listener::core::internals::connection::{RedisConnection, RedisFailure, RedisTarget};
use stream_listener::testing::RedisServer;

async fn connect(url: String, response_timeout: Duration) -> RedisConnection {
    RedisConnection::connect(&RedisTarget::standalone(url), response_timeout)
        .await
        .unwrap()
}

async fn failure_of(conn: &mut RedisConnection, cmd: &redis::Cmd) -> RedisFailure {
    let error = cmd.query_async::<Value>(conn).await.unwrap_err();
    RedisFailure::of(&error)
}

#[tokio::test]
async fn each_server_error_has_its_failure() {
    let server = RedisServer::start().unwrap();
    let mut conn = connect(server.url(), Duration::from_secs(5)).await;
    let _: String = conn.xadd("s", "*", &[("f", "v")]).await.unwrap();

    let mut noscript = redis::cmd("EVALSHA");
    noscript.arg("0".repeat(40)).arg(0);
    assert_eq!(
        failure_of(&mut conn, &noscript).await,
        RedisFailure::NoScript
    );

    let mut nogroup = redis::cmd("XREADGROUP");
    nogroup.arg(&["GROUP", "g", "c", "STREAMS", "s", ">"]);
    assert_eq!(failure_of(&mut conn, &nogroup).await, RedisFailure::NoGroup);

    let mut create = redis::cmd("XGROUP");
    create.arg(&["CREATE", "s", "g", "0"]);
    let () = create.query_async(&mut conn).await.unwrap();
    assert_eq!(
        failure_of(&mut conn, &create).await,
        RedisFailure::BusyGroup
    );

    let mut wrong_type = redis::cmd("HGET");
    wrong_type.arg("s").arg("f");
    assert_eq!(
        failure_of(&mut conn, &wrong_type).await,
        RedisFailure::WrongType
    );
    // From a script too (the stores' scripts pass Redis's own error on), and in a pipeline.
    let mut in_script = redis::cmd("EVAL");
    in_script
        .arg("return redis.call('HGET', KEYS[1], 'f')")
        .arg(1)
        .arg("s");
    assert_eq!(
        failure_of(&mut conn, &in_script).await,
        RedisFailure::WrongType
    );
    let error = redis::pipe()
        .get("absent")
        .hget("s", "f")
        .query_async::<Value>(&mut conn)
        .await
        .unwrap_err();
    assert_eq!(RedisFailure::of(&error), RedisFailure::WrongType, "{error}");
    // An error reply kept in place by `ignore_errors`.
    let replies: Vec<Value> = redis::pipe()
        .get("absent")
        .hget("s", "f")
        .ignore_errors()
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(RedisFailure::of_reply(&replies[0]), None);
    assert_eq!(
        RedisFailure::of_reply(&replies[1]),
        Some(RedisFailure::WrongType)
    );

    let mut unknown = redis::cmd("NO-SUCH-COMMAND");
    unknown.arg(1);
    assert_eq!(failure_of(&mut conn, &unknown).await, RedisFailure::Other);

    // At maxmemory (noeviction, the default policy) writes are refused with OOM.
    let () = redis::cmd("CONFIG")
        .arg(&["SET", "maxmemory", "1"])
        .query_async(&mut conn)
        .await
        .unwrap();
    let mut write = redis::cmd("SET");
    write.arg("k").arg("v");
    assert_eq!(
        failure_of(&mut conn, &write).await,
        RedisFailure::OutOfMemory
    );
    let () = redis::cmd("CONFIG")
        .arg(&["SET", "maxmemory", "0"])
        .query_async(&mut conn)
        .await
        .unwrap();
}

#[tokio::test]
async fn a_replica_refuses_writes_as_read_only() {
    let primary = RedisServer::start().unwrap();
    let replica = RedisServer::builder()
        .config("replicaof", format!("127.0.0.1 {}", primary.port()))
        .start()
        .unwrap();
    let mut conn = connect(replica.url(), Duration::from_secs(5)).await;
    let mut write = redis::cmd("SET");
    write.arg("k").arg("v");
    let failure = failure_of(&mut conn, &write).await;
    assert_eq!(failure, RedisFailure::ReadOnly);
    assert!(!failure.is_unreachable());
}

#[tokio::test]
async fn a_refused_connection_and_a_silent_server_are_unreachable() {
    let server = RedisServer::start().unwrap();
    let mut conn = connect(server.url(), Duration::from_millis(300)).await;
    server.pause().unwrap();
    let mut ping = redis::cmd("PING");
    ping.arg("x");
    let failure = failure_of(&mut conn, &ping).await;
    server.resume().unwrap();
    assert_eq!(failure, RedisFailure::Timeout);
    assert!(failure.is_unreachable());

    let url = server.url();
    drop(server);
    let error = RedisConnection::connect(&RedisTarget::standalone(url), Duration::from_secs(1))
        .await
        .unwrap_err();
    assert_eq!(
        RedisFailure::of(&error),
        RedisFailure::ConnectionLost,
        "{error}"
    );
    assert!(RedisFailure::of(&error).is_unreachable());
}
