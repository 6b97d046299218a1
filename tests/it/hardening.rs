//! Hardening of the login: garbled, replayed and wrong-nonce SCRAM messages
//! are refused; clients still logging in are limited; the auth timeout
//! covers the TLS handshake and a stalled exchange; every outcome is
//! recorded; secrets are compared in constant time.

use crate::common::attempts::expect_outcome;
use crate::common::tls::{write_file, TestCa};
use crate::common::wait::{eventually_async, DEADLINE};
use crate::common::wire::{message, read_error, read_message, sasl_initial, start_sasl};
use crate::common::{sqlstate, PgCluster, Usher, ALICE_PASSWORD};
use postgres_protocol::authentication::sasl::{ChannelBinding, ScramSha256};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use usher::auth::AuthOutcome;

/// A client-final message SCRAM-SHA-256 data from the SASLContinue body.
fn continue_data(body: &[u8]) -> &[u8] {
    assert_eq!(
        &body[..4],
        &11u32.to_be_bytes(),
        "AuthenticationSASLContinue"
    );
    &body[4..]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbled_scram_messages_get_08p01_and_others_are_unaffected() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "").await;
    let bystander = usher.alice().await;
    let mut attempts = usher.app.auth_attempts();

    // A client-first-message that is not SCRAM.
    let mut s = TcpStream::connect(usher.addr).await.unwrap();
    start_sasl(&mut s, "alice").await;
    s.write_all(&sasl_initial(b"garbage")).await.unwrap();
    let e = read_error(&mut s).await;
    assert_eq!(e[&'C'], "08P01");
    assert!(e[&'M'].contains("malformed SCRAM message"), "{e:?}");
    expect_outcome(&mut attempts, "alice", AuthOutcome::ProtocolError).await;

    // A mechanism that was not offered.
    let mut s = TcpStream::connect(usher.addr).await.unwrap();
    start_sasl(&mut s, "alice").await;
    let mut body = b"SCRAM-SHA-1\0".to_vec();
    body.extend_from_slice(&4i32.to_be_bytes());
    body.extend_from_slice(b"n,,x");
    s.write_all(&message(b'p', &body)).await.unwrap();
    assert_eq!(read_error(&mut s).await[&'C'], "08P01");

    // A data length that does not match the message.
    let mut s = TcpStream::connect(usher.addr).await.unwrap();
    start_sasl(&mut s, "alice").await;
    let mut body = b"SCRAM-SHA-256\0".to_vec();
    body.extend_from_slice(&1000i32.to_be_bytes());
    body.extend_from_slice(b"n,,n=,r=abc");
    s.write_all(&message(b'p', &body)).await.unwrap();
    assert_eq!(read_error(&mut s).await[&'C'], "08P01");

    // A good first message, then a garbled final one.
    let mut s = TcpStream::connect(usher.addr).await.unwrap();
    start_sasl(&mut s, "alice").await;
    let client = ScramSha256::new(ALICE_PASSWORD.as_bytes(), ChannelBinding::unsupported());
    s.write_all(&sasl_initial(client.message())).await.unwrap();
    read_message(&mut s).await;
    s.write_all(&message(b'p', b"c=biws,r=,p=\xff"))
        .await
        .unwrap();
    let e = read_error(&mut s).await;
    assert_eq!(e[&'C'], "08P01", "{e:?}");

    // Something other than a password message during authentication.
    let mut s = TcpStream::connect(usher.addr).await.unwrap();
    start_sasl(&mut s, "alice").await;
    s.write_all(&message(b'Q', b"SELECT 1\0")).await.unwrap();
    let e = read_error(&mut s).await;
    assert!(e[&'M'].contains("expected password response"), "{e:?}");

    let two: i32 = bystander.query_one("SELECT 2", &[]).await.unwrap().get(0);
    assert_eq!(two, 2);
}

