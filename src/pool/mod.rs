//! Pools of server connections, one per (database, user).
//!
//! A pool hands out [`Checkout`]s: a server connection plus a permit of the
//! pool's semaphore, so at most `pool_size` connections exist per pool and
//! clients beyond that wait (up to `query_wait_timeout`). Idle connections
//! sit in a per-pool list behind a short-held mutex: there is no lock shared
//! between pools, and none on the forwarding path.

mod registry;

pub use registry::Pools;

use crate::backend::{self, ServerConn, ServerTarget};
use crate::config::PoolMode;
use crate::protocol::error::sqlstate;
use crate::protocol::PgError;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Settings of one pool, resolved from the configuration.
#[derive(Debug, Clone)]
pub struct PoolSettings {
    pub mode: PoolMode,
    pub size: usize,
    pub query_wait_timeout: Duration,
    pub server_connect_timeout: Duration,
    pub server_reset_query: String,
}

/// Counters of one pool, for the console and metrics. Relaxed atomics.
#[derive(Debug, Default)]
pub struct PoolStats {
    pub server_connects: AtomicU64,
    pub checkouts: AtomicU64,
    pub waiting: AtomicUsize,
    pub active: AtomicUsize,
    /// Total microseconds clients waited for a server connection.
    pub wait_us: AtomicU64,
}

/// Server connections for one (database, user).
#[derive(Debug)]
pub struct Pool {
    pub database: String,
    pub user: String,
    pub settings: PoolSettings,
    target: ServerTarget,
    idle: Mutex<Vec<ServerConn>>,
    permits: Arc<Semaphore>,
    /// ParameterStatus values of the first server connection: what clients
    /// are told at login.
    server_params: OnceLock<Arc<HashMap<String, String>>>,
    pub stats: PoolStats,
}

/// A server connection lent to one client.
#[derive(Debug)]
pub struct Checkout {
    pub conn: ServerConn,
    /// True when the connection was opened for this checkout.
    pub fresh: bool,
    _permit: OwnedSemaphorePermit,
}

impl Pool {
    pub fn new(
        database: String,
        user: String,
        target: ServerTarget,
        settings: PoolSettings,
    ) -> Self {
        Pool {
            database,
            user,
            permits: Arc::new(Semaphore::new(settings.size)),
            settings,
            target,
            idle: Mutex::new(Vec::new()),
            server_params: OnceLock::new(),
            stats: PoolStats::default(),
        }
    }

    pub fn mode(&self) -> PoolMode {
        self.settings.mode
    }

    /// Idle server connections right now.
    pub fn idle_count(&self) -> usize {
        self.idle.lock().unwrap().len()
    }

    /// The server's reported parameters, learned from a server connection
    /// the first time a client logs in to this pool.
    pub async fn server_params(&self) -> Result<Arc<HashMap<String, String>>, PgError> {
        if let Some(p) = self.server_params.get() {
            return Ok(p.clone());
        }
        let checkout = self.checkout().await?;
        let params = Arc::new(checkout.conn.params.clone());
        self.checkin(checkout);
        Ok(self.server_params.get_or_init(|| params).clone())
    }

    /// Waits for a server connection: an idle one if any is alive, else a new one.
    pub async fn checkout(&self) -> Result<Checkout, PgError> {
        let started = std::time::Instant::now();
        self.stats.waiting.fetch_add(1, Ordering::Relaxed);
        let permit = tokio::time::timeout(
            self.settings.query_wait_timeout,
            self.permits.clone().acquire_owned(),
        )
        .await;
        self.stats.waiting.fetch_sub(1, Ordering::Relaxed);
        self.stats
            .wait_us
            .fetch_add(started.elapsed().as_micros() as u64, Ordering::Relaxed);
        let permit = match permit {
            Ok(Ok(p)) => p,
            Ok(Err(_)) => {
                return Err(PgError::fatal(sqlstate::ADMIN_SHUTDOWN, "pool is closed"));
            }
            Err(_) => {
                return Err(PgError::fatal(
                    sqlstate::TOO_MANY_CONNECTIONS,
                    format!(
                        "no server connection became free within query_wait_timeout ({:.1}s)",
                        self.settings.query_wait_timeout.as_secs_f64()
                    ),
                )
                .with_detail(format!(
                    "pool \"{}\"/\"{}\" has pool_size {} and all connections are in use",
                    self.database, self.user, self.settings.size
                )));
            }
        };
        self.stats.checkouts.fetch_add(1, Ordering::Relaxed);
        loop {
            let candidate = self.idle.lock().unwrap().pop();
            match candidate {
                Some(conn) if conn.looks_alive() => {
                    self.stats.active.fetch_add(1, Ordering::Relaxed);
                    return Ok(Checkout {
                        conn,
                        fresh: false,
                        _permit: permit,
                    });
                }
                Some(dead) => {
                    tracing::info!(
                        server = dead.id,
                        pid = dead.backend_pid(),
                        "dropping dead idle server connection"
                    );
                }
                None => break,
            }
        }
        let conn = backend::connect(&self.target, self.settings.server_connect_timeout).await?;
        self.stats.server_connects.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(server = conn.id, pid = conn.backend_pid(), db = %self.database, user = %self.user, "server connection opened");
        self.stats.active.fetch_add(1, Ordering::Relaxed);
        Ok(Checkout {
            conn,
            fresh: true,
            _permit: permit,
        })
    }

    /// Returns a clean server connection (idle, not in a transaction) to the pool.
    pub fn checkin(&self, mut checkout: Checkout) {
        self.stats.active.fetch_sub(1, Ordering::Relaxed);
        checkout.conn.last_used = std::time::Instant::now();
        self.idle.lock().unwrap().push(checkout.conn);
        // The permit drops here, after the connection is back in the list.
    }

    /// Closes a server connection that is not safe to reuse.
    pub fn discard(&self, checkout: Checkout) {
        self.stats.active.fetch_sub(1, Ordering::Relaxed);
        tracing::debug!(server = checkout.conn.id, "closing server connection");
        drop(checkout);
    }

    /// Session mode: runs `server_reset_query`, then returns the connection,
    /// or closes it if the reset fails.
    pub async fn reset_and_checkin(&self, mut checkout: Checkout) {
        let query = &self.settings.server_reset_query;
        if query.is_empty() {
            return self.checkin(checkout);
        }
        match checkout.conn.simple_query(query).await {
            Ok(()) => self.checkin(checkout),
            Err(e) => {
                tracing::warn!(server = checkout.conn.id, error = %e, "server_reset_query failed; closing the connection");
                self.discard(checkout);
            }
        }
    }

    /// Closes every idle connection (used at shutdown).
    pub fn close_idle(&self) {
        self.idle.lock().unwrap().clear();
    }
}
