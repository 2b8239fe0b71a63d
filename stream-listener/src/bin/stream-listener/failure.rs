//! How the tool fails: one line on standard error and an exit code (1 operation failed, 2 usage
//! error, 3 Redis unreachable). Connecting, with those failures, is in [`crate::connect`].

use stream_listener::core::internals::acl;
use stream_listener::core::internals::admin::AdminError;
use stream_listener::core::internals::report::Chain;

/// A failure and its exit code.
pub(crate) enum Failure {
    /// Exit code 1.
    Operation(String),
    /// Exit code 2.
    Usage(String),
    /// Exit code 3.
    Unreachable(String),
    /// Exit code 1: Redis refused a command or key for the user's ACL rule.
    NoPermission(String),
}

impl Failure {
    pub(crate) fn code(&self) -> u8 {
        match self {
            Failure::Operation(_) | Failure::NoPermission(_) => 1,
            Failure::Usage(_) => 2,
            Failure::Unreachable(_) => 3,
        }
    }

    pub(crate) fn message(&self) -> &str {
        match self {
            Failure::Operation(m)
            | Failure::Usage(m)
            | Failure::Unreachable(m)
            | Failure::NoPermission(m) => m,
        }
    }

    /// The message, and for a refused permission on stream `prefix` the key patterns the admin
    /// tool's ACL rule needs for it (Redis's `NOPERM` names a command, never the key).
    pub(crate) fn message_for(&self, prefix: Option<&str>) -> String {
        match (self, prefix) {
            (Failure::NoPermission(m), Some(prefix)) => format!(
                "{m}; for stream {prefix} the admin tool's rule needs the key patterns {} and the commands of README \"ACL users\"",
                acl::admin_key_patterns(prefix).join(" ")
            ),
            _ => self.message().to_owned(),
        }
    }
}

/// The stream prefix the subcommand names (its `<PREFIX>` argument), if any.
pub(crate) fn prefix_of(matches: &clap::ArgMatches) -> Option<String> {
    let mut current = matches;
    while let Some((_, sub)) = current.subcommand() {
        current = sub;
    }
    current
        .try_get_one::<String>("prefix")
        .ok()
        .flatten()
        .cloned()
}

impl From<AdminError> for Failure {
    fn from(err: AdminError) -> Self {
        let text = one_line(&Chain(&err).to_string());
        if err.is_no_permission() {
            Failure::NoPermission(format!(
                "{text}; the Redis user lacks this permission: add it to the user's ACL rule (`ACL LOG` on the server names the refused command or key)"
            ))
        } else if err.is_redis_unreachable() {
            Failure::Unreachable(format!(
                "lost the connection to Redis: {text}; check that Redis is up, then retry"
            ))
        } else if err.is_invalid_argument() {
            Failure::Usage(text)
        } else {
            Failure::Operation(text)
        }
    }
}

pub(crate) fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}
