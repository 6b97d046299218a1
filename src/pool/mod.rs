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
//!
//! The bookkeeping of all that is `slots.rs` (generic over the connection,
//! no I/O, unit-tested without a server); this file adds what needs one.
//!
//! Pin slots ([`PinSlot`]): a transaction-mode client whose state cannot
//! move keeps its server connection; at most `max_pinned` such clients per
//! pool (0: no cap), counted in `PoolStats::pinned` and a gauge.

pub mod caps;
mod hot_limits;
mod idle;
mod outage;
mod places;
mod pool_stats;
mod registry;
mod slots;

pub use pool_stats::PoolStats;
pub use registry::{Pools, TooManyRoutes};

use caps::{Capped, PoolCaps, ServerPlace};
use outage::{Outage, Turn};
use pool_stats::Waiting;
use slots::{Lease, NoSlot, Pooled, Slot, Slots};

use crate::backend::{self, ConnectError, ServerConn, ServerTarget};
use crate::config::{PoolLimits, PoolMode};
use arc_swap::ArcSwap;
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// At most this many (parameter, value) pairs a pool remembers the
/// server's spelling of.
pub const NORMALISED_BOUND: usize = 1024;

/// Server connections for one (database, user): the bookkeeping of
/// `slots.rs` (permits, idle list, generations, pause, waiting) plus
/// opening, vetting and resetting server connections.
#[derive(Debug)]
pub struct Pool {
    pub database: String,
    pub user: String,
    target: ArcSwap<ServerTarget>,
    /// Boxed: a connection moves through every checkout and checkin, and
    /// a box moves as a pointer (the struct is a few hundred bytes).
    slots: Slots<Box<ServerConn>>,
    /// ParameterStatus values of the first server connection: what clients
    /// are told at login.
    server_params: OnceLock<Arc<HashMap<String, String>>>,
    /// What the server made of startup parameters at earlier logins:
    /// (name, value asked) → the value it reports (`utf-8` → `UTF8`),
    /// learnt only from settings applied without an error or a notice. A
    /// transaction-mode login whose every parameter is known here needs no
    /// server connection to tell the client the server's values.
    normalised: Mutex<HashMap<(String, String), String>>,
    /// Shared with the checkouts, which count themselves (see [`pool_stats::Lent`]).
    pub stats: Arc<PoolStats>,
    /// Told when a pin slot is given back.
    pin_freed: Arc<Notify>,
    /// Clients waiting for a connection they caused to be opened, first
    /// come first: a connection checked in meanwhile goes to them before
    /// the idle list (`Pool::lend`). Entries of clients served otherwise
    /// are skipped when met.
    handoffs: Mutex<VecDeque<tokio::sync::oneshot::Sender<Checkout>>>,
    /// `handoffs.len()`, read without the lock on every checkin.
    handoffs_queued: AtomicUsize,
    /// Whether opening server connections fails now, and whose turn it is
    /// to try again (outage.rs).
    outage: Arc<Outage>,
    /// Its database's and user's tallies (`max_db_connections` and the
    /// other caps over many pools: caps.rs).
    pub caps: Arc<PoolCaps>,
    /// Where a hook routed this pool's clients (`ctx:route`); none for a
    /// pool of a database entry as configured. A routed pool's `database`
    /// is its base entry's key.
    pub route: Option<Arc<crate::config::ResolvedRoute>>,
}

/// A pinned client's place in its pool's `max_pinned`; given back when
/// dropped.
#[derive(Debug)]
pub struct PinSlot {
    stats: Arc<PoolStats>,
    freed: Arc<Notify>,
}

impl Drop for PinSlot {
    fn drop(&mut self) {
        self.stats.unpin();
        self.freed.notify_one();
    }
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
    pub conn: Box<ServerConn>,
    lease: Lease,
}

impl Checkout {
    /// With its connection watched by this worker's reactor (idle.rs):
    /// one handed over as it was checked in on another worker.
    fn here(mut self) -> Checkout {
        self.conn.bring_to_this_shard();
        self
    }
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
    /// or why it could not be reached): the client's own attempt's, or,
    /// shared, the attempt it waited for (a refusal that ended an outage;
    /// under `server_fast_fail`, the pool's last error).
    Connect(Arc<ConnectError>),
    /// No server connection could be opened within `query_wait_timeout`
    /// (the server down all along): the last attempt's error.
    ServerDown {
        error: Arc<ConnectError>,
        waited: Duration,
    },
    /// The database's or user's cap on server connections
    /// (`max_db_connections`, `max_user_connections`) stayed reached for
    /// `query_wait_timeout`, with no idle connection of another pool to
    /// close.
    Capped {
        which: Capped,
        /// The database's or user's name.
        name: String,
        limit: usize,
        waited: Duration,
    },
}

