//! The real-Redis test harness, Redis Cluster: a local 3-master cluster, streams on keys in
//! different slots through redis-rs's cluster client, and node fault injection.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use redis::streams::StreamId;
use redis::{AsyncTypedCommands, TypedCommands, Value};
use stream_listener::testing::{HarnessError, RedisCluster};

/// `(id, n)` of each entry, in order.
fn entries(ids: &[StreamId]) -> Vec<(String, String)> {
    ids.iter()
        .map(|e| (e.id.clone(), e.get::<String>("n").unwrap()))
        .collect()
}

/// `CLUSTER INFO` of one node, as a map.
fn cluster_info(cluster: &RedisCluster, node: usize) -> BTreeMap<String, String> {
    let mut con = cluster
        .node(node)
        .unwrap()
        .client()
        .get_connection()
        .unwrap();
    let info: String = redis::cmd("CLUSTER").arg("INFO").query(&mut con).unwrap();
    info.lines()
        .filter_map(|line| line.split_once(':'))
        .map(|(k, v)| (k.to_owned(), v.trim().to_owned()))
        .collect()
}

/// The port of the node serving `slot`, from `CLUSTER SLOTS` on node 0.
fn owner_port(cluster: &RedisCluster, slot: i64) -> i64 {
    let mut con = cluster.node(0).unwrap().client().get_connection().unwrap();
    let ranges: Vec<Value> = redis::cmd("CLUSTER").arg("SLOTS").query(&mut con).unwrap();
    ranges
        .iter()
        .find_map(|range| {
            let Value::Array(fields) = range else {
                return None;
            };
            let (Value::Int(start), Value::Int(end), Value::Array(master)) =
                (&fields[0], &fields[1], &fields[2])
            else {
                return None;
            };
            let Value::Int(port) = master[1] else {
                return None;
            };
            (*start..=*end).contains(&slot).then_some(port)
        })
        .unwrap()
}

#[tokio::test]
async fn streams_on_keys_in_different_slots_through_the_cluster_client() {
    let cluster = RedisCluster::start().unwrap();
    assert_eq!(cluster.nodes().len(), 3);
    assert_eq!(cluster.urls().len(), 3);

    // Eight shard streams; their slots must be different and spread over all three masters.
    let keys: Vec<String> = (0..8).map(|i| format!("{{orders:{i}}}")).collect();
    let mut con = cluster.node(0).unwrap().client().get_connection().unwrap();
    let slots: Vec<i64> = keys
        .iter()
        .map(|k| {
            redis::cmd("CLUSTER")
                .arg("KEYSLOT")
                .arg(k)
                .query(&mut con)
                .unwrap()
        })
        .collect();
    assert_eq!(
        slots.iter().collect::<BTreeSet<_>>().len(),
        keys.len(),
        "{slots:?}"
    );
    let owners: BTreeSet<i64> = slots.iter().map(|s| owner_port(&cluster, *s)).collect();
    let node_ports: BTreeSet<i64> = cluster
        .nodes()
        .iter()
        .map(|n| i64::from(n.port()))
        .collect();
    assert_eq!(owners, node_ports);

    let mut con = cluster.client().get_async_connection().await.unwrap();
    let mut written = BTreeMap::new();
    for (i, key) in keys.iter().enumerate() {
        let mut ids = Vec::new();
        for n in 0..3 {
            let value = format!("{i}-{n}");
            let id = con
                .xadd(key, "*", &[("n", value.clone())])
                .await
                .unwrap()
                .unwrap();
            ids.push((id, value));
        }
        written.insert(key.clone(), ids);
    }
    for (key, ids) in &written {
        let range = con.xrange_all(key).await.unwrap();
        assert_eq!(&entries(&range.ids), ids, "stream {key}");
        assert_eq!(con.xlen(key).await.unwrap(), 3);
    }
}

#[test]
fn cluster_info_shows_three_known_nodes_and_full_coverage() {
    let cluster = RedisCluster::start().unwrap();
    for node in 0..3 {
        let info = cluster_info(&cluster, node);
        assert_eq!(info["cluster_state"], "ok");
        assert_eq!(info["cluster_known_nodes"], "3");
        assert_eq!(info["cluster_size"], "3");
        assert_eq!(info["cluster_slots_assigned"], "16384");
        assert_eq!(info["cluster_slots_ok"], "16384");
    }
    assert!(matches!(
        cluster.pause_node(3),
        Err(HarnessError::NoSuchNode { index: 3, count: 3 })
    ));
}

