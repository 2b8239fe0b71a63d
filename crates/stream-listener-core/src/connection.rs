//! Connections to Redis: standalone or Cluster, chosen by configuration, behind one type.
//!
//! Both kinds reconnect by themselves (redis-rs's `ConnectionManager` and cluster connection).
//! Every command of the coordinator and the admin operations touches keys of one hash slot
//! (DESIGN.md §2), so the same code runs on both.

use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Value};

/// Where Redis is. Its `Debug` hides passwords (`user:password@` and `pass=`).
#[derive(Clone, PartialEq, Eq)]
pub enum RedisTarget {
    /// One server: a `redis://` URL (`redis://user:password@host:port/db`).
    Standalone(String),
    /// A Redis Cluster: one or more seed node URLs.
    Cluster(Vec<String>),
}

impl std::fmt::Debug for RedisTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RedisTarget::Standalone(url) => {
                f.debug_tuple("Standalone").field(&redact_url(url)).finish()
            }
            RedisTarget::Cluster(nodes) => f
                .debug_tuple("Cluster")
                .field(&nodes.iter().map(|n| redact_url(n)).collect::<Vec<_>>())
                .finish(),
        }
    }
}

/// `url` with the password of `user:password@host` and of a `pass=` query parameter replaced by
/// `***`, for logs and errors.
pub fn redact_url(url: &str) -> String {
    let mut out = url.to_owned();
    if let Some(scheme_end) = out.find("://") {
        let rest = scheme_end + 3;
        if let Some(at) = out[rest..].find('@').map(|i| rest + i)
            && let Some(colon) = out[rest..at].find(':').map(|i| rest + i)
        {
            out.replace_range(colon + 1..at, "***");
        }
    }
    if let Some(start) = out.find("pass=").map(|i| i + 5) {
        let end = out[start..].find('&').map_or(out.len(), |i| start + i);
        out.replace_range(start..end, "***");
    }
    out
}

/// A cloneable connection to a standalone server or a cluster. Clones share the underlying
/// multiplexed connection; blocking commands need a connection of their own.
#[derive(Clone)]
pub enum RedisConnection {
    /// A standalone server.
    Standalone(ConnectionManager),
    /// A Redis Cluster.
    Cluster(ClusterConnection),
}

impl std::fmt::Debug for RedisConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RedisConnection::Standalone(_) => f.write_str("RedisConnection::Standalone"),
            RedisConnection::Cluster(_) => f.write_str("RedisConnection::Cluster"),
        }
    }
}

/// Response timeout of the coordinator's and admin's commands (none of them blocks).
pub const DEFAULT_RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);
/// Connection timeout.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

impl RedisConnection {
    /// Connects to `target` with `response_timeout` for every command.
    ///
    /// # Errors
    /// A [`redis::RedisError`] when the URL is invalid or no server answers in time.
    pub async fn connect(
        target: &RedisTarget,
        response_timeout: Duration,
    ) -> redis::RedisResult<Self> {
        match target {
            RedisTarget::Standalone(url) => {
                let client = redis::Client::open(url.as_str())?;
                let config = ConnectionManagerConfig::new()
                    .set_response_timeout(Some(response_timeout))
                    .set_connection_timeout(Some(DEFAULT_CONNECT_TIMEOUT))
                    .set_number_of_retries(1);
                let manager = ConnectionManager::new_with_config(client, config).await?;
                Ok(RedisConnection::Standalone(manager))
            }
            RedisTarget::Cluster(nodes) => {
                let client = ClusterClient::builder(nodes.clone())
                    .response_timeout(response_timeout)
                    .connection_timeout(DEFAULT_CONNECT_TIMEOUT)
                    .retries(2)
                    .build()?;
                Ok(RedisConnection::Cluster(
                    client.get_async_connection().await?,
                ))
            }
        }
    }

    /// Whether this is a cluster connection (multi-slot calls must then be split per slot).
    pub fn is_cluster(&self) -> bool {
        matches!(self, RedisConnection::Cluster(_))
    }
}

impl ConnectionLike for RedisConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            RedisConnection::Standalone(c) => c.req_packed_command(cmd),
            RedisConnection::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            RedisConnection::Standalone(c) => c.req_packed_commands(pipeline, offset, count),
            RedisConnection::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            RedisConnection::Standalone(c) => c.get_db(),
            RedisConnection::Cluster(c) => c.get_db(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_never_reach_debug_output() {
        let target = RedisTarget::Standalone("redis://u:s3cret@127.0.0.1:7711/0".into());
        assert_eq!(
            format!("{target:?}"),
            "Standalone(\"redis://u:***@127.0.0.1:7711/0\")"
        );
        assert_eq!(
            redact_url("redis+unix:///tmp/r.sock?db=1&pass=s3cret"),
            "redis+unix:///tmp/r.sock?db=1&pass=***"
        );
        assert_eq!(
            redact_url("redis://127.0.0.1:6379"),
            "redis://127.0.0.1:6379"
        );
        let cluster = RedisTarget::Cluster(vec!["redis://:pw@10.0.0.1:7000".into()]);
        assert!(!format!("{cluster:?}").contains("pw@"));
    }
}
