//! The running pooler: state shared by all client tasks, the accept loop,
//! and graceful shutdown.

use crate::accept::AcceptBackoff;
use crate::auth::hba::Hba;
use crate::auth::{AuthAttempt, Credentials};
use crate::config::{settings, Config, ConfigError, HbaMethod, OnError};
use crate::frontend::prepared::StatementRegistry;
use crate::frontend::registry::ClientRegistry;
use crate::frontend::slots::LoginSlots;
use crate::hooks::builtin::Builtins;
use crate::hooks::lua::{LoadError, LuaEngine, LuaServices, LuaSettings};
use crate::hooks::query::QueryPool;
use crate::hooks::roles::RoleCache;
use crate::hooks::shared::SharedStore;
use crate::hooks::{Dispatcher, Hook};
use crate::pool::Pools;
use crate::protocol::PgError;
use crate::tls::{ClientTls, ServerTls};
use arc_swap::ArcSwap;
use parking_lot::Mutex;
use rand::RngCore;
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{broadcast, watch};

/// Auth attempt records a slow subscriber may fall behind by before it
/// misses some.
const ATTEMPT_BACKLOG: usize = 1024;

/// What the configuration file decides, built from it as a whole and
/// swapped as a whole on reload, so a login reads one consistent snapshot.
#[derive(Debug)]
pub struct Configured {
    pub config: Arc<Config>,
    /// Where user secrets come from: config, auth file, auth query.
    pub credentials: Credentials,
    /// `auth.hba` / `auth.hba_file`; `None`: every client uses `auth.method`.
    pub hba: Option<Hba>,
    /// Client-facing TLS; `None` when `tls.mode` is disable.
    pub client_tls: Option<ClientTls>,
    /// TLS towards each database's server.
    pub server_tls: HashMap<String, ServerTls>,
}

/// Everything client tasks share. Read-mostly; nothing here is locked on the
/// forwarding path.
#[derive(Debug)]
pub struct App {
    /// The configuration and what was built from it; replaced by a reload.
    configured: ArcSwap<Configured>,
    /// When the app was built (for per-second averages).
    pub started: std::time::Instant,
    pub pools: Pools,
    pub clients: Arc<ClientRegistry>,
    /// Server-side names of prepared statements, shared by all clients.
    pub statements: StatementRegistry,
    /// Salts the fake SCRAM exchange for unknown users.
    pub mock_key: [u8; 32],
    /// Read-buffer memory charged by all clients (`max_buffered_total`).
    pub buffers: crate::frontend::budget::BufferBudget,
    /// One slot per client in the startup phase (`max_auth_clients`, and
    /// `max_auth_clients_per_address` from one address).
    pub login_slots: LoginSlots,
    /// The hooks of every event and the global switch.
    pub hooks: Dispatcher,
    /// What Lua hooks reach beyond their VMs (shared store, role graph,
    /// query pool); survives reloads.
    pub lua_services: Arc<LuaServices>,
    /// The built-in hooks (blocking, auth monitoring), called before the
    /// Lua hooks.
    pub builtins: Builtins,
    /// The Lua hooks last loaded, kept so the built-ins can be put in front
    /// of them again when one comes or goes (MAINTENANCE ON/OFF).
    lua_hooks: LuaHooks,
    attempts: broadcast::Sender<AuthAttempt>,
    /// Shutdown has begun: stop accepting (both modes).
    shutdown: watch::Sender<bool>,
    /// End each client at its next moment between transactions
    /// (SHUTDOWN / SIGINT at once; SIGTERM once shutdown_timeout passes).
    drain: watch::Sender<bool>,
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

/// The Lua hooks of the running set.
#[derive(Default)]
struct LuaHooks(Mutex<Vec<Arc<dyn Hook>>>);

impl std::fmt::Debug for LuaHooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<String> = self.0.lock().iter().map(|h| h.name().to_string()).collect();
        f.debug_tuple("LuaHooks").field(&names).finish()
    }
}

/// What a successful reload did.
#[derive(Debug, Default)]
pub struct ReloadReport {
    /// Hook files loaded.
    pub hook_files: usize,
    /// Keys whose new value needs a restart; their old value stays.
    pub restart_needed: Vec<&'static str>,
}

