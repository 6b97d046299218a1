//! The set of pools, created on first use from the configuration, and the
//! operations on many pools at once (reload, PAUSE/RESUME, RECONNECT).
//!
//! A pool of a database reached through the fallback entry (`"*"`, an
//! "auto database") is removed again once nobody uses it: by its
//! maintenance task after `autodb_idle_timeout` without clients, lent
//! connections or waiters, or at once when the login that created it
//! failed (a database the server does not have leaves no pool). Whether a
//! pool is used is whether anyone but the registry holds it: every client
//! session (and a connection's recovery after its client left) holds its
//! pool's `Arc`, and the removal checks that count under the map's lock,
//! so a login either gets the pool before it goes or creates a new one.

use super::Pool;
use crate::backend::{HostHealth, ServerCredential, ServerHosts, ServerTarget, SharedCredential};
use crate::config::{Config, ResolvedRoute, FALLBACK_DATABASE};
use crate::tls::ServerTls;
use dashmap::DashMap;
use parking_lot::Mutex;
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// (database, user, route): a routed pool's database is its base entry's
/// key, and its route the normalised target (`ResolvedRoute::key`).
/// Looked up by [`KeyRef`], so that a login's lookup copies no name.
#[derive(Debug, Clone)]
struct PoolKey(String, String, Option<Arc<str>>);

/// A pool's key, borrowed.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct KeyRef<'a>(&'a str, &'a str, Option<&'a str>);

/// What [`PoolKey`] and [`KeyRef`] hash and compare alike by.
trait KeyParts {
    fn parts(&self) -> KeyRef<'_>;
}

impl KeyParts for PoolKey {
    fn parts(&self) -> KeyRef<'_> {
        KeyRef(&self.0, &self.1, self.2.as_deref())
    }
}

impl KeyParts for KeyRef<'_> {
    fn parts(&self) -> KeyRef<'_> {
        *self
    }
}

impl<'a> std::borrow::Borrow<dyn KeyParts + 'a> for PoolKey {
    fn borrow(&self) -> &(dyn KeyParts + 'a) {
        self
    }
}

impl std::hash::Hash for dyn KeyParts + '_ {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.parts().hash(state)
    }
}

impl PartialEq for dyn KeyParts + '_ {
    fn eq(&self, other: &Self) -> bool {
        self.parts() == other.parts()
    }
}

impl Eq for dyn KeyParts + '_ {}

impl std::hash::Hash for PoolKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.parts().hash(state)
    }
}

impl PartialEq for PoolKey {
    fn eq(&self, other: &Self) -> bool {
        self.parts() == other.parts()
    }
}

impl Eq for PoolKey {}

impl<'a> KeyRef<'a> {
    fn of(pool: &'a Pool) -> KeyRef<'a> {
        KeyRef(
            &pool.database,
            &pool.user,
            pool.route.as_deref().map(|r| &*r.key),
        )
    }
}

/// The pools by key, and how many of them are routed (`routing.max_pools`
/// counts them: a place is taken before a routed pool is inserted and
/// given back when one is removed, so logins creating different routes
/// at once cannot pass it).
#[derive(Debug, Default)]
struct PoolMap {
    pools: DashMap<PoolKey, Arc<Pool>>,
    routed: AtomicUsize,
}

impl PoolMap {
    /// Removes the entry of `key` if `remove` says so (under the
    /// entry's lock), giving back a routed pool's place.
    fn remove_if(
        &self,
        key: KeyRef<'_>,
        remove: impl FnOnce(&Arc<Pool>) -> bool,
    ) -> Option<Arc<Pool>> {
        let (_, pool) = self
            .pools
            .remove_if(&key as &dyn KeyParts, |_, p| remove(p))?;
        if pool.route.is_some() {
            self.routed.fetch_sub(1, Ordering::AcqRel);
        }
        Some(pool)
    }
}

/// A routed pool was refused: `routing.max_pools` are in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooManyRoutes(pub usize);

/// All pools, keyed by (database, user, route). Looked up once per client login.
#[derive(Debug, Default)]
pub struct Pools {
    /// In an `Arc` so that the maintenance tasks can remove their pool.
    map: Arc<PoolMap>,
    /// What is paused, so pools created later start paused too.
    paused: Mutex<Paused>,
    /// Which servers failed lately, or were read-only: shared by every
    /// pool's host choice (backend/hosts.rs).
    health: Arc<HostHealth>,
    /// The tallies of the caps over many pools (caps.rs).
    pub caps: super::caps::Caps,
}

/// PAUSE without a database pauses all; PAUSE db adds one.
#[derive(Debug, Default)]
struct Paused {
    all: bool,
    databases: BTreeSet<String>,
}

impl Paused {
    fn covers(&self, database: &str) -> bool {
        self.all || self.databases.contains(database)
    }
}

impl Pools {
    pub fn new() -> Self {
        Pools::default()
    }

