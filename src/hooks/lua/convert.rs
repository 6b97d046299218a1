//! What goes into a Lua `ctx` from Rust, and reading decisions back.

use super::vm::Vm;
use crate::auth::AuthAttempt;
use crate::config::{PoolMode, Route};
use crate::hooks::{ClientInfo, Rejection, ServerInfo, VarValue, Vars};
use crate::protocol::error::sqlstate;
use mlua::{Lua, LuaString, Table, Value};

/// The prelude's record of a call, as the call left it (read in the same
/// protected call as the call itself).
pub(super) struct Decided {
    /// state[2]: the last items, None when nothing was decided.
    pub last: Option<LuaString>,
    /// state[3] holds earlier items.
    pub chunks: bool,
}

/// What a hook call decided.
pub(super) struct Collected {
    /// The vars after the call; `None` if the hook never looked at them.
    pub vars: Option<Vars>,
    pub params: Vec<(String, String)>,
    pub exec: Vec<String>,
    pub notices: Vec<String>,
    pub reject: Option<Rejection>,
    /// ctx:route's table (client_connection).
    pub route: Option<Route>,
}

/// Appends one "<length>:<bytes>" item (see prelude.lua).
fn item(blob: &mut Vec<u8>, s: &[u8]) {
    push_uint(blob, s.len() as u64);
    blob.push(b':');
    blob.extend_from_slice(s);
}

/// Appends `n` in decimal, without the formatting machinery.
fn push_uint(blob: &mut Vec<u8>, n: u64) {
    if n < 10 {
        blob.push(b'0' + n as u8);
        return;
    }
    let mut digits = [0u8; 20];
    blob.extend_from_slice(uint(&mut digits, n));
}

/// An item holding `n` in decimal.
fn uint_item(blob: &mut Vec<u8>, n: u64) {
    let mut digits = [0u8; 20];
    item(blob, uint(&mut digits, n));
}

/// `n` in decimal, written into the end of `digits`.
fn uint(digits: &mut [u8; 20], mut n: u64) -> &[u8] {
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return &digits[i..];
        }
    }
}

/// The client's fields as the one string a ctx unpacks on first use (see
/// prelude.lua's unpack_client).
pub(super) fn client_blob(c: &ClientInfo) -> Vec<u8> {
    let startup = c.startup.packed();
    let tls = c.tls.as_ref();
    // The variable texts, and 160 bytes for the rest: 11 lengths with
    // their colons (5 bytes each), the id (10), the address (39), the port
    // (5), the method (16) and the pool mode (11).
    let texts = c.user.len()
        + c.database.len()
        + c.application_name.len()
        + tls.map_or(0, |t| {
            t.version.len() + t.cipher.len() + t.client_cert_subject.as_ref().map_or(0, String::len)
        });
    let mut blob = Vec::with_capacity(160 + texts + startup.len());
    uint_item(&mut blob, c.id.into());
    item(&mut blob, c.user.as_bytes());
    item(&mut blob, c.database.as_bytes());
    item(&mut blob, c.application_name.as_bytes());
    // `unix` for a client of the Unix-domain socket (SHOW CLIENTS' addr).
    match c.addr.ip() {
        Some(std::net::IpAddr::V4(ip)) => {
            let mut text = Vec::with_capacity(15);
            for (i, octet) in ip.octets().into_iter().enumerate() {
                if i > 0 {
                    text.push(b'.');
                }
                push_uint(&mut text, octet.into());
            }
            item(&mut blob, &text);
        }
        Some(ip) => item(&mut blob, ip.to_string().as_bytes()),
        None => item(&mut blob, crate::client_addr::UNIX_SHOWN.as_bytes()),
    }
    uint_item(&mut blob, c.addr.port().into());
    item(&mut blob, c.auth_method.as_bytes());
    item(
        &mut blob,
        match c.pool_mode {
            PoolMode::Session => b"session",
            PoolMode::Transaction => b"transaction",
        },
    );
    item(&mut blob, tls.map_or("", |t| t.version.as_str()).as_bytes());
    item(&mut blob, tls.map_or("", |t| t.cipher.as_str()).as_bytes());
    item(
        &mut blob,
        tls.and_then(|t| t.client_cert_subject.as_deref())
            .unwrap_or("")
            .as_bytes(),
    );
    blob.extend_from_slice(startup.as_bytes());
    // Bytes: Lua strings are, and the prelude splits them by length.
    blob
}

