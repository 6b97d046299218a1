//! Pinning: what pins, when the server is asked, refusals.

use super::*;

#[test]
fn a_listen_pins_the_connection_until_the_server_says_it_is_gone() {
    let mut h = Harness::new(PoolMode::Transaction, false);
    assert_eq!(transaction(&mut h, "select 1"), PinStep::Release);
    // The first pinning statement stops for a pin slot.
    assert_eq!(h.client(&query("LISTEN jobs")), [ClientStep::Pin]);
    assert_eq!(h.flow.pending(), 0, "not counted before it goes out");
    h.flow.slot_taken();
    assert_eq!(h.client(&query("LISTEN jobs")), [ClientStep::Forward]);
    h.server(&cat(&[complete("LISTEN"), ready(status::IDLE)]));
    assert_eq!(h.flow.transaction_end(), PinStep::Keep);
    assert_eq!(h.flow.pinned(), PinKinds::LISTEN);
    // Other transactions keep it; a second pin needs no new slot.
    assert_eq!(transaction(&mut h, "select 1"), PinStep::Keep);
    assert_eq!(
        transaction(&mut h, "select pg_advisory_lock(1)"),
        PinStep::Keep
    );
    assert_eq!(h.flow.pinned(), PinKinds::LISTEN | PinKinds::ADVISORY_LOCK);
    // UNLISTEN may end it: the server is asked, and the lock remains.
    assert_eq!(transaction(&mut h, "UNLISTEN *"), PinStep::Check);
    assert_eq!(h.flow.checked(PinKinds::ADVISORY_LOCK), PinStep::Keep);
    assert_eq!(h.flow.pinned(), PinKinds::ADVISORY_LOCK);
    assert_eq!(
        transaction(&mut h, "select pg_advisory_unlock_all()"),
        PinStep::Check
    );
    assert_eq!(h.flow.checked(PinKinds::NONE), PinStep::Release);
    assert!(h.flow.pinned().is_empty() && h.flow.state_left().is_empty());
}

#[test]
fn a_pin_and_its_end_in_one_transaction_ask_the_server() {
    let mut h = Harness::new(PoolMode::Transaction, false);
    h.flow.slot_taken();
    assert_eq!(
        transaction(&mut h, "CREATE TEMP TABLE t () ON COMMIT DROP"),
        PinStep::Check
    );
    assert_eq!(h.flow.checked(PinKinds::NONE), PinStep::Release);
    assert_eq!(
        transaction(&mut h, "LISTEN a; UNLISTEN *"),
        PinStep::Check,
        "pins and unpins: the server decides"
    );
    assert_eq!(h.flow.checked(PinKinds::NONE), PinStep::Release);
}

#[test]
fn a_statement_usher_cannot_read_is_checked_and_load_stays() {
    let mut h = Harness::new(PoolMode::Transaction, false);
    // A DO body is not read: the server is asked, even when unpinned.
    assert_eq!(
        transaction(&mut h, "DO $$ BEGIN CREATE TEMP TABLE t (); END $$"),
        PinStep::Check
    );
    assert_eq!(h.flow.checked(PinKinds::TEMP), PinStep::Keep);
    assert_eq!(h.flow.pinned(), PinKinds::TEMP);
    // LOAD cannot be undone or asked about: it pins for good.
    assert_eq!(transaction(&mut h, "LOAD 'plpgsql'"), PinStep::Keep);
    assert_eq!(transaction(&mut h, "DISCARD ALL"), PinStep::Check);
    assert_eq!(h.flow.checked(PinKinds::NONE), PinStep::Keep);
    assert_eq!(h.flow.pinned(), PinKinds::LOAD);
    assert!(h.flow.state_left().contains(PinKinds::LOAD));
}

#[test]
fn state_not_yet_judged_is_left_state() {
    let mut h = Harness::new(PoolMode::Transaction, false);
    h.flow.slot_taken();
    h.client(&query("BEGIN; CREATE TEMP TABLE t ()"));
    h.server(&cat(&[complete("BEGIN"), ready(status::IN_TRANSACTION)]));
    assert_eq!(
        h.flow.state_left(),
        PinKinds::TEMP,
        "the client may leave now"
    );
}

