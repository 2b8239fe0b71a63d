//! A listener in a process of its own, for the fault-injection tests in `tests/member_*.rs`
//! (a real process can be `SIGKILL`ed, or frozen with `SIGSTOP` while its clocks run on).
//!
//! ```text
//! member_process <redis-url> [--stream orders] [--group billing] [--concurrency 1]
//!     [--heartbeat-ms 200] [--lease-ms 1500] [--rebalance-ms 3000] [--fencing strict|acks]
//!     [--handler-ms 0] [--batch 64] [--block-ms 500] [--instance-id ID]
//! ```
//!
//! It prints one line per thing it does, on stdout, with the wall-clock time in µs since the Unix
//! epoch (comparable with the test process's clock):
//!
//! ```text
//! READY <member-id>,<member-id>...
//! H <us> <member> <shard> <entry-id> <member-epoch> <attempt> <payload n or ->   handler start
//! D <us> <member> <shard> <entry-id>                                          handler success
//! A <us> <member> <shard> <member-epoch>                                      Assigned event
//! V <us> <member> <shard> <member-epoch>                                      Revoked event
//! R <us> <member> <shard> <count> <first-id>                                  Read event
//! F <us> <member> <shard> <op>                                                FenceRejected
//! ```
//!
//! It shuts down gracefully on SIGTERM/SIGINT, and exits when its stdin closes (the test that
//! spawned it is gone).

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use stream_listener::core::connection::RedisTarget;
use stream_listener::core::coordinator::CoordinatorConfig;
use stream_listener::core::dataplane::FencingMode;
use stream_listener::core::handler::{Delivery, HandlerError};
use stream_listener::core::member::{EventCallback, Listener, ListenerEvent, ListenerOptions};

fn now_us() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros())
}

fn emit(line: String) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

struct Args {
    url: String,
    stream: String,
    group: String,
    concurrency: u32,
    heartbeat_ms: u64,
    lease_ms: u64,
    rebalance_ms: u64,
    fencing: FencingMode,
    handler_ms: u64,
    batch: usize,
    block_ms: u64,
    instance_id: Option<String>,
}

fn parse_args() -> Result<Args, String> {
    let mut raw = std::env::args().skip(1);
    let url = raw
        .next()
        .ok_or("usage: member_process <redis-url> [options]")?;
    let mut args = Args {
        url,
        stream: "orders".into(),
        group: "billing".into(),
        concurrency: 1,
        heartbeat_ms: 200,
        lease_ms: 1500,
        rebalance_ms: 3000,
        fencing: FencingMode::Strict,
        handler_ms: 0,
        batch: 64,
        block_ms: 500,
        instance_id: None,
    };
    while let Some(flag) = raw.next() {
        let value = raw.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let number = || {
            value
                .parse::<u64>()
                .map_err(|e| format!("{flag} {value}: {e}"))
        };
        match flag.as_str() {
            "--stream" => args.stream = value.clone(),
            "--group" => args.group = value.clone(),
            "--concurrency" => args.concurrency = number()? as u32,
            "--heartbeat-ms" => args.heartbeat_ms = number()?,
            "--lease-ms" => args.lease_ms = number()?,
            "--rebalance-ms" => args.rebalance_ms = number()?,
            "--handler-ms" => args.handler_ms = number()?,
            "--batch" => args.batch = number()? as usize,
            "--block-ms" => args.block_ms = number()?,
            "--instance-id" => args.instance_id = Some(value.clone()),
            "--fencing" => {
                args.fencing = match value.as_str() {
                    "strict" => FencingMode::Strict,
                    "acks" => FencingMode::Acks,
                    other => return Err(format!("--fencing {other}: strict or acks")),
                }
            }
            other => return Err(format!("unknown option {other}")),
        }
    }
    Ok(args)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = match parse_args() {
        Ok(args) => args,
        Err(error) => {
            eprintln!("member_process: {error}");
            std::process::exit(2);
        }
    };
    // Exit when the parent test goes away (its end of our stdin closes).
    std::thread::spawn(|| {
        let mut sink = Vec::new();
        let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
        std::process::exit(0);
    });

    let mut options = ListenerOptions::default();
    options.concurrency = args.concurrency;
    options.coordination = CoordinatorConfig::new(
        Duration::from_millis(args.heartbeat_ms),
        Duration::from_millis(args.lease_ms),
        Duration::from_millis(args.rebalance_ms),
    )
    .expect("valid timings");
    options.fencing = args.fencing;
    options.batch_size = args.batch;
    options.block = Duration::from_millis(args.block_ms);
    options.instance_id = args.instance_id.clone();
    options.events = Some(EventCallback(Arc::new(|event| {
        let at = now_us();
        let line = match event {
            ListenerEvent::Assigned {
                member,
                shard,
                member_epoch,
            } => format!("A {at} {member} {shard} {member_epoch}"),
            ListenerEvent::Revoked {
                member,
                shard,
                member_epoch,
            } => format!("V {at} {member} {shard} {member_epoch}"),
            ListenerEvent::Read {
                member,
                shard,
                count,
                first_id,
            } => format!("R {at} {member} {shard} {count} {first_id}"),
            ListenerEvent::FenceRejected { op, member, shard } => {
                format!("F {at} {member} {shard} {op}")
            }
            other => format!("# {at} {other:?}"),
        };
        emit(line);
    })));

    let handler_time = Duration::from_millis(args.handler_ms);
    let handler = move |delivery: Delivery| async move {
        let n = delivery
            .payload()
            .and_then(|p| std::str::from_utf8(p).ok())
            .and_then(|p| serde_json::from_str::<serde_json::Value>(p).ok())
            .and_then(|v| v.get("n").and_then(serde_json::Value::as_u64))
            .map_or_else(|| "-".to_owned(), |n| n.to_string());
        emit(format!(
            "H {} {} {} {} {} {} {}",
            now_us(),
            delivery.member_id,
            delivery.shard,
            delivery.entry_id,
            delivery.member_epoch,
            delivery.attempt,
            n
        ));
        if !handler_time.is_zero() {
            tokio::time::sleep(handler_time).await;
        }
        emit(format!(
            "D {} {} {} {}",
            now_us(),
            delivery.member_id,
            delivery.shard,
            delivery.entry_id
        ));
        Ok::<(), HandlerError>(())
    };

    let listener = Listener::new(
        RedisTarget::Standalone(args.url.clone()),
        &args.stream,
        &args.group,
        handler,
        options,
    )
    .expect("valid listener options");
    let handle = listener.start().await.expect("listener starts");
    emit(format!("READY {}", handle.member_ids().join(",")));
    if let Err(error) = handle.run_until_signal().await {
        eprintln!("member_process: {error}");
        std::process::exit(1);
    }
    emit(format!("EXIT {}", now_us()));
}
