//! The differential run of the extended query protocol (issue 26): three
//! clients send random batches (Parse named and unnamed, with and without
//! parameter types; Bind to named and unnamed portals; Describe of
//! statements and portals; Execute with and without a row limit; Close;
//! Flush, whose answers are read before the rest is sent; Sync, also in
//! the middle of a batch), simple-Query transactions with errors in them,
//! and DDL that changes result and parameter types (ALTER COLUMN TYPE, ADD
//! and DROP COLUMN, a table and an enum type dropped and made again),
//! interleaved through usher; each client's twin runs the same batches on
//! its own direct connection to a twin database. Every answer must match:
//! message kinds in order, SQLSTATEs, row and parameter descriptions (type
//! OIDs; a user type's by its name, since the twins' OIDs differ), rows,
//! command tags and transaction status. ParameterStatus and notices are
//! not compared; error texts differ only softly (a text prepared under two
//! names is named by the first in usher's errors) and are printed, not
//! failed on.
//!
//! Each client works on tables and a type of its own (`xd<run>.t<client>`,
//! `xd<run>.mood<client>`), so clients' writes and DDL cannot change what
//! another sees, directly or not: what is tested is usher's handling of
//! each client's statements, portals and transactions across server
//! connections. A client that leaves is replaced by a new one on the same
//! tables (the same texts: a new client's Parse of a text an earlier one
//! prepared before DDL).
//!
//! Configurations: `direct` (both sides direct connections, to the two
//! databases: the harness's self-check, which must never see a
//! difference), and `<pool_mode>/<pool_size>` through usher. Seeds are
//! printed on failure with how to replay them (tests/common/differential.rs:
//! USHER_DIFF_SEED, USHER_DIFF_CONFIGS, USHER_DIFF_STEPS...).
//!
//! CI runs the self-check (`direct`, the whole generator) and CI_CONFIGS
//! (both pool modes, one and two server connections) with LEAVE_OUT left
//! out of the generator (`xdiff::Gen` names the parts;
//! USHER_DIFF_LEAVE_OUT='' puts everything back):
//! - `stale`: a client's own statement prepared before DDL that changed
//!   its result type. Directly, PostgreSQL answers its Bind with 0A000
//!   "cached plan must not change result type" (on the connection that
//!   prepared it); through usher in transaction mode, a server connection
//!   that prepares it afresh runs it with the new shape. usher cannot tell
//!   the old shape without keeping every statement's RowDescription; the
//!   generator closes a client's statements after DDL instead, as drivers
//!   do when they meet 0A000 (docs/clients.md, "Prepared statements").
//!
//! `scripts/differential.sh --extended` runs it longer.

use crate::common;

use crate::common::differential::Plan;
use crate::common::PgCluster;

/// The configurations CI runs through usher (see the module doc for those
/// left out).
const CI_CONFIGS: &str = "session/1 session/2 transaction/1 transaction/2";

/// What the runs through usher leave out of the generator (xdiff::Gen),
/// for the divergences named in the module doc.
const LEAVE_OUT: &str = "stale";

/// USHER_DIFF_LEAVE_OUT, else `default`.
fn leave_out(default: &str) -> String {
    std::env::var("USHER_DIFF_LEAVE_OUT").unwrap_or_else(|_| default.into())
}

/// The harness itself: the same generator, both sides direct connections
/// (to the two twin databases). Any difference here is the harness's, not
/// usher's; it would make every other report doubtful.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_harness_sees_no_difference_between_two_direct_connections() {
    let pg = PgCluster::shared();
    let plan = Plan::from_env(4, 200, "direct");
    for &seed in &plan.seeds {
        xdiff::run(pg, "direct", &leave_out(""), seed, plan.steps).await;
    }
}

/// The differential run through usher, on CI_CONFIGS unless
/// USHER_DIFF_CONFIGS names others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extended_protocol_differential_against_postgres() {
    let pg = PgCluster::shared();
    let plan = Plan::from_env(4, 200, CI_CONFIGS);
    for config in &plan.configs {
        for &seed in &plan.seeds {
            xdiff::run(pg, config, &leave_out(LEAVE_OUT), seed, plan.steps).await;
        }
    }
}

