//! Cancel requests across instances (PgBouncer's peering): where a
//! CancelRequest goes when its key may belong to another usher.
//!
//! The key's secret names the instance that gave it
//! (`protocol::cancel_key`). A request for this instance is looked up
//! among its own clients; one for a listed peer is sent on to that peer's
//! address as a new CancelRequest with the forwardable bit cleared, on a
//! task of its own under [`FORWARD_TIMEOUT`] and at most `pool_size` at
//! once per peer, so a peer that is down or a flood of forged keys holds
//! up nobody. A request for an unknown peer, or one already forwarded that
//! is not ours, is dropped: cancel requests get no reply.

use super::client_registry::ClientRegistry;
use crate::backend::CancelTarget;
use crate::config::PeerConfig;
use crate::protocol::cancel_key;
use arc_swap::ArcSwap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How long a forwarded cancel may take (connect, send, the peer's close).
pub const FORWARD_TIMEOUT: Duration = Duration::from_secs(10);

/// One peer: where it listens and the cancels on their way to it.
#[derive(Debug)]
pub struct Peer {
    pub config: PeerConfig,
    /// Forwarded cancel requests not finished yet (SHOW PEERS).
    pending: AtomicUsize,
}

impl Peer {
    pub fn pending(&self) -> usize {
        self.pending.load(Ordering::Relaxed)
    }
}

/// The peer table: this instance's id (restart-only) and the others
/// (replaced by a reload).
#[derive(Debug)]
pub struct Peers {
    own_id: u16,
    table: ArcSwap<Vec<Arc<Peer>>>,
}

/// Where a cancel request goes.
#[derive(Debug)]
pub enum Route {
    /// One of this instance's clients, maybe: look up (pid, secret as given).
    Local { secret: u32 },
    /// Another instance's: send this secret on to it.
    Forward { peer: Arc<Peer>, secret: u32 },
    /// Nobody's, or forwarded to us by mistake: drop it.
    Drop { peer_id: u16 },
}

impl Peers {
    pub fn new(own_id: u16, peers: &[PeerConfig]) -> Peers {
        let p = Peers {
            own_id,
            table: ArcSwap::from_pointee(Vec::new()),
        };
        p.replace(peers);
        p
    }

    /// A reload's list. A peer whose entry did not change keeps its record
    /// (and its count of cancels under way); its own entry is ignored, so
    /// every instance may be given the same list.
    pub fn replace(&self, peers: &[PeerConfig]) {
        let old = self.table.load();
        let table = peers
            .iter()
            .filter(|c| c.id != self.own_id)
            .map(|c| match old.iter().find(|p| &p.config == c) {
                Some(same) => same.clone(),
                None => Arc::new(Peer {
                    config: c.clone(),
                    pending: AtomicUsize::new(0),
                }),
            })
            .collect();
        self.table.store(Arc::new(table));
    }

    /// The peers, by id (SHOW PEERS).
    pub fn all(&self) -> Vec<Arc<Peer>> {
        let mut all = self.table.load().to_vec();
        all.sort_by_key(|p| p.config.id);
        all
    }

    /// Where a cancel request with this secret goes.
    pub fn route(&self, secret: u32) -> Route {
        if self.own_id == 0 {
            return Route::Local { secret };
        }
        let key = cancel_key::decode(secret);
        if key.peer_id == self.own_id {
            return Route::Local {
                secret: cancel_key::as_given(secret),
            };
        }
        let peer = self
            .table
            .load()
            .iter()
            .find(|p| p.config.id == key.peer_id)
            .cloned();
        match peer {
            Some(peer) if key.forwardable => Route::Forward {
                peer,
                secret: cancel_key::forwarded(secret),
            },
            _ => Route::Drop {
                peer_id: key.peer_id,
            },
        }
    }
}

/// Serves a CancelRequest: this instance's client's server is sent the
/// cancel (on the caller's task: the cancel connection's own); another
/// instance's request is forwarded on a task of its own.
pub async fn cancel(peers: &Peers, clients: &ClientRegistry, pid: u32, secret: u32) {
    match peers.route(secret) {
        Route::Local { secret } => {
            if let Some(target) = clients.cancel_target(pid, secret) {
                if let Err(e) = target.cancel.send().await {
                    tracing::warn!(error = %e, "could not forward cancel request");
                }
            }
        }
        Route::Forward { peer, secret } => forward(peer, pid, secret),
        Route::Drop { peer_id } => {
            tracing::debug!(peer_id, "cancel request for no known peer dropped");
        }
    }
}

/// Sends the request on to `peer` in the background, unless `pool_size`
/// of them are already on their way there.
fn forward(peer: Arc<Peer>, pid: u32, secret: u32) {
    let limit = peer.config.pool_size;
    if peer
        .pending
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < limit).then_some(n + 1)
        })
        .is_err()
    {
        tracing::warn!(
            peer_id = peer.config.id,
            pool_size = limit,
            "cancel request not forwarded: too many on their way to this peer"
        );
        return;
    }
    tokio::spawn(async move {
        let target = CancelTarget {
            host: peer.config.host.clone(),
            port: peer.config.port,
            pid,
            secret,
        };
        match tokio::time::timeout(FORWARD_TIMEOUT, target.send()).await {
            Ok(Ok(())) => tracing::debug!(peer_id = peer.config.id, "cancel request forwarded"),
            Ok(Err(e)) => tracing::warn!(
                peer_id = peer.config.id,
                error = %e,
                "could not forward cancel request to peer"
            ),
            Err(_) => tracing::warn!(
                peer_id = peer.config.id,
                "forwarding a cancel request to peer timed out"
            ),
        }
        peer.pending.fetch_sub(1, Ordering::AcqRel);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(id: u16) -> PeerConfig {
        PeerConfig {
            id,
            host: "127.0.0.1".into(),
            port: 1,
            pool_size: 1,
        }
    }

    #[test]
    fn keys_route_to_their_instance_once() {
        let peers = Peers::new(1, &[peer(1), peer(2)]);
        // Its own entry is left out.
        assert_eq!(peers.all().len(), 1);
        let ours = cancel_key::new_secret(0xABCD_0000, 1);
        assert!(matches!(peers.route(ours), Route::Local { secret } if secret == ours));
        // Ours, arriving forwarded: found as given.
        let back = cancel_key::forwarded(ours);
        assert!(matches!(peers.route(back), Route::Local { secret } if secret == ours));
        let theirs = cancel_key::new_secret(0xABCD_0000, 2);
        match peers.route(theirs) {
            Route::Forward { peer, secret } => {
                assert_eq!(peer.config.id, 2);
                assert!(!cancel_key::decode(secret).forwardable);
            }
            other => panic!("{other:?}"),
        }
        // Already forwarded once: never again.
        let again = cancel_key::forwarded(theirs);
        assert!(matches!(peers.route(again), Route::Drop { peer_id: 2 }));
        let unknown = cancel_key::new_secret(0, 9);
        assert!(matches!(peers.route(unknown), Route::Drop { peer_id: 9 }));
    }

    #[test]
    fn without_peering_every_key_is_local() {
        let peers = Peers::new(0, &[peer(2)]);
        let s = cancel_key::new_secret(7, 2);
        assert!(matches!(peers.route(s), Route::Local { secret } if secret == s));
    }

    #[test]
    fn a_reload_keeps_unchanged_peers_and_their_counts() {
        let peers = Peers::new(1, &[peer(2), peer(3)]);
        let two = peers.all()[0].clone();
        two.pending.fetch_add(1, Ordering::Relaxed);
        let mut moved = peer(3);
        moved.port = 2;
        peers.replace(&[peer(2), moved]);
        let all = peers.all();
        assert!(Arc::ptr_eq(&all[0], &two));
        assert_eq!(all[0].pending(), 1);
        assert_eq!(all[1].config.port, 2);
    }

    #[tokio::test]
    async fn forwards_beyond_pool_size_are_dropped_and_a_dead_peer_is_let_go() {
        // A port nobody listens on: the connect fails, the count comes back.
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let mut dead = peer(2);
        dead.port = port;
        let peers = Peers::new(1, &[dead]);
        let p = peers.all()[0].clone();
        forward(p.clone(), 1, 2);
        // pool_size 1: a second one at once is not started.
        forward(p.clone(), 1, 2);
        assert!(p.pending() <= 1);
        tokio::time::timeout(Duration::from_secs(20), async {
            while p.pending() > 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("the failed forward is counted off");
    }
}
