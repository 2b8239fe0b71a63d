//! The Grafana dashboard (`dashboards/stream-listener.json`, docs/design.md §13.6) queries only
//! metrics a real listener exports: every metric name its PromQL uses is in a `/metrics` scrape
//! of a listener that handled entries with ok, retry and dead-letter outcomes and went through
//! a rebalance.

#[allow(dead_code)]
#[path = "support/http.rs"]
mod http;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use serde_json::Value;
use stream_listener::core::handler::HandlerFuture;
use stream_listener::core::internals::telemetry::names;
use stream_listener::testing::RedisServer;
use stream_listener::{
    Config, Delivery, HandlerError, ListenerRegistration, RunningApp, run_listeners,
};

const STREAM: &str = "dash_events";
const GROUP: &str = "dash_group";
const DASHBOARD: &str = include_str!("../dashboards/stream-listener.json");

/// The histogram metrics of the names table: `_bucket`, `_count` and `_sum` series.
const HISTOGRAMS: &[&str] = &[
    names::HANDLER_DURATION_SECONDS,
    names::HEARTBEAT_DURATION_SECONDS,
];

/// What the dashboard is meant to show: names of the metrics table (README `### Metrics`).
const EXPECTED: &[&str] = &[
    names::GROUP_LAG,
    names::SHARD_LAG,
    names::SHARD_PENDING,
    names::SHARD_OLDEST_PENDING_AGE_SECONDS,
    names::MESSAGES_HANDLED_TOTAL,
    names::RETRIES_TOTAL,
    names::DEAD_LETTERS_TOTAL,
    names::HANDLER_DURATION_SECONDS,
    names::REBALANCES_TOTAL,
    names::ASSIGNMENTS_TOTAL,
    names::REVOCATIONS_TOTAL,
    names::OWNED_SHARDS,
    names::MEMBER_EPOCH,
    names::HEARTBEATS_TOTAL,
    names::HEARTBEAT_DURATION_SECONDS,
];

/// Payload `ok`: handled; `retry`: fails its first attempt, then succeeds; `dead`: refused
/// (dead-lettered at once).
fn handler(delivery: Delivery) -> HandlerFuture {
    let kind = delivery
        .payload()
        .map(|p| String::from_utf8_lossy(p).into_owned());
    let attempt = delivery.metadata.attempt;
    Box::pin(async move {
        match kind.as_deref() {
            Some("\"retry\"") if attempt == 1 => {
                Err(HandlerError::retryable("first attempt fails"))
            }
            Some("\"dead\"") => Err(HandlerError::non_retryable("refused")),
            _ => Ok(()),
        }
    })
}

fn listeners() -> Vec<ListenerRegistration> {
    vec![ListenerRegistration::new("on_dash", STREAM, GROUP, handler)]
}

fn config(url: &str, listen: Option<&str>) -> Config {
    let listen = listen
        .map(|l| format!("[observability]\nlisten = \"{l}\"\nmetrics_interval = \"500ms\"\n"))
        .unwrap_or_default();
    let text = format!(
        r#"
[redis]
url = "{url}"
startup_timeout = "5s"

[coordination]
heartbeat_interval = "200ms"
member_lease_ttl = "1500ms"
rebalance_timeout = "3s"

[streams.{STREAM}]
shards = 4

[listeners.on_dash]
handler_timeout = "2s"
block = "200ms"
backoff = "10ms"

{listen}
"#
    );
    Config::from_toml_str(&text, "dashboard-test.toml").unwrap()
}

/// Every string of the dashboard that holds PromQL: panel target `expr`s and the template
/// variables' `definition`s.
fn queries(dashboard: &Value) -> Vec<String> {
    let mut found = Vec::new();
    collect(dashboard, &mut found);
    found
}

fn collect(value: &Value, found: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            for (key, value) in map {
                match (key.as_str(), value) {
                    ("expr" | "definition", Value::String(q)) => found.push(q.clone()),
                    _ => collect(value, found),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|v| collect(v, found)),
        _ => {}
    }
}

/// The metric names a PromQL expression uses: its identifiers starting `stream_listener_`
/// (label names, functions and `$variables` never do).
fn metric_names(query: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = query;
    while let Some(at) = rest.find("stream_listener_") {
        let preceded_by_ident = rest[..at]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':');
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
            .unwrap_or(tail.len());
        if !preceded_by_ident {
            names.insert(tail[..end].to_owned());
        }
        rest = &tail[end..];
    }
    names
}

