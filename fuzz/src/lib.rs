//! Helpers shared by the fuzz targets: running usher's async parsers over
//! in-memory streams (which are always ready, so one poll finishes them), and
//! cutting one fuzz input into the pieces a target needs.

use std::future::Future;
use std::io;
use std::pin::{pin, Pin};
use std::task::{Context, Poll, Waker};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Runs a future that never waits (its I/O is in memory) to completion.
pub fn block_on<F: Future>(future: F) -> F::Output {
    let mut future = pin!(future);
    let mut cx = Context::from_waker(Waker::noop());
    match future.as_mut().poll(&mut cx) {
        Poll::Ready(out) => out,
        Poll::Pending => panic!("an in-memory future waited"),
    }
}

/// A client connection in memory: reads come from the fuzz input, writes
/// are collected (what usher sent back).
pub struct Duplex<'a> {
    pub input: &'a [u8],
    pub output: Vec<u8>,
}

impl<'a> Duplex<'a> {
    pub fn new(input: &'a [u8]) -> Self {
        Duplex {
            input,
            output: Vec::new(),
        }
    }
}

impl AsyncRead for Duplex<'_> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.input).poll_read(cx, buf)
    }
}

impl AsyncWrite for Duplex<'_> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.output.extend_from_slice(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// Takes pieces off the front of a fuzz input; past the end, zeros and
/// empty slices.
pub struct Input<'a>(pub &'a [u8]);

impl<'a> Input<'a> {
    pub fn byte(&mut self) -> u8 {
        match self.0.split_first() {
            Some((b, rest)) => {
                self.0 = rest;
                *b
            }
            None => 0,
        }
    }

    pub fn u16(&mut self) -> u16 {
        u16::from_be_bytes([self.byte(), self.byte()])
    }

    /// Up to `n` bytes.
    pub fn take(&mut self, n: usize) -> &'a [u8] {
        let (head, rest) = self.0.split_at(n.min(self.0.len()));
        self.0 = rest;
        head
    }

    /// A piece whose length is the next byte.
    pub fn piece(&mut self) -> &'a [u8] {
        let n = self.byte() as usize;
        self.take(n)
    }

    pub fn rest(&mut self) -> &'a [u8] {
        self.take(usize::MAX)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// `text` with every `marker` replaced by `with`: lets the fuzzer write
/// values it cannot guess (a random nonce) by writing the marker.
pub fn splice(text: &[u8], marker: &[u8], with: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    let mut i = 0;
    while i < text.len() {
        if text[i..].starts_with(marker) {
            out.extend_from_slice(with);
            i += marker.len();
        } else {
            out.push(text[i]);
            i += 1;
        }
    }
    out
}
