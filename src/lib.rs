//! usher: a PostgreSQL connection pooler with programmable session hooks.
//!
//! See ARCHITECTURE.md for the map of the modules and how a connection
//! flows through them.

pub(crate) mod accept;
pub mod admin;
pub mod app;
pub mod auth;
pub mod backend;
pub mod client_addr;
pub mod config;
pub mod frontend;
pub mod hooks;
pub(crate) mod listen;
pub mod logging;
pub mod metrics;
pub(crate) mod pool;
pub mod protocol;
pub mod shards;
pub mod signals;
pub mod tls;
pub mod unix_listen;

pub use app::{App, Server};
pub use config::Config;
