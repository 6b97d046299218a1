//! The client's unnamed statement in transaction mode.
//!
//! PostgreSQL keeps one unnamed statement per session: an unnamed Parse
//! replaces it (one the server refuses leaves none), a simple Query or a
//! Close of it drops it, and a Bind or Describe of it uses it. In
//! transaction mode a client's batches may run on different server
//! connections, and between two of its batches another client may replace
//! the unnamed statement of the connection it gets. So usher keeps each
//! client's unnamed statement ([`Unnamed`], in `ClientStatements`), and
//! every server connection records whose unnamed statement it holds
//! (`PreparedSet::unnamed`, the token of the client's Parse). Before a Bind
//! or Describe of the unnamed statement that the server may not hold as the
//! client's, usher parses the client's again, unseen (or, when the client
//! has none, closes the server's, so the server answers 26000 as it would
//! directly).
//!
//! What a message did to the unnamed statement is known only from the
//! server's answers: an unnamed Parse the server refused leaves none, one
//! it skipped after an earlier error in its batch leaves the one before.
//! [`UnnamedTrack`] keeps each message that changes it (an [`Event`], in
//! the response plan's order) until its answer decides, and undoes the
//! client's change where it did not happen. A Bind or Describe in the same
//! batch as the change needs nothing (the server skips it too if the
//! change failed); one in a later batch while the change is undecided
//! waits for the answer ([`Use::Wait`]).

use crate::backend::PreparedSet;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};

/// Tokens of unnamed statements, unique in the process: a server
/// connection's token names exactly one client Parse.
static NEXT_TOKEN: AtomicU64 = AtomicU64::new(1);

/// A client's unnamed statement.
#[derive(Debug, Clone)]
pub struct Unnamed {
    /// The Parse body after the empty name: query text, NUL, parameter
    /// types. (A boxed slice: every idle client keeps this.)
    pub definition: Box<[u8]>,
    pub token: u64,
}

impl Unnamed {
    pub fn new(definition: &[u8]) -> Self {
        Unnamed {
            definition: definition.into(),
            token: NEXT_TOKEN.fetch_add(1, Ordering::Relaxed),
        }
    }
}

/// Who changed the unnamed statement, and how.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum By {
    /// The client's unnamed Parse.
    ClientParse,
    /// The client's Close of its unnamed statement.
    ClientClose,
    /// A message that drops it whatever happens: the client's simple Query
    /// (or a refused unnamed Parse's stand-in).
    Drops,
    /// usher's Parse of the client's statement again.
    UsherParse,
    /// usher's Close of the server's (the client has none).
    UsherClose,
}

impl By {
    /// The client sent it: its answer goes to the client, and it changed
    /// the client's statement when it went out.
    pub fn clients(self) -> bool {
        matches!(self, By::ClientParse | By::ClientClose | By::Drops)
    }
}

/// One message that changes the server's unnamed statement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event {
    pub by: By,
    /// The token the server holds once it is done (`None`: nobody's).
    pub after: Option<u64>,
    /// Its outcome cannot change what a later batch's Bind meets: it
    /// cannot be skipped (first in its batch) nor refused, or a refusal
    /// leaves what usher expects.
    certain: bool,
}

/// How an event ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Answered (ParseComplete, CloseComplete, or the Query's
    /// ReadyForQuery).
    Done,
    /// The server refused it (its error).
    Refused,
    /// Skipped after an earlier error in its batch.
    Skipped,
}

/// What a Bind or Describe of the unnamed statement needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Use {
    /// A change earlier in the same batch: the server holds the client's.
    Here,
    /// Compare the client's with what the server holds, and parse it again
    /// (or close the server's) first if they differ.
    Check,
    /// A change in an earlier batch is undecided: wait for its answer.
    Wait,
}

