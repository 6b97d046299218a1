//! Protocol details where a client can tell usher from PostgreSQL: the same
//! bytes go to the test cluster directly (over its Unix socket, where it
//! answers SSLRequest and GSSENCRequest with `N`, as usher without TLS does)
//! and to usher, and the answers are compared.

use crate::common;

use crate::common::attempts::expect_outcome;
use crate::common::tls::{tls_connect, write_file, TestCa};
use crate::common::wire::{message, read_message, startup_packet};
use crate::common::{PgCluster, Usher};
use std::collections::HashMap;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};
use usher::auth::AuthOutcome;

const SSL_REQUEST: u32 = 80_877_103;
const GSSENC_REQUEST: u32 = 80_877_104;

/// usher with `trust`, so that raw clients log in without SCRAM.
const TRUST: &str = "auth:\n  method: trust\n";

fn request(code: u32) -> Vec<u8> {
    let mut p = 8u32.to_be_bytes().to_vec();
    p.extend_from_slice(&code.to_be_bytes());
    p
}

/// A startup packet: `version`, then `body` as is (no terminator added).
fn raw_startup(version: u32, body: &[u8]) -> Vec<u8> {
    let mut p = ((body.len() + 8) as u32).to_be_bytes().to_vec();
    p.extend_from_slice(&version.to_be_bytes());
    p.extend_from_slice(body);
    p
}

/// A well-formed startup packet for protocol `major.minor`.
fn startup_version(major: u32, minor: u32, params: &[(&str, &str)]) -> Vec<u8> {
    let mut p = startup_packet(params);
    p[4..8].copy_from_slice(&((major << 16) | minor).to_be_bytes());
    p
}

/// One thing a test client does.
enum Step {
    Send(Vec<u8>),
    /// Read the one-byte answer to SSLRequest / GSSENCRequest.
    Byte,
    /// Send, then close the writing half.
    SendAndClose(Vec<u8>),
}

async fn direct(pg: &PgCluster) -> UnixStream {
    UnixStream::connect(pg.dir.join(format!(".s.PGSQL.{}", pg.port)))
        .await
        .unwrap()
}

/// Runs `steps`, then reads messages until an authentication request (the
/// login goes on: the comparison stops there) or the end of the connection.
/// One line per answer: `byte N`, `E FATAL 08P01 message`, `v 196608
/// [names]`, `R`, or `closed`.
async fn converse<S: AsyncRead + AsyncWrite + Unpin>(mut s: S, steps: &[Step]) -> Vec<String> {
    let mut out = Vec::new();
    for step in steps {
        match step {
            Step::Send(b) => s.write_all(b).await.unwrap(),
            Step::SendAndClose(b) => {
                s.write_all(b).await.unwrap();
                s.shutdown().await.unwrap();
            }
            Step::Byte => {
                let b = tokio::time::timeout(Duration::from_secs(10), s.read_u8())
                    .await
                    .expect("an answer within 10 s");
                match b {
                    Ok(b) => out.push(format!("byte {}", b as char)),
                    Err(_) => {
                        out.push("closed".into());
                        return out;
                    }
                }
            }
        }
    }
    loop {
        let read = tokio::time::timeout(Duration::from_secs(10), read_any(&mut s))
            .await
            .expect("an answer or the end within 10 s");
        let Some((tag, body)) = read else {
            out.push("closed".into());
            return out;
        };
        match tag {
            b'E' | b'N' => {
                let f = fields(&body);
                out.push(format!(
                    "{} {} {} {}",
                    tag as char, f[&'V'], f[&'C'], f[&'M']
                ));
            }
            b'v' => {
                let version = u32::from_be_bytes(body[..4].try_into().unwrap());
                let count = u32::from_be_bytes(body[4..8].try_into().unwrap());
                let names: Vec<String> = body[8..]
                    .split(|b| *b == 0)
                    .filter(|n| !n.is_empty())
                    .map(|n| String::from_utf8_lossy(n).into_owned())
                    .collect();
                assert_eq!(count as usize, names.len());
                out.push(format!("v {version} {names:?}"));
            }
            b'R' => {
                out.push("R".into());
                return out;
            }
            other => out.push(format!("{}", other as char)),
        }
    }
}

