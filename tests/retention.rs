//! Retention on real Redis (docs/design.md §10.9): `"acked"` never trims an entry a group has not
//! acked or not received (two groups, one stopped), `"force"` trims to the bounds and counts what
//! each group lost, exactly; dry runs change nothing; the runtime trims the shards it owns and
//! the dead-letter streams; the poller survives pending ids whose entries were trimmed; bad
//! values are refused and change nothing; the same on a 3-master cluster.

mod support;

use std::time::Duration;

use redis::AsyncCommands;
use stream_listener::core::internals::admin::{self, AdminError, StoreError, TrimReport};
use stream_listener::core::internals::connection::{RedisConnection, RedisTarget};
use stream_listener::core::internals::store::{
    GroupLoss, KeyTrim, Retention, RetentionError, RetentionMode, TrimReason,
};
use stream_listener::core::model::StartFrom;
use stream_listener::testing::RedisCluster;
use support::{Context, GROUP, STREAM};

const SHARD0: &str = "{orders:0}";

async fn add(conn: &mut RedisConnection, key: &str, ids: &[&str]) {
    for id in ids {
        let _: String = conn.xadd(key, *id, &[("n", *id)]).await.unwrap();
    }
}

/// Entries `1-1` .. `<n>-1`.
fn ids(n: u32) -> Vec<String> {
    (1..=n).map(|i| format!("{i}-1")).collect()
}

async fn add_n(conn: &mut RedisConnection, key: &str, n: u32) {
    let ids = ids(n);
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    add(conn, key, &refs).await;
}

/// Reads up to `count` new entries of `key` as consumer `consumer` of `group`.
async fn read(
    conn: &mut RedisConnection,
    key: &str,
    group: &str,
    consumer: &str,
    count: usize,
) -> Vec<String> {
    let options = redis::streams::StreamReadOptions::default()
        .group(group, consumer)
        .count(count);
    let reply: redis::streams::StreamReadReply =
        conn.xread_options(&[key], &[">"], &options).await.unwrap();
    reply
        .keys
        .into_iter()
        .flat_map(|k| k.ids.into_iter().map(|e| e.id))
        .collect()
}

async fn ack(conn: &mut RedisConnection, key: &str, group: &str, ids: &[&str]) {
    let acked: u64 = conn.xack(key, group, ids).await.unwrap();
    assert_eq!(acked, ids.len() as u64);
}

async fn ids_of(conn: &mut RedisConnection, key: &str) -> Vec<String> {
    let reply: redis::streams::StreamRangeReply = conn.xrange_all(key).await.unwrap();
    reply.ids.into_iter().map(|e| e.id).collect()
}

async fn register(conn: &mut RedisConnection, group: &str) {
    admin::register_group(conn, STREAM, group, StartFrom::Earliest)
        .await
        .unwrap();
}

fn max_len(mode: RetentionMode, len: u64) -> Retention {
    let mut retention = Retention::new(mode);
    retention.max_len = Some(len);
    retention
}

async fn set(conn: &mut RedisConnection, retention: Retention) {
    admin::set_stream_retention(conn, STREAM, Some(retention))
        .await
        .unwrap();
}

/// A dry run, then the trim; asserts both report the same and the dry run changed nothing.
async fn trim_twice(conn: &mut RedisConnection, key: &str) -> TrimReport {
    let before = ids_of(conn, key).await;
    let dry = admin::trim_stream(conn, STREAM, true).await.unwrap();
    assert!(dry.dry_run);
    assert_eq!(ids_of(conn, key).await, before, "a dry run changed nothing");
    let real = admin::trim_stream(conn, STREAM, false).await.unwrap();
    assert!(!real.dry_run);
    assert_eq!(
        without_age_points(&dry),
        without_age_points(&real),
        "the dry run predicted the trim"
    );
    real
}

/// The shard and dead-letter trims, without the trim points set by the age bound (Redis `TIME`
/// moves between two calls).
fn without_age_points(report: &TrimReport) -> Vec<KeyTrim> {
    let shards = report.shards.iter().map(|s| &s.trim);
    let dead = report.dead_letters.iter().map(|d| &d.trim);
    shards
        .chain(dead)
        .map(|trim| {
            let mut trim = trim.clone();
            if trim.reason == TrimReason::MaxAge {
                trim.trim_point = None;
            }
            trim
        })
        .collect()
}

