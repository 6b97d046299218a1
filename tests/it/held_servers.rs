#![allow(clippy::await_holding_lock)] // common::one_at_a_time
//! A server connection is a pool's scarcest thing: a client may not keep
//! one without a request in flight (idle_transaction_timeout covers every
//! such state), one that leaves mid-query has its query cancelled, so
//! pool_size bounds PostgreSQL backends, and one that leaves while it
//! waits for a server is not waited for.

use crate::common;

use crate::common::canary::Canary;
use crate::common::console::{console, get, row, wait_for_rows, Row};
use crate::common::wait::{eventually_async, wait_for_async};
use crate::common::wire::{message, read_error, read_message, startup_packet, trust_login};
use crate::common::{PgCluster, Usher};
use std::time::Duration;
use tokio::io::AsyncWriteExt;

/// Waits until the pool of alice/app lends `n` server connections.
async fn wait_for_lent(usher: &Usher, n: usize) {
    wait_for_async(
        Duration::from_secs(10),
        &format!("sv_active becomes {n}"),
        || async {
            let pools = console(usher, "SHOW POOLS").await;
            let lent = get(row(&pools, "user", "alice"), "sv_active")
                .unwrap_or("0")
                .to_string();
            if lent == n.to_string() {
                Ok(())
            } else {
                Err(lent)
            }
        },
    )
    .await
}

/// Every way of holding a server connection without a complete request in
/// flight ends with 25P03 after idle_transaction_timeout, and the server
/// connection goes to the next client.
/// A cluster of its own: the tests count all of alice's backends.
fn own_cluster() -> &'static PgCluster {
    PgCluster::own(module_path!())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_holding_a_server_without_a_request_is_timed_out() {
    // One of them counts all of alice's backends on the shared cluster.
    let _alone = common::one_at_a_time();
    let pg = own_cluster();
    pg.psql_super_db(
        "app",
        "CREATE TABLE IF NOT EXISTS held_copy (x int); GRANT ALL ON held_copy TO alice",
    );
    let usher = Usher::start(
        pg,
        "auth:\n  method: trust\npool_mode: transaction\npool_size: 1\n\
         idle_transaction_timeout: 0.5\nquery_wait_timeout: 5\n",
    )
    .await;
    // A Query this large streams through (smaller ones are read whole
    // before anything goes to the server).
    let large = format!("SELECT '{}'\0", "x".repeat(100_000));
    let query = message(b'Q', large.as_bytes());
    let stunts: [(&str, Vec<u8>); 4] = [
        ("a lone Flush", message(b'H', b"")),
        ("half a message", query[..query.len() / 2].to_vec()),
        ("a Parse without Sync", message(b'P', b"\0SELECT 1\0\0\0")),
        (
            "COPY FROM STDIN without data",
            message(b'Q', b"COPY held_copy FROM STDIN\0"),
        ),
    ];
    for (what, bytes) in stunts {
        let mut holder = trust_login(usher.addr).await;
        holder.write_all(&bytes).await.unwrap();
        wait_for_lent(&usher, 1).await;
        // The next client gets the server once the holder is cut off
        // (before: it waited query_wait_timeout and got 53300).
        let bystander = usher.alice().await;
        bystander
            .simple_query("SELECT 1")
            .await
            .unwrap_or_else(|e| panic!("{what}: the bystander got {e:?}"));
        let e = read_error(&mut holder).await;
        assert_eq!(e[&'C'], "25P03", "{what}: {e:?}");
    }
}

