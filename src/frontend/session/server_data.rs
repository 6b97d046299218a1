//! What the server sent: walked, forwarded, dropped or replaced, noted,
//! and the transaction ended when it is over.

use super::*;

impl Session {
    /// Forwards what the server sent, recording what the flow notes
    /// (parameters, dropped statements, errors), answering for rewritten
    /// prepared statements, and releasing the server connection when the
    /// flow says the transaction is over (transaction mode).
    pub(super) async fn forward_server_data(
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
                Some(ServerStep::Fatal) => {
                    // Held, whole, until the connection is seen closed
                    // (serve_loop: `Session::server_gone`).
                    let whole = walked.held.expect("the walk stopped before it");
                    fwd.fatal = Some(fwd.out_buf.split_to(whole));
                }
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
    pub(super) fn record(&mut self, note: Note, server: &mut crate::backend::ServerConn) {
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
}
