//! `stream retention`, `stream trim [--dry-run]` and the retention flags of `stream create`, run
//! as a process against real Redis (docs/design.md §10.9): what they print, `--json`, and every
//! bad value refused with exit code 2 (1 for an unknown stream) and nothing changed.

use std::process::Command;
use std::time::Duration;

use redis::AsyncCommands;
use stream_listener::core::internals::admin;
use stream_listener::core::internals::connection::{RedisConnection, RedisTarget};
use stream_listener::core::model::StartFrom;
use stream_listener_core::testing::{RedisCluster, RedisServer};

const BIN: &str = env!("CARGO_BIN_EXE_stream-listener");

/// Runs the tool with `args`; returns (exit code, stdout, stderr).
fn tool(args: &[&str]) -> (i32, String, String) {
    let output = Command::new(BIN)
        .args(args)
        .env_remove("REDIS_URL")
        .output()
        .unwrap();
    (
        output.status.code().unwrap(),
        String::from_utf8(output.stdout).unwrap(),
        String::from_utf8(output.stderr).unwrap(),
    )
}

fn cli(url: &str, args: &[&str]) -> (i32, String, String) {
    let mut all = vec!["--redis-url", url];
    all.extend_from_slice(args);
    tool(&all)
}

async fn connect(target: RedisTarget) -> RedisConnection {
    RedisConnection::connect(&target, Duration::from_secs(5))
        .await
        .unwrap()
}

/// Five entries `1-1`..`5-1` on `key`; `billing` reads and acks them all, `stopped` reads two
/// and acks the first, so its oldest pending id is `2-1`.
async fn two_groups(conn: &mut RedisConnection, key: &str) {
    for group in ["billing", "stopped"] {
        admin::register_group(conn, "orders", group, StartFrom::Earliest)
            .await
            .unwrap();
    }
    for id in ["1-1", "2-1", "3-1", "4-1", "5-1"] {
        let _: String = conn.xadd(key, id, &[("n", id)]).await.unwrap();
    }
    for (group, count, acks) in [("billing", 5, 5), ("stopped", 2, 1)] {
        let options = redis::streams::StreamReadOptions::default()
            .group(group, "c1")
            .count(count);
        let reply: redis::streams::StreamReadReply =
            conn.xread_options(&[key], &[">"], &options).await.unwrap();
        let ids: Vec<String> = reply.keys[0].ids.iter().map(|e| e.id.clone()).collect();
        let _: u64 = conn.xack(key, group, &ids[..acks]).await.unwrap();
    }
}

const SUMMARY: &str =
    "acked, max age none, max len 2 per shard; dead letters: max age none, max len none";

