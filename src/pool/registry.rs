//! The set of pools, created on first use from the configuration.

use super::{Pool, PoolSettings};
use crate::backend::{ServerCredential, ServerTarget, SharedCredential};
use crate::config::Config;
use dashmap::DashMap;
use std::sync::Arc;
use std::time::Duration;

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
        let settings = PoolSettings {
            mode: config.pool_mode_for(database, user),
            size: config.pool_size_for(database, user),
            query_wait_timeout: Duration::from_secs_f64(config.query_wait_timeout),
            server_connect_timeout: Duration::from_secs_f64(config.server_connect_timeout),
            server_reset_query: config.server_reset_query.clone(),
        };
        let pool = self
            .map
            .entry(key)
            .or_insert_with(|| {
                Arc::new(Pool::new(
                    database.to_string(),
                    user.to_string(),
                    target,
                    settings,
                ))
            })
            .clone();
        Some(pool)
    }

    /// Every pool, in no particular order.
    pub fn all(&self) -> Vec<Arc<Pool>> {
        self.map.iter().map(|e| e.value().clone()).collect()
    }
}
