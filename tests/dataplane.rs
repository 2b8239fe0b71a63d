//! The data plane's fenced shard operations on real Redis (docs/design.md §8): fence raise and
//! check rules (against the Rust model), stale tokens changing nothing, `acks` mode, own-PEL reads
//! with delivery counts, takeover claims without inflating counts, trimmed entries, missing
//! groups (Redis restarted empty), dead letters, and blocking waits (a client timeout below
//! BLOCK); then all of it on a 3-master cluster with shards in different slots.

mod support;

use std::time::{Duration, Instant};

use redis::AsyncCommands;
use stream_listener::core::internals::connection::{RedisConnection, RedisTarget};
use stream_listener::core::internals::dataplane::{
    ClaimReport, DataPlaneError, DeadLetterReason, EntryStatus, Fenced, FencingMode, ReadOutcome,
    ShardClient, ShardEntry, Waiter, key_slot,
};
use stream_listener::core::internals::fence::FenceVerdict;
use stream_listener::core::internals::keys::StreamKeys;
use stream_listener::testing::fixtures::fence_token as token;
use stream_listener::testing::{RedisCluster, RedisServer};
use support::connect;

const GROUP: &str = "g";
const STRICT: FencingMode = FencingMode::Strict;

fn client(conn: &RedisConnection, prefix: &str, member: &str) -> ShardClient {
    ShardClient::new(
        conn.clone(),
        StreamKeys::new(prefix).unwrap(),
        GROUP,
        member,
    )
    .unwrap()
}

async fn create_group(conn: &mut RedisConnection, key: &str) {
    let () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(key)
        .arg(GROUP)
        .arg("0")
        .arg("MKSTREAM")
        .query_async(conn)
        .await
        .unwrap();
}

/// Appends entries `<first>-0 ..= <last>-0`, each `key k<n> payload p<n>`.
async fn add(conn: &mut RedisConnection, key: &str, first: u64, last: u64) {
    for n in first..=last {
        let _: String = conn
            .xadd(
                key,
                format!("{n}-0"),
                &[("key", format!("k{n}")), ("payload", format!("p{n}"))],
            )
            .await
            .unwrap();
    }
}

fn ids(first: u64, last: u64) -> Vec<String> {
    (first..=last).map(|n| format!("{n}-0")).collect()
}

/// The group's whole PEL: (id, consumer, delivery count).
async fn pel(conn: &mut RedisConnection, key: &str) -> Vec<(String, String, u64)> {
    let rows: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
        .arg(key)
        .arg(GROUP)
        .arg("-")
        .arg("+")
        .arg(10_000)
        .query_async(conn)
        .await
        .unwrap();
    rows.into_iter().map(|(id, c, _, n)| (id, c, n)).collect()
}

fn pel_of(consumer: &str, first: u64, last: u64, count: u64) -> Vec<(String, String, u64)> {
    ids(first, last)
        .into_iter()
        .map(|id| (id, consumer.to_owned(), count))
        .collect()
}

fn entries(outcome: ReadOutcome) -> Vec<ShardEntry> {
    match outcome {
        ReadOutcome::Entries(entries) => entries,
        other => panic!("expected entries, got {other:?}"),
    }
}

fn present(id: u64, delivery_count: u64) -> ShardEntry {
    ShardEntry {
        id: format!("{id}-0"),
        fields: vec![
            ("key".into(), format!("k{id}").into_bytes()),
            ("payload".into(), format!("p{id}").into_bytes()),
        ]
        .into(),
        delivery_count,
        status: EntryStatus::Present,
    }
}

fn present_range(first: u64, last: u64, delivery_count: u64) -> Vec<ShardEntry> {
    (first..=last).map(|n| present(n, delivery_count)).collect()
}

async fn fence_field(conn: &mut RedisConnection, prefix: &str, shard: u32) -> Option<String> {
    conn.hget(StreamKeys::new(prefix).unwrap().fence(shard), GROUP)
        .await
        .unwrap()
}

