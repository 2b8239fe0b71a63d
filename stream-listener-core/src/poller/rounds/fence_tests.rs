//! The strict round's fence against a real standalone server (docs/design.md §8.16): the check
//! inside the transaction and the read gate, refusals, lost fences and scripts, a long script of
//! another client (`BUSY`) and `maxmemory`.

use std::time::Duration;

use redis::Value;

use super::tests::{
    CONSUMER, GROUP, append, entry_ids, fenced_client, key, pending, setup, shard_client, token,
};
use super::*;
use crate::connection::{RedisFailure, RedisTarget};
use crate::dataplane::round::{PartRead, PartReply};
use crate::dataplane::{DataPlaneError, Fenced, FencingMode, ReadOutcome, ShardClient};
use crate::testing::RedisServer;
use crate::testing::fixtures::command_calls;

/// The gate of shard 0 for group `g` and `token` (`StreamKeys::gate`).
fn gate(token: &FenceToken) -> String {
    format!("{{s:0}}:gate:g:{}", token.encode())
}

/// Sets the fence field of `group` on `shard` to `value`.
async fn set_fence(conn: &mut RedisConnection, shard: ShardIndex, value: &str) {
    let _: i64 = redis::cmd("HSET")
        .arg(format!("{{s:{shard}}}:fence"))
        .arg(GROUP)
        .arg(value)
        .query_async(conn)
        .await
        .unwrap();
}

/// Another member's token, higher than [`token`]: the shard's owner, once it raised the fence.
fn owner_token() -> FenceToken {
    FenceToken {
        member_epoch: 9,
        member_id: "owner".into(),
        ..token()
    }
}

/// The client of the member `consumer` on shards `{s:<i>}`.
fn client_of(conn: &RedisConnection, consumer: &str) -> ShardClient {
    let keys = crate::keys::StreamKeys::new("s").unwrap();
    ShardClient::new(conn.clone(), keys, GROUP, consumer).unwrap()
}

/// Whether the gate of shard 0 for `token` exists, with the consumer group `g`.
async fn gate_open(conn: &mut RedisConnection, token: &FenceToken) -> bool {
    let groups: redis::RedisResult<Vec<std::collections::HashMap<String, Value>>> =
        redis::cmd("XINFO")
            .arg("GROUPS")
            .arg(gate(token))
            .query_async(conn)
            .await;
    match groups {
        Ok(groups) => groups
            .iter()
            .any(|g| g.get("name") == Some(&Value::BulkString(b"g".to_vec()))),
        Err(error) => {
            assert_eq!(error.code(), Some("ERR"), "{error:?}");
            false
        }
    }
}

/// Opens the gate of shard 0 for `token` as a passing check of it does (when it is not open);
/// for a token the fence does not hold, a gate that a lost fence value could leave behind.
async fn open_gate(conn: &mut RedisConnection, token: &FenceToken) {
    if !gate_open(conn, token).await {
        let () = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(gate(token))
            .arg(GROUP)
            .arg("$")
            .arg("MKSTREAM")
            .query_async(conn)
            .await
            .unwrap();
    }
}

/// Sends one strict round for shard 0 as `client`'s consumer with `token` and nothing to ack,
/// up to 10 entries.
async fn strict_round(
    conn: &mut RedisConnection,
    client: &mut ShardClient,
    token: &FenceToken,
) -> Vec<PartReply> {
    let part = client.round_part(0, token, &[], FencingMode::Strict);
    let consumer = client.consumer().to_owned();
    crate::dataplane::round::read_round(conn, GROUP, &consumer, 10, vec![part], None)
        .await
        .unwrap()
}

/// `maxmemory` reached (`noeviction`, a limit of 1 byte): Redis refuses deny-oom writes, and
/// every command queued in a transaction. `false`: no limit.
async fn out_of_memory(conn: &mut RedisConnection, on: bool) {
    let limit = if on { "1" } else { "0" };
    for (name, value) in [("maxmemory-policy", "noeviction"), ("maxmemory", limit)] {
        let () = redis::cmd("CONFIG")
            .arg("SET")
            .arg(name)
            .arg(value)
            .query_async(conn)
            .await
            .unwrap();
    }
    if on {
        let refused: redis::RedisResult<()> = redis::cmd("SET")
            .arg("probe")
            .arg("1")
            .query_async(conn)
            .await;
        assert_eq!(refused.unwrap_err().code(), Some("OOM"), "out of memory");
    }
}

