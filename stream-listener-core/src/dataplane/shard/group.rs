//! Re-creating a shard's consumer group after Redis lost it (docs/design.md §8.11).

use super::ShardClient;
use crate::dataplane::error::DataPlaneError;
use crate::dataplane::scripts;
use crate::model::ShardIndex;

/// What [`ShardClient::recreate_group`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GroupRecreated {
    /// The consumer group was created from `0`; `stream_created` when the stream was too.
    Created {
        /// Whether the shard stream was created with it (`MKSTREAM`).
        stream_created: bool,
    },
    /// The group exists already (`BUSYGROUP`): created meanwhile.
    Exists,
    /// The stream is missing and was not to be created.
    StreamMissing,
}

impl ShardClient {
    /// Creates this group's consumer group on `shard` again from `0` (nothing written in the gap
    /// is skipped), and the shard stream with it (`MKSTREAM`) only when `create_stream`: the
    /// caller decides from the stream metadata (a member creates a stream only for an ACTIVE
    /// shard, docs/design.md §8.11). One script, so the check and the creation cannot be split.
    ///
    /// # Errors
    /// [`DataPlaneError::Redis`] when Redis fails or the key holds another type;
    /// [`DataPlaneError::UnexpectedReply`] for a reply of another shape.
    pub(crate) async fn recreate_group(
        &mut self,
        shard: ShardIndex,
        create_stream: bool,
    ) -> Result<GroupRecreated, DataPlaneError> {
        let (stream_created, group): (i64, i64) = scripts::recreate_group()
            .key(self.keys.shard(shard))
            .arg(&self.group)
            .arg(if create_stream { "1" } else { "0" })
            .invoke_async(&mut self.conn)
            .await
            .map_err(DataPlaneError::redis("recreate_group", Some(shard)))?;
        match group {
            1 => Ok(GroupRecreated::Created {
                stream_created: stream_created == 1,
            }),
            0 => Ok(GroupRecreated::Exists),
            -1 => Ok(GroupRecreated::StreamMissing),
            other => Err(DataPlaneError::unexpected(
                "recreate_group",
                Some(shard),
                format!("group status {other}"),
            )),
        }
    }

    /// Undoes [`ShardClient::recreate_group`] when the shard stopped being readable meanwhile:
    /// destroys the consumer group, and deletes the stream when this call's creation made it and
    /// it is still empty with no group.
    ///
    /// # Errors
    /// [`DataPlaneError::Redis`] when Redis fails.
    pub(crate) async fn undo_recreate_group(
        &mut self,
        shard: ShardIndex,
        stream_created: bool,
    ) -> Result<(), DataPlaneError> {
        scripts::undo_recreate_group()
            .key(self.keys.shard(shard))
            .arg(&self.group)
            .arg(if stream_created { "1" } else { "0" })
            .invoke_async::<i64>(&mut self.conn)
            .await
            .map(|_| ())
            .map_err(DataPlaneError::redis("undo_recreate_group", Some(shard)))
    }
}
