//! The `stream-listener` command-line tool, run as a process against real Redis servers: the
//! tables it prints, `--json`, exit codes (0 ok, 1 operation error, 2 usage, 3 Redis unreachable)
//! and one-line error messages.

use std::process::{Command, Output};
use std::time::Duration;

use redis::AsyncCommands;
use stream_listener::core::internals::admin;
use stream_listener::core::internals::connection::{RedisConnection, RedisTarget};
use stream_listener::core::model::StartFrom;
use stream_listener_core::testing::{RedisCluster, RedisServer};

const BIN: &str = env!("CARGO_BIN_EXE_stream-listener");

/// Runs the tool with `args` (no `REDIS_URL` from the environment).
fn run(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env_remove("REDIS_URL")
        .output()
        .unwrap()
}

/// Runs the tool against `url`; returns (exit code, stdout, stderr).
fn cli(url: &str, args: &[&str]) -> (i32, String, String) {
    let mut all = vec!["--redis-url", url];
    all.extend_from_slice(args);
    let output = run(&all);
    (
        output.status.code().unwrap(),
        String::from_utf8(output.stdout).unwrap(),
        String::from_utf8(output.stderr).unwrap(),
    )
}

async fn connect(url: &str) -> RedisConnection {
    RedisConnection::connect(
        &RedisTarget::standalone(url.to_owned()),
        Duration::from_secs(5),
    )
    .await
    .unwrap()
}

/// A port nothing listens on.
fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

#[tokio::test]
async fn stream_describe_prints_the_expected_table() {
    let server = RedisServer::start().unwrap();
    let url = server.url();
    let (code, out, err) = cli(&url, &["stream", "create", "orders", "--shards", "3"]);
    assert_eq!((code, err.as_str()), (0, ""));
    assert_eq!(
        out,
        "created stream orders with 3 shards ({orders:0}..{orders:2}), metadataVersion 1\n"
    );
    let (code, out, _) = cli(&url, &["stream", "create", "orders", "--shards", "3"]);
    assert_eq!(code, 0);
    assert_eq!(
        out,
        "stream orders already exists with 3 shards: nothing changed\n"
    );

    let mut conn = connect(&url).await;
    admin::register_group(&mut conn, "orders", "billing", StartFrom::Earliest)
        .await
        .unwrap();
    admin::register_group(&mut conn, "orders", "audit", StartFrom::Latest)
        .await
        .unwrap();
    for id in ["1-1", "1-2", "1-3"] {
        let _: String = conn.xadd("{orders:1}", id, &[("n", id)]).await.unwrap();
    }
    let _: Vec<redis::Value> = redis::cmd("XREADGROUP")
        .arg(&[
            "GROUP",
            "billing",
            "c1",
            "COUNT",
            "1",
            "STREAMS",
            "{orders:1}",
            ">",
        ])
        .query_async(&mut conn)
        .await
        .unwrap();

    let (code, out, err) = cli(&url, &["stream", "describe", "orders"]);
    assert_eq!((code, err.as_str()), (0, ""));
    let shown: Vec<&str> = out
        .lines()
        .filter(|line| !line.starts_with("updated:"))
        .collect();
    assert_eq!(
        shown,
        [
            "stream:          orders",
            "shard count:     3",
            "readable shards: 0-2",
            "metadata:        version 3, revision 3",
            "migration:       none",
            "groups:          billing (earliest), audit (latest)",
            "",
            "SHARD  STATE   LENGTH  GROUP    PENDING  LAG  LAST DELIVERED",
            "0      ACTIVE  0       audit    0        0    0-0",
            "0      ACTIVE  0       billing  0        0    0-0",
            "1      ACTIVE  3       audit    0        3    0-0",
            "1      ACTIVE  3       billing  1        2    1-1",
            "2      ACTIVE  0       audit    0        0    0-0",
            "2      ACTIVE  0       billing  0        0    0-0",
        ]
    );
    assert!(
        out.lines().any(|l| l.starts_with("updated:         20")),
        "{out}"
    );

    // After an XDEL Redis no longer knows the lag: "unknown", never 0.
    let _: u64 = conn.xdel("{orders:1}", &["1-3"]).await.unwrap();
    let (code, out, _) = cli(&url, &["stream", "describe", "orders"]);
    assert_eq!(code, 0);
    assert!(
        out.contains("1      ACTIVE  2       billing  1        unknown  1-1\n"),
        "{out}"
    );
}