/// One message, or `None` at the end of the connection.
async fn read_any<S: AsyncRead + Unpin>(s: &mut S) -> Option<(u8, Vec<u8>)> {
    let tag = s.read_u8().await.ok()?;
    let len = s.read_u32().await.ok()? as usize;
    let mut body = vec![0; len - 4];
    s.read_exact(&mut body).await.ok()?;
    Some((tag, body))
}

fn fields(body: &[u8]) -> HashMap<char, String> {
    body.split(|b| *b == 0)
        .filter(|f| !f.is_empty())
        .map(|f| (f[0] as char, String::from_utf8_lossy(&f[1..]).into_owned()))
        .collect()
}

/// The same steps to PostgreSQL and to usher: the same answers.
async fn same_answers(pg: &PgCluster, usher: &Usher, steps: &[Step]) -> Vec<String> {
    let expected = converse(direct(pg).await, steps).await;
    let got = converse(TcpStream::connect(usher.addr).await.unwrap(), steps).await;
    assert_eq!(got, expected, "usher (left) and PostgreSQL (right) differ");
    got
}

/// Reads messages to ReadyForQuery after a trust login; panics on an error.
async fn logged_in<S: AsyncRead + Unpin>(s: &mut S) {
    loop {
        match read_message(s).await {
            (b'Z', _) => return,
            (b'E', body) => panic!("login failed: {:?}", fields(&body)),
            _ => {}
        }
    }
}