#[tokio::test]
async fn raise_and_check_follow_the_rust_model_exactly() {
    let server = RedisServer::start().unwrap();
    let target = RedisTarget::standalone(server.url());
    let mut conn = connect(&target).await;
    let mut a = client(&conn, "orders", "a");
    let fence = StreamKeys::new("orders").unwrap().fence(0);

    // No fence is ever written next to a missing stream (a retired shard's would come back:
    // docs/design.md §8.11).
    let a5 = token(1_747_303_200_000_000, 5, "a");
    assert!(a.raise_fence(0, &a5).await.unwrap_err().is_no_group());
    assert_eq!(fence_field(&mut conn, "orders", 0).await, None);
    add(&mut conn, "{orders:0}", 1, 1).await;

    // The brief's cases, with exact values.
    assert_eq!(a.raise_fence(0, &a5).await.unwrap(), Ok(()));
    assert_eq!(fence_field(&mut conn, "orders", 0).await, Some(a5.encode()));
    assert_eq!(a.raise_fence(0, &a5).await.unwrap(), Ok(()), "same token");
    let higher = Err(Fenced::Higher {
        found: Some(a5.clone()),
    });
    let b4 = token(1_747_303_200_000_000, 4, "b");
    assert_eq!(a.raise_fence(0, &b4).await.unwrap(), higher, "lower");
    let b5 = token(1_747_303_200_000_000, 5, "b");
    assert_eq!(a.raise_fence(0, &b5).await.unwrap(), higher, "equal pair");
    let mut a5_other_process = a5.clone();
    a5_other_process.process_id = "proc-a-2".into();
    assert_eq!(a.raise_fence(0, &a5_other_process).await.unwrap(), higher);
    assert_eq!(fence_field(&mut conn, "orders", 0).await, Some(a5.encode()));
    let b6 = token(1_747_303_200_000_000, 6, "b");
    assert_eq!(a.raise_fence(0, &b6).await.unwrap(), Ok(()));
    let c1 = token(1_747_303_200_000_001, 1, "c");
    assert_eq!(
        a.raise_fence(0, &c1).await.unwrap(),
        Ok(()),
        "new incarnation"
    );
    assert_eq!(fence_field(&mut conn, "orders", 0).await, Some(c1.encode()));

    // Exact beyond 2^53: a float comparison would call these incarnations equal.
    let big = token(9_007_199_254_740_993, 1, "x");
    let () = conn.hset(&fence, GROUP, big.encode()).await.unwrap();
    let below = token(9_007_199_254_740_992, 9, "y");
    assert_eq!(
        a.raise_fence(0, &below).await.unwrap(),
        Err(Fenced::Higher {
            found: Some(big.clone())
        })
    );
    assert_eq!(
        a.ack(0, &below, &[]).await.unwrap(),
        Err(Fenced::Higher { found: Some(big) })
    );

    // A stored value that is not a token: fail closed.
    let () = conn.hset(&fence, GROUP, "garbage").await.unwrap();
    assert_eq!(
        a.raise_fence(0, &a5).await.unwrap(),
        Err(Fenced::Higher { found: None })
    );
    assert_eq!(
        a.ack(0, &a5, &[]).await.unwrap(),
        Err(Fenced::Higher { found: None })
    );

    // Every pair of a small grid: the scripts give FenceToken::raise's and ::check's verdicts.
    let mut grid = Vec::new();
    for incarnation in [1u64, 2] {
        for epoch in [4i64, 5, 6] {
            for member in ["a", "b"] {
                grid.push(token(incarnation, epoch, member));
            }
        }
    }
    let mut cases = 0;
    for stored in std::iter::once(None).chain(grid.iter().map(Some)) {
        for ours in &grid {
            match stored {
                Some(t) => {
                    let () = conn.hset(&fence, GROUP, t.encode()).await.unwrap();
                }
                None => {
                    let _: i64 = conn.hdel(&fence, GROUP).await.unwrap();
                }
            }
            let checked = a.ack(0, ours, &[]).await.unwrap();
            let expected = ours.check(stored);
            match (&checked, expected) {
                (Ok(0), FenceVerdict::Equal) => {}
                (Err(Fenced::Lower), FenceVerdict::Lower) => {}
                (Err(Fenced::Higher { found }), FenceVerdict::Higher) => {
                    assert_eq!(found.as_ref(), stored)
                }
                _ => panic!("check {ours:?} against {stored:?}: {checked:?}, model {expected:?}"),
            }
            let raised = a.raise_fence(0, ours).await.unwrap();
            let (verdict, after) = ours.raise(stored);
            let now = fence_field(&mut conn, "orders", 0).await;
            assert_eq!(now, Some(after.encode()), "{ours:?} over {stored:?}");
            match (&raised, verdict) {
                (Ok(()), FenceVerdict::Equal) => {}
                (Err(Fenced::Higher { found }), FenceVerdict::Higher) => {
                    assert_eq!(found.as_ref(), Some(&after))
                }
                _ => panic!("raise {ours:?} over {stored:?}: {raised:?}, model {verdict:?}"),
            }
            cases += 1;
        }
    }
    assert_eq!(cases, 13 * 12);
}

#[tokio::test]
async fn a_stale_token_reads_acks_and_claims_nothing() {
    let server = RedisServer::start().unwrap();
    let mut conn = connect(&RedisTarget::standalone(server.url())).await;
    let key = "{orders:0}";
    create_group(&mut conn, key).await;
    add(&mut conn, key, 1, 5).await;
    let (a5, b6) = (token(1, 5, "a"), token(1, 6, "b"));
    let mut a = client(&conn, "orders", "a");
    let mut b = client(&conn, "orders", "b");

    assert_eq!(a.raise_fence(0, &a5).await.unwrap(), Ok(()));
    assert_eq!(
        entries(a.read_new(0, &a5, 10, STRICT).await.unwrap()),
        present_range(1, 5, 1)
    );
    assert_eq!(pel(&mut conn, key).await, pel_of("a", 1, 5, 1));

    // b takes over; a is a zombie now.
    assert_eq!(b.raise_fence(0, &b6).await.unwrap(), Ok(()));
    add(&mut conn, key, 6, 6).await;
    let higher = Fenced::Higher {
        found: Some(b6.clone()),
    };
    assert_eq!(
        a.read_new(0, &a5, 10, STRICT).await.unwrap(),
        ReadOutcome::Fenced(higher.clone())
    );
    assert_eq!(
        a.read_pending(0, &a5, "0", 10, STRICT).await.unwrap(),
        ReadOutcome::Fenced(higher.clone())
    );
    assert_eq!(
        a.ack(0, &a5, &ids(1, 5)).await.unwrap(),
        Err(higher.clone())
    );
    assert_eq!(
        a.claim_others(0, &a5, 100).await.unwrap(),
        Err(higher.clone())
    );
    // Nothing changed: same PEL, same counts, entry 6 not delivered.
    assert_eq!(pel(&mut conn, key).await, pel_of("a", 1, 5, 1));

    // A fence below our token, or none (a lost raise): LOWER, nothing done either.
    let b7 = token(1, 7, "b");
    assert_eq!(
        b.read_new(0, &b7, 10, STRICT).await.unwrap(),
        ReadOutcome::Fenced(Fenced::Lower)
    );
    assert_eq!(b.ack(0, &b7, &ids(1, 5)).await.unwrap(), Err(Fenced::Lower));
    let _: i64 = conn
        .hdel(StreamKeys::new("orders").unwrap().fence(0), GROUP)
        .await
        .unwrap();
    assert_eq!(
        b.claim_others(0, &b6, 100).await.unwrap(),
        Err(Fenced::Lower)
    );
    assert_eq!(
        b.read_pending(0, &b6, "0", 10, STRICT).await.unwrap(),
        ReadOutcome::Fenced(Fenced::Lower)
    );
    assert_eq!(pel(&mut conn, key).await, pel_of("a", 1, 5, 1));

    // The owner raises again, claims a's entries with their counts unchanged, processes them.
    assert_eq!(b.raise_fence(0, &b6).await.unwrap(), Ok(()));
    assert_eq!(
        b.claim_others(0, &b6, 100).await.unwrap(),
        Ok(ClaimReport {
            claimed: 5,
            trimmed: 0,
            complete: true
        })
    );
    assert_eq!(pel(&mut conn, key).await, pel_of("b", 1, 5, 1));
    assert_eq!(
        entries(b.read_pending(0, &b6, "0", 10, STRICT).await.unwrap()),
        present_range(1, 5, 2)
    );
    assert_eq!(b.ack(0, &b6, &ids(1, 5)).await.unwrap(), Ok(5));
    assert_eq!(
        b.ack(0, &b6, &ids(1, 5)).await.unwrap(),
        Ok(0),
        "acked twice"
    );
    assert_eq!(
        entries(b.read_new(0, &b6, 10, STRICT).await.unwrap()),
        vec![present(6, 1)]
    );
    assert_eq!(pel(&mut conn, key).await, pel_of("b", 6, 6, 1));
}

