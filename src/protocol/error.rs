//! Errors that reach a client as an ErrorResponse.

use bytes::{BufMut, BytesMut};
use std::borrow::Cow;
use std::fmt;

/// SQLSTATE codes usher uses (see ../shared/REFERENCE.md).
pub mod sqlstate {
    pub const INVALID_PASSWORD: &str = "28P01";
    pub const INVALID_AUTHORIZATION: &str = "28000";
    pub const INVALID_CATALOG_NAME: &str = "3D000";
    pub const TOO_MANY_CONNECTIONS: &str = "53300";
    pub const PROTOCOL_VIOLATION: &str = "08P01";
    pub const QUERY_CANCELED: &str = "57014";
    pub const IDLE_SESSION_TIMEOUT: &str = "57P05";
    pub const IDLE_IN_TRANSACTION_TIMEOUT: &str = "25P03";
    pub const ADMIN_SHUTDOWN: &str = "57P01";
    pub const CONNECTION_FAILURE: &str = "08006";
    /// sqlclient_unable_to_establish_sqlconnection: libpq's, when no host works.
    pub const UNABLE_TO_CONNECT: &str = "08001";
    pub const CANNOT_CONNECT_NOW: &str = "57P03";
    pub const FEATURE_NOT_SUPPORTED: &str = "0A000";
    pub const SYNTAX_ERROR: &str = "42601";
    pub const INSUFFICIENT_PRIVILEGE: &str = "42501";
    pub const INVALID_PARAMETER_VALUE: &str = "22023";
    pub const UNDEFINED_OBJECT: &str = "42704";
    pub const CANT_CHANGE_RUNTIME_PARAM: &str = "55P02";
    pub const OBJECT_NOT_IN_PREREQUISITE_STATE: &str = "55000";
    pub const INTERNAL_ERROR: &str = "XX000";
    pub const PROGRAM_LIMIT_EXCEEDED: &str = "54000";
    pub const OUT_OF_MEMORY: &str = "53200";
    pub const CHARACTER_NOT_IN_REPERTOIRE: &str = "22021";
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Severity {
    /// The session ends after this error.
    Fatal,
    /// The statement failed; the session goes on.
    Error,
    Warning,
    Notice,
    /// Logged, never sent: PostgreSQL's COMMERROR, for input it answers by
    /// closing the connection without a word (a garbled startup packet).
    ServerOnly,
}

impl Severity {
    pub fn as_str(self) -> &'static str {
        match self {
            Severity::Fatal => "FATAL",
            Severity::Error => "ERROR",
            Severity::Warning => "WARNING",
            Severity::Notice => "NOTICE",
            Severity::ServerOnly => "LOG",
        }
    }
}

/// An error (or notice) in PostgreSQL's shape: severity, SQLSTATE, message,
/// and optional detail and hint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PgError {
    pub severity: Severity,
    pub code: String,
    pub message: String,
    pub detail: Option<String>,
    pub hint: Option<String>,
}

impl PgError {
    pub fn fatal(code: &str, message: impl Into<String>) -> Self {
        PgError {
            severity: Severity::Fatal,
            code: code.into(),
            message: message.into(),
            detail: None,
            hint: None,
        }
    }

    pub fn error(code: &str, message: impl Into<String>) -> Self {
        PgError {
            severity: Severity::Error,
            ..PgError::fatal(code, message)
        }
    }

    /// A NOTICE (SQLSTATE 00000) for the client.
    pub fn notice(message: impl Into<String>) -> Self {
        PgError {
            severity: Severity::Notice,
            ..PgError::fatal("00000", message)
        }
    }

    /// A WARNING (SQLSTATE 01000) for the client.
    pub fn warning(message: impl Into<String>) -> Self {
        PgError {
            severity: Severity::Warning,
            ..PgError::fatal("01000", message)
        }
    }

    pub fn with_detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    pub fn with_hint(mut self, hint: impl Into<String>) -> Self {
        self.hint = Some(hint.into());
        self
    }

    pub fn protocol(message: impl Into<String>) -> Self {
        PgError::fatal(sqlstate::PROTOCOL_VIOLATION, message)
    }

    /// An error for the log only: the client is sent nothing (see
    /// [`Severity::ServerOnly`]).
    pub fn server_only(code: &str, message: impl Into<String>) -> Self {
        PgError {
            severity: Severity::ServerOnly,
            ..PgError::fatal(code, message)
        }
    }

    pub fn is_server_only(&self) -> bool {
        self.severity == Severity::ServerOnly
    }