impl Pooled for Box<ServerConn> {
    fn id(&self) -> u64 {
        ServerConn::id(self)
    }
    fn generation(&self) -> u64 {
        ServerConn::generation(self)
    }
    fn created(&self) -> Instant {
        ServerConn::created(self)
    }
    fn last_used(&self) -> Instant {
        ServerConn::last_used(self)
    }
    fn touch(&mut self, now: Instant) {
        ServerConn::touch(self, now)
    }
}

impl Pool {
    pub fn new(
        database: String,
        user: String,
        target: ServerTarget,
        settings: PoolLimits,
        caps: Arc<PoolCaps>,
    ) -> Self {
        let stats = Arc::new(PoolStats::new(&database, &user));
        Pool {
            caps,
            database,
            user,
            slots: Slots::new(settings, stats.clone()),
            target: ArcSwap::from_pointee(target),
            server_params: OnceLock::new(),
            normalised: Mutex::new(HashMap::new()),
            stats,
            pin_freed: Arc::new(Notify::new()),
            handoffs: Mutex::new(VecDeque::new()),
            handoffs_queued: AtomicUsize::new(0),
            outage: Arc::default(),
            route: None,
        }
    }

    /// The routed target, or "" for a pool of a database entry as
    /// configured (logs).
    pub fn route_shown(&self) -> &str {
        self.route.as_ref().map_or("", |r| &r.key)
    }

    /// SHOW's `database` value: the database, or for a routed pool
    /// `base@host:port/dbname`.
    pub fn shown_database(&self) -> &str {
        self.route.as_ref().map_or(&self.database, |r| &r.shown)
    }

    fn pin_slot(&self) -> PinSlot {
        PinSlot {
            stats: self.stats.clone(),
            freed: self.pin_freed.clone(),
        }
    }

    /// A pin slot, if fewer than `max_pinned` are held.
    pub fn try_pin(&self) -> Option<PinSlot> {
        let max = self.slots.settings().max_pinned;
        self.stats.try_pin(max).then(|| self.pin_slot())
    }

    /// A pin slot, waiting (as a client waits for a server connection, and
    /// counted as waiting) up to `query_wait_timeout` for one to be given
    /// back; `None` if none was.
    pub async fn pin(&self) -> Option<PinSlot> {
        if let Some(slot) = self.try_pin() {
            return Some(slot);
        }
        let timeout = self.slots.settings().query_wait_timeout;
        let started = std::time::Instant::now();
        let waiting = Waiting::new(&self.stats);
        let slot = tokio::time::timeout(timeout, async {
            loop {
                let freed = self.pin_freed.notified();
                tokio::pin!(freed);
                freed.as_mut().enable();
                if let Some(slot) = self.try_pin() {
                    return slot;
                }
                freed.await;
            }
        })
        .await
        .ok();
        drop(waiting);
        self.stats.waited(started.elapsed());
        if slot.is_none() {
            // Pass the wake-up on: another waiter may find a slot.
            self.pin_freed.notify_one();
        }
        slot
    }

    /// A pin slot whatever `max_pinned` says: the server already holds the
    /// state (found by asking it), and the connection must stay with its
    /// client.
    pub fn pin_anyway(&self) -> PinSlot {
        self.stats.try_pin(0);
        self.pin_slot()
    }

    /// Pin slots held now.
    pub fn pinned(&self) -> usize {
        self.stats.pinned.load(Ordering::Relaxed)
    }

    /// The pool's settings now (they change on reload). A cheap guard:
    /// read what is needed and let it go, do not hold it across awaits.
    pub fn settings(&self) -> arc_swap::Guard<Arc<PoolLimits>> {
        self.slots.settings()
    }

    /// The settings a transaction reads, each one relaxed load (no
    /// arc-swap guard).
    pub(crate) fn hot(&self) -> &hot_limits::HotLimits {
        self.slots.hot()
    }

    pub fn mode(&self) -> PoolMode {
        self.slots.settings().mode
    }

