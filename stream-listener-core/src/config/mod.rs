//! The configuration file (docs/design.md §11): one TOML file, `stream-listener.toml` in the
//! working directory or the path in `STREAM_LISTENER_CONFIG`, with `REDIS_URL` and
//! `STREAM_LISTENER_INSTANCE_ID` overriding the Redis URL and the instance id.
//!
//! Every key is optional: an empty file, or no file at all, gives a working configuration (a
//! standalone Redis on `redis://127.0.0.1:6379`, the protocol's default timings). Unknown keys,
//! values of the wrong type and values out of range are errors that name the file, the line and
//! the dotted key ([`ConfigError::Invalid`]): a misspelt setting never silently falls back to its
//! default.
//!
//! ```toml
//! [redis]
//! url = "redis://127.0.0.1:6379"          # or cluster_nodes = ["redis://10.0.0.1:7000", ...]
//! startup_timeout = "30s"                 # capped retries while Redis does not answer
//!
//! [coordination]
//! heartbeat_interval = "3s"               # at most a third of member_lease_ttl
//! member_lease_ttl = "15s"
//! lease_margin = "3s"                     # default: 20% of member_lease_ttl
//! rebalance_timeout = "60s"
//!
//! [member]
//! instance_id = "orders-pod-1"            # static membership; one per process
//!
//! [streams.orders]
//! shards = 8                              # create the stream at startup if it does not exist
//! max_payload_bytes = 1048576             # publisher limit (Config::publisher_options)
//!
//! [listeners.on_order]                    # overrides for the listener named `on_order`
//! concurrency = 4
//! runtime_max_concurrency = 1
//! batch_size = 32
//! block = "2s"
//! max_attempts = 3
//! backoff = "200ms"
//! max_deliveries = 10
//! handler_timeout = "30s"
//! shutdown_timeout = "30s"
//! start_from = "earliest"                 # or "latest"
//! fencing = "strict"                      # or "acks"
//! ```
//!
//! Durations are humantime strings: `"250ms"`, `"3s"`, `"1m 30s"`.

mod error;
mod locate;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

pub use error::{ConfigError, Location};

use crate::connection::RedisTarget;
use crate::coordinator::CoordinatorConfig;
use crate::dataplane::FencingMode;
use crate::member::ListenerOptions;
use crate::model::StartFrom;
use crate::producer::PublisherOptions;

/// The config file read when `STREAM_LISTENER_CONFIG` is not set (in the working directory).
pub const DEFAULT_CONFIG_FILE: &str = "stream-listener.toml";
/// Environment variable naming the config file.
pub const CONFIG_ENV: &str = "STREAM_LISTENER_CONFIG";
/// Environment variable overriding `[redis] url`.
pub const REDIS_URL_ENV: &str = "REDIS_URL";
/// Environment variable overriding `[member] instance_id`, so pods sharing one file stay
/// distinct.
pub const INSTANCE_ID_ENV: &str = "STREAM_LISTENER_INSTANCE_ID";
/// The Redis URL used when neither `url`, `cluster_nodes` nor `REDIS_URL` is given.
pub const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";
/// The largest shard count `[streams.<prefix>] shards` accepts (the admin limit).
pub const MAX_SHARDS: u32 = crate::admin::MAX_SHARDS;

/// The whole configuration (docs/design.md §11). `Config::default()` is what an empty file gives.
///
/// Read one with [`Config::load`] (file and environment), [`Config::from_file`] or
/// [`Config::from_toml_str`]; or start from `Config::default()` and set fields, then
/// [`Config::validate`].
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct Config {
    /// `[redis]`: where Redis is.
    #[serde(default)]
    pub redis: RedisConfig,
    /// `[coordination]`: protocol timings.
    #[serde(default)]
    pub coordination: CoordinationConfig,
    /// `[member]`: this process's identity.
    #[serde(default)]
    pub member: MemberConfig,
    /// `[streams.<prefix>]`: per stream, keyed by prefix.
    #[serde(default)]
    pub streams: BTreeMap<String, StreamConfig>,
    /// `[listeners.<name>]`: overrides per listener, keyed by listener name.
    #[serde(default)]
    pub listeners: BTreeMap<String, ListenerConfig>,
    /// The file it came from, to locate errors found after loading.
    #[serde(skip)]
    origin: Option<Origin>,
}

