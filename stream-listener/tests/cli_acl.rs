//! The admin tool as the README's `sl-admin` user (README "ACL users"): the rule is read from
//! README.md, created on a real server, and every subcommand runs as that user without one
//! refusal (`ACL LOG` stays empty). A user lacking one permission gets an error naming it, and
//! the password is never printed, with a wrong password or an unreachable host.

use std::process::Command;
use std::time::Duration;

use redis::AsyncCommands;
use stream_listener::core::internals::admin;
use stream_listener::core::internals::connection::{RedisConnection, RedisTarget};
use stream_listener::core::model::StartFrom;
use stream_listener_core::testing::RedisServer;
use stream_listener_core::testing::acl::{AclRule, readme_acl_rules, rule_of};

const BIN: &str = env!("CARGO_BIN_EXE_stream-listener");
const DLQ: &str = "orders:dlq:billing";

fn admin_rule() -> AclRule {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md"))
        .expect("README.md is readable");
    let rules = readme_acl_rules(&readme).unwrap();
    rule_of(&rules, "sl-admin").unwrap().clone()
}

/// Runs the tool against `url`; returns (exit code, stdout, stderr).
fn cli(url: &str, args: &[&str]) -> (i32, String, String) {
    let output = Command::new(BIN)
        .arg("--redis-url")
        .arg(url)
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

/// Runs the tool and asserts it succeeded; returns stdout.
fn ok(url: &str, args: &[&str]) -> String {
    let (code, out, err) = cli(url, args);
    assert_eq!(code, 0, "{args:?} failed: {err}{out}");
    out
}

async fn connect(url: String) -> RedisConnection {
    RedisConnection::connect(&RedisTarget::standalone(url), Duration::from_secs(5))
        .await
        .unwrap()
}

/// Three dead letters of `billing` with payloads (written as the default user).
async fn dead_letters(conn: &mut RedisConnection) -> Vec<String> {
    let mut ids = Vec::new();
    for n in 1..=3 {
        let fields = [
            ("sourceStream", "{orders:0}".to_owned()),
            ("sourceId", format!("{n}-0")),
            ("shard", "0".to_owned()),
            ("group", "billing".to_owned()),
            ("reason", "handler".to_owned()),
            ("error", "boom".to_owned()),
            ("attempts", "1".to_owned()),
            ("key", format!("k{n}")),
            ("payload", format!("{{\"n\":{n}}}")),
        ];
        let id: String = conn.xadd(DLQ, "*", &fields).await.unwrap();
        ids.push(id);
    }
    ids
}

async fn acl_log(conn: &mut RedisConnection) -> Vec<String> {
    let raw: Vec<redis::Value> = redis::cmd("ACL")
        .arg("LOG")
        .query_async(conn)
        .await
        .unwrap();
    raw.iter().map(|e| format!("{e:?}")).collect()
}

/// Every subcommand of the tool, as `sl-admin`, on a stream with a group, entries and dead
/// letters: all succeed and Redis refuses nothing.
#[tokio::test]
async fn every_admin_command_runs_as_the_readme_admin_user() {
    let server = RedisServer::start().unwrap();
    let rule = admin_rule();
    rule.apply(&mut server.client().get_connection().unwrap())
        .unwrap();
    let mut conn = connect(server.url()).await;
    let url = rule.url(&server.addr());
    let url = url.as_str();

    ok(url, &["stream", "create", "orders", "--shards", "2"]);
    admin::register_group(&mut conn, "orders", "billing", StartFrom::Earliest)
        .await
        .unwrap();
    for n in 0..5 {
        let _: String = conn.xadd("{orders:0}", "*", &[("n", n)]).await.unwrap();
    }
    let ids = dead_letters(&mut conn).await;

    ok(url, &["stream", "list"]);
    ok(url, &["stream", "describe", "orders"]);
    ok(url, &["stream", "scale", "orders", "3"]);
    ok(url, &["stream", "scale", "orders", "2"]);
    ok(
        url,
        &["stream", "retire", "orders", "--routing-lease", "0s"],
    );
    ok(
        url,
        &[
            "stream",
            "retention",
            "orders",
            "--retention-max-len",
            "1000",
        ],
    );
    ok(url, &["stream", "trim", "orders", "--dry-run"]);
    ok(url, &["stream", "trim", "orders"]);
    ok(url, &["group", "list", "orders"]);
    ok(url, &["group", "describe", "orders", "billing"]);
    ok(url, &["group", "cleanup", "orders", "billing", "--dry-run"]);
    ok(url, &["group", "cleanup", "orders", "billing"]);
    ok(url, &["dlq", "list", "orders", "billing"]);
    ok(url, &["dlq", "show", "orders", "billing", &ids[0]]);
    ok(
        url,
        &["dlq", "replay", "orders", "billing", "--id", &ids[0]],
    );
    ok(url, &["dlq", "purge", "orders", "billing", "--id", &ids[1]]);
    ok(url, &["dlq", "purge", "orders", "billing", "--all"]);
    ok(
        url,
        &[
            "group",
            "reset",
            "orders",
            "billing",
            "--to",
            "earliest",
            "--dry-run",
        ],
    );
    ok(
        url,
        &["group", "reset", "orders", "billing", "--to", "latest"],
    );
    ok(url, &["group", "delete", "orders", "billing"]);
    ok(url, &["stream", "delete", "orders", "--force"]);
    let exists: bool = conn.exists("sl:{orders}:stream").await.unwrap();
    assert!(!exists, "the stream is deleted");
    assert_eq!(
        acl_log(&mut conn).await,
        Vec::<String>::new(),
        "no command or key refused"
    );
}

/// Without `+xdel` the purge fails (exit 1) naming the command; without the dead-letter key
/// pattern the list fails naming the key; neither prints the password.
/// The README's admin rule covers one stream: `stream list` lists that one and shows the others
/// as unreadable (it failed as a whole with `NoPerm` as soon as another stream existed).
#[tokio::test]
async fn stream_list_as_a_one_stream_admin_shows_the_others_as_unreadable() {
    let server = RedisServer::start().unwrap();
    let rule = admin_rule();
    rule.apply(&mut server.client().get_connection().unwrap())
        .unwrap();
    let mut conn = connect(server.url()).await;
    admin::create_stream(&mut conn, "orders", 2).await.unwrap();
    admin::create_stream(&mut conn, "payments", 3)
        .await
        .unwrap();
    let url = rule.url(&server.addr());
    let out = ok(&url, &["stream", "list"]);
    let line = |prefix: &str| {
        out.lines()
            .find(|l| l.split_whitespace().next() == Some(prefix))
            .unwrap_or_else(|| panic!("no row for {prefix}: {out}"))
            .to_owned()
    };
    assert!(line("orders").split_whitespace().any(|w| w == "2"), "{out}");
    let payments = line("payments");
    assert!(
        payments.contains("unreadable") && payments.contains("ACL rule"),
        "{out}"
    );
}

#[tokio::test]
async fn a_missing_admin_permission_is_named() {
    let server = RedisServer::start().unwrap();
    let mut sync = server.client().get_connection().unwrap();
    let mut conn = connect(server.url()).await;
    admin::create_stream(&mut conn, "orders", 2).await.unwrap();
    admin::register_group(&mut conn, "orders", "billing", StartFrom::Earliest)
        .await
        .unwrap();
    let ids = dead_letters(&mut conn).await;
    let rule = admin_rule();

    let no_xdel = rule.without("+xdel").unwrap();
    no_xdel.apply(&mut sync).unwrap();
    let url = no_xdel.url(&server.addr());
    let (code, _, err) = cli(
        &url,
        &["dlq", "purge", "orders", "billing", "--id", &ids[0]],
    );
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("'xdel'"), "{err}");
    assert!(err.contains("ACL"), "says where to add it: {err}");
    assert!(!err.contains(&rule.password), "{err}");

    let no_dlq = rule.without("~orders:dlq:*").unwrap();
    no_dlq.apply(&mut sync).unwrap();
    let url = no_dlq.url(&server.addr());
    let (code, _, err) = cli(&url, &["dlq", "list", "orders", "billing"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("NOPERM") || err.contains("NoPerm"), "{err}");
    assert!(
        err.contains("~orders:dlq:*"),
        "names the key pattern: {err}"
    );
    assert!(!err.contains(&rule.password), "{err}");
}

/// A wrong password and an unreachable host: the tool fails with its exit code and never prints
/// the password.
#[tokio::test]
async fn the_password_is_never_printed() {
    let server = RedisServer::start().unwrap();
    let rule = admin_rule();
    rule.apply(&mut server.client().get_connection().unwrap())
        .unwrap();
    let wrong = format!("redis://sl-admin:s3cret-pw@{}", server.addr());
    let (code, out, err) = cli(&wrong, &["stream", "list"]);
    assert_ne!(code, 0, "{out}");
    assert!(
        !err.contains("s3cret-pw") && !out.contains("s3cret-pw"),
        "{err}"
    );
    assert!(err.contains("***"), "the URL is shown redacted: {err}");

    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let unreachable = format!("redis://sl-admin:s3cret-pw@127.0.0.1:{port}");
    let (code, out, err) = cli(&unreachable, &["stream", "list"]);
    assert_eq!(code, 3, "{err}");
    assert!(
        !err.contains("s3cret-pw") && !out.contains("s3cret-pw"),
        "{err}"
    );
    let invalid = "redis://sl-admin:s3cret-pw@127.0.0.1:notaport";
    let (code, out, err) = cli(invalid, &["stream", "list"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        !err.contains("s3cret-pw") && !out.contains("s3cret-pw"),
        "{err}"
    );
}

/// On a 3-master cluster, with the README's admin rule and cluster line on every node: create,
/// list, describe, retention, trim and delete (which reads `CLUSTER NODES` and `SCAN`s every
/// master) succeed and no node refuses anything.
#[tokio::test]
async fn admin_commands_run_as_the_readme_admin_user_on_a_cluster() {
    use stream_listener_core::testing::RedisCluster;
    let cluster = RedisCluster::start().unwrap();
    let rule = admin_rule();
    assert!(
        !rule.cluster_rules.is_empty(),
        "README has the cluster line"
    );
    for node in cluster.nodes() {
        rule.apply_for_cluster(&mut node.client().get_connection().unwrap())
            .unwrap();
    }
    let mut args: Vec<String> = Vec::new();
    for node in cluster.nodes() {
        args.push("--cluster-node".into());
        args.push(rule.url(&node.addr()));
    }
    let run = |extra: &[&str]| {
        let output = Command::new(BIN)
            .args(&args)
            .args(extra)
            .env_remove("REDIS_URL")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&output.stderr).into_owned();
        assert_eq!(output.status.code(), Some(0), "{extra:?}: {err}");
        assert!(!err.contains(&rule.password), "{err}");
    };
    run(&["stream", "create", "orders", "--shards", "4"]);
    run(&["stream", "list"]);
    run(&["stream", "describe", "orders"]);
    run(&[
        "stream",
        "retention",
        "orders",
        "--retention-max-len",
        "1000",
    ]);
    run(&["stream", "trim", "orders"]);
    run(&["stream", "delete", "orders", "--force"]);
    for node in cluster.nodes() {
        let mut conn = connect(node.url()).await;
        assert_eq!(
            acl_log(&mut conn).await,
            Vec::<String>::new(),
            "node {}",
            node.addr()
        );
    }
}
