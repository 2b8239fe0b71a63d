//! `memory`: resident memory of a child process with an idle listener and with reads in flight.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::common::*;
use stream_listener_core::handler::{Delivery, HandlerError};
use stream_listener_core::internals::admin::{self};
use stream_listener_core::internals::connection::RedisTarget;
use stream_listener_core::internals::keys::StreamKeys;
use stream_listener_core::member::{EventCallback, Listener, ListenerEvent, ListenerOptions};
use stream_listener_core::model::StartFrom;
use stream_listener_core::testing::RedisServer;

pub(crate) const MEM_PREFIX: &str = "mem";
pub(crate) const MEM_SHARDS: u32 = 64;

/// The streams of the many-listeners case: `mem-l0` … `mem-l9`, 64 shards each.
const LISTENER_STREAMS: u32 = 10;

fn listener_stream(i: u32) -> String {
    format!("{MEM_PREFIX}-l{i}")
}

/// The child: `memory-child <url> <bare|listener|listeners> <group> <batch or count>`. Prints
/// `RSS_BARE <kB>` or `RSS_IDLE <kB>`, then (listener) waits until every shard has a batch of
/// `batch` entries in flight and prints `RSS_INFLIGHT <kB> <entries>`, then waits to be killed.
/// `listeners`: `count` listeners of `concurrency = 4`, one per stream `mem-l<i>`, idle.
pub(crate) fn memory_child(args: &[String]) {
    let url = args[0].clone();
    let mode = args[1].clone();
    let group = args[2].clone();
    let batch: usize = args[3].parse().unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async move {
        let target = RedisTarget::standalone(url);
        let mut conn = connect(&target).await;
        let _: String = redis::cmd("PING").query_async(&mut conn).await.unwrap();
        if mode == "bare" {
            tokio::time::sleep(Duration::from_secs(2)).await;
            println!("RSS_BARE {}", rss_kb());
            std::io::stdout().flush().unwrap();
            std::future::pending::<()>().await;
        }
        if mode == "listeners" {
            let count = u32::try_from(batch).unwrap();
            let mut handles = Vec::new();
            for i in 0..count {
                let mut options = ListenerOptions::default();
                options.concurrency = 4;
                options.coordination = coordination();
                let handler = |_d: Delivery| async { Ok::<(), HandlerError>(()) };
                let handle = Listener::new(
                    target.clone(),
                    &listener_stream(i),
                    &group,
                    handler,
                    options,
                )
                .unwrap()
                .start()
                .await
                .unwrap();
                handles.push(handle);
            }
            for i in 0..count {
                wait_converged(
                    &mut conn,
                    &listener_stream(i),
                    &group,
                    4,
                    Duration::from_secs(60),
                )
                .await
                .expect("converged");
            }
            tokio::time::sleep(Duration::from_secs(3)).await;
            println!("RSS_IDLE {}", rss_kb());
            std::io::stdout().flush().unwrap();
            std::future::pending::<()>().await;
        }
        let started = Arc::new(AtomicU64::new(0));
        let read = Arc::new(AtomicU64::new(0));
        let mut options = ListenerOptions::default();
        options.concurrency = 4;
        options.batch_size = batch;
        options.coordination = coordination();
        options.handler_timeout = Duration::from_secs(600);
        options.start_from = StartFrom::Latest;
        let r = read.clone();
        options.events = Some(EventCallback(Arc::new(move |e| {
            if let ListenerEvent::Read { count, .. } = e {
                r.fetch_add(count as u64, Ordering::Relaxed);
            }
        })));
        let s = started.clone();
        let handler = move |_d: Delivery| {
            s.fetch_add(1, Ordering::Relaxed);
            async {
                std::future::pending::<()>().await;
                Ok::<(), HandlerError>(())
            }
        };
        let _handle = Listener::new(target.clone(), MEM_PREFIX, &group, handler, options)
            .unwrap()
            .start()
            .await
            .unwrap();
        wait_converged(&mut conn, MEM_PREFIX, &group, 4, Duration::from_secs(60))
            .await
            .expect("converged");
        tokio::time::sleep(Duration::from_secs(3)).await;
        println!("RSS_IDLE {}", rss_kb());
        std::io::stdout().flush().unwrap();
        let want = (batch as u64) * u64::from(MEM_SHARDS);
        let give_up = Instant::now() + Duration::from_secs(60);
        while (started.load(Ordering::Relaxed) < u64::from(MEM_SHARDS)
            || read.load(Ordering::Relaxed) < want)
            && Instant::now() < give_up
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        println!("RSS_INFLIGHT {} {}", rss_kb(), read.load(Ordering::Relaxed));
        std::io::stdout().flush().unwrap();
        std::future::pending::<()>().await;
    });
}

pub(crate) struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub(crate) fn spawn_child(
    url: &str,
    mode: &str,
    group: &str,
    batch: usize,
) -> (Child, impl Iterator<Item = String> + use<>) {
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new(exe)
        .arg("memory-child")
        .arg(url)
        .arg(mode)
        .arg(group)
        .arg(batch.to_string())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let lines = BufReader::new(out).lines().map_while(Result::ok);
    (Child(child), lines)
}

