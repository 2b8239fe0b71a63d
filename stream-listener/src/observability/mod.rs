//! The process's HTTP listener of `[observability] listen` (docs/design.md §13.2): `/metrics`
//! (feature `metrics`), `/healthz` and `/readyz`.
//!
//! `run_listeners` starts it before it connects to Redis (so `/readyz` answers 503 `starting`
//! during startup) and stops it after the members have left (503 `shutting_down` during the
//! drain).

mod exporter;
mod probe;
mod server;

pub(crate) use probe::Probe;
pub(crate) use server::Server;

use std::net::SocketAddr;
use std::sync::Arc;

use stream_listener_core::config::Config;

use crate::run::RunError;

/// Starts the HTTP listener when `[observability] listen` is set, for the listeners named
/// `names` (in start order). Installs the Prometheus recorder first (feature `metrics`), which
/// forgets a gauge idle for 3 × the longer of `metrics_interval` and `refresh` (the longest
/// time between two sets of a live gauge: a heartbeat interval, a `block`).
///
/// # Errors
/// [`RunError::Config`] for an unparsable address; [`RunError::MetricsRecorder`] when another
/// global `metrics` recorder is installed; [`RunError::Listen`] when the address cannot be bound.
pub(crate) async fn start(
    config: &Config,
    names: Vec<String>,
    refresh: std::time::Duration,
) -> Result<Option<(Server, Arc<Probe>)>, RunError> {
    let Some(addr) = config.listen_addr()? else {
        return Ok(None);
    };
    let metrics = exporter::install(config.observability.metrics_interval.max(refresh))?;
    let probe = Arc::new(Probe::new(names));
    let server = server::start(addr, probe.clone(), metrics).await?;
    tracing::info!(address = %server.local_addr(), "observability listener started: /metrics, /healthz, /readyz");
    Ok(Some((server, probe)))
}

/// What to say when `addr` cannot be bound, by the kind of `error`.
pub(crate) fn bind_advice(addr: &SocketAddr, error: &std::io::Error) -> &'static str {
    match error.kind() {
        std::io::ErrorKind::AddrInUse => {
            "the port is in use by another process: stop it, or choose another port in [observability] listen"
        }
        std::io::ErrorKind::AddrNotAvailable => {
            "the address is not one of this machine's: use 0.0.0.0 (every interface) or one of its IP addresses"
        }
        std::io::ErrorKind::PermissionDenied if addr.port() < 1024 => {
            "ports below 1024 need privileges: choose a port above 1024"
        }
        _ => "check [observability] listen, or remove it for no HTTP listener",
    }
}
