//! A pool's `pool_size` places: a counting semaphore whose waiters queue
//! per shard (worker thread, see [`crate::shards`]).
//!
//! A place given back on a shard goes to that shard's longest waiting
//! client, so that the connection checked in there, on that shard's idle
//! list and reactor, is taken by a client of the same thread: no wake-up
//! across threads and no move of the socket. With one queue for all (as
//! tokio's semaphore has), at a full pool about half of all hand-overs went
//! to the other thread. Fairness is bounded: a place goes to another
//! shard's waiter instead when that one came more than [`SLACK`] waiters
//! before this shard's first, so no queue starves while another is busy.
//!
//! Places come back through [`Places::give_back`]; after `pool_size`
//! shrank below the places taken, those owed are kept out of circulation
//! as they come back.
//!
//! A waiter gives up at its deadline (`query_wait_timeout`). One task per
//! pool, the sweeper, watches the deadlines while anyone waits: it sleeps
//! until the earliest, ends the waits that reached theirs, and sleeps
//! again. A waiter arms no timer of its own: at 1,000 clients on 20
//! connections nearly every transaction waits, and a timer in tokio's
//! wheel per wait (registered, then cancelled) was about 600 instructions
//! of a transaction's 17,000 (callgrind).

use parking_lot::Mutex;
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::sync::Notify;
use tokio::time::Instant;

/// How many waiters of other shards that came later one may be passed over
/// by, at most, in favour of a place's own shard.
pub(super) const SLACK: u64 = 16;

#[derive(Debug)]
pub(super) struct Places {
    state: Mutex<State>,
    /// Tells the sweeper a waiter came with an earlier deadline than the
    /// one it sleeps until (`query_wait_timeout` was shortened).
    sooner: Notify,
}

#[derive(Debug)]
struct State {
    free: usize,
    /// Places to keep out of circulation as they come back.
    owed: usize,
    /// The waiters of each shard, first come first.
    queues: Box<[VecDeque<Arc<Waiter>>]>,
    /// Numbers the waiters in the order they came.
    next_ticket: u64,
    /// When the sweeper looks next; `None` while no sweeper runs.
    sweep_at: Option<Instant>,
}

#[derive(Debug)]
struct Waiter {
    ticket: u64,
    queue: usize,
    /// When it gives up.
    deadline: Instant,
    /// Set, under the state's lock, when a place is handed to it.
    granted: AtomicBool,
    /// Set, under the state's lock, when the sweeper ended its wait (it
    /// is out of the queue then; never both this and `granted`).
    expired: AtomicBool,
    waker: atomic_waker::AtomicWaker,
}

/// A wait that reached its deadline without a place.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Expired;

impl Places {
    pub(super) fn new(size: usize) -> Places {
        Places::with_queues(size, crate::shards::count_for(0))
    }

    pub(super) fn with_queues(size: usize, queues: usize) -> Places {
        Places {
            state: Mutex::new(State {
                free: size,
                owed: 0,
                queues: (0..queues.max(1)).map(|_| VecDeque::new()).collect(),
                next_ticket: 0,
                sweep_at: None,
            }),
            sooner: Notify::new(),
        }
    }

    /// Places free now (none while anyone waits: a place given back goes
    /// to a waiter).
    pub(super) fn available(&self) -> usize {
        self.state.lock().free
    }

    /// A place, if one is free now.
    pub(super) fn try_take(&self) -> bool {
        let mut state = self.state.lock();
        if state.free > 0 {
            state.free -= 1;
            return true;
        }
        false
    }

