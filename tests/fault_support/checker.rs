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
//! Lines that are not valid JSON of one of the five event kinds are violations (a torn line
//! would show up here).

#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;

use serde::Deserialize;

/// A re-timed read must be logged within this long after the `SIGCONT`, in µs.
pub const CONT_GRACE_US: u64 = 250_000;

/// One line of a `workload consume` log.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(tag = "event", rename_all = "camelCase")]
pub enum LogLine {
    /// One handler call.
    Handled(Handled),
    /// A shard assigned to a member.
    Assigned(Ownership),
    /// A shard given up by a member.
    Revoked(Ownership),
    /// A fenced read that returned entries.
    Read(Read),
    /// A read, ack or claim refused by the fence.
    FenceRejected(FenceRejected),
}

/// `{"event":"handled",...}`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Handled {
    pub member: String,
    pub shard: u32,
    pub entry_id: String,
    /// `None` for a payload that did not decode.
    pub key: Option<String>,
    pub seq: Option<u64>,
    pub attempt: u32,
    pub member_epoch: i64,
    pub start_us: u64,
    pub end_us: u64,
    pub ok: bool,
}

/// `{"event":"assigned"|"revoked",...}`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Ownership {
    pub member: String,
    pub shard: u32,
    pub member_epoch: i64,
    pub ts_us: u64,
}

/// `{"event":"read",...}`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Read {
    pub member: String,
    pub shard: u32,
    pub count: u64,
    pub first_id: String,
    pub ts_us: u64,
}

/// `{"event":"fenceRejected",...}`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FenceRejected {
    pub op: String,
    pub member: String,
    pub shard: u32,
    pub ts_us: u64,
}

impl LogLine {
    /// Parses one line.
    pub fn parse(line: &str) -> Result<LogLine, String> {
        serde_json::from_str(line).map_err(|e| format!("{e}: {line:?}"))
    }

    /// The member the line is about.
    pub fn member(&self) -> &str {
        match self {
            LogLine::Handled(h) => &h.member,
            LogLine::Assigned(o) | LogLine::Revoked(o) => &o.member,
            LogLine::Read(r) => &r.member,
            LogLine::FenceRejected(f) => &f.member,
        }
    }

    /// The line's time (`startUs` for a handler call).
    pub fn ts_us(&self) -> u64 {
        match self {
            LogLine::Handled(h) => h.start_us,
            LogLine::Assigned(o) | LogLine::Revoked(o) => o.ts_us,
            LogLine::Read(r) => r.ts_us,
            LogLine::FenceRejected(f) => f.ts_us,
        }
    }
}

/// The log of one consumer process, lines in the order it wrote them.
#[derive(Debug, Clone, Default)]
pub struct ProcessLog {
    /// A name for messages (`consumer-1`).
    pub name: String,
    pub lines: Vec<LogLine>,
    /// Lines that did not parse.
    pub bad_lines: Vec<String>,
}

impl ProcessLog {
    /// Parses the raw lines of one process.
    pub fn parse(name: &str, raw: &str) -> ProcessLog {
        let mut log = ProcessLog {
            name: name.to_owned(),
            ..ProcessLog::default()
        };
        for line in raw.lines().filter(|l| !l.trim().is_empty()) {
            match LogLine::parse(line) {
                Ok(parsed) => log.lines.push(parsed),
                Err(error) => log.bad_lines.push(error),
            }
        }
        log
    }
}

/// What `workload produce --keys K --count N` published: message `n` is `(key-<n mod K>, n div K)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expected {
    pub keys: u64,
    pub count: u64,
}

impl Expected {
    pub fn key(i: u64) -> String {
        format!("key-{i}")
    }

    /// Number of messages of key `i`.
    pub fn seqs_of(&self, i: u64) -> u64 {
        self.count / self.keys + u64::from(i < self.count % self.keys)
    }

    /// Every produced `(key, seq)`.
    pub fn messages(&self) -> impl Iterator<Item = (String, u64)> + '_ {
        (0..self.count).map(|n| (Expected::key(n % self.keys), n / self.keys))
    }
}