    /// The server of this pool's last new connection that fit its target
    /// (with several hosts), and when it was made.
    pub fn server_in_use(&self) -> Option<((String, u16), Instant)> {
        let target = self.target.load();
        target.hosts.in_use().map(|(h, at)| (h.clone(), at))
    }

    /// Offers the credential a client's login yielded to the server target.
    pub fn offer_credential(&self, credential: backend::ServerCredential) {
        self.target.load().credential.offer(credential);
    }

    /// Takes new settings from a reloaded configuration. A new `pool_size`
    /// resizes the pool; a new server address (`target`) starts a new
    /// generation of connections.
    pub fn apply(&self, settings: PoolLimits, target: Option<ServerTarget>) {
        let new_size = settings.size;
        let old = self.slots.apply(settings);
        if new_size != old.size {
            tracing::info!(db = %self.database, user = %self.user, from = old.size, to = new_size, "pool_size changed");
        }
        if let Some(mut target) = target {
            // The credential learnt from clients' logins carries over.
            target.credential = self.target.load().credential.clone();
            self.target.store(Arc::new(target));
            // What failed to open may open at the new address.
            self.outage.reset();
            self.reconnect();
            tracing::info!(db = %self.database, user = %self.user, "server address changed; reconnecting");
        }
    }

    /// RECONNECT: idle connections close now; lent ones when they come back.
    pub fn reconnect(&self) {
        self.slots.new_generation();
    }

    /// PAUSE: nothing more is lent until [`Pool::resume`]; clients wait.
    pub fn pause(&self) {
        self.slots.pause();
    }

    pub fn resume(&self) {
        self.slots.resume();
    }

    pub fn is_paused(&self) -> bool {
        self.slots.is_paused()
    }

    /// Waits until no server connection is lent out (after PAUSE), then
    /// closes the idle ones, as PgBouncer does.
    pub async fn drained(&self) {
        self.slots.drained().await;
    }

    /// The idle server connections (SHOW SERVERS): each one's summary,
    /// when it was last used, its prepared statements, and whether it is
    /// of an older generation (closed instead of reused).
    pub fn idle_servers(&self) -> Vec<IdleServer> {
        self.slots.describe_idle(|c, stale| IdleServer {
            summary: c.summary().clone(),
            last_used: c.last_used(),
            prepared: c.prepared().len(),
            stale,
        })
    }

    /// Idle server connections right now.
    pub fn idle_count(&self) -> usize {
        self.slots.idle_count()
    }

    /// The server's reported parameters, learned from a server connection
    /// the first time a client logs in to this pool.
    pub async fn server_params(
        self: &Arc<Self>,
    ) -> Result<Arc<HashMap<String, String>>, CheckoutError> {
        if let Some(p) = self.server_params.get() {
            return Ok(p.clone());
        }
        let checkout = self.checkout().await?;
        let params = Arc::new(checkout.conn.params().base().clone());
        self.checkin(checkout);
        Ok(self.server_params.get_or_init(|| params).clone())
    }

    /// What the server reports for parameter `name` set to `value`, if an
    /// earlier login learnt it.
    pub fn normalised(&self, name: &str, value: &str) -> Option<String> {
        self.normalised
            .lock()
            .get(&(name.to_string(), value.to_string()))
            .cloned()
    }

    /// Remembers what the server made of startup parameters (bounded: the
    /// memory starts over past [`NORMALISED_BOUND`] entries).
    pub fn learn_normalised(&self, learnt: impl IntoIterator<Item = ((String, String), String)>) {
        let mut known = self.normalised.lock();
        for (key, value) in learnt {
            if known.len() >= NORMALISED_BOUND {
                known.clear();
            }
            known.insert(key, value);
        }
    }

    /// Waits for a server connection: an idle one if any is alive, else a
    /// new one, or one checked in while the new one was opening. While
    /// none can be opened (an outage) it waits for the server to come
    /// back; all of it within `query_wait_timeout`.
    pub async fn checkout(self: &Arc<Self>) -> Result<Checkout, CheckoutError> {
        let started = Instant::now();
        let slot = match self.slots.wait_for_slot().await {
            Ok(slot) => slot,
            Err(e) => {
                self.stats.wait_sample(started.elapsed());
                return Err(match e {
                    NoSlot::Closed => CheckoutError::Closed,
                    NoSlot::TimedOut {
                        waited,
                        pool_size,
                        paused,
                    } => CheckoutError::NoneFree {
                        database: self.database.clone(),
                        user: self.user.clone(),
                        waited,
                        pool_size,
                        paused,
                    },
                });
            }
        };
        let deadline = started + self.slots.hot().query_wait_timeout();
        // The slot may have been waited for: the clock is read again.
        let now = Instant::now();
        let mut outage_wait = Duration::ZERO;
        let lent = self.lend(slot, now, deadline, &mut outage_wait).await;
        // One sample of the whole wait: for a place, and for the server
        // to come back (what SHOW STATS' total_wait_time adds up).
        self.stats
            .wait_sample(now.saturating_duration_since(started) + outage_wait);
        lent.map(Checkout::here)
    }