#[tokio::test]
async fn acks_mode_lets_a_stale_read_through_but_refuses_its_ack() {
    let server = RedisServer::start().unwrap();
    let mut conn = connect(&RedisTarget::standalone(server.url())).await;
    let key = "{orders:0}";
    create_group(&mut conn, key).await;
    add(&mut conn, key, 1, 3).await;
    let (a5, b6) = (token(1, 5, "a"), token(1, 6, "b"));
    let mut a = client(&conn, "orders", "a");
    let mut b = client(&conn, "orders", "b");
    assert_eq!(a.raise_fence(0, &a5).await.unwrap(), Ok(()));
    assert_eq!(b.raise_fence(0, &b6).await.unwrap(), Ok(()));

    // a's reads are not fenced in acks mode (the lease alone guards them) ...
    assert_eq!(
        entries(a.read_new(0, &a5, 10, FencingMode::Acks).await.unwrap()),
        present_range(1, 3, 1)
    );
    assert_eq!(
        entries(
            a.read_pending(0, &a5, "0", 10, FencingMode::Acks)
                .await
                .unwrap()
        ),
        present_range(1, 3, 2)
    );
    // ... but its acks and claims are.
    let higher = Fenced::Higher {
        found: Some(b6.clone()),
    };
    assert_eq!(
        a.ack(0, &a5, &ids(1, 3)).await.unwrap(),
        Err(higher.clone())
    );
    assert_eq!(a.claim_others(0, &a5, 10).await.unwrap(), Err(higher));
    assert_eq!(pel(&mut conn, key).await, pel_of("a", 1, 3, 2));
    // The owner claims them (counts unchanged), reads them again and acks.
    assert_eq!(
        b.claim_others(0, &b6, 10).await.unwrap(),
        Ok(ClaimReport {
            claimed: 3,
            trimmed: 0,
            complete: true
        })
    );
    assert_eq!(pel(&mut conn, key).await, pel_of("b", 1, 3, 2));
    assert_eq!(b.ack(0, &b6, &ids(1, 3)).await.unwrap(), Ok(3));
    assert_eq!(pel(&mut conn, key).await, vec![]);
}

#[tokio::test]
async fn own_pending_entries_come_back_in_pages_with_delivery_counts() {
    let server = RedisServer::start().unwrap();
    let mut conn = connect(&RedisTarget::standalone(server.url())).await;
    let key = "{orders:2}";
    create_group(&mut conn, key).await;
    add(&mut conn, key, 1, 5).await;
    let a5 = token(1, 5, "a");
    let mut a = client(&conn, "orders", "a");
    assert_eq!(a.raise_fence(2, &a5).await.unwrap(), Ok(()));
    assert_eq!(
        entries(a.read_new(2, &a5, 10, STRICT).await.unwrap()),
        present_range(1, 5, 1)
    );
    // Pages of 2 from "0", the cursor moving to the last id returned.
    let mut cursor = "0".to_owned();
    let mut pages = Vec::new();
    loop {
        let page = entries(a.read_pending(2, &a5, &cursor, 2, STRICT).await.unwrap());
        let Some(last) = page.last() else { break };
        cursor = last.id.clone();
        pages.push(page);
    }
    assert_eq!(
        pages,
        vec![
            present_range(1, 2, 2),
            present_range(3, 4, 2),
            present_range(5, 5, 2)
        ]
    );
    // A second re-read counts one more delivery.
    assert_eq!(
        entries(a.read_pending(2, &a5, "0", 10, STRICT).await.unwrap()),
        present_range(1, 5, 3)
    );
    assert_eq!(pel(&mut conn, key).await, pel_of("a", 1, 5, 3));
    // Acked entries leave the own PEL; the rest keep their counts.
    assert_eq!(a.ack(2, &a5, &ids(2, 3)).await.unwrap(), Ok(2));
    let rest = entries(a.read_pending(2, &a5, "0", 10, STRICT).await.unwrap());
    assert_eq!(rest, vec![present(1, 4), present(4, 4), present(5, 4)]);
    // Another consumer's pending entries are not in our own PEL.
    let mut b = client(&conn, "orders", "b");
    assert_eq!(
        entries(
            b.read_pending(2, &a5, "0", 10, FencingMode::Acks)
                .await
                .unwrap()
        ),
        vec![]
    );
}

