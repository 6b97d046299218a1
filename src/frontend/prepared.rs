//! Named prepared statements in transaction mode.
//!
//! A client's consecutive transactions may run on different server
//! connections, but a named statement lives on the connection that parsed it.
//! usher therefore keeps, per client, what each statement name means (its
//! query text and parameter types), gives every distinct statement one
//! server-side name (`usher_<id>`, shared by all clients, so it never
//! collides), remembers per server connection which of those it holds, and
//! prepares a statement on demand before a Bind or Describe that needs it.
//!
//! The server answers every Parse with ParseComplete and every Close with
//! CloseComplete, in order. [`ResponsePlan`] records, for each Parse/Close
//! sent, what to do with its answer: pass it on, drop it (a Parse the client
//! never sent), or turn it into ParseComplete (a Parse that was not needed
//! because the server already had the statement; a harmless Close of a name
//! that does not exist stands in for it, to keep the answers in order).
//! After an error the server skips to the next Sync, so answers still owed
//! for an earlier Sync are forgotten at each ReadyForQuery.
//!
//! SQL-level statements (a Query holding one `PREPARE name ... AS`,
//! `EXECUTE name`, `EXPLAIN ... EXECUTE name` or `DEALLOCATE name`,
//! `sql_scan::prepared_command`) are carried the same way:
//! [`Rewriter::rewrite_query`] rewrites the client's name to usher's,
//! prepares the statement first (a Query of its own, or a Parse + Sync for
//! a protocol-level one) where the server connection lacks it, and
//! answers a DEALLOCATE with a stand-in; what it did is a [`QueryRewrite`]
//! the flow tracks (answers to drop, the PREPARE to confirm, a stale
//! EXECUTE to run again).

use super::budget::{BufferBudget, Charge, FREE_STATEMENT_BYTES};
use super::sql_scan::{self, SqlPrepared};
use super::unnamed::{self, By, Outcome, Unnamed, UnnamedTrack, Use};
use crate::backend::PreparedSet;
use crate::protocol::tags::{backend, frontend, target};
use crate::protocol::PgError;
use bytes::{BufMut, Bytes, BytesMut};
use dashmap::DashMap;
use sha2::{Digest, Sha256};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A statement name no server connection ever holds.
const ABSENT_STATEMENT: &str = "usher_absent";

/// The name a client's Parse of a statement the server already holds is
/// checked under (made and closed at once).
const CHECK_STATEMENT: &str = "usher_check";

/// What stands in for a client's `DEALLOCATE name` of a statement usher
/// carries: the server answers it `DEALLOCATE` (after a `PREPARE` usher
/// drops) and keeps nothing, whatever the transaction state.
pub(crate) const DEALLOCATE_STAND_IN: &str =
    "PREPARE usher_deallocate AS SELECT; DEALLOCATE usher_deallocate";

/// The statement the stand-ins make and drop.
const DEALLOCATE_STAND_IN_NAME: &str = "usher_deallocate";

/// The SQLSTATE of "prepared statement ... already exists".
const DUPLICATE_PREPARED_STATEMENT: &str = "42P05";

/// Distinct statements the registry remembers at most; past it, it starts
/// over (statements already prepared keep their names; new Parses of the
/// same text get new ones), so dynamic SQL cannot grow it without bound.
const REGISTRY_LIMIT: usize = 100_000;

/// Ids for distinct statements (query text + parameter types), shared by all
/// clients so that identical statements share a server-side name. Keyed by
/// the SHA-256 of the definition, so an entry is small whatever the
/// statement's size; the texts live only with the clients that prepared
/// them.
///
/// A client's Parse is matched only to a server statement prepared since
/// the last DDL usher saw ([`StatementRegistry::schema_changed`]): each id
/// remembers the schema epoch it was given in, and a Parse in a later
/// epoch gets a new id (so it is prepared afresh, never matched to a
/// statement whose parameter or result types the DDL changed). Statements
/// clients prepared before keep theirs, as they would directly.
#[derive(Debug, Default)]
pub struct StatementRegistry {
    /// Definition → (id, the epoch it was given in).
    ids: DashMap<[u8; 32], (u64, u64)>,
    next: AtomicU64,
    epoch: AtomicU64,
}

impl StatementRegistry {
    fn id_for(&self, definition: &[u8]) -> u64 {
        let key: [u8; 32] = Sha256::digest(definition).into();
        let epoch = self.epoch.load(Ordering::Relaxed);
        if let Some(entry) = self.ids.get(&key) {
            if entry.1 == epoch {
                return entry.0;
            }
        }
        if self.ids.len() >= REGISTRY_LIMIT {
            self.ids.clear();
        }
        let mut entry = self
            .ids
            .entry(key)
            .or_insert_with(|| (self.new_id(), epoch));
        if entry.1 != epoch {
            *entry = (self.new_id(), epoch);
        }
        entry.0
    }

    fn new_id(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// A statement that may change what other statements mean (a CREATE,
    /// ALTER or DROP) completed, or the transaction that ran one ended:
    /// Parses from now on are prepared afresh.
    pub fn schema_changed(&self) {
        self.epoch.fetch_add(1, Ordering::Relaxed);
    }

    /// Statement `stale` (of this definition) is stale on the server (DDL
    /// changed its result type): its definition gets a new id, so no
    /// Parse of it is matched to the stale server statement again.
    /// Returns the definition's id now (a new one, or one another client
    /// already renewed it to).
    fn renew(&self, definition: &[u8], stale: u64) -> u64 {
        let key: [u8; 32] = Sha256::digest(definition).into();
        let epoch = self.epoch.load(Ordering::Relaxed);
        let mut entry = self
            .ids
            .entry(key)
            .or_insert_with(|| (self.new_id(), epoch));
        if entry.0 == stale {
            *entry = (self.new_id(), epoch);
        }
        entry.0
    }

    /// Distinct statements remembered now.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

/// Segment `v` (counted from 1) once Syncs `r..r + n` owe nothing (the
/// server ignored them, see `Flow::copy_started_at`): later ones are
/// numbered `n` lower, and those ended by them join segment `r`.
pub fn renumbered(v: u64, r: u64, n: u64) -> u64 {
    match v {
        v if v < r => v,
        v if v < r + n => r,
        v => v - n,
    }
}

/// The server-side name of statement `id`.
pub fn server_name(id: u64) -> String {
    format!("usher_{id}")
}

/// How a server message names one of usher's statements (quoted, as
/// PostgreSQL quotes names in its messages).
const QUOTED_SERVER_NAME: &[u8] = b"\"usher_";

/// True if a server error's message names one of usher's statements (e.g.
/// "bind message supplies 2 parameters, but prepared statement
/// \"usher_7\" requires 1").
pub fn error_names_server_statement(body: &[u8]) -> bool {
    crate::protocol::messages::error_message(body).is_some_and(|m| {
        m.windows(QUOTED_SERVER_NAME.len())
            .any(|w| w == QUOTED_SERVER_NAME)
    })
}

impl ClientStatements {
    /// A server error body with usher's statement names in its message
    /// told as the client's (the first of its names for that statement),
    /// or `None` if it names none the client has.
    /// `plan`: the client's changes not yet answered (a Close later in the
    /// batch has taken the name from the client's statements already).
    pub fn error_in_client_names(&self, body: &[u8], plan: &ResponsePlan) -> Option<Vec<u8>> {
        let message = crate::protocol::messages::error_message(body)?;
        let mut out = Vec::with_capacity(message.len());
        let mut rest = message;
        let mut renamed = false;
        while let Some(at) = rest
            .windows(QUOTED_SERVER_NAME.len())
            .position(|w| w == QUOTED_SERVER_NAME)
        {
            let digits_at = at + QUOTED_SERVER_NAME.len();
            let digits = rest[digits_at..]
                .iter()
                .take_while(|b| b.is_ascii_digit())
                .count();
            let id: Option<u64> = std::str::from_utf8(&rest[digits_at..digits_at + digits])
                .ok()
                .and_then(|d| d.parse().ok());
            let closed = rest.get(digits_at + digits) == Some(&b'"');
            let name = id.filter(|_| closed).and_then(|id| {
                let now = self.by_name.iter().flat_map(|m| m.map.iter());
                let before = plan
                    .changes
                    .iter()
                    .filter_map(|c| Some((&c.name, c.before.as_ref()?)));
                now.chain(before)
                    .filter(|(_, s)| s.id == id)
                    .map(|(n, _)| n)
                    .min()
            });
            match name {
                Some(name) => {
                    out.extend_from_slice(&rest[..at + 1]);
                    out.extend_from_slice(crate::protocol::error::shown_name(name).as_bytes());
                    renamed = true;
                }
                None => out.extend_from_slice(&rest[..digits_at + digits]),
            }
            rest = &rest[digits_at + digits..];
        }
        out.extend_from_slice(rest);
        if !renamed {
            return None;
        }
        crate::protocol::messages::with_error_field(body, b'M', &out)
    }
}

/// How the client prepared a statement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// A Parse message.
    Protocol,
    /// A SQL `PREPARE`.
    Sql,
}

/// A client's named statement.
#[derive(Debug, Clone)]
struct Statement {
    id: u64,
    /// Protocol: the Parse body after the name (query text, NUL, parameter
    /// types). SQL: the PREPARE text after the name (`[(types)] AS ...`;
    /// never a NUL, so never the same key as a Parse's).
    definition: Bytes,
    kind: Kind,
}

/// The statements one client has prepared.
#[derive(Debug, Default)]
pub struct ClientStatements {
    /// Boxed on first use: most clients name no statement, and each idle
    /// client keeps this (8 bytes, not a map's 48).
    by_name: Option<Box<Named>>,
    /// Its unnamed statement, as PostgreSQL would keep it (see
    /// [`super::unnamed`]).
    unnamed: Option<Unnamed>,
}

impl ClientStatements {
    /// Takes in what the server's answers (and the client's Queries) did to
    /// the unnamed statement since last asked.
    pub fn sync_unnamed(&mut self, plan: &mut ResponsePlan) {
        if let Some(now) = plan.unnamed.take_undone() {
            self.unnamed = now;
        }
        while let Some((number, now)) = plan.unnamed.next_applying() {
            let before = std::mem::replace(&mut self.unnamed, now);
            plan.unnamed.applied(number, before);
        }
    }

