//! Runs the hooks of each event in order, with the global switch.
//!
//! The hook list is swapped atomically on reload ([`arc_swap`]); calls in
//! flight finish on the list they started with. Per event a flag says
//! "hooks are on and someone handles this event", so the common case (no
//! hook for it, or hooks off) costs one relaxed atomic load.

use super::{ConnectionCtx, Event, Hook, HookError, Rejection, SessionCtx, SessionEndCtx};
use crate::auth::AuthAttempt;
use crate::protocol::error::sqlstate;
use arc_swap::ArcSwap;
use dashmap::DashMap;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Counters of one hook, kept across reloads (by hook name).
#[derive(Debug, Default)]
pub struct HookStats {
    pub calls: AtomicU64,
    pub rejects: AtomicU64,
    pub errors: AtomicU64,
    pub timeouts: AtomicU64,
    pub last_error: Mutex<Option<String>>,
}

struct Entry {
    hook: Arc<dyn Hook>,
    events: Vec<Event>,
    stats: Arc<HookStats>,
    /// Metric handles per event, registered once (labels allocate).
    metrics: [EventMetrics; 4],
    rejects: metrics::Counter,
}

/// The metrics of one hook for one event.
struct EventMetrics {
    calls: metrics::Counter,
    errors: metrics::Counter,
    timeouts: metrics::Counter,
    duration: metrics::Histogram,
}

impl EventMetrics {
    fn new(hook: &str, event: Event) -> Self {
        let labels = [
            ("hook", hook.to_string()),
            ("event", event.name().to_string()),
        ];
        EventMetrics {
            calls: metrics::counter!("usher_hook_calls_total", &labels),
            errors: metrics::counter!("usher_hook_errors_total", &labels),
            timeouts: metrics::counter!("usher_hook_timeouts_total", &labels),
            duration: metrics::histogram!("usher_hook_duration_seconds", &labels),
        }
    }
}

#[derive(Default)]
struct HookSet {
    entries: Vec<Arc<Entry>>,
    by_event: [Vec<Arc<Entry>>; 4],
}

/// One row of SHOW HOOKS.
#[derive(Debug, Clone)]
pub struct HookRow {
    pub name: String,
    pub events: Vec<Event>,
    pub calls: u64,
    pub rejects: u64,
    pub errors: u64,
    pub timeouts: u64,
    pub last_error: Option<String>,
}

/// The hooks of every event and the global switch.
pub struct Dispatcher {
    enabled: AtomicBool,
    /// Per event: enabled and at least one hook handles it.
    active: [AtomicBool; 4],
    set: ArcSwap<HookSet>,
    stats: DashMap<String, Arc<HookStats>>,
    /// hooks.on_error for client_connection: true = allow, false = reject.
    allow_on_error: AtomicBool,
}

impl std::fmt::Debug for Dispatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dispatcher")
            .field("enabled", &self.enabled())
            .finish_non_exhaustive()
    }
}

impl Dispatcher {
    pub fn new(enabled: bool, allow_on_error: bool) -> Self {
        Dispatcher {
            enabled: AtomicBool::new(enabled),
            active: Default::default(),
            set: ArcSwap::from_pointee(HookSet::default()),
            stats: DashMap::new(),
            allow_on_error: AtomicBool::new(allow_on_error),
        }
    }

    /// Replaces the hooks, in calling order (built-ins first, then Lua files).
    pub fn set_hooks(&self, hooks: Vec<Arc<dyn Hook>>) {
        let mut set = HookSet::default();
        for hook in hooks {
            let stats = self
                .stats
                .entry(hook.name().to_string())
                .or_default()
                .clone();
            let name = hook.name().to_string();
            let entry = Arc::new(Entry {
                events: hook.events(),
                metrics: Event::ALL.map(|e| EventMetrics::new(&name, e)),
                rejects: metrics::counter!("usher_hook_rejects_total", "hook" => name),
                hook,
                stats,
            });
            for e in &entry.events {
                set.by_event[*e as usize].push(entry.clone());
            }
            set.entries.push(entry);
        }
        self.set.store(Arc::new(set));
        self.refresh_active();
    }

    /// The global switch.
    pub fn set_enabled(&self, on: bool) {
        self.enabled.store(on, Ordering::SeqCst);
        self.refresh_active();
        tracing::warn!(
            enabled = on,
            "hooks switched {}",
            if on { "on" } else { "off" }
        );
    }

    pub fn enabled(&self) -> bool {
        self.enabled.load(Ordering::SeqCst)
    }

    pub fn set_allow_on_error(&self, allow: bool) {
        self.allow_on_error.store(allow, Ordering::Relaxed);
    }

    fn refresh_active(&self) {
        let set = self.set.load();
        let on = self.enabled();
        for e in Event::ALL {
            self.active[e as usize]
                .store(on && !set.by_event[e as usize].is_empty(), Ordering::SeqCst);
        }
    }

    /// True when some hook would run for `event`: the one atomic load of the
    /// fast path.
    #[inline]
    pub fn handles(&self, event: Event) -> bool {
        self.active[event as usize].load(Ordering::Relaxed)
    }

    fn entries(&self, event: Event) -> Option<arc_swap::Guard<Arc<HookSet>>> {
        if !self.handles(event) {
            return None;
        }
        Some(self.set.load())
    }

