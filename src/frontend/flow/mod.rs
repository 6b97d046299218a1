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
//! The serve loop (`session/`) only moves bytes: it walks them with a
//! `FrameWalker`, hands each message to the flow, and acts on the
//! [`ClientStep`] or [`ServerStep`] it returns (a step carries what it
//! needs: the error to send, the Query to retry).
//!
//! This file holds the steps and the flow's state; the decisions are in
//! `client_side.rs` (client messages), `server_side.rs` (server messages)
//! and `pinning.rs` (pins, slots, refusals); `tests/` drive a flow with
//! byte fixtures, as `protocol/frames.rs` is tested.

use super::lost_block::LostBlock;
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

mod client_side;
mod pinning;
mod server_side;
mod spare;
#[cfg(test)]
mod tests;

pub use pinning::refused_message;

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
    /// The server's FATAL, in transaction mode: the server ends the
    /// connection after it. Hold it: once the connection is seen closed,
    /// the session tells the client as ERROR and keeps it if only the
    /// server's leg died (`session/server_lost.rs`), else sends it as it
    /// came.
    Fatal,
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
    /// The segments (numbered as `syncs_sent` counts them; 0: none) of the
    /// last BEGIN and of the last COMMIT, ROLLBACK, END or ABORT sent:
    /// whether a block is open if the server dies with them in flight.
    begin_segment: u64,
    exit_segment: u64,
    /// The client's transaction block died with its server connection:
    /// its messages are answered as in an aborted block until it ends it
    /// (`super::lost_block`; the session walks them, no server is used).
    lost: Option<Box<LostBlock>>,
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
            begin_segment: 0,
            exit_segment: 0,
            lost: None,
        }
    }
}

impl Flow {
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
        self.plan.reset();
        self.tracked.clear();
        self.answered = false;
        self.copy = None;
    }

    /// The server connection died (transaction mode), after the session
    /// walked an answer for each segment in flight (see
    /// `session/server_lost.rs`): what the client's statements did on it
    /// died with it (settings, state that would pin, a COPY, a pipeline
    /// not synced), and the flow starts over as after a release.
    pub fn server_lost(&mut self) {
        self.pending = 0;
        self.unsynced = false;
        self.status = status::IDLE;
        self.copy_in = false;
        self.copy_end = None;
        self.server_fatal = false;
        self.discarded = false;
        self.effects = Effects::default();
        self.resets_from = 0;
        self.pins_seen = PinKinds::NONE;
        self.unpins_seen = PinKinds::NONE;
        self.refuse_next = None;
        self.refusals.clear();
        self.syncs_sent = self.ready_seen;
        self.shape = Shape::default();
        self.last_shape = Shape::default();
        self.closing.clear();
        self.ddl_open = false;
        self.begin_segment = 0;
        self.exit_segment = 0;
        self.released();
    }

    /// Whether the client is (or may be) in a transaction block once the
    /// segments in flight are answered, if the server died under them: it
    /// was in one, or one of them began one; unless the last one sent ended
    /// it (a COMMIT that fails ends the block as any failed COMMIT does).
    /// Unsynced messages count as in the block they would join.
    pub fn block_after_loss(&self) -> bool {
        let open = !self.idle() || self.begin_segment > self.ready_seen;
        let ended = self.exit_segment > self.ready_seen
            && self.exit_segment >= self.begin_segment
            && self.exit_segment == self.syncs_sent
            && !self.unsynced;
        open && !ended
    }

    /// Whether a block was open (or opened) before the last segment in
    /// flight: the status its answer's predecessors carry.
    pub fn block_before_last(&self) -> bool {
        !self.idle()
            || (self.begin_segment > self.ready_seen && self.begin_segment < self.syncs_sent)
    }

    /// The lost transaction block the client is in, if any (see
    /// [`Flow::server_lost`]).
    pub fn lost_block(&mut self) -> Option<&mut LostBlock> {
        self.lost.as_deref_mut()
    }

    /// The client's transaction block is lost with its server: answer it
    /// as an aborted block (`Some`) until it ends it (`None`).
    pub fn set_lost_block(&mut self, block: Option<LostBlock>) {
        self.lost = block.map(Box::new);
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
            && self.lost.is_none()
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