    /// DISCARD ALL / DEALLOCATE ALL: the client's statements are gone.
    pub fn clear(&mut self) {
        self.by_name = None;
    }

    /// The server said statements `stale` are stale (DDL changed their
    /// result type): the client's statements of those ids take new ids,
    /// prepared afresh where they are next used.
    pub fn renew(&mut self, stale: &[u64], registry: &StatementRegistry) {
        for stmt in self.by_name.iter_mut().flat_map(|m| m.map.values_mut()) {
            if stale.contains(&stmt.id) {
                stmt.id = registry.renew(&stmt.definition, stmt.id);
            }
        }
    }

    /// A SQL PREPARE of `name` (as statement `id`) failed on the server:
    /// the client has no such statement (unless it prepared the name again
    /// since).
    pub fn forget_failed(&mut self, name: &str, id: u64) {
        if self
            .get(name)
            .is_some_and(|s| s.id == id && s.kind == Kind::Sql)
        {
            self.remove(name);
        }
    }

    /// Puts back what a name meant before a Parse or Close the server
    /// never answered.
    pub fn undo(&mut self, undo: NameChangeUndo) {
        let NameChange { name, before, .. } = undo.0;
        match before {
            Some(statement) => self.insert(name, statement),
            None => self.remove(&name),
        }
    }

    /// Statements the client has now (SHOW CLIENTS' prepared_statements).
    pub fn len(&self) -> usize {
        self.by_name.as_ref().map_or(0, |m| m.map.len())
    }

    /// Whether the client has a statement of this name.
    pub fn contains(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    /// What the statements hold, as charged: names, definitions and
    /// [`STATEMENT_OVERHEAD`] each.
    pub fn bytes(&self) -> usize {
        self.by_name.as_ref().map_or(0, |m| m.bytes)
    }

    /// Whether a statement of `extra` bytes ([`statement_bytes`]) may be
    /// made: what the client's statements would hold beyond
    /// [`FREE_STATEMENT_BYTES`] is charged to `budget` first, refused
    /// (false, nothing charged) past `limit` (`max_buffered_total`).
    pub fn make_room(&mut self, extra: usize, budget: &Arc<BufferBudget>, limit: usize) -> bool {
        let wanted = (self.bytes() + extra).saturating_sub(FREE_STATEMENT_BYTES);
        if wanted == 0 {
            return true;
        }
        let named = self.by_name.get_or_insert_with(Default::default);
        let charge = named
            .charge
            .get_or_insert_with(|| Charge::new(budget.clone()));
        wanted <= charge.bytes() || charge.set(wanted, limit)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn get(&self, name: &str) -> Option<&Statement> {
        self.by_name.as_ref()?.map.get(name)
    }

    fn insert(&mut self, name: String, statement: Statement) {
        let named = self.by_name.get_or_insert_with(Default::default);
        let name_len = name.len();
        named.bytes += statement_bytes(&name, &statement.definition);
        if let Some(before) = named.map.insert(name, statement) {
            named.bytes -= name_len + before.definition.len() + STATEMENT_OVERHEAD;
        }
        named.settle();
    }

    fn remove(&mut self, name: &str) {
        if let Some(named) = self.by_name.as_mut() {
            if let Some(gone) = named.map.remove(name) {
                named.bytes -= statement_bytes(name, &gone.definition);
                named.settle();
            }
        }
    }
}

/// What a client's named statement is charged: its name, its definition
/// and [`STATEMENT_OVERHEAD`] (so a great many small ones count too).
pub fn statement_bytes(name: &str, definition: &[u8]) -> usize {
    name.len() + definition.len() + STATEMENT_OVERHEAD
}

/// About what a statement costs beside its name and definition: the map's
/// entry, the name's and definition's headers.
pub const STATEMENT_OVERHEAD: usize = 96;

/// A client's named statements and what they hold.
#[derive(Debug, Default)]
struct Named {
    map: HashMap<String, Statement>,
    /// [`statement_bytes`] of every statement in `map`.
    bytes: usize,
    /// What is held beyond [`FREE_STATEMENT_BYTES`], charged to the
    /// budget (from the first statement past it; given back when the
    /// statements go).
    charge: Option<Charge>,
}

impl Named {
    /// The charge brought to what is held now: down after a Close, up
    /// when a change the server never answered is undone (a statement
    /// made before, and charged then, is back).
    fn settle(&mut self) {
        if let Some(charge) = self.charge.as_mut() {
            charge.set(self.bytes.saturating_sub(FREE_STATEMENT_BYTES), usize::MAX);
        }
    }
}

/// A change to a client's statements to undo ([`ResponsePlan::take_undone`]).
#[derive(Debug)]
pub struct NameChangeUndo(NameChange);

/// What to do with a ParseComplete or CloseComplete from the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    Forward,
    Drop,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// The client's own Parse or Close.
    Pass,
    /// A Parse of server statement `id`; `forward` if the client asked for it.
    Prepared { id: u64, forward: bool },
    /// usher's own Parse or Close the client never sent.
    Drop,
    /// The next entry is the client's Parse or Close of a name: its change
    /// to the client's statements ([`ResponsePlan::changes`]) stands only
    /// if the server answers it (not skipped after an error, not refused).
    Named,
    /// A message that changes the unnamed statement (a Parse or Close, or
    /// a Query, which is answered by its ReadyForQuery).
    Unnamed(unnamed::Event),
}

/// A change to a client's statements made when its Parse or Close went
/// out, undone if the server never answers it.
#[derive(Debug)]
struct NameChange {
    name: String,
    /// What the name meant before (None: nothing).
    before: Option<Statement>,
    /// The Syncs sent before it (its batch).
    segment: u64,
}

/// The ParseComplete/CloseComplete answers owed by one server connection
/// during one checkout.
#[derive(Debug, Default)]
pub struct ResponsePlan {
    /// (Syncs sent before it, what to do with its answer).
    owed: VecDeque<(u64, Expect)>,
    /// Server statements bound or described since the last ReadyForQuery:
    /// those an error may be about.
    used: Vec<u64>,
    syncs_sent: u64,
    ready_seen: u64,
    /// One per [`Expect::Named`] owed, in order.
    changes: VecDeque<NameChange>,
    /// Changes the server never answered, for the session to undo
    /// ([`ResponsePlan::take_undone`]).
    undone: Vec<NameChange>,
    /// What the messages sent do to the unnamed statement.
    unnamed: UnnamedTrack,
}

impl ResponsePlan {
    /// Nothing owed or remembered (as a new plan).
    pub fn is_empty(&self) -> bool {
        self.owed.is_empty()
            && self.used.is_empty()
            && self.syncs_sent == self.ready_seen
            && self.unnamed.is_empty()
    }

