//! The key layout in Redis (docs/design.md §2) and the names that build it.
//!
//! Every multi-key command or script touches keys of one hash slot only: a shard stream
//! `{<prefix>:<i>}` and its fence, attempts hash and read gates share the slot of their whole
//! name; the stream metadata has the slot of `{<prefix>}`; a group's hash, leases and history
//! share the slot of `{<prefix>:<group>}`.
//! So a prefix may not contain `{` or `}` (it would move keys to other slots), and a group name
//! may not contain `:`, `{` or `}` (`orders` + `a:b` and `orders:a` + `b` would share keys).

use crate::model::ShardIndex;

/// The index of stream prefixes: a set, rebuildable, never a source of truth.
pub const STREAMS_INDEX_KEY: &str = "sl:streams";

/// Longest accepted stream prefix or group name, in bytes.
pub const MAX_NAME_LEN: usize = 200;

/// A stream prefix or consumer group name that cannot be used.
#[derive(Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NameError {
    /// Empty name.
    #[error("{kind} name is empty: give a non-empty name")]
    Empty {
        /// `stream prefix` or `consumer group`.
        kind: &'static str,
    },
    /// A character the key layout cannot carry.
    #[error(
        "{kind} name {name:?} contains {found:?}, which is not allowed ({reason}); choose a name without {forbidden}"
    )]
    ForbiddenCharacter {
        /// `stream prefix` or `consumer group`.
        kind: &'static str,
        /// The name.
        name: String,
        /// The first forbidden character found.
        found: char,
        /// Why it is forbidden.
        reason: &'static str,
        /// The forbidden characters.
        forbidden: &'static str,
    },
    /// Longer than [`MAX_NAME_LEN`].
    #[error("{kind} name is {len} bytes long; the limit is {max}")]
    TooLong {
        /// `stream prefix` or `consumer group`.
        kind: &'static str,
        /// Its length in bytes.
        len: usize,
        /// [`MAX_NAME_LEN`].
        max: usize,
    },
}

crate::report::readable_debug!(NameError);

fn check_name(
    kind: &'static str,
    name: &str,
    forbidden: &'static str,
    reason: &'static str,
) -> Result<(), NameError> {
    if name.is_empty() {
        return Err(NameError::Empty { kind });
    }
    if name.len() > MAX_NAME_LEN {
        return Err(NameError::TooLong {
            kind,
            len: name.len(),
            max: MAX_NAME_LEN,
        });
    }
    let bad = name
        .chars()
        .find(|c| forbidden.contains(*c) || c.is_control() || c.is_whitespace());
    match bad {
        Some(found) => Err(NameError::ForbiddenCharacter {
            kind,
            name: name.to_owned(),
            found,
            reason: match found {
                '{' | '}' | ':' => reason,
                _ => "whitespace and control characters make keys hard to type and to read",
            },
            forbidden: if forbidden.contains(':') {
                "':', '{', '}', whitespace or control characters"
            } else {
                "'{', '}', whitespace or control characters"
            },
        }),
        None => Ok(()),
    }
}

/// Checks a stream prefix: non-empty, at most [`MAX_NAME_LEN`] bytes, no `{`, `}`, whitespace or
/// control characters.
///
/// # Errors
/// [`NameError`] saying what is wrong.
pub fn validate_stream_prefix(prefix: &str) -> Result<(), NameError> {
    check_name(
        "stream prefix",
        prefix,
        "{}",
        "braces would change the Redis Cluster hash slot of its keys",
    )
}

/// Checks a consumer group name: as a prefix, and no `:` either.
///
/// # Errors
/// [`NameError`] saying what is wrong.
pub fn validate_group_name(group: &str) -> Result<(), NameError> {
    check_name(
        "consumer group",
        group,
        "{}:",
        "braces would change hash slots and ':' would let two groups share keys",
    )
}

/// The keys of one sharded stream (docs/design.md §2).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StreamKeys {
    prefix: String,
}

impl StreamKeys {
    /// Keys of the stream `prefix`.
    ///
    /// # Errors
    /// [`NameError`] when the prefix is not valid ([`validate_stream_prefix`]).
    pub fn new(prefix: &str) -> Result<Self, NameError> {
        validate_stream_prefix(prefix)?;
        Ok(StreamKeys {
            prefix: prefix.to_owned(),
        })
    }

    /// The stream prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The shard stream `{<prefix>:<i>}`.
    pub fn shard(&self, shard: ShardIndex) -> String {
        format!("{{{}:{shard}}}", self.prefix)
    }

    /// The fence hash `{<prefix>:<i>}:fence` of shard `i` (one field per consumer group).
    pub fn fence(&self, shard: ShardIndex) -> String {
        format!("{{{}:{shard}}}:fence", self.prefix)
    }

    /// The handler-attempt hash `{<prefix>:<i>}:attempts` of shard `i`: field
    /// `<group>|<entry id>`, the number of handler attempts started on a re-delivered entry
    /// (delivery count above 1), removed once it is acked or dead-lettered (docs/design.md §8.9).
    pub fn attempts(&self, shard: ShardIndex) -> String {
        format!("{{{}:{shard}}}:attempts", self.prefix)
    }

