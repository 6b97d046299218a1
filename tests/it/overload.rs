//! Overload from outside: running out of file descriptors, idle connections
//! to the metrics endpoint, and one address holding the login slots.

use crate::common::wait::{eventually_async, wait_for, wait_for_async, DEADLINE};
use crate::common::{sqlstate, usher_yaml, PgCluster, Usher, UsherProcess, ALICE_PASSWORD};
use std::net::SocketAddr;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

/// usher as a child process whose descriptors are limited to `nofile`
/// (RLIMIT_NOFILE, set in the child only: the test process keeps its own),
/// with its metrics endpoint on a port of its own.
fn limited_usher(pg: &PgCluster, nofile: u64) -> UsherProcess {
    UsherProcess::builder(pg)
        .metrics()
        .rlimit_nofile(nofile)
        .start()
}

/// alice's connection string, waiting up to 30 s for the connection.
fn alice_conn_str(usher: &UsherProcess) -> String {
    format!("{} connect_timeout=30", usher.alice_conn_str())
}

/// Descriptors the child has open now.
fn open_fds(usher: &UsherProcess) -> usize {
    std::fs::read_dir(format!("/proc/{}/fd", usher.pid()))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// CPU time (user + system) the child used so far, in clock ticks.
fn cpu_ticks(usher: &UsherProcess) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", usher.pid())).unwrap();
    // After the command name (in parentheses): state is field 3, utime
    // and stime are fields 14 and 15.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

/// Log lines about failed accepts.
fn accept_error_lines(usher: &UsherProcess) -> usize {
    usher
        .log()
        .lines()
        .filter(|l| l.to_ascii_lowercase().contains("accept"))
        .count()
}

/// Waits until a scrape of the metrics endpoint at `port` answers 200;
/// the response.
async fn scrape_ok(port: u16) -> String {
    wait_for_async(Duration::from_secs(30), "a scrape answers", || async {
        match http_get(port, "/metrics").await {
            Ok(text) if text.starts_with("HTTP/1.1 200") => Ok(text),
            other => Err(other),
        }
    })
    .await
}

/// alice logs in through `usher` and runs a query.
async fn alice_queries(conn_str: &str) -> Result<(), tokio_postgres::Error> {
    let (c, conn) = tokio_postgres::connect(conn_str, tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    c.query_one("SELECT 1", &[]).await.map(|_| ())
}

/// GET `path` from the metrics endpoint at `port`: the whole response.
async fn http_get(port: u16, path: &str) -> std::io::Result<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).await?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await?;
    let mut body = String::new();
    s.read_to_string(&mut body).await?;
    Ok(body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_descriptors_usher_backs_off_quietly_and_recovers() {
    let pg = PgCluster::shared();
    let nofile = 64;
    let usher = limited_usher(pg, nofile);
    let metrics_port = usher.metrics_port.unwrap();
    alice_queries(&alice_conn_str(&usher))
        .await
        .expect("alice logs in before the descriptors run out");
    // Silent clients until usher has no descriptor left: those it accepted
    // hold one each (and a login slot) until auth_timeout; the rest wait in
    // the listen backlog.
    let mut silent = Vec::new();
    for _ in 0..nofile + 20 {
        silent.push(TcpStream::connect(usher.addr()).await.unwrap());
    }
    wait_for(
        Duration::from_secs(20),
        "usher runs out of descriptors",
        || {
            let open = open_fds(&usher);
            if open >= nofile as usize - 1 {
                Ok(())
            } else {
                Err(format!("{open} open"))
            }
        },
    );
    // A login and a scrape arrive while none is left: both wait in the
    // backlogs, and both accept loops hit EMFILE.
    let login = tokio::spawn({
        let conn_str = alice_conn_str(&usher);
        async move { alice_queries(&conn_str).await }
    });
    let scrape = tokio::spawn(http_get(metrics_port, "/metrics"));
    let cpu = cpu_ticks(&usher);
    // A fixed window on purpose: what usher does with its time while out
    // of descriptors.
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Printed, not asserted (no timing in tests): a spinning accept loop
    // shows as about 200 ticks (a core for two seconds).
    eprintln!(
        "CPU while out of descriptors: {} ticks in 2 s",
        cpu_ticks(&usher) - cpu
    );
    // Descriptors come back: the silent clients leave.
    drop(silent);
    // The login and the scrape that waited end (the login may have been
    // accepted in a moment a descriptor was free and then failed to reach
    // the server: either way it ends).
    let login = tokio::time::timeout(Duration::from_secs(30), login)
        .await
        .expect("the waiting login ends")
        .unwrap();
    let scrape = tokio::time::timeout(Duration::from_secs(30), scrape)
        .await
        .expect("the waiting scrape ends")
        .unwrap();
    eprintln!(
        "while out of descriptors: login {login:?}, scrape {:?}",
        scrape
            .as_ref()
            .map(|t| t.lines().next().map(str::to_string))
    );
    // Logins and scrapes work again.
    let text = scrape_ok(metrics_port).await;
    assert!(text.contains("usher_clients_connected"), "{text}");
    alice_queries(&alice_conn_str(&usher))
        .await
        .expect("new logins work");
    let lines = accept_error_lines(&usher);
    eprintln!("{lines} log lines about accepts:");
    for l in usher.log().lines().filter(|l| l.contains("accept")) {
        eprintln!("  {l}");
    }
    assert!(
        lines <= 10,
        "{lines} log lines about failed accepts in two seconds:\n{}",
        usher.log().lines().take(20).collect::<Vec<_>>().join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_to_the_metrics_endpoint_are_bounded_and_closed() {
    let pg = PgCluster::shared();
    // Room for what usher needs and the endpoint's 64 connections, not for
    // 200 idle ones.
    let usher = limited_usher(pg, 128);
    let metrics_port = usher.metrics_port.unwrap();
    let before = open_fds(&usher);
    let mut idle = Vec::new();
    for _ in 0..200 {
        idle.push(
            TcpStream::connect(("127.0.0.1", metrics_port))
                .await
                .unwrap(),
        );
    }
    // The endpoint has taken all it serves at once (metrics.max_connections,
    // 64 by default); the rest wait in the backlog.
    eventually_async(
        Duration::from_secs(30),
        "the metrics endpoint holds 64 idle connections",
        || async { open_fds(&usher) >= before + 64 },
    )
    .await;
    tokio::time::timeout(
        Duration::from_secs(30),
        alice_queries(&alice_conn_str(&usher)),
    )
    .await
    .expect("a login is not starved of descriptors by idle scrapers")
    .expect("alice logs in while 200 connections sit idle at the metrics port");
    // The first ones accepted are closed once the request timeout passes
    // without a request.
    let mut first = idle.remove(0);
    let mut buf = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(30), first.read_to_end(&mut buf))
        .await
        .expect("an idle connection to the metrics endpoint is closed");
    let answer = String::from_utf8_lossy(&buf);
    assert!(
        read.is_err() || buf.is_empty() || answer.starts_with("HTTP/1.1 408"),
        "{answer}"
    );
    drop(idle);
    scrape_ok(metrics_port).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_endpoint_answers_only_get_metrics() {
    let pg = PgCluster::shared();
    let usher = limited_usher(pg, 1024);
    let metrics_port = usher.metrics_port.unwrap();
    let ok = http_get(metrics_port, "/metrics").await.unwrap();
    assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
    assert!(
        ok.to_ascii_lowercase().contains("connection: close"),
        "{ok}"
    );
    let missing = http_get(metrics_port, "/other").await.unwrap();
    assert!(missing.starts_with("HTTP/1.1 404"), "{missing}");
    let mut s = TcpStream::connect(("127.0.0.1", metrics_port))
        .await
        .unwrap();
    s.write_all(b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        .await
        .unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 405"), "{answer}");
    // A request head that never ends is cut at the size limit.
    let mut s = TcpStream::connect(("127.0.0.1", metrics_port))
        .await
        .unwrap();
    let mut head = b"GET /metrics HTTP/1.1\r\n".to_vec();
    while head.len() < 64 * 1024 {
        head.extend_from_slice(b"X-Filler: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n");
    }
    let _ = s.write_all(&head).await;
    let mut answer = Vec::new();
    let _ = s.read_to_end(&mut answer).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");
    let bad = {
        let mut s = TcpStream::connect(("127.0.0.1", metrics_port))
            .await
            .unwrap();
        s.write_all(b"hello\r\n\r\n").await.unwrap();
        let mut answer = String::new();
        s.read_to_string(&mut answer).await.unwrap();
        answer
    };
    assert!(bad.starts_with("HTTP/1.1 400"), "{bad}");
}

/// A TCP connection to `to` from the local address `from` (127.0.0.2 is
/// another loopback address on Linux).
async fn connect_from(from: [u8; 4], to: SocketAddr) -> TcpStream {
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::from((from, 0))).unwrap();
    socket.connect(to).await.unwrap()
}

/// alice logs in from the local address `from`.
async fn alice_from(
    from: [u8; 4],
    usher: &Usher,
) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    let stream = connect_from(from, usher.addr).await;
    let mut config = tokio_postgres::Config::new();
    config.user("alice").password(ALICE_PASSWORD).dbname("app");
    let (c, conn) = config.connect_raw(stream, tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    Ok(c)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_cannot_take_every_login_slot() {
    let pg = PgCluster::shared();
    let extra = "max_auth_clients: 6\nmax_auth_clients_per_address: 3\n";
    let usher = Usher::start(pg, extra).await;
    let other: [u8; 4] = [127, 0, 0, 2];
    // Three clients from 127.0.0.2 that never say a word hold its slots.
    let mut silent = Vec::new();
    for _ in 0..3 {
        silent.push(connect_from(other, usher.addr).await);
    }
    // They hold the slots once usher has accepted them.
    eventually_async(DEADLINE, "three login slots in use", || async {
        usher.app.deps.login_slots.in_use() == 3
    })
    .await;
    let e = alice_from(other, &usher)
        .await
        .expect_err("127.0.0.2 is over its limit");
    assert_eq!(sqlstate(&e).as_deref(), Some("53300"), "{e:?}");
    let message = e.as_db_error().unwrap().message();
    assert!(
        message.contains("127.0.0.2") && message.contains("max_auth_clients_per_address is 3"),
        "{message}"
    );
    // Everyone else still logs in.
    let c = alice_from([127, 0, 0, 1], &usher)
        .await
        .expect("another address logs in");
    c.query_one("SELECT 1", &[]).await.unwrap();
    // The limit is read at each login: a reload raises it.
    usher.rewrite_config(&usher_yaml(
        pg,
        "max_auth_clients: 6\nmax_auth_clients_per_address: 4\n",
    ));
    usher.app.reload().expect("reload");
    let c = alice_from(other, &usher)
        .await
        .expect("127.0.0.2 logs in under the raised limit");
    c.query_one("SELECT 1", &[]).await.unwrap();
    // Slots come back when the silent clients leave.
    usher.rewrite_config(&usher_yaml(pg, extra));
    usher.app.reload().expect("reload");
    drop(silent);
    eventually_async(
        Duration::from_secs(10),
        "127.0.0.2's slots are freed",
        || async { alice_from(other, &usher).await.is_ok() },
    )
    .await;
}
