//! The shared store's data, as plain data (no clock, lock or I/O, as
//! [`super::auth_monitor_state`]): what one instance has counted and not yet
//! written ([`Batch`], merged in place so a burst of logins is one row per
//! key), its own recent failures for the lockout's window ([`Recent`]), and
//! what it last read of the cluster ([`View`]).
//!
//! Failures are counted in time slices ([`slice`]): a row per (scope, key,
//! instance, slice) in the store, so any instance can sum the failures of
//! the last `window_s` over every instance, and old slices can be pruned.

use super::auth_monitor_state::{clip, Counters, Millis};
use std::collections::{HashMap, HashSet};
use std::net::IpAddr;

/// What a lock or a failure count is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Scope {
    /// A user name as clients give it (known or not).
    Role,
    /// A client address.
    Addr,
}

impl Scope {
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Role => "role",
            Scope::Addr => "addr",
        }
    }

    pub fn parse(s: &str) -> Option<Scope> {
        match s {
            "role" => Some(Scope::Role),
            "addr" => Some(Scope::Addr),
            _ => None,
        }
    }
}

/// A lock's or a failure count's key: the scope and the clipped user name
/// or the address as text.
pub type LockKey = (Scope, String);

/// The key of a user name.
pub fn role_key(user: &str) -> LockKey {
    (Scope::Role, clip(user).to_string())
}

/// The key of a client address (canonical: IPv4-mapped IPv6 as IPv4).
pub fn addr_key(addr: IpAddr) -> LockKey {
    (Scope::Addr, addr.to_canonical().to_string())
}

/// The row of pg_auth_mon's counters in the store: by the role's oid when
/// the instance knows it (`name` empty), else by name (`uid` 0); `(0, "")`
/// is the row of every unknown user name summed.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RowKey {
    pub uid: u32,
    pub name: String,
}

impl RowKey {
    pub fn unknown() -> RowKey {
        RowKey {
            uid: 0,
            name: String::new(),
        }
    }

    pub fn is_unknown(&self) -> bool {
        self.uid == 0 && self.name.is_empty()
    }
}

/// A reset from the console, written to the store so every instance
/// applies it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reset {
    All,
    /// A role (by name, and its oid when known) or an unknown name.
    Role {
        name: String,
        uid: u32,
    },
    Addr(IpAddr),
}

impl Reset {
    /// Whether a row of the counters goes with this reset (as
    /// `State::reset_role` decides for the local tables).
    pub fn covers_row(&self, key: &RowKey, c: &Counters) -> bool {
        match self {
            Reset::All => true,
            Reset::Role { name, uid } => {
                if key.uid == 0 {
                    !key.name.is_empty() && key.name == *name
                } else {
                    key.uid == *uid || c.login_name_at_last_attempt == *name
                }
            }
            Reset::Addr(_) => false,
        }
    }

    /// Whether a lock or failure count goes with this reset.
    pub fn covers_key(&self, key: &LockKey) -> bool {
        match self {
            Reset::All => true,
            Reset::Role { name, .. } => key.0 == Scope::Role && key.1 == clip(name),
            Reset::Addr(a) => *key == addr_key(*a),
        }
    }
}

/// Adds `newer`'s counts to `into`: counters add up, timestamps keep the
/// latest, the name and address of the latest attempt win.
pub fn merge_counters(into: &mut Counters, newer: &Counters) {
    into.successful_attempts += newer.successful_attempts;
    into.total_hba_conflicts += newer.total_hba_conflicts;
    into.other_auth_failures += newer.other_auth_failures;
    into.blocked_attempts += newer.blocked_attempts;
    into.last_successful_ts = into.last_successful_ts.max(newer.last_successful_ts);
    if newer.last_failed_ts.is_some() && newer.last_failed_ts >= into.last_failed_ts {
        into.last_failed_ts = newer.last_failed_ts;
        if newer.last_failed_addr.is_some() {
            into.last_failed_addr = newer.last_failed_addr;
        }
    }
    if newer.last_attempt_ts >= into.last_attempt_ts {
        into.last_attempt_ts = newer.last_attempt_ts;
        into.login_name_at_last_attempt = newer.login_name_at_last_attempt.clone();
    }
}

/// The width of a failure slice for a lockout window: a twentieth of it,
/// at least a second.
pub fn slice(window: Millis) -> Millis {
    (window / 20).max(1000)
}

/// The slice `now` falls in (its start).
pub fn bucket(now: Millis, slice: Millis) -> Millis {
    now - now % slice
}

