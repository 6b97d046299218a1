//! Test harness: a throwaway PostgreSQL cluster (initdb/pg_ctl, run as the
//! `postgres` OS user when the tests run as root) and usher in front of it.
#![allow(dead_code)]

pub mod attempts;
pub mod console;
pub mod libpq;
pub mod tls;
pub mod wire;

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
        let port = free_port();
        let conf = format!(
            "port = {port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{}'\nfsync = off\nsynchronous_commit = off\nfull_page_writes = off\nmax_connections = 300\nshared_buffers = 32MB\npassword_encryption = 'scram-sha-256'\nlog_min_messages = warning\n",
            dir.display()
        );
        std::fs::OpenOptions::new()
            .append(true)
            .open(data.join("postgresql.conf"))
            .unwrap()
            .write_all(conf.as_bytes())
            .unwrap();
        let cluster = PgCluster {
            port,
            dir,
            bin,
            _tmp: tmp,
        };
        cluster.pg_ctl_start();
        cluster.psql_super(&format!(
            "CREATE ROLE alice LOGIN PASSWORD '{ALICE_PASSWORD}'; CREATE ROLE bob LOGIN PASSWORD '{BOB_PASSWORD}';"
        ));
        cluster.psql_super("CREATE DATABASE app OWNER alice");
        cluster.psql_super("GRANT ALL ON DATABASE app TO bob");
        cluster.psql_super_db("app", "GRANT ALL ON SCHEMA public TO bob;");
        cluster
    }

    /// One cluster per test binary, stopped when the binary exits.
    pub fn shared() -> &'static PgCluster {
        static SHARED: OnceLock<PgCluster> = OnceLock::new();
        SHARED.get_or_init(|| {
            extern "C" fn stop_shared() {
                if let Some(c) = SHARED.get() {
                    c.stop();
                }
            }
            let c = PgCluster::start();
            unsafe { libc::atexit(stop_shared) };
            c
        })
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    pub fn pg_ctl_start(&self) {
        let mut c = pg_command(&self.bin, "pg_ctl");
        c.arg("-D")
            .arg(self.data())
            .arg("-l")
            .arg(self.dir.join("log"))
            .args(["-w", "-t", "60", "start"]);
        c.stdout(Stdio::null());
        run_ok(c, "pg_ctl start");
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
        cluster.port
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

/// usher as a child process (for signals and memory measurements).
pub struct UsherProcess {
    pub child: Child,
    pub port: u16,
    /// The configuration file it runs with (SIGHUP reads it again).
    pub config_path: PathBuf,
    _dir: tempfile::TempDir,
}

impl UsherProcess {
    pub fn start(cluster: &PgCluster, extra: &str) -> UsherProcess {
        let port = free_port();
        let yaml = usher_yaml(cluster, extra)
            .replace("listen: 127.0.0.1:0", &format!("listen: 127.0.0.1:{port}"));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("usher.yaml");
        std::fs::write(&path, yaml).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_usher"))
            .arg("--config")
            .arg(&path)
            .env("USHER_LOG", "warn")
            .spawn()
            .expect("start usher");
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "usher did not start listening"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        UsherProcess {
            child,
            port,
            config_path: path,
            _dir: dir,
        }
    }

    /// alice's connection string to this usher (database `app`).
    pub fn alice_conn_str(&self) -> String {
        format!(
            "host=127.0.0.1 port={} user=alice password={ALICE_PASSWORD} dbname=app",
            self.port
        )
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
}

impl Drop for UsherProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
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
pub fn sqlstate(e: &tokio_postgres::Error) -> Option<String> {
    e.as_db_error().map(|d| d.code().code().to_string())
}
