//! Clients that leave at any byte. Each test runs a canary client beside
//! it (tests/common/canary.rs): whatever one client does, the others never
//! wait. After every cut, PostgreSQL holds nothing the client did not
//! sync, alice's backends stay within pool_size, and the next client on
//! the (only) server connection finds a clean session.
//!
//! The cut test samples offsets (every one for short streams, a seeded
//! random sample for long ones): `USHER_CUTS=<n>` samples n per scenario,
//! `USHER_CUT_SEED` replays a seed and `USHER_CUT_CONFIGS` picks the
//! modes and worker counts (scripts/cuts.sh runs it longer).
#![allow(clippy::await_holding_lock)] // common::one_at_a_time

use crate::common;

use crate::common::canary::Canary;
use crate::common::wire::{message, read_message, startup_packet, trust_login};
use crate::common::{PgCluster, UsherProcess};
use rand::{Rng, SeedableRng};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

// --- messages ----------------------------------------------------------

fn cstr(s: &str) -> Vec<u8> {
    let mut v = s.as_bytes().to_vec();
    v.push(0);
    v
}

fn query(sql: &str) -> Vec<u8> {
    message(b'Q', &cstr(sql))
}

fn parse(name: &str, sql: &str) -> Vec<u8> {
    let mut body = cstr(name);
    body.extend(cstr(sql));
    body.extend([0, 0]);
    message(b'P', &body)
}

fn bind(statement: &str) -> Vec<u8> {
    let mut body = cstr("");
    body.extend(cstr(statement));
    body.extend([0, 0, 0, 0, 0, 0]);
    message(b'B', &body)
}

fn execute() -> Vec<u8> {
    message(b'E', &[0, 0, 0, 0, 0])
}

fn sync() -> Vec<u8> {
    message(b'S', b"")
}

fn flush() -> Vec<u8> {
    message(b'H', b"")
}

fn copy_data(data: &str) -> Vec<u8> {
    message(b'd', data.as_bytes())
}

fn copy_done() -> Vec<u8> {
    message(b'c', b"")
}

/// Parse, Bind and Execute of `sql` (unnamed).
fn extended(sql: &str) -> Vec<u8> {
    [parse("", sql), bind(""), execute()].concat()
}

fn insert(tag: &str) -> String {
    format!("INSERT INTO cut_rows VALUES ('{tag}')")
}

// --- the cluster ------------------------------------------------------

/// The module's cluster with the table the tests insert into. The tests of
/// this file run one at a time (`common::one_at_a_time`): each counts alice's
/// backends.
fn cluster() -> &'static PgCluster {
    static TABLE: std::sync::Once = std::sync::Once::new();
    // A cluster of its own: the tests count all of alice's backends.
    let pg = PgCluster::own(module_path!());
    TABLE.call_once(|| {
        pg.psql_super_db(
            "app",
            "CREATE TABLE IF NOT EXISTS cut_rows (tag text); GRANT ALL ON cut_rows TO alice",
        );
    });
    pg
}

/// A superuser's direct connection to `app`, for looking at what
/// PostgreSQL holds.
async fn direct(pg: &PgCluster) -> tokio_postgres::Client {
    let (c, conn) = tokio_postgres::connect(
        &format!(
            "host=127.0.0.1 port={} user=postgres password={} dbname=app",
            pg.port,
            common::SUPERUSER_PASSWORD
        ),
        tokio_postgres::NoTls,
    )
    .await
    .expect("direct connection");
    tokio::spawn(conn);
    c
}

async fn committed(direct: &tokio_postgres::Client, tag: &str) -> bool {
    let n: i64 = direct
        .query_one("SELECT count(*) FROM cut_rows WHERE tag = $1", &[&tag])
        .await
        .unwrap()
        .get(0);
    n > 0
}

