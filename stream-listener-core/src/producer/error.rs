//! Errors of the producer.

use std::time::Duration;

use crate::keys::NameError;
use crate::store::StoreError;

/// Why a publish (or building a [`super::Publisher`]) failed. Every variant says what to do.
///
/// Errors found before anything is sent (bad options, payload that does not serialize or is too
/// large, a field named `key`, an invalid header name) write nothing. A [`PublishError::Redis`] or
/// [`PublishError::ShardMissing`] of a batch can come after some of its entries were appended:
/// retrying the batch may then append those again (at-least-once, docs/design.md §12).
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum PublishError {
    /// The stream prefix is empty, too long or contains characters the key layout cannot carry.
    #[error("invalid stream prefix")]
    InvalidPrefix(#[from] NameError),
    /// A [`super::PublisherOptions`] value that cannot work.
    #[error("invalid publisher options: {detail}")]
    InvalidOptions {
        /// What is wrong and what to set instead.
        detail: String,
    },
    /// No stream metadata for this prefix.
    #[error(
        "stream {prefix:?} does not exist (no key {key}); create it with `stream-listener stream create {prefix} --shards N`, or set `shards` for it in the config so it is created at startup"
    )]
    UnknownStream {
        /// The stream prefix.
        prefix: String,
        /// The missing metadata key `sl:{<prefix>}:stream`.
        key: String,
    },
    /// The payload could not be serialized to JSON (for example a map with non-string keys).
    #[error(
        "payload{} failed to serialize to JSON; make its Serialize implementation succeed, or publish bytes with publish_raw",
        at_index(*.index)
    )]
    Serialize {
        /// Position in the batch (`None` for a single publish).
        index: Option<usize>,
        /// The serde_json error.
        source: serde_json::Error,
    },
    /// The payload is larger than `max_payload_bytes`: refused before any `XADD`.
    #[error(
        "payload{} is {size} bytes, over the limit of {limit} bytes (max_payload_bytes); make it smaller (store large blobs elsewhere and publish a reference) or raise max_payload_bytes",
        at_index(*.index)
    )]
    PayloadTooLarge {
        /// Position in the batch (`None` for a single publish).
        index: Option<usize>,
        /// Its size in bytes: the JSON bytes (plus the header fields' names and values, for
        /// a publish with headers or a trace context), or for `publish_raw` the sum of field
        /// names and values.
        size: usize,
        /// `max_payload_bytes`.
        limit: usize,
    },
    /// A raw field that would clash with the entry's own `key` field.
    #[error(
        "raw field {field:?} is reserved: every entry carries the partition key in field `key`; rename the field"
    )]
    ReservedField {
        /// The field name.
        field: String,
    },
    /// The stream has no ACTIVE shard (`shardCount` 0: it was fully drained).
    #[error(
        "stream {prefix:?} has no shards to publish to (shardCount 0 at metadataVersion {metadata_version}: it was fully drained); scale it out with `stream-listener stream scale {prefix} N`, after `stream-listener stream retire {prefix}` has finished the drain (or `stream-listener stream scale {prefix} --cancel` abandons it while the shards are still DRAINING)"
    )]
    NoShards {
        /// The stream prefix.
        prefix: String,
        /// The metadata version that says so.
        metadata_version: u64,
    },
    /// The stream metadata contradicts itself (a shard below `shardCount` is not ACTIVE, or the
    /// prefix differs): publishing is refused rather than guessed.
    #[error(
        "stream metadata of {prefix:?} is inconsistent: {detail}; finish or cancel the running resharding (`stream-listener stream scale`), or repair the metadata"
    )]
    InconsistentMetadata {
        /// The stream prefix.
        prefix: String,
        /// What is wrong.
        detail: String,
    },
    /// The routing metadata could not be refreshed and its lease has run out: publishing with it
    /// could append to a shard that is being retired, so publish fails closed (docs/design.md §9,
    /// §10).
    #[error(
        "routing of stream {prefix:?} is {age:?} old, past its lease of {lease:?} (routing_lease), and refreshing it {}; check that Redis is reachable, then retry",
        if source.is_some() { "failed" } else { "answered only after the lease had run out (Redis too slow)" }
    )]
    RoutingLeaseExpired {
        /// The stream prefix.
        prefix: String,
        /// Time since the last successful metadata read was sent.
        age: Duration,
        /// `routing_lease`.
        lease: Duration,
        /// The Redis error of the refresh; `None` when the read answered, but too late.
        #[source]
        source: Option<redis::RedisError>,
    },
    /// `XADD ... NOMKSTREAM` found no stream for a shard the freshly refreshed metadata still
    /// routes to: the shard stream was deleted although its shard is ACTIVE.
    #[error(
        "shard stream {stream_key} does not exist although metadataVersion {metadata_version} lists shard {shard} as ACTIVE; it was deleted outside stream-listener and nothing was appended: re-create it with the consumer group of every registered group (`XGROUP CREATE {stream_key} <group> 0 MKSTREAM`), then retry"
    )]
    ShardMissing {
        /// The shard stream key.
        stream_key: String,
        /// The shard index.
        shard: u32,
        /// The metadata version routed with.
        metadata_version: u64,
    },
    /// The stream metadata exists but cannot be read (corrupt JSON, another schema version).
    #[error(transparent)]
    Metadata(StoreError),
    /// [`crate::config::Config::publisher`] could not connect to Redis (not running, wrong
    /// address, TLS or authentication refused: the source says which). Nothing was sent.
    #[error(
        "cannot connect to Redis at {target}: check that Redis is running and that [redis] url / cluster_nodes (or REDIS_URL) points at it; nothing was published"
    )]
    Connect {
        /// The URL or cluster nodes (passwords replaced by `***`).
        target: String,
        /// The connection error.
        #[source]
        source: redis::RedisError,
    },
    /// Redis did not answer or refused a command (the cause is the error's source).
    #[error(
        "Redis command failed; {}, then retry (a retried batch may append some entries twice)",
        crate::connection::RedisFailure::hint(.0, "check that Redis is up and reachable")
    )]
    Redis(#[from] redis::RedisError),
    /// A header name the publisher refuses (docs/design.md §13.4): empty, or with a control
    /// character (`char::is_control`). Refused before any `XADD`: nothing was written.
    #[error(
        "header name {name:?}{} {problem}; header names must be non-empty text without control characters (they are the entry field `h:<name>`, read as text by consumers in any language)",
        at_index(*.index)
    )]
    InvalidHeaderName {
        /// Position in the batch (`None` for a single publish).
        index: Option<usize>,
        /// The refused name.
        name: String,
        /// What is wrong with it: `is empty` or `contains a control character`.
        problem: &'static str,
    },
    /// The stream the config declares (`[streams.<prefix>] shards = N`) does not exist and could
    /// not be created ([`crate::config::Config::publisher`]); the source says why (Redis failed,
    /// or too many shards declared).
    #[error("cannot create stream {prefix:?} declared in the config")]
    Provision {
        /// The stream prefix.
        prefix: String,
        /// Why.
        #[source]
        source: crate::store::provision::ProvisionError,
    },
    /// `min_replica_acks > 0` and fewer replicas acknowledged the write within
    /// `replica_ack_timeout` (`WAIT`, README "Waiting for replicas"). The entries **were**
    /// appended on the master (their ids are in `published`) and consumers will see them; a
    /// failover to a replica that lacks them would lose them. Publishing them again may append
    /// duplicates.
    #[error(
        "{} entries were appended but only {acked} of {wanted} replicas acknowledged them within {}; they are on the master and will be delivered unless a failover to a replica that lacks them loses them. Publishing again may append duplicates; check the replicas (INFO replication)",
        published.len(), humantime::format_duration(*timeout)
    )]
    NotReplicated {
        /// Where the entries were appended.
        published: Vec<super::Published>,
        /// Replicas that acknowledged (the smallest count of a batch's pipelines).
        acked: u32,
        /// `min_replica_acks`.
        wanted: u32,
        /// `replica_ack_timeout`.
        timeout: Duration,
    },
    /// Redis refused a command or key for the user's ACL rule (`NOPERM`, README "ACL users"):
    /// nothing was written by the refused command. Redis's message names a refused command but
    /// never a key; this names both.
    #[error(
        "the Redis user may not run {command} on {key}: add {rule} to the producer's ACL rule (README \"ACL users\")"
    )]
    NoPermission {
        /// The refused command (`XADD`, `WAIT`, `HGETALL`).
        command: String,
        /// The key, or keys, it was sent for.
        key: String,
        /// What to add: `+<command>` when the command is refused, else the key pattern.
        rule: String,
        /// Redis's error.
        #[source]
        source: redis::RedisError,
    },
}

