//! Configuration: the YAML schema, its defaults and its validation.
//!
//! The file is read with serde; `serde_path_to_error` names the key that was
//! wrong, so every error says the file, the key and what was expected.
//! Unknown keys are errors (`deny_unknown_fields` everywhere). The keys of
//! TLS, credential sources and HBA rules live in [`security`].

pub mod builtins;
pub mod console_set;
pub mod peering;
pub mod reload_guard;
pub mod routing;
pub mod security;
mod servers;
pub mod settings;
pub mod unix_socket;

pub use builtins::{
    AuthMonitorConfig, AuthStoreConfig, BlockAction, BlockRuleConfig, BlockingConfig,
    LockoutConfig, MaintenanceConfig,
};
pub use peering::PeerConfig;
pub use routing::{ResolvedRoute, Route, RouteRefusal, RoutingConfig};
pub use security::{HbaMethod, HbaRuleConfig, HbaType, ServerTlsMode, TlsConfig, TlsMode};
pub use servers::{is_socket_dir, HostSpec, TargetSessionAttrs};
pub use unix_socket::SocketMode;

use serde::Deserialize;
use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

/// How long a server connection stays with one client.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PoolMode {
    /// For the client's whole life; reset with `server_reset_query` at release.
    Session,
    /// For one transaction; released at ReadyForQuery 'I'.
    Transaction,
}

impl fmt::Display for PoolMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PoolMode::Session => "session",
            PoolMode::Transaction => "transaction",
        })
    }
}

/// What transaction mode does with a client whose statements leave state
/// on its server connection that cannot move to another one (LISTEN,
/// session advisory locks, temporary objects, WITH HOLD cursors, SQL
/// PREPARE, LOAD).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Pinning {
    /// The client keeps its server connection until the state is gone or
    /// it leaves (then the connection is reset).
    Auto,
    /// Such statements are refused (0A000) before they reach the server.
    Error,
    /// Nothing is done: the state stays on a connection others get.
    Off,
}

impl fmt::Display for Pinning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Pinning::Auto => "auto",
            Pinning::Error => "error",
            Pinning::Off => "off",
        })
    }
}

/// How clients prove who they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum AuthMethod {
    #[serde(rename = "trust")]
    Trust,
    #[serde(rename = "password")]
    Password,
    #[serde(rename = "md5")]
    Md5,
    #[serde(rename = "scram-sha-256")]
    ScramSha256,
    /// A TLS client certificate whose CN is the user name.
    #[serde(rename = "cert")]
    Cert,
    /// The operating-system user of a Unix-socket client (SO_PEERCRED),
    /// the user name or mapped to it (`auth.ident`).
    #[serde(rename = "peer")]
    Peer,
}

impl AuthMethod {
    /// The name, as in the configuration.
    pub fn as_str(self) -> &'static str {
        match self {
            AuthMethod::Trust => "trust",
            AuthMethod::Password => "password",
            AuthMethod::Md5 => "md5",
            AuthMethod::ScramSha256 => "scram-sha-256",
            AuthMethod::Cert => "cert",
            AuthMethod::Peer => "peer",
        }
    }
}

