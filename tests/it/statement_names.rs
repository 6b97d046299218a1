//! In transaction mode usher keeps each client's statement names itself
//! (its statements are shared server statements under usher's names); a
//! name exists for a client exactly when PostgreSQL would have it on a
//! direct connection (issue 26, items 3 and 4): a second Parse of a name is
//! refused with 42P05 and the rest of its batch skipped; a Parse the
//! server refused or skipped leaves no name (also one of a text usher
//! already holds on that connection); a Close it skipped removes none. Each sequence runs through usher (both modes, pool_size 1) and
//! directly, and the answers must be the same.

use crate::common::raw::{Msg, RawClient};
use crate::common::wire::Frontend::{self, *};
use crate::common::{PgCluster, UsherProcess};

fn s(x: &str) -> String {
    x.to_string()
}

/// The answers a client gets to `batches`, sent one after the other.
async fn answers(c: &mut RawClient, batches: &[Vec<Frontend>]) -> Vec<Vec<Msg>> {
    let mut all = Vec::new();
    for b in batches {
        let got = c.batch(b).await;
        // Error texts name statements as the client did; compare codes.
        all.push(
            got.into_iter()
                .map(|m| match m {
                    Msg::Error(code, _) => Msg::Error(code, String::new()),
                    Msg::Notice(..) | Msg::Parameter(..) => Msg::Other('-'),
                    m => m,
                })
                .filter(|m| *m != Msg::Other('-'))
                .collect(),
        );
    }
    all
}

