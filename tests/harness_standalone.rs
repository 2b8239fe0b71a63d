//! The real-Redis test harness, standalone servers: start, streams, fault injection, ports,
//! a missing binary, and no leaked server when the test process is killed.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use redis::streams::{StreamId, StreamReadOptions};
use redis::{AsyncTypedCommands, TypedCommands};
use stream_listener::testing::{HarnessError, REDIS_SERVER_ENV, RedisServer};

/// Set in the environment of re-executed copies of this test binary (see [`run_helper`]).
const HELPER_ENV: &str = "STREAM_LISTENER_HARNESS_HELPER";
/// Where the leak helper creates its server's directory.
const HELPER_DIR_ENV: &str = "STREAM_LISTENER_HARNESS_HELPER_DIR";
/// Prefix of the line the leak helper prints with its server's port.
const PORT_LINE: &str = "harness-helper-port=";

/// `(id, n, body)` of each entry, in order.
fn entries(ids: &[StreamId]) -> Vec<(String, String, String)> {
    ids.iter()
        .map(|e| {
            (
                e.id.clone(),
                e.get::<String>("n").unwrap(),
                e.get::<String>("body").unwrap(),
            )
        })
        .collect()
}

/// Whether something answers `PING` on `127.0.0.1:port` within 200 ms.
fn answers_ping(port: u16) -> bool {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).unwrap();
    let Ok(mut con) = client.get_connection_with_timeout(Duration::from_millis(200)) else {
        return false;
    };
    con.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    redis::cmd("PING").query::<String>(&mut con).ok().as_deref() == Some("PONG")
}

#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
/// Polls `condition` every 20 ms until it holds or `limit` passes; returns whether it held.
fn eventually(limit: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if condition() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test]
async fn stream_entries_round_trip_through_xrange_and_xreadgroup() {
    let server = RedisServer::start().unwrap();
    assert!(server.url().ends_with(&format!(":{}", server.port())));
    let mut con = server
        .client()
        .get_multiplexed_async_connection()
        .await
        .unwrap();

    let mut written = Vec::new();
    for n in 1..=3 {
        let body = format!("order-{n}");
        let id = con
            .xadd(
                "{orders:0}",
                "*",
                &[("n", n.to_string()), ("body", body.clone())],
            )
            .await
            .unwrap()
            .unwrap();
        written.push((id, n.to_string(), body));
    }

    let range = con.xrange_all("{orders:0}").await.unwrap();
    assert_eq!(entries(&range.ids), written);

    con.xgroup_create("{orders:0}", "billing", "0")
        .await
        .unwrap();
    let options = StreamReadOptions::default()
        .group("billing", "consumer-1")
        .count(10);
    let read = con
        .xread_options(&["{orders:0}"], &[">"], &options)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(read.keys.len(), 1);
    assert_eq!(read.keys[0].key, "{orders:0}");
    assert_eq!(entries(&read.keys[0].ids), written);

    let ids: Vec<&str> = written.iter().map(|(id, _, _)| id.as_str()).collect();
    assert_eq!(con.xack("{orders:0}", "billing", &ids).await.unwrap(), 3);
}

#[test]
fn pause_stops_answers_until_resume() {
    let server = RedisServer::start().unwrap();
    let client = server.client();
    let mut con = client.get_connection().unwrap();
    con.set("key", "before-pause").unwrap();

    // Connect first: redis-rs's handshake would itself time out on a stopped server.
    let mut paused = client.get_connection().unwrap();
    paused
        .set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    server.pause().unwrap();
    let started = Instant::now();
    let error = redis::cmd("GET")
        .arg("key")
        .query::<Option<String>>(&mut paused)
        .unwrap_err();
    assert!(error.is_timeout(), "expected a timeout, got {error:?}");
    assert!(started.elapsed() >= Duration::from_millis(250));

    server.resume().unwrap();
    let mut con = client.get_connection().unwrap();
    con.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert_eq!(con.get("key").unwrap().as_deref(), Some("before-pause"));
}

