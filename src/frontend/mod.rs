//! One task per client: startup → authentication → session → serve loop.
//!
//! - [`login`]: the startup phase up to ReadyForQuery.
//! - [`session`]: the serve loop that borrows server connections from the
//!   pool and forwards bytes both ways.
//! - [`params`]: the session's parameters, carried to every server connection.
//! - [`client_registry`]: connected clients by BackendKeyData, for cancel
//!   requests.
//! - [`peers`]: cancel requests whose key another usher gave: forwarded once.
//! - [`login_slots`]: login slots, in all and per address.
//! - [`client_stream`]: the client's connection, plain or TLS.
//! - [`flow`]: the forwarding decisions, without I/O (unit-tested).
//! - [`prepared`]: named prepared statements carried in transaction mode;
//!   [`unnamed`]: the client's unnamed statement, kept as PostgreSQL keeps it.
//! - [`budget`]: the memory all clients' read buffers may hold together.
//! - [`spare_box`]: boxes for a transaction's futures, their blocks kept per thread.
//! - [`spare_buffers`]: forwarding buffers kept per thread between transactions.
//! - [`abandon`]: a server connection its client left busy: cancelled,
//!   drained and reused, or closed once its backend is gone.
//! - [`lost_block`]: a transaction whose server died: the client stays,
//!   and is answered as in an aborted block until it ends it.

mod abandon;
pub(crate) mod budget;
pub(crate) mod client_registry;
pub(crate) mod client_stream;
pub mod deps;
pub(crate) mod flow;
pub(crate) mod login;
pub(crate) mod login_slots;
pub(crate) mod lost_block;
pub(crate) mod params;
pub mod peers;
pub mod prepared;
pub(crate) mod session;
mod spare_box;
mod spare_buffers;
pub mod sql_scan;
pub(crate) mod unnamed;

use crate::metrics::ErrorSource;
use crate::protocol::{PgError, Severity};
use bytes::BytesMut;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// What a client is told when no server connection could be had for it.
impl From<crate::pool::CheckoutError> for PgError {
    fn from(e: crate::pool::CheckoutError) -> PgError {
        use crate::pool::CheckoutError;
        use crate::protocol::error::sqlstate;
        match e {
            CheckoutError::Closed => PgError::fatal(sqlstate::ADMIN_SHUTDOWN, "pool is closed"),
            CheckoutError::NoneFree {
                database,
                user,
                waited,
                pool_size,
                paused,
            } => {
                use crate::protocol::error::shown_name;
                let (database, user) = (shown_name(&database), shown_name(&user));
                let detail = if paused {
                    format!(
                        "database \"{database}\" is paused (PAUSE or KILL on the admin console)"
                    )
                } else {
                    format!(
                        "pool \"{database}\"/\"{user}\" has pool_size {pool_size} and all connections are in use"
                    )
                };
                PgError::fatal(
                    sqlstate::TOO_MANY_CONNECTIONS,
                    format!(
                        "no server connection became free within query_wait_timeout ({:.1}s)",
                        waited.as_secs_f64()
                    ),
                )
                .with_detail(detail)
            }
            CheckoutError::Capped {
                which,
                name,
                limit,
                waited,
            } => {
                use crate::pool::caps::Capped;
                let (kind, key) = match which {
                    Capped::Database => ("database", "max_db_connections"),
                    Capped::User => ("user", "max_user_connections"),
                };
                PgError::fatal(
                    sqlstate::TOO_MANY_CONNECTIONS,
                    format!(
                        "no server connection became free within query_wait_timeout ({:.1}s)",
                        waited.as_secs_f64()
                    ),
                )
                .with_detail(format!(
                    "{kind} \"{}\" has {key} {limit} and all of its server connections are in use",
                    crate::protocol::error::shown_name(&name)
                ))
            }
            CheckoutError::Connect(e) => connect_error(&e),
            CheckoutError::ServerDown { error, waited } => {
                let mut e = connect_error(&error);
                let waited = format!(
                    "usher could not open a server connection for {:.1}s (query_wait_timeout)",
                    waited.as_secs_f64()
                );
                e.detail = Some(match e.detail.take() {
                    Some(detail) => format!("{detail}; {waited}"),
                    None => waited,
                });
                e
            }
        }
    }
}

