//! Every config error names the file, the line and the key.

use std::collections::HashMap;
use std::time::Duration;

use super::*;
use crate::connection::RedisTarget;
use crate::coordinator::CoordinatorConfig;
use crate::dataplane::FencingMode;
use crate::member::ListenerOptions;
use crate::model::StartFrom;

fn parse(text: &str) -> Result<Config, ConfigError> {
    Config::from_toml_str(text, "app.toml")
}

/// The error, its key, its line, and its message.
/// `text` is refused at `key` on `line`, with a message containing `expected`.
fn assert_invalid_at(text: &str, key: &str, line: usize, expected: &str) {
    let (got_key, got_line, message) = invalid(text);
    assert_eq!((got_key.as_str(), got_line), (key, line));
    assert!(message.contains(expected), "{message}");
}

fn invalid(text: &str) -> (String, usize, String) {
    match parse(text).unwrap_err() {
        ConfigError::Invalid {
            key,
            message,
            location,
        } => {
            let location = location.expect("errors of a file have a location");
            assert_eq!(location.file, "app.toml");
            (key, location.line, message)
        }
        other => panic!("expected Invalid, got {other:?}"),
    }
}

#[test]
fn an_empty_file_gives_the_defaults() {
    let config = parse("").unwrap();
    assert_eq!(
        config.redis.target(),
        RedisTarget::standalone(DEFAULT_REDIS_URL)
    );
    assert_eq!(config.redis.startup_timeout, Duration::from_secs(30));
    assert_eq!(
        config.coordinator_config().unwrap(),
        CoordinatorConfig::default()
    );
    assert!(config.streams.is_empty() && config.listeners.is_empty());
    Config::default().validate().unwrap();
}

#[test]
fn the_design_sketch_parses() {
    let config = parse(
        r#"
[redis]
url = "redis://user:secret@127.0.0.1:6379"
startup_timeout = "30s"

[coordination]
heartbeat_interval = "3s"
member_lease_ttl = "15s"
lease_margin = "3s"
rebalance_timeout = "60s"

[member]
instance_id = "orders-pod-1"

[streams.orders]
shards = 8
max_payload_bytes = 1048576

[listeners.on_order]
concurrency = 4
runtime_max_concurrency = 1
batch_size = 32
block = "2s"
max_attempts = 3
backoff = "200ms"
max_deliveries = 10
handler_timeout = "30s"
shutdown_timeout = "30s"
start_from = "latest"
fencing = "acks"
"#,
    )
    .unwrap();
    assert_eq!(config.streams["orders"].shards, Some(8));
    let options = config
        .listener_options("on_order", ListenerOptions::default())
        .unwrap();
    assert_eq!(options.concurrency, 4);
    assert_eq!(options.backoff, Duration::from_millis(200));
    assert_eq!(options.start_from, StartFrom::Latest);
    assert_eq!(options.fencing, FencingMode::Acks);
    assert_eq!(options.instance_id.as_deref(), Some("orders-pod-1"));
    assert_eq!(options.lease_margin, Some(Duration::from_secs(3)));
    assert_eq!(
        config.publisher_options("orders").max_payload_bytes,
        1048576
    );
    let debug = format!("{config:?}");
    assert!(!debug.contains("secret"), "password in Debug: {debug}");
}

#[test]
fn a_misspelt_key_is_an_error_naming_key_and_line() {
    let (key, line, message) = invalid("[streams.orders]\nshard_cuont = 8\n");
    assert_eq!(key, "streams.orders.shard_cuont");
    assert_eq!(line, 2);
    assert!(message.contains("unknown field `shard_cuont`"), "{message}");
    assert!(
        message.contains("`shards`"),
        "lists the valid keys: {message}"
    );
    let text = parse("[streams.orders]\nshard_cuont = 8\n")
        .unwrap_err()
        .to_string();
    assert!(
        text.starts_with("invalid config at app.toml:2:1, key `streams.orders.shard_cuont`: unknown field `shard_cuont`"),
        "{text}"
    );
}

#[test]
fn an_unknown_section_is_an_error() {
    assert_invalid_at(
        "[redis]\nurl = \"redis://h:1\"\n\n[coordinatoin]\n",
        "coordinatoin",
        4,
        "unknown field `coordinatoin`",
    );
}

#[test]
fn a_value_of_the_wrong_type_names_its_key() {
    assert_invalid_at(
        "# shards\n\n[streams.orders]\nshards = \"eight\"\n",
        "streams.orders.shards",
        4,
        "invalid type: string \"eight\"",
    );
}