    /// Appends this error as an ErrorResponse ('E'), or a NoticeResponse ('N')
    /// for warnings and notices; nothing for a server-only error. Control
    /// characters in the text (a NUL would end a field early) are escaped,
    /// so the message is always well formed.
    pub fn encode(&self, buf: &mut BytesMut) {
        let tag = match self.severity {
            Severity::Fatal | Severity::Error => b'E',
            Severity::Warning | Severity::Notice => b'N',
            Severity::ServerOnly => return,
        };
        let start = buf.len();
        buf.put_u8(tag);
        buf.put_u32(0);
        let mut field = |code: u8, value: &str| {
            buf.put_u8(code);
            if value.chars().any(escaped) {
                buf.put_slice(escape(value, usize::MAX, false).as_bytes());
            } else {
                buf.put_slice(value.as_bytes());
            }
            buf.put_u8(0);
        };
        field(b'S', self.severity.as_str());
        field(b'V', self.severity.as_str());
        field(b'C', &self.code);
        field(b'M', &self.message);
        if let Some(d) = &self.detail {
            field(b'D', d);
        }
        if let Some(h) = &self.hint {
            field(b'H', h);
        }
        buf.put_u8(0);
        let len = (buf.len() - start - 1) as u32;
        buf[start + 1..start + 5].copy_from_slice(&len.to_be_bytes());
    }
}

/// Control characters other than line breaks and tabs (which hook messages
/// may use) are escaped in whatever usher sends.
fn escaped(c: char) -> bool {
    c.is_control() && !matches!(c, '\n' | '\r' | '\t')
}

/// `s` with control characters escaped (`\x1b`; all of them, or only
/// those [`escaped`] names), cut to about `max` bytes (then `...`).
fn escape(s: &str, max: usize, all: bool) -> String {
    let mut out = String::with_capacity(s.len().min(max));
    for c in s.chars() {
        let before = out.len();
        if c.is_control() && (all || escaped(c)) {
            out.push_str(&format!("\\x{:02x}", c as u32));
        } else {
            out.push(c);
        }
        if out.len() > max {
            out.truncate(before);
            out.push_str("...");
            break;
        }
    }
    out
}

/// A name the client chose (user, database), as an error quotes it: every
/// control character escaped (`\x0a`), so that no error carries a line
/// break or an escape sequence the client sent. Names are bounded already
/// (63 bytes, startup.rs): nothing is cut.
pub fn shown_name(s: &str) -> Cow<'_, str> {
    if s.chars().any(char::is_control) {
        Cow::Owned(escape(s, usize::MAX, true))
    } else {
        Cow::Borrowed(s)
    }
}

/// Client input as it may appear in an error message: at most `max` bytes
/// (then `...`), every control character escaped (`\x1b`), so that an error
/// never echoes raw or unbounded bytes. PostgreSQL quotes names as they
/// are; usher quotes them this way.
pub fn shown(s: &str, max: usize) -> String {
    escape(s, max, true)
}

impl fmt::Display for PgError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {}: {}",
            self.severity.as_str(),
            self.code,
            self.message
        )
    }
}

impl std::error::Error for PgError {}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fields of an encoded ErrorResponse, split at NULs.
    fn fields(buf: &[u8]) -> Vec<&[u8]> {
        let len = u32::from_be_bytes(buf[1..5].try_into().unwrap()) as usize;
        assert_eq!(len + 1, buf.len(), "length matches");
        assert_eq!(&buf[buf.len() - 2..], b"\0\0", "ends with the terminator");
        buf[5..buf.len() - 1]
            .split(|b| *b == 0)
            .filter(|f| !f.is_empty())
            .collect()
    }

    #[test]
    fn control_characters_in_the_text_are_escaped() {
        let mut buf = BytesMut::new();
        PgError::error("42601", "bad\0command \x1b[2J")
            .with_detail("line\nbreak\tand tab")
            .encode(&mut buf);
        let f = fields(&buf);
        assert_eq!(f.len(), 5, "{f:?}");
        assert_eq!(f[3], b"Mbad\\x00command \\x1b[2J");
        assert_eq!(f[4], b"Dline\nbreak\tand tab");
    }

    #[test]
    fn server_only_errors_are_not_sent() {
        let mut buf = BytesMut::new();
        let e = PgError::server_only("08P01", "invalid length of startup packet");
        e.encode(&mut buf);
        assert!(buf.is_empty());
        assert!(e.is_server_only());
    }

    #[test]
    fn shown_escapes_and_bounds_client_input() {
        assert_eq!(shown("alice", 63), "alice");
        assert_eq!(shown("a\nb\x7f\u{85}é", 63), "a\\x0ab\\x7f\\x85é");
        assert_eq!(
            shown(&"x".repeat(100), 10),
            format!("{}...", "x".repeat(10))
        );
        assert_eq!(shown_name("alice"), "alice");
        assert_eq!(shown_name("a\nb\r\t\x1b[2J"), "a\\x0ab\\x0d\\x09\\x1b[2J");
        // An escape is never cut in half.
        assert_eq!(shown("abcdefgh\x01", 10), "abcdefgh...");
    }
}
