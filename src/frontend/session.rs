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

use super::abandon::{self, Abandoned};
use super::budget;
use super::client_registry::{ClientHandle, Registration};
use super::client_stream::ClientStream;
use super::close_with_error;
use super::deps::SessionDeps;
use super::flow::{self, ClientStep, Flow, Note, PinStep, ServerStep};
use super::params::{canonical_name, SessionParams};
use super::prepared::{self, ClientStatements, Rewriter};
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
    flow: Flow,
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
    /// freed whenever the client is idle again.
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
                Phase::Busy => Box::pin(self.busy(client)).await,
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
            .settings()
            .client_idle_timeout
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
            self.flow = (!fwd.flow.at_rest()).then(|| Box::new(fwd.flow));
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
            Some(flow) => *flow,
            None => Flow::new(self.mode, self.rewriting, self.pinning),
        };
        let mut fwd = Forwarding {
            held: None,
            lent_at: Instant::now(),
            server_gone: false,
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
                            Flow::new(mode, false, Pinning::Off),
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

    async fn serve_loop(&mut self, client: &mut ClientStream, fwd: &mut Forwarding) -> LoopEnd {
        let mut shutdown = self.deps.draining();
        let pool = self.pool.clone();
        // The phase began because the client was readable (or holds its
        // login's server connection): it parks only after an event.
        let mut woke = false;
        // Coming from the parked wait, the socket was just seen readable:
        // the first read need not ask again.
        let mut known_readable = fwd.held.is_none();
        let mut idle_timer: Option<Deadline> = None;
        let mut message_timer: Option<Deadline> = None;
        loop {
            let between_messages =
                fwd.flow.quiet() && fwd.in_walker.at_boundary() && fwd.to_server.is_empty();
            // A client may be ended by shutdown only between transactions.
            let idle = fwd.held.is_none() || (between_messages && fwd.flow.idle());
            if idle && *shutdown.borrow() {
                return LoopEnd::Shutdown;
            }
            if fwd.in_buf.is_empty()
                && (fwd.held.is_none() && fwd.in_buf.capacity() > 0
                    || fwd.in_buf.capacity() > budget::FREE_BYTES)
            {
                // An idle client keeps no buffer, and nobody keeps a large
                // one once the message that needed it is gone.
                spare_buffers::give_back(&mut fwd.in_buf);
            }
            if self.charged > 0 {
                // The charge follows the read buffer wherever it went: given
                // back, or swapped into the server queue (move_to_server).
                // Reads charge growth; this only lowers. (Large held
                // messages are rewritten, not swapped, today: this keeps the
                // budget right if one is ever forwarded whole.)
                let capacity = fwd.in_buf.capacity();
                self.deps
                    .buffers
                    .recharge(&mut self.charged, capacity, usize::MAX);
            }
            if woke
                && fwd.held.is_none()
                && between_messages
                && fwd.in_buf.is_empty()
                && fwd.out_buf.is_empty()
            {
                // Nothing held, nothing half-read: the client waits parked.
                return LoopEnd::Idle;
            }
            woke = true;
            // The client's turn to speak: its idle timeouts run (read each
            // turn, as a reload may change them). A client idle between
            // transactions (no server connection, or session mode at a
            // clean 'I') gets client_idle_timeout; one that holds a server
            // connection the server is not working for (inside a
            // transaction, after a lone Flush, in the middle of a message,
            // with an unsynced pipeline, in COPY IN) gets
            // idle_transaction_timeout, so it cannot keep a server forever.
            // A pinned client between transactions is idle as in session mode.
            // The timer restarts when that state changes or a client message
            // comes in whole, not at every turn: bytes trickled into an
            // unfinished message do not keep it from firing (PostgreSQL's
            // idle_in_transaction_session_timeout ends such a trickle too).
            let keeps_server = self.mode == PoolMode::Session || !fwd.flow.pinned().is_empty();
            let idle_limit =
                if fwd.held.is_none() || (between_messages && fwd.flow.idle() && keeps_server) {
                    pool.settings()
                        .client_idle_timeout
                        .map(|t| (Timer::IdleSession, t))
                } else if fwd.flow.waiting_for_client() || !fwd.in_walker.at_boundary() {
                    pool.settings()
                        .idle_transaction_timeout
                        .map(|t| (Timer::IdleTransaction, t))
                } else {
                    None
                };
            let restart = std::mem::take(&mut fwd.message_ended);
            idle_timer = Deadline::keep_or_start(idle_timer, idle_limit, restart);
            // A message held beyond the free part of the read buffer (charged
            // to max_buffered_total) must be finished within
            // client_message_timeout: a client that stops in its middle
            // would otherwise keep the budget others' large messages need
            // for as long as it liked, holding no server and no other timer.
            // (Not while usher itself is not reading: what the client sent
            // waits for the server to take it.)
            let message_limit = (self.charged > 0 && fwd.to_server.is_empty()).then(|| {
                let t = self.deps.config().client_message_timeout;
                (Timer::PartialMessage, std::time::Duration::from_secs_f64(t))
            });
            message_timer = Deadline::keep_or_start(message_timer, message_limit, restart);
            let first_deadline = match (idle_timer, message_timer) {
                (Some(i), Some(m)) => Some(if m.at < i.at { m } else { i }),
                (i, m) => i.or(m),
            };
            let in_buf = &mut fwd.in_buf;
            let out_buf = &mut fwd.out_buf;
            let held = &mut fwd.held;
            let to_server = &mut fwd.to_server;
            // Backpressure: nothing more from the client until what it sent
            // is on its way to the server.
            let read_client = to_server.is_empty() && !fwd.waiting;
            let ask_readable = !std::mem::take(&mut known_readable);
            // Biased, in this order (no random draw per turn): shutdown and
            // the idle timer are rare; the client comes before the server,
            // which cannot starve it (a client read is not taken again
            // until what it queued is written, and a write the server
            // does not take lets its reads through).
            let event = tokio::select! {
                biased;
                _ = shutdown.changed(), if idle => LoopEvent::Shutdown,
                end = async {
                    match first_deadline {
                        Some(d) => {
                            tokio::time::sleep_until(d.at).await;
                            LoopEnd::Error(d.error())
                        }
                        None => std::future::pending().await,
                    }
                } => return end,
                read = async {
                    if in_buf.capacity() == in_buf.len() {
                        if ask_readable {
                            client.readable().await?;
                        }
                        spare_buffers::reserve(in_buf);
                    }
                    client.read_buf(in_buf).await
                }, if read_client => match read {
                    Ok(0) | Err(_) => return LoopEnd::ClientLeft,
                    Ok(_) if fwd.in_buf.capacity() > budget::FREE_BYTES => {
                        let limit = self.deps.config().max_buffered_total;
                        if !self.deps.buffers.recharge(&mut self.charged, fwd.in_buf.capacity(), limit) {
                            return LoopEnd::Error(out_of_buffers(limit));
                        }
                        LoopEvent::ClientData
                    }
                    Ok(_) => LoopEvent::ClientData,
                },
                io = async {
                    match held.as_mut() {
                        Some(c) => server_io(c.conn.stream_mut(), to_server, out_buf).await,
                        None => std::future::pending().await,
                    }
                } => match io {
                                    Ok(ServerIo::Read(n)) if n > 0 => LoopEvent::ServerData,
                    Ok(ServerIo::Wrote) => LoopEvent::ServerWritten,
                    gone => {
                        // Nothing is left to cancel or recover on it.
                        fwd.server_gone = true;
                        return match gone {
                            _ if fwd.flow.server_fatal() => LoopEnd::ServerFatal,
                            Err(e) => LoopEnd::Error(server_lost(&e.to_string())),
                            _ => LoopEnd::Error(server_lost("server closed the connection unexpectedly")),
                        };
                    }
                },
            };
            let mut result = match event {
                LoopEvent::ClientData => {
                    let forwarded = self.forward_client_data(client, fwd).await;
                    if let (Ok(()), Some(c)) = (&forwarded, fwd.held.as_mut()) {
                        if !fwd.to_server.is_empty() {
                            write_to_server_now(c.conn.stream_mut(), &mut fwd.to_server).await;
                        }
                    }
                    forwarded
                }
                LoopEvent::ServerData => self.forward_server_data(client, fwd).await,
                LoopEvent::ServerWritten | LoopEvent::Shutdown => Ok(()),
            };
            if result.is_ok() && std::mem::take(&mut fwd.replay) {
                // A stale statement's segment goes again (ServerStep::Replay).
                result = Box::pin(self.forward_client_data(client, fwd)).await;
            }
            if result.is_ok() && event == LoopEvent::ServerData && std::mem::take(&mut fwd.waiting)
            {
                // The server answered more: walk on from the message that
                // waited (it waits again if it must).
                result = Box::pin(self.forward_client_data(client, fwd)).await;
                if let (Ok(()), Some(c)) = (&result, fwd.held.as_mut()) {
                    if !fwd.to_server.is_empty() {
                        write_to_server_now(c.conn.stream_mut(), &mut fwd.to_server).await;
                    }
                }
            }
            if let Err(end) = result {
                return end;
            }
            if fwd.flow.discarded()
                && fwd.flow.quiet()
                && fwd.in_walker.at_boundary()
                && fwd.to_server.is_empty()
            {
                // The client's DISCARD ALL completed: its session begins anew.
                fwd.flow.take_discarded();
                fwd.flow.settled();
                // Boxed, like every rare step here: the serve future is
                // what an idle client costs, and it is as large as its
                // largest step.
                if let Err(e) = Box::pin(self.restart_session(client, fwd)).await {
                    return LoopEnd::Error(e);
                }
            }
            if fwd.flow.settings_to_settle()
                && fwd.held.is_some()
                && fwd.in_walker.at_boundary()
                && fwd.to_server.is_empty()
                && fwd.out_buf.is_empty()
            {
                // Session mode (transaction mode settles as it releases).
                if let Err(e) = Box::pin(self.settle_settings(client, fwd, true)).await {
                    return LoopEnd::Error(e);
                }
            }
        }
    }

    /// Runs session_start hooks: their parameters replace those of the
    /// previous run; notices and failures (as WARNINGs) go to the client.
    /// Returns the statements hooks asked to run (session mode).
    async fn start_session(
        &mut self,
        client: &mut ClientStream,
        reason: SessionReason,
        server: Option<ServerInfo>,
    ) -> Result<Vec<String>, PgError> {
        if !self.deps.hooks.handles(Event::SessionStart) {
            return Ok(Vec::new());
        }
        let mut ctx = SessionCtx {
            client: &self.client,
            vars: &mut self.vars,
            reason,
            server,
            params: Vec::new(),
            exec: Vec::new(),
            notices: Vec::new(),
            warnings: Vec::new(),
        };
        self.deps.hooks.session_start(&mut ctx).await;
        let SessionCtx {
            params,
            exec,
            notices,
            warnings,
            ..
        } = ctx;
        self.params.set_hook_params(params);
        let mut out = BytesMut::new();
        for n in notices {
            PgError::notice(n).encode(&mut out);
        }
        for w in warnings {
            PgError::warning(w).encode(&mut out);
        }
        if !out.is_empty() {
            client
                .write_all(&out)
                .await
                .map_err(|_| PgError::protocol("client went away"))?;
        }
        Ok(exec)
    }

    /// After the client's DISCARD ALL: forget its SETs and the hooks'
    /// values, run session_start again, and (session mode) apply the result
    /// to the server connection it holds.
    async fn restart_session(
        &mut self,
        client: &mut ClientStream,
        fwd: &mut Forwarding,
    ) -> Result<(), PgError> {
        self.params.reset();
        let server = fwd.held.as_ref().map(server_info);
        let exec = self
            .start_session(client, SessionReason::DiscardAll, server)
            .await?;
        if let Some(checkout) = fwd.held.as_mut() {
            self.apply_session(client, checkout, exec).await?;
        }
        Ok(())
    }

    /// Brings a held server connection in line with the session (parameters)
    /// and runs the statements session_start hooks asked for; a failing
    /// statement is a WARNING for the client.
    async fn apply_session(
        &mut self,
        client: &mut ClientStream,
        checkout: &mut Checkout,
        exec: Vec<String>,
    ) -> Result<(), PgError> {
        let changed = self
            .params
            .bring_in_line(&mut checkout.conn, "", None)
            .await
            .map_err(|e| {
                PgError::fatal(
                    e.sqlstate(),
                    format!("could not apply session parameters: {e}"),
                )
            })?;
        report_parameters(client, changed).await?;
        self.run_session_statements(client, checkout, exec).await
    }

    /// Runs the statements session_start hooks asked for; a failing one is
    /// a WARNING for the client.
    async fn run_session_statements(
        &mut self,
        client: &mut ClientStream,
        checkout: &mut Checkout,
        exec: Vec<String>,
    ) -> Result<(), PgError> {
        for sql in exec {
            if let Err(e) = checkout.conn.simple_query(&sql).await {
                let w = PgError::warning(format!("session_start statement failed: {e}"))
                    .with_detail(sql.clone());
                let mut out = BytesMut::new();
                w.encode(&mut out);
                client
                    .write_all(&out)
                    .await
                    .map_err(|_| PgError::protocol("client went away"))?;
            }
        }
        Ok(())
    }

    /// [`ServerStep::Settle`]: the client's statements may have reset
    /// settings, which on the server connection went to the server's
    /// defaults. Brings the connection to what PostgreSQL would have, and
    /// returns the ParameterStatus messages to send before the
    /// ReadyForQuery (`status`): each reported parameter whose value is
    /// not what the client was last told.
    ///
    /// Outside a transaction block the settings are read back and the
    /// connection brought in line with the session (after a DISCARD ALL,
    /// the session begins anew first: its SETs and hook values are
    /// forgotten, session_start runs again). Inside one, the values the
    /// session started with go back for the names it reset, within the
    /// transaction (a ROLLBACK undoes both, as it would the RESET); the
    /// rest is settled when the block ends. In a failed block the error's
    /// abort undid the resets (unless a SAVEPOINT followed them in the same
    /// Query: a known limit).
    async fn settle_resets(
        &mut self,
        client: &mut ClientStream,
        fwd: &mut Forwarding,
        status: u8,
    ) -> Result<BytesMut, PgError> {
        let conn = &fwd.held.as_ref().expect("a server connection is held").conn;
        // What the client was told, before anything changes.
        let mut told: Vec<(String, Option<String>)> = conn
            .params()
            .base()
            .keys()
            .map(|name| {
                (
                    name.clone(),
                    self.params.told(name, &self.defaults).cloned(),
                )
            })
            .collect();
        told.sort();
        if status == crate::protocol::tags::status::IDLE {
            let mut exec = Vec::new();
            if fwd.flow.take_discarded() {
                // The client's DISCARD ALL: its session begins anew.
                self.params.reset();
                let server = fwd.held.as_ref().map(server_info);
                exec = self
                    .start_session(client, SessionReason::DiscardAll, server)
                    .await?;
                if self.mode != PoolMode::Session {
                    // (Statements are session mode's.)
                    exec.clear();
                }
            }
            self.settle_settings(client, fwd, false).await?;
            let checkout = fwd.held.as_mut().expect("a server connection is held");
            self.params
                .bring_in_line(&mut checkout.conn, "", None)
                .await
                .map_err(|e| {
                    PgError::fatal(
                        e.sqlstate(),
                        format!("could not apply session parameters: {e}"),
                    )
                })?;
            self.run_session_statements(client, checkout, exec).await?;
        } else if status == crate::protocol::tags::status::FAILED {
            // The error aborted the (sub)transaction, and the resets with
            // it: the server has what PostgreSQL would.
            fwd.flow.take_resets();
        } else {
            let restores = self.restores(fwd.flow.take_resets());
            let conn = &mut fwd.held.as_mut().expect("a server connection is held").conn;
            conn.restore(&restores).await.map_err(|e| {
                PgError::fatal(
                    e.sqlstate(),
                    format!("could not put back the session's value of a reset setting: {e}"),
                )
            })?;
        }
        let conn = &fwd.held.as_ref().expect("a server connection is held").conn;
        let mut out = BytesMut::new();
        for (name, before) in told {
            let Some(now) = conn.params().get(&name) else {
                continue;
            };
            if before.as_ref() != Some(now) {
                messages::parameter_status(&mut out, &name, now);
                if status != crate::protocol::tags::status::IDLE {
                    // Settled when the block ends; until then the client
                    // has what it was told.
                    self.params.observe(&name, now);
                }
            }
        }
        Ok(out)
    }

    /// What to put back inside a transaction block after `resets`: the
    /// value the session started with, for each name it has one of (the
    /// others went to the server's default, as they would directly).
    fn restores(&self, resets: Vec<Reset>) -> Vec<Restore> {
        let mut out = Vec::new();
        let mut put = |name: &str, local: bool| {
            if let Some(value) = self.params.reset_value(name) {
                if !SERVER_SET.contains(&name) {
                    out.push(Restore {
                        name: name.to_string(),
                        value: value.clone(),
                        local,
                    });
                }
            }
        };
        for reset in resets {
            match reset {
                Reset::One { name, local } => put(&canonical_name(&name), local),
                Reset::All => {
                    for name in self.params.started_with() {
                        put(name, false);
                    }
                }
                Reset::Unknown => {}
            }
        }
        out
    }

    /// Forwards what the client sent: streams it through, rewriting messages
    /// that name prepared statements, and borrows a server connection first
    /// if none is held. What to do with each message is the flow's call.
    async fn forward_client_data(
        &mut self,
        client: &mut ClientStream,
        fwd: &mut Forwarding,
    ) -> Result<(), LoopEnd> {
        let rewriting = self.rewriting;
        let pool = self.pool.clone();
        let stats = &pool.stats;
        loop {
            if rewriting && fwd.flow.quiet() && fwd.in_walker.at_boundary() {
                // A new segment begins: copy it, for a replay. Only a
                // segment that begins with a Bind is ever replayed: one
                // that begins with a Query (most of them) is not copied.
                fwd.copy.clear();
                if fwd.in_buf.first() == Some(&frontend::QUERY) {
                    fwd.flow.copy_lost();
                } else {
                    fwd.flow.copy_started();
                }
            }
            let mut stopped_at = None;
            let flow = &mut fwd.flow;
            let walked = fwd
                .in_walker
                .walk_peeking(
                    &fwd.in_buf,
                    |tag, len, head| Flow::client_wants_body(rewriting, tag, len, head),
                    |tag, body| match flow.client_message(tag, body) {
                        ClientStep::Forward => Visit::Forward,
                        step => {
                            stopped_at = Some((tag, step));
                            Visit::StopBefore
                        }
                    },
                )
                .map_err(LoopEnd::Error)?;
            fwd.message_ended |= walked.ended;
            // What the walked Queries did to the unnamed statement.
            self.statements.sync_unnamed(fwd.flow.plan_mut());
            stats.queries(fwd.flow.take_queries());
            stats.received(walked.forward as u64);
            self.received += walked.forward as u64;
            // A rewritten or refused message goes to the server in some form.
            let rewrite = stopped_at
                .filter(|(_, step)| matches!(step, ClientStep::Rewrite | ClientStep::Refuse));
            if (walked.forward > 0 || rewrite.is_some()) && fwd.held.is_none() {
                if pool.would_wait() {
                    // A client queued for a server keeps only what it sent,
                    // not a forwarding buffer: a thousand waiting clients
                    // would otherwise hold 16 MiB, and empty the spare lists.
                    spare_buffers::shrink_to_fit(&mut fwd.in_buf);
                }
                // Boxed (one allocation per transaction): checkout, the
                // parameter sync and session mode's hooks make a future of
                // a few KB that would otherwise sit in every idle client.
                let checkout = Box::pin(self.begin_transaction(client))
                    .await
                    .map_err(LoopEnd::Error)?;
                fwd.held = Some(checkout);
                stats.client_active(1);
                fwd.lent_at = Instant::now();
                spare_buffers::reserve(&mut fwd.out_buf);
            }
            let closing = fwd.flow.take_closing();
            if let (false, Some(held)) = (closing.is_empty(), &fwd.held) {
                self.close_idle_to(&closing, &held.conn);
            }
            if walked.forward > 0 {
                keep_copy(&mut fwd.flow, &mut fwd.copy, &fwd.in_buf[..walked.forward]);
                move_to_server(&mut fwd.to_server, &mut fwd.in_buf, walked.forward);
            }
            match stopped_at {
                None => return Ok(()),
                Some((_, ClientStep::Wait)) => {
                    fwd.waiting = true;
                    return Ok(());
                }
                Some((_, ClientStep::Terminate)) => return Err(LoopEnd::ClientLeft),
                Some((_, ClientStep::Pin)) => {
                    // Walked again once the flow knows whether it has a slot.
                    Box::pin(self.take_pin_slot(fwd)).await;
                }
                Some((tag, ClientStep::Refuse)) => {
                    // A stand-in that fails on the server goes in its place;
                    // usher's error replaces the server's.
                    let whole = walked.held.expect("the walk stopped before it");
                    let message = fwd.in_buf.split_to(whole);
                    fwd.message_ended = true;
                    fwd.keep_copy(&message);
                    queue_for_server(
                        &mut fwd.to_server,
                        flow::refused_message(tag, &message[5..]),
                    );
                    tracing::debug!(user = %self.client.user, database = %self.client.database, "statement refused before it reached the server (pinning)");
                    stats.received(message.len() as u64);
                    self.received += message.len() as u64;
                }
                Some((frontend::QUERY, _)) => {
                    // A statement about a prepared statement (SQL level).
                    let whole = walked.held.expect("the walk stopped before it");
                    let message = fwd.in_buf.split_to(whole);
                    fwd.message_ended = true;
                    fwd.keep_copy(&message);
                    let failed_block = fwd.flow.known_failed_block();
                    let checkout = fwd.held.as_mut().expect("a server connection is held");
                    let mut out = BytesMut::with_capacity(message.len() + 64);
                    let rewrite = Rewriter {
                        registry: &self.deps.statements,
                        statements: &mut self.statements,
                        prepared: checkout.conn.prepared_mut(),
                        plan: fwd.flow.plan_mut(),
                    }
                    .rewrite_query(&message[5..], failed_block, true, &mut out);
                    if rewrite.refused.is_some() {
                        out = flow::refused_message(frontend::QUERY, &message[5..]);
                    }
                    queue_for_server(&mut fwd.to_server, out);
                    fwd.flow.query_rewritten(rewrite);
                    self.registration.handle.set_prepared(self.statements.len());
                    stats.received(message.len() as u64);
                    self.received += message.len() as u64;
                }
                Some((tag, _)) => {
                    let whole = walked.held.expect("the walk stopped before it");
                    let checkout = fwd.held.as_mut().expect("a server connection is held");
                    let mut rewriter = Rewriter {
                        registry: &self.deps.statements,
                        statements: &mut self.statements,
                        prepared: checkout.conn.prepared_mut(),
                        plan: fwd.flow.plan_mut(),
                    };
                    // Whole, unless a Bind's parameters stream after its head.
                    fwd.message_ended = true;
                    let taken = if tag == frontend::BIND {
                        // Only the Bind's head is in: rewrite it, and let
                        // the parameters stream after it.
                        let (portal, name, head) = prepared::bind_names(&fwd.in_buf[5..])
                            .map(|(p, n, h)| (p.to_string(), n.to_string(), h))
                            .expect("the flow saw the Bind's names");
                        let mut out = BytesMut::with_capacity(64);
                        rewriter.rewrite_bind_head(&portal, &name, whole - 5 - head, &mut out);
                        let original = fwd.in_buf.split_to(5 + head);
                        fwd.in_walker.stream_rest_of_body(whole - 5 - head);
                        fwd.message_ended = whole - 5 == head;
                        queue_for_server(&mut fwd.to_server, out);
                        original
                    } else {
                        // The message is whole at the front of the buffer.
                        let message = fwd.in_buf.split_to(whole);
                        if let Some(error) =
                            prepared::duplicate_parse(rewriter.statements, tag, &message[5..])
                        {
                            // PostgreSQL's 42P05, in order: a stand-in
                            // that fails on the server, so the rest of the
                            // batch is skipped as it would be directly.
                            let mut out = BytesMut::with_capacity(message.len() + 128);
                            rewriter
                                .refuse_duplicate(&message[5..], &mut out)
                                .map_err(LoopEnd::Error)?;
                            queue_for_server(&mut fwd.to_server, out);
                            fwd.flow.refused_rewrite(error);
                        } else {
                            let mut out = BytesMut::with_capacity(message.len() + 64);
                            rewriter
                                .rewrite(tag, &message[5..], &mut out)
                                .map_err(LoopEnd::Error)?;
                            queue_for_server(&mut fwd.to_server, out);
                        }
                        message
                    };
                    fwd.keep_copy(&taken);
                    let taken = taken.len();
                    fwd.flow.rewritten();
                    self.registration.handle.set_prepared(self.statements.len());
                    stats.received(taken as u64);
                    self.received += taken as u64;
                }
            }
        }
    }

    /// Before a statement that fails while other sessions are connected to
    /// its database (DROP DATABASE, ALTER DATABASE ... RENAME, CREATE
    /// DATABASE ... TEMPLATE: `Flow::take_closing`) goes out, closes
    /// usher's idle server connections to that database on the server
    /// this client's connection is on; connections in use stay, and the
    /// client gets PostgreSQL's 55006 for them. Synchronous, with no step
    /// before the message: closing a socket is all it takes, since the
    /// backend exits when it reads the end of its connection, and
    /// PostgreSQL waits (up to 5 s) for other backends to exit before it
    /// gives up.
    fn close_idle_to(&self, databases: &[String], server: &crate::backend::ServerConn) {
        let server = &server.summary().cancel;
        for database in databases {
            let closed =
                self.deps
                    .pools
                    .close_idle_to_database(database, &server.host, server.port);
            if closed > 0 {
                tracing::info!(db = %database, closed, user = %self.client.user, "closed idle server connections to a database a statement needs no other session on");
            }
        }
    }

    /// Forwards what the server sent, recording what the flow notes
    /// (parameters, dropped statements, errors), answering for rewritten
    /// prepared statements, and releasing the server connection when the
    /// flow says the transaction is over (transaction mode).
    async fn forward_server_data(
        &mut self,
        client: &mut ClientStream,
        fwd: &mut Forwarding,
    ) -> Result<(), LoopEnd> {
        // Released only with nothing of the client's half-read or queued.
        let at_boundary = fwd.in_walker.at_boundary() && fwd.to_server.is_empty();
        loop {
            let mut answer = None;
            let mut release = false;
            let notes = &mut fwd.notes;
            let flow = &mut fwd.flow;
            let server = &mut fwd.held.as_mut().expect("a server connection is held").conn;
            let prepared = server.prepared_mut();
            let walked = fwd
                .out_walker
                .walk(&fwd.out_buf, Flow::server_wants_body, |tag, body| {
                    let (step, note) = flow.server_message(tag, body, prepared, at_boundary);
                    notes.extend(note);
                    match step {
                        ServerStep::Forward => Visit::Forward,
                        ServerStep::ForwardThenRelease => {
                            release = true;
                            Visit::StopAfter
                        }
                        other => {
                            answer = Some(other);
                            Visit::StopBefore
                        }
                    }
                })
                .map_err(|e| LoopEnd::Error(server_lost(&e.message)))?;
            for note in fwd.notes.drain(..) {
                self.record(note, server);
            }
            for (name, id) in fwd.flow.take_failed_prepares() {
                self.statements.forget_failed(&name, id);
            }
            if fwd.flow.take_schema_changed() {
                self.deps.statements.schema_changed();
            }
            // Last change first: a Parse and a Close of one name, both
            // skipped, leave what was there before the Parse.
            for undo in fwd.flow.plan_mut().take_undone().into_iter().rev() {
                self.statements.undo(undo);
            }
            self.statements.sync_unnamed(fwd.flow.plan_mut());
            if walked.forward > 0 {
                // Written from the buffer itself, then consumed: the buffer
                // stays one block of its own, kept for the next read.
                self.pool.stats.sent(walked.forward as u64);
                self.sent += walked.forward as u64;
                let written = client.write_all(&fwd.out_buf[..walked.forward]).await;
                // Consumed whether or not the client took them: the walker
                // is past them, and the abandon path walks on from here.
                spare_buffers::consume(&mut fwd.out_buf, walked.forward);
                written.map_err(|_| LoopEnd::ClientLeft)?;
            }
            match answer {
                Some(ServerStep::Settle { release }) => {
                    // The ReadyForQuery is whole at the front of the buffer.
                    let whole = walked.held.expect("the walk stopped before it");
                    let status = fwd.out_buf[5];
                    fwd.out_buf.advance(whole);
                    // Boxed, as every rare step: see serve_loop.
                    let mut out = Box::pin(self.settle_resets(client, fwd, status))
                        .await
                        .map_err(LoopEnd::Error)?;
                    messages::ready_for_query(&mut out, status);
                    self.pool.stats.sent(out.len() as u64);
                    self.sent += out.len() as u64;
                    client
                        .write_all(&out)
                        .await
                        .map_err(|_| LoopEnd::ClientLeft)?;
                    if release && self.end_transaction(client, fwd).await? {
                        return Ok(());
                    }
                }
                Some(step) => {
                    // The message replaced or dropped is whole in the buffer.
                    let whole = walked.held.expect("the walk stopped before it");
                    let mut out = BytesMut::new();
                    if step == ServerStep::NameStatements {
                        let body = &fwd.out_buf[5..whole];
                        let renamed = self
                            .statements
                            .error_in_client_names(body, fwd.flow.plan_mut());
                        let body = renamed.as_deref().unwrap_or(body);
                        out.put_u8(fwd.out_buf[0]);
                        out.put_u32(body.len() as u32 + 4);
                        out.put_slice(body);
                    }
                    fwd.out_buf.advance(whole);
                    match step {
                        ServerStep::SendRefusal(e) => {
                            metrics::count_error(ErrorSource::Usher, e.code.as_bytes());
                            e.encode(&mut out);
                        }
                        ServerStep::SendError(e) => out = e,
                        ServerStep::Replay => {
                            // The statement was renewed (the error's note):
                            // the segment is walked again, prepared afresh.
                            let mut again = std::mem::take(&mut fwd.copy);
                            again.extend_from_slice(&fwd.in_buf);
                            fwd.in_buf = again;
                            fwd.replay = true;
                        }
                        ServerStep::Retry(body) => {
                            // The stale statement was renewed (the error's
                            // note): the EXECUTE goes again, prepared afresh.
                            let checkout = fwd.held.as_mut().expect("a server connection is held");
                            let mut again = BytesMut::with_capacity(body.len() + 64);
                            let rewrite = Rewriter {
                                registry: &self.deps.statements,
                                statements: &mut self.statements,
                                prepared: checkout.conn.prepared_mut(),
                                plan: fwd.flow.plan_mut(),
                            }
                            .rewrite_query(&body, false, false, &mut again);
                            queue_for_server(&mut fwd.to_server, again);
                            fwd.flow.query_rewritten(rewrite);
                        }
                        _ => {}
                    }
                    if !out.is_empty() {
                        client
                            .write_all(&out)
                            .await
                            .map_err(|_| LoopEnd::ClientLeft)?;
                    }
                }
                None if release => {
                    if self.end_transaction(client, fwd).await? {
                        return Ok(());
                    }
                    // Pinned: the connection stays; walk what came after.
                }
                None => return Ok(()),
            }
        }
    }

    /// Keeps what a server message told: the session's and the server
    /// connection's parameters, statements both sides dropped, errors
    /// counted, transactions counted.
    fn record(&mut self, note: Note, server: &mut crate::backend::ServerConn) {
        match note {
            Note::Parameter { name, value, held } => {
                server.note_parameter(&name, &value);
                if !held {
                    self.params.observe(&name, &value);
                }
            }
            Note::StatementsDropped { discard_all } => {
                // The client dropped its names with the server's.
                self.statements.clear();
                if self.rewriting {
                    self.registration.handle.set_prepared(0);
                }
                if discard_all {
                    server.settings_reset();
                }
            }
            Note::Error { code, stale } => {
                metrics::count_error(ErrorSource::Server, &code);
                if !stale.is_empty() {
                    // DDL made usher's shared statements stale: this
                    // client's take new ids (prepared afresh where next
                    // used), and so does every later Parse of their text.
                    self.statements.renew(&stale, &self.deps.statements);
                }
            }
            Note::TransactionDone => self.pool.stats.transaction_done(),
        }
    }

    /// Transaction mode: the transaction is over; the server connection goes
    /// back to the pool, unless state the client holds on it pins it there.
    /// Returns whether it went back.
    async fn end_transaction(
        &mut self,
        client: &mut ClientStream,
        fwd: &mut Forwarding,
    ) -> Result<bool, LoopEnd> {
        if fwd.flow.settings_to_settle() && fwd.out_buf.is_empty() {
            // Boxed, as every rare step: see serve_loop.
            Box::pin(self.settle_settings(client, fwd, false))
                .await
                .map_err(LoopEnd::Error)?;
        }
        let step = match fwd.flow.transaction_end() {
            // The server is asked only when it has said nothing more (a
            // notification may follow a pinned client's ReadyForQuery);
            // else the connection stays pinned until the next transaction.
            PinStep::Check if fwd.out_buf.is_empty() => Box::pin(self.check_pins(client, fwd))
                .await
                .map_err(LoopEnd::Error)?,
            PinStep::Check => PinStep::Keep,
            step => step,
        };
        if step == PinStep::Keep {
            self.keep_pinned(fwd);
            return Ok(false);
        }
        self.unpinned(fwd);
        let checkout = fwd.held.take().expect("a server connection is held");
        let now = Instant::now();
        let lent = now.saturating_duration_since(fwd.lent_at);
        self.registration.handle.set_server(None);
        if fwd.out_buf.is_empty() {
            self.pool.checkin_at(checkout, now);
        } else {
            // The server said more after its last ReadyForQuery: not clean.
            let _ = client.write_all(&fwd.out_buf).await;
            self.pool.discard(checkout);
        }
        // Recorded once the connection is back: whoever sees the count
        // sees the pool as it is after this transaction.
        self.pool.stats.client_active(-1);
        self.pool.stats.transaction_time(lent);
        fwd.out_buf.clear();
        fwd.out_walker = FrameWalker::new(usize::MAX >> 1);
        // An idle client keeps no copy of its last segment either (the
        // busy phase gives both buffers back when it parks).
        fwd.copy.clear();
        fwd.flow.released();
        Ok(true)
    }

    /// A statement may have ended what pinned the connection: ask the
    /// server what its session still holds. Notifications that arrive
    /// meanwhile go to the client.
    async fn check_pins(
        &mut self,
        client: &mut ClientStream,
        fwd: &mut Forwarding,
    ) -> Result<PinStep, PgError> {
        let conn = &mut fwd.held.as_mut().expect("a server connection is held").conn;
        let (state, notifications) = conn.held_state().await.map_err(|e| {
            PgError::fatal(
                e.sqlstate(),
                format!("could not ask the server connection what the session holds: {e}"),
            )
        })?;
        if !notifications.is_empty() {
            client
                .write_all(&notifications)
                .await
                .map_err(|_| PgError::protocol("client went away"))?;
        }
        Ok(fwd.flow.checked(held_kinds(state)))
    }

    /// The connection stays with the client: it holds a pin slot (taken
    /// now, past max_pinned, if the state was found only by asking), and
    /// what pins it is logged when it changes.
    fn keep_pinned(&mut self, fwd: &mut Forwarding) {
        if !fwd.flow.has_slot() {
            self.pin_slot = Some(Box::new(self.pool.pin_anyway()));
            fwd.flow.slot_taken();
        }
        let pinned = fwd.flow.pinned();
        if pinned != self.logged_pins {
            self.logged_pins = pinned;
            tracing::debug!(
                user = %self.client.user, database = %self.client.database,
                server = fwd.held.as_ref().map(|c| c.conn.id()),
                reason = %pinned.describe(),
                "session pins its server connection"
            );
        }
    }

    /// Nothing pins the connection any more: the pin slot goes back.
    fn unpinned(&mut self, fwd: &mut Forwarding) {
        if fwd.flow.has_slot() {
            self.pin_slot = None;
            fwd.flow.slot_given_back();
        }
        if !self.logged_pins.is_empty() {
            self.logged_pins = PinKinds::NONE;
            tracing::debug!(
                user = %self.client.user, database = %self.client.database,
                "session no longer pins its server connection"
            );
        }
    }

    /// Before a statement that would pin the connection goes out: a pin
    /// slot of the pool. A client that holds no server connection waits
    /// for one (up to query_wait_timeout); inside a transaction it does
    /// not wait. Without one the flow refuses the statement.
    async fn take_pin_slot(&mut self, fwd: &mut Forwarding) {
        let waits = fwd.held.is_none();
        let slot = if waits {
            self.registration.handle.waiting();
            let slot = self.pool.pin().await;
            self.registration.handle.set_server(None);
            slot
        } else {
            self.pool.try_pin()
        };
        match slot {
            Some(slot) => {
                self.pin_slot = Some(Box::new(slot));
                fwd.flow.slot_taken();
            }
            None => {
                let max = self.pool.settings().max_pinned;
                fwd.flow.no_pin_slot(max, waits);
            }
        }
    }

    /// The client's statements may have changed settings: read back what
    /// the server connection's session has set and make it the session's
    /// own (`SessionParams::settle`). With `sync_now` (session mode, where
    /// the connection stays), a RESET's startup value goes back on at once.
    async fn settle_settings(
        &mut self,
        client: &mut ClientStream,
        fwd: &mut Forwarding,
        sync_now: bool,
    ) -> Result<(), PgError> {
        let effects = fwd.flow.settled();
        let mut custom = effects.custom;
        let checkout = fwd.held.as_mut().expect("a server connection is held");
        let conn = &mut checkout.conn;
        // Custom settings the session or the connection already has may
        // have been RESET: ask for them too.
        for name in conn.params().now().keys().chain(self.params.custom_names()) {
            if name.contains('.') && !custom.contains(name) {
                custom.push(name.clone());
            }
        }
        let read = conn.session_settings(&custom).await.map_err(|e| {
            PgError::fatal(
                e.sqlstate(),
                format!("could not read the session's settings back: {e}"),
            )
        })?;
        // (A SET LOCAL ... TO DEFAULT ended with its transaction.)
        let reset = |name: &str| {
            effects.resets.iter().any(|r| match r {
                Reset::All | Reset::Unknown => true,
                Reset::One { name: n, local } => !local && canonical_name(n) == name,
            })
        };
        self.params.settle(read, conn.params(), reset);
        if sync_now {
            self.apply_session(client, checkout, Vec::new()).await?;
        }
        Ok(())
    }

    /// Borrows a server connection and brings it in line with the session:
    /// parameters, and the bound on prepared statements it keeps.
    async fn begin_transaction(&mut self, client: &mut ClientStream) -> Result<Checkout, PgError> {
        self.registration.handle.waiting();
        let checkout = tokio::select! {
            biased;
            checkout = self.pool.checkout() => checkout,
            // A client that left while it waited is not waited for (nor
            // counted as waiting): its query never runs.
            () = client.closed() => {
                self.registration.handle.set_server(None);
                return Err(left_while_waiting());
            }
        };
        let mut checkout = match checkout {
            Ok(c) => c,
            Err(e) => {
                self.registration.handle.set_server(None);
                return Err(e.into());
            }
        };
        if !self.session_started {
            if let Err(e) = self.start_on_server(client, &mut checkout).await {
                self.pool.discard(checkout);
                return Err(e);
            }
        }
        let conn = &mut checkout.conn;
        let mut sql = String::new();
        let bound = self.pool.settings().prepared_statements;
        for id in conn.trim_prepared(bound) {
            sql.push_str(&format!("DEALLOCATE {};", prepared::server_name(id)));
        }
        match self.params.bring_in_line(conn, &sql, None).await {
            Ok(changed) => report_parameters(client, changed).await?,
            Err(e) => {
                self.pool.discard(checkout);
                return Err(PgError::fatal(
                    e.sqlstate(),
                    format!("could not prepare the server connection: {e}"),
                ));
            }
        }
        self.registration
            .handle
            .set_server(Some(checkout.conn.summary().clone()));
        Ok(checkout)
    }
}

