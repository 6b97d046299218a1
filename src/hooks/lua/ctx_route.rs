//! `ctx:route{...}`'s table, checked in Rust: the prelude's `Ctx:route`
//! passes it to [`read_route`], a C function that walks it on the Lua
//! stack, checks its fields and keeps the route
//! for this hook thread's call, which `convert::collect` takes when it
//! reads the call's "T" item ([`take`]). Checked and packed in Lua, or
//! read through mlua's values, the fields cost a routed login more than
//! the rest of its route.

use crate::config::{HostSpec, PoolMode, Route};
use mlua::ffi;
use std::cell::Cell;
use std::os::raw::c_int;

thread_local! {
    /// The route of the call running on this hook thread (a call and its
    /// read-back run on one thread, in one go).
    static ROUTE: Cell<Option<Route>> = const { Cell::new(None) };
    /// Why the last fields read on this thread were refused.
    static REFUSAL: Cell<String> = const { Cell::new(String::new()) };
}

/// The table's keys.
const KEYS: [&str; 8] = [
    "database",
    "host",
    "port",
    "hosts",
    "dbname",
    "user",
    "pool_size",
    "pool_mode",
];

/// The route kept by the call that just ran on this thread.
pub(super) fn take() -> Option<Route> {
    ROUTE.take()
}

/// Why the last fields were refused (the prelude's `route_refusal()`,
/// called only then).
pub(super) fn refusal() -> String {
    REFUSAL.take()
}

/// `read_route(keep, t)`: true when the table `t` is a route (kept for
/// this thread's call if `keep`), else false, with the reason for
/// [`refusal`]. Its keys are walked once (raw, as `next` walks), each
/// value read as its key comes.
pub(super) unsafe extern "C-unwind" fn read_route(state: *mut ffi::lua_State) -> c_int {
    // SAFETY: called by Lua with its arguments on `state`'s stack. Nothing
    // here raises a Lua error: lua_next walks a table nobody changes
    // meanwhile, strings are only read where they are strings (no
    // conversion, no allocation by Lua), the walk holds two values at a
    // time and a list's rawgeti one more (a C function has LUA_MINSTACK
    // slots), and lua_pushboolean does not allocate.
    unsafe {
        let keep = ffi::lua_toboolean(state, 1) != 0;
        let ok = match fields(state, 2).and_then(read) {
            Ok(route) => {
                if keep {
                    ROUTE.set(Some(route));
                }
                true
            }
            Err(why) => {
                REFUSAL.set(why);
                false
            }
        };
        ffi::lua_settop(state, 2);
        ffi::lua_pushboolean(state, ok as c_int);
    }
    1
}

/// The fields of the table at `index`, by [`KEYS`]' index; a key that is
/// not one of them is an error, and so is anything but a table.
///
/// # Safety
/// `state` is a running C function's, with `index` in its frame and two
/// free stack slots above its top (three with a list of hosts).
unsafe fn fields(state: *mut ffi::lua_State, index: c_int) -> Result<[Field; 8], String> {
    // SAFETY: see the function's contract.
    unsafe {
        if ffi::lua_type(state, index) != ffi::LUA_TTABLE {
            return Err("ctx:route: expected a table".into());
        }
        let mut f: [Field; 8] = std::array::from_fn(|_| Field::Nil);
        ffi::lua_pushnil(state);
        while ffi::lua_next(state, index) != 0 {
            // key at -2, value at -1
            let i = match ffi::lua_type(state, -2) {
                ffi::LUA_TSTRING => {
                    let mut len = 0;
                    let p = ffi::lua_tolstring(state, -2, &mut len);
                    let key = std::slice::from_raw_parts(p.cast::<u8>(), len);
                    KEYS.iter().position(|k| k.as_bytes() == key)
                }
                _ => None,
            };
            let Some(i) = i else {
                let key = shown_key(state, -2);
                ffi::lua_settop(state, -3);
                return Err(format!("ctx:route: unknown key {key}"));
            };
            f[i] = if i == 3 {
                Field::List(list(state, ffi::lua_gettop(state)))
            } else {
                field(state, -1)
            };
            ffi::lua_settop(state, -2);
        }
        Ok(f)
    }
}

/// A key that is not one of [`KEYS`], for the error (as tostring shows a
/// number; anything else by its type).
///
/// # Safety
/// As [`field`].
unsafe fn shown_key(state: *mut ffi::lua_State, index: c_int) -> String {
    // SAFETY: see the function's contract.
    unsafe {
        match field(state, index) {
            Field::Str(s) => s,
            Field::Int(n) => n.to_string(),
            Field::Num(x) => x.to_string(),
            _ => {
                let name = ffi::lua_typename(state, ffi::lua_type(state, index));
                std::ffi::CStr::from_ptr(name)
                    .to_string_lossy()
                    .into_owned()
            }
        }
    }
}

/// One argument, as read off the stack.
enum Field {
    Nil,
    Str(String),
    Int(i64),
    Num(f64),
    /// `hosts`: a table's strings (None: not a table, or not a non-empty
    /// list of non-empty strings without a comma).
    List(Option<Vec<String>>),
    Other,
}

