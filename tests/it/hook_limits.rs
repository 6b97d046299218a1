//! Hooks that run too long or keep too much, against a real PostgreSQL,
//! with usher as a child process on one runtime worker (`workers: 1`), so
//! that Lua running on a worker would stall everything: a runaway top
//! level on reload, one C call that backtracks for ever, a finalizer that
//! spins, and 8 MB kept in `ctx.vars`. A canary client (bob, with no
//! application_name: the hooks here act on application names) runs
//! `SELECT 1` throughout and fails the test on a stall.

use crate::common;

use crate::common::canary::Canary;
use crate::common::wait::DEADLINE;
use crate::common::{sqlstate, status_kb, PgCluster, UsherProcess, ALICE_PASSWORD};

/// A folder of hook files.
fn hook_dir(files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (name, code) in files {
        std::fs::write(dir.path().join(name), code).unwrap();
    }
    dir
}

/// One worker; md5 for clients and one server connection per pool (opened
/// before the canary starts: see [`watched`]): a debug build's SCRAM, a
/// client's or a new server connection's, holds the one worker long
/// enough to look like a stall to the canary.
fn hooks_yaml(dir: &tempfile::TempDir, extra: &str) -> String {
    let mut s = format!(
        "workers: 1\npool_size: 1\nauth:\n  method: md5\nhooks:\n  dir: {}\n",
        dir.path().display()
    );
    for line in extra.lines() {
        s.push_str(&format!("  {line}\n"));
    }
    s
}

/// Connects as `user` with `application_name`; gives up after [`DEADLINE`].
async fn login(
    usher: &UsherProcess,
    user: &str,
    password: &str,
    application_name: &str,
) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    let conn = format!(
        "{} application_name={application_name}",
        usher.conn_str(user, password, "app")
    );
    let (client, driver) = tokio::time::timeout(
        DEADLINE,
        tokio_postgres::connect(&conn, tokio_postgres::NoTls),
    )
    .await
    .unwrap_or_else(|_| panic!("{user} ({application_name}): the login hung"))?;
    tokio::spawn(driver);
    Ok(client)
}

/// alice logs in and runs a query, within [`DEADLINE`].
async fn alice_is_served(usher: &UsherProcess) {
    let c = login(usher, "alice", ALICE_PASSWORD, "plain")
        .await
        .expect("alice logs in");
    let row = tokio::time::timeout(DEADLINE, c.query_one("SELECT 1", &[]))
        .await
        .expect("alice's query hung")
        .unwrap();
    assert_eq!(row.get::<_, i32>(0), 1);
}

/// Starts the canary once alice's pool has its server connection.
async fn watched(usher: &UsherProcess) -> Canary {
    alice_is_served(usher).await;
    Canary::start(usher.port)
}

/// SHOW HOOKS' first row, column `column`.
async fn show_hooks(usher: &UsherProcess, column: &str) -> String {
    let rows = common::console::console_at(usher.port, "SHOW HOOKS")
        .await
        .unwrap();
    common::console::get(&rows[0], column)
        .unwrap_or_default()
        .to_string()
}

/// Waits until usher's log has `text`.
async fn logged(usher: &UsherProcess, text: &str) {
    common::wait::eventually_async(DEADLINE, text, || async { usher.log().contains(text) }).await;
}

const REJECT: &str = r#"
function client_connection(ctx)
  if ctx.application_name == "rejected" then ctx:reject("not this one") end
end
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runaway_top_level_fails_the_reload_and_the_old_hooks_serve() {
    let pg = PgCluster::shared();
    let dir = hook_dir(&[("10-reject.lua", REJECT)]);
    let usher = UsherProcess::builder(pg)
        .extra(&hooks_yaml(&dir, "timeout_ms: 200"))
        .start();
    let canary = watched(&usher).await;
    std::fs::write(dir.path().join("20-runaway.lua"), "while true do end\n").unwrap();
    // RELOAD on the console: an error naming the file, in good time.
    let e = tokio::time::timeout(
        DEADLINE,
        common::console::console_messages(usher.port, "RELOAD"),
    )
    .await
    .expect("RELOAD answers")
    .expect_err("the reload fails");
    let db = e.as_db_error().unwrap();
    let detail = db.detail().unwrap_or_default();
    assert!(
        detail.contains("20-runaway.lua") && detail.contains("time budget"),
        "{db:?}"
    );
    // SIGHUP: the same, logged at ERROR.
    usher.signal(libc::SIGHUP);
    common::wait::eventually_async(DEADLINE, "the SIGHUP reload fails", || async {
        usher.log().matches("reload failed").count() >= 2
    })
    .await;
    let log = usher.log();
    assert!(
        log.lines().any(|l| l.contains("ERROR")
            && l.contains("reload failed")
            && l.contains("20-runaway.lua")),
        "{log}"
    );
    // The old set still serves, and logins go on.
    let e = login(&usher, "alice", ALICE_PASSWORD, "rejected")
        .await
        .expect_err("still refused");
    assert_eq!(sqlstate(&e).as_deref(), Some("28000"));
    alice_is_served(&usher).await;
    canary.check();
}