#[tokio::test]
async fn retention_is_set_printed_cleared_and_trimmed_from_the_command_line() {
    let server = RedisServer::start().unwrap();
    let url = server.url();
    let (code, _, err) = cli(
        &url,
        &[
            "stream",
            "create",
            "orders",
            "--shards",
            "1",
            "--retention-max-len",
            "2",
        ],
    );
    assert_eq!((code, err.as_str()), (0, ""));
    let (code, out, _) = cli(&url, &["stream", "retention", "orders"]);
    assert_eq!(code, 0);
    assert_eq!(out, format!("stream orders: retention {SUMMARY}\n"));
    let (_, out, _) = cli(&url, &["stream", "describe", "orders"]);
    assert!(
        out.contains(&format!("\nretention:       {SUMMARY}\n")),
        "{out}"
    );

    let mut conn = connect(RedisTarget::standalone(url.clone())).await;
    two_groups(&mut conn, "{orders:0}").await;
    let (code, out, err) = cli(&url, &["stream", "trim", "orders", "--dry-run"]);
    assert_eq!((code, err.as_str()), (0, ""));
    assert_eq!(
        out,
        format!(
            "dry run (nothing changed): would trim orders to retention {SUMMARY}\n\n\
             SHARD  DELETED  LEFT  TRIM POINT  REASON\n\
             0      1        4     2-1         held back by group stopped at 2-1\n"
        )
    );
    let len: u64 = conn.xlen("{orders:0}").await.unwrap();
    assert_eq!(len, 5, "a dry run changes nothing");

    let (code, out, _) = cli(&url, &["--json", "stream", "trim", "orders"]);
    assert_eq!(code, 0);
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    let shard = &report["shards"][0];
    assert_eq!(report["dryRun"], false);
    assert_eq!(shard["shardIndex"], 0);
    assert_eq!(shard["deleted"], 1);
    assert_eq!(shard["reason"], "group");
    assert_eq!(shard["holder"], "stopped");
    assert_eq!(shard["trimPoint"], "2-1");
    assert_eq!(shard["lengthAfter"], 4);
    let len: u64 = conn.xlen("{orders:0}").await.unwrap();
    assert_eq!(len, 4);

    let (code, out, _) = cli(
        &url,
        &["stream", "retention", "orders", "--retention", "force"],
    );
    assert_eq!(code, 0);
    assert_eq!(
        out,
        "stream orders changed: retention force, max age none, max len 2 per shard; dead letters: max age none, max len none\n"
    );
    let (code, out, _) = cli(&url, &["stream", "retention", "orders", "--clear"]);
    assert_eq!(code, 0);
    assert_eq!(
        out,
        "stream orders changed: no retention: nothing is trimmed\n"
    );
    let (code, _, err) = cli(&url, &["stream", "trim", "orders"]);
    assert_eq!(code, 1);
    assert!(err.contains("stream \"orders\" has no retention"), "{err}");
}

#[tokio::test]
async fn bad_retention_flags_exit_2_naming_the_flag_and_change_nothing() {
    let server = RedisServer::start().unwrap();
    let url = server.url();
    let (code, _, _) = cli(&url, &["stream", "create", "orders", "--shards", "1"]);
    assert_eq!(code, 0);
    let cases: [(&[&str], &str); 7] = [
        (
            &["--retention-max-len", "0"],
            "error: --retention-max-len 0 is invalid: a length bound must be at least 1 (omit it for no length bound)\n",
        ),
        (
            &["--retention-max-len", "9007199254740993"],
            "error: --retention-max-len 9007199254740993 is invalid: it is above 2^53 entries; give at most 9007199254740992\n",
        ),
        (
            &["--retention-max-age", "0s"],
            "error: --retention-max-age 0 is invalid: an age bound must be above 0 (omit it for no age bound)\n",
        ),
        (
            &["--dlq-retention-max-age", "101years"],
            "error: --dlq-retention-max-age 3187317600000 ms is invalid: it is above 100 years; give a real age such as 7d\n",
        ),
        (
            &["--dlq-retention-max-len", "0"],
            "error: --dlq-retention-max-len 0 is invalid: a length bound must be at least 1 (omit it for no length bound)\n",
        ),
        (
            &["--retention-max-age", "1ns"],
            "error: --retention-max-age 1ns is below 1 ms: ages count in the milliseconds of entry ids; give at least 1ms\n",
        ),
        (
            &["--retention", "force", "--retention-max-age", "1ms"],
            "error: --retention-max-age 1ms with --retention force is below one heartbeat interval (3s): entries would be trimmed before a member could read them; give at least that, or use --retention acked\n",
        ),
    ];
    for (flags, expected) in cases {
        let mut args = vec!["stream", "retention", "orders"];
        args.extend_from_slice(flags);
        let (code, out, err) = cli(&url, &args);
        assert_eq!(
            (code, out.as_str(), err.as_str()),
            (2, "", expected),
            "{flags:?}"
        );
    }
    for flags in [
        &["--retention-max-len", "-1"][..],
        &["--retention-max-age", "seven days"],
        &["--retention", "sometimes"],
        &["--clear", "--retention-max-len", "5"],
    ] {
        let mut args = vec!["stream", "retention", "orders"];
        args.extend_from_slice(flags);
        let (code, _, err) = cli(&url, &args);
        assert_eq!(code, 2, "{flags:?}: {err}");
        assert!(err.starts_with("error:"), "{err}");
    }
    let (code, out, _) = cli(&url, &["stream", "retention", "orders"]);
    assert_eq!(code, 0);
    assert_eq!(out, "stream orders: no retention: nothing is trimmed\n");

    let (code, _, err) = cli(
        &url,
        &["stream", "retention", "nosuch", "--retention-max-len", "5"],
    );
    assert_eq!(code, 1);
    assert!(err.contains("nosuch"), "{err}");
    let (code, _, _) = cli(
        &url,
        &[
            "stream",
            "create",
            "other",
            "--shards",
            "1",
            "--retention-max-len",
            "0",
        ],
    );
    assert_eq!(code, 2);
    let mut conn = connect(RedisTarget::standalone(url.clone())).await;
    let exists: bool = conn.exists("sl:{other}:stream").await.unwrap();
    assert!(!exists, "a refused create creates nothing");
}

