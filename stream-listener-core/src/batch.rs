//! Batch handlers (docs/design.md §14.2): a listener function that takes the decoded entries of
//! one shard read at once, [`Batch<T>`], and says which of them failed with a [`BatchError`].
//!
//! The poller decodes every entry first ([`BatchHandler::decode`]): an entry that does not decode
//! is dead-lettered with reason `decode` and left out of the batch, so it never holds the batch
//! back. Then it calls the handler ([`BatchHandler::call`]) with the rest, in entry order:
//!
//! | the handler returns | what happens |
//! | --- | --- |
//! | `()`, `Ok(())` | every entry of the batch is acked |
//! | `Err(BatchError::at(i, e))` | entries `0..i` are acked; entry `i` failed with `e`: the entries from `i` on are retried as one batch with backoff; when `max_attempts` is used up (or `e` is non-retryable), entry `i` alone is dead-lettered and the entries after it go on as a fresh batch |
//! | `Err(BatchError::all(e))`, `Err(e)` of any other error type | the whole batch is retried with backoff; when `max_attempts` is used up (or `e` is non-retryable), every entry of the batch is dead-lettered |
//! | `e` is [`HandlerError::pause_shard(d)`](HandlerError::pause_shard) (with `at` or `all`) | no failed attempt: the shard is paused for `d`, then the batch (from `i` with `at`) runs again with the same attempt number; nothing is dead-lettered for it |
//!
//! An index out of range is a bug in the handler: it counts as [`BatchError::all`] with its
//! error, and is logged.

use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;

use crate::extract::{FromDelivery, IntoHandlerResult};
use crate::handler::{BoxError, Delivery, HandlerError, Metadata};

/// The decoded entries of one shard read, in entry order, each with its [`Metadata`]
/// (entry id, shard, delivery count, attempt, ...). `T` is the per-entry extractor:
/// `Json<U>`, `Message<U>`, `RawMessage`, ... ([`crate::extract`]).
///
/// Positions are the ones [`BatchError::at`] takes: `batch.items()[i]` is entry `i`. Entries
/// that did not decode are not in it (they are dead-lettered before the batch is built).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch<T> {
    items: Vec<T>,
    metadata: Vec<Metadata>,
}

impl<T> Batch<T> {
    /// A batch of `entries` (each value with its metadata), in this order; for unit tests of
    /// batch handlers (the poller builds the real ones).
    pub fn new(entries: Vec<(T, Metadata)>) -> Self {
        let (items, metadata) = entries.into_iter().unzip();
        Batch { items, metadata }
    }

    /// How many entries the batch has (at least 1 when the poller calls a handler).
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether the batch has no entry.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// The decoded entries, in entry order.
    pub fn items(&self) -> &[T] {
        &self.items
    }

    /// The decoded entries, in entry order, without their metadata.
    pub fn into_items(self) -> Vec<T> {
        self.items
    }

    /// The metadata of entry `index` (its position in the batch); `None` past the end.
    pub fn metadata(&self, index: usize) -> Option<&Metadata> {
        self.metadata.get(index)
    }

    /// The decoded entries, in entry order.
    pub fn iter(&self) -> std::slice::Iter<'_, T> {
        self.items.iter()
    }

    /// Each decoded entry with its metadata, in entry order.
    pub fn entries(&self) -> impl ExactSizeIterator<Item = (&T, &Metadata)> {
        self.items.iter().zip(self.metadata.iter())
    }

    /// Each decoded entry with its metadata, in entry order, owned.
    pub fn into_entries(self) -> Vec<(T, Metadata)> {
        self.items.into_iter().zip(self.metadata).collect()
    }
}

impl<T> IntoIterator for Batch<T> {
    type Item = T;
    type IntoIter = std::vec::IntoIter<T>;
    fn into_iter(self) -> Self::IntoIter {
        self.items.into_iter()
    }
}

impl<'a, T> IntoIterator for &'a Batch<T> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;
    fn into_iter(self) -> Self::IntoIter {
        self.items.iter()
    }
}

