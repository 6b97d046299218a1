//! One sandboxed Lua VM with every hook file loaded.
//!
//! The sandbox offers string, table, math, utf8, coroutine, a few os
//! functions (time, clock, date, difftime), the `usher` API and a `require`
//! that loads text files from the hooks folder only. There is no io, no
//! os.execute/remove/rename/exit/getenv, no debug, no load/loadfile/dofile
//! and no bytecode, and no `__gc` finalizers. Each call, and the files' top
//! level when a VM is built, runs under a time budget, enforced by an
//! instruction-count hook that the watchdog arms on a call that runs long
//! ([`super::watchdog`]), and the VM under a memory limit.

use super::api;
use super::ctx_route;
use super::watchdog::{self, MainState, Watched};
use super::LuaServices;
use crate::hooks::{Event, SessionReason};
use mlua::chunk::ChunkMode;
use mlua::{Function, Lua, LuaOptions, LuaString, StdLib, Table, Value};
use parking_lot::Mutex;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// The deadline of the call running in a VM: checked by the instruction
/// hook (CPU) and used as the timeout of awaited calls (usher.query).
pub(super) struct Budget {
    deadline: Mutex<Option<Instant>>,
    exceeded: AtomicBool,
}

impl Budget {
    fn new() -> Self {
        Budget {
            deadline: Mutex::new(None),
            exceeded: AtomicBool::new(false),
        }
    }

    pub(super) fn start(&self, deadline: Instant) {
        *self.deadline.lock() = Some(deadline);
        self.exceeded.store(false, Ordering::Relaxed);
    }

    pub(super) fn stop(&self) {
        *self.deadline.lock() = None;
    }

    fn deadline(&self) -> Option<Instant> {
        *self.deadline.lock()
    }

    /// Whether the call is past its deadline (and if so, marks the budget
    /// spent). The count hook's check.
    pub(super) fn past_deadline(&self) -> bool {
        let past = self.deadline.lock().is_some_and(|d| Instant::now() >= d);
        if past {
            self.exceed();
        }
        past
    }

    pub(super) fn was_exceeded(&self) -> bool {
        self.exceeded.load(Ordering::Relaxed)
    }

    /// Marks the budget spent.
    fn exceed(&self) {
        self.exceeded.store(true, Ordering::Relaxed);
    }
}

thread_local! {
    /// The runtime of the call running on this thread (set by
    /// [`CallRuntime::enter`]): awaited calls (usher.query) run there.
    static CALL_RUNTIME: std::cell::Cell<*const tokio::runtime::Handle> =
        const { std::cell::Cell::new(std::ptr::null()) };
}

/// While alive, the hook call on this thread may await on `runtime`.
pub(super) struct CallRuntime<'a> {
    previous: *const tokio::runtime::Handle,
    _runtime: std::marker::PhantomData<&'a tokio::runtime::Handle>,
}

impl<'a> CallRuntime<'a> {
    pub(super) fn enter(runtime: &'a tokio::runtime::Handle) -> CallRuntime<'a> {
        let previous = CALL_RUNTIME.replace(runtime);
        CallRuntime {
            previous,
            _runtime: std::marker::PhantomData,
        }
    }
}

impl Drop for CallRuntime<'_> {
    fn drop(&mut self) {
        CALL_RUNTIME.set(self.previous);
    }
}

/// Runs an awaited call (a query) to its end within what is left of the
/// hook's budget, blocking this hook thread (never a runtime worker: hook
/// calls are plain calls on hook threads, so a handler that never awaits
/// pays nothing for one that might).
pub(super) fn await_within_budget<T>(
    lua: &Lua,
    what: &str,
    call: impl std::future::Future<Output = mlua::Result<T>>,
) -> mlua::Result<T> {
    let runtime = CALL_RUNTIME.get();
    if runtime.is_null() {
        return Err(mlua::Error::runtime(format!(
            "{what} is available in handlers only, not at a file's top level"
        )));
    }
    // SAFETY: set by a CallRuntime guard that borrows the handle and lives
    // for the whole call, which is running on this thread.
    let runtime = unsafe { &*runtime };
    let deadline = lua.app_data_ref::<Arc<Budget>>().and_then(|b| b.deadline());
    let Some(deadline) = deadline else {
        return runtime.block_on(call);
    };
    match runtime.block_on(async { tokio::time::timeout_at(deadline.into(), call).await }) {
        Ok(r) => r,
        Err(_) => {
            if let Some(b) = lua.app_data_ref::<Arc<Budget>>() {
                b.exceed();
            }
            Err(mlua::Error::runtime("hook exceeded its time budget"))
        }
    }
}

