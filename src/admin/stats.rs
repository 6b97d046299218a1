//! PgBouncer's statistics and listing commands, with its column names and
//! order (see ../shared/REFERENCE.md), from usher's per-pool counters.
//!
//! usher keeps counters per (database, user) pool; PgBouncer's SHOW STATS is
//! per database, so pools are summed by database. Times are microseconds.
//! Counters usher does not keep (server-side parse counts, query time
//! separate from transaction time) are reported as 0.

use super::Reply;
use crate::config::settings::{Reload, SettingDefault, SETTINGS};
use crate::config::Config;
use crate::frontend::client_registry::ClientState;
use crate::frontend::deps::SessionDeps;
use crate::pool::Pool;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// Per-database sums of the pools' counters.
#[derive(Default, Clone, Copy)]
struct Totals {
    assignments: u64,
    xacts: u64,
    queries: u64,
    received: u64,
    sent: u64,
    xact_us: u64,
    wait_us: u64,
}

fn totals_by_database(deps: &SessionDeps) -> BTreeMap<String, Totals> {
    let mut by_db: BTreeMap<String, Totals> = deps
        .config()
        .listed_databases()
        .map(|(d, _)| (d.clone(), Totals::default()))
        .collect();
    for p in deps.pools.all() {
        let t = by_db.entry(p.database.clone()).or_default();
        let s = &p.stats;
        t.assignments += s.checkouts.load(Relaxed);
        t.xacts += s.transactions.load(Relaxed);
        t.queries += s.queries.load(Relaxed);
        t.received += s.received.load(Relaxed);
        t.sent += s.sent.load(Relaxed);
        t.xact_us += s.xact_us.load(Relaxed);
        t.wait_us += s.wait_us.load(Relaxed);
    }
    by_db
}

fn n(v: impl ToString) -> Option<String> {
    Some(v.to_string())
}

/// Per-second rate over usher's uptime.
fn per_sec(v: u64, deps: &SessionDeps) -> u64 {
    let secs = deps.started.elapsed().as_secs().max(1);
    v / secs
}

/// Average per transaction (times), or 0.
fn avg(v: u64, count: u64) -> u64 {
    v.checked_div(count).unwrap_or(0)
}

pub(super) fn show_stats(deps: &SessionDeps) -> Reply {
    let columns = [
        "database",
        "total_server_assignment_count",
        "total_xact_count",
        "total_query_count",
        "total_received",
        "total_sent",
        "total_xact_time",
        "total_query_time",
        "total_wait_time",
        "total_client_parse_count",
        "total_server_parse_count",
        "total_bind_count",
        "avg_server_assignment_count",
        "avg_xact_count",
        "avg_query_count",
        "avg_recv",
        "avg_sent",
        "avg_xact_time",
        "avg_query_time",
        "avg_wait_time",
        "avg_client_parse_count",
        "avg_server_parse_count",
        "avg_bind_count",
    ];
    let rows = totals_by_database(deps)
        .into_iter()
        .map(|(db, t)| {
            vec![
                Some(db),
                n(t.assignments),
                n(t.xacts),
                n(t.queries),
                n(t.received),
                n(t.sent),
                n(t.xact_us),
                n(t.xact_us),
                n(t.wait_us),
                n(0),
                n(0),
                n(0),
                n(per_sec(t.assignments, deps)),
                n(per_sec(t.xacts, deps)),
                n(per_sec(t.queries, deps)),
                n(per_sec(t.received, deps)),
                n(per_sec(t.sent, deps)),
                n(avg(t.xact_us, t.xacts)),
                n(avg(t.xact_us, t.queries)),
                n(avg(t.wait_us, t.assignments)),
                n(0),
                n(0),
                n(0),
            ]
        })
        .collect();
    Reply::rows(&columns, rows)
}

