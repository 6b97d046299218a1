//! The Lua engine: hook files from `hooks.dir`, run in sandboxed VMs on
//! hook threads.
//!
//! Every `*.lua` file directly in the folder is a hook, loaded in file-name
//! order; its global functions named after events are its handlers. Lua
//! never runs on a runtime worker: each call is a job for the hook threads
//! ([`threads`]), which borrows a whole VM from the engine's pool (no VM is
//! ever shared between threads behind a lock), so hooks on different
//! connections run in parallel, and a hook waiting on `usher.query` blocks
//! no worker. A call is a plain Lua call (no coroutine): `usher.query` and
//! `usher.roles.is_member` block their hook thread on the runtime until
//! the answer or the deadline. The client's task awaits the answer until
//! the call's deadline. The time budget's count hook is armed only on a
//! call that runs long ([`watchdog`]). A VM whose call ran out of time or memory is thrown away on
//! its thread, after the client has its answer; the next call builds a
//! fresh one (its files' top level run again, on the hook thread, within
//! that call's budget). Loading (at start, `usher hooks check`, RELOAD)
//! runs the files' top level once, under the same budget and memory limit.

mod api;
mod convert;
mod ctx_route;
pub(crate) mod threads;
mod vm;
mod watchdog;

pub use threads::HookThreads;
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
use threads::NoAnswer;
use vm::{Overran, Vm, VmError};

/// What hooks can reach beyond their VM, and the threads they run on;
/// lives across reloads.
#[derive(Debug)]
pub struct LuaServices {
    pub shared: SharedStore,
    pub roles: Arc<RoleCache>,
    pub query: Arc<QueryPool>,
    pub threads: HookThreads,
    /// The console's RECONNECTs (`usher.reconnects`).
    pub reconnects: Arc<crate::hooks::reconnects::Reconnects>,
}

/// Limits of the engine (from `hooks:`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LuaSettings {
    pub dir: PathBuf,
    pub timeout: Duration,
    pub memory_limit: usize,
    /// Idle VMs kept for reuse.
    pub max_idle_vms: usize,
    /// The bytes a client's `ctx.vars` may hold (keys and values).
    pub vars_max_bytes: usize,
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
            vars_max_bytes: h.vars_max_bytes,
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
/// its line), then runs their top level in one VM, within the time budget
/// and under the memory limit. `usher hooks check`.
pub fn check(
    sources: &[HookSource],
    settings: &LuaSettings,
    services: Arc<LuaServices>,
) -> Result<(), Vec<LoadError>> {
    build(sources, settings, services).map(drop)
}

/// [`check`], keeping the VM: the engine's first.
fn build(
    sources: &[HookSource],
    settings: &LuaSettings,
    services: Arc<LuaServices>,
) -> Result<Vm, Vec<LoadError>> {
    let scratch = mlua::Lua::new();
    let errors: Vec<LoadError> = sources
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
    if !errors.is_empty() {
        return Err(errors);
    }
    let deadline = Instant::now() + settings.timeout;
    Vm::new(
        sources,
        &settings.dir,
        settings.memory_limit,
        services,
        deadline,
    )
    .map_err(|e| {
        vec![LoadError {
            file: e.file.unwrap_or_else(|| settings.dir.display().to_string()),
            message: e.message,
        }]
    })
}

