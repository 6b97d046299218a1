//! The client side of SCRAM-SHA-256 from keys instead of a password: SCRAM
//! pass-through.
//!
//! When a client proves its password to usher with SCRAM, the proof yields
//! its ClientKey. With that key and the stored verifier (salt, iterations,
//! StoredKey, ServerKey), usher can log in to PostgreSQL as the client:
//! `ClientProof = ClientKey XOR HMAC(StoredKey, AuthMessage)`, and the
//! server's signature is checked with the ServerKey. No password is needed,
//! and none is stored. The server must hold the same verifier (same salt and
//! iterations) that usher checked the client against.

use super::scram::ScramVerifier;
use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// What usher needs to log in with SCRAM as a client without its password.
#[derive(Clone)]
pub struct ScramKeys {
    pub client_key: [u8; 32],
    pub verifier: ScramVerifier,
}

impl std::fmt::Debug for ScramKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ScramKeys(..)") // never print key material
    }
}

/// Why a pass-through exchange failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScramClientError {
    #[error("malformed SCRAM message from the server: {0}")]
    Malformed(&'static str),
    #[error("the server's SCRAM nonce does not extend usher's")]
    WrongNonce,
    /// The server's salt or iteration count differ from the verifier usher
    /// checked the client against: the password was changed on one side.
    #[error("the server's SCRAM salt or iteration count differ from the verifier usher has (was the password changed?)")]
    VerifierMismatch,
    #[error("the server's SCRAM signature is wrong")]
    WrongSignature,
    #[error("the server refused the SCRAM proof: {0}")]
    ServerError(String),
}

/// A pass-through exchange, one step at a time: [`ScramClient::message`]
/// after [`ScramClient::new`] and after [`ScramClient::update`], then
/// [`ScramClient::finish`] with the server's final message.
pub struct ScramClient {
    keys: ScramKeys,
    nonce: String,
    message: Vec<u8>,
    auth_message: Option<String>,
}

impl ScramClient {
    pub fn new(keys: ScramKeys) -> Self {
        let mut raw = [0u8; 18];
        rand::thread_rng().fill_bytes(&mut raw);
        let nonce = B64.encode(raw);
        // PostgreSQL takes the user name from the startup packet, so `n=` is empty.
        let message = format!("n,,n=,r={nonce}").into_bytes();
        ScramClient {
            keys,
            nonce,
            message,
            auth_message: None,
        }
    }

    /// The message to send now (client-first, then client-final).
    pub fn message(&self) -> &[u8] {
        &self.message
    }

    /// Takes the server-first-message and prepares the client-final-message.
    pub fn update(&mut self, server_first: &[u8]) -> Result<(), ScramClientError> {
        let text = std::str::from_utf8(server_first)
            .map_err(|_| ScramClientError::Malformed("not UTF-8"))?;
        let mut attrs = text.split(',');
        let nonce = attrs
            .next()
            .and_then(|a| a.strip_prefix("r="))
            .ok_or(ScramClientError::Malformed("expected nonce attribute"))?;
        let salt = attrs
            .next()
            .and_then(|a| a.strip_prefix("s="))
            .ok_or(ScramClientError::Malformed("expected salt attribute"))?;
        let iterations = attrs
            .next()
            .and_then(|a| a.strip_prefix("i="))
            .ok_or(ScramClientError::Malformed("expected iteration attribute"))?;
        if !nonce.starts_with(&self.nonce) || nonce.len() == self.nonce.len() {
            return Err(ScramClientError::WrongNonce);
        }
        let salt = B64
            .decode(salt)
            .map_err(|_| ScramClientError::Malformed("bad salt"))?;
        let iterations: u32 = iterations
            .parse()
            .map_err(|_| ScramClientError::Malformed("bad iteration count"))?;
        let v = &self.keys.verifier;
        if salt != v.salt || iterations != v.iterations {
            return Err(ScramClientError::VerifierMismatch);
        }
        // The GS2 header "n,," base64-encoded: no channel binding.
        let without_proof = format!("c=biws,r={nonce}");
        let first_bare = std::str::from_utf8(&self.message[3..]).expect("built as UTF-8");
        let auth_message = format!("{first_bare},{text},{without_proof}");
        let signature = hmac(&v.stored_key, auth_message.as_bytes());
        let mut proof = [0u8; 32];
        for (p, (k, s)) in proof
            .iter_mut()
            .zip(self.keys.client_key.iter().zip(signature))
        {
            *p = k ^ s;
        }
        self.message = format!("{without_proof},p={}", B64.encode(proof)).into_bytes();
        self.auth_message = Some(auth_message);
        Ok(())
    }