mod xdiff {
    use super::common::differential::Trail;
    use super::common::raw::{Msg, RawClient};
    use super::common::wire::Frontend;
    use super::common::{wait, PgCluster, Usher, ALICE_PASSWORD};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::Duration;

    const CLIENTS: usize = 3;
    /// The database each client's twin uses directly (`app` is usher's).
    const TWIN: &str = "xd_twin";
    /// How long an answer may take before the side counts as silent.
    const WAIT: Duration = Duration::from_secs(10);

    /// Creates the twin database once per test binary.
    fn twin(pg: &PgCluster) {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            pg.psql_super(&format!("CREATE DATABASE {TWIN} OWNER alice"));
        });
    }

    /// A schema of the run's own, the same in both databases: each
    /// client's table and enum type.
    fn schema(pg: &PgCluster) -> String {
        static RUNS: AtomicU32 = AtomicU32::new(0);
        let schema = format!("xd{}", RUNS.fetch_add(1, Ordering::Relaxed));
        let mut sql = format!("SET ROLE alice; CREATE SCHEMA {schema};");
        for c in 0..CLIENTS {
            sql += &format!(
                " CREATE TABLE {schema}.t{c} (k int4, v int4); \
                 CREATE TYPE {schema}.mood{c} AS ENUM ('ok', 'sad');"
            );
        }
        for db in ["app", TWIN] {
            pg.psql_super_db(db, &sql);
        }
        schema
    }

    /// Names of user types by OID in one database, asked on a connection
    /// of the test's own (a client's own connection must not see the
    /// test's traffic). A type dropped since is `<dropped type>`.
    struct Types(tokio_postgres::Client);

    impl Types {
        async fn connect(pg: &PgCluster, db: &str) -> Types {
            let (client, conn) = tokio_postgres::connect(
                &format!(
                    "host=127.0.0.1 port={} user=alice password={ALICE_PASSWORD} dbname={db}",
                    pg.port
                ),
                tokio_postgres::NoTls,
            )
            .await
            .expect("a connection for type names");
            tokio::spawn(conn);
            Types(client)
        }

        async fn name(&self, oid: u32) -> String {
            if oid < 16384 {
                return builtin(oid);
            }
            let row = self
                .0
                .query_opt(
                    "SELECT typnamespace::regnamespace::text || '.' || typname \
                     FROM pg_type WHERE oid = $1",
                    &[&oid],
                )
                .await
                .expect("type name");
            row.map_or_else(|| "<dropped type>".into(), |r| r.get(0))
        }
    }

    /// A built-in type's OID, named where the run meets it.
    fn builtin(oid: u32) -> String {
        let name = match oid {
            0 => "unspecified",
            16 => "bool",
            20 => "int8",
            23 => "int4",
            25 => "text",
            705 => "unknown",
            1700 => "numeric",
            _ => return oid.to_string(),
        };
        name.into()
    }

    /// What is compared of a side's answer to a step: a line per message
    /// (ParameterStatus, notices and BackendKeyData left out; an error by
    /// its SQLSTATE; user types by name), and the errors' texts apart.
    async fn normalised(answer: &Answer, types: &Types) -> (Vec<String>, Vec<String>) {
        let mut lines = Vec::new();
        let mut texts = Vec::new();
        for m in &answer.msgs {
            let line = match m {
                Msg::Parameter(..) | Msg::Notice(..) | Msg::Other('K') | Msg::Other('A') => {
                    continue
                }
                Msg::Error(code, text) => {
                    texts.push(text.clone());
                    // A statement whose type DDL dropped and made again:
                    // one backend may still say XX000 "cache lookup failed
                    // for type" where another, its invalidations read
                    // sooner, says 0A000 "cached plan must not change
                    // result type" (seen between the two direct sides):
                    // the same answer, a stale statement.
                    let code = if code == "XX000" { "0A000" } else { code };
                    format!("Error {code}")
                }
                Msg::Columns(columns) => {
                    let mut out = Vec::new();
                    for (name, oid, modifier) in columns {
                        let modifier = if *modifier >= 0 {
                            format!("({modifier})")
                        } else {
                            String::new()
                        };
                        out.push(format!("{name} {}{modifier}", types.name(*oid).await));
                    }
                    format!("Columns [{}]", out.join(", "))
                }
                Msg::ParameterTypes(oids) => {
                    let mut out = Vec::new();
                    for oid in oids {
                        out.push(types.name(*oid).await);
                    }
                    format!("ParameterTypes [{}]", out.join(", "))
                }
                other => format!("{other:?}"),
            };
            lines.push(line);
        }
        if answer.silent {
            lines.push(format!(
                "(nothing more within {} s, or the connection closed)",
                WAIT.as_secs()
            ));
        }
        (lines, texts)
    }

    /// The messages a side sent in answer to a step, and whether it fell
    /// silent before the answer was whole.
    #[derive(Default)]
    struct Answer {
        msgs: Vec<Msg>,
        silent: bool,
    }

    impl Answer {
        /// The next message that answers something (ParameterStatus,
        /// notices and notifications are kept but not returned).
        async fn next(&mut self, c: &mut RawClient) -> Option<Msg> {
            loop {
                let Some(m) = c.next(WAIT).await else {
                    self.silent = true;
                    return None;
                };
                self.msgs.push(m.clone());
                if !matches!(m, Msg::Parameter(..) | Msg::Notice(..) | Msg::Other('A')) {
                    return Some(m);
                }
            }
        }

        async fn until_ready(&mut self, c: &mut RawClient) -> Option<()> {
            while !matches!(self.next(c).await?, Msg::Ready(_)) {}
            Some(())
        }

        /// Reads what PostgreSQL answers to `m` (nothing while it skips to
        /// a Sync after an error).
        async fn read(
            &mut self,
            c: &mut RawClient,
            m: &Frontend,
            skipping: &mut bool,
        ) -> Option<()> {
            match m {
                Frontend::Sync => {
                    *skipping = false;
                    return self.until_ready(c).await;
                }
                _ if *skipping => return Some(()),
                Frontend::Flush => return Some(()),
                Frontend::Query(_) => return self.until_ready(c).await,
                _ => {}
            }
            let mut answer = self.next(c).await?;
            match m {
                Frontend::Describe('S', _) if matches!(answer, Msg::ParameterTypes(_)) => {
                    answer = self.next(c).await?;
                }
                Frontend::Execute(..) => {
                    while matches!(answer, Msg::Row(_)) {
                        answer = self.next(c).await?;
                    }
                }
                _ => {}
            }
            if matches!(answer, Msg::Error(..)) {
                *skipping = true;
            }
            Some(())
        }
    }

    /// Sends `batch` and reads the whole answer: up to each Flush, the
    /// messages go out and their answers are read before the rest is sent
    /// (what a Flush is for); the rest goes out in one write.
    async fn converse(c: &mut RawClient, batch: &[Frontend]) -> Answer {
        let mut answer = Answer::default();
        let mut skipping = false;
        let mut from = 0;
        while from < batch.len() {
            let to = batch[from..]
                .iter()
                .position(|m| *m == Frontend::Flush)
                .map_or(batch.len(), |i| from + i + 1);
            let bytes: Vec<u8> = batch[from..to].iter().flat_map(|m| m.encode()).collect();
            if c.send(&bytes).await.is_err() {
                answer.silent = true;
                return answer;
            }
            for m in &batch[from..to] {
                if answer.read(c, m, &mut skipping).await.is_none() {
                    return answer;
                }
            }
            from = to;
        }
        answer
    }

    /// The generator's belief about one client: its statements' parameter
    /// counts by name (as Parsed, whether or not the Parse succeeded: the
    /// point is to make Binds that fit often, not always).
    #[derive(Default)]
    struct Belief {
        statements: HashMap<String, usize>,
    }

    /// The highest `$n` in `sql`.
    fn parameters_in(sql: &str) -> usize {
        let b = sql.as_bytes();
        let mut max = 0;
        for (i, c) in b.iter().enumerate() {
            if *c == b'$' {
                let digits: String = sql[i + 1..]
                    .chars()
                    .take_while(|c| c.is_ascii_digit())
                    .collect();
                max = max.max(digits.parse().unwrap_or(0));
            }
        }
        max
    }

    fn pick<'a>(rng: &mut Gen, from: &[&'a str]) -> &'a str {
        from[rng.gen_range(0..from.len())]
    }

    /// The texts a client Parses: constants, parameters (typed by a cast,
    /// by a column, or not at all), its table's rows, writes, transaction
    /// control, and some that fail (at Parse or at Execute).
    fn statement_text(rng: &mut Gen, t: &str, mood: &str) -> String {
        let texts = [
            "select 1 as one".to_string(),
            "select 1 as a, 'x'::text as b".into(),
            "select $1::int4 + 1 as n".into(),
            "select $1 as p".into(),
            "select $1::text || 'x' as s".into(),
            "select 10 / $1::int4 as q".into(),
            format!("select k, v from {t} order by k, v"),
            format!("select * from {t} where k = $1 order by v"),
            format!("select * from {t} order by k, v"),
            format!("insert into {t} (k, v) values ($1, $2)"),
            format!("insert into {t} (k, v) values (1, 1) returning *"),
            format!("update {t} set v = v where k = $1"),
            format!("delete from {t} where k = $1"),
            format!("select count(*) as c from {t}"),
            "select g from generate_series(1, 4) as g".into(),
            "selec 1".into(),
            format!("select * from {t}_nosuch"),
            String::new(),
        ];
        let more = [
            ("types", format!("select 'ok'::{mood} as m")),
            ("types", format!("select $1::{mood} as m")),
            ("control", "begin".into()),
            ("control", "commit".into()),
            ("control", "rollback".into()),
            (
                "set_config",
                "select set_config('xd.x', $1, false) as x".into(),
            ),
        ];
        let more: Vec<String> = more
            .into_iter()
            .filter(|(feature, _)| !rng.left_out(feature))
            .map(|(_, text)| text)
            .collect();
        let n = rng.gen_range(0..texts.len() + more.len());
        texts
            .get(n)
            .unwrap_or_else(|| &more[n - texts.len()])
            .clone()
    }

    /// The run's random source, and the parts of the generator it leaves
    /// out (USHER_DIFF_LEAVE_OUT, space separated, else LEAVE_OUT for runs
    /// through usher): `set_config` (a statement that names it), `types`
    /// (an enum type in texts and DDL), `control` (BEGIN / COMMIT /
    /// ROLLBACK as Parsed statements), `ddl`, `deallocate` (DEALLOCATE
    /// ALL), `flush`, `sync` (a Sync in the middle of a batch),
    /// `duplicates` (a Close before each named Parse: no 42P05), `unnamed`
    /// (the unnamed statement bound or described only in the batch that
    /// Parsed it), `stale` (a client's statements from before DDL used
    /// again: left out, each client closes them all after DDL, as a driver
    /// does when it meets 0A000).
    pub struct Gen {
        rng: StdRng,
        leave_out: Vec<String>,
    }

    impl Gen {
        pub fn new(seed: u64, leave_out: &str) -> Gen {
            Gen {
                rng: StdRng::seed_from_u64(seed),
                leave_out: leave_out.split_whitespace().map(String::from).collect(),
            }
        }

        fn left_out(&self, feature: &str) -> bool {
            self.leave_out.iter().any(|f| f == feature)
        }
    }

    impl std::ops::Deref for Gen {
        type Target = StdRng;
        fn deref(&self) -> &StdRng {
            &self.rng
        }
    }

    impl std::ops::DerefMut for Gen {
        fn deref_mut(&mut self) -> &mut StdRng {
            &mut self.rng
        }
    }

    fn value(rng: &mut Gen) -> Option<String> {
        match rng.gen_range(0..12) {
            0 => None,
            1 => Some("ok".into()),
            2 => Some("0".into()),
            n => Some(((n % 4) + 1).to_string()),
        }
    }

    fn parse(rng: &mut Gen, belief: &mut Belief, t: &str, mood: &str) -> Frontend {
        let name = pick(rng, &["", "", "s0", "s1", "s2"]).to_string();
        let sql = statement_text(rng, t, mood);
        let used = parameters_in(&sql);
        let types: Vec<u32> = if rng.gen_bool(0.5) {
            Vec::new()
        } else {
            let n = if rng.gen_bool(0.8) {
                used
            } else {
                rng.gen_range(0..=3)
            };
            (0..n).map(|_| [0, 23, 25][rng.gen_range(0..3)]).collect()
        };
        belief
            .statements
            .insert(name.clone(), used.max(types.len()));
        Frontend::Parse(name, sql, types)
    }

    fn bind(rng: &mut Gen, belief: &Belief) -> Frontend {
        let known: Vec<&String> = belief.statements.keys().collect();
        let statement = if !known.is_empty() && rng.gen_bool(0.8) {
            known[rng.gen_range(0..known.len())].clone()
        } else {
            pick(rng, &["", "", "s0", "s1", "s2", "s3"]).to_string()
        };
        let n = match belief.statements.get(&statement) {
            Some(n) if rng.gen_bool(0.9) => *n,
            _ => rng.gen_range(0..=2),
        };
        let portal = pick(rng, &["", "", "p0"]).to_string();
        Frontend::Bind(portal, statement, (0..n).map(|_| value(rng)).collect())
    }

    fn execute(rng: &mut Gen, portal: &str) -> Frontend {
        Frontend::Execute(portal.to_string(), [0, 0, 0, 1, 2][rng.gen_range(0..5)])
    }

    /// One extended-protocol batch, ending with a Sync; a Flush (whose
    /// answers are read before the rest is sent) and a Sync in the middle
    /// now and then.
    ///
    /// The unnamed portal is executed or described only after a Bind of it
    /// earlier in the batch: a utility statement that failed in a simple
    /// Query inside a block (`RELEASE SAVEPOINT a` with no such savepoint)
    /// leaves a failed unnamed portal, and PostgreSQL 15.18 crashes (signal
    /// 11) when a later Execute runs it (BEGIN; RELEASE SAVEPOINT a; Parse
    /// "s2" `select $1::int4 + 1` and Sync; Execute "").
    fn extended(rng: &mut Gen, belief: &mut Belief, t: &str, mood: &str) -> Vec<Frontend> {
        let mut batch = Vec::new();
        // The unnamed portal was bound since the last Sync.
        let mut bound = false;
        let portal = |rng: &mut Gen, bound: bool, names: &[&str]| -> String {
            let name = pick(rng, names);
            if name.is_empty() && !bound {
                "p0".into()
            } else {
                name.into()
            }
        };
        for _ in 0..rng.gen_range(1..=4) {
            match rng.gen_range(0..100) {
                // What libpq sends for one statement.
                0..=24 => {
                    let p = parse(rng, belief, t, mood);
                    let Frontend::Parse(name, ..) = &p else {
                        unreachable!()
                    };
                    let name = name.clone();
                    batch.push(p);
                    let portal = pick(rng, &["", "", "p0"]).to_string();
                    bound |= portal.is_empty();
                    let n = belief.statements[&name];
                    batch.push(Frontend::Bind(
                        portal.clone(),
                        name,
                        (0..n).map(|_| value(rng)).collect(),
                    ));
                    batch.push(Frontend::Describe('P', portal.clone()));
                    batch.push(execute(rng, &portal));
                }
                25..=44 => batch.push(parse(rng, belief, t, mood)),
                45..=59 => {
                    let b = bind(rng, belief);
                    let Frontend::Bind(portal, ..) = &b else {
                        unreachable!()
                    };
                    let portal = portal.clone();
                    bound |= portal.is_empty();
                    batch.push(b);
                    if rng.gen_bool(0.7) {
                        batch.push(execute(rng, &portal));
                    }
                }
                60..=67 => {
                    let name = pick(rng, &["", "", "s0", "s1", "s2", "s3"]);
                    batch.push(Frontend::Describe('S', name.into()));
                }
                68..=72 => {
                    let name = portal(rng, bound, &["", "p0", "p1"]);
                    batch.push(Frontend::Describe('P', name));
                }
                73..=84 => {
                    let name = portal(rng, bound, &["", "", "p0", "p1"]);
                    batch.push(execute(rng, &name));
                }
                85..=91 => {
                    let name = pick(rng, &["", "s0", "s1", "s2"]);
                    belief.statements.remove(name);
                    batch.push(Frontend::Close('S', name.into()));
                }
                92..=95 => {
                    let name = pick(rng, &["", "p0"]);
                    batch.push(Frontend::Close('P', name.into()));
                }
                _ if rng.left_out("sync") => {}
                _ => {
                    bound = false;
                    batch.push(Frontend::Sync);
                }
            }
        }
        if rng.left_out("duplicates") {
            // A Close before each named Parse: no 42P05.
            batch = batch
                .into_iter()
                .flat_map(|m| match &m {
                    Frontend::Parse(name, ..) if !name.is_empty() => {
                        vec![Frontend::Close('S', name.clone()), m]
                    }
                    _ => vec![m],
                })
                .collect();
        }
        if rng.left_out("unnamed") {
            // The unnamed statement only where the batch Parsed it: a Bind
            // or Describe before names one that never exists.
            let mut parsed = false;
            for m in &mut batch {
                match m {
                    Frontend::Parse(name, ..) if name.is_empty() => parsed = true,
                    Frontend::Bind(_, name, _) | Frontend::Describe('S', name)
                        if name.is_empty() && !parsed =>
                    {
                        *name = "s3".into()
                    }
                    _ => {}
                }
            }
        }
        if rng.gen_bool(0.2) && !rng.left_out("flush") {
            let at = rng.gen_range(0..=batch.len());
            batch.insert(at, Frontend::Flush);
        }
        batch.push(Frontend::Sync);
        batch
    }

    /// A simple Query: transaction control, errors inside blocks, rows,
    /// writes, DEALLOCATE.
    fn query(rng: &mut Gen, belief: &mut Belief, t: &str) -> String {
        let sql = match rng.gen_range(0..14) {
            0..=2 => "BEGIN".to_string(),
            3..=4 => "COMMIT".into(),
            5..=6 => "ROLLBACK".into(),
            7 => "select 1/0".into(),
            8 => format!("select k, v from {t} order by k, v"),
            9 => format!("insert into {t} (k, v) values (4, 4)"),
            10 => format!("BEGIN; insert into {t} (k, v) values (5, 5); COMMIT"),
            11 => "select 1; selec 2".into(),
            12 => "SAVEPOINT a".into(),
            _ => "RELEASE SAVEPOINT a".into(),
        };
        if rng.gen_bool(0.03) && !rng.left_out("deallocate") {
            belief.statements.clear();
            return "DEALLOCATE ALL".into();
        }
        sql
    }

    /// DDL on the client's own table and type: result and parameter types
    /// change under its statements.
    /// A text `ddl` made.
    fn is_ddl(sql: &str) -> bool {
        let s = sql.trim_start().to_ascii_lowercase();
        ["alter ", "drop ", "create "]
            .iter()
            .any(|p| s.starts_with(p))
    }

    fn ddl(rng: &mut Gen, t: &str, mood: &str) -> String {
        let sql = [
            format!("alter table {t} alter column v type text"),
            format!("alter table {t} alter column v type int8 using v::int8"),
            format!("alter table {t} alter column v type int4 using v::int4"),
            format!("alter table {t} add column w int4 default 5"),
            format!("alter table {t} drop column if exists w"),
            format!("drop table if exists {t}; create table {t} (k int4, v int4)"),
            format!("drop type if exists {mood}; create type {mood} as enum ('ok', 'sad')"),
        ];
        let n = sql.len() - usize::from(rng.left_out("types"));
        sql[rng.gen_range(0..n)].clone()
    }

    /// Where the tested side's clients connect.
    enum Route {
        Usher(Usher, usize),
        /// Directly to `app`: the self-check.
        Direct,
    }

    struct Client {
        through: RawClient,
        direct: RawClient,
        /// The transaction status of the direct side's last ReadyForQuery.
        status: char,
        belief: Belief,
        /// DDL ran (or a transaction that ran some ended) since this
        /// client's last batch.
        after_ddl: bool,
        /// This client ran DDL in the transaction block it is in: others
        /// see it once the block ends.
        ddl_in_block: bool,
    }

    pub async fn run(
        pg: &'static PgCluster,
        config: &str,
        leave_out: &str,
        seed: u64,
        steps: usize,
    ) {
        twin(pg);
        let schema = schema(pg);
        let route = match config.split_once('/') {
            None if config == "direct" => Route::Direct,
            Some((mode, size)) => {
                let size: usize = size.parse().expect("<mode>/<pool_size>");
                let yaml =
                    format!("pool_mode: {mode}\npool_size: {size}\nauth:\n  method: trust\n");
                Route::Usher(Usher::start(pg, &yaml).await, size)
            }
            None => panic!("{config}: direct or <pool_mode>/<pool_size>"),
        };
        let session = config.starts_with("session/");
        let types_through = Types::connect(pg, "app").await;
        let types_direct = Types::connect(pg, TWIN).await;
        let mut rng = Gen::new(seed, leave_out);
        let mut trail = Trail::new(format!(
            "extended-protocol differential run: seed {seed}, {config}, {steps} steps, \
             leaving out '{leave_out}', schema {schema} (replay: USHER_DIFF_SEED={seed} \
             USHER_DIFF_CONFIGS={config} USHER_DIFF_STEPS={steps} USHER_DIFF_LEAVE_OUT='{leave_out}' \
             cargo test --test it extended_protocol::extended_protocol_differential)"
        ));
        eprintln!("{}", trail.what);
        // USHER_DIFF_SHOW=1: every step's batch and answer on stderr.
        let show = std::env::var_os("USHER_DIFF_SHOW").is_some();
        let mut soft = Vec::new();
        let mut clients: Vec<Option<Client>> = (0..CLIENTS).map(|_| None).collect();
        for step in 0..steps {
            // Clients that hold a server connection: in session mode every
            // connected one, in transaction mode those in a block.
            let holds = |c: &Option<Client>| c.as_ref().is_some_and(|c| session || c.status != 'I');
            let holding = clients.iter().filter(|c| holds(c)).count();
            let mut i = rng.gen_range(0..CLIENTS);
            if let Route::Usher(_, size) = &route {
                if holding >= *size && !holds(&clients[i]) {
                    let holders: Vec<usize> =
                        (0..CLIENTS).filter(|i| holds(&clients[*i])).collect();
                    i = holders[rng.gen_range(0..holders.len())];
                }
            }
            let t = format!("{schema}.t{i}");
            let mood = format!("{schema}.mood{i}");
            let Some(client) = clients[i].as_mut() else {
                trail.log.push(format!("[{step}] client {i} logs in"));
                let through = match &route {
                    Route::Usher(usher, _) => {
                        // A session-mode login waits for a server
                        // connection: only when one is free.
                        wait::eventually_async(
                            wait::DEADLINE,
                            "a free server connection",
                            || async { usher.app.deps.pools.all().iter().all(|p| !p.would_wait()) },
                        )
                        .await;
                        RawClient::tcp(usher.addr, &[("user", "alice"), ("database", "app")])
                            .await
                            .0
                    }
                    Route::Direct => {
                        RawClient::unix(&pg.dir, pg.port, &[("user", "alice"), ("database", "app")])
                            .await
                            .0
                    }
                };
                let direct =
                    RawClient::unix(&pg.dir, pg.port, &[("user", "alice"), ("database", TWIN)])
                        .await
                        .0;
                clients[i] = Some(Client {
                    through,
                    direct,
                    status: 'I',
                    belief: Belief::default(),
                    after_ddl: false,
                    ddl_in_block: false,
                });
                continue;
            };
            if rng.gen_bool(0.03) {
                trail.log.push(format!(
                    "[{step}] client {i} leaves (status {})",
                    client.status
                ));
                let client = clients[i].take().expect("connected");
                client.through.close().await;
                client.direct.close().await;
                continue;
            }
            // As a driver that meets 0A000 does: its statements from before
            // DDL are closed (and prepared again where used). Every name the
            // generator uses, not only those it believes open: a Close
            // behind an error in its batch was skipped, and the statement
            // it named is still there.
            let mut closes: Vec<Frontend> = Vec::new();
            if std::mem::take(&mut client.after_ddl) && rng.left_out("stale") {
                closes = ["", "s0", "s1", "s2", "s3"]
                    .into_iter()
                    .map(|name| Frontend::Close('S', name.to_string()))
                    .collect();
                closes.push(Frontend::Sync);
                client.belief.statements.clear();
            }
            let mut batch = match rng.gen_range(0..100) {
                // Out of a failed block, mostly.
                _ if client.status == 'E' && rng.gen_bool(0.4) => {
                    vec![Frontend::Query("ROLLBACK".into())]
                }
                0..=14 => vec![Frontend::Query(query(&mut rng, &mut client.belief, &t))],
                15..=21 if !rng.left_out("ddl") => vec![Frontend::Query(ddl(&mut rng, &t, &mood))],
                _ => extended(&mut rng, &mut client.belief, &t, &mood),
            };
            if !closes.is_empty() {
                closes.extend(batch);
                batch = closes;
            }
            let ddl = matches!(batch.first(), Some(Frontend::Query(sql)) if is_ddl(sql));
            if ddl {
                for c in clients.iter_mut().flatten() {
                    c.after_ddl = true;
                }
            }
            let Some(client) = clients[i].as_mut() else {
                unreachable!("connected")
            };
            client.ddl_in_block |= ddl && client.status != 'I';
            trail.log.push(format!("[{step}] client {i}: {batch:?}"));
            let got = converse(&mut client.through, &batch).await;
            let want = converse(&mut client.direct, &batch).await;
            let (got_lines, got_texts) = normalised(&got, &types_through).await;
            let (want_lines, want_texts) = normalised(&want, &types_direct).await;
            if got_lines != want_lines || want.silent {
                let list = |lines: &[String]| lines.join("\n    ");
                let sent: Vec<String> = batch.iter().map(|m| format!("{m:?}")).collect();
                trail.fail(
                    step,
                    format!(
                        "client {i} sent:\n    {}\ntested side ({config}):\n    {}\n\
                         direct:\n    {}\nerror texts: {got_texts:?}\n     direct: {want_texts:?}",
                        list(&sent),
                        list(&got_lines),
                        list(&want_lines),
                    ),
                );
            }
            if show {
                eprintln!("[{step}] client {i}: {batch:?}\n    {want_lines:?}");
            }
            if got_texts != want_texts {
                soft.push(format!(
                    "[{step}] {got_texts:?}\n      direct: {want_texts:?}"
                ));
            }
            if let Some(Msg::Ready(status)) = want.msgs.last() {
                client.status = *status;
            }
            if client.status == 'I' && std::mem::take(&mut client.ddl_in_block) {
                // Its DDL is everyone's now.
                for c in clients.iter_mut().flatten() {
                    c.after_ddl = true;
                }
            }
        }
        for client in clients.into_iter().flatten() {
            client.through.close().await;
            client.direct.close().await;
        }
        if !soft.is_empty() {
            eprintln!(
                "{}: error texts that differ (not failed on):\n{}",
                trail.what,
                soft.join("\n")
            );
        }
    }
}
