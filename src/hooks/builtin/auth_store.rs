//! `auth_monitor.store`: the auth monitor's counts shared between usher
//! instances through a PostgreSQL database (the tables of
//! sql/auth_monitor_store.sql).
//!
//! The login path never waits for the store. Counting an attempt adds it
//! to a batch in memory ([`Batch`], one entry per key, bounded by
//! `max_pending`); the lockout reads what the last refresh brought (the
//! other instances' failures in the window and the locks in force) beside
//! this instance's own exact counts. One task per instance, with its own
//! connection, writes the batch every `flush_interval_s` (one statement
//! per table, arrays unnested, `ON CONFLICT ... DO UPDATE` adding to the
//! row) and reads the cluster's view every `refresh_interval_s`. When the
//! store cannot be reached the batch waits (up to its bound), logins go on
//! with what each instance counts itself, a warning is logged (once, then
//! at most once a minute) and the task tries again, backing off.

use super::auth_monitor_state::{
    clip, Attempt, Counters, Engaged, Kind, Locked, LockoutPolicy, Millis,
};
use super::auth_store_state::{
    addr_key, bucket, in_window, lock_until, merge_counters, role_key, slice, Batch, LockKey,
    Recent, Reset, RowKey, Scope, View,
};
use super::{now_ms, timestamp, Table};
use crate::backend::server_stream;
use crate::client_addr::ClientHost;
use crate::config::{AuthStoreConfig, Config, ConfigIssue};
use crate::tls::ServerTls;
use arc_swap::ArcSwapOption;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tokio_postgres::config::SslMode;
use tokio_postgres::NoTls;

/// The store's tables, created if missing (the file is also for DBAs).
const SCHEMA_SQL: &str = include_str!("../../../sql/auth_monitor_store.sql");

/// Instances that start together create the tables one at a time.
const SCHEMA_LOCK: i64 = 0x7573_6865_725f_616d; // "usher_am"

/// Rows read back at most, per kind (other instances' failure slices,
/// locks, resets): a flood of names cannot make a refresh unbounded.
const MAX_READ: i64 = 100_000;

/// The longest pause between two tries to reach the store.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// While the store stays unreachable, the warning is repeated this often.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// Old slices and locks are deleted at most this often (by each instance).
const PRUNE_EVERY: Duration = Duration::from_secs(10);

/// Applies the resets other instances ran to the monitor's own tables.
pub type OnResets = Box<dyn Fn(&[Reset]) + Send + Sync>;

