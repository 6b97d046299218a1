//! Settings are what PostgreSQL would have them: a client sees, through
//! usher, the values, the ParameterStatus messages and the rendered dates
//! it would see on a direct connection, whatever the clients before it
//! left on the server connection, and a RESET returns to the client's own
//! startup value, inside a transaction block too. Each test runs the same
//! statements through usher (raw protocol, so every ParameterStatus is
//! seen) and on a direct connection to PostgreSQL, and compares.

use crate::common;

use crate::common::raw::{comparable, parameters, RawClient};
use crate::common::{PgCluster, Usher};

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

/// A setting only some roles may make (session_replication_role, granted
/// to alice, not to the role she takes) made before SET ROLE: through usher
/// in transaction mode, where clients take turns on one server connection,
/// each client's settings are made as the login's user and its role taken
/// last, as on its direct connection. (PostgreSQL's regression suite found
/// it: a client's identity was taken first, and the next setting, or the
/// reset of another client's, failed with 42501 and ended the client.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_setting_made_before_set_role_follows_the_client_across_turns() {
    let pg = PgCluster::shared();
    pg.ensure_role("usher_settings_sub", "NOLOGIN");
    pg.psql_super(
        "GRANT usher_settings_sub TO alice; \
         GRANT SET ON PARAMETER session_replication_role TO alice",
    );
    let usher = usher(pg, "transaction", 1).await;
    let check = "SELECT current_user, current_setting('session_replication_role')";
    let mut a = Pair::login(pg, &usher, "", "a").await;
    let mut b = Pair::login(pg, &usher, "", "b").await;
    let mut c = Pair::login(pg, &usher, "", "c").await;
    a.same("SET session_replication_role = replica").await;
    a.same("SET ROLE usher_settings_sub").await;
    a.same(check).await;
    // b takes the one server connection: a's role and setting reset.
    b.same(check).await;
    // a again: its setting made as alice, then its role.
    a.same(check).await;
    // c takes the role only: a's setting reset before c's role is taken.
    c.same("SET ROLE usher_settings_sub").await;
    c.same(check).await;
    a.same(check).await;
    c.same(check).await;
    a.same("RESET ROLE").await;
    a.same(check).await;
    for pair in [a, b, c] {
        pair.close().await;
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

/// The differential run: several clients with random startup values
/// (`options`), each beside its own direct connection to PostgreSQL, run
/// random sequences of SET, SET LOCAL, RESET, RESET ALL, set_config(),
/// DISCARD ALL, BEGIN / COMMIT / ROLLBACK / SAVEPOINT, SHOW and queries
/// that render dates, timestamps and intervals, over the settings that
/// shape what a client sees, interleaved through usher on pool_size 1 and
/// 2 in both pool modes. Every answer (rows, ParameterStatus, notices,
/// errors, transaction status) must be the same through usher as directly.
///
/// A bounded run here; `scripts/differential.sh` runs it longer. Seeds are
/// printed on failure and replayable: USHER_DIFF_SEED=<seed> (with
/// USHER_DIFF_CONFIGS=<mode>/<pool_size> for the failing configuration).
/// USHER_DIFF_SEEDS (seeds per configuration), USHER_DIFF_STEPS (steps per
/// seed) and USHER_DIFF_FIRST_SEED set the run's size and its seeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn differential_against_postgres() {
    let pg = PgCluster::shared();
    differential::schema(pg);
    let plan = common::differential::Plan::from_env(
        4,
        200,
        "transaction/1 transaction/2 session/1 session/2",
    );
    for config in &plan.configs {
        let (mode, pool_size) = config.split_once('/').expect("<mode>/<pool_size>");
        let pool_size: usize = pool_size.parse().expect("a pool size");
        for &seed in &plan.seeds {
            differential::run(pg, mode, pool_size, seed, plan.steps).await;
        }
    }
}

