//! Choosing a server among a database's hosts (`databases.<name>.hosts`),
//! as libpq does with several hosts, `target_session_attrs` and
//! `load_balance_hosts`, plus what a pooler needs and libpq does not keep:
//! a memory of each host across connections.
//!
//! - [`ServerHosts`]: one pool's list, its target and the rotation
//!   (`load_balance`: from a random host, then each connection the next);
//!   [`ServerHosts::plan`] orders the hosts for one connection.
//! - [`HostHealth`]: per host (shared by every pool, since a dead server is
//!   dead for all of them): the connect failures in a row and until when
//!   the host is skipped (a back-off that doubles from [`BACKOFF_START`]
//!   to [`BACKOFF_MAX`], reset by a success), and whether its sessions were
//!   last seen read-only.
//!
//! The plan never leaves a connection with nothing to try: hosts in
//! back-off are skipped only while a host that may fit can be tried (after
//! those that did not fit last time otherwise: a primary restarting beside
//! its standby is tried at every attempt of the pool's outage, not only
//! once its back-off ends), and a host that did not fit the target is
//! tried after those that may, not skipped (it may have been promoted
//! since). One host and `target: any` is the
//! path of a single server: no plan, no memory (connect.rs).

use super::{QueryError, ServerConn};
use crate::config::TargetSessionAttrs;
use bytes::BytesMut;
use parking_lot::Mutex;
use postgres_protocol::message::backend::Message;
use postgres_protocol::message::frontend;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The first skip after a host failed to connect; doubled by each failure
/// in a row, up to [`BACKOFF_MAX`].
pub const BACKOFF_START: Duration = Duration::from_secs(2);
pub const BACKOFF_MAX: Duration = Duration::from_secs(30);

/// What usher remembers of one server (host, port).
#[derive(Debug, Clone, Default)]
struct HostRecord {
    /// Connect failures in a row.
    failures: u32,
    /// Skipped until then (a back-off after a failure).
    down_until: Option<Instant>,
    /// Whether its sessions were read-only when last connected to.
    read_only: Option<bool>,
}

/// The memory of every server usher connected to or tried, shared by all
/// pools. Only the connect path touches it (a short-held lock).
#[derive(Debug, Default)]
pub struct HostHealth {
    hosts: Mutex<HashMap<(String, u16), HostRecord>>,
}

impl HostHealth {
    /// A connection to `host` failed: skip it for a while, longer each
    /// time in a row. Returns how long.
    pub fn failed(&self, host: &(String, u16), now: Instant) -> Duration {
        let mut hosts = self.hosts.lock();
        let r = hosts.entry(host.clone()).or_default();
        r.failures = r.failures.saturating_add(1);
        let skip = BACKOFF_START
            .saturating_mul(1 << (r.failures - 1).min(16))
            .min(BACKOFF_MAX);
        r.down_until = Some(now + skip);
        skip
    }

    /// usher logged in to `host` (whose sessions are `read_only`, when
    /// asked): no back-off any more.
    pub fn connected(&self, host: &(String, u16), read_only: Option<bool>) {
        let mut hosts = self.hosts.lock();
        let r = hosts.entry(host.clone()).or_default();
        r.failures = 0;
        r.down_until = None;
        if read_only.is_some() {
            r.read_only = read_only;
        }
    }

    fn record(&self, host: &(String, u16)) -> HostRecord {
        self.hosts.lock().get(host).cloned().unwrap_or_default()
    }
}

/// The servers one pool may use, in the configured order, with the
/// target they must fit.
#[derive(Debug)]
pub struct ServerHosts {
    list: Vec<(String, u16)>,
    target: TargetSessionAttrs,
    load_balance: bool,
    /// Where the next connection's rotation starts (`load_balance`;
    /// wraps, modulo the list's length).
    next: AtomicUsize,
    /// The host of the last connection that fit (SHOW DATABASES).
    in_use: Mutex<Option<(usize, Instant)>>,
    health: Arc<HostHealth>,
}

impl ServerHosts {
    /// `list` is never empty (config validation); an empty one gets the
    /// default server so nothing below has to check.
    pub fn new(
        mut list: Vec<(String, u16)>,
        target: TargetSessionAttrs,
        load_balance: bool,
        health: Arc<HostHealth>,
    ) -> ServerHosts {
        if list.is_empty() {
            list.push(("127.0.0.1".into(), 5432));
        }
        ServerHosts {
            list,
            target,
            load_balance,
            // A random first start, so that many small pools of one
            // database do not all begin at the first host.
            next: AtomicUsize::new(if load_balance { rand::random() } else { 0 }),
            in_use: Mutex::new(None),
            health,
        }
    }

