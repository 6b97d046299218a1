//! SQL-level prepared statements carried in transaction mode, stale
//! statements retried or replayed, error positions.

use super::*;

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
            format!("SERROR\0C42703\0Mcolumn \"{REFUSED_MARKER}\" does not exist\0\0").as_bytes(),
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
    let segment = |h: &mut Harness, rewrite: &mut dyn FnMut(&mut Harness, &[u8]), tail: &[u8]| {
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
