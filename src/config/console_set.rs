//! `SET key = value` on the admin console: one key of the running
//! configuration changed, as PgBouncer's console does.
//!
//! The value is read as the file would read it (a number, a word, a flow
//! list `[a, b]` or mapping; a text that reads as something else is tried
//! as a string too, so `'123'` works for a string key), then the whole
//! configuration is validated as a loaded file is. Applying it is the
//! reload's work (app.rs): a SET lasts until the next RELOAD, which reads
//! the file again, or a restart. Keys that need a restart are refused,
//! not held as a reload holds them.

use super::settings::{self, Reload};
use super::Config;
use serde::de::DeserializeOwned;

/// Why a SET was refused; nothing changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SetError {
    /// Not a configuration key, or no database or user of that name.
    Unknown(String),
    /// A key that only a restart changes.
    RestartOnly(String),
    /// A field of each entry of a list (`peers.host`): the list is set whole.
    PartOf { key: String, whole: &'static str },
    /// The value does not read as the key's type, or the configuration
    /// with it does not validate (or its files do not load).
    Invalid { key: String, message: String },
}

/// Sets `key` to `value` in `config`, then validates the whole. `key` is a
/// key of the settings table (case aside), with a database's or user's name
/// (as written) in place of `<name>`. A refused value changes nothing.
pub fn set(config: &mut Config, key: &str, value: &str) -> Result<(), SetError> {
    let (pattern, name) = pattern_of(key);
    let spec = settings::spec(&pattern).ok_or_else(|| SetError::Unknown(key.to_string()))?;
    if spec.reload == Reload::Restart {
        return Err(SetError::RestartOnly(spec.key.to_string()));
    }
    let mut next = config.clone();
    assign(&mut next, &pattern, name, value, key)?;
    next.validate().map_err(|issue| SetError::Invalid {
        key: key.to_string(),
        message: issue.to_string(),
    })?;
    *config = next;
    Ok(())
}

/// The settings table's key for `key` (`databases.<name>.pool_size`), and
/// the name it stands for.
fn pattern_of(key: &str) -> (String, Option<&str>) {
    let lower = key.to_ascii_lowercase();
    for section in ["databases.", "users."] {
        if lower.starts_with(section) {
            if let Some((name, field)) = key[section.len()..].rsplit_once('.') {
                let field = field.to_ascii_lowercase();
                return (format!("{section}<name>.{field}"), Some(name));
            }
        }
    }
    (lower, None)
}

/// Reads `value` as the file would, as `T`.
fn parse<T: DeserializeOwned>(value: &str) -> Result<T, String> {
    let text = || serde_yaml::Value::String(value.to_string());
    let read = serde_yaml::from_str(value).unwrap_or_else(|_| text());
    serde_yaml::from_value(read)
        .or_else(|e| serde_yaml::from_value(text()).map_err(|_| e.to_string()))
}

