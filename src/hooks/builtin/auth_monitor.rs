//! The auth monitor: pg_auth_mon's per-role counters fed by every auth
//! attempt, kept across restarts in a state file, with usher's extras (the
//! unknown names tried, the addresses that failed) and the lockout.
//!
//! One mutex guards the tables. It is taken once per login (never on the
//! forwarding path) and never across an await or a file write.

use super::auth_monitor_state::{
    clip, count, AddrRow, Attempt, Counters, Engaged, Kind, Limits, Locked, LockoutPolicy, Millis,
    RoleKey, Saved, State, StateFileError,
};
use super::auth_store::AuthStore;
use super::auth_store_state::{addr_key, merge_counters, role_key, Reset, RowKey};
use super::{now_ms, timestamp, Table};
use crate::auth::{AuthAttempt, AuthOutcome};
use crate::client_addr::ClientHost;
use crate::config::AuthMonitorConfig;
use crate::hooks::roles::RoleCache;
use crate::hooks::{Event, Hook, HookError};
use crate::protocol::error::{shown_name, sqlstate};
use crate::protocol::PgError;
use async_trait::async_trait;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::io::Write;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// The built-in `auth_monitor` hook.
#[derive(Debug)]
pub struct AuthMonitor {
    state: Mutex<State>,
    limits: Limits,
    lockout: Option<LockoutPolicy>,
    /// Role oids (and current names) from the server, when `hooks.query` is set.
    roles: Arc<RoleCache>,
    state_file: Option<PathBuf>,
    save_interval: Duration,
    /// Something changed since the last write of the state file.
    dirty: AtomicBool,
    /// One write of the state file at a time.
    saving: Mutex<()>,
    /// The state file could not be read: the first write moves it aside
    /// (`<file>.corrupt`) rather than destroy what an operator may want
    /// to look at. Not at load: `usher check` must not move files.
    corrupt: AtomicBool,
    /// `auth_monitor.store`: the counts shared with the other instances.
    store: Option<Arc<AuthStore>>,
}

/// The lockout rule of `config`, in milliseconds.
pub fn lockout_policy(config: &AuthMonitorConfig) -> Option<LockoutPolicy> {
    let ms = |s: f64| (s * 1000.0) as Millis;
    config.lockout.as_ref().map(|l| LockoutPolicy {
        max_failures: l.max_failures,
        window: ms(l.window_s),
        duration: ms(l.duration_s),
        by_role: l.by_role,
        by_address: l.by_address,
    })
}

impl AuthMonitor {
    pub const NAME: &'static str = "auth_monitor";

    /// Builds the monitor, reading the state file if there is one.
    pub fn new(config: &AuthMonitorConfig, roles: Arc<RoleCache>) -> AuthMonitor {
        let limits = Limits {
            roles: config.max_roles,
            unknown_names: config.max_unknown_names,
            addresses: config.max_addresses,
        };
        let lockout = lockout_policy(config);
        let (state, corrupt) = match &config.state_file {
            Some(path) => load(path, &limits),
            None => (State::default(), false),
        };
        let monitor = AuthMonitor {
            state: Mutex::new(state),
            limits,
            lockout,
            roles,
            state_file: config.state_file.clone(),
            save_interval: Duration::from_secs_f64(config.save_interval_s),
            dirty: AtomicBool::new(false),
            saving: Mutex::new(()),
            corrupt: AtomicBool::new(corrupt),
            store: None,
        };
        monitor.update_gauges(&monitor.state.lock());
        monitor
    }

    /// The monitor sharing its counts through `store`.
    pub fn with_store(mut self, store: Option<AuthStore>) -> AuthMonitor {
        self.store = store.map(Arc::new);
        self
    }

    /// The shared store, when `auth_monitor.store` is set.
    pub fn store(&self) -> Option<&AuthStore> {
        self.store.as_deref()
    }

    pub fn lockout_enabled(&self) -> bool {
        self.lockout.is_some()
    }