#[tokio::test]
async fn acked_never_trims_what_a_group_has_not_acked_or_received() {
    let (_serial, _server, _target, mut conn, _) = Context::start(1).await.parts();
    register(&mut conn, "fast").await;
    register(&mut conn, "stopped").await;
    add_n(&mut conn, SHARD0, 10).await;
    set(&mut conn, max_len(RetentionMode::Acked, 2)).await;

    // fast has read everything and acked 1..5; stopped has read nothing.
    assert_eq!(read(&mut conn, SHARD0, "fast", "c1", 10).await, ids(10));
    ack(
        &mut conn,
        SHARD0,
        "fast",
        &["1-1", "2-1", "3-1", "4-1", "5-1"],
    )
    .await;
    let report = trim_twice(&mut conn, SHARD0).await;
    let shard = &report.shards[0].trim;
    assert_eq!((shard.deleted, shard.reason), (0, TrimReason::Group));
    assert_eq!(shard.holder.as_deref(), Some("stopped"));
    assert_eq!(shard.holder_id.as_deref(), Some("1-1"));
    assert_eq!(ids_of(&mut conn, SHARD0).await, ids(10));

    // stopped reads 1..3 and acks 1, 2: its oldest pending (3-1) holds the trim point.
    read(&mut conn, SHARD0, "stopped", "c1", 3).await;
    ack(&mut conn, SHARD0, "stopped", &["1-1", "2-1"]).await;
    let report = trim_twice(&mut conn, SHARD0).await;
    let shard = &report.shards[0].trim;
    assert_eq!((shard.deleted, shard.reason), (2, TrimReason::Group));
    assert_eq!(shard.holder_id.as_deref(), Some("3-1"));
    assert_eq!(shard.trim_point.as_deref(), Some("3-1"));
    assert_eq!(shard.length_after, 8);
    assert!(shard.lost.is_empty());
    assert_eq!(ids_of(&mut conn, SHARD0).await, ids(10)[2..]);

    // stopped acks 3-1 and reads the rest: its oldest pending id (4-1) holds the point now.
    ack(&mut conn, SHARD0, "stopped", &["3-1"]).await;
    read(&mut conn, SHARD0, "stopped", "c1", 10).await;
    let report = trim_twice(&mut conn, SHARD0).await;
    let shard = &report.shards[0].trim;
    assert_eq!((shard.deleted, shard.reason), (1, TrimReason::Group));
    assert_eq!(shard.holder.as_deref(), Some("stopped"));
    assert_eq!(shard.holder_id.as_deref(), Some("4-1"));

    // Both ack everything: the length bound alone decides.
    let rest: Vec<String> = ids(10)[3..].to_vec();
    let rest: Vec<&str> = rest.iter().map(String::as_str).collect();
    ack(&mut conn, SHARD0, "stopped", &rest).await;
    ack(&mut conn, SHARD0, "fast", &rest[2..]).await;
    let report = trim_twice(&mut conn, SHARD0).await;
    let shard = &report.shards[0].trim;
    assert_eq!((shard.deleted, shard.reason), (5, TrimReason::MaxLen));
    assert_eq!(shard.trim_point.as_deref(), Some("9-1"));
    assert_eq!(shard.holder, None);
    assert_eq!(ids_of(&mut conn, SHARD0).await, ["9-1", "10-1"]);
}

#[tokio::test]
async fn acked_keeps_everything_on_a_shard_without_groups_and_trims_by_age() {
    let (_serial, _server, _target, mut conn, _) = Context::start(1).await.parts();
    // Old entries (ms 1..3 since the epoch) and three new ones.
    add(&mut conn, SHARD0, &["1-1", "2-1", "3-1", "*", "*", "*"]).await;
    let mut retention = Retention::new(RetentionMode::Acked);
    retention.max_age_ms = Some(3_600_000);
    set(&mut conn, retention).await;
    let report = trim_twice(&mut conn, SHARD0).await;
    let shard = &report.shards[0].trim;
    assert_eq!((shard.deleted, shard.reason), (0, TrimReason::NoGroups));
    assert_eq!(ids_of(&mut conn, SHARD0).await.len(), 6);

    register(&mut conn, GROUP).await;
    let all = read(&mut conn, SHARD0, GROUP, "c1", 10).await;
    ack(
        &mut conn,
        SHARD0,
        GROUP,
        &all.iter().map(String::as_str).collect::<Vec<_>>(),
    )
    .await;
    let report = trim_twice(&mut conn, SHARD0).await;
    let shard = &report.shards[0].trim;
    assert_eq!((shard.deleted, shard.reason), (3, TrimReason::MaxAge));
    assert_eq!(ids_of(&mut conn, SHARD0).await, all[3..]);
    let point = shard.trim_point.as_deref().unwrap();
    assert!(point.ends_with("-0") && point.len() > 10, "{point}");
    // Nothing older is left: the next trim has nothing to do.
    let report = trim_twice(&mut conn, SHARD0).await;
    let shard = &report.shards[0].trim;
    assert_eq!((shard.deleted, shard.reason), (0, TrimReason::WithinBounds));
}

