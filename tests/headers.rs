//! Message headers on real Redis (docs/design.md §13.4): what `publish_with_headers` and its batch
//! form write (fields `h:<name>` after `key` and `payload`), that a listener's handler sees
//! exactly those headers in order, that a bad header name is refused with nothing written, and
//! that headers survive a dead letter and its replay.
//!
//! No tracing subscriber is installed in this test binary: although the root's dev-dependency
//! turns the `opentelemetry` feature on, no trace context is written here (tests/trace_context.rs
//! has that).

mod support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::AsyncCommands;
use serde_json::json;
use stream_listener::core::extract::{FromDelivery, FromDeliveryParts};
use stream_listener::core::internals::admin::{self, DeadLetterSelection};
use stream_listener::core::internals::connection::RedisConnection;
use stream_listener::{
    Delivery, HandlerError, Headers, Message, PublishError, Publisher, PublisherOptions,
};
use support::{Context, GROUP, STREAM, options, settle, start_listener, total_len, wait_until};

/// What the handler saw for one entry: (shard stream key, entry id, headers through
/// `Message<T>`, through the `Headers` extractor). Entry ids repeat across shards.
type Seen = Arc<Mutex<Vec<(String, String, Headers, Headers)>>>;

#[derive(Debug, serde::Deserialize)]
struct Order {
    n: u64,
}

/// A handler that records what it saw; it fails non-retryably on the numbers in `poisoned`.
fn recording(
    seen: &Seen,
    poisoned: &Arc<Mutex<Vec<u64>>>,
) -> impl Fn(
    Delivery,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), HandlerError>> + Send>>
+ Send
+ Sync
+ 'static {
    let (seen, poisoned) = (seen.clone(), poisoned.clone());
    move |delivery: Delivery| {
        let (seen, poisoned) = (seen.clone(), poisoned.clone());
        Box::pin(async move {
            let message = Message::<Order>::from_delivery(&delivery)?;
            let extracted = Headers::from_delivery_parts(&delivery, &())?;
            let n = message.payload.n;
            if poisoned.lock().unwrap().contains(&n) {
                return Err(HandlerError::non_retryable(format!("poison {n}")));
            }
            seen.lock().unwrap().push((
                delivery.stream_key.clone(),
                delivery.entry_id.clone(),
                message.headers().clone(),
                extracted,
            ));
            Ok(())
        })
    }
}

async fn publisher(conn: &RedisConnection) -> Publisher {
    Publisher::new(conn.clone(), STREAM, PublisherOptions::default())
        .await
        .unwrap()
}

/// An entry's fields as (name, bytes), in stored order.
async fn entry_fields(conn: &mut RedisConnection, key: &str, id: &str) -> Vec<(String, Vec<u8>)> {
    let reply: Vec<(String, Vec<Vec<u8>>)> = redis::cmd("XRANGE")
        .arg(key)
        .arg(id)
        .arg(id)
        .query_async(conn)
        .await
        .unwrap();
    assert_eq!(reply.len(), 1, "entry {id} of {key}");
    reply[0]
        .1
        .chunks(2)
        .map(|kv| (String::from_utf8(kv[0].clone()).unwrap(), kv[1].clone()))
        .collect()
}

fn fields(items: &[(&str, &[u8])]) -> Vec<(String, Vec<u8>)> {
    items
        .iter()
        .map(|(k, v)| ((*k).to_owned(), v.to_vec()))
        .collect()
}

