//! What a listener runs for each entry: the [`Handler`] trait, the [`Delivery`] it receives and
//! the [`HandlerError`] that decides between retry and dead letter (docs/design.md §8.8, outcomes).
//!
//! A handler may run more than once for one entry (at-least-once delivery; a cancelled attempt is
//! retried by the next owner), so it must be safe to run again: make its effects idempotent where
//! duplicates matter (docs/design.md §12).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use crate::headers::Headers;
use crate::model::{Epoch, ShardIndex};

/// A boxed error from a handler.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// The future a [`Handler`] returns.
pub type HandlerFuture = Pin<Box<dyn Future<Output = Result<(), HandlerError>> + Send + 'static>>;

/// One entry handed to a handler: its fields and its [`Metadata`] (reachable directly,
/// `delivery.entry_id`, `delivery.shard`, ..., through `Deref`).
///
/// The fields are shared (`Arc`), not copied, between the attempts of one entry: cloning a
/// `Delivery` copies only its metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    /// Where the entry came from and who is handling it.
    pub metadata: Metadata,
    /// Every field of the entry, in order (`key` and `payload` for entries of the publisher,
    /// then its headers as `h:<name>` fields: [`Delivery::headers`]).
    pub fields: Arc<[(String, Vec<u8>)]>,
}

/// Where an entry came from and who is handling it: part of every [`Delivery`], and the
/// metadata of the `Message` and `RawMessage` extractors (`crate::extract`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Metadata {
    /// The Redis entry id, e.g. `1700000000000-0`.
    pub entry_id: String,
    /// The shard index.
    pub shard: ShardIndex,
    /// The shard stream key, e.g. `{orders:3}`.
    pub stream_key: String,
    /// The partition key the publisher routed by (field `key`), when present and UTF-8.
    pub partition_key: Option<String>,
    /// How many times Redis delivered the entry to this group (the PEL delivery count; 1 for a
    /// first read). Re-reads and handovers raise it without any handler attempt:
    /// `max_deliveries` counts attempts, not this (docs/design.md §8.9).
    pub delivery_count: u64,
    /// Attempt number of this call within the current delivery, from 1.
    pub attempt: u32,
    /// The member running the handler (`<base>-m<k>`).
    pub member_id: String,
    /// Its member epoch when it was given the shard.
    pub member_epoch: Epoch,
    /// Whether the member still owns the shard ([`Ownership::still_owned`]); ends when the shard
    /// is revoked (its drain began) or lost (docs/design.md §13.3).
    pub ownership: Ownership,
}

/// A handler's view of its member's ownership of the shard it handles (docs/design.md §13.3),
/// for long handlers that should stop early once the shard is going elsewhere (KCL's
/// `leaseLost`). One token per shard ownership, cloned into every delivery of that ownership.
///
/// It ends when the shard's drain begins (revoked: the handler may still finish and be acked,
/// within the drain), when the shard task is stopped (a fencing status, the member's end) and at
/// shutdown. A lease that merely lapses (Redis unreachable) does not end it until the member
/// hears of its fate: the handler itself is cancelled at the lease's end anyway, but work a
/// handler handed the token to outside its future keeps running until then. A handler that
/// stops early should return a retryable error: the entry stays pending for the next owner.
///
/// Equality ignores it (two deliveries of the same entry are equal whoever owns the shard).
#[derive(Debug, Clone, Default)]
pub struct Ownership {
    /// `None`: not tied to a shard (a delivery built with [`Metadata::new`]): always owned.
    token: Option<tokio_util::sync::CancellationToken>,
}

impl Ownership {
    /// Ownership that ends when `token` is cancelled (for unit tests of handlers).
    pub fn new(token: tokio_util::sync::CancellationToken) -> Self {
        Ownership { token: Some(token) }
    }

    /// Whether the member still owns the shard: `false` once it is revoked or lost. One atomic
    /// load.
    pub fn still_owned(&self) -> bool {
        !self.token.as_ref().is_some_and(|t| t.is_cancelled())
    }

    /// Resolves when the ownership ends, by a revoke or a loss (never, for a delivery not tied
    /// to a shard): `select!` on it to stop a long handler early.
    pub async fn ended(&self) {
        match &self.token {
            Some(token) => token.cancelled().await,
            None => std::future::pending().await,
        }
    }