/// Why a reload was refused; the running configuration and hooks stay.
#[derive(Debug)]
pub enum ReloadError {
    Config(ConfigError),
    Hooks(Vec<LoadError>),
}

impl std::fmt::Display for ReloadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReloadError::Config(e) => write!(f, "{e}"),
            ReloadError::Hooks(errors) => {
                let list: Vec<String> = errors.iter().map(|e| e.to_string()).collect();
                write!(f, "{}", list.join("\n"))
            }
        }
    }
}

/// How usher was started, beyond the configuration file.
#[derive(Debug, Clone, Default)]
pub struct StartOptions {
    /// `--no-hooks` / `USHER_HOOKS=off`: start with the hook switch off.
    pub hooks_off: bool,
}

impl App {
    /// Builds the app with default start options.
    pub fn new(config: Config) -> Result<Arc<App>, ConfigError> {
        App::with_options(config, StartOptions::default())
    }

    /// Builds the app, reading the files the config names (certificates,
    /// the auth file, an HBA file, the hook files); errors name the file and
    /// key. Broken hook files stop start-up unless hooks start switched off
    /// (the recovery path): then they are logged, and RELOAD brings them in
    /// once fixed.
    pub fn with_options(config: Config, options: StartOptions) -> Result<Arc<App>, ConfigError> {
        let configured = Configured::build(config)?;
        let config = configured.config.clone();
        let mut mock_key = [0u8; 32];
        rand::thread_rng().fill_bytes(&mut mock_key);
        let h = &config.hooks;
        let enabled = h.enabled && !options.hooks_off;
        let lua_services = Arc::new(LuaServices {
            shared: SharedStore::new(h.shared_max_keys),
            roles: Arc::new(RoleCache::default()),
            query: Arc::new(QueryPool::new(
                config.hook_query_connection(),
                h.query.as_ref().map_or(1, |q| q.pool_size),
                Duration::from_millis(h.query.as_ref().map_or(1000, |q| q.timeout_ms)),
            )),
        });
        let builtins = Builtins::from_config(&config, &lua_services.roles, &lua_services.query)?;
        let source = config.source.clone();
        let app = Arc::new(App {
            hooks: Dispatcher::new(enabled, h.on_error == OnError::Allow),
            lua_services,
            builtins,
            lua_hooks: LuaHooks::default(),
            buffers: Default::default(),
            login_slots: LoginSlots::new(config.max_auth_clients),
            configured: ArcSwap::from_pointee(configured),
            started: std::time::Instant::now(),
            pools: Pools::new(),
            clients: Arc::new(ClientRegistry::default()),
            statements: StatementRegistry::default(),
            mock_key,
            attempts: broadcast::channel(ATTEMPT_BACKLOG).0,
            shutdown: watch::channel(false).0,
            drain: watch::channel(false).0,
        });
        let settings = LuaSettings::from_config(&config);
        match app.reload_hooks_with(settings) {
            Ok(n) => tracing::info!(files = n, enabled, "hooks loaded"),
            Err(errors) if !enabled => {
                // The built-ins go in all the same, for when hooks come back on.
                app.install_hooks(&[]);
                for e in &errors {
                    tracing::error!(error = %e, "hook file failed to load (hooks are off; fix it and RELOAD)");
                }
            }
            Err(errors) => {
                let list: Vec<String> = errors.iter().map(|e| e.to_string()).collect();
                return Err(ConfigError {
                    file: source,
                    key: "hooks.dir".into(),
                    message: format!(
                        "hook files failed to load (start with --no-hooks or USHER_HOOKS=off to run without them):\n  {}",
                        list.join("\n  ")
                    ),
                });
            }
        }
        Ok(app)
    }

    /// The configuration and what was built from it, as of now.
    pub fn configured(&self) -> Arc<Configured> {
        self.configured.load_full()
    }

    /// The configuration as of now.
    pub fn config(&self) -> Arc<Config> {
        self.configured.load().config.clone()
    }

