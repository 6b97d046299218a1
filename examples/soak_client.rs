//! The client side of `benches/soak.sh` (run by hand, not part of CI).
//!
//! A raw PostgreSQL protocol client (postgres-protocol's message codecs, no
//! connection pool of its own) that holds thousands of connections to usher
//! at once and drives them through phases:
//!
//! 1. `connect`: open `--clients` connections (`--connect-concurrency` logins
//!    at a time);
//! 2. `idle`: all of them sit idle for `--idle-secs`;
//! 3. `active`: all of them run `--active-txns` transactions at once;
//! 4. `storm`: for `--storm-secs`, `--storm-workers` loops log in, run one
//!    transaction and leave, continuously, while `--storm-active` of the held
//!    clients keep running transactions (a client closed with an error logs
//!    in again) and the others stay idle; meanwhile `--restart-cmd` and
//!    `--reload-cmd` run alternately, `--events` times in all;
//! 5. `check`: every held client runs one more transaction;
//! 6. `close`: every client leaves; usher's descriptors are counted again.
//!
//! A transaction is `BEGIN`, `SELECT $1::int + 1` (extended protocol, the
//! answer is checked) and `COMMIT`, three round trips that hold the server
//! connection. Each operation ends one way: ok; an ErrorResponse (counted by
//! SQLSTATE, `!` marking FATAL); lost (the connection closed, or answered
//! nonsense, without an ErrorResponse); or hung (neither an answer nor an
//! error within `--deadline-secs`). Lost and hung must stay at zero.
//!
//! With `--usher-pid`, a sampler thread reads /proc/PID every 200 ms: peak
//! resident memory and descriptors per phase, CPU time per phase, VmHWM.
//! Prints a Markdown table; exits 1 if any client was lost or hung or got
//! a wrong answer, or a restart/reload command failed (the run is invalid).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::{BufMut, BytesMut};
use clap::Parser;
use fallible_iterator::FallibleIterator;
use postgres_protocol::authentication::md5_hash;
use postgres_protocol::authentication::sasl::{ChannelBinding, ScramSha256};
use postgres_protocol::message::{backend::Message, frontend};
use postgres_protocol::IsNull;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Semaphore;

#[derive(Parser, Clone)]
struct Args {
    #[arg(long, default_value = "127.0.0.1:6432")]
    addr: String,
    #[arg(long, default_value = "bench")]
    user: String,
    #[arg(long, default_value = "bench-pw")]
    password: String,
    #[arg(long, default_value = "bench")]
    database: String,
    #[arg(long, default_value_t = 10_000)]
    clients: usize,
    #[arg(long, default_value_t = 200)]
    connect_concurrency: usize,
    #[arg(long, default_value_t = 10)]
    idle_secs: u64,
    #[arg(long, default_value_t = 3)]
    active_txns: usize,
    #[arg(long, default_value_t = 60)]
    storm_secs: u64,
    #[arg(long, default_value_t = 20)]
    storm_workers: usize,
    #[arg(long, default_value_t = 200)]
    storm_active: usize,
    #[arg(long, default_value_t = 6)]
    events: usize,
    #[arg(long)]
    restart_cmd: Option<String>,
    #[arg(long)]
    reload_cmd: Option<String>,
    #[arg(long)]
    usher_pid: Option<u32>,
    /// An operation with neither an answer nor an error by then is hung.
    #[arg(long, default_value_t = 60)]
    deadline_secs: u64,
}

const PHASES: [&str; 6] = ["connect", "idle", "active", "storm", "check", "close"];

/// How one operation (a login, a transaction) ended, when not well.
#[derive(Debug)]
enum Fail {
    /// An ErrorResponse: SQLSTATE, FATAL (the connection is gone) or not.
    Error {
        code: String,
        fatal: bool,
        message: String,
    },
    /// Closed, reset or garbled without an ErrorResponse.
    Lost(String),
    Hung,
    /// The answer to `SELECT $1::int + 1` was not n + 1.
    Wrong(String),
}

