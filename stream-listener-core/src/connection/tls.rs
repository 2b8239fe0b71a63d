//! TLS for `rediss://` targets (docs/design.md §15.1): the crypto provider, the PEM files of
//! [`TlsOptions`] read for redis-rs, and the standalone client with them. What a failed
//! handshake means is in [`super::tls_failure`].

use super::TlsOptions;

/// Installs ring as rustls's process-wide crypto provider, once, unless the application has
/// installed one already: redis-rs's rustls support (no default features) builds its TLS
/// configurations from the process default (docs/design.md §15.1). Called before every
/// connection, so users never have to.
pub(crate) fn install_crypto_provider() {
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    INSTALLED.call_once(|| {
        // An Err means another provider is installed already: that one is used.
        let _ = ring_provider().install_default();
    });
}

/// rustls's *ring* provider. rustls 0.23.48 deprecated it for its lack of post-quantum key
/// exchange; its other provider, aws-lc-rs, needs cmake and a C toolchain to build on every
/// platform a user builds on, so *ring* stays, on purpose, until redis-rs and rustls 0.24 settle
/// which provider crates to use (docs/design.md §15.1).
#[allow(deprecated)]
pub(crate) fn ring_provider() -> rustls::crypto::CryptoProvider {
    rustls::crypto::ring::default_provider()
}

/// The PEM files of `tls` read and checked, for redis-rs (`Client::build_with_tls`,
/// `ClusterClientBuilder::certs`, Sentinel's `TlsCertificates`): `None` when neither
/// `tls_ca_file` nor a client certificate is set (a `rediss://` URL then verifies against the
/// system's root certificates).
///
/// # Errors
/// [`redis::ErrorKind::InvalidClientConfig`] naming the setting and the path when a file is
/// missing, unreadable or holds no certificate (no private key for `tls_key_file`), and when
/// `tls_cert_file` is set without `tls_key_file` or the reverse.
pub(crate) fn tls_certificates(
    tls: &TlsOptions,
) -> redis::RedisResult<Option<redis::TlsCertificates>> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    install_crypto_provider();
    let certificates = |setting: &str, path: &std::path::Path| {
        let pem = read_pem(setting, path)?;
        match CertificateDer::pem_slice_iter(&pem).collect::<Result<Vec<_>, _>>() {
            Ok(certs) if !certs.is_empty() => Ok(pem),
            Ok(_) => Err(invalid_tls_file(
                setting,
                path,
                "no certificate in it".into(),
            )),
            Err(e) => Err(invalid_tls_file(setting, path, e.to_string())),
        }
    };
    let client_tls = match (&tls.cert_file, &tls.key_file) {
        (Some(cert), Some(key)) => {
            let client_cert = certificates("tls_cert_file", cert)?;
            let client_key = read_pem("tls_key_file", key)?;
            let key_der = PrivateKeyDer::from_pem_slice(&client_key)
                .map_err(|e| invalid_tls_file("tls_key_file", key, e.to_string()))?;
            // What redis-rs does only when it connects, so that a certificate rustls refuses
            // (an X.509 v1 one: "invalid peer certificate: UnsupportedCertVersion", although it
            // is the client's own) is named here, with the file.
            let chain = CertificateDer::pem_slice_iter(&client_cert)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| invalid_tls_file("tls_cert_file", cert, e.to_string()))?;
            rustls::ClientConfig::builder()
                .with_root_certificates(rustls::RootCertStore::empty())
                .with_client_auth_cert(chain, key_der)
                .map_err(|e| {
                    invalid_tls_file(
                        "tls_cert_file",
                        cert,
                        format!(
                            "rustls cannot use it with tls_key_file {:?}: {e}; certificates must be X.509 v3 (`openssl x509 -req` makes v1 ones unless given -extfile)",
                            key.display().to_string()
                        ),
                    )
                })?;
            Some(redis::ClientTlsConfig {
                client_cert,
                client_key,
            })
        }
        (None, None) => None,
        (Some(_), None) | (None, Some(_)) => {
            return Err(redis::RedisError::from((
                redis::ErrorKind::InvalidClientConfig,
                "mutual TLS needs both tls_cert_file and tls_key_file",
                "set both (the client certificate and its private key, PEM) or neither".to_owned(),
            )));
        }
    };
    let root_cert = match &tls.ca_file {
        Some(ca) => Some(certificates("tls_ca_file", ca)?),
        None => None,
    };
    if client_tls.is_none() && root_cert.is_none() {
        return Ok(None);
    }
    Ok(Some(redis::TlsCertificates {
        client_tls,
        root_cert,
    }))
}

fn read_pem(setting: &str, path: &std::path::Path) -> redis::RedisResult<Vec<u8>> {
    std::fs::read(path).map_err(|e| invalid_tls_file(setting, path, format!("cannot read it: {e}")))
}

