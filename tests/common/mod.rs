//! Test harness: a throwaway PostgreSQL cluster (initdb/pg_ctl, run as the
//! `postgres` OS user when the tests run as root) and usher in front of it.
#![allow(dead_code)]

pub mod attempts;
pub mod canary;
pub mod console;
pub mod differential;
pub mod libpq;
pub mod metrics;
pub mod raw;
pub mod replica;
pub mod tls;
pub mod turns;
pub mod wait;
pub mod wire;
// Until the lead's canary.rs lands (then remove).

use std::io::Write;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

pub const SUPERUSER_PASSWORD: &str = "postgres-pw";
pub const ALICE_PASSWORD: &str = "alice-pw";
pub const BOB_PASSWORD: &str = "bob-pw";

/// A PostgreSQL cluster in a temporary directory, stopped when dropped.
pub struct PgCluster {
    pub port: u16,
    pub dir: PathBuf,
    bin: PathBuf,
    _tmp: tempfile::TempDir,
}

fn is_root() -> bool {
    unsafe { libc::geteuid() == 0 }
}

/// The directory with initdb and pg_ctl: PATH first, then /usr/lib/postgresql/*/bin.
fn pg_bin_dir() -> PathBuf {
    if let Ok(out) = Command::new("sh")
        .args(["-c", "command -v initdb"])
        .output()
    {
        let p = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if !p.is_empty() {
            let p = std::fs::canonicalize(&p).unwrap_or_else(|_| PathBuf::from(&p));
            return p.parent().unwrap().to_path_buf();
        }
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL is not installed: no initdb on PATH and no /usr/lib/postgresql")
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("bin"))
        .filter(|p| p.join("initdb").exists())
        .collect();
    found.sort();
    found
        .pop()
        .expect("no initdb under /usr/lib/postgresql/*/bin")
}