    /// Whether a login of `user` from `addr` is locked out: the error for
    /// the client, decided before any password is checked.
    pub fn lockout_check(&self, user: &str, addr: ClientHost) -> Option<PgError> {
        let policy = self.lockout.as_ref()?;
        let oid = self.roles.snapshot().oid(user);
        let now = now_ms();
        let local = self.state.lock().locked(user, oid, addr, now, policy);
        let locked = local.or_else(|| self.store.as_ref()?.locked(user, addr, now))?;
        let (message, until) = match locked {
            Locked::Role { until } => (
                format!(
                    "too many failed login attempts for user \"{}\"",
                    shown_name(clip(user))
                ),
                until,
            ),
            Locked::Address { until } => (
                format!("too many failed login attempts from host \"{addr}\""),
                until,
            ),
        };
        let scope = match locked {
            Locked::Role { .. } => "role",
            Locked::Address { .. } => "address",
        };
        metrics::counter!("usher_auth_mon_blocked_total", "reason" => "lockout", "scope" => scope)
            .increment(1);
        Some(
            PgError::fatal(sqlstate::INVALID_AUTHORIZATION, message)
                .with_detail(format!(
                    "usher refuses these logins until {} ({} s from now)",
                    timestamp(until),
                    until.saturating_sub(now).div_ceil(1000)
                ))
                .with_hint(
                    "try again later, or ask an admin to run RESET AUTH_MON on the usher console",
                ),
        )
    }

    /// Counts an authentication outcome.
    pub fn observe(&self, attempt: &AuthAttempt) {
        let kind = match attempt.outcome {
            AuthOutcome::Success => Kind::Success,
            AuthOutcome::HbaReject => Kind::HbaConflict,
            AuthOutcome::WrongPassword | AuthOutcome::UnknownUser => Kind::Failure { guess: true },
            AuthOutcome::Locked => Kind::Blocked,
            AuthOutcome::TlsRequired
            | AuthOutcome::Timeout
            | AuthOutcome::ProtocolError
            | AuthOutcome::Refused => Kind::Failure { guess: false },
        };
        metrics::counter!("usher_auth_mon_attempts_total", "outcome" => attempt.outcome.as_str())
            .increment(1);
        self.count(
            &attempt.user,
            attempt.user_exists,
            attempt.client_addr.host(),
            kind,
        );
    }

    /// Counts a client refused by a hook (a blocking rule or a Lua hook)
    /// after it authenticated.
    pub fn blocked(&self, user: &str, user_exists: bool, addr: ClientHost) {
        metrics::counter!("usher_auth_mon_blocked_total", "reason" => "hook", "scope" => "role")
            .increment(1);
        self.count(user, user_exists, addr, Kind::Blocked);
    }

    /// `addr` is canonical (IPv4-mapped IPv6 as IPv4), as
    /// [`crate::client_addr::ClientAddr::host`] gives it.
    fn count(&self, user: &str, user_exists: bool, addr: ClientHost, kind: Kind) {
        let oid = self.roles.snapshot().oid(user);
        let attempt = Attempt {
            user,
            // Known to usher's credentials, or a role on the server.
            known: user_exists || oid.is_some(),
            oid,
            addr,
            kind,
            now: now_ms(),
        };
        let mut effects = {
            let mut state = self.state.lock();
            let fx = state.record(&attempt, &self.limits, self.lockout.as_ref());
            self.update_gauges(&state);
            fx
        };
        if let Some(store) = &self.store {
            // The same counts for the store: this attempt's row (as the
            // local tables chose it) and its share of the lockout.
            let name = clip(user);
            let row = (!name.is_empty()).then(|| match (attempt.known, oid) {
                (false, _) => RowKey::unknown(),
                (true, Some(uid)) => RowKey {
                    uid,
                    name: String::new(),
                },
                (true, None) => RowKey {
                    uid: 0,
                    name: name.to_string(),
                },
            });
            let mut delta = Counters::default();
            count(&mut delta, name, &attempt, None);
            let cluster = store.record(row, &delta, &attempt, &effects.engaged);
            effects.engaged.extend(cluster);
        }
        self.dirty.store(true, Ordering::Relaxed);
        for table in effects.evicted {
            metrics::counter!("usher_auth_mon_evictions_total", "table" => table.as_str())
                .increment(1);
        }
        for lock in effects.engaged {
            match lock {
                Engaged::Role { user, until } => {
                    metrics::counter!("usher_auth_mon_lockouts_total", "scope" => "role")
                        .increment(1);
                    tracing::warn!(user = %user, addr = %attempt.addr, until = %timestamp(until), "too many failed logins: user locked out");
                }
                Engaged::Address { addr, until } => {
                    metrics::counter!("usher_auth_mon_lockouts_total", "scope" => "address")
                        .increment(1);
                    tracing::warn!(addr = %addr, user = %clip(attempt.user), until = %timestamp(until), "too many failed logins: address locked out");
                }
            }
        }
    }

