//! The running pooler: state shared by all client tasks, the accept loop,
//! and graceful shutdown.

use crate::accept::AcceptBackoff;
use crate::admin::{Pooler, ReloadError, ReloadReport};
use crate::auth::AuthAttempt;
use crate::client_addr::ClientAddr;
use crate::config::console_set::{self, SetError};
use crate::config::{reload_guard, settings, Config, ConfigError, OnError};
use crate::frontend::client_stream::ClientStream;
use crate::frontend::deps::{ConfigSnapshot, SessionDeps, ShutdownMode};
use crate::hooks::builtin::Builtins;
use crate::hooks::lua::{HookThreads, LoadError, LuaEngine, LuaServices, LuaSettings};
use crate::hooks::query::QueryPool;
use crate::hooks::roles::RoleCache;
use crate::hooks::shared::SharedStore;
use crate::hooks::{Dispatcher, Hook};
use crate::protocol::PgError;
use crate::shards::Shards;
use crate::unix_listen::{UnixSocket, UnixSocketSettings};
use parking_lot::Mutex;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::broadcast;
use tokio::task::JoinHandle;

/// The running pooler: what client sessions share ([`SessionDeps`]), and
/// what only the whole pooler handles: the hook files and what Lua hooks
/// reach beyond their VMs, and the reload that rebuilds them.
#[derive(Debug)]
pub struct App {
    /// What every client's login and session share.
    pub deps: Arc<SessionDeps>,
    /// What Lua hooks reach beyond their VMs (shared store, role graph,
    /// query pool); survives reloads.
    pub lua_services: Arc<LuaServices>,
    /// The Lua hooks last loaded, kept so the built-ins can be put in front
    /// of them again when one comes or goes (MAINTENANCE ON/OFF).
    lua_hooks: LuaHooks,
    /// Held by a reload: one at a time.
    reloading: Mutex<()>,
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
        let snapshot = ConfigSnapshot::build(config)?;
        let config = snapshot.config.clone();
        let h = &config.hooks;
        let enabled = h.enabled && !options.hooks_off;
        let lua_services = Arc::new(LuaServices {
            shared: SharedStore::new(h.shared_max_keys, h.shared_max_bytes),
            roles: Arc::new(RoleCache::default()),
            query: Arc::new(QueryPool::new(
                config.hook_query_connection(),
                h.query.as_ref().map_or(1, |q| q.pool_size),
                Duration::from_millis(h.query.as_ref().map_or(1000, |q| q.timeout_ms)),
            )),
            threads: HookThreads::new(),
            reconnects: Default::default(),
        });
        let builtins = Builtins::from_config(&config, &lua_services.roles, &lua_services.query)?;
        let source = config.source.clone();
        let hooks = Dispatcher::new(enabled, h.on_error == OnError::Allow);
        let app = Arc::new(App {
            deps: Arc::new(SessionDeps::new(snapshot, hooks, builtins)),
            lua_services,
            lua_hooks: LuaHooks::default(),
            reloading: Mutex::new(()),
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

    /// The configuration as of now.
    pub fn config(&self) -> Arc<Config> {
        self.deps.config()
    }

    /// The threads that serve clients (`workers`, restart-only; 0 is one
    /// per CPU).
    pub fn workers(&self) -> usize {
        crate::shards::count_for(self.config().workers)
    }

    /// RELOAD and SIGHUP: reads the configuration file and the hook files
    /// again. Everything is built first; only if all of it is valid does it
    /// replace the running set (pools take their new sizes and timeouts,
    /// users, HBA, TLS, blocking rules and hooks change at once). Keys that
    /// cannot change while running keep their old value and are reported.
    pub fn reload(&self) -> Result<ReloadReport, ReloadError> {
        let old = self.deps.snapshot();
        let path = std::path::PathBuf::from(&old.config.source);
        let mut config = Config::load(&path).map_err(ReloadError::Config)?;
        let restart_needed = hold_restart_only_keys(&old.config, &mut config);
        let hook_files = self.apply(&old, config, true)?;
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

    /// SET key = value from the console: the running configuration with
    /// one value changed, applied as a reload applies a file (the hook
    /// files are loaded again only if a `hooks` key their engine reads
    /// changed). It lasts until the next reload reads the file.
    pub fn set(&self, key: &str, value: &str) -> Result<(), SetError> {
        let old = self.deps.snapshot();
        let mut config = (*old.config).clone();
        console_set::set(&mut config, key, value)?;
        let load_hooks = LuaSettings::from_config(&config) != LuaSettings::from_config(&old.config);
        self.apply(&old, config, load_hooks)
            .map_err(|e| SetError::Invalid {
                key: key.to_string(),
                message: e.to_string(),
            })?;
        // SET hooks.enabled is the switch itself, whatever the file said
        // (after DISABLE HOOKS the file's `true` is unchanged, so the
        // reload's rule, act on a change in the file, would do nothing).
        // A RELOAD of an unchanged file still leaves the switch alone.
        if key.eq_ignore_ascii_case("hooks.enabled") {
            self.deps
                .hooks
                .set_enabled(self.deps.snapshot().config.hooks.enabled);
        }
        // A password is not logged.
        let shown = if key.to_ascii_lowercase().ends_with("password") {
            "(hidden)"
        } else {
            value
        };
        tracing::info!(key, value = shown, "SET from the admin console");
        Ok(())
    }

    /// Builds what `config` needs and swaps it in for `old`: the reload's
    /// work, for RELOAD and SET. Everything is built first; only if all of
    /// it is valid does it replace the running set (pools take their new
    /// sizes and timeouts, users, HBA, TLS, blocking rules and hooks change
    /// at once). `load_hooks`: compile the hook files again (else the
    /// running ones stay). Returns how many hook files are loaded.
    fn apply(
        &self,
        old: &ConfigSnapshot,
        config: Config,
        load_hooks: bool,
    ) -> Result<usize, ReloadError> {
        let snapshot = Arc::new(ConfigSnapshot::build(config).map_err(ReloadError::Config)?);
        let new = snapshot.config.clone();
        let s = &self.lua_services;
        let blocking = Builtins::blocking(&new, &s.roles, &s.query).map_err(ReloadError::Config)?;
        let engine = if load_hooks {
            let settings = LuaSettings::from_config(&new);
            Some(LuaEngine::load(settings, s.clone()).map_err(ReloadError::Hooks)?)
        } else {
            None
        };
        // Nothing where there was something (an emptied file, a missing
        // hooks folder) is refused, not applied.
        let loaded = self.lua_hooks.0.lock().len();
        let hook_files = engine.as_ref().map_or(loaded, |e| e.file_names().len());
        let running = old.provides(loaded);
        let next = snapshot.provides(hook_files);
        reload_guard::check(&running, &next, &new)
            .map_err(|issue| ReloadError::Config(issue.in_file(&new.source)))?;
        // Everything is valid: swap it in.
        let deps = &self.deps;
        deps.replace_snapshot(snapshot.clone());
        deps.pools
            .apply_config(&old.config, &new, &snapshot.server_tls);
        deps.builtins.blocking.replace_rules(blocking);
        deps.peers.replace(&new.peers);
        deps.hooks
            .set_allow_on_error(new.hooks.on_error == OnError::Allow);
        if new.hooks.enabled != old.config.hooks.enabled {
            deps.hooks.set_enabled(new.hooks.enabled);
        }
        if new.log.level != old.config.log.level {
            if let Err(e) = crate::logging::set_level(&new.log.level) {
                tracing::warn!(error = %e, "log.level not changed");
            }
        }
        // The built-ins in front (the blocking rules may have come or
        // gone), then the Lua hooks.
        let mut lua = self.lua_hooks.0.lock();
        if let Some(engine) = engine {
            *lua = engine.hooks();
        }
        self.install_hooks(&lua);
        Ok(hook_files)
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
        "workers" => hold!(workers),
        "so_reuseport" => hold!(so_reuseport),
        "peer_id" => hold!(peer_id),
        "unix_socket_dir" => hold!(unix_socket_dir),
        "unix_socket_mode" => hold!(unix_socket_mode),
        "unix_socket_group" => hold!(unix_socket_group),
        "hooks.query" => hold!(hooks.query),
        "hooks.roles_refresh_s" => hold!(hooks.roles_refresh_s),
        "hooks.shared_max_keys" => hold!(hooks.shared_max_keys),
        "hooks.shared_max_bytes" => hold!(hooks.shared_max_bytes),
        "log.format" => hold!(log.format),
        "auth_monitor" => hold!(auth_monitor),
        _ => return None,
    })
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
        let mut hooks = self.deps.builtins.hooks();
        hooks.extend(lua.iter().cloned());
        self.deps.hooks.set_hooks(hooks);
    }

    /// Starts the background work the app needs (the role graph refresher,
    /// the auth monitor's state file). Needs a tokio runtime.
    fn start_background(&self) {
        let s = &self.lua_services;
        if s.query.configured() {
            if self.deps.builtins.uses_roles() {
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
        self.deps.builtins.start(self.deps.shutting_down());
    }

    /// MAINTENANCE ON role / MAINTENANCE OFF (`None`): only members of the
    /// role get in. Puts the blocking hook in the dispatcher, or takes it
    /// out when it has nothing left to do.
    pub async fn set_maintenance(&self, role: Option<&str>) -> Result<bool, PgError> {
        let blocking = &self.deps.builtins.blocking;
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

    /// Every authentication outcome from now on.
    pub fn auth_attempts(&self) -> broadcast::Receiver<AuthAttempt> {
        self.deps.auth_attempts()
    }

    /// Starts a graceful shutdown: stop accepting, end clients at their next
    /// idle moment.
    pub fn begin_shutdown(&self) {
        self.deps.shutdown_with(ShutdownMode::WaitForServers);
    }

    /// Reloads and logs the outcome. One reload at a time.
    pub fn reload_and_log(&self) -> Result<ReloadReport, ReloadError> {
        let _one = self.reloading.lock();
        let result = self.reload();
        if let Err(e) = &result {
            tracing::error!(error = %e, "reload failed; the running configuration and hooks stay");
        }
        result
    }

    /// RELOAD and SIGHUP: [`App::reload_and_log`] on a blocking thread,
    /// never a runtime worker (it reads files and runs the hook files' top
    /// level); the running set serves until the new one is swapped in.
    pub async fn reload_off_workers(self: Arc<Self>) -> Result<ReloadReport, ReloadError> {
        let source = self.config().source.clone();
        tokio::task::spawn_blocking(move || self.reload_and_log())
            .await
            .unwrap_or_else(|e| {
                tracing::error!(error = %e, "reload failed; the running configuration and hooks stay");
                Err(ReloadError::Config(ConfigError {
                    file: source,
                    key: "(file)".into(),
                    message: format!("the reload did not finish: {e}"),
                }))
            })
    }

    /// SET from the console: [`App::set`] on a blocking thread (it reads
    /// the files the configuration names, as a reload does), one at a time
    /// with reloads.
    pub async fn set_off_workers(
        self: Arc<Self>,
        key: String,
        value: String,
    ) -> Result<(), SetError> {
        tokio::task::spawn_blocking(move || {
            let _one = self.reloading.lock();
            App::set(&self, &key, &value)
        })
        .await
        .unwrap_or_else(|e| {
            Err(SetError::Invalid {
                key: String::new(),
                message: format!("the SET did not finish: {e}"),
            })
        })
    }
}

/// The console's way to what only the whole pooler can do.
impl Pooler for App {
    fn reload(
        self: Arc<Self>,
    ) -> Pin<Box<dyn Future<Output = Result<ReloadReport, ReloadError>> + Send>> {
        Box::pin(self.reload_off_workers())
    }

    fn set(
        self: Arc<Self>,
        key: String,
        value: String,
    ) -> Pin<Box<dyn Future<Output = Result<(), SetError>> + Send>> {
        Box::pin(self.set_off_workers(key, value))
    }

    fn set_maintenance<'a>(
        &'a self,
        role: Option<&'a str>,
    ) -> Pin<Box<dyn Future<Output = Result<bool, PgError>> + Send + 'a>> {
        Box::pin(App::set_maintenance(self, role))
    }

    fn reconnected(&self, database: Option<&str>) {
        self.lua_services.reconnects.record(database);
    }
}

/// One client from accept to close: the login, then a task of its own for
/// the session or the console, so that the login's state (a large future:
/// TLS, SCRAM, hooks) is freed and an idle client keeps only what serving
/// it needs.
async fn serve_client(app: Arc<App>, stream: ClientStream, addr: ClientAddr) {
    use crate::frontend::login::{self, LoggedIn};
    let Some(admitted) = login::admit(&app.deps, stream, addr).await else {
        return;
    };
    let login::Admitted {
        mut stream,
        counted,
        logged_in,
    } = admitted;
    match logged_in {
        LoggedIn::Session(session) => {
            // Nothing around the session's own future: it is what an idle
            // client costs.
            tokio::spawn(session.serve(stream, counted));
        }
        LoggedIn::Console(registration) => {
            let pooler: Arc<dyn Pooler> = app.clone();
            match crate::admin::Console::login(app.deps.clone(), pooler, &mut stream, registration)
                .await
            {
                Ok(console) => {
                    tokio::spawn(async move {
                        let _counted = counted;
                        console.serve(stream).await
                    });
                }
                Err(e) => crate::frontend::close_with_error(&mut stream, &e).await,
            }
        }
    }
}

/// Serves a TCP client accepted on this shard's own listener.
fn serve_tcp(app: &Arc<App>, tcp: TcpStream, addr: SocketAddr) -> JoinHandle<()> {
    let _ = tcp.set_nodelay(true);
    tokio::spawn(serve_client(
        app.clone(),
        ClientStream::plain(tcp),
        ClientAddr::Tcp(addr),
    ))
}

/// Accepts with `accept` and hands each connection to `serve` until
/// shutdown begins. Out of descriptors and the like, it pauses (10 ms
/// doubling to 1 s) and logs the burst once (`AcceptBackoff`, named
/// `listener` in the log); clients wait in the listen backlog meanwhile.
async fn accept_until_shutdown<T, F>(
    app: &App,
    listener: &'static str,
    mut accept: impl FnMut() -> F,
    mut serve: impl FnMut(T),
) where
    F: Future<Output = std::io::Result<T>>,
{
    let mut shutdown = app.deps.shutting_down();
    let mut backoff = AcceptBackoff::new(listener);
    loop {
        let pause = tokio::select! {
            accepted = accept() => match accepted {
                Ok(connection) => {
                    backoff.accepted();
                    serve(connection);
                    continue;
                }
                Err(e) => backoff.failed(&e),
            },
            _ = async { let _ = shutdown.wait_for(|s| *s).await; } => return,
        };
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = async { let _ = shutdown.wait_for(|s| *s).await; } => return,
        }
    }
}

/// A shard's accept loop on its own listening socket (`listen::bind_each`)
/// until shutdown begins; then the connections the kernel had queued on
/// it are taken and the socket closed at once. Returns their logins, to
/// be waited for with the other clients.
async fn accept_tcp(app: Arc<App>, listener: std::net::TcpListener) -> Vec<JoinHandle<()>> {
    let listener = match TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            // Not expected (the socket is bound and listening); the other
            // shards' sockets keep serving the address.
            tracing::error!(error = %e, "a worker could not watch its listening socket");
            return Vec::new();
        }
    };
    accept_until_shutdown(
        &app,
        "clients",
        || listener.accept(),
        |(stream, addr)| {
            serve_tcp(&app, stream, addr);
        },
    )
    .await;
    // Connections the kernel queued on this socket would be reset when it
    // closes (with so_reuseport a new usher takes the new ones): take them
    // first, then close at once.
    crate::listen::drain_backlog(listener)
        .into_iter()
        .map(|(stream, addr)| serve_tcp(&app, stream, addr))
        .collect()
}