/// Why a batch handler did not succeed (see the module docs for the outcomes).
///
/// Made by [`BatchError::at`] (one entry failed: the ones before it are done),
/// [`BatchError::all`] (the whole batch failed), or from any error through `?`
/// (`From<E>`, the whole batch). A [`HandlerError`] keeps its kind:
/// `BatchError::at(i, HandlerError::non_retryable(e))` dead-letters entry `i` at once.
///
/// It does not implement `std::error::Error` on purpose: then `From<E>` for every error type
/// (so that `?` works in a handler) would overlap the blanket `From<T> for T`. Its `Display`
/// prints the error with the index.
#[derive(Debug)]
pub struct BatchError {
    /// The failed entry's position in the batch, or `None` for the whole batch.
    pub(crate) index: Option<usize>,
    /// The error, with its kind (retryable, non-retryable, decode, shard pause).
    pub(crate) error: HandlerError,
}

impl BatchError {
    /// Entry `index` of the batch failed with `error` (a [`HandlerError`] keeps its kind; any
    /// other error is retryable); the entries before it are handled and acked, the entries from
    /// it on are retried. An `index` at or past the batch's length is treated as
    /// [`BatchError::all`] (and logged).
    pub fn at(index: usize, error: impl Into<BoxError>) -> Self {
        BatchError {
            index: Some(index),
            error: handler_error(error),
        }
    }

    /// The whole batch failed with `error` (a [`HandlerError`] keeps its kind; any other error
    /// is retryable): retried whole, or every entry dead-lettered.
    pub fn all(error: impl Into<BoxError>) -> Self {
        BatchError {
            index: None,
            error: handler_error(error),
        }
    }

    /// The failed entry's position, `None` for the whole batch.
    pub fn index(&self) -> Option<usize> {
        self.index
    }

    /// The error.
    pub fn error(&self) -> &HandlerError {
        &self.error
    }
}

impl std::fmt::Display for BatchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.index {
            Some(index) => write!(f, "batch entry {index} failed: {}", self.error),
            None => write!(f, "batch failed: {}", self.error),
        }
    }
}

impl<E: Into<BoxError>> From<E> for BatchError {
    fn from(error: E) -> Self {
        BatchError::all(error)
    }
}

/// `error` as a [`HandlerError`]: one already is (its kind kept), any other is retryable.
fn handler_error(error: impl Into<BoxError>) -> HandlerError {
    match Err::<(), BoxError>(error.into()).into_handler_result() {
        Err(error) => error,
        // `into_handler_result` of an `Err` is always an `Err`.
        Ok(()) => HandlerError::retryable("batch handler failed"),
    }
}

/// What a batch listener function may return: `()`, `Result<(), BatchError>` or
/// `Result<(), E>` for any error `E` (the whole batch failed).
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be the return type of a batch listener function",
    label = "return `()`, `Result<(), BatchError>` or `Result<(), E>`",
    note = "return `Err(BatchError::at(i, e))` when entry `i` failed (the ones before it are acked), any other error retries the whole batch"
)]
pub trait IntoBatchResult {
    /// The outcome.
    ///
    /// # Errors
    /// The function's error as a [`BatchError`] (any error but a `BatchError` fails the whole
    /// batch).
    fn into_batch_result(self) -> Result<(), BatchError>;
}

impl IntoBatchResult for () {
    fn into_batch_result(self) -> Result<(), BatchError> {
        Ok(())
    }
}

impl IntoBatchResult for Result<(), BatchError> {
    fn into_batch_result(self) -> Result<(), BatchError> {
        self
    }
}

impl<E: Into<BoxError>> IntoBatchResult for Result<(), E> {
    fn into_batch_result(self) -> Result<(), BatchError> {
        self.map_err(BatchError::all)
    }
}

/// The future a [`BatchHandler`] returns.
pub type BatchFuture = Pin<Box<dyn Future<Output = Result<(), BatchError>> + Send + 'static>>;

/// The work a batch listener does per batch (docs/design.md §14.2). Implemented for every
/// `Fn(Batch<T>) -> impl Future<Output = R>` with `T: FromDelivery` and `R: IntoBatchResult`;
/// `T` is a parameter of the trait (as axum's `Handler<T, S>`) so that one function type has
/// one extractor type. Object-safe: `dyn BatchHandler<T>`.
pub trait BatchHandler<T>: Send + Sync + 'static {
    /// Decodes one entry for the batch.
    ///
    /// # Errors
    /// The extractor's error, [`HandlerError::Decode`] for an entry that does not have the
    /// expected shape: the poller dead-letters it (reason `decode`) and leaves it out of the
    /// batch.
    fn decode(&self, delivery: &Delivery) -> Result<T, HandlerError>;

    /// Handles one batch. Runs under `handler_timeout` on one worker; may be cancelled when
    /// the member loses the shard, and then runs again elsewhere (with the entries not acked).
    fn call(&self, batch: Batch<T>) -> BatchFuture;
}