/// The value at `index` of the stack.
///
/// # Safety
/// `state` is a running C function's, with `index` in its frame or past it.
unsafe fn field(state: *mut ffi::lua_State, index: c_int) -> Field {
    // SAFETY: see the function's contract.
    unsafe {
        match ffi::lua_type(state, index) {
            ffi::LUA_TNIL | ffi::LUA_TNONE => Field::Nil,
            ffi::LUA_TSTRING => Field::Str(string_at(state, index)),
            ffi::LUA_TNUMBER if ffi::lua_isinteger(state, index) != 0 => {
                Field::Int(ffi::lua_tointegerx(state, index, std::ptr::null_mut()))
            }
            ffi::LUA_TNUMBER => Field::Num(ffi::lua_tonumberx(state, index, std::ptr::null_mut())),
            _ => Field::Other,
        }
    }
}

/// The string at `index` (which is a string), lossily as UTF-8.
///
/// # Safety
/// As [`field`], and the value at `index` is a string.
unsafe fn string_at(state: *mut ffi::lua_State, index: c_int) -> String {
    let mut len = 0;
    // SAFETY: a string's bytes, valid while it is on the stack.
    let bytes = unsafe {
        let p = ffi::lua_tolstring(state, index, &mut len);
        std::slice::from_raw_parts(p.cast::<u8>(), len)
    };
    String::from_utf8_lossy(bytes).into_owned()
}

/// The fields as a route, or why not (the messages of the Lua checks they
/// replace).
fn read(mut f: [Field; 8]) -> Result<Route, String> {
    let host = string(&mut f, 1)?;
    let hosts = match std::mem::replace(&mut f[3], Field::Nil) {
        Field::Nil => match host {
            Some(h) if h.contains(',') => {
                return Err("ctx:route: host must be one host (use hosts for a list)".into())
            }
            Some(h) => vec![h],
            None => Vec::new(),
        },
        _ if host.is_some() => return Err("ctx:route: host and hosts are exclusive".into()),
        Field::List(Some(hosts)) => hosts,
        _ => return Err("ctx:route: hosts must be a non-empty list of strings".into()),
    };
    let pool_mode = match string(&mut f, 7)?.as_deref() {
        None => None,
        Some("session") => Some(PoolMode::Session),
        Some("transaction") => Some(PoolMode::Transaction),
        Some(_) => return Err("ctx:route: pool_mode must be session or transaction".into()),
    };
    let database = string(&mut f, 0)?;
    let port = integer(&f, 2, 65535)?.map(|p| p as u16);
    let dbname = string(&mut f, 4)?;
    let user = string(&mut f, 5)?;
    let pool_size = integer(&f, 6, 100_000)?.map(|n| n as usize);
    let hosts = hosts
        .into_iter()
        .map(HostSpec::try_from)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("ctx:route: host: {e}"))?;
    Ok(Route {
        database,
        hosts,
        port,
        dbname,
        user,
        pool_size,
        pool_mode,
    })
}

/// The strings of the list at `index` (raw: its sequence as `#` sees it
/// without metamethods), or None if it is not a table, is empty or holds
/// anything but non-empty strings without a comma.
///
/// # Safety
/// As [`field`], with a free stack slot.
unsafe fn list(state: *mut ffi::lua_State, index: c_int) -> Option<Vec<String>> {
    // SAFETY: see the function's contract; each value pushed is popped.
    unsafe {
        if ffi::lua_type(state, index) != ffi::LUA_TTABLE {
            return None;
        }
        let n = ffi::lua_rawlen(state, index);
        if n == 0 {
            return None;
        }
        let mut hosts = Vec::with_capacity(n.min(16));
        for i in 1..=n {
            let h = match ffi::lua_rawgeti(state, index, i as ffi::lua_Integer) {
                ffi::LUA_TSTRING => Some(string_at(state, -1)),
                _ => None,
            };
            ffi::lua_settop(state, -2);
            match h {
                Some(h) if !h.is_empty() && !h.contains(',') => hosts.push(h),
                _ => return None,
            }
        }
        Some(hosts)
    }
}

/// A string field: absent, or a non-empty string (taken out of `f`).
fn string(f: &mut [Field; 8], i: usize) -> Result<Option<String>, String> {
    match std::mem::replace(&mut f[i], Field::Nil) {
        Field::Nil => Ok(None),
        Field::Str(s) if !s.is_empty() => Ok(Some(s)),
        _ => Err(format!("ctx:route: {} must be a non-empty string", KEYS[i])),
    }
}

/// An integer field from 1 to `max` (a float with an integer value too, as
/// math.tointeger takes it).
fn integer(f: &[Field; 8], i: usize, max: i64) -> Result<Option<i64>, String> {
    let n = match f[i] {
        Field::Nil => return Ok(None),
        Field::Int(n) => Some(n),
        Field::Num(x) if x.fract() == 0.0 && x.abs() < 9.0e15 => Some(x as i64),
        _ => None,
    };
    match n {
        Some(n) if (1..=max).contains(&n) => Ok(Some(n)),
        _ => Err(format!(
            "ctx:route: {} must be an integer from 1 to {max}",
            KEYS[i]
        )),
    }
}
