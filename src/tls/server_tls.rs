//! The TLS usher uses towards PostgreSQL, per database: libpq's sslmodes
//! `disable`, `prefer`, `require` (encrypted, certificate not checked) and
//! `verify-full` (the certificate chains to `tls_ca` and names the host).

use super::{load_roots, provider};
use crate::config::{ConfigIssue, DatabaseConfig, ServerTlsMode};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, SignatureScheme};
use std::sync::Arc;

/// How to secure connections to one database's server.
#[derive(Clone)]
pub struct ServerTls {
    pub mode: ServerTlsMode,
    /// `None` for `disable`.
    config: Option<Arc<ClientConfig>>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

impl ServerTls {
    /// No TLS.
    pub fn disabled() -> Self {
        ServerTls {
            mode: ServerTlsMode::Disable,
            config: None,
        }
    }

    /// Builds the TLS settings of a database; errors name the key.
    pub fn from_config(db: &DatabaseConfig) -> Result<ServerTls, ConfigIssue> {
        // verify-full checks each server's certificate against its own name.
        let unnamed = db
            .server_hosts()
            .into_iter()
            .map(|(host, _)| host)
            // (a socket directory: TLS is not used there, as in libpq)
            .find(|host| {
                !crate::config::is_socket_dir(host) && ServerName::try_from(host.clone()).is_err()
            });
        let key = if db.hosts.is_some() { "hosts" } else { "host" };
        let config = match db.tls {
            ServerTlsMode::Disable => return Ok(ServerTls::disabled()),
            ServerTlsMode::Prefer | ServerTlsMode::Require => {
                ClientConfig::builder_with_provider(provider())
                    .with_safe_default_protocol_versions()
                    .map_err(|e| ConfigIssue::new("tls", e.to_string()))?
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(Unverified(provider())))
                    .with_no_client_auth()
            }
            ServerTlsMode::VerifyFull => {
                if let Some(host) = unnamed {
                    return Err(ConfigIssue::new(
                        key,
                        format!(
                            "verify-full needs a host name or IP address to check the certificate against, got `{host}`"
                        ),
                    ));
                }
                let Some(ca) = &db.tls_ca else {
                    return Err(ConfigIssue::new("tls_ca", "expected a CA file (PEM)"));
                };
                let roots =
                    load_roots(ca).map_err(|e| ConfigIssue::new("tls_ca", e.to_string()))?;
                ClientConfig::builder_with_provider(provider())
                    .with_safe_default_protocol_versions()
                    .map_err(|e| ConfigIssue::new("tls", e.to_string()))?
                    .with_root_certificates(roots)
                    .with_no_client_auth()
            }
        };
        Ok(ServerTls {
            mode: db.tls,
            config: Some(Arc::new(config)),
        })
    }

    /// The rustls configuration and the name to check `host`'s certificate
    /// against, unless TLS is off. Without verification the name only goes
    /// into SNI (`localhost` when `host` is no valid name).
    pub fn client_config(&self, host: &str) -> Option<(Arc<ClientConfig>, ServerName<'static>)> {
        let name = ServerName::try_from(host.to_string())
            .unwrap_or_else(|_| ServerName::try_from("localhost").expect("valid"));
        self.config.clone().map(|c| (c, name))
    }
}

/// `prefer` and `require` encrypt without checking who is at the other end
/// (libpq's behaviour without a root certificate). The handshake signatures
/// are still verified, so the session keys belong to the certificate shown.
#[derive(Debug)]
struct Unverified(Arc<CryptoProvider>);

impl ServerCertVerifier for Unverified {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
