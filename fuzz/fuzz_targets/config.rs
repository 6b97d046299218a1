//! The YAML configuration: parsing, validation, and what usher derives from
//! a valid one at run time (per-pool limits, durations, deadlines), which
//! must not fail for any configuration that passed validation.
#![no_main]
use libfuzzer_sys::fuzz_target;
use std::time::{Duration, Instant};
use usher::Config;

/// A number of seconds usher turns into a Duration and adds to now.
fn usable_seconds(key: &str, v: f64) {
    let d = Duration::try_from_secs_f64(v).unwrap_or_else(|e| panic!("{key}: {v}: {e}"));
    assert!(
        Instant::now().checked_add(d).is_some(),
        "{key}: {v} overflows a deadline"
    );
}

fn usable_millis(key: &str, v: u64) {
    let d = Duration::from_millis(v);
    assert!(
        Instant::now().checked_add(d).is_some(),
        "{key}: {v} overflows a deadline"
    );
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let config = match Config::from_yaml(text, "fuzz.yaml") {
        Ok(c) => c,
        Err(e) => {
            assert_eq!(e.file, "fuzz.yaml");
            assert!(!e.key.is_empty() && !e.message.is_empty());
            return;
        }
    };
    let mut databases: Vec<&str> = config.databases.keys().map(String::as_str).collect();
    databases.push("not-configured");
    let mut users: Vec<&str> = config.users.keys().map(String::as_str).collect();
    users.push("not-configured");
    for db in &databases {
        for user in &users {
            let limits = config.limits_for(db, user);
            assert!(limits.size > 0);
            let _ = config.pool_mode_for(db, user);
        }
    }
    for (key, db) in &config.databases {
        let _ = db.server_dbname(key);
    }
    let _ = config.hook_query_connection();
    let _ = config.auth.effective_query();
    for (key, v) in [
        ("query_wait_timeout", config.query_wait_timeout),
        ("client_idle_timeout", config.client_idle_timeout),
        ("idle_transaction_timeout", config.idle_transaction_timeout),
        ("server_idle_timeout", config.server_idle_timeout),
        ("server_lifetime", config.server_lifetime),
        ("server_check_delay", config.server_check_delay),
        ("server_connect_timeout", config.server_connect_timeout),
        ("auth_timeout", config.auth_timeout),
        ("shutdown_timeout", config.shutdown_timeout),
        ("auth.cache_ttl", config.auth.cache_ttl),
        ("hooks.roles_refresh_s", config.hooks.roles_refresh_s),
    ] {
        usable_seconds(key, v);
    }
    for (name, db) in &config.databases {
        for v in [
            db.query_wait_timeout,
            db.client_idle_timeout,
            db.idle_transaction_timeout,
            db.server_idle_timeout,
            db.server_lifetime,
            db.server_connect_timeout,
        ]
        .into_iter()
        .flatten()
        {
            usable_seconds(&format!("databases.{name}"), v);
        }
    }
    if let Some(m) = &config.auth_monitor {
        usable_seconds("auth_monitor.save_interval_s", m.save_interval_s);
        if let Some(l) = &m.lockout {
            usable_seconds("auth_monitor.lockout.window_s", l.window_s);
            usable_seconds("auth_monitor.lockout.duration_s", l.duration_s);
        }
    }
    usable_millis("hooks.timeout_ms", config.hooks.timeout_ms);
    if let Some(q) = &config.hooks.query {
        usable_millis("hooks.query.timeout_ms", q.timeout_ms);
    }
    assert!(
        config
            .hooks
            .memory_limit_mb
            .checked_mul(1024 * 1024)
            .is_some(),
        "hooks.memory_limit_mb overflows in bytes"
    );
});