impl Session {
    /// Session mode: the session begins with its server connection
    /// (session_start hooks, then their parameters and statements).
    async fn start_on_server(
        &mut self,
        client: &mut ClientStream,
        checkout: &mut Checkout,
    ) -> Result<(), PgError> {
        self.session_started = true;
        let reused = checkout.conn.start_session();
        let reason = if reused {
            SessionReason::ReusedServer
        } else {
            SessionReason::NewSession
        };
        let exec = self
            .start_session(client, reason, Some(server_info(checkout)))
            .await?;
        self.apply_session(client, checkout, exec).await
    }
}

/// What a session's server connection holds, as pin kinds.
fn held_kinds(state: HeldState) -> PinKinds {
    let mut kinds = PinKinds::NONE;
    for (held, kind) in [
        (state.listening, PinKinds::LISTEN),
        (state.advisory_locks, PinKinds::ADVISORY_LOCK),
        (state.temp_objects, PinKinds::TEMP),
        (state.hold_cursors, PinKinds::HOLD_CURSOR),
        (state.sql_prepared, PinKinds::SQL_PREPARE),
    ] {
        if held {
            kinds |= kind;
        }
    }
    kinds
}

/// Gives back a clean connection whose client may have left state on it
/// (`state`, transaction mode): after DISCARD ALL, or closed if a library
/// was LOADed (nothing unloads it).
pub(super) async fn release_pinned(pool: &Pool, checkout: Checkout, state: PinKinds) {
    if state.contains(PinKinds::LOAD) {
        tracing::debug!(
            server = checkout.conn.id(),
            "closing a server connection its client LOADed a library on"
        );
        pool.discard(checkout);
    } else {
        pool.reset_pinned_and_checkin(checkout).await;
    }
}

