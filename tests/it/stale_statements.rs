//! A shared server statement prepared before DDL never serves a later
//! Parse (issue 26, item 5): in transaction mode usher shares one server
//! statement among the clients that prepare the same text, and DDL may
//! change what that text means (its parameter and result types). A new
//! client's Parse of the text after DDL that passed through usher must get
//! what a fresh Parse gets directly; DDL usher did not see is caught by
//! the server's 0A000 or XX000, after which the statement is prepared
//! afresh. Two clients take turns through usher and directly
//! (`common::turns`).

use crate::common::turns::same_as_directly;
use crate::common::wire::Frontend::*;

fn s(x: &str) -> String {
    x.to_string()
}

const A: usize = 0;
const B: usize = 1;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_parse_after_ddl_gets_the_new_types() {
    same_as_directly(
        "a parameter type changed",
        "DROP TABLE IF EXISTS stale_p; CREATE TABLE stale_p (v date); GRANT ALL ON stale_p TO alice",
        vec![
            (
                A,
                vec![
                    Parse(s("s1"), s("insert into stale_p values ($1)"), vec![]),
                    Describe('S', s("s1")),
                    Sync,
                ],
            ),
            (A, vec![Query(s("drop table stale_p; create table stale_p (v int)"))]),
            (
                B,
                vec![
                    Parse(s("s1"), s("insert into stale_p values ($1)"), vec![]),
                    Describe('S', s("s1")),
                    Bind(s(""), s("s1"), vec![Some(s("7"))]),
                    Execute(s(""), 0),
                    Sync,
                ],
            ),
        ],
    )
    .await;
    same_as_directly(
        "a column added",
        "DROP TABLE IF EXISTS stale_r; CREATE TABLE stale_r (a int); INSERT INTO stale_r VALUES (1); GRANT ALL ON stale_r TO alice",
        vec![
            (
                A,
                vec![
                    Parse(s("s2"), s("select * from stale_r"), vec![]),
                    Bind(s(""), s("s2"), vec![]),
                    Execute(s(""), 0),
                    Sync,
                ],
            ),
            (A, vec![Query(s("alter table stale_r add column b int"))]),
            (
                B,
                vec![
                    Parse(s("s3"), s("select * from stale_r"), vec![]),
                    Bind(s(""), s("s3"), vec![]),
                    Describe('P', s("")),
                    Execute(s(""), 0),
                    Sync,
                ],
            ),
        ],
    )
    .await;
    same_as_directly(
        "a type made again",
        "DROP TYPE IF EXISTS stale_mood CASCADE; CREATE TYPE stale_mood AS ENUM ('a'); GRANT USAGE ON TYPE stale_mood TO alice",
        vec![
            (
                A,
                vec![
                    Parse(s("s4"), s("select $1::stale_mood::text"), vec![]),
                    Bind(s(""), s("s4"), vec![Some(s("a"))]),
                    Execute(s(""), 0),
                    Sync,
                ],
            ),
            (
                A,
                vec![Query(s(
                    "drop type stale_mood; create type stale_mood as enum ('a', 'b')",
                ))],
            ),
            (
                B,
                vec![
                    Parse(s("s5"), s("select $1::stale_mood::text"), vec![]),
                    Bind(s(""), s("s5"), vec![Some(s("b"))]),
                    Execute(s(""), 0),
                    Sync,
                ],
            ),
        ],
    )
    .await;
}
