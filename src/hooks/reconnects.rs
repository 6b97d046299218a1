//! How many times the console's RECONNECT named each database, and how
//! many times it named none: what `usher.reconnects(database)` tells a
//! hook, so that a hook's cache of routes (the routing-table recipe) can
//! notice a RECONNECT and read its table again.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Debug, Default)]
pub struct Reconnects {
    /// RECONNECT without a database.
    all: AtomicU64,
    by_database: Mutex<HashMap<String, u64>>,
}

impl Reconnects {
    /// RECONNECT `database` (all, without one) was done.
    pub fn record(&self, database: Option<&str>) {
        match database {
            None => {
                self.all.fetch_add(1, Ordering::Relaxed);
            }
            Some(db) => *self.by_database.lock().entry(db.to_string()).or_default() += 1,
        }
    }

    /// The RECONNECTs that reached `database`: those naming it and those
    /// naming none.
    pub fn of(&self, database: &str) -> u64 {
        let named = self.by_database.lock().get(database).copied().unwrap_or(0);
        self.all.load(Ordering::Relaxed) + named
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_database_counts_its_own_reconnects_and_those_of_all() {
        let r = Reconnects::default();
        assert_eq!(r.of("app"), 0);
        r.record(Some("app"));
        r.record(Some("app"));
        r.record(Some("other"));
        r.record(None);
        assert_eq!((r.of("app"), r.of("other"), r.of("none")), (3, 2, 1));
    }
}