/// The unnamed-statement events of one server connection's checkout.
#[derive(Debug, Default)]
pub struct UnnamedTrack {
    /// Events sent and not decided.
    pending: u32,
    /// The last event sent: (its batch, the event).
    last: Option<(u64, Event)>,
    /// For each undecided event of the client's (by its number), what the
    /// client's statement was before it, in order.
    befores: VecDeque<(u64, Option<Unnamed>)>,
    /// The client's changes sent and not yet applied to its statement (by
    /// their number; `None`: it has none after it), for the session to
    /// apply in order ([`UnnamedTrack::take_applying`]): a message the flow
    /// forwards changes it without the session stopping there.
    applying: VecDeque<(u64, Option<Unnamed>)>,
    /// Changes numbered so far.
    numbered: u64,
    /// What the client's statement is after an undone change, for the
    /// session ([`UnnamedTrack::take_undone`]).
    undone: Option<Option<Unnamed>>,
    /// The message being rewritten is the first of its batch.
    fresh: bool,
}

impl UnnamedTrack {
    /// Nothing undecided or untaken.
    pub fn is_empty(&self) -> bool {
        self.pending == 0 && self.undone.is_none() && self.applying.is_empty()
    }

    /// The flow is about to rewrite a message: whether it is the first of
    /// its batch.
    pub fn set_fresh(&mut self, fresh: bool) {
        self.fresh = fresh;
    }

    /// The message being rewritten is the first of its batch.
    pub fn fresh(&self) -> bool {
        self.fresh
    }

    /// An event went out in batch `segment`; `now`: the client's statement
    /// after it (a change of the client's, applied by the session).
    pub fn sent(
        &mut self,
        segment: u64,
        by: By,
        after: Option<u64>,
        now: Option<Unnamed>,
    ) -> Event {
        let certain = match by {
            By::ClientParse | By::ClientClose => self.fresh,
            By::Drops | By::UsherClose => true,
            By::UsherParse => false,
        };
        let event = Event { by, after, certain };
        self.pending += 1;
        self.last = Some((segment, event));
        if by.clients() {
            self.numbered += 1;
            self.befores.push_back((self.numbered, None));
            self.applying.push_back((self.numbered, now));
        }
        event
    }

    /// The next of the client's changes to apply, in order;
    /// [`UnnamedTrack::applied`] takes what it replaced.
    pub fn next_applying(&mut self) -> Option<(u64, Option<Unnamed>)> {
        self.applying.pop_front()
    }

    /// As new, keeping what it allocated (a flow's plan is reset at every
    /// transaction's end).
    pub fn reset(&mut self) {
        self.pending = 0;
        self.last = None;
        self.befores.clear();
        self.applying.clear();
        self.undone = None;
        self.numbered = 0;
        self.fresh = false;
    }

    /// Change `number` replaced `before`.
    pub fn applied(&mut self, number: u64, before: Option<Unnamed>) {
        if let Some((_, slot)) = self.befores.iter_mut().find(|(n, _)| *n == number) {
            *slot = before;
        }
    }

    /// An event's answer decided it.
    pub fn decided(&mut self, event: Event, outcome: Outcome, prepared: &mut PreparedSet) {
        self.pending = self.pending.saturating_sub(1);
        let outcome = if event.by == By::Drops {
            // A Query drops the statement before anything can fail.
            Outcome::Done
        } else {
            outcome
        };
        match outcome {
            Outcome::Done => prepared.set_unnamed(event.after),
            Outcome::Refused => prepared.set_unnamed(None),
            Outcome::Skipped => {}
        }
        if !event.by.clients() {
            return;
        }
        let before = self.befores.pop_front().and_then(|(_, b)| b);
        let now = match outcome {
            Outcome::Done => return,
            Outcome::Refused => None,
            Outcome::Skipped => before,
        };
        // A later change of the client's went out on top of this one: it
        // is what the client has, and this is what it replaced.
        match self.befores.front_mut() {
            Some((_, next)) => *next = now,
            None => self.undone = Some(now),
        }
    }

