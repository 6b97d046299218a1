//! Server connections: connect and log in to PostgreSQL, run usher's own
//! statements (reset, parameter sync), forward cancel requests.
//!
//! A [`ServerConn`] knows nothing of clients; the frontend forwards bytes
//! over its stream and tells it what it saw (ParameterStatus, ReadyForQuery).
//!
//! - [`server_stream`]: TCP or TLS to the server (`databases.<name>.tls`).
//! - [`credential`]: what usher logs in with (password, md5, SCRAM keys).
//! - [`hosts`]: which of a database's hosts to try, in what order, and
//!   the back-off of those that failed.
//! - [`error`]: [`ConnectError`] (connect and login), [`QueryError`]
//!   (usher's own statements); no client-facing text.
//! - [`server_params`]: the connection's record of its parameters and the
//!   one call that brings it in line with what a session wants.

mod connect;
pub(crate) mod credential;
pub mod error;
mod held_state;
pub mod hosts;
pub mod server_params;
pub(crate) mod server_stream;
mod session_settings;

pub use connect::{connect, ServerTarget};
pub use credential::{ServerCredential, SharedCredential};
pub use error::{ConnectError, QueryError, ServerError, TlsStep, WireError};
pub use held_state::HeldState;
pub use hosts::{HostHealth, ServerHosts};
pub use server_params::{ParamsFingerprint, Restore, ServerParams, Setting, Wanted};
pub use server_stream::ServerStream;

use crate::protocol::tags::field;
use bytes::BytesMut;
use fallible_iterator::FallibleIterator;
use postgres_protocol::message::backend::{ErrorFields, Message};
use postgres_protocol::message::frontend;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

static NEXT_SERVER_ID: AtomicU64 = AtomicU64::new(1);

/// What a server connection holds of usher's statements (transaction
/// mode, see frontend::prepared): the ids of usher's named statements,
/// least recently used first (the set derefs to them), and which client's
/// unnamed statement it holds, if usher knows.
#[derive(Debug)]
pub struct PreparedSet {
    named: lru::LruCache<u64, ()>,
    /// The token of the client unnamed statement the server's unnamed
    /// statement is (`frontend::prepared::Unnamed`); `None` when nobody's
    /// or unknown. usher's own Query traffic forgets it.
    unnamed: Option<u64>,
}

impl PreparedSet {
    pub fn unbounded() -> Self {
        PreparedSet {
            named: lru::LruCache::unbounded(),
            unnamed: None,
        }
    }

    /// The client unnamed statement the server holds as its unnamed one.
    pub fn unnamed(&self) -> Option<u64> {
        self.unnamed
    }

    pub fn set_unnamed(&mut self, token: Option<u64>) {
        self.unnamed = token;
    }
}

impl std::ops::Deref for PreparedSet {
    type Target = lru::LruCache<u64, ()>;
    fn deref(&self) -> &Self::Target {
        &self.named
    }
}

impl std::ops::DerefMut for PreparedSet {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.named
    }
}

/// Where to send a cancel request for whatever a server connection runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CancelTarget {
    pub host: String,
    pub port: u16,
    pub pid: u32,
    pub secret: u32,
}

impl CancelTarget {
    /// Opens a new connection to the server and sends the cancel request.
    pub async fn send(&self) -> std::io::Result<()> {
        let mut buf = BytesMut::new();
        frontend::cancel_request(self.pid as i32, self.secret as i32, &mut buf);
        if crate::config::is_socket_dir(&self.host) {
            let path = server_stream::socket_path(&self.host, self.port);
            send_and_wait(tokio::net::UnixStream::connect(path).await?, &buf).await
        } else {
            send_and_wait(
                TcpStream::connect((self.host.as_str(), self.port)).await?,
                &buf,
            )
            .await
        }
    }
}

/// Writes a cancel request and waits briefly for the server to close the
/// connection, which it does when done.
async fn send_and_wait<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    request: &[u8],
) -> std::io::Result<()> {
    stream.write_all(request).await?;
    let mut sink = [0u8; 16];
    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), stream.read(&mut sink)).await;
    Ok(())
}

/// What other tasks may know of a server connection while a client holds
/// it: where to send a cancel request, and what SHOW SERVERS lists. Shared
/// (an `Arc`), so lending the connection copies nothing.
#[derive(Debug)]
pub struct ServerSummary {
    pub id: u64,
    pub cancel: CancelTarget,
    pub connect_time: SystemTime,
    /// usher's end of the connection.
    pub local: Option<SocketAddr>,
    pub tls: bool,
}

