//! Where usher finds a user's secret, in order: the users listed in the
//! config, `auth.file` (PgBouncer's userlist.txt), then `auth.query` run on
//! the server as `auth.user` (cached briefly). A user listed in the config
//! without a password (e.g. only to set its pool size) still gets its secret
//! from the file or the query.

use super::auth_query::AuthQuery;
use super::{userlist, Secret};
use crate::config::{Config, ConfigError};
use crate::protocol::PgError;
use crate::tls::ServerTls;
use std::collections::HashMap;

/// What usher knows of one user.
#[derive(Debug, Clone, Default)]
pub struct UserLookup {
    pub exists: bool,
    /// `None` for unknown users and users without a password.
    pub secret: Option<Secret>,
}

#[derive(Debug)]
pub struct Credentials {
    /// Users in the config, with their password if they have one.
    listed: HashMap<String, Option<Secret>>,
    file: HashMap<String, Secret>,
    query: Option<AuthQuery>,
}

impl Credentials {
    /// Parses the config's passwords and reads `auth.file`.
    pub fn load(
        config: &Config,
        server_tls: &HashMap<String, ServerTls>,
    ) -> Result<Credentials, ConfigError> {
        let listed = config
            .users
            .iter()
            .map(|(name, u)| (name.clone(), u.password.as_deref().map(Secret::parse)))
            .collect();
        let file = match &config.auth.file {
            None => HashMap::new(),
            Some(path) => {
                let err = |message: String| ConfigError {
                    file: config.source.clone(),
                    key: "auth.file".into(),
                    message,
                };
                let text = std::fs::read_to_string(path)
                    .map_err(|e| err(format!("cannot read {}: {e}", path.display())))?;
                userlist::parse(&text).map_err(|e| err(format!("{}: {e}", path.display())))?
            }
        };
        Ok(Credentials {
            listed,
            file,
            query: AuthQuery::from_config(config, server_tls),
        })
    }

    /// Whether any user can be found: one listed in the config, in the auth
    /// file, or an auth query to ask.
    pub fn any(&self) -> bool {
        !self.listed.is_empty() || !self.file.is_empty() || self.query.is_some()
    }

    /// Finds `user` for a client of `database`. Fails only when the auth
    /// query had to run and could not.
    pub async fn lookup(&self, database: &str, user: &str) -> Result<UserLookup, PgError> {
        let listed = self.listed.get(user);
        if let Some(Some(secret)) = listed {
            return Ok(found(secret.clone()));
        }
        if let Some(secret) = self.file.get(user) {
            return Ok(found(secret.clone()));
        }
        let answer = match &self.query {
            Some(q) => q.lookup(database, user).await?,
            None => None,
        };
        Ok(UserLookup {
            exists: listed.is_some() || answer.is_some(),
            secret: answer.flatten(),
        })
    }

    /// True for users named in the config or in `auth.file` (no query).
    pub fn is_listed(&self, user: &str) -> bool {
        self.listed.contains_key(user) || self.file.contains_key(user)
    }

    /// Whether `user` is a member of `role`, asked of the server through
    /// `auth.user`; always false without it.
    pub async fn is_member(&self, database: &str, user: &str, role: &str) -> bool {
        match &self.query {
            Some(q) => q.is_member(database, user, role).await,
            None => false,
        }
    }
}

fn found(secret: Secret) -> UserLookup {
    UserLookup {
        exists: true,
        secret: Some(secret),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn config_then_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("userlist.txt");
        std::fs::write(&path, "\"bob\" \"bob-pw\"\n\"carol\" \"carol-pw\"\n").unwrap();
        let yaml = format!(
            "auth: {{ file: {} }}\nusers: {{ alice: {{ password: a }}, carol: {{ pool_size: 3 }} }}\n",
            path.display()
        );
        let config = Config::from_yaml(&yaml, "c.yaml").unwrap();
        let creds = Credentials::load(&config, &HashMap::new()).unwrap();
        for (user, password) in [("alice", "a"), ("bob", "bob-pw"), ("carol", "carol-pw")] {
            let l = creds.lookup("app", user).await.unwrap();
            assert!(l.exists, "{user}");
            assert!(l.secret.unwrap().check_cleartext(user, password), "{user}");
        }
        let nobody = creds.lookup("app", "nobody").await.unwrap();
        assert!(!nobody.exists && nobody.secret.is_none());
        assert!(creds.is_listed("bob") && !creds.is_listed("nobody"));
    }

    #[test]
    fn a_bad_file_names_the_key_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("userlist.txt");
        std::fs::write(&path, "\"bob\" \"x\"\nbroken\n").unwrap();
        let yaml = format!("auth: {{ file: {} }}\n", path.display());
        let config = Config::from_yaml(&yaml, "c.yaml").unwrap();
        let e = Credentials::load(&config, &HashMap::new()).unwrap_err();
        assert_eq!((e.file.as_str(), e.key.as_str()), ("c.yaml", "auth.file"));
        assert!(e.message.contains("line 2"), "{}", e.message);
    }
}
