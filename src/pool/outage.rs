//! A pool's memory of failing to open server connections: an outage
//! (PostgreSQL restarting, a failover, a network cut), and who tries again
//! when.
//!
//! A healthy pool opens connections as its clients need them, several at
//! once. The first attempt that fails for a reason that may pass
//! ([`ConnectError::is_transient`]: refused, reset, timed out, `57P03`,
//! `53300`, no host that fits the target) starts an outage: from then on
//! one caller at a time makes an attempt ([`Turn::Attempt`]), after a pause
//! that grows with the outage ([`pause`]: 50 ms first, then a quarter of
//! its age, at most `server_login_retry`), and the pool's other clients
//! wait ([`Turn::Wait`]) instead of each trying the server. An attempt
//! that opens a connection ends the outage and wakes them all; one refused
//! for good (authentication, `3D000`: [`Outage::failed`]) ends it too, and
//! every client that was waiting gets that refusal ([`Turn::Refused`]).
//!
//! With `server_fast_fail` (PgBouncer's way), a client that would wait gets
//! the last attempt's error at once instead ([`Turn::Refused`]).
//!
//! No I/O here: [`super::Pool`] opens the connections and asks for its
//! turn; tests drive the bookkeeping under tokio's paused clock.

use crate::backend::ConnectError;
use parking_lot::Mutex;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// The first pause of an outage: the second attempt comes this soon.
pub const FIRST_PAUSE: Duration = Duration::from_millis(50);

/// The longest pause while a host answers but fits no target (a standby,
/// a promotion awaited): short, so a promotion is found within a second.
pub const PROMOTION_PAUSE: Duration = Duration::from_millis(500);

/// The pause before the next attempt in an outage `age` old: a quarter of
/// its age (so that attempts thin out as it lasts, a few dozen in a
/// minute), at least [`FIRST_PAUSE`], at most `limit`
/// (`server_login_retry`), and at most [`PROMOTION_PAUSE`] while a
/// promotion is awaited.
pub fn pause(age: Duration, limit: Duration, promotion: bool) -> Duration {
    let cap = if promotion {
        limit.min(PROMOTION_PAUSE)
    } else {
        limit
    };
    (age / 4).max(FIRST_PAUSE).min(cap)
}

/// One pool's outage state, shared by its clients.
#[derive(Debug, Default)]
pub(super) struct Outage {
    state: Mutex<State>,
    /// Told (every waiter) when an attempt ends, its maker leaves, or the
    /// outage ends.
    changed: Notify,
}

#[derive(Debug, Default)]
struct State {
    /// When the outage began; `None`: none (connections open as needed).
    since: Option<Instant>,
    /// When the next attempt is due (in an outage).
    next: Option<Instant>,
    /// An attempt is being made (at most one in an outage).
    attempting: bool,
    /// Failed attempts in this outage, for the log.
    attempts: u32,
    /// The last failed attempt's error.
    last: Option<Arc<ConnectError>>,
    /// Counts recorded outcomes: a waiter remembers it, and so tells a
    /// refusal that came while it waited from an older one.
    epoch: u64,
    /// The last refusal that ended an outage (for good: authentication,
    /// `3D000`) and the epoch it was recorded at.
    refusal: Option<(u64, Arc<ConnectError>)>,
}

/// What a caller that needs a new server connection does now.
#[derive(Debug)]
pub(super) enum Turn {
    /// No outage: open one.
    Open,
    /// In an outage, the next attempt is this caller's (it ends when the
    /// [`Attempt`] is recorded or dropped).
    Attempt(Attempt),
    /// Wait for a change ([`Outage::changed`]), or until this instant
    /// (the next attempt is due), and ask again.
    Wait(Option<Instant>),
    /// Do not wait: this error is the answer (a refusal recorded while the
    /// caller waited, or the last error under fast fail).
    Refused(Arc<ConnectError>),
}

/// The one attempt of an outage being made; given back when dropped,
/// whoever made it (a client that left gives it back half-made).
#[derive(Debug)]
pub(super) struct Attempt {
    outage: Arc<Outage>,
}