#[derive(Default)]
struct PhaseStats {
    ok: u64,
    logins: u64,
    errors: BTreeMap<String, u64>,
    lost: u64,
    hung: u64,
    wrong: u64,
    peak_rss_kb: u64,
    peak_fds: u64,
    cpu_start: f64,
    cpu_end: f64,
    secs: f64,
    clients: String,
}

struct Stats {
    phases: Mutex<Vec<PhaseStats>>,
    current: AtomicUsize,
    examples: Mutex<Vec<String>>,
    /// How many errors of each SQLSTATE and message (digits masked).
    messages: Mutex<BTreeMap<(String, String), u64>>,
}

impl Stats {
    fn record(&self, what: &str, r: &Result<(), Fail>) {
        let phase = self.current.load(Ordering::Relaxed);
        let mut phases = self.phases.lock().unwrap();
        let p = &mut phases[phase];
        let example = match r {
            Ok(()) => {
                p.ok += 1;
                None
            }
            Err(Fail::Error {
                code,
                fatal,
                message,
            }) => {
                let key = if *fatal {
                    format!("{code}!")
                } else {
                    code.clone()
                };
                *p.errors.entry(key.clone()).or_default() += 1;
                drop(phases);
                // Ports, pids and counts vary; the message's shape is kept.
                let shape: String = message
                    .chars()
                    .map(|c| if c.is_ascii_digit() { '#' } else { c })
                    .collect();
                *self
                    .messages
                    .lock()
                    .unwrap()
                    .entry((key, shape))
                    .or_default() += 1;
                return;
            }
            Err(Fail::Lost(why)) => {
                p.lost += 1;
                Some(format!("{}: {what} lost: {why}", PHASES[phase]))
            }
            Err(Fail::Hung) => {
                p.hung += 1;
                Some(format!("{}: {what} hung", PHASES[phase]))
            }
            Err(Fail::Wrong(why)) => {
                p.wrong += 1;
                Some(format!("{}: {what} wrong answer: {why}", PHASES[phase]))
            }
        };
        drop(phases);
        if let Some(e) = example {
            let mut ex = self.examples.lock().unwrap();
            if ex.len() < 20 {
                eprintln!("soak: {e}");
                ex.push(e);
            }
        }
    }

    fn login(&self) {
        let phase = self.current.load(Ordering::Relaxed);
        self.phases.lock().unwrap()[phase].logins += 1;
    }
}

struct Conn {
    stream: TcpStream,
    buf: BytesMut,
    out: BytesMut,
}

