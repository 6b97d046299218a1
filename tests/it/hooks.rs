//! The hook framework through usher against a real PostgreSQL: rejection,
//! session_start (again after DISCARD ALL, across server connections),
//! budgets, reload, the global switch, and the hook API.

use crate::common;

use crate::common::wait::{eventually_async, DEADLINE};
use crate::common::{sqlstate, PgCluster, Usher, UsherProcess, ALICE_PASSWORD, BOB_PASSWORD};
use std::path::Path;
use std::time::{Duration, Instant};

/// A folder of hook files for one test.
struct HookDir(tempfile::TempDir);

impl HookDir {
    fn new(files: &[(&str, &str)]) -> HookDir {
        let dir = HookDir(tempfile::tempdir().unwrap());
        for (name, code) in files {
            dir.write(name, code);
        }
        dir
    }

    fn write(&self, name: &str, code: &str) {
        std::fs::write(self.0.path().join(name), code).unwrap();
    }

    fn path(&self) -> &Path {
        self.0.path()
    }

    /// The `hooks:` section for usher.yaml, with `extra` keys indented under it.
    fn yaml(&self, extra: &str) -> String {
        let mut s = format!("hooks:\n  dir: {}\n", self.path().display());
        if !extra.contains("timeout_ms") {
            s.push_str("  timeout_ms: 300\n");
        }
        for line in extra.lines() {
            s.push_str(&format!("  {line}\n"));
        }
        s
    }
}

async fn setting(c: &tokio_postgres::Client, name: &str) -> String {
    c.query_one("SELECT current_setting($1)", &[&name])
        .await
        .unwrap()
        .get(0)
}

/// Runs an admin console command as the `admin` user.
async fn console(
    usher: &Usher,
    command: &str,
) -> Result<Vec<tokio_postgres::SimpleQueryMessage>, tokio_postgres::Error> {
    common::console::console_messages(usher.addr.port(), command).await
}

/// SHOW HOOKS as (hook, column) → value.
async fn show_hooks(usher: &Usher) -> Vec<std::collections::HashMap<String, String>> {
    console(usher, "SHOW HOOKS")
        .await
        .unwrap()
        .into_iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => Some(
                r.columns()
                    .iter()
                    .enumerate()
                    .map(|(i, c)| (c.name().to_string(), r.get(i).unwrap_or("").to_string()))
                    .collect(),
            ),
            _ => None,
        })
        .collect()
}

/// Connects and collects the NOTICE/WARNING messages the server sends.
async fn connect_with_notices(
    usher: &Usher,
    user: &str,
    password: &str,
) -> (
    tokio_postgres::Client,
    std::sync::Arc<std::sync::Mutex<Vec<String>>>,
) {
    use futures_util::StreamExt;
    let (c, mut conn) =
        tokio_postgres::connect(&usher.conn_str(user, password), tokio_postgres::NoTls)
            .await
            .unwrap();
    let notices = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = notices.clone();
    tokio::spawn(async move {
        let mut stream = futures_util::stream::poll_fn(move |cx| conn.poll_message(cx));
        while let Some(Ok(msg)) = stream.next().await {
            if let tokio_postgres::AsyncMessage::Notice(n) = msg {
                sink.lock()
                    .unwrap()
                    .push(format!("{}: {}", n.severity(), n.message()));
            }
        }
    });
    (c, notices)
}

const REJECT_BOB: &str = r#"
function client_connection(ctx)
  if ctx.user == "bob" then
    ctx:reject("bob may not connect", { sqlstate = "28000", detail = "by policy", hint = "ask the DBA" })
  end