    /// The pool for (database, user); created if it does not exist yet.
    /// `None` if the database is neither listed nor reached through the
    /// fallback entry. `credential` is what the
    /// client's login gave usher to log in to the server with; it replaces an
    /// existing pool's when it differs (e.g. new SCRAM keys after a password
    /// change on the server). Counts a login of the pool.
    pub fn get_or_create(
        &self,
        config: &Config,
        database: &str,
        user: &str,
        tls: &ServerTls,
        credential: ServerCredential,
    ) -> Option<Arc<Pool>> {
        if let Some(p) = self
            .map
            .pools
            .get(&KeyRef(database, user, None) as &dyn KeyParts)
        {
            p.stats.logins.fetch_add(1, Ordering::Relaxed);
            p.offer_credential(credential);
            return Some(p.clone());
        }
        let target = target_for(config, database, user, tls, credential, &self.health)?;
        let settings = config.limits_for(database, user);
        let pool = self
            .map
            .pools
            .entry(PoolKey(database.to_string(), user.to_string(), None))
            .or_insert_with(|| {
                let pool = Arc::new(Pool::new(
                    database.to_string(),
                    user.to_string(),
                    target,
                    settings,
                    self.caps.for_pool(database, user),
                ));
                self.caps.register(&pool);
                if self.paused.lock().covers(database) {
                    pool.pause();
                }
                if pool.settings().auto {
                    tracing::info!(db = %database, user, "auto database: pool created");
                }
                spawn_maintenance(Arc::downgrade(&pool), Arc::downgrade(&self.map));
                pool
            })
            .clone();
        pool.stats.logins.fetch_add(1, Ordering::Relaxed);
        Some(pool)
    }

