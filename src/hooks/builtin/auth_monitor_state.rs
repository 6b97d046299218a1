//! The auth monitor's tables, as plain data: per-role counters (pg_auth_mon's
//! columns and usher's extras), one aggregate row for unknown user names,
//! the bounded tables of the most-tried unknown names and of client
//! addresses with failures, and the lockout state kept in those rows.
//!
//! No clock, lock or I/O here: callers pass the time, so the tests can too.
//! Every table has a configured bound; a new entry beyond it evicts the
//! least interesting one (least recently tried role, least tried name,
//! address with the fewest failures), never a locked one while others exist.

use crate::client_addr::ClientHost;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::net::IpAddr;

/// Unix time in milliseconds.
pub type Millis = u64;

/// PostgreSQL truncates identifiers to NAMEDATALEN - 1 bytes; usher keeps
/// no longer a name (attackers choose them).
pub const MAX_NAME_BYTES: usize = 63;

/// How long each table may grow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub roles: usize,
    pub unknown_names: usize,
    pub addresses: usize,
}

/// The lockout rule (`auth_monitor.lockout`), in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LockoutPolicy {
    pub max_failures: u32,
    pub window: Millis,
    pub duration: Millis,
    pub by_role: bool,
    pub by_address: bool,
}

/// Failures in the current window and the lock they led to.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lock {
    #[serde(default)]
    pub window_start: Millis,
    #[serde(default)]
    pub failures: u32,
    #[serde(default)]
    pub locked_until: Option<Millis>,
}

impl Lock {
    pub fn locked(&self, now: Millis) -> bool {
        self.locked_until.is_some_and(|t| t > now)
    }

    /// The time the lock ends, while it lasts.
    pub fn until(&self, now: Millis) -> Option<Millis> {
        self.locked_until.filter(|t| *t > now)
    }

    /// Counts a failure; true when it engages the lock. A window opens at
    /// its first failure; failures while locked do not extend the lock.
    fn fail(&mut self, now: Millis, p: &LockoutPolicy) -> bool {
        if self.locked(now) {
            return false;
        }
        if self.failures == 0 || now.saturating_sub(self.window_start) >= p.window {
            self.window_start = now;
            self.failures = 0;
        }
        self.failures += 1;
        if self.failures >= p.max_failures {
            self.failures = 0;
            self.locked_until = Some(now + p.duration);
            return true;
        }
        false
    }
}

/// pg_auth_mon's counters of one role, and usher's extras.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Counters {
    pub successful_attempts: u64,
    pub last_successful_ts: Option<Millis>,
    pub total_hba_conflicts: u64,
    pub other_auth_failures: u64,
    pub last_failed_ts: Option<Millis>,
    pub login_name_at_last_attempt: String,
    /// Refused by the lockout, a blocking rule or a hook.
    pub blocked_attempts: u64,
    pub last_failed_addr: Option<ClientHost>,
    pub last_attempt_ts: Millis,
    pub lock: Lock,
}

/// An unknown user name that was tried.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct NameRow {
    pub attempts: u64,
    pub last_attempt_ts: Millis,
    pub last_addr: Option<ClientHost>,
    pub lock: Lock,
}

/// A client address that failed to log in (or was refused).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct AddrRow {
    pub failed_attempts: u64,
    pub blocked_attempts: u64,
    pub last_failed_ts: Option<Millis>,
    /// The user name of the last refused attempt.
    pub last_user: String,
    pub lock: Lock,
}

/// How a role row is keyed: by oid when usher knows it from the server (so
/// a renamed role keeps its row), else by name.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum RoleKey {
    Oid(u32),
    Name(String),
}

/// What happened, as the tables count it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Success,
    /// Refused by the HBA rules (pg_auth_mon's total_hba_conflicts).
    HbaConflict,
    /// Any other failure; `guess`: a wrong password or unknown user, which
    /// counts towards the lockout.
    Failure {
        guess: bool,
    },
    /// Refused by the lockout, a blocking rule or a hook.
    Blocked,
}

