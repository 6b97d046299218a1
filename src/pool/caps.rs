//! Caps over many pools, with PgBouncer's meanings: `max_db_connections`
//! and `max_user_connections` bound the server connections of every pool
//! of a database / of a user (idle, lent or opening), and
//! `max_db_client_connections` / `max_user_client_connections` the
//! clients logged in to them.
//!
//! Each database name and each user name has a [`Tally`], shared by the
//! pools of that name. A server connection takes a [`ServerPlace`] before
//! it is opened and keeps it until it is dropped, however it is closed; a
//! client takes a [`ClientPlace`] at login. When a database or user is at
//! its cap and a pool needs a connection, an idle connection of another
//! pool under the same cap is closed to make room (PgBouncer evicts the
//! same way); otherwise the client waits, up to `query_wait_timeout`, for
//! a place to come free. Nothing here is touched on the transaction path:
//! only when a connection is opened or closed, and at login.

use super::Pool;
use dashmap::DashMap;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use tokio::sync::Notify;

/// What one database name or user name holds over all its pools.
#[derive(Debug, Default)]
pub struct Tally {
    servers: AtomicUsize,
    clients: AtomicUsize,
    /// Told when a server place is given back, or an idle connection
    /// that could be closed for one appears.
    freed: Notify,
    /// Clients waiting for a server place here.
    waiting: AtomicUsize,
    /// The pools under this name, for eviction.
    pools: Mutex<Vec<Weak<Pool>>>,
}

impl Tally {
    /// Server connections open (or opening) now.
    pub fn servers(&self) -> usize {
        self.servers.load(Ordering::Relaxed)
    }

    /// Clients logged in now.
    pub fn clients(&self) -> usize {
        self.clients.load(Ordering::Relaxed)
    }

    /// A wait for a place here, counted while it lasts.
    fn wait(&self) -> impl Drop + '_ {
        struct Waiting<'a>(&'a AtomicUsize);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::AcqRel);
            }
        }
        self.waiting.fetch_add(1, Ordering::AcqRel);
        Waiting(&self.waiting)
    }

    /// One more, unless that would pass `limit` (0: no limit).
    fn take(count: &AtomicUsize, limit: usize) -> bool {
        count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (limit == 0 || n < limit).then_some(n + 1)
            })
            .is_ok()
    }

    /// Closes one idle server connection of a pool other than `except`
    /// under this name; whether one was closed.
    fn evict_idle(&self, except: &Pool) -> bool {
        let pools: Vec<Arc<Pool>> = {
            let mut list = self.pools.lock();
            list.retain(|p| p.strong_count() > 0);
            list.iter().filter_map(Weak::upgrade).collect()
        };
        pools
            .iter()
            .filter(|p| !std::ptr::eq(Arc::as_ptr(p), except))
            .any(|p| p.close_oldest_idle())
    }
}

/// The tallies of every database name and user name that has a pool.
/// The pools own them; a tally goes when the last pool of its name does
/// (an auto database's pool is dropped when unused).
#[derive(Debug, Default)]
pub struct Caps {
    databases: DashMap<String, Weak<Tally>>,
    users: DashMap<String, Weak<Tally>>,
}

impl Caps {
    /// The tallies a new pool of (database, user) counts in (pools are
    /// made once per name pair: the names no pool holds are swept here).
    /// Shared: a client's place is one pointer (every idle client holds one).
    pub fn for_pool(&self, database: &str, user: &str) -> Arc<PoolCaps> {
        let get = |map: &DashMap<String, Weak<Tally>>, name: &str| {
            map.retain(|_, t| t.strong_count() > 0);
            let mut entry = map.entry(name.to_string()).or_default();
            entry.upgrade().unwrap_or_else(|| {
                let tally = Arc::new(Tally::default());
                *entry = Arc::downgrade(&tally);
                tally
            })
        };
        Arc::new(PoolCaps {
            database: get(&self.databases, database),
            user: get(&self.users, user),
        })
    }

