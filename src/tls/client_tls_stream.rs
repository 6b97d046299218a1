//! A client's TLS connection that holds no buffer while the client is idle.
//!
//! rustls' buffered `ServerConnection` keeps a 4 KiB read buffer for life
//! (its deframer never shrinks below one read), which was most of what an
//! idle TLS client cost (tests/it/memory.rs). This stream drives rustls'
//! unbuffered API instead: the TLS bytes read, the plaintext not yet taken
//! and the TLS bytes not yet written are its own buffers, each freed as soon
//! as it is empty. What is left while idle is rustls' connection state
//! (keys and the protocol state machine).
//!
//! Writes return once their bytes are on the socket, as with TCP (what
//! [`super::WriteThrough`] does for a buffered stream): a write that
//! returned `Pending` must be retried with the same bytes, as `write_all`
//! and every tokio helper does.

use bytes::{Buf, BytesMut};
use rustls::server::UnbufferedServerConnection;
use rustls::unbuffered::{ConnectionState, EncodeError, EncryptError, UnbufferedStatus};
use rustls::ServerConfig;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// TLS bytes asked of the socket at once: a whole record of the largest
/// size, and its header.
const READ_SIZE: usize = 16 * 1024 + 512;

/// Server-side TLS over a TCP stream; see the module documentation.
pub struct ClientTlsStream {
    tcp: TcpStream,
    conn: UnbufferedServerConnection,
    /// TLS bytes read and not yet processed (a partial record at most,
    /// between reads).
    incoming: BytesMut,
    /// Plaintext decrypted and not yet read.
    plaintext: BytesMut,
    /// TLS bytes to write, from `sent` on.
    outgoing: Vec<u8>,
    sent: usize,
    /// Plaintext bytes of the write in progress: encrypted, not yet
    /// reported to the writer (their TLS bytes are not all on the socket).
    accepted: usize,
    /// The peer sent close_notify: no more plaintext will come.
    peer_closed: bool,
    /// usher sent close_notify.
    closed: bool,
}

impl std::fmt::Debug for ClientTlsStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTlsStream")
            .field("tcp", &self.tcp)
            .field("incoming", &self.incoming.len())
            .field("plaintext", &self.plaintext.len())
            .field("outgoing", &(self.outgoing.len() - self.sent))
            .finish_non_exhaustive()
    }
}

/// What [`ClientTlsStream::drive`] does once application data may be written.
#[derive(Clone, Copy)]
enum Then<'a> {
    Nothing,
    Encrypt(&'a [u8]),
    CloseNotify,
}

/// Where the connection stands once every buffered record is processed.
enum Driven {
    /// More TLS bytes are needed (the handshake waits, or there is no
    /// plaintext to read).
    NeedInput,
    /// Application data may be written (the handshake may still wait for
    /// the client's Finished: `is_handshaking`).
    MayWrite,
    /// The plaintext given (or close_notify) was encrypted into `outgoing`.
    Encrypted,
    /// Both sides closed.
    Closed,
}

