//! The Lua engine: hook files from `hooks.dir`, run in sandboxed VMs.
//!
//! Every `*.lua` file directly in the folder is a hook, loaded in file-name
//! order; its global functions named after events are its handlers. Each
//! call borrows a whole VM from a pool (no VM is ever shared between
//! threads behind a lock), so hooks on different connections run in
//! parallel, and a hook waiting on `usher.query` blocks nothing else. A VM
//! whose call ran out of time or memory is thrown away; the next call
//! builds a fresh one.

mod api;
mod convert;
mod vm;

pub use vm::HookSource;

use super::query::QueryPool;
use super::roles::RoleCache;
use super::shared::SharedStore;
use super::{ConnectionCtx, Event, Hook, HookError, SessionCtx, SessionEndCtx};
use crate::auth::AuthAttempt;
use async_trait::async_trait;
use parking_lot::Mutex;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vm::{Budget, Vm};

/// What hooks can reach beyond their VM; lives across reloads.
#[derive(Debug)]
pub struct LuaServices {
    pub shared: SharedStore,
    pub roles: Arc<RoleCache>,
    pub query: Arc<QueryPool>,
}

/// Limits of the engine (from `hooks:`).
#[derive(Debug, Clone)]
pub struct LuaSettings {
    pub dir: PathBuf,
    pub timeout: Duration,
    pub memory_limit: usize,
    /// Idle VMs kept for reuse.
    pub max_idle_vms: usize,
}

impl LuaSettings {
    /// The Lua engine settings from the configuration.
    pub fn from_config(config: &crate::config::Config) -> LuaSettings {
        let h = &config.hooks;
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        LuaSettings {
            dir: h.dir.clone(),
            timeout: Duration::from_millis(h.timeout_ms),
            memory_limit: h.memory_limit_mb * 1024 * 1024,
            max_idle_vms: if h.vms == 0 { cores * 2 } else { h.vms },
        }
    }
}

/// A file that failed to load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadError {
    pub file: String,
    pub message: String,
}

impl std::fmt::Display for LoadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.file, self.message)
    }
}

/// One compiled set of hook files and its pool of VMs. A reload builds a new
/// engine; calls in flight finish on the old one.
pub struct LuaEngine {
    sources: Vec<HookSource>,
    /// Per file, the events it handles.
    events: Vec<Vec<Event>>,
    settings: LuaSettings,
    services: Arc<LuaServices>,
    idle: Mutex<Vec<Vm>>,
}

/// Reads the hook files of `dir` in file-name order. A missing folder means
/// no hooks.
pub fn read_sources(dir: &Path) -> Result<Vec<HookSource>, LoadError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => {
            return Err(LoadError {
                file: dir.display().to_string(),
                message: format!("cannot read the hooks folder: {e}"),
            })
        }
    };
    let mut paths: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "lua"))
        .collect();
    paths.sort();
    paths
        .into_iter()
        .map(|path| {
            let code = std::fs::read_to_string(&path).map_err(|e| LoadError {
                file: path.display().to_string(),
                message: format!("cannot read: {e}"),
            })?;
            Ok(HookSource {
                name: path.file_name().unwrap().to_string_lossy().into_owned(),
                path,
                code,
            })
        })
        .collect()
}

/// Compiles every file on its own (so every broken file is reported, with
/// its line), then runs them all in one VM. Used by load and `usher hooks check`.
pub fn check(
    sources: &[HookSource],
    settings: &LuaSettings,
    services: Arc<LuaServices>,
) -> Result<(), Vec<LoadError>> {
    let scratch = mlua::Lua::new();
    let mut errors: Vec<LoadError> = sources
        .iter()
        .filter_map(|s| {
            scratch
                .load(&s.code)
                .set_name(format!("@{}", s.path.display()))
                .set_mode(mlua::chunk::ChunkMode::Text)
                .into_function()
                .err()
                .map(|e| LoadError {
                    file: s.path.display().to_string(),
                    message: e.to_string(),
                })
        })
        .collect();
    if errors.is_empty() {
        if let Err(e) = Vm::new(sources, &settings.dir, settings.memory_limit, services) {
            errors.push(LoadError {
                file: settings.dir.display().to_string(),
                message: e.to_string(),
            });
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors)
    }
}