impl Conn {
    async fn connect(args: &Args) -> Result<Conn, Fail> {
        let stream = TcpStream::connect(&args.addr)
            .await
            .map_err(|e| Fail::Lost(format!("connect: {e}")))?;
        let _ = stream.set_nodelay(true);
        let mut conn = Conn {
            stream,
            buf: BytesMut::new(),
            out: BytesMut::new(),
        };
        let params = [
            ("user", args.user.as_str()),
            ("database", args.database.as_str()),
            ("application_name", "soak"),
        ];
        frontend::startup_message(params.iter().copied(), &mut conn.out).unwrap();
        conn.send().await?;
        let mut scram: Option<ScramSha256> = None;
        loop {
            match conn.read_msg().await? {
                Message::AuthenticationOk => {}
                Message::AuthenticationCleartextPassword => {
                    frontend::password_message(args.password.as_bytes(), &mut conn.out).unwrap();
                    conn.send().await?;
                }
                Message::AuthenticationMd5Password(body) => {
                    let hash =
                        md5_hash(args.user.as_bytes(), args.password.as_bytes(), body.salt());
                    frontend::password_message(hash.as_bytes(), &mut conn.out).unwrap();
                    conn.send().await?;
                }
                Message::AuthenticationSasl(_) => {
                    let s =
                        ScramSha256::new(args.password.as_bytes(), ChannelBinding::unsupported());
                    frontend::sasl_initial_response("SCRAM-SHA-256", s.message(), &mut conn.out)
                        .unwrap();
                    scram = Some(s);
                    conn.send().await?;
                }
                Message::AuthenticationSaslContinue(body) => {
                    let s = scram
                        .as_mut()
                        .ok_or_else(|| lost("SASL continue unasked"))?;
                    s.update(body.data())
                        .map_err(|e| lost(&format!("SCRAM: {e}")))?;
                    frontend::sasl_response(s.message(), &mut conn.out).unwrap();
                    conn.send().await?;
                }
                Message::AuthenticationSaslFinal(body) => {
                    let s = scram.as_mut().ok_or_else(|| lost("SASL final unasked"))?;
                    s.finish(body.data())
                        .map_err(|e| lost(&format!("SCRAM: {e}")))?;
                }
                Message::ParameterStatus(_)
                | Message::BackendKeyData(_)
                | Message::NoticeResponse(_) => {}
                Message::ErrorResponse(body) => return Err(error_of(&body)),
                Message::ReadyForQuery(_) => return Ok(conn),
                _ => return Err(lost("unexpected message during login")),
            }
        }
    }

    async fn send(&mut self) -> Result<(), Fail> {
        let out = self.out.split();
        self.stream
            .write_all(&out)
            .await
            .map_err(|e| Fail::Lost(format!("write: {e}")))
    }

    async fn read_msg(&mut self) -> Result<Message, Fail> {
        loop {
            match Message::parse(&mut self.buf) {
                Ok(Some(m)) => return Ok(m),
                Ok(None) => {}
                Err(e) => return Err(lost(&format!("bad message: {e}"))),
            }
            match self.stream.read_buf(&mut self.buf).await {
                Ok(0) => return Err(lost("closed without an ErrorResponse")),
                Ok(_) => {}
                Err(e) => return Err(lost(&format!("read: {e}"))),
            }
        }
    }

    /// Reads to ReadyForQuery. The first ErrorResponse is the result; after
    /// a FATAL one nothing more is read. Returns the first column of the
    /// last DataRow, if any.
    async fn until_ready(&mut self) -> Result<Option<String>, Fail> {
        let mut error = None;
        let mut value = None;
        loop {
            match self.read_msg().await? {
                Message::ReadyForQuery(_) => break,
                Message::ErrorResponse(body) => {
                    let e = error_of(&body);
                    if let Fail::Error { fatal: true, .. } = e {
                        return Err(e);
                    }
                    error.get_or_insert(e);
                }
                Message::DataRow(row) => {
                    let range = row.ranges().next().ok().flatten().flatten();
                    value = range.map(|r| String::from_utf8_lossy(&row.buffer()[r]).into_owned());
                }
                _ => {}
            }
        }
        if self.buf.is_empty() && self.buf.capacity() > 4096 {
            self.buf = BytesMut::new();
        }
        match error {
            Some(e) => Err(e),
            None => Ok(value),
        }
    }

    async fn simple(&mut self, sql: &str) -> Result<(), Fail> {
        frontend::query(sql, &mut self.out).unwrap();
        self.send().await?;
        self.until_ready().await.map(|_| ())
    }

    /// BEGIN; SELECT $1::int + 1 (extended protocol, answer checked); COMMIT.
    async fn txn(&mut self, n: i32) -> Result<(), Fail> {
        self.simple("BEGIN").await?;
        let r = self.select(n).await;
        if let Err(Fail::Error { fatal: false, .. }) = r {
            self.simple("ROLLBACK").await?;
            return r;
        }
        r?;
        self.simple("COMMIT").await
    }

