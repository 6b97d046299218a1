//! PostgreSQL restarting under usher (issue 29): clients that need a server
//! connection while none can be opened wait for the server to come back
//! (up to `query_wait_timeout`), one attempt at a time per pool, and their
//! queries run then; `server_fast_fail` keeps PgBouncer's immediate error;
//! a refused login (wrong password, missing database) still fails at once.
//!
//! The tests that stop PostgreSQL do it on a cluster of their own, one
//! test at a time (`STOPS`); the others use a server that is never up (a
//! port that accepts and closes) or the shared cluster.

use crate::common::canary::Canary;
use crate::common::console::console_at;
use crate::common::metrics::{metric, scrape};
use crate::common::wait::{wait_for_async, DEADLINE};
use crate::common::{sqlstate, PgCluster, Usher, UsherProcess, ALICE_PASSWORD, BOB_PASSWORD};
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The tests that stop this module's cluster run one at a time.
static STOPS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn cluster() -> &'static PgCluster {
    PgCluster::own(module_path!())
}

/// pg_ctl stop -m fast, off the runtime's threads.
async fn stop(pg: &'static PgCluster) {
    tokio::task::spawn_blocking(|| pg.stop_fast())
        .await
        .unwrap();
}

/// pg_ctl start (waits until it accepts connections).
async fn start(pg: &'static PgCluster) {
    tokio::task::spawn_blocking(|| pg.pg_ctl_start())
        .await
        .unwrap();
}

/// usher's configuration with database `app` on `port` and the test users,
/// then `extra` (top-level keys, and keys of `app` in `app_keys`).
fn yaml(port: u16, app_keys: &str, extra: &str) -> String {
    format!(
        "listen: 127.0.0.1:0\n\
         hooks: {{ dir: tests/no-hooks }}\n\
         pool_mode: transaction\n\
         databases:\n  app: {{ host: 127.0.0.1, port: {port}{app_keys} }}\n\
         users:\n  alice: {{ password: {ALICE_PASSWORD} }}\n  bob: {{ password: {BOB_PASSWORD} }}\n  admin: {{ password: admin-pw }}\n\
         admin: {{ users: [admin] }}\n{extra}"
    )
}

/// A port where something accepts connections and closes them at once
/// (a server that never comes up), counting the connections.
fn dead_host() -> (u16, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let count = Arc::new(AtomicUsize::new(0));
    let seen = count.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            seen.fetch_add(1, Ordering::SeqCst);
            drop(conn);
        }
    });
    (port, count)
}

/// The `column` of SHOW POOLS for (`database`, `user`).
async fn pool_column(port: u16, database: &str, user: &str, column: &str) -> Option<String> {
    let rows = console_at(port, "SHOW POOLS").await.ok()?;
    rows.into_iter()
        .find(|r| r["database"].as_deref() == Some(database) && r["user"].as_deref() == Some(user))
        .and_then(|r| r[column].clone())
}

/// A load client at the end: its connection, and each turn's outcome.
type Ran = (tokio_postgres::Client, Vec<Result<(), String>>);

/// Clients that each run a statement every 50 ms until told to stop
/// (every third turn a transaction block), keeping each turn's outcome.
struct Load {
    stop: Arc<AtomicBool>,
    turns: Vec<Arc<AtomicU64>>,
    tasks: Vec<tokio::task::JoinHandle<Ran>>,
}

impl Load {
    async fn start(usher: &Usher, clients: usize) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let (mut turns, mut tasks) = (Vec::new(), Vec::new());
        for _ in 0..clients {
            let client = usher.alice().await;
            let (stop, done) = (stop.clone(), Arc::new(AtomicU64::new(0)));
            turns.push(done.clone());
            tasks.push(tokio::spawn(async move {
                let mut client = client;
                let mut outcomes = Vec::new();
                let mut i = 0i64;
                while !stop.load(Ordering::Relaxed) && !client.is_closed() {
                    i += 1;
                    let turn = async {
                        if i % 3 == 0 {
                            let t = client.transaction().await?;
                            let row = t.query_one("SELECT $1::int8 + 1", &[&i]).await?;
                            assert_eq!(row.get::<_, i64>(0), i + 1);
                            t.simple_query("SELECT 1").await?;
                            t.commit().await
                        } else {
                            let row = client.query_one("SELECT $1::int8 * 2", &[&i]).await?;
                            assert_eq!(row.get::<_, i64>(0), i * 2);
                            Ok(())
                        }
                    };
                    outcomes.push(
                        turn.await
                            .map_err(|e| format!("turn {i}: {:?} {e}", sqlstate(&e))),
                    );
                    done.fetch_add(1, Ordering::Relaxed);
                    // The workload: a statement every 50 ms.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                (client, outcomes)
            }));
        }
        Load { stop, turns, tasks }
    }

