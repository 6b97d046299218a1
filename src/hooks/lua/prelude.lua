-- Loaded into every hook VM before the hook files: the methods of `ctx`.
-- Results are collected in fields the engine reads back after each call.
local Ctx = {}
Ctx.__index = Ctx

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

return Ctx
