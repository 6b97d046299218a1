//! The PostgreSQL v3 wire format as far as usher needs it.
//!
//! - [`startup`]: the untyped first packet (startup, SSL, GSSENC, cancel).
//! - [`messages`]: building the backend messages usher itself sends, and
//!   reading whole typed messages during login.
//! - [`frames`]: walking a byte stream message by message while forwarding,
//!   without buffering large messages whole.
//! - [`error`]: PostgreSQL-style errors with SQLSTATEs.
//! - [`scram`]: the server side of SCRAM-SHA-256.
//! - [`scram_client`]: the client side from keys (SCRAM pass-through).
//! - [`tags`]: the protocol's one-byte codes, named.
//! - [`cancel_key`]: where the peer id sits in the secret of a cancel key.

pub mod cancel_key;
pub mod error;
pub mod frames;
pub mod messages;
pub mod scram;
pub mod scram_client;
pub mod startup;
pub mod tags;

pub use error::{PgError, Severity};

/// Compares two byte strings without an early exit on the first
/// difference: secrets (passwords, hashes, SCRAM proofs) are compared so.
pub fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    use subtle::ConstantTimeEq;
    a.ct_eq(b).into()
}