/// A hook file's source.
#[derive(Debug, Clone)]
pub struct HookSource {
    /// The file name, e.g. `10-search-path.lua`: the hook's name.
    pub name: String,
    pub path: PathBuf,
    pub code: String,
}

/// Why a VM could not be built: a hook file's top level failed or ran out
/// of its budget (`file` names it), or usher's own set-up failed.
#[derive(Debug)]
pub(super) struct VmError {
    /// The hook file (its path) whose top level failed.
    pub file: Option<String>,
    /// The top level ran past its time budget or memory limit.
    pub overran: Option<Overran>,
    pub message: String,
}

/// Which budget code ran out of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Overran {
    Time,
    Memory,
}

impl VmError {
    fn setup(what: &str, e: mlua::Error) -> VmError {
        VmError {
            file: None,
            overran: None,
            message: format!("{what}: {e}"),
        }
    }

    /// A hook file's top level failed: `e`, or the budget it ran out of.
    fn file(source: &HookSource, budget: &Budget, e: mlua::Error) -> VmError {
        let overran = if budget.was_exceeded() {
            Some(Overran::Time)
        } else if super::is_memory_error(&e) {
            Some(Overran::Memory)
        } else {
            None
        };
        let message = match overran {
            Some(Overran::Time) => {
                "its top-level code ran past the time budget (hooks.timeout_ms)".to_string()
            }
            Some(Overran::Memory) => {
                "its top-level code exceeded the memory limit (hooks.memory_limit_mb)".to_string()
            }
            None => e.to_string(),
        };
        VmError {
            file: Some(source.path.display().to_string()),
            overran,
            message,
        }
    }
}

impl std::fmt::Display for VmError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.file {
            Some(file) => write!(f, "{file}: {}", self.message),
            None => f.write_str(&self.message),
        }
    }
}

/// A VM and, per hook file, the environment its globals (handlers) live in.
pub(super) struct Vm {
    pub lua: Lua,
    pub files: Vec<Table>,
    /// The prelude's call wrapper, its record of the call in progress and
    /// its vars encoder (see prelude.lua).
    pub run: Function,
    pub state: Table,
    pub encode_vars: Function,
    /// What `run` returns when the file has no handler for the event.
    pub no_handler: Table,
    /// The time budget of the call running (also the VM's app data, for
    /// awaited calls).
    pub budget: Arc<Budget>,
    /// Strings passed or looked up on every call, made once.
    pub names: Names,
    /// The main Lua thread, which the watchdog's signal arms.
    pub main: MainState,
}

/// Lua strings the engine uses on every call.
pub(super) struct Names {
    /// Per [`Event`] (its index).
    pub events: [LuaString; 4],
    /// Per [`SessionReason`].
    pub reasons: [LuaString; 3],
    pub vars: LuaString,
}

impl Names {
    fn new(lua: &Lua) -> mlua::Result<Names> {
        let s = |text: &str| lua.create_string(text);
        Ok(Names {
            events: [
                s(Event::AuthAttempt.name())?,
                s(Event::ClientConnection.name())?,
                s(Event::SessionStart.name())?,
                s(Event::SessionEnd.name())?,
            ],
            reasons: [
                s(SessionReason::NewSession.as_str())?,
                s(SessionReason::DiscardAll.as_str())?,
                s(SessionReason::ReusedServer.as_str())?,
            ],
            vars: s("vars")?,
        })
    }

    pub fn reason(&self, reason: SessionReason) -> &LuaString {
        &self.reasons[match reason {
            SessionReason::NewSession => 0,
            SessionReason::DiscardAll => 1,
            SessionReason::ReusedServer => 2,
        }]
    }
}