#[tokio::test]
async fn force_trims_to_the_bound_and_counts_each_groups_loss_exactly() {
    let (_serial, _server, _target, mut conn, _) = Context::start(1).await.parts();
    for group in ["done", "idle", "slow"] {
        register(&mut conn, group).await;
    }
    add_n(&mut conn, SHARD0, 10).await;
    // done: everything acked. slow: read 1..4, acked 1, 2 (3, 4 pending; 5..10 undelivered).
    // idle: nothing read.
    let all = read(&mut conn, SHARD0, "done", "c1", 10).await;
    ack(
        &mut conn,
        SHARD0,
        "done",
        &all.iter().map(String::as_str).collect::<Vec<_>>(),
    )
    .await;
    read(&mut conn, SHARD0, "slow", "c1", 4).await;
    ack(&mut conn, SHARD0, "slow", &["1-1", "2-1"]).await;
    set(&mut conn, max_len(RetentionMode::Force, 3)).await;

    let report = trim_twice(&mut conn, SHARD0).await;
    let shard = &report.shards[0].trim;
    assert_eq!((shard.deleted, shard.reason), (7, TrimReason::MaxLen));
    assert_eq!(shard.trim_point.as_deref(), Some("8-1"));
    assert_eq!(shard.holder.as_deref(), Some("idle"));
    let lost = |group: &str, entries| GroupLoss::new(group, entries);
    assert_eq!(shard.lost, [lost("idle", 7), lost("slow", 5)]);
    assert_eq!(ids_of(&mut conn, SHARD0).await, ["8-1", "9-1", "10-1"]);

    // slow's pending ids of trimmed entries are not counted again.
    let report = trim_twice(&mut conn, SHARD0).await;
    let shard = &report.shards[0].trim;
    assert_eq!((shard.deleted, shard.reason), (0, TrimReason::WithinBounds));
    assert!(shard.lost.is_empty());
}

#[tokio::test]
async fn retention_is_set_printed_and_cleared_without_a_metadata_version_bump() {
    let (_serial, _server, _target, mut conn, _) = Context::start(2).await.parts();
    let before = admin::describe_stream(&mut conn, STREAM).await.unwrap();
    let shown = admin::stream_retention(&mut conn, STREAM).await.unwrap();
    assert_eq!(shown.retention, None);

    let mut retention = max_len(RetentionMode::Force, 1000);
    retention.dlq_max_age_ms = Some(86_400_000);
    let changed = admin::set_stream_retention(&mut conn, STREAM, Some(retention))
        .await
        .unwrap();
    assert_eq!(
        (changed.previous, changed.retention),
        (None, Some(retention))
    );
    let stored: String = conn.hget("sl:{orders}:stream", "retention").await.unwrap();
    assert_eq!(
        stored,
        r#"{"mode":"force","maxAgeMs":null,"maxLen":1000,"dlqMaxAgeMs":86400000,"dlqMaxLen":null}"#
    );
    let after = admin::describe_stream(&mut conn, STREAM).await.unwrap();
    assert_eq!(after.metadata_version, before.metadata_version);
    assert_eq!(after.revision, before.revision);
    assert_eq!(after.retention, Some(retention));

    let cleared = admin::set_stream_retention(&mut conn, STREAM, None)
        .await
        .unwrap();
    assert_eq!(
        (cleared.previous, cleared.retention),
        (Some(retention), None)
    );
    let exists: bool = conn
        .hexists("sl:{orders}:stream", "retention")
        .await
        .unwrap();
    assert!(!exists);
    let error = admin::trim_stream(&mut conn, STREAM, true)
        .await
        .unwrap_err();
    assert!(
        matches!(&error, AdminError::NoRetention { prefix } if prefix == STREAM),
        "{error:?}"
    );
}

#[tokio::test]
async fn bad_retention_values_are_refused_by_name_and_change_nothing() {
    let (_serial, _server, _target, mut conn, _) = Context::start(1).await.parts();
    let good = max_len(RetentionMode::Acked, 10);
    set(&mut conn, good).await;
    let mut cases = Vec::new();
    let mut zero_len = good;
    zero_len.max_len = Some(0);
    cases.push((zero_len, "maxLen", "0"));
    let mut huge_len = good;
    huge_len.max_len = Some((1 << 53) + 1);
    cases.push((huge_len, "maxLen", "9007199254740993"));
    let mut zero_age = good;
    zero_age.max_age_ms = Some(0);
    cases.push((zero_age, "maxAgeMs", "0"));
    let mut old_age = good;
    old_age.dlq_max_age_ms = Some(101 * 365 * 86_400_000);
    cases.push((old_age, "dlqMaxAgeMs", "3185136000000 ms"));
    let mut zero_dlq = good;
    zero_dlq.dlq_max_len = Some(0);
    cases.push((zero_dlq, "dlqMaxLen", "0"));
    for (retention, key, value) in cases {
        let error = admin::set_stream_retention(&mut conn, STREAM, Some(retention))
            .await
            .unwrap_err();
        match &error {
            AdminError::InvalidRetention(RetentionError::InvalidValue {
                key: k, value: v, ..
            }) => assert_eq!((k.as_str(), v.as_str()), (key, value)),
            other => panic!("{key}: {other:?}"),
        }
        assert!(error.to_string().contains(key), "{error}");
        let shown = admin::stream_retention(&mut conn, STREAM).await.unwrap();
        assert_eq!(shown.retention, Some(good), "nothing changed");
    }
    let error = admin::set_stream_retention(&mut conn, "nosuch", Some(good))
        .await
        .unwrap_err();
    assert!(
        matches!(error, AdminError::Store(StoreError::MissingStream { .. })),
        "{error:?}"
    );
    let exists: bool = conn.exists("sl:{nosuch}:stream").await.unwrap();
    assert!(!exists);
}

