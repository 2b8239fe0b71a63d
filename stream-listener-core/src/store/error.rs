//! Errors of the Redis store.

use crate::coordinator::CoordinatorError;
use crate::keys::NameError;

/// Why a store operation failed. Every variant says what to do; none loses data (a failed
/// operation changes nothing, or leaves a change that the next attempt finishes).
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// Redis did not answer or refused a command ([`crate::connection::RedisFailure::of`] says
    /// which); the cause is the error's source.
    #[error(
        "Redis command failed; {}",
        crate::connection::RedisFailure::hint(.0, "check that Redis is up and reachable at the configured URL")
    )]
    Redis(#[from] redis::RedisError),
    /// A stream prefix or group name that cannot be used.
    #[error(transparent)]
    InvalidName(#[from] NameError),
    /// The stream metadata does not exist.
    #[error(
        "stream {prefix:?} does not exist (no key {key}); create it with `stream-listener stream create {prefix} --shards N`, or set `shards` for it in the config so it is created at startup"
    )]
    MissingStream {
        /// The stream prefix.
        prefix: String,
        /// The missing key.
        key: String,
    },
    /// The group hash is missing (lost metadata, or a group deleted under running members).
    #[error(
        "group {group:?} of stream {prefix:?} has no metadata ({key} is missing): Redis lost data, or the group was deleted under running members. It is not rebuilt from member reports: members whose stream has `shards` in the config provision it again by themselves; otherwise delete what is left of the group if `stream-listener group list {prefix}` still lists it (`stream-listener group delete {prefix} {group}`), create the stream if it is gone (`stream-listener stream create {prefix} --shards N`), and restart the members, which register the group again"
    )]
    MissingGroup {
        /// The stream prefix.
        prefix: String,
        /// The consumer group.
        group: String,
        /// The missing key.
        key: String,
    },
    /// A consumer group that is not registered on the stream.
    #[error(
        "consumer group {group:?} is not registered on stream {prefix:?}; start a listener for it (a listener registers its group when it starts); `stream-listener group list {prefix}` shows the groups that exist"
    )]
    UnknownGroup {
        /// The stream prefix.
        prefix: String,
        /// The consumer group.
        group: String,
    },
    /// A stored field is not valid JSON of the expected shape.
    #[error(
        "corrupt metadata in {key} field {field} (not JSON of the expected shape); {}",
        corrupt_field_advice(field)
    )]
    CorruptMetadata {
        /// The key.
        key: String,
        /// The hash field.
        field: String,
        /// The JSON error.
        source: serde_json::Error,
    },
    /// A stored value that is not JSON but should have another shape (a number, a list).
    #[error("corrupt metadata in {key}: {detail}; fix or delete the key by hand")]
    Malformed {
        /// The key.
        key: String,
        /// What is wrong.
        detail: String,
    },
    /// A key of docs/design.md §2 holds another Redis type than the store keeps there (it was
    /// overwritten by hand or by another program). Nothing was written.
    #[error(
        "{key} is a {found}, not a {expected}: it was overwritten by something else than stream-listener; restore it from a backup, or delete it (a missing key fails closed with its own error)"
    )]
    WrongType {
        /// The key.
        key: String,
        /// The type Redis reports (`TYPE`).
        found: String,
        /// The type the store keeps there (`hash`, `sorted set`, `list`).
        expected: &'static str,
    },
    /// Metadata written by another version of stream-listener.
    #[error(
        "metadata {key} has schema {found}, this build reads schema {supported}: run the same stream-listener version everywhere"
    )]
    UnknownSchema {
        /// The key.
        key: String,
        /// The stored schema.
        found: String,
        /// The schema this build reads.
        supported: u32,
    },
    /// The coordinator refused the request.
    #[error(transparent)]
    Coordinator(#[from] CoordinatorError),
    /// Redis did not answer a heartbeat in time (the member keeps its work until its lease ends).
    #[error(
        "heartbeat got no answer within {} ms; Redis is slow or unreachable",
        .0.as_millis()
    )]
    Timeout(std::time::Duration),
    /// Too many concurrent changes: the compare-and-set kept failing.
    #[error(
        "{what} kept conflicting with concurrent changes after {attempts} attempts; retry later"
    )]
    Contended {
        /// The operation.
        what: &'static str,
        /// Attempts made.
        attempts: u32,
    },
}

crate::report::readable_debug!(StoreError);

impl StoreError {
    pub(crate) fn corrupt(key: &str, field: &str, source: serde_json::Error) -> Self {
        StoreError::CorruptMetadata {
            key: key.to_owned(),
            field: field.to_owned(),
            source,
        }
    }

    pub(crate) fn malformed(key: &str, detail: impl Into<String>) -> Self {
        StoreError::Malformed {
            key: key.to_owned(),
            detail: detail.into(),
        }
    }
}

/// What to do about a corrupt field: the `retention` field has its own command (the key also
/// holds the stream's metadata, so deleting the key would lose the stream); any other field is
/// fixed by hand.
fn corrupt_field_advice(field: &str) -> &'static str {
    if field == super::retention::RETENTION_FIELD {
        "set it again with `stream-listener stream retention <prefix> ...`, or remove it with `stream-listener stream retention <prefix> --clear` (do not delete the key: it holds the stream's metadata)"
    } else {
        "fix or delete the key by hand (it is not rebuilt automatically)"
    }
}