async fn alice_backends(direct: &tokio_postgres::Client) -> i64 {
    direct
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE usename = 'alice' AND datname = 'app'",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

fn usher(pg: &PgCluster, mode: &str, workers: usize, extra: &str) -> UsherProcess {
    UsherProcess::builder(pg)
        .extra(&format!(
            "auth:\n  method: trust\npool_mode: {mode}\npool_size: 1\nworkers: {workers}\n\
             query_wait_timeout: 60\n{extra}"
        ))
        .start()
}

/// The next client on the only server connection: it gets one (the cut
/// one was recovered or closed), and finds no transaction open and no
/// setting of the client before it.
/// Returns the server connection's backend pid.
async fn next_client_finds_a_clean_session(usher: &UsherProcess, what: &str) -> String {
    let (c, _driver) = usher.alice().await;
    // A simple Query: its transaction begins with it, unless one was
    // left open.
    let rows = tokio::time::timeout(
        Duration::from_secs(60),
        c.simple_query(
            "SELECT now() = statement_timestamp(), \
             coalesce(current_setting('app.cut', true), ''), pg_backend_pid()",
        ),
    )
    .await
    .unwrap_or_else(|_| panic!("{what}: the next client waited a minute for a server"))
    .unwrap_or_else(|e| panic!("{what}: the next client failed: {e:?}"));
    let row = rows
        .iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => Some(r),
            _ => None,
        })
        .expect("a row");
    assert_eq!(
        row.get(0),
        Some("t"),
        "{what}: the next client's query ran inside a transaction left open"
    );
    assert_eq!(
        row.get(1),
        Some(""),
        "{what}: the next client sees the cut client's setting"
    );
    row.get(2).expect("a pid").to_string()
}

// --- 1. a client that leaves in the middle of a result -------------------

/// A client that reads part of a long result and leaves stops nobody:
/// the canary never waits, usher still serves, and the next client gets
/// the server connection (before: the drain of the left connection spun
/// without awaiting when the bytes left ended inside a message header,
/// freezing a worker and with it logins, the console and signals).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_mid_result_stops_nobody() {
    let _alone = common::one_at_a_time();
    let pg = cluster();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed());
    for (mode, workers) in [("session", 1), ("transaction", 2), ("transaction", 1)] {
        let usher = usher(pg, mode, workers, "");
        let canary = Canary::start(usher.port);
        let mut first_pid = None;
        let results = [
            query("SELECT g, repeat('y', 50) FROM generate_series(1, 3000000) g"),
            query("COPY (SELECT g, repeat('y', 50) FROM generate_series(1, 3000000) g) TO STDOUT"),
            [
                extended("SELECT g, repeat('y', 50) FROM generate_series(1, 3000000) g"),
                sync(),
            ]
            .concat(),
        ];
        for (i, request) in results.iter().enumerate() {
            for _ in 0..3 {
                let keep = rng.gen_range(10_000..200_000);
                let what =
                    format!("{mode}, {workers} worker(s), result {i}, left after {keep} bytes");
                let mut c = trust_login(usher.addr()).await;
                c.write_all(request).await.unwrap();
                let mut got = vec![0u8; keep];
                tokio::time::timeout(Duration::from_secs(30), c.read_exact(&mut got))
                    .await
                    .unwrap_or_else(|_| panic!("{what}: no result"))
                    .unwrap();
                drop(c);
                // Only whole messages went out: the connection is
                // recovered, not closed (before: the bytes the client
                // never took were walked twice, the drain waited for
                // answers that had come, and after 30 s closed it).
                let pid = next_client_finds_a_clean_session(&usher, &what).await;
                assert_eq!(
                    *first_pid.get_or_insert_with(|| pid.clone()),
                    pid,
                    "{what}: the server connection was closed, not recovered"
                );
            }
        }
        canary.check();
    }
}

// --- 2. nothing the client did not sync is committed ---------------------

