//! The server side of SCRAM-SHA-256 (RFC 5802, RFC 7677) as PostgreSQL
//! speaks it: no channel binding offered, the user name taken from the
//! startup packet. The client side is postgres-protocol's (with a password)
//! and [`super::scram_client`]'s (with keys, for pass-through).

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

type HmacSha256 = Hmac<Sha256>;

/// What PostgreSQL stores for a SCRAM password:
/// `SCRAM-SHA-256$<iterations>:<salt>$<StoredKey>:<ServerKey>`. Equality
/// compares the keys in constant time.
#[derive(Clone)]
pub struct ScramVerifier {
    pub iterations: u32,
    pub salt: Vec<u8>,
    pub stored_key: [u8; 32],
    pub server_key: [u8; 32],
}

impl ScramVerifier {
    /// Whether two verifiers are the same, comparing the keys in constant
    /// time (what `==` does too; named so that code handling secrets says so).
    pub fn ct_eq(&self, other: &ScramVerifier) -> bool {
        self.eq(other)
    }
}

impl PartialEq for ScramVerifier {
    fn eq(&self, other: &Self) -> bool {
        let keys =
            self.stored_key.ct_eq(&other.stored_key) & self.server_key.ct_eq(&other.server_key);
        bool::from(keys) && self.iterations == other.iterations && self.salt == other.salt
    }
}

impl Eq for ScramVerifier {}

impl std::fmt::Debug for ScramVerifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ScramVerifier(..)") // never print key material
    }
}

impl ScramVerifier {
    /// Parses a stored verifier; `None` if the text is not one.
    pub fn parse(text: &str) -> Option<Self> {
        let rest = text.strip_prefix("SCRAM-SHA-256$")?;
        let (iter_salt, keys) = rest.split_once('$')?;
        let (iterations, salt) = iter_salt.split_once(':')?;
        let (stored, server) = keys.split_once(':')?;
        Some(ScramVerifier {
            iterations: iterations.parse().ok().filter(|i| *i > 0)?,
            salt: B64.decode(salt).ok()?,
            stored_key: B64.decode(stored).ok()?.try_into().ok()?,
            server_key: B64.decode(server).ok()?.try_into().ok()?,
        })
    }

    /// Computes a verifier with a fresh random salt from a plaintext password
    /// (normalised with SASLprep, as PostgreSQL does).
    pub fn from_password(password: &str) -> Self {
        let text = postgres_protocol::password::scram_sha_256(password.as_bytes());
        Self::parse(&text).expect("postgres-protocol produced a valid verifier")
    }

    /// A verifier no proof can match, used for users that do not exist so that
    /// the exchange looks the same as for a real user. The salt depends on the
    /// name only, so repeated attempts see the same salt.
    pub fn mock(user: &str, secret: &[u8]) -> Self {
        let mut h = Sha256::new();
        h.update(secret);
        h.update(user.as_bytes());
        let salt = h.finalize()[..16].to_vec();
        let mut stored_key = [0u8; 32];
        rand::thread_rng().fill_bytes(&mut stored_key);
        ScramVerifier {
            iterations: 4096,
            salt,
            stored_key,
            server_key: [0u8; 32],
        }
    }
}

/// Why a SCRAM exchange failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScramError {
    /// The client's message is not valid SCRAM (or asks for channel binding).
    #[error("malformed SCRAM message: {0}")]
    Malformed(&'static str),
    /// The client's final message carries a nonce other than the one agreed.
    #[error("SCRAM nonce mismatch")]
    WrongNonce,
    /// The proof does not match: wrong password.
    #[error("SCRAM proof is wrong")]
    WrongProof,
}

/// A SCRAM exchange after the server's first message.
pub struct ScramServer {
    verifier: ScramVerifier,
    gs2_header: String,
    client_first_bare: String,
    server_first: String,
    nonce: String,
}