/// The client's vars as type/key/value items (see prelude.lua's
/// unpack_client); none when there are none.
pub(super) fn vars_blob(vars: &Vars) -> Option<String> {
    if vars.is_empty() {
        return None;
    }
    let mut blob = Vec::with_capacity(64);
    for (k, v) in vars {
        let (kind, text): (&[u8], std::borrow::Cow<str>) = match v {
            VarValue::Str(s) => (b"s", s.as_str().into()),
            VarValue::Int(i) => (b"i", i.to_string().into()),
            VarValue::Num(n) => (b"n", n.to_string().into()),
            VarValue::Bool(b) => (b"b", if *b { "true" } else { "false" }.into()),
        };
        item(&mut blob, kind);
        item(&mut blob, k.as_bytes());
        item(&mut blob, text.as_bytes());
    }
    String::from_utf8(blob).ok()
}

/// session_start's `server` field, as a table of ctx fields.
pub(super) fn session_fields(
    lua: &Lua,
    server: Option<&ServerInfo>,
) -> mlua::Result<Option<Table>> {
    let Some(s) = server else { return Ok(None) };
    let st = lua.create_table()?;
    st.raw_set("backend_pid", s.backend_pid)?;
    st.raw_set("server_version", s.server_version.as_str())?;
    st.raw_set("fresh", s.fresh)?;
    let fields = lua.create_table()?;
    fields.raw_set("server", st)?;
    Ok(Some(fields))
}

/// auth_attempt's ctx fields.
pub(super) fn auth_attempt_fields(lua: &Lua, a: &AuthAttempt) -> mlua::Result<Option<Table>> {
    let t = lua.create_table()?;
    t.raw_set("user", a.user.as_str())?;
    t.raw_set("user_exists", a.user_exists)?;
    t.raw_set("database", a.database.as_str())?;
    t.raw_set("client_addr", a.client_addr.shown())?;
    t.raw_set("client_port", a.client_addr.port())?;
    t.raw_set("method", a.method.as_str())?;
    t.raw_set("outcome", a.outcome.as_str())?;
    t.raw_set("success", a.outcome == crate::auth::AuthOutcome::Success)?;
    Ok(Some(t))
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

/// A record of the prelude's ctx methods being read: tag bytes, each
/// followed by its strings as string.pack's "<s4".
struct Record<'a>(&'a [u8]);

impl Record<'_> {
    fn tag(&mut self) -> Option<u8> {
        let (tag, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(*tag)
    }

    fn string(&mut self) -> mlua::Result<String> {
        let bad = || mlua::Error::runtime("truncated hook record");
        let (len, rest) = self.0.split_first_chunk::<4>().ok_or_else(bad)?;
        let len = u32::from_le_bytes(*len) as usize;
        let bytes = rest.get(..len).ok_or_else(bad)?;
        self.0 = &rest[len..];
        Ok(String::from_utf8_lossy(bytes).into_owned())
    }
}

/// What a client's vars take against `hooks.vars_max_bytes`: their keys'
/// and values' bytes (a number or boolean counts 8), summed as they are
/// read back, so that a huge value is refused before it is copied, and
/// never kept for the client's life.
struct VarsBudget {
    used: usize,
    max: usize,
}

impl VarsBudget {
    fn take(&mut self, key: usize, value: usize) -> mlua::Result<()> {
        self.used = self.used.saturating_add(key).saturating_add(value);
        if self.used > self.max {
            return Err(mlua::Error::runtime(format!(
                "ctx.vars holds more than {} bytes (hooks.vars_max_bytes); they are not kept",
                self.max
            )));
        }
        Ok(())
    }
}

