//! Metric names and the Prometheus endpoint (served by [`http`]).
//!
//! Recording goes through the `metrics` crate: handles are registered once
//! (per pool, per hook) and incremented with relaxed atomics, so the
//! forwarding path takes no lock. Labels are bounded: database, user (only
//! users that passed authentication have pools), hook file, event, outcome,
//! SQLSTATE class — never an unknown user name or a client address.

pub(crate) mod http;

use crate::config::MetricsConfig;
use metrics::Counter;
use metrics_exporter_prometheus::PrometheusHandle;
use std::sync::{LazyLock, OnceLock};
use std::time::Duration;

pub const TRANSACTIONS: &str = "usher_transactions_total";
pub const CLIENTS_WAITING: &str = "usher_pool_clients_waiting";
pub const SERVERS_ACTIVE: &str = "usher_pool_servers_active";
pub const SERVERS_IDLE: &str = "usher_pool_servers_idle";
pub const SERVER_CONNECTS: &str = "usher_server_connects_total";
pub const WAIT_SECONDS: &str = "usher_pool_wait_seconds";
pub const AUTH_ATTEMPTS: &str = "usher_auth_attempts_total";
pub const CLIENTS_CONNECTED: &str = "usher_clients_connected";
pub const CLIENTS_ACTIVE: &str = "usher_pool_clients_active";
pub const SERVERS_LOGIN: &str = "usher_pool_servers_login";
pub const TRANSACTION_SECONDS: &str = "usher_pool_transaction_seconds";
pub const QUERIES: &str = "usher_queries_total";
pub const CLIENT_RECEIVED_BYTES: &str = "usher_client_received_bytes_total";
pub const CLIENT_SENT_BYTES: &str = "usher_client_sent_bytes_total";
pub const ERRORS: &str = "usher_errors_total";
pub const HOOK_DURATION: &str = "usher_hook_duration_seconds";
/// Clients refused because a hook's route was outside `routing.allow`, per hook.
pub const ROUTES_REFUSED: &str = "usher_routes_refused_total";

/// Counts a route refused (a hook file's name is a bounded label).
pub fn route_refused(hook: &str) {
    metrics::counter!(ROUTES_REFUSED, "hook" => hook.to_string()).increment(1);
}

/// Hook threads set aside, still in a call past its deadline (set by
/// hooks::lua::threads).
pub const HOOK_THREADS_STUCK: &str = "usher_hook_threads_stuck";
pub const PINNED_SERVERS: &str = "usher_pinned_servers";
/// Bucket bounds (seconds) of the pool histograms (wait, transaction).
const POOL_BUCKETS: &[f64] = &[
    0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 60.0,
];
/// Bucket bounds (seconds) of hook call durations (the budget is 100 ms by
/// default).
const HOOK_BUCKETS: &[f64] = &[
    0.00001, 0.00005, 0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0,
];
/// Prefix of the process metrics (`usher_process_resident_memory_bytes`, ...).
pub const PROCESS_PREFIX: &str = "usher_";

/// How often the process metrics are read (from /proc on Linux).
const PROCESS_INTERVAL: Duration = Duration::from_secs(5);

/// The endpoint, bound and with its recorder installed, to be served on
/// the runtime ([`Endpoint::serve`]).
#[derive(Debug)]
pub struct Endpoint {
    listener: std::net::TcpListener,
    handle: PrometheusHandle,
    limits: http::Limits,
}

/// Why the metrics endpoint could not start (the port is taken...).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot start the metrics endpoint on {listen}: {reason}")]
pub struct InstallError {
    pub listen: std::net::SocketAddr,
    pub reason: String,
}