fn tls_error(e: rustls::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

impl ClientTlsStream {
    /// Runs the handshake on `tcp` (after usher answered `S`).
    pub async fn accept(tcp: TcpStream, config: Arc<ServerConfig>) -> io::Result<ClientTlsStream> {
        let conn = UnbufferedServerConnection::new(config).map_err(tls_error)?;
        let mut tls = ClientTlsStream {
            tcp,
            conn,
            incoming: BytesMut::new(),
            plaintext: BytesMut::new(),
            outgoing: Vec::new(),
            sent: 0,
            accepted: 0,
            peer_closed: false,
            closed: false,
        };
        loop {
            let driven = match tls.drive(Then::Nothing) {
                Ok(d) => d,
                Err(e) => {
                    // The alert rustls queued for the client goes out
                    // first, as the buffered stream sends it.
                    tls.encode_pending_alerts();
                    let _ = std::future::poll_fn(|cx| tls.poll_send(cx)).await;
                    return Err(e);
                }
            };
            std::future::poll_fn(|cx| tls.poll_send(cx)).await?;
            match driven {
                Driven::MayWrite if !tls.conn.is_handshaking() => return Ok(tls),
                Driven::Closed => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the client closed during the TLS handshake",
                    ))
                }
                _ => {
                    if std::future::poll_fn(|cx| tls.poll_fill(cx)).await? == 0 {
                        return Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "tls handshake eof",
                        ));
                    }
                }
            }
        }
    }

    pub fn tcp(&self) -> &TcpStream {
        &self.tcp
    }

    /// rustls' view of the connection (certificates, version, cipher).
    pub fn connection(&self) -> &UnbufferedServerConnection {
        &self.conn
    }

    /// True when a read would not wait for the socket: plaintext or TLS
    /// bytes are buffered, or the peer closed.
    pub fn has_buffered_input(&self) -> bool {
        !self.plaintext.is_empty() || !self.incoming.is_empty() || self.peer_closed
    }

    /// Processes the buffered TLS bytes until rustls needs more or lets
    /// application data be written; then does `then`.
    /// Decrypted records go to `plaintext`, handshake and alert records to
    /// `outgoing` (the caller sends them).
    fn drive(&mut self, then: Then<'_>) -> io::Result<Driven> {
        loop {
            let UnbufferedStatus { discard, state } =
                self.conn.process_tls_records(&mut self.incoming[..]);
            let done = match state.map_err(tls_error)? {
                ConnectionState::ReadTraffic(mut traffic) => {
                    while let Some(record) = traffic.next_record() {
                        self.plaintext
                            .extend_from_slice(record.map_err(tls_error)?.payload);
                    }
                    None
                }
                ConnectionState::ReadEarlyData(mut early) => {
                    // Not offered (max_early_data_size is 0); taken as data.
                    while let Some(record) = early.next_record() {
                        self.plaintext
                            .extend_from_slice(record.map_err(tls_error)?.payload);
                    }
                    None
                }
                ConnectionState::EncodeTlsData(mut encode) => {
                    let start = self.outgoing.len();
                    match encode.encode(&mut []) {
                        Err(EncodeError::InsufficientSize(need)) => {
                            self.outgoing.resize(start + need.required_size, 0);
                            let n = encode
                                .encode(&mut self.outgoing[start..])
                                .map_err(|e| io::Error::other(e.to_string()))?;
                            self.outgoing.truncate(start + n);
                        }
                        Err(e) => return Err(io::Error::other(e.to_string())),
                        Ok(_) => {}
                    }
                    None
                }
                // What was encoded is in `outgoing`, which the caller sends
                // before it waits for anything.
                ConnectionState::TransmitTlsData(transmit) => {
                    transmit.done();
                    None
                }
                ConnectionState::BlockedHandshake => Some(Driven::NeedInput),
                ConnectionState::PeerClosed => {
                    self.peer_closed = true;
                    None
                }
                ConnectionState::Closed => {
                    self.peer_closed = true;
                    Some(Driven::Closed)
                }
                ConnectionState::WriteTraffic(mut traffic) => {
                    let mut encrypt = |out: &mut [u8]| match then {
                        Then::Encrypt(data) => traffic.encrypt(data, out),
                        _ => traffic.queue_close_notify(out),
                    };
                    if let Then::Nothing = then {
                        Some(Driven::MayWrite)
                    } else {
                        let start = self.outgoing.len();
                        let n = match encrypt(&mut []) {
                            Err(EncryptError::InsufficientSize(need)) => {
                                self.outgoing.resize(start + need.required_size, 0);
                                encrypt(&mut self.outgoing[start..])
                                    .map_err(|e| io::Error::other(e.to_string()))?
                            }
                            Err(e) => return Err(io::Error::other(e.to_string())),
                            Ok(n) => n,
                        };
                        self.outgoing.truncate(start + n);
                        Some(Driven::Encrypted)
                    }
                }
                _ => return Err(io::Error::other("unexpected TLS connection state")),
            };
            self.incoming.advance(discard);
            if self.incoming.is_empty() {
                // Idle clients keep no buffer.
                self.incoming = BytesMut::new();
            }
            if let Some(driven) = done {
                return Ok(driven);
            }
        }
    }

    /// After an error: encodes what rustls queued (an alert), if anything.
    fn encode_pending_alerts(&mut self) {
        for _ in 0..4 {
            let UnbufferedStatus { state, .. } = self.conn.process_tls_records(&mut []);
            let Ok(ConnectionState::EncodeTlsData(mut encode)) = state else {
                return;
            };
            let start = self.outgoing.len();
            if let Err(EncodeError::InsufficientSize(need)) = encode.encode(&mut []) {
                self.outgoing.resize(start + need.required_size, 0);
                match encode.encode(&mut self.outgoing[start..]) {
                    Ok(n) => self.outgoing.truncate(start + n),
                    Err(_) => {
                        self.outgoing.truncate(start);
                        return;
                    }
                }
            }
        }
    }

    /// Writes `outgoing` to the socket; its buffer is freed once sent.
    fn poll_send(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.sent < self.outgoing.len() {
            let n = ready!(Pin::new(&mut self.tcp).poll_write(cx, &self.outgoing[self.sent..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.sent += n;
        }
        self.outgoing = Vec::new();
        self.sent = 0;
        Poll::Ready(Ok(()))
    }

    /// Reads TLS bytes from the socket; 0 at its end.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        if self.incoming.capacity() - self.incoming.len() < READ_SIZE / 4 {
            self.incoming.reserve(READ_SIZE);
        }
        tokio_util::io::poll_read_buf(Pin::new(&mut self.tcp), cx, &mut self.incoming)
    }
}