    fn update_gauges(&self, state: &State) {
        for (table, n) in [
            ("roles", state.roles.len()),
            ("unknown_names", state.unknown_names.len()),
            ("addresses", state.addresses.len()),
        ] {
            metrics::gauge!("usher_auth_mon_entries", "table" => table).set(n as f64);
        }
    }

    /// RESET AUTH_MON: forgets everything.
    pub fn reset_all(&self) {
        if let Some(store) = &self.store {
            store.reset(Reset::All);
        }
        let mut state = self.state.lock();
        state.clear();
        self.update_gauges(&state);
        self.dirty.store(true, Ordering::Relaxed);
    }

    /// RESET AUTH_MON name: forgets a role or unknown name. False if there
    /// was nothing to forget.
    pub fn reset_role(&self, name: &str) -> bool {
        let oid = self.roles.snapshot().oid(name);
        if let Some(store) = &self.store {
            store.reset(Reset::Role {
                name: name.to_string(),
                uid: oid.unwrap_or(0),
            });
        }
        let mut state = self.state.lock();
        let removed = state.reset_role(name, oid);
        self.update_gauges(&state);
        self.dirty.store(true, Ordering::Relaxed);
        removed
    }

    /// RESET AUTH_MON address: forgets a client address (and its lock).
    pub fn reset_address(&self, addr: IpAddr) -> bool {
        if let Some(store) = &self.store {
            store.reset(Reset::Addr(addr.to_canonical()));
        }
        let mut state = self.state.lock();
        let removed = state.reset_address(addr.to_canonical());
        self.update_gauges(&state);
        self.dirty.store(true, Ordering::Relaxed);
        removed
    }

