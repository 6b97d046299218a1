//! `auth_monitor.store`: usher instances sharing their auth monitor counts
//! through PostgreSQL, talking to it and to their clients directly (no
//! load balancer; benches/multi_instance.sh runs the lockout check behind
//! HAProxy). Wrong passwords spread over three instances lock the user out
//! on all of them, SHOW AUTH_MON agrees everywhere, RESET AUTH_MON on one
//! lifts the lock on all; a store that cannot be reached, hangs, or goes
//! away blocks no login and leaves each instance counting alone; what
//! waits is written at shutdown.

use crate::common;

use crate::common::console::{console, get, row, Row};
use crate::common::wait::{wait_for_async, DEADLINE};
use crate::common::{sqlstate, usher_yaml, PgCluster, Usher, ALICE_PASSWORD, BOB_PASSWORD};
use std::time::Duration;

const STORE_USER: &str = "usher_mon";
const STORE_PASSWORD: &str = "mon-pw";

/// The store's role and a schema of its own for one test (tests share the
/// cluster and run at once).
fn store_schema(pg: &PgCluster, schema: &str) {
    pg.ensure_role(STORE_USER, &format!("LOGIN PASSWORD '{STORE_PASSWORD}'"));
    pg.psql_super_db(
        "app",
        &format!("DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema} AUTHORIZATION {STORE_USER}"),
    );
}

/// usher's configuration with the store's user listed, `databases_extra`
/// entries beside `app`, and `extra` lines.
fn yaml_with_store(pg: &PgCluster, databases_extra: &str, extra: &str) -> String {
    usher_yaml(pg, extra)
        .replacen(
            "users:\n",
            &format!("users:\n  {STORE_USER}:\n    password: {STORE_PASSWORD}\n"),
            1,
        )
        .replacen("databases:\n", &format!("databases:\n{databases_extra}"), 1)
}

/// usher's configuration with the store in its own `schema` of `app`
/// (made afresh), with store `options` beside database, user and schema.
fn yaml_with_app_store(pg: &PgCluster, schema: &str, options: &str) -> String {
    store_schema(pg, schema);
    yaml_with_store(
        pg,
        "",
        &monitor(&format!(
            "{{ database: app, user: {STORE_USER}, schema: {schema}, {options} }}"
        )),
    )
}

/// The auth monitor with a lockout by user name after 3 failures, sharing
/// through `store` (YAML flow mapping of auth_monitor.store).
fn monitor(store: &str) -> String {
    format!(
        "auth_monitor:\n  lockout: {{ max_failures: 3, window_s: 60, duration_s: 600, by_address: false }}\n  store: {store}\n"
    )
}

/// A login that must fail: its SQLSTATE and message (within a generous
/// bound: a login never waits for the store).
async fn refused(port: u16, user: &str, password: &str) -> (String, String) {
    let conn = format!("host=127.0.0.1 port={port} user={user} password={password} dbname=app");
    let attempt = tokio::time::timeout(
        Duration::from_secs(10),
        tokio_postgres::connect(&conn, tokio_postgres::NoTls),
    )
    .await
    .unwrap_or_else(|_| panic!("{user}'s login on {port} hung"));
    let e = match attempt {
        Ok(_) => panic!("{user} logged in on {port}"),
        Err(e) => e,
    };
    let message = e.as_db_error().map(|d| d.message().to_string());
    (
        sqlstate(&e).unwrap_or_else(|| format!("{e:?}")),
        message.unwrap_or_default(),
    )
}

/// A login that must succeed, within the same bound.
async fn logs_in(port: u16, user: &str, password: &str) {
    let conn = format!("host=127.0.0.1 port={port} user={user} password={password} dbname=app");
    let (client, driver) = tokio::time::timeout(
        Duration::from_secs(10),
        tokio_postgres::connect(&conn, tokio_postgres::NoTls),
    )
    .await
    .unwrap_or_else(|_| panic!("{user}'s login on {port} hung"))
    .unwrap_or_else(|e| panic!("{user} on {port}: {e:?}"));
    tokio::spawn(driver);
    client.simple_query("SELECT 1").await.unwrap();
}

