//! Logging: tracing to stderr, as text or JSON lines (`log.format`), with a
//! level (`log.level`, a tracing filter) that can change while usher runs.
//!
//! Text has colours only when stderr is a terminal. In text, every control
//! character of the message and of every field value is escaped (`\x0a`,
//! [`EscapedFields`]): a user name, a database name or a hook's
//! `usher.log` text holding a newline cannot write a line of its own, nor
//! an ANSI sequence reach a terminal (JSON escapes them itself). `USHER_LOG` overrides
//! `log.level` at start. [`set_level`] swaps the filter
//! through `tracing_subscriber::reload`; the format is fixed at start.
//! Which connection events are logged (`log.connections`,
//! `log.disconnections`) is read from the configuration where they happen.

use crate::config::{LogConfig, LogFormat};
use parking_lot::Mutex;
use std::fmt::{self as stdfmt, Write as _};
use std::io::IsTerminal;
use std::sync::OnceLock;
use tracing::field::{Field, Visit};
use tracing_subscriber::field::{MakeVisitor, VisitFmt, VisitOutput};
use tracing_subscriber::fmt::format::Writer;
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
    let text_layer = (!json).then(|| {
        fmt::layer()
            .fmt_fields(EscapedFields)
            .with_ansi(ansi)
            .with_writer(std::io::stderr)
    });
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

/// The text format's fields: tracing's own layout (the message, then
/// `name=value` pairs, values as `Debug` shows them), with every control
/// character escaped as `\x0a` on the way out, in the message and in every
/// value, however it was recorded (`%` Display values and the message are
/// not escaped by tracing-subscriber).
#[derive(Debug, Clone, Copy, Default)]
pub struct EscapedFields;

impl<'w> MakeVisitor<Writer<'w>> for EscapedFields {
    type Visitor = EscapedVisitor<'w>;

    fn make_visitor(&self, writer: Writer<'w>) -> EscapedVisitor<'w> {
        EscapedVisitor {
            writer,
            first: true,
            result: Ok(()),
        }
    }
}

/// Writes one event's (or span's) fields for [`EscapedFields`].
pub struct EscapedVisitor<'w> {
    writer: Writer<'w>,
    first: bool,
    result: stdfmt::Result,
}

impl EscapedVisitor<'_> {
    fn write(&mut self, field: &Field, value: stdfmt::Arguments<'_>) {
        let name = field.name();
        // tracing-log's metadata of a `log` record, shown elsewhere.
        if self.result.is_err() || name.starts_with("log.") {
            return;
        }
        let w = &mut self.writer;
        let sep = if std::mem::take(&mut self.first) {
            ""
        } else {
            " "
        };
        self.result = (|| {
            w.write_str(sep)?;
            if name != "message" {
                let name = name.strip_prefix("r#").unwrap_or(name);
                if w.has_ansi_escapes() {
                    // Italic name, dimmed `=`, as tracing-subscriber's own.
                    write!(w, "\x1b[3m{name}\x1b[0m\x1b[2m=\x1b[0m")?;
                } else {
                    write!(w, "{name}=")?;
                }
            }
            Escaping(w).write_fmt(value)
        })();
    }
}

impl Visit for EscapedVisitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.write(field, format_args!("{value}"));
        } else {
            self.write(field, format_args!("{value:?}"));
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn stdfmt::Debug) {
        self.write(field, format_args!("{value:?}"));
    }
}

impl VisitOutput<stdfmt::Result> for EscapedVisitor<'_> {
    fn finish(self) -> stdfmt::Result {
        self.result
    }
}

impl VisitFmt for EscapedVisitor<'_> {
    fn writer(&mut self) -> &mut dyn stdfmt::Write {
        &mut self.writer
    }
}

/// A writer that escapes control characters (`\x1b`) in what goes through.
struct Escaping<'a, W: stdfmt::Write>(&'a mut W);

impl<W: stdfmt::Write> stdfmt::Write for Escaping<'_, W> {
    fn write_str(&mut self, s: &str) -> stdfmt::Result {
        let mut rest = s;
        while let Some((at, c)) = rest.char_indices().find(|(_, c)| c.is_control()) {
            self.0.write_str(&rest[..at])?;
            write!(self.0, "\\x{:02x}", c as u32)?;
            rest = &rest[at + c.len_utf8()..];
        }
        self.0.write_str(rest)
    }
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

    /// What the text format writes for one event.
    fn text_line(event: impl FnOnce()) -> String {
        use std::sync::{Arc, Mutex as StdMutex};
        #[derive(Clone, Default)]
        struct Buf(Arc<StdMutex<Vec<u8>>>);
        impl std::io::Write for Buf {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buf = Buf::default();
        let out = buf.clone();
        let subscriber = tracing_subscriber::fmt()
            .fmt_fields(EscapedFields)
            .with_ansi(false)
            .without_time()
            .with_writer(move || out.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, event);
        let bytes = buf.0.lock().unwrap().clone();
        String::from_utf8(bytes).unwrap()
    }

    #[test]
    fn control_characters_in_text_log_fields_are_escaped() {
        let user = "alice\n2099-01-01T00:00:00Z  INFO forged";
        let line = text_line(|| {
            tracing::info!(user = %user, database = "db\x1b[2J", n = 3, "hook says \r\n{}", "\x07");
        });
        assert_eq!(line.matches('\n').count(), 1, "one line: {line:?}");
        assert!(!line.contains('\x1b') && !line.contains('\x07') && !line.contains('\r'));
        assert!(line.contains("hook says \\x0d\\x0a\\x07"), "{line}");
        assert!(line.contains("user=alice\\x0a2099"), "{line}");
        assert!(line.contains(r#"database="db\u{1b}[2J""#), "{line}");
        assert!(line.contains(" n=3"), "{line}");
    }

    #[test]
    fn levels_are_checked() {
        use crate::config::check_log_level;
        assert!(check_log_level("info").is_ok());
        assert!(check_log_level("usher=debug,tokio_postgres=warn").is_ok());
        assert!(check_log_level("usher=loud").is_err());
    }
}