/// Sums the counts of slices that overlap the window ending at `now`.
pub fn in_window(slices: &[(Millis, u32)], now: Millis, window: Millis, slice: Millis) -> u32 {
    let start = now.saturating_sub(window);
    slices
        .iter()
        .filter(|(b, _)| b + slice > start)
        .map(|(_, n)| *n)
        .sum()
}

/// What one instance counted and has not written yet, in the order the
/// store must apply it: resets, then the failure counts cleared by a
/// success, then the additions. Every map holds one entry per key.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Batch {
    pub resets: Vec<Reset>,
    /// Role names whose failure counts a successful login cleared.
    pub cleared: HashSet<String>,
    pub roles: HashMap<RowKey, Counters>,
    /// Failures per (scope, key, slice start).
    pub failures: HashMap<(Scope, String, Millis), u32>,
    /// Locks engaged: the latest end per key.
    pub locks: HashMap<LockKey, Millis>,
    /// Counts not kept because the batch was full.
    pub dropped: u64,
}

impl Batch {
    pub fn is_empty(&self) -> bool {
        self.resets.is_empty()
            && self.cleared.is_empty()
            && self.roles.is_empty()
            && self.failures.is_empty()
            && self.locks.is_empty()
    }

    /// Keys held (the bound `max_pending` applies to).
    pub fn len(&self) -> usize {
        self.cleared.len() + self.roles.len() + self.failures.len() + self.locks.len()
    }

    /// Adds one attempt's counters to its row. False when the batch is full
    /// and the row is new (the count is dropped).
    pub fn add_row(&mut self, key: RowKey, delta: &Counters, max: usize) -> bool {
        if let Some(c) = self.roles.get_mut(&key) {
            merge_counters(c, delta);
            return true;
        }
        if !self.room(max) {
            return false;
        }
        self.roles.insert(key, delta.clone());
        true
    }

    /// Counts `n` failures of `key` in the slice starting at `bucket`.
    pub fn add_failure(&mut self, key: &LockKey, bucket: Millis, n: u32, max: usize) -> bool {
        let k = (key.0, key.1.clone(), bucket);
        if let Some(v) = self.failures.get_mut(&k) {
            *v += n;
            return true;
        }
        if !self.room(max) {
            return false;
        }
        self.failures.insert(k, n);
        true
    }

    /// A successful login of `name`: the failures counted for it so far
    /// (here and, once written, in the store) start over.
    pub fn clear_failures(&mut self, name: &str, max: usize) -> bool {
        let name = clip(name);
        self.failures
            .retain(|(s, k, _), _| !(*s == Scope::Role && k == name));
        if self.cleared.contains(name) {
            return true;
        }
        if !self.room(max) {
            return false;
        }
        self.cleared.insert(name.to_string());
        true
    }

    /// A lock engaged until `until`.
    pub fn add_lock(&mut self, key: &LockKey, until: Millis, max: usize) -> bool {
        if let Some(u) = self.locks.get_mut(key) {
            *u = (*u).max(until);
            return true;
        }
        if !self.room(max) {
            return false;
        }
        self.locks.insert(key.clone(), until);
        true
    }

    /// A reset: what it covers and was counted before it goes, and the
    /// reset itself is written first. Never dropped.
    pub fn add_reset(&mut self, reset: Reset) {
        self.forget(&reset);
        if reset == Reset::All {
            self.resets.clear();
        }
        self.resets.push(reset);
    }

    /// Drops what `reset` covers (a reset another instance ran and wrote:
    /// what was counted here before it must not come back).
    pub fn forget(&mut self, reset: &Reset) {
        if *reset == Reset::All {
            *self = Batch {
                resets: std::mem::take(&mut self.resets),
                dropped: self.dropped,
                ..Batch::default()
            };
            return;
        }
        self.roles.retain(|k, c| !reset.covers_row(k, c));
        self.failures
            .retain(|(s, k, _), _| !reset.covers_key(&(*s, k.clone())));
        self.locks.retain(|k, _| !reset.covers_key(k));
        if let Reset::Role { name, .. } = reset {
            self.cleared.remove(clip(name));
        }
    }

