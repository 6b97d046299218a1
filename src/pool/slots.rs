//! A pool's bookkeeping, apart from what a connection is: the `pool_size`
//! slots (places.rs, waiters queued per shard; the reserve is a semaphore)
//! and waiting for one under `query_wait_timeout`, the idle lists (idle.rs,
//! one per shard, last in, first out), generations (RECONNECT), PAUSE, and
//! the lifetime and idle-timeout decisions.
//!
//! It is generic over the connection (anything [`Pooled`]) and does no I/O:
//! [`super::Pool`] is these slots plus opening, vetting and resetting
//! server connections, and the unit tests below drive them with a plain
//! struct under tokio's paused clock.
//!
//! The decisions that depend on a connection's age take `now` from the
//! caller (the pool passes `Instant::now()`), so tests state the time.

use super::hot_limits::HotLimits;
use super::idle::IdleLists;
use super::places::{Expired, Places};
use super::pool_stats::{Lent, PoolStats, Waiting};
use crate::config::PoolLimits;
use arc_swap::ArcSwap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

/// What the bookkeeping needs to know of a pooled connection.
pub(super) trait Pooled {
    /// An id for logs.
    fn id(&self) -> u64;
    /// The generation it was opened in ([`Slots::generation`] then).
    fn generation(&self) -> u64;
    fn created(&self) -> Instant;
    fn last_used(&self) -> Instant;
    /// Marks it used at `now` (it is being checked in).
    fn touch(&mut self, now: Instant);
}

/// The slots, idle connections and state of one pool.
#[derive(Debug)]
pub(super) struct Slots<C> {
    settings: ArcSwap<PoolLimits>,
    /// What a transaction reads of `settings`, as atomics (hot_limits.rs).
    hot: HotLimits,
    /// One list per shard (idle.rs).
    idle: IdleLists<C>,
    /// The `pool_size` places, queued per shard (places.rs).
    places: Arc<Places>,
    /// `reserve_pool_size` more places, for clients that waited
    /// `reserve_pool_timeout`; with what it owes after shrinking.
    reserve: Arc<Semaphore>,
    reserve_owed: Arc<AtomicUsize>,
    /// Connections of an older generation are closed, not reused.
    generation: AtomicU64,
    paused: AtomicBool,
    resumed: Notify,
    stats: Arc<PoolStats>,
}

/// Resizes `permits` from `from` to `to` places: growing wakes waiters;
/// shrinking takes free permits now and records the others in `owed`, to
/// be taken as they come back ([`Slot`]'s drop).
fn resize(permits: &Semaphore, owed: &AtomicUsize, from: usize, to: usize) {
    if to > from {
        let mut grow = to - from;
        // Cancel permits still owed from an earlier shrink first.
        let _ = owed.fetch_update(Ordering::AcqRel, Ordering::Acquire, |o| {
            let cancel = o.min(to - from);
            grow = to - from - cancel;
            Some(o - cancel)
        });
        permits.add_permits(grow);
    } else {
        let shrink = from - to;
        let taken = permits.forget_permits(shrink);
        // Lent connections give theirs back later: forget those then.
        owed.fetch_add(shrink - taken, Ordering::AcqRel);
    }
}

/// One of the pool's `pool_size` places (or of its reserve), held from the
/// end of the wait until the connection is checked in or closed. While the
/// pool owes places (it shrank), the place is given up instead of returned.
#[derive(Debug)]
pub(super) enum Slot {
    Place(Arc<Places>),
    Reserve {
        permit: Option<OwnedSemaphorePermit>,
        owed: Arc<AtomicUsize>,
    },
}

impl Drop for Slot {
    fn drop(&mut self) {
        match self {
            Slot::Place(places) => places.give_back(),
            Slot::Reserve { permit, owed } => {
                let owed =
                    owed.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
                if owed.is_ok() {
                    if let Some(p) = permit.take() {
                        p.forget();
                    }
                }
            }
        }
    }
}

/// What a lent connection holds of its pool: its slot, and its place in
/// the active count. Dropping it (however the checkout ends) gives both back.
#[derive(Debug)]
pub(super) struct Lease {
    _slot: Slot,
    _lent: Lent,
}

/// Why no slot was had.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum NoSlot {
    /// The semaphore was closed.
    Closed,
    /// None came free within `query_wait_timeout`.
    TimedOut {
        waited: Duration,
        pool_size: usize,
        /// The pool was paused when the wait ended.
        paused: bool,
    },
}

