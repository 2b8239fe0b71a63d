//! One scenario on its own server: the stream, convergence, then the measured windows.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::measure::*;
use crate::report::*;
use crate::units::*;
use crate::*;
use redis::AsyncCommands;
use stream_listener_core::connection::{RedisConnection, RedisTarget};
use stream_listener_core::keys::StreamKeys;
use stream_listener_core::model::{
    GroupState, HeartbeatStatus, ShardInfo, ShardState, StreamMetadata,
};
use stream_listener_core::store::{GroupStore, StreamCas, write_stream_metadata};
use stream_listener_core::testing::RedisServer;

pub(crate) async fn create_stream(conn: &mut RedisConnection, shards: u32) {
    let keys = StreamKeys::new(PREFIX).expect("prefix");
    let mut meta = StreamMetadata {
        stream_prefix: PREFIX.into(),
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
    assert_eq!(written, StreamCas::Written);
}

pub(crate) fn member_id(i: usize) -> String {
    format!("member-{i:04}")
}

pub(crate) fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

/// Joins every member, then heartbeats rounds over all members until the group is STABLE and
/// every member converged. Sequential: concurrent full transitions only conflict. Gives up (false)
/// after `MAX_ROUNDS` rounds or `limit`.
pub(crate) async fn converge(
    members: &mut [Member],
    store: &mut GroupStore,
    ttl: Duration,
    limit: Duration,
) -> bool {
    let started = Instant::now();
    for round in 0..MAX_ROUNDS {
        let round_start = Instant::now();
        let mut full = 0usize;
        let mut fast = 0usize;
        let mut retries = 0usize;
        let mut conflicts = 0usize;
        let mut max_latency = Duration::ZERO;
        let mut statuses: BTreeMap<String, usize> = BTreeMap::new();
        for member in members.iter_mut() {
            let sample = member.heartbeat().await;
            assert!(!sample.error, "convergence heartbeat failed");
            if sample.fast_path {
                fast += 1;
            } else {
                full += 1;
            }
            if sample.attempts > 1 {
                conflicts += 1;
            }
            if sample.status == Some(HeartbeatStatus::Retry) {
                retries += 1;
            }
            if let Some(status) = sample.status
                && status != HeartbeatStatus::Ok
            {
                *statuses.entry(format!("{status:?}")).or_default() += 1;
            }
            max_latency = max_latency.max(sample.latency);
        }
        let loaded = store.load().await.expect("load group");
        let converged = members.iter().filter(|m| m.converged()).count();
        let max_gap = members.iter().map(|m| m.max_gap).max().unwrap_or_default();
        let took = round_start.elapsed();
        println!(
            "  round {round:>2}: {took:>8.2?} ({} per heartbeat, max {}), full {full}, fast {fast}, \
             CAS conflicts {conflicts}, RETRY {retries}, other statuses {statuses:?}; \
             group {:?}, {} members, converged {converged}/{}, longest gap between two \
             heartbeats of a member {max_gap:.1?}",
            ms(took / u32::try_from(members.len()).unwrap_or(1)),
            ms(max_latency),
            loaded.group.meta.state,
            loaded.group.members.len(),
            members.len(),
        );
        if max_gap > ttl {
            println!(
                "  warning: a member went {max_gap:.1?} without a heartbeat (lease TTL {ttl:?})"
            );
        }
        if loaded.group.meta.state == GroupState::Stable
            && loaded.group.members.len() == members.len()
            && converged == members.len()
        {
            println!(
                "  converged in {:.1?} ({} rounds after the joins)",
                started.elapsed(),
                round
            );
            return true;
        }
        if started.elapsed() > limit {
            println!(
                "  NOT converged after {:.1?} ({} rounds): giving up",
                started.elapsed(),
                round + 1
            );
            return false;
        }
    }
    println!("  NOT converged after {MAX_ROUNDS} rounds: giving up");
    false
}

/// The figures of one scenario.
pub(crate) struct Report {
    pub(crate) scenario: Scenario,
    pub(crate) idle: Measured,
    pub(crate) ping: Measured,
    pub(crate) renewal: Measured,
    /// `None` when the group did not converge.
    pub(crate) steady: Option<Measured>,
    pub(crate) convergence: Duration,
}

pub(crate) async fn run_scenario(scenario: Scenario, options: &Options) -> Report {
    let config = scenario.config();
    let interval = config.heartbeat_interval;
    let ttl = config.member_lease_ttl;
    println!(
        "\n== scenario {}: {} members x {} shards, a heartbeat every {interval:?} each \
         ({:.1}/s), lease TTL {ttl:?}, rebalance timeout {:?}{}",
        scenario.name,
        scenario.members,
        scenario.shards,
        scenario.members as f64 / interval.as_secs_f64(),
        config.rebalance_timeout,
        if scenario.after_loss {
            ", group provisioned as after a loss (hand-out hold of one lease TTL)"
        } else {
            ""
        }
    );
    let server = RedisServer::start().expect("start redis-server");
    println!("  redis-server pid {:?} at {}", server.pid(), server.url());
    let target = RedisTarget::Standalone(server.url());
    let mut conn = RedisConnection::connect(&target, Duration::from_secs(10))
        .await
        .expect("connect");
    create_stream(&mut conn, scenario.shards).await;
    let stream_keys = StreamKeys::new(PREFIX).expect("prefix");
    let group_keys = stream_keys.group(GROUP).expect("group");

    // 1. Idle.
    let idle = idle(&mut conn, options.idle).await;
    println!("  idle: Redis CPU {:.3}% of a core", idle.cpu() * 100.0);

    // 2. Baselines at the same rate.
    let lead = Duration::from_millis(200);
    let now = Instant::now();
    let pings: Vec<Ping> = (0..scenario.members)
        .map(|_| Ping { conn: conn.clone() })
        .collect();
    let (_, ping) = run_paced(
        pings,
        interval,
        now + lead,
        now + lead + Duration::from_secs(1),
        now + lead + Duration::from_secs(1) + options.baseline_window,
        conn.clone(),
        None,
    )
    .await;
    print_window("baseline PING", &ping);

    let mut seed = redis::pipe();
    for i in 0..scenario.members {
        seed.zadd(BASELINE_LEASES, member_id(i), 0).ignore();
    }
    let _: () = seed
        .query_async(&mut conn)
        .await
        .expect("seed baseline set");
    let renewals: Vec<Renewal> = (0..scenario.members)
        .map(|i| Renewal {
            conn: conn.clone(),
            metadata_key: stream_keys.metadata(),
            member: member_id(i),
            ttl_us: u64::try_from(ttl.as_micros()).unwrap_or(u64::MAX),
        })
        .collect();
    let now = Instant::now();
    let (_, renewal) = run_paced(
        renewals,
        interval,
        now + lead,
        now + lead + Duration::from_secs(1),
        now + lead + Duration::from_secs(1) + options.baseline_window,
        conn.clone(),
        None,
    )
    .await;
    print_window("baseline HGET + ZADD XX (pipelined)", &renewal);

    // 3. Convergence.
    let mut store = GroupStore::new(
        conn.clone(),
        stream_keys.clone(),
        group_keys.clone(),
        config,
    );
    store
        .provision(scenario.after_loss)
        .await
        .expect("provision");
    let mut members: Vec<Member> = (0..scenario.members)
        .map(|i| Member::new(member_id(i), store.clone()))
        .collect();
    println!("  convergence (round 0 = the joins):");
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut conn)
        .await
        .expect("CONFIG RESETSTAT");
    let cpu_before = redis_cpu(&mut conn).await;
    let convergence_start = Instant::now();
    let converged = converge(&mut members, &mut store, ttl, options.converge_limit).await;
    let convergence = convergence_start.elapsed();
    let cpu = (redis_cpu(&mut conn).await - cpu_before) / convergence.as_secs_f64();
    let hlen: u64 = conn.hlen(group_keys.metadata()).await.expect("HLEN");
    let bytes: Option<u64> = redis::cmd("MEMORY")
        .arg("USAGE")
        .arg(group_keys.metadata())
        .query_async(&mut conn)
        .await
        .expect("MEMORY USAGE");
    println!(
        "  during convergence: Redis CPU {:.1}% of a core; group hash {hlen} fields, {:.2} MB",
        cpu * 100.0,
        bytes.unwrap_or(0) as f64 / 1e6
    );
    print_commands(&command_stats(&mut conn).await, 4);
    if !converged {
        return Report {
            scenario,
            idle,
            ping,
            renewal,
            steady: None,
            convergence,
        };
    }

    // 4. Steady state: one interval of warm-up, then the window.
    let now = Instant::now();
    let start = now + lead;
    let from = start + interval;
    let stop = from + options.window;
    let (members, steady) = run_paced(
        members,
        interval,
        start,
        from,
        stop,
        conn.clone(),
        Some(&group_keys),
    )
    .await;
    print_window("steady heartbeats", &steady);
    let loaded = store.load().await.expect("load group");
    println!(
        "  after the window: group {:?}, {} members; {} of {} members converged",
        loaded.group.meta.state,
        loaded.group.members.len(),
        members.iter().filter(|m| m.converged()).count(),
        members.len()
    );
    println!("  INFO commandstats of the steady window:");
    print_commands(&steady.commands, 6);
    drop(server);
    Report {
        scenario,
        idle,
        ping,
        renewal,
        steady: Some(steady),
        convergence,
    }
}