/// Installs the Prometheus recorder and binds its HTTP endpoint
/// (`GET /metrics`, bounded as `config` says); starts the process metrics.
/// Call once, before anything registers a metric. The endpoint is served
/// once a runtime runs ([`Endpoint::serve`]); binding now means a port
/// taken is an error at start.
pub fn install(config: &MetricsConfig) -> Result<Option<Endpoint>, InstallError> {
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
    let Some(listen) = config.listen else {
        return Ok(None);
    };
    let failed = |e: &dyn std::fmt::Display| InstallError {
        listen,
        reason: e.to_string(),
    };
    // Histograms with buckets (not the exporter's default summaries), so
    // that they can be summed across pools and instances.
    let buckets = |b: PrometheusBuilder, name: &str, values: &[f64]| {
        b.set_buckets_for_metric(Matcher::Full(name.to_string()), values)
    };
    let builder = PrometheusBuilder::new();
    let builder = buckets(builder, WAIT_SECONDS, POOL_BUCKETS).map_err(|e| failed(&e))?;
    let builder = buckets(builder, TRANSACTION_SECONDS, POOL_BUCKETS).map_err(|e| failed(&e))?;
    let builder = buckets(builder, HOOK_DURATION, HOOK_BUCKETS).map_err(|e| failed(&e))?;
    let listener = std::net::TcpListener::bind(listen).map_err(|e| failed(&e))?;
    listener.set_nonblocking(true).map_err(|e| failed(&e))?;
    let handle = builder.install_recorder().map_err(|e| failed(&e))?;
    describe();
    start_process_collector(handle.clone());
    Ok(Some(Endpoint {
        listener,
        handle,
        limits: http::Limits {
            max_connections: config.max_connections,
            timeout: Duration::from_secs_f64(config.request_timeout),
        },
    }))
}

impl Endpoint {
    /// Serves `/metrics` until the runtime ends.
    pub async fn serve(self) {
        let listener = match tokio::net::TcpListener::from_std(self.listener) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "cannot serve the metrics endpoint");
                return;
            }
        };
        http::serve(listener, self.handle, self.limits).await
    }
}

/// Every [`PROCESS_INTERVAL`], on a small thread of its own (so the runtime
/// that forwards bytes is not involved): reads the process metrics
/// (resident and virtual memory, CPU seconds, open and maximum file
/// descriptors, threads, start time; from /proc on Linux), and does the
/// recorder's upkeep (histogram samples into their buckets).
fn start_process_collector(handle: PrometheusHandle) {
    let collector = metrics_process::Collector::new(PROCESS_PREFIX);
    collector.describe();
    collector.collect();
    let spawned = std::thread::Builder::new()
        .name("usher-process-metrics".into())
        .spawn(move || loop {
            std::thread::sleep(PROCESS_INTERVAL);
            collector.collect();
            handle.run_upkeep();
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start the process metrics thread");
    }
}

/// Counts a connected client (`usher_clients_connected`) until dropped.
#[derive(Debug)]
pub struct ClientConnected(());

impl ClientConnected {
    pub fn new() -> Self {
        clients_connected().increment(1.0);
        ClientConnected(())
    }
}

impl Default for ClientConnected {
    fn default() -> Self {
        ClientConnected::new()
    }
}

impl Drop for ClientConnected {
    fn drop(&mut self) {
        clients_connected().decrement(1.0);
    }
}

fn clients_connected() -> &'static metrics::Gauge {
    static GAUGE: OnceLock<metrics::Gauge> = OnceLock::new();
    GAUGE.get_or_init(|| metrics::gauge!(CLIENTS_CONNECTED))
}

/// Who sent an error to a client: usher itself, or the PostgreSQL server
/// (forwarded).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorSource {
    Usher = 0,
    Server = 1,
}

impl ErrorSource {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorSource::Usher => "usher",
            ErrorSource::Server => "server",
        }
    }
}

/// Slots of the error counters: one per class of two characters from
/// `0-9A-Z`, and the last for anything else (`other`).
const CLASS_SLOTS: usize = 36 * 36 + 1;

/// The `usher_errors_total` handles, registered the first time a class is
/// seen (with the recorder installed by then), so that counting an error
/// is an atomic load and an increment: no lock, not even the recorder's.
static ERROR_COUNTERS: LazyLock<[Box<[OnceLock<Counter>]>; 2]> =
    LazyLock::new(|| std::array::from_fn(|_| (0..CLASS_SLOTS).map(|_| OnceLock::new()).collect()));

/// The slot and label of an SQLSTATE's class: its first two characters
/// when both are digits or upper-case letters, else `other`.
fn error_class(sqlstate: &[u8]) -> (usize, String) {
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(usize::from(c - b'0')),
        b'A'..=b'Z' => Some(usize::from(c - b'A') + 10),
        _ => None,
    };
    match sqlstate {
        [a, b, ..] if sqlstate.len() == 5 => match (digit(*a), digit(*b)) {
            (Some(x), Some(y)) => (x * 36 + y, String::from_utf8_lossy(&sqlstate[..2]).into()),
            _ => (CLASS_SLOTS - 1, "other".into()),
        },
        _ => (CLASS_SLOTS - 1, "other".into()),
    }
}

