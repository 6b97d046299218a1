//! What every client's login and session share, and nothing more: the
//! configuration snapshot, the pools, the client registry, the hooks, the
//! memory and login bounds, and the shutdown signals. `App` (the running
//! pooler) owns one and adds what only it needs (the hook files, reload);
//! a session never sees `App`.

use super::budget::BufferBudget;
use super::client_registry::ClientRegistry;
use super::login_slots::LoginSlots;
use super::peers::Peers;
use super::prepared::StatementRegistry;
use crate::auth::hba::Hba;
use crate::auth::ident::IdentMap;
use crate::auth::{AuthAttempt, Credentials};
use crate::client_addr::ClientHost;
use crate::config::reload_guard::Provides;
use crate::config::{Config, ConfigError, HbaMethod};
use crate::hooks::builtin::Builtins;
use crate::hooks::Dispatcher;
use crate::pool::Pools;
use crate::protocol::PgError;
use crate::tls::{ClientTls, ServerTls};
use arc_swap::ArcSwap;
use rand::RngCore;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::{broadcast, watch};

/// Auth attempt records a slow subscriber may fall behind by before it
/// misses some.
const ATTEMPT_BACKLOG: usize = 1024;

/// The configuration file and what was built from it (credentials, HBA
/// rules, TLS), swapped as a whole on reload, so a login reads one
/// consistent snapshot.
#[derive(Debug)]
pub struct ConfigSnapshot {
    pub config: Arc<Config>,
    /// Where user secrets come from: config, auth file, auth query.
    pub credentials: Credentials,
    /// `auth.hba` / `auth.hba_file`; `None`: every client uses `auth.method`.
    pub hba: Option<Hba>,
    /// `auth.ident` / `auth.ident_file`: the user name maps of peer rules
    /// (empty without them).
    pub ident: IdentMap,
    /// Client-facing TLS; `None` when `tls.mode` is disable.
    pub client_tls: Option<ClientTls>,
    /// TLS towards each database's server.
    pub server_tls: HashMap<String, ServerTls>,
}

impl ConfigSnapshot {
    /// What this snapshot provides, with `hook_files` loaded beside it (a
    /// reload may not take it all away: config/reload_guard.rs).
    pub fn provides(&self, hook_files: usize) -> Provides {
        Provides {
            users: self.credentials.any(),
            databases: !self.config.databases.is_empty(),
            hook_files,
        }
    }
}

/// How a shutdown treats the clients already connected (PgBouncer's
/// SHUTDOWN WAIT_FOR_CLIENTS and WAIT_FOR_SERVERS).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShutdownMode {
    /// Clients keep working until they leave; after `shutdown_timeout` the
    /// rest are ended between transactions (SIGTERM).
    WaitForClients,
    /// Each client is ended as soon as it holds no server connection
    /// (SIGINT, the console's SHUTDOWN).
    WaitForServers,
}

/// The state client tasks share. Read-mostly; nothing here is locked on
/// the forwarding path.
#[derive(Debug)]
pub struct SessionDeps {
    /// The configuration and what was built from it; replaced by a reload.
    snapshot: ArcSwap<ConfigSnapshot>,
    /// When usher started (for per-second averages).
    pub started: Instant,
    pub pools: Pools,
    pub clients: Arc<ClientRegistry>,
    /// The other instances cancel requests are forwarded to (`peers`).
    pub peers: Peers,
    /// Server-side names of prepared statements, shared by all clients.
    pub statements: StatementRegistry,
    /// Salts the fake SCRAM exchange for unknown users.
    pub mock_key: [u8; 32],
    /// Memory charged by all clients (`max_buffered_total`): read buffers
    /// and prepared statements beyond their free parts.
    pub buffers: Arc<BufferBudget>,
    /// One slot per client in the startup phase (`max_auth_clients`, and
    /// `max_auth_clients_per_address` from one address).
    pub login_slots: LoginSlots,
    /// The hooks of every event and the global switch.
    pub hooks: Dispatcher,
    /// The built-in hooks (blocking, auth monitoring), called before the
    /// Lua hooks.
    pub builtins: Builtins,
    attempts: broadcast::Sender<AuthAttempt>,
    /// Shutdown has begun: stop accepting (both modes).
    shutdown: watch::Sender<bool>,
    /// End each client at its next moment between transactions
    /// (SHUTDOWN / SIGINT at once; SIGTERM once shutdown_timeout passes).
    drain: watch::Sender<bool>,
    /// The drain's flag where it is read on every serve-loop turn: one
    /// load, where the watch takes a lock.
    draining: std::sync::atomic::AtomicBool,
}

