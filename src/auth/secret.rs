//! What usher knows of a user's password.

use crate::protocol::scram::ScramVerifier;
use md5::{Digest, Md5};

/// A stored password in one of the forms PostgreSQL uses. The Debug output
/// never shows it.
#[derive(Clone)]
pub enum Secret {
    /// Plaintext (from the config file), with a SCRAM verifier computed once
    /// at load so SCRAM logins do not pay for PBKDF2.
    Plain {
        password: String,
        verifier: ScramVerifier,
    },
    /// `md5` + md5(password + user), as in pg_authid.
    Md5(String),
    /// A SCRAM-SHA-256 verifier.
    Scram(ScramVerifier),
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Secret::Plain { .. } => "Secret::Plain(..)",
            Secret::Md5(_) => "Secret::Md5(..)",
            Secret::Scram(_) => "Secret::Scram(..)",
        })
    }
}

impl Secret {
    /// Recognises the form of a configured password.
    pub fn parse(text: &str) -> Secret {
        if let Some(v) = ScramVerifier::parse(text) {
            return Secret::Scram(v);
        }
        if text.len() == 35
            && text.starts_with("md5")
            && text[3..].bytes().all(|b| b.is_ascii_hexdigit())
        {
            return Secret::Md5(text.to_string());
        }
        Secret::Plain {
            password: text.to_string(),
            verifier: ScramVerifier::from_password(text),
        }
    }

    /// The plaintext, when usher has it (needed to log in to the server).
    pub fn plaintext(&self) -> Option<&str> {
        match self {
            Secret::Plain { password, .. } => Some(password),
            _ => None,
        }
    }

    /// The `md5...` hash for `user`, when it can be derived.
    pub fn md5_hash(&self, user: &str) -> Option<String> {
        match self {
            Secret::Plain { password, .. } => {
                Some(postgres_protocol::password::md5(password.as_bytes(), user))
            }
            Secret::Md5(h) => Some(h.clone()),
            Secret::Scram(_) => None,
        }
    }

    /// The SCRAM verifier, when there is one.
    pub fn scram(&self) -> Option<&ScramVerifier> {
        match self {
            Secret::Plain { verifier, .. } | Secret::Scram(verifier) => Some(verifier),
            Secret::Md5(_) => None,
        }
    }

    /// Checks a cleartext password, in constant time where it compares.
    pub fn check_cleartext(&self, user: &str, given: &str) -> bool {
        match self {
            Secret::Plain { password, .. } => ct_eq(password.as_bytes(), given.as_bytes()),
            Secret::Md5(h) => ct_eq(
                h.as_bytes(),
                postgres_protocol::password::md5(given.as_bytes(), user).as_bytes(),
            ),
            Secret::Scram(v) => scram_client_key(v, given).is_some(),
        }
    }

    /// The SCRAM ClientKey for a cleartext password that matches a SCRAM
    /// verifier: what SCRAM pass-through needs to log in to the server.
    pub fn scram_client_key(&self, given: &str) -> Option<[u8; 32]> {
        match self {
            Secret::Scram(v) => scram_client_key(v, given),
            _ => None,
        }
    }

    /// Checks the response to an md5 challenge with `salt`.
    pub fn check_md5_response(&self, user: &str, salt: [u8; 4], response: &str) -> bool {
        let Some(hash) = self.md5_hash(user) else {
            return false;
        };
        let mut md5 = Md5::new();
        md5.update(&hash.as_bytes()[3..]);
        md5.update(salt);
        let expected = format!("md5{:x}", md5.finalize());
        ct_eq(expected.as_bytes(), response.as_bytes())
    }
}

/// Compares two byte strings without an early exit on the first
/// difference (it lives in `protocol`, which backend may use too).
pub use crate::protocol::ct_eq;

/// Checks a cleartext password against a SCRAM verifier by recomputing the
/// stored key with the verifier's salt and iteration count; on a match,
/// returns the ClientKey.
fn scram_client_key(v: &ScramVerifier, password: &str) -> Option<[u8; 32]> {
    use hmac::{Hmac, Mac};
    use sha2::Sha256;
    let prepped = stringprep_or_raw(password);
    let mut salted = [0u8; 32];
    pbkdf2::pbkdf2_hmac::<Sha256>(prepped.as_bytes(), &v.salt, v.iterations, &mut salted);
    let mut mac = Hmac::<Sha256>::new_from_slice(&salted).expect("any key length");
    mac.update(b"Client Key");
    let client_key: [u8; 32] = mac.finalize().into_bytes().into();
    let stored: [u8; 32] = sha2::Sha256::digest(client_key).into();
    ct_eq(&stored, &v.stored_key).then_some(client_key)
}

/// PostgreSQL applies SASLprep and falls back to the raw password when the
/// password is not valid for it.
fn stringprep_or_raw(password: &str) -> std::borrow::Cow<'_, str> {
    stringprep::saslprep(password).unwrap_or(std::borrow::Cow::Borrowed(password))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognises_forms() {
        assert!(matches!(Secret::parse("hunter2"), Secret::Plain { .. }));
        let md5 = postgres_protocol::password::md5(b"pw", "bob");
        assert!(matches!(Secret::parse(&md5), Secret::Md5(_)));
        let scram = postgres_protocol::password::scram_sha_256(b"pw");
        assert!(matches!(Secret::parse(&scram), Secret::Scram(_)));
    }

    #[test]
    fn cleartext_checks_every_form() {
        let md5 = postgres_protocol::password::md5(b"pw", "bob");
        let scram = postgres_protocol::password::scram_sha_256(b"pw");
        for s in [
            Secret::parse("pw"),
            Secret::parse(&md5),
            Secret::parse(&scram),
        ] {
            assert!(s.check_cleartext("bob", "pw"), "{s:?}");
            assert!(!s.check_cleartext("bob", "pW"), "{s:?}");
        }
    }

    #[test]
    fn md5_challenge() {
        let s = Secret::parse("pw");
        let salt = [1, 2, 3, 4];
        let response = postgres_protocol::authentication::md5_hash(b"bob", b"pw", salt);
        assert!(s.check_md5_response("bob", salt, &response));
        assert!(!s.check_md5_response("bob", [0, 0, 0, 0], &response));
        assert!(!s.check_md5_response("eve", salt, &response));
    }

    #[test]
    fn a_matching_cleartext_password_yields_the_scram_client_key() {
        let s = Secret::parse(&postgres_protocol::password::scram_sha_256(b"pw"));
        let key = s.scram_client_key("pw").expect("matches");
        let v = s.scram().unwrap();
        let stored: [u8; 32] = sha2::Sha256::digest(key).into();
        assert_eq!(stored, v.stored_key);
        assert_eq!(s.scram_client_key("pW"), None);
        assert_eq!(Secret::parse("pw").scram_client_key("pw"), None);
    }

    #[test]
    fn ct_eq_compares_whole_strings() {
        assert!(ct_eq(b"abc", b"abc"));
        assert!(!ct_eq(b"abc", b"abd"));
        assert!(!ct_eq(b"abc", b"ab"));
        assert!(!ct_eq(b"", b"a"));
        assert!(ct_eq(b"", b""));
    }

    #[test]
    fn debug_never_shows_the_secret() {
        let s = Secret::parse("hunter2");
        assert!(!format!("{s:?}").contains("hunter2"));
    }
}