    /// Adds what was counted after this batch (a flush that failed gives
    /// its batch back, and what came meanwhile goes after it): `newer`'s
    /// resets and clears apply to this batch's counts, then its counts add.
    /// Bounded like any addition; what does not fit is dropped.
    pub fn merge(&mut self, newer: Batch, max: usize) {
        self.dropped += newer.dropped;
        for r in newer.resets {
            self.add_reset(r);
        }
        // What does not fit is counted in `dropped` (by `room`). In key
        // order, so what is dropped does not depend on hashing.
        let mut cleared: Vec<_> = newer.cleared.into_iter().collect();
        cleared.sort();
        for name in cleared {
            self.clear_failures(&name, max);
        }
        let mut rows: Vec<_> = newer.roles.into_iter().collect();
        rows.sort_by(|a, b| a.0.cmp(&b.0));
        for (k, c) in rows {
            self.add_row(k, &c, max);
        }
        let mut failures: Vec<_> = newer.failures.into_iter().collect();
        failures.sort();
        for ((s, k, b), n) in failures {
            self.add_failure(&(s, k), b, n, max);
        }
        let mut locks: Vec<_> = newer.locks.into_iter().collect();
        locks.sort();
        for (k, u) in locks {
            self.add_lock(&k, u, max);
        }
    }

    fn room(&mut self, max: usize) -> bool {
        if self.len() < max {
            return true;
        }
        self.dropped += 1;
        false
    }
}

/// This instance's own failures of the last window, per key (the store's
/// reads leave this instance's rows out: these are exact and current).
#[derive(Debug, Default, Clone)]
pub struct Recent {
    map: HashMap<LockKey, Vec<(Millis, u32)>>,
}

impl Recent {
    /// Counts a failure of `key` in the slice `bucket`. False when `max`
    /// keys are tracked already (after dropping the expired ones).
    pub fn add(&mut self, key: &LockKey, bucket: Millis, max: usize, oldest: Millis) -> bool {
        if !self.map.contains_key(key) && self.map.len() >= max {
            self.prune(oldest);
            if self.map.len() >= max {
                return false;
            }
        }
        let slices = self.map.entry(key.clone()).or_default();
        match slices.last_mut() {
            Some((b, n)) if *b == bucket => *n += 1,
            _ => slices.push((bucket, 1)),
        }
        true
    }

    pub fn get(&self, key: &LockKey) -> &[(Millis, u32)] {
        self.map.get(key).map_or(&[], |v| v.as_slice())
    }

    pub fn clear(&mut self, key: &LockKey) {
        self.map.remove(key);
    }

    pub fn reset(&mut self, reset: &Reset) {
        self.map.retain(|k, _| !reset.covers_key(k));
    }

