//! How the tool fails: one line on standard error and an exit code (1 operation failed, 2 usage
//! error, 3 Redis unreachable), and connecting to Redis with those failures.

use stream_listener::core::internals::admin::AdminError;
use stream_listener::core::internals::connection::RedisFailure;
use stream_listener::core::internals::connection::{
    DEFAULT_RESPONSE_TIMEOUT, RedisConnection, RedisTarget, SentinelTarget,
};
use stream_listener::core::internals::report::Chain;

use crate::Cli;

/// A failure and its exit code.
pub(crate) enum Failure {
    /// Exit code 1.
    Operation(String),
    /// Exit code 2.
    Usage(String),
    /// Exit code 3.
    Unreachable(String),
}

impl Failure {
    pub(crate) fn code(&self) -> u8 {
        match self {
            Failure::Operation(_) => 1,
            Failure::Usage(_) => 2,
            Failure::Unreachable(_) => 3,
        }
    }

    pub(crate) fn message(&self) -> &str {
        match self {
            Failure::Operation(m) | Failure::Usage(m) | Failure::Unreachable(m) => m,
        }
    }
}

impl From<AdminError> for Failure {
    fn from(err: AdminError) -> Self {
        let text = one_line(&Chain(&err).to_string());
        if err.is_redis_unreachable() {
            Failure::Unreachable(format!(
                "lost the connection to Redis: {text}; check that Redis is up, then retry"
            ))
        } else {
            Failure::Operation(text)
        }
    }
}

pub(crate) fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// `redis://user:secret@host` → `redis://***@host`: never print a password.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}***{}", &url[..scheme + 3], &url[at..])
        }
        _ => url.to_owned(),
    }
}

/// Connects to the standalone server, cluster or Sentinel master the command line names.
pub(crate) async fn connect(cli: &Cli) -> Result<RedisConnection, Failure> {
    let sentinel = !cli.sentinels.is_empty() || cli.sentinel_master.is_some();
    let (target, shown) = if sentinel {
        let (Some(master), false) = (&cli.sentinel_master, cli.sentinels.is_empty()) else {
            return Err(Failure::Usage(
                "--sentinel and --sentinel-master (or REDIS_SENTINELS and REDIS_SENTINEL_MASTER) go together: the sentinels to ask and the master name they monitor".into(),
            ));
        };
        if !cli.cluster_nodes.is_empty() {
            return Err(Failure::Usage(
                "give either --sentinel (a master found through Redis Sentinel) or --cluster-node (a Redis Cluster), not both".into(),
            ));
        }
        let mut target = SentinelTarget::new(cli.sentinels.clone(), master.clone());
        target.master_auth = Some(cli.redis_url.clone());
        let shown: Vec<String> = cli.sentinels.iter().map(|n| redact(n)).collect();
        (
            RedisTarget::sentinel(target),
            format!("sentinel master {master} via {}", shown.join(", ")),
        )
    } else if cli.cluster_nodes.is_empty() {
        (
            RedisTarget::standalone(cli.redis_url.clone()),
            redact(&cli.redis_url),
        )
    } else {
        let shown: Vec<String> = cli.cluster_nodes.iter().map(|n| redact(n)).collect();
        (
            RedisTarget::cluster(cli.cluster_nodes.clone()),
            format!("cluster {}", shown.join(", ")),
        )
    };
    RedisConnection::connect(&target, DEFAULT_RESPONSE_TIMEOUT)
        .await
        .map_err(|err| {
            let text = one_line(&err.to_string());
            if sentinel && err.kind() == redis::ErrorKind::InvalidClientConfig {
                Failure::Usage(format!(
                    "cannot use {shown}: {text}; check --sentinel (REDIS_SENTINELS) and --sentinel-master (REDIS_SENTINEL_MASTER)"
                ))
            } else if err.kind() == redis::ErrorKind::InvalidClientConfig {
                Failure::Usage(format!(
                    "invalid Redis address {shown}: {text}; write it as redis://[user:password@]host:port[/db]"
                ))
            } else if RedisFailure::of(&err).is_unreachable() {
                Failure::Unreachable(format!(
                    "cannot reach Redis at {shown}: {text}; check that Redis is running and that --redis-url (or REDIS_URL, or --cluster-node, or --sentinel) points at it"
                ))
            } else {
                Failure::Operation(format!("cannot connect to Redis at {shown}: {text}"))
            }
        })
}

#[cfg(test)]
mod tests {
    use super::redact;

    #[test]
    fn passwords_are_never_printed() {
        assert_eq!(
            redact("redis://u:secret@host:6379/0"),
            "redis://***@host:6379/0"
        );
        assert_eq!(redact("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
    }
}