/// One logged-in connection to PostgreSQL.
///
/// Its records (the parameters the server reported, usher's statements it
/// holds, the sessions it served, when it was made and last used) change
/// only through the methods below, so the rules of a server connection
/// live here and nowhere else.
#[derive(Debug)]
pub struct ServerConn {
    stream: ServerStream,
    /// usher's own id for this connection (for logs and the console).
    id: u64,
    summary: Arc<ServerSummary>,
    /// The pool generation it was opened in: RECONNECT and a changed
    /// server address start a new one, and older connections are closed
    /// instead of reused.
    generation: u64,
    /// Its parameters: as at login, as now, and what they are in line with.
    params: ServerParams,
    created: Instant,
    last_used: Instant,
    /// Ids of usher's named statements prepared here, least recently used
    /// first (see frontend::prepared). Trimmed to the configured bound when
    /// the connection is next checked out.
    prepared: PreparedSet,
    /// Client sessions this connection has served (session mode), so a
    /// session_start hook can tell a fresh connection from a reused one.
    sessions_served: u64,
    /// The shard whose reactor watches its socket ([`crate::shards`]).
    shard: usize,
    /// What the pool keeps for as long as the connection lives (its place
    /// under `max_db_connections` / `max_user_connections`), given back
    /// when it is dropped, however it is closed.
    keep: Option<Box<dyn std::any::Any + Send + Sync>>,
}

impl ServerConn {
    pub(crate) fn new(
        stream: ServerStream,
        cancel: CancelTarget,
        params: HashMap<String, String>,
    ) -> Self {
        let now = Instant::now();
        let id = NEXT_SERVER_ID.fetch_add(1, Ordering::Relaxed);
        let summary = Arc::new(ServerSummary {
            id,
            cancel,
            connect_time: SystemTime::now(),
            local: stream.local_addr(),
            tls: stream.is_tls(),
        });
        ServerConn {
            stream,
            id,
            summary,
            generation: 0,
            params: ServerParams::new(params),
            created: now,
            last_used: now,
            prepared: PreparedSet::unbounded(),
            sessions_served: 0,
            shard: crate::shards::current(),
            keep: None,
        }
    }

    /// Moves the socket to the calling shard's reactor if another's
    /// watches it: a client served here is then woken by its own thread.
    /// Whether it moved. If it cannot (out of descriptors), it stays where
    /// it is, which works, only with wake-ups across threads.
    pub fn bring_to_this_shard(&mut self) -> bool {
        let here = crate::shards::current();
        if self.shard == here || here == crate::shards::NONE {
            return false;
        }
        match self.stream.rehome() {
            Ok(()) => {
                self.shard = here;
                true
            }
            Err(e) => {
                tracing::debug!(server = self.id, error = %e, "server connection not moved to this worker");
                false
            }
        }
    }

    /// [`ServerConn::looks_alive`] asked of the socket itself, for one
    /// just moved here (its new registration knows no readiness yet).
    pub fn peek_alive(&self) -> bool {
        self.stream.peek_alive()
    }

    /// Keeps `value` until this connection is dropped.
    pub fn keep_until_closed(&mut self, value: impl std::any::Any + Send + Sync) {
        self.keep = Some(Box::new(value));
    }

    /// usher's id for this connection.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// What other tasks may know of it (cancel target, SHOW SERVERS).
    pub fn summary(&self) -> &Arc<ServerSummary> {
        &self.summary
    }

    /// The socket, for forwarding.
    pub fn stream_mut(&mut self) -> &mut ServerStream {
        &mut self.stream
    }

    pub fn generation(&self) -> u64 {
        self.generation
    }

    pub fn set_generation(&mut self, generation: u64) {
        self.generation = generation;
    }

    pub fn created(&self) -> Instant {
        self.created
    }

    pub fn last_used(&self) -> Instant {
        self.last_used
    }

    /// It was used at `now` (checked in then).
    pub fn touch(&mut self, now: Instant) {
        self.last_used = now;
    }

    /// usher's statements prepared here.
    pub fn prepared(&self) -> &PreparedSet {
        &self.prepared
    }

    pub fn prepared_mut(&mut self) -> &mut PreparedSet {
        &mut self.prepared
    }

    /// Forgets the least recently used statements beyond `bound`,
    /// returning their ids (to DEALLOCATE on the server).
    pub fn trim_prepared(&mut self, bound: usize) -> Vec<u64> {
        let mut evicted = Vec::new();
        while self.prepared.len() > bound {
            match self.prepared.pop_lru() {
                Some((id, ())) => evicted.push(id),
                None => break,
            }
        }
        evicted
    }

    /// A client session begins on it; true if it served one before.
    pub fn start_session(&mut self) -> bool {
        self.sessions_served += 1;
        self.sessions_served > 1
    }

