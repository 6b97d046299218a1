//! The flow's unit tests: a flow fed byte fixtures the way the serve
//! loop feeds it (`Harness`), and the helpers the groups share.

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

mod answers;
mod carried_statements;
mod pin_steps;

/// A flow given back and taken again is as a new one, with the new
/// client's settings, whatever transactions it went through.
#[test]
fn a_flow_taken_again_is_as_new() {
    let mut h = Harness::new(PoolMode::Transaction, true);
    for sql in ["select 1", "begin; select 2; commit", "select 3"] {
        transaction(&mut h, sql);
    }
    let used = format!("{:?}", h.flow);
    let new = format!("{:?}", Flow::new(PoolMode::Session, false, Pinning::Off));
    assert_ne!(
        used, new,
        "the transactions left the flow as new: the test shows nothing"
    );
    Box::new(h.flow).give_back();
    let taken = Flow::take(PoolMode::Session, false, Pinning::Off);
    assert_eq!(format!("{taken:?}"), new);
}