impl Vm {
    /// Builds a VM and runs every hook file's top level in it, under the
    /// memory limit and within `deadline` (one budget for them all). An
    /// error names the file.
    pub fn new(
        sources: &[HookSource],
        dir: &Path,
        memory_limit: usize,
        services: Arc<LuaServices>,
        deadline: Instant,
    ) -> Result<Vm, VmError> {
        let setup = |e| VmError::setup("building the sandbox", e);
        let lua = Lua::new_with(
            StdLib::TABLE
                | StdLib::STRING
                | StdLib::MATH
                | StdLib::UTF8
                | StdLib::COROUTINE
                | StdLib::OS,
            LuaOptions::new(),
        )
        .map_err(setup)?;
        // The time budget: its count hook is armed by the watchdog (see
        // watchdog.rs) on a call that runs long.
        let budget = Arc::new(Budget::new());
        lua.set_app_data(budget.clone());
        let main = watchdog::main_state(&lua).map_err(setup)?;
        let base = sandbox(&lua, dir, services).map_err(setup)?;
        // ctx:route's reader, and the reason for its refusal (ctx_route.rs).
        // SAFETY: read_route is a C function that follows Lua's protocol.
        let read_route = unsafe { lua.create_c_function(ctx_route::read_route) };
        let route_refusal = lua.create_function(|_, ()| Ok(ctx_route::refusal()));
        let route_functions = read_route
            .and_then(|r| Ok((r, route_refusal?)))
            .map_err(|e| VmError::setup("prelude", e))?;
        let (_ctx_meta, state, run, encode_vars, no_handler): (
            Table,
            Table,
            Function,
            Function,
            Table,
        ) = lua
            .load(include_str!("prelude.lua"))
            .set_name("=usher prelude")
            .set_environment(base.clone())
            .call(route_functions)
            .map_err(|e| VmError::setup("prelude", e))?;
        let names = Names::new(&lua).map_err(|e| VmError::setup("prelude", e))?;
        // After the prelude, which keeps the plain setmetatable.
        guard_finalizers(&lua, &base).map_err(setup)?;
        // The memory limit bounds what hooks allocate, from their top level
        // on, rather than usher's own set-up; so does the time budget.
        lua.set_memory_limit(lua.used_memory() + memory_limit)
            .map_err(setup)?;
        let mut files = Vec::with_capacity(sources.len());
        budget.start(deadline);
        let watched = Watched::start(
            main,
            &budget,
            deadline.saturating_duration_since(Instant::now()),
        );
        for source in sources {
            let env = (|| -> mlua::Result<Table> {
                let env = lua.create_table()?;
                let meta = lua.create_table()?;
                meta.set("__index", base.clone())?;
                env.set_metatable(Some(meta))?;
                lua.load(&source.code)
                    .set_name(format!("@{}", source.path.display()))
                    .set_mode(ChunkMode::Text)
                    .set_environment(env.clone())
                    .exec()?;
                Ok(env)
            })()
            .map_err(|e| VmError::file(source, &budget, e))?;
            files.push(env);
        }
        drop(watched);
        budget.stop();
        Ok(Vm {
            lua,
            files,
            run,
            state,
            encode_vars,
            no_handler,
            names,
            budget,
            main,
        })
    }

    /// The handler of `event` in file `index`, if the file defines one: its
    /// global of that name now (a hook may replace its handlers).
    pub fn handler(&self, index: usize, event: Event) -> Option<Function> {
        let name = &self.names.events[event as usize];
        match self.files.get(index)?.raw_get::<Value>(name) {
            Ok(Value::Function(f)) => Some(f),
            _ => None,
        }
    }
}

/// The global environment hook files see.
fn sandbox(lua: &Lua, dir: &Path, services: Arc<LuaServices>) -> mlua::Result<Table> {
    let globals = lua.globals();
    let base = lua.create_table()?;
    for name in [
        "assert",
        "error",
        "ipairs",
        "next",
        "pairs",
        "pcall",
        "rawequal",
        "rawget",
        "rawlen",
        "rawset",
        "select",
        "setmetatable",
        "getmetatable",
        "tonumber",
        "tostring",
        "type",
        "xpcall",
        "_VERSION",
        "string",
        "table",
        "math",
        "utf8",
        "coroutine",
    ] {
        base.set(name, globals.get::<Value>(name)?)?;
    }
    let string: Table = globals.get("string")?;
    string.set("dump", Value::Nil)?; // bytecode
    let os_full: Table = globals.get("os")?;
    let os = lua.create_table()?;
    for name in ["time", "clock", "date", "difftime"] {
        os.set(name, os_full.get::<Value>(name)?)?;
    }
    base.set("os", os)?;
    let usher = api::usher_table(lua, services)?;
    base.set("print", usher.get::<Function>("_print")?)?;
    base.set("usher", usher)?;
    base.set(
        "require",
        require_function(lua, dir.to_path_buf(), base.clone())?,
    )?;
    base.set("_G", base.clone())?;
    guard_error_catchers(lua, &base)?;
    Ok(base)
}

