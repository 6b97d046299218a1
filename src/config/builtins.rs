//! The keys of the built-in hooks: `auth_monitor` (login auditing and
//! lockout) and `blocking` (connection rules and maintenance mode).
//!
//! Only shapes and numeric limits are checked here; globs, CIDRs, SQLSTATEs
//! and the need for `hooks.query` are checked when the rules are compiled
//! (`hooks::builtin`), with errors that name the key all the same.

use super::ConfigIssue;
use serde::{Deserialize, Deserializer};
use std::fmt;
use std::path::PathBuf;

/// `auth_monitor:`: pg_auth_mon's counters, kept across restarts, and the
/// lockout against password guessing. Absent: off.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthMonitorConfig {
    #[serde(default = "defaults::enabled")]
    pub enabled: bool,
    /// Where the counters are kept across restarts; none: memory only.
    pub state_file: Option<PathBuf>,
    /// Seconds between writes of the state file (only when something changed).
    #[serde(default = "defaults::save_interval_s")]
    pub save_interval_s: f64,
    /// Role rows kept; beyond it the least recently tried role is dropped.
    #[serde(default = "defaults::max_roles")]
    pub max_roles: usize,
    /// Unknown user names kept; beyond it the least tried name is dropped.
    #[serde(default = "defaults::max_unknown_names")]
    pub max_unknown_names: usize,
    /// Client addresses with failures kept; beyond it the one with the
    /// fewest failures is dropped.
    #[serde(default = "defaults::max_addresses")]
    pub max_addresses: usize,
    /// Off when absent.
    pub lockout: Option<LockoutConfig>,
    /// A PostgreSQL database every instance records its attempts in, so
    /// that the lockout and SHOW AUTH_MON are cluster-wide. Absent: each
    /// instance counts alone.
    pub store: Option<AuthStoreConfig>,
}

/// `auth_monitor.store`: where instances share their counts. Usher logs in
/// as `user` (listed under `users` with a plaintext password, as for
/// `hooks.query`) to the servers of `database` (a key of `databases`:
/// its hosts, dbname and TLS).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthStoreConfig {
    pub database: String,
    pub user: String,
    /// The schema of the store's tables (it must exist).
    #[serde(default = "defaults::store_schema")]
    pub schema: String,
    /// `CREATE TABLE IF NOT EXISTS` at each connection; false: the tables
    /// are made beforehand (sql/auth_monitor_store.sql).
    #[serde(default = "defaults::store_create_tables")]
    pub create_tables: bool,
    /// Seconds between writes of the attempts counted since the last one.
    #[serde(default = "defaults::store_flush_interval_s")]
    pub flush_interval_s: f64,
    /// Seconds between reads of the cluster-wide view (the lockout's
    /// counts and locks, SHOW AUTH_MON's totals).
    #[serde(default = "defaults::store_refresh_interval_s")]
    pub refresh_interval_s: f64,
    /// Seconds a connection, a flush or a refresh may take.
    #[serde(default = "defaults::store_timeout_s")]
    pub timeout_s: f64,
    /// Distinct keys (roles, names, addresses, time slices) waiting to be
    /// written; beyond it new ones are dropped (counted, logged).
    #[serde(default = "defaults::store_max_pending")]
    pub max_pending: usize,
}

/// `auth_monitor.lockout`: after `max_failures` wrong passwords (or unknown
/// user names) within `window_s`, further logins of that user, or from that
/// address, are refused for `duration_s`, before any password is checked.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LockoutConfig {
    #[serde(default = "defaults::max_failures")]
    pub max_failures: u32,
    #[serde(default = "defaults::window_s")]
    pub window_s: f64,
    #[serde(default = "defaults::duration_s")]
    pub duration_s: f64,
    /// Lock the user name that failed.
    #[serde(default = "defaults::by_role")]
    pub by_role: bool,
    /// Lock the client address that failed.
    #[serde(default = "defaults::by_address")]
    pub by_address: bool,
}

/// `blocking:`: ordered allow/deny rules and maintenance mode, run at
/// client_connection.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlockingConfig {
    #[serde(default)]
    pub rules: Vec<BlockRuleConfig>,
    /// Maintenance mode from the start: only members of this role get in.
    pub maintenance: Option<MaintenanceConfig>,
}

/// What a matching rule does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BlockAction {
    Allow,
    Deny,
}

