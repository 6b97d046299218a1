//! Connected clients: how a cancel request finds the server connection that
//! serves a client (by the BackendKeyData usher gave it), what SHOW CLIENTS
//! and SHOW SERVERS list, and how KILL_CLIENT reaches one.
//!
//! Each client's row is its own: the serve loop updates its state with
//! relaxed atomics and a per-client mutex, never a lock shared by clients.

use crate::backend::ServerSummary;
use crate::client_addr::ClientAddr;
use crate::protocol::cancel_key;
use atomic_waker::AtomicWaker;
use dashmap::DashMap;
use parking_lot::Mutex;
use rand::Rng;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::{SystemTime, UNIX_EPOCH};

/// What a client is doing, as SHOW CLIENTS says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ClientState {
    /// Between transactions, holding no server connection.
    Idle = 0,
    /// Holding a server connection.
    Active = 1,
    /// Waiting for a server connection (pool full or paused).
    Waiting = 2,
}

impl ClientState {
    pub fn as_str(self) -> &'static str {
        match self {
            ClientState::Idle => "idle",
            ClientState::Active => "active",
            ClientState::Waiting => "waiting",
        }
    }
}

/// Facts about a client fixed at login (SHOW CLIENTS' columns).
#[derive(Debug, Clone)]
///
/// Boxed strings (16 bytes each, not 24): every idle client keeps these.
pub struct ClientFacts {
    /// The same strings as the hook context's `ClientInfo`.
    pub user: Arc<str>,
    pub database: Arc<str>,
    pub addr: ClientAddr,
    /// usher's end of a TCP connection.
    pub local: Option<SocketAddr>,
    pub application_name: Arc<str>,
    /// e.g. `TLSv1_3/TLS13_AES_256_GCM_SHA384`; empty without TLS.
    pub tls: Box<str>,
}

/// What other tasks may need to know about one client, or tell it.
#[derive(Debug)]
pub struct ClientHandle {
    /// usher's sequential id for the client (SHOW CLIENTS' `id`, KILL_CLIENT's argument).
    pub id: u64,
    /// The client's BackendKeyData pid: usher's own, or (session mode) its
    /// backend's. Not unique: a backend reused by a later client, or two
    /// servers, may give two clients the same one; the secret tells them
    /// apart.
    pid: AtomicU32,
    pub secret: u32,
    pub facts: ClientFacts,
    pub connect_time: SystemTime,
    state: AtomicU8,
    /// Unix microseconds of the last transaction start, and of the start of
    /// the current wait for a server connection.
    request_us: AtomicU64,
    wait_since_us: AtomicU64,
    /// Named prepared statements the client has (transaction mode).
    prepared: AtomicU32,
    /// The server connection serving the client right now, if any.
    serving: Mutex<Option<Arc<ServerSummary>>>,
    /// KILL_CLIENT / KILL: the session ends as soon as it is woken.
    kill: KillSwitch,
    /// Where a hook routed the client (`ResolvedRoute::shown`), if it did:
    /// one pointer (every idle client keeps this; SHOW alone reads it).
    route: arc_swap::ArcSwapOption<Arc<str>>,
}

/// A flag and a waker, lock-free: the serve loop polls it at every wake-up.
#[derive(Debug, Default)]
struct KillSwitch {
    killed: AtomicBool,
    waker: AtomicWaker,
}

impl ClientHandle {
    /// SHOW's `database` value: the database the client asked for, or
    /// where a hook routed it (`base@host:port/dbname`).
    pub fn shown_database(&self) -> Arc<str> {
        match self.route.load_full() {
            Some(route) => Arc::clone(&route),
            None => self.facts.database.clone(),
        }
    }

    /// The pid the client was told (BackendKeyData).
    pub fn pid(&self) -> u32 {
        self.pid.load(Ordering::Relaxed)
    }

    /// A client begins to wait for a server connection.
    pub fn waiting(&self) {
        let now = unix_us(SystemTime::now());
        self.request_us.store(now, Ordering::Relaxed);
        self.wait_since_us.store(now, Ordering::Relaxed);
        self.state
            .store(ClientState::Waiting as u8, Ordering::Relaxed);
    }

