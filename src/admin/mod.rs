//! The admin console: the virtual database `usher` (also `pgbouncer`, so
//! PgBouncer tools work), simple query protocol only.
//!
//! `admin.users` may run every command; `admin.stats_users` only SHOW.
//! Names in commands (`RESET AUTH_MON alice`, `MAINTENANCE ON admins`) are
//! taken as written; double quotes may surround them.

mod clients;
pub(crate) mod operations;
mod stats;

use crate::config::console_set::SetError;
use crate::config::ConfigError;
use crate::frontend::client_registry::Registration;
use crate::frontend::client_stream::ClientStream;
use crate::frontend::close_with_error;
use crate::frontend::deps::{SessionDeps, ShutdownMode};
use crate::hooks::builtin::{AuthMonitor, Table};
use crate::hooks::lua::LoadError;
use crate::protocol::error::{shown, sqlstate};
use crate::protocol::messages::{self, read_message};
use crate::protocol::tags::{frontend, status};
use crate::protocol::PgError;
use bytes::BytesMut;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use tokio::io::AsyncWriteExt;

/// The console's database names are the configuration's (no `databases`
/// key may take them).
pub use crate::config::{is_admin_database, ADMIN_DATABASE};

/// What the console asks of the running pooler as a whole, beyond the
/// state sessions share: it owns the configuration file and the hook files.
pub trait Pooler: Send + Sync {
    /// RELOAD: the configuration file and the hook files, all or nothing
    /// (logged either way). Prepared off the runtime's workers; the
    /// running set serves until the new one is ready.
    fn reload(
        self: Arc<Self>,
    ) -> Pin<Box<dyn Future<Output = Result<ReloadReport, ReloadError>> + Send>>;

    /// SET key = value: the running configuration with one value changed,
    /// applied as RELOAD applies a file, until the next RELOAD.
    fn set(
        self: Arc<Self>,
        key: String,
        value: String,
    ) -> Pin<Box<dyn Future<Output = Result<(), SetError>> + Send>>;

    /// MAINTENANCE ON role / MAINTENANCE OFF (`None`): whether it changed.
    fn set_maintenance<'a>(
        &'a self,
        role: Option<&'a str>,
    ) -> Pin<Box<dyn Future<Output = Result<bool, PgError>> + Send + 'a>>;

    /// RECONNECT `database` (all, without one) was done: what hooks are
    /// told by `usher.reconnects`.
    fn reconnected(&self, _database: Option<&str>) {}
}

/// What a successful reload did.
#[derive(Debug, Default)]
pub struct ReloadReport {
    /// Hook files loaded.
    pub hook_files: usize,
    /// Keys whose new value needs a restart; their old value stays.
    pub restart_needed: Vec<&'static str>,
}

/// Why a reload was refused; the running configuration and hooks stay.
#[derive(Debug)]
pub enum ReloadError {
    Config(ConfigError),
    Hooks(Vec<LoadError>),
}

impl std::fmt::Display for ReloadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReloadError::Config(e) => write!(f, "{e}"),
            ReloadError::Hooks(errors) => {
                let list: Vec<String> = errors.iter().map(|e| e.to_string()).collect();
                write!(f, "{}", list.join("\n"))
            }
        }
    }
}

/// What a console user may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Admin,
    Stats,
}

/// A logged-in console session (listed by SHOW CLIENTS like any client).
pub struct Console {
    deps: Arc<SessionDeps>,
    pooler: Arc<dyn Pooler>,
    role: Role,
    registration: Registration,
}

