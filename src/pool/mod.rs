//! Pools of server connections, one per (database, user).
//!
//! A pool hands out [`Checkout`]s: a server connection plus a permit of the
//! pool's semaphore, so at most `pool_size` connections exist per pool and
//! clients beyond that wait (up to `query_wait_timeout`). Idle connections
//! sit in a per-pool list behind a short-held mutex: there is no lock shared
//! between pools, and none on the forwarding path.
//!
//! What operators change while it runs:
//! - the settings (a config reload): swapped whole; a new `pool_size`
//!   resizes the semaphore (shrinking takes permits out as they come back);
//! - PAUSE/RESUME: a paused pool lends nothing, clients wait for RESUME;
//! - RECONNECT (and a changed server address): a new generation; idle
//!   connections of older ones are closed now, lent ones when they return.

mod registry;
mod stats;

pub use registry::Pools;
pub use stats::PoolStats;

use stats::{Lent, Waiting};

use crate::backend::{self, ConnectError, ServerConn, ServerTarget};
use crate::config::{PoolLimits, PoolMode};
use arc_swap::ArcSwap;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

/// Server connections for one (database, user).
#[derive(Debug)]
pub struct Pool {
    pub database: String,
    pub user: String,
    settings: ArcSwap<PoolLimits>,
    target: ArcSwap<ServerTarget>,
    idle: Mutex<Vec<ServerConn>>,
    permits: Arc<Semaphore>,
    /// Permits to take out of circulation as they come back, after
    /// `pool_size` shrank below the connections lent out.
    owed: Arc<AtomicUsize>,
    /// Connections of an older generation are closed, not reused.
    generation: AtomicU64,
    paused: AtomicBool,
    resumed: Notify,
    /// ParameterStatus values of the first server connection: what clients
    /// are told at login.
    server_params: OnceLock<Arc<HashMap<String, String>>>,
    /// Shared with the checkouts, which count themselves (see [`Lent`]).
    pub stats: Arc<PoolStats>,
}

/// An idle server connection, as SHOW SERVERS lists it.
#[derive(Debug)]
pub struct IdleServer {
    pub summary: Arc<backend::ServerSummary>,
    pub last_used: std::time::Instant,
    pub prepared: usize,
    pub stale: bool,
}

/// A server connection lent to one client.
#[derive(Debug)]
pub struct Checkout {
    pub conn: ServerConn,
    _permit: Permit,
    _lent: Lent,
}

/// Why a checkout gave no server connection. The pool says what happened;
/// what a client is told is the frontend's business
/// (`From<CheckoutError> for PgError` there).
#[derive(Debug)]
pub enum CheckoutError {
    /// The pool is closed (usher is shutting down).
    Closed,
    /// No server connection became free within `query_wait_timeout`.
    NoneFree {
        database: String,
        user: String,
        waited: Duration,
        pool_size: usize,
        /// The database was paused (PAUSE or KILL) the whole time.
        paused: bool,
    },
    /// Opening a new server connection failed (the server's own error,
    /// or why it could not be reached).
    Connect(ConnectError),
}

/// A semaphore permit that is forgotten instead of returned while the pool
/// owes permits (it shrank).
#[derive(Debug)]
struct Permit {
    permit: Option<OwnedSemaphorePermit>,
    owed: Arc<AtomicUsize>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        let owed = self
            .owed
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
        if owed.is_ok() {
            if let Some(p) = self.permit.take() {
                p.forget();
            }
        }
    }
}

impl Pool {
    pub fn new(database: String, user: String, target: ServerTarget, settings: PoolLimits) -> Self {
        let stats = Arc::new(PoolStats::new(&database, &user));
        Pool {
            database,
            user,
            permits: Arc::new(Semaphore::new(settings.size)),
            settings: ArcSwap::from_pointee(settings),
            target: ArcSwap::from_pointee(target),
            owed: Arc::new(AtomicUsize::new(0)),
            generation: AtomicU64::new(0),
            paused: AtomicBool::new(false),
            resumed: Notify::new(),
            idle: Mutex::new(Vec::new()),
            server_params: OnceLock::new(),
            stats,
        }
    }

    /// The pool's settings now (they change on reload). A cheap guard:
    /// read what is needed and let it go, do not hold it across awaits.
    pub fn settings(&self) -> arc_swap::Guard<Arc<PoolLimits>> {
        self.settings.load()
    }

