//! A transaction block whose server connection died (transaction mode,
//! PostgreSQL restarted or failed over under it): the client keeps its
//! connection to usher, and until it ends the block its session answers
//! as PostgreSQL answers in an aborted one. Every statement gets `25P02`
//! ("current transaction is aborted, commands ignored until end of
//! transaction block"; the first the server's own error, `57P01` or
//! `08006`, if the client was not told it yet), and an extended-protocol
//! segment is skipped to its Sync after an error; COMMIT, END, ROLLBACK or
//! ABORT (`sql_scan::ends_transaction`, simple or extended, as
//! `IsTransactionExitStmt` lets them through) answer ROLLBACK and end the
//! block; every ReadyForQuery says 'E' until then, 'I' after.
//!
//! Nothing here reaches a server: the block is gone with its server, and
//! what the client sends until it ends the block is answered here. That
//! keeps a client's statements pipelined behind a lost one (COMMIT among
//! them) from running on a new server connection outside the block they
//! were meant for. No I/O: the session walks the client's messages and
//! writes what [`LostBlock::message`] appends.

use super::sql_scan::ends_transaction;
use crate::protocol::error::sqlstate;
use crate::protocol::messages;
use crate::protocol::tags::{backend, frontend, status, target};
use crate::protocol::PgError;
use bytes::BytesMut;

/// SQLSTATE in_failed_sql_transaction.
const IN_FAILED_TRANSACTION: &str = "25P02";

/// Bodies read whole, to find the statement texts and names in them;
/// larger messages are answered as statements that do not end the block.
pub const BODY_LIMIT: usize = 64 * 1024;

/// What became of the block after a client message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lost {
    /// Still aborted: more messages go to [`LostBlock::message`].
    Aborted,
    /// The client ended the block (its answers are written): the session
    /// goes on as usual with its next message.
    Ended,
    /// The client sent Terminate.
    Left,
}

/// One aborted block's state.
#[derive(Debug)]
pub struct LostBlock {
    /// The server's error, when the client has not been told it (the
    /// server died while the client was idle in its block): its next
    /// statement gets it, as the next statement on a direct connection
    /// would have met the closed connection.
    untold: Option<PgError>,
    /// An error was sent in this extended-protocol segment: the rest of it
    /// is skipped, up to its Sync.
    skipping: bool,
    /// Statements (`""`: the unnamed one) parsed since the loss that end
    /// the block, and portals bound to them.
    exit_statements: Vec<String>,
    exit_portals: Vec<String>,
    /// An Execute of such a portal ran in this segment: its Sync ends the
    /// block.
    ended: bool,
    /// A block is lost. `false`: only the client's extended-protocol
    /// segment that was not synced when the server died, outside a block:
    /// it fails, and its Sync (or the next Query) ends this.
    block: bool,
}

/// Which client messages usher reads whole while a block is lost.
pub fn wants_body(tag: u8, len: usize) -> bool {
    len <= BODY_LIMIT
        && matches!(
            tag,
            frontend::QUERY
                | frontend::PARSE
                | frontend::BIND
                | frontend::DESCRIBE
                | frontend::EXECUTE
                | frontend::CLOSE
        )
}

impl LostBlock {
    /// A lost block (`block`; else only a segment not synced); `untold`:
    /// the server's error if the client has not had it yet (ERROR
    /// severity: the client's connection goes on).
    pub fn new(untold: Option<PgError>, block: bool) -> Self {
        LostBlock {
            untold,
            skipping: false,
            exit_statements: Vec::new(),
            exit_portals: Vec::new(),
            ended: false,
            block,
        }
    }

    /// Ends a segment with ReadyForQuery: 'E' while the block is lost.
    fn ready(&mut self, out: &mut BytesMut) -> Lost {
        if std::mem::take(&mut self.ended) || !self.block {
            messages::ready_for_query(out, status::IDLE);
            Lost::Ended
        } else {
            messages::ready_for_query(out, status::FAILED);
            Lost::Aborted
        }
    }

    /// The error for a statement that does not end the block.
    fn error(&mut self) -> PgError {
        self.untold.take().unwrap_or_else(aborted)
    }

    /// Fails the extended-protocol segment: its error now, the rest of it
    /// skipped to its Sync.
    fn fail_segment(&mut self, out: &mut BytesMut) {
        self.error().encode(out);
        self.skipping = true;
    }

