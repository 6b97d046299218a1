//! Client authentication: the methods of `auth.method` (or of the HBA rule
//! that matched) against the credentials usher knows, and the record of
//! every attempt.
//!
//! Unknown users go through the same exchange as known ones and get the same
//! error (28P01), so a client cannot tell which roles exist.
//!
//! - [`credentials`]: where secrets come from (config, `auth.file`, `auth.query`).
//! - [`hba`]: the rules that pick the method or refuse the connection.
//! - [`cert`]: the user name in a client certificate.
//! - [`peer`], [`ident`]: the operating-system user of a Unix-socket
//!   client, and the user name maps (pg_ident.conf) that let it log in as
//!   another user.
//! - [`secret`], [`attempt`]: stored secrets; the record of an outcome.

pub(crate) mod attempt;
pub(crate) mod auth_query;
pub(crate) mod cert;
pub(crate) mod credentials;
pub mod hba;
pub mod ident;
pub mod peer;
pub mod secret;
pub mod userlist;

pub use attempt::{AuthAttempt, AuthOutcome};
pub use credentials::{Credentials, UserLookup};
pub use secret::Secret;

use crate::config::AuthMethod;
use crate::protocol::error::{shown_name, sqlstate};
use crate::protocol::messages::{self, MAX_LOGIN_MESSAGE};
use crate::protocol::scram::{ScramError, ScramServer, ScramVerifier};
use crate::protocol::tags::frontend;
use crate::protocol::PgError;
use bytes::BytesMut;
use rand::RngCore;
use rustls_pki_types::CertificateDer;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

/// A failed authentication: what to tell the client and what to record.
#[derive(Debug)]
pub struct AuthFailure {
    pub outcome: AuthOutcome,
    pub error: PgError,
}

impl AuthFailure {
    fn new(outcome: AuthOutcome, error: PgError) -> Self {
        AuthFailure { outcome, error }
    }

    fn protocol(error: PgError) -> Self {
        AuthFailure::new(AuthOutcome::ProtocolError, error)
    }
}

/// What a successful authentication proved.
#[derive(Default)]
pub struct Authenticated {
    /// The SCRAM ClientKey the client proved it holds (for pass-through).
    pub scram_client_key: Option<[u8; 32]>,
    /// The cleartext password the client sent (method `password`) when
    /// usher holds only its SCRAM verifier: a server that asks for a
    /// cleartext or md5 password can then be answered.
    pub cleartext: Option<String>,
}

impl std::fmt::Debug for Authenticated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authenticated")
            .field("scram_client_key", &self.scram_client_key.map(|_| ".."))
            .field("cleartext", &self.cleartext.as_ref().map(|_| ".."))
            .finish()
    }
}

/// One authentication to run: the method, who the client says it is, and
/// what usher knows of that user.
#[derive(Debug, Clone, Copy)]
pub struct Challenge<'a> {
    pub method: AuthMethod,
    pub user: &'a str,
    /// Whether usher knows the user (config, auth file or auth query).
    pub known: bool,
    /// `None` for unknown users and for users without a password (who may
    /// only use `trust` or `cert`).
    pub secret: Option<&'a Secret>,
    /// The certificate the client presented over TLS, already verified
    /// against `tls.ca`.
    pub certificate: Option<&'a CertificateDer<'static>>,
    /// Who the kernel says a Unix-socket client is (for `peer`); `None`
    /// for a TCP client.
    pub peer: Option<peer::PeerIdentity<'a>>,
    /// Salts the fake SCRAM exchange that hides whether a user exists.
    pub mock_key: &'a [u8],
}

fn password_failed(user: &str, outcome: AuthOutcome) -> AuthFailure {
    AuthFailure::new(
        outcome,
        PgError::fatal(
            sqlstate::INVALID_PASSWORD,
            format!(
                "password authentication failed for user \"{}\"",
                shown_name(user)
            ),
        ),
    )
}

