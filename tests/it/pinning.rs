//! Transaction mode: state a client leaves on its server connection that
//! cannot move to another one (LISTEN, session advisory locks, temporary
//! tables, WITH HOLD cursors) pins the connection to that client until the
//! state is gone or the client leaves; the other client never sees it, and
//! gets the connection as soon as the state is gone. `pinning: error`
//! refuses such statements (0A000) before they reach the server; `off`
//! keeps the old behaviour. Every test runs with pool_size 1 (one with 2),
//! so the clients share one server connection.

use crate::common;

use crate::common::{PgCluster, Usher, ALICE_PASSWORD};
use futures_util::StreamExt;
use std::sync::{Arc, Mutex};
use tokio_postgres::{AsyncMessage, SimpleQueryMessage};

/// A client of usher (or PostgreSQL, by port) and the payloads of the
/// notifications it received.
struct Client {
    c: tokio_postgres::Client,
    notes: Arc<Mutex<Vec<String>>>,
}

async fn connect(port: u16) -> Client {
    let conn =
        format!("host=127.0.0.1 port={port} user=alice password={ALICE_PASSWORD} dbname=app");
    let (c, mut connection) = tokio_postgres::connect(&conn, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| panic!("{conn}: {e:?}"));
    let notes = Arc::new(Mutex::new(Vec::new()));
    let seen = notes.clone();
    tokio::spawn(async move {
        let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(Ok(m)) = messages.next().await {
            if let AsyncMessage::Notification(n) = m {
                seen.lock().unwrap().push(n.payload().to_string());
            }
        }
    });
    Client { c, notes }
}

impl Client {
    /// The single value a query returns (empty for NULL).
    async fn value(&self, sql: &str) -> String {
        let rows = self
            .c
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

    async fn run(&self, sql: &str) {
        self.c
            .simple_query(sql)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e:?}"));
    }

    fn notes(&self) -> Vec<String> {
        self.notes.lock().unwrap().clone()
    }
}

async fn usher(pg: &PgCluster, extra: &str) -> Usher {
    Usher::start(
        pg,
        &format!("pool_mode: transaction\npool_size: 1\n{extra}"),
    )
    .await
}

/// Waits until `n` clients of alice's pool wait for a server connection.
async fn waiting(usher: &Usher, n: usize) {
    common::wait::eventually_async(
        common::wait::DEADLINE,
        &format!("{n} clients wait"),
        || async {
            usher
                .app
                .deps
                .pools
                .all()
                .iter()
                .find(|p| p.user == "alice")
                .is_some_and(|p| p.stats.waiting.load(std::sync::atomic::Ordering::Relaxed) == n)
        },
    )
    .await;
}

/// Waits until the other client `b` waits for the server connection, or
/// is done; if it is done, it ran while the first client held state on
/// the connection: `check` its answer (what it must not have seen), then
/// fail, since it should have waited.
async fn b_waits(
    usher: &Usher,
    b: &mut tokio::task::JoinHandle<(String, Vec<String>)>,
    check: impl Fn(&str, &[String]),
) {
    common::wait::eventually_async(common::wait::DEADLINE, "b waits or is done", || async {
        b.is_finished() || waiting_now(usher) == 1
    })
    .await;
    if b.is_finished() {
        let (value, notes) = b.await.unwrap();
        check(&value, &notes);
        panic!("b ran while the connection held the other client's state");
    }
}

fn waiting_now(usher: &Usher) -> usize {
    usher
        .app
        .deps
        .pools
        .all()
        .iter()
        .find(|p| p.user == "alice")
        .map_or(0, |p| {
            p.stats.waiting.load(std::sync::atomic::Ordering::Relaxed)
        })
}

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

/// Runs `sql` on a client of its own in a task: the other client, which
/// has to wait for the shared server connection.
fn meanwhile(port: u16, sql: &'static str) -> tokio::task::JoinHandle<(String, Vec<String>)> {
    tokio::spawn(async move {
        let b = connect(port).await;
        let v = b.value(sql).await;
        // Whatever reached b by the time it has its answer.
        b.run("SELECT 1").await;
        (v, b.notes())
    })
}

