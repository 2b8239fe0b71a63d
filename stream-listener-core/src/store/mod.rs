//! The Redis-recorded coordinator (docs/design.md §2, §3, §5): stream metadata and group metadata
//! in Redis hashes, each change a compare-and-set on a `revision` field, and the heartbeat
//! transaction that runs the pure [`crate::coordinator`] on what it loads.
//!
//! Missing metadata, invalid JSON or an unknown `schema` fail closed with a typed error: metadata
//! is never rebuilt from what members report.

mod error;
mod group;
pub mod provision;
mod retention;
mod scripts;
mod stream;

pub use error::StoreError;
pub use group::{GroupStore, HeartbeatOutcome};
#[cfg(feature = "testing")]
pub use retention::TRIM_AS_EVAL;
pub(crate) use retention::{Bounds, check_age, check_len, trim_key};
pub use retention::{
    GroupLoss, KeyTrim, MAX_RETENTION_AGE_MS, MAX_RETENTION_LEN, RETENTION_FIELD, Retention,
    RetentionError, RetentionMode, TrimReason, ensure_retention, load_retention, write_retention,
};
pub use stream::{
    SCHEMA_VERSION, StreamCas, load_stream_metadata, read_metadata_version, write_stream_metadata,
};
