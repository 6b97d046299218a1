//! The built-in hooks, which run before the Lua hooks and obey the same
//! global switch:
//!
//! - [`blocking`]: allow/deny rules and maintenance mode at client_connection.
//! - [`auth_monitor`]: pg_auth_mon's counters from every auth attempt, kept
//!   across restarts ([`auth_monitor_state`] holds the tables), and the
//!   lockout, which the login asks before it checks a password; with
//!   `auth_monitor.store`, [`auth_store`] shares the counts of every
//!   instance through PostgreSQL ([`auth_store_state`]: its batches and
//!   views as plain data).
//!
//! A built-in is in the dispatcher only while it has something to do
//! (blocking: rules or maintenance mode; auth monitor: `auth_monitor`
//! configured), so one that is off costs nothing.

pub mod auth_monitor;
pub mod auth_monitor_state;
pub mod auth_store;
pub mod auth_store_state;
pub mod blocking;

pub use auth_monitor::AuthMonitor;
pub use auth_monitor_state::Millis;
pub use auth_store::AuthStore;
pub use blocking::Blocking;

use super::query::QueryPool;
use super::roles::RoleCache;
use super::Hook;
use crate::config::{Config, ConfigError};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::watch;

/// The built-in hooks of one app.
#[derive(Debug)]
pub struct Builtins {
    pub auth_monitor: Option<Arc<AuthMonitor>>,
    pub blocking: Arc<Blocking>,
}

impl Builtins {
    /// Compiles `blocking:` and builds the auth monitor (reading its state
    /// file). Errors name the file and key.
    pub fn from_config(
        config: &Config,
        roles: &Arc<RoleCache>,
        query: &Arc<QueryPool>,
    ) -> Result<Builtins, ConfigError> {
        let blocking = Builtins::blocking(config, roles, query)?;
        let monitor_config = config.auth_monitor.as_ref().filter(|m| m.enabled);
        // A state file that can never be written would lose the counters
        // silently at every restart: say so now.
        if let Some(path) = monitor_config.and_then(|m| m.state_file.as_ref()) {
            let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
            if dir.is_some_and(|d| !d.is_dir()) || path.is_dir() {
                return Err(ConfigError {
                    file: config.source.clone(),
                    key: "auth_monitor.state_file".into(),
                    message: format!(
                        "expected a file in an existing directory, got `{}`",
                        path.display()
                    ),
                });
            }
        }
        let auth_monitor = match monitor_config {
            None => None,
            Some(m) => {
                let store = match &m.store {
                    None => None,
                    Some(s) => Some(
                        AuthStore::new(config, s, auth_monitor::lockout_policy(m), m.max_roles)
                            .map_err(|i| i.in_file(&config.source))?,
                    ),
                };
                Some(Arc::new(
                    AuthMonitor::new(m, roles.clone()).with_store(store),
                ))
            }
        };
        Ok(Builtins {
            auth_monitor,
            blocking: Arc::new(blocking),
        })
    }

    /// Compiles `blocking:` (also on reload, to replace the rules).
    pub fn blocking(
        config: &Config,
        roles: &Arc<RoleCache>,
        query: &Arc<QueryPool>,
    ) -> Result<Blocking, ConfigError> {
        Blocking::from_config(&config.blocking, roles.clone(), query.clone())
            .map_err(|issue| issue.in_file(&config.source))
    }

    /// The built-ins that have work to do, in calling order: blocking, then
    /// auth monitoring.
    pub fn hooks(&self) -> Vec<Arc<dyn Hook>> {
        let mut hooks: Vec<Arc<dyn Hook>> = Vec::new();
        if self.blocking.active() {
            hooks.push(self.blocking.clone());
        }
        if let Some(m) = &self.auth_monitor {
            hooks.push(m.clone());
        }
        hooks
    }

    /// True when a built-in reads the role graph (membership rules,
    /// maintenance mode, the auth monitor's oids).
    pub fn uses_roles(&self) -> bool {
        self.auth_monitor.is_some() || self.blocking.uses_roles()
    }

    /// Background work: the state file's periodic writes, the store's
    /// flushes and refreshes.
    pub fn start(&self, shutdown: watch::Receiver<bool>) {
        if let Some(m) = &self.auth_monitor {
            m.spawn_saver(shutdown.clone());
            m.spawn_store(shutdown);
        }
    }

    /// The last write of the state file, and the store's last flush (the
    /// store's task starts it when shutdown begins), at shutdown.
    pub async fn save_state(&self) {
        if let Some(m) = &self.auth_monitor {
            m.save_now().await;
            m.store_stopped().await;
        }
    }
}

/// A console result: column names and text values (NULL as `None`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Table {
    pub columns: Vec<&'static str>,
    pub rows: Vec<Vec<Option<String>>>,
}

impl Table {
    pub fn new(columns: &[&'static str], rows: Vec<Vec<Option<String>>>) -> Table {
        Table {
            columns: columns.to_vec(),
            rows,
        }
    }
}

/// Now, in Unix milliseconds (wall clock: the values outlive the process).
pub fn now_ms() -> Millis {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as Millis)
}

/// A Unix time in milliseconds as PostgreSQL prints a timestamptz in UTC:
/// `2024-05-01 12:34:56.789+00`.
pub fn timestamp(ms: Millis) -> String {
    match time::OffsetDateTime::from_unix_timestamp_nanos(ms as i128 * 1_000_000) {
        Ok(t) => format!(
            "{:04}-{:02}-{:02} {:02}:{:02}:{:02}.{:03}+00",
            t.year(),
            u8::from(t.month()),
            t.day(),
            t.hour(),
            t.minute(),
            t.second(),
            t.millisecond()
        ),
        Err(_) => ms.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_file_in_a_missing_directory_is_a_config_error() {
        let config = Config::from_yaml(
            "auth_monitor: { state_file: /nonexistent/dir/mon.json }\n",
            "s.yaml",
        )
        .unwrap();
        let roles = Arc::new(RoleCache::default());
        let query = Arc::new(QueryPool::new(None, 1, std::time::Duration::from_secs(1)));
        let e = Builtins::from_config(&config, &roles, &query).unwrap_err();
        assert_eq!(e.key, "auth_monitor.state_file");
        assert!(e
            .to_string()
            .starts_with("s.yaml: auth_monitor.state_file: expected"));
    }

    #[test]
    fn timestamps_look_like_postgresql_timestamptz() {
        assert_eq!(timestamp(0), "1970-01-01 00:00:00.000+00");
        assert_eq!(timestamp(1_714_566_896_789), "2024-05-01 12:34:56.789+00");
    }
}
