//! TLS for the throwaway servers: certificates made at test time ([`TlsMaterial`], with rcgen)
//! and the `redis-server` TLS directives ([`TlsAuthClients`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use super::HarnessError;
use super::probe;
use crate::connection::TlsOptions;

/// The names the server certificate is valid for: the harness binds `127.0.0.1` only.
const SERVER_NAMES: [&str; 2] = ["127.0.0.1", "localhost"];

/// Whether a TLS server asks clients for a certificate (`tls-auth-clients`,
/// <https://redis.io/docs/latest/operate/oss_and_stack/management/security/encryption/>).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum TlsAuthClients {
    /// `tls-auth-clients optional`: a client certificate is checked when sent, not required.
    #[default]
    Optional,
    /// `tls-auth-clients yes`: mutual TLS, a client without a certificate signed by the CA is
    /// refused during the handshake.
    Required,
}

impl TlsAuthClients {
    fn as_str(self) -> &'static str {
        match self {
            TlsAuthClients::Optional => "optional",
            TlsAuthClients::Required => "yes",
        }
    }
}

/// PEM files made at test time: a certificate authority, a server certificate for
/// `127.0.0.1` and `localhost` (also usable as a client certificate, as Redis uses it for
/// replication and the cluster bus), and a client certificate, all signed by the CA (ECDSA P-256).
/// Another [`TlsMaterial::generate`] makes an unrelated CA: the "wrong CA" of a test.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsMaterial {
    ca_file: PathBuf,
    server_cert_file: PathBuf,
    server_key_file: PathBuf,
    client_cert_file: PathBuf,
    client_key_file: PathBuf,
    /// The first name of the server certificate: the one the probe verifies.
    server_name: String,
}

impl TlsMaterial {
    /// Makes a new CA and the certificates it signs, and writes them to `dir` as `ca.crt`,
    /// `server.crt`, `server.key`, `client.crt` and `client.key`.
    ///
    /// # Errors
    /// [`HarnessError::Tls`] if a certificate cannot be made; [`HarnessError::Io`] if a file
    /// cannot be written.
    pub fn generate(dir: &Path) -> Result<Self, HarnessError> {
        Self::generate_for(dir, &SERVER_NAMES)
    }