/// SHOW POOLS: one row per pool. `cl_active` counts logged-in clients not
/// waiting (PgBouncer counts idle clients as active too).
pub(super) fn show_pools(deps: &SessionDeps) -> Reply {
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
    let mut pools = deps.pools.all();
    pools.sort_by(|a, b| (a.shown_database(), &a.user).cmp(&(b.shown_database(), &b.user)));
    // Per pool: logged-in clients not waiting, and the longest current wait.
    let mut clients: HashMap<(String, String), (usize, u64)> = HashMap::new();
    for c in deps.clients.all() {
        let key = (c.shown_database().to_string(), c.facts.user.to_string());
        let entry = clients.entry(key).or_default();
        if c.state() == ClientState::Waiting {
            entry.1 = entry.1.max(c.wait_us());
        } else {
            entry.0 += 1;
        }
    }
    let rows = pools
        .iter()
        .map(|p| {
            let n = |v: usize| Some(v.to_string());
            let (active, maxwait_us) = clients
                .get(&(p.shown_database().to_string(), p.user.clone()))
                .copied()
                .unwrap_or_default();
            vec![
                Some(p.shown_database().to_string()),
                Some(p.user.clone()),
                n(active),
                n(p.stats.waiting.load(Relaxed)),
                n(0),
                n(0),
                n(p.stats.active.load(Relaxed)),
                n(0),
                n(0),
                n(p.idle_count()),
                n(0),
                n(0),
                n(p.stats.servers_login.load(Relaxed)),
                Some((maxwait_us / 1_000_000).to_string()),
                Some((maxwait_us % 1_000_000).to_string()),
                Some(p.mode().to_string()),
                None,
            ]
        })
        .collect();
    Reply::rows(&columns, rows)
}

/// SHOW STATS_TOTALS, or (averages) STATS_AVERAGES: per second over uptime.
pub(super) fn show_totals(deps: &SessionDeps, averages: bool) -> Reply {
    let columns = [
        "database",
        "server_assignment_count",
        "xact_count",
        "query_count",
        "bytes_received",
        "bytes_sent",
        "xact_time",
        "query_time",
        "wait_time",
        "client_parse_count",
        "server_parse_count",
        "bind_count",
    ];
    let f = |v: u64| if averages { per_sec(v, deps) } else { v };
    let rows = totals_by_database(deps)
        .into_iter()
        .map(|(db, t)| {
            let mut row = vec![Some(db)];
            row.extend(
                [
                    t.assignments,
                    t.xacts,
                    t.queries,
                    t.received,
                    t.sent,
                    t.xact_us,
                    t.xact_us,
                    t.wait_us,
                    0,
                    0,
                    0,
                ]
                .map(|v| n(f(v))),
            );
            row
        })
        .collect();
    Reply::rows(&columns, rows)
}

fn pools_of<'a>(
    pools: &'a [Arc<Pool>],
    f: impl Fn(&Pool) -> bool + 'a,
) -> impl Iterator<Item = &'a Arc<Pool>> + 'a {
    pools.iter().filter(move |p| f(p))
}

/// The databases SHOW DATABASES lists: those listed under `databases`,
/// then the auto databases (reached through the fallback entry `"*"`) that
/// have a pool now, each with the entry it resolves to. The fallback entry
/// itself is no database.
fn databases(config: &Config, pools: &[Arc<Pool>]) -> Vec<String> {
    let mut names: Vec<String> = config.listed_databases().map(|(n, _)| n.clone()).collect();
    let mut auto: Vec<String> = pools
        .iter()
        .filter(|p| config.is_auto_database(&p.database))
        .map(|p| p.database.clone())
        .collect();
    auto.sort();
    auto.dedup();
    names.extend(auto);
    names
}

pub(super) fn show_databases(deps: &SessionDeps) -> Reply {
    let columns = [
        "name",
        "host",
        "port",
        "database",
        "force_user",
        "pool_size",
        "min_pool_size",
        "reserve_pool_size",
        "server_lifetime",
        "pool_mode",
        "load_balance_hosts",
        "max_connections",
        "current_connections",
        "max_client_connections",
        "current_client_connections",
        "paused",
        "disabled",
    ];
    let pools = deps.pools.all();
    let config = deps.config();
    let rows = databases(&config, &pools)
        .into_iter()
        .filter_map(|name| Some((config.database_for(&name)?, name)))
        .map(|(db, name)| {
            let name = &name;
            let limits = config.limits_for(name, "");
            // Every server connection of its pools, opening ones too, and
            // its clients: the counts its caps are checked against.
            let tally = deps.pools.caps.database(name);
            let (connections, clients) = tally.map_or((0, 0), |t| (t.servers(), t.clients()));
            let (host, port) = shown_server(db, pools_of(&pools, |p| &p.database == name));
            vec![
                Some(name.clone()),
                Some(host),
                n(port),
                Some(db.server_dbname(name).to_string()),
                None,
                n(limits.size),
                n(limits.min_size),
                n(limits.reserve_size),
                n(limits.server_lifetime.map_or(0, |d| d.as_secs())),
                Some(limits.mode.to_string()),
                // PgBouncer's names for libpq's load_balance_hosts.
                db.hosts.as_ref().map(|_| {
                    if db.load_balance {
                        "round-robin"
                    } else {
                        "disable"
                    }
                    .to_string()
                }),
                n(limits.max_db_connections),
                n(connections),
                n(limits.max_db_client_connections),
                n(clients),
                n(u8::from(deps.pools.is_paused(name))),
                n(0),
            ]
        })
        .collect();
    Reply::rows(&columns, rows)
}

