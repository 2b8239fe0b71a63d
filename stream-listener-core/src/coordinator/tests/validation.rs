//! Requests the coordinator refuses, and timings it does not accept.

use super::*;

#[test]
fn malformed_requests_are_refused_and_change_nothing() {
    let mut f = Fixture::new(4);
    f.join("a");
    let before = f.group.clone();
    let cases: Vec<(HeartbeatRequest, CoordinatorError)> = vec![
        (
            HeartbeatRequest {
                protocol_version: 9,
                ..request("a", "p-a", 1, &[])
            },
            CoordinatorError::UnsupportedProtocolVersion {
                got: 9,
                supported: 1,
            },
        ),
        (
            request("", "p-a", 1, &[]),
            CoordinatorError::EmptyField { field: "memberId" },
        ),
        (
            request("a", "", 1, &[]),
            CoordinatorError::EmptyField { field: "processId" },
        ),
        (
            request("a", "p-a", -3, &[]),
            CoordinatorError::InvalidMemberEpoch(-3),
        ),
        (
            request("a", "p-a", 1, &[1, 1]),
            CoordinatorError::DuplicateShard {
                shard: 1,
                field: "ownedShards",
            },
        ),
        (
            HeartbeatRequest {
                revoking_shards: revoking(&[2], RevokeState::Draining),
                ..request("a", "p-a", 1, &[2])
            },
            CoordinatorError::DuplicateShard {
                shard: 2,
                field: "revokingShards",
            },
        ),
        (
            request("a", "p-a", 1, &[4]),
            CoordinatorError::ShardOutOfRange {
                shard: 4,
                field: "ownedShards",
                bound: 4,
            },
        ),
    ];
    for (bad, expected) in cases {
        assert_eq!(f.send_raw(&bad), Err(expected));
        assert_eq!(f.group, before);
    }
}

#[test]
fn heartbeat_interval_above_a_third_of_the_lease_is_refused() {
    let err = CoordinatorConfig::new(
        Duration::from_secs(6),
        Duration::from_secs(15),
        Duration::from_secs(60),
    );
    assert_eq!(
        err,
        Err(TimingsError::HeartbeatTooSlow {
            heartbeat_ms: 6000,
            lease_ms: 15000
        })
    );
    assert_eq!(
        CoordinatorConfig::new(
            Duration::ZERO,
            Duration::from_secs(15),
            Duration::from_secs(60)
        ),
        Err(TimingsError::Zero {
            name: "heartbeat_interval"
        })
    );
    assert!(
        CoordinatorConfig::new(
            Duration::from_secs(5),
            Duration::from_secs(15),
            Duration::from_secs(60)
        )
        .is_ok()
    );
    // Absurd values are refused instead of overflowing time arithmetic later.
    assert_eq!(
        CoordinatorConfig::new(
            Duration::from_secs(3),
            Duration::from_secs(600_000 * 365 * 86_400),
            Duration::from_secs(60)
        ),
        Err(TimingsError::TooLong {
            name: "member_lease_ttl",
            max_secs: 86_400
        })
    );
}