#[tokio::test]
async fn entries_trimmed_while_pending_are_dropped_by_the_claim_or_read_without_body() {
    // Trimmed while pending: 100 entries, a reads 10 and dies, XTRIM MAXLEN 50, b takes over.
    let server = RedisServer::start().unwrap();
    let mut conn = connect(&RedisTarget::standalone(server.url())).await;
    let (a5, b6) = (token(1, 5, "a"), token(1, 6, "b"));
    let mut a = client(&conn, "orders", "a");
    let mut b = client(&conn, "orders", "b");
    for shard in [0u32, 1] {
        let key = format!("{{orders:{shard}}}");
        create_group(&mut conn, &key).await;
        add(&mut conn, &key, 1, 100).await;
        assert_eq!(a.raise_fence(shard, &a5).await.unwrap(), Ok(()));
        assert_eq!(
            entries(a.read_new(shard, &a5, 10, STRICT).await.unwrap()),
            present_range(1, 10, 1)
        );
        let trimmed: i64 = redis::cmd("XTRIM")
            .arg(&key)
            .arg("MAXLEN")
            .arg(50)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(trimmed, 50);
        // The ghosts are still in the PEL.
        assert_eq!(pel(&mut conn, &key).await, pel_of("a", 1, 10, 1));
    }

    // Shard 0, the takeover path: Redis 7.0's XCLAIM drops the ghosts and returns none of them.
    let key = "{orders:0}";
    assert_eq!(b.raise_fence(0, &b6).await.unwrap(), Ok(()));
    assert_eq!(
        b.claim_others(0, &b6, 100).await.unwrap(),
        Ok(ClaimReport {
            claimed: 0,
            trimmed: 10,
            complete: true
        })
    );
    assert_eq!(pel(&mut conn, key).await, vec![]);
    assert_eq!(
        b.claim_others(0, &b6, 100).await.unwrap(),
        Ok(ClaimReport {
            claimed: 0,
            trimmed: 0,
            complete: true
        })
    );
    assert_eq!(
        entries(b.read_pending(0, &b6, "0", 100, STRICT).await.unwrap()),
        vec![]
    );
    assert_eq!(
        entries(b.read_new(0, &b6, 100, STRICT).await.unwrap()),
        present_range(51, 100, 1)
    );

    // Shard 1, the owner's own PEL: ids come back without a body, their count not raised.
    let key = "{orders:1}";
    let ghosts = entries(a.read_pending(1, &a5, "0", 100, STRICT).await.unwrap());
    let expected: Vec<ShardEntry> = ids(1, 10)
        .into_iter()
        .map(|id| ShardEntry {
            id,
            fields: Default::default(),
            delivery_count: 1,
            status: EntryStatus::Trimmed,
        })
        .collect();
    assert_eq!(ghosts, expected);
    assert_eq!(a.ack(1, &a5, &ids(1, 10)).await.unwrap(), Ok(10));
    assert_eq!(pel(&mut conn, key).await, vec![]);
}

#[tokio::test]
async fn claims_are_bounded_per_call_and_leave_our_own_entries_alone() {
    let server = RedisServer::start().unwrap();
    let mut conn = connect(&RedisTarget::standalone(server.url())).await;
    let key = "{orders:0}";
    create_group(&mut conn, key).await;
    add(&mut conn, key, 1, 12).await;
    let mut me = client(&conn, "orders", "me");
    let mut x = client(&conn, "orders", "x");
    let mut y = client(&conn, "orders", "y");
    let (tx, ty, tme) = (token(1, 1, "x"), token(1, 2, "y"), token(1, 3, "me"));
    assert_eq!(x.raise_fence(0, &tx).await.unwrap(), Ok(()));
    assert_eq!(
        entries(x.read_new(0, &tx, 7, STRICT).await.unwrap()).len(),
        7
    );
    assert_eq!(y.raise_fence(0, &ty).await.unwrap(), Ok(()));
    assert_eq!(
        entries(y.read_new(0, &ty, 3, STRICT).await.unwrap()).len(),
        3
    );
    assert_eq!(me.raise_fence(0, &tme).await.unwrap(), Ok(()));
    assert_eq!(
        entries(me.read_new(0, &tme, 2, STRICT).await.unwrap()).len(),
        2
    );

    let mut reports = Vec::new();
    loop {
        let report = me.claim_others(0, &tme, 4).await.unwrap().unwrap();
        reports.push(report);
        if report.complete {
            break;
        }
    }
    let r = |claimed, complete| ClaimReport {
        claimed,
        trimmed: 0,
        complete,
    };
    assert_eq!(reports, vec![r(4, false), r(4, false), r(2, true)]);
    assert_eq!(pel(&mut conn, key).await, pel_of("me", 1, 12, 1));
    // Consumers are never deleted (that would drop their pending entries).
    let consumers: Vec<Vec<redis::Value>> = redis::cmd("XINFO")
        .arg("CONSUMERS")
        .arg(key)
        .arg(GROUP)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(consumers.len(), 3);
}

#[tokio::test]
async fn an_empty_read_returns_the_last_entry_id_to_wait_from() {
    let server = RedisServer::start().unwrap();
    let mut conn = connect(&RedisTarget::standalone(server.url())).await;
    let key = "{orders:0}";
    create_group(&mut conn, key).await;
    let a5 = token(1, 5, "a");
    let mut a = client(&conn, "orders", "a");
    assert_eq!(a.raise_fence(0, &a5).await.unwrap(), Ok(()));
    let empty = |id: &str| ReadOutcome::Empty {
        last_id: id.to_owned(),
    };
    assert_eq!(a.read_new(0, &a5, 10, STRICT).await.unwrap(), empty("0-0"));
    add(&mut conn, key, 1, 3).await;
    assert_eq!(
        entries(a.read_new(0, &a5, 2, STRICT).await.unwrap()),
        present_range(1, 2, 1)
    );
    assert_eq!(
        entries(a.read_new(0, &a5, 2, STRICT).await.unwrap()),
        present_range(3, 3, 1)
    );
    assert_eq!(a.read_new(0, &a5, 10, STRICT).await.unwrap(), empty("3-0"));
    assert_eq!(
        a.read_new(0, &a5, 10, FencingMode::Acks).await.unwrap(),
        empty("3-0")
    );
    let _: i64 = conn
        .xtrim(key, redis::streams::StreamMaxlen::Equals(0))
        .await
        .unwrap();
    assert_eq!(a.read_new(0, &a5, 10, STRICT).await.unwrap(), empty("0-0"));
}

