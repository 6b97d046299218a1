//! Opening a server connection and logging in to PostgreSQL: to the one
//! server of a database, or to the first of its hosts that answers and
//! fits its target (the order and the back-off are hosts.rs').

use super::credential::{ServerCredential, SharedCredential};
use super::error::{ConnectError, WireError};
use super::hosts::{unfit_reason, ServerHosts};
use super::{read_backend_message, server_error, server_stream, CancelTarget, ServerConn};
use crate::protocol::scram_client::ScramClient;
use crate::tls::ServerTls;
use bytes::BytesMut;
use md5::{Digest, Md5};
use postgres_protocol::authentication::sasl::{self, ChannelBinding, ScramSha256};
use postgres_protocol::message::backend::Message;
use postgres_protocol::message::frontend;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;

/// Everything needed to open a server connection for one pool.
#[derive(Clone)]
pub struct ServerTarget {
    /// The servers (one, or `hosts` with a target).
    pub hosts: Arc<ServerHosts>,
    pub dbname: String,
    pub user: String,
    pub tls: ServerTls,
    /// How to answer the server's authentication request.
    pub credential: SharedCredential,
}

/// A SCRAM exchange with the server: from a password, or from keys.
enum Scram {
    Password(ScramSha256),
    Keys(ScramClient),
}

impl Scram {
    fn message(&self) -> &[u8] {
        match self {
            Scram::Password(s) => s.message(),
            Scram::Keys(s) => s.message(),
        }
    }
}

impl std::fmt::Debug for ServerTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTarget")
            .field("hosts", &self.hosts.list())
            .field("target", &self.hosts.target())
            .field("dbname", &self.dbname)
            .field("user", &self.user)
            .field("tls", &self.tls.mode)
            .finish_non_exhaustive()
    }
}

/// Connects and logs in, within `timeout` per server tried.
pub async fn connect(target: &ServerTarget, timeout: Duration) -> Result<ServerConn, ConnectError> {
    let hosts = &target.hosts;
    if hosts.is_plain() {
        let (host, port) = &hosts.list()[0];
        return connect_to(target, host, *port, timeout).await;
    }
    let mut tried = Vec::new();
    let (mut unfit, mut last_error) = (false, None);
    let plan = hosts.plan(Instant::now());
    for &i in &plan {
        let (host, port) = &hosts.list()[i];
        let outcome = match connect_to(target, host, *port, timeout).await {
            Ok(mut conn) => check_target(&mut conn, hosts, timeout)
                .await
                .map(|read_only| (conn, read_only)),
            Err(e) => Err(e),
        };
        match outcome {
            Ok((conn, read_only)) => {
                let fit = read_only.is_none_or(|ro| hosts.target().fits(ro));
                hosts.connected(i, read_only, fit);
                if fit {
                    return Ok(conn);
                }
                tracing::debug!(%host, port, target = %hosts.target(), "server does not fit the target; trying the next");
                unfit = true;
                tried.push(format!("{host}:{port}: {}", unfit_reason(hosts.target())));
            }
            // The same answer from every server (they share their roles
            // and databases): the server's own error, as with one host.
            Err(e) if e.is_final() => return Err(e),
            Err(e) => {
                let skip = hosts.failed(i, Instant::now());
                tracing::warn!(%host, port, code = e.sqlstate(), error = %e, skip_s = skip.as_secs_f64(), "server could not be used; trying the next");
                tried.push(format!("{host}:{port}: {e}"));
                last_error = Some(e);
            }
        }
    }
    for (i, (host, port)) in hosts.list().iter().enumerate() {
        if !plan.contains(&i) {
            tried.push(format!("{host}:{port}: skipped (failed lately)"));
        }
    }
    match last_error {
        // One server, and it failed: its own error, as without `hosts`.
        Some(e) if hosts.list().len() == 1 => Err(e),
        _ => Err(ConnectError::NoHost {
            target: hosts.target(),
            unfit,
            tried,
        }),
    }
}