    pub fn mode(&self) -> PoolMode {
        self.settings.load().mode
    }

    /// Offers the credential a client's login yielded to the server target.
    pub fn offer_credential(&self, credential: backend::ServerCredential) {
        self.target.load().credential.offer(credential);
    }

    /// Takes new settings from a reloaded configuration. A new `pool_size`
    /// resizes the pool; a new server address (`target`) starts a new
    /// generation of connections.
    pub fn apply(&self, settings: PoolLimits, target: Option<ServerTarget>) {
        let old = self.settings.swap(Arc::new(settings));
        let new_size = self.settings.load().size;
        if new_size != old.size {
            self.resize(old.size, new_size);
            tracing::info!(db = %self.database, user = %self.user, from = old.size, to = new_size, "pool_size changed");
        }
        if let Some(mut target) = target {
            // The credential learnt from clients' logins carries over.
            target.credential = self.target.load().credential.clone();
            self.target.store(Arc::new(target));
            self.reconnect();
            tracing::info!(db = %self.database, user = %self.user, "server address changed; reconnecting");
        }
        self.trim_idle();
    }

    fn resize(&self, from: usize, to: usize) {
        if to > from {
            let mut grow = to - from;
            // Cancel permits still owed from an earlier shrink first.
            let _ = self
                .owed
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |owed| {
                    let cancel = owed.min(to - from);
                    grow = to - from - cancel;
                    Some(owed - cancel)
                });
            self.permits.add_permits(grow);
        } else {
            let shrink = from - to;
            let taken = self.permits.forget_permits(shrink);
            // Lent connections give theirs back later: forget those then.
            self.owed.fetch_add(shrink - taken, Ordering::AcqRel);
        }
    }

    /// RECONNECT: idle connections close now; lent ones when they come back.
    pub fn reconnect(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
        self.close_idle();
    }

    /// PAUSE: nothing more is lent until [`Pool::resume`]; clients wait.
    pub fn pause(&self) {
        self.paused.store(true, Ordering::Release);
    }

    pub fn resume(&self) {
        self.paused.store(false, Ordering::Release);
        self.resumed.notify_waiters();
    }

    pub fn is_paused(&self) -> bool {
        self.paused.load(Ordering::Acquire)
    }

    /// Waits until no server connection is lent out (after PAUSE), then
    /// closes the idle ones, as PgBouncer does.
    pub async fn drained(&self) {
        while self.stats.active.load(Ordering::Acquire) > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.close_idle();
    }

    async fn wait_unpaused(&self) {
        loop {
            let resumed = self.resumed.notified();
            tokio::pin!(resumed);
            resumed.as_mut().enable();
            if !self.is_paused() {
                return;
            }
            resumed.await;
        }
    }

    fn current(&self, conn: &ServerConn) -> bool {
        conn.generation() == self.generation.load(Ordering::Acquire)
    }

    /// The idle server connections (SHOW SERVERS): each one's summary,
    /// when it was last used, its prepared statements, and whether it is
    /// of an older generation (closed instead of reused).
    pub fn idle_servers(&self) -> Vec<IdleServer> {
        let generation = self.generation.load(Ordering::Acquire);
        self.idle
            .lock()
            .iter()
            .map(|c| IdleServer {
                summary: c.summary().clone(),
                last_used: c.last_used(),
                prepared: c.prepared().len(),
                stale: c.generation() != generation,
            })
            .collect()
    }

    /// Idle server connections right now.
    pub fn idle_count(&self) -> usize {
        self.idle.lock().len()
    }

    /// The server's reported parameters, learned from a server connection
    /// the first time a client logs in to this pool.
    pub async fn server_params(&self) -> Result<Arc<HashMap<String, String>>, CheckoutError> {
        if let Some(p) = self.server_params.get() {
            return Ok(p.clone());
        }
        let checkout = self.checkout().await?;
        let params = Arc::new(checkout.conn.params().clone());
        self.checkin(checkout);
        Ok(self.server_params.get_or_init(|| params).clone())
    }

    /// Waits for a server connection: an idle one if any is alive, else a new one.
    pub async fn checkout(&self) -> Result<Checkout, CheckoutError> {
        let started = std::time::Instant::now();
        let settings = self.settings.load_full();
        let waiting = Waiting::new(&self.stats);
        let permit = tokio::time::timeout(settings.query_wait_timeout, async {
            self.wait_unpaused().await;
            self.permits.clone().acquire_owned().await
        })
        .await;
        drop(waiting);
        self.stats.waited(started.elapsed());
        let permit = match permit {
            Ok(Ok(p)) => p,
            Ok(Err(_)) => return Err(CheckoutError::Closed),
            Err(_) => {
                return Err(CheckoutError::NoneFree {
                    database: self.database.clone(),
                    user: self.user.clone(),
                    waited: settings.query_wait_timeout,
                    pool_size: settings.size,
                    paused: self.is_paused(),
                })
            }
        };
        let permit = Permit {
            permit: Some(permit),
            owed: self.owed.clone(),
        };
        self.stats.checkouts.fetch_add(1, Ordering::Relaxed);
        while let Some(conn) = self.pop_idle() {
            if let Some(conn) = self.vet(conn).await {
                return Ok(Checkout {
                    conn,
                    _permit: permit,
                    _lent: Lent::new(&self.stats),
                });
            }
        }
        // Boxed: connecting (TLS, SCRAM) is a large future that would
        // otherwise sit in every client task's state, idle or not.
        let conn = Box::pin(self.connect(&settings))
            .await
            .map_err(CheckoutError::Connect)?;
        tracing::debug!(server = conn.id(), pid = conn.backend_pid(), db = %self.database, user = %self.user, "server connection opened");
        Ok(Checkout {
            conn,
            _permit: permit,
            _lent: Lent::new(&self.stats),
        })
    }

    /// Opens a server connection of the current generation.
    async fn connect(&self, settings: &PoolLimits) -> Result<ServerConn, ConnectError> {
        let generation = self.generation.load(Ordering::Acquire);
        let target = self.target.load_full();
        let login = self.stats.logging_in();
        let conn = backend::connect(&target, settings.server_connect_timeout).await;
        drop(login);
        let mut conn = conn?;
        conn.set_generation(generation);
        self.stats.connected();
        Ok(conn)
    }

    fn pop_idle(&self) -> Option<ServerConn> {
        let mut idle = self.idle.lock();
        let conn = idle.pop();
        self.stats.idle_servers(idle.len());
        conn
    }

    fn push_idle(&self, conn: ServerConn) {
        let mut idle = self.idle.lock();
        idle.push(conn);
        self.stats.idle_servers(idle.len());
    }

    /// Decides whether an idle connection may be handed out: not past its
    /// lifetime, not closed by the server, and, if it sat idle longer than
    /// `server_check_delay`, answering a round trip.
    async fn vet(&self, mut conn: ServerConn) -> Option<ServerConn> {
        if self.past_lifetime(&conn) {
            tracing::debug!(server = conn.id(), "server_lifetime reached; closing");
            return None;
        }
        if !self.current(&conn) {
            return None;
        }
        if !conn.looks_alive() {
            tracing::info!(
                server = conn.id(),
                pid = conn.backend_pid(),
                "idle server connection was closed by the server; dropping it"
            );
            return None;
        }
        let (check_delay, timeout) = {
            let s = self.settings.load();
            (s.server_check_delay, s.server_connect_timeout)
        };
        if conn.last_used().elapsed() >= check_delay {
            let check = tokio::time::timeout(timeout, conn.simple_query("")).await;
            if !matches!(check, Ok(Ok(()))) {
                tracing::info!(
                    server = conn.id(),
                    pid = conn.backend_pid(),
                    "idle server connection failed its check; dropping it"
                );
                return None;
            }
        }
        Some(conn)
    }

    fn past_lifetime(&self, conn: &ServerConn) -> bool {
        self.settings
            .load()
            .server_lifetime
            .is_some_and(|l| conn.created().elapsed() >= l)
    }

    /// Returns a clean server connection (idle, not in a transaction) to the
    /// pool, or closes it if it has outlived `server_lifetime`.
    pub fn checkin(&self, mut checkout: Checkout) {
        if self.past_lifetime(&checkout.conn) {
            tracing::debug!(
                server = checkout.conn.id(),
                "server_lifetime reached; closing"
            );
            return;
        }
        if !self.current(&checkout.conn) || self.is_paused() {
            tracing::debug!(server = checkout.conn.id(), "reconnect or pause; closing");
            return;
        }
        checkout.conn.touch();
        self.push_idle(checkout.conn);
        // The permit (and the active count) drop here, after the connection
        // is back in the list.
    }

    /// Closes a server connection that is not safe to reuse.
    pub fn discard(&self, checkout: Checkout) {
        tracing::debug!(server = checkout.conn.id(), "closing server connection");
        drop(checkout);
    }

    /// Session mode: runs `server_reset_query`, then returns the connection,
    /// or closes it if the reset fails.
    pub async fn reset_and_checkin(&self, mut checkout: Checkout) {
        let query = self.settings.load().server_reset_query.clone();
        if query.is_empty() {
            return self.checkin(checkout);
        }
        match checkout.conn.simple_query(&query).await {
            Ok(()) => {
                // The reset (DISCARD ALL by default) took usher's settings
                // of unreported parameters with it: forget them, or the
                // next session with the same value would not set it again.
                if let Some(reported) = self.server_params.get() {
                    checkout.conn.forget_unreported(reported);
                }
                self.checkin(checkout)
            }
            Err(e) => {
                tracing::warn!(server = checkout.conn.id(), code = e.sqlstate(), error = %e, "server_reset_query failed; closing the connection");
                self.discard(checkout);
            }
        }
    }

    /// Closes every idle connection (shutdown, PAUSE, RECONNECT).
    pub fn close_idle(&self) {
        let mut idle = self.idle.lock();
        idle.clear();
        self.stats.idle_servers(0);
    }

    /// Housekeeping, run periodically: closes idle connections past
    /// `server_idle_timeout` or `server_lifetime` (keeping `min_pool_size`),
    /// then opens connections up to `min_pool_size`.
    pub async fn maintain(&self) {
        let settings = self.settings.load_full();
        let min = settings.min_size.min(settings.size);
        self.trim_idle();
        {
            let mut idle = self.idle.lock();
            let active = self.stats.active.load(Ordering::Relaxed);
            let idle_timeout = settings.server_idle_timeout;
            let lifetime = settings.server_lifetime;
            // Oldest-used first: the LIFO list keeps them at the front.
            let mut keep = Vec::with_capacity(idle.len());
            let total = idle.len() + active;
            let mut closed = 0;
            for conn in idle.drain(..) {
                let expired = idle_timeout.is_some_and(|t| conn.last_used().elapsed() >= t)
                    || lifetime.is_some_and(|l| conn.created().elapsed() >= l);
                if expired && total - closed > min {
                    closed += 1;
                    tracing::debug!(server = conn.id(), "closing idle server connection");
                } else {
                    keep.push(conn);
                }
            }
            *idle = keep;
        }
        while self.idle_count() + self.stats.active.load(Ordering::Relaxed) < min
            && !self.is_paused()
        {
            let Ok(permit) = self.permits.clone().try_acquire_owned() else {
                break;
            };
            match self.connect(&settings).await {
                Ok(conn) => {
                    self.push_idle(conn);
                    drop(permit);
                }
                Err(e) => {
                    tracing::warn!(db = %self.database, user = %self.user, code = e.sqlstate(), error = %e, "could not open a min_pool_size connection");
                    break;
                }
            }
        }
    }

    /// Closes idle connections beyond `pool_size` (after it shrank).
    fn trim_idle(&self) {
        let size = self.settings.load().size;
        let active = self.stats.active.load(Ordering::Relaxed);
        let mut idle = self.idle.lock();
        let keep = size.saturating_sub(active);
        if idle.len() > keep {
            // The front holds the least recently used.
            let extra = idle.len() - keep;
            idle.drain(..extra);
            self.stats.idle_servers(idle.len());
        }
    }

    /// How often [`Pool::maintain`] should run for these settings.
    pub fn maintenance_interval(&self) -> Duration {
        let s = self.settings.load();
        let autodb = s.autodb_idle_timeout.filter(|_| s.auto);
        [s.server_idle_timeout, s.server_lifetime, autodb]
            .into_iter()
            .flatten()
            .map(|d| d / 4)
            .chain([Duration::from_secs(1)])
            .min()
            .unwrap()
            .max(Duration::from_millis(50))
    }
}