/// The listener receives what is meant for it, even between its
/// transactions; the other client waits for the connection, never gets the
/// notification, and runs on the same backend once the listener UNLISTENs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listen_pins_until_unlisten() {
    let pg = PgCluster::shared();
    let usher = usher(pg, "").await;
    let port = usher.addr.port();
    let a = connect(port).await;
    let pid = a.value("SELECT pg_backend_pid()").await;
    a.run("LISTEN jobs").await;
    assert_eq!(pinned(&usher), 1);
    let direct = connect(pg.port).await;
    direct.run("NOTIFY jobs, 'for a'").await;
    let mut b = meanwhile(port, "SELECT pg_backend_pid()");
    let b_sees_nothing = |_: &str, notes: &[String]| assert!(notes.is_empty(), "b got {notes:?}");
    b_waits(&usher, &mut b, b_sees_nothing).await;
    common::wait::eventually_async(
        common::wait::DEADLINE,
        "a gets its notification",
        || async { a.notes() == ["for a"] },
    )
    .await;
    assert_eq!(a.value("SELECT pg_backend_pid()").await, pid, "a keeps it");
    a.run("UNLISTEN *").await;
    let (b_pid, b_notes) = b.await.unwrap();
    b_sees_nothing(&b_pid, &b_notes);
    assert_eq!(
        b_pid, pid,
        "the connection went to b once a stopped listening"
    );
    assert_eq!(pinned(&usher), 0);
}

/// A session advisory lock stays with its client; the other client's
/// session holds no lock (before, it ran on the backend that held it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_advisory_lock_pins_until_unlock_all() {
    let pg = PgCluster::shared();
    let usher = usher(pg, "").await;
    let port = usher.addr.port();
    let a = connect(port).await;
    let pid = a.value("SELECT pg_backend_pid()").await;
    a.run("SELECT pg_advisory_lock(4242)").await;
    let mut b = meanwhile(
        port,
        "SELECT count(*)::text || ' ' || pg_backend_pid() FROM pg_locks \
         WHERE locktype = 'advisory' AND pid = pg_backend_pid()",
    );
    b_waits(&usher, &mut b, |locks, _| {
        assert!(locks.starts_with("0 "), "b's session holds a lock: {locks}")
    })
    .await;
    let direct = connect(pg.port).await;
    assert_eq!(
        direct.value("SELECT pg_try_advisory_lock(4242)").await,
        "f",
        "a holds it"
    );
    assert_eq!(
        a.value(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
        )
        .await,
        "1",
        "a's lock, in a later transaction"
    );
    a.run("SELECT pg_advisory_unlock_all()").await;
    let (b_locks, _) = b.await.unwrap();
    assert_eq!(b_locks, format!("0 {pid}"), "b: no lock, same backend");
}

/// A temporary table is its owner's across transactions; the other client
/// cannot see it, and gets the connection once the table is dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_temporary_table_pins_until_dropped() {
    let pg = PgCluster::shared();
    let usher = usher(pg, "").await;
    let port = usher.addr.port();
    let a = connect(port).await;
    let pid = a.value("SELECT pg_backend_pid()").await;
    a.run("CREATE TEMP TABLE mine (x int)").await;
    let mut b = meanwhile(
        port,
        "SELECT (to_regclass('pg_temp.mine') IS NULL)::text || ' ' || pg_backend_pid()",
    );
    b_waits(&usher, &mut b, |none, _| {
        assert!(
            none.starts_with("true "),
            "b sees a's temporary table: {none}"
        )
    })
    .await;
    a.run("INSERT INTO mine VALUES (1)").await;
    assert_eq!(a.value("SELECT count(*) FROM mine").await, "1");
    a.run("DROP TABLE mine").await;
    let (b_sees_none, _) = b.await.unwrap();
    assert_eq!(b_sees_none, format!("true {pid}"));
}

/// A WITH HOLD cursor is fetched from across transactions; the other client
/// has no cursor, and gets the connection once it is closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_cursor_pins_until_closed() {
    let pg = PgCluster::shared();
    let usher = usher(pg, "").await;
    let port = usher.addr.port();
    let a = connect(port).await;
    let pid = a.value("SELECT pg_backend_pid()").await;
    a.run("DECLARE c CURSOR WITH HOLD FOR SELECT generate_series(1, 3)")
        .await;
    let mut b = meanwhile(
        port,
        "SELECT count(*)::text || ' ' || pg_backend_pid() FROM pg_cursors",
    );
    b_waits(&usher, &mut b, |cursors, _| {
        assert!(cursors.starts_with("0 "), "b sees a's cursor: {cursors}")
    })
    .await;
    assert_eq!(a.value("FETCH 1 FROM c").await, "1");
    assert_eq!(a.value("FETCH 1 FROM c").await, "2");
    a.run("CLOSE c").await;
    let (b_cursors, _) = b.await.unwrap();
    assert_eq!(b_cursors, format!("0 {pid}"));
}