/// alice's SHOW AUTH_MON row on `usher`, if it has one.
async fn alice_row(usher: &Usher) -> Option<Row> {
    console(usher, "SHOW AUTH_MON")
        .await
        .into_iter()
        .find(|r| get(r, "rolname") == Some("alice"))
}

/// Waits until alice's row on `usher` satisfies `ok`; returns it.
async fn wait_alice(usher: &Usher, what: &str, ok: impl Fn(&Row) -> bool) -> Row {
    wait_for_async(DEADLINE, what, || async {
        match alice_row(usher).await {
            Some(r) if ok(&r) => Ok(r),
            other => Err(other),
        }
    })
    .await
}

fn failures(n: u64) -> impl Fn(&Row) -> bool {
    move |r: &Row| get(r, "other_auth_failures") == Some(n.to_string().as_str())
}

/// SHOW AUTH_STORE's row on `usher`.
async fn store_row(usher: &Usher) -> Row {
    console(usher, "SHOW AUTH_STORE").await.remove(0)
}

async fn wait_store_state(usher: &Usher, state: &str) -> Row {
    wait_for_async(DEADLINE, &format!("SHOW AUTH_STORE: {state}"), || async {
        let r = store_row(usher).await;
        if get(&r, "state") == Some(state) {
            Ok(r)
        } else {
            Err(r)
        }
    })
    .await
}

