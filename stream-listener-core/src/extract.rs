//! Extractors: how a listener function's arguments are made from a [`Delivery`] and the
//! application's states, as web frameworks make handler arguments from a request (docs/design.md
//! §7, §14.1), and how its return value becomes an outcome (docs/design.md §8).
//!
//! A function takes any number of extractors: every argument but the last is a
//! [`FromDeliveryParts`] (metadata and state, never the payload), the last a [`FromDelivery`]
//! (reads the payload) or another [`FromDeliveryParts`] ([`LastExtractor`]).
//!
//! | argument | trait | gets |
//! | --- | --- | --- |
//! | [`Json<T>`] | [`FromDelivery`], last | field `payload` decoded as JSON into `T` |
//! | [`Message<T>`] | [`FromDelivery`], last | the decoded payload plus where it came from: entry id, shard, stream key, partition key, delivery count, attempt, member id and epoch, and its headers |
//! | [`RawMessage`] | [`FromDelivery`], last | every field as bytes, undecoded, with the same metadata |
//! | [`State<T>`] | [`FromDeliveryParts`] | the application's value of type `T` (`app().with_state(value)`), cloned per call; missing: a startup error ([`MissingState`]) |
//! | [`Metadata`] | [`FromDeliveryParts`] | where the entry came from (the metadata of `Message<T>`) |
//! | [`Headers`] | [`FromDeliveryParts`] | the entry's headers (fields `h:<name>`, in order; docs/design.md §13.4), never a decode error |
//! | [`Delivery`] | [`FromDeliveryParts`] | the delivery itself (its fields shared, not copied) |
//!
//! A payload that does not decode is [`HandlerError::Decode`]: the entry is dead-lettered at
//! once with reason `decode` and acked, and the function is not called. Implement
//! [`FromDeliveryParts`] or [`FromDelivery`] for other argument types.
//!
//! | return type | outcome |
//! | --- | --- |
//! | `()` | acked |
//! | `Result<(), E>` with `Ok(())` | acked |
//! | `Err(e)`, `E` any `std::error::Error + Send + Sync + 'static` (or `Box<dyn Error + Send + Sync>`, `String`, `&'static str`) | [`HandlerError::Retryable`]: retried with backoff up to `max_attempts`, then dead-lettered |
//! | `Err(HandlerError::...)` | as given: [`HandlerError::non_retryable`] dead-letters at once |

use std::ops::{Deref, DerefMut};

use serde::de::DeserializeOwned;

pub use crate::handler::Metadata;
use crate::handler::{BoxError, Delivery, HandlerError};
pub use crate::headers::Headers;
use crate::state::{MissingState, States};

/// Builds a listener function's last argument from a [`Delivery`], reading its payload: a
/// payload extractor ([`Json<T>`], [`Message<T>`], [`RawMessage`] or your own). At most one per
/// function, and last; the arguments before it are [`FromDeliveryParts`].
///
/// An `Err` decides the entry's fate without calling the function: [`HandlerError::Decode`]
/// dead-letters it at once (a payload that cannot be decoded never will be).
///
/// A type implements this or [`FromDeliveryParts`], not both: a parts extractor is already
/// usable as the last argument ([`LastExtractor`]), and one with both would make the last
/// argument ambiguous.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be the payload argument of a listener function",
    label = "not a payload extractor",
    note = "use `Json<T>` (T: serde::Deserialize), `Message<T>` or `RawMessage`, or implement `FromDelivery` for `{Self}`"
)]
pub trait FromDelivery: Sized {
    /// Extracts the argument.
    ///
    /// # Errors
    /// [`HandlerError::Decode`] when the entry does not have the expected shape.
    fn from_delivery(delivery: &Delivery) -> Result<Self, HandlerError>;
}

