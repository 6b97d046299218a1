//! The connection to a PostgreSQL server: plain TCP, TLS negotiated with
//! an SSLRequest as the database's `tls` setting asks, or a Unix-domain
//! socket when the host is a directory (as libpq: a host beginning with `/`
//! names the directory holding `.s.PGSQL.<port>`; TLS is never used there).
//! Used by server connections and by the auth query's and the auth store's
//! tokio-postgres connections.

use super::error::{ConnectError, TlsStep};
use crate::config::{is_socket_dir, ServerTlsMode};
use crate::protocol::tags::encryption;
use crate::tls::{ServerTls, WriteThrough};
use std::io;
use std::path::PathBuf;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpStream, UnixStream};
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

/// The stream to one server.
#[derive(Debug)]
pub enum ServerStream {
    Plain(TcpStream),
    Tls(Box<WriteThrough<TlsStream<TcpStream>>>),
    /// A Unix-domain socket: the server on this machine, without TCP's
    /// per-packet work in the kernel.
    Unix(UnixStream),
}

/// The socket PostgreSQL listens on in directory `dir` for `port`.
pub fn socket_path(dir: &str, port: u16) -> PathBuf {
    PathBuf::from(format!("{}/.s.PGSQL.{port}", dir.trim_end_matches('/')))
}

/// Connects to `host:port` (or the socket for `port` in directory `host`)
/// and sets up TLS as `tls` says.
pub async fn open(host: &str, port: u16, tls: &ServerTls) -> Result<ServerStream, ConnectError> {
    if is_socket_dir(host) {
        // As libpq: TLS settings do not apply to a local socket.
        return UnixStream::connect(socket_path(host, port))
            .await
            .map(ServerStream::Unix)
            .map_err(|source| ConnectError::Unreachable {
                host: host.to_string(),
                port,
                source,
            });
    }
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

/// Registers `tcp`'s socket with the calling thread's runtime instead of
/// the one it was opened on: a duplicate of the descriptor is registered
/// here, and the old one is deregistered and closed (the socket and all
/// it holds stay as they are).
fn rehome_tcp(tcp: &mut TcpStream) -> io::Result<()> {
    use std::os::fd::AsFd;
    let fd = tcp.as_fd().try_clone_to_owned()?;
    *tcp = TcpStream::from_std(std::net::TcpStream::from(fd))?;
    Ok(())
}

impl ServerStream {
    /// Moves the connection's socket to the calling thread's reactor (see
    /// [`crate::shards`]): its readiness is then seen on this thread, not
    /// on the one that opened it. A TLS session is kept as it is.
    pub fn rehome(&mut self) -> io::Result<()> {
        use std::os::fd::AsFd;
        match self {
            ServerStream::Plain(tcp) => rehome_tcp(tcp),
            ServerStream::Tls(s) => rehome_tcp(s.get_mut().get_mut().0),
            ServerStream::Unix(unix) => {
                let fd = unix.as_fd().try_clone_to_owned()?;
                *unix = UnixStream::from_std(std::os::unix::net::UnixStream::from(fd))?;
                Ok(())
            }
        }
    }

    pub fn is_tls(&self) -> bool {
        matches!(self, ServerStream::Tls(_))
    }

    /// usher's end of the connection (SHOW SERVERS' local_addr); none
    /// for a Unix-domain socket.
    pub fn local_addr(&self) -> Option<std::net::SocketAddr> {
        match self {
            ServerStream::Plain(tcp) => tcp.local_addr().ok(),
            ServerStream::Tls(s) => s.get_ref().get_ref().0.local_addr().ok(),
            ServerStream::Unix(_) => None,
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
            // Nothing to peek at (WouldBlock) is the one healthy answer;
            // without read readiness the peek is not even tried.
            ServerStream::Unix(unix) => {
                let peeked = unix.try_io(tokio::io::Interest::READABLE, || {
                    let mut probe = [std::mem::MaybeUninit::<u8>::uninit(); 1];
                    socket2::SockRef::from(unix).peek(&mut probe)
                });
                return matches!(peeked, Err(e) if e.kind() == io::ErrorKind::WouldBlock);
            }
        };
        let mut probe = [0u8; 1];
        let mut buf = ReadBuf::new(&mut probe);
        let mut cx = Context::from_waker(Waker::noop());
        matches!(tcp.poll_peek(&mut cx, &mut buf), Poll::Pending)
    }
}

impl ServerStream {
    /// [`ServerStream::looks_alive`] asked of the socket itself (one
    /// system call), for a connection whose readiness this thread's
    /// reactor has not seen yet (just [rehomed](ServerStream::rehome)).
    pub fn peek_alive(&self) -> bool {
        let sock = match self {
            ServerStream::Plain(tcp) => socket2::SockRef::from(tcp),
            ServerStream::Tls(s) => {
                let (tcp, conn) = s.get_ref().get_ref();
                if !conn.wants_read() {
                    return false;
                }
                socket2::SockRef::from(tcp)
            }
            ServerStream::Unix(unix) => socket2::SockRef::from(unix),
        };
        let mut probe = [std::mem::MaybeUninit::<u8>::uninit(); 1];
        matches!(sock.peek(&mut probe), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
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
            ServerStream::Unix(s) => Pin::new(s).poll_read(cx, buf),
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
            ServerStream::Unix(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ServerStream::Plain(s) => Pin::new(s).poll_flush(cx),
            ServerStream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
            ServerStream::Unix(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ServerStream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            ServerStream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
            ServerStream::Unix(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_socket_directory_is_an_absolute_path_and_names_the_port() {
        assert!(is_socket_dir("/var/run/postgresql"));
        assert!(!is_socket_dir("db.example.com"));
        assert!(!is_socket_dir("127.0.0.1"));
        assert!(!is_socket_dir("::1"));
        assert_eq!(
            socket_path("/var/run/postgresql", 5432),
            PathBuf::from("/var/run/postgresql/.s.PGSQL.5432")
        );
        assert_eq!(
            socket_path("/tmp/", 6543),
            PathBuf::from("/tmp/.s.PGSQL.6543")
        );
    }
}
