//! `auth.user` + `auth.query`: asking PostgreSQL for the secret of a user
//! usher does not list, over a tokio-postgres connection logged in as
//! `auth.user` (one per database, opened on first use, reopened when lost).
//! Answers, found or not, are cached for `auth.cache_ttl` seconds, so a
//! role dropped on the server stops working once its entry expires. The
//! same connection answers `+role` membership questions for HBA rules.

use super::Secret;
use crate::backend::server_stream;
use crate::config::Config;
use crate::protocol::error::sqlstate;
use crate::protocol::PgError;
use crate::tls::ServerTls;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_postgres::config::SslMode;
use tokio_postgres::NoTls;

/// Cached answers, at most this many of each kind: unknown names are
/// chosen by clients, so the cache must not grow without bound.
const MAX_CACHED: usize = 10_000;

/// Members of a role, directly or through other roles; the user counts as a
/// member of itself, and superusers are not members of everything (as in
/// pg_hba.conf).
const MEMBERSHIP_QUERY: &str = "WITH RECURSIVE m(oid) AS ( \
     SELECT oid FROM pg_catalog.pg_roles WHERE rolname = $1 \
     UNION SELECT a.roleid FROM pg_catalog.pg_auth_members a JOIN m ON a.member = m.oid) \
     SELECT EXISTS (SELECT 1 FROM m JOIN pg_catalog.pg_roles r ON r.oid = m.oid WHERE r.rolname = $2)";

/// What the auth query said about a user: `None` if there is no such user,
/// `Some(None)` if it exists without a password.
pub type Answer = Option<Option<Secret>>;

/// Where a database lives, for the auth query's connection.
#[derive(Debug)]
struct Target {
    /// The database's servers, tried in order: the query only reads, so
    /// any of them (a standby too) can answer it.
    hosts: Vec<(String, u16)>,
    dbname: String,
    tls: ServerTls,
}

pub struct AuthQuery {
    user: String,
    password: Option<String>,
    query: String,
    /// `auth.dbname`: run every lookup there instead of the client's database.
    dbname: Option<String>,
    /// Each connection attempt and each query (`server_connect_timeout`).
    timeout: Duration,
    /// While the server cannot be reached, attempts go on for this long
    /// (`query_wait_timeout`; none with `server_fast_fail`), at most
    /// `retry` apart (`server_login_retry`), as a pool's do.
    outage_wait: Duration,
    retry: Duration,
    targets: HashMap<String, Target>,
    clients: HashMap<String, tokio::sync::Mutex<Option<Arc<tokio_postgres::Client>>>>,
    secrets: Cache<(String, String), Answer>,
    memberships: Cache<(String, String, String), bool>,
}

impl std::fmt::Debug for AuthQuery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuthQuery")
            .field("user", &self.user)
            .field("query", &self.query)
            .finish_non_exhaustive()
    }
}

impl AuthQuery {
    /// `None` unless `auth.user` is set.
    pub fn from_config(config: &Config, tls: &HashMap<String, ServerTls>) -> Option<AuthQuery> {
        let user = config.auth.user.clone()?;
        let query = config.auth.effective_query()?.to_string();
        let password = config.users.get(&user).and_then(|u| u.password.clone());
        // Listed databases only: with the fallback entry the query runs in
        // `auth.dbname` (a listed database; config validation asks for it).
        let targets: HashMap<String, Target> = config
            .listed_databases()
            .map(|(name, db)| {
                let target = Target {
                    hosts: db.server_hosts(),
                    dbname: db.server_dbname(name).to_string(),
                    tls: tls.get(name).cloned().unwrap_or_else(ServerTls::disabled),
                };
                (name.clone(), target)
            })
            .collect();
        let clients = targets
            .keys()
            .map(|k| (k.clone(), tokio::sync::Mutex::new(None)))
            .collect();
        let ttl = Duration::from_secs_f64(config.auth.cache_ttl);
        Some(AuthQuery {
            user,
            password,
            query,
            dbname: config.auth.dbname.clone(),
            timeout: Duration::from_secs_f64(config.server_connect_timeout),
            outage_wait: if config.server_fast_fail {
                Duration::ZERO
            } else {
                Duration::from_secs_f64(config.query_wait_timeout)
            },
            retry: Duration::from_secs_f64(config.server_login_retry),
            targets,
            clients,
            secrets: Cache::new(ttl),
            memberships: Cache::new(ttl),
        })
    }

