//! The checker of the fault-injection suite: reads the JSON lines that `workload consume`
//! processes wrote (examples/workload.rs) and verifies the three guarantees a fault must
//! not break.
//!
//! **(a) No message lost.** Every produced `(key, seq)` has at least one `handled` line with
//! `ok: true`, in any process. (`workload produce --keys K --count N` publishes message `n` as
//! key `key-<n mod K>`, seq `n div K`; see [`Expected`].) Handled lines of messages that were
//! never produced are reported as violations too.
//!
//! **(b) Per-key order in first-time handling.** A message's *first handling* is the earliest
//! `startUs` of all its `handled` lines (any process, any attempt, ok or not). For every key,
//! ordering its messages by first handling must give `seq` 0, 1, 2...: a message may be handled
//! again later (at-least-once), but it is never handled for the first time after a later message
//! of its key (equal times are accepted).
//!
//! **(c) No shard read by two members at once**, judged on `read` events only (a process that
//! is stopped cannot log, so its handler intervals may span the stop; reads are the operations
//! the fences guard):
//! - An *ownership interval* of member `M` (in process `P`) on shard `s` starts at an `assigned`
//!   line of `M` for `s` and ends at `M`'s next `revoked` line for `s`. A read logged after that
//!   `revoked` but before `M`'s next `assigned` of `s` still belongs to the interval: a read that
//!   was in flight when the shard was taken away is logged after the revocation (it is counted as
//!   a *late read*). A read of `s` by `M` before any `assigned` of `s` to `M` is a violation.
//! - The *read span* of an interval with reads is `[earliest read, latest read]`.
//! - Violation: two intervals of different members (or of the same member id in different
//!   processes) on the same shard whose read spans intersect (closed intervals). So between the
//!   last read of one owner and the first read of the next, ownership changed hands cleanly.
//! - A read's time is its `tsUs`, taken when the read's reply was processed: at or after the read
//!   ran in Redis. One exception: a process cannot log while it is stopped (`SIGSTOP`), so a read
//!   whose reply was already received or on its way when the process was stopped is logged only
//!   after `SIGCONT`. For each [`Stop`] given to the checker, the first read of each (member,
//!   shard) of that process logged within [`CONT_GRACE_US`] after the `SIGCONT`, in an interval
//!   that was already open at the `SIGSTOP`, is judged at the `SIGSTOP` instant instead (a shard
//!   task has at most one read in flight, so at most one read per shard is re-timed; any later
//!   read, and any read of an interval assigned after the stop, is judged at its own time).
//!   Re-timed reads are counted in the report.
//!
//! (b) holds with `ordering = "shard"` and `"key"` (docs/design.md §14.3); for `"none"`,
//! [`check_without_key_order`] judges (a) and (c) only.
//!
//! Lines that are not valid JSON of one of the five event kinds are violations (a torn line
//! would show up here).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;

use super::log::{Expected, LogLine, ProcessLog};

/// A re-timed read must be logged within this long after the `SIGCONT`, in µs.
pub const CONT_GRACE_US: u64 = 250_000;

/// A process that was stopped (`SIGSTOP`) at `stopped_us` and continued (`SIGCONT`) at
/// `continued_us` (wall-clock µs taken by the test just before sending each signal).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stop {
    /// Index of the process in the logs given to [`check`].
    pub process: usize,
    /// Just before the `SIGSTOP`, µs since the Unix epoch.
    pub stopped_us: u64,
    /// Just before the `SIGCONT`, µs since the Unix epoch.
    pub continued_us: u64,
}

/// One ownership interval with its reads (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interval {
    /// Index of the process in the logs given to [`check`].
    pub process: usize,
    /// The owning member.
    pub member: String,
    /// The shard owned.
    pub shard: u32,
    /// Time of the `assigned` line.
    pub assigned_us: u64,
    /// Time of the next `revoked` line, if any.
    pub revoked_us: Option<u64>,
    /// Judged read times, in log order.
    pub reads: Vec<u64>,
    /// Reads logged after the interval's `revoked` line.
    pub late_reads: usize,
}