/// Runs `batches` directly and through usher in both modes; all must agree.
async fn same_as_directly(what: &str, batches: Vec<Vec<Frontend>>) {
    let pg = PgCluster::shared();
    let table = format!("names_{}", rand::random::<u32>());
    pg.psql_super_db(
        "app",
        &format!("CREATE TABLE {table} (v int); GRANT ALL ON {table} TO alice"),
    );
    let batches: Vec<Vec<Frontend>> = batches
        .into_iter()
        .map(|b| {
            b.into_iter()
                .map(|m| match m {
                    Parse(n, sql, t) => Parse(n, sql.replace("TABLE", &table), t),
                    Query(sql) => Query(sql.replace("TABLE", &table)),
                    m => m,
                })
                .collect()
        })
        .collect();
    let (mut direct, _) =
        RawClient::unix(&pg.dir, pg.port, &[("user", "alice"), ("database", "app")]).await;
    let expected = answers(&mut direct, &batches).await;
    for mode in ["transaction", "session"] {
        let usher = UsherProcess::builder(pg)
            .extra(&format!(
                "auth:\n  method: trust\npool_mode: {mode}\npool_size: 1\n"
            ))
            .start();
        let (mut c, _) =
            RawClient::tcp(usher.addr(), &[("user", "alice"), ("database", "app")]).await;
        let got = answers(&mut c, &batches).await;
        assert_eq!(
            got, expected,
            "{what}, {mode}: through usher, then directly"
        );
    }
    let rows = pg.psql_super_db("app", &format!("SELECT count(*) FROM {table}"));
    assert_eq!(rows.trim(), "0", "{what}: a write after the error happened");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_parse_of_a_name_is_refused_and_the_rest_skipped() {
    same_as_directly(
        "across batches",
        vec![
            vec![Parse(s("s1"), s("select 1"), vec![]), Sync],
            vec![
                Parse(s("s1"), s("select 2"), vec![]),
                Bind(s(""), s("s1"), vec![]),
                Execute(s(""), 0),
                Parse(s("w"), s("insert into TABLE values (1)"), vec![]),
                Bind(s(""), s("w"), vec![]),
                Execute(s(""), 0),
                Sync,
            ],
            vec![Bind(s(""), s("s1"), vec![]), Execute(s(""), 0), Sync],
        ],
    )
    .await;
    // The text is checked before the name: its own error comes first.
    same_as_directly(
        "a duplicate whose text fails",
        vec![
            vec![Parse(s("s3"), s("select 1"), vec![]), Sync],
            vec![Parse(s("s3"), s("select $1, $2"), vec![25, 0]), Sync],
            vec![Parse(s("s3"), s("selec 2"), vec![]), Sync],
            vec![Query(s("BEGIN")), Query(s("select 1/0"))],
            vec![Parse(s("s3"), s("select 2"), vec![]), Sync],
            vec![Query(s("ROLLBACK"))],
            vec![Bind(s(""), s("s3"), vec![]), Execute(s(""), 0), Sync],
        ],
    )
    .await;
    same_as_directly(
        "in one batch",
        vec![vec![
            Parse(s("s2"), s("select 1"), vec![]),
            Parse(s("s2"), s("select 2"), vec![]),
            Bind(s(""), s("s2"), vec![]),
            Execute(s(""), 0),
            Sync,
            Bind(s(""), s("s2"), vec![]),
            Execute(s(""), 0),
            Sync,
        ]],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parse_refused_or_skipped_leaves_no_name() {
    same_as_directly(
        "refused in a failed block",
        vec![
            vec![Query(s("BEGIN")), Query(s("select 1/0"))],
            vec![Parse(s("s9"), s("select 9"), vec![]), Sync],
            vec![Query(s("ROLLBACK"))],
            vec![Bind(s(""), s("s9"), vec![]), Execute(s(""), 0), Sync],
        ],
    )
    .await;
    // usher holds the text already (on that server connection): its
    // check of the text meets the failed block as the Parse would.
    same_as_directly(
        "refused in a failed block, a text the server holds",
        vec![
            vec![Parse(s("s1"), s("select 9"), vec![]), Sync],
            vec![Query(s("BEGIN")), Query(s("select 1/0"))],
            vec![Parse(s("s2"), s("select 9"), vec![]), Sync],
            vec![Query(s("ROLLBACK"))],
            vec![Bind(s(""), s("s2"), vec![]), Execute(s(""), 0), Sync],
            vec![Bind(s(""), s("s1"), vec![]), Execute(s(""), 0), Sync],
        ],
    )
    .await;
    same_as_directly(
        "skipped after an error",
        vec![
            vec![
                Parse(s("e"), s("select 1/0"), vec![]),
                Bind(s(""), s("e"), vec![]),
                Execute(s(""), 0),
                Parse(s("s8"), s("select 8"), vec![]),
                Sync,
            ],
            vec![Bind(s(""), s("s8"), vec![]), Execute(s(""), 0), Sync],
        ],
    )
    .await;
    same_as_directly(
        "a Parse and a Close of one name, both skipped",
        vec![
            vec![
                Parse(s("e"), s("select 1/0"), vec![]),
                Bind(s(""), s("e"), vec![]),
                Execute(s(""), 0),
                Parse(s("s5"), s("select 5"), vec![]),
                Close('S', s("s5")),
                Sync,
            ],
            vec![Bind(s(""), s("s5"), vec![]), Execute(s(""), 0), Sync],
        ],
    )
    .await;
    same_as_directly(
        "failed to parse",
        vec![
            vec![Parse(s("s7"), s("selec 7"), vec![]), Sync],
            vec![Parse(s("s7"), s("select 7"), vec![]), Sync],
            vec![Bind(s(""), s("s7"), vec![]), Execute(s(""), 0), Sync],
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_close_skipped_after_an_error_removes_no_name() {
    same_as_directly(
        "close skipped",
        vec![
            vec![Parse(s("s0"), s("select 0"), vec![]), Sync],
            vec![Execute(s("p9"), 0), Close('S', s("s0")), Sync],
            vec![Bind(s(""), s("s0"), vec![]), Execute(s(""), 0), Sync],
        ],
    )
    .await;
    // The next batch in the same write, before the skipped Close's answer
    // is in: it waits for it, and the name is still there.
    same_as_directly(
        "close skipped, the next batch in the same write",
        vec![
            vec![Parse(s("s0"), s("select 0"), vec![]), Sync],
            vec![
                Execute(s("p9"), 0),
                Close('S', s("s0")),
                Sync,
                Bind(s(""), s("s0"), vec![]),
                Execute(s(""), 0),
                Sync,
            ],
            vec![
                Execute(s("p9"), 0),
                Close('S', s("s0")),
                Sync,
                Parse(s("s0"), s("select 1"), vec![]),
                Bind(s(""), s("s0"), vec![]),
                Execute(s(""), 0),
                Sync,
            ],
        ],
    )
    .await;
}

/// An error the server words with usher's name for the statement names
/// the client's, as directly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_names_the_clients_statement() {
    let pg = PgCluster::shared();
    let batches = vec![
        vec![Parse(s("mine"), s("select $1::int4"), vec![]), Sync],
        vec![Bind(s(""), s("mine"), vec![]), Execute(s(""), 0), Sync],
    ];
    let usher = UsherProcess::builder(pg)
        .extra("auth:\n  method: trust\npool_mode: transaction\npool_size: 1\n")
        .start();
    let (mut c, _) = RawClient::tcp(usher.addr(), &[("user", "alice"), ("database", "app")]).await;
    let mut got = Vec::new();
    for b in &batches {
        got.extend(c.batch(b).await);
    }
    let errors: Vec<_> = got
        .iter()
        .filter_map(|m| match m {
            Msg::Error(code, text) => Some((code.as_str(), text.as_str())),
            _ => None,
        })
        .collect();
    assert_eq!(
        errors,
        [(
            "08P01",
            "bind message supplies 0 parameters, but prepared statement \"mine\" requires 1"
        )]
    );
}

/// In a failed block, a Bind with the wrong number of parameters of a
/// statement the server connection lacks (another client's DEALLOCATE ALL
/// took it) is PostgreSQL's 08P01, which it checks before the block's
/// state, not the 25P02 that preparing the statement again meets; with the
/// right number, 25P02; after ROLLBACK the statement runs. Answers and
/// their texts as directly, in both modes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_miscounted_bind_in_a_failed_block_is_08p01_where_the_connection_lacks_the_statement() {
    let pg = PgCluster::shared();
    let first = vec![Parse(s("mine"), s("select $1::int4 + $2"), vec![23])];
    let after = vec![
        vec![Query(s("BEGIN")), Query(s("select 1/0"))],
        vec![Bind(s(""), s("mine"), vec![]), Execute(s(""), 0), Sync],
        vec![Bind(s(""), s("mine"), vec![Some(s("1"))]), Sync],
        vec![
            Bind(s(""), s("mine"), vec![Some(s("1")), Some(s("2"))]),
            Execute(s(""), 0),
            Sync,
        ],
        vec![Query(s("ROLLBACK"))],
        vec![
            Bind(s(""), s("mine"), vec![Some(s("1")), Some(s("2"))]),
            Execute(s(""), 0),
            Sync,
        ],
    ];
    // One server connection in transaction mode, so that b's DEALLOCATE
    // ALL takes a's statement from it; session mode needs two.
    as_directly_with_an_interloper(pg, &first, "DEALLOCATE ALL", &after, "08P01").await;
}

/// The unnamed statement's twin of the test above: the server connection
/// lost the client's unnamed statement to another client's Query; in a
/// block begun and failed by named statements (a Query would end the
/// unnamed statement directly too), a Bind of it with the wrong number of
/// parameters is 08P01, with the right number 25P02, as directly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_miscounted_bind_of_the_unnamed_statement_in_a_failed_block_is_08p01() {
    let pg = PgCluster::shared();
    let first = vec![Parse(s(""), s("select $1::int4 + $2"), vec![23])];
    let run_named = |name: &str, sql: &str| {
        vec![
            Parse(s(name), s(sql), vec![]),
            Bind(s(""), s(name), vec![]),
            Execute(s(""), 0),
            Sync,
        ]
    };
    let after = vec![
        run_named("begin_block", "BEGIN"),
        run_named("fail_block", "select 1/0"),
        vec![Bind(s(""), s(""), vec![]), Execute(s(""), 0), Sync],
        vec![Bind(s(""), s(""), vec![Some(s("1"))]), Sync],
        vec![
            Bind(s(""), s(""), vec![Some(s("1")), Some(s("2"))]),
            Execute(s(""), 0),
            Sync,
        ],
        run_named("end_block", "ROLLBACK"),
    ];
    // On a shared server connection, b's Query takes the unnamed
    // statement from it.
    as_directly_with_an_interloper(pg, &first, "select 1", &after, "08P01").await;
}

/// Runs `first` (then a Sync) on client a, `interloper` (a Query) on client
/// b, then each batch of `after` on a: directly (the answers must include
/// `expected_code`), then through usher in transaction mode on one server
/// connection (b's Query runs on a's) and in session mode on two; a's
/// answers must be the same, notices and parameters aside.
async fn as_directly_with_an_interloper(
    pg: &'static PgCluster,
    first: &[Frontend],
    interloper: &str,
    after: &[Vec<Frontend>],
    expected_code: &str,
) {
    let login = [("user", "alice"), ("database", "app")];
    async fn run(
        a: &mut RawClient,
        b: &mut RawClient,
        first: &[Frontend],
        interloper: &str,
        after: &[Vec<Frontend>],
    ) -> Vec<Msg> {
        let mut got = Vec::new();
        let mut batch = first.to_vec();
        batch.push(Sync);
        got.extend(a.batch(&batch).await);
        b.batch(&[Query(s(interloper))]).await;
        for batch in after {
            got.extend(a.batch(batch).await);
        }
        got.into_iter()
            .filter(|m| !matches!(m, Msg::Notice(..) | Msg::Parameter(..)))
            .collect()
    }
    let (mut a, _) = RawClient::unix(&pg.dir, pg.port, &login).await;
    let (mut b, _) = RawClient::unix(&pg.dir, pg.port, &login).await;
    let expected = run(&mut a, &mut b, first, interloper, after).await;
    assert!(
        expected
            .iter()
            .any(|m| matches!(m, Msg::Error(code, _) if code == expected_code)),
        "directly: {expected:?}"
    );
    for (mode, size) in [("transaction", 1), ("session", 2)] {
        let usher = UsherProcess::builder(pg)
            .extra(&format!(
                "auth:\n  method: trust\npool_mode: {mode}\npool_size: {size}\n"
            ))
            .start();
        let (mut a, _) = RawClient::tcp(usher.addr(), &login).await;
        let (mut b, _) = RawClient::tcp(usher.addr(), &login).await;
        let got = run(&mut a, &mut b, first, interloper, after).await;
        assert_eq!(got, expected, "{mode}: through usher, then directly");
    }
}
