//! W3C trace context in message headers (docs/design.md §13.4), with the cargo feature
//! `opentelemetry`.
//!
//! At publish, the current `tracing` span's OpenTelemetry context goes into the headers
//! `traceparent` (and `tracestate` when not empty) through OpenTelemetry's
//! `TraceContextPropagator`: the W3C format, so a consumer in another language reads it too. Each
//! handler attempt's span takes the context found in the entry's headers as its parent. Both
//! need a subscriber with a `tracing-opentelemetry` layer: without one, spans have no
//! OpenTelemetry context and nothing is written or parented.
//!
//! Without the feature both functions do nothing: headers are still written and read, and no
//! trace work is done.

use crate::headers::Headers;

/// The W3C header carrying the trace id, the parent span id and the sampled flag.
pub(crate) const TRACEPARENT: &str = "traceparent";

/// Adds the current span's trace context to `headers`: `traceparent`, and `tracestate` when it
/// is not empty. Nothing when they carry a `traceparent` already (the caller's context wins),
/// when no span is current, or without the feature.
pub(crate) fn inject_current(headers: &mut Headers) {
    #[cfg(feature = "opentelemetry")]
    otel::inject_current(headers);
    #[cfg(not(feature = "opentelemetry"))]
    let _ = headers;
}

/// Makes the producer's context, the `traceparent` (and `tracestate`) headers among the entry's
/// `fields`, the OpenTelemetry parent of `span`, which must not have been entered yet. Nothing
/// when the span is disabled, when there is no valid `traceparent`, or without the feature.
pub(crate) fn set_parent(span: &tracing::Span, fields: &[(String, Vec<u8>)]) {
    #[cfg(feature = "opentelemetry")]
    otel::set_parent(span, fields);
    #[cfg(not(feature = "opentelemetry"))]
    let _ = (span, fields);
}

#[cfg(feature = "opentelemetry")]
mod otel {
    use opentelemetry::Context;
    use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
    use opentelemetry::trace::TraceContextExt;
    use opentelemetry_sdk::propagation::TraceContextPropagator;
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    use super::TRACEPARENT;
    use crate::headers::{Headers, header_fields};

    /// The W3C header carrying vendor-specific trace data.
    const TRACESTATE: &str = "tracestate";

    /// Writes what the propagator sets as headers; an empty `tracestate` is left out.
    struct HeaderInjector<'a>(&'a mut Headers);

    impl Injector for HeaderInjector<'_> {
        fn set(&mut self, key: &str, value: String) {
            if key == TRACESTATE && value.is_empty() {
                return;
            }
            self.0.append(key, value);
        }
    }

    /// Reads the propagator's headers straight from an entry's fields (no copy).
    struct FieldExtractor<'a>(&'a [(String, Vec<u8>)]);

    impl Extractor for FieldExtractor<'_> {
        fn get(&self, key: &str) -> Option<&str> {
            header_fields(self.0)
                .find(|(name, _)| *name == key)
                .and_then(|(_, value)| std::str::from_utf8(value).ok())
        }

        fn keys(&self) -> Vec<&str> {
            header_fields(self.0).map(|(name, _)| name).collect()
        }
    }

    pub(super) fn inject_current(headers: &mut Headers) {
        if headers.contains(TRACEPARENT) {
            return;
        }
        let span = tracing::Span::current();
        if span.is_disabled() {
            return;
        }
        inject(&span.context(), headers);
    }

    /// Appends `cx`'s W3C headers; nothing for an invalid context (a span without an
    /// OpenTelemetry layer has one).
    fn inject(cx: &Context, headers: &mut Headers) {
        TraceContextPropagator::new().inject_context(cx, &mut HeaderInjector(headers));
    }

    pub(super) fn set_parent(span: &tracing::Span, fields: &[(String, Vec<u8>)]) {
        if span.is_disabled() {
            return;
        }
        let Some(cx) = extract(fields) else {
            return;
        };
        // Fails only without an OpenTelemetry layer (nothing to parent) or for a span already
        // started (not the case: it is fresh).
        if let Err(error) = span.set_parent(cx) {
            tracing::trace!(%error, "the handler span takes no trace parent");
        }
    }

    /// The producer's context from the `traceparent` / `tracestate` headers among `fields`;
    /// `None` without a `traceparent` or with a malformed one (the span keeps its own parent).
    fn extract(fields: &[(String, Vec<u8>)]) -> Option<Context> {
        if !header_fields(fields).any(|(name, _)| name == TRACEPARENT) {
            return None;
        }
        let cx = TraceContextPropagator::new().extract(&FieldExtractor(fields));
        cx.span().span_context().is_valid().then_some(cx)
    }

    #[cfg(test)]
    mod tests {
        use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};

        use super::*;

        const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
        const SPAN: &str = "00f067aa0ba902b7";

        fn context(trace_state: TraceState, flags: TraceFlags) -> Context {
            Context::new().with_remote_span_context(SpanContext::new(
                TraceId::from_hex(TRACE).unwrap(),
                SpanId::from_hex(SPAN).unwrap(),
                flags,
                true,
                trace_state,
            ))
        }

        fn entry(headers: &Headers) -> Vec<(String, Vec<u8>)> {
            let mut fields = vec![("key".to_owned(), b"k".to_vec())];
            fields.extend(headers.to_fields().map(|(n, v)| (n, v.to_vec())));
            fields
        }

        #[test]
        fn the_w3c_headers_of_a_context_are_traceparent_and_a_non_empty_tracestate() {
            let mut headers = Headers::new().with("tenant", "acme");
            let state = TraceState::from_key_value([("vendor", "v1")]).unwrap();
            inject(&context(state, TraceFlags::SAMPLED), &mut headers);
            assert_eq!(
                headers,
                Headers::new()
                    .with("tenant", "acme")
                    .with("traceparent", format!("00-{TRACE}-{SPAN}-01"))
                    .with("tracestate", "vendor=v1")
            );
            let mut unsampled = Headers::new();
            inject(
                &context(TraceState::default(), TraceFlags::default()),
                &mut unsampled,
            );
            assert_eq!(
                unsampled,
                Headers::new().with("traceparent", format!("00-{TRACE}-{SPAN}-00")),
                "an empty tracestate is not written"
            );
            let mut none = Headers::new();
            inject(&Context::new(), &mut none);
            assert!(none.is_empty(), "no span: no header");
        }

        #[test]
        fn the_producer_context_is_read_back_from_the_entry_fields() {
            let state = TraceState::from_key_value([("vendor", "v1")]).unwrap();
            let sent = context(state, TraceFlags::SAMPLED);
            let mut headers = Headers::new();
            inject(&sent, &mut headers);
            let read = extract(&entry(&headers)).unwrap();
            assert_eq!(read.span().span_context(), sent.span().span_context());

            assert!(extract(&entry(&Headers::new().with("tenant", "acme"))).is_none());
            let malformed = Headers::new().with("traceparent", "00-not-a-trace-01");
            assert!(extract(&entry(&malformed)).is_none());
            // A field `traceparent` without the prefix is not a header.
            let unprefixed = vec![(
                "traceparent".to_owned(),
                format!("00-{TRACE}-{SPAN}-01").into_bytes(),
            )];
            assert!(extract(&unprefixed).is_none());
        }
    }
}
