//! Several usher instances in front of one PostgreSQL, talking to each
//! other directly (benches/multi_instance.sh runs the same with HAProxy in
//! front): a cancel request sent to another instance than the query's is
//! forwarded to the right one, once; forged keys and dead peers harm
//! nobody; SHOW PEERS; and a rolling restart on one port (so_reuseport)
//! while a client loop runs and a session-mode client is mid-transaction.

use crate::common;

use crate::common::console::console_at;
use crate::common::wait::{eventually, eventually_async};
use crate::common::{free_port, sqlstate, usher_yaml, PgCluster, Usher, UsherProcess};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// `peers:` listing instances 1..=n at these ports (each instance gets the
/// same list; its own entry is ignored).
fn peers_yaml(ports: &[u16]) -> String {
    let mut y = String::from("peers:\n");
    for (i, port) in ports.iter().enumerate() {
        y.push_str(&format!(
            "  - {{ id: {}, host: 127.0.0.1, port: {port} }}\n",
            i + 1
        ));
    }
    y
}

/// An in-process usher on `port` with `extra` configuration.
async fn usher_on(pg: &PgCluster, port: u16, extra: &str) -> Usher {
    let yaml = usher_yaml(pg, extra).replacen(
        "listen: 127.0.0.1:0\n",
        &format!("listen: 127.0.0.1:{port}\n"),
        1,
    );
    Usher::start_yaml(&yaml).await
}

/// Three peered instances (ids 1, 2, 3) in `mode`.
async fn three_peers(pg: &PgCluster, mode: &str) -> Vec<Usher> {
    let ports = [free_port(), free_port(), free_port()];
    let mut ushers = Vec::new();
    for (i, port) in ports.iter().enumerate() {
        let extra = format!(
            "pool_mode: {mode}\npeer_id: {}\n{}",
            i + 1,
            peers_yaml(&ports)
        );
        ushers.push(usher_on(pg, *port, &extra).await);
    }
    ushers
}

/// Sends `token`'s cancel request to the instance on `port` (not the one
/// the client is connected to).
async fn cancel_through(token: &tokio_postgres::CancelToken, port: u16) {
    let stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    token
        .cancel_query_raw(stream, tokio_postgres::NoTls)
        .await
        .unwrap();
}

/// A raw CancelRequest (any key, forged ones too); returns what came back
/// before the instance closed the connection (nothing, for a cancel).
async fn raw_cancel(port: u16, pid: u32, secret: u32) -> Vec<u8> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let mut packet = Vec::new();
    packet.extend_from_slice(&16u32.to_be_bytes());
    packet.extend_from_slice(&80_877_102u32.to_be_bytes());
    packet.extend_from_slice(&pid.to_be_bytes());
    packet.extend_from_slice(&secret.to_be_bytes());
    s.write_all(&packet).await.unwrap();
    let mut reply = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut reply))
        .await
        .expect("the instance closes a cancel connection")
        .unwrap();
    reply
}