#[tokio::test]
async fn retention_commands_work_on_a_cluster() {
    let cluster = RedisCluster::start().unwrap();
    let mut args: Vec<String> = Vec::new();
    for url in cluster.urls() {
        args.push("--cluster-node".into());
        args.push(url);
    }
    let with = |extra: &[&str]| {
        let mut all: Vec<&str> = args.iter().map(String::as_str).collect();
        all.extend_from_slice(extra);
        tool(&all)
    };
    let (code, _, err) = with(&[
        "stream",
        "create",
        "orders",
        "--shards",
        "3",
        "--retention-max-len",
        "2",
    ]);
    assert_eq!((code, err.as_str()), (0, ""));
    let mut conn = connect(RedisTarget::cluster(cluster.urls())).await;
    two_groups(&mut conn, "{orders:2}").await;
    let (code, out, err) = with(&["stream", "trim", "orders", "--dry-run"]);
    assert_eq!((code, err.as_str()), (0, ""));
    assert!(
        out.ends_with(
            "SHARD  DELETED  LEFT  TRIM POINT  REASON\n\
             0      0        0     -           within bounds\n\
             1      0        0     -           within bounds\n\
             2      1        4     2-1         held back by group stopped at 2-1\n"
        ),
        "{out}"
    );
    let (code, _, _) = with(&["stream", "trim", "orders"]);
    assert_eq!(code, 0);
    let len: u64 = conn.xlen("{orders:2}").await.unwrap();
    assert_eq!(len, 4);
    let (code, out, _) = with(&["stream", "retention", "orders", "--clear"]);
    assert_eq!(
        (code, out.as_str()),
        (
            0,
            "stream orders changed: no retention: nothing is trimmed\n"
        )
    );
}

/// `stream create` on a stream that exists, with retention flags: the flags change the given
/// settings and keep the others (as `stream retention` does), and the text says so instead of
/// "nothing changed". Before, it replaced the whole retention and printed "nothing changed".
#[tokio::test]
async fn create_on_an_existing_stream_changes_only_the_given_retention_and_says_so() {
    let server = RedisServer::start().unwrap();
    let url = server.url();
    let first = [
        "stream",
        "create",
        "orders",
        "--shards",
        "2",
        "--retention",
        "force",
        "--retention-max-age",
        "7d",
    ];
    assert_eq!(cli(&url, &first).0, 0);
    let (code, out, err) = cli(
        &url,
        &[
            "stream",
            "create",
            "orders",
            "--shards",
            "2",
            "--retention-max-len",
            "10",
        ],
    );
    assert_eq!((code, err.as_str()), (0, ""));
    assert_eq!(
        out,
        "stream orders already exists with 2 shards: shards unchanged\n\
         stream orders changed: retention force, max age 7days, max len 10 per shard; dead letters: max age none, max len none\n"
    );
    let (_, out, _) = cli(&url, &["stream", "retention", "orders"]);
    assert_eq!(
        out,
        "stream orders: retention force, max age 7days, max len 10 per shard; dead letters: max age none, max len none\n"
    );
    // Without retention flags, an existing stream is left as it is.
    let (_, out, _) = cli(&url, &["stream", "create", "orders", "--shards", "2"]);
    assert_eq!(
        out,
        "stream orders already exists with 2 shards: nothing changed\n"
    );
}
