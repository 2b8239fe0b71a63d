//! Coalescing of concurrent single publishes into pipelines (docs/design.md §9).
//!
//! Why: a single publish is one `XADD`, one request and one reply. Many tasks publishing one
//! entry each on one publisher would pay that per entry, in Redis (one read and one reply write
//! per command) and in the client (one request, one reply, one wake-up). Sent as one pipeline,
//! the same entries cost far less, as `publish_batch` shows. So a publish that arrives while a
//! pipeline of its queue is in flight joins the next pipeline, as Kafka's producer batches
//! records, but without a linger delay: a publish on an idle queue is sent at once.
//!
//! How: one queue per pipeline target, one on a standalone server or Sentinel master (a pipeline
//! may hold entries of every shard), one per shard stream on a cluster (a redis-rs cluster
//! pipeline must stay in one slot). The publish that finds its queue idle starts a sender task
//! for it. The task sends everything queued as one pipeline (followed by the `WAIT` when
//! `min_replica_acks` is set), hands each caller its own reply, yields once so that the callers
//! it answered can join the next pipeline, and repeats until the queue is empty, then ends. A
//! queue has at most one pipeline in flight, so its entries are appended in the order they
//! joined, even when redis-rs re-sends a cluster pipeline after a redirect.
//!
//! The pipeline is sent by that task, not by one of the callers, so a caller that drops its
//! future cannot cancel the entries of others. An entry whose caller has gone before its pipeline
//! is built is left out. Each entry's reply is read on its own (`ignore_errors`): a nil reply
//! (retired shard) or an error reply reaches only its caller, which handles it as before
//! (refresh and retry, or its typed error).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use redis::{Cmd, Pipeline, RedisError, RedisResult, Value};
use tokio::sync::oneshot;

use crate::connection::RedisConnection;
use crate::replication::ReplicaWait;

/// One entry's outcome: its id (`None`: `NOMKSTREAM` found no stream) and, when a `WAIT`
/// followed its pipeline, the replicas that `WAIT` counted.
pub(super) type Reply = RedisResult<(Option<String>, Option<u32>)>;

/// A queued `XADD` and where its reply goes.
struct Job {
    xadd: Cmd,
    reply: oneshot::Sender<Reply>,
}

/// A queue: `None` for the one queue of a standalone server or Sentinel master, `Some(shard)`
/// for a shard's queue on a cluster.
type QueueId = Option<u32>;

/// The queues of one publisher (shared by its clones).
pub(super) struct Coalescer {
    conn: RedisConnection,
    wait: Option<ReplicaWait>,
    /// Entries waiting for the next pipeline, by queue. A queue is listed exactly while its
    /// sender task runs: an idle queue is removed.
    queues: Mutex<BTreeMap<QueueId, Vec<Job>>>,
}

impl Coalescer {
    /// Queues sending on `conn`, each pipeline followed by `wait`'s `WAIT` when set.
    pub(super) fn new(conn: RedisConnection, wait: Option<ReplicaWait>) -> Arc<Self> {
        Arc::new(Coalescer {
            conn,
            wait,
            queues: Mutex::new(BTreeMap::new()),
        })
    }

    /// Sends `xadd`, an `XADD` to shard `shard`'s stream, in the next pipeline of its queue (at
    /// once when the queue is idle) and returns its own reply. Dropping the returned future
    /// before the pipeline is built leaves the entry out; after that the entry is sent all the
    /// same.
    pub(super) async fn send(self: &Arc<Self>, shard: u32, xadd: Cmd) -> Reply {
        let (reply, receiver) = oneshot::channel();
        let queue = self.conn.is_cluster().then_some(shard);
        if self.enqueue(queue, Job { xadd, reply }) {
            tokio::spawn(QueueSender::new(Arc::clone(self), queue).run());
        }
        receiver.await.unwrap_or_else(|_| Err(sender_stopped()))
    }

    /// Adds `job` to `queue`; `true` when the queue was idle, and the caller must then start its
    /// sender task.
    fn enqueue(&self, queue: QueueId, job: Job) -> bool {
        let mut queues = self.lock();
        if let Some(jobs) = queues.get_mut(&queue) {
            jobs.push(job);
            return false;
        }
        queues.insert(queue, vec![job]);
        true
    }

