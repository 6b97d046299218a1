//! The keys of running several instances: `peer_id` and `peers` (cancel
//! requests forwarded to the instance that gave the key, as PgBouncer's
//! peering) and `so_reuseport` (several processes on one port).
//!
//! Only shapes and ranges are checked here; `protocol::cancel_key` says how
//! the peer id sits in the keys clients are given.

use super::ConfigIssue;
use serde::Deserialize;
use std::collections::BTreeSet;

/// The largest `peer_id` (and `peers[].id`): the id takes 14 bits of the
/// cancel key, as in PgBouncer (whose maximum is the same).
pub const MAX_PEER_ID: u16 = 16_383;

/// One entry of `peers:`: another usher a cancel request may belong to.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerConfig {
    /// Its `peer_id`.
    pub id: u16,
    /// Where it listens for clients (a cancel request is sent there).
    pub host: String,
    #[serde(default = "defaults::port")]
    pub port: u16,
    /// Cancel requests forwarded to it at once; more are dropped (a burst
    /// of forged keys cannot open unbounded connections).
    #[serde(default = "defaults::pool_size")]
    pub pool_size: usize,
}

mod defaults {
    super::super::settings::defaults_from_table! {
        port: u16 = "peers.port";
        pool_size: usize = "peers.pool_size";
    }
}

/// Checks `peer_id` and `peers`: ids in 1..=MAX_PEER_ID, each listed once,
/// a host and a port, a pool_size above 0. An entry with the instance's
/// own id is allowed (and ignored), so every instance may share one list.
pub fn validate(peer_id: u16, peers: &[PeerConfig]) -> Result<(), ConfigIssue> {
    if peer_id > MAX_PEER_ID {
        return Err(ConfigIssue::new(
            "peer_id",
            format!("expected 0 (no peering) to {MAX_PEER_ID}"),
        ));
    }
    let mut seen = BTreeSet::new();
    for (i, peer) in peers.iter().enumerate() {
        let key = |field: &str| format!("peers[{i}].{field}");
        if peer.id == 0 || peer.id > MAX_PEER_ID {
            return Err(ConfigIssue::new(
                key("id"),
                format!("expected 1 to {MAX_PEER_ID}"),
            ));
        }
        if !seen.insert(peer.id) {
            return Err(ConfigIssue::new(
                key("id"),
                format!("peer {} is listed twice", peer.id),
            ));
        }
        if peer.host.is_empty() {
            return Err(ConfigIssue::new(
                key("host"),
                "expected a host name or address",
            ));
        }
        if peer.port == 0 {
            return Err(ConfigIssue::new(key("port"), "expected a port (1-65535)"));
        }
        if peer.pool_size == 0 {
            return Err(ConfigIssue::new(
                key("pool_size"),
                "expected a number greater than 0",
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(id: u16) -> PeerConfig {
        PeerConfig {
            id,
            host: "127.0.0.1".into(),
            port: 6432,
            pool_size: 4,
        }
    }

    #[test]
    fn ids_are_bounded_and_unique() {
        assert!(validate(0, &[]).is_ok());
        assert!(validate(1, &[peer(1), peer(2)]).is_ok());
        assert_eq!(validate(16_384, &[]).unwrap_err().key, "peer_id");
        assert_eq!(validate(1, &[peer(0)]).unwrap_err().key, "peers[0].id");
        assert_eq!(
            validate(1, &[peer(2), peer(2)]).unwrap_err().key,
            "peers[1].id"
        );
        let mut p = peer(3);
        p.pool_size = 0;
        assert_eq!(validate(1, &[p]).unwrap_err().key, "peers[0].pool_size");
        let mut p = peer(3);
        p.host.clear();
        assert_eq!(validate(1, &[p]).unwrap_err().key, "peers[0].host");
    }
}
