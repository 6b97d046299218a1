//! A client's unnamed statement is its own, kept as PostgreSQL keeps it
//! (issue 26, item 1): in transaction mode another client's batches may
//! run on the same server connection between two of its own, and replace
//! the server's unnamed statement; a Bind or Describe of the unnamed
//! statement must still meet the client's (or 26000 where it has none),
//! never another client's. Two clients take turns through usher on one
//! and two server connections (and in session mode), each beside its own
//! direct connection, and every answer must be the same
//! (`common::turns`).

use crate::common::turns;
use crate::common::wire::Frontend::{self, *};

fn s(x: &str) -> String {
    x.to_string()
}

fn parse(sql: &str) -> Frontend {
    Parse(s(""), s(sql), vec![])
}

fn bind() -> Frontend {
    Bind(s(""), s(""), vec![])
}

fn run() -> Frontend {
    Execute(s(""), 0)
}

async fn same_as_directly(what: &str, turns: Vec<(usize, Vec<Frontend>)>) {
    turns::same_as_directly(what, "", turns).await
}

const A: usize = 0;
const B: usize = 1;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bind_or_describe_meets_the_clients_own_unnamed_statement() {
    same_as_directly(
        "another client's Parse in between",
        vec![
            (A, vec![parse("select 'client A'"), Sync]),
            (B, vec![parse("select 'client B'"), bind(), run(), Sync]),
            (A, vec![bind(), run(), Sync]),
            (B, vec![bind(), run(), Sync]),
        ],
    )
    .await;
    same_as_directly(
        "a Describe first",
        vec![
            (A, vec![parse("select 'client A' as a"), Sync]),
            (B, vec![parse("select 'client B' as b"), Sync]),
            (A, vec![Describe('S', s("")), bind(), run(), Sync]),
            (B, vec![Describe('S', s("")), Sync]),
        ],
    )
    .await;
    same_as_directly(
        "asyncpg's shape",
        vec![
            (
                A,
                vec![
                    Parse(s(""), s("select $1::int4 as n"), vec![]),
                    Describe('S', s("")),
                    Sync,
                ],
            ),
            (B, vec![parse("select 22"), Describe('S', s("")), Sync]),
            (A, vec![Bind(s(""), s(""), vec![Some(s("5"))]), run(), Sync]),
            (B, vec![bind(), run(), Sync]),
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_without_one_gets_26000() {
    same_as_directly(
        "never parsed one",
        vec![
            (A, vec![parse("select 11"), Sync]),
            (B, vec![bind(), run(), Sync]),
            (B, vec![Describe('S', s("")), Sync]),
            (A, vec![bind(), run(), Sync]),
        ],
    )
    .await;
    same_as_directly(
        "a simple Query dropped it",
        vec![
            (A, vec![parse("select 1"), Sync]),
            (A, vec![Query(s("select 2"))]),
            (B, vec![parse("select 3"), Sync]),
            (A, vec![bind(), run(), Sync]),
        ],
    )
    .await;
    same_as_directly(
        "closed",
        vec![
            (A, vec![parse("select 1"), Sync]),
            (A, vec![Close('S', s("")), Sync]),
            (B, vec![parse("select 3"), Sync]),
            (A, vec![bind(), run(), Sync]),
        ],
    )
    .await;
    same_as_directly(
        "refused by the server",
        vec![
            (A, vec![parse("select 1"), Sync]),
            (A, vec![parse("selec 1"), Sync]),
            (B, vec![parse("select 3"), Sync]),
            (A, vec![bind(), run(), Sync]),
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parse_skipped_after_an_error_leaves_the_one_before() {
    same_as_directly(
        "skipped",
        vec![
            (A, vec![parse("select 'before'"), Sync]),
            (B, vec![parse("select 'other'"), Sync]),
            (
                A,
                vec![Execute(s("nope"), 0), parse("select 'skipped'"), Sync],
            ),
            (A, vec![bind(), run(), Sync]),
        ],
    )
    .await;
    // The Bind goes out before the skipped Parse's answer is in: usher
    // waits for it (and parses the one before again).
    same_as_directly(
        "skipped, the Bind in the same write",
        vec![
            (A, vec![parse("select 'before'"), Sync]),
            (B, vec![parse("select 'other'"), Sync]),
            (
                A,
                vec![
                    Execute(s("nope"), 0),
                    parse("select 'skipped'"),
                    Sync,
                    bind(),
                    run(),
                    Sync,
                ],
            ),
            (A, vec![parse("select 'first'"), Sync, bind(), run(), Sync]),
        ],
    )
    .await;
    // Refused after a Bind that ran: the error is the Parse's own, and
    // the client has none.
    same_as_directly(
        "refused after other messages, the Bind in the same write",
        vec![
            (A, vec![parse("select 'before'"), Sync]),
            (B, vec![parse("select 'other'"), Sync]),
            (
                A,
                vec![bind(), run(), parse("selec"), Sync, bind(), run(), Sync],
            ),
        ],
    )
    .await;
}
