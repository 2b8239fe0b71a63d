//! Combined full transitions (docs/design.md §5.7): a full heartbeat is queued in the group hash,
//! and whichever requester holds the combiner lease applies every queued heartbeat in one load
//! and one compare-and-set, then writes each answer back for its requester to collect.
//!
//! This is flat combining (Hendler, Incze, Shavit and Tzafrir, "Flat Combining and the
//! Synchronization-Parallelism Tradeoff", SPAA 2010) over Redis. Each full transition loads and
//! decodes the whole group, and one compare-and-set serialises them: while a 1,000-member group
//! rebalances, every heartbeat is a full transition, and concurrent ones sent each other back to
//! load again about 99 times per committed write. A batch pays for the load once and applies
//! the heartbeats one after another to the same state, as if they had arrived in queue order at
//! the load's Redis `TIME`.
//!
//! The fields, all in the group hash so that the group's keys, ACL rules and deletion stay as
//! they are: `reqseq` (the last queued number), `reqdone` (the last answered one), `req:<n>`
//! (`<request id>\n<requester's timings>\n<request JSON>`), `resp:<request id>` (`<expiry µs>|<response JSON>` or
//! `<expiry µs>|solo`) and `combiner` (`<token>|<expiry µs>`).

use std::time::Duration;

use super::writes::Writes;
use super::{GroupStore, LoadedGroup, MAX_ATTEMPTS, duration_us, jitter};
use crate::coordinator::{self, Context, CoordinatorConfig, StreamView};
use crate::model::{HeartbeatRequest, HeartbeatResponse, Micros};
use crate::store::{StoreError, scripts};

const REQUEST: &str = "req:";
const ANSWER: &str = "resp:";
const ANSWERED_UP_TO: &str = "reqdone";
const COMBINER: &str = "combiner";
/// The answer that sends a request back to its requester's own transition.
const SOLO: &str = "solo";

/// Heartbeats applied in one batch at most: a bound on one compare-and-set's size.
const MAX_BATCH: usize = 256;
/// Heartbeats queued at most: beyond it, requesters run their own transitions.
const MAX_QUEUED: u64 = 4096;
/// How long an answer waits for its requester before a later batch deletes it. A requester
/// waits a third of its lease at most (`member::heartbeat`), so this is far beyond any wait.
const ANSWER_TTL: Duration = Duration::from_secs(60);
/// The longest pause between two polls of a waiting requester.
const MAX_POLL_PAUSE: Duration = Duration::from_millis(16);

/// What a queued heartbeat came to.
pub(super) enum Combined {
    /// A combiner applied it: this is its response.
    Answered(HeartbeatResponse),
    /// It was not queued, the combiner could not apply it in a batch (an invalid or stale
    /// request, a correction round that needs the fences), or its answer was unreadable: the
    /// requester runs its own transition, which answers or names the error.
    Solo,
}

impl GroupStore {
    /// Queues `request` and waits for its answer, combining batches while this requester holds
    /// the combiner lease. The caller's timeout bounds the wait.
    ///
    /// # Errors
    /// The load's errors ([`StoreError::MissingGroup`], corrupt metadata, [`StoreError::Redis`])
    /// when this requester combines; everything else answers [`Combined::Solo`].
    pub(super) async fn combined(
        &mut self,
        request: &HeartbeatRequest,
        stream: &mut StreamView,
    ) -> Result<Combined, StoreError> {
        let id = format!("{:016x}", rand::random::<u64>());
        let Ok(json) = serde_json::to_string(request) else {
            return Ok(Combined::Solo);
        };
        let entry = format!("{}\n{json}", encode_timings(&self.config));
        let lease = combiner_lease(&self.config);
        let submitted: redis::RedisResult<Vec<String>> = scripts::group_submit()
            .key(self.keys.metadata())
            .arg(&id)
            .arg(entry)
            .arg(&id)
            .arg(lease)
            .arg(MAX_QUEUED)
            .invoke_async(&mut self.conn)
            .await;
        let (mut leading, number) = match submitted.as_deref() {
            Ok([queued, leading, number]) if queued == "1" => (leading == "1", number.clone()),
            _ => return Ok(Combined::Solo),
        };
        let mut pause = Duration::from_millis(1);
        loop {
            if leading {
                self.combine(&id, stream).await?;
            }
            let polled: redis::RedisResult<Vec<String>> = scripts::group_poll()
                .key(self.keys.metadata())
                .arg(&id)
                .arg(&id)
                .arg(lease)
                .arg(&number)
                .invoke_async(&mut self.conn)
                .await;
            match polled.as_deref() {
                Ok([answered, answer]) if answered == "1" => return Ok(self.read_answer(answer)),
                Ok([waiting, took_lease]) if waiting == "0" => leading = took_lease == "1",
                // The group is gone, the request was lost (neither it nor its answer is
                // there), or the poll failed: the requester's own transition answers or says
                // what is wrong. Polling on would never end, and combining an empty queue
                // again and again would load the group in a hot loop.
                _ => return Ok(Combined::Solo),
            }
            if !leading {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(MAX_POLL_PAUSE);
            }
        }
    }

