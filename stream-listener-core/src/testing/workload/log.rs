//! The JSON lines a `workload consume` process writes to stdout (`examples/workload.rs` documents
//! the format), parsed into [`LogLine`]s, and what `workload produce` published ([`Expected`]).

use serde::{Deserialize, Serialize};

use crate::member::ListenerEvent;

/// One line of a `workload consume` log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "camelCase")]
pub enum LogLine {
    /// The listener started: its member ids (the first line of a consumer run with
    /// `--log-starts`).
    Ready(Ready),
    /// A handler call started (only with `--log-starts`).
    Handling(Handling),
    /// One handler call, written when it ended.
    Handled(Handled),
    /// A shard assigned to a member.
    Assigned(Ownership),
    /// A shard given up by a member.
    Revoked(Ownership),
    /// A fenced read that returned entries.
    Read(Read),
    /// A read, ack or claim refused by the fence.
    FenceRejected(FenceRejected),
    /// Entries a group lost to a `"force"` retention trim.
    EntriesLost(EntriesLost),
    /// A lifecycle hook call (only with `--log-hooks`), written when it ends.
    Hook(HookCall),
}

/// `{"event":"hook",...}`: one lifecycle hook call (docs/design.md §13.3).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HookCall {
    /// `on_assigned`, `on_revoked` or `on_lost`.
    pub hook: String,
    /// The member.
    pub member: String,
    /// The shard.
    pub shard: u32,
    /// The member epoch the shard was assigned at.
    pub member_epoch: i64,
    /// The ids pending for this member's consumer on the shard when the hook started (at most
    /// 1000; empty when the read failed).
    pub pending_ids: Vec<String>,
    /// When the hook started, µs since the Unix epoch.
    pub start_us: u64,
    /// When it ended, µs since the Unix epoch.
    pub ts_us: u64,
}

/// `{"event":"entriesLost",...}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EntriesLost {
    /// The trimming member.
    pub member: String,
    /// The shard.
    pub shard: u32,
    /// The consumer group that lost them.
    pub group: String,
    /// Entries lost.
    pub entries: u64,
    /// When the trim was seen, µs since the Unix epoch.
    pub ts_us: u64,
}

/// `{"event":"ready",...}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Ready {
    /// The member ids of the process's listener, in member order.
    pub members: Vec<String>,
    /// When the listener had started, µs since the Unix epoch.
    pub ts_us: u64,
}

/// Which handler call a `handling` or `handled` line is about.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HandlerCall {
    /// The member whose shard task called the handler.
    pub member: String,
    /// The shard of the entry.
    pub shard: u32,
    /// The entry's stream id.
    pub entry_id: String,
    /// The member epoch the entry was read under.
    pub member_epoch: i64,
    /// The handler attempt, from 1.
    pub attempt: u32,
}

/// `{"event":"handling",...}`: the start of one handler call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Handling {
    /// The call.
    #[serde(flatten)]
    pub call: HandlerCall,
    /// Redis's delivery count of the entry.
    pub delivery_count: u64,
    /// `N` of a `{"n": N}` payload; `None` for other payloads.
    pub n: Option<u64>,
    /// When the call started, µs since the Unix epoch.
    pub ts_us: u64,
}

/// `{"event":"handled",...}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Handled {
    /// The call.
    #[serde(flatten)]
    pub call: HandlerCall,
    /// The partition key of a `{"key","seq"}` payload; `None` for other payloads.
    pub key: Option<String>,
    /// The per-key sequence number of a `{"key","seq"}` payload; `None` for other payloads.
    pub seq: Option<u64>,
    /// When the call started, µs since the Unix epoch.
    pub start_us: u64,
    /// When it returned, µs since the Unix epoch.
    pub end_us: u64,
    /// Whether the handler succeeded.
    pub ok: bool,
}

/// `{"event":"assigned"|"revoked",...}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Ownership {
    /// The member that gained or gave up the shard.
    pub member: String,
    /// The shard.
    pub shard: u32,
    /// The member's epoch at the change.
    pub member_epoch: i64,
    /// When the event was seen, µs since the Unix epoch.
    pub ts_us: u64,
}

