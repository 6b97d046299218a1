//! Running usher: cancel requests, waiting for a full pool, pgbench load,
//! graceful shutdown on signals, `usher check`, and memory while a large
//! result streams through.

use crate::common;

use crate::common::console::{console_table, wait_pool};
use crate::common::metrics::{metric, scrape};
use crate::common::wait::{eventually_async, wait_for_async};
use crate::common::{sqlstate, usher_cli, PgCluster, Usher, UsherProcess, ALICE_PASSWORD};
use std::process::Command;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_reaches_the_right_backend_in_both_modes() {
    let pg = PgCluster::shared();
    for mode in ["session", "transaction"] {
        let usher = Usher::start(pg, &format!("pool_mode: {mode}\npool_size: 2\n")).await;
        let sleeper = usher.alice().await;
        let bystander = usher.alice().await;
        let token = sleeper.cancel_token();
        let bystander_sleep = tokio::spawn(async move {
            bystander
                .query_one("SELECT pg_sleep(1.5)::text", &[])
                .await
                .map(|_| ())
        });
        let started = Instant::now();
        // Cancel once the query runs on the server: a cancel that arrives
        // while the client is between transactions rightly does nothing.
        // Named for this test and mode: a query of the same text elsewhere
        // on the shared cluster (or the other mode's, not yet idle) would
        // set the cancel off too early.
        let sleep = format!("SELECT pg_sleep(30) AS cancel_right_backend_{mode}");
        let waited = sleep.clone();
        let canceller = tokio::spawn(async move {
            PgCluster::shared().wait_until_active(&waited).await;
            token.cancel_query(tokio_postgres::NoTls).await.unwrap();
        });
        let e = sleeper.simple_query(&sleep).await.unwrap_err();
        assert_eq!(sqlstate(&e).as_deref(), Some("57014"), "{mode}: {e:?}");
        assert!(started.elapsed() < Duration::from_secs(15));
        canceller.await.unwrap();
        bystander_sleep
            .await
            .unwrap()
            .expect("the other client's query is not cancelled");
        // The cancelled client goes on.
        assert_eq!(
            sleeper
                .query_one("SELECT 5", &[])
                .await
                .unwrap()
                .get::<_, i32>(0),
            5
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_between_transactions_does_nothing_harmful() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "pool_mode: transaction\npool_size: 1\n").await;
    let idle = usher.alice().await;
    let busy = usher.alice().await;
    idle.query_one("SELECT 1", &[]).await.unwrap();
    // `idle` holds no server connection now; `busy` will run on the only one.
    let token = idle.cancel_token();
    let busy_query = tokio::spawn(async move {
        busy.query_one("SELECT pg_sleep(1)::text AS cancel_between", &[])
            .await
            .map(|_| ())
    });
    // The cancel arrives while busy's query runs on the only server
    // connection.
    pg.wait_until_active("SELECT pg_sleep(1)::text AS cancel_between")
        .await;
    token.cancel_query(tokio_postgres::NoTls).await.unwrap();
    busy_query
        .await
        .unwrap()
        .expect("busy's query is not cancelled by idle's cancel");
    assert_eq!(
        idle.query_one("SELECT 6", &[])
            .await
            .unwrap()
            .get::<_, i32>(0),
        6
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_wait_for_a_full_pool_then_time_out() {
    let pg = PgCluster::shared();
    let usher = Usher::start(
        pg,
        "pool_mode: transaction\npool_size: 1\nquery_wait_timeout: 1\n",
    )
    .await;
    let mut holder = usher.alice().await;
    let waiter = usher.alice().await;
    let tx = holder.transaction().await.unwrap();
    tx.query_one("SELECT 1", &[]).await.unwrap();
    // While the only connection is in a transaction, the waiter times out.
    let started = Instant::now();
    let e = waiter.query_one("SELECT 2", &[]).await.unwrap_err();
    assert_eq!(sqlstate(&e).as_deref(), Some("53300"), "{e:?}");
    assert!(started.elapsed() >= Duration::from_millis(900));
    tx.commit().await.unwrap();

    // A waiter that the holder releases in time gets served.
    let waiter = usher.alice().await;
    let tx = holder.transaction().await.unwrap();
    tx.query_one("SELECT 1", &[]).await.unwrap();
    let served = tokio::spawn(async move {
        waiter
            .query_one("SELECT 7", &[])
            .await
            .map(|r| r.get::<_, i32>(0))
    });
    // The holder commits once the waiter waits for the connection.
    wait_pool(usher.addr.port(), "alice", "cl_waiting", "1").await;
    tx.commit().await.unwrap();
    assert_eq!(served.await.unwrap().unwrap(), 7);
}

fn pgbench(pg: &PgCluster, port: u16, args: &[&str]) -> String {
    let out = Command::new("pgbench")
        .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-U", "alice"])
        .args(args)
        .arg("app")
        .env("PGPASSWORD", ALICE_PASSWORD)
        .output()
        .expect("pgbench");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "pgbench {args:?} through usher in front of :{} failed:\n{text}",
        pg.port
    );
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbench_runs_without_failures_in_both_modes() {
    let pg = PgCluster::shared();
    for mode in ["session", "transaction"] {
        let usher = Usher::start(pg, &format!("pool_mode: {mode}\npool_size: 5\n")).await;
        let port = usher.addr.port();
        let report = tokio::task::spawn_blocking(move || {
            let pg = PgCluster::shared();
            pgbench(pg, port, &["-i", "-q", "-s", "1"]);
            pgbench(pg, port, &["-c", "20", "-j", "2", "-T", "5"])
        })
        .await
        .unwrap();
        let processed = report
            .lines()
            .find_map(|l| l.strip_prefix("number of transactions actually processed: "))
            .unwrap_or_else(|| panic!("{mode}: no summary in\n{report}"));
        let processed: u64 = processed
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!(processed > 0, "{mode}: {report}");
        let failed = report
            .lines()
            .find_map(|l| l.strip_prefix("number of failed transactions: "));
        assert_eq!(
            failed.map(|f| f.split_whitespace().next().unwrap()),
            Some("0"),
            "{mode}: {report}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_lets_running_transactions_finish_then_exits() {
    let pg = PgCluster::shared();
    let mut usher = UsherProcess::builder(pg)
        .extra("pool_mode: transaction\nshutdown_timeout: 20\n")
        .start();
    let conn = usher.alice_conn_str();
    let (mut c, driver) = usher.alice().await;
    let (idle, idle_driver) = usher.alice().await;
    c.batch_execute("DROP TABLE IF EXISTS shutdown_t; CREATE TABLE shutdown_t (v int)")
        .await
        .unwrap();
    idle.query_one("SELECT 1", &[]).await.unwrap();

    let tx = c.transaction().await.unwrap();
    tx.execute("INSERT INTO shutdown_t VALUES (1)", &[])
        .await
        .unwrap();
    // SIGINT is PgBouncer's "wait for servers": each client ends once its
    // transaction is over.
    usher.signal(libc::SIGINT);
    // No new clients are accepted.
    wait_until_refused(&conn).await;
    // The idle client was closed with 57P01.
    let e = idle_driver.await.unwrap().expect_err("idle client closed");
    assert_eq!(sqlstate(&e).as_deref(), Some("57P01"), "{e:?}");
    // The running transaction may finish.
    tx.execute("INSERT INTO shutdown_t VALUES (2)", &[])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    // ...and then its client is closed and usher exits cleanly.
    let e = driver
        .await
        .unwrap()
        .expect_err("client closed after its transaction");
    assert_eq!(sqlstate(&e).as_deref(), Some("57P01"), "{e:?}");
    assert!(wait_exit(&mut usher), "usher exits cleanly");
    assert_eq!(
        pg.psql_super_db("app", "SELECT count(*) FROM shutdown_t"),
        "2"
    );
}

/// A session-mode client between transactions holds its server and stays
/// in the busy loop (it never parks): SIGINT's drain must still reach it
/// there and end it with 57P01, and usher exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_ends_an_idle_session_mode_client_holding_its_server() {
    let pg = PgCluster::shared();
    let mut usher = UsherProcess::builder(pg)
        .extra("pool_mode: session\nshutdown_timeout: 20\n")
        .start();
    let (c, driver) = usher.alice().await;
    c.batch_execute("SELECT 1").await.unwrap();
    usher.signal(libc::SIGINT);
    let e = tokio::time::timeout(Duration::from_secs(10), driver)
        .await
        .expect("the idle session-mode client was ended by the drain")
        .unwrap()
        .expect_err("idle client closed");
    assert_eq!(sqlstate(&e).as_deref(), Some("57P01"), "{e:?}");
    assert!(wait_exit(&mut usher), "usher exits cleanly");
}

/// Waits until usher refuses new connections (shutdown closed its listener).
async fn wait_until_refused(conn: &str) {
    eventually_async(Duration::from_secs(10), "usher refuses clients", || async {
        tokio_postgres::connect(conn, tokio_postgres::NoTls)
            .await
            .is_err()
    })
    .await
}

/// Waits for the usher process to exit; returns whether it exited cleanly.
fn wait_exit(usher: &mut UsherProcess) -> bool {
    usher.wait_exit(Duration::from_secs(10)).success()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_waits_for_clients_to_leave() {
    let pg = PgCluster::shared();
    let mut usher = UsherProcess::builder(pg)
        .extra("pool_mode: transaction\nshutdown_timeout: 20\n")
        .start();
    let conn = usher.alice_conn_str();
    let (c, driver) = usher.alice().await;
    c.batch_execute("SELECT 1").await.unwrap();
    // SIGTERM is PgBouncer's "wait for clients": no new clients, but the
    // connected one keeps working, transaction after transaction.
    usher.signal(libc::SIGTERM);
    wait_until_refused(&conn).await;
    for _ in 0..3 {
        c.batch_execute("BEGIN; SELECT 1; COMMIT").await.unwrap();
    }
    assert!(
        usher.child.try_wait().unwrap().is_none(),
        "usher left early"
    );
    // Once it leaves, usher exits cleanly.
    drop(c);
    driver.await.unwrap().unwrap();
    assert!(wait_exit(&mut usher));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigusr1_pauses_and_sigusr2_resumes() {
    let pg = PgCluster::shared();
    let usher = UsherProcess::builder(pg)
        .extra("pool_mode: transaction\n")
        .start();
    let (c, _driver) = usher.alice().await;
    c.batch_execute("SELECT 1").await.unwrap();
    usher.signal(libc::SIGUSR1);
    let admin = format!(
        "host=127.0.0.1 port={} user=admin password=admin-pw dbname=usher",
        usher.port
    );
    let (console, console_driver) = tokio_postgres::connect(&admin, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(console_driver);
    eventually_async(Duration::from_secs(10), "SIGUSR1 pauses", || async {
        let state = console.simple_query("SHOW STATE").await.unwrap();
        state.iter().any(|m| {
            matches!(m, tokio_postgres::SimpleQueryMessage::Row(r) if r.get(0) == Some("paused"))
        })
    })
    .await;
    let query = tokio::spawn(async move { c.batch_execute("SELECT 1").await });
    // A fixed wait on purpose: nothing may happen during it (the query
    // must not run while paused).
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!query.is_finished(), "a query ran while paused");
    usher.signal(libc::SIGUSR2);
    tokio::time::timeout(Duration::from_secs(10), query)
        .await
        .expect("the query ran after SIGUSR2")
        .unwrap()
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_the_configuration_file() {
    let pg = PgCluster::shared();
    let usher = UsherProcess::builder(pg).extra("pool_size: 3\n").start();
    let admin = format!(
        "host=127.0.0.1 port={} user=admin password=admin-pw dbname=pgbouncer",
        usher.port
    );
    let pool_size = || async {
        let (c, driver) = tokio_postgres::connect(&admin, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(driver);
        let rows = c.simple_query("SHOW CONFIG").await.unwrap();
        rows.iter()
            .find_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) if r.get(0) == Some("pool_size") => {
                    r.get(1).map(str::to_string)
                }
                _ => None,
            })
            .unwrap()
    };
    assert_eq!(pool_size().await, "3");
    let yaml = std::fs::read_to_string(&usher.config_path).unwrap();
    std::fs::write(
        &usher.config_path,
        yaml.replace("pool_size: 3", "pool_size: 6"),
    )
    .unwrap();
    usher.signal(libc::SIGHUP);
    eventually_async(Duration::from_secs(10), "SIGHUP reloads", || async {
        pool_size().await == "6"
    })
    .await;
}

/// Issue 25 item 7: an emptied configuration file was accepted by SIGHUP
/// (afterwards every login got 28P01 and the console was gone), and a
/// `hooks.dir` naming a missing folder reloaded with no hooks at all, a
/// rejecting one too. Such reloads are refused with an ERROR that says
/// why, and the running set stays; `hooks.allow_empty: true` says "no
/// hook files" on purpose.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_would_leave_nothing_is_refused() {
    let pg = PgCluster::shared();
    let hooks = tempfile::tempdir().unwrap();
    std::fs::write(
        hooks.path().join("no-bob.lua"),
        "function client_connection(ctx)\n  if ctx.user == 'bob' then ctx:reject('bob may not connect') end\nend\n",
    )
    .unwrap();
    let usher = UsherProcess::builder(pg)
        .extra(&format!("hooks:\n  dir: {}\n", hooks.path().display()))
        .start();
    let running = std::fs::read_to_string(&usher.config_path).unwrap();
    let bob = format!(
        "host=127.0.0.1 port={} user=bob password={} dbname=app",
        usher.port,
        common::BOB_PASSWORD
    );
    let bob_refused = || async {
        let e = tokio_postgres::connect(&bob, tokio_postgres::NoTls)
            .await
            .err()
            .expect("the hook refuses bob");
        assert_eq!(sqlstate(&e).as_deref(), Some("28000"), "{e:?}");
    };
    bob_refused().await;
    // Each reload below is refused: its ERROR line is the sign it ran.
    let mut refusals = 0;
    let mut reload_refused = |yaml: &str, why: &str| {
        std::fs::write(&usher.config_path, yaml).unwrap();
        usher.signal(libc::SIGHUP);
        refusals += 1;
        common::wait::eventually(common::wait::DEADLINE, "the reload is refused", || {
            usher.log().matches("reload failed").count() == refusals
        });
        let log = usher.log();
        let line = log.lines().rfind(|l| l.contains("reload failed")).unwrap();
        assert!(line.contains("ERROR") && line.contains(why), "{line}");
    };

    reload_refused("", "holds no configuration");
    reload_refused("# all gone\n", "holds no configuration");
    let missing = hooks.path().join("gone");
    reload_refused(
        &running.replace(
            &hooks.path().display().to_string(),
            &missing.display().to_string(),
        ),
        "does not exist",
    );
    let databases = format!(
        "databases:\n  app:\n    host: 127.0.0.1\n    port: {}\n",
        pg.port
    );
    assert!(running.contains(&databases));
    reload_refused(&running.replace(&databases, ""), "lists no database");

    // The running set stayed: alice gets in, the console answers, the hook
    // still refuses bob.
    let (alice, _driver) = usher.alice().await;
    alice.simple_query("SELECT 1").await.unwrap();
    let config = common::console::console_at(usher.port, "SHOW CONFIG")
        .await
        .unwrap();
    assert!(!config.is_empty());
    bob_refused().await;

    // Said on purpose, no hook files is a reload like any other.
    std::fs::write(
        &usher.config_path,
        running.replace(
            &format!("dir: {}\n", hooks.path().display()),
            &format!("dir: {}\n  allow_empty: true\n", missing.display()),
        ),
    )
    .unwrap();
    usher.signal(libc::SIGHUP);
    wait_for_async(
        common::wait::DEADLINE,
        "bob gets in without the hook",
        || async {
            tokio_postgres::connect(&bob, tokio_postgres::NoTls)
                .await
                .map(|_| ())
        },
    )
    .await;
    assert_eq!(usher.log().matches("reload failed").count(), refusals);

    // `usher check` and a start refuse an empty file too.
    let empty = hooks.path().join("empty.yaml");
    std::fs::write(&empty, "\n").unwrap();
    for command in [&["check"][..], &[]] {
        let out = usher_cli()
            .args(command)
            .arg("--config")
            .arg(&empty)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{command:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("empty.yaml") && err.contains("holds no configuration"),
            "{err}"
        );
    }
}

/// The configuration the quickstart runs (and the README's tour uses) stays
/// valid, with the repository's example hooks.
#[test]
fn the_shipped_configuration_is_valid() {
    let out = usher_cli()
        .args(["check", "--config", "config/usher.yaml"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn check_validates_and_names_file_and_key() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.yaml");
    std::fs::write(&good, "databases:\n  app: {}\n").unwrap();
    let out = usher_cli()
        .args(["check", "--config"])
        .arg(&good)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, "databases:\n  app:\n    port: not-a-port\n").unwrap();
    let out = usher_cli()
        .args(["check", "--config"])
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bad.yaml"), "{err}");
    assert!(err.contains("databases.app.port"), "{err}");
    assert!(err.contains("expected u16"), "{err}");

    std::fs::write(&bad, "pool_sise: 5\n").unwrap();
    let out = usher_cli()
        .args(["check", "--config"])
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown field `pool_sise`"));

    let out = usher_cli()
        .args(["check", "--config", "/nonexistent.yaml"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent.yaml"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_result_is_not_held_in_memory_whole() {
    let pg = PgCluster::shared();
    let usher = UsherProcess::builder(pg)
        .extra("pool_mode: transaction\n")
        .start();
    let (c, _driver) = usher.alice().await;
    let before = common::status_kb(usher.child.id(), "VmHWM");
    // About 300 MB of rows; the client reads them slowly at first so that
    // usher must hold back rather than buffer.
    let rows = c
        .query_raw(
            "SELECT g, repeat('y', 300) FROM generate_series(1, 1000000) g",
            std::iter::empty::<i32>(),
        )
        .await
        .unwrap();
    futures_util::pin_mut!(rows);
    let mut n = 0u64;
    while let Some(_row) = futures_util::TryStreamExt::try_next(&mut rows)
        .await
        .unwrap()
    {
        n += 1;
        if n == 10 {
            // A slow reader on purpose: usher must hold back meanwhile.
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    assert_eq!(n, 1_000_000);
    let after = common::status_kb(usher.child.id(), "VmHWM");
    assert!(
        after < before + 64 * 1024,
        "usher's peak memory grew from {before} kB to {after} kB while streaming ~300 MB"
    );
}

/// psql's query: a text of its own, so that another test's sleep on the
/// shared cluster is not taken for it (Ctrl-C before psql has sent its
/// query cancels nothing).
const PSQL_SLEEP: &str = "SELECT pg_sleep(30) AS psql_ctrl_c";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn psql_ctrl_c_cancels_through_usher() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "pool_mode: transaction\n").await;
    let port = usher.addr.port().to_string();
    let child = tokio::process::Command::new("psql")
        .args([
            "-X",
            "-h",
            "127.0.0.1",
            "-p",
            &port,
            "-U",
            "alice",
            "-d",
            "app",
            "-c",
            PSQL_SLEEP,
        ])
        .env("PGPASSWORD", ALICE_PASSWORD)
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until the query runs on the server, then press Ctrl-C.
    pg.wait_until_active(PSQL_SLEEP).await;
    let started = Instant::now();
    unsafe { libc::kill(child.id().unwrap() as i32, libc::SIGINT) };
    let out = tokio::time::timeout(Duration::from_secs(10), child.wait_with_output())
        .await
        .expect("psql ends")
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("canceling statement due to user request"),
        "{stderr}"
    );
    assert!(started.elapsed() < Duration::from_secs(10));
}

const WRONG_PASSWORD: &str = "not-alices-pw";

/// usher as a child process with the whole configuration given (it must
/// say `listen: 127.0.0.1:0`, as `usher_yaml` does); `USHER_LOG` is not
/// passed on, so `log.*` applies.
fn logged_usher(yaml: &str) -> UsherProcess {
    UsherProcess::builder_yaml(yaml)
        .env_remove("USHER_LOG")
        .start()
}

/// Scrapes until `prefix`'s value is `want` (or panics after 10 s).
async fn scrape_until(port: u16, prefix: &str, want: f64) -> String {
    wait_for_async(
        Duration::from_secs(10),
        &format!("{prefix} becomes {want}"),
        || async {
            let text = scrape(port).await;
            if metric(&text, prefix) == Some(want) {
                Ok(text)
            } else {
                Err(text)
            }
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_endpoint_moves_with_traffic() {
    let pg = PgCluster::shared();
    // A database whose server takes the TCP connection and never answers:
    // server connections to it stay in login until server_connect_timeout.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_port = silent.local_addr().unwrap().port();
    let yaml = common::usher_yaml(pg, "pool_mode: transaction\n").replace(
        "databases:\n",
        &format!(
            "databases:\n  silent:\n    host: 127.0.0.1\n    port: {silent_port}\n    server_connect_timeout: 2\n    query_wait_timeout: 2\n"
        ),
    );
    let usher = UsherProcess::builder_yaml(&yaml)
        .env_remove("USHER_LOG")
        .metrics()
        .start();
    let metrics_port = usher.metrics_port.unwrap();
    let conn = usher.conn_str("alice", ALICE_PASSWORD, "app");
    let (c, driver) = tokio_postgres::connect(&conn, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(driver);
    c.simple_query("SELECT 1").await.unwrap();
    let pool = r#"{database="app",user="alice"}"#;
    let value = |text: &str, name: &str| -> f64 {
        let prefix = format!("{name}{pool}");
        metric(text, &prefix).unwrap_or_else(|| panic!("no {prefix} in\n{text}"))
    };
    // The server connection goes back (and the gauges and the transaction
    // time are recorded) just after the client has its answer.
    let xact_count = format!("usher_pool_transaction_seconds_count{pool}");
    let before = scrape_until(metrics_port, &xact_count, 1.0).await;
    assert!(
        metric(&before, "usher_clients_connected") >= Some(1.0),
        "{before}"
    );
    assert!(
        metric(&before, "usher_process_resident_memory_bytes") > Some(1e6),
        "{before}"
    );
    assert_eq!(value(&before, "usher_pool_clients_active"), 0.0);
    assert_eq!(value(&before, "usher_pool_servers_login"), 0.0);

    // Ten transactions of one query each.
    for _ in 0..10 {
        c.simple_query("SELECT 1").await.unwrap();
    }
    let after = scrape_until(metrics_port, &xact_count, 11.0).await;
    for (name, moved) in [
        ("usher_transactions_total", 10.0),
        ("usher_queries_total", 10.0),
        ("usher_pool_transaction_seconds_count", 10.0),
    ] {
        assert_eq!(
            value(&after, name),
            value(&before, name) + moved,
            "{name}:\n{after}"
        );
    }
    for name in [
        "usher_client_received_bytes_total",
        "usher_client_sent_bytes_total",
    ] {
        // At least the ten queries' Query messages (5 + 9 bytes), and their
        // answers (larger).
        assert!(
            value(&after, name) >= value(&before, name) + 140.0,
            "{name}:\n{after}"
        );
    }
    assert!(
        after.contains(
            r#"usher_pool_transaction_seconds_bucket{database="app",user="alice",le="0.001"}"#
        ),
        "a histogram with buckets:\n{after}"
    );
    assert_eq!(
        metric(
            &after,
            r#"usher_pool_servers_idle{database="app",user="alice"}"#
        ),
        Some(1.0),
        "{after}"
    );
    assert!(after.contains("usher_pool_wait_seconds_bucket"), "{after}");

    // A client inside a transaction holds a server connection.
    c.simple_query("BEGIN").await.unwrap();
    let text = scrape(metrics_port).await;
    assert_eq!(value(&text, "usher_pool_clients_active"), 1.0, "{text}");
    assert_eq!(value(&text, "usher_pool_servers_active"), 1.0, "{text}");
    c.simple_query("COMMIT").await.unwrap();
    let active = format!("usher_pool_clients_active{pool}");
    scrape_until(metrics_port, &active, 0.0).await;

    // Errors by SQLSTATE class: the server's syntax error (42601), usher's
    // wrong password (28P01).
    let server_42 = r#"usher_errors_total{class="42",source="server"}"#;
    let usher_28 = r#"usher_errors_total{class="28",source="usher"}"#;
    let e = c.simple_query("SELEC 1").await.unwrap_err();
    assert_eq!(sqlstate(&e).as_deref(), Some("42601"));
    assert!(tokio_postgres::connect(
        &usher.conn_str("alice", WRONG_PASSWORD, "app"),
        tokio_postgres::NoTls,
    )
    .await
    .is_err());
    let text = scrape(metrics_port).await;
    assert_eq!(metric(&text, server_42), Some(1.0), "{text}");
    assert_eq!(metric(&text, usher_28), Some(1.0), "{text}");
    assert!(
        metric(
            &text,
            r#"usher_auth_attempts_total{outcome="wrong_password"}"#
        ) >= Some(1.0),
        "{text}"
    );
    assert!(
        metric(&text, r#"usher_auth_attempts_total{outcome="success"}"#) >= Some(1.0),
        "{text}"
    );

    // A login to the silent database waits while its first server
    // connection is in login, then fails with 08006 from usher.
    let silent_conn = usher.conn_str("alice", ALICE_PASSWORD, "silent");
    let login = tokio::spawn(async move {
        tokio_postgres::connect(&silent_conn, tokio_postgres::NoTls)
            .await
            .map(|_| ())
    });
    let login_gauge = r#"usher_pool_servers_login{database="silent",user="alice"}"#;
    let text = scrape_until(metrics_port, login_gauge, 1.0).await;
    assert!(
        metric(&text, "usher_clients_connected") >= Some(2.0),
        "{text}"
    );
    let e = login
        .await
        .unwrap()
        .expect_err("the silent database fails the login");
    assert_eq!(sqlstate(&e).as_deref(), Some("08006"), "{e:?}");
    let text = scrape(metrics_port).await;
    assert_eq!(metric(&text, login_gauge), Some(0.0), "{text}");
    assert!(
        metric(&text, r#"usher_errors_total{class="08",source="usher"}"#) >= Some(1.0),
        "{text}"
    );
    // No label carries a client address or an unknown user name.
    assert!(!text.contains("127.0.0.1"), "{text}");
    drop(silent);
}

/// Waits until the log has a line containing `what`; returns the log.
async fn log_until(usher: &UsherProcess, what: &str) -> String {
    wait_for_async(
        Duration::from_secs(10),
        &format!("{what:?} in the log"),
        || async {
            let log = usher.log();
            if log.contains(what) {
                Ok(log)
            } else {
                Err(log)
            }
        },
    )
    .await
}

/// The number after `name=` in `line`.
fn field(line: &str, name: &str) -> u64 {
    let at = line
        .find(&format!(" {name}="))
        .unwrap_or_else(|| panic!("no {name} in {line}"));
    line[at + name.len() + 2..]
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .unwrap()
        .parse()
        .unwrap_or_else(|_| panic!("{name} is not a number in {line}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_events_are_logged_as_configured() {
    let pg = PgCluster::shared();
    for (extra, on) in [
        ("", true),
        (
            "log:\n  connections: false\n  disconnections: false\n",
            false,
        ),
    ] {
        let usher = logged_usher(&common::usher_yaml(pg, extra));
        let (c, driver) = tokio_postgres::connect(
            &usher.conn_str("alice", ALICE_PASSWORD, "app"),
            tokio_postgres::NoTls,
        )
        .await
        .unwrap();
        let driver = tokio::spawn(driver);
        c.simple_query("SELECT repeat('x', 1000)").await.unwrap();
        assert!(tokio_postgres::connect(
            &usher.conn_str("alice", WRONG_PASSWORD, "app"),
            tokio_postgres::NoTls,
        )
        .await
        .is_err());
        drop(c);
        driver.await.unwrap().unwrap();
        // The client has left when only the console's own connection is
        // counted; its disconnect line (if any) is written by then.
        let (console, console_driver) = tokio_postgres::connect(
            &usher.conn_str("admin", "admin-pw", "usher"),
            tokio_postgres::NoTls,
        )
        .await
        .unwrap();
        tokio::spawn(console_driver);
        wait_for_async(Duration::from_secs(10), "the client leaves", || async {
            let used = console
                .simple_query("SHOW LISTS")
                .await
                .unwrap()
                .into_iter()
                .find_map(|m| match m {
                    tokio_postgres::SimpleQueryMessage::Row(r)
                        if r.get(0) == Some("used_clients") =>
                    {
                        r.get(1).map(str::to_string)
                    }
                    _ => None,
                });
            if used.as_deref() == Some("1") {
                Ok(())
            } else {
                Err(used)
            }
        })
        .await;
        let log = log_until(&usher, "usher is accepting connections").await;
        assert!(
            !log.contains(ALICE_PASSWORD),
            "a password in the log:\n{log}"
        );
        assert!(
            !log.contains(WRONG_PASSWORD),
            "a password in the log:\n{log}"
        );
        if !on {
            for line in [
                "connection accepted",
                "login ok",
                "login failed",
                "client disconnected",
            ] {
                assert!(!log.contains(line), "{line:?} with the keys off:\n{log}");
            }
            continue;
        }
        assert!(log.contains("connection accepted"), "{log}");
        assert!(log.contains("login ok"), "{log}");
        let failed = log
            .lines()
            .find(|l| l.contains("login failed"))
            .unwrap_or_else(|| panic!("no failed login in\n{log}"));
        assert!(failed.contains("outcome=wrong_password"), "{failed}");
        let gone = log
            .lines()
            .find(|l| l.contains("client disconnected"))
            .unwrap_or_else(|| panic!("no disconnect in\n{log}"));
        assert!(
            gone.contains("user=alice") && gone.contains("reason=client"),
            "{gone}"
        );
        let _ = field(gone, "duration_ms");
        assert!(field(gone, "bytes_received") >= 30, "{gone}");
        assert!(field(gone, "bytes_sent") >= 1000, "{gone}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_columns_match_pgbouncer_and_stats_move() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "pool_mode: transaction\n").await;
    let c = usher.alice().await;
    for _ in 0..5 {
        c.simple_query("SELECT 1").await.unwrap();
    }
    let (columns, rows) = console_table(&usher, "SHOW POOLS").await;
    assert_eq!(
        columns,
        "database user cl_active cl_waiting cl_active_cancel_req cl_waiting_cancel_req sv_active sv_active_cancel sv_being_canceled sv_idle sv_used sv_tested sv_login maxwait maxwait_us pool_mode load_balance_hosts"
            .split(' ')
            .collect::<Vec<_>>()
    );
    assert_eq!(rows.len(), 1);
    let (columns, rows) = console_table(&usher, "SHOW STATS").await;
    assert_eq!(
        columns,
        "database total_server_assignment_count total_xact_count total_query_count total_received total_sent total_xact_time total_query_time total_wait_time total_client_parse_count total_server_parse_count total_bind_count avg_server_assignment_count avg_xact_count avg_query_count avg_recv avg_sent avg_xact_time avg_query_time avg_wait_time avg_client_parse_count avg_server_parse_count avg_bind_count"
            .split(' ')
            .collect::<Vec<_>>()
    );
    let app = rows
        .iter()
        .find(|r| r[0] == "app")
        .expect("a row for database app");
    let col = |name: &str| -> u64 {
        app[columns.iter().position(|c| c == name).unwrap()]
            .parse()
            .unwrap()
    };
    assert!(col("total_xact_count") >= 5, "{app:?}");
    assert!(col("total_query_count") >= 5, "{app:?}");
    assert!(
        col("total_received") > 0 && col("total_sent") > 0,
        "{app:?}"
    );
    let before = col("total_query_count");
    c.simple_query("SELECT 2").await.unwrap();
    let (_, rows) = console_table(&usher, "SELECT STATS").await;
    let app = rows.iter().find(|r| r[0] == "app").unwrap();
    assert_eq!(
        app[3].parse::<u64>().unwrap(),
        before + 1,
        "SELECT is an alias of SHOW; the count moved"
    );
    let (columns, _) = console_table(&usher, "SHOW STATS_TOTALS").await;
    assert_eq!(
        columns[..4],
        [
            "database",
            "server_assignment_count",
            "xact_count",
            "query_count"
        ]
    );
    let (columns, rows) = console_table(&usher, "SHOW DATABASES").await;
    assert_eq!(columns[0], "name");
    assert_eq!(columns.last().unwrap(), "disabled");
    assert!(rows.iter().any(|r| r[0] == "app"));
    let (_, rows) = console_table(&usher, "SHOW CONFIG").await;
    assert!(
        rows.iter()
            .any(|r| r[0] == "pool_mode" && r[1] == "transaction"),
        "{rows:?}"
    );
}

/// What a PgBouncer exporter (e.g. prometheus-community's) asks and how it
/// reads the answers: each command in simple protocol, with or without a
/// trailing semicolon; SHOW VERSION has one `version` column; SHOW LISTS
/// two columns whose items are numbers; SHOW CONFIG four columns with
/// `max_client_conn` a number; the metric columns of DATABASES,
/// STATS_TOTALS and POOLS numbers (or NULL).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pgbouncer_exporters_queries_all_answer_in_its_shapes() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "pool_mode: transaction\n").await;
    usher.alice().await.batch_execute("SELECT 1").await.unwrap();
    let number = |command: &str, column: &str, value: &str| {
        assert!(
            value.is_empty() || value.parse::<f64>().is_ok(),
            "{command}: {column} = {value:?} is not a number"
        )
    };
    let (columns, _) = console_table(&usher, "SHOW STATS").await;
    assert!(!columns.is_empty());
    let (columns, rows) = console_table(&usher, "SHOW VERSION;").await;
    assert_eq!(columns, ["version"]);
    assert_eq!(rows.len(), 1);
    let (columns, rows) = console_table(&usher, "SHOW LISTS;").await;
    assert_eq!(columns, ["list", "items"]);
    for r in &rows {
        number("SHOW LISTS", &r[0], &r[1]);
    }
    let (columns, rows) = console_table(&usher, "SHOW CONFIG;").await;
    assert_eq!(columns, ["key", "value", "default", "changeable"]);
    let max = rows.iter().find(|r| r[0] == "max_client_conn").unwrap();
    number("SHOW CONFIG", "max_client_conn", &max[1]);
    for (command, metrics) in [
        (
            "SHOW DATABASES;",
            &[
                "pool_size",
                "max_connections",
                "current_connections",
                "paused",
                "disabled",
            ][..],
        ),
        (
            "SHOW STATS_TOTALS;",
            &[
                "query_count",
                "query_time",
                "bytes_received",
                "bytes_sent",
                "wait_time",
                "xact_count",
                "xact_time",
                "client_parse_count",
                "server_parse_count",
                "bind_count",
            ][..],
        ),
        (
            "SHOW POOLS;",
            &[
                "cl_active",
                "cl_active_cancel_req",
                "cl_waiting",
                "cl_waiting_cancel_req",
                "sv_active",
                "sv_active_cancel",
                "sv_being_canceled",
                "sv_idle",
                "sv_used",
                "sv_tested",
                "sv_login",
                "maxwait",
            ][..],
        ),
    ] {
        let (columns, rows) = console_table(&usher, command).await;
        assert!(!rows.is_empty(), "{command} has rows");
        for metric in metrics {
            let i = columns
                .iter()
                .position(|c| c == metric)
                .unwrap_or_else(|| panic!("{command} has no column {metric}: {columns:?}"));
            for r in &rows {
                number(command, metric, &r[i]);
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_shutdown_answers_then_closes_the_console_and_exits() {
    let pg = PgCluster::shared();
    let mut usher = UsherProcess::builder(pg)
        .extra("shutdown_timeout: 30\n")
        .start();
    let admin = format!(
        "host=127.0.0.1 port={} user=admin password=admin-pw dbname=pgbouncer",
        usher.port
    );
    let (c, driver) = tokio_postgres::connect(&admin, tokio_postgres::NoTls)
        .await
        .unwrap();
    let driver = tokio::spawn(driver);
    let started = Instant::now();
    let replies = c.simple_query("SHUTDOWN").await.expect("SHUTDOWN answers");
    assert!(matches!(
        replies.last(),
        Some(tokio_postgres::SimpleQueryMessage::CommandComplete(_))
    ));
    // The console connection itself is ended (57P01), so it does not hold
    // the exit up until shutdown_timeout.
    let e = driver.await.unwrap().expect_err("the console is closed");
    assert_eq!(sqlstate(&e).as_deref(), Some("57P01"), "{e:?}");
    assert!(wait_exit(&mut usher), "usher exits cleanly");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "usher waited for its own console client"
    );
}