    /// Batches were renumbered (Syncs the server ignored).
    pub fn renumber(&mut self, shift: impl Fn(u64) -> u64) {
        if let Some((segment, _)) = &mut self.last {
            *segment = shift(*segment);
        }
    }

    /// What a Bind or Describe of the unnamed statement in batch `segment`
    /// needs.
    pub fn use_in(&self, segment: u64) -> Use {
        match self.last {
            Some((s, _)) if s == segment => Use::Here,
            Some((_, e)) if self.pending > 0 && !e.certain => Use::Wait,
            _ => Use::Check,
        }
    }

    /// The token the server will hold when the next message runs, if every
    /// message sent so far does what usher expects.
    pub fn expected(&self, prepared: &PreparedSet) -> Option<u64> {
        match self.last {
            Some((_, e)) if self.pending > 0 => e.after,
            _ => prepared.unnamed(),
        }
    }

    /// The client's statement after changes the server did not make (a
    /// refused or skipped Parse or Close).
    pub fn take_undone(&mut self) -> Option<Option<Unnamed>> {
        self.undone.take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set() -> PreparedSet {
        PreparedSet::unbounded()
    }

    #[test]
    fn a_skipped_parse_gives_back_the_statement_before_and_a_refused_one_none() {
        let mut t = UnnamedTrack::default();
        let mut server = set();
        let a = Unnamed::new(b"select 1\0\0\0");
        t.set_fresh(false);
        let e = t.sent(0, By::ClientParse, Some(7), None);
        let (n, _) = t.next_applying().unwrap();
        t.applied(n, Some(a.clone()));
        assert_eq!(t.use_in(1), Use::Wait, "undecided, not first in its batch");
        t.decided(e, Outcome::Skipped, &mut server);
        assert_eq!(t.take_undone().unwrap().unwrap().token, a.token);
        assert_eq!(server.unnamed(), None);

        t.set_fresh(true);
        let e = t.sent(1, By::ClientParse, Some(8), None);
        t.next_applying();
        assert_eq!(t.use_in(1), Use::Here);
        assert_eq!(t.use_in(2), Use::Check, "first in its batch: never skipped");
        t.decided(e, Outcome::Refused, &mut server);
        assert!(t.take_undone().unwrap().is_none());
        assert!(t.is_empty());
    }

    #[test]
    fn a_later_change_absorbs_an_earlier_ones_undo() {
        let mut t = UnnamedTrack::default();
        let mut server = set();
        t.set_fresh(false);
        let first = t.sent(0, By::ClientParse, Some(1), None);
        let query = t.sent(1, By::Drops, None, None);
        assert!(t.next_applying().is_some() && t.next_applying().is_some());
        assert_eq!(t.expected(&server), None);
        t.decided(first, Outcome::Skipped, &mut server);
        assert!(t.take_undone().is_none(), "the Query's drop stands");
        t.decided(query, Outcome::Done, &mut server);
        assert!(t.take_undone().is_none());
        assert!(t.is_empty());
    }

    #[test]
    fn the_server_holds_what_was_answered() {
        let mut t = UnnamedTrack::default();
        let mut server = set();
        server.set_unnamed(Some(3));
        t.set_fresh(true);
        let e = t.sent(0, By::UsherParse, Some(5), None);
        assert_eq!(t.expected(&server), Some(5));
        assert_eq!(t.use_in(1), Use::Wait, "usher's Parse may be refused");
        t.decided(e, Outcome::Done, &mut server);
        assert_eq!(server.unnamed(), Some(5));
        assert_eq!(t.use_in(1), Use::Check);
        let e = t.sent(1, By::UsherParse, Some(5), None);
        t.decided(e, Outcome::Refused, &mut server);
        assert_eq!(server.unnamed(), None);
        assert!(
            t.take_undone().is_none(),
            "usher's own change is not the client's"
        );
    }
}
