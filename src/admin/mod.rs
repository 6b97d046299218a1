//! The admin console: the virtual database `usher` (also `pgbouncer`, so
//! PgBouncer tools work), simple query protocol only.
//!
//! `admin.users` may run every command; `admin.stats_users` only SHOW.
//! Names in commands (`RESET AUTH_MON alice`, `MAINTENANCE ON admins`) are
//! taken as written; double quotes may surround them.

mod stats;

use crate::app::App;
use crate::frontend::close_with_error;
use crate::frontend::stream::ClientStream;
use crate::hooks::builtin::{AuthMonitor, Table};
use crate::protocol::error::sqlstate;
use crate::protocol::messages::{self, read_message};
use crate::protocol::PgError;
use bytes::BytesMut;
use std::sync::Arc;
use tokio::io::AsyncWriteExt;

/// The name of the admin console's database.
pub const ADMIN_DATABASE: &str = "usher";

/// True for the database names that reach the console.
pub fn is_admin_database(name: &str) -> bool {
    name == ADMIN_DATABASE || name == "pgbouncer"
}

/// What a console user may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Admin,
    Stats,
}

/// A logged-in console session.
pub struct Console {
    app: Arc<App>,
    role: Role,
}

impl Console {
    /// Checks the (already authenticated) user may use the console and sends the welcome.
    pub async fn login(
        app: Arc<App>,
        stream: &mut ClientStream,
        user: &str,
    ) -> Result<Console, PgError> {
        let admin = &app.config.admin;
        let role = if admin.users.iter().any(|u| u == user) {
            Role::Admin
        } else if admin.stats_users.iter().any(|u| u == user) {
            Role::Stats
        } else {
            return Err(PgError::fatal(
                sqlstate::INSUFFICIENT_PRIVILEGE,
                format!("user \"{user}\" may not use the admin console"),
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
        messages::ready_for_query(&mut out, b'I');
        stream
            .write_all(&out)
            .await
            .map_err(|_| PgError::protocol("client went away"))?;
        Ok(Console { app, role })
    }

    /// Answers simple queries until the client leaves.
    pub async fn serve(self, mut stream: ClientStream) {
        loop {
            let msg = match read_message(&mut stream, 64 * 1024).await {
                Ok(Some(m)) => m,
                Ok(None) => return,
                Err(e) => return close_with_error(&mut stream, &e).await,
            };
            let mut out = BytesMut::new();
            match msg.tag {
                b'X' => return,
                b'Q' => {
                    let sql = String::from_utf8_lossy(&msg.body);
                    let sql = sql.trim_end_matches('\0');
                    match self.run(sql).await {
                        Ok(reply) => reply.encode(&mut out),
                        Err(e) => {
                            crate::frontend::count_error(&e);
                            e.encode(&mut out)
                        }
                    }
                    messages::ready_for_query(&mut out, b'I');
                }
                _ => {
                    let e = PgError::fatal(
                        sqlstate::FEATURE_NOT_SUPPORTED,
                        "the admin console supports only the simple query protocol",
                    );
                    return close_with_error(&mut stream, &e).await;
                }
            }
            if stream.write_all(&out).await.is_err() {
                return;
            }
        }
    }

    /// Runs one console command.
    async fn run(&self, sql: &str) -> Result<Reply, PgError> {
        let words: Vec<String> = sql
            .trim()
            .trim_end_matches(';')
            .split_whitespace()
            .map(|w| w.to_ascii_uppercase())
            .collect();
        let words: Vec<&str> = words.iter().map(String::as_str).collect();
        match words.as_slice() {
            [] => Ok(Reply::Empty),
            ["SHOW" | "SELECT", what] => self.show(what),
            ["ENABLE", "HOOKS"] => {
                self.require_admin()?;
                self.app.hooks.set_enabled(true);
                Ok(Reply::Command("ENABLE HOOKS".into()))
            }
            ["DISABLE", "HOOKS"] => {
                self.require_admin()?;
                self.app.hooks.set_enabled(false);
                Ok(Reply::Command("DISABLE HOOKS".into()))
            }
            ["RELOAD"] => {
                self.require_admin()?;
                match self.app.reload_hooks() {
                    Ok(n) => {
                        tracing::info!(files = n, "RELOAD: hooks reloaded");
                        Ok(Reply::Command("RELOAD".into()))
                    }
                    Err(errors) => {
                        let list: Vec<String> = errors.iter().map(|e| e.to_string()).collect();
                        for e in &list {
                            tracing::error!(error = %e, "RELOAD: hook file failed; the running hooks stay");
                        }
                        Err(PgError::error(
                            sqlstate::INVALID_PARAMETER_VALUE,
                            "reload failed; the running hooks stay",
                        )
                        .with_detail(list.join("\n")))
                    }
                }
            }
            ["RESET", "AUTH_MON", rest @ ..] => {
                self.require_admin()?;
                let monitor = self.auth_monitor()?;
                match argument(sql, 2, rest.len()) {
                    None => {
                        monitor.reset_all();
                        tracing::warn!("RESET AUTH_MON: every counter cleared");
                    }
                    Some(what) => {
                        let removed = match what.parse::<std::net::IpAddr>() {
                            Ok(addr) if !sql.contains('"') => monitor.reset_address(addr),
                            _ => monitor.reset_role(&what),
                        };
                        tracing::warn!(what = %what, removed, "RESET AUTH_MON");
                    }
                }
                Ok(Reply::Command("RESET".into()))
            }
            ["MAINTENANCE", "ON", rest @ ..] => {
                self.require_admin()?;
                let role = argument(sql, 2, rest.len()).ok_or_else(|| {
                    PgError::error(
                        sqlstate::SYNTAX_ERROR,
                        "MAINTENANCE ON needs a role: MAINTENANCE ON <role>",
                    )
                })?;
                self.app.set_maintenance(Some(&role)).await?;
                Ok(Reply::Command("MAINTENANCE ON".into()))
            }
            ["MAINTENANCE", "OFF"] => {
                self.require_admin()?;
                self.app.set_maintenance(None).await?;
                Ok(Reply::Command("MAINTENANCE OFF".into()))
            }
            ["SHUTDOWN"] => {
                self.require_admin()?;
                self.app.begin_shutdown();
                Ok(Reply::Command("SHUTDOWN".into()))
            }
            _ => Err(PgError::error(
                sqlstate::SYNTAX_ERROR,
                format!("unknown admin console command: {}", sql.trim()),
            )
            .with_hint("SHOW HELP lists the commands")),
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
                    "SHOW HELP|VERSION|POOLS|HOOKS",
                    "SHOW STATS|STATS_TOTALS|STATS_AVERAGES|DATABASES|USERS|LISTS|CONFIG",
                    "SHOW AUTH_MON|AUTH_MON_UNKNOWN|AUTH_MON_ADDRS",
                    "SHOW BLOCKING",
                    "ENABLE HOOKS",
                    "DISABLE HOOKS",
                    "RELOAD",
                    "RESET AUTH_MON [role|address]",
                    "MAINTENANCE ON <role>",
                    "MAINTENANCE OFF",
                    "SHUTDOWN",
                ]
                .iter()
                .map(|c| vec![Some(c.to_string())])
                .collect(),
            )),
            "VERSION" => Ok(Reply::rows(
                &["version"],
                vec![vec![Some(format!("usher {}", env!("CARGO_PKG_VERSION")))]],
            )),
            "POOLS" => Ok(self.show_pools()),
            "STATS" => Ok(stats::show_stats(&self.app)),
            "STATS_TOTALS" => Ok(stats::show_totals(&self.app, false)),
            "STATS_AVERAGES" => Ok(stats::show_totals(&self.app, true)),
            "DATABASES" => Ok(stats::show_databases(&self.app)),
            "USERS" => Ok(stats::show_users(&self.app)),
            "LISTS" => Ok(stats::show_lists(&self.app)),
            "CONFIG" => Ok(stats::show_config(&self.app)),
            "HOOKS" => Ok(self.show_hooks()),
            "AUTH_MON" => Ok(self.auth_monitor()?.show_roles().into()),
            "AUTH_MON_UNKNOWN" => Ok(self.auth_monitor()?.show_unknown().into()),
            "AUTH_MON_ADDRS" => Ok(self.auth_monitor()?.show_addresses().into()),
            "BLOCKING" => Ok(self.app.builtins.blocking.show().into()),
            other => Err(PgError::error(
                sqlstate::SYNTAX_ERROR,
                format!("unknown SHOW item: {other}"),
            )
            .with_hint("SHOW HELP lists the commands")),
        }
    }