    /// A place, when one comes before `deadline`; queued on this shard.
    /// Dropping the future leaves the queue (and gives back a place handed
    /// to it meanwhile).
    pub(super) fn take(self: &Arc<Self>, deadline: Instant) -> Take<'_> {
        Take {
            places: self,
            deadline,
            waiter: None,
        }
    }

    /// Gives a place back: to a waiter (this shard's, within [`SLACK`]),
    /// or kept out of circulation if owed, or free.
    pub(super) fn give_back(&self) {
        let mut state = self.state.lock();
        if state.owed > 0 {
            state.owed -= 1;
            return;
        }
        let handed = state.hand_over();
        drop(state);
        if let Some(waiter) = handed {
            waiter.waker.wake();
        }
    }

    /// `pool_size` went from `from` to `to`: growing hands the new places
    /// to waiters (after cancelling what is still owed); shrinking takes
    /// free places now and owes the others.
    pub(super) fn resize(&self, from: usize, to: usize) {
        let mut woken = Vec::new();
        {
            let mut state = self.state.lock();
            if to > from {
                let cancel = state.owed.min(to - from);
                state.owed -= cancel;
                for _ in 0..(to - from - cancel) {
                    woken.extend(state.hand_over());
                }
            } else {
                let shrink = from - to;
                let taken = state.free.min(shrink);
                state.free -= taken;
                state.owed += shrink - taken;
            }
        }
        for waiter in woken {
            waiter.waker.wake();
        }
    }

    /// Ends the waits whose deadline is `now` or past (out of the queue,
    /// marked expired, woken) and says when to look again: the earliest
    /// deadline left, or `None` when nobody waits (the sweeper ends then).
    fn expire_due(&self, now: Instant) -> Option<Instant> {
        let mut expired = Vec::new();
        let mut state = self.state.lock();
        let mut earliest: Option<Instant> = None;
        for queue in state.queues.iter_mut() {
            queue.retain(|w| {
                if w.deadline <= now {
                    w.expired.store(true, Ordering::Release);
                    expired.push(w.clone());
                    return false;
                }
                earliest = Some(earliest.map_or(w.deadline, |e| e.min(w.deadline)));
                true
            });
        }
        state.sweep_at = earliest;
        drop(state);
        for waiter in expired {
            waiter.waker.wake();
        }
        earliest
    }

    /// Clients waiting now.
    #[cfg(test)]
    fn waiting(&self) -> usize {
        self.state.lock().queues.iter().map(VecDeque::len).sum()
    }
}

impl State {
    /// Hands a place to the waiter it is owed to (marked granted; to be
    /// woken after the lock), or makes it free.
    fn hand_over(&mut self) -> Option<Arc<Waiter>> {
        let n = self.queues.len();
        let local = crate::shards::current() % n;
        let oldest = (0..n)
            .filter_map(|q| self.queues[q].front().map(|w| (w.ticket, q)))
            .min();
        let Some((oldest_ticket, oldest_queue)) = oldest else {
            self.free += 1;
            return None;
        };
        let queue = match self.queues[local].front() {
            Some(w) if w.ticket <= oldest_ticket + SLACK => local,
            _ => oldest_queue,
        };
        let waiter = self.queues[queue].pop_front()?;
        waiter.granted.store(true, Ordering::Release);
        Some(waiter)
    }
}

/// The sweeper of one pool's waits: runs while anyone waits, sleeping
/// until the earliest deadline, or until told of an earlier one. It ends
/// when it finds nobody waiting, at most one `query_wait_timeout` after
/// the last wait.
async fn sweep(places: Arc<Places>) {
    while let Some(at) = places.expire_due(Instant::now()) {
        let sooner = places.sooner.notified();
        tokio::select! {
            _ = tokio::time::sleep_until(at) => {}
            _ = sooner => {}
        }
    }
}

/// The future of [`Places::take`].
pub(super) struct Take<'a> {
    places: &'a Arc<Places>,
    deadline: Instant,
    waiter: Option<Arc<Waiter>>,
}