/// DISCARD ALL ends every kind at once; a client that leaves pinned has
/// its connection reset before the next client gets it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discard_all_or_leaving_ends_the_pin() {
    let pg = PgCluster::shared();
    let usher = usher(pg, "").await;
    let port = usher.addr.port();
    let a = connect(port).await;
    a.run("LISTEN x; SELECT pg_advisory_lock(7); CREATE TEMP TABLE t ()")
        .await;
    let mut b = meanwhile(port, "SELECT count(*) FROM pg_listening_channels()");
    b_waits(&usher, &mut b, |channels, _| {
        assert_eq!(channels, "0", "b's session listens")
    })
    .await;
    a.run("DISCARD ALL").await;
    b.await.unwrap();
    assert_eq!(pinned(&usher), 0);

    let pid = a.value("SELECT pg_backend_pid()").await;
    a.run("LISTEN x; SELECT pg_advisory_lock(7); CREATE TEMP TABLE t ()")
        .await;
    drop(a);
    let b = connect(port).await;
    assert_eq!(
        b.value(
            "SELECT (SELECT count(*) FROM pg_listening_channels()) || ' ' || \
             (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()) \
             || ' ' || (to_regclass('pg_temp.t') IS NULL) || ' ' || pg_backend_pid()"
        )
        .await,
        format!("0 0 true {pid}"),
        "reset, then reused"
    );
    assert_eq!(pinned(&usher), 0);

    // Leaving inside a transaction block: rolled back, then reset.
    b.run("LISTEN y").await;
    b.run("BEGIN").await;
    drop(b);
    let c = connect(port).await;
    assert_eq!(
        c.value("SELECT (SELECT count(*) FROM pg_listening_channels()) || ' ' || pg_backend_pid()")
            .await,
        format!("0 {pid}")
    );
}

/// `pinning: error`: the statement is refused with 0A000 before it reaches
/// the server, in the simple and the extended protocol; inside a
/// transaction block the block is aborted, as for any error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pinning_error_refuses_the_statement() {
    let pg = PgCluster::shared();
    let usher = usher(pg, "pinning: error\n").await;
    let a = connect(usher.addr.port()).await;
    let e = a.c.simple_query("LISTEN jobs").await.unwrap_err();
    let db = e.as_db_error().expect("an ErrorResponse");
    assert_eq!(db.code().code(), "0A000");
    assert!(db.message().contains("LISTEN"), "{}", db.message());
    assert!(db.hint().unwrap_or_default().contains("session"));
    assert_eq!(
        a.value("SELECT count(*) FROM pg_listening_channels()")
            .await,
        "0",
        "it never ran"
    );
    let e =
        a.c.query("SELECT pg_advisory_lock($1)", &[&1i64])
            .await
            .unwrap_err();
    assert_eq!(common::sqlstate(&e).as_deref(), Some("0A000"));
    a.run("BEGIN").await;
    let e =
        a.c.simple_query("CREATE TEMP TABLE t ()")
            .await
            .unwrap_err();
    assert_eq!(common::sqlstate(&e).as_deref(), Some("0A000"));
    let e = a.c.simple_query("SELECT 1").await.unwrap_err();
    assert_eq!(common::sqlstate(&e).as_deref(), Some("25P02"));
    a.run("ROLLBACK").await;
    assert_eq!(
        a.value(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
        )
        .await,
        "0"
    );
    assert_eq!(a.value("SELECT 1").await, "1");
}

/// `pinning: off`: nothing is pinned (the old behaviour: the state stays on
/// the connection the next client gets).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pinning_off_does_nothing() {
    let pg = PgCluster::shared();
    let usher = usher(pg, "pinning: off\n").await;
    let port = usher.addr.port();
    let a = connect(port).await;
    // A channel of its own: a NOTIFY of another test's channel would
    // reach the idle backend, and the pool would replace it.
    a.run("LISTEN jobs_unpinned").await;
    let b = connect(port).await;
    assert_eq!(
        b.value("SELECT count(*) FROM pg_listening_channels()")
            .await,
        "1",
        "b runs at once, on the backend that listens"
    );
    assert_eq!(pinned(&usher), 0);
    b.run("UNLISTEN *").await;
}

