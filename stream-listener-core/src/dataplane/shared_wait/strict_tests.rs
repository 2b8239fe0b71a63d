//! The strict wait (docs/design.md §8.4, §8.16) against a real standalone server: a member's
//! blocking `XREADGROUP` over its shards and their read gates reads what it waits for, and a
//! raise of a shard's fence by its next owner ends a blocked wait without a read, and refuses a
//! late one.

use std::sync::Arc;
use std::time::Duration;

use super::{GroupRead, Settled, SharedWait, WaitEnd, WakeSource};
use crate::connection::{RedisConnection, RedisTarget};
use crate::dataplane::{FencingMode, ReadOutcome, ShardClient};
use crate::fence::FenceToken;
use crate::keys::StreamKeys;
use crate::testing::RedisServer;
use crate::testing::fixtures::command_calls;

const GROUP: &str = "g";
const LONG: Duration = Duration::from_secs(30);
/// Far below [`LONG`], far above a round trip.
const PROMPT: Duration = Duration::from_secs(5);

fn key(shard: u32) -> String {
    format!("{{s:{shard}}}")
}

fn token_of(member: &str, epoch: i64) -> FenceToken {
    FenceToken {
        incarnation: 1,
        member_epoch: epoch,
        member_id: member.into(),
        process_id: "p".into(),
    }
}

fn client_of(conn: &RedisConnection, member: &str) -> ShardClient {
    ShardClient::new(conn.clone(), StreamKeys::new("s").unwrap(), GROUP, member).unwrap()
}

/// A server with shards `{s:0}`..`{s:<shards>}` and group `g` on each, and a connection.
async fn setup(shards: u32) -> (RedisServer, RedisTarget, RedisConnection) {
    let server = RedisServer::start().unwrap();
    let target = RedisTarget::standalone(server.url());
    let conn = RedisConnection::connect(&target, PROMPT).await.unwrap();
    let mut client = client_of(&conn, "setup");
    for shard in 0..shards {
        client.recreate_group(shard, true).await.unwrap();
    }
    (server, target, conn)
}

/// The member `member`'s strict wait (the listener's in strict mode).
fn strict_wait(target: &RedisTarget, conn: &RedisConnection, member: &str) -> Arc<SharedWait> {
    strict_wait_blocking(target, conn, member, LONG)
}

/// [`strict_wait`] with blocks of up to `max_block`.
fn strict_wait_blocking(
    target: &RedisTarget,
    conn: &RedisConnection,
    member: &str,
    max_block: Duration,
) -> Arc<SharedWait> {
    let wait = SharedWait::new(
        WakeSource::Xread,
        target.clone(),
        conn.clone(),
        max_block,
        tracing::Span::none(),
    )
    .with_group_read(GroupRead {
        group: GROUP.into(),
        consumer: member.into(),
        count: 10,
    });
    Arc::new(wait)
}

/// Takes shard `shard` over as `client` with `token` and reads it up to date: the raise, and a
/// strict read whose passing check opens the gate. Returns the last id to wait from.
async fn take_over(client: &mut ShardClient, shard: u32, token: &FenceToken) -> String {
    assert_eq!(client.raise_fence(shard, token).await.unwrap(), Ok(()));
    loop {
        let (_, read) = client
            .ack_and_read_new(shard, token, &[], 100, FencingMode::Strict)
            .await
            .unwrap();
        match read {
            ReadOutcome::Entries(_) => {}
            ReadOutcome::Empty { last_id } => return last_id,
            ReadOutcome::Fenced(fenced) => panic!("{fenced:?}"),
        }
    }
}

async fn xadd(conn: &mut RedisConnection, key: &str) -> String {
    redis::cmd("XADD")
        .arg(key)
        .arg("*")
        .arg("f")
        .arg("v")
        .query_async(conn)
        .await
        .unwrap()
}

/// Entries of `shard` pending for `consumer`.
async fn pending_of(conn: &mut RedisConnection, shard: u32, consumer: &str) -> usize {
    let pending: Vec<redis::Value> = redis::cmd("XPENDING")
        .arg(key(shard))
        .arg(GROUP)
        .arg("-")
        .arg("+")
        .arg(100)
        .arg(consumer)
        .query_async(conn)
        .await
        .unwrap();
    pending.len()
}

async fn blocked_clients(conn: &mut RedisConnection) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("clients")
        .query_async(conn)
        .await
        .unwrap();
    info.lines()
        .find_map(|line| line.strip_prefix("blocked_clients:"))
        .map(|n| n.trim().parse().unwrap())
        .unwrap()
}