/// One attempt to count.
#[derive(Debug, Clone, Copy)]
pub struct Attempt<'a> {
    /// As the client gave it; empty when the client sent no startup packet.
    pub user: &'a str,
    /// Whether usher (or the server) knows the user.
    pub known: bool,
    pub oid: Option<u32>,
    /// A client of the Unix-domain socket (`Local`) has no address row.
    pub addr: ClientHost,
    pub kind: Kind,
    pub now: Millis,
}

/// A lock an attempt engaged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Engaged {
    Role { user: String, until: Millis },
    Address { addr: IpAddr, until: Millis },
}

/// Which table dropped an entry to make room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Table {
    Roles,
    UnknownNames,
    Addresses,
}

impl Table {
    pub fn as_str(self) -> &'static str {
        match self {
            Table::Roles => "roles",
            Table::UnknownNames => "unknown_names",
            Table::Addresses => "addresses",
        }
    }
}

/// What counting one attempt led to.
#[derive(Debug, Default)]
pub struct Effects {
    pub engaged: Vec<Engaged>,
    pub evicted: Vec<Table>,
}

/// Why a login is refused before its password is checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Locked {
    Role { until: Millis },
    Address { until: Millis },
}

/// Every table of the monitor.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct State {
    pub roles: HashMap<RoleKey, Counters>,
    /// pg_auth_mon's row with an empty rolname: every unknown name summed.
    pub unknown: Counters,
    pub unknown_names: HashMap<String, NameRow>,
    pub addresses: HashMap<IpAddr, AddrRow>,
}

/// Cuts a name to [`MAX_NAME_BYTES`] at a character boundary.
pub fn clip(name: &str) -> &str {
    if name.len() <= MAX_NAME_BYTES {
        return name;
    }
    let mut end = MAX_NAME_BYTES;
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    &name[..end]
}

impl State {
    /// Counts one attempt.
    pub fn record(
        &mut self,
        a: &Attempt<'_>,
        limits: &Limits,
        lockout: Option<&LockoutPolicy>,
    ) -> Effects {
        let mut fx = Effects::default();
        let user = clip(a.user);
        let role_policy = lockout.filter(|p| p.by_role);
        if !user.is_empty() {
            if a.known {
                let row = self.role_row(user, a.oid, limits, &mut fx);
                if count(row, user, a, role_policy) {
                    fx.engaged.push(Engaged::Role {
                        user: user.to_string(),
                        until: row.lock.locked_until.unwrap_or_default(),
                    });
                }
            } else {
                // The aggregate row keeps no lock: locks are per name. Its
                // login_name_at_last_attempt is the last unknown name tried.
                count(&mut self.unknown, user, a, None);
                if let Some(row) = self.name_row(user, a.now, limits, &mut fx) {
                    row.attempts += 1;
                    row.last_attempt_ts = a.now;
                    row.last_addr = Some(a.addr);
                    if let (Kind::Failure { guess: true }, Some(p)) = (a.kind, role_policy) {
                        if row.lock.fail(a.now, p) {
                            fx.engaged.push(Engaged::Role {
                                user: user.to_string(),
                                until: row.lock.locked_until.unwrap_or_default(),
                            });
                        }
                    }
                }
            }
        }
        // Local clients have no address: they are counted by role only.
        if let (true, ClientHost::Ip(ip)) = (a.kind != Kind::Success, a.addr) {
            let row = self.addr_row(ip, a.now, limits, &mut fx);
            row.last_user = user.to_string();
            if a.kind == Kind::Blocked {
                row.blocked_attempts += 1;
            } else {
                row.failed_attempts += 1;
                row.last_failed_ts = Some(a.now);
            }
            if let (Kind::Failure { guess: true }, Some(p)) =
                (a.kind, lockout.filter(|p| p.by_address))
            {
                if row.lock.fail(a.now, p) {
                    fx.engaged.push(Engaged::Address {
                        addr: ip,
                        until: row.lock.locked_until.unwrap_or_default(),
                    });
                }
            }
        }
        fx
    }

