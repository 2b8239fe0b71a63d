//! [`ShardClient`]: the fenced operations on one group's shards (docs/design.md §8). This
//! module holds the client and how a script is sent and its reply sorted out; the operations live
//! by concept in the submodules: takeover (fence, claims, own pending entries), reads, acks, dead
//! letters and attempt counts, consumer-group re-creation, and consumer hygiene.

mod ack;
mod consumers;
mod dead_letter;
mod group;
mod read;
mod reply;
mod takeover;

pub use consumers::{ConsumerSweep, KeepList, delete_idle_consumers, read_keep_list};
pub(crate) use group::GroupRecreated;

use redis::{Script, Value};

use super::error::DataPlaneError;
use super::{Fenced, FencingMode};
use crate::connection::{RedisConnection, RedisFailure};
use crate::fence::FenceToken;
use crate::keys::{GroupKeys, NameError, StreamKeys};
use crate::model::ShardIndex;
use reply::text;

/// The most ids one [`ShardClient::claim_others`] call requests (larger batches are clamped), so
/// that one script call stays short: Redis runs nothing else while a script runs.
pub const MAX_CLAIM_BATCH: usize = 1000;

/// The fenced operations of one member (Redis consumer) of one consumer group on the shards of one
/// stream. Every method is one round trip: one script on the shard's slot, or one `XADD` for
/// [`ShardClient::dead_letter`]. Cheap to clone (clones share the multiplexed connection); never
/// use it for blocking commands (that is [`super::Waiter`]'s job).
#[derive(Debug, Clone)]
pub struct ShardClient {
    conn: RedisConnection,
    keys: StreamKeys,
    group: String,
    /// The group's coordination keys (leases, group hash): read by consumer hygiene.
    group_keys: GroupKeys,
    consumer: String,
    dead_letters: String,
    max_entry_bytes: u64,
    /// The last token used and its encoding (`FenceToken::encode`), reused while it holds.
    encoded_token: Option<(FenceToken, String)>,
    /// The shard and token whose last read of new entries was vouched for (a passed check, or a
    /// read through the gates): the next round reads through the gate without the check
    /// ([`crate::dataplane::round`]).
    gate_open: Option<(ShardIndex, FenceToken)>,
    /// The `WAIT` sent after each ack (`min_replica_acks`), if any.
    replica_wait: Option<crate::replication::AckWaits>,
}

/// An `EVALSHA` ready to send, with the script it runs (loaded again on `NOSCRIPT`).
struct ScriptCall {
    script: &'static Script,
    cmd: redis::Cmd,
}

/// A script reply once the fence and a missing group are handled.
enum Reply {
    /// The script did its work: its status (`EQUAL`, `OK`, `EMPTY`) and the rest of the reply.
    Done(String, Vec<Value>),
    /// The fence refused the operation.
    Refused(Fenced),
}

impl Reply {
    /// The `n` values of an `OK` reply, or the fence's refusal; any other status or count is an
    /// unexpected reply to `op`.
    fn ok(
        self,
        op: &'static str,
        shard: ShardIndex,
        n: usize,
    ) -> Result<Result<Vec<Value>, Fenced>, DataPlaneError> {
        match self {
            Reply::Refused(fenced) => Ok(Err(fenced)),
            Reply::Done(status, rest) if status == "OK" && rest.len() == n => Ok(Ok(rest)),
            Reply::Done(status, rest) => Err(unexpected_status(op, shard, &status, &rest)),
        }
    }
}

/// A script's status (and the count of values after it) that `op` does not expect.
fn unexpected_status(
    op: &'static str,
    shard: ShardIndex,
    status: &str,
    rest: &[Value],
) -> DataPlaneError {
    DataPlaneError::unexpected(
        op,
        Some(shard),
        format!("status {status:?} with {} values", rest.len()),
    )
}

impl ShardClient {
    /// A client for consumer group `group` of the stream `keys`, acting as Redis consumer
    /// `consumer` (the member id, docs/design.md §7). Entries of any size are returned in full
    /// until [`ShardClient::with_max_entry_bytes`] sets a limit.
    ///
    /// # Errors
    /// [`NameError`] when the group name is not valid ([`crate::keys::validate_group_name`]).
    pub fn new(
        conn: RedisConnection,
        keys: StreamKeys,
        group: &str,
        consumer: &str,
    ) -> Result<Self, NameError> {
        let group_keys = keys.group(group)?;
        let dead_letters = keys.dead_letters(&group_keys);
        Ok(ShardClient {
            conn,
            keys,
            group: group.to_owned(),
            group_keys,
            consumer: consumer.to_owned(),
            dead_letters,
            max_entry_bytes: 0,
            encoded_token: None,
            gate_open: None,
            replica_wait: None,
        })
    }

    /// Follows acks with `WAIT` in the same pipeline (`min_replica_acks`, README "Waiting for
    /// replicas"), as the member's [`AckWaits`](crate::replication::AckWaits) allow: fewer
    /// replicas than asked is a `warn!`, never an error (the entries were handled and are acked
    /// on the master). `None`: no wait.
    pub(crate) fn with_replica_wait(mut self, wait: Option<crate::replication::AckWaits>) -> Self {
        self.replica_wait = wait;
        self
    }