    /// RELOAD and SIGHUP: reads the configuration file and the hook files
    /// again. Everything is built first; only if all of it is valid does it
    /// replace the running set (pools take their new sizes and timeouts,
    /// users, HBA, TLS, blocking rules and hooks change at once). Keys that
    /// cannot change while running keep their old value and are reported.
    pub fn reload(&self) -> Result<ReloadReport, ReloadError> {
        let old = self.configured();
        let path = std::path::PathBuf::from(&old.config.source);
        let mut config = Config::load(&path).map_err(ReloadError::Config)?;
        let restart_needed = hold_restart_only_keys(&old.config, &mut config);
        let configured = Arc::new(Configured::build(config).map_err(ReloadError::Config)?);
        let new = configured.config.clone();
        let s = &self.lua_services;
        let blocking = Builtins::blocking(&new, &s.roles, &s.query).map_err(ReloadError::Config)?;
        let engine = LuaEngine::load(LuaSettings::from_config(&new), self.lua_services.clone())
            .map_err(ReloadError::Hooks)?;
        // Everything is valid: swap it in.
        self.configured.store(configured.clone());
        self.pools
            .apply_config(&old.config, &new, &configured.server_tls);
        self.builtins.blocking.replace_rules(blocking);
        self.hooks
            .set_allow_on_error(new.hooks.on_error == OnError::Allow);
        if new.hooks.enabled != old.config.hooks.enabled {
            self.hooks.set_enabled(new.hooks.enabled);
        }
        if new.log.level != old.config.log.level {
            if let Err(e) = crate::logging::set_level(&new.log.level) {
                tracing::warn!(error = %e, "log.level not changed");
            }
        }
        let hook_files = engine.file_names().len();
        {
            let mut lua = self.lua_hooks.0.lock();
            *lua = engine.hooks();
            self.install_hooks(&lua);
        }
        for key in &restart_needed {
            tracing::warn!(
                key,
                "changed in the configuration file, but needs a restart to take effect"
            );
        }
        tracing::info!(hook_files, "configuration reloaded");
        Ok(ReloadReport {
            hook_files,
            restart_needed,
        })
    }
}

/// The keys a reload cannot apply (the settings table's restart units):
/// where the new file changes one, the running value is put back into
/// `new` (so SHOW CONFIG tells the truth) and the key is returned.
fn hold_restart_only_keys(old: &Config, new: &mut Config) -> Vec<&'static str> {
    settings::restart_units()
        .filter(|key| hold(old, new, key) == Some(true))
        .collect()
}

/// Puts `old`'s value of `key` back into `new`; whether it differed, or
/// `None` for a key this does not know (a unit test asks for every
/// restart unit).
fn hold(old: &Config, new: &mut Config, key: &str) -> Option<bool> {
    macro_rules! hold {
        ($($field:ident).+) => {{
            let changed = format!("{:?}", old.$($field).+) != format!("{:?}", new.$($field).+);
            if changed {
                new.$($field).+ = old.$($field).+.clone();
            }
            changed
        }};
    }
    Some(match key {
        "listen" => hold!(listen),
        "metrics.listen" => hold!(metrics.listen),
        "metrics.max_connections" => hold!(metrics.max_connections),
        "metrics.request_timeout" => hold!(metrics.request_timeout),
        "max_auth_clients" => hold!(max_auth_clients),
        "hooks.query" => hold!(hooks.query),
        "hooks.roles_refresh_s" => hold!(hooks.roles_refresh_s),
        "hooks.shared_max_keys" => hold!(hooks.shared_max_keys),
        "log.format" => hold!(log.format),
        "auth_monitor" => hold!(auth_monitor),
        _ => return None,
    })
}

impl Configured {
    /// Builds from the configuration everything the login path needs,
    /// reading the files it names (certificates, the auth file, an HBA
    /// file); errors name the file and key.
    pub fn build(config: Config) -> Result<Configured, ConfigError> {
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
        Ok(Configured {
            config: Arc::new(config),
            credentials,
            hba,
            client_tls,
            server_tls,
        })
    }
}

