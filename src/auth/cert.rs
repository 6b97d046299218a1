//! Client certificate authentication: the certificate (already verified
//! against `tls.ca` in the TLS handshake) names the user in its subject's
//! common name (CN), as PostgreSQL's `cert` method does by default.

use rustls_pki_types::CertificateDer;

/// The subject's first common name, if the certificate has a readable one.
pub fn common_name(cert: &CertificateDer<'_>) -> Option<String> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref()).ok()?;
    let cn = parsed.subject().iter_common_name().next()?;
    cn.as_str().ok().map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_subject_common_name() {
        let mut params = rcgen::CertificateParams::new(vec!["example.test".into()]).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::OrganizationName, "usher tests");
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "alice");
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        assert_eq!(common_name(cert.der()).as_deref(), Some("alice"));
    }

    #[test]
    fn garbage_has_no_common_name() {
        assert_eq!(
            common_name(&CertificateDer::from(vec![0x30, 0x03, 1, 2])),
            None
        );
        assert_eq!(common_name(&CertificateDer::from(Vec::new())), None);
    }
}
