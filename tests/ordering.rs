//! Key-ordered parallelism within a shard on real Redis (docs/design.md §14.3):
//!
//! - `ordering = "key"`: a shard runs entries of different keys at once (more than one, never
//!   more than `max_in_flight`), one key's entries one at a time in entry order, everything
//!   acked;
//! - an entry of key K that fails and is retried holds back K's later entries only;
//! - `ordering = "none"`: entries of one key run at once too; everything handled and acked;
//! - a second member joining mid-run in key mode: the drain hands shards over with nothing
//!   lost, no key ever in two handlers at once (across both members), and per key the first
//!   handling of each entry in entry order.
//!
//! Also run with `STREAM_LISTENER_TEST_FENCING=acks`.

mod support;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use stream_listener::core::handler::{Delivery, HandlerError};
use stream_listener::core::internals::connection::RedisConnection;
use stream_listener::core::member::{ListenerHandle, ListenerOptions, Ordering};
use support::*;

/// A stream entry id as numbers, for entry order.
fn id_order(id: &str) -> (u64, u64) {
    let (ms, seq) = id.split_once('-').unwrap();
    (ms.parse().unwrap(), seq.parse().unwrap())
}

/// One handler call's start.
#[derive(Debug, Clone)]
struct Start {
    member: String,
    shard: u32,
    key: String,
    id: String,
    attempt: u32,
}

/// What the handlers saw, across every listener of the test.
#[derive(Debug, Default)]
struct Seen {
    starts: Vec<Start>,
    /// Successful calls, in completion order: (shard, key, id).
    done: Vec<(u32, String, String)>,
    in_flight_shard: HashMap<u32, usize>,
    max_in_flight_shard: HashMap<u32, usize>,
    in_flight_key: HashMap<String, usize>,
    /// The most calls of one key in flight at once.
    max_in_flight_key: usize,
}

#[derive(Debug, Default)]
struct Tracker(Mutex<Seen>);

type Outcome = Arc<dyn Fn(&Delivery, &Seen) -> Result<(), HandlerError> + Send + Sync>;

impl Tracker {
    fn seen<T>(&self, f: impl FnOnce(&Seen) -> T) -> T {
        f(&self.0.lock().unwrap())
    }

    fn handled(&self) -> BTreeSet<(u32, String)> {
        self.seen(|s| s.done.iter().map(|(sh, _, id)| (*sh, id.clone())).collect())
    }

    /// The most calls in flight at once on `shard`.
    fn max_on(&self, shard: u32) -> usize {
        self.seen(|s| s.max_in_flight_shard.get(&shard).copied().unwrap_or(0))
    }

    /// Per key, the entry ids in the order their handling first started.
    fn first_starts_by_key(&self) -> BTreeMap<String, Vec<String>> {
        let mut seen_ids = BTreeSet::new();
        let mut by_key: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for start in self.seen(|s| s.starts.clone()) {
            if seen_ids.insert((start.shard, start.id.clone())) {
                by_key.entry(start.key).or_default().push(start.id);
            }
        }
        by_key
    }
}

/// A handler that records each call in `tracker`, sleeps `work`, then returns what `outcome`
/// says (`Ok` without one).
fn tracking_handler(
    tracker: Arc<Tracker>,
    work: Duration,
    outcome: Option<Outcome>,
) -> impl Fn(
    Delivery,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), HandlerError>> + Send>>
+ Send
+ Sync
+ 'static {
    move |delivery: Delivery| {
        let tracker = tracker.clone();
        let outcome = outcome.clone();
        Box::pin(async move {
            let key = delivery.partition_key().unwrap_or("").to_owned();
            {
                let mut seen = tracker.0.lock().unwrap();
                seen.starts.push(Start {
                    member: delivery.member_id.clone(),
                    shard: delivery.shard,
                    key: key.clone(),
                    id: delivery.entry_id.clone(),
                    attempt: delivery.attempt,
                });
                let shard = seen.in_flight_shard.entry(delivery.shard).or_default();
                *shard += 1;
                let now = *shard;
                let max = seen.max_in_flight_shard.entry(delivery.shard).or_default();
                *max = (*max).max(now);
                let per_key = seen.in_flight_key.entry(key.clone()).or_default();
                *per_key += 1;
                let now = *per_key;
                seen.max_in_flight_key = seen.max_in_flight_key.max(now);
            }
            tokio::time::sleep(work).await;
            let mut seen = tracker.0.lock().unwrap();
            *seen.in_flight_shard.get_mut(&delivery.shard).unwrap() -= 1;
            *seen.in_flight_key.get_mut(&key).unwrap() -= 1;
            let result = outcome.as_ref().map_or(Ok(()), |f| f(&delivery, &seen));
            if result.is_ok() {
                seen.done
                    .push((delivery.shard, key, delivery.entry_id.clone()));
            }
            result
        })
    }
}