    pub fn sessions_served(&self) -> u64 {
        self.sessions_served
    }

    /// The server's backend process id.
    pub fn backend_pid(&self) -> u32 {
        self.summary.cancel.pid
    }

    /// True if the server has not closed the connection or sent anything
    /// unasked while it sat idle (e.g. a FATAL on termination). Never blocks.
    pub fn looks_alive(&self) -> bool {
        self.stream.looks_alive()
    }

    /// Runs `sql` with the simple protocol and waits for ReadyForQuery.
    /// ParameterStatus messages update [`ServerConn::params`]. A server error
    /// is returned after the server is ready again.
    pub async fn simple_query(&mut self, sql: &str) -> Result<(), QueryError> {
        let mut out = BytesMut::new();
        frontend::query(sql, &mut out).map_err(|e| QueryError::Encode(e.to_string()))?;
        self.exchange(&out, 1, |_| {}).await
    }

    /// Applies session settings, then runs `then_sql` (usher's own
    /// statements, or nothing), in one round trip
    /// ([`ServerConn::bring_in_line`] decides which).
    ///
    /// Settings go through `set_config()` with the names and values bound
    /// as parameters, so no value is ever read as SQL, whatever this
    /// connection's `standard_conforming_strings` or encoding, and a value
    /// means what it means in a startup packet (`a,b` is a list for
    /// `search_path`). A `None` value restores the connection's base
    /// (RESET); calls run in order. The notices the server raises (e.g.
    /// 42622, a name truncated) are appended to `notices` as
    /// NoticeResponse messages, if given. The first server error is
    /// returned once the server is ready again.
    async fn apply(
        &mut self,
        settings: &[Setting],
        then_sql: &str,
        mut notices: Option<&mut BytesMut>,
    ) -> Result<(), QueryError> {
        let internal = |e: &dyn std::fmt::Display| QueryError::Encode(e.to_string());
        let mut out = BytesMut::new();
        let mut replies = 0;
        if !settings.is_empty() {
            let calls: Vec<String> = (0..settings.len())
                .map(|i| {
                    format!(
                        "pg_catalog.set_config(${}, ${}, false)",
                        2 * i + 1,
                        2 * i + 2
                    )
                })
                .collect();
            let sql = format!("SELECT {}", calls.join(", "));
            close_own_statement(&mut out).map_err(|e| internal(&e))?;
            frontend::parse(OWN_STATEMENT, &sql, std::iter::empty(), &mut out)
                .map_err(|e| internal(&e))?;
            let values = settings
                .iter()
                .flat_map(|s| [Some(s.name.as_str()), s.value.as_deref()]);
            frontend::bind(
                OWN_STATEMENT,
                OWN_STATEMENT,
                [0i16], // every parameter in text
                values,
                |v, buf| match v {
                    Some(v) => {
                        buf.extend_from_slice(v.as_bytes());
                        Ok(postgres_protocol::IsNull::No)
                    }
                    None => Ok(postgres_protocol::IsNull::Yes),
                },
                [0i16],
                &mut out,
            )
            .map_err(|e| match e {
                frontend::BindError::Conversion(e) => internal(&e),
                frontend::BindError::Serialization(e) => internal(&e),
            })?;
            frontend::execute(OWN_STATEMENT, 0, &mut out).map_err(|e| internal(&e))?;
            close_own_statement(&mut out).map_err(|e| internal(&e))?;
            frontend::sync(&mut out);
            replies += 1;
        }
        if !then_sql.is_empty() {
            frontend::query(then_sql, &mut out).map_err(|e| internal(&e))?;
            replies += 1;
        }
        if replies == 0 {
            return Ok(());
        }
        self.exchange(&out, replies, |m| {
            if let (Message::NoticeResponse(body), Some(out)) = (m, notices.as_deref_mut()) {
                encode_notice(body.fields(), out);
            }
        })
        .await
    }

    /// The one reply loop of usher's own statements: writes `request`, then
    /// reads the answers to `replies` requests (each ends at a
    /// ReadyForQuery). ParameterStatus messages update the parameters'
    /// record; the first ErrorResponse is returned once the server is
    /// ready again; every other message (rows, notices, notifications) is
    /// handed to `visit`.
    pub(crate) async fn exchange(
        &mut self,
        request: &[u8],
        mut replies: usize,
        mut visit: impl FnMut(Message),
    ) -> Result<(), QueryError> {
        if contains_query(request) {
            // A simple Query drops the server's unnamed statement.
            self.prepared.set_unnamed(None);
        }
        self.stream
            .write_all(request)
            .await
            .map_err(WireError::Lost)?;
        let mut buf = BytesMut::with_capacity(1024);
        let mut failure = None;
        while replies > 0 {
            match read_backend_message(&mut self.stream, &mut buf).await? {
                Message::ReadyForQuery(_) => replies -= 1,
                Message::ErrorResponse(body) => {
                    failure.get_or_insert_with(|| server_error(body.fields()));
                }
                Message::ParameterStatus(body) => {
                    if let (Ok(name), Ok(value)) = (body.name(), body.value()) {
                        self.params.reported(name, value);
                    }
                }
                other => visit(other),
            }
        }
        self.last_used = Instant::now();
        failure.map_or(Ok(()), |e| Err(QueryError::Server(e)))
    }
}