end
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_client_gets_the_hook_message_and_no_server_connection() {
    let pg = PgCluster::shared();
    let hooks = HookDir::new(&[("10-reject.lua", REJECT_BOB)]);
    let usher = Usher::start(pg, &hooks.yaml("")).await;
    let e = usher
        .connect_as("bob", BOB_PASSWORD)
        .await
        .expect_err("bob is rejected");
    let db = e.as_db_error().unwrap();
    assert_eq!(
        (db.code().code(), db.message()),
        ("28000", "bob may not connect")
    );
    assert_eq!(db.severity(), "FATAL");
    assert_eq!(db.detail(), Some("by policy"));
    assert_eq!(db.hint(), Some("ask the DBA"));
    // The login takes its pool after the hooks: a rejected one makes none
    // (and none of bob's pools, if another login made one, connected).
    let bob_connects: u64 = usher
        .app
        .deps
        .pools
        .all()
        .iter()
        .filter(|p| p.user == "bob")
        .map(|p| {
            p.stats
                .server_connects
                .load(std::sync::atomic::Ordering::Relaxed)
        })
        .sum();
    assert_eq!(bob_connects, 0, "no server connection was used for bob");
    assert_eq!(
        usher
            .alice()
            .await
            .query_one("SELECT 1", &[])
            .await
            .unwrap()
            .get::<_, i32>(0),
        1
    );
    let rows = show_hooks(&usher).await;
    assert_eq!(rows[0]["hook"], "10-reject.lua");
    assert_eq!(rows[0]["events"], "client_connection");
    assert_eq!(rows[0]["rejects"], "1");
    assert_eq!(rows[0]["calls"], "2");
}

const SESSION_HOOK: &str = r#"
function session_start(ctx)
  ctx:set("search_path", "pg_catalog")
  ctx:set("application_name", ctx.reason)