crate::report::readable_debug!(PublishError);

impl From<StoreError> for PublishError {
    fn from(error: StoreError) -> Self {
        match error {
            StoreError::Redis(e) => PublishError::Redis(e),
            StoreError::InvalidName(e) => PublishError::InvalidPrefix(e),
            StoreError::MissingStream { prefix, key } => {
                PublishError::UnknownStream { prefix, key }
            }
            other => PublishError::Metadata(other),
        }
    }
}

impl PublishError {
    /// `error` of `command` (as sent) on `key` as [`PublishError::NoPermission`] when Redis
    /// refused it for the ACL (`pattern`: the key pattern that grants `key`), else
    /// [`PublishError::Redis`].
    pub(crate) fn from_redis(
        error: redis::RedisError,
        command: &str,
        key: &str,
        pattern: &str,
    ) -> Self {
        if crate::connection::RedisFailure::of(&error)
            != crate::connection::RedisFailure::NoPermission
        {
            return PublishError::Redis(error);
        }
        let (command, rule) = match crate::acl::refused_command(&error) {
            Some(refused) => {
                let rule = format!("+{}", refused.to_lowercase().replace(' ', "|"));
                (refused, rule)
            }
            None => (command.to_owned(), pattern.to_owned()),
        };
        PublishError::NoPermission {
            command,
            key: key.to_owned(),
            rule,
            source: error,
        }
    }
}

fn at_index(index: Option<usize>) -> String {
    index.map_or_else(String::new, |i| format!(" of message #{i} of the batch"))
}