    /// The token that is cancelled when the ownership ends (a fresh, never-cancelled token for a
    /// delivery not tied to a shard), to hand to code that takes a `CancellationToken`.
    pub fn token(&self) -> tokio_util::sync::CancellationToken {
        self.token.clone().unwrap_or_default()
    }
}

impl PartialEq for Ownership {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for Ownership {}

impl Metadata {
    /// The metadata of entry `entry_id` with `fields` on shard `shard` (`stream_key`), handled
    /// by `member_id` at `member_epoch`: the partition key is read from the fields, the attempt
    /// is 1 and the delivery count 1 (set both fields for a re-delivery). Public so that a
    /// handler can be unit-tested with a [`Delivery`] of its own ([`Delivery::new`]).
    pub fn new(
        stream_key: &str,
        shard: ShardIndex,
        entry_id: String,
        fields: &[(String, Vec<u8>)],
        member_id: &str,
        member_epoch: Epoch,
    ) -> Self {
        Metadata {
            entry_id,
            shard,
            stream_key: stream_key.to_owned(),
            partition_key: field(fields, "key")
                .and_then(|k| std::str::from_utf8(k).ok())
                .map(str::to_owned),
            delivery_count: 1,
            attempt: 1,
            member_id: member_id.to_owned(),
            member_epoch,
            ownership: Ownership::default(),
        }
    }
}

impl std::ops::Deref for Delivery {
    type Target = Metadata;
    fn deref(&self) -> &Metadata {
        &self.metadata
    }
}

/// The value of the first field named `name` in `fields`.
pub(crate) fn field<'a>(fields: &'a [(String, Vec<u8>)], name: &str) -> Option<&'a [u8]> {
    fields
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_slice())
}

impl Delivery {
    /// A delivery of `fields` with `metadata` ([`Metadata::new`]), as the poller builds one per
    /// handler attempt; for unit tests of handlers.
    pub fn new(metadata: Metadata, fields: Arc<[(String, Vec<u8>)]>) -> Self {
        Delivery { metadata, fields }
    }

    /// The value of field `name`, if present.
    pub fn field(&self, name: &str) -> Option<&[u8]> {
        field(&self.fields, name)
    }

    /// The partition key the publisher routed by (field `key`), when it is UTF-8.
    pub fn partition_key(&self) -> Option<&str> {
        self.metadata.partition_key.as_deref()
    }

    /// The payload (field `payload`), as written by the publisher.
    pub fn payload(&self) -> Option<&[u8]> {
        self.field("payload")
    }

    /// The entry's headers: every field `h:<name>`, in order, as header `<name>`
    /// (docs/design.md §13.4). Copied out of the fields on each call; empty when there is none.
    pub fn headers(&self) -> Headers {
        Headers::from_fields(&self.fields)
    }

    /// Whether the member still owns this delivery's shard: `false` once the shard is revoked
    /// (its drain began) or lost ([`Ownership`], docs/design.md §13.3).
    pub fn still_owned(&self) -> bool {
        self.metadata.ownership.still_owned()
    }

    /// A token cancelled when the member's ownership of this delivery's shard ends
    /// ([`Ownership::token`]).
    pub fn ownership_token(&self) -> tokio_util::sync::CancellationToken {
        self.metadata.ownership.token()
    }
}

/// Why a handler did not succeed; decides what happens to the entry.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandlerError {
    /// Retried in place with backoff up to `max_attempts`, then dead-lettered. The handler's
    /// error is the source: a dead letter's `error` field and the logs print it with its causes
    /// (docs/design.md §8.14).
    #[error(transparent)]
    Retryable(BoxError),
    /// Dead-lettered at once: retrying cannot help.
    #[error("non-retryable: {0}")]
    NonRetryable(#[source] BoxError),
    /// The payload could not be decoded: dead-lettered at once with reason `decode`.
    #[error("payload could not be decoded: {0}")]
    Decode(String),
    /// A dependency is down ([`HandlerError::pause_shard`]): the shard reads nothing and starts
    /// no attempt for `duration`, then tries the same entry again. Not a failed attempt (it does
    /// not count toward `max_attempts` or `max_deliveries`) and never a dead letter
    /// (docs/design.md §14.4).
    #[error("dependency unavailable: shard paused for {duration:?}")]
    PauseShard {
        /// How long to pause, as asked (the poller clamps it to
        /// [`HandlerError::MIN_SHARD_PAUSE`]..=[`HandlerError::MAX_SHARD_PAUSE`]).
        duration: std::time::Duration,
    },
}