/// Counts an error (ErrorResponse) sent to a client, by the class of its
/// SQLSTATE (`usher_errors_total{class, source}`).
pub fn count_error(source: ErrorSource, sqlstate: &[u8]) {
    let (slot, class) = error_class(sqlstate);
    ERROR_COUNTERS[source as usize][slot]
        .get_or_init(|| metrics::counter!(ERRORS, "class" => class, "source" => source.as_str()))
        .increment(1);
}

fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(
        TRANSACTIONS,
        "Transactions (server connection checkouts) completed per pool"
    );
    describe_gauge!(
        CLIENTS_WAITING,
        "Clients waiting for a server connection per pool"
    );
    describe_gauge!(
        SERVERS_ACTIVE,
        "Server connections lent to clients per pool"
    );
    describe_gauge!(SERVERS_IDLE, "Idle server connections per pool");
    describe_gauge!(
        PINNED_SERVERS,
        "Server connections pinned to their client per pool (transaction mode: LISTEN, session advisory locks, temporary objects, WITH HOLD cursors, SQL PREPARE, LOAD)"
    );
    describe_counter!(SERVER_CONNECTS, "Server connections opened per pool");
    describe_histogram!(
        WAIT_SECONDS,
        Unit::Seconds,
        "Time clients waited for a server connection"
    );
    describe_counter!(AUTH_ATTEMPTS, "Authentication attempts by outcome");
    describe_gauge!(CLIENTS_CONNECTED, "Clients connected");
    describe_gauge!(
        CLIENTS_ACTIVE,
        "Clients holding a server connection per pool"
    );
    describe_gauge!(
        SERVERS_LOGIN,
        "Server connections being opened (connect and login) per pool"
    );
    describe_histogram!(
        TRANSACTION_SECONDS,
        Unit::Seconds,
        "Time a server connection was lent for one transaction (transaction mode)"
    );
    describe_counter!(
        QUERIES,
        "Queries (simple Query and extended Execute messages) clients sent per pool"
    );
    describe_counter!(
        CLIENT_RECEIVED_BYTES,
        Unit::Bytes,
        "Bytes received from clients (and forwarded to servers) per pool"
    );
    describe_counter!(
        CLIENT_SENT_BYTES,
        Unit::Bytes,
        "Bytes sent to clients (from servers) per pool"
    );
    describe_counter!(
        ERRORS,
        "Errors sent to clients by SQLSTATE class, from usher itself or forwarded from the server"
    );
    describe_counter!("usher_hook_calls_total", "Hook calls per hook and event");
    describe_counter!("usher_hook_errors_total", "Hook calls that failed");
    describe_counter!(
        "usher_hook_timeouts_total",
        "Hook calls stopped by their time budget"
    );
    describe_counter!("usher_hook_rejects_total", "Clients rejected by a hook");
    describe_counter!(
        ROUTES_REFUSED,
        "Clients refused because a hook routed them outside routing.allow"
    );
    describe_gauge!(
        HOOK_THREADS_STUCK,
        "Hook threads set aside, still in a call past its deadline (one long C call)"
    );
    describe_histogram!(HOOK_DURATION, Unit::Seconds, "Duration of hook calls");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_classes_are_two_characters_or_other() {
        assert_eq!(error_class(b"28P01"), (2 * 36 + 8, "28".to_string()));
        assert_eq!(error_class(b"42601").1, "42");
        assert_eq!(error_class(b"XX000"), (33 * 36 + 33, "XX".to_string()));
        assert_eq!(error_class(b"0A000").1, "0A");
        for bad in [
            &b""[..],
            b"4",
            b"42",
            b"4a001",
            b"4\xff000",
            b"a2000",
            b"428010",
            b"\x00\x00000",
        ] {
            assert_eq!(
                error_class(bad),
                (CLASS_SLOTS - 1, "other".to_string()),
                "{bad:?}"
            );
        }
    }
}
