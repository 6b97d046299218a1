//! The hook cookbook of docs/hooks.md: each recipe file in docs/cookbook/
//! is loaded as it is, alone, into an usher in front of a real PostgreSQL,
//! and real clients check that it does what the doc says. The doc shows
//! each file verbatim.

use crate::common::wait::{wait_for, DEADLINE};
use crate::common::{sqlstate, PgCluster, Usher, ALICE_PASSWORD, BOB_PASSWORD};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// The recipes, as files of docs/cookbook/ (routing-table.lua and
/// tenant-in-user-name.lua are run by routing.rs, over two shards).
const RECIPES: [&str; 8] = [
    "auth-monitor-notice.lua",
    "count-logins.lua",
    "per-role-settings.lua",
    "refuse-by-address.lua",
    "routing-table.lua",
    "tenant-in-user-name.lua",
    "tenant-settings.lua",
    "time-window.lua",
];

fn cookbook() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/cookbook")
}

/// A hooks folder holding one recipe, copied from docs/cookbook/.
fn hooks_with(recipe: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(cookbook().join(recipe), dir.path().join(recipe)).unwrap();
    dir
}

/// usher in front of `pg` with one recipe as its only hook: alice, bob and
/// `logins` (name, password) may log in, `usher.query` and the role graph
/// run as alice, and `extra` adds top-level keys. The budgets are generous:
/// a hook's first `usher.query` or role lookup opens a connection (SCRAM in
/// a debug build), slow on a loaded machine. (A session_start hook that
/// fails is only a WARNING to the client: the per-role test prints them.)
async fn usher_with(
    pg: &PgCluster,
    recipe: &str,
    logins: &[(&str, &str)],
    extra: &str,
) -> (Usher, tempfile::TempDir) {
    let hooks = hooks_with(recipe);
    let mut users = format!(
        "  alice:\n    password: {ALICE_PASSWORD}\n  bob:\n    password: {BOB_PASSWORD}\n  admin:\n    password: admin-pw\n"
    );
    for (name, password) in logins {
        users.push_str(&format!("  {name}:\n    password: {password}\n"));
    }
    let yaml = format!(
        "listen: 127.0.0.1:0\n\
         databases:\n  app:\n    host: 127.0.0.1\n    port: {}\n\
         users:\n{users}\
         admin:\n  users: [admin]\n\
         hooks:\n  dir: {}\n  timeout_ms: 10000\n  query: {{ database: app, user: alice, timeout_ms: 10000 }}\n\
         {extra}",
        pg.port,
        hooks.path().display()
    );
    (Usher::start_yaml(&yaml).await, hooks)
}

async fn setting(c: &tokio_postgres::Client, name: &str) -> Option<String> {
    c.query_one("SELECT current_setting($1, true)", &[&name])
        .await
        .unwrap()
        .get(0)
}

/// Connects to `port` from the local address `source` (any of 127.0.0.0/8
/// reaches usher on 127.0.0.1).
async fn connect_from(
    source: &str,
    port: u16,
    user: &str,
    password: &str,
) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(format!("{source}:0").parse().unwrap()).unwrap();
    let stream = socket.connect(([127, 0, 0, 1], port).into()).await.unwrap();
    let mut config = tokio_postgres::Config::new();
    config.user(user).password(password).dbname("app");
    let (client, conn) = config.connect_raw(stream, tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    Ok(client)
}

/// Connects and collects the NOTICE messages the client is sent.
async fn connect_with_notices(
    usher: &Usher,
    user: &str,
    password: &str,
) -> (tokio_postgres::Client, Arc<Mutex<Vec<String>>>) {
    use futures_util::StreamExt;
    let (c, mut conn) =
        tokio_postgres::connect(&usher.conn_str(user, password), tokio_postgres::NoTls)
            .await
            .unwrap();
    let notices = Arc::new(Mutex::new(Vec::new()));
    let sink = notices.clone();
    tokio::spawn(async move {
        let mut stream = futures_util::stream::poll_fn(move |cx| conn.poll_message(cx));
        while let Some(Ok(msg)) = stream.next().await {
            if let tokio_postgres::AsyncMessage::Notice(n) = msg {
                sink.lock().unwrap().push(n.message().to_string());
            }
        }
    });
    (c, notices)
}

/// The FATAL error a refused login got: (SQLSTATE, message, hint).
fn refusal(e: tokio_postgres::Error) -> (String, String, Option<String>) {
    let db = e.as_db_error().unwrap_or_else(|| panic!("{e:?}"));
    assert_eq!(db.severity(), "FATAL", "{db:?}");
    (
        db.code().code().to_string(),
        db.message().to_string(),
        db.hint().map(str::to_string),
    )
}

