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
//! batch_size = 500
//! block = "2s"
//! max_attempts = 3
//! backoff = "200ms"
//! max_deliveries = 10
//! handler_timeout = "30s"
//! shutdown_timeout = "30s"
//! start_from = "earliest"                 # or "latest"
//! fencing = "strict"                      # or "acks"
//!
//! [observability]
//! listen = "127.0.0.1:9464"               # /metrics, /healthz, /readyz; absent: no listener
//! metrics_interval = "5s"                 # gauges re-set this often
//! ```
//!
//! Durations are humantime strings: `"250ms"`, `"3s"`, `"1m 30s"`.

mod error;
mod locate;
mod options;
mod sections;
mod validate;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;

use validate::{check_instance_id, check_listen_addr, check_redis_url};

pub use crate::runtime::DEFAULT_METRICS_INTERVAL;
pub use error::{ConfigError, Location};
pub use sections::ObservabilityConfig;
pub use sections::{CoordinationConfig, ListenerConfig, MemberConfig, RedisConfig, StreamConfig};
pub use validate::redact_url;

/// The config file read when `STREAM_LISTENER_CONFIG` is not set (in the working directory).
pub const DEFAULT_CONFIG_FILE: &str = "stream-listener.toml";
/// Environment variable naming the config file.
pub const CONFIG_ENV: &str = "STREAM_LISTENER_CONFIG";
/// Environment variable overriding `[redis] url`.
pub const REDIS_URL_ENV: &str = "REDIS_URL";
/// Environment variable overriding `[member] instance_id`, so pods sharing one file stay
/// distinct.
pub const INSTANCE_ID_ENV: &str = "STREAM_LISTENER_INSTANCE_ID";
/// Environment variable overriding `[observability] listen`, so processes sharing one file on
/// one host bind different ports.
pub const LISTEN_ENV: &str = "STREAM_LISTENER_OBSERVABILITY_LISTEN";
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
    /// `[observability]`: the HTTP listener (`/metrics`, `/healthz`, `/readyz`) and the metrics
    /// interval.
    #[serde(default)]
    pub observability: ObservabilityConfig,
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

    /// Applies `REDIS_URL`, `STREAM_LISTENER_INSTANCE_ID` and
    /// `STREAM_LISTENER_OBSERVABILITY_LISTEN` from `env` (empty values are ignored).
    ///
    /// # Errors
    /// [`ConfigError::Env`] for a `REDIS_URL` that does not parse, one given while the file
    /// configures `cluster_nodes`, an unusable instance id, or a listen address that is not an
    /// IP address and port.
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
        if let Some(listen) = env(LISTEN_ENV).filter(|v| !v.is_empty()) {
            check_listen_addr(&listen).map_err(|message| ConfigError::Env {
                var: LISTEN_ENV,
                value: listen.clone(),
                message,
            })?;
            self.observability.listen = Some(listen);
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
