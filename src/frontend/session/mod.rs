//! The serve loop of a logged-in client.
//!
//! The client's bytes are walked message by message (only headers are read;
//! bodies stream through) and forwarded to a server connection borrowed from
//! the pool at the first message of a transaction. The server's bytes are
//! walked the same way, looking only at ReadyForQuery, ParameterStatus and
//! CommandComplete. In transaction mode the server connection goes back to
//! the pool at the ReadyForQuery 'I' that answers the client's last
//! Sync/Query; in session mode it stays until the client leaves.
//!
//! In transaction mode with `prepared_statements` on, messages that name a
//! prepared statement (Parse, Bind, Describe, Close) are read whole and
//! rewritten by [`super::prepared`]; everything else still streams through.
//!
//! This file holds the session, its phases (parked, busy) and its end;
//! `serve_loop.rs` the busy phase's loop, `client_data.rs` and
//! `server_data.rs` the forwarding each way, `transaction.rs` a
//! transaction's server connection (checkout, pinning, release), and
//! `session_start.rs` hooks, resets put back and settings read back.

use super::abandon::{self, Abandoned};
use super::budget;
use super::client_registry::{ClientHandle, Registration};
use super::client_stream::ClientStream;
use super::close_with_error;
use super::deps::SessionDeps;
use super::flow::{self, ClientStep, Flow, Note, PinStep, ServerStep};
use super::params::{canonical_name, SessionParams};
use super::prepared::{self, ClientStatements, Rewriter};
use super::spare_box::SpareBox;
use super::spare_buffers;
use super::sql_scan::{PinKinds, Reset};
use crate::backend::server_params::SERVER_SET;
use crate::backend::{HeldState, Restore};
use crate::config::{Pinning, PoolMode};
use crate::hooks::{ClientInfo, Event, ServerInfo, SessionCtx, SessionEndCtx, SessionReason, Vars};
use crate::metrics::{self, ErrorSource};
use crate::pool::{Checkout, PinSlot, Pool};
use crate::protocol::error::sqlstate;
use crate::protocol::frames::{FrameWalker, Visit};
use crate::protocol::messages;
use crate::protocol::tags::frontend;
use crate::protocol::PgError;
use bytes::{Buf, BufMut, BytesMut};
use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Instant;
use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt};

mod client_data;
mod serve_loop;
mod server_data;
mod server_lost;
mod session_start;
mod transaction;

pub(crate) use serve_loop::left_while_waiting;
use serve_loop::*;
use session_start::*;

pub(super) use transaction::release_pinned;

/// A logged-in client and what its session wants.
pub struct Session {
    deps: Arc<SessionDeps>,
    /// Who the client is (what hooks see).
    client: ClientInfo,
    /// Values hooks keep for this client between events.
    vars: Vars,
    /// session_start has run for the current session.
    session_started: bool,
    pool: Arc<Pool>,
    params: SessionParams,
    /// The pool's server defaults for reported parameters.
    defaults: Arc<HashMap<String, String>>,
    /// Its registry entry (SHOW CLIENTS, cancel, KILL), until the session ends.
    registration: Registration,
    started: Instant,
    mode: PoolMode,
    /// Bytes this client sent (forwarded to servers) and was sent, for the
    /// disconnect line.
    received: u64,
    sent: u64,
    /// Transaction mode with protocol-level prepared statements on.
    rewriting: bool,
    statements: ClientStatements,
    /// Bytes of this client's read buffer charged to `SessionDeps::buffers`.
    charged: usize,
    /// Session mode: the server connection the login took (the client was
    /// told its backend's pid); the serve loop starts with it.
    login_server: Option<Box<Checkout>>,
    /// Transaction mode: what state that cannot move does (`pinning`).
    pinning: Pinning,
    /// The pool's pin slot this client holds (its server connection is
    /// pinned, or about to be).
    pin_slot: Option<Box<PinSlot>>,
    /// What pinned the connection when it was last logged.
    logged_pins: PinKinds,
    /// The flow between busy phases (the busy phase's `Forwarding` has it
    /// meanwhile), when it remembers anything ([`Flow::at_rest`]).
    flow: Option<Box<Flow>>,
    /// The client's message walker between busy phases.
    in_walker: FrameWalker,
    /// The client counts as connected while its session lasts.
    counted: Option<Counted>,
}