#[tokio::test]
async fn a_missing_stream_or_group_is_a_typed_error() {
    let server = RedisServer::start().unwrap();
    let mut conn = connect(&RedisTarget::standalone(server.url())).await;
    let a5 = token(1, 5, "a");
    let mut a = client(&conn, "orders", "a");
    // Shard 0: no stream at all (but a fence left from before: the raise does not write one
    // next to a missing stream); shard 1: a stream without the group.
    add(&mut conn, "{orders:1}", 1, 1).await;
    assert!(a.raise_fence(0, &a5).await.unwrap_err().is_no_group());
    assert_eq!(fence_field(&mut conn, "orders", 0).await, None);
    let () = conn
        .hset("{orders:0}:fence", GROUP, a5.encode())
        .await
        .unwrap();
    assert_eq!(a.raise_fence(1, &a5).await.unwrap(), Ok(()));
    for shard in [0u32, 1] {
        let errors = [
            a.read_new(shard, &a5, 10, STRICT).await.unwrap_err(),
            a.read_new(shard, &a5, 10, FencingMode::Acks)
                .await
                .unwrap_err(),
            a.read_pending(shard, &a5, "0", 10, STRICT)
                .await
                .unwrap_err(),
            a.claim_others(shard, &a5, 10).await.unwrap_err(),
        ];
        for error in errors {
            match &error {
                DataPlaneError::NoGroup {
                    shard: s,
                    stream,
                    group,
                    detail,
                } => {
                    assert_eq!(*s, shard);
                    assert_eq!(stream, &format!("{{orders:{shard}}}"));
                    assert_eq!(group, GROUP);
                    assert!(
                        detail.starts_with("NOGROUP") || detail.starts_with("ERR no such key"),
                        "{detail}"
                    );
                }
                other => panic!("expected NoGroup, got {other:?}"),
            }
            assert!(error.is_no_group());
            assert!(error.to_string().contains("back off"), "{error}");
        }
        // Nothing is pending without a group: an ack changes nothing.
        assert_eq!(a.ack(shard, &a5, &ids(1, 1)).await.unwrap(), Ok(0));
    }
    // Redis restarted empty: the fence is gone first, so a read says LOWER.
    let () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
    assert_eq!(
        a.read_new(0, &a5, 10, STRICT).await.unwrap(),
        ReadOutcome::Fenced(Fenced::Lower)
    );
}

#[tokio::test]
async fn dead_letters_carry_exactly_the_fixed_fields_then_the_original_ones() {
    let server = RedisServer::start().unwrap();
    let mut conn = connect(&RedisTarget::standalone(server.url())).await;
    let key = "{orders:3}";
    create_group(&mut conn, key).await;
    add(&mut conn, key, 7, 7).await;
    let a5 = token(1, 5, "a");
    let mut a = client(&conn, "orders", "a");
    assert_eq!(a.dead_letter_key(), "orders:dlq:g");
    assert_eq!(a.raise_fence(3, &a5).await.unwrap(), Ok(()));
    let entry = entries(a.read_new(3, &a5, 1, STRICT).await.unwrap()).remove(0);
    let first = a
        .dead_letter(3, &entry, DeadLetterReason::Decode, "expected `}`", 1)
        .await
        .unwrap();
    let ghost = ShardEntry {
        id: "5-0".into(),
        fields: Default::default(),
        delivery_count: 1,
        status: EntryStatus::Trimmed,
    };
    let second = a
        .dead_letter(3, &ghost, DeadLetterReason::MaxDeliveries, "", 11)
        .await
        .unwrap();
    let rows: Vec<(String, Vec<Vec<u8>>)> = redis::cmd("XRANGE")
        .arg("orders:dlq:g")
        .arg("-")
        .arg("+")
        .query_async(&mut conn)
        .await
        .unwrap();
    let text = |fields: &[Vec<u8>]| -> Vec<String> {
        fields
            .iter()
            .map(|f| String::from_utf8(f.clone()).unwrap())
            .collect()
    };
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0].0, first);
    assert_eq!(
        text(&rows[0].1),
        [
            "sourceStream",
            "{orders:3}",
            "sourceId",
            "7-0",
            "shard",
            "3",
            "group",
            "g",
            "reason",
            "decode",
            "error",
            "expected `}`",
            "attempts",
            "1",
            "key",
            "k7",
            "payload",
            "p7"
        ]
    );
    assert_eq!(rows[1].0, second);
    assert_eq!(
        text(&rows[1].1),
        [
            "sourceStream",
            "{orders:3}",
            "sourceId",
            "5-0",
            "shard",
            "3",
            "group",
            "g",
            "reason",
            "max-deliveries",
            "error",
            "",
            "attempts",
            "11"
        ]
    );
    let reasons: Vec<&str> = [
        DeadLetterReason::Handler,
        DeadLetterReason::NonRetryable,
        DeadLetterReason::Decode,
        DeadLetterReason::MaxDeliveries,
        DeadLetterReason::TooLarge,
    ]
    .iter()
    .map(|r| r.as_str())
    .collect();
    assert_eq!(
        reasons,
        [
            "handler",
            "non-retryable",
            "decode",
            "max-deliveries",
            "too-large"
        ]
    );
}

