//! HBA rules: the first matching rule picks the method; `reject` and no
//! match refuse with 28000 in PostgreSQL's words; hostssl/hostnossl follow
//! TLS; `+role` asks the server; the pg_hba.conf file format.

use crate::common::attempts::expect_outcome;
use crate::common::tls::{psql_err, psql_ok, write_file, TestCa};
use crate::common::{PgCluster, Usher, ALICE_PASSWORD, BOB_PASSWORD};
use usher::auth::AuthOutcome;

/// The error usher sends (SQLSTATE, message) for a refused login.
async fn refused(usher: &Usher, user: &str, password: &str) -> (String, String) {
    let e = usher
        .connect_as(user, password)
        .await
        .expect_err("login refused");
    let db = e.as_db_error().expect("an error from usher");
    (db.code().code().to_string(), db.message().to_string())
}

/// A cluster of its own: the tests grant roles to bob.
fn own_cluster() -> &'static PgCluster {
    PgCluster::own(module_path!())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hba_rules_choose_the_method_or_refuse_with_28000() {
    let pg = own_cluster();
    let usher = Usher::start(
        pg,
        "auth:\n  method: scram-sha-256\n  hba:\n\
         \x20   - { type: host, database: all, user: bob, address: 127.0.0.1/32, method: reject }\n\
         \x20   - { type: host, database: app, user: alice, address: 127.0.0.1/32, method: trust }\n\
         \x20   - { type: host, database: all, user: admin, address: 10.0.0.0/8, method: trust }\n",
    )
    .await;
    let mut attempts = usher.app.auth_attempts();

    // trust from the rule, not scram-sha-256 from auth.method.
    usher
        .connect_as("alice", "not-checked")
        .await
        .expect("trusted");
    let a = expect_outcome(&mut attempts, "alice", AuthOutcome::Success).await;
    assert_eq!(a.method, "trust");

    assert_eq!(
        refused(&usher, "bob", BOB_PASSWORD).await,
        (
            "28000".into(),
            "HBA rejects connection for host \"127.0.0.1\", user \"bob\", database \"app\", no encryption".into()
        )
    );
    let b = expect_outcome(&mut attempts, "bob", AuthOutcome::HbaReject).await;
    assert!(b.user_exists);

    for user in ["admin", "mallory"] {
        assert_eq!(
            refused(&usher, user, "x").await,
            (
                "28000".into(),
                format!("no HBA entry for host \"127.0.0.1\", user \"{user}\", database \"app\", no encryption")
            )
        );
        let a = expect_outcome(&mut attempts, user, AuthOutcome::HbaReject).await;
        assert_eq!(a.user_exists, user == "admin");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostssl_and_hostnossl_follow_the_connections_encryption() {
    let pg = own_cluster();
    let ca = TestCa::new("hba CA");
    let dir = tempfile::tempdir().unwrap();
    let pair = ca.server(&["127.0.0.1"]);
    let cert = write_file(dir.path(), "usher.crt", &pair.cert_pem);
    let key = write_file(dir.path(), "usher.key", &pair.key_pem);
    let usher = Usher::start(
        pg,
        &format!(
            "tls:\n  cert: {}\n  key: {}\nauth:\n  hba:\n\
             \x20   - {{ type: hostssl, database: all, user: alice, address: all, method: scram-sha-256 }}\n\
             \x20   - {{ type: hostnossl, database: all, user: alice, address: all, method: reject }}\n\
             \x20   - {{ type: hostnossl, database: all, user: bob, address: all, method: scram-sha-256 }}\n",
            cert.display(),
            key.display()
        ),
    )
    .await;
    let conninfo = |user: &str, sslmode: &str| {
        format!(
            "host=127.0.0.1 port={} user={user} dbname=app sslmode={sslmode}",
            usher.addr.port()
        )
    };
    let sql = "SELECT current_user";
    assert_eq!(
        psql_ok(&conninfo("alice", "require"), Some(ALICE_PASSWORD), sql).await,
        "alice"
    );
    let e = psql_err(&conninfo("alice", "disable"), Some(ALICE_PASSWORD), sql).await;
    assert!(
        e.contains("HBA rejects connection for host \"127.0.0.1\", user \"alice\", database \"app\", no encryption"),
        "{e}"
    );
    assert_eq!(
        psql_ok(&conninfo("bob", "disable"), Some(BOB_PASSWORD), sql).await,
        "bob"
    );
    let e = psql_err(&conninfo("bob", "require"), Some(BOB_PASSWORD), sql).await;
    assert!(
        e.contains(
            "no HBA entry for host \"127.0.0.1\", user \"bob\", database \"app\", SSL encryption"
        ),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plus_role_rules_ask_the_server_about_membership() {
    let pg = own_cluster();
    // bob is in ops through staff; alice is in neither.
    pg.psql_super(
        "CREATE ROLE ops NOLOGIN; CREATE ROLE staff NOLOGIN; GRANT ops TO staff; GRANT staff TO bob;",
    );
    let usher = Usher::start(
        pg,
        "auth:\n  user: alice\n  hba:\n\
         \x20   - { type: host, database: all, user: +ops, address: all, method: trust }\n\
         \x20   - { type: host, database: all, user: all, address: all, method: reject }\n",
    )
    .await;
    let c = usher
        .connect_as("bob", "not-checked")
        .await
        .expect("bob is trusted as a member of ops");
    c.query_one("SELECT 1", &[]).await.unwrap();
    let (code, message) = refused(&usher, "alice", ALICE_PASSWORD).await;
    assert_eq!(code, "28000");
    assert!(message.starts_with("HBA rejects connection"), "{message}");

    // Without auth.user there is no one to ask: a configuration error.
    let config = usher::Config::from_yaml(
        "auth:\n  hba: [ { type: host, database: all, user: +ops, address: all, method: trust } ]\n",
        "hba.yaml",
    )
    .unwrap();
    let e = usher::App::new(config).expect_err("+role needs auth.user");
    assert_eq!((e.file.as_str(), e.key.as_str()), ("hba.yaml", "auth.hba"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_hba_file_in_pg_hba_conf_format_works() {
    let pg = own_cluster();
    let dir = tempfile::tempdir().unwrap();
    let file = write_file(
        dir.path(),
        "pg_hba.conf",
        "# TYPE  DATABASE  USER   ADDRESS                    METHOD\n\
         host    app       alice  127.0.0.1 255.255.255.255  trust\n\
         host    all       all    ::1/128                    reject\n\
         host    all       all    0.0.0.0/0                  scram-sha-256\n",
    );
    let usher = Usher::start(pg, &format!("auth:\n  hba_file: {}\n", file.display())).await;
    usher
        .connect_as("alice", "not-checked")
        .await
        .expect("trust");
    assert_eq!(refused(&usher, "bob", "wrong").await.0, "28P01");
    usher.connect_as("bob", BOB_PASSWORD).await.expect("scram");

    // A bad line is a configuration error naming the file and the line.
    let bad = write_file(
        dir.path(),
        "bad_hba.conf",
        "host all all all trust\nhost all all all ident\n",
    );
    let config =
        usher::Config::from_yaml(&format!("auth:\n  hba_file: {}\n", bad.display()), "u.yaml")
            .unwrap();
    let e = usher::App::new(config).expect_err("bad file");
    assert_eq!(e.key, "auth.hba_file");
    assert!(
        e.message
            .contains("bad_hba.conf: line 2: unsupported method `ident`"),
        "{e}"
    );

    // cert rules with no client certificates to check: an error, not a lockout.
    let cert = write_file(dir.path(), "cert_hba.conf", "hostssl all all all cert\n");
    let config = usher::Config::from_yaml(
        &format!("auth:\n  hba_file: {}\n", cert.display()),
        "u.yaml",
    )
    .unwrap();
    let e = usher::App::new(config).expect_err("cert without tls.ca");
    assert_eq!(e.key, "auth.hba_file");
    assert!(e.message.contains("tls.ca"), "{e}");
}
