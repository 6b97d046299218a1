//! Server faults: PostgreSQL restarted under load, a backend killed in the
//! middle of a transaction. The pool heals itself without restarting usher.

use crate::common;

use crate::common::wait::eventually_async;
use crate::common::{sqlstate, PgCluster, Usher};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pool_heals_after_postgresql_restarts_under_load() {
    let pg = Arc::new(PgCluster::start());
    for mode in ["transaction", "session"] {
        let usher =
            Arc::new(Usher::start(&pg, &format!("pool_mode: {mode}\npool_size: 5\n")).await);
        let stop = Arc::new(AtomicBool::new(false));
        let ok = Arc::new(AtomicU64::new(0));
        let mut workers = Vec::new();
        for _ in 0..4 {
            let (usher, stop, ok) = (usher.clone(), stop.clone(), ok.clone());
            workers.push(tokio::spawn(async move {
                let mut errors = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    // Reconnect after each failure, as an application would.
                    // (Connecting fails while the server is down.)
                    let Ok(c) = usher.connect_as("alice", common::ALICE_PASSWORD).await else {
                        // An application's pause between attempts (the
                        // workload, not a wait for an event).
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    };
                    loop {
                        match c.query_one("SELECT 1 FROM pg_sleep(0.01)", &[]).await {
                            Ok(_) => {
                                ok.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) => {
                                errors.push(e);
                                break;
                            }
                        }
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                    }
                }
                errors
            }));
        }
        eventually_async(
            Duration::from_secs(20),
            &format!("{mode}: queries run before the restart"),
            || async { ok.load(Ordering::Relaxed) >= 20 },
        )
        .await;
        // A query surely running when the server stops, on a fifth server
        // connection (in session mode the workers hold four): the workers'
        // short ones may all be between statements on a loaded machine.
        let long = usher.alice().await;
        let running = tokio::spawn(async move {
            let r = long.query_one("SELECT pg_sleep(30)", &[]).await;
            (long, r)
        });
        let pg2 = pg.clone();
        tokio::task::spawn_blocking(move || {
            let active = "SELECT count(*) FROM pg_stat_activity \
                          WHERE query = 'SELECT pg_sleep(30)' AND state = 'active'";
            while pg2.psql_super(active).trim() != "1" {
                std::thread::sleep(Duration::from_millis(10));
            }
            pg2.restart()
        })
        .await
        .unwrap();
        let after_restart = ok.load(Ordering::Relaxed);
        // Queries succeed again once the server is back, without restarting usher.
        eventually_async(
            Duration::from_secs(15),
            &format!("{mode}: queries succeed after the restart"),
            || async { ok.load(Ordering::Relaxed) >= after_restart + 50 },
        )
        .await;
        stop.store(true, Ordering::Relaxed);
        let (_long, interrupted) = running.await.unwrap();
        let Err(interrupted) = interrupted else {
            panic!("{mode}: the restart did not interrupt the running query")
        };
        let mut errors = vec![interrupted];
        for w in workers {
            errors.extend(w.await.unwrap());
        }
        for e in &errors {
            // Clients got a clear error from the server or usher, or lost the connection.
            if let Some(code) = sqlstate(e) {
                assert!(
                    ["57P01", "08006", "57P03"].contains(&code.as_str()),
                    "{mode}: unexpected {e:?}"
                );
            } else {
                assert!(
                    e.is_closed() || e.to_string().contains("connection"),
                    "{mode}: unexpected {e:?}"
                );
            }
        }
        // A new client and the pool are fine.
        let c = usher.alice().await;
        assert_eq!(
            c.query_one("SELECT 1", &[]).await.unwrap().get::<_, i32>(0),
            1
        );
    }
}

/// A backend killed while its client is inside a transaction (transaction
/// mode): the client gets PostgreSQL's 57P01 for its next statement, as
/// ERROR, and keeps its connection to usher; its block is aborted (25P02)
/// until it rolls back, and then it goes on over another backend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_killed_mid_transaction_fails_only_its_transaction() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "pool_mode: transaction\npool_size: 2\n").await;
    let mut victim = usher.alice().await;
    let bystander = usher.alice().await;
    let tx = victim.transaction().await.unwrap();
    let pid: i32 = tx
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        pg.psql_super(&format!("SELECT pg_terminate_backend({pid})")),
        "t"
    );
    // Whether the FATAL arrived before or while the statement was sent,
    // the statement gets it, as an ERROR.
    let e = tx
        .query_one("SELECT 1", &[])
        .await
        .expect_err("the victim's statement fails");
    let db = e.as_db_error().unwrap_or_else(|| panic!("{e:?}"));
    assert_eq!(
        (db.severity(), db.code().code()),
        ("ERROR", "57P01"),
        "{db:?}"
    );
    // The block is aborted, as after any error, until the client ends it.
    let e = tx
        .simple_query("SELECT 2")
        .await
        .expect_err("an aborted block refuses statements");
    assert_eq!(sqlstate(&e).as_deref(), Some("25P02"), "{e:?}");
    tx.rollback().await.expect("ROLLBACK ends the block");
    // The victim's connection stays, and its next statement runs on
    // another backend.
    assert!(!victim.is_closed());
    assert_ne!(common::backend_pid(&victim).await, pid);
    // Other clients never notice, and the dead connection left the pool.
    for _ in 0..5 {
        assert_ne!(common::backend_pid(&bystander).await, pid);
    }
}