/// SHOW DATABASES' host and port: the one server, or of several hosts
/// the one the database's pools connected to last (they fit the target),
/// or, before any connection, the list as PgBouncer shows it (`a,b`) and
/// the first one's port.
fn shown_server<'a>(
    db: &crate::config::DatabaseConfig,
    pools: impl Iterator<Item = &'a Arc<Pool>>,
) -> (String, u16) {
    let servers = db.server_hosts();
    if servers.len() == 1 {
        return servers[0].clone();
    }
    let latest = pools
        .filter_map(|p| p.server_in_use())
        .filter(|(server, _)| servers.contains(server))
        .max_by_key(|(_, at)| *at);
    match latest {
        Some((server, _)) => server,
        None => {
            let names: Vec<&str> = servers.iter().map(|(h, _)| h.as_str()).collect();
            (names.join(","), servers[0].1)
        }
    }
}

pub(super) fn show_users(deps: &SessionDeps) -> Reply {
    let columns = [
        "name",
        "pool_size",
        "reserve_pool_size",
        "pool_mode",
        "max_user_connections",
        "current_connections",
        "max_user_client_connections",
        "current_client_connections",
    ];
    let config = deps.config();
    let rows = config
        .users
        .iter()
        .map(|(name, u)| {
            let tally = deps.pools.caps.user(name);
            let (connections, clients) = tally.map_or((0, 0), |t| (t.servers(), t.clients()));
            vec![
                Some(name.clone()),
                u.pool_size.map(|v| v.to_string()),
                n(config.reserve_pool_size),
                u.pool_mode.map(|m| m.to_string()),
                n(u.max_user_connections
                    .unwrap_or(config.max_user_connections)),
                n(connections),
                n(u.max_user_client_connections
                    .unwrap_or(config.max_user_client_connections)),
                n(clients),
            ]
        })
        .collect();
    Reply::rows(&columns, rows)
}

pub(super) fn show_lists(deps: &SessionDeps) -> Reply {
    let pools = deps.pools.all();
    let idle: usize = pools.iter().map(|p| p.idle_count()).sum();
    let used: usize = pools.iter().map(|p| p.stats.active.load(Relaxed)).sum();
    let rows = [
        ("databases", databases(&deps.config(), &pools).len()),
        ("users", deps.config().users.len()),
        ("pools", pools.len()),
        ("used_clients", deps.clients.connected()),
        ("free_servers", idle),
        ("used_servers", used),
    ]
    .into_iter()
    .map(|(list, items)| vec![Some(list.to_string()), n(items)])
    .collect();
    Reply::rows(&["list", "items"], rows)
}

pub(super) fn show_config(deps: &SessionDeps) -> Reply {
    let rows = config_rows(&deps.config(), deps.hooks.enabled());
    Reply::rows(&["key", "value", "default", "changeable"], rows)
}

/// SHOW CONFIG's rows: key, value, default, changeable, for the keys the
/// settings table marks `show`, in its order. `hooks_enabled` is the live
/// switch (ENABLE/DISABLE HOOKS), not the file's value.
fn config_rows(c: &Config, hooks_enabled: bool) -> Vec<Vec<Option<String>>> {
    let yes = |b: bool| Some(if b { "yes" } else { "no" }.to_string());
    SETTINGS
        .iter()
        .filter(|s| s.show)
        .map(|s| {
            let default = match s.default {
                SettingDefault::Value(v) | SettingDefault::Text(v) => v,
            };
            vec![
                Some(s.key.to_string()),
                shown_value(c, hooks_enabled, s.key),
                Some(default.to_string()),
                yes(s.reload != Reload::Restart),
            ]
        })
        .collect()
}

