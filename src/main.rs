//! The `usher` command: run the pooler, or check a configuration.

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;
use usher::config::{Config, LogFormat};

#[derive(Parser)]
#[command(
    name = "usher",
    version,
    about = "A PostgreSQL connection pooler with programmable session hooks"
)]
struct Cli {
    /// The configuration file.
    #[arg(
        long,
        short,
        global = true,
        default_value = "config/usher.yaml",
        env = "USHER_CONFIG"
    )]
    config: PathBuf,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Run the pooler (the default).
    Run,
    /// Validate the configuration and exit (non-zero if it is invalid).
    Check,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let config = match Config::load(&cli.config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("usher: invalid configuration: {e}");
            return ExitCode::from(2);
        }
    };
    // Building the app reads the files the config names (certificates, the
    // auth file, HBA rules), so `check` validates those too.
    let app = match usher::App::new(config) {
        Ok(app) => app,
        Err(e) => {
            eprintln!("usher: invalid configuration: {e}");
            return ExitCode::from(2);
        }
    };
    match cli.command.unwrap_or(Command::Run) {
        Command::Check => {
            println!("{}: configuration is valid", cli.config.display());
            ExitCode::SUCCESS
        }
        Command::Run => run(app),
    }
}

fn run(app: std::sync::Arc<usher::App>) -> ExitCode {
    let config = app.config.clone();
    init_logging(&config);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(async move {
        let server = match usher::Server::bind_app(app).await {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(listen = %config.listen, error = %e, "cannot listen");
                return ExitCode::from(1);
            }
        };
        let app = server.app.clone();
        tokio::spawn(async move {
            use tokio::signal::unix::{signal, SignalKind};
            let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
            let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
            tokio::select! {
                _ = term.recv() => tracing::info!("SIGTERM: shutting down gracefully"),
                _ = int.recv() => tracing::info!("SIGINT: shutting down gracefully"),
            }
            app.begin_shutdown();
            // A second signal means: stop now.
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            tracing::warn!("second signal: exiting immediately");
            std::process::exit(1);
        });
        server.run().await;
        ExitCode::SUCCESS
    })
}

fn init_logging(config: &Config) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("USHER_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&config.log.level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match config.log.format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
}