    /// SHOW AUTH_MON: pg_auth_mon's columns in its order, then usher's.
    /// With a store (once it was read), the counts of every instance.
    pub fn show_roles(&self) -> Table {
        let graph = self.roles.snapshot();
        let warm = self.roles.is_warm();
        let names: HashMap<u32, &str> = graph.roles().map(|(n, o)| (o, n)).collect();
        let now = now_ms();
        let cluster = self.store.as_ref().and_then(|s| s.cluster_rows());
        // A lock engaged by any instance, by the name clients give.
        let shared_lock = |name: &str| {
            self.store
                .as_ref()
                .and_then(|s| s.lock_until(&role_key(name), now))
        };
        let state = self.state.lock();
        let mut rows: Vec<(String, Vec<Option<String>>)> = Vec::new();
        let mut push =
            |rolname: String, deleted: bool, uid: u32, c: &Counters, lock: Option<Millis>| {
                let n = |v: u64| Some(v.to_string());
                let ts = |v: Option<Millis>| v.map(timestamp);
                let lock = lock
                    .max(shared_lock(&rolname))
                    .max(shared_lock(&c.login_name_at_last_attempt));
                rows.push((
                    rolname.clone(),
                    vec![
                        Some(rolname),
                        Some(if deleted { "t" } else { "f" }.to_string()),
                        Some(uid.to_string()),
                        n(c.successful_attempts),
                        ts(c.last_successful_ts),
                        n(c.total_hba_conflicts),
                        n(c.other_auth_failures),
                        ts(c.last_failed_ts),
                        Some(c.login_name_at_last_attempt.clone()),
                        n(c.blocked_attempts),
                        c.last_failed_addr.map(|a| a.to_string()),
                        ts(lock),
                    ],
                ));
            };
        match cluster {
            None => {
                if state.unknown.last_attempt_ts > 0 {
                    push(String::new(), false, 0, &state.unknown, None);
                }
                for (key, c) in &state.roles {
                    let lock = c.lock.until(now);
                    match key {
                        RoleKey::Oid(oid) => match names.get(oid) {
                            Some(name) => push(name.to_string(), false, *oid, c, lock),
                            // Dropped on the server (pg_auth_mon: deleted,
                            // named by its last login attempt).
                            None => push(c.login_name_at_last_attempt.clone(), warm, *oid, c, lock),
                        },
                        RoleKey::Name(name) => push(name.clone(), false, 0, c, lock),
                    }
                }
            }
            Some(cluster) => {
                // A row kept by name (an instance that did not know the
                // oid yet) joins its role's row once the oid is known.
                let mut merged: HashMap<RowKey, Counters> = HashMap::new();
                for (mut key, c) in cluster {
                    if key.uid == 0 && !key.name.is_empty() {
                        if let Some(uid) = graph.oid(&key.name) {
                            key = RowKey {
                                uid,
                                name: String::new(),
                            };
                        }
                    }
                    merge_counters(merged.entry(key).or_default(), &c);
                }
                for (key, c) in &merged {
                    if key.is_unknown() {
                        if c.last_attempt_ts > 0 {
                            push(String::new(), false, 0, c, None);
                        }
                        continue;
                    }
                    let local = if key.uid != 0 {
                        RoleKey::Oid(key.uid)
                    } else {
                        RoleKey::Name(key.name.clone())
                    };
                    let lock = state.roles.get(&local).and_then(|r| r.lock.until(now));
                    if key.uid == 0 {
                        push(key.name.clone(), false, 0, c, lock);
                        continue;
                    }
                    match names.get(&key.uid) {
                        Some(name) => push(name.to_string(), false, key.uid, c, lock),
                        None => push(c.login_name_at_last_attempt.clone(), warm, key.uid, c, lock),
                    }
                }
            }
        }
        rows.sort_by(|a, b| a.0.cmp(&b.0));
        Table::new(
            &[
                "rolname",
                "deleted",
                "uid",
                "successful_attempts",
                "last_successful_ts",
                "total_hba_conflicts",
                "other_auth_failures",
                "last_failed_ts",
                "login_name_at_last_attempt",
                "blocked_attempts",
                "last_failed_addr",
                "locked_until",
            ],
            rows.into_iter().map(|(_, r)| r).collect(),
        )
    }

    /// SHOW AUTH_MON_UNKNOWN: the unknown user names tried, most tried first.
    pub fn show_unknown(&self) -> Table {
        let now = now_ms();
        let state = self.state.lock();
        let mut names: Vec<_> = state.unknown_names.iter().collect();
        names.sort_by(|a, b| b.1.attempts.cmp(&a.1.attempts).then(a.0.cmp(b.0)));
        Table::new(
            &[
                "name",
                "attempts",
                "last_attempt_ts",
                "last_addr",
                "locked_until",
            ],
            names
                .into_iter()
                .map(|(name, r)| {
                    vec![
                        Some(name.clone()),
                        Some(r.attempts.to_string()),
                        Some(timestamp(r.last_attempt_ts)),
                        r.last_addr.map(|a| a.to_string()),
                        r.lock
                            .until(now)
                            .max(self.shared_lock(&role_key(name), now))
                            .map(timestamp),
                    ]
                })
                .collect(),
        )
    }

    /// SHOW AUTH_MON_ADDRS: client addresses with failures, most first.
    pub fn show_addresses(&self) -> Table {
        let now = now_ms();
        let state = self.state.lock();
        let mut addrs: Vec<_> = state.addresses.iter().collect();
        addrs.sort_by(|a, b| {
            let total = |r: &AddrRow| r.failed_attempts + r.blocked_attempts;
            total(b.1).cmp(&total(a.1)).then(a.0.cmp(b.0))
        });
        Table::new(
            &[
                "addr",
                "failed_attempts",
                "blocked_attempts",
                "last_failed_ts",
                "last_user",
                "locked_until",
            ],
            addrs
                .into_iter()
                .map(|(addr, r)| {
                    vec![
                        Some(addr.to_string()),
                        Some(r.failed_attempts.to_string()),
                        Some(r.blocked_attempts.to_string()),
                        r.last_failed_ts.map(timestamp),
                        Some(r.last_user.clone()),
                        r.lock
                            .until(now)
                            .max(self.shared_lock(&addr_key(*addr), now))
                            .map(timestamp),
                    ]
                })
                .collect(),
        )
    }

