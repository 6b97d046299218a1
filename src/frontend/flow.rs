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
//! The serve loop (`session.rs`) only moves bytes: it walks them with a
//! `FrameWalker`, hands each message to the flow, and acts on the
//! [`ClientStep`] or [`ServerStep`] it returns. The unit tests below drive
//! a flow with byte fixtures, as `protocol/frames.rs` is tested.

use super::prepared::{self, Answer, ResponsePlan};
use super::sql_scan::{self, Effects};
use crate::backend::PreparedSet;
use crate::config::PoolMode;
use crate::protocol::messages;
use crate::protocol::tags::{backend, frontend, status};

/// Server ErrorResponses up to this size are read whole for their SQLSTATE.
pub const ERROR_BODY_LIMIT: usize = 64 * 1024;

/// The SQLSTATE of "cached plan must not change result type" (also used
/// for other unsupported features: a false alarm costs a re-prepare).
const STALE_STATEMENT: &[u8] = b"0A000";

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
    /// Send ParseComplete instead (a Close that stood in for a Parse the
    /// server did not need).
    SendParseComplete,
}

/// Something a server message told, for the session to record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Note {
    /// ParameterStatus: the server's value of a reported parameter.
    Parameter { name: String, value: String },
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
    /// have done to the session (settings changed).
    effects: Effects,
}

impl Flow {
    pub fn new(mode: PoolMode, rewriting: bool) -> Self {
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
            frontend::PARSE => head.first().map(|b| *b != 0),
            frontend::BIND => prepared::bind_names(head).map(|_| false),
            frontend::DESCRIBE | frontend::CLOSE => Some(true),
            _ => Some(false),
        }
    }

    /// A client message (whole, or its head if it streams).
    pub fn client_message(&mut self, tag: u8, body: &[u8]) -> ClientStep {
        match tag {
            frontend::TERMINATE => return ClientStep::Terminate,
            frontend::QUERY | frontend::SYNC | frontend::FUNCTION_CALL => {
                if tag == frontend::QUERY {
                    self.queries += 1;
                    self.effects.add(sql_scan::scan_query(body));
                }
                self.pending += 1;
                self.unsynced = false;
                self.plan.sync_sent();
            }
            frontend::COPY_DONE | frontend::COPY_FAIL => self.copy_in = false,
            frontend::FLUSH | frontend::COPY_DATA => {}
            frontend::PARSE | frontend::BIND | frontend::DESCRIBE | frontend::CLOSE
                if self.rewriting && prepared::needs_rewrite(tag, body) =>
            {
                if tag == frontend::PARSE {
                    self.effects.add(sql_scan::scan_parse(body));
                }
                return ClientStep::Rewrite;
            }
            _ => {
                self.unsynced = true;
                self.queries += u64::from(tag == frontend::EXECUTE);
                if tag == frontend::PARSE {
                    self.effects.add(sql_scan::scan_parse(body));
                }
                if self.rewriting && matches!(tag, frontend::PARSE | frontend::CLOSE) {
                    // Its ParseComplete/CloseComplete goes to the client.
                    self.plan.passed();
                }
            }
        }
        ClientStep::Forward
    }

    /// A rewritten message went to the server in place of the client's.
    pub fn rewritten(&mut self) {
        self.unsynced = true;
    }

    /// What `prepared::Rewriter` records its owed answers in.
    pub fn plan_mut(&mut self) -> &mut ResponsePlan {
        &mut self.plan
    }

    /// usher sent a Sync of its own (closing a pipeline a client left).
    pub fn sync_added(&mut self) {
        self.pending += 1;
        self.unsynced = false;
        self.plan.sync_sent();
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
        let step = match tag {
            backend::COPY_IN_RESPONSE => {
                self.copy_in = true;
                ServerStep::Forward
            }
            backend::READY_FOR_QUERY => {
                self.copy_in = false;
                self.pending = self.pending.saturating_sub(1);
                self.status = body.first().copied().unwrap_or(status::IDLE);
                if self.rewriting {
                    self.plan.ready(prepared);
                }
                if self.status == status::IDLE && self.pending == 0 {
                    note = Some(Note::TransactionDone);
                }
                if self.mode == PoolMode::Transaction
                    && self.status == status::IDLE
                    && self.quiet()
                    && client_at_boundary
                {
                    ServerStep::ForwardThenRelease
                } else {
                    ServerStep::Forward
                }
            }
            backend::PARAMETER_STATUS => {
                note = messages::parse_parameter_status(body)
                    .map(|(name, value)| Note::Parameter { name, value });
                ServerStep::Forward
            }
            backend::COMMAND_COMPLETE => {
                let discard_all = body == b"DISCARD ALL\0";
                if discard_all || body == b"DEALLOCATE ALL\0" {
                    prepared.clear();
                    self.discarded |= discard_all;
                    note = Some(Note::StatementsDropped { discard_all });
                }
                ServerStep::Forward
            }
            backend::PARSE_COMPLETE | backend::CLOSE_COMPLETE if self.rewriting => {
                match self.plan.answer(tag, prepared) {
                    Answer::Forward => ServerStep::Forward,
                    Answer::Drop => ServerStep::Drop,
                    Answer::AsParseComplete => ServerStep::SendParseComplete,
                }
            }
            backend::ERROR_RESPONSE => {
                self.server_fatal |= messages::error_is_fatal(body);
                let code = messages::error_code(body).unwrap_or_default();
                let stale = if self.rewriting && code == STALE_STATEMENT {
                    self.plan.take_used()
                } else {
                    Vec::new()
                };
                note = Some(Note::Error {
                    code: code.to_vec(),
                    stale,
                });
                ServerStep::Forward
            }
            _ => ServerStep::Forward,
        };
        (step, note)
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

    /// The session reads its settings back: the custom settings the
    /// client's statements named, to ask for by name.
    pub fn settled(&mut self) -> Vec<String> {
        std::mem::take(&mut self.effects).custom
    }

    /// Queries seen since last asked.
    pub fn take_queries(&mut self) -> u64 {
        std::mem::take(&mut self.queries)
    }

    /// The server connection went back: what is owed for it is forgotten.
    pub fn released(&mut self) {
        self.plan = ResponsePlan::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frontend::prepared::{ClientStatements, Rewriter, StatementRegistry};
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
                flow: Flow::new(mode, rewriting),
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
                        matches!(s, ServerStep::Drop | ServerStep::SendParseComplete)
                    })
                {
                    rest = &rest[5..]; // the answer replaced or dropped (no body)
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
                value: "x".into()
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
        // The same Parse again on a server that has it: a Close stands in.
        assert_eq!(h.client(&parse), [ClientStep::Rewrite]);
        let out = rewrite(&mut h, &mut statements, &parse);
        assert_eq!(out[0], frontend::CLOSE);
        h.client(&msg(frontend::SYNC, b""));
        let got = h.server(&cat(&[
            msg(backend::CLOSE_COMPLETE, b""),
            ready(status::IDLE),
        ]));
        assert_eq!(
            steps(&got),
            [ServerStep::SendParseComplete, ForwardThenRelease]
        );
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
        assert!(h.flow.settled().is_empty());
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
        assert_eq!(h.flow.settled(), ["myapp.tenant"]);
    }
}
