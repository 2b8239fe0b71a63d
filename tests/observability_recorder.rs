//! `[observability] listen` when the program installed its own global `metrics` recorder: a
//! clear startup error (its own file: the global recorder is per process).

use stream_listener::core::handler::HandlerFuture;
use stream_listener::{Config, Delivery, ListenerRegistration, RunError, run_listeners};

fn ignore(_: Delivery) -> HandlerFuture {
    Box::pin(async { Ok(()) })
}

#[tokio::test]
async fn listen_with_a_foreign_recorder_is_a_startup_error_saying_what_to_do() {
    metrics::set_global_recorder(metrics::NoopRecorder).unwrap();
    let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = probe.local_addr().unwrap();
    drop(probe);
    let mut config = Config::default();
    config.redis.url = Some(format!("redis://{address}"));
    config.observability.listen = Some(address.to_string());
    let listeners = vec![ListenerRegistration::new("l", "orders", "g", ignore)];
    let error = run_listeners(config, listeners).await.unwrap_err();
    assert!(matches!(error, RunError::MetricsRecorder), "{error:?}");
    assert!(
        error
            .to_string()
            .contains("remove `listen` from the config and serve the metrics of your own recorder"),
        "{error}"
    );
    // Nothing was bound: the address is still free.
    std::net::TcpListener::bind(address).unwrap();
}
