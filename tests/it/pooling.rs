//! The pooler end to end: queries, transactions, COPY, large results and
//! pooling behaviour in session and transaction mode, through usher against
//! a real PostgreSQL.

use crate::common;

use crate::common::{backend_pid, PgCluster, Usher};
use futures_util::{pin_mut, SinkExt, TryStreamExt};

const MODES: [&str; 2] = ["session", "transaction"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simple_and_extended_queries_in_both_modes() {
    let pg = PgCluster::shared();
    for mode in MODES {
        let usher = Usher::start(pg, &format!("pool_mode: {mode}\n")).await;
        let c = usher.alice().await;
        // Simple protocol.
        let rows = c
            .simple_query("SELECT 1 AS one; SELECT 'two'")
            .await
            .unwrap();
        let values: Vec<String> = rows
            .iter()
            .filter_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => Some(r.get(0).unwrap().to_string()),
                _ => None,
            })
            .collect();
        assert_eq!(values, ["1", "two"], "{mode}");
        // Extended protocol with parameters (unnamed statements via query_typed).
        let row = c
            .query_typed_raw(
                "SELECT $1::int + $2::int",
                vec![
                    (
                        &20i32 as &(dyn tokio_postgres::types::ToSql + Sync),
                        tokio_postgres::types::Type::INT4,
                    ),
                    (&22i32, tokio_postgres::types::Type::INT4),
                ],
            )
            .await
            .unwrap();
        pin_mut!(row);
        let first = row.try_next().await.unwrap().unwrap();
        assert_eq!(first.get::<_, i32>(0), 42, "{mode}");
        // Prepared (named by tokio-postgres) within one connection works in session mode,
        // and a pipeline of several queries sent at once works in both.
        let (a, b, d) = tokio::join!(
            c.query_one("SELECT $1::text", &[&"a"]),
            c.query_one("SELECT $1::text", &[&"b"]),
            c.query_one("SELECT $1::text", &[&"d"]),
        );
        assert_eq!(
            (
                a.unwrap().get::<_, String>(0),
                b.unwrap().get::<_, String>(0),
                d.unwrap().get::<_, String>(0)
            ),
            ("a".into(), "b".into(), "d".into()),
            "{mode}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactions_and_an_error_inside_one() {
    let pg = PgCluster::shared();
    for mode in MODES {
        let usher = Usher::start(pg, &format!("pool_mode: {mode}\npool_size: 1\n")).await;
        let mut c = usher.alice().await;
        let table = format!("tx_{mode}");
        c.batch_execute(&format!(
            "DROP TABLE IF EXISTS {table}; CREATE TABLE {table} (v int)"
        ))
        .await
        .unwrap();
        let tx = c.transaction().await.unwrap();
        tx.execute(&format!("INSERT INTO {table} VALUES (1)"), &[])
            .await
            .unwrap();
        let err = tx.execute("SELECT 1/0", &[]).await.unwrap_err();
        assert_eq!(common::sqlstate(&err).as_deref(), Some("22012"));
        // The transaction is aborted: further statements fail until rollback.
        let err = tx.execute("SELECT 1", &[]).await.unwrap_err();
        assert_eq!(common::sqlstate(&err).as_deref(), Some("25P02"));
        tx.rollback().await.unwrap();
        let n: i64 = c
            .query_one(&format!("SELECT count(*) FROM {table}"), &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(n, 0, "{mode}: the rolled back insert is gone");
        let tx = c.transaction().await.unwrap();
        tx.execute(&format!("INSERT INTO {table} VALUES (2)"), &[])
            .await
            .unwrap();
        tx.commit().await.unwrap();
        let n: i64 = c
            .query_one(&format!("SELECT count(*) FROM {table}"), &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(n, 1, "{mode}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copy_in_and_out() {
    let pg = PgCluster::shared();
    for mode in MODES {
        let usher = Usher::start(pg, &format!("pool_mode: {mode}\n")).await;
        let c = usher.alice().await;
        let table = format!("copy_{mode}");
        c.batch_execute(&format!(
            "DROP TABLE IF EXISTS {table}; CREATE TABLE {table} (id int, name text)"
        ))
        .await
        .unwrap();
        let sink = c
            .copy_in(&format!("COPY {table} FROM STDIN"))
            .await
            .unwrap();
        pin_mut!(sink);
        let mut data = String::new();
        for i in 0..5000 {
            data.push_str(&format!("{i}\tname-{i}\n"));
        }
        sink.send(bytes::Bytes::from(data.clone())).await.unwrap();
        let copied = sink.finish().await.unwrap();
        assert_eq!(copied, 5000, "{mode}");
        let stream = c
            .copy_out(&format!("COPY {table} TO STDOUT"))
            .await
            .unwrap();
        let chunks: Vec<bytes::Bytes> = stream.try_collect().await.unwrap();
        let out: Vec<u8> = chunks.concat();
        assert_eq!(String::from_utf8(out).unwrap(), data, "{mode}");
    }
}

/// tokio-postgres (as libpq) sends a Sync right after the Execute of a
/// COPY FROM STDIN, which PostgreSQL ignores in COPY IN mode: it owes no
/// ReadyForQuery, and the server connection goes back to the pool at the
/// end of the COPY's transaction as after any other (pool_size 1: the
/// next client gets it, the same backend).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_in_gives_its_server_connection_back() {
    let pg = PgCluster::shared();
    let usher = Usher::start(
        pg,
        "pool_mode: transaction\npool_size: 1\nquery_wait_timeout: 10\n",
    )
    .await;
    let a = usher.alice().await;
    let b = usher.alice().await;
    a.batch_execute("DROP TABLE IF EXISTS copy_back; CREATE TABLE copy_back (v int)")
        .await
        .unwrap();
    for round in 0..3 {
        let sink = a.copy_in("COPY copy_back FROM STDIN").await.unwrap();
        pin_mut!(sink);
        sink.send(bytes::Bytes::from("1\n2\n")).await.unwrap();
        assert_eq!(sink.finish().await.unwrap(), 2, "round {round}");
        let after_copy = backend_pid(&a).await;
        let other = tokio::time::timeout(std::time::Duration::from_secs(20), backend_pid(&b))
            .await
            .expect("the other client got the server connection");
        assert_eq!(other, after_copy, "round {round}: one server connection");
    }
    let n: i64 = b
        .query_one("SELECT count(*) FROM copy_back", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_million_rows_stream_through() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "pool_mode: transaction\n").await;
    let c = usher.alice().await;
    let rows = c
        .query_raw(
            "SELECT g, repeat('x', 50) FROM generate_series(1, 1000000) g",
            std::iter::empty::<i32>(),
        )
        .await
        .unwrap();
    pin_mut!(rows);
    let mut count = 0u64;
    let mut sum = 0i64;
    while let Some(row) = rows.try_next().await.unwrap() {
        count += 1;
        sum += row.get::<_, i32>(0) as i64;
    }
    assert_eq!(count, 1_000_000);
    assert_eq!(sum, 500_000_500_000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_mode_shares_a_backend_and_session_mode_does_not() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "pool_mode: transaction\npool_size: 1\n").await;
    let (a, b) = (usher.alice().await, usher.alice().await);
    assert_eq!(
        backend_pid(&a).await,
        backend_pid(&b).await,
        "transaction mode: one server connection serves both"
    );

    let usher = Usher::start(pg, "pool_mode: session\npool_size: 2\n").await;
    let (a, b) = (usher.alice().await, usher.alice().await);
    let (pa, pb) = (backend_pid(&a).await, backend_pid(&b).await);
    assert_ne!(
        pa, pb,
        "session mode: each client has its own server connection"
    );
    assert_eq!(
        backend_pid(&a).await,
        pa,
        "session mode: the same one for the client's life"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_mode_keeps_the_server_during_a_transaction() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "pool_mode: transaction\npool_size: 2\n").await;
    let mut a = usher.alice().await;
    let b = usher.alice().await;
    let tx = a.transaction().await.unwrap();
    let pid_in_tx = backend_pid(&tx).await;
    // While a's transaction is open, b must get the other connection.
    assert_ne!(backend_pid(&b).await, pid_in_tx);
    assert_eq!(
        backend_pid(&tx).await,
        pid_in_tx,
        "the transaction stays on its server"
    );
    tx.commit().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_mid_transaction_never_returns_a_dirty_server() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "pool_mode: transaction\npool_size: 1\n").await;
    {
        let a = usher.alice().await;
        a.batch_execute(
            "BEGIN; CREATE TEMP TABLE dirty (v int); SELECT pg_advisory_xact_lock(4242)",
        )
        .await
        .unwrap();
        // `a` drops here without COMMIT: the connection closes mid-transaction.
    }
    let b = usher.alice().await;
    // The next client must not find itself inside a's transaction.
    let in_tx: bool = b
        .query_one("SELECT count(*) > 0 FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    assert!(!in_tx, "a's advisory lock (and transaction) must be gone");
    let err = b.simple_query("COMMIT").await.map(|m| m.len());
    assert!(err.is_ok());
    let temp: i64 = b
        .query_one("SELECT count(*) FROM pg_class WHERE relname = 'dirty'", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(temp, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_mode_resets_the_server_between_clients() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "pool_mode: session\npool_size: 1\n").await;
    let pid = {
        let a = usher.alice().await;
        a.batch_execute("CREATE TEMP TABLE mine (v int); SET work_mem = '7MB'")
            .await
            .unwrap();
        backend_pid(&a).await
    };
    // The server connection is back in the pool.
    common::console::wait_pool(usher.addr.port(), "alice", "sv_idle", "1").await;
    let b = usher.alice().await;
    assert_eq!(
        backend_pid(&b).await,
        pid,
        "the server connection is reused"
    );
    let wm: String = b.query_one("SHOW work_mem", &[]).await.unwrap().get(0);
    assert_ne!(
        wm, "7MB",
        "DISCARD ALL reset the previous client's settings"
    );
    let temp: i64 = b
        .query_one("SELECT count(*) FROM pg_class WHERE relname = 'mine'", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(temp, 0);
}

/// A client that pipelines (tokio-postgres sends every query at once and
/// reads the answers as they come) with large requests and large answers:
/// usher keeps reading the server while its writes to the server wait, or
/// the server (blocked on its output) and usher (blocked on its input)
/// would wait for each other forever. PostgreSQL alone serves this.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipelining_client_with_large_requests_and_answers_does_not_stall() {
    let pg = PgCluster::shared();
    for mode in ["transaction", "session"] {
        let usher = Usher::start(pg, &format!("pool_mode: {mode}\n")).await;
        let c = usher.alice().await;
        let stmt = c.prepare("SELECT $1::text || $1::text").await.unwrap();
        let big = "y".repeat(100_000);
        let params: &[&(dyn tokio_postgres::types::ToSql + Sync)] = &[&big];
        let queries: Vec<_> = (0..1000).map(|_| c.query(&stmt, params)).collect();
        let answers = tokio::time::timeout(
            std::time::Duration::from_secs(60),
            futures_util::future::join_all(queries),
        )
        .await
        .unwrap_or_else(|_| panic!("{mode} mode: the pipeline stalled"));
        for rows in answers {
            let value: String = rows.unwrap()[0].get(0);
            assert_eq!(value.len(), 200_000);
        }
    }
}

/// A TCP proxy to the cluster on which every connection after the first
/// starts `delay` late: a server slow to start new backends.
async fn slow_to_connect_proxy(pg_port: u16, delay: std::time::Duration) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        for n in 0.. {
            let Ok((mut client, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                if n > 0 {
                    tokio::time::sleep(delay).await;
                }
                let mut server = tokio::net::TcpStream::connect(("127.0.0.1", pg_port))
                    .await
                    .unwrap();
                let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
            });
        }
    });
    port
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_takes_a_connection_checked_in_while_its_own_opens() {
    use std::time::Duration;
    let pg = PgCluster::shared();
    let proxy = slow_to_connect_proxy(pg.port, Duration::from_secs(60)).await;
    let yaml = common::usher_yaml(pg, "pool_mode: transaction\npool_size: 2\n")
        .replace(&format!("port: {}\n", pg.port), &format!("port: {proxy}\n"));
    let usher = Usher::start_yaml(&yaml).await;
    // alice's login opens the pool's first connection; her transaction
    // holds it.
    let alice = usher.alice().await;
    alice.batch_execute("BEGIN").await.unwrap();
    let alice_pid = backend_pid(&alice).await;
    // Another client of the pool: its query finds a free slot and nothing
    // idle, so a second connection starts opening, a minute away.
    let other = usher.alice().await;
    let other_query = tokio::spawn(async move { backend_pid(&other).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!other_query.is_finished());
    // alice's connection comes back: the other client is served by it, not
    // by the one still opening.
    alice.batch_execute("COMMIT").await.unwrap();
    let other_pid = tokio::time::timeout(Duration::from_secs(20), other_query)
        .await
        .expect("the client waited for the connection still opening")
        .unwrap();
    assert_eq!(other_pid, alice_pid);
}
