//! The caps over many pools, against a real PostgreSQL, counting its
//! backends: `max_db_connections` and `max_user_connections` (server
//! connections of every pool of a database / user, with PgBouncer's
//! eviction of another pool's idle connection), `max_db_client_connections`
//! and `max_user_client_connections` (clients), and the reserve pool.
//!
//! A cluster of its own: the tests count every backend of alice and bob.

use crate::common::console::{console, get, row};
use crate::common::wait::eventually_async;
use crate::common::{sqlstate, PgCluster, Usher, ALICE_PASSWORD, BOB_PASSWORD};
use std::time::Duration;

fn cluster() -> &'static PgCluster {
    PgCluster::own(module_path!())
}

/// The tests count every backend of alice and bob: one at a time.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// usher in front of the module's cluster: databases `app` and `app2`
/// (both the server's `app`), transaction mode, with `extra` settings.
async fn usher(extra: &str) -> Usher {
    usher_with("", "", extra).await
}

/// The same, with `app_keys` added to the `app` entry and `alice_keys`
/// to alice's (`, key: value` each).
async fn usher_with(app_keys: &str, alice_keys: &str, extra: &str) -> Usher {
    let pg = cluster();
    Usher::start_yaml(&format!(
        "listen: 127.0.0.1:0\n\
         pool_mode: transaction\n\
         databases:\n  app: {{ host: 127.0.0.1, port: {port}{app_keys} }}\n  app2: {{ host: 127.0.0.1, port: {port}, dbname: app }}\n\
         users:\n  alice: {{ password: {ALICE_PASSWORD}{alice_keys} }}\n  bob: {{ password: {BOB_PASSWORD} }}\n  admin: {{ password: admin-pw }}\n\
         admin: {{ users: [admin] }}\n\
         hooks: {{ dir: tests/no-hooks }}\n{extra}",
        port = pg.port
    ))
    .await
}

async fn connect(
    usher: &Usher,
    user: &str,
    db: &str,
) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    let password = if user == "alice" {
        ALICE_PASSWORD
    } else {
        BOB_PASSWORD
    };
    let (c, driver) = tokio_postgres::connect(
        &usher.conn_str_db(user, password, db),
        tokio_postgres::NoTls,
    )
    .await?;
    tokio::spawn(driver);
    Ok(c)
}

/// The message of a server error.
fn message(e: &tokio_postgres::Error) -> String {
    e.as_db_error()
        .map(|d| d.message().to_string())
        .unwrap_or_default()
}

/// PostgreSQL backends of alice and bob (every one is usher's here).
fn backends(user_filter: &str) -> usize {
    cluster()
        .psql_super(&format!(
            "SELECT count(*) FROM pg_stat_activity WHERE usename {user_filter}"
        ))
        .trim()
        .parse()
        .unwrap()
}

/// A client inside a transaction: it holds its server connection.
async fn holding(usher: &Usher, user: &str, db: &str) -> tokio_postgres::Client {
    let c = connect(usher, user, db).await.unwrap();
    c.batch_execute("BEGIN; SELECT 1").await.unwrap();
    c
}

/// max_db_connections counts every pool of the database: with two of
/// alice's transactions open, bob's query waits; when alice commits, her
/// connection is idle in her pool and is closed to make room for bob's
/// (PgBouncer's eviction), and the backends never pass the cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_db_connections_caps_every_pool_of_a_database_and_evicts_idle_ones() {
    let _one = ONE_AT_A_TIME.lock().await;
    let usher = usher("max_db_connections: 2\npool_size: 5\n").await;
    // A pool's first login needs a server connection (to learn what the
    // server reports): bob's comes first.
    let bob = connect(&usher, "bob", "app").await.unwrap();
    let a1 = holding(&usher, "alice", "app").await;
    let a2 = holding(&usher, "alice", "app").await;
    assert_eq!(backends("IN ('alice', 'bob')"), 2);
    let query = tokio::spawn(async move {
        bob.query_one("SELECT 42", &[])
            .await
            .map(|r| r.get::<_, i32>(0))
    });
    // A fixed wait on purpose: bob's query must not run meanwhile.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(
        !query.is_finished(),
        "bob's query ran past max_db_connections"
    );
    assert_eq!(backends("IN ('alice', 'bob')"), 2);
    let dbs = console(&usher, "SHOW DATABASES").await;
    let app = row(&dbs, "name", "app");
    assert_eq!(get(app, "max_connections"), Some("2"));
    assert_eq!(get(app, "current_connections"), Some("2"));
    a1.batch_execute("COMMIT").await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(10), query)
        .await
        .expect("bob's query ran once alice's connection was idle")
        .unwrap()
        .unwrap();
    assert_eq!(got, 42);
    assert!(backends("IN ('alice', 'bob')") <= 2);
    drop(a2);
}