async fn until_blocked(conn: &mut RedisConnection, n: u64) {
    let end = tokio::time::Instant::now() + PROMPT;
    while blocked_clients(conn).await != n {
        assert!(tokio::time::Instant::now() < end, "never {n} blocked");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// An entry on one of two waiting shards comes back as the wait's reply, already in the
/// member's PEL: no read after the wake.
#[tokio::test]
async fn a_strict_wait_reads_the_entry_it_waits_for() {
    let (_server, target, mut conn) = setup(2).await;
    let token = token_of("m", 1);
    let mut client = client_of(&conn, "m");
    let wait = strict_wait(&target, &conn, "m");
    let mut tasks = Vec::new();
    for shard in 0..2 {
        let last = take_over(&mut client, shard, &token).await;
        let gate = client.gate(shard, &token);
        let slot = wait.register(key(shard));
        tasks.push(tokio::spawn(async move {
            slot.wait_reading(&last, &gate, LONG).await
        }));
    }
    until_blocked(&mut conn, 1).await;
    let id = xadd(&mut conn, &key(1)).await;
    let end = tokio::time::timeout(PROMPT, tasks.pop().unwrap())
        .await
        .unwrap()
        .unwrap();
    let WaitEnd::Delivered(reply) = end else {
        panic!("{end:?}");
    };
    let entries = client.delivered_entries(1, reply).unwrap();
    assert_eq!(
        entries.iter().map(|e| e.id.clone()).collect::<Vec<_>>(),
        [id]
    );
    assert_eq!(pending_of(&mut conn, 1, "m").await, 1, "read into the PEL");
    assert!(!tasks[0].is_finished(), "shard 0 had no entry");
}

/// A zombie blocked in its strict wait when the shard's next owner raises the fence: the raise
/// deletes the zombie's gate, which ends the wait at once with nothing read ([`WaitEnd::Woken`]:
/// read, which the fence refuses). Entries published after the raise never enter the zombie's
/// PEL, and a wait the zombie sends later (a paused process resuming) is refused the same way;
/// the owner reads them.
#[tokio::test]
async fn a_raise_ends_a_zombies_strict_wait_and_nothing_after_it_is_read() {
    let (_server, target, mut conn) = setup(1).await;
    let zombie_token = token_of("zombie", 1);
    let mut zombie = client_of(&conn, "zombie");
    let last = take_over(&mut zombie, 0, &zombie_token).await;
    let gate = zombie.gate(0, &zombie_token);
    let wait = strict_wait(&target, &conn, "zombie");
    let slot = wait.register(key(0));
    let blocked = {
        let (last, gate) = (last.clone(), gate.clone());
        tokio::spawn(async move { slot.wait_reading(&last, &gate, LONG).await })
    };
    until_blocked(&mut conn, 1).await;

    let owner_token = token_of("owner", 2);
    let mut owner = client_of(&conn, "owner");
    assert_eq!(owner.raise_fence(0, &owner_token).await.unwrap(), Ok(()));
    let end = tokio::time::timeout(PROMPT, blocked)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(end, WaitEnd::Woken, "ended by the raise, nothing read");
    for _ in 0..3 {
        xadd(&mut conn, &key(0)).await;
    }
    // The zombie waits again with its gate, as a restarted wait's first `XREADGROUP` (a
    // paused process resuming): refused at once, nothing read.
    let late_wait = strict_wait(&target, &conn, "zombie");
    let late_slot = late_wait.register(key(0));
    let late = tokio::time::timeout(PROMPT, late_slot.wait_reading(&last, &gate, LONG))
        .await
        .unwrap();
    assert_eq!(late, WaitEnd::Woken);
    assert_eq!(
        pending_of(&mut conn, 0, "zombie").await,
        0,
        "no zombie read"
    );
    let (_, read) = owner
        .ack_and_read_new(0, &owner_token, &[], 100, FencingMode::Strict)
        .await
        .unwrap();
    assert!(
        matches!(&read, ReadOutcome::Entries(e) if e.len() == 3),
        "{read:?}"
    );
}

/// A task whose own wait timed out leaves its shard in the member's strict `XREADGROUP` (no
/// interrupt per timeout). An entry read for it then is stashed (it is in the PEL), and
/// `settle`, which the task calls before it reads the shard itself, hands it over, once, as
/// read (not re-read from the PEL, which would count a second delivery). Settling while the
/// command blocks interrupts it and takes the shard out, so that the task's own read and the
/// wait never read the shard at once.
#[tokio::test]
async fn settle_takes_the_shard_out_of_the_wait_and_reports_what_it_read() {
    let (_server, target, mut conn) = setup(2).await;
    let token = token_of("m", 1);
    let mut client = client_of(&conn, "m");
    let wait = strict_wait(&target, &conn, "m");
    let mut slots = Vec::new();
    for shard in 0..2 {
        let last = take_over(&mut client, shard, &token).await;
        let gate = client.gate(shard, &token);
        let slot = wait.register(key(shard));
        // A short wait of the task's own: it times out, the key stays in the command.
        let end = slot
            .wait_reading(&last, &gate, Duration::from_millis(20))
            .await;
        assert_eq!(end, WaitEnd::TimedOut);
        slots.push(slot);
    }
    until_blocked(&mut conn, 1).await;
    let id = xadd(&mut conn, &key(0)).await;
    // Read by the wait into the PEL, nobody waiting to receive it.
    let end = tokio::time::Instant::now() + PROMPT;
    while pending_of(&mut conn, 0, "m").await == 0 {
        assert!(tokio::time::Instant::now() < end, "never read");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let Settled::Stashed(reply) = slots[0].settle().await else {
        panic!("read for shard 0: handed over by settle");
    };
    let entries = client.delivered_entries(0, reply).unwrap();
    assert_eq!(
        entries.iter().map(|e| e.id.clone()).collect::<Vec<_>>(),
        [id]
    );
    assert_eq!(slots[0].settle().await, Settled::Clear, "handed over once");

    // Shard 1 is in the command blocked now: settling interrupts it and takes shard 1 out, so
    // an entry published after it is left for the task's own read.
    until_blocked(&mut conn, 1).await;
    let settled = tokio::time::timeout(PROMPT, slots[1].settle()).await;
    assert_eq!(settled.unwrap(), Settled::Clear, "nothing read for shard 1");
    // Both shards out: no command blocks any more, so nothing can read what comes next.
    until_blocked(&mut conn, 0).await;
    xadd(&mut conn, &key(1)).await;
    assert_eq!(
        pending_of(&mut conn, 1, "m").await,
        0,
        "not read by the wait"
    );
}

/// A strict wait whose reply is lost (the server holds it past the wait connection's response
/// timeout: `CLIENT PAUSE … WRITE` keeps the `XREADGROUP` from running): the driver kills that
/// connection on the control connection before anyone reads on, and the waiting task is told to
/// read its pending entries first ([`WaitEnd::ReadPending`]). Once writes resume, the killed
/// wait reads nothing: an entry published then stays for the task's own read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_that_lost_its_reply_is_killed_before_its_shard_reads_on() {
    let (_server, target, mut conn) = setup(1).await;
    let token = token_of("m", 1);
    let mut client = client_of(&conn, "m");
    let last = take_over(&mut client, 0, &token).await;
    let gate = client.gate(0, &token);
    // Blocks of 100 ms: the wait connection's response timeout is 2 × 100 ms + 1 s.
    let wait = strict_wait_blocking(&target, &conn, "m", Duration::from_millis(100));
    let slot = wait.register(key(0));
    let clients_before = client_count(&mut conn).await;
    let () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(4_000)
        .arg("WRITE")
        .query_async(&mut conn)
        .await
        .unwrap();
    let end = tokio::time::timeout(
        Duration::from_secs(3),
        slot.wait_reading(&last, &gate, LONG),
    )
    .await
    .unwrap();
    assert_eq!(end, WaitEnd::ReadPending, "the reply was lost");
    let () = redis::cmd("CLIENT")
        .arg("UNPAUSE")
        .query_async(&mut conn)
        .await
        .unwrap();
    drop(slot);
    assert!(
        client_count(&mut conn).await <= clients_before,
        "the wait's connection is gone"
    );
    xadd(&mut conn, &key(0)).await;
    assert_eq!(
        pending_of(&mut conn, 0, "m").await,
        0,
        "the killed wait read nothing"
    );
}

async fn client_count(conn: &mut RedisConnection) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("clients")
        .query_async(conn)
        .await
        .unwrap();
    info.lines()
        .find_map(|line| line.strip_prefix("connected_clients:"))
        .map(|n| n.trim().parse().unwrap())
        .unwrap()
}

/// A strict wait whose gate is missing and stays missing (the check cannot create it at
/// `maxmemory`, or it was deleted by hand) is refused once: its shard is told to read
/// ([`WaitEnd::Woken`]), and the member's waits are then plain `XREAD`s for one block time,
/// which wake on a new entry without reading it. The first version sent the next strict wait at
/// once after each refusal: a loop of refusals as fast as Redis answered them.
#[tokio::test]
async fn a_refused_strict_wait_waits_with_plain_xreads_for_a_block_time() {
    let (_server, target, mut conn) = setup(1).await;
    let token = token_of("m", 1);
    // Never opened: no check ran for this token.
    let gate = client_of(&conn, "m").gate(0, &token);
    let wait = strict_wait(&target, &conn, "m");
    let slot = wait.register(key(0));
    let strict_before = command_calls(&mut conn, "xreadgroup").await;
    let first = tokio::time::timeout(PROMPT, slot.wait_reading("0-0", &gate, LONG))
        .await
        .unwrap();
    assert_eq!(first, WaitEnd::Woken, "refused: the shard reads");
    // The shard read (its check refused, say) and waits again from a later id, with the same
    // missing gate.
    let again = {
        let gate = gate.clone();
        tokio::spawn(async move { slot.wait_reading("0-1", &gate, LONG).await })
    };
    until_blocked(&mut conn, 1).await;
    assert_eq!(
        command_calls(&mut conn, "xreadgroup").await,
        strict_before + 1,
        "one refusal, no loop"
    );
    assert!(
        command_calls(&mut conn, "xread").await >= 1,
        "a plain XREAD blocks"
    );
    xadd(&mut conn, &key(0)).await;
    let end = tokio::time::timeout(PROMPT, again).await.unwrap().unwrap();
    assert_eq!(end, WaitEnd::Woken, "woken, not read");
    assert_eq!(pending_of(&mut conn, 0, "m").await, 0, "nothing read");
}