/// Runs the challenge's method over `stream`. `recheck` is asked again
/// when the client's answer (password, md5 response, SCRAM proof) arrives,
/// before it is checked: a refusal decided meanwhile (the auth monitor's
/// lockout, engaged by logins that were already past their start) refuses
/// it unchecked, as outcome `Locked`. So the guesses checked are at most
/// the lockout's `max_failures`, not that plus the logins in flight.
pub async fn authenticate<S>(
    stream: &mut S,
    challenge: &Challenge<'_>,
    recheck: impl Fn() -> Option<PgError>,
) -> Result<Authenticated, AuthFailure>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let recheck = || recheck().map(|e| AuthFailure::new(AuthOutcome::Locked, e));
    let Challenge {
        method,
        user,
        known,
        secret,
        certificate,
        peer,
        mock_key,
    } = *challenge;
    let unknown = || {
        let outcome = if known {
            AuthOutcome::WrongPassword
        } else {
            AuthOutcome::UnknownUser
        };
        password_failed(user, outcome)
    };
    let wrong = || password_failed(user, AuthOutcome::WrongPassword);
    match method {
        AuthMethod::Trust if known => Ok(Authenticated::default()),
        AuthMethod::Trust => Err(unknown()),
        AuthMethod::Password => {
            let mut out = BytesMut::new();
            messages::authentication_cleartext(&mut out);
            send(stream, &out).await?;
            let given = read_password(stream).await?;
            let given = given.strip_suffix('\0').unwrap_or(&given);
            if let Some(refused) = recheck() {
                return Err(refused);
            }
            match secret {
                None => Err(unknown()),
                // One PBKDF2 run both checks the password and yields the
                // ClientKey for SCRAM pass-through.
                Some(s @ Secret::Scram(_)) => match s.scram_client_key(given) {
                    Some(key) => Ok(Authenticated {
                        scram_client_key: Some(key),
                        cleartext: Some(given.to_string()),
                    }),
                    None => Err(wrong()),
                },
                Some(s) if s.check_cleartext(user, given) => Ok(Authenticated::default()),
                Some(_) => Err(wrong()),
            }
        }
        AuthMethod::Cert => check_certificate(user, known, certificate),
        AuthMethod::Peer => peer::check(user, known, peer.as_ref()),
        // As in PostgreSQL: md5 with a SCRAM-only secret is done with SCRAM.
        AuthMethod::Md5 if secret.is_none_or(|s| s.md5_hash(user).is_some()) => {
            let mut salt = [0u8; 4];
            rand::thread_rng().fill_bytes(&mut salt);
            let mut out = BytesMut::new();
            messages::authentication_md5(&mut out, salt);
            send(stream, &out).await?;
            let given = read_password(stream).await?;
            let given = given.strip_suffix('\0').unwrap_or(&given);
            if let Some(refused) = recheck() {
                return Err(refused);
            }
            match secret {
                None => Err(unknown()),
                Some(s) if s.check_md5_response(user, salt, given) => Ok(Authenticated::default()),
                Some(_) => Err(wrong()),
            }
        }
        AuthMethod::Md5 | AuthMethod::ScramSha256 => {
            let verifier = secret.and_then(Secret::scram).cloned();
            let known = verifier.is_some();
            let verifier = verifier.unwrap_or_else(|| ScramVerifier::mock(user, mock_key));
            match scram_exchange(stream, verifier, recheck).await {
                Ok(client_key) if known => Ok(Authenticated {
                    scram_client_key: Some(client_key),
                    cleartext: None,
                }),
                Ok(_) => Err(unknown()),
                Err(ScramFailure::Proof) if secret.is_none() => Err(unknown()),
                Err(ScramFailure::Proof) => Err(wrong()),
                Err(ScramFailure::Failure(f)) => Err(f),
            }
        }
    }
}

/// `cert`: the verified certificate's CN must be the user name. As in
/// PostgreSQL, failures are 28000, not 28P01.
fn check_certificate(
    user: &str,
    known: bool,
    certificate: Option<&CertificateDer<'static>>,
) -> Result<Authenticated, AuthFailure> {
    let Some(certificate) = certificate else {
        return Err(AuthFailure::new(
            AuthOutcome::TlsRequired,
            PgError::fatal(
                sqlstate::INVALID_AUTHORIZATION,
                "connection requires a valid client certificate",
            ),
        ));
    };
    let matches = cert::common_name(certificate).is_some_and(|cn| cn == user);
    if matches && known {
        return Ok(Authenticated::default());
    }
    let outcome = match (matches, known) {
        (true, false) => AuthOutcome::UnknownUser,
        _ => AuthOutcome::WrongPassword,
    };
    Err(AuthFailure::new(
        outcome,
        PgError::fatal(
            sqlstate::INVALID_AUTHORIZATION,
            format!(
                "certificate authentication failed for user \"{}\"",
                shown_name(user)
            ),
        ),
    ))
}

