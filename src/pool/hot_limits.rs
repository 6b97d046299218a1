//! The pool settings a transaction reads, kept beside the pool's
//! `PoolLimits` as plain atomics.
//!
//! `PoolLimits` lives in an `ArcSwap` so that a reload can replace it
//! whole; each load of it costs a hazard-pointer dance (arc-swap's debt
//! list), about 50 instructions. A transaction read it seven times (the
//! checkout's deadline, the lifetime at checkout and checkin, the check
//! delay, the prepared-statement bound, the idle timeouts in the serve
//! loop and the parked wait): some 350 of its 15,000 instructions
//! (callgrind, pgbench -S). These few fields are copied here whenever the
//! settings change ([`HotLimits::store`]); a read is one relaxed load.
//! Each field is read on its own, which is all their readers need (none
//! relies on two of them changing together).

use crate::config::PoolLimits;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

/// What an absent duration is stored as.
const NONE: u64 = u64::MAX;

#[derive(Debug)]
pub(crate) struct HotLimits {
    query_wait_timeout: AtomicU64,
    server_lifetime: AtomicU64,
    server_check_delay: AtomicU64,
    client_idle_timeout: AtomicU64,
    idle_transaction_timeout: AtomicU64,
    prepared_statements: AtomicUsize,
}

/// A duration in nanoseconds, below [`NONE`] (584 years and more are
/// taken as that much less a nanosecond).
fn nanos(d: Duration) -> u64 {
    d.as_nanos().min(u128::from(NONE - 1)) as u64
}

fn nanos_of(d: Option<Duration>) -> u64 {
    d.map_or(NONE, nanos)
}

fn duration_of(n: u64) -> Option<Duration> {
    (n != NONE).then(|| Duration::from_nanos(n))
}

impl HotLimits {
    pub(crate) fn new(limits: &PoolLimits) -> HotLimits {
        let hot = HotLimits {
            query_wait_timeout: AtomicU64::new(0),
            server_lifetime: AtomicU64::new(NONE),
            server_check_delay: AtomicU64::new(0),
            client_idle_timeout: AtomicU64::new(NONE),
            idle_transaction_timeout: AtomicU64::new(NONE),
            prepared_statements: AtomicUsize::new(0),
        };
        hot.store(limits);
        hot
    }

    /// Takes the fields of new settings.
    pub(crate) fn store(&self, limits: &PoolLimits) {
        let put = |a: &AtomicU64, v: u64| a.store(v, Ordering::Relaxed);
        put(&self.query_wait_timeout, nanos(limits.query_wait_timeout));
        put(&self.server_lifetime, nanos_of(limits.server_lifetime));
        put(&self.server_check_delay, nanos(limits.server_check_delay));
        put(
            &self.client_idle_timeout,
            nanos_of(limits.client_idle_timeout),
        );
        put(
            &self.idle_transaction_timeout,
            nanos_of(limits.idle_transaction_timeout),
        );
        self.prepared_statements
            .store(limits.prepared_statements, Ordering::Relaxed);
    }

    pub(crate) fn query_wait_timeout(&self) -> Duration {
        Duration::from_nanos(self.query_wait_timeout.load(Ordering::Relaxed))
    }

    pub(crate) fn server_lifetime(&self) -> Option<Duration> {
        duration_of(self.server_lifetime.load(Ordering::Relaxed))
    }

    pub(crate) fn server_check_delay(&self) -> Duration {
        Duration::from_nanos(self.server_check_delay.load(Ordering::Relaxed))
    }

    pub(crate) fn client_idle_timeout(&self) -> Option<Duration> {
        duration_of(self.client_idle_timeout.load(Ordering::Relaxed))
    }

    pub(crate) fn idle_transaction_timeout(&self) -> Option<Duration> {
        duration_of(self.idle_transaction_timeout.load(Ordering::Relaxed))
    }

    pub(crate) fn prepared_statements(&self) -> usize {
        self.prepared_statements.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_field_follows_the_settings_it_mirrors() {
        let config =
            crate::config::Config::from_yaml("databases: { app: {} }\n", "t.yaml").unwrap();
        let mut limits = config.limits_for("app", "alice");
        limits.query_wait_timeout = Duration::from_secs(120);
        limits.server_lifetime = None;
        limits.server_check_delay = Duration::from_millis(30);
        limits.client_idle_timeout = Some(Duration::from_millis(1500));
        limits.idle_transaction_timeout = None;
        limits.prepared_statements = 7;
        let hot = HotLimits::new(&limits);
        let read = |hot: &HotLimits| {
            (
                hot.query_wait_timeout(),
                hot.server_lifetime(),
                hot.server_check_delay(),
                hot.client_idle_timeout(),
                hot.idle_transaction_timeout(),
                hot.prepared_statements(),
            )
        };
        let of = |l: &PoolLimits| {
            (
                l.query_wait_timeout,
                l.server_lifetime,
                l.server_check_delay,
                l.client_idle_timeout,
                l.idle_transaction_timeout,
                l.prepared_statements,
            )
        };
        assert_eq!(read(&hot), of(&limits));
        limits.query_wait_timeout = Duration::ZERO;
        limits.server_lifetime = Some(Duration::from_secs(3600));
        limits.server_check_delay = Duration::ZERO;
        limits.client_idle_timeout = None;
        limits.idle_transaction_timeout = Some(Duration::from_nanos(1));
        limits.prepared_statements = 0;
        hot.store(&limits);
        assert_eq!(read(&hot), of(&limits));
        // A duration too long for the nanoseconds is kept as the longest.
        limits.server_lifetime = Some(Duration::MAX);
        hot.store(&limits);
        assert!(hot.server_lifetime().unwrap() > Duration::from_secs(500 * 365 * 86400));
    }
}