    /// The end of a lock engaged through the store (by any instance).
    fn shared_lock(&self, key: &super::auth_store_state::LockKey, now: Millis) -> Option<Millis> {
        self.store.as_ref().and_then(|s| s.lock_until(key, now))
    }

    /// Applies the resets other instances' consoles ran (read from the
    /// store) to this instance's tables.
    fn apply_remote_resets(&self, resets: &[Reset]) {
        let graph = self.roles.snapshot();
        let mut state = self.state.lock();
        for r in resets {
            match r {
                Reset::All => state.clear(),
                Reset::Role { name, uid } => {
                    let oid = graph.oid(name).or((*uid != 0).then_some(*uid));
                    state.reset_role(name, oid);
                }
                Reset::Addr(addr) => {
                    state.reset_address(*addr);
                }
            }
            tracing::info!(reset = ?r, "auth monitor: a reset run on another instance applied");
        }
        self.update_gauges(&state);
        self.dirty.store(true, Ordering::Relaxed);
    }

    /// Starts the store's task (when `auth_monitor.store` is set).
    pub fn spawn_store(self: &Arc<Self>, shutdown: watch::Receiver<bool>) {
        let Some(store) = &self.store else { return };
        let me = Arc::downgrade(self);
        store.spawn(
            shutdown,
            Box::new(move |resets| {
                if let Some(m) = me.upgrade() {
                    m.apply_remote_resets(resets);
                }
            }),
        );
    }

    /// Waits for the store's last flush at shutdown (bounded).
    pub async fn store_stopped(&self) {
        if let Some(store) = &self.store {
            store.stopped().await;
        }
    }

    /// Writes the state file now if anything changed (blocking I/O: call
    /// it from `spawn_blocking` on the runtime).
    pub fn save(&self) -> Result<(), StateFileError> {
        let Some(path) = &self.state_file else {
            return Ok(());
        };
        let _one_at_a_time = self.saving.lock();
        if !self.dirty.swap(false, Ordering::Relaxed) {
            return Ok(());
        }
        if self.corrupt.swap(false, Ordering::Relaxed) {
            let aside = with_suffix(path, ".corrupt");
            if std::fs::rename(path, &aside).is_ok() {
                tracing::warn!(file = %aside.display(), "auth monitor: the corrupt state file was kept aside");
            }
        }
        let saved: Saved = self.state.lock().to_saved();
        let result = serde_json::to_vec_pretty(&saved)
            .map_err(std::io::Error::from)
            .and_then(|json| write_atomically(path, &json));
        let outcome = if result.is_ok() { "ok" } else { "error" };
        metrics::counter!("usher_auth_mon_state_saves_total", "result" => outcome).increment(1);
        if result.is_err() {
            // Try again at the next interval.
            self.dirty.store(true, Ordering::Relaxed);
        }
        result.map_err(|source| StateFileError::Write {
            path: path.clone(),
            source,
        })
    }

    /// Saves off the runtime's worker threads, logging a failure.
    pub async fn save_now(self: &Arc<Self>) {
        let me = self.clone();
        match tokio::task::spawn_blocking(move || me.save()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "auth monitor: could not save the state file"),
            Err(e) => tracing::warn!(error = %e, "auth monitor: saving the state file failed"),
        }
    }

    /// Writes the state file every `save_interval_s` (when something
    /// changed) until shutdown begins; the final write is the server's.
    pub fn spawn_saver(self: &Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        if self.state_file.is_none() {
            return;
        }
        let me = Arc::downgrade(self);
        let interval = self.save_interval;
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(interval) => {}
                    _ = shutdown.wait_for(|s| *s) => return,
                }
                let Some(m) = me.upgrade() else { return };
                m.save_now().await;
            }
        });
    }
}

#[async_trait]
impl Hook for AuthMonitor {
    fn name(&self) -> &str {
        AuthMonitor::NAME
    }

