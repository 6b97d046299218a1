//! Where a client connected from: a TCP address, or usher's Unix-domain
//! socket (`unix_socket_dir`), where the kernel tells who the peer is
//! (SO_PEERCRED) and there is no address.
//!
//! Each place that used an address says what a local client is there:
//! HBA rules of type `local` match it and `host*` rules do not; it counts
//! for `max_auth_clients_per_address` by its uid; the auth monitor counts
//! it by role only (no address row, no address lock); blocking rules with
//! `addresses` never match it; SHOW CLIENTS and hooks show `unix` and the
//! port, as PgBouncer's SHOW CLIENTS does; messages say `[local]`, as
//! PostgreSQL's do; logs say `unix(pid=..,uid=..)`.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;

/// What SHOW CLIENTS and hooks show as the address of a local client.
pub const UNIX_SHOWN: &str = "unix";

/// Where one client connected from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientAddr {
    Tcp(SocketAddr),
    /// The Unix-domain socket.
    Local(LocalPeer),
}

/// A client of the Unix-domain socket: its credentials, as the kernel
/// gave them at connect (SO_PEERCRED), and the socket's port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalPeer {
    pub uid: u32,
    pub gid: u32,
    /// The connecting process; `None` where the kernel does not say.
    pub pid: Option<i32>,
    /// The port in the socket's name (`.s.PGSQL.<port>`), which SHOW
    /// CLIENTS shows as the client's port, as PgBouncer does.
    pub port: u16,
}

impl ClientAddr {
    /// The IP address of a TCP client.
    pub fn ip(&self) -> Option<IpAddr> {
        match self {
            ClientAddr::Tcp(a) => Some(a.ip()),
            ClientAddr::Local(_) => None,
        }
    }

    /// The host part, which HBA rules, the lockout and the auth monitor's
    /// tables look at (IPv4-mapped IPv6 as IPv4).
    pub fn host(&self) -> ClientHost {
        match self {
            ClientAddr::Tcp(a) => ClientHost::Ip(a.ip().to_canonical()),
            ClientAddr::Local(_) => ClientHost::Local,
        }
    }

    /// The client's port; a local client's is the socket's.
    pub fn port(&self) -> u16 {
        match self {
            ClientAddr::Tcp(a) => a.port(),
            ClientAddr::Local(p) => p.port,
        }
    }

    /// The peer of a local client.
    pub fn local_peer(&self) -> Option<&LocalPeer> {
        match self {
            ClientAddr::Tcp(_) => None,
            ClientAddr::Local(p) => Some(p),
        }
    }

    /// The address as SHOW CLIENTS' `addr` and hooks' `client_addr` show
    /// it: the IP, or `unix`.
    pub fn shown(&self) -> String {
        match self {
            ClientAddr::Tcp(a) => a.ip().to_string(),
            ClientAddr::Local(_) => UNIX_SHOWN.to_string(),
        }
    }
}

impl From<SocketAddr> for ClientAddr {
    fn from(a: SocketAddr) -> Self {
        ClientAddr::Tcp(a)
    }
}

/// For logs: `10.0.0.1:5000`, `[::1]:5000`, `unix(pid=4242,uid=1000)`.
impl fmt::Display for ClientAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClientAddr::Tcp(a) => a.fmt(f),
            ClientAddr::Local(p) => match p.pid {
                Some(pid) => write!(f, "unix(pid={pid},uid={})", p.uid),
                None => write!(f, "unix(uid={})", p.uid),
            },
        }
    }
}

/// The host a client came from: an IP address, or this machine through
/// the Unix-domain socket (PostgreSQL's `[local]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ClientHost {
    Ip(IpAddr),
    Local,
}

/// How a local client's host is written (PostgreSQL's `%h` and messages).
pub const LOCAL_HOST: &str = "[local]";

impl ClientHost {
    pub fn ip(self) -> Option<IpAddr> {
        match self {
            ClientHost::Ip(ip) => Some(ip),
            ClientHost::Local => None,
        }
    }
}

impl From<IpAddr> for ClientHost {
    fn from(ip: IpAddr) -> Self {
        ClientHost::Ip(ip)
    }
}

impl fmt::Display for ClientHost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClientHost::Ip(ip) => ip.fmt(f),
            ClientHost::Local => f.write_str(LOCAL_HOST),
        }
    }
}

impl FromStr for ClientHost {
    type Err = std::net::AddrParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == LOCAL_HOST {
            return Ok(ClientHost::Local);
        }
        s.parse().map(ClientHost::Ip)
    }
}

/// As its text: an IP address serializes the same way, so state files
/// written before local clients existed read back unchanged.
impl Serialize for ClientHost {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ClientHost {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = std::borrow::Cow::<str>::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_read_back_as_written_and_old_addresses_still_read() {
        for text in ["10.0.0.1", "::1", "[local]"] {
            let host: ClientHost = text.parse().unwrap();
            assert_eq!(host.to_string(), text);
            let json = serde_json::to_string(&host).unwrap();
            assert_eq!(serde_json::from_str::<ClientHost>(&json).unwrap(), host);
        }
        // A state file written when this was an IpAddr.
        let ip: IpAddr = "192.0.2.7".parse().unwrap();
        let old = serde_json::to_string(&Some(ip)).unwrap();
        assert_eq!(
            serde_json::from_str::<Option<ClientHost>>(&old).unwrap(),
            Some(ClientHost::Ip(ip))
        );
        assert!("unix".parse::<ClientHost>().is_err());
    }

    #[test]
    fn a_local_client_shows_unix_and_the_socket_port() {
        let local = ClientAddr::Local(LocalPeer {
            uid: 1000,
            gid: 1000,
            pid: Some(4242),
            port: 6432,
        });
        assert_eq!(local.shown(), "unix");
        assert_eq!(local.port(), 6432);
        assert_eq!(local.host(), ClientHost::Local);
        assert_eq!(local.host().to_string(), "[local]");
        assert_eq!(local.to_string(), "unix(pid=4242,uid=1000)");
        let tcp = ClientAddr::Tcp("[::ffff:10.0.0.1]:5000".parse().unwrap());
        assert_eq!(tcp.host(), ClientHost::Ip("10.0.0.1".parse().unwrap()));
        assert_eq!(tcp.shown(), "::ffff:10.0.0.1");
        assert_eq!(tcp.to_string(), "[::ffff:10.0.0.1]:5000");
    }
}