    /// Whether [`Pool::checkout`] would wait now (a hint: see
    /// `Slots::would_wait`).
    pub fn would_wait(&self) -> bool {
        self.slots.would_wait()
    }

    /// A server connection if one may be had without waiting (the pool is
    /// not paused, not all of its connections are lent, and opening them
    /// does not fail now); `None` otherwise. Opening a new one is not
    /// waiting.
    pub async fn checkout_if_free(self: &Arc<Self>) -> Option<Result<Checkout, CheckoutError>> {
        if self.outage.is_on() {
            return None;
        }
        let slot = self.slots.try_slot()?;
        let settings = self.slots.settings_full();
        // Nor is waiting under a cap (a hint: it may fill meanwhile).
        if self.idle_count() == 0
            && self
                .caps
                .full(settings.max_db_connections, settings.max_user_connections)
        {
            return None;
        }
        let now = Instant::now();
        let mut no_outage = Duration::ZERO;
        let lent = self.lend(slot, now, now + settings.query_wait_timeout, &mut no_outage);
        Some(lent.await.map(Checkout::here))
    }

    /// Lends a connection in `slot`: an idle one if any is alive, else a
    /// new one, or one checked in while the new one was opening. In an
    /// outage the client waits its turn to try (outage.rs), or for a
    /// connection checked in, until `deadline`.
    async fn lend(
        self: &Arc<Self>,
        slot: Slot,
        now: Instant,
        deadline: Instant,
        outage_wait: &mut Duration,
    ) -> Result<Checkout, CheckoutError> {
        if let Some(conn) = self.take_vetted(now).await {
            return Ok(Checkout {
                conn,
                lease: self.slots.lease(slot),
            });
        }
        // A new connection, unless one is checked in first: the client
        // waits for a server, not for the one it caused to be opened (as
        // in PgBouncer). Bound to its own, the first clients of a pool
        // waited for backends to start while the connections already open
        // served everyone else (at pgbench's start, 100 clients on
        // pool_size 20: first transactions up to 166 ms, PgBouncer 13).
        let (handoff, mut handed) = tokio::sync::oneshot::channel();
        self.handoffs.lock().push_back(handoff);
        self.handoffs_queued.fetch_add(1, Ordering::Release);
        let seen = self.outage.epoch();
        let started = now;
        loop {
            let place = match self.server_place(&mut handed, started, deadline).await {
                Ok(Ok(place)) => place,
                Ok(Err(checkout)) => return Ok(checkout),
                Err(e) => {
                    self.give_back_handoff(&mut handed);
                    return Err(e);
                }
            };
            let attempt = match self
                .my_turn(&mut handed, seen, started, deadline, outage_wait)
                .await
            {
                Ok(Ok(attempt)) => attempt,
                Ok(Err(checkout)) => return Ok(checkout),
                Err(e) => {
                    self.give_back_handoff(&mut handed);
                    return Err(e);
                }
            };
            // Boxed and owning what it needs: a large future (TLS, SCRAM)
            // that would otherwise sit in every client task's state, and
            // one that may be handed to a task of its own.
            let pool = self.clone();
            let mut opening = Box::pin(async move {
                let settings = pool.slots.settings_full();
                let opened = pool.connect(&settings).await.map_err(Arc::new);
                let opened = opened.map(|mut conn| {
                    conn.keep_until_closed(place);
                    conn
                });
                pool.opened(opened.as_ref().err(), &settings);
                drop(attempt);
                if let Ok(conn) = &opened {
                    tracing::debug!(server = conn.id(), pid = conn.backend_pid(), db = %pool.database, user = %pool.user, "server connection opened");
                }
                (pool, opened)
            });
            tokio::select! {
                biased;
                Ok(checkout) = &mut handed => {
                    // The new connection finishes opening on its own,
                    // holding `slot`, and then is idle like any other.
                    tokio::spawn(async move {
                        if let (pool, Ok(conn)) = opening.await {
                            // Through the pool's checkin: another client
                            // may be waiting for one it caused to open.
                            let lease = pool.slots.lease(slot);
                            pool.checkin(Checkout { conn, lease });
                        }
                    });
                    return Ok(checkout);
                }
                (_, opened) = &mut opening => match opened {
                    Ok(conn) => {
                        self.give_back_handoff(&mut handed);
                        return Ok(Checkout {
                            conn,
                            lease: self.slots.lease(slot),
                        });
                    }
                    // Wait for the server to come back (the outage's
                    // turns), unless told to fail fast.
                    Err(e) if e.is_transient() && !self.slots.settings().server_fast_fail => {}
                    Err(e) => {
                        self.give_back_handoff(&mut handed);
                        return Err(CheckoutError::Connect(e));
                    }
                },
            }
        }
    }

