//! The record of one authentication attempt. Every outcome produces one; the
//! hook framework and auth monitoring consume them, and they are logged.

use crate::client_addr::ClientAddr;
use std::fmt;

/// How an authentication attempt ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthOutcome {
    Success,
    WrongPassword,
    UnknownUser,
    HbaReject,
    TlsRequired,
    Timeout,
    ProtocolError,
    /// Refused before authentication (too many clients, unknown database).
    Refused,
    /// Refused before authentication by the auth monitor's lockout (too
    /// many failures of the user or from the address).
    Locked,
}

impl AuthOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            AuthOutcome::Success => "success",
            AuthOutcome::WrongPassword => "wrong_password",
            AuthOutcome::UnknownUser => "unknown_user",
            AuthOutcome::HbaReject => "hba_reject",
            AuthOutcome::TlsRequired => "tls_required",
            AuthOutcome::Timeout => "timeout",
            AuthOutcome::ProtocolError => "protocol_error",
            AuthOutcome::Refused => "refused",
            AuthOutcome::Locked => "locked",
        }
    }
}

impl fmt::Display for AuthOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One authentication attempt. Holds no secret of any kind.
#[derive(Debug, Clone)]
pub struct AuthAttempt {
    /// The user name as the client gave it.
    pub user: String,
    pub user_exists: bool,
    pub database: String,
    pub client_addr: ClientAddr,
    pub method: String,
    pub outcome: AuthOutcome,
}

impl AuthAttempt {
    /// Writes the attempt to the log: successes at info, failures at warn.
    pub fn log(&self) {
        if self.outcome == AuthOutcome::Success {
            tracing::info!(
                user = %self.user, database = %self.database, addr = %self.client_addr,
                method = %self.method, outcome = %self.outcome, "login ok"
            );
        } else {
            tracing::warn!(
                user = %self.user, user_exists = self.user_exists, database = %self.database,
                addr = %self.client_addr, method = %self.method, outcome = %self.outcome,
                "login failed"
            );
        }
    }
}
