//! What a failed TLS handshake means and what to check (docs/design.md §15.1), the one place
//! that reads redis-rs's TLS errors for [`RedisFailure::of`].
//!
//! redis-rs returns every TLS failure as an I/O error wrapping rustls's error (the `source()`
//! chain stops at the `std::io::Error`, whose `get_ref()` holds the `rustls::Error`): a server
//! certificate that does not verify is `InvalidCertificate(..)`, a server refusing the client's
//! certificate is `AlertReceived(CertificateRequired | BadCertificate | UnknownCA ..)`. A
//! `redis://` URL against a TLS-only server only gets "connection reset by peer" (the server
//! closes after "wrong version number"), which a crashed server gives too; so after such a
//! failure [`explain_plaintext_failure`] sends one TLS ClientHello and, when the server answers
//! with a TLS handshake record, returns [`ServerSpeaksTls`] instead. The reverse, `rediss://`
//! against a plain server, is a timeout (the server never answers the ClientHello):
//! [`explain_tls_failure`] then sends a plain `PING` and returns [`ServerSpeaksPlain`] when it is
//! answered. redis-rs's cluster client
//! keeps the rustls error only as text ("Failed to create initial connections - Io: invalid peer
//! certificate: ..."), so [`explain_cluster_failure`] makes one connection to the first seed
//! alone, whose error keeps its type.

use std::sync::Arc;
use std::time::Duration;

use super::tls::standalone_client;
use super::{RedisFailure, TlsOptions};

/// How long the checks of [`explain_plaintext_failure`] and [`explain_tls_failure`] wait for the
/// server's first byte.
const TLS_CHECK_TIMEOUT: Duration = Duration::from_secs(1);
/// The first byte of a TLS handshake record (RFC 8446 §5.1, `ContentType.handshake`).
const TLS_HANDSHAKE_RECORD: u8 = 0x16;

/// A `redis://` URL reached a server that answers a TLS handshake: it must be `rediss://`.
#[derive(Debug, thiserror::Error)]
#[error(
    "the server at {address} speaks TLS but the URL is plain redis://; use rediss://{address} (with tls_ca_file)"
)]
pub(crate) struct ServerSpeaksTls {
    /// `host:port`.
    address: String,
}

/// A `rediss://` URL reached a server that answers plain RESP on that port: no TLS there.
#[derive(Debug, thiserror::Error)]
#[error(
    "the server at {address} answers plain RESP, not TLS, but the URL is rediss://; use redis://{address}, or the server's tls-port"
)]
pub(crate) struct ServerSpeaksPlain {
    /// `host:port`.
    address: String,
}

/// Why a TLS handshake failed, read from redis-rs's error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TlsCause {
    /// The server's certificate did not verify (rustls `InvalidCertificate`).
    ServerCertificate,
    /// The server refused the client: no client certificate, or one it does not trust.
    ClientRejected,
    /// A plain `redis://` connection reached a TLS server ([`ServerSpeaksTls`]).
    PlaintextToTls,
    /// Another TLS error (protocol versions, cipher suites, a malformed record).
    Other,
    /// A `rediss://` connection reached a port that speaks plain RESP ([`ServerSpeaksPlain`]).
    TlsToPlaintext,
}

