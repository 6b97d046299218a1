//! Any database, as on a direct connection: the fallback entry `"*"` of
//! `databases` lets a client reach any database the server has under its
//! own name, with a pool per (database, user) created on first use and
//! dropped after `autodb_idle_timeout` without clients; a listed database
//! keeps its own entry; a database the server does not have is the
//! server's own FATAL 3D000 and leaves no pool.

use crate::common;

use crate::common::console::{console, get, Row};
use crate::common::wait::{eventually_async, DEADLINE};
use crate::common::{sqlstate, PgCluster, Usher, ALICE_PASSWORD, BOB_PASSWORD};
use std::time::Duration;

/// A configuration with `app` listed and, when `fallback` is given, the
/// `"*"` entry with those keys (host and port are added).
fn yaml(pg: &PgCluster, fallback: Option<&str>, extra: &str) -> String {
    let port = pg.port;
    let star = match fallback {
        Some(keys) => format!("  \"*\": {{ host: 127.0.0.1, port: {port}{keys} }}\n"),
        None => String::new(),
    };
    format!(
        "listen: 127.0.0.1:0\n\
         hooks: {{ dir: tests/no-hooks }}\n\
         databases:\n  app: {{ host: 127.0.0.1, port: {port} }}\n{star}\
         users:\n  alice: {{ password: {ALICE_PASSWORD} }}\n  bob: {{ password: {BOB_PASSWORD} }}\n  admin: {{ password: admin-pw }}\n\
         admin: {{ users: [admin] }}\n{extra}"
    )
}

/// A database on the server, owned by alice, not listed in usher's config.
fn create_database(pg: &PgCluster, name: &str) {
    pg.psql_super(&format!("DROP DATABASE IF EXISTS {name}"));
    pg.psql_super(&format!("CREATE DATABASE {name} OWNER alice"));
}

async fn connect(
    usher: &Usher,
    database: &str,
) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    let (client, conn) = tokio_postgres::connect(
        &usher.conn_str_db("alice", ALICE_PASSWORD, database),
        tokio_postgres::NoTls,
    )
    .await?;
    tokio::spawn(conn);
    Ok(client)
}

async fn current_database(client: &tokio_postgres::Client) -> String {
    client
        .query_one("SELECT current_database()::text", &[])
        .await
        .unwrap()
        .get(0)
}

/// The SHOW POOLS rows of `database`.
async fn pools_of(usher: &Usher, database: &str) -> Vec<Row> {
    console(usher, "SHOW POOLS")
        .await
        .into_iter()
        .filter(|r| get(r, "database") == Some(database))
        .collect()
}

