//! Named prepared statements in transaction mode, as the serve loop drives
//! them but without I/O: client Parse/Bind/Describe/Close through the
//! Rewriter, Sync, the server's ParseComplete/CloseComplete/ReadyForQuery
//! through the ResponsePlan, DISCARD ALL, the bound on statements kept per
//! server connection, and changes of server connection between transactions.
#![no_main]
use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use usher::backend::PreparedSet;
use usher::frontend::prepared::{
    needs_rewrite, server_name, ClientStatements, ResponsePlan, Rewriter, StatementRegistry,
};
use usher::protocol::frames::{FrameWalker, Visit};
use usher_fuzz::Input;

/// Checks that `out` is whole messages of the extended protocol.
fn well_formed(out: &[u8]) {
    let mut walker = FrameWalker::new(1 << 20);
    let mut tags = Vec::new();
    let walked = walker
        .walk(
            out,
            |_, _| true,
            |tag, body| {
                tags.push(tag);
                if tag != b'B' {
                    // P, D and C start with a NUL-terminated name (after
                    // the kind byte of D and C).
                    let at = usize::from(tag != b'P');
                    assert!(body[at..].contains(&0), "unterminated name");
                }
                Visit::Forward
            },
        )
        .expect("rewritten messages parse");
    assert_eq!(
        walked.forward,
        out.len(),
        "rewritten output ends mid-message"
    );
    assert!(tags.iter().all(|t| matches!(t, b'P' | b'B' | b'D' | b'C')));
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input(data);
    let registry = StatementRegistry::default();
    let mut statements = ClientStatements::default();
    let mut servers: Vec<PreparedSet> =
        (0..2).map(|_| PreparedSet::unbounded()).collect();
    let mut current = 0;
    let mut plan = ResponsePlan::default();
    let bound = 1 + input.byte() as usize % 8;
    while !input.is_empty() {
        let op = input.byte();
        match op % 8 {
            0..=2 => {
                let tag = [b'P', b'B', b'D', b'C'][(op / 8) as usize % 4];
                let body = input.piece();
                if needs_rewrite(tag, body) {
                    let mut out = BytesMut::new();
                    let result = Rewriter {
                        registry: &registry,
                        statements: &mut statements,
                        prepared: &mut servers[current],
                        plan: &mut plan,
                    }
                    .rewrite(tag, body, &mut out);
                    match result {
                        Ok(()) => well_formed(&out),
                        Err(e) => assert_eq!(e.code, "08P01"),
                    }
                } else if matches!(tag, b'P' | b'C') {
                    plan.passed();
                }
            }
            3 => plan.sync_sent(),
            4 => {
                let tag = if op & 8 == 0 { b'1' } else { b'3' };
                let _ = plan.answer(tag, &mut servers[current]);
            }
            5 => plan.ready(&mut servers[current]),
            6 => {
                // DISCARD ALL / DEALLOCATE ALL went through.
                servers[current].clear();
                statements.clear();
            }
            _ => {
                // The transaction ended: the next one may run on the other
                // connection, which first drops statements beyond the bound.
                plan = ResponsePlan::default();
                current = usize::from(op & 8 != 0);
                let server = &mut servers[current];
                while server.len() > bound {
                    let (id, ()) = server.pop_lru().expect("not empty");
                    assert!(server_name(id).starts_with("usher_"));
                }
            }
        }
        for server in &servers {
            assert!(
                server.len() <= registry.len(),
                "a server holds an unknown statement"
            );
        }
    }
});