#[test]
fn pinning_off_and_session_mode_never_pin() {
    let mut off = Harness::new(PoolMode::Transaction, false);
    off.flow = Flow::new(PoolMode::Transaction, false, Pinning::Off);
    assert_eq!(transaction(&mut off, "LISTEN a"), PinStep::Release);
    assert!(off.flow.state_left().is_empty());
    let mut session = Harness::new(PoolMode::Session, false);
    assert_eq!(
        session.client(&query("LISTEN a")),
        [ClientStep::Forward],
        "session mode keeps its connection anyway"
    );
    assert!(session.flow.state_left().is_empty());
}

#[test]
fn pinning_error_refuses_the_statement_in_order() {
    let mut h = Harness::new(PoolMode::Transaction, false);
    h.flow = Flow::new(PoolMode::Transaction, false, Pinning::Error);
    h.client(&query("BEGIN"));
    assert_eq!(h.client(&query("LISTEN a")), [ClientStep::Refuse]);
    assert_eq!(h.flow.pending(), 2, "counted: its stand-in goes out");
    // The stand-in fails on the server, after the BEGIN's answer.
    let stand_in = refused_message(frontend::QUERY, b"LISTEN a\0");
    assert_eq!(stand_in[0], frontend::QUERY);
    assert!(String::from_utf8_lossy(&stand_in).contains(REFUSED_MARKER));
    let error = msg(
        backend::ERROR_RESPONSE,
        format!("SERROR\0C42703\0Mcolumn \"{REFUSED_MARKER}\" does not exist\0\0").as_bytes(),
    );
    let got = h.server(&cat(&[
        complete("BEGIN"),
        ready(status::IN_TRANSACTION),
        error.clone(),
        ready(status::FAILED),
    ]));
    let refusal = match &steps(&got)[..] {
        [Forward, Forward, ServerStep::SendRefusal(e), Forward] => e.clone(),
        other => panic!("{other:?}"),
    };
    assert_eq!(refusal.code, "0A000");
    assert!(refusal.message.contains("LISTEN"), "{}", refusal.message);
    assert!(refusal.hint.as_deref().unwrap().contains("session"));
    assert!(h.flow.state_left().is_empty(), "nothing ran");
    // The same error text from another statement is the server's.
    h.client(&query("select \"usher refused this statement\""));
    let got = h.server(&cat(&[error, ready(status::FAILED)]));
    assert_eq!(steps(&got), [Forward, Forward]);
}

#[test]
fn a_refused_parse_keeps_its_name_and_types_and_a_skipped_one_owes_nothing() {
    let mut h = Harness::new(PoolMode::Transaction, false);
    h.flow = Flow::new(PoolMode::Transaction, false, Pinning::Error);
    let parse = msg(
        frontend::PARSE,
        b"s1\0SELECT pg_advisory_lock($1)\0\0\x01\0\0\0\x14",
    );
    let pipeline = cat(&[
        msg(frontend::PARSE, b"\0bad\0\0\0"),
        parse.clone(),
        msg(frontend::SYNC, b""),
    ]);
    assert_eq!(
        h.client(&pipeline),
        [ClientStep::Forward, ClientStep::Refuse]
    );
    let stand_in = refused_message(frontend::PARSE, &parse[5..]);
    assert!(stand_in.starts_with(b"P"));
    assert!(stand_in[5..].starts_with(b"s1\0SELECT \""));
    assert!(stand_in.ends_with(b"\0\0\x01\0\0\0\x14"));
    assert_eq!(
        u32::from_be_bytes(stand_in[1..5].try_into().unwrap()) as usize,
        stand_in.len() - 1
    );
    // The rest of the pipeline (after the stand-in went out).
    h.client(&msg(frontend::SYNC, b""));
    // The first Parse fails: the server skips the stand-in.
    let got = h.server(&cat(&[
        msg(backend::ERROR_RESPONSE, b"SERROR\0C42601\0Msyntax\0\0"),
        ready(status::IDLE),
    ]));
    assert_eq!(steps(&got), [Forward, ForwardThenRelease], "as it is");
    assert!(h.flow.refusals.is_empty(), "its error will not come");
}

