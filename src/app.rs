//! The running pooler: state shared by all client tasks, the accept loop,
//! and graceful shutdown.

use crate::auth::Secret;
use crate::config::Config;
use crate::frontend::prepared::StatementRegistry;
use crate::frontend::registry::ClientRegistry;
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
    shutdown: watch::Sender<bool>,
}

impl App {
    pub fn new(config: Config) -> Arc<App> {
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
        Arc::new(App {
            config: Arc::new(config),
            secrets,
            pools: Pools::new(),
            clients: Arc::new(ClientRegistry::default()),
            statements: StatementRegistry::default(),
            mock_key,
            shutdown: watch::channel(false).0,
        })
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
    /// Binds `config.listen`.
    pub async fn bind(config: Config) -> std::io::Result<Server> {
        let listener = TcpListener::bind(config.listen).await?;
        Ok(Server {
            app: App::new(config),
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