    fn events(&self) -> Vec<Event> {
        vec![Event::AuthAttempt]
    }

    async fn auth_attempt(&self, attempt: &AuthAttempt) -> Result<(), HookError> {
        self.observe(attempt);
        Ok(())
    }
}

/// Reads the state file; a missing, unreadable or corrupt one means
/// starting empty, with a warning. True when the file is corrupt.
fn load(path: &Path, limits: &Limits) -> (State, bool) {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            tracing::warn!(file = %path.display(), "auth monitor: no state file yet; starting with empty counters");
            return (State::default(), false);
        }
        Err(e) => {
            tracing::warn!(file = %path.display(), error = %e, "auth monitor: cannot read the state file; starting with empty counters");
            return (State::default(), false);
        }
    };
    let parsed = serde_json::from_str::<Saved>(&text)
        .map_err(StateFileError::from)
        .and_then(|saved| State::from_saved(saved, limits));
    match parsed {
        Ok(state) => {
            tracing::info!(file = %path.display(), roles = state.roles.len(), "auth monitor: counters restored");
            (state, false)
        }
        Err(e) => {
            tracing::warn!(
                file = %path.display(), error = %e,
                "auth monitor: the state file is corrupt; starting with empty counters (the file is kept as .corrupt at the first write)"
            );
            (State::default(), true)
        }
    }
}

fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(suffix);
    path.with_file_name(name)
}

