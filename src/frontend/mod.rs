//! One task per client: startup → authentication → session → serve loop.
//!
//! - [`login`]: the startup phase up to ReadyForQuery.
//! - [`session`]: the serve loop that borrows server connections from the
//!   pool and forwards bytes both ways.
//! - [`params`]: the session's parameters, carried to every server connection.
//! - [`registry`]: connected clients by BackendKeyData, for cancel requests.

pub mod login;
pub mod params;
pub mod registry;
pub mod session;

use crate::protocol::PgError;
use bytes::BytesMut;
use tokio::io::{AsyncWrite, AsyncWriteExt};

/// Sends an error (or notice) to a client; failures to write are ignored,
/// since the client is usually about to be disconnected anyway.
pub async fn send_error<S: AsyncWrite + Unpin>(stream: &mut S, error: &PgError) {
    let mut buf = BytesMut::new();
    error.encode(&mut buf);
    let _ = stream.write_all(&buf).await;
    let _ = stream.flush().await;
}
