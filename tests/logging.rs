//! The log level changes while usher runs (`usher::logging::set_level`, what
//! a configuration reload calls): one test of the in-process subscriber,
//! which is global to this test binary. And what clients and hooks can
//! write into usher's text log and errors (a usher process of its own).

mod common;

use common::wire::{message, read_error, read_message, startup_packet};
use common::{PgCluster, UsherProcess, ALICE_PASSWORD};
use std::collections::HashMap;
use tokio::io::AsyncWriteExt;
use tracing::Level;

#[test]
fn set_level_changes_the_running_filter() {
    // The only test of this binary: nothing else reads the environment.
    std::env::remove_var("USHER_LOG");
    let config = usher::Config::from_yaml("log: { level: warn }\n", "t.yaml").unwrap();
    usher::logging::init(&config.log);
    assert!(tracing::enabled!(Level::WARN));
    assert!(!tracing::enabled!(Level::INFO));

    usher::logging::set_level("info").unwrap();
    assert!(tracing::enabled!(Level::INFO));
    assert!(!tracing::enabled!(Level::DEBUG));

    // A bad filter is refused and the running one stays.
    let e = usher::logging::set_level("usher=loud").unwrap_err();
    assert!(e.to_string().contains("usher=loud"), "{e}");
    assert!(tracing::enabled!(Level::INFO));

    // Per-target filters work too.
    usher::logging::set_level("error,logging=debug").unwrap();
    assert!(tracing::enabled!(Level::DEBUG));
    assert!(!tracing::enabled!(target: "usher::app", Level::WARN));
    assert!(tracing::enabled!(target: "usher::app", Level::ERROR));
}

/// A raw client's login with `user` and `database` and a cleartext
/// password (auth.method: password): the ErrorResponse it ends with.
async fn failed_login(
    usher: &UsherProcess,
    user: &str,
    database: &str,
    password: &str,
) -> HashMap<char, String> {
    let mut s = tokio::net::TcpStream::connect(usher.addr()).await.unwrap();
    s.write_all(&startup_packet(&[("user", user), ("database", database)]))
        .await
        .unwrap();
    let (tag, body) = read_message(&mut s).await;
    assert_eq!(
        (tag, &body[..]),
        (b'R', &3u32.to_be_bytes()[..]),
        "a cleartext password request"
    );
    let mut pw = password.as_bytes().to_vec();
    pw.push(0);
    s.write_all(&message(b'p', &pw)).await.unwrap();
    read_error(&mut s).await
}

/// Issue 25 item 6: a user or database name holding a newline wrote a
/// second, forged line into the text log, ANSI sequences went out raw
/// before authentication, `usher.log()` from a hook did the same, and the
/// client's ErrorResponse echoed the newline. Every text-log field and
/// every echo now escapes control characters (`\x0a`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_text_cannot_forge_log_lines_or_raw_echoes() {
    let pg = PgCluster::shared();
    let hooks = tempfile::tempdir().unwrap();
    std::fs::write(
        hooks.path().join("log.lua"),
        "function client_connection(ctx)\n  usher.log('info', 'hook line\\nFORGED by a hook \\27[31m red')\nend\n",
    )
    .unwrap();
    let usher = UsherProcess::builder(pg)
        .extra(&format!(
            "auth:\n  method: password\nhooks:\n  dir: {}\n",
            hooks.path().display()
        ))
        .env("USHER_LOG", "info")
        .start();

    // A forged user name: the 28P01 quotes it escaped.
    let user = "mallory\nFORGED by a user name \x1b[2J";
    let e = failed_login(&usher, user, "app", "guess").await;
    assert_eq!(e[&'C'], "28P01", "{e:?}");
    assert_eq!(
        e[&'M'],
        "password authentication failed for user \"mallory\\x0aFORGED by a user name \\x1b[2J\""
    );
    // A forged database name, after a good password: the 3D000 too.
    let e = failed_login(
        &usher,
        "alice",
        "app\r\nFORGED by a database name",
        ALICE_PASSWORD,
    )
    .await;
    assert_eq!(e[&'C'], "3D000", "{e:?}");
    assert_eq!(
        e[&'M'],
        "database \"app\\x0d\\x0aFORGED by a database name\" does not exist"
    );
    // A hook's usher.log text with a newline and an escape sequence.
    let (c, _driver) = usher.alice().await;
    c.simple_query("SELECT 1").await.unwrap();
    common::wait::eventually(common::wait::DEADLINE, "the hook's line is logged", || {
        usher.log().contains("hook line")
    });

    let log = usher.log();
    for forged in [
        "FORGED by a user name",
        "FORGED by a database name",
        "FORGED by a hook",
    ] {
        assert!(log.contains(forged), "{forged:?} is logged:\n{log}");
    }
    for line in log.lines() {
        assert!(!line.starts_with("FORGED"), "a forged line:\n{log}");
    }
    assert!(
        !log.contains('\x1b') && !log.contains('\r'),
        "raw control characters:\n{log:?}"
    );
    assert!(
        log.contains("hook line\\x0aFORGED by a hook \\x1b[31m red"),
        "{log}"
    );
}
