//! Boxes for the futures a transaction makes, whose memory is kept for
//! reuse, a few blocks per worker thread.
//!
//! A client in transaction mode boxes two futures per transaction: its busy
//! phase ([`Session::busy`](super::session::Session), about 2 KB) and its
//! checkout (about 1.1 KB). Boxed, so that an idle client holds neither;
//! but both are past glibc's per-thread cache (1,032 bytes), so each
//! allocation and free went through its bins: about 1,000 instructions per
//! transaction of 16,000 (callgrind, pgbench -S, 10 clients). A block freed
//! here is kept on the thread that freed it and is the next one of its
//! layout taken there: no allocator call, and warm memory. What is kept is
//! bounded per thread (not per client), so it adds nothing to what an idle
//! client costs. The same pattern as [`spare_buffers`](super::spare_buffers).

use std::alloc::Layout;
use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::ptr::NonNull;
use std::task::{Context, Poll};

/// Blocks kept per thread (of every layout together).
const KEPT_PER_THREAD: usize = 32;

/// Blocks given back on this thread; freed when the thread ends.
struct Spare(Vec<(Layout, NonNull<u8>)>);

impl Drop for Spare {
    fn drop(&mut self) {
        for (layout, block) in self.0.drain(..) {
            // SAFETY: every block was allocated with the global allocator
            // with this layout (`SpareBox::new_with`), and is owned by no one.
            unsafe { std::alloc::dealloc(block.as_ptr(), layout) };
        }
    }
}

thread_local! {
    static SPARE: RefCell<Spare> = const { RefCell::new(Spare(Vec::new())) };
}

/// A future on the heap, like `Pin<Box<F>>`, whose block goes back to this
/// thread's spare list when it is dropped.
pub struct SpareBox<F> {
    future: NonNull<F>,
}

// SAFETY: a SpareBox owns its future as a Box does.
unsafe impl<F: Send> Send for SpareBox<F> {}
// SAFETY: as above; `&SpareBox` gives no access to the future.
unsafe impl<F: Sync> Sync for SpareBox<F> {}

impl<F> SpareBox<F> {
    /// Makes the future (`make`) in a spare block of its layout if this
    /// thread has one, else in a new one: the block is taken first, so the future need not be built on the stack and then
    /// copied (a busy phase's is about 2 KB: the copy was ~150
    /// instructions per transaction, callgrind).
    #[inline(always)]
    pub fn new_with(make: impl FnOnce() -> F) -> Self {
        let layout = Layout::new::<F>();
        let ptr = if layout.size() == 0 {
            // Nothing to allocate (a zero-sized future): a dangling,
            // well-aligned pointer is a valid place for it.
            NonNull::<F>::dangling()
        } else {
            take_block(layout).cast::<F>()
        };
        // SAFETY: the block is ours, of F's size and alignment, and holds
        // nothing (or F is zero-sized and the pointer aligned).
        unsafe { ptr.as_ptr().write(make()) };
        SpareBox { future: ptr }
    }
}

/// A spare block of `layout` (not zero-sized) if this thread has one,
/// else a new one.
fn take_block(layout: Layout) -> NonNull<u8> {
    SPARE
        .try_with(|spare| {
            let mut spare = spare.borrow_mut();
            let at = spare.0.iter().rposition(|(l, _)| *l == layout)?;
            Some(spare.0.swap_remove(at).1)
        })
        .ok()
        .flatten()
        .unwrap_or_else(|| {
            // SAFETY: the layout's size is not zero.
            let block = unsafe { std::alloc::alloc(layout) };
            NonNull::new(block).unwrap_or_else(|| std::alloc::handle_alloc_error(layout))
        })
}

impl<F: Future> Future for SpareBox<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        // SAFETY: the future lives in its block until it is dropped in
        // place (`Drop`), and is never moved out: pinned, as in a Box.
        let future = unsafe { Pin::new_unchecked(&mut *self.future.as_ptr()) };
        future.poll(cx)
    }
}

impl<F> Drop for SpareBox<F> {
    fn drop(&mut self) {
        let layout = Layout::new::<F>();
        // SAFETY: the future was written in `new` and is dropped once.
        unsafe { std::ptr::drop_in_place(self.future.as_ptr()) };
        if layout.size() == 0 {
            return;
        }
        let block = self.future.cast::<u8>();
        let kept = SPARE
            .try_with(|spare| {
                let mut spare = spare.borrow_mut();
                if spare.0.len() < KEPT_PER_THREAD {
                    spare.0.push((layout, block));
                    true
                } else {
                    false
                }
            })
            .unwrap_or(false);
        if !kept {
            // SAFETY: allocated with this layout in `new`; no longer used.
            unsafe { std::alloc::dealloc(block.as_ptr(), layout) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    /// A future that counts its drops and holds some bytes.
    struct Counted {
        drops: Arc<AtomicUsize>,
        bytes: [u8; 1500],
    }

    impl Future for Counted {
        type Output = u8;
        fn poll(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<u8> {
            Poll::Ready(self.bytes[1499])
        }
    }

    impl Drop for Counted {
        fn drop(&mut self) {
            self.drops.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_block_given_back_is_the_next_one_of_its_layout_taken() {
        let drops = Arc::new(AtomicUsize::new(0));
        let make = |last| Counted {
            drops: drops.clone(),
            bytes: {
                let mut b = [0; 1500];
                b[1499] = last;
                b
            },
        };
        let first = SpareBox::new_with(|| make(7));
        let at = first.future.as_ptr() as usize;
        assert_eq!(first.await, 7);
        assert_eq!(drops.load(Ordering::Relaxed), 1, "dropped in place once");
        // Another layout does not take the block.
        let other = SpareBox::new_with(|| std::future::ready([1u8; 3000]));
        assert_ne!(other.future.as_ptr() as usize, at);
        assert_eq!(other.await[2999], 1);
        let second = SpareBox::new_with(|| make(9));
        assert_eq!(
            second.future.as_ptr() as usize,
            at,
            "the same block came back"
        );
        assert_eq!(second.await, 9);
        assert_eq!(drops.load(Ordering::Relaxed), 2);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_future_dropped_unfinished_is_dropped_once_and_zero_sized_ones_work() {
        let drops = Arc::new(AtomicUsize::new(0));
        let pending = SpareBox::new_with(|| Counted {
            drops: drops.clone(),
            bytes: [0; 1500],
        });
        drop(pending);
        assert_eq!(drops.load(Ordering::Relaxed), 1);
        assert_eq!(SpareBox::new_with(|| std::future::ready(())).await, ());
    }

    #[test]
    fn what_is_kept_per_thread_is_bounded() {
        let boxes: Vec<_> = (0..KEPT_PER_THREAD * 2)
            .map(|i| SpareBox::new_with(|| std::future::ready([i as u8; 64])))
            .collect();
        drop(boxes);
        SPARE.with(|spare| assert!(spare.borrow().0.len() <= KEPT_PER_THREAD));
    }
}