/// Whether `conn`'s sessions are read-only, when the target asks (`None`
/// for `target: any`).
async fn check_target(
    conn: &mut ServerConn,
    hosts: &ServerHosts,
    timeout: Duration,
) -> Result<Option<bool>, ConnectError> {
    if hosts.target() == crate::config::TargetSessionAttrs::Any {
        return Ok(None);
    }
    match tokio::time::timeout(timeout, conn.read_only()).await {
        Ok(Ok(ro)) => Ok(Some(ro)),
        Ok(Err(e)) => Err(ConnectError::Protocol(format!(
            "could not tell whether the session is read-only: {e}"
        ))),
        Err(_) => Err(ConnectError::Protocol(
            "no answer to SHOW transaction_read_only".into(),
        )),
    }
}

/// Connects to one server and logs in, within `timeout`.
async fn connect_to(
    target: &ServerTarget,
    host: &str,
    port: u16,
    timeout: Duration,
) -> Result<ServerConn, ConnectError> {
    match tokio::time::timeout(timeout, connect_inner(target, host, port)).await {
        Ok(r) => r,
        Err(_) => Err(ConnectError::Timeout {
            host: host.to_string(),
            port,
            after: timeout,
        }),
    }
}

async fn connect_inner(
    target: &ServerTarget,
    host: &str,
    port: u16,
) -> Result<ServerConn, ConnectError> {
    let mut stream = server_stream::open(host, port, &target.tls).await?;
    let mut out = BytesMut::new();
    frontend::startup_message(
        [
            ("user", target.user.as_str()),
            ("database", target.dbname.as_str()),
        ],
        &mut out,
    )
    .map_err(ConnectError::Encode)?;
    stream.write_all(&out).await.map_err(WireError::Lost)?;

    let credential = target.credential.get();
    let mut buf = BytesMut::with_capacity(1024);
    let mut scram: Option<Scram> = None;
    let mut params = HashMap::new();
    let mut key = None;
    let cannot = |asked: &'static str| cannot_answer(target, &credential, asked);
    loop {
        out.clear();
        match read_backend_message(&mut stream, &mut buf).await? {
            Message::AuthenticationOk => {}
            Message::AuthenticationCleartextPassword => {
                let Some(p) = credential.password() else {
                    return Err(cannot("a cleartext password"));
                };
                frontend::password_message(p.as_bytes(), &mut out).map_err(ConnectError::Encode)?;
            }
            Message::AuthenticationMd5Password(body) => {
                let hash = match &credential {
                    ServerCredential::Password(p) | ServerCredential::ScramAndPassword(_, p) => {
                        postgres_protocol::authentication::md5_hash(
                            target.user.as_bytes(),
                            p.as_bytes(),
                            body.salt(),
                        )
                    }
                    // The stored hash is all an md5 challenge needs.
                    ServerCredential::Md5(h) => md5_response(h, body.salt()),
                    _ => return Err(cannot("an md5 password")),
                };
                frontend::password_message(hash.as_bytes(), &mut out)
                    .map_err(ConnectError::Encode)?;
            }
            Message::AuthenticationSasl(body) => {
                let mut mechanisms = body.mechanisms();
                let mut found = false;
                while let Ok(Some(m)) = fallible_iterator::FallibleIterator::next(&mut mechanisms) {
                    found |= m == sasl::SCRAM_SHA_256;
                }
                if !found {
                    return Err(ConnectError::NoSaslMechanism);
                }
                let s = match &credential {
                    ServerCredential::Password(p) => Scram::Password(ScramSha256::new(
                        p.as_bytes(),
                        ChannelBinding::unsupported(),
                    )),
                    // Pass-through from keys: no PBKDF2 of usher's own.
                    ServerCredential::Scram(keys) | ServerCredential::ScramAndPassword(keys, _) => {
                        Scram::Keys(ScramClient::new(keys.clone()))
                    }
                    _ => return Err(cannot("a SCRAM password")),
                };
                frontend::sasl_initial_response(sasl::SCRAM_SHA_256, s.message(), &mut out)
                    .map_err(ConnectError::Encode)?;
                scram = Some(s);
            }
            Message::AuthenticationSaslContinue(body) => {
                match scram.as_mut() {
                    Some(Scram::Password(s)) => s
                        .update(body.data())
                        .map_err(|e| protocol(&e.to_string()))?,
                    Some(Scram::Keys(s)) => s
                        .update(body.data())
                        .map_err(|e| scram_failed(target, &e.to_string()))?,
                    None => return Err(protocol("unexpected SASL continue")),
                }
                let s = scram.as_ref().expect("set above");
                frontend::sasl_response(s.message(), &mut out).map_err(ConnectError::Encode)?;
            }
            Message::AuthenticationSaslFinal(body) => match scram.take() {
                Some(Scram::Password(mut s)) => s
                    .finish(body.data())
                    .map_err(|e| protocol(&format!("server's SCRAM signature is wrong: {e}")))?,
                Some(Scram::Keys(s)) => s
                    .finish(body.data())
                    .map_err(|e| scram_failed(target, &e.to_string()))?,
                None => return Err(protocol("unexpected SASL final")),
            },
            Message::ParameterStatus(body) => {
                if let (Ok(n), Ok(v)) = (body.name(), body.value()) {
                    params.insert(n.to_string(), v.to_string());
                }
            }
            Message::BackendKeyData(body) => {
                key = Some((body.process_id() as u32, body.secret_key() as u32))
            }
            Message::ErrorResponse(body) => {
                return Err(ConnectError::Refused(server_error(body.fields())))
            }
            Message::ReadyForQuery(_) => break,
            Message::NoticeResponse(_) => {}
            _ => return Err(protocol("unexpected message during server login")),
        }
        if !out.is_empty() {
            stream.write_all(&out).await.map_err(WireError::Lost)?;
        }
    }
    let (pid, secret) = key.unwrap_or((0, 0));
    let cancel = CancelTarget {
        host: host.to_string(),
        port,
        pid,
        secret,
    };
    Ok(ServerConn::new(stream, cancel, params))
}