impl fmt::Display for AuthMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The whole configuration file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Address clients connect to.
    #[serde(default = "defaults::listen")]
    pub listen: SocketAddr,
    /// Clients connected at once; the next one gets 53300.
    #[serde(default = "defaults::max_client_conn")]
    pub max_client_conn: usize,
    /// Server connections over every pool of a database; 0: no cap.
    #[serde(default = "defaults::max_db_connections")]
    pub max_db_connections: usize,
    /// Server connections over every pool of a user; 0: no cap.
    #[serde(default = "defaults::max_user_connections")]
    pub max_user_connections: usize,
    /// Clients of a database at once; 0: no cap.
    #[serde(default = "defaults::max_db_client_connections")]
    pub max_db_client_connections: usize,
    /// Clients of a user at once; 0: no cap.
    #[serde(default = "defaults::max_user_client_connections")]
    pub max_user_client_connections: usize,
    /// Server connections a pool may open beyond `pool_size` for clients
    /// that waited `reserve_pool_timeout`; 0: none.
    #[serde(default = "defaults::reserve_pool_size")]
    pub reserve_pool_size: usize,
    /// Seconds a client waits before the reserve may serve it; 0: never.
    #[serde(default = "defaults::reserve_pool_timeout")]
    pub reserve_pool_timeout: f64,
    /// Default pool mode for every database.
    #[serde(default = "defaults::pool_mode")]
    pub pool_mode: PoolMode,
    /// Server connections per (database, user).
    #[serde(default = "defaults::pool_size")]
    pub pool_size: usize,
    /// Run on a session-mode server connection before it goes back to the pool.
    #[serde(default = "defaults::server_reset_query")]
    pub server_reset_query: String,
    /// Server connections opened ahead of demand per (database, user).
    #[serde(default = "defaults::min_pool_size")]
    pub min_pool_size: usize,
    /// Seconds a client may wait for a server connection before it gets an error.
    #[serde(default = "defaults::query_wait_timeout")]
    pub query_wait_timeout: f64,
    /// Seconds an idle client may stay connected; 0 = forever.
    #[serde(default = "defaults::client_idle_timeout")]
    pub client_idle_timeout: f64,
    /// Seconds a client may sit idle inside a transaction; 0 = forever.
    #[serde(default = "defaults::idle_transaction_timeout")]
    pub idle_transaction_timeout: f64,
    /// Seconds an unused server connection stays open in the pool; 0 = forever.
    #[serde(default = "defaults::server_idle_timeout")]
    pub server_idle_timeout: f64,
    /// Seconds after which a server connection is closed when next released; 0 = forever.
    #[serde(default = "defaults::server_lifetime")]
    pub server_lifetime: f64,
    /// A server connection idle longer than this many seconds is checked with
    /// a round trip before it is handed out; 0 = always check.
    #[serde(default = "defaults::server_check_delay")]
    pub server_check_delay: f64,
    /// Seconds a pool of a database reached through the fallback entry
    /// (`databases."*"`) stays without clients before it is dropped; 0 =
    /// never dropped.
    #[serde(default = "defaults::autodb_idle_timeout")]
    pub autodb_idle_timeout: f64,
    /// Named prepared statements kept per server connection in transaction
    /// mode; 0 turns protocol-level prepared statement support off.
    #[serde(default = "defaults::prepared_statements")]
    pub prepared_statements: usize,
    /// Transaction mode: what a client whose state cannot move gets.
    #[serde(default = "defaults::pinning")]
    pub pinning: Pinning,
    /// Server connections per pool that pinned clients may hold at once
    /// (0: no cap); unset: pool_size - 1, at least 1.
    #[serde(default)]
    pub max_pinned: Option<usize>,
    /// Seconds to open and log in a server connection.
    #[serde(default = "defaults::server_connect_timeout")]
    pub server_connect_timeout: f64,
    /// The longest pause, in seconds, between a pool's attempts to open a
    /// server connection while they fail (the pauses grow to it).
    #[serde(default = "defaults::server_login_retry")]
    pub server_login_retry: f64,
    /// While a pool's attempts to open a server connection fail, a client
    /// that needs one gets the error at once (PgBouncer's behaviour)
    /// instead of waiting for the server to come back.
    #[serde(default = "defaults::server_fast_fail")]
    pub server_fast_fail: bool,
    /// Seconds a client has to send its startup packet and authenticate.
    #[serde(default = "defaults::auth_timeout")]
    pub auth_timeout: f64,
    /// Clients that may be in the startup phase (before authentication
    /// completes) at once; more are refused with 53300.
    #[serde(default = "defaults::max_auth_clients")]
    pub max_auth_clients: usize,
    /// Of those, clients from one address (an IPv6 /64) at once; more from
    /// it are refused with 53300, so that one address cannot take every
    /// login slot.
    #[serde(default = "defaults::max_auth_clients_per_address")]
    pub max_auth_clients_per_address: usize,
    /// Threads that serve clients (tokio worker threads); 0: one per CPU.
    #[serde(default = "defaults::workers")]
    pub workers: usize,
    /// SO_REUSEPORT (and SO_REUSEADDR) on the listening socket: another
    /// usher may bind the same address (a rolling restart).
    #[serde(default = "defaults::so_reuseport")]
    pub so_reuseport: bool,
    /// A Unix-domain socket for clients in this directory:
    /// `.s.PGSQL.<port>`, with the port of `listen`, so that
    /// `psql -h <dir> -p <port>` finds it. None: no socket.
    #[serde(default)]
    pub unix_socket_dir: Option<std::path::PathBuf>,
    /// The socket file's permissions.
    #[serde(default = "defaults::unix_socket_mode")]
    pub unix_socket_mode: SocketMode,
    /// The socket file's group (a name or a number); none: usher's own.
    #[serde(default)]
    pub unix_socket_group: Option<String>,
    /// This instance's id among its peers (1..=16383); 0: peering off.
    #[serde(default = "defaults::peer_id")]
    pub peer_id: u16,
    /// The other instances a cancel request may belong to.
    #[serde(default)]
    pub peers: Vec<PeerConfig>,
    /// Seconds running transactions get to finish on SIGTERM/SIGINT.
    #[serde(default = "defaults::shutdown_timeout")]
    pub shutdown_timeout: f64,
    /// Largest protocol message accepted from a client, in bytes.
    #[serde(default = "defaults::max_message_size")]
    pub max_message_size: usize,
    /// Largest client message usher holds whole (in transaction mode with
    /// prepared_statements: a named Parse, Describe, Close); larger ones
    /// end the session with 54000. Other messages stream through.
    #[serde(default = "defaults::max_buffered_message")]
    pub max_buffered_message: usize,
    /// Seconds a client may take to finish a message usher holds beyond
    /// the first 64 KiB of its read buffer (charged to
    /// `max_buffered_total`); then FATAL 57P05.
    #[serde(default = "defaults::client_message_timeout")]
    pub client_message_timeout: f64,
    /// Bytes all clients together may make usher hold in read buffers
    /// beyond their first 64 KiB each; a client that would pass it ends
    /// with 53200.
    #[serde(default = "defaults::max_buffered_total")]
    pub max_buffered_total: usize,
    /// Client-facing TLS; off when the section is absent.
    #[serde(default)]
    pub tls: TlsConfig,
    #[serde(default)]
    pub auth: AuthConfig,
    #[serde(default)]
    pub databases: BTreeMap<String, DatabaseConfig>,
    #[serde(default)]
    pub users: BTreeMap<String, UserConfig>,
    #[serde(default)]
    pub admin: AdminConfig,
    #[serde(default)]
    pub log: LogConfig,
    /// The file the configuration was read from (for error messages).
    #[serde(skip)]
    pub source: String,
    #[serde(default)]
    pub hooks: HooksConfig,
    #[serde(default)]
    pub metrics: MetricsConfig,
    /// Built-in login auditing and lockout; off when absent.
    pub auth_monitor: Option<AuthMonitorConfig>,
    /// Built-in connection blocking rules and maintenance mode.
    #[serde(default)]
    pub blocking: BlockingConfig,
    /// What client_connection hooks may route clients to; none: no route
    /// is allowed.
    pub routing: Option<RoutingConfig>,
}

/// `metrics:`: the Prometheus endpoint.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsConfig {
    /// Address of the HTTP endpoint serving `/metrics`; none: no endpoint.
    pub listen: Option<SocketAddr>,
    /// Connections the endpoint serves at once; more wait in the listen
    /// backlog (holding no descriptor of usher's).
    #[serde(default = "defaults::metrics_max_connections")]
    pub max_connections: usize,
    /// Seconds a connection has to send its request head, and again to
    /// take the response.
    #[serde(default = "defaults::metrics_request_timeout")]
    pub request_timeout: f64,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig {
            listen: None,
            max_connections: defaults::metrics_max_connections(),
            request_timeout: defaults::metrics_request_timeout(),
        }
    }
}

/// What a client_connection hook failure does to the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnError {
    /// Refuse the client (fail closed).
    Reject,
    /// Let the client in.
    Allow,
}

/// `hooks:`: the hook framework.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HooksConfig {
    /// The global switch (also ENABLE/DISABLE HOOKS, --no-hooks, USHER_HOOKS=off).
    #[serde(default = "defaults::hooks_enabled")]
    pub enabled: bool,
    /// Folder of Lua hook files, relative to the working directory.
    #[serde(default = "defaults::hooks_dir")]
    pub dir: std::path::PathBuf,
    /// A reload may leave no hook file (the folder missing or empty) where
    /// some are loaded; otherwise such a reload is refused.
    #[serde(default = "defaults::hooks_allow_empty")]
    pub allow_empty: bool,
    /// Time budget of one hook call, in milliseconds.
    #[serde(default = "defaults::hooks_timeout_ms")]
    pub timeout_ms: u64,
    /// Memory limit of one Lua VM, in MiB.
    #[serde(default = "defaults::hooks_memory_limit_mb")]
    pub memory_limit_mb: usize,
    #[serde(default = "defaults::hooks_on_error")]
    pub on_error: OnError,
    /// Idle Lua VMs kept for reuse; 0 = twice the number of cores.
    #[serde(default = "defaults::hooks_vms")]
    pub vms: usize,
    /// Where `usher.query` and the role graph ask their questions.
    pub query: Option<HookQueryConfig>,
    /// Seconds between refreshes of the cached role graph.
    #[serde(default = "defaults::roles_refresh_s")]
    pub roles_refresh_s: f64,
    /// Keys `usher.shared` keeps at most.
    #[serde(default = "defaults::shared_max_keys")]
    pub shared_max_keys: usize,
    /// Bytes (keys and values) `usher.shared` keeps at most.
    #[serde(default = "defaults::shared_max_bytes")]
    pub shared_max_bytes: usize,
    /// Bytes (keys and values) a client's `ctx.vars` may hold.
    #[serde(default = "defaults::vars_max_bytes")]
    pub vars_max_bytes: usize,
}

impl Default for HooksConfig {
    fn default() -> Self {
        serde_yaml::from_str("{}").expect("hooks defaults")
    }
}

