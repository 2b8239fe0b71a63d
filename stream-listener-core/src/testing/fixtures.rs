//! Protocol values and Redis setup that unit tests, integration tests and benchmarks share: a
//! heartbeat request, coordinator timings in milliseconds, a fence token, an all-active stream, a
//! stream provisioned as the admin tool does, `CLIENT PAUSE WRITE`, and the keys of the last
//! `XREAD` the server finished.
//!
//! The pure constructors are also compiled for the crate's own unit tests without the `testing`
//! feature; the ones that talk to Redis need it. Fixtures panic on failure: they are setup, and a
//! failing setup fails the test that called it.

use std::time::Duration;

use crate::coordinator::CoordinatorConfig;
use crate::fence::FenceToken;
use crate::model::{
    Epoch, HeartbeatRequest, Micros, PROTOCOL_VERSION, RevokeState, RevokingShard, ShardIndex,
};

/// A heartbeat of `member` (name `name`, process `proc-<member>`) at `(request_seq,
/// member_epoch)`, having adopted `metadata_version`, owning `owned`, with one worker, nothing
/// revoking and no fence conflict (docs/design.md §6). Change the rest with struct update syntax.
pub fn heartbeat_request(
    member: &str,
    name: &str,
    metadata_version: u64,
    (seq, epoch): (u64, Epoch),
    owned: &[ShardIndex],
) -> HeartbeatRequest {
    HeartbeatRequest {
        member_id: member.into(),
        member_name: name.into(),
        instance_id: None,
        process_id: format!("proc-{member}"),
        request_seq: seq,
        member_epoch: epoch,
        metadata_version,
        runtime_max_concurrency: 1,
        active_consumer_workers: 0,
        owned_shards: owned.to_vec(),
        revoking_shards: Vec::new(),
        fence_conflicts: Vec::new(),
        protocol_version: PROTOCOL_VERSION,
    }
}

/// `shards`, each reported as revoking in `state`, in the order given.
pub fn revoking(shards: &[ShardIndex], state: RevokeState) -> Vec<RevokingShard> {
    shards
        .iter()
        .map(|s| RevokingShard {
            shard_index: *s,
            state,
        })
        .collect()
}

/// The `[coordination]` timings from milliseconds: heartbeat interval, lease TTL, rebalance
/// timeout. Panics where [`CoordinatorConfig::new`] refuses them.
pub fn timings(heartbeat_ms: u64, lease_ms: u64, rebalance_ms: u64) -> CoordinatorConfig {
    CoordinatorConfig::new(
        Duration::from_millis(heartbeat_ms),
        Duration::from_millis(lease_ms),
        Duration::from_millis(rebalance_ms),
    )
    .unwrap()
}

/// The fence token of `member` (process `proc-<member>`) at `(incarnation, epoch)`
/// (docs/design.md §8).
pub fn fence_token(incarnation: Micros, epoch: Epoch, member: &str) -> FenceToken {
    FenceToken {
        incarnation,
        member_epoch: epoch,
        member_id: member.into(),
        process_id: format!("proc-{member}"),
    }
}

#[cfg(feature = "testing")]
pub use redis_setup::{
    command_calls, create_active_stream, create_stream, last_xread_keys, pause_writes,
};

#[cfg(feature = "testing")]
mod redis_setup {
    use crate::connection::RedisConnection;
    use crate::keys::StreamKeys;
    use crate::model::{ShardInfo, ShardState, StreamMetadata};
    use crate::store::{StreamCas, write_stream_metadata};