impl ScramServer {
    /// Takes the client-first-message and returns the exchange with the
    /// server-first-message to send.
    pub fn start(
        verifier: ScramVerifier,
        client_first: &[u8],
    ) -> Result<(Self, String), ScramError> {
        let text =
            std::str::from_utf8(client_first).map_err(|_| ScramError::Malformed("not UTF-8"))?;
        let (flag, rest) = text
            .split_once(',')
            .ok_or(ScramError::Malformed("no GS2 header"))?;
        match flag {
            "n" | "y" => {}
            f if f.starts_with("p=") => {
                return Err(ScramError::Malformed("channel binding is not offered"))
            }
            _ => return Err(ScramError::Malformed("bad channel binding flag")),
        }
        let (authzid, bare) = rest
            .split_once(',')
            .ok_or(ScramError::Malformed("no GS2 header"))?;
        if !authzid.is_empty() && !authzid.starts_with("a=") {
            return Err(ScramError::Malformed("bad authorization identity"));
        }
        let mut attrs = bare.split(',');
        let user = attrs.next().ok_or(ScramError::Malformed("no user name"))?;
        if !user.starts_with("n=") {
            return Err(ScramError::Malformed("expected user name attribute"));
        }
        let client_nonce = attrs
            .next()
            .and_then(|a| a.strip_prefix("r="))
            .ok_or(ScramError::Malformed("expected nonce attribute"))?;
        if client_nonce.is_empty()
            || !client_nonce
                .bytes()
                .all(|b| (0x21..=0x7e).contains(&b) && b != b',')
        {
            return Err(ScramError::Malformed("bad client nonce"));
        }
        let mut server_nonce = [0u8; 18];
        rand::thread_rng().fill_bytes(&mut server_nonce);
        let nonce = format!("{client_nonce}{}", B64.encode(server_nonce));
        let server_first = format!(
            "r={nonce},s={},i={}",
            B64.encode(&verifier.salt),
            verifier.iterations
        );
        let gs2_header = format!("{flag},{authzid},");
        Ok((
            ScramServer {
                verifier,
                gs2_header,
                client_first_bare: bare.to_string(),
                server_first: server_first.clone(),
                nonce,
            },
            server_first,
        ))
    }

    /// Checks the client-final-message; returns the server-final-message to
    /// send on success. Also returns the ClientKey the client proved it has.
    pub fn finish(self, client_final: &[u8]) -> Result<(String, [u8; 32]), ScramError> {
        let text =
            std::str::from_utf8(client_final).map_err(|_| ScramError::Malformed("not UTF-8"))?;
        let (without_proof, proof) = text
            .rsplit_once(",p=")
            .ok_or(ScramError::Malformed("expected proof attribute"))?;
        let mut attrs = without_proof.split(',');
        let binding = attrs
            .next()
            .and_then(|a| a.strip_prefix("c="))
            .ok_or(ScramError::Malformed("expected channel binding attribute"))?;
        let binding = B64
            .decode(binding)
            .map_err(|_| ScramError::Malformed("bad channel binding"))?;
        if binding != self.gs2_header.as_bytes() {
            return Err(ScramError::Malformed("channel binding does not match"));
        }
        let nonce = attrs
            .next()
            .and_then(|a| a.strip_prefix("r="))
            .ok_or(ScramError::Malformed("expected nonce attribute"))?;
        if nonce.as_bytes().ct_eq(self.nonce.as_bytes()).unwrap_u8() == 0 {
            return Err(ScramError::WrongNonce);
        }
        let proof: [u8; 32] = B64
            .decode(proof)
            .ok()
            .and_then(|p| p.try_into().ok())
            .ok_or(ScramError::Malformed("bad proof"))?;

        let auth_message = format!(
            "{},{},{}",
            self.client_first_bare, self.server_first, without_proof
        );
        let client_signature = hmac(&self.verifier.stored_key, auth_message.as_bytes());
        let mut client_key = [0u8; 32];
        for i in 0..32 {
            client_key[i] = proof[i] ^ client_signature[i];
        }
        let stored: [u8; 32] = Sha256::digest(client_key).into();
        if stored.ct_eq(&self.verifier.stored_key).unwrap_u8() == 0 {
            return Err(ScramError::WrongProof);
        }
        let server_signature = hmac(&self.verifier.server_key, auth_message.as_bytes());
        Ok((format!("v={}", B64.encode(server_signature)), client_key))
    }
}

