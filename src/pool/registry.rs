//! The set of pools, created on first use from the configuration.

use super::Pool;
use crate::backend::{ServerCredential, ServerTarget, SharedCredential};
use crate::config::Config;
use dashmap::DashMap;
use std::sync::Arc;

/// All pools, keyed by (database, user). Looked up once per client login.
#[derive(Debug, Default)]
pub struct Pools {
    map: DashMap<(String, String), Arc<Pool>>,
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
        tls: &crate::tls::ServerTls,
        credential: ServerCredential,
    ) -> Option<Arc<Pool>> {
        let key = (database.to_string(), user.to_string());
        if let Some(p) = self.map.get(&key) {
            p.target.credential.offer(credential);
            return Some(p.clone());
        }
        let db = config.databases.get(database)?;
        let target = ServerTarget {
            host: db.host.clone(),
            port: db.port,
            dbname: db.server_dbname(database).to_string(),
            user: user.to_string(),
            tls: tls.clone(),
            credential: SharedCredential::new(credential),
        };
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