#[test]
fn an_unterminated_string_names_its_key_and_line() {
    let (key, line, message) = invalid("[redis]\nurl = \"redis://127.0.0.1:6379\n");
    assert_eq!((key.as_str(), line), ("redis.url", 2));
    assert!(!message.is_empty());
}

#[test]
fn a_bad_duration_names_its_key() {
    let (key, line, message) = invalid("[listeners.on_order]\nbackoff = \"200 parsecs\"\n");
    assert_eq!((key.as_str(), line), ("listeners.on_order.backoff", 2));
    assert_eq!(
        message,
        "invalid value: string \"200 parsecs\", expected a duration such as \"3s\", \"250ms\" or \"1m 30s\""
    );
    let (key, _, _) = invalid("[coordination]\nheartbeat_interval = 3\n");
    assert_eq!(key, "coordination.heartbeat_interval");
}

#[test]
fn zero_concurrency_is_an_error() {
    let (key, line, message) = invalid("\n[listeners.on_order]\nconcurrency = 0\n");
    assert_eq!((key.as_str(), line), ("listeners.on_order.concurrency", 3));
    assert_eq!(message, "must be at least 1");
    let (key, _, _) = invalid("[listeners.x]\nconcurrency = -1\n");
    assert_eq!(key, "listeners.x.concurrency");
}

/// A `batch_size` past what Redis takes as `COUNT` (a signed 64-bit integer) passed the check
/// and then failed every read with "value is not an integer or out of range" (found by a
/// hostile test); members past the largest shard count could never own a shard.
#[test]
fn counts_above_their_limits_are_errors() {
    let (key, line, message) = invalid("[listeners.on_order]\nbatch_size = 18446744073709551615\n");
    assert_eq!((key.as_str(), line), ("listeners.on_order.batch_size", 2));
    assert_eq!(
        message,
        "must be at most 100000 (entries read per shard and round)"
    );
    let (key, _, message) = invalid("[listeners.on_order]\nconcurrency = 1025\n");
    assert_eq!(key, "listeners.on_order.concurrency");
    assert_eq!(
        message,
        "must be at most 1024 (the largest shard count: more members could never own a shard)"
    );
    let config = parse("[listeners.on_order]\nbatch_size = 100000\nconcurrency = 1024\n").unwrap();
    let options = config
        .listener_options("on_order", ListenerOptions::default())
        .unwrap();
    assert_eq!((options.batch_size, options.concurrency), (100_000, 1024));
}

#[test]
fn an_unparsable_redis_url_is_an_error() {
    assert_invalid_at(
        "[redis]\nurl = \"http://127.0.0.1:6379\"\n",
        "redis.url",
        2,
        "is not a Redis URL",
    );
    let (key, _, _) = invalid("[redis]\ncluster_nodes = [\"redis://a:1\", \"nope\"]\n");
    assert_eq!(key, "redis.cluster_nodes");
    let (key, _, message) =
        invalid("[redis]\nurl = \"redis://a:1\"\ncluster_nodes = [\"redis://b:1\"]\n");
    assert_eq!(key, "redis.cluster_nodes");
    assert!(message.contains("not both"), "{message}");
}

#[test]
fn sentinel_settings_come_together_and_never_with_a_cluster() {
    let (key, _, message) = invalid("[redis]\nsentinels = [\"redis://127.0.0.1:26379\"]\n");
    assert_eq!(key, "redis.sentinels");
    assert!(message.contains("needs `sentinel_master`"), "{message}");
    let (key, _, message) = invalid("[redis]\nsentinel_master = \"mymaster\"\n");
    assert_eq!(key, "redis.sentinel_master");
    assert!(message.contains("needs `sentinels`"), "{message}");
    let (key, _, message) = invalid(
        "[redis]\nsentinels = [\"redis://a:26379\"]\nsentinel_master = \"m\"\ncluster_nodes = [\"redis://b:1\"]\n",
    );
    assert_eq!(key, "redis.sentinels");
    assert!(message.contains("not both"), "{message}");
    let (key, _, message) = invalid("[redis]\nsentinels = [\"nope\"]\nsentinel_master = \"m\"\n");
    assert_eq!(key, "redis.sentinels");
    assert!(message.contains("is not a Redis URL"), "{message}");
    let config = parse(
        "[redis]\nurl = \"redis://u:pw@_/2\"\nsentinels = [\"redis://a:26379\", \"redis://b:26379\"]\nsentinel_master = \"mymaster\"\n",
    )
    .expect("a valid Sentinel configuration");
    let target = config.redis.target();
    let crate::connection::Topology::Sentinel(sentinel) = target.topology() else {
        panic!("a Sentinel target, got {target:?}");
    };
    assert_eq!(sentinel.master_name, "mymaster");
    assert_eq!(sentinel.sentinels.len(), 2);
    assert_eq!(sentinel.master_auth.as_deref(), Some("redis://u:pw@_/2"));
    assert!(!format!("{target:?}").contains("pw"));
}

