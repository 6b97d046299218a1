//! Limits and timeouts, each through usher against a real PostgreSQL.

use crate::common;

use crate::common::wait::{eventually_async, process_gone, DEADLINE};
use crate::common::{sqlstate, PgCluster, Usher};
use std::time::{Duration, Instant};

/// Server connections the `user` has open to database app.
fn server_conns(pg: &PgCluster, user: &str) -> i64 {
    pg.psql_super(&format!(
        "SELECT count(*) FROM pg_stat_activity WHERE usename = '{user}' AND datname = 'app'"
    ))
    .parse()
    .unwrap()
}

/// Waits for the connection driver of a client to end, returning its error.
async fn closed_with(
    driver: tokio::task::JoinHandle<Result<(), tokio_postgres::Error>>,
) -> tokio_postgres::Error {
    tokio::time::timeout(Duration::from_secs(10), driver)
        .await
        .expect("usher closes the client")
        .unwrap()
        .expect_err("closed with an error")
}

async fn connect(
    usher: &Usher,
    user: &str,
    password: &str,
) -> (
    tokio_postgres::Client,
    tokio::task::JoinHandle<Result<(), tokio_postgres::Error>>,
) {
    let (c, conn) = tokio_postgres::connect(&usher.conn_str(user, password), tokio_postgres::NoTls)
        .await
        .unwrap();
    (c, tokio::spawn(conn))
}

// Each test below that counts server connections uses its own cluster, so
// other tests' connections do not disturb the counts.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_pool_size_opens_connections_ahead_of_demand() {
    let pg = PgCluster::start();
    let usher = Usher::start(&pg, "pool_size: 5\nmin_pool_size: 3\n").await;
    let c = usher.alice().await;
    c.query_one("SELECT 1", &[]).await.unwrap();
    // One client ran one query, yet min_pool_size connections are open (a
    // fill racing that query may open one more, never more than pool_size).
    eventually_async(
        Duration::from_secs(20),
        "at least 3 connections open while one client ran one query",
        || async { (3..=5).contains(&server_conns(&pg, "alice")) },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_idle_timeout_closes_unused_connections() {
    let pg = PgCluster::start();
    let usher = Usher::start(&pg, "pool_mode: transaction\nserver_idle_timeout: 0.5\n").await;
    let c = usher.alice().await;
    c.query_one("SELECT 1", &[]).await.unwrap();
    assert_eq!(server_conns(&pg, "alice"), 1);
    eventually_async(
        Duration::from_secs(10),
        "the idle server connection is closed",
        || async { server_conns(&pg, "alice") == 0 },
    )
    .await;
    // The client is still there and gets a new server connection.
    c.query_one("SELECT 1", &[]).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_lifetime_replaces_old_connections() {
    let pg = PgCluster::shared();
    let usher = Usher::start(
        pg,
        "pool_mode: transaction\npool_size: 1\nserver_lifetime: 0.5\n",
    )
    .await;
    let c = usher.alice().await;
    let first: i32 = c
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    // A fixed wait on purpose: the connection must outlive server_lifetime.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let second: i32 = c
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    assert_ne!(
        first, second,
        "a connection older than server_lifetime is not reused"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_connect_timeout_bounds_a_server_that_never_answers() {
    // A "server" that accepts TCP connections and says nothing.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = silent.local_addr().unwrap().port();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = silent.accept().await {
            held.push(s);
        }
    });
    // The login waits for the server up to query_wait_timeout, then gets
    // the last attempt's error.
    let yaml = format!(
        "listen: 127.0.0.1:0\nauth: {{ method: trust }}\nserver_connect_timeout: 0.5\nquery_wait_timeout: 1\ndatabases:\n  app: {{ port: {port} }}\nusers:\n  alice: {{ password: x }}\n"
    );
    let usher = Usher::start_yaml(&yaml).await;
    let started = Instant::now();
    let e = usher
        .connect_as("alice", "x")
        .await
        .expect_err("login fails");
    assert_eq!(sqlstate(&e).as_deref(), Some("08006"), "{e:?}");
    assert!(
        e.as_db_error().unwrap().message().contains("within 0.5s"),
        "{e:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_idle_timeout_disconnects_idle_clients() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "client_idle_timeout: 0.5\n").await;
    let (c, driver) = connect(&usher, "alice", common::ALICE_PASSWORD).await;
    c.query_one("SELECT 1", &[]).await.unwrap();
    let e = closed_with(driver).await;
    assert_eq!(sqlstate(&e).as_deref(), Some("57P05"), "{e:?}");
    // A busy client is not idle: a query longer than the timeout is fine.
    let (c, _driver) = connect(&usher, "alice", common::ALICE_PASSWORD).await;
    c.query_one("SELECT pg_sleep(1)::text", &[]).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_transaction_timeout_ends_the_client_and_frees_the_server() {
    let pg = PgCluster::shared();
    let usher = Usher::start(
        pg,
        "pool_mode: transaction\npool_size: 1\nidle_transaction_timeout: 0.5\n",
    )
    .await;
    let (c, driver) = connect(&usher, "alice", common::ALICE_PASSWORD).await;
    c.batch_execute("BEGIN; SELECT pg_advisory_xact_lock(77)")
        .await
        .unwrap();
    let e = closed_with(driver).await;
    assert_eq!(sqlstate(&e).as_deref(), Some("25P03"), "{e:?}");
    // The pool's only server connection is usable again, and clean.
    let other = usher.alice().await;
    let locks: i64 = other
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(locks, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_connection_killed_while_idle_is_replaced() {
    let pg = PgCluster::shared();
    for check_delay in ["0", "30"] {
        let usher = Usher::start(
            pg,
            &format!("pool_mode: transaction\npool_size: 1\nserver_check_delay: {check_delay}\n"),
        )
        .await;
        let c = usher.alice().await;
        let pid: i32 = c
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(
            pg.psql_super(&format!("SELECT pg_terminate_backend({pid})")),
            "t"
        );
        // The backend has exited (its socket is closed).
        eventually_async(DEADLINE, "the terminated backend exits", || async {
            process_gone(pid)
        })
        .await;
        // The dead connection leaves the pool; the client never notices.
        let new_pid: i32 = c
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .unwrap()
            .get(0);
        assert_ne!(pid, new_pid, "check delay {check_delay}");
    }
}
