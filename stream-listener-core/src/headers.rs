//! Message headers (docs/design.md §13.4): name–value pairs that travel with an entry beside its
//! payload, as Kafka record headers do, for metadata such as a trace context, a content type or
//! a correlation id.
//!
//! In Redis a header is one more field of the entry, named [`HEADER_PREFIX`] + the header name
//! (`h:traceparent`), after the publisher's `key` and `payload` fields: any producer that can
//! `XADD` can write one, and a reader that does not know about headers sees extra fields it can
//! ignore. The prefix keeps headers apart from the fields the framework reads (`key`, `payload`)
//! and from `publish_raw`'s own fields as long as those do not start with `h:`.

/// The prefix of an entry field that carries a header: header `traceparent` is field
/// `h:traceparent`.
pub const HEADER_PREFIX: &str = "h:";

/// The headers of one message, in order: Kafka-style, a name may appear more than once, and
/// values are bytes (`&str` and `String` values convert). Names are compared exactly
/// (case-sensitive, as Redis field names and Kafka header keys are): `Content-Type` and
/// `content-type` are two headers. [`Headers::get`] returns the first value of a name, as an
/// HTTP-like lookup; [`Headers::get_all`] every value in order.
///
/// Building `Headers` accepts any name; the publisher checks them
/// ([`crate::producer::Publisher::publish_with_headers`]: non-empty, no control characters).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Headers {
    entries: Vec<(String, Vec<u8>)>,
}

/// `[("name", "text value"), ("name", [0, 255])]`: a value as text when it is UTF-8, as bytes
/// otherwise.
impl std::fmt::Debug for Headers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        struct Value<'a>(&'a [u8]);
        impl std::fmt::Debug for Value<'_> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                match std::str::from_utf8(self.0) {
                    Ok(text) => text.fmt(f),
                    Err(_) => self.0.fmt(f),
                }
            }
        }
        f.debug_list()
            .entries(self.iter().map(|(name, value)| (name, Value(value))))
            .finish()
    }
}

impl Headers {
    /// No headers.
    pub fn new() -> Self {
        Headers::default()
    }

    /// Appends header `name` with `value` after the others (an existing header of that name
    /// stays: both are kept, in order).
    pub fn append(&mut self, name: impl Into<String>, value: impl Into<Vec<u8>>) -> &mut Self {
        self.entries.push((name.into(), value.into()));
        self
    }

    /// [`Headers::append`] by value, for building: `Headers::new().with("tenant", "acme")`.
    #[must_use]
    pub fn with(mut self, name: impl Into<String>, value: impl Into<Vec<u8>>) -> Self {
        self.append(name, value);
        self
    }

    /// The first value of header `name`, if any.
    pub fn get(&self, name: &str) -> Option<&[u8]> {
        self.entries
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
    }

    /// The first value of header `name` when there is one and it is UTF-8.
    pub fn get_str(&self, name: &str) -> Option<&str> {
        self.get(name).and_then(|v| std::str::from_utf8(v).ok())
    }