    /// Checks the server-final-message: the server knows the verifier too.
    pub fn finish(self, server_final: &[u8]) -> Result<(), ScramClientError> {
        let auth_message = self.auth_message.ok_or(ScramClientError::Malformed(
            "final message before the first",
        ))?;
        let text = std::str::from_utf8(server_final)
            .map_err(|_| ScramClientError::Malformed("not UTF-8"))?;
        if let Some(e) = text.strip_prefix("e=") {
            return Err(ScramClientError::ServerError(e.to_string()));
        }
        let signature = text
            .split(',')
            .next()
            .and_then(|a| a.strip_prefix("v="))
            .and_then(|v| B64.decode(v).ok())
            .ok_or(ScramClientError::Malformed("expected verifier attribute"))?;
        let expected = hmac(&self.keys.verifier.server_key, auth_message.as_bytes());
        if expected.ct_eq(signature.as_slice()).unwrap_u8() == 0 {
            return Err(ScramClientError::WrongSignature);
        }
        Ok(())
    }
}

impl ScramKeys {
    /// True when `client_key` belongs to `verifier` (StoredKey = H(ClientKey)).
    pub fn consistent(&self) -> bool {
        let stored: [u8; 32] = Sha256::digest(self.client_key).into();
        stored.ct_eq(&self.verifier.stored_key).into()
    }
}

fn hmac(key: &[u8], data: &[u8]) -> [u8; 32] {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes any key length");
    mac.update(data);
    mac.finalize().into_bytes().into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::scram::ScramServer;
    use postgres_protocol::authentication::sasl::{ChannelBinding, ScramSha256};

    /// Logs in to usher's own SCRAM server with a password, then passes the
    /// recovered ClientKey on to a second server with the same verifier.
    fn keys_from_login(verifier: &ScramVerifier, password: &str) -> ScramKeys {
        let mut client = ScramSha256::new(password.as_bytes(), ChannelBinding::unsupported());
        let (server, first) = ScramServer::start(verifier.clone(), client.message()).unwrap();
        client.update(first.as_bytes()).unwrap();
        let (_, client_key) = server.finish(client.message()).unwrap();
        ScramKeys {
            client_key,
            verifier: verifier.clone(),
        }
    }

    #[test]
    fn pass_through_logs_in_where_the_server_has_the_same_verifier() {
        let verifier = ScramVerifier::from_password("s3cret");
        let keys = keys_from_login(&verifier, "s3cret");
        assert!(keys.consistent());
        let mut client = ScramClient::new(keys);
        let (server, first) = ScramServer::start(verifier, client.message()).unwrap();
        client.update(first.as_bytes()).unwrap();
        let (fin, _) = server
            .finish(client.message())
            .expect("server accepts the proof");
        client
            .finish(fin.as_bytes())
            .expect("client accepts the signature");
    }

    #[test]
    fn a_different_verifier_on_the_server_is_detected() {
        let ours = ScramVerifier::from_password("s3cret");
        let keys = keys_from_login(&ours, "s3cret");
        // Same password, new salt: the server's verifier is not ours.
        let theirs = ScramVerifier::from_password("s3cret");
        let mut client = ScramClient::new(keys);
        let (_, first) = ScramServer::start(theirs, client.message()).unwrap();
        assert_eq!(
            client.update(first.as_bytes()),
            Err(ScramClientError::VerifierMismatch)
        );
    }

    #[test]
    fn a_forged_server_signature_and_a_foreign_nonce_are_refused() {
        let verifier = ScramVerifier::from_password("pw");
        let keys = keys_from_login(&verifier, "pw");
        let mut client = ScramClient::new(keys.clone());
        let (_, first) = ScramServer::start(verifier.clone(), client.message()).unwrap();
        client.update(first.as_bytes()).unwrap();
        let forged = format!("v={}", B64.encode([7u8; 32]));
        assert_eq!(
            client.finish(forged.as_bytes()),
            Err(ScramClientError::WrongSignature)
        );

        let mut client = ScramClient::new(keys);
        let salt = B64.encode(&verifier.salt);
        let foreign = format!("r=someone-elses-nonce,s={salt},i={}", verifier.iterations);
        assert_eq!(
            client.update(foreign.as_bytes()),
            Err(ScramClientError::WrongNonce)
        );
        assert!(matches!(
            client.update(b"\xff"),
            Err(ScramClientError::Malformed(_))
        ));
    }
}
