//! Credential sources beyond the config: `auth.file` (userlist.txt) and
//! `auth.user` + `auth.query`, with SCRAM pass-through (roles whose password
//! exists only on the server) and md5 pass-through, cache expiry, and a
//! failing auth query.

use crate::common;

use crate::common::attempts::expect_outcome;
use crate::common::tls::write_file;
use crate::common::{sqlstate, PgCluster, Usher, ALICE_PASSWORD};
use std::sync::OnceLock;
use std::time::Duration;
use usher::auth::AuthOutcome;

const AUTH_PASSWORD: &str = "auth-pw";
const LOOKUP_PASSWORD: &str = "lookup-pw";

/// The module's cluster with the auth roles: `usher_auth` (superuser, reads
/// pg_shadow) and `usher_lookup` (may only call a SECURITY DEFINER lookup).
fn pg() -> &'static PgCluster {
    static READY: OnceLock<()> = OnceLock::new();
    // A cluster of its own: the tests put lines in its pg_hba.conf.
    let pg = PgCluster::own(module_path!());
    READY.get_or_init(|| {
        pg.psql_super(&format!(
            "CREATE ROLE usher_auth LOGIN SUPERUSER PASSWORD '{AUTH_PASSWORD}'; \
             CREATE ROLE usher_lookup LOGIN PASSWORD '{LOOKUP_PASSWORD}';"
        ));
        pg.psql_super_db(
            "app",
            "CREATE FUNCTION public.usher_get_auth(p_user name) \
               RETURNS TABLE (usename name, passwd text) LANGUAGE sql SECURITY DEFINER \
               AS $$ SELECT usename, passwd FROM pg_catalog.pg_shadow WHERE usename = p_user $$; \
             REVOKE ALL ON FUNCTION public.usher_get_auth(name) FROM PUBLIC; \
             GRANT EXECUTE ON FUNCTION public.usher_get_auth(name) TO usher_lookup;",
        );
    });
    pg
}

/// Runs SQL as the superuser, one statement list at a time: concurrent
/// GRANTs and REVOKEs on the same database or schema fail with "tuple
/// concurrently updated".
fn super_sql(db: &str, sql: &str) -> String {
    static CATALOG: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = CATALOG.lock().unwrap_or_else(|e| e.into_inner());
    pg().psql_super_db(db, sql)
}

/// Creates a login role on the server only, with a SCRAM password.
fn server_role(name: &str, password: &str) {
    super_sql(
        "postgres",
        &format!(
            "CREATE ROLE {name} LOGIN PASSWORD '{password}'; GRANT ALL ON DATABASE app TO {name};"
        ),
    );
    super_sql("app", &format!("GRANT ALL ON SCHEMA public TO {name}"));
}

