//! The server side of a flow: which server messages usher reads whole, and
//! what to do with each (forward, release, drop, replace, retry).

use super::*;

impl Flow {
    /// Which server messages usher reads whole.
    pub fn server_wants_body(tag: u8, len: usize) -> bool {
        matches!(
            tag,
            backend::READY_FOR_QUERY
                | backend::PARAMETER_STATUS
                | backend::COMMAND_COMPLETE
                | backend::PARSE_COMPLETE
                | backend::CLOSE_COMPLETE
        ) || (tag == backend::ERROR_RESPONSE && len <= ERROR_BODY_LIMIT)
    }

    /// A server message (whole if [`Flow::server_wants_body`] said so).
    /// `prepared` is the server connection's set of usher's statements;
    /// `client_at_boundary`: nothing of the client's is half-read or
    /// queued, so the connection may be released here.
    pub fn server_message(
        &mut self,
        tag: u8,
        body: &[u8],
        prepared: &mut PreparedSet,
        client_at_boundary: bool,
    ) -> (ServerStep, Option<Note>) {
        let mut note = None;
        if tag == backend::COMMAND_COMPLETE && changes_schema(body) {
            self.schema_changed = true;
            self.ddl_open = true;
        }
        let step = match tag {
            backend::COPY_IN_RESPONSE => {
                self.copy_in = self.copy_started_at();
                ServerStep::Forward
            }
            backend::READY_FOR_QUERY => {
                self.copy_in = false;
                if self.copy_end.is_some_and(|e| e <= self.ready_seen) {
                    // Not the end of a COPY to come.
                    self.copy_end = None;
                }
                self.pending = self.pending.saturating_sub(1);
                self.ready_seen += 1;
                // A refused message the server skipped (an earlier error in
                // its pipeline): its error will not come.
                while self
                    .refusals
                    .front()
                    .is_some_and(|(segment, _)| *segment <= self.ready_seen)
                {
                    self.refusals.pop_front();
                }
                self.status = body.first().copied().unwrap_or(status::IDLE);
                if self.ddl_open && self.status == status::IDLE {
                    // Committed (or rolled back): now others see it.
                    self.ddl_open = false;
                    self.schema_changed = true;
                }
                self.answered = false;
                if self.rewriting {
                    self.plan.ready(prepared);
                }
                if self
                    .tracked
                    .front()
                    .is_some_and(|t| t.segment <= self.ready_seen)
                {
                    let own = self.segment_answered(prepared);
                    if own {
                        return (ServerStep::Drop, None);
                    }
                }
                if self.status == status::IDLE && self.pending == 0 {
                    note = Some(Note::TransactionDone);
                }
                let release = self.mode == PoolMode::Transaction
                    && self.status == status::IDLE
                    && self.quiet()
                    && client_at_boundary;
                if self.resets_pending() && self.quiet() && client_at_boundary {
                    ServerStep::Settle { release }
                } else if release {
                    ServerStep::ForwardThenRelease
                } else {
                    ServerStep::Forward
                }
            }
            backend::PARAMETER_STATUS => {
                let held = self.resets_pending();
                note = messages::parse_parameter_status(body)
                    .map(|(name, value)| Note::Parameter { name, value, held });
                if held {
                    ServerStep::Drop
                } else {
                    ServerStep::Forward
                }
            }
            backend::COMMAND_COMPLETE if self.answering().is_some() => {
                let t = self.answering().expect("a tracked segment");
                t.made |= body == b"PREPARE\0";
                t.deallocated |= body == b"DEALLOCATE\0";
                if t.plan.drop_completes > 0 {
                    t.plan.drop_completes -= 1;
                    ServerStep::Drop
                } else {
                    ServerStep::Forward
                }
            }
            backend::COMMAND_COMPLETE => {
                let discard_all = body == b"DISCARD ALL\0";
                if discard_all || body == b"DEALLOCATE ALL\0" {
                    prepared.clear();
                    self.pinning_statements.clear();
                    self.discarded |= discard_all;
                    note = Some(Note::StatementsDropped { discard_all });
                }
                ServerStep::Forward
            }
            backend::PARSE_COMPLETE | backend::CLOSE_COMPLETE if self.rewriting => {
                match self.plan.answer(tag, prepared) {
                    Answer::Forward => ServerStep::Forward,
                    Answer::Drop => ServerStep::Drop,
                }
            }
            backend::ERROR_RESPONSE
                if self.mode == PoolMode::Transaction && messages::error_is_fatal(body) =>
            {
                self.server_fatal = true;
                note = Some(Note::Error {
                    code: messages::error_code(body).unwrap_or_default().to_vec(),
                    stale: Vec::new(),
                });
                ServerStep::Fatal
            }
            backend::ERROR_RESPONSE => {
                self.server_fatal |= messages::error_is_fatal(body);
                if self.rewriting {
                    self.plan.error(prepared);
                }
                let adjusted = if body.is_empty() {
                    // Not read whole: it goes as it is.
                    None
                } else if self.replayable(body, client_at_boundary) {
                    // Its ReadyForQuery is dropped: the replay's is the
                    // client's.
                    self.tracked.push_front(Tracked {
                        segment: self.ready_seen + 1,
                        plan: Segment {
                            own: true,
                            ..Segment::default()
                        },
                        deallocated: false,
                        made: false,
                        swallow_error: false,
                    });
                    self.copy = None;
                    Some(ServerStep::Replay)
                } else {
                    self.tracked_error(body)
                };
                if let Some(step) = adjusted {
                    let code = messages::error_code(body).unwrap_or_default();
                    let stale = if matches!(step, ServerStep::Retry(_) | ServerStep::Replay)
                        || matches!(step, ServerStep::SendError(_)) && renews(code)
                    {
                        self.plan.take_used()
                    } else {
                        Vec::new()
                    };
                    note = (step != ServerStep::Drop || !stale.is_empty()).then(|| Note::Error {
                        code: code.to_vec(),
                        stale,
                    });
                    step
                } else if let Some(refusal) = self.refused_answered(body) {
                    ServerStep::SendRefusal(refusal)
                } else {
                    let code = messages::error_code(body).unwrap_or_default();
                    let stale = if self.rewriting && renews(code) {
                        self.plan.take_used()
                    } else {
                        Vec::new()
                    };
                    note = Some(Note::Error {
                        code: code.to_vec(),
                        stale,
                    });
                    if self.rewriting && prepared::error_names_server_statement(body) {
                        ServerStep::NameStatements
                    } else {
                        ServerStep::Forward
                    }
                }
            }
            _ => ServerStep::Forward,
        };
        if tag != backend::READY_FOR_QUERY
            && matches!(
                step,
                ServerStep::Forward
                    | ServerStep::SendRefusal(_)
                    | ServerStep::NameStatements
                    | ServerStep::SendError(_)
            )
        {
            self.answered = true;
        }
        (step, note)
    }

