//! The whole story of issue 4 in one place: psql connects to usher with
//! sslmode=verify-full and logs in with a SCRAM password that exists only on
//! the PostgreSQL server (found through auth_query, passed through to a
//! server reached over verified TLS), and the log, captured at TRACE level,
//! shows every attempt's outcome and no password, verifier, key or proof.

mod common;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use common::tls::{psql_err, psql_ok, tls_connect, write_file, TestCa};
use common::wire::{message, read_message, sasl_initial, start_sasl};
use common::{PgCluster, Usher};
use postgres_protocol::authentication::sasl::{ChannelBinding, ScramSha256};
use std::io;
use std::sync::{Arc, Mutex};
use tokio::io::AsyncWriteExt;
use tracing_subscriber::fmt::MakeWriter;
use usher::auth::Secret;

const CAROL_PASSWORD: &str = "carol-Secr3t!";
const DORA_PASSWORD: &str = "dora-Pl41n-text";
const AUTH_PASSWORD: &str = "auth-user-Pw";

/// Everything written to the log, at every level.
#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<u8>>>);

impl io::Write for Capture {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for Capture {
    type Writer = Capture;
    fn make_writer(&'a self) -> Capture {
        self.clone()
    }
}

impl Capture {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_full_psql_logs_in_with_a_server_only_scram_password_and_no_secret_is_logged() {
    let log = Capture::default();
    tracing_subscriber::fmt()
        .with_writer(log.clone())
        .with_max_level(tracing::Level::TRACE)
        .with_ansi(false)
        .init();

    let pg = PgCluster::shared();
    let ca = TestCa::new("e2e CA");
    pg.enable_tls(&ca.server(&["localhost"]));
    pg.psql_super(&format!(
        "CREATE ROLE usher_auth LOGIN SUPERUSER PASSWORD '{AUTH_PASSWORD}'; \
         CREATE ROLE carol LOGIN PASSWORD '{CAROL_PASSWORD}'; \
         CREATE ROLE dora LOGIN PASSWORD '{DORA_PASSWORD}'; \
         GRANT ALL ON DATABASE app TO carol;"
    ));
    pg.psql_super_db(
        "app",
        "CREATE TABLE visits (who text); GRANT ALL ON visits TO carol;",
    );
    let verifier = pg.psql_super("SELECT rolpassword FROM pg_authid WHERE rolname = 'carol'");

    let dir = tempfile::tempdir().unwrap();
    let ca_file = write_file(dir.path(), "ca.pem", &ca.cert_pem);
    let pair = ca.server(&["127.0.0.1"]);
    let cert = write_file(dir.path(), "usher.crt", &pair.cert_pem);
    let key = write_file(dir.path(), "usher.key", &pair.key_pem);
    let yaml = format!(
        "listen: 127.0.0.1:0\n\
         pool_mode: transaction\n\
         pool_size: 2\n\
         tls:\n  mode: require\n  cert: {cert}\n  key: {key}\n\
         auth:\n  user: usher_auth\n  hba:\n\
         \x20   - {{ type: hostssl, database: app, user: dora, address: 127.0.0.1/32, method: password }}\n\
         \x20   - {{ type: hostssl, database: app, user: all, address: 127.0.0.1/32, method: scram-sha-256 }}\n\
         databases:\n  app:\n    host: localhost\n    port: {port}\n    tls: verify-full\n    tls_ca: {ca}\n\
         users:\n  usher_auth:\n    password: {AUTH_PASSWORD}\n",
        cert = cert.display(),
        key = key.display(),
        ca = ca_file.display(),
        port = pg.port,
    );
    let usher = Usher::start_yaml(&yaml).await;
    let conninfo = |user: &str, sslmode: &str| {
        format!(
            "host=127.0.0.1 port={} user={user} dbname=app sslmode={sslmode} sslrootcert={}",
            usher.addr.port(),
            ca_file.display()
        )
    };

    // The scenario: verify-full to usher, a role usher has never been told
    // about, transactions in transaction mode, TLS all the way to PostgreSQL.
    let out = psql_ok(
        &conninfo("carol", "verify-full"),
        Some(CAROL_PASSWORD),
        "BEGIN; INSERT INTO visits VALUES (current_user); COMMIT; \
         SELECT current_user || ' ' || (SELECT count(*) FROM visits) || ' ' || \
                (SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid())",
    )
    .await;
    assert_eq!(out.lines().last(), Some("carol 1 true"), "{out}");
    let stderr = psql_err(&conninfo("carol", "verify-full"), Some("guess"), "SELECT 1").await;
    assert!(
        stderr.contains("password authentication failed"),
        "{stderr}"
    );
    let stderr = psql_err(
        &conninfo("carol", "disable"),
        Some(CAROL_PASSWORD),
        "SELECT 1",
    )
    .await;
    assert!(stderr.contains("TLS is required"), "{stderr}");
    // A cleartext password (the HBA rule says `password`) over TLS.
    assert_eq!(
        psql_ok(
            &conninfo("dora", "verify-full"),
            Some(DORA_PASSWORD),
            "SELECT current_user"
        )
        .await,
        "dora"
    );

    // A SCRAM exchange by hand, to know the proof the client sent.
    let mut tls = tls_connect(usher.addr, &ca.cert_pem).await;
    start_sasl(&mut tls, "carol").await;
    let mut client = ScramSha256::new(CAROL_PASSWORD.as_bytes(), ChannelBinding::unsupported());
    tls.write_all(&sasl_initial(client.message()))
        .await
        .unwrap();
    let (_, body) = read_message(&mut tls).await;
    client.update(&body[4..]).unwrap();
    let last = String::from_utf8(client.message().to_vec()).unwrap();
    let proof = last.rsplit_once(",p=").unwrap().1.to_string();
    tls.write_all(&message(b'p', last.as_bytes()))
        .await
        .unwrap();
    let (tag, body) = read_message(&mut tls).await;
    assert_eq!((tag, &body[..4]), (b'R', &12u32.to_be_bytes()[..]));
    let server_final = String::from_utf8(body[4..].to_vec()).unwrap();
    client.finish(server_final.as_bytes()).unwrap();
    drop(tls);
    // Every connection has ended, so all it logs is in the log.
    common::wait::eventually_async(common::wait::DEADLINE, "the clients leave", || async {
        usher.app.deps.clients.connected() == 0
    })
    .await;

    let text = log.text();
    // Each attempt's outcome is there, with who and how.
    for expected in [
        "login ok user=carol database=app",
        "method=scram-sha-256 outcome=success",
        "outcome=wrong_password",
        "outcome=tls_required",
        "login ok user=dora database=app",
        "method=password outcome=success",
    ] {
        assert!(
            text.contains(expected),
            "{expected:?} not in the log:\n{text}"
        );
    }
    // No secret of any kind, in any form.
    let secret = Secret::parse(&verifier);
    let v = secret.scram().expect("a SCRAM verifier");
    let client_key = secret.scram_client_key(CAROL_PASSWORD).expect("key");
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let secrets = [
        CAROL_PASSWORD.to_string(),
        DORA_PASSWORD.to_string(),
        AUTH_PASSWORD.to_string(),
        verifier.clone(),
        B64.encode(v.stored_key),
        B64.encode(v.server_key),
        B64.encode(client_key),
        hex(&client_key),
        hex(&v.stored_key),
        proof,
        server_final.trim_start_matches("v=").to_string(),
    ];
    for s in &secrets {
        assert!(!text.contains(s.as_str()), "a secret is in the log: {s}");
    }
    assert!(text.len() > 1000, "the log was captured at TRACE level");
}