impl LuaEngine {
    /// Loads the hook files of `settings.dir`; any error keeps the caller's
    /// current engine in place.
    pub fn load(
        settings: LuaSettings,
        services: Arc<LuaServices>,
    ) -> Result<Arc<LuaEngine>, Vec<LoadError>> {
        let sources = read_sources(&settings.dir).map_err(|e| vec![e])?;
        check(&sources, &settings, services.clone())?;
        let first = Vm::new(
            &sources,
            &settings.dir,
            settings.memory_limit,
            services.clone(),
        )
        .map_err(|e| {
            vec![LoadError {
                file: settings.dir.display().to_string(),
                message: e.to_string(),
            }]
        })?;
        let events = (0..sources.len())
            .map(|i| {
                Event::ALL
                    .into_iter()
                    .filter(|e| first.handler(i, e.name()).is_some())
                    .collect()
            })
            .collect();
        Ok(Arc::new(LuaEngine {
            sources,
            events,
            settings,
            services,
            idle: Mutex::new(vec![first]),
        }))
    }

    /// One [`Hook`] per file that handles at least one event.
    pub fn hooks(self: &Arc<Self>) -> Vec<Arc<dyn Hook>> {
        (0..self.sources.len())
            .filter(|i| !self.events[*i].is_empty())
            .map(|index| {
                Arc::new(LuaFileHook {
                    engine: self.clone(),
                    index,
                }) as Arc<dyn Hook>
            })
            .collect()
    }

    pub fn file_names(&self) -> Vec<String> {
        self.sources.iter().map(|s| s.name.clone()).collect()
    }

    fn checkout(&self) -> Result<Vm, HookError> {
        if let Some(vm) = self.idle.lock().pop() {
            return Ok(vm);
        }
        Vm::new(
            &self.sources,
            &self.settings.dir,
            self.settings.memory_limit,
            self.services.clone(),
        )
        .map_err(|e| HookError::Failed(e.to_string()))
    }

    fn checkin(&self, vm: Vm) {
        let mut idle = self.idle.lock();
        if idle.len() < self.settings.max_idle_vms {
            idle.push(vm);
        }
    }

    /// Calls file `index`'s handler for `event` with a ctx built by `fill`,
    /// then lets `collect` read the ctx back. Runs under the time budget; a
    /// VM that ran out of time or memory is dropped.
    async fn call<T>(
        &self,
        index: usize,
        event: Event,
        client: Option<(&super::ClientInfo, &super::Vars)>,
        reason: Option<super::SessionReason>,
        fill: impl FnOnce(&mlua::Lua, &mlua::Table) -> mlua::Result<()>,
        collect: impl FnOnce(&Vm, &mlua::Table) -> mlua::Result<T>,
    ) -> Result<T, HookError> {
        let vm = self.checkout()?;
        let Some(handler) = vm.handler(index, event.name()) else {
            self.checkin(vm);
            return Err(HookError::Failed(format!("no {} handler", event.name())));
        };
        let failed = |e: mlua::Error| HookError::Failed(e.to_string());
        let ctx = convert::new_ctx(&vm, event, client, reason).map_err(failed)?;
        fill(&vm.lua, &ctx).map_err(failed)?;
        let deadline = Instant::now() + self.settings.timeout;
        if let Some(budget) = vm.lua.app_data_ref::<Budget>() {
            budget.start(deadline);
        }
        let outcome =
            tokio::time::timeout_at(deadline.into(), handler.call_async::<()>(ctx.clone())).await;
        let exceeded = vm.lua.app_data_ref::<Budget>().is_some_and(|b| {
            b.stop();
            b.was_exceeded()
        });
        match outcome {
            Err(_) => Err(HookError::Timeout), // an awaited call ran too long: drop the VM
            Ok(Err(_)) if exceeded => Err(HookError::Timeout),
            Ok(Err(e)) if is_memory_error(&e) => Err(HookError::Memory),
            Ok(Err(e)) => {
                self.checkin(vm);
                Err(HookError::Failed(first_line(&e)))
            }
            Ok(Ok(())) => {
                let result = collect(&vm, &ctx).map_err(|e| HookError::Failed(e.to_string()));
                self.checkin(vm);
                result
            }
        }
    }
}

fn is_memory_error(e: &mlua::Error) -> bool {
    match e {
        mlua::Error::MemoryError(_) => true,
        mlua::Error::CallbackError { cause, .. } => is_memory_error(cause),
        mlua::Error::WithContext { cause, .. } => is_memory_error(cause),
        other => other.to_string().contains("not enough memory"),
    }
}

/// The error message without Lua's stack traceback.
fn first_line(e: &mlua::Error) -> String {
    let text = e.to_string();
    text.lines().next().unwrap_or_default().to_string()
}

/// One hook file, as a [`Hook`].
struct LuaFileHook {
    engine: Arc<LuaEngine>,
    index: usize,
}

#[async_trait]
impl Hook for LuaFileHook {
    fn name(&self) -> &str {
        &self.engine.sources[self.index].name
    }

    fn events(&self) -> Vec<Event> {
        self.engine.events[self.index].clone()
    }