/// Options for `ordering` with up to `max_in_flight` calls per shard.
fn ordered(ordering: Ordering, max_in_flight: u32) -> ListenerOptions {
    let mut options = options(1);
    options.ordering = ordering;
    options.max_in_flight = max_in_flight;
    options
}

async fn start(
    ctx_target: &stream_listener::core::internals::connection::RedisTarget,
    tracker: &Arc<Tracker>,
    options: ListenerOptions,
    work: Duration,
    outcome: Option<Outcome>,
) -> ListenerHandle {
    start_listener(
        ctx_target,
        tracking_handler(tracker.clone(), work, outcome),
        options,
    )
    .await
}

/// Appends `{"n": n}` with partition key `key` to `shard`; returns (shard, id).
async fn publish(conn: &mut RedisConnection, shard: u32, key: &str, n: u64) -> (u32, String) {
    let payload = format!("{{\"n\":{n}}}");
    let id = xadd_fields(conn, shard, &[("key", key), ("payload", &payload)]).await;
    (shard, id)
}

/// Entry ids per key in entry order, from what was published as (shard, id, key).
fn published_by_key(published: &[(u32, String, String)]) -> BTreeMap<String, Vec<String>> {
    let mut by_key: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (_, id, key) in published {
        by_key.entry(key.clone()).or_default().push(id.clone());
    }
    for ids in by_key.values_mut() {
        ids.sort_by_key(|id| id_order(id));
    }
    by_key
}

