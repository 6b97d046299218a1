//! Building the Lua `ctx` table from Rust, and reading decisions back.

use super::vm::Vm;
use crate::auth::AuthAttempt;
use crate::hooks::{ClientInfo, Event, Rejection, ServerInfo, SessionReason, VarValue, Vars};
use crate::protocol::error::sqlstate;
use mlua::{Lua, Table, Value};

/// What a hook call decided.
pub(super) struct Collected {
    pub vars: Vars,
    pub params: Vec<(String, String)>,
    pub exec: Vec<String>,
    pub notices: Vec<String>,
    pub reject: Option<Rejection>,
}

/// A fresh ctx table for `event`, with the collecting fields and methods.
pub(super) fn new_ctx(vm: &Vm, event: Event) -> mlua::Result<Table> {
    let lua = &vm.lua;
    let ctx = lua.create_table()?;
    ctx.set("event", event.name())?;
    ctx.set("_set", lua.create_table()?)?;
    ctx.set("_exec", lua.create_table()?)?;
    ctx.set("_notices", lua.create_table()?)?;
    ctx.set_metatable(Some(vm.ctx_meta.clone()))?;
    Ok(ctx)
}

pub(super) fn fill_client(lua: &Lua, t: &Table, c: &ClientInfo, vars: &Vars) -> mlua::Result<()> {
    t.set("id", c.id)?;
    t.set("user", c.user.as_str())?;
    t.set("database", c.database.as_str())?;
    t.set("application_name", c.application_name.as_str())?;
    let startup = lua.create_table()?;
    for (k, v) in &c.startup {
        startup.set(k.as_str(), v.as_str())?;
    }
    t.set("startup", startup)?;
    t.set("client_addr", c.addr.ip().to_string())?;
    t.set("client_port", c.addr.port())?;
    if let Some(tls) = &c.tls {
        let tt = lua.create_table()?;
        tt.set("version", tls.version.as_str())?;
        tt.set("cipher", tls.cipher.as_str())?;
        tt.set("client_cert_subject", tls.client_cert_subject.as_deref())?;
        t.set("tls", tt)?;
    }
    t.set("auth_method", c.auth_method.as_str())?;
    t.set("pool_mode", c.pool_mode.to_string())?;
    let vt = lua.create_table()?;
    for (k, v) in vars {
        match v {
            VarValue::Str(s) => vt.set(k.as_str(), s.as_str())?,
            VarValue::Int(i) => vt.set(k.as_str(), *i)?,
            VarValue::Num(n) => vt.set(k.as_str(), *n)?,
            VarValue::Bool(b) => vt.set(k.as_str(), *b)?,
        }
    }
    t.set("vars", vt)?;
    Ok(())
}

pub(super) fn fill_session(
    lua: &Lua,
    t: &Table,
    reason: SessionReason,
    server: Option<&ServerInfo>,
) -> mlua::Result<()> {
    t.set("reason", reason.as_str())?;
    if let Some(s) = server {
        let st = lua.create_table()?;
        st.set("backend_pid", s.backend_pid)?;
        st.set("server_version", s.server_version.as_str())?;
        st.set("fresh", s.fresh)?;
        t.set("server", st)?;
    }
    Ok(())
}

pub(super) fn fill_auth_attempt(_lua: &Lua, t: &Table, a: &AuthAttempt) -> mlua::Result<()> {
    t.set("user", a.user.as_str())?;
    t.set("user_exists", a.user_exists)?;
    t.set("database", a.database.as_str())?;
    t.set("client_addr", a.client_addr.ip().to_string())?;
    t.set("client_port", a.client_addr.port())?;
    t.set("method", a.method.as_str())?;
    t.set("outcome", a.outcome.as_str())?;
    t.set("success", a.outcome == crate::auth::AuthOutcome::Success)?;
    Ok(())
}

/// Reads the decisions out of a ctx after a call.
pub(super) fn collect(t: &Table) -> mlua::Result<Collected> {
    let mut vars = Vars::new();
    if let Ok(vt) = t.get::<Table>("vars") {
        for pair in vt.pairs::<String, Value>() {
            let (k, v) = pair?;
            let v = match v {
                Value::String(s) => VarValue::Str(s.to_str()?.to_string()),
                Value::Integer(i) => VarValue::Int(i),
                Value::Number(n) => VarValue::Num(n),
                Value::Boolean(b) => VarValue::Bool(b),
                other => {
                    return Err(mlua::Error::runtime(format!(
                        "ctx.vars.{k}: only strings, numbers and booleans are kept, got {}",
                        other.type_name()
                    )))
                }
            };
            vars.insert(k, v);
        }
    }
    let pairs = |field: &str| -> mlua::Result<Vec<(String, String)>> {
        let list: Table = t.get(field)?;
        list.sequence_values::<Table>()
            .map(|p| {
                let p = p?;
                Ok((p.get(1)?, p.get(2)?))
            })
            .collect()
    };
    let strings = |field: &str| -> mlua::Result<Vec<String>> {
        let list: Table = t.get(field)?;
        list.sequence_values::<String>().collect()
    };
    let reject = match t.raw_get::<Value>("_reject")? {
        Value::Table(r) => Some(Rejection {
            message: r.get("message")?,
            sqlstate: r
                .get::<Option<String>>("sqlstate")?
                .unwrap_or_else(|| sqlstate::INVALID_AUTHORIZATION.to_string()),
            detail: r.get("detail")?,
            hint: r.get("hint")?,
            hook: String::new(),
        }),
        _ => None,
    };
    Ok(Collected {
        vars,
        params: pairs("_set")?,
        exec: strings("_exec")?,
        notices: strings("_notices")?,
        reject,
    })
}
