//! DROP DATABASE, ALTER DATABASE ... RENAME and CREATE DATABASE ...
//! TEMPLATE through usher while usher keeps idle server connections to
//! that database: a client used it and left, its server connection stays
//! in the pool. PostgreSQL refuses these statements while any other
//! backend is connected to the database (55006 after a five-second wait);
//! usher closes its own idle connections to it before the statement goes
//! out, so they succeed as on a direct connection. A connection in use is
//! left alone, and the client gets PostgreSQL's 55006 as directly.

use crate::common::console::{console, get, Row};
use crate::common::wait::{wait_for_async, DEADLINE};
use crate::common::{sqlstate, PgCluster, Usher, ALICE_PASSWORD, BOB_PASSWORD};

/// usher in `mode` with `app`, the fallback entry `"*"` (any database
/// under its own name) and `alias`, a client-facing name for the server
/// database `drop_alias_<mode>`.
async fn usher(pg: &PgCluster, mode: &str) -> Usher {
    let port = pg.port;
    Usher::start_yaml(&format!(
        "listen: 127.0.0.1:0\n\
         hooks: {{ dir: tests/no-hooks }}\n\
         pool_mode: {mode}\n\
         databases:\n  app: {{ host: 127.0.0.1, port: {port} }}\n  \
         \"*\": {{ host: 127.0.0.1, port: {port} }}\n  \
         alias: {{ host: 127.0.0.1, port: {port}, dbname: drop_alias_{mode} }}\n\
         users:\n  alice: {{ password: {ALICE_PASSWORD} }}\n  bob: {{ password: {BOB_PASSWORD} }}\n  admin: {{ password: admin-pw }}\n\
         admin: {{ users: [admin] }}\n"
    ))
    .await
}

/// A fresh database on the server, owned by alice (who may create
/// databases: the statements under test are hers).
fn create_database(pg: &PgCluster, name: &str) {
    // Once: two tests altering the role at the same moment fail with
    // "tuple concurrently updated".
    static CREATEDB: std::sync::Once = std::sync::Once::new();
    CREATEDB.call_once(|| {
        pg.psql_super("ALTER ROLE alice CREATEDB");
    });
    pg.psql_super(&format!("DROP DATABASE IF EXISTS {name}"));
    pg.psql_super(&format!("CREATE DATABASE {name} OWNER alice"));
}

fn database_exists(pg: &PgCluster, name: &str) -> bool {
    pg.psql_super(&format!(
        "SELECT count(*) FROM pg_database WHERE datname = '{name}'"
    )) == "1"
}

/// Backends connected to `database`, as pg_stat_activity counts them.
fn backends(pg: &PgCluster, database: &str) -> u32 {
    pg.psql_super(&format!(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = '{database}'"
    ))
    .parse()
    .unwrap()
}

async fn connect(usher: &Usher, database: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(
        &usher.conn_str_db("alice", ALICE_PASSWORD, database),
        tokio_postgres::NoTls,
    )
    .await
    .unwrap_or_else(|e| panic!("alice connects to {database}: {e:?}"));
    tokio::spawn(conn);
    client
}

/// The SHOW POOLS row of alice's pool of `database`.
async fn pool_of(usher: &Usher, database: &str) -> Option<Row> {
    console(usher, "SHOW POOLS")
        .await
        .into_iter()
        .find(|r| get(r, "database") == Some(database) && get(r, "user") == Some("alice"))
}