async fn wait_handled(tracker: &Tracker, published: &[(u32, String, String)], deadline: Duration) {
    let want: BTreeSet<(u32, String)> = published
        .iter()
        .map(|(s, id, _)| (*s, id.clone()))
        .collect();
    let all = wait_until(deadline, || tracker.handled().is_superset(&want)).await;
    let missing: Vec<_> = want.difference(&tracker.handled()).cloned().collect();
    assert!(all, "not handled: {:?}", first_five(&missing));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_mode_runs_keys_of_a_shard_at_once_and_each_key_in_entry_order() {
    let (_serial, _server, target, mut conn, _) = Context::start(2).await.parts();
    let mut published = Vec::new();
    for n in 0..160u64 {
        let shard = (n % 2) as u32;
        let key = format!("s{shard}-k{}", (n / 2) % 10);
        let (shard, id) = publish(&mut conn, shard, &key, n).await;
        published.push((shard, id, key));
    }
    let tracker = Arc::new(Tracker::default());
    let handle = start(
        &target,
        &tracker,
        ordered(Ordering::Key, 4),
        Duration::from_millis(20),
        None,
    )
    .await;
    wait_handled(&tracker, &published, Duration::from_secs(20)).await;
    for shard in 0..2 {
        let max = tracker.max_on(shard);
        assert!((2..=4).contains(&max), "shard {shard}: {max} calls at once");
    }
    assert_eq!(
        tracker.seen(|s| s.max_in_flight_key),
        1,
        "one key at a time"
    );
    assert_eq!(tracker.first_starts_by_key(), published_by_key(&published));
    assert_eq!(
        tracker.seen(|s| s.starts.len()),
        published.len(),
        "each entry once"
    );
    assert_no_pending(&mut conn, 0..2).await;
    handle.shutdown();
    handle.join().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_entry_holds_back_only_the_later_entries_of_its_key() {
    let (_serial, _server, target, mut conn, _) = Context::start(1).await.parts();
    let mut published = Vec::new();
    // a0 fails until every b entry has been handled: it can succeed only if b's entries ran
    // while it was retried. a1 must wait for a0.
    for (key, n) in [("a", 0), ("a", 1), ("b", 2), ("b", 3), ("b", 4), ("b", 5)] {
        let (shard, id) = publish(&mut conn, 0, key, n).await;
        published.push((shard, id, key.to_owned()));
    }
    let a0 = published[0].1.clone();
    let b_ids: BTreeSet<String> = published[2..].iter().map(|p| p.1.clone()).collect();
    let outcome: Outcome = Arc::new(move |delivery, seen| {
        let b_done = seen
            .done
            .iter()
            .filter(|(_, _, id)| b_ids.contains(id))
            .count();
        if delivery.entry_id == a0 && b_done < 4 {
            Err(HandlerError::retryable("b not handled yet"))
        } else {
            Ok(())
        }
    });
    let mut options = ordered(Ordering::Key, 16);
    options.max_attempts = 50;
    options.backoff = Duration::from_millis(20);
    let tracker = Arc::new(Tracker::default());
    let handle = start(
        &target,
        &tracker,
        options,
        Duration::from_millis(10),
        Some(outcome),
    )
    .await;
    wait_handled(&tracker, &published, Duration::from_secs(20)).await;
    let starts = tracker.seen(|s| s.starts.clone());
    let a0_attempts = starts.iter().filter(|s| s.id == published[0].1).count();
    assert!(a0_attempts >= 2, "a0 failed first: {a0_attempts} attempts");
    // a1 started once, after a0's last (successful) attempt started.
    let last_a0 = starts.iter().rposition(|s| s.id == published[0].1).unwrap();
    let a1: Vec<usize> = (0..starts.len())
        .filter(|&i| starts[i].id == published[1].1)
        .collect();
    assert_eq!(a1.len(), 1);
    assert!(a1[0] > last_a0, "a1 waited for a0: {starts:#?}");
    assert!(
        starts
            .iter()
            .all(|s| s.id == published[0].1 || s.attempt == 1)
    );
    assert_no_pending(&mut conn, [0]).await;
    handle.shutdown();
    handle.join().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn none_mode_runs_any_entries_at_once_and_acks_them_all() {
    let (_serial, _server, target, mut conn, _) = Context::start(1).await.parts();
    let mut published = Vec::new();
    for n in 0..40u64 {
        let (shard, id) = publish(&mut conn, 0, "one-key", n).await;
        published.push((shard, id, "one-key".to_owned()));
    }
    let tracker = Arc::new(Tracker::default());
    let handle = start(
        &target,
        &tracker,
        ordered(Ordering::None, 8),
        Duration::from_millis(30),
        None,
    )
    .await;
    wait_handled(&tracker, &published, Duration::from_secs(20)).await;
    let max = tracker.max_on(0);
    assert!((2..=8).contains(&max), "{max} calls at once");
    assert!(
        tracker.seen(|s| s.max_in_flight_key) > 1,
        "one key's entries at once"
    );
    assert_no_pending(&mut conn, [0]).await;
    handle.shutdown();
    handle.join().await.expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_joining_mid_run_in_key_mode_loses_nothing_and_keeps_each_key_in_order() {
    let (_serial, _server, target, mut conn, _) = Context::serial(4).await.parts();
    let tracker = Arc::new(Tracker::default());
    let options = ordered(Ordering::Key, 8);
    let first = start(
        &target,
        &tracker,
        options.clone(),
        Duration::from_millis(15),
        None,
    )
    .await;
    let mut published = Vec::new();
    let mut n = 0u64;
    let mut second = None;
    // 600 entries over 4 shards and 40 keys; the second member joins after 200.
    while n < 600 {
        let shard = (n % 4) as u32;
        let key = format!("s{shard}-k{}", (n / 4) % 10);
        let (shard, id) = publish(&mut conn, shard, &key, n).await;
        published.push((shard, id, key));
        n += 1;
        if n == 200 {
            second = Some(
                start(
                    &target,
                    &tracker,
                    options.clone(),
                    Duration::from_millis(15),
                    None,
                )
                .await,
            );
        }
        if n.is_multiple_of(20) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    let group = settle(&mut conn, 2, Duration::from_secs(20)).await;
    wait_handled(&tracker, &published, Duration::from_secs(30)).await;
    assert_eq!(
        tracker.seen(|s| s.max_in_flight_key),
        1,
        "no key in two handlers at once, on either member"
    );
    assert_eq!(tracker.first_starts_by_key(), published_by_key(&published));
    let members: BTreeSet<String> =
        tracker.seen(|s| s.starts.iter().map(|s| s.member.clone()).collect());
    assert_eq!(members.len(), 2, "both members handled entries: {group:#?}");
    assert_no_pending(&mut conn, 0..4).await;
    let second = second.unwrap();
    second.shutdown();
    first.shutdown();
    second.join().await.expect("clean shutdown");
    first.join().await.expect("clean shutdown");
}