const LOCKED: &str = "too many failed login attempts for user \"alice\"";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_spread_over_three_instances_lock_the_user_out_on_all_of_them() {
    let pg = PgCluster::shared();
    let yaml = yaml_with_app_store(
        pg,
        "store_three",
        "flush_interval_s: 0.1, refresh_interval_s: 0.1",
    );
    let ushers = vec![
        Usher::start_yaml(&yaml).await,
        Usher::start_yaml(&yaml).await,
        Usher::start_yaml(&yaml).await,
    ];
    for u in &ushers {
        let r = wait_store_state(u, "connected").await;
        assert!(get(&r, "instance").is_some_and(|i| !i.is_empty()), "{r:?}");
    }
    let instances: std::collections::HashSet<_> = {
        let mut v = Vec::new();
        for u in &ushers {
            v.push(get(&store_row(u).await, "instance").unwrap().to_string());
        }
        v.into_iter().collect()
    };
    assert_eq!(instances.len(), 3, "each instance has a name of its own");

    // One wrong password on each instance in turn; each is seen by all
    // three before the next (alone, none of them reaches 3).
    for (i, u) in ushers.iter().enumerate() {
        let (code, _) = refused(u.addr.port(), "alice", "guess").await;
        assert_eq!(code, "28P01", "instance {i}");
        if i < 2 {
            for other in &ushers {
                wait_alice(
                    other,
                    &format!("{} failure(s) seen everywhere", i + 1),
                    failures(i as u64 + 1),
                )
                .await;
            }
        }
    }
    // The third failure, on the third instance, reached the limit with the
    // other two's: it refuses alice at once, the right password too, as
    // a local lockout does.
    let (code, message) = refused(ushers[2].addr.port(), "alice", ALICE_PASSWORD).await;
    assert_eq!((code.as_str(), message.as_str()), ("28000", LOCKED));
    // The others refuse her once they read the lock.
    for u in &ushers[..2] {
        wait_alice(u, "the lock reaches the other instances", |r| {
            get(r, "locked_until").is_some()
        })
        .await;
        let (code, message) = refused(u.addr.port(), "alice", ALICE_PASSWORD).await;
        assert_eq!((code.as_str(), message.as_str()), ("28000", LOCKED));
    }
    // Others are not locked out.
    for u in &ushers {
        logs_in(u.addr.port(), "bob", BOB_PASSWORD).await;
    }
    // SHOW AUTH_MON agrees on every instance once the refusals are written:
    // three failures, three refusals (one on each), the same lock.
    let mut rows = Vec::new();
    for u in &ushers {
        rows.push(
            wait_alice(u, "every refusal counted everywhere", |r| {
                failures(3)(r) && get(r, "blocked_attempts") == Some("3")
            })
            .await,
        );
    }
    for r in &rows[1..] {
        assert_eq!(r, &rows[0], "SHOW AUTH_MON's alice row differs");
    }
    assert_eq!(get(&rows[0], "last_failed_addr"), Some("127.0.0.1"));
    assert_eq!(get(&rows[0], "successful_attempts"), Some("0"));
    assert!(get(&rows[0], "last_failed_ts").is_some());
    // The columns are pg_auth_mon's, in its order, then usher's.
    let (columns, _) = common::console::console_table(&ushers[1], "SHOW AUTH_MON").await;
    assert_eq!(
        columns[..8],
        [
            "rolname",
            "deleted",
            "uid",
            "successful_attempts",
            "last_successful_ts",
            "total_hba_conflicts",
            "other_auth_failures",
            "last_failed_ts"
        ]
    );
    // The store holds the sums (the documented layout).
    assert_eq!(
        pg.psql_super_db(
            "app",
            "SELECT other_auth_failures, blocked_attempts FROM store_three.usher_auth_mon_roles WHERE uid = 0 AND name = 'alice'"
        ),
        "3|3"
    );
    assert_eq!(
        pg.psql_super_db(
            "app",
            "SELECT count(*) FROM store_three.usher_auth_mon_locks WHERE scope = 'role' AND key = 'alice' AND locked_until > now()"
        ),
        "1"
    );

    // RESET AUTH_MON on one instance lifts the lock on all of them.
    console(&ushers[0], "RESET AUTH_MON alice").await;
    for u in &ushers {
        wait_for_async(DEADLINE, "the reset reaches every instance", || async {
            match alice_row(u).await {
                Some(r) if get(&r, "locked_until").is_some() => Err(Some(r)),
                other => Ok(other),
            }
        })
        .await;
        logs_in(u.addr.port(), "alice", ALICE_PASSWORD).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_cannot_be_reached_or_hangs_blocks_no_login() {
    let pg = PgCluster::shared();
    // Nothing listens on one port; the other accepts and never answers.
    let dead = common::free_port();
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_port = silent.local_addr().unwrap().port();
    let held = tokio::spawn(async move {
        let mut kept = Vec::new();
        while let Ok((s, _)) = silent.accept().await {
            kept.push(s);
        }
    });
    for (name, port, error) in [
        ("deadstore", dead, "cannot connect"),
        ("silentstore", silent_port, "took longer than"),
    ] {
        let yaml = yaml_with_store(
            pg,
            &format!("  {name}:\n    host: 127.0.0.1\n    port: {port}\n    tls: disable\n"),
            &monitor(&format!(
                "{{ database: {name}, user: {STORE_USER}, flush_interval_s: 0.1, refresh_interval_s: 0.1, timeout_s: 1 }}"
            )),
        );
        let usher = Usher::start_yaml(&yaml).await;
        let port = usher.addr.port();
        let r = wait_store_state(&usher, "unreachable").await;
        assert!(
            get(&r, "last_error").is_some_and(|e| e.contains(error)),
            "{name}: {r:?}"
        );
        // Logins go on; the lockout counts this instance's failures alone,
        // as without a store.
        logs_in(port, "alice", ALICE_PASSWORD).await;
        for _ in 0..3 {
            let (code, _) = refused(port, "alice", "guess").await;
            assert_eq!(code, "28P01", "{name}");
        }
        let (code, message) = refused(port, "alice", ALICE_PASSWORD).await;
        assert_eq!(
            (code.as_str(), message.as_str()),
            ("28000", LOCKED),
            "{name}"
        );
        logs_in(port, "bob", BOB_PASSWORD).await;
        // SHOW AUTH_MON shows what this instance counted.
        let rows = console(&usher, "SHOW AUTH_MON").await;
        let alice = row(&rows, "rolname", "alice");
        assert_eq!(get(alice, "other_auth_failures"), Some("3"), "{name}");
        assert_eq!(get(alice, "successful_attempts"), Some("1"), "{name}");
        let store = store_row(&usher).await;
        assert!(
            get(&store, "pending").is_some_and(|p| p != "0"),
            "the counts wait for the store: {store:?}"
        );
    }
    held.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_goes_away_and_comes_back() {
    let pg = PgCluster::shared();
    let yaml = yaml_with_app_store(
        pg,
        "store_back",
        "flush_interval_s: 0.1, refresh_interval_s: 0.1, timeout_s: 2",
    );
    let usher = Usher::start_yaml(&yaml).await;
    let port = usher.addr.port();
    wait_store_state(&usher, "connected").await;
    refused(port, "alice", "guess").await;
    wait_for_async(DEADLINE, "the failure is written", || async {
        let n = pg.psql_super_db(
            "app",
            "SELECT coalesce(sum(other_auth_failures), 0) FROM store_back.usher_auth_mon_roles WHERE name = 'alice'",
        );
        if n == "1" {
            Ok(())
        } else {
            Err(n)
        }
    })
    .await;
    // The tables go (as if the store database were dropped): flushes fail,
    // the instance counts alone, logins go on.
    pg.psql_super_db("app", "DROP SCHEMA store_back CASCADE");
    refused(port, "alice", "guess").await;
    let r = wait_for_async(DEADLINE, "SHOW AUTH_STORE: the error", || async {
        let r = store_row(&usher).await;
        if matches!(get(&r, "state"), Some("error" | "unreachable")) {
            Ok(r)
        } else {
            Err(r)
        }
    })
    .await;
    assert!(get(&r, "last_error").is_some(), "{r:?}");
    logs_in(port, "bob", BOB_PASSWORD).await;
    // Back: the tables are made again and what waited is written.
    pg.psql_super_db(
        "app",
        &format!("CREATE SCHEMA store_back AUTHORIZATION {STORE_USER}"),
    );
    wait_store_state(&usher, "connected").await;
    wait_for_async(DEADLINE, "the waiting counts are written", || async {
        let n = pg.psql_super_db(
            "app",
            "SELECT coalesce(sum(other_auth_failures), 0) FROM store_back.usher_auth_mon_roles WHERE name = 'alice'",
        );
        if n == "1" {
            Ok(())
        } else {
            Err(n)
        }
    })
    .await;
    // The store lost the first failure with its tables; SHOW AUTH_MON
    // shows what the store has now.
    wait_alice(&usher, "SHOW AUTH_MON reads the store again", failures(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_is_left_is_written_at_shutdown() {
    let pg = PgCluster::shared();
    // No flush after the first one for a minute: only the shutdown's
    // writes what comes next.
    let yaml = yaml_with_app_store(
        pg,
        "store_last",
        "flush_interval_s: 60, refresh_interval_s: 60",
    );
    let usher = Usher::start_yaml(&yaml).await;
    let port = usher.addr.port();
    wait_store_state(&usher, "connected").await;
    let r = wait_for_async(DEADLINE, "the first flush and read", || async {
        let r = store_row(&usher).await;
        if get(&r, "last_refresh_ts").is_some() {
            Ok(r)
        } else {
            Err(r)
        }
    })
    .await;
    let flushes = get(&r, "flushes").unwrap().to_string();
    for _ in 0..2 {
        refused(port, "alice", "guess").await;
    }
    let r = store_row(&usher).await;
    assert_eq!(get(&r, "flushes"), Some(flushes.as_str()), "{r:?}");
    assert_ne!(get(&r, "pending"), Some("0"), "{r:?}");
    let count = || {
        pg.psql_super_db(
            "app",
            "SELECT coalesce(sum(other_auth_failures), 0) FROM store_last.usher_auth_mon_roles WHERE name = 'alice'",
        )
    };
    assert_eq!(count(), "0");
    drop(usher);
    wait_for_async(DEADLINE, "the last flush at shutdown", || async {
        let n = count();
        if n == "2" {
            Ok(())
        } else {
            Err(n)
        }
    })
    .await;
}