    /// As new, keeping what its queues allocated (reset at every
    /// transaction's end).
    pub fn reset(&mut self) {
        self.owed.clear();
        self.used.clear();
        self.syncs_sent = 0;
        self.ready_seen = 0;
        self.changes.clear();
        self.undone.clear();
        self.unnamed.reset();
    }

    /// A Sync or Query went to the server.
    pub fn sync_sent(&mut self) {
        self.syncs_sent += 1;
    }

    /// Syncs `r..r + n` (counted from 1) were ignored by the server (COPY
    /// IN mode, see `Flow::copy_started_at`): renumber what is owed.
    pub fn syncs_ignored(&mut self, r: u64, n: u64) {
        // Entries hold the Syncs sent before them (their Sync's number - 1).
        let shift = |s: u64| renumbered(s + 1, r, n) - 1;
        self.syncs_sent -= n;
        for (segment, _) in &mut self.owed {
            *segment = shift(*segment);
        }
        for c in &mut self.changes {
            c.segment = shift(c.segment);
        }
        self.unnamed.renumber(shift);
    }

    /// The client's own Parse or Close went to the server unchanged.
    pub fn passed(&mut self) {
        self.owed.push_back((self.syncs_sent, Expect::Pass));
    }

    fn expect(&mut self, e: Expect) {
        self.owed.push_back((self.syncs_sent, e));
    }

    /// A message that changes the unnamed statement goes out next; `now`:
    /// the client's after it (a change of the client's).
    fn unnamed_sent(&mut self, by: By, after: Option<u64>, now: Option<Unnamed>) {
        let event = self.unnamed.sent(self.syncs_sent, by, after, now);
        self.expect(Expect::Unnamed(event));
    }

    /// The client's unnamed Parse (`body`, whole) goes to the server as it
    /// is, first in its batch.
    pub fn unnamed_parse_forwarded(&mut self, body: &[u8]) {
        self.unnamed.set_fresh(true);
        let new = Unnamed::new(body.get(1..).unwrap_or_default());
        self.unnamed_sent(By::ClientParse, Some(new.token), Some(new));
    }

    /// The client's simple Query goes out next (before its
    /// [`ResponsePlan::sync_sent`]): it drops the unnamed statement. Also
    /// for the stand-in of a refused unnamed Parse.
    pub fn drops_unnamed(&mut self) {
        self.unnamed_sent(By::Drops, None, None);
    }

    /// What a Bind or Describe of the unnamed statement needs now.
    pub fn unnamed_use(&self) -> Use {
        self.unnamed.use_in(self.syncs_sent)
    }

    /// The flow stops at a message to rewrite; `fresh`: it is the first of
    /// its batch.
    pub fn rewriting(&mut self, fresh: bool) {
        self.unnamed.set_fresh(fresh);
    }

    /// The server sent an ErrorResponse: it is about the first message of
    /// the batch being answered that is not answered yet. If that message
    /// changes the unnamed statement and may fail, it was refused (a client
    /// Parse is always first in its batch or right after a marker of
    /// usher's, see [`Rewriter::rewrite`]).
    pub fn error(&mut self, prepared: &mut PreparedSet) {
        self.forget_stale(prepared);
        if let Some(&(segment, Expect::Unnamed(event))) = self.owed.front() {
            let may_fail = !matches!(event.by, By::ClientClose | By::UsherClose);
            if segment == self.ready_seen && may_fail {
                self.owed.pop_front();
                self.unnamed.decided(event, Outcome::Refused, prepared);
            }
        }
    }

    /// ReadyForQuery: whatever was owed for that Sync will not come.
    pub fn ready(&mut self, prepared: &mut PreparedSet) {
        self.ready_seen += 1;
        self.used.clear();
        self.forget_stale(prepared);
    }

    fn forget_stale(&mut self, prepared: &mut PreparedSet) {
        while let Some(&(segment, e)) = self.owed.front() {
            if segment >= self.ready_seen {
                break;
            }
            self.owed.pop_front();
            match e {
                // Skipped after an error: the server does not have it.
                Expect::Prepared { id, .. } => {
                    prepared.pop(&id);
                }
                // The client's Parse or Close was skipped or refused:
                // what it did to the name did not happen.
                Expect::Named => self.undone.extend(self.changes.pop_front()),
                Expect::Unnamed(event) => self.unnamed.decided(event, Outcome::Skipped, prepared),
                _ => {}
            }
        }
    }

    /// A client's Parse or Close of `name` goes out next; `before` is what
    /// the name meant until now.
    fn named(&mut self, name: &str, before: Option<Statement>) {
        self.expect(Expect::Named);
        self.changes.push_back(NameChange {
            name: name.to_string(),
            before,
            segment: self.syncs_sent,
        });
    }

    /// A client's Parse or Close of `name` in an earlier batch is not
    /// answered yet: whether the name exists depends on it (it may be
    /// skipped after an error), so a message naming it waits.
    pub fn name_undecided(&self, name: &[u8]) -> bool {
        self.changes
            .iter()
            .any(|c| c.segment < self.syncs_sent && c.name.as_bytes() == name)
    }

    /// Changes to the client's statements whose Parse or Close the server
    /// never answered (skipped after an error, or refused), for
    /// [`ClientStatements::undo`].
    pub fn take_undone(&mut self) -> Vec<NameChangeUndo> {
        std::mem::take(&mut self.undone)
            .into_iter()
            .map(NameChangeUndo)
            .collect()
    }

    /// A statement of usher's was bound or described since the last
    /// ReadyForQuery.
    pub fn bound_usher_statement(&self) -> bool {
        !self.used.is_empty()
    }

    /// The server statements an error since the last ReadyForQuery may be
    /// about.
    pub fn take_used(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.used)
    }

