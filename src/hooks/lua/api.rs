//! The `usher` table hooks call: log, query, shared, roles.

use super::LuaServices;
use crate::hooks::query::QueryValue;
use crate::hooks::shared::SharedValue;
use mlua::{Lua, MultiValue, Table, Value};
use std::sync::Arc;
use std::time::Duration;

pub(super) fn usher_table(lua: &Lua, services: Arc<LuaServices>) -> mlua::Result<Table> {
    let usher = lua.create_table()?;

    usher.set(
        "log",
        lua.create_function(|_, (level, message): (String, String)| {
            log(&level, &message);
            Ok(())
        })?,
    )?;
    usher.set(
        "_print",
        lua.create_function(|_, args: MultiValue| {
            let text: Vec<String> = args
                .iter()
                .map(|v| v.to_string().unwrap_or_default())
                .collect();
            log("info", &text.join("\t"));
            Ok(())
        })?,
    )?;

    let s = services.clone();
    usher.set(
        "query",
        lua.create_function(move |lua, (sql, params): (String, MultiValue)| {
            let params: Vec<Option<String>> = params
                .iter()
                .map(|v| match v {
                    Value::Nil => Ok(None),
                    Value::Boolean(b) => Ok(Some(b.to_string())),
                    Value::Integer(i) => Ok(Some(i.to_string())),
                    Value::Number(n) => Ok(Some(n.to_string())),
                    Value::String(s) => Ok(Some(s.to_str()?.to_string())),
                    other => Err(mlua::Error::runtime(format!(
                        "usher.query: parameters must be strings, numbers, booleans or nil, got {}",
                        other.type_name()
                    ))),
                })
                .collect::<mlua::Result<_>>()?;
            let query = async {
                s.query
                    .query(&sql, &params)
                    .await
                    .map_err(mlua::Error::runtime)
            };
            let rows = super::vm::await_within_budget(lua, "usher.query", query)?;
            let out = lua.create_table()?;
            for row in rows {
                let t = lua.create_table()?;
                for (name, value) in row {
                    let v = match value {
                        QueryValue::Null => Value::Nil,
                        QueryValue::Bool(b) => Value::Boolean(b),
                        QueryValue::Int(i) => Value::Integer(i),
                        QueryValue::Num(n) => Value::Number(n),
                        QueryValue::Text(s) => Value::String(lua.create_string(&s)?),
                    };
                    t.set(name, v)?;
                }
                out.push(t)?;
            }
            Ok(out)
        })?,
    )?;

    let shared = lua.create_table()?;
    let s = services.clone();
    shared.set(
        "get",
        lua.create_function(move |lua, key: String| match s.shared.get(&key) {
            None => Ok(Value::Nil),
            Some(SharedValue::Str(v)) => Ok(Value::String(lua.create_string(&v)?)),
            Some(SharedValue::Int(v)) => Ok(Value::Integer(v)),
            Some(SharedValue::Num(v)) => Ok(Value::Number(v)),
            Some(SharedValue::Bool(v)) => Ok(Value::Boolean(v)),
        })?,
    )?;
    let s = services.clone();
    shared.set(
        "set",
        lua.create_function(move |_, (key, value, ttl): (String, Value, Option<f64>)| {
            let value = match value {
                Value::String(v) => SharedValue::Str(v.to_str()?.to_string()),
                Value::Integer(v) => SharedValue::Int(v),
                Value::Number(v) => SharedValue::Num(v),
                Value::Boolean(v) => SharedValue::Bool(v),
                Value::Nil => {
                    s.shared.delete(&key);
                    return Ok(());
                }
                other => {
                    return Err(mlua::Error::runtime(format!(
                        "usher.shared.set: values must be strings, numbers or booleans, got {}",
                        other.type_name()
                    )))
                }
            };
            s.shared
                .set(&key, value, ttl_of(ttl)?)
                .map_err(mlua::Error::runtime)
        })?,
    )?;
    let s = services.clone();
    shared.set(
        "incr",
        lua.create_function(
            move |_, (key, by, ttl): (String, Option<i64>, Option<f64>)| {
                s.shared
                    .incr(&key, by.unwrap_or(1), ttl_of(ttl)?)
                    .map_err(mlua::Error::runtime)
            },
        )?,
    )?;
    let s = services.clone();
    shared.set(
        "delete",
        lua.create_function(move |_, key: String| Ok(s.shared.delete(&key)))?,
    )?;
    usher.set("shared", shared)?;

    let roles = lua.create_table()?;
    let s = services.clone();
    roles.set(
        "is_member",
        lua.create_function(move |lua, (user, role): (String, String)| {
            let graph = async { s.roles.graph(&s.query).await.map_err(mlua::Error::runtime) };
            let graph = super::vm::await_within_budget(lua, "usher.roles.is_member", graph)?;
            Ok(graph.is_member(&user, &role))
        })?,
    )?;
    usher.set("roles", roles)?;

    let reconnects = services.reconnects.clone();
    usher.set(
        "reconnects",
        lua.create_function(move |_, database: String| Ok(reconnects.of(&database)))?,
    )?;
    Ok(usher)
}

fn ttl_of(ttl: Option<f64>) -> mlua::Result<Option<Duration>> {
    match ttl {
        None => Ok(None),
        Some(t) if crate::config::usable_seconds(t, false) => Ok(Some(Duration::from_secs_f64(t))),
        Some(t) => Err(mlua::Error::runtime(format!(
            "ttl must be a positive number of seconds (at most a century), got {t}"
        ))),
    }
}

fn log(level: &str, message: &str) {
    match level {
        "debug" => tracing::debug!(target: "usher::hooks::lua", "{message}"),
        "warn" | "warning" => tracing::warn!(target: "usher::hooks::lua", "{message}"),
        "error" => tracing::error!(target: "usher::hooks::lua", "{message}"),
        _ => tracing::info!(target: "usher::hooks::lua", "{message}"),
    }
}

#[cfg(test)]
mod tests {
    use super::ttl_of;

    #[test]
    fn a_ttl_too_large_for_a_deadline_is_an_error() {
        // Like the config's seconds (see config's tests): this panicked in
        // Duration::from_secs_f64.
        assert!(ttl_of(Some(1e300)).is_err());
        assert!(ttl_of(Some(f64::NAN)).is_err());
        assert!(ttl_of(Some(0.5)).unwrap().is_some());
    }
}