/// Issue 25 item 9: after BEGIN, a Query sent one byte every 300 ms held
/// the server connection for as long as the trickle lasted, since every
/// byte restarted idle_transaction_timeout. PostgreSQL ends the same
/// trickle at idle_in_transaction_session_timeout (bytes of an unfinished
/// message do not reset it); so does usher now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_byte_trickle_does_not_hold_off_idle_transaction_timeout() {
    // One of them counts all of alice's backends on the shared cluster.
    let _alone = common::one_at_a_time();
    let pg = own_cluster();
    let usher = Usher::start(
        pg,
        "auth:\n  method: trust\npool_mode: transaction\npool_size: 1\n\
         idle_transaction_timeout: 1\n",
    )
    .await;
    let canary = Canary::start(usher.addr.port());
    let mut holder = trust_login(usher.addr).await;
    holder.write_all(&message(b'Q', b"BEGIN\0")).await.unwrap();
    loop {
        let (tag, body) = read_message(&mut holder).await;
        if tag == b'Z' {
            assert_eq!(body, b"T", "in a transaction");
            break;
        }
    }
    // 60 bytes at one every 300 ms: 18 s of trickle against a 1 s timeout.
    let query = message(
        b'Q',
        format!("SELECT 1 /* {} */\0", "-".repeat(40)).as_bytes(),
    );
    let (mut from_usher, mut to_usher) = holder.into_split();
    let trickle = tokio::spawn(async move {
        for byte in query {
            if to_usher.write_all(&[byte]).await.is_err() {
                return false;
            }
            // The point of the test: time passes between the bytes.
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        true
    });
    let e = read_error(&mut from_usher).await;
    assert_eq!(e[&'C'], "25P03", "{e:?}");
    trickle.abort();
    // The server connection is free for the next client.
    usher.alice().await.simple_query("SELECT 1").await.unwrap();
    canary.check();
}

/// Clients of alice waiting for a server connection (SHOW POOLS).
async fn waiting(usher: &Usher) -> String {
    let pools = console(usher, "SHOW POOLS").await;
    get(row(&pools, "user", "alice"), "cl_waiting")
        .unwrap_or("0")
        .to_string()
}

/// Issue 25 item 11: a client that left while it waited for a server still
/// counted as waiting until query_wait_timeout, and its query ran once a
/// server came free. Now its socket is watched while it waits: gone (a
/// close, or a Terminate), it stops waiting and its query never runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_while_waiting_is_not_waited_for() {
    // One of them counts all of alice's backends on the shared cluster.
    let _alone = common::one_at_a_time();
    let pg = own_cluster();
    pg.psql_super_db(
        "app",
        "CREATE TABLE IF NOT EXISTS left_waiting (how text); GRANT ALL ON left_waiting TO alice",
    );
    let usher = Usher::start(
        pg,
        "auth:\n  method: trust\npool_mode: transaction\npool_size: 1\nquery_wait_timeout: 120\n",
    )
    .await;
    let canary = Canary::start(usher.addr.port());
    let holder = usher.alice().await;
    holder
        .batch_execute("DELETE FROM left_waiting")
        .await
        .unwrap();
    for how in ["close", "terminate"] {
        holder.batch_execute("BEGIN; SELECT 1").await.unwrap();
        let mut waiter = trust_login(usher.addr).await;
        let insert = format!("INSERT INTO left_waiting VALUES ('{how}')\0");
        waiter
            .write_all(&message(b'Q', insert.as_bytes()))
            .await
            .unwrap();
        wait_for_async(Duration::from_secs(10), "the waiter waits", || async {
            match waiting(&usher).await.as_str() {
                "1" => Ok(()),
                other => Err(other.to_string()),
            }
        })
        .await;
        if how == "terminate" {
            waiter.write_all(&message(b'X', b"")).await.unwrap();
        }
        drop(waiter);
        // It stops waiting at once (before: until query_wait_timeout).
        wait_for_async(
            Duration::from_secs(10),
            &format!("{how}: nobody waits"),
            || async {
                match waiting(&usher).await.as_str() {
                    "0" => Ok(()),
                    other => Err(other.to_string()),
                }
            },
        )
        .await;
        holder.batch_execute("COMMIT").await.unwrap();
        // The next transaction takes the one server connection: a query
        // still queued would have run by now.
        let rows = holder
            .query_one("SELECT count(*) FROM left_waiting", &[])
            .await
            .unwrap();
        assert_eq!(
            rows.get::<_, i64>(0),
            0,
            "{how}: the query of a client that left ran"
        );
        let clients = console(&usher, "SHOW CLIENTS").await;
        let alices = clients.iter().filter(|c| get(c, "user") == Some("alice"));
        assert_eq!(
            alices.count(),
            1,
            "{how}: only the holder is left: {clients:?}"
        );
    }
    // A waiter that sends more while it waits is still there: served once
    // the server comes free, both queries answered.
    holder.batch_execute("BEGIN; SELECT 1").await.unwrap();
    let mut waiter = trust_login(usher.addr).await;
    waiter
        .write_all(&message(b'Q', b"SELECT 1\0"))
        .await
        .unwrap();
    wait_for_async(Duration::from_secs(10), "the waiter waits", || async {
        match waiting(&usher).await.as_str() {
            "1" => Ok(()),
            other => Err(other.to_string()),
        }
    })
    .await;
    waiter
        .write_all(&message(b'Q', b"SELECT 2\0"))
        .await
        .unwrap();
    holder.batch_execute("COMMIT").await.unwrap();
    let mut ready = 0;
    while ready < 2 {
        let (tag, _) = read_message(&mut waiter).await;
        assert_ne!(tag, b'E');
        ready += usize::from(tag == b'Z');
    }
    canary.check();
}