impl Console {
    /// Checks the (already authenticated) user may use the console and sends the welcome.
    pub async fn login(
        deps: Arc<SessionDeps>,
        pooler: Arc<dyn Pooler>,
        stream: &mut ClientStream,
        registration: Registration,
    ) -> Result<Console, PgError> {
        let user = &*registration.handle.facts.user;
        let config = deps.config();
        let admin = &config.admin;
        let role = if admin.users.iter().any(|u| u == user) {
            Role::Admin
        } else if admin.stats_users.iter().any(|u| u == user) {
            Role::Stats
        } else {
            return Err(PgError::fatal(
                sqlstate::INSUFFICIENT_PRIVILEGE,
                format!(
                    "user \"{}\" may not use the admin console",
                    crate::protocol::error::shown_name(user)
                ),
            )
            .with_hint("list the user under admin.users or admin.stats_users"));
        };
        let mut out = BytesMut::new();
        messages::authentication_ok(&mut out);
        for (k, v) in [
            ("server_version", env!("CARGO_PKG_VERSION")),
            ("server_encoding", "UTF8"),
            ("client_encoding", "UTF8"),
            ("DateStyle", "ISO, MDY"),
            ("integer_datetimes", "on"),
            ("standard_conforming_strings", "on"),
            ("application_name", "usher"),
        ] {
            messages::parameter_status(&mut out, k, v);
        }
        messages::backend_key_data(&mut out, 0, 0);
        messages::ready_for_query(&mut out, status::IDLE);
        stream
            .write_all(&out)
            .await
            .map_err(|_| PgError::protocol("client went away"))?;
        Ok(Console {
            deps,
            pooler,
            role,
            registration,
        })
    }

    /// Answers simple queries until the client leaves or is killed.
    pub async fn serve(self, mut stream: ClientStream) {
        let handle = self.registration.handle.clone();
        let reason = tokio::select! {
            _ = self.answer(&mut stream) => "client",
            _ = handle.killed() => {
                let e = PgError::fatal(
                    sqlstate::ADMIN_SHUTDOWN,
                    "terminating connection due to administrator command",
                );
                close_with_error(&mut stream, &e).await;
                "killed"
            }
        };
        if self.deps.config().log.disconnections {
            let facts = &handle.facts;
            let duration = handle.connect_time.elapsed().unwrap_or_default();
            tracing::info!(
                user = %facts.user, database = %facts.database, addr = %facts.addr,
                duration_ms = duration.as_millis() as u64, reason,
                "console client disconnected"
            );
        }
    }

    async fn answer(&self, stream: &mut ClientStream) {
        // Between commands the console ends with the other clients when
        // usher drains (SHUTDOWN, SIGINT), so it does not hold the exit up.
        let mut drain = self.deps.draining();
        loop {
            let read = tokio::select! {
                read = read_message(stream, 64 * 1024) => Some(read),
                _ = async { drop(drain.wait_for(|d| *d).await) } => None,
            };
            let Some(read) = read else {
                let e = PgError::fatal(
                    sqlstate::ADMIN_SHUTDOWN,
                    "terminating connection because usher is shutting down",
                );
                return close_with_error(stream, &e).await;
            };
            let msg = match read {
                Ok(Some(m)) => m,
                Ok(None) => return,
                Err(e) => return close_with_error(stream, &e).await,
            };
            let mut out = BytesMut::new();
            match msg.tag {
                frontend::TERMINATE => return,
                frontend::QUERY => {
                    let result = match query_text(&msg.body) {
                        Ok(sql) => self.run(sql).await,
                        Err(e) => Err(e),
                    };
                    match result {
                        Ok(reply) => reply.encode(&mut out),
                        Err(e) => {
                            crate::frontend::count_error(&e);
                            e.encode(&mut out)
                        }
                    }
                    messages::ready_for_query(&mut out, status::IDLE);
                }
                _ => {
                    let e = PgError::fatal(
                        sqlstate::FEATURE_NOT_SUPPORTED,
                        "the admin console supports only the simple query protocol",
                    );
                    return close_with_error(stream, &e).await;
                }
            }
            if stream.write_all(&out).await.is_err() {
                return;
            }
        }
    }