    /// Looks `user` up for a client of `database`. A database usher has no
    /// server for (the admin console) knows no users this way.
    pub async fn lookup(&self, database: &str, user: &str) -> Result<Answer, PgError> {
        let db = self.dbname.as_deref().unwrap_or(database);
        if !self.targets.contains_key(db) {
            return Ok(None);
        }
        let key = (db.to_string(), user.to_string());
        if let Some(answer) = self.secrets.get(&key) {
            return Ok(answer);
        }
        let row = self
            .run(db, |client| {
                let user = user.to_string();
                let query = self.query.clone();
                async move { client.query_opt(&query, &[&user]).await }
            })
            .await?;
        let answer = match row {
            None => None,
            Some(row) => Some(
                row.try_get::<_, Option<String>>(1)
                    .map_err(|e| {
                        PgError::fatal(
                            sqlstate::INTERNAL_ERROR,
                            "auth.query must return the user name and its secret (text)",
                        )
                        .with_detail(e.to_string())
                    })?
                    .filter(|s| !s.is_empty())
                    .map(|s| Secret::parse(&s)),
            ),
        };
        self.secrets.put(key, answer.clone());
        Ok(answer)
    }

    /// Whether `user` is a member of `role` (for `+role` in HBA rules).
    /// A failed query counts as "no", and is logged.
    pub async fn is_member(&self, database: &str, user: &str, role: &str) -> bool {
        let db = self.dbname.as_deref().unwrap_or(database);
        if !self.targets.contains_key(db) {
            return false;
        }
        let key = (db.to_string(), user.to_string(), role.to_string());
        if let Some(answer) = self.memberships.get(&key) {
            return answer;
        }
        let result = self
            .run(db, |client| {
                let (user, role) = (user.to_string(), role.to_string());
                async move {
                    client
                        .query_one(MEMBERSHIP_QUERY, &[&user, &role])
                        .await
                        .and_then(|r| r.try_get::<_, bool>(0))
                }
            })
            .await;
        match result {
            Ok(member) => {
                self.memberships.put(key, member);
                member
            }
            Err(e) => {
                tracing::warn!(user, role, error = %e, "could not check role membership for an HBA rule");
                false
            }
        }
    }

    /// Runs `op` on the connection for `db`, opening it first if needed
    /// (waiting through an outage, [`AuthQuery::connect_waiting`]), and
    /// once more on a new connection if the old one was lost.
    async fn run<T, F, Fut>(&self, db: &str, op: F) -> Result<T, PgError>
    where
        F: Fn(Arc<tokio_postgres::Client>) -> Fut,
        Fut: std::future::Future<Output = Result<T, tokio_postgres::Error>>,
    {
        let slot = &self.clients[db];
        let mut guard = slot.lock().await;
        for attempt in 0..2 {
            let client = match guard.as_ref() {
                Some(c) if !c.is_closed() => c.clone(),
                _ => {
                    let c = self.connect_waiting(&self.targets[db]).await?;
                    *guard = Some(c.clone());
                    c
                }
            };
            let result = tokio::time::timeout(self.timeout, op(client.clone()))
                .await
                .map_err(|_| lookup_failed("timed out".into()))?;
            match result {
                Ok(v) => return Ok(v),
                Err(_) if attempt == 0 && client.is_closed() => *guard = None,
                Err(e) => return Err(lookup_failed(e.to_string())),
            }
        }
        Err(lookup_failed("the connection was lost twice".into()))
    }

    /// Opens the connection for `target`. While the server cannot be
    /// reached (refused, reset, timed out, starting up or shutting down,
    /// too many connections) it tries again, first after 50 ms, then
    /// after pauses that grow with the outage (a quarter of its length,
    /// at most `server_login_retry`), for up to `query_wait_timeout`: a
    /// login that needs the auth query waits out a restart as a client of
    /// a pool does (the login itself ends at `auth_timeout`). A refusal
    /// (auth.user's password) fails at once.
    async fn connect_waiting(
        &self,
        target: &Target,
    ) -> Result<Arc<tokio_postgres::Client>, PgError> {
        let started = Instant::now();
        loop {
            let attempt = tokio::time::timeout(self.timeout, self.connect(target))
                .await
                .unwrap_or_else(|_| Err((lookup_failed("timed out".into()), true)));
            let (error, unreachable) = match attempt {
                Ok(client) => return Ok(client),
                Err(failed) => failed,
            };
            let pause = (started.elapsed() / 4).clamp(
                Duration::from_millis(50),
                self.retry.max(Duration::from_millis(50)),
            );
            if !unreachable || started.elapsed() + pause > self.outage_wait {
                return Err(error);
            }
            tracing::debug!(error = %error, "auth_query: the server cannot be reached; trying again");
            tokio::time::sleep(pause).await;
        }
    }