/// The TLS cause of `error`, if it is a TLS failure: looks through the `source()` chain and
/// into `std::io::Error`s (whose `source()` skips the error they wrap). redis-rs's `source()` of
/// an I/O error is the `Arc<dyn Error + Send + Sync>` it keeps the `std::io::Error` in, so that
/// is looked through too (pinned by a unit test: a change in redis-rs fails it).
pub(crate) fn tls_cause(error: &redis::RedisError) -> Option<TlsCause> {
    type Shared = Arc<dyn std::error::Error + Send + Sync>;
    let mut next: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(current) = next {
        let unshared = current
            .downcast_ref::<Shared>()
            .map(|shared| &**shared as &(dyn std::error::Error + 'static))
            .unwrap_or(current);
        let inner = unshared
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .map(|e| e as &(dyn std::error::Error + 'static));
        for candidate in [Some(unshared), inner].into_iter().flatten() {
            if candidate.is::<ServerSpeaksTls>() {
                return Some(TlsCause::PlaintextToTls);
            }
            if candidate.is::<ServerSpeaksPlain>() {
                return Some(TlsCause::TlsToPlaintext);
            }
            if let Some(tls) = candidate.downcast_ref::<rustls::Error>() {
                return Some(cause_of(tls));
            }
        }
        next = current.source();
    }
    None
}

fn cause_of(error: &rustls::Error) -> TlsCause {
    use rustls::AlertDescription as Alert;
    match error {
        rustls::Error::InvalidCertificate(_) => TlsCause::ServerCertificate,
        rustls::Error::AlertReceived(
            Alert::CertificateRequired
            | Alert::BadCertificate
            | Alert::UnknownCA
            | Alert::CertificateUnknown
            | Alert::CertificateExpired
            | Alert::CertificateRevoked
            | Alert::UnsupportedCertificate
            | Alert::AccessDenied
            | Alert::DecryptError,
        ) => TlsCause::ClientRejected,
        _ => TlsCause::Other,
    }
}

/// What to check when `error` is a failed TLS handshake ([`RedisFailure::TlsHandshake`]), in one
/// sentence naming the settings; `None` for any other error.
pub fn tls_advice(error: &redis::RedisError) -> Option<&'static str> {
    Some(match tls_cause(error)? {
        TlsCause::ServerCertificate => {
            "TLS verification of the server's certificate failed: check that tls_ca_file (--tls-ca-file) is the CA that signed the server's certificate and that the URL's host is a name or IP address the certificate lists (tls_insecure = true skips verification: for tests only)"
        }
        TlsCause::ClientRejected => {
            "the server refused this client during the TLS handshake: it wants a client certificate its CA signed; set tls_cert_file and tls_key_file (--tls-cert-file, --tls-key-file) to one"
        }
        TlsCause::PlaintextToTls => {
            "the server seems to speak TLS: write the URL as rediss://host:port (and set tls_ca_file to the CA of its certificate)"
        }
        TlsCause::TlsToPlaintext => {
            "the server does not speak TLS on this port: write the URL as redis://host:port, or point rediss:// at the server's tls-port"
        }
        TlsCause::Other => {
            "the TLS handshake failed: check that the server's TLS settings (tls-protocols, tls-ciphers) allow TLS 1.2 or 1.3"
        }
    })
}

/// `error` of a connection to `url`, explained by [`explain_plaintext_failure`] for a `redis://`
/// URL and [`explain_tls_failure`] for a `rediss://` one.
pub(crate) async fn explain_failure(url: &str, error: redis::RedisError) -> redis::RedisError {
    if url.starts_with("rediss://") {
        explain_tls_failure(url, error).await
    } else {
        explain_plaintext_failure(url, error).await
    }
}

/// `error` of a connection to the `rediss://` URL `url`, or [`ServerSpeaksPlain`] when it timed
/// out (a plain server never answers a ClientHello) and the port answers a plain `PING` (at most
/// [`TLS_CHECK_TIMEOUT`]). Other errors are returned as is.
pub(crate) async fn explain_tls_failure(url: &str, error: redis::RedisError) -> redis::RedisError {
    use redis::{ConnectionAddr, IntoConnectionInfo};
    if !error.is_timeout() {
        return error;
    }
    let Ok(info) = url.into_connection_info() else {
        return error;
    };
    let ConnectionAddr::TcpTls { host, port, .. } = info.addr() else {
        return error;
    };
    match tokio::time::timeout(TLS_CHECK_TIMEOUT, speaks_plain_resp(host, *port)).await {
        Ok(Ok(true)) => redis::RedisError::from(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            ServerSpeaksPlain {
                address: format!("{host}:{port}"),
            },
        )),
        _ => error,
    }
}

/// Whether `host:port` answers an inline `PING` with a RESP reply (`+PONG`, or `-NOAUTH ...`
/// from a server with a password): plain Redis, not TLS.
async fn speaks_plain_resp(host: &str, port: u16) -> std::io::Result<bool> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect((host, port)).await?;
    stream.write_all(b"PING\r\n").await?;
    let mut first = [0u8; 1];
    stream.read_exact(&mut first).await?;
    Ok(matches!(first[0], b'+' | b'-'))
}

/// `error` of a connection to the plain `redis://` URL `url`, or [`ServerSpeaksTls`] when the
/// connection was reset or closed and the server answers a TLS ClientHello (at most
/// [`TLS_CHECK_TIMEOUT`]). Refused connections, timeouts and other errors are returned as is.
pub(crate) async fn explain_plaintext_failure(
    url: &str,
    error: redis::RedisError,
) -> redis::RedisError {
    use redis::{ConnectionAddr, IntoConnectionInfo};
    if RedisFailure::of(&error) != RedisFailure::ConnectionLost || error.is_connection_refusal() {
        return error;
    }
    let Ok(info) = url.into_connection_info() else {
        return error;
    };
    let ConnectionAddr::Tcp(host, port) = info.addr() else {
        return error;
    };
    match tokio::time::timeout(TLS_CHECK_TIMEOUT, speaks_tls(host, *port)).await {
        Ok(Ok(true)) => redis::RedisError::from(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            ServerSpeaksTls {
                address: format!("{host}:{port}"),
            },
        )),
        _ => error,
    }
}

