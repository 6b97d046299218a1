//! Running usher: cancel requests, waiting for a full pool, pgbench load,
//! graceful shutdown on signals, `usher check`, and memory while a large
//! result streams through.

mod common;

use common::console::console_table;
use common::{sqlstate, PgCluster, Usher, UsherProcess, ALICE_PASSWORD};
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
        let canceller = tokio::spawn(async move {
            let running = "SELECT count(*) FROM pg_stat_activity WHERE query = 'SELECT pg_sleep(30)' AND state = 'active'";
            let deadline = Instant::now() + Duration::from_secs(10);
            while tokio::task::spawn_blocking(move || PgCluster::shared().psql_super(running))
                .await
                .unwrap()
                != "1"
            {
                assert!(Instant::now() < deadline, "the query never started");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            token.cancel_query(tokio_postgres::NoTls).await.unwrap();
        });
        let e = sleeper
            .simple_query("SELECT pg_sleep(30)")
            .await
            .unwrap_err();
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
        busy.query_one("SELECT pg_sleep(1)::text", &[])
            .await
            .map(|_| ())
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
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
    tokio::time::sleep(Duration::from_millis(300)).await;
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
    let mut usher = UsherProcess::start(pg, "pool_mode: transaction\nshutdown_timeout: 20\n");
    let conn = format!(
        "host=127.0.0.1 port={} user=alice password={ALICE_PASSWORD} dbname=app",
        usher.port
    );
    let (mut c, driver) = tokio_postgres::connect(&conn, tokio_postgres::NoTls)
        .await
        .unwrap();
    let driver = tokio::spawn(driver);
    let (idle, idle_driver) = tokio_postgres::connect(&conn, tokio_postgres::NoTls)
        .await
        .unwrap();
    let idle_driver = tokio::spawn(idle_driver);
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
    tokio::time::sleep(Duration::from_millis(500)).await;

    // No new clients are accepted.
    assert!(tokio_postgres::connect(&conn, tokio_postgres::NoTls)
        .await
        .is_err());
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

/// Waits for the usher process to exit; returns whether it exited cleanly.
fn wait_exit(usher: &mut UsherProcess) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(s) = usher.child.try_wait().unwrap() {
            return s.success();
        }
        assert!(Instant::now() < deadline, "usher did not exit");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_waits_for_clients_to_leave() {
    let pg = PgCluster::shared();
    let mut usher = UsherProcess::start(pg, "pool_mode: transaction\nshutdown_timeout: 20\n");
    let conn = format!(
        "host=127.0.0.1 port={} user=alice password={ALICE_PASSWORD} dbname=app",
        usher.port
    );
    let (c, driver) = tokio_postgres::connect(&conn, tokio_postgres::NoTls)
        .await
        .unwrap();
    let driver = tokio::spawn(driver);
    c.batch_execute("SELECT 1").await.unwrap();
    // SIGTERM is PgBouncer's "wait for clients": no new clients, but the
    // connected one keeps working, transaction after transaction.
    usher.signal(libc::SIGTERM);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(tokio_postgres::connect(&conn, tokio_postgres::NoTls)
        .await
        .is_err());
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
    let usher = UsherProcess::start(pg, "pool_mode: transaction\n");
    let conn = format!(
        "host=127.0.0.1 port={} user=alice password={ALICE_PASSWORD} dbname=app",
        usher.port
    );
    let (c, driver) = tokio_postgres::connect(&conn, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(driver);
    c.batch_execute("SELECT 1").await.unwrap();
    usher.signal(libc::SIGUSR1);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let query = tokio::spawn(async move { c.batch_execute("SELECT 1").await });
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
    let usher = UsherProcess::start(pg, "pool_size: 3\n");
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
    let deadline = Instant::now() + Duration::from_secs(10);
    while pool_size().await != "6" {
        assert!(Instant::now() < deadline, "SIGHUP did not reload");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[test]
fn check_validates_and_names_file_and_key() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.yaml");
    std::fs::write(&good, "databases:\n  app: {}\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_usher"))
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
    let out = Command::new(env!("CARGO_BIN_EXE_usher"))
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
    let out = Command::new(env!("CARGO_BIN_EXE_usher"))
        .args(["check", "--config"])
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown field `pool_sise`"));

    let out = Command::new(env!("CARGO_BIN_EXE_usher"))
        .args(["check", "--config", "/nonexistent.yaml"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent.yaml"));
}

/// Peak resident memory of a process, from /proc.
fn peak_rss_kb(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmHWM in /proc/pid/status")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_result_is_not_held_in_memory_whole() {
    let pg = PgCluster::shared();
    let usher = UsherProcess::start(pg, "pool_mode: transaction\n");
    let conn = format!(
        "host=127.0.0.1 port={} user=alice password={ALICE_PASSWORD} dbname=app",
        usher.port
    );
    let (c, driver) = tokio_postgres::connect(&conn, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(driver);
    let before = peak_rss_kb(usher.child.id());
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
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    assert_eq!(n, 1_000_000);
    let after = peak_rss_kb(usher.child.id());
    assert!(
        after < before + 64 * 1024,
        "usher's peak memory grew from {before} kB to {after} kB while streaming ~300 MB"
    );
}

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
            "SELECT pg_sleep(30)",
        ])
        .env("PGPASSWORD", ALICE_PASSWORD)
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until the query runs on the server, then press Ctrl-C.
    let deadline = Instant::now() + Duration::from_secs(10);
    while pg.psql_super("SELECT count(*) FROM pg_stat_activity WHERE query = 'SELECT pg_sleep(30)' AND state = 'active'") != "1" {
        assert!(Instant::now() < deadline, "the query never started");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
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

/// GET /metrics from usher's Prometheus endpoint.
async fn scrape(port: u16) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("metrics endpoint answers");
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).await.unwrap();
    body
}

/// The value of a metric line that starts with `prefix` (name and labels).
fn metric(text: &str, prefix: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_endpoint_moves_with_traffic() {
    let pg = PgCluster::shared();
    let metrics_port = common::free_port();
    let usher = UsherProcess::start(
        pg,
        &format!("pool_mode: transaction\nmetrics:\n  listen: 127.0.0.1:{metrics_port}\n"),
    );
    let conn = format!(
        "host=127.0.0.1 port={} user=alice password={ALICE_PASSWORD} dbname=app",
        usher.port
    );
    let (c, driver) = tokio_postgres::connect(&conn, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(driver);
    c.simple_query("SELECT 1").await.unwrap();
    let before = scrape(metrics_port).await;
    let tx = r#"usher_transactions_total{database="app",user="alice"}"#;
    let first = metric(&before, tx).unwrap_or_else(|| panic!("no {tx} in\n{before}"));
    for _ in 0..10 {
        c.simple_query("SELECT 1").await.unwrap();
    }
    let _ = tokio_postgres::connect(
        &conn.replace(ALICE_PASSWORD, "wrong"),
        tokio_postgres::NoTls,
    )
    .await;
    let after = scrape(metrics_port).await;
    assert_eq!(metric(&after, tx), Some(first + 10.0), "{after}");
    assert!(
        metric(
            &after,
            r#"usher_auth_attempts_total{outcome="wrong_password"}"#
        ) >= Some(1.0),
        "{after}"
    );
    assert!(
        metric(&after, r#"usher_auth_attempts_total{outcome="success"}"#) >= Some(1.0),
        "{after}"
    );
    assert_eq!(
        metric(
            &after,
            r#"usher_pool_servers_idle{database="app",user="alice"}"#
        ),
        Some(1.0),
        "{after}"
    );
    assert!(after.contains("usher_pool_wait_seconds"), "{after}");
    // No label carries a client address or an unknown user name.
    assert!(!after.contains("127.0.0.1"), "{after}");
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