#[tokio::test]
async fn json_output_uses_the_stored_field_names() {
    let server = RedisServer::start().unwrap();
    let url = server.url();
    let (code, out, _) = cli(
        &url,
        &["--json", "stream", "create", "orders", "--shards", "2"],
    );
    assert_eq!(code, 0);
    let created: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(created["created"], true);
    assert_eq!(created["metadata"]["streamPrefix"], "orders");
    assert_eq!(created["metadata"]["shardCount"], 2);
    assert_eq!(created["metadata"]["shards"][1]["state"], "ACTIVE");

    let mut conn = connect(&url).await;
    admin::register_group(&mut conn, "orders", "billing", StartFrom::Earliest)
        .await
        .unwrap();
    for id in ["1-1", "1-2"] {
        let _: String = conn.xadd("{orders:0}", id, &[("n", id)]).await.unwrap();
    }
    // An XDEL of the tail: Redis can no longer tell the lag.
    let _: u64 = conn.xdel("{orders:0}", &["1-2"]).await.unwrap();

    // The global flag may also follow the subcommand.
    let (code, out, _) = cli(&url, &["stream", "describe", "orders", "--json"]);
    assert_eq!(code, 0);
    let described: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(described["metadataVersion"], 2);
    assert_eq!(described["readableShardSet"], serde_json::json!([0, 1]));
    let group = &described["shards"][0]["groups"][0];
    assert_eq!(group["name"], "billing");
    assert_eq!(group["lastDeliveredId"], "0-0");
    assert_eq!(group["lag"], "unknown");
    assert_eq!(described["shards"][1]["groups"][0]["lag"], 0);

    let (code, out, _) = cli(&url, &["--json", "group", "describe", "orders", "billing"]);
    assert_eq!(code, 0);
    let group: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(group["consumerGroup"], "billing");
    assert_eq!(group["state"], "EMPTY");
    assert_eq!(group["startFrom"], "earliest");
    assert_eq!(group["members"], serde_json::json!([]));
    assert_eq!(group["shards"][0]["length"], 1);
    assert_eq!(group["shards"][0]["targetOwner"], serde_json::Value::Null);

    let (code, out, _) = cli(&url, &["--json", "stream", "list"]);
    assert_eq!(code, 0);
    let listed: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(listed[0]["streamPrefix"], "orders");
    assert_eq!(listed[0]["groups"], serde_json::json!(["billing"]));
}

#[test]
fn unreachable_redis_exits_3_with_one_clear_line() {
    let port = closed_port();
    let url = format!("redis://127.0.0.1:{port}");
    let (code, out, err) = cli(&url, &["stream", "list"]);
    assert_eq!(code, 3, "{err}");
    assert_eq!(out, "");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with(&format!("error: cannot reach Redis at {url}: ")),
        "{err}"
    );
    assert!(err.contains("check that Redis is running"), "{err}");

    // The same through REDIS_URL, and for a cluster seed node.
    let output = Command::new(BIN)
        .args(["stream", "describe", "orders"])
        .env("REDIS_URL", &url)
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(3));
    let output = run(&["--cluster-node", &url, "stream", "list"]);
    assert_eq!(output.status.code(), Some(3));
    let err = String::from_utf8(output.stderr).unwrap();
    assert!(
        err.starts_with(&format!("error: cannot reach Redis at cluster {url}: ")),
        "{err}"
    );
}

#[test]
fn passwords_in_urls_are_not_printed() {
    let port = closed_port();
    let (code, _, err) = cli(
        &format!("redis://user:hunter2@127.0.0.1:{port}"),
        &["stream", "list"],
    );
    assert_eq!(code, 3);
    assert!(!err.contains("hunter2"), "{err}");
    assert!(
        err.contains(&format!("redis://user:***@127.0.0.1:{port}")),
        "{err}"
    );
}