/// Builds a listener function's argument from a [`Delivery`]'s metadata and the application's
/// states, without consuming the payload: any argument but the last is one ([`State<T>`],
/// [`Metadata`], [`Headers`], [`Delivery`] or your own), and the last may be one too.
///
/// Two steps, so that a missing state is a startup error and an entry pays no lookup by type:
/// [`prepare`](FromDeliveryParts::prepare) runs once when the listener is built and takes what
/// the extractor needs from the [`States`] (`()` for extractors of the delivery alone);
/// [`from_delivery_parts`](FromDeliveryParts::from_delivery_parts) runs for every attempt with
/// that.
///
/// ```
/// use stream_listener_core::extract::{FromDeliveryParts, State};
/// use stream_listener_core::handler::{Delivery, HandlerError};
/// use stream_listener_core::state::{MissingState, States};
///
/// /// The tenant of an entry (header `tenant`), or "default".
/// struct Tenant(String);
///
/// impl FromDeliveryParts for Tenant {
///     type Prepared = ();
///     fn prepare(_: &States) -> Result<(), MissingState> {
///         Ok(())
///     }
///     fn from_delivery_parts(delivery: &Delivery, _: &()) -> Result<Self, HandlerError> {
///         let tenant = delivery.headers().get_str("tenant").unwrap_or("default").to_owned();
///         Ok(Tenant(tenant))
///     }
/// }
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be an argument before the last one of a listener function",
    label = "not a metadata or state extractor",
    note = "only the last argument may read the payload (`Json<T>`, `Message<T>`, `RawMessage`): a listener function takes at most one payload extractor, last, so two payload extractors cannot be combined (`Message<T>` carries the payload with its metadata and headers)",
    note = "before it go `State<T>`, `Metadata`, `Headers`, `Delivery`, or a type implementing `FromDeliveryParts`"
)]
pub trait FromDeliveryParts: Sized {
    /// What the extractor takes from the application's states, once, when the listener is
    /// built: `()` when it needs none, `T` for [`State<T>`].
    type Prepared: Send + Sync + 'static;

    /// Takes what the extractor needs from `states`.
    ///
    /// # Errors
    /// [`MissingState`] naming the type when a state it needs was not given
    /// (`app().with_state(...)`): the application does not start.
    fn prepare(states: &States) -> Result<Self::Prepared, MissingState>;

    /// Extracts the argument for one attempt.
    ///
    /// # Errors
    /// A [`HandlerError`] decides the entry's fate without calling the function (as for
    /// [`FromDelivery`]); the extractors of this crate never fail.
    fn from_delivery_parts(
        delivery: &Delivery,
        prepared: &Self::Prepared,
    ) -> Result<Self, HandlerError>;
}

/// The delivery itself (its fields are shared, not copied).
impl FromDeliveryParts for Delivery {
    type Prepared = ();
    fn prepare(_: &States) -> Result<(), MissingState> {
        Ok(())
    }
    fn from_delivery_parts(delivery: &Delivery, _: &()) -> Result<Self, HandlerError> {
        Ok(delivery.clone())
    }
}

/// A state of the application, given with `app().with_state(value)` (docs/design.md §14.1),
/// cloned for every call (wrap it in an `Arc` when cloning is not cheap; a pool or a client
/// usually is). Destructure it in the argument: `State(db): State<Db>`.
///
/// `T` must be `Clone + Send + Sync + 'static`. A listener whose function takes `State<T>` for a
/// `T` that was not given does not start ([`MissingState`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct State<T>(pub T);

impl<T> Deref for State<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T> DerefMut for State<T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.0
    }
}

impl<T: Clone + Send + Sync + 'static> FromDeliveryParts for State<T> {
    type Prepared = T;
    fn prepare(states: &States) -> Result<T, MissingState> {
        states.require::<T>().cloned()
    }
    fn from_delivery_parts(_: &Delivery, prepared: &T) -> Result<Self, HandlerError> {
        Ok(State(prepared.clone()))
    }
}

/// An argument of a batch listener function before its `Batch<T>` (docs/design.md §14.2): made
/// from the application's states alone, since a batch has no one entry to look at. [`State<T>`]
/// is one; implement it for arguments of your own made from states.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot come before the `Batch<T>` of a batch listener function",
    label = "not made from the application's states",
    note = "before a `Batch<T>` go `State<T>` or a type implementing `FromStates`; per-entry metadata is in `Batch::metadata(i)`"
)]
pub trait FromStates: Sized {
    /// What the argument takes from the application's states, once, when the listener is built.
    type Prepared: Send + Sync + 'static;

    /// Takes what the argument needs from `states`.
    ///
    /// # Errors
    /// [`MissingState`] naming the type when a state it needs was not given
    /// (`app().with_state(...)`): the application does not start.
    fn prepare_states(states: &States) -> Result<Self::Prepared, MissingState>;

    /// The argument for one batch attempt.
    fn from_prepared(prepared: &Self::Prepared) -> Self;
}

impl<T: Clone + Send + Sync + 'static> FromStates for State<T> {
    type Prepared = T;
    fn prepare_states(states: &States) -> Result<T, MissingState> {
        states.require::<T>().cloned()
    }
    fn from_prepared(prepared: &T) -> Self {
        State(prepared.clone())
    }
}

