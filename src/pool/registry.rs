//! The set of pools, created on first use from the configuration, and the
//! operations on many pools at once (reload, PAUSE/RESUME, RECONNECT).

use super::Pool;
use crate::backend::{ServerCredential, ServerTarget, SharedCredential};
use crate::config::Config;
use crate::tls::ServerTls;
use dashmap::DashMap;
use parking_lot::Mutex;
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

/// All pools, keyed by (database, user). Looked up once per client login.
#[derive(Debug, Default)]
pub struct Pools {
    map: DashMap<(String, String), Arc<Pool>>,
    /// What is paused, so pools created later start paused too.
    paused: Mutex<Paused>,
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
    /// `None` if the database is not configured. `credential` is what the
    /// client's login gave usher to log in to the server with; it replaces an
    /// existing pool's when it differs (e.g. new SCRAM keys after a password
    /// change on the server).
    pub fn get_or_create(
        &self,
        config: &Config,
        database: &str,
        user: &str,
        tls: &ServerTls,
        credential: ServerCredential,
    ) -> Option<Arc<Pool>> {
        let key = (database.to_string(), user.to_string());
        if let Some(p) = self.map.get(&key) {
            p.offer_credential(credential);
            return Some(p.clone());
        }
        let target = target_for(config, database, user, tls, credential)?;
        let settings = config.limits_for(database, user);
        let pool = self
            .map
            .entry(key)
            .or_insert_with(|| {
                let pool = Arc::new(Pool::new(
                    database.to_string(),
                    user.to_string(),
                    target,
                    settings,
                ));
                if self.paused.lock().covers(database) {
                    pool.pause();
                }
                spawn_maintenance(Arc::downgrade(&pool));
                pool
            })
            .clone();
        Some(pool)
    }

    /// Every pool, in no particular order.
    pub fn all(&self) -> Vec<Arc<Pool>> {
        self.map.iter().map(|e| e.value().clone()).collect()
    }

    /// The pools of one database, or all of them (`None`).
    pub fn of(&self, database: Option<&str>) -> Vec<Arc<Pool>> {
        self.map
            .iter()
            .filter(|e| database.is_none_or(|d| e.key().0 == d))
            .map(|e| e.value().clone())
            .collect()
    }

    /// Hands every pool its settings from a reloaded configuration. Pools
    /// whose server address (host, port, dbname or TLS) changed reconnect.
    /// Pools of a database that is gone stay for the clients they serve;
    /// new clients cannot reach them.
    pub fn apply_config(&self, old: &Config, new: &Config, tls: &HashMap<String, ServerTls>) {
        for pool in self.all() {
            let (db, user) = (pool.database.as_str(), pool.user.as_str());
            let (Some(before), Some(after), Some(tls)) =
                (old.databases.get(db), new.databases.get(db), tls.get(db))
            else {
                continue;
            };
            let moved = before.host != after.host
                || before.port != after.port
                || before.server_dbname(db) != after.server_dbname(db)
                || before.tls != after.tls
                || before.tls_ca != after.tls_ca;
            let target = moved
                .then(|| target_for(new, db, user, tls, ServerCredential::None))
                .flatten();
            pool.apply(new.limits_for(db, user), target);
        }
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
) -> Option<ServerTarget> {
    let db = config.databases.get(database)?;
    Some(ServerTarget {
        host: db.host.clone(),
        port: db.port,
        dbname: db.server_dbname(database).to_string(),
        user: user.to_string(),
        tls: tls.clone(),
        credential: SharedCredential::new(credential),
    })
}

/// Runs [`Pool::maintain`] periodically for as long as the pool exists.
fn spawn_maintenance(pool: std::sync::Weak<Pool>) {
    tokio::spawn(async move {
        loop {
            let Some(p) = pool.upgrade() else { return };
            p.maintain().await;
            let interval = p.maintenance_interval();
            drop(p);
            tokio::time::sleep(interval).await;
        }
    });
}