/// The server asked for what usher does not have for this user: 28000,
/// saying what it would need.
fn cannot_answer(
    target: &ServerTarget,
    credential: &ServerCredential,
    asked: &'static str,
) -> ConnectError {
    let (has, hint) = match credential {
        ServerCredential::None => (
            "no password for this user",
            "give usher the user's password (users.<name>.password or auth.file), or let the server trust usher",
        ),
        ServerCredential::Md5(_) => (
            "only the user's md5 hash",
            "give usher the plaintext password, or use md5 in the server's pg_hba.conf",
        ),
        ServerCredential::Scram(_) => (
            "no cleartext password: the client logged in with SCRAM, which never reveals it",
            "use auth method password for this user in usher (the client then sends its password, over TLS), give usher the plaintext password, or use scram-sha-256 in the server's pg_hba.conf",
        ),
        ServerCredential::Password(_) | ServerCredential::ScramAndPassword(..) => (
            "no answer usher supports",
            "use scram-sha-256, md5 or password in the server's pg_hba.conf",
        ),
    };
    ConnectError::NoSecret {
        user: target.user.clone(),
        asked,
        has,
        hint,
    }
}

/// The answer to an md5 challenge from the stored `md5...` hash.
fn md5_response(stored: &str, salt: [u8; 4]) -> String {
    let mut md5 = Md5::new();
    md5.update(stored.as_bytes().get(3..).unwrap_or_default());
    md5.update(salt);
    format!("md5{:x}", md5.finalize())
}

fn scram_failed(target: &ServerTarget, why: &str) -> ConnectError {
    ConnectError::ScramPassThrough {
        user: target.user.clone(),
        why: why.to_string(),
    }
}

fn protocol(msg: &str) -> ConnectError {
    ConnectError::Protocol(msg.to_string())
}