#[test]
fn a_restarted_node_rejoins_with_its_slots() {
    let mut cluster = RedisCluster::builder().aof(true).start().unwrap();
    let client = cluster.client();
    let mut con = client.get_connection().unwrap();
    let keys: Vec<String> = (0..8).map(|i| format!("{{orders:{i}}}")).collect();
    for key in &keys {
        con.set(key.as_str(), key.as_str()).unwrap();
    }
    drop(con);

    let port = cluster.node(1).unwrap().port();
    cluster.kill_node(1).unwrap();
    cluster.restart_node(1).unwrap();
    assert_eq!(cluster.node(1).unwrap().port(), port);
    cluster.wait_until_ready().unwrap();

    // Same node id and slots (from its nodes.conf), data from its append-only file.
    let mut con = client.get_connection().unwrap();
    con.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    for key in &keys {
        assert_eq!(
            con.get(key.as_str()).unwrap().as_deref(),
            Some(key.as_str())
        );
    }
}

#[test]
fn a_paused_node_times_out_then_answers_after_resume() {
    let cluster = RedisCluster::start().unwrap();
    let node = cluster.node(2).unwrap();
    let mut con = node.client().get_connection().unwrap();
    con.set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();

    cluster.pause_node(2).unwrap();
    let error = redis::cmd("PING").query::<String>(&mut con).unwrap_err();
    assert!(error.is_timeout(), "{error:?}");

    cluster.resume_node(2).unwrap();
    let mut con = node.client().get_connection().unwrap();
    assert_eq!(
        redis::cmd("PING").query::<String>(&mut con).unwrap(),
        "PONG"
    );
    let info = cluster_info(&cluster, 2);
    assert_eq!(info["cluster_state"], "ok");
}

/// `masters(3).replicas(1)`: six nodes, three masters each with a linked replica; the key
/// helpers find a key's master and its replica; `CLUSTER FAILOVER` swaps them with the data; a
/// `kill -9` of a master makes the cluster promote its replica.
#[test]
fn a_cluster_with_replicas_fails_over_gracefully_and_after_a_kill() {
    let mut cluster = RedisCluster::builder()
        .masters(3)
        .replicas(1)
        .node_timeout(Duration::from_millis(1000))
        .start()
        .unwrap();
    assert_eq!(cluster.nodes().len(), 6);
    let masters: Vec<usize> = (0..6).filter(|&i| cluster.is_master(i).unwrap()).collect();
    assert_eq!(masters.len(), 3, "{masters:?}");
    let replicas: BTreeSet<usize> = masters
        .iter()
        .map(|&m| {
            cluster
                .replica_of(m)
                .unwrap()
                .expect("every master has a replica")
        })
        .collect();
    assert_eq!(replicas.len(), 3);
    assert!(replicas.iter().all(|r| !masters.contains(r)));
    let info = cluster_info(&cluster, 0);
    assert_eq!(info["cluster_size"], "3");
    assert_eq!(info["cluster_known_nodes"], "6");

    // CLUSTER FAILOVER goes to a replica; a master refuses it.
    let refused = cluster.failover(masters[0]).unwrap_err();
    assert!(
        matches!(&refused, HarnessError::UnexpectedReply { index, command, reply }
            if *index == masters[0] && command == "CLUSTER FAILOVER" && reply.contains("replica")),
        "{refused:?}"
    );

    let client = cluster.client();
    let mut con = client.get_connection().unwrap();
    con.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    con.set("{orders:0}", "before").unwrap();
    let old_master = cluster.master_of_key("{orders:0}").unwrap();
    let replica = cluster.replica_of(old_master).unwrap().unwrap();

    // Graceful: the replica takes over, the old master follows it.
    cluster.failover(replica).unwrap();
    assert!(cluster.is_master(replica).unwrap());
    assert!(!cluster.is_master(old_master).unwrap());
    assert_eq!(cluster.master_of_key("{orders:0}").unwrap(), replica);
    assert_eq!(cluster.replica_of(replica).unwrap(), Some(old_master));
    assert_eq!(con.get("{orders:0}").unwrap().as_deref(), Some("before"));
    // The write and its WAIT on one connection to the key's master: the write reached the
    // replica before the kill below. (A keyless WAIT through the cluster client fans out over its
    // slot map, stale right after the failover, and can reach the demoted node, which refuses it.)
    let mut node = cluster.nodes()[replica].client().get_connection().unwrap();
    let () = node.set("{orders:0}", "after failover").unwrap();
    let acked: i64 = redis::cmd("WAIT")
        .arg(1)
        .arg(1000)
        .query(&mut node)
        .unwrap();
    assert_eq!(acked, 1);

    // kill -9 of the new master: its replica (the old master) is promoted.
    cluster.kill_node(replica).unwrap();
    cluster.wait_until_promoted(old_master).unwrap();
    assert_eq!(cluster.master_of_key("{orders:0}").unwrap(), old_master);
    assert_eq!(cluster.replica_of(old_master).unwrap(), None);
    let mut con = client.get_connection().unwrap();
    con.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert_eq!(
        con.get("{orders:0}").unwrap().as_deref(),
        Some("after failover")
    );
    assert!(matches!(
        cluster.failover(6),
        Err(HarnessError::NoSuchNode { index: 6, count: 6 })
    ));
}