/// `hooks.query`: a database and user (listed under `users` with a
/// plaintext password) for the hooks' own small connection pool.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HookQueryConfig {
    pub database: String,
    pub user: String,
    #[serde(default = "defaults::query_pool_size")]
    pub pool_size: usize,
    #[serde(default = "defaults::query_timeout_ms")]
    pub timeout_ms: u64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthConfig {
    /// The method for every client, unless HBA rules choose one.
    #[serde(default = "defaults::auth_method")]
    pub method: AuthMethod,
    /// A PgBouncer-style userlist.txt: `"user" "password or verifier"` lines.
    pub file: Option<std::path::PathBuf>,
    /// A user listed under `users` whose password usher uses to run `query`.
    pub user: Option<String>,
    /// Looks up users usher does not know; `$1` is the user name, the result
    /// is (name, secret). Defaults to a pg_shadow lookup when `user` is set.
    pub query: Option<String>,
    /// The database (a key of `databases`) `query` runs in; default: the one
    /// the client asks for.
    pub dbname: Option<String>,
    /// Seconds an auth query result (found or not) is kept; 0 keeps none.
    #[serde(default = "defaults::auth_cache_ttl")]
    pub cache_ttl: f64,
    /// Ordered HBA rules; the first that matches decides the method.
    pub hba: Option<Vec<HbaRuleConfig>>,
    /// The same rules in pg_hba.conf format.
    pub hba_file: Option<std::path::PathBuf>,
    /// User name maps for `peer` rules (`map=name`), as pg_ident.conf.
    pub ident: Option<Vec<IdentEntryConfig>>,
    /// The same maps in pg_ident.conf format.
    pub ident_file: Option<std::path::PathBuf>,
}

/// One entry of `auth.ident`, with pg_ident.conf's columns as keys.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IdentEntryConfig {
    pub map: String,
    /// The operating-system user; `/regex` for an expression.
    pub system_user: String,
    /// The database user; `\1` is the expression's first group, `all` any.
    pub user: String,
}

impl Default for AuthConfig {
    fn default() -> Self {
        AuthConfig {
            method: defaults::auth_method(),
            file: None,
            user: None,
            query: None,
            dbname: None,
            cache_ttl: defaults::auth_cache_ttl(),
            hba: None,
            hba_file: None,
            ident: None,
            ident_file: None,
        }
    }
}

impl AuthConfig {
    /// The auth query, when `user` is set.
    pub fn effective_query(&self) -> Option<&str> {
        self.user.as_ref()?;
        Some(self.query.as_deref().unwrap_or(defaults::auth_query()))
    }
}

/// One database clients may ask for, and where it really lives.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatabaseConfig {
    /// One server; `None` when `hosts` is given (or for the default host).
    /// Read it through [`DatabaseConfig::server_hosts`].
    pub host: Option<String>,
    /// The port of `host`, and of each entry of `hosts` without its own.
    #[serde(default = "defaults::port")]
    pub port: u16,
    /// Several servers (`host` or `host:port` each), tried as `target`
    /// and `load_balance` say (backend/hosts.rs).
    pub hosts: Option<Vec<HostSpec>>,
    /// Which server fits: libpq's target_session_attrs.
    #[serde(default = "defaults::target")]
    pub target: TargetSessionAttrs,
    /// Start at a rotating host instead of the first
    /// (libpq's load_balance_hosts).
    #[serde(default = "defaults::load_balance")]
    pub load_balance: bool,
    /// Name on the server; defaults to the key.
    pub dbname: Option<String>,
    /// TLS to the server: disable | prefer | require | verify-full.
    #[serde(default = "defaults::server_tls")]
    pub tls: ServerTlsMode,
    /// CA file (PEM) the server's certificate must chain to (verify-full).
    pub tls_ca: Option<std::path::PathBuf>,
    pub pool_mode: Option<PoolMode>,
    pub pool_size: Option<usize>,
    pub min_pool_size: Option<usize>,
    pub query_wait_timeout: Option<f64>,
    pub client_idle_timeout: Option<f64>,
    pub idle_transaction_timeout: Option<f64>,
    pub server_idle_timeout: Option<f64>,
    pub server_lifetime: Option<f64>,
    pub server_connect_timeout: Option<f64>,
    pub pinning: Option<Pinning>,
    pub max_pinned: Option<usize>,
    pub max_db_connections: Option<usize>,
    pub max_db_client_connections: Option<usize>,
    pub reserve_pool_size: Option<usize>,
}