enum ScramFailure {
    /// The proof did not match.
    Proof,
    Failure(AuthFailure),
}

impl From<AuthFailure> for ScramFailure {
    fn from(f: AuthFailure) -> Self {
        ScramFailure::Failure(f)
    }
}

async fn scram_exchange<S>(
    stream: &mut S,
    verifier: ScramVerifier,
    recheck: impl Fn() -> Option<AuthFailure>,
) -> Result<[u8; 32], ScramFailure>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let malformed = |e: ScramError| {
        ScramFailure::Failure(AuthFailure::protocol(PgError::protocol(e.to_string())))
    };
    let mut out = BytesMut::new();
    messages::authentication_sasl(&mut out, &["SCRAM-SHA-256"]);
    send(stream, &out).await?;

    // SASLInitialResponse: mechanism name, then an Int32 length and the data.
    let mut body = read_auth_message(stream).await?;
    let mechanism = messages::get_cstr(&mut body).map_err(AuthFailure::protocol)?;
    if mechanism != "SCRAM-SHA-256" {
        // PostgreSQL's words; the client's bytes are not echoed.
        return Err(AuthFailure::protocol(PgError::protocol(
            "client selected an invalid SASL authentication mechanism",
        ))
        .into());
    }
    if body.len() < 4 {
        return Err(
            AuthFailure::protocol(PgError::protocol("malformed SASLInitialResponse")).into(),
        );
    }
    let data_len = i32::from_be_bytes([body[0], body[1], body[2], body[3]]);
    let data = &body[4..];
    if data_len < 0 || data_len as usize != data.len() {
        return Err(
            AuthFailure::protocol(PgError::protocol("malformed SASLInitialResponse")).into(),
        );
    }
    let (server, server_first) = ScramServer::start(verifier, data).map_err(malformed)?;
    out.clear();
    messages::authentication_sasl_continue(&mut out, server_first.as_bytes());
    send(stream, &out).await?;

    let body = read_auth_message(stream).await?;
    if let Some(refused) = recheck() {
        return Err(refused.into());
    }
    match server.finish(&body) {
        Ok((server_final, client_key)) => {
            out.clear();
            messages::authentication_sasl_final(&mut out, server_final.as_bytes());
            send(stream, &out).await?;
            Ok(client_key)
        }
        Err(ScramError::WrongProof) => Err(ScramFailure::Proof),
        Err(e) => Err(malformed(e)),
    }
}

async fn send<S: AsyncWrite + Unpin>(stream: &mut S, bytes: &[u8]) -> Result<(), AuthFailure> {
    stream.write_all(bytes).await.map_err(|e| {
        AuthFailure::protocol(PgError::fatal(
            sqlstate::CONNECTION_FAILURE,
            format!("could not send authentication request: {e}"),
        ))
    })?;
    stream.flush().await.map_err(|e| {
        AuthFailure::protocol(PgError::fatal(sqlstate::CONNECTION_FAILURE, e.to_string()))
    })
}

/// Reads the client's next 'p' message (password, SASL response).
async fn read_auth_message<S: AsyncRead + Unpin>(
    stream: &mut S,
) -> Result<bytes::Bytes, AuthFailure> {
    match messages::read_message(stream, MAX_LOGIN_MESSAGE).await {
        Ok(Some(m)) if m.tag == frontend::AUTH_RESPONSE => Ok(m.body),
        Ok(Some(m)) => Err(AuthFailure::protocol(PgError::protocol(format!(
            "expected password response, got message type '{}'",
            messages::printable(m.tag)
        )))),
        Ok(None) => Err(AuthFailure::protocol(PgError::protocol(
            "client closed the connection during authentication",
        ))),
        Err(e) => Err(AuthFailure::protocol(e)),
    }
}

async fn read_password<S: AsyncRead + Unpin>(stream: &mut S) -> Result<String, AuthFailure> {
    let body = read_auth_message(stream).await?;
    String::from_utf8(body.to_vec())
        .map_err(|_| AuthFailure::protocol(PgError::protocol("password is not UTF-8")))
}
