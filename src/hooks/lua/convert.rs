//! Building the Lua `ctx` table from Rust, and reading decisions back.

use super::vm::Vm;
use crate::auth::AuthAttempt;
use crate::hooks::{ClientInfo, Event, Rejection, ServerInfo, SessionReason, VarValue, Vars};
use crate::protocol::error::sqlstate;
use mlua::{Lua, Table};

/// What a hook call decided.
pub(super) struct Collected {
    /// The vars after the call; `None` if the hook never looked at them.
    pub vars: Option<Vars>,
    pub params: Vec<(String, String)>,
    pub exec: Vec<String>,
    pub notices: Vec<String>,
    pub reject: Option<Rejection>,
}

/// Appends one "<length>:<bytes>" item (see prelude.lua).
fn item(blob: &mut String, s: &str) {
    use std::fmt::Write;
    let _ = write!(blob, "{}:{s}", s.len());
}

/// A fresh ctx table for `event`, with the client's fields when there is a
/// client, built by the prelude from one string.
pub(super) fn new_ctx(
    vm: &Vm,
    event: Event,
    client: Option<(&ClientInfo, &Vars)>,
    reason: Option<SessionReason>,
) -> mlua::Result<Table> {
    let mut blob = String::with_capacity(256);
    if let Some((c, vars)) = client {
        let tls = c.tls.as_ref();
        for s in [
            c.id.to_string().as_str(),
            &c.user,
            &c.database,
            &c.application_name,
            &c.addr.ip().to_string(),
            &c.addr.port().to_string(),
            c.auth_method,
            &c.pool_mode.to_string(),
            tls.map_or("", |t| t.version.as_str()),
            tls.map_or("", |t| t.cipher.as_str()),
            tls.and_then(|t| t.client_cert_subject.as_deref())
                .unwrap_or(""),
            &c.startup.len().to_string(),
        ] {
            item(&mut blob, s);
        }
        for (k, v) in c.startup.iter() {
            item(&mut blob, k);
            item(&mut blob, v);
        }
        for (k, v) in vars {
            let (kind, value) = match v {
                VarValue::Str(s) => ("s", s.clone()),
                VarValue::Int(i) => ("i", i.to_string()),
                VarValue::Num(n) => ("n", n.to_string()),
                VarValue::Bool(b) => ("b", b.to_string()),
            };
            item(&mut blob, kind);
            item(&mut blob, k);
            item(&mut blob, &value);
        }
    }
    vm.ctx_build
        .call((event.name(), blob, reason.map(SessionReason::as_str)))
}

pub(super) fn fill_session(lua: &Lua, t: &Table, server: Option<&ServerInfo>) -> mlua::Result<()> {
    if let Some(s) = server {
        let st = lua.create_table()?;
        st.raw_set("backend_pid", s.backend_pid)?;
        st.raw_set("server_version", s.server_version.as_str())?;
        st.raw_set("fresh", s.fresh)?;
        t.raw_set("server", st)?;
    }
    Ok(())
}

pub(super) fn fill_auth_attempt(_lua: &Lua, t: &Table, a: &AuthAttempt) -> mlua::Result<()> {
    t.raw_set("user", a.user.as_str())?;
    t.raw_set("user_exists", a.user_exists)?;
    t.raw_set("database", a.database.as_str())?;
    t.raw_set("client_addr", a.client_addr.ip().to_string())?;
    t.raw_set("client_port", a.client_addr.port())?;
    t.raw_set("method", a.method.as_str())?;
    t.raw_set("outcome", a.outcome.as_str())?;
    t.raw_set("success", a.outcome == crate::auth::AuthOutcome::Success)?;
    Ok(())
}

/// Splits a blob of "<length>:<bytes>" items.
fn items(blob: &[u8]) -> mlua::Result<Vec<String>> {
    let bad = || mlua::Error::runtime("malformed hook summary");
    let mut out = Vec::new();
    let mut pos = 0;
    while pos < blob.len() {
        let colon = pos
            + blob[pos..]
                .iter()
                .position(|b| *b == b':')
                .ok_or_else(bad)?;
        let len: usize = std::str::from_utf8(&blob[pos..colon])
            .ok()
            .and_then(|l| l.parse().ok())
            .ok_or_else(bad)?;
        let end = colon + 1 + len;
        let bytes = blob.get(colon + 1..end).ok_or_else(bad)?;
        out.push(String::from_utf8_lossy(bytes).into_owned());
        pos = end;
    }
    Ok(out)
}

/// Reads the decisions out of a ctx after a call (summarized by the prelude).
pub(super) fn collect(vm: &Vm, t: &Table) -> mlua::Result<Collected> {
    let blob: mlua::LuaString = vm.ctx_summarize.call(t)?;
    let items = items(&blob.as_bytes())?;
    let mut out = Collected {
        vars: Some(Vars::new()),
        params: Vec::new(),
        exec: Vec::new(),
        notices: Vec::new(),
        reject: None,
    };
    let mut it = items.into_iter();
    let mut next = || {
        it.next()
            .ok_or_else(|| mlua::Error::runtime("truncated hook summary"))
    };
    loop {
        let tag = match next() {
            Ok(tag) => tag,
            Err(_) => break,
        };
        match tag.as_str() {
            "S" => out.params.push((next()?, next()?)),
            "E" => out.exec.push(next()?),
            "N" => out.notices.push(next()?),
            "R" => {
                let (message, code, detail, hint) = (next()?, next()?, next()?, next()?);
                let some = |s: String| (!s.is_empty()).then_some(s);
                out.reject = Some(Rejection {
                    message,
                    sqlstate: some(code)
                        .unwrap_or_else(|| sqlstate::INVALID_AUTHORIZATION.to_string()),
                    detail: some(detail),
                    hint: some(hint),
                    hook: String::new(),
                });
            }
            "K" => out.vars = None,
            "V" => {
                let (kind, key, value) = (next()?, next()?, next()?);
                let value = match kind.as_str() {
                    "i" => VarValue::Int(
                        value
                            .parse()
                            .map_err(|_| mlua::Error::runtime("bad integer"))?,
                    ),
                    "n" => VarValue::Num(
                        value
                            .parse()
                            .map_err(|_| mlua::Error::runtime("bad number"))?,
                    ),
                    "b" => VarValue::Bool(value == "true"),
                    _ => VarValue::Str(value),
                };
                if let Some(vars) = out.vars.as_mut() {
                    vars.insert(key, value);
                }
            }
            other => {
                return Err(mlua::Error::runtime(format!(
                    "unknown hook summary item {other}"
                )))
            }
        }
    }
    Ok(out)
}
