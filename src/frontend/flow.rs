//! The forwarding decisions of one session, without I/O.
//!
//! [`Flow`] is told every message that passes, in each direction, and
//! decides: which messages usher must read whole, which to forward, which
//! to rewrite (named prepared statements in transaction mode), which server
//! answers to drop or replace, and when the server connection may go back
//! to the pool. It also keeps the conversation's state: ReadyForQuery
//! messages owed, an unsynced pipeline, COPY IN, the transaction status, a
//! completed DISCARD ALL, a FATAL from the server.
//!
//! Pinning (transaction mode): statements that leave state the server
//! connection cannot hand to another client (`sql_scan::PinKinds`) make
//! the session keep its connection across transactions until the state is
//! gone ([`Flow::transaction_end`]: kept, released, or the server is asked
//! what is left, [`Flow::checked`]). Before such a statement goes out the
//! session takes a pin slot of its pool ([`ClientStep::Pin`], `max_pinned`);
//! with `pinning: error`, or no slot to be had, the statement is refused
//! ([`ClientStep::Refuse`]): it is replaced by one that fails on the
//! server ([`refused_message`]), whose error is replaced by usher's
//! ([`ServerStep::SendRefusal`]), so the answers stay in order and a
//! transaction block is aborted as it would be directly.
//!
//! The serve loop (`session.rs`) only moves bytes: it walks them with a
//! `FrameWalker`, hands each message to the flow, and acts on the
//! [`ClientStep`] or [`ServerStep`] it returns. The unit tests below drive
//! a flow with byte fixtures, as `protocol/frames.rs` is tested.

use super::prepared::{self, Answer, Prepares, QueryRewrite, ResponsePlan, Segment};
use super::sql_scan::{self, Effects, PinKinds, SqlPrepared};
use super::unnamed::Use;
use crate::backend::PreparedSet;
use crate::config::{Pinning, PoolMode};
use crate::protocol::error::sqlstate;
use crate::protocol::messages;
use crate::protocol::tags::{backend, frontend, status};
use crate::protocol::PgError;
use bytes::{BufMut, Bytes, BytesMut};
use std::collections::VecDeque;

/// Server ErrorResponses up to this size are read whole for their SQLSTATE.
pub const ERROR_BODY_LIMIT: usize = 64 * 1024;

/// The SQLSTATE of "cached plan must not change result type" (also used
/// for other unsupported features: a false alarm costs a re-prepare).
const STALE_STATEMENT: &[u8] = b"0A000";

/// The SQLSTATE of "cache lookup failed for type" (a statement whose type
/// DDL dropped and made again; an internal error otherwise, where a
/// re-prepare costs little).
const INTERNAL_ERROR: &[u8] = b"XX000";

/// An error after which the statements bound since the last ReadyForQuery
/// are renewed (prepared afresh where next used).
fn renews(code: &[u8]) -> bool {
    code == STALE_STATEMENT || code == INTERNAL_ERROR
}

/// A CommandComplete tag of a statement that may change what prepared
/// statements mean (their parameter or result types).
fn changes_schema(tag: &[u8]) -> bool {
    [&b"CREATE "[..], b"ALTER ", b"DROP "]
        .iter()
        .any(|p| tag.starts_with(p))
}

/// Query and Parse messages up to this size are read whole, so their SQL
/// can be scanned for what it does to the session (`sql_scan`); larger
/// ones stream, and count as changing anything.
pub const SCAN_LIMIT: usize = 64 * 1024;

/// What to do with a client message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientStep {
    /// Send it to the server as it is.
    Forward,
    /// It names a prepared statement: stop before it and rewrite it
    /// (`prepared::Rewriter`); then tell the flow with [`Flow::rewritten`].
    Rewrite,
    /// Terminate: the client is leaving.
    Terminate,
    /// It would pin the server connection and the session holds no pin
    /// slot: stop before it, take one (or tell the flow it cannot be had,
    /// [`Flow::no_pin_slot`]), and walk it again.
    Pin,
    /// It is refused: send [`refused_message`] in its place (the flow has
    /// counted it as sent).
    Refuse,
    /// It uses a statement (the unnamed one, or a name) that a message of
    /// an earlier batch may or may not have changed (it may be skipped
    /// after an error): stop before it and walk it again once the server
    /// has answered more (see `super::unnamed`).
    Wait,
}

/// What to do with a server message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerStep {
    /// Send it to the client.
    Forward,
    /// Send it, then give the server connection back: the transaction is
    /// over and nothing is owed (transaction mode).
    ForwardThenRelease,
    /// The client did not ask for it (a ParseComplete of a statement usher
    /// prepared on its own): drop it.
    Drop,
    /// The server's error for a refused statement: send usher's instead.
    SendRefusal(PgError),
    /// The client's EXECUTE failed because its statement is stale, outside
    /// a transaction block, with nothing sent after it: drop the error and
    /// send this Query of the client's again (rewritten afresh; the
    /// statement was renewed by the error's note), telling the flow
    /// ([`Flow::query_rewritten`]).
    Retry(Bytes),
    /// The error of a rewritten Query, its position told in the client's
    /// text: send this (a whole ErrorResponse) instead.
    SendError(BytesMut),
    /// The same for a protocol-level Bind (see [`Flow::copy_started`]):
    /// drop the error and walk the client's copy of the segment again, in
    /// front of what the client sent since (its ReadyForQuery is dropped).
    Replay,
    /// A server error names one of usher's statements: send it with the
    /// client's name instead (`ClientStatements::error_in_client_names`).
    NameStatements,
    /// A ReadyForQuery (nothing else in flight) after statements that may
    /// have reset settings: on the server connection a reset went to the
    /// server's default. Before the client hears it, the session puts back
    /// what PostgreSQL would have ([`Flow::take_resets`], or reading the
    /// settings back; nothing in a failed block, whose abort undid them)
    /// and tells the client the parameters that changed from what it was
    /// told (their ParameterStatus messages were held back); then it sends
    /// it, and gives the connection back if `release`.
    Settle { release: bool },
}

/// What a session does with its server connection at the end of a
/// transaction (transaction mode).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PinStep {
    /// Nothing ties the client to it: give it back.
    Release,
    /// The client holds state on it ([`Flow::pinned`]): keep it.
    Keep,
    /// A statement may have ended the state (or nobody knows what a text
    /// usher did not read left): ask the server ([`Flow::checked`]).
    Check,
}

/// The refused statement's stand-in: a quoted identifier no query can
/// resolve, so the server fails it at parse analysis (42703), whatever the
/// session, in order with the client's other messages.
pub(crate) const REFUSED_MARKER: &str = "usher refused this statement";

/// Something a server message told, for the session to record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Note {
    /// ParameterStatus: the server's value of a reported parameter.
    /// `held`: not sent to the client (a reset is being settled, see
    /// [`ServerStep::Settle`]).
    Parameter {
        name: String,
        value: String,
        held: bool,
    },
    /// DISCARD ALL or DEALLOCATE ALL completed: the server dropped its
    /// prepared statements (DISCARD ALL: and reset its settings).
    StatementsDropped { discard_all: bool },
    /// An ErrorResponse with this SQLSTATE (empty if it was not read).
    /// `stale`: usher's server statements it may be about, when it says
    /// a statement is stale (0A000, "cached plan must not change result
    /// type", after DDL).
    Error { code: Vec<u8>, stale: Vec<u64> },
    /// A transaction ended (ReadyForQuery 'I' with nothing more owed).
    TransactionDone,
}

/// The state of one session's conversation with its server connection.
#[derive(Debug)]
pub struct Flow {
    mode: PoolMode,
    /// Transaction mode with protocol-level prepared statements.
    rewriting: bool,
    /// Sync, Query and FunctionCall messages sent whose ReadyForQuery has
    /// not come.
    pending: u32,
    /// Extended-protocol messages sent since the last Sync.
    unsynced: bool,
    /// Transaction status of the last ReadyForQuery.
    status: u8,
    /// The server asked for COPY data and waits for CopyDone or CopyFail.
    copy_in: bool,
    /// ParseComplete/CloseComplete answers owed for rewritten messages.
    plan: ResponsePlan,
    /// A DISCARD ALL completed: the session begins anew once quiet.
    discarded: bool,
    /// The server sent a FATAL (or PANIC): its end is no news.
    server_fatal: bool,
    /// Queries (Query and Execute messages) seen since last taken.
    queries: u64,
    /// What the client's statements since the session last settled may
    /// have done to the session (settings changed, reset).
    effects: Effects,
    /// The first segment (counted from 1, as `ready_seen`) whose answers
    /// may come after a reset in `effects.resets`.
    resets_from: u64,
    /// What pins do in this session (`off` in session mode).
    pinning: Pinning,
    /// State the server connection holds for this client (transaction
    /// mode): the connection is kept until it is gone.
    pinned: PinKinds,
    /// State the client's statements since the last transaction end may
    /// have left, and may have ended.
    pins_seen: PinKinds,
    unpins_seen: PinKinds,
    /// The session holds a pin slot of its pool.
    slot: bool,
    /// Protocol-level statements whose text pins, by name: each Bind of
    /// one pins again (usually empty).
    pinning_statements: Vec<(String, PinKinds)>,
    /// No pin slot could be had: refuse the next pinning message
    /// (`max_pinned`, whether the session waited).
    refuse_next: Option<(usize, bool)>,
    /// Refused messages whose server error is owed: (the ReadyForQuery
    /// that ends their Sync segment, counted from 1; usher's error).
    refusals: VecDeque<(u64, PgError)>,
    syncs_sent: u64,
    ready_seen: u64,
    /// Segments whose answers usher adjusts (SQL-level prepared
    /// statements), oldest first; usually empty.
    tracked: VecDeque<Tracked>,
    /// SQL PREPAREs that failed: (the client's name, the statement id).
    failed_prepares: Vec<(String, u64)>,
    /// The first segment of which the session holds a copy of the
    /// client's bytes, from its first byte on (a stale Bind's segment is
    /// replayed from it).
    copy: Option<u64>,
    /// The shape of the extended-protocol segment being sent, and of the
    /// last one sent (its Sync went).
    shape: Shape,
    last_shape: Shape,
    /// Something of the segment being answered reached the client.
    answered: bool,
    /// Databases a message just walked fails on while other sessions are
    /// connected to them (`Effects::databases`), until the session takes
    /// them ([`Flow::take_closing`]).
    closing: Vec<String>,
    /// DDL completed since the session last asked
    /// ([`Flow::take_schema_changed`]).
    schema_changed: bool,
    /// DDL completed in the transaction not yet ended: its end changes the
    /// schema for everyone else.
    ddl_open: bool,
    /// `syncs_sent` when the client ended a COPY IN (CopyDone or CopyFail)
    /// before usher saw the server start it (see [`Flow::copy_started_at`]).
    copy_end: Option<u64>,
    /// The number (`syncs_sent`) of the last Query sent.
    last_query: u64,
}

