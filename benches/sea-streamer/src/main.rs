//! `sea-streamer-consume <redis-url> <stream> <count> <consumers> <batch>`: consumes and acks
//! `count` pre-loaded entries of the sharded stream `<stream>` (shard keys `<stream>:<i>`, the
//! payload in field `msg`, as sea-streamer-redis lays them out) with `consumers` sea-streamer
//! consumers in this process, `ConsumerMode::LoadBalanced`, consumer group `ssbench` from the
//! earliest entry, `AutoCommit::Rolling` (the handler acks each message; the consumer commits the
//! acks in the background) and read batches of `batch`. The handler does nothing else.
//!
//! Prints one line: `received_s=<s> acked_s=<s> count=<n> pending_at_received=<n>`: the time
//! until every entry was received (and acked locally), and until the group's pending count on
//! every shard was 0 after the consumers' final commit (`end()`: everything acknowledged in
//! Redis), and how many entries were still pending in Redis when the last one was received.
//! (Rolling commits the acks on the consumer's next read cycle: the last ones wait for the
//! blocking read of a quiet stream to return, so `acked_s` includes that wait.) The clock starts before the consumers are
//! created (they discover the shards and create the group).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sea_streamer_redis::{AutoCommit, AutoStreamReset, RedisConsumerOptions, RedisStreamer};
use sea_streamer_types::{
    Consumer, ConsumerGroup, ConsumerMode, ConsumerOptions, StreamKey, Streamer,
};

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [url, stream, count, consumers, batch] = &args[..] else {
        eprintln!("usage: sea-streamer-consume <redis-url> <stream> <count> <consumers> <batch>");
        std::process::exit(2);
    };
    let count: u64 = count.parse().expect("count");
    let consumers: usize = consumers.parse().expect("consumers");
    let batch: usize = batch.parse().expect("batch");
    let client = redis::Client::open(url.as_str()).expect("url");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("connect");
    let streamer = RedisStreamer::connect(url.parse().expect("url"), Default::default())
        .await
        .expect("sea-streamer connect");
    let key = StreamKey::new(stream.clone()).expect("stream key");
    let mut options = RedisConsumerOptions::new(ConsumerMode::LoadBalanced);
    options
        .set_consumer_group(ConsumerGroup::new("ssbench"))
        .expect("group");
    options.set_auto_stream_reset(AutoStreamReset::Earliest);
    options.set_auto_commit(AutoCommit::Rolling);
    options.set_batch_size(batch);
    let received = Arc::new(AtomicU64::new(0));
    let done = Arc::new(tokio::sync::Notify::new());
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..consumers {
        let consumer = streamer
            .create_consumer(std::slice::from_ref(&key), options.clone())
            .await
            .expect("consumer");
        let received = received.clone();
        let done = done.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                tokio::select! {
                    message = consumer.next() => {
                        let message = message.expect("next");
                        consumer.ack(&message).expect("ack");
                        if received.fetch_add(1, Ordering::Relaxed) + 1 >= count {
                            done.notify_waiters();
                        }
                    }
                    _ = done.notified() => break,
                }
                if received.load(Ordering::Relaxed) >= count {
                    break;
                }
            }
            // Commits the pending acks and stops the consumer.
            consumer.end().await.expect("end");
        }));
    }
    while received.load(Ordering::Relaxed) < count {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let received_s = start.elapsed().as_secs_f64();
    let shards: Vec<String> = {
        let mut keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{stream}:*"))
            .query_async(&mut conn)
            .await
            .expect("KEYS");
        keys.sort();
        keys
    };
    // Entries delivered to the group but not yet acknowledged in Redis, summed over the shards.
    async fn pending(conn: &mut redis::aio::MultiplexedConnection, shards: &[String]) -> u64 {
        let mut pending = 0u64;
        for shard in shards {
            let summary: redis::Value = redis::cmd("XPENDING")
                .arg(shard)
                .arg("ssbench")
                .query_async(conn)
                .await
                .expect("XPENDING");
            if let redis::Value::Array(items) = summary
                && let Some(redis::Value::Int(n)) = items.first()
            {
                pending += *n as u64;
            }
        }
        pending
    }
    let pending_at_received = pending(&mut conn, &shards).await;
    done.notify_waiters();
    for task in tasks {
        task.await.expect("consumer task");
    }
    loop {
        let pending = pending(&mut conn, &shards).await;
        if pending == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
        if start.elapsed() > Duration::from_secs(120) {
            eprintln!("still {pending} pending after 120 s");
            std::process::exit(1);
        }
    }
    let acked_s = start.elapsed().as_secs_f64();
    println!(
        "received_s={received_s:.4} acked_s={acked_s:.4} count={} pending_at_received={pending_at_received}",
        received.load(Ordering::Relaxed)
    );
}
