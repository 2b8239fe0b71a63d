//! `stream-listener dlq ...` run as a process against real Redis servers: the tables, `--json`,
//! exit codes (0 ok, 1 operation error, 2 usage) and messages of list, show, replay and purge,
//! and the dead-letter line of `group describe`.

use std::process::{Command, Output};
use std::time::Duration;

use redis::AsyncCommands;
use serde_json::Value;
use stream_listener::core::internals::admin;
use stream_listener::core::internals::connection::{RedisConnection, RedisTarget};
use stream_listener::core::model::StartFrom;
use stream_listener::shard_for_key;
use stream_listener_core::testing::{RedisCluster, RedisServer};

const BIN: &str = env!("CARGO_BIN_EXE_stream-listener");
const DLQ: &str = "orders:dlq:billing";
const TWO_HOURS_MS: u64 = 2 * 3_600_000;

/// Runs the tool with `args` (no `REDIS_URL` from the environment).
fn run(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env_remove("REDIS_URL")
        .output()
        .unwrap()
}

/// Runs the tool with `before` then `args`; returns (exit code, stdout, stderr).
fn cli_with(before: &[String], args: &[&str]) -> (i32, String, String) {
    let mut all: Vec<&str> = before.iter().map(String::as_str).collect();
    all.extend_from_slice(args);
    let output = run(&all);
    (
        output.status.code().unwrap(),
        String::from_utf8(output.stdout).unwrap(),
        String::from_utf8(output.stderr).unwrap(),
    )
}