/// `--help` shows the values of the environment variables behind the options, unless hidden:
/// URLs in `REDIS_URL` and `REDIS_SENTINELS` carry passwords.
#[test]
fn help_does_not_print_passwords_from_the_environment() {
    for command in [&["--help"][..], &["stream", "list", "--help"]] {
        let output = Command::new(BIN)
            .args(command)
            .env("REDIS_URL", "redis://user:hunter2@127.0.0.1:6390")
            .env(
                "REDIS_SENTINELS",
                "redis://sentinel:hunter3@127.0.0.1:26390",
            )
            .output()
            .unwrap();
        assert_eq!(output.status.code(), Some(0));
        let help = String::from_utf8(output.stdout).unwrap();
        assert!(help.contains("--redis-url"), "{help}");
        assert!(!help.contains("hunter2"), "{command:?}: {help}");
        assert!(!help.contains("hunter3"), "{command:?}: {help}");
    }
}

#[test]
fn usage_errors_exit_2() {
    let output = run(&["stream", "create", "orders"]);
    assert_eq!(output.status.code(), Some(2));
    let output = run(&["stream", "scale", "orders", "3", "--cancel"]);
    assert_eq!(output.status.code(), Some(2));
    let output = run(&["stream", "retire", "orders", "--routing-lease", "soon"]);
    assert_eq!(output.status.code(), Some(2));
    let (code, _, err) = cli("not-a-url", &["stream", "list"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.starts_with("error: invalid Redis address not-a-url"),
        "{err}"
    );
    let output = run(&["--help"]);
    assert_eq!(output.status.code(), Some(0));
    let help = String::from_utf8(output.stdout).unwrap();
    assert!(
        help.contains(
            "Exit codes: 0 success, 1 operation failed, 2 usage error, 3 Redis unreachable"
        )
    );
}

#[tokio::test]
async fn operation_errors_exit_1_and_wrong_arguments_exit_2_with_what_to_do() {
    let server = RedisServer::start().unwrap();
    let url = server.url();
    let (code, out, err) = cli(&url, &["stream", "describe", "orders"]);
    assert_eq!((code, out.as_str()), (1, ""));
    assert_eq!(
        err,
        "error: stream \"orders\" does not exist (no key sl:{orders}:stream); create it with `stream-listener stream create orders --shards N`, or set `shards` for it in the config so it is created at startup\n"
    );
    // Arguments wrong in themselves are usage errors (2), whatever Redis holds.
    let (code, _, err) = cli(&url, &["stream", "create", "orders", "--shards", "0"]);
    assert_eq!(code, 2);
    assert!(
        err.starts_with("error: a stream needs at least 1 shard, not 0"),
        "{err}"
    );
    let (code, _, err) = cli(&url, &["stream", "create", "{orders}", "--shards", "2"]);
    assert_eq!(code, 2);
    assert!(err.contains("not allowed"), "{err}");
    let (code, _, _) = cli(&url, &["stream", "create", "orders", "--shards", "2"]);
    assert_eq!(code, 0);
    let (code, _, err) = cli(&url, &["stream", "create", "orders", "--shards", "3"]);
    assert_eq!(code, 1);
    assert!(
        err.contains("use `stream-listener stream scale orders 3`")
            || err.contains("with `stream-listener stream scale orders 3`"),
        "{err}"
    );
    let (code, _, err) = cli(&url, &["stream", "scale", "orders", "--cancel"]);
    assert_eq!(code, 1);
    assert_eq!(
        err,
        "error: stream \"orders\" is not resharding: there is nothing to cancel\n"
    );
    let (code, _, err) = cli(&url, &["group", "describe", "orders", "billing"]);
    assert_eq!(code, 1);
    assert!(err.contains("is not registered"), "{err}");
}

#[tokio::test]
async fn scale_retire_and_group_commands() {
    let server = RedisServer::start().unwrap();
    let url = server.url();
    assert_eq!(
        cli(&url, &["stream", "create", "orders", "--shards", "2"]).0,
        0
    );
    let mut conn = connect(&url).await;
    admin::register_group(&mut conn, "orders", "billing", StartFrom::Earliest)
        .await
        .unwrap();

    let (code, out, _) = cli(&url, &["stream", "scale", "orders", "4"]);
    assert_eq!(code, 0);
    assert_eq!(
        out,
        "scaled out orders from 2 to 4 shards: shards 2-3 provisioned and ACTIVE (metadataVersion 3)\n"
    );
    let _: String = conn.xadd("{orders:3}", "1-1", &[("n", "1")]).await.unwrap();
    let (code, out, _) = cli(&url, &["stream", "scale", "orders", "2"]);
    assert_eq!(code, 0);
    assert!(
        out.starts_with("scale-in of orders from 4 to 2 shards started: shards 2-3 are DRAINING (metadataVersion 4)"),
        "{out}"
    );
    let (code, _, err) = cli(&url, &["stream", "scale", "orders", "3"]);
    assert_eq!(code, 1);
    assert!(err.contains("--cancel"), "{err}");

    let (code, out, _) = cli(&url, &["stream", "retire", "orders"]);
    assert_eq!(code, 0);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "SHARD  STATE     RESULT");
    assert!(
        lines[1].starts_with("2      DRAINING  waiting: routing lease not passed ("),
        "{out}"
    );
    let (code, out, _) = cli(
        &url,
        &["stream", "retire", "orders", "--routing-lease", "0s"],
    );
    assert_eq!(code, 0);
    assert_eq!(
        out,
        "SHARD  STATE     RESULT\n\
         2      RETIRED   retired\n\
         3      DRAINING  waiting: group billing has unread entries (next 1-1)\n\
         migration not complete: run `stream-listener stream retire orders` again later (metadataVersion 6)\n"
    );

    // The group epoch is as the coordinator's next transition makes it: the readable set changed.
    let (code, out, _) = cli(&url, &["group", "list", "orders"]);
    assert_eq!(code, 0);
    assert_eq!(
        out,
        "GROUP    START FROM  STATE  GROUP EPOCH  MEMBERS  LIVE  PROBLEM\n\
         billing  earliest    EMPTY  1            0        0     -\n"
    );
    let (code, out, _) = cli(&url, &["group", "describe", "orders", "billing"]);
    assert_eq!(code, 0);
    let tail: Vec<&str> = out
        .lines()
        .skip_while(|l| !l.starts_with("SHARD"))
        .collect();
    assert_eq!(
        tail,
        [
            "SHARD  STATE     OWNER  LENGTH  PENDING  LAG  LAST DELIVERED  DEAD LETTERS",
            "0      ACTIVE    -      0       0        0    0-0             0",
            "1      ACTIVE    -      0       0        0    0-0             0",
            "3      DRAINING  -      1       0        1    0-0             0",
        ]
    );
    assert!(out.contains("\nno members\n"), "{out}");

    let (code, out, _) = cli(&url, &["group", "delete", "orders", "billing"]);
    assert_eq!(code, 0);
    assert_eq!(
        out,
        "deleted group billing of stream orders: 1 metadata keys, unregistered, consumer groups destroyed on shards 0-1,3; dead-letter stream orders:dlq:billing deleted (0 entries)\n"
    );
    let (code, out, _) = cli(
        &url,
        &["stream", "retire", "orders", "--routing-lease", "0s"],
    );
    assert_eq!(code, 0);
    assert_eq!(
        out,
        "SHARD  STATE    RESULT\n\
         3      RETIRED  retired\n\
         migration complete: readable shards 0-1 (metadataVersion 9)\n"
    );
    let (code, out, _) = cli(&url, &["stream", "list"]);
    assert_eq!(code, 0);
    assert_eq!(
        out,
        "STREAM  SHARDS  VERSION  GROUPS  MIGRATION\n\
         orders  2       9        -       -\n"
    );

    // One shard is named in the singular.
    let (code, out, _) = cli(&url, &["stream", "scale", "orders", "3"]);
    assert_eq!(code, 0);
    assert_eq!(
        out,
        "scaled out orders from 2 to 3 shards: shard 2 provisioned and ACTIVE (metadataVersion 10)\n"
    );
    let (code, out, _) = cli(&url, &["stream", "scale", "orders", "2"]);
    assert_eq!(code, 0);
    assert!(
        out.starts_with("scale-in of orders from 3 to 2 shards started: shard 2 is DRAINING (metadataVersion 11);"),
        "{out}"
    );
}