#[derive(Clone)]
struct Origin {
    file: String,
    text: Arc<str>,
}

impl std::fmt::Debug for Origin {
    // The file name only: the text may hold a password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Origin").field(&self.file).finish()
    }
}

/// `[redis]`: a standalone server (`url`) or a cluster (`cluster_nodes`), not both.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct RedisConfig {
    /// `url`: `redis://[user:password@]host:port[/db]`, or `rediss://` for TLS. Default
    /// [`DEFAULT_REDIS_URL`]; `REDIS_URL` overrides it.
    pub url: Option<String>,
    /// `cluster_nodes`: seed node URLs of a Redis Cluster (empty: standalone).
    pub cluster_nodes: Vec<String>,
    /// `startup_timeout` (default 30 s): how long `run()` retries, with capped backoff, while
    /// Redis does not answer at startup, before it fails with a clear error.
    #[serde(with = "humantime_serde")]
    pub startup_timeout: Duration,
}

impl Default for RedisConfig {
    fn default() -> Self {
        RedisConfig {
            url: None,
            cluster_nodes: Vec::new(),
            startup_timeout: Duration::from_secs(30),
        }
    }
}

impl std::fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConfig")
            .field("url", &self.url.as_deref().map(redact_url))
            .field(
                "cluster_nodes",
                &self
                    .cluster_nodes
                    .iter()
                    .map(|n| redact_url(n))
                    .collect::<Vec<_>>(),
            )
            .field("startup_timeout", &self.startup_timeout)
            .finish()
    }
}

impl RedisConfig {
    /// Where to connect: the cluster when `cluster_nodes` is set, else `url` (default
    /// [`DEFAULT_REDIS_URL`]).
    pub fn target(&self) -> RedisTarget {
        if self.cluster_nodes.is_empty() {
            RedisTarget::Standalone(
                self.url
                    .clone()
                    .unwrap_or_else(|| DEFAULT_REDIS_URL.to_owned()),
            )
        } else {
            RedisTarget::Cluster(self.cluster_nodes.clone())
        }
    }
}

/// `[coordination]`: protocol timings (docs/design.md §5, §6). Defaults: heartbeat 3 s, lease 15 s,
/// margin 20% of the lease, rebalance timeout 60 s.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct CoordinationConfig {
    /// `heartbeat_interval`: at most a third of `member_lease_ttl`.
    #[serde(with = "humantime_serde")]
    pub heartbeat_interval: Duration,
    /// `member_lease_ttl`: how long an assignment lasts without a renewing heartbeat.
    #[serde(with = "humantime_serde")]
    pub member_lease_ttl: Duration,
    /// `lease_margin`: taken off the lease on the member's side (default 20% of the TTL); below
    /// `member_lease_ttl`.
    #[serde(with = "humantime_serde")]
    pub lease_margin: Option<Duration>,
    /// `rebalance_timeout`: how long a member has to release shards it must give up; above every
    /// listener's `handler_timeout`.
    #[serde(with = "humantime_serde")]
    pub rebalance_timeout: Duration,
}

impl Default for CoordinationConfig {
    fn default() -> Self {
        let defaults = CoordinatorConfig::default();
        CoordinationConfig {
            heartbeat_interval: defaults.heartbeat_interval,
            member_lease_ttl: defaults.member_lease_ttl,
            lease_margin: None,
            rebalance_timeout: defaults.rebalance_timeout,
        }
    }
}