/// Hands a client of the Unix-domain socket to the next shard.
fn hand_unix(
    shards: &Shards,
    app: &Arc<App>,
    stream: tokio::net::UnixStream,
    peer: crate::client_addr::LocalPeer,
) -> JoinHandle<()> {
    let moved = stream.into_std();
    let app = app.clone();
    shards.spawn(async move {
        match moved.and_then(tokio::net::UnixStream::from_std) {
            Ok(unix) => serve_client(app, ClientStream::unix(unix), ClientAddr::Local(peer)).await,
            Err(e) => tracing::warn!(error = %e, "could not hand a Unix-socket client to a worker"),
        }
    })
}

/// The bound listeners and the app behind them.
pub struct Server {
    pub app: Arc<App>,
    /// One listening socket per worker thread, all on `listen`
    /// (`listen::bind_each`).
    listeners: Vec<std::net::TcpListener>,
    /// The Unix-domain socket, when `unix_socket_dir` is set.
    unix: Option<UnixSocket>,
}

/// The next client of the Unix-domain socket; never, without one.
async fn accept_unix(
    unix: Option<&UnixSocket>,
) -> std::io::Result<(tokio::net::UnixStream, crate::client_addr::LocalPeer)> {
    match unix {
        Some(u) => u.accept().await,
        None => std::future::pending().await,
    }
}