/// A number's or boolean's bytes against the bound.
const SCALAR_BYTES: usize = 8;

/// Reads the decisions of the call that just ran, recorded by the
/// prelude's ctx methods (see prelude.lua's `state`). The vars, if read
/// back, must fit in `max_vars` bytes.
pub(super) fn collect(vm: &Vm, decided: Decided, max_vars: usize) -> mlua::Result<Collected> {
    let mut out = Collected {
        vars: None,
        params: Vec::new(),
        exec: Vec::new(),
        notices: Vec::new(),
        reject: None,
        route: None,
    };
    let Some(last) = decided.last else {
        return Ok(out);
    };
    let mut records = Vec::new();
    if decided.chunks {
        if let Some(chunks) = vm.state.raw_get::<Option<Table>>(3)? {
            for i in 1..=chunks.raw_len() {
                records.push(chunks.raw_get::<LuaString>(i)?);
            }
        }
    }
    records.push(last);
    for record in &records {
        let mut r = Record(&record.as_bytes());
        while let Some(tag) = r.tag() {
            match tag {
                b'S' => out.params.push((r.string()?, r.string()?)),
                b'E' => out.exec.push(r.string()?),
                b'N' => out.notices.push(r.string()?),
                b'R' => {
                    let (message, code, detail, hint) =
                        (r.string()?, r.string()?, r.string()?, r.string()?);
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
                b'T' => {
                    out.route = Some(super::ctx_route::take().ok_or_else(|| {
                        mlua::Error::runtime("ctx:route: the route was not kept")
                    })?);
                }
                b'U' => {
                    // Unpacked: ctx.vars is what the hook left (vars never
                    // unpacked were not changed: the caller keeps its own).
                    let ctx: Table = vm.state.raw_get(1)?;
                    out.vars = Some(match ctx.raw_get::<Value>(&vm.names.vars)? {
                        Value::Table(t) => read_vars(vm, &t, max_vars)?,
                        _ => Vars::new(),
                    });
                }
                other => {
                    return Err(mlua::Error::runtime(format!(
                        "unknown hook record item {other}"
                    )))
                }
            }
        }
    }
    Ok(out)
}

/// ctx.vars read back: string keys with string, integer or boolean values
/// here; anything else (a metatable, other keys, floats, which Lua's
/// tostring rounds, values that are refused) through the prelude's
/// encoder, as Lua itself would see them.
fn read_vars(vm: &Vm, t: &Table, max: usize) -> mlua::Result<Vars> {
    let mut vars = Vars::new();
    let mut budget = VarsBudget { used: 0, max };
    let mut plain = t.metatable().is_none();
    if plain {
        t.for_each::<Value, Value>(|k, v| {
            let (Value::String(k), true) = (&k, plain) else {
                plain = false;
                return Ok(());
            };
            let key = k.as_bytes().len();
            let value = match v {
                Value::String(s) => {
                    budget.take(key, s.as_bytes().len())?;
                    VarValue::Str(s.to_string_lossy())
                }
                Value::Integer(i) => {
                    budget.take(key, SCALAR_BYTES)?;
                    VarValue::Int(i)
                }
                Value::Boolean(b) => {
                    budget.take(key, SCALAR_BYTES)?;
                    VarValue::Bool(b)
                }
                _ => {
                    plain = false;
                    return Ok(());
                }
            };
            vars.insert(k.to_string_lossy(), value);
            Ok(())
        })?;
    }
    if plain {
        return Ok(vars);
    }
    let blob: LuaString = vm.encode_vars.call(t)?;
    let mut budget = VarsBudget { used: 0, max };
    let mut it = items(&blob.as_bytes())?.into_iter();
    let mut vars = Vars::new();
    while let (Some(kind), Some(key), Some(value)) = (it.next(), it.next(), it.next()) {
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
        let bytes = match &value {
            VarValue::Str(s) => s.len(),
            _ => SCALAR_BYTES,
        };
        budget.take(key.len(), bytes)?;
        vars.insert(key, value);
    }
    Ok(vars)
}