    async fn select(&mut self, n: i32) -> Result<(), Fail> {
        let out = &mut self.out;
        frontend::parse("", "SELECT $1::int + 1", [], out).unwrap();
        let param = n.to_string();
        let bound = frontend::bind(
            "",
            "",
            [0i16],
            [param.as_bytes()],
            |v, buf| {
                buf.put_slice(v);
                Ok(IsNull::No)
            },
            [0i16],
            out,
        );
        assert!(bound.is_ok());
        frontend::execute("", 0, out).unwrap();
        frontend::sync(out);
        self.send().await?;
        let want = (n + 1).to_string();
        match self.until_ready().await? {
            Some(v) if v == want => Ok(()),
            got => Err(Fail::Wrong(format!("asked {n} + 1, got {got:?}"))),
        }
    }

    async fn terminate(mut self) {
        frontend::terminate(&mut self.out);
        let _ = self.send().await;
        let _ = self.stream.shutdown().await;
    }
}

fn lost(why: &str) -> Fail {
    Fail::Lost(why.to_string())
}

fn error_of(body: &postgres_protocol::message::backend::ErrorResponseBody) -> Fail {
    let mut code = String::from("?????");
    let mut severity = String::new();
    let mut message = String::new();
    let mut fields = body.fields();
    while let Ok(Some(f)) = fields.next() {
        let value = String::from_utf8_lossy(f.value_bytes()).into_owned();
        match f.type_() {
            b'C' => code = value,
            b'V' => severity = value,
            b'S' if severity.is_empty() => severity = value,
            b'M' => message = value,
            _ => {}
        }
    }
    Fail::Error {
        code,
        fatal: severity == "FATAL" || severity == "PANIC",
        message,
    }
}

/// Runs `f` under the deadline; a timeout is a hung client.
async fn deadline<T>(
    d: Duration,
    f: impl std::future::Future<Output = Result<T, Fail>>,
) -> Result<T, Fail> {
    tokio::time::timeout(d, f).await.unwrap_or(Err(Fail::Hung))
}

/// Logs in, recording the outcome.
async fn login(args: &Args, stats: &Stats) -> Option<Conn> {
    let r = deadline(Duration::from_secs(args.deadline_secs), Conn::connect(args)).await;
    stats.login();
    match r {
        Ok(c) => {
            stats.record("login", &Ok(()));
            Some(c)
        }
        Err(e) => {
            stats.record("login", &Err(e));
            None
        }
    }
}

/// One transaction on a held connection; the connection is kept only if
/// it is still usable.
async fn txn(args: &Args, stats: &Stats, conn: Conn, n: i32) -> Option<Conn> {
    let mut conn = conn;
    let r = deadline(Duration::from_secs(args.deadline_secs), conn.txn(n)).await;
    let keep = matches!(r, Ok(()) | Err(Fail::Error { fatal: false, .. }));
    stats.record("transaction", &r);
    keep.then_some(conn)
}

// ---- /proc sampling -------------------------------------------------------

struct Proc {
    pid: u32,
    tick: f64,
}

impl Proc {
    fn status(&self, key: &str) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.pid)).unwrap_or_default();
        s.lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }
    fn fds(&self) -> u64 {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid))
            .map(|d| d.count() as u64)
            .unwrap_or(0)
    }
    /// utime + stime, in seconds.
    fn cpu(&self) -> f64 {
        let s = std::fs::read_to_string(format!("/proc/{}/stat", self.pid)).unwrap_or_default();
        let after = s.rsplit_once(") ").map(|(_, a)| a).unwrap_or("");
        let f: Vec<u64> = after
            .split_whitespace()
            .map(|v| v.parse().unwrap_or(0))
            .collect();
        if f.len() < 13 {
            return 0.0;
        }
        (f[11] + f[12]) as f64 / self.tick
    }
}