    /// Drops slices that start before `oldest`.
    pub fn prune(&mut self, oldest: Millis) {
        self.map.retain(|_, slices| {
            slices.retain(|(b, _)| *b >= oldest);
            !slices.is_empty()
        });
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

/// What an instance last read from the store.
#[derive(Debug, Default, Clone)]
pub struct View {
    /// pg_auth_mon's counters of every instance, summed.
    pub roles: HashMap<RowKey, Counters>,
    /// The other instances' failures in the window, per key and slice.
    pub others: HashMap<LockKey, Vec<(Millis, u32)>>,
    /// Locks in force, by any instance.
    pub locks: HashMap<LockKey, Millis>,
}

impl View {
    /// The view without what `reset` covers (applied at once on the
    /// instance that ran it; the others read the store again).
    pub fn without(&self, reset: &Reset) -> View {
        View {
            roles: self
                .roles
                .iter()
                .filter(|(k, c)| !reset.covers_row(k, c))
                .map(|(k, c)| (k.clone(), c.clone()))
                .collect(),
            others: self
                .others
                .iter()
                .filter(|(k, _)| !reset.covers_key(k))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            locks: self
                .locks
                .iter()
                .filter(|(k, _)| !reset.covers_key(k))
                .map(|(k, v)| (k.clone(), *v))
                .collect(),
        }
    }

    /// The cluster's counters: the store's rows plus what this instance
    /// counted since it read them (`overlay`).
    pub fn with_overlay(&self, overlay: &HashMap<RowKey, Counters>) -> HashMap<RowKey, Counters> {
        let mut rows = self.roles.clone();
        for (k, c) in overlay {
            merge_counters(rows.entry(k.clone()).or_default(), c);
        }
        rows
    }
}

/// A lock's end, if it is still in force at `now`.
pub fn lock_until(locks: &HashMap<LockKey, Millis>, key: &LockKey, now: Millis) -> Option<Millis> {
    locks.get(key).copied().filter(|u| *u > now)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delta(ok: u64, fail: u64, at: Millis, name: &str) -> Counters {
        Counters {
            successful_attempts: ok,
            last_successful_ts: (ok > 0).then_some(at),
            other_auth_failures: fail,
            last_failed_ts: (fail > 0).then_some(at),
            last_failed_addr: (fail > 0).then(|| format!("10.0.0.{}", at % 250).parse().unwrap()),
            login_name_at_last_attempt: name.into(),
            last_attempt_ts: at,
            ..Counters::default()
        }
    }

    fn by_name(n: &str) -> RowKey {
        RowKey {
            uid: 0,
            name: n.into(),
        }
    }

    #[test]
    fn counters_merge_as_pg_auth_mon_would_count_them_together() {
        let mut a = delta(1, 2, 100, "alice");
        merge_counters(&mut a, &delta(0, 1, 300, "Alice"));
        merge_counters(&mut a, &delta(3, 0, 200, "ALICE"));
        assert_eq!(a.successful_attempts, 4);
        assert_eq!(a.other_auth_failures, 3);
        assert_eq!(a.last_successful_ts, Some(200));
        assert_eq!(a.last_failed_ts, Some(300));
        assert_eq!(a.last_failed_addr, Some("10.0.0.50".parse().unwrap()));
        // The latest attempt names the row, whatever order they merge in.
        assert_eq!(a.login_name_at_last_attempt, "Alice");
        assert_eq!(a.last_attempt_ts, 300);
        // A NULL timestamp never wins.
        let mut b = delta(0, 1, 100, "b");
        merge_counters(&mut b, &delta(1, 0, 50, "b"));
        assert_eq!(
            (b.last_failed_ts, b.last_successful_ts),
            (Some(100), Some(50))
        );
    }

    #[test]
    fn a_batch_keeps_one_entry_per_key_and_stays_bounded() {
        let mut b = Batch::default();
        for i in 0..100 {
            assert!(b.add_row(by_name("alice"), &delta(0, 1, i, "alice"), 3));
            assert!(b.add_failure(&role_key("alice"), 1000 * (i / 50), 1, 3));
        }
        assert_eq!(b.roles.len(), 1);
        assert_eq!(b.roles[&by_name("alice")].other_auth_failures, 100);
        assert_eq!(b.failures.len(), 2, "two slices");
        assert_eq!(b.len(), 3);
        // Full: new keys are dropped and counted, known ones still add.
        assert!(!b.add_row(by_name("bob"), &delta(1, 0, 5, "bob"), 3));
        assert!(!b.add_lock(&role_key("alice"), 9, 3));
        assert!(b.add_row(by_name("alice"), &delta(1, 0, 200, "alice"), 3));
        assert_eq!(b.dropped, 2);
        assert_eq!(b.len(), 3);
    }

    #[test]
    fn a_success_clears_the_failures_counted_before_it() {
        let mut b = Batch::default();
        let alice = role_key("alice");
        b.add_failure(&alice, 0, 2, 100);
        b.add_failure(&addr_key("10.0.0.1".parse().unwrap()), 0, 2, 100);
        b.clear_failures("alice", 100);
        assert_eq!(b.failures.len(), 1, "the address keeps its count");
        b.add_failure(&alice, 1000, 1, 100);
        assert!(b.cleared.contains("alice"));
        assert_eq!(b.failures[&(Scope::Role, "alice".into(), 1000)], 1);
    }

    #[test]
    fn resets_remove_what_they_cover_and_go_first() {
        let mut b = Batch::default();
        let max = 100;
        b.add_row(by_name("alice"), &delta(1, 1, 1, "alice"), max);
        b.add_row(
            RowKey {
                uid: 42,
                name: String::new(),
            },
            &delta(1, 0, 1, "carol"),
            max,
        );
        b.add_row(by_name("bob"), &delta(1, 0, 1, "bob"), max);
        b.add_failure(&role_key("alice"), 0, 1, max);
        b.add_failure(&addr_key("10.0.0.1".parse().unwrap()), 0, 1, max);
        b.add_lock(&role_key("alice"), 50, max);
        b.add_reset(Reset::Role {
            name: "alice".into(),
            uid: 0,
        });
        b.add_reset(Reset::Role {
            name: "carol".into(),
            uid: 0,
        });
        assert_eq!(b.roles.keys().collect::<Vec<_>>(), [&by_name("bob")]);
        assert_eq!(b.failures.len(), 1);
        assert!(b.locks.is_empty());
        b.add_reset(Reset::Addr("10.0.0.1".parse().unwrap()));
        assert!(b.failures.is_empty());
        assert_eq!(b.resets.len(), 3);
        b.add_reset(Reset::All);
        assert_eq!(b.resets, [Reset::All]);
        assert!(b.roles.is_empty());
    }

    #[test]
    fn a_failed_flush_gives_its_batch_back_before_what_came_meanwhile() {
        let max = 100;
        let mut old = Batch::default();
        old.add_row(by_name("alice"), &delta(0, 2, 10, "alice"), max);
        old.add_failure(&role_key("alice"), 0, 2, max);
        old.add_row(by_name("bob"), &delta(0, 1, 10, "bob"), max);
        old.add_failure(&role_key("bob"), 0, 1, max);
        let mut newer = Batch::default();
        // alice logged in since: her failures start over; bob was reset.
        newer.add_row(by_name("alice"), &delta(1, 0, 20, "alice"), max);
        newer.clear_failures("alice", max);
        newer.add_reset(Reset::Role {
            name: "bob".into(),
            uid: 0,
        });
        newer.add_row(by_name("bob"), &delta(0, 1, 30, "bob"), max);
        newer.dropped = 1;
        old.merge(newer, max);
        let alice = &old.roles[&by_name("alice")];
        assert_eq!(
            (alice.successful_attempts, alice.other_auth_failures),
            (1, 2)
        );
        assert_eq!(
            old.roles[&by_name("bob")].other_auth_failures,
            1,
            "after the reset"
        );
        assert!(old.failures.is_empty());
        assert!(old.cleared.contains("alice"));
        assert_eq!(old.resets.len(), 1);
        assert_eq!(old.dropped, 1);

        // Merging into a full batch drops what does not fit, and counts it.
        let mut full = Batch::default();
        full.add_row(by_name("x"), &delta(1, 0, 1, "x"), 1);
        let mut more = Batch::default();
        more.add_row(by_name("y"), &delta(1, 0, 1, "y"), 10);
        more.add_row(by_name("x"), &delta(1, 0, 2, "x"), 10);
        full.merge(more, 1);
        assert_eq!(full.roles.len(), 1);
        assert_eq!(full.roles[&by_name("x")].successful_attempts, 2);
        assert_eq!(full.dropped, 1);
    }

    #[test]
    fn the_window_counts_the_slices_it_overlaps() {
        let window = 60_000;
        let s = slice(window);
        assert_eq!(s, 3000);
        assert_eq!(slice(5000), 1000, "at least a second");
        assert_eq!(bucket(10_500, 1000), 10_000);
        let slices = [(0, 1), (57_000, 2), (60_000, 3), (99_000, 4)];
        // Window (40 s, 100 s]: the slice at 0 is out, 57 s overlaps.
        assert_eq!(in_window(&slices, 100_000, window, s), 9);
        // A slice ahead of this clock (another instance's) counts too.
        assert_eq!(in_window(&slices, 60_000, window, s), 10);
        assert_eq!(in_window(&[], 60_000, window, s), 0);
    }

    #[test]
    fn recent_failures_stay_bounded_and_expire() {
        let mut r = Recent::default();
        let a = role_key("a");
        assert!(r.add(&a, 0, 2, 0));
        assert!(r.add(&a, 0, 2, 0));
        assert!(r.add(&a, 1000, 2, 0));
        assert_eq!(r.get(&a), [(0, 2), (1000, 1)]);
        assert!(r.add(&role_key("b"), 1000, 2, 0));
        assert!(!r.add(&role_key("c"), 1000, 2, 0), "full");
        // Room is made from expired keys.
        assert!(r.add(&role_key("c"), 5000, 2, 2000));
        assert_eq!(r.get(&a), &[] as &[(Millis, u32)]);
        r.reset(&Reset::All);
        assert!(r.is_empty());
    }

    #[test]
    fn the_view_adds_what_was_counted_since_it_was_read() {
        let mut v = View::default();
        v.roles.insert(by_name("alice"), delta(1, 2, 10, "alice"));
        v.locks.insert(role_key("alice"), 500);
        v.locks.insert(addr_key("10.0.0.1".parse().unwrap()), 500);
        let mut overlay = HashMap::new();
        overlay.insert(by_name("alice"), delta(0, 1, 20, "alice"));
        overlay.insert(RowKey::unknown(), delta(0, 1, 20, "ghost"));
        let rows = v.with_overlay(&overlay);
        assert_eq!(rows[&by_name("alice")].other_auth_failures, 3);
        assert_eq!(rows[&RowKey::unknown()].login_name_at_last_attempt, "ghost");
        assert_eq!(lock_until(&v.locks, &role_key("alice"), 400), Some(500));
        assert_eq!(lock_until(&v.locks, &role_key("alice"), 500), None);
        let after = v.without(&Reset::Role {
            name: "alice".into(),
            uid: 0,
        });
        assert!(after.roles.is_empty());
        assert_eq!(after.locks.len(), 1, "the address's lock stays");
        assert_eq!(addr_key("::ffff:10.0.0.1".parse().unwrap()).1, "10.0.0.1");
    }
}
