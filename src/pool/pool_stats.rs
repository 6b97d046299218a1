//! A pool's counters: relaxed atomics for the console (SHOW POOLS, STATS)
//! mirrored into metric handles registered once per pool, and the guards
//! that keep the gauges true however a task ends.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Counters of one pool, for the console and metrics. Relaxed atomics,
/// mirrored into metric handles registered once per pool.
#[derive(Debug)]
pub struct PoolStats {
    metrics: PoolMetrics,
    pub server_connects: AtomicU64,
    /// Clients that logged in to this pool (an auto database's pool is
    /// in use while this moves; see `registry::spawn_maintenance`).
    pub logins: AtomicU64,
    pub checkouts: AtomicU64,
    pub transactions: AtomicU64,
    pub waiting: AtomicUsize,
    pub active: AtomicUsize,
    /// Total microseconds clients waited for a server connection.
    pub wait_us: AtomicU64,
    /// Queries (simple Query and extended Execute messages) clients sent.
    pub queries: AtomicU64,
    /// Bytes from clients to servers, and from servers to clients.
    pub received: AtomicU64,
    pub sent: AtomicU64,
    /// Total microseconds server connections spent lent for a transaction
    /// (transaction mode).
    pub xact_us: AtomicU64,
    /// Clients holding a server connection of this pool right now.
    pub clients_active: AtomicUsize,
    /// Server connections being opened (connect and login) right now.
    pub servers_login: AtomicUsize,
    /// Pin slots held: server connections pinned to their client
    /// (transaction mode), or about to be.
    pub pinned: AtomicUsize,
    /// Idle server connections, as last told to the idle gauge (whose
    /// series two pools may share: see [`PoolStats::idle_servers`]).
    idle_now: AtomicUsize,
}

/// The Prometheus side of [`PoolStats`].
#[derive(Debug)]
struct PoolMetrics {
    transactions: metrics::Counter,
    waiting: metrics::Gauge,
    active: metrics::Gauge,
    idle: metrics::Gauge,
    connects: metrics::Counter,
    wait: metrics::Histogram,
    clients_active: metrics::Gauge,
    servers_login: metrics::Gauge,
    pinned: metrics::Gauge,
    transaction: metrics::Histogram,
    queries: metrics::Counter,
    received: metrics::Counter,
    sent: metrics::Counter,
}

impl PoolStats {
    pub(super) fn new(database: &str, user: &str) -> Self {
        use crate::metrics as m;
        let labels = [
            ("database", database.to_string()),
            ("user", user.to_string()),
        ];
        PoolStats {
            metrics: PoolMetrics {
                transactions: metrics::counter!(m::TRANSACTIONS, &labels),
                waiting: metrics::gauge!(m::CLIENTS_WAITING, &labels),
                active: metrics::gauge!(m::SERVERS_ACTIVE, &labels),
                idle: metrics::gauge!(m::SERVERS_IDLE, &labels),
                connects: metrics::counter!(m::SERVER_CONNECTS, &labels),
                wait: metrics::histogram!(m::WAIT_SECONDS, &labels),
                clients_active: metrics::gauge!(m::CLIENTS_ACTIVE, &labels),
                servers_login: metrics::gauge!(m::SERVERS_LOGIN, &labels),
                pinned: metrics::gauge!(m::PINNED_SERVERS, &labels),
                transaction: metrics::histogram!(m::TRANSACTION_SECONDS, &labels),
                queries: metrics::counter!(m::QUERIES, &labels),
                received: metrics::counter!(m::CLIENT_RECEIVED_BYTES, &labels),
                sent: metrics::counter!(m::CLIENT_SENT_BYTES, &labels),
            },
            server_connects: AtomicU64::new(0),
            logins: AtomicU64::new(0),
            checkouts: AtomicU64::new(0),
            transactions: AtomicU64::new(0),
            waiting: AtomicUsize::new(0),
            active: AtomicUsize::new(0),
            wait_us: AtomicU64::new(0),
            queries: AtomicU64::new(0),
            received: AtomicU64::new(0),
            sent: AtomicU64::new(0),
            xact_us: AtomicU64::new(0),
            clients_active: AtomicUsize::new(0),
            servers_login: AtomicUsize::new(0),
            pinned: AtomicUsize::new(0),
            idle_now: AtomicUsize::new(0),
        }
    }

