//! Clients taking turns, through usher and directly: each turn is one
//! client's batch, sent whole and answered up to its last ReadyForQuery;
//! the same turns run on direct connections and through usher (one and
//! two server connections in transaction mode, and session mode), and
//! every answer must be the same. For state PostgreSQL keeps per session
//! that usher carries across server connections (statements, names).

#![allow(dead_code)]

use super::raw::{Msg, RawClient};
use super::wire::Frontend;
use super::{PgCluster, UsherProcess};

/// A client's answers with error texts left out (they may differ in
/// wording, not in code) and asynchronous messages dropped.
fn comparable(got: Vec<Msg>) -> Vec<Msg> {
    got.into_iter()
        .filter_map(|m| match m {
            Msg::Error(code, _) => Some(Msg::Error(code, String::new())),
            Msg::Notice(..) | Msg::Parameter(..) => None,
            m => Some(m),
        })
        .collect()
}

async fn answers(clients: &mut [RawClient], turns: &[(usize, Vec<Frontend>)]) -> Vec<Vec<Msg>> {
    let mut all = Vec::new();
    for (who, batch) in turns {
        all.push(comparable(clients[*who].batch(batch).await));
    }
    all
}

/// Runs `turns` (which client, its batch; clients counted from 0) on
/// direct connections, then through usher in each configuration; all
/// must agree. `setup` runs as the superuser before each run (e.g. to
/// make the tables the turns change afresh).
pub async fn same_as_directly(what: &str, setup: &str, turns: Vec<(usize, Vec<Frontend>)>) {
    let pg = PgCluster::shared();
    let params = [("user", "alice"), ("database", "app")];
    let count = turns.iter().map(|(who, _)| who + 1).max().unwrap_or(0);
    if !setup.is_empty() {
        pg.psql_super_db("app", setup);
    }
    let mut direct = Vec::new();
    for _ in 0..count {
        direct.push(RawClient::unix(&pg.dir, pg.port, &params).await.0);
    }
    let expected = answers(&mut direct, &turns).await;
    for (mode, size) in [("transaction", 1), ("transaction", 2), ("session", 2)] {
        if !setup.is_empty() {
            pg.psql_super_db("app", setup);
        }
        let usher = UsherProcess::builder(pg)
            .extra(&format!(
                "auth:\n  method: trust\npool_mode: {mode}\npool_size: {size}\n"
            ))
            .start();
        let mut through = Vec::new();
        for _ in 0..count {
            through.push(RawClient::tcp(usher.addr(), &params).await.0);
        }
        let got = answers(&mut through, &turns).await;
        for (i, (got, expected)) in got.iter().zip(&expected).enumerate() {
            assert_eq!(
                got, expected,
                "{what}, {mode}/{size}, turn {i} (client {}): through usher, then directly",
                turns[i].0
            );
        }
    }
}
