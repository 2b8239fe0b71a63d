//! Whether a consumer group has live members, judged as `delete_group` judges it
//! (docs/design.md §10.5): a member is live while its lease runs past Redis `TIME`. The operations
//! that Kafka refuses for an active group (reset, delete) refuse a live group here.

use std::sync::LazyLock;

use redis::Script;

use super::group::group_active;
use super::{AdminError, scripts};
use crate::connection::RedisConnection;
use crate::coordinator::CoordinatorConfig;
use crate::keys::{GroupKeys, StreamKeys};
use crate::model::Micros;
use crate::store::{GroupStore, StoreError};

/// Members whose lease runs past Redis `TIME` ([`scripts::LIVE_LEASES_LUA`]: the sorted set,
/// or the member JSON when the sorted set holds another type). KEYS[1] leases, KEYS[2] group
/// hash. Returns {member, expiry µs, ...} (at most 20 members).
fn live_leases_script() -> &'static Script {
    static SCRIPT: LazyLock<Script> = LazyLock::new(|| {
        Script::new(&format!(
            "{}{}",
            scripts::LIVE_LEASES_LUA,
            r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
return live_leases(KEYS[1], KEYS[2], now)
"
        ))
    });
    &SCRIPT
}

/// Fails with [`AdminError::GroupActive`] when a member of `group` is live: first on the loaded
/// group (its members' `memberLeaseExpiresAt` at the load's Redis `TIME`), then on the leases
/// sorted set in one script (the lease a heartbeat renews). A group whose metadata is missing or
/// unreadable is judged by the sorted set alone.
///
/// # Errors
/// [`AdminError::GroupActive`] naming the live members; [`AdminError::Store`] on a Redis failure.
pub(super) async fn refuse_live(
    conn: &mut RedisConnection,
    keys: &StreamKeys,
    group_keys: &GroupKeys,
) -> Result<(), AdminError> {
    let prefix = keys.prefix();
    let group = group_keys.group();
    let mut store = GroupStore::new(
        conn.clone(),
        keys.clone(),
        group_keys.clone(),
        CoordinatorConfig::default(),
    );
    // Missing or unreadable metadata: the sorted set below decides.
    refuse_live_in_loaded(&mut store, prefix, group).await?;
    let reply: Vec<String> = live_leases_script()
        .key(group_keys.leases())
        .key(group_keys.metadata())
        .invoke_async(conn)
        .await
        .map_err(StoreError::from)?;
    if reply.is_empty() {
        return Ok(());
    }
    let live = reply
        .chunks(2)
        .map(|pair| {
            let expiry = pair.get(1).and_then(|s| s.parse::<f64>().ok());
            // Scores are whole µs below 2^53, so f64 holds them exactly.
            (pair[0].clone(), expiry.unwrap_or(0.0) as Micros)
        })
        .collect();
    let now = scripts::stream_time(conn, keys).await?;
    Err(group_active(prefix, group, live, now))
}

/// The first half of [`refuse_live`], shared with `delete_group`: loads the group and fails with
/// [`AdminError::GroupActive`] when a member's `memberLeaseExpiresAt` is past the load's Redis
/// `TIME`. Metadata that is missing or unreadable passes (the caller's leases script decides).
///
/// # Errors
/// [`AdminError::GroupActive`]; [`AdminError::Store`] on a Redis failure.
pub(super) async fn refuse_live_in_loaded(
    store: &mut GroupStore,
    prefix: &str,
    group: &str,
) -> Result<(), AdminError> {
    match store.load().await {
        Ok(loaded) => {
            let live: Vec<(String, Micros)> = loaded
                .group
                .members
                .values()
                .filter(|m| m.member_lease_expires_at > loaded.now)
                .map(|m| (m.member_id.clone(), m.member_lease_expires_at))
                .collect();
            if live.is_empty() {
                Ok(())
            } else {
                Err(group_active(prefix, group, live, loaded.now))
            }
        }
        Err(StoreError::Redis(err)) => Err(StoreError::Redis(err).into()),
        Err(_) => Ok(()),
    }
}