impl Interval {
    /// `[earliest read, latest read]`, when it has reads.
    pub fn read_span(&self) -> Option<(u64, u64)> {
        let lo = self.reads.iter().min()?;
        let hi = self.reads.iter().max()?;
        Some((*lo, *hi))
    }
}

/// What the checker found.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Logs checked.
    pub processes: usize,
    /// `handled` lines.
    pub handler_calls: usize,
    /// `handled` lines with `ok: false`.
    pub failed_calls: usize,
    /// Distinct produced messages with an `ok` handled line.
    pub handled_ok: usize,
    /// `ok` handled lines beyond the first per message (at-least-once duplicates).
    pub duplicates: usize,
    /// `read` lines.
    pub reads: usize,
    /// Reads logged after their interval's `revoked` line.
    pub late_reads: usize,
    /// Reads judged at a `SIGSTOP` instant instead of their own time.
    pub retimed_reads: usize,
    /// Fence rejections by op.
    pub fence_rejections: BTreeMap<String, usize>,
    /// Every ownership interval found.
    pub intervals: Vec<Interval>,
    /// What broke a guarantee, one sentence each.
    pub violations: Vec<String>,
    /// Messages without an ok handled line that were allowed to be lost: only from
    /// [`check_allowing_unreplicated_loss`], those of its `may_be_lost`.
    pub lost_unreplicated: usize,
}

impl Report {
    /// No violations.
    pub fn ok(&self) -> bool {
        self.violations.is_empty()
    }

    /// One paragraph for test output.
    pub fn summary(&self) -> String {
        format!(
            "{} processes, {} handler calls ({} failed), {} messages handled ok, {} duplicates, \
             {} reads ({} late, {} re-timed after SIGCONT), {} ownership intervals with reads, \
             fence rejections {:?}, {} violations",
            self.processes,
            self.handler_calls,
            self.failed_calls,
            self.handled_ok,
            self.duplicates,
            self.reads,
            self.late_reads,
            self.retimed_reads,
            self.intervals
                .iter()
                .filter(|i| !i.reads.is_empty())
                .count(),
            self.fence_rejections,
            self.violations.len()
        )
    }

    /// Panics with the violations (at most 30) and the read timeline of the shards involved.
    #[track_caller]
    pub fn assert_ok(&self) {
        if self.ok() {
            return;
        }
        let mut text = format!("checker found violations: {}\n", self.summary());
        for v in self.violations.iter().take(30) {
            let _ = writeln!(text, "  - {v}");
        }
        if self.violations.len() > 30 {
            let _ = writeln!(text, "  ... {} more", self.violations.len() - 30);
        }
        let _ = writeln!(text, "ownership intervals with reads:");
        let mut intervals: Vec<&Interval> = self
            .intervals
            .iter()
            .filter(|i| !i.reads.is_empty())
            .collect();
        intervals.sort_by_key(|i| (i.shard, i.read_span()));
        for i in intervals {
            let (lo, hi) = i.read_span().unwrap_or_default();
            let _ = writeln!(
                text,
                "  shard {} p{} {} assigned {} revoked {:?} reads {} [{lo}, {hi}] late {}",
                i.shard,
                i.process,
                i.member,
                i.assigned_us,
                i.revoked_us,
                i.reads.len(),
                i.late_reads
            );
        }
        panic!("{text}");
    }
}

/// Runs every check on the logs of all consumer processes of one run.
pub fn check(logs: &[ProcessLog], expected: Expected, stops: &[Stop]) -> Report {
    check_messages_and_reads(logs, expected, stops, true, &BTreeSet::new())
}

/// As [`check`], except that the messages in `may_be_lost` may have no ok handled line: in a
/// failover test, the messages the promoted replica never received (no shard stream holds them
/// after the failover; the dead master had acknowledged them), which asynchronous replication
/// loses. Each of them that is lost is counted in [`Report::lost_unreplicated`] instead of being
/// a violation; every other message, per-key order and reads are judged as by [`check`].
pub fn check_allowing_unreplicated_loss(
    logs: &[ProcessLog],
    expected: Expected,
    stops: &[Stop],
    may_be_lost: &BTreeSet<(String, u64)>,
) -> Report {
    check_messages_and_reads(logs, expected, stops, true, may_be_lost)
}

