//! TLS for the tests: a throwaway CA (rcgen) that signs server and client
//! certificates, PEM files on disk, SSL on the harness PostgreSQL, psql with
//! connection strings, and a raw TLS client speaking the SSLRequest dance.

use super::{is_root, pg_command, run_ok, PgCluster};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A certificate authority that lives for one test.
pub struct TestCa {
    pub cert_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

/// A certificate and its private key, PEM.
pub struct Pair {
    pub cert_pem: String,
    pub key_pem: String,
}

impl TestCa {
    pub fn new(name: &str) -> TestCa {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        TestCa {
            cert_pem: cert.pem(),
            issuer: Issuer::new(params, key),
        }
    }

    /// A server certificate for these host names / IP addresses.
    pub fn server(&self, names: &[&str]) -> Pair {
        let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        let mut params = CertificateParams::new(names).unwrap();
        params.distinguished_name.push(DnType::CommonName, "server");
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        self.sign(params)
    }

    /// A client certificate whose CN is `cn`.
    pub fn client(&self, cn: &str) -> Pair {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(DnType::CommonName, cn);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.sign(params)
    }

    fn sign(&self, params: CertificateParams) -> Pair {
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Pair {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        }
    }
}

/// Writes `text` to `dir/name` (mode 0600: libpq and PostgreSQL refuse key
/// files others can read) and returns the path.
pub fn write_file(dir: &Path, name: &str, text: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path
}

impl PgCluster {
    /// Turns SSL on with this certificate (takes effect at once, by reload).
    pub fn enable_tls(&self, server: &Pair) {
        let data = self.dir.join("data");
        let cert = write_file(&data, "server.crt", &server.cert_pem);
        let key = write_file(&data, "server.key", &server.key_pem);
        if is_root() {
            let mut c = Command::new("chown");
            c.arg("postgres:postgres").arg(&cert).arg(&key);
            run_ok(c, "chown");
        }
        self.psql_super("ALTER SYSTEM SET ssl = on");
        self.psql_super("ALTER SYSTEM SET ssl_cert_file = 'server.crt'");
        self.psql_super("ALTER SYSTEM SET ssl_key_file = 'server.key'");
        self.reload();
    }

    /// Puts `line` first in pg_hba.conf and reloads.
    pub fn prepend_hba(&self, line: &str) {
        let path = self.dir.join("data").join("pg_hba.conf");
        let old = std::fs::read_to_string(&path).unwrap();
        std::fs::write(&path, format!("{line}\n{old}")).unwrap();
        self.reload();
    }

    pub fn reload(&self) {
        let loaded = || self.psql_super("SELECT pg_conf_load_time()");
        let before = loaded();
        let mut c = pg_command(&self.bin, "pg_ctl");
        c.arg("-D").arg(self.dir.join("data")).arg("reload");
        c.stdout(std::process::Stdio::null());
        run_ok(c, "pg_ctl reload");
        // The postmaster applies a reload asynchronously. A new backend
        // inherits the postmaster's reload time, which changes once it has
        // read the files again (pg_hba.conf and the SSL files included).
        super::wait::eventually(
            super::wait::DEADLINE,
            "PostgreSQL reloads its configuration",
            || loaded() != before,
        );
    }
}

/// Runs psql with a libpq connection string; `-X -t -A`, one command.
pub async fn psql(conninfo: &str, password: Option<&str>, sql: &str) -> Output {
    let mut c = tokio::process::Command::new("psql");
    c.args([
        "-X",
        "-t",
        "-A",
        "-v",
        "ON_ERROR_STOP=1",
        "-d",
        conninfo,
        "-c",
        sql,
    ])
    .env_remove("PGPASSWORD")
    .env_remove("PGSSLMODE");
    if let Some(p) = password {
        c.env("PGPASSWORD", p);
    }
    c.output().await.expect("psql runs")
}

/// psql's output, asserting it succeeded.
pub async fn psql_ok(conninfo: &str, password: Option<&str>, sql: &str) -> String {
    let out = psql(conninfo, password, sql).await;
    assert!(
        out.status.success(),
        "psql {conninfo:?} {sql:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// psql's error output, asserting it failed.
pub async fn psql_err(conninfo: &str, password: Option<&str>, sql: &str) -> String {
    let out = psql(conninfo, password, sql).await;
    assert!(
        !out.status.success(),
        "psql {conninfo:?} {sql:?} should have failed: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stderr).to_string()
}

/// Sends SSLRequest, expects `S`, and runs a TLS handshake trusting `ca_pem`.
pub async fn tls_connect(
    addr: std::net::SocketAddr,
    ca_pem: &str,
) -> tokio_rustls::client::TlsStream<TcpStream> {
    use rustls::pki_types::pem::PemObject;
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let mut request = 8u32.to_be_bytes().to_vec();
    request.extend_from_slice(&80877103u32.to_be_bytes());
    tcp.write_all(&request).await.unwrap();
    assert_eq!(tcp.read_u8().await.unwrap(), b'S', "usher offers TLS");
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
        .expect("TLS handshake with usher")
}