#[tokio::test]
async fn dead_letter_streams_are_trimmed_by_their_own_bounds() {
    let (_serial, _server, _target, mut conn, _) = Context::start(1).await.parts();
    register(&mut conn, GROUP).await;
    add_n(&mut conn, SHARD0, 5).await;
    let dlq = format!("{STREAM}:dlq:{GROUP}");
    add_n(&mut conn, &dlq, 6).await;
    let mut retention = Retention::new(RetentionMode::Acked);
    retention.dlq_max_len = Some(2);
    set(&mut conn, retention).await;
    let report = trim_twice(&mut conn, &dlq).await;
    assert!(report.shards.is_empty(), "no shard bound");
    assert_eq!(report.dead_letters.len(), 1);
    let dead = &report.dead_letters[0];
    assert_eq!(dead.consumer_group, GROUP);
    assert_eq!(
        (dead.trim.deleted, dead.trim.reason),
        (4, TrimReason::MaxLen)
    );
    assert_eq!(ids_of(&mut conn, &dlq).await, ["5-1", "6-1"]);
    assert_eq!(ids_of(&mut conn, SHARD0).await.len(), 5, "shards untouched");
}

#[tokio::test]
async fn trimming_works_on_a_cluster() {
    let cluster = RedisCluster::start().unwrap();
    let mut conn = support::connect(&RedisTarget::cluster(cluster.urls())).await;
    admin::create_stream(&mut conn, STREAM, 3).await.unwrap();
    register(&mut conn, GROUP).await;
    register(&mut conn, "stopped").await;
    for shard in 0..3 {
        let key = format!("{{orders:{shard}}}");
        add_n(&mut conn, &key, 6).await;
        let all = read(&mut conn, &key, GROUP, "c1", 10).await;
        ack(
            &mut conn,
            &key,
            GROUP,
            &all.iter().map(String::as_str).collect::<Vec<_>>(),
        )
        .await;
        // stopped has read and acked up to 4-1 on every shard.
        read(&mut conn, &key, "stopped", "c1", 4).await;
        ack(&mut conn, &key, "stopped", &["1-1", "2-1", "3-1", "4-1"]).await;
    }
    let dlq = format!("{STREAM}:dlq:{GROUP}");
    add_n(&mut conn, &dlq, 3).await;
    let mut retention = max_len(RetentionMode::Acked, 1);
    retention.dlq_max_len = Some(1);
    set(&mut conn, retention).await;
    let dry = admin::trim_stream(&mut conn, STREAM, true).await.unwrap();
    let real = admin::trim_stream(&mut conn, STREAM, false).await.unwrap();
    assert_eq!(dry.shards, real.shards);
    for shard in &real.shards {
        assert_eq!(
            (shard.trim.deleted, shard.trim.reason),
            (4, TrimReason::Group)
        );
        assert_eq!(shard.trim.holder.as_deref(), Some("stopped"));
        let key = format!("{{orders:{}}}", shard.shard_index);
        assert_eq!(ids_of(&mut conn, &key).await, ["5-1", "6-1"]);
    }
    assert_eq!(real.shards.len(), 3);
    assert_eq!(real.dead_letters[0].trim.deleted, 2);
    assert_eq!(ids_of(&mut conn, &dlq).await, ["3-1"]);
}