    /// The client's message `tag` (its `body` whole if [`wants_body`]
    /// said so, else empty): appends PostgreSQL's answer in an aborted
    /// block to `out`.
    pub fn message(&mut self, tag: u8, body: &[u8], out: &mut BytesMut) -> Lost {
        match tag {
            frontend::TERMINATE => return Lost::Left,
            frontend::SYNC => {
                self.skipping = false;
                self.exit_statements.clear();
                self.exit_portals.clear();
                return self.ready(out);
            }
            frontend::QUERY => {
                let sql = body.split_last().map_or(&[][..], |(_, text)| text);
                if self.block && !body.is_empty() && ends_transaction(sql) {
                    messages::command_complete(out, "ROLLBACK");
                    self.ended = true;
                } else if self.block && is_blank(sql) && !body.is_empty() {
                    messages::empty_query_response(out);
                } else {
                    self.error().encode(out);
                }
                return self.ready(out);
            }
            frontend::FUNCTION_CALL => {
                self.error().encode(out);
                return self.ready(out);
            }
            _ if self.skipping => {}
            frontend::PARSE => match parse_parts(body) {
                Some((name, sql)) if ends_transaction(sql) => {
                    self.exit_statements.push(name.to_string());
                    messages::empty_message(out, backend::PARSE_COMPLETE);
                }
                _ => self.fail_segment(out),
            },
            frontend::BIND => match bind_names(body) {
                Some((portal, statement))
                    if self.exit_statements.iter().any(|s| s == statement) =>
                {
                    self.exit_portals.push(portal.to_string());
                    messages::empty_message(out, backend::BIND_COMPLETE);
                }
                _ => self.fail_segment(out),
            },
            frontend::DESCRIBE => {
                let (kind, name) = match body.split_first() {
                    Some((kind, rest)) => (*kind, cstr(rest)),
                    None => (0, None),
                };
                let known = match (kind, name) {
                    (target::STATEMENT, Some(n)) => self.exit_statements.iter().any(|s| s == n),
                    (target::PORTAL, Some(n)) => self.exit_portals.iter().any(|p| p == n),
                    _ => false,
                };
                if !known {
                    self.fail_segment(out);
                } else {
                    if kind == target::STATEMENT {
                        messages::no_parameters(out);
                    }
                    messages::empty_message(out, backend::NO_DATA);
                }
            }
            frontend::EXECUTE => match cstr(body) {
                Some(portal) if self.exit_portals.iter().any(|p| p == portal) => {
                    messages::command_complete(out, "ROLLBACK");
                    self.ended = true;
                }
                _ => self.fail_segment(out),
            },
            frontend::CLOSE => messages::empty_message(out, backend::CLOSE_COMPLETE),
            // Flush: the answers go out as they are made. COPY data
            // (no COPY is on) and anything else: nothing, as PostgreSQL
            // ignores COPY messages outside a COPY.
            _ => {}
        }
        Lost::Aborted
    }
}

/// PostgreSQL's error for a statement in an aborted block.
pub fn aborted() -> PgError {
    PgError::error(
        IN_FAILED_TRANSACTION,
        "current transaction is aborted, commands ignored until end of transaction block",
    )
}

/// The C string at the start of `body`, if it is one (UTF-8 or not, names
/// are compared as bytes).
fn cstr(body: &[u8]) -> Option<&str> {
    let end = body.iter().position(|b| *b == 0)?;
    std::str::from_utf8(&body[..end]).ok()
}

/// A Parse's statement text.
pub fn parse_text(body: &[u8]) -> Option<&[u8]> {
    parse_parts(body).map(|(_, text)| text)
}

/// A Parse's statement name and text.
fn parse_parts(body: &[u8]) -> Option<(&str, &[u8])> {
    let name = cstr(body)?;
    let rest = &body[name.len() + 1..];
    let end = rest.iter().position(|b| *b == 0)?;
    Some((name, &rest[..end]))
}

/// A Bind's portal and statement names.
fn bind_names(body: &[u8]) -> Option<(&str, &str)> {
    let portal = cstr(body)?;
    let statement = cstr(&body[portal.len() + 1..])?;
    Some((portal, statement))
}

/// Only whitespace and semicolons (an empty query).
fn is_blank(sql: &[u8]) -> bool {
    sql.iter().all(|b| b.is_ascii_whitespace() || *b == b';')
}

