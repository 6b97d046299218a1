//! What operators do to the pools and clients, shared by the console and
//! the signals: PAUSE/RESUME, RECONNECT, KILL, KILL_CLIENT (PgBouncer's
//! meanings). Each takes the state sessions share and nothing more.

use crate::frontend::deps::SessionDeps;
use crate::protocol::error::sqlstate;
use crate::protocol::PgError;

/// PAUSE [db]: no server connection is lent any more (clients wait, up
/// to query_wait_timeout); returns once every lent connection came back,
/// with the idle ones closed. `None`: every database.
pub async fn pause(deps: &SessionDeps, database: Option<&str>) -> Result<(), PgError> {
    known_database(deps, database)?;
    let pools = deps.pools.pause(database);
    tracing::warn!(database = database.unwrap_or("(all)"), "PAUSE");
    for pool in pools {
        pool.drained().await;
    }
    Ok(())
}

/// RESUME [db]: lends again; waiting clients go on.
pub fn resume(deps: &SessionDeps, database: Option<&str>) -> Result<(), PgError> {
    known_database(deps, database)?;
    deps.pools.resume(database);
    tracing::warn!(database = database.unwrap_or("(all)"), "RESUME");
    Ok(())
}

/// RECONNECT [db]: every server connection is replaced: idle ones now,
/// lent ones when they come back.
pub fn reconnect(deps: &SessionDeps, database: Option<&str>) -> Result<(), PgError> {
    known_database(deps, database)?;
    for pool in deps.pools.of(database) {
        pool.reconnect();
    }
    tracing::warn!(database = database.unwrap_or("(all)"), "RECONNECT");
    Ok(())
}

/// KILL [db]: ends every client of the database at once and closes its
/// server connections; it stays paused (new clients wait) until RESUME.
/// Returns how many clients were ended.
pub fn kill(deps: &SessionDeps, database: Option<&str>) -> Result<usize, PgError> {
    known_database(deps, database)?;
    let pools = deps.pools.pause(database);
    let mut killed = 0;
    for client in deps.clients.all() {
        let db = &*client.facts.database;
        // The console's own clients are not a database's clients.
        if !crate::admin::is_admin_database(db) && database.is_none_or(|d| db == d) {
            client.kill();
            killed += 1;
        }
    }
    for pool in pools {
        pool.reconnect();
    }
    tracing::warn!(
        database = database.unwrap_or("(all)"),
        clients = killed,
        "KILL"
    );
    Ok(killed)
}

/// KILL_CLIENT id: ends one client (its `id` in SHOW CLIENTS).
pub fn kill_client(deps: &SessionDeps, id: u64) -> Result<(), PgError> {
    let client = deps.clients.by_id(id).ok_or_else(|| {
        PgError::error(
            sqlstate::UNDEFINED_OBJECT,
            format!("no client with id {id}"),
        )
        .with_hint("SHOW CLIENTS lists the ids")
    })?;
    tracing::warn!(id, user = %client.facts.user, database = %client.facts.database, addr = %client.facts.addr, "KILL_CLIENT");
    client.kill();
    Ok(())
}

/// A database the console may name: a listed one, or an auto database
/// (reached through the fallback entry) that has a pool now.
fn known_database(deps: &SessionDeps, database: Option<&str>) -> Result<(), PgError> {
    let known = |d: &str| {
        deps.config().listed_database(d).is_some()
            || (deps.config().is_auto_database(d) && !deps.pools.of(Some(d)).is_empty())
    };
    match database {
        Some(d) if !known(d) => Err(PgError::error(
            sqlstate::INVALID_CATALOG_NAME,
            format!("no such database: {}", crate::protocol::error::shown(d, 64)),
        )),
        _ => Ok(()),
    }
}