impl AsyncRead for ClientTlsStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if !this.plaintext.is_empty() {
                let n = this.plaintext.len().min(buf.remaining());
                buf.put_slice(&this.plaintext[..n]);
                this.plaintext.advance(n);
                if this.plaintext.is_empty() {
                    this.plaintext = BytesMut::new();
                }
                return Poll::Ready(Ok(()));
            }
            // Handshake records rustls answers (a key update) go out; a
            // full socket does not hold up reading.
            if let Poll::Ready(Err(e)) = this.poll_send(cx) {
                return Poll::Ready(Err(e));
            }
            this.drive(Then::Nothing)?;
            if !this.plaintext.is_empty() {
                continue;
            }
            if this.peer_closed {
                return Poll::Ready(Ok(()));
            }
            if ready!(this.poll_fill(cx))? == 0 {
                // The socket ended without close_notify (what rustls'
                // reader says then).
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "peer closed connection without sending TLS close_notify",
                )));
            }
        }
    }
}

impl AsyncWrite for ClientTlsStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.accepted == 0 {
            if buf.is_empty() {
                return Poll::Ready(Ok(0));
            }
            // What an earlier write or a handshake answer left goes first.
            ready!(this.poll_send(cx))?;
            match this.drive(Then::Encrypt(buf))? {
                Driven::Encrypted => this.accepted = buf.len(),
                _ => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::NotConnected,
                        "the TLS connection cannot send data",
                    )))
                }
            }
        }
        ready!(this.poll_send(cx))?;
        let n = std::mem::take(&mut this.accepted);
        Poll::Ready(Ok(n.min(buf.len())))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().poll_send(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.closed {
            this.closed = true;
            // Best effort, as the buffered stream's: the socket is shut
            // down whatever rustls says.
            let _ = this.drive(Then::CloseNotify);
        }
        ready!(this.poll_send(cx))?;
        Pin::new(&mut this.tcp).poll_shutdown(cx)
    }
}
