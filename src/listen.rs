//! The listening socket for clients: bound with SO_REUSEADDR, and with
//! SO_REUSEPORT when `so_reuseport` is on, so another usher may bind the
//! same address (a rolling restart: the new one starts, the old one gets
//! SIGTERM, closes its socket at once and lets its clients finish).
//!
//! With SO_REUSEPORT the kernel spreads new connections over every socket
//! bound to the address, and the ones queued on a socket when it closes
//! are reset. So a shutdown takes what is queued ([`drain_backlog`]) and
//! closes in the same moment; `net.ipv4.tcp_migrate_req = 1` (Linux 5.14+)
//! has the kernel move even half-open ones to another socket
//! (docs/operations.md, "Running several instances").

use std::io;
use std::net::SocketAddr;
use tokio::net::{TcpListener, TcpSocket, TcpStream};

/// The backlog tokio's own `TcpListener::bind` uses.
const BACKLOG: u32 = 1024;

/// Binds and listens on `addr`.
pub fn bind(addr: SocketAddr, reuseport: bool) -> io::Result<TcpListener> {
    let socket = match addr {
        SocketAddr::V4(_) => TcpSocket::new_v4()?,
        SocketAddr::V6(_) => TcpSocket::new_v6()?,
    };
    // As tokio's TcpListener::bind: a restart binds despite TIME_WAIT.
    socket.set_reuseaddr(true)?;
    if reuseport {
        socket.set_reuseport(true)?;
    }
    socket.bind(addr)?;
    socket.listen(BACKLOG)
}

/// Closes the listener, first accepting every connection the kernel has
/// already queued on it (their handshake is done: closing would reset
/// them). Those are returned to be served as any other.
pub fn drain_backlog(listener: TcpListener) -> Vec<(TcpStream, SocketAddr)> {
    let mut queued = Vec::new();
    // Out of tokio's hands, the accept calls are made now, whatever the
    // reactor last saw; the socket stays non-blocking.
    let Ok(listener) = listener.into_std() else {
        return queued;
    };
    loop {
        match listener.accept() {
            Ok((stream, addr)) => {
                let stream = stream
                    .set_nonblocking(true)
                    .and_then(|()| TcpStream::from_std(stream));
                match stream {
                    Ok(s) => queued.push((s, addr)),
                    Err(e) => {
                        tracing::warn!(error = %e, "a queued connection was lost at shutdown")
                    }
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            // WouldBlock: the queue is empty. Anything else: nothing more
            // can be taken.
            Err(_) => break,
        }
    }
    drop(listener);
    queued
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn two_sockets_share_a_port_only_with_reuseport() {
        let first = bind("127.0.0.1:0".parse().unwrap(), true).unwrap();
        let addr = first.local_addr().unwrap();
        let second = bind(addr, true).expect("a second socket with SO_REUSEPORT");
        assert!(bind(addr, false).is_err(), "without it the port is taken");
        drop(second);
    }

    #[tokio::test]
    async fn queued_connections_are_taken_before_the_socket_closes() {
        let listener = bind("127.0.0.1:0".parse().unwrap(), false).unwrap();
        let addr = listener.local_addr().unwrap();
        // The handshake is the kernel's: these wait in the backlog.
        let clients = [
            std::net::TcpStream::connect(addr).unwrap(),
            std::net::TcpStream::connect(addr).unwrap(),
        ];
        let queued = drain_backlog(listener);
        assert_eq!(queued.len(), clients.len());
        assert!(
            std::net::TcpStream::connect(addr).is_err(),
            "the socket is closed"
        );
    }
}
