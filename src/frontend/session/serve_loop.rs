//! The busy phase's loop: one select over the client, the server, the
//! timers and shutdown, and what each event leads to.

use super::*;

impl Session {
    pub(super) async fn serve_loop(
        &mut self,
        client: &mut ClientStream,
        fwd: &mut Forwarding,
    ) -> LoopEnd {
        // Shutdown's drain pokes every client's kill switch, whose waker
        // `busy` registers at every poll: the loop reads the flag when
        // woken, with no receiver to register and drop each turn (that
        // was ~330 instructions per transaction under callgrind).
        let deps = self.deps.clone();
        let draining = std::future::poll_fn(|_| {
            if deps.is_draining() {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        });
        tokio::pin!(draining);
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
            if idle && self.deps.is_draining() {
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
                    pool.hot()
                        .client_idle_timeout()
                        .map(|t| (Timer::IdleSession, t))
                } else if fwd.flow.waiting_for_client() || !fwd.in_walker.at_boundary() {
                    pool.hot()
                        .idle_transaction_timeout()
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
                _ = &mut draining, if idle => LoopEvent::Shutdown,
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
                        let why = match gone {
                            Err(e) => e.to_string(),
                            _ => "server closed the connection unexpectedly".to_string(),
                        };
                        // Boxed, as every rare step.
                        if let Err(end) = Box::pin(self.server_gone(client, fwd, why)).await {
                            return end;
                        }
                        LoopEvent::ServerLost
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
                // What the client sent behind the lost transaction is
                // answered now (lost_block).
                LoopEvent::ServerLost if !fwd.in_buf.is_empty() => {
                    Box::pin(self.forward_client_data(client, fwd)).await
                }
                LoopEvent::ServerWritten | LoopEvent::ServerLost | LoopEvent::Shutdown => Ok(()),
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
}

/// What woke the serve loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LoopEvent {
    ClientData,
    ServerData,
    /// Queued client bytes went (partly) to the server.
    ServerWritten,
    /// The server connection died and the client stays (transaction mode).
    ServerLost,
    Shutdown,
}

/// What the server connection did.
pub(super) enum ServerIo {
    /// Read this many bytes into the buffer (0: the server closed).
    Read(usize),
    /// Wrote some of the queued bytes.
    Wrote,
}

/// Adds bytes usher made (a rewritten message) to those queued for the
/// server (no copy when none are).
pub(super) fn queue_for_server(queue: &mut BytesMut, bytes: BytesMut) {
    if queue.is_empty() {
        spare_buffers::give(std::mem::replace(queue, bytes));
    } else {
        queue.extend_from_slice(&bytes);
    }
}

/// Moves the first `n` bytes the client sent to those queued for the
/// server. The usual case, all that was read and nothing queued, swaps the
/// two buffers: no copy, and each stays a block of its own for reuse.
pub(super) fn move_to_server(queue: &mut BytesMut, from: &mut BytesMut, n: usize) {
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
pub(super) fn wrote_to_server(to_server: &mut BytesMut, n: usize) {
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
pub(super) async fn write_to_server_now(
    stream: &mut crate::backend::ServerStream,
    to_server: &mut BytesMut,
) {
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
pub(super) async fn server_io(
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
pub(super) enum Timer {
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
pub(super) struct Deadline {
    timer: Timer,
    limit: std::time::Duration,
    at: tokio::time::Instant,
}

impl Deadline {
    /// The error that ends the session when it fires.
    pub(super) fn error(&self) -> PgError {
        match self.timer {
            Timer::IdleSession => idle_session_timeout(),
            Timer::IdleTransaction => idle_in_transaction_timeout(),
            Timer::PartialMessage => message_timeout(self.limit),
        }
    }

    /// The timer `want` asks for (none: no timer): `running` if it is that
    /// timer with that limit and nothing restarts it, else one that starts
    /// now.
    pub(super) fn keep_or_start(
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

pub(crate) fn left_while_waiting() -> PgError {
    PgError::server_only(
        sqlstate::CONNECTION_FAILURE,
        "the client closed its connection while it waited for a server connection",
    )
}

/// A client that stopped in the middle of a large message: as PostgreSQL
/// ends a client idle in the middle of one (idle_session_timeout, whose
/// SQLSTATE this is), with usher's reason.
pub(super) fn message_timeout(limit: std::time::Duration) -> PgError {
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

pub(super) fn idle_session_timeout() -> PgError {
    PgError::fatal(
        sqlstate::IDLE_SESSION_TIMEOUT,
        "terminating connection due to idle-session timeout",
    )
    .with_detail("the client was idle longer than client_idle_timeout")
}

pub(super) fn idle_in_transaction_timeout() -> PgError {
    PgError::fatal(
        sqlstate::IDLE_IN_TRANSACTION_TIMEOUT,
        "terminating connection due to idle-in-transaction timeout",
    )
    .with_detail("the client was idle inside a transaction longer than idle_transaction_timeout")
}

pub(super) fn out_of_buffers(limit: usize) -> PgError {
    PgError::fatal(
        sqlstate::OUT_OF_MEMORY,
        "out of memory: usher cannot hold this client's message now",
    )
    .with_detail(format!(
        "clients' large messages already use max_buffered_total ({limit} bytes)"
    ))
}

pub(super) fn killed() -> PgError {
    PgError::fatal(
        sqlstate::ADMIN_SHUTDOWN,
        "terminating connection due to administrator command",
    )
    .with_detail("an admin console user ran KILL_CLIENT or KILL")
}

pub(super) fn server_lost(detail: &str) -> PgError {
    PgError::fatal(sqlstate::CONNECTION_FAILURE, "server connection lost")
        .with_detail(detail.to_string())
}
