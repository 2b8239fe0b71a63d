//! Listing the streams and the groups of a stream.

use std::collections::BTreeSet;

use redis::AsyncCommands;
use serde::Serialize;

use super::group::view_group;
use crate::admin::{AdminError, load_required, stream_keys};
use crate::connection::{RedisConnection, RedisFailure};
use crate::coordinator::CoordinatorConfig;
use crate::keys::{STREAMS_INDEX_KEY, StreamKeys};
use crate::model::{Epoch, GroupState, MemberState, Migration, StartFrom};
use crate::report::Chain;
use crate::store::{GroupStore, StoreError, load_stream_metadata};

/// One stream in [`list_streams`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StreamSummary {
    /// The stream prefix.
    pub stream_prefix: String,
    /// Shards producers route to; `None` when the metadata cannot be read.
    pub shard_count: Option<u32>,
    /// `metadataVersion`; `None` when the metadata cannot be read.
    pub metadata_version: Option<u64>,
    /// Registered consumer groups.
    pub groups: Vec<String>,
    /// The running migration, if any.
    pub migration: Option<Migration>,
    /// Why the metadata cannot be read (corrupt JSON, unknown schema), if it cannot.
    pub problem: Option<String>,
}

/// Lists the streams of the index `sl:streams`, sorted by prefix, each with its metadata loaded.
/// Prefixes whose metadata no longer exists are skipped (the index is rebuildable, never a source
/// of truth); metadata that cannot be read (corrupt, or refused by the user's ACL rule) is listed
/// with its [`StreamSummary::problem`].
///
/// # Errors
/// [`AdminError::Store`] when Redis fails.
pub async fn list_streams(conn: &mut RedisConnection) -> Result<Vec<StreamSummary>, AdminError> {
    let prefixes: BTreeSet<String> = conn
        .smembers(STREAMS_INDEX_KEY)
        .await
        .map_err(StoreError::from)?;
    let mut out = Vec::new();
    for prefix in prefixes {
        let summary = |problem: Option<String>| StreamSummary {
            stream_prefix: prefix.clone(),
            shard_count: None,
            metadata_version: None,
            groups: Vec::new(),
            migration: None,
            problem,
        };
        let keys = match StreamKeys::new(&prefix) {
            Ok(keys) => keys,
            Err(err) => {
                out.push(summary(Some(Chain(&err).to_string())));
                continue;
            }
        };
        match load_stream_metadata(conn, &keys).await {
            Ok(Some(meta)) => out.push(StreamSummary {
                shard_count: Some(meta.shard_count),
                metadata_version: Some(meta.metadata_version),
                groups: meta.groups.into_iter().map(|g| g.consumer_group).collect(),
                migration: meta.migration,
                ..summary(None)
            }),
            Ok(None) => {}
            // An admin user whose ACL rule covers some streams only (README "ACL users" gives one
            // stream's): the others are listed as unreadable, not a failure of the whole list.
            Err(StoreError::Redis(err)) if RedisFailure::of(&err) == RedisFailure::NoPermission => {
                out.push(summary(Some(format!(
                    "the Redis user may not read its metadata ({}): its ACL rule covers other streams; add this stream's key patterns (README \"ACL users\") to see it",
                    keys.metadata()
                ))));
            }
            Err(StoreError::Redis(err)) => return Err(StoreError::Redis(err).into()),
            Err(err) => out.push(summary(Some(Chain(&err).to_string()))),
        }
    }
    Ok(out)
}

/// One group in [`list_groups`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GroupSummary {
    /// The consumer group.
    pub consumer_group: String,
    /// Its registered `startFrom`.
    pub start_from: StartFrom,
    /// Group state (as [`describe_group`](crate::admin::describe_group) shows it); `None` when the metadata cannot be read.
    pub state: Option<GroupState>,
    /// Group epoch; `None` when the metadata cannot be read.
    pub group_epoch: Option<Epoch>,
    /// Members in the group metadata.
    pub members: usize,
    /// Members that are ACTIVE with a running lease.
    pub live_members: usize,
    /// Why the group metadata cannot be read (missing: lost metadata; corrupt), if it cannot.
    pub problem: Option<String>,
}

/// Lists the consumer groups registered on stream `prefix`, in registration order, each with a
/// summary of its metadata (judged like [`describe_group`](crate::admin::describe_group), with `config`). A group whose
/// metadata is missing or corrupt is listed with its [`GroupSummary::problem`].
///
/// # Errors
/// [`AdminError::InvalidName`]; [`AdminError::Store`]: unknown stream, corrupt stream metadata,
/// Redis failure.
pub async fn list_groups(
    conn: &mut RedisConnection,
    prefix: &str,
    config: &CoordinatorConfig,
) -> Result<Vec<GroupSummary>, AdminError> {
    let keys = stream_keys(prefix)?;
    let meta = load_required(conn, &keys).await?;
    let mut out = Vec::new();
    for registered in &meta.groups {
        let group_keys = keys.group(&registered.consumer_group)?;
        let mut store = GroupStore::new(conn.clone(), keys.clone(), group_keys, config.clone());
        let mut summary = GroupSummary {
            consumer_group: registered.consumer_group.clone(),
            start_from: registered.start_from,
            state: None,
            group_epoch: None,
            members: 0,
            live_members: 0,
            problem: None,
        };
        match store.load().await {
            Ok(loaded) => {
                let (view, _) = view_group(&loaded.group, loaded.now, &meta, config);
                summary.state = Some(view.meta.state);
                summary.group_epoch = Some(view.meta.group_epoch);
                summary.members = view.members.len();
                summary.live_members = view
                    .members
                    .values()
                    .filter(|m| {
                        m.state == MemberState::Active && m.member_lease_expires_at > loaded.now
                    })
                    .count();
            }
            Err(StoreError::Redis(err)) => return Err(StoreError::Redis(err).into()),
            Err(err) => summary.problem = Some(Chain(&err).to_string()),
        }
        out.push(summary);
    }
    Ok(out)
}
