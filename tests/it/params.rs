//! Session parameters through usher: every value a client or a hook gives
//! reaches the server exactly as PostgreSQL takes it from a startup packet,
//! and none is ever parsed as SQL, whatever the server connection's settings
//! (PostgreSQL directly is the reference).

use crate::common::{alice_with, PgCluster, Usher};

const MODES: [&str; 2] = ["session", "transaction"];

async fn show(c: &tokio_postgres::Client, name: &str) -> String {
    let rows = c.simple_query(&format!("SHOW {name}")).await.unwrap();
    match &rows[1] {
        tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).unwrap().to_string(),
        other => panic!("SHOW {name}: {other:?}"),
    }
}

/// The schema the tests use, made once per test process (the tests run
/// at once, and concurrent GRANTs on one table fail with "tuple
/// concurrently updated").
fn setup_schema(pg: &PgCluster) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| make_schema(pg));
}

fn make_schema(pg: &PgCluster) {
    pg.psql_super_db(
        "app",
        "CREATE SCHEMA IF NOT EXISTS params_sa AUTHORIZATION alice; \
         CREATE TABLE IF NOT EXISTS params_sa.only_in_sa (x int); \
         GRANT ALL ON params_sa.only_in_sa TO alice; \
         DROP TABLE IF EXISTS public.params_injected",
    );
}

/// A server connection left with `standard_conforming_strings = off` by one
/// client (a legal startup parameter) must not change how the next client's
/// values are read: backslashes stay backslashes, and nothing runs as SQL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_client_value_is_parsed_as_sql() {
    let pg = PgCluster::shared();
    setup_schema(pg);
    let usher = Usher::start(pg, "pool_mode: transaction\npool_size: 1\n").await;
    let port = usher.addr.port();
    let old_style = alice_with(port, "options='-c standard_conforming_strings=off'").await;
    assert_eq!(show(&old_style, "standard_conforming_strings").await, "off");
    for name in [
        r"C:\tools\",
        r"x\'; create table params_injected(x int); --",
    ] {
        let quoted = name.replace('\\', r"\\").replace('\'', r"\'");
        let c = alice_with(port, &format!("application_name='{quoted}'")).await;
        assert_eq!(show(&c, "application_name").await, name);
        assert_eq!(show(&c, "standard_conforming_strings").await, "on");
        // The first client's setting is back for it, and so on in turn.
        assert_eq!(show(&old_style, "standard_conforming_strings").await, "off");
    }
    let injected = pg.psql_super_db("app", "SELECT to_regclass('public.params_injected')");
    assert_eq!(injected, "", "a client value ran as SQL");
}

/// `-c search_path=a,b` is a list of two schemas on a direct connection;
/// so it must be through usher, in both modes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_valued_parameters_keep_their_meaning() {
    let pg = PgCluster::shared();
    setup_schema(pg);
    let options = "options='-c search_path=params_sa,public -c datestyle=postgres,dmy'";
    let direct = alice_with(pg.port, options).await;
    let want_path = show(&direct, "search_path").await;
    let want_style = show(&direct, "datestyle").await;
    for mode in MODES {
        let usher = Usher::start(pg, &format!("pool_mode: {mode}\npool_size: 2\n")).await;
        let c = alice_with(usher.addr.port(), options).await;
        assert_eq!(show(&c, "search_path").await, want_path, "{mode}");
        assert_eq!(show(&c, "datestyle").await, want_style, "{mode}");
        c.simple_query("SELECT count(*) FROM only_in_sa")
            .await
            .unwrap_or_else(|e| panic!("{mode}: an unqualified table of params_sa: {e:?}"));
    }
}

/// A hook's `ctx:set("search_path", "a, b")` (the shipped example's shape)
/// means two schemas too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hooks_list_value_keeps_its_meaning() {
    let pg = PgCluster::shared();
    setup_schema(pg);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("10-path.lua"),
        "function session_start(ctx) ctx:set(\"search_path\", \"params_sa, public\") end\n",
    )
    .unwrap();
    for mode in MODES {
        let usher = Usher::start(
            pg,
            &format!(
                "pool_mode: {mode}\nhooks:\n  dir: {}\n",
                dir.path().display()
            ),
        )
        .await;
        let c = alice_with(usher.addr.port(), "").await;
        assert_eq!(show(&c, "search_path").await, "params_sa, public", "{mode}");
        c.simple_query("SELECT count(*) FROM only_in_sa")
            .await
            .unwrap_or_else(|e| panic!("{mode}: an unqualified table of params_sa: {e:?}"));
    }
}
