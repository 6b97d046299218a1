//! `routing:`: what a client_connection hook's `ctx:route{...}` may name,
//! and a route resolved against its base entry of `databases`.
//!
//! A route names a base entry (`database`) and optionally servers, a
//! database name on them, a server role, a pool size and a pool mode. What
//! the route names itself is checked against `routing.allow`; what it
//! inherits from its base entry is the operator's own configuration and is
//! not. Host names are compared as written (case-insensitively), never
//! resolved: an address route must be allowed by an address or CIDR, a
//! name route by that name. Without a `routing` section every route is
//! refused, so a hook bug never sends credentials anywhere unexpected.

use super::{Config, ConfigIssue, DatabaseConfig, HostSpec, PoolMode};
use ipnet::IpNet;
use serde::Deserialize;
use std::net::IpAddr;
use std::sync::Arc;

/// `routing:`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoutingConfig {
    #[serde(default)]
    pub allow: RoutingAllow,
    /// Routed pools at most; a login that would create one more gets 53300.
    #[serde(default = "super::defaults::routing_max_pools")]
    pub max_pools: usize,
}

impl Default for RoutingConfig {
    fn default() -> Self {
        RoutingConfig {
            allow: RoutingAllow::default(),
            max_pools: super::defaults::routing_max_pools(),
        }
    }
}

/// `routing.allow:`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoutingAllow {
    /// Host names, addresses or CIDRs a route may name (parsed once, as
    /// the configuration loads: logins only compare).
    #[serde(default)]
    pub hosts: Vec<HostRule>,
    /// Ports a route may name.
    #[serde(default)]
    pub ports: Vec<u16>,
    /// Keys of `databases` a route may use as its base.
    #[serde(default)]
    pub databases: Vec<String>,
}

/// One rule of `routing.allow.hosts`: a network, an address, or a host
/// name (kept in lower case).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(try_from = "String")]
pub enum HostRule {
    Net(IpNet),
    Addr(IpAddr),
    Name(String),
}

impl TryFrom<String> for HostRule {
    type Error = String;

    fn try_from(rule: String) -> Result<Self, String> {
        if let Ok(net) = rule.parse::<IpNet>() {
            return Ok(HostRule::Net(net));
        }
        if let Ok(addr) = rule.parse::<IpAddr>() {
            return Ok(HostRule::Addr(addr));
        }
        if rule.is_empty()
            || rule.contains('/')
            || rule.chars().any(|c| c.is_whitespace() || c == ',')
        {
            return Err(format!(
                "expected a host name, an address or a CIDR, got `{rule}`"
            ));
        }
        Ok(HostRule::Name(rule.to_ascii_lowercase()))
    }
}

/// What a hook asked for with `ctx:route{...}`, unchecked.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Route {
    /// The base entry; none: the database the client asked for.
    pub database: Option<String>,
    /// `host`, or `hosts` (each with an optional port).
    pub hosts: Vec<HostSpec>,
    pub port: Option<u16>,
    pub dbname: Option<String>,
    /// The server role; none: the client's user name.
    pub user: Option<String>,
    pub pool_size: Option<usize>,
    pub pool_mode: Option<PoolMode>,
}

/// A route resolved against its base entry: where its pool connects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedRoute {
    /// The base entry's key (the pool's database name: caps, PAUSE,
    /// RECONNECT, SHOW's database column).
    pub base: String,
    pub hosts: Vec<(String, u16)>,
    pub dbname: String,
    pub user: String,
    pub pool_size: Option<usize>,
    pub pool_mode: Option<PoolMode>,
    /// The normalised target as one text: the pools' key beside
    /// (database, user).
    pub key: Arc<str>,
    /// `base@host:port/dbname`: SHOW POOLS', SERVERS' and CLIENTS'
    /// `database` value for the route's pools and clients.
    pub shown: Arc<str>,
    /// What the route named itself, to resolve it again against a reloaded
    /// configuration ([`ResolvedRoute::again`]).
    pub named: Named,
}

/// What a resolved route named itself (the rest came from its base entry).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Named {
    /// It named hosts (else they are its base entry's).
    pub hosts: bool,
    /// It named its dbname.
    pub dbname: bool,
    /// Its `port`.
    pub port: Option<u16>,
    /// Bit i: host i's port was named (by `port` or as `host:port`); past
    /// 64 hosts, all were.
    pub ports: u64,
}

