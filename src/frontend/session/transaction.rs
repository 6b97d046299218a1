//! A transaction's server connection (transaction mode): borrowed, kept
//! when the client holds state on it (pinning), given back.

use super::*;
use crate::backend::QueryError;

impl Session {
    /// Transaction mode: the transaction is over; the server connection goes
    /// back to the pool, unless state the client holds on it pins it there.
    /// Returns whether it went back.
    pub(super) async fn end_transaction(
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
            // A notice or a notification goes to the client; an error is
            // the server ending the connection (its FATAL at a shutdown):
            // the client's transaction is over, and its next one gets
            // another connection, so it is not told (an error it did not
            // ask for would end a client library's connection).
            if !says_error(&fwd.out_buf) {
                let _ = client.write_all(&fwd.out_buf).await;
            }
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
    pub(super) async fn check_pins(
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
    pub(super) fn keep_pinned(&mut self, fwd: &mut Forwarding) {
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
    pub(super) fn unpinned(&mut self, fwd: &mut Forwarding) {
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
    /// not wait. Without one the flow refuses the statement. A client
    /// that leaves while it waits ends there, as one waiting for a server
    /// connection does: it is neither counted as waiting nor given a slot.
    pub(super) async fn take_pin_slot(
        &mut self,
        client: &ClientStream,
        fwd: &mut Forwarding,
    ) -> Result<(), LoopEnd> {
        let waits = fwd.held.is_none();
        let slot = if waits {
            self.registration.handle.waiting();
            let slot = tokio::select! {
                biased;
                slot = self.pool.pin() => slot,
                () = client.closed() => {
                    self.registration.handle.set_server(None);
                    return Err(LoopEnd::ClientLeft);
                }
            };
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
        Ok(())
    }

    /// Borrows a server connection and brings it in line with the session:
    /// parameters, and the bound on prepared statements it keeps. In
    /// transaction mode a connection that dies under that (its server went
    /// away while it was idle, and the check at checkout did not see it
    /// yet) is replaced: nothing of the client's has reached it.
    pub(super) async fn begin_transaction(
        &mut self,
        client: &mut ClientStream,
    ) -> Result<Checkout, PgError> {
        let mut replaced = 0;
        loop {
            match self.borrow_server(client).await? {
                Ok(checkout) => return Ok(checkout),
                Err(e) if replaced < REPLACE_DEAD && self.mode == PoolMode::Transaction => {
                    replaced += 1;
                    tracing::debug!(user = %self.client.user, database = %self.client.database, error = %e, "server connection died before the client's statement was sent; taking another");
                }
                Err(e) => {
                    return Err(PgError::fatal(
                        e.sqlstate(),
                        format!("could not prepare the server connection: {e}"),
                    ))
                }
            }
        }
    }

    /// One try of [`Session::begin_transaction`]: `Ok(Err)` if the
    /// connection broke while it was brought in line (it is closed).
    async fn borrow_server(
        &mut self,
        client: &mut ClientStream,
    ) -> Result<Result<Checkout, QueryError>, PgError> {
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
        let bound = self.pool.hot().prepared_statements();
        for id in conn.trim_prepared(bound) {
            sql.push_str(&format!("DEALLOCATE {};", prepared::server_name(id)));
        }
        match self.params.bring_in_line(conn, &sql, None).await {
            Ok(changed) => report_parameters(client, changed).await?,
            Err(e @ QueryError::Wire(_)) => {
                self.pool.discard(checkout);
                self.registration.handle.set_server(None);
                return Ok(Err(e));
            }
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
        Ok(Ok(checkout))
    }
}

/// Whether the whole messages in `bytes` (from a server) include an
/// ErrorResponse.
fn says_error(bytes: &[u8]) -> bool {
    let mut error = false;
    let _ = FrameWalker::new(usize::MAX >> 1).walk(
        bytes,
        |_, _| false,
        |tag, _| {
            error |= tag == crate::protocol::tags::backend::ERROR_RESPONSE;
            Visit::Forward
        },
    );
    error
}

/// How many dead connections a checkout replaces before it gives up (each
/// replacement awaits a checkout: no loop turns without waiting).
const REPLACE_DEAD: usize = 3;

/// What a session's server connection holds, as pin kinds.
pub(super) fn held_kinds(state: HeldState) -> PinKinds {
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
pub(crate) async fn release_pinned(pool: &Pool, checkout: Checkout, state: PinKinds) {
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