/// Backends of alice in `app` running the marked sleep, and all of alice's.
fn backends(pg: &PgCluster) -> (usize, usize) {
    let out = pg.psql_super(
        "SELECT count(*) FILTER (WHERE query LIKE '%held_servers_sleep%' AND state = 'active'), \
         count(*) FROM pg_stat_activity WHERE usename = 'alice' AND datname = 'app'",
    );
    let (sleeping, all) = out.split_once('|').unwrap();
    (sleeping.parse().unwrap(), all.parse().unwrap())
}

/// Clients that send a long query and disconnect do not leave it running:
/// pool_size bounds alice's backends, and the server connections come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_mid_query_has_its_query_cancelled() {
    // One of them counts all of alice's backends on the shared cluster.
    let _alone = common::one_at_a_time();
    let pg = own_cluster();
    for mode in ["transaction", "session"] {
        let usher = Usher::start(
            pg,
            &format!("auth:\n  method: trust\npool_mode: {mode}\npool_size: 2\n"),
        )
        .await;
        for round in 0..6 {
            let mut quitter = trust_login(usher.addr).await;
            quitter
                .write_all(&message(
                    b'Q',
                    b"SELECT pg_sleep(60) /* held_servers_sleep */\0",
                ))
                .await
                .unwrap();
            // The query runs on the server, then its client is gone.
            eventually_async(
                Duration::from_secs(10),
                &format!("{mode}: the sleep starts"),
                || async { backends(pg).0 > 0 },
            )
            .await;
            drop(quitter);
            let (sleeping, all) = backends(pg);
            assert!(
                all <= 2,
                "{mode}, round {round}: {all} backends of alice ({sleeping} still sleeping) through a pool of 2"
            );
        }
        eventually_async(
            Duration::from_secs(10),
            &format!("{mode}: abandoned queries end"),
            || async { backends(pg).0 == 0 },
        )
        .await;
        let bystander = usher.alice().await;
        bystander.simple_query("SELECT 1").await.unwrap();
    }
}

/// A new pool's first login learns the server's parameters from a server
/// connection: during an outage it waits for one, up to
/// query_wait_timeout. A client that left meanwhile was kept (and counted
/// in SHOW CLIENTS and toward max_client_conn) until then; now its socket
/// is watched while it waits, as a transaction's is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_login_that_waits_out_an_outage_ends_when_its_client_leaves() {
    let pg = own_cluster();
    // A database whose server is down: nothing listens on its port.
    let down_port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let yaml = common::usher_yaml(pg, "auth:\n  method: trust\nquery_wait_timeout: 120\n").replace(
        "databases:\n",
        &format!("databases:\n  down:\n    host: 127.0.0.1\n    port: {down_port}\n"),
    );
    let usher = Usher::start_yaml(&yaml).await;
    let canary = Canary::start(usher.addr.port());
    let downs = |clients: &[Row]| {
        clients
            .iter()
            .filter(|c| get(c, "database") == Some("down"))
            .count()
    };
    let mut client = tokio::net::TcpStream::connect(usher.addr).await.unwrap();
    client
        .write_all(&startup_packet(&[("user", "alice"), ("database", "down")]))
        .await
        .unwrap();
    wait_for_rows(&usher, "SHOW CLIENTS", |c| downs(c) == 1).await;
    drop(client);
    // Gone at once (before: after query_wait_timeout, 120 s).
    wait_for_rows(&usher, "SHOW CLIENTS", |c| downs(c) == 0).await;
    canary.check();
}