    /// Withholds bodies larger than `limit` bytes (field names plus values) from reads: such
    /// entries come back as [`EntryStatus::TooLarge`](crate::dataplane::EntryStatus::TooLarge) with no fields, so a huge entry never
    /// reaches this process (a huge entry). `None`: no limit.
    pub fn with_max_entry_bytes(mut self, limit: Option<usize>) -> Self {
        self.max_entry_bytes = limit.map_or(0, |l| l.max(1) as u64);
        self
    }

    /// Sends every later command over `conn` (the member's data-plane connection,
    /// [`RedisConnection::member_data_plane`]).
    pub(crate) fn set_connection(&mut self, conn: RedisConnection) {
        self.conn = conn;
    }

    /// The connection every command goes over (the data plane's, once
    /// [`ShardClient::set_connection`] set it).
    pub(crate) fn connection(&self) -> &RedisConnection {
        &self.conn
    }

    /// The consumer group.
    pub fn group(&self) -> &str {
        &self.group
    }

    /// The Redis consumer name (the member id).
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// The stream's keys.
    pub fn keys(&self) -> &StreamKeys {
        &self.keys
    }

    /// The dead-letter stream `<prefix>:dlq:<group>`.
    pub fn dead_letter_key(&self) -> &str {
        &self.dead_letters
    }

    /// `EVALSHA` of `script` on `shard` with the common keys and arguments; the caller adds its
    /// own. Built directly: a `ScriptInvocation` copies every argument twice, and the ack carries
    /// a batch of ids.
    fn script_call(
        &mut self,
        script: &'static Script,
        shard: ShardIndex,
        token: &FenceToken,
    ) -> ScriptCall {
        self.script_call_with(script, shard, token, None)
    }

    /// [`ShardClient::script_call`] with a third key after the shard and its fence (one of the
    /// shard's companion keys, in its slot): `KEYS[3]` of the script.
    fn script_call_with(
        &mut self,
        script: &'static Script,
        shard: ShardIndex,
        token: &FenceToken,
        third_key: Option<String>,
    ) -> ScriptCall {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(script.get_hash())
            .arg(2 + usize::from(third_key.is_some()))
            .arg(self.keys.shard(shard))
            .arg(self.keys.fence(shard));
        if let Some(key) = third_key {
            cmd.arg(key);
        }
        cmd.arg(&self.group);
        cmd.arg(self.encoded(token));
        cmd.arg(token.incarnation).arg(token.member_epoch);
        ScriptCall { script, cmd }
    }

    /// `token` encoded (`FenceToken::encode`), from the cache while the token holds.
    fn encoded(&mut self, token: &FenceToken) -> &str {
        if self
            .encoded_token
            .as_ref()
            .is_none_or(|(cached, _)| cached != token)
        {
            self.encoded_token = Some((token.clone(), token.encode()));
        }
        self.encoded_token
            .as_ref()
            .map_or("", |(_, encoded)| encoded.as_str())
    }

    /// Runs a [`ShardClient::script_call`] and sorts out fence refusals and missing groups. On
    /// `NOSCRIPT` (a restarted or failed-over server) the script is loaded and run again.
    async fn run(
        &mut self,
        op: &'static str,
        shard: ShardIndex,
        call: ScriptCall,
    ) -> Result<Reply, DataPlaneError> {
        let reply = match call.cmd.query_async(&mut self.conn).await {
            Err(error) if RedisFailure::of(&error) == RedisFailure::NoScript => {
                call.script
                    .load_async(&mut self.conn)
                    .await
                    .map_err(DataPlaneError::redis(op, Some(shard)))?;
                call.cmd.query_async(&mut self.conn).await
            }
            other => other,
        };
        self.classify(op, shard, reply)
    }

    /// [`DataPlaneError::NoGroup`] for `shard`, with Redis's message.
    fn no_group(&self, shard: ShardIndex, detail: String) -> DataPlaneError {
        DataPlaneError::NoGroup {
            shard,
            stream: self.keys.shard(shard),
            group: self.group.clone(),
            detail,
        }
    }

    /// A script's reply: its status, fence refusals and missing groups sorted out.
    fn classify(
        &self,
        op: &'static str,
        shard: ShardIndex,
        reply: redis::RedisResult<Value>,
    ) -> Result<Reply, DataPlaneError> {
        let value = reply.map_err(DataPlaneError::redis(op, Some(shard)))?;
        let Value::Array(mut items) = value else {
            return Err(DataPlaneError::unexpected(
                op,
                Some(shard),
                format!("{value:?}"),
            ));
        };
        let status = items.first().and_then(text).ok_or_else(|| {
            DataPlaneError::unexpected(op, Some(shard), format!("no status in {items:?}"))
        })?;
        let rest = items.split_off(1);
        match status.as_str() {
            "LOWER" => Ok(Reply::Refused(Fenced::Lower)),
            "HIGHER" => Ok(Reply::Refused(Fenced::Higher {
                found: rest
                    .first()
                    .and_then(text)
                    .and_then(|s| FenceToken::decode(&s)),
            })),
            "NOGROUP" => Err(self.no_group(shard, rest.first().and_then(text).unwrap_or_default())),
            _ => Ok(Reply::Done(status, rest)),
        }
    }
}

pub(super) fn fenced_flag(mode: FencingMode) -> &'static str {
    match mode {
        FencingMode::Strict => "1",
        FencingMode::Acks => "0",
    }
}