impl App {
    /// Compiles the hook files anew and swaps them in; if any file fails,
    /// the running set stays. Returns how many files were loaded.
    pub fn reload_hooks(&self) -> Result<usize, Vec<LoadError>> {
        self.reload_hooks_with(LuaSettings::from_config(&self.config()))
    }

    fn reload_hooks_with(&self, settings: LuaSettings) -> Result<usize, Vec<LoadError>> {
        let engine = LuaEngine::load(settings, self.lua_services.clone())?;
        let files = engine.file_names().len();
        let mut lua = self.lua_hooks.0.lock();
        *lua = engine.hooks();
        self.install_hooks(&lua);
        Ok(files)
    }

    /// Hands the dispatcher the built-ins that have work to do, then the
    /// Lua hooks.
    fn install_hooks(&self, lua: &[Arc<dyn Hook>]) {
        let mut hooks = self.builtins.hooks();
        hooks.extend(lua.iter().cloned());
        self.hooks.set_hooks(hooks);
    }

    /// Starts the background work the app needs (the role graph refresher,
    /// the auth monitor's state file). Needs a tokio runtime.
    fn start_background(&self) {
        let s = &self.lua_services;
        if s.query.configured() {
            if self.builtins.uses_roles() {
                // Warm the role graph now, so the first logins do not wait
                // for it (Lua hooks alone load it at first use).
                let (roles, query) = (s.roles.clone(), s.query.clone());
                tokio::spawn(async move {
                    if let Err(e) = roles.refresh(&query).await {
                        tracing::warn!(error = %e, "could not read the role graph");
                    }
                });
            }
            s.roles.spawn_refresher(
                s.query.clone(),
                Duration::from_secs_f64(self.config().hooks.roles_refresh_s),
            );
        }
        self.builtins.start(self.shutting_down());
    }