#[tokio::test]
async fn bodies_over_the_limit_are_withheld_and_reported_with_their_size() {
    let server = RedisServer::start().unwrap();
    let mut conn = connect(&RedisTarget::standalone(server.url())).await;
    let key = "{orders:1}";
    create_group(&mut conn, key).await;
    add(&mut conn, key, 1, 1).await;
    let big = vec![b'x'; 1000];
    let _: String = conn
        .xadd(key, "2-0", &[("key", b"k2".as_slice()), ("payload", &big)])
        .await
        .unwrap();
    add(&mut conn, key, 3, 3).await;
    let a5 = token(1, 5, "a");
    let mut a = client(&conn, "orders", "a").with_max_entry_bytes(Some(100));
    assert_eq!(a.raise_fence(1, &a5).await.unwrap(), Ok(()));
    let too_large = |count| ShardEntry {
        id: "2-0".into(),
        fields: Default::default(),
        delivery_count: count,
        status: EntryStatus::TooLarge {
            bytes: 3 + 2 + 7 + 1000,
        },
    };
    assert_eq!(
        entries(a.read_new(1, &a5, 10, STRICT).await.unwrap()),
        vec![present(1, 1), too_large(1), present(3, 1)]
    );
    assert_eq!(
        entries(a.read_pending(1, &a5, "1-0", 1, STRICT).await.unwrap()),
        vec![too_large(2)]
    );
    // Without a limit the body comes back whole.
    let mut unlimited = client(&conn, "orders", "a");
    let whole = entries(
        unlimited
            .read_pending(1, &a5, "1-0", 1, STRICT)
            .await
            .unwrap(),
    );
    assert_eq!(whole[0].field("payload"), Some(big.as_slice()));
    assert_eq!(whole[0].status, EntryStatus::Present);
    // Acks mode reads with a plain XREADGROUP and applies the same limit after the read; once
    // nothing is new, the script answers with the last id to wait from.
    let () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(key)
        .arg("g2")
        .arg("0")
        .query_async(&mut conn)
        .await
        .unwrap();
    let mut plain = ShardClient::new(conn.clone(), StreamKeys::new("orders").unwrap(), "g2", "b")
        .unwrap()
        .with_max_entry_bytes(Some(100));
    let acks = FencingMode::Acks;
    assert_eq!(
        entries(plain.read_new(1, &a5, 10, acks).await.unwrap()),
        vec![present(1, 1), too_large(1), present(3, 1)]
    );
    assert_eq!(
        plain.read_new(1, &a5, 10, acks).await.unwrap(),
        ReadOutcome::Empty {
            last_id: "3-0".into()
        }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_wakes_on_a_new_entry_and_times_out_empty() {
    let server = RedisServer::start().unwrap();
    let target = RedisTarget::standalone(server.url());
    let mut conn = connect(&target).await;
    for shard in 0..3 {
        create_group(&mut conn, &format!("{{orders:{shard}}}")).await;
    }
    add(&mut conn, "{orders:0}", 1, 4).await;
    let shards: Vec<(String, String)> = vec![
        ("{orders:0}".into(), "4-0".into()),
        ("{orders:1}".into(), "0-0".into()),
        ("{orders:2}".into(), "0-0".into()),
    ];
    let mut waiter = Waiter::connect(&target, Duration::from_secs(3))
        .await
        .unwrap();
    assert_eq!(waiter.max_block(), Duration::from_secs(3));
    assert_eq!(
        Waiter::response_timeout_for(Duration::from_secs(3)),
        Duration::from_secs(7)
    );

    // An XADD during the block wakes it with that shard.
    let writer = {
        let mut conn = conn.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            add(&mut conn, "{orders:1}", 1, 1).await;
        })
    };
    let started = Instant::now();
    let woken = waiter.wait(&shards, Duration::from_secs(3)).await.unwrap();
    let took = started.elapsed();
    writer.await.unwrap();
    assert_eq!(woken, vec!["{orders:1}".to_owned()]);
    assert!(
        took >= Duration::from_millis(250) && took < Duration::from_secs(2),
        "{took:?}"
    );

    // An entry added before the wait, after the last id seen: no lost wake-up.
    let woken = waiter.wait(&shards, Duration::from_secs(3)).await.unwrap();
    assert_eq!(woken, vec!["{orders:1}".to_owned()]);

    // Idle for 2 s: an empty reply, not an error, on a connection whose default would time out.
    let idle = vec![
        ("{orders:0}".to_owned(), "4-0".to_owned()),
        ("{orders:1}".to_owned(), "1-0".to_owned()),
    ];
    let started = Instant::now();
    assert_eq!(
        waiter.wait(&idle, Duration::from_secs(2)).await.unwrap(),
        Vec::<String>::new()
    );
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(1900) && took < Duration::from_secs(3),
        "{took:?}"
    );
    // The same XREAD on a shared connection with a 1 s response timeout fails (below the block).
    let mut short = RedisConnection::connect(&target, Duration::from_secs(1))
        .await
        .unwrap();
    let error = redis::cmd("XREAD")
        .arg("BLOCK")
        .arg(2000)
        .arg("STREAMS")
        .arg("{orders:0}")
        .arg("4-0")
        .query_async::<redis::Value>(&mut short)
        .await
        .unwrap_err();
    assert!(error.is_timeout(), "{error:?}");

    // A block above the waiter's maximum is clamped to it; no shards: an empty list at once.
    let mut quick = Waiter::connect(&target, Duration::from_millis(500))
        .await
        .unwrap();
    let started = Instant::now();
    assert_eq!(
        quick.wait(&idle, Duration::from_secs(30)).await.unwrap(),
        Vec::<String>::new()
    );
    assert!(started.elapsed() < Duration::from_millis(1500));
    let started = Instant::now();
    assert_eq!(
        quick.wait(&[], Duration::from_secs(30)).await.unwrap(),
        Vec::<String>::new()
    );
    assert!(started.elapsed() < Duration::from_millis(100));
}