/// Why a route was refused (logged; the client is told "route not allowed").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteRefusal(pub String);

impl std::fmt::Display for RouteRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl RoutingAllow {
    /// Whether a route may name `host` (a name, or an address).
    pub fn allows_host(&self, host: &str) -> bool {
        let ip: Option<IpAddr> = host.parse().ok();
        self.hosts.iter().any(|rule| match (rule, ip) {
            (HostRule::Net(net), Some(ip)) => net.contains(&ip),
            (HostRule::Addr(a), Some(ip)) => *a == ip,
            (HostRule::Name(name), None) => name.eq_ignore_ascii_case(host),
            _ => false,
        })
    }

    pub fn allows_port(&self, port: u16) -> bool {
        self.ports.contains(&port)
    }

    pub fn allows_database(&self, name: &str) -> bool {
        self.databases.iter().any(|d| d == name)
    }
}

impl RoutingConfig {
    pub(super) fn validate(&self, config: &Config) -> Result<(), ConfigIssue> {
        if self.allow.ports.contains(&0) {
            return Err(ConfigIssue::new(
                "routing.allow.ports",
                "expected ports from 1 to 65535",
            ));
        }
        for name in &self.allow.databases {
            if config.listed_database(name).is_none() {
                return Err(ConfigIssue::new(
                    "routing.allow.databases",
                    format!("expected a database listed under `databases`, got `{name}`"),
                ));
            }
        }
        if self.max_pools == 0 {
            return Err(ConfigIssue::new(
                "routing.max_pools",
                "expected a number greater than 0",
            ));
        }
        Ok(())
    }
}

impl ResolvedRoute {
    /// The limits of a routed pool of `user`: its base entry's, with the
    /// route's pool size and mode.
    pub fn limits(&self, config: &Config, user: &str) -> super::PoolLimits {
        let mut limits = config.limits_for(&self.base, user);
        if let Some(size) = self.pool_size {
            if limits.max_pinned == super::default_max_pinned(limits.size) {
                limits.max_pinned = super::default_max_pinned(size);
            }
            limits.size = size;
            limits.min_size = limits.min_size.min(size);
        }
        if let Some(mode) = self.pool_mode {
            limits.mode = mode;
        }
        limits
    }
}

impl Route {
    /// The route checked against `routing.allow` and resolved against its
    /// base entry; `database` and `user` are the client's.
    pub fn resolve(
        &self,
        config: &Config,
        database: &str,
        user: &str,
    ) -> Result<ResolvedRoute, RouteRefusal> {
        let entry = self.check(config, database)?;
        Ok(self.clone().into_resolved(entry, database, user))
    }

