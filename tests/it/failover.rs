//! Several hosts per database (`databases.<name>.hosts`, `target`): a
//! primary and a streaming replica started by the harness. A read-write
//! client reaches the primary wherever it is listed, a read-only one the
//! replica; a host that fails is skipped by the next logins; after the
//! primary stops and the replica is promoted, read-write clients (one that
//! waited for a host that fits, too) reach the new primary; and when no
//! host fits within `query_wait_timeout`, the client is told so (08001).

use crate::common::console::{console, get, row};
use crate::common::wait::{wait_for_async, DEADLINE};
use crate::common::{sqlstate, PgCluster, Usher, ALICE_PASSWORD, BOB_PASSWORD};
use std::net::TcpListener;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

/// A primary and its replica, shared by the tests that change neither;
/// stopped when the binary exits.
fn pair() -> &'static (PgCluster, PgCluster) {
    static PAIR: OnceLock<(PgCluster, PgCluster)> = OnceLock::new();
    PAIR.get_or_init(|| {
        extern "C" fn stop_pair() {
            if let Some((primary, replica)) = PAIR.get() {
                replica.stop();
                primary.stop();
            }
        }
        let primary = PgCluster::start();
        let replica = primary.start_replica();
        unsafe { libc::atexit(stop_pair) };
        (primary, replica)
    })
}

/// The configuration of database `app` on `hosts` (YAML list items) with
/// `keys`.
fn yaml(hosts: &str, keys: &str) -> String {
    format!(
        "listen: 127.0.0.1:0\n\
         hooks: {{ dir: tests/no-hooks }}\n\
         server_connect_timeout: 5\n\
         databases:\n  app: {{ hosts: [{hosts}]{keys} }}\n\
         users:\n  alice: {{ password: {ALICE_PASSWORD} }}\n  bob: {{ password: {BOB_PASSWORD} }}\n  admin: {{ password: admin-pw }}\n\
         admin: {{ users: [admin] }}\n"
    )
}

async fn usher(hosts: &str, keys: &str) -> Usher {
    Usher::start_yaml(&yaml(hosts, keys)).await
}

fn host(pg: &PgCluster) -> String {
    format!("\"127.0.0.1:{}\"", pg.port)
}

/// The port of the server the client's next statement runs on, and
/// whether that server is in recovery.
async fn server_of(client: &tokio_postgres::Client) -> Result<(i32, bool), tokio_postgres::Error> {
    let row = client
        .query_one("SELECT inet_server_port(), pg_is_in_recovery()", &[])
        .await?;
    Ok((row.get(0), row.get(1)))
}

