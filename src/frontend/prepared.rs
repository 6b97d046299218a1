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

use crate::protocol::PgError;
use bytes::{BufMut, Bytes, BytesMut};
use dashmap::DashMap;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};

/// The ids of usher's statements one server connection holds, least
/// recently used first (`ServerConn::prepared`). The rewriter and the plan
/// need only this of the connection, so they run without I/O (and fuzz).
pub type ServerStatements = lru::LruCache<u64, ()>;

/// A statement name no server connection ever holds.
const ABSENT_STATEMENT: &str = "usher_absent";

/// Ids for distinct statements (query text + parameter types), shared by all
/// clients so that identical statements share a server-side name.
#[derive(Debug, Default)]
pub struct StatementRegistry {
    ids: DashMap<Bytes, u64>,
    next: AtomicU64,
}

impl StatementRegistry {
    fn id_for(&self, definition: &Bytes) -> u64 {
        if let Some(id) = self.ids.get(definition) {
            return *id;
        }
        *self
            .ids
            .entry(definition.clone())
            .or_insert_with(|| self.next.fetch_add(1, Ordering::Relaxed) + 1)
    }

    /// Distinct statements seen so far.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

/// The server-side name of statement `id`.
pub fn server_name(id: u64) -> String {
    format!("usher_{id}")
}

/// A client's named statement.
#[derive(Debug, Clone)]
struct Statement {
    id: u64,
    /// The Parse body after the name: query text, NUL, parameter types.
    definition: Bytes,
}

/// The named statements one client has prepared.
#[derive(Debug, Default)]
pub struct ClientStatements {
    by_name: HashMap<String, Statement>,
}

impl ClientStatements {
    /// DISCARD ALL / DEALLOCATE ALL: the client's statements are gone.
    pub fn clear(&mut self) {
        self.by_name.clear();
    }

    /// Statements the client has now (SHOW CLIENTS' prepared_statements).
    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }
}

/// What to do with a ParseComplete or CloseComplete from the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    Forward,
    Drop,
    /// Send ParseComplete instead.
    AsParseComplete,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// The client's own Parse or Close.
    Pass,
    /// A Close standing in for a Parse the server did not need.
    ParseAsClose,
    /// A Parse of server statement `id`; `forward` if the client asked for it.
    Prepared { id: u64, forward: bool },
}

/// The ParseComplete/CloseComplete answers owed by one server connection
/// during one checkout.
#[derive(Debug, Default)]
pub struct ResponsePlan {
    /// (Syncs sent before it, what to do with its answer).
    owed: VecDeque<(u64, Expect)>,
    syncs_sent: u64,
    ready_seen: u64,
}

impl ResponsePlan {
    /// A Sync or Query went to the server.
    pub fn sync_sent(&mut self) {
        self.syncs_sent += 1;
    }

    /// The client's own Parse or Close went to the server unchanged.
    pub fn passed(&mut self) {
        self.owed.push_back((self.syncs_sent, Expect::Pass));
    }

    fn expect(&mut self, e: Expect) {
        self.owed.push_back((self.syncs_sent, e));
    }

    /// ReadyForQuery: whatever was owed for that Sync will not come.
    pub fn ready(&mut self, server: &mut ServerStatements) {
        self.ready_seen += 1;
        self.forget_stale(server);
    }

    fn forget_stale(&mut self, server: &mut ServerStatements) {
        while let Some(&(segment, e)) = self.owed.front() {
            if segment >= self.ready_seen {
                break;
            }
            self.owed.pop_front();
            if let Expect::Prepared { id, .. } = e {
                // Skipped after an error: the server does not have it.
                server.pop(&id);
            }
        }
    }

    /// The server sent ParseComplete ('1') or CloseComplete ('3').
    pub fn answer(&mut self, tag: u8, server: &mut ServerStatements) -> Answer {
        self.forget_stale(server);
        match (tag, self.owed.pop_front().map(|(_, e)| e)) {
            (b'1', Some(Expect::Prepared { forward: false, .. })) => Answer::Drop,
            (b'3', Some(Expect::ParseAsClose)) => Answer::AsParseComplete,
            (_, Some(_)) => Answer::Forward,
            (_, None) => {
                tracing::warn!(tag = %(tag as char), "unexpected answer from server; passing it on");
                Answer::Forward
            }
        }
    }
}