/// Reads until the connection ends; every message (tag, body).
async fn read_to_end<S: AsyncRead + Unpin>(s: &mut S) -> Vec<(u8, Vec<u8>)> {
    let mut all = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(m) = read_any(s).await {
            all.push(m);
        }
    })
    .await
    .expect("the connection ends within 10 s");
    all
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn newer_minor_versions_and_pq_options_get_negotiate_protocol_version() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "").await;
    let alice = [("user", "alice"), ("database", "app")];

    // 3.2 (libpq 18 may ask for it): NegotiateProtocolVersion says 3.0,
    // then the login goes on.
    let a = same_answers(pg, &usher, &[Step::Send(startup_version(3, 2, &alice))]).await;
    assert_eq!(a, ["v 196608 []", "R"]);

    // _pq_. options are named back as unrecognized, in order.
    let p = startup_packet(&[
        ("user", "alice"),
        ("_pq_.foo", "1"),
        ("database", "app"),
        ("_pq_.bar", "x"),
    ]);
    let a = same_answers(pg, &usher, &[Step::Send(p)]).await;
    assert_eq!(a, [r#"v 196608 ["_pq_.foo", "_pq_.bar"]"#, "R"]);

    // Sent before the packet's other errors are reported.
    let p = startup_version(3, 1, &[("_pq_.x", "1"), ("database", "app")]);
    let a = same_answers(pg, &usher, &[Step::Send(p)]).await;
    assert_eq!(
        a,
        [
            r#"v 196608 ["_pq_.x"]"#,
            "E FATAL 28000 no PostgreSQL user name specified in startup packet",
            "closed"
        ]
    );

    // Not sent when the layout is wrong: that error comes first.
    let a = same_answers(
        pg,
        &usher,
        &[Step::Send(raw_startup(3 << 16 | 2, b"user\0alice\0"))],
    )
    .await;
    assert_eq!(
        a,
        [
            "E FATAL 08P01 invalid startup packet layout: expected terminator as last byte",
            "closed"
        ]
    );

    // Another major version is refused.
    for major in [4, 1234] {
        let a = same_answers(pg, &usher, &[Step::Send(startup_version(major, 2, &alice))]).await;
        assert_eq!(
            a,
            [
                format!("E FATAL 0A000 unsupported frontend protocol {major}.2: server supports 3.0 to 3.0"),
                "closed".into()
            ]
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn old_protocol_versions_get_the_old_error_format() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "").await;
    for version in [2 << 16, 1 << 16, 1] {
        let p = raw_startup(version, b"user\0alice\0\0");
        let mut answers = Vec::new();
        for mut s in [
            TcpStream::connect(usher.addr).await.unwrap(),
            TcpStream::connect(("127.0.0.1", pg.port)).await.unwrap(),
        ] {
            s.write_all(&p).await.unwrap();
            let mut all = Vec::new();
            tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut all))
                .await
                .unwrap()
                .unwrap();
            answers.push(String::from_utf8_lossy(&all).into_owned());
        }
        assert_eq!(answers[0], answers[1], "version {version:#x}");
        assert!(answers[0].starts_with("EFATAL:  unsupported frontend protocol"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_protocol_3_2_client_is_served_as_3_0() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, TRUST).await;
    let mut s = TcpStream::connect(usher.addr).await.unwrap();
    s.write_all(&startup_version(
        3,
        2,
        &[("user", "alice"), ("database", "app"), ("_pq_.x", "y")],
    ))
    .await
    .unwrap();
    let (tag, body) = read_message(&mut s).await;
    assert_eq!(tag, b'v');
    assert_eq!(&body[..8], &[0, 3, 0, 0, 0, 0, 0, 1]);
    logged_in(&mut s).await;
    s.write_all(&message(b'Q', b"SELECT 41 + 1\0"))
        .await
        .unwrap();
    loop {
        match read_message(&mut s).await {
            (b'D', body) => assert!(body.ends_with(b"42")),
            (b'Z', _) => break,
            (b'E', body) => panic!("{:?}", fields(&body)),
            _ => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_startup_packet_layout_is_checked_as_postgresql_does() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "").await;
    let v3 = 3 << 16;
    let layout = "E FATAL 08P01 invalid startup packet layout: expected terminator as last byte";
    let cases: &[(&[u8], &str)] = &[
        (b"user\0alice\0database\0app\0\0", "R"),
        (b"", layout),
        (b"user\0alice\0", layout),
        (b"user\0alice", layout),
        (b"user\0", layout),
        (b"user", layout),
        (b"user\0alice\0\0\0", layout),
        (b"user\0alice\0\0database\0app\0", layout),
        (b"\0user\0alice\0\0", layout),
        (
            b"\0",
            "E FATAL 28000 no PostgreSQL user name specified in startup packet",
        ),
        (
            b"user\0\0database\0app\0\0",
            "E FATAL 28000 no PostgreSQL user name specified in startup packet",
        ),
        (
            b"user\0alice\0replication\0maybe\0\0",
            "E FATAL 22023 invalid value for parameter \"replication\": \"maybe\"",
        ),
    ];
    for (body, first) in cases {
        let a = same_answers(pg, &usher, &[Step::Send(raw_startup(v3, body))]).await;
        assert_eq!(a[0], *first, "{body:?}");
    }

    // Lengths: the body after the length word may be 10,000 bytes, not more.
    let mut body = b"user\0alice\0database\0app\0".to_vec();
    body.resize(10_000 - 4, 0);
    let a = same_answers(pg, &usher, &[Step::Send(raw_startup(v3, &body))]).await;
    assert_eq!(a[0], layout);
    body.push(0);
    let a = same_answers(pg, &usher, &[Step::Send(raw_startup(v3, &body))]).await;
    assert_eq!(a, ["closed"], "over the limit: closed without a word");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_ssl_or_gssenc_request_is_refused_as_postgresql_refuses_it() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "").await;
    let (ssl, gss) = (request(SSL_REQUEST), request(GSSENC_REQUEST));
    let startup = startup_packet(&[("user", "alice"), ("database", "app")]);
    let unsupported = |code: &str| {
        format!("E FATAL 0A000 unsupported frontend protocol {code}: server supports 3.0 to 3.0")
    };
    let a = same_answers(
        pg,
        &usher,
        &[Step::Send(ssl.clone()), Step::Byte, Step::Send(ssl.clone())],
    )
    .await;
    assert_eq!(
        a,
        ["byte N".into(), unsupported("1234.5679"), "closed".into()]
    );
    let a = same_answers(
        pg,
        &usher,
        &[Step::Send(gss.clone()), Step::Byte, Step::Send(gss.clone())],
    )
    .await;
    assert_eq!(
        a,
        ["byte N".into(), unsupported("1234.5680"), "closed".into()]
    );
    // One of each, in either order, is fine; a third is not.
    let a = same_answers(
        pg,
        &usher,
        &[
            Step::Send(ssl.clone()),
            Step::Byte,
            Step::Send(gss.clone()),
            Step::Byte,
            Step::Send(ssl.clone()),
        ],
    )
    .await;
    assert_eq!(a[2], unsupported("1234.5679"));
    let a = same_answers(
        pg,
        &usher,
        &[
            Step::Send(gss.clone()),
            Step::Byte,
            Step::Send(ssl.clone()),
            Step::Byte,
            Step::Send(startup),
        ],
    )
    .await;
    assert_eq!(a, ["byte N", "byte N", "R"]);
    // A request with extra bytes is still a request.
    let mut long_ssl = ssl.clone();
    long_ssl[3] = 12;
    long_ssl.extend_from_slice(&[0; 4]);
    let a = same_answers(
        pg,
        &usher,
        &[Step::Send(long_ssl), Step::Byte, Step::Send(ssl.clone())],
    )
    .await;
    assert_eq!(a[0], "byte N");

    // Over TLS: a second SSLRequest, or a GSSENCRequest, gets the same
    // error (PostgreSQL takes both as done once TLS is on).
    let ca = TestCa::new("protocol CA");
    let dir = tempfile::tempdir().unwrap();
    let pair = ca.server(&["127.0.0.1"]);
    let cert = write_file(dir.path(), "usher.crt", &pair.cert_pem);
    let key = write_file(dir.path(), "usher.key", &pair.key_pem);
    let tls_usher = Usher::start(
        pg,
        &format!(
            "tls:\n  cert: {}\n  key: {}\n",
            cert.display(),
            key.display()
        ),
    )
    .await;
    for (again, code) in [(&ssl, "1234.5679"), (&gss, "1234.5680")] {
        let tls = tls_connect(tls_usher.addr, &ca.cert_pem).await;
        let a = converse(tls, &[Step::Send(again.clone())]).await;
        assert_eq!(a, [unsupported(code), "closed".into()]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_sent_before_the_answer_to_an_ssl_or_gssenc_request_are_refused() {
    // PostgreSQL refuses what arrived with the request, before its answer:
    // it was not sent over the encryption the client asked for, so it may
    // have been injected (CVE-2021-23214). usher reads ahead at login and
    // must not take it either.
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "").await;
    let startup = startup_packet(&[("user", "alice"), ("database", "app")]);
    for (code, what) in [
        (SSL_REQUEST, "SSL request"),
        (GSSENC_REQUEST, "GSSAPI encryption request"),
    ] {
        let mut both = request(code);
        both.extend_from_slice(&startup);
        let a = same_answers(pg, &usher, &[Step::Send(both), Step::Byte]).await;
        assert_eq!(
            a,
            [
                "byte N".to_string(),
                format!("E FATAL 08P01 received unencrypted data after {what}"),
                "closed".into()
            ]
        );
    }
    // Sent after the answer, the same bytes are a login; and a packet that
    // comes in pieces is put together.
    let (head, tail) = startup.split_at(7);
    let a = same_answers(
        pg,
        &usher,
        &[
            Step::Send(request(SSL_REQUEST)),
            Step::Byte,
            Step::Send(head.to_vec()),
            Step::Send(tail.to_vec()),
        ],
    )
    .await;
    assert_eq!(a, ["byte N", "R"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_query_sent_with_the_startup_packet_is_answered_after_the_login() {
    // A client may send its first query without waiting for the login's
    // end (trust needs no answer from it): what usher read ahead with the
    // startup packet is the session's first input.
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, TRUST).await;
    let mut s = TcpStream::connect(usher.addr).await.unwrap();
    let mut bytes = startup_packet(&[("user", "alice"), ("database", "app")]);
    bytes.extend_from_slice(&message(b'Q', b"SELECT 41 + 1\0"));
    s.write_all(&bytes).await.unwrap();
    logged_in(&mut s).await;
    let mut rows = Vec::new();
    loop {
        match read_message(&mut s).await {
            (b'D', body) => rows.push(String::from_utf8_lossy(&body[6..]).into_owned()),
            (b'E', body) => panic!("query failed: {:?}", fields(&body)),
            (b'Z', _) => break,
            _ => {}
        }
    }
    assert_eq!(rows, ["42"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_that_are_not_a_startup_packet_close_the_connection_silently() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "").await;
    let mut attempts = usher.app.auth_attempts();
    let mut cancel_12 = request(80_877_102);
    cancel_12[3] = 12;
    cancel_12.extend_from_slice(&[0; 4]);
    let cases: Vec<(&str, Vec<Step>)> = vec![
        // node-postgres ends a connection at once with Terminate.
        ("terminate", vec![Step::Send(b"X\0\0\0\x04".to_vec())]),
        ("length 4", vec![Step::Send(4u32.to_be_bytes().to_vec())]),
        ("length 7", vec![Step::Send(b"\0\0\0\x07abc".to_vec())]),
        (
            "huge length",
            vec![Step::Send(100_000_000u32.to_be_bytes().to_vec())],
        ),
        ("half a length", vec![Step::SendAndClose(vec![0, 0])]),
        (
            "cut short",
            vec![Step::SendAndClose(b"\0\0\0\x20abcd".to_vec())],
        ),
        ("cancel of 12 bytes", vec![Step::Send(cancel_12)]),
    ];
    for (what, steps) in &cases {
        let a = same_answers(pg, &usher, steps).await;
        assert_eq!(a, ["closed"], "{what}");
        expect_outcome(&mut attempts, "", AuthOutcome::ProtocolError).await;
    }
    // Connecting and leaving without a byte is no attempt at all.
    let a = same_answers(pg, &usher, &[Step::SendAndClose(vec![])]).await;
    assert_eq!(a, ["closed"]);
}

/// Sends a Query with this body; the answers up to ReadyForQuery.
async fn query<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S, body: &[u8]) -> Vec<String> {
    s.write_all(&message(b'Q', body)).await.unwrap();
    let mut out = Vec::new();
    loop {
        match read_message(s).await {
            (b'E', body) => {
                let f = fields(&body);
                out.push(format!("E {} {} {}", f[&'V'], f[&'C'], f[&'M']));
            }
            (b'Z', _) => return out,
            (tag, _) => out.push((tag as char).to_string()),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_queries_with_a_nul_or_bad_utf8_get_postgresql_errors() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, TRUST).await;
    let mut console = TcpStream::connect(usher.addr).await.unwrap();
    console
        .write_all(&startup_packet(&[("user", "admin"), ("database", "usher")]))
        .await
        .unwrap();
    logged_in(&mut console).await;
    let mut server = direct(pg).await;
    server
        .write_all(&startup_packet(&[("user", "postgres")]))
        .await
        .unwrap();
    logged_in(&mut server).await;

    for (sql, postgres) in [
        (&b"SHOW\0VERSION\0"[..], &b"SELECT\0 1\0"[..]),
        (b"SHOW VERSION", b"SELECT 1"),
        (b"SHOW VERSION\0\0", b"SELECT 1\0\0"),
        (b"SHOW \xe2\x28\xa1\0", b"SELECT \xe2\x28\xa1\0"),
        (b"SHOW \xff\0", b"SELECT \xff\0"),
    ] {
        let expected = query(&mut server, postgres).await;
        assert_eq!(expected.len(), 1, "{expected:?}");
        assert_eq!(query(&mut console, sql).await, expected, "{sql:?}");
    }
    // The session goes on.
    assert_eq!(
        query(&mut console, b"SHOW VERSION\0").await,
        ["T", "D", "C"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_do_not_echo_control_characters_or_unbounded_input() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, TRUST).await;
    let mut console = TcpStream::connect(usher.addr).await.unwrap();
    console
        .write_all(&startup_packet(&[("user", "admin"), ("database", "usher")]))
        .await
        .unwrap();
    logged_in(&mut console).await;
    let mut long = b"NONSENSE \x1b[2J".to_vec();
    long.extend(std::iter::repeat_n(b'x', 50_000));
    long.push(0);
    for sql in [
        &long[..],
        b"SHOW \x1b[2J\0",
        b"KILL_CLIENT \x07\x07\0",
        b"PAUSE \x1b\0",
    ] {
        let a = query(&mut console, sql).await;
        assert_eq!(a.len(), 1, "{a:?}");
        assert!(a[0].starts_with("E ERROR "), "{a:?}");
        assert!(!a[0].contains('\x1b') && !a[0].contains('\x07'), "{a:?}");
        assert!(a[0].len() < 300, "{} bytes", a[0].len());
    }

    // User and database names: PostgreSQL's length (63 bytes), control
    // characters escaped.
    let db = format!("\x1b[31m{}", "d".repeat(100));
    let mut s = TcpStream::connect(usher.addr).await.unwrap();
    s.write_all(&startup_packet(&[("user", "alice"), ("database", &db)]))
        .await
        .unwrap();
    let e = common::wire::read_error(&mut s).await;
    assert_eq!(e[&'C'], "3D000");
    let expected = format!("database \"\\x1b[31m{}\" does not exist", "d".repeat(58));
    assert_eq!(e[&'M'], expected);

    // A SASL mechanism is not echoed (PostgreSQL does not either).
    let usher = Usher::start(pg, "").await;
    let mut s = TcpStream::connect(usher.addr).await.unwrap();
    common::wire::start_sasl(&mut s, "alice").await;
    let mut body = b"\x1b[2J SCRAM\0".to_vec();
    body.extend_from_slice(&4i32.to_be_bytes());
    body.extend_from_slice(b"n,,x");
    s.write_all(&message(b'p', &body)).await.unwrap();
    let e = common::wire::read_error(&mut s).await;
    assert_eq!(
        e[&'M'],
        "client selected an invalid SASL authentication mechanism"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_fatal_reaches_the_client_once() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, &format!("pool_mode: session\n{TRUST}")).await;
    let mut s = TcpStream::connect(usher.addr).await.unwrap();
    s.write_all(&startup_packet(&[("user", "alice"), ("database", "app")]))
        .await
        .unwrap();
    logged_in(&mut s).await;
    s.write_all(&message(b'Q', b"SELECT pg_backend_pid()\0"))
        .await
        .unwrap();
    let mut pid = String::new();
    loop {
        match read_message(&mut s).await {
            (b'D', body) => pid = String::from_utf8_lossy(&body[6..]).into_owned(),
            (b'Z', _) => break,
            _ => {}
        }
    }
    pg.psql_super(&format!("SELECT pg_terminate_backend({pid})"));
    let all = read_to_end(&mut s).await;
    let errors: Vec<HashMap<char, String>> = all
        .iter()
        .filter(|(tag, _)| *tag == b'E')
        .map(|(_, body)| fields(body))
        .collect();
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(errors[0][&'C'], "57P01");
    assert_eq!(errors[0][&'V'], "FATAL");
}

/// The login's answers, one line each, up to ReadyForQuery or the end:
/// `R 0`, `N NOTICE 42622 message`, `S name=value`, `K`, `Z I`,
/// `E FATAL 22023 message`. BackendKeyData's numbers differ by nature.
async fn welcome<S: AsyncRead + AsyncWrite + Unpin>(
    mut s: S,
    params: &[(&str, &str)],
) -> Vec<String> {
    s.write_all(&startup_packet(params)).await.unwrap();
    let mut out = Vec::new();
    loop {
        let read = tokio::time::timeout(Duration::from_secs(10), read_any(&mut s))
            .await
            .expect("an answer within 10 s");
        let Some((tag, body)) = read else {
            out.push("closed".into());
            return out;
        };
        match tag {
            b'R' => out.push(format!(
                "R {}",
                u32::from_be_bytes(body[..4].try_into().unwrap())
            )),
            b'E' | b'N' => {
                let f = fields(&body);
                out.push(format!(
                    "{} {} {} {}",
                    tag as char, f[&'V'], f[&'C'], f[&'M']
                ));
            }
            b'S' => {
                let mut parts = body.split(|b| *b == 0);
                let name = String::from_utf8_lossy(parts.next().unwrap());
                let value = String::from_utf8_lossy(parts.next().unwrap());
                out.push(format!("S {name}={value}"));
            }
            b'K' => out.push("K".into()),
            b'Z' => {
                out.push(format!("Z {}", body[0] as char));
                return out;
            }
            other => out.push(format!("{}", other as char)),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_login_reports_the_servers_values_and_notices_as_postgresql_does() {
    let pg = PgCluster::shared();
    let long_name = "a".repeat(65);
    let cases: Vec<Vec<(&str, &str)>> = vec![
        // Raw values the server normalises, and a NOTICE (42622) while
        // applying them.
        vec![
            ("client_encoding", "utf-8"),
            ("datestyle", "iso"),
            ("application_name", &long_name),
            ("timezone", "utc"),
            ("intervalstyle", "ISO_8601"),
        ],
        // No notice: in transaction mode the second round's login finds
        // the server's spelling in what the first one learnt.
        vec![
            ("client_encoding", "utf-8"),
            ("datestyle", "iso"),
            ("timezone", "utc"),
        ],
        // Nothing to apply.
        vec![],
        // A bad startup parameter is the server's FATAL error, after
        // AuthenticationOk, as PostgreSQL sends it.
        vec![("options", "-c work_mem=banana")],
        vec![("no_such_parameter", "x")],
        vec![("is_superuser", "on")],
    ];
    for mode in ["session", "transaction"] {
        let usher = Usher::start(pg, &format!("pool_mode: {mode}\npool_size: 2\n{TRUST}")).await;
        // Twice: the second login may find what the first learnt.
        for round in 0..2 {
            for case in &cases {
                let mut params = vec![("user", "alice"), ("database", "app")];
                params.extend(case.iter().copied());
                let expected = welcome(direct(pg).await, &params).await;
                let got = welcome(TcpStream::connect(usher.addr).await.unwrap(), &params).await;
                assert_eq!(
                    got, expected,
                    "{mode} mode, round {round}, {case:?}: usher (left) and PostgreSQL (right) differ"
                );
            }
        }
    }
}

/// A trust login as alice in session mode: the stream, and the
/// BackendKeyData (pid, secret) usher told.
async fn session_login(usher: &Usher) -> (TcpStream, u32, u32) {
    let mut s = TcpStream::connect(usher.addr).await.unwrap();
    s.write_all(&startup_packet(&[("user", "alice"), ("database", "app")]))
        .await
        .unwrap();
    let mut key = None;
    loop {
        match read_message(&mut s).await {
            (b'K', body) => {
                key = Some((
                    u32::from_be_bytes(body[..4].try_into().unwrap()),
                    u32::from_be_bytes(body[4..8].try_into().unwrap()),
                ))
            }
            (b'Z', _) => break,
            (b'E', body) => panic!("login failed: {:?}", fields(&body)),
            _ => {}
        }
    }
    let (pid, secret) = key.expect("BackendKeyData");
    (s, pid, secret)
}

/// Runs one simple query; the first column of its first row (or the
/// error's SQLSTATE as `E code`), and the sender pid of any notification.
async fn first_value<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    sql: &str,
) -> (String, Option<u32>) {
    let mut body = sql.as_bytes().to_vec();
    body.push(0);
    s.write_all(&message(b'Q', &body)).await.unwrap();
    let (mut value, mut notified) = (String::new(), None);
    loop {
        match read_message(s).await {
            (b'D', body) if value.is_empty() => {
                let len = i32::from_be_bytes(body[2..6].try_into().unwrap()) as usize;
                value = String::from_utf8_lossy(&body[6..6 + len]).into_owned();
            }
            (b'A', body) => notified = Some(u32::from_be_bytes(body[..4].try_into().unwrap())),
            (b'E', body) => value = format!("E {}", fields(&body)[&'C']),
            (b'Z', _) => return (value, notified),
            _ => {}
        }
    }
}

async fn send_cancel(usher: &Usher, pid: u32, secret: u32) {
    let mut c = TcpStream::connect(usher.addr).await.unwrap();
    let mut p = 16u32.to_be_bytes().to_vec();
    p.extend_from_slice(&80_877_102u32.to_be_bytes());
    p.extend_from_slice(&pid.to_be_bytes());
    p.extend_from_slice(&secret.to_be_bytes());
    c.write_all(&p).await.unwrap();
    // usher closes it once the cancel has gone to the server (or nowhere).
    let _ = read_to_end(&mut c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_mode_tells_the_backends_pid_and_cancels_still_find_their_client() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, &format!("pool_mode: session\npool_size: 1\n{TRUST}")).await;
    let (mut a, pid_a, secret_a) = session_login(&usher).await;
    let (backend, _) = first_value(&mut a, "SELECT pg_backend_pid()").await;
    assert_eq!(
        backend,
        pid_a.to_string(),
        "BackendKeyData is the backend's pid"
    );
    let (_, sender) = first_value(&mut a, "LISTEN usher_pid_test; NOTIFY usher_pid_test").await;
    assert_eq!(
        sender,
        Some(pid_a),
        "a notification's sender is the pid told"
    );

    // A cancel with the key usher gave reaches the query.
    let sleeping = tokio::spawn(async move {
        let (v, _) = first_value(&mut a, "SELECT pg_sleep(60)").await;
        (a, v)
    });
    pg.wait_until_active("SELECT pg_sleep(60)").await;
    send_cancel(&usher, pid_a, secret_a).await;
    let (a, v) = sleeping.await.unwrap();
    assert_eq!(v, "E 57014");
    drop(a);

    // The next client gets the same backend (pool_size 1), so the same pid,
    // with its own secret: the first client's key cancels nothing of it.
    let (mut b, pid_b, secret_b) = common::wait::wait_for_async(
        common::wait::DEADLINE,
        "the first client's backend is back in the pool",
        || async {
            let (s, pid, secret) = session_login(&usher).await;
            if pid == pid_a {
                Ok((s, pid, secret))
            } else {
                Err(pid)
            }
        },
    )
    .await;
    assert_ne!(secret_b, secret_a);
    let (backend, _) = first_value(&mut b, "SELECT pg_backend_pid()").await;
    assert_eq!(backend, pid_b.to_string());
    let sleeping = tokio::spawn(async move {
        let (v, _) = first_value(&mut b, "SELECT pg_sleep(61)").await;
        (b, v)
    });
    pg.wait_until_active("SELECT pg_sleep(61)").await;
    send_cancel(&usher, pid_a, secret_a).await;
    assert!(
        pg.query_active("SELECT pg_sleep(61)"),
        "the previous client's key cancelled the next client's query"
    );
    send_cancel(&usher, pid_b, secret_b).await;
    let (mut b, v) = sleeping.await.unwrap();
    assert_eq!(v, "E 57014");

    // pg_terminate_backend(<the pid told>) ends that client's backend.
    assert_eq!(
        pg.psql_super(&format!("SELECT pg_terminate_backend({pid_b})")),
        "t"
    );
    let all = read_to_end(&mut b).await;
    assert!(
        all.iter()
            .any(|(tag, body)| *tag == b'E' && fields(body)[&'C'] == "57P01"),
        "the client learns its backend was terminated"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_mode_tells_usher_s_own_pid() {
    let pg = PgCluster::shared();
    let usher = Usher::start(
        pg,
        &format!("pool_mode: transaction\npool_size: 1\n{TRUST}"),
    )
    .await;
    let (mut a, pid, _) = session_login(&usher).await;
    let (backend, _) = first_value(&mut a, "SELECT pg_backend_pid()").await;
    assert_ne!(backend, pid.to_string());
}