    /// One server, any session: connect.rs' plain path.
    pub fn single(host: String, port: u16) -> ServerHosts {
        ServerHosts::new(
            vec![(host, port)],
            TargetSessionAttrs::Any,
            false,
            Arc::default(),
        )
    }

    pub fn target(&self) -> TargetSessionAttrs {
        self.target
    }

    pub fn list(&self) -> &[(String, u16)] {
        &self.list
    }

    /// True for one host and `target: any`: nothing to choose or check.
    pub fn is_plain(&self) -> bool {
        self.list.len() == 1 && self.target == TargetSessionAttrs::Any
    }

    /// The hosts to try for one connection, best first (indices into
    /// [`ServerHosts::list`]): from the rotation's start (or the first),
    /// those that may fit, then those that did not fit when last seen,
    /// and the hosts in back-off only if none may fit.
    pub fn plan(&self, now: Instant) -> Vec<usize> {
        let n = self.list.len();
        if n == 1 {
            return vec![0];
        }
        let start = if self.load_balance {
            self.next.fetch_add(1, Ordering::Relaxed) % n
        } else {
            0
        };
        let (mut fitting, mut unfit, mut down) = (Vec::new(), Vec::new(), Vec::new());
        for i in (start..n).chain(0..start) {
            let r = self.health.record(&self.list[i]);
            if r.down_until.is_some_and(|t| t > now) {
                down.push(i);
            } else if r.read_only.is_some_and(|ro| !self.target.fits(ro)) {
                unfit.push(i);
            } else {
                fitting.push(i);
            }
        }
        if fitting.is_empty() {
            unfit.append(&mut down);
            unfit
        } else {
            fitting.append(&mut unfit);
            fitting
        }
    }

    /// A connection to host `i` failed; returns how long it is skipped
    /// (zero with one host: a single server is always tried).
    pub fn failed(&self, i: usize, now: Instant) -> Duration {
        if self.list.len() == 1 {
            return Duration::ZERO;
        }
        self.health.failed(&self.list[i], now)
    }

    /// usher logged in to host `i`; `fit` says whether it was kept.
    pub fn connected(&self, i: usize, read_only: Option<bool>, fit: bool) {
        self.health.connected(&self.list[i], read_only);
        if fit {
            *self.in_use.lock() = Some((i, Instant::now()));
        }
    }

    /// The host of the last connection that fit, and when it was made.
    pub fn in_use(&self) -> Option<(&(String, u16), Instant)> {
        let (i, at) = (*self.in_use.lock())?;
        Some((self.list.get(i)?, at))
    }
}

/// Whether the server's sessions are read-only, from the parameters it
/// reported at login (PostgreSQL 14+ reports `in_hot_standby` and
/// `default_transaction_read_only`); `None` when it did not report both.
/// libpq decides the same way before it falls back to asking.
pub fn reported_read_only(params: &HashMap<String, String>) -> Option<bool> {
    let standby = params.get("in_hot_standby")?;
    let default_ro = params.get("default_transaction_read_only")?;
    Some(standby == "on" || default_ro == "on")
}

/// What libpq says of a server that does not fit `target`.
pub fn unfit_reason(target: TargetSessionAttrs) -> &'static str {
    match target {
        TargetSessionAttrs::ReadOnly => "session is not read-only",
        _ => "session is read-only",
    }
}