    /// The pool of `user`'s clients that a hook routed to `route`,
    /// created on first use (as an auto database's is) and removed once
    /// unused for `autodb_idle_timeout`. `credential` is the server role's
    /// (see [`Pools::get_or_create`]). Refused when `max_pools` routed
    /// pools exist.
    pub fn get_or_create_routed(
        &self,
        config: &Config,
        route: &ResolvedRoute,
        user: &str,
        tls: &ServerTls,
        credential: ServerCredential,
        max_pools: usize,
    ) -> Result<Arc<Pool>, TooManyRoutes> {
        let key = KeyRef(&route.base, user, Some(&route.key));
        if let Some(p) = self.map.pools.get(&key as &dyn KeyParts) {
            p.stats.logins.fetch_add(1, Ordering::Relaxed);
            p.offer_credential(credential);
            return Ok(p.clone());
        }
        // A place under max_pools, taken before the entry (iterating
        // under an entry's lock would deadlock on its shard), and given
        // back if another login inserted the pool meanwhile.
        let placed = self
            .map
            .routed
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max_pools).then_some(n + 1)
            });
        if placed.is_err() {
            return Err(TooManyRoutes(max_pools));
        }
        let target = routed_target(config, route, tls, credential, &self.health);
        let settings = route.limits(config, user);
        let mut created = false;
        let pool = self
            .map
            .pools
            .entry(PoolKey(
                route.base.clone(),
                user.to_string(),
                Some(route.key.clone()),
            ))
            .or_insert_with(|| {
                created = true;
                let mut pool = Pool::new(
                    route.base.clone(),
                    user.to_string(),
                    target,
                    settings,
                    self.caps.for_pool(&route.base, user),
                );
                pool.route = Some(Arc::new(route.clone()));
                let pool = Arc::new(pool);
                self.caps.register(&pool);
                if self.paused.lock().covers(&route.base) {
                    pool.pause();
                }
                tracing::info!(db = %route.base, user, route = %route.key, "routed pool created");
                spawn_maintenance(Arc::downgrade(&pool), Arc::downgrade(&self.map));
                pool
            })
            .clone();
        if !created {
            self.map.routed.fetch_sub(1, Ordering::AcqRel);
        }
        pool.stats.logins.fetch_add(1, Ordering::Relaxed);
        Ok(pool)
    }

    /// A login that failed after [`Pools::get_or_create`] gives its pool
    /// back: an auto database's pool that nobody else uses is removed at
    /// once (its idle connections closed), so a database the server does
    /// not have leaves no pool behind. Listed databases' pools stay.
    pub fn give_back(&self, pool: Arc<Pool>) {
        if removable(&pool) && remove_unused(&self.map, &pool, 2) {
            tracing::debug!(db = %pool.database, user = %pool.user, "auto database: pool removed after a failed login");
        }
    }

    /// Every pool, in no particular order.
    pub fn all(&self) -> Vec<Arc<Pool>> {
        self.map.pools.iter().map(|e| e.value().clone()).collect()
    }

    /// The pools of one database, or all of them (`None`).
    pub fn of(&self, database: Option<&str>) -> Vec<Arc<Pool>> {
        self.map
            .pools
            .iter()
            .filter(|e| database.is_none_or(|d| e.key().0 == d))
            .map(|e| e.value().clone())
            .collect()
    }

    /// Hands every pool its settings from a reloaded configuration. Pools
    /// whose servers (host, port, hosts, target, load_balance), dbname or
    /// TLS changed reconnect.
    /// An auto database's pool takes the fallback entry's settings (or,
    /// when the reload lists the database, its own entry's, and it stays);
    /// a listed database that is now reached through the fallback entry
    /// becomes an auto database. Pools of a database that is gone stay for
    /// the clients they serve (an auto database's until it is unused);
    /// new clients cannot reach them.
    /// Routed pools: [`Pools::apply_config_routed`].
    pub fn apply_config(&self, old: &Config, new: &Config, tls: &HashMap<String, ServerTls>) {
        for pool in self.all() {
            let (db, user) = (pool.database.as_str(), pool.user.as_str());
            if let Some(route) = &pool.route {
                self.apply_config_routed(&pool, route, old, new, tls);
                continue;
            }
            let tls = tls.get(db).or_else(|| tls.get(FALLBACK_DATABASE));
            let (Some(before), Some(after), Some(tls)) =
                (old.database_for(db), new.database_for(db), tls)
            else {
                continue;
            };
            let moved = !before.same_servers(after)
                || before.server_dbname(db) != after.server_dbname(db)
                || before.tls != after.tls
                || before.tls_ca != after.tls_ca;
            let target = moved
                .then(|| target_for(new, db, user, tls, ServerCredential::None, &self.health))
                .flatten();
            pool.apply(new.limits_for(db, user), target);
        }
    }

    /// A routed pool after a reload: its route is resolved again against
    /// the new configuration ([`ResolvedRoute::again`]). Still the same
    /// target: its limits follow; its base entry's TLS, `target` or
    /// `load_balance` changed: it reconnects with them. What it took from
    /// its base entry (hosts, dbname) moved: it reconnects there (its
    /// clients move with their base entry, as a listed database's do) and
    /// leaves the registry, its key being stale: new logins of the route
    /// make a pool under the new key. A route the configuration no longer
    /// allows (or whose base entry is gone) leaves the registry too, its
    /// idle connections closed: new logins cannot make it again, and its
    /// clients finish on it.
    fn apply_config_routed(
        &self,
        pool: &Arc<Pool>,
        route: &ResolvedRoute,
        old: &Config,
        new: &Config,
        tls: &HashMap<String, ServerTls>,
    ) {
        let user = pool.user.as_str();
        let retire = || {
            self.map
                .remove_if(KeyRef::of(pool), |p| Arc::ptr_eq(p, pool))
                .is_some()
        };
        let again = match route.again(new) {
            Ok(again) => again,
            Err(why) => {
                if retire() {
                    pool.close_idle();
                }
                tracing::warn!(db = %route.base, user, route = %route.key, reason = %why, "reload: route no longer allowed; its pool serves its clients and takes no new ones");
                return;
            }
        };
        let limits = again.limits(new, user);
        let base_changed = match (
            old.listed_database(&route.base),
            new.listed_database(&route.base),
        ) {
            (Some(b), Some(a)) => {
                b.tls != a.tls
                    || b.tls_ca != a.tls_ca
                    || b.target != a.target
                    || b.load_balance != a.load_balance
            }
            _ => true,
        };
        let moved = again.key != route.key;
        if !moved && !base_changed {
            pool.apply(limits, None);
            return;
        }
        let Some(tls) = tls.get(&route.base) else {
            pool.apply(limits, None);
            return;
        };
        let target = routed_target(new, &again, tls, ServerCredential::None, &self.health);
        pool.apply(limits, Some(target));
        if moved {
            retire();
            tracing::info!(db = %route.base, user, from = %route.key, to = %again.key, "reload: routed pool follows its base entry");
        }
    }

    /// Closes the idle server connections to database `dbname` (the
    /// server's name for it) on the server at `host`:`port`, in every
    /// pool whose connections go there, before a statement that fails
    /// while other sessions are connected to it (DROP DATABASE and the
    /// like, `sql_scan::Effects::databases`). Lent connections are left
    /// alone. How many were closed.
    pub fn close_idle_to_database(&self, dbname: &str, host: &str, port: u16) -> usize {
        self.all()
            .iter()
            .filter(|p| p.has_server_dbname(dbname))
            .map(|p| p.close_idle_on(host, port))
            .sum()
    }

    /// PAUSE [db]: marks them paused (pools created later too).
    pub fn pause(&self, database: Option<&str>) -> Vec<Arc<Pool>> {
        {
            let mut paused = self.paused.lock();
            match database {
                None => paused.all = true,
                Some(d) => {
                    paused.databases.insert(d.to_string());
                }
            }
        }
        let pools = self.of(database);
        for p in &pools {
            p.pause();
        }
        pools
    }

    /// RESUME [db]. RESUME without a database resumes everything.
    pub fn resume(&self, database: Option<&str>) {
        let mut paused = self.paused.lock();
        match database {
            None => *paused = Paused::default(),
            Some(d) => {
                paused.databases.remove(d);
            }
        }
        for p in self.all() {
            if !paused.covers(&p.database) {
                p.resume();
            }
        }
    }

    /// True after PAUSE without a database (SHOW STATE).
    pub fn is_paused_all(&self) -> bool {
        self.paused.lock().all
    }

    /// True if the database (or everything) is paused.
    pub fn is_paused(&self, database: &str) -> bool {
        self.paused.lock().covers(database)
    }
}

