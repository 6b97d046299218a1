//! The client side of a flow: which client messages usher reads whole,
//! and what to do with each (forward, rewrite, pin, refuse, wait).

use super::pinning::Gate;
use super::*;

impl Flow {
    /// Which client messages usher reads whole (given the body's length
    /// and the start of it that is in): Query and Parse up to
    /// [`SCAN_LIMIT`], for their SQL; with rewriting, also a larger named
    /// Parse (its text is the shared statement's key), Describe and Close
    /// (small). A Bind is never held: its names are read from its head and
    /// its parameters stream. `None`: more of the head is needed to decide.
    /// (An associated function of `rewriting`, so the walker can ask it
    /// while the flow itself is borrowed by the visitor.)
    pub fn client_wants_body(rewriting: bool, tag: u8, len: usize, head: &[u8]) -> Option<bool> {
        match tag {
            frontend::QUERY => Some(len <= SCAN_LIMIT),
            frontend::PARSE if len <= SCAN_LIMIT => Some(true),
            _ if !rewriting => Some(false),
            // Named: the text is the shared statement's key; unnamed: it
            // is kept, to parse again where the client uses it.
            frontend::PARSE => Some(true),
            frontend::BIND => prepared::bind_names(head).map(|_| false),
            frontend::DESCRIBE | frontend::CLOSE => Some(true),
            _ => Some(false),
        }
    }

    /// A client message (whole, or its head if it streams).
    pub fn client_message(&mut self, tag: u8, body: &[u8]) -> ClientStep {
        let mut check_unnamed = false;
        // The statement it names, read once (a Bind's head is parsed here).
        let named = if self.rewriting {
            prepared::statement_named(tag, body)
        } else {
            None
        };
        match named {
            Some([]) if matches!(tag, frontend::BIND | frontend::DESCRIBE) => {
                match self.plan.unnamed_use() {
                    Use::Here => {}
                    Use::Check => check_unnamed = true,
                    Use::Wait => return ClientStep::Wait,
                }
            }
            // Whether the name exists hangs on an earlier batch's answer.
            Some(name) if !name.is_empty() && self.plan.name_undecided(name) => {
                return ClientStep::Wait;
            }
            _ => {}
        }
        let mut carried = false;
        let effects = match tag {
            frontend::QUERY => {
                let mut effects = sql_scan::scan_query(body);
                let command = self.carried_query(body);
                // A statement run by name may be one of the client's.
                carried = command.is_some() || effects.executes && self.carries_now();
                if let Some(command) = command {
                    self.carry_pins(command, &mut effects);
                }
                Some(effects)
            }
            frontend::PARSE => {
                // Its segment is the one its Sync ends.
                if let Some(text) = super::super::lost_block::parse_text(body) {
                    self.block_control(text, self.syncs_sent + 1);
                }
                Some(sql_scan::scan_parse(body))
            }
            frontend::BIND if !self.pinning_statements.is_empty() => {
                self.bind_pins(body).map(|pins| Effects {
                    pins,
                    ..Effects::default()
                })
            }
            frontend::CLOSE if !self.pinning_statements.is_empty() => {
                if body.first() == Some(&crate::protocol::tags::target::STATEMENT) {
                    let name = cstr(&body[1..]);
                    self.pinning_statements
                        .retain(|(n, _)| n.as_bytes() != name);
                }
                None
            }
            _ => None,
        };
        let mut refused = None;
        if let Some(effects) = &effects {
            match self.gate(tag, effects) {
                Gate::Pass => {}
                Gate::NeedSlot => return ClientStep::Pin,
                Gate::Refuse(error) => refused = Some(error),
            }
        }
        if self.rewriting {
            self.note_shape(tag, body);
        }
        let step = match tag {
            frontend::TERMINATE => return ClientStep::Terminate,
            frontend::QUERY if carried && refused.is_none() => {
                // Counted as it goes out (Flow::query_rewritten).
                self.queries += 1;
                ClientStep::Rewrite
            }
            // PostgreSQL ignores a Sync in COPY IN mode: no ReadyForQuery.
            frontend::SYNC if self.copy_in => ClientStep::Forward,
            frontend::QUERY | frontend::SYNC | frontend::FUNCTION_CALL => {
                self.queries += u64::from(tag == frontend::QUERY);
                if self.rewriting && tag == frontend::QUERY {
                    self.plan.drops_unnamed();
                }
                self.pending += 1;
                self.unsynced = false;
                self.plan.sync_sent();
                self.syncs_sent += 1;
                if tag == frontend::QUERY {
                    self.last_query = self.syncs_sent;
                }
                if tag == frontend::QUERY {
                    if let Some((_, text)) = body.split_last() {
                        self.block_control(text, self.syncs_sent);
                    }
                }
                ClientStep::Forward
            }
            frontend::COPY_DONE | frontend::COPY_FAIL => {
                if !self.copy_in {
                    // Ends a COPY usher has not yet seen start (or none).
                    self.copy_end = Some(self.syncs_sent);
                }
                self.copy_in = false;
                ClientStep::Forward
            }
            frontend::FLUSH | frontend::COPY_DATA => ClientStep::Forward,
            frontend::PARSE
                if refused.is_none()
                    && self.rewriting
                    && !self.unsynced
                    && body.first() == Some(&0)
                    && prepared::unnamed_deallocate(body).is_none() =>
            {
                // The client's unnamed Parse, first in its batch (so
                // answered or refused, never skipped): it goes as it is,
                // and the plan keeps it for the client.
                self.plan.unnamed_parse_forwarded(body);
                self.unsynced = true;
                ClientStep::Forward
            }
            frontend::PARSE | frontend::BIND | frontend::DESCRIBE | frontend::CLOSE
                if refused.is_none()
                    && self.rewriting
                    && (check_unnamed || prepared::needs_rewrite(tag, body)) =>
            {
                self.plan.rewriting(!self.unsynced);
                ClientStep::Rewrite
            }
            _ => {
                self.unsynced = true;
                self.queries += u64::from(tag == frontend::EXECUTE);
                if self.rewriting && matches!(tag, frontend::PARSE | frontend::CLOSE) {
                    // Its ParseComplete/CloseComplete goes to the client.
                    self.plan.passed();
                }
                ClientStep::Forward
            }
        };
        match (refused, effects) {
            (Some(error), _) => {
                if self.rewriting && tag == frontend::PARSE && body.first() == Some(&0) {
                    // Its stand-in fails: the client has no unnamed
                    // statement after it (unless it was skipped, which
                    // usher does not tell apart here).
                    self.plan.drops_unnamed();
                }
                // A Query ends its own segment; a Parse, the next Sync's.
                let segment = self.syncs_sent + u64::from(tag == frontend::PARSE);
                self.refusals.push_back((segment, error));
                ClientStep::Refuse
            }
            (None, Some(mut effects)) => {
                self.closing.append(&mut effects.databases);
                if tag == frontend::PARSE && self.pinning != Pinning::Off {
                    // Each execution of a statement that pins pins again.
                    let name = cstr(body);
                    let pins = effects.pins.without(PinKinds::UNKNOWN);
                    self.pinning_statements
                        .retain(|(n, _)| n.as_bytes() != name);
                    if !pins.is_empty() {
                        let name = String::from_utf8_lossy(name).into_owned();
                        self.pinning_statements.push((name, pins));
                    }
                }
                self.note(effects);
                step
            }
            (None, None) => step,
        }
    }

