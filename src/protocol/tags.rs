//! The one-byte codes of the v3 protocol, named: message types in each
//! direction, transaction status, error fields and the answers to an
//! SSLRequest. Code outside `protocol/` names these instead of writing the
//! byte, so a reader never has to look up what `b'Z'` was.

/// Message types a client sends.
pub mod frontend {
    pub const BIND: u8 = b'B';
    pub const CLOSE: u8 = b'C';
    pub const COPY_DATA: u8 = b'd';
    pub const COPY_DONE: u8 = b'c';
    pub const COPY_FAIL: u8 = b'f';
    pub const DESCRIBE: u8 = b'D';
    pub const EXECUTE: u8 = b'E';
    pub const FLUSH: u8 = b'H';
    pub const FUNCTION_CALL: u8 = b'F';
    pub const PARSE: u8 = b'P';
    /// PasswordMessage, SASLInitialResponse and SASLResponse share it.
    pub const AUTH_RESPONSE: u8 = b'p';
    pub const QUERY: u8 = b'Q';
    pub const SYNC: u8 = b'S';
    pub const TERMINATE: u8 = b'X';
}

/// Message types a server sends.
pub mod backend {
    pub const AUTHENTICATION: u8 = b'R';
    pub const BACKEND_KEY_DATA: u8 = b'K';
    pub const BIND_COMPLETE: u8 = b'2';
    pub const CLOSE_COMPLETE: u8 = b'3';
    pub const COMMAND_COMPLETE: u8 = b'C';
    pub const COPY_BOTH_RESPONSE: u8 = b'W';
    pub const COPY_IN_RESPONSE: u8 = b'G';
    pub const COPY_OUT_RESPONSE: u8 = b'H';
    pub const DATA_ROW: u8 = b'D';
    pub const EMPTY_QUERY_RESPONSE: u8 = b'I';
    pub const ERROR_RESPONSE: u8 = b'E';
    pub const NEGOTIATE_PROTOCOL_VERSION: u8 = b'v';
    pub const NO_DATA: u8 = b'n';
    pub const NOTICE_RESPONSE: u8 = b'N';
    pub const NOTIFICATION_RESPONSE: u8 = b'A';
    pub const PARAMETER_DESCRIPTION: u8 = b't';
    pub const PARAMETER_STATUS: u8 = b'S';
    pub const PARSE_COMPLETE: u8 = b'1';
    pub const READY_FOR_QUERY: u8 = b'Z';
    pub const ROW_DESCRIPTION: u8 = b'T';
}

/// The transaction status in ReadyForQuery.
pub mod status {
    /// Not in a transaction block.
    pub const IDLE: u8 = b'I';
    /// In a transaction block.
    pub const IN_TRANSACTION: u8 = b'T';
    /// In a failed transaction block (queries are refused until it ends).
    pub const FAILED: u8 = b'E';
}

/// Field codes of ErrorResponse and NoticeResponse.
pub mod field {
    /// Severity, possibly localized.
    pub const SEVERITY: u8 = b'S';
    /// Severity, never localized (PostgreSQL 9.6+).
    pub const SEVERITY_RAW: u8 = b'V';
    pub const CODE: u8 = b'C';
    pub const MESSAGE: u8 = b'M';
    pub const DETAIL: u8 = b'D';
    pub const HINT: u8 = b'H';
}

/// What Describe and Close name: a statement or a portal.
pub mod target {
    pub const STATEMENT: u8 = b'S';
    pub const PORTAL: u8 = b'P';
}

/// The one-byte answers to SSLRequest (and GSSENCRequest).
pub mod encryption {
    pub const ACCEPT: u8 = b'S';
    pub const REFUSE: u8 = b'N';
}