/// A pipeline with no Sync is rolled back when its client leaves, as
/// PostgreSQL does for a direct client: an INSERT (with and without a
/// Flush), an extended-protocol COPY FROM STDIN ended with CopyDone, and an
/// INSERT before usher itself ends the client (54000, a Parse too large to
/// hold). Before: the abandon path gave the pipeline its Sync, which
/// committed it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_the_client_did_not_sync_is_committed() {
    let _alone = common::one_at_a_time();
    let pg = cluster();
    let direct = direct(pg).await;
    for (mode, workers) in [("transaction", 1), ("session", 2)] {
        let usher = usher(pg, mode, workers, "max_buffered_message: 100000\n");
        let canary = Canary::start(usher.port);
        let tag = |what: &str| format!("unsynced-{mode}-{what}");
        let oversized = parse("big", &format!("SELECT '{}'", "x".repeat(200_000)));
        // (row tag, what is sent first, whether to wait for its
        // CommandComplete, what is sent after it)
        let mut stunts: Vec<(String, Vec<u8>, bool, Vec<u8>)> = vec![
            (
                tag("insert"),
                extended(&insert(&tag("insert"))),
                false,
                vec![],
            ),
            (
                tag("insert-flush"),
                [extended(&insert(&tag("insert-flush"))), flush()].concat(),
                true,
                vec![],
            ),
            (
                tag("copy"),
                [
                    extended("COPY cut_rows FROM STDIN"),
                    copy_data(&format!("{}\n", tag("copy"))),
                    copy_done(),
                    flush(),
                ]
                .concat(),
                true,
                vec![],
            ),
        ];
        if mode == "transaction" {
            // Only transaction mode holds a named Parse whole (session
            // mode streams one this large).
            stunts.push((
                tag("fatal"),
                [extended(&insert(&tag("fatal"))), flush()].concat(),
                true,
                oversized,
            ));
        }
        for (tag, bytes, wait_for_answer, after) in stunts {
            let mut c = trust_login(usher.addr()).await;
            c.write_all(&bytes).await.unwrap();
            if wait_for_answer {
                // The INSERT (or COPY) ran: its CommandComplete came.
                loop {
                    let (t, _) = read_message(&mut c).await;
                    if t == b'C' {
                        break;
                    }
                }
            } else {
                // Until PostgreSQL has run it (its transaction has an id).
                common::wait::eventually_async(
                    Duration::from_secs(10),
                    "the INSERT runs",
                    || async {
                        direct
                            .query_one(
                                "SELECT count(*) FROM pg_stat_activity \
                                 WHERE usename = 'alice' AND backend_xid IS NOT NULL",
                                &[],
                            )
                            .await
                            .unwrap()
                            .get::<_, i64>(0)
                            > 0
                    },
                )
                .await;
            }
            if !after.is_empty() {
                // usher ends the client: 54000 (as soon as the length is
                // in; the rest is not sent, or the client's unread bytes
                // would turn usher's close into a reset that loses the
                // error).
                c.write_all(&after[..64]).await.unwrap();
                let e = common::wire::read_error(&mut c).await;
                assert_eq!(e[&'C'], "54000", "{tag}: {e:?}");
            }
            drop(c);
            next_client_finds_a_clean_session(&usher, &tag).await;
            assert!(
                !committed(&direct, &tag).await,
                "{tag}: usher committed what its client never synced"
            );
        }
        canary.check();
    }
}

// --- 3. cut at every point ------------------------------------------------

fn seed() -> u64 {
    std::env::var("USHER_CUT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            let s = rand::random::<u32>() as u64;
            eprintln!("cuts: USHER_CUT_SEED={s}");
            s
        })
}

/// The pool modes and worker counts to cut in: `USHER_CUT_CONFIGS`
/// (`transaction:1,session:2,...`), by default one of each mode.
fn configs() -> Vec<(String, usize)> {
    let spec = std::env::var("USHER_CUT_CONFIGS")
        .unwrap_or_else(|_| "transaction:1,session:2".to_string());
    spec.split(',')
        .map(|c| {
            let (mode, workers) = c.split_once(':').expect("mode:workers");
            (mode.to_string(), workers.parse().expect("a worker count"))
        })
        .collect()
}

