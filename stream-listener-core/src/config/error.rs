//! Errors of the configuration: each names the file, line and key it is about.

use std::fmt;
use std::path::PathBuf;

/// Where in a config file something is: file name as given, 1-based line and column (in
/// characters).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Location {
    /// The file as it was named (path or display name given to [`super::Config::from_toml_str`]).
    pub file: String,
    /// Line, from 1.
    pub line: usize,
    /// Column in characters, from 1.
    pub column: usize,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}", self.file, self.line, self.column)
    }
}

/// Why a configuration cannot be used (docs/design.md §11). Nothing was sent to Redis when one of
/// these is returned.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The config file could not be read (for a path named by `STREAM_LISTENER_CONFIG`, also when
    /// it does not exist; the default `stream-listener.toml` may be absent).
    #[error("cannot read config file {}{}: {source}", path.display(), env_note(*from_env))]
    Read {
        /// The path.
        path: PathBuf,
        /// Whether the path came from `STREAM_LISTENER_CONFIG`.
        from_env: bool,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A syntax error, an unknown key, a value of the wrong type or out of range. `key` is the
    /// dotted path of the offending key (`streams.orders.shards`), empty when the error is not
    /// about one key (a syntax error outside any key); `location` is `None` for a configuration
    /// built in code rather than read from a file.
    #[error("{}", describe_invalid(key, message, location.as_ref()))]
    Invalid {
        /// Dotted path of the key (`listeners.on_order.concurrency`).
        key: String,
        /// What is wrong and, where it helps, what to write instead.
        message: String,
        /// Where the key is in the file.
        location: Option<Location>,
    },
    /// An environment variable that overrides the file holds a value that cannot be used.
    #[error("environment variable {var}={value:?} cannot be used: {message}")]
    Env {
        /// The variable (`REDIS_URL`, `STREAM_LISTENER_INSTANCE_ID`).
        var: &'static str,
        /// Its value (a Redis URL with its password replaced by `***`).
        value: String,
        /// What is wrong.
        message: String,
    },
    /// A `[listeners.<name>]` section for a listener that is not registered in this program
    /// (found when `run()` compares the file with the `#[stream_listener]` functions).
    #[error(
        "{}[listeners.{name}] configures a listener that does not exist; the listeners of this program are: {}; fix the section name (a listener's name is its function name unless `name = \"...\"` is given)",
        location.as_ref().map(|l| format!("{l}: ")).unwrap_or_default(),
        if known.is_empty() { "(none)".to_owned() } else { known.join(", ") }
    )]
    UnknownListener {
        /// The name in the section header.
        name: String,
        /// Names of the registered listeners, sorted.
        known: Vec<String>,
        /// Where the section is.
        location: Option<Location>,
    },
}

crate::report::readable_debug!(ConfigError);

fn env_note(from_env: bool) -> &'static str {
    if from_env {
        " (named by STREAM_LISTENER_CONFIG)"
    } else {
        ""
    }
}

fn describe_invalid(key: &str, message: &str, location: Option<&Location>) -> String {
    let mut text = String::from("invalid config");
    if let Some(location) = location {
        text.push_str(&format!(" at {location}"));
    }
    if !key.is_empty() {
        text.push_str(&format!(", key `{key}`"));
    }
    text.push_str(": ");
    text.push_str(message);
    text
}

impl ConfigError {
    /// The dotted key path the error is about, when it is about one key.
    pub fn key(&self) -> Option<&str> {
        match self {
            ConfigError::Invalid { key, .. } if !key.is_empty() => Some(key),
            ConfigError::Env { var, .. } => Some(var),
            _ => None,
        }
    }

    /// Where in the file the error is, when it came from a file.
    pub fn location(&self) -> Option<&Location> {
        match self {
            ConfigError::Invalid { location, .. }
            | ConfigError::UnknownListener { location, .. } => location.as_ref(),
            _ => None,
        }
    }
}