impl Server {
    /// Builds the app and binds `config.listen`.
    pub async fn bind(config: Config, options: StartOptions) -> std::io::Result<Server> {
        let app = App::with_options(config, options)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        Server::bind_app(app).await
    }

    /// Binds `listen` (a socket per worker thread), and the Unix-domain
    /// socket named after its port, for an app already built.
    pub async fn bind_app(app: Arc<App>) -> std::io::Result<Server> {
        let config = app.config();
        let listeners = crate::listen::bind_each(config.listen, config.so_reuseport, app.workers())
            .map_err(|e| std::io::Error::new(e.kind(), format!("listen {}: {e}", config.listen)))?;
        let unix = match &config.unix_socket_dir {
            Some(dir) => Some(UnixSocket::bind(&UnixSocketSettings {
                dir: dir.clone(),
                port: listeners[0].local_addr()?.port(),
                mode: config.unix_socket_mode,
                group: config.unix_socket_group.clone(),
                take_over: config.so_reuseport,
            })?),
            None => None,
        };
        Ok(Server {
            app,
            listeners,
            unix,
        })
    }

    /// The Unix-domain socket's path, when there is one.
    pub fn unix_socket_path(&self) -> Option<&std::path::Path> {
        self.unix.as_ref().map(|u| u.path())
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listeners[0]
            .local_addr()
            .expect("bound listener has an address")
    }