/// A client uses `database` (the client-facing name) through usher and
/// leaves; usher keeps its server connection to `server_db` idle, and
/// PostgreSQL sees it connected.
async fn leave_an_idle_connection(usher: &Usher, pg: &PgCluster, database: &str, server_db: &str) {
    let client = connect(usher, database).await;
    client.simple_query("SELECT 1").await.unwrap();
    drop(client);
    wait_for_async(
        DEADLINE,
        &format!("an idle server connection to {database}"),
        || async {
            match pool_of(usher, database).await {
                Some(r) if get(&r, "sv_idle") == Some("1") && get(&r, "sv_active") == Some("0") => {
                    Ok(())
                }
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    assert_eq!(
        backends(pg, server_db),
        1,
        "usher holds a backend on {server_db}"
    );
}

/// How the statement is sent.
#[derive(Clone, Copy, Debug)]
enum Protocol {
    /// A simple Query.
    Simple,
    /// Parse, then Bind and Execute (tokio-postgres' `execute`).
    Extended,
}

/// alice, connected to `app` through usher, runs `sql`.
async fn run(usher: &Usher, sql: &str, protocol: Protocol) -> Result<(), tokio_postgres::Error> {
    let client = connect(usher, "app").await;
    match protocol {
        Protocol::Simple => client.batch_execute(sql).await,
        Protocol::Extended => client.execute(sql, &[]).await.map(drop),
    }
}

async fn drop_rename_and_template(mode: &str) {
    let pg = PgCluster::shared();
    let usher = usher(pg, mode).await;
    for protocol in [Protocol::Simple, Protocol::Extended] {
        let p = format!("{protocol:?}").to_lowercase();

        let x = format!("drop_{mode}_{p}");
        create_database(pg, &x);
        leave_an_idle_connection(&usher, pg, &x, &x).await;
        run(&usher, &format!("DROP DATABASE {x}"), protocol)
            .await
            .unwrap_or_else(|e| panic!("{mode}, {protocol:?}: DROP DATABASE {x}: {e:?}"));
        assert!(!database_exists(pg, &x));

        let x = format!("rename_{mode}_{p}");
        let y = format!("renamed_{mode}_{p}");
        create_database(pg, &x);
        pg.psql_super(&format!("DROP DATABASE IF EXISTS {y}"));
        leave_an_idle_connection(&usher, pg, &x, &x).await;
        run(
            &usher,
            &format!("ALTER DATABASE {x} RENAME TO {y}"),
            protocol,
        )
        .await
        .unwrap_or_else(|e| panic!("{mode}, {protocol:?}: ALTER DATABASE {x} RENAME: {e:?}"));
        assert!(database_exists(pg, &y) && !database_exists(pg, &x));
        pg.psql_super(&format!("DROP DATABASE {y}"));

        let x = format!("template_{mode}_{p}");
        let z = format!("copy_{mode}_{p}");
        create_database(pg, &x);
        pg.psql_super(&format!("DROP DATABASE IF EXISTS {z}"));
        leave_an_idle_connection(&usher, pg, &x, &x).await;
        run(
            &usher,
            &format!("CREATE DATABASE {z} TEMPLATE {x}"),
            protocol,
        )
        .await
        .unwrap_or_else(|e| panic!("{mode}, {protocol:?}: CREATE DATABASE TEMPLATE {x}: {e:?}"));
        assert!(database_exists(pg, &z));
        pg.psql_super(&format!("DROP DATABASE {z}"));
        pg.psql_super(&format!("DROP DATABASE {x}"));
    }

    // A `databases` entry whose server database has another name: the
    // statement names the server's.
    let server_db = format!("drop_alias_{mode}");
    create_database(pg, &server_db);
    leave_an_idle_connection(&usher, pg, "alias", &server_db).await;
    run(
        &usher,
        &format!("DROP DATABASE \"{server_db}\""),
        Protocol::Simple,
    )
    .await
    .unwrap_or_else(|e| panic!("{mode}: DROP DATABASE {server_db} (alias): {e:?}"));
    assert!(!database_exists(pg, &server_db));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_do_not_stop_drop_rename_or_template_in_transaction_mode() {
    drop_rename_and_template("transaction").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_do_not_stop_drop_rename_or_template_in_session_mode() {
    drop_rename_and_template("session").await;
}

/// A client inside a transaction on the database holds its server
/// connection: usher leaves it alone, and DROP DATABASE fails as it does
/// directly (55006, after PostgreSQL's wait); the client's transaction
/// goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_in_use_still_makes_drop_database_fail() {
    let pg = PgCluster::shared();
    let usher = usher(pg, "transaction").await;
    let x = "drop_in_use";
    create_database(pg, x);
    let user = connect(&usher, x).await;
    user.batch_execute("BEGIN; CREATE TABLE t (v int)")
        .await
        .unwrap();

    let e = run(&usher, &format!("DROP DATABASE {x}"), Protocol::Simple)
        .await
        .expect_err("DROP DATABASE of a database in use");
    assert_eq!(sqlstate(&e).as_deref(), Some("55006"), "{e:?}");
    let message = e.as_db_error().unwrap().message().to_string();
    assert_eq!(
        message,
        format!("database \"{x}\" is being accessed by other users")
    );

    user.batch_execute("INSERT INTO t VALUES (1); COMMIT")
        .await
        .unwrap();
    let row = user.query_one("SELECT count(*) FROM t", &[]).await.unwrap();
    assert_eq!(row.get::<_, i64>(0), 1);
    drop(user);
    pg.psql_super(&format!("DROP DATABASE {x} WITH (FORCE)"));
}
