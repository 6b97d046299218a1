//! The connection to a PostgreSQL server: plain TCP, or TLS negotiated with
//! an SSLRequest as the database's `tls` setting asks. Used by server
//! connections and by the auth query's tokio-postgres connections.

use super::error::{ConnectError, TlsStep};
use crate::config::ServerTlsMode;
use crate::protocol::tags::encryption;
use crate::tls::{ServerTls, WriteThrough};
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

/// The stream to one server.
#[derive(Debug)]
pub enum ServerStream {
    Plain(TcpStream),
    Tls(Box<WriteThrough<TlsStream<TcpStream>>>),
}

/// Connects to `host:port` and sets up TLS as `tls` says.
pub async fn open(host: &str, port: u16, tls: &ServerTls) -> Result<ServerStream, ConnectError> {
    let failed = |step: TlsStep| ConnectError::Tls {
        host: host.to_string(),
        port,
        step,
    };
    let mut tcp =
        TcpStream::connect((host, port))
            .await
            .map_err(|source| ConnectError::Unreachable {
                host: host.to_string(),
                port,
                source,
            })?;
    let _ = tcp.set_nodelay(true);
    let Some((config, name)) = tls.client_config(host) else {
        return Ok(ServerStream::Plain(tcp));
    };
    let mut request = Vec::with_capacity(8);
    request.extend_from_slice(&8u32.to_be_bytes());
    request.extend_from_slice(&crate::protocol::startup::SSL_REQUEST.to_be_bytes());
    tcp.write_all(&request)
        .await
        .map_err(|e| failed(TlsStep::Request(e)))?;
    // Exactly one byte: anything the server sent after it would be read in
    // plaintext, which TLS is there to prevent.
    let answer = tcp
        .read_u8()
        .await
        .map_err(|e| failed(TlsStep::Answer(e)))?;
    match answer {
        encryption::ACCEPT => {}
        encryption::REFUSE if tls.mode == ServerTlsMode::Prefer => {
            return Ok(ServerStream::Plain(tcp))
        }
        encryption::REFUSE => {
            return Err(failed(TlsStep::Refused {
                mode: tls.mode.to_string(),
            }))
        }
        _ => return Err(failed(TlsStep::BadAnswer)),
    }
    let stream = TlsConnector::from(config)
        .connect(name, tcp)
        .await
        .map_err(|e| failed(TlsStep::Handshake(e)))?;
    Ok(ServerStream::Tls(Box::new(WriteThrough::new(stream))))
}

impl ServerStream {
    pub fn is_tls(&self) -> bool {
        matches!(self, ServerStream::Tls(_))
    }

    /// usher's end of the connection (SHOW SERVERS' local_addr).
    pub fn local_addr(&self) -> Option<std::net::SocketAddr> {
        match self {
            ServerStream::Plain(tcp) => tcp.local_addr().ok(),
            ServerStream::Tls(s) => s.get_ref().get_ref().0.local_addr().ok(),
        }
    }

    /// True while the server has neither closed the connection nor sent
    /// anything unasked. Never blocks and never consumes input.
    pub fn looks_alive(&self) -> bool {
        let tcp = match self {
            ServerStream::Plain(tcp) => tcp,
            ServerStream::Tls(s) => {
                let (tcp, conn) = s.get_ref().get_ref();
                if !conn.wants_read() {
                    return false; // decrypted data or a close_notify is waiting
                }
                tcp
            }
        };
        let mut probe = [0u8; 1];
        let mut buf = ReadBuf::new(&mut probe);
        let mut cx = Context::from_waker(Waker::noop());
        matches!(tcp.poll_peek(&mut cx, &mut buf), Poll::Pending)
    }
}

impl AsyncRead for ServerStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ServerStream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            ServerStream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for ServerStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            ServerStream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            ServerStream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ServerStream::Plain(s) => Pin::new(s).poll_flush(cx),
            ServerStream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ServerStream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            ServerStream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}
