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

use std::sync::atomic::{AtomicUsize, Ordering};

/// Each client's read buffer may be this large without being charged.
pub const FREE_BYTES: usize = 64 * 1024;

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
        let wanted = capacity.saturating_sub(FREE_BYTES);
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
}