fn hmac(key: &[u8], data: &[u8]) -> [u8; 32] {
    let mut mac = HmacSha256::new_from_slice(key).expect("HMAC takes any key length");
    mac.update(data);
    mac.finalize().into_bytes().into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use postgres_protocol::authentication::sasl::{ChannelBinding, ScramSha256};

    fn exchange(stored_password: &str, client_password: &str) -> Result<(), ScramError> {
        let verifier = ScramVerifier::from_password(stored_password);
        let mut client =
            ScramSha256::new(client_password.as_bytes(), ChannelBinding::unsupported());
        let (server, first) = ScramServer::start(verifier, client.message())?;
        client.update(first.as_bytes()).unwrap();
        let (fin, _) = server.finish(client.message())?;
        client
            .finish(fin.as_bytes())
            .expect("client accepts server signature");
        Ok(())
    }

    #[test]
    fn right_password_passes_and_wrong_fails() {
        assert_eq!(exchange("s3cret", "s3cret"), Ok(()));
        assert_eq!(exchange("s3cret", "guess"), Err(ScramError::WrongProof));
    }

    #[test]
    fn verifier_round_trips() {
        let v = ScramVerifier::from_password("pw");
        let text = format!(
            "SCRAM-SHA-256${}:{}${}:{}",
            v.iterations,
            B64.encode(&v.salt),
            B64.encode(v.stored_key),
            B64.encode(v.server_key)
        );
        assert_eq!(ScramVerifier::parse(&text), Some(v));
        assert_eq!(ScramVerifier::parse("md5abc"), None);
    }

    #[test]
    fn wrong_nonce_and_garbage_are_refused() {
        let verifier = ScramVerifier::from_password("pw");
        let mut client = ScramSha256::new(b"pw", ChannelBinding::unsupported());
        let (server, first) = ScramServer::start(verifier.clone(), client.message()).unwrap();
        client.update(first.as_bytes()).unwrap();
        let tampered = String::from_utf8(client.message().to_vec())
            .unwrap()
            .replacen("r=", "r=X", 1);
        assert_eq!(
            server.finish(tampered.as_bytes()).err(),
            Some(ScramError::WrongNonce)
        );

        for bad in [
            &b"garbage"[..],
            b"p=tls-server-end-point,,n=,r=abc",
            b"n,,n=,r=",
            b"\xff",
        ] {
            assert!(matches!(
                ScramServer::start(verifier.clone(), bad),
                Err(ScramError::Malformed(_))
            ));
        }
    }

    #[test]
    fn replayed_final_message_fails_in_a_new_exchange() {
        let verifier = ScramVerifier::from_password("pw");
        let mut client = ScramSha256::new(b"pw", ChannelBinding::unsupported());
        let first_msg = client.message().to_vec();
        let (server, first) = ScramServer::start(verifier.clone(), &first_msg).unwrap();
        client.update(first.as_bytes()).unwrap();
        let final_msg = client.message().to_vec();
        assert!(server.finish(&final_msg).is_ok());
        // Same client messages against a new exchange: the server nonce differs.
        let (server2, _) = ScramServer::start(verifier, &first_msg).unwrap();
        assert_eq!(
            server2.finish(&final_msg).err(),
            Some(ScramError::WrongNonce)
        );
    }

    #[test]
    fn mock_verifier_rejects_everything() {
        let v = ScramVerifier::mock("nobody", b"k");
        let mut client = ScramSha256::new(b"", ChannelBinding::unsupported());
        let (server, first) = ScramServer::start(v, client.message()).unwrap();
        client.update(first.as_bytes()).unwrap();
        assert_eq!(
            server.finish(client.message()).err(),
            Some(ScramError::WrongProof)
        );
    }
}