#[test]
fn a_prefix_with_braces_is_an_error() {
    for prefix in ["{orders}", "orders}{", "{}orders", "a{b"] {
        let (key, line, message) = invalid(&format!("[streams.\"{prefix}\"]\nshards = 4\n"));
        assert_eq!(key, format!("streams.{prefix:?}"));
        assert_eq!(line, 1);
        assert!(message.contains("not allowed"), "{message}");
    }
}

#[test]
fn shard_counts_are_checked() {
    let (key, line, _) = invalid("[streams.orders]\nshards = 0\n");
    assert_eq!((key.as_str(), line), ("streams.orders.shards", 2));
    let (_, _, message) = invalid("[streams.orders]\nshards = 5000\n");
    assert!(message.contains("1 to 1024"), "{message}");
}

#[test]
fn timings_are_checked() {
    let (key, line, message) =
        invalid("[coordination]\nmember_lease_ttl = \"3s\"\nheartbeat_interval = \"2s\"\n");
    assert_eq!((key.as_str(), line), ("coordination.heartbeat_interval", 3));
    assert!(message.contains("more than a third"), "{message}");
    let (key, _, _) = invalid("[coordination]\nlease_margin = \"20s\"\n");
    assert_eq!(key, "coordination.lease_margin");
    // Defaults: lease 15 s, heartbeat 3 s: a 10 s margin leaves less than two heartbeats.
    let (key, _, message) = invalid("[coordination]\nlease_margin = \"10s\"\n");
    assert_eq!(key, "coordination.lease_margin");
    assert!(message.contains("two heartbeat intervals"), "{message}");
    let config = parse("[listeners.slow]\nhandler_timeout = \"2m\"\n").unwrap();
    let err = config
        .listener_options("slow", ListenerOptions::default())
        .unwrap_err();
    assert_eq!(err.key(), Some("listeners.slow.handler_timeout"));
    assert_eq!(err.location().map(|l| l.line), Some(2));
}

#[test]
fn hook_timeout_is_read_and_must_be_positive_and_below_the_rebalance_timeout() {
    let config = parse("[listeners.on_order]\nhook_timeout = \"3s\"\n").unwrap();
    let options = config
        .listener_options("on_order", ListenerOptions::default())
        .unwrap();
    assert_eq!(options.hook_timeout, Some(Duration::from_secs(3)));
    assert_eq!(options.effective_hook_timeout(), Duration::from_secs(3));
    let defaults = config
        .listener_options("other", ListenerOptions::default())
        .unwrap();
    assert_eq!(defaults.hook_timeout, None);
    // 10 s, below the default rebalance timeout (60 s); half a shorter one.
    assert_eq!(defaults.effective_hook_timeout(), Duration::from_secs(10));
    let short = parse(
        "[coordination]\nrebalance_timeout = \"4s\"\n[listeners.any]\nhandler_timeout = \"1s\"\n",
    )
    .unwrap();
    let options = short
        .listener_options("any", ListenerOptions::default())
        .unwrap();
    assert_eq!(options.effective_hook_timeout(), Duration::from_secs(2));
    let config = parse("\n[listeners.slow]\nhook_timeout = \"2m\"\n").unwrap();
    let err = config
        .listener_options("slow", ListenerOptions::default())
        .unwrap_err();
    assert_eq!(err.key(), Some("listeners.slow.hook_timeout"));
    assert_eq!(err.location().map(|l| l.line), Some(3));
    assert!(
        err.to_string().contains("must be below rebalance_timeout"),
        "{err}"
    );
    let err = parse("[listeners.zero]\nhook_timeout = \"0s\"\n").unwrap_err();
    assert_eq!(err.key(), Some("listeners.zero.hook_timeout"));
    assert!(err.to_string().contains("must be positive"), "{err}");
}

