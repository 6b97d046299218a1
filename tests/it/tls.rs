//! TLS: psql to usher with sslmode=require and verify-full, `tls.mode:
//! require` refusing plaintext, client certificate authentication, and usher
//! to PostgreSQL with each of disable / prefer / require / verify-full.

use crate::common;

use crate::common::attempts::expect_outcome;
use crate::common::libpq::LibpqClient;
use crate::common::tls::{psql_err, psql_ok, tls_connect, write_file, Pair, TestCa};
use crate::common::wire::{read_message, startup_packet};
use crate::common::{sqlstate, PgCluster, Usher, ALICE_PASSWORD};
use std::path::PathBuf;
use std::sync::OnceLock;
use tokio::io::AsyncWriteExt;
use usher::auth::AuthOutcome;

/// The cluster (with SSL on, its certificate naming only `localhost`), the
/// CA that signed every certificate, and the files usher reads.
struct Env {
    pg: &'static PgCluster,
    ca: TestCa,
    dir: tempfile::TempDir,
    ca_file: PathBuf,
    usher_cert: PathBuf,
    usher_key: PathBuf,
}

fn env() -> &'static Env {
    static ENV: OnceLock<Env> = OnceLock::new();
    ENV.get_or_init(|| {
        // A cluster of its own: its server certificate is this module's.
        let pg = PgCluster::own(module_path!());
        let ca = TestCa::new("usher test CA");
        pg.enable_tls(&ca.server(&["localhost"]));
        let dir = tempfile::tempdir().unwrap();
        let ca_file = write_file(dir.path(), "ca.pem", &ca.cert_pem);
        let usher = ca.server(&["127.0.0.1", "localhost"]);
        let usher_cert = write_file(dir.path(), "usher.crt", &usher.cert_pem);
        let usher_key = write_file(dir.path(), "usher.key", &usher.key_pem);
        Env {
            pg,
            ca,
            dir,
            ca_file,
            usher_cert,
            usher_key,
        }
    })
}

impl Env {
    /// The `tls:` section for usher.
    fn usher_tls(&self, mode: &str) -> String {
        format!(
            "tls:\n  mode: {mode}\n  cert: {}\n  key: {}\n",
            self.usher_cert.display(),
            self.usher_key.display()
        )
    }

    /// Writes a client certificate pair; returns libpq's sslcert/sslkey options.
    fn client_files(&self, name: &str, pair: &Pair) -> String {
        let cert = write_file(self.dir.path(), &format!("{name}.crt"), &pair.cert_pem);
        let key = write_file(self.dir.path(), &format!("{name}.key"), &pair.key_pem);
        format!("sslcert={} sslkey={}", cert.display(), key.display())
    }
}