    /// Registers a pool made with [`Caps::for_pool`] for eviction.
    pub fn register(&self, pool: &Arc<Pool>) {
        for tally in [&pool.caps.database, &pool.caps.user] {
            tally.pools.lock().push(Arc::downgrade(pool));
        }
    }

    /// The tally of a database name, if it has pools.
    pub fn database(&self, name: &str) -> Option<Arc<Tally>> {
        self.databases.get(name).and_then(|t| t.upgrade())
    }

    /// The tally of a user name, if it has pools.
    pub fn user(&self, name: &str) -> Option<Arc<Tally>> {
        self.users.get(name).and_then(|t| t.upgrade())
    }
}

/// A pool's two tallies.
#[derive(Debug, Clone)]
pub struct PoolCaps {
    pub database: Arc<Tally>,
    pub user: Arc<Tally>,
}

/// Which cap refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capped {
    Database,
    User,
}

/// A server connection's place under its database's and user's caps,
/// given back when dropped.
#[derive(Debug)]
pub struct ServerPlace(Arc<PoolCaps>);

impl Drop for ServerPlace {
    fn drop(&mut self) {
        for tally in [&self.0.database, &self.0.user] {
            tally.servers.fetch_sub(1, Ordering::AcqRel);
            tally.freed.notify_waiters();
        }
    }
}

/// A client's place under its database's and user's client caps, given
/// back when dropped.
#[derive(Debug)]
pub struct ClientPlace(Arc<PoolCaps>);

impl Drop for ClientPlace {
    fn drop(&mut self) {
        self.0.database.clients.fetch_sub(1, Ordering::AcqRel);
        self.0.user.clients.fetch_sub(1, Ordering::AcqRel);
    }
}

impl PoolCaps {
    /// A place for a new server connection now, if both caps allow one
    /// (0: no cap).
    pub fn try_server(
        self: &Arc<Self>,
        db_limit: usize,
        user_limit: usize,
    ) -> Result<ServerPlace, Capped> {
        if !Tally::take(&self.database.servers, db_limit) {
            return Err(Capped::Database);
        }
        if !Tally::take(&self.user.servers, user_limit) {
            self.database.servers.fetch_sub(1, Ordering::AcqRel);
            self.database.freed.notify_waiters();
            return Err(Capped::User);
        }
        Ok(ServerPlace(self.clone()))
    }

    /// A place for a new server connection of `pool`: at once if the caps
    /// allow, else after closing an idle connection of another pool under
    /// the full cap, else when one is given back. Not bounded here: the
    /// caller bounds the wait.
    pub async fn server(
        self: &Arc<Self>,
        pool: &Pool,
        db_limit: usize,
        user_limit: usize,
    ) -> ServerPlace {
        let _waiting = (self.database.wait(), self.user.wait());
        loop {
            let database_freed = self.database.freed.notified();
            let user_freed = self.user.freed.notified();
            tokio::pin!(database_freed, user_freed);
            database_freed.as_mut().enable();
            user_freed.as_mut().enable();
            let full = match self.try_server(db_limit, user_limit) {
                Ok(place) => return place,
                Err(Capped::Database) => &self.database,
                Err(Capped::User) => &self.user,
            };
            if full.evict_idle(pool) {
                // Its place was given back as it closed: try again.
                continue;
            }
            // Only the full cap's news is awaited: when the user's cap
            // refuses, try_server gives the database's count back and
            // tells its waiters, this client among them, which would
            // wake it at once, for ever (a busy loop that starved every
            // other client of its worker).
            if Arc::ptr_eq(full, &self.database) {
                database_freed.await;
            } else {
                user_freed.await;
            }
        }
    }

    /// Whether a new server connection would pass a cap now (a hint).
    pub fn full(&self, db_limit: usize, user_limit: usize) -> bool {
        let over = |count: &AtomicUsize, limit| limit > 0 && count.load(Ordering::Acquire) >= limit;
        over(&self.database.servers, db_limit) || over(&self.user.servers, user_limit)
    }