    /// Runs one console command.
    async fn run(&self, sql: &str) -> Result<Reply, PgError> {
        let command = parse_command(sql)?;
        if command.needs_admin() {
            self.require_admin()?;
        }
        match command {
            Command::Empty => Ok(Reply::Empty),
            Command::Show(what) => self.show(&what),
            Command::EnableHooks => {
                self.deps.hooks.set_enabled(true);
                Ok(Reply::Command("ENABLE HOOKS".into()))
            }
            Command::DisableHooks => {
                self.deps.hooks.set_enabled(false);
                Ok(Reply::Command("DISABLE HOOKS".into()))
            }
            Command::Reload => self.reload().await,
            Command::Set { key, value } => {
                self.pooler
                    .clone()
                    .set(key, value.clone())
                    .await
                    .map_err(|e| set_error(e, &value))?;
                Ok(Reply::Command("SET".into()))
            }
            Command::Pause(db) => {
                operations::pause(&self.deps, db.as_deref()).await?;
                Ok(Reply::Command("PAUSE".into()))
            }
            Command::Resume(db) => {
                operations::resume(&self.deps, db.as_deref())?;
                Ok(Reply::Command("RESUME".into()))
            }
            Command::Reconnect(db) => {
                operations::reconnect(&self.deps, db.as_deref())?;
                self.pooler.reconnected(db.as_deref());
                Ok(Reply::Command("RECONNECT".into()))
            }
            Command::Kill(db) => {
                operations::kill(&self.deps, db.as_deref())?;
                Ok(Reply::Command("KILL".into()))
            }
            Command::KillClient(id) => {
                operations::kill_client(&self.deps, id)?;
                Ok(Reply::Command("KILL_CLIENT".into()))
            }
            Command::ResetAuthMon(target) => {
                let monitor = self.auth_monitor()?;
                match target {
                    None => {
                        monitor.reset_all();
                        tracing::warn!("RESET AUTH_MON: every counter cleared");
                    }
                    Some(AuthMonTarget::Address(addr)) => {
                        let removed = monitor.reset_address(addr);
                        tracing::warn!(what = %addr, removed, "RESET AUTH_MON");
                    }
                    Some(AuthMonTarget::Role(role)) => {
                        let removed = monitor.reset_role(&role);
                        tracing::warn!(what = %role, removed, "RESET AUTH_MON");
                    }
                }
                Ok(Reply::Command("RESET".into()))
            }
            Command::MaintenanceOn(role) => {
                self.pooler.set_maintenance(Some(&role)).await?;
                Ok(Reply::Command("MAINTENANCE ON".into()))
            }
            Command::MaintenanceOff => {
                self.pooler.set_maintenance(None).await?;
                Ok(Reply::Command("MAINTENANCE OFF".into()))
            }
            Command::Shutdown(mode) => {
                tracing::warn!(?mode, "SHUTDOWN from the admin console");
                self.deps.shutdown_with(mode);
                Ok(Reply::Command("SHUTDOWN".into()))
            }
        }
    }

    /// RELOAD: the configuration file and the hook files, all or nothing.
    async fn reload(&self) -> Result<Reply, PgError> {
        match self.pooler.clone().reload().await {
            Ok(report) if report.restart_needed.is_empty() => Ok(Reply::Command("RELOAD".into())),
            Ok(report) => {
                // Applied, but some changes wait for a restart: say which.
                let keys = report.restart_needed.join(", ");
                Ok(Reply::Notice(
                    PgError::warning(format!(
                        "reloaded, but these keys need a restart to change: {keys}"
                    )),
                    "RELOAD".into(),
                ))
            }
            Err(e) => Err(PgError::error(
                sqlstate::INVALID_PARAMETER_VALUE,
                "reload failed; the running configuration and hooks stay",
            )
            .with_detail(e.to_string())),
        }
    }

    fn require_admin(&self) -> Result<(), PgError> {
        match self.role {
            Role::Admin => Ok(()),
            Role::Stats => Err(PgError::error(
                sqlstate::INSUFFICIENT_PRIVILEGE,
                "admin access needed for this command",
            )),
        }
    }