/// As [`check`] without (b), per-key order: for consumers run with `ordering = "none"`
/// (docs/design.md §14.3), which promises no order. (a) and (c) are judged as by [`check`].
pub fn check_without_key_order(logs: &[ProcessLog], expected: Expected, stops: &[Stop]) -> Report {
    check_messages_and_reads(logs, expected, stops, false, &BTreeSet::new())
}

fn check_messages_and_reads(
    logs: &[ProcessLog],
    expected: Expected,
    stops: &[Stop],
    key_order: bool,
    may_be_lost: &BTreeSet<(String, u64)>,
) -> Report {
    let mut report = Report {
        processes: logs.len(),
        ..Report::default()
    };
    for log in logs {
        for bad in &log.bad_lines {
            report.violations.push(format!(
                "{}: line is not a valid log event: {bad}",
                log.name
            ));
        }
    }
    check_messages(logs, expected, key_order, may_be_lost, &mut report);
    check_reads(logs, stops, &mut report);
    report
}

/// (a) no loss and (b) per-key order of first handling.
fn check_messages(
    logs: &[ProcessLog],
    expected: Expected,
    key_order: bool,
    may_be_lost: &BTreeSet<(String, u64)>,
    report: &mut Report,
) {
    // (key, seq) -> (first start, ok lines)
    let mut seen: HashMap<(String, u64), (u64, usize)> = HashMap::new();
    for log in logs {
        for line in &log.lines {
            let LogLine::Handled(h) = line else { continue };
            report.handler_calls += 1;
            if !h.ok {
                report.failed_calls += 1;
            }
            let (Some(key), Some(seq)) = (&h.key, h.seq) else {
                report.violations.push(format!(
                    "{}: handled an entry whose payload did not decode: shard {} entry {}",
                    log.name, h.call.shard, h.call.entry_id
                ));
                continue;
            };
            let entry = seen.entry((key.clone(), seq)).or_insert((u64::MAX, 0));
            entry.0 = entry.0.min(h.start_us);
            entry.1 += usize::from(h.ok);
        }
    }
    let produced: BTreeSet<(String, u64)> = expected.messages().collect();
    let mut missing = Vec::new();
    for message in &produced {
        match seen.get(message) {
            Some((_, ok)) if *ok > 0 => {
                report.handled_ok += 1;
                report.duplicates += ok - 1;
            }
            _ if may_be_lost.contains(message) => report.lost_unreplicated += 1,
            _ => missing.push(message),
        }
    }
    if !missing.is_empty() {
        let sample: Vec<String> = missing
            .iter()
            .take(10)
            .map(|(k, s)| format!("{k}#{s}"))
            .collect();
        report.violations.push(format!(
            "{} of {} produced messages have no ok handled line (lost), e.g. {}",
            missing.len(),
            produced.len(),
            sample.join(", ")
        ));
    }
    let unexpected: Vec<String> = seen
        .keys()
        .filter(|m| !produced.contains(*m))
        .take(10)
        .map(|(k, s)| format!("{k}#{s}"))
        .collect();
    if !unexpected.is_empty() {
        report.violations.push(format!(
            "handled messages that were never produced, e.g. {}",
            unexpected.join(", ")
        ));
    }
    // (b) per key, first handling in seq order.
    if !key_order {
        return;
    }
    let mut per_key: BTreeMap<&str, Vec<(u64, u64)>> = BTreeMap::new();
    for ((key, seq), (first, _)) in &seen {
        per_key.entry(key).or_default().push((*seq, *first));
    }
    for (key, mut firsts) in per_key {
        firsts.sort();
        for pair in firsts.windows(2) {
            let ((seq_a, first_a), (seq_b, first_b)) = (pair[0], pair[1]);
            if first_b < first_a {
                report.violations.push(format!(
                    "key {key}: seq {seq_b} was first handled at {first_b}, before seq {seq_a} \
                     (first handled at {first_a}): per-key order broken"
                ));
            }
        }
    }
}

