//! Malformed coordination data (docs/design.md §5.6): garbage written into each key of
//! docs/design.md §2 in turn, while a member reads. Every case ends in one of two ways: the store
//! repairs the value (the fast path falls back to the full transition, which rewrites what it
//! derives) and the member goes on, or the member stops with a typed error that names the key (and
//! field) and says what to do; once an operator puts the key back, the member goes on. Never a
//! panic, a wrapped counter or a group stuck without a word; and every entry published before,
//! during and after is handled exactly once in the end.
//!
//! One table of cases, one loop, one server; each case has its own stream prefix. The member is
//! driven by hand (a [`GroupStore`] heartbeat, then the fenced reads and acks of a
//! [`ShardClient`]), so each step's errors are seen as the runtime sees them. Each heartbeat uses
//! a fresh store, as a restarted member would, so no cached stream view hides a corrupt value.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use redis::AsyncCommands;
use stream_listener::core::internals::admin;
use stream_listener::core::internals::connection::{RedisConnection, RedisTarget};
use stream_listener::core::internals::coordinator::{CoordinatorConfig, CoordinatorError};
use stream_listener::core::internals::dataplane::{
    DeadLetterReason, Fenced, FencingMode, ReadOutcome, ShardClient, ShardEntry,
};
use stream_listener::core::internals::fence::FenceToken;
use stream_listener::core::internals::keys::StreamKeys;
use stream_listener::core::internals::report::Chain;
use stream_listener::core::internals::store::{GroupStore, StoreError};
use stream_listener::core::model::{
    FenceConflict, HeartbeatRequest, HeartbeatStatus, RevokeState, StartFrom,
};
use stream_listener::testing::RedisServer;
use stream_listener::testing::fixtures::{heartbeat_request, revoking};

const GROUP: &str = "g";
const MEMBER: &str = "a";
const PROCESS: &str = "proc-a";
const SHARDS: u32 = 2;
/// Steps a phase may take before the test gives up (each step is a few Redis round trips).
const MAX_STEPS: usize = 30;

/// The keys of docs/design.md §2 a case can corrupt (shard 0 for the per-shard ones).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Key {
    Stream,
    Group,
    Leases,
    History,
    Fence,
    Shard,
    Index,
    DeadLetters,
}

