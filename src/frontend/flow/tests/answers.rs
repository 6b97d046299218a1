//! The protocol: releases, pipelines, errors, COPY, DISCARD ALL, resets,
//! the prepared-statement plan.

use super::*;

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
