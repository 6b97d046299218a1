//! The server side of a database entry: `host` / `port`, or `hosts` (a
//! list of `host` or `host:port`), `target` (libpq's
//! target_session_attrs) and `load_balance`. How a connection picks among
//! them is backend/hosts.rs'; this file only reads and checks the keys.

use super::{ConfigIssue, DatabaseConfig};
use serde::Deserialize;
use std::fmt;

/// True when `host` names a directory of Unix-domain sockets rather than a
/// host: libpq's rule, an absolute path (`/var/run/postgresql`); the
/// server's socket there is `.s.PGSQL.<port>`.
pub fn is_socket_dir(host: &str) -> bool {
    host.starts_with('/')
}

/// One entry of `databases.<name>.hosts`: a host name or address, with an
/// optional port (`db.example:5433`, `[::1]:5433`; a bare IPv6 address
/// takes the entry's `port`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(try_from = "String")]
pub struct HostSpec {
    pub host: String,
    pub port: Option<u16>,
}

impl TryFrom<String> for HostSpec {
    type Error = String;

    fn try_from(text: String) -> Result<Self, String> {
        let bad = || format!("expected `host` or `host:port`, got `{text}`");
        let (host, port) = if let Some(rest) = text.strip_prefix('[') {
            // [v6] or [v6]:port
            let (addr, after) = rest.split_once(']').ok_or_else(bad)?;
            match after {
                "" => (addr, None),
                _ => (addr, Some(after.strip_prefix(':').ok_or_else(bad)?)),
            }
        } else {
            match text.rsplit_once(':') {
                // More than one colon: a bare IPv6 address.
                Some((h, _)) if h.contains(':') => (text.as_str(), None),
                Some((h, p)) => (h, Some(p)),
                None => (text.as_str(), None),
            }
        };
        if host.is_empty() || host.chars().any(|c| c.is_whitespace() || c == ',') {
            return Err(bad());
        }
        let port = match port {
            None => None,
            Some(p) => match p.parse::<u16>() {
                Ok(p) if p > 0 => Some(p),
                _ => return Err(format!("expected a port from 1 to 65535 in `{text}`")),
            },
        };
        Ok(HostSpec {
            host: host.to_string(),
            port,
        })
    }
}

/// Which server a connection may use, as libpq's target_session_attrs:
/// `read-write` a server whose sessions are not read-only (a primary),
/// `read-only` one whose are (a standby, or default_transaction_read_only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TargetSessionAttrs {
    Any,
    ReadWrite,
    ReadOnly,
}

impl TargetSessionAttrs {
    /// Whether a server whose sessions are read-only (or not) fits.
    pub fn fits(self, read_only: bool) -> bool {
        match self {
            TargetSessionAttrs::Any => true,
            TargetSessionAttrs::ReadWrite => !read_only,
            TargetSessionAttrs::ReadOnly => read_only,
        }
    }
}

impl fmt::Display for TargetSessionAttrs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TargetSessionAttrs::Any => "any",
            TargetSessionAttrs::ReadWrite => "read-write",
            TargetSessionAttrs::ReadOnly => "read-only",
        })
    }
}

impl DatabaseConfig {
    /// The servers of this database, in the configured order, each with
    /// its port: `hosts`, or the one `host` (default 127.0.0.1).
    pub fn server_hosts(&self) -> Vec<(String, u16)> {
        match &self.hosts {
            Some(list) => list
                .iter()
                .map(|h| (h.host.clone(), h.port.unwrap_or(self.port)))
                .collect(),
            None => vec![(self.first_host().to_string(), self.port)],
        }
    }

    /// The first configured host (what SHOW DATABASES shows before any
    /// connection, and verify-full checks when there is one host).
    pub fn first_host(&self) -> &str {
        match (&self.host, &self.hosts) {
            (Some(h), _) => h,
            (None, Some(list)) if !list.is_empty() => &list[0].host,
            _ => super::defaults::host_str(),
        }
    }

    /// Whether the servers a pool connects to differ: a reload that
    /// changes them starts a new generation of connections.
    pub fn same_servers(&self, other: &DatabaseConfig) -> bool {
        self.server_hosts() == other.server_hosts()
            && self.target == other.target
            && self.load_balance == other.load_balance
    }
}