    /// The read gate `{<prefix>:<i>}:gate:<group>:<token>` of shard `i` for one consumer group
    /// and one fencing token (`token`: [`crate::fence::FenceToken::encode`]): an empty stream with
    /// that consumer group, which a strict read and a strict wait name in their `XREADGROUP`
    /// (docs/design.md §8.16). It exists only while the shard's fence holds `token`: the fence
    /// check that passes for `token` creates it, a check that refuses deletes it, and the raise
    /// of another token deletes it, which also ends a wait blocked on it. Never written to. Listed
    /// in the shard's [`StreamKeys::gate_registry`]. In the shard's slot, and matched by the
    /// listener's shard key pattern `{<prefix>:[0-9]*`; not by the producer's
    /// (`{<prefix>:[0-9]*}`), and never taken for a shard: shards are named in the stream
    /// metadata, not found by pattern.
    pub fn gate(&self, shard: ShardIndex, group: &GroupKeys, token: &str) -> String {
        format!("{{{}:{shard}}}:gate:{}:{token}", self.prefix, group.group)
    }

    /// The read gates' registry `{<prefix>:<i>}:gates` of shard `i`: a set of the gate keys
    /// ([`StreamKeys::gate`]) that exist on the shard, of every group. A raise deletes what it
    /// lists for its group, so a gate is closed even when the fence value it belonged to was lost
    /// (docs/design.md §8.16).
    pub fn gate_registry(&self, shard: ShardIndex) -> String {
        format!("{{{}:{shard}}}:gates", self.prefix)
    }

    /// The read gate `{<prefix>:<i>}:gate:<group>` of versions before gates were per token: only
    /// deleted (consumer hygiene and the admin deletions), never created.
    pub fn legacy_gate(&self, shard: ShardIndex, group: &GroupKeys) -> String {
        format!("{{{}:{shard}}}:gate:{}", self.prefix, group.group)
    }

    /// The stream metadata hash `sl:{<prefix>}:stream`.
    pub fn metadata(&self) -> String {
        format!("sl:{{{}}}:stream", self.prefix)
    }

    /// The dead-letter stream `<prefix>:dlq:<group>` of a group.
    pub fn dead_letters(&self, group: &GroupKeys) -> String {
        format!("{}:dlq:{}", self.prefix, group.group)
    }

    /// The keys of consumer group `group` on this stream.
    ///
    /// # Errors
    /// [`NameError`] when the group name is not valid ([`validate_group_name`]).
    pub fn group(&self, group: &str) -> Result<GroupKeys, NameError> {
        validate_group_name(group)?;
        Ok(GroupKeys {
            prefix: self.prefix.clone(),
            group: group.to_owned(),
        })
    }
}

/// The coordinator keys of one consumer group (docs/design.md §2), all in the slot of
/// `{<prefix>:<group>}`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct GroupKeys {
    prefix: String,
    group: String,
}

impl GroupKeys {
    /// The consumer group name.
    pub fn group(&self) -> &str {
        &self.group
    }

    /// The stream prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The group hash `sl:{<prefix>:<group>}:group`.
    pub fn metadata(&self) -> String {
        format!("sl:{{{}:{}}}:group", self.prefix, self.group)
    }

    /// The lease sorted set `sl:{<prefix>:<group>}:leases` (member id → expiry in µs).
    pub fn leases(&self) -> String {
        format!("sl:{{{}:{}}}:leases", self.prefix, self.group)
    }

    /// The capped history list `sl:{<prefix>:<group>}:history`.
    pub fn history(&self) -> String {
        format!("sl:{{{}:{}}}:history", self.prefix, self.group)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_follow_the_design_layout() {
        let stream = StreamKeys::new("orders").unwrap();
        let group = stream.group("billing").unwrap();
        assert_eq!(stream.shard(3), "{orders:3}");
        assert_eq!(stream.fence(3), "{orders:3}:fence");
        assert_eq!(
            stream.gate(3, &group, "7:2:p:m0"),
            "{orders:3}:gate:billing:7:2:p:m0"
        );
        assert_eq!(stream.gate_registry(3), "{orders:3}:gates");
        assert_eq!(stream.legacy_gate(3, &group), "{orders:3}:gate:billing");
        assert_eq!(stream.metadata(), "sl:{orders}:stream");
        assert_eq!(stream.dead_letters(&group), "orders:dlq:billing");
        assert_eq!(group.metadata(), "sl:{orders:billing}:group");
        assert_eq!(group.leases(), "sl:{orders:billing}:leases");
        assert_eq!(group.history(), "sl:{orders:billing}:history");
    }

    #[test]
    fn braces_in_a_prefix_are_rejected_with_a_clear_error() {
        for bad in ["{orders}", "orders}{", "{}orders", "a{b"] {
            let err = StreamKeys::new(bad).unwrap_err();
            assert!(matches!(err, NameError::ForbiddenCharacter { .. }), "{bad}");
            assert!(err.to_string().contains("not allowed"), "{err}");
        }
        assert_eq!(
            StreamKeys::new(""),
            Err(NameError::Empty {
                kind: "stream prefix"
            })
        );
        assert!(matches!(
            StreamKeys::new(&"x".repeat(201)),
            Err(NameError::TooLong { len: 201, .. })
        ));
        assert!(StreamKeys::new("orders.v2-eu_1").is_ok());
    }

    #[test]
    fn group_names_reject_colons_and_braces() {
        let stream = StreamKeys::new("orders").unwrap();
        for bad in ["a:b", "{g}", "g}", "two words"] {
            assert!(stream.group(bad).is_err(), "{bad}");
        }
        assert!(stream.group("billing-v2").is_ok());
    }
}
