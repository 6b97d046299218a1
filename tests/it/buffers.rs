//! What one client, and all clients together, can make usher hold in
//! memory: messages usher must read whole are bounded by
//! max_buffered_message (54000 past it), everything else streams, and the
//! large buffers of all clients together by max_buffered_total (53200).

use crate::common;

use crate::common::canary::Canary;
use crate::common::wire::{message, read_error, read_message, trust_login};
use crate::common::{sqlstate, PgCluster, Usher};
use tokio::io::AsyncWriteExt;

/// A named Parse of `SELECT '<n x's>'`.
fn named_parse(name: &str, n: usize) -> Vec<u8> {
    let mut body = format!("{name}\0SELECT '").into_bytes();
    body.extend(std::iter::repeat_n(b'x', n));
    body.extend_from_slice(b"'\0\0\0");
    message(b'P', &body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_messages_usher_must_hold_are_bounded_by_max_buffered_message() {
    let pg = PgCluster::shared();
    let usher = Usher::start(
        pg,
        "pool_mode: transaction\nmax_buffered_message: 1048576\n",
    )
    .await;
    let c = usher.alice().await;
    let big = "x".repeat(2 << 20);
    // Streamed: an unnamed statement, and a named one's 2 MB parameter.
    let rows = c
        .simple_query(&format!("SELECT length('{big}')"))
        .await
        .unwrap();
    assert!(
        matches!(&rows[1], tokio_postgres::SimpleQueryMessage::Row(r) if r.get(0) == Some("2097152"))
    );
    let stmt = c.prepare("SELECT length($1::text)").await.unwrap();
    let n: i32 = c.query_one(&stmt, &[&big]).await.unwrap().get(0);
    assert_eq!(n, 2 << 20);
    // Held whole: a named Parse of 2 MB is refused with 54000.
    let e = c
        .prepare(&format!("SELECT '{big}'"))
        .await
        .expect_err("a 2 MB named Parse is past max_buffered_message");
    assert_eq!(sqlstate(&e).as_deref(), Some("54000"), "{e:?}");
    // Others go on.
    usher.alice().await.simple_query("SELECT 1").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_messages_of_all_clients_together_are_bounded_by_max_buffered_total() {
    let pg = PgCluster::shared();
    let usher = Usher::start(
        pg,
        "auth:\n  method: trust\npool_mode: transaction\n\
         max_buffered_message: 2097152\nmax_buffered_total: 3145728\n",
    )
    .await;
    let parse = named_parse("s1", 1_900_000);
    let (first, rest) = parse.split_at(1_500_000);
    // One client holds 1.5 MB of a message; a second one that would take
    // the total past 3 MB is ended with 53200.
    let mut a = trust_login(usher.addr).await;
    a.write_all(first).await.unwrap();
    common::wait::eventually_async(
        std::time::Duration::from_secs(10),
        "usher holds the message",
        || async { usher.app.deps.buffers.used() >= 1_400_000 },
    )
    .await;
    let mut b = trust_login(usher.addr).await;
    let _ = b.write_all(first).await;
    let e = read_error(&mut b).await;
    assert_eq!(e[&'C'], "53200", "{e:?}");
    // The first one finishes its message and is answered.
    a.write_all(rest).await.unwrap();
    a.write_all(&message(b'S', b"")).await.unwrap();
    assert_eq!(read_message(&mut a).await.0, b'1');
    assert_eq!(read_message(&mut a).await.0, b'Z');
    // Once it is done with it, and has closed the statement (a statement
    // beyond 1 MiB is charged too), the memory is free for others.
    a.write_all(&message(b'C', b"Ss1\0")).await.unwrap();
    a.write_all(&message(b'S', b"")).await.unwrap();
    assert_eq!(read_message(&mut a).await.0, b'3');
    assert_eq!(read_message(&mut a).await.0, b'Z');
    let mut c = trust_login(usher.addr).await;
    c.write_all(&named_parse("s2", 1_900_000)).await.unwrap();
    c.write_all(&message(b'S', b"")).await.unwrap();
    assert_eq!(read_message(&mut c).await.0, b'1');
}

/// Issue 25 item 8: clients that each sent all but the last byte of a
/// large named Parse and stopped held the shared budget for as long as they
/// liked (no server connection, no timeout), and others' large Parses got
/// 53200 meanwhile. A message held against max_buffered_total must now be
/// finished within client_message_timeout, then FATAL 57P05.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_inside_a_held_message_is_ended() {
    let pg = PgCluster::shared();
    let usher = Usher::start(
        pg,
        "auth:\n  method: trust\npool_mode: transaction\n\
         max_buffered_total: 41943040\nclient_message_timeout: 5\n",
    )
    .await;
    let canary = Canary::start(usher.addr.port());
    let parse = named_parse("s1", 15_900_000);
    let mut holders = Vec::new();
    for _ in 0..2 {
        let mut holder = trust_login(usher.addr).await;
        holder.write_all(&parse[..parse.len() - 1]).await.unwrap();
        holders.push(holder);
    }
    common::wait::eventually_async(
        common::wait::DEADLINE,
        "usher holds both messages",
        || async { usher.app.deps.buffers.used() >= 2 * 15_000_000 },
    )
    .await;
    // While they hold it, another client's large Parse finds no budget.
    let mut other = trust_login(usher.addr).await;
    let _ = other.write_all(&parse).await;
    assert_eq!(read_error(&mut other).await[&'C'], "53200");
    // They are ended, and what they held is free again.
    for holder in &mut holders {
        let e = read_error(holder).await;
        assert_eq!(e[&'C'], "57P05", "{e:?}");
        assert!(e[&'M'].contains("did not finish its message"), "{e:?}");
    }
    common::wait::eventually_async(common::wait::DEADLINE, "the budget is free", || async {
        usher.app.deps.buffers.used() == 0
    })
    .await;
    // (Checked before the last Parse: a whole 16 MB named Parse is handled
    // in one go on a runtime worker, about 600 ms in a debug build.)
    canary.check();
    let mut c = trust_login(usher.addr).await;
    c.write_all(&parse).await.unwrap();
    c.write_all(&message(b'S', b"")).await.unwrap();
    assert_eq!(read_message(&mut c).await.0, b'1');
}

/// The statements a client keeps in transaction mode (each named Parse's
/// text, each SQL PREPARE's) are charged to max_buffered_total beyond 1 MiB
/// per client: a client that prepares without end gets 53200 for the
/// statement past the total and keeps its connection and its statements;
/// closing some makes room again; what a client held goes back when it
/// leaves. Another client never notices.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepared_statements_are_bounded_by_max_buffered_total() {
    let pg = PgCluster::shared();
    let usher = Usher::start(
        pg,
        "pool_mode: transaction\nmax_buffered_message: 1048576\nmax_buffered_total: 2097152\n",
    )
    .await;
    let canary = Canary::start(usher.addr.port());
    let filler = "x".repeat(200_000);
    let text = |i: usize| format!("SELECT length('{filler}') + {i}");
    let budget = || usher.app.deps.buffers.used();

    // Protocol-level statements: 1 MiB free, then 2 MiB charged.
    let a = usher.alice().await;
    let mut kept = Vec::new();
    let refused = loop {
        match a.prepare(&text(kept.len())).await {
            Ok(s) => kept.push(s),
            Err(e) => break e,
        }
        assert!(kept.len() < 40, "40 statements of 200 KB were all kept");
    };
    assert_eq!(sqlstate(&refused).as_deref(), Some("53200"), "{refused:?}");
    assert!(
        (10..=16).contains(&kept.len()),
        "{} statements of 200 KB kept within 1 + 2 MiB",
        kept.len()
    );
    assert!(budget() <= 2 << 20, "{} bytes charged", budget());
    // The client goes on, its statements too.
    let n: i32 = a.query_one(&kept[0], &[]).await.unwrap().get(0);
    assert_eq!(n, 200_000);
    let last = kept.len() - 1;
    let n: i32 = a.query_one(&kept[last], &[]).await.unwrap().get(0);
    assert_eq!(n as usize, 200_000 + last);
    // Closing statements makes room.
    let charged = budget();
    kept.truncate(5);
    a.simple_query("SELECT 1").await.unwrap();
    common::wait::eventually_async(
        common::wait::DEADLINE,
        "the closed statements' charge goes back",
        || async { budget() < charged },
    )
    .await;
    kept.push(a.prepare(&text(99)).await.expect("room again"));

    // What a client held goes back when it leaves.
    drop((kept, a));
    common::wait::eventually_async(
        common::wait::DEADLINE,
        "nothing charged once the client left",
        || async { budget() == 0 },
    )
    .await;

    // SQL PREPARE is charged the same way (in Queries usher reads whole,
    // up to 64 KiB: a larger one pins its server connection instead).
    let b = usher.alice().await;
    let small = "x".repeat(60_000);
    let mut prepared = 0;
    let refused = loop {
        let sql = format!("PREPARE p{prepared} AS SELECT length('{small}') + {prepared}");
        match b.simple_query(&sql).await {
            Ok(_) => prepared += 1,
            Err(e) => break e,
        }
        assert!(prepared < 80, "80 statements of 60 KB were all kept");
    };
    assert_eq!(sqlstate(&refused).as_deref(), Some("53200"), "{refused:?}");
    assert!((40..=54).contains(&prepared), "{prepared} kept");
    let rows = b.simple_query("EXECUTE p0").await.unwrap();
    assert!(
        matches!(&rows[1], tokio_postgres::SimpleQueryMessage::Row(r) if r.get(0) == Some("60000"))
    );
    b.simple_query("DEALLOCATE ALL").await.unwrap();
    common::wait::eventually_async(
        common::wait::DEADLINE,
        "DEALLOCATE ALL gives the charge back",
        || async { budget() == 0 },
    )
    .await;
    b.simple_query(&format!("PREPARE again AS SELECT length('{small}')"))
        .await
        .unwrap();
    canary.check();
}
