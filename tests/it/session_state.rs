//! A session's settings through usher are what they would be on a direct
//! connection, and stay the client's own: a client's SET (of any
//! parameter, reported by the server or not), SET ROLE and set_config()
//! follow it from server connection to server connection in transaction
//! mode and never reach another client; RESET returns to the client's
//! startup value; a rolled-back SET is undone (PostgreSQL directly is the
//! reference). Every test runs with pool_size 1, so the clients share one
//! server connection and take turns on it.

use crate::common;

use crate::common::{alice_with, PgCluster, Usher};
use tokio_postgres::SimpleQueryMessage;

/// The single value a query returns (empty for NULL).
async fn value(c: &tokio_postgres::Client, sql: &str) -> String {
    let rows = c
        .simple_query(sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e:?}"));
    rows.iter()
        .find_map(|m| match m {
            SimpleQueryMessage::Row(r) => Some(r.get(0).unwrap_or_default().to_string()),
            _ => None,
        })
        .unwrap_or_else(|| panic!("{sql}: no row"))
}

async fn run(c: &tokio_postgres::Client, sql: &str) {
    c.simple_query(sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e:?}"));
}

async fn usher(pg: &PgCluster, mode: &str) -> Usher {
    Usher::start(pg, &format!("pool_mode: {mode}\npool_size: 1\n")).await
}

/// Session mode: a client's startup value reaches its server connection
/// even when the previous client of that connection had the same value
/// (the reset between them removed it from the server).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_startup_value_survives_the_previous_clients_reset() {
    let pg = PgCluster::shared();
    let usher = usher(pg, "session").await;
    let port = usher.addr.port();
    for round in 0..3 {
        let c = alice_with(port, "options='-c work_mem=8MB'").await;
        assert_eq!(value(&c, "SHOW work_mem").await, "8MB", "client {round}");
        drop(c);
        common::wait::eventually_async(common::wait::DEADLINE, "the client leaves", || async {
            usher.app.deps.clients.connected() == 0
        })
        .await;
    }
}

/// Transaction mode: a SET of a parameter the server does not report
/// stays with its client and never reaches the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_stays_with_its_client() {
    let pg = PgCluster::shared();
    let usher = usher(pg, "transaction").await;
    let port = usher.addr.port();
    let a = alice_with(port, "").await;
    let b = alice_with(port, "").await;
    let default = value(&b, "SHOW statement_timeout").await;
    run(&a, "SET statement_timeout = '42s'").await;
    run(&a, "SET myapp.tenant = 'tenant-a'").await;
    assert_eq!(value(&b, "SHOW statement_timeout").await, default);
    assert_eq!(
        value(&b, "SELECT current_setting('myapp.tenant', true)").await,
        ""
    );
    assert_eq!(value(&a, "SHOW statement_timeout").await, "42s");
    assert_eq!(value(&a, "SHOW myapp.tenant").await, "tenant-a");
    // A client's own later SET wins, and b still sees nothing of it.
    run(&b, "SET statement_timeout = '7s'").await;
    run(&a, "SET statement_timeout TO DEFAULT").await;
    assert_eq!(value(&a, "SHOW statement_timeout").await, default);
    assert_eq!(value(&b, "SHOW statement_timeout").await, "7s");
}

/// set_config(..., false) is a SET by another name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_config_stays_with_its_client() {
    let pg = PgCluster::shared();
    let usher = usher(pg, "transaction").await;
    let port = usher.addr.port();
    let a = alice_with(port, "").await;
    let b = alice_with(port, "").await;
    run(&a, "SELECT set_config('myapp.tenant', 'tenant-a', false)").await;
    assert_eq!(
        value(&b, "SELECT current_setting('myapp.tenant', true)").await,
        ""
    );
    assert_eq!(value(&a, "SHOW myapp.tenant").await, "tenant-a");
}

/// SET ROLE: the client keeps its role, the next client of the server
/// connection is itself (and is not killed by a replayed is_superuser).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_role_stays_with_its_client() {
    let pg = PgCluster::shared();
    pg.ensure_role("state_reader", "");
    pg.psql_super("GRANT state_reader TO alice");
    let usher = usher(pg, "transaction").await;
    let port = usher.addr.port();
    let a = alice_with(port, "").await;
    let b = alice_with(port, "").await;
    run(&a, "SET ROLE state_reader").await;
    assert_eq!(value(&b, "SELECT current_user").await, "alice");
    assert_eq!(value(&a, "SELECT current_user").await, "state_reader");
    assert_eq!(value(&b, "SELECT current_user").await, "alice");
    run(&a, "RESET ROLE").await;
    assert_eq!(value(&a, "SELECT current_user").await, "alice");
}

/// RESET returns to the client's startup value, as on a direct connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_returns_to_the_startup_value() {
    let pg = PgCluster::shared();
    let options = "options='-c DateStyle=Postgres,MDY -c work_mem=8MB'";
    let direct = alice_with(pg.port, options).await;
    let script = [
        "SET datestyle TO iso",
        "SET work_mem = '16MB'",
        "RESET datestyle",
        "RESET work_mem",
    ];
    for sql in script {
        run(&direct, sql).await;
    }
    let want_datestyle = value(&direct, "SHOW datestyle").await;
    let want_work_mem = value(&direct, "SHOW work_mem").await;
    assert_eq!(want_work_mem, "8MB");
    for mode in ["session", "transaction"] {
        let usher = usher(pg, mode).await;
        let c = alice_with(usher.addr.port(), options).await;
        for sql in script {
            run(&c, sql).await;
        }
        assert_eq!(value(&c, "SHOW datestyle").await, want_datestyle, "{mode}");
        assert_eq!(value(&c, "SHOW work_mem").await, want_work_mem, "{mode}");
        run(&c, "SET work_mem = '16MB'").await;
        run(&c, "RESET ALL").await;
        assert_eq!(value(&c, "SHOW work_mem").await, want_work_mem, "{mode}");
    }
}

/// A SET inside a transaction block that rolls back is undone, and stays
/// undone on the client's next server connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolled_back_set_is_undone() {
    let pg = PgCluster::shared();
    let usher = usher(pg, "transaction").await;
    let port = usher.addr.port();
    let a = alice_with(port, "").await;
    let b = alice_with(port, "").await;
    let default = value(&a, "SHOW statement_timeout").await;
    run(&a, "BEGIN; SET statement_timeout = '3s'; ROLLBACK").await;
    run(&b, "SELECT 1").await;
    assert_eq!(value(&a, "SHOW statement_timeout").await, default);
    run(&a, "BEGIN; SET statement_timeout = '4s'; COMMIT").await;
    run(&b, "SELECT 1").await;
    assert_eq!(value(&a, "SHOW statement_timeout").await, "4s");
    assert_eq!(value(&b, "SHOW statement_timeout").await, default);
}