/// Backends of `database` on the server, as pg_stat_activity counts them.
fn backends(pg: &PgCluster, database: &str) -> u32 {
    pg.psql_super(&format!(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = '{database}'"
    ))
    .trim()
    .parse()
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unlisted_database_is_reached_through_the_fallback_entry() {
    let pg = PgCluster::shared();
    create_database(pg, "anydb_reach");
    let usher = Usher::start_yaml(&yaml(pg, Some(", pool_size: 3"), "")).await;
    let client = connect(&usher, "anydb_reach")
        .await
        .expect("a database the server has is reachable through \"*\"");
    assert_eq!(current_database(&client).await, "anydb_reach");

    // Its pool is there, with the "*" entry's settings, and SHOW DATABASES
    // lists the database.
    let pools = pools_of(&usher, "anydb_reach").await;
    assert_eq!(pools.len(), 1, "{pools:?}");
    assert_eq!(get(&pools[0], "user"), Some("alice"));
    let databases = console(&usher, "SHOW DATABASES").await;
    let row = databases
        .iter()
        .find(|r| get(r, "name") == Some("anydb_reach"))
        .unwrap_or_else(|| panic!("SHOW DATABASES lists the auto database: {databases:?}"));
    assert_eq!(get(row, "database"), Some("anydb_reach"));
    assert_eq!(get(row, "pool_size"), Some("3"));
    assert!(
        !databases.iter().any(|r| get(r, "name") == Some("*")),
        "the fallback entry is not a database: {databases:?}"
    );

    // Another user of the same database gets a pool of its own.
    let (bob, conn) = tokio_postgres::connect(
        &usher.conn_str_db("bob", BOB_PASSWORD, "anydb_reach"),
        tokio_postgres::NoTls,
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    assert_eq!(current_database(&bob).await, "anydb_reach");
    assert_eq!(pools_of(&usher, "anydb_reach").await.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listed_database_uses_its_own_entry() {
    let pg = PgCluster::shared();
    // `listed` is a name for the server's `app`: through "*" it would be
    // a database the server does not have.
    let port = pg.port;
    let config = yaml(pg, Some(", pool_mode: session"), "").replace(
        "databases:\n",
        &format!("databases:\n  listed: {{ host: 127.0.0.1, port: {port}, dbname: app }}\n"),
    );
    let usher = Usher::start_yaml(&config).await;
    let client = connect(&usher, "listed").await.expect("the listed entry");
    assert_eq!(current_database(&client).await, "app");
    let pools = pools_of(&usher, "listed").await;
    assert_eq!(
        get(&pools[0], "pool_mode"),
        Some("transaction"),
        "the listed entry's (global) pool mode, not the fallback's"
    );
    let auto = connect(&usher, "postgres").await.unwrap();
    assert_eq!(current_database(&auto).await, "postgres");
    let pools = pools_of(&usher, "postgres").await;
    assert_eq!(get(&pools[0], "pool_mode"), Some("session"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_database_gives_the_servers_3d000_and_leaves_no_pool() {
    let pg = PgCluster::shared();
    let usher = Usher::start_yaml(&yaml(pg, Some(""), "")).await;
    for _ in 0..2 {
        let e = connect(&usher, "anydb_not_there")
            .await
            .expect_err("a database the server does not have");
        assert_eq!(sqlstate(&e).as_deref(), Some("3D000"), "{e:?}");
        let db = e.as_db_error().unwrap();
        assert_eq!(db.severity(), "FATAL");
        assert_eq!(db.message(), "database \"anydb_not_there\" does not exist");
    }
    assert!(
        pools_of(&usher, "anydb_not_there").await.is_empty(),
        "no pool is left behind: {:?}",
        console(&usher, "SHOW POOLS").await
    );
    let databases = console(&usher, "SHOW DATABASES").await;
    assert!(
        !databases
            .iter()
            .any(|r| get(r, "name") == Some("anydb_not_there")),
        "{databases:?}"
    );
    // The console's names stay the console's.
    let e = connect(&usher, "pgbouncer")
        .await
        .expect_err("alice is no admin");
    assert_eq!(sqlstate(&e).as_deref(), Some("42501"), "{e:?}");
    let message = e.as_db_error().unwrap().message();
    assert!(message.contains("admin console"), "{message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_auto_database_pool_goes_away_after_autodb_idle_timeout() {
    let pg = PgCluster::shared();
    create_database(pg, "anydb_idle");
    let timeout = 0.3;
    let usher = Usher::start_yaml(&yaml(
        pg,
        Some(""),
        &format!("autodb_idle_timeout: {timeout}\n"),
    ))
    .await;
    let client = connect(&usher, "anydb_idle").await.unwrap();
    assert_eq!(current_database(&client).await, "anydb_idle");
    assert_eq!(backends(pg, "anydb_idle"), 1, "its idle server connection");

    // A connected client keeps the pool, even idle and holding no server
    // connection (transaction mode): time passing is the point here.
    tokio::time::sleep(Duration::from_secs_f64(timeout * 5.0)).await;
    assert_eq!(pools_of(&usher, "anydb_idle").await.len(), 1);
    assert_eq!(current_database(&client).await, "anydb_idle");

    // Once it leaves, the pool goes, its idle server connection with it.
    drop(client);
    eventually_async(DEADLINE, "the auto database's pool is dropped", || async {
        pools_of(&usher, "anydb_idle").await.is_empty()
    })
    .await;
    let databases = console(&usher, "SHOW DATABASES").await;
    assert!(
        !databases
            .iter()
            .any(|r| get(r, "name") == Some("anydb_idle")),
        "{databases:?}"
    );
    common::wait::eventually(DEADLINE, "its server connection is closed", || {
        backends(pg, "anydb_idle") == 0
    });
    let stats = console(&usher, "SHOW STATS").await;
    assert!(
        !stats
            .iter()
            .any(|r| get(r, "database") == Some("anydb_idle")),
        "its stats went with it: {stats:?}"
    );

    // A new client creates it again.
    let client = connect(&usher, "anydb_idle").await.unwrap();
    assert_eq!(current_database(&client).await, "anydb_idle");
    assert_eq!(pools_of(&usher, "anydb_idle").await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_fallback_an_unlisted_database_is_3d000_as_before() {
    let pg = PgCluster::shared();
    create_database(pg, "anydb_unlisted");
    let usher = Usher::start_yaml(&yaml(pg, None, "")).await;
    let e = connect(&usher, "anydb_unlisted")
        .await
        .expect_err("an unlisted database is refused without \"*\"");
    assert_eq!(sqlstate(&e).as_deref(), Some("3D000"), "{e:?}");
    assert_eq!(backends(pg, "anydb_unlisted"), 0, "usher asked no server");
    assert!(pools_of(&usher, "anydb_unlisted").await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_applies_to_the_auto_databases_already_there() {
    let pg = PgCluster::shared();
    create_database(pg, "anydb_reload_auto");
    create_database(pg, "anydb_reload_listed");
    let usher = Usher::start_yaml(&yaml(pg, Some(""), "autodb_idle_timeout: 3600\n")).await;
    for db in ["anydb_reload_auto", "anydb_reload_listed"] {
        let client = connect(&usher, db).await.unwrap();
        assert_eq!(current_database(&client).await, db);
    }
    // Both unused now. The reload shortens autodb_idle_timeout and lists
    // one of the two: that one is a listed database from now on and stays.
    let port = pg.port;
    usher.rewrite_config(
        &yaml(
            pg,
            Some(", pool_mode: session"),
            "autodb_idle_timeout: 0.2\n",
        )
        .replace(
            "databases:\n",
            &format!("databases:\n  anydb_reload_listed: {{ host: 127.0.0.1, port: {port} }}\n"),
        ),
    );
    console(&usher, "RELOAD").await;
    eventually_async(
        DEADLINE,
        "the unused auto database's pool is dropped",
        || async { pools_of(&usher, "anydb_reload_auto").await.is_empty() },
    )
    .await;
    let pools = pools_of(&usher, "anydb_reload_listed").await;
    assert_eq!(pools.len(), 1, "the newly listed database keeps its pool");
    // The fallback entry's new settings reach new auto databases.
    let client = connect(&usher, "anydb_reload_auto").await.unwrap();
    assert_eq!(current_database(&client).await, "anydb_reload_auto");
    let pools = pools_of(&usher, "anydb_reload_auto").await;
    assert_eq!(get(&pools[0], "pool_mode"), Some("session"));
    // Time passing is the point: a listed database's pool is never dropped
    // for being unused (several autodb_idle_timeouts here).
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(pools_of(&usher, "anydb_reload_listed").await.len(), 1);
}