/// Offsets to cut at: every one up to `len` when there are few, else a
/// sample that always holds the first, the last and each boundary ±1.
fn offsets(len: usize, boundaries: &[usize], rng: &mut impl Rng) -> Vec<usize> {
    let wanted: usize = std::env::var("USHER_CUTS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    if len <= wanted * 2 {
        return (0..=len).collect();
    }
    let mut picked = vec![0, len];
    for b in boundaries {
        picked.extend([b.saturating_sub(1), *b, (*b + 1).min(len)]);
    }
    while picked.len() < wanted + 2 + boundaries.len() * 3 {
        picked.push(rng.gen_range(0..=len));
    }
    picked.sort_unstable();
    picked.dedup();
    picked
}

/// What a client sends, in pieces; a row a piece inserts may be committed
/// only if the piece's `commits_at` offset was reached (None: never).
struct Pipeline {
    name: &'static str,
    pieces: Vec<Vec<u8>>,
    /// (row tag, the piece whose end commits it)
    rows: Vec<(String, Option<usize>)>,
}

fn pipelines(prefix: &str) -> Vec<Pipeline> {
    let t = |s: &str| format!("{prefix}-{s}");
    vec![
        Pipeline {
            name: "extended: synced, then unsynced",
            pieces: vec![
                [extended(&insert(&t("a1"))), sync()].concat(),
                extended(&insert(&t("a2"))),
                flush(),
            ],
            rows: vec![(t("a1"), Some(0)), (t("a2"), None)],
        },
        Pipeline {
            name: "simple: a query, then a transaction block left open",
            pieces: vec![
                query(&insert(&t("b1"))),
                query(&format!("BEGIN; {}", insert(&t("b2")))),
                query("SET app.cut = 'dirty'"),
                query("SELECT pg_sleep(0.01)"),
            ],
            rows: vec![(t("b1"), Some(0)), (t("b2"), None)],
        },
        Pipeline {
            name: "simple COPY FROM STDIN",
            pieces: vec![
                query("COPY cut_rows FROM STDIN"),
                copy_data(&format!("{}\n", t("c1"))),
                copy_done(),
            ],
            rows: vec![(t("c1"), Some(2))],
        },
        Pipeline {
            name: "extended COPY FROM STDIN, synced then not",
            pieces: vec![
                [
                    extended("COPY cut_rows FROM STDIN"),
                    copy_data(&format!("{}\n", t("d1"))),
                    copy_done(),
                    sync(),
                ]
                .concat(),
                extended("COPY cut_rows FROM STDIN"),
                copy_data(&format!("{}\n", t("d2"))),
                copy_done(),
            ],
            rows: vec![(t("d1"), Some(0)), (t("d2"), None)],
        },
        Pipeline {
            name: "extended: BEGIN, INSERT, COMMIT, no Sync",
            pieces: vec![
                extended("BEGIN"),
                extended(&insert(&t("e1"))),
                extended("COMMIT"),
                extended(&insert(&t("e2"))),
            ],
            // COMMIT commits when it runs, Sync or not (PostgreSQL
            // finishes a transaction command at once).
            rows: vec![(t("e1"), Some(2)), (t("e2"), None)],
        },
        Pipeline {
            name: "a session setting, a named statement, a query in flight",
            pieces: vec![
                query("SET app.cut = 'dirty'"),
                [
                    parse("s1", "SELECT pg_sleep(0.01)"),
                    bind("s1"),
                    execute(),
                    sync(),
                ]
                .concat(),
                [extended(&insert(&t("f1"))), sync()].concat(),
            ],
            rows: vec![(t("f1"), Some(2))],
        },
    ]
}