/// usher's YAML with `users.<auth_user>` added and `extra` at the top level.
fn yaml(auth_user: &str, auth_password: &str, extra: &str) -> String {
    common::usher_yaml(pg(), extra).replacen(
        "users:\n",
        &format!("users:\n  {auth_user}:\n    password: {auth_password}\n"),
        1,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scram_role_that_exists_only_on_the_server_logs_in_through_auth_query() {
    server_role("carol", "carol-pw");
    super_sql(
        "app",
        "CREATE TABLE carol_log (n int); ALTER TABLE carol_log OWNER TO carol;",
    );
    for method in ["scram-sha-256", "password", "md5"] {
        let usher = Usher::start_yaml(&yaml(
            "usher_auth",
            AUTH_PASSWORD,
            &format!("pool_mode: transaction\npool_size: 1\nauth:\n  method: {method}\n  user: usher_auth\n"),
        ))
        .await;
        let mut attempts = usher.app.auth_attempts();
        let a = usher
            .connect_as("carol", "carol-pw")
            .await
            .unwrap_or_else(|e| panic!("{method}: {e:?}"));
        let a_attempt = expect_outcome(&mut attempts, "carol", AuthOutcome::Success).await;
        assert!(a_attempt.user_exists);
        assert_eq!(a_attempt.method, method);
        let b = usher.connect_as("carol", "carol-pw").await.unwrap();
        // Transaction mode: both clients take turns on one server connection,
        // which usher logged in to with carol's own SCRAM proof.
        for i in 0..3 {
            a.batch_execute(&format!(
                "BEGIN; INSERT INTO carol_log VALUES ({i}); COMMIT;"
            ))
            .await
            .unwrap();
            let row = b
                .query_one("SELECT current_user::text, count(*) FROM carol_log", &[])
                .await
                .unwrap();
            assert_eq!(row.get::<_, String>(0), "carol", "{method}");
        }
        let pid_a: i32 = a
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .unwrap()
            .get(0);
        let pid_b: i32 = b
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(pid_a, pid_b, "{method}: one shared server connection");

        let e = usher
            .connect_as("carol", "wrong")
            .await
            .expect_err("wrong password refused");
        assert_eq!(sqlstate(&e).as_deref(), Some("28P01"), "{method}");
        expect_outcome(&mut attempts, "carol", AuthOutcome::Success).await;
        expect_outcome(&mut attempts, "carol", AuthOutcome::WrongPassword).await;

        let e = usher.connect_as("nobody", "x").await.expect_err("unknown");
        assert_eq!(sqlstate(&e).as_deref(), Some("28P01"), "{method}");
        let n = expect_outcome(&mut attempts, "nobody", AuthOutcome::UnknownUser).await;
        assert!(!n.user_exists);
    }
    // Users in the config are still found there first.
    let usher = Usher::start_yaml(&yaml(
        "usher_auth",
        AUTH_PASSWORD,
        "auth:\n  user: usher_auth\n",
    ))
    .await;
    usher.alice().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unprivileged_auth_user_can_use_a_security_definer_lookup() {
    server_role("gina", "gina-pw");
    let usher = Usher::start_yaml(&yaml(
        "usher_lookup",
        LOOKUP_PASSWORD,
        "auth:\n  user: usher_lookup\n  query: SELECT usename, passwd FROM public.usher_get_auth($1)\n",
    ))
    .await;
    let c = usher.connect_as("gina", "gina-pw").await.unwrap();
    let me: String = c
        .query_one("SELECT current_user::text", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(me, "gina");
    // The default query would need pg_shadow, which usher_lookup may not read.
    let usher = Usher::start_yaml(&yaml(
        "usher_lookup",
        LOOKUP_PASSWORD,
        "auth:\n  user: usher_lookup\n",
    ))
    .await;
    let e = usher
        .connect_as("gina", "gina-pw")
        .await
        .expect_err("no access");
    assert_eq!(sqlstate(&e).as_deref(), Some("08006"), "{e:?}");
}

/// Retries `f` until it returns true, for up to 15 s.
async fn eventually<F, Fut>(what: &str, f: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    common::wait::eventually_async(Duration::from_secs(15), what, f).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_dropped_on_the_server_stops_working_once_the_cache_expires() {
    server_role("dave", "dave-pw");
    let usher = Usher::start_yaml(&yaml(
        "usher_auth",
        AUTH_PASSWORD,
        "auth:\n  user: usher_auth\n  cache_ttl: 0.5\n",
    ))
    .await;
    usher
        .connect_as("dave", "dave-pw")
        .await
        .expect("dave logs in");
    super_sql(
        "app",
        "REVOKE ALL ON SCHEMA public FROM dave; REVOKE ALL ON DATABASE app FROM dave; DROP ROLE dave;",
    );
    eventually("dave refused after the drop", || async {
        match usher.connect_as("dave", "dave-pw").await {
            Err(e) => {
                assert_eq!(sqlstate(&e).as_deref(), Some("28P01"), "{e:?}");
                true
            }
            Ok(_) => false,
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_password_changed_on_the_server_gives_the_pool_new_scram_keys() {
    server_role("frank", "frank-old");
    let usher = Usher::start_yaml(&yaml(
        "usher_auth",
        AUTH_PASSWORD,
        "pool_size: 1\nauth:\n  user: usher_auth\n  cache_ttl: 0.5\n",
    ))
    .await;
    let c = usher.connect_as("frank", "frank-old").await.unwrap();
    c.query_one("SELECT 1", &[]).await.unwrap();
    drop(c);
    pg().psql_super("ALTER ROLE frank PASSWORD 'frank-new'");
    // The pooled server connection was logged in with the old keys; end it so
    // that usher must log in again.
    pg().psql_super(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = 'frank'",
    );
    eventually("the new password works end to end", || async {
        match usher.connect_as("frank", "frank-new").await {
            Ok(c) => c.query_one("SELECT 1", &[]).await.is_ok(),
            Err(_) => false,
        }
    })
    .await;
    let e = usher
        .connect_as("frank", "frank-old")
        .await
        .expect_err("the old password is refused");
    assert_eq!(sqlstate(&e).as_deref(), Some("28P01"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_file_secrets_log_in_with_scram_and_md5_pass_through() {
    server_role("hank", "hank-pw");
    super_sql(
        "postgres",
        "SET password_encryption = 'md5'; CREATE ROLE erin LOGIN PASSWORD 'erin-pw'; \
         GRANT ALL ON DATABASE app TO erin;",
    );
    pg().prepend_hba("host all erin 127.0.0.1/32 md5");
    let secret = |role: &str| {
        pg().psql_super(&format!(
            "SELECT rolpassword FROM pg_authid WHERE rolname = '{role}'"
        ))
    };
    let (hank, erin) = (secret("hank"), secret("erin"));
    assert!(hank.starts_with("SCRAM-SHA-256$") && erin.starts_with("md5"));
    let dir = tempfile::tempdir().unwrap();
    let file = write_file(
        dir.path(),
        "userlist.txt",
        &format!(";; users usher does not list in its config\n\"hank\" \"{hank}\"\n\"erin\" \"{erin}\"\n"),
    );
    // md5: PostgreSQL's rule, SCRAM for a SCRAM secret and md5 for an md5 one.
    let usher = Usher::start(
        pg(),
        &format!("auth:\n  method: md5\n  file: {}\n", file.display()),
    )
    .await;
    for (user, password) in [("hank", "hank-pw"), ("erin", "erin-pw")] {
        let c = usher
            .connect_as(user, password)
            .await
            .unwrap_or_else(|e| panic!("{user}: {e:?}"));
        let me: String = c
            .query_one("SELECT current_user::text", &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(me, user);
        let e = usher.connect_as(user, "wrong").await.expect_err("wrong");
        assert_eq!(sqlstate(&e).as_deref(), Some("28P01"), "{user}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_auth_query_refuses_with_08006_without_details() {
    server_role("ivan", "ivan-pw");
    let usher = Usher::start_yaml(&yaml(
        "usher_auth",
        "not-the-password",
        "auth:\n  user: usher_auth\n",
    ))
    .await;
    let mut attempts = usher.app.auth_attempts();
    let e = usher
        .connect_as("ivan", "ivan-pw")
        .await
        .expect_err("lookup fails");
    let db = e.as_db_error().expect("an error from usher");
    assert_eq!(db.code().code(), "08006");
    assert!(
        db.message().contains("could not look up the user"),
        "{db:?}"
    );
    assert_eq!(
        db.detail(),
        None,
        "the reason is for the log, not the client"
    );
    expect_outcome(&mut attempts, "ivan", AuthOutcome::Refused).await;
    // Users in the config need no lookup.
    let c = usher.connect_as("alice", ALICE_PASSWORD).await.unwrap();
    c.query_one("SELECT 1", &[]).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_asking_for_a_cleartext_password_gets_the_one_the_client_gave() {
    // usher knows judy only by her SCRAM verifier (auth.query); the server
    // asks usher for judy's password in cleartext (pg_hba `password`).
    server_role("judy", "judy-pw");
    pg().prepend_hba("host all judy 127.0.0.1/32 password");
    for mode in ["session", "transaction"] {
        // The client gives usher the cleartext: usher passes it on.
        let usher = Usher::start_yaml(&yaml(
            "usher_auth",
            AUTH_PASSWORD,
            &format!("pool_mode: {mode}\nauth:\n  method: password\n  user: usher_auth\n"),
        ))
        .await;
        let c = usher
            .connect_as("judy", "judy-pw")
            .await
            .unwrap_or_else(|e| panic!("{mode}: {e:?}"));
        let me: String = c
            .query_one("SELECT current_user::text", &[])
            .await
            .unwrap_or_else(|e| panic!("{mode}: {e:?}"))
            .get(0);
        assert_eq!(me, "judy");

        // SCRAM never shows usher the password: the client is told so.
        let usher = Usher::start_yaml(&yaml(
            "usher_auth",
            AUTH_PASSWORD,
            &format!("pool_mode: {mode}\nauth:\n  method: scram-sha-256\n  user: usher_auth\n"),
        ))
        .await;
        let e = async {
            let c = usher.connect_as("judy", "judy-pw").await?;
            c.query_one("SELECT 1", &[]).await
        }
        .await
        .expect_err("no cleartext to give the server");
        assert_eq!(sqlstate(&e).as_deref(), Some("28000"), "{mode}: {e:?}");
        let db = e.as_db_error().expect("a server-style error");
        assert!(
            db.message().contains("cleartext password") && !db.message().contains("SCRAM keys"),
            "{mode}: {}",
            db.message()
        );
    }
}
