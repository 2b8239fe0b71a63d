//! The `stream-listener` admin tool over TLS (README "TLS"): `--tls-ca-file`, `--tls-cert-file`,
//! `--tls-key-file`, `--tls-insecure` and their `REDIS_TLS_*` variables against a TLS-only
//! server; TLS failures exit 1 with one line naming the flag to fix, misused flags exit 2.

use std::process::Command;

use stream_listener_core::testing::{RedisServer, TlsAuthClients, TlsMaterial};

const BIN: &str = env!("CARGO_BIN_EXE_stream-listener");

/// Runs the tool with `args` and the environment `env` only (no `REDIS_*` of the caller);
/// returns (exit code, stdout, stderr).
fn cli(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut command = Command::new(BIN);
    command.args(args);
    for var in [
        "REDIS_URL",
        "REDIS_TLS_CA_FILE",
        "REDIS_TLS_CERT_FILE",
        "REDIS_TLS_KEY_FILE",
        "REDIS_TLS_INSECURE",
    ] {
        command.env_remove(var);
    }
    command.envs(env.iter().copied());
    let output = command.output().unwrap();
    (
        output.status.code().unwrap(),
        String::from_utf8(output.stdout).unwrap(),
        String::from_utf8(output.stderr).unwrap(),
    )
}

fn path(p: &std::path::Path) -> String {
    p.display().to_string()
}

#[test]
fn admin_commands_run_over_mutual_tls() {
    let server = RedisServer::builder()
        .tls(TlsAuthClients::Required)
        .start()
        .unwrap();
    let url = server.url();
    let tls = server.tls().unwrap();
    let (ca, cert, key) = (
        path(tls.ca_file()),
        path(tls.client_cert_file()),
        path(tls.client_key_file()),
    );
    let flags = [
        "--redis-url",
        url.as_str(),
        "--tls-ca-file",
        ca.as_str(),
        "--tls-cert-file",
        cert.as_str(),
        "--tls-key-file",
        key.as_str(),
    ];
    let mut create = flags.to_vec();
    create.extend(["stream", "create", "orders", "--shards", "2"]);
    let (code, out, err) = cli(&create, &[]);
    assert_eq!((code, err.as_str()), (0, ""));
    assert_eq!(
        out,
        "created stream orders with 2 shards ({orders:0}..{orders:1}), metadataVersion 1\n"
    );

    // The same through the environment.
    let env = [
        ("REDIS_URL", url.as_str()),
        ("REDIS_TLS_CA_FILE", ca.as_str()),
        ("REDIS_TLS_CERT_FILE", cert.as_str()),
        ("REDIS_TLS_KEY_FILE", key.as_str()),
    ];
    let (code, out, err) = cli(&["stream", "list", "--json"], &env);
    assert_eq!((code, err.as_str()), (0, ""));
    assert!(out.contains("\"orders\""), "{out}");

    // Without the client certificate the server refuses the handshake: exit 1, what to set.
    let (code, out, err) = cli(
        &[
            "--redis-url",
            url.as_str(),
            "--tls-ca-file",
            ca.as_str(),
            "stream",
            "list",
        ],
        &[],
    );
    assert_eq!((code, out.as_str()), (1, ""), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with("error: TLS with Redis at rediss://"),
        "{err}"
    );
    assert!(err.contains("--tls-cert-file"), "{err}");
}

#[test]
fn tls_failures_and_misused_flags_say_what_to_fix() {
    let server = RedisServer::builder()
        .tls(TlsAuthClients::Optional)
        .start()
        .unwrap();
    let url = server.url();
    let other_dir = std::env::temp_dir().join(format!("cli-tls-other-{}", std::process::id()));
    std::fs::create_dir_all(&other_dir).unwrap();
    let other = TlsMaterial::generate(&other_dir).unwrap();
    let other_ca = path(other.ca_file());

    let (code, _, err) = cli(
        &[
            "--redis-url",
            url.as_str(),
            "--tls-ca-file",
            other_ca.as_str(),
            "stream",
            "list",
        ],
        &[],
    );
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("TLS verification"), "{err}");
    assert!(err.contains("--tls-ca-file"), "{err}");

    let plain = format!("redis://127.0.0.1:{}", server.port());
    let (code, _, err) = cli(&["--redis-url", plain.as_str(), "stream", "list"], &[]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("speaks TLS"), "{err}");
    assert!(err.contains("rediss://"), "{err}");

    let (code, out, err) = cli(
        &[
            "--redis-url",
            url.as_str(),
            "--tls-insecure",
            "stream",
            "list",
        ],
        &[],
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, "no streams (the index sl:streams is empty)\n");
    assert!(err.contains("warning: --tls-insecure"), "{err}");

    let (code, _, err) = cli(
        &[
            "--redis-url",
            plain.as_str(),
            "--tls-ca-file",
            other_ca.as_str(),
            "stream",
            "list",
        ],
        &[],
    );
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("need rediss:// URLs"), "{err}");

    let (code, _, err) = cli(
        &[
            "--redis-url",
            url.as_str(),
            "--tls-cert-file",
            other_ca.as_str(),
            "stream",
            "list",
        ],
        &[],
    );
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--tls-key-file"), "{err}");

    let (code, _, err) = cli(
        &[
            "--redis-url",
            url.as_str(),
            "--tls-ca-file",
            "/nonexistent/ca.crt",
            "stream",
            "list",
        ],
        &[],
    );
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("/nonexistent/ca.crt"), "{err}");
    let _ = std::fs::remove_dir_all(&other_dir);
}