/// The string, n bytes of it from application_name, takes for ever: n³
/// steps of backtracking in one C call, which no instruction count stops.
const BACKTRACK: &str = r#"
function client_connection(ctx)
  local n = tonumber(ctx.application_name)
  if n then
    usher.log("warn", "backtracking over " .. n)
    string.find(string.rep("a", n), ".-.-.-b")
  end
end
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_long_c_call_holds_only_its_own_client() {
    let pg = PgCluster::shared();
    let dir = hook_dir(&[("10-backtrack.lua", BACKTRACK)]);
    let usher = UsherProcess::builder(pg)
        .extra(&hooks_yaml(&dir, "timeout_ms: 1000"))
        .start();
    let canary = watched(&usher).await;
    let conn = format!(
        "{} application_name=100000",
        usher.conn_str("alice", ALICE_PASSWORD, "app")
    );
    let stuck = tokio::spawn(async move {
        tokio::time::timeout(
            DEADLINE,
            tokio_postgres::connect(&conn, tokio_postgres::NoTls),
        )
        .await
        .map(|r| r.map(drop))
    });
    logged(&usher, "backtracking over 100000").await;
    // Meanwhile, and after its deadline, others log in and are served.
    alice_is_served(&usher).await;
    let e = stuck
        .await
        .unwrap()
        .expect("an answer at the hook's deadline")
        .expect_err("refused (hooks.on_error: reject)");
    assert_eq!(sqlstate(&e).as_deref(), Some("28000"), "{e:?}");
    logged(&usher, "still running past its deadline").await;
    for _ in 0..3 {
        alice_is_served(&usher).await;
    }
    assert_eq!(show_hooks(&usher, "timeouts").await, "1");
    canary.check();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finalizer_that_spins_holds_no_one() {
    let pg = PgCluster::shared();
    let dir = hook_dir(&[(
        "10-finalizer.lua",
        r#"
function client_connection(ctx)
  if ctx.application_name == "finalizer" then
    setmetatable({}, { __gc = function()
      local t = os.clock()
      while os.clock() - t < 30 do end
    end })
    -- Garbage, so that a collection runs the finalizer.
    for i = 1, 1e6 do local _ = { i } end
  end
end
"#,
    )]);
    let usher = UsherProcess::builder(pg)
        .extra(&hooks_yaml(&dir, "timeout_ms: 2000"))
        .start();
    let canary = watched(&usher).await;
    let e = login(&usher, "alice", ALICE_PASSWORD, "finalizer")
        .await
        .expect_err("the hook fails");
    assert_eq!(sqlstate(&e).as_deref(), Some("28000"), "{e:?}");
    let last_error = show_hooks(&usher, "last_error").await;
    assert!(last_error.contains("__gc"), "{last_error}");
    alice_is_served(&usher).await;
    canary.check();
}

const BIG_VARS: &str = r#"
function client_connection(ctx)
  ctx.vars.big = string.rep("x", 8 * 1024 * 1024)
end
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_megabytes_in_ctx_vars_is_a_hook_error_not_kept() {
    let pg = PgCluster::shared();
    let dir = hook_dir(&[("10-big.lua", BIG_VARS)]);
    // Failing closed: the client is refused, with the reason in SHOW HOOKS.
    let usher = UsherProcess::builder(pg)
        .extra(&hooks_yaml(&dir, "timeout_ms: 5000"))
        .start();
    let e = login(&usher, "alice", ALICE_PASSWORD, "plain")
        .await
        .expect_err("the hook fails");
    assert_eq!(sqlstate(&e).as_deref(), Some("28000"), "{e:?}");
    let last_error = show_hooks(&usher, "last_error").await;
    assert!(
        last_error.contains("ctx.vars holds more than 65536 bytes (hooks.vars_max_bytes)"),
        "{last_error}"
    );
    drop(usher);

    // Failing open: 40 clients get in, and none keeps the 8 MB.
    let usher = UsherProcess::builder(pg)
        .extra(&hooks_yaml(&dir, "timeout_ms: 5000\non_error: allow"))
        .start();
    let before = status_kb(usher.pid(), "VmRSS");
    let mut clients = Vec::new();
    for _ in 0..40 {
        clients.push(
            login(&usher, "alice", ALICE_PASSWORD, "plain")
                .await
                .expect("let in (hooks.on_error: allow)"),
        );
    }
    let grown_mb = status_kb(usher.pid(), "VmRSS").saturating_sub(before) / 1024;
    assert_eq!(show_hooks(&usher, "errors").await, "40");
    // 40 × 8 MB kept would be 320 MB; the VMs' garbage is bounded by
    // their memory limit.
    assert!(grown_mb < 160, "usher grew by {grown_mb} MB");
    drop(clients);
}