    /// Takes a pin slot if fewer than `max` are held (0: no cap).
    pub(super) fn try_pin(&self, max: usize) -> bool {
        let taken = self
            .pinned
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (max == 0 || n < max).then_some(n + 1)
            })
            .is_ok();
        if taken {
            self.metrics.pinned.increment(1.0);
        }
        taken
    }

    pub(super) fn unpin(&self) {
        self.pinned.fetch_sub(1, Ordering::AcqRel);
        self.metrics.pinned.decrement(1.0);
    }

    fn waiting(&self, delta: isize) {
        if delta > 0 {
            self.waiting.fetch_add(1, Ordering::Relaxed);
        } else {
            self.waiting.fetch_sub(1, Ordering::Relaxed);
        }
        self.metrics.waiting.increment(delta as f64);
    }

    fn active(&self, delta: isize) {
        if delta > 0 {
            self.active.fetch_add(1, Ordering::Relaxed);
        } else {
            self.active.fetch_sub(1, Ordering::Relaxed);
        }
        self.metrics.active.increment(delta as f64);
    }

    /// A client waited this long for a pin slot (or gave up): the total
    /// and a sample of the histogram.
    pub(super) fn waited(&self, wait: Duration) {
        self.wait_sample(wait);
        self.waited_for_place(wait);
    }

    /// One checkout's whole wait (for a place, and for the server to come
    /// back), a sample of the histogram (`usher_pool_wait_seconds`).
    pub(super) fn wait_sample(&self, wait: Duration) {
        self.metrics.wait.record(wait.as_secs_f64());
    }

    /// A client waited this long for a place in the pool: added to the
    /// total (SHOW STATS).
    pub(super) fn waited_for_place(&self, wait: Duration) {
        self.wait_us
            .fetch_add(wait.as_micros() as u64, Ordering::Relaxed);
    }

    /// A client waited this long for the server to come back (an outage),
    /// after its wait for a place: added to the total (SHOW STATS); the
    /// checkout's histogram sample has both ([`PoolStats::wait_sample`]).
    pub(super) fn waited_for_server(&self, wait: Duration) {
        self.wait_us
            .fetch_add(wait.as_micros() as u64, Ordering::Relaxed);
    }

    /// Idle server connections in the pool now (called as its idle lists
    /// change; of two calls at once on two shards the later swap stands
    /// until the next). The gauge moves by the change: pools of one base
    /// database and user on two routes share its series (the labels are
    /// the base's), which then holds their sum, not the last one's count.
    pub(super) fn idle_servers(&self, n: usize) {
        let before = self.idle_now.swap(n, Ordering::Relaxed);
        if n != before {
            self.metrics.idle.increment(n as f64 - before as f64);
        }
    }

    pub(super) fn connected(&self) {
        self.server_connects.fetch_add(1, Ordering::Relaxed);
        self.metrics.connects.increment(1);
    }

    /// A transaction ended (the server said ReadyForQuery 'I' with nothing owed).
    pub fn transaction_done(&self) {
        self.transactions.fetch_add(1, Ordering::Relaxed);
        self.metrics.transactions.increment(1);
    }

    /// A client took (+1) or gave back (-1) a server connection.
    pub fn client_active(&self, delta: isize) {
        if delta > 0 {
            self.clients_active.fetch_add(1, Ordering::Relaxed);
        } else {
            self.clients_active.fetch_sub(1, Ordering::Relaxed);
        }
        self.metrics.clients_active.increment(delta as f64);
    }

    /// A transaction-mode server connection went back after `lent`.
    pub fn transaction_time(&self, lent: Duration) {
        self.xact_us
            .fetch_add(lent.as_micros() as u64, Ordering::Relaxed);
        self.metrics.transaction.record(lent.as_secs_f64());
    }

    /// Queries (Query and Execute messages) clients sent.
    pub fn queries(&self, n: u64) {
        if n > 0 {
            self.queries.fetch_add(n, Ordering::Relaxed);
            self.metrics.queries.increment(n);
        }
    }

    /// Bytes received from a client (forwarded to its server).
    pub fn received(&self, bytes: u64) {
        self.received.fetch_add(bytes, Ordering::Relaxed);
        self.metrics.received.increment(bytes);
    }

    /// Bytes sent to a client (from its server).
    pub fn sent(&self, bytes: u64) {
        self.sent.fetch_add(bytes, Ordering::Relaxed);
        self.metrics.sent.increment(bytes);
    }

    /// Counts a server connection being opened until the guard drops
    /// (the connect and login ended, well or not, or were abandoned).
    pub(super) fn logging_in(&self) -> LoginGuard<'_> {
        self.servers_login.fetch_add(1, Ordering::Relaxed);
        self.metrics.servers_login.increment(1.0);
        LoginGuard(self)
    }
}