impl ServerConn {
    /// Whether this connection's session is read-only: from the reported
    /// parameters, else (a server before 14) `SHOW transaction_read_only`,
    /// as libpq asks.
    pub async fn read_only(&mut self) -> Result<bool, QueryError> {
        if let Some(ro) = reported_read_only(self.params().now()) {
            return Ok(ro);
        }
        let mut out = BytesMut::new();
        frontend::query("SHOW transaction_read_only", &mut out)
            .map_err(|e| QueryError::Encode(e.to_string()))?;
        let mut value = None;
        self.exchange(&out, 1, |m| {
            if let Message::DataRow(row) = m {
                let buffer = row.buffer();
                if let Ok(Some(Some(r))) =
                    fallible_iterator::FallibleIterator::next(&mut row.ranges())
                {
                    value = Some(&buffer[r] == b"on");
                }
            }
        })
        .await?;
        value.ok_or_else(|| QueryError::Encode("SHOW transaction_read_only returned no row".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use TargetSessionAttrs::*;

    fn hosts(n: u16, target: TargetSessionAttrs, load_balance: bool) -> ServerHosts {
        let list = (0..n).map(|i| ("h".to_string(), 5000 + i)).collect();
        ServerHosts::new(list, target, load_balance, Arc::default())
    }

    #[test]
    fn in_order_without_memory_and_rotating_with_load_balance() {
        let now = Instant::now();
        let h = hosts(3, Any, false);
        assert_eq!((h.plan(now), h.plan(now)), (vec![0, 1, 2], vec![0, 1, 2]));
        let h = hosts(3, Any, true);
        let first = h.plan(now);
        let starts: Vec<usize> = (0..4).map(|_| h.plan(now)[0]).collect();
        let after = |i: usize| (first[0] + i) % 3;
        assert_eq!(starts, vec![after(1), after(2), after(3), after(4)]);
        assert_eq!(h.plan(now), vec![after(5), after(6), after(7)]);
    }

    #[test]
    fn a_failed_host_is_skipped_for_a_growing_while_and_forgiven_on_success() {
        let now = Instant::now();
        let h = hosts(2, Any, false);
        assert_eq!(h.failed(0, now), BACKOFF_START);
        assert_eq!(h.plan(now), vec![1]);
        assert_eq!(h.plan(now + BACKOFF_START), vec![0, 1], "tried again after");
        assert_eq!(h.failed(0, now), BACKOFF_START * 2);
        for _ in 0..10 {
            h.failed(0, now);
        }
        assert_eq!(h.failed(0, now), BACKOFF_MAX);
        h.connected(0, None, true);
        assert_eq!(h.plan(now), vec![0, 1]);
        assert_eq!(h.failed(0, now), BACKOFF_START, "the count starts over");
    }

    #[test]
    fn with_every_host_down_all_are_tried() {
        let now = Instant::now();
        let h = hosts(2, Any, false);
        h.failed(0, now);
        h.failed(1, now);
        assert_eq!(h.plan(now), vec![0, 1]);
        // One host is never held back.
        let one = hosts(1, ReadWrite, false);
        assert_eq!(one.failed(0, now), Duration::ZERO);
        assert_eq!(one.plan(now), vec![0]);
    }

    #[test]
    fn hosts_that_did_not_fit_come_last_not_never() {
        let now = Instant::now();
        let h = hosts(3, ReadWrite, false);
        h.connected(0, Some(true), false);
        assert_eq!(h.plan(now), vec![1, 2, 0]);
        // The same servers seen from a read-only pool (shared memory).
        let ro = ServerHosts::new(h.list.clone(), ReadOnly, false, h.health.clone());
        h.connected(1, Some(false), true);
        assert_eq!(ro.plan(now), vec![0, 2, 1]);
        // A host down and the others unfit: the unfit ones are tried,
        // then the one down (a primary restarting beside its standbys).
        h.failed(1, now);
        h.connected(2, Some(true), false);
        assert_eq!(h.plan(now), vec![0, 2, 1]);
        // With a host that may fit, the one down is skipped.
        h.connected(2, Some(false), true);
        assert_eq!(h.plan(now), vec![2, 0]);
    }

    #[test]
    fn the_host_in_use_is_the_last_that_fit() {
        let h = hosts(2, ReadWrite, false);
        assert!(h.in_use().is_none());
        h.connected(0, Some(true), false);
        assert!(h.in_use().is_none());
        h.connected(1, Some(false), true);
        assert_eq!(h.in_use().unwrap().0 .1, 5001);
    }

    #[test]
    fn read_only_comes_from_both_reported_parameters() {
        let p = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<HashMap<_, _>>()
        };
        let both = |s, d| p(&[("in_hot_standby", s), ("default_transaction_read_only", d)]);
        assert_eq!(reported_read_only(&both("off", "off")), Some(false));
        assert_eq!(reported_read_only(&both("on", "off")), Some(true));
        assert_eq!(reported_read_only(&both("off", "on")), Some(true));
        assert_eq!(reported_read_only(&p(&[("in_hot_standby", "off")])), None);
    }
}