/// Debug never shows the password (see [`security::redacted_user`]).
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UserConfig {
    /// Plaintext, an md5 hash (`md5...`) or a SCRAM-SHA-256 verifier. A
    /// value of the wrong type is an error that does not quote it.
    #[serde(default, deserialize_with = "security::secret_string")]
    pub password: Option<String>,
    pub pool_mode: Option<PoolMode>,
    pub pool_size: Option<usize>,
    pub max_user_connections: Option<usize>,
    pub max_user_client_connections: Option<usize>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminConfig {
    /// May use the admin console (database `usher`).
    #[serde(default = "defaults::admin_users")]
    pub users: Vec<String>,
    /// May only SHOW on the admin console.
    #[serde(default = "defaults::admin_stats_users")]
    pub stats_users: Vec<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogConfig {
    /// A tracing filter, e.g. `info` or `usher=debug`.
    #[serde(default = "defaults::log_level")]
    pub level: String,
    #[serde(default = "defaults::log_format")]
    pub format: LogFormat,
    /// A line per connection accepted and per login (ok, or failed with
    /// the reason).
    #[serde(default = "defaults::log_connections")]
    pub connections: bool,
    /// A line per client that leaves: duration, bytes each way, reason.
    #[serde(default = "defaults::log_disconnections")]
    pub disconnections: bool,
}

impl Default for LogConfig {
    fn default() -> Self {
        serde_yaml::from_str("{}").expect("log defaults")
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

/// Serde's defaults, read from the settings table.
mod defaults {
    /// `databases.<name>.host`'s default, as the table writes it (a plain
    /// host name needs no YAML unquoting).
    pub fn host_str() -> &'static str {
        super::settings::default_text("databases.<name>.host")
    }

    settings::defaults_from_table! {
        listen: std::net::SocketAddr = "listen";
        routing_max_pools: usize = "routing.max_pools";
        so_reuseport: bool = "so_reuseport";
        unix_socket_mode: super::SocketMode = "unix_socket_mode";
        peer_id: u16 = "peer_id";
        max_client_conn: usize = "max_client_conn";
        max_db_connections: usize = "max_db_connections";
        max_user_connections: usize = "max_user_connections";
        max_db_client_connections: usize = "max_db_client_connections";
        max_user_client_connections: usize = "max_user_client_connections";
        reserve_pool_size: usize = "reserve_pool_size";
        reserve_pool_timeout: f64 = "reserve_pool_timeout";
        pool_mode: super::PoolMode = "pool_mode";
        pool_size: usize = "pool_size";
        min_pool_size: usize = "min_pool_size";
        server_reset_query: String = "server_reset_query";
        query_wait_timeout: f64 = "query_wait_timeout";
        client_idle_timeout: f64 = "client_idle_timeout";
        idle_transaction_timeout: f64 = "idle_transaction_timeout";
        server_connect_timeout: f64 = "server_connect_timeout";
        server_login_retry: f64 = "server_login_retry";
        server_fast_fail: bool = "server_fast_fail";
        auth_timeout: f64 = "auth_timeout";
        client_message_timeout: f64 = "client_message_timeout";
        shutdown_timeout: f64 = "shutdown_timeout";
        server_idle_timeout: f64 = "server_idle_timeout";
        server_lifetime: f64 = "server_lifetime";
        server_check_delay: f64 = "server_check_delay";
        autodb_idle_timeout: f64 = "autodb_idle_timeout";
        prepared_statements: usize = "prepared_statements";
        pinning: super::Pinning = "pinning";
        max_message_size: usize = "max_message_size";
        max_buffered_message: usize = "max_buffered_message";
        max_buffered_total: usize = "max_buffered_total";
        max_auth_clients: usize = "max_auth_clients";
        workers: usize = "workers";
        max_auth_clients_per_address: usize = "max_auth_clients_per_address";
        metrics_max_connections: usize = "metrics.max_connections";
        metrics_request_timeout: f64 = "metrics.request_timeout";
        tls_mode: super::TlsMode = "tls.mode";
        auth_method: super::AuthMethod = "auth.method";
        auth_cache_ttl: f64 = "auth.cache_ttl";
        port: u16 = "databases.<name>.port";
        target: super::TargetSessionAttrs = "databases.<name>.target";
        load_balance: bool = "databases.<name>.load_balance";
        server_tls: super::ServerTlsMode = "databases.<name>.tls";
        admin_users: Vec<String> = "admin.users";
        admin_stats_users: Vec<String> = "admin.stats_users";
        log_level: String = "log.level";
        log_format: super::LogFormat = "log.format";
        log_connections: bool = "log.connections";
        log_disconnections: bool = "log.disconnections";
        hooks_enabled: bool = "hooks.enabled";
        hooks_dir: std::path::PathBuf = "hooks.dir";
        hooks_allow_empty: bool = "hooks.allow_empty";
        hooks_timeout_ms: u64 = "hooks.timeout_ms";
        hooks_memory_limit_mb: usize = "hooks.memory_limit_mb";
        hooks_on_error: super::OnError = "hooks.on_error";
        hooks_vms: usize = "hooks.vms";
        roles_refresh_s: f64 = "hooks.roles_refresh_s";
        shared_max_keys: usize = "hooks.shared_max_keys";
        shared_max_bytes: usize = "hooks.shared_max_bytes";
        vars_max_bytes: usize = "hooks.vars_max_bytes";
        query_pool_size: usize = "hooks.query.pool_size";
        query_timeout_ms: u64 = "hooks.query.timeout_ms";
    }
    use super::settings;

    /// The auth query used when `auth.user` is set and `auth.query` is not.
    pub fn auth_query() -> &'static str {
        settings::default_text("auth.query")
    }
}

/// The key of `databases` that stands for every database not listed
/// (PgBouncer's `*`): a client of an unlisted database reaches the
/// server's database of the same name through this entry.
pub const FALLBACK_DATABASE: &str = "*";

/// The admin console's database (`psql -d usher`).
pub const ADMIN_DATABASE: &str = "usher";

/// The database names that reach the admin console: usher's, and
/// PgBouncer's, so that PgBouncer tools work. No `databases` key may use them.
pub const ADMIN_DATABASES: [&str; 2] = [ADMIN_DATABASE, "pgbouncer"];

/// True for the database names that reach the console.
pub fn is_admin_database(name: &str) -> bool {
    ADMIN_DATABASES.contains(&name)
}

/// Checks a `log.level` value: a tracing filter.
pub fn check_log_level(filter: &str) -> Result<(), ConfigIssue> {
    tracing_subscriber::EnvFilter::try_new(filter)
        .map(|_| ())
        .map_err(|e| {
            ConfigIssue::new(
                "log.level",
                format!("expected a tracing filter such as `info` or `usher=debug,warn`: {e}"),
            )
        })
}

/// One thing wrong with the configuration: the key (a dotted path) and
/// what was expected. Validation returns it; where the file is known it
/// becomes a [`ConfigError`] ([`ConfigIssue::in_file`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {message}")]
pub struct ConfigIssue {
    pub key: String,
    pub message: String,
}

impl ConfigIssue {
    pub fn new(key: impl Into<String>, message: impl Into<String>) -> ConfigIssue {
        ConfigIssue {
            key: key.into(),
            message: message.into(),
        }
    }

    /// The same issue under a section: `tls_ca` under `databases.app` is
    /// `databases.app.tls_ca`.
    pub fn under(self, section: &str) -> ConfigIssue {
        ConfigIssue {
            key: format!("{section}.{}", self.key),
            message: self.message,
        }
    }

    /// The error that names the file too.
    pub fn in_file(self, file: &str) -> ConfigError {
        ConfigError {
            file: file.to_string(),
            key: self.key,
            message: self.message,
        }
    }
}

/// A configuration that could not be loaded: which file, which key, what was wrong.
#[derive(Debug, thiserror::Error)]
#[error("{file}: {key}: {message}")]
pub struct ConfigError {
    pub file: String,
    /// Dotted path of the offending key, or `(file)` for whole-file errors.
    pub key: String,
    pub message: String,
}

/// The largest number of seconds a setting takes: a century. Larger values
/// cannot be turned into deadlines.
pub const MAX_SECONDS: f64 = 3_153_600_000.0;

/// The largest `hooks.memory_limit_mb` (1 TiB), so the limit in bytes fits.
pub const MAX_HOOK_MEMORY_MB: usize = 1 << 20;

/// True for a number of seconds usher can use: finite, at most
/// [`MAX_SECONDS`], and greater than 0 or (when `zero_ok`) 0.
pub(crate) fn usable_seconds(v: f64, zero_ok: bool) -> bool {
    v.is_finite() && (v > 0.0 || zero_ok && v == 0.0) && v <= MAX_SECONDS
}

/// The dotted key of a serde path, `(top level)` for the root; an empty key
/// is written `""` so that every error names one.
fn key_of(path: &serde_path_to_error::Path) -> String {
    use serde_path_to_error::Segment;
    let mut key = String::new();
    for segment in path.iter() {
        if !key.is_empty() && !matches!(segment, Segment::Seq { .. }) {
            key.push('.');
        }
        match segment {
            Segment::Map { key: k } if k.is_empty() => key.push_str("\"\""),
            other => key.push_str(&other.to_string()),
        }
    }
    if key.is_empty() {
        key.push_str("(top level)");
    }
    key
}

impl Config {
    /// Reads, parses and validates a configuration file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            file: file.clone(),
            key: "(file)".into(),
            message: format!("cannot read: {e}"),
        })?;
        Config::from_yaml(&text, &file)
    }

    /// Parses and validates YAML text; `file` names it in errors. A text
    /// with no YAML in it (empty, or only comments) is an error: every
    /// key would take its default, and usher would run with no users and no
    /// databases (a truncated file, a template that rendered nothing).
    pub fn from_yaml(text: &str, file: &str) -> Result<Config, ConfigError> {
        if matches!(
            serde_yaml::from_str::<serde_yaml::Value>(text),
            Ok(serde_yaml::Value::Null)
        ) {
            return Err(ConfigError {
                file: file.to_string(),
                key: "(file)".into(),
                message: "the file holds no configuration (it is empty, or only comments)".into(),
            });
        }
        let de = serde_yaml::Deserializer::from_str(text);
        let config: Config = serde_path_to_error::deserialize(de).map_err(|e| {
            let key = key_of(e.path());
            ConfigError {
                file: file.to_string(),
                key,
                message: e.into_inner().to_string(),
            }
        })?;
        let mut config = config;
        config.source = file.to_string();
        config.validate().map_err(|issue| issue.in_file(file))?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), ConfigIssue> {
        let err = |key: &str, message: &str| ConfigIssue::new(key, message);
        if self.max_client_conn == 0 {
            return Err(err("max_client_conn", "expected a number greater than 0"));
        }
        if self.pool_size == 0 {
            return Err(err("pool_size", "expected a number greater than 0"));
        }
        check_log_level(&self.log.level)?;
        peering::validate(self.peer_id, &self.peers)?;
        unix_socket::validate(self)?;
        for (key, v) in [
            ("query_wait_timeout", self.query_wait_timeout),
            ("server_connect_timeout", self.server_connect_timeout),
            ("server_login_retry", self.server_login_retry),
            ("auth_timeout", self.auth_timeout),
            ("shutdown_timeout", self.shutdown_timeout),
            ("client_message_timeout", self.client_message_timeout),
        ] {
            if !usable_seconds(v, false) {
                return Err(err(
                    key,
                    "expected a positive number of seconds (at most a century)",
                ));
            }
        }
        for (key, v) in [
            ("client_idle_timeout", self.client_idle_timeout),
            ("idle_transaction_timeout", self.idle_transaction_timeout),
            ("server_idle_timeout", self.server_idle_timeout),
            ("server_lifetime", self.server_lifetime),
            ("server_check_delay", self.server_check_delay),
            ("autodb_idle_timeout", self.autodb_idle_timeout),
        ] {
            if !usable_seconds(v, true) {
                return Err(err(
                    key,
                    "expected a number of seconds (0 turns it off; at most a century)",
                ));
            }
        }
        if self.max_auth_clients_per_address == 0 {
            return Err(err(
                "max_auth_clients_per_address",
                "expected a number greater than 0",
            ));
        }
        if self.metrics.max_connections == 0 {
            return Err(err(
                "metrics.max_connections",
                "expected a number greater than 0",
            ));
        }
        let t = self.metrics.request_timeout;
        if !(t > 0.0 && t.is_finite()) {
            return Err(err(
                "metrics.request_timeout",
                "expected a positive number of seconds",
            ));
        }
        if self.max_message_size < 1024 {
            return Err(err("max_message_size", "expected at least 1024 bytes"));
        }
        if self.max_buffered_message < 1024 {
            return Err(err("max_buffered_message", "expected at least 1024 bytes"));
        }
        if self.max_buffered_total < self.max_buffered_message {
            return Err(err(
                "max_buffered_total",
                "expected at least max_buffered_message",
            ));
        }
        for (name, db) in &self.databases {
            if db.pool_size == Some(0) {
                return Err(err(
                    &format!("databases.{name}.pool_size"),
                    "expected a number greater than 0",
                ));
            }
            for (key, v) in [
                ("query_wait_timeout", db.query_wait_timeout),
                ("server_connect_timeout", db.server_connect_timeout),
                ("client_idle_timeout", db.client_idle_timeout),
                ("idle_transaction_timeout", db.idle_transaction_timeout),
                ("server_idle_timeout", db.server_idle_timeout),
                ("server_lifetime", db.server_lifetime),
            ] {
                if v.is_some_and(|v| !usable_seconds(v, true)) {
                    return Err(err(
                        &format!("databases.{name}.{key}"),
                        "expected a number of seconds (at most a century)",
                    ));
                }
            }
            servers::check(db).map_err(|e| e.under(&format!("databases.{name}")))?;
            if is_admin_database(name) {
                return Err(err(
                    &format!("databases.{name}"),
                    "this name is reserved for the admin console",
                ));
            }
            if name == FALLBACK_DATABASE && db.dbname.is_some() {
                return Err(err(
                    &format!("databases.{name}.dbname"),
                    "the fallback entry connects each client to the server's database of the \
                     client's own name; list a database to give it another name",
                ));
            }
        }
        if self.fallback_database().is_some()
            && self.auth.user.is_some()
            && self.auth.dbname.is_none()
        {
            return Err(err(
                "auth.dbname",
                "expected a listed database for the auth query: with the fallback entry \
                 (databases.\"*\") clients may ask for any database, and the auth query \
                 runs in one database usher lists",
            ));
        }
        for (name, user) in &self.users {
            if user.pool_size == Some(0) {
                return Err(err(
                    &format!("users.{name}.pool_size"),
                    "expected a number greater than 0",
                ));
            }
        }
        if self.hooks.timeout_ms == 0 {
            return Err(err(
                "hooks.timeout_ms",
                "expected a number of milliseconds greater than 0",
            ));
        }
        if self.hooks.memory_limit_mb == 0 || self.hooks.memory_limit_mb > MAX_HOOK_MEMORY_MB {
            return Err(err(
                "hooks.memory_limit_mb",
                "expected a number of MiB from 1 to 1048576",
            ));
        }
        if !usable_seconds(self.hooks.roles_refresh_s, false) {
            return Err(err(
                "hooks.roles_refresh_s",
                "expected a positive number of seconds (at most a century)",
            ));
        }
        if let Some(q) = &self.hooks.query {
            if self.listed_database(&q.database).is_none() {
                return Err(err(
                    "hooks.query.database",
                    &format!(
                        "expected a database listed under `databases`, got `{}`",
                        q.database
                    ),
                ));
            }
            if self.plaintext_password(&q.user).is_none() {
                return Err(err(
                    "hooks.query.user",
                    &format!(
                        "expected a user listed under `users` with a plaintext password, got `{}`",
                        q.user
                    ),
                ));
            }
        }
        for (i, name) in self.admin.users.iter().enumerate() {
            if !self.users.contains_key(name) {
                return Err(err(
                    &format!("admin.users[{i}]"),
                    &format!("expected a user listed under `users`, got `{name}`"),
                ));
            }
        }
        for (i, name) in self.admin.stats_users.iter().enumerate() {
            if !self.users.contains_key(name) {
                return Err(err(
                    &format!("admin.stats_users[{i}]"),
                    &format!("expected a user listed under `users`, got `{name}`"),
                ));
            }
        }
        if let Some(m) = &self.auth_monitor {
            builtins::validate(m)?;
            if let Some(store) = &m.store {
                if self.listed_database(&store.database).is_none() {
                    return Err(err(
                        "auth_monitor.store.database",
                        &format!(
                            "expected a database listed under `databases`, got `{}`",
                            store.database
                        ),
                    ));
                }
                if self.plaintext_password(&store.user).is_none() {
                    return Err(err(
                        "auth_monitor.store.user",
                        &format!(
                            "expected a user listed under `users` with a plaintext password, got `{}`",
                            store.user
                        ),
                    ));
                }
            }
        }
        if let Some(r) = &self.routing {
            r.validate(self)?;
        }
        security::validate(self)
    }

    /// The plaintext password of a user listed under `users` (not an md5
    /// hash or a SCRAM verifier): what usher's own tokio-postgres logins
    /// (hooks.query, the auth monitor's store) present.
    pub fn plaintext_password(&self, user: &str) -> Option<&str> {
        self.users
            .get(user)
            .and_then(|u| u.password.as_deref())
            .filter(|p| !(p.starts_with("SCRAM-SHA-256$") || p.len() == 35 && p.starts_with("md5")))
    }

    /// The entry of a database listed under `databases` (never the
    /// fallback entry).
    pub fn listed_database(&self, name: &str) -> Option<&DatabaseConfig> {
        self.databases
            .get(name)
            .filter(|_| name != FALLBACK_DATABASE)
    }

    /// The databases listed under `databases`, without the fallback entry.
    pub fn listed_databases(&self) -> impl Iterator<Item = (&String, &DatabaseConfig)> {
        self.databases
            .iter()
            .filter(|(name, _)| name.as_str() != FALLBACK_DATABASE)
    }

    /// The fallback entry (`databases."*"`), if there is one.
    pub fn fallback_database(&self) -> Option<&DatabaseConfig> {
        self.databases.get(FALLBACK_DATABASE)
    }

    /// The entry a client's database name resolves to: its own when it is
    /// listed, else the fallback entry (whose `dbname` is the client's
    /// name: [`DatabaseConfig::server_dbname`] gives the key). `None`:
    /// usher has no way to that database.
    pub fn database_for(&self, name: &str) -> Option<&DatabaseConfig> {
        self.databases
            .get(name)
            .or_else(|| self.fallback_database())
    }

    /// True when `name` is reached through the fallback entry (not listed).
    pub fn is_auto_database(&self, name: &str) -> bool {
        self.listed_database(name).is_none() && self.fallback_database().is_some()
    }

    /// The pool mode for a (database, user): user setting, then database, then global.
    pub fn pool_mode_for(&self, db: &str, user: &str) -> PoolMode {
        self.users
            .get(user)
            .and_then(|u| u.pool_mode)
            .or_else(|| self.database_for(db).and_then(|d| d.pool_mode))
            .unwrap_or(self.pool_mode)
    }

    /// The pool size for a (database, user): user setting, then database, then global.
    pub fn pool_size_for(&self, db: &str, user: &str) -> usize {
        self.users
            .get(user)
            .and_then(|u| u.pool_size)
            .or_else(|| self.database_for(db).and_then(|d| d.pool_size))
            .unwrap_or(self.pool_size)
    }

    /// Every limit of the pool for (database, user), with overrides applied
    /// (a database reached through the fallback entry takes that entry's).
    pub fn limits_for(&self, db: &str, user: &str) -> PoolLimits {
        let d = self.database_for(db);
        let u = self.users.get(user);
        let size = self.pool_size_for(db, user);
        let secs = |v: f64| (v > 0.0).then(|| Duration::from_secs_f64(v));
        let pick =
            |f: fn(&DatabaseConfig) -> Option<f64>, global: f64| d.and_then(f).unwrap_or(global);
        PoolLimits {
            mode: self.pool_mode_for(db, user),
            size,
            min_size: d
                .and_then(|d| d.min_pool_size)
                .unwrap_or(self.min_pool_size),
            query_wait_timeout: Duration::from_secs_f64(pick(
                |d| d.query_wait_timeout,
                self.query_wait_timeout,
            )),
            server_connect_timeout: Duration::from_secs_f64(pick(
                |d| d.server_connect_timeout,
                self.server_connect_timeout,
            )),
            client_idle_timeout: secs(pick(|d| d.client_idle_timeout, self.client_idle_timeout)),
            idle_transaction_timeout: secs(pick(
                |d| d.idle_transaction_timeout,
                self.idle_transaction_timeout,
            )),
            server_idle_timeout: secs(pick(|d| d.server_idle_timeout, self.server_idle_timeout)),
            server_lifetime: secs(pick(|d| d.server_lifetime, self.server_lifetime)),
            server_check_delay: Duration::from_secs_f64(self.server_check_delay),
            server_login_retry: Duration::from_secs_f64(self.server_login_retry),
            server_fast_fail: self.server_fast_fail,
            server_reset_query: self.server_reset_query.clone(),
            prepared_statements: self.prepared_statements,
            pinning: d.and_then(|d| d.pinning).unwrap_or(self.pinning),
            max_pinned: d
                .and_then(|d| d.max_pinned)
                .or(self.max_pinned)
                .unwrap_or_else(|| default_max_pinned(size)),
            auto: self.is_auto_database(db),
            autodb_idle_timeout: secs(self.autodb_idle_timeout),
            max_db_connections: d
                .and_then(|d| d.max_db_connections)
                .unwrap_or(self.max_db_connections),
            max_user_connections: u
                .and_then(|u| u.max_user_connections)
                .unwrap_or(self.max_user_connections),
            max_db_client_connections: d
                .and_then(|d| d.max_db_client_connections)
                .unwrap_or(self.max_db_client_connections),
            max_user_client_connections: u
                .and_then(|u| u.max_user_client_connections)
                .unwrap_or(self.max_user_client_connections),
            reserve_size: d
                .and_then(|d| d.reserve_pool_size)
                .unwrap_or(self.reserve_pool_size),
            reserve_timeout: secs(self.reserve_pool_timeout),
        }
    }
}