impl Drop for Attempt {
    fn drop(&mut self) {
        let mut s = self.outage.state.lock();
        if s.attempting {
            s.attempting = false;
            drop(s);
            self.outage.changed.notify_waiters();
        }
    }
}

impl Outage {
    /// The epoch now: what a caller passes to [`Outage::turn`] later.
    pub(super) fn epoch(&self) -> u64 {
        self.state.lock().epoch
    }

    /// Whether the pool is in an outage.
    pub(super) fn is_on(&self) -> bool {
        self.state.lock().since.is_some()
    }

    /// A future told at the next change; made (and enabled) before
    /// [`Outage::turn`] is asked, so that no change between is missed.
    pub(super) fn changed(&self) -> tokio::sync::futures::Notified<'_> {
        self.changed.notified()
    }

    /// What a caller that began waiting at `seen` ([`Outage::epoch`]) does
    /// now; `fast_fail`: `server_fast_fail`.
    pub(super) fn turn(self: &Arc<Self>, now: Instant, seen: u64, fast_fail: bool) -> Turn {
        let mut s = self.state.lock();
        if let Some((at, refusal)) = &s.refusal {
            if *at > seen {
                return Turn::Refused(refusal.clone());
            }
        }
        if s.since.is_none() {
            return Turn::Open;
        }
        if !s.attempting && s.next.is_none_or(|next| now >= next) {
            s.attempting = true;
            return Turn::Attempt(Attempt {
                outage: self.clone(),
            });
        }
        match &s.last {
            Some(last) if fast_fail => Turn::Refused(last.clone()),
            _ => Turn::Wait(s.next.filter(|_| !s.attempting)),
        }
    }

    /// A connection opened (by anyone): the outage, if any, is over.
    /// Returns how long it lasted and the attempts it took.
    pub(super) fn succeeded(&self) -> Option<(Duration, u32)> {
        let mut s = self.state.lock();
        let since = s.since.take()?;
        let attempts = std::mem::take(&mut s.attempts);
        s.next = None;
        s.last = None;
        s.epoch += 1;
        drop(s);
        self.changed.notify_waiters();
        Some((since.elapsed(), attempts))
    }

    /// An attempt failed with `error` at `now`; `limit`:
    /// `server_login_retry`. A transient error starts or continues the
    /// outage (the next attempt after [`pause`]); another ends it, and
    /// the clients that waited get it. Returns whether this began an
    /// outage.
    pub(super) fn failed(&self, error: &Arc<ConnectError>, now: Instant, limit: Duration) -> bool {
        let mut s = self.state.lock();
        s.epoch += 1;
        let began = if error.is_transient() {
            let began = s.since.is_none();
            s.attempts += 1;
            let since = *s.since.get_or_insert(now);
            let wait = pause(
                now.saturating_duration_since(since),
                limit,
                error.awaits_promotion(),
            );
            s.next = Some(now + wait);
            s.last = Some(error.clone());
            began
        } else {
            // The server answers: no outage, whatever it said.
            s.since = None;
            s.next = None;
            s.attempts = 0;
            s.last = None;
            s.refusal = Some((s.epoch, error.clone()));
            false
        };
        drop(s);
        self.changed.notify_waiters();
        began
    }

    /// The server's address changed (a reload): whatever failed before
    /// may work now. The outage ends; waiters ask again.
    pub(super) fn reset(&self) {
        let mut s = self.state.lock();
        s.since = None;
        s.next = None;
        s.attempts = 0;
        s.last = None;
        s.epoch += 1;
        drop(s);
        self.changed.notify_waiters();
    }

    /// The last failed attempt's error (in an outage).
    pub(super) fn last_error(&self) -> Option<Arc<ConnectError>> {
        self.state.lock().last.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::ServerError;

    const LIMIT: Duration = Duration::from_secs(15);

    fn refused() -> Arc<ConnectError> {
        Arc::new(ConnectError::Unreachable {
            host: "127.0.0.1".into(),
            port: 1,
            source: std::io::ErrorKind::ConnectionRefused.into(),
        })
    }

    fn wrong_password() -> Arc<ConnectError> {
        Arc::new(ConnectError::Refused(ServerError {
            fatal: true,
            code: "28P01".into(),
            message: "password authentication failed".into(),
            detail: None,
            hint: None,
        }))
    }

    #[test]
    fn pauses_start_short_grow_with_the_outage_and_stop_at_the_limit() {
        let ms = Duration::from_millis;
        assert_eq!(pause(ms(0), LIMIT, false), FIRST_PAUSE);
        assert_eq!(pause(ms(100), LIMIT, false), FIRST_PAUSE);
        assert_eq!(pause(ms(2000), LIMIT, false), ms(500));
        assert_eq!(pause(ms(20_000), LIMIT, false), ms(5000));
        assert_eq!(pause(ms(600_000), LIMIT, false), LIMIT);
        // Awaiting a promotion: never more than half a second.
        assert_eq!(pause(ms(600_000), LIMIT, true), PROMOTION_PAUSE);
        // A limit under the first pause wins.
        assert_eq!(pause(ms(0), ms(10), false), ms(10));
    }

    #[tokio::test(start_paused = true)]
    async fn in_an_outage_one_caller_tries_at_a_time_and_the_others_wait() {
        let outage = Arc::new(Outage::default());
        let now = Instant::now();
        let seen = outage.epoch();
        assert!(matches!(outage.turn(now, seen, false), Turn::Open));
        assert!(outage.failed(&refused(), now, LIMIT), "an outage begins");
        assert!(!outage.failed(&refused(), now, LIMIT), "it goes on");
        // Before the pause is over everybody waits for it.
        match outage.turn(now, seen, false) {
            Turn::Wait(Some(until)) => assert_eq!(until, now + FIRST_PAUSE),
            other => panic!("expected a wait, got {other:?}"),
        }
        // Then one caller makes the attempt; the others wait for it.
        let later = now + FIRST_PAUSE;
        let attempt = match outage.turn(later, seen, false) {
            Turn::Attempt(a) => a,
            other => panic!("expected the attempt, got {other:?}"),
        };
        assert!(matches!(outage.turn(later, seen, false), Turn::Wait(None)));
        // Its maker left without an outcome: the next caller takes over.
        drop(attempt);
        assert!(matches!(outage.turn(later, seen, false), Turn::Attempt(_)));
        // A success ends the outage for everybody.
        assert!(outage.succeeded().is_some());
        assert!(matches!(outage.turn(later, seen, false), Turn::Open));
        assert!(outage.succeeded().is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn a_refusal_ends_the_outage_and_reaches_those_who_waited() {
        let outage = Arc::new(Outage::default());
        let now = Instant::now();
        outage.failed(&refused(), now, LIMIT);
        let waiting_since = outage.epoch();
        let attempt = match outage.turn(now + FIRST_PAUSE, waiting_since, false) {
            Turn::Attempt(a) => a,
            other => panic!("expected the attempt, got {other:?}"),
        };
        assert!(!outage.failed(&wrong_password(), now, LIMIT));
        drop(attempt);
        assert!(!outage.is_on());
        match outage.turn(now, waiting_since, false) {
            Turn::Refused(e) => assert_eq!(e.sqlstate(), "28P01"),
            other => panic!("expected the refusal, got {other:?}"),
        }
        // A caller that comes later tries for itself.
        assert!(matches!(
            outage.turn(now, outage.epoch(), false),
            Turn::Open
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn fast_fail_answers_with_the_last_error_until_an_attempt_is_due() {
        let outage = Arc::new(Outage::default());
        let now = Instant::now();
        outage.failed(&refused(), now, LIMIT);
        let seen = outage.epoch();
        match outage.turn(now, seen, true) {
            Turn::Refused(e) => assert_eq!(e.sqlstate(), "08006"),
            other => panic!("expected the last error, got {other:?}"),
        }
        assert!(matches!(
            outage.turn(now + FIRST_PAUSE, seen, true),
            Turn::Attempt(_)
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn waiters_are_told_when_an_attempt_ends() {
        let outage = Arc::new(Outage::default());
        let now = Instant::now();
        outage.failed(&refused(), now, LIMIT);
        let changed = outage.changed();
        tokio::pin!(changed);
        changed.as_mut().enable();
        assert!(outage.succeeded().is_some());
        tokio::time::timeout(Duration::from_secs(1), changed)
            .await
            .expect("told");
    }
}