    /// The server sent ParseComplete ('1') or CloseComplete ('3').
    pub fn answer(&mut self, tag: u8, prepared: &mut PreparedSet) -> Answer {
        self.forget_stale(prepared);
        if matches!(self.owed.front(), Some((_, Expect::Named))) {
            // Answered: the client's change to the name stands.
            self.owed.pop_front();
            self.changes.pop_front();
        }
        if let Some(&(_, Expect::Unnamed(event))) = self.owed.front() {
            self.owed.pop_front();
            self.unnamed.decided(event, Outcome::Done, prepared);
            return if event.by.clients() {
                Answer::Forward
            } else {
                Answer::Drop
            };
        }
        match (tag, self.owed.pop_front().map(|(_, e)| e)) {
            (backend::PARSE_COMPLETE, Some(Expect::Prepared { forward: false, .. })) => {
                Answer::Drop
            }
            (_, Some(Expect::Drop)) => Answer::Drop,
            (_, Some(_)) => Answer::Forward,
            (_, None) => {
                tracing::warn!(tag = %(tag as char), "unexpected answer from server; passing it on");
                Answer::Forward
            }
        }
    }
}

/// True if this client message names a statement and needs rewriting:
/// every Parse and every Close of a statement (they change what the
/// client's names mean), and a Bind or Describe of a named statement.
/// (Whether one of the unnamed statement needs anything is the flow's
/// call: [`ResponsePlan::unnamed_use`].) `body` is the whole message body,
/// or a Bind's head.
pub fn needs_rewrite(tag: u8, body: &[u8]) -> bool {
    match tag {
        frontend::PARSE => true,
        frontend::BIND => bind_names(body).is_some_and(|(_, name, _)| !name.is_empty()),
        frontend::DESCRIBE => {
            body.first() == Some(&target::STATEMENT) && body.get(1).is_some_and(|b| *b != 0)
        }
        frontend::CLOSE => body.first() == Some(&target::STATEMENT),
        _ => false,
    }
}

/// The statement a client Parse, Bind, Describe or Close names (empty: the
/// unnamed one; `None`: none, or a portal). `body`: the whole body, or a
/// Bind's head.
pub fn statement_named(tag: u8, body: &[u8]) -> Option<&[u8]> {
    fn cstr(b: &[u8]) -> Option<&[u8]> {
        b.iter().position(|c| *c == 0).map(|end| &b[..end])
    }
    match tag {
        frontend::PARSE => cstr(body),
        frontend::BIND => bind_names(body).map(|(_, name, _)| name.as_bytes()),
        frontend::DESCRIBE | frontend::CLOSE if body.first() == Some(&target::STATEMENT) => {
            cstr(&body[1..])
        }
        _ => None,
    }
}

/// True if this client message uses the unnamed statement (a Bind of it,
/// or a Describe of it). `body`: the whole body, or a Bind's head.
pub fn uses_unnamed(tag: u8, body: &[u8]) -> bool {
    matches!(tag, frontend::BIND | frontend::DESCRIBE)
        && statement_named(tag, body).is_some_and(<[u8]>::is_empty)
}

/// The name in an unnamed Parse of `DEALLOCATE [PREPARE] name` (how
/// psycopg 3 drops a statement: its SQL commands go through the extended
/// protocol).
pub fn unnamed_deallocate(body: &[u8]) -> Option<String> {
    let text = body.strip_prefix(&[0])?;
    let end = text.iter().position(|b| *b == 0)?;
    match sql_scan::prepared_command(&text[..end])? {
        SqlPrepared::Deallocate { name } => Some(name),
        _ => None,
    }
}

/// The portal and statement names at the start of a Bind body, and how
/// many bytes they take; `None` until both are in (or if they are not
/// UTF-8, in which case the Bind streams through unchanged).
pub fn bind_names(head: &[u8]) -> Option<(&str, &str, usize)> {
    let (portal, rest) = split_cstr(head).ok()?;
    let (name, _) = split_cstr(rest).ok()?;
    Some((portal, name, portal.len() + name.len() + 2))
}

/// The client's Parse of a name it already has: PostgreSQL refuses it
/// (42P05) and skips the rest of the batch; the caller sends
/// `flow::refused_message` with this error.
pub fn duplicate_parse(statements: &ClientStatements, tag: u8, body: &[u8]) -> Option<PgError> {
    if tag != frontend::PARSE {
        return None;
    }
    let (name, _) = split_cstr(body).ok()?;
    statements.get(name).filter(|_| !name.is_empty())?;
    Some(PgError::error(
        DUPLICATE_PREPARED_STATEMENT,
        format!(
            "prepared statement \"{}\" already exists",
            crate::protocol::error::shown_name(name)
        ),
    ))
}

/// The number of parameters a Bind supplies, from its body past the
/// portal and statement names (`head` bytes), if that much of it is in.
pub fn bind_parameter_count(body: &[u8], head: usize) -> Option<usize> {
    let rest = body.get(head..)?;
    let formats = usize::from(u16::from_be_bytes([*rest.first()?, *rest.get(1)?]));
    let at = 2 + 2 * formats;
    Some(usize::from(u16::from_be_bytes([
        *rest.get(at)?,
        *rest.get(at + 1)?,
    ])))
}

/// A named Parse or SQL PREPARE of `name` that would take the client's
/// statements past what the budget allows ([`ClientStatements::make_room`]):
/// the error to answer in its place (53200, as PostgreSQL's out of memory).
/// For a Parse the caller writes [`Rewriter::refusal_stand_in`] instead of
/// it; for a Query, `flow::refused_message`.
pub fn no_room_for(name: &str, held: usize, limit: usize) -> PgError {
    PgError::error(crate::protocol::error::sqlstate::OUT_OF_MEMORY, "out of memory")
        .with_detail(format!(
            "usher cannot keep prepared statement \"{}\": this client's prepared statements hold {held} bytes, and clients' held bytes are at max_buffered_total ({limit} bytes)",
            crate::protocol::error::shown_name(name)
        ))
        .with_hint("Close (DEALLOCATE) prepared statements that are no longer used.")
}

/// The name and [`statement_bytes`] of the statement a named Parse
/// (`body`) would make; `None` for any other message.
pub fn parse_statement_bytes(tag: u8, body: &[u8]) -> Option<(&str, usize)> {
    if tag != frontend::PARSE {
        return None;
    }
    let (name, rest) = split_cstr(body).ok()?;
    (!name.is_empty()).then(|| (name, statement_bytes(name, rest)))
}

/// The name and [`statement_bytes`] of the statement a Query's SQL
/// PREPARE (whole body) would make.
pub fn prepare_statement_bytes(body: &[u8]) -> Option<(String, usize)> {
    let text = body.strip_suffix(&[0]).unwrap_or(body);
    match sql_scan::prepared_command(text)? {
        SqlPrepared::Prepare { name, rest } => {
            let bytes = statement_bytes(&name, rest);
            Some((name, bytes))
        }
        _ => None,
    }
}

/// Everything one rewrite needs.
pub struct Rewriter<'a> {
    pub registry: &'a StatementRegistry,
    pub statements: &'a mut ClientStatements,
    pub prepared: &'a mut PreparedSet,
    pub plan: &'a mut ResponsePlan,
}

