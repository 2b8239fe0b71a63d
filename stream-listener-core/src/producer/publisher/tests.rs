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