#[tokio::test]
async fn cluster_nodes_select_the_cluster() {
    let cluster = RedisCluster::start().unwrap();
    let mut args: Vec<String> = Vec::new();
    for url in cluster.urls() {
        args.push("--cluster-node".into());
        args.push(url);
    }
    let with = |extra: &[&str]| {
        let mut all: Vec<&str> = args.iter().map(String::as_str).collect();
        all.extend_from_slice(extra);
        run(&all)
    };
    let output = with(&["stream", "create", "orders", "--shards", "4"]);
    assert_eq!(output.status.code(), Some(0), "{output:?}");
    let output = with(&["stream", "scale", "orders", "2"]);
    assert_eq!(output.status.code(), Some(0), "{output:?}");
    let output = with(&["stream", "retire", "orders", "--routing-lease", "0s"]);
    assert_eq!(output.status.code(), Some(0), "{output:?}");
    let output = with(&["stream", "describe", "orders"]);
    assert_eq!(output.status.code(), Some(0), "{output:?}");
    let out = String::from_utf8(output.stdout).unwrap();
    assert!(out.contains("readable shards: 0-1\n"), "{out}");
    assert!(
        out.contains("3      RETIRED  -       -      -        -    -\n"),
        "{out}"
    );
}

#[tokio::test]
async fn group_reset_and_stream_delete_print_results_and_exit_codes() {
    let server = RedisServer::start().unwrap();
    let url = server.url();
    let mut conn = connect(&url).await;
    admin::create_stream(&mut conn, "orders", 2).await.unwrap();
    admin::register_group(&mut conn, "orders", "billing", StartFrom::Earliest)
        .await
        .unwrap();
    for id in ["1000-0", "2000-0", "3000-0"] {
        let _: String = conn.xadd("{orders:1}", id, &[("n", id)]).await.unwrap();
    }
    let _: Vec<redis::Value> = redis::cmd("XREADGROUP")
        .arg(&["GROUP", "billing", "c1", "STREAMS", "{orders:1}", ">"])
        .query_async(&mut conn)
        .await
        .unwrap();

    let (code, out, err) = cli(
        &url,
        &[
            "group",
            "reset",
            "orders",
            "billing",
            "--to",
            "1970-01-01T00:00:02Z",
            "--dry-run",
        ],
    );
    assert_eq!((code, err.as_str()), (0, ""));
    assert_eq!(
        out,
        "dry run: group billing of stream orders would be reset to 1970-01-01T00:00:02.000Z; nothing changed\n\
         SHARD  OLD POSITION  NEW POSITION               TO DELIVER  SKIPPED  PENDING CLEARED\n\
         0      0-0           0-0                        0           0        0\n\
         1      3000-0        1999-18446744073709551615  2           0        3\n"
    );
    let (code, out, _) = cli(
        &url,
        &[
            "--json",
            "group",
            "reset",
            "orders",
            "billing",
            "--shift-by",
            "-1",
            "--shards",
            "1",
        ],
    );
    assert_eq!(code, 0);
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(json["dryRun"], false);
    assert_eq!(
        json["target"],
        serde_json::json!({"kind": "shiftBy", "n": -1})
    );
    assert_eq!(json["shards"][0]["shardIndex"], 1);
    assert_eq!(json["shards"][0]["newPosition"], "2000-0");
    assert_eq!(json["shards"][0]["toDeliver"], 1);
    assert_eq!(json["shards"][0]["entriesRead"], 2);

    for (args, code, needle) in [
        (vec!["--shift-by", "0"], 2, "--shift-by 0 moves nothing"),
        // Against Redis's clock: what Redis holds, so an operation error.
        (vec!["--to", "2999-01-01T00:00:00Z"], 1, "in the future"),
        (vec!["--to", "latest", "--shards", "0,5"], 1, "shard 5"),
        (vec!["--shift-by", "x"], 2, "invalid value"),
        (vec!["--to", "yesterday"], 2, "RFC 3339"),
        (vec![], 2, "--to"),
        (
            vec!["--to", "latest", "--shift-by", "1"],
            2,
            "cannot be used with",
        ),
    ] {
        let mut all = vec!["group", "reset", "orders", "billing"];
        all.extend(args.iter().copied());
        let (got, out, err) = cli(&url, &all);
        assert_eq!(got, code, "{args:?}: {err}");
        assert!(out.is_empty(), "{args:?}: {out}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    let (code, _, err) = cli(
        &url,
        &["group", "reset", "orders", "nobody", "--to", "latest"],
    );
    assert_eq!(code, 1);
    assert!(err.contains("nobody"), "{err}");

    admin::register_group(&mut conn, "orders", "audit", StartFrom::Latest)
        .await
        .unwrap();
    let _: String = conn
        .xadd("orders:dlq:audit", "*", &[("shard", "0")])
        .await
        .unwrap();
    let (code, out, err) = cli(
        &url,
        &["group", "delete", "orders", "audit", "--keep-dead-letters"],
    );
    assert_eq!((code, err.as_str()), (0, ""));
    assert_eq!(
        out,
        "deleted group audit of stream orders: 1 metadata keys, unregistered, consumer groups destroyed on shards 0-1; dead-letter stream orders:dlq:audit kept (1 entries)\n"
    );

    let (code, _, err) = cli(&url, &["stream", "delete", "orders"]);
    assert_eq!(code, 1);
    assert!(
        err.contains("consumer group \"billing\" on shard 1") && err.contains("--force"),
        "{err}"
    );
    let (code, out, err) = cli(&url, &["stream", "delete", "orders", "--force"]);
    assert_eq!((code, err.as_str()), (0, ""));
    // 5 keys: 2 shard streams, the stream metadata, the group hash, audit's kept dead letters.
    assert_eq!(
        out,
        "deleted stream orders (forced): 5 keys, shard streams 0-1, groups billing, dead letters of unregistered groups orders:dlq:audit\n"
    );
    let (code, _, err) = cli(&url, &["stream", "delete", "orders"]);
    assert_eq!(code, 1, "{err}");
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(keys, Vec::<String>::new());
}

/// Makes `consumer` a Redis consumer of `group` on `key` with `pending` entries read and not
/// acked.
async fn consumer_on(
    conn: &mut RedisConnection,
    key: &str,
    group: &str,
    consumer: &str,
    pending: usize,
) {
    let _: i64 = redis::cmd("XGROUP")
        .arg("CREATECONSUMER")
        .arg(key)
        .arg(group)
        .arg(consumer)
        .query_async(conn)
        .await
        .unwrap();
    for _ in 0..pending {
        let _: String = conn.xadd(key, "*", &[("n", "1")]).await.unwrap();
    }
    if pending > 0 {
        let _: redis::Value = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(group)
            .arg(consumer)
            .arg("COUNT")
            .arg(pending)
            .arg("STREAMS")
            .arg(key)
            .arg(">")
            .query_async(conn)
            .await
            .unwrap();
    }
}

/// The group's consumer names on `key`, sorted.
async fn consumer_names(conn: &mut RedisConnection, key: &str, group: &str) -> Vec<String> {
    let reply: redis::streams::StreamInfoConsumersReply =
        conn.xinfo_consumers(key, group).await.unwrap();
    let mut names: Vec<String> = reply.consumers.into_iter().map(|c| c.name).collect();
    names.sort();
    names
}

/// `group cleanup`: the dry run prints per shard what would go and what stays and why, and
/// changes nothing; `--json`; then the cleanup deletes exactly those; an unknown group or
/// stream, or an invalid name, exits 1 naming it and changes nothing.
#[tokio::test]
async fn group_cleanup_lists_then_deletes_idle_consumers_of_members_that_left() {
    let server = RedisServer::start().unwrap();
    let url = server.url();
    let mut conn = connect(&url).await;
    admin::create_stream(&mut conn, "orders", 2).await.unwrap();
    admin::register_group(&mut conn, "orders", "billing", StartFrom::Earliest)
        .await
        .unwrap();
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await.unwrap();
    let now = secs * 1_000_000 + micros;
    let _: i64 = conn
        .zadd("sl:{orders:billing}:leases", "live-m0", now + 60_000_000)
        .await
        .unwrap();
    consumer_on(&mut conn, "{orders:0}", "billing", "live-m0", 0).await;
    consumer_on(&mut conn, "{orders:0}", "billing", "gone-m0", 0).await;
    consumer_on(&mut conn, "{orders:1}", "billing", "busy-m0", 2).await;
    consumer_on(&mut conn, "{orders:1}", "billing", "old-m0", 0).await;

    let (code, out, err) = cli(
        &url,
        &["group", "cleanup", "orders", "billing", "--dry-run"],
    );
    assert_eq!((code, err.as_str()), (0, ""));
    assert_eq!(
        out,
        "consumer cleanup of group billing on stream orders (dry run: nothing deleted)\n\
         shard 0: would delete gone-m0\n  kept live-m0 (live member, pending 0)\n\
         shard 1: would delete old-m0\n  kept busy-m0 (no member, pending entries, pending 2)\n\
         would delete 2 consumers in all\n"
    );
    assert_eq!(
        consumer_names(&mut conn, "{orders:0}", "billing").await,
        ["gone-m0", "live-m0"]
    );
    assert_eq!(
        consumer_names(&mut conn, "{orders:1}", "billing").await,
        ["busy-m0", "old-m0"]
    );

    let (code, out, _) = cli(
        &url,
        &[
            "--json",
            "group",
            "cleanup",
            "orders",
            "billing",
            "--dry-run",
        ],
    );
    assert_eq!(code, 0);
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(json["dryRun"], true);
    assert_eq!(json["shards"][1]["deleted"], serde_json::json!(["old-m0"]));
    assert_eq!(
        json["shards"][1]["kept"],
        serde_json::json!([{"consumer": "busy-m0", "reason": "pending", "pending": 2}])
    );
    assert_eq!(json["shards"][0]["kept"][0]["reason"], "liveMember");

    for (args, expected_code, names) in [
        (["group", "cleanup", "orders", "nobody"], 1, "\"nobody\""),
        (["group", "cleanup", "nowhere", "billing"], 1, "\"nowhere\""),
        (["group", "cleanup", "orders", "a:b"], 2, "a:b"),
    ] {
        let (code, out, err) = cli(&url, &args);
        assert_eq!((code, out.as_str()), (expected_code, ""), "{args:?}: {err}");
        assert!(
            err.starts_with("error: ") && err.contains(names),
            "{args:?}: {err}"
        );
        assert_eq!(err.lines().count(), 1, "{err}");
    }

    let (code, out, _) = cli(&url, &["group", "cleanup", "orders", "billing"]);
    assert_eq!(code, 0);
    assert!(out.contains("shard 0: deleted gone-m0\n"), "{out}");
    assert!(out.ends_with("deleted 2 consumers in all\n"), "{out}");
    assert_eq!(
        consumer_names(&mut conn, "{orders:0}", "billing").await,
        ["live-m0"]
    );
    assert_eq!(
        consumer_names(&mut conn, "{orders:1}", "billing").await,
        ["busy-m0"]
    );
}

#[tokio::test]
async fn group_cleanup_works_on_a_cluster() {
    let cluster = RedisCluster::start().unwrap();
    let mut args: Vec<String> = Vec::new();
    for url in cluster.urls() {
        args.push("--cluster-node".into());
        args.push(url);
    }
    let with = |extra: &[&str]| {
        let mut all: Vec<&str> = args.iter().map(String::as_str).collect();
        all.extend_from_slice(extra);
        run(&all)
    };
    let mut conn = RedisConnection::connect(
        &RedisTarget::cluster(cluster.urls()),
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    admin::create_stream(&mut conn, "orders", 3).await.unwrap();
    admin::register_group(&mut conn, "orders", "billing", StartFrom::Earliest)
        .await
        .unwrap();
    for shard in 0..3 {
        let key = format!("{{orders:{shard}}}");
        consumer_on(&mut conn, &key, "billing", "gone-m0", 0).await;
        consumer_on(&mut conn, &key, "billing", "busy-m0", 1).await;
    }
    let output = with(&["group", "cleanup", "orders", "billing"]);
    assert_eq!(output.status.code(), Some(0), "{output:?}");
    let out = String::from_utf8(output.stdout).unwrap();
    assert_eq!(
        out,
        "consumer cleanup of group billing on stream orders\n\
         shard 0: deleted gone-m0\n  kept busy-m0 (no member, pending entries, pending 1)\n\
         shard 1: deleted gone-m0\n  kept busy-m0 (no member, pending entries, pending 1)\n\
         shard 2: deleted gone-m0\n  kept busy-m0 (no member, pending entries, pending 1)\n\
         deleted 3 consumers in all\n"
    );
    for shard in 0..3 {
        let key = format!("{{orders:{shard}}}");
        assert_eq!(
            consumer_names(&mut conn, &key, "billing").await,
            ["busy-m0"]
        );
    }
}