    /// A place for a new connection under the database's and user's caps
    /// (at once when they are not reached, or are 0), or a connection
    /// handed to this client while it waits for one (`Ok(Err)`); an error
    /// once `deadline` passes.
    async fn server_place(
        &self,
        handed: &mut tokio::sync::oneshot::Receiver<Checkout>,
        started: Instant,
        deadline: Instant,
    ) -> Result<Result<ServerPlace, Checkout>, CheckoutError> {
        let (db_limit, user_limit) = {
            let s = self.slots.settings();
            (s.max_db_connections, s.max_user_connections)
        };
        let which = match self.caps.try_server(db_limit, user_limit) {
            Ok(place) => return Ok(Ok(place)),
            Err(which) => which,
        };
        let _waiting = Waiting::new(&self.stats);
        tokio::select! {
            biased;
            Ok(checkout) = &mut *handed => Ok(Err(checkout)),
            place = self.caps.server(self, db_limit, user_limit) => Ok(Ok(place)),
            _ = tokio::time::sleep_until(deadline.into()) => {
                let (name, limit) = match which {
                    Capped::Database => (self.database.clone(), db_limit),
                    Capped::User => (self.user.clone(), user_limit),
                };
                Err(CheckoutError::Capped { which, name, limit, waited: started.elapsed() })
            }
        }
    }

    /// A pool of nothing (its server is a closed port), for unit tests.
    #[cfg(test)]
    pub(crate) fn for_tests(database: &str, user: &str) -> Pool {
        let config =
            crate::config::Config::from_yaml("databases: { app: {} }\n", "t.yaml").unwrap();
        let target = ServerTarget {
            hosts: Arc::new(backend::ServerHosts::single("127.0.0.1".into(), 1)),
            dbname: database.into(),
            user: user.into(),
            tls: crate::tls::ServerTls::disabled(),
            credential: backend::SharedCredential::default(),
        };
        let caps = caps::Caps::default().for_pool(database, user);
        Pool::new(
            database.into(),
            user.into(),
            target,
            config.limits_for(database, user),
            caps,
        )
    }

    /// Closes this pool's least recently used idle connection, if it has
    /// one (to make room under a cap for another pool); whether it did.
    pub fn close_oldest_idle(&self) -> bool {
        self.slots.close_oldest_idle()
    }

    /// Waits until this client may open a connection (`Ok(Ok)`, with the
    /// outage's attempt if it makes one), or a connection is handed to it
    /// meanwhile (`Ok(Err)`); an error if the outage's answer is one, or
    /// `deadline` passes first. Counted as waiting while it waits (SHOW
    /// POOLS), and the wait added to the pool's total (SHOW STATS).
    async fn my_turn(
        &self,
        handed: &mut tokio::sync::oneshot::Receiver<Checkout>,
        seen: u64,
        started: Instant,
        deadline: Instant,
        outage_wait: &mut Duration,
    ) -> Result<Result<Option<outage::Attempt>, Checkout>, CheckoutError> {
        let mut waiting: Option<(Waiting<'_>, Instant)> = None;
        let turn = 'turn: loop {
            let changed = self.outage.changed();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let now = Instant::now();
            if now >= deadline {
                // No attempt past the deadline while the server is down.
                if let Some(error) = self.outage.last_error() {
                    break Err(CheckoutError::ServerDown {
                        error,
                        waited: now.saturating_duration_since(started),
                    });
                }
            }
            let fast_fail = self.slots.settings().server_fast_fail;
            let until = match self.outage.turn(now, seen, fast_fail) {
                Turn::Open => break Ok(Ok(None)),
                Turn::Attempt(attempt) => break Ok(Ok(Some(attempt))),
                Turn::Refused(e) => break Err(CheckoutError::Connect(e)),
                Turn::Wait(until) => until.map_or(deadline, |u| u.min(deadline)),
            };
            waiting.get_or_insert_with(|| (Waiting::new(&self.stats), now));
            tokio::select! {
                biased;
                Ok(checkout) = &mut *handed => break 'turn Ok(Err(checkout)),
                () = &mut changed => {}
                () = tokio::time::sleep_until(until.into()) => {}
            }
        };
        if let Some((_, since)) = waiting {
            let waited = since.elapsed();
            *outage_wait += waited;
            self.stats.waited_for_server(waited);
        }
        turn
    }