/// SHOW PEERS on the instance on `port`: (peer_id, pending_cancel_requests).
async fn peers_pending(port: u16) -> Vec<(String, String)> {
    console_at(port, "SHOW PEERS")
        .await
        .unwrap()
        .into_iter()
        .map(|r| {
            (
                r["peer_id"].clone().unwrap(),
                r["pending_cancel_requests"].clone().unwrap(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_sent_to_another_instance_cancels_the_query_in_both_modes() {
    let pg = PgCluster::shared();
    for mode in ["session", "transaction"] {
        let ushers = three_peers(pg, mode).await;
        // Each instance's query, cancelled through the next instance.
        for (i, seconds) in [(0usize, 31), (1, 32), (2, 33)] {
            let on = &ushers[i];
            let through = ushers[(i + 1) % 3].addr.port();
            let client = on.alice().await;
            let token = client.cancel_token();
            let sql = format!("SELECT pg_sleep({seconds})");
            let running = {
                let sql = sql.clone();
                tokio::spawn(async move { client.simple_query(&sql).await.map(|_| ()) })
            };
            pg.wait_until_active(&sql).await;
            cancel_through(&token, through).await;
            let e = running.await.unwrap().unwrap_err();
            assert_eq!(
                sqlstate(&e).as_deref(),
                Some("57014"),
                "{mode}: instance {} through {through}: {e:?}",
                i + 1
            );
        }
        // Every instance lists the other two.
        let (columns, _) = common::console::console_table(&ushers[0], "SHOW PEERS").await;
        assert_eq!(
            columns,
            [
                "peer_id",
                "host",
                "port",
                "pool_size",
                "pending_cancel_requests"
            ]
        );
        let listed = peers_pending(ushers[0].addr.port()).await;
        assert_eq!(listed.len(), 2, "{listed:?}");
        assert_eq!(listed[0].0, "2");
        assert_eq!(listed[1].0, "3");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forwarded_cancel_is_never_forwarded_again() {
    let pg = PgCluster::shared();
    let ports = [free_port(), free_port(), free_port()];
    let a = usher_on(pg, ports[0], &format!("peer_id: 1\n{}", peers_yaml(&ports))).await;
    // B believes peer 1 lives where C is; C knows where peer 1 is. A key
    // of A's sent to B goes to C, already forwarded: C must drop it.
    let wrong = format!(
        "peer_id: 2\npeers:\n  - {{ id: 1, host: 127.0.0.1, port: {} }}\n",
        ports[2]
    );
    let b = usher_on(pg, ports[1], &wrong).await;
    let c = usher_on(pg, ports[2], &format!("peer_id: 3\n{}", peers_yaml(&ports))).await;

    let client = a.alice().await;
    let token = client.cancel_token();
    let sleeping = tokio::spawn(async move {
        client
            .simple_query("SELECT pg_sleep(3)")
            .await
            .map(|_| client)
    });
    pg.wait_until_active("SELECT pg_sleep(3)").await;
    cancel_through(&token, b.addr.port()).await;
    // B's forward is done once C has closed the connection (C routes it
    // first: a second forward would reach A at once).
    eventually_async(Duration::from_secs(10), "B's forward is done", || async {
        peers_pending(b.addr.port()).await == [("1".to_string(), "0".to_string())]
    })
    .await;
    let client = sleeping
        .await
        .unwrap()
        .expect("the cancel that came back forwarded was dropped");

    // The same key sent to C directly is forwarded to A: C's way to A works.
    let running =
        tokio::spawn(async move { client.simple_query("SELECT pg_sleep(34)").await.map(|_| ()) });
    pg.wait_until_active("SELECT pg_sleep(34)").await;
    cancel_through(&token, c.addr.port()).await;
    let e = running.await.unwrap().unwrap_err();
    assert_eq!(sqlstate(&e).as_deref(), Some("57014"), "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_keys_and_dead_peers_get_no_reply_and_block_nobody() {
    let pg = PgCluster::shared();
    // Peer 2 is listed, but nothing listens there.
    let dead = free_port();
    let port = free_port();
    let a = usher_on(
        pg,
        port,
        &format!(
            "peer_id: 1\npeers:\n  - {{ id: 2, host: 127.0.0.1, port: {dead}, pool_size: 2 }}\n"
        ),
    )
    .await;
    let client = a.alice().await;
    // An unknown peer (99), a dead one (2), and garbage for ourselves (1):
    // each connection is closed without a byte.
    for secret in [
        0xFFFF_0000 | 0x4000 | 99,
        0x1234_0000 | 0x4000 | 2,
        0x0BAD_0000 | 1,
    ] {
        for _ in 0..5 {
            assert!(raw_cancel(port, 12345, secret).await.is_empty());
        }
    }
    // The instance goes on serving, and the forwards to the dead peer end.
    assert_eq!(
        client
            .query_one("SELECT 7", &[])
            .await
            .unwrap()
            .get::<_, i32>(0),
        7
    );
    eventually_async(
        Duration::from_secs(30),
        "forwards to the dead peer end",
        || async { peers_pending(port).await == [("2".to_string(), "0".to_string())] },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_changes_the_peers_but_not_the_peer_id() {
    let pg = PgCluster::shared();
    let port = free_port();
    let base = |extra: &str| {
        usher_yaml(pg, extra).replacen(
            "listen: 127.0.0.1:0\n",
            &format!("listen: 127.0.0.1:{port}\n"),
            1,
        )
    };
    let a = Usher::start_yaml(&base(
        "peer_id: 1\npeers:\n  - { id: 2, host: 127.0.0.1, port: 7002 }\n",
    ))
    .await;
    a.rewrite_config(&base(
        "peer_id: 5\npeers:\n  - { id: 2, host: 127.0.0.1, port: 7002 }\n  - { id: 3, host: 127.0.0.1, port: 7003 }\n",
    ));
    let messages = common::console::console_messages(port, "RELOAD")
        .await
        .unwrap();
    let notices = format!("{messages:?}");
    let rows = console_at(port, "SHOW PEERS").await.unwrap();
    assert_eq!(rows.len(), 2, "{rows:?}");
    let config = console_at(port, "SHOW CONFIG").await.unwrap();
    let peer_id = config
        .iter()
        .find(|r| r["key"].as_deref() == Some("peer_id"))
        .expect("SHOW CONFIG lists peer_id");
    assert_eq!(peer_id["value"].as_deref(), Some("1"), "{notices}");
    assert_eq!(peer_id["changeable"].as_deref(), Some("no"));
}

/// A client loop: connect, one query, disconnect, until told to stop;
/// returns (successes, failures with their errors).
fn client_loop(
    port: u16,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<(usize, Vec<String>)> {
    tokio::spawn(async move {
        let conn = format!(
            "host=127.0.0.1 port={port} user=alice password={} dbname=app",
            common::ALICE_PASSWORD
        );
        let (mut ok, mut failed) = (0, Vec::new());
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let result = async {
                let (c, driver) = tokio_postgres::connect(&conn, tokio_postgres::NoTls).await?;
                let driver = tokio::spawn(driver);
                let n: i32 = c.query_one("SELECT 1", &[]).await?.get(0);
                drop(c);
                let _ = driver.await;
                Ok::<_, tokio_postgres::Error>(n)
            }
            .await;
            match result {
                Ok(1) => ok += 1,
                other => failed.push(format!("{other:?}")),
            }
        }
        (ok, failed)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_on_one_port_drops_no_client() {
    let pg = PgCluster::shared();
    let port = free_port();
    let config = "pool_mode: session\nso_reuseport: true\nshutdown_timeout: 60\n";
    let mut old = UsherProcess::builder(pg)
        .extra(config)
        .first_port(port)
        .start();
    assert_eq!(old.port, port, "the port was free");
    // A session-mode client in the middle of a transaction on the old one.
    let (mid, _driver) = old.alice().await;
    mid.batch_execute("BEGIN; CREATE TEMP TABLE t (n int); INSERT INTO t VALUES (1)")
        .await
        .unwrap();

    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let looping = client_loop(port, stop.clone());
    // The new one binds the same port while the old one still listens.
    let new = UsherProcess::builder(pg)
        .extra(config)
        .first_port(port)
        .start();
    assert_eq!(new.port, port, "SO_REUSEPORT let the second bind");
    assert!(common::wait::listens_on(old.pid(), port));

    old.signal(libc::SIGTERM);
    // The old one closes its listening socket at once, so every new
    // connection goes to the new one, while its client is still there.
    eventually(
        Duration::from_secs(10),
        "the old usher stops listening",
        || !common::wait::listens_on(old.pid(), port),
    );
    assert!(
        old.child.try_wait().unwrap().is_none(),
        "it waits for its client"
    );
    // A connection made now is the new one's, and it works.
    let (fresh, _d) = new.alice().await;
    assert_eq!(
        fresh
            .query_one("SELECT 2", &[])
            .await
            .unwrap()
            .get::<_, i32>(0),
        2
    );

    // The client mid-transaction finishes its work on the old one.
    mid.batch_execute("INSERT INTO t VALUES (2)").await.unwrap();
    let sum: i64 = mid
        .query_one("SELECT sum(n) FROM t", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(sum, 3);
    mid.batch_execute("COMMIT").await.unwrap();
    drop(mid);
    let status = old.wait_exit(Duration::from_secs(30));
    assert!(status.success(), "the old usher exits cleanly: {status}");

    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (ok, failed) = looping.await.unwrap();
    assert!(
        failed.is_empty(),
        "{} failed of {}: {failed:?}",
        failed.len(),
        ok + failed.len()
    );
    assert!(ok > 0, "the loop ran");
    drop(new);
}