    /// The server started a COPY IN (in the segment being answered): the
    /// Syncs the client sent after the message that started it, and before
    /// its CopyDone or CopyFail, are ignored by the server (tokio-postgres
    /// and libpq send one right after an Execute of COPY): they owe no
    /// ReadyForQuery, and their segments are the COPY's. Returns whether
    /// the COPY is still on from the client's side.
    pub(super) fn copy_started_at(&mut self) -> bool {
        let r = self.ready_seen + 1;
        let (last, on) = match self.copy_end.take() {
            Some(e) => (e, false),
            None => (self.syncs_sent, true),
        };
        // A Query that started it is its own end, not a Sync.
        let mut ignored = (last + 1).saturating_sub(r);
        if ignored > 0 && self.last_query == r {
            ignored -= 1;
        }
        if ignored > 0 {
            self.syncs_ignored(r, ignored);
        }
        on
    }

    /// Syncs `r..r + n` (counted from 1) owe nothing: later segments are
    /// numbered `n` lower, and those ended by them join segment `r`.
    pub(super) fn syncs_ignored(&mut self, r: u64, n: u64) {
        let shift = |v: u64| prepared::renumbered(v, r, n);
        self.pending = self.pending.saturating_sub(n as u32);
        self.syncs_sent -= n;
        self.last_query = shift(self.last_query);
        if self.syncs_sent < r {
            self.unsynced = true;
        }
        for (segment, _) in &mut self.refusals {
            *segment = shift(*segment);
        }
        for t in &mut self.tracked {
            t.segment = shift(t.segment);
        }
        if self.resets_from > 0 {
            self.resets_from = shift(self.resets_from);
        }
        self.copy = self.copy.map(shift);
        for segment in [&mut self.begin_segment, &mut self.exit_segment] {
            if *segment > 0 {
                *segment = shift(*segment);
            }
        }
        self.plan.syncs_ignored(r, n);
    }

