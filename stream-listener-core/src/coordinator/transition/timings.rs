//! Each member's own timings (docs/design.md §6.5).

use crate::coordinator::CoordinatorConfig;
use crate::model::{HeartbeatResponse, MemberMetadata, Micros};

pub(super) fn ms(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Records `config` (that of the requesting process) as the member's own timings (docs/design.md
/// §6.5).
pub(super) fn record_timings(member: &mut MemberMetadata, config: &CoordinatorConfig) {
    member.heartbeat_interval_ms = ms(config.heartbeat_interval);
    member.member_lease_ttl_ms = ms(config.member_lease_ttl);
    member.rebalance_timeout_ms = ms(config.rebalance_timeout);
}

/// A recorded timing in ms, or `fallback` when it was not recorded (`0`: data written before
/// members' own timings were).
pub(super) fn recorded_or(recorded_ms: u64, fallback: std::time::Duration) -> u64 {
    if recorded_ms == 0 {
        ms(fallback)
    } else {
        recorded_ms
    }
}

/// The member's own lease TTL (µs): the one its lease was last renewed with.
pub(crate) fn member_lease_ttl_us(member: &MemberMetadata, config: &CoordinatorConfig) -> Micros {
    recorded_or(member.member_lease_ttl_ms, config.member_lease_ttl).saturating_mul(1000)
}

pub(super) fn member_rebalance_timeout_us(
    member: &MemberMetadata,
    config: &CoordinatorConfig,
) -> Micros {
    recorded_or(member.rebalance_timeout_ms, config.rebalance_timeout).saturating_mul(1000)
}

/// `response` with the member's own timings: every member adopts the interval and TTL of the
/// responses it gets, whichever member's transition wrote them.
pub(super) fn with_own_timings(
    response: HeartbeatResponse,
    member: &MemberMetadata,
    config: &CoordinatorConfig,
) -> HeartbeatResponse {
    HeartbeatResponse {
        heartbeat_interval_ms: recorded_or(member.heartbeat_interval_ms, config.heartbeat_interval),
        member_lease_ttl_ms: recorded_or(member.member_lease_ttl_ms, config.member_lease_ttl),
        rebalance_timeout_ms: recorded_or(member.rebalance_timeout_ms, config.rebalance_timeout),
        ..response
    }
}