/// `[member]`: this process's identity.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct MemberConfig {
    /// `instance_id`: static membership (docs/design.md §7): member ids become
    /// `<instance_id>-m<k>` and a restarted process takes its shards back. One per process;
    /// `STREAM_LISTENER_INSTANCE_ID` overrides it.
    pub instance_id: Option<String>,
}

/// `[streams.<prefix>]`: one sharded stream.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct StreamConfig {
    /// `shards`: create the stream with this many shards at startup if it does not exist
    /// (1 to [`MAX_SHARDS`]). An existing stream keeps its count (change it with
    /// `stream-listener stream scale`). Without it, the stream must exist.
    pub shards: Option<u32>,
    /// `max_payload_bytes`: the publisher's payload limit (default 1 MiB), see
    /// [`Config::publisher_options`].
    pub max_payload_bytes: Option<usize>,
}

/// `[listeners.<name>]`: overrides of one listener's settings; every key is optional and wins
/// over the value in `#[stream_listener(...)]` and the defaults of
/// [`crate::member::ListenerOptions`].
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct ListenerConfig {
    /// `concurrency`: logical members in this process (≥ 1).
    pub concurrency: Option<u32>,
    /// `runtime_max_concurrency`: local workers per member (≥ 1, default 1).
    pub runtime_max_concurrency: Option<u32>,
    /// `batch_size`: entries per read (≥ 1, default 32).
    pub batch_size: Option<usize>,
    /// `block`: longest wait for new entries (> 0, default 2 s).
    #[serde(with = "humantime_serde")]
    pub block: Option<Duration>,
    /// `max_attempts`: handler attempts before dead-lettering (≥ 1, default 3).
    pub max_attempts: Option<u32>,
    /// `backoff`: first retry backoff, doubled per attempt (default 200 ms).
    #[serde(with = "humantime_serde")]
    pub backoff: Option<Duration>,
    /// `max_deliveries`: handler attempts on an entry, in processes that did not finish them (it
    /// may crash the process), after which it is dead-lettered unhandled (≥ 1, default 10).
    /// Re-reads without an attempt do not count (docs/design.md §8.9).
    pub max_deliveries: Option<u64>,
    /// `handler_timeout`: limit of one handler attempt (> 0, below `rebalance_timeout`, default
    /// 30 s).
    #[serde(with = "humantime_serde")]
    pub handler_timeout: Option<Duration>,
    /// `shutdown_timeout`: time in-flight handlers get at shutdown (default 30 s).
    #[serde(with = "humantime_serde")]
    pub shutdown_timeout: Option<Duration>,
    /// `start_from`: `"earliest"` (default) or `"latest"`, where a newly registered group starts.
    pub start_from: Option<StartFrom>,
    /// `fencing`: `"strict"` (default) or `"acks"` (docs/design.md §8).
    pub fencing: Option<FencingMode>,
}

/// `redis://user:secret@host` → `redis://***@host`: never print a password.
pub fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}***{}", &url[..scheme + 3], &url[at..])
        }
        _ => url.to_owned(),
    }
}

fn check_redis_url(url: &str) -> Result<(), String> {
    redis::IntoConnectionInfo::into_connection_info(url)
        .map(|_| ())
        .map_err(|e| {
            format!(
                "{:?} is not a Redis URL ({e}); write redis://[user:password@]host:port[/db] or rediss://... for TLS",
                redact_url(url)
            )
        })
}

fn check_instance_id(id: &str) -> Result<(), String> {
    if id.is_empty() {
        return Err("the instance id is empty; give a non-empty id or remove the key".into());
    }
    if let Some(c) = id
        .chars()
        .find(|c| c.is_whitespace() || c.is_control() || matches!(c, '{' | '}'))
    {
        return Err(format!(
            "instance id {id:?} contains {c:?}; use letters, digits, '-', '_', '.' or ':'"
        ));
    }
    if id.len() > crate::keys::MAX_NAME_LEN {
        return Err(format!(
            "instance id is {} bytes long; the limit is {}",
            id.len(),
            crate::keys::MAX_NAME_LEN
        ));
    }
    Ok(())
}

