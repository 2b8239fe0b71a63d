//! Printing a scenario's windows and the summary against the goals.

use crate::measure::*;
use crate::scenario::*;
use crate::*;
use stream_listener_core::model::HeartbeatStatus;

/// The top `n` commands by total time (scripts include the commands they call).
pub(crate) fn print_commands(commands: &[(String, u64, u64)], n: usize) {
    for (name, calls, usec) in commands.iter().take(n) {
        println!(
            "    {name:<12} calls {calls:>7}  usec {usec:>10}  usec/call {:>8.2}",
            *usec as f64 / (*calls).max(1) as f64
        );
    }
}

pub(crate) fn print_window(name: &str, m: &Measured) {
    let full = m.count(|s| !s.fast_path && s.status.is_some());
    let fast = m.count(|s| s.fast_path);
    let retries = m.count(|s| s.status == Some(HeartbeatStatus::Retry));
    let errors = m.count(|s| s.error);
    let conflicts = m.count(|s| s.attempts > 1);
    let fencing = m.count(|s| {
        matches!(
            s.status,
            Some(HeartbeatStatus::UnknownMemberId | HeartbeatStatus::FencedMemberEpoch)
        )
    });
    println!(
        "  {name}: {} requests in {:.1?} ({:.1}/s), p50 {}, p99 {}, max {}, Redis CPU {:.3}% \
         of a core{}",
        m.samples.len(),
        m.wall,
        m.rate(),
        ms(m.percentile(50.0)),
        ms(m.percentile(99.0)),
        ms(m.max()),
        m.cpu() * 100.0,
        if errors > 0 {
            format!(", {errors} ERRORS")
        } else {
            String::new()
        }
    );
    if m.samples.iter().any(|s| s.status.is_some()) {
        println!(
            "    fast path {fast} ({:.1}%), full transitions {full}, CAS conflicts {conflicts}, \
             RETRY {retries}, UNKNOWN_MEMBER_ID / FENCED_MEMBER_EPOCH {fencing}, \
             group revision +{}",
            100.0 * fast as f64 / m.samples.len().max(1) as f64,
            m.revision_delta
                .map_or_else(|| "?".into(), |d| d.to_string())
        );
    }
}

pub(crate) fn summary(reports: &[Report], options: &Options) {
    println!(
        "\n== summary (steady window {:?}, baselines {:?} each, idle {:?})",
        options.window, options.baseline_window, options.idle
    );
    println!(
        "| scenario | heartbeats/s | fast-path share | full transitions in window | p50 | p99 | \
         RETRY | Redis CPU (% of a core) | p50 / PING, / HGET+ZADD | p99 / PING, / HGET+ZADD | \
         CPU / PING, / HGET+ZADD | CPU above idle / PING's, / HGET+ZADD's | goals met? |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for r in reports {
        let Some(s) = &r.steady else {
            println!(
                "| {} ({} members x {} shards) | did not converge in {:.0?}: not measured |",
                r.scenario.name, r.scenario.members, r.scenario.shards, r.convergence
            );
            continue;
        };
        let fast = s.count(|x| x.fast_path);
        let full = s.count(|x| !x.fast_path && x.status.is_some());
        let retries = s.count(|x| x.status == Some(HeartbeatStatus::Retry));
        let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
        let lat = |m: &Measured, p: f64| m.percentile(p).as_secs_f64();
        let net = |m: &Measured| m.cpu() - r.idle.cpu();
        let p99 = s.percentile(99.0);
        let goals = format!(
            "CPU {}, p99 {}, no RETRY {}",
            yes_no(s.cpu() < CPU_GOAL),
            yes_no(p99 < P99_GOAL),
            yes_no(retries == 0)
        );
        println!(
            "| {} ({} members x {} shards) | {:.1} | {:.1}% | {full} | {} | {} | {retries} | \
             {:.2}% (idle {:.2}%) | {:.2}, {:.2} | {:.2}, {:.2} | {:.2}, {:.2} | {:.2}, {:.2} | \
             {goals} |",
            r.scenario.name,
            r.scenario.members,
            r.scenario.shards,
            s.rate(),
            100.0 * fast as f64 / s.samples.len().max(1) as f64,
            ms(s.percentile(50.0)),
            ms(p99),
            s.cpu() * 100.0,
            r.idle.cpu() * 100.0,
            ratio(lat(s, 50.0), lat(&r.ping, 50.0)),
            ratio(lat(s, 50.0), lat(&r.renewal, 50.0)),
            ratio(lat(s, 99.0), lat(&r.ping, 99.0)),
            ratio(lat(s, 99.0), lat(&r.renewal, 99.0)),
            ratio(s.cpu(), r.ping.cpu()),
            ratio(s.cpu(), r.renewal.cpu()),
            ratio(net(s), net(&r.ping)),
            ratio(net(s), net(&r.renewal)),
        );
    }
    println!("\nbaselines:");
    println!("| scenario | baseline | requests/s | p50 | p99 | Redis CPU (% of a core) |");
    println!("| --- | --- | --- | --- | --- | --- |");
    for r in reports {
        for (name, m) in [
            ("idle", &r.idle),
            ("PING", &r.ping),
            ("HGET + ZADD XX", &r.renewal),
        ] {
            println!(
                "| {} | {name} | {:.1} | {} | {} | {:.2}% |",
                r.scenario.name,
                m.rate(),
                ms(m.percentile(50.0)),
                ms(m.percentile(99.0)),
                m.cpu() * 100.0
            );
        }
    }
    for r in reports {
        println!(
            "scenario {}: lease TTL {:?}, convergence {} {:.1?}",
            r.scenario.name,
            r.scenario.config().member_lease_ttl,
            if r.steady.is_some() {
                "took"
            } else {
                "FAILED after"
            },
            r.convergence
        );
    }
}

pub(crate) fn yes_no(ok: bool) -> &'static str {
    if ok { "yes" } else { "NO" }
}