impl Rewriter<'_> {
    /// Rewrites one client message for which [`needs_rewrite`] said yes,
    /// appending what to send to the server to `out`.
    pub fn rewrite(&mut self, tag: u8, body: &[u8], out: &mut BytesMut) -> Result<(), PgError> {
        match tag {
            frontend::PARSE if body.first() == Some(&0) => {
                self.statements.sync_unnamed(self.plan);
                let known =
                    unnamed_deallocate(body).filter(|name| self.statements.get(name).is_some());
                if known.is_none() && !self.plan.unnamed.fresh() {
                    // Not first in its batch: a marker whose answer comes
                    // just before the Parse's, so that an error after it
                    // is the Parse's own (ResponsePlan::error).
                    put_close(out, ABSENT_STATEMENT);
                    self.plan.expect(Expect::Drop);
                }
                let start = begin(out, frontend::PARSE);
                match known {
                    Some(name) => {
                        // A statement of usher's own stands in for the
                        // client's: the DEALLOCATE drops it and answers
                        // as the server would (a Close first, in case an
                        // earlier stand-in was never executed).
                        self.statements.remove(&name);
                        out.truncate(start);
                        put_close(out, DEALLOCATE_STAND_IN_NAME);
                        self.plan.expect(Expect::Drop);
                        let own = begin(out, frontend::PARSE);
                        put_cstr(out, DEALLOCATE_STAND_IN_NAME);
                        put_cstr(out, "SELECT");
                        out.put_u16(0);
                        finish(out, own);
                        self.plan.expect(Expect::Drop);
                        let start = begin(out, frontend::PARSE);
                        out.put_u8(0);
                        put_cstr(out, &format!("DEALLOCATE {DEALLOCATE_STAND_IN_NAME}"));
                        let types = split_cstr(&body[1..])?.1;
                        out.put_slice(types);
                        finish(out, start);
                    }
                    None => {
                        out.put_slice(body);
                        finish(out, start);
                    }
                }
                let new = Unnamed::new(&body[1..]);
                self.plan
                    .unnamed_sent(By::ClientParse, Some(new.token), Some(new));
                self.statements.sync_unnamed(self.plan);
            }
            frontend::PARSE => {
                let (name, rest) = split_cstr(body)?;
                let definition = Bytes::copy_from_slice(rest);
                let id = self.registry.id_for(&definition);
                let before = self.statements.get(name).cloned();
                self.plan.named(name, before);
                self.statements.insert(
                    name.to_string(),
                    Statement {
                        id,
                        definition: definition.clone(),
                        kind: Kind::Protocol,
                    },
                );
                if self.prepared.get(&id).is_some() {
                    // The server has it: the text is checked under a
                    // name of usher's instead (so it fails where the
                    // client's Parse would, with 25P02 in a failed block
                    // or a syntax error), and dropped again (right after
                    // it, so never skipped where it was made).
                    put_parse(out, CHECK_STATEMENT, &definition);
                    self.plan.expect(Expect::Pass);
                    put_close(out, CHECK_STATEMENT);
                    self.plan.expect(Expect::Drop);
                } else {
                    self.parse_on_server(id, &definition, true, out);
                }
            }
            frontend::BIND => {
                let (portal, rest) = split_cstr(body)?;
                let (name, params) = split_cstr(rest)?;
                self.rewrite_bind_head(portal, name, params.len(), out);
                out.put_slice(params);
            }
            frontend::CLOSE if body.get(1) == Some(&0) => {
                // The client's unnamed statement: gone once the server
                // closes it (a Close never fails; it may be skipped).
                self.plan.unnamed_sent(By::ClientClose, None, None);
                self.statements.sync_unnamed(self.plan);
                let start = begin(out, frontend::CLOSE);
                out.put_slice(body);
                finish(out, start);
            }
            frontend::DESCRIBE => {
                let (name, _) = split_cstr(&body[1..])?;
                let name = self.prepare_if_needed(name, out);
                let start = begin(out, frontend::DESCRIBE);
                out.put_u8(target::STATEMENT);
                put_cstr(out, &name);
                finish(out, start);
            }
            frontend::CLOSE => {
                // The server never saw the client's name: closing it there is
                // harmless and answers CloseComplete, as the client expects.
                let (name, _) = split_cstr(&body[1..])?;
                let before = self.statements.get(name).cloned();
                self.plan.named(name, before);
                self.statements.remove(name);
                let start = begin(out, frontend::CLOSE);
                out.put_slice(body);
                finish(out, start);
                self.plan.passed();
            }
            _ => unreachable!("needs_rewrite admits only P, B, D and C"),
        }
        Ok(())
    }

    /// A Parse of a name the client has ([`duplicate_parse`]): the server
    /// checks the text first, as directly (a syntax error or an
    /// undeterminable parameter type is reported before the name), then
    /// refuses the name. A statement of usher's whose name holds the
    /// refusal marker is made first, so the client's text, parsed under
    /// that name, fails with 42P05 (replaced by the client's own 42P05),
    /// or with the text's own error (or 25P02 in a failed block), as the
    /// client's Parse would directly.
    pub fn refuse_duplicate(&mut self, body: &[u8], out: &mut BytesMut) -> Result<(), PgError> {
        let (_, rest) = split_cstr(body)?;
        let marker = super::flow::REFUSED_MARKER;
        put_close(out, marker);
        self.plan.expect(Expect::Drop);
        let start = begin(out, frontend::PARSE);
        put_cstr(out, marker);
        // Parsed, never run; a transaction-exit statement, so it is made
        // in a failed block too and the client's text meets the server's
        // checks in their order (25P02 first, unless it ends the block).
        put_cstr(out, "ROLLBACK");
        out.put_u16(0);
        finish(out, start);
        self.plan.expect(Expect::Drop);
        let start = begin(out, frontend::PARSE);
        put_cstr(out, marker);
        out.put_slice(rest);
        finish(out, start);
        Ok(())
    }

    /// Rewrites a client's Query (its whole body) that the flow found to be
    /// a statement about a prepared statement
    /// (`sql_scan::prepared_command`), appending what to send to `out`,
    /// unless it is refused ([`QueryRewrite::refused`]: the caller sends the
    /// refusal's stand-in). `failed_block`: the server connection is known
    /// to be in a failed transaction block (every statement fails there
    /// with 25P02 before names are looked at). `may_retry`: an EXECUTE may
    /// be run again if its statement is stale (not for a retry).
    pub fn rewrite_query(
        &mut self,
        body: &[u8],
        failed_block: bool,
        may_retry: bool,
        out: &mut BytesMut,
    ) -> QueryRewrite {
        let mut r = QueryRewrite::default();
        let text = body.strip_suffix(&[0]).unwrap_or(body);
        match sql_scan::prepared_command(text) {
            Some(SqlPrepared::Prepare { name, rest }) => {
                if self.statements.get(&name).is_some() {
                    r.refused = Some(PgError::error(
                        DUPLICATE_PREPARED_STATEMENT,
                        format!(
                            "prepared statement \"{}\" already exists",
                            crate::protocol::error::shown_name(&name)
                        ),
                    ));
                    return r;
                }
                let definition = Bytes::copy_from_slice(rest);
                let id = self.registry.id_for(&definition);
                let server = server_name(id);
                // On a connection that has it, it is prepared again (the
                // text is checked now, as directly).
                let after_deallocate = self.prepared.get(&id).is_some();
                let start = begin(out, frontend::QUERY);
                if after_deallocate {
                    out.put_slice(format!("DEALLOCATE {server}; ").as_bytes());
                    r.client.drop_completes = 1;
                } else {
                    self.prepared.put(id, ());
                }
                out.put_slice(format!("PREPARE {server}").as_bytes());
                // What stands for the client's text up to the name's end.
                let written = out.len() - start - 5;
                let name_end = rest.as_ptr() as usize - text.as_ptr() as usize;
                r.client.edits.push(Edit {
                    server: 0..written,
                    client: 0..chars(&text[..name_end]),
                });
                out.put_slice(rest);
                out.put_u8(0);
                finish(out, start);
                self.statements.insert(
                    name.clone(),
                    Statement {
                        id,
                        definition,
                        kind: Kind::Sql,
                    },
                );
                r.client.prepares = Some(Prepares {
                    id,
                    name: Some(name),
                    after_deallocate,
                });
            }
            Some(SqlPrepared::Deallocate { name })
                if !failed_block && self.statements.get(&name).is_some() =>
            {
                self.statements.remove(&name);
                let start = begin(out, frontend::QUERY);
                out.put_slice(DEALLOCATE_STAND_IN.as_bytes());
                out.put_u8(0);
                finish(out, start);
                r.client.drop_completes = 1;
            }
            command => {
                // Statements run by name (EXECUTE, EXPLAIN EXECUTE, CREATE
                // TABLE AS EXECUTE), in one statement or several: the
                // client's names become usher's, each statement prepared
                // first where the connection lacks it. Other names, and
                // other texts, go as they are: the server answers as it
                // would directly.
                let single = matches!(command, Some(SqlPrepared::Execute { .. }));
                let references: Vec<_> = sql_scan::execute_references(text)
                    .into_iter()
                    .filter_map(|(at, name)| self.statements.get(&name).map(|s| (at, s.clone())))
                    .collect();
                for (_, stmt) in &references {
                    if self.prepared.get(&stmt.id).is_none() {
                        r.own.push(self.prepare_own(stmt, out));
                    }
                    if !self.plan.used.contains(&stmt.id) {
                        self.plan.used.push(stmt.id);
                    }
                }
                let start = begin(out, frontend::QUERY);
                let mut from = 0;
                let (mut server_at, mut client_at) = (0, 0);
                for (at, stmt) in &references {
                    let same = chars(&text[from..at.start]);
                    out.put_slice(&text[from..at.start]);
                    let name = server_name(stmt.id);
                    out.put_slice(name.as_bytes());
                    let (s, c) = (server_at + same, client_at + same);
                    server_at = s + name.len();
                    client_at = c + chars(&text[at.clone()]);
                    r.client.edits.push(Edit {
                        server: s..server_at,
                        client: c..client_at,
                    });
                    from = at.end;
                }
                out.put_slice(&body[from..]);
                finish(out, start);
                if may_retry && single && references.len() == 1 {
                    r.client.retry = Some(Bytes::copy_from_slice(body));
                }
            }
        }
        r
    }

    /// Prepares the client's statement `stmt` on this server connection in
    /// a segment of usher's own, before the Query that runs it (so that
    /// the server's record of the statement's text holds none of that
    /// Query's arguments): a PREPARE Query for a SQL statement, a Parse +
    /// Sync for a protocol-level one.
    fn prepare_own(&mut self, stmt: &Statement, out: &mut BytesMut) -> Segment {
        let mut own = Segment {
            own: true,
            ..Segment::default()
        };
        match stmt.kind {
            Kind::Sql => {
                let start = begin(out, frontend::QUERY);
                out.put_slice(format!("PREPARE {}", server_name(stmt.id)).as_bytes());
                out.put_slice(&stmt.definition);
                out.put_u8(0);
                finish(out, start);
                self.prepared.put(stmt.id, ());
                own.drop_completes = 1;
                own.prepares = Some(Prepares {
                    id: stmt.id,
                    name: None,
                    after_deallocate: false,
                });
            }
            Kind::Protocol => {
                self.parse_on_server(stmt.id, &stmt.definition, false, out);
                out.put_slice(&[frontend::SYNC, 0, 0, 0, 4]);
            }
        }
        own
    }

    /// A Bind of the client's statement `name` (the unnamed one too)
    /// supplying `supplied` parameters, in a failed transaction block,
    /// where this server connection lacks the statement: PostgreSQL
    /// checks the parameter count before the block's state, so a wrong
    /// count is its 08P01, not the 25P02 that preparing the statement
    /// again here would meet. When
    /// it is, writes a stand-in that fails on the server naming
    /// [`super::flow::REFUSED_MARKER`] (skipping the rest of the batch, as
    /// directly) and returns the error to answer in its place; the caller
    /// writes the Bind after it, unchanged.
    pub fn refuse_miscounted_bind(
        &mut self,
        name: &str,
        supplied: usize,
        out: &mut BytesMut,
    ) -> Option<PgError> {
        let definition: &[u8] = if name.is_empty() {
            // The unnamed statement: unless the server will hold the
            // client's, it would be parsed again here.
            self.statements.sync_unnamed(self.plan);
            let expected = self.plan.unnamed.expected(self.prepared);
            let unnamed = self.statements.unnamed.as_ref()?;
            if expected == Some(unnamed.token) {
                return None;
            }
            &unnamed.definition
        } else {
            let stmt = self.statements.get(name)?;
            if stmt.kind != Kind::Protocol || self.prepared.get(&stmt.id).is_some() {
                return None;
            }
            &stmt.definition
        };
        let (text, types) = split_cstr(definition).ok()?;
        let declared = usize::from(u16::from_be_bytes([*types.first()?, *types.get(1)?]));
        let required = sql_scan::parameter_count(text.as_bytes(), declared);
        if required == supplied {
            return None;
        }
        self.refusal_stand_in(out);
        Some(PgError::error(
            crate::protocol::error::sqlstate::PROTOCOL_VIOLATION,
            format!(
                "bind message supplies {supplied} parameters, but prepared statement \"{}\" requires {required}",
                crate::protocol::error::shown_name(name)
            ),
        ))
    }

    /// In place of a message usher refuses after the flow passed it for a
    /// rewrite: messages that fail on the server naming
    /// [`super::flow::REFUSED_MARKER`] (the rest of the batch is skipped,
    /// as directly), whose error the caller replaces with its own
    /// (`Flow::refused_rewrite`). Nothing of the client's goes to the
    /// server, and nothing is made there.
    pub fn refusal_stand_in(&mut self, out: &mut BytesMut) {
        // A transaction-exit statement is made in a failed block; made a
        // second time under the same name, it fails with 42P05 naming the
        // marker.
        let marker = super::flow::REFUSED_MARKER;
        let parse_marker = |out: &mut BytesMut| {
            let start = begin(out, frontend::PARSE);
            put_cstr(out, marker);
            put_cstr(out, "ROLLBACK");
            out.put_u16(0);
            finish(out, start);
        };
        put_close(out, marker);
        self.plan.expect(Expect::Drop);
        parse_marker(out);
        self.plan.expect(Expect::Drop);
        // Its 42P05 is replaced by the refusal.
        parse_marker(out);
    }

    /// Writes the start of a Bind of the client's statement `name`: a
    /// Parse first if this server connection lacks it, then the Bind's
    /// header (its length counting the `rest` bytes of parameters that
    /// follow unchanged), the portal and the server-side name. The
    /// parameters need not be held: they stream after it.
    pub fn rewrite_bind_head(&mut self, portal: &str, name: &str, rest: usize, out: &mut BytesMut) {
        let name = self.prepare_if_needed(name, out);
        out.put_u8(frontend::BIND);
        out.put_u32((4 + portal.len() + 1 + name.len() + 1 + rest) as u32);
        put_cstr(out, portal);
        put_cstr(out, &name);
    }

    /// The server-side name for the client's statement `name`, preparing it
    /// on this server connection first if needed. Unknown names pass
    /// through, so the server reports them as it would directly.
    fn prepare_if_needed(&mut self, name: &str, out: &mut BytesMut) -> String {
        if name.is_empty() {
            self.unnamed_present(out);
            return String::new();
        }
        let Some(stmt) = self.statements.get(name).cloned() else {
            return name.to_string();
        };
        if self.prepared.get(&stmt.id).is_none() && stmt.kind == Kind::Sql {
            // A SQL-prepared statement has no Parse form (its parameter
            // types are names): bound at the protocol level, it works only
            // where the connection has it; elsewhere the server says 26000.
            return name.to_string();
        }
        if self.prepared.get(&stmt.id).is_none() {
            self.parse_on_server(stmt.id, &stmt.definition, false, out);
        }
        if !self.plan.used.contains(&stmt.id) {
            self.plan.used.push(stmt.id);
        }
        server_name(stmt.id)
    }

    /// Before a Bind or Describe of the unnamed statement: unless the
    /// server will hold the client's, parse it again (unseen), or close
    /// the server's when the client has none (the server then answers
    /// 26000, as directly).
    fn unnamed_present(&mut self, out: &mut BytesMut) {
        self.statements.sync_unnamed(self.plan);
        let expected = self.plan.unnamed.expected(self.prepared);
        match &self.statements.unnamed {
            Some(u) if expected == Some(u.token) => {}
            Some(u) => {
                put_parse(out, "", &u.definition);
                let after = Some(u.token);
                self.plan.unnamed_sent(By::UsherParse, after, None);
            }
            None => {
                put_close(out, "");
                self.plan.unnamed_sent(By::UsherClose, None, None);
            }
        }
    }

    fn parse_on_server(&mut self, id: u64, definition: &[u8], forward: bool, out: &mut BytesMut) {
        put_parse(out, &server_name(id), definition);
        self.prepared.put(id, ());
        self.plan.expect(Expect::Prepared { id, forward });
    }
}

