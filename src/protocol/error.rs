//! Errors that reach a client as an ErrorResponse.

use bytes::{BufMut, BytesMut};
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
    pub const CANNOT_CONNECT_NOW: &str = "57P03";
    pub const FEATURE_NOT_SUPPORTED: &str = "0A000";
    pub const SYNTAX_ERROR: &str = "42601";
    pub const INSUFFICIENT_PRIVILEGE: &str = "42501";
    pub const INVALID_PARAMETER_VALUE: &str = "22023";
    pub const UNDEFINED_OBJECT: &str = "42704";
    pub const OBJECT_NOT_IN_PREREQUISITE_STATE: &str = "55000";
    pub const INTERNAL_ERROR: &str = "XX000";
    pub const PROGRAM_LIMIT_EXCEEDED: &str = "54000";
    pub const OUT_OF_MEMORY: &str = "53200";
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Severity {
    /// The session ends after this error.
    Fatal,
    /// The statement failed; the session goes on.
    Error,
    Warning,
    Notice,
}

impl Severity {
    pub fn as_str(self) -> &'static str {
        match self {
            Severity::Fatal => "FATAL",
            Severity::Error => "ERROR",
            Severity::Warning => "WARNING",
            Severity::Notice => "NOTICE",
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

    /// Appends this error as an ErrorResponse ('E'), or a NoticeResponse ('N')
    /// for warnings and notices.
    pub fn encode(&self, buf: &mut BytesMut) {
        let tag = match self.severity {
            Severity::Fatal | Severity::Error => b'E',
            Severity::Warning | Severity::Notice => b'N',
        };
        let start = buf.len();
        buf.put_u8(tag);
        buf.put_u32(0);
        let mut field = |code: u8, value: &str| {
            buf.put_u8(code);
            buf.put_slice(value.as_bytes());
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