    fn show(&self, what: &str) -> Result<Reply, PgError> {
        match what {
            "HELP" => Ok(Reply::rows(
                &["command"],
                [
                    "SHOW HELP|VERSION|STATE|POOLS|CLIENTS|SERVERS|HOOKS",
                    "SHOW STATS|STATS_TOTALS|STATS_AVERAGES|DATABASES|USERS|LISTS|CONFIG",
                    "SHOW AUTH_MON|AUTH_MON_UNKNOWN|AUTH_MON_ADDRS|AUTH_STORE",
                    "SHOW BLOCKING|PEERS",
                    "PAUSE [<db>]",
                    "RESUME [<db>]",
                    "RECONNECT [<db>]",
                    "KILL [<db>]",
                    "KILL_CLIENT <id>",
                    "RELOAD",
                    "SET <key> = <value>",
                    "ENABLE HOOKS",
                    "DISABLE HOOKS",
                    "RESET AUTH_MON [role|address]",
                    "MAINTENANCE ON <role>",
                    "MAINTENANCE OFF",
                    "SHUTDOWN [WAIT_FOR_SERVERS|WAIT_FOR_CLIENTS]",
                ]
                .iter()
                .map(|c| vec![Some(c.to_string())])
                .collect(),
            )),
            "VERSION" => Ok(Reply::rows(
                &["version"],
                vec![vec![Some(format!("usher {}", env!("CARGO_PKG_VERSION")))]],
            )),
            "POOLS" => Ok(stats::show_pools(&self.deps)),
            "CLIENTS" => Ok(clients::show_clients(&self.deps)),
            "SERVERS" => Ok(clients::show_servers(&self.deps)),
            "STATE" => Ok(Reply::rows(
                &["state"],
                vec![vec![Some(
                    if self.deps.pools.is_paused_all() {
                        "paused"
                    } else {
                        "active"
                    }
                    .to_string(),
                )]],
            )),
            "STATS" => Ok(stats::show_stats(&self.deps)),
            "STATS_TOTALS" => Ok(stats::show_totals(&self.deps, false)),
            "STATS_AVERAGES" => Ok(stats::show_totals(&self.deps, true)),
            "DATABASES" => Ok(stats::show_databases(&self.deps)),
            "USERS" => Ok(stats::show_users(&self.deps)),
            "LISTS" => Ok(stats::show_lists(&self.deps)),
            "CONFIG" => Ok(stats::show_config(&self.deps)),
            "HOOKS" => Ok(self.show_hooks()),
            "AUTH_MON" => Ok(self.auth_monitor()?.show_roles().into()),
            "AUTH_MON_UNKNOWN" => Ok(self.auth_monitor()?.show_unknown().into()),
            "AUTH_MON_ADDRS" => Ok(self.auth_monitor()?.show_addresses().into()),
            "AUTH_STORE" => match self.auth_monitor()?.store() {
                Some(store) => Ok(store.show().into()),
                None => Err(PgError::error(
                    sqlstate::OBJECT_NOT_IN_PREREQUISITE_STATE,
                    "the auth monitor has no shared store",
                )
                .with_hint("configure auth_monitor.store (docs/security.md, Auth monitoring)")),
            },
            "BLOCKING" => Ok(self.deps.builtins.blocking.show().into()),
            "PEERS" => Ok(stats::show_peers(&self.deps)),
            other => Err(PgError::error(
                sqlstate::SYNTAX_ERROR,
                format!("unknown SHOW item: {}", shown(other, 64)),
            )
            .with_hint("SHOW HELP lists the commands")),
        }
    }

    fn auth_monitor(&self) -> Result<&AuthMonitor, PgError> {
        self.deps.builtins.auth_monitor.as_deref().ok_or_else(|| {
            PgError::error(
                sqlstate::OBJECT_NOT_IN_PREREQUISITE_STATE,
                "auth monitoring is off",
            )
            .with_hint("configure auth_monitor (docs/security.md, Auth monitoring)")
        })
    }

    fn show_hooks(&self) -> Reply {
        let enabled = self.deps.hooks.enabled();
        let rows = self
            .deps
            .hooks
            .rows()
            .into_iter()
            .map(|h| {
                let events: Vec<&str> = h.events.iter().map(|e| e.name()).collect();
                vec![
                    Some(h.name),
                    Some(events.join(",")),
                    Some(h.calls.to_string()),
                    Some(h.rejects.to_string()),
                    Some(h.errors.to_string()),
                    Some(h.timeouts.to_string()),
                    h.last_error,
                    Some(if enabled { "on" } else { "off" }.to_string()),
                ]
            })
            .collect();
        Reply::rows(
            &[
                "hook",
                "events",
                "calls",
                "rejects",
                "errors",
                "timeouts",
                "last_error",
                "enabled",
            ],
            rows,
        )
    }
}

