//! The keys of usher's security: client-facing TLS (`tls`), TLS towards
//! PostgreSQL (`databases.<name>.tls`), and the HBA rules (`auth.hba`), with
//! the checks that tie them together. Files named here (certificates, the
//! userlist, a pg_hba.conf) are read when the app is built, not here.

use super::{AuthMethod, Config, ConfigIssue, UserConfig};
use serde::{Deserialize, Deserializer};
use std::fmt;
use std::path::PathBuf;

impl fmt::Debug for UserConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        redacted_user(self, f)
    }
}

/// UserConfig's Debug: the password's presence, never its text.
pub fn redacted_user(u: &UserConfig, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    f.debug_struct("UserConfig")
        .field("password", &u.password.as_ref().map(|_| ".."))
        .field("pool_mode", &u.pool_mode)
        .field("pool_size", &u.pool_size)
        .finish()
}

/// Reads a password. serde's own error for a wrong type would quote the
/// value (`invalid type: integer `12345``), and an unquoted numeric password
/// is the usual way to get one; this error names only the expectation.
pub(super) fn secret_string<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    struct Secret;
    impl<'de> serde::de::Visitor<'de> for Secret {
        type Value = Option<String>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a string (quote passwords that look like numbers)")
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
            Ok(Some(v.to_string()))
        }
        fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_none<E: serde::de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<Self::Value, E> {
            Err(E::custom(EXPECTED_STRING))
        }
        fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<Self::Value, E> {
            Err(E::custom(EXPECTED_STRING))
        }
        fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<Self::Value, E> {
            Err(E::custom(EXPECTED_STRING))
        }
        fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<Self::Value, E> {
            Err(E::custom(EXPECTED_STRING))
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, _: A) -> Result<Self::Value, A::Error> {
            Err(serde::de::Error::custom(EXPECTED_STRING))
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(self, _: A) -> Result<Self::Value, A::Error> {
            Err(serde::de::Error::custom(EXPECTED_STRING))
        }
    }
    d.deserialize_any(Secret)
}

const EXPECTED_STRING: &str =
    "expected a string (quote passwords that look like numbers or booleans)";

/// Whether clients may or must use TLS.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TlsMode {
    /// SSLRequest is answered `N`.
    #[default]
    Disable,
    /// TLS when the client asks for it, plaintext otherwise.
    Allow,
    /// Plaintext clients are refused (cancel requests excepted).
    Require,
}

/// `tls`: the certificate usher shows clients, and the CA their
/// certificates must chain to.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// `allow` when the section is present; `disable` when it is absent.
    #[serde(default = "super::defaults::tls_mode")]
    pub mode: TlsMode,
    /// Certificate chain (PEM).
    pub cert: Option<PathBuf>,
    /// Private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: Option<PathBuf>,
    /// CA (PEM) for client certificates; without it none are asked for.
    pub ca: Option<PathBuf>,
}

/// TLS from usher to PostgreSQL, as libpq's sslmode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum ServerTlsMode {
    #[serde(rename = "disable")]
    Disable,
    /// TLS if the server offers it; its certificate is not checked.
    #[serde(rename = "prefer")]
    Prefer,
    /// TLS or no connection; the certificate is not checked.
    #[serde(rename = "require")]
    Require,
    /// TLS, a certificate that chains to `tls_ca` and names the host.
    #[serde(rename = "verify-full")]
    VerifyFull,
}

impl fmt::Display for ServerTlsMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ServerTlsMode::Disable => "disable",
            ServerTlsMode::Prefer => "prefer",
            ServerTlsMode::Require => "require",
            ServerTlsMode::VerifyFull => "verify-full",
        })
    }
}

/// The connection types of pg_hba.conf.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HbaType {
    /// Clients of the Unix-domain socket (`unix_socket_dir`).
    Local,
    Host,
    HostSsl,
    HostNoSsl,
}

/// What an HBA rule does with the connections it matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum HbaMethod {
    #[serde(rename = "trust")]
    Trust,
    #[serde(rename = "password")]
    Password,
    #[serde(rename = "md5")]
    Md5,
    #[serde(rename = "scram-sha-256")]
    ScramSha256,
    #[serde(rename = "cert")]
    Cert,
    /// Local rules only.
    #[serde(rename = "peer")]
    Peer,
    #[serde(rename = "reject")]
    Reject,
}