    /// One batch: load, apply the queued heartbeats in order, and write the group, the answers
    /// and the end of the queue with one compare-and-set; on a conflict, again from the load
    /// (up to [`MAX_ATTEMPTS`], then the lease is left to expire and a waiter takes over).
    async fn combine(&mut self, token: &str, stream: &mut StreamView) -> Result<(), StoreError> {
        for attempt in 1..=MAX_ATTEMPTS {
            let loaded = self.load().await?;
            let queue = Queue::of(&loaded, &self.config);
            if queue.requests.is_empty() && queue.done.is_empty() {
                // Another combiner answered them between this one's lease and its load. A
                // failed release only leaves the lease to expire.
                let _: redis::RedisResult<i64> = scripts::group_release_lease()
                    .key(self.keys.metadata())
                    .arg(token)
                    .invoke_async(&mut self.conn)
                    .await;
                return Ok(());
            }
            if loaded.group.meta.metadata_version > stream.metadata_version {
                // As in the requester's own transition (`GroupStore::heartbeat`).
                *stream = self.read_stream_view(None).await?;
            }
            let ctx = Context {
                now: loaded.now,
                stream,
            };
            let (group, answers) =
                coordinator::heartbeat_batch(&loaded.group, &queue.requests, &ctx);
            let mut writes = Writes::diff(&loaded, &group, &self.config)?;
            queue.write_answers(&loaded, &answers, token, &mut writes)?;
            if self.compare_and_set(&loaded, &writes).await? {
                return Ok(());
            }
            tracing::debug!(
                stream = %self.keys.prefix(),
                group = %self.keys.group(),
                attempt,
                batch = queue.requests.len(),
                "group metadata changed concurrently; loading the batch again"
            );
            tokio::time::sleep(jitter(attempt)).await;
        }
        Ok(())
    }

    fn read_answer(&self, answer: &str) -> Combined {
        let Some((_, body)) = answer.split_once('|') else {
            return Combined::Solo;
        };
        if body == SOLO {
            return Combined::Solo;
        }
        match serde_json::from_str(body) {
            Ok(response) => Combined::Answered(response),
            Err(error) => {
                // The request was applied; its own transition answers it again from the stored
                // response (rule 0, docs/design.md §6.4).
                tracing::warn!(key = %self.keys.metadata(), %error, "a combined answer is not JSON; asking again");
                Combined::Solo
            }
        }
    }
}

/// The combiner lease: a tenth of the lease TTL, between 50 ms and 2 s, in µs (1.5 s on the
/// default timings). A combiner that stops (killed, paused) holds the queue up for that long,
/// well within a requester's timeout (a third of its lease). One that outlives it while working,
/// as a batch of many joins can (each runs the assignor: 4 ms at 1,000 members × 10,000 shards),
/// only costs a second combiner's work, which the compare-and-set then refuses.
fn combiner_lease(config: &CoordinatorConfig) -> u64 {
    duration_us(
        (config.member_lease_ttl / 10).clamp(Duration::from_millis(50), Duration::from_secs(2)),
    )
}

/// The requester's `[coordination]` timings, queued with its request: members of one group may
/// run different ones, and a transition records and answers the requester's own (docs/design.md
/// §6.5). Four integers: heartbeat interval, lease TTL and rebalance timeout in µs, history cap.
fn encode_timings(config: &CoordinatorConfig) -> String {
    format!(
        "{} {} {} {}",
        duration_us(config.heartbeat_interval),
        duration_us(config.member_lease_ttl),
        duration_us(config.rebalance_timeout),
        config.history_capacity
    )
}

