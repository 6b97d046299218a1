//! The signal handlers: what an operator does to a running usher without
//! the console.

use crate::admin::operations;
use crate::app::App;
use crate::frontend::deps::ShutdownMode;
use std::sync::Arc;

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
                    // Off the workers, and not awaited here: the other
                    // signals are still heard meanwhile.
                    tokio::spawn(app.clone().reload_off_workers());
                }
                _ = term.recv() => {
                    if mode.is_some() {
                        tracing::warn!("second SIGTERM: exiting immediately");
                        std::process::exit(1);
                    }
                    tracing::info!("SIGTERM: shutting down once clients leave (WAIT_FOR_CLIENTS)");
                    mode = Some(ShutdownMode::WaitForClients);
                    app.deps.shutdown_with(ShutdownMode::WaitForClients);
                }
                _ = int.recv() => {
                    if mode == Some(ShutdownMode::WaitForServers) {
                        tracing::warn!("second SIGINT: exiting immediately");
                        std::process::exit(1);
                    }
                    tracing::info!("SIGINT: shutting down as transactions end (WAIT_FOR_SERVERS)");
                    mode = Some(ShutdownMode::WaitForServers);
                    app.deps.shutdown_with(ShutdownMode::WaitForServers);
                }
                _ = quit.recv() => {
                    tracing::warn!("SIGQUIT: exiting immediately");
                    std::process::exit(1);
                }
                _ = usr1.recv() => {
                    tracing::info!("SIGUSR1: pausing every database");
                    let app = app.clone();
                    tokio::spawn(async move {
                        let _ = operations::pause(&app.deps, None).await;
                        tracing::info!("SIGUSR1: every database is paused");
                    });
                }
                _ = usr2.recv() => {
                    tracing::info!("SIGUSR2: resuming every database");
                    let _ = operations::resume(&app.deps, None);
                }
            }
        }
    });
}
