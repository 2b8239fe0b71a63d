//! The decoded JSON of the group hash's last load, kept by content (docs/design.md §5.1): a load
//! parses only the `meta` and `member:<id>` values that differ from the ones it decoded before.
//!
//! A full transition changes a handful of fields, so between two loads of a 1,000-member group
//! most of its 0.9–1.3 MB of JSON is the same text: parsing all of it again was about 4 ms of
//! every full transition. The cache is keyed by the exact stored text, so it never answers for
//! a value it has not parsed: it needs no invalidation, only a bound (it keeps what the last load
//! saw). Clones of a [`crate::store::GroupStore`] share it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use serde::de::DeserializeOwned;

/// Field name → (the stored JSON, what it decoded to), shared between clones of one store.
#[derive(Debug)]
pub(super) struct DecodeCache<T> {
    inner: Arc<Mutex<HashMap<String, (String, T)>>>,
}

impl<T> Clone for DecodeCache<T> {
    fn clone(&self) -> Self {
        DecodeCache {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<T> Default for DecodeCache<T> {
    fn default() -> Self {
        DecodeCache {
            inner: Arc::default(),
        }
    }
}

impl<T: DeserializeOwned + Clone> DecodeCache<T> {
    /// Decodes the `(field, json)` values of one load with `serde_json`, except those whose
    /// text is exactly what this cache parsed for that field last time. Entries of fields not in
    /// this load are dropped, so the cache holds one load's worth.
    ///
    /// # Errors
    /// The first field that is not valid JSON for `T`, with its parse error. The cache then
    /// keeps what it held before that field.
    pub(super) fn decode_all<'a>(
        &self,
        values: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<Vec<(&'a str, T)>, (&'a str, serde_json::Error)> {
        let mut cached = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let mut kept = HashMap::with_capacity(cached.len());
        let mut decoded = Vec::new();
        for (field, json) in values {
            let previous = cached.remove_entry(field);
            let entry = match previous {
                Some((name, (text, value))) if text == json => (name, (text, value)),
                previous => match serde_json::from_str::<T>(json) {
                    Ok(value) => (field.to_owned(), (json.to_owned(), value)),
                    Err(error) => {
                        cached.extend(previous);
                        cached.extend(kept);
                        return Err((field, error));
                    }
                },
            };
            decoded.push((field, entry.1.1.clone()));
            kept.insert(entry.0, entry.1);
        }
        *cached = kept;
        Ok(decoded)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Clone, PartialEq, serde::Deserialize)]
    struct Value {
        n: u32,
    }

    #[test]
    fn a_value_is_parsed_again_only_when_its_text_changed() {
        let cache = DecodeCache::<Value>::default();
        let first = cache
            .decode_all([("a", r#"{"n":1}"#), ("b", r#"{"n":2}"#)])
            .unwrap();
        assert_eq!(first, vec![("a", Value { n: 1 }), ("b", Value { n: 2 })]);
        // Poison the cached value of `a` to see whether it is reused for the same text.
        cache.inner.lock().unwrap().get_mut("a").unwrap().1 = Value { n: 99 };
        let second = cache
            .decode_all([("a", r#"{"n":1}"#), ("b", r#"{"n":3}"#)])
            .unwrap();
        assert_eq!(second, vec![("a", Value { n: 99 }), ("b", Value { n: 3 })]);
        // A field absent from a load is forgotten.
        cache.decode_all([("b", r#"{"n":3}"#)]).unwrap();
        assert!(!cache.inner.lock().unwrap().contains_key("a"));
    }

    #[test]
    fn a_value_that_is_not_json_is_an_error_and_the_cache_keeps_its_entries() {
        let cache = DecodeCache::<Value>::default();
        cache
            .decode_all([("a", r#"{"n":1}"#), ("b", r#"{"n":2}"#)])
            .unwrap();
        let (field, _) = cache
            .decode_all([("a", r#"{"n":1}"#), ("b", "not json")])
            .unwrap_err();
        assert_eq!(field, "b");
        let entries = cache.inner.lock().unwrap();
        assert_eq!(entries.len(), 2, "{entries:?}");
        assert_eq!(entries["b"].1, Value { n: 2 });
    }

    #[test]
    fn clones_share_one_cache() {
        let cache = DecodeCache::<Value>::default();
        let clone = cache.clone();
        cache.decode_all([("a", r#"{"n":1}"#)]).unwrap();
        assert!(clone.inner.lock().unwrap().contains_key("a"));
    }
}
