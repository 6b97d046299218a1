//! The time budget's watchdog: Lua code runs without any debug hook until
//! a call has run for a while, then the budget's count hook is armed.
//!
//! A count hook makes Lua trap on every VM instruction, which cost a
//! trivial hook call more than the rest of its Lua. Instead, each call
//! (and a VM's top level) is *watched*: the thread running it publishes
//! "in a call, number n" in its slot, and a watchdog thread looks at the
//! slots every tick (a quarter of the budget, 1 to 250 ms). A call still
//! running at the next tick gets a signal; the handler, on the thread
//! running the call, arms the count hook on the VM's main thread with
//! `lua_sethook`, which Lua documents as safe to call from a signal
//! handler (it is how the standalone interpreter stops on Ctrl-C). The
//! hook then checks the deadline every [`CHECK_EVERY`] instructions and
//! raises the budget's error past it, as it always did. The handler reads
//! only this thread's record of the VM it is running, set at the call's
//! start and cleared (then the hook removed) at its end: the watchdog
//! itself never touches a Lua state, so a VM is only ever changed by the
//! thread running it. A signal that comes late arms the next call on that
//! thread, which is harmless (the hook checks that call's deadline). A
//! call still running is signalled again after 2, 4, 8... ticks (a thread
//! set aside in a long C call is not signalled every tick for its life).
//!
//! Coroutines a hook creates always carry the count hook (set when they
//! are created, [`watch_thread`]): the signal arms the main thread only,
//! and a loop inside a coroutine resumed before it would not see it.
//!
//! The watchdog ticks while calls run and for a few ticks after, then
//! sleeps until a call starts (so a steady stream of calls wakes it only
//! at its ticks, and an idle usher not at all). Elsewhere than Linux the
//! count hook is armed at each call's start.

use super::vm::Budget;
use mlua::ffi;
use std::cell::Cell;
use std::os::raw::c_int;
use std::time::Duration;

/// Instructions between two checks of the deadline once the hook is armed.
const CHECK_EVERY: c_int = 1000;

thread_local! {
    /// The main Lua state of the VM whose call runs on this thread (null
    /// between calls): what the signal handler arms.
    static RUNNING: Cell<*mut ffi::lua_State> = const { Cell::new(std::ptr::null_mut()) };
    /// The budget of that call: what the count hook checks.
    static BUDGET: Cell<*const Budget> = const { Cell::new(std::ptr::null()) };
}

/// The count hook: raises the budget's error once the call on this thread
/// is past its deadline.
unsafe extern "C-unwind" fn budget_hook(state: *mut ffi::lua_State, _ar: *mut ffi::lua_Debug) {
    let budget = BUDGET.get();
    // SAFETY: BUDGET points at the Budget of the VM running on this thread
    // (set by `Watched`, which borrows it, and cleared when it ends).
    if budget.is_null() || !unsafe { (*budget).past_deadline() } {
        return;
    }
    // No Rust value with a destructor is alive here: lua_error unwinds
    // (longjmp) to the protected call.
    unsafe {
        ffi::lua_pushstring(state, c"hook exceeded its time budget".as_ptr());
        ffi::lua_error(state);
    }
}

fn arm(state: *mut ffi::lua_State) {
    // SAFETY: `state` is the main state of the VM running on this thread.
    unsafe { ffi::lua_sethook(state, Some(budget_hook), ffi::LUA_MASKCOUNT, CHECK_EVERY) };
}

/// `watch(co)`: gives a coroutine the count hook for good (the sandbox's
/// coroutine.create and coroutine.wrap call it).
pub(super) unsafe extern "C-unwind" fn watch_thread(state: *mut ffi::lua_State) -> c_int {
    // SAFETY: called by Lua with its arguments on `state`'s stack.
    unsafe {
        let co = ffi::lua_tothread(state, 1);
        if !co.is_null() {
            ffi::lua_sethook(co, Some(budget_hook), ffi::LUA_MASKCOUNT, CHECK_EVERY);
        }
    }
    0
}

/// The main thread of the Lua state `lua`.
pub(super) fn main_state(lua: &mlua::Lua) -> mlua::Result<MainState> {
    let mut main = std::ptr::null_mut();
    // SAFETY: reads the registry's main-thread entry and pops it.
    unsafe {
        lua.exec_raw::<()>((), |state| {
            ffi::lua_rawgeti(state, ffi::LUA_REGISTRYINDEX, ffi::LUA_RIDX_MAINTHREAD);
            main = ffi::lua_tothread(state, -1);
            ffi::lua_pop(state, 1);
        })?;
    }
    Ok(MainState(main))
}