fn conninfo(usher: &Usher, user: &str, extra: &str) -> String {
    format!(
        "host=127.0.0.1 port={} user={user} dbname=app {extra}",
        usher.addr.port()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn psql_connects_with_sslmode_require_and_verify_full() {
    let e = env();
    let usher = Usher::start(e.pg, &e.usher_tls("allow")).await;
    let pw = Some(ALICE_PASSWORD);
    let sql = "SELECT current_user";
    assert_eq!(
        psql_ok(&conninfo(&usher, "alice", "sslmode=require"), pw, sql).await,
        "alice"
    );
    let verify_full = format!("sslmode=verify-full sslrootcert={}", e.ca_file.display());
    assert_eq!(
        psql_ok(&conninfo(&usher, "alice", &verify_full), pw, sql).await,
        "alice"
    );
    // The certificate really is checked: another CA's root does not accept it.
    let other = write_file(e.dir.path(), "other-ca.pem", &TestCa::new("other").cert_pem);
    let stderr = psql_err(
        &conninfo(
            &usher,
            "alice",
            &format!("sslmode=verify-full sslrootcert={}", other.display()),
        ),
        pw,
        sql,
    )
    .await;
    assert!(stderr.contains("certificate verify failed"), "{stderr}");
    // `allow` still serves plaintext clients.
    assert_eq!(
        psql_ok(&conninfo(&usher, "alice", "sslmode=disable"), pw, sql).await,
        "alice"
    );
    // A large result and many round trips go through TLS whole.
    let out = psql_ok(
        &conninfo(&usher, "alice", &verify_full),
        pw,
        "SELECT repeat('x', 1000) || i FROM generate_series(1, 5000) i",
    )
    .await;
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 5000);
    assert_eq!(lines[4999], format!("{}5000", "x".repeat(1000)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_require_refuses_plaintext_clients_with_a_clear_error() {
    let e = env();
    let usher = Usher::start(e.pg, &e.usher_tls("require")).await;
    let mut attempts = usher.app.auth_attempts();
    let err = usher
        .connect_as("alice", ALICE_PASSWORD)
        .await
        .expect_err("plaintext refused");
    let db = err.as_db_error().expect("an error from usher");
    assert_eq!(db.code().code(), "28000");
    assert!(db.message().contains("TLS is required"), "{db:?}");
    assert!(
        db.hint().unwrap_or("").contains("sslmode=require"),
        "{db:?}"
    );
    let a = expect_outcome(&mut attempts, "alice", AuthOutcome::TlsRequired).await;
    assert!(a.user_exists);

    let stderr = psql_err(
        &conninfo(&usher, "alice", "sslmode=disable"),
        Some(ALICE_PASSWORD),
        "SELECT 1",
    )
    .await;
    assert!(stderr.contains("TLS is required"), "{stderr}");
    assert_eq!(
        psql_ok(
            &conninfo(&usher, "alice", "sslmode=require"),
            Some(ALICE_PASSWORD),
            "SELECT 1"
        )
        .await,
        "1"
    );
    expect_outcome(&mut attempts, "alice", AuthOutcome::TlsRequired).await;
    expect_outcome(&mut attempts, "alice", AuthOutcome::Success).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plaintext_cancel_request_reaches_a_tls_client_query() {
    let e = env();
    let usher = Usher::start(
        e.pg,
        &format!("{}auth:\n  method: trust\n", e.usher_tls("require")),
    )
    .await;
    let mut tls = tls_connect(usher.addr, &e.ca.cert_pem).await;
    tls.write_all(&startup_packet(&[("user", "alice"), ("database", "app")]))
        .await
        .unwrap();
    let mut key = None;
    loop {
        match read_message(&mut tls).await {
            (b'K', body) => key = Some(body),
            (b'Z', _) => break,
            (b'E', body) => panic!("login failed: {}", String::from_utf8_lossy(&body)),
            _ => {}
        }
    }
    let key = key.expect("BackendKeyData");
    tls.write_all(&common::wire::message(b'Q', b"SELECT pg_sleep(30)\0"))
        .await
        .unwrap();
    e.pg.wait_until_active("SELECT pg_sleep(30)").await;
    // libpq before PostgreSQL 17 sends cancel requests unencrypted.
    let mut cancel = tokio::net::TcpStream::connect(usher.addr).await.unwrap();
    let mut packet = 16u32.to_be_bytes().to_vec();
    packet.extend_from_slice(&80877102u32.to_be_bytes());
    packet.extend_from_slice(&key);
    cancel.write_all(&packet).await.unwrap();
    loop {
        let (tag, body) = read_message(&mut tls).await;
        if tag == b'E' {
            let fields = common::wire::error_fields(&common::wire::message(b'E', &body)).unwrap();
            assert_eq!(fields[&'C'], "57014", "{fields:?}");
            break;
        }
    }
}

/// The reported hang: psycopg on the system libpq (PostgreSQL 15), TLS,
/// session mode, `select repeat('x', 4395) from generate_series(1, 20)` in a
/// loop stopped after a few rounds. libpq reads one TLS record at a time
/// into at least 8 KB of free space and, when a message is incomplete, the
/// application waits on the socket; usher wrote records of up to 16 KB, so
/// the rest of a record stayed decrypted inside OpenSSL while the socket was
/// quiet. The client here reads and waits the same way (common::libpq).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_libpq_style_client_gets_every_large_result_over_tls_in_session_mode() {
    let e = env();
    let extra = format!(
        "{}auth:\n  method: trust\npool_mode: session\n",
        e.usher_tls("require")
    );
    let usher = Usher::start(e.pg, &extra).await;
    let mut client = LibpqClient::connect(usher.addr, &e.ca.cert_pem, "alice").await;
    tokio::task::spawn_blocking(move || {
        for round in 0..10 {
            // The reported query, then one large enough that usher waits on
            // the client and reads the server's output in large pieces.
            for (rows, size) in [(20, 4395), (1000, 4395)] {
                let sql = format!("select repeat('x', {size}) from generate_series(1, {rows})");
                let out = client.query(&sql);
                assert_eq!(out.rows, rows, "round {round}");
                assert_eq!(out.tag, format!("SELECT {rows}"));
            }
        }
        // Every record fits in what libpq asks for, as PostgreSQL's do
        // (checked too because a larger record hangs libpq only when it
        // happens to end a result).
        assert!(
            client.largest_record <= usher::tls::client_tls::MAX_RECORD_PLAINTEXT,
            "a TLS record carried {} bytes",
            client.largest_record
        );
        client.close();
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_certificates_authenticate_by_their_common_name() {
    let e = env();
    let extra = format!(
        "{}  ca: {}\nauth:\n  method: cert\n",
        e.usher_tls("allow"),
        e.ca_file.display()
    );
    let usher = Usher::start(e.pg, &extra).await;
    let mut attempts = usher.app.auth_attempts();
    let root = format!("sslmode=verify-full sslrootcert={}", e.ca_file.display());
    let alice = e.client_files("alice", &e.ca.client("alice"));
    let bob = e.client_files("bob", &e.ca.client("bob"));
    let mallory = e.client_files("mallory", &e.ca.client("mallory"));
    let forged = e.client_files("forged", &TestCa::new("other").client("alice"));
    let sql = "SELECT current_user";

    // No password anywhere: the certificate is the credential.
    assert_eq!(
        psql_ok(
            &conninfo(&usher, "alice", &format!("{root} {alice}")),
            None,
            sql
        )
        .await,
        "alice"
    );
    expect_outcome(&mut attempts, "alice", AuthOutcome::Success).await;

    let stderr = psql_err(
        &conninfo(&usher, "alice", &format!("{root} {bob}")),
        None,
        sql,
    )
    .await;
    assert!(
        stderr.contains("certificate authentication failed for user \"alice\""),
        "{stderr}"
    );
    expect_outcome(&mut attempts, "alice", AuthOutcome::WrongPassword).await;

    let stderr = psql_err(
        &conninfo(&usher, "mallory", &format!("{root} {mallory}")),
        None,
        sql,
    )
    .await;
    assert!(
        stderr.contains("certificate authentication failed for user \"mallory\""),
        "{stderr}"
    );
    let a = expect_outcome(&mut attempts, "mallory", AuthOutcome::UnknownUser).await;
    assert!(!a.user_exists);

    for without in [root.as_str(), "sslmode=disable"] {
        let stderr = psql_err(&conninfo(&usher, "alice", without), None, sql).await;
        assert!(
            stderr.contains("connection requires a valid client certificate"),
            "{without}: {stderr}"
        );
        expect_outcome(&mut attempts, "alice", AuthOutcome::TlsRequired).await;
    }

    // A certificate from another CA does not get through the handshake.
    let stderr = psql_err(
        &conninfo(&usher, "alice", &format!("{root} {forged}")),
        None,
        sql,
    )
    .await;
    assert!(stderr.to_lowercase().contains("ssl"), "{stderr}");

    // The error a client gets is PostgreSQL's: 28000.
    let err = usher
        .connect_as("alice", "x")
        .await
        .expect_err("no certificate");
    assert_eq!(sqlstate(&err).as_deref(), Some("28000"), "{err}");
}

/// What `pg_stat_ssl` says about the server connection usher uses.
async fn server_ssl(usher: &Usher) -> Result<bool, tokio_postgres::Error> {
    let c = usher.connect_as("alice", ALICE_PASSWORD).await?;
    let row = c
        .query_one(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await?;
    Ok(row.get(0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usher_connects_to_postgres_with_each_tls_mode() {
    let e = env();
    let other = write_file(
        e.dir.path(),
        "other-root.pem",
        &TestCa::new("other").cert_pem,
    );
    let start = |host: &str, tls: &str| {
        let yaml = common::usher_yaml(e.pg, "")
            .replace("    host: 127.0.0.1\n", &format!("    host: {host}\n{tls}"));
        async move { Usher::start_yaml(&yaml).await }
    };
    let ca = format!("    tls_ca: {}\n", e.ca_file.display());
    for (host, tls, expected) in [
        ("127.0.0.1", "    tls: disable\n".to_string(), false),
        ("127.0.0.1", "    tls: prefer\n".to_string(), true),
        ("127.0.0.1", "    tls: require\n".to_string(), true),
        ("localhost", format!("    tls: verify-full\n{ca}"), true),
    ] {
        let usher = start(host, &tls).await;
        let ssl = server_ssl(&usher)
            .await
            .unwrap_or_else(|err| panic!("{tls}: {err}"));
        assert_eq!(ssl, expected, "{tls}");
    }

    // verify-full checks the name: the server's certificate names only localhost.
    let usher = start("127.0.0.1", &format!("    tls: verify-full\n{ca}")).await;
    let err = server_ssl(&usher).await.expect_err("wrong name refused");
    assert_eq!(sqlstate(&err).as_deref(), Some("08006"), "{err}");
    let message = err.as_db_error().map(|d| d.message().to_string());
    assert!(
        message.unwrap_or_default().contains("certificate"),
        "{err:?}"
    );

    // ... and the issuer.
    let usher = start(
        "localhost",
        &format!("    tls: verify-full\n    tls_ca: {}\n", other.display()),
    )
    .await;
    let err = server_ssl(&usher)
        .await
        .expect_err("unknown issuer refused");
    let message = err.as_db_error().map(|d| d.message().to_string());
    assert!(
        message.unwrap_or_default().contains("certificate"),
        "{err:?}"
    );
}

#[test]
fn usher_check_reads_the_certificate_and_auth_files() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("check CA");
    let pair = ca.server(&["127.0.0.1"]);
    let cert = write_file(dir.path(), "usher.crt", &pair.cert_pem);
    let key = write_file(dir.path(), "usher.key", &pair.key_pem);
    let check = |yaml: String| {
        let path = dir.path().join("usher.yaml");
        std::fs::write(&path, yaml).unwrap();
        let out = common::usher_cli()
            .args(["check", "--config"])
            .arg(&path)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let tls = |cert: &str, key: &str| format!("tls:\n  cert: {cert}\n  key: {key}\n");
    let (ok, err) = check(tls(&cert.display().to_string(), &key.display().to_string()));
    assert!(ok, "{err}");

    let (ok, err) = check(tls("/nonexistent/usher.crt", &key.display().to_string()));
    assert!(!ok);
    assert!(
        err.contains("usher.yaml: tls.cert: cannot read /nonexistent/usher.crt"),
        "{err}"
    );

    // A key file that holds a certificate: named, and never quoted.
    let (ok, err) = check(tls(
        &cert.display().to_string(),
        &cert.display().to_string(),
    ));
    assert!(!ok);
    assert!(
        err.contains("tls.key") && err.contains("no PEM private key"),
        "{err}"
    );
    assert!(!err.contains("BEGIN"), "{err}");

    let other = TestCa::new("other").server(&["127.0.0.1"]);
    let other_key = write_file(dir.path(), "other.key", &other.key_pem);
    let (ok, err) = check(tls(
        &cert.display().to_string(),
        &other_key.display().to_string(),
    ));
    assert!(!ok);
    assert!(err.contains("tls.key: does not fit tls.cert"), "{err}");

    let (ok, err) = check(format!(
        "databases:\n  app:\n    tls: verify-full\n    tls_ca: {}\n",
        key.display()
    ));
    assert!(!ok);
    assert!(err.contains("databases.app.tls_ca"), "{err}");

    let list = write_file(dir.path(), "userlist.txt", "\"alice\" \"pw\"\nalice pw\n");
    let (ok, err) = check(format!("auth:\n  file: {}\n", list.display()));
    assert!(!ok);
    assert!(err.contains("auth.file") && err.contains("line 2"), "{err}");
}
