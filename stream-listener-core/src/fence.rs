//! Per-shard fencing tokens (docs/design.md §8).
//!
//! Each shard has a fence hash `{<prefix>:<i>}:fence` with one field per consumer group holding the
//! token of the member process allowed to read, ack and claim there. These are the comparison
//! rules; the Redis scripts of the data plane implement exactly the same ones, and the coordinator
//! simulation uses these functions to model them.

use serde::{Deserialize, Serialize};

use crate::model::{COUNTER_LIMIT, Epoch, Micros};

/// A fencing token: `(incarnation, memberEpoch, memberId, processId)` as of the heartbeat response
/// that gave the member the shard. Tokens are ordered by `(incarnation, memberEpoch)` only; two
/// different tokens with the same pair are *not* ordered (neither may replace the other).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FenceToken {
    /// The group incarnation (µs) of the response.
    pub incarnation: Micros,
    /// The member epoch of the response.
    pub member_epoch: Epoch,
    /// The member id.
    pub member_id: String,
    /// The member's process id.
    pub process_id: String,
}

/// The answer of a fence script (docs/design.md §8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FenceVerdict {
    /// The fence holds this token (after a raise: it was accepted): go on.
    Equal,
    /// The fence is below the token: a raise was lost in a failover. Re-check lease and
    /// assignment, raise again, retry.
    Lower,
    /// The fence holds a higher or a competing token: stop using the shard and report the conflict.
    Higher,
}

impl FenceToken {
    fn order_key(&self) -> (Micros, Epoch) {
        (self.incarnation, self.member_epoch)
    }

    /// Raises `fence` to `self` when `self` is strictly higher by `(incarnation, memberEpoch)` (or
    /// the fence is empty); accepts the same token again. Returns the verdict and the fence value
    /// after the script: `Equal` when the fence now holds `self`, `Higher` when it holds a token
    /// that `self` may not replace (left unchanged).
    pub fn raise(&self, fence: Option<&FenceToken>) -> (FenceVerdict, FenceToken) {
        match fence {
            Some(current) if current == self => (FenceVerdict::Equal, self.clone()),
            Some(current) if current.order_key() >= self.order_key() => {
                (FenceVerdict::Higher, current.clone())
            }
            _ => (FenceVerdict::Equal, self.clone()),
        }
    }

    /// The value stored in a fence hash field: `<incarnation>:<memberEpoch>:<processId>:<memberId>`
    /// (the member id last, so it may contain `:`). Scripts compare the first two numerically.
    pub fn encode(&self) -> String {
        format!(
            "{}:{}:{}:{}",
            self.incarnation, self.member_epoch, self.process_id, self.member_id
        )
    }

    /// Parses [`FenceToken::encode`]'s format; `None` when `value` is not such a token, or when
    /// its incarnation or epoch is at or above [`COUNTER_LIMIT`] (by absolute value): no real
    /// token gets there, and a correction round must be able to start a higher incarnation and
    /// epoch (`+ 1`) above every token found, so such a value is treated as corrupt, like any
    /// other value that is not a token (fail closed: an operator deletes the fence field).
    pub fn decode(value: &str) -> Option<FenceToken> {
        let mut parts = value.splitn(4, ':');
        let incarnation: Micros = parts.next()?.parse().ok()?;
        let member_epoch: Epoch = parts.next()?.parse().ok()?;
        if incarnation >= COUNTER_LIMIT || member_epoch.unsigned_abs() >= COUNTER_LIMIT {
            return None;
        }
        let process_id = parts.next()?.to_owned();
        let member_id = parts.next()?.to_owned();
        Some(FenceToken {
            incarnation,
            member_epoch,
            member_id,
            process_id,
        })
    }

    /// Checks `fence` before a read, ack or claim: `Equal` only when it holds exactly `self`.
    pub fn check(&self, fence: Option<&FenceToken>) -> FenceVerdict {
        match fence {
            Some(current) if current == self => FenceVerdict::Equal,
            Some(current) if current.order_key() >= self.order_key() => FenceVerdict::Higher,
            _ => FenceVerdict::Lower,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::fixtures::fence_token as token;

    #[test]
    fn raise_accepts_only_strictly_higher_or_same_token() {
        let a5 = token(1, 5, "a");
        assert_eq!(a5.raise(None), (FenceVerdict::Equal, a5.clone()));
        assert_eq!(a5.raise(Some(&a5)), (FenceVerdict::Equal, a5.clone()));
        let b6 = token(1, 6, "b");
        assert_eq!(b6.raise(Some(&a5)), (FenceVerdict::Equal, b6.clone()));
        assert_eq!(a5.raise(Some(&b6)), (FenceVerdict::Higher, b6.clone()));
        // Same (incarnation, epoch), another member: neither replaces the other.
        let b5 = token(1, 5, "b");
        assert_eq!(b5.raise(Some(&a5)), (FenceVerdict::Higher, a5.clone()));
        // A new incarnation wins whatever the epoch.
        let c1 = token(2, 1, "c");
        assert_eq!(c1.raise(Some(&b6)), (FenceVerdict::Equal, c1.clone()));
    }

    #[test]
    fn tokens_round_trip_through_their_stored_form() {
        let t = FenceToken {
            incarnation: 1_747_303_200_000_000,
            member_epoch: 12,
            member_id: "pod:1-m0".into(),
            process_id: "0190a1b2-c3d4".into(),
        };
        assert_eq!(t.encode(), "1747303200000000:12:0190a1b2-c3d4:pod:1-m0");
        assert_eq!(FenceToken::decode(&t.encode()), Some(t));
        assert_eq!(FenceToken::decode("12:x:p:m"), None);
        assert_eq!(FenceToken::decode("12"), None);
        // At the counter limit: corrupt, whatever the rest.
        assert_eq!(FenceToken::decode("18446744073709551615:1:p:m"), None);
        assert_eq!(FenceToken::decode("4611686018427387904:1:p:m"), None);
        assert_eq!(FenceToken::decode("1:9223372036854775807:p:m"), None);
        assert!(FenceToken::decode("4611686018427387903:1:p:m").is_some());
    }

    #[test]
    fn check_distinguishes_lost_raise_from_conflict() {
        let a5 = token(1, 5, "a");
        assert_eq!(a5.check(Some(&a5)), FenceVerdict::Equal);
        assert_eq!(a5.check(None), FenceVerdict::Lower);
        assert_eq!(a5.check(Some(&token(1, 4, "z"))), FenceVerdict::Lower);
        assert_eq!(a5.check(Some(&token(1, 6, "b"))), FenceVerdict::Higher);
        assert_eq!(a5.check(Some(&token(1, 5, "b"))), FenceVerdict::Higher);
    }
}