    /// This client no longer waits for a connection to be handed to it;
    /// one handed over at the same moment goes back.
    fn give_back_handoff(&self, handed: &mut tokio::sync::oneshot::Receiver<Checkout>) {
        handed.close();
        if let Ok(other) = handed.try_recv() {
            self.checkin(other);
        }
    }

    /// Records what an attempt to open a connection came to, in the
    /// outage and the log.
    fn opened(&self, error: Option<&Arc<ConnectError>>, settings: &PoolLimits) {
        match error {
            None => {
                if let Some((lasted, attempts)) = self.outage.succeeded() {
                    tracing::info!(db = %self.database, user = %self.user, lasted_ms = lasted.as_millis() as u64, attempts, "server connections open again");
                }
            }
            Some(e) => {
                let now = Instant::now();
                if self.outage.failed(e, now, settings.server_login_retry) {
                    tracing::warn!(db = %self.database, user = %self.user, code = e.sqlstate(), error = %e, fast_fail = settings.server_fast_fail, "could not open a server connection; trying again with a growing pause (server_login_retry)");
                } else {
                    tracing::debug!(db = %self.database, user = %self.user, code = e.sqlstate(), error = %e, "could not open a server connection");
                }
            }
        }
    }

    /// A clean connection checked in goes to the first client still
    /// waiting for a connection it caused to be opened, if any; `Some`
    /// (to be checked in as usual) otherwise.
    fn hand_off(&self, mut checkout: Checkout, now: Instant) -> Option<Checkout> {
        if !self.slots.reusable(&checkout.conn, now) {
            return Some(checkout);
        }
        checkout.conn.touch(now);
        let mut queue = self.handoffs.lock();
        while let Some(waiter) = queue.pop_front() {
            self.handoffs_queued.fetch_sub(1, Ordering::Release);
            match waiter.send(checkout) {
                Ok(()) => return None,
                // That client got its own connection first, or left.
                Err(back) => checkout = back,
            }
        }
        Some(checkout)
    }

    /// The most recently used idle connection that is still good, if any.
    /// `now` is the caller's clock reading (one per checkout; read again
    /// only after a vetting that waited).
    async fn take_vetted(&self, mut now: Instant) -> Option<Box<ServerConn>> {
        while let Some(conn) = self.slots.take_idle(now) {
            let (conn, waited) = self.vet(conn, now).await;
            if let Some(conn) = conn {
                return Some(conn);
            }
            if waited {
                now = Instant::now();
            }
        }
        None
    }

    /// Opens a server connection of the current generation.
    async fn connect(&self, settings: &PoolLimits) -> Result<Box<ServerConn>, ConnectError> {
        let generation = self.slots.generation();
        let target = self.target.load_full();
        let login = self.stats.logging_in();
        let conn = backend::connect(&target, settings.server_connect_timeout).await;
        drop(login);
        let mut conn = conn?;
        conn.set_generation(generation);
        self.stats.connected();
        Ok(Box::new(conn))
    }