    /// Observe an authentication outcome.
    pub async fn auth_attempt(&self, attempt: &AuthAttempt) {
        let Some(set) = self.entries(Event::AuthAttempt) else {
            return;
        };
        for entry in &set.by_event[Event::AuthAttempt as usize] {
            let result = timed(entry, Event::AuthAttempt, entry.hook.auth_attempt(attempt)).await;
            if let Err(e) = result {
                tracing::warn!(hook = %entry.hook.name(), event = "auth_attempt", error = %e, "hook failed");
            }
        }
    }

    /// Runs client_connection hooks until one rejects. A failing hook rejects
    /// the client unless `hooks.on_error` is `allow`.
    pub async fn client_connection(&self, ctx: &mut ConnectionCtx<'_>) {
        let Some(set) = self.entries(Event::ClientConnection) else {
            return;
        };
        for entry in &set.by_event[Event::ClientConnection as usize] {
            let result = timed(
                entry,
                Event::ClientConnection,
                entry.hook.client_connection(ctx),
            )
            .await;
            if let Err(e) = result {
                tracing::warn!(hook = %entry.hook.name(), event = "client_connection", user = %ctx.client.user, error = %e, "hook failed");
                if !self.allow_on_error.load(Ordering::Relaxed) {
                    ctx.reject = Some(Rejection {
                        message: "connection refused: a connection hook failed".into(),
                        sqlstate: sqlstate::INVALID_AUTHORIZATION.into(),
                        detail: Some(format!("hook \"{}\" failed", entry.hook.name())),
                        hint: Some(
                            "see usher's log; an admin can run DISABLE HOOKS on the usher console"
                                .into(),
                        ),
                        hook: entry.hook.name().to_string(),
                    });
                }
            }
            if let Some(r) = &mut ctx.reject {
                if r.hook.is_empty() {
                    r.hook = entry.hook.name().to_string();
                }
                entry.stats.rejects.fetch_add(1, Ordering::Relaxed);
                entry.rejects.increment(1);
                return;
            }
        }
    }

    /// Runs session_start hooks; failures become warnings in `ctx.warnings`.
    pub async fn session_start(&self, ctx: &mut SessionCtx<'_>) {
        let Some(set) = self.entries(Event::SessionStart) else {
            return;
        };
        for entry in &set.by_event[Event::SessionStart as usize] {
            let result = timed(entry, Event::SessionStart, entry.hook.session_start(ctx)).await;
            if let Err(e) = result {
                tracing::warn!(hook = %entry.hook.name(), event = "session_start", user = %ctx.client.user, error = %e, "hook failed");
                ctx.warnings.push(format!(
                    "session_start hook \"{}\" failed: {e}",
                    entry.hook.name()
                ));
            }
        }
    }

    /// Observe the end of a session.
    pub async fn session_end(&self, ctx: &SessionEndCtx<'_>) {
        let Some(set) = self.entries(Event::SessionEnd) else {
            return;
        };
        for entry in &set.by_event[Event::SessionEnd as usize] {
            if let Err(e) = timed(entry, Event::SessionEnd, entry.hook.session_end(ctx)).await {
                tracing::warn!(hook = %entry.hook.name(), event = "session_end", error = %e, "hook failed");
            }
        }
    }

    /// Counts a refusal a hook made outside an event call (the auth
    /// monitor's lockout, decided before authentication), so SHOW HOOKS
    /// shows it.
    pub fn count_reject(&self, hook: &str) {
        self.stats
            .entry(hook.to_string())
            .or_default()
            .rejects
            .fetch_add(1, Ordering::Relaxed);
        metrics::counter!("usher_hook_rejects_total", "hook" => hook.to_string()).increment(1);
    }

    /// Every hook with its counters, in calling order.
    pub fn rows(&self) -> Vec<HookRow> {
        self.set
            .load()
            .entries
            .iter()
            .map(|e| HookRow {
                name: e.hook.name().to_string(),
                events: e.events.clone(),
                calls: e.stats.calls.load(Ordering::Relaxed),
                rejects: e.stats.rejects.load(Ordering::Relaxed),
                errors: e.stats.errors.load(Ordering::Relaxed),
                timeouts: e.stats.timeouts.load(Ordering::Relaxed),
                last_error: e.stats.last_error.lock().clone(),
            })
            .collect()
    }
}

/// Runs one hook call, counting it and timing it.
async fn timed(
    entry: &Entry,
    event: Event,
    call: impl std::future::Future<Output = Result<(), HookError>>,
) -> Result<(), HookError> {
    let started = Instant::now();
    let result = call.await;
    let m = &entry.metrics[event as usize];
    entry.stats.calls.fetch_add(1, Ordering::Relaxed);
    m.calls.increment(1);
    m.duration.record(started.elapsed().as_secs_f64());
    if let Err(e) = &result {
        entry.stats.errors.fetch_add(1, Ordering::Relaxed);
        m.errors.increment(1);
        if *e == HookError::Timeout {
            entry.stats.timeouts.fetch_add(1, Ordering::Relaxed);
            m.timeouts.increment(1);
        }
        *entry.stats.last_error.lock() = Some(e.to_string());
    }
    result
}
