//! TLS streams buffer: a write may leave encrypted bytes inside rustls until
//! the next write or flush. usher's forwarding code writes a message and
//! then waits for the other side, as it does with a plain socket, so a TLS
//! write here returns only once its bytes have reached the socket.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Wraps a TLS stream so that `poll_write` flushes before it reports the
/// bytes written.
///
/// A write that returned `Pending` must be retried with the same bytes (as
/// `write_all` and every tokio helper does): the bytes were handed to TLS on
/// the first try, and the retry only finishes sending them.
#[derive(Debug)]
pub struct WriteThrough<S> {
    inner: S,
    /// Bytes TLS has taken that have not been reported to the writer yet.
    accepted: usize,
}

impl<S> WriteThrough<S> {
    pub fn new(inner: S) -> Self {
        WriteThrough { inner, accepted: 0 }
    }

    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for WriteThrough<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for WriteThrough<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if this.accepted == 0 {
            let n = ready!(Pin::new(&mut this.inner).poll_write(cx, buf))?;
            if n == 0 {
                return Poll::Ready(Ok(0));
            }
            this.accepted = n;
        }
        let flushed = ready!(Pin::new(&mut this.inner).poll_flush(cx));
        let n = std::mem::take(&mut this.accepted);
        flushed.map(|()| n.min(buf.len())).into()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    /// Takes every write into a buffer and holds it there until flushed, the
    /// way a TLS stream holds records when the socket is full.
    #[derive(Default)]
    struct Holding {
        held: Vec<u8>,
        sent: Vec<u8>,
        flush_pending_once: bool,
    }

    impl AsyncWrite for Holding {
        fn poll_write(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            self.held.extend_from_slice(buf);
            Poll::Ready(Ok(buf.len()))
        }
        fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            if std::mem::take(&mut self.flush_pending_once) {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            let held = std::mem::take(&mut self.held);
            self.sent.extend(held);
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn a_write_returns_only_when_its_bytes_are_sent() {
        let mut w = WriteThrough::new(Holding {
            flush_pending_once: true,
            ..Holding::default()
        });
        w.write_all(b"hello").await.unwrap();
        w.write_all(b" world").await.unwrap();
        assert_eq!(w.get_ref().sent, b"hello world");
        assert!(w.get_ref().held.is_empty());
    }
}