fn invalid_tls_file(setting: &str, path: &std::path::Path, why: String) -> redis::RedisError {
    redis::RedisError::from((
        redis::ErrorKind::InvalidClientConfig,
        "invalid TLS file",
        format!(
            "{setting} = {:?}: {why} (a PEM file is expected)",
            path.display().to_string()
        ),
    ))
}

/// The standalone client of `url` with `tls`: certificates from [`tls_certificates`], and no
/// verification of the server when `tls.insecure` (redis-rs's `#insecure`).
pub(super) fn standalone_client(url: &str, tls: &TlsOptions) -> redis::RedisResult<redis::Client> {
    use redis::IntoConnectionInfo;
    client_of(url.into_connection_info()?, tls)
}

/// The client of `info` with `tls`, as [`standalone_client`] (the Sentinel code reaches the
/// sentinels and the master with it).
pub(super) fn client_of(
    mut info: redis::ConnectionInfo,
    tls: &TlsOptions,
) -> redis::RedisResult<redis::Client> {
    use redis::ConnectionAddr;
    if tls.insecure {
        let ConnectionAddr::TcpTls {
            host,
            port,
            tls_params,
            ..
        } = info.addr().clone()
        else {
            return Err(redis::RedisError::from((
                redis::ErrorKind::InvalidClientConfig,
                "tls_insecure needs a rediss:// URL",
            )));
        };
        info = info.set_addr(ConnectionAddr::TcpTls {
            host,
            port,
            insecure: true,
            tls_params,
        });
    }
    match tls_certificates(tls)? {
        Some(certs) => redis::Client::build_with_tls(info, certs),
        None => redis::Client::open(info),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tls_file(name: &str, contents: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("sl-tls-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        std::fs::write(&path, contents).unwrap();
        path
    }

    /// A self-signed X.509 v1 certificate (what `openssl x509 -req` makes without `-extfile`)
    /// and its key.
    const V1_CERT: &str = "-----BEGIN CERTIFICATE-----
MIIBFjCBvQIUdFrWg+2Wijs4iGuIiN++ZZ2DtxswCgYIKoZIzj0EAwIwDTELMAkG
A1UEAwwCdjEwIBcNMjYxMjAxMjM1NDMzWhgPMjEyNjExMDcyMzU0MzNaMA0xCzAJ
BgNVBAMMAnYxMFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAEkegvCGv9INkc5Yd0
yeGgO4yc9rZDm9NMb8H/HjwlYOu2XqNDxxYBzb4qp1sbdihOjQINK5CcS6mX8Yo8
HMSoTjAKBggqhkjOPQQDAgNIADBFAiBj7iNVeTqdX1XRRWv2YCiNdC2eZtSym7QW
FQYmTke5rQIhAPHh/+sxPF+oPP+LtPBeUkH6Fgsna6UT0yeLPziB7jJA
-----END CERTIFICATE-----
";
    const V1_KEY: &str = "-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQg4GxSRoflT0b86kWo
hv3+P/xn86Up5PCJ/+B2OAtOZVKhRANCAASR6C8Ia/0g2Rzlh3TJ4aA7jJz2tkOb
00xvwf8ePCVg67Zeo0PHFgHNviqnWxt2KE6NAg0rkJxLqZfxijwcxKhO
-----END PRIVATE KEY-----
";

    #[test]
    fn a_v1_client_certificate_is_an_invalid_tls_file_naming_it() {
        let tls = TlsOptions {
            cert_file: Some(tls_file("v1.crt", V1_CERT)),
            key_file: Some(tls_file("v1.key", V1_KEY)),
            ..TlsOptions::default()
        };
        let error = tls_certificates(&tls).unwrap_err();
        assert_eq!(error.kind(), redis::ErrorKind::InvalidClientConfig);
        let text = error.to_string();
        assert!(
            text.contains("invalid TLS file")
                && text.contains("tls_cert_file = ")
                && text.contains("v3"),
            "{text}"
        );
    }

    #[test]
    fn tls_files_are_checked_and_named_in_errors() {
        assert!(tls_certificates(&TlsOptions::default()).unwrap().is_none());
        let mut tls = TlsOptions {
            ca_file: Some("/nonexistent/ca.crt".into()),
            ..TlsOptions::default()
        };
        let error = tls_certificates(&tls).unwrap_err();
        assert_eq!(error.kind(), redis::ErrorKind::InvalidClientConfig);
        let text = error.to_string();
        assert!(
            text.contains("tls_ca_file = \"/nonexistent/ca.crt\": cannot read it"),
            "{text}"
        );

        tls.ca_file = Some(tls_file("not-pem.crt", "hello"));
        let text = tls_certificates(&tls).unwrap_err().to_string();
        assert!(
            text.contains("tls_ca_file") && text.contains("no certificate"),
            "{text}"
        );

        let tls = TlsOptions {
            cert_file: Some("/c.crt".into()),
            ..TlsOptions::default()
        };
        let text = tls_certificates(&tls).unwrap_err().to_string();
        assert!(text.contains("tls_cert_file and tls_key_file"), "{text}");
    }
}