impl Future for Take<'_> {
    type Output = Result<(), Expired>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let waiter = match &self.waiter {
            Some(w) => w.clone(),
            None => {
                let mut state = self.places.state.lock();
                if state.free > 0 {
                    state.free -= 1;
                    return Poll::Ready(Ok(()));
                }
                let queue = crate::shards::current() % state.queues.len();
                let waiter = Arc::new(Waiter {
                    ticket: state.next_ticket,
                    queue,
                    deadline: self.deadline,
                    granted: AtomicBool::new(false),
                    expired: AtomicBool::new(false),
                    waker: atomic_waker::AtomicWaker::new(),
                });
                state.next_ticket += 1;
                waiter.waker.register(cx.waker());
                state.queues[queue].push_back(waiter.clone());
                // The sweeper watches the deadline: started if none runs,
                // told if this one comes before the time it wakes at.
                let start_sweeper = match state.sweep_at {
                    None => {
                        state.sweep_at = Some(self.deadline);
                        true
                    }
                    Some(at) if self.deadline < at => {
                        state.sweep_at = Some(self.deadline);
                        self.places.sooner.notify_one();
                        false
                    }
                    Some(_) => false,
                };
                drop(state);
                if start_sweeper {
                    tokio::spawn(sweep(self.places.clone()));
                }
                self.waiter = Some(waiter);
                return Poll::Pending;
            }
        };
        waiter.waker.register(cx.waker());
        if waiter.granted.load(Ordering::Acquire) {
            self.waiter = None;
            return Poll::Ready(Ok(()));
        }
        if waiter.expired.load(Ordering::Acquire) {
            self.waiter = None;
            return Poll::Ready(Err(Expired));
        }
        Poll::Pending
    }
}

