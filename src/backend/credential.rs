//! What usher logs in to PostgreSQL with for a pool's user: a plaintext
//! password, an md5 hash (answers md5 challenges as PgBouncer does), or the
//! SCRAM keys a client's own login yielded (pass-through).

use crate::protocol::ct_eq;
use crate::protocol::scram_client::ScramKeys;
use parking_lot::RwLock;
use std::sync::Arc;

/// One way to log in to the server. Debug never shows the secret, and
/// equality compares secrets in constant time.
#[derive(Clone, Default)]
pub enum ServerCredential {
    /// Nothing: only a server that trusts usher lets it in.
    #[default]
    None,
    Password(String),
    /// `md5` + md5(password + user), as stored in pg_authid.
    Md5(String),
    Scram(ScramKeys),
}

impl std::fmt::Debug for ServerCredential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ServerCredential::None => "ServerCredential::None",
            ServerCredential::Password(_) => "ServerCredential::Password(..)",
            ServerCredential::Md5(_) => "ServerCredential::Md5(..)",
            ServerCredential::Scram(_) => "ServerCredential::Scram(..)",
        })
    }
}

impl PartialEq for ServerCredential {
    fn eq(&self, other: &Self) -> bool {
        use ServerCredential::*;
        match (self, other) {
            (None, None) => true,
            (Password(a), Password(b)) | (Md5(a), Md5(b)) => ct_eq(a.as_bytes(), b.as_bytes()),
            (Scram(a), Scram(b)) => ct_eq(&a.client_key, &b.client_key) && a.verifier == b.verifier,
            _ => false,
        }
    }
}

/// A pool's credential, shared by its clones of the target. A client's
/// login may bring a newer one (the password changed on the server, so the
/// cached verifier and the ClientKey changed); it then replaces the old.
#[derive(Clone, Default)]
pub struct SharedCredential(Arc<RwLock<ServerCredential>>);

impl std::fmt::Debug for SharedCredential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.get().fmt(f)
    }
}

impl SharedCredential {
    pub fn new(credential: ServerCredential) -> Self {
        SharedCredential(Arc::new(RwLock::new(credential)))
    }

    pub fn get(&self) -> ServerCredential {
        self.0.read().clone()
    }

    /// Keeps `credential` if it says something and differs from the current
    /// one. `None` never replaces a credential.
    pub fn offer(&self, credential: ServerCredential) {
        if credential == ServerCredential::None {
            return;
        }
        if *self.0.read() == credential {
            return;
        }
        *self.0.write() = credential;
    }
}
