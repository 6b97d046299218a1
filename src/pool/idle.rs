//! A pool's idle connections, one list per worker thread (shard).
//!
//! A server connection's socket is watched by the reactor of the shard
//! that opened it, so a client served on another shard is woken across
//! threads at every read. A connection checked in goes on the list of the
//! shard that checks it in, and a checkout takes from its own shard's list
//! first, another's only when its own is empty. Each list is last in,
//! first out (the warmest connection), behind its own short-held mutex.
//!
//! The operations that span the lists (closing, trimming, SHOW) take one
//! list's lock at a time.

use super::slots::Pooled;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

#[derive(Debug)]
pub(super) struct IdleLists<C> {
    /// Oldest used at the front of each; taken from the back.
    lists: Box<[Mutex<Vec<C>>]>,
    /// The connections in all the lists.
    total: AtomicUsize,
}

impl<C: Pooled> IdleLists<C> {
    /// One list per shard of this machine's cores (a shard index beyond
    /// them shares a list, which is still correct).
    pub(super) fn new() -> Self {
        Self::with_lists(crate::shards::count_for(0))
    }

    pub(super) fn with_lists(n: usize) -> Self {
        IdleLists {
            lists: (0..n.max(1)).map(|_| Mutex::new(Vec::new())).collect(),
            total: AtomicUsize::new(0),
        }
    }

    /// This shard's list (off the shards, any list does).
    fn local(&self) -> usize {
        crate::shards::current() % self.lists.len()
    }

    /// Idle connections in all the lists.
    pub(super) fn len(&self) -> usize {
        self.total.load(Ordering::Relaxed)
    }

    /// The most recently used connection of this shard's list, else of
    /// the next list that has one; with the total left.
    pub(super) fn pop(&self) -> (Option<C>, usize) {
        let n = self.lists.len();
        let local = self.local();
        for i in 0..n {
            let mut list = self.lists[(local + i) % n].lock();
            if let Some(conn) = list.pop() {
                let left = self.total.fetch_sub(1, Ordering::Relaxed) - 1;
                return (Some(conn), left);
            }
        }
        (None, self.len())
    }

    /// Puts `conn` on this shard's list unless `refuse()` (checked under
    /// the list's lock); the total after, or the connection refused.
    pub(super) fn push_unless(&self, conn: C, refuse: impl FnOnce() -> bool) -> Result<usize, C> {
        let mut list = self.lists[self.local()].lock();
        if refuse() {
            return Err(conn);
        }
        list.push(conn);
        Ok(self.total.fetch_add(1, Ordering::Relaxed) + 1)
    }

    /// Takes the least recently used connection of all the lists.
    pub(super) fn take_oldest(&self) -> Option<C> {
        // The list whose front was used longest ago; it may change before
        // its lock is taken again, which only makes the choice approximate.
        let oldest = (0..self.lists.len())
            .filter_map(|i| self.lists[i].lock().first().map(|c| (c.last_used(), i)))
            .min()?
            .1;
        let mut list = self.lists[oldest].lock();
        if list.is_empty() {
            return None;
        }
        self.total.fetch_sub(1, Ordering::Relaxed);
        Some(list.remove(0))
    }

    /// Takes the connections `which` picks, list by list (the others keep
    /// their order); they are dropped by the caller, after the locks.
    pub(super) fn take_where(&self, mut which: impl FnMut(&C) -> bool) -> Vec<C> {
        let mut taken = Vec::new();
        for list in self.lists.iter() {
            let mut list = list.lock();
            let before = taken.len();
            taken.extend(list.extract_if(.., |c| which(c)));
            self.total
                .fetch_sub(taken.len() - before, Ordering::Relaxed);
        }
        taken
    }

    /// Takes every connection.
    pub(super) fn take_all(&self) -> Vec<C> {
        self.take_where(|_| true)
    }

    /// `describe(connection)` for each, least recently used first.
    pub(super) fn describe<R>(&self, mut describe: impl FnMut(&C) -> R) -> Vec<R> {
        let mut all: Vec<(std::time::Instant, R)> = Vec::with_capacity(self.len());
        for list in self.lists.iter() {
            all.extend(list.lock().iter().map(|c| (c.last_used(), describe(c))));
        }
        all.sort_by_key(|(used, _)| *used);
        all.into_iter().map(|(_, r)| r).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    #[derive(Debug)]
    struct Conn(u64, Instant);

    impl Pooled for Conn {
        fn id(&self) -> u64 {
            self.0
        }
        fn generation(&self) -> u64 {
            0
        }
        fn created(&self) -> Instant {
            self.1
        }
        fn last_used(&self) -> Instant {
            self.1
        }
        fn touch(&mut self, now: Instant) {
            self.1 = now;
        }
    }

    #[tokio::test]
    async fn a_shard_takes_its_own_connections_first_then_another_shards() {
        let lists = Arc::new(IdleLists::with_lists(2));
        let shards = crate::shards::Shards::start(2).unwrap();
        let t0 = Instant::now();
        // Shard 0 checks in 1 and 2, shard 1 checks in 3.
        for (id, shard) in [(1, 0), (2, 0), (3, 1)] {
            let l = lists.clone();
            let conn = Conn(id, t0 + Duration::from_secs(id));
            let pushed =
                shards.spawn_on(shard, async move { l.push_unless(conn, || false).is_ok() });
            assert!(pushed.await.unwrap());
        }
        assert_eq!(lists.len(), 3);
        // From shard 1: its own (3), then shard 0's most recent (2), then 1.
        let l = lists.clone();
        let order = shards
            .spawn_on(1, async move {
                (0..4).map(|_| l.pop().0.map(|c| c.0)).collect::<Vec<_>>()
            })
            .await
            .unwrap();
        assert_eq!(order, [Some(3), Some(2), Some(1), None]);
        assert_eq!(lists.len(), 0);
    }

    #[test]
    fn the_oldest_is_taken_across_lists_and_described_first() {
        let lists = IdleLists::with_lists(1);
        let t0 = Instant::now();
        for id in [1, 2, 3] {
            let _ = lists.push_unless(Conn(id, t0 + Duration::from_secs(id)), || false);
        }
        assert_eq!(lists.describe(|c| c.0), [1, 2, 3]);
        assert_eq!(lists.take_oldest().map(|c| c.0), Some(1));
        assert!(lists.push_unless(Conn(9, t0), || true).is_err(), "refused");
        assert_eq!(lists.take_where(|c| c.0 == 3).len(), 1);
        assert_eq!(lists.len(), 1);
        assert_eq!(lists.take_all().len(), 1);
        assert_eq!(lists.len(), 0);
    }
}