/// A VM's main Lua thread, owned by its `mlua::Lua` (which is Send).
#[derive(Clone, Copy)]
pub(super) struct MainState(*mut ffi::lua_State);

// SAFETY: only used by the thread that holds the VM (see `Watched`).
unsafe impl Send for MainState {}

/// While alive, the call (or top level) on this thread is watched.
pub(super) struct Watched<'a> {
    main: MainState,
    _budget: std::marker::PhantomData<&'a Budget>,
}

impl<'a> Watched<'a> {
    /// Starts watching the call about to run on `main` (which this thread
    /// holds) under `budget`, of `timeout` in all.
    pub(super) fn start(main: MainState, budget: &'a Budget, timeout: Duration) -> Watched<'a> {
        BUDGET.set(budget);
        RUNNING.set(main.0);
        std::sync::atomic::compiler_fence(std::sync::atomic::Ordering::SeqCst);
        if !imp::started(timeout) {
            arm(main.0);
        }
        Watched {
            main,
            _budget: std::marker::PhantomData,
        }
    }
}

impl Drop for Watched<'_> {
    fn drop(&mut self) {
        imp::ended();
        RUNNING.set(std::ptr::null_mut());
        // A signal handled from here on finds no VM: the hook goes, and
        // stays gone.
        std::sync::atomic::compiler_fence(std::sync::atomic::Ordering::SeqCst);
        // SAFETY: this thread holds the VM; mask 0 removes the hook.
        unsafe { ffi::lua_sethook(self.main.0, None, 0, 0) };
        BUDGET.set(std::ptr::null());
    }
}

#[cfg(target_os = "linux")]
mod imp {
    use super::RUNNING;
    use parking_lot::{Condvar, Mutex};
    use std::cell::Cell;
    use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
    use std::sync::{Arc, OnceLock};
    use std::time::Duration;

    /// Ticks without a call before the watchdog sleeps.
    const LINGER_TICKS: u32 = 8;

    /// What one thread that runs Lua publishes.
    struct Slot {
        /// The kernel's id of the thread.
        tid: i32,
        /// `n << 1 | 1` while its n-th call runs, `n << 1` after it.
        call: AtomicU64,
        /// The tick its call wants (a quarter of its budget), in µs.
        tick_us: AtomicU64,
        /// What the watchdog saw at its last tick.
        seen: AtomicU64,
        /// Ticks the watchdog has seen the same call for.
        ticks_in_call: AtomicU32,
    }

    struct Watchdog {
        slots: Mutex<Vec<Arc<Slot>>>,
        wake: Condvar,
        sleeping: AtomicBool,
        /// Its thread runs (else calls arm the hook at their start).
        running: AtomicBool,
        signal: i32,
    }

    static WATCHDOG: OnceLock<Option<Watchdog>> = OnceLock::new();
    static SPAWN: std::sync::Once = std::sync::Once::new();

    /// This thread's slot, removed from the watchdog's list when the
    /// thread ends.
    struct Holder {
        slot: Arc<Slot>,
        calls: Cell<u64>,
    }

    impl Drop for Holder {
        fn drop(&mut self) {
            if let Some(Some(w)) = WATCHDOG.get() {
                w.slots.lock().retain(|s| !Arc::ptr_eq(s, &self.slot));
            }
        }
    }

    thread_local! {
        static HOLDER: Option<Holder> = register();
    }