#[test]
fn unknown_listeners_are_reported_with_their_line() {
    let config = parse("[listeners.on_order]\nconcurrency = 2\n\n[listeners.on_ordr]\n").unwrap();
    config
        .check_listener_names(["on_order", "on_ordr"])
        .unwrap();
    let err = config.check_listener_names(["on_order"]).unwrap_err();
    let text = err.to_string();
    assert!(
        text.starts_with("app.toml:4:12: [listeners.on_ordr] configures a listener that does not exist; the listeners of this program are: on_order"),
        "{text}"
    );
}

#[test]
fn environment_overrides() {
    let dir = tempfile_dir();
    let path = dir.join("custom.toml");
    std::fs::write(
        &path,
        "[redis]\nurl = \"redis://file:1\"\n[member]\ninstance_id = \"a\"\n",
    )
    .unwrap();
    let env: HashMap<&str, String> = [
        (CONFIG_ENV, path.display().to_string()),
        (REDIS_URL_ENV, "redis://env:2".to_owned()),
        (INSTANCE_ID_ENV, "pod-7".to_owned()),
    ]
    .into();
    let config = Config::load_with_env(|k| env.get(k).cloned()).unwrap();
    assert_eq!(
        config.redis.target(),
        RedisTarget::standalone("redis://env:2")
    );
    assert_eq!(config.member.instance_id.as_deref(), Some("pod-7"));
    assert_eq!(config.file(), Some(path.display().to_string().as_str()));

    let bad_url: HashMap<&str, String> = [(REDIS_URL_ENV, "localhost".to_owned())].into();
    let err = Config::load_with_env(|k| bad_url.get(k).cloned()).unwrap_err();
    assert!(
        matches!(
            err,
            ConfigError::Env {
                var: "REDIS_URL",
                ..
            }
        ),
        "{err}"
    );

    // Two processes on one host share a file but not the HTTP port.
    let listen: HashMap<&str, String> = [
        (CONFIG_ENV, path.display().to_string()),
        (LISTEN_ENV, "127.0.0.1:9475".to_owned()),
    ]
    .into();
    let config = Config::load_with_env(|k| listen.get(k).cloned()).unwrap();
    assert_eq!(
        config.listen_addr().unwrap(),
        Some("127.0.0.1:9475".parse().unwrap())
    );
    let bad_listen: HashMap<&str, String> = [(LISTEN_ENV, "localhost:9475".to_owned())].into();
    let err = Config::load_with_env(|k| bad_listen.get(k).cloned()).unwrap_err();
    assert!(
        matches!(
            err,
            ConfigError::Env {
                var: "STREAM_LISTENER_OBSERVABILITY_LISTEN",
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("\"127.0.0.1:9464\""), "{err}");

    let missing: HashMap<&str, String> =
        [(CONFIG_ENV, dir.join("nope.toml").display().to_string())].into();
    let err = Config::load_with_env(|k| missing.get(k).cloned()).unwrap_err();
    assert!(
        err.to_string().contains("named by STREAM_LISTENER_CONFIG"),
        "{err}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

fn tempfile_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("sl-config-{}", uuid::Uuid::now_v7()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn observability_defaults_to_no_listener_and_a_5s_interval() {
    let config = parse("").unwrap();
    assert_eq!(config.observability.listen, None);
    assert_eq!(config.listen_addr().unwrap(), None);
    assert_eq!(
        config.observability.metrics_interval,
        Duration::from_secs(5)
    );
}

#[test]
fn observability_listen_and_interval_parse() {
    let config =
        parse("[observability]\nlisten = \"[::]:9464\"\nmetrics_interval = \"2s\"\n").unwrap();
    assert_eq!(
        config.listen_addr().unwrap(),
        Some("[::]:9464".parse().unwrap())
    );
    assert_eq!(
        config.observability.metrics_interval,
        Duration::from_secs(2)
    );
    // The process-wide interval reaches every listener's sampler.
    let options = config
        .listener_options("any", ListenerOptions::default())
        .unwrap();
    assert_eq!(options.metrics_interval, Duration::from_secs(2));
}

#[test]
fn an_unparsable_listen_address_names_file_line_and_key() {
    assert_invalid_at(
        "[redis]\nurl = \"redis://h:1\"\n\n[observability]\nlisten = \"localhost:9464\"\n",
        "observability.listen",
        5,
        "\"localhost:9464\" is not a socket address",
    );
    assert_invalid_at(
        "[observability]\nlisten = \"127.0.0.1\"\n",
        "observability.listen",
        2,
        "e.g. \"127.0.0.1:9464\"",
    );
}

#[test]
fn a_zero_metrics_interval_is_refused() {
    assert_invalid_at(
        "[observability]\nmetrics_interval = \"0s\"\n",
        "observability.metrics_interval",
        2,
        "must be positive",
    );
}

#[test]
fn a_metrics_interval_above_a_day_is_refused() {
    assert_invalid_at(
        "[observability]\nmetrics_interval = \"2days\"\n",
        "observability.metrics_interval",
        2,
        "at most 1 day",
    );
}

#[test]
fn batch_max_wait_is_read_and_must_leave_half_the_lease() {
    let config = parse("[listeners.on_orders]\nbatch_max_wait = \"250ms\"\n").unwrap();
    let options = config
        .listener_options("on_orders", ListenerOptions::default())
        .unwrap();
    assert_eq!(options.batch_max_wait, Duration::from_millis(250));
    let defaults = config
        .listener_options("other", ListenerOptions::default())
        .unwrap();
    assert_eq!(defaults.batch_max_wait, Duration::ZERO);
    // The default lease is 15 s: 7.5 s is the most.
    let config = parse("\n[listeners.slow]\nbatch_max_wait = \"8s\"\n").unwrap();
    let err = config
        .listener_options("slow", ListenerOptions::default())
        .unwrap_err();
    assert_eq!(err.key(), Some("listeners.slow.batch_max_wait"));
    assert_eq!(err.location().map(|l| l.line), Some(3));
    assert!(
        err.to_string()
            .contains("must be at most half of member_lease_ttl"),
        "{err}"
    );
}

#[test]
fn ordering_and_max_in_flight_are_read() {
    let config = parse("[listeners.on_order]\nordering = \"key\"\nmax_in_flight = 64\n").unwrap();
    let options = config
        .listener_options("on_order", ListenerOptions::default())
        .unwrap();
    assert_eq!(options.ordering, crate::member::Ordering::Key);
    assert_eq!(options.max_in_flight, 64);
    let defaults = parse("")
        .unwrap()
        .listener_options("on_order", ListenerOptions::default())
        .unwrap();
    assert_eq!(defaults.ordering, crate::member::Ordering::Shard);
    assert_eq!(defaults.max_in_flight, 16);
    let none = parse("[listeners.x]\nordering = \"none\"\n")
        .unwrap()
        .listener_options("x", ListenerOptions::default())
        .unwrap();
    assert_eq!(none.ordering, crate::member::Ordering::None);
}

#[test]
fn a_wrong_ordering_is_an_error_at_its_key_listing_the_three() {
    assert_invalid_at(
        "[listeners.on_order]\n\nordering = \"keys\"\n",
        "listeners.on_order.ordering",
        3,
        "expected one of `shard`, `key`, `none`",
    );
}

#[test]
fn zero_max_in_flight_is_an_error() {
    let (key, line, message) = invalid("[listeners.on_order]\nmax_in_flight = 0\n");
    assert_eq!(
        (key.as_str(), line),
        ("listeners.on_order.max_in_flight", 2)
    );
    assert_eq!(message, "must be at least 1");
}

/// `max_entry_bytes` (README "Configuration"): the largest entry a listener hands to its
/// handler; a larger one is dead-lettered `too-large`. Before it was a key, a config-only
/// program (the attribute and a TOML file) could not change the 16 MiB default.
#[test]
fn max_entry_bytes_is_read_and_zero_is_an_error() {
    let config = parse("[listeners.on_order]\nmax_entry_bytes = 65536\n").unwrap();
    let options = config
        .listener_options("on_order", ListenerOptions::default())
        .unwrap();
    assert_eq!(options.max_entry_bytes, Some(65536));
    let defaults = parse("")
        .unwrap()
        .listener_options("on_order", ListenerOptions::default())
        .unwrap();
    assert_eq!(defaults.max_entry_bytes, Some(16 * 1024 * 1024));
    let (key, line, message) = invalid("[listeners.on_order]\nmax_entry_bytes = 0\n");
    assert_eq!(
        (key.as_str(), line),
        ("listeners.on_order.max_entry_bytes", 2)
    );
    assert_eq!(message, "must be at least 1");
}

#[test]
fn tls_settings_are_checked() {
    assert_invalid_at(
        "[redis]\nurl = \"redis://127.0.0.1:6379\"\ntls_ca_file = \"/ca.crt\"\n",
        "redis.tls_ca_file",
        3,
        "is a plain redis:// URL",
    );
    let (key, _, message) = invalid(
        "[redis]\ncluster_nodes = [\"rediss://a:1\", \"redis://b:1\"]\ntls_insecure = true\n",
    );
    assert_eq!(key, "redis.tls_insecure");
    assert!(
        message.contains("cluster_nodes \"redis://b:1\""),
        "{message}"
    );
    let (key, _, message) =
        invalid("[redis]\nurl = \"rediss://a:1\"\ntls_cert_file = \"/c.crt\"\n");
    assert_eq!(key, "redis.tls_cert_file");
    assert!(message.contains("tls_key_file"), "{message}");
    let (key, _, _) = invalid("[redis]\nurl = \"rediss://a:1\"\ntls_key_file = \"/c.key\"\n");
    assert_eq!(key, "redis.tls_key_file");
    let (key, _, message) = invalid(
        "[redis]\nurl = \"rediss://a:1\"\ntls_insecure = true\ntls_ca_file = \"/ca.crt\"\n",
    );
    assert_eq!(key, "redis.tls_insecure");
    assert!(message.contains("tls_ca_file"), "{message}");
    // No url: the default redis://127.0.0.1:6379 is plain.
    let (key, _, _) = invalid("[redis]\ntls_ca_file = \"/ca.crt\"\n");
    assert_eq!(key, "redis.tls_ca_file");
    parse(
        "[redis]\nurl = \"rediss://a:1\"\ntls_ca_file = \"/ca.crt\"\ntls_cert_file = \"/c.crt\"\ntls_key_file = \"/c.key\"\n",
    )
    .expect("rediss:// with a CA and a client certificate is valid");
}

#[test]
fn replica_waits_reach_listeners_and_publishers_and_their_timeout_is_checked() {
    let config = parse(
        "[redis]\nmin_replica_acks = 1\nreplica_ack_timeout = \"250ms\"\ncluster_nodes = [\"redis://127.0.0.1:7000\"]\n",
    )
    .unwrap();
    let options = config
        .listener_options("l", ListenerOptions::default())
        .unwrap();
    assert_eq!(
        (options.min_replica_acks, options.replica_ack_timeout),
        (1, Duration::from_millis(250))
    );
    let publisher = config.publisher_options("orders");
    assert_eq!(
        (publisher.min_replica_acks, publisher.replica_ack_timeout),
        (1, Duration::from_millis(250))
    );
    assert_invalid_at(
        "[redis]\nmin_replica_acks = 1\nreplica_ack_timeout = \"0s\"\n",
        "redis.replica_ack_timeout",
        3,
        "must be positive",
    );
    // The default heartbeat interval is 3 s.
    assert_invalid_at(
        "[redis]\nmin_replica_acks = 2\nreplica_ack_timeout = \"3s\"\n",
        "redis.replica_ack_timeout",
        3,
        "must be below heartbeat_interval (3s)",
    );
    // Off: the timeout is not checked.
    parse("[redis]\nreplica_ack_timeout = \"0s\"\n").unwrap();
}

#[test]
fn debug_of_a_unix_socket_url_hides_its_pass_parameter() {
    let config = parse("[redis]\nurl = \"redis+unix:///tmp/r.sock?db=1&pass=s3cret\"\n").unwrap();
    let debug = format!("{config:?}");
    assert!(!debug.contains("s3cret"), "password in Debug: {debug}");
    assert_eq!(
        redact_url("redis://u:s3cret@127.0.0.1:6379"),
        crate::connection::redact_url("redis://u:s3cret@127.0.0.1:6379"),
        "one redaction for config and connection"
    );
}

#[test]
fn tls_settings_with_a_sentinel_target_need_a_rediss_url() {
    let (key, _, message) = invalid(
        "[redis]\nsentinels = [\"redis://a:26379\"]\nsentinel_master = \"m\"\ntls_ca_file = \"/ca.crt\"\n",
    );
    assert_eq!(key, "redis.tls_ca_file");
    assert!(message.contains("rediss://"), "{message}");
    for tls_url in [
        "sentinels = [\"rediss://a:26379\"]\nsentinel_master = \"m\"\n",
        "url = \"rediss://u:pw@_/0\"\nsentinels = [\"redis://a:26379\"]\nsentinel_master = \"m\"\n",
    ] {
        parse(&format!("[redis]\n{tls_url}tls_ca_file = \"/ca.crt\"\n")).unwrap();
    }
}
