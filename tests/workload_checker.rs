//! Self-tests of the fault checker (`stream_listener::testing::workload::check`) on hand-written
//! logs: each violation is found, and clean histories pass.

use stream_listener::testing::workload::*;

fn handled(member: &str, shard: u32, key: &str, seq: u64, start: u64, ok: bool) -> LogLine {
    LogLine::Handled(Handled {
        call: HandlerCall {
            member: member.into(),
            shard,
            entry_id: format!("{start}-0"),
            member_epoch: 1,
            attempt: 1,
        },
        key: Some(key.into()),
        seq: Some(seq),
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

#[test]
fn without_key_order_an_out_of_order_first_handling_passes_but_a_loss_does_not() {
    // `ordering = "none"`: seq 1 first handled before seq 0 is allowed.
    let unordered = log(
        "p0",
        vec![
            assigned("a", 0, 1),
            handled("a", 0, "key-0", 1, 10, true),
            handled("a", 0, "key-0", 0, 11, true),
        ],
    );
    check_without_key_order(std::slice::from_ref(&unordered), TWO, &[]).assert_ok();
    assert!(!check(&[unordered], TWO, &[]).ok(), "check still judges it");
    let lost = log(
        "p0",
        vec![assigned("a", 0, 1), handled("a", 0, "key-0", 1, 10, true)],
    );
    let report = check_without_key_order(&[lost], TWO, &[]);
    assert_eq!(report.violations.len(), 1, "{:?}", report.violations);
    assert!(report.violations[0].contains("lost"));
}

/// The allowance of a failover test: a message listed in `may_be_lost` (no replica had
/// acknowledged it) may be missing and is counted; any other missing message is still a loss.
#[test]
fn only_messages_allowed_as_unreplicated_may_be_lost() {
    let three = Expected { keys: 1, count: 3 };
    let p0 = log(
        "p0",
        vec![
            assigned("a", 0, 10),
            read("a", 0, 20),
            handled("a", 0, "key-0", 0, 21, true),
        ],
    );
    let allowed: std::collections::BTreeSet<(String, u64)> =
        [("key-0".to_owned(), 2)].into_iter().collect();
    let report = check_allowing_unreplicated_loss(std::slice::from_ref(&p0), three, &[], &allowed);
    assert_eq!(report.lost_unreplicated, 1);
    assert_eq!(report.handled_ok, 1);
    assert_eq!(report.violations.len(), 1, "{:?}", report.violations);
    assert!(
        report.violations[0].contains("1 of 3") && report.violations[0].contains("key-0#1"),
        "{:?}",
        report.violations
    );
    let both: std::collections::BTreeSet<(String, u64)> =
        [("key-0".to_owned(), 1), ("key-0".to_owned(), 2)]
            .into_iter()
            .collect();
    let report = check_allowing_unreplicated_loss(&[p0], three, &[], &both);
    assert!(report.ok(), "{:?}", report.violations);
    assert_eq!(report.lost_unreplicated, 2);
    assert_eq!(check(&[log("p1", vec![])], three, &[]).lost_unreplicated, 0);
}