#[test]
fn admin_commands_run_on_a_tls_cluster() {
    let cluster = stream_listener_core::testing::RedisCluster::builder()
        .tls()
        .start()
        .unwrap();
    let ca = path(cluster.tls().unwrap().ca_file());
    let mut args: Vec<String> = cluster
        .urls()
        .into_iter()
        .flat_map(|url| ["--cluster-node".to_owned(), url])
        .collect();
    args.extend(["--tls-ca-file".to_owned(), ca]);
    args.extend(["stream", "create", "orders", "--shards", "3"].map(String::from));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (code, out, err) = cli(&args, &[]);
    assert_eq!((code, err.as_str()), (0, ""));
    assert!(
        out.starts_with("created stream orders with 3 shards"),
        "{out}"
    );

    // REDIS_TLS_INSECURE=true: no CA, no verification, a warning.
    let first = cluster.urls()[0].clone();
    let (code, out, err) = cli(
        &["--cluster-node", first.as_str(), "stream", "list"],
        &[("REDIS_TLS_INSECURE", "true")],
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("orders"), "{out}");
    assert!(err.contains("warning: --tls-insecure"), "{err}");
}

/// A TLS-only sentinel (`tls-port`, `tls-replication yes`) monitoring the TLS-only `server`
/// under the name `tlsmaster`, started by hand (the Sentinel harness has no TLS); killed on drop.
struct TlsSentinel {
    child: std::process::Child,
    port: u16,
    _dir: std::path::PathBuf,
}

impl TlsSentinel {
    fn start(server: &RedisServer, tls: &TlsMaterial) -> TlsSentinel {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir =
            std::env::temp_dir().join(format!("cli-tls-sentinel-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let conf = dir.join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "port 0\ntls-port {port}\nbind 127.0.0.1\ndir {}\ntls-cert-file {}\ntls-key-file {}\ntls-ca-cert-file {}\ntls-auth-clients yes\ntls-replication yes\nsentinel monitor tlsmaster 127.0.0.1 {} 1\n",
                path(&dir),
                path(tls.server_cert_file()),
                path(tls.server_key_file()),
                path(tls.ca_file()),
                server.port(),
            ),
        )
        .unwrap();
        let binary = std::env::var("STREAM_LISTENER_REDIS_SERVER").unwrap_or("redis-server".into());
        let child = Command::new(binary)
            .arg(&conf)
            .arg("--sentinel")
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "the sentinel did not start"
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        TlsSentinel {
            child,
            port,
            _dir: dir,
        }
    }
}

impl Drop for TlsSentinel {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self._dir);
    }
}

#[test]
fn admin_commands_run_through_a_tls_sentinel_without_redis_url() {
    // README "Sentinel" and "TLS": `rediss://` sentinels and the --tls-* flags are enough; the
    // master is reached with TLS too, as run() does without `[redis] url`.
    let server = RedisServer::builder()
        .tls(TlsAuthClients::Required)
        .start()
        .unwrap();
    let tls = server.tls().unwrap();
    let sentinel = TlsSentinel::start(&server, tls);
    let sentinel_url = format!("rediss://127.0.0.1:{}", sentinel.port);
    let (ca, cert, key) = (
        path(tls.ca_file()),
        path(tls.client_cert_file()),
        path(tls.client_key_file()),
    );
    let (code, out, err) = cli(
        &[
            "--sentinel",
            &sentinel_url,
            "--sentinel-master",
            "tlsmaster",
            "--tls-ca-file",
            &ca,
            "--tls-cert-file",
            &cert,
            "--tls-key-file",
            &key,
            "stream",
            "list",
        ],
        &[],
    );
    assert_eq!((code, err.as_str()), (0, ""), "{out}");
}