#[tokio::test]
async fn pause_times_out_an_async_command_with_a_response_timeout() {
    let server = RedisServer::start().unwrap();
    let config =
        redis::AsyncConnectionConfig::new().set_response_timeout(Some(Duration::from_millis(300)));
    let mut con = server
        .client()
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .unwrap();
    con.set("key", "value").await.unwrap();

    server.pause().unwrap();
    let error = con.get("key").await.unwrap_err();
    assert!(error.is_timeout(), "expected a timeout, got {error:?}");

    server.resume().unwrap();
    let mut fresh = server
        .client()
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .unwrap();
    assert_eq!(fresh.get("key").await.unwrap().as_deref(), Some("value"));
}

#[test]
fn kill_then_restart_comes_back_on_the_same_port_without_data() {
    let mut server = RedisServer::start().unwrap();
    let port = server.port();
    let mut con = server.client().get_connection().unwrap();
    con.set("key", "value").unwrap();

    server.kill().unwrap();
    assert_eq!(server.pid(), None);
    assert!(!answers_ping(port));
    assert!(matches!(
        server.pause(),
        Err(HarnessError::NotRunning { port: p }) if p == port
    ));
    server.kill().unwrap(); // idempotent

    server.restart().unwrap();
    assert_eq!(server.port(), port);
    assert!(server.pid().is_some());
    let mut con = server.client().get_connection().unwrap();
    // No persistence by default: the restarted server is empty.
    assert_eq!(con.get("key").unwrap(), None);
    assert_eq!(redis::cmd("DBSIZE").query::<i64>(&mut con).unwrap(), 0);
}

#[test]
fn aof_keeps_acknowledged_writes_across_kill_and_restart() {
    let mut server = RedisServer::builder().aof(true).start().unwrap();
    let mut con = server.client().get_connection().unwrap();
    let aof: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("append*")
        .query(&mut con)
        .unwrap();
    assert!(
        aof.windows(2).any(|w| w == ["appendonly", "yes"]),
        "{aof:?}"
    );
    assert!(
        aof.windows(2).any(|w| w == ["appendfsync", "always"]),
        "{aof:?}"
    );

    let mut written = Vec::new();
    for n in 1..=5 {
        let body = format!("payment-{n}");
        let id = con
            .xadd(
                "{payments:0}",
                "*",
                &[("n", n.to_string()), ("body", body.clone())],
            )
            .unwrap()
            .unwrap();
        written.push((id, n.to_string(), body));
    }
    con.set("last", "5").unwrap();
    drop(con);

    let port = server.port();
    server.kill().unwrap();
    assert!(!answers_ping(port));
    server.restart().unwrap();

    let mut con = server.client().get_connection().unwrap();
    let range = con.xrange_all("{payments:0}").unwrap();
    assert_eq!(entries(&range.ids), written);
    assert_eq!(con.get("last").unwrap().as_deref(), Some("5"));
}

#[test]
fn parallel_servers_get_different_ports() {
    let starts: Vec<_> = (0..4)
        .map(|_| std::thread::spawn(|| RedisServer::start().unwrap()))
        .collect();
    let servers: Vec<RedisServer> = starts.into_iter().map(|t| t.join().unwrap()).collect();
    let mut ports: Vec<u16> = servers.iter().map(RedisServer::port).collect();
    ports.sort_unstable();
    ports.dedup();
    assert_eq!(ports.len(), servers.len(), "ports: {ports:?}");
    for server in &servers {
        let mut con = server.client().get_connection().unwrap();
        let config: Vec<String> = redis::cmd("CONFIG")
            .arg("GET")
            .arg("port")
            .query(&mut con)
            .unwrap();
        assert_eq!(config, ["port".to_owned(), server.port().to_string()]);
    }
}

#[test]
fn missing_binary_is_reported_with_install_instructions() {
    let error = RedisServer::builder()
        .server_binary("/nonexistent/redis-server")
        .start()
        .unwrap_err();
    assert!(
        matches!(
            &error,
            HarnessError::RedisNotInstalled { binary: "redis-server", looked_for, .. }
                if looked_for.contains("/nonexistent/redis-server")
        ),
        "{error:?}"
    );
    let message = error.to_string();
    assert!(
        message.contains("apt-get install redis-server redis-tools"),
        "{message}"
    );
    assert!(message.contains("brew install redis"), "{message}");
    assert!(message.contains(REDIS_SERVER_ENV), "{message}");
}