    /// The client got a server connection (`Some`) or gave it back (`None`).
    pub fn set_server(&self, server: Option<Arc<ServerSummary>>) {
        let state = if server.is_some() {
            ClientState::Active
        } else {
            ClientState::Idle
        };
        self.wait_since_us.store(0, Ordering::Relaxed);
        self.state.store(state as u8, Ordering::Relaxed);
        *self.serving.lock() = server;
    }

    pub fn server(&self) -> Option<Arc<ServerSummary>> {
        self.serving.lock().clone()
    }

    pub fn state(&self) -> ClientState {
        match self.state.load(Ordering::Relaxed) {
            1 => ClientState::Active,
            2 => ClientState::Waiting,
            _ => ClientState::Idle,
        }
    }

    /// When the client last began a transaction (or logged in).
    pub fn request_time(&self) -> SystemTime {
        match self.request_us.load(Ordering::Relaxed) {
            0 => self.connect_time,
            us => UNIX_EPOCH + std::time::Duration::from_micros(us),
        }
    }

    /// How long the client has been waiting for a server connection.
    pub fn wait_us(&self) -> u64 {
        match self.wait_since_us.load(Ordering::Relaxed) {
            0 => 0,
            since => unix_us(SystemTime::now()).saturating_sub(since),
        }
    }

    pub fn set_prepared(&self, n: usize) {
        self.prepared.store(n as u32, Ordering::Relaxed);
    }

    pub fn prepared(&self) -> u32 {
        self.prepared.load(Ordering::Relaxed)
    }

    /// Ends the client's session (KILL_CLIENT, KILL).
    pub fn kill(&self) {
        self.kill.killed.store(true, Ordering::Release);
        self.kill.waker.wake();
    }

    /// Resolves once the client is killed.
    pub fn killed(&self) -> impl Future<Output = ()> + '_ {
        std::future::poll_fn(move |cx| self.poll_killed(cx))
    }

    /// Ready once the client is killed; else the task is woken when it is,
    /// or when it is [poked](ClientHandle::poke).
    pub fn poll_killed(&self, cx: &mut std::task::Context<'_>) -> Poll<()> {
        let k = &self.kill;
        if k.killed.load(Ordering::Acquire) {
            return Poll::Ready(());
        }
        k.waker.register(cx.waker());
        // A kill between the check and the registration woke nobody.
        if k.killed.load(Ordering::Acquire) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }

    /// Wakes the client's task without killing it: an idle client looks
    /// again at what may end it (shutdown's drain).
    pub fn poke(&self) {
        self.kill.waker.wake();
    }
}