impl Config {
    /// The tokio-postgres connection settings for `hooks.query`, if configured.
    pub fn hook_query_connection(&self) -> Option<tokio_postgres::Config> {
        let q = self.hooks.query.as_ref()?;
        let db = self.listed_database(&q.database)?;
        let mut c = tokio_postgres::Config::new();
        // tokio-postgres tries the hosts in order; a hook's questions
        // (role membership) read, which any server can answer.
        for (host, port) in db.server_hosts() {
            c.host(&host).port(port);
        }
        c.dbname(db.server_dbname(&q.database))
            .user(&q.user)
            .application_name("usher hooks")
            .connect_timeout(Duration::from_secs_f64(self.server_connect_timeout));
        if let Some(p) = self.users.get(&q.user).and_then(|u| u.password.as_deref()) {
            c.password(p);
        }
        Some(c)
    }
}

/// The limits and timeouts of one pool, resolved from the configuration.
/// `None` means "no limit".
#[derive(Debug, Clone)]
pub struct PoolLimits {
    pub mode: PoolMode,
    pub size: usize,
    pub min_size: usize,
    pub query_wait_timeout: Duration,
    pub server_connect_timeout: Duration,
    pub client_idle_timeout: Option<Duration>,
    pub idle_transaction_timeout: Option<Duration>,
    pub server_idle_timeout: Option<Duration>,
    pub server_lifetime: Option<Duration>,
    pub server_check_delay: Duration,
    /// The longest pause between attempts to open a server connection
    /// while they fail.
    pub server_login_retry: Duration,
    /// While opening server connections fails, clients get the error at
    /// once instead of waiting.
    pub server_fast_fail: bool,
    pub server_reset_query: String,
    pub prepared_statements: usize,
    /// The database is reached through the fallback entry (not listed):
    /// its pool is dropped when unused (see `autodb_idle_timeout`).
    pub auto: bool,
    /// How long an auto database's pool may stay without clients before
    /// it is dropped; `None` (`autodb_idle_timeout: 0`): never.
    pub autodb_idle_timeout: Option<Duration>,
    /// Transaction mode: what a client whose state cannot move gets.
    pub pinning: Pinning,
    /// Server connections pinned clients may hold at once; 0: no cap.
    pub max_pinned: usize,
    /// The caps over many pools (0: none): server connections of the
    /// pool's database, of its user; clients of each.
    pub max_db_connections: usize,
    pub max_user_connections: usize,
    pub max_db_client_connections: usize,
    pub max_user_client_connections: usize,
    /// Connections beyond `size` for clients that waited `reserve_timeout`.
    pub reserve_size: usize,
    pub reserve_timeout: Option<Duration>,
}

