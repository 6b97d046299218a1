//! A canary client beside a failure-path test: one connection through
//! usher running `select 1` every 10 ms on a thread and runtime of its own
//! (so nothing the test does can slow it), and, every 100 ms, a fresh
//! login to the admin console (which needs no server connection).
//! [`Canary::check`] fails the test if any of them took longer than
//! [`STALL`]: whatever one client does, the others must never notice.
//!
//! The canary logs in as bob, whose pool is his own: a test that holds all
//! of alice's server connections does not make the canary wait for one.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The longest a canary's query may take.
pub const STALL: Duration = Duration::from_millis(250);

/// The longest a canary's console login may take. A SCRAM login is two
/// PBKDF2 derivations of 4,096 rounds (the canary's and usher's), a few
/// ms of CPU where a query is microseconds: with the whole suite on the
/// 2-core machine (4 test threads, in-process ushers, clusters), logins
/// took 260-322 ms with nothing stalled in usher, while the stalls the
/// canary is for (a runtime worker held by a hook, a spin) last seconds.
pub const LOGIN_STALL: Duration = Duration::from_millis(500);

/// How long one step is waited for before it counts as hung (then the
/// canary gives up: the test fails at check with what it saw).
const GIVE_UP: Duration = Duration::from_secs(10);

pub struct Canary {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Report>>,
}

#[derive(Debug, Default)]
struct Report {
    steps: u64,
    /// The slowest step for its limit: what it was, how long it took,
    /// and its limit.
    slowest: Option<(String, Duration, Duration)>,
    /// A step that failed outright.
    failure: Option<String>,
}

impl Report {
    fn record(&mut self, what: &str, took: Duration, limit: Duration) {
        self.steps += 1;
        let share = took.as_secs_f64() / limit.as_secs_f64();
        if self
            .slowest
            .as_ref()
            .is_none_or(|(_, d, l)| share > d.as_secs_f64() / l.as_secs_f64())
        {
            self.slowest = Some((what.to_string(), took, limit));
        }
    }
}

impl Canary {
    /// Starts the canary against usher at `port` (bob, database `app`).
    pub fn start(port: u16) -> Canary {
        let conn_str = format!(
            "host=127.0.0.1 port={port} user=bob password={} dbname=app",
            super::BOB_PASSWORD
        );
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(run(conn_str, stopping, ready_tx))
        });
        // The canary is connected before the test does anything.
        ready_rx
            .recv_timeout(GIVE_UP)
            .expect("the canary connects to usher");
        Canary {
            stop,
            thread: Some(thread),
        }
    }

    /// Stops the canary and fails the test if it ever stalled.
    pub fn check(mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let report = self.thread.take().unwrap().join().expect("canary thread");
        if let Some(failure) = &report.failure {
            panic!("the canary failed: {failure} ({report:?})");
        }
        let (what, took, limit) = report.slowest.clone().unwrap_or_default();
        assert!(
            took <= limit,
            "the canary stalled: {what} took {took:?} (over {limit:?}; {} steps)",
            report.steps
        );
        assert!(report.steps > 0, "the canary never ran");
    }
}

impl Drop for Canary {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

async fn connect(conn_str: &str) -> Result<tokio_postgres::Client, String> {
    let (client, conn) = tokio_postgres::connect(conn_str, tokio_postgres::NoTls)
        .await
        .map_err(|e| format!("login: {e}"))?;
    tokio::spawn(conn);
    Ok(client)
}

async fn run(
    conn_str: String,
    stop: Arc<AtomicBool>,
    ready: std::sync::mpsc::Sender<()>,
) -> Report {
    let mut report = Report::default();
    let console = conn_str
        .replace("user=bob", "user=admin")
        .replace(
            &format!("password={}", super::BOB_PASSWORD),
            "password=admin-pw",
        )
        .replace("dbname=app", "dbname=usher");
    let client = match connect(&conn_str).await {
        Ok(c) => c,
        Err(e) => {
            report.failure = Some(e);
            return report;
        }
    };
    // Warm: bob's pool opens its server connection now, not during the
    // first watched query.
    if let Err(e) = client.simple_query("select 1").await {
        report.failure = Some(format!("the first select 1: {e}"));
        return report;
    }
    let _ = ready.send(());
    let mut turn = 0u64;
    while !stop.load(Ordering::Relaxed) {
        turn += 1;
        let started = Instant::now();
        let (what, outcome) = if turn.is_multiple_of(10) {
            let login = async {
                let c = connect(&console).await?;
                c.simple_query("SHOW VERSION")
                    .await
                    .map(drop)
                    .map_err(|e| format!("SHOW VERSION after login: {e}"))
            };
            (
                "a console login",
                tokio::time::timeout(GIVE_UP, login).await,
            )
        } else {
            let query = async {
                client
                    .simple_query("select 1")
                    .await
                    .map(drop)
                    .map_err(|e| format!("select 1: {e}"))
            };
            ("select 1", tokio::time::timeout(GIVE_UP, query).await)
        };
        let took = started.elapsed();
        let limit = if what == "a console login" {
            LOGIN_STALL
        } else {
            STALL
        };
        report.record(what, took, limit);
        match outcome {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                report.failure = Some(e);
                return report;
            }
            Err(_) => {
                report.failure = Some(format!("{what} hung for {GIVE_UP:?}"));
                return report;
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    report
}
