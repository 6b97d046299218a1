//! What can go wrong talking to a server, as the backend sees it. No text
//! here is meant for a client: the frontend turns these into `PgError`s
//! (frontend/mod.rs) and the auth query into its own answer. Each error
//! names the SQLSTATE class it belongs to (`sqlstate()`), so the edge
//! does not have to guess.

use crate::config::TargetSessionAttrs;
use crate::protocol::error::{shown_name, sqlstate};
use std::fmt;
use std::io;
use std::time::Duration;

/// A server's ErrorResponse: its fields, as the server sent them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerError {
    /// FATAL or PANIC: the server ends the connection.
    pub fatal: bool,
    pub code: String,
    pub message: String,
    pub detail: Option<String>,
    pub hint: Option<String>,
}

impl fmt::Display for ServerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (SQLSTATE {})", self.message, self.code)
    }
}

/// The connection to a server broke under a read or a write.
#[derive(Debug)]
pub enum WireError {
    /// Reading or writing the socket failed.
    Lost(io::Error),
    /// The server closed the connection.
    Closed,
    /// The server sent something that is not a backend message.
    Malformed(String),
}

impl WireError {
    pub fn sqlstate(&self) -> &'static str {
        match self {
            WireError::Lost(_) | WireError::Closed => sqlstate::CONNECTION_FAILURE,
            WireError::Malformed(_) => sqlstate::PROTOCOL_VIOLATION,
        }
    }
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WireError::Lost(e) => write!(f, "server connection failed: {e}"),
            WireError::Closed => f.write_str("server closed the connection unexpectedly"),
            WireError::Malformed(e) => write!(f, "bad message from server: {e}"),
        }
    }
}

impl std::error::Error for WireError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            WireError::Lost(e) => Some(e),
            _ => None,
        }
    }
}

/// The step of setting up TLS with a server that failed.
#[derive(Debug)]
pub enum TlsStep {
    /// Writing the SSLRequest failed.
    Request(io::Error),
    /// Reading the server's one-byte answer failed.
    Answer(io::Error),
    /// The server answered `N` and the database's `tls` requires TLS.
    Refused { mode: String },
    /// The answer was neither `S` nor `N`.
    BadAnswer,
    /// The TLS handshake failed (certificate, name, protocol).
    Handshake(io::Error),
}

/// Why opening and logging in to a server connection failed.
#[derive(Debug)]
pub enum ConnectError {
    /// The whole connect and login took longer than `server_connect_timeout`.
    Timeout {
        host: String,
        port: u16,
        after: Duration,
    },
    /// No connection to the server (TCP, or its Unix-domain socket).
    Unreachable {
        host: String,
        port: u16,
        source: io::Error,
    },
    /// TLS with the server could not be set up.
    Tls {
        host: String,
        port: u16,
        step: TlsStep,
    },
    /// The connection broke during the login.
    Wire(WireError),
    /// The server refused the login with an ErrorResponse.
    Refused(ServerError),
    /// The server asked for a kind of secret usher does not have for the user.
    NoSecret {
        user: String,
        /// What the server asked for ("an md5 password"...).
        asked: &'static str,
        /// What usher has ("no password for this user"...).
        has: &'static str,
        /// What the operator can do about it.
        hint: &'static str,
    },
    /// The server offers no SASL mechanism usher supports.
    NoSaslMechanism,
    /// SCRAM pass-through (from a client's keys) failed.
    ScramPassThrough { user: String, why: String },
    /// The server broke the login protocol (unexpected message, bad SCRAM).
    Protocol(String),
    /// A login message could not be encoded (a NUL in a name...).
    Encode(io::Error),
    /// Of several hosts (or one with a target) none could be used: each
    /// one's `host:port: why`, in the order tried, then those skipped
    /// (in back-off).
    NoHost {
        target: TargetSessionAttrs,
        /// Some host was reached but did not fit the target.
        unfit: bool,
        tried: Vec<String>,
    },
}

impl ConnectError {
    /// The SQLSTATE a client is given for this failure.
    pub fn sqlstate(&self) -> &str {
        match self {
            ConnectError::Timeout { .. } | ConnectError::Unreachable { .. } => {
                sqlstate::CONNECTION_FAILURE
            }
            ConnectError::Tls {
                step: TlsStep::BadAnswer,
                ..
            } => sqlstate::PROTOCOL_VIOLATION,
            ConnectError::Tls { .. } => sqlstate::CONNECTION_FAILURE,
            ConnectError::Wire(e) => e.sqlstate(),
            ConnectError::Refused(e) => &e.code,
            ConnectError::NoSecret { .. } => sqlstate::INVALID_AUTHORIZATION,
            ConnectError::ScramPassThrough { .. } => sqlstate::INVALID_PASSWORD,
            ConnectError::NoSaslMechanism => sqlstate::FEATURE_NOT_SUPPORTED,
            ConnectError::Protocol(_) => sqlstate::PROTOCOL_VIOLATION,
            ConnectError::Encode(_) => sqlstate::INTERNAL_ERROR,
            ConnectError::NoHost { .. } => sqlstate::UNABLE_TO_CONNECT,
        }
    }

    /// Whether another server of the same database would answer the same:
    /// a refused login (authentication, a database that does not exist),
    /// a secret usher lacks. Such an error ends the search for a host.
    pub fn is_final(&self) -> bool {
        match self {
            ConnectError::Refused(e) => {
                e.code.starts_with("28") || e.code == sqlstate::INVALID_CATALOG_NAME
            }
            ConnectError::NoSecret { .. }
            | ConnectError::ScramPassThrough { .. }
            | ConnectError::Encode(_) => true,
            _ => false,
        }
    }
}

