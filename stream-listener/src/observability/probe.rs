//! What `/healthz` and `/readyz` answer (docs/design.md §13.2): the app's phase and each
//! member's [`MemberHealth`], as JSON with camelCase fields.

use std::sync::Mutex;

use serde::Serialize;
use stream_listener_core::member::{HealthSource, MemberHealth};

/// The app's health, shared by `run_listeners` (writer) and the HTTP listener (reader).
pub(crate) struct Probe {
    phase: Mutex<Phase>,
}

enum Phase {
    /// Checking the config, connecting, provisioning: no member yet.
    Starting { names: Vec<String> },
    /// The members run; `listeners` gives each listener's name and member count, in the order
    /// of the source's members.
    Running {
        listeners: Vec<(String, usize)>,
        source: HealthSource,
    },
}

/// A probe's answer: the HTTP status and the JSON body.
pub(crate) struct Answer {
    pub(crate) ok: bool,
    pub(crate) body: Body,
}

/// The JSON body of `/healthz` and `/readyz`.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Body {
    /// `/readyz`: `ready`, `starting`, `not_ready`, `shutting_down`; `/healthz`: `live`,
    /// `starting`, `shutting_down`, `not_live`.
    status: &'static str,
    listeners: Vec<ListenerBody>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ListenerBody {
    name: String,
    live: bool,
    ready: bool,
    members: Vec<MemberBody>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct MemberBody {
    id: String,
    state: &'static str,
    reason: String,
    live: bool,
    ready: bool,
    member_epoch: i64,
    owned_shards: Vec<u32>,
    target_shards: Vec<u32>,
    pending_shards: Vec<u32>,
    revoking_shards: Vec<u32>,
    /// Milliseconds of lease left (margin taken off), `null` without a lease.
    lease_remaining_ms: Option<u64>,
    since_last_renewal_ms: Option<u64>,
    since_last_response_ms: Option<u64>,
    last_error: Option<String>,
    /// `ListenerHandle::pause`d: still ready (it heartbeats and keeps its shards).
    paused: bool,
}

impl Probe {
    /// An app starting the listeners `names`.
    pub(crate) fn new(names: Vec<String>) -> Self {
        Probe {
            phase: Mutex::new(Phase::Starting { names }),
        }
    }

    /// The members run: `listeners` are (name, member count) in the order of `source`.
    pub(crate) fn running(&self, listeners: Vec<(String, usize)>, source: HealthSource) {
        *self.lock() = Phase::Running { listeners, source };
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Phase> {
        self.phase
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// `/readyz`: ready once every member of every listener holds its assignment with a valid
    /// lease; not during startup, shutdown, a fencing or a lapsed lease.
    pub(crate) fn readiness(&self) -> Answer {
        self.answer(
            |listeners, shutting_down| {
                if shutting_down {
                    (false, "shutting_down")
                } else if listeners.iter().all(|l| l.ready) {
                    (true, "ready")
                } else {
                    (false, "not_ready")
                }
            },
            "starting",
            false,
        )
    }

    /// `/healthz`: live while every member heartbeats within its lease (and during startup
    /// and shutdown).
    pub(crate) fn liveness(&self) -> Answer {
        self.answer(
            |listeners, shutting_down| {
                if listeners.iter().all(|l| l.live) {
                    (
                        true,
                        if shutting_down {
                            "shutting_down"
                        } else {
                            "live"
                        },
                    )
                } else {
                    (false, "not_live")
                }
            },
            "starting",
            true,
        )
    }

    fn answer(
        &self,
        judge: impl Fn(&[ListenerBody], bool) -> (bool, &'static str),
        starting: &'static str,
        ok_while_starting: bool,
    ) -> Answer {
        let phase = self.lock();
        match &*phase {
            Phase::Starting { names } => Answer {
                ok: ok_while_starting,
                body: Body {
                    status: starting,
                    listeners: names
                        .iter()
                        .map(|name| ListenerBody {
                            name: name.clone(),
                            live: true,
                            ready: false,
                            members: Vec::new(),
                        })
                        .collect(),
                },
            },
            Phase::Running { listeners, source } => {
                let shutting_down = source.is_shutting_down();
                let mut members = source.health().into_iter();
                let bodies: Vec<ListenerBody> = listeners
                    .iter()
                    .map(|(name, count)| {
                        let members: Vec<MemberBody> =
                            members.by_ref().take(*count).map(member_body).collect();
                        ListenerBody {
                            name: name.clone(),
                            live: members.iter().all(|m| m.live),
                            ready: members.iter().all(|m| m.ready),
                            members,
                        }
                    })
                    .collect();
                let (ok, status) = judge(&bodies, shutting_down);
                Answer {
                    ok,
                    body: Body {
                        status,
                        listeners: bodies,
                    },
                }
            }
        }
    }
}

fn member_body(health: MemberHealth) -> MemberBody {
    let ms = |d: Option<std::time::Duration>| {
        d.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    };
    MemberBody {
        state: health.state.as_str(),
        live: health.live,
        ready: health.ready,
        member_epoch: health.member_epoch,
        lease_remaining_ms: ms(health.lease_remaining),
        since_last_renewal_ms: ms(health.since_last_renewal),
        since_last_response_ms: ms(health.since_last_response),
        owned_shards: health.owned_shards,
        target_shards: health.target_shards,
        pending_shards: health.pending_shards,
        revoking_shards: health.revoking_shards,
        reason: health.reason,
        last_error: health.last_error,
        paused: health.paused,
        id: health.member_id,
    }
}