    /// Whether a login of `user` from `addr` is locked out now.
    pub fn locked(
        &self,
        user: &str,
        oid: Option<u32>,
        addr: ClientHost,
        now: Millis,
        policy: &LockoutPolicy,
    ) -> Option<Locked> {
        if let (true, ClientHost::Ip(ip)) = (policy.by_address, addr) {
            if let Some(until) = self.addresses.get(&ip).and_then(|r| r.lock.until(now)) {
                return Some(Locked::Address { until });
            }
        }
        if policy.by_role {
            let user = clip(user);
            let by_oid = oid.and_then(|o| self.roles.get(&RoleKey::Oid(o)));
            let until = by_oid
                .or_else(|| self.roles.get(&RoleKey::Name(user.to_string())))
                .and_then(|r| r.lock.until(now))
                .or_else(|| self.unknown_names.get(user).and_then(|r| r.lock.until(now)));
            if let Some(until) = until {
                return Some(Locked::Role { until });
            }
        }
        None
    }

    /// Forgets everything.
    pub fn clear(&mut self) {
        *self = State::default();
    }

    /// Forgets a role (by its current name, its oid, or the name of its last
    /// attempt), or the unknown name: counters and lock. True if anything
    /// was removed.
    pub fn reset_role(&mut self, name: &str, oid: Option<u32>) -> bool {
        let before = self.roles.len() + self.unknown_names.len();
        self.roles.retain(|k, c| match k {
            RoleKey::Oid(o) => Some(*o) != oid && c.login_name_at_last_attempt != name,
            RoleKey::Name(n) => n != name,
        });
        self.unknown_names.remove(clip(name));
        before != self.roles.len() + self.unknown_names.len()
    }

    /// Forgets a client address: counters and lock.
    pub fn reset_address(&mut self, addr: IpAddr) -> bool {
        self.addresses.remove(&addr).is_some()
    }

    /// Drops entries beyond the limits (after loading a state file written
    /// with larger ones): least recently active first.
    pub fn enforce(&mut self, limits: &Limits) {
        fn keep<K: Clone + Eq + std::hash::Hash, V>(
            map: &mut HashMap<K, V>,
            max: usize,
            age: impl Fn(&V) -> Millis,
        ) {
            if map.len() <= max {
                return;
            }
            let mut by_age: Vec<(Millis, K)> =
                map.iter().map(|(k, v)| (age(v), k.clone())).collect();
            by_age.sort_by_key(|(age, _)| std::cmp::Reverse(*age));
            for (_, k) in by_age.into_iter().skip(max) {
                map.remove(&k);
            }
        }
        keep(&mut self.roles, limits.roles, |c| c.last_attempt_ts);
        keep(&mut self.unknown_names, limits.unknown_names, |r| {
            r.last_attempt_ts
        });
        keep(&mut self.addresses, limits.addresses, |r| {
            r.last_failed_ts.unwrap_or_default()
        });
    }

    /// The row of a known role; a row kept by name moves to the oid once
    /// the oid is known. Makes room when the table is full.
    fn role_row(
        &mut self,
        user: &str,
        oid: Option<u32>,
        limits: &Limits,
        fx: &mut Effects,
    ) -> &mut Counters {
        let key = match oid {
            Some(o) => RoleKey::Oid(o),
            None => RoleKey::Name(user.to_string()),
        };
        if oid.is_some() && !self.roles.contains_key(&key) {
            if let Some(by_name) = self.roles.remove(&RoleKey::Name(user.to_string())) {
                self.roles.insert(key.clone(), by_name);
            }
        }
        if !self.roles.contains_key(&key) && self.roles.len() >= limits.roles {
            // The least recently tried role goes.
            if let Some(k) = self
                .roles
                .iter()
                .min_by_key(|(_, c)| c.last_attempt_ts)
                .map(|(k, _)| k.clone())
            {
                self.roles.remove(&k);
                fx.evicted.push(Table::Roles);
            }
        }
        self.roles.entry(key).or_default()
    }

