//! usher's integration tests, built as one test binary (one link instead
//! of one per file), each file a module: `cargo test --test it <module>::`
//! runs one file's tests, e.g. `cargo test --test it cuts::`.
//!
//! The modules share one throwaway PostgreSQL cluster
//! ([`common::PgCluster::shared`]); a module whose tests change the whole
//! cluster (its TLS certificate, pg_hba.conf, role grants) or count every
//! backend of a role starts its own ([`common::PgCluster::own`]), so that
//! the tests of other modules running beside it neither disturb it nor
//! are disturbed. Two files stay test binaries of their own, because each
//! installs a process-wide tracing subscriber: `tests/logging.rs` and
//! `tests/secure_login.rs`.

#[path = "../common/mod.rs"]
mod common;

mod anydb;
mod auth_sources;
mod auth_store;
mod buffers;
mod builtins;
mod caps;
mod control;
mod cookbook;
mod cuts;
mod drop_database;
mod extended_protocol;
mod failover;
mod faults;
mod hardening;
mod harness;
mod hba;
mod held_servers;
mod hook_limits;
mod hooks;
mod layers;
mod limits;
mod login;
mod memory;
mod online_restart;
mod operations;
mod overload;
mod own_statements;
mod params;
mod peers;
mod pinning;
mod pooling;
mod prepared;
mod protocol;
mod routing;
mod server_restarts;
mod server_socket;
mod session_state;
mod settings;
mod stale_statements;
mod statement_names;
mod tls;
mod tls_stress;
mod unix_socket;
mod unnamed_statement;
