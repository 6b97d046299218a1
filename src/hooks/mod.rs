//! The hook framework: code that runs when a session's life changes.
//!
//! A [`Hook`] has one method per event, each with a default that does
//! nothing (as Pingora's proxy phases do), so a hook implements only the
//! events it cares about. Hooks are Lua files from `hooks.dir` ([`lua`]) and
//! built-in Rust hooks. The [`Dispatcher`] holds, per event, an atomically
//! swapped list of the hooks that handle it, and the global switch: an event
//! nobody handles, or any event while hooks are off, costs one atomic load.
//!
//! | event | when | may |
//! |---|---|---|
//! | `auth_attempt` | after every authentication outcome | observe |
//! | `client_connection` | once per client, after authentication, before the welcome and before any server connection | reject, set parameters, fill `vars` |
//! | `session_start` | when the session begins and after each reset (client DISCARD ALL; session mode: a reused server connection) | set parameters; session mode: exec SQL |
//! | `session_end` | the client left | observe |

pub mod builtin;
pub mod cli;
pub(crate) mod context;
pub(crate) mod dispatcher;
pub mod lua;
pub mod query;
pub mod reconnects;
pub mod roles;
pub mod shared;

pub use context::{
    ClientInfo, ConnectionCtx, Rejection, ServerInfo, SessionCtx, SessionEndCtx, SessionReason,
    StartupParams, TlsInfo, VarValue, Vars,
};
pub use dispatcher::{Dispatcher, HookStats};

use crate::auth::AuthAttempt;
use async_trait::async_trait;
use std::fmt;

/// The moments hooks run at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Event {
    AuthAttempt = 0,
    ClientConnection = 1,
    SessionStart = 2,
    SessionEnd = 3,
}

impl Event {
    pub const ALL: [Event; 4] = [
        Event::AuthAttempt,
        Event::ClientConnection,
        Event::SessionStart,
        Event::SessionEnd,
    ];

    /// The name used in Lua files and on the console.
    pub fn name(self) -> &'static str {
        match self {
            Event::AuthAttempt => "auth_attempt",
            Event::ClientConnection => "client_connection",
            Event::SessionStart => "session_start",
            Event::SessionEnd => "session_end",
        }
    }

    pub fn from_name(name: &str) -> Option<Event> {
        Event::ALL.into_iter().find(|e| e.name() == name)
    }
}

impl fmt::Display for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a hook call failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HookError {
    /// The hook raised an error.
    Failed(String),
    /// The hook ran past its time budget (`hooks.timeout_ms`).
    Timeout,
    /// The hook ran out of memory (`hooks.memory_limit_mb`).
    Memory,
}

impl fmt::Display for HookError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HookError::Failed(m) => f.write_str(m),
            HookError::Timeout => f.write_str("hook exceeded its time budget (hooks.timeout_ms)"),
            HookError::Memory => {
                f.write_str("hook exceeded its memory limit (hooks.memory_limit_mb)")
            }
        }
    }
}

/// Code that runs at the events of a session's life. Every method has a
/// default that does nothing; `events` says which ones the hook implements,
/// so the dispatcher calls it only for those.
#[async_trait]
pub trait Hook: Send + Sync {
    /// A name for logs, metrics and SHOW HOOKS (a Lua hook's file name).
    fn name(&self) -> &str;

    /// The events this hook handles.
    fn events(&self) -> Vec<Event>;

    /// Every authentication outcome, success or not. Observe only: an error
    /// is logged and changes nothing.
    async fn auth_attempt(&self, _attempt: &AuthAttempt) -> Result<(), HookError> {
        Ok(())
    }

    /// A client authenticated and is about to be let in. Set
    /// `ctx.reject` to refuse it; add to `ctx.params` to set session
    /// parameters; `ctx.vars` is carried to the client's later events.
    async fn client_connection(&self, _ctx: &mut ConnectionCtx<'_>) -> Result<(), HookError> {
        Ok(())
    }

    /// The client's session begins (or begins again after a reset). Add to
    /// `ctx.params` (applied on every server connection the session uses)
    /// and, in session mode, `ctx.exec`.
    async fn session_start(&self, _ctx: &mut SessionCtx<'_>) -> Result<(), HookError> {
        Ok(())
    }

    /// The client left. Observe only.
    async fn session_end(&self, _ctx: &SessionEndCtx<'_>) -> Result<(), HookError> {
        Ok(())
    }
}