    /// The route checked against `routing.allow`: its base entry if allowed.
    /// `database` is the client's.
    pub fn check<'c>(
        &self,
        config: &'c Config,
        database: &str,
    ) -> Result<&'c DatabaseConfig, RouteRefusal> {
        let refuse = |why: String| Err(RouteRefusal(why));
        let Some(routing) = &config.routing else {
            return refuse("no `routing` section in the configuration".into());
        };
        let allow = &routing.allow;
        let base = self.database.as_deref().unwrap_or(database);
        let Some(entry) = config.listed_database(base) else {
            return refuse(format!(
                "database \"{base}\" is not listed under `databases`"
            ));
        };
        if !allow.allows_database(base) {
            return refuse(format!(
                "database \"{base}\" is not in routing.allow.databases"
            ));
        }
        for h in &self.hosts {
            if !allow.allows_host(&h.host) {
                return refuse(format!("host \"{}\" is not in routing.allow.hosts", h.host));
            }
        }
        for port in self
            .port
            .iter()
            .chain(self.hosts.iter().filter_map(|h| h.port.as_ref()))
        {
            if !allow.allows_port(*port) {
                return refuse(format!("port {port} is not in routing.allow.ports"));
            }
        }
        Ok(entry)
    }

    /// The route, checked ([`Route::check`] gave `entry`), resolved against
    /// its base entry: what it leaves out is the entry's, its host names in
    /// lower case, and its key and SHOW's text written. Takes the route so
    /// that its texts are moved, not copied: this runs at every routed login.
    pub fn into_resolved(
        self,
        entry: &DatabaseConfig,
        database: &str,
        user: &str,
    ) -> ResolvedRoute {
        let named = Named {
            hosts: !self.hosts.is_empty(),
            dbname: self.dbname.is_some(),
            port: self.port,
            ports: self.hosts.iter().enumerate().fold(0, |bits, (i, h)| {
                if (self.port.is_some() || h.port.is_some()) && i < 64 {
                    bits | 1 << i
                } else {
                    bits
                }
            }),
        };
        let base = self.database.unwrap_or_else(|| database.to_string());
        let hosts: Vec<(String, u16)> = if self.hosts.is_empty() {
            let mut hosts = entry.server_hosts();
            if let Some(p) = self.port {
                hosts.iter_mut().for_each(|h| h.1 = p);
            }
            hosts
        } else {
            let port = self.port.unwrap_or(entry.port);
            self.hosts
                .into_iter()
                .map(|h| {
                    let mut host = h.host;
                    host.make_ascii_lowercase();
                    (host, h.port.unwrap_or(port))
                })
                .collect()
        };
        let dbname = self
            .dbname
            .unwrap_or_else(|| entry.server_dbname(&base).to_string());
        let user = self.user.unwrap_or_else(|| user.to_string());
        // Written in place (no format! per part).
        use std::fmt::Write;
        let mut key = String::with_capacity(64);
        for (i, (h, p)) in hosts.iter().enumerate() {
            if i > 0 {
                key.push(',');
            }
            if h.contains(':') {
                let _ = write!(key, "[{h}]:{p}");
            } else {
                let _ = write!(key, "{h}:{p}");
            }
        }
        key.push('/');
        key.push_str(&dbname);
        let mut shown = String::with_capacity(base.len() + 1 + key.len());
        shown.push_str(&base);
        shown.push('@');
        shown.push_str(&key);
        key.push_str(" user=");
        key.push_str(&user);
        if let Some(n) = self.pool_size {
            let _ = write!(key, " pool_size={n}");
        }
        if let Some(m) = self.pool_mode {
            let _ = write!(key, " pool_mode={m}");
        }
        ResolvedRoute {
            base,
            hosts,
            dbname,
            user,
            pool_size: self.pool_size,
            pool_mode: self.pool_mode,
            key: key.into(),
            shown: shown.into(),
            named,
        }
    }
}

