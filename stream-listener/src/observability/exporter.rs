//! The Prometheus recorder behind `/metrics` (feature `metrics`): installed once per process.

use std::time::Duration;

use crate::run::RunError;

/// What `/metrics` serves: the recorder's handle, or nothing without the feature.
#[derive(Clone)]
pub(crate) struct Metrics {
    #[cfg(feature = "metrics")]
    pub(crate) handle: metrics_exporter_prometheus::PrometheusHandle,
}

/// The recorder this crate installed in this process, reused by later `run_with` calls (tests
/// run several apps in one process; the global recorder can be set only once).
#[cfg(feature = "metrics")]
static INSTALLED: std::sync::Mutex<Option<metrics_exporter_prometheus::PrometheusHandle>> =
    std::sync::Mutex::new(None);

/// Installs the Prometheus recorder as the global `metrics` recorder, gauges forgotten after
/// 3 × `interval` without an update, with `_bucket` histograms for the two duration metrics.
/// A second call in the same process returns the first recorder.
///
/// # Errors
/// [`RunError::MetricsRecorder`] when another global recorder is installed.
#[cfg(feature = "metrics")]
pub(crate) fn install(interval: Duration) -> Result<Metrics, RunError> {
    use metrics_exporter_prometheus::{BuildError, PrometheusBuilder};

    let mut installed = INSTALLED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(handle) = installed.as_ref() {
        return Ok(Metrics {
            handle: handle.clone(),
        });
    }
    let handle = builder(interval)
        .and_then(PrometheusBuilder::install_recorder)
        .map_err(|e| match e {
            BuildError::FailedToSetGlobalRecorder(_) => RunError::MetricsRecorder,
            other => RunError::MetricsSetup(other.to_string()),
        })?;
    *installed = Some(handle.clone());
    Ok(Metrics { handle })
}

/// The recorder's settings: gauges idle for 3 × `interval` are forgotten (a revoked shard's
/// lag stops being reported), the two duration histograms get buckets (`_bucket` series for
/// `histogram_quantile`; without them the exporter renders summaries).
#[cfg(feature = "metrics")]
fn builder(
    interval: Duration,
) -> Result<metrics_exporter_prometheus::PrometheusBuilder, metrics_exporter_prometheus::BuildError>
{
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
    use metrics_util::MetricKindMask;
    use stream_listener_core::internals::telemetry::names;

    PrometheusBuilder::new()
        .idle_timeout(MetricKindMask::GAUGE, Some(interval.saturating_mul(3)))
        .set_buckets_for_metric(
            Matcher::Full(names::HANDLER_DURATION_SECONDS.into()),
            names::HANDLER_DURATION_BUCKETS,
        )?
        .set_buckets_for_metric(
            Matcher::Full(names::HEARTBEAT_DURATION_SECONDS.into()),
            names::HEARTBEAT_DURATION_BUCKETS,
        )
}

/// Without the `metrics` feature there is nothing to install.
#[cfg(not(feature = "metrics"))]
pub(crate) fn install(_interval: Duration) -> Result<Metrics, RunError> {
    Ok(Metrics {})
}

impl Metrics {
    /// The `/metrics` body: Prometheus text, or `None` without the feature.
    pub(crate) fn render(&self) -> Option<String> {
        #[cfg(feature = "metrics")]
        return Some(self.handle.render());
        #[cfg(not(feature = "metrics"))]
        None
    }

    /// The exporter's periodic maintenance (histogram buckets drained, idle gauges forgotten);
    /// its docs ask for it at least every few seconds when nothing scrapes.
    pub(crate) fn upkeep(&self) {
        #[cfg(feature = "metrics")]
        self.handle.run_upkeep();
    }
}