    /// Writes the metadata of a new stream `prefix` of `shards` shards, all ACTIVE, at
    /// `metadataVersion` 1 with no group (docs/design.md §3), without creating the shard
    /// streams. Panics on a Redis error, on an invalid prefix, or if the stream exists.
    pub async fn create_active_stream(conn: &mut RedisConnection, prefix: &str, shards: u32) {
        let keys = StreamKeys::new(prefix).expect("stream prefix");
        let mut meta = StreamMetadata {
            stream_prefix: prefix.into(),
            shard_count: shards,
            shards: (0..shards)
                .map(|i| ShardInfo {
                    shard_index: i,
                    state: ShardState::Active,
                })
                .collect(),
            metadata_version: 1,
            groups: Vec::new(),
            migration: None,
            updated_at: "2026-11-29T00:00:00Z".into(),
            revision: 0,
        };
        let written = write_stream_metadata(conn, &keys, None, &mut meta)
            .await
            .expect("write stream metadata");
        assert_eq!(written, StreamCas::Written, "stream {prefix} exists");
    }

    /// Creates stream `prefix` with `shards` shard streams, as `stream-listener stream create`
    /// does ([`crate::admin::create_stream`]), for the unit tests of layers below `admin` (the
    /// layering check, `tests/module_layering.rs`, lets them reach it only through this
    /// harness). Panics on a Redis error or if the stream exists.
    pub async fn create_stream(conn: &mut RedisConnection, prefix: &str, shards: u32) {
        crate::admin::create_stream(conn, prefix, shards)
            .await
            .expect("create the stream");
    }

    /// `CLIENT PAUSE <ms> WRITE`: commands that write (`XREADGROUP` and the ack script among
    /// them) wait for `ms` milliseconds, reads go on. Panics on a Redis error.
    pub async fn pause_writes(conn: &mut RedisConnection, ms: u64) {
        let () = redis::cmd("CLIENT")
            .arg("PAUSE")
            .arg(ms)
            .arg("WRITE")
            .query_async(conn)
            .await
            .expect("CLIENT PAUSE WRITE");
    }
    /// How many times the server ran `command` (lower case, `client|unblock` for a
    /// subcommand), from `INFO commandstats`; 0 when it never ran. Panics on a Redis error.
    pub async fn command_calls(conn: &mut RedisConnection, command: &str) -> u64 {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(conn)
            .await
            .expect("INFO commandstats");
        let prefix = format!("cmdstat_{command}:calls=");
        info.lines()
            .find_map(|line| line.strip_prefix(prefix.as_str()))
            .and_then(|rest| rest.split(',').next())
            .map_or(0, |n| n.parse().expect("a call count"))
    }

    /// The shard keys of the most recent shared wait the server finished — an `XREAD`, or in
    /// strict mode an `XREADGROUP … BLOCK` over the shards and their read gates (the gates left
    /// out) — from its `SLOWLOG` (set `slowlog-log-slower-than 0` first so that every command
    /// is logged with its arguments). Panics when the log holds neither.
    pub async fn last_xread_keys(conn: &mut RedisConnection) -> Vec<String> {
        let log: redis::Value = redis::cmd("SLOWLOG")
            .arg("GET")
            .arg(-1)
            .query_async(conn)
            .await
            .expect("SLOWLOG GET");
        let redis::Value::Array(entries) = log else {
            panic!("SLOWLOG GET answered {log:?}")
        };
        for entry in entries {
            let redis::Value::Array(fields) = entry else {
                continue;
            };
            let Some(redis::Value::Array(args)) = fields.get(3) else {
                continue;
            };
            let args: Vec<String> = args
                .iter()
                .map(|a| redis::from_redis_value(a.clone()).expect("a bulk string argument"))
                .collect();
            let command = args.first().map(|c| c.to_ascii_lowercase());
            let blocking_read = command.as_deref() == Some("xreadgroup")
                && args.iter().any(|a| a.eq_ignore_ascii_case("block"));
            if command.as_deref() == Some("xread") || blocking_read {
                let streams = args.iter().position(|a| a == "STREAMS").expect("STREAMS");
                let keys = &args[streams + 1..];
                return keys[..keys.len() / 2]
                    .iter()
                    .filter(|key| !key.contains(":gate:"))
                    .cloned()
                    .collect();
            }
        }
        panic!("no XREAD or blocking XREADGROUP in the slow log");
    }
}