    /// Decides whether an idle connection (of the current generation, not
    /// past its lifetime: [`Slots::take_idle`]) may be handed out: not
    /// closed by the server, and, if it sat idle longer than
    /// `server_check_delay`, answering a round trip; and whether it waited
    /// for that round trip.
    async fn vet(
        &self,
        mut conn: Box<ServerConn>,
        now: Instant,
    ) -> (Option<Box<ServerConn>>, bool) {
        if !conn.looks_alive() {
            tracing::info!(
                server = conn.id(),
                pid = conn.backend_pid(),
                "idle server connection was closed by the server; dropping it"
            );
            return (None, false);
        }
        if !self.still_fits(&conn) {
            return (None, false);
        }
        // Taken from another worker's list: moved to this worker's
        // reactor, and asked again, of the socket itself (the other
        // reactor may not have seen the server close it yet).
        if conn.bring_to_this_shard() && !conn.peek_alive() {
            tracing::info!(
                server = conn.id(),
                pid = conn.backend_pid(),
                "idle server connection was closed by the server; dropping it"
            );
            return (None, false);
        }
        if self.slots.needs_check(&conn, now) {
            let timeout = self.slots.settings().server_connect_timeout;
            let check = tokio::time::timeout(timeout, conn.simple_query("")).await;
            if !matches!(check, Ok(Ok(()))) {
                tracing::info!(
                    server = conn.id(),
                    pid = conn.backend_pid(),
                    "idle server connection failed its check; dropping it"
                );
                return (None, true);
            }
            // The round trip may have brought news (in_hot_standby after
            // a promotion).
            if !self.still_fits(&conn) {
                return (None, true);
            }
            return (Some(conn), true);
        }
        (Some(conn), false)
    }

    /// Whether an idle connection still fits its database's target, as
    /// far as the parameters its server last reported tell (a standby that
    /// was promoted reports `in_hot_standby` off at its next statement). A
    /// server that restarted as a standby closed its connections, which
    /// [`ServerConn::looks_alive`] sees. With `target: any`, one comparison.
    fn still_fits(&self, conn: &ServerConn) -> bool {
        let target = self.target.load().hosts.target();
        if target == crate::config::TargetSessionAttrs::Any {
            return true;
        }
        match backend::hosts::reported_read_only(conn.params().now()) {
            Some(ro) if !target.fits(ro) => {
                tracing::info!(
                    server = conn.id(),
                    pid = conn.backend_pid(),
                    %target,
                    "idle server connection no longer fits the target; dropping it"
                );
                false
            }
            _ => true,
        }
    }

    /// Returns a clean server connection (idle, not in a transaction) to the
    /// pool, or closes it if it has outlived `server_lifetime` (or RECONNECT
    /// or PAUSE came meanwhile).
    pub fn checkin(&self, checkout: Checkout) {
        self.checkin_at(checkout, Instant::now());
    }

    /// [`Pool::checkin`] for a caller that has just read the clock.
    pub fn checkin_at(&self, checkout: Checkout, now: Instant) {
        let checkout = if self.handoffs_queued.load(Ordering::Acquire) == 0 {
            checkout
        } else {
            match self.hand_off(checkout, now) {
                Some(checkout) => checkout,
                None => return,
            }
        };
        if self.slots.checkin(checkout.conn, checkout.lease, now) == slots::CheckedIn::Idle {
            self.caps.idle_added();
        }
    }

    /// Closes a server connection that is not safe to reuse.
    pub fn discard(&self, checkout: Checkout) {
        tracing::debug!(server = checkout.conn.id(), "closing server connection");
        drop(checkout);
    }

    /// Session mode: runs `server_reset_query`, then returns the connection,
    /// or closes it if the reset fails.
    pub async fn reset_and_checkin(&self, mut checkout: Checkout) {
        let query = self.slots.settings().server_reset_query.clone();
        if query.is_empty() {
            return self.checkin(checkout);
        }
        match checkout.conn.reset_session(&query).await {
            Ok(()) => self.checkin(checkout),
            Err(e) => {
                tracing::warn!(server = checkout.conn.id(), code = e.sqlstate(), error = %e, "server_reset_query failed; closing the connection");
                self.discard(checkout);
            }
        }
    }

    /// Transaction mode: a connection whose client held state on it (a
    /// pinned client that left) goes back after DISCARD ALL, whatever
    /// `server_reset_query` says (it is session mode's, and may not end
    /// LISTEN, locks or temporary tables); closed if that fails.
    pub async fn reset_pinned_and_checkin(&self, mut checkout: Checkout) {
        match checkout.conn.reset_session("DISCARD ALL").await {
            Ok(()) => {
                checkout.conn.prepared_mut().clear();
                self.checkin(checkout)
            }
            Err(e) => {
                tracing::warn!(server = checkout.conn.id(), code = e.sqlstate(), error = %e, "DISCARD ALL after a pinned client failed; closing the connection");
                self.discard(checkout);
            }
        }
    }