    /// A connection of this pool went idle: a client waiting under one of
    /// its caps may close it to make room. Two loads when nobody waits
    /// (every checkin).
    pub fn idle_added(&self) {
        for tally in [&self.database, &self.user] {
            if tally.waiting.load(Ordering::Acquire) > 0 {
                tally.freed.notify_waiters();
            }
        }
    }

    /// A place for a client, if both client caps allow one (0: no cap).
    pub fn client(
        self: &Arc<Self>,
        db_limit: usize,
        user_limit: usize,
    ) -> Result<ClientPlace, Capped> {
        if !Tally::take(&self.database.clients, db_limit) {
            return Err(Capped::Database);
        }
        if !Tally::take(&self.user.clients, user_limit) {
            self.database.clients.fetch_sub(1, Ordering::AcqRel);
            return Err(Capped::User);
        }
        Ok(ClientPlace(self.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps() -> (Caps, Arc<PoolCaps>, Arc<PoolCaps>) {
        let caps = Caps::default();
        let a = caps.for_pool("db", "alice");
        let b = caps.for_pool("db", "bob");
        (caps, a, b)
    }

    #[test]
    fn server_places_count_over_every_pool_of_a_database() {
        let (caps, a, b) = caps();
        let one = a.try_server(2, 0).unwrap();
        let two = b.try_server(2, 0).unwrap();
        assert_eq!(b.try_server(2, 0).unwrap_err(), Capped::Database);
        assert_eq!(caps.database("db").unwrap().servers(), 2);
        drop(one);
        let three = b.try_server(2, 0).unwrap();
        assert_eq!(caps.user("bob").unwrap().servers(), 2);
        drop((two, three));
        assert_eq!(caps.database("db").unwrap().servers(), 0);
    }

    #[test]
    fn a_user_cap_refusal_gives_the_database_place_back() {
        let (caps, a, _) = caps();
        let _one = a.try_server(0, 1).unwrap();
        assert_eq!(a.try_server(0, 1).unwrap_err(), Capped::User);
        assert_eq!(caps.database("db").unwrap().servers(), 1);
    }

    #[test]
    fn client_places_are_capped_and_given_back() {
        let (caps, a, b) = caps();
        let one = a.client(2, 1).unwrap();
        assert_eq!(a.client(2, 1).unwrap_err(), Capped::User);
        let _two = b.client(2, 1).unwrap();
        assert_eq!(b.client(2, 0).unwrap_err(), Capped::Database);
        drop(one);
        assert_eq!(caps.database("db").unwrap().clients(), 1);
        assert!(a.client(2, 1).is_ok());
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_wait_for_a_server_place_ends_when_one_is_given_back() {
        let (_caps, a, b) = caps();
        let held = a.try_server(1, 0).unwrap();
        let pool = Pool::for_tests("db", "bob");
        let waiter = async { b.server(&pool, 1, 0).await };
        tokio::pin!(waiter);
        assert!(
            futures_poll(&mut waiter).await.is_none(),
            "waits while full"
        );
        drop(held);
        assert!(futures_poll(&mut waiter).await.is_some(), "then has one");
    }

    /// Polls once.
    async fn futures_poll<F: std::future::Future + Unpin>(f: &mut F) -> Option<F::Output> {
        std::future::poll_fn(|cx| {
            std::task::Poll::Ready(match std::pin::Pin::new(&mut *f).poll(cx) {
                std::task::Poll::Ready(v) => Some(v),
                std::task::Poll::Pending => None,
            })
        })
        .await
    }

    #[test]
    fn tallies_no_pool_holds_are_forgotten() {
        let (caps, a, b) = caps();
        drop(a);
        assert!(caps.user("alice").is_none());
        assert!(caps.user("bob").is_some());
        drop(b);
        assert!(caps.database("db").is_none());
        let _c = caps.for_pool("other", "carol");
        assert_eq!(caps.databases.len(), 1, "dead names swept");
    }
}
