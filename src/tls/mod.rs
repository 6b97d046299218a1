//! TLS with rustls (the `ring` provider): the acceptor clients meet, the
//! connectors usher uses towards PostgreSQL, and a stream wrapper that makes
//! TLS writes behave like a socket's.
//!
//! - [`client_tls`]: client-facing `ServerConfig` from `tls.cert`/`key`/`ca`.
//! - [`server_tls`]: server-facing `ClientConfig` per database (`databases.<name>.tls`).
//! - [`write_through`]: writes that return once the bytes are on the socket.
//! - [`client_tls_stream`]: a client's TLS stream on rustls' unbuffered API, holding no
//!   buffer while idle (writes return once on the socket too).

pub mod client_tls;
pub(crate) mod client_tls_stream;
pub(crate) mod server_tls;
pub(crate) mod write_through;

pub use client_tls::ClientTls;
pub use client_tls_stream::ClientTlsStream;
pub use server_tls::ServerTls;
pub use write_through::WriteThrough;

use rustls::crypto::CryptoProvider;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::path::Path;
use std::sync::{Arc, OnceLock};

/// The crypto provider for every TLS configuration usher builds.
pub fn provider() -> Arc<CryptoProvider> {
    static PROVIDER: OnceLock<Arc<CryptoProvider>> = OnceLock::new();
    PROVIDER
        .get_or_init(|| Arc::new(rustls::crypto::ring::default_provider()))
        .clone()
}

/// Why a PEM file could not be used. The message names the file and
/// never quotes its contents (a key file holds a private key).
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: not a valid PEM certificate file: {reason}")]
    BadPem { path: String, reason: String },
    #[error("{path}: no certificate in the file")]
    NoCertificate { path: String },
    #[error("{path}: no PEM private key in the file")]
    NoKey { path: String },
    #[error("{path}: unusable CA certificate: {reason}")]
    BadCa { path: String, reason: String },
}

/// Reads every certificate of a PEM file; an error says what was wrong.
pub fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::BadPem {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            path: path.display().to_string(),
        });
    }
    Ok(certs)
}

/// Reads the private key of a PEM file (PKCS#8, PKCS#1 or SEC1).
pub fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let pem = read(path)?;
    // The error never quotes the file: it holds a private key.
    PrivateKeyDer::from_pem_slice(&pem).map_err(|_| TlsError::NoKey {
        path: path.display().to_string(),
    })
}

/// A root store of the certificates in a PEM file.
pub fn load_roots(path: &Path) -> Result<rustls::RootCertStore, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in load_certs(path)? {
        roots.add(cert).map_err(|e| TlsError::BadCa {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
    }
    Ok(roots)
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.display().to_string(),
        source,
    })
}
