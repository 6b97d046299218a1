-- Loaded into every hook VM before the hook files: the methods of `ctx`.
-- Results are collected in fields the engine reads back after each call.
local Ctx = {}

local function allowed_in(ctx, what, ...)
  for _, event in ipairs({ ... }) do
    if ctx.event == event then return end
  end
  error(what .. " is not available in " .. ctx.event, 3)
end

--- Refuse the client (client_connection only).
function Ctx:reject(message, opts)
  allowed_in(self, "ctx:reject", "client_connection")
  opts = opts or {}
  local sqlstate = opts.sqlstate and tostring(opts.sqlstate) or nil
  if sqlstate and not sqlstate:match("^[0-9A-Z][0-9A-Z][0-9A-Z][0-9A-Z][0-9A-Z]$") then
    error("ctx:reject: sqlstate must be five characters 0-9/A-Z, got " .. sqlstate, 2)
  end
  rawset(self, "_reject", {
    message = tostring(message),
    sqlstate = sqlstate,
    detail = opts.detail and tostring(opts.detail) or nil,
    hint = opts.hint and tostring(opts.hint) or nil,
  })
end

--- Set a session parameter, applied on every server connection the session uses.
function Ctx:set(name, value)
  allowed_in(self, "ctx:set", "client_connection", "session_start")
  table.insert(self._set, { tostring(name), tostring(value) })
end

--- Run a statement on the session's server connection (session mode, session_start).
function Ctx:exec(sql)
  allowed_in(self, "ctx:exec", "session_start")
  if self.pool_mode ~= "session" then
    error("ctx:exec is only available in session mode", 2)
  end
  table.insert(self._exec, tostring(sql))
end

--- Send the client a NOTICE.
function Ctx:notice(message)
  allowed_in(self, "ctx:notice", "client_connection", "session_start")
  table.insert(self._notices, tostring(message))
end

-- Crossing between Rust and Lua costs a protected call per value, so a
-- ctx goes in, and the decisions come out, as one string each: a list of
-- "<length>:<bytes>" items.

local function decode(blob)
  local out, n, pos = {}, 0, 1
  while pos <= #blob do
    local colon = string.find(blob, ":", pos, true)
    local len = tonumber(string.sub(blob, pos, colon - 1))
    n = n + 1
    out[n] = string.sub(blob, colon + 1, colon + len)
    pos = colon + len + 1
  end
  return out, n
end

--- Fills a ctx's client fields from its blob. The blob holds: id, user,
--- database, application_name, client_addr, client_port, auth_method,
--- pool_mode, tls version, cipher, client certificate subject ("" when
--- absent), the number of startup parameters, their key/value pairs, then
--- the vars as type/key/value triples (type "s", "i", "n" or "b").
local function unpack_client(ctx, blob)
  local a, n = decode(blob)
  rawset(ctx, "id", tonumber(a[1]))
  rawset(ctx, "user", a[2])
  rawset(ctx, "database", a[3])
  rawset(ctx, "application_name", a[4])
  rawset(ctx, "client_addr", a[5])
  rawset(ctx, "client_port", tonumber(a[6]))
  rawset(ctx, "auth_method", a[7])
  rawset(ctx, "pool_mode", a[8])
  if a[9] ~= "" then
    rawset(ctx, "tls", { version = a[9], cipher = a[10], client_cert_subject = a[11] ~= "" and a[11] or nil })
  end
  local startup, vars = {}, {}
  local last = 12 + tonumber(a[12]) * 2
  for i = 13, last, 2 do startup[a[i]] = a[i + 1] end
  for i = last + 1, n, 3 do
    local kind, key, value = a[i], a[i + 1], a[i + 2]
    if kind == "i" then value = math.tointeger(tonumber(value))
    elseif kind == "n" then value = tonumber(value)
    elseif kind == "b" then value = value == "true" end
    vars[key] = value
  end
  rawset(ctx, "startup", startup)
  rawset(ctx, "vars", vars)
end

-- A ctx unpacks its client fields on first use: a hook that never looks
-- at them (or an event without a client) pays nothing for them.
Ctx.__index = function(ctx, key)
  local method = Ctx[key]
  if method ~= nil then return method end
  local blob = rawget(ctx, "_blob")
  if blob == nil then return nil end
  rawset(ctx, "_blob", nil)
  unpack_client(ctx, blob)
  return rawget(ctx, key)
end

--- Builds a ctx; an empty blob means an event without a client. `reason`
--- is session_start's (nil for other events).
local function build(event, blob, reason)
  return setmetatable({ event = event, reason = reason, _set = {}, _exec = {}, _notices = {},
                        _blob = blob ~= "" and blob or nil }, Ctx)
end

--- What the hook decided, as one blob of tagged items: "S" name value
--- (ctx:set), "E" sql, "N" notice, "R" message sqlstate detail hint (""
--- when absent), "V" type key value (ctx.vars), "K" (vars untouched: keep
--- them).
local function summarize(ctx)
  local parts, n = {}, 0
  local function add(...)
    for i = 1, select("#", ...) do
      local s = tostring((select(i, ...)))
      n = n + 1
      parts[n] = #s .. ":" .. s
    end
  end
  for _, p in ipairs(ctx._set) do add("S", p[1], p[2]) end
  for _, s in ipairs(ctx._exec) do add("E", s) end
  for _, s in ipairs(ctx._notices) do add("N", s) end
  local r = rawget(ctx, "_reject")
  if r then add("R", r.message, r.sqlstate or "", r.detail or "", r.hint or "") end
  -- Vars never unpacked were not changed: the caller keeps its own.
  if rawget(ctx, "_blob") ~= nil then add("K") end
  local vars = rawget(ctx, "vars")
  if type(vars) == "table" then
    for k, v in pairs(vars) do
      local t = type(v)
      if t == "string" then add("V", "s", k, v)
      elseif math.type(v) == "integer" then add("V", "i", k, v)
      elseif t == "number" then add("V", "n", k, v)
      elseif t == "boolean" then add("V", "b", k, v)
      else error("ctx.vars." .. tostring(k) .. ": only strings, numbers and booleans are kept, got " .. t, 0) end
    end
  end
  return table.concat(parts)
end

return Ctx, build, summarize
