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
            tracing::warn!(address = %local, %error, "observability listener failed");
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

#[cfg(test)]
mod tests {
    use super::*;

    async fn body_of(response: Response) -> (StatusCode, String) {
        let status = response.status();
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .unwrap();
        (status, String::from_utf8(bytes.to_vec()).unwrap())
    }

    fn state() -> AppState {
        AppState {
            probe: Arc::new(Probe::new(vec!["on_order".into()])),
            metrics: super::super::exporter::install(Duration::from_secs(5)).unwrap(),
        }
    }

    /// Without the `metrics` feature: 404 saying why (`cargo test -p stream-listener
    /// --no-default-features --lib observability`).
    #[cfg(not(feature = "metrics"))]
    #[tokio::test]
    async fn without_the_feature_metrics_is_404_saying_so() {
        let (status, body) = body_of(metrics_page(State(state())).await).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert!(
            body.starts_with("the `metrics` cargo feature of stream-listener is off"),
            "{body}"
        );
    }

    #[cfg(feature = "metrics")]
    #[tokio::test]
    async fn with_the_feature_metrics_is_prometheus_text() {
        // Installed first: what is recorded before a recorder exists goes nowhere.
        let state = state();
        metrics::counter!("stream_listener_unit_probe_total").increment(2);
        let (status, body) = body_of(metrics_page(State(state)).await).await;
        assert_eq!(status, StatusCode::OK);
        assert!(
            body.lines()
                .any(|l| l == "stream_listener_unit_probe_total 2"),
            "{body}"
        );
    }

    #[tokio::test]
    async fn while_starting_readyz_is_503_and_healthz_200() {
        let (status, body) = body_of(readyz(State(state())).await).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            body,
            r#"{"status":"starting","listeners":[{"name":"on_order","live":true,"ready":false,"members":[]}]}"#
        );
        let (status, body) = body_of(healthz(State(state())).await).await;
        assert_eq!(status, StatusCode::OK);
        assert!(body.starts_with(r#"{"status":"starting""#), "{body}");
    }
}
