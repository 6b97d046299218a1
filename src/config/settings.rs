//! The settings table: every configuration key once, with its default and
//! what a reload does with it.
//!
//! Serde's defaults ([`default_value`]), SHOW CONFIG (the rows marked
//! `show`, in this order; `changeable` is "not restart-only") and RELOAD
//! (which holds the [`restart_units`]) all read [`SETTINGS`]; a unit test
//! checks docs/configuration.md's `| key | default | meaning |` tables and the shipped
//! `config/usher.yaml` against it.
//!
//! Keys are dotted paths; `<name>` stands for a key of `databases` or
//! `users`. A key other keys nest under is a section (`auth_monitor`,
//! `hooks.query`): a reload treats a restart-only section as one unit.

use serde::de::DeserializeOwned;

/// What RELOAD (or SIGHUP) does with a changed value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reload {
    /// Takes effect at once, for connected clients too.
    Live,
    /// Applies to clients (or logins) that come after the reload.
    NewClients,
    /// Needs a restart: RELOAD keeps the running value and warns.
    Restart,
}

/// A key's default.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SettingDefault {
    /// A value, written as YAML would write it (serde reads it from here).
    Value(&'static str),
    /// No value of its own; what applies instead, in words ("none",
    /// "global", "the key").
    Text(&'static str),
}

/// One configuration key.
#[derive(Debug, Clone, Copy)]
pub struct SettingSpec {
    pub key: &'static str,
    pub default: SettingDefault,
    pub reload: Reload,
    /// A row of SHOW CONFIG.
    pub show: bool,
}

use Reload::{Live, NewClients, Restart};
use SettingDefault::{Text, Value};

const fn s(key: &'static str, default: SettingDefault, reload: Reload, show: bool) -> SettingSpec {
    SettingSpec {
        key,
        default,
        reload,
        show,
    }
}

const SHOW: bool = true;
const HIDE: bool = false;

/// Every configuration key. The order is SHOW CONFIG's (for the rows it
/// shows) and RELOAD's warning's.
pub const SETTINGS: &[SettingSpec] = &[
    s("listen", Value("127.0.0.1:6432"), Restart, SHOW),
    s("metrics.listen", Text("none"), Restart, HIDE),
    s("metrics.max_connections", Value("64"), Restart, HIDE),
    s("metrics.request_timeout", Value("5"), Restart, HIDE),
    s("max_client_conn", Value("10000"), NewClients, SHOW),
    s("max_auth_clients", Value("1000"), Restart, SHOW),
    s(
        "max_auth_clients_per_address",
        Value("100"),
        NewClients,
        SHOW,
    ),
    s("workers", Value("0"), Restart, SHOW),
    // Running several instances (config/peering.rs). The listening socket and
    // the cancel keys already given out depend on these two.
    s("so_reuseport", Value("false"), Restart, SHOW),
    s("peer_id", Value("0"), Restart, SHOW),
    // The Unix-domain socket is made once, at start (src/unix_listen.rs).
    s("unix_socket_dir", Text("none"), Restart, SHOW),
    s("unix_socket_mode", Value("0777"), Restart, SHOW),
    s("unix_socket_group", Text("none"), Restart, SHOW),
    // Cancels forwarded after the reload use the new list.
    s("peers", Text("none"), Live, HIDE),
    s("peers.id", Text("none"), Live, HIDE),
    s("peers.host", Text("none"), Live, HIDE),
    s("peers.port", Value("6432"), Live, HIDE),
    s("peers.pool_size", Value("8"), Live, HIDE),
    s("pool_mode", Value("transaction"), NewClients, SHOW),
    s("pool_size", Value("20"), Live, SHOW),
    s("min_pool_size", Value("0"), Live, SHOW),
    s("server_reset_query", Value("DISCARD ALL"), Live, SHOW),
    s("query_wait_timeout", Value("120"), Live, SHOW),
    s("server_connect_timeout", Value("15"), Live, SHOW),
    // Read at each failed attempt to open a server connection.
    s("server_login_retry", Value("15"), Live, SHOW),
    s("server_fast_fail", Value("false"), Live, SHOW),
    s("client_idle_timeout", Value("0"), Live, SHOW),
    s("idle_transaction_timeout", Value("0"), Live, SHOW),
    s("server_idle_timeout", Value("600"), Live, SHOW),
    s("server_lifetime", Value("3600"), Live, SHOW),
    s("server_check_delay", Value("30"), Live, SHOW),
    // Read by each auto database's pool at its next maintenance round.
    s("autodb_idle_timeout", Value("3600"), Live, SHOW),
    s("auth_timeout", Value("60"), NewClients, SHOW),
    s("shutdown_timeout", Value("30"), Live, SHOW),
    s("max_message_size", Value("268435456"), NewClients, SHOW),
    s("max_buffered_message", Value("16777216"), NewClients, SHOW),
    s("max_buffered_total", Value("536870912"), Live, SHOW),
    s("client_message_timeout", Value("60"), Live, SHOW),
    // Whether a client's named statements are rewritten is decided when it
    // connects; the bound per server connection applies at once.
    s("prepared_statements", Value("200"), NewClients, SHOW),
    // Read when a client connects; the cap applies at each new pin.
    s("pinning", Value("auto"), NewClients, HIDE),
    s("max_pinned", Text("pool_size - 1, at least 1"), Live, HIDE),
    // Caps over many pools (src/pool/caps.rs): read at each new server
    // connection; the client caps at each login.
    s("max_db_connections", Value("0"), Live, SHOW),
    s("max_user_connections", Value("0"), Live, SHOW),
    s("max_db_client_connections", Value("0"), Live, SHOW),
    s("max_user_client_connections", Value("0"), Live, SHOW),
    s("reserve_pool_size", Value("0"), Live, SHOW),
    s("reserve_pool_timeout", Value("5"), Live, SHOW),
    s("tls.mode", Value("allow"), NewClients, HIDE),
    s("tls.cert", Text("none"), NewClients, HIDE),
    s("tls.key", Text("none"), NewClients, HIDE),
    s("tls.ca", Text("none"), NewClients, HIDE),
    s("auth.method", Value("scram-sha-256"), NewClients, SHOW),
    s("auth.file", Text("none"), NewClients, HIDE),
    s("auth.user", Text("none"), NewClients, HIDE),
    s(
        "auth.query",
        Value("SELECT usename, passwd FROM pg_shadow WHERE usename = $1"),
        NewClients,
        HIDE,
    ),
    s("auth.dbname", Text("the client's"), NewClients, HIDE),
    s("auth.cache_ttl", Value("10"), NewClients, HIDE),
    s("auth.hba", Text("none"), NewClients, HIDE),
    s("auth.hba_file", Text("none"), NewClients, HIDE),
    s("auth.ident", Text("none"), NewClients, HIDE),
    s("auth.ident_file", Text("none"), NewClients, HIDE),
    // A database whose servers (host, port, hosts, target, load_balance),
    // dbname or tls change reconnects.
    s("databases.<name>.host", Value("127.0.0.1"), Live, HIDE),
    s("databases.<name>.port", Value("5432"), Live, HIDE),
    s("databases.<name>.hosts", Text("none"), Live, HIDE),
    s("databases.<name>.target", Value("any"), Live, HIDE),
    s("databases.<name>.load_balance", Value("false"), Live, HIDE),
    s("databases.<name>.dbname", Text("the key"), Live, HIDE),
    s("databases.<name>.tls", Value("prefer"), Live, HIDE),
    s("databases.<name>.tls_ca", Text("none"), Live, HIDE),
    s(
        "databases.<name>.pool_mode",
        Text("global"),
        NewClients,
        HIDE,
    ),
    s("databases.<name>.pool_size", Text("global"), Live, HIDE),
    s("databases.<name>.min_pool_size", Text("global"), Live, HIDE),
    s(
        "databases.<name>.query_wait_timeout",
        Text("global"),
        Live,
        HIDE,
    ),
    s(
        "databases.<name>.server_connect_timeout",
        Text("global"),
        Live,
        HIDE,
    ),
    s(
        "databases.<name>.client_idle_timeout",
        Text("global"),
        Live,
        HIDE,
    ),
    s(
        "databases.<name>.idle_transaction_timeout",
        Text("global"),
        Live,
        HIDE,
    ),
    s(
        "databases.<name>.server_idle_timeout",
        Text("global"),
        Live,
        HIDE,
    ),
    s(
        "databases.<name>.server_lifetime",
        Text("global"),
        Live,
        HIDE,
    ),
    s("databases.<name>.pinning", Text("global"), NewClients, HIDE),
    s("databases.<name>.max_pinned", Text("global"), Live, HIDE),
    s(
        "databases.<name>.max_db_connections",
        Text("global"),
        Live,
        HIDE,
    ),
    s(
        "databases.<name>.max_db_client_connections",
        Text("global"),
        Live,
        HIDE,
    ),
    s(
        "databases.<name>.reserve_pool_size",
        Text("global"),
        Live,
        HIDE,
    ),
    s("users.<name>.password", Text("none"), NewClients, HIDE),
    s(
        "users.<name>.pool_mode",
        Text("database's"),
        NewClients,
        HIDE,
    ),
    s("users.<name>.pool_size", Text("database's"), Live, HIDE),
    s(
        "users.<name>.max_user_connections",
        Text("global"),
        Live,
        HIDE,
    ),
    s(
        "users.<name>.max_user_client_connections",
        Text("global"),
        Live,
        HIDE,
    ),
    s("admin.users", Value("[]"), NewClients, HIDE),
    s("admin.stats_users", Value("[]"), NewClients, HIDE),
    s("hooks.enabled", Value("true"), Live, SHOW),
    s("hooks.dir", Value("hooks"), Live, SHOW),
    s("hooks.allow_empty", Value("false"), Live, HIDE),
    s("hooks.timeout_ms", Value("100"), Live, SHOW),
    s("hooks.memory_limit_mb", Value("32"), Live, SHOW),
    s("hooks.on_error", Value("reject"), Live, HIDE),
    s("hooks.vms", Value("0"), Live, HIDE),
    s("hooks.vars_max_bytes", Value("65536"), Live, HIDE),
    s("hooks.query", Text("none"), Restart, HIDE),
    s("hooks.query.database", Text("none"), Restart, HIDE),
    s("hooks.query.user", Text("none"), Restart, HIDE),
    s("hooks.query.pool_size", Value("2"), Restart, HIDE),
    s("hooks.query.timeout_ms", Value("1000"), Restart, HIDE),
    // The role graph's refresher is started once, with the interval of
    // the start.
    s("hooks.roles_refresh_s", Value("30"), Restart, HIDE),
    s("hooks.shared_max_keys", Value("10000"), Restart, HIDE),
    s("hooks.shared_max_bytes", Value("4194304"), Restart, HIDE),
    s("log.level", Value("info"), Live, SHOW),
    s("log.format", Value("text"), Restart, HIDE),
    s("log.connections", Value("true"), Live, SHOW),
    s("log.disconnections", Value("true"), Live, SHOW),
    s("auth_monitor", Text("off"), Restart, HIDE),
    s("auth_monitor.enabled", Value("true"), Restart, HIDE),
    s("auth_monitor.state_file", Text("none"), Restart, HIDE),
    s("auth_monitor.save_interval_s", Value("10"), Restart, HIDE),
    s("auth_monitor.max_roles", Value("1024"), Restart, HIDE),
    s(
        "auth_monitor.max_unknown_names",
        Value("100"),
        Restart,
        HIDE,
    ),
    s("auth_monitor.max_addresses", Value("1024"), Restart, HIDE),
    s(
        "auth_monitor.lockout.max_failures",
        Value("10"),
        Restart,
        HIDE,
    ),
    s("auth_monitor.lockout.window_s", Value("60"), Restart, HIDE),
    s(
        "auth_monitor.lockout.duration_s",
        Value("300"),
        Restart,
        HIDE,
    ),
    s("auth_monitor.lockout.by_role", Value("true"), Restart, HIDE),
    s(
        "auth_monitor.lockout.by_address",
        Value("true"),
        Restart,
        HIDE,
    ),
    // The shared store (hooks/builtin/auth_store.rs): part of the
    // restart-only section, its intervals too (one task, started once).
    s("auth_monitor.store", Text("none"), Restart, HIDE),
    s("auth_monitor.store.database", Text("none"), Restart, HIDE),
    s("auth_monitor.store.user", Text("none"), Restart, HIDE),
    s("auth_monitor.store.schema", Value("public"), Restart, HIDE),
    s(
        "auth_monitor.store.create_tables",
        Value("true"),
        Restart,
        HIDE,
    ),
    s(
        "auth_monitor.store.flush_interval_s",
        Value("1"),
        Restart,
        HIDE,
    ),
    s(
        "auth_monitor.store.refresh_interval_s",
        Value("1"),
        Restart,
        HIDE,
    ),
    s("auth_monitor.store.timeout_s", Value("5"), Restart, HIDE),
    s(
        "auth_monitor.store.max_pending",
        Value("10000"),
        Restart,
        HIDE,
    ),
    // Rules and maintenance mode are replaced as a whole.
    s("blocking", Text("none"), Live, HIDE),
    // Checked at each login against the running configuration.
    s("routing", Text("none"), NewClients, HIDE),
    s("routing.allow.hosts", Value("[]"), NewClients, HIDE),
    s("routing.allow.ports", Value("[]"), NewClients, HIDE),
    s("routing.allow.databases", Value("[]"), NewClients, HIDE),
    s("routing.max_pools", Value("100"), NewClients, HIDE),
];

/// The entry for `key`, if it is one.
pub fn spec(key: &str) -> Option<&'static SettingSpec> {
    SETTINGS.iter().find(|s| s.key == key)
}

