//! Named prepared statements and session state in transaction mode, where a
//! client's consecutive transactions land on different server connections.

use crate::common;

use crate::common::{sqlstate, PgCluster, Usher, ALICE_PASSWORD};
use std::collections::HashSet;
use std::process::Command;

async fn pid(c: &tokio_postgres::Client) -> i32 {
    let rows = c.simple_query("SELECT pg_backend_pid()").await.unwrap();
    match &rows[1] {
        tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).unwrap().parse().unwrap(),
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_follows_its_client_to_other_server_connections() {
    let pg = PgCluster::shared();
    // One worker: its idle list is last in, first out, so b's transaction
    // decides which connection a gets (with two, each would keep its own).
    let usher = Usher::start(pg, "pool_mode: transaction\npool_size: 2\nworkers: 1\n").await;
    let mut a = usher.alice().await;
    let mut b = usher.alice().await;
    let stmt = a
        .prepare("SELECT $1::int * 2, pg_backend_pid()")
        .await
        .unwrap();
    let mut pids = HashSet::new();
    for i in 0..20 {
        // b holds one server connection in a transaction every other round,
        // so a's statement must run on whichever connection is free.
        let tx = if i % 2 == 0 {
            Some(b.transaction().await.unwrap())
        } else {
            None
        };
        if let Some(tx) = &tx {
            tx.query_one("SELECT 1", &[]).await.unwrap();
        }
        let row = a.query_one(&stmt, &[&i]).await.unwrap();
        assert_eq!(row.get::<_, i32>(0), i * 2);
        pids.insert(row.get::<_, i32>(1));
        if let Some(tx) = tx {
            tx.commit().await.unwrap();
        }
    }
    assert_eq!(
        pids.len(),
        2,
        "the statement ran on both server connections: {pids:?}"
    );
    // And inside a transaction too.
    let tx = a.transaction().await.unwrap();
    assert_eq!(
        tx.query_one(&stmt, &[&21]).await.unwrap().get::<_, i32>(0),
        42
    );
    tx.commit().await.unwrap();
    let _ = &mut b;
}

/// A client speaking the protocol by hand, to choose statement names.
struct RawClient {
    stream: tokio::net::TcpStream,
    buf: bytes::BytesMut,
}

impl RawClient {
    async fn connect(usher: &Usher) -> RawClient {
        use tokio::io::AsyncWriteExt;
        let mut stream = tokio::net::TcpStream::connect(usher.addr).await.unwrap();
        let mut out = bytes::BytesMut::new();
        postgres_protocol::message::frontend::startup_message(
            [("user", "alice"), ("database", "app")],
            &mut out,
        )
        .unwrap();
        stream.write_all(&out).await.unwrap();
        let mut c = RawClient {
            stream,
            buf: bytes::BytesMut::new(),
        };
        c.until_ready().await;
        c
    }

    /// Reads messages up to ReadyForQuery; returns the text of DataRow
    /// column 0 values and the SQLSTATE of any error.
    async fn until_ready(&mut self) -> (Vec<String>, Option<String>) {
        use postgres_protocol::message::backend::Message;
        use tokio::io::AsyncReadExt;
        let (mut rows, mut error) = (Vec::new(), None);
        loop {
            match Message::parse(&mut self.buf).unwrap() {
                Some(Message::ReadyForQuery(_)) => return (rows, error),
                Some(Message::DataRow(r)) => {
                    let mut ranges = r.ranges();
                    let range = fallible_iterator::FallibleIterator::next(&mut ranges)
                        .unwrap()
                        .unwrap()
                        .unwrap();
                    rows.push(String::from_utf8(r.buffer()[range].to_vec()).unwrap());
                }
                Some(Message::ErrorResponse(e)) => {
                    let mut fields = e.fields();
                    while let Some(f) =
                        fallible_iterator::FallibleIterator::next(&mut fields).unwrap()
                    {
                        if f.type_() == b'C' {
                            error = Some(String::from_utf8_lossy(f.value_bytes()).into_owned());
                        }
                    }
                }
                Some(_) => {}
                None => {
                    assert!(
                        self.stream.read_buf(&mut self.buf).await.unwrap() > 0,
                        "usher closed the connection"
                    );
                }
            }
        }
    }

    async fn send(
        &mut self,
        build: impl FnOnce(&mut bytes::BytesMut),
    ) -> (Vec<String>, Option<String>) {
        use tokio::io::AsyncWriteExt;
        let mut out = bytes::BytesMut::new();
        build(&mut out);
        postgres_protocol::message::frontend::sync(&mut out);
        self.stream.write_all(&out).await.unwrap();
        self.until_ready().await
    }

    /// A simple Query: its rows' first column and its error's SQLSTATE.
    async fn query(&mut self, sql: &str) -> (Vec<String>, Option<String>) {
        use tokio::io::AsyncWriteExt;
        let mut out = bytes::BytesMut::new();
        postgres_protocol::message::frontend::query(sql, &mut out).unwrap();
        self.stream.write_all(&out).await.unwrap();
        self.until_ready().await
    }

    async fn parse(&mut self, name: &str, query: &str) -> Option<String> {
        self.send(|out| {
            postgres_protocol::message::frontend::parse(name, query, std::iter::empty(), out)
                .unwrap()
        })
        .await
        .1
    }

    async fn execute(&mut self, name: &str) -> (Vec<String>, Option<String>) {
        self.execute_with(name, false).await
    }

    /// Bind, Describe of the portal, Execute, Sync: as libpq's
    /// PQexecPrepared (psycopg 3, Ruby pg, PHP PDO) runs a statement.
    async fn execute_described(&mut self, name: &str) -> (Vec<String>, Option<String>) {
        self.execute_with(name, true).await
    }

    async fn execute_with(&mut self, name: &str, describe: bool) -> (Vec<String>, Option<String>) {
        use postgres_protocol::message::frontend;
        self.send(|out| {
            frontend::bind(
                "",
                name,
                std::iter::empty::<i16>(),
                std::iter::empty::<()>(),
                |_, _| {
                    Ok::<_, Box<dyn std::error::Error + Sync + Send>>(
                        postgres_protocol::IsNull::Yes,
                    )
                },
                Some(0),
                out,
            )
            .map_err(|_| ())
            .unwrap();
            if describe {
                frontend::describe(b'P', "", out).unwrap();
            }
            frontend::execute("", 0, out).unwrap();
        })
        .await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_names_in_different_clients_never_collide() {
    let pg = PgCluster::shared();
    let usher = Usher::start(
        pg,
        "pool_mode: transaction\npool_size: 1\nauth: { method: trust }\n",
    )
    .await;
    let mut a = RawClient::connect(&usher).await;
    let mut b = RawClient::connect(&usher).await;
    assert_eq!(a.parse("q", "SELECT 'from a'").await, None);
    assert_eq!(b.parse("q", "SELECT 'from b'").await, None);
    for _ in 0..3 {
        assert_eq!(a.execute("q").await, (vec!["from a".to_string()], None));
        assert_eq!(b.execute("q").await, (vec!["from b".to_string()], None));
    }
    // Re-preparing a name after closing it takes the new text.
    a.send(|out| postgres_protocol::message::frontend::close(b'S', "q", out).unwrap())
        .await;
    assert_eq!(a.parse("q", "SELECT 'a again'").await, None);
    assert_eq!(a.execute("q").await, (vec!["a again".to_string()], None));
    // A name the client never prepared is an error, as on PostgreSQL.
    assert_eq!(a.execute("nope").await.1.as_deref(), Some("26000"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_errors_and_reprepare_behave_as_direct() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "pool_mode: transaction\npool_size: 2\n").await;
    let c = usher.alice().await;
    // A statement that fails to parse leaves nothing behind.
    let e = c.prepare("SELEC 1").await.unwrap_err();
    assert_eq!(sqlstate(&e).as_deref(), Some("42601"));
    let ok = c.prepare("SELECT 1").await.unwrap();
    assert_eq!(c.query_one(&ok, &[]).await.unwrap().get::<_, i32>(0), 1);
    // Dropping a statement closes it; preparing again works.
    drop(ok);
    for _ in 0..3 {
        let s = c.prepare("SELECT 2").await.unwrap();
        assert_eq!(c.query_one(&s, &[]).await.unwrap().get::<_, i32>(0), 2);
    }
    // An error inside a pipeline does not confuse later statements.
    let good = c.prepare("SELECT $1::int").await.unwrap();
    let (bad, fine) = tokio::join!(c.query_one("SELECT 1/0", &[]), c.query_one(&good, &[&5]));
    assert_eq!(sqlstate(&bad.unwrap_err()).as_deref(), Some("22012"));
    assert_eq!(fine.unwrap().get::<_, i32>(0), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deallocate_all_and_discard_all_forget_statements() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "pool_mode: transaction\npool_size: 1\n").await;
    let c = usher.alice().await;
    for command in ["DEALLOCATE ALL", "DISCARD ALL"] {
        let s = c.prepare("SELECT 3").await.unwrap();
        assert_eq!(c.query_one(&s, &[]).await.unwrap().get::<_, i32>(0), 3);
        c.batch_execute(command).await.unwrap();
        let e = c.query_one(&s, &[]).await.unwrap_err();
        assert_eq!(sqlstate(&e).as_deref(), Some("26000"), "{command}: {e:?}");
        let again = c.prepare("SELECT 3").await.unwrap();
        assert_eq!(
            c.query_one(&again, &[]).await.unwrap().get::<_, i32>(0),
            3,
            "{command}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_server_connection_keeps_a_bounded_number_of_statements() {
    let pg = PgCluster::shared();
    let usher = Usher::start(
        pg,
        "pool_mode: transaction\npool_size: 1\nprepared_statements: 3\n",
    )
    .await;
    let c = usher.alice().await;
    let mut statements = Vec::new();
    for i in 0..10 {
        statements.push(c.prepare(&format!("SELECT {i}")).await.unwrap());
    }
    for round in 0..3 {
        for (i, s) in statements.iter().enumerate() {
            assert_eq!(
                c.query_one(s, &[]).await.unwrap().get::<_, i32>(0),
                i as i32,
                "round {round}"
            );
        }
        // Counted in a new transaction, after usher trimmed the connection.
        let rows = c
            .simple_query("SELECT count(*) FROM pg_prepared_statements")
            .await
            .unwrap();
        let n: usize = match &rows[1] {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).unwrap().parse().unwrap(),
            other => panic!("{other:?}"),
        };
        assert!(n <= 3, "round {round}: {n} statements kept on the server");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_feature_named_statements_break_across_servers() {
    let pg = PgCluster::shared();
    let usher = Usher::start(
        pg,
        "pool_mode: transaction\npool_size: 2\nprepared_statements: 0\n",
    )
    .await;
    let a = usher.alice().await;
    let mut b = usher.alice().await;
    let s = a.prepare("SELECT 4").await.unwrap();
    // b takes the server connection the statement lives on.
    let tx = b.transaction().await.unwrap();
    tx.query_one("SELECT 1", &[]).await.unwrap();
    let e = a.query_one(&s, &[]).await.unwrap_err();
    assert_eq!(sqlstate(&e).as_deref(), Some("26000"), "{e:?}");
    tx.commit().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbench_prepared_and_extended_through_a_small_pool() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "pool_mode: transaction\npool_size: 5\n").await;
    let port = usher.addr.port().to_string();
    let report = tokio::task::spawn_blocking(move || {
        let run = |args: &[&str]| {
            let out = Command::new("pgbench")
                .args(["-h", "127.0.0.1", "-p", &port, "-U", "alice"])
                .args(args)
                .arg("app")
                .env("PGPASSWORD", ALICE_PASSWORD)
                .output()
                .unwrap();
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(out.status.success(), "pgbench {args:?}:\n{text}");
            text
        };
        run(&["-i", "-q", "-s", "1"]);
        // In prepared mode pgbench prepares each statement synchronously at
        // its first use, blocking its whole thread until a server connection
        // is free; with several clients per thread and fewer server
        // connections than clients, that thread's other clients (holding
        // those connections mid-transaction) could never go on. Any pooler
        // deadlocks pgbench that way, so prepared mode gets a thread per client.
        vec![
            (
                "prepared",
                run(&["-M", "prepared", "-c", "20", "-j", "20", "-T", "4"]),
            ),
            (
                "extended",
                run(&["-M", "extended", "-c", "20", "-j", "2", "-T", "4"]),
            ),
        ]
    })
    .await
    .unwrap();
    for (mode, text) in report {
        let failed = text
            .lines()
            .find_map(|l| l.strip_prefix("number of failed transactions: "));
        assert_eq!(
            failed.map(|f| f.split_whitespace().next().unwrap()),
            Some("0"),
            "{mode}:\n{text}"
        );
        let processed: u64 = text
            .lines()
            .find_map(|l| l.strip_prefix("number of transactions actually processed: "))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or_else(|| panic!("{mode}: no summary in\n{text}"));
        assert!(processed > 100, "{mode}: {processed}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_settings_follow_each_client_on_a_shared_server() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "pool_mode: transaction\npool_size: 1\n").await;
    let connect = |app: &'static str, path: &'static str| {
        let conn = format!(
            "{} application_name={app} options='-c search_path={path}'",
            usher.conn_str("alice", ALICE_PASSWORD)
        );
        async move {
            let (c, driver) = tokio_postgres::connect(&conn, tokio_postgres::NoTls)
                .await
                .unwrap();
            tokio::spawn(driver);
            c
        }
    };
    let a = connect("app_a", "pg_catalog").await;
    let b = connect("app_b", "information_schema").await;
    let show = "SELECT current_setting('application_name') || '/' || current_setting('search_path') || '/' || current_setting('DateStyle')";
    for i in 0..5 {
        let (ra, rb) = (
            a.query_one(show, &[]).await.unwrap(),
            b.query_one(show, &[]).await.unwrap(),
        );
        let expect_a = if i < 2 {
            "app_a/pg_catalog/ISO, MDY"
        } else {
            "renamed_a/pg_catalog/SQL, DMY"
        };
        assert_eq!(ra.get::<_, String>(0), expect_a, "round {i}");
        assert_eq!(
            rb.get::<_, String>(0),
            "app_b/information_schema/ISO, MDY",
            "round {i}"
        );
        if i == 1 {
            // SET of reported parameters follows the client too.
            a.batch_execute("SET application_name = 'renamed_a'; SET DateStyle = 'SQL, DMY'")
                .await
                .unwrap();
        }
    }
    assert_eq!(pid(&a).await, pid(&b).await);
}

/// DDL that changes a statement's result type makes the server's copy
/// stale ("cached plan must not change result type", 0A000). The first
/// client to meet it gets that error, as a client of its own statement
/// would directly; from then on no client's Parse of that text is matched
/// to the stale server statement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_made_stale_by_ddl_is_prepared_anew() {
    let pg = PgCluster::shared();
    let setup = "DROP TABLE IF EXISTS stale_shape; CREATE TABLE stale_shape (a int); \
                 INSERT INTO stale_shape VALUES (1); GRANT ALL ON stale_shape TO alice";
    pg.psql_super_db("app", setup);
    let usher = Usher::start(pg, "pool_mode: transaction\npool_size: 1\n").await;
    let sql = "SELECT * FROM stale_shape";
    let first = usher.alice().await;
    let stmt = first.prepare(sql).await.unwrap();
    assert_eq!(first.query(&stmt, &[]).await.unwrap()[0].len(), 1);
    pg.psql_super_db(
        "app",
        "DROP TABLE stale_shape; CREATE TABLE stale_shape (a int, b text); \
         INSERT INTO stale_shape VALUES (1, 'x'); GRANT ALL ON stale_shape TO alice",
    );
    // The first use after the DDL may fail with 0A000 (it does directly,
    // for a statement prepared before it).
    let meets_it = usher.alice().await;
    if let Ok(stmt) = meets_it.prepare(sql).await {
        if let Err(e) = meets_it.query(&stmt, &[]).await {
            assert_eq!(sqlstate(&e).as_deref(), Some("0A000"), "{e:?}");
        }
    }
    // After it, every client's Parse gets the new shape.
    for round in 0..3 {
        let c = usher.alice().await;
        let stmt = c.prepare(sql).await.unwrap();
        let rows = c
            .query(&stmt, &[])
            .await
            .unwrap_or_else(|e| panic!("round {round}: {e:?}"));
        assert_eq!(rows[0].len(), 2, "round {round}");
    }
    // The first client prepares again and is fine too.
    let stmt = first.prepare(sql).await.unwrap();
    assert_eq!(first.query(&stmt, &[]).await.unwrap()[0].len(), 2);
}

/// The pool's pinned server connections.
fn pinned(usher: &Usher) -> usize {
    usher
        .app
        .deps
        .pools
        .all()
        .iter()
        .find(|p| p.user == "alice")
        .map_or(0, |p| p.pinned())
}

fn ok() -> (Vec<String>, Option<String>) {
    (Vec::new(), None)
}

fn failed(code: &str) -> (Vec<String>, Option<String>) {
    (Vec::new(), Some(code.to_string()))
}

/// psycopg 3, Rails and PHP PDO prepare at the protocol level and drop a
/// statement with SQL `DEALLOCATE name`. Through usher the server has the
/// statement under usher's name: the DEALLOCATE must forget the client's
/// statement and answer as the server would, in and out of a transaction
/// block, and leave other clients' statements of the same name alone; a
/// name the client never prepared still gets PostgreSQL's own 26000.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_deallocate_forgets_a_protocol_level_statement() {
    let pg = PgCluster::shared();
    let usher = Usher::start(
        pg,
        "pool_mode: transaction\npool_size: 1\nauth: { method: trust }\n",
    )
    .await;
    let mut a = RawClient::connect(&usher).await;
    let mut b = RawClient::connect(&usher).await;
    assert_eq!(a.parse("s1", "SELECT 'a'").await, None);
    assert_eq!(b.parse("s1", "SELECT 'b'").await, None);
    assert_eq!(a.execute("s1").await, (vec!["a".to_string()], None));
    assert_eq!(
        a.query("DEALLOCATE s1").await,
        ok(),
        "as the server answers"
    );
    assert_eq!(a.execute("s1").await, failed("26000"), "forgotten");
    assert_eq!(a.query("DEALLOCATE s1").await, failed("26000"), "gone");
    assert_eq!(b.execute("s1").await, (vec!["b".to_string()], None));
    // DEALLOCATE PREPARE, quoted names, inside a transaction block.
    assert_eq!(a.parse("Mixed", "SELECT 'm'").await, None);
    assert_eq!(a.parse("s2", "SELECT 2").await, None);
    assert_eq!(a.query("BEGIN").await, ok());
    assert_eq!(a.query("DEALLOCATE PREPARE \"Mixed\";").await, ok());
    assert_eq!(a.query("deallocate s2").await, ok());
    assert_eq!(a.query("COMMIT").await, ok());
    assert_eq!(a.execute("Mixed").await, failed("26000"));
    assert_eq!(a.execute("s2").await, failed("26000"));
    // An unquoted name is folded to lower case, as by PostgreSQL.
    assert_eq!(a.parse("s3", "SELECT 3").await, None);
    assert_eq!(a.query("DEALLOCATE S3").await, ok());
    assert_eq!(a.query("DEALLOCATE nope").await, failed("26000"));
    // In a failed transaction block the server's 25P02, and the statement stays.
    assert_eq!(a.parse("s4", "SELECT '4'").await, None);
    assert_eq!(a.query("BEGIN").await, ok());
    assert_eq!(a.query("SELECT 1/0").await, failed("22012"));
    assert_eq!(a.query("DEALLOCATE s4").await, failed("25P02"));
    assert_eq!(a.query("ROLLBACK").await, ok());
    assert_eq!(a.execute("s4").await, (vec!["4".to_string()], None));
    assert_eq!(b.execute("s1").await, (vec!["b".to_string()], None));
    // psycopg 3 sends its DEALLOCATE through the extended protocol (an
    // unnamed Parse, Bind, Describe, Execute), twice in a row here.
    assert_eq!(a.parse("_pg3_0", "SELECT 'x'").await, None);
    for expect in [None, Some("26000".to_string())] {
        let (_, e) = a
            .send(|out| {
                use postgres_protocol::message::frontend;
                frontend::parse("", "DEALLOCATE _pg3_0", std::iter::empty(), out).unwrap();
                frontend::bind(
                    "",
                    "",
                    std::iter::empty::<i16>(),
                    std::iter::empty::<()>(),
                    |_, _| {
                        Ok::<_, Box<dyn std::error::Error + Sync + Send>>(
                            postgres_protocol::IsNull::Yes,
                        )
                    },
                    Some(0),
                    out,
                )
                .map_err(|_| ())
                .unwrap();
                frontend::describe(b'P', "", out).unwrap();
                frontend::execute("", 0, out).unwrap();
            })
            .await;
        assert_eq!(e, expect);
    }
    assert_eq!(a.execute("_pg3_0").await, failed("26000"));
    // A protocol-level statement EXECUTEd in SQL, on a connection without it.
    assert_eq!(a.parse("pe", "SELECT 'pe'").await, None);
    assert_eq!(b.query("DEALLOCATE ALL").await, ok());
    assert_eq!(a.query("EXECUTE pe").await, (vec!["pe".to_string()], None));
    assert_eq!(pinned(&usher), 0);
}

/// SQL-level PREPARE / EXECUTE / DEALLOCATE in transaction mode, two
/// clients on one server connection: each keeps its own statements under
/// the same name, the server never holds the client's name, nothing pins,
/// and a statement is prepared again on demand on a connection without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_prepare_and_execute_follow_their_client_without_pinning() {
    let pg = PgCluster::shared();
    let usher = Usher::start(
        pg,
        "pool_mode: transaction\npool_size: 1\nquery_wait_timeout: 2\nauth: { method: trust }\n",
    )
    .await;
    let mut a = RawClient::connect(&usher).await;
    let mut b = RawClient::connect(&usher).await;
    assert_eq!(
        a.query("PREPARE q (int) AS SELECT ($1 * 2)::text").await,
        ok()
    );
    assert_eq!(pinned(&usher), 0, "a SQL PREPARE no longer pins");
    assert_eq!(b.query("prepare Q as select 'b'").await, ok());
    for i in 0..3 {
        assert_eq!(
            a.query(&format!("EXECUTE q({i})")).await,
            (vec![(i * 2).to_string()], None)
        );
        assert_eq!(b.query("execute q").await, (vec!["b".to_string()], None));
    }
    // The server never has the client's name.
    assert_eq!(
        a.query("SELECT count(*)::text FROM pg_prepared_statements WHERE name = 'q'")
            .await,
        (vec!["0".to_string()], None)
    );
    // As PostgreSQL: a second PREPARE of the name, unknown names.
    assert_eq!(a.query("PREPARE q AS SELECT 1").await, failed("42P05"));
    assert_eq!(a.query("EXECUTE nope").await, failed("26000"));
    assert_eq!(a.query("DEALLOCATE nope").await, failed("26000"));
    // Inside a transaction block, and EXPLAIN EXECUTE.
    assert_eq!(a.query("BEGIN").await, ok());
    assert_eq!(
        a.query("EXECUTE q (5)").await,
        (vec!["10".to_string()], None)
    );
    assert_eq!(a.query("COMMIT").await, ok());
    let (plan, e) = a.query("EXPLAIN (COSTS OFF) EXECUTE q(1)").await;
    assert_eq!((plan.len(), e), (1, None), "{plan:?}");
    // b's DEALLOCATE ALL drops every statement on the server connection:
    // a's is prepared again where it runs next.
    assert_eq!(b.query("DEALLOCATE ALL").await, ok());
    assert_eq!(b.query("EXECUTE q").await, failed("26000"));
    assert_eq!(
        a.query("EXECUTE q(7)").await,
        (vec!["14".to_string()], None)
    );
    // Run by name inside other statements, and among several in one Query.
    assert_eq!(b.query("DEALLOCATE ALL").await, ok());
    assert_eq!(
        a.query("SELECT '1'; EXECUTE q(3)").await,
        (vec!["1".to_string(), "6".to_string()], None)
    );
    assert_eq!(
        a.query("DROP TABLE IF EXISTS sql_prep_ctas; CREATE TABLE sql_prep_ctas AS EXECUTE q(4)")
            .await,
        ok()
    );
    assert_eq!(
        a.query("SELECT * FROM sql_prep_ctas").await,
        (vec!["8".to_string()], None)
    );
    assert_eq!(a.query("DROP TABLE sql_prep_ctas").await, ok());
    // A statement that fails to prepare leaves no name behind.
    assert_eq!(
        a.query("PREPARE bad AS SELECT * FROM no_such_table").await,
        failed("42P01")
    );
    assert_eq!(a.query("EXECUTE bad").await, failed("26000"));
    assert_eq!(a.query("DEALLOCATE q").await, ok());
    assert_eq!(a.query("EXECUTE q(1)").await, failed("26000"));
    assert_eq!(b.query("PREPARE q AS SELECT 'b again'").await, ok());
    assert_eq!(
        b.query("EXECUTE q").await,
        (vec!["b again".to_string()], None)
    );
    assert_eq!(pinned(&usher), 0);
}

/// With two server connections: a client's SQL statement runs on whichever
/// one its transaction gets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sql_prepared_statement_runs_on_any_server_connection() {
    let pg = PgCluster::shared();
    // One worker, for the reason given in the first test of this file.
    let usher = Usher::start(pg, "pool_mode: transaction\npool_size: 2\nworkers: 1\n").await;
    let a = usher.alice().await;
    let b = usher.alice().await;
    a.batch_execute("PREPARE p (int) AS SELECT $1 + 1, pg_backend_pid()")
        .await
        .unwrap();
    let mut pids = HashSet::new();
    for i in 0..10 {
        let holding = i % 2 == 0;
        if holding {
            b.batch_execute("BEGIN; SELECT 1").await.unwrap();
        }
        let rows = a.simple_query(&format!("EXECUTE p({i})")).await.unwrap();
        match &rows[1] {
            tokio_postgres::SimpleQueryMessage::Row(r) => {
                assert_eq!(r.get(0), Some((i + 1).to_string().as_str()));
                pids.insert(r.get(1).unwrap().to_string());
            }
            other => panic!("{other:?}"),
        }
        if holding {
            b.batch_execute("COMMIT").await.unwrap();
        }
    }
    assert_eq!(pids.len(), 2, "ran on both server connections: {pids:?}");
    assert_eq!(pinned(&usher), 0);
}

/// DDL that changes a SQL-prepared statement's result type: outside a
/// transaction block usher prepares it again and runs it, so the client
/// gets the new shape instead of 0A000; inside one the error stands (the
/// block is aborted), as directly, and the next use outside works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_sql_statement_is_prepared_again_and_retried_outside_a_block() {
    let pg = PgCluster::shared();
    let setup = "DROP TABLE IF EXISTS stale_sql; CREATE TABLE stale_sql (a int); \
                 INSERT INTO stale_sql VALUES (1); GRANT ALL ON stale_sql TO alice";
    pg.psql_super_db("app", setup);
    let usher = Usher::start(
        pg,
        "pool_mode: transaction\npool_size: 1\nauth: { method: trust }\n",
    )
    .await;
    let mut a = RawClient::connect(&usher).await;
    assert_eq!(a.query("PREPARE s AS SELECT * FROM stale_sql").await, ok());
    assert_eq!(a.query("EXECUTE s").await, (vec!["1".to_string()], None));
    pg.psql_super_db("app", "ALTER TABLE stale_sql ALTER a TYPE text");
    assert_eq!(
        a.query("EXECUTE s").await,
        (vec!["1".to_string()], None),
        "retried after preparing it again"
    );
    pg.psql_super_db(
        "app",
        "ALTER TABLE stale_sql ALTER a TYPE bigint USING a::bigint",
    );
    // Inside a transaction block: the error, as directly.
    assert_eq!(a.query("BEGIN").await, ok());
    assert_eq!(a.query("EXECUTE s").await, failed("0A000"));
    assert_eq!(a.query("ROLLBACK").await, ok());
    assert_eq!(a.query("EXECUTE s").await, (vec!["1".to_string()], None));
}

/// A protocol-level statement made stale by DDL, run as libpq runs it
/// (Bind, Describe of the portal, Execute, Sync) outside a transaction
/// block: usher prepares it again and runs the segment again, so the client
/// gets the new shape (with its RowDescription) instead of 0A000. Without
/// the Describe (the client would read the rows with a description it
/// kept), and inside a block, the error stands, as directly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_statement_run_as_libpq_runs_it_is_replayed_outside_a_block() {
    let pg = PgCluster::shared();
    pg.psql_super_db(
        "app",
        "DROP TABLE IF EXISTS stale_bind; CREATE TABLE stale_bind (a int); \
         INSERT INTO stale_bind VALUES (1); GRANT ALL ON stale_bind TO alice",
    );
    let usher = Usher::start(
        pg,
        "pool_mode: transaction\npool_size: 1\nauth: { method: trust }\n",
    )
    .await;
    let mut a = RawClient::connect(&usher).await;
    let one = || (vec!["1".to_string()], None);
    assert_eq!(a.parse("s", "SELECT * FROM stale_bind").await, None);
    assert_eq!(a.execute_described("s").await, one());
    pg.psql_super_db("app", "ALTER TABLE stale_bind ALTER a TYPE text");
    assert_eq!(a.execute_described("s").await, one(), "replayed");
    assert_eq!(a.execute_described("s").await, one());
    pg.psql_super_db(
        "app",
        "ALTER TABLE stale_bind ALTER a TYPE bigint USING a::bigint",
    );
    assert_eq!(
        a.execute("s").await,
        failed("0A000"),
        "no Describe: no replay"
    );
    assert_eq!(a.execute("s").await, one(), "prepared afresh");
    pg.psql_super_db("app", "ALTER TABLE stale_bind ALTER a TYPE text");
    assert_eq!(a.query("BEGIN").await, ok());
    assert_eq!(
        a.execute_described("s").await,
        failed("0A000"),
        "in a block"
    );
    assert_eq!(a.query("ROLLBACK").await, ok());
    assert_eq!(a.execute_described("s").await, one());
}

/// An error in a rewritten statement points where it would directly: the
/// position is told in the client's text, not usher's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_position_in_a_carried_statement_is_the_clients() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "pool_mode: transaction\npool_size: 1\n").await;
    let through = usher.alice().await;
    let direct = common::alice_with(pg.port, "").await;
    through
        .batch_execute("PREPARE \"näme\" (int) AS SELECT $1")
        .await
        .unwrap();
    direct
        .batch_execute("PREPARE \"näme\" (int) AS SELECT $1")
        .await
        .unwrap();
    for sql in [
        "PREPARE p1 AS SELECT $1a;",
        "PREPARE p2 AS SELECT 1 +; -- trailing\n",
        "  PREPARE \"a long name\" AS SELECT nope",
        "EXECUTE \"näme\"(1 + )",
        "EXPLAIN EXECUTE \"näme\" (1 +)",
    ] {
        let position = |e: tokio_postgres::Error| match e.as_db_error().and_then(|d| d.position()) {
            Some(tokio_postgres::error::ErrorPosition::Original(p)) => Some(*p),
            _ => None,
        };
        let expected = position(direct.batch_execute(sql).await.unwrap_err());
        assert!(expected.is_some(), "{sql}");
        assert_eq!(
            position(through.batch_execute(sql).await.unwrap_err()),
            expected,
            "{sql}"
        );
    }
}