impl LuaEngine {
    /// Loads the hook files of `settings.dir`; any error keeps the caller's
    /// current engine in place. Runs the files' top level (under the
    /// budget) on the calling thread: a caller on the runtime hands it to
    /// a blocking thread (App::reload).
    pub fn load(
        settings: LuaSettings,
        services: Arc<LuaServices>,
    ) -> Result<Arc<LuaEngine>, Vec<LoadError>> {
        let sources = read_sources(&settings.dir).map_err(|e| vec![e])?;
        let first = build(&sources, &settings, services.clone())?;
        let events = (0..sources.len())
            .map(|i| {
                Event::ALL
                    .into_iter()
                    .filter(|e| first.handler(i, *e).is_some())
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

    /// An idle VM, or a new one whose files' top level runs within the
    /// call's `deadline`. On a hook thread.
    fn checkout(&self, deadline: Instant) -> Result<Vm, HookError> {
        if let Some(vm) = self.idle.lock().pop() {
            return Ok(vm);
        }
        Vm::new(
            &self.sources,
            &self.settings.dir,
            self.settings.memory_limit,
            self.services.clone(),
            deadline,
        )
        .map_err(|e: VmError| match e.overran {
            Some(Overran::Time) => HookError::Timeout,
            Some(Overran::Memory) => HookError::Memory,
            None => HookError::Failed(e.to_string()),
        })
    }

    /// Keeps `vm` for reuse, or gives it back when enough are idle (to be
    /// dropped once the caller has its answer).
    fn checkin(&self, vm: Vm) -> Option<Vm> {
        let mut idle = self.idle.lock();
        if idle.len() < self.settings.max_idle_vms {
            idle.push(vm);
            None
        } else {
            Some(vm)
        }
    }

    /// Calls file `index`'s handler for `event` on a hook thread, through
    /// the prelude's `run` (which looks the handler up and builds the ctx:
    /// the client's fields and vars from a string each, `client`'s blobs,
    /// unpacked on first use, and the table of further `fields`), then lets
    /// `collect` read the decisions back. Answers at the deadline at the
    /// latest (a thread stuck in a C call is set aside, see [`threads`]).
    async fn call<T: Send + 'static>(
        self: &Arc<Self>,
        index: usize,
        event: Event,
        client: Option<(Vec<u8>, Option<String>)>,
        reason: Option<super::SessionReason>,
        fields: impl FnOnce(&mlua::Lua) -> mlua::Result<Option<mlua::Table>> + Send + 'static,
        collect: impl FnOnce(&Vm, convert::Decided) -> mlua::Result<T> + Send + 'static,
    ) -> Result<T, HookError> {
        let deadline = Instant::now() + self.settings.timeout;
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return Err(HookError::Failed(
                "hooks run only within usher's runtime".into(),
            ));
        };
        let engine = self.clone();
        let answer = self
            .services
            .threads
            .run(deadline, move |reply| {
                let (result, spent) = engine.run_call(
                    &runtime, deadline, index, event, client, reason, fields, collect,
                );
                let _ = reply.send(result);
                // After the answer: thrown away (an overrun) or, when enough
                // are idle, dropped.
                drop(spent);
            })
            .await;
        match answer {
            Ok(result) => result,
            Err(NoAnswer::Late) => Err(HookError::Timeout),
            Err(NoAnswer::Lost) => Err(HookError::Failed(
                "the hook call ended without an answer (see usher's log)".into(),
            )),
        }
    }

    /// The call itself, on a hook thread: its result, and a VM to drop
    /// once the caller has it.
    #[allow(clippy::too_many_arguments)]
    fn run_call<T>(
        &self,
        runtime: &tokio::runtime::Handle,
        deadline: Instant,
        index: usize,
        event: Event,
        client: Option<(Vec<u8>, Option<String>)>,
        reason: Option<super::SessionReason>,
        fields: impl FnOnce(&mlua::Lua) -> mlua::Result<Option<mlua::Table>>,
        collect: impl FnOnce(&Vm, convert::Decided) -> mlua::Result<T>,
    ) -> (Result<T, HookError>, Option<Vm>) {
        let vm = match self.checkout(deadline) {
            Ok(vm) => vm,
            Err(e) => return (Err(e), None),
        };
        let failed = |e: mlua::Error| HookError::Failed(e.to_string());
        let (blob, varblob) = match client {
            Some((blob, varblob)) => (Some(blob), varblob),
            None => (None, None),
        };
        let fields = match fields(&vm.lua) {
            Ok(f) => f,
            Err(e) => return (Err(failed(e)), self.checkin(vm)),
        };
        vm.budget.start(deadline);
        // A plain call: usher.query and the like block this hook thread
        // on the runtime (vm::await_within_budget), never a worker. The
        // client's blob is pushed, the handler called and the record read
        // back in one protected call: each mlua call that may allocate is
        // a protected call of its own while a memory limit is set.
        let outcome = {
            let _runtime = vm::CallRuntime::enter(runtime);
            let _watched = watchdog::Watched::start(vm.main, &vm.budget, self.settings.timeout);
            let blob = blob.as_deref();
            // SAFETY: the closure keeps to the stack it is given (the
            // arguments below, then what it leaves: three values), and
            // holds nothing to drop when a Lua error unwinds through it.
            unsafe {
                vm.lua.exec_raw::<(bool, mlua::Value, bool)>(
                    (
                        &vm.no_handler,
                        &vm.state,
                        &vm.run,
                        &vm.files[index],
                        &vm.names.events[event as usize],
                        reason.map(|r| vm.names.reason(r)),
                        fields,
                        varblob.as_deref(),
                    ),
                    |state| call_and_read_back(state, blob),
                )
            }
        };
        vm.budget.stop();
        let exceeded = vm.budget.was_exceeded();
        match outcome {
            Err(_) if exceeded => (Err(HookError::Timeout), Some(vm)),
            Err(e) if is_memory_error(&e) => (Err(HookError::Memory), Some(vm)),
            Err(e) => (Err(HookError::Failed(first_line(&e))), self.checkin(vm)),
            Ok((true, _, _)) => (
                Err(HookError::Failed(format!("no {} handler", event.name()))),
                self.checkin(vm),
            ),
            Ok((false, last, chunks)) => {
                let last = match last {
                    mlua::Value::String(s) => Some(s),
                    _ => None,
                };
                let decided = convert::Decided { last, chunks };
                let result = collect(&vm, decided).map_err(|e| HookError::Failed(e.to_string()));
                (result, self.checkin(vm))
            }
        }
    }
}

/// On the stack: no_handler, the prelude's state, run, and run's arguments
/// but the client's blob, which is pushed here. Calls run and leaves: run
/// found no handler, state[2], state[3] is set.
///
/// # Safety
/// Called by `exec_raw` (in protected mode) with that stack.
unsafe fn call_and_read_back(state: *mut mlua::ffi::lua_State, blob: Option<&[u8]>) {
    use mlua::ffi;
    // SAFETY: see the function's contract; Lua errors unwind to exec_raw's
    // protected call, and nothing here needs dropping.
    unsafe {
        match blob {
            Some(b) => {
                ffi::lua_pushlstring(state, b.as_ptr().cast(), b.len());
            }
            None => ffi::lua_pushnil(state),
        }
        ffi::lua_call(state, 6, 1); // no_handler, state, result
        let no_handler = ffi::lua_rawequal(state, -1, -3);
        ffi::lua_pop(state, 1); // no_handler, state
        ffi::lua_pushboolean(state, no_handler);
        ffi::lua_rawgeti(state, -2, 2);
        ffi::lua_rawgeti(state, -3, 3);
        let chunks = ffi::lua_type(state, -1) != ffi::LUA_TNIL;
        ffi::lua_pop(state, 1);
        ffi::lua_pushboolean(state, chunks as std::os::raw::c_int);
        // no_handler, state, found, state[2], chunks
        ffi::lua_remove(state, -5);
        ffi::lua_remove(state, -4);
    }
}

impl Drop for LuaEngine {
    /// The idle VMs are dropped on a hook thread: dropping a VM frees all
    /// its memory, which is no work for a runtime worker.
    fn drop(&mut self) {
        let idle = std::mem::take(&mut *self.idle.lock());
        if !idle.is_empty() {
            self.services.threads.spawn(move || drop(idle));
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

/// The client's fields and vars as the prelude's blobs.
fn blobs(client: &super::ClientInfo, vars: &super::Vars) -> Option<(Vec<u8>, Option<String>)> {
    Some((convert::client_blob(client), convert::vars_blob(vars)))
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
        let attempt = attempt.clone();
        self.engine
            .call(
                self.index,
                Event::AuthAttempt,
                None,
                None,
                move |lua| convert::auth_attempt_fields(lua, &attempt),
                |_, _| Ok(()),
            )
            .await
    }

    async fn client_connection(&self, ctx: &mut ConnectionCtx<'_>) -> Result<(), HookError> {
        let max_vars = self.engine.settings.vars_max_bytes;
        let out = self
            .engine
            .call(
                self.index,
                Event::ClientConnection,
                blobs(ctx.client, ctx.vars),
                None,
                |_| Ok(None),
                move |vm, decided| convert::collect(vm, decided, max_vars),
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
        if let Some(route) = out.route {
            if let Some((_, first)) = &ctx.route {
                return Err(HookError::Failed(format!(
                    "ctx:route may be called once per client (hook \"{first}\" routed it already)"
                )));
            }
            ctx.route = Some((route, self.name().to_string()));
        }
        Ok(())
    }

    async fn session_start(&self, ctx: &mut SessionCtx<'_>) -> Result<(), HookError> {
        let max_vars = self.engine.settings.vars_max_bytes;
        let server = ctx.server.clone();
        let out = self
            .engine
            .call(
                self.index,
                Event::SessionStart,
                blobs(ctx.client, ctx.vars),
                Some(ctx.reason),
                move |lua| convert::session_fields(lua, server.as_ref()),
                move |vm, decided| convert::collect(vm, decided, max_vars),
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
        let duration = ctx.duration;
        self.engine
            .call(
                self.index,
                Event::SessionEnd,
                blobs(ctx.client, ctx.vars),
                None,
                move |lua| {
                    let t = lua.create_table()?;
                    t.raw_set("duration_ms", duration.as_millis() as i64)?;
                    Ok(Some(t))
                },
                |_, _| Ok(()),
            )
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine(code: &str, timeout_ms: u64, memory_mb: usize) -> Arc<LuaEngine> {
        load(code, timeout_ms, memory_mb).unwrap()
    }

    fn load(
        code: &str,
        timeout_ms: u64,
        memory_mb: usize,
    ) -> Result<Arc<LuaEngine>, Vec<LoadError>> {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("10-test.lua"), code).unwrap();
        let settings = LuaSettings {
            dir: dir.keep(),
            timeout: Duration::from_millis(timeout_ms),
            memory_limit: memory_mb * 1024 * 1024,
            max_idle_vms: 2,
            vars_max_bytes: 100,
        };
        let services = Arc::new(LuaServices {
            shared: SharedStore::new(10, 1 << 20),
            roles: Arc::new(RoleCache::default()),
            query: Arc::new(QueryPool::new(None, 1, Duration::from_secs(1))),
            threads: HookThreads::new(),
            reconnects: Default::default(),
        });
        LuaEngine::load(settings, services)
    }

    async fn run(engine: &Arc<LuaEngine>) -> Result<(), HookError> {
        engine
            .call(
                0,
                Event::AuthAttempt,
                None,
                None,
                |_| Ok(None),
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
            "function auth_attempt(ctx) coroutine.wrap(function() while true do end end)() end",
            // A coroutine made before the call, at the top level, and one
            // made by a coroutine.
            "local co = coroutine.create(function() while true do end end)\nfunction auth_attempt(ctx) coroutine.resume(co) end",
            "function auth_attempt(ctx) coroutine.wrap(function() coroutine.wrap(function() while true do end end)() end)() end",
            // Lua called back from C.
            "function auth_attempt(ctx) string.gsub('abc', '%w', function() while true do end end) end",
        ] {
            let e = engine(code, 100, 8);
            let started = Instant::now();
            assert_eq!(run(&e).await, Err(HookError::Timeout), "{code}");
            assert!(started.elapsed() < Duration::from_secs(2), "{code}");
            // Stopped by the budget: a thread set aside at the deadline
            // (a busy machine can be late) returns, and none stays stuck.
            let waited = Instant::now();
            while e.services.threads.stuck() > 0 && waited.elapsed() < Duration::from_secs(10) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            assert_eq!(e.services.threads.stuck(), 0, "{code}");
        }
    }

    #[tokio::test]
    async fn coroutine_wrap_behaves_as_lua_s() {
        let e = engine(
            r#"
function auth_attempt(ctx)
  local gen = coroutine.wrap(function(a) local b = coroutine.yield(a + 1) return b * 2 end)
  assert(gen(1) == 2)
  assert(gen(5) == 10)
  local ok, err = pcall(gen)
  assert(not ok and err:find("cannot resume dead coroutine", 1, true), err)
  local failing = coroutine.wrap(function() error("inner") end)
  ok, err = pcall(failing)
  assert(not ok and err:find("inner", 1, true), err)
  local t = {}
  ok, err = pcall(coroutine.wrap(function() error(t) end))
  assert(not ok and err == t)
end
"#,
            1000,
            8,
        );
        assert_eq!(run(&e).await, Ok(()));
    }

    #[tokio::test]
    async fn a_memory_bomb_is_stopped() {
        let e = engine("function auth_attempt(ctx) local t = {} for i = 1, 1e9 do t[i] = string.rep('x', 4096) .. i end end", 5000, 8);
        assert_eq!(run(&e).await, Err(HookError::Memory));
        // The next call gets a fresh VM.
        assert_eq!(run(&e).await, Err(HookError::Memory));
    }

    #[test]
    fn a_top_level_that_runs_away_fails_the_load_naming_the_file() {
        for (code, timeout_ms, what) in [
            (
                "while true do end",
                100,
                "ran past the time budget (hooks.timeout_ms)",
            ),
            (
                "while true do pcall(function() while true do end end) end",
                100,
                "ran past the time budget (hooks.timeout_ms)",
            ),
            (
                "local t = {} for i = 1, 1e9 do t[i] = string.rep('x', 4096) .. i end",
                5000,
                "exceeded the memory limit (hooks.memory_limit_mb)",
            ),
        ] {
            let errors = load(code, timeout_ms, 8).err().expect(code);
            assert_eq!(errors.len(), 1, "{code}");
            assert!(errors[0].file.ends_with("10-test.lua"), "{errors:?}");
            assert!(errors[0].message.contains(what), "{code}: {errors:?}");
        }
    }

    #[tokio::test]
    async fn hooks_run_on_hook_threads() {
        let e = engine("function auth_attempt(ctx) end", 1000, 8);
        let thread = e
            .call(
                0,
                Event::AuthAttempt,
                None,
                None,
                |_| {
                    assert_eq!(std::thread::current().name(), Some("usher-hook"));
                    Ok(None)
                },
                |_, _| Ok(std::thread::current().name().map(str::to_string)),
            )
            .await;
        assert_eq!(thread, Ok(Some("usher-hook".to_string())));
    }

    #[tokio::test]
    async fn finalizers_are_refused() {
        let e = engine(
            "function auth_attempt(ctx) setmetatable({}, { __gc = function() end }) end",
            1000,
            8,
        );
        let Err(HookError::Failed(m)) = run(&e).await else {
            panic!()
        };
        assert!(m.contains("hooks may not set __gc finalizers"), "{m}");
        // Other metatables are fine, and so is a __gc added later (Lua
        // never runs it).
        let e = engine(
            "function auth_attempt(ctx) local mt = { __index = {} }; setmetatable({}, mt); mt.__gc = error end",
            1000,
            8,
        );
        assert_eq!(run(&e).await, Ok(()));
        let errors = load("setmetatable({}, { __gc = print })", 1000, 8)
            .err()
            .unwrap();
        assert!(errors[0].message.contains("__gc"), "{errors:?}");
    }

    #[tokio::test]
    async fn vars_past_their_bound_are_a_hook_error_and_not_kept() {
        let mut vars = super::super::Vars::new();
        for code in [
            "function client_connection(ctx) ctx.vars.big = string.rep('x', 101) end",
            "function client_connection(ctx) for i = 1, 20 do ctx.vars['k' .. i] = i end end",
            // Through the encoder (a float).
            "function client_connection(ctx) for i = 1, 20 do ctx.vars['k' .. i] = i + 0.5 end end",
        ] {
            let (r, _) = connect(&hook(code), &client(), &mut vars).await;
            assert_eq!(
                r,
                Err(HookError::Failed(
                    "runtime error: ctx.vars holds more than 100 bytes (hooks.vars_max_bytes); they are not kept"
                        .into()
                )),
                "{code}"
            );
            assert!(vars.is_empty(), "{code}");
        }
        let code = "function client_connection(ctx) ctx.vars.fits = string.rep('x', 96) end";
        let (r, _) = connect(&hook(code), &client(), &mut vars).await;
        assert_eq!((r, vars.len()), (Ok(()), 1));
    }

    fn client() -> super::super::ClientInfo {
        super::super::ClientInfo {
            id: 42,
            user: "alice".into(),
            database: "app".into(),
            application_name: "psql".into(),
            startup: vec![
                ("user".to_string(), "alice".to_string()),
                ("options".to_string(), String::new()),
                ("application_name".to_string(), "psql".to_string()),
            ]
            .into(),
            addr: crate::client_addr::ClientAddr::Tcp("10.1.2.3:5000".parse().unwrap()),
            tls: None,
            auth_method: "scram-sha-256",
            pool_mode: crate::config::PoolMode::Transaction,
        }
    }

    /// What one client_connection call of the first hook decided.
    async fn connect(
        hook: &Arc<dyn Hook>,
        client: &super::super::ClientInfo,
        vars: &mut super::super::Vars,
    ) -> (Result<(), HookError>, ConnectionCtx<'static>) {
        let mut ctx = ConnectionCtx {
            client: Box::leak(Box::new(client.clone())),
            vars: Box::leak(Box::new(vars.clone())),
            reject: None,
            params: vec![],
            notices: vec![],
            route: None,
        };
        let r = hook.client_connection(&mut ctx).await;
        *vars = ctx.vars.clone();
        (r, ctx)
    }

    /// What one session_start call of the first hook decided.
    async fn start(
        hook: &Arc<dyn Hook>,
        client: &super::super::ClientInfo,
        vars: &mut super::super::Vars,
        server: Option<super::super::ServerInfo>,
    ) -> (Result<(), HookError>, SessionCtx<'static>) {
        let mut ctx = SessionCtx {
            client: Box::leak(Box::new(client.clone())),
            vars: Box::leak(Box::new(vars.clone())),
            reason: super::super::SessionReason::DiscardAll,
            server,
            params: vec![],
            exec: vec![],
            notices: vec![],
            warnings: vec![],
        };
        let r = hook.session_start(&mut ctx).await;
        *vars = ctx.vars.clone();
        (r, ctx)
    }

    fn hook(code: &str) -> Arc<dyn Hook> {
        engine(code, 1000, 8).hooks().remove(0)
    }

    fn set(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[tokio::test]
    async fn ctx_shows_every_client_field() {
        let h = hook(
            r#"
function client_connection(ctx)
  local parts = {}
  for _, k in ipairs({ "event", "id", "user", "database", "application_name", "client_addr",
                       "client_port", "auth_method", "pool_mode", "tls", "reason" }) do
    parts[#parts + 1] = k .. "=" .. tostring(ctx[k]) .. ":" .. (math.type(ctx[k]) or type(ctx[k]))
  end
  ctx:set("fields", table.concat(parts, " "))
  local keys = {}
  for k, v in pairs(ctx.startup) do keys[#keys + 1] = k .. "=" .. v end
  table.sort(keys)
  ctx:set("startup", table.concat(keys, ","))
  ctx:set("vars", tostring(next(ctx.vars)))
  ctx:set("type", type(ctx))
end
function session_start(ctx)
  ctx:set("reason", ctx.reason)
  ctx:set("server", tostring(ctx.server and ctx.server.backend_pid) .. "/" ..
    tostring(ctx.server and ctx.server.server_version) .. "/" .. tostring(ctx.server and ctx.server.fresh))
end
"#,
        );
        let mut tls = client();
        tls.tls = Some(Box::new(super::super::TlsInfo {
            version: "TLSv1.3".into(),
            cipher: "TLS13_AES_256_GCM_SHA384".into(),
            client_cert_subject: None,
        }));
        let mut vars = super::super::Vars::new();
        let (r, ctx) = connect(&h, &client(), &mut vars).await;
        assert_eq!(r, Ok(()));
        assert_eq!(
            ctx.params,
            set(&[
                ("fields", "event=client_connection:string id=42:integer user=alice:string database=app:string application_name=psql:string client_addr=10.1.2.3:string client_port=5000:integer auth_method=scram-sha-256:string pool_mode=transaction:string tls=nil:nil reason=nil:nil"),
                ("startup", "application_name=psql,options=,user=alice"),
                ("vars", "nil"),
                ("type", "table"),
            ])
        );
        let h2 = hook("function client_connection(ctx) ctx:set('tls', ctx.tls.version .. '/' .. ctx.tls.cipher .. '/' .. tostring(ctx.tls.client_cert_subject)) end");
        let (_, ctx) = connect(&h2, &tls, &mut vars).await;
        assert_eq!(
            ctx.params,
            set(&[("tls", "TLSv1.3/TLS13_AES_256_GCM_SHA384/nil")])
        );
        let server = super::super::ServerInfo {
            backend_pid: 777,
            server_version: "17.2".into(),
            fresh: false,
        };
        let (_, ctx) = start(&h, &client(), &mut vars, Some(server)).await;
        assert_eq!(
            ctx.params,
            set(&[("reason", "discard_all"), ("server", "777/17.2/false")])
        );
        let (_, ctx) = start(&h, &client(), &mut vars, None).await;
        assert_eq!(
            ctx.params,
            set(&[("reason", "discard_all"), ("server", "nil/nil/nil")])
        );
    }

    #[tokio::test]
    async fn decisions_come_back_in_order() {
        let h = hook(
            r#"
function client_connection(ctx)
  ctx:set("a", 1)
  ctx:notice("first")
  ctx:set("b", true)
  ctx:notice(2.5)
  ctx:reject("not this one")
  ctx:reject("go away", { sqlstate = "42501", detail = "d", hint = 7 })
end
function session_start(ctx)
  ctx:set("search_path", "x, public")
  ctx:notice("hello")
end
"#,
        );
        let mut vars = super::super::Vars::new();
        let (r, ctx) = connect(&h, &client(), &mut vars).await;
        assert_eq!(r, Ok(()));
        assert_eq!(ctx.params, set(&[("a", "1"), ("b", "true")]));
        assert_eq!(ctx.notices, ["first", "2.5"]);
        let reject = ctx.reject.unwrap();
        assert_eq!(
            (
                reject.message.as_str(),
                reject.sqlstate.as_str(),
                reject.detail.as_deref(),
                reject.hint.as_deref(),
                reject.hook.as_str()
            ),
            ("go away", "42501", Some("d"), Some("7"), "10-test.lua")
        );
        let (r, ctx) = start(&h, &client(), &mut vars, None).await;
        assert_eq!(r, Ok(()));
        assert_eq!(ctx.params, set(&[("search_path", "x, public")]));
        assert_eq!(ctx.notices, ["hello"]);
        let h = hook("function client_connection(ctx) ctx:reject('no') end");
        let (_, ctx) = connect(&h, &client(), &mut vars).await;
        let reject = ctx.reject.unwrap();
        assert_eq!(
            (reject.sqlstate.as_str(), reject.detail, reject.hint),
            ("28000", None, None)
        );
    }

    #[tokio::test]
    async fn a_route_comes_back_once_and_misuse_is_an_error() {
        let h = hook(
            r#"
function client_connection(ctx)
  ctx:route{ database = "app", hosts = { "10.1.0.7", "shard-b:5433" }, port = 6432,
    dbname = "t42", user = "alice", pool_size = 4, pool_mode = "session" }
end
"#,
        );
        let mut vars = super::super::Vars::new();
        let (r, ctx) = connect(&h, &client(), &mut vars).await;
        assert_eq!(r, Ok(()));
        let (route, by) = ctx.route.unwrap();
        assert_eq!(by, "10-test.lua");
        let hosts: Vec<_> = route
            .hosts
            .iter()
            .map(|h| (h.host.as_str(), h.port))
            .collect();
        assert_eq!(hosts, [("10.1.0.7", None), ("shard-b", Some(5433))]);
        assert_eq!(
            (
                route.database.as_deref(),
                route.port,
                route.dbname.as_deref(),
                route.user.as_deref(),
                route.pool_size,
                route.pool_mode
            ),
            (
                Some("app"),
                Some(6432),
                Some("t42"),
                Some("alice"),
                Some(4),
                Some(crate::config::PoolMode::Session)
            )
        );
        let h = hook("function client_connection(ctx) ctx:route{ host = 'h' } end");
        let (r, ctx) = connect(&h, &client(), &mut vars).await;
        assert_eq!(r, Ok(()));
        let route = ctx.route.unwrap().0;
        assert_eq!(
            (route.hosts.len(), route.database, route.user),
            (1, None, None)
        );
        for (code, wanted) in [
            (
                "ctx:route{ host = 'a' }\n  ctx:route{ host = 'b' }",
                "ctx:route may be called once per client",
            ),
            ("ctx:route('a')", "ctx:route: expected a table"),
            ("ctx:route{ hots = 'a' }", "ctx:route: unknown key hots"),
            (
                "ctx:route{ port = 0 }",
                "port must be an integer from 1 to 65535",
            ),
            (
                "ctx:route{ port = 1.5 }",
                "port must be an integer from 1 to 65535",
            ),
            (
                "ctx:route{ pool_mode = 'statement' }",
                "pool_mode must be session or transaction",
            ),
            (
                "ctx:route{ host = 'a', hosts = { 'b' } }",
                "host and hosts are exclusive",
            ),
            ("ctx:route{ host = 'a,b' }", "host must be one host"),
            (
                "ctx:route{ host = 'a:0' }",
                "ctx:route: host: expected a port",
            ),
        ] {
            let code = format!("function client_connection(ctx)\n  {code}\nend");
            let (r, ctx) = connect(&hook(&code), &client(), &mut vars).await;
            let Err(HookError::Failed(m)) = r else {
                panic!("{code}: {r:?}")
            };
            assert!(m.contains(wanted), "{code}: {m}");
            if wanted.contains("once") {
                assert!(m.contains("10-test.lua:3:"), "{m}");
                assert!(ctx.route.is_none());
            }
        }
        // Another event: an error naming the line.
        let h = hook("function session_start(ctx)\n  ctx:route{ host = 'a' }\nend");
        let (r, _) = start(&h, &client(), &mut vars, None).await;
        let Err(HookError::Failed(m)) = r else {
            panic!()
        };
        assert!(
            m.ends_with("10-test.lua:2: ctx:route is not available in session_start"),
            "{m}"
        );
    }

    #[tokio::test]
    async fn vars_follow_the_client_between_events() {
        use super::super::VarValue;
        let h = hook(
            r#"
function client_connection(ctx)
  ctx.vars.s = "text"
  ctx.vars.i = 41 + 1
  ctx.vars.n = 0.1 + 0.2
  ctx.vars.big = 2^53
  ctx.vars.b = false
  ctx.vars[7] = "seven"
end
function session_start(ctx)
  ctx:set("check", tostring(ctx.vars.n == 0.3) .. " " .. math.type(ctx.vars.i) .. " " ..
    math.type(ctx.vars.n) .. " " .. tostring(ctx.vars.b) .. " " .. tostring(ctx.vars["7"]) .. " " ..
    tostring(ctx.vars.big))
  ctx.vars.i = ctx.vars.i + 1
  ctx.vars.s = nil
end
"#,
        );
        let mut vars = super::super::Vars::new();
        vars.insert("old".into(), VarValue::Str("gone".into()));
        let (r, _) = connect(&h, &client(), &mut vars).await;
        assert_eq!(r, Ok(()));
        assert_eq!(
            vars,
            [
                ("7".to_string(), VarValue::Str("seven".into())),
                ("b".to_string(), VarValue::Bool(false)),
                ("big".to_string(), VarValue::Num(9007199254741000.0)), // through "%.14g"
                ("i".to_string(), VarValue::Int(42)),
                ("n".to_string(), VarValue::Num(0.3)),
                ("old".to_string(), VarValue::Str("gone".into())),
                ("s".to_string(), VarValue::Str("text".into())),
            ]
            .into_iter()
            .collect()
        );
        let (r, ctx) = start(&h, &client(), &mut vars, None).await;
        assert_eq!(r, Ok(()));
        assert_eq!(
            ctx.params,
            set(&[("check", "true integer float false seven 9007199254741000")])
        );
        assert_eq!(vars.get("i"), Some(&VarValue::Int(43)));
        assert_eq!(vars.get("s"), None);
        assert_eq!(vars.len(), 6);
    }

    #[tokio::test]
    async fn vars_a_hook_never_read_are_kept() {
        use super::super::VarValue;
        let mut vars = super::super::Vars::new();
        vars.insert("team".into(), VarValue::Str("payments".into()));
        for code in [
            "function client_connection(ctx) end",
            "function client_connection(ctx) ctx:set('a', 'b') end",
            // Assigned without being read: ignored, as before.
            "function client_connection(ctx) ctx.vars = { other = 1 } end",
            "function client_connection(ctx) local u = ctx.user end",
        ] {
            let (r, _) = connect(&hook(code), &client(), &mut vars).await;
            assert_eq!(r, Ok(()), "{code}");
            assert_eq!(vars.len(), 1, "{code}");
        }
        let code = "function client_connection(ctx) local u = ctx.user; ctx.vars = nil end";
        let (r, _) = connect(&hook(code), &client(), &mut vars).await;
        assert_eq!(r, Ok(()));
        assert!(vars.is_empty());
    }

    #[tokio::test]
    async fn misuse_of_ctx_is_an_error_naming_the_line() {
        let cases = [
            (
                "function session_start(ctx)\n  ctx:reject('no')\nend",
                "[string \"/",
            ),
            (
                "function session_start(ctx)\n  ctx:exec('SELECT 1')\nend",
                "ctx:exec is only available in session mode",
            ),
            (
                "function client_connection(ctx)\n  ctx:reject('no', { sqlstate = 'x' })\nend",
                "ctx:reject: sqlstate must be five characters 0-9/A-Z, got x",
            ),
            (
                "function client_connection(ctx)\n  error('plain', 2)\nend",
                "plain",
            ),
            ("function client_connection(ctx)\n  error({})\nend", ""),
        ];
        let mut vars = super::super::Vars::new();
        for (code, _) in cases {
            let h = hook(code);
            let r = if code.contains("session_start") {
                start(&h, &client(), &mut vars, None).await.0
            } else {
                connect(&h, &client(), &mut vars).await.0
            };
            let Err(HookError::Failed(message)) = r else {
                panic!("{code}: {r:?}")
            };
            eprintln!("{code}: {message}");
        }
        let h = hook("function session_start(ctx)\n  ctx:reject('no')\nend");
        let (r, _) = start(&h, &client(), &mut vars, None).await;
        let Err(HookError::Failed(m)) = r else {
            panic!()
        };
        assert!(
            m.ends_with("10-test.lua:2: ctx:reject is not available in session_start"),
            "{m}"
        );
        let h = hook("function client_connection(ctx)\n  error('plain', 2)\nend");
        let (r, _) = connect(&h, &client(), &mut vars).await;
        assert_eq!(r, Err(HookError::Failed("runtime error: plain".into())));
        let h = hook("function client_connection(ctx) ctx.vars.t = {} end");
        let (r, _) = connect(&h, &client(), &mut vars).await;
        let Err(HookError::Failed(m)) = r else {
            panic!()
        };
        eprintln!("bad var: {m:?}");
        assert!(
            m.contains("ctx.vars.t: only strings, numbers and booleans are kept, got table"),
            "{m}"
        );
    }

    #[tokio::test]
    async fn a_ctx_kept_past_its_call_still_reads_but_decides_nothing() {
        let h = hook(
            r#"
local kept
function client_connection(ctx)
  if kept == nil then kept = ctx return end
  kept:set("late", "x")
  kept:notice("late")
  ctx:set("user_of_kept", kept.user)
end
"#,
        );
        let mut vars = super::super::Vars::new();
        let (r, ctx) = connect(&h, &client(), &mut vars).await;
        assert_eq!((r, ctx.params.len()), (Ok(()), 0));
        let mut bob = client();
        bob.user = "bob".into();
        let (r, ctx) = connect(&h, &bob, &mut vars).await;
        assert_eq!(r, Ok(()));
        assert_eq!(ctx.params, set(&[("user_of_kept", "alice")]));
        assert!(ctx.notices.is_empty());
    }

    #[tokio::test]
    async fn many_decisions_keep_their_order() {
        let h = hook(
            r#"
function client_connection(ctx)
  for i = 1, 3000 do ctx:set("p" .. i, string.rep("v", i % 7)) end
  for i = 1, 500 do ctx:notice("n" .. i) end
  ctx:reject("last", { detail = string.rep("d", 5000) })
end
"#,
        );
        let mut vars = super::super::Vars::new();
        let (r, ctx) = connect(&h, &client(), &mut vars).await;
        assert_eq!(r, Ok(()));
        assert_eq!(ctx.params.len(), 3000);
        for (i, (k, v)) in ctx.params.iter().enumerate() {
            let n = i + 1;
            assert_eq!((k.clone(), v.len()), (format!("p{n}"), n % 7));
        }
        let notices: Vec<String> = (1..=500).map(|i| format!("n{i}")).collect();
        assert_eq!(ctx.notices, notices);
        let reject = ctx.reject.unwrap();
        assert_eq!(
            (reject.message.as_str(), reject.detail.map(|d| d.len())),
            ("last", Some(5000))
        );
    }

    #[tokio::test]
    async fn exec_in_session_mode_and_vars_with_a_metatable() {
        use super::super::VarValue;
        let h = hook(
            r#"
function session_start(ctx)
  ctx:exec("SET x = 1")
  ctx:set("a", "b")
  ctx:exec(42)
  ctx.vars = setmetatable({ k = "v", f = 1.5 }, { __index = function() return "dflt" end })
  ctx:notice(ctx.vars.missing)
end
"#,
        );
        let mut c = client();
        c.pool_mode = crate::config::PoolMode::Session;
        let mut vars = super::super::Vars::new();
        let (r, ctx) = start(&h, &c, &mut vars, None).await;
        assert_eq!(r, Ok(()));
        assert_eq!(ctx.exec, ["SET x = 1", "42"]);
        assert_eq!(ctx.params, set(&[("a", "b")]));
        assert_eq!(ctx.notices, ["dflt"]);
        assert_eq!(
            vars,
            [
                ("f".to_string(), VarValue::Num(1.5)),
                ("k".to_string(), VarValue::Str("v".into()))
            ]
            .into_iter()
            .collect()
        );
    }

    #[tokio::test]
    async fn a_hook_may_replace_its_handler() {
        let h = hook(
            r#"
function client_connection(ctx)
  ctx:set("which", "first")
  client_connection = function(ctx) ctx:set("which", "second") end
end
"#,
        );
        let mut vars = super::super::Vars::new();
        let (_, ctx) = connect(&h, &client(), &mut vars).await;
        assert_eq!(ctx.params, set(&[("which", "first")]));
        let (_, ctx) = connect(&h, &client(), &mut vars).await;
        assert_eq!(ctx.params, set(&[("which", "second")]));
        let h = hook("function client_connection(ctx) client_connection = nil end");
        assert_eq!(connect(&h, &client(), &mut vars).await.0, Ok(()));
        assert_eq!(
            connect(&h, &client(), &mut vars).await.0,
            Err(HookError::Failed("no client_connection handler".into()))
        );
    }

    #[tokio::test]
    async fn clients_taking_turns_on_one_vm_see_their_own_fields() {
        let h = hook("function client_connection(ctx) ctx:set('who', ctx.user .. '@' .. ctx.client_addr .. ':' .. ctx.client_port) end");
        let mut bob = client();
        bob.user = "bob".into();
        bob.addr = crate::client_addr::ClientAddr::Tcp("[::1]:6000".parse().unwrap());
        // A client of the Unix-domain socket: `unix` and the socket's port.
        let mut carol = client();
        carol.user = "carol".into();
        carol.addr = crate::client_addr::ClientAddr::Local(crate::client_addr::LocalPeer {
            uid: 1000,
            gid: 1000,
            pid: Some(4242),
            port: 6432,
        });
        let mut vars = super::super::Vars::new();
        for (c, who) in [
            (&carol, "carol@unix:6432"),
            (&bob, "bob@::1:6000"),
            (&client(), "alice@10.1.2.3:5000"),
            (&client(), "alice@10.1.2.3:5000"),
            (&bob, "bob@::1:6000"),
        ] {
            let (_, ctx) = connect(&h, c, &mut vars).await;
            assert_eq!(ctx.params, set(&[("who", who)]));
        }
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
