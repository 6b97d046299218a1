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
    /// SCRAM keys and the cleartext password they come from: the client
    /// gave usher its password in cleartext (auth method `password`), so a
    /// server asking for a cleartext or md5 password can be answered too.
    ScramAndPassword(ScramKeys, String),
}

impl std::fmt::Debug for ServerCredential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ServerCredential::None => "ServerCredential::None",
            ServerCredential::Password(_) => "ServerCredential::Password(..)",
            ServerCredential::Md5(_) => "ServerCredential::Md5(..)",
            ServerCredential::Scram(_) => "ServerCredential::Scram(..)",
            ServerCredential::ScramAndPassword(..) => "ServerCredential::ScramAndPassword(..)",
        })
    }
}

impl PartialEq for ServerCredential {
    fn eq(&self, other: &Self) -> bool {
        use ServerCredential::*;
        match (self, other) {
            (None, None) => true,
            (Password(a), Password(b)) | (Md5(a), Md5(b)) => ct_eq(a.as_bytes(), b.as_bytes()),
            (Scram(a), Scram(b)) => same_keys(a, b),
            (ScramAndPassword(a, p), ScramAndPassword(b, q)) => {
                same_keys(a, b) && ct_eq(p.as_bytes(), q.as_bytes())
            }
            _ => false,
        }
    }
}

fn same_keys(a: &ScramKeys, b: &ScramKeys) -> bool {
    ct_eq(&a.client_key, &b.client_key) && a.verifier == b.verifier
}

impl ServerCredential {
    /// The cleartext password, if usher has it.
    pub fn password(&self) -> Option<&str> {
        match self {
            ServerCredential::Password(p) | ServerCredential::ScramAndPassword(_, p) => Some(p),
            _ => None,
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
    /// one. `None` never replaces a credential, and SCRAM keys do not replace
    /// the same keys held with their cleartext password (a SCRAM client's
    /// login after a `password` client's must not lose the password).
    pub fn offer(&self, credential: ServerCredential) {
        if credential == ServerCredential::None {
            return;
        }
        {
            let current = self.0.read();
            if *current == credential {
                return;
            }
            if let (ServerCredential::ScramAndPassword(held, _), ServerCredential::Scram(offered)) =
                (&*current, &credential)
            {
                if same_keys(held, offered) {
                    return;
                }
            }
        }
        *self.0.write() = credential;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(k: u8) -> ScramKeys {
        let verifier = crate::protocol::scram::ScramVerifier {
            iterations: 4096,
            salt: b"salt".to_vec(),
            stored_key: [3; 32],
            server_key: [4; 32],
        };
        ScramKeys {
            client_key: [k; 32],
            verifier,
        }
    }

    #[test]
    fn the_same_scram_keys_do_not_replace_them_with_their_password() {
        let shared =
            SharedCredential::new(ServerCredential::ScramAndPassword(keys(1), "pw".into()));
        shared.offer(ServerCredential::Scram(keys(1)));
        assert_eq!(shared.get().password(), Some("pw"));
        // New keys (the password changed): the old password is gone.
        shared.offer(ServerCredential::Scram(keys(2)));
        assert_eq!(shared.get(), ServerCredential::Scram(keys(2)));
    }
}