/// Why the store could not be used.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot connect: {0}")]
    Connect(#[from] crate::backend::ConnectError),
    #[error("cannot log in as {user}: {source}")]
    Login {
        user: String,
        source: tokio_postgres::Error,
    },
    #[error("{what}: {source}")]
    Query {
        what: &'static str,
        source: tokio_postgres::Error,
    },
    #[error("{what} took longer than {} s", .after.as_secs_f64())]
    Timeout { what: &'static str, after: Duration },
}

/// Where the store is and how usher logs in there.
#[derive(Debug)]
struct Target {
    database: String,
    hosts: Vec<(String, u16)>,
    dbname: String,
    tls: ServerTls,
    user: String,
    password: String,
    schema: String,
    create_tables: bool,
}

/// What the login path adds to and the task takes from, under one mutex
/// (held for map operations only, never across an await; taken before
/// the status's when both are).
#[derive(Debug, Default)]
struct Buffers {
    /// Counted, not yet written.
    pending: Batch,
    /// Role rows of the flush on its way now.
    inflight: HashMap<RowKey, Counters>,
    /// Role rows written since the view was last read.
    flushed: HashMap<RowKey, Counters>,
    /// Role rows written before the read on its way now (the new view
    /// holds them; until it is in place they are added to the old one).
    refreshing: HashMap<RowKey, Counters>,
    /// This instance's own failures of the window.
    recent: Recent,
    /// Locks this instance engaged (the view has them after a refresh).
    own_locks: HashMap<LockKey, Millis>,
}

/// The task's state, for SHOW AUTH_STORE and the warnings.
#[derive(Debug)]
struct Status {
    state: &'static str,
    last_error: Option<String>,
    last_flush: Option<Millis>,
    last_refresh: Option<Millis>,
    flushes: u64,
    refreshes: u64,
    errors: u64,
    dropped: u64,
    warned: Option<Instant>,
}

/// The connection of the store's task.
struct Conn {
    client: tokio_postgres::Client,
}

/// One instance's side of the shared store.
#[derive(Debug)]
pub struct AuthStore {
    target: Target,
    /// This process among the instances: its rows of failures are its own.
    instance: String,
    policy: Option<LockoutPolicy>,
    slice: Millis,
    flush_interval: Duration,
    refresh_interval: Duration,
    timeout: Duration,
    max_pending: usize,
    max_roles: usize,
    buf: Mutex<Buffers>,
    view: ArcSwapOption<View>,
    status: Mutex<Status>,
    /// Set once the task has ended (after its last flush).
    stopped: watch::Sender<bool>,
}

impl AuthStore {
    /// The store `store` describes (validated with the rest of `config`).
    pub fn new(
        config: &Config,
        store: &AuthStoreConfig,
        policy: Option<LockoutPolicy>,
        max_roles: usize,
    ) -> Result<AuthStore, ConfigIssue> {
        let db = config.listed_database(&store.database).ok_or_else(|| {
            ConfigIssue::new(
                "auth_monitor.store.database",
                "expected a database listed under `databases`",
            )
        })?;
        let tls = ServerTls::from_config(db)
            .map_err(|i| i.under(&format!("databases.{}", store.database)))?;
        let password = config
            .plaintext_password(&store.user)
            .ok_or_else(|| {
                ConfigIssue::new(
                    "auth_monitor.store.user",
                    "expected a user listed under `users` with a plaintext password",
                )
            })?
            .to_string();
        let slice = policy.as_ref().map_or(1000, |p| slice(p.window));
        Ok(AuthStore {
            target: Target {
                database: store.database.clone(),
                hosts: db.server_hosts(),
                dbname: db.server_dbname(&store.database).to_string(),
                tls,
                user: store.user.clone(),
                password,
                schema: store.schema.clone(),
                create_tables: store.create_tables,
            },
            instance: instance_name(config),
            policy,
            slice,
            flush_interval: Duration::from_secs_f64(store.flush_interval_s),
            refresh_interval: Duration::from_secs_f64(store.refresh_interval_s),
            timeout: Duration::from_secs_f64(store.timeout_s),
            max_pending: store.max_pending,
            max_roles,
            buf: Mutex::new(Buffers::default()),
            view: ArcSwapOption::empty(),
            status: Mutex::new(Status {
                state: "starting",
                last_error: None,
                last_flush: None,
                last_refresh: None,
                flushes: 0,
                refreshes: 0,
                errors: 0,
                dropped: 0,
                warned: None,
            }),
            stopped: watch::channel(false).0,
        })
    }

    /// Counts one attempt (its role row's `delta`, and for the lockout its
    /// failure or success); `local` are the locks this instance's own
    /// tables engaged for it. Returns the locks engaged because the
    /// failures of every instance reached the limit.
    pub fn record(
        &self,
        row: Option<RowKey>,
        delta: &Counters,
        a: &Attempt<'_>,
        local: &[Engaged],
    ) -> Vec<Engaged> {
        // A local client has no address key: it is counted by role only.
        let (ip, now) = (a.addr.ip(), a.now);
        let max = self.max_pending;
        let mut engaged = Vec::new();
        let view = self.view.load();
        let mut b = self.buf.lock();
        let Buffers {
            pending,
            recent,
            own_locks,
            ..
        } = &mut *b;
        if let Some(row) = row {
            pending.add_row(row, delta, max);
        }
        let Some(p) = &self.policy else {
            return engaged;
        };
        let user = clip(a.user);
        match a.kind {
            Kind::Success if p.by_role && !user.is_empty() => {
                pending.clear_failures(user, max);
                recent.clear(&role_key(user));
            }
            Kind::Failure { guess: true } => {
                let slot = bucket(now, self.slice);
                let oldest = now.saturating_sub(p.window + self.slice);
                let mut keys = Vec::new();
                if p.by_role && !user.is_empty() {
                    keys.push(role_key(user));
                }
                if let (true, Some(ip)) = (p.by_address, ip) {
                    keys.push(addr_key(ip));
                }
                for key in keys {
                    pending.add_failure(&key, slot, 1, max);
                    recent.add(&key, slot, max, oldest);
                    let here = local.iter().find_map(|e| match e {
                        Engaged::Role { user, until } if role_key(user) == key => Some(*until),
                        Engaged::Address { addr, until } if addr_key(*addr) == key => Some(*until),
                        _ => None,
                    });
                    if let Some(until) = here {
                        // Engaged by this instance's own count: the others
                        // learn it from the store.
                        add_own_lock(own_locks, &key, until, now, max);
                        pending.add_lock(&key, until, max);
                        continue;
                    }
                    let in_view = view.as_ref().and_then(|v| lock_until(&v.locks, &key, now));
                    if lock_until(own_locks, &key, now).or(in_view).is_some() {
                        continue;
                    }
                    let others = view
                        .as_ref()
                        .and_then(|v| v.others.get(&key))
                        .map_or(0, |s| in_window(s, now, p.window, self.slice));
                    let mine = in_window(recent.get(&key), now, p.window, self.slice);
                    if others + mine < p.max_failures {
                        continue;
                    }
                    let until = now + p.duration;
                    add_own_lock(own_locks, &key, until, now, max);
                    pending.add_lock(&key, until, max);
                    engaged.push(match key.0 {
                        Scope::Role => Engaged::Role {
                            user: user.to_string(),
                            until,
                        },
                        Scope::Addr => match ip {
                            Some(addr) => Engaged::Address { addr, until },
                            None => continue,
                        },
                    });
                }
            }
            _ => {}
        }
        engaged
    }

    /// Whether a lock engaged by any instance refuses `user` from `addr`.
    pub fn locked(&self, user: &str, addr: ClientHost, now: Millis) -> Option<Locked> {
        let p = self.policy.as_ref()?;
        if let (true, ClientHost::Ip(ip)) = (p.by_address, addr) {
            if let Some(until) = self.lock_until(&addr_key(ip), now) {
                return Some(Locked::Address { until });
            }
        }
        if p.by_role {
            if let Some(until) = self.lock_until(&role_key(user), now) {
                return Some(Locked::Role { until });
            }
        }
        None
    }

    /// The end of the lock of `key`, engaged here or by another instance.
    pub fn lock_until(&self, key: &LockKey, now: Millis) -> Option<Millis> {
        let view = self.view.load();
        let own = lock_until(&self.buf.lock().own_locks, key, now);
        own.max(view.as_ref().and_then(|v| lock_until(&v.locks, key, now)))
    }

    /// RESET AUTH_MON on this instance's console: written to the store
    /// (every instance applies it), and applied here at once.
    pub fn reset(&self, reset: Reset) {
        let mut b = self.buf.lock();
        b.pending.add_reset(reset.clone());
        self.forget(&mut b, &reset);
    }

    /// Resets another instance ran (read from the store).
    fn apply_remote(&self, resets: &[Reset]) {
        let mut b = self.buf.lock();
        for r in resets {
            b.pending.forget(r);
            self.forget(&mut b, r);
        }
    }

    fn forget(&self, b: &mut Buffers, reset: &Reset) {
        for rows in [&mut b.inflight, &mut b.flushed, &mut b.refreshing] {
            rows.retain(|k, c| !reset.covers_row(k, c));
        }
        b.recent.reset(reset);
        b.own_locks.retain(|k, _| !reset.covers_key(k));
        if let Some(view) = self.view.load_full() {
            self.view.store(Some(Arc::new(view.without(reset))));
        }
    }

    /// The cluster's counters (the store's rows and what this instance
    /// counted since it read them); `None` until the store was first read.
    pub fn cluster_rows(&self) -> Option<HashMap<RowKey, Counters>> {
        let b = self.buf.lock();
        let view = self.view.load_full()?;
        let mut overlay = b.pending.roles.clone();
        for rows in [&b.inflight, &b.flushed, &b.refreshing] {
            for (k, c) in rows {
                merge_counters(overlay.entry(k.clone()).or_default(), c);
            }
        }
        Some(view.with_overlay(&overlay))
    }

    /// SHOW AUTH_STORE: one row about this instance's side of the store.
    pub fn show(&self) -> Table {
        // The buffers' lock before the status's, as everywhere.
        let (pending, locks, waiting_dropped) = {
            let b = self.buf.lock();
            (b.pending.len(), b.own_locks.len(), b.pending.dropped)
        };
        let view = self.view.load();
        let s = self.status.lock();
        let n = |v: u64| Some(v.to_string());
        Table::new(
            &[
                "instance",
                "database",
                "state",
                "last_error",
                "last_flush_ts",
                "last_refresh_ts",
                "flushes",
                "refreshes",
                "errors",
                "pending",
                "dropped",
                "cluster_roles",
                "cluster_locks",
            ],
            vec![vec![
                Some(self.instance.clone()),
                Some(self.target.database.clone()),
                Some(s.state.to_string()),
                s.last_error.clone(),
                s.last_flush.map(timestamp),
                s.last_refresh.map(timestamp),
                n(s.flushes),
                n(s.refreshes),
                n(s.errors),
                n(pending as u64),
                n(s.dropped + waiting_dropped),
                view.as_ref().map(|v| v.roles.len().to_string()),
                Some((view.as_ref().map_or(0, |v| v.locks.len()) + locks).to_string()),
            ]],
        )
    }

    /// Starts the task: it runs until `shutdown`, then writes what is left
    /// (if the store is reachable) and ends. `on_resets` applies the
    /// resets other instances ran to the monitor's own tables.
    pub fn spawn(self: &Arc<Self>, shutdown: watch::Receiver<bool>, on_resets: OnResets) {
        let me = self.clone();
        tokio::spawn(async move {
            me.run(shutdown, on_resets).await;
            me.stopped.send_replace(true);
        });
    }

    /// Waits (at most `timeout_s`) for the task's last flush at shutdown.
    pub async fn stopped(&self) {
        let mut rx = self.stopped.subscribe();
        let _ =
            tokio::time::timeout(self.timeout + Duration::from_secs(1), rx.wait_for(|s| *s)).await;
    }

    async fn run(&self, mut shutdown: watch::Receiver<bool>, on_resets: OnResets) {
        let mut conn: Option<Conn> = None;
        let mut backoff = self.flush_interval.min(MAX_BACKOFF);
        // Resets are read from where the log stood at the first connection.
        let mut last_reset: Option<i64> = None;
        let mut next_flush = Instant::now();
        let mut next_refresh = Instant::now();
        let mut next_prune = Instant::now();
        loop {
            if *shutdown.borrow() {
                break;
            }
            if conn.as_ref().is_none_or(|c| c.client.is_closed()) {
                match self.connect(&mut last_reset).await {
                    Ok(c) => {
                        conn = Some(c);
                        backoff = self.flush_interval.min(MAX_BACKOFF);
                        self.up();
                    }
                    Err(e) => {
                        conn = None;
                        self.failed("unreachable", &e);
                        tokio::select! {
                            _ = tokio::time::sleep(backoff) => {}
                            _ = shutdown.wait_for(|s| *s) => break,
                        }
                        backoff = (backoff * 2).min(MAX_BACKOFF);
                        continue;
                    }
                }
            }
            let Some(c) = conn.as_mut() else { continue };
            let wake = next_flush.min(next_refresh);
            tokio::select! {
                _ = tokio::time::sleep_until(wake.into()) => {}
                _ = shutdown.wait_for(|s| *s) => break,
            }
            let now = Instant::now();
            let mut result = Ok(());
            if now >= next_flush {
                next_flush = now + self.flush_interval;
                result = self.flush(c).await;
            }
            if result.is_ok() && now >= next_refresh {
                next_refresh = now + self.refresh_interval;
                let prune = now >= next_prune;
                if prune {
                    next_prune = now + PRUNE_EVERY;
                }
                result = self.refresh(c, &mut last_reset, prune).await.map(|resets| {
                    if !resets.is_empty() {
                        on_resets(&resets);
                    }
                });
            }
            match result {
                Ok(()) => self.up(),
                Err(e) => {
                    // A new connection next time (the statement may have
                    // left the old one in any state).
                    conn = None;
                    self.failed("error", &e);
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = shutdown.wait_for(|s| *s) => break,
                    }
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
        // Shutdown: what is left goes out if the store is there.
        if let Some(c) = conn.as_mut() {
            if let Err(e) = self.flush(c).await {
                tracing::warn!(error = %e, "auth monitor store: the last counts could not be written");
            }
        }
    }

    /// Opens the task's connection (under `timeout_s`) and creates the
    /// tables if asked to.
    async fn connect(&self, last_reset: &mut Option<i64>) -> Result<Conn, StoreError> {
        let t = &self.target;
        let work = async {
            let mut last = None;
            let mut stream = None;
            for (host, port) in &t.hosts {
                match server_stream::open(host, *port, &t.tls).await {
                    Ok(s) => {
                        stream = Some(s);
                        break;
                    }
                    Err(e) => last = Some(e),
                }
            }
            let stream = match (stream, last) {
                (Some(s), _) => s,
                (None, Some(e)) => return Err(StoreError::Connect(e)),
                (None, None) => unreachable!("a database has at least one host"),
            };
            let mut config = tokio_postgres::Config::new();
            config
                .user(&t.user)
                .password(&t.password)
                .dbname(&t.dbname)
                .application_name("usher auth_monitor store")
                // The schema is an identifier (checked in config), quoted.
                .options(format!("-c search_path=\"{}\"", t.schema))
                .ssl_mode(SslMode::Disable); // TLS, if any, is on the stream
            let (client, connection) =
                config
                    .connect_raw(stream, NoTls)
                    .await
                    .map_err(|source| StoreError::Login {
                        user: t.user.clone(),
                        source,
                    })?;
            tokio::spawn(async move {
                if let Err(e) = connection.await {
                    tracing::debug!(error = %e, "auth monitor store connection ended");
                }
            });
            if t.create_tables {
                let sql = format!(
                    "BEGIN; SELECT pg_advisory_xact_lock({SCHEMA_LOCK}); {SCHEMA_SQL}\nCOMMIT;"
                );
                client
                    .batch_execute(&sql)
                    .await
                    .map_err(|source| StoreError::Query {
                        what: "creating the tables (sql/auth_monitor_store.sql)",
                        source,
                    })?;
            }
            if last_reset.is_none() {
                let row = client
                    .query_one(
                        "SELECT coalesce(max(id), 0)::int8 FROM usher_auth_mon_resets",
                        &[],
                    )
                    .await
                    .map_err(|source| StoreError::Query {
                        what: "reading the resets",
                        source,
                    })?;
                *last_reset = Some(row.get(0));
            }
            Ok(Conn { client })
        };
        timed(self.timeout, "connecting", work).await
    }

    /// Writes the pending batch in one transaction; on failure it is put
    /// back in front of what was counted meanwhile.
    async fn flush(&self, c: &mut Conn) -> Result<(), StoreError> {
        let batch = {
            let mut b = self.buf.lock();
            let mut batch = std::mem::take(&mut b.pending);
            let dropped = std::mem::take(&mut batch.dropped);
            if dropped > 0 {
                self.status.lock().dropped += dropped;
                metrics::counter!("usher_auth_mon_store_dropped_total").increment(dropped);
                tracing::warn!(
                    dropped,
                    max_pending = self.max_pending,
                    "auth monitor store: counts dropped, the batch was full"
                );
            }
            if batch.is_empty() {
                return Ok(());
            }
            b.inflight = batch.roles.clone();
            batch
        };
        let result = timed(self.timeout, "writing the counts", self.write(c, &batch)).await;
        let mut b = self.buf.lock();
        let inflight = std::mem::take(&mut b.inflight);
        match &result {
            Ok(()) => {
                for (k, v) in inflight {
                    merge_counters(b.flushed.entry(k).or_default(), &v);
                }
                let mut s = self.status.lock();
                s.flushes += 1;
                s.last_flush = Some(now_ms());
                metrics::counter!("usher_auth_mon_store_flushes_total", "result" => "ok")
                    .increment(1);
            }
            Err(_) => {
                let newer = std::mem::take(&mut b.pending);
                let mut again = batch;
                again.merge(newer, self.max_pending);
                b.pending = again;
                metrics::counter!("usher_auth_mon_store_flushes_total", "result" => "error")
                    .increment(1);
            }
        }
        result
    }

    async fn write(&self, c: &mut Conn, batch: &Batch) -> Result<(), StoreError> {
        let q = |what: &'static str| move |source| StoreError::Query { what, source };
        let tx = c
            .client
            .transaction()
            .await
            .map_err(q("starting a transaction"))?;
        for r in &batch.resets {
            let (scope, key, uid) = match r {
                Reset::All => ("all", String::new(), 0u32),
                Reset::Role { name, uid } => ("role", clip(name).to_string(), *uid),
                Reset::Addr(a) => ("addr", addr_key(*a).1, 0),
            };
            // What the reset covers goes, as on the console's instance.
            match r {
                Reset::All => {
                    for sql in [
                        "DELETE FROM usher_auth_mon_roles",
                        "DELETE FROM usher_auth_mon_failures",
                        "DELETE FROM usher_auth_mon_locks",
                    ] {
                        tx.execute(sql, &[]).await.map_err(q("applying a reset"))?;
                    }
                }
                Reset::Role { .. } => {
                    tx.execute(
                        "DELETE FROM usher_auth_mon_roles WHERE (uid = 0 AND name = $1) \
                         OR (uid <> 0 AND (uid = $2 OR login_name_at_last_attempt = $1))",
                        &[&key, &uid],
                    )
                    .await
                    .map_err(q("applying a reset"))?;
                    for sql in [
                        "DELETE FROM usher_auth_mon_failures WHERE scope = 'role' AND key = $1",
                        "DELETE FROM usher_auth_mon_locks WHERE scope = 'role' AND key = $1",
                    ] {
                        tx.execute(sql, &[&key])
                            .await
                            .map_err(q("applying a reset"))?;
                    }
                }
                Reset::Addr(_) => {
                    for sql in [
                        "DELETE FROM usher_auth_mon_failures WHERE scope = 'addr' AND key = $1",
                        "DELETE FROM usher_auth_mon_locks WHERE scope = 'addr' AND key = $1",
                    ] {
                        tx.execute(sql, &[&key])
                            .await
                            .map_err(q("applying a reset"))?;
                    }
                }
            }
            tx.execute(
                "INSERT INTO usher_auth_mon_resets (instance, scope, key, uid) VALUES ($1, $2, $3, $4)",
                &[&self.instance, &scope, &key, &uid],
            )
            .await
            .map_err(q("logging a reset"))?;
        }
        if !batch.cleared.is_empty() {
            let mut names: Vec<&str> = batch.cleared.iter().map(String::as_str).collect();
            names.sort_unstable();
            tx.execute(
                "DELETE FROM usher_auth_mon_failures WHERE scope = 'role' AND key = ANY($1::text[])",
                &[&names],
            )
            .await
            .map_err(q("clearing failures after a success"))?;
        }
        if !batch.failures.is_empty() {
            // In key order: instances writing the same rows take their
            // locks in the same order (no deadlock).
            let mut rows: Vec<_> = batch.failures.iter().collect();
            rows.sort();
            let scopes: Vec<&str> = rows.iter().map(|((s, _, _), _)| s.as_str()).collect();
            let keys: Vec<&str> = rows.iter().map(|((_, k, _), _)| k.as_str()).collect();
            let buckets: Vec<f64> = rows.iter().map(|((_, _, b), _)| *b as f64).collect();
            let counts: Vec<i64> = rows.iter().map(|(_, n)| i64::from(**n)).collect();
            tx.execute(
                "INSERT INTO usher_auth_mon_failures AS t (scope, key, instance, bucket, failures) \
                 SELECT u.scope, u.key, $1, to_timestamp(u.b / 1000), u.n \
                 FROM unnest($2::text[], $3::text[], $4::float8[], $5::int8[]) AS u(scope, key, b, n) \
                 ON CONFLICT (scope, key, instance, bucket) DO UPDATE SET failures = t.failures + excluded.failures",
                &[&self.instance, &scopes, &keys, &buckets, &counts],
            )
            .await
            .map_err(q("writing failures"))?;
        }
        if !batch.roles.is_empty() {
            let mut rows: Vec<_> = batch.roles.iter().collect();
            rows.sort_by(|a, b| a.0.cmp(b.0));
            let ms = |v: Option<Millis>| v.map(|m| m as f64);
            let uids: Vec<u32> = rows.iter().map(|(k, _)| k.uid).collect();
            let names: Vec<&str> = rows.iter().map(|(k, _)| k.name.as_str()).collect();
            let ok: Vec<i64> = rows
                .iter()
                .map(|(_, c)| c.successful_attempts as i64)
                .collect();
            let ok_ts: Vec<Option<f64>> =
                rows.iter().map(|(_, c)| ms(c.last_successful_ts)).collect();
            let hba: Vec<i64> = rows
                .iter()
                .map(|(_, c)| c.total_hba_conflicts as i64)
                .collect();
            let fail: Vec<i64> = rows
                .iter()
                .map(|(_, c)| c.other_auth_failures as i64)
                .collect();
            let fail_ts: Vec<Option<f64>> =
                rows.iter().map(|(_, c)| ms(c.last_failed_ts)).collect();
            let login: Vec<&str> = rows
                .iter()
                .map(|(_, c)| c.login_name_at_last_attempt.as_str())
                .collect();
            let blocked: Vec<i64> = rows
                .iter()
                .map(|(_, c)| c.blocked_attempts as i64)
                .collect();
            let addr: Vec<Option<String>> = rows
                .iter()
                .map(|(_, c)| c.last_failed_addr.map(|a| a.to_string()))
                .collect();
            let at: Vec<f64> = rows.iter().map(|(_, c)| c.last_attempt_ts as f64).collect();
            tx.execute(
                "INSERT INTO usher_auth_mon_roles AS t (uid, name, successful_attempts, last_successful_ts, \
                   total_hba_conflicts, other_auth_failures, last_failed_ts, login_name_at_last_attempt, \
                   blocked_attempts, last_failed_addr, last_attempt_ts) \
                 SELECT u.uid, u.name, u.ok, to_timestamp(u.ok_ts / 1000), u.hba, u.fail, \
                   to_timestamp(u.fail_ts / 1000), u.login, u.blocked, u.addr, to_timestamp(u.at / 1000) \
                 FROM unnest($1::oid[], $2::text[], $3::int8[], $4::float8[], $5::int8[], $6::int8[], \
                   $7::float8[], $8::text[], $9::int8[], $10::text[], $11::float8[]) \
                   AS u(uid, name, ok, ok_ts, hba, fail, fail_ts, login, blocked, addr, at) \
                 ON CONFLICT (uid, name) DO UPDATE SET \
                   successful_attempts = t.successful_attempts + excluded.successful_attempts, \
                   last_successful_ts = greatest(t.last_successful_ts, excluded.last_successful_ts), \
                   total_hba_conflicts = t.total_hba_conflicts + excluded.total_hba_conflicts, \
                   other_auth_failures = t.other_auth_failures + excluded.other_auth_failures, \
                   last_failed_ts = greatest(t.last_failed_ts, excluded.last_failed_ts), \
                   last_failed_addr = CASE WHEN excluded.last_failed_ts IS NOT NULL \
                       AND (t.last_failed_ts IS NULL OR excluded.last_failed_ts >= t.last_failed_ts) \
                     THEN coalesce(excluded.last_failed_addr, t.last_failed_addr) ELSE t.last_failed_addr END, \
                   login_name_at_last_attempt = CASE WHEN excluded.last_attempt_ts >= t.last_attempt_ts \
                     THEN excluded.login_name_at_last_attempt ELSE t.login_name_at_last_attempt END, \
                   blocked_attempts = t.blocked_attempts + excluded.blocked_attempts, \
                   last_attempt_ts = greatest(t.last_attempt_ts, excluded.last_attempt_ts)",
                &[
                    &uids, &names, &ok, &ok_ts, &hba, &fail, &fail_ts, &login, &blocked, &addr, &at,
                ],
            )
            .await
            .map_err(q("writing the counters"))?;
        }
        if !batch.locks.is_empty() {
            let mut rows: Vec<_> = batch.locks.iter().collect();
            rows.sort();
            let scopes: Vec<&str> = rows.iter().map(|((s, _), _)| s.as_str()).collect();
            let keys: Vec<&str> = rows.iter().map(|((_, k), _)| k.as_str()).collect();
            let until: Vec<f64> = rows.iter().map(|(_, u)| **u as f64).collect();
            tx.execute(
                "INSERT INTO usher_auth_mon_locks AS t (scope, key, locked_until, instance) \
                 SELECT u.scope, u.key, to_timestamp(u.until / 1000), $1 \
                 FROM unnest($2::text[], $3::text[], $4::float8[]) AS u(scope, key, until) \
                 ON CONFLICT (scope, key) DO UPDATE SET \
                   locked_until = greatest(t.locked_until, excluded.locked_until), instance = excluded.instance",
                &[&self.instance, &scopes, &keys, &until],
            )
            .await
            .map_err(q("writing locks"))?;
        }
        tx.commit().await.map_err(q("committing"))
    }

    /// Reads the cluster's view (and the resets other instances ran since
    /// the last read); with `prune`, deletes slices and locks that no
    /// longer matter first.
    async fn refresh(
        &self,
        c: &mut Conn,
        last_reset: &mut Option<i64>,
        prune: bool,
    ) -> Result<Vec<Reset>, StoreError> {
        {
            // What was written so far is in what is read now.
            let mut b = self.buf.lock();
            let flushed = std::mem::take(&mut b.flushed);
            for (k, v) in flushed {
                merge_counters(b.refreshing.entry(k).or_default(), &v);
            }
        }
        let result = timed(
            self.timeout,
            "reading the cluster's counts",
            self.read(c, last_reset, prune),
        )
        .await;
        let mut b = self.buf.lock();
        let refreshing = std::mem::take(&mut b.refreshing);
        match result {
            Ok((view, resets)) => {
                for r in &resets {
                    b.pending.forget(r);
                }
                let now = now_ms();
                b.own_locks.retain(|_, until| *until > now);
                if let Some(p) = &self.policy {
                    b.recent.prune(now.saturating_sub(p.window + self.slice));
                }
                self.view.store(Some(Arc::new(view)));
                drop(b);
                if !resets.is_empty() {
                    self.apply_remote(&resets);
                }
                let mut s = self.status.lock();
                s.refreshes += 1;
                s.last_refresh = Some(now);
                Ok(resets)
            }
            Err(e) => {
                for (k, v) in refreshing {
                    merge_counters(b.flushed.entry(k).or_default(), &v);
                }
                Err(e)
            }
        }
    }

    async fn read(
        &self,
        c: &mut Conn,
        last_reset: &mut Option<i64>,
        prune: bool,
    ) -> Result<(View, Vec<Reset>), StoreError> {
        let q = |what: &'static str| move |source| StoreError::Query { what, source };
        let client = &c.client;
        let now = now_ms();
        if prune {
            if let Some(p) = &self.policy {
                let oldest = now.saturating_sub(p.window + 2 * self.slice) as f64;
                client
                    .execute(
                        "DELETE FROM usher_auth_mon_failures WHERE bucket < to_timestamp($1::float8 / 1000)",
                        &[&oldest],
                    )
                    .await
                    .map_err(q("pruning failures"))?;
            }
            client
                .execute(
                    "DELETE FROM usher_auth_mon_locks \
                     WHERE locked_until < to_timestamp($1::float8 / 1000) - interval '1 minute'",
                    &[&(now as f64)],
                )
                .await
                .map_err(q("pruning locks"))?;
            client
                .execute(
                    "DELETE FROM usher_auth_mon_resets WHERE at < now() - interval '1 day'",
                    &[],
                )
                .await
                .map_err(q("pruning resets"))?;
        }
        let mut resets = Vec::new();
        let from = last_reset.unwrap_or(0);
        for row in client
            .query(
                "SELECT id, instance, scope, key, uid FROM usher_auth_mon_resets \
                 WHERE id > $1 ORDER BY id LIMIT $2",
                &[&from, &MAX_READ],
            )
            .await
            .map_err(q("reading resets"))?
        {
            let id: i64 = row.get(0);
            *last_reset = Some(id.max(last_reset.unwrap_or(0)));
            let instance: &str = row.get(1);
            if instance == self.instance {
                continue;
            }
            let key: String = row.get(3);
            match row.get::<_, &str>(2) {
                "all" => resets.push(Reset::All),
                "role" => resets.push(Reset::Role {
                    name: key,
                    uid: row.get(4),
                }),
                "addr" => {
                    if let Ok(a) = key.parse() {
                        resets.push(Reset::Addr(a));
                    }
                }
                _ => {}
            }
        }
        let ms = "(round(extract(epoch FROM {}) * 1000))::int8";
        let col = |c: &str| ms.replace("{}", c);
        let sql = format!(
            "SELECT uid, name, successful_attempts, {}, total_hba_conflicts, other_auth_failures, {}, \
               login_name_at_last_attempt, blocked_attempts, last_failed_addr, {} \
             FROM usher_auth_mon_roles ORDER BY last_attempt_ts DESC LIMIT $1",
            col("last_successful_ts"),
            col("last_failed_ts"),
            col("last_attempt_ts")
        );
        let mut view = View::default();
        // The row of unknown names, and up to max_roles roles.
        let limit = self.max_roles as i64 + 1;
        for row in client
            .query(&sql, &[&limit])
            .await
            .map_err(q("reading the counters"))?
        {
            let ms = |i: usize| row.get::<_, Option<i64>>(i).map(|v| v.max(0) as Millis);
            let n = |i: usize| row.get::<_, i64>(i).max(0) as u64;
            let counters = Counters {
                successful_attempts: n(2),
                last_successful_ts: ms(3),
                total_hba_conflicts: n(4),
                other_auth_failures: n(5),
                last_failed_ts: ms(6),
                login_name_at_last_attempt: row.get(7),
                blocked_attempts: n(8),
                last_failed_addr: row.get::<_, Option<&str>>(9).and_then(|a| a.parse().ok()),
                last_attempt_ts: ms(10).unwrap_or_default(),
                ..Counters::default()
            };
            let key = RowKey {
                uid: row.get(0),
                name: row.get(1),
            };
            view.roles.insert(key, counters);
        }
        if let Some(p) = &self.policy {
            let since = now.saturating_sub(p.window + self.slice) as f64;
            let sql = format!(
                "SELECT scope, key, {}, sum(failures)::int8 FROM usher_auth_mon_failures \
                 WHERE instance <> $1 AND bucket >= to_timestamp($2::float8 / 1000) \
                 GROUP BY scope, key, bucket LIMIT $3",
                col("bucket")
            );
            for row in client
                .query(&sql, &[&self.instance, &since, &MAX_READ])
                .await
                .map_err(q("reading failures"))?
            {
                let Some(scope) = Scope::parse(row.get(0)) else {
                    continue;
                };
                let b: i64 = row.get(2);
                let n: i64 = row.get(3);
                view.others
                    .entry((scope, row.get(1)))
                    .or_default()
                    .push((b.max(0) as Millis, n.clamp(0, u32::MAX as i64) as u32));
            }
            let sql = format!(
                "SELECT scope, key, {} FROM usher_auth_mon_locks \
                 WHERE locked_until > to_timestamp($1::float8 / 1000) LIMIT $2",
                col("locked_until")
            );
            for row in client
                .query(&sql, &[&(now as f64), &MAX_READ])
                .await
                .map_err(q("reading locks"))?
            {
                let Some(scope) = Scope::parse(row.get(0)) else {
                    continue;
                };
                let until: i64 = row.get(2);
                view.locks
                    .insert((scope, row.get(1)), until.max(0) as Millis);
            }
        }
        Ok((view, resets))
    }

    /// The store answered.
    fn up(&self) {
        let mut s = self.status.lock();
        if s.state != "connected" {
            if s.warned.is_some() {
                tracing::warn!(database = %self.target.database, "auth monitor store: reachable again; counts are shared");
            }
            s.state = "connected";
            s.warned = None;
            metrics::gauge!("usher_auth_mon_store_up").set(1.0);
        }
    }

    /// The store failed: logins go on with local counting; the warning is
    /// logged once, then at most once a minute while it lasts.
    fn failed(&self, state: &'static str, e: &StoreError) {
        let mut s = self.status.lock();
        s.state = state;
        s.errors += 1;
        s.last_error = Some(e.to_string());
        metrics::gauge!("usher_auth_mon_store_up").set(0.0);
        if s.warned.is_none_or(|at| at.elapsed() >= WARN_EVERY) {
            s.warned = Some(Instant::now());
            tracing::warn!(
                database = %self.target.database, error = %e,
                "auth monitor store: not available; this instance counts its own logins alone until it is (the lockout does not see the other instances' failures)"
            );
        }
    }
}

/// Remembers a lock this instance engaged; when `max` are held, expired
/// ones make room (and a new one beyond is kept by the store only).
fn add_own_lock(
    locks: &mut HashMap<LockKey, Millis>,
    key: &LockKey,
    until: Millis,
    now: Millis,
    max: usize,
) {
    if !locks.contains_key(key) && locks.len() >= max {
        locks.retain(|_, u| *u > now);
        if locks.len() >= max {
            return;
        }
    }
    let u = locks.entry(key.clone()).or_default();
    *u = (*u).max(until);
}

/// `work` within `after`.
async fn timed<T>(
    after: Duration,
    what: &'static str,
    work: impl std::future::Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    tokio::time::timeout(after, work)
        .await
        .unwrap_or(Err(StoreError::Timeout { what, after }))
}

/// The name of this process among the instances (SHOW AUTH_STORE; the
/// `instance` column of the store's rows): host, listen address, peer id,
/// pid and a random part, so two processes (a restart, or instances in one
/// process as in the tests) never share one.
fn instance_name(config: &Config) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "usher".into());
    let mut name = format!("{host}/{}", config.listen);
    if config.peer_id != 0 {
        name.push_str(&format!("/peer{}", config.peer_id));
    }
    format!(
        "{name}/{}/{:08x}",
        std::process::id(),
        rand::random::<u32>()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hooks::builtin::auth_monitor::lockout_policy;

    fn store(lockout: &str) -> AuthStore {
        let yaml = format!(
            "databases: {{ app: {{ port: 1 }} }}\nusers: {{ mon: {{ password: pw }} }}\n\
             auth_monitor: {{ lockout: {{ {lockout} }}, store: {{ database: app, user: mon, schema: s1 }} }}\n"
        );
        let c = Config::from_yaml(&yaml, "t.yaml").unwrap();
        let m = c.auth_monitor.as_ref().unwrap();
        AuthStore::new(&c, m.store.as_ref().unwrap(), lockout_policy(m), 10).unwrap()
    }

    const WRONG: Kind = Kind::Failure { guess: true };
    const NOW: Millis = 1_000_000;

    fn attempt<'a>(user: &'a str, addr: &str, kind: Kind, now: Millis) -> Attempt<'a> {
        Attempt {
            user,
            known: true,
            oid: None,
            addr: addr.parse().unwrap(),
            kind,
            now,
        }
    }

    fn fail(s: &AuthStore, user: &str, addr: &str, now: Millis) -> Vec<Engaged> {
        s.record(
            None,
            &Counters::default(),
            &attempt(user, addr, WRONG, now),
            &[],
        )
    }

    #[test]
    fn the_other_instances_failures_count_towards_the_lock() {
        let s = store("max_failures: 3, window_s: 60, duration_s: 30, by_address: false");
        let mut view = View::default();
        view.others.insert(
            role_key("alice"),
            vec![
                (bucket(NOW - 70_000, 3000), 5),
                (bucket(NOW - 10_000, 3000), 1),
            ],
        );
        s.view.store(Some(Arc::new(view)));
        // 1 other in the window (the 5 are older) + 1 here: not yet.
        assert!(fail(&s, "alice", "10.0.0.1", NOW).is_empty());
        assert_eq!(s.locked("alice", "10.0.0.9".parse().unwrap(), NOW), None);
        let engaged = fail(&s, "alice", "10.0.0.2", NOW + 1);
        assert_eq!(
            engaged,
            [Engaged::Role {
                user: "alice".into(),
                until: NOW + 1 + 30_000
            }]
        );
        assert_eq!(
            s.locked("alice", "10.0.0.9".parse().unwrap(), NOW + 2),
            Some(Locked::Role {
                until: NOW + 30_001
            })
        );
        assert_eq!(s.locked("bob", "10.0.0.1".parse().unwrap(), NOW + 2), None);
        {
            let b = s.buf.lock();
            assert_eq!(b.pending.locks[&role_key("alice")], NOW + 30_001);
            assert_eq!(b.pending.failures.len(), 1, "both failures in one slice");
        }
        // While locked, failures do not engage it again.
        assert!(fail(&s, "alice", "10.0.0.2", NOW + 3).is_empty());
        // A reset here lifts it and is written for the others.
        s.reset(Reset::Role {
            name: "alice".into(),
            uid: 0,
        });
        assert_eq!(
            s.locked("alice", "10.0.0.9".parse().unwrap(), NOW + 4),
            None
        );
        let b = s.buf.lock();
        assert!(b.pending.locks.is_empty() && b.pending.failures.is_empty());
        assert_eq!(b.pending.resets.len(), 1);
        assert!(b.recent.is_empty());
    }

    #[test]
    fn a_lock_from_the_store_or_engaged_here_refuses_and_a_success_starts_over() {
        let s = store("max_failures: 2, window_s: 60, duration_s: 30");
        let mut view = View::default();
        view.locks
            .insert(addr_key("10.0.0.7".parse().unwrap()), NOW + 5);
        s.view.store(Some(Arc::new(view)));
        assert_eq!(
            s.locked("anyone", "10.0.0.7".parse().unwrap(), NOW),
            Some(Locked::Address { until: NOW + 5 })
        );
        assert_eq!(
            s.locked("anyone", "10.0.0.7".parse().unwrap(), NOW + 5),
            None
        );
        // A lock the local tables engaged goes to the store as it is.
        let local = [Engaged::Address {
            addr: "10.0.0.8".parse().unwrap(),
            until: NOW + 99,
        }];
        let extra = s.record(
            None,
            &Counters::default(),
            &attempt("carol", "10.0.0.8", WRONG, NOW),
            &local,
        );
        assert!(extra.is_empty(), "{extra:?}");
        assert_eq!(
            s.buf.lock().pending.locks[&addr_key("10.0.0.8".parse().unwrap())],
            NOW + 99
        );
        // carol: one failure here; a success clears it (and the store's).
        s.record(
            None,
            &Counters::default(),
            &attempt("carol", "10.0.0.9", Kind::Success, NOW + 1),
            &[],
        );
        assert!(s.buf.lock().pending.cleared.contains("carol"));
        assert!(fail(&s, "carol", "10.0.0.10", NOW + 2).is_empty());
        assert_eq!(
            s.locked("carol", "10.0.0.11".parse().unwrap(), NOW + 3),
            None
        );
        // SHOW AUTH_STORE before the task ran.
        let t = s.show();
        assert_eq!(t.columns[2], "state");
        assert_eq!(t.rows[0][2].as_deref(), Some("starting"));
        assert!(t.rows[0][0]
            .as_deref()
            .unwrap()
            .contains(&std::process::id().to_string()));
    }
}