/// The last argument of a listener function: a payload extractor ([`FromDelivery`]) or a parts
/// extractor ([`FromDeliveryParts`]). Implemented through those two traits (`M` is
/// [`ViaPayload`] or [`ViaParts`], inferred); implement one of them, not this.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be the argument of a listener function",
    label = "not an extractor",
    note = "use `Json<T>` (T: serde::Deserialize), `Message<T>`, `RawMessage`, `State<T>`, `Metadata`, `Headers` or `Delivery`, or implement `FromDelivery` (reads the payload) or `FromDeliveryParts` (metadata and state) for `{Self}`"
)]
pub trait LastExtractor<M>: Sized {
    /// As [`FromDeliveryParts::Prepared`]; `()` for a payload extractor.
    type Prepared: Send + Sync + 'static;

    /// As [`FromDeliveryParts::prepare`].
    ///
    /// # Errors
    /// [`MissingState`] when a state the extractor needs was not given.
    fn prepare_last(states: &States) -> Result<Self::Prepared, MissingState>;

    /// Extracts the argument for one attempt.
    ///
    /// # Errors
    /// As [`FromDelivery::from_delivery`].
    fn from_delivery_last(
        delivery: &Delivery,
        prepared: &Self::Prepared,
    ) -> Result<Self, HandlerError>;
}

/// [`LastExtractor`]'s marker for a [`FromDelivery`] argument.
#[derive(Debug)]
pub enum ViaPayload {}

/// [`LastExtractor`]'s marker for a [`FromDeliveryParts`] argument.
#[derive(Debug)]
pub enum ViaParts {}

impl<T: FromDelivery> LastExtractor<ViaPayload> for T {
    type Prepared = ();
    fn prepare_last(_: &States) -> Result<(), MissingState> {
        Ok(())
    }
    fn from_delivery_last(delivery: &Delivery, _: &()) -> Result<Self, HandlerError> {
        T::from_delivery(delivery)
    }
}

impl<T: FromDeliveryParts> LastExtractor<ViaParts> for T {
    type Prepared = T::Prepared;
    fn prepare_last(states: &States) -> Result<Self::Prepared, MissingState> {
        T::prepare(states)
    }
    fn from_delivery_last(
        delivery: &Delivery,
        prepared: &Self::Prepared,
    ) -> Result<Self, HandlerError> {
        T::from_delivery_parts(delivery, prepared)
    }
}

fn decode_payload<T: DeserializeOwned>(delivery: &Delivery) -> Result<T, HandlerError> {
    let payload = delivery.payload().ok_or_else(|| {
        HandlerError::Decode(format!(
            "entry {} of {} has no `payload` field (fields: {})",
            delivery.entry_id,
            delivery.stream_key,
            field_names(delivery)
        ))
    })?;
    serde_json::from_slice(payload).map_err(|e| {
        HandlerError::Decode(format!(
            "payload of entry {} of {} is not a JSON {}: {e}",
            delivery.entry_id,
            delivery.stream_key,
            std::any::type_name::<T>()
        ))
    })
}

fn field_names(delivery: &Delivery) -> String {
    let names: Vec<&str> = delivery.fields.iter().map(|(n, _)| n.as_str()).collect();
    if names.is_empty() {
        "none".to_owned()
    } else {
        names.join(", ")
    }
}

/// The payload (field `payload`) decoded from JSON into `T`; destructure it in the argument:
/// `async fn on_order(Json(order): Json<Order>)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Json<T>(pub T);

impl<T> Json<T> {
    /// The decoded value.
    pub fn into_inner(self) -> T {
        self.0
    }
}

impl<T> Deref for Json<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T> DerefMut for Json<T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.0
    }
}

impl<T: DeserializeOwned> FromDelivery for Json<T> {
    fn from_delivery(delivery: &Delivery) -> Result<Self, HandlerError> {
        decode_payload(delivery).map(Json)
    }
}

impl FromDeliveryParts for Metadata {
    type Prepared = ();
    fn prepare(_: &States) -> Result<(), MissingState> {
        Ok(())
    }
    fn from_delivery_parts(delivery: &Delivery, _: &()) -> Result<Self, HandlerError> {
        Ok(delivery.metadata.clone())
    }
}

