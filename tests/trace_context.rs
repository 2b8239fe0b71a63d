//! W3C trace context through a real Redis (docs/design.md §13.4, feature `opentelemetry`, which
//! the root's dev-dependency on `stream-listener` turns on): a message published inside a span
//! carries that span's `traceparent`, and the listener's `handle` span for it is a child of the
//! producer's span in the same trace, as exported by the OpenTelemetry SDK's in-memory exporter;
//! a batch carries the context in each entry, and a caller's own `traceparent` is kept.
//!
//! One test in this binary: it installs the process-wide subscriber (a registry with a
//! `tracing-opentelemetry` layer), which the listener's tasks on other threads then report to.

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry::trace::{SpanContext, TraceContextExt, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use serde_json::json;
use stream_listener::{Delivery, HandlerError, Headers, Publisher, PublisherOptions};
use support::{Context, STREAM, options, settle, start_listener, wait_until};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;

/// The finished spans named `name`.
fn finished(exporter: &InMemorySpanExporter, name: &str) -> Vec<SpanData> {
    exporter
        .get_finished_spans()
        .unwrap()
        .into_iter()
        .filter(|span| span.name == name)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handler_span_is_a_child_of_the_producer_span_in_its_trace() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("trace-context-test")));
    tracing::subscriber::set_global_default(subscriber).unwrap();

    let (_serial, _server, target, mut conn, _recorder) = Context::start(2).await.parts();
    // (shard stream key, entry id, headers) of every entry handled.
    let seen: Arc<Mutex<Vec<(String, String, Headers)>>> = Arc::default();
    let handler = {
        let seen = seen.clone();
        move |delivery: Delivery| {
            let seen = seen.clone();
            async move {
                seen.lock().unwrap().push((
                    delivery.stream_key.clone(),
                    delivery.entry_id.clone(),
                    delivery.headers(),
                ));
                Ok::<(), HandlerError>(())
            }
        }
    };
    let listener = start_listener(&target, handler, options(1)).await;
    settle(&mut conn, 1, Duration::from_secs(20)).await;
    let producer = Publisher::new(conn.clone(), STREAM, PublisherOptions::default())
        .await
        .unwrap();

    let checkout = tracing::info_span!("checkout");
    let published = producer
        .publish_with_headers(
            "customer:1",
            &json!({"n": 1}),
            &Headers::new().with("tenant", "acme"),
        )
        .instrument(checkout.clone())
        .await
        .unwrap();
    let producer_context: SpanContext = checkout.context().span().span_context().clone();
    assert!(producer_context.is_valid());
    drop(checkout);

    // The headers carry the producer span's W3C context after the caller's own header (the
    // tracestate is empty, so not written).
    let traceparent = format!(
        "00-{}-{}-01",
        producer_context.trace_id(),
        producer_context.span_id()
    );
    let handled = wait_until(Duration::from_secs(10), || {
        seen.lock()
            .unwrap()
            .iter()
            .any(|(key, id, _)| *key == published.stream_key && *id == published.entry_id)
    })
    .await;
    assert!(handled, "entry {} not handled", published.entry_id);
    let headers = seen.lock().unwrap()[0].2.clone();
    assert_eq!(
        headers,
        Headers::new()
            .with("tenant", "acme")
            .with("traceparent", traceparent.as_str())
    );

    // The consumer's span: same trace, its parent the producer's span, with the entry's fields.
    assert!(
        wait_until(Duration::from_secs(10), || !finished(&exporter, "handle")
            .is_empty())
        .await,
        "no handle span exported"
    );
    let handle = finished(&exporter, "handle").remove(0);
    assert_eq!(
        handle.span_context.trace_id(),
        producer_context.trace_id(),
        "{handle:#?}"
    );
    assert_eq!(handle.parent_span_id, producer_context.span_id());
    assert!(handle.parent_span_is_remote);
    let attribute = |key: &str| {
        handle
            .attributes
            .iter()
            .find(|kv| kv.key.as_str() == key)
            .map(|kv| kv.value.to_string())
    };
    assert_eq!(
        attribute("entry_id").as_deref(),
        Some(published.entry_id.as_str())
    );
    assert_eq!(attribute("stream").as_deref(), Some(STREAM));
    assert_eq!(attribute("shard"), Some(published.shard.to_string()));

    // Inside a span, a batch carries the span's context in every entry, except where the caller
    // gave a traceparent of its own: that one is kept, alone.
    let own = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let batch_span = tracing::info_span!("batch");
    let batch = producer
        .publish_batch_with_headers(&[
            ("customer:2", json!({"n": 2}), Headers::new()),
            (
                "customer:3",
                json!({"n": 3}),
                Headers::new().with("traceparent", own),
            ),
        ])
        .instrument(batch_span.clone())
        .await
        .unwrap();
    let batch_context = batch_span.context().span().span_context().clone();
    drop(batch_span);
    let headers_of = |key: &str, id: &str| {
        seen.lock()
            .unwrap()
            .iter()
            .find(|(k, i, _)| k == key && i == id)
            .map(|(_, _, headers)| headers.clone())
    };
    assert!(
        wait_until(Duration::from_secs(10), || batch
            .iter()
            .all(|p| headers_of(&p.stream_key, &p.entry_id).is_some()))
        .await
    );
    assert_eq!(
        headers_of(&batch[0].stream_key, &batch[0].entry_id).unwrap(),
        Headers::new().with(
            "traceparent",
            format!(
                "00-{}-{}-01",
                batch_context.trace_id(),
                batch_context.span_id()
            )
        )
    );
    assert_eq!(
        headers_of(&batch[1].stream_key, &batch[1].entry_id).unwrap(),
        Headers::new().with("traceparent", own)
    );
    listener.shutdown_and_wait().await.expect("clean shutdown");
    provider.shutdown().unwrap();
}