/// What became of a connection checked in.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum CheckedIn {
    /// Back in the idle list.
    Idle,
    /// Closed: it outlived `server_lifetime`.
    PastLifetime,
    /// Closed: RECONNECT started a new generation, or the pool is paused.
    Stale,
}

impl<C: Pooled> Slots<C> {
    pub(super) fn new(settings: PoolLimits, stats: Arc<PoolStats>) -> Self {
        Slots {
            places: Arc::new(Places::new(settings.size)),
            reserve: Arc::new(Semaphore::new(settings.reserve_size)),
            reserve_owed: Arc::new(AtomicUsize::new(0)),
            hot: HotLimits::new(&settings),
            settings: ArcSwap::from_pointee(settings),
            idle: IdleLists::new(),
            generation: AtomicU64::new(0),
            paused: AtomicBool::new(false),
            resumed: Notify::new(),
            stats,
        }
    }

    /// The settings now. A cheap guard: do not hold it across awaits.
    pub(super) fn settings(&self) -> arc_swap::Guard<Arc<PoolLimits>> {
        self.settings.load()
    }

    pub(super) fn hot(&self) -> &HotLimits {
        &self.hot
    }

    pub(super) fn settings_full(&self) -> Arc<PoolLimits> {
        self.settings.load_full()
    }

    /// Takes new settings: a new `pool_size` resizes (growing wakes
    /// waiters; shrinking takes free permits now and the others as they
    /// come back), and idle connections beyond the new size close.
    /// Returns the old settings.
    pub(super) fn apply(&self, settings: PoolLimits) -> Arc<PoolLimits> {
        self.hot.store(&settings);
        let old = self.settings.swap(Arc::new(settings));
        let new = self.settings.load();
        if new.size != old.size {
            self.places.resize(old.size, new.size);
        }
        if new.reserve_size != old.reserve_size {
            resize(
                &self.reserve,
                &self.reserve_owed,
                old.reserve_size,
                new.reserve_size,
            );
        }
        self.trim_idle();
        old
    }

    /// The generation new connections are opened in.
    pub(super) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// RECONNECT: a new generation; idle connections close now, lent ones
    /// when they come back.
    pub(super) fn new_generation(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
        self.close_idle();
    }

    fn current(&self, conn: &C) -> bool {
        conn.generation() == self.generation()
    }

    /// PAUSE: no slot is given until [`Slots::resume`]; waiters wait.
    pub(super) fn pause(&self) {
        self.paused.store(true, Ordering::Release);
    }

    pub(super) fn resume(&self) {
        self.paused.store(false, Ordering::Release);
        self.resumed.notify_waiters();
    }

    pub(super) fn is_paused(&self) -> bool {
        self.paused.load(Ordering::Acquire)
    }