/// A histogram series name (`…_bucket`, `…_count`, `…_sum`) → its metric; others unchanged.
fn base_name(series: &str) -> &str {
    for suffix in ["_bucket", "_count", "_sum"] {
        if let Some(base) = series.strip_suffix(suffix)
            && HISTOGRAMS.contains(&base)
        {
            return base;
        }
    }
    series
}

/// The series names of a Prometheus text scrape.
fn scraped(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| l.split(['{', ' ']).next().unwrap_or_default().to_owned())
        .collect()
}

#[test]
fn the_extractor_finds_names_and_only_names() {
    let names = metric_names(
        r#"histogram_quantile(0.99, sum by (le, group) (rate(stream_listener_handler_duration_seconds_bucket{stream=~"$stream"}[$__rate_interval]))) / stream_listener_x_total"#,
    );
    assert_eq!(
        names,
        BTreeSet::from([
            "stream_listener_handler_duration_seconds_bucket".to_owned(),
            "stream_listener_x_total".to_owned()
        ])
    );
    assert_eq!(
        base_name("stream_listener_handler_duration_seconds_bucket"),
        "stream_listener_handler_duration_seconds"
    );
    assert_eq!(
        base_name("stream_listener_x_count"),
        "stream_listener_x_count"
    );
}

#[test]
fn the_dashboard_uses_exactly_the_expected_metrics_of_the_table() {
    let dashboard: Value = serde_json::from_str(DASHBOARD).unwrap();
    let used: BTreeSet<String> = queries(&dashboard)
        .iter()
        .flat_map(|q| metric_names(q))
        .map(|s| base_name(&s).to_owned())
        .collect();
    let expected: BTreeSet<String> = EXPECTED.iter().map(|s| (*s).to_owned()).collect();
    assert!(!expected.is_empty());
    assert!(EXPECTED.iter().all(|name| names::ALL.contains(name)));
    assert_eq!(used, expected);
    assert!(
        dashboard["panels"].as_array().unwrap().len() >= 10,
        "the panels are there"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_dashboard_queries_is_in_a_real_scrape() {
    let dashboard: Value = serde_json::from_str(DASHBOARD).unwrap();
    let wanted: BTreeSet<String> = queries(&dashboard)
        .iter()
        .flat_map(|q| metric_names(q))
        .collect();
    assert!(wanted.len() >= EXPECTED.len(), "{wanted:?}");

    let server = RedisServer::start().unwrap();
    let app = run_listeners(config(&server.url(), Some("127.0.0.1:0")), listeners())
        .await
        .unwrap();
    let addr = app.observability_addr().unwrap();
    assert!(app.wait_for_assignment(4, Duration::from_secs(15)).await);
    publish(&server.url()).await;

    // A second process-worth of members joins: shards move (revocations, a rebalance).
    let second = run_listeners(config(&server.url(), None), listeners())
        .await
        .unwrap();

    let deadline = Instant::now() + Duration::from_secs(20);
    let (missing, text) = loop {
        let (status, text) = http::get(addr, "/metrics").await.unwrap();
        assert_eq!(status, 200, "{text}");
        let have = scraped(&text);
        let missing: Vec<&String> = wanted.iter().filter(|w| !have.contains(*w)).collect();
        if missing.is_empty() || Instant::now() > deadline {
            break (missing.into_iter().cloned().collect::<Vec<_>>(), text);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    stop(second).await;
    stop(app).await;
    assert!(
        missing.is_empty(),
        "the dashboard queries series no scrape has: {missing:?}"
    );
    // Every exported series says what it is: a `# HELP` line (Prometheus and Grafana show it).
    let exported: Vec<&str> = names::ALL
        .iter()
        .copied()
        .filter(|name| text.contains(&format!("# TYPE {name} ")))
        .collect();
    assert!(exported.len() >= EXPECTED.len(), "{exported:?}");
    let undescribed: Vec<&str> = exported
        .into_iter()
        .filter(|name| !text.contains(&format!("# HELP {name} ")))
        .collect();
    assert!(undescribed.is_empty(), "no # HELP line: {undescribed:?}");
}

async fn publish(url: &str) {
    let mut config = Config::default();
    config.redis.url = Some(url.to_owned());
    let publisher = config.publisher(STREAM).await.unwrap();
    for (i, kind) in ["ok", "retry", "dead", "ok", "retry", "dead"]
        .iter()
        .enumerate()
    {
        publisher.publish(&format!("k{i}"), kind).await.unwrap();
    }
}

async fn stop(app: RunningApp) {
    tokio::time::timeout(Duration::from_secs(15), app.shutdown_and_wait())
        .await
        .unwrap()
        .expect("clean shutdown");
}