/// The text of a Query message, read as PostgreSQL reads it: one string
/// ended by the message's only NUL, valid UTF-8 (the console's encoding).
/// Errors are PostgreSQL's (an ERROR: the session goes on).
fn query_text(body: &[u8]) -> Result<&str, PgError> {
    let Some(end) = body.iter().position(|b| *b == 0) else {
        return Err(PgError::error(
            sqlstate::PROTOCOL_VIOLATION,
            "invalid string in message",
        ));
    };
    let text = std::str::from_utf8(&body[..end]).map_err(|e| {
        // PostgreSQL names the bytes of the first bad character: as many
        // as its first byte announces, at most what is there.
        let bad = &body[e.valid_up_to()..end];
        let announced = match bad[0] {
            b if b & 0xe0 == 0xc0 => 2,
            b if b & 0xf0 == 0xe0 => 3,
            b if b & 0xf8 == 0xf0 => 4,
            _ => 1,
        };
        let bytes: Vec<String> = bad
            .iter()
            .take(announced)
            .map(|b| format!("0x{b:02x}"))
            .collect();
        PgError::error(
            sqlstate::CHARACTER_NOT_IN_REPERTOIRE,
            format!(
                "invalid byte sequence for encoding \"UTF8\": {}",
                bytes.join(" ")
            ),
        )
    })?;
    if end + 1 != body.len() {
        return Err(PgError::error(
            sqlstate::PROTOCOL_VIOLATION,
            "invalid message format",
        ));
    }
    Ok(text)
}

/// A console command as parsed: keywords matched case-insensitively, names
/// (databases, roles) as written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// An empty query.
    Empty,
    /// `SHOW <item>` (or `SELECT <item>`), the item upper-cased; unknown
    /// items are refused when the command runs.
    Show(String),
    EnableHooks,
    DisableHooks,
    Reload,
    /// `SET key = value` (or `TO`): the key as written, the value unquoted.
    Set {
        key: String,
        value: String,
    },
    Pause(Option<String>),
    Resume(Option<String>),
    Reconnect(Option<String>),
    Kill(Option<String>),
    KillClient(u64),
    ResetAuthMon(Option<AuthMonTarget>),
    MaintenanceOn(String),
    MaintenanceOff,
    Shutdown(ShutdownMode),
}

/// What `RESET AUTH_MON <what>` clears.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AuthMonTarget {
    /// An unquoted IP address.
    Address(std::net::IpAddr),
    /// Anything else (a quoted address is a role name).
    Role(String),
}

impl Command {
    /// Everything but SHOW needs `admin.users`.
    pub fn needs_admin(&self) -> bool {
        !matches!(self, Command::Empty | Command::Show(_))
    }
}

/// Parses one console command (the text of a simple Query). Errors are
/// 42601 with the usage.
pub fn parse_command(sql: &str) -> Result<Command, PgError> {
    let words: Vec<String> = sql
        .trim()
        .trim_end_matches(';')
        .split_whitespace()
        .map(|w| w.to_ascii_uppercase())
        .collect();
    let words: Vec<&str> = words.iter().map(String::as_str).collect();
    let syntax = |message: String| PgError::error(sqlstate::SYNTAX_ERROR, message);
    Ok(match words.as_slice() {
        [] => Command::Empty,
        ["SHOW" | "SELECT", what] => Command::Show(what.to_string()),
        ["ENABLE", "HOOKS"] => Command::EnableHooks,
        ["DISABLE", "HOOKS"] => Command::DisableHooks,
        ["RELOAD"] => Command::Reload,
        ["SET", ..] => parse_set(sql)?,
        ["PAUSE", rest @ ..] => Command::Pause(argument(sql, 1, rest.len())),
        ["RESUME", rest @ ..] => Command::Resume(argument(sql, 1, rest.len())),
        ["RECONNECT", rest @ ..] => Command::Reconnect(argument(sql, 1, rest.len())),
        ["KILL", rest @ ..] => Command::Kill(argument(sql, 1, rest.len())),
        ["KILL_CLIENT", id] => Command::KillClient(id.parse::<u64>().map_err(|_| {
            syntax(format!(
                "KILL_CLIENT needs a client id (SHOW CLIENTS' id column), got \"{}\"",
                shown(id, 64)
            ))
        })?),
        ["RESET", "AUTH_MON", rest @ ..] => {
            Command::ResetAuthMon(argument(sql, 2, rest.len()).map(|what| {
                match what.parse::<std::net::IpAddr>() {
                    Ok(addr) if !sql.contains('"') => AuthMonTarget::Address(addr),
                    _ => AuthMonTarget::Role(what),
                }
            }))
        }
        ["MAINTENANCE", "ON", rest @ ..] => {
            Command::MaintenanceOn(argument(sql, 2, rest.len()).ok_or_else(|| {
                syntax("MAINTENANCE ON needs a role: MAINTENANCE ON <role>".into())
            })?)
        }
        ["MAINTENANCE", "OFF"] => Command::MaintenanceOff,
        ["SHUTDOWN", rest @ ..] => Command::Shutdown(match rest {
            [] | ["WAIT_FOR_SERVERS"] => ShutdownMode::WaitForServers,
            ["WAIT_FOR_CLIENTS"] => ShutdownMode::WaitForClients,
            _ => {
                return Err(syntax(
                    "SHUTDOWN takes WAIT_FOR_SERVERS (the default) or WAIT_FOR_CLIENTS".into(),
                ))
            }
        }),
        _ => {
            return Err(syntax(format!(
                "unknown admin console command: {}",
                shown(sql.trim(), 64)
            ))
            .with_hint("SHOW HELP lists the commands"))
        }
    })
}