impl<F, T, Fut, R> BatchHandler<T> for F
where
    F: Fn(Batch<T>) -> Fut + Send + Sync + 'static,
    T: FromDelivery + Send + 'static,
    Fut: Future<Output = R> + Send + 'static,
    R: IntoBatchResult,
{
    fn decode(&self, delivery: &Delivery) -> Result<T, HandlerError> {
        T::from_delivery(delivery)
    }

    fn call(&self, batch: Batch<T>) -> BatchFuture {
        let future = self(batch);
        Box::pin(async move { future.await.into_batch_result() })
    }
}

/// The call of a batch handler on its decoded batch, not made yet (the poller makes it on a
/// worker, a panic in it caught).
pub(crate) type BatchCall<'a> = Box<dyn FnOnce() -> BatchFuture + Send + 'a>;

/// One attempt of a batch, decoded: the entries that did not decode (their positions in the
/// deliveries given, with the error) and the handler's call for the others (not made yet).
pub(crate) struct Prepared<'a> {
    /// Positions (in the deliveries given) of the entries in the batch, in order: entry `i` of
    /// the batch is delivery `kept[i]`.
    pub(crate) kept: Vec<usize>,
    /// Deliveries that did not decode: (position, error).
    pub(crate) failed: Vec<(usize, HandlerError)>,
    /// The handler's call with the batch of the kept entries; `None` when none was kept.
    pub(crate) run: Option<BatchCall<'a>>,
}

/// A [`BatchHandler`] with its extractor type erased, as the poller holds it.
pub(crate) trait ErasedBatchHandler: Send + Sync + 'static {
    /// Decodes `deliveries` and calls the handler with those that decoded.
    fn prepare(&self, deliveries: Vec<Delivery>) -> Prepared<'_>;
}

struct Typed<H, T> {
    handler: H,
    _extractor: PhantomData<fn() -> T>,
}

impl<H: BatchHandler<T>, T: Send + 'static> ErasedBatchHandler for Typed<H, T> {
    fn prepare(&self, deliveries: Vec<Delivery>) -> Prepared<'_> {
        let mut kept = Vec::with_capacity(deliveries.len());
        let mut failed = Vec::new();
        let mut entries = Vec::with_capacity(deliveries.len());
        for (position, delivery) in deliveries.into_iter().enumerate() {
            match self.handler.decode(&delivery) {
                Ok(value) => {
                    kept.push(position);
                    entries.push((value, delivery.metadata));
                }
                Err(error) => failed.push((position, error)),
            }
        }
        let handler = &self.handler;
        let run = (!entries.is_empty())
            .then(|| Box::new(move || handler.call(Batch::new(entries))) as BatchCall<'_>);
        Prepared { kept, failed, run }
    }
}

/// The handler of a listener, per entry or per batch: what the member's shard tasks run.
#[derive(Clone)]
pub(crate) enum AnyHandler {
    /// [`crate::handler::Handler`]: one entry per call.
    Entry(Arc<dyn crate::handler::Handler>),
    /// [`BatchHandler`]: the entries of one read per call.
    Batch(Arc<dyn ErasedBatchHandler>),
}

impl AnyHandler {
    /// `handler` with its extractor type erased.
    pub(crate) fn batch<T: Send + 'static>(handler: impl BatchHandler<T>) -> Self {
        AnyHandler::Batch(Arc::new(Typed {
            handler,
            _extractor: PhantomData,
        }))
    }
}

/// A listener's handler, per entry ([`crate::handler::Handler`]) or per batch
/// ([`BatchHandler`]), with its types erased: what [`Listener::with_handler`] runs. The
/// facade's registrations make one at startup from the application's states (docs/design.md
/// §14.1, §14.2).
///
/// [`Listener::with_handler`]: crate::member::Listener::with_handler
#[derive(Clone)]
pub struct ListenerHandler(pub(crate) AnyHandler);

