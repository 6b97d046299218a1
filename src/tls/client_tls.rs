//! The TLS usher offers clients: its certificate (`tls.cert`, `tls.key`) and,
//! with `tls.ca`, verification of the certificates clients present. A client
//! without a certificate may still connect; methods other than `cert` do not
//! need one.

use super::{load_certs, load_key, load_roots, provider};
use crate::config::{ConfigIssue, TlsConfig, TlsMode};
use rustls::server::WebPkiClientVerifier;
use rustls::ServerConfig;
use std::sync::Arc;
use tokio_rustls::TlsAcceptor;

/// The most plaintext usher puts in one TLS record to a client: what
/// PostgreSQL puts in one (its 8 KB send buffer), not TLS's 16 KB.
///
/// libpq needs this (PostgreSQL 15's, at least). It reads one record per
/// `SSL_read` into at least 8 KB of free space; the rest of a larger record
/// stays decrypted inside OpenSSL, and an application on libpq's
/// asynchronous API (psycopg) then waits on the socket for a message that
/// already arrived: a hang once the server has sent the end of a result
/// (tests/it/tls.rs, tests/common/libpq.rs).
pub const MAX_RECORD_PLAINTEXT: usize = 8192;

/// rustls counts the record header in `max_fragment_size`.
const RECORD_HEADER: usize = 5;

/// Client-facing TLS, built once from `tls`.
#[derive(Clone)]
pub struct ClientTls {
    pub mode: TlsMode,
    pub acceptor: TlsAcceptor,
    /// Client certificates are asked for and checked against `tls.ca`.
    pub verifies_clients: bool,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls")
            .field("mode", &self.mode)
            .field("verifies_clients", &self.verifies_clients)
            .finish_non_exhaustive()
    }
}

impl ClientTls {
    /// `None` when TLS is off. Errors name the key and what was wrong.
    pub fn from_config(tls: &TlsConfig) -> Result<Option<ClientTls>, ConfigIssue> {
        if tls.mode == TlsMode::Disable {
            return Ok(None);
        }
        let (Some(cert), Some(key)) = (&tls.cert, &tls.key) else {
            return Err(ConfigIssue::new("tls.cert", "expected a PEM file"));
        };
        let certs = load_certs(cert).map_err(|e| ConfigIssue::new("tls.cert", e.to_string()))?;
        let key = load_key(key).map_err(|e| ConfigIssue::new("tls.key", e.to_string()))?;
        let verifier = match &tls.ca {
            Some(ca) => {
                let roots =
                    load_roots(ca).map_err(|e| ConfigIssue::new("tls.ca", e.to_string()))?;
                WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                    .allow_unauthenticated()
                    .build()
                    .map_err(|e| ConfigIssue::new("tls.ca", e.to_string()))?
            }
            None => WebPkiClientVerifier::no_client_auth(),
        };
        let mut config = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| ConfigIssue::new("tls", e.to_string()))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(certs, key)
            .map_err(|e| ConfigIssue::new("tls.key", format!("does not fit tls.cert: {e}")))?;
        // PostgreSQL 17 clients may name the protocol; older ones send nothing.
        config.alpn_protocols = vec![b"postgresql".to_vec()];
        config.max_fragment_size = Some(MAX_RECORD_PLAINTEXT + RECORD_HEADER);
        // No session resumption, as PostgreSQL (no session cache, no
        // tickets): a cache would hold up to 256 sessions, and TLS 1.3
        // tickets cost every handshake.
        config.send_tls13_tickets = 0;
        config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
        Ok(Some(ClientTls {
            mode: tls.mode,
            acceptor: TlsAcceptor::from(Arc::new(config)),
            verifies_clients: tls.ca.is_some(),
        }))
    }
}