    /// As [`generate`](Self::generate) with a server certificate valid for `server_names` only
    /// (host names or IP addresses): without `127.0.0.1` among them, a client of the harness's
    /// server sees a certificate for another host (the "wrong host name" case of a test).
    ///
    /// # Errors
    /// As [`generate`](Self::generate); [`HarnessError::Tls`] for a name that is neither a DNS
    /// name nor an IP address.
    pub fn generate_for(dir: &Path, server_names: &[&str]) -> Result<Self, HarnessError> {
        let err = |what: &str| {
            let what = what.to_owned();
            move |e: rcgen::Error| HarnessError::tls(what, e)
        };
        let ca_key = KeyPair::generate().map_err(err("CA key"))?;
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).map_err(err("CA"))?;
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "stream-listener test CA");
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca = ca_params.self_signed(&ca_key).map_err(err("CA"))?;
        let leaf = |names: Vec<String>, purposes: Vec<ExtendedKeyUsagePurpose>, cn: &str| {
            let key = KeyPair::generate().map_err(err("key"))?;
            let mut params = CertificateParams::new(names).map_err(err(cn))?;
            params.distinguished_name.push(DnType::CommonName, cn);
            params.extended_key_usages = purposes;
            let cert = params.signed_by(&key, &ca, &ca_key).map_err(err(cn))?;
            Ok::<_, HarnessError>((cert.pem(), key.serialize_pem()))
        };
        let (server_cert, server_key) = leaf(
            server_names.iter().map(|n| (*n).to_owned()).collect(),
            vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ],
            "stream-listener test server",
        )?;
        let (client_cert, client_key) = leaf(
            Vec::new(),
            vec![ExtendedKeyUsagePurpose::ClientAuth],
            "stream-listener test client",
        )?;
        let material = TlsMaterial {
            ca_file: dir.join("ca.crt"),
            server_cert_file: dir.join("server.crt"),
            server_key_file: dir.join("server.key"),
            client_cert_file: dir.join("client.crt"),
            client_key_file: dir.join("client.key"),
            server_name: server_names
                .first()
                .copied()
                .unwrap_or("localhost")
                .to_owned(),
        };
        for (path, pem) in [
            (&material.ca_file, ca.pem()),
            (&material.server_cert_file, server_cert),
            (&material.server_key_file, server_key),
            (&material.client_cert_file, client_cert),
            (&material.client_key_file, client_key),
        ] {
            std::fs::write(path, pem)
                .map_err(|e| HarnessError::io(format!("cannot write {}", path.display()), e))?;
        }
        Ok(material)
    }

    /// The CA certificate (`tls_ca_file`, `--tls-ca-cert-file`).
    pub fn ca_file(&self) -> &Path {
        &self.ca_file
    }

    /// The server certificate (`--tls-cert-file`), for `127.0.0.1` and `localhost`.
    pub fn server_cert_file(&self) -> &Path {
        &self.server_cert_file
    }

    /// The server certificate's private key (`--tls-key-file`).
    pub fn server_key_file(&self) -> &Path {
        &self.server_key_file
    }

    /// The client certificate (`tls_cert_file`) for mutual TLS.
    pub fn client_cert_file(&self) -> &Path {
        &self.client_cert_file
    }

    /// The client certificate's private key (`tls_key_file`).
    pub fn client_key_file(&self) -> &Path {
        &self.client_key_file
    }

    /// The client's TLS settings: this CA, no client certificate.
    pub fn ca_only(&self) -> TlsOptions {
        TlsOptions {
            ca_file: Some(self.ca_file.clone()),
            ..TlsOptions::default()
        }
    }

    /// The client's TLS settings for mutual TLS: this CA and the client certificate.
    pub fn mutual(&self) -> TlsOptions {
        TlsOptions {
            cert_file: Some(self.client_cert_file.clone()),
            key_file: Some(self.client_key_file.clone()),
            ..self.ca_only()
        }
    }

    /// The `redis-server` arguments of a TLS-only server on `port`: `--port 0 --tls-port <port>`,
    /// the certificate, key and CA files, `--tls-auth-clients`, and TLS for replication and the
    /// cluster bus (`--tls-replication yes --tls-cluster yes`).
    pub(crate) fn server_args(&self, port: u16, auth: TlsAuthClients) -> Vec<(String, String)> {
        let path = |p: &Path| p.display().to_string();
        [
            ("port", "0".to_owned()),
            ("tls-port", port.to_string()),
            ("tls-cert-file", path(&self.server_cert_file)),
            ("tls-key-file", path(&self.server_key_file)),
            ("tls-ca-cert-file", path(&self.ca_file)),
            ("tls-auth-clients", auth.as_str().to_owned()),
            ("tls-replication", "yes".to_owned()),
            ("tls-cluster", "yes".to_owned()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
    }

    /// The `redis-cli` arguments to talk to such a server (`--tls --cacert --cert --key`).
    pub(crate) fn cli_args(&self) -> Vec<std::ffi::OsString> {
        vec![
            "--tls".into(),
            "--cacert".into(),
            self.ca_file.clone().into(),
            "--cert".into(),
            self.client_cert_file.clone().into(),
            "--key".into(),
            self.client_key_file.clone().into(),
        ]
    }

    /// The redis-rs certificates for mutual TLS with this CA.
    ///
    /// # Errors
    /// [`HarnessError::Io`] if a file cannot be read.
    pub(crate) fn redis_certificates(&self) -> Result<redis::TlsCertificates, HarnessError> {
        let read = |p: &Path| {
            std::fs::read(p)
                .map_err(|e| HarnessError::io(format!("cannot read {}", p.display()), e))
        };
        Ok(redis::TlsCertificates {
            client_tls: Some(redis::ClientTlsConfig {
                client_cert: read(&self.client_cert_file)?,
                client_key: read(&self.client_key_file)?,
            }),
            root_cert: Some(read(&self.ca_file)?),
        })
    }

    /// The probe's TLS transport: trusts this CA, verifies the server certificate's first name, presents the client certificate (so it
    /// works with `tls-auth-clients yes`), ring as the crypto provider (no process default needed).
    ///
    /// # Errors
    /// [`HarnessError::Tls`] if the files do not parse.
    pub(crate) fn probe_config(&self) -> Result<probe::Transport, HarnessError> {
        let tls = |what: &str| {
            let what = what.to_owned();
            move |e: rustls::pki_types::pem::Error| HarnessError::tls(what, e)
        };
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_file_iter(&self.ca_file).map_err(tls("CA file"))? {
            roots
                .add(cert.map_err(tls("CA file"))?)
                .map_err(|e| HarnessError::tls("CA file", e))?;
        }
        let chain = CertificateDer::pem_file_iter(&self.client_cert_file)
            .map_err(tls("client certificate"))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(tls("client certificate"))?;
        let key = PrivateKeyDer::from_pem_file(&self.client_key_file).map_err(tls("client key"))?;
        let provider = Arc::new(crate::connection::ring_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| HarnessError::tls("protocol versions", e))?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .map_err(|e| HarnessError::tls("client certificate", e))?;
        let name = rustls::pki_types::ServerName::try_from(self.server_name.clone())
            .map_err(|e| HarnessError::tls("server name", e))?;
        Ok(probe::Transport::Tls(Arc::new(config), name))
    }
}
