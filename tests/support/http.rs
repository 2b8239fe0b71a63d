//! A real HTTP/1 client for the observability listener's endpoints (hyper-util's).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// `GET http://{addr}{path}`: the status and the body, or the connection error.
pub async fn get(addr: SocketAddr, path: &str) -> Result<(u16, String), String> {
    let client: Client<_, Empty<&'static [u8]>> =
        Client::builder(TokioExecutor::new()).build_http();
    let request = format!("http://{addr}{path}");
    let response = tokio::time::timeout(
        Duration::from_secs(5),
        client.get(request.parse().map_err(|e| format!("{e}"))?),
    )
    .await
    .map_err(|_| format!("GET {request} timed out"))?
    .map_err(|e| format!("GET {request}: {e}"))?;
    let status = response.status().as_u16();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("body of {request}: {e}"))?
        .to_bytes();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// Polls `GET path` every 50 ms until `done(status, json body)` holds, for at most `timeout`;
/// returns the last answer. Panics with the last answer when the deadline passes.
pub async fn wait_for(
    addr: SocketAddr,
    path: &str,
    timeout: Duration,
    what: &str,
    done: impl Fn(u16, &serde_json::Value) -> bool,
) -> (u16, serde_json::Value) {
    let deadline = Instant::now() + timeout;
    let mut last;
    loop {
        match get(addr, path).await {
            Ok((status, body)) => {
                let json: serde_json::Value = serde_json::from_str(&body)
                    .unwrap_or_else(|e| panic!("{path} answered non-JSON ({e}): {body}"));
                if done(status, &json) {
                    return (status, json);
                }
                last = format!("{status} {json}");
            }
            Err(error) => last = error,
        }
        assert!(
            Instant::now() < deadline,
            "{what}: {path} did not get there within {timeout:?}; last answer: {last}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A port nothing listens on now (bound and released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