fn sample(proc: &Proc, stats: &Stats) {
    let rss = proc.status("VmRSS:");
    let fds = proc.fds();
    let phase = stats.current.load(Ordering::Relaxed);
    let mut phases = stats.phases.lock().unwrap();
    let p = &mut phases[phase];
    p.peak_rss_kb = p.peak_rss_kb.max(rss);
    p.peak_fds = p.peak_fds.max(fds);
}

// ---- phases ---------------------------------------------------------------

struct Run {
    stats: Arc<Stats>,
    proc: Option<Arc<Proc>>,
    started: Instant,
}

impl Run {
    fn begin(&self, phase: usize, clients: String) -> Instant {
        if let Some(p) = &self.proc {
            sample(p, &self.stats);
        }
        let cpu = self.proc.as_ref().map(|p| p.cpu()).unwrap_or(0.0);
        let mut phases = self.stats.phases.lock().unwrap();
        phases[phase].cpu_start = cpu;
        phases[phase].clients = clients;
        drop(phases);
        self.stats.current.store(phase, Ordering::Relaxed);
        eprintln!(
            "soak: {:>6.1}s phase {}",
            self.started.elapsed().as_secs_f64(),
            PHASES[phase]
        );
        Instant::now()
    }

    fn end(&self, phase: usize, began: Instant) {
        if let Some(p) = &self.proc {
            sample(p, &self.stats);
        }
        let cpu = self.proc.as_ref().map(|p| p.cpu()).unwrap_or(0.0);
        let mut phases = self.stats.phases.lock().unwrap();
        phases[phase].cpu_end = cpu;
        phases[phase].secs = began.elapsed().as_secs_f64();
    }
}

/// Runs `f` on every slot at once; each task gets its index and connection
/// and hands back what is left of the connection.
async fn each<F, Fut>(slots: Vec<Option<Conn>>, f: F) -> Vec<Option<Conn>>
where
    F: Fn(usize, Option<Conn>) -> Fut,
    Fut: std::future::Future<Output = Option<Conn>> + Send + 'static,
{
    let handles: Vec<_> = slots
        .into_iter()
        .enumerate()
        .map(|(i, c)| tokio::spawn(f(i, c)))
        .collect();
    let mut out = Vec::with_capacity(handles.len());
    for h in handles {
        out.push(h.await.expect("client task panicked"));
    }
    out
}

fn held(slots: &[Option<Conn>]) -> usize {
    slots.iter().filter(|c| c.is_some()).count()
}

