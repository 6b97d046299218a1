//! What operators do to a running usher, shared by the admin console and
//! the signals: PAUSE/RESUME, RECONNECT, KILL, KILL_CLIENT (PgBouncer's
//! meanings), and the signal handlers themselves.

use crate::app::{App, ReloadError, ReloadReport, ShutdownMode};
use crate::protocol::error::sqlstate;
use crate::protocol::PgError;
use std::sync::Arc;

impl App {
    /// PAUSE [db]: no server connection is lent any more (clients wait, up
    /// to query_wait_timeout); returns once every lent connection came back,
    /// with the idle ones closed. `None`: every database.
    pub async fn pause(&self, database: Option<&str>) -> Result<(), PgError> {
        self.known_database(database)?;
        let pools = self.pools.pause(database);
        tracing::warn!(database = database.unwrap_or("(all)"), "PAUSE");
        for pool in pools {
            pool.drained().await;
        }
        Ok(())
    }

    /// RESUME [db]: lends again; waiting clients go on.
    pub fn resume(&self, database: Option<&str>) -> Result<(), PgError> {
        self.known_database(database)?;
        self.pools.resume(database);
        tracing::warn!(database = database.unwrap_or("(all)"), "RESUME");
        Ok(())
    }

    /// RECONNECT [db]: every server connection is replaced: idle ones now,
    /// lent ones when they come back.
    pub fn reconnect(&self, database: Option<&str>) -> Result<(), PgError> {
        self.known_database(database)?;
        for pool in self.pools.of(database) {
            pool.reconnect();
        }
        tracing::warn!(database = database.unwrap_or("(all)"), "RECONNECT");
        Ok(())
    }

    /// KILL [db]: ends every client of the database at once and closes its
    /// server connections; it stays paused (new clients wait) until RESUME.
    /// Returns how many clients were ended.
    pub fn kill(&self, database: Option<&str>) -> Result<usize, PgError> {
        self.known_database(database)?;
        let pools = self.pools.pause(database);
        let mut killed = 0;
        for client in self.clients.all() {
            let db = client.facts.database.as_str();
            // The console's own clients are not a database's clients.
            if !crate::admin::is_admin_database(db) && database.is_none_or(|d| db == d) {
                client.kill();
                killed += 1;
            }
        }
        for pool in pools {
            pool.reconnect();
        }
        tracing::warn!(
            database = database.unwrap_or("(all)"),
            clients = killed,
            "KILL"
        );
        Ok(killed)
    }

    /// KILL_CLIENT id: ends one client (its `id` in SHOW CLIENTS).
    pub fn kill_client(&self, id: u64) -> Result<(), PgError> {
        let client = self.clients.by_id(id).ok_or_else(|| {
            PgError::error(
                sqlstate::UNDEFINED_OBJECT,
                format!("no client with id {id}"),
            )
            .with_hint("SHOW CLIENTS lists the ids")
        })?;
        tracing::warn!(id, user = %client.facts.user, database = %client.facts.database, addr = %client.facts.addr, "KILL_CLIENT");
        client.kill();
        Ok(())
    }

    fn known_database(&self, database: Option<&str>) -> Result<(), PgError> {
        match database {
            Some(d) if !self.config().databases.contains_key(d) => Err(PgError::error(
                sqlstate::INVALID_CATALOG_NAME,
                format!("no such database: {}", crate::protocol::error::shown(d, 64)),
            )),
            _ => Ok(()),
        }
    }

    /// Reloads and logs the outcome (SIGHUP).
    pub fn reload_and_log(&self) -> Result<ReloadReport, ReloadError> {
        let result = self.reload();
        if let Err(e) = &result {
            tracing::error!(error = %e, "reload failed; the running configuration and hooks stay");
        }
        result
    }
}

/// Handles the signals, as PgBouncer does:
/// - SIGHUP: reload the configuration and hooks;
/// - SIGTERM: stop accepting, let clients finish (WAIT_FOR_CLIENTS); a
///   second SIGTERM exits at once;
/// - SIGINT: stop accepting, end each client once its transaction is over
///   (WAIT_FOR_SERVERS); a second SIGINT exits at once;
/// - SIGQUIT: exit at once;
/// - SIGUSR1: PAUSE; SIGUSR2: RESUME.
pub fn spawn_signal_handlers(app: Arc<App>) {
    use tokio::signal::unix::{signal, SignalKind};
    let handler = |kind: SignalKind| signal(kind).expect("install a signal handler");
    let (mut hup, mut term, mut int, mut quit, mut usr1, mut usr2) = (
        handler(SignalKind::hangup()),
        handler(SignalKind::terminate()),
        handler(SignalKind::interrupt()),
        handler(SignalKind::quit()),
        handler(SignalKind::user_defined1()),
        handler(SignalKind::user_defined2()),
    );
    tokio::spawn(async move {
        let mut mode: Option<ShutdownMode> = None;
        loop {
            tokio::select! {
                _ = hup.recv() => {
                    tracing::info!("SIGHUP: reloading the configuration and hooks");
                    let _ = app.reload_and_log();
                }
                _ = term.recv() => {
                    if mode.is_some() {
                        tracing::warn!("second SIGTERM: exiting immediately");
                        std::process::exit(1);
                    }
                    tracing::info!("SIGTERM: shutting down once clients leave (WAIT_FOR_CLIENTS)");
                    mode = Some(ShutdownMode::WaitForClients);
                    app.shutdown_with(ShutdownMode::WaitForClients);
                }
                _ = int.recv() => {
                    if mode == Some(ShutdownMode::WaitForServers) {
                        tracing::warn!("second SIGINT: exiting immediately");
                        std::process::exit(1);
                    }
                    tracing::info!("SIGINT: shutting down as transactions end (WAIT_FOR_SERVERS)");
                    mode = Some(ShutdownMode::WaitForServers);
                    app.shutdown_with(ShutdownMode::WaitForServers);
                }
                _ = quit.recv() => {
                    tracing::warn!("SIGQUIT: exiting immediately");
                    std::process::exit(1);
                }
                _ = usr1.recv() => {
                    tracing::info!("SIGUSR1: pausing every database");
                    let app = app.clone();
                    tokio::spawn(async move {
                        let _ = app.pause(None).await;
                        tracing::info!("SIGUSR1: every database is paused");
                    });
                }
                _ = usr2.recv() => {
                    tracing::info!("SIGUSR2: resuming every database");
                    let _ = app.resume(None);
                }
            }
        }
    });
}