/// What [`Rewriter::rewrite_query`] did with a client's Query, for the
/// flow to track its answers.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct QueryRewrite {
    /// usher's own segments, sent before the client's Query (a PREPARE
    /// Query, or a Parse + Sync, per statement the connection lacks): their
    /// answers are dropped, and when one fails, so is the error the
    /// client's Query then gets.
    pub own: Vec<Segment>,
    /// The client's Query as it went.
    pub client: Segment,
    /// Refused with this error: the refusal's stand-in goes in its place.
    pub refused: Option<PgError>,
}

/// One Sync segment (a Query, or usher's Parse + Sync) whose answers the
/// flow adjusts.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Segment {
    /// usher's own: its ReadyForQuery is dropped too.
    pub own: bool,
    /// Its first CommandCompletes are usher's (dropped).
    pub drop_completes: u32,
    /// It PREPAREs a server statement.
    pub prepares: Option<Prepares>,
    /// The client's Query, to run again if its statement turns out stale.
    pub retry: Option<Bytes>,
    /// Where usher's text differs from the client's, in characters, in
    /// order: an error's position is told in the client's text.
    pub edits: Vec<Edit>,
}

/// A span of the text the server got (`server`) that stands for a span of
/// the client's (`client`), in characters from 0.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Edit {
    pub server: std::ops::Range<usize>,
    pub client: std::ops::Range<usize>,
}