impl HbaMethod {
    /// The authentication method, or `None` for `reject`.
    pub fn auth_method(self) -> Option<AuthMethod> {
        Some(match self {
            HbaMethod::Trust => AuthMethod::Trust,
            HbaMethod::Password => AuthMethod::Password,
            HbaMethod::Md5 => AuthMethod::Md5,
            HbaMethod::ScramSha256 => AuthMethod::ScramSha256,
            HbaMethod::Cert => AuthMethod::Cert,
            HbaMethod::Peer => AuthMethod::Peer,
            HbaMethod::Reject => return None,
        })
    }
}

/// One rule of `auth.hba`, with pg_hba.conf's columns as keys. `database`
/// and `user` are comma-separated lists as in pg_hba.conf.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HbaRuleConfig {
    #[serde(rename = "type")]
    pub conn_type: HbaType,
    pub database: String,
    pub user: String,
    /// CIDR, a single address, or `all`; absent for `local`.
    pub address: Option<String>,
    pub method: HbaMethod,
    /// A `peer` rule's user name map (`auth.ident`).
    pub map: Option<String>,
}

/// Checks that the security keys fit together.
pub(super) fn validate(config: &Config) -> Result<(), ConfigIssue> {
    let err = |key: &str, message: String| ConfigIssue::new(key, message);
    let tls = &config.tls;
    if tls.mode != TlsMode::Disable {
        for (key, value) in [("tls.cert", &tls.cert), ("tls.key", &tls.key)] {
            if value.is_none() {
                return Err(err(
                    key,
                    "expected a PEM file: TLS is on (tls.mode is not disable)".into(),
                ));
            }
        }
    }
    let auth = &config.auth;
    let hba_cert = auth
        .hba
        .iter()
        .flatten()
        .any(|r| r.method == HbaMethod::Cert);
    if auth.method == AuthMethod::Cert || hba_cert {
        if tls.mode == TlsMode::Disable {
            return Err(err(
                "tls.mode",
                "certificate authentication needs TLS: expected allow or require".into(),
            ));
        }
        if tls.ca.is_none() {
            return Err(err(
                "tls.ca",
                "certificate authentication needs the CA file client certificates chain to".into(),
            ));
        }
    }
    for (name, db) in &config.databases {
        match (db.tls, &db.tls_ca) {
            (ServerTlsMode::VerifyFull, None) => {
                return Err(err(
                    &format!("databases.{name}.tls_ca"),
                    "expected a CA file (PEM): tls is verify-full".into(),
                ))
            }
            (mode, Some(_)) if mode != ServerTlsMode::VerifyFull => {
                return Err(err(
                    &format!("databases.{name}.tls_ca"),
                    format!("is only used with tls: verify-full (tls is {mode})"),
                ))
            }
            _ => {}
        }
    }
    if auth.query.is_some() && auth.user.is_none() {
        return Err(err(
            "auth.query",
            "needs auth.user, the user that runs it".into(),
        ));
    }
    if let Some(user) = &auth.user {
        let Some(u) = config.users.get(user) else {
            return Err(err(
                "auth.user",
                format!("expected a user listed under `users`, got `{user}`"),
            ));
        };
        if let Some(p) = &u.password {
            let hashed = p.starts_with("SCRAM-SHA-256$") || (p.len() == 35 && p.starts_with("md5"));
            if hashed {
                return Err(err(
                    &format!("users.{user}.password"),
                    "auth.user logs in to PostgreSQL itself: expected a plaintext password, not a hash"
                        .into(),
                ));
            }
        }
    }
    if let Some(db) = &auth.dbname {
        if config.listed_database(db).is_none() {
            return Err(err(
                "auth.dbname",
                format!("expected a database listed under `databases`, got `{db}`"),
            ));
        }
    }
    if !super::usable_seconds(auth.cache_ttl, true) {
        return Err(err(
            "auth.cache_ttl",
            "expected a number of seconds (0 caches nothing; at most a century)".into(),
        ));
    }
    if auth.method == AuthMethod::Peer && config.unix_socket_dir.is_none() {
        return Err(err(
            "auth.method",
            "peer authentication is only supported on local sockets: set unix_socket_dir".into(),
        ));
    }
    if auth.ident.is_some() && auth.ident_file.is_some() {
        return Err(err(
            "auth.ident_file",
            "expected either auth.ident or auth.ident_file, not both".into(),
        ));
    }
    if auth.hba.is_some() && auth.hba_file.is_some() {
        return Err(err(
            "auth.hba_file",
            "expected either auth.hba or auth.hba_file, not both".into(),
        ));
    }
    if config.max_auth_clients == 0 {
        return Err(err(
            "max_auth_clients",
            "expected a number greater than 0".into(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::config::{Config, TlsMode};

    fn key_of(yaml: &str) -> String {
        Config::from_yaml(yaml, "s.yaml").unwrap_err().key
    }

    #[test]
    fn tls_section_defaults_to_allow_and_needs_cert_and_key() {
        let c = Config::from_yaml("{}", "s.yaml").unwrap();
        assert_eq!(c.tls.mode, TlsMode::Disable);
        assert_eq!(key_of("tls: { key: k.pem }\n"), "tls.cert");
        let c = Config::from_yaml("tls: { cert: c.pem, key: k.pem }\n", "s.yaml").unwrap();
        assert_eq!(c.tls.mode, TlsMode::Allow);
    }

    #[test]
    fn cert_auth_needs_tls_and_a_ca() {
        assert_eq!(key_of("auth: { method: cert }\n"), "tls.mode");
        assert_eq!(
            key_of("tls: { cert: c, key: k }\nauth: { method: cert }\n"),
            "tls.ca"
        );
        assert_eq!(
            key_of("tls: { cert: c, key: k }\nauth: { hba: [ { type: hostssl, database: all, user: all, address: all, method: cert } ] }\n"),
            "tls.ca"
        );
    }

    #[test]
    fn server_tls_ca_goes_with_verify_full() {
        assert_eq!(
            key_of("databases: { a: { tls: verify-full } }\n"),
            "databases.a.tls_ca"
        );
        assert_eq!(
            key_of("databases: { a: { tls: require, tls_ca: ca.pem } }\n"),
            "databases.a.tls_ca"
        );
        assert_eq!(
            key_of("databases: { a: { tls: sometimes } }\n"),
            "databases.a.tls"
        );
    }

    #[test]
    fn auth_query_needs_a_listed_user_with_a_plaintext_password() {
        assert_eq!(key_of("auth: { query: SELECT 1 }\n"), "auth.query");
        assert_eq!(key_of("auth: { user: nobody }\n"), "auth.user");
        let scram = postgres_protocol::password::scram_sha_256(b"pw");
        assert_eq!(
            key_of(&format!(
                "auth: {{ user: a }}\nusers: {{ a: {{ password: \"{scram}\" }} }}\n"
            )),
            "users.a.password"
        );
        let c =
            Config::from_yaml("auth: { user: a }\nusers: { a: { password: pw } }\n", "s").unwrap();
        assert!(c.auth.effective_query().unwrap().contains("pg_shadow"));
        assert_eq!(key_of("auth: { dbname: x }\n"), "auth.dbname");
    }

    #[test]
    fn a_wrongly_typed_password_is_not_quoted_and_debug_hides_it() {
        let e = Config::from_yaml("users: { u: { password: 918273645 } }\n", "s.yaml").unwrap_err();
        assert_eq!(e.key, "users.u.password");
        assert!(!e.to_string().contains("918273645"), "{e}");
        assert!(e.message.contains("quote"), "{e}");
        let c =
            Config::from_yaml("users: { u: { password: \"hunter22\" }, v: {} }\n", "s").unwrap();
        assert_eq!(c.users["u"].password.as_deref(), Some("hunter22"));
        assert_eq!(c.users["v"].password, None);
        assert!(!format!("{c:?}").contains("hunter22"));
    }

    #[test]
    fn hba_rules_parse_with_pg_hba_columns() {
        let c = Config::from_yaml(
            "auth: { hba: [ { type: hostssl, database: all, user: carol, address: 0.0.0.0/0, method: reject } ] }\n",
            "s.yaml",
        )
        .unwrap();
        assert_eq!(c.auth.hba.unwrap()[0].user, "carol");
        assert_eq!(
            key_of("auth: { hba: [ { type: host, database: all, user: all, method: ldap } ] }\n"),
            "auth.hba[0].method"
        );
        assert_eq!(
            key_of("auth: { hba: [], hba_file: pg_hba.conf }\n"),
            "auth.hba_file"
        );
    }

    #[test]
    fn peer_needs_the_unix_socket_and_one_source_of_maps() {
        assert_eq!(key_of("auth: { method: peer }\n"), "auth.method");
        Config::from_yaml(
            "unix_socket_dir: /run/usher\nauth: { method: peer }\n",
            "s.yaml",
        )
        .unwrap();
        assert_eq!(
            key_of("auth: { ident: [], ident_file: pg_ident.conf }\n"),
            "auth.ident_file"
        );
    }
}