    async fn wait_unpaused(&self) {
        // Not paused, nearly always: no notification to make and enable
        // (about 110 instructions per waiting checkout).
        if !self.is_paused() {
            return;
        }
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

    /// Connections lent out now.
    fn active(&self) -> usize {
        self.stats.active.load(Ordering::Relaxed)
    }

    /// Waits until the pool is not paused and a slot is free, for at most
    /// `query_wait_timeout`; counted as waiting meanwhile.
    pub(super) async fn wait_for_slot(&self) -> Result<Slot, NoSlot> {
        // Most checkouts find a place free: no timer, no waiter list (a
        // permit left over means nobody is queued for one).
        if let Some(slot) = self.try_slot() {
            return Ok(slot);
        }
        let started = tokio::time::Instant::now();
        let settings = self.settings.load();
        let wait_limit = settings.query_wait_timeout;
        let deadline = started + wait_limit;
        // A client that waited reserve_pool_timeout may also take one of
        // the reserve's places, whichever comes first.
        let reserve_after = settings
            .reserve_timeout
            .filter(|_| settings.reserve_size > 0);
        let pool_size = settings.size;
        drop(settings);
        let waiting = Waiting::new(&self.stats);
        // A place's wait ends at the deadline by itself (the places'
        // sweeper); only a pause and the reserve need timers of their own.
        let main = async {
            if self.is_paused() {
                tokio::time::timeout_at(deadline, self.wait_unpaused())
                    .await
                    .map_err(|_| Expired)?;
            }
            self.places.take(deadline).await?;
            Ok(Ok(Slot::Place(self.places.clone())))
        };
        let got = match reserve_after {
            None => main.await,
            Some(after) => {
                let reserve = async {
                    tokio::time::sleep(after).await;
                    self.wait_unpaused().await;
                    let permit = self.reserve.clone().acquire_owned().await;
                    if permit.is_ok() {
                        tracing::debug!("taking a connection from the reserve pool");
                    }
                    permit.map(|p| Slot::Reserve {
                        permit: Some(p),
                        owed: self.reserve_owed.clone(),
                    })
                };
                tokio::time::timeout_at(deadline, async {
                    tokio::select! {
                        biased;
                        p = main => p,
                        p = reserve => Ok(p),
                    }
                })
                .await
                .unwrap_or(Err(Expired))
            }
        };
        drop(waiting);
        // The histogram's sample is the checkout's (with any outage wait).
        self.stats.waited_for_place(started.elapsed());
        match got {
            Ok(Ok(slot)) => {
                self.stats.checkouts.fetch_add(1, Ordering::Relaxed);
                Ok(slot)
            }
            Ok(Err(_)) => Err(NoSlot::Closed),
            Err(Expired) => Err(NoSlot::TimedOut {
                waited: wait_limit,
                pool_size,
                paused: self.is_paused(),
            }),
        }
    }

    /// Whether a checkout now would wait: the pool is paused or every
    /// slot is taken. A hint (it may change at once), for what a client
    /// keeps while it waits.
    pub(super) fn would_wait(&self) -> bool {
        self.is_paused() || self.places.available() == 0
    }

    /// A slot if one is free now and the pool is not paused; no waiting.
    pub(super) fn try_slot(&self) -> Option<Slot> {
        if self.is_paused() {
            return None;
        }
        let slot = self.try_place()?;
        self.stats.checkouts.fetch_add(1, Ordering::Relaxed);
        Some(slot)
    }

    /// One of the `pool_size` places, if one is free now.
    fn try_place(&self) -> Option<Slot> {
        self.places
            .try_take()
            .then(|| Slot::Place(self.places.clone()))
    }

    /// Lends a connection in `slot`: it counts as active until the lease drops.
    pub(super) fn lease(&self, slot: Slot) -> Lease {
        Lease {
            _slot: slot,
            _lent: Lent::new(&self.stats),
        }
    }

    /// The most recently used idle connection that may be reused: of the
    /// current generation and not past `server_lifetime` (others met on
    /// the way are closed). Whether it is still alive is the caller's to check.
    pub(super) fn take_idle(&self, now: Instant) -> Option<C> {
        while let Some(conn) = self.pop_idle() {
            if self.past_lifetime(&conn, now) {
                tracing::debug!(server = conn.id(), "server_lifetime reached; closing");
                continue;
            }
            if self.current(&conn) {
                return Some(conn);
            }
        }
        None
    }

    /// Whether an idle connection sat long enough (`server_check_delay`)
    /// to need a round trip before it is lent.
    pub(super) fn needs_check(&self, conn: &C, now: Instant) -> bool {
        now.saturating_duration_since(conn.last_used()) >= self.hot.server_check_delay()
    }

    fn past_lifetime(&self, conn: &C, now: Instant) -> bool {
        self.hot
            .server_lifetime()
            .is_some_and(|l| now.saturating_duration_since(conn.created()) >= l)
    }

    fn pop_idle(&self) -> Option<C> {
        let (conn, left) = self.idle.pop();
        self.stats.idle_servers(left);
        conn
    }

    /// Adds a connection to the idle list as it is (a new one, opened for
    /// `min_pool_size`), unless the pool is paused: PAUSE closes the idle
    /// connections, and one that finished opening after that would sit
    /// through the pause (dead, if the server was restarted meanwhile).
    /// Whether it was kept; checked under the list's lock, which PAUSE's
    /// close takes after setting the flag.
    pub(super) fn add_idle(&self, conn: C) -> bool {
        match self.idle.push_unless(conn, || self.is_paused()) {
            Ok(total) => {
                self.stats.idle_servers(total);
                true
            }
            Err(conn) => {
                tracing::debug!(server = conn.id(), "opened during a pause; closing");
                false
            }
        }
    }

    /// Whether a clean connection checked in now may be used again: of
    /// the current generation, not past `server_lifetime`, the pool not
    /// paused (what [`Slots::checkin`] keeps).
    pub(super) fn reusable(&self, conn: &C, now: Instant) -> bool {
        !self.past_lifetime(conn, now) && self.current(conn) && !self.is_paused()
    }

    /// Takes back a clean connection: idle again, or closed if it outlived
    /// `server_lifetime`, is of an older generation, or the pool is paused.
    /// The lease (the slot and the active count) is given up after the
    /// connection is back in the list.
    pub(super) fn checkin(&self, mut conn: C, lease: Lease, now: Instant) -> CheckedIn {
        let outcome = if self.past_lifetime(&conn, now) {
            tracing::debug!(server = conn.id(), "server_lifetime reached; closing");
            CheckedIn::PastLifetime
        } else if !self.current(&conn) || self.is_paused() {
            tracing::debug!(server = conn.id(), "reconnect or pause; closing");
            CheckedIn::Stale
        } else {
            conn.touch(now);
            // A PAUSE between the check above and the list's lock closes it.
            return match self.add_idle(conn) {
                true => CheckedIn::Idle,
                false => CheckedIn::Stale,
            }; // the lease drops here
        };
        // Closed before the slot is free, so the pool never has more than
        // pool_size connections open.
        drop(conn);
        drop(lease);
        outcome
    }

    /// Closes every idle connection (shutdown, PAUSE, RECONNECT).
    /// Closes the least recently used idle connection, if any; whether
    /// there was one. Dropped after the list's lock is released.
    pub(super) fn close_oldest_idle(&self) -> bool {
        let oldest = self.idle.take_oldest();
        self.stats.idle_servers(self.idle.len());
        oldest.is_some()
    }

    pub(super) fn close_idle(&self) {
        let closing = self.idle.take_all();
        self.stats.idle_servers(self.idle.len());
        drop(closing);
    }

    /// Closes the idle connections `which` picks (the others keep their
    /// order); how many. They are dropped after the list's lock is
    /// released.
    pub(super) fn close_idle_where(&self, which: impl FnMut(&C) -> bool) -> usize {
        let closing = self.idle.take_where(which);
        self.stats.idle_servers(self.idle.len());
        closing.len()
    }

    /// Waits until no connection is lent out (after PAUSE), then closes
    /// the idle ones, as PgBouncer does.
    pub(super) async fn drained(&self) {
        while self.active() > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.close_idle();
    }

    /// Idle connections right now.
    pub(super) fn idle_count(&self) -> usize {
        self.idle.len()
    }

    /// `describe(connection, stale)` for each idle connection, least
    /// recently used first; `stale`: of an older generation.
    pub(super) fn describe_idle<R>(&self, mut describe: impl FnMut(&C, bool) -> R) -> Vec<R> {
        let generation = self.generation();
        self.idle
            .describe(|c| describe(c, c.generation() != generation))
    }

    /// Closes idle connections beyond `pool_size` (after it shrank), least
    /// recently used first.
    fn trim_idle(&self) {
        let keep = self.settings.load().size.saturating_sub(self.active());
        while self.idle.len() > keep && self.idle.take_oldest().is_some() {}
        self.stats.idle_servers(self.idle.len());
    }

    /// Housekeeping: closes idle connections beyond `pool_size`, and those
    /// past `server_idle_timeout` or `server_lifetime` while more than
    /// `min_pool_size` exist.
    pub(super) fn close_expired(&self, now: Instant) {
        let settings = self.settings.load_full();
        let min = settings.min_size.min(settings.size);
        self.trim_idle();
        let total = self.idle.len() + self.active();
        let idle_timeout = settings.server_idle_timeout;
        let lifetime = settings.server_lifetime;
        let mut closed = 0;
        // Least recently used first, within each shard's list.
        let closing = self.idle.take_where(|conn| {
            let expired = idle_timeout
                .is_some_and(|t| now.saturating_duration_since(conn.last_used()) >= t)
                || lifetime.is_some_and(|l| now.saturating_duration_since(conn.created()) >= l);
            let close = expired && total - closed > min;
            if close {
                closed += 1;
                tracing::debug!(server = conn.id(), "closing idle server connection");
            }
            close
        });
        self.stats.idle_servers(self.idle.len());
        drop(closing);
    }

    /// A free slot to open one more connection in, while idle and lent
    /// connections are fewer than `min_pool_size` and the pool is not paused.
    pub(super) fn slot_for_min_size(&self) -> Option<Slot> {
        let settings = self.settings.load();
        let min = settings.min_size.min(settings.size);
        if self.idle_count() + self.active() >= min || self.is_paused() {
            return None;
        }
        self.try_place()
    }

    /// How often housekeeping should run for these settings: a quarter of
    /// the shortest of `server_idle_timeout` and `server_lifetime`, between
    /// 50 ms and 1 s.
    pub(super) fn maintenance_interval(&self) -> Duration {
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

/// The bookkeeping driven with a plain struct for a connection, under
/// tokio's paused clock: waits of `query_wait_timeout` take no real time.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    const WAIT: Duration = Duration::from_secs(5);

    #[derive(Debug)]
    struct Conn {
        id: u64,
        generation: u64,
        created: Instant,
        last_used: Instant,
    }

    impl Pooled for Conn {
        fn id(&self) -> u64 {
            self.id
        }
        fn generation(&self) -> u64 {
            self.generation
        }
        fn created(&self) -> Instant {
            self.created
        }
        fn last_used(&self) -> Instant {
            self.last_used
        }
        fn touch(&mut self, now: Instant) {
            self.last_used = now;
        }
    }

    /// The default settings with `pool_size` = `size`, a 5 s
    /// `query_wait_timeout`, no idle timeout and no lifetime.
    fn limits(size: usize) -> PoolLimits {
        let config = Config::from_yaml("databases: { app: {} }\n", "t.yaml").unwrap();
        PoolLimits {
            size,
            min_size: 0,
            query_wait_timeout: WAIT,
            server_idle_timeout: None,
            server_lifetime: None,
            ..config.limits_for("app", "u")
        }
    }

    fn slots(settings: PoolLimits) -> Arc<Slots<Conn>> {
        Arc::new(Slots::new(settings, Arc::new(PoolStats::new("app", "u"))))
    }

    /// A connection "opened" now, in the current generation.
    fn open(slots: &Slots<Conn>, id: u64) -> Conn {
        let now = Instant::now();
        Conn {
            id,
            generation: slots.generation(),
            created: now,
            last_used: now,
        }
    }

    /// What `Pool::checkout` does, without the I/O: a slot, then the idle
    /// connection if any, else a new one (`id`).
    async fn checkout(slots: &Slots<Conn>, id: u64) -> (Conn, Lease) {
        let slot = slots.wait_for_slot().await.expect("a slot");
        let conn = slots
            .take_idle(Instant::now())
            .unwrap_or_else(|| open(slots, id));
        (conn, slots.lease(slot))
    }

    /// Lets spawned tasks run until `done` holds (the clock is paused, so
    /// this is about scheduling, not time).
    async fn until(mut done: impl FnMut() -> bool) {
        for _ in 0..1000 {
            if done() {
                return;
            }
            tokio::task::yield_now().await;
        }
        panic!("condition never held");
    }

    fn waiting(slots: &Slots<Conn>) -> usize {
        slots.stats.waiting.load(Ordering::Relaxed)
    }

    /// Whether a slot is free right now (taken and given back).
    async fn slot_free(slots: &Slots<Conn>) -> bool {
        tokio::time::timeout(Duration::from_millis(1), slots.wait_for_slot())
            .await
            .is_ok_and(|slot| slot.is_ok())
    }

    #[tokio::test(start_paused = true)]
    async fn checkout_from_empty_gives_a_slot_to_connect_in() {
        let slots = slots(limits(2));
        let slot = slots.wait_for_slot().await.unwrap();
        assert!(slots.take_idle(Instant::now()).is_none());
        let lease = slots.lease(slot);
        assert_eq!(slots.active(), 1);
        assert_eq!(slots.stats.checkouts.load(Ordering::Relaxed), 1);
        drop(lease);
        assert_eq!(slots.active(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_checked_in_connection_is_lent_again_last_in_first_out() {
        let slots = slots(limits(2));
        let (a, lease_a) = checkout(&slots, 1).await;
        let (b, lease_b) = checkout(&slots, 2).await;
        assert_eq!(slots.checkin(a, lease_a, Instant::now()), CheckedIn::Idle);
        assert_eq!(slots.checkin(b, lease_b, Instant::now()), CheckedIn::Idle);
        assert_eq!((slots.idle_count(), slots.active()), (2, 0));
        let (again, _lease) = checkout(&slots, 3).await;
        assert_eq!(again.id, 2, "the most recently used comes first");
        assert_eq!(slots.idle_count(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn checkin_marks_the_connection_used() {
        let slots = slots(limits(1));
        let (mut conn, lease) = checkout(&slots, 1).await;
        let long_ago = conn.last_used;
        conn.last_used = long_ago - Duration::from_millis(1);
        slots.checkin(conn, lease, Instant::now());
        let (conn, _lease) = checkout(&slots, 2).await;
        assert!(conn.last_used >= long_ago);
    }

    #[tokio::test(start_paused = true)]
    async fn pool_size_bounds_checkouts_and_a_waiter_times_out() {
        let slots = slots(limits(2));
        let _a = checkout(&slots, 1).await;
        let _b = checkout(&slots, 2).await;
        let started = tokio::time::Instant::now();
        let waiter = tokio::spawn({
            let slots = slots.clone();
            async move { slots.wait_for_slot().await.map(drop) }
        });
        until(|| waiting(&slots) == 1).await;
        assert_eq!(
            waiter.await.unwrap(),
            Err(NoSlot::TimedOut {
                waited: WAIT,
                pool_size: 2,
                paused: false
            })
        );
        assert!(started.elapsed() >= WAIT, "it waited query_wait_timeout");
        assert_eq!(waiting(&slots), 0, "no longer counted as waiting");
        assert_eq!(slots.active(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_gets_the_connection_checked_in() {
        let slots = slots(limits(1));
        let (conn, lease) = checkout(&slots, 1).await;
        let waiter = tokio::spawn({
            let slots = slots.clone();
            async move { checkout(&slots, 2).await.0.id }
        });
        until(|| waiting(&slots) == 1).await;
        slots.checkin(conn, lease, Instant::now());
        assert_eq!(waiter.await.unwrap(), 1);
        assert_eq!(waiting(&slots), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn discard_frees_the_slot() {
        let slots = slots(limits(1));
        let (conn, lease) = checkout(&slots, 1).await;
        assert!(!slot_free(&slots).await);
        // What Pool::discard does: the connection and its lease drop.
        drop((conn, lease));
        assert_eq!((slots.active(), slots.idle_count()), (0, 0));
        let (conn, _lease) = checkout(&slots, 2).await;
        assert_eq!(conn.id, 2, "a new connection: nothing went back idle");
    }

    #[tokio::test(start_paused = true)]
    async fn growing_wakes_a_waiter() {
        let slots = slots(limits(1));
        let _held = checkout(&slots, 1).await;
        let waiter = tokio::spawn({
            let slots = slots.clone();
            async move { checkout(&slots, 2).await.0.id }
        });
        until(|| waiting(&slots) == 1).await;
        slots.apply(limits(2));
        assert_eq!(waiter.await.unwrap(), 2, "got a slot before timing out");
    }

    #[tokio::test(start_paused = true)]
    async fn shrinking_closes_surplus_idle_connections_now() {
        let slots = slots(limits(3));
        let lent = [
            checkout(&slots, 1).await,
            checkout(&slots, 2).await,
            checkout(&slots, 3).await,
        ];
        for (conn, lease) in lent {
            slots.checkin(conn, lease, Instant::now());
        }
        assert_eq!(slots.idle_count(), 3);
        let old = slots.apply(limits(1));
        assert_eq!(old.size, 3);
        // The least recently used go.
        assert_eq!(slots.describe_idle(|c, _| c.id), vec![3]);
        let _one = checkout(&slots, 4).await;
        assert!(!slot_free(&slots).await, "one slot in all");
    }

    #[tokio::test(start_paused = true)]
    async fn shrinking_below_the_lent_takes_their_slots_as_they_come_back() {
        let slots = slots(limits(3));
        let a = checkout(&slots, 1).await;
        let b = checkout(&slots, 2).await;
        let c = checkout(&slots, 3).await;
        slots.apply(limits(1));
        slots.checkin(a.0, a.1, Instant::now());
        slots.checkin(b.0, b.1, Instant::now());
        assert!(!slot_free(&slots).await, "two slots were owed");
        slots.checkin(c.0, c.1, Instant::now());
        // Idle connections beyond pool_size close at the next housekeeping.
        slots.close_expired(Instant::now());
        assert_eq!(slots.idle_count(), 1);
        let _one = checkout(&slots, 4).await;
        assert!(!slot_free(&slots).await, "one slot in all");
    }

    #[tokio::test(start_paused = true)]
    async fn growing_again_cancels_what_a_shrink_still_owed() {
        let slots = slots(limits(2));
        let a = checkout(&slots, 1).await;
        let b = checkout(&slots, 2).await;
        slots.apply(limits(1)); // one owed
        slots.apply(limits(2)); // no longer owed; nothing added
        drop((a, b));
        let _a = checkout(&slots, 3).await;
        let _b = checkout(&slots, 4).await;
        assert!(!slot_free(&slots).await, "two slots, not three");
    }

    #[tokio::test(start_paused = true)]
    async fn a_new_generation_closes_idle_connections_and_refuses_returning_ones() {
        let slots = slots(limits(2));
        let idle = checkout(&slots, 1).await;
        let lent = checkout(&slots, 2).await;
        slots.checkin(idle.0, idle.1, Instant::now());
        assert_eq!(slots.idle_count(), 1);

        slots.new_generation();
        assert_eq!(slots.idle_count(), 0, "idle ones close at once");
        assert_eq!(
            slots.checkin(lent.0, lent.1, Instant::now()),
            CheckedIn::Stale
        );
        assert_eq!((slots.idle_count(), slots.active()), (0, 0));

        let (conn, lease) = checkout(&slots, 3).await;
        assert_eq!(conn.generation, 1, "new connections are of the new one");
        assert_eq!(slots.checkin(conn, lease, Instant::now()), CheckedIn::Idle);
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_connection_of_an_older_generation_is_stale_and_never_lent() {
        let slots = slots(limits(2));
        let old = open(&slots, 1);
        slots.new_generation();
        slots.add_idle(old);
        slots.add_idle(open(&slots, 2));
        assert_eq!(
            slots.describe_idle(|c, stale| (c.id, stale)),
            vec![(1, true), (2, false)]
        );
        let now = Instant::now();
        assert_eq!(slots.take_idle(now).map(|c| c.id), Some(2));
        assert!(slots.take_idle(now).is_none(), "the old one was closed");
        assert_eq!(slots.idle_count(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_opened_during_a_pause_is_closed_not_idled() {
        let slots = slots(limits(2));
        slots.pause();
        slots.drained().await;
        assert!(!slots.add_idle(open(&slots, 1)));
        assert_eq!(slots.idle_count(), 0, "PAUSE leaves no idle connection");
        slots.resume();
        assert!(slots.add_idle(open(&slots, 2)));
        assert_eq!(slots.idle_count(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn pause_holds_checkouts_until_resume() {
        let slots = slots(limits(2));
        slots.pause();
        let waiter = tokio::spawn({
            let slots = slots.clone();
            async move { checkout(&slots, 1).await.0.id }
        });
        until(|| waiting(&slots) == 1).await;
        tokio::time::sleep(WAIT / 2).await;
        assert!(!waiter.is_finished(), "a free slot, but paused");
        slots.resume();
        assert_eq!(waiter.await.unwrap(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_wait_that_ends_paused_says_so() {
        let slots = slots(limits(2));
        slots.pause();
        assert_eq!(
            slots.wait_for_slot().await.map(drop),
            Err(NoSlot::TimedOut {
                waited: WAIT,
                pool_size: 2,
                paused: true
            })
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_returning_to_a_paused_pool_closes() {
        let slots = slots(limits(1));
        let (conn, lease) = checkout(&slots, 1).await;
        slots.pause();
        assert_eq!(slots.checkin(conn, lease, Instant::now()), CheckedIn::Stale);
        assert_eq!((slots.idle_count(), slots.active()), (0, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn drained_waits_for_every_connection_then_closes_the_idle() {
        let slots = slots(limits(2));
        let idle = checkout(&slots, 1).await;
        let (conn, lease) = checkout(&slots, 2).await;
        slots.checkin(idle.0, idle.1, Instant::now());
        slots.pause();
        let drained = slots.drained();
        tokio::pin!(drained);
        assert!(
            tokio::time::timeout(Duration::from_secs(60), &mut drained)
                .await
                .is_err(),
            "one is still lent"
        );
        assert_eq!(slots.idle_count(), 1);
        drop((conn, lease));
        tokio::time::timeout(Duration::from_secs(1), drained)
            .await
            .expect("drained once everything is back");
        assert_eq!(slots.idle_count(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn housekeeping_closes_connections_idle_too_long_down_to_min_pool_size() {
        let timeout = Duration::from_secs(600);
        let slots = slots(PoolLimits {
            min_size: 1,
            server_idle_timeout: Some(timeout),
            ..limits(3)
        });
        let lent = [
            checkout(&slots, 1).await,
            checkout(&slots, 2).await,
            checkout(&slots, 3).await,
        ];
        for (conn, lease) in lent {
            slots.checkin(conn, lease, Instant::now());
        }
        let returned = Instant::now();
        slots.close_expired(returned + timeout - Duration::from_secs(1));
        assert_eq!(slots.idle_count(), 3, "not idle long enough yet");
        slots.close_expired(returned + timeout);
        assert_eq!(
            slots.describe_idle(|c, _| c.id),
            vec![3],
            "the least recently used close first; min_pool_size stays"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn lent_connections_count_toward_min_pool_size() {
        let timeout = Duration::from_secs(600);
        let slots = slots(PoolLimits {
            min_size: 1,
            server_idle_timeout: Some(timeout),
            ..limits(2)
        });
        let idle = checkout(&slots, 1).await;
        let _lent = checkout(&slots, 2).await;
        slots.checkin(idle.0, idle.1, Instant::now());
        slots.close_expired(Instant::now() + timeout);
        assert_eq!(slots.idle_count(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn server_lifetime_closes_idle_refuses_returning_and_is_never_lent() {
        let lifetime = Duration::from_secs(3600);
        let slots = slots(PoolLimits {
            server_lifetime: Some(lifetime),
            ..limits(3)
        });
        let a = checkout(&slots, 1).await;
        let b = checkout(&slots, 2).await;
        let c = checkout(&slots, 3).await;
        let later = Instant::now() + lifetime;
        slots.checkin(a.0, a.1, Instant::now());
        slots.checkin(b.0, b.1, Instant::now());
        assert_eq!(slots.checkin(c.0, c.1, later), CheckedIn::PastLifetime);
        assert_eq!(slots.idle_count(), 2);

        assert!(slots.take_idle(later).is_none(), "both too old to lend");
        assert_eq!(slots.idle_count(), 0);

        let d = open(&slots, 4);
        let d_opened = d.created;
        slots.add_idle(d);
        slots.close_expired(d_opened + lifetime - Duration::from_secs(1));
        assert_eq!(slots.idle_count(), 1);
        slots.close_expired(d_opened + lifetime);
        assert_eq!(slots.idle_count(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn housekeeping_asks_for_connections_up_to_min_pool_size() {
        let slots = slots(PoolLimits {
            min_size: 2,
            ..limits(5)
        });
        let _lent = checkout(&slots, 1).await;
        let slot = slots.slot_for_min_size().expect("one short");
        slots.add_idle(open(&slots, 2));
        drop(slot);
        assert!(slots.slot_for_min_size().is_none(), "one lent + one idle");

        slots.close_idle();
        slots.pause();
        assert!(slots.slot_for_min_size().is_none(), "not while paused");
    }

    #[tokio::test(start_paused = true)]
    async fn idle_connections_are_closed_by_choice_the_rest_kept_in_order() {
        let slots = slots(limits(5));
        let lent = checkout(&slots, 9).await;
        for id in 1..=4 {
            slots.add_idle(open(&slots, id));
        }
        assert_eq!(slots.close_idle_where(|c| c.id % 2 == 0), 2);
        assert_eq!(slots.describe_idle(|c, _| c.id), [1, 3]);
        assert_eq!(slots.close_idle_where(|_| false), 0);
        drop(lent);
        assert_eq!(slots.active(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn min_pool_size_is_bounded_by_pool_size_and_free_slots() {
        let slots = slots(PoolLimits {
            min_size: 5,
            ..limits(1)
        });
        let slot = slots.slot_for_min_size().expect("below min");
        assert!(slots.slot_for_min_size().is_none(), "no free slot left");
        slots.add_idle(open(&slots, 1));
        drop(slot);
        assert!(
            slots.slot_for_min_size().is_none(),
            "min capped at pool_size"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_connection_is_checked_after_server_check_delay() {
        let slots = slots(limits(1));
        let delay = slots.settings().server_check_delay;
        let conn = open(&slots, 1);
        assert!(!slots.needs_check(&conn, conn.last_used + delay - Duration::from_millis(1)));
        assert!(slots.needs_check(&conn, conn.last_used + delay));
    }

    #[test]
    fn housekeeping_runs_at_a_quarter_of_the_shortest_timeout_within_bounds() {
        let every = |idle: Option<u64>, lifetime: Option<u64>| {
            let slots = slots(PoolLimits {
                server_idle_timeout: idle.map(Duration::from_secs),
                server_lifetime: lifetime.map(Duration::from_secs),
                ..limits(1)
            });
            slots.maintenance_interval()
        };
        assert_eq!(every(None, None), Duration::from_secs(1));
        assert_eq!(every(Some(2), Some(600)), Duration::from_millis(500));
        assert_eq!(every(None, Some(3600)), Duration::from_secs(1));
        assert_eq!(every(Some(0), None), Duration::from_millis(50));
    }
}