fn unix_us(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// All connected clients, keyed by the pid they were told (several may
/// share one).
#[derive(Debug, Default)]
pub struct ClientRegistry {
    by_pid: DashMap<u32, Listed>,
    count: AtomicUsize,
    next_id: AtomicU64,
    /// `peer_id` (restart-only): put in every secret given out
    /// (protocol::cancel_key); 0: the secret is all random.
    peer_id: u16,
}

/// Removes the client from the registry when its task ends.
#[derive(Debug)]
pub struct Registration {
    registry: Arc<ClientRegistry>,
    pub handle: Arc<ClientHandle>,
    /// Its place under `max_db_client_connections` and
    /// `max_user_client_connections`, given back with the registration.
    place: Option<crate::pool::caps::ClientPlace>,
}

/// The clients told one pid: nearly always one, kept without a list of its
/// own (every idle client has an entry). The rare list is boxed, so an
/// entry is 16 bytes, not 32 (with its key 24, not 40, in every bucket).
#[derive(Debug)]
enum Listed {
    One(Arc<ClientHandle>),
    // The box is the point: a thin pointer keeps every entry small.
    #[allow(clippy::box_collection)]
    Many(Box<Vec<Arc<ClientHandle>>>),
}

impl Listed {
    fn iter(&self) -> std::slice::Iter<'_, Arc<ClientHandle>> {
        match self {
            Listed::One(h) => std::slice::from_ref(h).iter(),
            Listed::Many(v) => v.iter(),
        }
    }

    fn push(&mut self, handle: Arc<ClientHandle>) {
        match self {
            Listed::One(first) => *self = Listed::Many(Box::new(vec![first.clone(), handle])),
            Listed::Many(v) => v.push(handle),
        }
    }

    /// True if `handle` is the only one.
    fn is_only(&self, handle: &Arc<ClientHandle>) -> bool {
        matches!(self, Listed::One(h) if Arc::ptr_eq(h, handle))
    }

    /// Takes `handle` out of a list of several.
    fn remove(&mut self, handle: &Arc<ClientHandle>) {
        if let Listed::Many(v) = self {
            v.retain(|h| !Arc::ptr_eq(h, handle));
            if v.len() == 1 {
                *self = Listed::One(v[0].clone());
            }
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.registry.unlist(&self.handle);
    }
}

impl Registration {
    /// Keeps the client's place under the client caps until it leaves.
    /// The client's session was routed (SHOW's `database` value, `base@host:port/dbname`).
    pub fn routed(&self, shown: Arc<str>) {
        self.handle.route.store(Some(Arc::new(shown)));
    }

    pub fn keep_place(&mut self, place: crate::pool::caps::ClientPlace) {
        self.place = Some(place);
    }

    /// Tells the client another pid from now on (session mode: its
    /// backend's); the secret stays usher's own.
    pub fn tell_pid(&self, pid: u32) {
        self.registry.unlist(&self.handle);
        self.handle.pid.store(pid, Ordering::Relaxed);
        match self.registry.by_pid.entry(pid) {
            dashmap::Entry::Occupied(mut o) => o.get_mut().push(self.handle.clone()),
            dashmap::Entry::Vacant(v) => {
                v.insert(Listed::One(self.handle.clone()));
            }
        }
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
    /// A registry whose keys carry `peer_id` (0: peering off).
    pub fn with_peer_id(peer_id: u16) -> ClientRegistry {
        ClientRegistry {
            peer_id,
            ..ClientRegistry::default()
        }
    }

    /// The peer id in the keys this registry gives.
    pub fn peer_id(&self) -> u16 {
        self.peer_id
    }

    /// Counts a new connection; returns the guard and the count including it.
    pub fn connect(self: &Arc<Self>) -> (Connected, usize) {
        let n = self.count.fetch_add(1, Ordering::Relaxed) + 1;
        (Connected(self.clone()), n)
    }

    /// Clients connected right now (logged in or not).
    pub fn connected(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }

    /// Gives a logged-in client an id, a unique pid and a random secret.
    pub fn register(self: &Arc<Self>, facts: ClientFacts) -> Registration {
        let mut rng = rand::thread_rng();
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        loop {
            let pid = rng.gen_range(1..i32::MAX as u32);
            if let dashmap::Entry::Vacant(v) = self.by_pid.entry(pid) {
                let handle = Arc::new(ClientHandle {
                    id,
                    pid: AtomicU32::new(pid),
                    secret: cancel_key::new_secret(rng.gen(), self.peer_id),
                    facts,
                    connect_time: SystemTime::now(),
                    state: AtomicU8::new(ClientState::Idle as u8),
                    request_us: AtomicU64::new(0),
                    wait_since_us: AtomicU64::new(0),
                    prepared: AtomicU32::new(0),
                    serving: Mutex::new(None),
                    kill: KillSwitch::default(),
                    route: arc_swap::ArcSwapOption::empty(),
                });
                v.insert(Listed::One(handle.clone()));
                return Registration {
                    registry: self.clone(),
                    handle,
                    place: None,
                };
            }
        }
    }

    /// The server to cancel for a cancel request, if the key matches a client
    /// that is being served right now. Every client told `pid` shares the entry: each secret is compared
    /// (in constant time), and the one that matches is the client.
    pub fn cancel_target(&self, pid: u32, secret: u32) -> Option<Arc<ServerSummary>> {
        let handle = self
            .by_pid
            .get(&pid)?
            .iter()
            // Every secret is compared, whichever matches.
            .fold(None, |found, h| {
                if crate::auth::secret::ct_eq(&h.secret.to_be_bytes(), &secret.to_be_bytes()) {
                    Some(h)
                } else {
                    found
                }
            })?
            .clone();
        handle.server()
    }

    /// Takes a client out of its pid's entry.
    fn unlist(&self, handle: &Arc<ClientHandle>) {
        let pid = handle.pid();
        if self
            .by_pid
            .remove_if(&pid, |_, same| same.is_only(handle))
            .is_none()
        {
            if let Some(mut same) = self.by_pid.get_mut(&pid) {
                same.remove(handle);
            }
        }
    }

    /// Wakes every client's task ([`ClientHandle::poke`]).
    pub fn poke_all(&self) {
        for entry in self.by_pid.iter() {
            for handle in entry.value().iter() {
                handle.poke();
            }
        }
    }

    /// Every logged-in client, by id.
    pub fn all(&self) -> Vec<Arc<ClientHandle>> {
        let mut all: Vec<_> = self
            .by_pid
            .iter()
            .flat_map(|e| e.value().iter().cloned().collect::<Vec<_>>())
            .collect();
        all.sort_by_key(|h| h.id);
        all
    }

    /// The client with this id (KILL_CLIENT).
    pub fn by_id(&self, id: u64) -> Option<Arc<ClientHandle>> {
        self.by_pid
            .iter()
            .find_map(|e| e.value().iter().find(|h| h.id == id).cloned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts() -> ClientFacts {
        ClientFacts {
            user: "alice".into(),
            database: "app".into(),
            addr: ClientAddr::Tcp("127.0.0.1:5000".parse().unwrap()),
            local: None,
            application_name: "".into(),
            tls: "".into(),
        }
    }

    #[test]
    fn clients_get_increasing_ids_and_leave_the_registry_when_dropped() {
        let registry = Arc::new(ClientRegistry::default());
        let a = registry.register(facts());
        let b = registry.register(facts());
        assert!(b.handle.id > a.handle.id);
        assert_eq!(registry.by_id(a.handle.id).unwrap().pid(), a.handle.pid());
        assert_eq!(registry.all().len(), 2);
        drop(a);
        assert_eq!(registry.all().len(), 1);
        assert!(registry.by_id(1).is_none());
    }

    #[test]
    fn clients_told_the_same_pid_are_found_by_their_secret() {
        let registry = Arc::new(ClientRegistry::default());
        let a = registry.register(facts());
        let b = registry.register(facts());
        // A backend reused by b while a is still leaving: both told 4242.
        a.tell_pid(4242);
        b.tell_pid(4242);
        assert_eq!((a.handle.pid(), b.handle.pid()), (4242, 4242));
        let server = |id| {
            Arc::new(ServerSummary {
                id,
                cancel: crate::backend::CancelTarget {
                    host: "127.0.0.1".into(),
                    port: 5432,
                    pid: 4242,
                    secret: id as u32,
                },
                connect_time: SystemTime::now(),
                local: None,
                tls: false,
            })
        };
        a.handle.set_server(Some(server(1)));
        b.handle.set_server(Some(server(2)));
        let target = |secret| registry.cancel_target(4242, secret).map(|s| s.id);
        assert_eq!(target(a.handle.secret), Some(1));
        assert_eq!(target(b.handle.secret), Some(2));
        assert_eq!(target(a.handle.secret ^ b.handle.secret ^ 1), None);
        assert_eq!(registry.all().len(), 2);
        drop(a);
        assert_eq!(target(b.handle.secret), Some(2));
        assert_eq!(registry.all().len(), 1);
        drop(b);
        assert!(registry.by_pid.is_empty());
    }

    #[test]
    fn secrets_carry_the_peer_id_when_peering_is_on() {
        let registry = Arc::new(ClientRegistry::with_peer_id(42));
        for _ in 0..20 {
            let r = registry.register(facts());
            let key = cancel_key::decode(r.handle.secret);
            assert_eq!((key.peer_id, key.forwardable), (42, true));
        }
    }

    #[test]
    fn state_follows_waiting_and_serving() {
        let registry = Arc::new(ClientRegistry::default());
        let r = registry.register(facts());
        assert_eq!(r.handle.state(), ClientState::Idle);
        r.handle.waiting();
        assert_eq!(r.handle.state(), ClientState::Waiting);
        r.handle.set_server(None);
        assert_eq!(r.handle.state(), ClientState::Idle);
        assert_eq!(r.handle.wait_us(), 0);
    }

    #[tokio::test]
    async fn a_kill_wakes_the_waiting_session_even_if_it_came_first() {
        let registry = Arc::new(ClientRegistry::default());
        let r = registry.register(facts());
        let handle = r.handle.clone();
        let waiting = tokio::spawn(async move { handle.killed().await });
        tokio::task::yield_now().await;
        r.handle.kill();
        tokio::time::timeout(std::time::Duration::from_secs(5), waiting)
            .await
            .expect("the kill woke it")
            .unwrap();
        // Killed before anyone waits: resolves at once.
        tokio::time::timeout(std::time::Duration::from_secs(5), r.handle.killed())
            .await
            .expect("already killed");
    }
}