/// The decoded payload with its [`Metadata`] (reachable directly: `message.entry_id`,
/// `message.shard`, ... through `Deref`) and its [`Headers`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Message<T> {
    /// Field `payload`, decoded from JSON.
    pub payload: T,
    /// Where the entry came from.
    pub metadata: Metadata,
    /// The entry's headers (fields `h:<name>`, in order); empty when it has none.
    pub headers: Headers,
}

impl<T> Message<T> {
    /// The entry's headers (fields `h:<name>`, in order; docs/design.md §13.4).
    pub fn headers(&self) -> &Headers {
        &self.headers
    }
}

impl<T> Deref for Message<T> {
    type Target = Metadata;
    fn deref(&self) -> &Metadata {
        &self.metadata
    }
}

impl<T: DeserializeOwned> FromDelivery for Message<T> {
    fn from_delivery(delivery: &Delivery) -> Result<Self, HandlerError> {
        Ok(Message {
            payload: decode_payload(delivery)?,
            metadata: delivery.metadata.clone(),
            headers: delivery.headers(),
        })
    }
}

/// Every field of the entry as bytes, undecoded (never a decode error), with its [`Metadata`]
/// (through `Deref`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RawMessage {
    /// Every field, in order (`key` and `payload` for entries of the publisher, then its
    /// headers as `h:<name>` fields: [`RawMessage::headers`]).
    pub fields: Vec<(String, Vec<u8>)>,
    /// Where the entry came from.
    pub metadata: Metadata,
}

impl RawMessage {
    /// The value of field `name`, if present.
    pub fn field(&self, name: &str) -> Option<&[u8]> {
        crate::handler::field(&self.fields, name)
    }

    /// Field `payload`, if present.
    pub fn payload(&self) -> Option<&[u8]> {
        self.field("payload")
    }

    /// The headers among the fields (every `h:<name>`, in order; docs/design.md §13.4), copied.
    pub fn headers(&self) -> Headers {
        Headers::from_fields(&self.fields)
    }
}

impl Deref for RawMessage {
    type Target = Metadata;
    fn deref(&self) -> &Metadata {
        &self.metadata
    }
}

impl FromDelivery for RawMessage {
    fn from_delivery(delivery: &Delivery) -> Result<Self, HandlerError> {
        Ok(RawMessage {
            fields: delivery.fields.to_vec(),
            metadata: delivery.metadata.clone(),
        })
    }
}

/// The entry's headers alone: never a decode error.
impl FromDeliveryParts for Headers {
    type Prepared = ();
    fn prepare(_: &States) -> Result<(), MissingState> {
        Ok(())
    }
    fn from_delivery_parts(delivery: &Delivery, _: &()) -> Result<Self, HandlerError> {
        Ok(delivery.headers())
    }
}

/// What a listener function may return: `()` or `Result<(), E>` (see the module docs).
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be the return type of a listener function",
    label = "return `()` or `Result<(), E>`",
    note = "return `()`, or `Result<(), E>` where `E: std::error::Error + Send + Sync + 'static` (errors are retried; return `Err(HandlerError::non_retryable(e))` to dead-letter at once)"
)]
pub trait IntoHandlerResult {
    /// The outcome.
    ///
    /// # Errors
    /// The function's error: [`HandlerError`] as returned, any other error as
    /// [`HandlerError::Retryable`].
    fn into_handler_result(self) -> Result<(), HandlerError>;
}

impl IntoHandlerResult for () {
    fn into_handler_result(self) -> Result<(), HandlerError> {
        Ok(())
    }
}