/// Writes a temporary file next to `path`, flushes it to disk and renames
/// it over `path`: a crash leaves the old file or the new one, never half.
fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = with_suffix(path, ".tmp");
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            // User names and client addresses: for the operator only.
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        // The rename itself is durable once the directory is synced.
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            if let Ok(d) = std::fs::File::open(dir) {
                let _ = d.sync_all();
            }
        }
        Ok(())
    };
    write().inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn monitor(dir: &Path, extra: &str) -> AuthMonitor {
        let yaml = format!(
            "auth_monitor: {{ state_file: {}, {extra} }}\n",
            dir.join("mon.json").display()
        );
        let config = Config::from_yaml(&yaml, "t.yaml").unwrap();
        AuthMonitor::new(
            config.auth_monitor.as_ref().unwrap(),
            Arc::new(RoleCache::default()),
        )
    }

    fn attempt(user: &str, exists: bool, outcome: AuthOutcome) -> AuthAttempt {
        AuthAttempt {
            user: user.into(),
            user_exists: exists,
            database: "app".into(),
            client_addr: crate::client_addr::ClientAddr::Tcp("10.0.0.1:5000".parse().unwrap()),
            method: "scram-sha-256".into(),
            outcome,
        }
    }

    #[test]
    fn counters_survive_a_save_and_a_corrupt_file_is_moved_aside() {
        let dir = tempfile::tempdir().unwrap();
        let m = monitor(dir.path(), "");
        m.observe(&attempt("alice", true, AuthOutcome::Success));
        m.observe(&attempt("alice", true, AuthOutcome::WrongPassword));
        m.observe(&attempt("mallory", false, AuthOutcome::UnknownUser));
        m.save().unwrap();
        assert!(!dir.path().join("mon.json.tmp").exists());
        let again = monitor(dir.path(), "");
        assert_eq!(again.show_roles().rows, m.show_roles().rows);
        assert_eq!(again.show_unknown().rows[0][0].as_deref(), Some("mallory"));

        std::fs::write(dir.path().join("mon.json"), b"{ not json").unwrap();
        let empty = monitor(dir.path(), "");
        assert!(empty.show_roles().rows.is_empty());
        assert!(
            !dir.path().join("mon.json.corrupt").exists(),
            "not moved at load"
        );
        empty.observe(&attempt("bob", true, AuthOutcome::Success));
        empty.save().unwrap();
        assert_eq!(
            std::fs::read(dir.path().join("mon.json.corrupt")).unwrap(),
            b"{ not json"
        );
        assert_eq!(monitor(dir.path(), "").show_roles().rows.len(), 1);
    }

    /// Keeps the key of every metric touched.
    #[derive(Default)]
    struct Keys(Mutex<Vec<metrics::Key>>);

    impl metrics::Recorder for Keys {
        fn describe_counter(
            &self,
            _: metrics::KeyName,
            _: Option<metrics::Unit>,
            _: metrics::SharedString,
        ) {
        }
        fn describe_gauge(
            &self,
            _: metrics::KeyName,
            _: Option<metrics::Unit>,
            _: metrics::SharedString,
        ) {
        }
        fn describe_histogram(
            &self,
            _: metrics::KeyName,
            _: Option<metrics::Unit>,
            _: metrics::SharedString,
        ) {
        }
        fn register_counter(
            &self,
            key: &metrics::Key,
            _: &metrics::Metadata<'_>,
        ) -> metrics::Counter {
            self.0.lock().push(key.clone());
            metrics::Counter::noop()
        }
        fn register_gauge(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
            self.0.lock().push(key.clone());
            metrics::Gauge::noop()
        }
        fn register_histogram(
            &self,
            key: &metrics::Key,
            _: &metrics::Metadata<'_>,
        ) -> metrics::Histogram {
            self.0.lock().push(key.clone());
            metrics::Histogram::noop()
        }
    }

    #[test]
    fn metric_labels_never_carry_user_names_or_addresses() {
        let dir = tempfile::tempdir().unwrap();
        let keys = Keys::default();
        let yaml = format!(
            "auth_monitor: {{ state_file: {}, max_unknown_names: 1, lockout: {{ max_failures: 1, by_role: false }} }}\n",
            dir.path().join("m.json").display()
        );
        let config = Config::from_yaml(&yaml, "t.yaml").unwrap();
        metrics::with_local_recorder(&keys, || {
            let m = AuthMonitor::new(
                config.auth_monitor.as_ref().unwrap(),
                Arc::new(RoleCache::default()),
            );
            for user in ["alice", "mallory-guess-1", "mallory-guess-2"] {
                m.observe(&attempt(user, user == "alice", AuthOutcome::WrongPassword));
                let locked = m.lockout_check(user, "10.0.0.1".parse().unwrap());
                assert!(locked.is_some());
                m.observe(&attempt(user, user == "alice", AuthOutcome::Locked));
                m.blocked(user, user == "alice", "10.0.0.1".parse().unwrap());
            }
            m.save().unwrap();
        });
        let keys = keys.0.lock();
        let names: std::collections::HashSet<&str> = keys.iter().map(|k| k.name()).collect();
        for expected in [
            "usher_auth_mon_attempts_total",
            "usher_auth_mon_blocked_total",
            "usher_auth_mon_lockouts_total",
            "usher_auth_mon_evictions_total",
            "usher_auth_mon_entries",
            "usher_auth_mon_state_saves_total",
        ] {
            assert!(names.contains(expected), "{expected} in {names:?}");
        }
        for key in keys.iter() {
            for label in key.labels() {
                let v = label.value();
                assert!(
                    !v.contains("mallory") && !v.contains("alice") && !v.contains("10.0.0"),
                    "{key:?}"
                );
            }
        }
    }

    #[test]
    fn lockout_errors_say_why_and_until_when() {
        let dir = tempfile::tempdir().unwrap();
        let m = monitor(
            dir.path(),
            "lockout: { max_failures: 2, window_s: 60, duration_s: 30, by_address: false }",
        );
        assert!(m
            .lockout_check("alice", "10.0.0.1".parse().unwrap())
            .is_none());
        m.observe(&attempt("alice", true, AuthOutcome::WrongPassword));
        m.observe(&attempt("alice", true, AuthOutcome::WrongPassword));
        let e = m
            .lockout_check("alice", "10.0.0.2".parse().unwrap())
            .unwrap();
        assert_eq!(e.code, "28000");
        assert_eq!(
            e.message,
            "too many failed login attempts for user \"alice\""
        );
        assert!(e.detail.unwrap().contains("30 s from now"));
        assert!(m
            .lockout_check("bob", "10.0.0.1".parse().unwrap())
            .is_none());
        assert!(m.reset_role("alice"));
        assert!(m
            .lockout_check("alice", "10.0.0.1".parse().unwrap())
            .is_none());
    }
}