/// `error` of a cluster connection to the seeds `nodes`, or the TLS error of one connection to
/// the first seed: redis-rs's cluster client reports "Failed to create initial connections" with
/// the rustls error only as text, so the handshake is tried once more, alone, where the error
/// keeps its type (at most [`TLS_CHECK_TIMEOUT`] more, and only after a lost connection). A plain
/// `redis://` first seed is checked as [`explain_plaintext_failure`] does.
pub(crate) async fn explain_cluster_failure(
    nodes: &[String],
    tls: &TlsOptions,
    error: redis::RedisError,
) -> redis::RedisError {
    let Some(first) = nodes.first() else {
        return error;
    };
    if !first.starts_with("rediss://") {
        return explain_plaintext_failure(first, error).await;
    }
    if error.is_timeout() {
        return explain_tls_failure(first, error).await;
    }
    if RedisFailure::of(&error) != RedisFailure::ConnectionLost {
        return error;
    }
    let Ok(client) = standalone_client(first, tls) else {
        return error;
    };
    match tokio::time::timeout(TLS_CHECK_TIMEOUT, client.get_multiplexed_async_connection()).await {
        Ok(Err(alone)) if tls_cause(&alone).is_some() => alone,
        _ => error,
    }
}

/// Whether `host:port` answers a TLS ClientHello with a TLS handshake record (its ServerHello).
async fn speaks_tls(host: &str, port: u16) -> std::io::Result<bool> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let name =
        rustls::pki_types::ServerName::try_from(host.to_owned()).map_err(std::io::Error::other)?;
    // Nothing is verified: the handshake is never finished, only the server's first byte read.
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(super::ring_provider()))
        .with_safe_default_protocol_versions()
        .map_err(std::io::Error::other)?
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
    let mut hello = Vec::new();
    rustls::ClientConnection::new(Arc::new(config), name)
        .map_err(std::io::Error::other)?
        .write_tls(&mut hello)?;
    let mut stream = tokio::net::TcpStream::connect((host, port)).await?;
    stream.write_all(&hello).await?;
    let mut first = [0u8; 1];
    stream.read_exact(&mut first).await?;
    Ok(first[0] == TLS_HANDSHAKE_RECORD)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn io_wrapped(error: impl std::error::Error + Send + Sync + 'static) -> redis::RedisError {
        redis::RedisError::from(std::io::Error::new(std::io::ErrorKind::InvalidData, error))
    }

    #[test]
    fn rustls_errors_inside_io_errors_are_tls_failures() {
        let wrong_ca = io_wrapped(rustls::Error::InvalidCertificate(
            rustls::CertificateError::UnknownIssuer,
        ));
        assert_eq!(tls_cause(&wrong_ca), Some(TlsCause::ServerCertificate));
        assert_eq!(RedisFailure::of(&wrong_ca), RedisFailure::TlsHandshake);
        assert!(tls_advice(&wrong_ca).unwrap().contains("tls_ca_file"));
        let refused = io_wrapped(rustls::Error::AlertReceived(
            rustls::AlertDescription::CertificateRequired,
        ));
        assert_eq!(tls_cause(&refused), Some(TlsCause::ClientRejected));
        assert!(tls_advice(&refused).unwrap().contains("tls_cert_file"));
        let plaintext = io_wrapped(ServerSpeaksTls {
            address: "127.0.0.1:6380".into(),
        });
        assert_eq!(tls_cause(&plaintext), Some(TlsCause::PlaintextToTls));
        assert!(tls_advice(&plaintext).unwrap().contains("rediss://"));
        let plain_server = io_wrapped(ServerSpeaksPlain {
            address: "127.0.0.1:6379".into(),
        });
        assert_eq!(tls_cause(&plain_server), Some(TlsCause::TlsToPlaintext));
        assert!(
            tls_advice(&plain_server)
                .unwrap()
                .contains("redis://host:port")
        );
        // Other I/O errors are not TLS failures.
        let reset =
            redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert_eq!(tls_cause(&reset), None);
        assert_eq!(tls_advice(&reset), None);
        assert_eq!(RedisFailure::of(&reset), RedisFailure::ConnectionLost);
    }
}