impl Drop for Take<'_> {
    fn drop(&mut self) {
        let Some(waiter) = self.waiter.take() else {
            return;
        };
        let mut state = self.places.state.lock();
        if waiter.granted.load(Ordering::Acquire) {
            // Handed a place as it gave up: it goes to the next.
            drop(state);
            self.places.give_back();
            return;
        }
        if waiter.expired.load(Ordering::Acquire) {
            // The sweeper took it out of the queue.
            return;
        }
        let queue = &mut state.queues[waiter.queue];
        if let Some(i) = queue.iter().position(|w| Arc::ptr_eq(w, &waiter)) {
            queue.remove(i);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A deadline far enough away not to matter.
    fn later() -> Instant {
        Instant::now() + Duration::from_secs(3600)
    }

    #[tokio::test]
    async fn waiters_are_served_first_come_and_a_cancelled_one_passes_its_place_on() {
        let places = Arc::new(Places::with_queues(1, 1));
        assert!(places.try_take());
        assert!(!places.try_take());
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for i in 0..3 {
            let (p, o) = (places.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                p.take(later()).await.unwrap();
                o.lock().push(i);
                p.give_back();
            }));
            tokio::task::yield_now().await;
            while places.waiting() < i + 1 {
                tokio::task::yield_now().await;
            }
        }
        // One that gives up before it is served leaves no trace.
        let quitter = tokio::time::timeout(Duration::from_millis(10), places.take(later())).await;
        assert!(quitter.is_err());
        assert_eq!(places.waiting(), 3);
        places.give_back();
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(*order.lock(), [0, 1, 2]);
        assert_eq!(places.available(), 1, "the place is free again");
    }

    #[tokio::test]
    async fn a_place_goes_to_its_own_shards_waiter_unless_another_waited_too_long() {
        let shards = crate::shards::Shards::start(2).unwrap();
        let places = Arc::new(Places::with_queues(0, 2));
        let waiter = |shard: usize| {
            let p = places.clone();
            shards.spawn_on(shard, async move { p.take(later()).await })
        };
        let until_waiting = |n: usize| {
            let p = places.clone();
            async move {
                while p.waiting() < n {
                    tokio::task::yield_now().await;
                }
            }
        };
        // Shard 1's waiter comes first (ticket 0), then SLACK + 1 of shard 0's.
        let first_of_1 = waiter(1);
        until_waiting(1).await;
        let mut of_0 = Vec::new();
        for i in 0..=SLACK as usize {
            of_0.push(waiter(0));
            until_waiting(2 + i).await;
        }
        let give_back_on_0 = || {
            let p = places.clone();
            shards.spawn_on(0, async move { p.give_back() })
        };
        // Places given back on shard 0 go to its own waiters while their
        // first came within SLACK of shard 1's.
        for _ in 0..SLACK {
            give_back_on_0().await.unwrap();
            assert_eq!(of_0.remove(0).await.unwrap(), Ok(()));
        }
        assert!(!first_of_1.is_finished());
        // Shard 0's first now came SLACK + 1 after shard 1's: shard 1's is served.
        give_back_on_0().await.unwrap();
        assert_eq!(first_of_1.await.unwrap(), Ok(()));
        assert_eq!(places.waiting(), 1);
        assert!(!of_0[0].is_finished());
    }

    #[tokio::test(start_paused = true)]
    async fn a_wait_ends_at_its_deadline_and_leaves_the_queue() {
        let places = Arc::new(Places::with_queues(1, 1));
        assert!(places.try_take());
        let started = Instant::now();
        let deadline = started + Duration::from_secs(5);
        assert_eq!(places.take(deadline).await, Err(Expired));
        assert_eq!(
            Instant::now(),
            deadline,
            "it ended at its deadline, not later"
        );
        assert_eq!(places.waiting(), 0);
        // Nothing was lost: the place given back is free again.
        places.give_back();
        assert_eq!(places.available(), 1);
        assert!(places.state.lock().sweep_at.is_none(), "the sweeper ended");
    }

    #[tokio::test(start_paused = true)]
    async fn a_later_waiter_with_an_earlier_deadline_ends_first() {
        // query_wait_timeout shortened by a reload: the sweeper, sleeping
        // until the first waiter's deadline, is told of the earlier one.
        let places = Arc::new(Places::with_queues(1, 1));
        assert!(places.try_take());
        let started = Instant::now();
        let long = tokio::spawn({
            let p = places.clone();
            async move { p.take(started + Duration::from_secs(100)).await }
        });
        while places.waiting() < 1 {
            tokio::task::yield_now().await;
        }
        let short = places.take(started + Duration::from_secs(2)).await;
        assert_eq!(short, Err(Expired));
        assert_eq!(Instant::now(), started + Duration::from_secs(2));
        assert!(!long.is_finished());
        // The first still waits its turn and gets the place given back.
        places.give_back();
        assert_eq!(long.await.unwrap(), Ok(()));
        assert_eq!(places.available(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn waiters_of_a_busy_pool_keep_their_place_in_line_past_earlier_deadlines() {
        // Places keep coming back while waiters keep queueing: every wait
        // that gets a place before its deadline is served in order, and
        // the one that does not is ended at its deadline.
        let places = Arc::new(Places::with_queues(1, 1));
        assert!(places.try_take());
        let started = Instant::now();
        let mut waits = Vec::new();
        for i in 0..5u64 {
            let p = places.clone();
            waits.push(tokio::spawn(async move {
                p.take(started + Duration::from_secs(10 + i)).await
            }));
            while places.waiting() < i as usize + 1 {
                tokio::task::yield_now().await;
            }
        }
        for wait in waits.drain(..3) {
            tokio::time::sleep(Duration::from_secs(1)).await;
            places.give_back();
            assert_eq!(wait.await.unwrap(), Ok(()));
        }
        // 3 s in: the last two wait until 13 s and 14 s.
        assert_eq!(waits.remove(0).await.unwrap(), Err(Expired));
        assert_eq!(Instant::now(), started + Duration::from_secs(13));
        places.give_back();
        assert_eq!(waits.remove(0).await.unwrap(), Ok(()));
    }

    #[test]
    fn places_owed_after_shrinking_are_kept_as_they_come_back() {
        let places = Places::with_queues(3, 1);
        assert!(places.try_take() && places.try_take());
        places.resize(3, 1);
        assert_eq!(places.available(), 0, "the free one taken now");
        places.give_back();
        assert_eq!(places.available(), 0, "owed: kept");
        places.give_back();
        assert_eq!(places.available(), 1);
        places.resize(1, 2);
        assert_eq!(places.available(), 2);
    }
}