/// The prefix's first `n` shards whose keys are in pairwise different slots.
fn shards_in_different_slots(prefix: &str, n: usize) -> Vec<u32> {
    let keys = StreamKeys::new(prefix).unwrap();
    let mut chosen: Vec<u32> = Vec::new();
    for shard in 0.. {
        let slot = key_slot(&keys.shard(shard));
        if chosen.iter().all(|&c| key_slot(&keys.shard(c)) != slot) {
            chosen.push(shard);
        }
        if chosen.len() == n {
            break;
        }
    }
    chosen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_operation_works_on_a_cluster_across_slots() {
    let cluster = RedisCluster::start().unwrap();
    let target = RedisTarget::cluster(cluster.urls());
    let mut conn = connect(&target).await;
    let keys = StreamKeys::new("orders").unwrap();
    let shards = shards_in_different_slots("orders", 3);
    let (a5, b6) = (token(1, 5, "a"), token(1, 6, "b"));
    let mut a = client(&conn, "orders", "a");
    let mut b = client(&conn, "orders", "b");
    for &shard in &shards {
        let key = keys.shard(shard);
        create_group(&mut conn, &key).await;
        add(&mut conn, &key, 1, 5).await;
        assert_eq!(a.raise_fence(shard, &a5).await.unwrap(), Ok(()));
        assert_eq!(
            entries(a.read_new(shard, &a5, 3, STRICT).await.unwrap()),
            present_range(1, 3, 1)
        );
        assert_eq!(b.raise_fence(shard, &b6).await.unwrap(), Ok(()));
        let higher = Fenced::Higher {
            found: Some(b6.clone()),
        };
        assert_eq!(
            a.read_new(shard, &a5, 3, STRICT).await.unwrap(),
            ReadOutcome::Fenced(higher.clone())
        );
        assert_eq!(a.ack(shard, &a5, &ids(1, 3)).await.unwrap(), Err(higher));
        assert_eq!(
            b.claim_others(shard, &b6, 10).await.unwrap(),
            Ok(ClaimReport {
                claimed: 3,
                trimmed: 0,
                complete: true
            })
        );
        assert_eq!(
            entries(b.read_pending(shard, &b6, "0", 10, STRICT).await.unwrap()),
            present_range(1, 3, 2)
        );
        assert_eq!(
            entries(b.read_new(shard, &b6, 10, STRICT).await.unwrap()),
            present_range(4, 5, 1)
        );
        assert_eq!(
            b.read_new(shard, &b6, 10, STRICT).await.unwrap(),
            ReadOutcome::Empty {
                last_id: "5-0".into()
            }
        );
        let entry = present(2, 2);
        let id = b
            .dead_letter(shard, &entry, DeadLetterReason::Handler, "boom", 3)
            .await
            .unwrap();
        assert!(!id.is_empty());
        // Handler attempts on a re-delivered entry (docs/design.md §8.9): counted in the shard's
        // slot, fenced like an ack, forgotten on request.
        assert_eq!(b.count_attempt(shard, &b6, "2-0").await.unwrap(), Ok(1));
        assert_eq!(b.count_attempt(shard, &b6, "2-0").await.unwrap(), Ok(2));
        assert_eq!(
            a.count_attempt(shard, &a5, "2-0").await.unwrap(),
            Err(Fenced::Higher {
                found: Some(b6.clone())
            })
        );
        let attempts: Vec<(String, u64)> = conn.hgetall(keys.attempts(shard)).await.unwrap();
        assert_eq!(attempts, vec![("g|2-0".to_owned(), 2)]);
        b.forget_attempts(shard, &["2-0"]).await.unwrap();
        let left: u64 = conn.exists(keys.attempts(shard)).await.unwrap();
        assert_eq!(left, 0);
        b.forget_attempts(shard, &[]).await.unwrap();
        assert_eq!(b.ack(shard, &b6, &ids(1, 5)).await.unwrap(), Ok(5));
        assert_eq!(pel(&mut conn, &key).await, vec![]);
    }
    let dead: u64 = conn.xlen("orders:dlq:g").await.unwrap();
    assert_eq!(dead, 3);
    // A shard without a stream on the cluster: the same typed error, and no fence written.
    let missing = shards_in_different_slots("orders", 4)[3];
    assert!(b.raise_fence(missing, &b6).await.unwrap_err().is_no_group());
    let fences: u64 = conn.exists(keys.fence(missing)).await.unwrap();
    assert_eq!(fences, 0);
    let () = conn
        .hset(keys.fence(missing), "g", b6.encode())
        .await
        .unwrap();
    assert!(
        b.count_attempt(missing, &b6, "1-0")
            .await
            .unwrap_err()
            .is_no_group()
    );
    let attempts: u64 = conn.exists(keys.attempts(missing)).await.unwrap();
    assert_eq!(attempts, 0, "an attempt count next to a missing stream");
    assert!(
        b.read_new(missing, &b6, 1, STRICT)
            .await
            .unwrap_err()
            .is_no_group()
    );

    // Waiting: one waiter per slot; a call mixing slots is refused before anything is sent.
    let mut waiter = Waiter::connect(&target, Duration::from_secs(3))
        .await
        .unwrap();
    let mixed: Vec<(String, String)> = shards
        .iter()
        .map(|&s| (keys.shard(s), "5-0".to_owned()))
        .collect();
    assert!(matches!(
        waiter.wait(&mixed, Duration::from_secs(1)).await,
        Err(DataPlaneError::CrossSlot { .. })
    ));
    let one = vec![mixed[1].clone()];
    let started = Instant::now();
    assert_eq!(
        waiter.wait(&one, Duration::from_secs(2)).await.unwrap(),
        Vec::<String>::new()
    );
    assert!(started.elapsed() >= Duration::from_millis(1900));
    let writer = {
        let mut conn = conn.clone();
        let key = mixed[1].0.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            add(&mut conn, &key, 6, 6).await;
        })
    };
    assert_eq!(
        waiter.wait(&one, Duration::from_secs(3)).await.unwrap(),
        vec![mixed[1].0.clone()]
    );
    writer.await.unwrap();
}

/// A restarted or failed-over server has no scripts loaded: every fenced operation loads its
/// script on `NOSCRIPT` and runs it again, with the same result.
#[tokio::test]
async fn operations_reload_their_scripts_after_a_script_flush() {
    let server = RedisServer::start().unwrap();
    let mut conn = connect(&RedisTarget::standalone(server.url())).await;
    let key = "{orders:0}";
    create_group(&mut conn, key).await;
    add(&mut conn, key, 1, 2).await;
    let a5 = token(1, 5, "a");
    let mut a = client(&conn, "orders", "a");
    let flush = |mut conn: RedisConnection| async move {
        let () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(&mut conn)
            .await
            .unwrap();
    };
    flush(conn.clone()).await;
    assert_eq!(a.raise_fence(0, &a5).await.unwrap(), Ok(()));
    flush(conn.clone()).await;
    assert_eq!(
        entries(a.read_new(0, &a5, 10, STRICT).await.unwrap()),
        vec![present(1, 1), present(2, 1)]
    );
    flush(conn.clone()).await;
    assert_eq!(
        a.ack(0, &a5, &["1-0".into(), "2-0".into()]).await.unwrap(),
        Ok(2)
    );
    assert!(pel(&mut conn, key).await.is_empty());
}