/// A process that was stopped (`SIGSTOP`) at `stopped_us` and continued (`SIGCONT`) at
/// `continued_us` (wall-clock µs taken by the test just before sending each signal).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stop {
    /// Index of the process in the logs given to [`check`].
    pub process: usize,
    pub stopped_us: u64,
    pub continued_us: u64,
}

/// One ownership interval with its reads (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interval {
    pub process: usize,
    pub member: String,
    pub shard: u32,
    pub assigned_us: u64,
    pub revoked_us: Option<u64>,
    /// Judged read times, in log order.
    pub reads: Vec<u64>,
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
    pub processes: usize,
    pub handler_calls: usize,
    pub failed_calls: usize,
    /// Distinct produced messages with an `ok` handled line.
    pub handled_ok: usize,
    /// `ok` handled lines beyond the first per message (at-least-once duplicates).
    pub duplicates: usize,
    pub reads: usize,
    pub late_reads: usize,
    pub retimed_reads: usize,
    /// Fence rejections by op.
    pub fence_rejections: BTreeMap<String, usize>,
    pub intervals: Vec<Interval>,
    pub violations: Vec<String>,
}

impl Report {
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
    check_messages(logs, expected, &mut report);
    check_reads(logs, stops, &mut report);
    report
}

/// (a) no loss and (b) per-key order of first handling.
fn check_messages(logs: &[ProcessLog], expected: Expected, report: &mut Report) {
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
                    log.name, h.shard, h.entry_id
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
                LogLine::Handled(_) => {}
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

/// Checker self-tests on hand-written logs: each violation is found, and clean histories pass.
#[cfg(test)]
mod tests {
    use super::*;

    fn handled(member: &str, shard: u32, key: &str, seq: u64, start: u64, ok: bool) -> LogLine {
        LogLine::Handled(Handled {
            member: member.into(),
            shard,
            entry_id: format!("{start}-0"),
            key: Some(key.into()),
            seq: Some(seq),
            attempt: 1,
            member_epoch: 1,
            start_us: start,
            end_us: start + 1,
            ok,
        })
    }

    fn assigned(member: &str, shard: u32, ts: u64) -> LogLine {
        LogLine::Assigned(Ownership {
            member: member.into(),
            shard,
            member_epoch: 1,
            ts_us: ts,
        })
    }

    fn revoked(member: &str, shard: u32, ts: u64) -> LogLine {
        LogLine::Revoked(Ownership {
            member: member.into(),
            shard,
            member_epoch: 1,
            ts_us: ts,
        })
    }

    fn read(member: &str, shard: u32, ts: u64) -> LogLine {
        LogLine::Read(Read {
            member: member.into(),
            shard,
            count: 1,
            first_id: format!("{ts}-0"),
            ts_us: ts,
        })
    }

    fn log(name: &str, lines: Vec<LogLine>) -> ProcessLog {
        ProcessLog {
            name: name.into(),
            lines,
            bad_lines: Vec::new(),
        }
    }

    const TWO: Expected = Expected { keys: 1, count: 2 };

    #[test]
    fn parses_the_five_event_kinds_and_rejects_torn_lines() {
        let raw = concat!(
            r#"{"event":"handled","member":"a-m0","shard":3,"entryId":"1-0","key":"key-0","seq":0,"attempt":1,"memberEpoch":2,"startUs":10,"endUs":11,"ok":true}"#,
            "\n",
            r#"{"event":"assigned","member":"a-m0","shard":3,"memberEpoch":2,"tsUs":5}"#,
            "\n",
            r#"{"event":"revoked","member":"a-m0","shard":3,"memberEpoch":2,"tsUs":20}"#,
            "\n",
            r#"{"event":"read","member":"a-m0","shard":3,"count":4,"firstId":"1-0","tsUs":9}"#,
            "\n",
            r#"{"event":"fenceRejected","op":"ack","member":"a-m0","shard":3,"tsUs":21}"#,
            "\n",
            r#"{"event":"handled","member":"a-m0","shard":3,"entryId":"2-0","key":null,"seq":null,"attempt":1,"memberEpoch":2,"startUs":12,"endUs":13,"ok":false}"#,
            "\n",
            r#"{"event":"read","member":"a-m0","sha"#,
            "\n"
        );
        let log = ProcessLog::parse("p", raw);
        assert_eq!(log.lines.len(), 6, "{:?}", log.bad_lines);
        assert_eq!(log.bad_lines.len(), 1);
        assert!(matches!(&log.lines[4], LogLine::FenceRejected(f) if f.op == "ack"));
        assert!(matches!(&log.lines[5], LogLine::Handled(h) if h.key.is_none() && !h.ok));
        let report = check(&[log], Expected { keys: 1, count: 1 }, &[]);
        assert_eq!(report.violations.len(), 2, "{:?}", report.violations); // torn + undecodable
    }

    #[test]
    fn expected_messages_follow_the_producer_numbering() {
        let e = Expected { keys: 3, count: 7 };
        let messages: Vec<(String, u64)> = e.messages().collect();
        assert_eq!(messages[0], ("key-0".into(), 0));
        assert_eq!(messages[4], ("key-1".into(), 1));
        assert_eq!(messages[6], ("key-0".into(), 2));
        assert_eq!((e.seqs_of(0), e.seqs_of(1), e.seqs_of(2)), (3, 2, 2));
    }

    #[test]
    fn a_clean_handover_passes() {
        let p0 = log(
            "p0",
            vec![
                assigned("a", 0, 10),
                read("a", 0, 20),
                handled("a", 0, "key-0", 0, 21, false),
                handled("a", 0, "key-0", 0, 22, true),
                revoked("a", 0, 30),
            ],
        );
        let p1 = log(
            "p1",
            vec![
                assigned("b", 0, 35),
                read("b", 0, 40),
                handled("b", 0, "key-0", 0, 41, true),
                handled("b", 0, "key-0", 1, 42, true),
            ],
        );
        let report = check(&[p0, p1], TWO, &[]);
        report.assert_ok();
        assert_eq!(
            (report.handled_ok, report.duplicates, report.failed_calls),
            (2, 1, 1)
        );
    }

    #[test]
    fn a_lost_message_is_found() {
        let p0 = log(
            "p0",
            vec![
                assigned("a", 0, 10),
                read("a", 0, 20),
                handled("a", 0, "key-0", 0, 21, true),
                handled("a", 0, "key-0", 1, 22, false),
            ],
        );
        let report = check(&[p0], TWO, &[]);
        assert_eq!(report.violations.len(), 1);
        assert!(
            report.violations[0].contains("key-0#1"),
            "{:?}",
            report.violations
        );
    }

    #[test]
    fn first_handling_out_of_key_order_is_found_but_a_late_duplicate_is_not() {
        // seq 1 first handled before seq 0: broken.
        let broken = log(
            "p0",
            vec![
                assigned("a", 0, 1),
                handled("a", 0, "key-0", 1, 10, true),
                handled("a", 0, "key-0", 0, 11, true),
            ],
        );
        let report = check(&[broken], TWO, &[]);
        assert_eq!(report.violations.len(), 1, "{:?}", report.violations);
        assert!(report.violations[0].contains("per-key order"));
        // seq 0 again after seq 1 (a redelivery): fine.
        let duplicate = log(
            "p0",
            vec![
                handled("a", 0, "key-0", 0, 10, true),
                handled("a", 0, "key-0", 1, 11, true),
                handled("a", 0, "key-0", 0, 12, true),
            ],
        );
        check(&[duplicate], TWO, &[]).assert_ok();
    }

    #[test]
    fn overlapping_reads_of_two_members_are_found() {
        let p0 = log(
            "p0",
            vec![assigned("a", 0, 10), read("a", 0, 20), read("a", 0, 50)],
        );
        let p1 = log("p1", vec![assigned("b", 0, 30), read("b", 0, 40)]);
        let report = check(&[p0, p1], Expected { keys: 1, count: 0 }, &[]);
        assert_eq!(report.violations.len(), 1, "{:?}", report.violations);
        assert!(report.violations[0].contains("read by two members at once"));
    }

    #[test]
    fn overlapping_ownership_without_overlapping_reads_passes() {
        // The zombie's interval stays open (it logs its revocation only after SIGCONT), but it
        // does not read while the new owner does.
        let p0 = log(
            "p0",
            vec![assigned("a", 0, 10), read("a", 0, 20), revoked("a", 0, 100)],
        );
        let p1 = log(
            "p1",
            vec![assigned("b", 0, 50), read("b", 0, 60), read("b", 0, 120)],
        );
        let report = check(&[p0, p1], Expected { keys: 1, count: 0 }, &[]);
        report.assert_ok();
    }

    #[test]
    fn a_read_after_the_revocation_belongs_to_the_interval_and_is_judged() {
        let p0 = log(
            "p0",
            vec![
                assigned("a", 0, 10),
                read("a", 0, 20),
                revoked("a", 0, 30),
                read("a", 0, 31),
            ],
        );
        let early = log("p1", vec![assigned("b", 0, 25), read("b", 0, 30)]);
        let report = check(&[p0.clone(), early], Expected { keys: 1, count: 0 }, &[]);
        assert_eq!(report.late_reads, 1);
        assert_eq!(report.violations.len(), 1, "{:?}", report.violations);
        let later = log("p1", vec![assigned("b", 0, 25), read("b", 0, 40)]);
        check(&[p0, later], Expected { keys: 1, count: 0 }, &[]).assert_ok();
    }

    #[test]
    fn a_read_without_assignment_is_found() {
        let p0 = log("p0", vec![read("a", 0, 20)]);
        let report = check(&[p0], Expected { keys: 1, count: 0 }, &[]);
        assert_eq!(report.violations.len(), 1, "{:?}", report.violations);
    }

    #[test]
    fn one_read_logged_right_after_sigcont_is_judged_at_the_stop() {
        // a was stopped at 100 and continued at 1000; its read of shard 0 in flight at the stop
        // is logged at 1001. b read the shard at 500 while a was stopped.
        let p0 = log(
            "p0",
            vec![
                assigned("a", 0, 10),
                read("a", 0, 20),
                read("a", 0, 1001),
                revoked("a", 0, 1002),
            ],
        );
        let p1 = log("p1", vec![assigned("b", 0, 400), read("b", 0, 500)]);
        let stop = Stop {
            process: 0,
            stopped_us: 100,
            continued_us: 1000,
        };
        let report = check(
            &[p0.clone(), p1.clone()],
            Expected { keys: 1, count: 0 },
            &[stop],
        );
        report.assert_ok();
        assert_eq!(report.retimed_reads, 1);
        // Without the stop, the same history is a violation.
        assert!(
            !check(
                &[p0.clone(), p1.clone()],
                Expected { keys: 1, count: 0 },
                &[]
            )
            .ok()
        );
        // A second read after SIGCONT is judged at its own time.
        let mut p0_two = p0;
        p0_two.lines.insert(3, read("a", 0, 1003));
        assert!(!check(&[p0_two, p1], Expected { keys: 1, count: 0 }, &[stop]).ok());
    }

    #[test]
    fn a_read_of_a_shard_assigned_after_sigcont_is_not_retimed() {
        // a's member a2 is assigned shard 0 right after SIGCONT (1000) and reads it at 1001,
        // within the grace: that read cannot have been in flight at the stop (100).
        let p0 = log("p0", vec![assigned("a2", 0, 1000), read("a2", 0, 1001)]);
        let p1 = log(
            "p1",
            vec![
                assigned("b", 0, 400),
                read("b", 0, 500),
                revoked("b", 0, 990),
            ],
        );
        let stop = Stop {
            process: 0,
            stopped_us: 100,
            continued_us: 1000,
        };
        let report = check(&[p0, p1], Expected { keys: 1, count: 0 }, &[stop]);
        report.assert_ok();
        assert_eq!(report.retimed_reads, 0);
    }
}
