//! Changing a running usher from the admin console: PAUSE/RESUME, KILL,
//! KILL_CLIENT, RECONNECT, SHOW CLIENTS/SERVERS, RELOAD of the
//! configuration file (a changed pool size applies, a broken file is kept
//! out) and SET of one key (until the next RELOAD).

use crate::common;

use crate::common::console::{
    console, console_messages, console_table, get, row, wait_for_rows, Row,
};
use crate::common::{backend_pid, sqlstate, usher_yaml, PgCluster, Usher, BOB_PASSWORD};
use std::time::Duration;
use tokio_postgres::SimpleQueryMessage;

/// The clients of database `app` in SHOW CLIENTS.
fn app_clients(rows: &[Row]) -> Vec<&Row> {
    rows.iter()
        .filter(|r| get(r, "database") == Some("app"))
        .collect()
}

fn waiting_in_pool(rows: &[Row]) -> usize {
    get(row(rows, "database", "app"), "cl_waiting")
        .unwrap()
        .parse()
        .unwrap()
}

/// A query that has not finished after a while is still waiting (not a
/// timing target: the query itself takes microseconds once it may run).
/// A fixed wait on purpose: nothing may happen during it.
async fn still_pending<T>(task: &tokio::task::JoinHandle<T>) -> bool {
    tokio::time::sleep(Duration::from_millis(300)).await;
    !task.is_finished()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_waits_for_transactions_holds_clients_and_resume_releases_them() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "pool_mode: transaction\npool_size: 2\n").await;
    let busy = usher.alice().await;
    let waiter = usher.alice().await;
    busy.batch_execute("BEGIN; SELECT 1").await.unwrap();

    // PAUSE returns only once the open transaction has given its server back.
    let port = usher.addr.port();
    let pause = tokio::spawn(async move { console_messages(port, "PAUSE app").await });
    assert!(
        still_pending(&pause).await,
        "PAUSE returned during a transaction"
    );
    busy.batch_execute("COMMIT").await.unwrap();
    pause.await.unwrap().expect("PAUSE succeeds");

    let (_, dbs) = console_table(&usher, "SHOW DATABASES").await;
    assert_eq!(dbs[0][15], "1", "SHOW DATABASES says paused: {dbs:?}");
    // Paused: the next query waits, and the console shows the client waiting.
    let query = tokio::spawn(async move {
        let n: i32 = waiter.query_one("SELECT 41 + 1", &[]).await?.get(0);
        Ok::<_, tokio_postgres::Error>(n)
    });
    wait_for_rows(&usher, "SHOW POOLS", |rows| waiting_in_pool(rows) == 1).await;
    let clients = console(&usher, "SHOW CLIENTS").await;
    assert!(
        app_clients(&clients)
            .iter()
            .any(|c| get(c, "state") == Some("waiting")),
        "{clients:#?}"
    );
    assert!(still_pending(&query).await, "a query ran while paused");
    let pools = console(&usher, "SHOW POOLS").await;
    let pool = row(&pools, "database", "app");
    let waited_us: u64 = get(pool, "maxwait").unwrap().parse::<u64>().unwrap() * 1_000_000
        + get(pool, "maxwait_us").unwrap().parse::<u64>().unwrap();
    assert!(waited_us >= 300_000, "maxwait shows the wait: {pool:?}");

    console(&usher, "RESUME app").await;
    assert_eq!(query.await.unwrap().unwrap(), 42);
    wait_for_rows(&usher, "SHOW POOLS", |rows| waiting_in_pool(rows) == 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_client_ends_that_client_only() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "pool_mode: transaction\n").await;
    let (victim, victim_driver) = tokio_postgres::connect(
        &format!(
            "{} application_name=victim",
            usher.conn_str("alice", common::ALICE_PASSWORD)
        ),
        tokio_postgres::NoTls,
    )
    .await
    .unwrap();
    let victim_driver = tokio::spawn(victim_driver);
    let bystander = usher.alice().await;
    victim.batch_execute("SELECT 1").await.unwrap();

    let clients = console(&usher, "SHOW CLIENTS").await;
    let id = get(row(&clients, "application_name", "victim"), "id")
        .unwrap()
        .to_string();
    let messages = console_messages(usher.addr.port(), &format!("KILL_CLIENT {id}"))
        .await
        .unwrap();
    assert!(matches!(
        messages.last(),
        Some(SimpleQueryMessage::CommandComplete(_))
    ));

    // The victim's connection ends with 57P01; the bystander goes on.
    let ended = tokio::time::timeout(Duration::from_secs(10), victim_driver)
        .await
        .expect("the killed client's connection ends")
        .unwrap();
    let e = ended.expect_err("the killed client gets an error");
    assert_eq!(sqlstate(&e).as_deref(), Some("57P01"), "{e:?}");
    assert!(victim.batch_execute("SELECT 1").await.is_err());
    bystander.batch_execute("SELECT 1").await.unwrap();
    let clients = console(&usher, "SHOW CLIENTS").await;
    assert_eq!(app_clients(&clients).len(), 1, "{clients:#?}");

    // An id nobody has is an error, not a disconnect.
    let e = console_messages(usher.addr.port(), "KILL_CLIENT 999999")
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&e).as_deref(), Some("42704"), "{e:?}");
    let e = console_messages(usher.addr.port(), "KILL_CLIENT alice")
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&e).as_deref(), Some("42601"), "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_ends_a_databases_clients_even_mid_transaction_and_holds_new_ones_until_resume() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "pool_mode: transaction\n").await;
    let in_tx = usher.alice().await;
    in_tx.batch_execute("BEGIN; SELECT 1").await.unwrap();
    console(&usher, "KILL app").await;
    let e = in_tx.batch_execute("SELECT 1").await.unwrap_err();
    assert!(
        e.is_closed() || sqlstate(&e).as_deref() == Some("57P01"),
        "{e:?}"
    );

    // New clients get in (the pool knows the server's parameters) but wait
    // for a server connection until RESUME.
    let late = usher.alice().await;
    let query = tokio::spawn(async move { late.batch_execute("SELECT 1").await });
    assert!(
        still_pending(&query).await,
        "a query ran on a killed database"
    );
    // The killed client's server connection is no longer counted anywhere.
    let pools = console(&usher, "SHOW POOLS").await;
    assert_eq!(get(row(&pools, "database", "app"), "sv_active"), Some("0"));

    // A client killed while it waits stops being counted as waiting.
    let (doomed, doomed_driver) = tokio_postgres::connect(
        &format!(
            "{} application_name=doomed",
            usher.conn_str("alice", common::ALICE_PASSWORD)
        ),
        tokio_postgres::NoTls,
    )
    .await
    .unwrap();
    tokio::spawn(doomed_driver);
    let doomed_query = tokio::spawn(async move { doomed.batch_execute("SELECT 1").await });
    wait_for_rows(&usher, "SHOW POOLS", |rows| waiting_in_pool(rows) == 2).await;
    let clients = console(&usher, "SHOW CLIENTS").await;
    let id = get(row(&clients, "application_name", "doomed"), "id").unwrap();
    console(&usher, &format!("KILL_CLIENT {id}")).await;
    assert!(doomed_query.await.unwrap().is_err());
    wait_for_rows(&usher, "SHOW POOLS", |rows| waiting_in_pool(rows) == 1).await;

    console(&usher, "RESUME").await;
    query.await.unwrap().unwrap();
    wait_for_rows(&usher, "SHOW POOLS", |rows| waiting_in_pool(rows) == 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnect_replaces_idle_server_connections() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "pool_mode: transaction\n").await;
    let c = usher.alice().await;
    let before = backend_pid(&c).await;
    assert_eq!(
        backend_pid(&c).await,
        before,
        "the idle connection is reused"
    );
    console(&usher, "RECONNECT app").await;
    assert_ne!(
        backend_pid(&c).await,
        before,
        "RECONNECT closed the old connection"
    );
    let e = console_messages(usher.addr.port(), "RECONNECT nosuchdb")
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&e).as_deref(), Some("3D000"), "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn show_clients_and_servers_pair_a_client_with_its_server() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "pool_mode: transaction\n").await;
    let c = usher.alice().await;
    c.batch_execute("BEGIN").await.unwrap();
    let backend: i32 = c
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);

    let pgbouncer = [
        "type",
        "user",
        "database",
        "replication",
        "state",
        "addr",
        "port",
        "local_addr",
        "local_port",
        "connect_time",
        "request_time",
        "wait",
        "wait_us",
        "close_needed",
        "ptr",
        "link",
        "remote_pid",
        "tls",
        "application_name",
        "prepared_statements",
        "id",
    ];
    let (columns, _) = console_table(&usher, "SHOW CLIENTS").await;
    assert_eq!(columns, pgbouncer);
    let (columns, _) = console_table(&usher, "SHOW SERVERS").await;
    assert_eq!(columns, pgbouncer);

    let clients = console(&usher, "SHOW CLIENTS").await;
    let client = row(&clients, "user", "alice");
    assert_eq!(get(client, "type"), Some("C"));
    assert_eq!(get(client, "state"), Some("active"));
    assert_eq!(get(client, "addr"), Some("127.0.0.1"));
    assert_eq!(
        get(client, "local_port"),
        Some(&*usher.addr.port().to_string())
    );
    let servers = console(&usher, "SHOW SERVERS").await;
    let server = row(&servers, "remote_pid", &backend.to_string());
    assert_eq!(get(server, "state"), Some("active"));
    assert_eq!(get(server, "link"), get(client, "ptr"));
    assert_eq!(get(client, "link"), get(server, "ptr"));
    assert_eq!(get(server, "port"), Some(&*pg.port.to_string()));

    // After the transaction the client is idle and its server too, unlinked.
    c.batch_execute("COMMIT").await.unwrap();
    let clients = console(&usher, "SHOW CLIENTS").await;
    let client = row(&clients, "user", "alice");
    assert_eq!(get(client, "state"), Some("idle"));
    assert_eq!(get(client, "link"), None);
    let servers = console(&usher, "SHOW SERVERS").await;
    let server = row(&servers, "remote_pid", &backend.to_string());
    assert_eq!(get(server, "state"), Some("idle"));
    assert_eq!(get(server, "link"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_applies_a_changed_pool_size_users_and_rules() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "pool_mode: transaction\npool_size: 1\n").await;
    let holder = usher.alice().await;
    let waiter = usher.alice().await;
    holder.batch_execute("BEGIN; SELECT 1").await.unwrap();
    let query = tokio::spawn(async move { waiter.batch_execute("SELECT 1").await });
    wait_for_rows(&usher, "SHOW POOLS", |rows| waiting_in_pool(rows) == 1).await;

    // pool_size 2, and bob denied by a new blocking rule.
    usher.rewrite_config(&usher_yaml(
        pg,
        "pool_mode: transaction\npool_size: 2\nblocking:\n  rules:\n    - { action: deny, users: [bob] }\n",
    ));
    console(&usher, "RELOAD").await;
    // The waiting client gets the second connection while the first is held.
    tokio::time::timeout(Duration::from_secs(10), query)
        .await
        .expect("the waiting query ran after the pool grew")
        .unwrap()
        .unwrap();
    let config = console(&usher, "SHOW CONFIG").await;
    assert_eq!(get(row(&config, "key", "pool_size"), "value"), Some("2"));
    let e = usher.connect_as("bob", BOB_PASSWORD).await.unwrap_err();
    assert_eq!(sqlstate(&e).as_deref(), Some("28000"), "{e:?}");
    holder.batch_execute("COMMIT").await.unwrap();

    // Shrinking works too: with pool_size 1 a second transaction waits.
    usher.rewrite_config(&usher_yaml(pg, "pool_mode: transaction\npool_size: 1\n"));
    console(&usher, "RELOAD").await;
    let other = usher.alice().await;
    holder.batch_execute("BEGIN; SELECT 1").await.unwrap();
    let query = tokio::spawn(async move { other.batch_execute("SELECT 1").await });
    assert!(
        still_pending(&query).await,
        "pool_size 1 lent two connections"
    );
    holder.batch_execute("COMMIT").await.unwrap();
    query.await.unwrap().unwrap();
    // The rule is gone with the new file: bob gets in again.
    usher.connect_as("bob", BOB_PASSWORD).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_config_is_refused_and_the_running_one_stays() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "pool_size: 3\n").await;
    let c = usher.alice().await;
    usher.rewrite_config(&usher_yaml(pg, "pool_size: 5\npool_sise: 4\n"));
    let e = console_messages(usher.addr.port(), "RELOAD")
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&e).as_deref(), Some("22023"), "{e:?}");
    let detail = e
        .as_db_error()
        .and_then(|d| d.detail())
        .unwrap_or_default()
        .to_string();
    assert!(
        detail.contains("pool_sise"),
        "the error names the key: {detail}"
    );
    let config = console(&usher, "SHOW CONFIG").await;
    assert_eq!(get(row(&config, "key", "pool_size"), "value"), Some("3"));
    c.batch_execute("SELECT 1").await.unwrap();
    usher.alice().await.batch_execute("SELECT 1").await.unwrap();

    // A file that parses but names a missing file is refused too.
    usher.rewrite_config(&usher_yaml(
        pg,
        "pool_size: 5\nauth:\n  file: /nonexistent/userlist.txt\n",
    ));
    let e = console_messages(usher.addr.port(), "RELOAD")
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&e).as_deref(), Some("22023"), "{e:?}");
    let config = console(&usher, "SHOW CONFIG").await;
    assert_eq!(get(row(&config, "key", "pool_size"), "value"), Some("3"));

    // A key that needs a restart keeps its running value; the rest applies.
    // psql shows the WARNING that names it.
    usher.rewrite_config(&usher_yaml(pg, "pool_size: 5\nmax_auth_clients: 7\n"));
    let out = std::process::Command::new(pg.bin("psql"))
        .args(["-X", "-c", "RELOAD"])
        .arg(format!(
            "host=127.0.0.1 port={} user=admin password=admin-pw dbname=usher",
            usher.addr.port()
        ))
        .output()
        .expect("psql");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("WARNING") && stderr.contains("max_auth_clients"),
        "{stderr}"
    );
    let config = console(&usher, "SHOW CONFIG").await;
    assert_eq!(get(row(&config, "key", "pool_size"), "value"), Some("5"));
    assert_eq!(
        get(row(&config, "key", "max_auth_clients"), "value"),
        Some("1000")
    );
}