mod differential {
    use super::common::differential::Trail;
    use super::common::raw::{comparable, Msg, RawClient};
    use super::common::{wait, PgCluster, Usher};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// How a setting is written in SET and read back.
    #[derive(Clone, Copy, PartialEq, Eq)]
    enum Kind {
        /// A quoted literal in SET.
        Quoted,
        /// A list of names (SET search_path TO a, b); a string in
        /// set_config() and the startup packet.
        List,
        /// A custom setting: read with current_setting(name, true), whose
        /// NULL (never defined) and '' (defined by an earlier client of the
        /// server connection: PostgreSQL cannot undefine it) count as one.
        Custom,
    }

    struct Param {
        name: &'static str,
        kind: Kind,
        values: &'static [&'static str],
    }

    const PARAMS: &[Param] = &[
        Param {
            name: "DateStyle",
            kind: Kind::Quoted,
            values: &[
                "ISO",
                "German",
                "SQL, DMY",
                "Postgres, MDY",
                "iso, ymd",
                "SQL",
                "ISO, DMY",
                "German, MDY",
            ],
        },
        Param {
            name: "TimeZone",
            kind: Kind::Quoted,
            values: &[
                "UTC",
                "Etc/UTC",
                "Europe/Berlin",
                "America/New_York",
                "Asia/Kolkata",
            ],
        },
        Param {
            name: "IntervalStyle",
            kind: Kind::Quoted,
            values: &["postgres", "postgres_verbose", "sql_standard", "iso_8601"],
        },
        Param {
            name: "search_path",
            kind: Kind::List,
            values: &[
                "public",
                "diff_s1,public",
                "diff_s2,diff_s1",
                "\"$user\",public",
                "diff_s2",
            ],
        },
        Param {
            name: "statement_timeout",
            kind: Kind::Quoted,
            values: &["0", "5s", "10min", "7500ms"],
        },
        Param {
            name: "application_name",
            kind: Kind::Quoted,
            values: &["app-a", "app-b", "reporting"],
        },
        Param {
            name: "extra_float_digits",
            kind: Kind::Quoted,
            values: &["0", "1", "3", "-5"],
        },
        Param {
            name: "standard_conforming_strings",
            kind: Kind::Quoted,
            values: &["on", "off"],
        },
        Param {
            name: "app.x",
            kind: Kind::Custom,
            values: &["a", "b", ""],
        },
        // Taken after the others, made as the login's user: alice may
        // set session_replication_role (granted), the role she takes may
        // not (42501, on both sides alike).
        Param {
            name: "session_replication_role",
            kind: Kind::Quoted,
            values: &["origin", "replica", "local"],
        },
        Param {
            name: "role",
            kind: Kind::Quoted,
            values: &["usher_settings_sub", "none"],
        },
    ];

    /// Not given in the startup packet (the role taken at login is not
    /// what this generator is about).
    const NOT_AT_STARTUP: &[&str] = &["session_replication_role", "role"];

    /// Renders dates (in the session's field order), timestamps (its zone),
    /// intervals (its style), a float (extra_float_digits), a string
    /// literal (standard_conforming_strings) and the search path.
    const RENDER: &str = "SELECT '01/02/2024'::date, '2024-01-02 03:04:05+00'::timestamptz, \
                          interval '1 day 2 hours 3.5 seconds', 0.1::float8, 'a\\b', \
                          current_schemas(false)";

    pub fn schema(pg: &PgCluster) {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            pg.psql_super_db(
                "app",
                "CREATE SCHEMA IF NOT EXISTS diff_s1 AUTHORIZATION alice; \
                 CREATE SCHEMA IF NOT EXISTS diff_s2 AUTHORIZATION alice",
            );
            pg.ensure_role("usher_settings_sub", "NOLOGIN");
            pg.psql_super(
                "GRANT usher_settings_sub TO alice; \
                 GRANT SET ON PARAMETER session_replication_role TO alice",
            );
        });
    }

    /// A value as SET takes it.
    fn set_value(param: &Param, value: &str) -> String {
        match param.kind {
            Kind::List => value.replace(',', ", "),
            _ => format!("'{value}'"),
        }
    }

    /// The statement that reads a setting back.
    fn read(param: &Param) -> String {
        match param.kind {
            Kind::Custom => format!("SELECT current_setting('{}', true)", param.name),
            _ => format!("SHOW {}", param.name),
        }
    }

    /// A random statement for a client whose transaction status is
    /// `status`, and whether it may go by the extended protocol.
    /// `local_default`: the block ran SET LOCAL ... TO DEFAULT, after which
    /// RESET ALL is not generated (docs/clients.md, a known limit: PostgreSQL's
    /// RESET ALL skips a setting whose value came from its reset value,
    /// and at COMMIT the value before the SET LOCAL comes back; through
    /// usher the startup value stays).
    fn statement(rng: &mut StdRng, status: char, local_default: bool) -> (String, bool) {
        let param = &PARAMS[rng.gen_range(0..PARAMS.len())];
        let value = param.values[rng.gen_range(0..param.values.len())];
        let name = param.name;
        let in_block = status != 'I';
        let sql = match rng.gen_range(0..100) {
            0..=19 => format!("SET {name} = {}", set_value(param, value)),
            20..=25 => format!("SET LOCAL {name} = {}", set_value(param, value)),
            26..=34 => format!("RESET {name}"),
            35..=37 => format!("SET {name} TO DEFAULT"),
            38..=39 => format!("SET LOCAL {name} TO DEFAULT"),
            40..=42 if !(in_block && local_default) => "RESET ALL".into(),
            40..=42 => read(param),
            43..=49 => format!(
                "SELECT set_config('{name}', '{value}', {})",
                rng.gen_bool(0.3)
            ),
            50..=51 => "DISCARD ALL".into(),
            52..=58 if !in_block => "BEGIN".into(),
            52..=55 => "COMMIT".into(),
            56..=58 => "ROLLBACK".into(),
            59..=61 => "SAVEPOINT s".into(),
            62..=63 => "ROLLBACK TO SAVEPOINT s".into(),
            64 => "RELEASE SAVEPOINT s".into(),
            65..=79 => read(param),
            80..=89 => RENDER.into(),
            // Two statements in one Query: a reset only last (the
            // statements after a reset in one Query see the server's
            // default until its ReadyForQuery: docs/clients.md, a known limit).
            _ => {
                let (second, _) = statement(rng, status, local_default);
                let first = match rng.gen_range(0..3) {
                    0 => "BEGIN".to_string(),
                    1 => format!("SET {name} = {}", set_value(param, value)),
                    _ => read(param),
                };
                return (format!("{first}; {second}"), false);
            }
        };
        let extended = !sql.starts_with("DISCARD") && rng.gen_bool(0.2);
        (sql, extended)
    }

    /// Random startup `options` (spaces escaped, as libpq does).
    fn options(rng: &mut StdRng) -> String {
        let mut out = Vec::new();
        for param in PARAMS {
            if rng.gen_bool(0.35) && !NOT_AT_STARTUP.contains(&param.name) {
                let value = param.values[rng.gen_range(0..param.values.len())];
                if !value.is_empty() {
                    out.push(format!("-c {}={}", param.name, value.replace(' ', "\\ ")));
                }
            }
        }
        out.join(" ")
    }

    struct Client {
        through: RawClient,
        direct: RawClient,
        /// The transaction status of the last ReadyForQuery.
        status: char,
        /// The block ran SET LOCAL ... TO DEFAULT (see `statement`).
        local_default: bool,
    }

    /// What a test compares of an answer, the custom setting's NULL read
    /// as ''.
    fn normalised(
        sql: &str,
        msgs: &[Msg],
    ) -> (Vec<Msg>, std::collections::BTreeMap<String, String>) {
        let (mut others, parameters) = comparable(msgs);
        if sql.contains("current_setting('app.x', true)") {
            for m in &mut others {
                if let Msg::Row(values) = m {
                    for v in values.iter_mut() {
                        v.get_or_insert_with(String::new);
                    }
                }
            }
        }
        (others, parameters)
    }

    pub async fn run(pg: &PgCluster, mode: &str, pool_size: usize, seed: u64, steps: usize) {
        let mut rng = StdRng::seed_from_u64(seed);
        let usher = Usher::start(
            pg,
            &format!("pool_mode: {mode}\npool_size: {pool_size}\nauth:\n  method: trust\n"),
        )
        .await;
        let mut trail = Trail::new(format!(
                "differential run: seed {seed}, pool_mode {mode}, pool_size {pool_size}, {steps} steps \
                 (replay: USHER_DIFF_SEED={seed} USHER_DIFF_CONFIGS={mode}/{pool_size} \
                 USHER_DIFF_STEPS={steps})"
        ));
        let mut clients: Vec<Option<Client>> = (0..4).map(|_| None).collect();
        for step in 0..steps {
            let session = mode == "session";
            // Clients that hold a server connection: in session mode every
            // connected one, in transaction mode those in a block.
            let holds = |c: &Option<Client>| c.as_ref().is_some_and(|c| session || c.status != 'I');
            let holding = clients.iter().filter(|c| holds(c)).count();
            let mut i = rng.gen_range(0..clients.len());
            if holding >= pool_size && !holds(&clients[i]) {
                // Every server connection is held: one of their clients.
                let holders: Vec<usize> =
                    (0..clients.len()).filter(|i| holds(&clients[*i])).collect();
                i = holders[rng.gen_range(0..holders.len())];
            }
            let Some(client) = clients[i].as_mut() else {
                let options = options(&mut rng);
                let app_name = rng.gen_bool(0.3).then_some("from-startup");
                trail.log.push(format!("[{step}] client {i} logs in: options '{options}' application_name {app_name:?}"));
                // A login takes a server connection only if one is free at
                // once (else it reports the values as given): wait for one.
                wait::eventually_async(wait::DEADLINE, "a free server connection", || async {
                    usher.app.deps.pools.all().iter().all(|p| !p.would_wait())
                })
                .await;
                let mut params = vec![
                    ("user", "alice"),
                    ("database", "app"),
                    ("options", options.as_str()),
                ];
                if let Some(name) = app_name {
                    params.push(("application_name", name));
                }
                let (through, got) = RawClient::tcp(usher.addr, &params).await;
                let (direct, want) = RawClient::unix(&pg.dir, pg.port, &params).await;
                if comparable(&got) != comparable(&want) {
                    trail.fail(
                        step,
                        format!(
                            "login of client {i}\nthrough usher: {got:?}\ndirect:        {want:?}"
                        ),
                    );
                }
                clients[i] = Some(Client {
                    through,
                    direct,
                    status: 'I',
                    local_default: false,
                });
                continue;
            };
            if rng.gen_bool(0.04) {
                trail.log.push(format!(
                    "[{step}] client {i} leaves (status {})",
                    client.status
                ));
                let client = clients[i].take().expect("connected");
                client.through.close().await;
                client.direct.close().await;
                continue;
            }
            let (sql, extended) = statement(&mut rng, client.status, client.local_default);
            trail.log.push(format!(
                "[{step}] client {i}{}: {sql}",
                if extended { " (extended)" } else { "" }
            ));
            let (got, want) = if extended {
                (
                    client.through.extended(&sql).await,
                    client.direct.extended(&sql).await,
                )
            } else {
                (
                    client.through.query(&sql).await,
                    client.direct.query(&sql).await,
                )
            };
            if normalised(&sql, &got) != normalised(&sql, &want) {
                trail.fail(
                    step,
                    format!("client {i}: {sql}\nthrough usher: {got:?}\ndirect:        {want:?}"),
                );
            }
            if let Some(Msg::Ready(status)) = want.last() {
                client.status = *status;
            }
            client.local_default = client.status != 'I'
                && (client.local_default || sql.contains("SET LOCAL") && sql.contains("DEFAULT"));
        }
        for client in clients.into_iter().flatten() {
            client.through.close().await;
            client.direct.close().await;
        }
    }
}