impl ConnectError {
    /// Whether trying again later may succeed: the server could not be
    /// reached or was not taking connections (starting up, shutting down,
    /// out of connection slots), the connection broke during the login,
    /// or no host fit the target (a promotion may come). A refusal, a TLS
    /// or protocol problem, a secret usher lacks: no.
    pub fn is_transient(&self) -> bool {
        match self {
            ConnectError::Timeout { .. }
            | ConnectError::Unreachable { .. }
            | ConnectError::NoHost { .. }
            | ConnectError::Wire(WireError::Lost(_) | WireError::Closed) => true,
            ConnectError::Tls {
                step: TlsStep::Request(e) | TlsStep::Answer(e) | TlsStep::Handshake(e),
                ..
            } => io_transient(e),
            // 57P01-03: shutting down, crashed, starting up or shutting
            // down; 53xxx: too many connections, out of resources; 08xxx:
            // the server's own account of a broken connection.
            ConnectError::Refused(e) => ["57P", "53", "08"].iter().any(|p| e.code.starts_with(p)),
            _ => false,
        }
    }

    /// No host fit the target, but some answered: a promotion (or a
    /// demotion) is awaited.
    pub fn awaits_promotion(&self) -> bool {
        matches!(self, ConnectError::NoHost { unfit: true, .. })
    }
}

/// An I/O error of a connection that the other side ended (a server going
/// down), rather than one about what was said (a certificate).
fn io_transient(e: &io::Error) -> bool {
    use io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionReset
            | ConnectionAborted
            | ConnectionRefused
            | UnexpectedEof
            | BrokenPipe
            | TimedOut
    )
}

impl fmt::Display for ConnectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConnectError::Timeout { host, port, after } => write!(
                f,
                "could not connect to server {host}:{port} within {:.1}s",
                after.as_secs_f64()
            ),
            ConnectError::Unreachable { host, port, source }
                if crate::config::is_socket_dir(host) =>
            {
                let path = super::server_stream::socket_path(host, *port);
                write!(
                    f,
                    "could not connect to server on socket \"{}\": {source}",
                    path.display()
                )
            }
            ConnectError::Unreachable { host, port, source } => {
                write!(f, "could not connect to server {host}:{port}: {source}")
            }
            ConnectError::Tls { host, port, step } => match step {
                TlsStep::Request(e) => {
                    write!(f, "could not send SSL negotiation to {host}:{port}: {e}")
                }
                TlsStep::Answer(e) => {
                    write!(f, "no answer to SSL negotiation from {host}:{port}: {e}")
                }
                TlsStep::Refused { mode } => write!(
                    f,
                    "server {host}:{port} does not support SSL, but tls is {mode}"
                ),
                TlsStep::BadAnswer => write!(
                    f,
                    "server {host}:{port} sent an invalid answer to SSL negotiation"
                ),
                TlsStep::Handshake(e) => write!(f, "TLS with server {host}:{port} failed: {e}"),
            },
            ConnectError::Wire(e) => e.fmt(f),
            ConnectError::Refused(e) => f.write_str(&e.message),
            ConnectError::NoSecret { user, asked, .. } => write!(
                f,
                "the server asked for {asked} for user \"{}\", which usher does not have",
                shown_name(user)
            ),
            ConnectError::NoSaslMechanism => {
                f.write_str("server offers no SASL mechanism usher supports")
            }
            ConnectError::ScramPassThrough { user, why } => {
                write!(
                    f,
                    "SCRAM pass-through for user \"{}\" failed: {why}",
                    shown_name(user)
                )
            }
            ConnectError::Protocol(what) => write!(f, "server login: {what}"),
            ConnectError::Encode(e) => e.fmt(f),
            // The hosts tried and why go into the client's DETAIL.
            ConnectError::NoHost { target, unfit, .. } => match (target, unfit) {
                (TargetSessionAttrs::Any, _) | (_, false) => {
                    f.write_str("could not connect to any host")
                }
                (t, true) => write!(f, "no host fits target_session_attrs={t}"),
            },
        }
    }
}

impl std::error::Error for ConnectError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ConnectError::Unreachable { source, .. } => Some(source),
            ConnectError::Tls {
                step: TlsStep::Request(e) | TlsStep::Answer(e) | TlsStep::Handshake(e),
                ..
            } => Some(e),
            ConnectError::Wire(e) => Some(e),
            ConnectError::Encode(e) => Some(e),
            _ => None,
        }
    }
}

impl From<WireError> for ConnectError {
    fn from(e: WireError) -> Self {
        ConnectError::Wire(e)
    }
}

/// Why a statement usher ran on a server connection (a reset, a parameter
/// sync, a check) failed.
#[derive(Debug)]
pub enum QueryError {
    /// The server answered with an error; the connection is ready again.
    Server(ServerError),
    /// The connection broke.
    Wire(WireError),
    /// The statement could not be encoded (a NUL in it...).
    Encode(String),
}

impl QueryError {
    /// The SQLSTATE of the failure: the server's own, or usher's.
    pub fn sqlstate(&self) -> &str {
        match self {
            QueryError::Server(e) => &e.code,
            QueryError::Wire(e) => e.sqlstate(),
            QueryError::Encode(_) => sqlstate::INTERNAL_ERROR,
        }
    }
}

impl fmt::Display for QueryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            QueryError::Server(e) => f.write_str(&e.message),
            QueryError::Wire(e) => e.fmt(f),
            QueryError::Encode(e) => f.write_str(e),
        }
    }
}

impl std::error::Error for QueryError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            QueryError::Wire(e) => Some(e),
            _ => None,
        }
    }
}

impl From<WireError> for QueryError {
    fn from(e: WireError) -> Self {
        QueryError::Wire(e)
    }
}
