//! Tests of the publisher's options and of routing from the stream metadata.

use super::*;
use crate::model::{ShardInfo, ShardState, StreamMetadata};

fn meta(shard_count: u32, shards: &[(u32, ShardState)]) -> StreamMetadata {
    StreamMetadata {
        stream_prefix: "orders".into(),
        shard_count,
        shards: shards
            .iter()
            .map(|&(shard_index, state)| ShardInfo { shard_index, state })
            .collect(),
        metadata_version: 7,
        groups: Vec::new(),
        migration: None,
        updated_at: "2026-11-29T00:00:00Z".into(),
        revision: 1,
    }
}

#[test]
fn default_options_are_the_documented_ones() {
    let o = PublisherOptions::default();
    assert_eq!(o.max_payload_bytes, 1 << 20);
    assert_eq!(o.maxlen, None);
    assert_eq!(o.refresh_interval, Duration::from_secs(5));
    assert_eq!(o.routing_lease, Duration::from_secs(30));
    assert!(o.validate().is_ok());
}

#[test]
fn options_that_cannot_work_are_refused() {
    let bad = [
        PublisherOptions {
            max_payload_bytes: 0,
            ..Default::default()
        },
        PublisherOptions {
            maxlen: Some(0),
            ..Default::default()
        },
        PublisherOptions {
            routing_lease: Duration::ZERO,
            refresh_interval: Duration::ZERO,
            ..Default::default()
        },
        PublisherOptions {
            refresh_interval: Duration::from_secs(30),
            ..Default::default()
        },
        PublisherOptions {
            min_replica_acks: 1,
            replica_ack_timeout: Duration::ZERO,
            ..Default::default()
        },
    ];
    for options in bad {
        let err = options.validate().unwrap_err();
        assert!(
            matches!(err, PublishError::InvalidOptions { .. }),
            "{options:?}"
        );
    }
}

#[test]
fn routing_requires_active_shards_below_the_count() {
    let keys = StreamKeys::new("orders").unwrap();
    let ok = meta(
        2,
        &[
            (0, ShardState::Active),
            (1, ShardState::Active),
            (2, ShardState::Draining),
        ],
    );
    let routing = Routing::from_metadata(&keys, &ok).unwrap();
    assert_eq!(routing.shard_keys, ["{orders:0}", "{orders:1}"]);
    assert_eq!(routing.metadata_version, 7);

    let draining_below = meta(2, &[(0, ShardState::Active), (1, ShardState::Draining)]);
    let missing = meta(2, &[(0, ShardState::Active)]);
    let mut other_prefix = ok.clone();
    other_prefix.stream_prefix = "payments".into();
    for bad in [draining_below, missing, other_prefix] {
        let err = Routing::from_metadata(&keys, &bad).unwrap_err();
        assert!(
            matches!(err, PublishError::InconsistentMetadata { .. }),
            "{err}"
        );
    }
    let drained = meta(0, &[(0, ShardState::Retired)]);
    assert_eq!(
        Routing::from_metadata(&keys, &drained).unwrap().shard_count,
        0
    );
}

#[test]
fn error_messages_say_what_to_do() {
    let too_large = PublishError::PayloadTooLarge {
        index: Some(3),
        size: 2_000_000,
        limit: 1_048_576,
    };
    let text = too_large.to_string();
    assert!(text.contains("message #3"), "{text}");
    assert!(text.contains("2000000 bytes"), "{text}");
    assert!(text.contains("1048576"), "{text}");
    let single = PublishError::PayloadTooLarge {
        index: None,
        size: 10,
        limit: 5,
    };
    assert!(single.to_string().starts_with("payload is 10 bytes"));
}

#[test]
fn a_message_with_headers_is_written_as_payload_then_prefixed_header_fields() {
    let headers = Headers::new()
        .with("content-type", "application/json")
        .with("tag", "a")
        .with("tag", b"\x00\xff".to_vec());
    let trace = Headers::new().with(
        "traceparent",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    );
    let message = Encoded::new(br#"{"id":1}"#.to_vec(), &headers, &trace);
    assert_eq!(
        message.fields(),
        vec![
            ("payload", &br#"{"id":1}"#[..]),
            ("h:content-type", &b"application/json"[..]),
            ("h:tag", &b"a"[..]),
            ("h:tag", &b"\x00\xff"[..]),
            (
                "h:traceparent",
                &b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"[..]
            ),
        ]
    );
    // The JSON, then each header field's name and value.
    assert_eq!(
        message.size(),
        8 + (14 + 16) + (5 + 1) + (5 + 2) + (13 + 55)
    );
    let plain = Encoded::new(b"1".to_vec(), &Headers::new(), &Headers::new());
    assert_eq!(plain.fields(), vec![("payload", &b"1"[..])]);
    assert_eq!(plain.size(), 1);
}

#[test]
fn a_bad_header_name_is_refused_with_its_position() {
    assert!(check_header_names(&Headers::new().with("ok", "v"), None).is_ok());
    let err = check_header_names(
        &Headers::new().with("ok", "v").with("bad\r\n", "v"),
        Some(3),
    )
    .unwrap_err();
    match &err {
        PublishError::InvalidHeaderName {
            index,
            name,
            problem,
        } => assert_eq!(
            (*index, name.as_str(), *problem),
            (Some(3), "bad\r\n", "contains a control character")
        ),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        err.to_string(),
        "header name \"bad\\r\\n\" of message #3 of the batch contains a control character; header names must be non-empty text without control characters (they are the entry field `h:<name>`, read as text by consumers in any language)"
    );
}

#[test]
fn without_a_current_span_no_trace_context_is_added() {
    assert!(trace_headers(&Headers::new()).is_empty());
}
