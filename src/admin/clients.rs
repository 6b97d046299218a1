//! SHOW CLIENTS and SHOW SERVERS, with PgBouncer's columns in its order
//! (see ../shared/REFERENCE.md).
//!
//! `ptr` and `link` pair a client with the server connection it holds:
//! clients are `c<id>`, servers `s<id>`. Columns usher has nothing for
//! (replication, cancel requests in flight) are `none` or 0.

use super::Reply;
use crate::backend::ServerSummary;
use crate::frontend::client_registry::{ClientHandle, ClientState};
use crate::frontend::deps::SessionDeps;
use crate::hooks::builtin::timestamp;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

const COLUMNS: [&str; 21] = [
    "type",
    "user",
    "database",
    "replication",
    "state",
    "addr",
    "port",
    "local_addr",
    "local_port",
    "connect_time",
    "request_time",
    "wait",
    "wait_us",
    "close_needed",
    "ptr",
    "link",
    "remote_pid",
    "tls",
    "application_name",
    "prepared_statements",
    "id",
];

/// A time as PgBouncer prints it: `2024-05-01 12:34:56 UTC` (the auth
/// monitor's timestamp without its milliseconds and offset).
fn pgb_time(t: SystemTime) -> String {
    let ms = t
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let stamp = timestamp(ms);
    format!("{} UTC", stamp.get(..19).unwrap_or(&stamp))
}

fn s(v: impl ToString) -> Option<String> {
    Some(v.to_string())
}

pub(super) fn show_clients(deps: &SessionDeps) -> Reply {
    let rows = deps.clients.all().iter().map(|c| client_row(c)).collect();
    Reply::rows(&COLUMNS, rows)
}

fn client_row(c: &ClientHandle) -> Vec<Option<String>> {
    let f = &c.facts;
    let wait_us = if c.state() == ClientState::Waiting {
        c.wait_us()
    } else {
        0
    };
    let link = c.server().map(|srv| format!("s{}", srv.id));
    vec![
        s("C"),
        s(&f.user),
        s(c.shown_database()),
        s("none"),
        s(c.state().as_str()),
        s(f.addr.shown()),
        s(f.addr.port()),
        // A local client: `unix` and the socket's port on both ends, as
        // PgBouncer shows it.
        match f.addr.local_peer() {
            Some(_) => s(crate::client_addr::UNIX_SHOWN),
            None => f.local.map(|a| a.ip().to_string()),
        },
        match f.addr.local_peer() {
            Some(p) => s(p.port),
            None => f.local.map(|a| a.port().to_string()),
        },
        s(pgb_time(c.connect_time)),
        s(pgb_time(c.request_time())),
        s(wait_us / 1_000_000),
        s(wait_us % 1_000_000),
        s(0),
        s(format!("c{}", c.id)),
        link,
        // The connecting process of a local client (SO_PEERCRED), as PgBouncer.
        s(f.addr.local_peer().and_then(|p| p.pid).unwrap_or(0)),
        Some(f.tls.to_string()).filter(|t| !t.is_empty()),
        s(&f.application_name),
        s(c.prepared()),
        s(c.id),
    ]
}

pub(super) fn show_servers(deps: &SessionDeps) -> Reply {
    let mut rows = Vec::new();
    // Lent connections, seen through the clients that hold them.
    for c in deps.clients.all() {
        if let Some(srv) = c.server() {
            let database = c.shown_database();
            let row = ServerRow {
                summary: &srv,
                user: &c.facts.user,
                database: &database,
                state: "active",
                request_time: c.request_time(),
                link: Some(format!("c{}", c.id)),
                prepared: None,
                stale: false,
            };
            rows.push(row.cells());
        }
    }
    let mut pools = deps.pools.all();
    pools.sort_by(|a, b| (&a.database, &a.user).cmp(&(&b.database, &b.user)));
    let now = (Instant::now(), SystemTime::now());
    for pool in pools {
        for idle in pool.idle_servers() {
            let used_ago = now.0.saturating_duration_since(idle.last_used);
            let row = ServerRow {
                summary: &idle.summary,
                user: &pool.user,
                database: pool.shown_database(),
                state: "idle",
                request_time: now.1.checked_sub(used_ago).unwrap_or(UNIX_EPOCH),
                link: None,
                prepared: Some(idle.prepared),
                stale: idle.stale,
            };
            rows.push(row.cells());
        }
    }
    Reply::rows(&COLUMNS, rows)
}

/// One server connection's row.
struct ServerRow<'a> {
    summary: &'a ServerSummary,
    user: &'a str,
    database: &'a str,
    state: &'static str,
    request_time: SystemTime,
    link: Option<String>,
    /// Known for idle connections only (a lent one is its client's to touch).
    prepared: Option<usize>,
    stale: bool,
}

impl ServerRow<'_> {
    fn cells(&self) -> Vec<Option<String>> {
        let srv = self.summary;
        // A Unix-domain socket shows as PgBouncer shows one: "unix" and
        // the port, at both ends.
        let unix = crate::config::is_socket_dir(&srv.cancel.host);
        let (addr, local_addr, local_port) = match srv.local {
            Some(a) => (s(&srv.cancel.host), s(a.ip()), s(a.port())),
            None if unix => (s("unix"), s("unix"), s(srv.cancel.port)),
            None => (s(&srv.cancel.host), None, None),
        };
        vec![
            s("S"),
            s(self.user),
            s(self.database),
            s("none"),
            s(self.state),
            addr,
            s(srv.cancel.port),
            local_addr,
            local_port,
            s(pgb_time(srv.connect_time)),
            s(pgb_time(self.request_time)),
            s(0),
            s(0),
            s(u8::from(self.stale)),
            s(format!("s{}", srv.id)),
            self.link.clone(),
            s(srv.cancel.pid),
            Some(if srv.tls { "TLS" } else { "" }.to_string()).filter(|t| !t.is_empty()),
            None,
            s(self.prepared.unwrap_or(0)),
            s(srv.id),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn times_look_like_pgbouncers() {
        let t = UNIX_EPOCH + Duration::from_secs(1_714_566_896);
        assert_eq!(pgb_time(t), "2024-05-01 12:34:56 UTC");
    }
}