/// Checks the server keys of `databases.<name>` (errors name the key
/// under the entry: `hosts`).
pub(super) fn check(db: &DatabaseConfig) -> Result<(), ConfigIssue> {
    if let Some(list) = &db.hosts {
        if db.host.is_some() {
            return Err(ConfigIssue::new(
                "hosts",
                "give either `host` (one server) or `hosts` (a list), not both",
            ));
        }
        if list.is_empty() {
            return Err(ConfigIssue::new("hosts", "expected at least one host"));
        }
    }
    if db.host.as_deref().is_some_and(str::is_empty) {
        return Err(ConfigIssue::new("host", "expected a host name or address"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn spec(s: &str) -> Result<HostSpec, String> {
        HostSpec::try_from(s.to_string())
    }

    #[test]
    fn host_entries_parse_with_and_without_ports() {
        let h = |host: &str, port| HostSpec {
            host: host.into(),
            port,
        };
        assert_eq!(spec("db1").unwrap(), h("db1", None));
        assert_eq!(spec("db1:5433").unwrap(), h("db1", Some(5433)));
        assert_eq!(spec("[::1]:6000").unwrap(), h("::1", Some(6000)));
        assert_eq!(spec("[::1]").unwrap(), h("::1", None));
        assert_eq!(spec("fe80::1").unwrap(), h("fe80::1", None));
        for bad in [
            "", ":5432", "db:", "db:0", "db:70000", "db:x", "[::1", "[::1]x", "a b",
        ] {
            assert!(spec(bad).is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn hosts_and_host_are_one_list_and_target_defaults_to_any() {
        let c = Config::from_yaml(
            "databases:\n  a: { host: db0, port: 5440 }\n  b: { hosts: [db1, \"db2:5433\"], port: 5434, target: read-write, load_balance: true }\n  c: {}\n",
            "t.yaml",
        )
        .unwrap();
        let a = c.listed_database("a").unwrap();
        assert_eq!(a.server_hosts(), vec![("db0".to_string(), 5440)]);
        assert_eq!((a.target, a.load_balance), (TargetSessionAttrs::Any, false));
        let b = c.listed_database("b").unwrap();
        assert_eq!(
            b.server_hosts(),
            vec![("db1".to_string(), 5434), ("db2".to_string(), 5433)]
        );
        assert_eq!(
            (b.target, b.load_balance, b.first_host()),
            (TargetSessionAttrs::ReadWrite, true, "db1")
        );
        let dflt = c.listed_database("c").unwrap();
        assert_eq!(dflt.server_hosts(), vec![("127.0.0.1".to_string(), 5432)]);
        assert!(!a.same_servers(b) && a.same_servers(a));
    }

    #[test]
    fn bad_server_keys_are_errors_naming_the_key() {
        for (yaml, key, says) in [
            (
                "databases: { a: { host: x, hosts: [y] } }",
                "databases.a.hosts",
                "not both",
            ),
            (
                "databases: { a: { hosts: [] } }",
                "databases.a.hosts",
                "at least one",
            ),
            (
                "databases: { a: { hosts: [y, \"z:0\"] } }",
                "databases.a.hosts[1]",
                "port",
            ),
            (
                "databases: { a: { target: primary } }",
                "databases.a.target",
                "read-write",
            ),
            (
                "databases: { a: { load_balance: maybe } }",
                "databases.a.load_balance",
                "bool",
            ),
        ] {
            let e = Config::from_yaml(yaml, "t.yaml").expect_err(yaml);
            assert_eq!(e.key, key, "{yaml}: {e}");
            assert!(e.message.contains(says), "{yaml}: {e}");
        }
    }

    #[test]
    fn targets_fit_as_libpq_says() {
        use TargetSessionAttrs::*;
        assert!(Any.fits(true) && Any.fits(false));
        assert!(ReadWrite.fits(false) && !ReadWrite.fits(true));
        assert!(ReadOnly.fits(true) && !ReadOnly.fits(false));
    }
}