/// Tells the client about parameters whose value changed under it.
async fn report_parameters(
    client: &mut ClientStream,
    changed: Vec<(String, String)>,
) -> Result<(), PgError> {
    if changed.is_empty() {
        return Ok(());
    }
    let mut out = BytesMut::new();
    for (name, value) in changed {
        messages::parameter_status(&mut out, &name, &value);
    }
    client
        .write_all(&out)
        .await
        .map_err(|_| PgError::protocol("client went away"))
}

/// What session_start hooks learn of a server connection.
fn server_info(checkout: &Checkout) -> ServerInfo {
    ServerInfo {
        backend_pid: checkout.conn.backend_pid(),
        server_version: checkout
            .conn
            .params()
            .get("server_version")
            .cloned()
            .unwrap_or_default(),
        fresh: checkout.conn.sessions_served() <= 1,
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

/// What woke the serve loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LoopEvent {
    ClientData,
    ServerData,
    /// Queued client bytes went (partly) to the server.
    ServerWritten,
    Shutdown,
}

/// What the server connection did.
enum ServerIo {
    /// Read this many bytes into the buffer (0: the server closed).
    Read(usize),
    /// Wrote some of the queued bytes.
    Wrote,
}

/// Adds bytes usher made (a rewritten message) to those queued for the
/// server (no copy when none are).
fn queue_for_server(queue: &mut BytesMut, bytes: BytesMut) {
    if queue.is_empty() {
        spare_buffers::give(std::mem::replace(queue, bytes));
    } else {
        queue.extend_from_slice(&bytes);
    }
}

/// Moves the first `n` bytes the client sent to those queued for the
/// server. The usual case, all that was read and nothing queued, swaps the
/// two buffers: no copy, and each stays a block of its own for reuse.
fn move_to_server(queue: &mut BytesMut, from: &mut BytesMut, n: usize) {
    if queue.is_empty() && n == from.len() {
        std::mem::swap(queue, from);
    } else {
        if queue.capacity() == 0 {
            *queue = spare_buffers::take();
        }
        queue.extend_from_slice(&from[..n]);
        spare_buffers::consume(from, n);
    }
}

/// Drops the first `n` queued bytes, written to the server.
fn wrote_to_server(to_server: &mut BytesMut, n: usize) {
    spare_buffers::consume(to_server, n);
    if to_server.is_empty() && to_server.capacity() > budget::FREE_BYTES {
        // A large message's buffer is not kept (nor charged): let it go
        // once it is written.
        *to_server = BytesMut::new();
    }
}

/// Writes what is queued for the server if the socket takes it now, without
/// waiting: the usual Query goes out in the turn that read it, not a loop
/// turn later. Anything else (a full socket, an error) is left to
/// [`server_io`], which waits and reports.
async fn write_to_server_now(stream: &mut crate::backend::ServerStream, to_server: &mut BytesMut) {
    std::future::poll_fn(|cx| {
        if let Poll::Ready(Ok(n)) = Pin::new(&mut *stream).poll_write(cx, to_server) {
            if n > 0 {
                wrote_to_server(to_server, n);
            }
        }
        Poll::Ready(())
    })
    .await
}

/// Writes queued bytes to the server and reads what it sends, whichever
/// can happen first: the server is read even while a write waits, since a
/// server blocked on its own output reads nothing more.
async fn server_io(
    stream: &mut crate::backend::ServerStream,
    to_server: &mut BytesMut,
    out_buf: &mut BytesMut,
) -> std::io::Result<ServerIo> {
    if out_buf.capacity() == out_buf.len() {
        spare_buffers::reserve(out_buf);
    }
    std::future::poll_fn(|cx| {
        if !to_server.is_empty() {
            match Pin::new(&mut *stream).poll_write(cx, to_server) {
                Poll::Ready(Ok(0)) => {
                    return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()))
                }
                Poll::Ready(Ok(n)) => {
                    wrote_to_server(to_server, n);
                    return Poll::Ready(Ok(ServerIo::Wrote));
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {}
            }
        }
        tokio_util::io::poll_read_buf(Pin::new(&mut *stream), cx, out_buf).map_ok(ServerIo::Read)
    })
    .await
}