fn json(out: &str) -> Value {
    serde_json::from_str(out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

/// A stream `orders` of 2 shards with group `billing`, and two dead letters written with the
/// fixed fields two hours in the past (so their age reads `2h`): one from key `a` with its
/// payload, one dead-lettered by id (too large). Returns their ids.
async fn two_dead_letters(conn: &mut RedisConnection) -> (String, String) {
    admin::create_stream(conn, "orders", 2).await.unwrap();
    admin::register_group(conn, "orders", "billing", StartFrom::Earliest)
        .await
        .unwrap();
    let (secs, _): (u64, u64) = redis::cmd("TIME").query_async(conn).await.unwrap();
    let ms = secs * 1000 - TWO_HOURS_MS;
    let shard = shard_for_key("a", 2).to_string();
    let source = format!("{{orders:{shard}}}");
    let with_payload = format!("{ms}-0");
    let too_large = format!("{ms}-1");
    let fixed = |source_id: &str, reason: &str, error: &str, attempts: &str| {
        vec![
            ("sourceStream", source.clone()),
            ("sourceId", source_id.to_owned()),
            ("shard", shard.clone()),
            ("group", "billing".to_owned()),
            ("reason", reason.to_owned()),
            ("error", error.to_owned()),
            ("attempts", attempts.to_owned()),
        ]
    };
    let mut first = fixed("5-0", "handler", "boom\n  caused by: disk full", "3");
    first.push(("key", "a".into()));
    first.push(("payload", r#"{"n":1}"#.into()));
    let _: String = conn.xadd(DLQ, &with_payload, &first).await.unwrap();
    let second = fixed("6-0", "too-large", "entry of 17000000 bytes", "0");
    let _: String = conn.xadd(DLQ, &too_large, &second).await.unwrap();
    (with_payload, too_large)
}

async fn connect(target: RedisTarget) -> RedisConnection {
    RedisConnection::connect(&target, Duration::from_secs(5))
        .await
        .unwrap()
}

#[tokio::test]
async fn dlq_list_show_replay_and_purge_through_the_tool() {
    let server = RedisServer::start().unwrap();
    let url = vec!["--redis-url".to_owned(), server.url()];
    let cli = |args: &[&str]| cli_with(&url, args);
    let mut conn = connect(RedisTarget::standalone(server.url())).await;
    let (a, b) = two_dead_letters(&mut conn).await;
    let shard = shard_for_key("a", 2);

    // list: a table, the error on one line.
    let (code, out, err) = cli(&["dlq", "list", "orders", "billing"]);
    assert_eq!((code, err.as_str()), (0, ""), "{out}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines[0],
        "dead letters of group billing on stream orders (orders:dlq:billing): 2 in total"
    );
    let rows: Vec<Vec<&str>> = lines[2..]
        .iter()
        .map(|l| l.split_whitespace().collect())
        .collect();
    let shard_text = shard.to_string();
    assert_eq!(
        rows,
        vec![
            vec![
                "ID", "SHARD", "SOURCE", "ID", "REASON", "ATTEMPTS", "AGE", "ENTRY", "ERROR"
            ],
            vec![
                &a,
                &shard_text,
                "5-0",
                "handler",
                "3",
                "2h",
                "kept",
                "boom",
                "caused",
                "by:",
                "disk",
                "full"
            ],
            vec![
                &b,
                &shard_text,
                "6-0",
                "too-large",
                "0",
                "2h",
                "id-only",
                "entry",
                "of",
                "17000000",
                "bytes"
            ],
        ]
    );

    // list --json, paged: the full error, and the id to continue after.
    let (code, out, _) = cli(&["--json", "dlq", "list", "orders", "billing", "--count", "1"]);
    assert_eq!(code, 0);
    let page = json(&out);
    assert_eq!(page["total"], 2);
    assert_eq!(page["deadLetterStream"], DLQ);
    assert_eq!(page["nextAfter"], a.as_str());
    let first = &page["deadLetters"][0];
    assert_eq!(first["id"], a.as_str());
    assert_eq!(first["sourceStream"], format!("{{orders:{shard}}}"));
    assert_eq!(first["sourceId"], "5-0");
    assert_eq!(first["shard"], shard);
    assert_eq!(first["reason"], "handler");
    assert_eq!(first["error"], "boom\n  caused by: disk full");
    assert_eq!(first["attempts"], 3);
    assert_eq!(first["payloadFields"], 2);
    let age = first["ageMs"].as_u64().unwrap();
    assert!(
        (TWO_HOURS_MS..TWO_HOURS_MS + 60_000).contains(&age),
        "{age}"
    );
    let (_, out, _) = cli(&["--json", "dlq", "list", "orders", "billing", "--after", &a]);
    let page = json(&out);
    assert_eq!(page["deadLetters"][0]["id"], b.as_str());
    assert_eq!(page["nextAfter"], Value::Null);

    // show: every field.
    let (code, out, _) = cli(&["dlq", "show", "orders", "billing", &a]);
    assert_eq!(code, 0);
    assert!(
        out.contains(
            "error:\n  boom\n    caused by: disk full\nfields:\n  key = a\n  payload = {\"n\":1}\n"
        ),
        "{out}"
    );
    assert!(out.starts_with(&format!("id:           {a}\n")), "{out}");
    let (_, out, _) = cli(&["dlq", "show", "orders", "billing", &b]);
    assert!(
        out.contains("fields:       none (dead-lettered by id"),
        "{out}"
    );

    // describe: count and oldest age.
    let (_, out, _) = cli(&["group", "describe", "orders", "billing"]);
    assert!(
        out.contains("dead letters: 2 in orders:dlq:billing, oldest 2h old\n"),
        "{out}"
    );

    // replay --dry-run changes nothing; replay --all publishes one and skips the other. Another
    // group of the stream receives the replayed entry too, and the report says so.
    admin::register_group(&mut conn, "orders", "audit", StartFrom::Latest)
        .await
        .unwrap();
    let (code, out, _) = cli(&["dlq", "replay", "orders", "billing", "--all", "--dry-run"]);
    assert_eq!(code, 0);
    assert!(
        out.starts_with("dry run: would replay 1 dead letter of orders:dlq:billing (nothing published or removed):\n"),
        "{out}"
    );
    assert!(
        out.contains(&format!(
            "DEAD LETTER      KEY  SHARD\n{a}  a    {shard}\nnote: consumer groups audit of orders receive the replayed entries too (a second copy of what they handled)\nskipped 1 (kept):\n"
        )),
        "{out}"
    );
    assert_eq!(conn.xlen::<_, u64>(DLQ).await.unwrap(), 2);
    let (code, out, _) = cli(&["--json", "dlq", "replay", "orders", "billing", "--all"]);
    assert_eq!(code, 0, "{out}");
    let report = json(&out);
    assert_eq!(report["dryRun"], false);
    assert_eq!(report["selection"], "all");
    let replayed = &report["replayed"][0];
    assert_eq!(replayed["id"], a.as_str());
    assert_eq!(replayed["partitionKey"], "a");
    assert_eq!(replayed["shard"], shard);
    assert_eq!(replayed["streamKey"], format!("{{orders:{shard}}}"));
    assert_eq!(replayed["removed"], true);
    let new_id = replayed["newId"].as_str().unwrap().to_owned();
    assert_eq!(report["skipped"][0]["id"], b.as_str());
    assert_eq!(report["skipped"][0]["skipped"], "no-payload");
    assert_eq!(report["otherGroups"], serde_json::json!(["audit"]));
    let entry: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
        .arg(format!("{{orders:{shard}}}"))
        .arg(&new_id)
        .arg(&new_id)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        entry[0].1,
        vec![
            ("key".to_owned(), "a".to_owned()),
            ("payload".to_owned(), r#"{"n":1}"#.to_owned())
        ]
    );
    let (code, out, _) = cli(&["dlq", "replay", "orders", "billing", "--id", &b]);
    assert_eq!(code, 0);
    assert_eq!(
        out,
        format!(
            "replayed 0 dead letters of orders:dlq:billing\nskipped 1 (kept):\n  {b} (too-large): no payload fields (dead-lettered by id: trimmed or too large); kept, purge it with `dlq purge --id`\n"
        )
    );

    // Bad input.
    let (code, _, err) = cli(&["dlq", "purge", "orders", "billing"]);
    assert_eq!(code, 2);
    assert!(
        err.contains("--id <ID>...|--all|--reason <REASON>|--older-than <DURATION>"),
        "{err}"
    );
    let (code, _, err) = cli(&["dlq", "replay", "orders", "billing", "--reason", "oops"]);
    assert_eq!(code, 2);
    assert!(err.contains("\"oops\" is not a dead-letter reason; give one of handler, non-retryable, decode, max-deliveries, too-large"), "{err}");
    let (code, _, err) = cli(&["dlq", "purge", "orders", "billing", "--id", "1-1", &b]);
    assert_eq!(code, 1);
    assert_eq!(
        err,
        "error: no dead letter 1-1 in orders:dlq:billing; nothing was done; list the dead letters with `stream-listener dlq list`\n"
    );
    let (code, _, err) = cli(&["dlq", "show", "orders", "billing", "nope"]);
    assert_eq!(code, 2);
    assert!(
        err.starts_with("error: \"nope\" is not a stream entry id"),
        "{err}"
    );
    let (code, _, err) = cli(&["dlq", "list", "orders", "ghost"]);
    assert_eq!(code, 1);
    assert!(
        err.contains("consumer group \"ghost\" is not registered"),
        "{err}"
    );
    assert_eq!(conn.xlen::<_, u64>(DLQ).await.unwrap(), 1);

    // purge: dry run, then for real.
    let (code, out, _) = cli(&[
        "dlq",
        "purge",
        "orders",
        "billing",
        "--older-than",
        "1h",
        "--dry-run",
    ]);
    assert_eq!(code, 0);
    assert_eq!(
        out,
        format!("dry run: would purge 1 dead letter from orders:dlq:billing: {b}\n")
    );
    let (code, out, _) = cli(&["dlq", "purge", "orders", "billing", "--older-than", "3h"]);
    assert_eq!(code, 0);
    assert_eq!(
        out,
        "no dead letter of orders:dlq:billing matches: nothing purged\n"
    );
    let (code, out, _) = cli(&[
        "--json",
        "dlq",
        "purge",
        "orders",
        "billing",
        "--reason",
        "too-large",
    ]);
    assert_eq!(code, 0);
    let report = json(&out);
    assert_eq!(report["purged"], 1);
    assert_eq!(report["ids"][0], b.as_str());
    assert_eq!(report["selection"]["reason"], "too-large");
    let (_, out, _) = cli(&[
        "--json",
        "dlq",
        "purge",
        "orders",
        "billing",
        "--older-than",
        "2d",
        "--dry-run",
    ]);
    assert_eq!(json(&out)["selection"]["olderThanMs"], 2 * 86_400_000u64);
    assert_eq!(conn.xlen::<_, u64>(DLQ).await.unwrap(), 0);
    let (_, out, _) = cli(&["group", "describe", "orders", "billing"]);
    assert!(
        out.contains("dead letters: 0 in orders:dlq:billing\n"),
        "{out}"
    );
}

#[tokio::test]
async fn dlq_list_and_replay_on_a_cluster() {
    let cluster = RedisCluster::start().unwrap();
    let nodes: Vec<String> = cluster
        .urls()
        .into_iter()
        .flat_map(|url| ["--cluster-node".to_owned(), url])
        .collect();
    let mut conn = connect(RedisTarget::cluster(cluster.urls())).await;
    let (a, b) = two_dead_letters(&mut conn).await;
    let (code, out, err) = cli_with(&nodes, &["--json", "dlq", "list", "orders", "billing"]);
    assert_eq!((code, err.as_str()), (0, ""));
    let ids: Vec<String> = json(&out)["deadLetters"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(ids, [a.clone(), b.clone()]);
    let (code, out, err) = cli_with(
        &nodes,
        &["--json", "dlq", "replay", "orders", "billing", "--id", &a],
    );
    assert_eq!((code, err.as_str()), (0, ""));
    let report = json(&out);
    assert_eq!(report["replayed"][0]["shard"], shard_for_key("a", 2));
    assert_eq!(report["replayed"][0]["removed"], true);
    let shard_len: u64 = conn
        .xlen(format!("{{orders:{}}}", shard_for_key("a", 2)))
        .await
        .unwrap();
    assert_eq!(shard_len, 1);
    let (code, out, _) = cli_with(&nodes, &["dlq", "purge", "orders", "billing", "--all"]);
    assert_eq!(code, 0);
    assert_eq!(
        out,
        format!("purged 1 dead letter from orders:dlq:billing: {b}\n")
    );
}

/// Two dead letters of one entry (written twice after a crash between the dead letter and the
/// ack): the replay publishes the entry once and says it removed the second.
#[tokio::test]
async fn dlq_replay_publishes_an_entry_dead_lettered_twice_once() {
    let server = RedisServer::start().unwrap();
    let url = vec!["--redis-url".to_owned(), server.url()];
    let mut conn = connect(RedisTarget::standalone(server.url())).await;
    admin::create_stream(&mut conn, "orders", 1).await.unwrap();
    admin::register_group(&mut conn, "orders", "billing", StartFrom::Earliest)
        .await
        .unwrap();
    for id in ["1-0", "2-0"] {
        let fields = [
            ("sourceStream", "{orders:0}"),
            ("sourceId", "5-0"),
            ("shard", "0"),
            ("group", "billing"),
            ("reason", "handler"),
            ("error", "boom"),
            ("attempts", "3"),
            ("key", "a"),
            ("payload", r#"{"n":1}"#),
        ];
        let _: String = conn.xadd(DLQ, id, &fields).await.unwrap();
    }

    let (code, out, err) = cli_with(&url, &["dlq", "replay", "orders", "billing", "--all"]);
    assert_eq!((code, err.as_str()), (0, ""), "{out}");
    assert!(
        out.starts_with("replayed 1 dead letter of orders:dlq:billing:\n"),
        "{out}"
    );
    assert!(
        out.ends_with("removed 1 dead letter naming an entry replayed above (dead-lettered twice, which at-least-once delivery allows):\n  2-0 (same entry as 1-0)\n"),
        "{out}"
    );
    assert_eq!(conn.xlen::<_, u64>(DLQ).await.unwrap(), 0);
    assert_eq!(conn.xlen::<_, u64>("{orders:0}").await.unwrap(), 1);
}