/// The running value of a key SHOW CONFIG shows.
fn shown_value(c: &Config, hooks_enabled: bool, key: &str) -> Option<String> {
    Some(match key {
        "listen" => c.listen.to_string(),
        "max_client_conn" => c.max_client_conn.to_string(),
        "max_auth_clients" => c.max_auth_clients.to_string(),
        "max_auth_clients_per_address" => c.max_auth_clients_per_address.to_string(),
        "workers" => c.workers.to_string(),
        "so_reuseport" => c.so_reuseport.to_string(),
        "peer_id" => c.peer_id.to_string(),
        // Unset: empty, as PgBouncer shows an unset key.
        "unix_socket_dir" => c
            .unix_socket_dir
            .as_ref()
            .map(|d| d.display().to_string())
            .unwrap_or_default(),
        "unix_socket_mode" => c.unix_socket_mode.to_string(),
        "unix_socket_group" => c.unix_socket_group.clone().unwrap_or_default(),
        "pool_mode" => c.pool_mode.to_string(),
        "pool_size" => c.pool_size.to_string(),
        "min_pool_size" => c.min_pool_size.to_string(),
        "server_reset_query" => c.server_reset_query.clone(),
        "query_wait_timeout" => c.query_wait_timeout.to_string(),
        "server_connect_timeout" => c.server_connect_timeout.to_string(),
        "server_login_retry" => c.server_login_retry.to_string(),
        "server_fast_fail" => c.server_fast_fail.to_string(),
        "client_idle_timeout" => c.client_idle_timeout.to_string(),
        "idle_transaction_timeout" => c.idle_transaction_timeout.to_string(),
        "server_idle_timeout" => c.server_idle_timeout.to_string(),
        "server_lifetime" => c.server_lifetime.to_string(),
        "server_check_delay" => c.server_check_delay.to_string(),
        "autodb_idle_timeout" => c.autodb_idle_timeout.to_string(),
        "auth_timeout" => c.auth_timeout.to_string(),
        "shutdown_timeout" => c.shutdown_timeout.to_string(),
        "client_message_timeout" => c.client_message_timeout.to_string(),
        "max_message_size" => c.max_message_size.to_string(),
        "max_buffered_message" => c.max_buffered_message.to_string(),
        "max_buffered_total" => c.max_buffered_total.to_string(),
        "prepared_statements" => c.prepared_statements.to_string(),
        "max_db_connections" => c.max_db_connections.to_string(),
        "max_user_connections" => c.max_user_connections.to_string(),
        "max_db_client_connections" => c.max_db_client_connections.to_string(),
        "max_user_client_connections" => c.max_user_client_connections.to_string(),
        "reserve_pool_size" => c.reserve_pool_size.to_string(),
        "reserve_pool_timeout" => c.reserve_pool_timeout.to_string(),
        "auth.method" => c.auth.method.to_string(),
        "hooks.enabled" => hooks_enabled.to_string(),
        "hooks.dir" => c.hooks.dir.display().to_string(),
        "hooks.timeout_ms" => c.hooks.timeout_ms.to_string(),
        "hooks.memory_limit_mb" => c.hooks.memory_limit_mb.to_string(),
        "log.level" => c.log.level.clone(),
        "log.connections" => c.log.connections.to_string(),
        "log.disconnections" => c.log.disconnections.to_string(),
        _ => return None,
    })
}

/// SHOW PEERS: PgBouncer's columns (pool_size: cancels forwarded to the
/// peer at once), then the cancels on their way there now.
pub fn show_peers(deps: &SessionDeps) -> Reply {
    let rows = deps
        .peers
        .all()
        .iter()
        .map(|p| {
            vec![
                Some(p.config.id.to_string()),
                Some(p.config.host.clone()),
                Some(p.config.port.to_string()),
                Some(p.config.pool_size.to_string()),
                Some(p.pending().to_string()),
            ]
        })
        .collect();
    Reply::rows(
        &[
            "peer_id",
            "host",
            "port",
            "pool_size",
            "pending_cancel_requests",
        ],
        rows,
    )
}

#[cfg(test)]
mod tests {
    use super::{config_rows, shown_value};
    use crate::config::settings::SETTINGS;
    use crate::config::Config;

