//! Startup and authentication: every method, every refusal with its
//! SQLSTATE, bad input, and that one client's trouble never reaches another.

use crate::common;

use crate::common::wire::{read_error, startup_packet};
use crate::common::{sqlstate, PgCluster, Usher, ALICE_PASSWORD};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_client_auth_method_logs_in_and_refuses_a_wrong_password() {
    let pg = PgCluster::shared();
    for method in ["trust", "password", "md5", "scram-sha-256"] {
        let usher = Usher::start(pg, &format!("auth:\n  method: {method}\n")).await;
        let c = usher.alice().await;
        let one: i32 = c.query_one("SELECT 1", &[]).await.unwrap().get(0);
        assert_eq!(one, 1, "{method}");
        if method != "trust" {
            let e = usher
                .connect_as("alice", "wrong")
                .await
                .expect_err("wrong password refused");
            assert_eq!(sqlstate(&e).as_deref(), Some("28P01"), "{method}: {e}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configured_md5_and_scram_secrets_check_client_passwords() {
    let pg = PgCluster::shared();
    let md5 = postgres_protocol::password::md5(ALICE_PASSWORD.as_bytes(), "alice");
    let scram = pg.psql_super("SELECT rolpassword FROM pg_authid WHERE rolname = 'alice'");
    assert!(scram.starts_with("SCRAM-SHA-256$"));
    for (method, secret) in [
        ("md5", md5.as_str()),
        ("scram-sha-256", scram.as_str()),
        ("password", scram.as_str()),
    ] {
        let yaml = common::usher_yaml(pg, &format!("auth:\n  method: {method}\n")).replace(
            &format!("password: {ALICE_PASSWORD}\n"),
            &format!("password: \"{secret}\"\n"),
        );
        let usher = Usher::start_yaml(&yaml).await;
        let e = usher
            .connect_as("alice", "wrong")
            .await
            .expect_err("wrong password refused");
        let db = e.as_db_error().expect("an error from usher");
        assert_eq!(db.code().code(), "28P01", "{method}");
        assert!(
            db.message().contains("password authentication failed"),
            "{method}: {db:?}"
        );
        let login = usher.connect_as("alice", ALICE_PASSWORD).await;
        if secret == scram {
            // The server holds the same verifier: the ClientKey the client
            // proved to usher logs usher in to the server (pass-through).
            let c = login.unwrap_or_else(|e| panic!("{method}: {e}"));
            let me: String = c
                .query_one("SELECT current_user::text", &[])
                .await
                .unwrap()
                .get(0);
            assert_eq!(me, "alice", "{method}");
        } else {
            // An md5 hash answers only md5 challenges; this server asks for SCRAM.
            let e = login.expect_err("no SCRAM login from an md5 hash");
            let db = e.as_db_error().expect("an error from usher");
            assert!(
                db.message().contains("SCRAM password")
                    && db.message().contains("usher does not have")
                    && db.detail() == Some("usher has only the user's md5 hash"),
                "{method}: {db:?}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_user_and_wrong_password_look_the_same() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "").await;
    let unknown = usher.connect_as("mallory", "x").await.err().unwrap();
    let wrong = usher.connect_as("alice", "x").await.err().unwrap();
    let (u, w) = (unknown.as_db_error().unwrap(), wrong.as_db_error().unwrap());
    assert_eq!(u.code().code(), "28P01");
    assert_eq!(w.code().code(), "28P01");
    assert_eq!(
        u.message().replace("mallory", "X"),
        w.message().replace("alice", "X")
    );
    assert_eq!(u.hint(), None);
    assert_eq!(u.detail(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_database_is_3d000() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "").await;
    let conn = format!(
        "host=127.0.0.1 port={} user=alice password={ALICE_PASSWORD} dbname=nope",
        usher.addr.port()
    );
    let e = tokio_postgres::connect(&conn, tokio_postgres::NoTls)
        .await
        .err()
        .unwrap();
    assert_eq!(sqlstate(&e).as_deref(), Some("3D000"), "{e}");
    assert!(
        e.as_db_error()
            .unwrap()
            .message()
            .contains("\"nope\" does not exist"),
        "{e:?}"
    );
}

/// The server's own refusal at usher's login to it (here: the database the
/// config points at does not exist on the server) reaches the client as
/// the server sent it: FATAL, its SQLSTATE and its message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_refusal_reaches_the_client_with_its_fields() {
    let pg = PgCluster::shared();
    let yaml = common::usher_yaml(pg, "").replace(
        "databases:\n",
        &format!(
            "databases:\n  gone:\n    host: 127.0.0.1\n    port: {}\n    dbname: no_such_database\n",
            pg.port
        ),
    );
    let usher = Usher::start_yaml(&yaml).await;
    let e = tokio_postgres::connect(
        &usher.conn_str_db("alice", ALICE_PASSWORD, "gone"),
        tokio_postgres::NoTls,
    )
    .await
    .err()
    .expect("the server refuses");
    let db = e.as_db_error().expect("the server's error, forwarded");
    assert_eq!(db.severity(), "FATAL", "{db:?}");
    assert_eq!(db.code().code(), "3D000", "{db:?}");
    assert_eq!(
        db.message(),
        "database \"no_such_database\" does not exist",
        "{db:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_many_clients_is_53300() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "max_client_conn: 2\n").await;
    let a = usher.alice().await;
    let _b = usher.alice().await;
    let e = usher
        .connect_as("alice", ALICE_PASSWORD)
        .await
        .err()
        .unwrap();
    assert_eq!(sqlstate(&e).as_deref(), Some("53300"), "{e}");
    assert_eq!(
        a.query_one("SELECT 1", &[]).await.unwrap().get::<_, i32>(0),
        1,
        "others unaffected"
    );
    drop(a);
    common::wait::eventually_async(common::wait::DEADLINE, "a client leaves", || async {
        usher.app.deps.clients.connected() == 1
    })
    .await;
    usher.alice().await; // a slot is free again
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_startup_packets_get_08p01_and_others_are_unaffected() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "").await;
    let bystander = usher.alice().await;

    // A length field that is far over the limit: closed without a word,
    // as PostgreSQL does (tests/it/protocol.rs compares the two).
    let mut s = TcpStream::connect(usher.addr).await.unwrap();
    s.write_all(&100_000_000u32.to_be_bytes()).await.unwrap();
    s.write_all(&[0; 8]).await.unwrap();
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut rest)).await;
    assert_eq!(rest, b"", "nothing sent");

    // Parameters without their terminator.
    let mut s = TcpStream::connect(usher.addr).await.unwrap();
    let mut p = startup_packet(&[("user", "alice")]);
    p.truncate(p.len() - 2); // "user\0alice" with no terminators
    let n = p.len() as u32;
    p[..4].copy_from_slice(&n.to_be_bytes());
    s.write_all(&p).await.unwrap();
    assert_eq!(read_error(&mut s).await[&'C'], "08P01");

    // An unsupported protocol version.
    let mut s = TcpStream::connect(usher.addr).await.unwrap();
    s.write_all(&[0, 0, 0, 8, 0, 4, 0, 0]).await.unwrap();
    let e = read_error(&mut s).await;
    assert_eq!(e[&'C'], "0A000");
    assert!(
        e[&'M'].contains("unsupported frontend protocol 4.0"),
        "{e:?}"
    );

    // A message over max_message_size after login.
    let usher2 = Usher::start(pg, "auth:\n  method: trust\nmax_message_size: 4096\n").await;
    let mut s = TcpStream::connect(usher2.addr).await.unwrap();
    s.write_all(&startup_packet(&[("user", "alice"), ("database", "app")]))
        .await
        .unwrap();
    let mut welcome = [0u8; 1024];
    let n = s.read(&mut welcome).await.unwrap();
    assert_eq!(welcome[0], b'R', "AuthenticationOk first ({n} bytes)");
    let mut q = vec![b'Q'];
    q.extend_from_slice(&100_000u32.to_be_bytes());
    s.write_all(&q).await.unwrap();
    let e = read_error(&mut s).await;
    assert_eq!(e[&'C'], "08P01");
    assert!(e[&'M'].contains("invalid message length"), "{e:?}");

    assert_eq!(
        bystander
            .query_one("SELECT 2", &[])
            .await
            .unwrap()
            .get::<_, i32>(0),
        2
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_client_hits_the_auth_timeout() {
    let pg = PgCluster::shared();
    // The bystander's own login must fit in auth_timeout too (two PBKDF2
    // runs in a debug build, on a loaded machine): 0.5 s was too tight.
    let usher = Usher::start(pg, "auth_timeout: 2\n").await;
    let mut silent = TcpStream::connect(usher.addr).await.unwrap();
    let bystander = usher.alice().await;
    let started = std::time::Instant::now();
    let e = read_error(&mut silent).await;
    assert_eq!(e[&'C'], "08P01");
    assert!(e[&'M'].contains("timeout"), "{e:?}");
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(
        bystander
            .query_one("SELECT 3", &[])
            .await
            .unwrap()
            .get::<_, i32>(0),
        3
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ssl_and_gssenc_requests_are_answered_n() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "auth:\n  method: trust\n").await;
    let mut s = TcpStream::connect(usher.addr).await.unwrap();
    for code in [80877103u32, 80877104] {
        s.write_all(&8u32.to_be_bytes()).await.unwrap();
        s.write_all(&code.to_be_bytes()).await.unwrap();
        let mut answer = [0u8; 1];
        s.read_exact(&mut answer).await.unwrap();
        assert_eq!(&answer, b"N");
    }
    // The connection then goes on in plaintext.
    s.write_all(&startup_packet(&[("user", "alice"), ("database", "app")]))
        .await
        .unwrap();
    let mut first = [0u8; 9];
    s.read_exact(&mut first).await.unwrap();
    assert_eq!(first, [b'R', 0, 0, 0, 8, 0, 0, 0, 0], "AuthenticationOk");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn psql_works_through_usher() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "").await;
    let port = usher.addr.port().to_string();
    let out = tokio::process::Command::new("psql")
        .args([
            "-X",
            "-t",
            "-A",
            "-h",
            "127.0.0.1",
            "-p",
            &port,
            "-U",
            "alice",
            "-d",
            "app",
            "-c",
            "SELECT current_user || '@' || current_database()",
        ])
        .env("PGPASSWORD", ALICE_PASSWORD)
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "alice@app");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn startup_parameters_reach_the_server() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "pool_mode: transaction\npool_size: 1\n").await;
    let conn = format!("{} application_name=reporter options='-c search_path=pg_catalog -c statement_timeout=1234'", usher.conn_str("alice", ALICE_PASSWORD));
    let (c, conn) = tokio_postgres::connect(&conn, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let plain = usher.alice().await;
    for _ in 0..3 {
        let row = c.query_one("SELECT current_setting('application_name'), current_setting('search_path'), current_setting('statement_timeout')", &[]).await.unwrap();
        assert_eq!(
            (
                row.get::<_, String>(0),
                row.get::<_, String>(1),
                row.get::<_, String>(2)
            ),
            ("reporter".into(), "pg_catalog".into(), "1234ms".into())
        );
        // The other client on the same server connection sees none of it.
        let row = plain.query_one("SELECT current_setting('application_name'), current_setting('search_path'), current_setting('statement_timeout')", &[]).await.unwrap();
        assert_eq!(
            (
                row.get::<_, String>(0),
                row.get::<_, String>(1),
                row.get::<_, String>(2)
            ),
            ("".into(), "\"$user\", public".into(), "0".into())
        );
    }
}