/// What an extended-protocol segment held, for the replay's safety.
#[derive(Debug, Clone, Copy, Default)]
struct Shape {
    binds: u32,
    /// A Describe of the portal followed the (last) Bind: the client reads
    /// the rows with the RowDescription it gets now, not with one it kept.
    described: bool,
}

/// Client segments up to this size are copied for a replay.
pub const REPLAY_LIMIT: usize = 16 * 1024;

/// A segment being answered whose answers usher adjusts.
#[derive(Debug)]
struct Tracked {
    /// The ReadyForQuery that ends it (counted from 1).
    segment: u64,
    plan: Segment,
    /// Its DEALLOCATE / PREPARE of the statement completed.
    deallocated: bool,
    made: bool,
    /// usher's own segment before it failed: drop its first error.
    swallow_error: bool,
}

impl Flow {
    pub fn new(mode: PoolMode, rewriting: bool, pinning: Pinning) -> Self {
        Flow {
            mode,
            rewriting,
            pending: 0,
            unsynced: false,
            status: status::IDLE,
            copy_in: false,
            plan: ResponsePlan::default(),
            discarded: false,
            server_fatal: false,
            queries: 0,
            effects: Effects::default(),
            resets_from: 0,
            pinning: match mode {
                PoolMode::Transaction => pinning,
                PoolMode::Session => Pinning::Off,
            },
            pinned: PinKinds::NONE,
            pins_seen: PinKinds::NONE,
            unpins_seen: PinKinds::NONE,
            slot: false,
            pinning_statements: Vec::new(),
            refuse_next: None,
            refusals: VecDeque::new(),
            syncs_sent: 0,
            ready_seen: 0,
            tracked: VecDeque::new(),
            failed_prepares: Vec::new(),
            copy: None,
            shape: Shape::default(),
            last_shape: Shape::default(),
            answered: false,
            closing: Vec::new(),
            schema_changed: false,
            ddl_open: false,
            copy_end: None,
            last_query: 0,
        }
    }

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
        if self.rewriting && prepared::uses_unnamed(tag, body) {
            match self.plan.unnamed_use() {
                Use::Here => {}
                Use::Check => check_unnamed = true,
                Use::Wait => return ClientStep::Wait,
            }
        }
        if self.rewriting
            && prepared::statement_named(tag, body)
                .is_some_and(|name| !name.is_empty() && self.plan.name_undecided(name))
        {
            // Whether the name exists hangs on an earlier batch's answer.
            return ClientStep::Wait;
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
            frontend::PARSE => Some(sql_scan::scan_parse(body)),
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

    fn note_shape(&mut self, tag: u8, body: &[u8]) {
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
    fn carried_query<'b>(&self, body: &'b [u8]) -> Option<SqlPrepared<'b>> {
        if !self.carries_now() {
            return None;
        }
        sql_scan::prepared_command(body.strip_suffix(&[0])?)
    }

    fn carries_now(&self) -> bool {
        self.rewriting && !self.unsynced && !self.copy_in
    }