    async fn auth_attempt(&self, attempt: &AuthAttempt) -> Result<(), HookError> {
        self.engine
            .call(
                self.index,
                Event::AuthAttempt,
                None,
                None,
                |lua, ctx| convert::fill_auth_attempt(lua, ctx, attempt),
                |_, _| Ok(()),
            )
            .await
    }

    async fn client_connection(&self, ctx: &mut ConnectionCtx<'_>) -> Result<(), HookError> {
        let client = ctx.client;
        let vars = ctx.vars.clone();
        let out = self
            .engine
            .call(
                self.index,
                Event::ClientConnection,
                Some((client, &vars)),
                None,
                |_, _| Ok(()),
                convert::collect,
            )
            .await?;
        if let Some(vars) = out.vars {
            *ctx.vars = vars;
        }
        ctx.params.extend(out.params);
        ctx.notices.extend(out.notices);
        if let Some(mut r) = out.reject {
            r.hook = self.name().to_string();
            ctx.reject = Some(r);
        }
        Ok(())
    }

    async fn session_start(&self, ctx: &mut SessionCtx<'_>) -> Result<(), HookError> {
        let (client, reason, server) = (ctx.client, ctx.reason, ctx.server.clone());
        let vars = ctx.vars.clone();
        let out = self
            .engine
            .call(
                self.index,
                Event::SessionStart,
                Some((client, &vars)),
                Some(reason),
                |lua, t| convert::fill_session(lua, t, server.as_ref()),
                convert::collect,
            )
            .await?;
        if let Some(vars) = out.vars {
            *ctx.vars = vars;
        }
        ctx.params.extend(out.params);
        ctx.exec.extend(out.exec);
        ctx.notices.extend(out.notices);
        Ok(())
    }

    async fn session_end(&self, ctx: &SessionEndCtx<'_>) -> Result<(), HookError> {
        let (client, vars, duration) = (ctx.client, ctx.vars, ctx.duration);
        self.engine
            .call(
                self.index,
                Event::SessionEnd,
                Some((client, vars)),
                None,
                |_, t| t.raw_set("duration_ms", duration.as_millis() as i64),
                |_, _| Ok(()),
            )
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine(code: &str, timeout_ms: u64, memory_mb: usize) -> Arc<LuaEngine> {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("10-test.lua"), code).unwrap();
        let settings = LuaSettings {
            dir: dir.keep(),
            timeout: Duration::from_millis(timeout_ms),
            memory_limit: memory_mb * 1024 * 1024,
            max_idle_vms: 2,
        };
        let services = Arc::new(LuaServices {
            shared: SharedStore::new(10),
            roles: Arc::new(RoleCache::default()),
            query: Arc::new(QueryPool::new(None, 1, Duration::from_secs(1))),
        });
        LuaEngine::load(settings, services).unwrap()
    }

    async fn run(engine: &Arc<LuaEngine>) -> Result<(), HookError> {
        engine
            .call(
                0,
                Event::AuthAttempt,
                None,
                None,
                |_, _| Ok(()),
                |_, _| Ok(()),
            )
            .await
    }

    #[tokio::test]
    async fn an_endless_loop_is_stopped() {
        for code in [
            "function auth_attempt(ctx) while true do end end",
            "function auth_attempt(ctx) while true do pcall(function() while true do end end) end end",
            "function auth_attempt(ctx) while true do xpcall(function() while true do end end, print) end end",
            "function auth_attempt(ctx) while true do coroutine.resume(coroutine.create(function() while true do end end)) end end",
        ] {
            let e = engine(code, 100, 8);
            let started = Instant::now();
            assert_eq!(run(&e).await, Err(HookError::Timeout), "{code}");
            assert!(started.elapsed() < Duration::from_secs(2), "{code}");
        }
    }

    #[tokio::test]
    async fn a_memory_bomb_is_stopped() {
        let e = engine("function auth_attempt(ctx) local t = {} for i = 1, 1e9 do t[i] = string.rep('x', 4096) .. i end end", 5000, 8);
        assert_eq!(run(&e).await, Err(HookError::Memory));
        // The next call gets a fresh VM.
        assert_eq!(run(&e).await, Err(HookError::Memory));
    }

    #[tokio::test]
    async fn the_sandbox_has_no_io_os_or_load() {
        let e = engine(
            "function auth_attempt(ctx) assert(io == nil and debug == nil and load == nil and loadfile == nil and dofile == nil and os.execute == nil and os.getenv == nil and os.exit == nil and os.remove == nil and string.dump == nil and package == nil) end",
            100,
            8,
        );
        assert_eq!(run(&e).await, Ok(()));
    }
}