/// pcall, xpcall and coroutine.resume catch errors, so a hook could catch
/// the budget's error and loop on. These versions rethrow it. And
/// coroutines get the budget's count hook when created (the watchdog arms
/// only the main thread): coroutine.create and coroutine.wrap are replaced
/// by versions that set it (wrap in Lua, as the C one creates its
/// coroutine where no wrapper can reach).
fn guard_error_catchers(lua: &Lua, base: &Table) -> mlua::Result<()> {
    let exceeded = lua.create_function(|lua, ()| {
        Ok(lua
            .app_data_ref::<Arc<Budget>>()
            .is_some_and(|b| b.was_exceeded()))
    })?;
    // SAFETY: a C function that only sets a debug hook on its argument.
    let watch = unsafe { lua.create_c_function(watchdog::watch_thread)? };
    let wrap: Function = lua
        .load(
            r#"
local exceeded, pcall, xpcall, resume, create, status, close, watch, type, error = ...
local function check(ok, ...)
  if not ok and exceeded() then error("hook exceeded its time budget", 0) end
  return ok, ...
end
local function guarded_resume(...) return check(resume(...)) end
local function watched_create(f)
  local co = create(f)
  watch(co)
  return co
end
-- As the C coroutine.wrap: an error in the coroutine closes it and is
-- raised again, a string with the caller's position.
local function wrapped(co, ok, ...)
  if ok then return ... end
  local e = ...
  if status(co) == "dead" then
    local closed, ce = close(co)
    if not closed then e = ce end
  end
  if type(e) == "string" then error(e, 2) end
  error(e, 0)
end
return function(...) return check(pcall(...)) end,
       function(...) return check(xpcall(...)) end,
       guarded_resume,
       watched_create,
       function(f)
         local co = watched_create(f)
         return function(...) return wrapped(co, guarded_resume(co, ...)) end
       end
"#,
        )
        .set_name("=usher budget guard")
        .into_function()?;
    let coroutine: Table = base.get("coroutine")?;
    let (pcall, xpcall, resume, create, wrap): (Function, Function, Function, Function, Function) =
        wrap.call((
            exceeded,
            base.get::<Function>("pcall")?,
            base.get::<Function>("xpcall")?,
            coroutine.get::<Function>("resume")?,
            coroutine.get::<Function>("create")?,
            coroutine.get::<Function>("status")?,
            coroutine.get::<Function>("close")?,
            watch,
            base.get::<Function>("type")?,
            base.get::<Function>("error")?,
        ))?;
    base.set("pcall", pcall)?;
    base.set("xpcall", xpcall)?;
    coroutine.set("resume", resume)?;
    coroutine.set("create", create)?;
    coroutine.set("wrap", wrap)?;
    Ok(())
}

/// A `__gc` finalizer runs inside the garbage collector, where Lua runs no
/// debug hook (so no time budget), at whatever call happens to collect,
/// and at the latest when the VM is dropped: hooks may not set one. (Lua
/// marks a table for finalization only if its metatable has `__gc` when
/// set; one added later never runs.)
fn guard_finalizers(lua: &Lua, base: &Table) -> mlua::Result<()> {
    let wrap: Function = lua
        .load(
            r#"
local setmetatable, rawget, type, error = ...
return function(t, mt)
  if type(mt) == "table" and rawget(mt, "__gc") ~= nil then
    error("setmetatable: hooks may not set __gc finalizers (they would run outside the time budget)", 2)
  end
  return setmetatable(t, mt)
end
"#,
        )
        .set_name("=usher finalizer guard")
        .into_function()?;
    let guarded: Function = wrap.call((
        base.get::<Function>("setmetatable")?,
        base.get::<Function>("rawget")?,
        base.get::<Function>("type")?,
        base.get::<Function>("error")?,
    ))?;
    base.set("setmetatable", guarded)
}

/// `require("name")` loads `<hooks dir>/name.lua` (dots become folders) as
/// text, once per VM.
fn require_function(lua: &Lua, dir: PathBuf, base: Table) -> mlua::Result<Function> {
    let loaded = lua.create_table()?;
    lua.create_function(move |lua, name: String| {
        if let Ok(v @ Value::Table(_)) = loaded.raw_get::<Value>(name.as_str()) {
            return Ok(v);
        }
        let valid = !name.is_empty()
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.')
            && !name.contains("..");
        if !valid {
            return Err(mlua::Error::runtime(format!(
                "require: invalid module name \"{name}\""
            )));
        }
        let path = dir.join(format!("{}.lua", name.replace('.', "/")));
        let code = std::fs::read_to_string(&path).map_err(|e| {
            mlua::Error::runtime(format!("require: cannot read {}: {e}", path.display()))
        })?;
        let env = lua.create_table()?;
        let meta = lua.create_table()?;
        meta.set("__index", base.clone())?;
        env.set_metatable(Some(meta))?;
        let value: Value = lua
            .load(&code)
            .set_name(format!("@{}", path.display()))
            .set_mode(ChunkMode::Text)
            .set_environment(env.clone())
            .eval()?;
        let value = match value {
            Value::Nil => Value::Table(env),
            v => v,
        };
        loaded.raw_set(name.as_str(), value.clone())?;
        Ok(value)
    })
}
