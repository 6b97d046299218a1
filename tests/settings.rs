//! Settings are what PostgreSQL would have them: a client sees, through
//! usher, the values, the ParameterStatus messages and the rendered dates
//! it would see on a direct connection, whatever the clients before it
//! left on the server connection, and a RESET returns to the client's own
//! startup value, inside a transaction block too. Each test runs the same
//! statements through usher (raw protocol, so every ParameterStatus is
//! seen) and on a direct connection to PostgreSQL, and compares.

mod common;

use common::raw::{comparable, parameters, RawClient};
use common::{PgCluster, Usher};

const MODES: [&str; 2] = ["session", "transaction"];

/// usher with trust, so raw clients log in without SCRAM.
async fn usher(pg: &PgCluster, mode: &str, pool_size: usize) -> Usher {
    Usher::start(
        pg,
        &format!("pool_mode: {mode}\npool_size: {pool_size}\nauth:\n  method: trust\n"),
    )
    .await
}

fn startup(options: &str) -> Vec<(&'static str, &str)> {
    vec![("user", "alice"), ("database", "app"), ("options", options)]
}

/// A client through usher and the same client on a direct connection.
struct Pair {
    usher: RawClient,
    direct: RawClient,
    what: String,
}

impl Pair {
    async fn login(pg: &PgCluster, usher: &Usher, options: &str, what: &str) -> Pair {
        let (through, got) = RawClient::tcp(usher.addr, &startup(options)).await;
        let (direct, want) = RawClient::unix(&pg.dir, pg.port, &startup(options)).await;
        assert_eq!(
            parameters(&got),
            parameters(&want),
            "{what}: the parameters told at login"
        );
        Pair {
            usher: through,
            direct,
            what: what.to_string(),
        }
    }

    /// Runs `sql` on both; every message must match.
    async fn same(&mut self, sql: &str) {
        let got = self.usher.query(sql).await;
        let want = self.direct.query(sql).await;
        assert_eq!(
            comparable(&got),
            comparable(&want),
            "{}: {sql}\nthrough usher: {got:?}\ndirect:        {want:?}",
            self.what
        );
    }

    async fn close(self) {
        self.usher.close().await;
        self.direct.close().await;
    }
}

/// Waits until the client's server connection is back in the pool (session
/// mode resets it after the client leaves), so the next login finds it.
async fn server_back(usher: &Usher) {
    common::wait::eventually_async(common::wait::DEADLINE, "the client leaves", || async {
        usher.app.deps.clients.connected() == 0
    })
    .await;
    common::console::wait_pool(usher.addr.port(), "alice", "sv_active", "0").await;
}

/// Issue 25 item 12: a client's DateStyle must not shape the next
/// client's. `iso` sets only the output format and keeps the field order
/// the session has: on a direct connection that is the default (MDY); on a
/// server connection a German client left it was DMY, and the next client
/// read `01/02/2024` as the first of February.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_datestyle_does_not_leak_to_the_next_client() {
    let pg = PgCluster::shared();
    for mode in MODES {
        let usher = usher(pg, mode, 1).await;
        let mut german = Pair::login(pg, &usher, "-c DateStyle=German", mode).await;
        german.same("SELECT '01/02/2024'::date").await;
        german.close().await;
        server_back(&usher).await;
        let mut iso = Pair::login(pg, &usher, "-c DateStyle=iso", mode).await;
        iso.same("SHOW DateStyle").await;
        iso.same("SELECT '01/02/2024'::date").await;
        iso.close().await;
    }
}

/// RESET inside a transaction block returns to the client's startup
/// value, as on a direct connection (the server connection's own reset
/// value is the server's default: usher restores the client's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_in_a_transaction_block_returns_to_the_startup_value() {
    let pg = PgCluster::shared();
    pg.psql_super_db(
        "app",
        "CREATE SCHEMA IF NOT EXISTS settings_s1 AUTHORIZATION alice",
    );
    let options = "-c statement_timeout=5s -c DateStyle=German -c IntervalStyle=iso_8601 \
                   -c TimeZone=UTC -c application_name=startup-app \
                   -c search_path=settings_s1,public -c app.x=startup-x";
    for mode in MODES {
        let usher = usher(pg, mode, 1).await;
        let mut c = Pair::login(pg, &usher, options, mode).await;
        for name in [
            "statement_timeout",
            "DateStyle",
            "IntervalStyle",
            "TimeZone",
            "application_name",
            "search_path",
            "app.x",
        ] {
            c.same(&format!("SET {name} = DEFAULT")).await;
            c.same("BEGIN").await;
            c.same(&format!("RESET {name}")).await;
            c.same(&format!("SHOW {name}")).await;
            c.same("SELECT '01/02/2024'::date, interval '1 day 2 hours'")
                .await;
            c.same("COMMIT").await;
            c.same(&format!("SHOW {name}")).await;
            // The same in one Query, and with SET ... TO DEFAULT.
            c.same(&format!("BEGIN; RESET {name}")).await;
            c.same(&format!("SHOW {name}")).await;
            c.same("ROLLBACK").await;
            c.same("BEGIN").await;
            c.same(&format!("SET {name} TO DEFAULT")).await;
            c.same(&format!("SHOW {name}")).await;
            c.same("COMMIT").await;
        }
        c.same("BEGIN").await;
        c.same("SET DateStyle = SQL").await;
        c.same("RESET ALL").await;
        c.same("SHOW DateStyle").await;
        c.same("SHOW statement_timeout").await;
        c.same("COMMIT").await;
        c.close().await;
    }
}

/// After RESET ALL, DISCARD ALL or RESET of one setting, the client is
/// told its own startup values (ParameterStatus), only where they changed,
/// as PostgreSQL tells it; never the server connection's defaults.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_reports_the_startup_values() {
    let pg = PgCluster::shared();
    let options = "-c DateStyle=German -c TimeZone=UTC -c IntervalStyle=sql_standard \
                   -c application_name=startup-app -c extra_float_digits=1";
    for mode in MODES {
        let usher = usher(pg, mode, 1).await;
        let mut c = Pair::login(pg, &usher, options, mode).await;
        for sql in [
            "SET DateStyle = SQL",
            "SET TimeZone = 'Europe/Berlin'",
            "SET application_name = 'other'",
            "RESET ALL",
            "SHOW TimeZone",
            "SET IntervalStyle = postgres",
            "SET extra_float_digits = 3",
            "DISCARD ALL",
            "SELECT 0.1::float8, interval '1 day 2 hours', '2024-01-02 03:04:05+00'::timestamptz",
            "SET TimeZone = 'America/New_York'",
            "RESET TimeZone",
            "SET application_name = 'again'",
            "RESET application_name",
            "RESET DateStyle",
            "SET DateStyle TO DEFAULT",
        ] {
            c.same(sql).await;
        }
        c.close().await;
    }
}