    /// A carried PREPARE pins nothing (the statement lives in usher); its
    /// text's pins are those of each EXECUTE of it, as with a Bind of a
    /// protocol-level statement; a DEALLOCATE forgets them.
    fn carry_pins(&mut self, command: SqlPrepared<'_>, effects: &mut Effects) {
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

    fn segment_sent(&mut self) {
        self.pending += 1;
        self.unsynced = false;
        self.plan.sync_sent();
        self.syncs_sent += 1;
    }

    fn track(&mut self, plan: Segment, always: bool) {
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
    fn answering(&mut self) -> Option<&mut Tracked> {
        let now = self.ready_seen + 1;
        self.tracked.front_mut().filter(|t| t.segment == now)
    }

    /// What a Bind of a statement whose text pins pins (all such
    /// statements' kinds if its names are not in the head usher saw).
    fn bind_pins(&self, body: &[u8]) -> Option<PinKinds> {
        let pins = match prepared::bind_names(body) {
            Some((_, name, _)) => self
                .pinning_statements
                .iter()
                .filter(|(n, _)| n == name)
                .fold(PinKinds::NONE, |all, (_, k)| all | *k),
            None => self
                .pinning_statements
                .iter()
                .fold(PinKinds::NONE, |all, (_, k)| all | *k),
        };
        (!pins.is_empty()).then_some(pins)
    }

    /// Whether a Query, Parse or Bind with these effects may go out.
    fn gate(&mut self, tag: u8, effects: &Effects) -> Gate {
        // What the scan recognised; state left by a text it could not read
        // is found by asking the server afterwards.
        let pins = effects.pins.without(PinKinds::UNKNOWN);
        if pins.is_empty() {
            return Gate::Pass;
        }
        match self.pinning {
            Pinning::Off => Gate::Pass,
            // A Bind cannot be refused (it has no stand-in): the statement
            // it runs pins even past max_pinned.
            _ if tag == frontend::BIND => match self.refuse_next.take() {
                Some(_) => Gate::Pass,
                None if self.slot => Gate::Pass,
                None => Gate::NeedSlot,
            },
            Pinning::Error => Gate::Refuse(refused_for_pinning(pins)),
            Pinning::Auto if self.slot => Gate::Pass,
            Pinning::Auto => match self.refuse_next.take() {
                Some((max_pinned, waited)) => {
                    Gate::Refuse(no_pin_slot_error(pins, max_pinned, waited))
                }
                None => Gate::NeedSlot,
            },
        }
    }

    /// Keeps what a text may do: its settings until the session settles
    /// them, its pins until the transaction ends.
    fn note(&mut self, effects: Effects) {
        if self.effects.resets.is_empty() && !effects.resets.is_empty() {
            self.resets_from = self.ready_seen + 1;
        }
        if self.pinning != Pinning::Off {
            self.pins_seen |= effects.pins;
            self.unpins_seen |= effects.unpins;
        }
        self.effects.add(effects);
    }

    /// The databases whose idle server connections usher closes before
    /// the messages walked go out: DROP DATABASE and the like fail while
    /// other sessions are connected (usually empty).
    pub fn take_closing(&mut self) -> Vec<String> {
        std::mem::take(&mut self.closing)
    }

    /// The session took a pin slot (before a pinning statement, or for
    /// state the server said it holds).
    pub fn slot_taken(&mut self) {
        self.slot = true;
    }

    /// The session gave its pin slot back.
    pub fn slot_given_back(&mut self) {
        self.slot = false;
    }

    /// The session holds a pin slot.
    pub fn has_slot(&self) -> bool {
        self.slot
    }

    /// No pin slot could be had for the message the flow stopped at
    /// ([`ClientStep::Pin`]; `max_pinned` of the pool, and whether the
    /// session waited for one): it is refused (53300) when walked again.
    pub fn no_pin_slot(&mut self, max_pinned: usize, waited: bool) {
        self.refuse_next = Some((max_pinned, waited));
    }

    /// The transaction is over and nothing is owed (the flow said
    /// [`ServerStep::ForwardThenRelease`]): keep the server connection,
    /// give it back, or ask the server first.
    pub fn transaction_end(&mut self) -> PinStep {
        if self.pinning == Pinning::Off {
            return PinStep::Release;
        }
        let candidates = self.pinned | self.pins_seen;
        if candidates.is_empty() {
            self.pins_seen = PinKinds::NONE;
            self.unpins_seen = PinKinds::NONE;
            return PinStep::Release;
        }
        let checkable = candidates.and(PinKinds::CHECKABLE);
        if candidates.contains(PinKinds::UNKNOWN) || self.unpins_seen.intersects(checkable) {
            return PinStep::Check;
        }
        self.pinned = candidates;
        self.pins_seen = PinKinds::NONE;
        self.unpins_seen = PinKinds::NONE;
        PinStep::Keep
    }

    /// The server said which state it holds (after [`PinStep::Check`]):
    /// that, and a LOAD (which nothing undoes), is what pins now.
    pub fn checked(&mut self, present: PinKinds) -> PinStep {
        let candidates = self.pinned | self.pins_seen;
        self.pinned = present.and(PinKinds::CHECKABLE) | candidates.and(PinKinds::LOAD);
        self.pins_seen = PinKinds::NONE;
        self.unpins_seen = PinKinds::NONE;
        if self.pinned.is_empty() {
            PinStep::Release
        } else {
            PinStep::Keep
        }
    }

    /// The state that keeps the server connection with this client.
    pub fn pinned(&self) -> PinKinds {
        self.pinned
    }

    /// State the server connection may hold for this client: what pins,
    /// and what statements since the last transaction end may have left.
    /// A connection with any goes back only after a reset.
    pub fn state_left(&self) -> PinKinds {
        if self.pinning == Pinning::Off {
            PinKinds::NONE
        } else {
            self.pinned | self.pins_seen
        }
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
    fn copy_started_at(&mut self) -> bool {
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
    fn syncs_ignored(&mut self, r: u64, n: u64) {
        let shift = |v: u64| match v {
            v if v < r => v,
            v if v < r + n => r,
            v => v - n,
        };
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
    fn replayable(&self, body: &[u8], client_at_boundary: bool) -> bool {
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
    fn segment_answered(&mut self, prepared: &mut PreparedSet) -> bool {
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
    fn tracked_error(&mut self, body: &[u8]) -> Option<ServerStep> {
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
    fn moved_position(edits: &[prepared::Edit], body: &[u8]) -> Option<Vec<u8>> {
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
    fn refused_answered(&mut self, body: &[u8]) -> Option<PgError> {
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

    /// Resets may have happened in the segment being answered (or one
    /// already answered) and are not settled.
    fn resets_pending(&self) -> bool {
        !self.effects.resets.is_empty() && self.ready_seen + 1 >= self.resets_from
    }

    /// The resets to settle inside a transaction block (after
    /// [`ServerStep::Settle`] with status 'T'): taken, the rest of what the
    /// statements did stays to settle once the block ends.
    pub fn take_resets(&mut self) -> Vec<super::sql_scan::Reset> {
        std::mem::take(&mut self.effects.resets)
    }

    /// Nothing is in flight: the server owes the client nothing.
    pub fn quiet(&self) -> bool {
        self.pending == 0 && !self.unsynced
    }

    /// The server waits for the client (it owes no answer, or it waits for
    /// COPY data): a held server connection is then the client's doing.
    pub fn waiting_for_client(&self) -> bool {
        self.pending == 0 || self.copy_in
    }

    /// The last ReadyForQuery said: not in a transaction block.
    pub fn idle(&self) -> bool {
        self.status == status::IDLE
    }

    /// The last ReadyForQuery's transaction status.
    #[cfg(test)]
    pub fn status(&self) -> u8 {
        self.status
    }

    /// ReadyForQuery messages the server still owes.
    pub fn pending(&self) -> u32 {
        self.pending
    }

    pub fn unsynced(&self) -> bool {
        self.unsynced
    }

    pub fn copy_in(&self) -> bool {
        self.copy_in
    }

    pub fn server_fatal(&self) -> bool {
        self.server_fatal
    }

    /// DDL completed (or the transaction that ran it ended) since last
    /// asked: shared statements prepared before must not serve new Parses
    /// (`StatementRegistry::schema_changed`).
    pub fn take_schema_changed(&mut self) -> bool {
        std::mem::take(&mut self.schema_changed)
    }

    /// A DISCARD ALL completed since last asked.
    pub fn take_discarded(&mut self) -> bool {
        std::mem::take(&mut self.discarded)
    }

    /// A DISCARD ALL completed and is not yet handled.
    pub fn discarded(&self) -> bool {
        self.discarded
    }

    /// The client's statements may have changed session settings, and the
    /// server has finished with them (nothing owed, not in a transaction
    /// block): time for the session to read its settings back.
    pub fn settings_to_settle(&self) -> bool {
        self.effects.settings && self.quiet() && self.idle()
    }

    /// The client's statements since the session last settled may have
    /// changed session settings (whatever the server still owes).
    pub fn settings_unsettled(&self) -> bool {
        self.effects.settings
    }

    /// The session reads its settings back: what the client's statements
    /// may have done since it last did (the custom settings they named,
    /// to ask for by name; the resets not yet settled).
    pub fn settled(&mut self) -> Effects {
        std::mem::take(&mut self.effects)
    }

    /// Queries seen since last asked.
    pub fn take_queries(&mut self) -> u64 {
        std::mem::take(&mut self.queries)
    }

    /// The server connection went back: what is owed for it is forgotten.
    pub fn released(&mut self) {
        self.plan = ResponsePlan::default();
        self.tracked.clear();
        self.answered = false;
        self.copy = None;
    }

    /// Nothing here differs from a new flow's state in what it decides
    /// next: an idle client may then keep no flow at all (a new one is
    /// made when it speaks again).
    pub fn at_rest(&self) -> bool {
        self.pending == 0
            && !self.unsynced
            && self.status == status::IDLE
            && !self.copy_in
            && self.plan.is_empty()
            && !self.discarded
            && !self.server_fatal
            && self.queries == 0
            && self.effects == Effects::default()
            && self.pinned.is_empty()
            && self.pins_seen.is_empty()
            && self.unpins_seen.is_empty()
            && !self.slot
            && self.pinning_statements.is_empty()
            && self.refuse_next.is_none()
            && self.refusals.is_empty()
            && !self.schema_changed
            && !self.ddl_open
            // Only their difference counts (refused segments).
            && self.syncs_sent == self.ready_seen
    }
}

/// The C string at the start of `body` (without its NUL).
fn cstr(body: &[u8]) -> &[u8] {
    body.iter()
        .position(|b| *b == 0)
        .map_or(body, |end| &body[..end])
}

/// What [`Flow::gate`] decided for a Query, Parse or Bind.
enum Gate {
    Pass,
    NeedSlot,
    Refuse(PgError),
}

/// What a client is told of a statement `pinning: error` refuses.
fn refused_for_pinning(pins: PinKinds) -> PgError {
    PgError::error(
        sqlstate::FEATURE_NOT_SUPPORTED,
        format!(
            "{} is not supported in transaction mode: it would pin the server connection",
            pins.describe()
        ),
    )
    .with_detail("pinning is set to error for this database; the statement was not run")
    .with_hint("Use pool_mode: session for this database, or pinning: auto.")
}

/// What a client is told when `max_pinned` clients of its pool already
/// hold their server connections.
fn no_pin_slot_error(pins: PinKinds, max_pinned: usize, waited: bool) -> PgError {
    PgError::error(
        sqlstate::TOO_MANY_CONNECTIONS,
        format!(
            "too many pinned server connections: {} would pin one more",
            pins.describe()
        ),
    )
    .with_detail(format!(
        "max_pinned ({max_pinned}) clients of this pool already hold their server connections{}; the statement was not run",
        if waited {
            " and none gave one back within query_wait_timeout"
        } else {
            " (inside a transaction usher does not wait)"
        }
    ))
    .with_hint("Raise max_pinned, end the state (UNLISTEN *, pg_advisory_unlock_all(), DISCARD ALL...), or use pool_mode: session.")
}

/// The message to send in place of a refused Query or Parse (whole body):
/// a statement that fails on the server with [`REFUSED_MARKER`] in its
/// error; a Parse keeps its name and parameter types.
pub fn refused_message(tag: u8, body: &[u8]) -> BytesMut {
    let text = format!("SELECT \"{REFUSED_MARKER}\"");
    let mut out = BytesMut::with_capacity(64 + body.len().min(256));
    out.put_u8(tag);
    out.put_u32(0);
    if tag == frontend::PARSE {
        let (name, rest) = match body.iter().position(|b| *b == 0) {
            Some(p) => (&body[..p], &body[p + 1..]),
            None => (&[][..], &[][..]),
        };
        let types = rest
            .iter()
            .position(|b| *b == 0)
            .map_or(&[][..], |p| &rest[p + 1..]);
        out.put_slice(name);
        out.put_u8(0);
        out.put_slice(text.as_bytes());
        out.put_u8(0);
        if types.len() >= 2 {
            out.put_slice(types);
        } else {
            out.put_u16(0);
        }
    } else {
        out.put_slice(text.as_bytes());
        out.put_u8(0);
    }
    let len = (out.len() - 1) as u32;
    out[1..5].copy_from_slice(&len.to_be_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frontend::prepared::{self, ClientStatements, Rewriter, StatementRegistry};
    use crate::protocol::frames::{FrameWalker, Visit};
    use bytes::BytesMut;

    fn msg(tag: u8, body: &[u8]) -> Vec<u8> {
        let mut m = vec![tag];
        m.extend_from_slice(&(body.len() as u32 + 4).to_be_bytes());
        m.extend_from_slice(body);
        m
    }

    fn cat(parts: &[Vec<u8>]) -> Vec<u8> {
        parts.concat()
    }

    /// A flow with a server connection's statement set, fed bytes the way
    /// the serve loop feeds it.
    struct Harness {
        flow: Flow,
        prepared: PreparedSet,
        client: FrameWalker,
        server: FrameWalker,
    }

    impl Harness {
        fn new(mode: PoolMode, rewriting: bool) -> Self {
            Harness {
                flow: Flow::new(mode, rewriting, Pinning::Auto),
                prepared: PreparedSet::unbounded(),
                client: FrameWalker::new(1 << 20),
                server: FrameWalker::new(1 << 20),
            }
        }

        /// Client bytes: the step for each message.
        fn client(&mut self, bytes: &[u8]) -> Vec<ClientStep> {
            let mut steps = vec![];
            let rewriting = self.flow.rewriting;
            let flow = &mut self.flow;
            let walked = self
                .client
                .walk_peeking(
                    bytes,
                    |tag, len, head| Flow::client_wants_body(rewriting, tag, len, head),
                    |tag, body| {
                        let step = flow.client_message(tag, body);
                        steps.push(step);
                        match step {
                            ClientStep::Forward => Visit::Forward,
                            _ => Visit::StopBefore,
                        }
                    },
                )
                .unwrap();
            assert!(walked.stopped || walked.forward == bytes.len());
            steps
        }

        /// Server bytes: the step (and note) for each message.
        fn server(&mut self, bytes: &[u8]) -> Vec<(ServerStep, Option<Note>)> {
            let mut out = vec![];
            let mut rest = bytes;
            while !rest.is_empty() {
                let flow = &mut self.flow;
                let prepared = &mut self.prepared;
                let walked = self
                    .server
                    .walk(rest, Flow::server_wants_body, |tag, body| {
                        let (step, note) = flow.server_message(tag, body, prepared, true);
                        let visit = match step {
                            ServerStep::ForwardThenRelease => Visit::StopAfter,
                            ServerStep::Forward => Visit::Forward,
                            _ => Visit::StopBefore,
                        };
                        out.push((step, note));
                        visit
                    })
                    .unwrap();
                rest = &rest[walked.forward..];
                if walked.stopped
                    && out.last().is_some_and(|(s, _)| {
                        matches!(
                            s,
                            ServerStep::Drop
                                | ServerStep::SendRefusal(_)
                                | ServerStep::Retry(_)
                                | ServerStep::Replay
                                | ServerStep::SendError(_)
                                | ServerStep::Settle { .. }
                        )
                    })
                {
                    // The answer replaced or dropped.
                    let len = u32::from_be_bytes(rest[1..5].try_into().unwrap()) as usize;
                    rest = &rest[1 + len..];
                }
            }
            out
        }
    }

    fn steps(list: &[(ServerStep, Option<Note>)]) -> Vec<ServerStep> {
        list.iter().map(|(s, _)| s.clone()).collect()
    }

    fn ready(status: u8) -> Vec<u8> {
        msg(backend::READY_FOR_QUERY, &[status])
    }

    fn complete(tag: &str) -> Vec<u8> {
        msg(backend::COMMAND_COMPLETE, format!("{tag}\0").as_bytes())
    }

    use ServerStep::{Forward, ForwardThenRelease};

    #[test]
    fn a_simple_query_releases_at_its_ready_for_query_in_transaction_mode_only() {
        for (mode, last) in [
            (PoolMode::Transaction, ForwardThenRelease),
            (PoolMode::Session, Forward),
        ] {
            let mut h = Harness::new(mode, false);
            assert_eq!(
                h.client(&msg(frontend::QUERY, b"select 1\0")),
                [ClientStep::Forward]
            );
            assert_eq!(h.flow.pending(), 1);
            assert!(!h.flow.waiting_for_client());
            let answer = cat(&[
                msg(backend::ROW_DESCRIPTION, b"..."),
                msg(backend::DATA_ROW, b"..."),
                complete("SELECT 1"),
                ready(status::IDLE),
            ]);
            let got = h.server(&answer);
            assert_eq!(steps(&got), [Forward, Forward, Forward, last]);
            assert_eq!(got[3].1, Some(Note::TransactionDone));
            assert!(h.flow.quiet() && h.flow.idle());
            assert_eq!(h.flow.take_queries(), 1);
        }
    }

    #[test]
    fn a_flow_is_at_rest_between_transactions_unless_it_remembers_something() {
        let mut h = Harness::new(PoolMode::Transaction, false);
        assert!(h.flow.at_rest());
        h.client(&msg(frontend::QUERY, b"select 1\0"));
        assert!(!h.flow.at_rest(), "an answer is owed");
        h.server(&cat(&[complete("SELECT 1"), ready(status::IDLE)]));
        assert_eq!(h.flow.take_queries(), 1);
        // As the serve loop does when the connection goes back.
        assert!(h.flow.transaction_end() == PinStep::Release);
        h.flow.released();
        assert!(h.flow.at_rest());
        h.client(&msg(frontend::QUERY, b"begin\0"));
        h.server(&cat(&[complete("BEGIN"), ready(status::IN_TRANSACTION)]));
        h.flow.take_queries();
        assert!(!h.flow.at_rest(), "inside a transaction block");
        h.client(&msg(frontend::QUERY, b"set work_mem = '8MB'; commit\0"));
        h.server(&cat(&[
            complete("SET"),
            complete("COMMIT"),
            ready(status::IDLE),
        ]));
        h.flow.take_queries();
        assert!(!h.flow.at_rest(), "settings to settle");
        h.flow.settled();
        assert!(h.flow.transaction_end() == PinStep::Release);
        h.flow.released();
        assert!(h.flow.at_rest());
    }

    #[test]
    fn the_extended_protocol_waits_for_sync_and_a_pipeline_for_its_last_ready() {
        let mut h = Harness::new(PoolMode::Transaction, false);
        let one = cat(&[
            msg(frontend::PARSE, b"\0select 1\0\0\0"),
            msg(frontend::BIND, b"\0\0\0\0\0\0\0\0"),
            msg(frontend::EXECUTE, b"\0\0\0\0\0"),
        ]);
        h.client(&one);
        assert!(h.flow.unsynced() && !h.flow.quiet());
        assert!(h.flow.waiting_for_client(), "no Sync yet: the server waits");
        h.client(&msg(frontend::SYNC, b""));
        h.client(&cat(&[one, msg(frontend::SYNC, b"")]));
        assert_eq!(h.flow.pending(), 2);
        assert_eq!(h.flow.take_queries(), 2);
        let answer = cat(&[
            msg(backend::PARSE_COMPLETE, b""),
            msg(backend::BIND_COMPLETE, b""),
            complete("SELECT 1"),
        ]);
        let got = h.server(&cat(&[answer.clone(), ready(status::IDLE)]));
        assert_eq!(steps(&got).last(), Some(&Forward), "one Sync is still owed");
        let got = h.server(&cat(&[answer, ready(status::IDLE)]));
        assert_eq!(steps(&got).last(), Some(&ForwardThenRelease));
    }

    #[test]
    fn an_error_inside_a_pipeline_skips_to_the_next_sync() {
        let mut h = Harness::new(PoolMode::Transaction, false);
        let request = cat(&[
            msg(frontend::PARSE, b"\0bad\0\0\0"),
            msg(frontend::BIND, b"\0\0\0\0\0\0\0\0"),
            msg(frontend::EXECUTE, b"\0\0\0\0\0"),
            msg(frontend::SYNC, b""),
        ]);
        h.client(&cat(&[request.clone(), request]));
        let error = msg(backend::ERROR_RESPONSE, b"SERROR\0C42601\0Msyntax\0\0");
        let got = h.server(&cat(&[error.clone(), ready(status::IDLE)]));
        assert_eq!(
            got[0].1,
            Some(Note::Error {
                code: b"42601".to_vec(),
                stale: vec![]
            })
        );
        assert_eq!(steps(&got), [Forward, Forward]);
        assert!(!h.flow.server_fatal());
        let got = h.server(&cat(&[error, ready(status::IDLE)]));
        assert_eq!(steps(&got), [Forward, ForwardThenRelease]);
    }

    #[test]
    fn transaction_status_t_and_e_keep_the_server() {
        let mut h = Harness::new(PoolMode::Transaction, false);
        h.client(&msg(frontend::QUERY, b"begin\0"));
        let got = h.server(&cat(&[complete("BEGIN"), ready(status::IN_TRANSACTION)]));
        assert_eq!(steps(&got), [Forward, Forward]);
        assert!(h.flow.waiting_for_client() && !h.flow.idle());
        h.client(&msg(frontend::QUERY, b"oops\0"));
        let got = h.server(&cat(&[
            msg(backend::ERROR_RESPONSE, b"SERROR\0C42601\0\0"),
            ready(status::FAILED),
        ]));
        assert_eq!(steps(&got), [Forward, Forward]);
        assert_eq!(h.flow.status(), status::FAILED);
        h.client(&msg(frontend::QUERY, b"rollback\0"));
        let got = h.server(&cat(&[complete("ROLLBACK"), ready(status::IDLE)]));
        assert_eq!(steps(&got), [Forward, ForwardThenRelease]);
    }

    #[test]
    fn copy_in_waits_for_the_client_and_copy_out_and_both_stream() {
        let mut h = Harness::new(PoolMode::Transaction, false);
        h.client(&msg(frontend::QUERY, b"copy t from stdin\0"));
        h.server(&msg(backend::COPY_IN_RESPONSE, b"\0\0\0"));
        assert!(h.flow.copy_in() && h.flow.waiting_for_client());
        h.client(&cat(&[
            msg(frontend::COPY_DATA, b"1\n"),
            msg(frontend::COPY_DONE, b""),
        ]));
        assert!(!h.flow.copy_in() && !h.flow.waiting_for_client());
        let got = h.server(&cat(&[complete("COPY 1"), ready(status::IDLE)]));
        assert_eq!(steps(&got), [Forward, ForwardThenRelease]);

        for response in [backend::COPY_OUT_RESPONSE, backend::COPY_BOTH_RESPONSE] {
            h.client(&msg(frontend::QUERY, b"copy t to stdout\0"));
            let got = h.server(&cat(&[
                msg(response, b"\0\0\0"),
                msg(frontend::COPY_DATA, &[7u8; 100]),
                msg(frontend::COPY_DONE, b""),
                complete("COPY 1"),
                ready(status::IDLE),
            ]));
            assert_eq!(
                steps(&got),
                [Forward, Forward, Forward, Forward, ForwardThenRelease]
            );
            assert!(!h.flow.copy_in());
        }
    }

    /// tokio-postgres and libpq send Bind, Execute, Sync for a COPY FROM
    /// STDIN, then the data, CopyDone and Sync: PostgreSQL ignores the
    /// first Sync (it arrives in COPY IN mode), so only one ReadyForQuery
    /// comes, whether the client's CopyDone went before usher saw the COPY
    /// start or after.
    #[test]
    fn a_sync_the_server_ignores_in_copy_in_owes_nothing() {
        let copy = cat(&[
            msg(frontend::BIND, b"\0\0\0\0\0\0\0\0"),
            msg(frontend::EXECUTE, b"\0\0\0\0\0"),
            msg(frontend::SYNC, b""),
        ]);
        let end = cat(&[
            msg(frontend::COPY_DATA, b"1\n"),
            msg(frontend::COPY_DONE, b""),
            msg(frontend::SYNC, b""),
        ]);
        let answers = |h: &mut Harness| {
            h.server(&cat(&[
                msg(backend::BIND_COMPLETE, b""),
                msg(backend::COPY_IN_RESPONSE, b"\0\0\0"),
            ]))
        };
        // The data after the COPY started.
        let mut h = Harness::new(PoolMode::Transaction, false);
        h.client(&copy);
        answers(&mut h);
        assert!(h.flow.copy_in() && h.flow.pending() == 0 && h.flow.unsynced());
        h.client(&end);
        assert_eq!(h.flow.pending(), 1);
        let got = h.server(&cat(&[complete("COPY 1"), ready(status::IDLE)]));
        assert_eq!(steps(&got), [Forward, ForwardThenRelease]);
        assert!(h.flow.quiet());
        // All of it before.
        let mut h = Harness::new(PoolMode::Transaction, false);
        h.client(&cat(&[copy.clone(), end.clone()]));
        assert_eq!(h.flow.pending(), 2);
        answers(&mut h);
        assert!(!h.flow.copy_in() && h.flow.pending() == 1);
        let got = h.server(&cat(&[complete("COPY 1"), ready(status::IDLE)]));
        assert_eq!(steps(&got), [Forward, ForwardThenRelease]);
        assert!(h.flow.quiet());
        // A Query's COPY: the Query is its own end.
        let mut h = Harness::new(PoolMode::Transaction, false);
        h.client(&msg(frontend::QUERY, b"copy t from stdin\0"));
        h.server(&msg(backend::COPY_IN_RESPONSE, b"\0\0\0"));
        assert_eq!(h.flow.pending(), 1);
    }

    /// DDL tells the session at once, and again when its transaction
    /// ends (others see it only then).
    #[test]
    fn ddl_changes_the_schema_when_it_completes_and_when_its_block_ends() {
        let mut h = Harness::new(PoolMode::Transaction, true);
        h.client(&query("BEGIN; ALTER TABLE t ADD COLUMN c int"));
        h.server(&cat(&[complete("BEGIN"), complete("ALTER TABLE")]));
        assert!(h.flow.take_schema_changed());
        h.server(&ready(status::IN_TRANSACTION));
        assert!(!h.flow.take_schema_changed());
        h.client(&query("COMMIT"));
        h.server(&cat(&[complete("COMMIT"), ready(status::IDLE)]));
        assert!(h.flow.take_schema_changed(), "committed");
        h.client(&query("SELECT 1"));
        h.server(&cat(&[complete("SELECT 1"), ready(status::IDLE)]));
        assert!(!h.flow.take_schema_changed());
        h.flow.take_queries();
        ClientStatements::default().sync_unnamed(h.flow.plan_mut());
        assert!(h.flow.at_rest());
    }

    #[test]
    fn discard_all_drops_the_servers_statements_and_restarts_the_session() {
        let mut h = Harness::new(PoolMode::Session, false);
        h.prepared.put(7, ());
        h.client(&msg(frontend::QUERY, b"discard all\0"));
        let got = h.server(&cat(&[complete("DISCARD ALL"), ready(status::IDLE)]));
        assert_eq!(
            got[0].1,
            Some(Note::StatementsDropped { discard_all: true })
        );
        assert!(h.prepared.is_empty());
        assert!(h.flow.take_discarded());
        assert!(!h.flow.take_discarded());
        h.prepared.put(8, ());
        h.client(&msg(frontend::QUERY, b"deallocate all\0"));
        let got = h.server(&cat(&[complete("DEALLOCATE ALL"), ready(status::IDLE)]));
        assert_eq!(
            got[0].1,
            Some(Note::StatementsDropped { discard_all: false })
        );
        assert!(h.prepared.is_empty() && !h.flow.discarded());
    }

    #[test]
    fn a_reset_holds_its_parameters_and_settles_before_its_ready_for_query() {
        let status_of = |p: &[u8]| msg(backend::PARAMETER_STATUS, p);
        for mode in [PoolMode::Transaction, PoolMode::Session] {
            let mut h = Harness::new(mode, false);
            // A SET is forwarded as it comes.
            h.client(&msg(frontend::QUERY, b"SET DateStyle = SQL\0"));
            let got = h.server(&cat(&[
                status_of(b"DateStyle\0SQL, MDY\0"),
                complete("SET"),
                ready(status::IDLE),
            ]));
            assert_eq!(steps(&got)[0], Forward, "{mode:?}");
            h.flow.settled();
            // A RESET in a block: its parameters are held, and the
            // ReadyForQuery 'T' stops for the session to settle.
            h.client(&msg(frontend::QUERY, b"BEGIN; RESET DateStyle\0"));
            let got = h.server(&cat(&[
                complete("BEGIN"),
                complete("RESET"),
                status_of(b"DateStyle\0ISO, MDY\0"),
                ready(status::IN_TRANSACTION),
            ]));
            assert_eq!(
                steps(&got),
                [
                    Forward,
                    Forward,
                    ServerStep::Drop,
                    ServerStep::Settle { release: false }
                ],
                "{mode:?}"
            );
            assert_eq!(
                got[2].1,
                Some(Note::Parameter {
                    name: "DateStyle".into(),
                    value: "ISO, MDY".into(),
                    held: true,
                })
            );
            assert_eq!(
                h.flow.take_resets(),
                [sql_scan::Reset::One {
                    name: "datestyle".into(),
                    local: false
                }]
            );
            // Settled: the next answers flow; the SET of the block is
            // settled when it ends.
            h.client(&msg(frontend::QUERY, b"SHOW DateStyle\0"));
            assert_eq!(steps(&h.server(&ready(status::IN_TRANSACTION))), [Forward]);
            // RESET ALL that fails in the block: its abort undid it, the
            // session tells what the server has.
            h.client(&msg(frontend::QUERY, b"RESET ALL; SELECT 1/0\0"));
            let got = h.server(&cat(&[
                complete("RESET"),
                status_of(b"DateStyle\0German, DMY\0"),
                ready(status::FAILED),
            ]));
            assert_eq!(
                steps(&got),
                [
                    Forward,
                    ServerStep::Drop,
                    ServerStep::Settle { release: false }
                ]
            );
            assert_eq!(h.flow.take_resets(), [sql_scan::Reset::All]);
            h.client(&msg(frontend::QUERY, b"ROLLBACK\0"));
            let got = h.server(&cat(&[complete("ROLLBACK"), ready(status::IDLE)]));
            let end = if mode == PoolMode::Transaction {
                ForwardThenRelease
            } else {
                Forward
            };
            assert_eq!(steps(&got), [Forward, end.clone()]);
            // A DISCARD ALL settles before its ReadyForQuery 'I'.
            h.client(&msg(frontend::QUERY, b"DISCARD ALL\0"));
            let got = h.server(&cat(&[
                complete("DISCARD ALL"),
                status_of(b"TimeZone\0Etc/UTC\0"),
                ready(status::IDLE),
            ]));
            let release = mode == PoolMode::Transaction;
            assert_eq!(
                steps(&got),
                [Forward, ServerStep::Drop, ServerStep::Settle { release }]
            );
            assert!(h.flow.settings_to_settle());
            h.flow.settled();
            h.client(&msg(frontend::QUERY, b"SHOW TimeZone\0"));
            assert_eq!(steps(&h.server(&ready(status::IDLE))), [end]);
        }
    }

    #[test]
    fn a_reset_settles_only_when_nothing_else_is_in_flight() {
        let mut h = Harness::new(PoolMode::Transaction, false);
        h.client(&cat(&[
            msg(frontend::QUERY, b"RESET TimeZone\0"),
            msg(frontend::QUERY, b"SELECT 1\0"),
        ]));
        let got = h.server(&cat(&[complete("RESET"), ready(status::IDLE)]));
        assert_eq!(steps(&got), [Forward, Forward], "the SELECT is in flight");
        let got = h.server(&cat(&[complete("SELECT 1"), ready(status::IDLE)]));
        assert_eq!(steps(&got), [Forward, ServerStep::Settle { release: true }]);
    }

    #[test]
    fn a_server_fatal_is_remembered_and_parameters_are_noted() {
        let mut h = Harness::new(PoolMode::Session, false);
        h.client(&msg(frontend::QUERY, b"set application_name = 'x'\0"));
        let got = h.server(&cat(&[
            msg(backend::PARAMETER_STATUS, b"application_name\0x\0"),
            complete("SET"),
            ready(status::IDLE),
        ]));
        assert_eq!(
            got[0].1,
            Some(Note::Parameter {
                name: "application_name".into(),
                value: "x".into(),
                held: false,
            })
        );
        h.server(&msg(
            backend::ERROR_RESPONSE,
            b"SFATAL\0VFATAL\0C57P01\0Mbye\0\0",
        ));
        assert!(h.flow.server_fatal());
    }

    #[test]
    fn a_terminate_mid_transaction_ends_the_client() {
        let mut h = Harness::new(PoolMode::Transaction, false);
        h.client(&msg(frontend::QUERY, b"begin\0"));
        h.server(&cat(&[complete("BEGIN"), ready(status::IN_TRANSACTION)]));
        let got = h.client(&cat(&[
            msg(frontend::TERMINATE, b""),
            msg(frontend::QUERY, b"x\0"),
        ]));
        assert_eq!(got, [ClientStep::Terminate]);
        assert_eq!(h.flow.status(), status::IN_TRANSACTION);
    }

    /// The prepared-statement plan: a client's named Parse is rewritten to
    /// usher's shared name; on a server that already has the statement the
    /// Parse becomes a harmless Close whose CloseComplete is turned into
    /// ParseComplete; a Bind on a server that lacks it gets a Parse first,
    /// whose ParseComplete the client never asked for and never sees.
    #[test]
    fn the_prepared_statement_plan() {
        let registry = StatementRegistry::default();
        let mut statements = ClientStatements::default();
        let mut h = Harness::new(PoolMode::Transaction, true);
        let parse = msg(frontend::PARSE, b"s1\0select 1\0\0\0");
        let bind = msg(frontend::BIND, b"\0s1\0\0\0\0\0\0\0");
        let rewrite = |h: &mut Harness, statements: &mut ClientStatements, m: &[u8]| {
            let mut out = BytesMut::new();
            Rewriter {
                registry: &registry,
                statements,
                prepared: &mut h.prepared,
                plan: h.flow.plan_mut(),
            }
            .rewrite(m[0], &m[5..], &mut out)
            .unwrap();
            h.flow.rewritten();
            out
        };
        // First server connection: Parse goes out under usher's name.
        assert_eq!(h.client(&parse), [ClientStep::Rewrite]);
        let out = rewrite(&mut h, &mut statements, &parse);
        assert_eq!(out[0], frontend::PARSE);
        assert!(out.windows(6).any(|w| w == b"usher_"));
        h.client(&msg(frontend::SYNC, b""));
        let got = h.server(&cat(&[
            msg(backend::PARSE_COMPLETE, b""),
            ready(status::IDLE),
        ]));
        assert_eq!(steps(&got), [Forward, ForwardThenRelease]);
        h.flow.released();
        // The same Parse again on a server that has it: the text is
        // checked under a name of usher's, closed at once.
        assert_eq!(h.client(&parse), [ClientStep::Rewrite]);
        let out = rewrite(&mut h, &mut statements, &parse);
        assert_eq!(out[0], frontend::PARSE);
        assert!(out.windows(11).any(|w| w == b"usher_check"));
        h.client(&msg(frontend::SYNC, b""));
        let got = h.server(&cat(&[
            msg(backend::PARSE_COMPLETE, b""),
            msg(backend::CLOSE_COMPLETE, b""),
            ready(status::IDLE),
        ]));
        assert_eq!(steps(&got), [Forward, ServerStep::Drop, ForwardThenRelease]);
        h.flow.released();
        // Another server connection without it: a Bind brings a Parse.
        h.prepared.clear();
        assert_eq!(h.client(&bind), [ClientStep::Rewrite]);
        let out = rewrite(&mut h, &mut statements, &bind);
        assert_eq!(
            (
                out[0],
                out.iter().filter(|b| **b == frontend::BIND).count() > 0
            ),
            (frontend::PARSE, true)
        );
        h.client(&msg(frontend::SYNC, b""));
        let got = h.server(&cat(&[
            msg(backend::PARSE_COMPLETE, b""),
            msg(backend::BIND_COMPLETE, b""),
            ready(status::IDLE),
        ]));
        assert_eq!(steps(&got), [ServerStep::Drop, Forward, ForwardThenRelease]);
        // An error before the Parse: the server never got it, nor keeps it.
        h.flow.released();
        h.prepared.clear();
        h.client(&bind);
        rewrite(&mut h, &mut statements, &bind);
        h.client(&msg(frontend::SYNC, b""));
        assert_eq!(h.prepared.len(), 1);
        h.server(&cat(&[
            msg(backend::ERROR_RESPONSE, b"SERROR\0C42P01\0\0"),
            ready(status::IDLE),
        ]));
        assert!(
            h.prepared.is_empty(),
            "a skipped Parse is not on the server"
        );
    }

    #[test]
    fn settings_settle_once_the_transaction_is_over() {
        let mut h = Harness::new(PoolMode::Transaction, false);
        let done = |tag: &[u8]| cat(&[msg(backend::COMMAND_COMPLETE, tag), ready(status::IDLE)]);
        h.client(&msg(frontend::QUERY, b"SELECT 1\0"));
        h.server(&done(b"SELECT 1\0"));
        assert!(!h.flow.settings_to_settle(), "a SELECT changes nothing");
        // In a block: only once it ends (a rollback is read back too).
        h.client(&msg(frontend::QUERY, b"BEGIN; SET search_path = a\0"));
        h.server(&cat(&[
            msg(backend::COMMAND_COMPLETE, b"BEGIN\0"),
            msg(backend::COMMAND_COMPLETE, b"SET\0"),
            ready(status::IN_TRANSACTION),
        ]));
        assert!(!h.flow.settings_to_settle(), "not while the block is open");
        h.client(&msg(frontend::QUERY, b"ROLLBACK\0"));
        h.server(&done(b"ROLLBACK\0"));
        assert!(h.flow.settings_to_settle());
        assert!(h.flow.settled().custom.is_empty());
        assert!(!h.flow.settings_to_settle(), "settled");
        // The extended protocol: the Parse's text; custom names are kept.
        h.client(&cat(&[
            msg(frontend::PARSE, b"\0SET myapp.tenant = 'a'\0\0\0"),
            msg(frontend::BIND, b"\0\0\0\0\0\0\0\0"),
            msg(frontend::EXECUTE, b"\0\0\0\0\0"),
        ]));
        assert!(!h.flow.settings_to_settle(), "not before its Sync");
        h.client(&msg(frontend::SYNC, b""));
        h.server(&cat(&[
            msg(backend::PARSE_COMPLETE, b""),
            msg(backend::BIND_COMPLETE, b""),
            done(b"SET\0"),
        ]));
        assert!(h.flow.settings_to_settle());
        assert_eq!(h.flow.settled().custom, ["myapp.tenant"]);
    }

    fn query(sql: &str) -> Vec<u8> {
        msg(frontend::QUERY, format!("{sql}\0").as_bytes())
    }

    /// A client's transaction on a pinning-aware flow: the query, its
    /// answer, and what the session does at the end.
    fn transaction(h: &mut Harness, sql: &str) -> PinStep {
        let mut steps = h.client(&query(sql));
        if steps == [ClientStep::Pin] {
            h.flow.slot_taken();
            steps = h.client(&query(sql));
        }
        assert_eq!(steps, [ClientStep::Forward], "{sql}");
        let got = h.server(&cat(&[complete("OK"), ready(status::IDLE)]));
        match steps_of(&got).last() {
            // A text that may reset settings (DO) settles first, as the
            // session does, then releases.
            Some(ServerStep::Settle { release: true }) => drop(h.flow.settled()),
            last => assert_eq!(last, Some(&ForwardThenRelease), "{sql}"),
        }
        h.flow.transaction_end()
    }

    fn steps_of(list: &[(ServerStep, Option<Note>)]) -> Vec<ServerStep> {
        steps(list)
    }

    #[test]
    fn a_listen_pins_the_connection_until_the_server_says_it_is_gone() {
        let mut h = Harness::new(PoolMode::Transaction, false);
        assert_eq!(transaction(&mut h, "select 1"), PinStep::Release);
        // The first pinning statement stops for a pin slot.
        assert_eq!(h.client(&query("LISTEN jobs")), [ClientStep::Pin]);
        assert_eq!(h.flow.pending(), 0, "not counted before it goes out");
        h.flow.slot_taken();
        assert_eq!(h.client(&query("LISTEN jobs")), [ClientStep::Forward]);
        h.server(&cat(&[complete("LISTEN"), ready(status::IDLE)]));
        assert_eq!(h.flow.transaction_end(), PinStep::Keep);
        assert_eq!(h.flow.pinned(), PinKinds::LISTEN);
        // Other transactions keep it; a second pin needs no new slot.
        assert_eq!(transaction(&mut h, "select 1"), PinStep::Keep);
        assert_eq!(
            transaction(&mut h, "select pg_advisory_lock(1)"),
            PinStep::Keep
        );
        assert_eq!(h.flow.pinned(), PinKinds::LISTEN | PinKinds::ADVISORY_LOCK);
        // UNLISTEN may end it: the server is asked, and the lock remains.
        assert_eq!(transaction(&mut h, "UNLISTEN *"), PinStep::Check);
        assert_eq!(h.flow.checked(PinKinds::ADVISORY_LOCK), PinStep::Keep);
        assert_eq!(h.flow.pinned(), PinKinds::ADVISORY_LOCK);
        assert_eq!(
            transaction(&mut h, "select pg_advisory_unlock_all()"),
            PinStep::Check
        );
        assert_eq!(h.flow.checked(PinKinds::NONE), PinStep::Release);
        assert!(h.flow.pinned().is_empty() && h.flow.state_left().is_empty());
    }

    #[test]
    fn a_pin_and_its_end_in_one_transaction_ask_the_server() {
        let mut h = Harness::new(PoolMode::Transaction, false);
        h.flow.slot_taken();
        assert_eq!(
            transaction(&mut h, "CREATE TEMP TABLE t () ON COMMIT DROP"),
            PinStep::Check
        );
        assert_eq!(h.flow.checked(PinKinds::NONE), PinStep::Release);
        assert_eq!(
            transaction(&mut h, "LISTEN a; UNLISTEN *"),
            PinStep::Check,
            "pins and unpins: the server decides"
        );
        assert_eq!(h.flow.checked(PinKinds::NONE), PinStep::Release);
    }

    #[test]
    fn a_statement_usher_cannot_read_is_checked_and_load_stays() {
        let mut h = Harness::new(PoolMode::Transaction, false);
        // A DO body is not read: the server is asked, even when unpinned.
        assert_eq!(
            transaction(&mut h, "DO $$ BEGIN CREATE TEMP TABLE t (); END $$"),
            PinStep::Check
        );
        assert_eq!(h.flow.checked(PinKinds::TEMP), PinStep::Keep);
        assert_eq!(h.flow.pinned(), PinKinds::TEMP);
        // LOAD cannot be undone or asked about: it pins for good.
        assert_eq!(transaction(&mut h, "LOAD 'plpgsql'"), PinStep::Keep);
        assert_eq!(transaction(&mut h, "DISCARD ALL"), PinStep::Check);
        assert_eq!(h.flow.checked(PinKinds::NONE), PinStep::Keep);
        assert_eq!(h.flow.pinned(), PinKinds::LOAD);
        assert!(h.flow.state_left().contains(PinKinds::LOAD));
    }

    #[test]
    fn state_not_yet_judged_is_left_state() {
        let mut h = Harness::new(PoolMode::Transaction, false);
        h.flow.slot_taken();
        h.client(&query("BEGIN; CREATE TEMP TABLE t ()"));
        h.server(&cat(&[complete("BEGIN"), ready(status::IN_TRANSACTION)]));
        assert_eq!(
            h.flow.state_left(),
            PinKinds::TEMP,
            "the client may leave now"
        );
    }

    #[test]
    fn pinning_off_and_session_mode_never_pin() {
        let mut off = Harness::new(PoolMode::Transaction, false);
        off.flow = Flow::new(PoolMode::Transaction, false, Pinning::Off);
        assert_eq!(transaction(&mut off, "LISTEN a"), PinStep::Release);
        assert!(off.flow.state_left().is_empty());
        let mut session = Harness::new(PoolMode::Session, false);
        assert_eq!(
            session.client(&query("LISTEN a")),
            [ClientStep::Forward],
            "session mode keeps its connection anyway"
        );
        assert!(session.flow.state_left().is_empty());
    }

    #[test]
    fn pinning_error_refuses_the_statement_in_order() {
        let mut h = Harness::new(PoolMode::Transaction, false);
        h.flow = Flow::new(PoolMode::Transaction, false, Pinning::Error);
        h.client(&query("BEGIN"));
        assert_eq!(h.client(&query("LISTEN a")), [ClientStep::Refuse]);
        assert_eq!(h.flow.pending(), 2, "counted: its stand-in goes out");
        // The stand-in fails on the server, after the BEGIN's answer.
        let stand_in = refused_message(frontend::QUERY, b"LISTEN a\0");
        assert_eq!(stand_in[0], frontend::QUERY);
        assert!(String::from_utf8_lossy(&stand_in).contains(REFUSED_MARKER));
        let error = msg(
            backend::ERROR_RESPONSE,
            format!("SERROR\0C42703\0Mcolumn \"{REFUSED_MARKER}\" does not exist\0\0").as_bytes(),
        );
        let got = h.server(&cat(&[
            complete("BEGIN"),
            ready(status::IN_TRANSACTION),
            error.clone(),
            ready(status::FAILED),
        ]));
        let refusal = match &steps(&got)[..] {
            [Forward, Forward, ServerStep::SendRefusal(e), Forward] => e.clone(),
            other => panic!("{other:?}"),
        };
        assert_eq!(refusal.code, "0A000");
        assert!(refusal.message.contains("LISTEN"), "{}", refusal.message);
        assert!(refusal.hint.as_deref().unwrap().contains("session"));
        assert!(h.flow.state_left().is_empty(), "nothing ran");
        // The same error text from another statement is the server's.
        h.client(&query("select \"usher refused this statement\""));
        let got = h.server(&cat(&[error, ready(status::FAILED)]));
        assert_eq!(steps(&got), [Forward, Forward]);
    }

    #[test]
    fn a_refused_parse_keeps_its_name_and_types_and_a_skipped_one_owes_nothing() {
        let mut h = Harness::new(PoolMode::Transaction, false);
        h.flow = Flow::new(PoolMode::Transaction, false, Pinning::Error);
        let parse = msg(
            frontend::PARSE,
            b"s1\0SELECT pg_advisory_lock($1)\0\0\x01\0\0\0\x14",
        );
        let pipeline = cat(&[
            msg(frontend::PARSE, b"\0bad\0\0\0"),
            parse.clone(),
            msg(frontend::SYNC, b""),
        ]);
        assert_eq!(
            h.client(&pipeline),
            [ClientStep::Forward, ClientStep::Refuse]
        );
        let stand_in = refused_message(frontend::PARSE, &parse[5..]);
        assert!(stand_in.starts_with(b"P"));
        assert!(stand_in[5..].starts_with(b"s1\0SELECT \""));
        assert!(stand_in.ends_with(b"\0\0\x01\0\0\0\x14"));
        assert_eq!(
            u32::from_be_bytes(stand_in[1..5].try_into().unwrap()) as usize,
            stand_in.len() - 1
        );
        // The rest of the pipeline (after the stand-in went out).
        h.client(&msg(frontend::SYNC, b""));
        // The first Parse fails: the server skips the stand-in.
        let got = h.server(&cat(&[
            msg(backend::ERROR_RESPONSE, b"SERROR\0C42601\0Msyntax\0\0"),
            ready(status::IDLE),
        ]));
        assert_eq!(steps(&got), [Forward, ForwardThenRelease], "as it is");
        assert!(h.flow.refusals.is_empty(), "its error will not come");
    }

    #[test]
    fn without_a_pin_slot_the_statement_is_refused_with_53300() {
        let mut h = Harness::new(PoolMode::Transaction, false);
        assert_eq!(h.client(&query("LISTEN a")), [ClientStep::Pin]);
        h.flow.no_pin_slot(3, true);
        assert_eq!(h.client(&query("LISTEN a")), [ClientStep::Refuse]);
        let got = h.server(&cat(&[
            msg(
                backend::ERROR_RESPONSE,
                format!("SERROR\0C42703\0Mcolumn \"{REFUSED_MARKER}\" does not exist\0\0")
                    .as_bytes(),
            ),
            ready(status::IDLE),
        ]));
        let e = match &steps(&got)[..] {
            [ServerStep::SendRefusal(e), ForwardThenRelease] => e.clone(),
            other => panic!("{other:?}"),
        };
        assert_eq!(e.code, "53300");
        assert!(e.detail.unwrap().contains("max_pinned (3)"));
        assert_eq!(h.flow.transaction_end(), PinStep::Release);
        // Next time it asks again.
        assert_eq!(h.client(&query("LISTEN a")), [ClientStep::Pin]);
    }
    #[test]
    fn each_execution_of_a_prepared_statement_that_pins_pins_again() {
        let mut h = Harness::new(PoolMode::Transaction, false);
        let parse = msg(frontend::PARSE, b"s1\0SELECT pg_advisory_lock($1)\0\0\0");
        let bind = msg(frontend::BIND, b"\0s1\0\0\0\0\0\0\0");
        let execute = cat(&[
            bind.clone(),
            msg(frontend::EXECUTE, b"\0\0\0\0\0"),
            msg(frontend::SYNC, b""),
        ]);
        let answer = cat(&[complete("SELECT 1"), ready(status::IDLE)]);
        assert_eq!(h.client(&parse), [ClientStep::Pin]);
        h.flow.slot_taken();
        h.client(&cat(&[parse.clone(), execute.clone()]));
        h.server(&answer);
        assert_eq!(h.flow.transaction_end(), PinStep::Keep);
        assert_eq!(
            transaction(&mut h, "SELECT pg_advisory_unlock_all()"),
            PinStep::Check
        );
        assert_eq!(h.flow.checked(PinKinds::NONE), PinStep::Release);
        h.flow.slot_given_back();
        // The statement runs again: it takes the lock again.
        assert_eq!(h.client(&execute), [ClientStep::Pin]);
        h.flow.slot_taken();
        h.client(&execute);
        h.server(&answer);
        assert_eq!(h.flow.transaction_end(), PinStep::Keep);
        // Without a slot to be had a Bind still goes (it cannot be
        // refused); the state found pins past the cap.
        assert_eq!(
            transaction(&mut h, "SELECT pg_advisory_unlock_all()"),
            PinStep::Check
        );
        h.flow.checked(PinKinds::NONE);
        h.flow.slot_given_back();
        assert_eq!(h.client(&execute), [ClientStep::Pin]);
        h.flow.no_pin_slot(1, false);
        assert_eq!(
            h.client(&execute),
            [
                ClientStep::Forward,
                ClientStep::Forward,
                ClientStep::Forward
            ]
        );
        h.server(&answer);
        assert_eq!(h.flow.transaction_end(), PinStep::Keep);
        // Once closed, a Bind of that name pins nothing.
        h.client(&cat(&[
            msg(frontend::CLOSE, b"Ss1\0"),
            msg(frontend::SYNC, b""),
        ]));
        h.server(&cat(&[
            msg(backend::CLOSE_COMPLETE, b""),
            ready(status::IDLE),
        ]));
        assert!(h.flow.pinning_statements.is_empty());
    }

    /// A client's carried Query through the flow and the rewriter, as the
    /// serve loop does it: the bytes that go to the server.
    fn carried(
        h: &mut Harness,
        registry: &StatementRegistry,
        statements: &mut ClientStatements,
        sql: &str,
    ) -> Vec<u8> {
        let message = query(sql);
        assert_eq!(h.client(&message), [ClientStep::Rewrite], "{sql}");
        let failed_block = h.flow.known_failed_block();
        let mut out = BytesMut::new();
        let rewrite = Rewriter {
            registry,
            statements,
            prepared: &mut h.prepared,
            plan: h.flow.plan_mut(),
        }
        .rewrite_query(&message[5..], failed_block, true, &mut out);
        if rewrite.refused.is_some() {
            out = refused_message(frontend::QUERY, &message[5..]);
        }
        h.flow.query_rewritten(rewrite);
        out.to_vec()
    }

    /// The Query texts in bytes sent to the server (and 'P'/'S' for a Parse
    /// or a Sync).
    fn texts(bytes: &[u8]) -> Vec<String> {
        let mut out = vec![];
        let mut at = 0;
        while at < bytes.len() {
            let len = u32::from_be_bytes(bytes[at + 1..at + 5].try_into().unwrap()) as usize;
            let body = &bytes[at + 5..at + 1 + len];
            out.push(match bytes[at] {
                frontend::QUERY => String::from_utf8_lossy(&body[..body.len() - 1]).into_owned(),
                other => (other as char).to_string(),
            });
            at += 1 + len;
        }
        out
    }

    fn error(code: &str) -> Vec<u8> {
        msg(
            backend::ERROR_RESPONSE,
            format!("SERROR\0C{code}\0Mit failed\0\0").as_bytes(),
        )
    }

    /// SQL PREPARE / EXECUTE / DEALLOCATE in one Query: carried under
    /// usher's name, nothing pins; an EXECUTE on a connection without the
    /// statement prepares it first in a segment of usher's own whose
    /// answers the client never sees.
    #[test]
    fn sql_prepared_statements_are_carried_without_pinning() {
        let registry = StatementRegistry::default();
        let mut statements = ClientStatements::default();
        let mut h = Harness::new(PoolMode::Transaction, true);
        let out = carried(
            &mut h,
            &registry,
            &mut statements,
            "PREPARE q (int) AS SELECT $1",
        );
        assert_eq!(texts(&out), ["PREPARE usher_1 (int) AS SELECT $1"]);
        let got = h.server(&cat(&[complete("PREPARE"), ready(status::IDLE)]));
        assert_eq!(steps(&got), [Forward, ForwardThenRelease]);
        assert_eq!(h.flow.transaction_end(), PinStep::Release, "no pin");
        h.flow.released();
        assert_eq!(statements.len(), 1);
        // The same connection: EXECUTE under usher's name.
        let out = carried(&mut h, &registry, &mut statements, "EXECUTE q(1)");
        assert_eq!(texts(&out), ["EXECUTE usher_1(1)"]);
        let rows = cat(&[
            msg(backend::ROW_DESCRIPTION, b"..."),
            msg(backend::DATA_ROW, b"..."),
            complete("SELECT 1"),
            ready(status::IDLE),
        ]);
        assert_eq!(
            steps(&h.server(&rows)),
            [Forward, Forward, Forward, ForwardThenRelease]
        );
        h.flow.released();
        // Another connection: PREPARE first, its answers dropped.
        h.prepared.clear();
        let out = carried(&mut h, &registry, &mut statements, "EXECUTE q (2)");
        assert_eq!(
            texts(&out),
            ["PREPARE usher_1 (int) AS SELECT $1", "EXECUTE usher_1 (2)"]
        );
        assert_eq!(h.flow.pending(), 2);
        let got = h.server(&cat(&[
            complete("PREPARE"),
            ready(status::IDLE),
            rows.clone(),
        ]));
        assert_eq!(
            steps(&got),
            [
                ServerStep::Drop,
                ServerStep::Drop,
                Forward,
                Forward,
                Forward,
                ForwardThenRelease
            ]
        );
        assert!(h.prepared.contains(&1));
        h.flow.released();
        // If that PREPARE fails, the client sees its error once.
        h.prepared.clear();
        carried(&mut h, &registry, &mut statements, "EXECUTE q(3)");
        let got = h.server(&cat(&[
            error("42P01"),
            ready(status::IDLE),
            error("26000"),
            ready(status::IDLE),
        ]));
        assert_eq!(
            steps(&got),
            [
                Forward,
                ServerStep::Drop,
                ServerStep::Drop,
                ForwardThenRelease
            ]
        );
        assert!(!h.prepared.contains(&1), "not on the server");
        h.flow.released();
        // A new text; then q's text under another name, on a connection
        // that has it: the same server statement, prepared again.
        let out = carried(
            &mut h,
            &registry,
            &mut statements,
            "prepare r(int) as select $1",
        );
        assert_eq!(texts(&out), ["PREPARE usher_2(int) as select $1"]);
        h.prepared.put(1, ());
        let out = carried(
            &mut h,
            &registry,
            &mut statements,
            "PREPARE s (int) AS SELECT $1",
        );
        assert_eq!(
            texts(&out),
            ["DEALLOCATE usher_1; PREPARE usher_1 (int) AS SELECT $1"]
        );
        let got = h.server(&cat(&[
            complete("PREPARE"),
            ready(status::IDLE),
            complete("DEALLOCATE"),
            complete("PREPARE"),
            ready(status::IDLE),
        ]));
        assert_eq!(
            steps(&got),
            [
                Forward,
                Forward,
                ServerStep::Drop,
                Forward,
                ForwardThenRelease
            ]
        );
        assert!(h.prepared.contains(&1) && h.prepared.contains(&2));
        // DEALLOCATE of a known name: a stand-in answers DEALLOCATE.
        let out = carried(&mut h, &registry, &mut statements, "DEALLOCATE r");
        assert_eq!(texts(&out), [prepared::DEALLOCATE_STAND_IN]);
        let got = h.server(&cat(&[
            complete("PREPARE"),
            complete("DEALLOCATE"),
            ready(status::IDLE),
        ]));
        assert_eq!(steps(&got), [ServerStep::Drop, Forward, ForwardThenRelease]);
        assert_eq!(statements.len(), 2, "q and s are left");
        // A name the client does not have goes as it is.
        let out = carried(&mut h, &registry, &mut statements, "DEALLOCATE r");
        assert_eq!(texts(&out), ["DEALLOCATE r"]);
        h.server(&cat(&[error("26000"), ready(status::IDLE)]));
        let out = carried(&mut h, &registry, &mut statements, "EXECUTE nope");
        assert_eq!(texts(&out), ["EXECUTE nope"]);
        h.server(&cat(&[error("26000"), ready(status::IDLE)]));
        assert_eq!(h.flow.transaction_end(), PinStep::Release);
    }

    #[test]
    fn a_failed_sql_prepare_leaves_no_name_and_a_second_one_is_refused() {
        let registry = StatementRegistry::default();
        let mut statements = ClientStatements::default();
        let mut h = Harness::new(PoolMode::Transaction, true);
        carried(
            &mut h,
            &registry,
            &mut statements,
            "PREPARE bad AS SELECT * FROM nothing",
        );
        h.server(&cat(&[error("42P01"), ready(status::IDLE)]));
        for (name, id) in h.flow.take_failed_prepares() {
            statements.forget_failed(&name, id);
        }
        assert!(statements.is_empty() && h.prepared.is_empty());
        h.flow.released();
        carried(&mut h, &registry, &mut statements, "PREPARE q AS SELECT 1");
        h.server(&cat(&[complete("PREPARE"), ready(status::IDLE)]));
        assert!(h.flow.take_failed_prepares().is_empty());
        h.flow.released();
        // The name again: 42P05 as PostgreSQL says, by a stand-in.
        let out = carried(&mut h, &registry, &mut statements, "PREPARE q AS SELECT 2");
        assert!(String::from_utf8_lossy(&out).contains(REFUSED_MARKER));
        let got = h.server(&cat(&[
            msg(
                backend::ERROR_RESPONSE,
                format!("SERROR\0C42703\0Mcolumn \"{REFUSED_MARKER}\" does not exist\0\0")
                    .as_bytes(),
            ),
            ready(status::IDLE),
        ]));
        match &steps(&got)[..] {
            [ServerStep::SendRefusal(e), ForwardThenRelease] => assert_eq!(e.code, "42P05"),
            other => panic!("{other:?}"),
        }
        // In a failed block a DEALLOCATE goes as it is (25P02; kept).
        h.client(&query("BEGIN"));
        h.server(&cat(&[complete("BEGIN"), ready(status::IN_TRANSACTION)]));
        h.client(&query("SELECT 1/0"));
        h.server(&cat(&[error("22012"), ready(status::FAILED)]));
        let out = carried(&mut h, &registry, &mut statements, "DEALLOCATE q");
        assert_eq!(texts(&out), ["DEALLOCATE q"]);
        h.server(&cat(&[error("25P02"), ready(status::FAILED)]));
        assert_eq!(statements.len(), 1);
        // A PREPARE there fails before it does anything: the connection
        // keeps the statement it had, the client gets no name.
        let id = 3; // bad was 1, q 2
        h.prepared.put(id, ());
        let out = carried(&mut h, &registry, &mut statements, "PREPARE p AS SELECT 9");
        assert_eq!(
            texts(&out),
            ["DEALLOCATE usher_3; PREPARE usher_3 AS SELECT 9"]
        );
        h.server(&cat(&[error("25P02"), ready(status::FAILED)]));
        assert!(
            h.prepared.contains(&id),
            "the DEALLOCATE did not run either"
        );
        for (name, id) in h.flow.take_failed_prepares() {
            statements.forget_failed(&name, id);
        }
        assert_eq!(statements.len(), 1, "p is not the client's");
    }

    #[test]
    fn a_stale_sql_execute_is_retried_only_outside_a_block_and_last() {
        let registry = StatementRegistry::default();
        let mut statements = ClientStatements::default();
        let mut h = Harness::new(PoolMode::Transaction, true);
        carried(
            &mut h,
            &registry,
            &mut statements,
            "PREPARE s AS SELECT * FROM t",
        );
        h.server(&cat(&[complete("PREPARE"), ready(status::IDLE)]));
        h.flow.released();
        carried(&mut h, &registry, &mut statements, "EXECUTE s");
        let got = h.server(&cat(&[error("0A000"), ready(status::IDLE)]));
        let body = match &steps(&got)[..] {
            [ServerStep::Retry(body), ServerStep::Drop] => body.clone(),
            other => panic!("{other:?}"),
        };
        assert_eq!(
            got[0].1,
            Some(Note::Error {
                code: b"0A000".to_vec(),
                stale: vec![1]
            }),
            "the statement is renewed before the retry"
        );
        statements.renew(&[1], &registry);
        assert_eq!(&body[..], b"EXECUTE s\0", "the client's Query");
        let mut out = BytesMut::new();
        let rewrite = Rewriter {
            registry: &registry,
            statements: &mut statements,
            prepared: &mut h.prepared,
            plan: h.flow.plan_mut(),
        }
        .rewrite_query(&body, false, false, &mut out);
        assert_eq!(
            texts(&out),
            ["PREPARE usher_2 AS SELECT * FROM t", "EXECUTE usher_2"]
        );
        h.flow.query_rewritten(rewrite);
        let got = h.server(&cat(&[
            complete("PREPARE"),
            ready(status::IDLE),
            complete("SELECT 0"),
            ready(status::IDLE),
        ]));
        assert_eq!(
            steps(&got),
            [
                ServerStep::Drop,
                ServerStep::Drop,
                Forward,
                ForwardThenRelease
            ]
        );
        h.flow.released();
        // Inside a block: the error stands (and a retry's failure too).
        h.client(&query("BEGIN"));
        h.server(&cat(&[complete("BEGIN"), ready(status::IN_TRANSACTION)]));
        carried(&mut h, &registry, &mut statements, "EXECUTE s");
        let got = h.server(&cat(&[error("0A000"), ready(status::FAILED)]));
        assert_eq!(steps(&got), [Forward, Forward], "not retried");
        h.client(&query("ROLLBACK"));
        h.server(&cat(&[complete("ROLLBACK"), ready(status::IDLE)]));
        h.flow.released();
        // Outside one, but with another Query sent after it: not retried.
        carried(&mut h, &registry, &mut statements, "EXECUTE s");
        h.client(&query("SELECT 1"));
        let got = h.server(&cat(&[error("0A000"), ready(status::IDLE)]));
        assert_eq!(steps(&got), [Forward, Forward]);
    }

    #[test]
    fn what_usher_does_not_carry_still_pins() {
        let registry = StatementRegistry::default();
        let mut statements = ClientStatements::default();
        let mut h = Harness::new(PoolMode::Transaction, true);
        // Several statements in one Query: the server gets the client's name.
        let sql = "PREPARE a AS SELECT 1; EXECUTE a";
        assert_eq!(h.client(&query(sql)), [ClientStep::Pin]);
        h.flow.slot_taken();
        let out = carried(&mut h, &registry, &mut statements, sql);
        assert_eq!(texts(&out), [sql], "as it is: a is not usher's");
        h.server(&cat(&[
            complete("PREPARE"),
            complete("SELECT 1"),
            ready(status::IDLE),
        ]));
        assert_eq!(h.flow.transaction_end(), PinStep::Keep);
        // After an unsynced extended message: not carried either.
        let mut h = Harness::new(PoolMode::Transaction, true);
        h.flow.slot_taken();
        let steps = h.client(&cat(&[
            msg(frontend::EXECUTE, b"\0\0\0\0\0"),
            query("PREPARE b AS SELECT 1"),
        ]));
        assert_eq!(steps, [ClientStep::Forward, ClientStep::Forward]);
        // Without rewriting (prepared_statements: 0) PREPARE pins as before.
        let mut h = Harness::new(PoolMode::Transaction, false);
        assert_eq!(h.client(&query("PREPARE c AS SELECT 1")), [ClientStep::Pin]);
        // A carried PREPARE of a text that pins pins at its EXECUTE.
        let mut statements = ClientStatements::default();
        let mut h = Harness::new(PoolMode::Transaction, true);
        carried(
            &mut h,
            &registry,
            &mut statements,
            "PREPARE l AS SELECT pg_advisory_lock(1)",
        );
        h.server(&cat(&[complete("PREPARE"), ready(status::IDLE)]));
        assert_eq!(h.flow.transaction_end(), PinStep::Release);
        h.flow.released();
        assert_eq!(h.client(&query("EXECUTE l")), [ClientStep::Pin]);
        h.flow.slot_taken();
        carried(&mut h, &registry, &mut statements, "EXECUTE l");
        h.server(&cat(&[complete("SELECT 1"), ready(status::IDLE)]));
        assert_eq!(h.flow.transaction_end(), PinStep::Keep);
    }

    /// A stale statement bound as libpq binds it (Bind, Describe portal,
    /// Execute, Sync), outside a block, alone and last: the error and its
    /// ReadyForQuery are dropped and the segment is walked again; in other
    /// shapes the error goes to the client.
    #[test]
    fn a_stale_bind_is_replayed_only_when_the_client_reads_the_new_shape() {
        let registry = StatementRegistry::default();
        let mut statements = ClientStatements::default();
        let mut h = Harness::new(PoolMode::Transaction, true);
        let parse = msg(frontend::PARSE, b"s\0select * from t\0\0\0");
        let bind = msg(frontend::BIND, b"\0s\0\0\0\0\0\0\0");
        let mut rewrite = |h: &mut Harness, m: &[u8]| {
            let mut out = BytesMut::new();
            let mut w = Rewriter {
                registry: &registry,
                statements: &mut statements,
                prepared: &mut h.prepared,
                plan: h.flow.plan_mut(),
            };
            if m[0] == frontend::BIND {
                w.rewrite_bind_head("", "s", 4, &mut out);
            } else {
                w.rewrite(m[0], &m[5..], &mut out).unwrap();
            }
            h.flow.rewritten();
        };
        h.client(&parse);
        rewrite(&mut h, &parse);
        h.client(&msg(frontend::SYNC, b""));
        h.server(&cat(&[
            msg(backend::PARSE_COMPLETE, b""),
            ready(status::IDLE),
        ]));
        h.flow.released();
        let tail = cat(&[
            msg(frontend::DESCRIBE, b"P\0"),
            msg(frontend::EXECUTE, b"\0\0\0\0\0"),
            msg(frontend::SYNC, b""),
        ]);
        let segment =
            |h: &mut Harness, rewrite: &mut dyn FnMut(&mut Harness, &[u8]), tail: &[u8]| {
                h.flow.copy_started();
                assert_eq!(h.client(&bind), [ClientStep::Rewrite]);
                rewrite(h, &bind);
                h.client(tail);
            };
        segment(&mut h, &mut rewrite, &tail);
        let got = h.server(&cat(&[error("0A000"), ready(status::IDLE)]));
        assert_eq!(steps(&got), [ServerStep::Replay, ServerStep::Drop]);
        assert!(matches!(&got[0].1, Some(Note::Error { stale, .. }) if stale == &[1]));
        assert!(
            h.flow.quiet() && !h.flow.copying(),
            "walked again from the copy"
        );
        // Without the Describe: the client kept a description; no replay.
        let bare = cat(&[
            msg(frontend::EXECUTE, b"\0\0\0\0\0"),
            msg(frontend::SYNC, b""),
        ]);
        segment(&mut h, &mut rewrite, &bare);
        let got = h.server(&cat(&[error("0A000"), ready(status::IDLE)]));
        assert_eq!(steps(&got), [Forward, ForwardThenRelease]);
        h.flow.released();
        // Without a copy of the segment (too large, or not from its start).
        assert_eq!(h.client(&bind), [ClientStep::Rewrite]);
        rewrite(&mut h, &bind);
        h.client(&tail);
        let got = h.server(&cat(&[error("0A000"), ready(status::IDLE)]));
        assert_eq!(steps(&got), [Forward, ForwardThenRelease]);
        h.flow.released();
        // Something of its answer already reached the client.
        segment(&mut h, &mut rewrite, &tail);
        let got = h.server(&cat(&[
            msg(backend::NOTICE_RESPONSE, b"SNOTICE\0C00000\0Mhi\0\0"),
            error("0A000"),
            ready(status::IDLE),
        ]));
        assert_eq!(steps(&got), [Forward, Forward, ForwardThenRelease]);
        h.flow.released();
        // Inside a transaction block.
        h.client(&query("BEGIN"));
        h.server(&cat(&[complete("BEGIN"), ready(status::IN_TRANSACTION)]));
        segment(&mut h, &mut rewrite, &tail);
        let got = h.server(&cat(&[error("0A000"), ready(status::FAILED)]));
        assert_eq!(steps(&got), [Forward, Forward]);
    }

    #[test]
    fn an_error_position_is_told_in_the_clients_text() {
        let registry = StatementRegistry::default();
        let mut statements = ClientStatements::default();
        let mut h = Harness::new(PoolMode::Transaction, true);
        // "PREPARE p1 AS SELECT $1a": the server got "PREPARE usher_1 AS
        // SELECT $1a", 5 characters longer before the error.
        carried(
            &mut h,
            &registry,
            &mut statements,
            "PREPARE p1 AS SELECT $1a",
        );
        let got = h.server(&cat(&[
            msg(
                backend::ERROR_RESPONSE,
                b"SERROR\0C42601\0Mtrailing junk\0P24\0\0",
            ),
            ready(status::IDLE),
        ]));
        let e = match &steps(&got)[..] {
            [ServerStep::SendError(e), ForwardThenRelease] => e.clone(),
            other => panic!("{other:?}"),
        };
        assert_eq!(&e[5..], b"SERROR\0C42601\0Mtrailing junk\0P19\0\0");
        h.flow.released();
        // Inside a rewritten name: its start; after several, each shift.
        carried(&mut h, &registry, &mut statements, "PREPARE q AS SELECT 1");
        h.server(&cat(&[complete("PREPARE"), ready(status::IDLE)]));
        h.flow.released();
        h.prepared.put(1, ());
        carried(
            &mut h,
            &registry,
            &mut statements,
            "EXECUTE q; EXECUTE q; SELECT x",
        );
        h.server(&cat(&[error("42703"), ready(status::IDLE)]));
        use prepared::{client_position, Edit};
        let edits = [
            Edit {
                server: 8..15,
                client: 8..9,
            },
            Edit {
                server: 25..32,
                client: 19..20,
            },
        ];
        assert_eq!(client_position(&edits, 3), 3);
        assert_eq!(client_position(&edits, 10), 9);
        assert_eq!(client_position(&edits, 17), 11);
        assert_eq!(client_position(&edits, 40), 28);
    }
}