/// What a client is told when usher could not log in to the server: the
/// server's own refusal (its fields, as FATAL), or usher's account of it.
impl From<crate::backend::ConnectError> for PgError {
    fn from(e: crate::backend::ConnectError) -> PgError {
        connect_error(&e)
    }
}

/// See `From<ConnectError> for PgError` (an error may be shared by the
/// clients that waited for the attempt that met it).
fn connect_error(e: &crate::backend::ConnectError) -> PgError {
    use crate::backend::ConnectError;
    match e {
        ConnectError::Refused(e) => PgError {
            severity: Severity::Fatal,
            code: e.code.clone(),
            message: e.message.clone(),
            detail: e.detail.clone(),
            hint: e.hint.clone(),
        },
        ConnectError::NoSecret { has, hint, .. } => PgError::fatal(e.sqlstate(), e.to_string())
            .with_detail(format!("usher has {has}"))
            .with_hint(*hint),
        ConnectError::NoHost { tried, .. } => {
            PgError::fatal(e.sqlstate(), e.to_string()).with_detail(tried.join("; "))
        }
        e => PgError::fatal(e.sqlstate(), e.to_string()),
    }
}

/// Sends an error (or notice) to a client; failures to write are ignored,
/// since the client is usually about to be disconnected anyway.
pub async fn send_error<S: AsyncWrite + Unpin>(stream: &mut S, error: &PgError) {
    count_error(error);
    let mut buf = BytesMut::new();
    error.encode(&mut buf);
    let _ = stream.write_all(&buf).await;
    let _ = stream.flush().await;
}

/// Counts an error usher itself sends a client (`usher_errors_total`,
/// source `usher`); warnings and notices are not errors.
pub fn count_error(error: &PgError) {
    if matches!(error.severity, Severity::Error | Severity::Fatal) {
        crate::metrics::count_error(ErrorSource::Usher, error.code.as_bytes());
    }
}

