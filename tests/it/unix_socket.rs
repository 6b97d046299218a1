//! The Unix-domain socket for clients (`unix_socket_dir`): psql and
//! tokio-postgres reach usher through `<dir>/.s.PGSQL.<port>` in both pool
//! modes, with hooks, cancel requests and the console; an SSLRequest gets
//! `N`; HBA `local` rules decide for its clients and `host` rules do not;
//! SHOW CLIENTS shows them as PgBouncer does; the file goes at shutdown,
//! and a rolling restart with `so_reuseport` leaves the new usher's file.

use crate::common::canary::Canary;
use crate::common::console::{get, Row};
use crate::common::tls::{psql_err, psql_ok, write_file, TestCa};
use crate::common::wait::eventually;
use crate::common::{sqlstate, PgCluster, Usher, UsherProcess, ALICE_PASSWORD, BOB_PASSWORD};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_postgres::NoTls;

/// The socket's path for usher's port, as libpq names it.
fn socket(dir: &Path, port: u16) -> PathBuf {
    dir.join(format!(".s.PGSQL.{port}"))
}

/// A client of the socket in `dir`, built with `Config::host_path` as an
/// application would.
async fn connect_unix(
    dir: &Path,
    port: u16,
    user: &str,
    password: &str,
    database: &str,
) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    let (client, conn) = tokio_postgres::Config::new()
        .host_path(dir)
        .port(port)
        .user(user)
        .password(password)
        .dbname(database)
        .connect(NoTls)
        .await?;
    tokio::spawn(conn);
    Ok(client)
}

