//! The `stream-listener` admin tool pointed at Redis Sentinel (`--sentinel`, `--sentinel-master`,
//! or `REDIS_SENTINELS` and `REDIS_SENTINEL_MASTER`), as a process against a real setup (one
//! master, one replica, three sentinels): it finds the master, finds the new one after a
//! failover, and fails with usage (2) or unreachable (3) exit codes that say why.

use std::process::Command;
use std::time::Duration;

use stream_listener_core::testing::RedisSentinel;

const BIN: &str = env!("CARGO_BIN_EXE_stream-listener");

/// Runs the tool with `args` and `env` (none of the Redis variables from the environment);
/// returns (exit code, stdout, stderr).
fn run(args: &[String], env: &[(&str, String)]) -> (i32, String, String) {
    let output = Command::new(BIN)
        .args(args)
        .env_remove("REDIS_URL")
        .env_remove("REDIS_SENTINELS")
        .env_remove("REDIS_SENTINEL_MASTER")
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .unwrap();
    (
        output.status.code().unwrap(),
        String::from_utf8(output.stdout).unwrap(),
        String::from_utf8(output.stderr).unwrap(),
    )
}

fn words(words: &[&str]) -> Vec<String> {
    words.iter().map(|w| (*w).to_owned()).collect()
}

/// `--sentinel <url>...` for every sentinel of `setup`, then `--sentinel-master <name>`.
fn via(setup: &RedisSentinel, master: &str) -> Vec<String> {
    let mut args = Vec::new();
    for url in setup.sentinel_urls() {
        args.extend(["--sentinel".to_owned(), url]);
    }
    args.extend(["--sentinel-master".to_owned(), master.to_owned()]);
    args
}

#[test]
fn the_admin_tool_finds_the_master_through_sentinel_and_after_a_failover() {
    let mut setup = RedisSentinel::start().unwrap();
    let sentinel = via(&setup, setup.master_name());
    let with = |args: &[&str]| [sentinel.clone(), words(args)].concat();

    let (code, out, err) = run(&with(&["stream", "create", "orders", "--shards", "2"]), &[]);
    assert_eq!((code, err.as_str()), (0, ""), "{out}");
    let (code, out, err) = run(&with(&["stream", "describe", "orders"]), &[]);
    assert_eq!((code, err.as_str()), (0, ""));
    assert!(out.contains("orders"), "{out}");

    // The stream is on the replica before the master dies (WAIT 1), so the new master has it.
    let mut master = setup.master().unwrap().client().get_connection().unwrap();
    let acked: i64 = redis::cmd("WAIT")
        .arg(1)
        .arg(2000)
        .query(&mut master)
        .unwrap();
    assert_eq!(acked, 1);
    setup.kill_master().unwrap();
    setup.wait_for_failover(Duration::from_secs(30)).unwrap();

    // The environment variables instead of the flags.
    let env = [
        ("REDIS_SENTINELS", setup.sentinel_urls().join(",")),
        ("REDIS_SENTINEL_MASTER", setup.master_name().to_owned()),
    ];
    let (code, again, err) = run(&words(&["stream", "describe", "orders"]), &env);
    assert_eq!((code, err.as_str()), (0, ""));
    assert_eq!(again, out, "the new master describes the same stream");
}

#[test]
fn the_admin_tool_says_why_sentinel_cannot_be_used() {
    let setup = RedisSentinel::start().unwrap();
    let (code, _, err) = run(
        &[via(&setup, "nosuch"), words(&["stream", "list"])].concat(),
        &[],
    );
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("monitors a master named \"nosuch\"") && err.contains("--sentinel-master"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");

    let (code, _, err) = run(
        &words(&["--sentinel", &setup.sentinel_urls()[0], "stream", "list"]),
        &[],
    );
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--sentinel-master"), "{err}");

    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let nobody = format!("redis://127.0.0.1:{closed}");
    let (code, _, err) = run(
        &words(&[
            "--sentinel",
            &nobody,
            "--sentinel-master",
            "mymaster",
            "stream",
            "list",
        ]),
        &[],
    );
    assert_eq!(code, 3, "{err}");
    assert!(
        err.contains(&format!("no sentinel of [{nobody}] answered")),
        "{err}"
    );
}
