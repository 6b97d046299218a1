//! A cached copy of the server's role graph (pg_auth_members), refreshed in
//! the background, so `usher.roles.is_member` and member_of rules never wait
//! on the server once the cache is warm.

use super::query::{HookQueryError, QueryPool, QueryValue};
use arc_swap::ArcSwap;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Who is a direct member of which role, and each role's oid.
#[derive(Debug, Default, Clone)]
pub struct RoleGraph {
    /// member → roles it is directly a member of.
    member_of: HashMap<String, Vec<String>>,
    oids: HashMap<String, u32>,
}

impl RoleGraph {
    /// Builds a graph from (member, role) pairs and (role, oid) pairs.
    pub fn new(
        edges: impl IntoIterator<Item = (String, String)>,
        oids: HashMap<String, u32>,
    ) -> Self {
        let mut member_of: HashMap<String, Vec<String>> = HashMap::new();
        for (member, role) in edges {
            member_of.entry(member).or_default().push(role);
        }
        RoleGraph { member_of, oids }
    }

    /// True if `user` is `role` or a member of it, directly or through other
    /// roles (as PostgreSQL's is_member_of_role).
    pub fn is_member(&self, user: &str, role: &str) -> bool {
        if user == role {
            return true;
        }
        let mut seen = HashSet::new();
        let mut stack = vec![user];
        while let Some(r) = stack.pop() {
            for parent in self.member_of.get(r).into_iter().flatten() {
                if parent == role {
                    return true;
                }
                if seen.insert(parent.as_str()) {
                    stack.push(parent);
                }
            }
        }
        false
    }

    /// The role's oid, if the role exists on the server.
    pub fn oid(&self, role: &str) -> Option<u32> {
        self.oids.get(role).copied()
    }

    /// Every role on the server with its oid.
    pub fn roles(&self) -> impl Iterator<Item = (&str, u32)> {
        self.oids.iter().map(|(name, oid)| (name.as_str(), *oid))
    }
}

/// The cache and its refresher.
#[derive(Debug)]
pub struct RoleCache {
    graph: ArcSwap<RoleGraph>,
    warm: AtomicBool,
}

impl Default for RoleCache {
    fn default() -> Self {
        RoleCache {
            graph: ArcSwap::from_pointee(RoleGraph::default()),
            warm: AtomicBool::new(false),
        }
    }
}

impl RoleCache {
    /// The current graph; loads it first if it never was.
    pub async fn graph(&self, pool: &QueryPool) -> Result<Arc<RoleGraph>, HookQueryError> {
        if !self.warm.load(Ordering::Acquire) {
            self.refresh(pool).await?;
        }
        Ok(self.graph.load_full())
    }

    /// The current graph without waiting (empty while cold).
    pub fn snapshot(&self) -> Arc<RoleGraph> {
        self.graph.load_full()
    }

    pub fn is_warm(&self) -> bool {
        self.warm.load(Ordering::Acquire)
    }

    /// Reads pg_auth_members and pg_roles now.
    pub async fn refresh(&self, pool: &QueryPool) -> Result<(), HookQueryError> {
        let edges = pool
            .query(
                "SELECT m.rolname::text, r.rolname::text FROM pg_auth_members a \
                 JOIN pg_roles m ON m.oid = a.member JOIN pg_roles r ON r.oid = a.roleid",
                &[],
            )
            .await?;
        let roles = pool
            .query("SELECT rolname::text, oid FROM pg_roles", &[])
            .await?;
        let text = |v: &QueryValue| match v {
            QueryValue::Text(s) => s.clone(),
            _ => String::new(),
        };
        let graph = RoleGraph::new(
            edges.iter().map(|r| (text(&r[0].1), text(&r[1].1))),
            roles
                .iter()
                .filter_map(|r| match r[1].1 {
                    QueryValue::Int(oid) => Some((text(&r[0].1), oid as u32)),
                    _ => None,
                })
                .collect(),
        );
        self.graph.store(Arc::new(graph));
        self.warm.store(true, Ordering::Release);
        Ok(())
    }

    /// Refreshes every `interval` for as long as the cache exists.
    pub fn spawn_refresher(self: &Arc<Self>, pool: Arc<QueryPool>, interval: Duration) {
        let cache = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(interval).await;
                let Some(c) = cache.upgrade() else { return };
                if let Err(e) = c.refresh(&pool).await {
                    tracing::warn!(error = %e, "could not refresh the role graph");
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn membership_is_transitive_and_reflexive() {
        let g = RoleGraph::new(
            [
                ("alice", "staff"),
                ("staff", "reporting"),
                ("bob", "ops"),
                ("ops", "staff"),
                ("staff", "ops"),
            ]
            .map(|(a, b)| (a.to_string(), b.to_string())),
            HashMap::new(),
        );
        assert!(g.is_member("alice", "reporting"));
        assert!(g.is_member("alice", "alice"));
        assert!(g.is_member("bob", "reporting"), "through a cycle");
        assert!(!g.is_member("reporting", "alice"));
        assert!(!g.is_member("carol", "staff"));
    }
}