/// Whether `request` (whole frontend messages) holds a simple Query.
fn contains_query(request: &[u8]) -> bool {
    let mut at = 0;
    while let Some(head) = request.get(at..at + 5) {
        if head[0] == crate::protocol::tags::frontend::QUERY {
            return true;
        }
        at += 1 + u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
    }
    false
}

/// The name of the statement and portal usher's own statements use on a
/// connection that serves a client: named, so the client's unnamed
/// statement and portal are never touched (a simple Query, or an unnamed
/// Parse, would drop the client's unnamed statement), and closed before
/// and after use, so nothing of usher's is left for the client to meet.
pub(crate) const OWN_STATEMENT: &str = "usher_own";

/// Closes usher's own portal and statement (harmless if absent: a Close
/// never fails, even after an error left them behind).
pub(crate) fn close_own_statement(out: &mut BytesMut) -> std::io::Result<()> {
    frontend::close(b'P', OWN_STATEMENT, out)?;
    frontend::close(b'S', OWN_STATEMENT, out)
}

/// `sql` (one statement, no parameters) as usher's own extended-protocol
/// statement: Parse, Bind, Execute and the Closes, without a Sync.
pub(crate) fn own_statement(sql: &str, out: &mut BytesMut) -> std::io::Result<()> {
    close_own_statement(out)?;
    frontend::parse(OWN_STATEMENT, sql, std::iter::empty(), out)?;
    frontend::bind(
        OWN_STATEMENT,
        OWN_STATEMENT,
        std::iter::empty::<i16>(),
        std::iter::empty::<()>(),
        |_, _| Ok(postgres_protocol::IsNull::No),
        [0i16],
        out,
    )
    .map_err(|e| match e {
        frontend::BindError::Conversion(e) => std::io::Error::other(e.to_string()),
        frontend::BindError::Serialization(e) => e,
    })?;
    frontend::execute(OWN_STATEMENT, 0, out)?;
    close_own_statement(out)
}

/// Reads one backend message into `buf` and parses it.
pub(crate) async fn read_backend_message(
    stream: &mut ServerStream,
    buf: &mut BytesMut,
) -> Result<Message, WireError> {
    loop {
        if let Some(m) = Message::parse(buf).map_err(|e| WireError::Malformed(e.to_string()))? {
            return Ok(m);
        }
        let n = stream.read_buf(buf).await.map_err(WireError::Lost)?;
        if n == 0 {
            return Err(WireError::Closed);
        }
    }
}

/// Writes a server's NoticeResponse again, every field as it came.
fn encode_notice(mut fields: ErrorFields<'_>, out: &mut BytesMut) {
    use bytes::BufMut;
    let start = out.len();
    out.put_u8(crate::protocol::tags::backend::NOTICE_RESPONSE);
    out.put_u32(0);
    while let Ok(Some(f)) = fields.next() {
        out.put_u8(f.type_());
        out.put_slice(f.value_bytes());
        out.put_u8(0);
    }
    out.put_u8(0);
    let len = (out.len() - start - 1) as u32;
    out[start + 1..start + 5].copy_from_slice(&len.to_be_bytes());
}

/// A server ErrorResponse's fields, as data.
pub(crate) fn server_error(mut fields: ErrorFields<'_>) -> ServerError {
    let mut e = ServerError {
        fatal: false,
        code: crate::protocol::error::sqlstate::INTERNAL_ERROR.to_string(),
        message: "server error".to_string(),
        detail: None,
        hint: None,
    };
    while let Ok(Some(f)) = fields.next() {
        let value = String::from_utf8_lossy(f.value_bytes()).into_owned();
        match f.type_() {
            field::SEVERITY if value == "FATAL" || value == "PANIC" => e.fatal = true,
            field::CODE => e.code = value,
            field::MESSAGE => e.message = value,
            field::DETAIL => e.detail = Some(value),
            field::HINT => e.hint = Some(value),
            _ => {}
        }
    }
    e
}