impl fmt::Display for BlockAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BlockAction::Allow => "allow",
            BlockAction::Deny => "deny",
        })
    }
}

/// One rule. Every condition given must hold (an empty list is no
/// condition); within a list, any entry may match.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlockRuleConfig {
    /// For SHOW BLOCKING, logs and metrics; default `rule<N>` (from 1).
    pub name: Option<String>,
    pub action: BlockAction,
    /// Role names or globs (`*`, `?`).
    #[serde(default, deserialize_with = "names")]
    pub users: Vec<String>,
    /// Members of any of these roles (directly or through other roles).
    #[serde(default, deserialize_with = "names")]
    pub member_of: Vec<String>,
    /// Database names (as clients ask for them) or globs.
    #[serde(default, deserialize_with = "names")]
    pub databases: Vec<String>,
    /// Client addresses: CIDRs or single addresses.
    #[serde(default, deserialize_with = "names")]
    pub addresses: Vec<String>,
    /// application_name globs.
    #[serde(default, deserialize_with = "names")]
    pub application_names: Vec<String>,
    /// true: TLS clients only; false: plaintext clients only.
    pub tls: Option<bool>,
    pub message: Option<String>,
    /// Default 28000 (invalid_authorization_specification).
    #[serde(default, deserialize_with = "sqlstate")]
    pub sqlstate: Option<String>,
    pub detail: Option<String>,
    pub hint: Option<String>,
}

/// `blocking.maintenance`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MaintenanceConfig {
    pub member_of: String,
    pub message: Option<String>,
    /// Default 57P03 (cannot_connect_now).
    #[serde(default, deserialize_with = "sqlstate")]
    pub sqlstate: Option<String>,
    pub hint: Option<String>,
}

/// A name or a list of names.
fn names<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    struct Names;
    impl<'de> serde::de::Visitor<'de> for Names {
        type Value = Vec<String>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a string or a list of strings")
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
            Ok(vec![v.to_string()])
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(
            self,
            mut seq: A,
        ) -> Result<Self::Value, A::Error> {
            let mut out = Vec::new();
            while let Some(s) = seq.next_element::<String>()? {
                out.push(s);
            }
            Ok(out)
        }
    }
    d.deserialize_any(Names)
}

/// A SQLSTATE: a string, or digits YAML read as a number (`28000`, or
/// `08006`, which loses its leading zero on the way).
fn sqlstate<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    struct Code;
    impl<'de> serde::de::Visitor<'de> for Code {
        type Value = Option<String>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a SQLSTATE such as 28000 or 57P03")
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
            Ok(Some(v.to_string()))
        }
        fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Self::Value, E> {
            Ok(Some(format!("{v:05}")))
        }
    }
    d.deserialize_any(Code)
}

/// Numeric limits of `auth_monitor`.
pub(super) fn validate(m: &AuthMonitorConfig) -> Result<(), ConfigIssue> {
    let err = |key: &str, message: &str| ConfigIssue::new(key, message).under("auth_monitor");
    let seconds = |v: f64| super::usable_seconds(v, false);
    if !seconds(m.save_interval_s) {
        return Err(err(
            "save_interval_s",
            "expected a positive number of seconds (at most a century)",
        ));
    }
    for (key, v) in [
        ("max_roles", m.max_roles),
        ("max_unknown_names", m.max_unknown_names),
        ("max_addresses", m.max_addresses),
    ] {
        if v == 0 || v > 1_000_000 {
            return Err(err(key, "expected a number from 1 to 1000000"));
        }
    }
    if let Some(l) = &m.lockout {
        if l.max_failures == 0 {
            return Err(err(
                "lockout.max_failures",
                "expected a number greater than 0",
            ));
        }
        for (key, v) in [("window_s", l.window_s), ("duration_s", l.duration_s)] {
            if !seconds(v) {
                return Err(err(
                    &format!("lockout.{key}"),
                    "expected a positive number of seconds (at most a century)",
                ));
            }
        }
        if !l.by_role && !l.by_address {
            return Err(err(
                "lockout",
                "by_role and by_address are both false: remove `lockout` to turn it off",
            ));
        }
    }
    if let Some(s) = &m.store {
        for (key, v) in [
            ("flush_interval_s", s.flush_interval_s),
            ("refresh_interval_s", s.refresh_interval_s),
            ("timeout_s", s.timeout_s),
        ] {
            if !seconds(v) {
                return Err(err(
                    &format!("store.{key}"),
                    "expected a positive number of seconds (at most a century)",
                ));
            }
        }
        if s.max_pending == 0 || s.max_pending > 10_000_000 {
            return Err(err(
                "store.max_pending",
                "expected a number from 1 to 10000000",
            ));
        }
        if !is_identifier(&s.schema) {
            return Err(err(
                "store.schema",
                "expected a schema name: letters, digits, `_` or `$`, not starting with a digit, at most 63 bytes",
            ));
        }
    }
    Ok(())
}