/// The ack of one batch and the read of the next in one round trip: both results, in both
/// fencing modes, after a script flush, and when the fence has moved on.
#[tokio::test]
async fn ack_and_read_new_acks_then_reads_in_one_round_trip() {
    let server = RedisServer::start().unwrap();
    let mut conn = connect(&RedisTarget::standalone(server.url())).await;
    let key = "{orders:0}";
    create_group(&mut conn, key).await;
    add(&mut conn, key, 1, 6).await;
    let a5 = token(1, 5, "a");
    let mut a = client(&conn, "orders", "a");
    assert_eq!(a.raise_fence(0, &a5).await.unwrap(), Ok(()));
    let ids = |entries: &[ShardEntry]| entries.iter().map(|e| e.id.clone()).collect::<Vec<_>>();

    let first = entries(a.read_new(0, &a5, 2, STRICT).await.unwrap());
    assert_eq!(first, vec![present(1, 1), present(2, 1)]);
    let (acked, read) = a
        .ack_and_read_new(0, &a5, &ids(&first), 2, STRICT)
        .await
        .unwrap();
    assert_eq!(acked, 2);
    let second = entries(read);
    assert_eq!(second, vec![present(3, 1), present(4, 1)]);
    // Scripts gone (a restarted server): both are loaded and run again.
    let () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut conn)
        .await
        .unwrap();
    let (acked, read) = a
        .ack_and_read_new(0, &a5, &ids(&second), 2, FencingMode::Acks)
        .await
        .unwrap();
    assert_eq!(acked, 2);
    let third = entries(read);
    assert_eq!(third, vec![present(5, 1), present(6, 1)]);
    assert_eq!(
        pel(&mut conn, key).await.len(),
        2,
        "only the last batch is pending"
    );

    // Another member's higher token: the strict read is refused (the transaction reads
    // nothing), an acks-mode read is not (reads rely on the lease there). The ack is plain in
    // both: it names entries `a` handled, so acking them late loses nothing (design §8.2).
    add(&mut conn, key, 7, 8).await;
    let b6 = token(1, 6, "b");
    let mut b = client(&conn, "orders", "b");
    assert_eq!(b.raise_fence(0, &b6).await.unwrap(), Ok(()));
    let (acked, read) = a
        .ack_and_read_new(0, &a5, &ids(&third), 1, STRICT)
        .await
        .unwrap();
    assert_eq!(acked, 2, "a late ack of handled entries goes through");
    assert!(matches!(read, ReadOutcome::Fenced(Fenced::Higher { .. })));
    assert!(pel(&mut conn, key).await.is_empty(), "nothing read");
    let (acked, read) = a
        .ack_and_read_new(0, &a5, &ids(&third), 1, FencingMode::Acks)
        .await
        .unwrap();
    assert_eq!(acked, 0, "acked before");
    assert_eq!(entries(read), vec![present(7, 1)]);
    assert_eq!(pel(&mut conn, key).await.len(), 1);

    // Nothing new: the read ends with the last id to wait from, after the ack.
    let (acked, read) = b
        .ack_and_read_new(0, &b6, &["5-0".into()], 5, STRICT)
        .await
        .unwrap();
    assert_eq!(acked, 0);
    assert_eq!(entries(read), vec![present(8, 1)]);
    let (acked, read) = b
        .ack_and_read_new(0, &b6, &["8-0".into()], 5, STRICT)
        .await
        .unwrap();
    assert_eq!(acked, 1);
    assert_eq!(
        read,
        ReadOutcome::Empty {
            last_id: "8-0".into()
        }
    );
}

/// The handler-attempt count (docs/design.md §8.9) survives garbage: a field that is not a decimal
/// count, or a key of another type, is dropped and counted again from 1 (never an error that
/// would stop the shard); a refused token writes nothing.
#[tokio::test]
async fn a_corrupt_attempt_count_is_dropped_and_counted_again() {
    let server = RedisServer::start().unwrap();
    let target = RedisTarget::standalone(server.url());
    let mut conn = connect(&target).await;
    let keys = StreamKeys::new("orders").unwrap();
    create_group(&mut conn, &keys.shard(0)).await;
    let a5 = token(1, 5, "a");
    let mut a = client(&conn, "orders", "a");
    assert_eq!(a.raise_fence(0, &a5).await.unwrap(), Ok(()));
    let attempts = keys.attempts(0);
    assert_eq!(a.count_attempt(0, &a5, "1-0").await.unwrap(), Ok(1));
    assert_eq!(a.count_attempt(0, &a5, "1-0").await.unwrap(), Ok(2));
    for garbage in ["abc", "-3", "1.5", "", "99999999999999999999", " 7"] {
        let () = conn.hset(&attempts, "g|1-0", garbage).await.unwrap();
        assert_eq!(
            a.count_attempt(0, &a5, "1-0").await.unwrap(),
            Ok(1),
            "{garbage:?}"
        );
    }
    let () = conn.del(&attempts).await.unwrap();
    let () = conn.set(&attempts, "not a hash").await.unwrap();
    assert_eq!(a.count_attempt(0, &a5, "1-0").await.unwrap(), Ok(1));
    let stored: Vec<(String, u64)> = conn.hgetall(&attempts).await.unwrap();
    assert_eq!(stored, vec![("g|1-0".to_owned(), 1)]);
    // Another member's stale token: refused, nothing counted.
    let stale = token(1, 4, "b");
    assert_eq!(
        a.count_attempt(0, &stale, "1-0").await.unwrap(),
        Err(Fenced::Higher {
            found: Some(a5.clone())
        })
    );
    let stored: Vec<(String, u64)> = conn.hgetall(&attempts).await.unwrap();
    assert_eq!(stored, vec![("g|1-0".to_owned(), 1)]);
}

/// A key overwritten with another Redis type (a string where the shard stream or its fence
/// was): the error says so and that retrying cannot help, not "check that Redis is up" (found by
/// a hostile test: the shard stalled behind that advice).
#[tokio::test]
async fn a_key_of_another_type_is_an_error_that_says_so() {
    let server = RedisServer::start().unwrap();
    let mut conn = connect(&RedisTarget::standalone(server.url())).await;
    let a5 = token(1, 5, "a");
    let mut a = client(&conn, "orders", "a");
    create_group(&mut conn, "{orders:0}").await;
    create_group(&mut conn, "{orders:1}").await;
    assert_eq!(a.raise_fence(0, &a5).await.unwrap(), Ok(()));
    let _: i64 = conn.del("{orders:0}").await.unwrap();
    let () = conn.set("{orders:0}", "junk").await.unwrap();
    let () = conn.set("{orders:1}:fence", "junk").await.unwrap();
    let errors = [
        a.read_new(0, &a5, 10, STRICT).await.unwrap_err(),
        a.read_pending(0, &a5, "0", 10, STRICT).await.unwrap_err(),
        a.raise_fence(1, &a5).await.unwrap_err(),
    ];
    for error in errors {
        let text = error.to_string();
        assert!(matches!(error, DataPlaneError::Redis { .. }), "{error:?}");
        assert!(text.contains("holds another Redis type"), "{text}");
        assert!(!text.contains("check that Redis is up"), "{text}");
    }
}