/// The group's last-delivered id on `shard`.
async fn last_delivered(conn: &mut RedisConnection, shard: ShardIndex) -> String {
    let groups: Vec<std::collections::HashMap<String, Value>> = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(key(shard))
        .query_async(conn)
        .await
        .unwrap();
    match &groups[0]["last-delivered-id"] {
        Value::BulkString(id) => String::from_utf8(id.clone()).unwrap(),
        other => panic!("{other:?}"),
    }
}

/// A transaction left open on a connection of its own: `client`'s strict read of shard 0 with
/// `token`, queued (`MULTI`, the check, the read), its `EXEC` not yet sent.
struct Queued {
    wire: RedisConnection,
    exec: redis::Cmd,
    gate: String,
}

impl Queued {
    async fn new(server: &RedisServer, client: &mut ShardClient, token: &FenceToken) -> Self {
        let part = client.round_part(0, token, &[], FencingMode::Strict);
        let commands =
            crate::dataplane::round::strict_read_commands(GROUP, client.consumer(), 10, &[part]);
        let target = RedisTarget::standalone(server.url());
        let mut wire = RedisConnection::connect(&target, Duration::from_secs(5))
            .await
            .unwrap();
        let (exec, queue) = commands.split_last().unwrap();
        let mut pipe = redis::pipe();
        queue.iter().for_each(|c| _ = pipe.add_command(c.clone()));
        let replies: Vec<Value> = pipe.query_async(&mut wire).await.unwrap();
        let queued = Value::SimpleString("QUEUED".into());
        assert_eq!(replies, [Value::Okay, queued.clone(), queued]);
        Queued {
            wire,
            exec: exec.clone(),
            gate: gate(token),
        }
    }

    /// Sends the `EXEC`: shard 0's share of its reply, as a round hands it to the shard.
    async fn exec(mut self) -> PartRead {
        let mut pipe = redis::pipe();
        pipe.add_command(self.exec).ignore_errors();
        let mut replies: Vec<Value> = pipe.query_async(&mut self.wire).await.unwrap();
        let reply = replies.remove(0);
        let mut shares = crate::dataplane::round::exec_shares(reply, &[key(0)], &self.gate);
        shares.remove(0)
    }
}