    /// Accepts clients until shutdown begins, then waits up to
    /// `shutdown_timeout` for connected clients to leave; those still there
    /// are ended between transactions, with a short grace to get there.
    /// An error if the worker threads cannot start.
    pub async fn run(self) -> std::io::Result<()> {
        let app = self.app;
        let shards = Shards::start(app.workers()).inspect_err(|e| {
            tracing::error!(error = %e, "cannot start the worker threads");
        })?;
        app.start_background();
        tracing::info!(
            listen = %self.listeners[0].local_addr().map(|a| a.to_string()).unwrap_or_default(),
            unix_socket = %self.unix.as_ref().map(|u| u.path().display().to_string()).unwrap_or_default(),
            "usher is accepting connections"
        );
        // Each shard accepts TCP clients on its own socket; this thread
        // only the Unix-domain socket's, handed round the shards.
        let accepting: Vec<_> = self
            .listeners
            .into_iter()
            .enumerate()
            .map(|(i, listener)| shards.spawn_on(i, accept_tcp(app.clone(), listener)))
            .collect();
        accept_until_shutdown(
            &app,
            "unix clients",
            || accept_unix(self.unix.as_ref()),
            |(stream, peer)| {
                hand_unix(&shards, &app, stream, peer);
            },
        )
        .await;
        // The shards' accept loops take what is queued on their sockets
        // and close them (accept_tcp); the Unix socket's file goes too
        // (unless another usher took it over), what is queued on it first.
        let mut queued = Vec::new();
        for accepting in accepting {
            queued.extend(accepting.await.unwrap_or_default());
        }
        if let Some(unix) = self.unix {
            queued.extend(
                unix.close()
                    .into_iter()
                    .map(|(stream, peer)| hand_unix(&shards, &app, stream, peer)),
            );
        }
        let deadline = Duration::from_secs_f64(app.config().shutdown_timeout);
        tracing::info!(
            clients = app.deps.clients.connected(),
            timeout_s = deadline.as_secs_f64(),
            "shutting down: waiting for clients"
        );
        let waited = tokio::time::timeout(deadline, async {
            // Their logins first: until one starts it is not counted.
            for login in queued {
                let _ = login.await;
            }
            while app.deps.clients.connected() > 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        if waited.is_err() {
            tracing::warn!(
                clients = app.deps.clients.connected(),
                "shutdown_timeout reached; closing remaining clients"
            );
            app.deps.start_drain();
            let _ = tokio::time::timeout(Duration::from_secs(1), async {
                while app.deps.clients.connected() > 0 {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            })
            .await;
        }
        for pool in app.deps.pools.all() {
            pool.close_idle();
        }
        app.deps.builtins.save_state().await;
        tracing::info!("usher stopped");
        Ok(())
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
                "workers",
                "so_reuseport",
                "peer_id",
                "unix_socket_dir",
                "unix_socket_mode",
                "unix_socket_group",
                "hooks.query",
                "hooks.roles_refresh_s",
                "hooks.shared_max_keys",
                "hooks.shared_max_bytes",
                "log.format",
                "auth_monitor",
            ]
        );
    }
}