/// Sends a final error and closes the connection so that the client reads
/// it: closing a socket with unread input makes the kernel reset the
/// connection, which can destroy the error before the client sees it, so
/// the unread input is drained (briefly, and boundedly) after our FIN.
pub async fn close_with_error<S: AsyncRead + AsyncWrite + Unpin>(stream: &mut S, error: &PgError) {
    send_error(stream, error).await;
    let _ = stream.shutdown().await;
    // On the heap: an array here would make this future (and every client
    // task that may call it) 4 KB larger for the client's whole life.
    let mut sink = vec![0u8; 4096];
    // Read what the client is still sending before closing: closing with
    // unread bytes makes the kernel send a reset, and the client may lose
    // the error it was just sent (a client in the middle of writing a
    // message too large for usher would see only "connection closed").
    // Bounded in time and bytes, so a client cannot hold its task.
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        let mut total = 0;
        while total < 64 << 20 {
            match stream.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(n) => total += n,
            }
        }
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{ConnectError, ServerError, TlsStep, WireError};
    use crate::pool::CheckoutError;
    use std::io;

    fn told(e: ConnectError) -> (Severity, String, String) {
        let e = PgError::from(CheckoutError::Connect(e.into()));
        (e.severity, e.code, e.message)
    }

    fn io_error() -> io::Error {
        io::Error::new(io::ErrorKind::ConnectionRefused, "refused")
    }

    /// What a client is told when usher cannot log in to the server: the
    /// texts and SQLSTATEs from before the backend had typed errors.
    #[test]
    fn a_failed_server_login_tells_the_client_what_it_always_did() {
        let h = || "db1".to_string();
        let p = || 5432;
        let cases = [
            (
                ConnectError::Timeout {
                    host: h(),
                    port: p(),
                    after: Duration::from_millis(500),
                },
                "08006",
                "could not connect to server db1:5432 within 0.5s",
            ),
            (
                ConnectError::Unreachable {
                    host: h(),
                    port: p(),
                    source: io_error(),
                },
                "08006",
                "could not connect to server db1:5432: refused",
            ),
            (
                ConnectError::Tls {
                    host: h(),
                    port: p(),
                    step: TlsStep::Request(io_error()),
                },
                "08006",
                "could not send SSL negotiation to db1:5432: refused",
            ),
            (
                ConnectError::Tls {
                    host: h(),
                    port: p(),
                    step: TlsStep::Answer(io_error()),
                },
                "08006",
                "no answer to SSL negotiation from db1:5432: refused",
            ),
            (
                ConnectError::Tls {
                    host: h(),
                    port: p(),
                    step: TlsStep::Refused {
                        mode: "require".into(),
                    },
                },
                "08006",
                "server db1:5432 does not support SSL, but tls is require",
            ),
            (
                ConnectError::Tls {
                    host: h(),
                    port: p(),
                    step: TlsStep::BadAnswer,
                },
                "08P01",
                "server db1:5432 sent an invalid answer to SSL negotiation",
            ),
            (
                ConnectError::Tls {
                    host: h(),
                    port: p(),
                    step: TlsStep::Handshake(io_error()),
                },
                "08006",
                "TLS with server db1:5432 failed: refused",
            ),
            (
                ConnectError::Wire(WireError::Closed),
                "08006",
                "server closed the connection unexpectedly",
            ),
            (
                ConnectError::Wire(WireError::Lost(io_error())),
                "08006",
                "server connection failed: refused",
            ),
            (
                ConnectError::Wire(WireError::Malformed("short".into())),
                "08P01",
                "bad message from server: short",
            ),
            (
                ConnectError::NoSecret {
                    user: "alice".into(),
                    asked: "a SCRAM password",
                    has: "only the user's md5 hash",
                    hint: "give usher the plaintext password",
                },
                "28000",
                "the server asked for a SCRAM password for user \"alice\", which usher does not have",
            ),
            (
                ConnectError::NoSaslMechanism,
                "0A000",
                "server offers no SASL mechanism usher supports",
            ),
            (
                ConnectError::ScramPassThrough {
                    user: "alice".into(),
                    why: "invalid proof".into(),
                },
                "28P01",
                "SCRAM pass-through for user \"alice\" failed: invalid proof",
            ),
            (
                ConnectError::Protocol("unexpected SASL final".into()),
                "08P01",
                "server login: unexpected SASL final",
            ),
            (
                ConnectError::Encode(io::Error::other("nul byte")),
                "XX000",
                "nul byte",
            ),
        ];
        for (error, code, message) in cases {
            assert_eq!(
                told(error),
                (Severity::Fatal, code.to_string(), message.to_string())
            );
        }
    }

    /// A server's refusal reaches the client with its own fields, as FATAL
    /// (the server ends the connection at login whatever it called it).
    #[test]
    fn a_server_refusal_keeps_its_fields() {
        let refusal = ServerError {
            fatal: false,
            code: "3D000".into(),
            message: "database \"gone\" does not exist".into(),
            detail: Some("d".into()),
            hint: Some("h".into()),
        };
        let e = PgError::from(CheckoutError::Connect(
            ConnectError::Refused(refusal).into(),
        ));
        assert_eq!(
            e,
            PgError::fatal("3D000", "database \"gone\" does not exist")
                .with_detail("d")
                .with_hint("h")
        );
    }

    /// Of several hosts none usable: 08001, naming the target when one was
    /// reached but did not fit, with each host and why in the DETAIL.
    #[test]
    fn no_usable_host_is_08001_with_each_host_in_the_detail() {
        use crate::config::TargetSessionAttrs::{Any, ReadWrite};
        let tried = || {
            vec![
                "a:1: session is read-only".to_string(),
                "b:2: refused".into(),
            ]
        };
        for (target, unfit, message) in [
            (
                ReadWrite,
                true,
                "no host fits target_session_attrs=read-write",
            ),
            (ReadWrite, false, "could not connect to any host"),
            (Any, false, "could not connect to any host"),
        ] {
            let e = PgError::from(CheckoutError::Connect(
                ConnectError::NoHost {
                    target,
                    unfit,
                    tried: tried(),
                }
                .into(),
            ));
            assert_eq!(
                e,
                PgError::fatal("08001", message)
                    .with_detail("a:1: session is read-only; b:2: refused")
            );
        }
    }
}
