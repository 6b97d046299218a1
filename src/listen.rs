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
//!
//! With several worker threads each accepts on a socket of its own
//! ([`bind_each`]): the sockets share the address through SO_REUSEPORT
//! and the kernel spreads connections over them, so a client is accepted
//! on the thread that serves it (no thread that only accepts, no hand-over
//! between threads). Without `so_reuseport`, the address must still be
//! free of anyone else's socket: that is checked first.

use std::io;
use std::net::SocketAddr;
use tokio::net::{TcpListener, TcpSocket, TcpStream};

/// The backlog tokio's own `TcpListener::bind` uses.
const BACKLOG: u32 = 1024;

/// A socket of `addr`'s family with SO_REUSEADDR (as tokio's
/// TcpListener::bind: a restart binds despite TIME_WAIT).
fn new_socket(addr: SocketAddr) -> io::Result<TcpSocket> {
    let socket = match addr {
        SocketAddr::V4(_) => TcpSocket::new_v4()?,
        SocketAddr::V6(_) => TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    Ok(socket)
}

/// Binds and listens on `addr`.
pub fn bind(addr: SocketAddr, reuseport: bool) -> io::Result<TcpListener> {
    let socket = new_socket(addr)?;
    if reuseport {
        socket.set_reuseport(true)?;
    }
    socket.bind(addr)?;
    socket.listen(BACKLOG)
}

/// Binds `n` listening sockets (at least one) to `addr` for the worker
/// threads, not yet registered with any runtime (each thread takes its
/// own: `TcpListener::from_std`). One is [`bind`] as it is; more share the
/// address with SO_REUSEPORT, after a socket bound without it showed that
/// nobody else holds the address, unless `reuseport` allows sharing it
/// anyway. A port of 0 is the first socket's for the others.
pub fn bind_each(
    addr: SocketAddr,
    reuseport: bool,
    n: usize,
) -> io::Result<Vec<std::net::TcpListener>> {
    let first = |share: bool| bind(addr, share).and_then(TcpListener::into_std);
    if n <= 1 {
        return Ok(vec![first(reuseport)?]);
    }
    if !reuseport && addr.port() != 0 {
        // Fails as a plain bind would while another socket holds it.
        // Bound, not listening: no connection can reach it meanwhile.
        new_socket(addr)?.bind(addr)?;
    }
    let mut listeners = vec![first(true)?];
    let addr = listeners[0].local_addr()?;
    for _ in 1..n {
        listeners.push(bind(addr, true)?.into_std()?);
    }
    Ok(listeners)
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
    async fn each_worker_gets_a_socket_on_the_same_address() {
        let listeners = bind_each("127.0.0.1:0".parse().unwrap(), false, 3).unwrap();
        let addr = listeners[0].local_addr().unwrap();
        assert!(listeners.iter().all(|l| l.local_addr().unwrap() == addr));
        // Connections reach one of them.
        let _client = std::net::TcpStream::connect(addr).unwrap();
        // Nobody else binds the address without SO_REUSEPORT...
        assert!(bind(addr, false).is_err());
        drop(listeners);
        // ...and without so_reuseport, usher does not join another
        // socket that shares its address (another usher's with
        // so_reuseport), though its own sockets share it; with it, it does.
        let other = bind("127.0.0.1:0".parse().unwrap(), true).unwrap();
        let taken = other.local_addr().unwrap();
        assert!(bind_each(taken, false, 2).is_err());
        assert_eq!(bind_each(taken, true, 2).unwrap().len(), 2);
        // One worker binds as before.
        let one = bind_each("127.0.0.1:0".parse().unwrap(), false, 1).unwrap();
        assert_eq!(one.len(), 1);
        assert!(
            bind(one[0].local_addr().unwrap(), true).is_err(),
            "no SO_REUSEPORT on it"
        );
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