    /// Waits until every client has finished `more` turns from now (or
    /// one has stopped: its connection closed).
    async fn run_on(&self, more: u64) {
        let from: Vec<u64> = self
            .turns
            .iter()
            .map(|t| t.load(Ordering::Relaxed))
            .collect();
        wait_for_async(Duration::from_secs(60), "every client runs on", || async {
            let now: Vec<u64> = self
                .turns
                .iter()
                .map(|t| t.load(Ordering::Relaxed))
                .collect();
            if self.tasks.iter().any(|t| t.is_finished())
                || now.iter().zip(&from).all(|(n, f)| n - f >= more)
            {
                Ok(())
            } else {
                Err(format!("{from:?} -> {now:?}"))
            }
        })
        .await
    }

    async fn finish(self) -> Vec<Ran> {
        self.stop.store(true, Ordering::Relaxed);
        let mut all = Vec::new();
        for t in self.tasks {
            all.push(t.await.unwrap());
        }
        all
    }
}

/// Issue 29's test: PostgreSQL stops (`pg_ctl stop -m fast`) for two
/// seconds, twice, under 20 clients in transaction mode. A client's only
/// errors are for statements in flight at a stop (`57P01`, as a direct
/// connection gets it, or `08006`), at most one per stop; its connection to
/// usher survives; and its next statement succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_stops_under_load_fail_only_the_statements_in_flight() {
    let _one = STOPS.lock().await;
    let pg = cluster();
    let usher = Usher::start_yaml(&yaml(
        pg.port,
        "",
        "pool_size: 10
",
    ))
    .await;
    let load = Load::start(&usher, 20).await;
    load.run_on(5).await;
    for _ in 0..2 {
        stop(pg).await;
        // Down for two seconds: time passing is the point.
        tokio::time::sleep(Duration::from_secs(2)).await;
        start(pg).await;
        load.run_on(5).await;
    }
    for (n, (client, outcomes)) in load.finish().await.into_iter().enumerate() {
        let errors: Vec<&String> = outcomes.iter().filter_map(|o| o.as_ref().err()).collect();
        eprintln!("client {n}: {} turns, errors: {errors:?}", outcomes.len());
        assert!(
            !client.is_closed(),
            "client {n} lost its connection: {errors:?}"
        );
        assert!(errors.len() <= 2, "client {n}: {errors:?}");
        for e in &errors {
            assert!(
                e.contains("Some(\"57P01\")") || e.contains("Some(\"08006\")"),
                "client {n}: {e}"
            );
        }
        for pair in outcomes.windows(2) {
            assert!(
                pair[0].is_ok() || pair[1].is_ok(),
                "client {n}: the statement after an error failed too: {pair:?}"
            );
        }
        assert!(
            outcomes.last().is_some_and(|o| o.is_ok()),
            "client {n}: {outcomes:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_query_sent_while_postgresql_is_down_runs_once_it_is_back() {
    let _one = STOPS.lock().await;
    let pg = cluster();
    let usher = Usher::start_yaml(&yaml(pg.port, "", "")).await;
    let port = usher.addr.port();
    let alice = usher.alice().await;
    alice.simple_query("SELECT 1").await.unwrap();

    stop(pg).await;
    // Sent while nothing listens: it waits instead of failing.
    let query = tokio::spawn(async move {
        let row = alice.query_one("SELECT 41 + 1", &[]).await;
        (alice, row)
    });
    wait_for_async(DEADLINE, "the query waits for a server", || async {
        if query.is_finished() {
            return Ok(());
        }
        match pool_column(port, "app", "alice", "cl_waiting").await {
            Some(n) if n != "0" => Ok(()),
            other => Err(other),
        }
    })
    .await;
    assert!(
        !query.is_finished(),
        "the query ended while the server was down: {:?}",
        query.await
    );
    // A client that logs in meanwhile gets in (the pool knows the server's
    // parameters) and its query waits too.
    let late = usher.alice().await;
    let late_query = tokio::spawn(async move { late.query_one("SELECT 7", &[]).await });

    start(pg).await;
    let (alice, row) = query.await.unwrap();
    assert_eq!(row.expect("the query ran").get::<_, i32>(0), 42);
    assert_eq!(late_query.await.unwrap().unwrap().get::<_, i32>(0), 7);
    assert!(!alice.is_closed());
    // The wait is the pool's wait time (SHOW STATS), as a wait for a slot is.
    let stats = console_at(port, "SHOW STATS").await.unwrap();
    let app = stats
        .iter()
        .find(|r| r["database"].as_deref() == Some("app"))
        .expect("app's row");
    let waited: u64 = app["total_wait_time"].as_deref().unwrap().parse().unwrap();
    assert!(waited > 0, "{app:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_server_fast_fail_a_client_gets_the_error_at_once() {
    let _one = STOPS.lock().await;
    let pg = cluster();
    let usher = Usher::start_yaml(&yaml(pg.port, "", "server_fast_fail: true\n")).await;
    let alice = usher.alice().await;
    alice.simple_query("SELECT 1").await.unwrap();
    stop(pg).await;
    let e = alice
        .simple_query("SELECT 1")
        .await
        .expect_err("no server: the query fails");
    start(pg).await;
    // PgBouncer's way: FATAL, and the client's connection ends.
    let db = e.as_db_error().unwrap_or_else(|| panic!("{e:?}"));
    assert_eq!(
        (db.severity(), db.code().code()),
        ("FATAL", "08006"),
        "{db:?}"
    );
    assert!(
        db.message().starts_with("could not connect to server"),
        "{db:?}"
    );
    wait_for_async(DEADLINE, "the client's connection ends", || async {
        alice.is_closed().then_some(()).ok_or(())
    })
    .await;
    // Once the server is back, clients are served again.
    let again = usher.alice().await;
    wait_for_async(DEADLINE, "a query after the restart", || async {
        again.simple_query("SELECT 1").await.map(drop)
    })
    .await;
}

/// usher_pool_wait_seconds has a query's whole wait, through an outage
/// too (it had only the wait for a place, near nothing, while SHOW STATS'
/// total_wait_time had both).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wait_histogram_has_a_wait_through_an_outage() {
    let _one = STOPS.lock().await;
    let pg = cluster();
    let usher = UsherProcess::builder_yaml(&yaml(pg.port, "", ""))
        .metrics()
        .start();
    let metrics_port = usher.metrics_port.unwrap();
    let conn = usher.conn_str("alice", ALICE_PASSWORD, "app");
    let (alice, driver) = tokio_postgres::connect(&conn, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(driver);
    alice.simple_query("SELECT 1").await.unwrap();
    let sum = |text: &str| {
        metric(
            text,
            r#"usher_pool_wait_seconds_sum{database="app",user="alice"}"#,
        )
        .unwrap_or_else(|| panic!("no wait histogram in\n{text}"))
    };
    let before = sum(&scrape(metrics_port).await);
    stop(pg).await;
    let query = tokio::spawn(async move { alice.query_one("SELECT 1", &[]).await.map(drop) });
    // The outage lasts at least this long (not a wait for an event).
    tokio::time::sleep(Duration::from_millis(1200)).await;
    start(pg).await;
    query
        .await
        .unwrap()
        .expect("the query ran once the server was back");
    let after = sum(&scrape(metrics_port).await);
    assert!(
        after - before >= 1.0,
        "the histogram has {} s more for a wait of over 1.2 s",
        after - before
    );
}

/// A login that needs the auth query (a role usher does not list) while
/// PostgreSQL restarts waits for it, as a query does, and gets in once it
/// is back; a canary on the shared cluster never notices. The auth query's
/// connection failing for another reason (auth.user's wrong password) still
/// refuses at once (auth_sources.rs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_login_through_the_auth_query_waits_for_a_restart() {
    let _one = STOPS.lock().await;
    let pg = cluster();
    pg.ensure_role(
        "restarts_auth",
        "LOGIN SUPERUSER PASSWORD 'restarts-auth-pw'",
    );
    pg.ensure_role("restarts_dora", "LOGIN PASSWORD 'dora-pw'");
    pg.psql_super("GRANT CONNECT ON DATABASE app TO restarts_dora");
    let extra = "auth:\n  user: restarts_auth\n";
    let usher = Usher::start_yaml(&yaml(pg.port, "", extra).replacen(
        "users:\n",
        "users:\n  restarts_auth: { password: restarts-auth-pw }\n",
        1,
    ))
    .await;
    let canary_usher = Usher::start(PgCluster::shared(), "").await;
    let canary = Canary::start(canary_usher.addr.port());

    stop(pg).await;
    let login = tokio::spawn({
        let conn = usher.conn_str("restarts_dora", "dora-pw");
        async move {
            let (c, connection) = tokio_postgres::connect(&conn, tokio_postgres::NoTls).await?;
            tokio::spawn(connection);
            c.query_one("SELECT current_user::text", &[])
                .await
                .map(|r| r.get::<_, String>(0))
        }
    });
    // Not a timed wait for an event: the login must still be waiting after
    // a while with the server down (it failed at once before).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        !login.is_finished(),
        "the login ended while the server was down: {:?}",
        login.await
    );
    start(pg).await;
    let user = tokio::time::timeout(DEADLINE, login)
        .await
        .expect("the login ends once the server is back")
        .unwrap()
        .expect("the login gets in");
    assert_eq!(user, "restarts_dora");
    canary.check();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_login_fails_at_once_while_the_server_is_up() {
    let pg = PgCluster::shared();
    // A wait would last ten minutes: the test would hang, not pass.
    let usher = Usher::start_yaml(&format!(
        "listen: 127.0.0.1:0\n\
         hooks: {{ dir: tests/no-hooks }}\n\
         query_wait_timeout: 600\n\
         databases:\n  app: {{ port: {0} }}\n  restarts_nodb: {{ port: {0}, dbname: restarts_no_such_database }}\n\
         users:\n  alice: {{ password: {ALICE_PASSWORD} }}\n  restarts_nobody: {{ password: nobody-pw }}\n",
        pg.port
    ))
    .await;
    let guard = Duration::from_secs(60);
    // A user the server does not know (its password check fails).
    let e = tokio::time::timeout(guard, usher.connect_as("restarts_nobody", "nobody-pw"))
        .await
        .expect("the login did not wait")
        .map(drop)
        .expect_err("the server refuses the user");
    assert_eq!(sqlstate(&e).as_deref(), Some("28P01"), "{e:?}");
    // A database the server does not have.
    let conn = usher.conn_str_db("alice", ALICE_PASSWORD, "restarts_nodb");
    let e = tokio::time::timeout(guard, tokio_postgres::connect(&conn, tokio_postgres::NoTls))
        .await
        .expect("the login did not wait")
        .map(drop)
        .expect_err("the server has no such database");
    assert_eq!(sqlstate(&e).as_deref(), Some("3D000"), "{e:?}");
    assert!(
        !e.as_db_error()
            .unwrap()
            .detail()
            .unwrap_or_default()
            .contains("query_wait_timeout"),
        "{e:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_of_a_server_that_is_down_share_the_attempts_and_stall_no_other_pool() {
    let pg = PgCluster::shared();
    let (dead, attempts) = dead_host();
    let usher = Usher::start_yaml(&format!(
        "listen: 127.0.0.1:0\n\
         hooks: {{ dir: tests/no-hooks }}\n\
         pool_size: 40\n\
         auth: {{ method: password }}\n\
         databases:\n  app: {{ port: {} }}\n  restarts_down: {{ port: {dead}, query_wait_timeout: 1 }}\n\
         users:\n  alice: {{ password: {ALICE_PASSWORD} }}\n  bob: {{ password: {BOB_PASSWORD} }}\n  admin: {{ password: admin-pw }}\n\
         admin: {{ users: [admin] }}\n",
        pg.port
    ))
    .await;
    // Cleartext passwords: forty SCRAM exchanges at once (PBKDF2 on both
    // sides, in this process, on the runtime usher shares) would stall
    // the canary themselves.
    let canary = Canary::start(usher.addr.port());
    let login = || {
        let conn = usher.conn_str_db("alice", ALICE_PASSWORD, "restarts_down");
        tokio::spawn(async move {
            tokio_postgres::connect(&conn, tokio_postgres::NoTls)
                .await
                .map(drop)
        })
    };
    // The first login finds the server down; the others come once the
    // pool knows it is, and wait for its attempts instead of making their
    // own.
    let mut logins = vec![login()];
    wait_for_async(DEADLINE, "a first attempt", || async {
        match attempts.load(Ordering::SeqCst) {
            0 => Err(()),
            _ => Ok(()),
        }
    })
    .await;
    let before = attempts.load(Ordering::SeqCst);
    logins.extend((1..40).map(|_| login()));
    for login in logins {
        let e = login.await.unwrap().expect_err("the server never came up");
        let db = e.as_db_error().unwrap_or_else(|| panic!("{e:?}"));
        // After query_wait_timeout, the last attempt's error, saying so.
        assert_eq!(db.code().code(), "08006", "{db:?}");
        assert!(
            db.detail()
                .unwrap_or_default()
                .contains("query_wait_timeout"),
            "{db:?}"
        );
    }
    let made = attempts.load(Ordering::SeqCst) - before;
    assert!(
        made < 39,
        "39 waiting clients made {made} attempts: one each or more"
    );
    // Meanwhile bob's pool, on a server that is up, never stalled.
    canary.check();
}