/// The rows of a console command run as admin through the socket.
async fn console_unix(dir: &Path, port: u16, command: &str) -> Vec<Row> {
    let c = connect_unix(dir, port, "admin", "admin-pw", "usher")
        .await
        .expect("admin on the socket");
    crate::common::console::rows(c.simple_query(command).await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn psql_and_tokio_postgres_work_through_the_socket_in_both_pool_modes() {
    let pg = PgCluster::shared();
    let sockets = tempfile::tempdir().unwrap();
    let hooks = tempfile::tempdir().unwrap();
    // What a hook sees of a socket client: `unix` and the port.
    std::fs::write(
        hooks.path().join("where.lua"),
        "function client_connection(ctx)\n  ctx:set('application_name', ctx.client_addr .. ':' .. ctx.client_port)\nend\n",
    )
    .unwrap();
    for mode in ["transaction", "session"] {
        let usher = Usher::start(
            pg,
            &format!(
                "pool_mode: {mode}\nunix_socket_dir: {}\nhooks:\n  dir: {}\n",
                sockets.path().display(),
                hooks.path().display()
            ),
        )
        .await;
        let port = usher.addr.port();
        let dir = sockets.path();
        assert!(socket(dir, port).exists(), "{mode}: the socket is made");
        let canary = Canary::start(port);

        let out = psql_ok(
            &format!("host={} port={port} user=alice dbname=app", dir.display()),
            Some(ALICE_PASSWORD),
            "select 'through ' || current_setting('application_name')",
        )
        .await;
        assert_eq!(out, format!("through unix:{port}"), "{mode}");

        let alice = connect_unix(dir, port, "alice", ALICE_PASSWORD, "app")
            .await
            .unwrap_or_else(|e| panic!("{mode}: {e:?}"));
        alice
            .batch_execute("begin; create temp table t (x int); insert into t values (1), (2)")
            .await
            .unwrap();
        let n: i64 = alice
            .query_one("select sum(x) from t", &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(n, 3);
        alice.batch_execute("commit").await.unwrap();
        let x: i32 = alice
            .query_one("select $1::int + 1", &[&41i32])
            .await
            .unwrap()
            .get(0);
        assert_eq!(x, 42, "{mode}: the extended protocol");

        // A cancel request through the socket reaches the query.
        let cancel = alice.cancel_token();
        let sleeper = tokio::spawn(async move { alice.simple_query("select pg_sleep(30)").await });
        pg.wait_until_active("select pg_sleep(30)").await;
        cancel.cancel_query(NoTls).await.expect("cancel sent");
        let e = tokio::time::timeout(Duration::from_secs(10), sleeper)
            .await
            .expect("cancelled within 10 s")
            .unwrap()
            .expect_err("cancelled");
        assert_eq!(sqlstate(&e).as_deref(), Some("57014"), "{mode}: {e:?}");

        // SHOW CLIENTS through the socket: `unix` and the socket's port on
        // both ends, and the connecting process (this one), as PgBouncer.
        // (The canary's console logins are admin's too, through TCP: the
        // row is the one on the socket's side.)
        let rows = console_unix(dir, port, "SHOW CLIENTS").await;
        let admin = rows
            .iter()
            .find(|r| get(r, "user") == Some("admin") && get(r, "local_addr") == Some("unix"))
            .unwrap_or_else(|| panic!("{rows:?}"));
        let port_text = port.to_string();
        assert_eq!(get(admin, "addr"), Some("unix"));
        assert_eq!(get(admin, "port"), Some(port_text.as_str()));
        assert_eq!(get(admin, "local_addr"), Some("unix"));
        assert_eq!(get(admin, "local_port"), Some(port_text.as_str()));
        let me = std::process::id().to_string();
        assert_eq!(get(admin, "remote_pid"), Some(me.as_str()));
        canary.check();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ssl_request_on_the_socket_is_answered_n_as_postgres_does() {
    let pg = PgCluster::shared();
    let sockets = tempfile::tempdir().unwrap();
    let certs = tempfile::tempdir().unwrap();
    let ca = TestCa::new("unix socket CA");
    let pair = ca.server(&["127.0.0.1"]);
    let cert = write_file(certs.path(), "usher.crt", &pair.cert_pem);
    let key = write_file(certs.path(), "usher.key", &pair.key_pem);
    // TLS required: of TCP clients; the socket has none to offer.
    let usher = Usher::start(
        pg,
        &format!(
            "unix_socket_dir: {}\ntls:\n  mode: require\n  cert: {}\n  key: {}\n",
            sockets.path().display(),
            cert.display(),
            key.display()
        ),
    )
    .await;
    let port = usher.addr.port();
    let mut s = tokio::net::UnixStream::connect(socket(sockets.path(), port))
        .await
        .unwrap();
    let mut request = 8u32.to_be_bytes().to_vec();
    request.extend_from_slice(&80877103u32.to_be_bytes());
    s.write_all(&request).await.unwrap();
    assert_eq!(s.read_u8().await.unwrap(), b'N');
    drop(s);
    let alice = connect_unix(sockets.path(), port, "alice", ALICE_PASSWORD, "app")
        .await
        .expect("a plaintext client of the socket is not refused by tls.mode: require");
    alice.simple_query("select 1").await.unwrap();
    let e = usher.connect_as("alice", ALICE_PASSWORD).await.unwrap_err();
    assert_eq!(
        sqlstate(&e).as_deref(),
        Some("28000"),
        "TCP still requires TLS"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_hba_rules_decide_for_socket_clients_and_host_rules_do_not() {
    let pg = PgCluster::shared();
    let sockets = tempfile::tempdir().unwrap();
    let usher = Usher::start(
        pg,
        &format!(
            "unix_socket_dir: {}\nauth:\n  hba:\n\
             \x20   - {{ type: local, database: all, user: bob, method: reject }}\n\
             \x20   - {{ type: local, database: app, user: alice, method: trust }}\n\
             \x20   - {{ type: host, database: all, user: all, address: all, method: scram-sha-256 }}\n",
            sockets.path().display()
        ),
    )
    .await;
    let (dir, port) = (sockets.path(), usher.addr.port());
    // trust from the local rule: the password is not asked for.
    let alice = connect_unix(dir, port, "alice", "not-checked", "app")
        .await
        .expect("trusted on the socket");
    alice.simple_query("select 1").await.unwrap();
    let refused = |e: tokio_postgres::Error| {
        let db = e.as_db_error().expect("an error from usher").clone();
        (db.code().code().to_string(), db.message().to_string())
    };
    let e = connect_unix(dir, port, "bob", BOB_PASSWORD, "app")
        .await
        .unwrap_err();
    assert_eq!(
        refused(e),
        (
            "28000".into(),
            "HBA rejects connection for host \"[local]\", user \"bob\", database \"app\", no encryption".into()
        )
    );
    // No local rule for admin: `host ... all` is not the socket.
    let e = connect_unix(dir, port, "admin", "admin-pw", "app")
        .await
        .unwrap_err();
    assert_eq!(
        refused(e),
        (
            "28000".into(),
            "no HBA entry for host \"[local]\", user \"admin\", database \"app\", no encryption"
                .into()
        )
    );
    // And the local rule is not TCP's: alice needs her password there.
    let e = usher.connect_as("alice", "not-checked").await.unwrap_err();
    assert_eq!(sqlstate(&e).as_deref(), Some("28P01"));
    usher
        .connect_as("bob", BOB_PASSWORD)
        .await
        .expect("bob over TCP");
    let out = psql_err(
        &format!("host={} port={port} user=bob dbname=app", dir.display()),
        Some(BOB_PASSWORD),
        "select 1",
    )
    .await;
    assert!(
        out.contains("HBA rejects connection for host \"[local]\""),
        "{out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_file_goes_at_shutdown_and_a_live_socket_stops_a_second_start() {
    let pg = PgCluster::shared();
    let sockets = tempfile::tempdir().unwrap();
    let yaml = format!("unix_socket_dir: {}\n", sockets.path().display());
    let usher = Usher::start(pg, &yaml).await;
    let path = socket(sockets.path(), usher.addr.port());
    assert!(path.exists());

    // Another usher on the same port's socket, without so_reuseport: the
    // path is live, and starting is an error that says so (the TCP port
    // is free: another address).
    let second = crate::common::usher_yaml(pg, &yaml).replacen(
        "listen: 127.0.0.1:0",
        &format!("listen: 127.0.0.2:{}", usher.addr.port()),
        1,
    );
    let config = usher::Config::from_yaml(&second, "second.yaml").unwrap();
    let e = match usher::Server::bind(config, Default::default()).await {
        Ok(_) => panic!("a second usher started on a live socket"),
        Err(e) => e,
    };
    assert!(e.to_string().contains("another process listens"), "{e}");
    assert!(path.exists(), "the live socket is left alone");

    drop(usher);
    eventually(
        Duration::from_secs(10),
        "the socket file is removed",
        || !path.exists(),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_with_so_reuseport_leaves_the_new_ushers_socket() {
    let pg = PgCluster::shared();
    let sockets = tempfile::tempdir().unwrap();
    let extra = format!(
        "so_reuseport: true\nunix_socket_dir: {}\n",
        sockets.path().display()
    );
    let old = UsherProcess::builder(pg).extra(&extra).start();
    let port = old.addr().port();
    let path = socket(sockets.path(), port);
    // The TCP port listens a moment before the socket is in place.
    eventually(Duration::from_secs(10), "the socket is made", || {
        path.exists()
    });
    let before = connect_unix(sockets.path(), port, "alice", ALICE_PASSWORD, "app")
        .await
        .expect("through the old usher's socket");
    let new = UsherProcess::builder(pg)
        .extra(&extra)
        .first_port(port)
        .start();
    // The old usher's client is still served; the path is the new one's.
    before.simple_query("select 1").await.unwrap();
    let mut old = old;
    old.signal(libc::SIGTERM);
    drop(before);
    old.wait_exit(Duration::from_secs(30));
    assert!(path.exists(), "the old usher left the new one's socket");
    let after = connect_unix(sockets.path(), port, "alice", ALICE_PASSWORD, "app")
        .await
        .expect("through the new usher's socket");
    after.simple_query("select 1").await.unwrap();
    drop(new);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_lets_the_mapped_os_user_in_and_refuses_the_rest_with_28000() {
    use crate::common::attempts::expect_outcome;
    use usher::auth::AuthOutcome;
    let pg = PgCluster::shared();
    let sockets = tempfile::tempdir().unwrap();
    // The postgres OS user reaches the socket too.
    std::fs::set_permissions(
        sockets.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let usher = Usher::start(
        pg,
        &format!(
            "unix_socket_dir: {}\nauth:\n  hba:\n\
             \x20   - {{ type: local, database: all, user: all, method: peer, map: m }}\n\
             \x20   - {{ type: host, database: all, user: all, address: all, method: scram-sha-256 }}\n\
             \x20 ident:\n\
             \x20   - {{ map: m, system_user: root, user: alice }}\n\
             \x20   - {{ map: m, system_user: '/^(post)gres$', user: 'bob' }}\n",
            sockets.path().display()
        ),
    )
    .await;
    let (dir, port) = (sockets.path(), usher.addr.port());
    let mut attempts = usher.app.auth_attempts();

    // These tests run as root; the map lets root in as alice, whatever
    // password the client has (none is asked for).
    let alice = connect_unix(dir, port, "alice", "not-asked", "app")
        .await
        .expect("root is alice through the map");
    let who: String = alice
        .query_one("select current_user::text", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(who, "alice", "usher logged in to the server as alice");
    let a = expect_outcome(&mut attempts, "alice", AuthOutcome::Success).await;
    assert_eq!(a.method, "peer");
    assert_eq!(a.client_addr.shown(), "unix");

    // Root is not bob: refused as PostgreSQL refuses.
    let e = connect_unix(dir, port, "bob", BOB_PASSWORD, "app")
        .await
        .unwrap_err();
    let db = e.as_db_error().expect("an error from usher");
    assert_eq!(
        (db.code().code(), db.message()),
        ("28000", "Peer authentication failed for user \"bob\"")
    );
    expect_outcome(&mut attempts, "bob", AuthOutcome::WrongPassword).await;
    // A user usher does not know is told the same.
    let e = connect_unix(dir, port, "nobody_here", "x", "app")
        .await
        .unwrap_err();
    assert_eq!(
        e.as_db_error().map(|d| d.message().to_string()),
        Some("Peer authentication failed for user \"nobody_here\"".into())
    );

    // Another OS user (postgres, uid 101 here), matched by the expression.
    let out = tokio::process::Command::new("runuser")
        .args(["-u", "postgres", "--", "psql", "-X", "-t", "-A", "-d"])
        .arg(format!(
            "host={} port={port} user=bob dbname=app",
            dir.display()
        ))
        .args(["-c", "select current_user"])
        .env_remove("PGPASSWORD")
        .output()
        .await
        .expect("runuser runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "bob");

    // TCP clients never match local rules: the host rule asks for a password.
    let e = usher.connect_as("alice", "not-asked").await.unwrap_err();
    assert_eq!(sqlstate(&e).as_deref(), Some("28P01"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_as_auth_method_refuses_tcp_clients_as_postgres_would() {
    let pg = PgCluster::shared();
    let sockets = tempfile::tempdir().unwrap();
    let usher = Usher::start(
        pg,
        &format!(
            "unix_socket_dir: {}\nauth:\n  method: peer\n",
            sockets.path().display()
        ),
    )
    .await;
    let e = usher.connect_as("alice", ALICE_PASSWORD).await.unwrap_err();
    let db = e.as_db_error().expect("an error from usher");
    assert_eq!(
        (db.code().code(), db.message()),
        ("28000", "Peer authentication failed for user \"alice\"")
    );
    // Without a map, root may log in only as `root`.
    let e = connect_unix(sockets.path(), usher.addr.port(), "alice", "x", "app")
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&e).as_deref(), Some("28000"));
}