/// `SET key = value` or `SET key TO value`, as PgBouncer's console takes
/// it: the value bare, or in single quotes (`''` for a quote).
fn parse_set(sql: &str) -> Result<Command, PgError> {
    let usage = || {
        PgError::error(
            sqlstate::SYNTAX_ERROR,
            "SET needs a key and a value: SET <key> = <value>",
        )
    };
    let text = sql.trim().trim_end_matches(';').trim_end();
    // The first word is SET (three ASCII letters).
    let rest = text[3..].trim_start();
    let end = rest
        .find(|c: char| c.is_whitespace() || c == '=')
        .unwrap_or(rest.len());
    let (key, rest) = rest.split_at(end);
    let rest = rest.trim_start();
    let value = match rest.strip_prefix('=') {
        Some(value) => value,
        None => match rest.get(..2) {
            Some(to)
                if to.eq_ignore_ascii_case("to") && rest[2..].starts_with(char::is_whitespace) =>
            {
                &rest[2..]
            }
            _ => return Err(usage()),
        },
    }
    .trim();
    if key.is_empty() || value.is_empty() {
        return Err(usage());
    }
    let value = match value.strip_prefix('\'').and_then(|v| v.strip_suffix('\'')) {
        Some(quoted) if !quoted.replace("''", "").contains('\'') => quoted.replace("''", "'"),
        _ if value.starts_with('\'') => {
            return Err(PgError::error(
                sqlstate::SYNTAX_ERROR,
                "unterminated quoted string in SET",
            ))
        }
        _ => value.to_string(),
    };
    Ok(Command::Set {
        key: key.to_string(),
        value,
    })
}

/// A refused SET as PostgreSQL says it of its own parameters.
fn set_error(e: SetError, value: &str) -> PgError {
    match e {
        SetError::Unknown(key) => PgError::error(
            sqlstate::UNDEFINED_OBJECT,
            format!(
                "unrecognized configuration parameter \"{}\"",
                shown(&key, 64)
            ),
        )
        .with_hint(
            "docs/configuration.md lists the keys (databases.<name>.<key> for a listed database)",
        ),
        SetError::RestartOnly(key) => PgError::error(
            sqlstate::CANT_CHANGE_RUNTIME_PARAM,
            format!("parameter \"{key}\" cannot be changed without restarting the server"),
        ),
        SetError::PartOf { key, whole } => PgError::error(
            sqlstate::FEATURE_NOT_SUPPORTED,
            format!("parameter \"{key}\" is part of each entry of {whole}: set {whole} whole"),
        )
        .with_hint(format!("SET {whole} = '[...]', the list as YAML writes it")),
        SetError::Invalid { key, message } => {
            // A password is not echoed.
            let text = if key.to_ascii_lowercase().ends_with("password") {
                format!("invalid value for parameter \"{}\"", shown(&key, 64))
            } else {
                format!(
                    "invalid value for parameter \"{}\": \"{}\"",
                    shown(&key, 64),
                    shown(value, 64)
                )
            };
            PgError::error(sqlstate::INVALID_PARAMETER_VALUE, text).with_detail(message)
        }
    }
}