/// Runs a whole SCRAM login by hand; returns the client's two messages.
async fn scram_login(usher: &Usher) -> (Vec<u8>, Vec<u8>) {
    let mut s = TcpStream::connect(usher.addr).await.unwrap();
    start_sasl(&mut s, "alice").await;
    let mut client = ScramSha256::new(ALICE_PASSWORD.as_bytes(), ChannelBinding::unsupported());
    let first = client.message().to_vec();
    s.write_all(&sasl_initial(&first)).await.unwrap();
    let (_, body) = read_message(&mut s).await;
    client.update(continue_data(&body)).unwrap();
    let last = client.message().to_vec();
    s.write_all(&message(b'p', &last)).await.unwrap();
    let (tag, body) = read_message(&mut s).await;
    assert_eq!(
        (tag, &body[..4]),
        (b'R', &12u32.to_be_bytes()[..]),
        "SASLFinal"
    );
    client
        .finish(&body[4..])
        .expect("usher's signature is right");
    let (tag, body) = read_message(&mut s).await;
    assert_eq!((tag, body), (b'R', vec![0, 0, 0, 0]), "AuthenticationOk");
    (first, last)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_scram_exchange_is_refused() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "").await;
    let mut attempts = usher.app.auth_attempts();
    let (first, last) = scram_login(&usher).await;
    expect_outcome(&mut attempts, "alice", AuthOutcome::Success).await;

    // An eavesdropper replays both messages: usher's new nonce unmasks it.
    let mut s = TcpStream::connect(usher.addr).await.unwrap();
    start_sasl(&mut s, "alice").await;
    s.write_all(&sasl_initial(&first)).await.unwrap();
    read_message(&mut s).await;
    s.write_all(&message(b'p', &last)).await.unwrap();
    let e = read_error(&mut s).await;
    assert_eq!(e[&'C'], "08P01");
    assert!(e[&'M'].contains("nonce"), "{e:?}");
    expect_outcome(&mut attempts, "alice", AuthOutcome::ProtocolError).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_nonce_is_refused() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "").await;
    let mut attempts = usher.app.auth_attempts();
    let mut s = TcpStream::connect(usher.addr).await.unwrap();
    start_sasl(&mut s, "alice").await;
    let mut client = ScramSha256::new(ALICE_PASSWORD.as_bytes(), ChannelBinding::unsupported());
    s.write_all(&sasl_initial(client.message())).await.unwrap();
    let (_, body) = read_message(&mut s).await;
    client.update(continue_data(&body)).unwrap();
    // The right proof for the agreed nonce, sent with another nonce.
    let last = String::from_utf8(client.message().to_vec()).unwrap();
    let tampered = last.replacen(",r=", ",r=X", 1);
    s.write_all(&message(b'p', tampered.as_bytes()))
        .await
        .unwrap();
    let e = read_error(&mut s).await;
    assert_eq!(e[&'C'], "08P01");
    assert_eq!(e[&'M'], "SCRAM nonce mismatch");
    expect_outcome(&mut attempts, "alice", AuthOutcome::ProtocolError).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_still_logging_in_are_limited_by_max_auth_clients() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "max_auth_clients: 2\n").await;
    let mut attempts = usher.app.auth_attempts();
    // Logged-in clients hold no login slot.
    let mut sessions = Vec::new();
    for _ in 0..3 {
        sessions.push(usher.alice().await);
    }
    let silent1 = TcpStream::connect(usher.addr).await.unwrap();
    let silent2 = TcpStream::connect(usher.addr).await.unwrap();
    // They hold the slots once usher has accepted them.
    eventually_async(DEADLINE, "two login slots in use", || async {
        usher.app.deps.login_slots.in_use() == 2
    })
    .await;
    let e = usher
        .connect_as("alice", ALICE_PASSWORD)
        .await
        .expect_err("no login slot");
    let db = e.as_db_error().expect("an error from usher");
    assert_eq!(db.code().code(), "53300");
    assert!(db.message().contains("max_auth_clients is 2"), "{db:?}");
    expect_outcome(&mut attempts, "", AuthOutcome::Refused).await;
    for s in &sessions {
        s.query_one("SELECT 1", &[]).await.unwrap();
    }
    drop((silent1, silent2));
    eventually_async(Duration::from_secs(10), "slots are freed", || async {
        usher.connect_as("alice", ALICE_PASSWORD).await.is_ok()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_auth_timeout_covers_the_tls_handshake_and_a_stalled_exchange() {
    let pg = PgCluster::shared();
    let ca = TestCa::new("timeout CA");
    let dir = tempfile::tempdir().unwrap();
    let pair = ca.server(&["127.0.0.1"]);
    let cert = write_file(dir.path(), "usher.crt", &pair.cert_pem);
    let key = write_file(dir.path(), "usher.key", &pair.key_pem);
    let usher = Usher::start(
        pg,
        &format!(
            "auth_timeout: 0.5\ntls:\n  cert: {}\n  key: {}\n",
            cert.display(),
            key.display()
        ),
    )
    .await;
    let mut attempts = usher.app.auth_attempts();

    // SSLRequest answered, then no ClientHello.
    let started = Instant::now();
    let mut s = TcpStream::connect(usher.addr).await.unwrap();
    let mut request = 8u32.to_be_bytes().to_vec();
    request.extend_from_slice(&80877103u32.to_be_bytes());
    s.write_all(&request).await.unwrap();
    assert_eq!(s.read_u8().await.unwrap(), b'S');
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut rest)).await;
    assert!(closed.is_ok(), "usher closes a stalled TLS handshake");
    assert!(started.elapsed() < Duration::from_secs(5));
    expect_outcome(&mut attempts, "", AuthOutcome::Timeout).await;

    // Garbage instead of a ClientHello is a protocol error.
    let mut s = TcpStream::connect(usher.addr).await.unwrap();
    s.write_all(&request).await.unwrap();
    assert_eq!(s.read_u8().await.unwrap(), b'S');
    s.write_all(&[0x42; 64]).await.unwrap();
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut rest)).await;
    expect_outcome(&mut attempts, "", AuthOutcome::ProtocolError).await;

    // A SCRAM exchange that stops after the first step.
    let mut s = TcpStream::connect(usher.addr).await.unwrap();
    start_sasl(&mut s, "alice").await;
    let e = read_error(&mut s).await;
    assert_eq!(e[&'C'], "08P01");
    assert!(e[&'M'].contains("timeout"), "{e:?}");
    let a = expect_outcome(&mut attempts, "alice", AuthOutcome::Timeout).await;
    assert!(a.user_exists);
    assert_eq!(a.database, "app");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_outcome_is_recorded_with_who_where_and_how() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "").await;
    let mut attempts = usher.app.auth_attempts();
    usher.alice().await;
    let ok = expect_outcome(&mut attempts, "alice", AuthOutcome::Success).await;
    assert!(ok.user_exists);
    assert_eq!(ok.database, "app");
    assert_eq!(ok.method, "scram-sha-256");
    assert!(ok.client_addr.ip().is_some_and(|ip| ip.is_loopback()));

    usher.connect_as("alice", "wrong").await.expect_err("wrong");
    expect_outcome(&mut attempts, "alice", AuthOutcome::WrongPassword).await;
    let e = usher.connect_as("mallory", "x").await.expect_err("unknown");
    assert_eq!(sqlstate(&e).as_deref(), Some("28P01"));
    let m = expect_outcome(&mut attempts, "mallory", AuthOutcome::UnknownUser).await;
    assert!(!m.user_exists);

    // A startup packet that cannot be read: a protocol error, name unknown
    // (the client is told nothing, as PostgreSQL tells it nothing).
    let mut s = TcpStream::connect(usher.addr).await.unwrap();
    s.write_all(&100_000_000u32.to_be_bytes()).await.unwrap();
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut rest)).await;
    assert_eq!(rest, b"");
    expect_outcome(&mut attempts, "", AuthOutcome::ProtocolError).await;
}

