//! Picking free loopback ports.
//!
//! Ports are drawn at random from [`PORT_RANGE`], below the usual ephemeral range so outgoing
//! connections rarely take them, and low enough that a cluster node's bus port (`port + 10000`) is
//! a valid port as well. A candidate is taken only when it (and its bus port, for cluster nodes)
//! can be bound on `127.0.0.1` right now and is not already held by another server of this process.
//! Another process can still take the port before `redis-server` binds it: the server builder then
//! retries with a new port.

use std::collections::BTreeSet;
use std::hash::BuildHasher;
use std::net::{Ipv4Addr, TcpListener};
use std::ops::RangeInclusive;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use super::HarnessError;

/// The range client ports are drawn from. Cluster bus ports are `port + 10000`, so they fall in
/// 20000..=39999 and stay below 55535 + 10000 = 65535.
const PORT_RANGE: RangeInclusive<u16> = 10_000..=29_999;

/// Offset of a Redis Cluster node's bus port from its client port.
pub(crate) const BUS_PORT_OFFSET: u16 = 10_000;

/// How many random candidates are tried before giving up.
const CANDIDATES: u32 = 500;

/// Ports held by live harness servers of this process (client and bus ports).
static HELD: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());

/// A port held for one server; released when dropped.
#[derive(Debug)]
pub(crate) struct PortLease {
    port: u16,
    bus: bool,
}

impl PortLease {
    /// The client port.
    pub(crate) fn port(&self) -> u16 {
        self.port
    }
}

impl Drop for PortLease {
    fn drop(&mut self) {
        let mut held = HELD.lock().unwrap_or_else(PoisonError::into_inner);
        held.remove(&self.port);
        if self.bus {
            held.remove(&(self.port + BUS_PORT_OFFSET));
        }
    }
}

/// Picks a free loopback port (and, when `bus` is set, a free bus port `port + 10000`).
///
/// # Errors
///
/// [`HarnessError::PortsExhausted`] when no candidate was free.
pub(crate) fn lease(bus: bool) -> Result<PortLease, HarnessError> {
    for _ in 0..CANDIDATES {
        let port = random_port();
        let mut held = HELD.lock().unwrap_or_else(PoisonError::into_inner);
        let bus_port = port + BUS_PORT_OFFSET;
        if held.contains(&port) || (bus && held.contains(&bus_port)) {
            continue;
        }
        if !bindable(port) || (bus && !bindable(bus_port)) {
            continue;
        }
        held.insert(port);
        if bus {
            held.insert(bus_port);
        }
        return Ok(PortLease { port, bus });
    }
    Err(HarnessError::PortsExhausted {
        attempts: CANDIDATES,
    })
}

/// Whether `127.0.0.1:port` can be bound right now.
pub(crate) fn bindable(port: u16) -> bool {
    TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok()
}

fn random_port() -> u16 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    // `RandomState` is seeded from the OS; hashing a counter gives a cheap random sequence.
    let n = std::hash::RandomState::new().hash_one(COUNTER.fetch_add(1, Ordering::Relaxed));
    let span = u64::from(PORT_RANGE.end() - PORT_RANGE.start()) + 1;
    let offset = u16::try_from(n % span).unwrap_or(0);
    PORT_RANGE.start() + offset
}
