//! The server connection died under a client (PostgreSQL restarted, shut
//! down, failed over, a backend killed): in transaction mode, when only
//! the server's leg died, the client keeps its connection to usher.
//!
//! It is told what a direct connection would tell it, once per segment it
//! waits for: the server's own error (the FATAL `57P01` of a fast
//! shutdown, sent as ERROR) or `08006`, then ReadyForQuery. If it was (or
//! may have been) inside a transaction block, the block is lost: until the
//! client ends it, its session answers as PostgreSQL answers in an aborted
//! block (`super::lost_block`), so nothing it pipelined behind the lost
//! statements runs outside the block they belonged to. Its next
//! transaction gets a new server connection (waiting for the server to
//! come back, `pool/outage.rs`).
//!
//! The client loses its connection, as before, when its state cannot be
//! carried: session mode, state pinned to the dead connection (LISTEN, a
//! temporary table...), a COPY in progress, or half a message sent either
//! way.

use super::*;
use crate::frontend::lost_block::{self, Lost, LostBlock};
use crate::protocol::tags::{backend, status};

impl Session {
    /// The server connection is gone (`why`, when the server said nothing).
    /// `Ok`: the client stays, told what it waited for; else how the
    /// session ends.
    pub(super) async fn server_gone(
        &mut self,
        client: &mut ClientStream,
        fwd: &mut Forwarding,
        why: String,
    ) -> Result<(), LoopEnd> {
        let fatal = fwd.fatal.take();
        if !self.keeps_client(fwd) {
            return Err(match fatal {
                Some(fatal) => {
                    // As it came: the client's connection ends with it.
                    self.sent += fatal.len() as u64;
                    let _ = client.write_all(&fatal).await;
                    LoopEnd::ServerFatal
                }
                None if fwd.flow.server_fatal() => LoopEnd::ServerFatal,
                None => LoopEnd::Error(server_lost(&why)),
            });
        }
        let server_error = fatal
            .as_deref()
            .and_then(|m| messages::error_from_body(&m[5..]));
        let error = lost_block::server_died(server_error);
        let owed = fwd.flow.pending();
        // Whether the client is left in a transaction block (then lost:
        // answered as aborted until it ends it), and whether it was in one
        // before the last segment in flight.
        let block = fwd.flow.block_after_loss();
        let before = fwd.flow.block_before_last();
        let unsynced = fwd.flow.unsynced();
        let mut out = BytesMut::new();
        let mut checkout = fwd.held.take().expect("a server connection is held");
        for i in 0..owed {
            // In a block, statements after the first error get 25P02.
            let e = if i > 0 && before {
                lost_block::aborted()
            } else {
                error.clone()
            };
            let in_block = if i + 1 == owed { block } else { before };
            let status = if in_block {
                status::FAILED
            } else {
                status::IDLE
            };
            let mut said = BytesMut::new();
            e.encode(&mut said);
            crate::frontend::count_error(&e);
            // Walked through the flow, as if the server had said it, so
            // that what it owed the client is settled (a Parse never
            // answered is undone).
            let prepared = checkout.conn.prepared_mut();
            let _ = fwd
                .flow
                .server_message(backend::ERROR_RESPONSE, &said[5..], prepared, false);
            let _ = fwd
                .flow
                .server_message(backend::READY_FOR_QUERY, &[status], prepared, false);
            out.extend_from_slice(&said);
            messages::ready_for_query(&mut out, status);
        }
        for (name, id) in fwd.flow.take_failed_prepares() {
            self.statements.forget_failed(&name, id);
        }
        for undo in fwd.flow.plan_mut().take_undone().into_iter().rev() {
            self.statements.undo(undo);
        }
        self.statements.sync_unnamed(fwd.flow.plan_mut());
        if fwd.flow.take_schema_changed() {
            self.deps.statements.schema_changed();
        }
        fwd.flow.server_lost();
        self.registration.handle.set_prepared(self.statements.len());
        // The dead connection goes; nothing of its bytes either way stays.
        self.registration.handle.set_server(None);
        tracing::info!(
            user = %self.client.user, database = %self.client.database,
            server = checkout.conn.id(), owed, in_block = block,
            code = %error.code, "server connection lost under a client; the client stays"
        );
        self.pool.discard(checkout);
        self.pool.stats.client_active(-1);
        fwd.server_gone = false;
        fwd.out_buf.clear();
        fwd.to_server.clear();
        fwd.out_walker = FrameWalker::new(usize::MAX >> 1);
        fwd.copy.clear();
        fwd.waiting = false;
        fwd.replay = false;
        if block || unsynced {
            // Its next statement gets the server's error, unless the
            // client was told it inside the block (then 25P02).
            let untold = (owed == 0 || !block).then_some(error);
            fwd.flow.set_lost_block(Some(LostBlock::new(untold, block)));
        }
        if !out.is_empty() {
            self.sent += out.len() as u64;
            client
                .write_all(&out)
                .await
                .map_err(|_| LoopEnd::ClientLeft)?;
        }
        Ok(())
    }

    /// Whether the client can stay when its server connection died: in
    /// transaction mode, with nothing that lived only on that connection
    /// (pinned state, a COPY, a reset in progress) and no message half
    /// sent either way.
    fn keeps_client(&self, fwd: &Forwarding) -> bool {
        self.mode == PoolMode::Transaction
            && fwd.flow.pinned().is_empty()
            && self.pin_slot.is_none()
            && !fwd.flow.copy_in()
            && !fwd.flow.discarded()
            && fwd.in_walker.at_boundary()
            && fwd.out_walker.at_boundary()
    }

    /// Answers what the client sent while its block is lost (nothing goes
    /// to a server); `true` once it ended the block (the rest of its bytes
    /// go on as usual).
    pub(super) async fn answer_lost_block(
        &mut self,
        client: &mut ClientStream,
        fwd: &mut Forwarding,
    ) -> Result<bool, LoopEnd> {
        let lost = fwd.flow.lost_block().expect("a lost block");
        let mut out = BytesMut::new();
        let mut outcome = Lost::Aborted;
        let walked = fwd
            .in_walker
            .walk(&fwd.in_buf, lost_block::wants_body, |tag, body| {
                outcome = lost.message(tag, body, &mut out);
                match outcome {
                    Lost::Aborted => Visit::Forward,
                    Lost::Ended | Lost::Left => Visit::StopAfter,
                }
            })
            .map_err(LoopEnd::Error)?;
        fwd.message_ended |= walked.ended;
        // Answered here: dropped, never sent.
        spare_buffers::consume(&mut fwd.in_buf, walked.forward);
        self.received += walked.forward as u64;
        if !out.is_empty() {
            self.sent += out.len() as u64;
            client
                .write_all(&out)
                .await
                .map_err(|_| LoopEnd::ClientLeft)?;
        }
        match outcome {
            Lost::Aborted => Ok(false),
            Lost::Ended => {
                fwd.flow.set_lost_block(None);
                Ok(true)
            }
            Lost::Left => Err(LoopEnd::ClientLeft),
        }
    }
}