/// psql's output of a console command as admin: (stdout, stderr, success).
fn psql_console(pg: &PgCluster, usher: &Usher, command: &str) -> (String, String, bool) {
    let out = std::process::Command::new(pg.bin("psql"))
        .args(["-X", "-c", command])
        .arg(format!(
            "host=127.0.0.1 port={} user=admin password=admin-pw dbname=usher",
            usher.addr.port()
        ))
        .output()
        .expect("psql");
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
        out.status.success(),
    )
}

fn config_value(rows: &[Row], key: &str) -> String {
    get(row(rows, "key", key), "value").unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_changes_a_running_key_until_the_next_reload() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "pool_mode: transaction\npool_size: 1\n").await;
    let holder = usher.alice().await;
    let waiter = usher.alice().await;
    holder.batch_execute("BEGIN; SELECT 1").await.unwrap();
    let query = tokio::spawn(async move { waiter.batch_execute("SELECT 1").await });
    wait_for_rows(&usher, "SHOW POOLS", |rows| waiting_in_pool(rows) == 1).await;

    // SET answers as PgBouncer's does, and the pool grows at once: the
    // waiting client gets a second connection while the first is held.
    let (stdout, stderr, ok) = psql_console(pg, &usher, "SET pool_size TO '2'");
    assert!(ok && stdout.trim() == "SET", "{stdout}{stderr}");
    tokio::time::timeout(Duration::from_secs(10), query)
        .await
        .expect("the waiting query ran after SET pool_size = 2")
        .unwrap()
        .unwrap();
    let config = console(&usher, "SHOW CONFIG").await;
    assert_eq!(config_value(&config, "pool_size"), "2");
    assert_eq!(
        get(row(&config, "key", "pool_size"), "changeable"),
        Some("yes")
    );
    holder.batch_execute("COMMIT").await.unwrap();

    // Another key, seen by a client: client_idle_timeout ends an idle one.
    console(&usher, "SET client_idle_timeout = 1").await;
    let idle = usher.alice().await;
    let e = common::wait::wait_for_async(
        Duration::from_secs(10),
        "the idle client is ended",
        || async {
            match idle.batch_execute("SELECT 1").await {
                Err(e) => Ok(e),
                Ok(()) => {
                    tokio::time::sleep(Duration::from_millis(1500)).await;
                    Err("still connected")
                }
            }
        },
    )
    .await;
    assert!(
        e.is_closed() || sqlstate(&e).as_deref() == Some("57P05"),
        "{e:?}"
    );
    console(&usher, "SET client_idle_timeout = 0").await;

    // RELOAD reads the file again: the console's values are gone, and a
    // second transaction waits for the one connection.
    console(&usher, "RELOAD").await;
    let config = console(&usher, "SHOW CONFIG").await;
    assert_eq!(config_value(&config, "pool_size"), "1");
    let other = usher.alice().await;
    holder.batch_execute("BEGIN; SELECT 1").await.unwrap();
    let query = tokio::spawn(async move { other.batch_execute("SELECT 1").await });
    assert!(
        still_pending(&query).await,
        "pool_size 1 lent two connections after RELOAD"
    );
    holder.batch_execute("COMMIT").await.unwrap();
    query.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_refuses_restart_only_keys_unknown_keys_bad_values_and_stats_users() {
    let pg = PgCluster::shared();
    let yaml = usher_yaml(pg, "pool_size: 3\n").replace(
        "admin:\n  users: [admin]\n",
        "admin:\n  users: [admin]\n  stats_users: [bob]\n",
    );
    let usher = Usher::start_yaml(&yaml).await;
    let port = usher.addr.port();
    let refused = |command: &'static str| async move {
        let e = console_messages(port, command).await.unwrap_err();
        let db = e
            .as_db_error()
            .unwrap_or_else(|| panic!("{command}: {e:?}"));
        (
            db.code().code().to_string(),
            db.message().to_string(),
            db.detail().unwrap_or_default().to_string(),
        )
    };

    let (code, message, _) = refused("SET listen = '127.0.0.1:7000'").await;
    assert_eq!(code, "55P02", "{message}");
    assert!(
        message.contains("\"listen\"") && message.contains("restart"),
        "{message}"
    );

    let (code, message, _) = refused("SET pool_sise = 4").await;
    assert_eq!(code, "42704", "{message}");
    assert!(message.contains("\"pool_sise\""), "{message}");

    let (code, message, detail) = refused("SET pool_size = 0").await;
    assert_eq!(code, "22023", "{message}");
    assert!(detail.contains("greater than 0"), "{message}: {detail}");
    let (code, message, _) = refused("SET pool_size = many").await;
    assert_eq!(code, "22023", "{message}");
    let (code, message, detail) = refused("SET pool_mode = statement").await;
    assert_eq!(code, "22023", "{message}: {detail}");

    // bob may SHOW but not SET.
    let conn = format!("host=127.0.0.1 port={port} user=bob password={BOB_PASSWORD} dbname=usher");
    let (bob, driver) = tokio_postgres::connect(&conn, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(driver);
    bob.simple_query("SHOW CONFIG").await.unwrap();
    let e = bob.simple_query("SET pool_size = 4").await.unwrap_err();
    assert_eq!(sqlstate(&e).as_deref(), Some("42501"), "{e:?}");

    // None of it changed anything.
    let config = console(&usher, "SHOW CONFIG").await;
    assert_eq!(config_value(&config, "pool_size"), "3");
    assert_eq!(config_value(&config, "pool_mode"), "transaction");
    assert_eq!(config_value(&config, "listen"), "127.0.0.1:0");
}
