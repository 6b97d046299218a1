-- Loaded into every hook VM before the hook files: the methods of `ctx`
-- and `run`, through which the engine calls every handler. Its arguments
-- are the engine's reader of ctx:route's fields and the reason for its
-- last refusal (ctx_route.rs).
local read_route, route_refusal = ...
local Ctx = {}

-- The plumbing, as upvalues: no lookup in the (large) global table per
-- use, and a hook that replaces a global cannot break the engine. (The
-- conversions hooks see, tostring, stay globals, as they always were.)
local rawget, rawset, setmetatable, type, next, error = rawget, rawset, setmetatable, type, next, error
local pack = string.pack

-- The call in progress: [1] its ctx; [2] what it decided so far, false
-- for nothing: one string of items, each a tag byte and its strings
-- (string.pack "<s4": a 4-byte little-endian length, the bytes): "S" name
-- value (ctx:set), "E" sql (ctx:exec), "N" message (ctx:notice), "R"
-- message sqlstate detail hint ("" when absent; the last one counts), "T"
-- (ctx:route: the engine holds the route; [4] is true once routed), "U"
-- (the client fields were unpacked, so ctx.vars is to be read back). The
-- engine reads [2] after the call (and [3], earlier items of a long
-- record), and the ctx only after a "U". A ctx kept past its call decides
-- nothing.
local state = {}

--- Appends items to state[2], moving a long one to the list state[3]
--- first (so that many decisions cost no more than their size).
local function record(items)
  local decided = state[2]
  if decided and #decided > 1024 then
    local chunks = state[3]
    if chunks == nil then
      chunks = {}
      state[3] = chunks
    end
    chunks[#chunks + 1] = decided
    decided = false
  end
  state[2] = (decided or "") .. items
end

local function allowed_in(ctx, what, first, second)
  local event = ctx.event
  if event == first or (second ~= nil and event == second) then return end
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
  message = tostring(message)
  sqlstate = sqlstate or ""
  local detail = opts.detail and tostring(opts.detail) or ""
  local hint = opts.hint and tostring(opts.hint) or ""
  if state[1] ~= self then return end
  record(pack("<Bs4s4s4s4", 82, message, sqlstate, detail, hint))
end

--- Set a session parameter, applied on every server connection the session uses.
function Ctx:set(name, value)
  allowed_in(self, "ctx:set", "client_connection", "session_start")
  name = tostring(name)
  value = tostring(value)
  if state[1] ~= self then return end
  record(pack("<Bs4s4", 83, name, value))
end

--- Run a statement on the session's server connection (session mode, session_start).
function Ctx:exec(sql)
  allowed_in(self, "ctx:exec", "session_start")
  if self.pool_mode ~= "session" then
    error("ctx:exec is only available in session mode", 2)
  end
  sql = tostring(sql)
  if state[1] ~= self then return end
  record(pack("<Bs4", 69, sql))
end

--- Send this client's session to another server (client_connection, at
--- most once per client): a table of database (the base entry), host,
--- port, hosts, dbname, user (the server role), pool_size, pool_mode.
--- The table is checked by the engine (read_route), which keeps the route
--- when this ctx's call is in progress: the "T" item says so.
function Ctx:route(t)
  if self.event ~= "client_connection" then allowed_in(self, "ctx:route", "client_connection") end
  local mine = state[1] == self
  if not read_route(mine and not state[4], t) then error(route_refusal(), 2) end
  if not mine then return end
  if state[4] then error("ctx:route may be called once per client", 2) end
  state[4] = true
  record("T")
end

--- Send the client a NOTICE.
function Ctx:notice(message)
  allowed_in(self, "ctx:notice", "client_connection", "session_start")
  message = tostring(message)
  if state[1] ~= self then return end
  record(pack("<Bs4", 78, message))
end

-- A ctx's client fields go in as one string, built by the engine: a list
-- of "<length>:<bytes>" items, then the startup parameters as on the wire
-- ("name\0value\0" pairs); its vars as another (nil when there are none).
-- They are unpacked on first use: a hook that never looks at them (or an
-- event without a client) pays nothing for them.