impl SessionDeps {
    pub fn new(snapshot: ConfigSnapshot, hooks: Dispatcher, builtins: Builtins) -> SessionDeps {
        let mut mock_key = [0u8; 32];
        rand::thread_rng().fill_bytes(&mut mock_key);
        let config = &snapshot.config;
        let clients = Arc::new(ClientRegistry::with_peer_id(config.peer_id));
        let peers = Peers::new(config.peer_id, &config.peers);
        SessionDeps {
            login_slots: LoginSlots::new(snapshot.config.max_auth_clients),
            snapshot: ArcSwap::from_pointee(snapshot),
            started: Instant::now(),
            pools: Pools::new(),
            clients,
            peers,
            statements: StatementRegistry::default(),
            mock_key,
            buffers: Arc::default(),
            hooks,
            builtins,
            attempts: broadcast::channel(ATTEMPT_BACKLOG).0,
            shutdown: watch::channel(false).0,
            drain: watch::channel(false).0,
            draining: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// The configuration and what was built from it, as of now.
    pub fn snapshot(&self) -> Arc<ConfigSnapshot> {
        self.snapshot.load_full()
    }

    /// The configuration as of now.
    pub fn config(&self) -> Arc<Config> {
        self.snapshot.load().config.clone()
    }

    /// A reload's new snapshot: logins from now on read it.
    pub fn replace_snapshot(&self, snapshot: Arc<ConfigSnapshot>) {
        self.snapshot.store(snapshot);
    }

    /// The auth monitor's lockout, asked before the password is checked:
    /// the error for a client whose user or address is locked out, whatever
    /// the database. The admin console is no exception: a password tried
    /// there is a guess like any other. The way back in for a locked-out
    /// operator is the hook switch (`hooks.enabled: false` and a reload,
    /// or the start-up flag), since the lockout never applies while hooks
    /// are off.
    pub fn lockout_check(&self, user: &str, addr: ClientHost) -> Option<PgError> {
        let monitor = self.builtins.auth_monitor.as_ref()?;
        if !monitor.lockout_enabled() || !self.hooks.enabled() {
            return None;
        }
        let refusal = monitor.lockout_check(user, addr)?;
        self.hooks
            .count_reject(crate::hooks::builtin::AuthMonitor::NAME);
        Some(refusal)
    }

    /// A hook (built-in or Lua) refused a client after it authenticated:
    /// the auth monitor counts it as a blocked attempt.
    pub fn client_rejected(&self, user: &str, user_exists: bool, addr: ClientHost) {
        if let Some(m) = &self.builtins.auth_monitor {
            m.blocked(user, user_exists, addr);
        }
    }

    /// Reports an authentication outcome: logged (with `log.connections`),
    /// counted, handed to the auth_attempt hooks, and sent to whoever
    /// subscribed.
    pub async fn record(&self, attempt: AuthAttempt) {
        if self.config().log.connections {
            attempt.log();
        }
        metrics::counter!(crate::metrics::AUTH_ATTEMPTS, "outcome" => attempt.outcome.as_str())
            .increment(1);
        self.hooks.auth_attempt(&attempt).await;
        if self.attempts.receiver_count() > 0 {
            let _ = self.attempts.send(attempt);
        }
    }

    /// Every authentication outcome from now on.
    pub fn auth_attempts(&self) -> broadcast::Receiver<AuthAttempt> {
        self.attempts.subscribe()
    }

    /// Starts a shutdown: stop accepting; clients leave as `mode` says.
    pub fn shutdown_with(&self, mode: ShutdownMode) {
        self.shutdown.send_replace(true);
        if mode == ShutdownMode::WaitForServers {
            self.start_drain();
        }
    }

    /// Ends each client at its next moment between transactions.
    pub fn start_drain(&self) {
        self.draining
            .store(true, std::sync::atomic::Ordering::Release);
        self.drain.send_replace(true);
        // Idle clients wait on their kill switch's waker, not on the drain
        // (a receiver each would be most of what an idle client holds).
        self.clients.poke_all();
    }

    /// True once clients should end between transactions.
    pub fn is_draining(&self) -> bool {
        self.draining.load(std::sync::atomic::Ordering::Acquire)
    }

    /// True (in the receiver) once clients should end between transactions.
    pub fn draining(&self) -> watch::Receiver<bool> {
        self.drain.subscribe()
    }

    /// True (in the receiver) once usher stops accepting.
    pub fn shutting_down(&self) -> watch::Receiver<bool> {
        self.shutdown.subscribe()
    }
}

impl ConfigSnapshot {
    /// The TLS towards the server of a client's database: its own entry's
    /// when it is listed, else the fallback entry's (`databases."*"`).
    pub fn server_tls_for(&self, database: &str) -> Option<&ServerTls> {
        self.server_tls
            .get(database)
            .or_else(|| self.server_tls.get(crate::config::FALLBACK_DATABASE))
    }

    /// Builds from the configuration everything the login path needs,
    /// reading the files it names (certificates, the auth file, an HBA
    /// file); errors name the file and key.
    pub fn build(config: Config) -> Result<ConfigSnapshot, ConfigError> {
        let err = |key: &str, message: String| ConfigError {
            file: config.source.clone(),
            key: key.to_string(),
            message,
        };
        let client_tls =
            ClientTls::from_config(&config.tls).map_err(|i| i.in_file(&config.source))?;
        let mut server_tls = HashMap::new();
        for (name, db) in &config.databases {
            let tls = ServerTls::from_config(db).map_err(|i| {
                i.under(&format!("databases.{name}"))
                    .in_file(&config.source)
            })?;
            server_tls.insert(name.clone(), tls);
        }
        let credentials = Credentials::load(&config, &server_tls)?;
        let hba = match (&config.auth.hba, &config.auth.hba_file) {
            (Some(rules), _) => {
                Some(Hba::from_config(rules).map_err(|i| i.in_file(&config.source))?)
            }
            (None, Some(path)) => {
                let text = std::fs::read_to_string(path).map_err(|e| {
                    err(
                        "auth.hba_file",
                        format!("cannot read {}: {e}", path.display()),
                    )
                })?;
                let name = path.display().to_string();
                let hba = Hba::parse_file(&text, &name)
                    .map_err(|m| err("auth.hba_file", format!("{name}: {m}")))?;
                Some(hba)
            }
            (None, None) => None,
        };
        let ident = match (&config.auth.ident, &config.auth.ident_file) {
            (Some(entries), _) => {
                IdentMap::from_config(entries).map_err(|i| i.in_file(&config.source))?
            }
            (None, Some(path)) => {
                let text = std::fs::read_to_string(path).map_err(|e| {
                    err(
                        "auth.ident_file",
                        format!("cannot read {}: {e}", path.display()),
                    )
                })?;
                IdentMap::parse_file(&text)
                    .map_err(|m| err("auth.ident_file", format!("{}: {m}", path.display())))?
            }
            (None, None) => IdentMap::default(),
        };
        // A map no entry has would refuse every login of its rules.
        if let Some((map, rule)) = hba
            .iter()
            .flat_map(Hba::maps)
            .find(|(map, _)| !ident.has_map(map))
        {
            return Err(err(
                if config.auth.hba.is_some() {
                    "auth.hba"
                } else {
                    "auth.hba_file"
                },
                format!("{rule}: map `{map}` has no entry in auth.ident or auth.ident_file"),
            ));
        }
        let verifies_clients = client_tls.as_ref().is_some_and(|t| t.verifies_clients);
        if hba.as_ref().is_some_and(|h| h.uses(HbaMethod::Cert)) && !verifies_clients {
            return Err(err(
                "auth.hba_file",
                "cert rules need TLS (tls.mode allow or require) and tls.ca".into(),
            ));
        }
        if hba.as_ref().is_some_and(Hba::needs_membership) && config.auth.user.is_none() {
            return Err(err(
                if config.auth.hba.is_some() {
                    "auth.hba"
                } else {
                    "auth.hba_file"
                },
                "+role rules need auth.user: usher asks the server about role membership".into(),
            ));
        }
        Ok(ConfigSnapshot {
            config: Arc::new(config),
            credentials,
            hba,
            ident,
            client_tls,
            server_tls,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_rules_map_must_have_entries() {
        let yaml = |ident: &str| {
            format!(
                "unix_socket_dir: /run/usher\nauth:\n  hba:\n    - {{ type: local, database: all, user: all, method: peer, map: m }}\n{ident}"
            )
        };
        let config = Config::from_yaml(&yaml(""), "t.yaml").unwrap();
        let e = ConfigSnapshot::build(config).unwrap_err();
        assert_eq!(e.key, "auth.hba");
        assert!(e.message.contains("map `m` has no entry"), "{}", e.message);
        let config = Config::from_yaml(
            &yaml("  ident: [ { map: m, system_user: root, user: alice } ]\n"),
            "t.yaml",
        )
        .unwrap();
        assert!(ConfigSnapshot::build(config).unwrap().ident.has_map("m"));
    }
}