    /// SHOW CONFIG's rows for a file that sets nothing, and for one that
    /// sets every shown key: the output PgBouncer tools read, pinned.
    #[test]
    fn show_config_rows_are_pinned() {
        let text = |rows: Vec<Vec<Option<String>>>| -> Vec<String> {
            rows.into_iter()
                .map(|r| {
                    r.into_iter()
                        .map(|c| c.unwrap_or_default())
                        .collect::<Vec<_>>()
                        .join("|")
                })
                .collect()
        };
        let c = Config::from_yaml("{}\n", "t.yaml").unwrap();
        for s in SETTINGS.iter().filter(|s| s.show) {
            assert!(shown_value(&c, true, s.key).is_some(), "{}", s.key);
        }
        assert_eq!(
            text(config_rows(&c, true)),
            [
                "listen|127.0.0.1:6432|127.0.0.1:6432|no",
                "max_client_conn|10000|10000|yes",
                "max_auth_clients|1000|1000|no",
                "max_auth_clients_per_address|100|100|yes",
                "workers|0|0|no",
                "so_reuseport|false|false|no",
                "peer_id|0|0|no",
                "unix_socket_dir||none|no",
                "unix_socket_mode|0777|0777|no",
                "unix_socket_group||none|no",
                "pool_mode|transaction|transaction|yes",
                "pool_size|20|20|yes",
                "min_pool_size|0|0|yes",
                "server_reset_query|DISCARD ALL|DISCARD ALL|yes",
                "query_wait_timeout|120|120|yes",
                "server_connect_timeout|15|15|yes",
                "server_login_retry|15|15|yes",
                "server_fast_fail|false|false|yes",
                "client_idle_timeout|0|0|yes",
                "idle_transaction_timeout|0|0|yes",
                "server_idle_timeout|600|600|yes",
                "server_lifetime|3600|3600|yes",
                "server_check_delay|30|30|yes",
                "autodb_idle_timeout|3600|3600|yes",
                "auth_timeout|60|60|yes",
                "shutdown_timeout|30|30|yes",
                "max_message_size|268435456|268435456|yes",
                "max_buffered_message|16777216|16777216|yes",
                "max_buffered_total|536870912|536870912|yes",
                "client_message_timeout|60|60|yes",
                "prepared_statements|200|200|yes",
                "max_db_connections|0|0|yes",
                "max_user_connections|0|0|yes",
                "max_db_client_connections|0|0|yes",
                "max_user_client_connections|0|0|yes",
                "reserve_pool_size|0|0|yes",
                "reserve_pool_timeout|5|5|yes",
                "auth.method|scram-sha-256|scram-sha-256|yes",
                "hooks.enabled|true|true|yes",
                "hooks.dir|hooks|hooks|yes",
                "hooks.timeout_ms|100|100|yes",
                "hooks.memory_limit_mb|32|32|yes",
                "log.level|info|info|yes",
                "log.connections|true|true|yes",
                "log.disconnections|true|true|yes",
            ]
        );
        let c = Config::from_yaml(
            "listen: 0.0.0.0:7000\nmax_client_conn: 5\nmax_auth_clients: 6\n\
             max_auth_clients_per_address: 2\nworkers: 3\nso_reuseport: true\npeer_id: 4\n\
             unix_socket_dir: /run/usher\nunix_socket_mode: 0660\nunix_socket_group: usher\npool_mode: session\npool_size: 7\n\
             min_pool_size: 1\nserver_reset_query: ''\nquery_wait_timeout: 1.5\n\
             server_connect_timeout: 2\nserver_login_retry: 2.5\nserver_fast_fail: true\nclient_idle_timeout: 3\nidle_transaction_timeout: 4\n\
             server_idle_timeout: 5\nserver_lifetime: 6\nserver_check_delay: 0\n\
             autodb_idle_timeout: 7\n\
             auth_timeout: 8\nshutdown_timeout: 9\nmax_message_size: 2048\n\
             max_buffered_message: 1024\nmax_buffered_total: 4096\nclient_message_timeout: 10\n\
             prepared_statements: 0\n\
             max_db_connections: 11\nmax_user_connections: 12\nmax_db_client_connections: 13\n\
             max_user_client_connections: 14\nreserve_pool_size: 15\nreserve_pool_timeout: 1.25\n\
             auth: { method: md5 }\nhooks: { enabled: false, dir: h, timeout_ms: 5, memory_limit_mb: 8 }\n\
             log: { level: debug, connections: false, disconnections: false }\n",
            "t.yaml",
        )
        .unwrap();
        let values: Vec<String> = config_rows(&c, false)
            .into_iter()
            .map(|r| r[1].clone().unwrap_or_default())
            .collect();
        assert_eq!(
            values,
            [
                "0.0.0.0:7000",
                "5",
                "6",
                "2",
                "3",
                "true",
                "4",
                "/run/usher",
                "0660",
                "usher",
                "session",
                "7",
                "1",
                "",
                "1.5",
                "2",
                "2.5",
                "true",
                "3",
                "4",
                "5",
                "6",
                "0",
                "7",
                "8",
                "9",
                "2048",
                "1024",
                "4096",
                "10",
                "0",
                "11",
                "12",
                "13",
                "14",
                "15",
                "1.25",
                "md5",
                "false",
                "h",
                "5",
                "8",
                "debug",
                "false",
                "false",
            ]
        );
    }
}
