//! What the client sent: walked, forwarded, rewritten, refused or held
//! back, and the server connection borrowed first.

use super::*;

impl Session {
    /// Forwards what the client sent: streams it through, rewriting messages
    /// that name prepared statements, and borrows a server connection first
    /// if none is held. What to do with each message is the flow's call.
    pub(super) async fn forward_client_data(
        &mut self,
        client: &mut ClientStream,
        fwd: &mut Forwarding,
    ) -> Result<(), LoopEnd> {
        let rewriting = self.rewriting;
        let pool = self.pool.clone();
        let stats = &pool.stats;
        loop {
            if fwd.flow.lost_block().is_some() && !self.answer_lost_block(client, fwd).await? {
                // Still in the block its server took with it.
                return Ok(());
            }
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
                // Boxed (in a block kept on this thread: no allocation):
                // checkout, the parameter sync and session mode's hooks
                // make a future of a few KB that would otherwise sit in
                // every idle client.
                let checkout = SpareBox::new_with(|| self.begin_transaction(client))
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
                    Box::pin(self.take_pin_slot(client, fwd)).await?;
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
                    // A PREPARE past what the budget allows is refused.
                    let no_room = prepared::prepare_statement_bytes(&message[5..])
                        .filter(|(name, _)| !self.statements.contains(name))
                        .and_then(|(name, bytes)| {
                            let limit = self.deps.config().max_buffered_total;
                            (!self.statements.make_room(bytes, &self.deps.buffers, limit)).then(
                                || prepared::no_room_for(&name, self.statements.bytes(), limit),
                            )
                        });
                    let mut out = BytesMut::with_capacity(message.len() + 64);
                    let rewrite = match no_room {
                        Some(error) => prepared::QueryRewrite {
                            refused: Some(error),
                            ..Default::default()
                        },
                        None => Rewriter {
                            registry: &self.deps.statements,
                            statements: &mut self.statements,
                            prepared: checkout.conn.prepared_mut(),
                            plan: fwd.flow.plan_mut(),
                        }
                        .rewrite_query(
                            &message[5..],
                            failed_block,
                            true,
                            &mut out,
                        ),
                    };
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
                    let failed_block = fwd.flow.known_failed_block();
                    let mut refused = None;
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
                        let rest = whole - 5 - head;
                        refused = prepared::bind_parameter_count(&fwd.in_buf[5..], head)
                            .filter(|_| failed_block)
                            .and_then(|n| rewriter.refuse_miscounted_bind(&name, n, &mut out));
                        if refused.is_some() {
                            // Skipped by the server after the stand-in's error.
                            out.put_u8(frontend::BIND);
                            out.put_u32((4 + head + rest) as u32);
                            out.put_slice(&fwd.in_buf[5..5 + head]);
                        } else {
                            rewriter.rewrite_bind_head(&portal, &name, rest, &mut out);
                        }
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
                        } else if let Some(error) = prepared::parse_statement_bytes(
                            tag,
                            &message[5..],
                        )
                        .and_then(|(name, bytes)| {
                            // Read only for a named Parse: a Bind
                            // takes no configuration load.
                            let limit = self.deps.config().max_buffered_total;
                            let statements = &mut *rewriter.statements;
                            (!statements.make_room(bytes, &self.deps.buffers, limit))
                                .then(|| prepared::no_room_for(name, statements.bytes(), limit))
                        }) {
                            // Past what the budget allows: refused (53200),
                            // nothing of it sent.
                            let mut out = BytesMut::with_capacity(128);
                            rewriter.refusal_stand_in(&mut out);
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
                    if let Some(error) = refused {
                        fwd.flow.refused_rewrite(error);
                    }
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
    pub(super) fn close_idle_to(&self, databases: &[String], server: &crate::backend::ServerConn) {
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
}