/// The default of `key` as written in the table (a [`SettingDefault::Value`]).
/// Panics if the table has none: callers name keys of the table, and a
/// unit test calls every one of them.
pub fn default_text(key: &str) -> &'static str {
    match spec(key).map(|s| s.default) {
        Some(Value(v)) => v,
        other => panic!("settings table: no default value for {key} ({other:?})"),
    }
}

/// The default of `key`, read the way the configuration file is.
pub fn default_value<T: DeserializeOwned>(key: &str) -> T {
    let text = default_text(key);
    serde_yaml::from_str(text)
        .unwrap_or_else(|e| panic!("settings table: default of {key} ({text:?}): {e}"))
}

/// The keys RELOAD holds when they change: restart-only keys that are not
/// inside a restart-only section (a section is held as one).
pub fn restart_units() -> impl Iterator<Item = &'static str> {
    SETTINGS
        .iter()
        .filter(|s| s.reload == Restart)
        .map(|s| s.key)
        .filter(|key| {
            !SETTINGS.iter().any(|p| {
                p.reload == Restart
                    && key.len() > p.key.len()
                    && key.starts_with(p.key)
                    && key.as_bytes()[p.key.len()] == b'.'
            })
        })
}

/// Whether other keys nest under `key`.
pub fn is_section(key: &str) -> bool {
    SETTINGS.iter().any(|s| {
        s.key.len() > key.len() && s.key.starts_with(key) && s.key.as_bytes()[key.len()] == b'.'
    })
}