    /// The auth monitor's lockout, asked before the password is checked:
    /// the error for a client whose user or address is locked out, whatever
    /// the database. The admin console is no exception: a password tried
    /// there is a guess like any other. The way back in for a locked-out
    /// operator is the hook switch (`hooks.enabled: false` and a reload,
    /// or the start-up flag), since the lockout never applies while hooks
    /// are off.
    pub fn lockout_check(&self, user: &str, addr: IpAddr) -> Option<PgError> {
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
    pub fn client_rejected(&self, user: &str, user_exists: bool, addr: IpAddr) {
        if let Some(m) = &self.builtins.auth_monitor {
            m.blocked(user, user_exists, addr);
        }
    }

    /// MAINTENANCE ON role / MAINTENANCE OFF (`None`): only members of the
    /// role get in. Puts the blocking hook in the dispatcher, or takes it
    /// out when it has nothing left to do.
    pub async fn set_maintenance(&self, role: Option<&str>) -> Result<bool, PgError> {
        let blocking = &self.builtins.blocking;
        let changed = match role {
            Some(role) => {
                blocking.maintenance_on(role).await?;
                true
            }
            None => blocking.maintenance_off(),
        };
        let lua = self.lua_hooks.0.lock();
        self.install_hooks(&lua);
        Ok(changed)
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

    /// Starts a graceful shutdown: stop accepting, end clients at their next
    /// idle moment.
    pub fn begin_shutdown(&self) {
        self.shutdown_with(ShutdownMode::WaitForServers);
    }

    /// Starts a shutdown: stop accepting; clients leave as `mode` says.
    pub fn shutdown_with(&self, mode: ShutdownMode) {
        self.shutdown.send_replace(true);
        if mode == ShutdownMode::WaitForServers {
            self.drain.send_replace(true);
        }
    }

    /// True (in the receiver) once clients should end between transactions.
    pub fn draining(&self) -> watch::Receiver<bool> {
        self.drain.subscribe()
    }

    pub fn shutting_down(&self) -> watch::Receiver<bool> {
        self.shutdown.subscribe()
    }
}

/// A bound listener and the app behind it.
pub struct Server {
    pub app: Arc<App>,
    listener: TcpListener,
}

impl Server {
    /// Builds the app and binds `config.listen`.
    pub async fn bind(config: Config, options: StartOptions) -> std::io::Result<Server> {
        let app = App::with_options(config, options)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        Server::bind_app(app).await
    }

    /// Binds `listen` for an app already built.
    pub async fn bind_app(app: Arc<App>) -> std::io::Result<Server> {
        let listener = TcpListener::bind(app.config().listen).await?;
        Ok(Server { app, listener })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("bound listener has an address")
    }

    /// Accepts clients until shutdown begins, then waits up to
    /// `shutdown_timeout` for connected clients to leave; those still there
    /// are ended between transactions, with a short grace to get there.
    pub async fn run(self) {
        let app = self.app;
        app.start_background();
        let mut shutdown = app.shutting_down();
        tracing::info!(listen = %self.listener.local_addr().map(|a| a.to_string()).unwrap_or_default(), "usher is accepting connections");
        // Out of descriptors and the like: pause (10 ms doubling to 1 s)
        // and log the burst once; clients wait in the listen backlog.
        let mut backoff = AcceptBackoff::new("clients");
        loop {
            tokio::select! {
                accepted = self.listener.accept() => match accepted {
                    Ok((stream, addr)) => {
                        backoff.accepted();
                        let app = app.clone();
                        tokio::spawn(crate::frontend::login::handle_client(app, stream, addr));
                    }
                    Err(e) => {
                        let pause = backoff.failed(&e);
                        tokio::select! {
                            _ = tokio::time::sleep(pause) => {}
                            _ = async { let _ = shutdown.wait_for(|s| *s).await; } => break,
                        }
                    }
                },
                _ = async { let _ = shutdown.wait_for(|s| *s).await; } => break,
            }
        }
        drop(self.listener);
        let deadline = Duration::from_secs_f64(app.config().shutdown_timeout);
        tracing::info!(
            clients = app.clients.connected(),
            timeout_s = deadline.as_secs_f64(),
            "shutting down: waiting for clients"
        );
        let waited = tokio::time::timeout(deadline, async {
            while app.clients.connected() > 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        if waited.is_err() {
            tracing::warn!(
                clients = app.clients.connected(),
                "shutdown_timeout reached; closing remaining clients"
            );
            app.drain.send_replace(true);
            let _ = tokio::time::timeout(Duration::from_secs(1), async {
                while app.clients.connected() > 0 {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            })
            .await;
        }
        for pool in app.pools.all() {
            pool.close_idle();
        }
        app.builtins.save_state().await;
        tracing::info!("usher stopped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reload_holds_the_keys_that_need_a_restart() {
        let old = Config::from_yaml(
            "listen: 127.0.0.1:6432\npool_size: 3\nmetrics: { listen: 127.0.0.1:9100 }\n",
            "a.yaml",
        )
        .unwrap();
        let mut new = Config::from_yaml(
            "listen: 127.0.0.1:7000\npool_size: 5\nmetrics: { listen: 127.0.0.1:9200 }\nmax_auth_clients: 7\n",
            "a.yaml",
        )
        .unwrap();
        let held = hold_restart_only_keys(&old, &mut new);
        assert_eq!(held, ["listen", "metrics.listen", "max_auth_clients"]);
        assert_eq!(new.listen, old.listen);
        assert_eq!(new.metrics.listen, old.metrics.listen);
        assert_eq!(new.max_auth_clients, old.max_auth_clients);
        assert_eq!(new.pool_size, 5, "what a reload can apply is kept");
    }

    #[test]
    fn every_restart_unit_of_the_table_can_be_held() {
        let old = Config::from_yaml("{}\n", "a.yaml").unwrap();
        for key in settings::restart_units() {
            let mut new = old.clone();
            assert_eq!(hold(&old, &mut new, key), Some(false), "{key}");
        }
        assert_eq!(
            settings::restart_units().collect::<Vec<_>>(),
            [
                "listen",
                "metrics.listen",
                "metrics.max_connections",
                "metrics.request_timeout",
                "max_auth_clients",
                "hooks.query",
                "hooks.roles_refresh_s",
                "hooks.shared_max_keys",
                "log.format",
                "auth_monitor",
            ]
        );
    }
}