/// Polls `check` every 50 ms until it returns true or `deadline` passes; returns its last value.
async fn poll_for<F, Fut>(deadline: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let end = std::time::Instant::now() + deadline;
    loop {
        if check().await {
            return true;
        }
        if std::time::Instant::now() >= end {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn len_of(target: &RedisTarget, key: &str) -> u64 {
    let mut conn = support::connect(target).await;
    conn.xlen(key).await.unwrap()
}

async fn pending_of(target: &RedisTarget, key: &str) -> u64 {
    let mut conn = support::connect(target).await;
    let reply: redis::streams::StreamPendingReply = conn.xpending(key, GROUP).await.unwrap();
    reply.count() as u64
}

fn fast_trims() -> stream_listener::core::member::ListenerOptions {
    let mut options = support::options(1);
    options.retention_interval = Duration::from_millis(200);
    options
}

#[tokio::test]
async fn the_runtime_trims_the_shards_it_owns_and_its_dead_letters() {
    let (_serial, server, target, mut conn, recorder) = Context::serial(2).await.parts();
    support::preload(&server.client(), &[0, 1], 20, 0);
    let dlq = format!("{STREAM}:dlq:{GROUP}");
    add_n(&mut conn, &dlq, 6).await;
    let mut retention = max_len(RetentionMode::Acked, 5);
    retention.dlq_max_len = Some(2);
    set(&mut conn, retention).await;

    let handle = support::start_recording(&target, &recorder, fast_trims(), Duration::ZERO).await;
    let trimmed = poll_for(Duration::from_secs(20), || async {
        len_of(&target, "{orders:0}").await == 5
            && len_of(&target, "{orders:1}").await == 5
            && len_of(&target, &dlq).await == 2
    })
    .await;
    assert!(
        trimmed,
        "lengths {} {} {}",
        len_of(&target, "{orders:0}").await,
        len_of(&target, "{orders:1}").await,
        len_of(&target, &dlq).await
    );
    // Acked mode: every entry was handled before it went.
    assert_eq!(recorder.handled().len(), 40);
    assert_eq!(ids_of(&mut conn, &dlq).await, ["5-1", "6-1"]);
    handle.shutdown_and_wait().await.expect("clean shutdown");
}

#[tokio::test]
async fn the_poller_survives_pending_entries_trimmed_by_force() {
    let (_serial, server, target, mut conn, recorder) = Context::serial(1).await.parts();
    register(&mut conn, GROUP).await;
    let published = support::preload(&server.client(), &[0], 10, 0);
    // A consumer that is gone holds all ten; a force trim removes seven of them.
    assert_eq!(read(&mut conn, SHARD0, GROUP, "ghost", 10).await.len(), 10);
    set(&mut conn, max_len(RetentionMode::Force, 3)).await;
    let report = admin::trim_stream(&mut conn, STREAM, false).await.unwrap();
    assert_eq!(report.shards[0].trim.deleted, 7);
    assert_eq!(report.shards[0].trim.lost, [GroupLoss::new(GROUP, 7)]);

    let handle = support::start_recording(&target, &recorder, fast_trims(), Duration::ZERO).await;
    let later = support::preload(&server.client(), &[0], 2, 10);
    let expected: std::collections::BTreeSet<(u32, String)> = published[7..]
        .iter()
        .chain(&later)
        .map(|p| (0, p.id.clone()))
        .collect();
    let done = poll_for(Duration::from_secs(20), || async {
        recorder.handled() == expected && pending_of(&target, SHARD0).await == 0
    })
    .await;
    assert!(
        done,
        "handled {:?}, pending {}",
        recorder.handled(),
        pending_of(&target, SHARD0).await
    );
    handle.shutdown_and_wait().await.expect("clean shutdown");
}

#[tokio::test]
async fn a_force_trim_by_the_runtime_reports_each_groups_loss() {
    let (_serial, server, target, mut conn, recorder) = Context::serial(1).await.parts();
    register(&mut conn, "laggard").await;
    support::preload(&server.client(), &[0], 20, 0);
    let lost = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut options = fast_trims();
    let sink = lost.clone();
    options.events = Some(stream_listener::core::member::EventCallback(
        std::sync::Arc::new(move |event| {
            if let stream_listener::core::member::ListenerEvent::EntriesLost {
                group,
                entries,
                ..
            } = event
            {
                sink.lock().unwrap().push((group, entries));
            }
        }),
    ));
    let handler = support::recording_handler(recorder.clone(), Duration::ZERO, None);
    let handle = support::start_listener(&target, handler, options).await;
    let handled = poll_for(Duration::from_secs(20), || async {
        recorder.handled().len() == 20 && pending_of(&target, SHARD0).await == 0
    })
    .await;
    assert!(handled);

    set(&mut conn, max_len(RetentionMode::Force, 5)).await;
    let reported = poll_for(Duration::from_secs(20), || async {
        lost.lock().unwrap().iter().map(|(_, n)| n).sum::<u64>() == 15
    })
    .await;
    assert!(reported, "{:?}", lost.lock().unwrap());
    assert!(lost.lock().unwrap().iter().all(|(g, _)| g == "laggard"));
    assert_eq!(len_of(&target, SHARD0).await, 5);
    handle.shutdown_and_wait().await.expect("clean shutdown");
}

fn ignore(_: stream_listener::Delivery) -> stream_listener::core::handler::HandlerFuture {
    Box::pin(async { Ok(()) })
}

fn config_with(url: &str, stream_keys: &str) -> Result<stream_listener::Config, String> {
    let text = format!(
        "[redis]\nurl = \"{url}\"\nstartup_timeout = \"5s\"\n\n[coordination]\nheartbeat_interval = \"200ms\"\nmember_lease_ttl = \"1500ms\"\nrebalance_timeout = \"3s\"\n\n[streams.orders]\nshards = 2\n{stream_keys}\n[listeners.on_order]\nretention_interval = \"500ms\"\nhandler_timeout = \"2s\"\n"
    );
    let config = stream_listener::Config::from_toml_str(&text, "retention.toml")
        .map_err(|e| e.to_string())?;
    config.validate().map_err(|e| e.to_string())?;
    Ok(config)
}

#[tokio::test]
async fn startup_writes_the_configured_retention_when_it_differs() {
    let server = stream_listener::testing::RedisServer::start().unwrap();
    let url = server.url();
    let config = config_with(
        &url,
        "retention = \"force\"\nretention_max_age = \"7d\"\nretention_max_len = 1000\ndlq_retention_max_len = 50\n",
    )
    .unwrap();
    let start = |config: stream_listener::Config| async move {
        let listeners = vec![stream_listener::ListenerRegistration::new(
            "on_order", STREAM, GROUP, ignore,
        )];
        stream_listener::run_listeners(config, listeners)
            .await
            .unwrap()
    };
    let app = start(config).await;
    let mut conn = support::connect(&RedisTarget::standalone(url.clone())).await;
    let shown = admin::stream_retention(&mut conn, STREAM).await.unwrap();
    let mut expected = max_len(RetentionMode::Force, 1000);
    expected.max_age_ms = Some(7 * 86_400_000);
    expected.dlq_max_len = Some(50);
    assert_eq!(shown.retention, Some(expected));
    let version = admin::describe_stream(&mut conn, STREAM)
        .await
        .unwrap()
        .metadata_version;
    app.shutdown_and_wait().await.expect("clean shutdown");

    // Changed by hand; the next start puts the configured value back, without a version bump.
    admin::set_stream_retention(&mut conn, STREAM, None)
        .await
        .unwrap();
    let config = config_with(&url, "retention_max_len = 10\n").unwrap();
    let app = start(config).await;
    let shown = admin::stream_retention(&mut conn, STREAM).await.unwrap();
    assert_eq!(shown.retention, Some(max_len(RetentionMode::Acked, 10)));
    let after = admin::describe_stream(&mut conn, STREAM).await.unwrap();
    assert_eq!(after.metadata_version, version);
    app.shutdown_and_wait().await.expect("clean shutdown");
}

#[test]
fn bad_retention_config_values_name_the_key() {
    let url = "redis://127.0.0.1:1";
    let cases = [
        (
            "retention_max_len = 0\n",
            "streams.orders.retention_max_len",
            "at least 1",
        ),
        (
            "retention_max_len = 9007199254740993\n",
            "streams.orders.retention_max_len",
            "above 2^53",
        ),
        (
            "retention_max_age = \"0s\"\n",
            "streams.orders.retention_max_age",
            "above 0",
        ),
        (
            "retention_max_age = \"100ms\"\n",
            "streams.orders.retention_max_age",
            "below one heartbeat_interval (200ms)",
        ),
        (
            "dlq_retention_max_age = \"101years\"\n",
            "streams.orders.dlq_retention_max_age",
            "above 100 years",
        ),
        (
            "dlq_retention_max_len = 0\n",
            "streams.orders.dlq_retention_max_len",
            "at least 1",
        ),
        (
            "retention = \"sometimes\"\n",
            "streams.orders.retention",
            "unknown variant",
        ),
        (
            "retention_max_len = -5\n",
            "streams.orders.retention_max_len",
            "invalid value",
        ),
    ];
    for (line, key, message) in cases {
        let error = config_with(url, line).unwrap_err();
        assert!(
            error.contains(&format!("`{key}`")) && error.contains(message),
            "{line}: {error}"
        );
    }
    let error = config_with(url, "").map(|_| ()).and_then(|()| {
        let text = "[listeners.on_order]\nretention_interval = \"0s\"\n";
        let config = stream_listener::Config::from_toml_str(text, "retention.toml")
            .map_err(|e| e.to_string())?;
        config.validate().map_err(|e| e.to_string())
    });
    let error = error.unwrap_err();
    assert!(
        error.contains("listeners.on_order.retention_interval") && error.contains("positive"),
        "{error}"
    );
}

/// Age and length bounds together, a group's pending entry at the tail: the trim's fast path
/// (few entries at or after the group's point) removes what the dry run's full computation
/// predicts.
#[tokio::test]
async fn age_and_length_bounds_together_remove_the_larger_prefix() {
    let (_serial, _server, _target, mut conn, _) = Context::start(1).await.parts();
    register(&mut conn, GROUP).await;
    add(
        &mut conn,
        SHARD0,
        &["1-1", "2-1", "3-1", "4-1", "*", "*", "*", "*"],
    )
    .await;
    let all = read(&mut conn, SHARD0, GROUP, "c1", 10).await;
    let acked: Vec<&str> = all[..7].iter().map(String::as_str).collect();
    ack(&mut conn, SHARD0, GROUP, &acked).await;
    let mut retention = max_len(RetentionMode::Acked, 3);
    retention.max_age_ms = Some(3_600_000);
    set(&mut conn, retention).await;
    let report = trim_twice(&mut conn, SHARD0).await;
    let shard = &report.shards[0].trim;
    assert_eq!((shard.deleted, shard.reason), (5, TrimReason::MaxLen));
    assert_eq!(shard.trim_point.as_deref(), Some(all[5].as_str()));
    assert_eq!(shard.holder_id.as_deref(), Some(all[7].as_str()));
    assert_eq!(ids_of(&mut conn, SHARD0).await, all[5..]);

    // A longer length bound: the age bound alone decides.
    add(&mut conn, SHARD0, &["*"]).await;
    let mut retention = max_len(RetentionMode::Acked, 3);
    retention.max_age_ms = Some(3_600_000);
    retention.max_len = Some(100);
    set(&mut conn, retention).await;
    let report = trim_twice(&mut conn, SHARD0).await;
    assert_eq!(report.shards[0].trim.reason, TrimReason::WithinBounds);
    assert_eq!(ids_of(&mut conn, SHARD0).await.len(), 4);
}

/// The fast path's count of the entries at or after the holding group's point (its lag and its
/// in-flight entries) against the full computation of the dry run: 300 entries, keep 200.
#[tokio::test]
async fn the_length_bound_counts_the_entries_a_group_still_needs_exactly() {
    let (_serial, _server, _target, mut conn, _) = Context::start(1).await.parts();
    register(&mut conn, GROUP).await;
    add_n(&mut conn, SHARD0, 300).await;
    set(&mut conn, max_len(RetentionMode::Acked, 200)).await;
    // Read 50: 250 entries at or after the first undelivered one, more than the 200 kept.
    let first = read(&mut conn, SHARD0, GROUP, "c1", 50).await;
    ack(
        &mut conn,
        SHARD0,
        GROUP,
        &first.iter().map(String::as_str).collect::<Vec<_>>(),
    )
    .await;
    let report = trim_twice(&mut conn, SHARD0).await;
    let shard = &report.shards[0].trim;
    assert_eq!((shard.deleted, shard.reason), (50, TrimReason::Group));
    assert_eq!(shard.trim_point.as_deref(), Some("51-1"));
    // Read 100 more, ack all but the last 10: 160 entries at or after the oldest pending one.
    let next = read(&mut conn, SHARD0, GROUP, "c1", 100).await;
    ack(
        &mut conn,
        SHARD0,
        GROUP,
        &next[..90].iter().map(String::as_str).collect::<Vec<_>>(),
    )
    .await;
    let report = trim_twice(&mut conn, SHARD0).await;
    let shard = &report.shards[0].trim;
    assert_eq!((shard.deleted, shard.reason), (50, TrimReason::MaxLen));
    assert_eq!(shard.trim_point.as_deref(), Some("101-1"));
    assert_eq!(shard.holder_id.as_deref(), Some("141-1"));
    assert_eq!(ids_of(&mut conn, SHARD0).await, ids(300)[100..]);
}

/// Review: a group moved back (`XGROUP SETID`) behind its pending entries has ids that are both
/// pending and undelivered; a force trim counted each of them twice (7 lost of 5 entries).
#[tokio::test]
async fn force_counts_an_entry_both_pending_and_undelivered_once() {
    let (_serial, _server, _target, mut conn, _) = Context::start(1).await.parts();
    register(&mut conn, "back").await;
    add_n(&mut conn, SHARD0, 8).await;
    // back: read 1..4 (pending), then set back to 2-1: 3, 4 are pending and undelivered.
    read(&mut conn, SHARD0, "back", "c1", 4).await;
    let _: () = redis::cmd("XGROUP")
        .arg("SETID")
        .arg(SHARD0)
        .arg("back")
        .arg("2-1")
        .query_async(&mut conn)
        .await
        .unwrap();
    set(&mut conn, max_len(RetentionMode::Force, 3)).await;

    let report = trim_twice(&mut conn, SHARD0).await;
    let shard = &report.shards[0].trim;
    assert_eq!((shard.deleted, shard.reason), (5, TrimReason::MaxLen));
    // Lost: 1-1, 2-1 (pending, delivered), 3-1, 4-1 (pending, undelivered), 5-1 (undelivered).
    assert_eq!(shard.lost, [GroupLoss::new("back", 5)]);
    assert_eq!(ids_of(&mut conn, SHARD0).await, ["6-1", "7-1", "8-1"]);
}

/// Review: a group whose last-delivered-id is the largest entry id (nothing can follow it) made
/// every trim of its shard fail with 'invalid start ID' (`XRANGE (<largest id> +`), so the shard
/// was never trimmed again.
#[tokio::test]
async fn a_group_at_the_largest_entry_id_does_not_stop_trimming() {
    let (_serial, _server, _target, mut conn, _) = Context::start(1).await.parts();
    register(&mut conn, "done").await;
    add_n(&mut conn, SHARD0, 5).await;
    let _: () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(SHARD0)
        .arg("end")
        .arg("18446744073709551615-18446744073709551615")
        .query_async(&mut conn)
        .await
        .unwrap();
    set(&mut conn, max_len(RetentionMode::Acked, 2)).await;

    // done has nothing delivered: it holds everything back; end needs nothing.
    let report = trim_twice(&mut conn, SHARD0).await;
    let shard = &report.shards[0].trim;
    assert_eq!((shard.deleted, shard.holder.as_deref()), (0, Some("done")));
    let all = read(&mut conn, SHARD0, "done", "c1", 10).await;
    ack(
        &mut conn,
        SHARD0,
        "done",
        &all.iter().map(String::as_str).collect::<Vec<_>>(),
    )
    .await;
    let report = trim_twice(&mut conn, SHARD0).await;
    let shard = &report.shards[0].trim;
    assert_eq!((shard.deleted, shard.reason), (3, TrimReason::MaxLen));
    assert_eq!(ids_of(&mut conn, SHARD0).await, ["4-1", "5-1"]);
}

/// Review: a stored retention that parses but is out of range (written by hand, or by another
/// version: `maxLen` 0) was used as is, so a force trim removed every entry of the shard. It is
/// now corrupt metadata: refused by name, nothing trimmed.
#[tokio::test]
async fn a_stored_retention_out_of_range_is_corrupt_and_trims_nothing() {
    let (_serial, _server, _target, mut conn, _) = Context::start(1).await.parts();
    register(&mut conn, "idle").await;
    add_n(&mut conn, SHARD0, 4).await;
    for json in [
        r#"{"mode":"force","maxLen":0}"#,
        r#"{"mode":"force","maxAgeMs":0}"#,
        r#"{"mode":"force","maxLen":18446744073709551615}"#,
    ] {
        let _: () = conn
            .hset("sl:{orders}:stream", "retention", json)
            .await
            .unwrap();
        for dry_run in [true, false] {
            let error = admin::trim_stream(&mut conn, STREAM, dry_run)
                .await
                .unwrap_err();
            assert!(
                matches!(
                    &error,
                    AdminError::Store(StoreError::CorruptMetadata { field, .. }) if field == "retention"
                ),
                "{json}: {error:?}"
            );
            // The advice is the command that fixes it, not deleting the metadata key.
            assert!(
                error.to_string().ends_with(
                    "set it again with `stream-listener stream retention <prefix> ...`, or remove it with `stream-listener stream retention <prefix> --clear` (do not delete the key: it holds the stream's metadata)"
                ),
                "{error}"
            );
        }
        assert_eq!(ids_of(&mut conn, SHARD0).await.len(), 4, "{json}");
    }
}

/// Review: a corrupt stored retention could not be replaced or cleared: `stream retention`
/// loaded it first and failed, although every error about it (and the startup's) says to fix
/// it with `stream retention --clear`.
#[tokio::test]
async fn a_corrupt_stored_retention_is_replaced_or_cleared() {
    let (_serial, _server, _target, mut conn, _) = Context::start(1).await.parts();
    for json in ["notjson", r#"{"mode":"force","maxLen":0}"#] {
        let _: () = conn
            .hset("sl:{orders}:stream", "retention", json)
            .await
            .unwrap();
        let cleared = admin::set_stream_retention(&mut conn, STREAM, None)
            .await
            .unwrap();
        assert_eq!(
            (cleared.previous, cleared.retention),
            (None, None),
            "{json}"
        );
        let stored: Option<String> = conn.hget("sl:{orders}:stream", "retention").await.unwrap();
        assert_eq!(stored, None, "{json}");

        let _: () = conn
            .hset("sl:{orders}:stream", "retention", json)
            .await
            .unwrap();
        let good = max_len(RetentionMode::Acked, 10);
        let set = admin::set_stream_retention(&mut conn, STREAM, Some(good))
            .await
            .unwrap();
        assert_eq!(set.retention, Some(good));
        let shown = admin::stream_retention(&mut conn, STREAM).await.unwrap();
        assert_eq!(shown.retention, Some(good), "{json}");
    }
}
