//! Connection blocking: ordered allow/deny rules on the role (name or glob,
//! membership in a role), database, client address, application_name and
//! TLS, and maintenance mode (only members of one role get in), run at
//! client_connection, before any server connection is used.
//!
//! Membership comes from the cached role graph ([`RoleCache`]), refreshed in
//! the background: a login waits on the server only while the cache is cold.
//! If the graph cannot be read, the hook fails and `hooks.on_error` decides
//! (default: reject).

use super::{now_ms, timestamp, Millis, Table};
use crate::config::{BlockAction, BlockRuleConfig, BlockingConfig, ConfigIssue, MaintenanceConfig};
use crate::hooks::query::QueryPool;
use crate::hooks::roles::{RoleCache, RoleGraph};
use crate::hooks::{ClientInfo, ConnectionCtx, Event, Hook, HookError, Rejection};
use crate::protocol::error::shown_name;
use crate::protocol::error::sqlstate;
use crate::protocol::PgError;
use arc_swap::{ArcSwap, ArcSwapOption};
use async_trait::async_trait;
use ipnet::IpNet;
use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use wildmatch::WildMatch;

/// One compiled rule.
#[derive(Debug)]
struct Rule {
    name: String,
    action: BlockAction,
    users: Vec<WildMatch>,
    member_of: Vec<String>,
    databases: Vec<WildMatch>,
    addresses: Vec<IpNet>,
    application_names: Vec<WildMatch>,
    tls: Option<bool>,
    message: Option<String>,
    sqlstate: String,
    detail: Option<String>,
    hint: Option<String>,
    /// The conditions as configured, for SHOW BLOCKING.
    summary: String,
    matches: AtomicU64,
}

/// Maintenance mode: only members of `role` get in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Maintenance {
    pub role: String,
    pub since: Millis,
    /// "config" or "console".
    pub source: &'static str,
}

/// How maintenance mode refuses (`blocking.maintenance`, also used when it
/// is switched on from the console).
#[derive(Debug, Clone)]
struct MaintenanceStyle {
    message: Option<String>,
    sqlstate: String,
    hint: Option<String>,
}

/// What `blocking:` compiles to.
#[derive(Debug)]
struct Policy {
    rules: Vec<Rule>,
    style: MaintenanceStyle,
}

/// The built-in `blocking` hook.
#[derive(Debug)]
pub struct Blocking {
    /// The rules and maintenance style; a config reload replaces them.
    policy: ArcSwap<Policy>,
    maintenance: ArcSwapOption<Maintenance>,
    maintenance_rejects: AtomicU64,
    roles: Arc<RoleCache>,
    query: Arc<QueryPool>,
}

impl Blocking {
    pub const NAME: &'static str = "blocking";

    /// Compiles `blocking:`; an error names the key. `member_of` needs
    /// `hooks.query`, the connection the role graph is read through.
    pub fn from_config(
        config: &BlockingConfig,
        roles: Arc<RoleCache>,
        query: Arc<QueryPool>,
    ) -> Result<Blocking, ConfigIssue> {
        let needs_query = |key: String| {
            ConfigIssue::new(
                key,
                "member_of needs hooks.query (a database and user through which usher reads role memberships from the server)",
            )
        };
        let mut rules = Vec::new();
        let mut names = HashSet::new();
        for (i, r) in config.rules.iter().enumerate() {
            let key = format!("blocking.rules[{i}]");
            if !r.member_of.is_empty() && !query.configured() {
                return Err(needs_query(format!("{key}.member_of")));
            }
            let rule = compile(r, i, &key)?;
            if !names.insert(rule.name.clone()) {
                return Err(ConfigIssue::new(
                    format!("{key}.name"),
                    format!("rule name \"{}\" is used twice", rule.name),
                ));
            }
            rules.push(rule);
        }
        let m = config.maintenance.as_ref();
        let style = MaintenanceStyle {
            message: m.and_then(|m| m.message.clone()),
            sqlstate: sqlstate_of(
                m.and_then(|m| m.sqlstate.as_deref()),
                sqlstate::CANNOT_CONNECT_NOW,
                "blocking.maintenance.sqlstate",
            )?,
            hint: m.and_then(|m| m.hint.clone()),
        };
        let maintenance = match m {
            Some(MaintenanceConfig { member_of, .. }) => {
                if !query.configured() {
                    return Err(needs_query("blocking.maintenance.member_of".into()));
                }
                Some(Arc::new(Maintenance {
                    role: member_of.clone(),
                    since: now_ms(),
                    source: "config",
                }))
            }
            None => None,
        };
        Ok(Blocking {
            policy: ArcSwap::from_pointee(Policy { rules, style }),
            maintenance: ArcSwapOption::new(maintenance),
            maintenance_rejects: AtomicU64::new(0),
            roles,
            query,
        })
    }