/// Where the pool for (database, user) connects, if the database is configured.
fn target_for(
    config: &Config,
    database: &str,
    user: &str,
    tls: &ServerTls,
    credential: ServerCredential,
    health: &Arc<HostHealth>,
) -> Option<ServerTarget> {
    let db = config.database_for(database)?;
    Some(ServerTarget {
        hosts: Arc::new(ServerHosts::new(
            db.server_hosts(),
            db.target,
            db.load_balance,
            health.clone(),
        )),
        dbname: db.server_dbname(database).to_string(),
        user: user.to_string(),
        tls: tls.clone(),
        credential: SharedCredential::new(credential),
    })
}

/// Where a routed pool connects: its route's servers, database and role,
/// over its base entry's TLS and host choice.
fn routed_target(
    config: &Config,
    route: &ResolvedRoute,
    tls: &ServerTls,
    credential: ServerCredential,
    health: &Arc<HostHealth>,
) -> ServerTarget {
    let base = config.listed_database(&route.base);
    ServerTarget {
        hosts: Arc::new(ServerHosts::new(
            route.hosts.clone(),
            base.map_or(crate::config::TargetSessionAttrs::Any, |d| d.target),
            base.is_some_and(|d| d.load_balance),
            health.clone(),
        )),
        dbname: route.dbname.clone(),
        user: route.user.clone(),
        tls: tls.clone(),
        credential: SharedCredential::new(credential),
    }
}

/// Whether a pool goes once unused: an auto database's, or a routed one.
fn removable(pool: &Pool) -> bool {
    pool.route.is_some() || pool.settings().auto
}

/// Runs [`Pool::maintain`] periodically for as long as the pool exists;
/// an auto database's pool unused for `autodb_idle_timeout` is removed
/// from `map`, and the task ends.
fn spawn_maintenance(pool: Weak<Pool>, map: Weak<PoolMap>) {
    tokio::spawn(async move {
        let mut unused = Unused::default();
        loop {
            let Some(p) = pool.upgrade() else { return };
            p.maintain().await;
            let timeout = {
                let s = p.settings();
                s.autodb_idle_timeout
                    .filter(|_| s.auto || p.route.is_some())
            };
            match timeout {
                Some(timeout) if unused.for_longer_than(&p, timeout) => {
                    if let Some(map) = map.upgrade() {
                        if remove_unused(&map, &p, 2) {
                            tracing::info!(db = %p.database, user = %p.user, route = %p.route_shown(), idle_s = timeout.as_secs_f64(), "unused pool removed (autodb_idle_timeout)");
                            return;
                        }
                    }
                }
                Some(_) => {}
                None => unused = Unused::default(),
            }
            let interval = p.maintenance_interval();
            drop(p);
            tokio::time::sleep(interval).await;
        }
    });
}