/// An error's position (1-based, in characters) in the text the server
/// got, told in the client's text: inside a rewritten span, its start.
pub fn client_position(edits: &[Edit], server: usize) -> usize {
    let at = server.saturating_sub(1);
    let mut shift: isize = 0;
    for e in edits {
        if at < e.server.start {
            break;
        }
        if at < e.server.end {
            return e.client.start + 1;
        }
        shift = e.client.end as isize - e.server.end as isize;
    }
    (at as isize + shift).max(0) as usize + 1
}

fn chars(bytes: &[u8]) -> usize {
    String::from_utf8_lossy(bytes).chars().count()
}

/// A PREPARE of server statement `id` in a segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prepares {
    pub id: u64,
    /// The client's name for it (forgotten if the PREPARE fails).
    pub name: Option<String>,
    /// A `DEALLOCATE` of it comes first (the connection had it).
    pub after_deallocate: bool,
}

fn split_cstr(body: &[u8]) -> Result<(&str, &[u8]), PgError> {
    let end = body
        .iter()
        .position(|b| *b == 0)
        .ok_or_else(|| PgError::protocol("invalid message: name is not terminated"))?;
    let name = std::str::from_utf8(&body[..end])
        .map_err(|_| PgError::protocol("invalid message: name is not UTF-8"))?;
    Ok((name, &body[end + 1..]))
}

fn begin(out: &mut BytesMut, tag: u8) -> usize {
    let start = out.len();
    out.put_u8(tag);
    out.put_u32(0);
    start
}

fn finish(out: &mut BytesMut, start: usize) {
    let len = (out.len() - start - 1) as u32;
    out[start + 1..start + 5].copy_from_slice(&len.to_be_bytes());
}

fn put_cstr(out: &mut BytesMut, s: &str) {
    out.put_slice(s.as_bytes());
    out.put_u8(0);
}

/// A Parse of `name` with `definition` (query text, NUL, parameter types).
fn put_parse(out: &mut BytesMut, name: &str, definition: &[u8]) {
    let start = begin(out, frontend::PARSE);
    put_cstr(out, name);
    out.put_slice(definition);
    finish(out, start);
}