    /// True when there is anything to check: otherwise the hook stays out
    /// of the dispatcher and costs nothing.
    pub fn active(&self) -> bool {
        !self.policy.load().rules.is_empty() || self.maintenance.load().is_some()
    }

    /// A config reload: the rules of `new` (compiled from the new file)
    /// replace these. Maintenance mode set in the file follows the file;
    /// set from the console, it stays until MAINTENANCE OFF.
    pub fn replace_rules(&self, new: Blocking) {
        self.policy.store(new.policy.load_full());
        let current = self.maintenance.load_full();
        if current.as_ref().is_some_and(|m| m.source == "console") {
            return;
        }
        let wanted = new.maintenance.load_full();
        if current.as_ref().map(|m| &m.role) != wanted.as_ref().map(|m| &m.role) {
            tracing::warn!(
                role = wanted.as_ref().map(|m| m.role.as_str()),
                "maintenance mode changed by reload"
            );
            self.maintenance.store(wanted);
        }
    }

    /// True when some rule (or maintenance mode) asks about role membership.
    pub fn uses_roles(&self) -> bool {
        self.maintenance.load().is_some()
            || self
                .policy
                .load()
                .rules
                .iter()
                .any(|r| !r.member_of.is_empty())
    }

    pub fn maintenance(&self) -> Option<Maintenance> {
        self.maintenance.load_full().map(|m| (*m).clone())
    }

    /// MAINTENANCE ON role: checks the role graph can be read and knows the
    /// role (a typo would lock everyone out), then switches it on.
    pub async fn maintenance_on(&self, role: &str) -> Result<(), PgError> {
        if !self.query.configured() {
            return Err(PgError::error(
                sqlstate::OBJECT_NOT_IN_PREREQUISITE_STATE,
                "maintenance mode needs hooks.query: usher reads role memberships from the server through it",
            ));
        }
        let graph = self
            .graph()
            .await
            .map_err(|e| PgError::error(sqlstate::CONNECTION_FAILURE, e.to_string()))?;
        if graph.oid(role).is_none() {
            return Err(PgError::error(
                sqlstate::UNDEFINED_OBJECT,
                format!("role \"{role}\" does not exist on the server"),
            ));
        }
        self.maintenance.store(Some(Arc::new(Maintenance {
            role: role.to_string(),
            since: now_ms(),
            source: "console",
        })));
        tracing::warn!(
            role,
            "maintenance mode on: only members of the role may connect"
        );
        Ok(())
    }

    /// MAINTENANCE OFF. False if it was not on.
    pub fn maintenance_off(&self) -> bool {
        let was = self.maintenance.swap(None);
        if was.is_some() {
            tracing::warn!("maintenance mode off");
        }
        was.is_some()
    }

    async fn graph(&self) -> Result<Arc<RoleGraph>, HookError> {
        self.roles
            .graph(&self.query)
            .await
            .map_err(|e| HookError::Failed(format!("role memberships are unknown: {e}")))
    }

    /// The first rule that matches the client.
    /// The first rule that matches the client: the rules it was checked
    /// against and the rule's index in them.
    async fn first_match(&self, c: &ClientInfo) -> Result<Option<(Arc<Policy>, usize)>, HookError> {
        // None for a client of the Unix-domain socket.
        let addr = c.addr.ip().map(|ip| ip.to_canonical());
        let policy = self.policy.load_full();
        for (i, rule) in policy.rules.iter().enumerate() {
            if rule.matches_cheaply(c, addr) && self.member_of_matches(rule, &c.user).await? {
                return Ok(Some((policy, i)));
            }
        }
        Ok(None)
    }