    pub(super) fn note_shape(&mut self, tag: u8, body: &[u8]) {
        match tag {
            frontend::BIND => {
                self.shape.binds += 1;
                self.shape.described = false;
            }
            frontend::DESCRIBE if body.first() == Some(&crate::protocol::tags::target::PORTAL) => {
                self.shape.described |= self.shape.binds > 0;
            }
            frontend::SYNC => self.last_shape = std::mem::take(&mut self.shape),
            frontend::QUERY | frontend::FUNCTION_CALL => {
                self.shape = Shape::default();
                self.last_shape = Shape::default();
            }
            _ => {}
        }
    }

    /// The session starts copying what the client sends (nothing is in
    /// flight: the next segment is the copy's first), up to
    /// [`REPLAY_LIMIT`].
    pub fn copy_started(&mut self) {
        self.copy = Some(self.syncs_sent + 1);
    }

    /// The session's copy is gone (too large, or replayed).
    pub fn copy_lost(&mut self) {
        self.copy = None;
    }

    /// The session keeps a copy of what the client sends.
    pub fn copying(&self) -> bool {
        self.copy.is_some()
    }

    /// A Query usher carries as a statement about a prepared statement:
    /// transaction mode with rewriting, read whole, and not in the middle
    /// of an extended-protocol pipeline or COPY.
    pub(super) fn carried_query<'b>(&self, body: &'b [u8]) -> Option<SqlPrepared<'b>> {
        if !self.carries_now() {
            return None;
        }
        sql_scan::prepared_command(body.strip_suffix(&[0])?)
    }

    pub(super) fn carries_now(&self) -> bool {
        self.rewriting && !self.unsynced && !self.copy_in
    }

    /// A carried PREPARE pins nothing (the statement lives in usher); its
    /// text's pins are those of each EXECUTE of it, as with a Bind of a
    /// protocol-level statement; a DEALLOCATE forgets them.
    pub(super) fn carry_pins(&mut self, command: SqlPrepared<'_>, effects: &mut Effects) {
        match command {
            SqlPrepared::Prepare { name, .. } => {
                let pins = effects
                    .pins
                    .without(PinKinds::SQL_PREPARE | PinKinds::UNKNOWN);
                effects.pins = PinKinds::NONE;
                if self.pinning != Pinning::Off && !pins.is_empty() {
                    self.pinning_statements.retain(|(n, _)| *n != name);
                    self.pinning_statements.push((name, pins));
                }
            }
            SqlPrepared::Execute { name, .. } => {
                for (_, pins) in self.pinning_statements.iter().filter(|(n, _)| *n == name) {
                    effects.pins |= *pins;
                }
            }
            SqlPrepared::Deallocate { name } => {
                self.pinning_statements.retain(|(n, _)| *n != name);
            }
        }
    }

    /// A carried Query (the flow said [`ClientStep::Rewrite`]) went out as
    /// `Rewriter::rewrite_query` made it: count its segments and track
    /// what it asked for.
    pub fn query_rewritten(&mut self, rewrite: QueryRewrite) {
        let owns = !rewrite.own.is_empty();
        for own in rewrite.own {
            self.segment_sent();
            self.track(own, false);
        }
        self.plan.drops_unnamed();
        self.segment_sent();
        if let Some(error) = rewrite.refused {
            self.refusals.push_back((self.syncs_sent, error));
        }
        // After usher's own segments it is tracked: it may owe an error
        // to drop.
        self.track(rewrite.client, owns);
    }

    pub(super) fn segment_sent(&mut self) {
        self.pending += 1;
        self.unsynced = false;
        self.plan.sync_sent();
        self.syncs_sent += 1;
    }

    pub(super) fn track(&mut self, plan: Segment, always: bool) {
        if plan == Segment::default() && !always {
            return;
        }
        self.tracked.push_back(Tracked {
            segment: self.syncs_sent,
            plan,
            deallocated: false,
            made: false,
            swallow_error: false,
        });
    }

    /// The server connection is known to be in a failed transaction block
    /// (nothing is in flight and the last ReadyForQuery said 'E').
    pub fn known_failed_block(&self) -> bool {
        self.quiet() && self.status == status::FAILED
    }

    /// SQL PREPAREs that failed since last asked: (client name, statement
    /// id), for the session to forget.
    pub fn take_failed_prepares(&mut self) -> Vec<(String, u64)> {
        std::mem::take(&mut self.failed_prepares)
    }

    /// The tracked segment being answered now, if any.
    pub(super) fn answering(&mut self) -> Option<&mut Tracked> {
        let now = self.ready_seen + 1;
        self.tracked.front_mut().filter(|t| t.segment == now)
    }

    /// A rewritten message went to the server in place of the client's.
    pub fn rewritten(&mut self) {
        self.unsynced = true;
    }

    /// A message the flow said to rewrite was refused instead (a Parse of
    /// a name the client has: 42P05): [`refused_message`] went in its
    /// place, whose server error is replaced by `error`.
    pub fn refused_rewrite(&mut self, error: PgError) {
        self.refusals.push_back((self.syncs_sent + 1, error));
    }

    /// What `prepared::Rewriter` records its owed answers in.
    pub fn plan_mut(&mut self) -> &mut ResponsePlan {
        &mut self.plan
    }

    /// usher sent a Sync of its own (closing a pipeline a client left).
    pub fn sync_added(&mut self) {
        self.segment_sent();
    }
}

impl Flow {
    /// Notes a statement text of segment `segment` that begins or ends a
    /// transaction block: should the server die with segments in flight,
    /// the session tells from them whether the client is left in a block
    /// (`session/server_lost.rs`). One look at the first word.
    fn block_control(&mut self, text: &[u8], segment: u64) {
        match sql_scan::block_control(text) {
            Some(sql_scan::BlockControl::Begins) => self.begin_segment = segment,
            Some(sql_scan::BlockControl::Ends) => self.exit_segment = segment,
            None => {}
        }
    }
}
