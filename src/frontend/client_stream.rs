//! A client's connection: plain TCP, or TLS after an SSLRequest.
//!
//! Writes on either kind return once the bytes are on the socket (see
//! [`crate::tls::WriteThrough`]), and [`ClientStream::readable`] waits for
//! input without taking a buffer, so the serve loop treats both alike.

use crate::tls::WriteThrough;
use rustls_pki_types::CertificateDer;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

/// The stream to one client.
#[derive(Debug)]
pub enum ClientStream {
    Plain(TcpStream),
    Tls(Box<WriteThrough<TlsStream<TcpStream>>>),
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
            ClientStream::Tls(s) => s.get_ref().get_ref().0.local_addr().ok(),
            ClientStream::Closed => None,
        }
    }

    /// Runs the TLS handshake on a plain stream (after usher answered `S`
    /// to an SSLRequest). On failure the stream is [`ClientStream::Closed`].
    pub async fn start_tls(&mut self, acceptor: &TlsAcceptor) -> io::Result<()> {
        let ClientStream::Plain(tcp) = std::mem::replace(self, ClientStream::Closed) else {
            return Err(io::Error::other("TLS can only start on a plain connection"));
        };
        let tls = acceptor.accept(tcp).await?;
        *self = ClientStream::Tls(Box::new(WriteThrough::new(tls)));
        Ok(())
    }

    /// The certificate the client presented (already verified against
    /// `tls.ca` during the handshake), if any.
    pub fn peer_certificate(&self) -> Option<&CertificateDer<'static>> {
        match self {
            ClientStream::Tls(s) => s.get_ref().get_ref().1.peer_certificates()?.first(),
            _ => None,
        }
    }

    /// TLS details for hooks: protocol version, cipher, client certificate.
    pub fn tls_info(&self) -> Option<crate::hooks::TlsInfo> {
        let ClientStream::Tls(s) = self else {
            return None;
        };
        let conn = s.get_ref().get_ref().1;
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
        match self {
            ClientStream::Plain(s) => s.readable().await,
            ClientStream::Tls(s) => {
                let (tcp, conn) = s.get_ref().get_ref();
                if !conn.wants_read() {
                    return Ok(()); // buffered plaintext, or the peer closed
                }
                tcp.readable().await
            }
            ClientStream::Closed => Err(closed()),
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