impl Drop for PoolStats {
    /// A pool that goes takes its idle connections out of the shared series.
    fn drop(&mut self) {
        let idle = *self.idle_now.get_mut();
        if idle > 0 {
            self.metrics.idle.decrement(idle as f64);
        }
    }
}

/// See [`PoolStats::logging_in`].
pub(super) struct LoginGuard<'a>(&'a PoolStats);

impl Drop for LoginGuard<'_> {
    fn drop(&mut self) {
        self.0.servers_login.fetch_sub(1, Ordering::Relaxed);
        self.0.metrics.servers_login.decrement(1.0);
    }
}

/// Counts a lent connection as active until dropped: however a checkout
/// ends (checked in, discarded, or dropped with a task that was killed),
/// the count comes back down.
#[derive(Debug)]
pub(super) struct Lent(Arc<PoolStats>);

impl Lent {
    pub(super) fn new(stats: &Arc<PoolStats>) -> Lent {
        stats.active(1);
        Lent(stats.clone())
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        self.0.active(-1);
    }
}

/// Counts a client waiting for a connection until dropped (a waiting task
/// may be killed).
pub(super) struct Waiting<'a>(&'a PoolStats);

impl<'a> Waiting<'a> {
    pub(super) fn new(stats: &'a PoolStats) -> Waiting<'a> {
        stats.waiting(1);
        Waiting(stats)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.waiting(-1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The idle gauge's value for (db, alice), as the exporter renders it.
    fn idle_gauge(handle: &metrics_exporter_prometheus::PrometheusHandle) -> f64 {
        let text = handle.render();
        let line = text
            .lines()
            .find(|l| l.starts_with(crate::metrics::SERVERS_IDLE) && l.contains("user=\"alice\""))
            .unwrap_or_else(|| panic!("no idle gauge in {text}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    }

    #[test]
    fn two_pools_sharing_labels_sum_in_the_idle_gauge() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let (a, b) = metrics::with_local_recorder(&recorder, || {
            (PoolStats::new("db", "alice"), PoolStats::new("db", "alice"))
        });
        a.idle_servers(3);
        b.idle_servers(2);
        assert_eq!(idle_gauge(&handle), 5.0);
        a.idle_servers(1);
        b.idle_servers(2);
        assert_eq!(idle_gauge(&handle), 3.0);
        drop(b);
        assert_eq!(idle_gauge(&handle), 1.0, "a pool that goes leaves the sum");
        a.idle_servers(0);
        assert_eq!(idle_gauge(&handle), 0.0);
    }
}