/// `{"event":"read",...}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Read {
    /// The member that read.
    pub member: String,
    /// The shard read.
    pub shard: u32,
    /// Entries the read returned.
    pub count: u64,
    /// The id of the first of them.
    pub first_id: String,
    /// When the read's reply was processed, µs since the Unix epoch.
    pub ts_us: u64,
}

/// `{"event":"fenceRejected",...}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FenceRejected {
    /// `read`, `ack` or `claim`.
    pub op: String,
    /// The member whose operation was refused.
    pub member: String,
    /// The shard.
    pub shard: u32,
    /// When the refusal was seen, µs since the Unix epoch.
    pub ts_us: u64,
}

impl LogLine {
    /// The line a `workload consume` process writes for `event`, seen at `ts_us`.
    pub fn from_event(event: ListenerEvent, ts_us: u64) -> LogLine {
        match event {
            ListenerEvent::Assigned {
                member,
                shard,
                member_epoch,
            } => LogLine::Assigned(Ownership {
                member,
                shard,
                member_epoch,
                ts_us,
            }),
            ListenerEvent::Revoked {
                member,
                shard,
                member_epoch,
            } => LogLine::Revoked(Ownership {
                member,
                shard,
                member_epoch,
                ts_us,
            }),
            ListenerEvent::Read {
                member,
                shard,
                count,
                first_id,
            } => LogLine::Read(Read {
                member,
                shard,
                count: count as u64,
                first_id,
                ts_us,
            }),
            ListenerEvent::FenceRejected { op, member, shard } => {
                LogLine::FenceRejected(FenceRejected {
                    op: op.to_owned(),
                    member,
                    shard,
                    ts_us,
                })
            }
            ListenerEvent::EntriesLost {
                member,
                shard,
                group,
                entries,
            } => LogLine::EntriesLost(EntriesLost {
                member,
                shard,
                group,
                entries,
                ts_us,
            }),
        }
    }

    /// Parses one line.
    ///
    /// # Errors
    ///
    /// The JSON error and the line, when it is not one of the event kinds.
    pub fn parse(line: &str) -> Result<LogLine, String> {
        serde_json::from_str(line).map_err(|e| format!("{e}: {line:?}"))
    }

    /// The member the line is about (the first member of a `ready` line).
    pub fn member(&self) -> &str {
        match self {
            LogLine::Ready(r) => r.members.first().map_or("", String::as_str),
            LogLine::Handling(Handling { call, .. }) | LogLine::Handled(Handled { call, .. }) => {
                &call.member
            }
            LogLine::Assigned(o) | LogLine::Revoked(o) => &o.member,
            LogLine::Read(r) => &r.member,
            LogLine::FenceRejected(f) => &f.member,
            LogLine::EntriesLost(l) => &l.member,
            LogLine::Hook(h) => &h.member,
        }
    }

    /// The line's time (`startUs` for a handler call, the end for a hook call).
    pub fn ts_us(&self) -> u64 {
        match self {
            LogLine::Ready(r) => r.ts_us,
            LogLine::Handling(h) => h.ts_us,
            LogLine::Handled(h) => h.start_us,
            LogLine::Assigned(o) | LogLine::Revoked(o) => o.ts_us,
            LogLine::Read(r) => r.ts_us,
            LogLine::FenceRejected(f) => f.ts_us,
            LogLine::EntriesLost(l) => l.ts_us,
            LogLine::Hook(h) => h.ts_us,
        }
    }
}

/// The log of one consumer process, lines in the order it wrote them.
#[derive(Debug, Clone, Default)]
pub struct ProcessLog {
    /// A name for messages (`consumer-1`).
    pub name: String,
    /// The lines that parsed, in order.
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
            log.push(line);
        }
        log
    }

    /// Parses one more line into `lines` or `bad_lines`.
    pub fn push(&mut self, line: &str) {
        match LogLine::parse(line) {
            Ok(parsed) => self.lines.push(parsed),
            Err(error) => self.bad_lines.push(error),
        }
    }
}

/// What `workload produce --keys K --count N` published: message `n` is `(key-<n mod K>, n div K)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expected {
    /// Partition keys (`--keys`).
    pub keys: u64,
    /// Messages (`--count`).
    pub count: u64,
}

impl Expected {
    /// The partition key of key number `i`.
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