/// What counts a client as connected (the registry's count, the gauge).
pub(crate) type Counted = (
    super::client_registry::Connected,
    crate::metrics::ClientConnected,
);

/// Why the serve loop ended.
enum LoopEnd {
    /// The client sent Terminate or closed its socket.
    ClientLeft,
    /// Tell the client this and close.
    Error(PgError),
    /// usher is shutting down and the client was idle.
    Shutdown,
    /// The server closed the connection after a FATAL the client was
    /// forwarded: nothing more to say (a direct client sees just that).
    ServerFatal,
    /// Not an end: the client holds nothing any more and the busy phase
    /// gives way to the idle wait.
    Idle,
}

/// What the serve task does next.
enum Phase {
    /// Forward ([`Session::busy`], boxed).
    Busy,
    /// Wait for the client, holding nothing ([`Session::parked`]).
    Parked,
    Ended,
}

/// The forwarding state of one client (`fwd` in the serve loop): the server
/// connection it holds, the buffers and walkers of both directions, and
/// the [`Flow`] that decides what happens to each message.
struct Forwarding {
    held: Option<Checkout>,
    /// When the held server connection was checked out.
    lent_at: Instant,
    /// The server connection failed or was closed by the server.
    server_gone: bool,
    /// The server's FATAL (transaction mode), held until its connection
    /// is seen closed ([`ServerStep::Fatal`]).
    fatal: Option<BytesMut>,
    flow: Box<Flow>,
    in_buf: BytesMut,
    out_buf: BytesMut,
    /// Client bytes forwarded but not yet written to the server. The serve
    /// loop writes them while it keeps reading the server, so a client that
    /// pipelines (writing while it reads) cannot deadlock usher and the
    /// server against each other; it reads no more from the client until
    /// they are written.
    to_server: BytesMut,
    in_walker: FrameWalker,
    out_walker: FrameWalker,
    /// What the flow noted in one walk of server bytes, recorded after it
    /// (kept, so a transaction's notes cost no allocation).
    notes: Vec<Note>,
    /// The client's bytes since nothing was in flight, as it sent them
    /// (rewriting only, up to `flow::REPLAY_LIMIT`): a segment whose Bind
    /// met a stale statement is walked again from here.
    copy: BytesMut,
    /// The copy went back in front of `in_buf`: walk it.
    replay: bool,
    /// The walk stopped at a message that waits for the server's answers
    /// (`ClientStep::Wait`): nothing more is read from the client, and the
    /// walk goes on after the next server bytes.
    waiting: bool,
    /// A client message came in whole since the serve loop last looked:
    /// what restarts its timers (bytes of an unfinished one do not).
    message_ended: bool,
}

impl Forwarding {
    /// Client bytes that went (or stand for what went) to the server.
    fn keep_copy(&mut self, bytes: &[u8]) {
        keep_copy(&mut self.flow, &mut self.copy, bytes);
    }

    /// The client is idle again: its buffers go back for the next busy
    /// client on this thread.
    fn give_back_buffers(&mut self) {
        spare_buffers::give_back(&mut self.in_buf);
        spare_buffers::give_back(&mut self.out_buf);
        spare_buffers::give_back(&mut self.to_server);
        spare_buffers::give_back(&mut self.copy);
    }
}

/// Keeps client bytes in the copy of the segment (see [`Forwarding::copy`]).
fn keep_copy(flow: &mut Flow, copy: &mut BytesMut, bytes: &[u8]) {
    if !flow.copying() {
        return;
    }
    if copy.len() + bytes.len() > flow::REPLAY_LIMIT {
        flow.copy_lost();
        *copy = BytesMut::new();
    } else {
        copy.extend_from_slice(bytes);
    }
}

impl Session {
    pub(crate) fn new(
        deps: Arc<SessionDeps>,
        pool: Arc<Pool>,
        params: SessionParams,
        defaults: Arc<HashMap<String, String>>,
        registration: Registration,
        client: ClientInfo,
        vars: Vars,
    ) -> Self {
        // The mode is the pool's at login: a reload that changes it applies
        // to clients that log in afterwards.
        let settings = pool.settings();
        let mode = settings.mode;
        let rewriting = mode == PoolMode::Transaction && settings.prepared_statements > 0;
        let pinning = settings.pinning;
        drop(settings);
        Session {
            deps,
            client,
            vars,
            session_started: false,
            pool,
            params,
            defaults,
            registration,
            started: Instant::now(),
            mode,
            received: 0,
            sent: 0,
            rewriting,
            statements: ClientStatements::default(),
            charged: 0,
            login_server: None,
            pinning,
            pin_slot: None,
            logged_pins: PinKinds::NONE,
            flow: None,
            in_walker: FrameWalker::new(0),
            counted: None,
        }
    }