/// A client that cannot get a connection under the cap within
/// query_wait_timeout gets 53300 naming the cap; the other database is
/// not capped by this one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_waiting_past_query_wait_timeout_under_the_cap_gets_53300() {
    let _one = ONE_AT_A_TIME.lock().await;
    let usher = usher_with(", max_db_connections: 1", "", "query_wait_timeout: 1\n").await;
    // A pool's first login needs a server connection: bob's comes first.
    let bob = connect(&usher, "bob", "app").await.unwrap();
    let _a = holding(&usher, "alice", "app").await;
    let e = bob.batch_execute("SELECT 1").await.unwrap_err();
    assert_eq!(sqlstate(&e).as_deref(), Some("53300"), "{e:?}");
    let db = e.as_db_error().unwrap();
    assert!(
        db.detail()
            .unwrap_or_default()
            .contains("max_db_connections 1"),
        "{db:?}"
    );
    // app2 is another database of usher's: its own cap (none).
    let other = connect(&usher, "bob", "app2").await.unwrap();
    other.batch_execute("SELECT 1").await.unwrap();
}

/// max_user_connections counts a user's pools over every database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_user_connections_caps_a_user_over_every_database() {
    let _one = ONE_AT_A_TIME.lock().await;
    let usher = usher_with("", ", max_user_connections: 1", "").await;
    // A pool's first login needs a server connection: app2's comes first.
    let a2 = connect(&usher, "alice", "app2").await.unwrap();
    let a1 = holding(&usher, "alice", "app").await;
    let query = tokio::spawn(async move {
        a2.query_one("SELECT 7", &[])
            .await
            .map(|r| r.get::<_, i32>(0))
    });
    // bob is not capped by alice's cap.
    let bob = holding(&usher, "bob", "app").await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(
        !query.is_finished(),
        "alice's second server connection was opened"
    );
    assert_eq!(backends("= 'alice'"), 1);
    let users = console(&usher, "SHOW USERS").await;
    let alice = row(&users, "name", "alice");
    assert_eq!(get(alice, "max_user_connections"), Some("1"));
    assert_eq!(get(alice, "current_connections"), Some("1"));
    a1.batch_execute("COMMIT").await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(10), query)
        .await
        .expect("alice's query on app2 ran once her app connection was idle")
        .unwrap()
        .unwrap();
    assert_eq!(got, 7);
    assert_eq!(backends("= 'alice'"), 1);
    drop(bob);
}

/// max_db_client_connections and max_user_client_connections refuse the
/// next client with 53300, count in SHOW DATABASES / SHOW USERS, and give
/// the place back when a client leaves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_caps_refuse_the_next_client_and_free_the_place_when_one_leaves() {
    let _one = ONE_AT_A_TIME.lock().await;
    let usher = usher("max_db_client_connections: 2\nmax_user_client_connections: 1\n").await;
    let a = connect(&usher, "alice", "app").await.unwrap();
    let e = connect(&usher, "alice", "app").await.unwrap_err();
    assert_eq!(sqlstate(&e).as_deref(), Some("53300"), "{e:?}");
    assert!(
        message(&e).contains("max_user_client_connections is 1"),
        "{e:?}"
    );
    let b = connect(&usher, "bob", "app").await.unwrap();
    let dbs = console(&usher, "SHOW DATABASES").await;
    let app = row(&dbs, "name", "app");
    assert_eq!(get(app, "max_client_connections"), Some("2"));
    assert_eq!(get(app, "current_client_connections"), Some("2"));
    let users = console(&usher, "SHOW USERS").await;
    assert_eq!(
        get(row(&users, "name", "bob"), "current_client_connections"),
        Some("1")
    );
    drop(a);
    // alice's place comes back when her session ends.
    eventually_async(
        Duration::from_secs(10),
        "alice may log in again",
        || async { connect(&usher, "alice", "app").await.is_ok() },
    )
    .await;
    drop(b);
}

