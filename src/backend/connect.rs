//! Opening a server connection and logging in to PostgreSQL.

use super::{error_from_fields, lost, read_backend_message, CancelTarget, ServerConn};
use crate::protocol::error::sqlstate;
use crate::protocol::PgError;
use bytes::BytesMut;
use postgres_protocol::authentication::sasl::{self, ChannelBinding, ScramSha256};
use postgres_protocol::message::backend::Message;
use postgres_protocol::message::frontend;
use std::collections::HashMap;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

/// Everything needed to open a server connection for one pool.
#[derive(Clone)]
pub struct ServerTarget {
    pub host: String,
    pub port: u16,
    pub dbname: String,
    pub user: String,
    /// Plaintext password for md5 / SCRAM / cleartext login to the server.
    pub password: Option<String>,
}

impl std::fmt::Debug for ServerTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTarget")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("dbname", &self.dbname)
            .field("user", &self.user)
            .finish_non_exhaustive()
    }
}

/// Connects and logs in, within `timeout`.
pub async fn connect(target: &ServerTarget, timeout: Duration) -> Result<ServerConn, PgError> {
    match tokio::time::timeout(timeout, connect_inner(target)).await {
        Ok(r) => r,
        Err(_) => Err(PgError::fatal(
            sqlstate::CONNECTION_FAILURE,
            format!(
                "could not connect to server {}:{} within {:.1}s",
                target.host,
                target.port,
                timeout.as_secs_f64()
            ),
        )),
    }
}

async fn connect_inner(target: &ServerTarget) -> Result<ServerConn, PgError> {
    let mut stream = TcpStream::connect((target.host.as_str(), target.port))
        .await
        .map_err(|e| {
            PgError::fatal(
                sqlstate::CONNECTION_FAILURE,
                format!(
                    "could not connect to server {}:{}: {e}",
                    target.host, target.port
                ),
            )
        })?;
    let _ = stream.set_nodelay(true);
    let mut out = BytesMut::new();
    frontend::startup_message(
        [
            ("user", target.user.as_str()),
            ("database", target.dbname.as_str()),
        ],
        &mut out,
    )
    .map_err(internal)?;
    stream.write_all(&out).await.map_err(lost)?;

    let mut buf = BytesMut::with_capacity(1024);
    let mut scram: Option<ScramSha256> = None;
    let mut params = HashMap::new();
    let mut key = None;
    let password = || {
        target.password.as_deref().ok_or_else(|| {
            PgError::fatal(
                sqlstate::INVALID_PASSWORD,
                format!(
                    "server asked for a password for user \"{}\" and usher has none",
                    target.user
                ),
            )
        })
    };
    loop {
        out.clear();
        match read_backend_message(&mut stream, &mut buf).await? {
            Message::AuthenticationOk => {}
            Message::AuthenticationCleartextPassword => {
                frontend::password_message(password()?.as_bytes(), &mut out).map_err(internal)?;
            }
            Message::AuthenticationMd5Password(body) => {
                let hash = postgres_protocol::authentication::md5_hash(
                    target.user.as_bytes(),
                    password()?.as_bytes(),
                    body.salt(),
                );
                frontend::password_message(hash.as_bytes(), &mut out).map_err(internal)?;
            }
            Message::AuthenticationSasl(body) => {
                let mut mechanisms = body.mechanisms();
                let mut found = false;
                while let Ok(Some(m)) = fallible_iterator::FallibleIterator::next(&mut mechanisms) {
                    found |= m == sasl::SCRAM_SHA_256;
                }
                if !found {
                    return Err(PgError::fatal(
                        sqlstate::FEATURE_NOT_SUPPORTED,
                        "server offers no SASL mechanism usher supports",
                    ));
                }
                let s = ScramSha256::new(password()?.as_bytes(), ChannelBinding::unsupported());
                frontend::sasl_initial_response(sasl::SCRAM_SHA_256, s.message(), &mut out)
                    .map_err(internal)?;
                scram = Some(s);
            }
            Message::AuthenticationSaslContinue(body) => {
                let s = scram
                    .as_mut()
                    .ok_or_else(|| protocol("unexpected SASL continue"))?;
                s.update(body.data())
                    .map_err(|e| protocol(&e.to_string()))?;
                frontend::sasl_response(s.message(), &mut out).map_err(internal)?;
            }
            Message::AuthenticationSaslFinal(body) => {
                let s = scram
                    .as_mut()
                    .ok_or_else(|| protocol("unexpected SASL final"))?;
                s.finish(body.data())
                    .map_err(|e| protocol(&format!("server's SCRAM signature is wrong: {e}")))?;
            }
            Message::ParameterStatus(body) => {
                if let (Ok(n), Ok(v)) = (body.name(), body.value()) {
                    params.insert(n.to_string(), v.to_string());
                }
            }
            Message::BackendKeyData(body) => {
                key = Some((body.process_id() as u32, body.secret_key() as u32))
            }
            Message::ErrorResponse(body) => {
                let mut e = error_from_fields(body.fields());
                e.severity = crate::protocol::Severity::Fatal;
                return Err(e);
            }
            Message::ReadyForQuery(_) => break,
            Message::NoticeResponse(_) => {}
            _ => return Err(protocol("unexpected message during server login")),
        }
        if !out.is_empty() {
            stream.write_all(&out).await.map_err(lost)?;
        }
    }
    let (pid, secret) = key.unwrap_or((0, 0));
    let cancel = CancelTarget {
        host: target.host.clone(),
        port: target.port,
        pid,
        secret,
    };
    Ok(ServerConn::new(stream, cancel, params))
}

fn internal(e: std::io::Error) -> PgError {
    PgError::fatal(sqlstate::INTERNAL_ERROR, e.to_string())
}

fn protocol(msg: &str) -> PgError {
    PgError::fatal(sqlstate::PROTOCOL_VIOLATION, format!("server login: {msg}"))
}