    /// Session mode: the session will start on the server connection the
    /// login took.
    pub(crate) fn hold_login_server(&mut self, checkout: Checkout) {
        self.login_server = Some(Box::new(checkout));
    }

    /// Session mode, at login: the session begins on the server connection
    /// the login took (session_start hooks, their parameters and
    /// statements), as it would at the first checkout.
    pub(crate) async fn start_on_login_server(
        &mut self,
        client: &mut ClientStream,
    ) -> Result<(), PgError> {
        let Some(mut checkout) = self.login_server.take() else {
            return Ok(());
        };
        match self.start_on_server(client, &mut checkout).await {
            Ok(()) => {
                self.login_server = Some(checkout);
                Ok(())
            }
            Err(e) => {
                self.pool.discard(*checkout);
                Err(e)
            }
        }
    }

    /// Serves the client until it leaves, an error ends it, or shutdown:
    /// the future of the client's task (`counted` is dropped with it).
    ///
    /// That future is what an idle client costs, so it is kept small: it
    /// holds the boxed session, the boxed stream, and either the small wait
    /// of an idle client ([`Session::parked`]) or a boxed busy phase
    /// ([`Session::busy`]: forwarding, its buffers and decisions), which is
    /// given up whenever the client is idle again (its block kept on the
    /// thread for the next busy phase: [`SpareBox`]).
    pub fn serve(
        mut self: Box<Self>,
        client: ClientStream,
        counted: Counted,
    ) -> impl std::future::Future<Output = ()> + Send {
        self.counted = Some(counted);
        self.serve_boxed(Box::new(client))
    }

    async fn serve_boxed(mut self: Box<Self>, mut client: Box<ClientStream>) {
        let client = &mut *client;
        let mut phase = Box::pin(self.begin(client)).await;
        loop {
            phase = match phase {
                Phase::Busy => SpareBox::new_with(|| self.busy(client)).await,
                Phase::Parked => self.parked(client).await,
                Phase::Ended => return,
            };
        }
    }

    /// The session begins: in transaction mode now, with no server
    /// connection (session_start hooks); in session mode when its server
    /// connection is assigned.
    async fn begin(&mut self, client: &mut ClientStream) -> Phase {
        let config = self.deps.config();
        // Messages read whole (named Parse, Describe, Close) are bounded by
        // max_buffered_message; all others stream.
        self.in_walker =
            FrameWalker::new(config.max_message_size).inspect_up_to(config.max_buffered_message);
        drop(config);
        if self.mode == PoolMode::Transaction {
            self.session_started = true;
            if let Err(e) = self
                .start_session(client, SessionReason::NewSession, None)
                .await
            {
                let fwd = self.forwarding();
                Box::pin(self.finish(client, fwd, LoopEnd::Error(e), false)).await;
                return Phase::Ended;
            }
        }
        if self.login_server.is_some() {
            Phase::Busy
        } else {
            Phase::Parked
        }
    }

    /// The client holds nothing (no server connection, no buffer, nothing
    /// half-read): wait until it sends something, or until its idle
    /// timeout (client_idle_timeout), shutdown's drain or KILL ends it.
    async fn parked(&mut self, client: &mut ClientStream) -> Phase {
        let timeout = self
            .pool
            .hot()
            .client_idle_timeout()
            .map(|t| Box::pin(tokio::time::sleep(t)));
        let woken = IdleWait {
            client,
            handle: &self.registration.handle,
            deps: &self.deps,
            timeout,
        }
        .await;
        if woken == Woken::Readable {
            return Phase::Busy;
        }
        Box::pin(self.end_parked(client, woken)).await;
        Phase::Ended
    }

    /// An idle client's session ends.
    async fn end_parked(&mut self, client: &mut ClientStream, woken: Woken) {
        let end = match woken {
            Woken::Readable | Woken::Left => LoopEnd::ClientLeft,
            Woken::TimedOut => LoopEnd::Error(idle_session_timeout()),
            Woken::Draining => LoopEnd::Shutdown,
            Woken::Killed => LoopEnd::Error(killed()),
        };
        let fwd = self.forwarding();
        self.finish(client, fwd, end, false).await;
    }