/// The serve loop's timers (see [`Deadline`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Timer {
    /// client_idle_timeout.
    IdleSession,
    /// idle_transaction_timeout.
    IdleTransaction,
    /// client_message_timeout: part of a message held against
    /// max_buffered_total.
    PartialMessage,
}

/// A running timer of the serve loop: it keeps its deadline while the
/// client stays in the state it times, whatever else the turns bring.
#[derive(Debug, Clone, Copy)]
struct Deadline {
    timer: Timer,
    limit: std::time::Duration,
    at: tokio::time::Instant,
}

impl Deadline {
    /// The error that ends the session when it fires.
    fn error(&self) -> PgError {
        match self.timer {
            Timer::IdleSession => idle_session_timeout(),
            Timer::IdleTransaction => idle_in_transaction_timeout(),
            Timer::PartialMessage => message_timeout(self.limit),
        }
    }

    /// The timer `want` asks for (none: no timer): `running` if it is that
    /// timer with that limit and nothing restarts it, else one that starts
    /// now.
    fn keep_or_start(
        running: Option<Deadline>,
        want: Option<(Timer, std::time::Duration)>,
        restart: bool,
    ) -> Option<Deadline> {
        let (timer, limit) = want?;
        match running {
            Some(d) if d.timer == timer && d.limit == limit && !restart => Some(d),
            _ => Some(Deadline {
                timer,
                limit,
                at: tokio::time::Instant::now() + limit,
            }),
        }
    }
}

