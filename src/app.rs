//! The running pooler: state shared by all client tasks, the accept loop,
//! and graceful shutdown.

use crate::auth::Secret;
use crate::config::{Config, OnError};
use crate::frontend::prepared::StatementRegistry;
use crate::frontend::registry::ClientRegistry;
use crate::hooks::lua::{LoadError, LuaEngine, LuaServices, LuaSettings};
use crate::hooks::query::QueryPool;
use crate::hooks::roles::RoleCache;
use crate::hooks::shared::SharedStore;
use crate::hooks::{Dispatcher, Hook};
use crate::pool::Pools;
use rand::RngCore;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// Everything client tasks share. Read-mostly; nothing here is locked on the
/// forwarding path.
#[derive(Debug)]
pub struct App {
    pub config: Arc<Config>,
    /// Secrets of the users in the config, parsed once.
    pub secrets: HashMap<String, Secret>,
    pub pools: Pools,
    pub clients: Arc<ClientRegistry>,
    /// Server-side names of prepared statements, shared by all clients.
    pub statements: StatementRegistry,
    /// Salts the fake SCRAM exchange for unknown users.
    pub mock_key: [u8; 32],
    /// The hooks of every event and the global switch.
    pub hooks: Dispatcher,
    /// What Lua hooks reach beyond their VMs (shared store, role graph,
    /// query pool); survives reloads.
    pub lua_services: Arc<LuaServices>,
    shutdown: watch::Sender<bool>,
}

/// How usher was started, beyond the configuration file.
#[derive(Debug, Clone, Default)]
pub struct StartOptions {
    /// `--no-hooks` / `USHER_HOOKS=off`: start with the hook switch off.
    pub hooks_off: bool,
}

impl App {
    /// Builds the app and loads the hooks. Broken hook files stop start-up,
    /// unless hooks start switched off (the recovery path): then they are
    /// reported and RELOAD can bring them in once fixed.
    pub fn new(config: Config, options: StartOptions) -> anyhow::Result<Arc<App>> {
        let secrets = config
            .users
            .iter()
            .filter_map(|(name, u)| {
                u.password
                    .as_deref()
                    .map(|p| (name.clone(), Secret::parse(p)))
            })
            .collect();
        let mut mock_key = [0u8; 32];
        rand::thread_rng().fill_bytes(&mut mock_key);
        let h = &config.hooks;
        let enabled = h.enabled && !options.hooks_off;
        let query = Arc::new(QueryPool::new(
            config.hook_query_connection(),
            h.query.as_ref().map_or(1, |q| q.pool_size),
            Duration::from_millis(h.query.as_ref().map_or(1000, |q| q.timeout_ms)),
        ));
        let roles = Arc::new(RoleCache::default());
        if query.configured() {
            roles.spawn_refresher(query.clone(), Duration::from_secs_f64(h.roles_refresh_s));
        }
        let lua_services = Arc::new(LuaServices {
            shared: SharedStore::new(h.shared_max_keys),
            roles,
            query,
        });
        let app = Arc::new(App {
            hooks: Dispatcher::new(enabled, h.on_error == OnError::Allow),
            config: Arc::new(config),
            secrets,
            pools: Pools::new(),
            clients: Arc::new(ClientRegistry::default()),
            statements: StatementRegistry::default(),
            mock_key,
            lua_services,
            shutdown: watch::channel(false).0,
        });
        match app.reload_hooks() {
            Ok(n) => tracing::info!(files = n, enabled, "hooks loaded"),
            Err(errors) if !enabled => {
                for e in &errors {
                    tracing::error!(error = %e, "hook file failed to load (hooks are off; fix it and RELOAD)");
                }
            }
            Err(errors) => {
                let list: Vec<String> = errors.iter().map(|e| e.to_string()).collect();
                anyhow::bail!(
                    "hooks failed to load:\n  {}\n(start with --no-hooks or USHER_HOOKS=off to run without them)",
                    list.join("\n  ")
                );
            }
        }
        Ok(app)
    }

    /// The Lua engine settings from the configuration.
    pub fn lua_settings(config: &Config) -> LuaSettings {
        let h = &config.hooks;
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        LuaSettings {
            dir: h.dir.clone(),
            timeout: Duration::from_millis(h.timeout_ms),
            memory_limit: h.memory_limit_mb * 1024 * 1024,
            max_idle_vms: if h.vms == 0 { cores * 2 } else { h.vms },
        }
    }

    /// Compiles the hook files anew and swaps them in; if any file fails,
    /// the running set stays. Returns how many files were loaded.
    pub fn reload_hooks(&self) -> Result<usize, Vec<LoadError>> {
        let engine = LuaEngine::load(App::lua_settings(&self.config), self.lua_services.clone())?;
        let hooks: Vec<Arc<dyn Hook>> = engine.hooks();
        let files = engine.file_names().len();
        self.hooks.set_hooks(hooks);
        Ok(files)
    }

    /// True for users listed in the config.
    pub fn user_exists(&self, user: &str) -> bool {
        self.config.users.contains_key(user)
    }

    /// Starts a graceful shutdown: stop accepting, end clients at their next
    /// idle moment.
    pub fn begin_shutdown(&self) {
        self.shutdown.send_replace(true);
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
    /// Binds `config.listen` and builds the app.
    pub async fn bind(config: Config, options: StartOptions) -> anyhow::Result<Server> {
        let listener = TcpListener::bind(config.listen)
            .await
            .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", config.listen))?;
        Ok(Server {
            app: App::new(config, options)?,
            listener,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("bound listener has an address")
    }

    /// Accepts clients until shutdown begins, then waits up to
    /// `shutdown_timeout` for connected clients to finish.
    pub async fn run(self) {
        let app = self.app;
        let mut shutdown = app.shutting_down();
        tracing::info!(listen = %self.listener.local_addr().map(|a| a.to_string()).unwrap_or_default(), "usher is accepting connections");
        loop {
            tokio::select! {
                accepted = self.listener.accept() => match accepted {
                    Ok((stream, addr)) => {
                        let app = app.clone();
                        tokio::spawn(crate::frontend::login::handle_client(app, stream, addr));
                    }
                    Err(e) => {
                        // Out of file descriptors and the like: back off briefly.
                        tracing::error!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
                _ = async { let _ = shutdown.wait_for(|s| *s).await; } => break,
            }
        }
        drop(self.listener);
        let deadline = Duration::from_secs_f64(app.config.shutdown_timeout);
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
        }
        for pool in app.pools.all() {
            pool.close_idle();
        }
        tracing::info!("usher stopped");
    }
}
