//! Metric names and the Prometheus endpoint.
//!
//! Recording goes through the `metrics` crate: handles are registered once
//! (per pool, per hook) and incremented with relaxed atomics, so the
//! forwarding path takes no lock. Labels are bounded: database, user (only
//! users that passed authentication have pools), hook file, event, outcome —
//! never an unknown user name or a client address.

use std::net::SocketAddr;

pub const TRANSACTIONS: &str = "usher_transactions_total";
pub const CLIENTS_WAITING: &str = "usher_pool_clients_waiting";
pub const SERVERS_ACTIVE: &str = "usher_pool_servers_active";
pub const SERVERS_IDLE: &str = "usher_pool_servers_idle";
pub const SERVER_CONNECTS: &str = "usher_server_connects_total";
pub const WAIT_SECONDS: &str = "usher_pool_wait_seconds";
pub const AUTH_ATTEMPTS: &str = "usher_auth_attempts_total";
pub const CLIENTS_CONNECTED: &str = "usher_clients_connected";

/// Installs the Prometheus recorder and its HTTP endpoint (`GET /metrics`).
/// Call once, before anything registers a metric.
pub fn install(listen: SocketAddr) -> Result<(), String> {
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .with_http_listener(listen)
        .install()
        .map_err(|e| format!("cannot start the metrics endpoint on {listen}: {e}"))?;
    describe();
    Ok(())
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
    describe_counter!(SERVER_CONNECTS, "Server connections opened per pool");
    describe_histogram!(
        WAIT_SECONDS,
        Unit::Seconds,
        "Time clients waited for a server connection"
    );
    describe_counter!(AUTH_ATTEMPTS, "Authentication attempts by outcome");
    describe_gauge!(CLIENTS_CONNECTED, "Clients connected");
    describe_counter!("usher_hook_calls_total", "Hook calls per hook and event");
    describe_counter!("usher_hook_errors_total", "Hook calls that failed");
    describe_counter!(
        "usher_hook_timeouts_total",
        "Hook calls stopped by their time budget"
    );
    describe_counter!("usher_hook_rejects_total", "Clients rejected by a hook");
    describe_histogram!(
        "usher_hook_duration_seconds",
        Unit::Seconds,
        "Duration of hook calls"
    );
}