/// True if this client message names a statement and needs rewriting.
/// `body` is the whole message body.
pub fn needs_rewrite(tag: u8, body: &[u8]) -> bool {
    match tag {
        b'P' => body.first().is_some_and(|b| *b != 0),
        b'B' => {
            // portal name, then statement name
            let Some(end) = body.iter().position(|b| *b == 0) else {
                return false;
            };
            body.get(end + 1).is_some_and(|b| *b != 0)
        }
        b'D' => body.first() == Some(&b'S') && body.get(1).is_some_and(|b| *b != 0),
        b'C' => body.first() == Some(&b'S') && body.get(1).is_some_and(|b| *b != 0),
        _ => false,
    }
}

/// Everything one rewrite needs.
pub struct Rewriter<'a> {
    pub registry: &'a StatementRegistry,
    pub statements: &'a mut ClientStatements,
    /// The statements the server connection holds.
    pub server: &'a mut ServerStatements,
    pub plan: &'a mut ResponsePlan,
}

impl Rewriter<'_> {
    /// Rewrites one client message for which [`needs_rewrite`] said yes,
    /// appending what to send to the server to `out`.
    pub fn rewrite(&mut self, tag: u8, body: &[u8], out: &mut BytesMut) -> Result<(), PgError> {
        match tag {
            b'P' => {
                let (name, rest) = split_cstr(body)?;
                let definition = Bytes::copy_from_slice(rest);
                let id = self.registry.id_for(&definition);
                self.statements.by_name.insert(
                    name.to_string(),
                    Statement {
                        id,
                        definition: definition.clone(),
                    },
                );
                if self.server.get(&id).is_some() {
                    put_close(out, ABSENT_STATEMENT);
                    self.plan.expect(Expect::ParseAsClose);
                } else {
                    self.parse_on_server(id, &definition, true, out);
                }
            }
            b'B' => {
                let (portal, rest) = split_cstr(body)?;
                let (name, params) = split_cstr(rest)?;
                let name = self.prepare_if_needed(name, out);
                let start = begin(out, b'B');
                put_cstr(out, portal);
                put_cstr(out, &name);
                out.put_slice(params);
                finish(out, start);
            }
            b'D' => {
                let (name, _) = split_cstr(&body[1..])?;
                let name = self.prepare_if_needed(name, out);
                let start = begin(out, b'D');
                out.put_u8(b'S');
                put_cstr(out, &name);
                finish(out, start);
            }
            b'C' => {
                // The server never saw the client's name: closing it there is
                // harmless and answers CloseComplete, as the client expects.
                let (name, _) = split_cstr(&body[1..])?;
                self.statements.by_name.remove(name);
                let start = begin(out, b'C');
                out.put_slice(body);
                finish(out, start);
                self.plan.passed();
            }
            _ => unreachable!("needs_rewrite admits only P, B, D and C"),
        }
        Ok(())
    }

    /// The server-side name for the client's statement `name`, preparing it
    /// on this server connection first if needed. Unknown names pass
    /// through, so the server reports them as it would directly.
    fn prepare_if_needed(&mut self, name: &str, out: &mut BytesMut) -> String {
        let Some(stmt) = self.statements.by_name.get(name).cloned() else {
            return name.to_string();
        };
        if self.server.get(&stmt.id).is_none() {
            self.parse_on_server(stmt.id, &stmt.definition, false, out);
        }
        server_name(stmt.id)
    }

    fn parse_on_server(&mut self, id: u64, definition: &[u8], forward: bool, out: &mut BytesMut) {
        let start = begin(out, b'P');
        put_cstr(out, &server_name(id));
        out.put_slice(definition);
        finish(out, start);
        self.server.put(id, ());
        self.plan.expect(Expect::Prepared { id, forward });
    }
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

fn put_close(out: &mut BytesMut, name: &str) {
    let start = begin(out, b'C');
    out.put_u8(b'S');
    put_cstr(out, name);
    finish(out, start);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognises_named_statement_messages() {
        assert!(needs_rewrite(b'P', b"s1\0select 1\0\0\0"));
        assert!(!needs_rewrite(b'P', b"\0select 1\0\0\0"));
        assert!(needs_rewrite(b'B', b"\0s1\0rest"));
        assert!(!needs_rewrite(b'B', b"p\0\0rest"));
        assert!(needs_rewrite(b'D', b"Ss1\0"));
        assert!(!needs_rewrite(b'D', b"Pp1\0"));
        assert!(needs_rewrite(b'C', b"Ss1\0"));
        assert!(!needs_rewrite(b'C', b"S\0"));
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
}