/// (c) no shard read by two members at once.
fn check_reads(logs: &[ProcessLog], stops: &[Stop], report: &mut Report) {
    let mut intervals: Vec<Interval> = Vec::new();
    for (process, log) in logs.iter().enumerate() {
        let stops_of: Vec<&Stop> = stops.iter().filter(|s| s.process == process).collect();
        // (member, shard) -> index of its current interval in `intervals`.
        let mut current: HashMap<(&str, u32), usize> = HashMap::new();
        // (stop index, member, shard) already re-timed.
        let mut retimed: BTreeSet<(usize, &str, u32)> = BTreeSet::new();
        for line in &log.lines {
            match line {
                LogLine::Assigned(o) => {
                    intervals.push(Interval {
                        process,
                        member: o.member.clone(),
                        shard: o.shard,
                        assigned_us: o.ts_us,
                        revoked_us: None,
                        reads: Vec::new(),
                        late_reads: 0,
                    });
                    current.insert((&o.member, o.shard), intervals.len() - 1);
                }
                LogLine::Revoked(o) => match current.get(&(o.member.as_str(), o.shard)) {
                    Some(&i) if intervals[i].revoked_us.is_none() => {
                        intervals[i].revoked_us = Some(o.ts_us);
                    }
                    _ => report.violations.push(format!(
                        "{}: {} revoked shard {} at {} without owning it",
                        log.name, o.member, o.shard, o.ts_us
                    )),
                },
                LogLine::Read(r) => {
                    report.reads += 1;
                    let Some(&i) = current.get(&(r.member.as_str(), r.shard)) else {
                        report.violations.push(format!(
                            "{}: {} read shard {} at {} (first id {}) before it was ever assigned it",
                            log.name, r.member, r.shard, r.ts_us, r.first_id
                        ));
                        continue;
                    };
                    let mut at = r.ts_us;
                    for (k, stop) in stops_of.iter().enumerate() {
                        // Only a read of an interval that was open at the stop can have been in
                        // flight then.
                        let in_grace = intervals[i].assigned_us <= stop.stopped_us
                            && r.ts_us >= stop.continued_us
                            && r.ts_us <= stop.continued_us + CONT_GRACE_US;
                        if in_grace && retimed.insert((k, r.member.as_str(), r.shard)) {
                            at = stop.stopped_us;
                            report.retimed_reads += 1;
                        }
                    }
                    let interval = &mut intervals[i];
                    if interval.revoked_us.is_some_and(|revoked| r.ts_us > revoked) {
                        interval.late_reads += 1;
                        report.late_reads += 1;
                    }
                    interval.reads.push(at);
                }
                LogLine::FenceRejected(f) => {
                    *report.fence_rejections.entry(f.op.clone()).or_default() += 1;
                }
                LogLine::Handled(_)
                | LogLine::Handling(_)
                | LogLine::Ready(_)
                | LogLine::EntriesLost(_)
                | LogLine::Hook(_) => {}
            }
        }
    }
    // Per shard, read spans of different owners must not intersect.
    let mut by_shard: BTreeMap<u32, Vec<&Interval>> = BTreeMap::new();
    for interval in intervals.iter().filter(|i| !i.reads.is_empty()) {
        by_shard.entry(interval.shard).or_default().push(interval);
    }
    for (shard, list) in &by_shard {
        for (x, a) in list.iter().enumerate() {
            for b in &list[x + 1..] {
                if a.process == b.process && a.member == b.member {
                    continue;
                }
                let (Some((a_lo, a_hi)), Some((b_lo, b_hi))) = (a.read_span(), b.read_span())
                else {
                    continue;
                };
                if a_lo <= b_hi && b_lo <= a_hi {
                    report.violations.push(format!(
                        "shard {shard} read by two members at once: {} (p{}, assigned {}) read it \
                         during [{a_lo}, {a_hi}] and {} (p{}, assigned {}) during [{b_lo}, {b_hi}]",
                        a.member, a.process, a.assigned_us, b.member, b.process, b.assigned_us
                    ));
                }
            }
        }
    }
    report.intervals = intervals;
}
