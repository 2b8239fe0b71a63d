//! Acknowledging entries (docs/design.md §8.2, §8.5): one shard's fenced ack, sent on its own
//! (before a claim, a pending read, a raise or the end of a task), and the reply of the plain
//! `XACK` that travels with a read ([`crate::dataplane::round`]).

use redis::Value;

use super::reply::int;
use super::{Reply, ScriptCall, ShardClient};
use crate::connection::RedisFailure;
use crate::dataplane::error::DataPlaneError;
use crate::dataplane::round::into_result;
use crate::dataplane::{Fenced, scripts};
use crate::fence::FenceToken;
use crate::model::ShardIndex;

impl ShardClient {
    /// Acknowledges `ids` on `shard` (`XACK`), always fenced, whatever the [`FencingMode`](crate::dataplane::FencingMode).
    /// Returns how many of them were pending in the group (ids acked before, or never delivered,
    /// count 0). With no ids only the fence is checked. Ack trimmed entries like any other.
    ///
    /// # Errors
    /// [`DataPlaneError::Redis`] when Redis fails (acking again is harmless). A missing group is
    /// not an error here: nothing is pending, the result is 0 (a missing fence answers
    /// [`Fenced::Lower`] first).
    pub async fn ack(
        &mut self,
        shard: ShardIndex,
        token: &FenceToken,
        ids: &[String],
    ) -> Result<Result<usize, Fenced>, DataPlaneError> {
        let call = self.ack_call(shard, token, ids);
        let Some(turn) = self
            .replica_wait
            .as_ref()
            .and_then(crate::replication::AckWaits::begin)
        else {
            let reply = self.run(ACK, shard, call).await?;
            return ack_outcome(shard, reply);
        };
        // The ack and its WAIT in one pipeline: on a cluster it goes to the fence key's node.
        let mut pipe = redis::pipe();
        pipe.add_command(call.cmd.clone())
            .add_command(turn.cmd())
            .ignore_errors();
        let replies: Vec<Value> = pipe
            .query_async(&mut self.conn)
            .await
            .map_err(DataPlaneError::redis(ACK, Some(shard)))?;
        let Ok([ack_reply, wait_reply]) = <[Value; 2]>::try_from(replies) else {
            return Err(DataPlaneError::unexpected(
                ACK,
                Some(shard),
                "not two replies",
            ));
        };
        let reply = match into_result(ack_reply) {
            // The script was not loaded, so the ack did not run: load it and ack again, then wait.
            Err(error) if RedisFailure::of(&error) == RedisFailure::NoScript => {
                let reply = self.run(ACK, shard, call).await?;
                let waited: redis::RedisResult<Value> =
                    turn.cmd().query_async(&mut self.conn).await;
                turn.finish(waited.as_ref().ok(), ids.len());
                reply
            }
            other => {
                turn.finish(Some(&wait_reply), ids.len());
                self.classify(ACK, shard, other)?
            }
        };
        ack_outcome(shard, reply)
    }

    /// The listener's read round as one raw call, for the benchmarks' diagnostic loops
    /// (`testing` feature): one pipeline with a plain `XACK` of each part's ids and one
    /// multi-stream read of up to `count` new entries per shard, as this client's consumer,
    /// fenced by a transaction in [`crate::dataplane::FencingMode::Strict`] (each part checked against its own
    /// token; [`crate::dataplane::round`]). Standalone servers only. Returns, per part in order,
    /// its ack reply (`None` without ids) and its read reply shaped as a one-stream `XREADGROUP`
    /// reply (`[[key, entries]]`, nil when nothing was new).
    ///
    /// # Errors
    /// The pipeline's [`redis::RedisError`] (connection lost, timeout), or a read that was
    /// refused, aborted or of an unexpected shape.
    #[cfg(feature = "testing")]
    pub async fn read_round(
        &mut self,
        parts: &[(ShardIndex, &FenceToken, &[String])],
        count: usize,
        mode: crate::dataplane::FencingMode,
    ) -> redis::RedisResult<Vec<(Option<redis::RedisResult<Value>>, Value)>> {
        let round: Vec<crate::dataplane::round::RoundPart> = parts
            .iter()
            .map(|&(shard, token, ids)| self.round_part(shard, token, ids, mode))
            .collect();
        let mut conn = self.conn.clone();
        let replies = crate::dataplane::round::read_round(
            &mut conn,
            &self.group,
            &self.consumer,
            count,
            round,
            self.replica_wait.as_ref(),
        )
        .await?;
        replies
            .into_iter()
            .map(|reply| match reply.read {
                crate::dataplane::round::PartRead::Entries(read) => Ok((reply.ack, read)),
                other => Err(redis::RedisError::from((
                    redis::ErrorKind::Parse,
                    "read round",
                    format!("{other:?}"),
                ))),
            })
            .collect()
    }

    pub(super) fn ack_call(
        &mut self,
        shard: ShardIndex,
        token: &FenceToken,
        ids: &[String],
    ) -> ScriptCall {
        let mut call = self.script_call(scripts::ack(), shard, token);
        for id in ids {
            call.cmd.arg(id);
        }
        call
    }
}

pub(super) const ACK: &str = "ack";

/// What the ack script's reply means.
pub(super) fn ack_outcome(
    shard: ShardIndex,
    reply: Reply,
) -> Result<Result<usize, Fenced>, DataPlaneError> {
    match reply.ok(ACK, shard, 1)? {
        Ok(rest) => int(&rest[0])
            .and_then(|n| usize::try_from(n).ok())
            .map(Ok)
            .ok_or_else(|| DataPlaneError::unexpected(ACK, Some(shard), "acked count")),
        Err(fenced) => Ok(Err(fenced)),
    }
}

/// The reply of a plain `XACK` sent in a read round: how many of the ids were pending.
pub(super) fn ack_count(
    shard: ShardIndex,
    reply: redis::RedisResult<Value>,
) -> Result<usize, DataPlaneError> {
    let reply = reply.map_err(DataPlaneError::redis(ACK, Some(shard)))?;
    int(&reply)
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| {
            DataPlaneError::unexpected(ACK, Some(shard), format!("XACK reply {reply:?}"))
        })
}
