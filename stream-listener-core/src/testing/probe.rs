//! A tiny RESP2 client with hard timeouts, used to probe servers while they start.
//!
//! The harness does not probe through redis-rs: a probe must never block longer than its timeout,
//! whatever state the server is in (loading, paused, half started), and must see `-LOADING` as a
//! plain "not yet".

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

/// One RESP2 reply (arrays are not needed by the harness).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Reply {
    /// `+OK`, `+PONG`.
    Simple(String),
    /// `-ERR ...`, `-LOADING ...`.
    Error(String),
    /// `:42`.
    Integer(i64),
    /// `$n` then n bytes (lossily decoded), or `$-1` (None).
    Bulk(Option<String>),
}

/// How a probe reaches a server: plain TCP, or TLS (a TLS-only server, `--port 0`).
#[derive(Debug, Clone, Default)]
pub(crate) enum Transport {
    /// Plain RESP over TCP.
    #[default]
    Plain,
    /// RESP over TLS with this client configuration (the harness's CA and client certificate),
    /// verifying the server certificate for this name.
    Tls(
        Arc<rustls::ClientConfig>,
        rustls::pki_types::ServerName<'static>,
    ),
}

/// Sends one command to `127.0.0.1:port` over `transport` on a fresh connection and reads one
/// reply. Connecting, writing and reading (and over TLS the handshake) each time out after
/// `timeout`.
pub(crate) fn command_via(
    transport: &Transport,
    port: u16,
    args: &[&str],
    timeout: Duration,
) -> io::Result<Reply> {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let stream = TcpStream::connect_timeout(&addr, timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let mut request = format!("*{}\r\n", args.len());
    for arg in args {
        request.push_str(&format!("${}\r\n{arg}\r\n", arg.len()));
    }
    match transport {
        Transport::Plain => exchange(stream, &request),
        Transport::Tls(config, name) => {
            let tls = rustls::ClientConnection::new(config.clone(), name.clone())
                .map_err(io::Error::other)?;
            exchange(rustls::StreamOwned::new(tls, stream), &request)
        }
    }
}

fn exchange(stream: impl Read + Write, request: &str) -> io::Result<Reply> {
    let mut reader = BufReader::new(stream);
    reader.get_mut().write_all(request.as_bytes())?;
    reader.get_mut().flush()?;
    read_reply(&mut reader)
}

fn read_reply(reader: &mut impl BufRead) -> io::Result<Reply> {
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let line = line.trim_end_matches(['\r', '\n']);
    let bad = || io::Error::new(io::ErrorKind::InvalidData, format!("bad reply {line:?}"));
    let (kind, rest) = line.split_at_checked(1).ok_or_else(bad)?;
    match kind {
        "+" => Ok(Reply::Simple(rest.to_owned())),
        "-" => Ok(Reply::Error(rest.to_owned())),
        ":" => rest.parse().map(Reply::Integer).map_err(|_| bad()),
        "$" => {
            let len: i64 = rest.parse().map_err(|_| bad())?;
            let Ok(len) = usize::try_from(len) else {
                return Ok(Reply::Bulk(None));
            };
            let mut data = vec![0; len + 2];
            reader.read_exact(&mut data)?;
            data.truncate(len);
            Ok(Reply::Bulk(Some(
                String::from_utf8_lossy(&data).into_owned(),
            )))
        }
        _ => Err(bad()),
    }
}

/// Reads `name:value` out of an `INFO`-style text.
pub(crate) fn info_field<'a>(info: &'a str, name: &str) -> Option<&'a str> {
    info.lines().find_map(|line| {
        line.strip_prefix(name)
            .and_then(|rest| rest.strip_prefix(':'))
            .map(str::trim)
    })
}
