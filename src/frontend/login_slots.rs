//! Login slots: how many clients may be logging in at once, in all
//! (`max_auth_clients`) and from one address (`max_auth_clients_per_address`).
//!
//! A client that connects and says nothing holds its slot until
//! `auth_timeout`; without the per-address bound, one address with enough
//! stalled sockets holds every slot and everyone else gets 53300.
//!
//! Addresses are counted as IPv4 addresses and IPv6 /64 prefixes: a /64 is
//! what one host (or one customer's network) is given, and its owner can
//! use any of its 2^64 addresses, so counting single IPv6 addresses would
//! bound nothing. An IPv4-mapped IPv6 address counts as its IPv4 address.
//! Clients of the Unix-domain socket have no address: each local user
//! (uid, from SO_PEERCRED) counts as one.

use crate::client_addr::ClientAddr;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// What an address is counted as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AddrKey {
    V4([u8; 4]),
    /// The first 64 bits.
    V6Prefix(u64),
    /// A local user's uid, on the Unix-domain socket.
    Local(u32),
}

impl AddrKey {
    /// The key of a client.
    pub fn of_client(addr: &ClientAddr) -> AddrKey {
        match addr {
            ClientAddr::Tcp(a) => AddrKey::of(a.ip()),
            ClientAddr::Local(p) => AddrKey::Local(p.uid),
        }
    }

    pub fn of(addr: IpAddr) -> AddrKey {
        match addr {
            IpAddr::V4(v4) => AddrKey::V4(v4.octets()),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => AddrKey::V4(v4.octets()),
                None => AddrKey::V6Prefix((u128::from(v6) >> 64) as u64),
            },
        }
    }
}

impl std::fmt::Display for AddrKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            AddrKey::V4(o) => write!(f, "{}", std::net::Ipv4Addr::from(o)),
            AddrKey::V6Prefix(p) => {
                write!(f, "{}/64", std::net::Ipv6Addr::from(u128::from(p) << 64))
            }
            AddrKey::Local(uid) => write!(f, "uid {uid} on the Unix socket"),
        }
    }
}

/// Why no slot was given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoSlot {
    /// Every slot is taken (`max_auth_clients`).
    All,
    /// The address has its share (`max_auth_clients_per_address`).
    Address(AddrKey),
}

/// The login slots of the app. The total is fixed at start; the
/// per-address bound is given at each login (it can be reloaded).
#[derive(Debug)]
pub struct LoginSlots {
    all: Arc<Semaphore>,
    /// Logins in progress per address (addresses with none are removed).
    by_addr: Arc<Mutex<HashMap<AddrKey, usize>>>,
}

/// A slot, held until the login ends.
#[derive(Debug)]
pub struct LoginSlot {
    _permit: OwnedSemaphorePermit,
    key: AddrKey,
    by_addr: Arc<Mutex<HashMap<AddrKey, usize>>>,
}

impl LoginSlots {
    pub fn new(max: usize) -> LoginSlots {
        LoginSlots {
            all: Arc::new(Semaphore::new(max)),
            by_addr: Arc::default(),
        }
    }

    /// A slot for a client from `addr`, if both bounds allow one.
    pub fn try_acquire(&self, addr: &ClientAddr, per_address: usize) -> Result<LoginSlot, NoSlot> {
        let key = AddrKey::of_client(addr);
        let mut by_addr = self.by_addr.lock();
        let count = by_addr.entry(key).or_insert(0);
        if *count >= per_address {
            return Err(NoSlot::Address(key));
        }
        let Ok(permit) = self.all.clone().try_acquire_owned() else {
            if *count == 0 {
                by_addr.remove(&key);
            }
            return Err(NoSlot::All);
        };
        *count += 1;
        Ok(LoginSlot {
            _permit: permit,
            key,
            by_addr: self.by_addr.clone(),
        })
    }

    /// Logins in progress (from every address).
    pub fn in_use(&self) -> usize {
        self.by_addr.lock().values().sum()
    }

    /// Addresses with logins in progress.
    pub fn addresses(&self) -> usize {
        self.by_addr.lock().len()
    }
}

impl Drop for LoginSlot {
    fn drop(&mut self) {
        let mut by_addr = self.by_addr.lock();
        if let Some(count) = by_addr.get_mut(&self.key) {
            *count -= 1;
            if *count == 0 {
                by_addr.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn tcp(s: &str) -> ClientAddr {
        ClientAddr::Tcp(std::net::SocketAddr::new(ip(s), 5000))
    }

    #[test]
    fn ipv6_addresses_count_per_64_and_mapped_ipv4_as_ipv4() {
        assert_eq!(
            AddrKey::of(ip("2001:db8:1:2::1")),
            AddrKey::of(ip("2001:db8:1:2:ffff:ffff:ffff:ffff"))
        );
        assert_ne!(
            AddrKey::of(ip("2001:db8:1:2::1")),
            AddrKey::of(ip("2001:db8:1:3::1"))
        );
        assert_eq!(
            AddrKey::of(ip("::ffff:192.0.2.7")),
            AddrKey::of(ip("192.0.2.7"))
        );
        assert_ne!(AddrKey::of(ip("192.0.2.7")), AddrKey::of(ip("192.0.2.8")));
        assert_eq!(
            AddrKey::of(ip("2001:db8:1:2::1")).to_string(),
            "2001:db8:1:2::/64"
        );
        assert_eq!(AddrKey::of(ip("::ffff:192.0.2.7")).to_string(), "192.0.2.7");
    }

    #[test]
    fn each_address_gets_its_share_and_gives_it_back() {
        let slots = LoginSlots::new(5);
        let a = "192.0.2.1";
        let b = "192.0.2.2";
        let held: Vec<_> = (0..2)
            .map(|_| slots.try_acquire(&tcp(a), 2).unwrap())
            .collect();
        assert_eq!(
            slots.try_acquire(&tcp(a), 2).unwrap_err(),
            NoSlot::Address(AddrKey::of(ip(a)))
        );
        let more: Vec<_> = (0..3)
            .map(|_| slots.try_acquire(&tcp(b), 3).unwrap())
            .collect();
        // All five are taken: another address is refused for that reason,
        // and leaves no entry behind.
        assert_eq!(
            slots.try_acquire(&tcp("192.0.2.3"), 2).unwrap_err(),
            NoSlot::All
        );
        assert_eq!((slots.in_use(), slots.addresses()), (5, 2));
        drop(held);
        assert_eq!((slots.in_use(), slots.addresses()), (3, 1));
        let _again = slots.try_acquire(&tcp(a), 2).unwrap();
        drop(more);
        assert_eq!((slots.in_use(), slots.addresses()), (1, 1));
    }

    #[test]
    fn each_local_user_counts_as_one_address() {
        use crate::client_addr::LocalPeer;
        let local = |uid| {
            ClientAddr::Local(LocalPeer {
                uid,
                gid: uid,
                pid: Some(1),
                port: 6432,
            })
        };
        let slots = LoginSlots::new(10);
        let _held = slots.try_acquire(&local(1000), 1).unwrap();
        let refused = slots.try_acquire(&local(1000), 1).unwrap_err();
        assert_eq!(refused, NoSlot::Address(AddrKey::Local(1000)));
        assert_eq!(
            AddrKey::Local(1000).to_string(),
            "uid 1000 on the Unix socket"
        );
        let _other = slots.try_acquire(&local(1001), 1).unwrap();
        assert_eq!(slots.addresses(), 2);
    }
}