#[test]
fn without_a_pin_slot_the_statement_is_refused_with_53300() {
    let mut h = Harness::new(PoolMode::Transaction, false);
    assert_eq!(h.client(&query("LISTEN a")), [ClientStep::Pin]);
    h.flow.no_pin_slot(3, true);
    assert_eq!(h.client(&query("LISTEN a")), [ClientStep::Refuse]);
    let got = h.server(&cat(&[
        msg(
            backend::ERROR_RESPONSE,
            format!("SERROR\0C42703\0Mcolumn \"{REFUSED_MARKER}\" does not exist\0\0").as_bytes(),
        ),
        ready(status::IDLE),
    ]));
    let e = match &steps(&got)[..] {
        [ServerStep::SendRefusal(e), ForwardThenRelease] => e.clone(),
        other => panic!("{other:?}"),
    };
    assert_eq!(e.code, "53300");
    assert!(e.detail.unwrap().contains("max_pinned (3)"));
    assert_eq!(h.flow.transaction_end(), PinStep::Release);
    // Next time it asks again.
    assert_eq!(h.client(&query("LISTEN a")), [ClientStep::Pin]);
}
#[test]
fn each_execution_of_a_prepared_statement_that_pins_pins_again() {
    let mut h = Harness::new(PoolMode::Transaction, false);
    let parse = msg(frontend::PARSE, b"s1\0SELECT pg_advisory_lock($1)\0\0\0");
    let bind = msg(frontend::BIND, b"\0s1\0\0\0\0\0\0\0");
    let execute = cat(&[
        bind.clone(),
        msg(frontend::EXECUTE, b"\0\0\0\0\0"),
        msg(frontend::SYNC, b""),
    ]);
    let answer = cat(&[complete("SELECT 1"), ready(status::IDLE)]);
    assert_eq!(h.client(&parse), [ClientStep::Pin]);
    h.flow.slot_taken();
    h.client(&cat(&[parse.clone(), execute.clone()]));
    h.server(&answer);
    assert_eq!(h.flow.transaction_end(), PinStep::Keep);
    assert_eq!(
        transaction(&mut h, "SELECT pg_advisory_unlock_all()"),
        PinStep::Check
    );
    assert_eq!(h.flow.checked(PinKinds::NONE), PinStep::Release);
    h.flow.slot_given_back();
    // The statement runs again: it takes the lock again.
    assert_eq!(h.client(&execute), [ClientStep::Pin]);
    h.flow.slot_taken();
    h.client(&execute);
    h.server(&answer);
    assert_eq!(h.flow.transaction_end(), PinStep::Keep);
    // Without a slot to be had a Bind still goes (it cannot be
    // refused); the state found pins past the cap.
    assert_eq!(
        transaction(&mut h, "SELECT pg_advisory_unlock_all()"),
        PinStep::Check
    );
    h.flow.checked(PinKinds::NONE);
    h.flow.slot_given_back();
    assert_eq!(h.client(&execute), [ClientStep::Pin]);
    h.flow.no_pin_slot(1, false);
    assert_eq!(
        h.client(&execute),
        [
            ClientStep::Forward,
            ClientStep::Forward,
            ClientStep::Forward
        ]
    );
    h.server(&answer);
    assert_eq!(h.flow.transaction_end(), PinStep::Keep);
    // Once closed, a Bind of that name pins nothing.
    h.client(&cat(&[
        msg(frontend::CLOSE, b"Ss1\0"),
        msg(frontend::SYNC, b""),
    ]));
    h.server(&cat(&[
        msg(backend::CLOSE_COMPLETE, b""),
        ready(status::IDLE),
    ]));
    assert!(h.flow.pinning_statements.is_empty());
}