    /// Every value of header `name`, in order.
    pub fn get_all<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.entries
            .iter()
            .filter(move |(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
    }

    /// Whether a header `name` is present.
    pub fn contains(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    /// Every header (name, value), in order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &[u8])> {
        self.entries.iter().map(|(n, v)| (n.as_str(), v.as_slice()))
    }

    /// How many headers (duplicates counted).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The headers of an entry: every field named `h:<name>`, in field order, as header
    /// `<name>`. Any other field is not a header.
    pub(crate) fn from_fields(fields: &[(String, Vec<u8>)]) -> Self {
        Headers {
            entries: header_fields(fields)
                .map(|(name, value)| (name.to_owned(), value.to_vec()))
                .collect(),
        }
    }

    /// The entry fields that carry these headers: (`h:<name>`, value), in order.
    pub(crate) fn to_fields(&self) -> impl Iterator<Item = (String, &[u8])> {
        self.iter()
            .map(|(name, value)| (format!("{HEADER_PREFIX}{name}"), value))
    }

    /// The first name that a publisher refuses, with why: empty, or with a control character
    /// (`char::is_control`: C0, DEL, C1), which other producers' tools and logs mangle.
    pub(crate) fn invalid_name(&self) -> Option<(&str, &'static str)> {
        self.iter().find_map(|(name, _)| {
            if name.is_empty() {
                Some((name, "is empty"))
            } else if name.chars().any(char::is_control) {
                Some((name, "contains a control character"))
            } else {
                None
            }
        })
    }
}

/// The header fields of an entry, without allocating: (name without the prefix, value).
pub(crate) fn header_fields(fields: &[(String, Vec<u8>)]) -> impl Iterator<Item = (&str, &[u8])> {
    fields.iter().filter_map(|(name, value)| {
        name.strip_prefix(HEADER_PREFIX)
            .map(|header| (header, value.as_slice()))
    })
}

impl<N: Into<String>, V: Into<Vec<u8>>> FromIterator<(N, V)> for Headers {
    fn from_iter<I: IntoIterator<Item = (N, V)>>(iter: I) -> Self {
        Headers {
            entries: iter
                .into_iter()
                .map(|(n, v)| (n.into(), v.into()))
                .collect(),
        }
    }
}

impl<N: Into<String>, V: Into<Vec<u8>>> Extend<(N, V)> for Headers {
    fn extend<I: IntoIterator<Item = (N, V)>>(&mut self, iter: I) {
        self.entries
            .extend(iter.into_iter().map(|(n, v)| (n.into(), v.into())));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(pairs: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
        pairs
            .iter()
            .map(|(n, v)| ((*n).to_owned(), v.as_bytes().to_vec()))
            .collect()
    }

    #[test]
    fn headers_are_encoded_as_prefixed_fields_in_order() {
        let headers = Headers::new()
            .with("tenant", "acme")
            .with(
                "traceparent",
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            )
            .with("tenant", b"\xff\x00".to_vec());
        let encoded: Vec<(String, Vec<u8>)> =
            headers.to_fields().map(|(n, v)| (n, v.to_vec())).collect();
        assert_eq!(
            encoded,
            vec![
                ("h:tenant".to_owned(), b"acme".to_vec()),
                (
                    "h:traceparent".to_owned(),
                    b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".to_vec()
                ),
                ("h:tenant".to_owned(), vec![0xff, 0x00]),
            ]
        );
    }

    #[test]
    fn only_prefixed_fields_are_headers_and_decoding_inverts_encoding() {
        let entry = fields(&[
            ("key", "c1"),
            ("payload", "{}"),
            ("h:b", "2"),
            ("hx", "not a header"),
            ("h:a", "1"),
            ("h:b", "3"),
            ("H:c", "not a header either"),
        ]);
        let headers = Headers::from_fields(&entry);
        let pairs: Vec<(&str, &[u8])> = headers.iter().collect();
        assert_eq!(
            pairs,
            vec![("b", &b"2"[..]), ("a", &b"1"[..]), ("b", &b"3"[..])]
        );
        assert_eq!(headers.get("b"), Some(&b"2"[..]));
        assert_eq!(headers.get_str("a"), Some("1"));
        assert_eq!(headers.get_all("b").collect::<Vec<_>>(), [b"2", b"3"]);
        assert_eq!(headers.get("B"), None, "names are case-sensitive");
        assert!(!headers.contains("c"));
        let round_trip: Vec<(String, Vec<u8>)> =
            headers.to_fields().map(|(n, v)| (n, v.to_vec())).collect();
        assert_eq!(Headers::from_fields(&round_trip), headers);
    }

    #[test]
    fn debug_shows_text_values_as_text() {
        let headers = Headers::new().with("a", "text").with("b", vec![0xff, 0]);
        assert_eq!(
            format!("{headers:?}"),
            r#"[("a", "text"), ("b", [255, 0])]"#
        );
    }

    #[test]
    fn names_that_are_empty_or_hold_control_characters_are_refused() {
        assert_eq!(Headers::new().with("ok-name", "v").invalid_name(), None);
        assert_eq!(
            Headers::new().with("a", "1").with("", "v").invalid_name(),
            Some(("", "is empty"))
        );
        for bad in ["line\nbreak", "tab\there", "nul\0", "del\u{7f}", "c1\u{85}"] {
            assert_eq!(
                Headers::new().with(bad, "v").invalid_name(),
                Some((bad, "contains a control character")),
                "{bad:?}"
            );
        }
        assert_eq!(
            Headers::new().with("ünïcode name", "v").invalid_name(),
            None
        );
    }
}