end
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_start_runs_again_after_discard_all() {
    let pg = PgCluster::shared();
    let hooks = HookDir::new(&[("20-session.lua", SESSION_HOOK)]);
    for mode in ["transaction", "session"] {
        let usher = Usher::start(pg, &format!("pool_mode: {mode}\n{}", hooks.yaml(""))).await;
        let c = usher.alice().await;
        assert_eq!(setting(&c, "search_path").await, "pg_catalog", "{mode}");
        assert_eq!(
            setting(&c, "application_name").await,
            "new_session",
            "{mode}"
        );
        c.batch_execute("SET search_path = public; SET application_name = 'mine'")
            .await
            .unwrap();
        assert_eq!(setting(&c, "application_name").await, "mine", "{mode}");
        c.batch_execute("DISCARD ALL").await.unwrap();
        // DISCARD ALL reset everything; session_start ran again and set its values back.
        assert_eq!(setting(&c, "search_path").await, "pg_catalog", "{mode}");
        assert_eq!(
            setting(&c, "application_name").await,
            "discard_all",
            "{mode}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_mode_tells_a_reused_server_connection() {
    let pg = PgCluster::shared();
    let hooks = HookDir::new(&[(
        "20-session.lua",
        r#"
function session_start(ctx)
  ctx:set("application_name", ctx.reason .. "/" .. tostring(ctx.server.fresh) .. "/" .. ctx.server.backend_pid)
end
"#,
    )]);
    let usher = Usher::start(
        pg,
        &format!("pool_mode: session\npool_size: 1\n{}", hooks.yaml("")),
    )
    .await;
    let pid = {
        let c = usher.alice().await;
        let pid: i32 = c
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(
            setting(&c, "application_name").await,
            format!("new_session/true/{pid}")
        );
        pid
    };
    // The server connection is back in the pool.
    common::console::wait_pool(usher.addr.port(), "alice", "sv_idle", "1").await;
    let c = usher.alice().await;
    assert_eq!(
        setting(&c, "application_name").await,
        format!("reused_server/false/{pid}")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_start_parameters_follow_the_session_across_server_connections() {
    let pg = PgCluster::shared();
    let hooks = HookDir::new(&[(
        "20-timeout.lua",
        r#"
function session_start(ctx)
  if ctx.application_name == "timed" then ctx:set("statement_timeout", "1234ms") end
end
"#,
    )]);
    // One worker: its idle list is last in, first out, so b's transaction
    // decides which connection a gets (with two, each would keep its own).
    let usher = Usher::start(
        pg,
        &format!(
            "pool_mode: transaction\npool_size: 2\nworkers: 1\n{}",
            hooks.yaml("")
        ),
    )
    .await;
    let conn = format!(
        "{} application_name=timed",
        usher.conn_str("alice", ALICE_PASSWORD)
    );
    let (a, driver) = tokio_postgres::connect(&conn, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(driver);
    // Another client of the same pool, without the hook's setting.
    let mut b = usher.alice().await;
    let mut pids = std::collections::HashSet::new();
    for i in 0..6 {
        let tx = if i % 2 == 0 {
            Some(b.transaction().await.unwrap())
        } else {
            None
        };
        if let Some(tx) = &tx {
            assert_eq!(
                tx.query_one("SELECT current_setting('statement_timeout')", &[])
                    .await
                    .unwrap()
                    .get::<_, String>(0),
                "0"
            );
        }
        let row = a
            .query_one(
                "SELECT current_setting('statement_timeout'), pg_backend_pid()",
                &[],
            )
            .await
            .unwrap();
        assert_eq!(row.get::<_, String>(0), "1234ms", "round {i}");
        pids.insert(row.get::<_, i32>(1));
        if let Some(tx) = tx {
            tx.commit().await.unwrap();
        }
    }
    assert_eq!(pids.len(), 2, "alice ran on both server connections");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hook_that_loops_forever_is_stopped_and_others_are_served() {
    let pg = PgCluster::shared();
    let hooks = HookDir::new(&[(
        "10-loop.lua",
        r#"
function client_connection(ctx)
  if ctx.user == "bob" then
    if ctx.application_name == "sneaky" then
      while true do pcall(function() while true do end end) end
    end
    while true do end
  end
end
"#,
    )]);
    let usher = Usher::start(pg, &hooks.yaml("timeout_ms: 200")).await;
    for app in ["plain", "sneaky"] {
        let conn = format!(
            "{} application_name={app}",
            usher.conn_str("bob", BOB_PASSWORD)
        );
        let started = Instant::now();
        let looping = tokio::spawn(async move {
            tokio_postgres::connect(&conn, tokio_postgres::NoTls)
                .await
                .map(|_| ())
        });
        // Meanwhile other clients are served.
        for _ in 0..3 {
            assert_eq!(
                usher
                    .alice()
                    .await
                    .query_one("SELECT 1", &[])
                    .await
                    .unwrap()
                    .get::<_, i32>(0),
                1
            );
        }
        let e = looping
            .await
            .unwrap()
            .expect_err("the looping hook fails closed");
        assert_eq!(sqlstate(&e).as_deref(), Some("28000"), "{app}: {e:?}");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{app}: stopped within its budget"
        );
    }
    let rows = show_hooks(&usher).await;
    assert_eq!(rows[0]["timeouts"], "2");
    assert!(
        rows[0]["last_error"].contains("time budget"),
        "{:?}",
        rows[0]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memory_bomb_is_contained() {
    let pg = PgCluster::shared();
    let hooks = HookDir::new(&[(
        "10-bomb.lua",
        r#"
function client_connection(ctx)
  if ctx.user == "bob" then
    local t = {}
    for i = 1, 1e9 do t[i] = string.rep("x", 4096) .. i end
  end
  ctx.vars.ok = true
end
"#,
    )]);
    let usher = Usher::start(pg, &hooks.yaml("memory_limit_mb: 8\ntimeout_ms: 5000")).await;
    let e = usher
        .connect_as("bob", BOB_PASSWORD)
        .await
        .expect_err("the bomb fails closed");
    assert_eq!(sqlstate(&e).as_deref(), Some("28000"));
    let rows = show_hooks(&usher).await;
    assert!(rows[0]["last_error"].contains("memory"), "{:?}", rows[0]);
    // A fresh VM serves the next client.
    assert_eq!(
        usher
            .alice()
            .await
            .query_one("SELECT 1", &[])
            .await
            .unwrap()
            .get::<_, i32>(0),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_file_on_reload_keeps_the_old_set() {
    let pg = PgCluster::shared();
    let hooks = HookDir::new(&[("10-reject.lua", REJECT_BOB)]);
    let usher = Usher::start(pg, &hooks.yaml("")).await;
    assert!(usher.connect_as("bob", BOB_PASSWORD).await.is_err());
    hooks.write(
        "20-broken.lua",
        "function client_connection(ctx)\n  if then\nend\n",
    );
    let e = console(&usher, "RELOAD")
        .await
        .expect_err("reload reports the error");
    let db = e.as_db_error().unwrap();
    assert!(
        db.detail().unwrap_or_default().contains("20-broken.lua:2"),
        "{db:?}"
    );
    // The old set still runs.
    assert!(usher.connect_as("bob", BOB_PASSWORD).await.is_err());
    // Fixed, and the reject removed: the new set runs.
    std::fs::remove_file(hooks.path().join("10-reject.lua")).unwrap();
    hooks.write(
        "20-broken.lua",
        "function client_connection(ctx) ctx:set('application_name', 'reloaded') end\n",
    );
    console(&usher, "RELOAD").await.unwrap();
    let bob = usher
        .connect_as("bob", BOB_PASSWORD)
        .await
        .expect("bob gets in after the reload");
    assert_eq!(setting(&bob, "application_name").await, "reloaded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_switch_turns_every_hook_off_and_admins_always_get_in() {
    let pg = PgCluster::shared();
    let hooks = HookDir::new(&[(
        "10-everyone.lua",
        "function client_connection(ctx) ctx:reject('nobody gets in') end\nfunction session_start(ctx) ctx:set('application_name', 'hooked') end\n",
    )]);
    let usher = Usher::start(pg, &hooks.yaml("")).await;
    let e = usher
        .connect_as("alice", ALICE_PASSWORD)
        .await
        .expect_err("rejected");
    assert_eq!(sqlstate(&e).as_deref(), Some("28000"));
    // The console is never subject to hooks, so the switch is reachable.
    console(&usher, "DISABLE HOOKS").await.unwrap();
    let c = usher.alice().await;
    assert_eq!(setting(&c, "application_name").await, "", "no hook ran");
    assert_eq!(show_hooks(&usher).await[0]["enabled"], "off");
    console(&usher, "ENABLE HOOKS").await.unwrap();
    assert!(usher.connect_as("alice", ALICE_PASSWORD).await.is_err());

    // SET hooks.enabled is the same switch, whatever the file says (it
    // says true here, so a change in the file is not what moves it); a
    // RELOAD of the unchanged file leaves it where it is.
    console(&usher, "SET hooks.enabled = false").await.unwrap();
    usher.alice().await;
    console(&usher, "SET hooks.enabled = true").await.unwrap();
    assert!(usher.connect_as("alice", ALICE_PASSWORD).await.is_err());
    console(&usher, "DISABLE HOOKS").await.unwrap();
    console(&usher, "SET hooks.enabled = true").await.unwrap();
    assert!(
        usher.connect_as("alice", ALICE_PASSWORD).await.is_err(),
        "SET hooks.enabled = true after DISABLE HOOKS turns them on"
    );
    console(&usher, "DISABLE HOOKS").await.unwrap();
    console(&usher, "RELOAD").await.unwrap();
    usher.alice().await;
    console(&usher, "ENABLE HOOKS").await.unwrap();

    // hooks.enabled: false in the config.
    let off = Usher::start(pg, &hooks.yaml("enabled: false")).await;
    let c = off.alice().await;
    assert_eq!(setting(&c, "application_name").await, "");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_hooks_flag_and_environment_start_with_hooks_off() {
    let pg = PgCluster::shared();
    let hooks = HookDir::new(&[(
        "10-everyone.lua",
        "function client_connection(ctx) ctx:reject('nobody') end\n",
    )]);
    for (flag, env) in [(Some("--no-hooks"), None), (None, Some("off"))] {
        let mut builder = UsherProcess::builder(pg).extra(&hooks.yaml(""));
        if let Some(f) = flag {
            builder = builder.arg(f);
        }
        if let Some(v) = env {
            builder = builder.env("USHER_HOOKS", v);
        }
        let usher = builder.start();
        let r = tokio_postgres::connect(&usher.alice_conn_str(), tokio_postgres::NoTls).await;
        drop(usher);
        assert!(
            r.is_ok(),
            "{flag:?} {env:?}: hooks are off, alice gets in: {:?}",
            r.err()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hook_api_query_shared_roles_and_vars() {
    let pg = PgCluster::shared();
    pg.ensure_role("hook_reporting", "NOLOGIN");
    pg.psql_super("GRANT hook_reporting TO bob");
    let hooks = HookDir::new(&[
        (
            "10-connect.lua",
            r#"
function client_connection(ctx)
  local rows = usher.query("SELECT $1::text AS who, 40 + $2::int AS n, NULL::text AS nothing", ctx.user, 2)
  ctx.vars.greeting = rows[1].who .. rows[1].n .. tostring(rows[1].nothing)
  ctx.vars.logins = usher.shared.incr("logins:" .. ctx.user)
  ctx.vars.reporting = usher.roles.is_member(ctx.user, "hook_reporting")
end
"#,
        ),
        (
            "20-session.lua",
            r#"
function session_start(ctx)
  ctx:set("application_name", ctx.vars.greeting .. "/" .. ctx.vars.logins .. "/" .. tostring(ctx.vars.reporting))
  ctx:notice("welcome " .. ctx.user)
end
"#,
        ),
    ]);
    let usher = Usher::start(
        pg,
        &format!(
            "{}  query: {{ database: app, user: alice }}\n",
            // The first usher.query and the role graph each open a connection
            // (SCRAM in a debug build): more than the default test budget on a
            // loaded machine.
            hooks.yaml("timeout_ms: 3000")
        ),
    )
    .await;
    let a = usher.alice().await;
    assert_eq!(setting(&a, "application_name").await, "alice42nil/1/false");
    let a2 = usher.alice().await;
    assert_eq!(
        setting(&a2, "application_name").await,
        "alice42nil/2/false",
        "usher.shared counts across clients"
    );
    let (b, notices) = connect_with_notices(&usher, "bob", BOB_PASSWORD).await;
    assert_eq!(
        setting(&b, "application_name").await,
        "bob42nil/1/true",
        "bob is a member of hook_reporting"
    );
    assert!(
        notices
            .lock()
            .unwrap()
            .iter()
            .any(|n| n == "NOTICE: welcome bob"),
        "{:?}",
        notices.lock().unwrap()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_in_session_mode_and_warnings_for_failing_hooks() {
    let pg = PgCluster::shared();
    let hooks = HookDir::new(&[(
        "20-session.lua",
        r#"
function session_start(ctx)
  if ctx.user == "bob" then error("boom") end
  ctx:exec("CREATE TEMP TABLE hook_made AS SELECT 7 AS v")
end
"#,
    )]);
    let usher = Usher::start(pg, &format!("pool_mode: session\n{}", hooks.yaml(""))).await;
    let a = usher.alice().await;
    assert_eq!(
        a.query_one("SELECT v FROM hook_made", &[])
            .await
            .unwrap()
            .get::<_, i32>(0),
        7
    );
    // A failing session_start: a WARNING, and the session goes on.
    let (b, notices) = connect_with_notices(&usher, "bob", BOB_PASSWORD).await;
    assert_eq!(
        b.query_one("SELECT 1", &[]).await.unwrap().get::<_, i32>(0),
        1
    );
    assert!(
        notices
            .lock()
            .unwrap()
            .iter()
            .any(|n| n.starts_with("WARNING") && n.contains("boom")),
        "{:?}",
        notices.lock().unwrap()
    );

    // In transaction mode ctx:exec is refused: a WARNING, the session goes on.
    let usher = Usher::start(pg, &format!("pool_mode: transaction\n{}", hooks.yaml(""))).await;
    let (a, notices) = connect_with_notices(&usher, "alice", ALICE_PASSWORD).await;
    assert_eq!(
        a.query_one("SELECT 1", &[]).await.unwrap().get::<_, i32>(0),
        1
    );
    assert!(
        notices
            .lock()
            .unwrap()
            .iter()
            .any(|n| n.contains("only available in session mode")),
        "{:?}",
        notices.lock().unwrap()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_attempt_and_session_end_are_observed() {
    let pg = PgCluster::shared();
    let hooks = HookDir::new(&[(
        "30-observe.lua",
        r#"
function auth_attempt(ctx) usher.shared.incr("attempts:" .. ctx.outcome) end
function session_end(ctx) usher.shared.incr("ended") end
function session_start(ctx)
  ctx:set("application_name", (usher.shared.get("attempts:wrong_password") or 0) .. "/" .. (usher.shared.get("attempts:unknown_user") or 0) .. "/" .. (usher.shared.get("ended") or 0))
end
"#,
    )]);
    let usher = Usher::start(pg, &hooks.yaml("")).await;
    assert!(usher.connect_as("alice", "wrong").await.is_err());
    assert!(usher.connect_as("nobody", "x").await.is_err());
    drop(usher.alice().await);
    eventually_async(DEADLINE, "session_end runs", || async {
        usher.app.lua_services.shared.get("ended").is_some()
    })
    .await;
    let c = usher.alice().await;
    assert_eq!(setting(&c, "application_name").await, "1/1/1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hooks_check_and_try_on_the_command_line() {
    let pg = PgCluster::shared();
    let hooks = HookDir::new(&[
        ("10-reject.lua", REJECT_BOB),
        ("20-session.lua", SESSION_HOOK),
    ]);
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("usher.yaml");
    std::fs::write(&config, common::usher_yaml(pg, &hooks.yaml(""))).unwrap();
    let usher = |args: &[&str]| {
        common::usher_cli()
            .args(["--config", config.to_str().unwrap()])
            .args(args)
            .output()
            .unwrap()
    };
    let out = usher(&["hooks", "check"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = usher(&[
        "hooks",
        "try",
        "client_connection",
        "--user",
        "bob",
        "--database",
        "app",
        "--addr",
        "10.1.2.3",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("decision: reject by 10-reject.lua (28000): bob may not connect"),
        "{text}"
    );
    let out = usher(&["hooks", "try", "session_start", "--user", "alice"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("set: search_path = pg_catalog"), "{text}");
    hooks.write("30-broken.lua", "x = = 1\n");
    let out = usher(&["hooks", "check"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("30-broken.lua:1:"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_examples_load_and_leave_ordinary_roles_alone() {
    let pg = PgCluster::shared();
    let usher = Usher::start(pg, "pool_mode: transaction\nhooks:\n  dir: hooks\n").await;
    let names: Vec<String> = show_hooks(&usher)
        .await
        .into_iter()
        .map(|r| r["hook"].clone())
        .collect();
    assert_eq!(
        names,
        [
            "10-settings-per-role.lua",
            "20-time-window.lua",
            "30-log-connections.lua"
        ]
    );
    let c = usher.alice().await;
    assert_eq!(setting(&c, "search_path").await, "\"$user\", public");
    assert_eq!(setting(&c, "application_name").await, "");
}
