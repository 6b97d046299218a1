//! A server reached through its Unix-domain socket: `host` names the
//! socket directory (libpq's and PgBouncer's `host=/var/run/postgresql`).
//! Queries, reuse of a pooled connection, replacing one the server closed,
//! and cancel requests all go through the socket; the server sees no TCP
//! peer (`inet_server_addr()` is NULL, as on any local-socket session).

use crate::common::console::{console, get};
use crate::common::{backend_pid, sqlstate, PgCluster, Usher, ALICE_PASSWORD, BOB_PASSWORD};
use std::time::{Duration, Instant};

/// usher in front of the shared cluster's socket (the test cluster trusts
/// local connections, so the server asks usher for no password).
async fn usher_on_socket(pg: &PgCluster, mode: &str) -> Usher {
    let yaml = format!(
        "listen: 127.0.0.1:0\n\
         pool_mode: {mode}\n\
         pool_size: 2\n\
         hooks: {{ dir: tests/no-hooks }}\n\
         databases:\n  app: {{ host: {}, port: {} }}\n\
         users:\n  alice: {{ password: {ALICE_PASSWORD} }}\n  bob: {{ password: {BOB_PASSWORD} }}\n  admin: {{ password: admin-pw }}\n\
         admin: {{ users: [admin] }}\n",
        pg.dir.display(),
        pg.port
    );
    Usher::start_yaml(&yaml).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queries_reach_the_server_through_its_socket() {
    let pg = PgCluster::shared();
    for mode in ["session", "transaction"] {
        let usher = usher_on_socket(pg, mode).await;
        let alice = usher.alice().await;
        let row = alice
            .query_one(
                "SELECT inet_server_addr() IS NULL, current_user::text, current_database()::text",
                &[],
            )
            .await
            .unwrap();
        assert!(row.get::<_, bool>(0), "{mode}: the server saw a TCP peer");
        assert_eq!(row.get::<_, String>(1), "alice", "{mode}");
        assert_eq!(row.get::<_, String>(2), "app", "{mode}");
        if mode == "session" {
            // As PgBouncer shows a socket: "unix" and the port.
            let servers = console(&usher, "SHOW SERVERS").await;
            let server = servers.first().expect("alice's server connection");
            let port = pg.port.to_string();
            assert_eq!(get(server, "addr"), Some("unix"));
            assert_eq!(get(server, "port"), Some(port.as_str()));
            assert_eq!(get(server, "local_addr"), Some("unix"));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooled_socket_connection_is_reused_until_the_server_closes_it() {
    let pg = PgCluster::shared();
    let usher = usher_on_socket(pg, "transaction").await;
    let alice = usher.alice().await;
    let first = backend_pid(&alice).await;
    // Quiet between transactions: the same connection serves the next one
    // (the check that it is still open must not mistake it for closed).
    for _ in 0..3 {
        assert_eq!(backend_pid(&alice).await, first);
    }
    // The server ends it while it is idle in the pool: the next
    // transaction gets a new one, and the client sees no error.
    pg.psql_super(&format!("SELECT pg_terminate_backend({first})"));
    let gone = format!("SELECT count(*) FROM pg_stat_activity WHERE pid = {first}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while pg.psql_super(&gone).trim() != "0" && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // (Its entry goes a moment before the process and its socket.)
    tokio::time::sleep(Duration::from_millis(200)).await;
    let second = backend_pid(&alice).await;
    assert_ne!(second, first);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_reaches_the_server_through_its_socket() {
    let pg = PgCluster::shared();
    for mode in ["session", "transaction"] {
        let usher = usher_on_socket(pg, mode).await;
        let sleeper = usher.alice().await;
        let token = sleeper.cancel_token();
        let started = Instant::now();
        let canceller = tokio::spawn(async move {
            PgCluster::shared()
                .wait_until_active("SELECT pg_sleep(31)")
                .await;
            token.cancel_query(tokio_postgres::NoTls).await.unwrap();
        });
        let e = sleeper
            .simple_query("SELECT pg_sleep(31)")
            .await
            .unwrap_err();
        assert_eq!(sqlstate(&e).as_deref(), Some("57014"), "{mode}: {e:?}");
        assert!(started.elapsed() < Duration::from_secs(15), "{mode}");
        canceller.await.unwrap();
        assert_eq!(
            sleeper
                .query_one("SELECT 7", &[])
                .await
                .unwrap()
                .get::<_, i32>(0),
            7
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_socket_directory_without_a_server_is_a_clear_error() {
    let pg = PgCluster::shared();
    let empty = tempfile::tempdir().unwrap();
    let yaml = format!(
        "listen: 127.0.0.1:0\n\
         hooks: {{ dir: tests/no-hooks }}\n\
         query_wait_timeout: 1\n\
         databases:\n  app: {{ host: {}, port: {} }}\n\
         users:\n  alice: {{ password: {ALICE_PASSWORD} }}\n",
        empty.path().display(),
        pg.port
    );
    let usher = Usher::start_yaml(&yaml).await;
    // The first login of a pool asks the server for its parameters; it
    // waits for the server (query_wait_timeout), then gets the last error.
    let Err(e) = usher.connect_as("alice", ALICE_PASSWORD).await else {
        panic!("alice logged in with no server behind the socket");
    };
    let db = e.as_db_error().expect("an ErrorResponse");
    assert_eq!(db.code().code(), "08006", "{e:?}");
    let socket = format!("{}/.s.PGSQL.{}", empty.path().display(), pg.port);
    assert!(
        db.message().contains(&socket),
        "the message names the socket: {}",
        db.message()
    );
}