impl HandlerError {
    /// A retryable error.
    pub fn retryable(error: impl Into<BoxError>) -> Self {
        HandlerError::Retryable(error.into())
    }

    /// A non-retryable error.
    pub fn non_retryable(error: impl Into<BoxError>) -> Self {
        HandlerError::NonRetryable(error.into())
    }

    /// The shortest pause [`HandlerError::pause_shard`] makes: a zero duration would run the
    /// handler again at once, in a hot loop.
    pub const MIN_SHARD_PAUSE: std::time::Duration = std::time::Duration::from_millis(10);

    /// The longest pause [`HandlerError::pause_shard`] makes: a longer one is cut to this (the
    /// handler can ask again when the entry is retried). The heartbeats keep the shard
    /// meanwhile, so the limit is independent of the lease.
    pub const MAX_SHARD_PAUSE: std::time::Duration = std::time::Duration::from_secs(3600);

    /// A dependency is down: pause this shard (reads and attempts) for `duration`, keep the entry
    /// pending and try it again after, in place (docs/design.md §14.4). It is not a failed
    /// attempt and never dead-letters the entry; the member's other shards keep going. A revoke
    /// or a shutdown during the pause ends it: the entry stays pending for the next owner.
    /// With `ordering = "key"` or `"none"` the entries already running on the shard finish
    /// during the pause and none starts; from a batch handler (in a `BatchError`) the batch
    /// runs again after the pause, with the same attempt number.
    /// `duration` is clamped to [`HandlerError::MIN_SHARD_PAUSE`]..=
    /// [`HandlerError::MAX_SHARD_PAUSE`].
    pub fn pause_shard(duration: std::time::Duration) -> Self {
        HandlerError::PauseShard { duration }
    }
}

/// The work a listener does per entry. Implemented for every
/// `Fn(Delivery) -> impl Future<Output = Result<(), HandlerError>>`.
pub trait Handler: Send + Sync + 'static {
    /// Handles one entry. Runs under `handler_timeout`; may be cancelled when the member loses
    /// the shard (lease end, fencing), and then runs again elsewhere.
    fn handle(&self, delivery: Delivery) -> HandlerFuture;
}

impl<F, Fut> Handler for F
where
    F: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), HandlerError>> + Send + 'static,
{
    fn handle(&self, delivery: Delivery) -> HandlerFuture {
        Box::pin(self(delivery))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::Chain;

    /// A handler's error with a cause of its own, as a client library returns one.
    #[derive(Debug, thiserror::Error)]
    #[error("charging the card failed")]
    struct ChargeFailed(#[source] std::io::Error);

    fn charge_failed() -> ChargeFailed {
        ChargeFailed(std::io::Error::other("connection reset by peer"))
    }

    #[tokio::test]
    async fn an_ownership_ends_when_its_token_is_cancelled_and_an_untied_one_never() {
        let token = tokio_util::sync::CancellationToken::new();
        let ownership = Ownership::new(token.clone());
        let short = std::time::Duration::from_millis(20);
        assert!(ownership.still_owned());
        assert!(
            tokio::time::timeout(short, ownership.ended())
                .await
                .is_err()
        );
        token.cancel();
        assert!(!ownership.still_owned());
        assert!(ownership.token().is_cancelled());
        tokio::time::timeout(short, ownership.ended())
            .await
            .expect("ended once the token is cancelled");
        let untied = Ownership::default();
        assert!(untied.still_owned());
        assert!(!untied.token().is_cancelled());
        assert!(tokio::time::timeout(short, untied.ended()).await.is_err());
    }

    /// What a dead letter's `error` field and the retry log print (`poller/entries.rs`): the
    /// handler's error with its causes, each once.
    #[test]
    fn a_handler_errors_causes_reach_the_dead_letter_text() {
        let retryable = HandlerError::retryable(charge_failed());
        assert_eq!(
            Chain(&retryable).to_string(),
            "charging the card failed: connection reset by peer"
        );
        let non_retryable = HandlerError::non_retryable(charge_failed());
        assert_eq!(
            Chain(&non_retryable).to_string(),
            "non-retryable: charging the card failed: connection reset by peer"
        );
        assert_eq!(
            Chain(&HandlerError::Decode("expected value at line 1".into())).to_string(),
            "payload could not be decoded: expected value at line 1"
        );
    }
}