#[test]
fn a_server_that_exits_at_start_is_reported_with_its_log_tail() {
    let error = RedisServer::builder()
        .config("no-such-directive", "1")
        .start()
        .unwrap_err();
    let HarnessError::ServerExited { log_tail, .. } = &error else {
        panic!("expected ServerExited, got {error:?}");
    };
    assert!(log_tail.contains("no-such-directive"), "{log_tail}");
    assert!(error.to_string().contains("no-such-directive"), "{error}");
}

/// A directory removed (with its contents) when dropped.
struct RemovedOnDrop(std::path::PathBuf);

impl RemovedOnDrop {
    fn new(name: &str) -> Self {
        let path = std::env::temp_dir().join(format!(
            "stream-listener-{name}-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        std::fs::create_dir_all(&path).unwrap();
        Self(path)
    }
}

impl Drop for RemovedOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs the `#[ignore]`d helper test `name` of this binary in a child process with `env` set.
fn run_helper(name: &str, env: &[(&str, &str)]) -> Command {
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .args([
            name,
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(HELPER_ENV, "1")
        .stdin(Stdio::null());
    for (key, value) in env {
        command.env(key, value);
    }
    command
}

#[test]
fn env_override_naming_a_missing_binary_gives_redis_not_installed() {
    // Changing the environment of this (multi-threaded) process would race with the other tests,
    // so the check runs in a child process with the variable set.
    let output = run_helper(
        "helper_env_override_missing",
        &[(REDIS_SERVER_ENV, "/nonexistent/redis-server")],
    )
    .output()
    .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("1 passed"), "{stdout}");
}

#[test]
#[ignore = "helper: run by env_override_naming_a_missing_binary_gives_redis_not_installed"]
fn helper_env_override_missing() {
    if std::env::var_os(HELPER_ENV).is_none() {
        return;
    }
    let error = RedisServer::start().unwrap_err();
    assert!(
        matches!(
            &error,
            HarnessError::RedisNotInstalled { binary: "redis-server", looked_for, env_var }
                if looked_for.contains("/nonexistent/redis-server") && *env_var == REDIS_SERVER_ENV
        ),
        "{error:?}"
    );
}

// The parent-death signal is Linux-only; elsewhere servers stop on `Drop` only.
#[cfg(target_os = "linux")]
#[test]
fn servers_die_with_a_sigkilled_test_process() {
    use std::io::{BufRead, BufReader};

    // The killed helper cannot remove its server's directory: give it one we remove.
    let parent = RemovedOnDrop::new("leak-test");
    let mut helper = run_helper(
        "helper_start_server_and_wait",
        &[(HELPER_DIR_ENV, parent.0.to_str().unwrap())],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    let stdout = helper.stdout.take().unwrap();
    let port: u16 = BufReader::new(stdout)
        .lines()
        .map(Result::unwrap)
        // libtest may print `test <name> ... ` on the same line first.
        .find_map(|line| {
            line.split_once(PORT_LINE)
                .map(|(_, p)| p.trim().parse().unwrap())
        })
        .expect("the helper printed no port");

    // The server outlives the short-lived thread that started it...
    assert!(
        answers_ping(port),
        "the helper's server on port {port} does not answer"
    );
    // ...but not the process: SIGKILL runs no destructor, PR_SET_PDEATHSIG does the work.
    helper.kill().unwrap();
    helper.wait().unwrap();
    assert!(
        eventually(Duration::from_secs(10), || !answers_ping(port)),
        "redis-server on port {port} survived its SIGKILLed test process"
    );
}

#[test]
#[ignore = "helper: run by servers_die_with_a_sigkilled_test_process"]
fn helper_start_server_and_wait() {
    if std::env::var_os(HELPER_ENV).is_none() {
        return;
    }
    // Start the server from a thread that exits at once: the parent-death signal must not fire
    // when this thread ends, only when the process does.
    let parent = std::env::var_os(HELPER_DIR_ENV).unwrap();
    let server = std::thread::spawn(|| RedisServer::builder().temp_dir_in(parent).start().unwrap())
        .join()
        .unwrap();
    println!("{PORT_LINE}{}", server.port());
    // Wait to be killed; give up after a while so a broken parent cannot leave us behind.
    std::thread::sleep(Duration::from_secs(60));
}
