//! Connected clients, by the BackendKeyData usher gave them: how a cancel
//! request finds the server connection that currently serves a client.

use crate::backend::CancelTarget;
use dashmap::DashMap;
use rand::Rng;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// What other tasks may need to know about one client.
#[derive(Debug)]
pub struct ClientHandle {
    /// usher's "process id" for this client (its BackendKeyData pid).
    pub pid: u32,
    pub secret: u32,
    /// The server connection serving the client right now, if any.
    serving: Mutex<Option<CancelTarget>>,
}

impl ClientHandle {
    pub fn set_server(&self, target: Option<CancelTarget>) {
        *self.serving.lock().unwrap() = target;
    }

    pub fn server(&self) -> Option<CancelTarget> {
        self.serving.lock().unwrap().clone()
    }
}

/// All connected clients, keyed by their pid.
#[derive(Debug, Default)]
pub struct ClientRegistry {
    by_pid: DashMap<u32, Arc<ClientHandle>>,
    count: AtomicUsize,
}

/// Removes the client from the registry when its task ends.
#[derive(Debug)]
pub struct Registration {
    registry: Arc<ClientRegistry>,
    pub handle: Arc<ClientHandle>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.registry.by_pid.remove(&self.handle.pid);
    }
}

/// Counts a connected client until dropped.
#[derive(Debug)]
pub struct Connected(Arc<ClientRegistry>);

impl Drop for Connected {
    fn drop(&mut self) {
        self.0.count.fetch_sub(1, Ordering::Relaxed);
    }
}

impl ClientRegistry {
    /// Counts a new connection; returns the guard and the count including it.
    pub fn connect(self: &Arc<Self>) -> (Connected, usize) {
        let n = self.count.fetch_add(1, Ordering::Relaxed) + 1;
        (Connected(self.clone()), n)
    }

    /// Clients connected right now.
    pub fn connected(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }

    /// Gives a logged-in client a unique pid and a random secret.
    pub fn register(self: &Arc<Self>) -> Registration {
        let mut rng = rand::thread_rng();
        loop {
            let pid = rng.gen_range(1..i32::MAX as u32);
            if let dashmap::Entry::Vacant(v) = self.by_pid.entry(pid) {
                let handle = Arc::new(ClientHandle {
                    pid,
                    secret: rng.gen(),
                    serving: Mutex::new(None),
                });
                v.insert(handle.clone());
                return Registration {
                    registry: self.clone(),
                    handle,
                };
            }
        }
    }

    /// The server to cancel for a cancel request, if the key matches a client
    /// that is being served right now.
    pub fn cancel_target(&self, pid: u32, secret: u32) -> Option<CancelTarget> {
        let handle = self.by_pid.get(&pid)?.clone();
        if !crate::auth::secret::ct_eq(&handle.secret.to_be_bytes(), &secret.to_be_bytes()) {
            return None;
        }
        handle.server()
    }
}