    /// The row of an unknown name. When the table is full, the least tried
    /// name that is not locked goes (if every name is locked, the new name
    /// is not kept: `None`).
    fn name_row(
        &mut self,
        user: &str,
        now: Millis,
        limits: &Limits,
        fx: &mut Effects,
    ) -> Option<&mut NameRow> {
        if !self.unknown_names.contains_key(user)
            && self.unknown_names.len() >= limits.unknown_names
        {
            let victim = self
                .unknown_names
                .iter()
                .filter(|(_, r)| !r.lock.locked(now))
                .min_by_key(|(_, r)| (r.attempts, r.last_attempt_ts))
                .map(|(k, _)| k.clone())?;
            self.unknown_names.remove(&victim);
            fx.evicted.push(Table::UnknownNames);
        }
        Some(self.unknown_names.entry(user.to_string()).or_default())
    }

    /// The row of a client address. When the table is full, the address
    /// with the fewest refusals goes, locked ones last.
    fn addr_row(
        &mut self,
        addr: IpAddr,
        now: Millis,
        limits: &Limits,
        fx: &mut Effects,
    ) -> &mut AddrRow {
        if !self.addresses.contains_key(&addr) && self.addresses.len() >= limits.addresses {
            if let Some(victim) = self
                .addresses
                .iter()
                .min_by_key(|(_, r)| {
                    (
                        r.lock.locked(now),
                        r.failed_attempts + r.blocked_attempts,
                        r.last_failed_ts,
                    )
                })
                .map(|(k, _)| *k)
            {
                self.addresses.remove(&victim);
                fx.evicted.push(Table::Addresses);
            }
        }
        self.addresses.entry(addr).or_default()
    }
}

/// Counts an attempt in a role's (or the aggregate's) counters; true when
/// it engaged the role's lock.
pub fn count(
    c: &mut Counters,
    user: &str,
    a: &Attempt<'_>,
    policy: Option<&LockoutPolicy>,
) -> bool {
    c.login_name_at_last_attempt = user.to_string();
    c.last_attempt_ts = a.now;
    match a.kind {
        Kind::Success => {
            c.successful_attempts += 1;
            c.last_successful_ts = Some(a.now);
            // Only the password's owner can succeed: the guessing count starts over.
            c.lock.failures = 0;
            false
        }
        Kind::HbaConflict => {
            c.total_hba_conflicts += 1;
            c.last_failed_ts = Some(a.now);
            c.last_failed_addr = Some(a.addr);
            false
        }
        Kind::Failure { guess } => {
            c.other_auth_failures += 1;
            c.last_failed_ts = Some(a.now);
            c.last_failed_addr = Some(a.addr);
            guess && policy.is_some_and(|p| c.lock.fail(a.now, p))
        }
        Kind::Blocked => {
            c.blocked_attempts += 1;
            false
        }
    }
}

