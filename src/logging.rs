//! Logging: tracing to stderr, as text or JSON lines (`log.format`), with a
//! level (`log.level`, a tracing filter) that can change while usher runs.
//!
//! Text has colours only when stderr is a terminal. `USHER_LOG` overrides
//! `log.level` at start. [`set_level`] swaps the filter
//! through `tracing_subscriber::reload`; the format is fixed at start.
//! Which connection events are logged (`log.connections`,
//! `log.disconnections`) is read from the configuration where they happen.

use crate::config::{LogConfig, LogFormat};
use parking_lot::Mutex;
use std::io::IsTerminal;
use std::sync::OnceLock;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{fmt, reload, EnvFilter, Registry};

/// What [`set_level`] needs once [`init`] has run.
struct Live {
    filter: reload::Handle<EnvFilter, Registry>,
    /// The `log.level` last applied from the configuration (or given at
    /// start), so that a reload that leaves it alone keeps a `USHER_LOG`
    /// override.
    configured: Mutex<String>,
}

static LIVE: OnceLock<Live> = OnceLock::new();

/// Installs the global subscriber: `USHER_LOG` if set (and valid), else
/// `config.level`; text or JSON lines on stderr. Call once, at start; later
/// calls change nothing.
pub fn init(config: &LogConfig) {
    let filter = EnvFilter::try_from_env("USHER_LOG").unwrap_or_else(|_| parse(&config.level));
    let (filter, handle) = reload::Layer::new(filter);
    let json = config.format == LogFormat::Json;
    // Colours only on a terminal: not in journald or a log file.
    let ansi = std::io::stderr().is_terminal();
    let text_layer = (!json).then(|| fmt::layer().with_ansi(ansi).with_writer(std::io::stderr));
    let json_layer = json.then(|| fmt::layer().json().with_writer(std::io::stderr));
    let installed = tracing_subscriber::registry()
        .with(filter)
        .with(text_layer)
        .with(json_layer)
        .try_init();
    if installed.is_ok() {
        let _ = LIVE.set(Live {
            filter: handle,
            configured: Mutex::new(config.level.clone()),
        });
    }
}

/// Changes the log level (a tracing filter such as `info` or
/// `usher=debug,warn`) while usher runs. A filter equal to the one last
/// configured changes nothing, so a configuration reload that leaves
/// `log.level` alone keeps the `USHER_LOG` override of the start. An invalid
/// filter is an error and the running one stays. Without [`init`] (tests,
/// `usher check`) this does nothing and succeeds.
pub fn set_level(filter: &str) -> Result<(), LevelError> {
    let new = EnvFilter::try_new(filter).map_err(|e| LevelError::Invalid {
        filter: filter.to_string(),
        reason: e.to_string(),
    })?;
    let Some(live) = LIVE.get() else {
        return Ok(());
    };
    let mut configured = live.configured.lock();
    if *configured == filter {
        return Ok(());
    }
    live.filter
        .reload(new)
        .map_err(|e| LevelError::Reload(e.to_string()))?;
    *configured = filter.to_string();
    tracing::info!(level = filter, "log level changed");
    Ok(())
}

/// Why the log level was not changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LevelError {
    #[error("invalid log.level {filter:?}: {reason}")]
    Invalid { filter: String, reason: String },
    #[error("cannot change the log level: {0}")]
    Reload(String),
}

/// The filter for `level`; an invalid one (which validation refuses) falls
/// back to `info`.
fn parse(level: &str) -> EnvFilter {
    EnvFilter::try_new(level).unwrap_or_else(|_| EnvFilter::new("info"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_level_without_init_is_a_checked_no_op() {
        assert_eq!(set_level("usher=debug,warn"), Ok(()));
        assert!(set_level("usher=loud").is_err());
    }

    #[test]
    fn levels_are_checked() {
        use crate::config::check_log_level;
        assert!(check_log_level("info").is_ok());
        assert!(check_log_level("usher=debug,tokio_postgres=warn").is_ok());
        assert!(check_log_level("usher=loud").is_err());
    }
}
