//! The `usher` command: run the pooler, or check a configuration.

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;
use usher::config::Config;

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
    /// Start with hooks switched off (also USHER_HOOKS=off): the recovery
    /// path when a hook rejects everyone.
    #[arg(long, global = true)]
    no_hooks: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Run the pooler (the default).
    Run,
    /// Validate the configuration and exit (non-zero if it is invalid).
    Check,
    /// Work with hook files: check them, or try them on a made-up client.
    #[command(subcommand)]
    Hooks(usher::hooks::cli::HooksCommand),
}

fn main() -> ExitCode {
    large_blocks_go_back_to_the_system();
    let cli = Cli::parse();
    let config = match Config::load(&cli.config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("usher: invalid configuration: {e}");
            return ExitCode::from(2);
        }
    };
    let command = cli.command.unwrap_or(Command::Run);
    if let Command::Hooks(cmd) = command {
        return usher::hooks::cli::run(&config, cmd);
    }
    let hooks_off =
        cli.no_hooks || std::env::var("USHER_HOOKS").is_ok_and(|v| v.eq_ignore_ascii_case("off"));
    let mut endpoint = None;
    if matches!(command, Command::Run) {
        usher::logging::init(&config.log);
        // Before the app registers its metrics (pools, hooks).
        match usher::metrics::install(&config.metrics) {
            Ok(e) => endpoint = e,
            Err(e) => {
                eprintln!("usher: {e}");
                return ExitCode::from(1);
            }
        }
    }
    // Building the app reads the files the config names (certificates, the
    // auth file, HBA rules, hook files), so `check` validates those too.
    let app = match usher::App::with_options(config, usher::app::StartOptions { hooks_off }) {
        Ok(app) => app,
        Err(e) => {
            eprintln!("usher: invalid configuration: {e}");
            return ExitCode::from(2);
        }
    };
    match command {
        Command::Check => {
            println!("{}: configuration is valid", cli.config.display());
            ExitCode::SUCCESS
        }
        _ => run(app, endpoint),
    }
}

/// A large block (a held message's buffer, up to max_buffered_message)
/// comes from mmap and goes back to the system when freed. glibc raises
/// its mmap threshold whenever such a block is freed (up to 32 MiB), after
/// which blocks that size come from its heaps and stay resident: after a
/// burst of large named Parses had ended, usher kept most of the peak
/// (twelve 15 MB Parses: 63 to 115 MB more than before the burst; with the
/// threshold fixed, 0.5 to 16 MB; tests/it/memory.rs). Setting it fixes it,
/// and the trim threshold, at glibc's initial 128 KiB; buffers usher uses
/// on every transaction (16 KiB) are well under it.
fn large_blocks_go_back_to_the_system() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: sets one malloc parameter, before any other thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024);
    }
}

fn run(app: std::sync::Arc<usher::App>, endpoint: Option<usher::metrics::Endpoint>) -> ExitCode {
    let config = app.config();
    // This thread accepts the Unix-domain socket's clients and runs the
    // signal handlers, the metrics endpoint and the background work; TCP
    // clients are accepted and every client served by the worker threads
    // `Server::run` starts (src/shards.rs).
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(async move {
        let server = match usher::Server::bind_app(app).await {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(listen = %config.listen, error = %e, "cannot listen");
                eprintln!("usher: cannot listen: {e}");
                return ExitCode::from(1);
            }
        };
        usher::signals::spawn_signal_handlers(server.app.clone());
        if let Some(endpoint) = endpoint {
            tokio::spawn(endpoint.serve());
        }
        match server.run().await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("usher: cannot start the worker threads: {e}");
                ExitCode::from(1)
            }
        }
    })
}
