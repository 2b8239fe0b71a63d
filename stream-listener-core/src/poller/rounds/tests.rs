//! The round rules against a real standalone server.

use std::time::Duration;

use redis::Value;

use super::*;
use crate::connection::RedisTarget;
use crate::dataplane::GroupRecreated;
use crate::dataplane::round::PartRead;
use crate::testing::RedisServer;
use crate::testing::fixtures::pause_writes;

/// The consumer group of every shard.
pub(super) const GROUP: &str = "g";
/// The member whose rounds the tests send.
pub(super) const CONSUMER: &str = "m-m0";

/// [`CONSUMER`]'s token.
pub(super) fn token() -> FenceToken {
    FenceToken {
        incarnation: 1,
        member_epoch: 1,
        member_id: CONSUMER.into(),
        process_id: "p".into(),
    }
}

/// The stream of shard `shard` of the stream `s`.
pub(super) fn key(shard: ShardIndex) -> String {
    format!("{{s:{shard}}}")
}

/// A server with shards 0..`shards`, each with group `g` and `entries` entries.
pub(super) async fn setup(shards: u32, entries: usize) -> (RedisServer, RedisConnection) {
    let server = RedisServer::start().unwrap();
    let target = RedisTarget::standalone(server.url());
    let mut conn = RedisConnection::connect(&target, Duration::from_secs(5))
        .await
        .unwrap();
    let mut client = shard_client(&conn);
    for shard in 0..shards {
        let created = client.recreate_group(shard, true).await.unwrap();
        assert_eq!(
            created,
            GroupRecreated::Created {
                stream_created: true
            }
        );
        append(&mut conn, shard, entries).await;
    }
    (server, conn)
}

/// Appends `n` entries (field `n`: 0, 1, …) to shard `shard`.
pub(super) async fn append(conn: &mut RedisConnection, shard: ShardIndex, n: usize) {
    for i in 0..n {
        let _: String = redis::cmd("XADD")
            .arg(key(shard))
            .arg("*")
            .arg("n")
            .arg(i)
            .query_async(conn)
            .await
            .unwrap();
    }
}

/// [`setup`], and the member's read rounds on it, `count` entries per shard per round.
async fn setup_rounds(
    shards: u32,
    entries: usize,
    count: usize,
) -> (RedisServer, RedisConnection, Arc<ReadRounds>) {
    let (server, conn) = setup(shards, entries).await;
    let rounds = rounds_of(count);
    (server, conn, rounds)
}

/// The member's read rounds, `count` entries per shard per round (sent on the connection each
/// `submit` names).
pub(super) fn rounds_of(count: usize) -> Arc<ReadRounds> {
    ReadRounds::new(GROUP.into(), CONSUMER.into(), count, None)
}

/// The member's client for the shards `{s:<i>}` (to raise fences and build round parts).
pub(super) fn shard_client(conn: &RedisConnection) -> crate::dataplane::ShardClient {
    let keys = crate::keys::StreamKeys::new("s").unwrap();
    crate::dataplane::ShardClient::new(conn.clone(), keys, GROUP, CONSUMER).unwrap()
}

/// The member's client with the fences of shards 0..`shards` raised with [`token`].
pub(super) async fn fenced_client(
    conn: &mut RedisConnection,
    shards: u32,
) -> crate::dataplane::ShardClient {
    let mut client = shard_client(conn);
    for shard in 0..shards {
        assert_eq!(client.raise_fence(shard, &token()).await.unwrap(), Ok(()));
    }
    client
}

fn request(shard: ShardIndex) -> Request {
    Request {
        shard,
        token: token(),
        part: RoundPart {
            key: key(shard),
            ack: Vec::new(),
            fence: None,
        },
    }
}

fn always(_: ShardIndex, _: &FenceToken) -> bool {
    true
}

/// How many entries a round's reply holds for its shard.
fn entries(result: &RoundResult) -> usize {
    let RoundResult::Done(reply, _) = result else {
        panic!("round not done");
    };
    match &reply.read {
        PartRead::Entries(Value::Array(streams)) => match &streams[0] {
            Value::Array(pair) => match &pair[1] {
                Value::Array(list) => list.len(),
                other => panic!("{other:?}"),
            },
            other => panic!("{other:?}"),
        },
        PartRead::Entries(Value::Nil) => 0,
        other => panic!("{other:?}"),
    }
}

fn turn(result: RoundResult) -> Option<Turn> {
    match result {
        RoundResult::Done(_, turn) => turn,
        _ => panic!("round not done"),
    }
}