    async fn member_of_matches(&self, rule: &Rule, user: &str) -> Result<bool, HookError> {
        if rule.member_of.is_empty() {
            return Ok(true);
        }
        let graph = self.graph().await?;
        Ok(rule.member_of.iter().any(|r| graph.is_member(user, r)))
    }

    /// SHOW BLOCKING: maintenance mode (when on), then the rules in order.
    pub fn show(&self) -> Table {
        let mut rows = Vec::new();
        if let Some(m) = self.maintenance.load_full() {
            rows.push(vec![
                Some("maintenance".to_string()),
                Some("deny".to_string()),
                Some(format!(
                    "not member_of {} (since {}, from the {})",
                    m.role,
                    timestamp(m.since),
                    m.source
                )),
                Some(self.maintenance_rejects.load(Ordering::Relaxed).to_string()),
            ]);
        }
        for r in &self.policy.load().rules {
            rows.push(vec![
                Some(r.name.clone()),
                Some(r.action.to_string()),
                Some(r.summary.clone()),
                Some(r.matches.load(Ordering::Relaxed).to_string()),
            ]);
        }
        Table::new(&["rule", "action", "conditions", "matches"], rows)
    }
}

impl Rule {
    /// Every condition but membership (which may need the server).
    /// A rule with `addresses` never matches a local client (`addr` None).
    fn matches_cheaply(&self, c: &ClientInfo, addr: Option<IpAddr>) -> bool {
        let any =
            |globs: &[WildMatch], s: &str| globs.is_empty() || globs.iter().any(|g| g.matches(s));
        any(&self.users, &c.user)
            && any(&self.databases, &c.database)
            && any(&self.application_names, &c.application_name)
            && (self.addresses.is_empty()
                || addr.is_some_and(|a| self.addresses.iter().any(|n| n.contains(&a))))
            && self.tls.is_none_or(|t| t == c.tls.is_some())
    }

    fn rejection(&self, c: &ClientInfo) -> Rejection {
        Rejection {
            message: self.message.clone().unwrap_or_else(|| {
                format!(
                    "connection of user \"{}\" to database \"{}\" refused by usher's rule \"{}\"",
                    shown_name(&c.user),
                    shown_name(&c.database),
                    self.name
                )
            }),
            sqlstate: self.sqlstate.clone(),
            detail: self.detail.clone(),
            hint: self.hint.clone(),
            hook: Blocking::NAME.to_string(),
        }
    }
}

fn compile(r: &BlockRuleConfig, i: usize, key: &str) -> Result<Rule, ConfigIssue> {
    let globs = |v: &[String]| v.iter().map(|s| WildMatch::new(s)).collect::<Vec<_>>();
    let mut addresses = Vec::new();
    for (j, a) in r.addresses.iter().enumerate() {
        let net = a
            .parse::<IpNet>()
            .or_else(|_| a.parse::<IpAddr>().map(IpNet::from))
            .map_err(|_| {
                ConfigIssue::new(
                    format!("{key}.addresses[{j}]"),
                    format!("expected a CIDR (10.0.0.0/8) or an address, got `{a}`"),
                )
            })?;
        addresses.push(net);
    }
    let mut summary = Vec::new();
    for (what, list) in [
        ("users", &r.users),
        ("member_of", &r.member_of),
        ("databases", &r.databases),
        ("addresses", &r.addresses),
        ("application_names", &r.application_names),
    ] {
        if !list.is_empty() {
            summary.push(format!("{what}: {}", list.join(",")));
        }
    }
    if let Some(t) = r.tls {
        summary.push(format!("tls: {t}"));
    }
    Ok(Rule {
        name: r.name.clone().unwrap_or_else(|| format!("rule{}", i + 1)),
        action: r.action,
        users: globs(&r.users),
        member_of: r.member_of.clone(),
        databases: globs(&r.databases),
        addresses,
        application_names: globs(&r.application_names),
        tls: r.tls,
        message: r.message.clone(),
        sqlstate: sqlstate_of(
            r.sqlstate.as_deref(),
            sqlstate::INVALID_AUTHORIZATION,
            &format!("{key}.sqlstate"),
        )?,
        detail: r.detail.clone(),
        hint: r.hint.clone(),
        summary: if summary.is_empty() {
            "(every client)".into()
        } else {
            summary.join("; ")
        },
        matches: AtomicU64::new(0),
    })
}

