//! What hooks see and what they decide, per event.

use crate::client_addr::ClientAddr;
use crate::config::{PoolMode, Route};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// TLS details of a client connection.
#[derive(Debug, Clone, Default)]
pub struct TlsInfo {
    pub version: String,
    pub cipher: String,
    /// Subject of the client certificate, if one was presented.
    pub client_cert_subject: Option<String>,
}

/// The startup packet's parameters, as sent, in one allocation (every
/// idle client keeps them): `name\0value\0` pairs, as on the wire.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct StartupParams(Box<str>);

impl StartupParams {
    /// (name, value) pairs in the order sent.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> + '_ {
        let mut parts = self.0.split_terminator('\0');
        std::iter::from_fn(move || Some((parts.next()?, parts.next().unwrap_or(""))))
    }

    pub fn len(&self) -> usize {
        self.iter().count()
    }

    /// The pairs as packed: `name\0value\0` each.
    pub fn packed(&self) -> &str {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The value of `name`, if it was sent.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.iter().find(|(k, _)| *k == name).map(|(_, v)| v)
    }
}

impl<K: AsRef<str>, V: AsRef<str>> FromIterator<(K, V)> for StartupParams {
    /// Names and values hold no NUL (they come from C strings); one that
    /// does is cut there.
    fn from_iter<I: IntoIterator<Item = (K, V)>>(pairs: I) -> Self {
        let mut packed = String::new();
        for (k, v) in pairs {
            for part in [k.as_ref(), v.as_ref()] {
                packed.push_str(part.split('\0').next().unwrap_or(""));
                packed.push('\0');
            }
        }
        StartupParams(packed.into_boxed_str())
    }
}

impl From<Vec<(String, String)>> for StartupParams {
    fn from(pairs: Vec<(String, String)>) -> Self {
        pairs.into_iter().collect()
    }
}

impl std::fmt::Debug for StartupParams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// Facts about a connected client, fixed for its life.
#[derive(Debug, Clone)]
pub struct ClientInfo {
    /// usher's own id for the connection (the BackendKeyData pid in
    /// transaction mode; session mode tells the backend's pid).
    pub id: u32,
    /// Shared with the client's registry entry (`ClientFacts`): every
    /// idle client keeps one copy of each, not two.
    pub user: Arc<str>,
    pub database: Arc<str>,
    pub application_name: Arc<str>,
    /// The startup packet's parameters, as sent.
    pub startup: StartupParams,
    pub addr: ClientAddr,
    /// Boxed: most clients have none, and each idle client keeps this.
    pub tls: Option<Box<TlsInfo>>,
    /// The method's name (`AuthMethod::as_str`).
    pub auth_method: &'static str,
    pub pool_mode: PoolMode,
}

/// A value in `ctx.vars`.
#[derive(Debug, Clone, PartialEq)]
pub enum VarValue {
    Str(String),
    Int(i64),
    Num(f64),
    Bool(bool),
}

/// Values hooks keep for a client between its events.
pub type Vars = BTreeMap<String, VarValue>;

/// A hook's refusal of a client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    pub message: String,
    /// Default 28000 (invalid_authorization_specification).
    pub sqlstate: String,
    pub detail: Option<String>,
    pub hint: Option<String>,
    /// The hook that refused.
    pub hook: String,
}

/// client_connection: what the hook sees and decides.
#[derive(Debug)]
pub struct ConnectionCtx<'a> {
    pub client: &'a ClientInfo,
    pub vars: &'a mut Vars,
    pub reject: Option<Rejection>,
    /// Session parameters to set, in order.
    pub params: Vec<(String, String)>,
    /// Notices for the client.
    pub notices: Vec<String>,
    /// Where the client's session goes (`ctx:route{...}`), and the hook
    /// that said so; none: where its startup packet says.
    pub route: Option<(Route, String)>,
}

/// Why session_start fired.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionReason {
    /// The client's session begins.
    NewSession,
    /// The client sent DISCARD ALL.
    DiscardAll,
    /// Session mode: a pooled server connection, reset with
    /// server_reset_query, begins serving this client.
    ReusedServer,
}

impl SessionReason {
    pub fn as_str(self) -> &'static str {
        match self {
            SessionReason::NewSession => "new_session",
            SessionReason::DiscardAll => "discard_all",
            SessionReason::ReusedServer => "reused_server",
        }
    }
}

/// The server connection a session_start runs with (session mode).
#[derive(Debug, Clone)]
pub struct ServerInfo {
    pub backend_pid: u32,
    pub server_version: String,
    /// Opened for this session (true) or reused from the pool.
    pub fresh: bool,
}

/// session_start: what the hook sees and decides.
#[derive(Debug)]
pub struct SessionCtx<'a> {
    pub client: &'a ClientInfo,
    pub vars: &'a mut Vars,
    pub reason: SessionReason,
    pub server: Option<ServerInfo>,
    /// Session parameters to set, in order.
    pub params: Vec<(String, String)>,
    /// Session mode: statements to run on the server connection.
    pub exec: Vec<String>,
    pub notices: Vec<String>,
    /// Hook failures, sent to the client as WARNINGs.
    pub warnings: Vec<String>,
}

/// session_end: what the hook sees.
#[derive(Debug)]
pub struct SessionEndCtx<'a> {
    pub client: &'a ClientInfo,
    pub vars: &'a Vars,
    pub duration: Duration,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn startup_parameters_are_kept_packed_in_their_order() {
        let p: StartupParams = vec![
            ("user".to_string(), "alice".to_string()),
            ("options".to_string(), String::new()),
            ("application_name".to_string(), "psql".to_string()),
        ]
        .into();
        assert_eq!(
            p.iter().collect::<Vec<_>>(),
            [
                ("user", "alice"),
                ("options", ""),
                ("application_name", "psql")
            ]
        );
        assert_eq!(p.len(), 3);
        assert_eq!(p.get("application_name"), Some("psql"));
        assert_eq!(p.get("database"), None);
        assert!(StartupParams::default().is_empty());
        assert_eq!(StartupParams::default().iter().count(), 0);
    }
}