impl ResolvedRoute {
    /// The route resolved again against `config` (a reload): checked
    /// against its `routing.allow`, with what it did not name taken from
    /// its base entry as it is now.
    pub fn again(&self, config: &Config) -> Result<ResolvedRoute, RouteRefusal> {
        let n = &self.named;
        let hosts = if n.hosts {
            self.hosts
                .iter()
                .enumerate()
                .map(|(i, (host, port))| HostSpec {
                    host: host.clone(),
                    port: (i >= 64 || n.ports & 1 << i != 0).then_some(*port),
                })
                .collect()
        } else {
            Vec::new()
        };
        let route = Route {
            database: Some(self.base.clone()),
            hosts,
            port: n.port,
            dbname: n.dbname.then(|| self.dbname.clone()),
            user: Some(self.user.clone()),
            pool_size: self.pool_size,
            pool_mode: self.pool_mode,
        };
        route.resolve(config, &self.base, &self.user)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(routing: &str) -> Config {
        let yaml = format!(
            "databases:\n  app: {{host: 10.0.0.1, port: 5432, dbname: app_main}}\n  other: {{host: 10.0.0.2}}\n{routing}"
        );
        Config::from_yaml(&yaml, "test.yaml").unwrap()
    }

    const ALLOW: &str = "routing:\n  allow:\n    hosts: [10.1.0.0/16, shard-a.example, '::1']\n    ports: [5433]\n    databases: [app]\n";

    fn host(h: &str) -> HostSpec {
        HostSpec::try_from(h.to_string()).unwrap()
    }

    #[test]
    fn hosts_match_by_cidr_address_or_name() {
        let c = config(ALLOW);
        let allow = &c.routing.as_ref().unwrap().allow;
        assert!(allow.allows_host("10.1.2.3"));
        assert!(!allow.allows_host("10.2.0.1"));
        assert!(allow.allows_host("Shard-A.example"));
        assert!(!allow.allows_host("shard-b.example"));
        assert!(allow.allows_host("::1"));
        assert!(!allow.allows_host("::2"));
        // A name that looks like an allowed network is not resolved.
        assert!(!allow.allows_host("10.1.0.0.example"));
    }

    #[test]
    fn a_route_inherits_its_base_entry_and_is_normalised() {
        let c = config(ALLOW);
        let r = Route::default().resolve(&c, "app", "alice").unwrap();
        assert_eq!(r.base, "app");
        assert_eq!(r.hosts, [("10.0.0.1".to_string(), 5432)]);
        assert_eq!(&*r.key, "10.0.0.1:5432/app_main user=alice");
        assert_eq!(&*r.shown, "app@10.0.0.1:5432/app_main");
        let r = Route {
            hosts: vec![host("10.1.0.7"), host("shard-a.example:5433")],
            dbname: Some("t42".into()),
            user: Some("bob".into()),
            pool_size: Some(3),
            pool_mode: Some(PoolMode::Session),
            ..Route::default()
        }
        .resolve(&c, "app", "alice.t42")
        .unwrap();
        assert_eq!(
            &*r.key,
            "10.1.0.7:5432,shard-a.example:5433/t42 user=bob pool_size=3 pool_mode=session"
        );
    }

    #[test]
    fn what_a_route_names_must_be_allowed() {
        let c = config(ALLOW);
        let refused = |r: Route| r.resolve(&c, "app", "alice").unwrap_err().0;
        assert!(refused(Route {
            hosts: vec![host("10.9.0.1")],
            ..Route::default()
        })
        .contains("routing.allow.hosts"));
        assert!(refused(Route {
            hosts: vec![host("10.1.0.1:6543")],
            ..Route::default()
        })
        .contains("routing.allow.ports"));
        assert!(refused(Route {
            port: Some(6543),
            ..Route::default()
        })
        .contains("routing.allow.ports"));
        assert!(refused(Route {
            database: Some("other".into()),
            ..Route::default()
        })
        .contains("routing.allow.databases"));
        assert!(refused(Route {
            database: Some("nowhere".into()),
            ..Route::default()
        })
        .contains("not listed"));
        assert!(Route {
            port: Some(5433),
            ..Route::default()
        }
        .resolve(&c, "app", "alice")
        .is_ok());
    }

    #[test]
    fn a_route_resolved_again_takes_what_it_did_not_name_from_the_new_entry() {
        let c = config(ALLOW);
        let named = Route {
            hosts: vec![host("10.1.0.7"), host("shard-a.example:5433")],
            ..Route::default()
        }
        .resolve(&c, "app", "alice")
        .unwrap();
        let inherited = Route::default().resolve(&c, "app", "alice").unwrap();
        let moved = Config::from_yaml(
            &format!(
                "databases:\n  app: {{host: 10.0.0.9, port: 6000, dbname: app_next}}\n{ALLOW}"
            ),
            "test.yaml",
        )
        .unwrap();
        // Its own host and port stay; the port it inherited follows, and
        // so do the servers and dbname it did not name.
        assert_eq!(
            &*named.again(&moved).unwrap().key,
            "10.1.0.7:6000,shard-a.example:5433/app_next user=alice"
        );
        assert_eq!(
            &*inherited.again(&moved).unwrap().key,
            "10.0.0.9:6000/app_next user=alice"
        );
        assert_eq!(named.again(&c).unwrap(), named);
        // No longer allowed: refused.
        let tighter = config(&ALLOW.replace("10.1.0.0/16, ", ""));
        assert!(named.again(&tighter).unwrap_err().0.contains("10.1.0.7"));
    }

    #[test]
    fn without_a_routing_section_every_route_is_refused() {
        let c = config("");
        let e = Route::default().resolve(&c, "app", "alice").unwrap_err();
        assert!(e.0.contains("no `routing` section"), "{e}");
    }

    #[test]
    fn the_allow_list_is_validated() {
        for (bad, key) in [
            (
                "routing:\n  allow:\n    hosts: ['10.0.0.0/33']\n",
                "routing.allow.hosts",
            ),
            (
                "routing:\n  allow:\n    ports: [0]\n",
                "routing.allow.ports",
            ),
            (
                "routing:\n  allow:\n    databases: [nowhere]\n",
                "routing.allow.databases",
            ),
            ("routing:\n  max_pools: 0\n", "routing.max_pools"),
        ] {
            let e = Config::from_yaml(
                &format!("databases:\n  app: {{host: 10.0.0.1}}\n{bad}"),
                "test.yaml",
            )
            .unwrap_err();
            assert!(e.to_string().contains(key), "{bad}: {e}");
        }
        assert_eq!(config(ALLOW).routing.unwrap().max_pools, 100);
    }
}