fn put_close(out: &mut BytesMut, name: &str) {
    let start = begin(out, frontend::CLOSE);
    out.put_u8(target::STATEMENT);
    put_cstr(out, name);
    finish(out, start);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_are_charged_beyond_their_free_part_and_give_it_back() {
        let budget = Arc::new(BufferBudget::default());
        let mut s = ClientStatements::default();
        let statement = |n: usize| Statement {
            id: 1,
            definition: Bytes::from(vec![b'x'; n]),
            kind: Kind::Protocol,
        };
        let half = FREE_STATEMENT_BYTES / 2;
        // Within the free part: nothing charged.
        assert!(s.make_room(statement_bytes("a", &[0; 1000]), &budget, 1 << 20));
        s.insert("a".into(), statement(1000));
        assert_eq!(s.bytes(), statement_bytes("a", &[0; 1000]));
        assert_eq!(budget.used(), 0);
        // Past it: charged, up to the limit.
        let big = statement_bytes("b", &vec![0; half * 3]);
        assert!(!s.make_room(big, &budget, half / 2), "past the limit");
        assert_eq!(budget.used(), 0, "nothing charged for a refusal");
        assert!(s.make_room(big, &budget, 1 << 30));
        s.insert("b".into(), statement(half * 3));
        assert_eq!(budget.used(), s.bytes() - FREE_STATEMENT_BYTES);
        // The same name again replaces it: charged once.
        s.insert("b".into(), statement(half * 2));
        assert_eq!(
            s.bytes(),
            statement_bytes("a", &[0; 1000]) + statement_bytes("b", &vec![0; half * 2])
        );
        assert_eq!(budget.used(), s.bytes() - FREE_STATEMENT_BYTES);
        // A Close gives back; an undone Close charges again.
        s.remove("b");
        assert_eq!(budget.used(), 0);
        s.insert("b".into(), statement(half * 3));
        assert_eq!(budget.used(), s.bytes() - FREE_STATEMENT_BYTES);
        // DISCARD ALL, or the client leaving, gives everything back.
        s.clear();
        assert_eq!((s.bytes(), budget.used()), (0, 0));
        assert!(s.make_room(big, &budget, 1 << 30));
        s.insert("c".into(), statement(half * 3));
        assert!(budget.used() > 0);
        drop(s);
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn a_duplicate_parse_is_42p05_with_its_name_escaped() {
        let r = StatementRegistry::default();
        let mut plan = ResponsePlan::default();
        let mut prepared = PreparedSet::unbounded();
        let mut mine = ClientStatements::default();
        let mut out = BytesMut::new();
        let body = b"s\n1\0select 1\0\0\0";
        assert!(duplicate_parse(&mine, frontend::PARSE, body).is_none());
        Rewriter {
            registry: &r,
            statements: &mut mine,
            prepared: &mut prepared,
            plan: &mut plan,
        }
        .rewrite(frontend::PARSE, body, &mut out)
        .unwrap();
        let e = duplicate_parse(&mine, frontend::PARSE, body).expect("a duplicate");
        assert_eq!(e.code, DUPLICATE_PREPARED_STATEMENT);
        assert!(!e.message.contains('\n'), "{}", e.message);
        assert!(duplicate_parse(&mine, frontend::PARSE, b"\0select 1\0\0\0").is_none());
    }

    #[test]
    fn recognises_named_statement_messages() {
        assert!(needs_rewrite(b'P', b"s1\0select 1\0\0\0"));
        assert!(needs_rewrite(b'P', b"\0select 1\0\0\0"), "it is kept");
        assert!(needs_rewrite(b'B', b"\0s1\0rest"));
        assert!(!needs_rewrite(b'B', b"p\0\0rest"));
        assert!(uses_unnamed(b'B', b"p\0\0rest"));
        assert!(!uses_unnamed(b'B', b"p\0s1\0rest"));
        assert!(needs_rewrite(b'D', b"Ss1\0"));
        assert!(!needs_rewrite(b'D', b"Pp1\0"));
        assert!(uses_unnamed(b'D', b"S\0"));
        assert!(!uses_unnamed(b'D', b"P\0"));
        assert!(needs_rewrite(b'C', b"Ss1\0"));
        assert!(
            needs_rewrite(b'C', b"S\0"),
            "it drops the unnamed statement"
        );
        assert!(!needs_rewrite(b'C', b"P\0"));
    }

    #[test]
    fn registry_shares_ids_for_identical_statements() {
        let r = StatementRegistry::default();
        let a = r.id_for(&Bytes::from_static(b"select 1\0\0\0"));
        let b = r.id_for(&Bytes::from_static(b"select 1\0\0\0"));
        let c = r.id_for(&Bytes::from_static(b"select 2\0\0\0"));
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_eq!(r.len(), 2);
    }

    #[test]
    fn an_error_naming_usher_s_statement_names_the_client_s() {
        let r = StatementRegistry::default();
        let mut plan = ResponsePlan::default();
        let mut prepared = PreparedSet::unbounded();
        let mut mine = ClientStatements::default();
        let mut out = BytesMut::new();
        Rewriter {
            registry: &r,
            statements: &mut mine,
            prepared: &mut prepared,
            plan: &mut plan,
        }
        .rewrite(frontend::PARSE, b"s1\0select $1\0\0\0", &mut out)
        .unwrap();
        let id = mine.get("s1").unwrap().id;
        let message = format!(
            "bind message supplies 2 parameters, but prepared statement \"usher_{id}\" requires 1"
        );
        let body = [b"SERROR\0C08P01\0M", message.as_bytes(), b"\0\0"].concat();
        assert!(error_names_server_statement(&body));
        let renamed = mine.error_in_client_names(&body, &plan).expect("renamed");
        assert_eq!(
            crate::protocol::messages::error_message(&renamed).unwrap(),
            b"bind message supplies 2 parameters, but prepared statement \"s1\" requires 1"
        );
        let other = b"SERROR\0C08P01\0Mprepared statement \"usher_999\" is odd\0\0";
        assert!(
            mine.error_in_client_names(other, &plan).is_none(),
            "not the client's"
        );
        assert!(!error_names_server_statement(
            b"SERROR\0C22012\0Mdivision by zero\0\0"
        ));
    }

    #[test]
    fn a_parse_after_ddl_is_never_matched_to_a_statement_from_before() {
        let r = StatementRegistry::default();
        let def = b"insert into t values ($1)\0\0\0";
        let before = r.id_for(def);
        assert_eq!(r.id_for(def), before);
        r.schema_changed();
        let after = r.id_for(def);
        assert_ne!(after, before, "prepared afresh");
        assert_eq!(r.id_for(def), after, "and shared again");
    }

    #[test]
    fn a_stale_statement_is_renewed_once_for_everyone() {
        let r = StatementRegistry::default();
        let def = b"select * from t\0\0\0";
        let old = r.id_for(def);
        let mut plan = ResponsePlan::default();
        let mut prepared = PreparedSet::unbounded();
        let mut mine = ClientStatements::default();
        let mut theirs = ClientStatements::default();
        let mut out = BytesMut::new();
        for client in [&mut mine, &mut theirs] {
            let mut w = Rewriter {
                registry: &r,
                statements: client,
                prepared: &mut prepared,
                plan: &mut plan,
            };
            w.rewrite(frontend::PARSE, b"s\0select * from t\0\0\0", &mut out)
                .unwrap();
            w.rewrite_bind_head("", "s", 4, &mut out);
        }
        let used = plan.take_used();
        assert_eq!(used, [old], "the statement bound is what an error is about");
        mine.renew(&used, &r);
        let new = mine.get("s").unwrap().id;
        assert_ne!(new, old);
        assert_eq!(r.id_for(def), new, "a later Parse gets the new id");
        theirs.renew(&used, &r);
        assert_eq!(
            theirs.get("s").unwrap().id,
            new,
            "renewed once, shared again"
        );
    }

    /// The messages in `out`: (tag, body).
    fn messages(out: &[u8]) -> Vec<(u8, Vec<u8>)> {
        let mut list = vec![];
        let mut at = 0;
        while at < out.len() {
            let len = u32::from_be_bytes(out[at + 1..at + 5].try_into().unwrap()) as usize;
            list.push((out[at], out[at + 5..at + 1 + len].to_vec()));
            at += 1 + len;
        }
        list
    }

    #[test]
    fn sql_and_protocol_statements_share_the_clients_names() {
        let r = StatementRegistry::default();
        let mut plan = ResponsePlan::default();
        let mut prepared = PreparedSet::unbounded();
        let mut mine = ClientStatements::default();
        let mut w = Rewriter {
            registry: &r,
            statements: &mut mine,
            prepared: &mut prepared,
            plan: &mut plan,
        };
        let mut out = BytesMut::new();
        // A protocol-level statement EXECUTEd in SQL on a connection that
        // lacks it: a Parse + Sync of usher's own first.
        w.rewrite(frontend::PARSE, b"p\0select 1\0\0\0", &mut out)
            .unwrap();
        w.prepared.clear();
        out.clear();
        let rewrite = w.rewrite_query(b"EXECUTE p\0", false, true, &mut out);
        let sent = messages(&out);
        assert_eq!(
            sent.iter().map(|(t, _)| *t).collect::<Vec<_>>(),
            [frontend::PARSE, frontend::SYNC, frontend::QUERY]
        );
        assert_eq!(sent[0].1, b"usher_1\0select 1\0\0\0");
        assert_eq!(sent[2].1, b"EXECUTE usher_1\0");
        assert!(rewrite.own.len() == 1 && rewrite.own[0].own && rewrite.own[0].prepares.is_none());
        assert_eq!(rewrite.client.retry.as_deref(), Some(&b"EXECUTE p\0"[..]));
        // A SQL statement is not a Parse's: the same text is another one.
        out.clear();
        let rewrite = w.rewrite_query(b"PREPARE s AS select 1\0", false, true, &mut out);
        assert_eq!(messages(&out)[0].1, b"PREPARE usher_2 AS select 1\0");
        assert_eq!(
            rewrite.client.prepares,
            Some(Prepares {
                id: 2,
                name: Some("s".into()),
                after_deallocate: false
            })
        );
        // Bound at the protocol level, it is usher's name where the
        // connection has it, the client's (26000) where it does not.
        out.clear();
        w.rewrite_bind_head("", "s", 4, &mut out);
        assert!(out.windows(8).any(|x| x == b"usher_2\0"));
        w.prepared.clear();
        out.clear();
        w.rewrite_bind_head("", "s", 4, &mut out);
        assert_eq!(
            messages(&[&out[..], &[0u8; 4][..]].concat())[0].0,
            frontend::BIND
        );
        assert!(out.windows(3).any(|x| x == b"\0s\0"));
        // DEALLOCATE forgets either kind; a name it does not have goes on.
        for name in ["p", "s"] {
            out.clear();
            let rewrite = w.rewrite_query(
                format!("DEALLOCATE {name}\0").as_bytes(),
                false,
                true,
                &mut out,
            );
            assert_eq!(rewrite.client.drop_completes, 1, "{name}");
        }
        assert!(w.statements.is_empty());
        // psycopg 3's DEALLOCATE, an unnamed Parse: a stand-in of usher's.
        w.rewrite(frontend::PARSE, b"t\0select 2\0\0\0", &mut out)
            .unwrap();
        let parse = b"\0DEALLOCATE t\0\0\0";
        assert!(unnamed_deallocate(parse).is_some());
        assert!(unnamed_deallocate(b"\0DEALLOCATE ALL\0\0\0").is_none());
        out.clear();
        *w.plan = ResponsePlan::default();
        w.rewrite(frontend::PARSE, parse, &mut out).unwrap();
        assert_eq!(
            messages(&out),
            [
                (frontend::CLOSE, b"Susher_deallocate\0".to_vec()),
                (frontend::PARSE, b"usher_deallocate\0SELECT\0\0\0".to_vec()),
                (
                    frontend::PARSE,
                    b"\0DEALLOCATE usher_deallocate\0\0\0".to_vec()
                ),
            ]
        );
        assert!(w.statements.is_empty());
        let mut none = PreparedSet::unbounded();
        assert_eq!(
            w.plan.answer(backend::CLOSE_COMPLETE, &mut none),
            Answer::Drop
        );
        assert_eq!(
            w.plan.answer(backend::PARSE_COMPLETE, &mut none),
            Answer::Drop
        );
        assert_eq!(
            w.plan.answer(backend::PARSE_COMPLETE, &mut none),
            Answer::Forward
        );
        out.clear();
        *w.plan = ResponsePlan::default();
        w.plan.rewriting(true);
        w.rewrite(frontend::PARSE, parse, &mut out).unwrap();
        assert_eq!(
            messages(&out),
            [(frontend::PARSE, parse.to_vec())],
            "gone: as it is"
        );
        // Not first in its batch: a marker first, so its error is told
        // from an earlier message's.
        out.clear();
        w.plan.rewriting(false);
        w.rewrite(frontend::PARSE, parse, &mut out).unwrap();
        assert_eq!(
            messages(&out),
            [
                (frontend::CLOSE, b"Susher_absent\0".to_vec()),
                (frontend::PARSE, parse.to_vec())
            ]
        );
        out.clear();
        let rewrite = w.rewrite_query(b"DEALLOCATE p\0", false, true, &mut out);
        assert_eq!(rewrite, QueryRewrite::default());
        assert_eq!(
            messages(&out),
            [(frontend::QUERY, b"DEALLOCATE p\0".to_vec())]
        );
    }
}
