//! The client side of `benches/restarts.sh` (run by hand, not part of CI).
//!
//! `--clients` connections through a pooler, each running `SELECT 1` every
//! `--interval-ms`, for `--secs`, while the script stops and starts
//! PostgreSQL underneath. What an application would do: a statement that
//! fails is counted and the next one goes at the next turn; a connection
//! that closes is counted and opened again (every `--interval-ms` until a
//! login succeeds).
//!
//! Prints one line of `key=value`: statements that succeeded, errors (by
//! SQLSTATE, and failed logins), the clients that lost their connection at
//! least once and how many times connections were lost, and the longest
//! stall: for one client, from the start of a statement that did not
//! succeed at once to the end of its next one that did (waits, errors and
//! reconnections included). A client still stalled at the end counts until
//! then.

use clap::Parser;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Parser)]
struct Args {
    /// libpq-style connection string.
    #[arg(long)]
    conn: String,
    #[arg(long, default_value_t = 20)]
    clients: usize,
    #[arg(long, default_value_t = 50)]
    interval_ms: u64,
    #[arg(long, default_value_t = 30)]
    secs: u64,
}

#[derive(Default)]
struct Report {
    ok: u64,
    errors: BTreeMap<String, u64>,
    disconnected_clients: u64,
    disconnections: u64,
    longest_stall: Duration,
}

async fn connect(conn: &str) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    let (client, driver) = tokio_postgres::connect(conn, tokio_postgres::NoTls).await?;
    tokio::spawn(driver);
    Ok(client)
}

fn code(e: &tokio_postgres::Error) -> String {
    e.as_db_error()
        .map(|d| d.code().code().to_string())
        .unwrap_or_else(|| "closed".to_string())
}

async fn client_loop(args: Arc<Args>, end: Instant, report: Arc<Mutex<Report>>) {
    let interval = Duration::from_millis(args.interval_ms);
    let mut client = None;
    let mut stalled_since: Option<Instant> = None;
    let mut lost_once = false;
    while Instant::now() < end {
        let started = Instant::now();
        let c = match client.take() {
            Some(c) => c,
            None => match connect(&args.conn).await {
                Ok(c) => c,
                Err(e) => {
                    *report
                        .lock()
                        .unwrap()
                        .errors
                        .entry(format!("login {}", code(&e)))
                        .or_default() += 1;
                    stalled_since.get_or_insert(started);
                    tokio::time::sleep(interval).await;
                    continue;
                }
            },
        };
        match c.simple_query("SELECT 1").await {
            Ok(_) => {
                let mut r = report.lock().unwrap();
                r.ok += 1;
                let since = stalled_since.take().unwrap_or(started);
                r.longest_stall = r.longest_stall.max(since.elapsed());
            }
            Err(e) => {
                stalled_since.get_or_insert(started);
                let mut r = report.lock().unwrap();
                *r.errors.entry(code(&e)).or_default() += 1;
                if c.is_closed() {
                    r.disconnections += 1;
                    if !std::mem::replace(&mut lost_once, true) {
                        r.disconnected_clients += 1;
                    }
                }
            }
        }
        // A closed connection is opened again at the next turn.
        if !c.is_closed() {
            client = Some(c);
        }
        tokio::time::sleep(interval).await;
    }
    if let Some(since) = stalled_since {
        let mut r = report.lock().unwrap();
        r.longest_stall = r.longest_stall.max(since.elapsed());
    }
}

#[tokio::main]
async fn main() {
    let args = Arc::new(Args::parse());
    let end = Instant::now() + Duration::from_secs(args.secs);
    let report = Arc::new(Mutex::new(Report::default()));
    let tasks: Vec<_> = (0..args.clients)
        .map(|_| tokio::spawn(client_loop(args.clone(), end, report.clone())))
        .collect();
    for t in tasks {
        // A statement still waiting at the end is waited for (a pooler
        // waits up to its query_wait_timeout); its wait is the stall.
        let _ = t.await;
    }
    let r = report.lock().unwrap();
    let errors: u64 = r.errors.values().sum();
    let by_code: Vec<String> = r.errors.iter().map(|(c, n)| format!("{c}:{n}")).collect();
    println!(
        "ok={} errors={} by_code={} disconnected_clients={} disconnections={} longest_stall_ms={}",
        r.ok,
        errors,
        if by_code.is_empty() {
            "-".to_string()
        } else {
            by_code.join(",")
        },
        r.disconnected_clients,
        r.disconnections,
        r.longest_stall.as_millis()
    );
}