#[tokio::main]
async fn main() {
    let args = Arc::new(Args::parse());
    let stats = Arc::new(Stats {
        phases: Mutex::new((0..PHASES.len()).map(|_| PhaseStats::default()).collect()),
        current: AtomicUsize::new(0),
        examples: Mutex::new(Vec::new()),
        messages: Mutex::new(BTreeMap::new()),
    });
    let proc = args.usher_pid.map(|pid| {
        // SAFETY: sysconf has no preconditions.
        let tick = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        Arc::new(Proc { pid, tick })
    });
    let done = Arc::new(AtomicBool::new(false));
    let sampler = proc.clone().map(|p| {
        let (stats, done) = (stats.clone(), done.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                sample(&p, &stats);
                std::thread::sleep(Duration::from_millis(200));
            }
        })
    });
    let run = Run {
        stats: stats.clone(),
        proc: proc.clone(),
        started: Instant::now(),
    };
    let fds_before = proc.as_ref().map(|p| p.fds()).unwrap_or(0);

    // connect
    let t = run.begin(0, format!("{}", args.clients));
    let gate = Arc::new(Semaphore::new(args.connect_concurrency));
    let slots: Vec<Option<Conn>> = (0..args.clients).map(|_| None).collect();
    let slots = each(slots, |_, _| {
        let (args, stats, gate) = (args.clone(), stats.clone(), gate.clone());
        async move {
            let _permit = gate.acquire_owned().await.unwrap();
            login(&args, &stats).await
        }
    })
    .await;
    run.end(0, t);
    let connected = held(&slots);
    eprintln!("soak: {connected} of {} clients connected", args.clients);

    // idle
    let t = run.begin(1, format!("{connected} idle"));
    tokio::time::sleep(Duration::from_secs(args.idle_secs)).await;
    run.end(1, t);

    // active
    let t = run.begin(2, format!("{connected} x {} txns", args.active_txns));
    let slots = each(slots, |i, c| {
        let (args, stats) = (args.clone(), stats.clone());
        async move {
            let mut c = c?;
            for k in 0..args.active_txns {
                c = txn(&args, &stats, c, (i * 10 + k) as i32).await?;
            }
            Some(c)
        }
    })
    .await;
    run.end(2, t);

    // storm
    let storm_logins_before = stats.phases.lock().unwrap()[3].logins;
    let t = run.begin(
        3,
        format!(
            "{} held ({} active) + {} login loops",
            held(&slots),
            args.storm_active.min(held(&slots)),
            args.storm_workers
        ),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let counter = Arc::new(AtomicU64::new(0));
    let workers: Vec<_> = (0..args.storm_workers)
        .map(|w| {
            let (args, stats, stop, counter) =
                (args.clone(), stats.clone(), stop.clone(), counter.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let n = counter.fetch_add(1, Ordering::Relaxed) as i32;
                    match login(&args, &stats).await {
                        Some(c) => match txn(&args, &stats, c, n).await {
                            Some(c) => c.terminate().await,
                            None => tokio::time::sleep(Duration::from_millis(50 + w as u64)).await,
                        },
                        // Refused: a short pause, not a busy loop.
                        None => tokio::time::sleep(Duration::from_millis(50 + w as u64)).await,
                    }
                }
            })
        })
        .collect();
    let events = {
        let args = args.clone();
        let started = run.started;
        tokio::spawn(async move {
            let storm = Duration::from_secs(args.storm_secs);
            let t0 = Instant::now();
            let mut log = Vec::new();
            for i in 0..args.events {
                let at = storm * (i as u32 + 1) / (args.events as u32 + 1);
                tokio::time::sleep_until((t0 + at).into()).await;
                let (name, cmd) = if i % 2 == 0 {
                    ("restart", args.restart_cmd.as_deref())
                } else {
                    ("reload", args.reload_cmd.as_deref())
                };
                let Some(cmd) = cmd else { continue };
                let s = Instant::now();
                let status = tokio::process::Command::new("sh")
                    .arg("-c")
                    .arg(cmd)
                    .status()
                    .await;
                let ok = matches!(&status, Ok(s) if s.success());
                let line = format!(
                    "{name} at {:.1}s (storm +{:.1}s): {}, took {:.1}s",
                    started.elapsed().as_secs_f64(),
                    at.as_secs_f64(),
                    match status {
                        Ok(s) if s.success() => "ok".to_string(),
                        Ok(s) => format!("FAILED ({s})"),
                        Err(e) => format!("FAILED ({e})"),
                    },
                    s.elapsed().as_secs_f64()
                );
                eprintln!("soak: {line}");
                log.push((ok, line));
            }
            log
        })
    };
    let deadline_at = Instant::now() + Duration::from_secs(args.storm_secs);
    let slots = each(slots, |i, c| {
        let (args, stats, stop) = (args.clone(), stats.clone(), stop.clone());
        async move {
            if i >= args.storm_active {
                return c;
            }
            let mut c = c;
            let mut k = 0;
            while !stop.load(Ordering::Relaxed) && Instant::now() < deadline_at {
                c = match c {
                    Some(conn) => {
                        k += 1;
                        let c = txn(&args, &stats, conn, (i * 1000 + k % 1000) as i32).await;
                        if c.is_none() {
                            // Closed with an error: log in again shortly.
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                        c
                    }
                    None => {
                        let c = login(&args, &stats).await;
                        if c.is_none() {
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                        c
                    }
                };
            }
            c
        }
    });
    let slots = {
        let stop = stop.clone();
        let timer = tokio::spawn(async move {
            tokio::time::sleep_until(deadline_at.into()).await;
            stop.store(true, Ordering::Relaxed);
        });
        let slots = slots.await;
        timer.await.unwrap();
        slots
    };
    for w in workers {
        w.await.unwrap();
    }
    let event_log = events.await.unwrap();
    run.end(3, t);
    let storm_logins = stats.phases.lock().unwrap()[3].logins - storm_logins_before;

    // check: every held client runs one more transaction; the ones closed
    // with an error during the storm log in again first.
    let t = run.begin(4, format!("{}", slots.len()));
    let slots = each(slots, |i, c| {
        let (args, stats, gate) = (args.clone(), stats.clone(), gate.clone());
        async move {
            let c = match c {
                Some(c) => c,
                None => {
                    let _permit = gate.acquire_owned().await.unwrap();
                    login(&args, &stats).await?
                }
            };
            txn(&args, &stats, c, i as i32).await
        }
    })
    .await;
    run.end(4, t);

    // close
    let t = run.begin(5, format!("{} leave", held(&slots)));
    each(slots, |_, c| async move {
        if let Some(c) = c {
            c.terminate().await;
        }
        None
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    run.end(5, t);
    let fds_after = proc.as_ref().map(|p| p.fds()).unwrap_or(0);
    let hwm = proc.as_ref().map(|p| p.status("VmHWM:")).unwrap_or(0);
    let rss_after = proc.as_ref().map(|p| p.status("VmRSS:")).unwrap_or(0);
    done.store(true, Ordering::Relaxed);
    if let Some(s) = sampler {
        s.join().unwrap();
    }

    // report
    let phases = stats.phases.lock().unwrap();
    println!(
        "| phase | clients | secs | logins | ok | errors by SQLSTATE (! = FATAL) | lost | hung | wrong | peak RSS MB | peak fds | usher CPU s |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut bad = 0;
    for (i, p) in phases.iter().enumerate() {
        let errors = if p.errors.is_empty() {
            "-".to_string()
        } else {
            p.errors
                .iter()
                .map(|(k, v)| format!("{k} x{v}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        bad += p.lost + p.hung + p.wrong;
        println!(
            "| {} | {} | {:.1} | {} | {} | {} | {} | {} | {} | {:.0} | {} | {:.1} |",
            PHASES[i],
            p.clients,
            p.secs,
            p.logins,
            p.ok,
            errors,
            p.lost,
            p.hung,
            p.wrong,
            p.peak_rss_kb as f64 / 1024.0,
            p.peak_fds,
            p.cpu_end - p.cpu_start
        );
    }
    println!();
    println!("storm: {storm_logins} logins in {}s", args.storm_secs);
    for (_, e) in &event_log {
        println!("event: {e}");
    }
    let failed_events = event_log.iter().filter(|(ok, _)| !ok).count();
    if proc.is_some() {
        println!(
            "usher: VmHWM {:.0} MB; descriptors {fds_before} before the clients, {fds_after} after they left; RSS after {:.0} MB; CPU {:.1} s in all",
            hwm as f64 / 1024.0,
            rss_after as f64 / 1024.0,
            phases[5].cpu_end - phases[0].cpu_start
        );
    }
    for ((code, message), n) in stats.messages.lock().unwrap().iter() {
        println!("error {code} x{n}: {message}");
    }
    let examples = stats.examples.lock().unwrap();
    for e in examples.iter() {
        println!("example: {e}");
    }
    if bad > 0 {
        println!("FAIL: {bad} clients lost, hung or answered wrongly");
    }
    if failed_events > 0 {
        println!("INVALID: {failed_events} restart/reload commands failed (see above)");
    }
    if bad > 0 || failed_events > 0 {
        std::process::exit(1);
    }
}