impl ListenerHandler {
    /// A handler of one entry per call.
    pub fn each(handler: impl crate::handler::Handler) -> Self {
        ListenerHandler(AnyHandler::Entry(Arc::new(handler)))
    }

    /// A handler of the decoded entries of one read per call.
    pub fn batch<T: Send + 'static>(handler: impl BatchHandler<T>) -> Self {
        ListenerHandler(AnyHandler::batch(handler))
    }

    /// Whether it handles batches.
    pub fn is_batch(&self) -> bool {
        matches!(self.0, AnyHandler::Batch(_))
    }
}

/// A handler shared with other listeners (or made once by a registration).
impl From<Arc<dyn crate::handler::Handler>> for ListenerHandler {
    fn from(handler: Arc<dyn crate::handler::Handler>) -> Self {
        ListenerHandler(AnyHandler::Entry(handler))
    }
}

impl std::fmt::Debug for ListenerHandler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = if self.is_batch() { "batch" } else { "each" };
        f.debug_tuple("ListenerHandler").field(&kind).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::extract::Json;

    fn delivery(id: &str, payload: &str) -> Delivery {
        let fields: Arc<[(String, Vec<u8>)]> =
            vec![("payload".to_owned(), payload.as_bytes().to_vec())].into();
        Delivery::new(
            Metadata::new("{orders:0}", 0, id.to_owned(), &fields, "m-m0", 1),
            fields,
        )
    }

    #[derive(Debug, thiserror::Error)]
    #[error("downstream unavailable")]
    struct Downstream;

    #[test]
    fn errors_keep_their_kind_and_index() {
        let at = BatchError::at(2, HandlerError::non_retryable(Downstream));
        assert_eq!(at.index(), Some(2));
        assert!(matches!(at.error(), HandlerError::NonRetryable(_)));
        assert_eq!(
            at.to_string(),
            "batch entry 2 failed: non-retryable: downstream unavailable"
        );
        let plain = BatchError::at(0, Downstream);
        assert!(matches!(plain.error(), HandlerError::Retryable(_)));
        let all: BatchError = Downstream.into();
        assert_eq!(all.index(), None);
        assert_eq!(all.to_string(), "batch failed: downstream unavailable");
        let result: Result<(), Downstream> = Err(Downstream);
        assert_eq!(result.into_batch_result().unwrap_err().index(), None);
        assert!(().into_batch_result().is_ok());
        let given: Result<(), BatchError> = Err(BatchError::at(1, "x"));
        assert_eq!(given.into_batch_result().unwrap_err().index(), Some(1));
    }

    #[derive(Debug, serde::Deserialize, PartialEq)]
    struct Order {
        id: u32,
    }

    #[tokio::test]
    async fn undecodable_entries_are_left_out_and_the_rest_keep_their_order() {
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let record = seen.clone();
        let handler = AnyHandler::batch(move |batch: Batch<Json<Order>>| {
            let ids: Vec<(u32, String)> = batch
                .entries()
                .map(|(Json(order), meta)| (order.id, meta.entry_id.clone()))
                .collect();
            record.lock().unwrap().push(ids);
            async { Ok::<(), BatchError>(()) }
        });
        let AnyHandler::Batch(handler) = handler else {
            unreachable!("made as a batch handler")
        };
        let prepared = handler.prepare(vec![
            delivery("1-0", r#"{"id":1}"#),
            delivery("2-0", "not json"),
            delivery("3-0", r#"{"id":3}"#),
        ]);
        assert_eq!(prepared.kept, vec![0, 2]);
        assert_eq!(prepared.failed.len(), 1);
        assert_eq!(prepared.failed[0].0, 1);
        assert!(matches!(prepared.failed[0].1, HandlerError::Decode(_)));
        prepared.run.expect("two entries kept")().await.unwrap();
        assert_eq!(
            *seen.lock().unwrap(),
            vec![vec![(1, "1-0".to_owned()), (3, "3-0".to_owned())]]
        );
        let none = handler.prepare(vec![delivery("4-0", "{}")]);
        assert!(none.run.is_none() && none.kept.is_empty());
    }
}
