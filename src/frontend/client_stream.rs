//! A client's connection: plain TCP, or TLS after an SSLRequest.
//!
//! Writes on either kind return once the bytes are on the socket (see
//! [`crate::tls::ClientTlsStream`]), and [`ClientStream::readable`] waits for
//! input without taking a buffer, so the serve loop treats both alike.

use crate::tls::ClientTlsStream;
use rustls_pki_types::CertificateDer;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;

/// The stream to one client.
#[derive(Debug)]
pub enum ClientStream {
    Plain(TcpStream),
    /// Boxed: rustls' state is large, and most clients are plain.
    Tls(Box<ClientTlsStream>),
    /// What is left after a TLS handshake failed: every operation fails.
    Closed,
}

impl ClientStream {
    /// True once TLS is on.
    pub fn is_tls(&self) -> bool {
        matches!(self, ClientStream::Tls(_))
    }

    /// usher's end of the connection (SHOW CLIENTS' local_addr).
    pub fn local_addr(&self) -> Option<std::net::SocketAddr> {
        match self {
            ClientStream::Plain(tcp) => tcp.local_addr().ok(),
            ClientStream::Tls(s) => s.tcp().local_addr().ok(),
            ClientStream::Closed => None,
        }
    }

    /// Runs the TLS handshake on a plain stream (after usher answered `S`
    /// to an SSLRequest). On failure the stream is [`ClientStream::Closed`].
    pub async fn start_tls(&mut self, acceptor: &TlsAcceptor) -> io::Result<()> {
        let ClientStream::Plain(tcp) = std::mem::replace(self, ClientStream::Closed) else {
            return Err(io::Error::other("TLS can only start on a plain connection"));
        };
        let tls = ClientTlsStream::accept(tcp, acceptor.config().clone()).await?;
        *self = ClientStream::Tls(Box::new(tls));
        Ok(())
    }

    /// The certificate the client presented (already verified against
    /// `tls.ca` during the handshake), if any.
    pub fn peer_certificate(&self) -> Option<&CertificateDer<'static>> {
        match self {
            ClientStream::Tls(s) => s.connection().peer_certificates()?.first(),
            _ => None,
        }
    }

    /// TLS details for hooks: protocol version, cipher, client certificate.
    pub fn tls_info(&self) -> Option<crate::hooks::TlsInfo> {
        let ClientStream::Tls(s) = self else {
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

    /// Waits until a read would make progress, without reading. For TLS,
    /// plaintext already decrypted and buffered counts as readable.
    pub async fn readable(&self) -> io::Result<()> {
        std::future::poll_fn(|cx| self.poll_readable(cx)).await
    }

    /// [`ClientStream::readable`] as a poll: the waker is kept by the
    /// socket's registration, not by a future.
    pub fn poll_readable(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self {
            ClientStream::Plain(s) => s.poll_read_ready(cx),
            ClientStream::Tls(s) => {
                if s.has_buffered_input() {
                    // buffered plaintext or TLS bytes, or the peer closed
                    return Poll::Ready(Ok(()));
                }
                s.tcp().poll_read_ready(cx)
            }
            ClientStream::Closed => Poll::Ready(Err(closed())),
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
        match self.get_mut() {
            ClientStream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            ClientStream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
            ClientStream::Closed => Poll::Ready(Err(closed())),
        }
    }
}

impl AsyncWrite for ClientStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            ClientStream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            ClientStream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
            ClientStream::Closed => Poll::Ready(Err(closed())),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ClientStream::Plain(s) => Pin::new(s).poll_flush(cx),
            ClientStream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
            ClientStream::Closed => Poll::Ready(Ok(())),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ClientStream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            ClientStream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
            ClientStream::Closed => Poll::Ready(Ok(())),
        }
    }
}
