//! The axum server of `[observability] listen`: three routes, stopped after the members left.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::exporter::Metrics;
use super::probe::{Answer, Probe};
use crate::run::RunError;

/// How often the exporter's upkeep runs (its docs: every few seconds; 5 s is its own default).
const UPKEEP_INTERVAL: Duration = Duration::from_secs(5);

/// The running HTTP listener.
pub(crate) struct Server {
    addr: SocketAddr,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server").field("addr", &self.addr).finish()
    }
}

#[derive(Clone)]
struct AppState {
    probe: Arc<Probe>,
    metrics: Metrics,
}

/// Binds `addr` and serves `/metrics`, `/healthz` and `/readyz` until [`Server::stop`].
///
/// # Errors
/// [`RunError::Listen`] when `addr` cannot be bound (port in use, foreign address,
/// privileged port).
pub(crate) async fn start(
    addr: SocketAddr,
    probe: Arc<Probe>,
    metrics: Metrics,
) -> Result<Server, RunError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| RunError::Listen {
            address: addr.to_string(),
            advice: super::bind_advice(&addr, &source),
            source,
        })?;
    let local = listener.local_addr().unwrap_or(addr);
    let stop = CancellationToken::new();
    let router = Router::new()
        .route("/metrics", get(metrics_page))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(AppState {
            probe,
            metrics: metrics.clone(),
        });
    let shutdown = stop.clone();
    let task = tokio::spawn(async move {
        let upkeep = upkeep(metrics, shutdown.clone());
        let serve =
            axum::serve(listener, router).with_graceful_shutdown(shutdown.cancelled_owned());
        let (served, ()) = tokio::join!(serve, upkeep);
        if let Err(error) = served {
            tracing::warn!(%error, "observability listener failed");
        }
    });
    Ok(Server {
        addr: local,
        stop,
        task,
    })
}

impl Server {
    /// The bound address (the real port when `listen` gave port 0).
    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, lets in-flight requests finish, and waits for the task.
    pub(crate) async fn stop(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }
}

async fn upkeep(metrics: Metrics, stop: CancellationToken) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(UPKEEP_INTERVAL) => metrics.upkeep(),
            _ = stop.cancelled() => return,
        }
    }
}

async fn metrics_page(State(state): State<AppState>) -> Response {
    match state.metrics.render() {
        Some(text) => (
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
            text,
        )
            .into_response(),
        None => (
            StatusCode::NOT_FOUND,
            "the `metrics` cargo feature of stream-listener is off in this build: enable it (it is on by default) to serve /metrics\n",
        )
            .into_response(),
    }
}

async fn healthz(State(state): State<AppState>) -> Response {
    json(state.probe.liveness())
}

async fn readyz(State(state): State<AppState>) -> Response {
    json(state.probe.readiness())
}

fn json(answer: Answer) -> Response {
    let status = if answer.ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    // Serializing plain structs of strings and numbers cannot fail.
    let body = serde_json::to_string(&answer.body)
        .unwrap_or_else(|e| format!("{{\"status\":\"error\",\"error\":{:?}}}", e.to_string()));
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}