impl<E: Into<BoxError>> IntoHandlerResult for Result<(), E> {
    fn into_handler_result(self) -> Result<(), HandlerError> {
        self.map_err(|e| {
            let boxed: BoxError = e.into();
            match boxed.downcast::<HandlerError>() {
                Ok(handler_error) => *handler_error,
                Err(other) => HandlerError::Retryable(other),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn delivery(fields: &[(&str, &str)]) -> Delivery {
        let fields: Arc<[(String, Vec<u8>)]> = fields
            .iter()
            .map(|(n, v)| ((*n).to_owned(), v.as_bytes().to_vec()))
            .collect();
        Delivery {
            metadata: Metadata::new("{orders:2}", 2, "1-0".into(), &fields, "m-m0", 7),
            fields,
        }
    }

    #[derive(Debug, serde::Deserialize, PartialEq)]
    struct Order {
        id: u32,
    }

    #[test]
    fn json_decodes_the_payload() {
        let d = delivery(&[("key", "c1"), ("payload", r#"{"id":1}"#)]);
        let Json(order) = Json::<Order>::from_delivery(&d).unwrap();
        assert_eq!(order, Order { id: 1 });
    }

    #[test]
    fn bad_json_is_a_decode_error() {
        let d = delivery(&[("payload", r#"{"id":"#)]);
        let err = Json::<Order>::from_delivery(&d).unwrap_err();
        assert!(matches!(err, HandlerError::Decode(_)), "{err}");
        let d = delivery(&[("other", "x")]);
        let err = Json::<Order>::from_delivery(&d).unwrap_err();
        assert!(
            err.to_string()
                .contains("no `payload` field (fields: other)"),
            "{err}"
        );
    }

    #[test]
    fn message_has_the_metadata() {
        let d = delivery(&[("key", "c1"), ("payload", r#"{"id":1}"#)]);
        let m = Message::<Order>::from_delivery(&d).unwrap();
        assert_eq!(m.payload, Order { id: 1 });
        assert_eq!(m.partition_key.as_deref(), Some("c1"));
        assert_eq!(
            (m.shard, m.member_epoch, m.entry_id.as_str()),
            (2, 7, "1-0")
        );
        let raw = RawMessage::from_delivery(&d).unwrap();
        assert_eq!(raw.field("key"), Some(&b"c1"[..]));
        assert_eq!(raw.member_id, "m-m0");
    }

    #[test]
    fn every_extractor_sees_the_headers_in_order() {
        let d = delivery(&[
            ("key", "c1"),
            ("payload", r#"{"id":1}"#),
            ("h:tenant", "acme"),
            ("h:tag", "a"),
            ("h:tag", "b"),
        ]);
        let expected = Headers::new()
            .with("tenant", "acme")
            .with("tag", "a")
            .with("tag", "b");
        assert_eq!(Headers::from_delivery_parts(&d, &()).unwrap(), expected);
        assert_eq!(d.headers(), expected);
        assert_eq!(
            Message::<Order>::from_delivery(&d).unwrap().headers(),
            &expected
        );
        assert_eq!(RawMessage::from_delivery(&d).unwrap().headers(), expected);
        let plain = delivery(&[("key", "c1"), ("payload", r#"{"id":1}"#)]);
        assert!(
            Headers::from_delivery_parts(&plain, &())
                .unwrap()
                .is_empty()
        );
    }

    #[derive(Debug, Clone, PartialEq)]
    struct Db(&'static str);

    #[test]
    fn each_parts_extractor_extracts_without_the_payload() {
        // No `payload` field: a parts extractor never looks at it.
        let d = delivery(&[("key", "c1"), ("h:tenant", "acme")]);
        let metadata = Metadata::from_delivery_parts(&d, &()).unwrap();
        assert_eq!(metadata, d.metadata);
        assert_eq!(
            Headers::from_delivery_parts(&d, &()).unwrap(),
            Headers::new().with("tenant", "acme")
        );
        assert_eq!(Delivery::from_delivery_parts(&d, &()).unwrap(), d);
        let states = States::new().with(Db("primary"));
        let prepared = State::<Db>::prepare(&states).unwrap();
        let State(db) = State::<Db>::from_delivery_parts(&d, &prepared).unwrap();
        assert_eq!(db, Db("primary"));
        assert_eq!(
            State::<u8>::prepare(&states).unwrap_err(),
            MissingState::of::<u8>()
        );
        // The parts extractors are last arguments too, and so are the payload extractors.
        let via_parts = <Metadata as LastExtractor<ViaParts>>::from_delivery_last(&d, &()).unwrap();
        assert_eq!(via_parts, d.metadata);
        assert!(<Json<Order> as LastExtractor<ViaPayload>>::from_delivery_last(&d, &()).is_err());
    }

    #[derive(Debug, thiserror::Error)]
    #[error("downstream unavailable")]
    struct Downstream;

    #[test]
    fn return_values_map_to_outcomes() {
        assert!(().into_handler_result().is_ok());
        assert!(Ok::<(), Downstream>(()).into_handler_result().is_ok());
        let retry = Err::<(), _>(Downstream).into_handler_result().unwrap_err();
        assert!(matches!(retry, HandlerError::Retryable(_)));
        let fatal = Err::<(), _>(HandlerError::non_retryable(Downstream))
            .into_handler_result()
            .unwrap_err();
        assert!(matches!(fatal, HandlerError::NonRetryable(_)));
        let text = Err::<(), _>("plain text")
            .into_handler_result()
            .unwrap_err();
        assert_eq!(text.to_string(), "plain text");
    }
}