impl Config {
    /// Reads the configuration as a deployed program does: the file named by
    /// `STREAM_LISTENER_CONFIG`, else `stream-listener.toml` in the working directory if it
    /// exists, else the defaults; then `REDIS_URL` and `STREAM_LISTENER_INSTANCE_ID` override the
    /// Redis URL and the instance id (empty variables are ignored). Validated.
    ///
    /// # Errors
    /// [`ConfigError::Read`] when the named file cannot be read (a missing default file is not an
    /// error); [`ConfigError::Invalid`] for syntax errors, unknown keys and bad values, naming
    /// file, line and key; [`ConfigError::Env`] for an unusable environment value.
    pub fn load() -> Result<Config, ConfigError> {
        Config::load_with_env(|name| std::env::var(name).ok())
    }

    /// [`Config::load`] with the environment given as a lookup function (for tests and for
    /// programs that keep settings elsewhere).
    ///
    /// # Errors
    /// As [`Config::load`].
    pub fn load_with_env(env: impl Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
        let named = env(CONFIG_ENV).filter(|v| !v.is_empty());
        let mut config = match named {
            Some(path) => Config::read(Path::new(&path), true)?,
            None => {
                let path = Path::new(DEFAULT_CONFIG_FILE);
                if path.exists() {
                    Config::read(path, false)?
                } else {
                    Config::default()
                }
            }
        };
        config.apply_env(env)?;
        Ok(config)
    }

    /// Reads and validates the TOML file at `path` (no environment overrides).
    ///
    /// # Errors
    /// [`ConfigError::Read`] when it cannot be read; [`ConfigError::Invalid`] as for
    /// [`Config::from_toml_str`].
    pub fn from_file(path: impl AsRef<Path>) -> Result<Config, ConfigError> {
        Config::read(path.as_ref(), false)
    }