/// The files where secrets are checked, and the words that name secrets.
const CHECKED: &[&str] = &[
    "src/auth",
    "src/protocol/scram.rs",
    "src/protocol/scram_client.rs",
    "src/backend/credential.rs",
    "src/backend/connect.rs",
    "src/frontend/client_registry.rs",
    "src/frontend/login.rs",
];
const SECRET_WORDS: &[&str] = &[
    "password",
    "proof",
    "stored_key",
    "server_key",
    "client_key",
    "signature",
    "secret",
];

#[test]
fn secrets_are_compared_in_constant_time() {
    // ct_eq itself must not stop at the first difference: equal lengths,
    // one byte apart at the start or at the end, give the same answer.
    use usher::auth::secret::ct_eq;
    assert!(ct_eq(b"s3cret", b"s3cret"));
    assert!(!ct_eq(b"s3cret", b"x3cret"));
    assert!(!ct_eq(b"s3cret", b"s3crex"));
    assert!(!ct_eq(b"s3cret", b"s3cre"));

    // And no code that handles secrets compares them with == or !=.
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for entry in CHECKED {
        let path = root.join(entry);
        if path.is_dir() {
            for f in std::fs::read_dir(&path).unwrap() {
                files.push(f.unwrap().path());
            }
        } else {
            files.push(path);
        }
    }
    let mut offending = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        for (i, line) in text.lines().enumerate() {
            if line.contains("#[cfg(test)]") {
                break; // unit tests may compare what they like
            }
            let code = line.split("//").next().unwrap_or_default();
            let lower = code.to_lowercase();
            let compares = code.contains("==") || code.contains("!=");
            if compares && !code.contains("ct_eq") && SECRET_WORDS.iter().any(|w| lower.contains(w))
            {
                offending.push(format!("{}:{}: {}", file.display(), i + 1, line.trim()));
            }
        }
    }
    assert!(
        offending.is_empty(),
        "secrets compared with == or != (use ct_eq):\n{}",
        offending.join("\n")
    );
}