fn assign(
    config: &mut Config,
    pattern: &str,
    name: Option<&str>,
    value: &str,
    key: &str,
) -> Result<(), SetError> {
    let invalid = |message: String| SetError::Invalid {
        key: key.to_string(),
        message,
    };
    let unknown = || SetError::Unknown(key.to_string());
    macro_rules! put {
        ($($path:ident).+) => {
            $($path).+ = parse(value).map_err(invalid)?
        };
    }
    let c = config;
    match pattern {
        "max_client_conn" => put!(c.max_client_conn),
        "max_auth_clients_per_address" => put!(c.max_auth_clients_per_address),
        "peers" => put!(c.peers),
        "peers.id" | "peers.host" | "peers.port" | "peers.pool_size" => {
            return Err(SetError::PartOf {
                key: key.to_string(),
                whole: "peers",
            })
        }
        "pool_mode" => put!(c.pool_mode),
        "pool_size" => put!(c.pool_size),
        "min_pool_size" => put!(c.min_pool_size),
        "server_reset_query" => put!(c.server_reset_query),
        "query_wait_timeout" => put!(c.query_wait_timeout),
        "server_connect_timeout" => put!(c.server_connect_timeout),
        "server_login_retry" => put!(c.server_login_retry),
        "server_fast_fail" => put!(c.server_fast_fail),
        "client_idle_timeout" => put!(c.client_idle_timeout),
        "idle_transaction_timeout" => put!(c.idle_transaction_timeout),
        "server_idle_timeout" => put!(c.server_idle_timeout),
        "server_lifetime" => put!(c.server_lifetime),
        "server_check_delay" => put!(c.server_check_delay),
        "autodb_idle_timeout" => put!(c.autodb_idle_timeout),
        "auth_timeout" => put!(c.auth_timeout),
        "shutdown_timeout" => put!(c.shutdown_timeout),
        "max_message_size" => put!(c.max_message_size),
        "max_buffered_message" => put!(c.max_buffered_message),
        "max_buffered_total" => put!(c.max_buffered_total),
        "client_message_timeout" => put!(c.client_message_timeout),
        "prepared_statements" => put!(c.prepared_statements),
        "pinning" => put!(c.pinning),
        "max_pinned" => put!(c.max_pinned),
        "max_db_connections" => put!(c.max_db_connections),
        "max_user_connections" => put!(c.max_user_connections),
        "max_db_client_connections" => put!(c.max_db_client_connections),
        "max_user_client_connections" => put!(c.max_user_client_connections),
        "reserve_pool_size" => put!(c.reserve_pool_size),
        "reserve_pool_timeout" => put!(c.reserve_pool_timeout),
        "tls.mode" => put!(c.tls.mode),
        "tls.cert" => put!(c.tls.cert),
        "tls.key" => put!(c.tls.key),
        "tls.ca" => put!(c.tls.ca),
        "auth.method" => put!(c.auth.method),
        "auth.file" => put!(c.auth.file),
        "auth.user" => put!(c.auth.user),
        "auth.query" => put!(c.auth.query),
        "auth.dbname" => put!(c.auth.dbname),
        "auth.cache_ttl" => put!(c.auth.cache_ttl),
        "auth.hba" => put!(c.auth.hba),
        "auth.hba_file" => put!(c.auth.hba_file),
        "auth.ident" => put!(c.auth.ident),
        "auth.ident_file" => put!(c.auth.ident_file),
        "admin.users" => put!(c.admin.users),
        "admin.stats_users" => put!(c.admin.stats_users),
        "hooks.enabled" => put!(c.hooks.enabled),
        "hooks.dir" => put!(c.hooks.dir),
        "hooks.allow_empty" => put!(c.hooks.allow_empty),
        "hooks.timeout_ms" => put!(c.hooks.timeout_ms),
        "hooks.memory_limit_mb" => put!(c.hooks.memory_limit_mb),
        "hooks.on_error" => put!(c.hooks.on_error),
        "hooks.vms" => put!(c.hooks.vms),
        "hooks.vars_max_bytes" => put!(c.hooks.vars_max_bytes),
        "log.level" => put!(c.log.level),
        "log.connections" => put!(c.log.connections),
        "log.disconnections" => put!(c.log.disconnections),
        "blocking" => put!(c.blocking),
        "routing" => put!(c.routing),
        _ if pattern.starts_with("routing.") => {
            // A key of the section gives the configuration one if it had none.
            let r = c.routing.get_or_insert_with(super::RoutingConfig::default);
            match pattern {
                "routing.allow.hosts" => put!(r.allow.hosts),
                "routing.allow.ports" => put!(r.allow.ports),
                "routing.allow.databases" => put!(r.allow.databases),
                "routing.max_pools" => put!(r.max_pools),
                _ => return Err(unknown()),
            }
        }
        _ if pattern.starts_with("databases.") => {
            let d = c.databases.get_mut(name.unwrap_or_default());
            let d = d.ok_or_else(unknown)?;
            match &pattern["databases.<name>.".len()..] {
                "host" => put!(d.host),
                "port" => put!(d.port),
                "hosts" => put!(d.hosts),
                "target" => put!(d.target),
                "load_balance" => put!(d.load_balance),
                "dbname" => put!(d.dbname),
                "tls" => put!(d.tls),
                "tls_ca" => put!(d.tls_ca),
                "pool_mode" => put!(d.pool_mode),
                "pool_size" => put!(d.pool_size),
                "min_pool_size" => put!(d.min_pool_size),
                "query_wait_timeout" => put!(d.query_wait_timeout),
                "server_connect_timeout" => put!(d.server_connect_timeout),
                "client_idle_timeout" => put!(d.client_idle_timeout),
                "idle_transaction_timeout" => put!(d.idle_transaction_timeout),
                "server_idle_timeout" => put!(d.server_idle_timeout),
                "server_lifetime" => put!(d.server_lifetime),
                "pinning" => put!(d.pinning),
                "max_pinned" => put!(d.max_pinned),
                "max_db_connections" => put!(d.max_db_connections),
                "max_db_client_connections" => put!(d.max_db_client_connections),
                "reserve_pool_size" => put!(d.reserve_pool_size),
                _ => return Err(unknown()),
            }
        }
        _ if pattern.starts_with("users.") => {
            let u = c.users.get_mut(name.unwrap_or_default());
            let u = u.ok_or_else(unknown)?;
            match &pattern["users.<name>.".len()..] {
                "password" => put!(u.password),
                "pool_mode" => put!(u.pool_mode),
                "pool_size" => put!(u.pool_size),
                "max_user_connections" => put!(u.max_user_connections),
                "max_user_client_connections" => put!(u.max_user_client_connections),
                _ => return Err(unknown()),
            }
        }
        _ => return Err(unknown()),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::PoolMode;

    fn config() -> Config {
        Config::from_yaml(
            "databases: { app: {} }\nusers: { u: { password: pw } }\n",
            "t.yaml",
        )
        .unwrap()
    }

    #[test]
    fn every_key_a_reload_applies_can_be_set_and_no_other() {
        for s in settings::SETTINGS {
            let key = s.key.replace("databases.<name>", "databases.app");
            let key = key.replace("users.<name>", "users.u");
            let value = match s.default {
                settings::SettingDefault::Value(v) => v,
                settings::SettingDefault::Text(_) => "null",
            };
            let result = set(&mut config(), &key, value);
            match s.reload {
                Reload::Restart => {
                    assert_eq!(result, Err(SetError::RestartOnly(s.key.into())), "{key}")
                }
                _ => assert!(
                    !matches!(result, Err(SetError::Unknown(_) | SetError::RestartOnly(_))),
                    "{key}: {result:?}"
                ),
            }
        }
    }

    #[test]
    fn values_read_as_the_file_reads_them_and_are_validated() {
        let mut c = config();
        set(&mut c, "POOL_SIZE", "7").unwrap();
        assert_eq!(c.pool_size, 7);
        set(&mut c, "pool_mode", "session").unwrap();
        assert_eq!(c.pool_mode, PoolMode::Session);
        set(&mut c, "server_reset_query", "123").unwrap();
        assert_eq!(c.server_reset_query, "123");
        set(&mut c, "server_reset_query", "").unwrap();
        assert_eq!(c.server_reset_query, "");
        set(&mut c, "admin.users", "[u]").unwrap();
        assert_eq!(c.admin.users, ["u"]);
        assert!(matches!(
            set(&mut c, "admin.users", "[u, v]"),
            Err(SetError::Invalid { .. })
        ));
        set(&mut c, "databases.app.pool_size", "3").unwrap();
        assert_eq!(c.databases["app"].pool_size, Some(3));
        set(&mut c, "databases.app.pool_size", "null").unwrap();
        assert_eq!(c.databases["app"].pool_size, None);
        set(&mut c, "users.u.password", "new secret").unwrap();
        assert_eq!(c.users["u"].password.as_deref(), Some("new secret"));

        let invalid = |r: Result<(), SetError>| match r {
            Err(SetError::Invalid { message, .. }) => message,
            other => panic!("{other:?}"),
        };
        assert!(invalid(set(&mut c, "pool_size", "many")).contains("invalid"));
        assert!(invalid(set(&mut c, "pool_size", "0")).contains("greater than 0"));
        assert!(invalid(set(&mut c, "pool_mode", "statement")).contains("unknown variant"));
        assert!(invalid(set(&mut c, "log.level", "usher=loud")).contains("log.level"));
        assert_eq!(c.pool_size, 7, "a refused value changes nothing");

        assert_eq!(
            set(&mut c, "pool_sise", "3"),
            Err(SetError::Unknown("pool_sise".into()))
        );
        assert_eq!(
            set(&mut c, "databases.nowhere.pool_size", "3"),
            Err(SetError::Unknown("databases.nowhere.pool_size".into()))
        );
        assert_eq!(
            set(&mut c, "listen", "127.0.0.1:7000"),
            Err(SetError::RestartOnly("listen".into()))
        );
        assert!(matches!(
            set(&mut c, "peers.host", "x"),
            Err(SetError::PartOf { whole: "peers", .. })
        ));
    }
}