    /// A stale statement's error (0A000) for a protocol-level Bind that
    /// usher can run again: the segment began outside a transaction block
    /// (the last ReadyForQuery said 'I': the error rolled back all it did),
    /// it is the only one in flight and the last sent (nothing of the
    /// client's after it has gone out, or is half read), the session holds
    /// a copy of it whole, nothing of its answer reached the client yet,
    /// and it is one Bind of a statement of usher's followed by a Describe
    /// of its portal (libpq's PQexecPrepared: the client reads the rows
    /// with the RowDescription the replay sends, never with one of the old
    /// shape).
    pub(super) fn replayable(&self, body: &[u8], client_at_boundary: bool) -> bool {
        let segment = self.ready_seen + 1;
        self.rewriting
            && messages::error_code(body) == Some(STALE_STATEMENT)
            && client_at_boundary
            && self.status == status::IDLE
            && self.pending == 1
            && self.syncs_sent == segment
            && !self.unsynced
            && self.copy == Some(segment)
            && !self.answered
            && self.last_shape.binds == 1
            && self.last_shape.described
            && self.plan.bound_usher_statement()
            && self.tracked.is_empty()
    }

    /// A tracked segment's ReadyForQuery came: whether the statement it
    /// PREPAREd is on the server now (a failed PREPARE: the client's name
    /// is forgotten). Returns whether the segment was usher's own.
    pub(super) fn segment_answered(&mut self, prepared: &mut PreparedSet) -> bool {
        let t = self.tracked.pop_front().expect("a tracked segment");
        if let Some(Prepares {
            id,
            name,
            after_deallocate,
        }) = t.plan.prepares
        {
            // Untouched if neither ran (a failed block).
            let present = t.made || (after_deallocate && !t.deallocated);
            if !present {
                prepared.pop(&id);
            }
            if let Some(name) = name.filter(|_| !t.made) {
                self.failed_prepares.push((name, id));
            }
        }
        t.plan.own
    }

    /// What to do with an error in a tracked segment, if it is not simply
    /// forwarded: the error an EXECUTE gets after usher's own PREPARE of
    /// its statement failed (the client sees that one), or a stale
    /// statement's error that can be retried. A retry is safe when the
    /// EXECUTE ran outside a transaction block (the last ReadyForQuery said
    /// 'I', and a Query holding one statement is a transaction of its own,
    /// rolled back by the error: nothing of it happened) and nothing the
    /// client sent after it has gone out (the answers stay in order).
    pub(super) fn tracked_error(&mut self, body: &[u8]) -> Option<ServerStep> {
        let (idle, syncs_sent, unsynced) =
            (self.status == status::IDLE, self.syncs_sent, self.unsynced);
        let t = self.answering()?;
        if t.swallow_error {
            t.swallow_error = false;
            return Some(ServerStep::Drop);
        }
        if t.plan.own {
            // The client's Query after usher's segments fails for it.
            let own = t.segment;
            if let Some(client) = self
                .tracked
                .iter_mut()
                .find(|t| t.segment > own && !t.plan.own)
            {
                client.swallow_error = true;
            }
            return None;
        }
        let stale = messages::error_code(body) == Some(STALE_STATEMENT);
        if let Some(moved) = Self::moved_position(&t.plan.edits, body) {
            if !(stale && t.plan.retry.is_some()) {
                let mut error = BytesMut::with_capacity(moved.len() + 5);
                error.put_u8(backend::ERROR_RESPONSE);
                error.put_u32(moved.len() as u32 + 4);
                error.put_slice(&moved);
                return Some(ServerStep::SendError(error));
            }
        }
        if stale && t.plan.retry.is_some() && idle && syncs_sent == t.segment && !unsynced {
            // Its ReadyForQuery is dropped; the retry is the client's now.
            t.plan.own = true;
            return t.plan.retry.take().map(ServerStep::Retry);
        }
        None
    }

    /// An error body with its position (field P) told in the client's text,
    /// if it has one and usher's text differs from the client's.
    pub(super) fn moved_position(edits: &[prepared::Edit], body: &[u8]) -> Option<Vec<u8>> {
        if edits.is_empty() {
            return None;
        }
        let position: usize = std::str::from_utf8(messages::error_field_of(body, b'P')?)
            .ok()?
            .parse()
            .ok()?;
        let moved = prepared::client_position(edits, position);
        messages::with_error_field(body, b'P', moved.to_string().as_bytes())
    }

    /// An ErrorResponse is the server's answer to a refused message's
    /// stand-in (its segment is the one being answered, and it names the
    /// marker): usher's error takes its place.
    pub(super) fn refused_answered(&mut self, body: &[u8]) -> Option<PgError> {
        let ours = self
            .refusals
            .front()
            .is_some_and(|(segment, _)| *segment == self.ready_seen + 1)
            && messages::error_message(body).is_some_and(|m| {
                m.windows(REFUSED_MARKER.len())
                    .any(|w| w == REFUSED_MARKER.as_bytes())
            });
        if !ours {
            return None;
        }
        self.refusals.pop_front().map(|(_, e)| e)
    }
}