/// The error a client is told in place of the server's when its server
/// connection died under a statement: the server's own fields (its FATAL
/// 57P01 at a fast shutdown), as ERROR, since the client's connection to
/// usher stays; or 08006 when the server said nothing.
pub fn server_died(server: Option<PgError>) -> PgError {
    let mut e = server.unwrap_or_else(|| {
        PgError::error(
            sqlstate::CONNECTION_FAILURE,
            "server closed the connection unexpectedly",
        )
    });
    e.severity = crate::protocol::Severity::Error;
    let ours = "usher's connection to the server ended with it; the client's connection to usher stays, and its next transaction gets a new server connection";
    e.detail = Some(match e.detail.take() {
        Some(d) => format!("{d}; {ours}"),
        None => ours.to_string(),
    });
    e
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The messages in `out`, as (tag, body).
    fn answers(out: &BytesMut) -> Vec<(u8, Vec<u8>)> {
        let mut v = Vec::new();
        let mut rest = &out[..];
        while rest.len() >= 5 {
            let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
            v.push((rest[0], rest[5..1 + len].to_vec()));
            rest = &rest[1 + len..];
        }
        v
    }

    fn tags(out: &BytesMut) -> String {
        answers(out)
            .iter()
            .map(|(t, b)| match t {
                b'Z' => format!("Z{}", b[0] as char),
                b'E' => format!("E{}", code(b)),
                t => (*t as char).to_string(),
            })
            .collect::<Vec<_>>()
            .join(" ")
    }

    fn code(body: &[u8]) -> String {
        String::from_utf8_lossy(messages::error_code(body).unwrap()).into()
    }

    fn query(sql: &str) -> Vec<u8> {
        let mut b = sql.as_bytes().to_vec();
        b.push(0);
        b
    }

    fn parse(name: &str, sql: &str) -> Vec<u8> {
        let mut b = name.as_bytes().to_vec();
        b.push(0);
        b.extend_from_slice(sql.as_bytes());
        b.extend_from_slice(&[0, 0, 0]);
        b
    }

    fn bind(portal: &str, statement: &str) -> Vec<u8> {
        let mut b = portal.as_bytes().to_vec();
        b.push(0);
        b.extend_from_slice(statement.as_bytes());
        b.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0]);
        b
    }

    #[test]
    fn statements_fail_until_the_client_rolls_back() {
        let told = PgError::error("57P01", "terminating connection");
        let mut block = LostBlock::new(Some(told), true);
        let mut out = BytesMut::new();
        // The first statement gets the server's error, the next 25P02.
        assert_eq!(
            block.message(b'Q', &query("INSERT 1"), &mut out),
            Lost::Aborted
        );
        assert_eq!(
            block.message(b'Q', &query("COMMIT; SELECT 1"), &mut out),
            Lost::Aborted
        );
        assert_eq!(block.message(b'Q', &query(" ; "), &mut out), Lost::Aborted);
        assert_eq!(tags(&out), "E57P01 ZE E25P02 ZE I ZE");
        out.clear();
        assert_eq!(block.message(b'Q', &query("commit"), &mut out), Lost::Ended);
        assert_eq!(tags(&out), "C ZI");
        assert_eq!(answers(&out)[0].1, b"ROLLBACK\0");
    }

    #[test]
    fn an_extended_segment_is_skipped_after_its_error_and_a_rollback_goes_through() {
        let mut block = LostBlock::new(None, true);
        let mut out = BytesMut::new();
        for (tag, body) in [
            (b'P', parse("", "INSERT INTO t VALUES (1)")),
            (b'B', bind("", "")),
            (b'E', b"\0\0\0\0\0".to_vec()),
            (b'S', vec![]),
        ] {
            assert_eq!(block.message(tag, &body, &mut out), Lost::Aborted);
        }
        assert_eq!(tags(&out), "E25P02 ZE");
        out.clear();
        // pgjdbc's rollback: unnamed Parse, Bind, Describe, Execute, Sync.
        let mut last = Lost::Aborted;
        for (tag, body) in [
            (b'P', parse("", "ROLLBACK")),
            (b'B', bind("", "")),
            (b'D', b"P\0".to_vec()),
            (b'E', b"\0\0\0\0\0".to_vec()),
            (b'S', vec![]),
        ] {
            last = block.message(tag, &body, &mut out);
        }
        assert_eq!(last, Lost::Ended);
        assert_eq!(tags(&out), "1 2 n C ZI");
    }

    #[test]
    fn outside_a_block_only_the_segment_not_synced_fails() {
        let told = PgError::error("57P01", "terminating connection");
        let mut block = LostBlock::new(Some(told), false);
        let mut out = BytesMut::new();
        assert_eq!(block.message(b'E', b"\0\0\0\0\0", &mut out), Lost::Aborted);
        assert_eq!(block.message(b'S', &[], &mut out), Lost::Ended);
        assert_eq!(tags(&out), "E57P01 ZI");
    }

    #[test]
    fn terminate_and_the_error_in_place_of_the_servers() {
        let mut block = LostBlock::new(None, true);
        assert_eq!(block.message(b'X', &[], &mut BytesMut::new()), Lost::Left);
        let e = server_died(Some(PgError::fatal(
            "57P01",
            "terminating connection due to administrator command",
        )));
        assert_eq!(
            (e.severity, e.code.as_str()),
            (crate::protocol::Severity::Error, "57P01")
        );
        assert_eq!(server_died(None).code, "08006");
    }
}