/// Serde default functions that read the table: `name: Type = "key";`.
macro_rules! defaults_from_table {
    ($($name:ident: $ty:ty = $key:literal;)*) => {
        $(
            pub fn $name() -> $ty {
                $crate::config::settings::default_value($key)
            }
        )*
    };
}
pub(crate) use defaults_from_table;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use std::collections::BTreeMap;

    /// The page whose key tables document every setting.
    const DOC: &str = "docs/configuration.md";

    fn repo_file(name: &str) -> String {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(name);
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    /// The `code` spans of a Markdown table cell.
    fn code_spans(cell: &str) -> Vec<&str> {
        cell.split('`').skip(1).step_by(2).collect()
    }

    /// Every row of docs/configuration.md's `| key | default | meaning |` tables, as
    /// (key, default cell, line). A cell naming several keys (`a.b` / `c`,
    /// or `a.b`, `c`, ...) gives a row per key; bare names are siblings of
    /// the first key. A default cell with as many ` / `-separated parts as
    /// keys gives each key its part.
    fn doc_rows() -> Vec<(String, String, usize)> {
        let doc = repo_file(DOC);
        let mut rows = Vec::new();
        let mut in_table = false;
        for (n, line) in doc.lines().enumerate() {
            let line_no = n + 1;
            if line.starts_with("| key | default | meaning |") {
                in_table = true;
                continue;
            }
            if !line.starts_with('|') {
                in_table = false;
                continue;
            }
            if !in_table || line.starts_with("|---") {
                continue;
            }
            let cells: Vec<&str> = line.split(" | ").collect();
            assert!(cells.len() >= 3, "{DOC}:{line_no}: not a 3-column row");
            let keys = code_spans(cells[0]);
            assert!(
                !keys.is_empty(),
                "{DOC}:{line_no}: no key in `{}`",
                cells[0]
            );
            let parent = keys[0].rsplit_once('.').map(|(p, _)| p);
            let defaults: Vec<&str> = cells[1].split(" / ").collect();
            for (i, key) in keys.iter().enumerate() {
                let key = match parent {
                    Some(p) if i > 0 && !key.contains('.') => format!("{p}.{key}"),
                    _ => key.to_string(),
                };
                let default = if defaults.len() == keys.len() {
                    defaults[i]
                } else {
                    cells[1]
                };
                rows.push((key, default.trim().to_string(), line_no));
            }
        }
        rows
    }

    #[test]
    fn the_configuration_doc_documents_every_key_with_its_default() {
        let rows = doc_rows();
        assert!(
            rows.len() > 50,
            "{DOC}: key tables not found ({} rows)",
            rows.len()
        );
        let mut wrong = Vec::new();
        let mut documented: BTreeMap<&str, (&str, usize)> = BTreeMap::new();
        for (key, default, line) in &rows {
            // `auth_monitor.*`: the section, documented further on.
            let name = key.strip_suffix(".*").unwrap_or(key);
            if spec(name).is_none() {
                wrong.push(format!("{DOC}:{line}: `{key}` is not a configuration key"));
            }
            documented.insert(name, (default, *line));
        }
        for s in SETTINGS {
            let Some((cell, line)) = documented.get(s.key) else {
                // A section is documented by its keys.
                if !is_section(s.key) {
                    wrong.push(format!("`{}` is not in {DOC}'s tables", s.key));
                }
                continue;
            };
            let ok = match s.default {
                Value(v) => code_spans(cell).first() == Some(&v),
                Text(t) => *cell == t,
            };
            if !ok {
                wrong.push(format!(
                    "{DOC}:{line}: `{}` defaults to {:?}, not `{cell}`",
                    s.key, s.default
                ));
            }
        }
        assert!(wrong.is_empty(), "\n{}", wrong.join("\n"));
    }

    /// Key paths of a YAML file, as the table writes them.
    fn check_keys(value: &serde_yaml::Value, path: &str, found: &mut Vec<String>) {
        let serde_yaml::Value::Mapping(map) = value else {
            panic!("config/usher.yaml: `{path}` is not a section");
        };
        for (k, v) in map {
            let k = k.as_str().expect("string keys");
            let key = match path {
                "" => k.to_string(),
                "databases" | "users" => format!("{path}.<name>"),
                _ => format!("{path}.{k}"),
            };
            if matches!(path, "databases" | "users") {
                check_keys(v, &key, found);
                continue;
            }
            assert!(
                spec(&key).is_some() || is_section(&key),
                "config/usher.yaml: `{key}` is not a configuration key"
            );
            if is_section(&key) && v.is_mapping() {
                check_keys(v, &key, found);
            } else {
                found.push(key);
            }
        }
    }

    #[test]
    fn the_shipped_config_parses_and_uses_known_keys() {
        let text = repo_file("config/usher.yaml");
        Config::from_yaml(&text, "config/usher.yaml").expect("config/usher.yaml loads");
        let mut found = Vec::new();
        check_keys(&serde_yaml::from_str(&text).unwrap(), "", &mut found);
        assert!(
            found.contains(&"databases.<name>.host".to_string()),
            "{found:?}"
        );
    }

    #[test]
    fn every_default_value_is_read_and_restart_units_are_sections_or_keys() {
        // A file with every section, so that every serde default runs.
        let c = Config::from_yaml(
            "databases: { app: {} }\nusers: { u: { password: pw } }\n\
             hooks: { query: { database: app, user: u } }\n\
             auth_monitor: { lockout: {} }\ntls: { cert: c.pem, key: k.pem }\n",
            "t.yaml",
        )
        .unwrap();
        assert_eq!(c.tls.mode, crate::config::TlsMode::Allow);
        assert_eq!(c.hooks.query.as_ref().unwrap().pool_size, 2);
        assert_eq!(
            c.auth_monitor
                .as_ref()
                .unwrap()
                .lockout
                .as_ref()
                .unwrap()
                .max_failures,
            10
        );
        for s in SETTINGS {
            if let Value(v) = s.default {
                let parsed: Result<serde_yaml::Value, _> = serde_yaml::from_str(v);
                assert!(parsed.is_ok(), "{}: {v}", s.key);
            }
        }
        let mut keys: Vec<_> = SETTINGS.iter().map(|s| s.key).collect();
        keys.sort();
        keys.dedup();
        assert_eq!(keys.len(), SETTINGS.len(), "a key is in the table twice");
    }
}