/// The database cap on clients, alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_db_client_connections_refuses_a_database_past_its_cap() {
    let _one = ONE_AT_A_TIME.lock().await;
    let usher = usher("max_db_client_connections: 1\n").await;
    let _a = connect(&usher, "alice", "app").await.unwrap();
    let e = connect(&usher, "bob", "app").await.unwrap_err();
    assert_eq!(sqlstate(&e).as_deref(), Some("53300"), "{e:?}");
    assert!(
        message(&e).contains("max_db_client_connections is 1"),
        "{e:?}"
    );
    connect(&usher, "bob", "app2")
        .await
        .expect("another database");
}

/// reserve_pool_size: a client that waited reserve_pool_timeout gets a
/// connection beyond pool_size; without a reserve it would wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_waited_reserve_pool_timeout_is_served_from_the_reserve() {
    let _one = ONE_AT_A_TIME.lock().await;
    let usher = usher(
        "pool_size: 1\nreserve_pool_size: 1\nreserve_pool_timeout: 0.3\nquery_wait_timeout: 30\n",
    )
    .await;
    let held = holding(&usher, "alice", "app").await;
    let second = connect(&usher, "alice", "app").await.unwrap();
    let started = std::time::Instant::now();
    let got: i32 = tokio::time::timeout(Duration::from_secs(10), second.query_one("SELECT 5", &[]))
        .await
        .expect("served from the reserve while the pool's one connection is held")
        .unwrap()
        .get(0);
    assert_eq!(got, 5);
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "the reserve served before reserve_pool_timeout"
    );
    assert_eq!(backends("= 'alice'"), 2);
    // The reserve is one connection: a third client waits.
    let third = connect(&usher, "alice", "app").await.unwrap();
    second.batch_execute("BEGIN").await.unwrap();
    let query = tokio::spawn(async move { third.batch_execute("SELECT 1").await });
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(!query.is_finished(), "a third connection was opened");
    assert_eq!(backends("= 'alice'"), 2);
    held.batch_execute("COMMIT").await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), query)
        .await
        .expect("served once a connection came back")
        .unwrap()
        .unwrap();
}

/// Without a reserve, the same client waits (the test above would fail
/// for the right reason).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_reserve_the_client_waits_for_the_pool() {
    let _one = ONE_AT_A_TIME.lock().await;
    let usher = usher("pool_size: 1\nquery_wait_timeout: 30\n").await;
    let held = holding(&usher, "alice", "app").await;
    let second = connect(&usher, "alice", "app").await.unwrap();
    let query = tokio::spawn(async move { second.batch_execute("SELECT 1").await });
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(!query.is_finished());
    assert_eq!(backends("= 'alice'"), 1);
    held.batch_execute("COMMIT").await.unwrap();
    query.await.unwrap().unwrap();
}

/// The caps are reloadable from the console (SET): a lower client cap
/// applies to the next login.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_cap_set_on_the_console_applies_to_the_next_login() {
    let _one = ONE_AT_A_TIME.lock().await;
    let usher = usher("").await;
    let _a = connect(&usher, "alice", "app").await.unwrap();
    console(&usher, "SET max_db_client_connections = 1").await;
    let e = connect(&usher, "bob", "app").await.unwrap_err();
    assert_eq!(sqlstate(&e).as_deref(), Some("53300"), "{e:?}");
}