fn left_while_waiting() -> PgError {
    PgError::server_only(
        sqlstate::CONNECTION_FAILURE,
        "the client closed its connection while it waited for a server connection",
    )
}

/// A client that stopped in the middle of a large message: as PostgreSQL
/// ends a client idle in the middle of one (idle_session_timeout, whose
/// SQLSTATE this is), with usher's reason.
fn message_timeout(limit: std::time::Duration) -> PgError {
    PgError::fatal(
        sqlstate::IDLE_SESSION_TIMEOUT,
        "terminating connection: the client did not finish its message in time",
    )
    .with_detail(format!(
        "usher held part of a message larger than {} KiB for it (against max_buffered_total) longer than client_message_timeout ({}s)",
        budget::FREE_BYTES / 1024,
        limit.as_secs_f64()
    ))
}

fn idle_session_timeout() -> PgError {
    PgError::fatal(
        sqlstate::IDLE_SESSION_TIMEOUT,
        "terminating connection due to idle-session timeout",
    )
    .with_detail("the client was idle longer than client_idle_timeout")
}

fn idle_in_transaction_timeout() -> PgError {
    PgError::fatal(
        sqlstate::IDLE_IN_TRANSACTION_TIMEOUT,
        "terminating connection due to idle-in-transaction timeout",
    )
    .with_detail("the client was idle inside a transaction longer than idle_transaction_timeout")
}

fn out_of_buffers(limit: usize) -> PgError {
    PgError::fatal(
        sqlstate::OUT_OF_MEMORY,
        "out of memory: usher cannot hold this client's message now",
    )
    .with_detail(format!(
        "clients' large messages already use max_buffered_total ({limit} bytes)"
    ))
}

fn killed() -> PgError {
    PgError::fatal(
        sqlstate::ADMIN_SHUTDOWN,
        "terminating connection due to administrator command",
    )
    .with_detail("an admin console user ran KILL_CLIENT or KILL")
}

fn server_lost(detail: &str) -> PgError {
    PgError::fatal(sqlstate::CONNECTION_FAILURE, "server connection lost")
        .with_detail(detail.to_string())
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
        assert!(session <= 448, "Session {session} B");
        let handle = std::mem::size_of::<ClientHandle>();
        assert!(handle <= 240, "ClientHandle {handle} B");
    }
}