/// A name usher may put in its own SQL (quoted): an unquoted PostgreSQL
/// identifier's characters, any case.
fn is_identifier(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'$')
        && !s.as_bytes()[0].is_ascii_digit()
        && s.as_bytes()[0] != b'$'
}

mod defaults {
    super::super::settings::defaults_from_table! {
        enabled: bool = "auth_monitor.enabled";
        save_interval_s: f64 = "auth_monitor.save_interval_s";
        max_roles: usize = "auth_monitor.max_roles";
        max_unknown_names: usize = "auth_monitor.max_unknown_names";
        max_addresses: usize = "auth_monitor.max_addresses";
        max_failures: u32 = "auth_monitor.lockout.max_failures";
        window_s: f64 = "auth_monitor.lockout.window_s";
        duration_s: f64 = "auth_monitor.lockout.duration_s";
        by_role: bool = "auth_monitor.lockout.by_role";
        by_address: bool = "auth_monitor.lockout.by_address";
        store_schema: String = "auth_monitor.store.schema";
        store_create_tables: bool = "auth_monitor.store.create_tables";
        store_flush_interval_s: f64 = "auth_monitor.store.flush_interval_s";
        store_refresh_interval_s: f64 = "auth_monitor.store.refresh_interval_s";
        store_timeout_s: f64 = "auth_monitor.store.timeout_s";
        store_max_pending: usize = "auth_monitor.store.max_pending";
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    #[test]
    fn lists_or_single_names_and_defaults() {
        let c = Config::from_yaml(
            "auth_monitor: { state_file: s.json, lockout: { max_failures: 3 } }\n\
             blocking:\n  rules:\n    - { action: deny, member_of: reporting, databases: [app, other], tls: false }\n  maintenance: { member_of: admins }\n",
            "b.yaml",
        )
        .unwrap();
        let m = c.auth_monitor.unwrap();
        assert!(m.enabled);
        assert_eq!(m.max_unknown_names, 100);
        let l = m.lockout.unwrap();
        assert_eq!((l.max_failures, l.window_s, l.duration_s), (3, 60.0, 300.0));
        let r = &c.blocking.rules[0];
        assert_eq!(r.member_of, ["reporting"]);
        assert_eq!(r.databases, ["app", "other"]);
        assert_eq!(r.tls, Some(false));
        assert_eq!(c.blocking.maintenance.unwrap().member_of, "admins");
    }

    #[test]
    fn errors_name_the_key() {
        for (yaml, key) in [
            ("auth_monitor: { max_roles: 0 }\n", "auth_monitor.max_roles"),
            (
                "auth_monitor: { lockout: { window_s: -1 } }\n",
                "auth_monitor.lockout.window_s",
            ),
            (
                "auth_monitor: { lockout: { by_role: false, by_address: false } }\n",
                "auth_monitor.lockout",
            ),
            (
                "auth_monitor: { store: { database: app, user: u, schema: \"a;b\" } }\n",
                "auth_monitor.store.schema",
            ),
            (
                "auth_monitor: { store: { database: app, user: u, flush_interval_s: 0 } }\n",
                "auth_monitor.store.flush_interval_s",
            ),
            (
                "auth_monitor: { store: { database: app, user: u, colour: red } }\n",
                "auth_monitor.store.colour",
            ),
            (
                "blocking: { rules: [ { action: maybe } ] }\n",
                "blocking.rules[0].action",
            ),
            (
                "blocking: { rules: [ { action: deny, users: 3 } ] }\n",
                "blocking.rules[0].users",
            ),
        ] {
            let e = Config::from_yaml(yaml, "e.yaml").unwrap_err();
            assert_eq!(e.key, key, "{yaml}: {e}");
        }
    }
}