/// Sends `bytes[..cut]` and leaves, either at once or after reading what
/// came back for a moment.
async fn cut_after_sending(usher: &UsherProcess, bytes: &[u8], cut: usize, linger: bool) {
    let mut c = trust_login(usher.addr()).await;
    c.write_all(&bytes[..cut]).await.unwrap();
    if linger {
        let mut sink = vec![0u8; 64 * 1024];
        let _ = tokio::time::timeout(Duration::from_millis(20), c.read(&mut sink)).await;
    }
    drop(c);
}

/// Cuts each pipeline at sampled byte offsets, in both modes with one and
/// two workers, and checks after each cut what PostgreSQL holds, alice's
/// backends and the next client's session. Also cuts the login and
/// result streams (simple, extended, COPY OUT) at sampled offsets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_cut_at_any_byte_leaves_nothing_behind() {
    let _alone = common::one_at_a_time();
    let pg = cluster();
    let direct = direct(pg).await;
    let seed = seed();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let run = rand::random::<u32>();
    for (mode, workers) in configs() {
        let usher = usher(pg, &mode, workers, "");
        let canary = Canary::start(usher.port);
        for (n, pipeline) in pipelines(&format!("cut{run}-{mode}{workers}"))
            .into_iter()
            .enumerate()
        {
            let bytes = pipeline.pieces.concat();
            let ends: Vec<usize> = pipeline
                .pieces
                .iter()
                .scan(0, |end, p| {
                    *end += p.len();
                    Some(*end)
                })
                .collect();
            for cut in offsets(bytes.len(), &ends, &mut rng) {
                let what = format!(
                    "seed {seed}, {mode}, {workers} worker(s), '{}' cut at {cut} of {}",
                    pipeline.name,
                    bytes.len()
                );
                // Each cut gets rows of its own.
                let renamed = pipelines(&format!("cut{run}-{mode}{workers}-{cut}")).swap_remove(n);
                let bytes = renamed.pieces.concat();
                cut_after_sending(&usher, &bytes, cut, cut % 2 == 0).await;
                next_client_finds_a_clean_session(&usher, &what).await;
                for (tag, commits_at) in &renamed.rows {
                    if committed(&direct, tag).await {
                        assert!(
                            commits_at.is_some_and(|piece| cut >= ends[piece]),
                            "{what}: {tag} was committed, but its client never sent \
                             what commits it"
                        );
                    }
                }
                let backends = alice_backends(&direct).await;
                assert!(backends <= 1, "{what}: alice has {backends} backends");
            }
        }
        // The login, cut anywhere.
        let login = startup_packet(&[("user", "alice"), ("database", "app")]);
        for cut in offsets(login.len(), &[], &mut rng) {
            let mut c = tokio::net::TcpStream::connect(usher.addr()).await.unwrap();
            c.write_all(&login[..cut]).await.unwrap();
            drop(c);
        }
        next_client_finds_a_clean_session(&usher, &format!("{mode}: after cut logins")).await;
        // Result streams, left after any number of bytes read.
        let results = [
            query("SELECT g, repeat('z', 40) FROM generate_series(1, 20000) g"),
            [
                extended("SELECT g, repeat('z', 40) FROM generate_series(1, 20000) g"),
                sync(),
            ]
            .concat(),
            query("COPY (SELECT g, repeat('z', 40) FROM generate_series(1, 20000) g) TO STDOUT"),
        ];
        for request in &results {
            for keep in offsets(1_000_000, &[], &mut rng) {
                let what = format!(
                    "seed {seed}, {mode}, {workers} worker(s): result left after {keep} bytes"
                );
                let mut c = trust_login(usher.addr()).await;
                c.write_all(request).await.unwrap();
                let mut got = vec![0u8; keep];
                let _ = tokio::time::timeout(Duration::from_secs(10), c.read_exact(&mut got)).await;
                drop(c);
                next_client_finds_a_clean_session(&usher, &what).await;
                let backends = alice_backends(&direct).await;
                assert!(backends <= 1, "{what}: alice has {backends} backends");
            }
        }
        canary.check();
    }
}
