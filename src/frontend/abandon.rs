//! A server connection whose client left in the middle of something.
//!
//! Dropping it would leave PostgreSQL running the client's query on a
//! backend that no pool counts any more: a loop of clients that send a long
//! query and disconnect would fill `max_connections` through a pool of
//! five. So the connection keeps its pool permit (it counts against
//! `pool_size`) until its backend is idle again or gone:
//!
//! - when only whole messages went to the server, the work is cancelled
//!   (a CancelRequest, or CopyFail for COPY FROM STDIN), an open pipeline
//!   gets its Sync, the answers are read and dropped up to the last
//!   ReadyForQuery, an open transaction is rolled back, and the connection
//!   goes back to the pool (reset first in session mode);
//! - otherwise (half a message went out, or something failed) the work is
//!   cancelled, usher's side of the socket is shut down, and usher reads
//!   until the server closes it: then the backend is gone.
//!
//! Both run in a task of their own, bounded by [`RECOVERY_TIMEOUT`].

use super::prepared::ResponsePlan;
use crate::backend::ServerConn;
use crate::config::PoolMode;
use crate::pool::{Checkout, Pool};
use crate::protocol::frames::{FrameWalker, Visit};
use crate::protocol::messages::parse_parameter_status;
use bytes::{BufMut, BytesMut};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The longest a left connection is waited for before it is closed (the
/// salvage) or given up on (waiting for the backend to exit).
pub const RECOVERY_TIMEOUT: Duration = Duration::from_secs(30);

/// Where the conversation with the server stood when the client left.
pub(super) struct Abandoned {
    pub checkout: Checkout,
    /// Server bytes read but not forwarded, and the walker that knows where
    /// their message boundaries are.
    pub out_buf: BytesMut,
    pub out_walker: FrameWalker,
    /// ReadyForQuery messages the server still owes.
    pub pending: u32,
    /// Extended-protocol messages went out after the last Sync.
    pub unsynced: bool,
    /// The server waits for COPY data.
    pub copy_in: bool,
    /// Transaction status of the last ReadyForQuery.
    pub status: u8,
    /// Only whole client messages went to the server.
    pub whole_messages: bool,
    /// The session ended abruptly (KILL): its state is not trusted.
    pub interrupted: bool,
    /// Prepared-statement answers still owed (transaction mode rewriting).
    pub plan: Option<ResponsePlan>,
}

/// Recovers `left` for `pool`, or closes it once its backend is gone.
pub(super) async fn recover(pool: Arc<Pool>, mode: PoolMode, mut left: Abandoned) {
    let id = left.checkout.conn.id;
    let salvaged = if left.whole_messages && !left.interrupted {
        tokio::time::timeout(RECOVERY_TIMEOUT, salvage(&mut left))
            .await
            .unwrap_or(Err("timed out"))
    } else {
        Err("a message was half sent")
    };
    match salvaged {
        Ok(()) => {
            tracing::debug!(
                server = id,
                "server connection recovered from a client that left"
            );
            match mode {
                PoolMode::Session => pool.reset_and_checkin(left.checkout).await,
                PoolMode::Transaction => pool.checkin(left.checkout),
            }
        }
        Err(why) => {
            tracing::debug!(
                server = id,
                why,
                "closing a server connection a client left busy"
            );
            let conn = &mut left.checkout.conn;
            if left.pending > 0 || left.copy_in || left.unsynced {
                cancel(conn).await;
            }
            let _ = tokio::time::timeout(RECOVERY_TIMEOUT, wait_for_close(conn)).await;
            pool.discard(left.checkout);
        }
    }
}

/// Cancels what the server runs, drains its answers and leaves no
/// transaction open.
async fn salvage(left: &mut Abandoned) -> Result<(), &'static str> {
    let mut out = BytesMut::new();
    if left.copy_in {
        // CopyFail ends COPY FROM STDIN with an error (and its transaction).
        out.put_u8(b'f');
        let reason = b"client went away\0";
        out.put_u32(4 + reason.len() as u32);
        out.put_slice(reason);
    } else if left.pending > 0 {
        cancel(&mut left.checkout.conn).await;
    }
    if left.unsynced {
        out.put_slice(&[b'S', 0, 0, 0, 4]);
        left.pending += 1;
        if let Some(plan) = left.plan.as_mut() {
            plan.sync_sent();
        }
    }
    if !out.is_empty() {
        let conn = &mut left.checkout.conn;
        conn.stream
            .write_all(&out)
            .await
            .map_err(|_| "write failed")?;
    }
    let mut status = left.status;
    while left.pending > 0 || !left.out_walker.at_boundary() {
        status = drain_some(left).await?.unwrap_or(status);
    }
    if status != b'I' {
        // Inside a transaction block (or a failed one): roll it back.
        left.checkout
            .conn
            .simple_query("ROLLBACK")
            .await
            .map_err(|_| "ROLLBACK failed")?;
    }
    Ok(())
}

/// Reads what the server sent next and walks it, keeping the connection's
/// own records (parameters, prepared statements) true. Returns the status
/// of the last ReadyForQuery in it.
async fn drain_some(left: &mut Abandoned) -> Result<Option<u8>, &'static str> {
    if left.out_buf.is_empty() {
        left.out_buf.reserve(16 * 1024);
        let n = left
            .checkout
            .conn
            .stream
            .read_buf(&mut left.out_buf)
            .await
            .map_err(|_| "read failed")?;
        if n == 0 {
            return Err("the server closed the connection");
        }
    }
    let conn: &mut ServerConn = &mut left.checkout.conn;
    let plan = &mut left.plan;
    let pending = &mut left.pending;
    let mut status = None;
    let mut copy_in = false;
    let walked = left
        .out_walker
        .walk(
            &left.out_buf,
            |tag, _| matches!(tag, b'Z' | b'S' | b'C'),
            |tag, body| {
                match tag {
                    b'Z' => {
                        *pending = pending.saturating_sub(1);
                        status = body.first().copied();
                        if let Some(plan) = plan.as_mut() {
                            plan.ready(conn);
                        }
                    }
                    b'S' => {
                        if let Some((name, value)) = parse_parameter_status(body) {
                            conn.params.insert(name, value);
                        }
                    }
                    b'C' if body == b"DISCARD ALL\0" || body == b"DEALLOCATE ALL\0" => {
                        conn.prepared.clear();
                    }
                    b'1' | b'3' => {
                        if let Some(plan) = plan.as_mut() {
                            plan.answer(tag, conn);
                        }
                    }
                    b'G' => copy_in = true,
                    _ => {}
                }
                Visit::Forward
            },
        )
        .map_err(|_| "bad message from the server")?;
    let _ = left.out_buf.split_to(walked.forward);
    if copy_in {
        // A queued COPY FROM STDIN began after the cancel: end it too.
        return Err("a COPY began");
    }
    Ok(status)
}

/// Sends a cancel request for whatever the connection runs.
async fn cancel(conn: &mut ServerConn) {
    let target = conn.summary.cancel.clone();
    if let Err(e) = target.send().await {
        tracing::warn!(server = conn.id, error = %e, "could not cancel the query of a client that left");
    }
}

/// Shuts usher's side down and reads until the server closes its side: the
/// backend has then exited.
async fn wait_for_close(conn: &mut ServerConn) {
    let _ = conn.stream.shutdown().await;
    let mut sink = vec![0u8; 16 * 1024];
    while let Ok(n) = conn.stream.read(&mut sink).await {
        if n == 0 {
            break;
        }
    }
}
