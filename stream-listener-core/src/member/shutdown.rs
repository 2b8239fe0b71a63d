//! [`ShutdownError`]: what was not clean in a graceful shutdown (docs/design.md §8.13, §14.5).

use std::time::Duration;

use crate::model::ShardIndex;
use crate::store::StoreError;

/// Why a graceful shutdown ([`super::ListenerHandle::shutdown_and_wait`], `join`) was not
/// clean. Every member has stopped either way, and nothing is lost (at-least-once): what a
/// cancelled handler had stays pending for the shard's next owner, and a member whose leave was
/// lost is expired when its lease runs out, its shards then moving.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum ShutdownError {
    /// A shard's handler still ran after `shutdown_timeout`: it was cancelled, its entry not
    /// acked (handled again by the shard's next owner). Raise `shutdown_timeout`, or make the
    /// handler return sooner (`Delivery::ownership_token` ends at shutdown).
    #[error(
        "listener `{listener}` (stream {stream:?}, group {group:?}): the handler of shard {shard} on member {member_id} still ran after shutdown_timeout ({}): cancelled, its entry stays pending for the next owner; raise shutdown_timeout or let the handler stop when its ownership ends",
        humantime::format_duration(*shutdown_timeout)
    )]
    HandlerCancelled {
        /// The listener's name (`ListenerOptions::name`).
        listener: String,
        /// The stream prefix.
        stream: String,
        /// The consumer group.
        group: String,
        /// The member that ran it.
        member_id: String,
        /// The shard.
        shard: ShardIndex,
        /// The `shutdown_timeout` it ran past.
        shutdown_timeout: Duration,
    },
    /// A member's leave heartbeat did not reach Redis: its shards move to the other members
    /// only when its lease expires (`member_lease_ttl`), not at once.
    #[error(
        "listener `{listener}` (stream {stream:?}, group {group:?}): member {member_id} could not leave the group: its shards move when its lease expires"
    )]
    LeaveNotDelivered {
        /// The listener's name (`ListenerOptions::name`).
        listener: String,
        /// The stream prefix.
        stream: String,
        /// The consumer group.
        group: String,
        /// The member.
        member_id: String,
        /// Why the leave failed (boxed: the error stays small on the happy path's `Result`).
        #[source]
        source: Box<StoreError>,
    },
    /// More than one of the above, in member order.
    #[error("{} problems in the shutdown: {}", .0.len(), list(.0))]
    Several(Vec<ShutdownError>),
}

crate::report::readable_debug!(ShutdownError);

impl ShutdownError {
    /// `Ok` for no problems, the one problem, or [`ShutdownError::Several`].
    pub(super) fn from_problems(mut problems: Vec<ShutdownError>) -> Result<(), ShutdownError> {
        match problems.len() {
            0 => Ok(()),
            1 => Err(problems.remove(0)),
            _ => Err(ShutdownError::Several(problems)),
        }
    }

    /// Every problem, [`ShutdownError::Several`] flattened.
    pub fn problems(&self) -> Vec<&ShutdownError> {
        match self {
            ShutdownError::Several(all) => all.iter().flat_map(ShutdownError::problems).collect(),
            one => vec![one],
        }
    }
}

/// The problems' messages with their causes, `; `-separated.
fn list(problems: &[ShutdownError]) -> String {
    problems
        .iter()
        .map(|p| crate::report::Chain(p).to_string())
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cancelled(shard: ShardIndex) -> ShutdownError {
        ShutdownError::HandlerCancelled {
            listener: "on_order".into(),
            stream: "orders".into(),
            group: "billing".into(),
            member_id: "m-m0".into(),
            shard,
            shutdown_timeout: Duration::from_millis(300),
        }
    }

    #[test]
    fn no_problem_is_ok_one_is_itself_more_are_several() {
        assert!(ShutdownError::from_problems(Vec::new()).is_ok());
        let one = ShutdownError::from_problems(vec![cancelled(1)]).unwrap_err();
        assert!(matches!(
            one,
            ShutdownError::HandlerCancelled { shard: 1, .. }
        ));
        let two = ShutdownError::from_problems(vec![cancelled(1), cancelled(2)]).unwrap_err();
        assert_eq!(two.problems().len(), 2);
        let text = format!("{two:?}");
        assert!(text.starts_with("2 problems in the shutdown: "), "{text}");
        assert!(
            text.contains("shard 1 ") && text.contains("shard 2 "),
            "{text}"
        );
        assert!(text.contains("shutdown_timeout (300ms)"), "{text}");
    }
}