    /// Forwards until the client is idle again (then its forwarding state
    /// is dropped and the loop parks), or until the session ends.
    async fn busy(&mut self, client: &mut ClientStream) -> Phase {
        let mut fwd = self.forwarding();
        // KILL_CLIENT / KILL end the session wherever it is, even waiting
        // for a server connection; what it held is then in an unknown state.
        let handle = self.registration.handle.clone();
        // Biased (no random draw per poll): the kill is looked at first,
        // and costs one flag read when there is none.
        let (end, interrupted) = tokio::select! {
            biased;
            _ = handle.killed() => (LoopEnd::Error(killed()), true),
            end = self.serve_loop(client, &mut fwd) => (end, false),
        };
        if let LoopEnd::Idle = end {
            fwd.give_back_buffers();
            self.flow = if fwd.flow.at_rest() {
                fwd.flow.give_back();
                None
            } else {
                Some(fwd.flow)
            };
            self.in_walker = fwd.in_walker;
            return Phase::Parked;
        }
        Box::pin(self.finish(client, fwd, end, interrupted)).await;
        Phase::Ended
    }

    /// The forwarding state of a busy phase, from what the session keeps
    /// between them (and, in session mode, the server connection the
    /// login took).
    fn forwarding(&mut self) -> Forwarding {
        let flow = match self.flow.take() {
            Some(flow) => flow,
            None => Flow::take(self.mode, self.rewriting, self.pinning),
        };
        let mut fwd = Forwarding {
            held: None,
            // Set when a server connection is lent (below, or at checkout):
            // no clock read for a phase that may not take one.
            lent_at: self.started,
            server_gone: false,
            fatal: None,
            flow,
            in_buf: BytesMut::new(),
            out_buf: BytesMut::new(),
            to_server: BytesMut::new(),
            in_walker: std::mem::replace(&mut self.in_walker, FrameWalker::new(0)),
            out_walker: FrameWalker::new(usize::MAX >> 1),
            notes: Vec::new(),
            copy: BytesMut::new(),
            replay: false,
            waiting: false,
            message_ended: false,
        };
        if let Some(checkout) = self.login_server.take() {
            self.registration
                .handle
                .set_server(Some(checkout.conn.summary().clone()));
            fwd.held = Some(*checkout);
            fwd.lent_at = Instant::now();
            self.pool.stats.client_active(1);
            spare_buffers::reserve(&mut fwd.out_buf);
        }
        fwd
    }

