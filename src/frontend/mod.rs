//! One task per client: startup → authentication → session → serve loop.
//!
//! - [`login`]: the startup phase up to ReadyForQuery.
//! - [`session`]: the serve loop that borrows server connections from the
//!   pool and forwards bytes both ways.
//! - [`params`]: the session's parameters, carried to every server connection.
//! - [`registry`]: connected clients by BackendKeyData, for cancel requests.
//! - [`slots`]: login slots, in all and per address.
//! - [`stream`]: the client's connection, plain or TLS.
//! - [`flow`]: the forwarding decisions, without I/O (unit-tested).
//! - [`budget`]: the memory all clients' read buffers may hold together.
//! - [`abandon`]: a server connection its client left busy: cancelled,
//!   drained and reused, or closed once its backend is gone.

mod abandon;
pub(crate) mod budget;
pub mod deps;
pub(crate) mod flow;
pub(crate) mod login;
pub(crate) mod params;
pub mod prepared;
pub(crate) mod registry;
pub(crate) mod session;
pub(crate) mod slots;
pub(crate) mod sql_scan;
pub(crate) mod stream;

use crate::metrics::ErrorSource;
use crate::protocol::{PgError, Severity};
use bytes::BytesMut;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// What a client is told when no server connection could be had for it.
impl From<crate::pool::CheckoutError> for PgError {
    fn from(e: crate::pool::CheckoutError) -> PgError {
        use crate::pool::CheckoutError;
        use crate::protocol::error::sqlstate;
        match e {
            CheckoutError::Closed => PgError::fatal(sqlstate::ADMIN_SHUTDOWN, "pool is closed"),
            CheckoutError::NoneFree {
                database,
                user,
                waited,
                pool_size,
                paused,
            } => {
                let detail = if paused {
                    format!(
                        "database \"{database}\" is paused (PAUSE or KILL on the admin console)"
                    )
                } else {
                    format!(
                        "pool \"{database}\"/\"{user}\" has pool_size {pool_size} and all connections are in use"
                    )
                };
                PgError::fatal(
                    sqlstate::TOO_MANY_CONNECTIONS,
                    format!(
                        "no server connection became free within query_wait_timeout ({:.1}s)",
                        waited.as_secs_f64()
                    ),
                )
                .with_detail(detail)
            }
            CheckoutError::Connect(e) => e,
        }
    }
}

/// Sends an error (or notice) to a client; failures to write are ignored,
/// since the client is usually about to be disconnected anyway.
pub async fn send_error<S: AsyncWrite + Unpin>(stream: &mut S, error: &PgError) {
    count_error(error);
    let mut buf = BytesMut::new();
    error.encode(&mut buf);
    let _ = stream.write_all(&buf).await;
    let _ = stream.flush().await;
}

/// Counts an error usher itself sends a client (`usher_errors_total`,
/// source `usher`); warnings and notices are not errors.
pub fn count_error(error: &PgError) {
    if matches!(error.severity, Severity::Error | Severity::Fatal) {
        crate::metrics::count_error(ErrorSource::Usher, error.code.as_bytes());
    }
}

/// Sends a final error and closes the connection so that the client reads
/// it: closing a socket with unread input makes the kernel reset the
/// connection, which can destroy the error before the client sees it, so
/// the unread input is drained (briefly, and boundedly) after our FIN.
pub async fn close_with_error<S: AsyncRead + AsyncWrite + Unpin>(stream: &mut S, error: &PgError) {
    send_error(stream, error).await;
    let _ = stream.shutdown().await;
    // On the heap: an array here would make this future (and every client
    // task that may call it) 4 KB larger for the client's whole life.
    let mut sink = vec![0u8; 4096];
    // Read what the client is still sending before closing: closing with
    // unread bytes makes the kernel send a reset, and the client may lose
    // the error it was just sent (a client in the middle of writing a
    // message too large for usher would see only "connection closed").
    // Bounded in time and bytes, so a client cannot hold its task.
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        let mut total = 0;
        while total < 64 << 20 {
            match stream.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(n) => total += n,
            }
        }
    })
    .await;
}
