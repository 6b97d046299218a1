//! What an accept loop does when `accept` fails: back off and keep going,
//! logging a burst of failures once rather than each failure.
//!
//! Out of descriptors (EMFILE, ENFILE) or kernel memory (ENOBUFS, ENOMEM),
//! the connection waiting in the backlog stays there and the next `accept`
//! fails at once: retried without a pause, the loop takes a core and the log
//! gets a line per try. Here the pause starts at [`FIRST_PAUSE`] and doubles
//! up to [`MAX_PAUSE`] while the failures last; the first failure of a burst
//! is logged, then at most one line per [`LOG_EVERY`] while it lasts, and
//! one when accepting works again.

use std::io;
use std::time::{Duration, Instant};

/// The first pause after a failed accept.
pub const FIRST_PAUSE: Duration = Duration::from_millis(10);
/// The longest pause between tries.
pub const MAX_PAUSE: Duration = Duration::from_secs(1);
/// While failures go on, a line at most this often.
pub const LOG_EVERY: Duration = Duration::from_secs(60);

/// The state of one accept loop's failures.
#[derive(Debug)]
pub struct AcceptBackoff {
    /// Which listener, for the log (`clients`, `metrics`).
    listener: &'static str,
    /// The pause after the next failure.
    pause: Duration,
    /// Failed accepts since the last one that worked.
    failures: u64,
    /// Failed accepts not reported in a log line yet.
    unlogged: u64,
    /// When this burst began.
    since: Option<Instant>,
    /// When a failure was last logged (kept across bursts, so that bursts
    /// in quick succession do not log a line each).
    logged: Option<Instant>,
    /// This burst was logged: its end is too.
    burst_logged: bool,
}

impl AcceptBackoff {
    pub fn new(listener: &'static str) -> AcceptBackoff {
        AcceptBackoff {
            listener,
            pause: FIRST_PAUSE,
            failures: 0,
            unlogged: 0,
            since: None,
            logged: None,
            burst_logged: false,
        }
    }

    /// An accept worked: the burst, if any, is over.
    pub fn accepted(&mut self) {
        if self.failures == 0 {
            return;
        }
        if self.burst_logged {
            let seconds = self.since.map_or(0.0, |t| t.elapsed().as_secs_f64());
            tracing::warn!(
                listener = self.listener,
                failures = self.failures,
                seconds,
                "accepting connections again"
            );
        }
        self.pause = FIRST_PAUSE;
        self.failures = 0;
        self.since = None;
        self.burst_logged = false;
    }

    /// An accept failed with `e`: how long to wait before the next. Errors
    /// that concern only the connection being accepted (it was reset or
    /// aborted before usher took it) need no pause.
    pub fn failed(&mut self, e: &io::Error) -> Duration {
        let now = Instant::now();
        self.failures += 1;
        self.unlogged += 1;
        self.since.get_or_insert(now);
        let pause = if only_this_connection(e) {
            Duration::ZERO
        } else {
            let pause = self.pause;
            self.pause = (self.pause * 2).min(MAX_PAUSE);
            pause
        };
        if self
            .logged
            .is_none_or(|t| now.duration_since(t) >= LOG_EVERY)
        {
            tracing::warn!(
                listener = self.listener,
                error = %e,
                failures = self.unlogged,
                pause_ms = pause.as_millis() as u64,
                "accept failed; backing off (further failures are counted, not logged, for {}s)",
                LOG_EVERY.as_secs()
            );
            self.logged = Some(now);
            self.unlogged = 0;
            self.burst_logged = true;
        }
        pause
    }
}

/// True for errors about the connection being accepted, not the listener
/// or the process.
fn only_this_connection(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::Interrupted
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn emfile() -> io::Error {
        io::Error::from_raw_os_error(24)
    }

    #[test]
    fn the_pause_doubles_to_the_maximum_and_resets() {
        let mut b = AcceptBackoff::new("test");
        let pauses: Vec<u128> = (0..10).map(|_| b.failed(&emfile()).as_millis()).collect();
        assert_eq!(pauses, [10, 20, 40, 80, 160, 320, 640, 1000, 1000, 1000]);
        assert_eq!(b.failures, 10);
        assert_eq!(b.unlogged, 9, "one line for the burst so far");
        b.accepted();
        assert_eq!(b.failed(&emfile()), FIRST_PAUSE);
        assert_eq!(
            b.unlogged, 10,
            "a burst soon after another is counted, not logged"
        );
        assert!(!b.burst_logged);
    }

    #[test]
    fn a_failure_of_one_connection_needs_no_pause() {
        let mut b = AcceptBackoff::new("test");
        let aborted = io::Error::from(io::ErrorKind::ConnectionAborted);
        assert_eq!(b.failed(&aborted), Duration::ZERO);
        assert_eq!(b.failed(&emfile()), FIRST_PAUSE);
    }
}