/// The name after the first `skip` words of a command, as written (quotes
/// removed), when the command has `count` (0 or 1) more words.
fn argument(sql: &str, skip: usize, count: usize) -> Option<String> {
    if count == 0 {
        return None;
    }
    let mut rest = sql.trim().trim_end_matches(';').trim_start();
    for _ in 0..skip {
        rest = rest
            .trim_start()
            .split_once(char::is_whitespace)
            .map_or("", |(_, r)| r);
    }
    let rest = rest.trim();
    match rest.strip_prefix('"').and_then(|r| r.strip_suffix('"')) {
        Some(quoted) => Some(quoted.replace("\"\"", "\"")),
        None => Some(rest.to_string()),
    }
}

/// The answer to one console command.
enum Reply {
    Empty,
    Command(String),
    /// A command that completed with a warning for the user.
    Notice(PgError, String),
    Rows {
        columns: Vec<&'static str>,
        rows: Vec<Vec<Option<String>>>,
    },
}

impl From<Table> for Reply {
    fn from(t: Table) -> Reply {
        Reply::Rows {
            columns: t.columns,
            rows: t.rows,
        }
    }
}

impl Reply {
    fn rows(columns: &[&'static str], rows: Vec<Vec<Option<String>>>) -> Reply {
        Reply::Rows {
            columns: columns.to_vec(),
            rows,
        }
    }

    fn encode(&self, out: &mut BytesMut) {
        match self {
            Reply::Empty => messages::empty_query_response(out),
            Reply::Command(tag) => messages::command_complete(out, tag),
            Reply::Notice(notice, tag) => {
                notice.encode(out);
                messages::command_complete(out, tag);
            }
            Reply::Rows { columns, rows } => {
                messages::row_description(out, columns);
                for row in rows {
                    let values: Vec<Option<&str>> = row.iter().map(|v| v.as_deref()).collect();
                    messages::data_row(out, &values);
                }
                messages::command_complete(out, &format!("SHOW {}", rows.len()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_takes_equals_or_to_and_a_bare_or_quoted_value() {
        let set = |key: &str, value: &str| Command::Set {
            key: key.into(),
            value: value.into(),
        };
        let parsed = |sql: &str| parse_command(sql).unwrap();
        assert_eq!(parsed("SET pool_size = 5"), set("pool_size", "5"));
        assert_eq!(parsed("set pool_size=5;"), set("pool_size", "5"));
        assert_eq!(parsed("SET pool_size TO '5'"), set("pool_size", "5"));
        assert_eq!(
            parsed("SET server_reset_query = 'DISCARD ALL'"),
            set("server_reset_query", "DISCARD ALL")
        );
        assert_eq!(
            parsed("SET auth.query = 'SELECT ''x'''"),
            set("auth.query", "SELECT 'x'")
        );
        assert_eq!(
            parsed("SET databases.App.pool_size to 3"),
            set("databases.App.pool_size", "3")
        );
        for bad in [
            "SET",
            "SET pool_size",
            "SET pool_size =",
            "SET pool_size 5",
            "SET = 5",
            "SET x = 'a",
        ] {
            let e = parse_command(bad).unwrap_err();
            assert_eq!(e.code, sqlstate::SYNTAX_ERROR, "{bad}");
        }
        assert!(parse_command("SET x = 1").unwrap().needs_admin());
    }

    #[test]
    fn reads_query_text_as_postgresql_does() {
        assert_eq!(query_text(b"SHOW POOLS\0").unwrap(), "SHOW POOLS");
        let message = |body: &[u8]| query_text(body).unwrap_err().message;
        assert_eq!(message(b"SHOW POOLS"), "invalid string in message");
        assert_eq!(message(b"SHOW\0POOLS\0"), "invalid message format");
        assert_eq!(message(b"SHOW\0\0"), "invalid message format");
        assert_eq!(
            message(b"SHOW \xff abc\0"),
            "invalid byte sequence for encoding \"UTF8\": 0xff"
        );
        assert_eq!(
            message(b"SHOW \xe2\x28\xa1\0"),
            "invalid byte sequence for encoding \"UTF8\": 0xe2 0x28 0xa1"
        );
        assert_eq!(
            message(b"SHOW \xf0\x9f\0"),
            "invalid byte sequence for encoding \"UTF8\": 0xf0 0x9f"
        );
        assert_eq!(query_text(b"\xff\0").unwrap_err().code, "22021");
        assert_eq!(query_text(b"x\0y\0").unwrap_err().code, "08P01");
    }
}