#[test]
fn every_recipe_is_tested_and_shown_verbatim_in_hooks_md() {
    let mut files: Vec<String> = std::fs::read_dir(cookbook())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".lua"))
        .collect();
    files.sort();
    assert_eq!(files, RECIPES, "docs/cookbook/ and this test's RECIPES");
    let doc = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/hooks.md"))
        .unwrap();
    for recipe in RECIPES {
        let code = std::fs::read_to_string(cookbook().join(recipe)).unwrap();
        assert!(
            doc.contains(&format!("```lua\n{code}```")),
            "docs/hooks.md does not show docs/cookbook/{recipe} as it is"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_role_settings_follow_members_of_the_role() {
    let pg = PgCluster::shared();
    pg.ensure_role("reporting", "NOLOGIN");
    pg.ensure_role("etl", "NOLOGIN");
    pg.psql_super("GRANT reporting TO bob");
    for mode in ["transaction", "session"] {
        let (usher, _hooks) = usher_with(
            pg,
            "per-role-settings.lua",
            &[],
            &format!("pool_mode: {mode}\n"),
        )
        .await;
        let (bob, notices) = connect_with_notices(&usher, "bob", BOB_PASSWORD).await;
        assert_eq!(
            setting(&bob, "search_path").await.as_deref(),
            Some("reports, public"),
            "{mode} {:?}",
            notices.lock().unwrap()
        );
        assert_eq!(
            setting(&bob, "statement_timeout").await.as_deref(),
            Some("30s")
        );
        assert_eq!(setting(&bob, "work_mem").await.as_deref(), Some("4MB"));
        bob.batch_execute("SET search_path = public").await.unwrap();
        bob.batch_execute("DISCARD ALL").await.unwrap();
        assert_eq!(
            setting(&bob, "search_path").await.as_deref(),
            Some("reports, public"),
            "{mode}: again after DISCARD ALL"
        );
        let alice = usher.alice().await;
        assert_eq!(
            setting(&alice, "search_path").await.as_deref(),
            Some("\"$user\", public"),
            "{mode}: alice is no member"
        );
        assert_eq!(
            setting(&alice, "statement_timeout").await.as_deref(),
            Some("0")
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn time_window_lets_each_role_in_during_its_hours_only() {
    let pg = PgCluster::shared();
    pg.ensure_role("night_batch", "NOLOGIN");
    pg.ensure_role("day_reports", "NOLOGIN");
    pg.psql_super("GRANT night_batch TO bob");
    pg.psql_super("GRANT day_reports TO alice");
    let (usher, _hooks) = usher_with(pg, "time-window.lua", &[], "").await;
    let utc_hour = || {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        secs / 3600 % 24
    };
    // Whatever the hour, one of the two windows is open and the other
    // closed; tried again if the hour turns meanwhile.
    loop {
        let hour = utc_hour();
        let alice = usher.connect_as("alice", ALICE_PASSWORD).await;
        let bob = usher.connect_as("bob", BOB_PASSWORD).await;
        if utc_hour() != hour {
            continue;
        }
        let day = (8..20).contains(&hour);
        let (admitted, refused, role, window) = if day {
            (alice, bob, "night_batch", ("20:00", "08:00"))
        } else {
            (bob, alice, "day_reports", ("08:00", "20:00"))
        };
        let c = admitted.unwrap_or_else(|e| panic!("{hour}h: {e:?}"));
        c.simple_query("SELECT 1").await.unwrap();
        let (code, message, hint) = refusal(refused.expect_err("outside its window"));
        assert_eq!(code, "57P03");
        assert_eq!(
            message,
            format!(
                "members of {role} may connect only between {} and {} UTC",
                window.0, window.1
            )
        );
        assert_eq!(hint, Some(format!("try again after {} UTC", window.0)));
        break;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_settings_come_from_a_table() {
    let pg = PgCluster::shared();
    pg.psql_super_db(
        "app",
        "CREATE TABLE tenant_settings (role name, name text, value text, PRIMARY KEY (role, name));
         GRANT SELECT ON tenant_settings TO alice;
         INSERT INTO tenant_settings VALUES ('bob', 'app.tenant_id', '42'), ('bob', 'statement_timeout', '5s');",
    );
    let (usher, _hooks) = usher_with(pg, "tenant-settings.lua", &[], "").await;
    let bob = usher.connect_as("bob", BOB_PASSWORD).await.unwrap();
    assert_eq!(setting(&bob, "app.tenant_id").await.as_deref(), Some("42"));
    assert_eq!(
        setting(&bob, "statement_timeout").await.as_deref(),
        Some("5s")
    );
    let alice = usher.alice().await;
    assert_eq!(setting(&alice, "app.tenant_id").await, None);
    assert_eq!(
        setting(&alice, "statement_timeout").await.as_deref(),
        Some("0")
    );

    // A change in the table reaches the next login.
    pg.psql_super_db(
        "app",
        "UPDATE tenant_settings SET value = '43' WHERE name = 'app.tenant_id'",
    );
    let bob = usher.connect_as("bob", BOB_PASSWORD).await.unwrap();
    assert_eq!(setting(&bob, "app.tenant_id").await.as_deref(), Some("43"));

    // Without the table the hook fails, and hooks.on_error refuses.
    pg.psql_super_db(
        "app",
        "ALTER TABLE tenant_settings RENAME TO tenant_settings_gone",
    );
    let e = usher
        .connect_as("bob", BOB_PASSWORD)
        .await
        .expect_err("the hook failed");
    assert_eq!(sqlstate(&e).as_deref(), Some("28000"), "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refuse_by_address_keeps_members_to_their_networks() {
    let pg = PgCluster::shared();
    pg.ensure_role("dba", "NOLOGIN");
    pg.psql_super("GRANT dba TO bob");
    let (usher, _hooks) = usher_with(pg, "refuse-by-address.lua", &[], "").await;
    let port = usher.addr.port();
    let bob = connect_from("127.0.0.1", port, "bob", BOB_PASSWORD)
        .await
        .expect("127.0.0.1/32 is bob's");
    bob.simple_query("SELECT 1").await.unwrap();
    let e = connect_from("127.0.0.2", port, "bob", BOB_PASSWORD)
        .await
        .expect_err("127.0.0.2 is not");
    assert_eq!(
        refusal(e),
        (
            "28000".to_string(),
            "members of dba may not connect from 127.0.0.2".to_string(),
            Some("connect from the admin network".to_string())
        )
    );
    let alice = connect_from("127.0.0.2", port, "alice", ALICE_PASSWORD)
        .await
        .expect("alice is no member of dba");
    alice.simple_query("SELECT 1").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn count_logins_limits_a_user_per_minute() {
    let pg = PgCluster::shared();
    pg.ensure_role("batch_loader", "LOGIN PASSWORD 'loader-pw'");
    let (usher, _hooks) =
        usher_with(pg, "count-logins.lua", &[("batch_loader", "loader-pw")], "").await;
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(
            usher
                .connect_as("batch_loader", "loader-pw")
                .await
                .expect("within the limit"),
        );
    }
    let e = usher
        .connect_as("batch_loader", "loader-pw")
        .await
        .expect_err("the fourth login of the minute");
    let (code, message, hint) = refusal(e);
    assert_eq!(code, "53300");
    assert_eq!(
        message,
        "too many logins for user batch_loader: 4 within a minute, at most 3"
    );
    assert_eq!(hint.as_deref(), Some("reuse connections, or wait a minute"));
    // Users without a limit are counted, not refused.
    for _ in 0..5 {
        held.push(usher.alice().await);
    }
    use usher::hooks::shared::SharedValue;
    let shared = &usher.app.lua_services.shared;
    assert_eq!(shared.get("logins/alice"), Some(SharedValue::Int(5)));
    assert_eq!(shared.get("logins/batch_loader"), Some(SharedValue::Int(4)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_monitor_notice_tells_a_user_of_failed_logins() {
    let pg = PgCluster::shared();
    let (usher, _hooks) = usher_with(
        pg,
        "auth-monitor-notice.lua",
        &[],
        "auth_monitor:\n  store: { database: app, user: alice }\n",
    )
    .await;
    for _ in 0..2 {
        let e = usher
            .connect_as("bob", "wrong")
            .await
            .expect_err("wrong password");
        assert_eq!(sqlstate(&e).as_deref(), Some("28P01"));
    }
    // The store has them once this instance flushed its counts.
    wait_for(DEADLINE, "bob's failures in the store", || {
        // By oid or by name (uid 0): see the recipe.
        let n = pg.psql_super_db(
            "app",
            "SELECT sum(other_auth_failures) FROM usher_auth_mon_roles \
             WHERE uid = 'bob'::regrole OR (uid = 0 AND name = 'bob')",
        );
        if n == "2" {
            Ok(())
        } else {
            Err(n)
        }
    });
    let (bob, notices) = connect_with_notices(&usher, "bob", BOB_PASSWORD).await;
    bob.simple_query("SELECT 1").await.unwrap();
    let notices = notices.lock().unwrap().clone();
    assert_eq!(notices.len(), 1, "{notices:?}");
    assert!(
        notices[0].starts_with("2 failed login attempts as bob so far (0 refused), the last at ")
            && notices[0].ends_with(" UTC from 127.0.0.1"),
        "{notices:?}"
    );
    let (alice, notices) = connect_with_notices(&usher, "alice", ALICE_PASSWORD).await;
    alice.simple_query("SELECT 1").await.unwrap();
    assert_eq!(*notices.lock().unwrap(), Vec::<String>::new());
}