    /// The entries of `queue` whose callers still wait, taken out for the next pipeline. `None`
    /// when there are none: the queue is then removed under the same lock, so the next publish
    /// starts a new sender task.
    fn take(&self, queue: QueueId) -> Option<Vec<Job>> {
        let mut queues = self.lock();
        let jobs = queues.get_mut(&queue)?;
        jobs.retain(|job| !job.reply.is_closed());
        if jobs.is_empty() {
            queues.remove(&queue);
            return None;
        }
        // The next pipeline is likely as large: keep the room instead of growing it again.
        let room = jobs.len();
        Some(std::mem::replace(jobs, Vec::with_capacity(room)))
    }

    /// Sends `jobs` as one pipeline and hands each caller its reply.
    async fn send_pipeline(&self, jobs: Vec<Job>) {
        let mut pipe = Pipeline::with_capacity(jobs.len() + 1);
        // Every reply comes back as it is, so that an error reply fails only its own entry.
        pipe.ignore_errors();
        let mut callers = Vec::with_capacity(jobs.len());
        for job in jobs {
            pipe.add_command(job.xadd);
            callers.push(job.reply);
        }
        if let Some(wait) = self.wait {
            pipe.add_command(wait.cmd());
        }
        let mut conn = self.conn.clone();
        let replies = self.replies(pipe.query_async(&mut conn).await, callers.len());
        for (caller, reply) in callers.into_iter().zip(replies) {
            // A caller that has gone no longer wants its reply.
            let _ = caller.send(reply);
        }
    }

    /// Each of the `entries` entries' reply, from the pipeline's `result`: the whole pipeline's
    /// error for each when it failed; else the entry's own reply, and the `WAIT`'s.
    fn replies(&self, result: RedisResult<Vec<Value>>, entries: usize) -> Vec<Reply> {
        let mut values = match result {
            Ok(values) => values,
            Err(error) => return vec![Err(error); entries],
        };
        let acked = match self.wait {
            None => Ok(None),
            Some(_) => match values.pop() {
                Some(Value::ServerError(error)) => Err(RedisError::from(error)),
                // As for a batch: a reply that is not a count counts no replica.
                reply => Ok(Some(
                    reply.as_ref().and_then(ReplicaWait::acked).unwrap_or(0),
                )),
            },
        };
        values
            .into_iter()
            .map(|value| Ok((entry_id(value)?, acked.clone()?)))
            .collect()
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<QueueId, Vec<Job>>> {
        // Nothing panics while the map is held: a poisoned lock still holds a whole map.
        self.queues
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// An `XADD` reply as a single `XADD` reads it: the id, `None` for nil, or the error reply.
fn entry_id(value: Value) -> RedisResult<Option<String>> {
    Ok(redis::from_redis_value(value.extract_error()?)?)
}

/// What a caller gets when the sender task ended without answering: its runtime shut down
/// (or it panicked) with the entry taken or queued.
fn sender_stopped() -> RedisError {
    std::io::Error::other(
        "the publisher's pipeline task stopped before Redis answered (is the runtime shutting down?); the entry may or may not have been appended",
    )
    .into()
}

/// The sender task of one queue ([`Coalescer`]). Dropped before its queue is empty (its runtime
/// shut down, or a panic), it removes the queue: the callers still in it get an error instead of
/// waiting forever, and the next publish starts a new sender task.
struct QueueSender {
    coalescer: Arc<Coalescer>,
    queue: QueueId,
    /// Set once [`Coalescer::take`] has removed the queue as idle.
    idle: bool,
}

impl QueueSender {
    fn new(coalescer: Arc<Coalescer>, queue: QueueId) -> Self {
        QueueSender {
            coalescer,
            queue,
            idle: false,
        }
    }

    /// Sends the queue's entries, one pipeline in flight at a time, until it is empty.
    ///
    /// After each pipeline the task yields once (a scheduler turn, no timer): the callers it has
    /// just answered, and any other task ready to run, can publish again and join the next
    /// pipeline instead of each starting a small one. Measured on a local cluster with 64
    /// callers over 16 shard queues (the producer bench): pipelines of 2.4 entries on average
    /// without it, 3.5 with it, and about a quarter less Redis CPU per entry.
    async fn run(mut self) {
        while let Some(jobs) = self.coalescer.take(self.queue) {
            self.coalescer.send_pipeline(jobs).await;
            tokio::task::yield_now().await;
        }
        self.idle = true;
    }
}

impl Drop for QueueSender {
    fn drop(&mut self) {
        if !self.idle {
            self.coalescer.lock().remove(&self.queue);
        }
    }
}

#[cfg(all(test, feature = "testing"))]
mod tests;