    fn auth_monitor(&self) -> Result<&AuthMonitor, PgError> {
        self.app.builtins.auth_monitor.as_deref().ok_or_else(|| {
            PgError::error(
                sqlstate::OBJECT_NOT_IN_PREREQUISITE_STATE,
                "auth monitoring is off",
            )
            .with_hint("configure auth_monitor (README: Auth monitoring)")
        })
    }

    fn show_hooks(&self) -> Reply {
        let enabled = self.app.hooks.enabled();
        let rows = self
            .app
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

    fn show_pools(&self) -> Reply {
        use std::sync::atomic::Ordering::Relaxed;
        let columns = [
            "database",
            "user",
            "cl_active",
            "cl_waiting",
            "cl_active_cancel_req",
            "cl_waiting_cancel_req",
            "sv_active",
            "sv_active_cancel",
            "sv_being_canceled",
            "sv_idle",
            "sv_used",
            "sv_tested",
            "sv_login",
            "maxwait",
            "maxwait_us",
            "pool_mode",
            "load_balance_hosts",
        ];
        let mut pools = self.app.pools.all();
        pools.sort_by(|a, b| (&a.database, &a.user).cmp(&(&b.database, &b.user)));
        let rows = pools
            .iter()
            .map(|p| {
                let n = |v: usize| Some(v.to_string());
                vec![
                    Some(p.database.clone()),
                    Some(p.user.clone()),
                    n(p.stats.active.load(Relaxed)),
                    n(p.stats.waiting.load(Relaxed)),
                    n(0),
                    n(0),
                    n(p.stats.active.load(Relaxed)),
                    n(0),
                    n(0),
                    n(p.idle_count()),
                    n(0),
                    n(0),
                    n(0),
                    n(0),
                    n(0),
                    Some(p.mode().to_string()),
                    None,
                ]
            })
            .collect();
        Reply::rows(&columns, rows)
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
