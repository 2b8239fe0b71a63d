//! A batch of heartbeats at one instant (docs/design.md §5.7): what applying them one after
//! another gives, refused requests left out, repeated requests answered as their first copy.

use super::*;

fn with_defaults(request: HeartbeatRequest) -> Option<(HeartbeatRequest, CoordinatorConfig)> {
    Some((request, CoordinatorConfig::default()))
}

/// A batch answers and leaves the group exactly as the same requests applied one by one, and a
/// refused request in the middle (a shard reported twice) is left out without changing the
/// others' answers.
#[test]
fn a_batch_is_its_requests_applied_one_after_another_without_the_refused_ones() {
    let mut one_by_one = Fixture::owned_by_a(4);
    let batched = Fixture::owned_by_a(4);
    let b = request("b", "p-b", JOIN_EPOCH, &[]);
    let mut bad = request("c", "p-c", JOIN_EPOCH, &[]);
    bad.owned_shards = vec![1, 1];
    let mut a = request("a", "p-a", 1, &[0, 1, 2, 3]);
    a.request_seq = one_by_one.seqs["p-a"] + 1;
    let requests = [
        with_defaults(b.clone()),
        with_defaults(bad),
        with_defaults(a.clone()),
    ];
    let ctx = Context {
        now: batched.now,
        stream: &batched.stream,
    };
    let (after, answers) = heartbeat_batch(&batched.group, &requests, &ctx);
    let expected = vec![
        Some(one_by_one.send_raw(&b).unwrap()),
        None,
        Some(one_by_one.send_raw(&a).unwrap()),
    ];
    assert_eq!(answers, expected);
    assert_eq!(after, one_by_one.group);
    check_group(&after, batched.now, true).expect("invariants hold");
    assert!(!after.members.contains_key("c"));
}

/// A leave queued twice (its requester's first batch failed to write, and it sent the request
/// again) is answered `OK` both times, as its first copy was, not `UNKNOWN_MEMBER_ID`.
#[test]
fn a_request_repeated_within_a_batch_gets_the_answer_of_its_first_copy() {
    let f = Fixture::owned_by_a(2);
    let mut leave = request("a", "p-a", LEAVE_EPOCH, &[]);
    leave.request_seq = f.seqs["p-a"] + 1;
    let requests = [with_defaults(leave.clone()), with_defaults(leave)];
    let ctx = Context {
        now: f.now,
        stream: &f.stream,
    };
    let (after, answers) = heartbeat_batch(&f.group, &requests, &ctx);
    let first = answers[0].clone().expect("the leave is applied");
    assert_eq!(first.status, HeartbeatStatus::Ok);
    assert_eq!(answers[1], Some(first));
    assert!(
        !after.members.contains_key("a"),
        "the leave removed the member"
    );
}

/// A batch in which many requests are refused replays at most a few times: after the fourth
/// refusal every later request is left to its requester, answered or not.
#[test]
fn a_batch_of_many_refused_requests_leaves_the_rest_to_their_requesters_after_four_replays() {
    let f = Fixture::new(4);
    let mut requests = Vec::new();
    for i in 0..10 {
        let mut bad = request(&format!("bad{i}"), &format!("p-bad{i}"), JOIN_EPOCH, &[]);
        bad.owned_shards = vec![0, 0];
        requests.push(with_defaults(bad));
        requests.push(with_defaults(request(
            &format!("ok{i}"),
            &format!("p-ok{i}"),
            JOIN_EPOCH,
            &[],
        )));
    }
    let ctx = Context {
        now: f.now,
        stream: &f.stream,
    };
    let (after, answers) = heartbeat_batch(&f.group, &requests, &ctx);
    let answered: Vec<usize> = (0..answers.len())
        .filter(|i| answers[*i].is_some())
        .collect();
    // Refused: 0, 2, 4, 6 (the fourth replay); the joins between them are applied, and every
    // request after the fourth refusal is left out.
    assert_eq!(answered, vec![1, 3, 5]);
    assert_eq!(
        after.members.keys().collect::<Vec<_>>(),
        ["ok0", "ok1", "ok2"]
    );
}