/// One write of garbage.
#[derive(Debug, Clone, Copy)]
enum Act {
    /// `HSET key field value`.
    HSet(Key, &'static str, &'static str),
    /// `HSET key field value` with bytes that need not be UTF-8.
    HSetBytes(Key, &'static [u8], &'static [u8]),
    /// `ZADD key score member` with a member that need not be UTF-8.
    ZAddBytes(Key, &'static [u8], &'static str),
    /// `HDEL key field`.
    HDel(Key, &'static str),
    /// Rewrites a hash field's current value.
    Edit(Key, &'static str, fn(&str) -> String),
    /// `ZADD key score member` (score as Redis parses it: `inf`, `1e300`, ...).
    ZAdd(Key, &'static str, &'static str),
    /// `LPUSH key value`.
    LPush(Key, &'static str),
    /// Replaces the key by a string.
    WrongType(Key),
}

/// What must happen while the garbage is there.
#[derive(Debug, Clone, Copy)]
enum Expect {
    /// The store repairs it: no step fails, the key is not restored.
    Repairs,
    /// Not read on the member's path: no step fails; restored afterwards (other cases need it).
    Ignored,
    /// Some step fails with an error naming `key` (when given) and containing the text; restored
    /// afterwards, as an operator would, and then the member goes on.
    Stops(Option<Key>, &'static str),
    /// As `Stops`, and the heartbeat itself fails so: the fast path does not step around it.
    StopsHeartbeat(Key, &'static str),
}

struct Case {
    name: &'static str,
    acts: &'static [Act],
    expect: Expect,
}

fn set_json(value: &str, edit: impl FnOnce(&mut serde_json::Value)) -> String {
    let mut json: serde_json::Value = serde_json::from_str(value).unwrap();
    edit(&mut json);
    json.to_string()
}

/// µs since 1970 in the year 2223: a valid counter (below 2^53), but later than any deadline
/// the coordinator sets (now + at most a day).
const FAR_FUTURE: u64 = 8_000_000_000_000_000;

/// The full path runs only when the fast path does not answer: deleting `steady` forces it.
const FULL: Act = Act::HDel(Key::Group, "steady");

fn cases() -> Vec<Case> {
    use Act::*;
    use Expect::*;
    use Key::*;
    vec![
        // ---- stream metadata hash ----
        Case {
            name: "stream meta not JSON",
            acts: &[HSet(Stream, "meta", "{not json"), FULL],
            expect: Stops(Some(Stream), "meta"),
        },
        Case {
            name: "stream meta with a shard index at u32::MAX",
            acts: &[
                Edit(Stream, "meta", |v| {
                    set_json(v, |j| j["shards"][1]["shardIndex"] = u32::MAX.into())
                }),
                FULL,
            ],
            expect: Stops(Some(Stream), "shard index"),
        },
        Case {
            // A stored name reached the admin tool's `keys.group(..)?` as an invalid-name error,
            // which the tool reports as a usage error (exit 2) though its arguments were fine.
            name: "stream meta with a registered group name that cannot be used",
            acts: &[
                Edit(Stream, "meta", |v| {
                    set_json(v, |j| j["groups"][0]["consumerGroup"] = "a:b".into())
                }),
                FULL,
            ],
            expect: Stops(Some(Stream), "cannot be used"),
        },
        Case {
            name: "stream revision not a number",
            acts: &[HSet(Stream, "revision", "twelve"), FULL],
            expect: Stops(Some(Stream), "revision"),
        },
        Case {
            name: "stream metadataVersion not a number",
            acts: &[HSet(Stream, "metadataVersion", "v2")],
            expect: Stops(Some(Stream), "metadataVersion"),
        },
        Case {
            name: "stream metadataVersion above u64",
            acts: &[HSet(Stream, "metadataVersion", "18446744073709551616")],
            expect: Stops(Some(Stream), "metadataVersion"),
        },
        Case {
            name: "stream schema unknown",
            acts: &[HSet(Stream, "schema", "2"), FULL],
            expect: Stops(Some(Stream), "schema"),
        },
        Case {
            name: "stream schema missing",
            acts: &[HDel(Stream, "schema"), FULL],
            expect: Stops(Some(Stream), "schema"),
        },
        Case {
            name: "stream metadata hash of the wrong type",
            acts: &[WrongType(Stream)],
            expect: Stops(Some(Stream), "not a hash"),
        },
        // ---- group hash ----
        Case {
            name: "group member JSON not UTF-8",
            acts: &[
                HSetBytes(Group, b"member:a", b"{\"memberId\":\"\xff\xfe\"}"),
                FULL,
            ],
            expect: Stops(Some(Group), "field member:a is not UTF-8"),
        },
        Case {
            name: "group hash field name not UTF-8",
            acts: &[HSetBytes(Group, b"member:\xff", b"{}"), FULL],
            expect: Stops(Some(Group), "a field name that is not UTF-8"),
        },
        Case {
            name: "lease of a member id that is not UTF-8",
            acts: &[ZAddBytes(Leases, b"\xff\xfe", "1"), FULL],
            expect: Stops(Some(Leases), "not UTF-8"),
        },
        // Without FULL: the fast path checks `schema` and `meta` too (a hostile test edited them
        // under a steady group, which kept going until the next membership change stopped it).
        Case {
            name: "group schema unknown, while steady",
            acts: &[HSet(Group, "schema", "2")],
            expect: StopsHeartbeat(Group, "schema"),
        },
        Case {
            name: "group schema missing, while steady",
            acts: &[HDel(Group, "schema")],
            expect: StopsHeartbeat(Group, "schema"),
        },
        Case {
            name: "group meta missing, while steady",
            acts: &[HDel(Group, "meta")],
            expect: StopsHeartbeat(Group, "meta"),
        },
        Case {
            name: "stream schema unknown, while steady",
            acts: &[HSet(Stream, "schema", "2")],
            expect: StopsHeartbeat(Stream, "schema"),
        },
        Case {
            name: "group meta of the wrong JSON shape",
            acts: &[HSet(Group, "meta", "[]"), FULL],
            expect: Stops(Some(Group), "meta"),
        },
        Case {
            name: "group incarnation at u64::MAX",
            acts: &[
                Edit(Group, "meta", |v| {
                    set_json(v, |j| j["incarnation"] = u64::MAX.into())
                }),
                FULL,
            ],
            expect: Stops(Some(Group), "incarnation"),
        },
        Case {
            name: "group epoch at i64::MAX",
            acts: &[
                Edit(Group, "meta", |v| {
                    set_json(v, |j| j["groupEpoch"] = i64::MAX.into())
                }),
                FULL,
            ],
            expect: Stops(Some(Group), "groupEpoch"),
        },
        Case {
            name: "group handOutNotBefore in 2223 (no shard handed out for two centuries)",
            acts: &[
                Edit(Group, "meta", |v| {
                    set_json(v, |j| j["handOutNotBefore"] = FAR_FUTURE.into())
                }),
                FULL,
            ],
            expect: Stops(Some(Group), "handOutNotBefore"),
        },
        Case {
            name: "correction round that ends in 2223",
            acts: &[
                Edit(Group, "meta", |v| {
                    set_json(v, |j| {
                        j["correctionRound"] = serde_json::json!({
                            "startedAt": 1, "notBeforeEnd": FAR_FUTURE,
                            "baseEpoch": 1, "syncedMembers": []
                        })
                    })
                }),
                FULL,
            ],
            expect: Stops(Some(Group), "notBeforeEnd"),
        },
        Case {
            name: "old process holding a shard until 2223",
            acts: &[
                Edit(Group, "member:a", |v| {
                    set_json(v, |j| {
                        j["oldProcessHoldings"] = serde_json::json!([
                            {"processId": "proc-old", "shards": [0], "leaseExpiresAt": FAR_FUTURE}
                        ])
                    })
                }),
                FULL,
            ],
            expect: Stops(Some(Group), "member:a"),
        },
        Case {
            name: "member not JSON",
            acts: &[HSet(Group, "member:a", "{")],
            expect: Stops(Some(Group), "member:a"),
        },
        Case {
            name: "member epoch at i64::MAX",
            acts: &[Edit(Group, "member:a", |v| {
                set_json(v, |j| j["memberEpoch"] = i64::MAX.into())
            })],
            expect: Stops(Some(Group), "member:a"),
        },
        Case {
            name: "group revision not a number",
            acts: &[HSet(Group, "revision", "NaN")],
            expect: Stops(Some(Group), "revision"),
        },
        Case {
            name: "group leaseRevision negative",
            acts: &[HSet(Group, "leaseRevision", "-1")],
            expect: Stops(Some(Group), "leaseRevision"),
        },
        Case {
            name: "group leaseRevision not a number",
            acts: &[HSet(Group, "leaseRevision", "1.5")],
            expect: Stops(Some(Group), "leaseRevision"),
        },
        Case {
            name: "steady without a separator",
            acts: &[HSet(Group, "steady", "garbage")],
            expect: Repairs,
        },
        Case {
            name: "steady with a deadline that is not a number",
            acts: &[Edit(Group, "steady", |v| {
                format!("{}|soon", v.split_once('|').unwrap().0)
            })],
            expect: Repairs,
        },
        Case {
            name: "steady with a deadline that is NaN",
            acts: &[Edit(Group, "steady", |v| {
                format!("{}|nan", v.split_once('|').unwrap().0)
            })],
            expect: Repairs,
        },
        Case {
            name: "steady with a negative deadline",
            acts: &[Edit(Group, "steady", |v| {
                format!("{}|-5", v.split_once('|').unwrap().0)
            })],
            expect: Repairs,
        },
        Case {
            name: "steady with an infinite deadline",
            acts: &[Edit(Group, "steady", |v| {
                format!("{}|inf", v.split_once('|').unwrap().0)
            })],
            expect: Repairs,
        },
        Case {
            name: "steady empty",
            acts: &[HSet(Group, "steady", "")],
            expect: Repairs,
        },
        Case {
            name: "steady without the group's epochs",
            acts: &[Edit(Group, "steady", |v| {
                let mut parts = v.split('|');
                format!("{}|{}", parts.next().unwrap(), parts.next().unwrap())
            })],
            expect: Repairs,
        },
        Case {
            name: "steady with an epoch too large for the response",
            acts: &[Edit(Group, "steady", |v| {
                let (head, _) = v.rsplit_once('|').unwrap();
                format!("{head}|99999999999999999999")
            })],
            expect: Repairs,
        },
        Case {
            name: "fast entry without a newline",
            acts: &[HSet(Group, "fast:a", "proc-a|no newline")],
            expect: Repairs,
        },
        Case {
            name: "fast entry with a response that is not JSON",
            acts: &[Edit(Group, "fast:a", |v| {
                format!("{}\n{{broken", v.split_once('\n').unwrap().0)
            })],
            expect: Repairs,
        },
        // The queue of combined transitions (docs/design.md §5.7): counters that do not read
        // count as `reqdone` (or 0), the next submit rewrites `reqseq` and the next batch
        // `reqdone`, deleting entries it cannot apply; a lease no requester could have taken
        // (one ending more than 2 s ahead) is taken over.
        Case {
            name: "queue counter reqseq not a number",
            acts: &[HSet(Group, "reqseq", "many"), FULL],
            expect: Repairs,
        },
        Case {
            name: "queue counter reqdone negative",
            acts: &[HSet(Group, "reqdone", "-7"), FULL],
            expect: Repairs,
        },
        Case {
            name: "queue counter reqdone far above reqseq",
            acts: &[HSet(Group, "reqdone", "123456789012345"), FULL],
            expect: Repairs,
        },
        Case {
            name: "queue entry without a request id",
            acts: &[HSet(Group, "req:1", "no request id"), FULL],
            expect: Repairs,
        },
        Case {
            name: "queue counter reqdone above 2^53",
            acts: &[HSet(Group, "reqdone", "9007199254740993"), FULL],
            expect: Repairs,
        },
        Case {
            name: "combiner lease expiring in a far future",
            acts: &[HSet(Group, "combiner", "held|99999999999999999999"), FULL],
            expect: Repairs,
        },
        Case {
            name: "combiner lease that does not read",
            acts: &[HSet(Group, "combiner", "held|forever"), FULL],
            expect: Repairs,
        },
        Case {
            name: "fastseq not a number",
            acts: &[HSet(Group, "fastseq:a", "many")],
            expect: Stops(Some(Group), "fastseq:a"),
        },
        Case {
            name: "fastseq at u64::MAX",
            acts: &[HSet(Group, "fastseq:a", "18446744073709551615")],
            expect: Stops(Some(Group), "fastseq:a"),
        },
        Case {
            name: "fastseq far ahead (the member continues above it)",
            acts: &[HSet(Group, "fastseq:a", "123456789012345")],
            expect: Repairs,
        },
        Case {
            name: "fastseq negative (the fast path writes over it)",
            acts: &[HSet(Group, "fastseq:a", "-5")],
            expect: Repairs,
        },
        Case {
            name: "fastworkers not a number",
            acts: &[HSet(Group, "fastworkers:a", "lots")],
            expect: Repairs,
        },
        Case {
            name: "fastworkers above u32",
            acts: &[HSet(Group, "fastworkers:a", "99999999999")],
            expect: Repairs,
        },
        Case {
            name: "group hash of the wrong type",
            acts: &[WrongType(Group)],
            expect: Stops(Some(Group), "not a hash"),
        },
        // ---- leases ----
        Case {
            name: "lease at +inf on the full path",
            acts: &[ZAdd(Leases, MEMBER, "inf"), FULL],
            expect: Stops(Some(Leases), "lease"),
        },
        Case {
            name: "lease at 1e300 (the fast path writes over it)",
            acts: &[ZAdd(Leases, MEMBER, "1e300")],
            expect: Repairs,
        },
        Case {
            name: "lease at -inf (an expired lease: the member rejoins)",
            acts: &[ZAdd(Leases, MEMBER, "-inf")],
            expect: Repairs,
        },
        Case {
            name: "leases of the wrong type",
            acts: &[WrongType(Leases)],
            expect: Stops(Some(Leases), "not a sorted set"),
        },
        // ---- history ----
        Case {
            name: "history of the wrong type",
            acts: &[WrongType(History)],
            expect: Stops(Some(History), "not a list"),
        },
        Case {
            name: "history entry not JSON",
            acts: &[LPush(History, "{garbage")],
            expect: Stops(Some(History), "entry"),
        },
        // ---- shard fence ----
        Case {
            name: "fence not a token",
            acts: &[HSet(Fence, GROUP, "garbage")],
            expect: Stops(Some(Fence), "not a fencing token"),
        },
        Case {
            name: "fence incarnation at u64::MAX",
            acts: &[HSet(Fence, GROUP, "18446744073709551615:1:proc-z:z")],
            expect: Stops(Some(Fence), "not a fencing token"),
        },
        Case {
            name: "fence epoch at i64::MAX",
            acts: &[HSet(
                Fence,
                GROUP,
                "9007199254740991:9223372036854775807:proc-z:z",
            )],
            expect: Stops(Some(Fence), "not a fencing token"),
        },
        Case {
            name: "fence epoch at i64::MAX under a lower incarnation (raised over)",
            acts: &[HSet(Fence, GROUP, "1:9223372036854775807:proc-z:z")],
            expect: Repairs,
        },
        Case {
            name: "fence below the member's token (a lost raise: raised again)",
            acts: &[HSet(Fence, GROUP, "1:1:proc-z:z")],
            expect: Repairs,
        },
        Case {
            name: "fence of the wrong type",
            acts: &[WrongType(Fence)],
            expect: Stops(None, "WRONGTYPE"),
        },
        // ---- data keys ----
        Case {
            name: "shard stream of the wrong type",
            acts: &[WrongType(Shard)],
            expect: Stops(None, "WRONGTYPE"),
        },
        Case {
            name: "dead-letter stream of the wrong type",
            acts: &[WrongType(DeadLetters)],
            expect: Stops(None, "WRONGTYPE"),
        },
        Case {
            name: "sl:streams of the wrong type",
            acts: &[WrongType(Index)],
            expect: Ignored,
        },
    ]
}

fn key_name(prefix: &str, key: Key) -> String {
    let stream = StreamKeys::new(prefix).unwrap();
    let group = stream.group(GROUP).unwrap();
    match key {
        Key::Stream => stream.metadata(),
        Key::Group => group.metadata(),
        Key::Leases => group.leases(),
        Key::History => group.history(),
        Key::Fence => stream.fence(0),
        Key::Shard => stream.shard(0),
        Key::Index => "sl:streams".into(),
        Key::DeadLetters => stream.dead_letters(&group),
    }
}

fn act_key(act: &Act) -> Key {
    match *act {
        Act::HSet(k, ..)
        | Act::HSetBytes(k, ..)
        | Act::ZAddBytes(k, ..)
        | Act::HDel(k, _)
        | Act::Edit(k, ..)
        | Act::ZAdd(k, ..)
        | Act::LPush(k, _)
        | Act::WrongType(k) => k,
    }
}

/// Writes the garbage. Returns the hash field or sorted-set member written and its value as
/// Redis holds it, to check a repair later.
async fn apply(
    conn: &mut RedisConnection,
    prefix: &str,
    act: &Act,
) -> Option<(Key, &'static str, String)> {
    let key = key_name(prefix, act_key(act));
    match *act {
        Act::HSet(k, field, value) => {
            let _: () = conn.hset(&key, field, value).await.unwrap();
            Some((k, field, value.to_owned()))
        }
        Act::HSetBytes(_, field, value) => {
            let _: () = conn.hset(&key, field, value).await.unwrap();
            None
        }
        Act::ZAddBytes(_, member, score) => {
            let _: () = redis::cmd("ZADD")
                .arg(&key)
                .arg(score)
                .arg(member)
                .query_async(conn)
                .await
                .unwrap();
            None
        }
        Act::HDel(_, field) => {
            let _: () = conn.hdel(&key, field).await.unwrap();
            None
        }
        Act::Edit(k, field, edit) => {
            let value: String = conn.hget(&key, field).await.unwrap();
            let edited = edit(&value);
            let _: () = conn.hset(&key, field, &edited).await.unwrap();
            Some((k, field, edited))
        }
        Act::ZAdd(k, member, score) => {
            let _: () = redis::cmd("ZADD")
                .arg(&key)
                .arg(score)
                .arg(member)
                .query_async(conn)
                .await
                .unwrap();
            let stored = stored_value(conn, prefix, k, member).await.unwrap();
            Some((k, member, stored))
        }
        Act::LPush(_, value) => {
            let _: () = conn.lpush(&key, value).await.unwrap();
            None
        }
        Act::WrongType(_) => {
            let _: () = conn.set(&key, "garbage").await.unwrap();
            None
        }
    }
}

/// The hash field (or sorted-set member's score) as Redis holds it now.
async fn stored_value(
    conn: &mut RedisConnection,
    prefix: &str,
    key: Key,
    field: &str,
) -> Option<String> {
    let name = key_name(prefix, key);
    if key == Key::Leases {
        let score: Option<String> = redis::cmd("ZSCORE")
            .arg(&name)
            .arg(field)
            .query_async(conn)
            .await
            .unwrap();
        return score;
    }
    conn.hget(&name, field).await.unwrap()
}

/// `DUMP` of a key (`None`: it does not exist), to put it back as an operator would.
async fn dump(conn: &mut RedisConnection, key: &str) -> Option<Vec<u8>> {
    redis::cmd("DUMP").arg(key).query_async(conn).await.unwrap()
}

async fn restore(conn: &mut RedisConnection, key: &str, dumped: &Option<Vec<u8>>) {
    match dumped {
        Some(bytes) => {
            let _: () = redis::cmd("RESTORE")
                .arg(key)
                .arg(0)
                .arg(bytes.as_slice())
                .arg("REPLACE")
                .query_async(conn)
                .await
                .unwrap();
        }
        None => {
            let _: () = conn.del(key).await.unwrap();
        }
    }
}

fn config() -> CoordinatorConfig {
    // A lease far longer than any case, so no lease ends by itself while garbage is there.
    support::coordination(
        Duration::from_millis(100),
        Duration::from_secs(10),
        Duration::from_secs(20),
    )
}

/// A member driven by hand: the protocol of `member/heartbeat.rs` and the poller, minus timing.
struct Member {
    conn: RedisConnection,
    prefix: String,
    client: ShardClient,
    seq: u64,
    epoch: i64,
    incarnation: u64,
    metadata_version: u64,
    owned: Vec<u32>,
    revoked: Vec<u32>,
    raised: BTreeMap<u32, FenceToken>,
    conflicts: Vec<FenceConflict>,
    /// Acked entry ids (`<shard>/<id>`) with how often each was acked.
    handled: BTreeMap<String, u32>,
    /// Whether the last heartbeat was answered by the fast path.
    fast: bool,
}

impl Member {
    fn new(conn: RedisConnection, prefix: &str) -> Self {
        let client = ShardClient::new(
            conn.clone(),
            StreamKeys::new(prefix).unwrap(),
            GROUP,
            MEMBER,
        )
        .unwrap();
        Member {
            conn,
            prefix: prefix.to_owned(),
            client,
            seq: 0,
            epoch: 0,
            incarnation: 0,
            metadata_version: 0,
            owned: Vec::new(),
            revoked: Vec::new(),
            raised: BTreeMap::new(),
            conflicts: Vec::new(),
            handled: BTreeMap::new(),
            fast: false,
        }
    }

    fn store(&self) -> GroupStore {
        let stream = StreamKeys::new(&self.prefix).unwrap();
        let keys = stream.group(GROUP).unwrap();
        GroupStore::new(self.conn.clone(), stream, keys, config())
    }

    fn token(&self) -> FenceToken {
        FenceToken {
            incarnation: self.incarnation,
            member_epoch: self.epoch,
            member_id: MEMBER.into(),
            process_id: PROCESS.into(),
        }
    }

    /// One heartbeat, a load and a history read (what any full transition and `describe` do),
    /// then one fenced round on every owned shard. Returns the errors seen, as text.
    async fn step(&mut self) -> Vec<String> {
        let mut problems = Vec::new();
        self.seq += 1;
        let request = HeartbeatRequest {
            process_id: PROCESS.into(),
            revoking_shards: revoking(&self.revoked, RevokeState::Revoked),
            fence_conflicts: self.conflicts.clone(),
            ..heartbeat_request(
                MEMBER,
                "corruption",
                self.metadata_version,
                (self.seq, self.epoch),
                &self.owned,
            )
        };
        let mut store = self.store();
        self.fast = false;
        match store.heartbeat(&request).await {
            Ok(outcome) => {
                self.fast = outcome.fast_path;
                let response = outcome.response;
                match response.status {
                    HeartbeatStatus::Ok
                    | HeartbeatStatus::SyncMetadata
                    | HeartbeatStatus::RevokePending => {
                        self.epoch = response.member_epoch;
                        self.incarnation = response.incarnation;
                        self.metadata_version = response.metadata_version;
                        self.revoked = self
                            .owned
                            .iter()
                            .filter(|s| !response.assigned_shards.contains(s))
                            .copied()
                            .collect();
                        self.owned = response.assigned_shards.clone();
                        self.conflicts.clear();
                    }
                    HeartbeatStatus::Retry => {}
                    _ => {
                        // Fenced or unknown: stop everything and join again.
                        self.epoch = 0;
                        self.owned.clear();
                        self.revoked.clear();
                        self.raised.clear();
                        self.conflicts.clear();
                    }
                }
            }
            // A sequence behind the recorded one: continue above it, as the runtime does.
            Err(StoreError::Coordinator(CoordinatorError::StaleRequestSeq { last, .. }))
                if last > self.seq =>
            {
                self.seq = last;
            }
            Err(error) => problems.push(format!("heartbeat: {}", Chain(&error))),
        }
        if let Err(error) = store.load().await {
            problems.push(format!("load: {}", Chain(&error)));
        }
        if let Err(error) = store.history().await {
            problems.push(format!("history: {}", Chain(&error)));
        }
        for shard in self.owned.clone() {
            if let Err(problem) = self.poll(shard).await {
                problems.push(problem);
            }
        }
        problems
    }

    async fn poll(&mut self, shard: u32) -> Result<(), String> {
        let token = self.token();
        let fence = StreamKeys::new(&self.prefix).unwrap().fence(shard);
        if self.raised.get(&shard) != Some(&token) {
            match self.client.raise_fence(shard, &token).await {
                Ok(Ok(())) => {
                    self.raised.insert(shard, token.clone());
                }
                Ok(Err(fenced)) => return Err(self.refused(shard, &fence, fenced)),
                Err(error) => return Err(format!("raise: {}", Chain(&error))),
            }
        }
        for pending in [true, false] {
            let outcome = if pending {
                self.client
                    .read_pending(shard, &token, "0", 100, FencingMode::Strict)
                    .await
            } else {
                self.client
                    .read_new(shard, &token, 100, FencingMode::Strict)
                    .await
            };
            match outcome {
                Ok(ReadOutcome::Entries(entries)) => self.handle(shard, &token, entries).await?,
                Ok(ReadOutcome::Empty { .. }) => {}
                Ok(ReadOutcome::Fenced(fenced)) => return Err(self.refused(shard, &fence, fenced)),
                Err(error) => return Err(format!("read: {}", Chain(&error))),
            }
        }
        Ok(())
    }

    /// A fence refusal as the poller treats it: `Lower` raises again next time; `Higher` with a
    /// token is reported as a conflict; a value that is no token stops the shard (the poller
    /// logs that the field must be deleted).
    fn refused(&mut self, shard: u32, fence: &str, fenced: Fenced) -> String {
        self.raised.remove(&shard);
        match fenced {
            Fenced::Lower => format!("lower fence on {fence} (raised again next step)"),
            Fenced::Higher { found: Some(t) } => {
                self.conflicts.push(FenceConflict {
                    shard_index: shard,
                    incarnation: t.incarnation,
                    epoch: t.member_epoch,
                });
                format!("higher fence on {fence}: {}", t.encode())
            }
            Fenced::Higher { found: None } => {
                format!("{fence} field {GROUP} holds a value that is not a fencing token")
            }
        }
    }

    /// The handler: entries with a `dlq` field are dead-lettered, the others handled; each is
    /// acked only after that succeeded.
    async fn handle(
        &mut self,
        shard: u32,
        token: &FenceToken,
        entries: Vec<ShardEntry>,
    ) -> Result<(), String> {
        let mut done = Vec::new();
        let mut problem = None;
        for entry in entries {
            if entry.field("dlq").is_some()
                && let Err(error) = self
                    .client
                    .dead_letter(shard, &entry, DeadLetterReason::Handler, "poison", 1)
                    .await
            {
                problem = Some(format!("dead letter: {}", Chain(&error)));
                continue;
            }
            done.push(entry.id);
        }
        match self.client.ack(shard, token, &done).await {
            Ok(Ok(_)) => {
                for id in done {
                    *self.handled.entry(format!("{shard}/{id}")).or_default() += 1;
                }
            }
            Ok(Err(fenced)) => {
                let fence = StreamKeys::new(&self.prefix).unwrap().fence(shard);
                return Err(self.refused(shard, &fence, fenced));
            }
            Err(error) => return Err(format!("ack: {}", Chain(&error))),
        }
        problem.map_or(Ok(()), Err)
    }

    /// Steps until every id in `published` is handled and the fast path answers again; `Err`
    /// says what was missing after [`MAX_STEPS`].
    async fn settle(&mut self, published: &BTreeSet<String>) -> Result<(), String> {
        let mut last = Vec::new();
        for _ in 0..MAX_STEPS {
            last = self.step().await;
            let all = published.iter().all(|id| self.handled.contains_key(id));
            if all && self.fast && last.is_empty() {
                return Ok(());
            }
        }
        let missing: Vec<_> = published
            .iter()
            .filter(|id| !self.handled.contains_key(*id))
            .collect();
        Err(format!(
            "did not settle in {MAX_STEPS} steps: missing {missing:?}, fast path {}, last errors {last:?}",
            self.fast
        ))
    }
}

async fn publish(conn: &mut RedisConnection, prefix: &str, n: u32, dlq: bool) -> Vec<String> {
    let stream = StreamKeys::new(prefix).unwrap();
    let mut ids = Vec::new();
    for shard in 0..SHARDS {
        for i in 0..n {
            let id: String = if dlq && shard == 0 && i == 0 {
                conn.xadd(stream.shard(shard), "*", &[("dlq", "1")])
                    .await
                    .unwrap()
            } else {
                conn.xadd(stream.shard(shard), "*", &[("n", i.to_string())])
                    .await
                    .unwrap()
            };
            ids.push(format!("{shard}/{id}"));
        }
    }
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_in_any_coordination_key_is_repaired_or_stops_with_a_clear_error() {
    let server = RedisServer::start().unwrap();
    let mut conn = support::connect(&RedisTarget::standalone(server.url())).await;
    let cases = cases();
    assert!(cases.len() >= 25);
    let mut failures = Vec::new();
    for (index, case) in cases.iter().enumerate() {
        let prefix = format!("c{index}");
        admin::create_stream(&mut conn, &prefix, SHARDS)
            .await
            .unwrap();
        admin::register_group(&mut conn, &prefix, GROUP, StartFrom::Earliest)
            .await
            .unwrap();
        let mut member = Member::new(conn.clone(), &prefix);
        let mut published: BTreeSet<String> = publish(&mut conn, &prefix, 2, false)
            .await
            .into_iter()
            .collect();
        if let Err(e) = member.settle(&published).await {
            failures.push(format!("{} (before the garbage): {e}", case.name));
            continue;
        }

        // Entries published while the garbage is there (one of them for the dead letters).
        published.extend(publish(&mut conn, &prefix, 2, true).await);
        let mut saved = Vec::new();
        for act in case.acts {
            let key = key_name(&prefix, act_key(act));
            if !saved.iter().any(|(k, _)| k == &key) {
                let dumped = dump(&mut conn, &key).await;
                saved.push((key, dumped));
            }
        }
        let mut written = Vec::new();
        for act in case.acts {
            written.extend(apply(&mut conn, &prefix, act).await);
        }
        let mut seen = Vec::new();
        for _ in 0..3 {
            seen.extend(member.step().await);
        }
        // A lower fence is raised again at once: not a failure.
        seen.retain(|p| !p.starts_with("lower fence"));
        let verdict = match case.expect {
            Expect::Repairs | Expect::Ignored if !seen.is_empty() => {
                Some(format!("expected no error, got {seen:?}"))
            }
            Expect::StopsHeartbeat(key, text) => {
                let key = key_name(&prefix, key);
                let names = |p: &&String| {
                    p.starts_with("heartbeat:") && p.contains(text) && p.contains(key.as_str())
                };
                (!seen.iter().any(|p| names(&p))).then(|| {
                    format!("expected a heartbeat error naming {key:?} and {text:?}, got {seen:?}")
                })
            }
            Expect::Stops(key, text) => {
                let key = key.map(|k| key_name(&prefix, k));
                let names = |p: &String| {
                    p.contains(text) && key.as_ref().is_none_or(|k| p.contains(k.as_str()))
                };
                // What the member sees must say what is wrong: every failed heartbeat too.
                let heartbeats_named = seen
                    .iter()
                    .filter(|p| p.starts_with("heartbeat:"))
                    .all(names);
                (!seen.iter().any(names) || !heartbeats_named).then(|| {
                    format!("expected every heartbeat error and some error to name {key:?} and {text:?}, got {seen:?}")
                })
            }
            _ => None,
        };
        // A repair rewrites the value: garbage the fast path just steps around is not repaired.
        if matches!(case.expect, Expect::Repairs) {
            for (key, field, bad) in &written {
                let now = stored_value(&mut conn, &prefix, *key, field).await;
                if now.as_ref() == Some(bad) {
                    failures.push(format!("{}: {field} still holds {bad:?}", case.name));
                }
            }
        }
        // A Lua runtime error is never an answer: the scripts check what they parse (a key of
        // the wrong type is Redis's own error, passed on).
        let lua_error = |p: &&String| p.contains("user_script") && !p.contains("WRONGTYPE");
        if let Some(lua) = seen.iter().find(lua_error) {
            failures.push(format!("{}: a script error: {lua}", case.name));
        }
        if let Some(verdict) = verdict {
            failures.push(format!("{}: {verdict}", case.name));
        }
        if !matches!(case.expect, Expect::Repairs) {
            for (key, dumped) in &saved {
                restore(&mut conn, key, dumped).await;
            }
        }
        published.extend(publish(&mut conn, &prefix, 2, false).await);
        if let Err(e) = member.settle(&published).await {
            failures.push(format!("{}: {e}", case.name));
            continue;
        }
        let twice: Vec<_> = member.handled.iter().filter(|(_, n)| **n > 1).collect();
        assert!(twice.is_empty(), "{}: handled twice: {twice:?}", case.name);
        assert_eq!(
            member.handled.keys().cloned().collect::<BTreeSet<_>>(),
            published,
            "{}",
            case.name
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A compare-and-set that meets a `:history` (or `:leases`) key of the wrong type writes nothing
/// and names the key: before the check, `LPUSH` failed after the script had already written the
/// group hash (a new revision, the member deleted), and the heartbeat reported a Redis error.
#[tokio::test]
async fn a_transition_meeting_a_history_of_the_wrong_type_writes_nothing() {
    let server = RedisServer::start().unwrap();
    let mut conn = support::connect(&RedisTarget::standalone(server.url())).await;
    let prefix = "history";
    admin::create_stream(&mut conn, prefix, SHARDS)
        .await
        .unwrap();
    admin::register_group(&mut conn, prefix, GROUP, StartFrom::Earliest)
        .await
        .unwrap();
    let mut member = Member::new(conn.clone(), prefix);
    member.settle(&BTreeSet::new()).await.unwrap();
    let history = key_name(prefix, Key::History);
    let group = key_name(prefix, Key::Group);
    let _: () = conn.set(&history, "garbage").await.unwrap();
    let before: BTreeMap<String, String> = conn.hgetall(&group).await.unwrap();
    // Leaving sends the member to the history.
    let leave = HeartbeatRequest {
        process_id: PROCESS.into(),
        ..heartbeat_request(
            MEMBER,
            "corruption",
            member.metadata_version,
            (member.seq + 1, -1),
            &[],
        )
    };
    let err = member.store().heartbeat(&leave).await.unwrap_err();
    assert!(
        matches!(&err, StoreError::WrongType { key, .. } if *key == history),
        "{err}"
    );
    assert!(err.to_string().contains("not a list"), "{err}");
    // The request stays queued for the next batch (docs/design.md §5.7): the queue's fields are
    // not the group's state, which the refused compare-and-set left as it was.
    let state = |fields: BTreeMap<String, String>| -> BTreeMap<String, String> {
        let queue = |f: &str| f.starts_with("req") || f.starts_with("resp:") || f == "combiner";
        fields.into_iter().filter(|(f, _)| !queue(f)).collect()
    };
    let after: BTreeMap<String, String> = conn.hgetall(&group).await.unwrap();
    assert_eq!(state(after), state(before), "nothing written");
    let _: () = conn.del(&history).await.unwrap();
    let left = member.store().heartbeat(&leave).await.unwrap();
    assert_eq!(left.response.status, HeartbeatStatus::Ok);
    let history_len: usize = conn.llen(&history).await.unwrap();
    assert_eq!(history_len, 1);
}

/// The same through the member runtime: garbage in `steady` and every `fast:<id>` while a
/// listener reads. Before the fix every heartbeat was a Lua error, the lease lapsed and the
/// member stopped reading for good; now the fast path falls back, the full transition rewrites
/// both, and the member keeps its shards and handles everything. Then a `fastseq:<id>` that is
/// not a number: the member's heartbeats fail with a typed error naming the field (reads stop
/// when the lease ends); once an operator deletes the field, it goes on and nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_survives_garbage_in_the_fast_path_fields() {
    use support as ms;
    let server = RedisServer::start().unwrap();
    let target = RedisTarget::standalone(server.url());
    let mut conn = ms::connect(&target).await;
    admin::create_stream(&mut conn, ms::STREAM, 4)
        .await
        .unwrap();
    let recorder = Arc::new(ms::Recorder::default());
    let handle = ms::start_recording(&target, &recorder, ms::options(1), Duration::ZERO).await;
    let (_, converged) =
        ms::wait_for_group(&mut conn, Duration::from_secs(10), ms::converged).await;
    assert!(converged, "the group did not converge");
    let client = redis::Client::open(server.url()).unwrap();
    let mut published = ms::preload(&client, &[0, 1, 2, 3], 10, 0);
    let all_handled = |recorder: &ms::Recorder, published: &[ms::Published]| {
        let handled = recorder.handled();
        published
            .iter()
            .all(|p| handled.contains(&(p.shard, p.id.clone())))
    };
    assert!(
        ms::wait_until(Duration::from_secs(10), || all_handled(
            &recorder, &published
        ))
        .await
    );

    let group = StreamKeys::new(ms::STREAM)
        .unwrap()
        .group(ms::GROUP)
        .unwrap()
        .metadata();
    let revoked_before = recorder
        .events()
        .iter()
        .filter(|e| matches!(e, ms::Ev::Revoked { .. }))
        .count();
    let fields: Vec<String> = conn.hkeys(&group).await.unwrap();
    let _: () = conn.hset(&group, "steady", "garbage").await.unwrap();
    for field in fields.iter().filter(|f| f.starts_with("fast:")) {
        let _: () = conn.hset(&group, field, "no newline").await.unwrap();
    }
    // The full transition rewrites both (before the fix every heartbeat failed, the lease lapsed
    // and nothing was rewritten).
    let mut rewritten = false;
    for _ in 0..250 {
        let now: BTreeMap<String, String> = conn.hgetall(&group).await.unwrap();
        rewritten = now.get("steady").is_some_and(|v| v.contains('|'))
            && now
                .iter()
                .filter(|(f, _)| f.starts_with("fast:"))
                .all(|(_, v)| v.contains('\n'));
        if rewritten {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(rewritten, "steady and fast:<id> were not rewritten");
    published.extend(ms::preload(&client, &[0, 1, 2, 3], 10, 100));
    assert!(
        ms::wait_until(Duration::from_secs(5), || all_handled(
            &recorder, &published
        ))
        .await,
        "entries published after the garbage were not handled"
    );
    let revoked_after = recorder
        .events()
        .iter()
        .filter(|e| matches!(e, ms::Ev::Revoked { .. }))
        .count();
    assert_eq!(revoked_after, revoked_before, "the member gave shards up");

    // A value the store cannot repair: a typed error until it is deleted.
    let seq_fields: Vec<String> = conn.hkeys(&group).await.unwrap();
    let seq_fields: Vec<&String> = seq_fields
        .iter()
        .filter(|f| f.starts_with("fastseq:"))
        .collect();
    assert!(!seq_fields.is_empty());
    for field in &seq_fields {
        let _: () = conn.hset(&group, *field, "many").await.unwrap();
    }
    let mut store = GroupStore::new(
        conn.clone(),
        StreamKeys::new(ms::STREAM).unwrap(),
        StreamKeys::new(ms::STREAM)
            .unwrap()
            .group(ms::GROUP)
            .unwrap(),
        ms::fast(),
    );
    let err = store.load().await.unwrap_err();
    assert!(
        matches!(&err, StoreError::Malformed { key, detail } if *key == group && detail.contains("fastseq:")),
        "{err}"
    );
    published.extend(ms::preload(&client, &[0, 1, 2, 3], 5, 200));
    // Its heartbeats fail (full path: the typed error) until its lease has run out.
    let leases = StreamKeys::new(ms::STREAM)
        .unwrap()
        .group(ms::GROUP)
        .unwrap()
        .leases();
    // Counting the group loads (one HGETALL each: nothing else here sends one) shows the failing
    // heartbeats back off instead of looping.
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut conn)
        .await
        .unwrap();
    let window = std::time::Instant::now();
    let mut lapsed = false;
    for _ in 0..500 {
        let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await.unwrap();
        let scores: Vec<(String, f64)> = conn.zrange_withscores(&leases, 0, -1).await.unwrap();
        lapsed = scores
            .iter()
            .all(|(_, s)| *s <= (secs * 1_000_000 + micros) as f64);
        if lapsed {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(lapsed, "the member's heartbeats went on succeeding");
    let elapsed = window.elapsed();
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn)
        .await
        .unwrap();
    let loads: u64 = stats
        .lines()
        .find_map(|l| l.strip_prefix("cmdstat_hgetall:calls="))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |n| n.parse().unwrap());
    let bound = 2 * (elapsed.as_millis() / ms::HEARTBEAT.as_millis()) as u64 + 2;
    assert!(
        (1..=bound).contains(&loads),
        "{loads} group loads in {elapsed:?} (at most {bound}: one per heartbeat interval)"
    );
    for field in &seq_fields {
        let _: () = conn.hdel(&group, *field).await.unwrap();
    }
    published.extend(ms::preload(&client, &[0, 1, 2, 3], 5, 300));
    assert!(
        ms::wait_until(Duration::from_secs(15), || all_handled(
            &recorder, &published
        ))
        .await,
        "entries were lost after the repair"
    );
    handle.shutdown();
    handle.join().await.expect("clean shutdown");
}