    /// The session is over: the server connection goes back (or to
    /// recovery), the client is told why if it is still there,
    /// session_end hooks run and the disconnection is logged.
    async fn finish(
        &mut self,
        client: &mut ClientStream,
        mut fwd: Forwarding,
        end: LoopEnd,
        interrupted: bool,
    ) {
        self.registration.handle.set_server(None);
        self.deps.buffers.recharge(&mut self.charged, 0, 0);
        // Pinned or not, the connection is the pool's again from here.
        self.pin_slot = None;
        if let Some(checkout) = fwd.held.take() {
            self.pool.stats.client_active(-1);
            let clean = !interrupted
                && fwd.flow.quiet()
                && fwd.flow.idle()
                && fwd.out_buf.is_empty()
                && fwd.to_server.is_empty();
            match (clean, self.mode) {
                _ if fwd.server_gone => self.pool.discard(checkout),
                (true, PoolMode::Session) => Box::pin(self.pool.reset_and_checkin(checkout)).await,
                (true, PoolMode::Transaction) if !fwd.flow.state_left().is_empty() => {
                    Box::pin(release_pinned(&self.pool, checkout, fwd.flow.state_left())).await
                }
                (true, PoolMode::Transaction) => self.pool.checkin(checkout),
                (false, mode) => {
                    // The server may still be working for the client: the
                    // connection keeps its pool permit until it is idle
                    // again or its backend is gone.
                    let left = Abandoned {
                        checkout,
                        out_buf: std::mem::take(&mut fwd.out_buf),
                        out_walker: std::mem::replace(&mut fwd.out_walker, FrameWalker::new(0)),
                        flow: std::mem::replace(
                            &mut fwd.flow,
                            Flow::take(mode, false, Pinning::Off),
                        ),
                        whole_messages: fwd.in_walker.at_boundary() && fwd.to_server.is_empty(),
                        interrupted,
                    };
                    tokio::spawn(abandon::recover(self.pool.clone(), mode, left));
                }
            }
        }
        match &end {
            LoopEnd::ClientLeft | LoopEnd::ServerFatal | LoopEnd::Idle => {}
            LoopEnd::Error(e) => Box::pin(close_with_error(client, e)).await,
            LoopEnd::Shutdown => {
                let e = PgError::fatal(
                    sqlstate::ADMIN_SHUTDOWN,
                    "terminating connection because usher is shutting down",
                );
                Box::pin(close_with_error(client, &e)).await;
            }
        }
        if self.deps.hooks.handles(Event::SessionEnd) {
            let ctx = SessionEndCtx {
                client: &self.client,
                vars: &self.vars,
                duration: self.started.elapsed(),
            };
            Box::pin(self.deps.hooks.session_end(&ctx)).await;
        }
        if self.deps.config().log.disconnections {
            let (reason, error) = match &end {
                LoopEnd::ClientLeft | LoopEnd::Idle => ("client", None),
                LoopEnd::Error(e) => ("error", Some(e)),
                LoopEnd::Shutdown => ("shutdown", None),
                LoopEnd::ServerFatal => ("server", None),
            };
            tracing::info!(
                user = %self.client.user, database = %self.client.database, addr = %self.client.addr,
                duration_ms = self.started.elapsed().as_millis() as u64,
                bytes_received = self.received, bytes_sent = self.sent,
                reason = %reason, sqlstate = error.map(|e| e.code.as_str()), error = error.map(|e| e.message.as_str()),
                "client disconnected"
            );
        }
    }
}

/// The wait of an idle client: a few pointers, since every idle client
/// holds one. The socket's registration keeps the read waker; the kill
/// switch's waker is also what shutdown's drain pokes.
struct IdleWait<'a> {
    client: &'a ClientStream,
    handle: &'a ClientHandle,
    deps: &'a SessionDeps,
    /// client_idle_timeout, when set.
    timeout: Option<Pin<Box<tokio::time::Sleep>>>,
}

/// What ended an idle client's wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Woken {
    /// It sent something (or closed: the read will say).
    Readable,
    /// Its socket failed.
    Left,
    TimedOut,
    Draining,
    Killed,
}

impl std::future::Future for IdleWait<'_> {
    type Output = Woken;

    fn poll(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<Woken> {
        // The waker is registered before the drain flag is read: a drain
        // that starts in between pokes it.
        if self.handle.poll_killed(cx).is_ready() {
            return Poll::Ready(Woken::Killed);
        }
        if self.deps.is_draining() {
            return Poll::Ready(Woken::Draining);
        }
        match self.client.poll_readable(cx) {
            Poll::Ready(Ok(())) => return Poll::Ready(Woken::Readable),
            Poll::Ready(Err(_)) => return Poll::Ready(Woken::Left),
            Poll::Pending => {}
        }
        if let Some(t) = self.timeout.as_mut() {
            if t.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Woken::TimedOut);
            }
        }
        Poll::Pending
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    /// The size of what `f` returns (a future's, without making one).
    fn output_size<F, A, B, C, R>(_: &F) -> usize
    where
        F: Fn(A, B, C) -> R,
    {
        std::mem::size_of::<R>()
    }

    /// What every idle client holds: the serve task's future (the boxed
    /// session, the stream, the idle wait) and the session. The busy
    /// phase's state is boxed and freed while the client is idle.
    #[test]
    fn an_idle_client_holds_little() {
        let serve = output_size(&Session::serve);
        let session = std::mem::size_of::<Session>();
        eprintln!(
            "serve future {serve} B, Session {session} B (Flow {} B, Forwarding {} B while busy)",
            std::mem::size_of::<Flow>(),
            std::mem::size_of::<Forwarding>()
        );
        // tokio's task cell (128-aligned) stays at 256 B with it.
        assert!(serve <= 128, "serve future {serve} B");
        // Kept small: every idle client holds one of each.
        // (448 before the client caps' place: one pointer.)
        assert!(session <= 456, "Session {session} B");
        let handle = std::mem::size_of::<ClientHandle>();
        assert!(handle <= 240, "ClientHandle {handle} B");
    }
}