/// A port where something accepts connections and closes them at once (a
/// server that is not one), counting the connections.
fn dead_host() -> (u16, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let count = Arc::new(AtomicUsize::new(0));
    let seen = count.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            seen.fetch_add(1, Ordering::SeqCst);
            drop(conn);
        }
    });
    (port, count)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_write_reaches_the_primary_even_when_the_replica_is_listed_first() {
    let (primary, replica) = pair();
    let usher = usher(
        &format!("{}, {}", host(replica), host(primary)),
        ", target: read-write",
    )
    .await;
    let alice = usher.alice().await;
    assert_eq!(
        server_of(&alice).await.unwrap(),
        (primary.port as i32, false)
    );
    alice
        .batch_execute("CREATE TEMP TABLE written (x int)")
        .await
        .expect("a read-write session");
    // SHOW DATABASES shows the host in use, not the first listed.
    let databases = console(&usher, "SHOW DATABASES").await;
    let app = row(&databases, "name", "app");
    assert_eq!(get(app, "port"), Some(primary.port.to_string().as_str()));
    assert_eq!(get(app, "load_balance_hosts"), Some("disable"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_reaches_the_replica() {
    let (primary, replica) = pair();
    let usher = usher(
        &format!("{}, {}", host(primary), host(replica)),
        ", target: read-only, pool_mode: session",
    )
    .await;
    let alice = usher.alice().await;
    assert_eq!(
        server_of(&alice).await.unwrap(),
        (replica.port as i32, true)
    );
    // SHOW SERVERS names the replica for the connection alice holds.
    let servers = console(&usher, "SHOW SERVERS").await;
    let held = row(&servers, "user", "alice");
    assert_eq!(get(held, "port"), Some(replica.port.to_string().as_str()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_host_listed_first_is_skipped_and_the_next_login_does_not_try_it_again() {
    let (primary, _) = pair();
    let (dead, tried) = dead_host();
    let usher = usher(&format!("\"127.0.0.1:{dead}\", {}", host(primary)), "").await;
    let alice = usher.alice().await;
    assert_eq!(server_of(&alice).await.unwrap().0, primary.port as i32);
    assert_eq!(
        tried.load(Ordering::SeqCst),
        1,
        "the dead host was tried first"
    );
    // bob's pool opens its own server connection: the dead host is in
    // back-off for every pool, so it goes straight to the primary.
    let bob = usher
        .connect_as("bob", BOB_PASSWORD)
        .await
        .expect("bob connects");
    assert_eq!(server_of(&bob).await.unwrap().0, primary.port as i32);
    assert_eq!(
        tried.load(Ordering::SeqCst),
        1,
        "the second login went to the dead host again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_host_fitting_the_client_gets_08001_naming_the_target() {
    let (_, replica) = pair();
    let (dead, _) = dead_host();
    // The client waits for a host that fits, up to query_wait_timeout.
    let usher = usher(
        &format!("{}, \"127.0.0.1:{dead}\"", host(replica)),
        ", target: read-write, query_wait_timeout: 1",
    )
    .await;
    let e = usher
        .connect_as("alice", ALICE_PASSWORD)
        .await
        .map(|_| ())
        .expect_err("no host fits: the login fails");
    assert_eq!(sqlstate(&e).as_deref(), Some("08001"), "{e}");
    let db = e.as_db_error().unwrap();
    assert_eq!(db.message(), "no host fits target_session_attrs=read-write");
    let detail = db.detail().unwrap_or_default();
    assert!(
        detail.contains(&format!("127.0.0.1:{}: session is read-only", replica.port))
            && detail.contains(&format!("127.0.0.1:{dead}: ")),
        "{detail}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_promotion_read_write_clients_reach_the_new_primary() {
    // A pair of its own: this test ends the primary.
    let primary = PgCluster::start();
    let replica = primary.start_replica();
    let usher = usher(
        &format!("{}, {}", host(&primary), host(&replica)),
        ", target: read-write",
    )
    .await;
    let before = usher.alice().await;
    assert_eq!(
        server_of(&before).await.unwrap(),
        (primary.port as i32, false)
    );

    primary.stop_fast();
    // The primary is gone and the replica is a standby: nothing fits, and
    // a client that logs in now (bob's pool opens its first connection)
    // waits for a host that does.
    let bob = usher.conn_str("bob", BOB_PASSWORD);
    let waiting = tokio::spawn(async move {
        let (client, driver) = tokio_postgres::connect(&bob, tokio_postgres::NoTls).await?;
        tokio::spawn(driver);
        let server = server_of(&client).await?;
        Ok::<_, tokio_postgres::Error>((client, server, std::time::Instant::now()))
    });
    wait_for_async(DEADLINE, "bob's login waits for a primary", || async {
        let pools = console(&usher, "SHOW POOLS").await;
        match pools.iter().find(|r| get(r, "user") == Some("bob")) {
            Some(r) if get(r, "cl_waiting") != Some("0") => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    assert!(!waiting.is_finished(), "{:?}", waiting.await);

    let promoting = std::time::Instant::now();
    replica.promote();
    // The waiting client reaches the new primary, found at the pool's next
    // attempt (at most 0.5 s apart while a standby answers; printed, not
    // asserted).
    let (after, server, at) = waiting.await.unwrap().expect("bob's login");
    eprintln!(
        "the waiting client's statement ran {:?} after pg_ctl promote began",
        at.saturating_duration_since(promoting)
    );
    assert_eq!(server, (replica.port as i32, false));
    after
        .batch_execute("CREATE TABLE after_promotion (x int)")
        .await
        .expect("the new primary takes writes");
    // The client from before the fail-over: its pool's idle connection to
    // the old primary is dropped, and its next statement runs on the new
    // primary.
    let moved = wait_for_async(DEADLINE, "the old client's statement", || {
        server_of(&before)
    })
    .await;
    assert_eq!(moved, (replica.port as i32, false));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_changes_the_target_reconnects_to_a_host_that_fits() {
    let (primary, replica) = pair();
    let hosts = format!("{}, {}", host(primary), host(replica));
    let usher = usher(&hosts, ", target: read-only").await;
    let alice = usher.alice().await;
    assert_eq!(
        server_of(&alice).await.unwrap(),
        (replica.port as i32, true)
    );
    usher.rewrite_config(&yaml(&hosts, ", target: read-write"));
    console(&usher, "RELOAD").await;
    // The pool's connection to the replica is of the old generation: the
    // next statement gets a new one, on the primary.
    assert_eq!(
        server_of(&alice).await.unwrap(),
        (primary.port as i32, false)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_connection_to_a_promoted_standby_is_not_handed_out_for_read_only() {
    // A pair of its own: the replica is promoted, the primary stopped.
    let primary = PgCluster::start();
    let replica = primary.start_replica();
    let usher = usher(
        &host(&replica),
        ", target: read-only, query_wait_timeout: 1",
    )
    .await;
    let alice = usher.alice().await;
    assert_eq!(
        server_of(&alice).await.unwrap(),
        (replica.port as i32, true)
    );
    primary.stop_fast();
    replica.promote();
    // The pooled connection learns of the promotion with its next answer
    // (the server reports in_hot_standby off then); that one use may
    // already be refused, so its outcome is not the point.
    let _ = server_of(&alice).await;
    // From then on it does not fit read-only: the next client of the same
    // pool does not get it, and with no standby left it is told so.
    let e = match usher.connect_as("alice", ALICE_PASSWORD).await {
        Ok(again) => server_of(&again).await.map(|s| s.0),
        Err(e) => Err(e),
    }
    .expect_err("the promoted server was used for a read-only client");
    assert_eq!(sqlstate(&e).as_deref(), Some("08001"), "{e}");
    assert_eq!(
        e.as_db_error().unwrap().message(),
        "no host fits target_session_attrs=read-only"
    );
}