pub(crate) fn field(line: &str, n: usize) -> u64 {
    line.split_whitespace()
        .nth(n)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

pub(crate) async fn memory() {
    let server = RedisServer::start().expect("redis-server");
    let url = server.url();
    let target = RedisTarget::standalone(url.clone());
    let mut conn = connect(&target).await;
    admin::create_stream(&mut conn, MEM_PREFIX, MEM_SHARDS)
        .await
        .unwrap();
    let keys = StreamKeys::new(MEM_PREFIX).unwrap();
    let (_bare, mut lines) = spawn_child(&url, "bare", "-", 1);
    let bare = tokio::task::spawn_blocking(move || lines.next().unwrap())
        .await
        .unwrap();
    let bare = field(&bare, 1);
    drop(_bare);
    println!("[memory] bare process (tokio runtime + one Redis connection): {bare} kB");
    let mut rows = Vec::new();
    for (i, batch) in [100usize, 1000].into_iter().enumerate() {
        let group = format!("mem{i}");
        let (child, mut lines) = spawn_child(&url, "listener", &group, batch);
        let (idle_line, lines) = tokio::task::spawn_blocking(move || {
            let l = lines.next().unwrap();
            (l, lines)
        })
        .await
        .unwrap();
        let idle = field(&idle_line, 1);
        // Now fill every shard with one batch (the handler blocks on its first entry), in one
        // MULTI/EXEC: the blocked shard tasks wake when every entry is there, so each first read
        // takes a whole batch.
        let mut pipe = redis::pipe();
        pipe.atomic();
        for n in 0..batch * MEM_SHARDS as usize {
            let key = format!("key-{}", n % 1000);
            pipe.cmd("XADD")
                .arg(keys.shard((n % MEM_SHARDS as usize) as u32))
                .arg("*")
                .arg("key")
                .arg(&key)
                .arg("payload")
                .arg(format!("{{\"key\":\"{key}\",\"seq\":{n}}}"))
                .ignore();
        }
        let () = pipe.query_async(&mut conn).await.unwrap();
        let mut lines = lines;
        let inflight_line = tokio::task::spawn_blocking(move || lines.next().unwrap())
            .await
            .unwrap();
        let inflight = field(&inflight_line, 1);
        let entries = field(&inflight_line, 2);
        println!(
            "[memory] batch {batch}: idle {idle} kB, {entries} entries in flight: {inflight} kB"
        );
        rows.push((batch, idle, inflight, entries));
        drop(child);
        // Drop this batch's entries so the next child's group starts from an empty stream.
        for s in 0..MEM_SHARDS {
            let _: i64 = redis::cmd("XTRIM")
                .arg(keys.shard(s))
                .arg("MAXLEN")
                .arg(0)
                .query_async(&mut conn)
                .await
                .unwrap();
        }
    }
    // `key key-NNN payload {"key":"key-NNN","seq":N}`: about 50 bytes of field names and values,
    // plus an id of about 15 bytes.
    let entry_bytes = "about 50 bytes of field names and values, plus a 15-byte id";
    let (b1, i1, f1, e1) = rows[0];
    let (b2, i2, f2, e2) = rows[1];
    let slope = (f2 as f64 - f1 as f64) * 1024.0 / (e2 as f64 - e1 as f64);
    println!("\n[memory] (load {})", load_average());
    println!("| case | VmRSS | ratio to bare process |");
    println!("| --- | --- | --- |");
    println!("| bare process: tokio runtime + one Redis connection | {bare} kB | 1 |");
    for (b, i, f, e) in [(b1, i1, f1, e1), (b2, i2, f2, e2)] {
        println!(
            "| listener, 4 members, 64 shards, idle (child for batch {b}) | {i} kB | {:.2} |",
            i as f64 / bare as f64
        );
        println!(
            "| same, {e} entries in flight (batch {b} on each shard) | {f} kB | {:.2} |",
            f as f64 / bare as f64
        );
    }
    println!(
        "\n[memory] per entry in flight (slope between the two batch sizes): {slope:.0} bytes; entries are {entry_bytes}"
    );
    many_listeners(&server, &mut conn).await;
}

/// 10 listeners of 64 shards in one process against one listener of 64 shards (same run):
/// resident memory and the connections the server counts, both idle.
async fn many_listeners(
    server: &RedisServer,
    conn: &mut stream_listener_core::internals::connection::RedisConnection,
) {
    for i in 0..LISTENER_STREAMS {
        admin::create_stream(conn, &listener_stream(i), MEM_SHARDS)
            .await
            .unwrap();
    }
    let mut rows = Vec::new();
    for count in [1, LISTENER_STREAMS] {
        let before = connected_clients(conn).await;
        let group = format!("many{count}");
        let (child, mut lines) = spawn_child(&server.url(), "listeners", &group, count as usize);
        let idle_line = tokio::task::spawn_blocking(move || lines.next().unwrap())
            .await
            .unwrap();
        let connections = connected_clients(conn).await - before;
        rows.push((count, field(&idle_line, 1), connections));
        drop(child);
    }
    let (_, one_rss, one_conns) = rows[0];
    println!(
        "\n[memory] listeners of 4 members × 64 shards in one process, idle (load {})",
        load_average()
    );
    println!("| listeners | VmRSS | ratio | connections | ratio |");
    println!("| --- | --- | --- | --- | --- |");
    for (count, rss, conns) in rows {
        println!(
            "| {count} | {rss} kB | {:.2} | {conns} | {:.2} |",
            rss as f64 / one_rss as f64,
            conns as f64 / one_conns as f64
        );
    }
}

/// The server's `connected_clients`.
async fn connected_clients(
    conn: &mut stream_listener_core::internals::connection::RedisConnection,
) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("clients")
        .query_async(conn)
        .await
        .unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("connected_clients:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap()
}