/// The requester's timings from [`encode_timings`], on top of the combiner's configuration;
/// `None` when they do not read.
fn decode_timings(text: &str, combiner: &CoordinatorConfig) -> Option<CoordinatorConfig> {
    let mut numbers = text.split(' ').map(|n| n.parse::<u64>().ok());
    let mut next = || numbers.next().flatten();
    let config = CoordinatorConfig {
        heartbeat_interval: Duration::from_micros(next()?),
        member_lease_ttl: Duration::from_micros(next()?),
        rebalance_timeout: Duration::from_micros(next()?),
        history_capacity: usize::try_from(next()?).ok()?,
        ..combiner.clone()
    };
    Some(config)
}

/// The queue as loaded: the heartbeats to apply, in order, and what the batch's write removes.
struct Queue {
    /// The requesters' ids for the answers, in queue order.
    ids: Vec<String>,
    /// Each request with its requester's timings, in queue order; `None` when the stored text
    /// does not read (answered `solo`).
    requests: Vec<Option<(HeartbeatRequest, CoordinatorConfig)>>,
    /// The number of the last request in `requests` (the new `reqdone`).
    last: u64,
    /// `req:` fields to delete: those in `requests`, and leftovers at or below `reqdone` or
    /// without a readable number or id.
    done: Vec<String>,
}

impl Queue {
    fn of(loaded: &LoadedGroup, combiner: &CoordinatorConfig) -> Queue {
        // As the submit script reads it: a number at or above 2^53 (not exact in Lua) is 0.
        let answered_up_to = loaded
            .fields
            .get(ANSWERED_UP_TO)
            .and_then(|v| v.parse::<u64>().ok())
            .filter(|n| *n < 1 << 53)
            .unwrap_or(0);
        let mut numbered = Vec::new();
        let mut done = Vec::new();
        for (field, value) in &loaded.fields {
            let Some(number) = field.strip_prefix(REQUEST) else {
                continue;
            };
            match (number.parse::<u64>(), value.split_once('\n')) {
                (Ok(n), Some((id, body))) if n > answered_up_to => {
                    numbered.push((n, field, id, body));
                }
                _ => done.push(field.clone()),
            }
        }
        numbered.sort_unstable_by_key(|(n, ..)| *n);
        numbered.truncate(MAX_BATCH);
        let last = numbered.last().map_or(answered_up_to, |(n, ..)| *n);
        let mut ids = Vec::with_capacity(numbered.len());
        let mut requests = Vec::with_capacity(numbered.len());
        for (_, field, id, body) in numbered {
            done.push(field.clone());
            ids.push(id.to_owned());
            requests.push(body.split_once('\n').and_then(|(timings, json)| {
                Some((
                    serde_json::from_str(json).ok()?,
                    decode_timings(timings, combiner)?,
                ))
            }));
        }
        Queue {
            ids,
            requests,
            last,
            done,
        }
    }

    /// Adds to `writes` the batch's answers, the end of the queue, the deletion of answers no
    /// requester collected in time, and the release of the combiner lease if `token` still
    /// holds it.
    fn write_answers(
        &self,
        loaded: &LoadedGroup,
        answers: &[Option<HeartbeatResponse>],
        token: &str,
        writes: &mut Writes,
    ) -> Result<(), StoreError> {
        let expiry = loaded.now + duration_us(ANSWER_TTL);
        for (id, answer) in self.ids.iter().zip(answers) {
            let body = match answer {
                Some(response) => serde_json::to_string(response)
                    .map_err(|e| StoreError::corrupt("group", ANSWER, e))?,
                None => SOLO.to_owned(),
            };
            writes.set(format!("{ANSWER}{id}"), format!("{expiry}|{body}"));
        }
        writes.set(ANSWERED_UP_TO.to_owned(), self.last.to_string());
        for field in &self.done {
            writes.delete(field.clone());
        }
        for (field, value) in &loaded.fields {
            if field.starts_with(ANSWER) && answer_expired(value, loaded.now) {
                writes.delete(field.clone());
            }
        }
        writes.release(COMBINER.to_owned(), token);
        Ok(())
    }
}

/// Whether a stored answer's expiry has passed (an unreadable one has: nothing can collect it).
fn answer_expired(value: &str, now: Micros) -> bool {
    value
        .split_once('|')
        .and_then(|(expiry, _)| expiry.parse::<Micros>().ok())
        .is_none_or(|expiry| expiry <= now)
}

#[cfg(all(test, feature = "testing"))]
mod tests;