    fn read(path: &Path, from_env: bool) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: PathBuf::from(path),
            from_env,
            source,
        })?;
        Config::from_toml_str(&text, &path.display().to_string())
    }

    /// Parses and validates TOML `text`; `file` names it in error messages (no environment
    /// overrides).
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] for a syntax error, an unknown key, a value of the wrong type, or
    /// a value [`Config::validate`] refuses; it names `file`, the line and the dotted key.
    pub fn from_toml_str(text: &str, file: &str) -> Result<Config, ConfigError> {
        let origin = Origin {
            file: file.to_owned(),
            text: Arc::from(text),
        };
        let mut config: Config = toml::from_str(text).map_err(|e| origin.parse_error(&e))?;
        config.origin = Some(origin);
        config.validate()?;
        Ok(config)
    }

    /// Applies `REDIS_URL` and `STREAM_LISTENER_INSTANCE_ID` from `env` (empty values are
    /// ignored).
    ///
    /// # Errors
    /// [`ConfigError::Env`] for a `REDIS_URL` that does not parse, one given while the file
    /// configures `cluster_nodes`, or an unusable instance id.
    pub fn apply_env(&mut self, env: impl Fn(&str) -> Option<String>) -> Result<(), ConfigError> {
        if let Some(url) = env(REDIS_URL_ENV).filter(|v| !v.is_empty()) {
            let invalid = |message: String| ConfigError::Env {
                var: REDIS_URL_ENV,
                value: redact_url(&url),
                message,
            };
            check_redis_url(&url).map_err(invalid)?;
            if !self.redis.cluster_nodes.is_empty() {
                return Err(invalid(
                    "the config file sets [redis] cluster_nodes; unset REDIS_URL or remove cluster_nodes".into(),
                ));
            }
            self.redis.url = Some(url);
        }
        if let Some(id) = env(INSTANCE_ID_ENV).filter(|v| !v.is_empty()) {
            check_instance_id(&id).map_err(|message| ConfigError::Env {
                var: INSTANCE_ID_ENV,
                value: id.clone(),
                message,
            })?;
            self.member.instance_id = Some(id);
        }
        Ok(())
    }

    /// The file the configuration was read from, if any.
    pub fn file(&self) -> Option<&str> {
        self.origin.as_ref().map(|o| o.file.as_str())
    }

    /// Where the key at dotted `path` is written in the file, if it came from one.
    pub fn locate(&self, path: &[&str]) -> Option<Location> {
        let origin = self.origin.as_ref()?;
        locate::locate_key(&origin.file, &origin.text, path)
    }

    fn invalid(&self, path: &[&str], message: impl Into<String>) -> ConfigError {
        let segments: Vec<String> = path.iter().map(|s| (*s).to_owned()).collect();
        ConfigError::Invalid {
            key: locate::dotted(&segments),
            message: message.into(),
            location: self.locate(path),
        }
    }

    /// Checks every value: Redis URLs parse and `url` and `cluster_nodes` are not both given;
    /// timings are positive, `heartbeat_interval` ≤ `member_lease_ttl` / 3, `lease_margin` <
    /// `member_lease_ttl`; the instance id is usable; stream prefixes are valid (no `{`
    /// or `}`) and `shards` is 1 to [`MAX_SHARDS`]; listener counts are at least 1 and
    /// `handler_timeout` is positive and below `rebalance_timeout`.
    ///
    /// # Errors
    /// The first problem found, as [`ConfigError::Invalid`] naming the key (and the file and
    /// line when the configuration came from a file).
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_redis()?;
        self.coordinator_config()?;
        if let Some(id) = &self.member.instance_id {
            check_instance_id(id).map_err(|m| self.invalid(&["member", "instance_id"], m))?;
        }
        for (prefix, stream) in &self.streams {
            crate::keys::validate_stream_prefix(prefix).map_err(|e| {
                self.invalid(&["streams", prefix], format!("{e} (write `[streams.<prefix>]` with the bare prefix, e.g. [streams.orders])"))
            })?;
            if let Some(shards) = stream.shards
                && !(1..=MAX_SHARDS).contains(&shards)
            {
                return Err(self.invalid(
                    &["streams", prefix, "shards"],
                    format!("{shards} shards: a stream needs 1 to {MAX_SHARDS} shards"),
                ));
            }
            if stream.max_payload_bytes == Some(0) {
                return Err(self.invalid(
                    &["streams", prefix, "max_payload_bytes"],
                    "must be at least 1 (default 1048576, 1 MiB)",
                ));
            }
        }
        for (name, listener) in &self.listeners {
            self.validate_listener(name, listener)?;
        }
        Ok(())
    }

    fn validate_redis(&self) -> Result<(), ConfigError> {
        let redis = &self.redis;
        if redis.url.is_some() && !redis.cluster_nodes.is_empty() {
            return Err(self.invalid(
                &["redis", "cluster_nodes"],
                "give either `url` (one server) or `cluster_nodes` (a cluster), not both",
            ));
        }
        if let Some(url) = &redis.url {
            check_redis_url(url).map_err(|m| self.invalid(&["redis", "url"], m))?;
        }
        for node in &redis.cluster_nodes {
            check_redis_url(node).map_err(|m| self.invalid(&["redis", "cluster_nodes"], m))?;
        }
        if redis.startup_timeout.is_zero() {
            return Err(self.invalid(
                &["redis", "startup_timeout"],
                "must be positive, e.g. \"30s\"",
            ));
        }
        Ok(())
    }

    /// The protocol timings of `[coordination]`, checked.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] for a zero duration, a heartbeat slower than a third of the
    /// lease, or a lease margin not below the lease.
    pub fn coordinator_config(&self) -> Result<CoordinatorConfig, ConfigError> {
        let c = &self.coordination;
        for (key, value) in [
            ("heartbeat_interval", c.heartbeat_interval),
            ("member_lease_ttl", c.member_lease_ttl),
            ("rebalance_timeout", c.rebalance_timeout),
        ] {
            if value.is_zero() {
                return Err(self.invalid(&["coordination", key], "must be positive"));
            }
        }
        if c.heartbeat_interval.saturating_mul(3) > c.member_lease_ttl {
            return Err(self.invalid(
                &["coordination", "heartbeat_interval"],
                format!(
                    "{} is more than a third of member_lease_ttl ({}); members would lose their lease between two heartbeats: lower it or raise member_lease_ttl",
                    humantime::format_duration(c.heartbeat_interval),
                    humantime::format_duration(c.member_lease_ttl)
                ),
            ));
        }
        // The member's lease (ttl - margin) must outlast two heartbeat intervals, or it lapses
        // between heartbeats and every lapse re-reads (and re-counts) the pending entries.
        if let Some(margin) = c.lease_margin
            && margin.saturating_add(c.heartbeat_interval.saturating_mul(2)) > c.member_lease_ttl
        {
            return Err(self.invalid(
                &["coordination", "lease_margin"],
                format!(
                    "{} leaves members less than two heartbeat intervals ({} each) of their {} lease; lower lease_margin (at most member_lease_ttl - 2 x heartbeat_interval)",
                    humantime::format_duration(margin),
                    humantime::format_duration(c.heartbeat_interval),
                    humantime::format_duration(c.member_lease_ttl)
                ),
            ));
        }
        CoordinatorConfig::new(
            c.heartbeat_interval,
            c.member_lease_ttl,
            c.rebalance_timeout,
        )
        .map_err(|e| self.invalid(&["coordination"], e.to_string()))
    }

    fn validate_listener(&self, name: &str, l: &ListenerConfig) -> Result<(), ConfigError> {
        let at_least_one = [
            ("concurrency", l.concurrency.map(u64::from)),
            (
                "runtime_max_concurrency",
                l.runtime_max_concurrency.map(u64::from),
            ),
            ("batch_size", l.batch_size.map(|v| v as u64)),
            ("max_attempts", l.max_attempts.map(u64::from)),
            ("max_deliveries", l.max_deliveries),
        ];
        for (key, value) in at_least_one {
            if value == Some(0) {
                return Err(self.invalid(&["listeners", name, key], "must be at least 1"));
            }
        }
        for (key, value) in [("block", l.block), ("handler_timeout", l.handler_timeout)] {
            if value.is_some_and(|v| v.is_zero()) {
                return Err(self.invalid(&["listeners", name, key], "must be positive"));
            }
        }
        Ok(())
    }

    /// Fails on a `[listeners.<name>]` section whose name is not in `known` (the registered
    /// listeners of the program).
    ///
    /// # Errors
    /// [`ConfigError::UnknownListener`] for the first such section, with its location.
    pub fn check_listener_names<'a>(
        &self,
        known: impl IntoIterator<Item = &'a str>,
    ) -> Result<(), ConfigError> {
        let mut known: Vec<String> = known.into_iter().map(str::to_owned).collect();
        known.sort();
        known.dedup();
        for name in self.listeners.keys() {
            if !known.iter().any(|k| k == name) {
                return Err(ConfigError::UnknownListener {
                    name: name.clone(),
                    location: self.locate(&["listeners", name]),
                    known,
                });
            }
        }
        Ok(())
    }

    /// The settings of listener `name`: `base` (defaults and the values of
    /// `#[stream_listener(...)]`) with `[coordination]`, `[member] instance_id` and the
    /// overrides of `[listeners.<name>]` applied.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] when the timings are invalid, or when the listener's effective
    /// `handler_timeout` is not below `rebalance_timeout` (docs/design.md §8).
    pub fn listener_options(
        &self,
        name: &str,
        base: ListenerOptions,
    ) -> Result<ListenerOptions, ConfigError> {
        let mut options = base;
        options.name = name.to_owned();
        options.coordination = self.coordinator_config()?;
        options.lease_margin = self.coordination.lease_margin;
        if let Some(id) = &self.member.instance_id {
            options.instance_id = Some(id.clone());
        }
        if let Some(l) = self.listeners.get(name) {
            self.validate_listener(name, l)?;
            macro_rules! set {
                ($($field:ident),*) => { $( if let Some(v) = l.$field { options.$field = v; } )* };
            }
            set!(
                concurrency,
                runtime_max_concurrency,
                batch_size,
                block,
                max_attempts,
                backoff,
                max_deliveries,
                handler_timeout,
                shutdown_timeout,
                start_from,
                fencing
            );
        }
        if options.handler_timeout >= options.coordination.rebalance_timeout {
            let overridden = self
                .listeners
                .get(name)
                .is_some_and(|l| l.handler_timeout.is_some());
            let path: &[&str] = if overridden {
                &["listeners", name, "handler_timeout"]
            } else {
                &["coordination", "rebalance_timeout"]
            };
            return Err(self.invalid(
                path,
                format!(
                    "listener {name:?}: handler_timeout ({}) must be below rebalance_timeout ({}), or a slow handler would get its member fenced while it drains",
                    humantime::format_duration(options.handler_timeout),
                    humantime::format_duration(options.coordination.rebalance_timeout)
                ),
            ));
        }
        Ok(options)
    }

    /// A [`Publisher`](crate::producer::Publisher) for stream `prefix` on the configured Redis
    /// (standalone or cluster), with [`Config::publisher_options`]. One connection attempt, no
    /// retries.
    ///
    /// # Errors
    /// [`PublishError::Redis`](crate::producer::PublishError::Redis) when Redis cannot be
    /// reached; otherwise as [`Publisher::new`](crate::producer::Publisher::new) (for example
    /// [`PublishError::UnknownStream`](crate::producer::PublishError::UnknownStream)).
    pub async fn publisher(
        &self,
        prefix: &str,
    ) -> Result<crate::producer::Publisher, crate::producer::PublishError> {
        let conn = crate::connection::RedisConnection::connect(
            &self.redis.target(),
            crate::connection::DEFAULT_RESPONSE_TIMEOUT,
        )
        .await?;
        crate::producer::Publisher::new(conn, prefix, self.publisher_options(prefix)).await
    }

    /// Publisher settings for stream `prefix`: the defaults with `max_payload_bytes` of
    /// `[streams.<prefix>]` applied.
    pub fn publisher_options(&self, prefix: &str) -> PublisherOptions {
        let mut options = PublisherOptions::default();
        if let Some(max) = self.streams.get(prefix).and_then(|s| s.max_payload_bytes) {
            options.max_payload_bytes = max;
        }
        options
    }
}

impl Origin {
    fn parse_error(&self, error: &toml::de::Error) -> ConfigError {
        let offset = error.span().map(|s| s.start);
        let key = offset
            .and_then(|o| {
                locate::key_at(&self.text, o)
                    .map(|path| locate::dotted(&path))
                    .or_else(|| locate::key_on_line(&self.text, o))
            })
            .unwrap_or_default();
        let location = offset.map(|o| {
            let (line, column) = locate::line_column(&self.text, o);
            Location {
                file: self.file.clone(),
                line,
                column,
            }
        });
        let mut message = error.message().trim_end().to_owned();
        if message.ends_with("expected a duration") {
            message.push_str(" such as \"3s\", \"250ms\" or \"1m 30s\"");
        }
        ConfigError::Invalid {
            key,
            message,
            location,
        }
    }
}

#[cfg(test)]
mod tests;