local find, sub, gmatch, tointeger = string.find, string.sub, string.gmatch, math.tointeger

--- Fills a ctx's client fields from its blobs. The client blob's items
--- are: id, user, database, application_name, client_addr, client_port,
--- auth_method, pool_mode, tls version, cipher, client certificate subject
--- ("" when absent); the startup parameters follow. The vars blob holds
--- type/key/value triples (type "s", "i", "n" or "b").
local function unpack_client(ctx, blob, varblob)
  local a, n, pos = {}, 0, 1
  while n < 11 do
    local colon = find(blob, ":", pos, true)
    local len = tonumber(sub(blob, pos, colon - 1))
    n = n + 1
    a[n] = sub(blob, colon + 1, colon + len)
    pos = colon + len + 1
  end
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
  for k, v in gmatch(sub(blob, pos), "([^\0]*)\0([^\0]*)\0") do startup[k] = v end
  if varblob ~= nil then
    local v, m = {}, 0
    pos = 1
    while pos <= #varblob do
      local colon = find(varblob, ":", pos, true)
      local len = tonumber(sub(varblob, pos, colon - 1))
      m = m + 1
      v[m] = sub(varblob, colon + 1, colon + len)
      pos = colon + len + 1
    end
    for i = 1, m, 3 do
      local kind, key, value = v[i], v[i + 1], v[i + 2]
      if kind == "i" then value = tointeger(tonumber(value))
      elseif kind == "n" then value = tonumber(value)
      elseif kind == "b" then value = value == "true" end
      vars[key] = value
    end
  end
  rawset(ctx, "startup", startup)
  rawset(ctx, "vars", vars)
end

Ctx.__index = function(ctx, key)
  local method = Ctx[key]
  if method ~= nil then return method end
  local blob = rawget(ctx, "_blob")
  if blob == nil then return nil end
  local varblob = rawget(ctx, "_vars")
  rawset(ctx, "_blob", nil)
  rawset(ctx, "_vars", nil)
  if state[1] == ctx then record("U") end
  unpack_client(ctx, blob, varblob)
  return rawget(ctx, key)
end

-- What run returns when the file has no handler for the event (any more:
-- a hook may replace its globals).
local no_handler = {}

--- Calls the handler of `event` in the file environment `env` with a
--- fresh ctx: `reason` is session_start's, `fields` a table of further
--- fields (or nil), `varblob` and `blob` hold the client's vars and fields
--- (nil for no vars, and for an event without a client; the blob last, as
--- the engine pushes it itself). A tail
--- call: the handler's stack levels are those of a direct call from the
--- engine.
local function run(env, event, reason, fields, varblob, blob)
  local handler = rawget(env, event)
  if type(handler) ~= "function" then return no_handler end
  local ctx = setmetatable({ event = event, reason = reason, _blob = blob, _vars = varblob }, Ctx)
  if fields ~= nil then
    for k, v in next, fields do rawset(ctx, k, v) end
  end
  state[1], state[2], state[3], state[4] = ctx, false, nil, nil
  return handler(ctx)
end

--- The vars as one blob of type/key/value items, for vars the engine does
--- not read itself (a metatable, keys other than strings, values other
--- than strings, integers and booleans).
local function encode_vars(vars)
  local parts, n = {}, 0
  local function add(...)
    for i = 1, select("#", ...) do
      local s = tostring((select(i, ...)))
      n = n + 1
      parts[n] = #s .. ":" .. s
    end
  end
  for k, v in pairs(vars) do
    local t = type(v)
    if t == "string" then add("s", k, v)
    elseif math.type(v) == "integer" then add("i", k, v)
    elseif t == "number" then add("n", k, v)
    elseif t == "boolean" then add("b", k, v)
    else error("ctx.vars." .. tostring(k) .. ": only strings, numbers and booleans are kept, got " .. t, 0) end
  end
  return table.concat(parts)
end

return Ctx, state, run, encode_vars, no_handler