    /// Closes every idle connection (shutdown, PAUSE, RECONNECT).
    pub fn close_idle(&self) {
        self.slots.close_idle();
    }

    /// Whether its server connections are to database `dbname`, as the
    /// server names it (a `databases` entry's `dbname`).
    pub fn has_server_dbname(&self, dbname: &str) -> bool {
        self.target.load().dbname == dbname
    }

    /// Closes the idle connections to the server at `host`:`port` (as
    /// configured); how many. Their sockets close, and their backends exit.
    pub fn close_idle_on(&self, host: &str, port: u16) -> usize {
        self.slots.close_idle_where(|c| {
            let server = &c.summary().cancel;
            server.host == host && server.port == port
        })
    }

    /// Housekeeping, run periodically: closes idle connections past
    /// `server_idle_timeout` or `server_lifetime` (keeping `min_pool_size`),
    /// then opens connections up to `min_pool_size`.
    pub async fn maintain(&self) {
        let settings = self.slots.settings_full();
        self.slots.close_expired(Instant::now());
        while let Some(slot) = self.slots.slot_for_min_size() {
            // In an outage, only when the next attempt is due and nobody
            // makes it: clients' attempts come first.
            let attempt = match self.outage.turn(Instant::now(), self.outage.epoch(), true) {
                Turn::Open => None,
                Turn::Attempt(attempt) => Some(attempt),
                Turn::Wait(_) | Turn::Refused(_) => break,
            };
            // Under a cap, min_pool_size opens only what fits.
            let Ok(place) = self
                .caps
                .try_server(settings.max_db_connections, settings.max_user_connections)
            else {
                break;
            };
            let opened = self.connect(&settings).await.map_err(Arc::new);
            self.opened(opened.as_ref().err(), &settings);
            drop(attempt);
            let opened = opened.map(|mut conn| {
                conn.keep_until_closed(place);
                conn
            });
            match opened {
                Ok(conn) => {
                    let kept = self.slots.add_idle(conn);
                    drop(slot);
                    if !kept {
                        break;
                    }
                }
                Err(e) => {
                    tracing::debug!(db = %self.database, user = %self.user, code = e.sqlstate(), error = %e, "could not open a min_pool_size connection");
                    break;
                }
            }
        }
    }

    /// How often [`Pool::maintain`] should run for these settings.
    pub fn maintenance_interval(&self) -> Duration {
        self.slots.maintenance_interval()
    }
}

/// What can be seen of `Pool` without a server: the bookkeeping itself is
/// tested in `slots.rs`.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::SharedCredential;
    use crate::config::Config;
    use crate::tls::ServerTls;

    #[tokio::test(start_paused = true)]
    async fn a_checkout_from_a_paused_pool_times_out_naming_the_pool() {
        let config = Config::from_yaml("databases: { app: {} }\n", "t.yaml").unwrap();
        let limits = PoolLimits {
            size: 3,
            query_wait_timeout: Duration::from_secs(5),
            ..config.limits_for("app", "alice")
        };
        // Nothing listens there, and nothing may connect: the pool is paused.
        let target = ServerTarget {
            hosts: Arc::new(backend::ServerHosts::single("127.0.0.1".into(), 1)),
            dbname: "app".into(),
            user: "alice".into(),
            tls: ServerTls::disabled(),
            credential: SharedCredential::default(),
        };
        let caps = caps::Caps::default().for_pool("app", "alice");
        let pool = Arc::new(Pool::new(
            "app".into(),
            "alice".into(),
            target,
            limits,
            caps,
        ));
        pool.pause();
        match pool.checkout().await {
            Err(CheckoutError::NoneFree {
                database,
                user,
                waited,
                pool_size,
                paused,
            }) => {
                assert_eq!((database.as_str(), user.as_str()), ("app", "alice"));
                assert_eq!(
                    (waited, pool_size, paused),
                    (Duration::from_secs(5), 3, true)
                );
            }
            other => panic!("expected NoneFree, got {other:?}"),
        }
        assert_eq!(
            pool.stats
                .waiting
                .load(std::sync::atomic::Ordering::Relaxed),
            0
        );
        assert_eq!(
            pool.stats
                .servers_login
                .load(std::sync::atomic::Ordering::Relaxed),
            0
        );
    }
}
