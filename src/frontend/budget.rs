//! The memory all clients together may make usher hold in read buffers.
//!
//! A client's read buffer is small (it streams), except while usher must
//! hold a message whole (a named Parse in transaction mode, up to
//! `max_buffered_message`). The part of each buffer beyond
//! [`FREE_BYTES`] is charged here against `max_buffered_total`, so a few
//! clients sending large messages cannot take all of usher's memory: the
//! one that would pass the total ends with 53200 and the others go on.
//! A client may not keep a charge by stopping in the middle of its message:
//! the serve loop ends it after `client_message_timeout` (57P05).
//! Ordinary traffic never touches the counter.
//!
//! The statements a client keeps in transaction mode (each named Parse's
//! text, each SQL PREPARE's) are charged here too, beyond
//! [`FREE_STATEMENT_BYTES`] per client: a client that prepared without
//! end would otherwise grow usher's memory until the system killed it,
//! and every client with it. The statement past the total is refused with
//! 53200 and the client goes on.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Each client's read buffer may be this large without being charged.
pub const FREE_BYTES: usize = 64 * 1024;

/// Each client's prepared statements may hold this much without being
/// charged: hundreds of ordinary statements.
pub const FREE_STATEMENT_BYTES: usize = 1024 * 1024;

/// Bytes charged by all clients.
#[derive(Debug, Default)]
pub struct BufferBudget {
    used: AtomicUsize,
}

impl BufferBudget {
    /// Changes a client's charge from `*charged` to the part of `capacity`
    /// beyond [`FREE_BYTES`]. False (and nothing changed) when that would
    /// take the total past `limit`.
    pub fn recharge(&self, charged: &mut usize, capacity: usize, limit: usize) -> bool {
        self.charge_to(charged, capacity.saturating_sub(FREE_BYTES), limit)
    }

    /// Changes a charge from `*charged` to `wanted` bytes. False (and
    /// nothing changed) when that would take the total past `limit`.
    fn charge_to(&self, charged: &mut usize, wanted: usize, limit: usize) -> bool {
        if wanted == *charged {
            return true;
        }
        if wanted < *charged {
            self.used.fetch_sub(*charged - wanted, Ordering::Relaxed);
            *charged = wanted;
            return true;
        }
        let more = wanted - *charged;
        let took = self
            .used
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |used| {
                (used + more <= limit).then_some(used + more)
            });
        if took.is_ok() {
            *charged = wanted;
        }
        took.is_ok()
    }

    /// Bytes charged now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }
}

/// A charge that goes back to its budget when dropped: a client's
/// statements' (kept with them, so no path that drops them forgets it).
#[derive(Debug)]
pub struct Charge {
    budget: Arc<BufferBudget>,
    bytes: usize,
}

impl Charge {
    pub fn new(budget: Arc<BufferBudget>) -> Charge {
        Charge { budget, bytes: 0 }
    }

    /// Bytes charged now.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Changes the charge to `bytes`; false (nothing changed) when that
    /// would take the budget's total past `limit`.
    pub fn set(&mut self, bytes: usize, limit: usize) -> bool {
        self.budget.charge_to(&mut self.bytes, bytes, limit)
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_only_beyond_the_free_part_and_refuses_past_the_limit() {
        let budget = BufferBudget::default();
        let (mut a, mut b) = (0, 0);
        assert!(budget.recharge(&mut a, FREE_BYTES, 1000));
        assert_eq!((a, budget.used()), (0, 0));
        assert!(budget.recharge(&mut a, FREE_BYTES + 600, 1000));
        assert!(!budget.recharge(&mut b, FREE_BYTES + 600, 1000));
        assert_eq!((a, b, budget.used()), (600, 0, 600));
        assert!(budget.recharge(&mut a, 0, 1000));
        assert!(budget.recharge(&mut b, FREE_BYTES + 600, 1000));
        assert_eq!((a, b, budget.used()), (0, 600, 600));
    }

    #[test]
    fn a_charge_is_refused_past_the_limit_and_goes_back_when_dropped() {
        let budget = Arc::new(BufferBudget::default());
        let mut a = Charge::new(budget.clone());
        let mut b = Charge::new(budget.clone());
        assert!(a.set(700, 1000));
        assert!(!b.set(400, 1000), "past the limit");
        assert_eq!((b.bytes(), budget.used()), (0, 700));
        assert!(a.set(500, 1000), "down");
        assert!(b.set(400, 1000));
        drop(a);
        assert_eq!(budget.used(), 400);
        drop(b);
        assert_eq!(budget.used(), 0);
    }
}
