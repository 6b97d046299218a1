//! PgBouncer's online restart of PostgreSQL: PAUSE, restart the server,
//! RESUME, and the clients lose nothing. On a cluster of its own, since
//! the test restarts it.

use crate::common::canary::Canary;
use crate::common::console::console_messages;
use crate::common::{PgCluster, Usher};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Clients that keep running transactions until told to stop: how many
/// each completed, and every error any of them got.
struct Load {
    stop: Arc<AtomicBool>,
    done: Vec<Arc<AtomicU64>>,
    tasks: Vec<tokio::task::JoinHandle<Vec<String>>>,
}

impl Load {
    async fn start(usher: &Usher, clients: usize) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let mut done = Vec::new();
        let mut tasks = Vec::new();
        for n in 0..clients {
            let mut client = usher.alice().await;
            let (stop, count) = (stop.clone(), Arc::new(AtomicU64::new(0)));
            done.push(count.clone());
            tasks.push(tokio::spawn(async move {
                let mut errors = Vec::new();
                let mut i = 0i64;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    // A transaction block with a prepared statement (named,
                    // as tokio-postgres prepares), then a lone statement.
                    let step = async {
                        let t = client.transaction().await?;
                        let row = t.query_one("SELECT $1::int8 + 1", &[&i]).await?;
                        assert_eq!(row.get::<_, i64>(0), i + 1);
                        t.commit().await?;
                        client.simple_query("SELECT 1").await?;
                        Ok::<_, tokio_postgres::Error>(())
                    };
                    if let Err(e) = step.await {
                        errors.push(format!("client {n}, turn {i}: {e:?}"));
                        if client.is_closed() {
                            break;
                        }
                    }
                    count.fetch_add(1, Ordering::Relaxed);
                    // A pause between transactions, so that the pool
                    // holds idle connections when PAUSE comes.
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                errors
            }));
        }
        Load { stop, done, tasks }
    }

    /// Waits until every client has completed `more` transactions from now
    /// (or one has lost its connection).
    async fn run_on(&self, more: u64) {
        let from: Vec<u64> = self
            .done
            .iter()
            .map(|d| d.load(Ordering::Relaxed))
            .collect();
        crate::common::wait::wait_for_async(
            Duration::from_secs(30),
            &format!("every client completes {more} more transactions"),
            || async {
                let now: Vec<u64> = self
                    .done
                    .iter()
                    .map(|d| d.load(Ordering::Relaxed))
                    .collect();
                // A client whose connection was lost has stopped: its
                // errors tell the rest.
                let lost = self.tasks.iter().any(|t| t.is_finished());
                if lost || now.iter().zip(&from).all(|(n, f)| n - f >= more) {
                    Ok(())
                } else {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    Err(format!("{from:?} -> {now:?}"))
                }
            },
        )
        .await
    }

    async fn errors(self) -> Vec<String> {
        self.stop.store(true, Ordering::Relaxed);
        let mut errors = Vec::new();
        for task in self.tasks {
            errors.extend(task.await.unwrap());
        }
        errors
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_restart_postgresql_resume_loses_no_query() {
    let pg = PgCluster::own(module_path!());
    // min_pool_size: the pool also opens connections on its own.
    let usher = Usher::start(
        pg,
        "pool_mode: transaction\npool_size: 4\nmin_pool_size: 4\n",
    )
    .await;
    let port = usher.addr.port();
    let load = Load::start(&usher, 3).await;
    load.run_on(20).await;

    // PAUSE returns once every transaction in flight has ended; the
    // clients' next transactions wait.
    console_messages(port, "PAUSE").await.expect("PAUSE");
    tokio::task::spawn_blocking(|| PgCluster::own(module_path!()).restart())
        .await
        .unwrap();
    console_messages(port, "RESUME").await.expect("RESUME");

    // Every client goes on without an error, and from RESUME on nobody
    // stalls (the waits PAUSE imposes end at RESUME).
    let canary = Canary::start(port);
    load.run_on(50).await;
    canary.check();
    let errors = load.errors().await;
    assert!(
        errors.is_empty(),
        "{} errors:\n{}",
        errors.len(),
        errors.join("\n")
    );
}
