//! A client's connection: plain TCP, TLS after an SSLRequest, or the
//! Unix-domain socket (never TLS, as in PostgreSQL).
//!
//! Writes on either kind return once the bytes are on the socket (see
//! [`crate::tls::ClientTlsStream`]), and [`ClientStream::readable`] waits for
//! input without taking a buffer, so the serve loop treats both alike.
//!
//! Small reads on a plain connection (the login reads a message's header,
//! then its body) read ahead: one `recv` takes what the client sent, and
//! the next reads are served from it, so a login message costs one system
//! call instead of three. Large reads (the serve loop's) go straight to the
//! socket once the read-ahead is used up; an empty read-ahead holds no
//! memory, so an idle client pays nothing for it.

use crate::tls::ClientTlsStream;
use bytes::{Buf, BytesMut};
use rustls_pki_types::CertificateDer;
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpStream, UnixStream};
use tokio_rustls::TlsAcceptor;

/// A Terminate message: a client that sent it is leaving.
const TERMINATE: [u8; 5] = [b'X', 0, 0, 0, 4];

/// How often [`ClientStream::closed`] looks at the socket's end-of-stream
/// flag while bytes the client sent wait unread.
const CLOSED_RECHECK: std::time::Duration = std::time::Duration::from_millis(100);

/// Reads asking for less than this read ahead (a startup packet or login
/// message fits; a login's messages are far smaller).
const READ_AHEAD: usize = 2048;

/// The stream to one client.
#[derive(Debug)]
pub struct ClientStream {
    io: Io,
    /// Bytes read from a plain connection and not yet taken.
    ahead: BytesMut,
}

#[derive(Debug)]
enum Io {
    Plain(TcpStream),
    /// Boxed: rustls' state is large, and most clients are plain.
    Tls(Box<ClientTlsStream>),
    /// A client of the Unix-domain socket; read ahead as a plain one.
    Unix(UnixStream),
    /// What is left after a TLS handshake failed: every operation fails.
    Closed,
}

impl ClientStream {
    /// A plain connection, as accepted.
    pub fn plain(tcp: TcpStream) -> Self {
        ClientStream {
            io: Io::Plain(tcp),
            ahead: BytesMut::new(),
        }
    }

    /// A client of the Unix-domain socket, as accepted.
    pub fn unix(unix: UnixStream) -> Self {
        ClientStream {
            io: Io::Unix(unix),
            ahead: BytesMut::new(),
        }
    }

    /// True once TLS is on.
    pub fn is_tls(&self) -> bool {
        matches!(self.io, Io::Tls(_))
    }

    /// True for a client of the Unix-domain socket.
    pub fn is_unix(&self) -> bool {
        matches!(self.io, Io::Unix(_))
    }

    /// True when bytes the client sent have been read ahead and not yet
    /// taken. After an SSLRequest or GSSENCRequest they came before the
    /// answer, unencrypted: PostgreSQL refuses them.
    pub fn has_read_ahead(&self) -> bool {
        !self.ahead.is_empty()
    }

    /// usher's end of the connection (SHOW CLIENTS' local_addr).
    pub fn local_addr(&self) -> Option<std::net::SocketAddr> {
        match &self.io {
            Io::Plain(tcp) => tcp.local_addr().ok(),
            Io::Tls(s) => s.tcp().local_addr().ok(),
            Io::Unix(_) | Io::Closed => None,
        }
    }

    /// Runs the TLS handshake on a plain stream (after usher answered `S`
    /// to an SSLRequest). On failure every later operation on the stream fails.
    /// Bytes read ahead would be lost to the handshake: the caller refuses
    /// them first ([`ClientStream::has_read_ahead`]).
    pub async fn start_tls(&mut self, acceptor: &TlsAcceptor) -> io::Result<()> {
        if self.has_read_ahead() {
            return Err(io::Error::other("bytes before the TLS handshake"));
        }
        let Io::Plain(tcp) = std::mem::replace(&mut self.io, Io::Closed) else {
            return Err(io::Error::other("TLS can only start on a plain connection"));
        };
        let tls = ClientTlsStream::accept(tcp, acceptor.config().clone()).await?;
        self.io = Io::Tls(Box::new(tls));
        Ok(())
    }