/// Submits `request` from a task of its own (a sibling shard task), always held.
fn spawn_submit(
    rounds: &Arc<ReadRounds>,
    conn: &RedisConnection,
    request: Request,
) -> tokio::task::JoinHandle<RoundResult> {
    let (rounds, conn) = (rounds.clone(), conn.clone());
    tokio::spawn(async move { rounds.submit(&conn, request, None, &always).await })
}

/// `waiting`'s request is queued and stays unsent, however long it waits.
async fn assert_held_up(rounds: &ReadRounds, waiting: &tokio::task::JoinHandle<RoundResult>) {
    wait_queued(rounds, 1).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished());
}

/// Waits until `n` requests are queued (spawned tasks have reached the queue); fails after
/// 10 s (a request that was sent at once instead).
async fn wait_queued(rounds: &ReadRounds, n: usize) {
    wait_for("requests to queue", || rounds.lock().queued.len() >= n).await;
}

async fn wait_for(what: &str, done: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "waited 10 s for {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The ids of every entry of `shard`, in order.
pub(super) async fn entry_ids(conn: &mut RedisConnection, shard: ShardIndex) -> Vec<String> {
    redis::cmd("XRANGE")
        .arg(key(shard))
        .arg("-")
        .arg("+")
        .query_async::<Vec<(String, Vec<(String, String)>)>>(conn)
        .await
        .unwrap()
        .into_iter()
        .map(|(id, _)| id)
        .collect()
}

/// How many entries of `shard` are pending in the group.
pub(super) async fn pending(conn: &mut RedisConnection, shard: ShardIndex) -> i64 {
    let summary: Vec<Value> = redis::cmd("XPENDING")
        .arg(key(shard))
        .arg(GROUP)
        .query_async(conn)
        .await
        .unwrap();
    match &summary[0] {
        Value::Int(n) => *n,
        other => panic!("{other:?}"),
    }
}

async fn xreadgroup_calls(conn: &mut RedisConnection) -> u64 {
    crate::testing::fixtures::command_calls(conn, "xreadgroup").await
}

/// A shard that got entries holds the next round up until it asks again (then both shards
/// share one `XREADGROUP`) or drops its turn.
#[tokio::test]
async fn a_round_waits_for_the_shards_that_got_entries() {
    let (_server, mut conn, rounds) = setup_rounds(3, 5, 2).await;
    let first = rounds.submit(&conn, request(0), None, &always).await;
    assert_eq!(entries(&first), 2);
    let turn0 = turn(first).expect("shard 0 got entries: it has a turn");

    let before = xreadgroup_calls(&mut conn).await;
    let waiting = spawn_submit(&rounds, &conn, request(1));
    // Shard 0 holds the round: shard 1's request is not sent, however long it waits.
    assert_held_up(&rounds, &waiting).await;
    assert_eq!(xreadgroup_calls(&mut conn).await, before);

    // Shard 0 asks again: one round, one XREADGROUP, for both.
    let again = rounds.submit(&conn, request(0), Some(turn0), &always).await;
    let other = waiting.await.unwrap();
    assert_eq!((entries(&again), entries(&other)), (2, 2));
    assert_eq!(xreadgroup_calls(&mut conn).await, before + 1);

    // Shard 1 drops its turn without asking: shard 0 alone still has one; then shard 2's
    // request waits for shard 0 only.
    drop(turn(other));
    let turn0 = turn(again).unwrap();
    let waiting = spawn_submit(&rounds, &conn, request(2));
    assert_held_up(&rounds, &waiting).await;
    drop(turn0);
    let third = waiting.await.unwrap();
    assert_eq!(entries(&third), 2);
}

/// A shard with nothing new gets no turn: it does not hold the next round up.
#[tokio::test]
async fn a_shard_with_nothing_new_holds_nothing_up() {
    let (_server, conn, rounds) = setup_rounds(2, 0, 2).await;
    let empty = rounds.submit(&conn, request(0), None, &always).await;
    assert_eq!(entries(&empty), 0);
    assert!(turn(empty).is_none());
    let next = rounds.submit(&conn, request(1), None, &always).await;
    assert_eq!(entries(&next), 0);
}

/// A request whose shard the member no longer holds is not sent: nothing is read for it.
#[tokio::test]
async fn a_request_the_member_no_longer_holds_is_not_sent() {
    let (_server, mut conn, rounds) = setup_rounds(2, 3, 10).await;
    let only_shard_1 = |shard: ShardIndex, _: &FenceToken| shard == 1;
    let refused = rounds.submit(&conn, request(0), None, &only_shard_1).await;
    assert!(matches!(refused, RoundResult::NotSent));
    assert_eq!(
        pending(&mut conn, 0).await,
        0,
        "nothing was read for shard 0"
    );
    let sent = rounds.submit(&conn, request(1), None, &only_shard_1).await;
    assert_eq!(entries(&sent), 3);
}

/// A task cancelled while sending a round (its member stopped) does not stall the member:
/// the next queued request is sent.
#[tokio::test]
async fn a_cancelled_leader_lets_the_next_round_go() {
    let (_server, mut conn, rounds) = setup_rounds(2, 3, 10).await;
    // Writes (XREADGROUP is one) wait while clients are paused: the leader's round hangs.
    pause_writes(&mut conn, 1500).await;
    let leader = spawn_submit(&rounds, &conn, request(0));
    wait_for("the round to start", || rounds.lock().in_flight).await;
    let queued = spawn_submit(&rounds, &conn, request(1));
    wait_queued(&rounds, 1).await;
    assert!(!leader.is_finished() && !queued.is_finished());
    leader.abort();
    let next = tokio::time::timeout(Duration::from_secs(10), queued)
        .await
        .expect("the queued request is sent once the leader is gone")
        .unwrap();
    assert_eq!(entries(&next), 3);
}

/// One shard's missing group fails the multi-stream read for every shard of the round: each
/// is told to read on its own. The round's plain acks still ran, whatever the token: an ack
/// names entries this member handled, so it is never refused (docs/design.md §8.2).
#[tokio::test]
async fn a_failed_read_is_reported_to_every_shard_and_the_acks_still_run() {
    let (_server, mut conn) = setup(2, 2).await;
    let mut client = fenced_client(&mut conn, 2).await;
    let rounds = rounds_of(10);
    let first = rounds.submit(&conn, request(0), None, &always).await;
    assert_eq!(entries(&first), 2);
    let turn0 = turn(first);
    let ids = entry_ids(&mut conn, 0).await;
    let mut one = request(1);
    one.part.ack = vec!["1-0".to_owned()];
    let mut zero = request(0);
    zero.part.ack = ids;
    // Shard 1 loses its consumer group (the stream stays).
    client.undo_recreate_group(1, false).await.unwrap();
    // Shard 1 waits for shard 0, which asks with its ack: one round for both.
    let one = spawn_submit(&rounds, &conn, one);
    wait_queued(&rounds, 1).await;
    let zero = rounds.submit(&conn, zero, turn0, &always).await;
    let mut acks = Vec::new();
    for result in [zero, one.await.unwrap()] {
        let RoundResult::Done(reply, turn) = result else {
            panic!("round not done");
        };
        assert!(
            matches!(reply.read, PartRead::ReadAlone),
            "read on your own"
        );
        assert!(turn.is_none());
        acks.push(reply.ack.expect("an ack reply"));
    }
    assert_eq!(acks[0].as_ref().unwrap(), &Value::Int(2));
    assert!(
        acks[1].as_ref().is_ok(),
        "an ack on a shard without its group is not an error: nothing was pending"
    );
    assert_eq!(pending(&mut conn, 0).await, 0, "shard 0's entries acked");
}

/// A round reads at most [`MAX_ROUND_ENTRIES`] entries: with `count` at half of it, two shards
/// per round, the first two queued; the third is first in line for the next round.
#[test]
fn a_round_takes_at_most_its_entry_budget_in_arrival_order() {
    let rounds = rounds_of(MAX_ROUND_ENTRIES / 2);
    assert_eq!(rounds.max_parts(), 2);
    assert_eq!(
        rounds_of(MAX_ROUND_ENTRIES * 2).max_parts(),
        1,
        "one shard at least"
    );
    let mut state = State::default();
    let mut replies = Vec::new();
    for shard in [4, 1, 7] {
        let (reply, waiting) = oneshot::channel();
        replies.push(waiting);
        state.queued.push(Queued {
            request: request(shard),
            reply,
        });
    }
    let round: Vec<ShardIndex> = state
        .start(rounds.max_parts())
        .unwrap()
        .iter()
        .map(|q| q.request.shard)
        .collect();
    assert_eq!(round, vec![4, 1]);
    assert!(state.in_flight);
    let left: Vec<ShardIndex> = state.queued.iter().map(|q| q.request.shard).collect();
    assert_eq!(left, vec![7]);
}