/// `max_pinned` when none is set: all but one of the pool's connections
/// (at least one), so a pool of more than one always keeps a connection
/// for clients that do not pin, and a pool of one can still serve a
/// client that does.
pub fn default_max_pinned(pool_size: usize) -> usize {
    pool_size.saturating_sub(1).max(1)
}

impl DatabaseConfig {
    /// The database name on the server for the database clients call `key`.
    pub fn server_dbname<'a>(&'a self, key: &'a str) -> &'a str {
        self.dbname.as_deref().unwrap_or(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minimal_config_gets_defaults() {
        let c = Config::from_yaml("databases: { app: {} }\n", "t.yaml").unwrap();
        assert_eq!(c.listen.port(), 6432);
        assert_eq!(c.pool_mode, PoolMode::Transaction);
        assert_eq!(c.auth.method, AuthMethod::ScramSha256);
        assert_eq!(c.databases["app"].server_dbname("app"), "app");
    }

    #[test]
    fn the_overload_bounds_have_defaults_and_refuse_zero() {
        let c = Config::from_yaml("databases: { app: {} }\n", "t.yaml").unwrap();
        assert_eq!(c.max_auth_clients_per_address, 100);
        assert_eq!(c.metrics.max_connections, 64);
        assert_eq!(c.metrics.request_timeout, 5.0);
        let c = Config::from_yaml("metrics: { listen: 127.0.0.1:9100 }\n", "t.yaml").unwrap();
        assert_eq!(
            c.metrics.max_connections, 64,
            "defaults with a metrics section"
        );
        for (yaml, key) in [
            (
                "max_auth_clients_per_address: 0\n",
                "max_auth_clients_per_address",
            ),
            (
                "metrics: { max_connections: 0 }\n",
                "metrics.max_connections",
            ),
            (
                "metrics: { request_timeout: 0 }\n",
                "metrics.request_timeout",
            ),
            (
                "metrics: { request_timeout: .inf }\n",
                "metrics.request_timeout",
            ),
        ] {
            assert_eq!(
                Config::from_yaml(yaml, "t.yaml").unwrap_err().key,
                key,
                "{yaml}"
            );
        }
    }

    #[test]
    fn unknown_key_names_file_and_key() {
        let e = Config::from_yaml("databases:\n  app:\n    hots: x\n", "u.yaml").unwrap_err();
        assert_eq!(e.file, "u.yaml");
        assert_eq!(e.key, "databases.app.hots");
        assert!(e.message.contains("unknown field `hots`"), "{}", e.message);
    }

    #[test]
    fn numbers_too_large_to_use_are_refused() {
        // Caught by the config fuzz target's checks (on inputs written
        // after reading the code): these passed validation, then panicked
        // where usher turned them into durations, deadlines or bytes.
        for (yaml, key) in [
            ("query_wait_timeout: 1e300\n", "query_wait_timeout"),
            ("server_lifetime: 1e300\n", "server_lifetime"),
            (
                "databases: { app: { server_lifetime: 1e300 } }\n",
                "databases.app.server_lifetime",
            ),
            ("auth: { cache_ttl: 1e300 }\n", "auth.cache_ttl"),
            (
                "hooks: { roles_refresh_s: 1e300 }\n",
                "hooks.roles_refresh_s",
            ),
            (
                "auth_monitor: { state_file: m.json, lockout: { duration_s: 1e19 } }\n",
                "auth_monitor.lockout.duration_s",
            ),
            (
                "hooks: { memory_limit_mb: 18446744073709551615 }\n",
                "hooks.memory_limit_mb",
            ),
        ] {
            let e = Config::from_yaml(yaml, "n.yaml").expect_err(yaml);
            assert_eq!(e.key, key, "{yaml}");
        }
        // A century is still fine.
        Config::from_yaml("server_lifetime: 3153600000\n", "n.yaml").unwrap();
    }

    #[test]
    fn an_empty_key_is_named_too() {
        // Found by fuzzing (fuzz/fuzz_targets/config.rs): the key was "".
        let e = Config::from_yaml("\"\": 1\n", "u.yaml").unwrap_err();
        assert_eq!(e.key, "\"\"");
        let e = Config::from_yaml("databases:\n  app:\n    \"\": x\n", "u.yaml").unwrap_err();
        assert_eq!(e.key, "databases.app.\"\"");
    }

    #[test]
    fn wrong_type_names_key_and_expectation() {
        let e = Config::from_yaml("pool_size: lots\n", "w.yaml").unwrap_err();
        assert_eq!(e.key, "pool_size");
        assert!(e.message.contains("expected"), "{}", e.message);
        let e = Config::from_yaml("pool_mode: statement\n", "w.yaml").unwrap_err();
        assert_eq!(e.key, "pool_mode");
        assert!(e.message.contains("session"), "{}", e.message);
    }

    #[test]
    fn log_keys_default_on_and_level_is_checked() {
        let c = Config::from_yaml("databases: { app: {} }\n", "l.yaml").unwrap();
        assert!(c.log.connections && c.log.disconnections);
        assert_eq!(c.log.level, "info");
        let c = Config::from_yaml(
            "log: { level: \"usher=debug,warn\", format: json, connections: false, disconnections: false }\n",
            "l.yaml",
        )
        .unwrap();
        assert!(!c.log.connections && !c.log.disconnections);
        assert_eq!(c.log.format, LogFormat::Json);
        let e = Config::from_yaml("log: { level: \"usher=loud\" }\n", "l.yaml").unwrap_err();
        assert_eq!(e.key, "log.level");
        let e = Config::from_yaml("log: { connection: false }\n", "l.yaml").unwrap_err();
        assert!(
            e.message.contains("unknown field `connection`"),
            "{}",
            e.message
        );
    }

    #[test]
    fn the_admin_database_names_are_reserved() {
        for name in ADMIN_DATABASES {
            let e = Config::from_yaml(&format!("databases: {{ {name}: {{}} }}\n"), "r.yaml")
                .unwrap_err();
            assert_eq!(e.key, format!("databases.{name}"));
            assert!(is_admin_database(name));
        }
        assert!(!is_admin_database("app"));
    }

    #[test]
    fn an_issue_becomes_an_error_naming_the_file() {
        let e = ConfigIssue::new("tls_ca", "expected a CA file (PEM)")
            .under("databases.app")
            .in_file("c.yaml");
        assert_eq!(
            e.to_string(),
            "c.yaml: databases.app.tls_ca: expected a CA file (PEM)"
        );
        let e = Config::from_yaml("log: { level: \"usher=loud\" }\n", "l.yaml").unwrap_err();
        assert_eq!((e.file.as_str(), e.key.as_str()), ("l.yaml", "log.level"));
    }

    #[test]
    fn admin_users_must_exist() {
        let e = Config::from_yaml("admin: { users: [root] }\n", "a.yaml").unwrap_err();
        assert_eq!(e.key, "admin.users[0]");
    }

    #[test]
    fn pinning_and_max_pinned_are_global_and_per_database() {
        let c = Config::from_yaml(
            "pool_size: 4\ndatabases: { a: { pinning: error, max_pinned: 0 }, b: { pool_size: 1 }, c: {} }\n",
            "p.yaml",
        )
        .unwrap();
        let (a, b, cc) = (
            c.limits_for("a", "u"),
            c.limits_for("b", "u"),
            c.limits_for("c", "u"),
        );
        assert_eq!((a.pinning, a.max_pinned), (Pinning::Error, 0));
        assert_eq!((b.pinning, b.max_pinned), (Pinning::Auto, 1));
        assert_eq!((cc.pinning, cc.max_pinned), (Pinning::Auto, 3));
        let c = Config::from_yaml(
            "pinning: off\nmax_pinned: 2\ndatabases: { a: {} }\n",
            "p.yaml",
        )
        .unwrap();
        let a = c.limits_for("a", "u");
        assert_eq!((a.pinning, a.max_pinned), (Pinning::Off, 2));
        let e = Config::from_yaml("pinning: sometimes\n", "p.yaml").unwrap_err();
        assert_eq!(e.key, "pinning");
    }

    #[test]
    fn per_database_and_user_overrides() {
        let c = Config::from_yaml(
            "pool_size: 3\ndatabases: { a: { pool_size: 5, pool_mode: session }, b: {} }\nusers: { u: { pool_size: 7 } }\n",
            "o.yaml",
        )
        .unwrap();
        assert_eq!(c.pool_size_for("a", "x"), 5);
        assert_eq!(c.pool_size_for("b", "x"), 3);
        assert_eq!(c.pool_size_for("a", "u"), 7);
        assert_eq!(c.pool_mode_for("a", "x"), PoolMode::Session);
        assert_eq!(c.pool_mode_for("b", "x"), PoolMode::Transaction);
    }

    #[test]
    fn the_fallback_entry_serves_unlisted_databases_under_their_own_name() {
        let c = Config::from_yaml(
            "databases: { app: { pool_size: 5 }, \"*\": { port: 5433, pool_size: 7, pool_mode: session } }\n",
            "f.yaml",
        )
        .unwrap();
        assert_eq!(c.autodb_idle_timeout, 3600.0);
        let any = c.database_for("reports").expect("through \"*\"");
        assert_eq!((any.port, any.server_dbname("reports")), (5433, "reports"));
        assert!(c.is_auto_database("reports") && !c.is_auto_database("app"));
        assert!(c.listed_database("*").is_none());
        assert_eq!(c.listed_databases().count(), 1);
        let auto = c.limits_for("reports", "u");
        assert!(auto.auto);
        assert_eq!(auto.autodb_idle_timeout, Some(Duration::from_secs(3600)));
        assert_eq!((auto.size, auto.mode), (7, PoolMode::Session));
        let listed = c.limits_for("app", "u");
        assert!(!listed.auto);
        assert_eq!((listed.size, listed.mode), (5, PoolMode::Transaction));
        // Without "*" nothing resolves but the listed.
        let c = Config::from_yaml("databases: { app: {} }\n", "f.yaml").unwrap();
        assert!(c.database_for("reports").is_none() && !c.is_auto_database("reports"));
        let c = Config::from_yaml(
            "autodb_idle_timeout: 0\ndatabases: { \"*\": {} }\n",
            "f.yaml",
        )
        .unwrap();
        assert_eq!(c.limits_for("x", "u").autodb_idle_timeout, None, "0: never");
    }

    #[test]
    fn the_fallback_entry_refuses_what_cannot_work() {
        for (yaml, key) in [
            (
                "databases: { \"*\": { dbname: app } }\n",
                "databases.*.dbname",
            ),
            ("autodb_idle_timeout: -1\n", "autodb_idle_timeout"),
            (
                "databases: { app: {}, \"*\": {} }\nusers: { a: { password: pw } }\nauth: { user: a }\n",
                "auth.dbname",
            ),
            (
                "databases: { app: {}, \"*\": {} }\nusers: { a: { password: pw } }\nauth: { user: a, dbname: \"*\" }\n",
                "auth.dbname",
            ),
            (
                "databases: { \"*\": {} }\nusers: { a: { password: pw } }\nhooks: { query: { database: \"*\", user: a } }\n",
                "hooks.query.database",
            ),
        ] {
            let e = Config::from_yaml(yaml, "f.yaml").expect_err(yaml);
            assert_eq!(e.key, key, "{yaml}: {}", e.message);
        }
        Config::from_yaml(
            "databases: { app: {}, \"*\": {} }\nusers: { a: { password: pw } }\nauth: { user: a, dbname: app }\n",
            "f.yaml",
        )
        .expect("the auth query in a listed database");
    }

    #[test]
    fn limits_resolve_per_database_and_zero_means_off() {
        let c = Config::from_yaml(
            "server_lifetime: 0\nclient_idle_timeout: 5\ndatabases: { a: { client_idle_timeout: 0, server_lifetime: 9, min_pool_size: 2 }, b: {} }\n",
            "l.yaml",
        )
        .unwrap();
        let a = c.limits_for("a", "u");
        assert_eq!(a.client_idle_timeout, None);
        assert_eq!(a.server_lifetime, Some(Duration::from_secs(9)));
        assert_eq!(a.min_size, 2);
        let b = c.limits_for("b", "u");
        assert_eq!(b.client_idle_timeout, Some(Duration::from_secs(5)));
        assert_eq!(b.server_lifetime, None);
        assert_eq!(b.server_idle_timeout, Some(Duration::from_secs(600)));
        let e =
            Config::from_yaml("databases: { a: { server_lifetime: -1 } }\n", "l.yaml").unwrap_err();
        assert_eq!(e.key, "databases.a.server_lifetime");
    }
}
