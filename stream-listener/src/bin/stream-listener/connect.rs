//! Connecting to the standalone server, cluster or Sentinel master the command line names, with
//! the `--tls-*` flags checked, and a failed connection as a [`Failure`] with its exit code.

use stream_listener::core::internals::connection::RedisFailure;
use stream_listener::core::internals::connection::{
    DEFAULT_RESPONSE_TIMEOUT, RedisConnection, RedisTarget, SentinelTarget, TlsOptions, Topology,
    redact_url, redact_urls, tls_advice,
};

use crate::Cli;
use crate::failure::{Failure, one_line};

/// The TLS flags (`--tls-ca-file`, `--tls-cert-file`, `--tls-key-file`, `--tls-insecure`), checked
/// as the `[redis] tls_*` keys are: a certificate needs its key, `--tls-insecure` excludes
/// `--tls-ca-file`, and any of them needs `rediss://` URLs.
fn tls_options(cli: &Cli, urls: &[&str]) -> Result<TlsOptions, Failure> {
    let mut tls = TlsOptions::default();
    tls.ca_file = cli.tls_ca_file.clone();
    tls.cert_file = cli.tls_cert_file.clone();
    tls.key_file = cli.tls_key_file.clone();
    tls.insecure = cli.tls_insecure;
    if tls.cert_file.is_some() != tls.key_file.is_some() {
        return Err(Failure::Usage(
            "mutual TLS needs both --tls-cert-file and --tls-key-file".into(),
        ));
    }
    if tls.insecure && tls.ca_file.is_some() {
        return Err(Failure::Usage(
            "--tls-insecure skips verifying the server, so --tls-ca-file would not be used: give one of them".into(),
        ));
    }
    let any = tls.ca_file.is_some() || tls.cert_file.is_some() || tls.insecure;
    if let Some(plain) = urls.iter().find(|u| !u.starts_with("rediss://"))
        && any
    {
        return Err(Failure::Usage(format!(
            "the --tls-* flags need rediss:// URLs, but {} is plain redis://; write it as rediss://host:port",
            redact_url(plain)
        )));
    }
    if tls.insecure {
        eprintln!(
            "warning: --tls-insecure: the server's TLS certificate is not verified (tests only)"
        );
    }
    Ok(tls)
}

/// The URL of a standalone server when `--redis-url` (`REDIS_URL`) is not given.
const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";

/// The target the command line names, how to show it (passwords redacted), and the URLs the
/// `--tls-*` flags need to be `rediss://`.
///
/// # Errors
/// [`Failure::Usage`] when `--sentinel` and `--sentinel-master` do not come together, or come
/// with `--cluster-node`.
pub(crate) fn target_of(cli: &Cli) -> Result<(RedisTarget, String, Vec<&str>), Failure> {
    let redis_url = cli.redis_url.as_deref().unwrap_or(DEFAULT_REDIS_URL);
    let sentinel = !cli.sentinels.is_empty() || cli.sentinel_master.is_some();
    let (target, shown) = if sentinel {
        let (Some(master), false) = (&cli.sentinel_master, cli.sentinels.is_empty()) else {
            return Err(Failure::Usage(
                "--sentinel and --sentinel-master (or REDIS_SENTINELS and REDIS_SENTINEL_MASTER) go together: the sentinels to ask and the master name they monitor".into(),
            ));
        };
        if !cli.cluster_nodes.is_empty() {
            return Err(Failure::Usage(
                "give either --sentinel (a master found through Redis Sentinel) or --cluster-node (a Redis Cluster), not both".into(),
            ));
        }
        let mut target = SentinelTarget::new(cli.sentinels.clone(), master.clone());
        // Without --redis-url the master speaks TLS when every sentinel does (as `[redis]`
        // without `url`); the plain default URL would make it plain.
        target.master_auth = cli.redis_url.clone();
        let shown = redact_urls(&cli.sentinels);
        (
            RedisTarget::sentinel(target),
            format!("sentinel master {master} via {}", shown.join(", ")),
        )
    } else if cli.cluster_nodes.is_empty() {
        (
            RedisTarget::standalone(redis_url.to_owned()),
            redact_url(redis_url),
        )
    } else {
        let shown = redact_urls(&cli.cluster_nodes);
        (
            RedisTarget::cluster(cli.cluster_nodes.clone()),
            format!("cluster {}", shown.join(", ")),
        )
    };
    let urls: Vec<&str> = if sentinel {
        cli.sentinels.iter().map(String::as_str).collect()
    } else if cli.cluster_nodes.is_empty() {
        vec![redis_url]
    } else {
        cli.cluster_nodes.iter().map(String::as_str).collect()
    };
    Ok((target, shown, urls))
}

/// Connects to the standalone server, cluster or Sentinel master the command line names.
pub(crate) async fn connect(cli: &Cli) -> Result<RedisConnection, Failure> {
    let (target, shown, urls) = target_of(cli)?;
    let sentinel = matches!(target.topology(), Topology::Sentinel(_));
    let target = target.with_tls(tls_options(cli, &urls)?);
    RedisConnection::connect(&target, DEFAULT_RESPONSE_TIMEOUT)
        .await
        .map_err(|err| {
            let text = one_line(&err.to_string());
            if let Some(advice) = tls_advice(&err) {
                Failure::Operation(format!(
                    "TLS with Redis at {shown} failed ({text}): {advice}"
                ))
            } else if err.kind() == redis::ErrorKind::InvalidClientConfig
                && text.contains("tls_")
            {
                // A TLS file named by its `[redis]` key: give the flag's name too.
                Failure::Usage(format!(
                    "invalid TLS file: {text}; give --tls-ca-file, --tls-cert-file and --tls-key-file readable PEM files"
                ))
            } else if sentinel && err.kind() == redis::ErrorKind::InvalidClientConfig {
                Failure::Usage(format!(
                    "cannot use {shown}: {text}; check --sentinel (REDIS_SENTINELS) and --sentinel-master (REDIS_SENTINEL_MASTER)"
                ))
            } else if err.kind() == redis::ErrorKind::InvalidClientConfig {
                Failure::Usage(format!(
                    "invalid Redis address {shown}: {text}; write it as redis://[user:password@]host:port[/db]"
                ))
            } else if RedisFailure::of(&err).is_unreachable() {
                Failure::Unreachable(format!(
                    "cannot reach Redis at {shown}: {text}; check that Redis is running and that --redis-url (or REDIS_URL, or --cluster-node, or --sentinel) points at it"
                ))
            } else {
                Failure::Operation(format!("cannot connect to Redis at {shown}: {text}"))
            }
        })
}