/// The state file's shape (version 1). Tables are lists: JSON objects
/// cannot have oids or addresses as keys.
#[derive(Debug, Serialize, Deserialize)]
pub struct Saved {
    pub version: u32,
    #[serde(default)]
    pub roles: Vec<SavedRole>,
    #[serde(default)]
    pub unknown: Counters,
    #[serde(default)]
    pub unknown_names: Vec<SavedName>,
    #[serde(default)]
    pub addresses: Vec<SavedAddr>,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct SavedRole {
    /// The role's oid, when known; else `name` keys the row.
    pub oid: Option<u32>,
    pub name: Option<String>,
    #[serde(flatten)]
    pub counters: Counters,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct SavedName {
    pub name: String,
    #[serde(flatten)]
    pub row: NameRow,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct SavedAddr {
    pub addr: IpAddr,
    #[serde(flatten)]
    pub row: AddrRow,
}

pub const STATE_VERSION: u32 = 1;

/// Why the state file could not be read back or written.
#[derive(Debug, thiserror::Error)]
pub enum StateFileError {
    #[error("unsupported state file version {found} (expected {STATE_VERSION})")]
    Version { found: u32 },
    #[error("a role row has neither oid nor name")]
    RoleWithoutKey,
    /// Not JSON of the expected shape.
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    #[error("cannot write {}: {source}", path.display())]
    Write {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}

impl State {
    pub fn to_saved(&self) -> Saved {
        Saved {
            version: STATE_VERSION,
            roles: self
                .roles
                .iter()
                .map(|(k, c)| SavedRole {
                    oid: match k {
                        RoleKey::Oid(o) => Some(*o),
                        RoleKey::Name(_) => None,
                    },
                    name: match k {
                        RoleKey::Oid(_) => None,
                        RoleKey::Name(n) => Some(n.clone()),
                    },
                    counters: c.clone(),
                })
                .collect(),
            unknown: self.unknown.clone(),
            unknown_names: self
                .unknown_names
                .iter()
                .map(|(name, row)| SavedName {
                    name: name.clone(),
                    row: row.clone(),
                })
                .collect(),
            addresses: self
                .addresses
                .iter()
                .map(|(addr, row)| SavedAddr {
                    addr: *addr,
                    row: row.clone(),
                })
                .collect(),
        }
    }

    /// The state a file holds, within `limits`.
    pub fn from_saved(saved: Saved, limits: &Limits) -> Result<State, StateFileError> {
        if saved.version != STATE_VERSION {
            return Err(StateFileError::Version {
                found: saved.version,
            });
        }
        let mut state = State {
            unknown: saved.unknown,
            ..State::default()
        };
        for r in saved.roles {
            let key = match (r.oid, r.name) {
                (Some(o), _) => RoleKey::Oid(o),
                (None, Some(n)) => RoleKey::Name(clip(&n).to_string()),
                (None, None) => return Err(StateFileError::RoleWithoutKey),
            };
            state.roles.insert(key, r.counters);
        }
        for n in saved.unknown_names {
            state.unknown_names.insert(clip(&n.name).to_string(), n.row);
        }
        for a in saved.addresses {
            state.addresses.insert(a.addr, a.row);
        }
        state.enforce(limits);
        Ok(state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        roles: 3,
        unknown_names: 2,
        addresses: 2,
    };
    const POLICY: LockoutPolicy = LockoutPolicy {
        max_failures: 3,
        window: 1000,
        duration: 5000,
        by_role: true,
        by_address: true,
    };

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn attempt(user: &str, known: bool, addr: &str, kind: Kind, now: Millis) -> Attempt<'static> {
        Attempt {
            user: Box::leak(user.to_string().into_boxed_str()),
            known,
            oid: None,
            addr: ip(addr).into(),
            kind,
            now,
        }
    }

    const WRONG: Kind = Kind::Failure { guess: true };

    #[test]
    fn counts_like_pg_auth_mon() {
        let mut s = State::default();
        for (user, known, kind, t) in [
            ("alice", true, Kind::Success, 10),
            ("alice", true, WRONG, 20),
            ("alice", true, Kind::HbaConflict, 30),
            ("alice", true, Kind::Blocked, 40),
            ("ghost", false, WRONG, 50),
            ("ghost", false, WRONG, 60),
            ("phantom", false, WRONG, 70),
        ] {
            s.record(&attempt(user, known, "10.0.0.1", kind, t), &LIMITS, None);
        }
        let a = &s.roles[&RoleKey::Name("alice".into())];
        assert_eq!(
            (
                a.successful_attempts,
                a.last_successful_ts,
                a.total_hba_conflicts,
                a.other_auth_failures,
                a.last_failed_ts,
                a.blocked_attempts
            ),
            (1, Some(10), 1, 1, Some(30), 1)
        );
        assert_eq!(s.unknown.other_auth_failures, 3);
        assert_eq!(s.unknown_names["ghost"].attempts, 2);
        let addr = &s.addresses[&ip("10.0.0.1")];
        assert_eq!((addr.failed_attempts, addr.blocked_attempts), (5, 1));
        assert_eq!(addr.last_user, "phantom");
    }

    #[test]
    fn a_local_client_is_counted_by_role_and_never_locks_an_address() {
        let mut s = State::default();
        let local = |user, known, kind, now| Attempt {
            addr: ClientHost::Local,
            ..attempt(user, known, "10.0.0.1", kind, now)
        };
        for t in 0..5 {
            s.record(&local("alice", true, WRONG, t), &LIMITS, Some(&POLICY));
        }
        s.record(&local("ghost", false, WRONG, 6), &LIMITS, Some(&POLICY));
        assert!(s.addresses.is_empty(), "{:?}", s.addresses);
        let a = &s.roles[&RoleKey::Name("alice".into())];
        assert_eq!(a.last_failed_addr, Some(ClientHost::Local));
        assert_eq!(s.unknown_names["ghost"].last_addr, Some(ClientHost::Local));
        assert!(matches!(
            s.locked("alice", None, ClientHost::Local, 10, &POLICY),
            Some(Locked::Role { .. })
        ));
        assert_eq!(
            s.locked("carol", None, ClientHost::Local, 10, &POLICY),
            None
        );
    }

    #[test]
    fn a_role_row_follows_its_oid_across_a_rename() {
        let mut s = State::default();
        s.record(
            &attempt("carol", true, "10.0.0.1", Kind::Success, 1),
            &LIMITS,
            None,
        );
        let mut a = attempt("carol", true, "10.0.0.1", Kind::Success, 2);
        a.oid = Some(42);
        s.record(&a, &LIMITS, None);
        let mut a = attempt("caroline", true, "10.0.0.1", Kind::Success, 3);
        a.oid = Some(42);
        s.record(&a, &LIMITS, None);
        assert_eq!(s.roles.len(), 1);
        let row = &s.roles[&RoleKey::Oid(42)];
        assert_eq!(row.successful_attempts, 3);
        assert_eq!(row.login_name_at_last_attempt, "caroline");
    }

    #[test]
    fn every_table_stays_within_its_bound() {
        let mut s = State::default();
        // "hot" is tried often; a stream of one-off names must not push it out.
        for t in 0..5 {
            s.record(&attempt("hot", false, "10.0.0.9", WRONG, t), &LIMITS, None);
        }
        for i in 0..1000u64 {
            let addr = format!("10.1.{}.{}", i / 256, i % 256);
            let fx = s.record(
                &attempt(&format!("user{i}"), i % 2 == 0, &addr, WRONG, 100 + i),
                &LIMITS,
                None,
            );
            assert!(fx.evicted.len() <= 2);
            assert!(s.roles.len() <= LIMITS.roles);
            assert!(s.unknown_names.len() <= LIMITS.unknown_names);
            assert!(s.addresses.len() <= LIMITS.addresses);
        }
        assert!(
            s.unknown_names.contains_key("hot"),
            "the most tried name stays"
        );
        assert!(s.addresses.contains_key(&ip("10.0.0.9")), "and its address");
        assert_eq!(s.unknown.other_auth_failures, 505, "the sum keeps counting");
        // Names are clipped to what PostgreSQL would keep.
        let long = "x".repeat(500);
        s.record(
            &attempt(&long, false, "10.0.0.9", WRONG, 5000),
            &LIMITS,
            None,
        );
        assert!(s.unknown_names.keys().all(|k| k.len() <= MAX_NAME_BYTES));
        assert_eq!(clip("ééééééééééééééééééééééééééééééééé").len(), 62);
    }

    #[test]
    fn lockout_engages_within_the_window_and_expires() {
        let mut s = State::default();
        let p = Some(&POLICY);
        // Two failures, then the window passes: no lock.
        s.record(&attempt("alice", true, "10.0.0.1", WRONG, 0), &LIMITS, p);
        s.record(&attempt("alice", true, "10.0.0.2", WRONG, 500), &LIMITS, p);
        s.record(&attempt("alice", true, "10.0.0.3", WRONG, 1500), &LIMITS, p);
        assert_eq!(
            s.locked("alice", None, ip("10.0.0.4").into(), 1600, &POLICY),
            None
        );
        s.record(&attempt("alice", true, "10.0.0.3", WRONG, 1700), &LIMITS, p);
        let fx = s.record(&attempt("alice", true, "10.0.0.3", WRONG, 1800), &LIMITS, p);
        assert_eq!(
            fx.engaged,
            vec![
                Engaged::Role {
                    user: "alice".into(),
                    until: 6800
                },
                Engaged::Address {
                    addr: ip("10.0.0.3"),
                    until: 6800
                }
            ]
        );
        assert_eq!(
            s.locked("alice", None, ip("10.9.9.9").into(), 2000, &POLICY),
            Some(Locked::Role { until: 6800 })
        );
        assert_eq!(
            s.locked("bob", None, ip("10.0.0.3").into(), 2000, &POLICY),
            Some(Locked::Address { until: 6800 })
        );
        // Blocked attempts while locked do not extend it.
        s.record(
            &attempt("alice", true, "10.0.0.3", Kind::Blocked, 3000),
            &LIMITS,
            p,
        );
        assert_eq!(
            s.locked("alice", None, ip("10.9.9.9").into(), 6800, &POLICY),
            None
        );
        // A success starts the count over.
        s.record(&attempt("bob", true, "10.0.0.5", WRONG, 7000), &LIMITS, p);
        s.record(&attempt("bob", true, "10.0.0.5", WRONG, 7001), &LIMITS, p);
        s.record(
            &attempt("bob", true, "10.0.0.6", Kind::Success, 7002),
            &LIMITS,
            p,
        );
        s.record(&attempt("bob", true, "10.0.0.7", WRONG, 7003), &LIMITS, p);
        assert_eq!(
            s.locked("bob", None, ip("10.9.9.9").into(), 7004, &POLICY),
            None
        );
    }

    #[test]
    fn unknown_names_lock_like_known_ones() {
        // Otherwise the lockout would tell which roles exist.
        let mut s = State::default();
        let p = LockoutPolicy {
            by_address: false,
            ..POLICY
        };
        for t in 0..3 {
            s.record(
                &attempt("ghost", false, "10.0.0.1", WRONG, t),
                &LIMITS,
                Some(&p),
            );
        }
        assert_eq!(
            s.locked("ghost", None, ip("10.0.0.1").into(), 10, &p),
            Some(Locked::Role { until: 5002 })
        );
        assert_eq!(s.locked("other", None, ip("10.0.0.1").into(), 10, &p), None);
    }

    #[test]
    fn reset_and_the_state_file_round_trip() {
        let mut s = State::default();
        let mut a = attempt("alice", true, "10.0.0.1", WRONG, 1);
        a.oid = Some(7);
        s.record(&a, &LIMITS, Some(&POLICY));
        s.record(&attempt("bob", true, "10.0.0.2", WRONG, 2), &LIMITS, None);
        s.record(
            &attempt("ghost", false, "10.0.0.2", WRONG, 3),
            &LIMITS,
            None,
        );
        let json = serde_json::to_string(&s.to_saved()).unwrap();
        let back = State::from_saved(serde_json::from_str(&json).unwrap(), &LIMITS).unwrap();
        assert_eq!(back, s);
        let small = Limits {
            roles: 1,
            unknown_names: 1,
            addresses: 1,
        };
        let cut = State::from_saved(serde_json::from_str(&json).unwrap(), &small).unwrap();
        assert_eq!(cut.roles.len(), 1);
        assert!(
            cut.roles.contains_key(&RoleKey::Name("bob".into())),
            "the latest stays"
        );
        assert!(
            State::from_saved(serde_json::from_str(r#"{"version": 99}"#).unwrap(), &LIMITS)
                .is_err()
        );

        assert!(s.reset_role("alice", Some(7)));
        assert!(s.reset_role("ghost", None));
        assert!(!s.reset_role("nobody", None));
        assert!(s.reset_address(ip("10.0.0.2")));
        assert_eq!(s.roles.len(), 1);
        assert!(s.unknown_names.is_empty());
        s.clear();
        assert_eq!(s, State::default());
    }
}