/// `max_pinned`: past it, a client that would pin waits, and gets its turn
/// when a pinned client lets go; a client that does not pin is served by
/// the rest of the pool meanwhile; inside a transaction block the
/// statement is refused at once with 53300.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_pinned_makes_the_next_pinner_wait() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "pool_mode: transaction\npool_size: 2\nmax_pinned: 1\n").await;
    let port = usher.addr.port();
    let a = connect(port).await;
    a.run("LISTEN one").await;
    let c = connect(port).await;
    c.run("BEGIN").await;
    let e = c.c.simple_query("LISTEN two").await.unwrap_err();
    let db = e.as_db_error().expect("an ErrorResponse");
    assert_eq!(db.code().code(), "53300");
    assert!(
        db.detail().unwrap_or_default().contains("max_pinned (1)"),
        "{db:?}"
    );
    c.run("ROLLBACK").await;
    assert_eq!(c.value("SELECT 1").await, "1", "unpinned work goes on");
    let waiter = tokio::spawn(async move {
        c.run("LISTEN two").await;
        let listening = c
            .value("SELECT count(*) FROM pg_listening_channels()")
            .await;
        (c, listening)
    });
    waiting(&usher, 1).await;
    assert_eq!(a.value("SELECT 1").await, "1");
    a.run("UNLISTEN *").await;
    let (_c, listening) = waiter.await.unwrap();
    assert_eq!(listening, "1");
    assert_eq!(pinned(&usher), 1, "c's");
}

/// A client that leaves while it waits for a pin slot stops waiting then
/// (as one waiting for a server connection does), not when a slot frees or
/// query_wait_timeout ends its wait; the next pinner gets the slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_while_it_waits_for_a_pin_slot_stops_waiting() {
    let pg = PgCluster::shared();
    let usher = Usher::start(
        pg,
        "pool_mode: transaction\npool_size: 2\nmax_pinned: 1\nquery_wait_timeout: 300\n",
    )
    .await;
    let port = usher.addr.port();
    let a = connect(port).await;
    a.run("LISTEN one").await;
    // c's connection runs in a task of its own: aborting it closes c's socket.
    let conn =
        format!("host=127.0.0.1 port={port} user=alice password={ALICE_PASSWORD} dbname=app");
    let (c, connection) = tokio_postgres::connect(&conn, tokio_postgres::NoTls)
        .await
        .unwrap();
    let socket = tokio::spawn(connection);
    let query = tokio::spawn(async move { c.simple_query("LISTEN two").await.map(|_| ()) });
    waiting(&usher, 1).await;
    socket.abort();
    assert!(
        query.await.unwrap().is_err(),
        "c's connection is gone, so is its query"
    );
    waiting(&usher, 0).await;
    // The slot a lets go of goes to the next pinner, not to c.
    a.run("UNLISTEN *").await;
    let d = connect(port).await;
    d.run("LISTEN three").await;
    assert_eq!(
        d.value("SELECT count(*) FROM pg_listening_channels()")
            .await,
        "1"
    );
    assert_eq!(pinned(&usher), 1, "d's");
}

/// A SQL PREPARE in a Query usher carries (the Query holds it alone) does
/// not pin; one it does not carry (here inside a multi-statement Query)
/// still pins until its DEALLOCATE, and the other client never sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uncarried_sql_prepare_pins_until_deallocated() {
    let pg = PgCluster::shared();
    let usher = usher(pg, "").await;
    let port = usher.addr.port();
    let a = connect(port).await;
    a.run("PREPARE lone AS SELECT 1").await;
    assert_eq!(pinned(&usher), 0, "a lone PREPARE is carried");
    let pid = a.value("SELECT pg_backend_pid()").await;
    a.run("PREPARE multi AS SELECT 2; SELECT 1").await;
    assert_eq!(pinned(&usher), 1);
    let mut b = meanwhile(
        port,
        "SELECT count(*)::text || ' ' || pg_backend_pid() FROM pg_prepared_statements \
         WHERE name = 'multi'",
    );
    b_waits(&usher, &mut b, |seen, _| {
        assert!(seen.starts_with("0 "), "b sees a's statement: {seen}")
    })
    .await;
    assert_eq!(a.value("EXECUTE multi").await, "2");
    assert_eq!(a.value("EXECUTE lone").await, "1");
    a.run("DEALLOCATE multi").await;
    let (b_sees, _) = b.await.unwrap();
    assert_eq!(b_sees, format!("0 {pid}"));
    assert_eq!(pinned(&usher), 0);
}