/// A fenced round over six shards in one transaction, with plain acks before it: shard 0 and 2
/// hold the token, shard 1's fence is higher (another member's), shard 3's field is missing
/// (`LOWER`), shard 4's holds a value that is not a token, shard 5's fence key is of the wrong
/// type. Each refused shard gets its own verdict; the check deletes the round's gate (shard
/// 0's, open from an earlier round), so the read fails with `NOGROUP` and nothing at all is read
/// (no shard's PEL grows, not even those whose fence held); every ack went through (more than
/// the script's chunk of 500 ids included).
#[tokio::test]
async fn a_fenced_round_with_any_refusal_reads_nothing_and_each_shard_gets_its_verdict() {
    let (_server, mut conn) = setup(6, 1200).await;
    let mut client = fenced_client(&mut conn, 6).await;
    // Deliver everything of shards 0 and 2 to CONSUMER, to ack them in the round.
    for shard in [0, 2] {
        let _: Value = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(GROUP)
            .arg(CONSUMER)
            .arg("COUNT")
            .arg(5000)
            .arg("STREAMS")
            .arg(key(shard))
            .arg(">")
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    // A round that finds nothing new opens the gate.
    strict_round(&mut conn, &mut client, &token()).await;
    assert!(
        gate_open(&mut conn, &token()).await,
        "the owner's round opened the gate"
    );
    set_fence(&mut conn, 1, &owner_token().encode()).await;
    let _: i64 = redis::cmd("HDEL")
        .arg("{s:3}:fence")
        .arg(GROUP)
        .query_async(&mut conn)
        .await
        .unwrap();
    set_fence(&mut conn, 4, "garbage").await;
    let () = redis::cmd("SET")
        .arg("{s:5}:fence")
        .arg("not a hash")
        .query_async(&mut conn)
        .await
        .unwrap();
    let acks = [
        entry_ids(&mut conn, 0).await,
        Vec::new(),
        entry_ids(&mut conn, 2).await,
    ];
    let parts: Vec<RoundPart> = (0..6)
        .map(|s: u32| {
            let ids = acks.get(s as usize).cloned().unwrap_or_default();
            client.round_part(s, &token(), &ids, FencingMode::Strict)
        })
        .collect();
    let replies = crate::dataplane::round::read_round(&mut conn, GROUP, CONSUMER, 10, parts, None)
        .await
        .unwrap();
    let reads: Vec<String> = replies.iter().map(|r| format!("{:?}", r.read)).collect();
    assert_eq!(reads[0], "ReadAlone", "nothing read: read on your own");
    assert!(
        reads[1].starts_with("Fenced(Higher { found: Some("),
        "{}",
        reads[1]
    );
    assert_eq!(reads[2], "ReadAlone");
    assert_eq!(reads[3], "Fenced(Lower)");
    assert_eq!(reads[4], "Fenced(Higher { found: None })");
    assert_eq!(reads[5], "Fenced(Higher { found: None })");
    assert_eq!(
        replies[0].ack.as_ref().unwrap().as_ref().unwrap(),
        &Value::Int(1200)
    );
    assert_eq!(
        replies[2].ack.as_ref().unwrap().as_ref().unwrap(),
        &Value::Int(1200)
    );
    for shard in 0..6 {
        assert_eq!(
            pending(&mut conn, shard).await,
            0,
            "shard {shard}: nothing read"
        );
    }
    assert!(
        !gate_open(&mut conn, &token()).await,
        "the refusal deleted the gate"
    );
}

/// A zombie's round names its own token's gate, which the owner's raise deleted: its check
/// refuses, its read fails and nothing is read; the shard client reports the refusal
/// ([`ReadOutcome::Fenced`]), not the read's `NOGROUP` as an error. The owner's gate is another
/// key, which the zombie's refusal leaves open: the owner's next round reads.
#[tokio::test]
async fn a_zombies_refused_round_reads_nothing_and_leaves_the_owners_gate_open() {
    let (_server, mut conn) = setup(1, 4).await;
    let mut owner = client_of(&conn, "owner");
    assert_eq!(owner.raise_fence(0, &owner_token()).await.unwrap(), Ok(()));
    assert!(!gate_open(&mut conn, &owner_token()).await);
    let replies = strict_round(&mut conn, &mut owner, &owner_token()).await;
    assert!(replies[0].has_entries(), "{:?}", replies[0].read);
    assert!(
        gate_open(&mut conn, &owner_token()).await,
        "the first passing check created it"
    );
    for n in 0..3 {
        let _: String = redis::cmd("XADD")
            .arg(key(0))
            .arg("*")
            .arg("n")
            .arg(n)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    let before = last_delivered(&mut conn, 0).await;
    let mut zombie = shard_client(&conn);
    let (acked, read) = zombie
        .ack_and_read_new(0, &token(), &[], 10, FencingMode::Strict)
        .await
        .unwrap();
    assert_eq!(acked, 0);
    assert!(
        matches!(read, ReadOutcome::Fenced(Fenced::Higher { found: Some(_) })),
        "{read:?}"
    );
    assert!(!gate_open(&mut conn, &token()).await);
    assert!(
        gate_open(&mut conn, &owner_token()).await,
        "the zombie's refusal left the owner's gate"
    );
    assert_eq!(last_delivered(&mut conn, 0).await, before, "nothing read");
    assert_eq!(pending(&mut conn, 0).await, 4, "the owner's 4 only");
    let replies = strict_round(&mut conn, &mut owner, &owner_token()).await;
    assert!(replies[0].has_entries(), "{:?}", replies[0].read);
    assert_eq!(pending(&mut conn, 0).await, 7);
}

/// A server that lost its scripts (restarted, `SCRIPT FLUSH`) still checks the fence: the check
/// goes as `EVAL`, so it cannot miss with `NOSCRIPT` and let the read run unfenced.
#[tokio::test]
async fn a_server_without_scripts_still_fences_the_round() {
    let (_server, mut conn) = setup(1, 4).await;
    let mut client = fenced_client(&mut conn, 1).await;
    let stale = FenceToken {
        member_epoch: 0,
        ..token()
    };
    // Left behind by a lost fence value: only the check can stop the read.
    open_gate(&mut conn, &stale).await;
    let () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut conn)
        .await
        .unwrap();
    let replies = strict_round(&mut conn, &mut client, &stale).await;
    assert!(
        matches!(replies[0].read, PartRead::Fenced(Fenced::Higher { .. })),
        "{:?}",
        replies[0].read
    );
    assert_eq!(pending(&mut conn, 0).await, 0, "nothing read");
    let replies = strict_round(&mut conn, &mut client, &token()).await;
    assert!(replies[0].has_entries(), "the token holds: read");
    assert_eq!(pending(&mut conn, 0).await, 4);
}

/// Every fence key lost (a failover, a hand deletion): the check says `LOWER` and deletes the
/// gate like any refusal, so nothing is read (the design before the gate let this read run and
/// kept its entries from the handler).
#[tokio::test]
async fn with_every_fence_lost_nothing_is_read() {
    let (_server, mut conn) = setup(1, 4).await;
    let mut client = fenced_client(&mut conn, 1).await;
    open_gate(&mut conn, &token()).await;
    let _: i64 = redis::cmd("DEL")
        .arg("{s:0}:fence")
        .query_async(&mut conn)
        .await
        .unwrap();
    let replies = strict_round(&mut conn, &mut client, &token()).await;
    assert!(
        matches!(replies[0].read, PartRead::Fenced(Fenced::Lower)),
        "{:?}",
        replies[0].read
    );
    assert_eq!(pending(&mut conn, 0).await, 0, "nothing read");
    assert!(!gate_open(&mut conn, &token()).await);
}

/// Makes every other client's command wait behind a script that runs `ms` milliseconds past
/// `busy-reply-threshold` (set to 50 ms): Redis answers `BUSY` to all but the commands allowed
/// while busy (`MULTI`, `WATCH`, `DISCARD`...). Returns when the server answers `BUSY`; the
/// thread ends with the script.
async fn long_script(server: &RedisServer, ms: u64) -> std::thread::JoinHandle<()> {
    let mut sync = server.client().get_connection().unwrap();
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("busy-reply-threshold")
        .arg(50)
        .query(&mut sync)
        .unwrap();
    let busy = std::thread::spawn(move || {
        let _: i64 = redis::cmd("EVAL")
            .arg(
                "local t = redis.call('TIME') local start = t[1] * 1000000 + t[2] \
                 while true do local n = redis.call('TIME') \
                 if n[1] * 1000000 + n[2] - start > tonumber(ARGV[1]) * 1000 then return 1 end end",
            )
            .arg(0)
            .arg(ms)
            .query(&mut sync)
            .unwrap();
    });
    let mut probe = server.client().get_connection().unwrap();
    wait_for_busy(&mut probe, true).await;
    busy
}

/// Waits until `PING` answers `BUSY` (`busy`), or answers again.
async fn wait_for_busy(probe: &mut redis::Connection, busy: bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let reply: redis::RedisResult<String> = redis::cmd("PING").query(probe);
        let is_busy = matches!(&reply, Err(e) if e.code() == Some("BUSY"));
        if is_busy == busy {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "BUSY {busy} never came: {reply:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// While another client's script runs past `busy-reply-threshold`, a strict round over two
/// shards reads nothing: Redis refuses the queued check and read with `BUSY` (it accepts
/// `MULTI`), and the `EXEC` answers `EXECABORT`. Each shard is told to read on its own; no
/// entry enters any PEL. Once the script ended, the same round reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn during_a_long_script_a_strict_round_reads_nothing() {
    let (server, mut conn) = setup(2, 5).await;
    let mut client = fenced_client(&mut conn, 2).await;
    let target = RedisTarget::standalone(server.url());
    let mut wire = RedisConnection::connect(&target, Duration::from_secs(5))
        .await
        .unwrap();
    let parts = |client: &mut ShardClient| -> Vec<RoundPart> {
        (0..2)
            .map(|s| client.round_part(s, &token(), &[], FencingMode::Strict))
            .collect()
    };
    let busy = long_script(&server, 300).await;
    let replies = crate::dataplane::round::read_round(
        &mut wire,
        GROUP,
        CONSUMER,
        10,
        parts(&mut client),
        None,
    )
    .await
    .unwrap();
    busy.join().unwrap();
    for reply in &replies {
        assert!(
            matches!(reply.read, PartRead::ReadAlone),
            "{:?}",
            reply.read
        );
    }
    for shard in 0..2 {
        assert_eq!(pending(&mut conn, shard).await, 0, "shard {shard}");
    }
    let replies = crate::dataplane::round::read_round(
        &mut wire,
        GROUP,
        CONSUMER,
        10,
        parts(&mut client),
        None,
    )
    .await
    .unwrap();
    assert!(replies.iter().all(PartReply::has_entries));
}

/// docs/design.md §8.16, the `BUSY` hole of the check sent before the transaction: another
/// client's script runs past `busy-reply-threshold` while a zombie's strict read reaches Redis,
/// and ends somewhere inside it (a pipeline that reaches Redis in two reads). For every split of
/// the pipeline — the first `k` commands while the server is busy, the rest once the script
/// ended — the zombie reads nothing: no entry enters any PEL and the group's last-delivered id
/// stays. The zombie's gate is open (left behind by a lost fence value), so only the check can
/// stop the read. With the check sent before `MULTI` (`WATCH`, `EVAL`, `MULTI`, the read, `EXEC`), the
/// split after the refused `EVAL` read 10 entries into the zombie's PEL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_script_ending_anywhere_in_a_zombies_strict_read_lets_nothing_through() {
    let (server, mut conn) = setup(1, 20).await;
    let mut owner = client_of(&conn, "owner");
    assert_eq!(owner.raise_fence(0, &owner_token()).await.unwrap(), Ok(()));
    let mut zombie = shard_client(&conn);
    let part = zombie.round_part(0, &token(), &[], FencingMode::Strict);
    let commands = crate::dataplane::round::strict_read_commands(GROUP, CONSUMER, 10, &[part]);
    let before = last_delivered(&mut conn, 0).await;
    let target = RedisTarget::standalone(server.url());
    let mut probe = server.client().get_connection().unwrap();
    for k in 0..=commands.len() {
        // The zombie's gate open, as a lost fence value could leave it.
        open_gate(&mut conn, &token()).await;
        let mut wire = RedisConnection::connect(&target, Duration::from_secs(5))
            .await
            .unwrap();
        let busy = long_script(&server, 400).await;
        let mut first = redis::pipe();
        commands[..k]
            .iter()
            .for_each(|c| _ = first.add_command(c.clone()));
        let early: Vec<Value> = if k > 0 {
            first.ignore_errors().query_async(&mut wire).await.unwrap()
        } else {
            Vec::new()
        };
        busy.join().unwrap();
        wait_for_busy(&mut probe, false).await;
        let mut rest = redis::pipe();
        commands[k..]
            .iter()
            .for_each(|c| _ = rest.add_command(c.clone()));
        let late: Vec<Value> = if k < commands.len() {
            rest.ignore_errors().query_async(&mut wire).await.unwrap()
        } else {
            Vec::new()
        };
        assert_eq!(
            (
                pending(&mut conn, 0).await,
                last_delivered(&mut conn, 0).await
            ),
            (0, before.clone()),
            "split after {k} commands: the zombie read (replies while busy {early:?}, after \
             {late:?})"
        );
        if k == commands.len() {
            // All of it while busy: Redis accepts MULTI, refuses the queued check and read with
            // BUSY, and aborts the EXEC it refuses for BUSY.
            let text: Vec<String> = early.iter().map(|v| format!("{v:?}")).collect();
            assert_eq!(early[0], Value::Okay, "{text:?}");
            assert!(
                text[1].contains("BUSY") && text[2].contains("BUSY"),
                "{text:?}"
            );
            assert!(text[3].contains("EXECABORT"), "{text:?}");
        }
    }
}

/// At `maxmemory` (`noeviction`) Redis refuses every command queued in a transaction, so a
/// strict round's `EXEC` answers `EXECABORT` for the owner and a zombie alike; each shard then
/// reads on its own with the fenced read script, which Redis runs: the owner reads, the zombie
/// is refused. When memory runs out between the queueing and the `EXEC` instead, the
/// transaction runs: with its gate open the owner's check passes and it reads, and a zombie's
/// check deletes its own gate (`DEL` is not deny-oom; opened here as a lost fence value could
/// leave it), so its read fails and nothing is read.
#[tokio::test]
async fn at_maxmemory_the_owner_still_reads_and_a_zombie_is_refused() {
    let (server, mut conn) = setup(1, 4).await;
    let mut owner = client_of(&conn, "owner");
    let mut zombie = shard_client(&conn);
    assert_eq!(owner.raise_fence(0, &owner_token()).await.unwrap(), Ok(()));
    let replies = strict_round(&mut conn, &mut owner, &owner_token()).await;
    assert!(replies[0].has_entries());
    for n in 0..6 {
        let _: String = redis::cmd("XADD")
            .arg(key(0))
            .arg("*")
            .arg("n")
            .arg(n)
            .query_async(&mut conn)
            .await
            .unwrap();
    }

    out_of_memory(&mut conn, true).await;
    let replies = strict_round(&mut conn, &mut owner, &owner_token()).await;
    assert!(
        matches!(replies[0].read, PartRead::ReadAlone),
        "EXECABORT: {:?}",
        replies[0].read
    );
    let (_, read) = owner
        .ack_and_read_new(0, &owner_token(), &[], 2, FencingMode::Strict)
        .await
        .unwrap();
    assert!(
        matches!(&read, ReadOutcome::Entries(e) if e.len() == 2),
        "the owner reads alone: {read:?}"
    );
    let (_, read) = zombie
        .ack_and_read_new(0, &token(), &[], 2, FencingMode::Strict)
        .await
        .unwrap();
    assert!(matches!(read, ReadOutcome::Fenced(_)), "{read:?}");
    assert_eq!(pending(&mut conn, 0).await, 6, "4 + 2, all the owner's");
    out_of_memory(&mut conn, false).await;

    // Memory runs out after the owner's transaction was queued: the gate is open, it reads.
    let queued = Queued::new(&server, &mut owner, &owner_token()).await;
    out_of_memory(&mut conn, true).await;
    let read = queued.exec().await;
    assert!(
        matches!(&read, PartRead::Entries(Value::Array(_))),
        "{read:?}"
    );
    out_of_memory(&mut conn, false).await;
    assert_eq!(pending(&mut conn, 0).await, 10, "and the 4 left");
    let _: String = redis::cmd("XADD")
        .arg(key(0))
        .arg("*")
        .arg("n")
        .arg(9)
        .query_async(&mut conn)
        .await
        .unwrap();

    // ... and after a zombie's: its check deletes its gate, its read fails, nothing is read.
    open_gate(&mut conn, &token()).await;
    let before = last_delivered(&mut conn, 0).await;
    let queued = Queued::new(&server, &mut zombie, &token()).await;
    out_of_memory(&mut conn, true).await;
    let read = queued.exec().await;
    assert!(
        matches!(read, PartRead::Fenced(Fenced::Higher { .. })),
        "{read:?}"
    );
    out_of_memory(&mut conn, false).await;
    assert!(
        !gate_open(&mut conn, &token()).await,
        "DEL ran at maxmemory"
    );
    assert!(gate_open(&mut conn, &owner_token()).await);
    assert_eq!(last_delivered(&mut conn, 0).await, before, "nothing read");
    assert_eq!(pending(&mut conn, 0).await, 10);
}

/// The owner's check passes, but the gate is missing (a refusal or consumer hygiene deleted it)
/// and memory ran out after the transaction was queued: `XGROUP CREATE … MKSTREAM` is deny-oom,
/// so the check cannot open the gate, the read fails and nothing is read (fail closed). The
/// shard client reports it as [`DataPlaneError::GateUnavailable`] with Redis's `OOM` as its
/// source. Once memory frees, the owner's next round creates the gate and reads.
#[tokio::test]
async fn a_gate_that_cannot_be_created_at_maxmemory_fails_the_read_closed() {
    let (server, mut conn) = setup(1, 4).await;
    let mut owner = client_of(&conn, "owner");
    assert_eq!(owner.raise_fence(0, &owner_token()).await.unwrap(), Ok(()));
    assert!(!gate_open(&mut conn, &owner_token()).await);
    let queued = Queued::new(&server, &mut owner, &owner_token()).await;
    out_of_memory(&mut conn, true).await;
    let read = queued.exec().await;
    assert!(
        matches!(&read, PartRead::GateUnavailable { gate, detail } if *gate == self::gate(&owner_token()) && detail.starts_with("OOM")),
        "{read:?}"
    );
    let reply = PartReply { ack: None, read };
    let error = owner
        .round_reply(0, &owner_token(), 10, FencingMode::Strict, reply)
        .await
        .unwrap_err();
    out_of_memory(&mut conn, false).await;
    let DataPlaneError::GateUnavailable {
        shard,
        gate,
        source,
    } = &error
    else {
        panic!("{error:?}");
    };
    assert_eq!((*shard, gate.clone()), (0, self::gate(&owner_token())));
    assert_eq!(
        RedisFailure::of(source),
        RedisFailure::OutOfMemory,
        "{error}"
    );
    assert!(
        !error.is_no_group(),
        "the shard's group is there: no re-creation"
    );
    let text = error.to_string();
    assert!(
        text.contains("failed closed") && text.contains("maxmemory"),
        "{text}"
    );
    assert_eq!(pending(&mut conn, 0).await, 0, "nothing read");
    assert!(!gate_open(&mut conn, &owner_token()).await);

    let replies = strict_round(&mut conn, &mut owner, &owner_token()).await;
    assert!(replies[0].has_entries(), "{:?}", replies[0].read);
    assert!(gate_open(&mut conn, &owner_token()).await);
}

/// The registry of shard 0's gates, sorted.
async fn registry(conn: &mut RedisConnection) -> Vec<String> {
    let mut listed: Vec<String> = redis::cmd("SMEMBERS")
        .arg("{s:0}:gates")
        .query_async(conn)
        .await
        .unwrap();
    listed.sort();
    listed
}

/// A raise deletes every other token's gate of the group on the shard, the one the fence held
/// and one a lost fence value left behind (found through the registry: the raise over an empty
/// field knows no stored token), and keeps another group's; the new owner's first passing check
/// opens and lists its own.
#[tokio::test]
async fn a_raise_closes_the_groups_other_gates_even_over_a_lost_fence() {
    let (_server, mut conn) = setup(1, 4).await;
    let mut first = client_of(&conn, "first");
    let first_token = FenceToken {
        member_epoch: 3,
        member_id: "first".into(),
        ..token()
    };
    assert_eq!(first.raise_fence(0, &first_token).await.unwrap(), Ok(()));
    strict_round(&mut conn, &mut first, &first_token).await;
    assert_eq!(registry(&mut conn).await, [gate(&first_token)]);
    // Another group's gate on the shard, listed in the same registry.
    let other = "{s:0}:gate:h:1:1:p:m".to_owned();
    let () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(&other)
        .arg("h")
        .arg("$")
        .arg("MKSTREAM")
        .query_async(&mut conn)
        .await
        .unwrap();
    let _: i64 = redis::cmd("SADD")
        .arg("{s:0}:gates")
        .arg(&other)
        .query_async(&mut conn)
        .await
        .unwrap();

    // A normal raise: the stored token's gate goes.
    let mut second = client_of(&conn, "second");
    let second_token = FenceToken {
        member_epoch: 5,
        member_id: "second".into(),
        ..token()
    };
    assert_eq!(second.raise_fence(0, &second_token).await.unwrap(), Ok(()));
    assert!(!gate_open(&mut conn, &first_token).await);
    assert_eq!(registry(&mut conn).await, std::slice::from_ref(&other));
    strict_round(&mut conn, &mut second, &second_token).await;
    assert!(gate_open(&mut conn, &second_token).await);

    // The fence lost: a raise over the empty field still closes the second's gate.
    let _: i64 = redis::cmd("DEL")
        .arg("{s:0}:fence")
        .query_async(&mut conn)
        .await
        .unwrap();
    let mut owner = client_of(&conn, "owner");
    assert_eq!(owner.raise_fence(0, &owner_token()).await.unwrap(), Ok(()));
    assert!(!gate_open(&mut conn, &second_token).await);
    assert_eq!(registry(&mut conn).await, std::slice::from_ref(&other));
    let replies = strict_round(&mut conn, &mut owner, &owner_token()).await;
    assert!(
        matches!(replies[0].read, PartRead::Entries(_)),
        "the check passed: {:?}",
        replies[0].read
    );
    let mut expected = vec![gate(&owner_token()), other];
    expected.sort();
    assert_eq!(registry(&mut conn).await, expected);
}

/// Entries of a round's share, 0 for any other read.
fn share_len(read: &ReadOutcome) -> usize {
    match read {
        ReadOutcome::Entries(entries) => entries.len(),
        _ => 0,
    }
}

/// Once a round's check passed for every shard, the next round reads through the gates: one
/// plain `XREADGROUP` naming each shard's gate, no transaction and no script, and it reads what
/// the check would have let through. A shard whose last read was not vouched for (a new client,
/// as after a new token) brings the check back for its round.
#[tokio::test]
async fn once_its_check_passed_a_round_reads_through_the_gates_without_the_check() {
    let (_server, mut conn) = setup(2, 3).await;
    let mut clients = [fenced_client(&mut conn, 2).await, shard_client(&conn)];
    let round = async |conn: &mut RedisConnection, clients: &mut [ShardClient; 2]| {
        let parts = (0..2u32)
            .map(|s| clients[s as usize].round_part(s, &token(), &[], FencingMode::Strict))
            .collect();
        let replies = crate::dataplane::round::read_round(conn, GROUP, CONSUMER, 10, parts, None)
            .await
            .unwrap();
        let mut counts = Vec::new();
        for (s, reply) in replies.into_iter().enumerate() {
            let (_, read) = clients[s]
                .round_reply(s as u32, &token(), 10, FencingMode::Strict, reply)
                .await
                .unwrap();
            counts.push(share_len(&read));
        }
        counts
    };
    let (evals, execs) = (
        command_calls(&mut conn, "eval").await,
        command_calls(&mut conn, "exec").await,
    );
    assert_eq!(round(&mut conn, &mut clients).await, vec![3, 3]);
    assert_eq!(command_calls(&mut conn, "eval").await, evals + 1, "checked");
    append(&mut conn, 0, 2).await;
    append(&mut conn, 1, 1).await;
    assert_eq!(round(&mut conn, &mut clients).await, vec![2, 1]);
    assert_eq!(
        (
            command_calls(&mut conn, "eval").await,
            command_calls(&mut conn, "exec").await
        ),
        (evals + 1, execs + 1),
        "the second round ran no check and no transaction"
    );
    assert_eq!(
        (pending(&mut conn, 0).await, pending(&mut conn, 1).await),
        (5, 4)
    );
    // Shard 1's task starts again (a new client knows no open gate): the round checks.
    clients[1] = shard_client(&conn);
    append(&mut conn, 1, 1).await;
    assert_eq!(round(&mut conn, &mut clients).await, vec![0, 1]);
    assert_eq!(
        command_calls(&mut conn, "eval").await,
        evals + 2,
        "checked again"
    );
}

/// A member whose gate was open reads through it; the new owner's raise deletes it, so the
/// member's next read through the gate fails and reads nothing, and the check that follows at
/// once gives the shard its verdict (`HIGHER`): the refusal, not an error. The entries added
/// after the raise stay undelivered, for the owner.
#[tokio::test]
async fn a_read_through_a_gate_the_raise_deleted_reads_nothing_and_gets_the_verdict() {
    let (_server, mut conn) = setup(1, 2).await;
    let mut zombie = fenced_client(&mut conn, 1).await;
    let (_, read) = zombie
        .ack_and_read_new(0, &token(), &[], 10, FencingMode::Strict)
        .await
        .unwrap();
    assert_eq!(share_len(&read), 2, "{read:?}");
    let mut owner = client_of(&conn, "owner");
    assert_eq!(owner.raise_fence(0, &owner_token()).await.unwrap(), Ok(()));
    assert!(
        !gate_open(&mut conn, &token()).await,
        "the raise deleted it"
    );
    append(&mut conn, 0, 3).await;
    let before = last_delivered(&mut conn, 0).await;
    let (reads, evals) = (
        command_calls(&mut conn, "xreadgroup").await,
        command_calls(&mut conn, "eval").await,
    );
    let (_, read) = zombie
        .ack_and_read_new(0, &token(), &[], 10, FencingMode::Strict)
        .await
        .unwrap();
    assert!(
        matches!(read, ReadOutcome::Fenced(Fenced::Higher { found: Some(_) })),
        "{read:?}"
    );
    assert_eq!(
        (
            command_calls(&mut conn, "xreadgroup").await,
            command_calls(&mut conn, "eval").await
        ),
        (reads + 2, evals + 1),
        "the read through the gate, then the checked transaction"
    );
    assert_eq!(last_delivered(&mut conn, 0).await, before, "nothing read");
    assert_eq!(pending(&mut conn, 0).await, 2, "the zombie's first 2 only");
}
