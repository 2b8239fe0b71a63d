//! The application's shared states by type (docs/design.md §14.1): what `app().with_state(db)`
//! collects and the `State<T>` extractor ([`crate::extract::State`]) reads.
//!
//! A listener resolves the states its function needs once, when it is built
//! ([`crate::extract::FromDeliveryParts::prepare`]): a missing one is an error at startup
//! ([`MissingState`]), and no entry pays for a lookup by type.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::Arc;

/// The application's states: at most one value per type, any number of types (a database pool,
/// an HTTP client, a counter). Cheap to clone (the values are shared, behind an `Arc`).
///
/// Inserting a value of a type that is already there replaces it: `States::new().with(1u32)
/// .with(2u32)` holds `2u32` alone. Wrap two values of one type in distinct types (newtypes) to
/// keep both.
#[derive(Clone, Default)]
pub struct States {
    values: Arc<HashMap<TypeId, Entry>>,
}

#[derive(Clone)]
struct Entry {
    type_name: &'static str,
    value: Arc<dyn Any + Send + Sync>,
}

impl States {
    /// No state.
    pub fn new() -> Self {
        States::default()
    }

    /// These states with `value` added, replacing the value of type `T` if there was one.
    #[must_use]
    pub fn with<T: Clone + Send + Sync + 'static>(mut self, value: T) -> Self {
        self.insert(value);
        self
    }

    /// Adds `value`; returns the value of type `T` it replaces, if there was one. Copies the map
    /// when it is shared with a clone (the clone keeps its values).
    pub fn insert<T: Clone + Send + Sync + 'static>(&mut self, value: T) -> Option<T> {
        let entry = Entry {
            type_name: std::any::type_name::<T>(),
            value: Arc::new(value),
        };
        Arc::make_mut(&mut self.values)
            .insert(TypeId::of::<T>(), entry)
            .and_then(|old| old.value.downcast_ref::<T>().cloned())
    }

    /// The value of type `T`, if one was added.
    pub fn get<T: 'static>(&self) -> Option<&T> {
        self.values
            .get(&TypeId::of::<T>())
            .and_then(|entry| entry.value.downcast_ref::<T>())
    }

    /// The value of type `T`, or [`MissingState`] naming `T`.
    ///
    /// # Errors
    /// [`MissingState`] when no value of type `T` was added.
    pub fn require<T: 'static>(&self) -> Result<&T, MissingState> {
        self.get::<T>().ok_or(MissingState {
            type_name: std::any::type_name::<T>(),
        })
    }

    /// How many types have a value.
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// Whether no state was added.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// The type names of the values, sorted (for messages and `Debug`).
    pub fn type_names(&self) -> Vec<&'static str> {
        let mut names: Vec<&'static str> = self.values.values().map(|e| e.type_name).collect();
        names.sort_unstable();
        names
    }
}

impl std::fmt::Debug for States {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.type_names()).finish()
    }
}

/// A listener function takes `State<T>` (or an extractor that needs a state of type `T`), and
/// no value of type `T` was given to the application. `run_listeners` reports it as
/// `RunError::MissingState` with the listener's name, before contacting Redis.
#[derive(Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "no state of type `{type_name}` was provided: add one with `stream_listener::app().with_state(value)` (value: `{type_name}`) before running"
)]
pub struct MissingState {
    /// The missing type, as `std::any::type_name` prints it.
    pub type_name: &'static str,
}

// Readable from `main`, as every public error (docs/design.md §14.5).
crate::report::readable_debug!(MissingState);

impl MissingState {
    /// The error for a missing `T`.
    pub fn of<T: ?Sized>() -> Self {
        MissingState {
            type_name: std::any::type_name::<T>(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Clone, PartialEq)]
    struct Db(&'static str);

    #[test]
    fn a_second_value_of_one_type_replaces_the_first() {
        let mut states = States::new().with(Db("first")).with(7u32);
        assert_eq!(states.get::<Db>(), Some(&Db("first")));
        let clone = states.clone();
        assert_eq!(states.insert(Db("second")), Some(Db("first")));
        assert_eq!(states.get::<Db>(), Some(&Db("second")));
        assert_eq!(states.get::<u32>(), Some(&7));
        assert_eq!(states.len(), 2);
        // The clone made before kept its own value.
        assert_eq!(clone.get::<Db>(), Some(&Db("first")));
    }

    #[test]
    fn a_missing_type_is_named() {
        let states = States::new().with(7u32);
        let error = states.require::<Db>().unwrap_err();
        assert_eq!(error.type_name, std::any::type_name::<Db>());
        assert!(error.to_string().contains("app().with_state("), "{error}");
        assert_eq!(format!("{error:?}"), error.to_string(), "readable Debug");
        assert!(States::new().is_empty());
        assert_eq!(format!("{states:?}"), "{\"u32\"}");
    }
}