/// The headers the handler saw for entry `id` of `stream_key`, once it was handled (both ways
/// of reading them must agree).
async fn seen_headers(seen: &Seen, stream_key: &str, id: &str) -> Headers {
    let this =
        |(key, entry, ..): &&(String, String, Headers, Headers)| key == stream_key && entry == id;
    let found = wait_until(Duration::from_secs(10), || {
        seen.lock().unwrap().iter().any(|e| this(&e))
    })
    .await;
    assert!(
        found,
        "entry {id} of {stream_key} not handled: {:?}",
        seen.lock().unwrap()
    );
    let all = seen.lock().unwrap();
    let (_, _, from_message, extracted) = all.iter().find(this).unwrap();
    assert_eq!(from_message, extracted);
    from_message.clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn published_headers_reach_the_handler_exactly_and_in_order() {
    let (_serial, _server, target, mut conn, _recorder) = Context::start(2).await.parts();
    let seen = Seen::default();
    let listener = start_listener(&target, recording(&seen, &Arc::default()), options(1)).await;
    settle(&mut conn, 1, Duration::from_secs(20)).await;
    let producer = publisher(&conn).await;

    let headers = Headers::new()
        .with("content-type", "application/json")
        .with("tag", "first")
        .with("Tag", "case matters")
        .with("tag", b"\x00\xffbinary".to_vec());
    let one = producer
        .publish_with_headers("customer:1", &json!({"n": 1}), &headers)
        .await
        .unwrap();
    // Stored as `key`, `payload`, then one `h:<name>` field per header, in order.
    assert_eq!(
        entry_fields(&mut conn, &one.stream_key, &one.entry_id).await,
        fields(&[
            ("key", b"customer:1"),
            ("payload", br#"{"n":1}"#),
            ("h:content-type", b"application/json"),
            ("h:tag", b"first"),
            ("h:Tag", b"case matters"),
            ("h:tag", b"\x00\xffbinary"),
        ])
    );
    let got = seen_headers(&seen, &one.stream_key, &one.entry_id).await;
    assert_eq!(got, headers);
    assert_eq!(got.get_str("tag"), Some("first"));
    assert_eq!(
        got.get_all("tag").collect::<Vec<_>>(),
        vec![&b"first"[..], &b"\x00\xffbinary"[..]]
    );

    // The batch form: each message its own headers; none at all is no header field.
    let batch = producer
        .publish_batch_with_headers(&[
            ("customer:2", json!({"n": 2}), Headers::new().with("a", "2")),
            ("customer:3", json!({"n": 3}), Headers::new()),
            (
                "customer:4",
                json!({"n": 4}),
                Headers::new().with("b", "4").with("a", "4"),
            ),
        ])
        .await
        .unwrap();
    assert_eq!(
        entry_fields(&mut conn, &batch[1].stream_key, &batch[1].entry_id).await,
        fields(&[("key", b"customer:3"), ("payload", br#"{"n":3}"#)])
    );
    assert_eq!(
        seen_headers(&seen, &batch[0].stream_key, &batch[0].entry_id).await,
        Headers::new().with("a", "2")
    );
    assert_eq!(
        seen_headers(&seen, &batch[1].stream_key, &batch[1].entry_id).await,
        Headers::new()
    );
    assert_eq!(
        seen_headers(&seen, &batch[2].stream_key, &batch[2].entry_id).await,
        Headers::new().with("b", "4").with("a", "4")
    );
    let plain = producer
        .publish("customer:5", &json!({"n": 5}))
        .await
        .unwrap();
    assert!(
        seen_headers(&seen, &plain.stream_key, &plain.entry_id)
            .await
            .is_empty()
    );

    // A producer in another language writes a header with a plain XADD.
    let id: String = redis::cmd("XADD")
        .arg(&one.stream_key)
        .arg("*")
        .arg("key")
        .arg("customer:1")
        .arg("payload")
        .arg(r#"{"n":6}"#)
        .arg("h:source")
        .arg("redis-cli")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        seen_headers(&seen, &one.stream_key, &id).await,
        Headers::new().with("source", "redis-cli")
    );
    listener.shutdown_and_wait().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_header_name_is_refused_with_a_typed_error_and_nothing_is_written() {
    let (_serial, _server, _target, mut conn, _recorder) = Context::start(2).await.parts();
    let producer = publisher(&conn).await;
    for (name, problem) in [
        ("new\nline", "contains a control character"),
        ("nul\0", "contains a control character"),
        ("", "is empty"),
    ] {
        let err = producer
            .publish_with_headers(
                "customer:1",
                &json!({"n": 1}),
                &Headers::new().with("fine", "v").with(name, "v"),
            )
            .await
            .unwrap_err();
        match err {
            PublishError::InvalidHeaderName {
                index: None,
                name: refused,
                problem: why,
            } => assert_eq!((refused.as_str(), why), (name, problem)),
            other => panic!("{name:?}: {other:?}"),
        }
    }
    // One bad name refuses the whole batch, naming its position.
    let err = producer
        .publish_batch_with_headers(&[
            (
                "customer:1",
                json!({"n": 1}),
                Headers::new().with("ok", "v"),
            ),
            (
                "customer:2",
                json!({"n": 2}),
                Headers::new().with("tab\t", "v"),
            ),
        ])
        .await
        .unwrap_err();
    assert!(
        matches!(
            &err,
            PublishError::InvalidHeaderName { index: Some(1), name, .. } if name == "tab\t"
        ),
        "{err:?}"
    );
    assert_eq!(total_len(&mut conn, STREAM, 2).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_survive_a_dead_letter_and_its_replay() {
    let (_serial, _server, target, mut conn, _recorder) = Context::start(2).await.parts();
    let seen = Seen::default();
    let poisoned = Arc::new(Mutex::new(vec![7]));
    let listener = start_listener(&target, recording(&seen, &poisoned), options(1)).await;
    settle(&mut conn, 1, Duration::from_secs(20)).await;
    let producer = publisher(&conn).await;
    let headers = Headers::new()
        .with("tenant", "acme")
        .with(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        )
        .with("tenant", "second");
    let original = producer
        .publish_with_headers("customer:7", &json!({"n": 7}), &headers)
        .await
        .unwrap();

    // Dead-lettered with every original field, the header fields included, in order.
    let dlq = format!("{STREAM}:dlq:{GROUP}");
    let end = Instant::now() + Duration::from_secs(20);
    while conn.xlen::<_, u64>(&dlq).await.unwrap() < 1 {
        assert!(Instant::now() < end, "no dead letter");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let dead = admin::list_dead_letters(&mut conn, STREAM, GROUP, None, 10)
        .await
        .unwrap()
        .dead_letters;
    assert_eq!(dead.len(), 1);
    let dead_fields = entry_fields(&mut conn, &dlq, &dead[0].id).await;
    let original_fields = entry_fields(&mut conn, &original.stream_key, &original.entry_id).await;
    assert_eq!(
        dead_fields[dead_fields.len() - original_fields.len()..],
        original_fields
    );

    // Replayed: the new entry has the same fields, and the handler the same headers.
    poisoned.lock().unwrap().clear();
    let report = admin::replay_dead_letters(
        &mut conn,
        STREAM,
        GROUP,
        DeadLetterSelection::Ids(vec![dead[0].id.clone()]),
        false,
    )
    .await
    .unwrap();
    assert_eq!(report.replayed.len(), 1, "{report:?}");
    let new_id = report.replayed[0].new_id.clone().unwrap();
    assert_eq!(
        entry_fields(&mut conn, &original.stream_key, &new_id).await,
        original_fields
    );
    assert_eq!(
        seen_headers(&seen, &original.stream_key, &new_id).await,
        headers
    );
    listener.shutdown_and_wait().await.expect("clean shutdown");
}