/// Runs a PostgreSQL server program, as the postgres OS user when we are root.
fn pg_command(bin: &Path, program: &str) -> Command {
    let path = bin.join(program);
    if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(path);
        c
    } else {
        Command::new(path)
    }
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn run_ok(mut cmd: Command, what: &str) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl PgCluster {
    /// initdb, configure (scram-sha-256 over TCP, test roles), start.
    pub fn start() -> PgCluster {
        PgCluster::start_first_on(None)
    }

    /// [`PgCluster::start`], trying `port` first (tests of the harness: a
    /// port already taken). free_port() can race with another process
    /// taking the port before the server binds it: the server then exits
    /// (EADDRINUSE) and is started again on another port.
    pub fn start_first_on(first_port: Option<u16>) -> PgCluster {
        let bin = pg_bin_dir();
        let tmp = tempfile::Builder::new()
            .prefix("usher-pg-")
            .tempdir()
            .unwrap();
        let dir = tmp.path().to_path_buf();
        if is_root() {
            run_ok(
                {
                    let mut c = Command::new("chown");
                    c.arg("postgres:postgres").arg(&dir);
                    c
                },
                "chown",
            );
        }
        let pwfile = dir.join("pwfile");
        std::fs::write(&pwfile, SUPERUSER_PASSWORD).unwrap();
        if is_root() {
            run_ok(
                {
                    let mut c = Command::new("chown");
                    c.arg("postgres:postgres").arg(&pwfile);
                    c
                },
                "chown",
            );
        }
        let data = dir.join("data");
        let mut initdb = pg_command(&bin, "initdb");
        initdb
            .arg("-D")
            .arg(&data)
            .args([
                "-U",
                "postgres",
                "-E",
                "UTF8",
                "--locale=C",
                "-N",
                "--auth-local=trust",
                "--auth-host=scram-sha-256",
            ])
            .arg(format!("--pwfile={}", pwfile.display()));
        run_ok(initdb, "initdb");
        let conf = format!(
            "listen_addresses = '127.0.0.1'\nunix_socket_directories = '{}'\nfsync = off\nsynchronous_commit = off\nfull_page_writes = off\nmax_connections = 400\nshared_buffers = 32MB\npassword_encryption = 'scram-sha-256'\nlog_min_messages = warning\n",
            dir.display()
        );
        std::fs::OpenOptions::new()
            .append(true)
            .open(data.join("postgresql.conf"))
            .unwrap()
            .write_all(conf.as_bytes())
            .unwrap();
        let mut cluster = PgCluster {
            port: 0,
            dir,
            bin,
            _tmp: tmp,
        };
        let mut first_port = first_port;
        for attempt in 1.. {
            cluster.port = first_port.take().unwrap_or_else(free_port);
            // The last `port` line of postgresql.conf wins.
            std::fs::OpenOptions::new()
                .append(true)
                .open(data.join("postgresql.conf"))
                .unwrap()
                .write_all(format!("port = {}\n", cluster.port).as_bytes())
                .unwrap();
            let log = cluster.dir.join("log");
            let logged = std::fs::metadata(&log).map_or(0, |m| m.len() as usize);
            let out = cluster.pg_ctl_start_output();
            if out.status.success() {
                break;
            }
            let new_log = std::fs::read(&log).unwrap_or_default();
            let new_log = String::from_utf8_lossy(&new_log[logged.min(new_log.len())..]);
            assert!(
                new_log.contains("Address already in use") && attempt < 5,
                "pg_ctl start failed: {}\n{}\n{new_log}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        cluster.psql_super(&format!(
            "CREATE ROLE alice LOGIN PASSWORD '{ALICE_PASSWORD}'; CREATE ROLE bob LOGIN PASSWORD '{BOB_PASSWORD}';"
        ));
        cluster.psql_super("CREATE DATABASE app OWNER alice");
        cluster.psql_super("GRANT ALL ON DATABASE app TO bob");
        cluster.psql_super_db("app", "GRANT ALL ON SCHEMA public TO bob;");
        cluster
    }

    /// The cluster the tests of a binary share, started on first use and
    /// stopped when the binary exits. Tests on it keep to objects of their
    /// own (tables, schemas, databases, roles with names of their own).
    pub fn shared() -> &'static PgCluster {
        PgCluster::own("shared")
    }

    /// A cluster of its own for the tests of one module (pass
    /// `module_path!()`), started on first use and stopped when the binary
    /// exits: for tests that change the whole cluster (its TLS certificate,
    /// pg_hba.conf, a role's grants) or count every backend of a role,
    /// which the tests of other modules running beside them would disturb.
    pub fn own(name: &'static str) -> &'static PgCluster {
        type Slot = &'static OnceLock<PgCluster>;
        static SLOTS: std::sync::Mutex<Vec<(&'static str, Slot)>> =
            std::sync::Mutex::new(Vec::new());
        static STOP_AT_EXIT: std::sync::Once = std::sync::Once::new();
        extern "C" fn stop_all() {
            let slots = SLOTS.lock().unwrap_or_else(|e| e.into_inner());
            // Statics are never dropped, so their TempDirs are not either:
            // the data directories go here (a run left some 150 MB each).
            for c in slots.iter().filter_map(|(_, slot)| slot.get()) {
                c.stop();
                let _ = std::fs::remove_dir_all(&c.dir);
            }
        }
        STOP_AT_EXIT.call_once(|| unsafe {
            libc::atexit(stop_all);
        });
        // One slot per name, filled outside the list's lock, so that a
        // module starting its cluster does not hold up the others.
        let slot: Slot = {
            let mut slots = SLOTS.lock().unwrap_or_else(|e| e.into_inner());
            match slots.iter().find(|(n, _)| *n == name) {
                Some((_, slot)) => slot,
                None => {
                    let slot: Slot = Box::leak(Box::default());
                    slots.push((name, slot));
                    slot
                }
            }
        };
        slot.get_or_init(PgCluster::start)
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    pub fn pg_ctl_start(&self) {
        let out = self.pg_ctl_start_output();
        assert!(
            out.status.success(),
            "pg_ctl start failed: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn pg_ctl_start_output(&self) -> std::process::Output {
        let mut c = pg_command(&self.bin, "pg_ctl");
        c.arg("-D")
            .arg(self.data())
            .arg("-l")
            .arg(self.dir.join("log"))
            .args(["-w", "-t", "60", "start"]);
        c.output().expect("pg_ctl start")
    }

    pub fn stop(&self) {
        let mut c = pg_command(&self.bin, "pg_ctl");
        c.arg("-D")
            .arg(self.data())
            .args(["-m", "immediate", "-w", "stop"]);
        let _ = c.stdout(Stdio::null()).stderr(Stdio::null()).status();
    }

    /// Restarts the server (clients connected to it lose their connections).
    pub fn restart(&self) {
        let mut c = pg_command(&self.bin, "pg_ctl");
        c.arg("-D")
            .arg(self.data())
            .arg("-l")
            .arg(self.dir.join("log"))
            .args(["-m", "fast", "-w", "restart"]);
        c.stdout(Stdio::null());
        run_ok(c, "pg_ctl restart");
    }

    pub fn psql_super(&self, sql: &str) -> String {
        self.psql_super_db("postgres", sql)
    }

    /// Creates `role` with `attributes` (e.g. "NOLOGIN") unless it exists.
    /// Tests share the cluster and run at once: two creating the same role
    /// together meet as a unique_violation on pg_authid, not as
    /// duplicate_object, so both mean "already there".
    pub fn ensure_role(&self, role: &str, attributes: &str) {
        self.psql_super(&format!(
            "DO $$ BEGIN CREATE ROLE {role} {attributes}; \
             EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL; END $$"
        ));
    }

    /// Runs SQL as the superuser over the Unix socket; returns the output.
    pub fn psql_super_db(&self, db: &str, sql: &str) -> String {
        let out = Command::new("psql")
            .args(["-X", "-q", "-t", "-A", "-v", "ON_ERROR_STOP=1", "-h"])
            .arg(&self.dir)
            .args([
                "-p",
                &self.port.to_string(),
                "-U",
                "postgres",
                "-d",
                db,
                "-c",
                sql,
            ])
            .output()
            .expect("psql");
        assert!(
            out.status.success(),
            "psql {sql}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// Whether `query` runs on this cluster now (active in pg_stat_activity).
    pub fn query_active(&self, query: &str) -> bool {
        let n = self.psql_super(&format!(
            "SELECT count(*) FROM pg_stat_activity WHERE query = '{}' AND state = 'active'",
            query.replace('\'', "''")
        ));
        n != "0"
    }

    /// Waits until `query` runs on this cluster (psql polls it off the
    /// runtime's threads).
    pub async fn wait_until_active(&'static self, query: &str) {
        let query = query.to_string();
        wait::eventually_async(wait::DEADLINE, &format!("{query} runs"), || {
            let query = query.clone();
            async move {
                tokio::task::spawn_blocking(move || self.query_active(&query))
                    .await
                    .unwrap()
            }
        })
        .await
    }

    pub fn bin(&self, program: &str) -> PathBuf {
        self.bin.join(program)
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The YAML for usher in front of `cluster`, with `extra` lines appended
/// (later keys must not repeat the ones here). Unless `extra` configures
/// hooks, the hooks folder is one without files, so the example hooks of
/// the repository do not run in every test.
pub fn usher_yaml(cluster: &PgCluster, extra: &str) -> String {
    usher_yaml_for(cluster.port, extra)
}

fn usher_yaml_for(cluster_port: u16, extra: &str) -> String {
    let hooks = if extra.contains("hooks:") {
        ""
    } else {
        "hooks:\n  dir: tests/no-hooks\n"
    };
    format!(
        "listen: 127.0.0.1:0\n\
         databases:\n  app:\n    host: 127.0.0.1\n    port: {}\n\
         users:\n  alice:\n    password: {ALICE_PASSWORD}\n  bob:\n    password: {BOB_PASSWORD}\n  admin:\n    password: admin-pw\n\
         admin:\n  users: [admin]\n{hooks}{extra}",
        cluster_port
    )
}

/// usher running inside the test process; shut down when dropped. Its
/// configuration is a file (`config_path`) that RELOAD reads again.
pub struct Usher {
    pub addr: SocketAddr,
    pub app: Arc<usher::App>,
    pub config_path: PathBuf,
    _dir: tempfile::TempDir,
}

impl Usher {
    pub async fn start(cluster: &PgCluster, extra: &str) -> Usher {
        Usher::start_yaml(&usher_yaml(cluster, extra)).await
    }

    pub async fn start_yaml(yaml: &str) -> Usher {
        init_tracing();
        let dir = tempfile::tempdir().unwrap();
        let config_path = dir.path().join("usher.yaml");
        std::fs::write(&config_path, yaml).unwrap();
        let config = usher::Config::load(&config_path).expect("test config");
        let server = usher::Server::bind(config, Default::default())
            .await
            .expect("bind");
        let addr = server.local_addr();
        let app = server.app.clone();
        tokio::spawn(server.run());
        Usher {
            addr,
            app,
            config_path,
            _dir: dir,
        }
    }

    /// Replaces the configuration file (RELOAD reads it).
    pub fn rewrite_config(&self, yaml: &str) {
        std::fs::write(&self.config_path, yaml).unwrap();
    }

    pub fn conn_str(&self, user: &str, password: &str) -> String {
        self.conn_str_db(user, password, "app")
    }

    pub fn conn_str_db(&self, user: &str, password: &str, database: &str) -> String {
        format!(
            "host=127.0.0.1 port={} user={user} password={password} dbname={database}",
            self.addr.port()
        )
    }

    pub async fn connect_as(
        &self,
        user: &str,
        password: &str,
    ) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
        let (client, conn) =
            tokio_postgres::connect(&self.conn_str(user, password), tokio_postgres::NoTls).await?;
        tokio::spawn(conn);
        Ok(client)
    }

    pub async fn alice(&self) -> tokio_postgres::Client {
        self.connect_as("alice", ALICE_PASSWORD)
            .await
            .expect("alice connects")
    }
}

impl Drop for Usher {
    fn drop(&mut self) {
        self.app.begin_shutdown();
    }
}

/// The usher binary for its one-shot commands (`check`, `hooks check`,
/// `hooks try`); a running usher is started with [`UsherProcess::builder`].
/// alice's client of `port` (usher, or PostgreSQL directly) with extra
/// connection settings (`options='-c ...'`, `application_name=...`).
pub async fn alice_with(port: u16, extra: &str) -> tokio_postgres::Client {
    let conn = format!(
        "host=127.0.0.1 port={port} user=alice password={ALICE_PASSWORD} dbname=app {extra}"
    );
    let (c, driver) = tokio_postgres::connect(&conn, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| panic!("{conn}: {e:?}"));
    tokio::spawn(driver);
    c
}

pub fn usher_cli() -> Command {
    Command::new(env!("CARGO_BIN_EXE_usher"))
}

/// usher as a child process (for signals, exit codes, its log, resource
/// limits and memory measurements), started with [`UsherProcess::builder`].
/// Its stderr (the log) goes to a file ([`UsherProcess::log`]), printed
/// when a test fails while it runs.
pub struct UsherProcess {
    pub child: Child,
    pub port: u16,
    /// The metrics endpoint's port, when started with `.metrics()`.
    pub metrics_port: Option<u16>,
    /// The configuration file it runs with (SIGHUP reads it again).
    pub config_path: PathBuf,
    log_path: PathBuf,
    _dir: tempfile::TempDir,
}

/// How to start an [`UsherProcess`]: the configuration, the environment,
/// arguments and limits of the child.
pub struct UsherProcessBuilder {
    yaml: YamlSource,
    metrics: bool,
    env: Vec<(String, Option<String>)>,
    args: Vec<String>,
    nofile: Option<u64>,
    first_port: Option<u16>,
}

enum YamlSource {
    /// `usher_yaml(cluster, extra)`: the cluster's port and the extra lines.
    Cluster(u16, String),
    /// The whole configuration.
    Whole(String),
}

impl UsherProcessBuilder {
    /// Lines appended to the configuration (see [`usher_yaml`]).
    pub fn extra(mut self, yaml: &str) -> Self {
        match &mut self.yaml {
            YamlSource::Cluster(_, extra) => extra.push_str(yaml),
            YamlSource::Whole(whole) => whole.push_str(yaml),
        }
        self
    }

    /// Runs the metrics endpoint on a port of its own (`metrics_port`).
    pub fn metrics(mut self) -> Self {
        self.metrics = true;
        self
    }

    /// Sets an environment variable of the child (`USHER_LOG` is `warn`
    /// unless set or removed here).
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.to_string(), Some(value.to_string())));
        self
    }

    /// Removes an environment variable from the child's (`USHER_LOG`: then
    /// the configuration's `log.*` applies).
    pub fn env_remove(mut self, key: &str) -> Self {
        self.env.push((key.to_string(), None));
        self
    }

    /// A command-line argument after `--config FILE`.
    pub fn arg(mut self, arg: &str) -> Self {
        self.args.push(arg.to_string());
        self
    }

    /// Limits the child's file descriptors (RLIMIT_NOFILE, set in the child
    /// only: the test process keeps its own).
    pub fn rlimit_nofile(mut self, n: u64) -> Self {
        self.nofile = Some(n);
        self
    }

    /// The port of the first attempt to start (tests of the harness: a
    /// port already taken).
    pub fn first_port(mut self, port: u16) -> Self {
        self.first_port = Some(port);
        self
    }

    /// Starts usher and waits until it listens. free_port() can race with
    /// another process taking the port before usher binds it: usher then
    /// exits (EADDRINUSE), and it is started again on other ports.
    pub fn start(self) -> UsherProcess {
        let dir = tempfile::tempdir().unwrap();
        let config_path = dir.path().join("usher.yaml");
        let log_path = dir.path().join("stderr.log");
        let mut dir = Some(dir);
        let mut first_port = self.first_port;
        for _ in 0..5 {
            let port = first_port.take().unwrap_or_else(free_port);
            let metrics_port = self.metrics.then(free_port);
            let mut yaml = match &self.yaml {
                YamlSource::Cluster(cluster_port, extra) => usher_yaml_for(*cluster_port, extra),
                YamlSource::Whole(whole) => whole.clone(),
            };
            assert!(
                yaml.contains("listen: 127.0.0.1:0\n"),
                "the configuration must say `listen: 127.0.0.1:0`"
            );
            yaml = yaml.replacen(
                "listen: 127.0.0.1:0\n",
                &format!("listen: 127.0.0.1:{port}\n"),
                1,
            );
            if let Some(m) = metrics_port {
                yaml.push_str(&format!("metrics:\n  listen: 127.0.0.1:{m}\n"));
            }
            std::fs::write(&config_path, yaml).unwrap();
            let mut command = usher_cli();
            command
                .arg("--config")
                .arg(&config_path)
                .args(&self.args)
                .env("USHER_LOG", "warn")
                .stderr(std::fs::File::create(&log_path).unwrap());
            for (key, value) in &self.env {
                match value {
                    Some(v) => command.env(key, v),
                    None => command.env_remove(key),
                };
            }
            if let Some(nofile) = self.nofile {
                use std::os::unix::process::CommandExt;
                // SAFETY: setrlimit is async-signal-safe; nothing else runs
                // between fork and exec.
                unsafe {
                    command.pre_exec(move || {
                        let limit = libc::rlimit {
                            rlim_cur: nofile,
                            rlim_max: nofile,
                        };
                        if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                            return Err(std::io::Error::last_os_error());
                        }
                        Ok(())
                    });
                }
            }
            let mut child = command.spawn().expect("start usher");
            // Listening: its own socket on the port (not merely something
            // answering there), or it exited.
            let exited = wait::wait_for(Duration::from_secs(30), "usher listens", || {
                if let Some(status) = child.try_wait().unwrap() {
                    return Ok(Some(status));
                }
                if wait::listens_on(child.id(), port) {
                    return Ok(None);
                }
                Err(std::fs::read_to_string(&log_path).unwrap_or_default())
            });
            match exited {
                None => {
                    return UsherProcess {
                        child,
                        port,
                        metrics_port,
                        config_path,
                        log_path,
                        _dir: dir.take().unwrap(),
                    }
                }
                Some(status) => {
                    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                    // EADDRINUSE: a port was taken; again with others.
                    assert!(
                        log.contains("os error 98"),
                        "usher exited at start ({status}):\n{log}"
                    );
                }
            }
        }
        panic!("usher did not start: its ports were taken five times");
    }
}

impl UsherProcess {
    /// usher in front of `cluster` (the configuration of [`usher_yaml`]).
    pub fn builder(cluster: &PgCluster) -> UsherProcessBuilder {
        UsherProcess::builder_from(YamlSource::Cluster(cluster.port, String::new()))
    }

    /// usher with the whole configuration given; it must say
    /// `listen: 127.0.0.1:0`, as [`usher_yaml`] does (the port is chosen at
    /// start).
    pub fn builder_yaml(yaml: &str) -> UsherProcessBuilder {
        UsherProcess::builder_from(YamlSource::Whole(yaml.to_string()))
    }

    fn builder_from(yaml: YamlSource) -> UsherProcessBuilder {
        UsherProcessBuilder {
            yaml,
            metrics: false,
            env: Vec::new(),
            args: Vec::new(),
            nofile: None,
            first_port: None,
        }
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// A connection string to this usher.
    pub fn conn_str(&self, user: &str, password: &str, database: &str) -> String {
        format!(
            "host=127.0.0.1 port={} user={user} password={password} dbname={database}",
            self.port
        )
    }

    /// alice's connection string to this usher (database `app`).
    pub fn alice_conn_str(&self) -> String {
        self.conn_str("alice", ALICE_PASSWORD, "app")
    }

    /// alice connected to this usher, with her connection's driver task.
    pub async fn alice(
        &self,
    ) -> (
        tokio_postgres::Client,
        tokio::task::JoinHandle<Result<(), tokio_postgres::Error>>,
    ) {
        let (c, conn) = tokio_postgres::connect(&self.alice_conn_str(), tokio_postgres::NoTls)
            .await
            .expect("alice connects");
        (c, tokio::spawn(conn))
    }

    pub fn signal(&self, sig: i32) {
        unsafe { libc::kill(self.child.id() as i32, sig) };
    }

    /// What usher wrote to stderr so far (its log).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap()
    }

    /// Waits (up to `timeout`) for usher to exit; its exit status.
    pub fn wait_exit(&mut self, timeout: Duration) -> std::process::ExitStatus {
        let child = &mut self.child;
        wait::wait_for(timeout, "usher exits", || {
            child.try_wait().unwrap().ok_or("still running")
        })
    }
}

impl Drop for UsherProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!(
                "--- usher's log (port {}) ---\n{}",
                self.port,
                std::fs::read_to_string(&self.log_path).unwrap_or_default()
            );
        }
    }
}

pub fn init_tracing() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(std::env::var("USHER_LOG").unwrap_or_else(|_| "warn".into()))
            .with_test_writer()
            .try_init();
    });
}

/// The SQLSTATE of a tokio-postgres error, if the server (usher) sent one.
/// The pid of the backend that runs `c`'s next statement.
pub async fn backend_pid(c: &impl tokio_postgres::GenericClient) -> i32 {
    c.query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0)
}

pub fn sqlstate(e: &tokio_postgres::Error) -> Option<String> {
    e.as_db_error().map(|d| d.code().code().to_string())
}

/// A memory figure of a process from /proc/PID/status, in KB: `VmRSS`
/// (resident now) or `VmHWM` (the peak so far).
pub fn status_kb(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{field} in /proc/{pid}/status"))
}

/// For the tests of one binary that must not overlap (e.g. each counts
/// all of alice's backends on the shared cluster): held across the test's
/// awaits on purpose, each test has a runtime of its own, so a waiting one
/// blocks only its own thread.
#[allow(dead_code)]
pub fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}
