//! Forwarding buffers kept for reuse, a few per worker thread.
//!
//! A client in transaction mode takes its buffers when it becomes busy and
//! gives them up when it is idle again (an idle client holds none). Taking
//! fresh 16 KiB blocks from malloc for every transaction cost two large
//! allocations and frees per transaction (glibc's tcache stops at 1 KiB, so
//! each went through `_int_malloc`/`_int_free`) and handed the transaction
//! cold memory. Here a buffer given back on a thread is the next one taken
//! there: warm, and no allocator call. What is kept is bounded per thread,
//! not per client, so it adds nothing to what an idle client costs.

use bytes::BytesMut;
use std::cell::RefCell;

/// The size forwarding buffers start at (reads grow them when a message
/// needs more).
pub const BUFFER_SIZE: usize = 16 * 1024;

/// Buffers kept per thread: enough for the clients a worker turns over
/// between transactions, 512 KiB at most.
const KEPT_PER_THREAD: usize = 32;

thread_local! {
    static SPARE: RefCell<Vec<BytesMut>> = const { RefCell::new(Vec::new()) };
}

/// An empty buffer of at least [`BUFFER_SIZE`] bytes' capacity.
pub fn take() -> BytesMut {
    SPARE
        .with(|spare| spare.borrow_mut().pop())
        .unwrap_or_else(|| BytesMut::with_capacity(BUFFER_SIZE))
}

/// Makes room for a read of [`BUFFER_SIZE`] bytes: a buffer with no memory
/// takes a spare one, any other grows (or moves its bytes to the front).
pub fn reserve(buf: &mut BytesMut) {
    if buf.capacity() == 0 {
        *buf = take();
    } else {
        buf.reserve(BUFFER_SIZE);
    }
}

/// Drops the first `n` bytes; an emptied buffer gets its whole block back
/// (no allocation), so the next read is not cut short.
pub fn consume(buf: &mut BytesMut, n: usize) {
    bytes::Buf::advance(buf, n);
    if buf.is_empty() {
        // Cannot fail for lack of memory: it never allocates.
        let _ = buf.try_reclaim(BUFFER_SIZE);
    }
}

/// Gives a buffer back; its bytes are dropped. Kept only if it is the
/// usual size and nothing else shares its memory; otherwise freed.
pub fn give(mut buf: BytesMut) {
    if buf.capacity() == 0 {
        return;
    }
    buf.clear();
    // Gets the whole block back without allocating, if it is ours alone.
    if !buf.try_reclaim(BUFFER_SIZE) || buf.capacity() > 2 * BUFFER_SIZE {
        return;
    }
    SPARE.with(|spare| {
        let mut spare = spare.borrow_mut();
        if spare.len() < KEPT_PER_THREAD {
            spare.push(buf);
        }
    });
}

/// Moves a buffer's bytes into one of their size and gives the block back
/// (a client that will wait holds only what it sent). A large message is
/// left where it is: its buffer is already about its size (and charged to
/// the budget), and a copy would hold it twice for a moment.
pub fn shrink_to_fit(buf: &mut BytesMut) {
    if buf.capacity() > buf.len() && buf.len() <= crate::frontend::budget::FREE_BYTES {
        let small = BytesMut::from(&buf[..]);
        give(std::mem::replace(buf, small));
    }
}

/// Gives the buffer back and leaves an empty one (no memory) in its place.
pub fn give_back(buf: &mut BytesMut) {
    give(std::mem::take(buf));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_given_back_is_the_next_one_taken() {
        let mut a = take();
        a.extend_from_slice(b"some bytes");
        let at = a.as_ptr();
        give(a);
        let b = take();
        assert_eq!(b.as_ptr(), at, "the same block came back");
        assert!(b.is_empty());
        assert!(b.capacity() >= BUFFER_SIZE);
    }

    #[test]
    fn a_shared_or_large_buffer_is_not_kept() {
        // Drain what earlier tests on this thread left.
        while SPARE.with(|s| s.borrow_mut().pop()).is_some() {}
        let mut a = take();
        a.extend_from_slice(&[1; 100]);
        let shared = a.split_to(10);
        give(a);
        assert_eq!(SPARE.with(|s| s.borrow().len()), 0, "shared memory kept");
        drop(shared);
        give(BytesMut::with_capacity(4 * BUFFER_SIZE));
        assert_eq!(SPARE.with(|s| s.borrow().len()), 0, "large buffer kept");
    }

    #[test]
    fn shrinking_keeps_the_bytes_and_gives_the_block_back() {
        while SPARE.with(|s| s.borrow_mut().pop()).is_some() {}
        let mut a = take();
        a.extend_from_slice(b"Q\0\0\0\x0bSELECT 1\0");
        let block = a.as_ptr();
        shrink_to_fit(&mut a);
        assert_eq!(&a[..], b"Q\0\0\0\x0bSELECT 1\0");
        assert!(a.capacity() < BUFFER_SIZE);
        assert_eq!(take().as_ptr(), block, "the block is the next one taken");
    }

    #[test]
    fn at_most_a_bounded_number_are_kept() {
        let many: Vec<_> = (0..KEPT_PER_THREAD + 5).map(|_| take()).collect();
        for b in many {
            give(b);
        }
        assert_eq!(SPARE.with(|s| s.borrow().len()), KEPT_PER_THREAD);
    }
}
