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
//!   gets a failing Parse and a Sync (so what it did is rolled back, never
//!   committed), the answers are read and dropped up to the last
//!   ReadyForQuery, an open transaction is rolled back, and the connection
//!   goes back to the pool (reset first in session mode, and in
//!   transaction mode if the client held state on it that pins);
//! - otherwise (half a message went out, or something failed) the work is
//!   cancelled, usher's side of the socket is shut down, and usher reads
//!   until the server closes it: then the backend is gone.
//!
//! Both run in a task of their own, bounded by [`RECOVERY_TIMEOUT`].

use super::flow::{Flow, Note};
use crate::backend::ServerConn;
use crate::config::PoolMode;
use crate::pool::{Checkout, Pool};
use crate::protocol::frames::{FrameWalker, Visit};
use crate::protocol::tags::frontend;
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
    /// The session's flow: what the server still owes, COPY IN, the
    /// transaction status, the prepared-statement answers owed.
    pub flow: Box<Flow>,
    /// Only whole client messages went to the server.
    pub whole_messages: bool,
    /// The session ended abruptly (KILL): its state is not trusted.
    pub interrupted: bool,
}

/// Recovers `left` for `pool`, or closes it once its backend is gone.
pub(super) async fn recover(pool: Arc<Pool>, mode: PoolMode, mut left: Abandoned) {
    let id = left.checkout.conn.id();
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
            // Whatever it holds as its unnamed statement, it is nobody's
            // the next client may count on.
            left.checkout.conn.prepared_mut().set_unnamed(None);
            let state = left.flow.state_left();
            match mode {
                PoolMode::Session => pool.reset_and_checkin(left.checkout).await,
                // A pinned client's state goes with a reset.
                PoolMode::Transaction if !state.is_empty() => {
                    super::session::release_pinned(&pool, left.checkout, state).await
                }
                // Settings the client changed and nobody read back: the
                // connection's record of them is not true any more, and
                // the next client must not find them.
                PoolMode::Transaction if left.flow.settings_unsettled() => {
                    pool.reset_pinned_and_checkin(left.checkout).await
                }
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
            let flow = &left.flow;
            if flow.pending() > 0 || flow.copy_in() || flow.unsynced() {
                cancel(conn).await;
            }
            let _ = tokio::time::timeout(RECOVERY_TIMEOUT, wait_for_close(conn)).await;
            pool.discard(left.checkout);
        }
    }
}

/// Cancels what the server runs, drains its answers and leaves no
/// transaction open. Nothing the client did not sync is committed.
async fn salvage(left: &mut Abandoned) -> Result<(), &'static str> {
    let mut out = BytesMut::new();
    if left.flow.copy_in() {
        // CopyFail ends COPY FROM STDIN with an error (and its transaction).
        out.put_u8(frontend::COPY_FAIL);
        let reason = b"client went away\0";
        out.put_u32(4 + reason.len() as u32);
        out.put_slice(reason);
        left.flow.client_message(frontend::COPY_FAIL, reason);
    } else if left.flow.pending() > 0 || left.flow.unsynced() {
        // An unsynced Execute may still be running, too.
        cancel(&mut left.checkout.conn).await;
    }
    if left.flow.unsynced() {
        // A Sync alone would commit what the pipeline did in its implicit
        // transaction; the client never asked for that. A message that
        // fails first makes the Sync roll it back, as PostgreSQL does when
        // a client leaves (an error already there has the same effect).
        put_failing_parse(&mut out);
        out.put_slice(&[frontend::SYNC, 0, 0, 0, 4]);
        left.flow.sync_added();
    }
    if !out.is_empty() {
        let conn = &mut left.checkout.conn;
        conn.stream_mut()
            .write_all(&out)
            .await
            .map_err(|_| "write failed")?;
    }
    drain(left).await?;
    if !left.flow.idle() {
        // Inside a transaction block (or a failed one): roll it back.
        left.checkout
            .conn
            .simple_query("ROLLBACK")
            .await
            .map_err(|_| "ROLLBACK failed")?;
    }
    Ok(())
}

/// The text of [`put_failing_parse`]'s statement: a syntax error on every
/// server, whatever the session.
const FAILING_TEXT: &[u8] = b"usher: the client left without Sync\0";

/// A Parse that always fails (a syntax error, checked before its name is):
/// named, so the server's unnamed statement is untouched.
fn put_failing_parse(out: &mut BytesMut) {
    let name = b"usher_client_left\0";
    out.put_u8(frontend::PARSE);
    out.put_u32((4 + name.len() + FAILING_TEXT.len() + 2) as u32);
    out.put_slice(name);
    out.put_slice(FAILING_TEXT);
    out.put_u16(0);
}

/// Reads and walks the server's answers until nothing more is owed and
/// the last message is whole. Every turn that cannot finish awaits a read,
/// so [`RECOVERY_TIMEOUT`] holds and the worker is never kept.
async fn drain(left: &mut Abandoned) -> Result<(), &'static str> {
    loop {
        walk_buffered(left)?;
        if left.flow.copy_in() {
            // A queued COPY FROM STDIN began after the cancel: end it too.
            return Err("a COPY began");
        }
        if left.flow.pending() == 0 && left.out_walker.at_boundary() {
            return Ok(());
        }
        // What is buffered (if anything) is the start of a message the
        // walker needs more of.
        left.out_buf.reserve(16 * 1024);
        let n = left
            .checkout
            .conn
            .stream_mut()
            .read_buf(&mut left.out_buf)
            .await
            .map_err(|_| "read failed")?;
        if n == 0 {
            return Err("the server closed the connection");
        }
    }
}

/// Walks the server bytes buffered through the flow, keeping the
/// connection's own records (parameters, prepared statements) true, and
/// drops the whole messages walked.
fn walk_buffered(left: &mut Abandoned) -> Result<(), &'static str> {
    if left.out_buf.is_empty() {
        return Ok(());
    }
    let conn: &mut ServerConn = &mut left.checkout.conn;
    let flow = &mut left.flow;
    let mut parameters = Vec::new();
    let walked = left
        .out_walker
        .walk(&left.out_buf, Flow::server_wants_body, |tag, body| {
            if let (_, Some(Note::Parameter { name, value, .. })) =
                flow.server_message(tag, body, conn.prepared_mut(), false)
            {
                parameters.push((name, value));
            }
            Visit::Forward
        })
        .map_err(|_| "bad message from the server")?;
    for (name, value) in parameters {
        conn.note_parameter(&name, &value);
    }
    let _ = left.out_buf.split_to(walked.forward);
    Ok(())
}

/// Sends a cancel request for whatever the connection runs.
async fn cancel(conn: &mut ServerConn) {
    let target = conn.summary().cancel.clone();
    if let Err(e) = target.send().await {
        tracing::warn!(server = conn.id(), error = %e, "could not cancel the query of a client that left");
    }
}

/// Shuts usher's side down and reads until the server closes its side: the
/// backend has then exited.
async fn wait_for_close(conn: &mut ServerConn) {
    let _ = conn.stream_mut().shutdown().await;
    let mut sink = vec![0u8; 16 * 1024];
    while let Ok(n) = conn.stream_mut().read(&mut sink).await {
        if n == 0 {
            break;
        }
    }
}