/// A SQLSTATE for an error: five digits or capital letters, not of the
/// success, warning or no-data classes.
fn sqlstate_of(given: Option<&str>, default: &str, key: &str) -> Result<String, ConfigIssue> {
    let Some(s) = given else {
        return Ok(default.to_string());
    };
    let valid = s.len() == 5
        && s.bytes()
            .all(|b| b.is_ascii_digit() || b.is_ascii_uppercase())
        && !["00", "01", "02"].contains(&&s[..2]);
    if valid {
        Ok(s.to_string())
    } else {
        Err(ConfigIssue::new(
            key,
            format!("expected an error SQLSTATE of five digits or capital letters (e.g. 28000), got `{s}`"),
        ))
    }
}

#[async_trait]
impl Hook for Blocking {
    fn name(&self) -> &str {
        Blocking::NAME
    }

    fn events(&self) -> Vec<Event> {
        vec![Event::ClientConnection]
    }

    async fn client_connection(&self, ctx: &mut ConnectionCtx<'_>) -> Result<(), HookError> {
        let c = ctx.client;
        if let Some(m) = self.maintenance.load_full() {
            if !self.graph().await?.is_member(&c.user, &m.role) {
                let policy = self.policy.load();
                self.maintenance_rejects.fetch_add(1, Ordering::Relaxed);
                metrics::counter!("usher_blocking_matches_total", "rule" => "maintenance", "action" => "deny")
                    .increment(1);
                ctx.reject = Some(Rejection {
                    message: policy.style.message.clone().unwrap_or_else(|| {
                        format!(
                            "usher is in maintenance mode: only members of role \"{}\" may connect",
                            m.role
                        )
                    }),
                    sqlstate: policy.style.sqlstate.clone(),
                    detail: None,
                    hint: policy.style.hint.clone(),
                    hook: Blocking::NAME.to_string(),
                });
                return Ok(());
            }
        }
        if let Some((policy, i)) = self.first_match(c).await? {
            let rule = &policy.rules[i];
            rule.matches.fetch_add(1, Ordering::Relaxed);
            metrics::counter!("usher_blocking_matches_total", "rule" => rule.name.clone(), "action" => rule.action.to_string())
                .increment(1);
            tracing::debug!(user = %c.user, database = %c.database, rule = %rule.name, action = %rule.action, "blocking rule matched");
            if rule.action == BlockAction::Deny {
                ctx.reject = Some(rule.rejection(c));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, PoolMode};
    use std::collections::HashMap;
    use std::time::Duration;

    fn blocking(yaml: &str, with_query: bool) -> Result<Blocking, ConfigIssue> {
        let c = Config::from_yaml(yaml, "b.yaml").unwrap();
        let query = QueryPool::new(
            with_query.then(tokio_postgres::Config::new),
            1,
            Duration::from_millis(10),
        );
        let roles = RoleCache::default();
        Blocking::from_config(&c.blocking, Arc::new(roles), Arc::new(query))
    }

    fn client(user: &str, db: &str, addr: &str, app: &str, tls: bool) -> ClientInfo {
        ClientInfo {
            id: 1,
            user: user.into(),
            database: db.into(),
            application_name: app.into(),
            startup: Default::default(),
            addr: crate::client_addr::ClientAddr::Tcp(format!("{addr}:5000").parse().unwrap()),
            tls: tls.then(Default::default),
            auth_method: "scram-sha-256",
            pool_mode: PoolMode::Transaction,
        }
    }

    async fn decide(b: &Blocking, c: &ClientInfo) -> Option<Rejection> {
        let mut vars = Default::default();
        let mut ctx = ConnectionCtx {
            client: c,
            vars: &mut vars,
            reject: None,
            params: vec![],
            notices: vec![],
            route: None,
        };
        b.client_connection(&mut ctx).await.unwrap();
        ctx.reject
    }

    #[tokio::test]
    async fn first_matching_rule_decides() {
        let b = blocking(
            r#"
blocking:
  rules:
    - { name: ops-ok, action: allow, users: "ops_*", addresses: 10.0.0.0/8 }
    - { action: deny, users: ["ops_*", mallory], message: "go away", sqlstate: 42501, hint: ask }
    - { action: deny, databases: secret, tls: false }
    - { action: deny, application_names: "*batch*", addresses: ["192.168.1.7"] }
"#,
            false,
        )
        .unwrap();
        assert!(
            decide(&b, &client("ops_anna", "app", "10.1.2.3", "", false))
                .await
                .is_none()
        );
        let r = decide(&b, &client("ops_anna", "app", "172.16.0.1", "", false))
            .await
            .unwrap();
        assert_eq!(
            (r.message.as_str(), r.sqlstate.as_str(), r.hint.as_deref()),
            ("go away", "42501", Some("ask"))
        );
        assert!(decide(&b, &client("mallory", "app", "10.1.2.3", "", true))
            .await
            .is_some());
        let r = decide(&b, &client("alice", "secret", "10.1.2.3", "", false))
            .await
            .unwrap();
        assert_eq!(r.sqlstate, "28000");
        assert!(r.message.contains("rule \"rule3\""), "{}", r.message);
        assert!(decide(&b, &client("alice", "secret", "10.1.2.3", "", true))
            .await
            .is_none());
        assert!(decide(
            &b,
            &client("alice", "app", "192.168.1.7", "nightly-batch", false)
        )
        .await
        .is_some());
        assert!(decide(
            &b,
            &client("alice", "app", "192.168.1.8", "nightly-batch", false)
        )
        .await
        .is_none());
        let shown = b.show();
        let matches: HashMap<_, _> = shown
            .rows
            .iter()
            .map(|r| (r[0].clone().unwrap(), r[3].clone().unwrap()))
            .collect();
        assert_eq!(matches["ops-ok"], "1");
        assert_eq!(matches["rule2"], "2");
    }

    #[tokio::test]
    async fn a_rule_with_addresses_never_matches_a_local_client() {
        let b = blocking(
            "blocking:\n  rules:\n    - { action: deny, addresses: 0.0.0.0/0 }\n    - { action: deny, users: bob }\n",
            false,
        )
        .unwrap();
        let local = |user: &str| ClientInfo {
            addr: crate::client_addr::ClientAddr::Local(crate::client_addr::LocalPeer {
                uid: 0,
                gid: 0,
                pid: None,
                port: 6432,
            }),
            ..client(user, "app", "127.0.0.1", "", false)
        };
        assert!(decide(&b, &client("alice", "app", "10.0.0.1", "", false))
            .await
            .is_some());
        assert!(decide(&b, &local("alice")).await.is_none());
        assert!(
            decide(&b, &local("bob")).await.is_some(),
            "a rule without addresses does"
        );
    }

    #[test]
    fn configuration_errors_name_the_key() {
        for (yaml, with_query, key) in [
            ("blocking: { rules: [ { action: deny, member_of: x } ] }", false, "blocking.rules[0].member_of"),
            ("blocking: { maintenance: { member_of: admins } }", false, "blocking.maintenance.member_of"),
            ("blocking: { rules: [ { action: deny }, { action: deny, addresses: [10.0.0.0/33] } ] }", true, "blocking.rules[1].addresses[0]"),
            ("blocking: { rules: [ { action: deny, sqlstate: '00000' } ] }", true, "blocking.rules[0].sqlstate"),
            ("blocking: { rules: [ { action: deny, sqlstate: 28p01 } ] }", true, "blocking.rules[0].sqlstate"),
            ("blocking: { rules: [ { name: a, action: deny }, { name: a, action: allow } ] }", true, "blocking.rules[1].name"),
        ] {
            let issue = blocking(yaml, with_query).unwrap_err();
            assert_eq!(issue.key, key, "{yaml}: {issue}");
        }
        assert!(blocking(
            "blocking: { rules: [ { action: deny, member_of: x } ] }",
            true
        )
        .is_ok());
        assert!(!blocking("{}", false).unwrap().active());
    }
}