    /// One attempt at the connection; the error says whether the server
    /// could not be reached (worth another attempt) rather than refused.
    async fn connect(
        &self,
        target: &Target,
    ) -> Result<Arc<tokio_postgres::Client>, (PgError, bool)> {
        // The server could not be reached: the client is told why, as a
        // server login would tell it (never a server's refusal here).
        let mut opened = None;
        for (host, port) in &target.hosts {
            match server_stream::open(host, *port, &target.tls).await {
                Ok(stream) => {
                    opened = Some(Ok(stream));
                    break;
                }
                Err(e) => opened = Some(Err(PgError::fatal(e.sqlstate(), e.to_string()))),
            }
        }
        let stream = opened
            .unwrap_or_else(|| Err(lookup_failed("no server".into())))
            .map_err(|e| (e, true))?;
        let mut config = tokio_postgres::Config::new();
        config
            .user(&self.user)
            .dbname(&target.dbname)
            .application_name("usher auth_query")
            .ssl_mode(SslMode::Disable); // TLS, if any, is already on the stream
        if let Some(p) = &self.password {
            config.password(p);
        }
        let (client, connection) = config.connect_raw(stream, NoTls).await.map_err(|e| {
            // Starting up or shutting down (57P03), too many connections
            // (53300), or the connection lost: the server is not there yet.
            let unreachable = match e.code() {
                Some(c) => matches!(c.code(), "57P03" | "53300" | "57P01"),
                None => {
                    e.is_closed()
                        || std::error::Error::source(&e)
                            .is_some_and(|s| s.downcast_ref::<std::io::Error>().is_some())
                }
            };
            (
                lookup_failed(format!("could not log in as auth.user: {e}")),
                unreachable,
            )
        })?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "auth_query connection ended");
            }
        });
        Ok(Arc::new(client))
    }
}

fn lookup_failed(detail: String) -> PgError {
    PgError::fatal(sqlstate::CONNECTION_FAILURE, "auth_query failed").with_detail(detail)
}

/// Answers kept for a while, at most [`MAX_CACHED`] of them.
struct Cache<K, V> {
    ttl: Duration,
    map: Mutex<HashMap<K, (Instant, V)>>,
}

impl<K: Hash + Eq, V: Clone> Cache<K, V> {
    fn new(ttl: Duration) -> Self {
        Cache {
            ttl,
            map: Mutex::new(HashMap::new()),
        }
    }

    fn get(&self, key: &K) -> Option<V> {
        let map = self.map.lock();
        map.get(key)
            .filter(|(at, _)| at.elapsed() < self.ttl)
            .map(|(_, v)| v.clone())
    }

    fn put(&self, key: K, value: V) {
        if self.ttl.is_zero() {
            return;
        }
        let mut map = self.map.lock();
        if map.len() >= MAX_CACHED {
            map.retain(|_, (at, _)| at.elapsed() < self.ttl);
            if map.len() >= MAX_CACHED {
                map.clear(); // a flood of names: start over rather than grow
            }
        }
        map.insert(key, (Instant::now(), value));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_expires_and_stays_bounded() {
        let c: Cache<u32, bool> = Cache::new(Duration::from_millis(30));
        c.put(1, true);
        assert_eq!(c.get(&1), Some(true));
        std::thread::sleep(Duration::from_millis(40));
        assert_eq!(c.get(&1), None);
        for i in 0..(MAX_CACHED as u32 + 5) {
            c.put(i, false);
        }
        assert!(c.map.lock().len() <= MAX_CACHED);
        let none: Cache<u32, bool> = Cache::new(Duration::ZERO);
        none.put(1, true);
        assert_eq!(none.get(&1), None);
    }
}