    /// The certificate the client presented (already verified against
    /// `tls.ca` during the handshake), if any.
    pub fn peer_certificate(&self) -> Option<&CertificateDer<'static>> {
        match &self.io {
            Io::Tls(s) => s.connection().peer_certificates()?.first(),
            _ => None,
        }
    }

    /// TLS details for hooks: protocol version, cipher, client certificate.
    pub fn tls_info(&self) -> Option<crate::hooks::TlsInfo> {
        let Io::Tls(s) = &self.io else {
            return None;
        };
        let conn = s.connection();
        Some(crate::hooks::TlsInfo {
            version: conn
                .protocol_version()
                .map(|v| format!("{v:?}"))
                .unwrap_or_default(),
            cipher: conn
                .negotiated_cipher_suite()
                .map(|c| format!("{:?}", c.suite()))
                .unwrap_or_default(),
            client_cert_subject: self
                .peer_certificate()
                .and_then(crate::auth::cert::common_name)
                .map(|cn| format!("CN={cn}")),
        })
    }

    /// Resolves once the client has closed its end of the connection (or
    /// its socket failed), without taking any byte it sent: for a client
    /// that waits for a server, whose next message must stay unread. A
    /// Terminate waiting on a plain connection counts as closed; other
    /// bytes waiting leave only the socket's end-of-stream flag to tell,
    /// looked at every [`CLOSED_RECHECK`].
    pub async fn closed(&self) {
        let (tcp, plain) = match &self.io {
            Io::Plain(s) => (s, true),
            Io::Tls(s) => (s.tcp(), false),
            Io::Unix(s) => return self.unix_closed(s).await,
            Io::Closed => return,
        };
        if plain && self.ahead.starts_with(&TERMINATE) {
            return;
        }
        loop {
            if self.ahead.is_empty() {
                let mut head = [0u8; TERMINATE.len()];
                let mut head = ReadBuf::new(&mut head);
                // Waits for input (or the end) without taking it.
                match std::future::poll_fn(|cx| tcp.poll_peek(cx, &mut head)).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) if plain && head.filled() == TERMINATE => return,
                    Ok(_) => {}
                }
            }
            // Bytes wait: the socket says whether its peer also closed.
            match tcp.ready(tokio::io::Interest::READABLE).await {
                Ok(ready) if !ready.is_read_closed() => {}
                _ => return,
            }
            tokio::time::sleep(CLOSED_RECHECK).await;
        }
    }

    /// [`ClientStream::closed`] on the Unix-domain socket, which tokio
    /// gives no `poll_peek`: a peek when readable instead.
    async fn unix_closed(&self, unix: &UnixStream) {
        if self.ahead.starts_with(&TERMINATE) {
            return;
        }
        loop {
            if self.ahead.is_empty() {
                if unix.readable().await.is_err() {
                    return;
                }
                // Zeroed, so that what the peek wrote is read as bytes.
                let mut head = [std::mem::MaybeUninit::new(0u8); TERMINATE.len()];
                let peeked = unix.try_io(tokio::io::Interest::READABLE, || {
                    socket2::SockRef::from(unix).peek(&mut head)
                });
                // SAFETY: every byte was initialised above; peek only writes.
                let head = head.map(|b| unsafe { b.assume_init() });
                match peeked {
                    Ok(0) => return,
                    Ok(n) if n == TERMINATE.len() && head == TERMINATE => return,
                    Ok(_) => {}
                    // The readiness was stale; readable() waits again.
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                    Err(_) => return,
                }
            }
            match unix.ready(tokio::io::Interest::READABLE).await {
                Ok(ready) if !ready.is_read_closed() => {}
                _ => return,
            }
            tokio::time::sleep(CLOSED_RECHECK).await;
        }
    }

    /// Waits until a read would make progress, without reading. For TLS,
    /// plaintext already decrypted and buffered counts as readable.
    pub async fn readable(&self) -> io::Result<()> {
        std::future::poll_fn(|cx| self.poll_readable(cx)).await
    }

    /// [`ClientStream::readable`] as a poll: the waker is kept by the
    /// socket's registration, not by a future.
    pub fn poll_readable(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.has_read_ahead() {
            return Poll::Ready(Ok(()));
        }
        match &self.io {
            Io::Plain(s) => s.poll_read_ready(cx),
            Io::Tls(s) => {
                if s.has_buffered_input() {
                    // buffered plaintext or TLS bytes, or the peer closed
                    return Poll::Ready(Ok(()));
                }
                s.tcp().poll_read_ready(cx)
            }
            Io::Unix(s) => s.poll_read_ready(cx),
            Io::Closed => Poll::Ready(Err(closed())),
        }
    }
}

fn closed() -> io::Error {
    io::Error::new(io::ErrorKind::NotConnected, "connection closed")
}

impl AsyncRead for ClientStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.ahead.is_empty() {
            let small = buf.remaining() < READ_AHEAD;
            let read_ahead = match &mut this.io {
                Io::Plain(s) if small => poll_read_ahead(Pin::new(s), cx, &mut this.ahead),
                Io::Unix(s) if small => poll_read_ahead(Pin::new(s), cx, &mut this.ahead),
                Io::Plain(s) => return Pin::new(s).poll_read(cx, buf),
                Io::Unix(s) => return Pin::new(s).poll_read(cx, buf),
                Io::Tls(s) => return Pin::new(s.as_mut()).poll_read(cx, buf),
                Io::Closed => return Poll::Ready(Err(closed())),
            };
            if ready!(read_ahead)? == 0 {
                // The end of the stream: nothing read.
                this.ahead = BytesMut::new();
                return Poll::Ready(Ok(()));
            }
        }
        let n = this.ahead.len().min(buf.remaining());
        buf.put_slice(&this.ahead[..n]);
        this.ahead.advance(n);
        if this.ahead.is_empty() {
            // Give the memory back: an idle client holds none.
            this.ahead = BytesMut::new();
        }
        Poll::Ready(Ok(()))
    }
}

/// One read into the read-ahead buffer.
fn poll_read_ahead<R: AsyncRead>(
    io: Pin<&mut R>,
    cx: &mut Context<'_>,
    ahead: &mut BytesMut,
) -> Poll<io::Result<usize>> {
    ahead.reserve(READ_AHEAD);
    tokio_util::io::poll_read_buf(io, cx, ahead)
}

impl AsyncWrite for ClientStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match &mut self.get_mut().io {
            Io::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
            Io::Unix(s) => Pin::new(s).poll_write(cx, buf),
            Io::Closed => Poll::Ready(Err(closed())),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().io {
            Io::Plain(s) => Pin::new(s).poll_flush(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
            Io::Unix(s) => Pin::new(s).poll_flush(cx),
            Io::Closed => Poll::Ready(Ok(())),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().io {
            Io::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
            Io::Unix(s) => Pin::new(s).poll_shutdown(cx),
            Io::Closed => Poll::Ready(Ok(())),
        }
    }
}