/// Since when an auto database's pool has been unused, as its maintenance
/// task sees it (PgBouncer's autodb `active_stamp`). Logins and checkouts
/// counted since the last round count as use, so a client that came and
/// went between two rounds is not missed.
#[derive(Debug, Default)]
struct Unused {
    since: Option<Instant>,
    /// (logins, checkouts) at the last round.
    seen: (u64, u64),
}

impl Unused {
    /// Whether `pool` (held by the registry and the caller) has been unused
    /// for `timeout`.
    fn for_longer_than(&mut self, pool: &Arc<Pool>, timeout: Duration) -> bool {
        let s = &pool.stats;
        let seen = (
            s.logins.load(Ordering::Relaxed),
            s.checkouts.load(Ordering::Relaxed),
        );
        let used = seen != self.seen || in_use(pool, 2);
        self.seen = seen;
        if used {
            self.since = None;
            return false;
        }
        self.since.get_or_insert_with(Instant::now).elapsed() >= timeout
    }
}

/// Whether anyone beyond `holders` holds `pool` (a client session, a
/// login, a connection's recovery), or it lends, opens or waits for a
/// server connection.
fn in_use(pool: &Arc<Pool>, holders: usize) -> bool {
    let s = &pool.stats;
    Arc::strong_count(pool) > holders
        || s.active.load(Ordering::Acquire) > 0
        || s.waiting.load(Ordering::Acquire) > 0
        || s.servers_login.load(Ordering::Acquire) > 0
}

/// Removes `pool` from `map` if it is still there and nobody but the map
/// and the caller (`holders` in all) holds it; checked under the map's
/// lock, so no login can take it meanwhile. Its idle connections close.
fn remove_unused(map: &PoolMap, pool: &Arc<Pool>, holders: usize) -> bool {
    let removed = map
        .remove_if(KeyRef::of(pool), |p| {
            Arc::ptr_eq(p, pool) && !in_use(p, holders)
        })
        .is_some();
    if removed {
        pool.close_idle();
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Route;

    fn route(config: &Config, dbname: String) -> ResolvedRoute {
        Route {
            dbname: Some(dbname),
            ..Route::default()
        }
        .resolve(config, "app", "alice")
        .unwrap()
    }

    /// Logins creating different routes at once: exactly `max_pools`
    /// routed pools, however their checks and inserts interleave.
    #[test]
    fn racing_logins_of_different_routes_stay_within_max_pools() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let config = Arc::new(
            Config::from_yaml(
                "databases:\n  app: { host: 127.0.0.1 }\nrouting:\n  allow: { databases: [app] }\n",
                "test.yaml",
            )
            .unwrap(),
        );
        let (threads, per_thread, max_pools) = (8, 40, 5);
        for round in 0..5 {
            let pools = Arc::new(Pools::new());
            let start = Arc::new(std::sync::Barrier::new(threads));
            let created: usize = (0..threads)
                .map(|t| {
                    let (pools, config, start) = (pools.clone(), config.clone(), start.clone());
                    let runtime = runtime.handle().clone();
                    std::thread::spawn(move || {
                        let _runtime = runtime.enter();
                        let routes: Vec<_> = (0..per_thread)
                            .map(|i| route(&config, format!("db_{round}_{t}_{i}")))
                            .collect();
                        start.wait();
                        routes
                            .iter()
                            .filter(|r| {
                                pools
                                    .get_or_create_routed(
                                        &config,
                                        r,
                                        "alice",
                                        &ServerTls::disabled(),
                                        ServerCredential::None,
                                        max_pools,
                                    )
                                    .is_ok()
                            })
                            .count()
                    })
                })
                .collect::<Vec<_>>()
                .into_iter()
                .map(|h| h.join().unwrap())
                .sum();
            assert_eq!(created, max_pools, "round {round}");
            assert_eq!(pools.all().len(), max_pools, "round {round}");
        }
    }
}
