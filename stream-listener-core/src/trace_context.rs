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
        // An invalid context (no OpenTelemetry layer) makes the propagator write nothing.
        TraceContextPropagator::new().inject_context(&span.context(), &mut HeaderInjector(headers));
    }

    pub(super) fn set_parent(span: &tracing::Span, fields: &[(String, Vec<u8>)]) {
        if span.is_disabled() || !header_fields(fields).any(|(name, _)| name == TRACEPARENT) {
            return;
        }
        let cx = TraceContextPropagator::new().extract(&FieldExtractor(fields));
        // A malformed traceparent extracts nothing: keep the span's own parent then.
        if !cx.span().span_context().is_valid() {
            return;
        }
        // Fails only without an OpenTelemetry layer (nothing to parent) or for a span already
        // started (not the case: it is fresh).
        if let Err(error) = span.set_parent(cx) {
            tracing::trace!(%error, "the handler span takes no trace parent");
        }
    }
}