    fn watchdog() -> Option<&'static Watchdog> {
        let w = WATCHDOG.get_or_init(install).as_ref()?;
        SPAWN.call_once(|| {
            let spawned = std::thread::Builder::new()
                .name("usher-hook-watch".into())
                .spawn(move || w.run());
            match spawned {
                Ok(_) => w.running.store(true, Ordering::SeqCst),
                Err(e) => tracing::warn!(
                    error = %e,
                    "hooks: no thread for the budget's watchdog; the count hook runs always"
                ),
            }
        });
        Some(w)
    }

    /// Installs the signal handler (None if that fails: calls then arm the
    /// hook at their start).
    fn install() -> Option<Watchdog> {
        let signal = libc::SIGRTMIN() + 5;
        // SAFETY: installs a handler that touches only this thread's
        // RUNNING and the Lua state it names (see `on_signal`).
        let installed = unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut()) == 0
        };
        if !installed {
            tracing::warn!(
                "hooks: no signal for the budget's watchdog; the count hook runs always"
            );
            return None;
        }
        Some(Watchdog {
            slots: Mutex::new(Vec::new()),
            wake: Condvar::new(),
            sleeping: AtomicBool::new(false),
            running: AtomicBool::new(false),
            signal,
        })
    }

    fn register() -> Option<Holder> {
        let w = watchdog()?;
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() };
        let slot = Arc::new(Slot {
            tid,
            call: AtomicU64::new(0),
            tick_us: AtomicU64::new(0),
            seen: AtomicU64::new(0),
            ticks_in_call: AtomicU32::new(0),
        });
        w.slots.lock().push(slot.clone());
        Some(Holder {
            slot,
            calls: Cell::new(0),
        })
    }

    /// The handler: arms the count hook on the VM this thread is running.
    extern "C" fn on_signal(_: libc::c_int) {
        let state = RUNNING.get();
        if !state.is_null() {
            super::arm(state);
        }
    }

    /// A call starts on this thread; false if it is not watched.
    pub(super) fn started(timeout: Duration) -> bool {
        HOLDER
            .try_with(|h| {
                let Some(h) = h else { return false };
                let Some(Some(w)) = WATCHDOG.get() else {
                    return false;
                };
                if !w.running.load(Ordering::Relaxed) {
                    return false;
                }
                let n = h.calls.get() + 1;
                h.calls.set(n);
                let tick =
                    (timeout / 4).clamp(Duration::from_millis(1), Duration::from_millis(250));
                h.slot
                    .tick_us
                    .store(tick.as_micros() as u64, Ordering::Relaxed);
                h.slot.call.store(n << 1 | 1, Ordering::SeqCst);
                if w.sleeping.load(Ordering::SeqCst) {
                    let _slots = w.slots.lock();
                    w.wake.notify_one();
                }
                true
            })
            .unwrap_or(false)
    }

    /// The call on this thread ended.
    pub(super) fn ended() {
        let _ = HOLDER.try_with(|h| {
            if let Some(h) = h {
                h.slot.call.store(h.calls.get() << 1, Ordering::SeqCst);
            }
        });
    }

    impl Watchdog {
        fn run(&self) {
            let mut slots = self.slots.lock();
            let mut tick = Duration::from_millis(25);
            let mut quiet = 0;
            loop {
                let mut active = false;
                let mut wanted: Option<u64> = None;
                for slot in slots.iter() {
                    let now = slot.call.load(Ordering::SeqCst);
                    let before = slot.seen.swap(now, Ordering::Relaxed);
                    if now & 1 == 1 {
                        active = true;
                        let t = slot.tick_us.load(Ordering::Relaxed);
                        wanted = Some(wanted.map_or(t, |w| w.min(t)));
                        let ticks = if now == before {
                            slot.ticks_in_call.load(Ordering::Relaxed) + 1
                        } else {
                            0
                        };
                        slot.ticks_in_call.store(ticks, Ordering::Relaxed);
                        // The same call as a tick ago: arm its hook. Again
                        // after 2, 4, 8... ticks, should a signal be lost,
                        // but rarely for a thread set aside in a long C
                        // call.
                        if ticks > 0 && ticks.is_power_of_two() {
                            // SAFETY: a thread of this process, alive
                            // while its slot is listed (we hold the list).
                            unsafe { libc::tgkill(libc::getpid(), slot.tid, self.signal) };
                        }
                    } else if now != before {
                        active = true;
                    }
                }
                if let Some(us) = wanted {
                    tick = Duration::from_micros(us);
                }
                quiet = if active { 0 } else { quiet + 1 };
                if quiet >= LINGER_TICKS {
                    self.sleeping.store(true, Ordering::SeqCst);
                    // A call that started before `sleeping` was seen is
                    // seen here; one after, notifies.
                    if slots.iter().all(|s| s.call.load(Ordering::SeqCst) & 1 == 0) {
                        self.wake.wait(&mut slots);
                    }
                    self.sleeping.store(false, Ordering::SeqCst);
                    quiet = 0;
                    continue;
                }
                self.wake.wait_for(&mut slots, tick);
            }
        }
    }
}

#[cfg(not(target_os = "linux"))]
mod imp {
    use std::time::Duration;

    pub(super) fn started(_timeout: Duration) -> bool {
        false
    }

    pub(super) fn ended() {}
}
