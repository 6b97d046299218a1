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
    // Once it is done with it, the memory is free for others.
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
